"""Entry point: `python run.py --model tinyllama --ticks 10000` (see `python run.py --help`)."""

import signal
import sys

if __name__ == "__main__":
    interrupted = []

    def _interrupt(number, frame):  # importing torch takes seconds: a Ctrl-C then is a clean stop too
        interrupted.append(number)
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # a background job that ignores Ctrl-C keeps ignoring it
        signal.signal(signal.SIGINT, _interrupt)
    try:
        from positronic.cli import entry
    except BaseException:
        # a KeyboardInterrupt raised inside a library's import can come out as another error
        # (numpy's lazy attributes, then transformers' import wrapper): the Ctrl-C is what happened
        if interrupted:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        raise
    signal.signal(signal.SIGINT, previous)
    entry()

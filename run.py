"""Entry point: `python run.py --model tinyllama --ticks 10000` (see `python run.py --help`)."""

import signal
import sys

if __name__ == "__main__":
    # Importing torch and transformers takes seconds. A Ctrl-C then must be a clean stop, but
    # an exception raised inside a library's import can surface as another error (numpy's lazy
    # attributes under transformers' import wrapper gave a traceback) or abort native code, so
    # the imports are not interrupted: the Ctrl-C is noted and the command ends as they finish.
    interrupted = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # a background job that ignores Ctrl-C keeps ignoring it
        signal.signal(signal.SIGINT, lambda number, frame: interrupted.append(number))
    from positronic.cli import entry

    if interrupted:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, previous)
    entry()

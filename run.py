"""Entry point: `python run.py --model tinyllama --ticks 10000` (see `python run.py --help`)."""

import sys

if __name__ == "__main__":
    try:  # importing torch takes seconds: a Ctrl-C then is a clean stop too, not a traceback
        from positronic.cli import entry
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    entry()

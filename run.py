"""Entry point: `python run.py --model tinyllama --ticks 10000` (see `python run.py --help`)."""

from positronic.cli import main

if __name__ == "__main__":
    main()

"""What the CLI tests share: the exit code of a command line, and a short text to evaluate."""

from positronic.cli import main

TEXT = ("The keeper of the lighthouse wrote in his log every evening. He noted the wind, the ships that "
        "passed, and the colour of the sea. In winter the storms came from the north and the lamp had to "
        "be trimmed twice a night. His daughter learned to read from the log, one line at a time. ") * 3


def run_cli(*args) -> int:
    """The exit code `positronic ARGS` would have."""
    try:
        main(list(args))
    except SystemExit as exc:
        return exc.code or 0
    return 0

"""Small helpers more than one module needs, kept here so each exists once.

    one_line(text)          an error message fit for one terminal line
    error_line(exc)         "Type: message" of an exception, on one line
    is_int / is_int_list    exact ints (a bool is no int here: a file or a saved state that
                            says True where a count belongs is malformed)
    DTYPES                  the dtype names the project writes into files and accepts back
    quiet_transformers      transformers without its log lines and progress bars
    atomic_write_dir        build a directory beside its place, fsync it, rename it in
    read_text_file          a user's text file (--prompt-file, --text), read with a bound
    from_list               torch.tensor(a list of Python numbers), in a third of the time
    parse_options           "name=value,name=value" (a press's own settings) as a dict
    TorchOps                how many torch operations a block dispatches (what a round costs a
                            GPU's host: one launch each, whatever the tensors' sizes)

Writing a single file atomically is `positronic.mirror.write_atomic` (temporary file, fsync,
rename): the mirror package has no torch and no dependency on this one, so it keeps its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NUMPY = {torch.long: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def from_list(values: list, dtype: torch.dtype) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` for a flat list of Python numbers (dtype long, float32 or
    bool), the same values, through numpy: torch converts element by element, ~25 us for the
    ~500 ids of a tick's live map against ~6 (a tick's view makes six of these)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


MAX_TEXT_BYTES = 64 << 20  # a text file a command reads: 64 MiB is ~15M tokens, past every model's positions


def parse_options(text: str) -> dict[str, int | float | bool | str]:
    """`"name=value,name=value"` as {name: value}: a value is an int, a float, true/false, or
    else the text itself. ValueError for an item without `=`, an empty or repeated name."""
    options: dict[str, int | float | bool | str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not name.isidentifier():
            raise ValueError(f"a policy option is NAME=VALUE, got {item!r}")
        if name in options:
            raise ValueError(f"policy option {name!r} is given twice")
        options[name] = _option_value(value)
    return options


def _option_value(value: str) -> int | float | bool | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def read_text_file(path: Path, flag: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of `path` (a file, or a pipe such as /dev/stdin), at most `limit` bytes
    read whatever it is (/dev/zero stops there): OSError with a one-line message naming `flag`."""
    from positronic.mirror import TooLarge, read_bounded

    try:
        return read_bounded(path, limit, regular=False).decode("utf-8")
    except TooLarge as exc:
        raise OSError(f"cannot read {flag} {path}: {exc}") from None
    except OSError as exc:
        raise OSError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise OSError(f"cannot read {flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def one_line(text: str, limit: int = 300) -> str:
    """`text` with every run of whitespace (newlines too) made one space, cut to `limit`
    characters with an ellipsis: errors are printed as a single `error: …` line."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_line(error: BaseException, limit: int = 300) -> str:
    """The exception's type and message on one line (the type says what kind of failure when
    the message alone does not, e.g. a bare path from FileNotFoundError)."""
    return one_line(f"{type(error).__name__}: {error}", limit)


def is_int(value) -> bool:
    return type(value) is int


def is_int_list(value) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, outermost first: what creating
    `path` makes, for remove_empty to take back."""
    missing = []
    for parent in [path, *path.parents]:
        if parent.exists() or parent.is_symlink():
            break
        missing.insert(0, parent)
    return missing


def remove_empty(made: list[Path]) -> None:
    """Remove the directories of `made` (outermost first, as missing_dirs lists them), innermost
    first, while they are empty: what an operation that failed or let go made, and no more."""
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:  # not empty (another's files) or gone: kept as it is
            return


def atomic_write_dir(target: Path, write) -> None:
    """Create directory `target` by calling write(tmp) on a temp dir beside it, then renaming it
    into place, so `target` is either absent/old or complete. A stale `target` is replaced;
    if another process put a complete one there first, theirs is kept.

    Every file is fsynced before the rename, as `mirror.write_atomic` does for one file: after
    a crash the renamed directory must not hold files whose data never reached the disk (a
    cache stamped complete but holding zeros would be trusted on every later start). A write
    that fails leaves no directory behind, not even the parents this call made."""
    made = missing_dirs(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        for path in [tmp, *tmp.rglob("*")]:  # mkdtemp makes 0700; a cache is shareable
            path.chmod(0o755 if path.is_dir() else 0o644)
            if path.is_file():
                _fsync(path)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "x")  # move aside; the directory rename below is atomic
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
        _fsync(target.parent)  # the rename itself
    except OSError:
        if not target.is_dir():  # only a complete directory is ever renamed into place
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            remove_empty(made)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def quiet_transformers(progress: bool = False):
    """Silence transformers' log lines and (unless `progress`) its progress bars: they would
    land in the live view or between the generated text and the progress lines."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    (transformers.logging.enable_progress_bar if progress else transformers.logging.disable_progress_bar)()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        (transformers.logging.enable_progress_bar if bars else transformers.logging.disable_progress_bar)()


class TorchOps(TorchDispatchMode):
    """`with TorchOps() as ops: ...`, then `ops.count`: the torch operations the block
    dispatched (each an aten call: a kernel launch on a GPU, a dispatch on a CPU), and
    `ops.by_name` {aten name: count}."""

    def __init__(self):
        super().__init__()
        self.count, self.by_name = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.by_name[str(func)] = self.by_name.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))

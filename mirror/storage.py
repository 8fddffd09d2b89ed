"""Save and load a mirror (plus a small metadata dict) as msgpack.

The file is columnar: one list per ledger field, so 100k tokens stay compact. Version 2
wraps the content in an envelope with its sha256, so an edit or a flipped bit anywhere (a
token id, a text, the settings) is refused instead of resumed. Writes are atomic (temporary
file, then rename) and loads validate everything before building a Mirror, so a truncated or
corrupt file raises MirrorFileError and yields nothing.

    envelope: {"format": FORMAT, "version": 2, "sha256": hex of body, "body": bytes}
    body:     {"ledger": {column: [...]}, "live": {"ledger_ids": [...], "positions": [...]}, "meta": {...}}
              (+ "layers": [[ledger id, ...] per layer] when layers keep different rows)
              (+ "ring": {"sinks", "capacity", "cursor"} with a ring store, mirror/ring.py)
    version 1 (read only): {"format", "version": 1, "ledger", "live", "meta"}, no checksum
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Sequence

import msgpack

from .ledger import SOURCES, STATES, Ledger, LedgerEntry
from .layer_rows import LayerRows
from .live_map import LiveMap
from .mirror import Mirror, MirrorInvariantError
from .ring import Ring

FORMAT = "positronic-mirror"
VERSION = 2
READABLE = (1, 2)

# column name -> (type check, description used in errors)
_COLUMNS = {
    "token_id": (lambda v: type(v) is int, "int"),
    "text": (lambda v: type(v) is str, "str"),
    "source": (lambda v: v in SOURCES, f"one of {SOURCES}"),
    "tick_born": (lambda v: type(v) is int, "int"),
    "brightness": (lambda v: type(v) in (int, float), "number"),
    "state": (lambda v: v in STATES, f"one of {STATES}"),
    "tick_died": (lambda v: v is None or type(v) is int, "int or None"),
    "replaced_by": (lambda v: type(v) is list and all(type(i) is int for i in v), "list of int"),
    "position": (lambda v: v is None or (type(v) is int and v >= 0), "int >= 0 or None"),
    "resurrections": (lambda v: type(v) is int and v >= 0, "int >= 0"),
    "pinned": (lambda v: type(v) is bool, "bool"),
}
# columns added after files were first written, with the value older files mean
_LATER_COLUMNS = {"position": None, "resurrections": 0, "pinned": False}


class MirrorFileError(ValueError):
    """A mirror file that cannot be trusted: unreadable, truncated, or not a valid mirror."""


def to_columns(mirror: Mirror) -> dict:
    """The mirror as plain data (fresh lists, nothing shared with the mirror):
    {"ledger": {column: [value per ledger id]}, "live": {"ledger_ids": [...], "positions": [...]}}.
    Also the form a mirror takes inside a .pt tick fixture."""
    entries = mirror.ledger.entries
    ledger = {name: [getattr(e, name) for e in entries] for name in _COLUMNS}
    ledger["replaced_by"] = [list(ids) for ids in ledger["replaced_by"]]
    columns = {"ledger": ledger, "live": {"ledger_ids": list(mirror.live.ledger_ids),
                                          "positions": list(mirror.live.positions)}}
    if mirror.layers is not None:  # only then: files of every-layer-alike runs are unchanged
        columns["layers"] = [list(layer) for layer in mirror.layers.rows]
    if mirror.ring is not None:  # likewise: only a ring store's files carry the cursor
        columns["ring"] = mirror.ring.to_dict()
    return columns


def to_chunks(mirror: Mirror, meta: dict | None = None) -> list[bytes]:
    """The file's bytes as [envelope head, body]: joined, exactly what msgpack packs for the
    envelope, but the body is written as packed, not copied into a second buffer (a recall
    index's K/V make it tens of MB; a server writes one before each answer's last byte)."""
    body = msgpack.packb({**to_columns(mirror), "meta": meta or {}}, use_bin_type=True)
    packer = msgpack.Packer(use_bin_type=True)
    fields = ("format", FORMAT, "version", VERSION, "sha256", hashlib.sha256(body).hexdigest(), "body")
    head = packer.pack_map_header(4) + b"".join(packer.pack(field) for field in fields) + _bin_header(len(body))
    return [head, body]


def _bin_header(size: int) -> bytes:
    """msgpack's header of a bin of `size` bytes (bin 8, 16 or 32, the smallest that holds it)."""
    if size < 1 << 8:
        return struct.pack(">BB", 0xC4, size)
    if size < 1 << 16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)


def to_bytes(mirror: Mirror, meta: dict | None = None) -> bytes:
    return b"".join(to_chunks(mirror, meta))


def _unpack(data: bytes, source: str, what: str):
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MirrorFileError(f"{source}: not a readable {what} ({type(exc).__name__}: {exc})") from None


def from_bytes(data: bytes, source: str = "mirror data") -> tuple[Mirror, dict]:
    doc = _unpack(data, source, "mirror file")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MirrorFileError(f"{source}: not a positronic mirror file")
    if doc.get("version") not in READABLE:
        raise MirrorFileError(f"{source}: mirror file version {doc.get('version')!r}, this build reads "
                              f"{', '.join(map(str, READABLE))}")
    if doc["version"] >= 2:
        body = doc.get("body")
        if not isinstance(body, bytes) or not isinstance(doc.get("sha256"), str):
            raise MirrorFileError(f"{source}: mirror file without its content or checksum")
        if hashlib.sha256(body).hexdigest() != doc["sha256"]:
            raise MirrorFileError(f"{source}: checksum mismatch: the file was changed or damaged after it was saved")
        doc = _unpack(body, source, "mirror body")
        if not isinstance(doc, dict):
            raise MirrorFileError(f"{source}: the mirror body is not a map")
    ledger, live, meta = doc.get("ledger"), doc.get("live"), doc.get("meta")
    if not isinstance(ledger, dict) or not isinstance(live, dict) or not isinstance(meta, dict):
        raise MirrorFileError(f"{source}: missing ledger, live map or meta section")
    columns = {"ledger": ledger, "live": live}
    for optional in ("layers", "ring"):
        if optional in doc:
            columns[optional] = doc[optional]
    return from_columns(columns, source), meta


def from_columns(columns: dict, source: str = "mirror data") -> Mirror:
    """Build a Mirror from `to_columns` data, validating every column and then the mirror's
    invariants; raises MirrorFileError naming `source` and the first problem."""
    ledger, live = (columns.get("ledger"), columns.get("live")) if isinstance(columns, dict) else (None, None)
    if not isinstance(ledger, dict) or not isinstance(live, dict):
        raise MirrorFileError(f"{source}: missing ledger or live map section")
    values = []
    for name, (valid, kind) in _COLUMNS.items():
        column = ledger.get(name)
        if column is None and name in _LATER_COLUMNS and isinstance(ledger.get("token_id"), list):
            column = [_LATER_COLUMNS[name]] * len(ledger["token_id"])
        if not isinstance(column, list):
            raise MirrorFileError(f"{source}: ledger column {name!r} missing")
        bad = next((i for i, v in enumerate(column) if not valid(v)), None)
        if bad is not None:
            raise MirrorFileError(f"{source}: ledger {name}[{bad}] = {column[bad]!r}, expected {kind}")
        values.append(column)
    if len({len(c) for c in values}) != 1:
        raise MirrorFileError(f"{source}: ledger columns have different lengths")
    ids, positions = live.get("ledger_ids"), live.get("positions")
    for name, column in (("ledger_ids", ids), ("positions", positions)):
        if not isinstance(column, list) or not all(type(v) is int for v in column):
            raise MirrorFileError(f"{source}: live map {name} must be a list of int")
    if len(ids) != len(positions):
        raise MirrorFileError(f"{source}: live map has {len(ids)} rows but {len(positions)} positions")
    entries = [
        LedgerEntry(t, s, src, born, float(b), state, died, list(rb), position, back, pinned)
        for t, s, src, born, b, state, died, rb, position, back, pinned in zip(*values)
    ]
    layers = columns.get("layers")
    if layers is not None and not (isinstance(layers, list) and layers and all(
            isinstance(layer, list) and all(type(v) is int for v in layer) for layer in layers)):
        raise MirrorFileError(f"{source}: per-layer rows must be a non-empty list of lists of int")
    ring = columns.get("ring")
    if ring is not None:
        try:
            ring = Ring.from_dict(ring)
        except ValueError as exc:
            raise MirrorFileError(f"{source}: {exc}") from None
    mirror = Mirror(Ledger(entries), LiveMap(list(ids), list(positions)),
                    None if layers is None else LayerRows(layers), ring)
    try:
        mirror.check()
    except MirrorInvariantError as exc:
        raise MirrorFileError(f"{source}: inconsistent mirror: {exc}") from None
    return mirror


# Fault injection for the kill soaks (tests/positronic/server/test_kill_soak.py): seconds a write
# waits, its data on disk, before the rename that publishes it, so that kills land mid-write.
WRITE_DELAY_S = float(os.environ.get("POSITRONIC_TEST_WRITE_DELAY_S") or 0)


def write_atomic(path: str | os.PathLike, data: bytes | Sequence[bytes]) -> None:
    """Write `data` (bytes, or pieces written one after another) so that a reader sees the old
    file or the new one, never half of one, and the new one is on disk when this returns
    (temporary file beside it, fsync, rename). A write that fails or is killed leaves at most
    a `NAME.*.tmp` file, which `stale_temporaries` finds."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        if WRITE_DELAY_S:
            time.sleep(WRITE_DELAY_S)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: name the file (a bare "[Errno 28]" says nothing of which)
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Temporary files `write_atomic(path, …)` left behind when it was killed."""
    path = Path(path)
    return sorted(path.parent.glob(path.name + ".*.tmp"))


def save(path: str | os.PathLike, mirror: Mirror, meta: dict | None = None) -> None:
    """Write atomically (see write_atomic)."""
    write_atomic(path, to_chunks(mirror, meta))


MAX_MIRROR_BYTES = 1 << 31  # 2 GiB: tens of millions of ledger tokens; beyond, a file is not a mirror


class TooLarge(OSError):
    """A file (or what a device or pipe yields) larger than the caller reads."""


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def _not_regular(mode: int) -> OSError:
    return OSError(f"not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'of another kind')})")


def regular_file(path: str | os.PathLike) -> os.stat_result:
    """`path`'s stat (links followed) if it is a regular file: FileNotFoundError when nothing
    is there, else OSError "not a regular file (a FIFO)". Opens nothing, so a FIFO cannot
    block the check: what a command will read whole (a session's mirror.msgpack, an event log
    it appends to, a fixture, saved labels) is checked with this before it is opened."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(info.st_mode)
    return info


def read_bounded(path: str | os.PathLike, limit: int, *, regular: bool = True) -> bytes:
    """The bytes of `path`, at most `limit` of them: TooLarge past that, without reading more
    than limit + 1. The checks follow what is opened (a symlink to /dev/zero is the device):
    `regular` refuses anything but a regular file (OSError), since a device or a FIFO states
    no size a check could trust."""
    # O_NONBLOCK: opening a FIFO waits for a writer; this way it opens at once and is refused
    fd = os.open(path, os.O_RDONLY | (os.O_NONBLOCK if regular else 0))
    try:
        info = os.fstat(fd)
        if regular and not stat.S_ISREG(info.st_mode):
            raise _not_regular(info.st_mode)
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise TooLarge(f"{info.st_size} bytes, more than the {limit} read")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise TooLarge(f"more than the {limit} bytes read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def load(path: str | os.PathLike) -> tuple[Mirror, dict]:
    try:
        data = read_bounded(path, MAX_MIRROR_BYTES)
    except OSError as exc:
        raise MirrorFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return from_bytes(data, source=str(path))

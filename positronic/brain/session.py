"""Sessions: a run saved so that it can go on exactly where it stopped.

A session directory holds these files:

    mirror.msgpack         the mirror (ledger + live map) and the run's metadata: model, tick,
                           settings, sampler state, counts, the policy's state, and the name and
                           sha256 of the cache file (mirror/storage.py: versioned, checksummed)
    kv-<sha256[:16]>.safetensors
                           the cache as it was: keys, values [layers, kv_heads, rows, head_dim],
                           the greedy prediction after every row, the next-token logits and the
                           attention row of the newest token (StateManager.tensors)

    blob-<sha256>.bin      a large piece of the policy's state (SmartKV recall's index, in
                           blocks of its ring), named by its content and named in the mirror
                           file's policy state: a save writes only the pieces that changed
    .lock                  while a run or a server holds the session (Claim): names the holder

Saving touches nothing in the run (no rebuild), so a run with `--session` makes the same
tokens as one without, and resuming loads the cache instead of recomputing it, so the resumed
run continues token for token. The cache file and the blobs are written first under names of
their own content; the mirror file, written next, names them; only then are the previous
ones removed. A save killed at any point leaves the previous checkpoint whole.

`restore` is `read` (every file, checked: what waits on the disk) then `rebuild` (the Brain
they hold); the server reads in a helper thread while the other sessions tick.

Everything read is checked before it is used (checksums, types, shapes against the model,
layer 0 against a fresh computation); a session that fails any check raises SessionError and
is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import re
import stat
import threading
from pathlib import Path

import safetensors.torch
import torch

from positronic import mirror
from positronic import steps
from positronic.mirror import MirrorFileError, MirrorInvariantError

from .config import RESOLVED, ConfigError, check_budget
from .loop import Brain, BrainConfig, cache_capacity
from ..models.weights import FORMATS
from ..policies.recall import Digested
from ..state import StateInvariantError, StateManager
from ..util import missing_dirs, remove_empty

MIRROR_FILE = "mirror.msgpack"
CACHE_FILE = re.compile(r"kv-[0-9a-f]{16}\.safetensors")
RUN_ID = re.compile(r"[0-9a-f]{32}")
LOCK_FILE = ".lock"
MAX_TICK = 2**53  # beyond this a tick is not an exact JSON number in the event log
HEADER_SLACK = 1 << 20  # bytes a cache file may hold besides its tensors (the safetensors header)
BLOB_FILE = re.compile(r"blob-([0-9a-f]{64})\.bin")
BLOB_MIN = 1 << 16  # bytes: a piece of the policy's state this large is kept in a blob file of its own
BLOB = "$blob"  # the key of a blob's reference in the mirror file: {BLOB: sha256, "size": bytes}
MAX_BLOB_BYTES = mirror.storage.MAX_MIRROR_BYTES  # all of a session's blobs (they were the mirror file's)
# blob path -> (inode, size, mtime) as this process wrote it, the WRITTEN_KEPT most recent: one
# forgotten (a server that has seen many sessions) is only written again at its next save
_written: dict[str, tuple[int, int, int]] = {}
_written_lock = threading.Lock()  # a server saves its sessions from several threads
WRITTEN_KEPT = 1 << 14


class SessionError(ValueError):
    """A session directory that cannot be saved to or resumed from."""


class SessionLocked(SessionError):
    """Another process (a run, a server) is using the session directory: `holder` names it
    ("run.py (pid 123)")."""

    def __init__(self, directory: Path, holder: str):
        super().__init__(f"{directory} is in use by {holder}: one run or server per session directory")
        self.directory, self.holder = directory, holder


class Claim:
    """`directory` held by this process (created if needed, with its missing parents): one
    owner per session, whoever it is (run.py for its whole run, the server while the session
    is in its pool, `serve` for its whole --session-dir). A second claim, from any process or
    from this one, gets SessionLocked at once instead of racing this one's saves. An advisory
    lock (flock on DIRECTORY/.lock, which names the holder): the kernel drops it when the
    process ends, killed or not, so a crash never leaves the directory locked. `release()`
    removes the lock file, and the directories the claim created if they are still empty: a
    run refused after its claim leaves nothing behind. A lock file that is a link or not a
    regular file is SessionError (never written through); storage that fails is OSError."""

    ATTEMPTS = 100  # claims that lose a race with a release and start again, before giving up

    def __init__(self, directory: str | Path, who: str = "a run"):
        self.directory = Path(directory)
        self._made = missing_dirs(self.directory)  # what this claim creates, taken back on release
        try:
            self._fd = self._lock(f"{who} (pid {os.getpid()})")
        except BaseException:
            self._fd = None
            remove_empty(self._made)
            raise

    def _lock(self, holder: str) -> int:
        import fcntl

        path = self.directory / LOCK_FILE
        for _ in range(self.ATTEMPTS):
            self.directory.mkdir(parents=True, exist_ok=True)  # OSError: the storage's trouble, not the session's
            try:  # never through a link: the file is truncated and written
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except FileNotFoundError:  # the directory went with the last holder's release: made again
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SessionError(f"cannot lock {path}: it is a symbolic link; remove it") from None
                if exc.errno == errno.EISDIR:
                    raise SessionError(f"cannot lock {path}: not a regular file; remove it") from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SessionError(f"cannot lock {path}: not a regular file; remove it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    other = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                    raise SessionLocked(self.directory, other) from None
                try:  # the file opened may be one the last holder removed as it let go: then not ours
                    current = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    current = None
                if current is None or not os.path.samestat(os.fstat(fd), current):
                    os.close(fd)
                    continue
                if current.st_nlink != 1:  # another file's hard link: never truncated
                    raise SessionError(f"cannot lock {path}: it has other names (a hard link); remove it")
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{holder}\n".encode(), 0)
                return fd
            except BaseException:
                os.close(fd)
                raise
        raise SessionError(f"cannot lock {path}: it kept disappearing ({self.ATTEMPTS} attempts)")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the directory go (once; later calls do nothing)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # removed while still held: a claimant that opened this file finds it gone and starts again
            with contextlib.suppress(OSError):
                os.unlink(self.directory / LOCK_FILE)
            remove_empty(self._made)
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def __del__(self):  # dropped without release (a pool never closed): its descriptor at least
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


@contextlib.contextmanager
def locked(directory: str | Path, who: str = "a run"):
    """`directory` held for the block (Claim): SessionLocked if another holds it."""
    claim = Claim(directory, who)
    try:
        yield claim.directory
    finally:
        claim.release()


def save(directory: str | Path, brain: Brain, model_name: str, note: dict | None = None) -> Path:
    """Checkpoint `brain` into `directory` (created if needed) without changing it; atomic.
    Refuses a broken state (StateBrokenError): a state that cannot be trusted is never saved.
    `note`: what the caller keeps beside the run, in the same atomic write (the server's
    answer to the session's last request), given back by `restore`."""
    directory = Path(directory)
    tensors = brain.state.tensors()
    directory.mkdir(parents=True, exist_ok=True)
    data = safetensors.torch.save(tensors)
    digest = hashlib.sha256(data).hexdigest()
    cache_name = f"kv-{digest[:16]}.safetensors"
    mirror.write_atomic(directory / cache_name, data)
    meta = {
        "model": model_name,
        **({"weights": brain.state.lm.weights} if brain.state.lm.weights != "float32" else {}),
        "tick": brain.tick,
        "config": dataclasses.asdict(brain.config),
        "generator": bytes(brain.generator_state().numpy().tobytes()),
        "counts": dict(brain.counts),
        "policy": _blobs_out(brain.policy.state(), blobs := {}),
        "cache": {"file": cache_name, "sha256": digest},
        "pending_input": list(brain.pending_input),  # typed input not fed yet
        "run_id": brain.run_id,
    }
    if note is not None:
        meta["note"] = note
    for digest, piece in blobs.items():
        _write_blob(directory / f"blob-{digest}.bin", piece)
    path = directory / MIRROR_FILE
    mirror.write_atomic(path, brain.state.mirror.to_chunks(meta))  # mirror.save, from the read-only view
    kept = {cache_name} | {f"blob-{digest}.bin" for digest in blobs}
    files = [*directory.glob("kv-*.safetensors"), *(f for f in directory.glob("blob-*.bin") if BLOB_FILE.fullmatch(f.name))]
    for stale in files:
        if stale.name not in kept:
            with _written_lock:
                _written.pop(str(stale), None)
            stale.unlink(missing_ok=True)
    for stale in [*mirror.stale_temporaries(path), *directory.glob("kv-*.safetensors.*.tmp"),
                  *directory.glob("blob-*.bin.*.tmp")]:
        stale.unlink(missing_ok=True)  # left by a save that was killed (write_atomic's temporaries)
    return path


def _blobs_out(state, blobs: dict[str, bytes]):
    """`state` (plain data) with every bytes value of BLOB_MIN or more, in a dict or in a list
    of bytes, replaced by its reference {BLOB: sha256, "size": n}; the pieces go into `blobs`
    (sha256 -> bytes). Other lists (a policy's long lists of numbers) are passed over."""
    if isinstance(state, (bytes, bytearray)) and len(state) >= BLOB_MIN:
        # a Digested piece comes with its digest (a recall block unchanged since the last save)
        digest = state.sha256 if isinstance(state, Digested) else hashlib.sha256(state).hexdigest()
        blobs[digest] = state
        return {BLOB: digest, "size": len(state)}
    if isinstance(state, dict):
        return {key: _blobs_out(value, blobs) for key, value in state.items()}
    if isinstance(state, list) and all(isinstance(item, (bytes, bytearray)) for item in state):
        return [_blobs_out(item, blobs) for item in state]
    return state


def _write_blob(path: Path, piece: bytes) -> None:
    """Write a blob unless this process wrote it there already and it is as it was left (its
    name is its content: a checkpoint's unchanged pieces are not written again)."""
    key = str(path)
    try:
        info = path.stat()
        with _written_lock:
            if _written.get(key) == (info.st_ino, info.st_size, info.st_mtime_ns):
                _written[key] = _written.pop(key)  # the most recent again
                return
    except FileNotFoundError:
        pass
    mirror.write_atomic(path, piece)
    info = path.stat()
    with _written_lock:
        _written.pop(key, None)
        _written[key] = (info.st_ino, info.st_size, info.st_mtime_ns)
        while len(_written) > WRITTEN_KEPT:
            _written.pop(next(iter(_written)))


def _blobs_in(directory: Path, state, budget: list[int] | None = None):
    """`state` with every blob reference replaced by the blob's bytes, each read checked against
    its name (sha256) and size; SessionError for a missing, damaged or oversized one."""
    budget = [MAX_BLOB_BYTES] if budget is None else budget
    if isinstance(state, dict) and BLOB in state:
        digest, size = state.get(BLOB), state.get("size")
        if set(state) != {BLOB, "size"} or not (isinstance(digest, str) and BLOB_FILE.fullmatch(f"blob-{digest}.bin"))\
                or type(size) is not int or not 0 <= size <= budget[0]:
            raise SessionError(f"{directory / MIRROR_FILE}: a malformed blob reference in the policy's state")
        budget[0] -= size
        path = directory / f"blob-{digest}.bin"
        try:
            piece = mirror.read_bounded(path, size)
        except mirror.TooLarge:
            raise SessionError(f"{path}: larger than the {size} bytes the session names") from None
        except OSError as exc:
            raise SessionError(f"{path}: cannot read a piece of the saved policy state ({exc.strerror or exc})") \
                from None
        if len(piece) != size or hashlib.sha256(piece).hexdigest() != digest:
            raise SessionError(f"{path}: checksum mismatch: a piece of the saved policy state was changed or damaged")
        return piece
    if isinstance(state, dict):
        return {key: _blobs_in(directory, value, budget) for key, value in state.items()}
    if isinstance(state, list) and all(isinstance(item, (bytes, dict)) for item in state):
        return [_blobs_in(directory, item, budget) for item in state]
    return state


# Settings added after sessions were first saved, with the values those runs used: a session
# saved before them resumes exactly as it would have gone on, not with today's defaults.
BEFORE_NEW_SETTINGS = {"ttl_decay": 2.0, "ttl_gain": 10.0, "unit": 2, "bridge_margin": 0.0, "recall": False,
                       "kv_format": "float", "gates": "", "kv_store": "splice", "min_p": 0.0,
                       "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": "",
                       "memory_rank": "gates", "reread": False}

def checked_config(path: Path, config) -> dict:
    """The saved settings, complete and valid, or SessionError naming what is not (a missing
    budget must not silently become the default, a string must not reach the loop). Past the
    names, the check is a new config's own (`BrainConfig.validate`): a session resumes only
    with settings a new run would be allowed."""
    fields = {f.name for f in dataclasses.fields(BrainConfig)}
    if not isinstance(config, dict):
        raise SessionError(f"{path}: settings missing")
    if unknown := sorted(set(config) - fields):
        raise SessionError(f"{path}: unknown settings: {unknown}")
    config = {**BEFORE_NEW_SETTINGS, **config}
    if missing := sorted(fields - set(config)):
        raise SessionError(f"{path}: settings missing: {missing}")
    for name, kind in RESOLVED.items():  # saved resolved: None here would be a file no run wrote
        if type(config[name]) is not kind:
            raise SessionError(f"{path}: setting {name} has the wrong type: {config[name]!r}")
    try:
        BrainConfig(**config).validate()
    except ConfigError as exc:
        raise session_setting_error(path, exc) from None
    return config


def session_setting_error(path: Path, exc: ConfigError) -> SessionError:
    """A saved setting's ConfigError as the SessionError that names the file and the setting."""
    message = str(exc)
    return SessionError(f"{path}: setting {message}" if message.startswith(exc.field)
                        else f"{path}: setting {exc.field}: {message}")


def _check_meta(path: Path, saved: mirror.Mirror, meta: dict) -> None:
    """SessionError naming the first part of the metadata that is missing or malformed."""
    if not isinstance(meta.get("model"), str):
        raise SessionError(f"{path}: model missing")
    if meta.get("weights", "float32") not in FORMATS:
        raise SessionError(f"{path}: weights {str(meta.get('weights'))[:40]!r} is not one of {', '.join(FORMATS)}")
    tick = meta.get("tick")
    last = max((t for e in saved.ledger.entries for t in (e.tick_born, e.tick_died) if t is not None), default=0)
    if type(tick) is not int or not last <= tick <= MAX_TICK:
        raise SessionError(f"{path}: tick {tick!r} is not a count between the ledger's last tick {last} and {MAX_TICK}")
    generator = meta.get("generator")
    if not isinstance(generator, bytes) or len(generator) != torch.Generator().get_state().numel():
        raise SessionError(f"{path}: sampler state missing or of the wrong size")
    counts = meta.get("counts", {})
    if not (isinstance(counts, dict) and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items())):
        raise SessionError(f"{path}: counts must map names to counts >= 0")
    run_id = meta.get("run_id")
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        raise SessionError(f"{path}: run id malformed: {run_id!r}")
    cache = meta.get("cache")
    if "note" in meta and not isinstance(meta["note"], dict):
        raise SessionError(f"{path}: note malformed: {type(meta['note']).__name__}, not a map")
    if cache is not None and not (isinstance(cache, dict) and set(cache) == {"file", "sha256"}
                                  and isinstance(cache["file"], str) and CACHE_FILE.fullmatch(cache["file"])
                                  and isinstance(cache["sha256"], str) and cache["sha256"][:16] == cache["file"][3:19]):
        raise SessionError(f"{path}: cache reference malformed: {cache!r}")


def load(directory: str | Path) -> tuple[mirror.Mirror, dict]:
    """The saved mirror and its metadata, validated (the parts that need no model)."""
    path = Path(directory) / MIRROR_FILE
    try:  # a FIFO, a directory or a device there is named as such, and never opened to wait on
        mirror.storage.regular_file(path)
    except FileNotFoundError:
        raise SessionError(f"{directory}: no saved session ({MIRROR_FILE} missing)") from None
    except OSError as exc:
        raise SessionError(f"{path}: {exc.strerror or exc}") from None
    try:
        saved, meta = mirror.load(path)
    except MirrorFileError as exc:
        raise SessionError(str(exc)) from None
    meta["config"] = checked_config(path, meta.get("config"))
    _check_meta(path, saved, meta)
    return saved, meta


def _read_cache(directory: Path, reference: dict, limit: int) -> dict[str, torch.Tensor]:
    """The cache tensors named by the mirror file, checked against their sha256; a file larger
    than the mirror's rows can need (`limit` bytes) is refused before it is read."""
    path = directory / reference["file"]
    try:
        data = mirror.read_bounded(path, limit)
    except mirror.TooLarge as exc:
        raise SessionError(f"{path}: {exc}: more than the saved context can need") from None
    except OSError as exc:
        raise SessionError(f"{path}: cannot read the saved cache ({exc.strerror or exc})") from None
    if hashlib.sha256(data).hexdigest() != reference["sha256"]:
        raise SessionError(f"{path}: checksum mismatch: the saved cache was changed or damaged")
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # the checksum matched a file safetensors cannot read: a forged pair
        raise SessionError(f"{path}: not a readable cache file ({type(exc).__name__}: {exc})") from None


def _cache_bytes(lm, rows: int) -> int:
    """The most bytes a cache file for `rows` live rows of `lm` can take."""
    item = torch.empty((), dtype=lm.dtype).element_size()
    kv = 2 * lm.num_layers * lm.num_kv_heads * rows * lm.head_dim * item
    return kv + 8 * rows + 4 * lm.vocab_size + 4 * lm.num_layers * lm.num_heads * rows + HEADER_SLACK


def resume(lm, directory: str | Path) -> Brain:
    """A Brain that continues the saved run exactly: the cache as it was saved (sessions from
    before the cache file was saved: rebuilt from the mirror, as they were saved right after
    a rebuild), the sampler, the tick, the policy's state."""
    return restore(lm, directory)[0]


def restore(lm, directory: str | Path) -> tuple[Brain, dict | None]:
    """resume(), and the note saved with the checkpoint (None if it has none)."""
    return rebuild(lm, read(lm, directory))


@dataclasses.dataclass
class SessionFiles:
    """A checkpoint's files read and checked (`read`): what `rebuild` makes a Brain of."""

    directory: Path
    mirror: mirror.Mirror
    meta: dict
    config: BrainConfig
    tensors: dict[str, torch.Tensor] | None  # the cache's (None: saved before the cache file was)
    policy: object  # the policy's state, its blobs read (when `meta` has one: older sessions did not save it)


def read(lm, directory: str | Path) -> SessionFiles:
    """Every file of a checkpoint for `lm`, read and checked: the part of `restore` that waits
    on the disk (the server reads in a helper thread while the others' rounds go on)."""
    directory = Path(directory)
    saved, meta = load(directory)
    path = directory / MIRROR_FILE
    if meta["model"] != lm.name:
        raise SessionError(f"{directory}: saved with model {meta['model']!r}, not {lm.name!r}")
    weights = meta.get("weights", "float32")  # its rows were computed by layers of this format
    if weights != lm.weights:
        raise SessionError(f"{directory}: saved with --weights {weights}, this model runs {lm.weights}: "
                           f"resume with --weights {weights}")
    config = BrainConfig(**meta["config"])
    try:  # what a new run's settings must fit in this model, the same check
        check_budget(lm, config)
    except ConfigError as exc:
        raise session_setting_error(path, exc) from None
    tensors = None if meta.get("cache") is None else _read_cache(directory, meta["cache"], _cache_bytes(lm, len(saved)))
    policy = _blobs_in(directory, meta["policy"]) if "policy" in meta else None
    return SessionFiles(directory, saved, meta, config, tensors, policy)


def rebuild(lm, files: SessionFiles) -> tuple[Brain, dict | None]:
    """The Brain a checkpoint's files (`read`) hold, and its note: the cache as it was saved
    (or rebuilt from the mirror), the sampler, the tick, the policy's state."""
    directory, saved, meta, config = files.directory, files.mirror, files.meta, files.config
    path = directory / MIRROR_FILE
    options = dict(capacity=cache_capacity(len(saved), config.budget, config.kv_store),
                   score_layers=config.recorded_layers, brightness=steps.RULES[config.brightness].start,
                   kv_format=config.kv_format, kv_store=config.kv_store)
    try:
        if files.tensors is None:
            state = StateManager.from_mirror(lm, saved, **options)
        else:
            state = StateManager.from_saved(lm, saved, files.tensors, **options)
    except (ValueError, MirrorInvariantError, StateInvariantError) as exc:
        if isinstance(exc, SessionError):
            raise
        raise SessionError(f"{directory}: the saved state does not fit {lm.name}: {exc}") from None
    generator = torch.Generator()
    try:
        generator.set_state(torch.frombuffer(bytearray(meta["generator"]), dtype=torch.uint8))
    except RuntimeError as exc:
        raise SessionError(f"{path}: sampler state invalid ({exc})") from None
    pending = meta.get("pending_input", [])  # sessions from before typed input: none
    if not (isinstance(pending, list) and all(type(t) is int and 0 <= t < lm.vocab_size for t in pending)):
        raise SessionError(f"{path}: pending input must be a list of token ids inside {lm.name}'s vocabulary")
    brain = Brain(state, config, tick=meta["tick"], generator_state=generator.get_state(), pending_input=pending,
                  run_id=meta.get("run_id"))  # sessions saved before run ids get a new one
    if "policy" in meta:  # older sessions did not save it: a keyed scorer starts empty
        try:
            brain.policy.load_state(files.policy)
        except ValueError as exc:
            raise SessionError(f"{path}: {exc}") from None
    brain.counts.update({k: v for k, v in meta.get("counts", {}).items() if k in brain.counts})
    return brain, meta.get("note")

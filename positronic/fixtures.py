"""Captured ticks as `.pt` fixtures: capture from a run, load safely, replay exactly.

A fixture freezes one tick's Step 4: the mirror before it, the action list, and what came
out. Replaying rebuilds the state from the mirror, applies the same list and compares.

Why the expected values come from a *fresh* state and not from the live run: a live cache
carries splice traces (deeper-layer K/V of rows computed before earlier edits), which a
state rebuilt from the mirror does not have, so the live run's logits cannot be reproduced
from a file that holds only the mirror. At capture time we therefore build a fresh state
from a copy of the mirror (`StateManager.from_mirror`), apply the actions to it and record
*its* results, after asserting that its live ids equal the live run's. A replay builds the
same fresh state and must match exactly.

    Capture(directory, lm, spec)   observer for `Brain.observers` (run flag --capture)
    capture_tick(state, actions, tick=, brightness=, fault=)   one tick applied through the API, recorded
    save_fixture / load_fixture    torch.save / torch.load(weights_only=True) + validation: bounded
                                   sizes and tensors, content checksum (`checksum`), then the schema
    replay(fixture, lm)            -> ReplayResult (checks: ids, positions, text, brightness, layer 0,
                                      greedy, rebuild)
    print_replay(path)             what `positronic replay FILE` prints

The file schema is documented in fixtures/README.md; `_parse` below is its executable form.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import math
import os
import re
import reprlib
import struct
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from positronic.mirror import Mirror, MirrorFileError
from positronic.mirror.storage import from_columns, to_columns

from .actions import ActionError, validate
from .state_manager import FAULT_STAGES, ApplyReport, StateManager
from .text import span_texts

FORMAT = "positronic-tick-fixture"
VERSION = 3  # 3: content checksum (sha256); 2: atomic ticks, Step 2b brightness recorded and checked
_RECAPTURE = "recapture it (bench/capture_fixtures.py, or run --capture)"
OLD_VERSIONS = {1: "written for the v1 runtime (faults by edit count, brightness set before Step 4); " + _RECAPTURE,
                2: "written without a content checksum; " + _RECAPTURE}
LAYER0_ROWS = 8  # at most this many layer-0 rows are stored: first, last, created rows
GREEDY_TOKENS = 4  # greedy continuation recorded after the tick
CAPTURE_LIMIT = 50  # files per run unless the spec lists the ticks
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HUGE = 2**62  # stands in for vocab size / context limit when checking actions without a model
# Bounds checked before anything is allocated from a file's say-so (the committed files are ~16 KB):
MAX_FILE_BYTES = 64 * 2**20  # the file, and the uncompressed members of its zip archive together
MAX_DEPTH = 8  # nesting of dicts and lists (the schema nests 4 deep: mirror.ledger.replaced_by[i])
MAX_KV_HEADS, MAX_HEAD_DIM = 256, 1024  # layer-0 K/V are [kv_heads, <= LAYER0_ROWS, head_dim]
MAX_TENSOR_ELEMENTS = MAX_KV_HEADS * LAYER0_ROWS * MAX_HEAD_DIM
TENSOR_DTYPES = (torch.int64, torch.float32)  # the only dtypes the schema stores


class FixtureError(ValueError):
    """A fixture file that cannot be used; the message is one line naming the file."""


class CaptureMismatch(AssertionError):
    """At capture, the fresh state disagreed with the live run: a bug, not a bad file."""


class _Invalid(Exception):
    """Internal: one schema problem, before the file name is attached."""


# --- the data ------------------------------------------------------------------------------


@dataclass
class Expected:
    """What the fresh state looked like after the tick.

    live_ids / positions / texts / brightness: one per live row. layer0_rows: int64 [r], row indices
    (1 <= r <= LAYER0_ROWS). layer0_keys / layer0_values: float32 [kv_heads, r, head_dim].
    greedy: argmax tokens continuing from the state after the tick (no sampling, no penalty).
    """

    live_ids: list[int]
    positions: list[int]
    texts: list[str]
    brightness: list[float]
    rebuilt: bool
    layer0_rows: torch.Tensor
    layer0_keys: torch.Tensor
    layer0_values: torch.Tensor
    greedy: list[int]


@dataclass
class Fixture:
    """One captured tick. `mirror_columns` is the mirror before Step 4 as plain data
    (mirror.storage.to_columns); `mirror()` builds a new Mirror from it on each call.

    The arguments of Step 4 besides the actions: `tick` (the ledger stamp), `brightness`
    (Step 2b's brightness, one per live row before the tick, or None: unchanged) and
    `new_brightness` (where new tokens' brightness starts). `fault`: None, or the stage
    (state_manager.FAULT_STAGES) at which replay makes the tick fail, as it failed live."""

    model: str
    dtype: str
    device: str
    tick: int
    label: str
    mirror_columns: dict
    live_ids_before: list[int]
    positions_before: list[int]
    actions: list[dict]
    brightness: list[float] | None
    fault: str | None
    new_brightness: float
    expected: Expected
    path: Path | None = None

    def mirror(self) -> Mirror:
        return from_columns(copy.deepcopy(self.mirror_columns), source=f"{self.path or 'fixture'}: mirror")

    def to_dict(self) -> dict:
        """The file's content: plain dicts, lists, str/int/float/bool/None and tensors only,
        "sha256" last: the `checksum` of all the rest."""
        e = self.expected
        content = {
            "format": FORMAT, "version": VERSION, "model": self.model, "dtype": self.dtype,
            "device": self.device, "tick": self.tick, "label": self.label,
            "before": {"live_ids": list(self.live_ids_before), "positions": list(self.positions_before)},
            "mirror": copy.deepcopy(self.mirror_columns),
            "actions": copy.deepcopy(self.actions),
            "brightness": None if self.brightness is None else [float(b) for b in self.brightness],
            "fault": self.fault,
            "new_brightness": float(self.new_brightness),
            "after": {
                "live_ids": list(e.live_ids), "positions": list(e.positions), "texts": list(e.texts),
                "brightness": [float(b) for b in e.brightness], "rebuilt": bool(e.rebuilt), "greedy": list(e.greedy),
                "layer0": {name: tensor.clone(memory_format=torch.contiguous_format) for name, tensor in
                           (("rows", e.layer0_rows), ("keys", e.layer0_keys), ("values", e.layer0_values))},
            },
        }
        content["sha256"] = checksum(content)
        return content


# --- playing a tick on a fresh state (shared by capture and replay) --------------------------


def _play(lm, columns: dict, actions: list[dict], *, tick: int, brightness: list[float] | None,
          fault: str | None, new_brightness: float, source: str = "fixture") -> tuple[StateManager, ApplyReport]:
    """Build a fresh state from the mirror columns (cache recomputed from the live rows at
    their recorded positions), then apply `actions` to it as tick `tick` with the Step 2b
    `brightness`, with the fault injected at its stage if any."""
    state = StateManager.from_mirror(lm, from_columns(copy.deepcopy(columns), source=f"{source}: mirror"),
                                     brightness=new_brightness)
    if fault is not None:
        state.inject_fault(fault)
    brightness = None if brightness is None else list(brightness)
    return state, state.apply(copy.deepcopy(actions), tick=tick, brightness=brightness)


def _chosen_rows(state: StateManager, ledger_length_before: int) -> list[int]:
    """Rows whose layer-0 K/V a fixture keeps: the first, the last and the ones the tick
    created (ledger ids born in it), at most LAYER0_ROWS, ascending."""
    live = state.mirror.live.ledger_ids
    created = [row for row, ledger_id in enumerate(live) if ledger_id >= ledger_length_before]
    wanted = list(dict.fromkeys([0, len(live) - 1] + created))  # in priority order, no repeats
    return sorted(wanted[:LAYER0_ROWS])


def _layer0(state: StateManager, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's keys and values of `rows`: each float32 [kv_heads, len(rows), head_dim], on CPU."""
    layer = state.cache.layers[0]
    keys, values = layer.keys, layer.values  # live views, each [1, kv_heads, rows, head_dim]: only read
    index = torch.tensor(rows, dtype=torch.long, device=keys.device)

    def pick(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[0].index_select(1, index).float().cpu().clone()  # a copy: never a view of the cache

    return pick(keys), pick(values)


def _greedy(state: StateManager, count: int) -> list[int]:
    """`count` argmax tokens continuing from `state` (appends count-1 of them to it).

    A list without an `add` leaves no logits; then the state is rebuilt first (deterministic,
    and replay does exactly the same)."""
    if state.next_logits is None:
        state.rebuild(count=False)
    tokens: list[int] = []
    for index in range(count):
        tokens.append(int(state.next_logits.argmax()))
        if index + 1 < count:
            report = state.append(tokens[-1:], source="generated")
            if report.rebuilt:  # nothing injects a fault here: a real failure, never a result to record
                raise RuntimeError(f"greedy continuation failed: {report.error}")
    return tokens


_INJECTED = re.compile(r"^InjectedFault: fault injected (?:at stage '([a-z-]+)'|(half-way through the forward))")


def _fault_of(report: ApplyReport) -> str | None:
    """The fault stage that makes a fresh state end a tick like `report` did.

    A tick is atomic: after any failure the mirror is the one from before the tick and the
    cache is rebuilt from it, so every stage leaves the same state. The stage of an injected
    fault is kept when the report names it; any other failure is replayed as a failure at
    "commit", the last stage (the tick's whole work done, then discarded)."""
    if not report.rebuilt:
        return None
    match = _INJECTED.match(report.error or "")
    if match:
        stage = match.group(1) or "mid-forward"
        if stage in FAULT_STAGES:
            return stage
    return "commit"


# --- capture --------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A tick just before Step 4: what `finish` needs to record it. `brightness`: Step 2b's,
    when the caller knows it (capture_tick, and Capture, which observers receive it in)."""

    tick: int
    columns: dict
    actions: list[dict]
    new_brightness: float
    label: str = ""
    brightness: list[float] | None = None


def snapshot(state: StateManager, actions: list[dict], *, tick: int, label: str = "",
             brightness: list[float] | None = None) -> Snapshot:
    """Copy what a fixture needs from the live state before Step 4 runs as tick `tick`."""
    brightness = None if brightness is None else [float(b) for b in brightness]
    return Snapshot(tick, to_columns(state.mirror), copy.deepcopy(actions), float(state.new_brightness), label,
                    brightness)


def finish(snap: Snapshot, state: StateManager, report: ApplyReport, *, fault: str | None = None) -> Fixture:
    """Record the tick `snap` describes, now that the live `state` applied it with `report`.

    The expected values come from a fresh state built from the snapshot's mirror (see the
    module docstring). `fault`: the stage injected into the live run, if known; otherwise it
    is derived from the report. Raises CaptureMismatch if the fresh state's live ids,
    positions, brightness or rebuild differ from the live run's.
    """
    lm = state.lm
    fault = (fault or _fault_of(report)) if report.rebuilt else None  # a fault that never fired is no part of it
    fresh, fresh_report = _play(lm, snap.columns, snap.actions, tick=snap.tick, brightness=snap.brightness,
                                fault=fault, new_brightness=snap.new_brightness, source=f"tick {snap.tick}")
    differ = [name for name, a, b in [
        ("live ids", fresh.live_token_ids(), state.live_token_ids()),
        ("positions", fresh.positions(), state.positions()),
        ("brightness", fresh.mirror.brightness(), state.mirror.brightness()),
        ("rebuilt", fresh_report.rebuilt, report.rebuilt)] if a != b]
    if differ:
        raise CaptureMismatch(f"tick {snap.tick}: a state rebuilt from the mirror ends the tick differently "
                              f"from the live run ({', '.join(differ)}; rebuilt {fresh_report.rebuilt} "
                              f"vs {report.rebuilt})")
    rows = _chosen_rows(fresh, len(snap.columns["ledger"]["token_id"]))
    keys, values = _layer0(fresh, rows)
    expected = Expected(fresh.live_token_ids(), fresh.positions(), fresh.mirror.live_texts(),
                        fresh.mirror.brightness(), fresh_report.rebuilt,
                        torch.tensor(rows, dtype=torch.int64), keys, values, [])
    expected.greedy = _greedy(fresh, GREEDY_TOKENS)
    live = snap.columns["live"]
    ledger_ids = snap.columns["ledger"]["token_id"]
    return Fixture(model=lm.name, dtype=str(lm.dtype).removeprefix("torch."), device=torch.device(lm.device).type,
                   tick=snap.tick, label=snap.label, mirror_columns=snap.columns,
                   live_ids_before=[ledger_ids[i] for i in live["ledger_ids"]],
                   positions_before=list(live["positions"]), actions=snap.actions, brightness=snap.brightness,
                   fault=fault, new_brightness=snap.new_brightness, expected=expected)


def capture_tick(state: StateManager, actions: list[dict], *, tick: int | None = None,
                 brightness: list[float] | None = None, fault: str | None = None,
                 label: str = "") -> tuple[Fixture, ApplyReport]:
    """Apply `actions` to the live `state` as tick `tick` (default: the state's last tick + 1)
    with Step 2b's `brightness` (one per live row, or None) and `fault` injected at its stage
    (state_manager.FAULT_STAGES), if given; record the tick as a fixture. The API
    counterpart of Capture, for crafted action lists."""
    if fault is not None and fault not in FAULT_STAGES:
        raise ValueError(f"unknown fault stage {fault!r}; choose from {', '.join(FAULT_STAGES)}")
    tick = state.last_tick + 1 if tick is None else tick
    snap = snapshot(state, actions, tick=tick, label=label, brightness=brightness)
    if fault is not None:
        state.inject_fault(fault)
    report = state.apply(actions, tick=tick, brightness=snap.brightness)
    return finish(snap, state, report, fault=fault), report


def parse_spec(spec: str) -> tuple[str, frozenset[int]]:
    """--capture-ticks: ("repairs" | "all", {}) or ("list", {tick, ...}). Raises ValueError."""
    text = spec.strip().lower()
    if text in ("repairs", "all"):
        return text, frozenset()
    try:
        ticks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        ticks = frozenset()
    if not ticks or min(ticks) < 1:
        raise ValueError(f"--capture-ticks {spec!r}: expected 'repairs', 'all' or tick numbers like 5,17,40")
    return "list", ticks


class Capture:
    """Observer (Brain.observers) that saves chosen ticks as fixtures DIR/tickNNNNNN.pt.

    spec: 'repairs' (ticks whose list has a replace_pair or delete), 'all', or '5,17,40'.
    At most `limit` files per run unless the spec lists the ticks. The directory, the first
    file and reaching the limit are announced on `log` (default stderr)."""

    def __init__(self, directory: Path, lm, spec: str, *, limit: int = CAPTURE_LIMIT, log=None):
        self.kind, self.ticks = parse_spec(spec)
        self.directory, self.lm = Path(directory), lm
        self.limit = len(self.ticks) if self.kind == "list" else limit
        self.log = log
        self.written: list[Path] = []
        self._pending: Snapshot | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        files = f"{self.limit} file{'s' * (self.limit != 1)}"
        self._say(f"capture: {self._describe()} into {self.directory}/ (at most {files})")

    def wants(self, tick: int, actions: list[dict]) -> bool:
        if len(self.written) >= self.limit:
            return False
        if self.kind == "list":
            return tick in self.ticks
        return self.kind == "all" or any(a["action"] in ("replace_pair", "delete") for a in actions)

    def before_apply(self, brain, actions: list[dict], brightness=None) -> None:
        wanted = self.wants(brain.tick, actions)
        self._pending = snapshot(brain.state, actions, tick=brain.tick, label=_run_label(brain.config),
                                 brightness=brightness) if wanted else None

    def after_apply(self, brain, actions: list[dict], report: ApplyReport) -> None:
        snap, self._pending = self._pending, None
        if snap is None:
            return
        path = self.directory / f"tick{snap.tick:06d}.pt"
        save_fixture(finish(snap, brain.state, report), path)
        self.written.append(path)
        # Announce the first file and the last, not every one: these lines land in the middle
        # of the generated text stream.
        if len(self.written) == 1:
            kinds = ", ".join(a["action"] for a in snap.actions)
            self._say(f"capture: tick {snap.tick} ({kinds}{', rebuilt' if report.rebuilt else ''}) -> {path}")
        if len(self.written) == self.limit:
            self._say(f"capture: done, {self.limit} fixture{'s' * (self.limit != 1)} in {self.directory}/"
                      + ("" if self.kind == "list" else " (the limit; later ticks are not captured)"))

    def _say(self, line: str) -> None:
        print(line, file=self.log or sys.stderr, flush=True)

    def _describe(self) -> str:
        if self.kind == "list":
            return "ticks " + ",".join(map(str, sorted(self.ticks)))
        return "every tick" if self.kind == "all" else "ticks with a repair or cull"


def _run_label(config) -> str:
    """How a live run was set up, in one line (a fixture's label)."""
    return (f"live run: policy {config.policy}, budget {config.budget}, window {config.window}, "
            f"repairer {config.repairer} x{config.repair_tokens}, seed {config.seed}")


# --- files ----------------------------------------------------------------------------------


def save_fixture(fixture: Fixture, path: Path) -> None:
    """torch.save the fixture atomically (temporary file, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(fixture.to_dict(), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fixture.path = path


def load_fixture(path: Path) -> Fixture:
    """Read a fixture with `torch.load(weights_only=True)` (nothing but plain data and tensors
    is unpickled, so no code in the file can run) after bounding the file's size, then check,
    before anything else touches the content, that it is a tree of plain values and compact
    tensors of bounded size (`_check_content`); then the format, the version, the checksum and
    every field. Raises FixtureError with one line naming the file and the first problem."""
    path = Path(path)
    try:
        fixture = _parse(_read(path))
    except _Invalid as problem:
        raise FixtureError(_one_line(f"{path}: {problem}")) from None
    except Exception as exc:  # a shape the checks did not foresee: still one line, never a traceback
        raise FixtureError(_one_line(f"{path}: malformed fixture ({type(exc).__name__}: {exc})")) from None
    fixture.path = path
    return fixture


def _read(path: Path):
    """The unpickled content, or _Invalid saying why there is none."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            head = f.read(2)
            if not head.startswith((b"PK", b"\x80")):  # torch.save's zip, or a (legacy) pickle
                raise _Invalid("not a .pt file (neither a torch zip archive nor a pickle)")
            _check_size(f, zipped=head == b"PK")
            f.seek(0)
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error says enough
            return torch.load(f, map_location="cpu", weights_only=True)
    except _Invalid:
        raise
    except OSError as exc:
        raise _Invalid(f"cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # torch raises many unrelated types for damaged or hostile files
        message = str(exc)
        if "Weights only load failed" in message:  # the safe unpickler met a global or an opcode it refuses
            raise _Invalid(f"refused: holds something other than plain data and tensors ({_refusal(message)})") \
                from None
        raise _Invalid(f"not a readable .pt file ({type(exc).__name__}: {_refusal(message)})") from None


def _check_size(f, *, zipped: bool) -> None:
    """Refuse a file, or a zip archive whose members unpack, beyond MAX_FILE_BYTES: torch.load
    allocates every stored tensor whole, and reads deflated members too (a small zip can
    unpack to gigabytes)."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_FILE_BYTES:
        raise _Invalid(f"a file of {size} bytes, more than the {MAX_FILE_BYTES} a fixture may have")
    if zipped:
        f.seek(0)
        with zipfile.ZipFile(f) as archive:  # reads the directory only, leaves `f` open; BadZipFile if damaged
            unpacked = sum(member.file_size for member in archive.infolist())
        if unpacked > MAX_FILE_BYTES:
            raise _Invalid(f"its zip archive unpacks to {unpacked} bytes, more than the {MAX_FILE_BYTES} "
                           "a fixture may have")


# Sentences of torch's refusals that give advice (load it with weights_only=False, allow-list
# the global) rather than the reason: never shown, a hostile file must not be waved through.
_ADVICE = ("weights only load failed", "pytorch 2.6", "re-run", "two options", "alternatively", "please",
           "trust", "check the documentation", "file an issue", "safe_globals")


def _refusal(message: str) -> str:
    """The reason inside a torch error, on one line, without torch's advice around it."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", message)  # terminal colour codes
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    sentences = (part.strip() for part in re.split(r"(?<=[.!?])\s+|\n", text))
    kept = [part for part in sentences if part and not any(word in part.lower() for word in _ADVICE)]
    return " ".join(kept).rstrip(".") or "unsupported content"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- schema (fixtures/README.md) ------------------------------------------------------------

_TOP = {"format", "version", "sha256", "model", "dtype", "device", "tick", "label", "before", "mirror", "actions",
        "brightness", "fault", "new_brightness", "after"}
_PLAIN = (str, int, float, bool, type(None))


def _need(doc: dict, key: str, where: str, valid, kind: str):
    """doc[key], or _Invalid if it is missing or `valid(value)` is false."""
    if key not in doc:
        raise _Invalid(f"missing field {where}{key}")
    value = doc[key]
    if not valid(value):
        raise _Invalid(f"field {where}{key} must be {kind}, got {_show(value)}")
    return value


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    text = reprlib.repr(value)  # never the whole of a long list or a huge int
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _is_int(value) -> bool:
    return type(value) is int


def _int_list(value) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def _id_list(value) -> bool:
    """Token ids: ints >= 0 (the vocabulary's size is checked at replay)."""
    return _int_list(value) and all(v >= 0 for v in value)


def _position_list(value) -> bool:
    """RoPE positions: strictly increasing ints >= 0 (the model's limit is checked at replay)."""
    return _int_list(value) and all(a < b for a, b in zip([-1] + value, value))  # the first >= 0


def _section(doc: dict, key: str) -> dict:
    return _need(doc, key, "", lambda v: type(v) is dict, "a dict")


def _check_content(data) -> None:
    """Before anything else reads the unpickled content: it must be a tree (no container held
    twice, so no cycle) of dicts with str keys, lists, str / int64 / float / bool / None and
    tensors (`_check_tensor`), at most MAX_DEPTH deep. Names the first offender's path."""
    seen: set[int] = set()
    storages: set[int] = set()
    stack = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Invalid(f"field {where}: nested deeper than {MAX_DEPTH} levels")
        if id(value) in seen:
            raise _Invalid(f"field {where or '(top)'}: the same {type(value).__name__} appears twice "
                           "(shared or cyclic)")
        seen.add(id(value))
        if type(value) is dict and (bad := next((k for k in value if type(k) is not str), None)) is not None:
            raise _Invalid(f"field {where or '(top)'} has a key {_show(bad)}, expected str")
        for key, item in value.items() if type(value) is dict else enumerate(value):
            path = f"{where}[{key}]" if type(key) is int else f"{where}.{key}" if where else key
            kind = type(item)
            if kind in (dict, list):
                stack.append((item, path, depth + 1))
            elif kind is torch.Tensor:
                _check_tensor(item, path, storages)
            elif kind not in _PLAIN:
                raise _Invalid(f"field {path} holds {kind.__name__}: a fixture holds only dicts, lists, str, int, "
                               "float, bool, None and tensors")
            elif kind is int and not -2**63 <= item < 2**63:
                raise _Invalid(f"field {path} holds an int beyond 64 bits")


def _check_tensor(tensor: torch.Tensor, where: str, storages: set[int]) -> None:
    """A plain CPU tensor of a schema dtype, at most MAX_TENSOR_ELEMENTS elements, that owns
    exactly its storage: contiguous, at offset 0, storage size = its element count (so no
    stride-0 or overlapping view that a copy would blow up, no slice of a larger buffer) and
    no storage shared with another tensor. Only metadata is read: nothing is allocated."""
    if tensor.dtype not in TENSOR_DTYPES:
        raise _Invalid(f"field {where} must be an int64 or float32 tensor, got {_show(tensor)}")
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise _Invalid(f"field {where} is a {tensor.layout} tensor on {tensor.device}: only dense CPU tensors")
    count = math.prod(tensor.shape)
    if tensor.dim() > 4 or count > MAX_TENSOR_ELEMENTS:  # 4: a restore's K/V [layers, kv_heads, rows, head_dim]
        raise _Invalid(f"field {where} is a tensor of shape {list(tensor.shape)} ({count} elements): at most 4 "
                       f"dimensions and {MAX_TENSOR_ELEMENTS} elements")
    storage = tensor.untyped_storage()
    if not tensor.is_contiguous() or tensor.storage_offset() != 0 or storage.nbytes() != count * tensor.element_size():
        raise _Invalid(f"field {where} is a view (shape {list(tensor.shape)}, strides {list(tensor.stride())}, "
                       f"offset {tensor.storage_offset()}, storage of {storage.nbytes()} bytes): only compact "
                       "tensors that own their storage")
    if count and storage.data_ptr() in storages:
        raise _Invalid(f"field {where} shares its storage with another tensor")
    storages.add(storage.data_ptr())


def checksum(content: dict) -> str:
    """sha256 of a fixture's content without its "sha256" field, over a canonical serialization
    (`_feed`): the same data gives the same digest whatever pickle's byte layout. It detects a
    file edited or damaged after it was saved; it is no signature (anyone can recompute it)."""
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in content.items() if key != "sha256"})
    return digest.hexdigest()


def _feed(digest, value) -> None:
    """One value into the digest: a type tag, then a length-prefixed or fixed-size body; dicts
    by sorted key; tensors as dtype, shape and their bytes in C order."""
    kind = type(value)
    if value is None or kind is bool:
        digest.update({None: b"N", True: b"T", False: b"F"}[value])
    elif kind is int:
        digest.update(b"i%d;" % value)
    elif kind is float:
        digest.update(b"f" + struct.pack("<d", value))
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        digest.update(b"s%d:" % len(data) + data)
    elif kind is list:
        digest.update(b"l%d:" % len(value))
        for item in value:
            _feed(digest, item)
    elif kind is dict:
        digest.update(b"d%d:" % len(value))
        for key in sorted(value):
            _feed(digest, key)
            _feed(digest, value[key])
    elif kind is torch.Tensor:
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(f"t{str(value.dtype).removeprefix('torch.')}{list(value.shape)}:".encode() + data)
    else:
        raise TypeError(f"a fixture cannot hold {kind.__name__}")


def _parse(data) -> Fixture:
    """Validate the unpickled content and build the Fixture; _Invalid names the first problem."""
    if type(data) is not dict:
        raise _Invalid(f"not a tick fixture: holds {_show(data)}, expected a dict")
    _check_content(data)
    if data.get("format") != FORMAT:
        raise _Invalid(f"not a tick fixture (format {reprlib.repr(data.get('format'))}, expected {FORMAT!r})")
    version = data.get("version")
    if not _is_int(version) or version != VERSION:
        why = OLD_VERSIONS.get(version) if _is_int(version) else None
        raise _Invalid(f"fixture version {reprlib.repr(version)}, this build reads {VERSION}"
                       + (f": {why}" if why else ""))
    recorded = _need(data, "sha256", "", lambda v: type(v) is str, "a str")
    if recorded != checksum(data):
        raise _Invalid("checksum mismatch: the content was changed or damaged after it was saved")
    if unknown := sorted(set(data) - _TOP):
        raise _Invalid(f"unknown field(s) {', '.join(unknown)}")
    model = _need(data, "model", "", lambda v: type(v) is str and v != "", "a model name")
    dtype = _need(data, "dtype", "", lambda v: type(v) is str and v in DTYPES, f"one of {', '.join(DTYPES)}")
    device = _need(data, "device", "", lambda v: type(v) is str and v in ("cpu", "cuda"), "cpu or cuda")
    tick = _need(data, "tick", "", lambda v: _is_int(v) and v >= 0, "an int >= 0")
    label = _need(data, "label", "", lambda v: type(v) is str, "a str")
    brightness = _need(data, "new_brightness", "", lambda v: type(v) in (int, float) and math.isfinite(v), "a number")
    columns = _section(data, "mirror")
    mirror = _parse_mirror(columns)
    ids_before, positions_before = _parse_before(_section(data, "before"), mirror)
    actions = _parse_actions(data, len(ids_before))
    step_brightness = _parse_brightness(data, len(ids_before))
    fault = _parse_fault(data)
    expected = _parse_after(_section(data, "after"))
    return Fixture(model, dtype, device, tick, label, columns, ids_before, positions_before, actions,
                   step_brightness, fault, float(brightness), expected)


def _parse_mirror(columns: dict) -> Mirror:
    """The mirror's own validation (columns, then invariants), as a session file gets."""
    try:
        return from_columns(columns, source="mirror")
    except MirrorFileError as exc:
        raise _Invalid(str(exc)) from None


def _parse_before(before: dict, mirror: Mirror) -> tuple[list[int], list[int]]:
    ids = _need(before, "live_ids", "before.", _id_list, "a list of token ids (int >= 0)")
    positions = _need(before, "positions", "before.", _int_list, "a list of int")
    if ids != mirror.live_token_ids() or positions != mirror.positions():
        raise _Invalid("before.live_ids / before.positions do not match the mirror's live rows")
    return ids, positions


def _parse_actions(data: dict, live_length: int) -> list[dict]:
    """The list as Step 4 validates it, short of the model's vocabulary (checked at replay)."""
    actions = _need(data, "actions", "", lambda v: type(v) is list and v != [], "a non-empty list")
    try:
        validate(actions, live_length=live_length, vocab_size=_HUGE, max_length=_HUGE)
    except ActionError as exc:
        raise _Invalid(f"actions: {exc}") from None
    return actions


def _float_list(value) -> bool:
    return type(value) is list and all(type(v) is float and math.isfinite(v) for v in value)


def _parse_brightness(data: dict, live_length: int) -> list[float] | None:
    """Step 2b's brightness: None, or one finite float per live row before the tick."""
    return _need(data, "brightness", "", lambda v: v is None or (_float_list(v) and len(v) == live_length),
                 f"None or a list of {live_length} finite floats (one per live row before the tick)")


def _parse_fault(data: dict) -> str | None:
    stages = " | ".join(repr(stage) for stage in FAULT_STAGES)
    return _need(data, "fault", "", lambda v: v is None or (type(v) is str and v in FAULT_STAGES),
                 f"None or a fault stage ({stages})")


def _parse_after(after: dict) -> Expected:
    ids = _need(after, "live_ids", "after.", lambda v: _id_list(v) and v != [],
                "a non-empty list of token ids (int >= 0)")
    positions = _need(after, "positions", "after.", _position_list, "a list of increasing positions (int >= 0)")
    texts = _need(after, "texts", "after.", lambda v: type(v) is list and all(type(s) is str for s in v),
                  "a list of str")
    brightness = _need(after, "brightness", "after.", _float_list, "a list of finite floats")
    if not len(ids) == len(positions) == len(texts) == len(brightness):
        raise _Invalid(f"after: {len(ids)} live ids, {len(positions)} positions, {len(texts)} texts, "
                       f"{len(brightness)} brightness values")
    rebuilt = _need(after, "rebuilt", "after.", lambda v: type(v) is bool, "a bool")
    greedy = _need(after, "greedy", "after.", lambda v: _id_list(v) and 1 <= len(v) <= 64,
                   "a list of 1-64 token ids (int >= 0)")
    rows, keys, values = _parse_layer0(_need(after, "layer0", "after.", lambda v: type(v) is dict, "a dict"),
                                       len(ids))
    return Expected(ids, positions, texts, brightness, rebuilt, rows, keys, values, greedy)


def _parse_layer0(layer0: dict, live_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows int64 [r] strictly increasing in 0..live_length-1; keys/values float32 [h, r, d] with
    1 <= h <= MAX_KV_HEADS, 1 <= d <= MAX_HEAD_DIM (the model's sizes are checked at replay)."""
    is_tensor = lambda v: type(v) is torch.Tensor  # noqa: E731 - one line
    rows = _need(layer0, "rows", "after.layer0.", lambda v: is_tensor(v) and v.dtype == torch.int64 and v.dim() == 1
                 and 1 <= len(v) <= LAYER0_ROWS, f"an int64 tensor [r], 1 <= r <= {LAYER0_ROWS}")
    listed = rows.tolist()
    if listed != sorted(set(listed)) or listed[0] < 0 or listed[-1] >= live_length:
        raise _Invalid(f"after.layer0.rows {listed} must be increasing rows of 0..{live_length - 1}")
    kind = (f"a finite float32 tensor [kv_heads, {len(listed)}, head_dim], 1 <= kv_heads <= {MAX_KV_HEADS}, "
            f"1 <= head_dim <= {MAX_HEAD_DIM}")
    valid = lambda v: (is_tensor(v) and v.dtype == torch.float32 and v.dim() == 3  # noqa: E731
                       and v.shape[1] == len(listed) and 1 <= v.shape[0] <= MAX_KV_HEADS
                       and 1 <= v.shape[2] <= MAX_HEAD_DIM and bool(torch.isfinite(v).all()))
    keys = _need(layer0, "keys", "after.layer0.", valid, kind)
    values = _need(layer0, "values", "after.layer0.", valid, kind)
    if keys.shape != values.shape:
        raise _Invalid(f"after.layer0 keys {list(keys.shape)} and values {list(values.shape)} differ in shape")
    return rows, keys, values


# --- replay ---------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class ReplayResult:
    """The comparisons, plus what the diff view needs: ledger ids of the live rows before and
    after, and every ledger entry's text after the tick."""

    checks: list[Check]
    report: ApplyReport
    live_ids: list[int]
    greedy: list[int]
    layer0_error: float
    rows_before: list[int] = field(default_factory=list)
    rows_after: list[int] = field(default_factory=list)
    ledger_texts: list[str] = field(default_factory=list)  # text per ledger id, after the tick

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def failed(self) -> list[str]:
        return [check.name for check in self.checks if not check.passed]


def tolerance(dtype: str) -> float:
    """Layer-0 tolerance: 1e-4 in float32 (DESIGN §4), looser in half precision."""
    return 1e-4 if dtype == "float32" else 2e-2


def replay(fixture: Fixture, lm) -> ReplayResult:
    """Rebuild the state from the fixture's mirror, apply its actions (injecting its fault, so
    a rebuild fixture runs the rebuild path) and compare with what was recorded."""
    where = fixture.path or "fixture"
    if lm.name != fixture.model:
        raise FixtureError(f"{where}: captured with model {fixture.model!r}, not {lm.name!r}")
    if problem := _misfit(fixture, lm):
        raise FixtureError(_one_line(f"{where}: does not fit model {lm.name!r}: {problem}"))
    try:
        state, report = _play(lm, fixture.mirror_columns, fixture.actions, tick=fixture.tick,
                              brightness=fixture.brightness, fault=fixture.fault,
                              new_brightness=fixture.new_brightness, source=str(where))
    except (ActionError, MirrorFileError, ValueError) as exc:
        raise FixtureError(_one_line(f"{where}: does not fit model {lm.name!r}: {exc}")) from None
    e = fixture.expected
    rows_after, texts = list(state.mirror.live.ledger_ids), [entry.text for entry in state.mirror.ledger.entries]
    ids, positions, live_texts = state.live_token_ids(), state.positions(), state.mirror.live_texts()
    brightness = state.mirror.brightness()
    layer0_check, error = _compare_layer0(state, e, tolerance(fixture.dtype))
    greedy = _greedy(state, len(e.greedy))
    checks = [
        _equal("live ids", ids, e.live_ids, f"{len(ids)} rows"),
        _equal("positions", positions, e.positions, f"{positions[0]}..{positions[-1]}" if positions else "none"),
        _equal("text", live_texts, e.texts, f"{len(''.join(live_texts))} characters"),
        _equal("brightness", brightness, e.brightness,
               f"{min(brightness):g}..{max(brightness):g}" if brightness else "none"),
        layer0_check,
        _equal("greedy", greedy, e.greedy, f"{greedy} {''.join(span_texts(lm.decode, greedy, ids[-1]))!r}"),
        _equal("rebuild", report.rebuilt, e.rebuilt, "rebuilt from the mirror" if report.rebuilt else "no rebuild"),
    ]
    return ReplayResult(checks, report, ids, greedy, error, list(fixture.mirror_columns["live"]["ledger_ids"]),
                        rows_after, texts)


def _misfit(fixture: Fixture, lm) -> str | None:
    """What in the fixture `lm` cannot take, found before any state is built (load_fixture
    checked everything that needs no model): a token id outside its vocabulary, a RoPE
    position at or beyond its limit, an action list it refuses, layer-0 K/V of other sizes."""
    e = fixture.expected
    for name, ids in (("before.live_ids", fixture.live_ids_before), ("after.live_ids", e.live_ids),
                      ("after.greedy", e.greedy)):
        if bad := _first_outside(ids, lm.vocab_size):
            return f"{name}[{bad[0]}] = {bad[1]} is outside the vocabulary 0..{lm.vocab_size - 1}"
    for name, positions in (("before.positions", fixture.positions_before), ("after.positions", e.positions)):
        if bad := _first_outside(positions, lm.max_positions):
            return f"{name}[{bad[0]}] = RoPE position {bad[1]}, outside the model's 0..{lm.max_positions - 1}"
    try:
        validate(fixture.actions, live_length=len(fixture.live_ids_before), vocab_size=lm.vocab_size,
                 max_length=lm.max_positions)
    except ActionError as exc:
        return f"actions: {exc}"
    heads, _, head_dim = e.layer0_keys.shape
    if (heads, head_dim) != (lm.num_kv_heads, lm.head_dim):
        return (f"after.layer0 holds {heads} kv heads of size {head_dim}, the model has {lm.num_kv_heads} "
                f"of size {lm.head_dim}")
    return None


def _first_outside(values: list[int], limit: int) -> tuple[int, int] | None:
    """(index, value) of the first value outside 0..limit-1, or None."""
    return next(((index, v) for index, v in enumerate(values) if not 0 <= v < limit), None)


def _equal(name: str, got, want, detail: str) -> Check:
    if got == want:
        return Check(name, True, detail)
    if isinstance(got, list) and isinstance(want, list):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return Check(name, False, f"differ at index {first} (lengths {len(got)} / expected {len(want)}): "
                                  f"got {_show(got[first:first + 3])}, expected {_show(want[first:first + 3])}")
    return Check(name, False, f"got {got!r}, expected {want!r}")


def _compare_layer0(state: StateManager, e: Expected, limit: float) -> tuple[Check, float]:
    rows = e.layer0_rows.tolist()
    if rows[-1] >= len(state):
        return Check("layer-0 K/V", False, f"row {rows[-1]} does not exist ({len(state)} rows)"), math.inf
    keys, values = _layer0(state, rows)  # [kv_heads, rows, head_dim]: the sizes _misfit checked
    error = max((keys - e.layer0_keys).abs().max().item(), (values - e.layer0_values).abs().max().item())
    detail = f"rows {rows}, max |diff| {error:.1e} (limit {limit:.0e})"
    return Check("layer-0 K/V", error <= limit, detail), error


# --- the replay view ------------------------------------------------------------------------

ELIDE_KEEP = 12  # unchanged tokens kept on each side of a change in the text view


def describe_action(action: dict, texts_before: list[str], decode) -> str:
    """One action in words, quoting the text of the rows it touches."""
    name = action["action"]
    if name == "add":
        return f"add token {action['token_id']} ({decode([action['token_id']])!r}) at the end"
    if name == "delete":
        row = action["position"]
        return f"delete row {row} ({texts_before[row]!r})"
    p1, p2, new = action["original_pos1"], action["original_pos2"], action["new_token_ids"]
    old = "".join(texts_before[p1:p2 + 1])
    return f"replace rows {p1}-{p2} ({old!r}) with {len(new)} token{'s' * (len(new) != 1)} ({decode(new)!r})"


def diff_segments(rows_before: list[int], rows_after: list[int], texts: list[str]) -> list[tuple[str, str]]:
    """The tick as one token sequence of (text, kind), kind in same / removed / inserted.

    rows_before / rows_after: ledger ids of the live rows; texts: text per ledger id. Ledger
    ids are unique and never reused, so a diff over them is exact."""
    merged: list[tuple[str, str]] = []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, rows_before, rows_after, autojunk=False).get_opcodes():
        if op == "equal":
            merged += [(texts[i], "same") for i in rows_before[a0:a1]]
        else:
            merged += [(texts[i], "removed") for i in rows_before[a0:a1]]
            merged += [(texts[i], "inserted") for i in rows_after[b0:b1]]
    return merged


def elide(segments: list[tuple[str, str]], keep: int = ELIDE_KEEP) -> list[tuple[str, str]]:
    """Keep `keep` unchanged tokens on each side of every change; longer unchanged runs are
    cut, the cut marked by an "elided" segment. With no change at all, the last 2*keep stay."""
    out: list[tuple[str, str]] = []
    run: list[tuple[str, str]] = []

    def flush(at_end: bool) -> None:
        at_start = not out
        if at_start and at_end:
            head, tail, mark = [], run[-2 * keep:], ("… ", "elided")
        else:
            head, tail = ([] if at_start else run[:keep]), ([] if at_end else run[-keep:])
            mark = ("… ", "elided") if at_start else (" …", "elided") if at_end else (" … ", "elided")
        out.extend(run if len(run) <= len(head) + len(tail) + 1 else head + [mark] + tail)
        run.clear()

    for segment in segments:
        if segment[1] == "same":
            run.append(segment)
        else:
            flush(at_end=False)
            out.append(segment)
    flush(at_end=True)
    return out


def side(segments: list[tuple[str, str]], which: str) -> list[tuple[str, str]]:
    """The before (which="before": no inserted text) or after (no removed text) view."""
    drop = "inserted" if which == "before" else "removed"
    return [segment for segment in segments if segment[1] != drop]


STYLES = {"same": "", "removed": "red strike", "inserted": "bold green", "elided": "dim"}
MARKERS = {"removed": ("[-", "-]"), "inserted": ("{+", "+}")}  # wdiff style, for output without colour


def _styled(segments: list[tuple[str, str]], *, marked: bool):
    """A rich Text of the segments; consecutive pieces of one kind form one run. `marked`
    also brackets removed and inserted runs, so the change shows without colour."""
    from rich.text import Text

    runs: list[list[str]] = []  # [kind, text]
    for piece, kind in segments:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += piece
        else:
            runs.append([kind, piece])
    text = Text()
    for kind, piece in runs:
        opening, closing = MARKERS.get(kind, ("", "")) if marked else ("", "")
        text.append(opening + piece + closing, style=STYLES[kind])
    return text


def print_replay(path: Path) -> None:
    """Load a fixture and the model named in it, replay it, and print what the tick does:
    its actions in words, the text before and after (removed text red and struck through,
    inserted text green) and each check. Exits with code 1 if a check fails."""
    from rich.console import Console

    from .models import load_model

    fixture = load_fixture(path)
    device = "cuda" if fixture.device == "cuda" and torch.cuda.is_available() else "cpu"
    lm = load_model(fixture.model, device=device, dtype=fixture.dtype)
    result = replay(fixture, lm)
    console = Console(highlight=False, soft_wrap=True)
    for line in _header(fixture, result, lm.decode):
        console.print(line)
    shown = elide(diff_segments(result.rows_before, result.rows_after, result.ledger_texts))
    marked = console.color_system is None  # no colour: bracket the changes instead
    console.print(_styled([("before: ", "same")] + side(shown, "before"), marked=marked))
    console.print(_styled([("after:  ", "same")] + side(shown, "after"), marked=marked))
    console.print("checks:")
    for check in result.checks:
        mark = "[green]PASS[/green]" if check.passed else "[bold red]FAIL[/bold red]"
        console.print(f"  {mark}  {check.name:<12} {_escape(check.detail)}")
    if result.passed:
        console.print("[green]PASS[/green]: the replay reproduces the captured tick")
    else:
        console.print(f"[bold red]FAIL[/bold red]: {', '.join(result.failed())} differ from the capture")
        raise SystemExit(1)


def _header(fixture: Fixture, result: ReplayResult, decode) -> list[str]:
    """Markup lines: which tick, then its actions in words (`decode`: ids -> text)."""
    texts_before = [result.ledger_texts[i] for i in result.rows_before]
    lines = [_escape(f"fixture {fixture.path}: model {fixture.model} ({fixture.dtype}), tick {fixture.tick}"
                     + (f" - {fixture.label}" if fixture.label else "")),
             f"{len(result.rows_before)} live rows before, {len(result.rows_after)} after; actions:"]
    lines += [_escape("  " + describe_action(a, texts_before, decode)) for a in fixture.actions]
    if fixture.brightness is not None:
        lines.append(f"  Step 2b brightness stored for the {len(fixture.brightness)} rows")
    if fixture.fault is not None:
        error = result.report.error or "it did not fire"
        lines.append(_escape(f"  fault injected at stage {fixture.fault!r}: {error}; the tick was not applied "
                             "(the mirror is the one from before it) and the cache was rebuilt from the mirror"))
    return lines


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)

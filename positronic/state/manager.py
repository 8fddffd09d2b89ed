"""StateManager: the only code that changes the KV cache or the mirror.

Every change, from a whole tick to one deleted row, is one `Layout` (mirror/layout.py)
applied to both blades from the same arguments:

    1. plan      the rows afterwards and their RoPE positions (pure; nothing touched yet)
    2. splice    the cache moves its surviving rows into place, opening gaps for new tokens
    3. rotate    keys whose position had to change are re-rotated (rare)
    4. forward   ONE model forward writes every new token's K/V into its gap: an inserted
                 token sees only the rows left of it (the mask follows positions), the newest
                 token sees everything and leaves the next logits and the attention row
    5. commit    the mirror takes the layout: ledger entries, live map, brightness

If anything fails in 2–5 the mirror is still the one from before the tick (the mirror undoes
its own half-done splice), and the cache is rebuilt from it: a tick happens entirely or not at
all. If the rebuild fails too, the state is marked broken (`broken` says why): every edit and
every save refuses until a `rebuild()` succeeds. Nothing else gets write access:
policies, repairers, the view and the tools read `view()` (fresh tensors) or read-only
properties, and hand their decisions back as arguments of `apply()`.

    cache.layers[l].keys / .values   [1, kv_heads, rows, head_dim] (SpliceCache; with a 4-bit
                                     kv_format, decoded copies of the stored rows)
    mirror.live.positions[i]         RoPE position row i's key was rotated with
    mirror.layers                    None, or per layer the ledger ids its cache rows hold, when
                                     layers keep different rows (`split_layers`, a per-layer
                                     policy: SmartKV); the live map is then their union
    mirror.ring                      None, or with the ring store (kv_store="ring") the slot of every
                                     row (mirror/ring.py): the cache's ring, recorded at each commit
    next_logits                      [vocab] float32, from the forward that wrote the last row
    last_attention                   [scored layers, heads, rows] float32, that row's attention
    last_query, last_log_norm        [scored layers, heads, head_dim], [scored layers, heads]: its
                                     scaled query and log-normaliser (forward.ForwardResult)
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

import torch

from positronic.mirror import Insertion, LayerRows, Layout, Mirror, plan_layout, runs_without
from positronic.steps.attention import layer_indices

from ..kv import formats as kv_formats, rope
from ..kv.cache import SpliceCache, check_store
from ..kv.centres import key_centres
from ..text import span_texts
from . import checks, persistence
from .actions import ActionError, validate
from .faults import NO_FAULTS, Fault
from .forward import Probes, forward, prefill
from .readonly import CacheView, MirrorView
from .view import ContextView, RowReader, snapshot


class StateBrokenError(RuntimeError):
    """The cache could not be rebuilt from the mirror after a failed edit: the state cannot be
    used (or saved) until `rebuild()` succeeds."""


@dataclass
class ApplyReport:
    """What one `apply` did. `rebuilt` is True when a stage failed: the tick was not applied
    and the cache was recomputed from the (unchanged) mirror; `error` says what failed."""

    tick: int
    applied: int = 0
    edits: int = 0
    rotated_rows: int = 0
    rebuilt: bool = False
    error: str | None = None
    seconds: float = 0.0
    probe_logprobs: list[float] | None = None  # one per probe asked for (see forward.Probes)


def default_capacity(rows: int) -> int:
    """Rows to preallocate for a context of `rows`: a quarter more plus 64, so that appends and
    edits rarely have to pack the rows down (the cache grows by doubling if ever needed)."""
    return rows + rows // 4 + 64


class StateManager:
    def __init__(self, lm, mirror: Mirror | None = None, *, capacity: int = 0, score_layers="last",
                 new_brightness: float = 255.0, kv_format: str = "float", kv_store: str = "splice", sinks: int = 0):
        self.lm = lm
        self._mirror = mirror if mirror is not None else Mirror()
        self.attention_layers = layer_indices(score_layers, lm.num_layers)  # "last", "all" or ints
        self.kv_format = kv_formats.check_format(kv_format)  # how the cache stores rows: float | int4 | fp4 | int4h
        self.kv_store = check_store(kv_store)  # where: splice (one window of the buffer) | ring (cache.RingLayer)
        ring = self._mirror.ring
        if ring is not None and kv_store != "ring":
            raise ValueError("the mirror records a ring store's slots: resume it with kv_store ring")
        if ring is None and kv_store == "ring" and len(self._mirror):
            raise ValueError("a ring store resumes from a mirror that records its slots")
        if kv_store == "ring" and self._mirror.layers is not None:
            raise ValueError("per-layer rows need the splice store")
        capacity = capacity or default_capacity(len(self._mirror))
        # a resumed ring keeps its recorded slots (capacity included): the rows go back where they were
        self._cache = self._new_cache(ring.capacity if ring else capacity, store=kv_store,
                                      sinks=ring.sinks if ring else sinks)
        if ring is not None:
            self._cache.set_ring(ring)
        elif kv_store == "ring":
            self._mirror.ring = self._cache.ring  # an empty mirror starts recording the cursor
        self.new_brightness = float(new_brightness)  # where a new token's brightness starts (the rule's)
        self.next_logits: torch.Tensor | None = None
        self.last_attention: torch.Tensor | None = None
        self.last_query: torch.Tensor | None = None
        self.last_log_norm: torch.Tensor | None = None
        self._predicted: list[int] = []  # per live row, see ContextView.predicted
        self._requantized: list[int] = []  # per live row: times its 4-bit key was re-rotated (rounding_bounds)
        self.last_tick = 0
        self.rebuilds = 0
        self.rotated_rows = 0
        self._edits = 0
        self._version = 0  # any change to the cache (edit, rebuild) moves it on: stale views refuse
        self._faults = NO_FAULTS  # test-only fault injection (faults.py): hooks that do nothing
        self._broken: str | None = None  # why the cache no longer matches the mirror

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_tokens(cls, lm, token_ids: list[int], *, source: str = "prompt", brightness: float = 255.0,
                    capacity: int = 0, score_layers="last", kv_format: str = "float", kv_store: str = "splice",
                    sinks: int = 0) -> "StateManager":
        """Prefill `token_ids` (the caller adds BOS if it wants one) at positions 0..n-1.
        kv_store "ring": rows 0..sinks-1 keep their slots, the rest wrap round (cache.RingLayer)."""
        if not token_ids:
            raise ValueError("a context needs at least one token")
        manager = cls(lm, capacity=capacity or default_capacity(len(token_ids)), score_layers=score_layers,
                      new_brightness=brightness, kv_format=kv_format, kv_store=kv_store, sinks=sinks)
        report = manager._edit([], [Insertion(0, tuple(token_ids), source)], tick=0)
        if report.rebuilt:
            raise RuntimeError(f"prefill failed: {report.error}")
        return manager

    @classmethod
    def from_mirror(cls, lm, mirror: Mirror, *, capacity: int = 0, score_layers="last",
                    brightness: float = 255.0, kv_format: str = "float", kv_store: str = "splice") -> "StateManager":
        """Resume from a saved mirror: the cache is recomputed from its live rows (with a ring
        store, into the slots the mirror records)."""
        mirror.check(lm.max_positions)
        manager = cls(lm, mirror, capacity=capacity, score_layers=score_layers, new_brightness=brightness,
                      kv_format=kv_format, kv_store=kv_store)
        manager.rebuild(count=False)
        return manager

    @classmethod
    def from_saved(cls, lm, mirror: Mirror, tensors: dict[str, torch.Tensor], *, capacity: int = 0,
                   score_layers="last", brightness: float = 255.0, kv_format: str = "float",
                   kv_store: str = "splice") -> "StateManager":
        """Resume from a saved mirror and the cache it described (`tensors()` of the state that
        was saved): the rows are loaded, not recomputed, so the run goes on exactly as it would
        have. Raises ValueError naming what does not fit (a shape, a dtype, a token outside the
        vocabulary) before anything is allocated, and StateInvariantError if layer 0 does not
        match a fresh computation of the mirror's tokens at their positions. An int4 or fp4 cache
        saves its rows decoded (`tensors`) and encodes them again here: in float32 that gives back
        the same codes and scales (kv_formats.PackedFormat.decode); int4h saves its codes. A ring store's rows are
        saved in row order and go back into the slots the mirror records (its cursor)."""
        return persistence.from_saved(cls, lm, mirror, tensors, capacity=capacity, score_layers=score_layers,
                                      brightness=brightness, kv_format=kv_format, kv_store=kv_store)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What `from_saved` needs besides the mirror, as CPU copies:
        keys, values [layers, kv_heads, rows, head_dim] (model dtype; an int4 or fp4 cache's rows
        decoded), or for int4h its rows as stored: key_ and value_codes int32 [layers, kv_heads,
        rows, head_dim // 8], _scales float16 and _zeros uint8 [layers, kv_heads, rows, groups];
        predicted [rows] int64;
        next_logits [vocab], last_attention [scored layers, heads, rows], last_query and
        last_log_norm float32 when the last edit left them; with a 4-bit format requantized
        [rows] int64 (how often each key was re-rotated, for the deep check's tolerance)."""
        return persistence.tensors(self)

    def _new_cache(self, capacity: int, store: str = "splice", sinks: int = 0) -> SpliceCache:
        """A cache in this state's format (int4h: with the model's key centres, kv_centres.py)."""
        centres = key_centres(self.lm) if self.kv_format == "int4h" else None
        return SpliceCache(self.lm.model.config, max_cache_len=capacity, kv_format=self.kv_format, store=store,
                           sinks=sinks, key_centres=centres)

    # --- reads (copies or read-only views) ----------------------------------------------

    @property
    def mirror(self) -> MirrorView:
        """A read-only view of the mirror (sessions save it, the live view draws it): any write
        through it raises ReadOnlyError. Only StateManager changes the mirror (`_mirror`)."""
        return MirrorView(self._mirror)

    @property
    def cache(self) -> CacheView:
        """A read-only view of the cache (lengths, memory, layers; their tensors come out
        cloned). The model reads and writes the real one (`_cache`) inside StateManager's forwards."""
        return CacheView(self._cache)

    def __len__(self) -> int:
        return len(self._mirror)

    @property
    def per_layer(self) -> bool:
        """True when layers keep different rows (`split_layers`): the live map is the union."""
        return self._mirror.layers is not None

    @property
    def lanes(self) -> int:
        """Units that keep their own rows: the layers, or with per-head rows layers × kv heads
        (lane = layer * kv_heads + head); 0 while every layer holds the same rows."""
        return self._mirror.layers.num_layers if self.per_layer else 0

    @property
    def lanes_per_layer(self) -> int:
        """1 (a lane per layer, or no lanes at all) or the kv heads (per-head rows)."""
        return max(1, self.lanes // self.lm.num_layers)

    @property
    def rows_per_layer(self) -> int:
        """Rows each layer's cache holds (the live length, unless layers keep different rows)."""
        return len(self._mirror.layers) if self.per_layer else len(self._mirror)

    @property
    def version(self) -> int:
        """Moves on with every change to the cache (an edit, a rebuild): a view taken before is stale."""
        return self._version

    @property
    def broken(self) -> str | None:
        """Why the state is unusable (a rebuild failed), or None."""
        return self._broken

    def _refuse_if_broken(self, what: str) -> None:
        if self._broken:
            raise StateBrokenError(f"cannot {what}: {self._broken}")

    @property
    def edits(self) -> int:
        """Coupled edits (applied layouts) since this manager was created."""
        return self._edits

    def live_token_ids(self) -> list[int]:
        return self._mirror.live_token_ids()

    def positions(self) -> list[int]:
        return self._mirror.positions()

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer `index`'s live keys and values, [1, kv_heads, rows, head_dim]
        (decoded, with a 4-bit kv_format)."""
        layer = self._cache.layers[index]
        return layer.keys.clone(), layer.values.clone()

    def memory_bytes(self) -> int:
        """Bytes the cache holds: K/V buffers (4-bit: codes and scales), spare rows and scratch."""
        return self._cache.memory_bytes()

    def bytes_per_token(self) -> int:
        """Cache bytes one live token takes in this state's kv_format (every layer's K and V)."""
        lm = self.lm
        return kv_formats.bytes_per_token(self.kv_format, layers=lm.num_layers, kv_heads=lm.num_kv_heads,
                                          head_dim=lm.head_dim, dtype=lm.dtype)

    def view(self, *, keys: bool = False) -> ContextView:
        """A read-only snapshot; `keys`: with the newest query and a reader of rows' K/V."""
        rows = RowReader(self, self._cache, self._mirror) if keys else None
        return snapshot(self, self._mirror, self._predicted, keys=keys, rows=rows)

    # --- coupled operations -------------------------------------------------------------

    def delete(self, row: int, *, tick: int | None = None) -> ApplyReport:
        """Remove live row `row` from cache and mirror (not with per-layer rows: `apply` a drop)."""
        self._refuse_per_layer("delete")
        self._check_row(row, len(self) - 1)
        return self._edit([row], [], tick=tick)

    def insert(self, row: int, token_ids: list[int], *, source: str = "inserted",
               tick: int | None = None) -> ApplyReport:
        """Insert tokens before live row `row`; their K/V see only the rows before them."""
        self._refuse_per_layer("insert")
        self._check_row(row, len(self))
        return self._edit([], [Insertion(row, tuple(token_ids), source)], tick=tick)

    def append(self, token_ids: list[int], *, source: str = "generated", tick: int | None = None) -> ApplyReport:
        """Append tokens after the last row; leaves `next_logits` and `last_attention`. With
        per-layer rows every layer appends them, one edit per token."""
        if not self.per_layer:
            return self._edit([], [Insertion(len(self), tuple(token_ids), source)], tick=tick)
        if not token_ids:
            raise ValueError("append needs at least one token")
        for token_id in token_ids:
            report = self._edit_layers([[] for _ in range(self.lanes)], [token_id], tick=tick,
                                       brightness=None, source=source)
            if report.rebuilt:
                break
        return report

    def _refuse_per_layer(self, what: str) -> None:
        if self.per_layer:
            raise ActionError(f"cannot {what} a row when layers keep different rows: apply a drop action")

    def split_layers(self, heads: int = 1) -> None:
        """Let layers keep different rows from now on (a per-layer policy: SmartKV): the
        mirror gets per-layer rows (mirror/layer_rows.py), every layer holding today's live
        rows, and edits become `drop` (rows per lane) and `add` actions. heads: 1 (a lane per
        layer) or the kv heads (a lane per kv head of each layer: heads keep different rows
        too). Only with the float kv_format. There is no way back: the lanes' rows would differ."""
        self._refuse_if_broken("split the layers")
        if heads not in (1, self.lm.num_kv_heads):
            raise ValueError(f"lanes per layer must be 1 or the {self.lm.num_kv_heads} kv heads, not {heads}")
        if self.per_layer:
            if self.lanes != self.lm.num_layers * heads:
                kinds = {1: "per layer", self.lm.num_kv_heads: "per kv head"}
                raise ValueError(f"the state keeps rows {kinds[self.lanes_per_layer]}, the gates score "
                                 f"{kinds[heads]}: per-layer and per-head rows cannot be swapped (go on with the "
                                 "gates the run started with: --gates FILE)")
            return
        if kv_formats.packed(self.kv_format):
            raise ValueError(f"per-layer rows need the float kv_format, not {self.kv_format}")
        if self.kv_store == "ring":
            raise ValueError("per-layer rows need the splice store: a ring keeps one cursor for every layer")
        self._mirror.layers = LayerRows.every_layer(self.lm.num_layers * heads, self._mirror.live.ledger_ids)
        self._version += 1

    def pin(self, rows: list[int]) -> None:
        """Pin live rows: no policy evicts or repairs them (they stay pinned until `unpin`)."""
        self._mirror.set_pinned(self._rows(rows), True)

    def unpin(self, rows: list[int]) -> None:
        self._mirror.set_pinned(self._rows(rows), False)

    @staticmethod
    def _rows(rows) -> list[int]:
        rows = list(rows)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
            raise ValueError(f"rows must be ints, got {rows!r}")
        return rows

    def _check_row(self, row: int, last: int) -> None:
        if not 0 <= row <= last:
            raise IndexError(f"row {row} out of range 0..{last}")

    # --- Step 4 -------------------------------------------------------------------------

    def apply(self, actions: list[dict], *, tick: int | None = None,
              brightness: list[float] | torch.Tensor | None = None, add_source: str = "generated",
              probes: Probes | None = None) -> ApplyReport:
        """Step 4: validate the whole list (ActionError, state untouched), then apply it as
        one layout and one forward.

        Positions in the actions are rows before the tick. A replace_pair's tokens take the
        place of its first row; adds go last, in list order. `tick` stamps the ledger (default:
        the last tick + 1); `brightness` (one per live row before the tick, Step 2b) is stored
        with the tick; `add_source` is the ledger source of the added tokens ("prompt" when a
        long prompt's last token comes in with its bulk prune). A failure after validation is
        reported (`rebuilt`), not raised. `probes` ride along in the tick's forward (the list
        must add a token) and their log-probabilities come back in the report; their scratch
        rows are dropped, so they change nothing.
        """
        plan = validate(actions, live_length=len(self), vocab_size=self.lm.vocab_size,
                        max_length=self.lm.max_positions,
                        layers=(self.lanes, self.rows_per_layer) if self.per_layer else None)
        brightness = self._checked_brightness(brightness)
        if self.per_layer:
            if probes:
                raise ValueError("probes need every layer to hold the same rows")
            if len(plan.adds) > 1:
                raise ActionError("a per-layer state adds at most one token per edit")
            report = self._edit_layers(plan.drops or [[] for _ in range(self.lanes)],
                                       [action["token_id"] for action in plan.adds], tick=tick,
                                       brightness=brightness, source=add_source)
            report.applied = 0 if report.rebuilt else len(actions)
            return report
        deleted, insertions = [], []
        for action in plan.edits:
            if action["action"] == "delete":
                deleted.append(action["position"])
            else:
                pair = (action["original_pos1"], action["original_pos2"])
                deleted += pair
                insertions.append(Insertion(pair[0], tuple(action["new_token_ids"]), "repair", replaces=pair))
        if plan.restored:
            insertions += self._restorations(plan.restored, set(deleted))
        stored = checks.checked_stored_rows(self.lm, self.kv_format, self._cache.layers[0], self._mirror.ledger,
                                             plan.stored)
        insertions += [Insertion(len(self), (action["token_id"],), add_source) for action in plan.adds]
        if probes:
            if self.kv_store == "ring":
                raise ValueError("probes need the splice store: a ring keeps no scratch rows")
            if not plan.adds:
                raise ValueError("probes ride along in a forward: the action list must add a token")
            if max(probes.positions) >= max(self._mirror.live.positions, default=0) + 1 + len(plan.adds):
                raise ValueError("a probe's position must lie within the context")
        report = self._edit(deleted, insertions, tick=tick, brightness=brightness, probes=probes, stored=stored)
        report.applied = 0 if report.rebuilt else len(actions)
        return report

    def _checked_brightness(self, brightness) -> list[float] | None:
        """Step 2b's brightness as floats, one finite value per live row (ValueError otherwise)."""
        if brightness is None:
            return None
        brightness = [float(b) for b in (brightness.tolist() if torch.is_tensor(brightness) else brightness)]
        if len(brightness) != len(self):
            raise ValueError(f"{len(brightness)} brightness values for {len(self)} live rows")
        if not all(math.isfinite(b) for b in brightness):
            raise ValueError("brightness values must be finite")
        return brightness

    def _restorations(self, ledger_ids: tuple[int, ...], deleted: set[int]) -> list[Insertion]:
        """Insertions that bring culled ledger entries back at the positions they held, one per
        gap between surviving rows. ActionError for an id that is not a culled token with a
        recorded position, or whose position a surviving row holds now."""
        ledger, live = self._mirror.ledger, self._mirror.live
        entries = []
        for ledger_id in ledger_ids:
            entry = ledger[ledger_id] if ledger_id < len(ledger) else None
            if entry is None or entry.state != "culled" or entry.position is None:
                state = "no ledger entry" if entry is None else f"{entry.state}{'' if entry.position is not None else ', no position'}"
                raise ActionError(f"restore: ledger id {ledger_id} cannot come back ({state})")
            entries.append((entry.position, ledger_id, entry))
        taken = {p for row, p in enumerate(live.positions) if row not in deleted}
        groups: dict[int, list] = {}
        for position, ledger_id, entry in sorted(entries):
            if position in taken:
                raise ActionError(f"restore: ledger id {ledger_id}'s position {position} is held by a live row")
            groups.setdefault(bisect.bisect_left(live.positions, position), []).append((position, ledger_id, entry))
        return [Insertion(row, tuple(e.token_id for _, _, e in group), group[0][2].source,
                          positions=tuple(p for p, _, _ in group), restores=tuple(i for _, i, _ in group))
                for row, group in sorted(groups.items())]

    def _edit(self, deleted: list[int], insertions: list[Insertion], *, tick: int | None,
              brightness: list[float] | None = None, probes: Probes | None = None,
              stored: dict | None = None) -> ApplyReport:
        self._refuse_if_broken("edit")
        self._version += 1
        start = time.perf_counter()
        tick = self.last_tick + 1 if tick is None else tick
        layout = plan_layout(self._mirror.live.positions, deleted, insertions, self.lm.max_positions)
        texts = self._texts(layout)
        report = ApplyReport(tick=tick)

        def write_and_commit():
            report.probe_logprobs = self._write(layout, probes, stored or {})
            self._faults.point("commit")
            self._mirror.splice(layout, texts, tick=tick, brightness=self.new_brightness, live_brightness=brightness,
                                ring=self._cache.ring)
            report.rotated_rows = self._rotated(layout)
        return self._transaction(report, start, write_and_commit)

    def _edit_layers(self, drops: list[list[int]], adds: list[int], *, tick: int | None,
                     brightness: list[float] | None, source: str) -> ApplyReport:
        """A per-layer edit: layer l drops its rows drops[l], then every layer appends `adds`
        (at most one token) in the same forward. A token no layer holds any more retires
        from the ledger; the live map (the union) and the per-layer rows change together."""
        self._refuse_if_broken("edit")
        self._version += 1
        start = time.perf_counter()
        tick = self.last_tick + 1 if tick is None else tick
        mirror = self._mirror
        kept = mirror.layers.after(drops, [])  # LayerRowsError (a ValueError): nothing touched yet
        deleted = [row for row, ledger_id in enumerate(mirror.live.ledger_ids) if ledger_id not in kept.counts]
        insertions = [Insertion(len(mirror), (token_id,), source) for token_id in adds]
        layout = plan_layout(mirror.live.positions, deleted, insertions, self.lm.max_positions)
        texts = self._texts(layout)
        runs = [runs_without(len(mirror.layers), dropped) for dropped in drops]
        length = len(mirror.layers) - len(drops[0]) + len(adds)
        report = ApplyReport(tick=tick)

        def write_and_commit():
            self._write_layers(layout, runs, length, kept.rows, adds)
            self._faults.point("commit")
            mirror.splice(layout, texts, tick=tick, brightness=self.new_brightness, live_brightness=brightness,
                          layer_drops=drops)
            report.rotated_rows = self._rotated(layout)
        return self._transaction(report, start, write_and_commit)

    def _transaction(self, report: ApplyReport, start: float, write_and_commit) -> ApplyReport:
        """Run an edit's cache writes and mirror commit: all of it, or (on any failure or an
        interrupt) a rebuild of the cache from the unchanged mirror, reported as `rebuilt`."""
        tick = report.tick
        try:
            write_and_commit()
            self._edits += 1
            report.edits = 1
            self.rotated_rows += report.rotated_rows
        except BaseException as exc:
            report.error = f"{type(exc).__name__}: {exc}"
            try:
                self.rebuild()
            except BaseException as again:
                raise StateBrokenError(f"tick {tick} failed ({report.error}) and so did the rebuild from the mirror "
                                       f"({type(again).__name__}: {again}); the state is unusable and is not saved") from exc
            report.rebuilt = True
            if not isinstance(exc, Exception):  # Ctrl-C: consistent again, now stop
                raise
        self.last_tick = tick
        report.seconds = time.perf_counter() - start
        return report

    def _write(self, layout: Layout, probes: Probes | None, stored: dict) -> list[float] | None:
        """Stages 2–4 on the cache: splice, re-rotate, restored rows' own K/V (`stored`, by
        ledger id) copied in, one forward for the other new rows (with the probes' scratch
        rows after the live rows, dropped again). Returns the probes' log-probabilities."""
        predicted_before, requantized_before = self._predicted, self._requantized
        scratch = len(probes) if probes and layout.old_length and layout.new_rows else 0
        if layout.old_length:
            self._cache.splice(list(layout.kept), layout.length + scratch)
        else:
            self._cache.reserve(layout.length)  # a ring lays out its mask before the prefill: room first
        # int4h reads every key at its row's position (a moved row's re-rotation), probes' scratch rows included
        self._cache.set_positions(layout.positions, probes.positions if scratch else ())
        self._faults.point("splice")
        if layout.moved is not None:
            first = layout.moved
            cos, sin = rope.rotation(self.lm.inv_freq, torch.tensor(layout.old_positions[first:]),
                                     torch.tensor(layout.positions[first:]))
            self._cache.rotate_keys(first, cos, sin)
        self._faults.point("rotate")
        predicted, requantized = [0] * layout.length, [0] * layout.length
        for old, new, count in layout.kept:
            predicted[new : new + count] = predicted_before[old : old + count]
            requantized[new : new + count] = requantized_before[old : old + count]
        if layout.moved is not None and self._cache.rotation_rounds:
            for row in range(layout.moved, layout.length):  # new rows keep their own position: 0
                requantized[row] += layout.old_positions[row] != layout.positions[row]
        known = {row: stored[ledger_id] for insertion, part in layout.groups
                 for row, ledger_id in zip(layout.new_rows[part], insertion.restores) if ledger_id in stored}
        if known:
            self._copy_rows(known)
            for row, (_, _, token_id) in known.items():
                predicted[row] = token_id
                requantized[row] = 1  # what checked_stored_rows allowed it
        fed = [(row, token_id) for row, token_id in zip(layout.new_rows, layout.new_token_ids) if row not in known]
        newest = bool(fed) and fed[-1][0] == layout.length - 1
        if layout.deleted or layout.new_rows or layout.moved is not None:  # the last forward is history
            self._take_newest(None)
        probe_logprobs = None
        if fed:
            rows = [row for row, _ in fed]
            token_ids = [token_id for _, token_id in fed]
            positions = [layout.positions[row] for row in rows]
            if layout.old_length == 0:
                result = prefill(self.lm, self._cache, token_ids, positions, attention_layers=self.attention_layers)
            else:
                gaps = torch.tensor(rows + list(range(layout.length, layout.length + scratch)), dtype=torch.long,
                                    device=self.lm.device)
                with self._cache.fill(gaps), self._faults.forward():
                    result = forward(self.lm, self._cache, token_ids, positions,
                                     list(layout.positions), attention_layers=self.attention_layers if newest else None,
                                     probes=probes if scratch else None)
                if scratch:
                    for layer in self._cache.layers:
                        layer.crop(-scratch)
                    probe_logprobs = result.probe_logprobs.tolist()
            for row, token_id in zip(rows, result.predicted.tolist()):
                predicted[row] = token_id
            if newest:
                self._take_newest(result)
        self._faults.point("forward")
        self._predicted, self._requantized = predicted, requantized
        return probe_logprobs

    def _write_layers(self, layout: Layout, runs: list[list[tuple[int, int, int]]], length: int,
                      kept_ids: list[list[int]], adds: list[int]) -> None:
        """A per-layer edit's stages 2–4: each layer closes up its own kept rows, keys are
        re-rotated where the union's positions were packed (each layer its own rows), and
        one forward writes the added token into the last row of every layer."""
        mirror = self._mirror
        self._cache.splice_layers(runs, length)
        self._faults.point("splice")
        new_position = {ledger_id: layout.positions[new + k] for old, new, count in layout.kept
                        for k, ledger_id in enumerate(mirror.live.ledger_ids[old:old + count])}
        if layout.moved is not None:  # the union's positions were packed down: follow them
            old_position = dict(zip(mirror.live.ledger_ids, mirror.live.positions))
            heads = self.lanes_per_layer
            for index, layer in enumerate(self._cache.layers):
                lanes = kept_ids[index * heads : (index + 1) * heads]  # each lane its own rows
                cos, sin = (torch.stack(t) for t in zip(*(
                    rope.rotation(self.lm.inv_freq, torch.tensor([old_position[i] for i in ids]),
                                  torch.tensor([new_position[i] for i in ids])) for ids in lanes)))
                # [lanes, rows, head_dim]: one lane (a layer) rotates every head alike
                layer.rotate_keys(0, cos[0] if heads == 1 else cos, sin[0] if heads == 1 else sin)
                # unmoved rows get an identity rotation: exact
        self._faults.point("rotate")
        predicted = [0] * layout.length
        for old, new, count in layout.kept:
            predicted[new:new + count] = self._predicted[old:old + count]
        self._take_newest(None)
        if adds:
            position = layout.positions[layout.new_rows[0]]
            key_positions = [new_position[i] for i in kept_ids[0]] + [position]  # layer 0's: only their count matters
            with self._cache.fill(torch.tensor([length - 1], dtype=torch.long, device=self.lm.device)), \
                    self._faults.forward():
                result = forward(self.lm, self._cache, adds, [position], key_positions,
                                 attention_layers=self.attention_layers)
            predicted[layout.new_rows[0]] = int(result.predicted[0])
            self._take_newest(result)
        self._faults.point("forward")
        self._predicted, self._requantized = predicted, [0] * layout.length

    def _copy_rows(self, known: dict) -> None:
        """Write given K/V into live rows: known = {row: (keys, values, _)}, each
        [layers, kv_heads, head_dim] in the cache's dtype and device. They go in the way a
        forward's rows do (`fill` + `update`), so every layer kind stores them its own way
        (a packed layer encodes them)."""
        rows = sorted(known)
        index = torch.tensor(rows, dtype=torch.long, device=self.lm.device)
        keys = torch.stack([known[row][0] for row in rows], dim=2)  # [layers, kv_heads, n, head_dim]
        values = torch.stack([known[row][1] for row in rows], dim=2)
        with self._cache.fill(index):
            for layer, layer_keys, layer_values in zip(self._cache.layers, keys, values):
                layer.update(layer_keys[None], layer_values[None])

    def _take_newest(self, result) -> None:
        """What the forward that wrote the newest row leaves (None: forget it, it is history)."""
        self.next_logits = None if result is None else result.logits
        self.last_attention = None if result is None else result.attention
        self.last_query = None if result is None else result.query
        self.last_log_norm = None if result is None else result.log_norm

    @staticmethod
    def _rotated(layout: Layout) -> int:
        if layout.moved is None:
            return 0
        return sum(a != b for a, b in zip(layout.old_positions[layout.moved:], layout.positions[layout.moved:]))

    def rebuild(self, *, count: bool = True) -> None:
        """Recompute the whole cache from the mirror: live tokens at their recorded positions.
        If that fails (or is interrupted) the state is marked broken until a rebuild succeeds."""
        self._version += 1
        self._cache.reset()
        if self._mirror.ring is not None:  # back into the slots the mirror records, whatever a failed edit did
            self._cache.set_ring(self._mirror.ring)
        token_ids, positions = self._mirror.live_token_ids(), self._mirror.positions()
        self._take_newest(None)
        self._predicted = []
        self._requantized = [0] * len(token_ids)  # fresh rows, rounded once
        self._broken = "the cache is being rebuilt"
        try:
            if token_ids:
                self._cache.set_positions(positions)
                result = prefill(self.lm, self._cache, token_ids, positions, attention_layers=self.attention_layers)
                self._take_newest(result)
                self._predicted = result.predicted.tolist()
                if self.per_layer:  # every layer computed the union: each keeps its own rows
                    self._keep_layer_rows()
        except BaseException as exc:
            self._broken = f"rebuilding the cache from the mirror failed ({type(exc).__name__}: {exc})"
            raise
        self._broken = None
        self.rebuilds += count

    def _keep_layer_rows(self) -> None:
        """After a prefill of the union (every layer holding every live row), close each layer
        up to the rows it holds. The newest row is in every layer (it was just added), so its
        attention row covers each layer's rows once recomputed: forget the union's."""
        mirror = self._mirror
        runs = []
        for lane in range(mirror.layers.num_layers):
            rows_of = mirror.layer_rows_of(lane)
            keep = set(rows_of)
            runs.append(runs_without(len(mirror), [row for row in range(len(mirror)) if row not in keep]))
        self._cache.splice_layers(runs, len(mirror.layers))
        self.last_attention = self.last_query = self.last_log_norm = None

    def divergence(self) -> float:
        """KL(fresh ‖ spliced) in nats of the next-token distribution: what the splices cost.

        "fresh" is a cache computed from scratch from the same live tokens at the same
        positions (a scratch cache); the live state is not touched. Costs one prefill.
        """
        if self.next_logits is None:
            raise ValueError("no next-token logits: the last operation did not write the last row")
        return checks.divergence(self.lm, self._new_cache(len(self) + 1), self.live_token_ids(), self.positions(),
                                 self.next_logits)

    # --- invariants ---------------------------------------------------------------------

    def check(self, *, deep: bool = False, tolerance: float | None = None) -> None:
        """Raise unless cache and mirror agree: mirror invariants, one row per live token in
        every layer, right shapes. `deep` also compares layer 0 with a fresh computation of
        the live tokens at their recorded positions, element by element within `tolerance`
        (default: `layer0_tolerance`, which a 4-bit kv_format widens by its rounding bound, for
        keys as often as they were re-rotated)."""
        checks.check(self, self._cache, self._mirror, self._predicted, self._requantized, deep=deep,
                     tolerance=tolerance)

    def inject_fault(self, stage: str) -> None:
        """Tests: make the next edit raise InjectedFault at `stage` (faults.FAULT_STAGES): after
        the splice, after the re-rotation, after the forward, half-way through the forward (in
        the middle layer, after some layers wrote their rows), or just before the mirror commits."""
        self._faults = Fault(self.lm, stage)

    def _texts(self, layout: Layout) -> list[str]:
        """Each new token's text, decoded as a span after the token left of its group."""
        live = self._mirror.live.ledger_ids
        token_at_new_row = dict(zip(layout.new_rows, layout.new_token_ids))

        def token_at(row: int) -> int:
            if row in token_at_new_row:
                return token_at_new_row[row]
            old = next(old + row - new for old, new, count in layout.kept if new <= row < new + count)
            return self._mirror.ledger[live[old]].token_id

        texts: list[str] = []
        for insertion, part in layout.groups:
            if insertion.restores:  # back with the text it had
                texts += [self._mirror.ledger[i].text for i in insertion.restores]
                continue
            first = layout.new_rows[part][0]
            previous = token_at(first - 1) if first > 0 else None
            texts += span_texts(self.lm.decode, list(insertion.token_ids), previous)
        return texts

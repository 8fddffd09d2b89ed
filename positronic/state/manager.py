"""StateManager: the only code that changes the KV cache or the mirror.

A tick's change comes as one `Edit` (edit.py: an action list checked once). Every change,
from a whole tick to one deleted row, is one `Layout` (mirror/layout.py) applied to both
blades from the same arguments, by the way the layers hold rows (rows.py: shared or per lane):

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
                                     (None once layers keep rows of their own: nothing reads it)
    last_query, last_log_norm        [scored layers, heads, head_dim], [scored layers, heads]: its
                                     scaled query and log-normaliser (forward.ForwardResult)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from positronic.mirror import Insertion, LayerRows, Mirror
from positronic.steps.attention import layer_indices

from ..kv import formats as kv_formats
from ..kv.cache import SpliceCache, check_store
from ..kv.centres import key_centres
from . import checks, persistence, rows as row_plans
from .actions import ActionError
from .edit import Bounds, Edit
from .faults import NO_FAULTS, Fault
from .forward import Probes, forward, prefill
from .readonly import CacheView, MirrorView
from .rows import LaneRows, SharedRows
from .view import StateReads


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


class StateManager(StateReads):
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
        report = manager._edit(manager._shared([], [Insertion(0, tuple(token_ids), source)]), tick=0)
        if report.rebuilt:
            raise RuntimeError(f"prefill failed: {report.error}")
        return manager

    @classmethod
    def from_mirror(cls, lm, mirror: Mirror, *, capacity: int = 0, score_layers="last",
                    brightness: float = 255.0, kv_format: str = "float", kv_store: str = "splice") -> "StateManager":
        """Resume from a saved mirror: the cache is recomputed from its live rows (with a ring
        store, into the slots the mirror records). ValueError if its rows do not fit `lm`."""
        persistence.check_fits(lm, mirror)
        manager = cls(lm, mirror, capacity=capacity, score_layers=score_layers, new_brightness=brightness,
                      kv_format=kv_format, kv_store=kv_store)
        manager.rebuild(count=False)
        return manager

    @classmethod
    def from_saved(cls, lm, mirror: Mirror, tensors: dict[str, torch.Tensor], *, capacity: int = 0,
                   score_layers="last", brightness: float = 255.0, kv_format: str = "float",
                   kv_store: str = "splice") -> "StateManager":
        """Resume from a saved mirror and the cache it described (`tensors()` of the state that
        was saved): the rows are loaded, not recomputed. See persistence.from_saved."""
        return persistence.from_saved(cls, lm, mirror, tensors, capacity=capacity, score_layers=score_layers,
                                      brightness=brightness, kv_format=kv_format, kv_store=kv_store)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What `from_saved` needs besides the mirror, as CPU copies (see persistence.tensors)."""
        return persistence.tensors(self)

    def _new_cache(self, capacity: int, store: str = "splice", sinks: int = 0) -> SpliceCache:
        """A cache in this state's format (int4h: with the model's key centres, kv_centres.py)."""
        centres = key_centres(self.lm) if self.kv_format == "int4h" else None
        return SpliceCache(self.lm.model.config, max_cache_len=capacity, kv_format=self.kv_format, store=store,
                           sinks=sinks, key_centres=centres)

    # --- reads (the rest are StateReads': copies or read-only views) ----------------------

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

    @property
    def bounds(self) -> Bounds:
        """What an action list for this state is checked against (`Edit.from_actions`)."""
        return Bounds(len(self), self.lm.vocab_size, self.lm.max_positions,
                      (self.lanes, self.rows_per_layer) if self.per_layer else None)

    def _refuse_if_broken(self, what: str) -> None:
        if self._broken:
            raise StateBrokenError(f"cannot {what}: {self._broken}")

    # --- coupled operations -------------------------------------------------------------

    def delete(self, row: int, *, tick: int | None = None) -> ApplyReport:
        """Remove live row `row` from cache and mirror (not with per-layer rows: `apply` a drop)."""
        self._refuse_per_layer("delete")
        self._check_row(row, len(self) - 1)
        return self._edit(self._shared([row], []), tick=tick)

    def insert(self, row: int, token_ids: list[int], *, source: str = "inserted",
               tick: int | None = None) -> ApplyReport:
        """Insert tokens before live row `row`; their K/V see only the rows before them."""
        self._refuse_per_layer("insert")
        self._check_row(row, len(self))
        return self._edit(self._shared([], [Insertion(row, tuple(token_ids), source)]), tick=tick)

    def append(self, token_ids: list[int], *, source: str = "generated", tick: int | None = None) -> ApplyReport:
        """Append tokens after the last row; leaves `next_logits` and `last_attention`. With
        per-layer rows every layer appends them, one edit per token."""
        if not self.per_layer:
            return self._edit(self._shared([], [Insertion(len(self), tuple(token_ids), source)]), tick=tick)
        if not token_ids:
            raise ValueError("append needs at least one token")
        for token_id in token_ids:
            report = self._edit(self._lanes([[] for _ in range(self.lanes)], [token_id], source), tick=tick)
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
        too). Any kv_format (a 4-bit one moves each lane's codes and scales; int4h reads each
        lane's keys at its own rows' positions). There is no way back: the lanes' rows would differ."""
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
        if self.kv_store == "ring":
            raise ValueError("per-layer rows need the splice store: a ring keeps one cursor for every layer")
        self._mirror.layers = LayerRows.every_layer(self.lm.num_layers * heads, self._mirror.live.ledger_ids)
        self._version += 1

    def pin(self, rows: list[int]) -> None:
        """Pin live rows: no policy evicts or repairs them (they stay pinned until `unpin`).
        With per-layer rows only tokens every lane holds can be pinned (ValueError otherwise)."""
        rows = self._rows(rows)
        if self.per_layer:
            everywhere = self._mirror.layers.num_layers
            live = self._mirror.live.ledger_ids
            if partial := [row for row in rows if 0 <= row < len(live)
                           and self._mirror.layers.counts.get(live[row], 0) != everywhere]:
                raise ValueError(f"rows {partial[:5]} are held by some lanes only (the policy dropped them in others): "
                                 "only a token every lane holds can be pinned")
        self._mirror.set_pinned(rows, True)

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

    def apply(self, edit: Edit | list[dict], *, tick: int | None = None,
              brightness: list[float] | torch.Tensor | None = None, add_source: str = "generated",
              probes: Probes | None = None) -> ApplyReport:
        """Step 4: apply a checked `Edit` (or an action list, checked here: ActionError, state
        untouched) as one layout and one forward.

        Positions in the actions are rows before the tick. A replace_pair's tokens take the
        place of its first row; adds go last, in list order. `tick` stamps the ledger (default:
        the last tick + 1); `brightness` (one per live row before the tick, Step 2b) is stored
        with the tick; `add_source` is the ledger source of the added tokens ("prompt" when a
        long prompt's last token comes in with its bulk prune). A failure after the checks is
        reported (`rebuilt`), not raised. `probes` ride along in the tick's forward (the list
        must add a token) and their log-probabilities come back in the report; their scratch
        rows are dropped, so they change nothing.
        """
        if not isinstance(edit, Edit):
            edit = Edit.from_actions(edit, self.bounds)  # the wire format, checked once at the edge
        elif edit.bounds != self.bounds:
            raise ActionError(f"the edit was checked for a state of {edit.bounds}, this one is {self.bounds}")
        brightness = self._checked_brightness(brightness)
        if edit.reread and (probes or self.kv_store == "ring"):
            raise ActionError("a reread needs the splice store and no probes (it runs the newest row's forward "
                              "where the row lies)")
        if self.per_layer:
            if probes:
                raise ValueError("probes need every layer to hold the same rows")
            live = dict(zip(self._mirror.live.ledger_ids, self._mirror.live.positions)) if edit.stored else None
            stored = checks.checked_stored_rows(self.lm, self.kv_format, self._cache.layers[0], self._mirror.ledger,
                                                 edit.stored, live)
            rows = self._lanes(edit.drops or [[] for _ in range(self.lanes)], list(edit.adds), add_source,
                               edit.lane_inserts(), stored)
        else:
            deleted = edit.deleted_rows()
            restored = row_plans.restorations(self._mirror, edit.restores, set(deleted)) if edit.restores else []
            stored = checks.checked_stored_rows(self.lm, self.kv_format, self._cache.layers[0], self._mirror.ledger,
                                                 edit.stored)
            if probes:
                self._check_probes(probes, len(edit.adds))
            rows = self._shared(deleted, edit.insertions(add_source, restored))
        report = self._edit(rows, tick=tick, brightness=brightness, probes=probes, stored=stored, reread=edit.reread)
        report.applied = 0 if report.rebuilt else len(edit)
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

    def _check_probes(self, probes: Probes, adds: int) -> None:
        if self.kv_store == "ring":
            raise ValueError("probes need the splice store: a ring keeps no scratch rows")
        if not adds:
            raise ValueError("probes ride along in a forward: the action list must add a token")
        if max(probes.positions) >= max(self._mirror.live.positions, default=0) + 1 + adds:
            raise ValueError("a probe's position must lie within the context")

    def _shared(self, deleted: list[int], insertions: list[Insertion]) -> SharedRows:
        return SharedRows(self._mirror, deleted, insertions, self.lm.max_positions)

    def _lanes(self, drops, adds: list[int], source: str, inserts: list[list[int]] | None = None,
               stored: dict | None = None) -> LaneRows:
        return LaneRows(self._mirror, [list(d) for d in drops], adds, source, self.lm.max_positions,
                        self.lanes_per_layer, inserts, stored)

    def _edit(self, rows: SharedRows | LaneRows, *, tick: int | None, brightness: list[float] | None = None,
              probes: Probes | None = None, stored: dict | None = None, reread: bool = False) -> ApplyReport:
        """Stages 2–5 of a planned edit (`rows`): the cache's writes, then the mirror's commit.
        All of it, or (on any failure or an interrupt) a rebuild of the cache from the
        unchanged mirror, reported as `rebuilt`."""
        self._refuse_if_broken("edit")
        self._version += 1
        start = time.perf_counter()
        report = ApplyReport(tick=self.last_tick + 1 if tick is None else tick)
        texts = row_plans.texts(self.lm.decode, self._mirror, rows.layout)
        try:
            report.probe_logprobs = self._write(rows, probes, stored or {}, reread)
            self._faults.point("commit")
            rows.commit(self._mirror, self._cache, texts, tick=report.tick, brightness=self.new_brightness,
                        live_brightness=brightness)
            report.rotated_rows = row_plans.rotated(rows.layout)
            self._edits += 1
            report.edits = 1
            self.rotated_rows += report.rotated_rows
        except BaseException as exc:
            report.error = f"{type(exc).__name__}: {exc}"
            try:
                self.rebuild()
            except BaseException as again:
                raise StateBrokenError(f"tick {report.tick} failed ({report.error}) and so did the rebuild from the "
                                       f"mirror ({type(again).__name__}: {again}); the state is unusable and is not "
                                       "saved") from exc
            report.rebuilt = True
            if not isinstance(exc, Exception):  # Ctrl-C: consistent again, now stop
                raise
        self.last_tick = report.tick
        report.seconds = time.perf_counter() - start
        return report

    def _write(self, rows: SharedRows | LaneRows, probes: Probes | None, stored: dict,
               reread: bool = False) -> list[float] | None:
        """Stages 2–4 on the cache: splice, re-rotate, restored rows' own K/V (`stored`, by
        ledger id) copied in, one forward for the other new rows (with the probes' scratch
        rows after the live rows, dropped again), or with `reread` (no new rows then but
        restored ones) for the newest row again, in its place. Returns the probes'
        log-probabilities."""
        layout = rows.layout
        predicted_before, requantized_before = self._predicted, self._requantized
        scratch = len(probes) if probes and layout.old_length and layout.new_rows else 0
        rows.splice(self._cache, scratch, probes.positions if scratch else ())
        self._faults.point("splice")
        rows.rotate(self._cache, self.lm.inv_freq)
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
        if known and not self.per_layer:  # LaneRows copied them into their lanes as it spliced
            row_plans.copy_rows(self._cache, known)
            for row, (_, _, token_id) in known.items():
                predicted[row] = token_id
                requantized[row] = 1  # what checks.checked_stored_rows allowed it
        fed = [(row, token_id) for row, token_id in zip(layout.new_rows, layout.new_token_ids) if row not in known]
        if reread:  # the newest row stays the last one (Edit refused a list that adds or removes it)
            fed.append((layout.length - 1, self._mirror.ledger[self._mirror.live.ledger_ids[-1]].token_id))
        newest = bool(fed) and fed[-1][0] == layout.length - 1
        if rows.changed:  # the last forward is history
            self._take_newest(None)
        probe_logprobs = None
        if fed:
            new_rows = [row for row, _ in fed]
            token_ids = [token_id for _, token_id in fed]
            positions = [layout.positions[row] for row in new_rows]
            if layout.old_length == 0:
                result = prefill(self.lm, self._cache, token_ids, positions, attention_layers=self.attention_layers)
            else:
                gaps = torch.tensor(rows.gaps(new_rows, scratch), dtype=torch.long, device=self.lm.device)
                with self._cache.fill(gaps), self._faults.forward():
                    result = forward(self.lm, self._cache, token_ids, positions, rows.key_positions(),
                                     attention_layers=self.attention_layers if newest else None,
                                     probes=probes if scratch else None,
                                     weights=not self.per_layer)  # a per-layer policy reads no shared row
                if scratch:
                    for layer in self._cache.layers:
                        layer.crop(-scratch)
                    probe_logprobs = result.probe_logprobs.tolist()
            for row, token_id in zip(new_rows, result.predicted.tolist()):
                predicted[row] = token_id
            if newest:
                self._take_newest(result)
        self._faults.point("forward")
        self._predicted, self._requantized = predicted, requantized
        return probe_logprobs

    def _take_newest(self, result) -> None:
        """What the forward that wrote the newest row leaves (None: forget it, it is history)."""
        self.next_logits = None if result is None else result.logits
        self.last_attention = None if result is None else result.attention
        self.last_query = None if result is None else result.query
        self.last_log_norm = None if result is None else result.log_norm

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
                if self.per_layer:  # every layer computed the union: each closes up to its own rows;
                    # the newest row is in every layer, but its attention covered the union's rows
                    self._cache.splice_layers(row_plans.lane_runs(self._mirror), len(self._mirror.layers))
                    self._cache.set_lane_positions(row_plans.lane_positions(self._mirror))
                    self.last_attention = self.last_query = self.last_log_norm = None
        except BaseException as exc:
            self._broken = f"rebuilding the cache from the mirror failed ({type(exc).__name__}: {exc})"
            raise
        self._broken = None
        self.rebuilds += count

    def divergence(self) -> float:
        """KL(fresh ‖ spliced) in nats of the next-token distribution: what the splices cost.

        "fresh" is a cache computed from scratch from the same live tokens at the same
        positions (a scratch cache); the live state is not touched. Costs one prefill.
        """
        if self.next_logits is None:
            raise ValueError("no next-token logits: the last operation did not write the last row")
        return checks.divergence(self.lm, self._new_cache(len(self) + 1), self.live_token_ids(), self.positions(),
                                 self.next_logits)

    def check(self, *, deep: bool = False, tolerance: float | None = None) -> None:
        """Raise unless cache and mirror agree: mirror invariants, one row per live token in
        every layer, right shapes. `deep` also compares layer 0 with a fresh computation of
        the live tokens at their recorded positions, element by element within `tolerance`
        (default: checks.layer0_tolerance, which a 4-bit kv_format widens by its rounding bound,
        for keys as often as they were re-rotated)."""
        checks.check(self, self._cache, self._mirror, self._predicted, self._requantized, deep=deep,
                     tolerance=tolerance)

    def inject_fault(self, stage: str) -> None:
        """Tests: make the next edit raise InjectedFault at `stage` (faults.FAULT_STAGES): after
        the splice, after the re-rotation, after the forward, half-way through the forward (in
        the middle layer, after some layers wrote their rows), or just before the mirror commits."""
        self._faults = Fault(self.lm, stage, self._cache)

"""StateManager: the only code that changes the KV store or the mirror.

Each coupled operation takes one set of arguments and applies the same splice to both
blades: `delete(row)`, `insert(row, token_ids)`, `append(token_ids)`, and the rare
re-rotation that makes room between RoPE positions. Nothing else can change one side
without the other. `apply(actions)` is Step 4: validate the whole list, then apply it in
place; if anything fails after the first edit, the cache is rebuilt from the mirror.

    mirror.live.positions[i]   RoPE position row i's key was rotated with
    store.layer(l)             keys/values [1, kv_heads, rows, head_dim]
    next_logits                [vocab] float32, from the last forward that ended at the last row
    last_attention             [layers, heads, rows] float32, that forward's attention row
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mirror import Mirror

from . import rope
from .actions import validate
from .forward import fresh_layer0_kv, forward, prefill
from .kv_store import KVStore, make_store, new_rows
from .text import span_texts


class StateInvariantError(AssertionError):
    """The cache and the mirror disagree."""


class InjectedFault(RuntimeError):
    """Raised on purpose by `inject_fault`, to test recovery."""


@dataclass
class ApplyReport:
    """What one `apply` did. `rebuilt` is True when an edit failed and the cache was
    recomputed from the mirror; `error` then says what failed."""

    tick: int
    applied: int = 0
    edits: int = 0
    rotated_rows: int = 0
    rebuilt: bool = False
    error: str | None = None
    seconds: float = 0.0


class StateManager:
    def __init__(self, lm, store: KVStore, mirror: Mirror, *, store_kind: str = "dynamic"):
        self.lm = lm
        self.store = store
        self.store_kind = store_kind  # backend for scratch caches (divergence)
        self.mirror = mirror
        self.tick = 0  # stamped on ledger entries; the loop advances it
        self.new_brightness = 255.0  # brightness a new token starts with (depends on the rule)
        self.next_logits: torch.Tensor | None = None
        self.last_attention: torch.Tensor | None = None
        self.rebuilds = 0
        self.rotated_rows = 0
        self._edits = 0
        self._fault: tuple[int, bool] | None = None

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_tokens(cls, lm, token_ids: list[int], *, store: str = "dynamic", source: str = "prompt",
                    brightness: float = 255.0) -> "StateManager":
        """Prefill `token_ids` (the caller adds BOS if it wants one) at positions 0..n-1."""
        if not token_ids:
            raise ValueError("a context needs at least one token")
        manager = cls(lm, make_store(store, lm.num_layers), Mirror(), store_kind=store)
        manager.new_brightness = brightness
        manager.append(list(token_ids), source=source)
        return manager

    @classmethod
    def from_mirror(cls, lm, mirror: Mirror, *, store: str = "dynamic") -> "StateManager":
        """Resume from a saved mirror: the cache is recomputed from its live rows."""
        mirror.check(lm.max_positions)
        manager = cls(lm, make_store(store, lm.num_layers), mirror, store_kind=store)
        manager.rebuild(count=False)
        return manager

    # --- reads --------------------------------------------------------------------------

    @property
    def cache(self):
        """The transformers Cache the model reads."""
        return self.store.cache

    def __len__(self) -> int:
        return len(self.mirror)

    @property
    def edits(self) -> int:
        """Coupled edits made since this manager was created."""
        return self._edits

    def live_token_ids(self) -> list[int]:
        return self.mirror.live_token_ids()

    def positions(self) -> list[int]:
        return self.mirror.positions()

    def set_brightness(self, values: list[float]) -> None:
        """Store Step 2b's brightness, one value per live row (metadata only; no cache change)."""
        self.mirror.set_brightness(values)

    # --- coupled operations -------------------------------------------------------------

    def delete(self, row: int) -> int:
        """Remove live row `row` from store and mirror; returns its ledger id."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range 0..{len(self) - 1}")
        self.store.delete(row)
        self._between_blades()
        ledger_id = self.mirror.delete(row, self.tick)
        self._edit_done(stale=True)
        return ledger_id

    def insert(self, row: int, token_ids: list[int], *, source: str = "inserted") -> list[int]:
        """Insert tokens before live row `row`; their K/V come from a forward over rows
        [0, row) only, at the RoPE positions they keep. Returns their ledger ids."""
        if not 0 <= row <= len(self):
            raise IndexError(f"insert row {row} out of range 0..{len(self)}")
        positions = self._make_room(row, len(token_ids))
        context = self.store.left_context(row)
        forward(self.lm, context, token_ids, positions)
        keys, values = new_rows(context, row)
        texts = self._texts(row, token_ids)
        self.store.insert(row, keys, values)
        self._between_blades()
        ledger_ids = self.mirror.insert(row, token_ids, texts, positions, source=source, tick=self.tick,
                                        brightness=self.new_brightness)
        self._edit_done(stale=True)
        return ledger_ids

    def append(self, token_ids: list[int], *, source: str = "generated") -> list[int]:
        """Append tokens after the last row: the one model forward of a tick. Leaves
        `next_logits` and `last_attention` for the last appended token."""
        row = len(self)
        positions = self._make_room(row, len(token_ids))
        texts = self._texts(row, token_ids)
        result = prefill(self.lm, self.store.cache, token_ids, positions)
        self._between_blades()
        ledger_ids = self.mirror.insert(row, token_ids, texts, positions, source=source, tick=self.tick,
                                        brightness=self.new_brightness)
        self.next_logits, self.last_attention = result.logits, result.attention
        self._edit_done(stale=False)
        return ledger_ids

    def _reposition(self, new_positions: list[int]) -> None:
        """Re-rotate keys whose position changes (one coupled edit). Rows whose position
        stays put are not touched, so a key is rounded only when it really moves."""
        old_positions = self.mirror.live.positions
        start = next((i for i, (a, b) in enumerate(zip(old_positions, new_positions)) if a != b), None)
        if start is None:
            return
        cos, sin = rope.rotation(self.lm.inv_freq, torch.tensor(old_positions[start:]),
                                 torch.tensor(new_positions[start:]))
        self.store.rotate_keys(start, cos, sin)
        self._between_blades()
        self.mirror.live.set_positions(new_positions)
        self.rotated_rows += len(new_positions) - start
        self._edit_done(stale=True)

    def _make_room(self, row: int, count: int) -> list[int]:
        """RoPE positions for `count` new rows before `row`, strictly between their
        neighbours. Without room, the rows from `row` on shift right; near the model's
        limit everything is packed down to 0.. instead."""
        positions, limit = self.mirror.live.positions, self.lm.max_positions
        if len(positions) + count > limit:
            raise ValueError(f"{len(positions) + count} rows do not fit the model's {limit} positions")
        left = positions[row - 1] if row > 0 else -1
        right = positions[row] if row < len(positions) else limit
        if right - left - 1 < count:
            shift = count - (right - left - 1)
            if row < len(positions) and positions[-1] + shift < limit:
                self._reposition(positions[:row] + [p + shift for p in positions[row:]])
            else:
                n = len(positions)
                self._reposition(list(range(row)) + list(range(row + count, n + count)))
                left = row - 1
        return list(range(left + 1, left + 1 + count))

    # --- Step 4 -------------------------------------------------------------------------

    def apply(self, actions: list[dict]) -> ApplyReport:
        """Validate the whole list (raises ActionError, state untouched), then apply it.

        Position edits run in descending order of their highest row; a replace_pair deletes
        pos2, then pos1, then inserts at pos1; adds run last. A failure after the first
        edit rebuilds the cache from the mirror and is reported, not raised.
        """
        start, edits_before, rotated_before = time.perf_counter(), self._edits, self.rotated_rows
        plan = validate(actions, live_length=len(self), vocab_size=self.lm.vocab_size,
                        max_length=self.lm.max_positions)
        report = ApplyReport(tick=self.tick)
        try:
            for action in plan.edits:
                if action["action"] == "delete":
                    self.delete(action["position"])
                else:
                    pos1, pos2 = action["original_pos1"], action["original_pos2"]
                    old = [self.delete(pos2), self.delete(pos1)][::-1]
                    new = self.insert(pos1, action["new_token_ids"], source="repair")
                    self.mirror.link_replacement(old, new)
                report.applied += 1
            for action in plan.adds:
                self.append([action["token_id"]], source="generated")
                report.applied += 1
        except BaseException as exc:
            report.error = f"{type(exc).__name__}: {exc}"
            self.rebuild()
            report.rebuilt = True
            if not isinstance(exc, Exception):  # Ctrl-C: consistent again, now stop
                raise
        report.edits = self._edits - edits_before
        report.rotated_rows = self.rotated_rows - rotated_before
        report.seconds = time.perf_counter() - start
        return report

    def rebuild(self, *, count: bool = True) -> None:
        """Recompute the whole cache from the mirror: live tokens at their recorded positions."""
        self.store.reset()
        token_ids, positions = self.mirror.live_token_ids(), self.mirror.positions()
        self.next_logits = self.last_attention = None
        if token_ids:
            result = prefill(self.lm, self.store.cache, token_ids, positions)
            self.next_logits, self.last_attention = result.logits, result.attention
        self.rebuilds += count

    def divergence(self) -> float:
        """KL(fresh ‖ spliced) in nats of the next-token distribution: what the splices cost.

        "fresh" is a cache computed from scratch from the same live tokens at the same
        positions (in a scratch store); the live state is not touched. Costs one prefill.
        """
        if self.next_logits is None:
            raise ValueError("no next-token logits: the last operation was not an append")
        scratch = make_store(self.store_kind, self.lm.num_layers)
        fresh = prefill(self.lm, scratch.cache, self.live_token_ids(), self.positions()).logits
        log_fresh, log_spliced = fresh.log_softmax(-1), self.next_logits.log_softmax(-1)
        return float((log_fresh.exp() * (log_fresh - log_spliced)).sum())

    # --- invariants ---------------------------------------------------------------------

    def check(self, *, deep: bool = False) -> None:
        """Raise unless store and mirror agree: mirror invariants, one row per live token in
        every layer, right shapes. `deep` also compares layer 0 with a fresh computation of
        the live tokens at their recorded positions."""
        self.mirror.check(self.lm.max_positions)
        rows = len(self.mirror)
        if len(self.store) != rows:
            raise StateInvariantError(f"cache holds {len(self.store)} rows but the mirror {rows}")
        shape = (1, self.lm.num_kv_heads, rows, self.lm.head_dim)
        for index in range(self.store.num_layers):
            keys, values = self.store.layer(index)
            if tuple(keys.shape) != shape or tuple(values.shape) != shape:
                raise StateInvariantError(
                    f"layer {index} holds K {tuple(keys.shape)} / V {tuple(values.shape)}, expected {shape}")
        if deep and rows:
            keys, values = self.store.layer(0)
            fresh_keys, fresh_values = fresh_layer0_kv(self.lm, self.live_token_ids(), self.positions())
            tolerance = 1e-4 if self.lm.dtype == torch.float32 else 2e-2
            error = max((keys - fresh_keys).abs().max().item(), (values - fresh_values).abs().max().item())
            if error > tolerance:
                raise StateInvariantError(f"layer 0 differs from a fresh prefill by {error:.2e} (> {tolerance})")

    # --- fault injection (tests) --------------------------------------------------------

    def inject_fault(self, after_edits: int, *, mid_edit: bool = False) -> None:
        """Raise InjectedFault after the `after_edits`-th coupled edit from now, or, with
        `mid_edit`, inside it: after the store was spliced and before the mirror was."""
        self._fault = (self._edits + after_edits, mid_edit)

    def _between_blades(self) -> None:
        if self._fault and self._fault[1] and self._edits + 1 == self._fault[0]:
            self._fault = None
            raise InjectedFault(f"fault injected inside edit {self._edits + 1}")

    def _edit_done(self, *, stale: bool) -> None:
        self._edits += 1
        if stale:  # the last forward no longer describes the cache
            self.next_logits = self.last_attention = None
        if self._fault and not self._fault[1] and self._edits == self._fault[0]:
            self._fault = None
            raise InjectedFault(f"fault injected after edit {self._edits}")

    def _texts(self, row: int, token_ids: list[int]) -> list[str]:
        live = self.mirror.live.ledger_ids
        previous = self.mirror.ledger[live[row - 1]].token_id if row > 0 else None
        return span_texts(self.lm.decode, token_ids, previous)

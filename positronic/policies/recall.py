"""Recall: evicted rows come back when the context asks for them, exactly as they were.

No bounded cache of the field keeps a token once it is evicted. Here the ledger keeps every
token and the RoPE position it held, and live positions keep the gaps evicted rows left, so
an evicted row can be put back exactly where it was (StateManager's `restore` action).

What comes back: when a row is evicted, its K/V in every layer are kept here as they were in
the cache (keys rotated at the position it held, which is where it comes back), with the
token the model predicted after it. A restore hands them to Step 4, which copies them into
the gap after checking layer 0 against the token at its position. Recomputing them instead
(seeing only today's compressed left context) costs the retrieval probe 2.64 nats over the
full cache; the stored K/V cost 0.55 (bench/results/history/recall.md).

When: every `every` ticks, and at once on the tick after a typed token came in (`wake`), the
newest token's query scores the kept keys like live rows: an evicted row's would-be attention
is exp(q·k − log Σ_live exp(q·k')), averaged over layers and heads like the live rows' scores
(steps.scores). If the best row would get at least `threshold` times a live row's fair share
(1 / live rows), it comes back with the evicted rows around it (up to `span` rows, nearest
positions first: the text around a match is what makes it useful), and the policy frees as
many more rows in the same tick. A row that came back cannot come back again for `cooldown`
ticks after it is evicted again, so nothing flickers in and out.

Memory: `capacity` evicted rows at most (oldest dropped first), each 2 × layers × kv_heads ×
head_dim in the cache's dtype (SmolLM2 float32: 46 KB), in buffers with room for a quarter
more: a tick writes the rows it evicts after the kept ones, and the oldest leave by moving
where the kept rows start; the index is copied only when the room runs out. Cost: scoring
reads every kept key (one [rows × head_dim] × [head_dim × group] product per layer and kv
head), hence `every`.

    keys, values  [layers, kv_heads, rows, head_dim]  (the cache's dtype, on the CPU)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..util import DTYPES, is_int_list

DEFAULT_THRESHOLD = 8.0  # × a live row's fair share of attention
DEFAULT_SPAN = 16  # rows restored around the best match
DEFAULT_CAPACITY = 2048  # evicted rows kept recallable (scoring them costs ~6% of a SmolLM2 CPU tick per 1000)
DEFAULT_COOLDOWN = 64  # ticks before a restored row may come back again
DEFAULT_EVERY = 1  # ticks between looks (and at once after typed input): the query that finds a fact comes at one token


@dataclass
class Lookup:
    """One tick of recall, made by `Recall.look` and current only at `Recall.adopt` (once the
    tick went through): the clocks after the tick, the ledger ids it brings back (nearest to
    the best match first) and the rows it evicts, copied while the view is the cache's."""

    clock: int
    awake: bool
    back: list[int] = field(default_factory=list)
    evicted: tuple = ()  # (ledger ids, positions, predicted, keys, values) of the rows this tick takes out

    def fit(self, room: int) -> None:
        """Bring back at most `room` rows (the rows the tick freed beyond what it needed)."""
        if self.back:
            self.back = self.back[: max(0, room)]


def raw(tensor: torch.Tensor | None) -> bytes:
    """A tensor's bytes as they lie in memory (b"" for None), for a saved state."""
    return b"" if tensor is None else _byte_array(tensor).tobytes()


def _byte_array(tensor: torch.Tensor):
    """A tensor's bytes in memory order, as a numpy uint8 array (a copy only if not contiguous)."""
    return tensor.contiguous().view(torch.uint8).numpy()


class Digested(bytes):
    """A piece of a saved state that carries its sha256 (hex, `sha256`): a session names a
    large piece by it (brain/session.py), and a piece known unchanged since the last save is
    not hashed again. Equal to the same bytes, and taken back as bytes."""

    sha256: str

    @classmethod
    def of(cls, tensor: torch.Tensor, sha256: str | None = None) -> "Digested":
        """`raw(tensor)` with its digest: `sha256` when the caller knows it, else computed."""
        piece = cls(_byte_array(tensor))
        piece.sha256 = sha256 or hashlib.sha256(piece).hexdigest()
        return piece


class NoRecall:
    """Recall off: looks at nothing, brings nothing back, keeps nothing (a policy's stand-in)."""

    def look(self, view, *, typed: bool = False) -> Lookup:
        return Lookup(0, False)

    def idle(self) -> Lookup:
        return Lookup(0, False)

    def settle(self, lookup, view, gone, actions, outcomes) -> None:
        pass

    def adopt(self, lookup) -> None:
        pass


NO_RECALL = NoRecall()


class Recall:
    """The index of evicted rows (see the module docstring). A policy consults it each tick:
    `look` (what comes back), `settle` (the restore action; the rows this tick evicts), and
    the Brain's commit hands the tick's `Lookup` to `adopt`."""

    def __init__(self, *, threshold: float = DEFAULT_THRESHOLD, span: int = DEFAULT_SPAN,
                 capacity: int = DEFAULT_CAPACITY, cooldown: int = DEFAULT_COOLDOWN, every: int = DEFAULT_EVERY):
        self.threshold, self.span, self.capacity, self.cooldown, self.every = threshold, span, capacity, cooldown, every
        self.ids: list[int] = []  # ledger id per kept row, in order of eviction
        self.positions: list[int] = []
        self.predicted: list[int] = []  # the model's next token after each kept row (ContextView.predicted)
        self.keys: torch.Tensor | None = None  # [layers, kv_heads, rows, head_dim]: views of `_buffers`
        self.values: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # with room after the kept rows
        self._first = 0  # the buffers' row of the oldest kept row
        self.back_at: dict[int, int] = {}  # ledger id -> clock of its last restore
        self.clock = 0  # plans so far
        self.restored = 0  # rows brought back so far
        self.awake = False  # look on the next plan whatever the clock says (typed input came in)

    def __len__(self) -> int:
        return len(self.ids)

    def wake(self) -> None:
        """Typed input came in (outside a tick): look at the next tick's query, off the `every`
        schedule. Within a tick, `look(typed=True)` does this as part of the tick's state."""
        self.awake = True

    # --- one tick ---------------------------------------------------------------------------

    def look(self, view, *, typed: bool = False) -> Lookup:
        """This tick's lookup: the ledger ids to bring back (nearest to the best match first, or
        none). `typed`: the tick adds a typed token, so the next tick looks whatever the clock."""
        lookup = Lookup(self.clock + 1, typed)
        due = self.awake or lookup.clock % self.every == 0
        if not due or not self.ids or view.query is None or view.log_norm is None:
            return lookup
        share = self.shares(view.query, view.log_norm)
        best = int(share.argmax())
        if float(share[best]) * len(view) < self.threshold:
            return lookup
        live = set(view.positions.tolist())
        center = self.positions[best]
        near = sorted((abs(p - center), p, i) for i, p in zip(self.ids, self.positions)
                      if abs(p - center) <= self.span and p not in live
                      and lookup.clock - self.back_at.get(i, -self.cooldown) >= self.cooldown)
        lookup.back = [i for _, _, i in near[: self.span]]
        return lookup

    def idle(self) -> Lookup:
        """A tick that does not look (a bulk prune): the clocks stay, nothing comes back."""
        return Lookup(self.clock, self.awake)

    def settle(self, lookup: Lookup, view, gone: list[int], actions: list[dict], outcomes: list) -> None:
        """After the policy chose its rows: the restore action for `lookup.back` (appended to
        `actions`), and the K/V of the rows `gone` copied into the lookup now, while the view's
        state is the cache's."""
        if lookup.back:
            actions.append({"action": "restore", "ledger_ids": lookup.back, **self.payload(lookup.back)})
            outcomes.append(((), f"recalled {len(lookup.back)}"))
        rows = gone if gone and view.rows is not None else []
        if rows:
            keys, values = view.rows(rows)
            lookup.evicted = ([int(view.ledger_ids[r]) for r in rows], [int(view.positions[r]) for r in rows],
                              [int(view.predicted[r]) for r in rows], keys, values)

    def shares(self, query: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
        """[rows] float32: each kept row's would-be attention, averaged over layers and heads.
        query: [layers, heads, head_dim] (scaled, rotated); log_norm: [layers, heads]."""
        layers, kv_heads, _, head_dim = self.keys.shape
        if query.shape[0] != layers:
            raise ValueError(f"recall scores every layer's keys: the query covers {query.shape[0]} of {layers} layers "
                             "(record every layer: StateManager(score_layers='all'))")
        group = query.shape[1] // kv_heads
        query = query.reshape(layers, kv_heads, group, head_dim).to(self.keys.dtype)
        logits = self.keys @ query.transpose(-1, -2)  # [layers, kv_heads, rows, group]
        logits = logits.float() - log_norm.reshape(layers, kv_heads, 1, group)
        return logits.exp().mean(dim=(0, 1, 3))

    def payload(self, ids: list[int]) -> dict:
        """The restore action's own K/V for `ids` (see positronic.state.actions)."""
        where = {i: k for k, i in enumerate(self.ids)}
        index = torch.tensor([where[i] for i in ids], dtype=torch.long)
        return {"keys": self.keys.index_select(2, index), "values": self.values.index_select(2, index),
                "predicted": [self.predicted[where[i]] for i in ids]}

    def adopt(self, lookup: Lookup) -> None:
        """The tick of `lookup` went through: its clocks stand, the rows it brought back leave
        the index, the rows it evicted join it (the oldest go beyond `capacity`)."""
        self.clock, self.awake = lookup.clock, lookup.awake
        restored = lookup.back
        if restored:
            back = set(restored)
            self._keep([k for k, i in enumerate(self.ids) if i not in back])
            self.back_at.update((i, self.clock) for i in restored)
            self.restored += len(restored)
        if lookup.evicted:
            ids, positions, predicted, keys, values = lookup.evicted
            self._append(keys, values)
            self.ids += ids
            self.positions += positions
            self.predicted += predicted
        if len(self.ids) > self.capacity:  # the oldest evictions go first
            gone = len(self.ids) - self.capacity
            del self.ids[:gone], self.positions[:gone], self.predicted[:gone]
            self._first += gone
            self._view(len(self.ids))
        if len(self.back_at) > 2 * self.capacity:
            self.back_at = {i: t for i, t in self.back_at.items() if self.clock - t < self.cooldown}

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows [layers, kv_heads, n, head_dim] after the kept ones, in the buffers' room: the
        kept rows are copied only when the room runs out (every capacity / 4 rows at most),
        not with every eviction (a copy of the whole index each tick: 94 MB for SmolLM2 at
        2,048 rows, ~20 ms)."""
        held, count = len(self.ids), keys.shape[2]
        if self._buffers is None or self._first + held + count > self._buffers[0].shape[2]:
            room = max(held + count, self.capacity) + max(16, self.capacity // 4)
            buffers = tuple(t.new_empty(*t.shape[:2], room, t.shape[3]) for t in (keys, values))
            if held:
                buffers[0][:, :, :held], buffers[1][:, :, :held] = self.keys, self.values
            self._buffers, self._first = buffers, 0
        at = self._first + held
        self._buffers[0][:, :, at : at + count] = keys
        self._buffers[1][:, :, at : at + count] = values
        self._view(held + count)

    def _view(self, rows: int) -> None:
        """`keys` and `values`: the kept `rows` of the buffers."""
        keys, values = self._buffers
        self.keys, self.values = keys[:, :, self._first : self._first + rows], values[:, :, self._first : self._first + rows]

    def _keep(self, kept) -> None:
        kept = list(kept)
        self.ids = [self.ids[k] for k in kept]
        self.positions = [self.positions[k] for k in kept]
        self.predicted = [self.predicted[k] for k in kept]
        index = torch.tensor(kept, dtype=torch.long)
        keys, values = self.keys.index_select(2, index), self.values.index_select(2, index)
        self._first = 0  # back to the buffers' first row: the room after them stays
        self._buffers[0][:, :, : len(kept)], self._buffers[1][:, :, : len(kept)] = keys, values
        self._view(len(kept))

    # --- sessions ---------------------------------------------------------------------------

    def _rows(self) -> tuple:
        """(ids, positions, predicted, keys, values) of the kept rows, oldest first."""
        return self.ids, self.positions, self.predicted, self.keys, self.values

    def _set_rows(self, ids: list[int], positions: list[int], predicted: list[int], keys, values) -> None:
        self.ids, self.positions, self.predicted = ids, positions, predicted
        # the saved rows as they are (no room after them: the next eviction makes some)
        self._buffers, self._first = (None, 0) if keys is None else ((keys, values), 0)
        self.keys, self.values = keys, values

    VERSION_1 = {"ids", "positions", "shape", "keys", "back_at", "clock", "restored"}  # keys only

    def state(self) -> dict:
        """Plain data for a session: the kept rows, their K/V as raw bytes, the clocks."""
        ids, positions, predicted, keys, values = self._rows()
        return {"ids": list(ids), "positions": list(positions), "predicted": list(predicted),
                "shape": [] if keys is None else list(keys.shape),
                "dtype": "float32" if keys is None else str(keys.dtype).removeprefix("torch."),
                "keys": raw(keys), "values": raw(values), **self.clocks()}

    def clocks(self) -> dict:
        """The saved state's clocks: restores by ledger id, plans, rows brought back, awake."""
        return {"back_at": [[i, t] for i, t in self.back_at.items()], "clock": self.clock,
                "restored": self.restored, "awake": self.awake}

    @staticmethod
    def checked_clocks(state: dict) -> bool:
        """Whether a saved state's clocks (`clocks()`) are well formed."""
        return (isinstance(state["back_at"], list) and all(is_int_list(p) and len(p) == 2 for p in state["back_at"])
                and type(state["clock"]) is int and type(state["restored"]) is int and type(state["awake"]) is bool)

    def load_clocks(self, state: dict) -> None:
        self.back_at = {i: t for i, t in state["back_at"]}
        self.clock, self.restored, self.awake = state["clock"], state["restored"], state["awake"]

    def load_state(self, state: dict) -> None:
        """Take a `state()` back; ValueError if anything is malformed (nothing changes then)."""
        fields = {"ids", "positions", "predicted", "shape", "dtype", "keys", "values", "back_at", "clock",
                  "restored", "awake"}
        if isinstance(state, dict) and set(state) == self.VERSION_1 and type(state.get("clock")) is int \
                and type(state.get("restored")) is int:
            # a session from before rows came back with their own K/V: it kept keys only, so
            # what it evicted cannot come back exactly; the index starts empty from here
            state = {**self.__class__().state(), "clock": state["clock"], "restored": state["restored"]}
        ok = (isinstance(state, dict) and set(state) == fields
              and is_int_list(state["ids"]) and is_int_list(state["positions"]) and is_int_list(state["predicted"])
              and len(state["ids"]) == len(state["positions"]) == len(state["predicted"])
              and len(state["ids"]) <= self.capacity and is_int_list(state["shape"]) and state["dtype"] in DTYPES
              and isinstance(state["keys"], bytes) and isinstance(state["values"], bytes) and self.checked_clocks(state))
        keys = values = None
        if ok and (state["shape"] or state["keys"]):
            shape, dtype = state["shape"], DTYPES[state["dtype"]]
            size = torch.finfo(dtype).bits // 8
            ok = (len(shape) == 4 and shape[2] == len(state["ids"]) and all(n > 0 for n in shape[:2] + shape[3:])
                  and len(state["keys"]) == len(state["values"]) == size * shape[0] * shape[1] * shape[2] * shape[3])
            if ok:
                keys, values = (torch.frombuffer(bytearray(state[k]), dtype=torch.uint8).view(dtype).reshape(shape)
                                for k in ("keys", "values"))
                ok = bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())
        if not ok:
            raise ValueError("recall: malformed saved state")
        self._set_rows(list(state["ids"]), list(state["positions"]), list(state["predicted"]), keys, values)
        self.load_clocks(state)

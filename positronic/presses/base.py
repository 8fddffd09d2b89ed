"""What every press shares: the rows it reads (`Rows`), its settings, the budget maths and `plan`.

A press is today's policy (positronic/policies/) for S sequences at once, in the manner of
kvpress's presses: `score` gives every row a value (lower = less worth keeping) and the next
per-row state, and the one selection (select.py) takes the lowest units. Sequences live in
[S, N] tensors over a row capacity N; rows 0..length[s]-1 of sequence s are live, the rest
padding whose contents are junk: no press and no selection lets them count.

Per-row state (`row_state`: name -> (dtype, the value a new row starts with)) is the caller's
to keep: it allocates [S, N] tensors, moves them with the rows when rows are deleted and the
rest compacted, and fills each new row; a press never sees rows move. Per-sequence state
(`sequence_state`, e.g. a generator) stays with its sequence. `score` returns new tensors and
never writes its inputs, so a round that fails is simply not adopted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import Tensor

from positronic import steps
from positronic.util import parse_options

from .select import bounds, select

RECENT_MIN = 32  # llama.cpp's recent window: max(RECENT_MIN, length // 4) rows (policies.base.RECENT_MIN)
DEFAULT_WINDOW = 32  # the window of a press that takes it as a setting, when none is given (policies.base)


@dataclass(frozen=True)
class Rows:
    """What a press reads in one round, S sequences, N row capacity (all on one device)."""

    length: Tensor  # [S] int64: live rows of each sequence
    positions: Tensor  # [S, N] int64: each row's RoPE position (junk past length)
    # [S, N] float32: the newest token's attention share of each row (mean over heads, then
    # recorded layers), as `steps.scores` gives it; junk past length
    shares: Tensor
    pinned: Tensor  # [S, N] bool: rows the user pinned (never selected)
    # A press whose rows differ by lane (`Press.lanes` > 1, L lanes) reads these too:
    lane_positions: Tensor | None = None  # [S, L, N] int64: each lane's rows' positions
    # [S, L, N] float32: the newest token's largest attention share of each row over the query
    # heads reading the lane (zeros: no forward recorded them, e.g. just rebuilt); with every layer recorded
    lane_peaks: Tensor | None = None
    # A press that reads keys (`reads_keys`): read(members [n], rows [n]) -> copies of keys,
    # values [n, layers, kv_heads, head_dim], row rows[i] of sequence members[i] in every lane
    read: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    # A press that reads the newest query (`reads_query`, every layer recorded): recall's
    query: Tensor | None = None  # [S, layers, heads, head_dim] float32, scaled and rotated
    log_norm: Tensor | None = None  # [S, layers, heads] float32: log Σ exp(q·k) over each lane's rows
    token_ids: Tensor | None = None  # [S, N] int64: each row's token (lane 0's)


@dataclass(frozen=True)
class Settings:
    """The settings every press has; a press that needs more subclasses this. The names are
    BrainConfig's, so `Settings.of(config)` reads a run's settings."""

    budget: int  # live rows a sequence may hold after a round
    sinks: int = 4  # attention-sink rows never selected
    protect: int = 0  # a protected prefix, counted from row 0 (the longer of sinks and protect wins)
    window: int | None = None  # recent rows never selected, for a press that takes it as a setting
    evict_every: int = 0  # edit once every N rounds, freeing N rows (0: the press's own `batch`)

    def __post_init__(self):
        for name in ("budget", "sinks", "protect", "window", "evict_every"):
            value = getattr(self, name)
            if name == "window" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "budget" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'budget' else 0}, got {value!r}")

    def shared(self) -> "Settings":
        """What sequences scored together in one round must agree on: these settings with each
        per-sequence one (a field whose metadata says `per_sequence`, e.g. a seed that only
        starts a sequence's own state) at its default."""
        own = {f.name: f.default for f in fields(self) if f.metadata.get("per_sequence")}
        return replace(self, **own) if own else self

    @classmethod
    def of(cls, source: Any) -> "Settings":
        """These settings from `source`: one of them, a mapping of fields, or any object with
        attributes of the same names (a BrainConfig; fields it lacks keep their defaults, and
        its `policy_options` give the press's own). ValueError naming a setting it lacks."""
        if isinstance(source, cls):
            return source
        names = [f.name for f in fields(cls)]
        if isinstance(source, Mapping):
            given = dict(source)
        else:
            given = {name: getattr(source, name) for name in names if hasattr(source, name)}
            given |= parse_options(getattr(source, "policy_options", "") or "")
        if unknown := sorted(set(given) - set(names)):
            raise ValueError(f"this press has no setting {unknown[0]!r}; its settings: {', '.join(names)}")
        try:
            return cls(**given)
        except TypeError as exc:  # a setting without a default that `source` does not give
            raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class Plan:
    """One round of a press: the rows it deletes and the state to adopt once the round commits.
    A press with lanes (`Press.lanes` > 1) gives `deleted` and `values` lane by lane, [S, L, N]."""

    deleted: Tensor  # [S, N] bool: never a padding, pinned or protected row
    need: Tensor  # [S] int64: rows it was to free (per lane; deleted.sum(-1) < need: too few were selectable)
    values: Tensor  # [S, N] float64: the scores it selected by (junk past length)
    next: dict[str, Tensor]  # the next row and sequence state: current only once the round commits
    stop: Tensor  # [S] bool: the press cannot continue (none at capacity with at_capacity="stop")
    # rows coming back (recall): a state.slots.Inserts over these S sequences, its row state by
    # the press's own names; None: none
    inserts: Any = None
    # per-sequence tensors written in place (`slot_state`): name -> (members [n], items [n], values, axis)
    writes: dict = field(default_factory=dict)


def mean_after_sinks(shares: Tensor, length: Tensor, sinks: int) -> Tensor:
    """[S] float64: the mean share of rows [sinks, length), all live rows when length <= sinks
    (the sinks soak up most attention), 0.0 for an empty sequence. shares: [S, N] float64.

    The rules compare shares against this mean, and equal shares sit exactly on it, so it must
    be today's to the bit: the sum runs left to right (cumsum, on the CPU) as Python's `sum`
    over a list does. (float64 sums of float32 shares are mostly exact whatever the order;
    this keeps them equal where they are not.)"""
    row = torch.arange(shares.shape[1], device=shares.device)
    first = torch.where(length > sinks, sinks, 0)
    pool = (row >= first[:, None]) & (row < length[:, None])
    total = torch.where(pool, shares, 0.0).cumsum(dim=1)[:, -1] if shares.shape[1] else shares.new_zeros(len(length))
    count = length - first
    return torch.where(count > 0, total / count.clamp(min=1), 0.0)


class Press:
    """Scorer + unit + window + batch over S sequences; see the module docstring."""

    name: ClassVar[str] = "press"
    Settings: ClassVar[type[Settings]] = Settings
    unit: int = 1  # rows per unit
    # name -> (dtype, a new row's value); with lanes > 1 kept per lane, [S, L, N]
    row_state: dict[str, tuple[torch.dtype, float]] = {}
    lanes: int = 1  # lanes that keep their own rows (1: every lane alike; more: known once `bind` has run)
    reads_keys: ClassVar[bool] = False  # its rounds read rows' keys and values (`Rows.read`)
    reads_lane_peaks: bool = False  # its rounds read `Rows.lane_peaks` (every layer's attention recorded)
    reads_query: bool = False  # its rounds read `Rows.query` and `log_norm` (every layer recorded)
    # per-sequence tensors the state keeps in its slot: name -> (shape, dtype, fill); in `plan`'s
    # state by name, the next values in `Plan.next` (replaced) or `Plan.writes` (written in place)
    slot_state: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = {}
    # a round below the budget is plain (the engine's `_plain_round`): `plan` there deletes nothing,
    # brings nothing back, stops nothing and keeps no per-sequence state, so its next row state is
    # `score`'s and the round needs neither a selection nor a compaction. False: every round plans
    plain_rounds: ClassVar[bool] = False

    def __init__(self, settings: Settings | Mapping | Any):
        self.settings = self.Settings.of(settings)
        self.check()
        # which presses score together in a round (the engine groups by it every round)
        self.group = (self.name, self.settings.shared())

    # --- per press ----------------------------------------------------------------------------

    def bind(self, lm, policy=None) -> None:
        """Ready the press for `lm`'s sequences before one joins (`policy`: the joining brain's,
        whose loaded parts a press may share); most need nothing of the model."""

    def carry(self, policy, mirror) -> dict[str, Tensor] | None:
        """A joining sequence's per-row state, read from today's policy of the same name and its
        mirror (`{name: [rows]}`, with lanes `[lanes, rows]`), or None: the engine reads it
        the common way (brightness from the ledger, a keyed scorer's values)."""
        return None

    def restore(self, policy, mirror, rows: dict[str, Tensor], slots: dict[str, Tensor]) -> bool:
        """`carry` backwards, for a sequence leaving into its Brain: today's `policy` takes the
        state the press kept (`rows`: {name: [rows]}, or `[lanes, rows]`; `slots`: its
        `slot_state` tensors) for the rows of `mirror`. False: the engine restores it the
        common way (a keyed scorer's values, the random scorer's generator)."""
        return False

    def carry_slots(self, policy, mirror) -> dict[str, Tensor]:
        """A joining sequence's `slot_state` tensors, read from today's policy (others at their fill)."""
        return {}

    def score(self, rows: Rows, state: dict[str, Tensor], clock: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """values [S, N] float64 (lower = less worth keeping) and the next state (new tensors).
        clock [S] int64: the rounds each sequence was scored in before this one."""
        raise NotImplementedError

    def sequence_state(self) -> dict[str, Tensor]:
        """A new sequence's per-sequence state (the caller stacks them [S, ...]; none by default)."""
        return {}

    def window(self, length: Tensor) -> Tensor:
        """[S] int64: most recent rows never selected at live length `length` [S]: llama.cpp's
        max(32, length // 4)."""
        return (length // 4).clamp(min=RECENT_MIN)

    def batch(self) -> int:
        """Rows freed at once when the cache is full, so a sequence edits once every `batch`
        rounds: `evict_every` if set, else llama.cpp's batch, max(1, budget // 16), plus the
        row this round's token needs."""
        return self.settings.evict_every or max(1, self.settings.budget // 16) + 1

    def stops(self, length: Tensor) -> Tensor:
        """[S] bool: sequences the press cannot continue (none at capacity)."""
        return torch.zeros_like(length, dtype=torch.bool)

    # --- shared -------------------------------------------------------------------------------

    def check(self) -> None:
        """ValueError unless a full cache leaves at least one batch of selectable rows
        (`Policy.check`, the same message)."""
        s = self.settings
        window = self.window_at(s.budget)
        free = steps.selectable_rows(s.budget, sinks=s.sinks, protect=s.protect, window=window)
        need = self.batch()
        if len(free) < need:
            raise ValueError(
                f"policy {self.name}: budget {s.budget} leaves {len(free)} evictable rows after the protected "
                f"prefix ({max(s.sinks, s.protect)}) and the recent window ({window}); it needs at least {need}")

    def window_at(self, length: int) -> int:
        """`window` of one live length, as a number."""
        return int(self.window(torch.tensor([length]))[0])

    def due(self, length: Tensor) -> Tensor:
        """[S] int64: rows to free this round at live length `length` (before the round's add):
        none below the budget, `batch` at it, more above it."""
        budget = self.settings.budget
        return torch.where(length < budget, 0, length - budget + self.batch())

    def bounds(self, length: Tensor, kept: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """start, stop [S]: the selectable rows [start, stop) of each sequence (`kept`: the
        recent window is that of a context of `kept` rows, a prune's; default `length`)."""
        window = self.window(length if kept is None else kept)
        return bounds(length, max(self.settings.sinks, self.settings.protect), window)

    def plan(self, rows: Rows, state: dict[str, Tensor], clock: Tensor, need: Tensor | None = None,
             kept: Tensor | None = None) -> Plan:
        """Score, then select `need` rows per sequence (default `due`; `length - target` prunes
        down to a target, as `Policy.prune`, with the recent window of the `kept` [S] rows that
        remain). Nothing changes until the caller adopts `next`."""
        values, next = self.score(rows, state, clock)
        need = self.due(rows.length) if need is None else need
        start, stop = self.bounds(rows.length, kept)
        deleted = select(values, rows.length, need, start, stop, rows.pinned, self.unit)
        return Plan(deleted, need, values, next, self.stops(rows.length))

"""positronic/presses/: every press, batched over S sequences, deletes exactly the rows today's
per-sequence policy of the same name deletes, row for row, round after round (with the state
compacted between rounds as the caller will); `select` is `Policy.free` without a repairer.

The policies are built with `lm=None`: only a repairer reads the model, and these have none."""

import math
import random

import pytest
import torch

from positronic.brain.config import BrainConfig
from positronic.policies import POLICIES, make_policy
from positronic.policies import base as policy_base
from positronic.presses import PRESSES, Rows, make_press, select
from positronic.presses import base as press_base
from positronic.presses.select import bounds
from positronic.state import ContextView
from positronic import steps

ROUNDS = 24

# (press, BrainConfig settings): budgets, prefixes, windows, units and rules that differ
CASES = [
    ("streaming", dict(budget=48)),
    ("streaming", dict(budget=100, sinks=0, protect=8)),
    ("h2o", dict(budget=64)),
    ("h2o", dict(budget=100, sinks=2)),
    ("scored", dict(budget=48)),
    ("scored", dict(budget=100, protect=10)),
    ("random", dict(budget=64, seed=7)),
    ("none", dict(budget=48, protect=6, at_capacity="shift")),
    ("none", dict(budget=64, at_capacity="stop")),
    ("brightness", dict(budget=48)),
    ("brightness", dict(budget=64, window=8, unit=2)),
    ("brightness", dict(budget=60, window=6, unit=2, ttl_gain=10.0)),  # the reference gain: rows saturate, ties
    ("brightness", dict(budget=80, window=12, unit=3, sinks=2, brightness="vote")),
    ("brightness", dict(budget=60, window=16, brightness="vote", repair_batch=3)),
    # editing every N rounds (evict_every): one row every round, and a few at a time
    ("h2o", dict(budget=64, evict_every=1)),
    ("scored", dict(budget=48, evict_every=5)),
    ("streaming", dict(budget=100, evict_every=31)),
    ("brightness", dict(budget=60, window=16, evict_every=2)),
]


def config(name: str, **settings) -> BrainConfig:
    cfg = BrainConfig(policy=name, **settings)
    cfg.validate()
    return cfg


def view(length: int, *, ids=None, positions=None, brightness=None, pinned=None) -> ContextView:
    """A hand-made view: all a policy reads (the mirror's brightness arrives as float32, as from a state)."""
    rows = list(range(length))
    return ContextView(token_ids=torch.zeros(length, dtype=torch.long),
                       ledger_ids=torch.tensor(rows if ids is None else ids, dtype=torch.long),
                       positions=torch.tensor(rows if positions is None else positions, dtype=torch.long),
                       brightness=torch.tensor([255.0] * length if brightness is None else brightness,
                                               dtype=torch.float32),
                       predicted=torch.zeros(length, dtype=torch.long),
                       pinned=torch.tensor([False] * length if pinned is None else pinned, dtype=torch.bool))


def ties_to_the_higher_row(values, length, need, start, stop, pinned, unit):
    """A deliberately wrong selection: `select` with the rows in reverse, so ties go to the higher row."""
    rows = values.shape[1]
    return select(values.flip(1), torch.full_like(length, rows), need, rows - stop, rows - start, pinned.flip(1),
                  unit).flip(1)


# --- the rounds: the press against today's policies ------------------------------------------------------------


class Sequence:
    """One sequence as a Brain keeps it today: its rows (ledger ids, RoPE positions, pins, the
    mirror's brightness) and its own policy object."""

    def __init__(self, policy, length: int, start: float, rng: random.Random):
        self.policy, self.start, self.rng = policy, start, rng
        self.ids, self.next_id = list(range(length)), length
        self.positions = []
        for _ in range(length):
            self.positions.append((self.positions[-1] if self.positions else -1) + rng.choice([1, 1, 1, 2, 5]))
        self.pinned = [rng.random() < 0.06 for _ in range(length)]
        self.brightness = [rng.choice([start, start, start - 1.0, start / 2, 0.0, rng.uniform(0, start)])
                           for _ in range(length)]

    def view(self) -> ContextView:
        return view(len(self.ids), ids=self.ids, positions=self.positions, brightness=self.brightness,
                    pinned=self.pinned)

    def apply(self, deleted: list[int], brightness: list[float] | None) -> None:
        """The round's deletes and its add (Step 4): kept rows take the round's brightness,
        the new row the rule's start."""
        if brightness is not None:
            self.brightness = brightness
        gone = set(deleted)
        for name in ("ids", "positions", "pinned", "brightness"):
            setattr(self, name, [x for row, x in enumerate(getattr(self, name)) if row not in gone])
        self.ids.append(self.next_id)
        self.next_id += 1
        self.positions.append(self.positions[-1] + self.rng.choice([1, 1, 2]) if self.positions else 0)
        self.pinned.append(self.rng.random() < 0.03)
        self.brightness.append(self.start)


def junk(shape, dtype, rng: torch.Generator) -> torch.Tensor:
    """What padding rows hold: anything (NaN for floats), to show it never counts."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=rng) < 0.5
    if dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype)
    return torch.randint(-10**6, 10**6, shape, generator=rng, dtype=dtype)


def padded(lists: list[list], rows: int, dtype, rng: torch.Generator) -> torch.Tensor:
    """[S, rows] from per-sequence lists, junk past each list's length."""
    out = junk((len(lists), rows), dtype, rng)
    for s, values in enumerate(lists):
        out[s, :len(values)] = torch.tensor(values, dtype=dtype)
    return out


def carry(state: torch.Tensor, deleted: torch.Tensor, length: torch.Tensor, fill: float) -> torch.Tensor:
    """A row state after a round, moved as the caller moves rows: the survivors move up in
    order, each sequence's new row (the round's add) starts at `fill`, padding is junk."""
    row = torch.arange(state.shape[1])
    keep = (row < length[:, None]) & ~deleted
    moved = state.gather(1, torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices)
    kept = keep.sum(dim=1)[:, None]
    moved = torch.where(row == kept, torch.tensor(fill, dtype=state.dtype), moved)
    return torch.where(row <= kept, moved, torch.tensor(math.nan, dtype=state.dtype))


def shares_of(length: int, sinks: int, rng: random.Random) -> torch.Tensor:
    """Attention-like shares summing to ~1: heavy sinks, the rest from a few levels (equal
    shares, so ties everywhere), some rows unattended; one round in four the rest all equal,
    which puts every one of them exactly on the mean (vote: none above it; scored: all accessed)."""
    levels = [1] if rng.random() < 0.25 else [0, 1, 1, 2, 3, 3, 3, 5]
    raw = [20.0 if row < sinks else float(rng.choice(levels)) for row in range(length)]
    raw = raw if sum(raw) else [1.0] * length
    return torch.tensor(raw, dtype=torch.float32) / sum(raw)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all())


def mismatches(name: str, settings: dict, lengths: list[int], seed: int, rounds: int = ROUNDS) -> list[str]:
    """Play `rounds` rounds of len(lengths) sequences through the press and through one policy
    per sequence; every difference found (deleted rows, stop flags, values, state), in words."""
    rng, junk_rng = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = config(name, **settings)
    press = make_press(name, cfg)
    start = steps.RULES[cfg.brightness].start
    seqs = [Sequence(make_policy(name, None, cfg), length, start, rng) for length in lengths]
    capacity, found = max(lengths) + rounds + 2, []
    state = {key: padded([[fill] * len(q.ids) for q in seqs], capacity, dtype, junk_rng)
             for key, (dtype, fill) in press.row_state.items()}
    if "brightness" in state:  # rows already lived: the mirror's brightness, as a policy reads it
        state["brightness"] = padded([q.brightness for q in seqs], capacity, torch.float32, junk_rng)
    parts = [press.sequence_state() for _ in seqs]
    state |= {key: torch.stack([part[key] for part in parts]) for key in parts[0]}
    clock = torch.zeros(len(seqs), dtype=torch.long)
    for round_ in range(rounds):
        shares = [shares_of(len(q.ids), cfg.sinks, rng) for q in seqs]
        length = torch.tensor([len(q.ids) for q in seqs])
        rows = Rows(length=length, positions=padded([q.positions for q in seqs], capacity, torch.long, junk_rng),
                    shares=padded([s.tolist() for s in shares], capacity, torch.float32, junk_rng),
                    pinned=padded([q.pinned for q in seqs], capacity, torch.bool, junk_rng))
        if round_ % 7 == 3:  # a round that fails: nothing adopted, the inputs untouched, the same plan again
            before = {key: value.clone() for key, value in state.items()}
            failed = press.plan(rows, state, clock)
            assert all(same(before[key], state[key]) for key in state), "a plan wrote its input state"
        plan = press.plan(rows, state, clock)
        if round_ % 7 == 3 and not (torch.equal(failed.deleted, plan.deleted) and same(failed.values, plan.values)):
            found.append(f"round {round_}: the plan again after a failed round differs")
        for s, q in enumerate(seqs):
            live = int(length[s])
            old = q.policy.plan(q.view(), shares[s].tolist(), {})
            q.policy.commit(old.next)
            assert all(a["action"] == "delete" for a in old.actions)
            expected = sorted(a["position"] for a in old.actions)
            got = plan.deleted[s].nonzero().flatten().tolist()
            where = f"round {round_}, sequence {s} ({live} rows)"
            if got != expected:
                found.append(f"{where}: deleted {got}, the policy {expected}")
            if bool(plan.stop[s]) != old.stop:
                found.append(f"{where}: stop {bool(plan.stop[s])}, the policy {old.stop}")
            found += [f"{where}: {what}" for what in state_mismatches(name, q.policy, old, plan, s, live, q.ids)]
            q.apply(expected, old.brightness)
        state = {key: carry(plan.next[key], plan.deleted, length, fill)
                 for key, (_, fill) in press.row_state.items()} | {key: plan.next[key] for key in parts[0]}
        clock = clock + 1
    return found


def state_mismatches(name, policy, old, plan, s: int, live: int, ids: list[int]) -> list[str]:
    """What the press carries to the next round against what the policy does (its values, its state)."""
    if name == "brightness":
        got = plan.values[s, :live].tolist()
        return [] if got == old.brightness else [f"brightness {got}, the policy {old.brightness}"]
    if name in ("h2o", "scored"):
        key = "accumulated" if name == "h2o" else "last"
        got, want = plan.next[key][s, :live].tolist(), [float(policy.scorer.value[i]) for i in ids]
        return [] if got == want else [f"{key} {got}, the policy {want}"]
    if name == "random":
        return [] if torch.equal(plan.next["generator"][s], policy.scorer.generator.get_state()) else ["generator"]
    return []


def lengths_for(budget: int, count: int) -> list[int]:
    """Sequences of different lengths about the budget: one full, one over it (a budget made
    smaller), some filling up, and with eight a short one (length <= sinks at first)."""
    pool = [budget, budget + 9, budget - 5, 3, budget - 1, budget + 20, budget - 12, budget + 1]
    return pool[:count] if count > 1 else [budget]


@pytest.mark.parametrize("name,settings", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_every_press_deletes_what_its_policy_deletes_round_after_round(name, settings, count):
    found = mismatches(name, settings, lengths_for(settings["budget"], count), seed=count * 31 + len(name))
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("name,settings", [("scored", dict(budget=48)),
                                           ("brightness", dict(budget=60, window=6, unit=2, ttl_gain=10.0))])
def test_a_wrong_tie_order_is_caught(monkeypatch, name, settings):
    """The rounds can fail: with ties going to the higher row they do."""
    lengths = lengths_for(settings["budget"], 3)
    assert not mismatches(name, settings, lengths, seed=5, rounds=8)
    monkeypatch.setattr(press_base, "select", ties_to_the_higher_row)
    assert mismatches(name, settings, lengths, seed=5, rounds=8)


# --- select: Policy.free without a repairer -----------------------------------------------------------------


def reference(values: list[float], need: int, unit: int, sinks: int, protect: int, window: int,
              pinned: list[bool]) -> list[int]:
    """The rows today's `Policy.free(view, values, need, repair=False)` takes out, for a
    brightness policy of `unit`-row units and a fixed window, with no repairer."""
    cfg = config("brightness", budget=200, sinks=sinks, protect=protect, window=window, unit=unit)
    policy = make_policy("brightness", None, cfg)
    return sorted(policy.free(view(len(values), pinned=pinned), values, need, repair=False)[2])


def batched(cases: list[dict], unit: int, rows: int, chooser=select) -> list[list[int]]:
    """`chooser` over the cases as one batch of sequences, the deleted rows of each."""
    rng = torch.Generator().manual_seed(0)
    length = torch.tensor([len(c["values"]) for c in cases])
    starts, stops = zip(*[(r.start, r.stop) for c in cases for r in [steps.selectable_rows(
        len(c["values"]), sinks=c["sinks"], protect=c["protect"], window=c["window"])]])
    deleted = chooser(padded([c["values"] for c in cases], rows, torch.float64, rng), length,
                      torch.tensor([c["need"] for c in cases]), torch.tensor(starts), torch.tensor(stops),
                      padded([c["pinned"] for c in cases], rows, torch.bool, rng), unit)
    return [deleted[s].nonzero().flatten().tolist() for s in range(len(cases))]


def random_cases(rng: random.Random, count: int) -> list[dict]:
    """Sequences with few distinct values (ties), an occasional +inf, pins, and needs from 0 to more than fits."""
    cases = []
    for _ in range(count):
        length = rng.randint(0, 60)
        cases.append(dict(values=[rng.choice([0.0, 1.0, 1.0, 2.0, 3.0, 0.5, math.inf if rng.random() < 0.1 else 2.0])
                                  for _ in range(length)],
                          pinned=[rng.random() < 0.15 for _ in range(length)], need=rng.randint(0, 24),
                          sinks=rng.choice([0, 2, 4]), protect=rng.choice([0, 0, 6]), window=rng.choice([0, 3, 10])))
    return cases


@pytest.mark.parametrize("unit", [1, 2, 3])
def test_select_is_policy_free_without_a_repairer(unit):
    rng, wrong = random.Random(unit), 0
    for trial in range(30):
        cases = random_cases(rng, rng.choice([1, 3, 8]))
        want = [reference(c["values"], c["need"], unit, c["sinks"], c["protect"], c["window"], c["pinned"])
                for c in cases]
        assert batched(cases, unit, 64) == want, trial
        wrong += batched(cases, unit, 64, ties_to_the_higher_row) != want
    assert wrong > 10, "the cases have ties a wrong order would get wrong"


def test_select_by_hand():
    """Units of 2 over rows 2..9 (2 sinks, a window of 2): lowest max first, ties to the lower
    row, no overlaps; then single rows when the units run out; pins split units."""
    values = [0, 0, 3, 1, 1, 1, 2, 2, 1, 3, 0, 0]
    case = dict(values=[float(v) for v in values], sinks=2, protect=0, window=2, pinned=[False] * 12)
    assert batched([case | dict(need=4)], 2, 16) == [[3, 4, 5, 6]]  # (3,4) before (4,5): ties to the lower row
    assert batched([case | dict(need=5)], 2, 16) == [[3, 4, 5, 6, 7, 8]]
    # the units ran out: one single row more, row 2 (its 3 ties row 9's, the lower row goes)
    assert batched([case | dict(need=7)], 2, 16) == [[2, 3, 4, 5, 6, 7, 8]]
    pinned = [row == 4 for row in range(12)]
    assert batched([case | dict(need=2, pinned=pinned)], 2, 16) == [[5, 6]]
    assert batched([case | dict(need=3, pinned=pinned)], 1, 16) == [[3, 5, 8]]
    for need in (4, 5, 7):
        want = reference(case["values"], need, 2, 2, 0, 2, case["pinned"])
        assert batched([case | dict(need=need)], 2, 16) == [want]


def test_bounds_are_selectable_rows():
    for length in range(0, 50):
        for prefix, window in ((4, 0), (4, 10), (0, 32), (20, 5), (60, 3)):
            start, stop = bounds(torch.tensor([length]), prefix, torch.tensor([window]))
            free = steps.selectable_rows(length, sinks=prefix, window=window)
            assert (int(start[0]), int(stop[0])) == (free.start, free.stop)


# --- the budget maths and the settings ------------------------------------------------------------------------


def test_registry_and_make_press():
    assert set(PRESSES) == {"streaming", "h2o", "scored", "brightness", "random", "none", "smartkv", "knorm"}
    assert set(PRESSES) <= set(POLICIES)
    assert (press_base.RECENT_MIN, press_base.DEFAULT_WINDOW) == (policy_base.RECENT_MIN, policy_base.DEFAULT_WINDOW)
    cfg = config("brightness", budget=64, window=8, unit=3, brightness="vote")
    press = make_press("brightness", cfg)
    assert (press.settings.window, press.unit, press.settings.brightness) == (8, 3, "vote")
    assert press.row_state == {"brightness": (torch.float32, steps.VOTE_START)}
    assert make_press("h2o", {"budget": 64}).settings == PRESSES["h2o"].Settings(budget=64)
    assert make_press("brightness", {"budget": 64}).unit == 1, "unit 0: single rows without a repairer"
    with pytest.raises(ValueError, match="unknown press 'tova'"):
        make_press("tova", {"budget": 64})
    with pytest.raises(ValueError, match="at_capacity must be 'stop' or 'shift', got 'wrap'"):
        make_press("none", {"budget": 64, "at_capacity": "wrap"})
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        make_press("streaming", {"budget": 0})


@pytest.mark.parametrize("name", ["streaming", "h2o", "scored", "random", "brightness"])
def test_window_batch_and_due_are_the_policys(name):
    for settings in (dict(budget=48), dict(budget=100, protect=10), dict(budget=512) | ({"window": 64} if name == "brightness" else {}), dict(budget=130),
                     dict(budget=64, evict_every=1), dict(budget=100, protect=10, evict_every=7)):
        cfg = config(name, **settings)
        press, policy = make_press(name, cfg), make_policy(name, None, cfg)
        lengths = list(range(0, settings["budget"] + 40))
        assert press.window(torch.tensor(lengths)).tolist() == [policy.window(cfg, n) for n in lengths]
        assert press.batch() == policy.batch(cfg)
        assert press.due(torch.tensor(lengths)).tolist() == [policy.due(n) for n in lengths]


@pytest.mark.parametrize("name,settings", [("streaming", dict(budget=140, protect=100)),
                                           ("h2o", dict(budget=60, sinks=26)),
                                           ("brightness", dict(budget=40, window=36))])
def test_a_budget_without_room_is_refused_in_the_policys_words(name, settings):
    cfg = BrainConfig(policy=name, **settings)  # not validated: that would refuse it already
    with pytest.raises(ValueError) as policy_error:
        POLICIES[name].check(cfg)
    with pytest.raises(ValueError) as press_error:
        make_press(name, cfg)
    assert str(press_error.value) == str(policy_error.value)

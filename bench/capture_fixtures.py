"""Make the committed tick fixtures in fixtures/ from the embedded model (SmolLM2, float32, CPU).

    .venv/bin/python bench/capture_fixtures.py [--out fixtures]

Deterministic (fixed prompt, seed and greedy choices), so the files can be regenerated; a
rerun on the same torch/transformers build gives fixtures that replay the same. One live run
(brightness policy, budget 40, the self repairer: one token per pair, two pairs every other
tick) from a 53-token prompt, pruned to the budget before the first tick, provides:

    loop_two_repairs.pt       captured by Capture: the first tick with two repairs from tick
                              8 on (edits behind it, so the live cache carries splice traces),
                              with its Step 2b brightness
    loop_rebuild.pt           captured by Capture: a repair tick that failed at stage "commit"
                              (fault injected by an observer: every new row written, then the
                              mirror refuses); the tick is not applied, the cache rebuilt
and, on the same run's state, ticks crafted through the API (capture_tick), each with the
tick's greedy `add` last as the loop would:
    api_replace_3_tokens.pt   replace_pair with 3 new tokens
    api_two_repairs_2_tokens.pt  two replace_pairs of 2 new tokens each around a delete: the
                              right pair's tokens are computed seeing the left pair's
    api_delete_row4.pt        delete at row 4, the first row after the 4 attention sinks
    api_delete_last_row.pt    delete at the last row
    api_rebuild_mid_forward.pt   delete + replace_pair + add, fault half-way through the
                              forward (some layers wrote their rows): the cache is rebuilt
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from positronic import load_model  # noqa: E402
import torch  # noqa: E402

from positronic.cli import DEFAULT_PROMPT  # noqa: E402
from positronic.fixtures import Capture, capture_tick, load_fixture, replay, save_fixture  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402

# the self repairer proposes 1 token per pair; repair_batch 2: every other tick repairs two pairs
CONFIG = dict(budget=40, window=8, seed=1, temperature=0.7, repairer="self", repair_batch=2)
# The default prompt and more: 53 tokens with BOS, over the budget of 40, so the start prunes
# it to the budget and from tick 1 on every other tick repairs two pairs.
PROMPT = DEFAULT_PROMPT + (" made the finest clocks in the land. Every morning he wound each one by hand and "
                           "listened to the ticking that filled his small shop, and every evening he")
FIRST_LOOP_TICK = 8  # the loop fixture is taken from this tick on
MAX_TICKS = 120  # the live run's captures happen well before this


class FirstMatch(Capture):
    """Capture only the first tick whose action list satisfies `predicate`."""

    def __init__(self, directory: Path, lm, predicate):
        super().__init__(directory, lm, "all", limit=1)
        self.predicate = predicate

    def wants(self, tick: int, actions: list[dict]) -> bool:
        return super().wants(tick, actions) and self.predicate(actions)


class FaultOnFirstRepair:
    """Observer: make the first apply that has a replace_pair fail at `stage`."""

    def __init__(self, stage: str):
        self.stage, self.tick = stage, None

    def before_apply(self, brain, actions: list[dict], brightness=None) -> None:
        if self.tick is None and any(a["action"] == "replace_pair" for a in actions):
            self.tick = brain.tick
            brain.state.inject_fault(self.stage)

    def after_apply(self, brain, actions: list[dict], report) -> None:
        if brain.tick == self.tick and not report.rebuilt:
            raise SystemExit(f"tick {brain.tick}: the injected fault did not fire")


def two_repairs(actions: list[dict]) -> bool:
    return sum(a["action"] == "replace_pair" for a in actions) >= 2


class TwoRepairsFrom(FirstMatch):
    """The first tick from `first` on with two repairs."""

    def __init__(self, directory: Path, lm, first: int):
        super().__init__(directory, lm, two_repairs)
        self.first = first

    def wants(self, tick: int, actions: list[dict]) -> bool:
        return tick >= self.first and super().wants(tick, actions)


def run_until(brain: Brain, capture: Capture) -> Path:
    """Step until `capture` wrote its file; returns it."""
    for _ in range(MAX_TICKS):
        brain.step()
        if capture.written:
            return capture.written[0]
    raise SystemExit(f"no tick within {MAX_TICKS} matched {type(capture).__name__}")


def live_fixtures(brain: Brain, lm, scratch: Path, out: Path) -> None:
    """loop_two_repairs.pt and loop_rebuild.pt, through Capture in the running loop."""
    capture = TwoRepairsFrom(scratch / "repair", lm, FIRST_LOOP_TICK)
    brain.observers[:] = [capture]
    shutil.copy(run_until(brain, capture), out / "loop_two_repairs.pt")
    capture = Capture(scratch / "rebuild", lm, "repairs", limit=1)
    brain.observers[:] = [FaultOnFirstRepair("commit"), capture]  # the fault first: both see one tick
    shutil.copy(run_until(brain, capture), out / "loop_rebuild.pt")
    brain.observers.clear()


def crafted(brain: Brain, name: str, actions: list[dict], out: Path, *, fault: str | None = None,
            label: str) -> None:
    """Apply one crafted tick (plus the greedy add) to the running state as the brain's next
    tick and save it. No Step 2b runs for it, so it stores no brightness."""
    state = brain.state
    brain.tick += 1
    actions = actions + [{"action": "add", "token_id": int(state.next_logits.argmax())}]
    fixture, report = capture_tick(state, actions, tick=brain.tick, fault=fault, label=f"crafted: {label}")
    if report.rebuilt != (fault is not None):
        raise SystemExit(f"{name}: rebuilt={report.rebuilt} with fault {fault}")
    save_fixture(fixture, out / name)
    for _ in range(2):  # a couple of ordinary ticks between crafted ones
        brain.step()


def crafted_fixtures(brain: Brain, lm, out: Path) -> None:
    three = lm.encode(" a small wooden")[:3]
    if len(three) != 3:
        raise SystemExit(f"expected 3 tokens, got {three}")
    crafted(brain, "api_replace_3_tokens.pt",
            [{"action": "replace_pair", "original_pos1": 10, "original_pos2": 11, "new_token_ids": three}], out,
            label="replace_pair rows 10-11 with 3 tokens, then the greedy add")
    two_a, two_b = lm.encode(" the clock")[:2], lm.encode(" an old")[:2]
    if len(two_a) != 2 or len(two_b) != 2:
        raise SystemExit(f"expected 2 tokens each, got {two_a}, {two_b}")
    crafted(brain, "api_two_repairs_2_tokens.pt",
            [{"action": "replace_pair", "original_pos1": 20, "original_pos2": 21, "new_token_ids": two_b},
             {"action": "delete", "position": 16},
             {"action": "replace_pair", "original_pos1": 8, "original_pos2": 9, "new_token_ids": two_a}], out,
            label="replace_pair rows 8-9 and 20-21 with 2 tokens each, delete row 16, then the greedy add")
    crafted(brain, "api_delete_row4.pt", [{"action": "delete", "position": 4}], out,
            label="delete row 4 (first unprotected row after 4 sinks), then the greedy add")
    crafted(brain, "api_delete_last_row.pt", [{"action": "delete", "position": len(brain.state) - 1}], out,
            label="delete the last row, then the greedy add")
    crafted(brain, "api_rebuild_mid_forward.pt",
            [{"action": "replace_pair", "original_pos1": 12, "original_pos2": 13, "new_token_ids": two_a},
             {"action": "delete", "position": 20}], out, fault="mid-forward",
            label="delete row 20, replace_pair rows 12-13, add; fault half-way through the forward -> "
                  "the tick is not applied, the cache is rebuilt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "fixtures")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # deterministic and, where cores are shared, much faster; replay needs no match
    lm = load_model("smollm2", device="cpu", dtype="float32")
    brain = Brain.start(lm, [lm.bos_id] + lm.encode(PROMPT), BrainConfig(**CONFIG))
    with tempfile.TemporaryDirectory() as scratch:
        live_fixtures(brain, lm, Path(scratch), out)
    crafted_fixtures(brain, lm, out)
    for path in sorted(out.glob("*.pt")):  # every file must replay before it is committed
        result = replay(load_fixture(path), lm)
        print(f"{path.name:28} {path.stat().st_size:7} bytes  {'PASS' if result.passed else 'FAIL'}")
        if not result.passed:
            raise SystemExit(f"{path}: {', '.join(result.failed())} differ")


if __name__ == "__main__":
    main()

"""Make the committed tick fixtures in fixtures/ from the embedded model (SmolLM2, float32, CPU).

    .venv/bin/python bench/capture_fixtures.py [--out fixtures]

Deterministic (fixed prompt, seed and greedy choices), so the files can be regenerated; a
rerun on the same torch/transformers build gives fixtures that replay the same. One live run
(brightness policy, budget 40, the self repairer proposing 2 tokens per pair) provides:

    loop_repair_2_tokens.pt   captured by Capture: the first tick with two 2-token repairs
    loop_rebuild.pt           captured by Capture: a repair tick whose apply failed after its
                              3rd edit (fault injected by an observer); the cache was rebuilt
and, on the same run's state, ticks crafted through the API (capture_tick), each with the
tick's greedy `add` last as the loop would:
    api_replace_3_tokens.pt   replace_pair with 3 new tokens
    api_delete_row4.pt        delete at row 4, the first row after the 4 attention sinks
    api_delete_last_row.pt    delete at the last row
    api_rebuild_mid_edit.pt   delete + replace_pair + add, fault inside the 4th edit (the
                              store spliced, the mirror not yet): the cache is rebuilt
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
from positronic.cli import DEFAULT_PROMPT  # noqa: E402
from positronic.fixtures import Capture, Fault, capture_tick, load_fixture, replay, save_fixture  # noqa: E402
from positronic.loop import Brain, BrainConfig  # noqa: E402

CONFIG = dict(budget=40, window=8, repair_tokens=2, seed=1, temperature=0.7)
MAX_TICKS = 120  # the live run's captures happen well before this


class FirstMatch(Capture):
    """Capture only the first tick whose action list satisfies `predicate`."""

    def __init__(self, directory: Path, lm, predicate):
        super().__init__(directory, lm, "all", limit=1)
        self.predicate = predicate

    def wants(self, tick: int, actions: list[dict]) -> bool:
        return super().wants(tick, actions) and self.predicate(actions)


class FaultOnFirstRepair:
    """Observer: before the first apply that has a replace_pair, make its edit `after_edits` fail."""

    def __init__(self, after_edits: int):
        self.after_edits, self.tick = after_edits, None

    def before_apply(self, brain, actions: list[dict]) -> None:
        if self.tick is None and any(a["action"] == "replace_pair" for a in actions):
            self.tick = brain.tick
            brain.state.inject_fault(self.after_edits)

    def after_apply(self, brain, actions: list[dict], report) -> None:
        if brain.tick == self.tick and not report.rebuilt:
            raise SystemExit(f"tick {brain.tick}: the injected fault did not fire")


def two_pairs_of_two(actions: list[dict]) -> bool:
    pairs = [a for a in actions if a["action"] == "replace_pair"]
    return len(pairs) >= 2 and all(len(a["new_token_ids"]) == 2 for a in pairs)


def run_until(brain: Brain, capture: Capture) -> Path:
    """Step until `capture` wrote its file; returns it."""
    for _ in range(MAX_TICKS):
        brain.step()
        if capture.written:
            return capture.written[0]
    raise SystemExit(f"no tick within {MAX_TICKS} matched {type(capture).__name__}")


def live_fixtures(brain: Brain, lm, scratch: Path, out: Path) -> None:
    """loop_repair_2_tokens.pt and loop_rebuild.pt, through Capture in the running loop."""
    capture = FirstMatch(scratch / "repair", lm, two_pairs_of_two)
    brain.observers[:] = [capture]
    shutil.copy(run_until(brain, capture), out / "loop_repair_2_tokens.pt")
    capture = Capture(scratch / "rebuild", lm, "repairs", limit=1)
    brain.observers[:] = [FaultOnFirstRepair(after_edits=3), capture]  # the fault first: both see one tick
    shutil.copy(run_until(brain, capture), out / "loop_rebuild.pt")
    brain.observers.clear()


def crafted(brain: Brain, name: str, actions: list[dict], out: Path, *, fault: Fault | None = None,
            label: str) -> None:
    """Apply one crafted tick (plus the greedy add) to the running state and save it."""
    state = brain.state
    brain.tick += 1
    state.tick = brain.tick
    actions = actions + [{"action": "add", "token_id": int(state.next_logits.argmax())}]
    fixture, report = capture_tick(state, actions, fault=fault, label=f"crafted: {label}")
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
    crafted(brain, "api_delete_row4.pt", [{"action": "delete", "position": 4}], out,
            label="delete row 4 (first unprotected row after 4 sinks), then the greedy add")
    crafted(brain, "api_delete_last_row.pt", [{"action": "delete", "position": len(brain.state) - 1}], out,
            label="delete the last row, then the greedy add")
    two = lm.encode(" the clock")[:2]
    crafted(brain, "api_rebuild_mid_edit.pt",
            [{"action": "replace_pair", "original_pos1": 12, "original_pos2": 13, "new_token_ids": two},
             {"action": "delete", "position": 20}], out, fault=Fault(4, mid_edit=True),
            label="delete row 20, replace_pair rows 12-13, add; fault inside edit 4 (the insert) -> rebuild")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "fixtures")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model("smollm2", device="cpu", dtype="float32")
    brain = Brain.start(lm, [lm.bos_id] + lm.encode(DEFAULT_PROMPT), BrainConfig(**CONFIG))
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

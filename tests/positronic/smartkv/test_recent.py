"""`--memory-rank recent`: a lane's memory ranked by the gates and by the attention the lane
paid each row lately (positronic/smartkv/recent.py).

The rank's arithmetic is checked on RecentMemories alone; in the brain it is held to the
prototype it was measured with (bench/observed_rank.py --fresh-back, which patches the default
policy and keeps its sums in a table of its own): the same rows in every lane and the same
logits at every tick, recall taking tokens back included."""

import numpy as np
import pytest
import torch

from positronic.brain import session as sessions
from positronic.brain.defaults import default_policy
from positronic.brain.loop import Brain, BrainConfig
from positronic.mirror import to_bytes
from positronic.smartkv import policy as smartkv_policy
from positronic.smartkv import rows as smartkv_rows
from positronic.smartkv.recent import BETA, DECAY, RecentMemories, lane_shares
from positronic.smartkv.rows import Memories
from positronic.state import FAULT_STAGES

from .test_policy import (BUDGET, any_gate_file, config, gate_file, head_gate_file,  # noqa: F401 (fixtures)
                          layer_positions, resumed_midway, text_ids)
from .test_recall_pins import eager_recall  # noqa: F401 (a fixture)

HORIZON = 100


def filled(kind, scores=(0.0, 0.5, 1.0)):
    """A one-lane memory of len(scores) tokens (ids 10, 11, ..., positions 0, 1, ...), full."""
    memory = kind(1, len(scores), HORIZON)
    for i, score in enumerate(scores):
        memory.offer(10 + i, i, [score], now=i)
    return memory


def test_recent_attention_outranks_a_higher_gate_score():
    gates, recent = filled(Memories), filled(RecentMemories)
    lane_ids = np.array([[0, 10, 11, 12, 20]])  # a sink, the memory's three, a window token
    share = np.array([[5.0, 3.0, 0.0, 0.0, 9.0]])  # the lane looks at token 10, the weakest by its gate
    recent.attend(lane_ids, share, newer_than=19)
    assert recent.used[0, :3].tolist() == [3.0, 0.0, 0.0]
    recent.attend(lane_ids, share, newer_than=19)
    assert recent.used[0, :3].tolist() == [DECAY * 3.0 + 3.0, 0.0, 0.0]
    assert recent.window_ids.tolist() == [20] and recent.window_used.tolist() == [[DECAY * 9.0 + 9.0]]
    # the gates alone drop token 10 (4 ** 0 times the lifespan left: the lowest); used, it outranks 11
    assert gates.offer(13, 3, [0.6], now=3).tolist() == [10]
    assert recent.offer(13, 3, [0.6], now=3).tolist() == [11]
    rank = recent._ranks(3, slice(0, 3))[0]
    plain = Memories._unheld_ranks(recent, 3, (0, slice(0, 3)))
    np.testing.assert_allclose(rank, plain * (1 + recent.used[0, :3]) ** BETA)


def test_a_window_token_brings_its_sums_and_a_token_taken_back_starts_with_nothing():
    memory = filled(RecentMemories)
    memory.used[0, :] = 7.0  # the offered column's leftovers included
    memory.attend(np.array([[0, 10, 11, 12, 13, 14]]), np.array([[1.0, 0, 0, 0, 6.0, 2.0]]), newer_than=12)
    assert memory.used[0, :3].tolist() == [DECAY * 7.0] * 3
    memory.offer(13, 3, [5.0], now=3)  # a strong newcomer: the weakest old token goes
    assert memory.used[0, memory.ids[0, :3].tolist().index(13)] == 6.0  # its attention in the window
    memory.offer(15, 4, [9.0], now=4)  # a token the window never counted: nothing
    assert memory.used[0, memory.ids[0, :3].tolist().index(15)] == 0.0
    memory.used[0, :3] = [1.0, 2.0, 3.0]
    memory.take_back(0, [99], [0.0], now=4, hold=2)  # recall: in place of the weakest
    at = memory.ids[0, :3].tolist().index(99)
    assert memory.used[0, at] == 0.0 and sorted(memory.used[0, :3].tolist()).count(0.0) == 1
    memory.used[0, at] = 1e9  # held rows stay held whatever their use: none outranks "held"
    assert memory._ranks(5, slice(0, 3))[0, at] == smartkv_rows.HELD


def test_the_sums_move_with_copies_and_pins():
    memory = filled(RecentMemories, (0.0, 0.5, 1.0, 1.5))
    memory.used[0, :4] = [1.0, 2.0, 3.0, 4.0]
    memory.attend(np.array([[10, 11, 12, 13, 20]]), np.zeros((1, 5)), newer_than=19)
    memory.used[0, :4], memory.window_used[0, 0] = [1.0, 2.0, 3.0, 4.0], 5.0
    twin = memory.copy()
    assert type(twin) is RecentMemories and twin.used[0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert twin.window_ids.tolist() == [20] and twin.window_used.tolist() == [[5.0]]
    twin.used[0, 0] = twin.window_used[0, 0] = 9.0
    assert memory.used[0, 0] == 1.0 and memory.window_used[0, 0] == 5.0
    memory.remove(11)  # pinned: out of the memory, the last held token fills its slot
    assert dict(zip(memory.ids[0, :3].tolist(), memory.used[0, :3].tolist())) == {10: 1.0, 13: 4.0, 12: 3.0}
    memory.grow()
    assert memory.used.shape == (1, 5) and memory.used[0, :3].tolist() == [1.0, 4.0, 3.0]


def test_attention_that_misses_a_held_token_is_refused():
    memory = filled(RecentMemories)
    with pytest.raises(RuntimeError, match="lane 0's memory holds a token its cache rows do not"):
        memory.attend(np.array([[0, 10, 12]]), np.ones((1, 3)), newer_than=12)
    with pytest.raises(RuntimeError, match="a lane's rows are not in ledger order"):  # one search needs them ascending
        memory.attend(np.array([[0, 11, 10, 12]]), np.ones((1, 4)), newer_than=12)
    with pytest.raises(ValueError, match="attention of 2 lanes"):
        memory.attend(np.zeros((2, 3), dtype=np.int64), np.ones((2, 3)), newer_than=0)
    assert not memory.used.any()
    with pytest.raises(RuntimeError, match="not the same window tokens"):
        RecentMemories(2, 2, HORIZON).attend(np.array([[0, 20, 21], [0, 20, 22]]), np.ones((2, 3)), newer_than=19)


def test_the_setting_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="memory_rank must be one of gates, recent, got 'often'"):
        BrainConfig(policy="smartkv", memory_rank="often").validate()
    with pytest.raises(ValueError, match="--memory-rank applies to policy smartkv, not brightness"):
        BrainConfig(policy="brightness", memory_rank="recent").validate()
    assert BrainConfig(policy="smartkv", memory_rank="recent").recorded_layers == "all"  # every lane's query
    assert sessions.BEFORE_NEW_SETTINGS["memory_rank"] == "gates"  # older sessions rank as they began


def prototype(monkeypatch, bench_script):
    """bench/observed_rank.py --fresh-back patched into the default policy (undone after the test)."""
    script = bench_script("observed_rank")
    for owner, name in ((Memories, "_ranks"), (Memories, "take_back"), (Memories, "offer"),
                        (smartkv_policy.SmartKVPolicy, "_plan"), (script.Observed, "current")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored at teardown, whatever patch sets
    script.patch(beta=2.0, decay=0.97, offset=1.0, seed_restored=False, fresh_back=True)  # as measured: smartkv.md


def forced(lm, settings, ids, start):
    """Rows of every lane and the logits after each forced tick, and the restore actions."""
    brain = Brain.start(lm, ids[:start], settings)
    lanes, logits, restores = [], [], []
    for token in ids[start:]:
        record = brain.step(force=token)
        assert not record.rebuilt, record.error
        lanes.append(layer_positions(brain.state))
        logits.append(brain.state.next_logits.clone())
        restores += [a for a in record.actions if a["action"] == "restore"]
    brain.state.check(deep=True)
    return lanes, logits, restores


def test_the_brain_keeps_what_the_measured_prototype_keeps(tiny, head_gate_file, eager_recall, monkeypatch,
                                                            bench_script):
    """Per-head lanes, as the prototype reads them (and as the shipped gates are)."""
    ids = text_ids(tiny, 90, seed=41)
    product = forced(tiny, config(head_gate_file, recall=True, memory_rank="recent"), ids, 15)
    gates_only = forced(tiny, config(head_gate_file, recall=True, memory_rank="gates"), ids, 15)
    prototype(monkeypatch, bench_script)  # it patches the gates' rank
    measured = forced(tiny, config(head_gate_file, recall=True, memory_rank="gates"), ids, 15)
    assert product[2], "recall should take tokens back (their sums start again)"
    assert product[0] == measured[0]
    for ours, theirs in zip(product[1], measured[1]):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert product[0] != gates_only[0], "recent use should change the rows some lane keeps"


def test_a_lane_of_a_whole_layer_counts_the_largest_share_of_any_head(tiny, gate_file):
    """Per-layer gates: a lane is a layer, and its share of a row is the largest over all the
    layer's query heads. Checked against the attention row the forward itself records."""
    brain = Brain.start(tiny, text_ids(tiny, 30, seed=46), config(gate_file, memory_rank="recent"))
    for token in text_ids(tiny, 8, seed=47)[1:]:
        brain.step(force=token)
    view = brain.state.view(keys=True)
    ids, share = lane_shares(view, heads=1)
    assert ids.shape == share.shape and ids.shape[0] == tiny.num_layers
    keys = view.rows.lane_keys()  # [layers, kv_heads, rows, head_dim]
    group = view.query.shape[1] // keys.shape[1]
    for layer in range(tiny.num_layers):  # the query attended exactly these rows: a softmax over them
        weights = torch.stack([torch.softmax(keys[layer, head // group] @ view.query[layer, head], dim=0)
                               for head in range(view.query.shape[1])])  # [heads, rows]
        np.testing.assert_allclose(share[layer], weights.amax(0).numpy() * ids.shape[1], rtol=1e-4, atol=1e-6)
        assert (weights.amax(0) > weights.amin(0) + 1e-3).any(), "the heads should disagree somewhere"


def test_a_resumed_session_goes_on_exactly_with_its_sums(tiny, head_gate_file, tmp_path):
    expected, got, brain, resumed = resumed_midway(tiny, config(head_gate_file, temperature=0.9, memory_rank="recent"),
                                                   seed=43, path=tmp_path / "s")
    assert got == expected
    saved = brain.policy.state()
    assert np.asarray(saved["used"]).shape == (brain.state.lanes, brain.policy.memory.count)
    assert np.asarray(saved["used"]).any(), "twenty ticks of attention should have counted"
    assert len(saved["window_used"]) == 6  # the window's tokens (--window 6)
    before = resumed.policy.state()
    for bad in ({k: v for k, v in saved.items() if k != "used"}, saved | {"used": [[-1.0]]},
                saved | {"used": [row + [0.0] for row in saved["used"]]}, saved | {"used": "many"},
                {k: v for k, v in saved.items() if k != "window_used"}, saved | {"window_used": "many"},
                saved | {"window_used": saved["window_used"][::-1]},  # ids out of order
                saved | {"window_used": [[i, sums[:-1]] for i, sums in saved["window_used"]]}):
        with pytest.raises(ValueError, match="malformed saved state"):
            resumed.policy.load_state(bad)
        assert resumed.policy.state() == before  # nothing changed


@pytest.mark.parametrize("stage", FAULT_STAGES[:2])
def test_a_failed_tick_leaves_the_sums_as_they_were(tiny, head_gate_file, stage):
    brain = Brain.start(tiny, text_ids(tiny, 40, seed=44), config(head_gate_file, memory_rank="recent"))
    for token in text_ids(tiny, 12, seed=45)[1:]:
        brain.step(force=token)
    mirror_before, policy_before = to_bytes(brain.state.mirror), brain.policy.state()
    brain.state.inject_fault(stage)
    record = brain.step(force=7)
    assert record.rebuilt and record.error
    assert to_bytes(brain.state.mirror) == mirror_before and brain.policy.state() == policy_before
    assert not brain.step(force=7).rebuilt
    brain.state.check(deep=True)


def test_run_and_eval_take_the_setting(run_cli, tiny, head_gate_file, tmp_path, capsys):
    common = ("-m", "random:tiny", "--policy", "smartkv", "--gates", str(head_gate_file))
    assert run_cli(*common, "--memory-rank", "recent", "-c", "24", "--window", "8", "-n", "40", "--no-tui",
                   "--no-input", "--session", str(tmp_path / "s")) == 0
    resumed = sessions.resume(tiny, tmp_path / "s")
    assert resumed.config.memory_rank == "recent" and type(resumed.policy.memory) is RecentMemories

    def eval_ppl(*flags) -> str:
        out = tmp_path / f"e{len(flags)}"
        assert run_cli("eval", *common, "--policy", "streaming", "--budget", "48", "--max-tokens", "120", "--no-probe",
                       "--out", str(out), *flags) == 0  # streaming takes no rank: it runs as without the flag
        return next(line for line in (out / "results.csv").read_text().splitlines() if line.startswith("smartkv,48,"))

    assert eval_ppl("--memory-rank", "recent") != eval_ppl()
    capsys.readouterr()
    assert run_cli("eval", *common, "--memory-rank", "recent", "--generate", "8", "--out", str(tmp_path / "g")) != 0
    assert "--memory-rank applies to the teacher-forced eval" in capsys.readouterr().err


def test_the_default_ranks_by_recent_use_where_recall_runs(run_cli, tiny, head_gate_file, tmp_path):
    """The best measured: recent with recall (the default policy's), the gates alone without."""
    assert BrainConfig(policy="smartkv", recall=True).memory_rank == "recent"
    assert BrainConfig(policy="smartkv").memory_rank == "gates"
    assert BrainConfig(policy="brightness", recall=True).memory_rank == "gates"  # it has no such memory
    assert BrainConfig(policy="smartkv", recall=True, memory_rank="gates").memory_rank == "gates"
    assert "its memory ranked by recent use too" in default_policy("smollm2", BrainConfig(budget=256)).note
    assert "recent" not in default_policy("smollm2", BrainConfig(budget=256), recall=False).note

    def resumed(*flags):  # no --policy: the default policy for a model with gates, smartkv with recall
        path = tmp_path / f"s{len(flags)}"
        assert run_cli("-m", "random:tiny", "--gates", str(head_gate_file), "-c", "24", "--window", "8", "-n", "20",
                       "--no-tui", "--no-input", "--session", str(path), *flags) == 0
        brain = sessions.resume(tiny, path)
        return brain.config.policy, brain.config.recall, brain.config.memory_rank, type(brain.policy.memory)

    assert resumed() == ("smartkv", True, "recent", RecentMemories)
    assert resumed("--memory-rank", "gates") == ("smartkv", True, "gates", Memories)
    assert resumed("--no-recall", "-n", "20") == ("smartkv", False, "gates", Memories)


def test_batched_sequences_make_what_each_makes_alone(tiny, head_gate_file, alone, batched):
    """Two sequences ranked by recent use (one with recall), past their budgets, batched."""
    prompts = [text_ids(tiny, 30, seed=48), text_ids(tiny, 26, seed=49)]
    configs = [dict(policy="smartkv", gates=str(head_gate_file), budget=BUDGET, sinks=3, window=6, seed=0,
                    temperature=0, memory_rank="recent"),
               dict(policy="smartkv", gates=str(head_gate_file), budget=BUDGET + 4, sinks=3, window=6, seed=1,
                    temperature=0.9, memory_rank="recent", recall=True)]
    ticks = 30
    want = [alone(tiny, prompt, ticks, **config) for prompt, config in zip(prompts, configs)]
    batch, got = batched(tiny, prompts, configs, ticks)
    assert got == want
    for brain in batch.brains.values():
        assert brain.policy.memory.used.any()
        brain.state.check(deep=True)

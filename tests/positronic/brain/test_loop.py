"""The tick loop end to end on the real embedded model, sessions, fidelity and typed input
(positronic/brain/loop.py); the repairers are tests/positronic/policies/test_repairers.py."""

import json
import re

import pytest
import torch

from positronic import mirror as mirror_pkg
from positronic import steps
from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.policies import make_policy
from positronic.state.manager import StateManager

PROMPT = "The old lighthouse keeper climbed the spiral stairs every night, counting each step"


def test_300_ticks_at_budget_128_stay_consistent_and_bounded(smol):
    config = BrainConfig(budget=128, seed=3, repairer="self")
    brain = Brain.start(smol, [smol.bos_id] + smol.encode(PROMPT), config)
    lengths, actions = [], []
    for _ in range(300):
        record = brain.step()
        brain.state.check()
        lengths.append(record.live_length)
        actions += record.actions
        assert 0 <= record.brightness_min <= record.brightness_max <= 255
        assert not record.rebuilt, record.error
    warm = next(i for i, n in enumerate(lengths) if n >= 128)
    assert max(lengths[warm:]) <= 128 + 2, "after warm-up the length stays within budget + cull rate"
    assert brain.counts["repairs"] > 50
    assert any(a["action"] == "replace_pair" for a in actions)
    brain.state.check(deep=True)
    ledger = brain.state.mirror.ledger
    assert ledger.count("replaced") == 2 * brain.counts["repairs"]
    assert len(ledger) == len(brain.state) + ledger.count("replaced") + ledger.count("culled")


@pytest.mark.smollm2
def test_events_file_has_one_parsable_record_per_tick(tmp_path, capsys, run_cli):
    events = tmp_path / "events.jsonl"
    assert run_cli("--ticks", "40", "--budget", "48", "--repairer", "self", "--no-tui", "--events", str(events), "--prompt", PROMPT) == 0
    header, *records = [json.loads(line) for line in events.read_text().splitlines()]
    assert header["record"] == "header" and header["schema"] == 1 and header["tick"] == 0
    assert header["model"] == "smollm2" and header["config"]["budget"] == 48 and header["resumed"] is False
    assert [r["tick"] for r in records] == list(range(1, 41)) and {r["record"] for r in records} == {"tick"}
    assert {"token_id", "text", "actions", "live_length", "seconds", "removed"} <= set(records[0])
    assert any(a["action"] == "replace_pair" for r in records for a in r["actions"])
    for r in records:  # every row an edit takes out is named, with its text, as it was before the tick
        rows = sorted(row for a in r["actions"] for row in ((a["position"],) if a["action"] == "delete" else
                      (a["original_pos1"], a["original_pos2"]) if a["action"] == "replace_pair" else ()))
        assert len(r["removed"]) == len(rows) and all(set(x) == {"ledger_id", "text"} for x in r["removed"])
    assert any(x["text"] for r in records for x in r["removed"])
    out = capsys.readouterr().out
    assert "lighthouse keeper" in out and "--- summary ---" in out and "repairs" in out


@pytest.mark.smollm2
def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path, capsys, run_cli):
    common = ["--temperature", "0", "--budget", "48", "--repairer", "self", "--no-tui", "--save-every", "30"]
    assert run_cli("--ticks", "60", "--session", str(tmp_path / "straight"), "--prompt", PROMPT, *common) == 0
    assert run_cli("--ticks", "30", "--session", str(tmp_path / "split"), "--prompt", PROMPT, *common) == 0
    # a prompt starts a run: with --resume it would be ignored, so it is refused
    assert run_cli("--ticks", "30", "--session", str(tmp_path / "split"), "--resume", "--prompt", PROMPT, *common) == 2
    assert "--prompt/--prompt-file start a run" in capsys.readouterr().err
    assert run_cli("--ticks", "30", "--session", str(tmp_path / "split"), "--resume", *common) == 0
    straight, meta_a = mirror_pkg.load(tmp_path / "straight" / "mirror.msgpack")
    split, meta_b = mirror_pkg.load(tmp_path / "split" / "mirror.msgpack")
    assert meta_a["tick"] == meta_b["tick"] == 60
    assert straight.live_token_ids() == split.live_token_ids()
    assert straight.positions() == split.positions()
    assert straight.ledger.entries == split.ledger.entries
    assert split.ledger.count("replaced") > 0, "the run must have repaired something"


def test_resume_refuses_a_session_of_another_model(tmp_path, smol, tiny):
    brain = Brain.start(tiny, [1, 2, 3, 4, 5], BrainConfig(budget=48))
    brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    with pytest.raises(sessions.SessionError, match="saved with model 'random:tiny', not 'smollm2'"):
        sessions.resume(smol, tmp_path)
    with pytest.raises(sessions.SessionError, match="no saved session"):
        sessions.resume(tiny, tmp_path / "empty")


@pytest.mark.parametrize("args, message", [
    (["--brightness", "glow"], "unknown brightness rule 'glow'"),
    (["--budget", "10"], "budget 10 leaves no room to cull"),
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--temperature", "-1"], "Invalid value for .--temperature."),
    (["--ticks", "0"], "--ticks must be at least 1, or -1 for no limit"),
    # click words the bound its own way ("x>=-1" in the GPU machines' older click): the flag and -1 named
    (["--ticks", "-2"], "Invalid value for .-n. / .--ticks. / .--n-predict.: .*(greater than or equal to -1|-2 is not in the range x>=-1)"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file"),
    (["--resume"], "--resume needs --session"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--repairer", "mlm:/nonexistent"], "masked LM directory '/nonexistent' does not exist"),
    (["--repairer", "oracle"], "unknown repairer 'oracle'"),
    (["--repairer", "self", "--repair-tokens", "2"], "the self repairer proposes exactly 1 token per pair, not 2"),
    (["--repairer", "self", "--unit", "1"], "the self repairer replaces pairs: it needs unit 2"),
    (["--repair-tokens", "17"], "--repair-tokens must be in 1..16"),
    (["--dtype", "float7"], "float7"),
    (["--no-such-flag"], "no-such-flag"),
    (["--store", "dynamic"], "store"),  # v1's KV store backends are gone, and so is the flag
])
def test_bad_flags_give_one_line_and_exit_code_2(args, message, capsys, run_cli):
    code = run_cli("--ticks", "3", "--no-tui", *args) if "--ticks" not in args else run_cli("--no-tui", *args)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


# --- fidelity -------------------------------------------------------------------------------


def test_divergence_measures_what_splicing_costs(tiny):
    sm = StateManager.from_tokens(tiny, [1] + list(range(40, 80)))
    assert sm.divergence() < 1e-9, "a freshly built cache equals itself"
    sm.apply([{"action": "replace_pair", "original_pos1": 10, "original_pos2": 11, "new_token_ids": [300]},
              {"action": "add", "token_id": 5}])
    spliced = sm.divergence()
    assert spliced > 1e-6, "later rows still carry the replaced tokens' trace"
    before = sm.live_token_ids(), sm.positions()
    sm.rebuild()
    assert (sm.live_token_ids(), sm.positions()) == before
    assert sm.divergence() < 1e-9


def test_refresh_kl_rebuilds_only_above_the_threshold(tiny):
    ids = [1] + list(range(40, 70))
    eager = Brain.start(tiny, ids, BrainConfig(budget=40, refresh_kl=1e-12))
    lazy = Brain.start(tiny, ids, BrainConfig(budget=40, refresh_kl=1e9))
    for _ in range(100):
        eager.step()
        lazy.step()
    assert eager.counts["refreshes"] == 2 and eager.last_divergence > 1e-12
    assert lazy.counts["refreshes"] == 0 and lazy.last_divergence is not None


# --- the tick: forced tokens, failed ticks, the rule's settings ------------------------------


def test_a_forced_step_adds_exactly_the_forced_token(tiny):
    """brain.step(force=t) adds t and nothing else, draws nothing from the sampler, and still
    runs the policy: at the budget the same tick repairs or culls."""
    brain = Brain.start(tiny, [1] + list(range(40, 80)), BrainConfig(budget=40, seed=5, repair_batch=1, repairer="self"))
    sampler = brain.generator_state().clone()
    forced = [tiny.eos_id, 300, 7, 300, 511, 3 + ord("x")]  # tokens a sampler would hardly pick
    edited = 0
    for token_id in forced:
        before = brain.state.live_token_ids()
        at_budget = len(before) >= brain.config.budget
        record = brain.step(force=token_id)
        assert not record.rebuilt, record.error
        assert record.token_id == token_id
        assert [a for a in record.actions if a["action"] == "add"] == [{"action": "add", "token_id": token_id}]
        assert record.actions[-1] == {"action": "add", "token_id": token_id}
        live = brain.state.live_token_ids()
        assert live[-1] == token_id
        edits = [a for a in record.actions if a["action"] != "add"]
        assert bool(edits) == at_budget, "at the budget the tick edits as well as adding, below it only adds"
        edited += bool(edits)
        removed = sum(2 - len(a["new_token_ids"]) if a["action"] == "replace_pair" else 1 for a in edits)
        assert len(live) == len(before) + 1 - removed
        entry = brain.state.mirror.ledger[brain.state.mirror.live.ledger_ids[-1]]
        assert (entry.token_id, entry.source, entry.tick_born) == (token_id, "generated", brain.tick)
        assert record.text == tiny.decode([token_id])
    assert edited >= len(forced) // 2
    assert torch.equal(brain.generator_state(), sampler), "forcing draws nothing from the sampler"
    brain.state.check(deep=True)


def test_teacher_forcing_a_runs_own_tokens_reproduces_the_run(tiny):
    """The forced path is the sampled path with the token given: forcing the tokens a run
    sampled gives the same actions and the same mirror."""
    config = dict(budget=48, seed=2, temperature=1.0, repairer="self")
    free = Brain.start(tiny, [1] + list(range(40, 75)), BrainConfig(**config))
    forced = Brain.start(tiny, [1] + list(range(40, 75)), BrainConfig(**config))
    for _ in range(30):
        a = free.step()
        b = forced.step(force=a.token_id)
        assert (b.token_id, b.actions, b.outcomes, b.text) == (a.token_id, a.actions, a.outcomes, a.text)
    assert free.counts["repairs"] > 0
    assert mirror_pkg.to_bytes(forced.state.mirror) == mirror_pkg.to_bytes(free.state.mirror)


def test_a_failed_tick_changes_nothing_and_shows_no_text(tiny):
    brain = Brain.start(tiny, [1] + list(range(40, 90)), BrainConfig(budget=48, seed=4, repairer="self"))
    # forced tokens: the text of the tick after the fault must not hang on a sampled token's bytes
    brain.step(force=60)
    while len(brain.state) < 48:  # the next tick is at the budget: it edits
        brain.step(force=60)
    before = mirror_pkg.to_bytes(brain.state.mirror), dict(brain.counts)
    brain.state.inject_fault("forward")
    record = brain.step(force=300)
    assert record.rebuilt and "InjectedFault" in record.error and record.text == ""
    assert any(a["action"] == "replace_pair" for a in record.actions), "the tick would have repaired"
    assert mirror_pkg.to_bytes(brain.state.mirror) == before[0], "not the add, the repair nor the brightness"
    assert brain.counts == {**before[1], "rebuilds": before[1]["rebuilds"] + 1}
    brain.state.check(deep=True)
    record = brain.step(force=300)  # the next tick goes through
    assert not record.rebuilt and record.text == tiny.decode([300])
    assert brain.state.live_token_ids()[-1] == 300


def test_the_vote_rule_gets_the_runs_sinks_through_the_policy(tiny, crafted_view):
    """Step 2b with the vote rule: the threshold is the mean score of the non-sink rows, so the
    policy must hand the rule the run's `sinks`. Rows 10 and 11 are above the non-sink mean
    (1/32) but below the mean of all rows (1/20). Dyadic scores keep the arithmetic exact."""
    n = 20
    scores = [0.125] * 4 + [1 / 32] * 16
    scores[10] = scores[11] = 1.5 / 32
    scores[12] = scores[13] = 0.5 / 32
    assert sum(scores) == 1.0
    start = [5000.0] * n
    view = crafted_view(list(range(10, 10 + n)), [50] * n, start)
    plans = {}
    for sinks in (0, 4):
        config = BrainConfig(brightness="vote", sinks=sinks, budget=100)
        plans[sinks] = make_policy("brightness", tiny, config).plan(view, scores, {})
        assert plans[sinks].brightness == steps.update_vote(start, scores, sinks=sinks)
    with_sinks, without = plans[4].brightness, plans[0].brightness
    assert with_sinks[10:12] == [5001.0, 5001.0] and without[10:12] == [4999.0, 4999.0]
    assert with_sinks[:4] == [5004.0] * 4 and without[:4] == [5002.0] * 4
    assert with_sinks[4:10] == without[4:10] == [4999.0] * 6, "rows at the threshold lose 1 either way"


def test_a_vote_run_with_sinks_differs_from_one_without(smol):
    """End to end on the real model, whose first row soaks up attention: the same greedy run
    with --sinks 4 and --sinks 0 stores the vote rule's result for its own sink count."""
    prompt = [smol.bos_id] + smol.encode(PROMPT)
    runs = {}
    for sinks in (0, 4):
        brain = Brain.start(smol, prompt, BrainConfig(brightness="vote", sinks=sinks, budget=200, temperature=0))
        for _ in range(3):
            previous = brain.state.mirror.brightness()
            scores = steps.scores(brain.state.last_attention, "all")
            brain.step()
            assert brain.state.mirror.brightness() == steps.update_vote(previous, scores, sinks=sinks) + [10000.0]
        runs[sinks] = brain
    assert runs[0].state.live_token_ids() == runs[4].state.live_token_ids()
    assert runs[0].state.mirror.brightness() != runs[4].state.mirror.brightness()


def test_a_repair_batch_edits_one_tick_in_batch_and_keeps_live_between_budget_minus_batch_and_budget(tiny):
    """repair_batch=B: when the budget is reached the brightness policy frees B rows at once
    (with the self repairer each pair frees one: B pairs), then the next B-1 ticks only add;
    the live length never leaves [budget - B + 1, budget]."""
    budget, batch = 60, 6
    brain = Brain.start(tiny, [1] + list(range(40, 40 + budget - 1)), BrainConfig(budget=budget, repair_batch=batch,
                                                                                  repairer="self", temperature=0))
    edit_ticks, lengths = [], []
    for _ in range(4 * batch):
        record = brain.step()
        assert not record.rebuilt, record.error
        pairs = [a for a in record.actions if a["action"] == "replace_pair"]
        if pairs:
            edit_ticks.append(record.tick)
            assert len(pairs) == batch
        lengths.append(record.live_length)
    assert edit_ticks == [1, 1 + batch, 1 + 2 * batch, 1 + 3 * batch]
    assert min(lengths) == budget - batch + 1 and max(lengths) == budget


def test_ctrl_c_in_the_middle_of_a_tick_leaves_no_half_tick(tiny):
    """A KeyboardInterrupt half-way through the tick's forward: the state is the one from
    before the tick (rebuilt, consistent), the tick count and the sampler are unchanged, and
    the next tick goes through as tick N+1."""
    brain = Brain.start(tiny, [1] + list(range(40, 80)), BrainConfig(budget=40, repair_batch=1, seed=2))
    for _ in range(3):
        brain.step()
    ids, sampler = brain.state.live_token_ids(), brain.generator_state().clone()
    layer, fired = tiny.model.model.layers[1], []

    def interrupt(module, args):  # once: the rebuild that follows must go through
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt

    handle = layer.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            brain.step()
    finally:
        handle.remove()
    assert brain.tick == 3 and brain.state.live_token_ids() == ids
    assert torch.equal(brain.generator_state(), sampler), "the interrupted tick's draw is given back"
    brain.state.check(deep=True)
    record = brain.step()
    assert record.tick == 4 and not record.rebuilt and brain.state.live_token_ids()[-1] == record.token_id


def test_ctrl_c_while_starting_exits_130_with_one_line(monkeypatch, capsys):
    from positronic import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.run, "load_model", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "random:tiny", "--no-tui", "--ticks", "2"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.smollm2
def test_a_run_with_no_flags_shows_maintenance_at_work(capsys, run_cli):
    """`make run` / `python run.py` with nothing else: the defaults reach the budget and edit."""
    assert run_cli("--no-tui") == 0
    out = capsys.readouterr().out
    summary = out[out.index("--- summary ---"):]
    culls = int(re.search(r"culls (\d+)", summary).group(1))
    live, budget = map(int, re.search(r"live (\d+) / budget (\d+)", summary).groups())
    assert culls > 0 and budget == 128 and live <= budget


@pytest.mark.parametrize("flag", ["--events", "--session"])
def test_an_unusable_output_is_refused_before_the_model_loads(tmp_path, capsys, flag, run_cli):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / ("events.jsonl" if flag == "--events" else "session")
    assert run_cli("--model", "no-such-model", "--no-tui", flag, str(target)) == 2
    err = capsys.readouterr().err
    assert f"cannot use {flag}" in err and "no-such-model" not in err, "refused before loading the model"


def test_a_budget_beyond_the_models_positions_is_refused_at_start(capsys, run_cli):
    assert run_cli("--model", "random:tiny", "--budget", "100000", "--no-tui") == 2
    assert "budget 100000 is above random:tiny's 512 positions" in capsys.readouterr().err


def test_starting_over_a_saved_session_without_resume_is_refused(tmp_path, capsys, run_cli):
    common = ["--model", "random:tiny", "--budget", "64", "--ticks", "3", "--no-tui", "--session", str(tmp_path)]
    assert run_cli(*common) == 0
    saved = (tmp_path / "mirror.msgpack").read_bytes()
    assert run_cli(*common) == 2
    assert "already holds a saved run; continue it with --resume, replace it with --overwrite" in capsys.readouterr().err
    assert (tmp_path / "mirror.msgpack").read_bytes() == saved, "the saved run is untouched"
    assert run_cli(*common[:-2], "--session", str(tmp_path), "--resume") == 0
    assert mirror_pkg.load(tmp_path / "mirror.msgpack")[1]["tick"] == 6
    assert run_cli(*common, "--overwrite", "--resume") == 2
    assert "cannot go with --resume" in capsys.readouterr().err
    assert run_cli(*common, "--overwrite", "--seed", "9") == 0
    meta = mirror_pkg.load(tmp_path / "mirror.msgpack")[1]
    assert meta["tick"] == 3 and meta["config"]["seed"] == 9, "a new run replaced the old one"


def test_resuming_with_events_trims_the_ticks_after_the_checkpoint(tmp_path, run_cli):
    """A run killed after its last checkpoint left records the resumed run makes again: they
    (and a torn last line) are dropped, so every tick appears exactly once."""
    events = tmp_path / "events.jsonl"
    common = ["--model", "random:tiny", "--budget", "64", "--no-tui", "--session", str(tmp_path / "s"),
              "--events", str(events)]
    assert run_cli(*common, "--ticks", "20") == 0
    with events.open("a") as log:  # what a killed run had written past the checkpoint (tick 20)
        for tick in (21, 22):
            log.write(json.dumps({"tick": tick, "token_id": 5}) + "\n")
        log.write('{"tick": 23, "tok')
    assert run_cli(*common, "--ticks", "5", "--resume") == 0
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["tick"] for r in records if r.get("record") == "tick"] == list(range(1, 26))
    assert [(r["tick"], r["resumed"]) for r in records if r.get("record") == "header"] == [(0, False), (20, True)]


def test_resume_refuses_flags_that_would_change_the_saved_settings(tmp_path, capsys, run_cli):
    common = ["--model", "random:tiny", "--no-tui", "--session", str(tmp_path), "--ticks", "3"]
    assert run_cli(*common, "--budget", "64", "--policy", "h2o") == 0
    assert run_cli(*common, "--resume", "--budget", "80", "--kv-eviction", "1") == 2
    err = capsys.readouterr().err
    assert "--budget 80 (saved: 64)" in err and "--policy streaming (saved: h2o)" in err
    assert run_cli(*common, "--resume", "--budget", "64") == 0, "the same value is fine"


# --- input while it runs: typed lines become user turns, one token per tick ----------------


def ledger_runs(brain) -> list[tuple[str, list[int]]]:
    """The ledger as runs of (source, token ids) in the order the tokens came."""
    runs = []
    for entry in brain.state.mirror.ledger.entries:
        if runs and runs[-1][0] == entry.source:
            runs[-1][1].append(entry.token_id)
        else:
            runs.append((entry.source, [entry.token_id]))
    return runs


def test_a_typed_line_is_read_as_a_user_turn_and_the_agent_answers_it(smol):
    """The real model: the turn's tokens enter the ledger with source "user", in order, one per
    tick and without a draw from the sampler; then the model generates again."""
    brain = Brain.start(smol, [smol.bos_id] + smol.encode(PROMPT), BrainConfig(budget=128, seed=1))
    for _ in range(5):
        brain.step()
    turn = brain.say("What is the capital of France?")
    assert turn == smol.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert brain.pending_input == tuple(turn)
    sampler = brain.generator_state().clone()
    records = [brain.step() for _ in range(len(turn))]
    assert [(r.source, r.token_id) for r in records] == [("user", t) for t in turn]
    assert torch.equal(brain.generator_state(), sampler), "fed tokens draw nothing from the sampler"
    assert brain.pending_input == ()
    answer = [brain.step() for _ in range(12)]
    assert all(r.source == "generated" for r in answer)
    assert [s for s, _ in ledger_runs(brain)] == ["prompt", "generated", "user", "generated"]
    assert ledger_runs(brain)[2][1] == turn
    assert answer[0].to_json()["source"] == "generated" and records[0].to_json()["source"] == "user"
    assert smol.decode([r.token_id for r in answer]).strip(), "the agent goes on: it answers"
    brain.state.check(deep=True)


def test_the_budget_holds_while_input_is_fed(tiny):
    config = BrainConfig(budget=48, window=8, seed=3, repair_batch=1)
    brain = Brain.start(tiny, [1] + list(range(40, 70)), config)
    said = []
    for tick in range(200):
        if tick % 40 == 0:  # a turn takes at most 32 ticks: the agent writes between turns
            said.append(brain.say(f"line {tick} " + "x" * (tick % 7)))
        record = brain.step()
        assert record.live_length <= 48 and len(brain.state) <= 48
        assert not record.rebuilt, record.error
    brain.state.check(deep=True)
    typed = [ids for source, ids in ledger_runs(brain) if source == "user"]
    assert typed == said, "every turn whole, in order, between generated text"
    assert brain.counts["culls"] > 0, "the policy culled while the input came in"


def test_a_forced_tick_leaves_typed_input_queued_and_a_failed_or_interrupted_tick_keeps_its_token(tiny):
    brain = Brain.start(tiny, [1] + list(range(40, 60)), BrainConfig(budget=48, window=8, seed=2))
    turn = brain.say("hi")
    record = brain.step(force=300)  # teacher forcing wins: the typed input waits
    assert (record.token_id, record.source) == (300, "generated") and brain.pending_input == tuple(turn)
    brain.state.inject_fault("forward")
    record = brain.step()
    assert record.rebuilt and brain.pending_input == tuple(turn), "a tick that failed added nothing"

    class CtrlC:
        def before_apply(self, brain, actions, brightness=None):
            raise KeyboardInterrupt

        def after_apply(self, brain, actions, report):
            pass

    brain.observers.append(CtrlC())
    with pytest.raises(KeyboardInterrupt):
        brain.step()
    brain.observers.clear()
    assert brain.pending_input == tuple(turn), "nor did an interrupted one"
    assert [brain.step().token_id for _ in turn] == turn


def test_a_line_too_long_for_the_budget_is_refused_and_nothing_is_queued(tiny):
    from positronic.brain.chat import TurnRefused

    brain = Brain.start(tiny, [1] + list(range(40, 60)), BrainConfig(budget=48, window=8))
    assert brain.say("   ") == [] and brain.pending_input == ()
    with pytest.raises(TurnRefused, match="more than the 36 a turn may take"):  # 48 - 4 sinks - 8 window
        brain.say("y" * 19)  # 18 frame characters + 19
    assert brain.pending_input == ()
    assert len(brain.say("y" * 18)) == 36


@pytest.mark.long
def test_lines_on_stdin_of_a_no_tui_run_reach_the_ledger(tiny, tmp_path):
    """`python run.py --model random:tiny --no-tui --ticks 60` with input on a pipe: each line
    is fed as a user turn (a blank one is ignored, one too long refused on stderr) and the
    run goes on; --no-input reads nothing."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]

    def run(directory, *flags, stdin=b"hello\n\n" + b"z" * 200 + b"\nbye"):  # 24 + 22 typed tokens
        args = [sys.executable, "run.py", "--model", "random:tiny", "--no-tui", "--ticks", "60", "--session",
                str(tmp_path / directory), *flags]
        done = subprocess.run(args, cwd=root, input=stdin, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()
        return ledger_runs(sessions.resume(tiny, tmp_path / directory)), done.stderr.decode()

    runs, err = run("piped")
    assert [(s, tiny.decode(ids)) for s, ids in runs if s == "user"] == [
        ("user", "\nUser: hello\nAssistant:\nUser: bye\nAssistant:")], "both lines, in order, whole"
    assert runs[-1][0] == "generated", "the agent generates after the input"
    assert "input refused: the line is 218 tokens as a user turn, more than the 92" in err
    runs, err = run("ignored", "--no-input")
    assert {s for s, _ in runs} == {"prompt", "generated"} and "refused" not in err

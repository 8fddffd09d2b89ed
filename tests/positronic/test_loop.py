"""The tick loop end to end on the real embedded model, sessions, and the repairers."""

import json
import re

import pytest
import torch

import mirror as mirror_pkg
from positronic import session as sessions
from positronic.cli import main
from positronic.loop import Brain, BrainConfig
from positronic.repairers import MaskedLMRepairer, RepairerError, SelfRepairer, make_repairer
from positronic.state_manager import StateManager
from test_state_manager import fresh_logits

PROMPT = "The old lighthouse keeper climbed the spiral stairs every night, counting each step"


def run_cli(*args) -> int:
    """The exit code `positronic ARGS` would have."""
    try:
        main(list(args))
    except SystemExit as exc:
        return exc.code or 0
    return 0


def test_300_ticks_at_budget_128_stay_consistent_and_bounded(smol):
    config = BrainConfig(budget=128, seed=3)
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


def test_events_file_has_one_parsable_record_per_tick(tmp_path, capsys):
    events = tmp_path / "events.jsonl"
    assert run_cli("--ticks", "40", "--budget", "40", "--no-tui", "--events", str(events), "--prompt", PROMPT) == 0
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["tick"] for r in records] == list(range(1, 41))
    assert {"token_id", "text", "actions", "live_length", "seconds"} <= set(records[0])
    assert any(a["action"] == "replace_pair" for r in records for a in r["actions"])
    out = capsys.readouterr().out
    assert "lighthouse keeper" in out and "--- summary ---" in out and "repairs" in out


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path, capsys):
    common = ["--temperature", "0", "--budget", "48", "--no-tui", "--prompt", PROMPT, "--save-every", "50"]
    assert run_cli("--ticks", "100", "--session", str(tmp_path / "straight"), *common) == 0
    assert run_cli("--ticks", "50", "--session", str(tmp_path / "split"), *common) == 0
    assert run_cli("--ticks", "50", "--session", str(tmp_path / "split"), "--resume", *common) == 0
    straight, meta_a = mirror_pkg.load(tmp_path / "straight" / "mirror.msgpack")
    split, meta_b = mirror_pkg.load(tmp_path / "split" / "mirror.msgpack")
    assert meta_a["tick"] == meta_b["tick"] == 100
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
    (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--temperature", "-1"], "Invalid value for .--temperature."),
    (["--ticks", "0"], "Invalid value for .--ticks."),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file"),
    (["--resume"], "--resume needs --session"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--repairer", "mlm:/nonexistent"], "masked LM directory '/nonexistent' does not exist"),
    (["--repairer", "oracle"], "unknown repairer 'oracle'"),
    (["--dtype", "float7"], "float7"),
    (["--no-such-flag"], "no-such-flag"),
])
def test_bad_flags_give_one_line_and_exit_code_2(args, message, capsys):
    code = run_cli("--ticks", "3", "--no-tui", *args) if "--ticks" not in args else run_cli("--no-tui", *args)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


# --- repairers ------------------------------------------------------------------------------


def test_self_repairer_proposes_the_models_greedy_token_for_the_slot(smol):
    sm = StateManager.from_tokens(smol, [smol.bos_id] + smol.encode(PROMPT))
    sm.apply([{"action": "delete", "position": 3}])  # positions now have a gap
    sm.rebuild()  # drop the deleted token's trace from deeper layers, so a fresh forward is comparable
    live, positions = sm.live_token_ids(), sm.positions()
    proposal = SelfRepairer(sm, tokens=2).propose(live, (8, 9))
    # independently: plain forwards over the left context at the recorded positions
    first = int(fresh_logits(smol, live[:8], positions[:8])[-1].argmax())
    second = int(fresh_logits(smol, live[:8] + [first], positions[:8] + [positions[7] + 1])[-1].argmax())
    assert proposal == [first, second]


def test_masked_lm_repairer_fills_the_slot_through_text(tmp_path, smol):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "keeper", "climbed", "stairs", "night", "lamp"]
    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(words)})
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64))
    with torch.no_grad():  # make "lamp" the masked LM's favourite word
        model.cls.predictions.bias.zero_()
        model.cls.predictions.bias[words.index("lamp")] = 50.0
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    sm = StateManager.from_tokens(smol, [smol.bos_id] + smol.encode(PROMPT))
    repairer = make_repairer(f"mlm:{tmp_path}", sm)
    assert isinstance(repairer, MaskedLMRepairer)
    live = sm.live_token_ids()
    proposal = repairer.propose(live, (4, 5))
    assert smol.decode(proposal) == " lamp", "the text crosses vocabularies as a span, leading space kept"


def test_cull_only_brain_deletes_dim_pairs_and_stays_within_budget(tiny):
    brain = Brain.start(tiny, [1] + list(range(40, 70)), BrainConfig(budget=40, repairer="none"))
    lengths, outcomes = [], set()
    for _ in range(60):
        record = brain.step()
        lengths.append(record.live_length)
        outcomes |= {outcome for _, outcome in record.outcomes}
        assert all(a["action"] != "replace_pair" for a in record.actions), "cull only: nothing is replaced"
    assert brain.counts["repairs"] == 0 and brain.counts["culls"] > 0
    assert outcomes <= {"left", "deleted"} and "deleted" in outcomes
    assert max(lengths[20:]) <= 41, "budget + cull rate"
    brain.state.check(deep=True)


def test_unknown_repairer_is_refused(tiny):
    sm = StateManager.from_tokens(tiny, [1, 2, 3])
    with pytest.raises(RepairerError, match="unknown repairer"):
        make_repairer("oracle", sm)


# --- fidelity -------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["dynamic", "preallocated"])
def test_divergence_measures_what_splicing_costs(tiny, store):
    sm = StateManager.from_tokens(tiny, [1] + list(range(40, 80)), store=store)
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

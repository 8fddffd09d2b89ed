"""Repairers (positronic/policies/repairers.py): self (the model's prediction for the slot, no forward),
bridge (probed candidates against the cull), mlm:PATH (a masked LM through text), none, and the
specifications they refuse."""

from types import SimpleNamespace

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.policies.repairers import (BridgeRepairer, MaskedLMRepairer, NoRepairer, RepairerError, SelfRepairer,
                                  make_repairer)
from positronic.state.manager import StateManager

PROMPT = "The old lighthouse keeper climbed the spiral stairs every night, counting each step"


def test_self_repairer_proposes_the_models_greedy_token_for_the_slot(smol, fresh_logits):
    sm = StateManager.from_tokens(smol, [smol.bos_id] + smol.encode(PROMPT))
    sm.apply([{"action": "delete", "position": 3}])  # positions now have a gap
    sm.rebuild()  # drop the deleted token's trace from deeper layers, so a fresh forward is comparable
    live, positions = sm.live_token_ids(), sm.positions()
    view = sm.view()
    repairer = SelfRepairer(smol)
    for pair in [(8, 9), (12, 13)]:
        p1 = pair[0]
        # independently: a plain forward over the left context at the recorded positions
        expected = int(fresh_logits(smol, live[:p1], positions[:p1])[-1].argmax())
        assert expected not in (smol.bos_id, smol.eos_id)
        assert repairer.propose(view, pair) == [expected] == [int(view.predicted[p1 - 1])]


def test_self_repairer_reads_the_views_prediction_and_refuses_bos_and_eos(crafted_view):
    """The proposal for pair (p1, p2) is view.predicted[p1 - 1], one token, no forward: the
    repairer needs nothing of the model but its BOS and EOS ids."""
    lm = SimpleNamespace(bos_id=1, eos_id=2)  # no model at all: a forward would fail
    repairer = SelfRepairer(lm)
    token_ids = [1, 10, 11, 12, 13, 14, 15, 16]
    predicted = [100, 101, 102, 103, 104, 105, 106, 107]
    view = crafted_view(token_ids, predicted)
    assert repairer.propose(view, (5, 6)) == [104]
    assert repairer.propose(view, (1, 2)) == [100]
    assert repairer.propose(view, (3, 5)) == [102], "only the row left of the pair counts"
    assert repairer.propose(view, (0, 1)) == [], "no row left of the pair: no prediction"
    for refused in (1, 2):
        predicted_here = list(predicted)
        predicted_here[4] = refused
        assert repairer.propose(crafted_view(token_ids, predicted_here), (5, 6)) == [], refused
    assert SelfRepairer(SimpleNamespace(bos_id=1, eos_id=None)).propose(
        crafted_view(token_ids, [2] * 8), (5, 6)) == [2], "without an EOS id only BOS is refused"


def test_self_repairer_proposes_exactly_one_token(tiny):
    for tokens in (0, 2, 3):
        with pytest.raises(RepairerError, match="exactly 1 token"):
            SelfRepairer(tiny, tokens=tokens)
        with pytest.raises(RepairerError, match="exactly 1 token"):
            make_repairer("self", tiny, tokens=tokens)
    with pytest.raises(ValueError, match="self repairer proposes exactly 1 token per pair, not 2"):
        BrainConfig(repairer="self", repair_tokens=2).validate()
    with pytest.raises(ValueError, match="exactly 1 token"):
        Brain.start(tiny, [1, 2, 3], BrainConfig(budget=48, repairer="self", repair_tokens=2))
    BrainConfig(repairer="none", repair_tokens=2).validate()  # only the self repairer is limited
    assert isinstance(make_repairer("none", tiny, tokens=2), NoRepairer)


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
    repairer = make_repairer(f"mlm:{tmp_path}", smol)
    assert isinstance(repairer, MaskedLMRepairer)
    proposal = repairer.propose(sm.view(), (4, 5))
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
    assert outcomes == {"culled"}
    assert max(lengths[20:]) <= 41, "budget + cull rate"
    brain.state.check(deep=True)


def test_unknown_repairer_is_refused(tiny):
    with pytest.raises(RepairerError, match="unknown repairer"):
        make_repairer("oracle", tiny)


def test_bridge_repairs_a_probed_pair_only_when_its_best_candidate_beats_culling(tiny):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)),
                        BrainConfig(budget=48, window=8, repairer="bridge", seed=1, temperature=0))
    repairer = brain.policy.repairer
    repaired = culled = 0
    for _ in range(80):
        view, scores = brain.state.view(), dict(repairer.scores)
        record = brain.step()
        assert record.live_length <= 48 and not record.rebuilt
        for unit, outcome in record.outcomes:
            key = tuple(int(view.ledger_ids[row]) for row in (unit[0], unit[-1], unit[-1] + 1)) if unit else None
            if key not in scores:
                assert outcome != "replaced", "only probed pairs are repaired"
                continue
            cull = scores[key].pop(repairer.CULL)
            # the pair's own tokens, plus the model's prediction for the slot when it was probed
            assert {int(view.token_ids[unit[0]]), int(view.token_ids[unit[1]])} <= set(scores[key])
            best = max(scores[key], key=scores[key].get)
            if outcome == "replaced":
                action = next(a for a in record.actions if a.get("original_pos1") == unit[0])
                assert action["new_token_ids"] == [best] and scores[key][best] >= cull
                repaired += 1
            elif scores[key][best] < cull:
                culled += 1
    assert repaired > 0 and culled > 0, (repaired, culled)
    brain.state.check(deep=True)


def test_bridge_probes_each_candidate_and_the_cull_and_proposes_only_what_beats_the_cull_by_the_margin(crafted_view):
    lm = SimpleNamespace(bos_id=1, eos_id=2)
    view = crafted_view([1, 10, 11, 12, 13, 14], [20, 2, 22, 23, 24, 25])  # the slot's prediction is EOS
    repairer = BridgeRepairer(lm, margin=0.5)
    probes, asked = repairer.request(view, [(2, 3), (0, 1), (4, 5)])  # (0, 1): no left row; (4, 5): no right neighbour
    assert (probes.token_ids, probes.positions, probes.targets) == ((11, 12, 10), (2, 2, 1), (13, 13, 13)), \
        "the pair's own tokens at the pair's position (EOS refused), then the left row in its place (the cull)"
    assert repairer.scores == {}, "asking changes nothing: the answers come with the tick that ran the probes"
    repairer.adopt(asked, [-3.0, -1.0, -1.6])
    assert repairer.propose(view, (2, 3)) == [12], "-1.0 beats the cull's -1.6 by more than 0.5"
    assert repairer.propose(view, (4, 5)) == [] and repairer.propose(view, (1, 2)) == [], "no scores: cull"
    saved = repairer.state()
    again = BridgeRepairer(lm, margin=0.7)
    again.load_state(saved)
    assert again.scores == repairer.scores and again.propose(view, (2, 3)) == [], "-1.0 is not 0.7 above -1.6"
    repairer.adopt(asked, None)  # a tick that ran no probes scored nothing and forgets nothing
    assert repairer.propose(view, (2, 3)) == [12]
    moved = crafted_view([1, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25])
    moved.ledger_ids[4] = 9  # the right neighbour is another token now: the scores do not apply
    assert repairer.propose(moved, (2, 3)) == []
    for bad in ({"scores": [[1, 2, 3, 4]]}, {"scores": [[1, 2, 3, 4, "x"]]}, {"other": []}, []):
        with pytest.raises(ValueError, match="malformed saved state"):
            again.load_state(bad)


def test_repairer_specifications_are_checked_before_any_model_loads(tmp_path):
    with pytest.raises(RepairerError, match="masked LM directory .* does not exist"):
        make_repairer(f"mlm:{tmp_path / 'missing'}", None)
    with pytest.raises(RepairerError, match="cannot load a masked LM from"):
        make_repairer(f"mlm:{tmp_path}", SimpleNamespace(bos_id=1, eos_id=2))  # a directory with no model
    assert isinstance(make_repairer("bridge", SimpleNamespace(bos_id=1, eos_id=None)), BridgeRepairer)
    with pytest.raises(RepairerError, match="exactly 1 token per pair, not 2"):
        make_repairer("bridge", SimpleNamespace(bos_id=1, eos_id=None), tokens=2)

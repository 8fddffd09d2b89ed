"""knorm (presses/knorm.py): the rows whose keys have the largest mean L2 norm go first, read once
a row; `mix` blends in the attention share; a policy of its own through policies/pressed.py."""

from dataclasses import replace

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.presses import KeyNormPress, KeyNormSettings, Rows
from positronic.state.manager import StateManager


def mean_key_norms(lm, ids: list[int]) -> torch.Tensor:
    """[rows] float64: each row's keys' L2 norm averaged over layers and kv heads, from a prefill."""
    state = StateManager.from_tokens(lm, ids)
    keys = torch.stack([state.layer_kv(layer)[0][0] for layer in range(lm.num_layers)])  # [layers, kv, rows, d]
    return keys.double().norm(dim=-1).mean(dim=(0, 1))


def test_a_pruned_prompt_loses_its_largest_norm_keys_first(tiny):
    prompt = [tiny.bos_id] + [(13 * i) % 400 + 5 for i in range(99)]
    brain = Brain.start(tiny, prompt, BrainConfig(policy="knorm", budget=48, temperature=0))
    norms = mean_key_norms(tiny, prompt[:-1])  # the rows the prune chose among
    window = max(32, 48 // 4)  # the pruned context's recent window
    selectable = list(range(4, 99 - window))
    need = 99 - 47
    expected = sorted(sorted(selectable, key=lambda row: -float(norms[row]))[:need])
    culled = sorted(i for i, e in enumerate(brain.state.mirror.ledger.entries) if e.state == "culled")
    assert culled == expected
    assert len(brain.state) == 48


def test_each_row_is_read_once_and_mix_weighs_in_the_shares(tiny):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(policy="knorm", budget=48))
    press, reads = brain.policy.press, []
    score = press.score

    def counted(rows, state, clock):
        def read(members, index):
            reads.append(len(index))
            return rows.read(members, index)
        return score(replace(rows, read=read), state, clock)
    press.score = counted
    for _ in range(30):
        brain.step()
    assert reads == [31] + [1] * 29, "the prompt's rows on the first tick, then each new row once"
    shares = torch.tensor([[.1, .2, .3, .1, .2, .1]])
    rows = Rows(length=torch.tensor([6]), positions=torch.arange(6)[None], shares=shares,
                pinned=torch.zeros(1, 6, dtype=torch.bool))
    norm = {"norm": torch.tensor([[1.0, 2.0, 3.0, 2.0, 1.0, 3.0]], dtype=torch.float64)}
    for mix in (0.0, 0.5, 1.0):
        values, _ = KeyNormPress(KeyNormSettings(budget=48, mix=mix)).score(rows, norm, torch.tensor([0]))
        want = (1 - mix) * -norm["norm"] / 2.0 + mix * shares.double() * 6
        assert torch.allclose(values, want if mix else -norm["norm"]), mix
    with pytest.raises(ValueError, match=r"mix must be a number in \[0, 1\]"):
        KeyNormSettings(budget=48, mix=1.5)

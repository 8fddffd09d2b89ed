"""Rounds: sequences' works as greenlets of one thread, pausing at their forwards, which run
as one. What Batch relies on beyond batched = alone (test_batch.py): prompts prefilled chunk
by chunk beside ticking sequences, one work's failure kept to it, torch's grad mode and the
caller's context variables as a plain call would leave them, and clear refusals."""

import contextvars

import pytest
import torch

from positronic.batch import Rounds
from positronic.models import load_model
from positronic.brain.loop import Brain, BrainConfig
from positronic.state.forward import MEETING, forward

from .test_batch import PROMPTS

CALLER = contextvars.ContextVar("caller", default=None)


def test_a_prompt_goes_in_chunk_by_chunk_while_the_others_tick_and_all_is_as_alone(tiny):
    """One work starts a 200-token prompt (4 chunks of 64 tokens) while two brains tick 4 times
    each: the ticks ride in the prompt's rounds, and every brain's tokens, then the new one's next
5, are those alone."""
    long_prompt = [1] + [3 + (7 * k) % 400 for k in range(199)]
    config = dict(budget=48, seed=4, temperature=0)
    solo = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt in PROMPTS[:2]]
    want = [[brain.step().token_id for _ in range(4)] for brain in solo]
    started = Brain.start(tiny, long_prompt, BrainConfig(**config))
    want_next = [started.step().token_id for _ in range(5)]

    rounds = Rounds()
    brains = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt in PROMPTS[:2]]

    def ticks(brain):
        return [brain.step().token_id for _ in range(4)]

    got = rounds.run({"a": lambda: ticks(brains[0]), "b": lambda: ticks(brains[1]),
                      "new": lambda: Brain.start(tiny, long_prompt, BrainConfig(**config))})
    assert [got["a"], got["b"]] == want
    # every forward of the new one (4 chunks, and whatever its start adds) was a round, and the
    # others' 4 ticks each rode in one of them
    assert rounds.forwards >= 4 and rounds.fed == 4 + 4 + rounds.forwards
    assert [got["new"].step().token_id for _ in range(5)] == want_next
    got["new"].state.check(deep=True)


def test_a_works_exception_is_its_outcome_and_the_others_finish(tiny):
    brains = [Brain.start(tiny, prompt, BrainConfig(budget=40, seed=k, temperature=0)) for k, prompt in enumerate(PROMPTS[:2])]
    alone = Brain.start(tiny, PROMPTS[1], BrainConfig(budget=40, seed=1, temperature=0))
    want = [alone.step().token_id for _ in range(3)]

    def fails():
        brains[0].step()
        raise ValueError("this sequence's own failure")

    rounds = Rounds()
    got = rounds.run({"bad": fails, "good": lambda: [brains[1].step().token_id for _ in range(3)]})
    assert isinstance(got["bad"], ValueError) and str(got["bad"]) == "this sequence's own failure"
    assert got["good"] == want
    assert list(got) == ["bad", "good"]


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_and_context_are_the_callers_in_every_work_and_after(tiny, grad):
    """A work that starts while another is paused inside `forward` (grad off there) still
    starts in the caller's grad mode; the caller gets its mode back, sees no MEETING, and its
    context variables reach the works."""
    brains = [Brain.start(tiny, prompt, BrainConfig(budget=40, seed=k, temperature=0)) for k, prompt in enumerate(PROMPTS[:3])]
    seen = []

    def work(brain):
        seen.append((torch.is_grad_enabled(), CALLER.get(), MEETING.get() is rounds))
        brain.step()
        seen.append((torch.is_grad_enabled(), CALLER.get(), MEETING.get() is rounds))

    token = CALLER.set("the caller's")
    rounds = Rounds()
    try:
        with torch.set_grad_enabled(grad):
            got = rounds.run({k: (lambda brain=brain: work(brain)) for k, brain in enumerate(brains)})
            assert torch.is_grad_enabled() is grad
    finally:
        CALLER.reset(token)
    assert all(outcome is None for outcome in got.values())
    assert seen == [(grad, "the caller's", True)] * 6
    assert MEETING.get() is None


def test_a_round_cannot_start_inside_a_work_nor_a_forward_come_from_outside_one(tiny):
    rounds = Rounds()
    got = rounds.run({"nested": lambda: rounds.run({})})
    assert isinstance(got["nested"], RuntimeError) and "already running" in str(got["nested"])
    cache = Brain.start(tiny, PROMPTS[0], BrainConfig(budget=40)).state.cache
    token = MEETING.set(rounds)
    try:
        with pytest.raises(RuntimeError, match="must come from a work"):
            forward(tiny, cache, [5], [31], list(range(32)))
    finally:
        MEETING.reset(token)
    assert rounds.run({}) == {} and rounds.forwards == 0
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="Rounds.call must come from a work"):
        rounds.call(torch.get_num_threads)
    assert torch.get_num_threads() == threads  # the caller's count untouched
    for bad, what in (([lambda: None], "got list$"), ({"a": 3}, "not callable")):
        with pytest.raises(TypeError, match=f"Rounds.run takes a dict of name -> callable.*{what}"):
            rounds.run(bad)
    assert rounds.run({"a": lambda: 7}) == {"a": 7}  # nothing left behind by the refusals


def test_works_on_two_models_share_a_forward_per_model_and_each_gets_its_own(tiny):
    """A round feeds one forward per model (a forward runs one model's weights): two brains of
    each of two models, every brain's tokens as alone, two forwards a round."""
    other = load_model("random:tiny", device="cpu", dtype="float32")
    with torch.no_grad():
        for parameter in other.model.parameters():
            parameter.mul_(1.5)  # other weights: a forward of the wrong model would change the tokens
    config = dict(budget=40, seed=2, temperature=0)
    models = [tiny, tiny, other, other]
    want = []
    for lm, prompt in zip(models, PROMPTS):
        brain = Brain.start(lm, prompt, BrainConfig(**config))
        want.append([brain.step().token_id for _ in range(3)])
    brains = [Brain.start(lm, prompt, BrainConfig(**config)) for lm, prompt in zip(models, PROMPTS)]
    rounds = Rounds()
    got = rounds.run({k: (lambda brain=brain: [brain.step().token_id for _ in range(3)]) for k, brain in enumerate(brains)})
    assert [got[k] for k in range(4)] == want
    assert want[0] != want[2] or want[1] != want[3]  # the two models differ where it shows
    assert rounds.forwards == 2 * 3 and rounds.fed == 4 * 3

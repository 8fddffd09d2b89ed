import math

import pytest
import torch

from positronic.steps.sample import NonFiniteLogits, sample


def draws(logits, n=300, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return [sample(logits, generator=g, **kw).token_id for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1e-3])
def test_greedy_picks_argmax_with_ties_to_lowest_id(temperature):
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert sample(logits, temperature=temperature).token_id == 1


def test_greedy_ignores_generator_state():
    logits = torch.tensor([0.0, 5.0, 4.9])
    assert set(draws(logits, n=50, temperature=0.0)) == {1}


def test_top_is_twenty_sorted_probabilities_after_temperature():
    logits = torch.arange(30, dtype=torch.float32) % 7  # many ties
    s = sample(logits, temperature=0.5, generator=torch.Generator().manual_seed(1))
    expected = torch.softmax(logits / 0.5, dim=-1)
    assert len(s.top) == 20
    ids = [i for i, _ in s.top]
    assert len(set(ids)) == 20
    for (i, p), (j, q) in zip(s.top, s.top[1:]):
        assert p > q or (p == q and i < j)  # descending, ties in id order
    for i, p in s.top:
        assert p == pytest.approx(float(expected[i]), rel=1e-6)
    assert ids[:5] == [6, 13, 20, 27, 5]


def test_top_for_greedy_is_softmax_of_logits():
    logits = torch.tensor([2.0, 1.0, 0.0])
    s = sample(logits, temperature=0.0)
    expected = torch.softmax(logits, dim=-1).tolist()
    assert [i for i, _ in s.top] == [0, 1, 2]
    assert [p for _, p in s.top] == pytest.approx(expected)


def test_small_vocab_top_has_vocab_entries():
    assert len(sample(torch.tensor([0.0, 1.0]), temperature=0.0).top) == 2


def test_float16_logits_are_computed_in_float32():
    # 1000/0.01 overflows float16; computing in half precision would give NaNs.
    logits = torch.tensor([990.0, 1000.0], dtype=torch.float16)
    s = sample(logits, temperature=0.01, generator=torch.Generator().manual_seed(0))
    assert s.token_id == 1
    assert all(math.isfinite(p) for _, p in s.top)
    assert s.top[0] == (1, pytest.approx(1.0))


def test_sampling_follows_distribution_and_temperature():
    logits = torch.log(torch.tensor([0.75, 0.25]))
    at_one = draws(logits, n=2000, temperature=1.0)
    assert 0.72 < at_one.count(0) / 2000 < 0.78
    # T=0.5 squares the probabilities: .5625 / (.5625 + .0625) = 0.9
    at_half = draws(logits, n=2000, temperature=0.5)
    assert 0.88 < at_half.count(0) / 2000 < 0.92


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(100)
    a = draws(logits, n=50, seed=123, temperature=1.0)
    b = draws(logits, n=50, seed=123, temperature=1.0)
    c = draws(logits, n=50, seed=124, temperature=1.0)
    assert a == b
    assert a != c


def test_top_k_keeps_only_k_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    assert set(draws(logits, temperature=1.0, top_k=1)) == {1}
    assert set(draws(logits, temperature=1.0, top_k=2)) == {1, 3}
    assert set(draws(logits, temperature=5.0, top_k=0)) == {0, 1, 2, 3, 4}


PROBS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize(
    "top_p, allowed",
    [(1e-6, {0}), (0.45, {0}), (0.75, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, allowed):
    assert set(draws(PROBS, n=600, temperature=1.0, top_p=top_p)) == allowed


def test_top_p_boundary_is_inclusive():
    # Equal logits give exactly 0.25 each: two tokens already reach 0.5, so a third is not kept
    # (which two of the equal four is transformers' TopPLogitsWarper's sort order)
    assert len(set(draws(torch.zeros(4), n=600, temperature=1.0, top_p=0.5))) == 2


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_top():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps p >= 0.25, min_p 0.25 keeps p >= 0.125
    assert set(draws(PROBS, n=600, temperature=1.0, min_p=0.5)) == {0, 1}
    assert set(draws(PROBS, n=600, temperature=1.0, min_p=0.25)) == {0, 1, 2}
    assert set(draws(PROBS, n=50, temperature=1.0, min_p=1.0)) == {0}  # the most likely always stays


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0])
    # token 0 occurs twice: 2.0 - 0.5 (presence) - 2 * 0.4 (frequency) = 0.7 < 1.0
    s = sample(logits, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4, recent_ids=[0, 0, 2],
               generator=torch.Generator().manual_seed(0))
    expected = torch.softmax(torch.tensor([0.7, 1.0, -0.9, 0.0]), dim=-1)
    assert dict(s.top) == pytest.approx({i: float(p) for i, p in enumerate(expected)})
    assert sample(logits, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4,
                  recent_ids=[0, 0]).token_id == 1
    # a negative penalty favours what occurred: 0.0 + 2.5 = 2.5 > 2.0
    assert sample(logits, temperature=0.0, presence_penalty=-2.5, recent_ids=[3]).token_id == 3


def test_logit_bias_adds_to_the_logits_and_minus_100_bans():
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert sample(logits, temperature=0.0, logit_bias={0: -100.0}).token_id == 1
    assert sample(logits, temperature=0.0, logit_bias={2: 2.5}).token_id == 2
    assert 0 not in set(draws(logits, n=300, temperature=1.5, logit_bias={0: -100.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        sample(logits, logit_bias={3: 1.0})


def test_top_p_applies_to_top_k_survivors():
    # After top_k=2 the survivors are 0.5/0.8 and 0.3/0.8; top_p=0.6 keeps only the first.
    assert set(draws(PROBS, temperature=1.0, top_k=2, top_p=0.6)) == {0}


def test_repetition_penalty_divides_positive_logits():
    logits = torch.tensor([2.0, 1.9, -1.0])
    assert sample(logits, temperature=0.0, repetition_penalty=2.0, recent_ids=[0]).token_id == 1
    assert sample(logits, temperature=0.0, repetition_penalty=1.0, recent_ids=[0]).token_id == 0


def test_repetition_penalty_multiplies_negative_logits_and_shows_in_top():
    logits = torch.tensor([2.0, 1.9, -1.0, -1.1])
    s = sample(logits, temperature=0.5, repetition_penalty=2.0, recent_ids=[0, 2],
               generator=torch.Generator().manual_seed(0))
    expected = torch.softmax(torch.tensor([1.0, 1.9, -2.0, -1.1]) / 0.5, dim=-1)
    assert [i for i, _ in s.top] == [1, 0, 3, 2]
    assert dict(s.top) == pytest.approx({i: float(p) for i, p in enumerate(expected)})


def test_repeated_recent_ids_are_penalised_once():
    logits = torch.tensor([2.0, 0.7])
    # once: 2.0 -> 1.0 > 0.7; twice would give 0.5 < 0.7
    assert sample(logits, temperature=0.0, repetition_penalty=2.0, recent_ids=[0, 0]).token_id == 0


def test_input_logits_are_not_modified():
    logits = torch.tensor([2.0, -1.0])
    sample(logits, temperature=0.0, repetition_penalty=3.0, recent_ids=[0, 1])
    assert logits.tolist() == [2.0, -1.0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"recent_ids": [5], "repetition_penalty": 1.2}, "recent_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sample(torch.zeros(3), **kwargs)


@pytest.mark.parametrize("logits", [torch.zeros(2, 3), torch.zeros(0), torch.zeros(3, dtype=torch.long)])
def test_bad_logits_raise(logits):
    with pytest.raises(ValueError, match="logits"):
        sample(logits)


@pytest.mark.parametrize("ties", ["many", "none", "at the cut only"])
def test_only_the_largest_are_sorted_but_exactly_as_a_full_stable_sort_would(ties):
    """Many ties (also at the cut), none (the short way: topk's own order), or one pair, the
    count-th and the next: the first `count` of a stable descending sort either way."""
    from positronic.steps.sample import _largest

    generator = torch.Generator().manual_seed(3)
    for count in (1, 20, 50, 999, 1000):
        if ties == "many":
            probs = torch.randint(0, 40, (1000,), generator=generator).float()
        else:
            probs = torch.rand(1000, generator=generator)
            if ties == "at the cut only" and count < 1000:
                order = probs.argsort(descending=True)
                probs[order[count]] = probs[order[count - 1]]
        values, ids = _largest(probs, count)
        full_values, full_ids = torch.sort(probs, descending=True, stable=True)
        assert torch.equal(values, full_values[:count]) and torch.equal(ids, full_ids[:count])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_or_inf_logits_are_refused_by_name_before_drawing(bad, temperature):
    from positronic.steps import NonFiniteLogits

    logits = torch.tensor([1.0, 2.0, 0.5, 3.0])
    logits[2] = bad
    generator = torch.Generator().manual_seed(5)
    before = generator.get_state()
    with pytest.raises(NonFiniteLogits, match="logits"):
        sample(logits, temperature=temperature, generator=generator)
    assert torch.equal(generator.get_state(), before), "nothing was drawn"
    with pytest.raises(NonFiniteLogits):
        sample(torch.full((4,), -math.inf), temperature=temperature)
    with pytest.raises(ValueError):  # a NonFiniteLogits is a ValueError
        sample(torch.full((3,), math.nan, dtype=torch.float16))


def test_minus_inf_logits_are_tokens_that_are_never_drawn():
    logits = torch.tensor([-math.inf, 1.0, -math.inf, 1.5])
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 1e300}, {"top_p": 0.5}):
        assert set(draws(logits, n=100, **kwargs)) <= {1, 3}


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-8])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.tensor([0.3, 2.0, 1.0, 2.0 - 1e-6])
    assert set(draws(logits, n=50, top_p=top_p, temperature=1.0)) == {1}
    assert set(draws(logits, n=50, top_p=top_p, top_k=2, temperature=5.0)) == {1}


@pytest.mark.parametrize("temperature", [1.0001e-3, 2e-3])
def test_a_tiny_temperature_draws_the_largest_even_when_dividing_overflows(temperature):
    logits = torch.tensor([1e36, -3e38, 3e38, 2.9e38])  # / 1e-3 is inf in float32
    assert set(draws(logits, n=50, temperature=temperature)) == {2}
    assert set(draws(torch.tensor([1.0, 40.0, 39.9]), n=50, temperature=temperature)) == {1}


@pytest.mark.parametrize("temperature", [1e6, 1e30, 1e300, math.inf])
def test_a_huge_temperature_draws_uniformly_from_the_finite_logits(temperature):
    logits = torch.tensor([5.0, -math.inf, -5.0, 0.0])
    seen = draws(logits, n=600, temperature=temperature)
    counts = [seen.count(i) for i in range(4)]
    assert counts[1] == 0 and all(150 < c < 250 for c in (counts[0], counts[2], counts[3]))


@pytest.mark.parametrize("penalty", [1e-300, 1e300, math.inf])
def test_an_extreme_repetition_penalty_leaves_a_finite_distribution(penalty):
    logits = torch.tensor([0.0, 2.0, -1.0, 1.0])
    s = sample(logits, temperature=1.0, repetition_penalty=penalty, recent_ids=[0, 1, 2],
               generator=torch.Generator().manual_seed(0))
    assert all(math.isfinite(p) for _, p in s.top) and 0 <= s.token_id < 4


def test_a_brain_whose_cache_turned_to_nan_rebuilds_it_from_the_mirror_and_goes_on(tiny):
    """Garbage in the cache makes the next logits NaN: the brain's tick does not draw a token
    from them (nor crash in torch), it rebuilds the state from the mirror and draws from the
    recomputed logits; if those are still not finite, the tick fails by name and did not happen."""
    from positronic.brain.loop import Brain, BrainConfig
    from positronic.steps import NonFiniteLogits

    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), BrainConfig(policy="streaming", budget=48, seed=3))
    brain.step()
    for layer in brain.state._cache.layers:  # a row that turned to garbage (written behind the state's back)
        layer.value_buffer[:, :, layer.start + 5] = math.nan
    brain.step()  # its forward read the NaN row
    assert not bool(torch.isfinite(brain.state.next_logits).all())
    record = brain.step()
    assert 0 <= record.token_id < tiny.vocab_size and not record.rebuilt and record.tick == 3
    assert brain.counts["rebuilds"] == 1
    assert bool(torch.isfinite(brain.state.next_logits).all())
    brain.state.check(deep=True)
    for _ in range(5):
        brain.step()
    assert brain.counts["rebuilds"] == 1

    brain.state.next_logits = torch.full_like(brain.state.next_logits, math.nan)  # a rebuild that does not help: the tick fails by name
    brain.state.rebuild = lambda: None
    with pytest.raises(NonFiniteLogits):
        brain.step()
    assert brain.tick == 8 and brain.counts["rebuilds"] == 2


def _reference_top_k_draw(logits, top_k, temperature, seed):
    """The rule sample() documents, written plainly: TopKLogitsWarper's set (ties at the cut
    kept) in id order, softmax over it, one multinomial draw; the record a stable sort of the
    whole vocabulary's probabilities."""
    tempered = (logits - logits.max()) / temperature
    probs = torch.softmax(tempered, dim=-1)
    values, ids = torch.sort(probs, descending=True, stable=True)
    candidates = (tempered >= torch.topk(tempered, top_k).values[-1]).nonzero().squeeze(1)
    pick = int(torch.multinomial(torch.softmax(tempered[candidates], dim=-1), 1,
                                 generator=torch.Generator().manual_seed(seed)))
    return int(candidates[pick]), list(zip(ids[:20].tolist(), values[:20].tolist()))


@pytest.mark.parametrize("ties", ["none", "at the cut", "everywhere"])
@pytest.mark.parametrize("top_k", [1, 5, 50])
def test_top_k_draws_and_records_exactly_what_the_plain_rule_gives(ties, top_k):
    """The top_k set and the record come from one topk of the logits; with or without ties
    at the cut, the token drawn (same seed) and the record are the plain rule's."""
    generator = torch.Generator().manual_seed(top_k)
    for seed in range(20):
        if ties == "everywhere":
            logits = torch.randint(0, 6, (500,), generator=generator).float()
        else:
            logits = torch.randn(500, generator=generator) * 3
            if ties == "at the cut":
                order = logits.argsort(descending=True)
                logits[order[top_k]] = logits[order[top_k - 1]]
        s = sample(logits, temperature=0.8, top_k=top_k, generator=torch.Generator().manual_seed(seed))
        assert (s.token_id, s.top) == _reference_top_k_draw(logits, top_k, 0.8, seed)


def test_greedy_many_picks_each_rows_sample_to_the_bit():
    """Rows of different penalties and recent ids (a short row repeating its own first id):
    each pick equals `sample` alone with temperature 0, ties and penalised ties included."""
    from positronic.steps.sample import greedy_many

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=generator).round(decimals=1)  # many exact ties
    logits[2] = -logits[2].abs()  # every logit negative: the penalty multiplies
    recent = torch.randint(0, 50, (6, 8), generator=generator)
    recent[3] = recent[3, 0]  # a short row: its one id repeated
    recent[0, 0], recent[2, 0] = logits[0].argmax(), logits[2].argmax()  # the favourite penalised
    before = logits.clone()
    penalties = [1.1, 1.0, 1.3, 1.1, 2.0, 1.3]
    want = [sample(logits[s], temperature=0, repetition_penalty=penalties[s],
                   recent_ids=sorted(set(recent[s].tolist()))).token_id for s in range(6)]
    assert greedy_many(logits, recent, penalties) == want == greedy_many(logits, recent, penalties, finite=True)
    assert torch.equal(logits, before)  # the caller's logits are not written
    assert greedy_many(logits, recent, [1.0] * 6) == logits.argmax(dim=-1).tolist()
    assert want != logits.argmax(dim=-1).tolist()  # the penalties changed some pick
    one = [sample(logits[s], temperature=0, repetition_penalty=1.3, recent_ids=sorted(set(recent[s].tolist()))).token_id
           for s in range(6)]  # one penalty for every row: the rows at once, no mask
    assert greedy_many(logits, recent, [1.3] * 6) == one


def test_greedy_many_names_the_rows_without_finite_logits():
    from positronic.steps.sample import greedy_many

    logits = torch.zeros(3, 10)
    logits[1, 4] = float("nan")
    with pytest.raises(NonFiniteLogits, match=r"rows \[1\]"):
        greedy_many(logits, torch.zeros(3, 0, dtype=torch.long), [1.0] * 3)


@pytest.mark.parametrize("vocab", [50, 3000])
def test_sample_many_draws_each_rows_sample_with_its_own_generator(vocab):
    """Rows of different settings (temperature, top-k with and without a tie at its cut, top-p,
    min-p, penalties, an extreme penalty) and recent ids: each row's token is `sample`'s with
    the same generator, and every generator ends where `sample` leaves it, over 40 draws."""
    from positronic.steps.sample import sample_many

    generator = torch.Generator().manual_seed(vocab)
    settings = [(0.7, 50, 0.95, 0.0, 1.1), (0.7, 50, 0.95, 0.0, 1.1), (1.3, 0, 1.0, 0.0, 1.0),
                (0.5, 5, 1.0, 0.1, 1.3), (0.9, 0, 0.8, 0.0, 1.1), (0.7, 50, 0.95, 0.0, 1e-37), (2.0, 3, 0.5, 0.2, 1.0)]
    rows = len(settings)
    for draw in range(40):
        logits = torch.randn(rows, vocab, generator=generator) * 3
        if draw % 4 == 0:  # ties at row 3's top-k cut (its 5th and 6th largest alike) and many ties in row 6
            order = logits[3].argsort(descending=True)
            logits[3, order[5]] = logits[3, order[4]]
            logits[6] = logits[6].round()
        recent = torch.randint(0, vocab, (rows, 16), generator=generator)
        recent[1] = recent[1, 0]  # a short row: one id repeated
        logits[5, recent[5, 0]] = 50.0  # divided by row 5's penalty it passes float32's largest: `sample` mends it
        mine = [torch.Generator().manual_seed(100 * draw + r) for r in range(rows)]
        theirs = [torch.Generator().manual_seed(100 * draw + r) for r in range(rows)]
        want = [sample(logits[r], temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=pen,
                       recent_ids=recent[r].tolist(), generator=theirs[r]).token_id
                for r, (t, k, p, m, pen) in enumerate(settings)]
        assert sample_many(logits, recent, settings, mine) == want, f"draw {draw}"
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs))

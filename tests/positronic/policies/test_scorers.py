"""Scorers (positronic/policies/scorers.py) on their own: one value per live row each tick, keyed by
ledger id where they keep state, so it follows a row through splices, forgets it once it is
gone, and change only when a tick's next state is adopted (a tick that did not happen never is). The policies built on them (which rows go)
are tests/positronic/policies/test_policy.py."""

import pytest

from positronic import steps
from positronic.brain.loop import BrainConfig
from positronic.policies.scorers import AccumulatedScorer, BrightnessScorer, LastAccessScorer, RecencyScorer, Scorer


def test_last_access_stamps_rows_above_the_mean_of_the_non_sinks_and_rows_seen_for_the_first_time(crafted_view):
    scorer = LastAccessScorer(sinks=2)
    view = crafted_view([5] * 6, [0] * 6)
    assert scorer.values(view, [0.9, 0.5, 0.1, 0.1, 0.1, 0.1]) == [1] * 6, "first seen: accessed now"
    # tick 2: the mean of the non-sink rows is 0.175 (the sinks' 0.9 would lift a plain mean to 0.35,
    # above row 3's 0.3); rows 0, 3 and 5 are above it
    assert scorer.values(view, [0.9, 0.1, 0.05, 0.3, 0.0, 0.35]) == [2, 1, 1, 2, 1, 2]
    all_sinks = LastAccessScorer(sinks=10)  # no row besides the sinks: the mean of all rows
    all_sinks.values(view, [0.0] * 6)
    assert all_sinks.values(view, [0.2, 0.1, 0.1, 0.1, 0.1, 0.4]) == [2, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="5 scores for 6 live rows"):
        scorer.values(view, [0.1] * 5)


@pytest.mark.parametrize("length", [5, 7, 10, 11, 13, 17, 29, 37, 61, 94, 97, 173, 250])
def test_last_access_counts_rows_of_equal_score_all_accessed_whatever_the_sum_rounds(crafted_view, length):
    """Uniform attention after the first tick: every row is as accessed as any other, so every
    row is stamped, on any Python (3.12's `sum` rounds the mean of equal floats otherwise than
    3.11's; a strict "above the mean" stamped some lengths' rows and not others')."""
    scorer = LastAccessScorer(sinks=2)
    view = crafted_view([5] * length, [0] * length)
    scorer.values(view, [1.0 / length] * length)
    for share in (1.0 / (length + 80), 0.1, 1.0 / 3):
        scores = [0.3, 0.3] + [share] * (length - 2)
        assert scorer.values(view, scores)[2:] == [scorer.clock] * (length - 2), share
    below = [0.3, 0.3] + [0.2] * (length - 3) + [0.2 * (1 - 1e-6)]
    assert scorer.values(view, below)[-1] == scorer.clock - 1, "a row below the mean is not stamped"


def test_accumulated_scores_follow_a_row_through_a_splice_by_its_ledger_id(crafted_view):
    scorer = AccumulatedScorer()
    view = crafted_view([5] * 4, [0] * 4)  # ledger ids 0..3
    values, next = scorer.plan(view, [1.0, 2.0, 3.0, 4.0])
    assert values == [1.0, 2.0, 3.0, 4.0]
    scorer.removing(next, [1])
    scorer.adopt(next)
    moved = crafted_view([5] * 4, [0] * 4)
    moved.ledger_ids[:] = moved.ledger_ids.new_tensor([0, 2, 3, 9])  # row 1 culled, a new token 9 appended
    assert scorer.values(moved, [0.5, 0.5, 0.5, 0.5]) == [1.5, 3.5, 4.5, 0.5]
    assert 1 not in scorer.value, "a removed row is forgotten once it is gone"


def test_a_row_a_failed_plan_meant_to_remove_keeps_its_value(crafted_view):
    scorer = AccumulatedScorer()
    view = crafted_view([5] * 3, [0] * 3)
    _, next = scorer.plan(view, [1.0, 1.0, 1.0])
    scorer.removing(next, [2])
    scorer.adopt(next)
    assert scorer.values(view, [1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0], "still live: the removal did not happen"


def test_a_plan_that_is_not_adopted_changes_nothing(crafted_view):
    scorer = LastAccessScorer(sinks=0)
    view = crafted_view([5] * 3, [0] * 3)
    scorer.values(view, [0.2, 0.3, 0.5])
    saved = scorer.state()
    _, next = scorer.plan(view, [0.0, 0.0, 1.0])
    scorer.removing(next, [0])
    assert scorer.state() == saved
    scorer.plan(view, [0.0, 0.0, 1.0])  # a second plan of the same tick starts from the same state
    assert scorer.state() == saved
    scorer.adopt(next)
    assert scorer.state() != saved and scorer.clock == 2 and scorer.state()["removing"] == [0]


def test_state_round_trips_and_malformed_state_is_refused_without_a_change(crafted_view):
    scorer = AccumulatedScorer()
    view = crafted_view([5] * 3, [0] * 3)
    _, next = scorer.plan(view, [0.25, 0.5, 1.0])
    scorer.removing(next, [2])
    scorer.adopt(next)
    again = AccumulatedScorer()
    again.load_state(scorer.state())
    assert again.state() == scorer.state()
    assert again.values(view, [1.0, 1.0, 1.0]) == scorer.values(view, [1.0, 1.0, 1.0]) == [1.25, 1.5, 2.0]
    before = again.state()
    for bad in [{}, {"ids": [1], "values": [], "clock": 1, "removing": []},
                {"ids": [1], "values": ["x"], "clock": 1, "removing": []},
                {"ids": [1], "values": [1.0], "clock": 1.5, "removing": []},
                {"ids": [True], "values": [1.0], "clock": 1, "removing": []}]:
        with pytest.raises(ValueError, match="AccumulatedScorer: malformed saved state"):
            again.load_state(bad)
        assert again.state() == before
    with pytest.raises(ValueError, match="RecencyScorer keeps no state"):
        RecencyScorer().load_state({"ids": []})
    Scorer().load_state({})


def test_recency_is_the_rope_position(crafted_view):
    view = crafted_view([5] * 4, [0] * 4)
    view.positions[:] = view.positions.new_tensor([0, 3, 7, 8])
    assert RecencyScorer().values(view, [0.1] * 4) == [0.0, 3.0, 7.0, 8.0]


def test_brightness_follows_the_configured_rule_and_its_settings(crafted_view):
    view = crafted_view([5] * 4, [0] * 4, brightness=[10.0, 100.0, 200.0, 255.0])
    scores = [0.7, 0.1, 0.1, 0.1]
    slow = BrightnessScorer(BrainConfig(brightness="ttl", ttl_decay=1.0, ttl_gain=0.0))
    fast = BrightnessScorer(BrainConfig(brightness="ttl", ttl_decay=50.0, ttl_gain=0.0))
    assert slow.keeps_brightness and slow.values(view, scores) == steps.update_ttl(
        [10.0, 100.0, 200.0, 255.0], scores, decay=1.0, gain=0.0)
    assert fast.values(view, scores) != slow.values(view, scores)
    vote = BrightnessScorer(BrainConfig(brightness="vote", sinks=1))
    assert vote.values(view, scores) == steps.update_vote([10.0, 100.0, 200.0, 255.0], scores, sinks=1)

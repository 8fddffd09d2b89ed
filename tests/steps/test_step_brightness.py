import pytest

from positronic.steps.brightness import RULES, update_ttl, update_vote


def test_ttl_formula_spot_check():
    assert update_ttl([100.0], [0.5]) == [103.0]
    assert update_ttl([100.0, 50.0], [0.0, 0.2]) == pytest.approx([98.0, 50.0])


def test_ttl_clamps_to_0_and_255():
    assert update_ttl([1.0, 254.0, 255.0], [0.0, 1.0, 0.9]) == [0.0, 255.0, 255.0]


def test_ttl_custom_parameters():
    assert update_ttl([10.0], [0.5], decay=1.0, gain=4.0, floor=5.0, cap=11.0) == [11.0]
    assert update_ttl([10.0], [0.0], decay=8.0, floor=5.0) == [5.0]


# Dyadic numbers keep the arithmetic exact. Non-sink mean = (0.125+0.25+0.5625+0.0625)/4 = 0.25;
# had the sinks been included the mean would be 0.265625 and row 0 would gain 1, not 2.
SCORES = [0.5, 0.25, 0.375, 0.0, 0.125, 0.25, 0.5625, 0.0625]


def test_vote_threshold_excludes_sinks():
    out = update_vote([100.0] * 8, SCORES, sinks=4)
    #           2.0   =thr   1.5   0     below =thr  2.25  below
    assert out == [102.0, 99.0, 101.0, 99.0, 99.0, 99.0, 102.0, 99.0]


def test_vote_with_no_sinks_uses_all_rows():
    # mean of all = 2.125/8 = 0.265625: 0.5 -> +1, 0.375 -> +1, 0.5625 -> +2
    out = update_vote([100.0] * 8, SCORES, sinks=0)
    assert out == [101.0, 99.0, 101.0, 99.0, 99.0, 99.0, 102.0, 99.0]


def test_vote_clamps_to_0_and_cap():
    out = update_vote([10000.0, 0.0, 5.0, 5.0], [0.9, 0.0, 0.05, 0.05], sinks=0)
    assert out == [10000.0, 0.0, 4.0, 4.0]
    assert update_vote([9.0, 9.0], [1.0, 0.0], sinks=0, cap=10.0) == [10.0, 8.0]


def test_vote_zero_threshold_sends_attended_rows_to_cap():
    out = update_vote([50.0, 50.0, 50.0], [1.0, 0.0, 0.0], sinks=1)
    assert out == [10000.0, 49.0, 49.0]


def test_vote_fewer_rows_than_sinks_uses_all_rows():
    assert update_vote([5.0, 5.0], [0.75, 0.25], sinks=4) == [6.0, 4.0]


def test_empty_lists():
    assert update_ttl([], []) == []
    assert update_vote([], []) == []


@pytest.mark.parametrize("update", [update_ttl, update_vote])
def test_length_mismatch_raises(update):
    with pytest.raises(ValueError, match="brightness and scores"):
        update([1.0, 2.0], [0.5])


def test_inputs_are_not_mutated():
    b = [100.0, 100.0]
    update_ttl(b, [1.0, 1.0])
    update_vote(b, [1.0, 0.0], sinks=0)
    assert b == [100.0, 100.0]


def test_each_rule_is_registered_under_its_flag_name_and_starts_where_its_update_expects():
    assert set(RULES) == {"ttl", "vote"}  # the --brightness choices
    assert RULES["ttl"].update([RULES["ttl"].start], [0.0]) == [253.0]  # a full new row, then one decay


def test_only_the_vote_rule_takes_the_runs_sinks():
    """`settings` tells the policy which run settings a rule takes: vote's threshold depends on
    the sinks, ttl has no such option (passing it would be an error, not silently ignored)."""
    assert dict(RULES["vote"].settings) == {"sinks": "sinks"}
    assert dict(RULES["ttl"].settings) == {"decay": "ttl_decay", "gain": "ttl_gain"}
    vote = RULES["vote"].update
    assert vote([100.0] * 8, SCORES, sinks=4) != vote([100.0] * 8, SCORES, sinks=0)
    assert vote([100.0] * 8, SCORES) == vote([100.0] * 8, SCORES, sinks=4), "the default is 4 sinks"
    with pytest.raises(TypeError):
        RULES["ttl"].update([100.0], [0.5], sinks=4)

"""Per-layer live maps (mirror/layer_rows.py) and the mirror's per-layer splice and file format."""

import pytest

from positronic.mirror import (Insertion, LayerRows, LayerRowsError, Ledger, LiveMap, Mirror, MirrorFileError,
                               MirrorInvariantError, from_bytes, plan_layout, runs_without, to_bytes)
from positronic.mirror.storage import to_columns


def per_layer_mirror(rows: list[list[int]], count: int = 8) -> Mirror:
    """A mirror of `count` live tokens (ids 0..count-1 at positions 0, 2, 4, …) whose layers
    hold `rows` (ledger ids)."""
    ledger = Ledger()
    for t in range(count):
        ledger.add(100 + t, f"t{t}", "prompt", 0, 255.0)
    return Mirror(ledger, LiveMap(list(range(count)), [2 * t for t in range(count)]), LayerRows(rows))


def test_after_drops_rows_per_layer_and_appends_everywhere():
    layers = LayerRows([[0, 1, 2, 3], [0, 2, 4, 5]])
    after = layers.after([[1], [3]], [9])
    assert after.rows == [[0, 2, 3, 9], [0, 2, 4, 9]]
    assert layers.rows == [[0, 1, 2, 3], [0, 2, 4, 5]], "the original is unchanged"
    assert after.occupancy([0, 2, 3, 4, 9]) == [2, 2, 1, 1, 2]
    with pytest.raises(LayerRowsError, match="different numbers"):
        layers.after([[1], []], [])
    with pytest.raises(LayerRowsError, match="out of range"):
        layers.after([[4], [0]], [])
    with pytest.raises(LayerRowsError, match="out of range"):
        layers.after([[-1], [0]], [])
    with pytest.raises(LayerRowsError, match="repeated"):
        layers.after([[1, 1], [0, 2]], [])


@pytest.mark.parametrize("rows,message", [
    ([[0, 1, 2], [0, 1]], "different numbers"),
    ([[0, 1, 9], [0, 1, 2]], "not live"),
    ([[0, 2, 1], [0, 1, 2]], "position order"),
    ([[0, 1, 1], [0, 1, 2]], "position order"),
    ([[0, 1, 2], [0, 1, 2]], "held by no layer"),
])
def test_check_refuses_layers_that_do_not_describe_the_live_map(rows, message):
    with pytest.raises(MirrorInvariantError, match=message):
        per_layer_mirror(rows, count=4).check()


def test_splice_retires_what_no_layer_holds_and_appends_the_new_token_to_every_layer():
    mirror = per_layer_mirror([[0, 1, 2, 4, 5, 6, 7], [0, 1, 3, 4, 5, 6, 7]], count=8)
    mirror.check()
    drops = [[1], [2]]  # layer 0 drops token 1, layer 1 drops token 3
    still = mirror.layers.after(drops, []).held()
    deleted = [row for row, i in enumerate(mirror.live.ledger_ids) if i not in still]
    assert deleted == [3]  # token 1 is still held by layer 1
    layout = plan_layout(mirror.live.positions, deleted, [Insertion(8, (55,), "generated")], 10_000)
    new_ids = mirror.splice(layout, ["x"], tick=1, brightness=255.0, layer_drops=drops)
    mirror.check()
    assert new_ids == [8] and mirror.ledger[3].state == "culled" and mirror.ledger[3].position == 6
    assert mirror.layers.rows == [[0, 2, 4, 5, 6, 7, 8], [0, 1, 4, 5, 6, 7, 8]]
    assert mirror.live.ledger_ids == [0, 1, 2, 4, 5, 6, 7, 8] and mirror.live.positions[-1] == 15


def test_a_layer_takes_tokens_back_in_position_order_and_drops_as_many_more():
    layers = LayerRows([[0, 1, 2, 3], [0, 2, 4, 5]])
    after = layers.after([[1, 3], [3]], [9], [[1 + 3], []])
    assert after.rows == [[0, 2, 4, 9], [0, 2, 4, 9]] and after.occupancy([1, 3, 4, 5]) == [0, 0, 2, 0]
    with pytest.raises(LayerRowsError, match="different numbers"):
        layers.after([[1], [3]], [], [[4], []])
    with pytest.raises(LayerRowsError, match="already held"):
        layers.after([[1, 3], [3]], [], [[2], []])
    with pytest.raises(LayerRowsError, match="taken back twice"):
        layers.after([[1, 3, 0], [3]], [], [[4, 4], []])


def test_asking_again_with_the_same_or_other_drops_gives_what_a_fresh_layer_rows_gives():
    """`after` keeps the rows after its last drops for the commit's second ask (with the new
    token): every ask, repeated or not, with or without appends, is what a fresh copy answers."""
    layers = LayerRows([[0, 1, 2, 3], [0, 2, 4, 5]])

    def fresh(*args):
        made = LayerRows([list(layer) for layer in layers.rows]).after(*args)
        return made.rows, made.counts
    asks = [([[1], [3]], [], [[], []]), ([[1], [3]], [9], [[], []]), ([[2], [0]], [9], [[], []]),
            ([[1], [3]], [9, 10], [[], []]), ([[1, 3], [3]], [], [[4], []]), ([[1, 3], [3]], [9], [[4], []]),
            ([[], []], [], [[], []]), ([[], []], [9], [[], []])]  # under the budget: nothing dropped
    for drops, new_ids, inserts in asks + asks[::-1]:
        after = layers.after(drops, new_ids, inserts)
        assert (after.rows, after.counts) == fresh(drops, new_ids, inserts)
    assert layers.rows == [[0, 1, 2, 3], [0, 2, 4, 5]]  # the asked object itself never changes
    plan, commit = layers.after([[1], [3]], []), layers.after([[1], [3]], [9])
    assert plan.rows == [[0, 2, 3], [0, 2, 4]] and commit.rows == [[0, 2, 3, 9], [0, 2, 4, 9]]
    assert plan.counts == {0: 2, 2: 2, 3: 1, 4: 1} and commit.counts == {0: 2, 2: 2, 3: 1, 4: 1, 9: 2}


def test_a_token_no_layer_held_rejoins_the_live_map_at_its_position():
    mirror = per_layer_mirror([[0, 1, 2, 4, 5, 6, 7], [0, 1, 3, 4, 5, 6, 7]], count=8)
    mirror.splice(plan_layout(mirror.live.positions, [3], [], 10_000), [], tick=1, brightness=1.0,
                  layer_drops=[[1], [2]])  # token 3 (position 6) leaves the union
    assert mirror.ledger[3].state == "culled" and mirror.ledger[3].position == 6
    assert mirror.layers.rows == [[0, 2, 4, 5, 6, 7], [0, 1, 4, 5, 6, 7]]
    back = Insertion(2, (103,), "prompt", positions=(6,), restores=(3,))
    layout = plan_layout(mirror.live.positions, [2], [back, Insertion(7, (55,), "generated")], 10_000)
    restore_only = plan_layout(mirror.live.positions, [], [back, Insertion(7, (55,), "generated")], 10_000)
    with pytest.raises(ValueError, match="restore exactly the tokens"):  # no layer takes token 3 back
        mirror.splice(restore_only, ["t3", "x"], tick=2, brightness=1.0, layer_drops=[[], []], layer_inserts=[[], []])
    new_ids = mirror.splice(layout, ["t3", "x"], tick=2, brightness=1.0, layer_drops=[[1], []],
                            layer_inserts=[[3], []])  # layer 0 takes token 3 back in place of token 2
    mirror.check()
    assert new_ids == [3, 8] and mirror.ledger[3].state == "live" and mirror.ledger[2].state == "culled"
    assert mirror.layers.rows == [[0, 3, 4, 5, 6, 7, 8], [0, 1, 4, 5, 6, 7, 8]]
    assert mirror.live.ledger_ids == [0, 1, 3, 4, 5, 6, 7, 8] and mirror.live.positions[2] == 6


def test_a_restoring_splice_that_fails_after_the_restore_leaves_the_token_culled(monkeypatch):
    """The undo log covers what a restore changes beyond brightness (state, position, resurrections):
    a failure after the token came back to life puts it back among the culled, as it was."""
    mirror = per_layer_mirror([[0, 1, 2, 4, 5, 6, 7], [0, 1, 3, 4, 5, 6, 7]], count=8)
    mirror.splice(plan_layout(mirror.live.positions, [3], [], 10_000), [], tick=1, brightness=1.0,
                  layer_drops=[[1], [2]])  # token 3 leaves the union: culled at position 6
    before = to_bytes(mirror)
    back = Insertion(2, (103,), "prompt", positions=(6,), restores=(3,))
    layout = plan_layout(mirror.live.positions, [2], [back, Insertion(7, (55,), "generated")], 10_000)
    import positronic.mirror.mirror as module

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(module, "LiveMap", broken)  # after the ledger's retire, resurrect and add
    with pytest.raises(RuntimeError, match="disk on fire"):
        mirror.splice(layout, ["t3", "x"], tick=2, brightness=9.0, layer_drops=[[1], []], layer_inserts=[[3], []],
                      live_brightness=[5.0] * len(mirror.live))
    monkeypatch.undo()
    assert to_bytes(mirror) == before
    assert mirror.ledger[3].state == "culled" and mirror.ledger[3].position == 6
    assert mirror.ledger[3].resurrections == 0
    mirror.check()


def test_a_splice_that_fails_leaves_the_layers_and_the_ledger_as_they_were():
    mirror = per_layer_mirror([[0, 1, 2, 3], [0, 1, 2, 3]], count=4)
    before = to_bytes(mirror)
    layout = plan_layout(mirror.live.positions, [], [Insertion(4, (55,), "generated")], 10_000)
    with pytest.raises(ValueError, match="exactly the tokens"):  # the layout must delete token 1, which no layer keeps
        mirror.splice(plan_layout(mirror.live.positions, [], [], 10_000), [], tick=1, brightness=1.0,
                      layer_drops=[[1], [1]])
    with pytest.raises(LayerRowsError):
        mirror.splice(layout, ["x"], tick=1, brightness=1.0, layer_drops=[[1], []])
    with pytest.raises(ValueError, match="only with them"):
        mirror.splice(layout, ["x"], tick=1, brightness=1.0)
    with pytest.raises(ValueError, match="appended new tokens and restores only"):
        mirror.splice(plan_layout(mirror.live.positions, [], [Insertion(1, (55,), "inserted")], 10_000), ["x"],
                      tick=1, brightness=1.0, layer_drops=[[], []])
    assert to_bytes(mirror) == before

    def broken_add(*args, **kwargs):
        raise RuntimeError("disk full")
    mirror.ledger.add = broken_add  # fails half-way, after the drops were planned
    with pytest.raises(RuntimeError):
        mirror.splice(layout, ["x"], tick=1, brightness=1.0, layer_drops=[[], []])
    del mirror.ledger.add
    assert to_bytes(mirror) == before


def test_the_mirror_file_keeps_per_layer_rows_and_refuses_bad_ones():
    mirror = per_layer_mirror([[0, 1, 3], [0, 2, 3]], count=4)
    assert from_bytes(to_bytes(mirror))[0].layers.rows == [[0, 1, 3], [0, 2, 3]]
    plain = Mirror(mirror.ledger, mirror.live)
    assert "layers" not in to_columns(plain), "files of every-layer-alike runs are unchanged"
    assert from_bytes(to_bytes(plain))[0].layers is None
    import msgpack
    import hashlib

    for bad, message in (([[0, 1, 3], [0, 3, 2]], "position order"), ([], "non-empty"), ([[0, "1", 3]], "lists of int")):
        body = msgpack.packb({**to_columns(mirror), "layers": bad, "meta": {}}, use_bin_type=True)
        data = msgpack.packb({"format": "positronic-mirror", "version": 2, "sha256": hashlib.sha256(body).hexdigest(),
                              "body": body}, use_bin_type=True)
        with pytest.raises(MirrorFileError, match=message):
            from_bytes(data)


def test_runs_without_is_plan_layouts_deletion_runs():
    import random

    rng = random.Random(3)
    for _ in range(300):
        length = rng.randrange(0, 40)
        dropped = rng.sample(range(length), rng.randrange(0, length + 1)) if length else []
        assert runs_without(length, dropped) == list(plan_layout(list(range(length)), dropped, [], 10**6).kept)
        # the deletions-only path against the general one (a new row after every survivor splits no run)
        assert runs_without(length, dropped) == runs_without(length, dropped, [length])


def test_runs_without_with_inserted_rows_moves_each_survivor_to_its_row_among_them():
    """A lane that drops rows and takes tokens back: each survivor's new row is its place in the
    new ascending id list (what a map from id to old row gives, one survivor at a time)."""
    import bisect
    import random

    rng = random.Random(5)
    for _ in range(500):
        old = sorted(rng.sample(range(200), rng.randrange(0, 40)))
        dropped = rng.sample(range(len(old)), rng.randrange(0, len(old) + 1)) if old else []
        survivors = [i for row, i in enumerate(old) if row not in set(dropped)]
        taken = rng.sample(sorted(set(range(200)) - set(old)), rng.randrange(0, 7))
        new = sorted(survivors + taken)
        expected = [(old.index(i), new.index(i)) for i in survivors]  # (old row, new row), one by one
        runs = runs_without(len(old), dropped, sorted(bisect.bisect_left(new, i) for i in taken))
        assert [(o + k, n + k) for o, n, count in runs for k in range(count)] == expected
        # maximal runs: two runs never continue each other
        assert all((a[0] + a[2], a[1] + a[2]) != b[:2] for a, b in zip(runs, runs[1:]))

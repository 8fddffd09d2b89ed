"""LaneRecall: its index, a ring of preallocated slots that keeps the newest `capacity` tokens,
scores them by ledger id whatever slot they sit in and saves the ring slot for slot, in blocks;
and its rule, what comes back and into which lanes."""

import math

import numpy
import pytest
import torch

from positronic.policies.recall import Recall
from positronic.smartkv import recall as lane_recall
from positronic.smartkv.recall import LaneLookup, LaneRecall
from positronic.state.view import ContextView

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4


def leaving(recall: LaneRecall, first: int, count: int, generator: torch.Generator):
    """`count` tokens (ledger ids from `first`) leave the window in one tick; their K/V."""
    ids = list(range(first, first + count))
    keys = torch.randn(LAYERS, KV_HEADS, count, HEAD_DIM, generator=generator)
    values = torch.randn(LAYERS, KV_HEADS, count, HEAD_DIM, generator=generator)
    lookup = LaneLookup(recall.clock + 1, False)
    lookup.evicted = (ids, [i + 1000 for i in ids], [i % 7 for i in ids], keys, values,
                      {i: [float(i), -float(i)] for i in ids})
    recall.adopt(lookup)
    return keys, values


def by_id(recall: LaneRecall, query: torch.Tensor, log_norm: torch.Tensor) -> dict:
    shares = recall.lane_shares(recall.lane_logits(query, log_norm))
    return {ledger_id: shares[:, k] for k, ledger_id in enumerate(recall.ids)}


def test_the_ring_keeps_the_newest_tokens_their_own_kv_and_saves_them_slot_for_slot():
    generator = torch.Generator().manual_seed(0)
    recall = LaneRecall(KV_HEADS, capacity=5)
    keys, values = zip(*(leaving(recall, first, 3, generator) for first in range(100, 112, 3)))
    keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # 12 tokens, ids 100..111

    ids, positions, predicted, kept_keys, kept_values = recall._rows()
    assert ids == list(range(107, 112))  # the oldest seven went
    assert positions == [i + 1000 for i in ids] and predicted == [i % 7 for i in ids]
    assert torch.equal(kept_keys, keys[:, :, 7:]) and torch.equal(kept_values, values[:, :, 7:])
    assert sorted(recall.scores) == ids
    assert recall.keys.shape[3] == 5  # preallocated (keys as columns): nothing grew
    assert recall.payload([109])["keys"].equal(keys[:, :, 9:10])

    saved = recall.state()
    assert saved["ring"]["ids"] == recall.ids == [110, 111, 107, 108, 109] and saved["ring"]["next"] == 2
    resumed = LaneRecall(KV_HEADS, capacity=5)
    resumed.load_state(saved)
    assert (resumed.ids, resumed.positions, resumed.predicted, resumed.next) == \
        (recall.ids, recall.positions, recall.predicted, recall.next)
    assert torch.equal(resumed.keys, recall.keys) and torch.equal(resumed.values, recall.values)  # all 5 filled
    query, log_norm = torch.randn(LAYERS, 2 * KV_HEADS, HEAD_DIM, generator=generator), torch.zeros(LAYERS, 2 * KV_HEADS)
    before, after = by_id(recall, query, log_norm), by_id(resumed, query, log_norm)
    assert before.keys() == after.keys() and all(torch.allclose(before[i], after[i]) for i in before)

    # both go on alike: the next tokens overwrite the same (oldest) tokens
    twin = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    leaving(recall, 112, 2, twin[0])
    leaving(resumed, 112, 2, twin[1])
    assert recall._rows()[0] == resumed._rows()[0] == [109, 110, 111, 112, 113]
    assert all(torch.equal(a, b) for a, b in zip(recall._rows()[3:], resumed._rows()[3:]))


@pytest.mark.parametrize("tokens", [0, 3, 5, 7])
def test_the_index_round_trips_whether_its_ring_has_wrapped_or_not(tokens, monkeypatch):
    """Not yet full, just full, wrapped part way: the kept tokens are their own K/V, oldest
    first; saved in blocks of 2 slots and taken back, the ring is the same slot for slot, and a
    state saved before the ring form (the index oldest first) and one saved by a ring of
    another capacity come back as the same tokens, oldest first."""
    monkeypatch.setattr(lane_recall, "BLOCK", 2)
    generator = torch.Generator().manual_seed(2)
    recall = LaneRecall(KV_HEADS, capacity=5)
    keys = values = torch.empty(LAYERS, KV_HEADS, 0, HEAD_DIM)
    for first in range(100, 100 + tokens):
        k, v = leaving(recall, first, 1, generator)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
    ids, _, _, kept_keys, kept_values = recall._rows()
    kept = min(tokens, 5)
    assert ids == list(range(100 + tokens - kept, 100 + tokens))
    if tokens:
        assert torch.equal(kept_keys, keys[:, :, tokens - kept:]) and torch.equal(kept_values, values[:, :, tokens - kept:])

    saved = recall.state()
    assert len(saved["ring"]["keys"]) == len(saved["ring"]["values"]) == -(-kept // 2)
    same = LaneRecall(KV_HEADS, capacity=5)
    same.load_state(saved)
    assert (same.ids, same.next) == (recall.ids, recall.next)
    if tokens:  # the filled slots (the rest were never written)
        assert torch.equal(same.keys[..., :kept], recall.keys[..., :kept])
        assert torch.equal(same.values[:, :, :kept], recall.values[:, :, :kept])
    else:
        assert same.keys is None
    old_form = {"index": Recall.state(recall), "scores": saved["scores"], "lane_back_at": saved["lane_back_at"]}
    for state, capacity in ((old_form, 5), (saved, 8)):
        other = LaneRecall(KV_HEADS, capacity=capacity)
        other.load_state(state)
        assert other._rows()[0] == ids and other.next == kept % capacity
        assert all(torch.equal(a, b) for a, b in zip(other._rows()[3:], recall._rows()[3:])) if tokens else True


def test_more_tokens_leaving_at_once_than_the_ring_holds_keep_the_newest_and_their_scores_only():
    """A long prompt's bulk prune: 7 tokens leave at once into a ring of 5. The newest 5 are
    indexed with their scores, no other score is kept, and the saved index loads."""
    generator = torch.Generator().manual_seed(6)
    recall = LaneRecall(KV_HEADS, capacity=5)
    keys, _ = leaving(recall, 100, 7, generator)
    assert recall.ids == list(range(102, 107)) and sorted(recall.scores) == recall.ids
    assert torch.equal(recall._rows()[3], keys[:, :, 2:])
    resumed = LaneRecall(KV_HEADS, capacity=5)
    resumed.load_state(recall.state())
    assert resumed.ids == recall.ids and resumed.scores == recall.scores


def test_a_save_changes_only_the_blocks_new_tokens_fell_in(monkeypatch):
    """What lets a session checkpoint write only what changed (brain/session.py keeps each
    block by its content): one more token changes one block, keys and values."""
    monkeypatch.setattr(lane_recall, "BLOCK", 2)
    generator = torch.Generator().manual_seed(3)
    recall = LaneRecall(KV_HEADS, capacity=7)
    leaving(recall, 100, 4, generator)
    before = recall.state()["ring"]
    for first in (104, 105, 106, 107):  # fills slots 4, 5, 6, then wraps to 0
        leaving(recall, first, 1, generator)
        after = recall.state()["ring"]
        for part in ("keys", "values"):
            changed = [k for k, block in enumerate(after[part]) if k >= len(before[part]) or before[part][k] != block]
            assert changed == [recall._runs((recall.next - 1) % 7, 1)[0][0] // 2], (first, part)
        before = after


@pytest.mark.parametrize("damage", [
    lambda ring: ring.update(next=4),  # not full: the next slot is the first free one
    lambda ring: ring["keys"].__setitem__(0, ring["keys"][0][:-1]),
    lambda ring: ring["values"].pop(),
    lambda ring: ring.update(shape=[LAYERS, KV_HEADS]),
    lambda ring: ring.update(capacity=2),
    lambda ring: ring["keys"].__setitem__(0, b"\xff" * len(ring["keys"][0])),  # NaN
])
def test_a_malformed_ring_is_refused_and_changes_nothing(damage, monkeypatch):
    monkeypatch.setattr(lane_recall, "BLOCK", 2)
    generator = torch.Generator().manual_seed(4)
    recall = LaneRecall(KV_HEADS, capacity=5)
    leaving(recall, 100, 3, generator)
    saved = recall.state()
    damage(saved["ring"])
    target = LaneRecall(KV_HEADS, capacity=5)
    leaving(target, 500, 2, generator)
    before = target.state()
    with pytest.raises(ValueError, match="malformed saved state"):
        target.load_state(saved)
    assert target.state() == before


def test_a_saved_index_whose_scores_do_not_match_is_refused_and_changes_nothing():
    generator = torch.Generator().manual_seed(0)
    recall = LaneRecall(KV_HEADS, capacity=5)
    leaving(recall, 100, 3, generator)
    saved = recall.state()
    saved["scores"] = saved["scores"][:-1]
    target = LaneRecall(KV_HEADS, capacity=5)
    leaving(target, 500, 2, generator)
    before = target.state()
    with pytest.raises(ValueError, match="scores do not match"):
        target.load_state(saved)
    after = target.state()
    assert after["ring"]["ids"] == before["ring"]["ids"] == [500, 501]
    assert after["ring"]["keys"] == before["ring"]["keys"]


def view_with_query(query: torch.Tensor, log_norm: torch.Tensor, newest: int) -> ContextView:
    """The live context as a policy sees it, reduced to what recall reads: the newest position,
    query and log-normaliser (no live rows are read)."""
    empty = torch.zeros(1, dtype=torch.long)
    return ContextView(token_ids=empty, ledger_ids=empty, positions=torch.tensor([newest]), brightness=empty,
                       predicted=empty, query=query, log_norm=log_norm)


def test_a_token_comes_back_into_every_lane_lacking_it_when_one_lane_would_read_it_above_all_it_holds():
    """4 lanes (2 layers x 2 kv heads). A lane's would-be share of a token it lacks is
    exp(q.k - its log-normaliser): 1 means as much attention as all the rows it holds
    together. At that share (recall_share) the token comes back, with its indexed neighbours,
    into every lane lacking each of them; below it, or for a token every lane holds, nothing."""
    recall = LaneRecall(KV_HEADS, capacity=8, share=1.0, span=2)
    d = HEAD_DIM
    keys = torch.zeros(LAYERS, KV_HEADS, 3, d)  # tokens 10, 11 (positions 1010, 1011) and 20 (1500)
    keys[0, 0, 2, 0] = 1.0  # token 20: lane 0 (layer 0, kv head 0) reads it
    keys[1, 1, 0, 1] = 1.0  # token 10: lane 3 (layer 1, kv head 1) reads it
    lookup = LaneLookup(1, False)
    lookup.evicted = ([10, 11, 20], [1010, 1011, 1500], [0, 0, 0], keys, keys.clone(),
                      {i: [0.0] * 4 for i in (10, 11, 20)})
    recall.adopt(lookup)
    log_norm = torch.full((LAYERS, 2 * KV_HEADS), 5.0)  # an unread token gets exp(-5): nothing

    def look(share_20: float, share_10: float, held: list[list[int]]) -> LaneLookup:
        query = torch.zeros(LAYERS, 2 * KV_HEADS, d)  # 2 query heads per kv head, both alike
        query[0, :2, 0] = 5.0 + torch.tensor(share_20).log()
        query[1, 2:, 1] = 5.0 + torch.tensor(share_10).log()
        padded = numpy.array([ids + [-1] * (2 - len(ids)) for ids in held])  # -1: no token
        return recall.look_lanes(view_with_query(query, log_norm, 2000), padded, room=4)

    nobody = [[], [], [], []]
    assert look(share_20=0.9, share_10=1e-6, held=nobody).back == []  # below: nothing comes back
    assert look(share_20=1e-6, share_10=3.0, held=[[10, 11]] * 4).back == []  # every lane holds it
    back = look(share_20=1e-6, share_10=1.5, held=[[10], [10], [], []])
    # into the lanes lacking each: 10 into lanes 2 and 3, its neighbour 11 into all four
    assert back.back == [10, 11] and back.lanes == {10: [2, 3], 11: [0, 1, 2, 3]}

    # a lane's share is the mean over its query heads: one head above the share is not enough
    def look_heads(first: float, second: float) -> LaneLookup:
        query = torch.zeros(LAYERS, 2 * KV_HEADS, d)
        query[0, 0, 0], query[0, 1, 0] = 5.0 + math.log(first), 5.0 + math.log(second)  # lane 0's two heads
        return recall.look_lanes(view_with_query(query, log_norm, 2000), numpy.full((4, 1), -1), room=4)

    assert look_heads(1.5, 1e-6).back == []  # mean 0.75
    assert look_heads(1.5, 0.6).back == [20]  # mean 1.05 (its indexed neighbours are 500 positions away)


def test_the_cooldowns_stay_bounded_without_being_rewalked_while_they_run():
    """Each restore starts a cooldown per (token, lane). Expired ones are forgotten once the
    map has grown, but while most are still running the map is walked again only when it has
    doubled: a fixed threshold walked it on every tick (0.84 ms a tick in a long run). Every
    cooldown still running is kept, so what may come back is decided as before."""
    cooldown, lanes = 100, [0, 1, 2, 3]
    recall = LaneRecall(KV_HEADS, capacity=4, cooldown=cooldown)
    walks, largest = 0, 0
    for tick in range(1, 401):
        lookup = LaneLookup(recall.clock + 1, False)
        lookup.back, lookup.lanes = [tick], {tick: lanes}  # one token back into every lane each tick
        before = recall.lane_back_at
        recall.adopt(lookup)
        walks += recall.lane_back_at is not before
        largest = max(largest, len(recall.lane_back_at))
        running = {(i, lane) for i in range(max(1, tick - cooldown + 1), tick + 1) for lane in lanes}
        assert running <= set(recall.lane_back_at)
    assert walks <= 10  # 8 -> 16 -> ... -> 512, then about once per cooldown
    assert largest <= 2 * len(lanes) * cooldown + len(lanes)


def test_a_saved_block_carries_its_digest_and_only_the_blocks_written_since_are_hashed(monkeypatch):
    """A session names each block by its sha256; a block the ring has not written into since the
    last save keeps the digest it had, so a save hashes only what changed. A stale digest would
    name a blob by the wrong content (the session could not be resumed): every one is checked."""
    import hashlib

    from positronic.policies import recall as shared

    monkeypatch.setattr(lane_recall, "BLOCK", 4)
    generator = torch.Generator().manual_seed(3)
    recall = LaneRecall(KV_HEADS, capacity=10)  # blocks of slots 0-3, 4-7, 8-9
    hashed = []
    real = hashlib.sha256

    def counted(data=b""):
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(shared.hashlib, "sha256", counted)

    def check(state) -> None:
        for name in ("keys", "values"):
            for piece in state["ring"][name]:
                assert isinstance(piece, bytes) and piece.sha256 == real(piece).hexdigest()

    leaving(recall, 0, 6, generator)
    check(recall.state())
    assert len(hashed) == 4  # two blocks, keys and values
    for first, count, blocks in ((6, 1, 1), (7, 2, 2), (9, 4, 2), (13, 1, 1), (14, 0, 0)):
        if count:
            leaving(recall, first, count, generator)  # 9..12 wraps: slots 9, 0, 1, 2
        hashed.clear()
        saved = recall.state()
        check(saved)
        assert len(hashed) == 2 * blocks, f"tokens {first}..{first + count - 1}"
    resumed = LaneRecall(KV_HEADS, capacity=10)
    resumed.load_state(saved)
    hashed.clear()
    check(resumed.state())  # a ring taken back hashes its blocks afresh
    assert len(hashed) == 6


def test_what_comes_back_with_a_match_is_mostly_the_text_after_it():
    """A question names a fact's subject and the fact follows it ("the number for KEY is
    48213" matches at KEY): of the tokens indexed around the match, those after it come back
    first, those before it at seven times their distance (`reach`), within `span`."""
    recall = LaneRecall(KV_HEADS, capacity=64, share=1.0, span=16)
    keys = torch.zeros(LAYERS, KV_HEADS, 41, HEAD_DIM)  # tokens 100..140 at positions 1100..1140
    keys[0, 0, 20, 0] = 1.0  # lane 0 reads token 120
    lookup = LaneLookup(1, False)
    lookup.evicted = (list(range(100, 141)), list(range(1100, 1141)), [0] * 41, keys, keys.clone(),
                      {i: [0.0] * 4 for i in range(100, 141)})
    recall.adopt(lookup)
    query = torch.zeros(LAYERS, 2 * KV_HEADS, HEAD_DIM)
    query[0, :2, 0] = 5.0 + math.log(2.0)  # both of lane 0's heads: twice what its rows get
    back = recall.look_lanes(view_with_query(query, torch.full((LAYERS, 2 * KV_HEADS), 5.0), 2000),
                             numpy.full((4, 1), -1), room=16).back
    # the match, 13 after it and 2 before it, nearest first (equal reaches: the earlier first)
    assert back == [120, 121, 122, 123, 124, 125, 126, 119, 127, 128, 129, 130, 131, 132, 133, 118]
    assert lane_recall.reach(numpy.array([-2, -1, 0, 3])).tolist() == [14, 7, 0, 3]
    assert lane_recall.reach(torch.tensor([-2, 5])).tolist() == [14, 5]


def test_the_ring_grows_until_it_holds_its_capacity_and_keeps_every_token_as_it_was():
    """The index doubles its slots as tokens come (a short run never holds `capacity` tokens'
    K/V), the tokens lying in order in them, and stops at `capacity`, then overwrites the oldest."""
    generator = torch.Generator().manual_seed(4)
    recall = LaneRecall(KV_HEADS, capacity=300)
    keys, values = leaving(recall, 0, 3, generator)
    assert recall.keys.shape[3] == recall.values.shape[2] == lane_recall.BLOCK  # not 300
    more = [leaving(recall, first, 50, generator) for first in range(3, 253, 50)]  # 253 tokens in all
    assert recall.keys.shape[3] == 256
    keys = torch.cat([keys] + [k for k, _ in more], dim=2)
    values = torch.cat([values] + [v for _, v in more], dim=2)
    ids, _, _, kept_keys, kept_values = recall._rows()
    assert ids == list(range(253)) and torch.equal(kept_keys, keys) and torch.equal(kept_values, values)
    later = leaving(recall, 253, 100, generator)  # past the capacity: the oldest 53 go
    assert recall.keys.shape[3] == 300 and len(recall.ids) == 300
    ids, _, _, kept_keys, _ = recall._rows()
    assert ids == list(range(53, 353))
    assert torch.equal(kept_keys, torch.cat([keys[:, :, 53:], later[0]], dim=2))
    saved = recall.state()
    resumed = LaneRecall(KV_HEADS, capacity=300)
    resumed.load_state(saved)
    assert resumed.ids == recall.ids and torch.equal(resumed._rows()[3], kept_keys)
    full = recall.keys
    leaving(recall, 353, 1, generator)
    assert recall.keys is full and recall.ids[recall.next - 1] == 353  # written in place, never copied again

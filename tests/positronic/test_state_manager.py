"""Step 4: coupled edits on the real embedded model and on tiny random Llamas."""

import random

import pytest
import torch
from action_lists import apply_to_list, random_actions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirror as mirror_pkg
from positronic.actions import ActionError
from positronic.forward import fresh_layer0_kv
from positronic.kv_store import PreallocatedStore
from positronic.state_manager import StateManager

STORES = ["dynamic", "preallocated"]


@pytest.fixture(params=STORES)
def store(request):
    """Every Step 4 test runs on each KV store backend."""
    return request.param


PROMPT = "The old lighthouse keeper climbed the spiral stairs every night, counting each step as the storm grew louder."


def prompt_ids(lm, text=PROMPT):
    return [lm.bos_id] + lm.encode(text)


def fresh_logits(lm, token_ids, positions):
    """Next-token logits of one plain forward over the tokens at the given positions,
    written without any of the project's forward code."""
    n = len(token_ids)
    mask = torch.full((n, n), torch.finfo(lm.dtype).min).triu(1)[None, None]
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([token_ids]), position_ids=torch.tensor([positions]),
                       attention_mask=mask, use_cache=False)
    return out.logits[0].float()


def assert_layer0_exact(sm, atol):
    keys, values = sm.store.layer(0)
    fresh_keys, fresh_values = fresh_layer0_kv(sm.lm, sm.live_token_ids(), sm.positions())
    torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=atol)
    torch.testing.assert_close(values, fresh_values, rtol=0, atol=atol)


def snapshot(sm):
    """Everything Step 4 may change, copied."""
    tensors = [tuple(t.clone() for t in sm.store.layer(i)) for i in range(sm.store.num_layers)]
    return sm.live_token_ids(), sm.positions(), tensors, mirror_pkg.to_bytes(sm.mirror)


# --- 1. layer-0 exactness on SmolLM2 --------------------------------------------------------


def test_layer0_matches_fresh_prefill_after_random_edits(smol, store):
    rng = random.Random(1)
    sm = StateManager.from_tokens(smol, prompt_ids(smol), store=store)
    expected = sm.live_token_ids()
    edge_lists = [
        [{"action": "delete", "position": 0}],
        [{"action": "replace_pair", "original_pos1": 0, "original_pos2": 1, "new_token_ids": [42, 43, 44]}],
        [{"action": "delete", "position": len(sm) - 1}, {"action": "add", "token_id": 7}],
    ]
    for round_ in range(14):
        actions = edge_lists[round_] if round_ < len(edge_lists) else random_actions(rng, len(sm), smol.vocab_size)
        if round_ == 3:  # the last two rows, replaced by three tokens
            n = len(sm)
            actions = [{"action": "replace_pair", "original_pos1": n - 2, "original_pos2": n - 1,
                        "new_token_ids": [100, 200, 300]}]
        report = sm.apply(actions)
        assert not report.rebuilt, report.error
        expected = apply_to_list(expected, actions)
        assert sm.live_token_ids() == expected
        sm.check()
        assert_layer0_exact(sm, atol=1e-4)
    assert sm.rotated_rows > 0, "the edits should have needed at least one re-rotation"


# --- 2. incremental decode parity (seed 001) ------------------------------------------------


def test_incremental_decode_matches_one_forward(smol, store):
    token_ids = prompt_ids(smol)[:24]
    sm = StateManager.from_tokens(smol, token_ids[:1], store=store)
    incremental = [sm.next_logits]
    for token_id in token_ids[1:]:
        sm.append([token_id])
        incremental.append(sm.next_logits)
    full = fresh_logits(smol, token_ids, list(range(len(token_ids))))
    incremental = torch.stack(incremental)
    ratio = (incremental - full).abs().max() / full.abs().max()
    assert ratio <= 1e-5, f"max |dlogit| / max |logit| = {ratio:.2e}"


def test_store_refuses_a_block_of_the_wrong_shape(tiny, store):
    sm = StateManager.from_tokens(tiny, [1, 2, 3, 4], store=store)
    keys, values = sm.store.layer(0)
    good = torch.zeros(tiny.num_layers, 1, tiny.num_kv_heads, 2, tiny.head_dim)
    bad_head_dim = torch.zeros(tiny.num_layers, 1, tiny.num_kv_heads, 2, tiny.head_dim + 1)
    with pytest.raises(ValueError, match=r"keys have shape \[2, 1, 2, 2, 17\].*takes \[2, 1, 2, n, 16\]"):
        sm.store.insert(1, bad_head_dim, good)
    with pytest.raises(ValueError, match="2 new key rows but 3 value rows"):
        sm.store.insert(1, good, torch.zeros(tiny.num_layers, 1, tiny.num_kv_heads, 3, tiny.head_dim))
    assert torch.equal(sm.store.layer(0)[0], keys) and len(sm.store) == 4


def test_preallocated_store_edits_in_place_reports_memory_and_resets(tiny):
    sm = StateManager.from_tokens(tiny, list(range(1, 41)), store="preallocated")
    store = sm.store
    row_bytes = 2 * tiny.num_layers * tiny.num_kv_heads * tiny.head_dim * 4  # K and V, float32
    assert store.memory_usage_mb() == pytest.approx(store.capacity * row_bytes / 2**20)
    sm.apply([{"action": "replace_pair", "original_pos1": 10, "original_pos2": 11, "new_token_ids": [7]},
              {"action": "delete", "position": 3}, {"action": "add", "token_id": 9}])
    buffer, scratch = store.buffer, store.scratch
    assert scratch is not None, "an overlapping row move keeps its scratch buffer"
    assert store.memory_usage_mb() == pytest.approx(2 * store.capacity * row_bytes / 2**20)
    for _ in range(5):  # steady state: edits and appends never reallocate
        sm.apply([{"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": [8]},
                  {"action": "add", "token_id": 11}])
    assert store.buffer is buffer and store.scratch is scratch
    sm.check(deep=True)
    store.reset()
    assert len(store) == 0 and store.buffer is buffer
    sm.rebuild()  # the emptied buffer is filled again in place, and matches the mirror
    assert store.buffer is buffer and len(store) == len(sm.mirror.live.ledger_ids)
    sm.check(deep=True)


def test_preallocated_store_moving_either_side_and_packing_down_matches_the_reference(tiny):
    """Edits near the front move the rows before them (the start shifts), appends that reach
    the end of a small buffer pack the rows down to row 0, and through all of it the store
    holds exactly what the reference store holds."""
    rng = random.Random(11)
    ids = [rng.randrange(tiny.vocab_size) for _ in range(30)]
    small = StateManager(tiny, PreallocatedStore(tiny.num_layers, capacity=48), mirror_pkg.Mirror(), store_kind="preallocated")
    small.append(ids, source="prompt")
    reference = StateManager.from_tokens(tiny, ids, store="dynamic")
    starts, packs = set(), 0
    for _ in range(60):
        actions = random_actions(rng, len(reference), tiny.vocab_size, keep_first=1,
                                 adds=(1, 3) if len(reference) < 40 else (0, 1))
        start_before = small.store.start
        for sm in (small, reference):
            assert not sm.apply(actions).rebuilt
        starts.add(small.store.start)
        packs += small.store.start == 0 and start_before > 0 and len(small) > 20
        assert small.live_token_ids() == reference.live_token_ids() and small.positions() == reference.positions()
        for index in range(tiny.num_layers):
            for ours, theirs in zip(small.store.layer(index), reference.store.layer(index)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert max(starts) >= 3, "front edits should have moved the start"
    assert packs >= 1, "appends at the end of the buffer should have packed the rows down"
    assert small.store.buffer.shape[3] == 48, "packing down, not growing, while the rows fit"
    small.check(deep=True)


# --- 3. rebuild -----------------------------------------------------------------------------


def test_rebuild_equals_fresh_prefill_at_recorded_positions(smol, store):
    rng = random.Random(3)
    sm = StateManager.from_tokens(smol, prompt_ids(smol), store=store)
    for _ in range(5):
        sm.apply(random_actions(rng, len(sm), smol.vocab_size, adds=(1, 1)))
    assert sm.positions() != list(range(len(sm))), "edits should leave gaps in the positions"
    spliced = sm.next_logits
    sm.rebuild()
    sm.check(deep=True)
    fresh = fresh_logits(smol, sm.live_token_ids(), sm.positions())[-1]
    torch.testing.assert_close(sm.next_logits, fresh, rtol=0, atol=1e-4)
    # splicing keeps the traces of replaced tokens in deeper layers: close, not equal
    kl = torch.nn.functional.kl_div(spliced.log_softmax(-1), fresh.log_softmax(-1), log_target=True,
                                    reduction="sum")
    assert 0 < kl.item() < 5.0


# --- 4. property test against a plain list --------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), start=st.integers(1, 12), rounds=st.integers(1, 8))
def test_random_action_lists_match_a_list_model(tiny, store, seed, start, rounds):
    rng = random.Random(seed)
    expected = [rng.randrange(tiny.vocab_size) for _ in range(start)]
    sm = StateManager.from_tokens(tiny, expected, store=store)
    for _ in range(rounds):
        actions = random_actions(rng, len(sm), tiny.vocab_size, max_new=4)
        report = sm.apply(actions)
        assert not report.rebuilt, report.error
        expected = apply_to_list(expected, actions)
        assert sm.live_token_ids() == expected
        sm.check(deep=True)


# --- 5. bad input changes nothing -----------------------------------------------------------

BAD_LISTS = [
    ({"action": "add", "token_id": 1}, "action list must be a list"),
    (["add"], "action 0: must be a dict"),
    ([{"action": "insert", "position": 1}], r"action 0 \(insert\): unknown action 'insert'"),
    ([{"action": "add", "token_id": 1, "why": "x"}], r"action 0 \(add\): unknown key\(s\) why"),
    ([{"action": "delete"}], r"action 0 \(delete\): missing key\(s\) position"),
    ([{"action": "delete", "position": "3"}], "position must be an int, got str"),
    ([{"action": "delete", "position": True}], "position must be an int, got bool"),
    ([{"action": "delete", "position": 2.0}], "position must be an int, got float"),
    ([{"action": "delete", "position": -1}], r"position=-1 is out of range 0\.\.9"),
    ([{"action": "delete", "position": 10}], r"position=10 is out of range 0\.\.9"),
    ([{"action": "delete", "position": 3}, {"action": "delete", "position": 3}],
     r"action 1 \(delete\): position=3 is already edited by action 0"),
    ([{"action": "delete", "position": 4},
      {"action": "replace_pair", "original_pos1": 3, "original_pos2": 4, "new_token_ids": [5]}],
     r"action 1 \(replace_pair\): original_pos2=4 is already edited by action 0"),
    ([{"action": "replace_pair", "original_pos1": 5, "original_pos2": 4, "new_token_ids": [5]}],
     "original_pos1=5 must be below original_pos2=4"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 4, "new_token_ids": [5]}],
     "original_pos1=4 must be below original_pos2=4"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": []}],
     "new_token_ids must be a non-empty list"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": 7}],
     "new_token_ids must be a non-empty list"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [3, 512]}],
     r"new_token_ids item=512 is outside the vocabulary 0\.\.511"),
    ([{"action": "add", "token_id": -2}], "token_id=-2 is outside the vocabulary"),
    ([{"action": "add", "token_id": False}], "token_id must be an int, got bool"),
    ([{"action": "delete", "position": i} for i in range(10)], "would leave the context empty"),
    ([{"action": "add", "token_id": 1}] * 503, "beyond the model's 512"),
    # a valid action before the bad one must not have been applied either
    ([{"action": "add", "token_id": 9}, {"action": "delete", "position": 99}], r"action 1 \(delete\)"),
]


@pytest.mark.parametrize("actions, message", BAD_LISTS, ids=[m for _, m in BAD_LISTS])
def test_bad_action_list_is_refused_and_changes_nothing(tiny, store, actions, message):
    sm = StateManager.from_tokens(tiny, list(range(1, 11)), store=store)
    sm.apply([{"action": "delete", "position": 2}, {"action": "add", "token_id": 77}])  # some history
    before = snapshot(sm)
    with pytest.raises(ActionError, match=message):
        sm.apply(actions)
    after = snapshot(sm)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(torch.equal(a, b) for la, lb in zip(after[2], before[2]) for a, b in zip(la, lb))


# --- 6. fault injection ---------------------------------------------------------------------

TICK = [
    {"action": "replace_pair", "original_pos1": 20, "original_pos2": 21, "new_token_ids": [11, 12, 13]},
    {"action": "delete", "position": 9},
    {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [14]},
    {"action": "add", "token_id": 15},
]


# The coupled edits TICK makes, in order: the 3-for-2 replacement at 20 needs room, so the
# rows from 20 on are re-rotated (an edit that changes no ids) before the insert.
TICK_EDITS = [("delete", 21), ("delete", 20), ("rotate",), ("insert", 20, [11, 12, 13]), ("delete", 9),
              ("delete", 5), ("delete", 4), ("insert", 4, [14]), ("insert", None, [15])]


def ids_after_edits(ids, count):
    ids = list(ids)
    for edit in TICK_EDITS[:count]:
        if edit[0] == "delete":
            del ids[edit[1]]
        elif edit[0] == "insert":
            row = len(ids) if edit[1] is None else edit[1]
            ids[row:row] = edit[2]
    return ids


@pytest.mark.parametrize("mid_edit", [False, True], ids=["between-edits", "between-blades"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 8, 9])
def test_fault_mid_tick_rebuilds_a_consistent_state(tiny, store, k, mid_edit):
    rng = random.Random(k)
    sm = StateManager.from_tokens(tiny, [rng.randrange(512) for _ in range(30)], store=store)
    before = sm.live_token_ids()
    assert ids_after_edits(before, len(TICK_EDITS)) == apply_to_list(before, TICK)
    sm.inject_fault(k, mid_edit=mid_edit)
    report = sm.apply(TICK)
    assert report.rebuilt and "InjectedFault" in report.error
    sm.check(deep=True)
    # the mirror holds exactly the edits that completed; a half-done edit counts for nothing
    assert sm.live_token_ids() == ids_after_edits(before, k - 1 if mid_edit else k)
    # every layer equals a cache computed from scratch from the mirror
    fresh = StateManager.from_mirror(tiny, mirror_pkg.from_bytes(mirror_pkg.to_bytes(sm.mirror))[0], store=store)
    for i in range(tiny.num_layers):
        for a, b in zip(sm.store.layer(i), fresh.store.layer(i)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert sm.next_logits is not None and sm.rebuilds == 1


# --- 7. drift under long runs in float16 ----------------------------------------------------


def test_keys_stay_close_to_fresh_values_through_2000_edits(tiny_half, store):
    lm, rng = tiny_half, random.Random(7)
    sm = StateManager.from_tokens(lm, [rng.randrange(lm.vocab_size) for _ in range(40)], store=store)
    edits_seen = {}  # ledger id -> coupled edits made while it was live
    while sm.edits < 2000:
        length = len(sm)
        actions = random_actions(rng, length, lm.vocab_size, keep_first=4, adds=(1, 3) if length < 40 else (0, 1))
        before = list(sm.mirror.live.ledger_ids)
        report = sm.apply(actions)
        assert not report.rebuilt, report.error
        for ledger_id in before:
            edits_seen[ledger_id] = edits_seen.get(ledger_id, 0) + report.edits
    assert sm.rotated_rows > 200, "the run must exercise re-rotation"
    keys, _ = sm.store.layer(0)
    fresh, _ = fresh_layer0_kv(lm, sm.live_token_ids(), sm.positions())
    error = (keys.float() - fresh.float()).abs().amax(dim=(0, 1, 3))  # per row
    scale = fresh.float().abs().max()
    lived = torch.tensor([edits_seen.get(i, 0) for i in sm.mirror.live.ledger_ids])
    assert lived.max() >= 2000, "the sink rows lived through the whole run"
    tolerance = 4e-3 * scale
    assert error.max() <= tolerance, f"worst key error {error.max():.2e} > {tolerance:.2e}"
    old, young = error[lived >= 1000], error[lived < 100]
    assert old.max() <= tolerance and young.max() <= tolerance

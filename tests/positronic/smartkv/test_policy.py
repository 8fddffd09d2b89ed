"""--policy smartkv in the brain: per-layer rows through the tick loop, Step 4, sessions and the view.

The reference for what the brain keeps is SmartKVCache (tested on its own against plain
transformers in test_cache.py): the same gates and layout must keep the same rows in every
layer and give the same logits. The logits are also checked against a plain DynamicCache that
holds, per layer, exactly the rows the brain's mirror says that layer holds.
"""

import random

import pytest
import torch
from transformers import DynamicCache

from positronic.brain import session as sessions
from positronic.state.actions import ActionError
from positronic.brain.loop import Brain, BrainConfig
from positronic.mirror import from_bytes, to_bytes
from positronic.smartkv import GateSet, SmartKVCache
from positronic.smartkv.policy import SmartKVPolicy
from positronic.state import FAULT_STAGES, StateManager
from positronic.tui.render import frame
from positronic.tui.snapshot import take_snapshot
from positronic.models import with_cache

SINKS, WINDOW, BUDGET = 3, 6, 20  # memory: 11 rows per layer


def scaled_gates(lm, path, *, seed: int, per_head: bool = False):
    """Untrained gates score within ~0.01 of each other; scaled up to the spread of trained ones
    (~1) and with a short lifespan horizon, both the scores and the tokens' ages decide what
    memory keeps within these tests' few dozen tokens."""
    gates = GateSet.for_config(lm.model.config, seed=seed, per_head=per_head, header={"lifespan": {"horizon": 48}})
    with torch.no_grad():
        for gate in gates.gates:
            last = [m for m in gate.modules() if isinstance(m, torch.nn.Linear)][-1]
            last.weight.mul_(100.0)
            last.bias.mul_(100.0)
    gates.save(path)
    return path


@pytest.fixture(scope="module")
def gate_file(tiny, tmp_path_factory):
    return scaled_gates(tiny, tmp_path_factory.mktemp("gates") / "tiny.safetensors", seed=21)


@pytest.fixture(scope="module")
def head_gate_file(tiny, tmp_path_factory):
    """Per-head gates (an output per kv head)."""
    return scaled_gates(tiny, tmp_path_factory.mktemp("gates") / "tiny_heads.safetensors", seed=22, per_head=True)


@pytest.fixture(params=["per layer", "per head"])
def any_gate_file(request):
    """Each of the two kinds of gates: rows per layer, rows per kv head."""
    return request.getfixturevalue("gate_file" if request.param == "per layer" else "head_gate_file")


def config(gate_file, **changes) -> BrainConfig:
    base = dict(policy="smartkv", budget=BUDGET, sinks=SINKS, window=WINDOW, gates=str(gate_file))
    return BrainConfig(**(base | changes))


def text_ids(lm, count, seed=0):
    rng = random.Random(seed)
    return [lm.bos_id] + [rng.randrange(3, min(lm.vocab_size, 259)) for _ in range(count - 1)]


def layer_positions(state: StateManager) -> list[list[int]]:
    """Per lane (a layer, or with per-head rows a kv head of a layer), the positions it holds."""
    return [state.mirror.layer_positions(lane) for lane in range(state.lanes)]


class Reference:
    """Plain transformers over exactly the rows each layer holds: K/V of every position so far
    (the prompt from one prefill, each later token as the reference itself computed it),
    gathered per layer for each step."""

    def __init__(self, lm, prompt: list[int]):
        self.lm = lm
        full = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            lm.model(torch.tensor([prompt]), **with_cache(full), use_cache=True)
        self.store = [(layer.keys, layer.values) for layer in full.layers]

    def step(self, kept: list[list[int]], token: int, position: int) -> torch.Tensor:
        """Logits of `token` at `position` attending to positions kept[l] in lane l (a layer, or
        one kv head of a layer: lane = layer * kv_heads + head), plus itself."""
        cache = DynamicCache(config=self.lm.model.config)
        heads = len(kept) // len(self.store)
        for layer, (keys, values) in enumerate(self.store):
            lanes = kept[layer * heads : (layer + 1) * heads]
            rows = torch.tensor(lanes)[:, None].expand(-1, keys.shape[1] // heads, -1).reshape(keys.shape[1], -1)
            index = rows[None, :, :, None].expand(1, -1, -1, keys.shape[3])  # each kv head its lane's rows
            cache.update(keys.gather(2, index), values.gather(2, index), layer)
        with torch.no_grad():
            logits = self.lm.model(torch.tensor([[token]]), **with_cache(cache), use_cache=True,
                                   position_ids=torch.tensor([[position]])).logits[0, -1]
        for layer, (keys, values) in enumerate(self.store):
            new = cache.layers[layer]
            self.store[layer] = (torch.cat([keys, new.keys[:, :, -1:]], 2), torch.cat([values, new.values[:, :, -1:]], 2))
        return logits


def test_the_brain_keeps_what_smartkv_cache_keeps_and_predicts_the_same(tiny, gate_file):
    ids = text_ids(tiny, 70, seed=3)
    prompt = 15
    brain = Brain.start(tiny, ids[:prompt], config(gate_file))
    gates = GateSet.load(gate_file)
    cache = SmartKVCache(tiny.model.config, gates, sinks=SINKS, budget=BUDGET - SINKS - WINDOW, window=WINDOW)
    reference = Reference(tiny, ids[:prompt])
    with torch.no_grad():
        first = tiny.model(torch.tensor([ids[:prompt]]), **with_cache(cache), use_cache=True).logits[0, -1]
    torch.testing.assert_close(brain.state.next_logits, first, atol=1e-4, rtol=1e-4)
    differ = False
    for n in range(prompt, len(ids) - 1):
        record = brain.step(force=ids[n])
        assert not record.rebuilt and record.live_length == min(n + 1, BUDGET) <= BUDGET
        with torch.no_grad():
            logits = tiny.model(torch.tensor([[ids[n]]]), **with_cache(cache), use_cache=True).logits[0, -1]
        kept = layer_positions(brain.state)
        for layer in range(tiny.num_layers):
            assert kept[layer] == sorted(cache.positions(layer).tolist()), f"layer {layer} at token {n}"
        differ |= kept[0] != kept[1]
        torch.testing.assert_close(brain.state.next_logits, logits, atol=1e-4, rtol=1e-4)
        before = [[p for p in layer if p != n] for layer in kept]
        torch.testing.assert_close(brain.state.next_logits, reference.step(before, ids[n], n), atol=1e-4, rtol=1e-4)
        assert record.live_tokens == len(brain.state) == len(set(kept[0]) | set(kept[1]))
    assert differ, "the gates should make the layers keep different rows"
    brain.state.check(deep=True)
    assert brain.counts["culls"] == brain.state.mirror.ledger.count("culled") > 0


def test_a_prompt_longer_than_the_budget_is_pruned_per_layer(tiny, gate_file):
    ids = text_ids(tiny, 60, seed=4)
    brain = Brain.start(tiny, ids, config(gate_file))
    gates = GateSet.load(gate_file)
    cache = SmartKVCache(tiny.model.config, gates, sinks=SINKS, budget=BUDGET - SINKS - WINDOW, window=WINDOW,
                         prune="manual")
    with torch.no_grad():
        tiny.model(torch.tensor([ids[:-1]]), **with_cache(cache), use_cache=True)
        cache.bulk_prune()
        logits = tiny.model(torch.tensor([ids[-1:]]), **with_cache(cache), use_cache=True).logits[0, -1]
    assert brain.state.rows_per_layer == BUDGET and brain.tick == 0
    for layer in range(tiny.num_layers):
        assert layer_positions(brain.state)[layer] == sorted(cache.positions(layer).tolist())
    torch.testing.assert_close(brain.state.next_logits, logits, atol=1e-4, rtol=1e-4)
    brain.state.check(deep=True)


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_a_failed_per_layer_tick_changes_nothing(tiny, any_gate_file, stage):
    brain = Brain.start(tiny, text_ids(tiny, 40, seed=5), config(any_gate_file))
    for token in text_ids(tiny, 12, seed=6)[1:]:
        brain.step(force=token)
    mirror_before = to_bytes(brain.state.mirror)
    policy_before = brain.policy.state()
    brain.state.inject_fault(stage)
    record = brain.step(force=7)
    assert record.rebuilt and record.error
    assert to_bytes(brain.state.mirror) == mirror_before and brain.policy.state() == policy_before
    brain.state.check(deep=True)
    assert not brain.step(force=7).rebuilt
    brain.state.check(deep=True)


def resumed_midway(lm, settings, *, seed: int, path, before_resume=lambda: None):
    """The tokens of 40 uninterrupted ticks, and of 23 ticks, a save to `path`, and 17 ticks
    of the session resumed from it (after `before_resume()`), with the saved and the resumed
    brain. Asserts the resumed session holds the saved one's rows in every lane."""
    straight = Brain.start(lm, text_ids(lm, 25, seed=seed), settings)
    expected = [straight.step().token_id for _ in range(40)]
    brain = Brain.start(lm, text_ids(lm, 25, seed=seed), settings)
    got = [brain.step().token_id for _ in range(23)]
    sessions.save(path, brain, lm.name)
    before_resume()
    resumed = sessions.resume(lm, path)
    assert layer_positions(resumed.state) == layer_positions(brain.state)
    got += [resumed.step().token_id for _ in range(17)]
    return expected, got, brain, resumed


def test_a_resumed_session_goes_on_exactly(tiny, gate_file, tmp_path):
    expected, got, _, resumed = resumed_midway(tiny, config(gate_file, temperature=0.9), seed=8, path=tmp_path / "s")
    assert resumed.state.per_layer
    assert got == expected


def test_a_session_ranked_without_value_norms_resumes_without_them(tiny, gate_file, tmp_path, monkeypatch):
    """Sessions saved before scores added the value norms (their policy state has no
    "value_norms") go on ranking as they began, not with today's rule."""
    settings = config(gate_file, temperature=0.9)
    today = Brain.start(tiny, text_ids(tiny, 25, seed=8), settings)
    today_tokens = [today.step().token_id for _ in range(40)]
    monkeypatch.setattr(SmartKVPolicy, "value_norms", False)  # the code before value norms
    expected, got, brain, resumed = resumed_midway(tiny, settings, seed=8, path=tmp_path / "s",
                                                   before_resume=monkeypatch.undo)
    assert expected != today_tokens, "the value norms should change this stream"
    assert got == expected
    old_state = {name: value for name, value in brain.policy.state().items() if name != "value_norms"}
    resumed.policy.load_state(old_state)
    assert resumed.policy.value_norms is False
    with pytest.raises(ValueError, match="malformed saved state"):
        resumed.policy.load_state(old_state | {"value_norms": "yes"})


def test_the_mirror_file_keeps_the_layers(tiny, gate_file):
    brain = Brain.start(tiny, text_ids(tiny, 40, seed=9), config(gate_file))
    mirror, _ = from_bytes(to_bytes(brain.state.mirror))
    assert mirror.layers.rows == brain.state.mirror.layers.rows


def test_step4_refuses_what_a_per_layer_state_cannot_take(tiny, gate_file):
    brain = Brain.start(tiny, text_ids(tiny, 40, seed=10), config(gate_file))
    state, before = brain.state, to_bytes(brain.state.mirror)
    rows = state.rows_per_layer
    for actions, message in (
        ([{"action": "delete", "position": 5}], "add, drop, restore and reread actions only"),
        ([{"action": "drop", "rows": [[4], []]}], "as many rows"),
        ([{"action": "drop", "rows": [[rows]] * 2}], "out of range|rows must be ints"),
        ([{"action": "drop", "rows": [[4]]}], "one per layer"),
        ([{"action": "add", "token_id": 5}, {"action": "add", "token_id": 6}], "at most one token"),
    ):
        with pytest.raises(ActionError, match=message):
            state.apply(actions)
        assert to_bytes(state.mirror) == before
    plain = StateManager.from_tokens(tiny, text_ids(tiny, 10))
    with pytest.raises(ActionError, match="use delete"):
        plain.apply([{"action": "drop", "rows": [[1], [1]]}])


@pytest.mark.parametrize("changes,message", [
    ({"repairer": "bridge", "unit": 2}, "repairer"),
    ({"budget": SINKS + WINDOW + 4, "window": 20}, "budget|memory"),
    ({"gates": "/no/such/gates.safetensors"}, "does not exist"),
])
def test_settings_smartkv_cannot_run_with_are_refused(gate_file, changes, message):
    with pytest.raises(ValueError, match=message):
        config(gate_file, **changes).validate()


def test_gates_of_another_model_are_refused(tiny, gate_file, tmp_path):
    other = tmp_path / "other.safetensors"
    GateSet.new(3, 32).save(other)
    with pytest.raises(ValueError, match="this model has 2 layers"):
        Brain.start(tiny, text_ids(tiny, 10), config(gate_file, gates=str(other)))
    no_horizon = tmp_path / "no_horizon.safetensors"
    GateSet.for_config(tiny.model.config, header={"lifespan": {"horizon": 0}}).save(no_horizon)
    with pytest.raises(ValueError, match="smartkv: the gates' lifespan horizon must be a positive integer, got 0"):
        Brain.start(tiny, text_ids(tiny, 10), config(gate_file, gates=str(no_horizon)))
    with pytest.raises(ValueError, match="applies to policy smartkv"):
        BrainConfig(policy="h2o", gates=str(gate_file)).validate()


def test_the_live_view_shows_layers_per_token(tiny, gate_file):
    brain = Brain.start(tiny, text_ids(tiny, 30, seed=11), config(gate_file))
    for token in text_ids(tiny, 30, seed=12)[1:]:
        brain.step(force=token)
    snap = take_snapshot(brain, tiny, done=29, total=29)
    assert snap.measure == "layers" and snap.bright_max == tiny.num_layers
    mirror = brain.state.mirror
    assert snap.brightness == [float(c) for c in mirror.layers.occupancy(mirror.live.ledger_ids)]
    assert set(snap.brightness) == {1.0, 2.0}, "some tokens are held by one layer only"
    from rich.console import Console

    console = Console(width=100, height=30, record=True, color_system=None)
    console.print(frame(snap, 100, 30))
    screen = console.export_text()
    assert f"live {BUDGET}/{BUDGET}" in screen and f"tokens {len(brain.state)}" in screen
    assert "layers per token" in screen and "0..2 layers" in screen


def test_run_and_eval_commands_take_policy_smartkv(run_cli, gate_file, tmp_path, capsys):
    assert run_cli("-m", "random:tiny", "--policy", "smartkv", "--gates", str(gate_file), "-c", "24", "--window", "8", "-n", "40",
                   "--no-tui", "--no-input") == 0
    out = capsys.readouterr()
    assert "policy smartkv" in out.out and "/ budget 24 per layer" in out.out
    assert run_cli("eval", "-m", "random:tiny", "--policy", "smartkv", "--policy", "streaming", "--gates",
                   str(gate_file), "--budget", "48", "--max-tokens", "80", "--no-probe", "--out",
                   str(tmp_path / "e")) == 0
    assert "\nsmartkv,48," in (tmp_path / "e" / "results.csv").read_text()


def test_a_per_layer_tick_is_captured_and_replays_exactly(tiny, any_gate_file, tmp_path):
    from positronic.fixtures import capture_tick, load_fixture, replay, save_fixture

    brain = Brain.start(tiny, text_ids(tiny, 40, seed=13), config(any_gate_file))
    for token in text_ids(tiny, 10, seed=14)[1:]:
        brain.step(force=token)
    plan = brain.policy.plan(brain.state.view(keys=True), [], {})
    actions = plan.actions + [{"action": "add", "token_id": 9}]
    assert actions[0]["action"] == "drop" and len(actions[0]["rows"]) == brain.state.lanes  # 2 layers, or 2 x 2 heads
    fixture, report = capture_tick(brain.state, actions, label="smartkv")
    assert not report.rebuilt
    save_fixture(fixture, tmp_path / "t.pt")
    loaded = load_fixture(tmp_path / "t.pt")
    assert loaded.mirror_columns["layers"] == fixture.mirror_columns["layers"]
    result = replay(loaded, tiny)
    assert result.passed, result.failed()
    broken = load_fixture(tmp_path / "t.pt")
    broken.actions[0]["rows"][0] = broken.actions[0]["rows"][0][:-1] + [0]  # layer 0 drops a sink instead
    assert not replay(broken, tiny).passed


def test_a_server_session_keeps_per_layer_rows_and_resumes_from_disk(tiny, gate_file, tmp_path, live_server,
                                                                    server_settings, conversation):
    settings = server_settings(tmp_path, max_sessions=1)  # a second session checkpoints the first to disk
    with live_server(tiny, settings, config(gate_file, temperature=0.0, budget=96, window=16)) as server:
        client = server.client()
        conversation(client, "a", ["first turn", "second"], max_tokens=60)
        described = server.get("/v1/sessions/a").json()
        assert described["live_length"] == 96 and described["culled"] > 0  # rows per layer: the budget
        conversation(client, "b", ["b says hello"], max_tokens=4)
        assert (settings.session_dir / "a").is_dir(), "session a was checkpointed when b came in"
        reply = conversation(client, "a", ["third turn"], max_tokens=6)
        after = server.get("/v1/sessions/a").json()
    assert reply and after["tick"] > described["tick"] and after["live_length"] == 96


def test_a_rebuild_gives_each_layer_its_own_rows_of_a_fresh_union_prefill(tiny, gate_file):
    """rebuild() recomputes the union (every live token at its position) and each layer keeps
    its own rows: every layer's K/V equal a plain transformers prefill of the union gathered
    at that layer's rows (deep check looks at layer 0 only, so this is what guards the rest)."""
    brain = Brain.start(tiny, text_ids(tiny, 40, seed=15), config(gate_file))
    for token in text_ids(tiny, 30, seed=16)[1:]:
        brain.step(force=token)
    state = brain.state
    assert layer_positions(state)[0] != layer_positions(state)[1]
    state.rebuild()
    full = DynamicCache(config=tiny.model.config)
    with torch.no_grad():
        tiny.model(torch.tensor([state.live_token_ids()]), position_ids=torch.tensor([state.positions()]),
                   **with_cache(full), use_cache=True)
    for layer in range(tiny.num_layers):
        rows = torch.tensor(state.mirror.layer_rows_of(layer))
        keys, values = state.layer_kv(layer)
        torch.testing.assert_close(keys, full.layers[layer].keys[:, :, rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values, full.layers[layer].values[:, :, rows], atol=1e-4, rtol=1e-4)


# --- per-head rows: every kv head of every layer keeps its own rows ------------------------------

def test_per_head_gates_make_the_brain_keep_what_a_per_head_smartkv_cache_keeps(tiny, head_gate_file):
    ids = text_ids(tiny, 70, seed=23)
    prompt = 15
    heads = tiny.model.config.num_key_value_heads
    brain = Brain.start(tiny, ids[:prompt], config(head_gate_file))
    assert brain.state.lanes == tiny.num_layers * heads == 4
    gates = GateSet.load(head_gate_file)
    cache = SmartKVCache(tiny.model.config, gates, sinks=SINKS, budget=BUDGET - SINKS - WINDOW, window=WINDOW)
    reference = Reference(tiny, ids[:prompt])
    with torch.no_grad():
        tiny.model(torch.tensor([ids[:prompt]]), **with_cache(cache), use_cache=True)
    heads_differ = False
    for n in range(prompt, len(ids) - 1):
        record = brain.step(force=ids[n])
        assert not record.rebuilt and record.live_length == min(n + 1, BUDGET)
        with torch.no_grad():
            logits = tiny.model(torch.tensor([[ids[n]]]), **with_cache(cache), use_cache=True).logits[0, -1]
        kept = layer_positions(brain.state)
        for lane in range(brain.state.lanes):
            assert kept[lane] == sorted(cache.positions(lane // heads, lane % heads).tolist()), f"lane {lane} at {n}"
        heads_differ |= kept[0] != kept[1]
        torch.testing.assert_close(brain.state.next_logits, logits, atol=1e-4, rtol=1e-4)
        before = [[p for p in lane if p != n] for lane in kept]
        torch.testing.assert_close(brain.state.next_logits, reference.step(before, ids[n], n), atol=1e-4, rtol=1e-4)
    assert heads_differ, "per-head gates should make the kv heads of layer 0 keep different rows"
    brain.state.check(deep=True)
    snap = take_snapshot(brain, tiny, done=1, total=1)
    assert snap.measure == "kv heads" and snap.bright_max == 4


def test_a_per_head_session_resumes_exactly_and_a_rebuild_gives_each_head_its_rows(tiny, head_gate_file, gate_file,
                                                                                  tmp_path):
    expected, got, _, resumed = resumed_midway(tiny, config(head_gate_file, temperature=0.9), seed=26,
                                               path=tmp_path / "s")
    assert resumed.state.lanes == 4
    assert got == expected
    with pytest.raises(ValueError, match="per-layer and per-head rows cannot be swapped"):
        Brain(resumed.state, config(gate_file, temperature=0.9), tick=resumed.tick)  # per-layer gates on per-head rows
    state = resumed.state
    state.rebuild()
    full = DynamicCache(config=tiny.model.config)
    with torch.no_grad():
        tiny.model(torch.tensor([state.live_token_ids()]), position_ids=torch.tensor([state.positions()]),
                   **with_cache(full), use_cache=True)
    for lane in range(state.lanes):
        layer, head = divmod(lane, 2)
        rows = torch.tensor(state.mirror.layer_rows_of(lane))
        keys, values = state.layer_kv(layer)
        torch.testing.assert_close(keys[:, head], full.layers[layer].keys[:, head, rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values[:, head], full.layers[layer].values[:, head, rows], atol=1e-4, rtol=1e-4)


def test_a_run_past_the_position_limit_packs_every_lane(tiny, any_gate_file):
    """Past the model's positions the union is packed down and every lane re-rotates its own
    keys (per head: each kv head its own tokens); layer 0 then still equals a fresh prefill."""
    brain = Brain.start(tiny, text_ids(tiny, 20, seed=27), config(any_gate_file))
    for token in text_ids(tiny, tiny.max_positions + 20, seed=28)[1:]:
        assert not brain.step(force=token).rebuilt
    assert max(brain.state.positions()) < tiny.max_positions < brain.tick
    brain.state.check(deep=True)

"""The lean forward (positronic/models/lean.py): a Llama model's forward without the library's
scaffolding gives the library forward's bits (logits, every layer's rows, the recorded
attention) on every weight format, for a lone brain's prompts and ticks, a batched forward and
Core v4's rounds; and steps aside wherever that is not so by construction (another family, a
subclass, a hook, several tokens without a mask)."""

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.batch.engine import Engine
from positronic.models import lean as leans
from positronic.models import load_model
from positronic.state import StateManager

WEIGHTS = ["float32", "int8", "int8-weight-only", "int4", "bfloat16"]


@pytest.fixture(scope="module", params=WEIGHTS)
def llama(request):
    return load_model("random:llama3", device="cpu", dtype="float32", weights=request.param)


@pytest.fixture
def calls(monkeypatch):
    """How many forwards the lean one ran (it runs as it would)."""
    counted = []
    original = leans.LeanLlama.__call__

    def counting(self, *args, **kwargs):
        counted.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(leans.LeanLlama, "__call__", counting)
    return counted


def library_only(monkeypatch):
    monkeypatch.setattr(leans, "lean_forward", lambda model: None)


def ticks(lm, ids, start):
    """A state of `ids[:start]`, then the rest appended one at a time: each tick's logits and
    attention row, and every layer's rows at the end."""
    state = StateManager.from_tokens(lm, ids[:start])
    seen = []
    for token in ids[start:]:
        state.append([token])
        seen.append((state.next_logits.clone(), state.last_attention.clone()))
    return seen, [state.layer_kv(layer) for layer in range(lm.num_layers)]


def test_a_prompt_and_its_ticks_are_the_library_forwards_bits(llama, calls, monkeypatch):
    ids = [llama.bos_id] + [(7 * i) % 250 + 3 for i in range(40)]
    lean, lean_rows = ticks(llama, ids, 10)
    assert len(calls) == 1 + len(ids) - 10, "the prompt (under its mask) and every tick: the lean forward runs"
    library_only(monkeypatch)
    library, library_rows = ticks(llama, ids, 10)
    assert len(calls) == 1 + len(ids) - 10
    for (logits, row), (want_logits, want_row) in zip(lean, library):
        assert torch.equal(logits, want_logits)
        assert torch.equal(row, want_row)
    for (keys, values), (want_keys, want_values) in zip(lean_rows, library_rows):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_a_brain_past_its_budget_makes_the_library_forwards_run(calls, monkeypatch):
    """Evicting every tick (spliced rows, gaps in the positions, the attention row scoring every
    row): tokens, live rows and positions as with the library's forward. (A model of its own:
    the session's shared one may carry another test's hooks, and then rightly takes the library's.)"""
    tiny = load_model("random:tiny", device="cpu", dtype="float32")
    def run():
        brain = Brain.start(tiny, [1] + list(range(40, 110)), BrainConfig(budget=64, temperature=0.0))
        tokens = [brain.step().token_id for _ in range(40)]
        return tokens, brain.state.live_token_ids(), brain.state.positions()

    lean = run()
    assert len(calls) >= 40
    library_only(monkeypatch)
    assert run() == lean


@pytest.mark.parametrize("name", ["random:qwen3", "random:phi3", "random:mistral"])
def test_other_families_take_the_librarys_forward(name):
    assert leans.lean_forward(load_model(name, device="cpu", dtype="float32").model) is None


def test_a_hook_on_a_skipped_module_or_a_subclass_takes_the_librarys_forward(calls):
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    assert leans.lean_forward(lm.model) is not None
    fired = []
    handle = lm.model.model.layers[0].register_forward_hook(lambda *args: fired.append(1))
    try:
        assert leans.lean_forward(lm.model) is None
        StateManager.from_tokens(lm, [1, 5, 6]).append([7])
        assert len(fired) == 2 and not calls, "the hook ran: the library's forward took the prompt and the tick"
    finally:
        handle.remove()
    assert leans.lean_forward(lm.model) is not None
    lm.model.forward = lambda *args, **kwargs: pytest.fail("not the model's forward")
    assert leans.lean_forward(lm.model) is None, "a forward put on the model (a fault injected) is the library's"
    del lm.model.forward
    assert leans.lean_forward(lm.model) is not None
    mlp = lm.model.model.layers[1].mlp
    kind = type(mlp)
    mlp.__class__ = type("Patched", (kind,), {})
    try:
        assert not leans.LeanLlama.fits(lm.model)
    finally:
        mlp.__class__ = kind


def test_core_v4_rounds_are_the_library_forwards_bits(calls, monkeypatch):
    """Three sequences in one state (a mask per slot, Decode rows), evicting: the same tokens and
    every slot's rows."""
    tiny = load_model("random:tiny", device="cpu", dtype="float32")
    def rounds():
        engine = Engine(tiny, slots=4, capacity=72)
        for key, start in (("a", 40), ("b", 90), ("c", 150)):
            engine.join(key, Brain.start(tiny, [1] + list(range(start, start + 50)),
                                         BrainConfig(policy="h2o", budget=64, temperature=0)))
        tokens = [engine.step() for _ in range(25)]
        return tokens, engine.state.kv.keys.clone(), engine.state.kv.values.clone()

    lean = rounds()
    assert len(calls) >= 25
    library_only(monkeypatch)
    library = rounds()
    assert lean[0] == library[0]
    assert torch.equal(lean[1], library[1]) and torch.equal(lean[2], library[2])


def test_several_tokens_without_a_mask_are_refused():
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="4D mask"):
        leans.lean_forward(lm.model)(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), None)

"""The lean decode forward (positronic/models/decode.py): one token through a Llama model without
the library's scaffolding gives the library forward's bits (logits, every layer's new row, the
recorded attention) on every weight format, and steps aside wherever that is not so by
construction (another family, a subclass, a hook, a mask, several tokens)."""

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.models import decode, load_model
from positronic.state import StateManager
from positronic.state import forward as forwards

WEIGHTS = ["float32", "int8", "int4", "bfloat16"]


@pytest.fixture(scope="module", params=WEIGHTS)
def llama(request):
    return load_model("random:llama3", device="cpu", dtype="float32", weights=request.param)


@pytest.fixture
def calls(monkeypatch):
    """How many forwards the lean decoder ran (it runs as it would)."""
    counted = []
    original = decode.LlamaDecode.__call__

    def counting(self, *args):
        counted.append(1)
        return original(self, *args)

    monkeypatch.setattr(decode.LlamaDecode, "__call__", counting)
    return counted


def library_only(monkeypatch):
    monkeypatch.setattr(forwards, "lean_decoder", lambda model: None)


def ticks(lm, ids, start):
    """A state of `ids[:start]`, then the rest appended one at a time: each tick's logits and
    attention row, and every layer's rows at the end."""
    state = StateManager.from_tokens(lm, ids[:start])
    seen = []
    for token in ids[start:]:
        state.append([token])
        seen.append((state.next_logits.clone(), state.last_attention.clone()))
    return seen, [state.layer_kv(layer) for layer in range(lm.num_layers)]


def test_a_decode_tick_is_the_library_forwards_bits(llama, calls, monkeypatch):
    ids = [llama.bos_id] + [(7 * i) % 250 + 3 for i in range(40)]
    lean, lean_rows = ticks(llama, ids, 10)
    assert len(calls) == len(ids) - 10, "every tick after the prompt is one token: the lean forward runs"
    library_only(monkeypatch)
    library, library_rows = ticks(llama, ids, 10)
    assert len(calls) == len(ids) - 10
    for (logits, row), (want_logits, want_row) in zip(lean, library):
        assert torch.equal(logits, want_logits)
        assert torch.equal(row, want_row)
    for (keys, values), (want_keys, want_values) in zip(lean_rows, library_rows):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_a_brain_past_its_budget_makes_the_library_forwards_run(tiny, calls, monkeypatch):
    """Evicting every tick (spliced rows, gaps in the positions, the attention row scoring every
    row): tokens, live rows and positions as with the library's forward."""
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
    assert decode.lean_decoder(load_model(name, device="cpu", dtype="float32").model) is None


def test_a_hook_on_a_skipped_module_or_a_subclass_takes_the_librarys_forward(calls):
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    assert decode.lean_decoder(lm.model) is not None
    fired = []
    handle = lm.model.model.layers[0].register_forward_hook(lambda *args: fired.append(1))
    try:
        assert decode.lean_decoder(lm.model) is None
        StateManager.from_tokens(lm, [1, 5, 6]).append([7])
        assert fired and not calls, "the hook ran: the library's forward took the tick"
    finally:
        handle.remove()
    assert decode.lean_decoder(lm.model) is not None
    mlp = lm.model.model.layers[1].mlp
    kind = type(mlp)
    mlp.__class__ = type("Patched", (kind,), {})
    try:
        assert not decode.LlamaDecode.fits(lm.model)
    finally:
        mlp.__class__ = kind


def test_several_tokens_or_a_mask_take_the_librarys_forward(tiny, calls):
    state = StateManager.from_tokens(tiny, [1] + list(range(10, 30)))
    assert not calls, "a prompt is many tokens"
    state.append([40, 41])
    assert not calls
    state.append([42])
    assert len(calls) == 1

"""Each supported family, on its real transformers class with random weights (random:<family>,
positronic/models/random_models.py), spliced exactly: layer 0 equals a fresh prefill after
random edits; incremental decode equals one forward; a rebuild equals a plain transformers
prefill in every layer; the attention row equals eager attention; sessions resume token for
token; every policy, recall, pins and the 4-bit formats run; SmartKV gates train on it.

The tiny configs are held to the real models' published configs in everything splicing
depends on (the last test). The references are plain transformers (DynamicCache, eager
attention), none of the project's forward code.
"""

import os
import random

import pytest
import torch
import transformers
from transformers import DynamicCache

from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.models import FAMILY_SHAPES, load_model, random_config, with_cache
from positronic.policies import POLICIES
from positronic.smartkv import GateSet
from positronic.state import StateManager
from positronic.batch import forward_many
from positronic.kv.cache import SpliceCache
from positronic.state.forward import forward, fresh_layer0_kv, prefill, prepare

LONG = bool(os.environ.get("POSITRONIC_LONG_TESTS"))  # the long form (docs/development.md)
FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "phi3"]
CLASSES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """A tiny random model of one family (float32 on the CPU)."""
    lm = load_model(f"random:{request.param}", device="cpu", dtype="float32")
    assert type(lm.model).__name__ == CLASSES[request.param]
    return lm


def prompt(lm, count=40, seed=0):
    rng = random.Random(seed)
    return [lm.bos_id] + [rng.randrange(3, 259) for _ in range(count - 1)]


def random_actions(rng, length, vocab, keep_first=1):
    """Deletes, pair replacements (1-3 new tokens) and adds on distinct rows; never row 0."""
    rows, taken, actions = list(range(keep_first, length - 1)), set(), []
    rng.shuffle(rows)
    for row in rows[: rng.randint(1, 4)]:
        if {row, row + 1} & taken:
            continue
        if rng.random() < 0.5:
            taken |= {row, row + 1}
            actions.append({"action": "replace_pair", "original_pos1": row, "original_pos2": row + 1,
                            "new_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]})
        else:
            taken.add(row)
            actions.append({"action": "delete", "position": row})
    return actions + [{"action": "add", "token_id": rng.randrange(3, vocab)} for _ in range(rng.randint(1, 2))]


def prefill_kv(lm, token_ids, positions):
    """Every layer's K/V [1, kv_heads, rows, head_dim] and the logits [rows, vocab] of one plain
    transformers forward of the tokens at those positions into a DynamicCache, causal by row."""
    n = len(token_ids)
    mask = torch.full((n, n), torch.finfo(lm.dtype).min).triu(1)[None, None]
    cache = DynamicCache()  # no config: a sliding-window model's would keep only its window
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([token_ids]), position_ids=torch.tensor([positions]),
                       attention_mask=mask, **with_cache(cache), use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers], out.logits[0].float()


def test_layer0_equals_a_fresh_prefill_after_random_edits(family):
    rng = random.Random(5)
    sm = StateManager.from_tokens(family, prompt(family))
    for tick in range(1, 16):
        report = sm.apply(random_actions(rng, len(sm), 259), tick=tick)
        assert not report.rebuilt, report.error
        sm.check(deep=True)
        expected, _ = prefill_kv(family, sm.live_token_ids(), sm.positions())
        keys, values = expected[0]
        got_keys, got_values = sm.layer_kv(0)
        torch.testing.assert_close(got_keys, keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_values, values, rtol=0, atol=1e-5)
    assert sm.positions() != list(range(len(sm))), "the edits should leave gaps in the positions"


def test_layer0_kv_from_the_first_layers_attention_alone_is_a_fresh_prefills(family):
    # what checks a deep check and every recalled row: the norm and attention of layer 0, its MLP not run
    ids = prompt(family, 12)
    positions = [0, 1, 2, 7, 8, 9, 30, 31, 32, 33, 90, 91]
    (want_keys, want_values), *_ = prefill_kv(family, ids, positions)[0]
    keys, values = fresh_layer0_kv(family, ids, positions)
    torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)


def test_incremental_decode_equals_one_forward(family):
    ids = prompt(family, 32)
    sm = StateManager.from_tokens(family, ids[:1])
    incremental = [sm.next_logits]
    for token_id in ids[1:]:
        sm.append([token_id])
        incremental.append(sm.next_logits)
    _, full = prefill_kv(family, ids, list(range(len(ids))))
    ratio = (torch.stack(incremental) - full).abs().max() / full.abs().max()
    assert ratio <= 1e-5, f"max |dlogit| / max |logit| = {ratio:.2e}"


def test_a_batched_forward_gives_each_sequence_its_alone_numbers_bit_for_bit(family):
    """Three sequences in one forward (one feeding three rows): logits and the K/V written are
    exactly those of each forward alone, in every family (its biases, fused projections)."""
    prompts = [prompt(family, 17, seed=1), prompt(family, 9, seed=2), prompt(family, 30, seed=3)]
    feeds = [[21], [60, 61, 62], [131]]
    parts, alone, caches = [], [], []
    for text, feed in zip(prompts, feeds):
        pair = []
        for _ in range(2):
            cache = SpliceCache(family.model.config, max_cache_len=64)
            prefill(family, cache, text, list(range(len(text))))
            pair.append(cache)
        positions = list(range(len(text), len(text) + len(feed)))
        keys = list(range(len(text))) + positions
        parts.append(prepare(family, pair[0], feed, positions, keys))
        alone.append(forward(family, pair[1], feed, positions, keys))
        caches.append(pair)
    for got, want, (shared, solo) in zip(forward_many(family, parts), alone, caches):
        assert torch.equal(got.logits, want.logits)
        for layer, other in zip(shared.layers, solo.layers):
            assert torch.equal(layer.keys, other.keys) and torch.equal(layer.values, other.values)


def test_a_rebuild_is_a_plain_prefill_in_every_layer_and_the_attention_row_is_eager_attentions(family):
    rng = random.Random(7)
    layers = list(range(family.num_layers))
    sm = StateManager.from_tokens(family, prompt(family), score_layers=layers)
    for tick in range(1, 6):
        sm.apply(random_actions(rng, len(sm), 259), tick=tick)
    sm.rebuild()
    sm.check(deep=True)
    expected, logits = prefill_kv(family, sm.live_token_ids(), sm.positions())
    for index, (keys, values) in enumerate(expected):
        got_keys, got_values = sm.layer_kv(index)
        torch.testing.assert_close(got_keys, keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_values, values, rtol=0, atol=1e-5)
    torch.testing.assert_close(sm.next_logits, logits[-1], rtol=0, atol=1e-4)
    ids, positions, n = sm.live_token_ids(), sm.positions(), len(sm)
    causal = torch.full((n, n), torch.finfo(family.dtype).min).triu(1)[None, None]
    model, previous = family.model, family.model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                        attention_mask=causal, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    eager = torch.stack([out.attentions[i][0, :, -1] for i in layers]).float()
    torch.testing.assert_close(sm.last_attention, eager, rtol=0, atol=1e-5)


def test_a_session_saves_and_resumes_token_for_token(family, tmp_path):
    config = BrainConfig(budget=48, policy="h2o", temperature=0.8, seed=11, recall=True)
    ids = prompt(family, 30)

    def stream(brain, ticks):
        return [(r.token_id, r.actions) for r in (brain.step() for _ in range(ticks))]
    straight = stream(Brain.start(family, ids, config), 50)
    brain = Brain.start(family, ids, config)
    first = stream(brain, 29)
    sessions.save(tmp_path, brain, family.name)
    resumed = sessions.resume(family, tmp_path)
    assert first + stream(resumed, 21) == straight
    assert any(a["action"] != "add" for _, actions in straight for a in actions), "the run must edit"


def gates_for(lm, path):
    gates = GateSet.for_config(lm.model.config, seed=3, per_head=True, header={"lifespan": {"horizon": 48}})
    gates.save(path)
    return str(path)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_past_its_budget(family, policy, tmp_path):
    """80 ticks past a full budget (200 with POSITRONIC_LONG_TESTS=1; always 200 on random:phi3,
    whose 255 positions then run out: rows are re-rotated into room), consistent every tick and
    exact against a fresh layer 0 at the end."""
    ticks = 200 if LONG or family.max_positions < 30 + 200 else 80
    extra = {"gates": gates_for(family, tmp_path / "gates.safetensors")} if policy == "smartkv" else {}
    at_capacity = "shift" if policy == "none" else "stop"
    config = BrainConfig(policy=policy, budget=48, sinks=4, at_capacity=at_capacity, seed=2, **extra)
    brain = Brain.start(family, prompt(family, 30), config)
    for _ in range(ticks):
        record = brain.step()
        assert not record.rebuilt and not record.stopped, record
        assert record.live_length <= 48
        brain.state.check()
    brain.state.check(deep=True)
    assert brain.state.mirror.ledger.count("culled") + brain.state.mirror.ledger.count("replaced") > ticks // 2
    if family.max_positions < 30 + ticks:  # random:phi3: its window's 255 positions ran out
        assert brain.state.rotated_rows > 0 and max(brain.state.positions()) < family.max_positions


@pytest.mark.parametrize("setting", ["recall", "pins", "int4h", "int4", "ring"])
def test_recall_pins_and_the_cache_formats_run(family, setting):
    config = {"recall": dict(policy="streaming", recall=True), "pins": dict(policy="brightness"),
              "int4h": dict(policy="streaming", kv_format="int4h"), "int4": dict(policy="h2o", kv_format="int4"),
              "ring": dict(policy="streaming", kv_store="ring")}[setting]
    text = family.encode("filler words and more filler, the code is 4817, then filler again " * 2)
    pins = ["4817"] if setting == "pins" else ()
    brain = Brain.start(family, [family.bos_id] + text, BrainConfig(budget=64, seed=4, **config), pins=pins)
    ledger = brain.state.mirror.ledger
    pinned = [i for i, entry in enumerate(ledger.entries) if entry.pinned]
    assert len(pinned) == (8 if pins else 0)
    for _ in range(120):
        record = brain.step()
        assert not record.rebuilt, record
        assert all(ledger[i].state == "live" for i in pinned)
    brain.state.check(deep=True)
    if setting == "recall":
        assert brain.state.mirror.ledger.count("culled") > 0


def test_smartkv_gates_train_on_the_family(family, tmp_path, run_cli):
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    held = tmp_path / "b.txt"
    held.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 8)
    out = tmp_path / "gates.safetensors"
    code = run_cli("smartkv", "train", "--model", family.name, "--text", str(text), "--heldout", str(held),
                   "--out", str(out), "--per-head", "--window", "96", "--horizon", "32", "--hidden", "16",
                   "--epochs", "1", "--threads", "1",
                   "--threshold", "1")  # random weights attend near uniformly: a lower bar tells rows apart
    assert code == 0
    gates = GateSet.load(out)
    gates.check_model(family.model.config)
    brain = Brain.start(family, prompt(family, 30), BrainConfig(policy="smartkv", budget=40, gates=str(out)))
    for _ in range(30):
        assert not brain.step().rebuilt
    brain.state.check(deep=True)


# What the real models publish (their config.json on the Hugging Face hub), in everything that
# splicing depends on. The tiny random configs must agree; sizes (layers, width, vocab) are scaled.
PUBLISHED = {
    "llama3": dict(model="meta-llama/Llama-3.2-1B", model_type="llama", num_attention_heads=32,
                   num_key_value_heads=8, hidden_size=2048, head_dim=64, attention_bias=False,
                   rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   tie_word_embeddings=True, sliding_window=None, qk_norm=False),
    "qwen2": dict(model="Qwen/Qwen2.5-0.5B-Instruct", model_type="qwen2", num_attention_heads=14,
                  num_key_value_heads=2, hidden_size=896, head_dim=64, attention_bias=True,
                  rope={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
                  sliding_window=None, qk_norm=False),  # use_sliding_window false
    "qwen3": dict(model="Qwen/Qwen3-0.6B", model_type="qwen3", num_attention_heads=16, num_key_value_heads=8,
                  hidden_size=1024, head_dim=128, attention_bias=False,
                  rope={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
                  sliding_window=None, qk_norm=True),
    "mistral": dict(model="mistralai/Mistral-7B-Instruct-v0.3", model_type="mistral", num_attention_heads=32,
                    num_key_value_heads=8, hidden_size=4096, head_dim=128, attention_bias=False,
                    rope={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                    sliding_window=None, qk_norm=False),
    "phi3": dict(model="microsoft/Phi-3-medium-4k-instruct", model_type="phi3", num_attention_heads=40,
                 num_key_value_heads=10, hidden_size=5120, head_dim=128, attention_bias=False,
                 rope={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                 sliding_window=2047, max_position_embeddings=4096, qk_norm=False),
}


def _facts(config, model) -> dict:
    attention = model.model.layers[0].self_attn
    rope = dict(config.rope_parameters)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return dict(
        model_type=config.model_type,
        gqa=heads // kv,
        head_dim_is_width_over_heads=(getattr(config, "head_dim", None) or config.hidden_size // heads)
        == config.hidden_size // heads,
        biases=any(name.endswith("bias") for name, _ in attention.named_parameters()),
        qk_norm=hasattr(attention, "q_norm") and hasattr(attention, "k_norm"),
        rope={k: v for k, v in rope.items() if k != "partial_rotary_factor" and v is not None},
        tie_word_embeddings=config.tie_word_embeddings,
        window_ratio=None if getattr(config, "sliding_window", None) is None
        else config.sliding_window / config.max_position_embeddings)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_tiny_config_matches_its_real_model_in_what_splicing_depends_on(name):
    real = PUBLISHED[name]
    assert FAMILY_SHAPES[name][1] == real["model"]
    tiny = random_config(name)
    model = transformers.AutoModelForCausalLM.from_config(tiny)
    facts = _facts(tiny, model)
    assert facts["model_type"] == real["model_type"]
    assert facts["gqa"] == real["num_attention_heads"] // real["num_key_value_heads"]
    assert facts["head_dim_is_width_over_heads"] == (real["head_dim"] == real["hidden_size"] // real["num_attention_heads"])
    assert facts["biases"] == real["attention_bias"]
    assert facts["qk_norm"] == real["qk_norm"]
    assert facts["rope"] == real["rope"]
    assert facts["tie_word_embeddings"] == real["tie_word_embeddings"]
    real_ratio = None if real["sliding_window"] is None else real["sliding_window"] / real["max_position_embeddings"]
    assert facts["window_ratio"] == pytest.approx(real_ratio, abs=0.01) if real_ratio else facts["window_ratio"] is None


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_server_chats_with_the_models_own_template_and_continues_a_session(name, tmp_path, live_server,
                                                                                server_settings):
    """A family model whose tokenizer has a chat template (ChatML, as Qwen's): the server writes
    the conversation with it and a session's second turn continues the first."""
    from positronic.brain.chat import ChatFormat

    lm = load_model(f"random:{name}", device="cpu", dtype="float32")
    lm.tokenizer.chat_template = CHATML
    written = lm.decode(ChatFormat(lm).conversation([{"role": "user", "content": "hi"}]))
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in written
    with live_server(lm, server_settings(tmp_path)) as server:
        client, history = server.client(), []
        for text in ("hello there", "and again"):
            history.append({"role": "user", "content": text})
            reply = client.chat.completions.create(model=lm.name, messages=history, max_tokens=6, user="s1")
            assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert reply.usage.prompt_tokens > 0

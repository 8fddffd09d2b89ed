"""The default policy: SmartKV where gates exist for the model, brightness otherwise."""

from positronic.brain.config import BrainConfig
from positronic.brain.defaults import default_policy


def test_a_model_with_shipped_gates_gets_smartkv_with_recall_and_recent_use_unless_recall_is_turned_off():
    choice = default_policy("smollm2", BrainConfig(budget=256))
    assert (choice.policy, choice.recall) == ("smartkv", True)
    assert "policy smartkv with recall, its memory ranked by recent use too (--memory-rank recent): the best measured" in choice.note
    off = default_policy("smollm2", BrainConfig(budget=256), recall=False)
    assert (off.policy, off.recall) == ("smartkv", False) and "--no-recall" in off.note
    assert default_policy("smollm2", BrainConfig(budget=256), recall=True).recall is True


def test_a_model_without_gates_keeps_a_gate_free_policy_and_is_told_how_to_train_gates():
    choice = default_policy("random:tiny", BrainConfig(budget=256))
    assert (choice.policy, choice.recall) == ("brightness", False)
    assert "positronic smartkv train --model random:tiny" in choice.note and "--gates" in choice.note
    assert default_policy("random:tiny", BrainConfig(budget=256), recall=True).recall is True


def test_gates_given_make_smartkv_the_default_for_any_model():
    """Even where SmartKV then cannot run: the gates asked for it, so its error is shown, not hidden
    behind another policy."""
    assert default_policy("random:tiny", BrainConfig(budget=256, gates="g.safetensors")).policy == "smartkv"


def test_settings_smartkv_cannot_take_keep_the_gate_free_default_and_say_why():
    for settings, reason in [({"repairer": "bridge", "unit": 2}, "repairer"), ({"kv_store": "ring"}, "ring store")]:
        choice = default_policy("smollm2", BrainConfig(budget=256, **settings))
        assert choice.policy == "brightness" and reason in choice.note, settings


def test_a_4bit_cache_keeps_the_best_memory_by_default():
    """SmartKV keeps each lane's rows in any kv_format: asking for 4-bit rows is no reason to
    fall back to a gate-free policy."""
    for kv_format in ("int4h", "int4", "fp4"):
        choice = default_policy("smollm2", BrainConfig(budget=256, kv_format=kv_format))
        assert (choice.policy, choice.recall) == ("smartkv", True), kv_format

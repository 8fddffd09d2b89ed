"""Settings: typed parts define the defaults and their own checks; BrainConfig is the flat record
sessions save, and its validate() holds every rule that ties parts together
(positronic/brain/config.py)."""

import dataclasses
import re

import pytest

from positronic.brain.config import (BUDGET, PARTS, Brightness, BrainConfig, ContextShift, Memory, Repair, Sampling,
                                     SmartKVGates)


def test_every_field_of_the_record_is_defined_by_exactly_one_part_with_the_same_default():
    """One place for defaults: the record's defaults are the parts' (policy and its press's own
    options aside, which name the part that applies), and no setting belongs to two parts."""
    owners: dict[str, type] = {}
    for part in PARTS:
        for field in dataclasses.fields(part):
            assert field.name not in owners, f"{field.name} is in {owners.get(field.name)} and {part}"
            owners[field.name] = part
    record = {field.name: field.default for field in dataclasses.fields(BrainConfig)}
    assert set(record) - set(owners) == {"policy", "policy_options"}
    assert set(owners) <= set(record)
    for name, part in owners.items():
        assert record[name] == next(f.default for f in dataclasses.fields(part) if f.name == name), name
    assert BrainConfig().budget == BUDGET


def test_parts_read_the_record_and_are_frozen():
    config = BrainConfig(policy="streaming", budget=256, temperature=0.0, top_k=7, seed=3, repairer="none")
    assert config.sampling == Sampling(temperature=0.0, top_k=7, seed=3)
    assert config.memory.budget == 256 and config.memory.window == config.window
    assert config.repair == Repair()
    assert config.brightness_rule == Brightness()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sampling.temperature = 1.0  # a part is a snapshot; the record is what a run changes


def test_a_saved_flat_record_reads_back_unchanged():
    config = BrainConfig(policy="h2o", budget=96, sinks=2, window=20, top_p=0.5, kv_format="int4")
    assert BrainConfig(**dataclasses.asdict(config)) == config


@pytest.mark.parametrize("part, bad, message", [
    (Sampling, {"temperature": -1.0}, "temperature must be a finite number >= 0"),
    (Sampling, {"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    (Sampling, {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    (Sampling, {"repetition_penalty": float("inf")}, "repetition_penalty must be in [0.01, 100.0]"),
    (Sampling, {"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 100.0]"),
    (Sampling, {"seed": -1}, "seed must be in 0..2**63-1"),
    (Sampling, {"seed": 2**64}, "seed must be in 0..2**63-1"),
    (Sampling, {"top_p": 0.0}, "top_p must be in (0, 1]"),
    (Sampling, {"top_k": -1}, "top_k must be >= 0"),
    (Sampling, {"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 100.0]"),
    (Memory, {"sinks": -1, "window": 8}, "sinks must be >= 0"),
    (Memory, {"kv_format": "int3", "window": 8}, "int3"),
    (Memory, {"kv_store": "heap", "window": 8}, "heap"),
    (Brightness, {"brightness": "glow"}, "unknown brightness rule 'glow'"),
    (Brightness, {"ttl_gain": float("inf")}, "ttl_gain must be a finite number >= 0"),
    (Brightness, {"repair_batch": 0}, "repair_batch must be >= 1"),
    (Repair, {"repair_tokens": 17}, "repair_tokens must be in 1..16"),
    (Repair, {"repairer": "self", "repair_tokens": 2}, "the self repairer proposes exactly 1 token"),
    (ContextShift, {"at_capacity": "wrap"}, "at_capacity must be 'stop' or 'shift'"),
])
def test_each_part_refuses_its_own_bad_values_and_the_record_reports_them(part, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        part(**bad).check()
    with pytest.raises(ValueError, match=re.escape(message)):
        BrainConfig(**bad).validate()


@pytest.mark.parametrize("settings, message", [
    ({"policy": "h2o", "kv_store": "ring"}, "the ring store serves only the streaming policy"),
    ({"policy": "streaming", "kv_store": "ring", "kv_format": "int4"}, "the ring store keeps float rows"),
    ({"repairer": "self", "unit": 3}, "the self repairer replaces pairs: it needs unit 2"),
    ({"policy": "streaming", "gates": "g.safetensors"}, "--gates applies to policy smartkv"),
    ({"budget": 20, "window": 16}, "budget 20 leaves no room to cull"),
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"policy": "smartkv", "evict_every": 4}, "evict_every applies to the shared-row policies, not smartkv"),
    ({"policy": "none", "evict_every": 1}, "evict_every applies to the shared-row policies, not none"),
    ({"policy": "h2o", "budget": 64, "evict_every": 40}, "evict_every 40 frees more rows at once than policy h2o "
                                                         "can take at budget 64 \\(28 evictable rows\\)"),
    ({"policy": "brightness", "budget": 64, "window": 32, "evict_every": 29}, "evict_every 29 frees more rows"),
])
def test_rules_across_parts_are_checked_by_the_record(settings, message):
    with pytest.raises(ValueError, match=message):
        BrainConfig(**settings).validate()


def test_the_defaults_are_valid_and_smartkv_gates_default_to_the_shipped_ones():
    BrainConfig().validate()
    assert SmartKVGates().gates == ""


@pytest.mark.parametrize("settings, field, message", [
    ({"evict_every": -1}, "evict_every", "evict_every must be >= 0, got -1"),
    ({"policy": "smartkv", "evict_every": 2}, "evict_every", "evict_every applies to the shared-row policies"),
    ({"refresh_kl": float("nan")}, "refresh_kl", "refresh_kl must be a finite number >= 0, got nan"),
    ({"refresh_kl": float("inf")}, "refresh_kl", "refresh_kl must be a finite number >= 0, got inf"),
    ({"budget": 2**64 - 1}, "budget", "budget must be in -2**63..2**63-1"),  # was an OverflowError in a policy
    ({"protect": 2**63}, "protect", "protect must be in -2**63..2**63-1"),
    ({"budget": "64"}, "budget", "budget has the wrong type: '64'"),
    ({"recall": 1}, "recall", "recall has the wrong type: 1"),
    ({"top_k": True}, "top_k", "top_k has the wrong type: True"),  # a bool is no count
    ({"kv_format": "int3"}, "kv_format", "kv_format: unknown kv format 'int3'"),
    ({"policy": "smartkv", "gates": "/dev/null"}, "gates", "gates /dev/null: not a regular file (a character device)"),
    ({"policy": "smartkv", "gates": "/no/such.safetensors"}, "gates", "gates /no/such.safetensors does not exist"),
])
def test_validate_is_one_check_for_every_config_and_names_the_field(settings, field, message):
    """A new config and one read back from a session pass the same validate(): types, bounds
    (integers within int64, floats finite) and the parts' rules, each failure a ConfigError
    whose field says which setting, its message starting with the field's name."""
    from positronic.brain.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        BrainConfig(**settings).validate()
    assert caught.value.field == field and str(caught.value).startswith(field)


def test_the_model_dependent_checks_name_their_field(tiny):
    from positronic.brain.config import ConfigError, check_budget

    for settings, field in (({"budget": 2**40}, "budget"), ({"logit_bias": "600:1"}, "logit_bias")):
        with pytest.raises(ConfigError, match="random:tiny") as caught:
            check_budget(tiny, BrainConfig(**settings))
        assert caught.value.field == field


@pytest.mark.parametrize("policy", ["streaming", "h2o", "scored", "random", "knorm", "none"])
def test_a_window_the_policy_does_not_read_is_refused_not_ignored(policy):
    """Policies that keep llama.cpp's recent window (max(32, live length / 4)) never read the
    configured one: the library refuses a window given to them, as --window is refused, instead
    of running with another window than the one asked for. Their own default still validates,
    so a session saved before reads back."""
    from positronic.brain.config import ConfigError
    from positronic.policies import POLICIES

    with pytest.raises(ConfigError, match=f"policy {policy} .*leave the window out") as caught:
        BrainConfig(policy=policy, budget=128, window=8).validate()
    assert caught.value.field == "window"
    BrainConfig(policy=policy, budget=128).validate()
    BrainConfig(policy=policy, budget=128, window=POLICIES[policy].default_window(128)).validate()
    for reader in ("brightness", "smartkv"):
        assert BrainConfig(policy=reader, budget=128, window=8).validate() is None

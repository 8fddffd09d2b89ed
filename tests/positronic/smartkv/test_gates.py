"""Gates (positronic/smartkv/gates.py): one MLP per layer scoring keys, its safetensors file (round
trip, every kind of bad file refused), the shipped SmolLM2 gates, Spearman's rank correlation."""

import json

import pytest
import torch
from safetensors.torch import save_file

from positronic.smartkv import GateFileError, GateSet
from positronic.smartkv.gates import SHIPPED_SHARED, Gate, spearman


def rounded(gates: GateSet) -> GateSet:
    """The same gates with every tensor rounded to float16 (what a file stores)."""
    copy = GateSet.new(gates.num_layers, gates.in_dim, hidden=gates.gates[0].hidden, depth=gates.gates[0].depth,
                       heads=gates.heads, shared=gates.shared)
    for mine, theirs in zip(copy.gates, gates.gates):
        mine.load_state_dict({k: v.half().float() for k, v in theirs.state_dict().items()})
    return copy


@pytest.mark.parametrize("shared,heads", [(False, 1), (True, 1), (False, 2)])
def test_gate_file_round_trip(tmp_path, shared, heads):
    gates = GateSet.new(3, 32, hidden=16, depth=3, heads=heads, shared=shared, seed=1, header={"model": "random:tiny"})
    keys = torch.randn(50, 32)
    for gate in set(gates.gates):
        gate.set_normalisation(torch.randn(100, 32) * 3 + 1)
    path = tmp_path / "g.safetensors"
    gates.save(path)
    loaded = GateSet.load(path)
    assert loaded.num_layers == 3 and loaded.in_dim == 32 and loaded.shared == shared and loaded.heads == heads
    assert loaded.score(0, keys).shape == (50, heads)
    assert loaded.header["model"] == "random:tiny" and loaded.header["hidden"] == 16
    expected = rounded(gates)
    for l in range(3):
        torch.testing.assert_close(loaded.score(l, keys), expected.score(l, keys), atol=0, rtol=0)
        torch.testing.assert_close(loaded.score(l, keys), gates.score(l, keys), atol=0.02, rtol=0.01)
    loaded.save(tmp_path / "again.safetensors")
    again = GateSet.load(tmp_path / "again.safetensors")
    for a, b in zip(again.gates, loaded.gates):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name


def test_bad_gate_files_are_refused_with_a_clear_error(tmp_path):
    good = GateSet.new(2, 32, hidden=8, depth=2)
    good_path = tmp_path / "good.safetensors"
    good.save(good_path)
    from safetensors import safe_open

    with safe_open(str(good_path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(f.metadata()["smartkv"])

    def write(name, tensors, metadata):
        path = tmp_path / name
        save_file(tensors, str(path), metadata=metadata)
        return path

    pickle_path = tmp_path / "gates.pt"
    torch.save({"layers.0.mean": torch.zeros(32)}, pickle_path)
    cases = [
        (tmp_path / "missing.safetensors", "does not exist"),
        (pickle_path, "not a safetensors gate file"),
        (write("nohead.safetensors", tensors, {}), "no 'smartkv' header"),
        (write("notjson.safetensors", tensors, {"smartkv": "{oops"}), "not JSON"),
        (write("version.safetensors", tensors, {"smartkv": json.dumps(dict(header, format=7))}), "format 7"),
        (write("field.safetensors", tensors, {"smartkv": json.dumps(dict(header, hidden="8"))}), "'hidden'"),
        (write("shape.safetensors", dict(tensors, **{"layers.1.linear.0.weight": torch.zeros(8, 31)}),
               {"smartkv": json.dumps(header)}), r"layers.1.linear.0.weight has shape \[8, 31\], expected \[8, 32\]"),
        (write("fewer.safetensors", {k: v for k, v in tensors.items() if not k.startswith("layers.1.")},
               {"smartkv": json.dumps(header)}), "missing"),
        (write("extra.safetensors", dict(tensors, stray=torch.zeros(1)), {"smartkv": json.dumps(header)}), "unexpected"),
        (write("depth.safetensors", tensors, {"smartkv": json.dumps(dict(header, depth=3))}), "do not match the header"),
        (write("heads.safetensors", tensors, {"smartkv": json.dumps(dict(header, heads=2))}),
         r"linear.1.weight has shape \[1, 8\], expected \[2, 8\]"),  # an output per head the file lacks
        (write("noheads.safetensors", tensors, {"smartkv": json.dumps(dict(header, heads=0))}), "'heads'"),
        (write("nan.safetensors", dict(tensors, **{"layers.0.mean": torch.full((32,), float("nan"))}),
               {"smartkv": json.dumps(header)}), "not finite"),
    ]
    older = write("older.safetensors", tensors, {"smartkv": json.dumps({k: v for k, v in header.items() if k != "heads"})})
    assert GateSet.load(older).heads == 1, "a file from before per-head gates scores per layer"
    (tmp_path / "text.safetensors").write_text("not a tensor file at all")
    cases.append((tmp_path / "text.safetensors", "not a safetensors gate file"))
    for path, message in cases:
        with pytest.raises(GateFileError, match=message):
            GateSet.load(path)


@pytest.mark.smollm2
def test_shipped_gates_fit_smollm2_config():
    from positronic.models import smollm2_cache
    from transformers import AutoConfig

    gates = GateSet.for_model("smollm2")
    config = AutoConfig.from_pretrained(smollm2_cache(), local_files_only=True)
    gates.check_model(config)
    assert gates.header["lifespan"]["threshold"] > 0 and len(gates.header["heldout_spearman"]) == 30
    assert gates.heads == config.num_key_value_heads == 3, "the shipped gates score per kv head"
    assert GateSet.load(SHIPPED_SHARED["smollm2"]).heads == 3
    with pytest.raises(GateFileError, match="no gates are shipped"):
        GateSet.for_model("tinyllama")


def test_gate_scores_rank_keys():
    assert Gate(4, hidden=8, depth=2)(torch.randn(5, 4)).shape == (5, 1)
    assert Gate(4, hidden=8, depth=2, heads=3)(torch.randn(5, 4)).shape == (5, 3)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    # ties take their average rank: ranks (1.5, 1.5, 3) against (1, 2, 3)
    assert spearman(torch.tensor([0.0, 0, 1]), torch.tensor([1.0, 2, 3])) == pytest.approx(0.8660254, abs=1e-6)

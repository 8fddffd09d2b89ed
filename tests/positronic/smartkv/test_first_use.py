"""Gates trained on a model's first use (positronic/smartkv/first_use.py): trained once from the
package's text, kept, reused, trained again when the kept file is not this model's or is broken,
refused with the reason where the model's attention has nothing to learn; and `run`'s default
policy on them (docs/smartkv.md, "Gates on first use")."""

from __future__ import annotations

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.models import load_model
from positronic.smartkv import first_use
from positronic.smartkv.first_use import GateTrainingError, cache_path, fingerprint, gates_for, kept
from positronic.smartkv.gates import GateSet
from positronic.smartkv.train import TrainConfig
from positronic.texts import DEFAULT_TEXT

QUICK = dict(text=DEFAULT_TEXT.read_text(encoding="utf-8")[:3000], train=TrainConfig(epochs=2))


def attentive(name: str):
    """A random model whose attention prefers some tokens: its query and key projections x8
    (at their initial scale random weights attend almost uniformly: nothing to learn)."""
    lm = load_model(name, device="cpu", dtype="float32")
    with torch.no_grad():
        for layer in lm.model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                projection.weight.mul_(8)
    return lm


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gates"


@pytest.mark.parametrize("name", ["random:tiny", "random:qwen2"])
def test_gates_are_trained_once_kept_and_reused_by_a_smartkv_brain(name, cache):
    lm, lines = attentive(name), []
    path = gates_for(lm, log=lines.append, **QUICK)
    assert path.parent == cache and path == cache_path(lm) and len(lines) == 2
    assert "training them on alice_ch1-2.txt" in lines[0] and "held-out rank correlation" in lines[1]
    header = GateSet.load(path).header
    assert header["first_use"]["fingerprint"] == fingerprint(lm) and header["heldout_spearman"]
    assert min(header["heldout_spearman"]) > 0, "the gates rank the held-out tokens as their lifespans go"
    stamp, lines = path.stat().st_mtime_ns, []
    assert gates_for(lm, log=lines.append, **QUICK) == path and lines == [] and path.stat().st_mtime_ns == stamp
    assert not list(cache.glob(".*")), "no temporary file is left"
    config = BrainConfig(policy="smartkv", recall=True, gates="auto", budget=64, temperature=0)
    config.validate()
    brain = Brain.start(lm, [lm.bos_id] + list(range(10, 90)), config)  # "auto" finds the kept file
    assert brain.policy.gates.header["first_use"]["fingerprint"] == fingerprint(lm)
    assert max(brain.step().live_length for _ in range(10)) <= 64


def test_a_broken_or_foreign_kept_file_is_trained_again_not_trusted(cache):
    lm = attentive("random:tiny")
    path = gates_for(lm, log=lambda line: None, **QUICK)
    good = path.read_bytes()
    for broken in (good[: len(good) // 2], b"not a gate file"):
        path.write_bytes(broken)
        assert kept(lm, path)[0] is None and "unusable" in kept(lm, path)[1]
        lines = []
        assert gates_for(lm, log=lines.append, **QUICK) == path
        assert "the kept file is unusable" in lines[0] and kept(lm, path)[0] is not None
    foreign = GateSet.for_config(lm.model.config, per_head=True,
                                 header={"first_use": {"fingerprint": "0" * 16, "recipe": first_use.RECIPE}})
    foreign.save(path)
    lines = []
    gates_for(lm, log=lines.append, **QUICK)
    assert "made for other weights" in lines[0]
    assert GateSet.load(path).header["first_use"]["fingerprint"] == fingerprint(lm)


def test_a_cache_that_cannot_be_written_is_said_not_a_traceback(cache):
    lm = attentive("random:tiny")
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the folder should be")
    with pytest.raises(GateTrainingError, match="trained for random:tiny but not kept in"):
        gates_for(lm, log=lambda line: None, **QUICK)


def test_other_weights_under_the_same_name_get_their_own_gates():
    plain, sharper = load_model("random:tiny", device="cpu", dtype="float32"), attentive("random:tiny")
    assert plain.name == sharper.name and fingerprint(plain) != fingerprint(sharper)
    assert cache_path(plain) != cache_path(sharper) and fingerprint(plain) == fingerprint(
        load_model("random:tiny", device="cpu", dtype="float32"))


def test_a_model_with_nothing_to_learn_is_refused_with_the_reason_and_nothing_kept(cache):
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    with pytest.raises(GateTrainingError, match="attention tells no token from another"):
        gates_for(lm, log=lambda line: None, **QUICK)
    assert not cache.exists() or not list(cache.iterdir())


def test_run_defaults_to_smartkv_on_kept_gates_and_falls_back_with_the_reason(run_cli, monkeypatch, capsys, tmp_path):
    """A model without shipped gates: `run`'s default is SmartKV with recall on its gates kept
    from a first use (here written beforehand: training is tested above); where none can be
    trained it runs brightness and says why; `--gates auto` asked for explicitly stops instead."""
    monkeypatch.setattr("positronic.brain.defaults.trainable", lambda model: True)  # random weights, as a real model
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    common = ["-m", "random:tiny", "--budget", "64", "--ticks", "4", "--no-tui", "--temperature", "0"]
    assert run_cli(*common, "--events", str(tmp_path / "a.jsonl")) == 0
    err = capsys.readouterr().err
    assert "policy brightness" in err and "attention tells no token from another" in err
    path = cache_path(lm)
    GateSet.for_config(lm.model.config, per_head=True,
                       header={"first_use": {"fingerprint": fingerprint(lm), "recipe": first_use.RECIPE}}).save(path)
    assert run_cli(*common, "--session", str(tmp_path / "s")) == 0
    err = capsys.readouterr().err
    assert "policy smartkv with recall" in err and "gates trained for random:tiny on its first use" in err
    from positronic.brain import session as sessions

    resumed = sessions.resume(lm, tmp_path / "s")
    assert resumed.config.policy == "smartkv" and resumed.config.gates == str(path)
    path.unlink()
    assert run_cli(*common, "--policy", "smartkv", "--gates", "auto") == 2
    assert "--gates auto: gates: none could be trained for random:tiny" in capsys.readouterr().err


def test_press_default_uses_kept_gates_and_falls_back_with_the_reason(capsys):
    """`positronic.press` with its default policy on a user's own model: gates kept from a first
    use are used without training; where none can be trained (random weights) it generates with
    the gate-free default and says why on stderr."""
    from types import SimpleNamespace

    import transformers

    from positronic import press

    tiny = load_model("random:tiny", device="cpu", dtype="float32")
    config = transformers.LlamaConfig(**{k: v for k, v in tiny.model.config.to_dict().items()
                                         if k not in ("_attn_implementation", "attn_implementation")})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor([[tiny.bos_id] + list(range(10, 70))])
    with press(model, tiny.tokenizer, budget=48):
        fallback = model.generate(ids, max_new_tokens=6)
    err = capsys.readouterr().err
    assert "positronic.press: policy brightness" in err and "attention tells no token from another" in err
    own = SimpleNamespace(model=model, name=model.config._name_or_path or type(model).__name__)
    GateSet.for_config(model.config, per_head=True,
                       header={"first_use": {"fingerprint": fingerprint(own), "recipe": first_use.RECIPE}}
                       ).save(cache_path(own))
    with press(model, tiny.tokenizer, budget=48):
        smart = model.generate(ids, max_new_tokens=6)
    err = capsys.readouterr().err
    assert "positronic.press" not in err and "training" not in err, err
    assert fallback.shape == smart.shape == (1, ids.shape[1] + 6)


def test_eval_with_gates_auto_is_refused_before_any_run_where_none_can_be_trained(run_cli, capsys, tmp_path, eval_text):
    text = tmp_path / "t.txt"
    text.write_text(eval_text)
    out = tmp_path / "out"
    for mode in ((), ("--task", "needle", "--context", "256", "--instances", "1")):
        assert run_cli("eval", "-m", "random:tiny", "--text", str(text), "--policy", "smartkv", "--gates", "auto",
                       "--budget", "64", "--out", str(out), *(mode or ("--max-tokens", "80", "--no-probe"))) == 2
        err = capsys.readouterr().err
        assert "--gates auto: gates: none could be trained for random:tiny" in err and "ppl" not in err
        assert not out.exists() or not any(out.iterdir())

"""A policy written in one file (policies/pressed.py): a press registered by name ticks alone in a
Brain, in `run` and in `serve`, with its own settings from --policy-option, and saves and resumes
with its state. (That it makes the same tokens alone as in engine rounds, joining and leaving:
tests/positronic/batch/test_engine.py, whose presses include knorm, which has no policy of its own.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from positronic import presses
from positronic.brain import session as sessions
from positronic.brain.config import ConfigError
from positronic.brain.loop import Brain, BrainConfig
from positronic.policies import POLICIES
from positronic.policies.pressed import PressPolicy, policy_of
from positronic.presses import PRESSES, Press, Settings


@dataclass(frozen=True)
class StrideSettings(Settings):
    stride: int = 2  # rows at positions that are multiples of it go last

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"stride must be an int >= 1, got {self.stride!r}")


class StridePress(Press):
    """The oldest rows go first, but those at a multiple of `stride` only after every other."""

    name = "stride"
    Settings = StrideSettings

    def score(self, rows, state, clock):
        positions = rows.positions.to(torch.float64)
        return positions + (rows.positions % self.settings.stride == 0) * 1e9, {}


@pytest.fixture
def stride():
    """StridePress registered for one test, as `presses.register` (or an entry point) does it."""
    presses.register(StridePress)
    yield StridePress
    PRESSES.pop("stride"), POLICIES.pop("stride")


def keeps_the_stride(mirror, stride: int) -> bool:
    """The press's rule, read from the mirror: oldest first, rows at a multiple of `stride`
    only after every other, so no live row off the stride is older than an evicted one."""
    off = [e.position for e in mirror.ledger.entries if e.state == "culled" and e.position % stride]
    live = mirror.positions()
    return bool(off) and any(p % stride == 0 for p in live[4:]) and \
        all(p % stride == 0 for p in live[4:] if p < max(off))


def test_a_registered_press_is_a_policy_with_its_own_setting(tiny, stride):
    config = BrainConfig(policy="stride", policy_options="stride=3", budget=48, temperature=0)
    config.validate()
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), config)
    assert isinstance(brain.policy, PressPolicy) and brain.policy.press.settings.stride == 3
    records = [brain.step() for _ in range(80)]
    assert max(r.live_length for r in records) == 48 and any(len(r.actions) > 1 for r in records)
    assert keeps_the_stride(brain.state.mirror, 3) and not keeps_the_stride(brain.state.mirror, 2)
    for bad, field in (("stride=0", "stride must be an int >= 1"), ("width=2", "no setting 'width'"),
                       ("stride", "NAME=VALUE")):
        with pytest.raises(ConfigError, match=field):
            BrainConfig(policy="stride", policy_options=bad, budget=48).validate()


def test_run_takes_it_by_name_saves_it_and_resumes_it(tiny, stride, run_cli, tmp_path):
    common = ["-m", "random:tiny", "--policy", "stride", "--policy-option", "stride=4", "--budget", "48",
              "--temperature", "0", "--no-tui", "--session", str(tmp_path / "s"), "--prompt", "a b c d e f"]
    assert run_cli(*common, "--ticks", "60") == 0
    brain = sessions.resume(tiny, tmp_path / "s")
    assert brain.config.policy_options == "stride=4" and brain.tick == 60
    assert keeps_the_stride(brain.state.mirror, 4)
    assert run_cli("-m", "random:tiny", "--session", str(tmp_path / "s"), "--resume", "--ticks", "20", "--no-tui") == 0
    assert sessions.resume(tiny, tmp_path / "s").tick == 80
    assert run_cli(*common[:4], "--policy-option", "stride=x", "--ticks", "5", "--no-tui") == 2
    assert run_cli(*common[:4], "--window", "8", "--ticks", "5", "--no-tui") == 2, "its window is llama.cpp's"


def test_a_press_with_a_window_of_its_own_takes_window(tiny, run_cli, tmp_path):
    """--window reaches a press whose `window` reads it (as brightness's does)."""

    class Windowed(StridePress):
        name = "windowed"

        def window(self, length):
            return torch.full_like(length, self.settings.window if self.settings.window is not None else 32)

    presses.register(Windowed)
    try:
        events = tmp_path / "events.jsonl"
        assert run_cli("-m", "random:tiny", "--policy", "windowed", "--window", "8", "--budget", "48", "--ticks",
                       "60", "--no-tui", "--temperature", "0", "--events", str(events)) == 0
        brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), BrainConfig(policy="windowed", window=8,
                                                                                  budget=48))
        assert brain.policy.press.window_at(48) == 8
    finally:
        PRESSES.pop("windowed"), POLICIES.pop("windowed")


def test_the_server_runs_it(tiny, stride, live_server, server_settings, tmp_path):
    config = BrainConfig(policy="stride", policy_options="stride=5", budget=48, temperature=0)
    with live_server(tiny, server_settings(tmp_path), config) as server:
        assert server.get("/health").json()["policy"] == "stride"
        reply = server.client().chat.completions.create(
            model="random:tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=80, user="s")
        assert reply.usage.completion_tokens == 80
        brain = server.server.pool.loaded["s"].brain
        assert isinstance(brain.policy, PressPolicy) and len(brain.state.mirror) <= 48
        assert keeps_the_stride(brain.state.mirror, 5)
    assert sessions.resume(tiny, server.server.pool.path("s")).config.policy_options == "stride=5"


def test_saved_state_that_does_not_fit_is_refused_by_name(tiny):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 70)), BrainConfig(policy="knorm", budget=48))
    for _ in range(10):
        brain.step()
    state = brain.policy.state()
    other = Brain.start(tiny, [tiny.bos_id] + list(range(10, 70)), BrainConfig(policy="knorm", budget=48)).policy
    other.load_state(state)
    assert torch.equal(other.rows["norm"], brain.policy.rows["norm"]) and other.clock == brain.policy.clock == 10
    broken = state | {"rows": {"norm": state["rows"]["norm"] | {"data": b"\0" * 3}}}
    with pytest.raises(ValueError, match="saved 'norm' is not a torch.float64 tensor"):
        other.load_state(broken)
    with pytest.raises(ValueError, match="needs ids, clock, rows and sequence"):
        other.load_state({"ids": []})


def test_a_press_that_keeps_lanes_needs_a_policy_of_its_own(tiny):
    laned = type("Laned", (StridePress,), {"name": "laned", "lanes": 2})
    with pytest.raises(ValueError, match="press 'laned' keeps lanes"):
        policy_of(laned)(tiny, BrainConfig(policy="streaming", budget=48))
    with pytest.raises(ValueError, match="already registered"):
        presses.register(type("Other", (StridePress,), {"name": "h2o"}))


def test_eval_gives_its_settings_to_the_presses_in_the_sweep(tiny, stride, run_cli, eval_text, tmp_path, capsys):
    """`eval --policy-option` reaches the policies made from a press among the --policy runs (h2o
    beside it takes none), is recorded with the results, and is refused by name where it does
    not apply or the press has no such setting."""
    import json

    text = tmp_path / "t.txt"
    text.write_text(eval_text)
    common = ["eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--max-tokens", "90",
              "--no-probe"]
    ppl = {}
    for option in ("stride=1", "stride=3"):
        out = tmp_path / option
        assert run_cli(*common, "--policy", "stride", "--policy", "h2o", "--policy-option", option,
                       "--out", str(out)) == 0
        data = json.loads((out / "results.json").read_text())
        assert data["settings"]["policy_options"] == option
        ppl[option] = {run["label"]: run["ppl"] for run in data["runs"]}
    assert ppl["stride=1"]["h2o@48"] == ppl["stride=3"]["h2o@48"]
    assert ppl["stride=1"]["stride@48"] != ppl["stride=3"]["stride@48"]
    capsys.readouterr()
    assert run_cli(*common, "--policy", "h2o", "--policy-option", "stride=3", "--out", str(tmp_path / "x")) == 2
    assert "--policy-option sets a press's own settings" in capsys.readouterr().err
    assert run_cli(*common, "--policy", "stride", "--policy-option", "width=3", "--out", str(tmp_path / "x")) == 2
    assert "--policy-option: policy stride: this press has no setting 'width'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())

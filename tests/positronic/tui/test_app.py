"""The live view's wiring: short real runs under run_live (frames, the summary, Ctrl-C, a
failed tick, typed lines) and the loading line."""

import re
import threading

import pytest
from rich.live import _RefreshThread

from positronic.brain.loop import Brain, BrainConfig
from positronic.brain.runner import Runner
from positronic.tui.app import loading, run_live
from positronic.tui.records import ActionRecorder
from positronic.tui.render import render_actions
from positronic.tui.snapshot import take_snapshot


def live_stopped() -> bool:
    """No rich refresh thread is left running (Live.stop signals it; it ends at once)."""
    threads = [t for t in threading.enumerate() if isinstance(t, _RefreshThread)]
    for thread in threads:
        thread.join(timeout=2)
    return not any(t.is_alive() for t in threads)


@pytest.fixture
def live_run(console, lighthouse):
    def live_run(tiny, ticks, *observers, text=lighthouse):
        brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(text), BrainConfig(budget=48, seed=1))
        brain.observers.extend(observers)
        c = console(100, 30)
        result = run_live(brain, tiny, Runner(brain, tiny.name, ticks), show_prompt=True, console=c)
        return brain, result, c.export_text()
    return live_run


def test_run_live_runs_shows_frames_and_ends_with_the_summary(tiny, live_run):
    brain, result, out = live_run(tiny, 20)
    assert result.ticks == 20 and not result.interrupted
    assert "[finished]" in out and "tick 20/20" in out and "replace" in out  # 64 tokens > 48: repairs ran
    assert out.rindex("--- summary ---") > out.rindex("[finished]"), "the summary follows the last frame"
    assert "ticks 20 in" in out
    assert brain.observers == [], "the action recorder is removed"
    assert live_stopped(), "Live stopped"


class CtrlC:
    """An observer that presses Ctrl-C at a given tick (what the user does)."""

    def __init__(self, tick):
        self.tick = tick

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.tick:
            raise KeyboardInterrupt

    def after_apply(self, brain, actions, report):
        pass


def test_ctrl_c_ends_the_view_cleanly_with_the_summary(tiny, live_run):
    brain, result, out = live_run(tiny, 50, CtrlC(6))
    assert result.interrupted and result.ticks == 5
    assert "[interrupted]" in out and "--- summary --- (interrupted)" in out
    assert live_stopped()


class Fault:
    """An observer that makes Step 4 fail at a given tick (the state manager then rebuilds)."""

    def __init__(self, tick):
        self.tick = tick

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.tick:
            brain.state.inject_fault("forward")

    def after_apply(self, brain, actions, report):
        pass


def test_a_failed_tick_is_logged_and_the_run_goes_on(tiny, crafted, plain, live_run):
    brain, result, out = live_run(tiny, 6, Fault(4))
    assert result.ticks == 6 and not result.interrupted
    assert brain.counts["rebuilds"] == 1 and "rebuilds 1" in out
    born = [entry.tick_born for entry in brain.state.mirror.ledger.entries]
    assert 4 not in born and {3, 5, 6} <= set(born), "tick 4 added nothing, the others did"
    assert live_stopped()
    # the edits panel's log: what the tick tried, then that it failed
    brain = crafted(tiny)
    recorder = ActionRecorder(tiny)
    brain.observers.extend([recorder, Fault(1)])
    record = brain.step()
    assert record.rebuilt and record.text == ""
    assert len(recorder.lines) >= 2 and recorder.lines[0].startswith("t1 replace ")
    assert recorder.lines[-1].startswith("t1 REBUILT the cache from the mirror: InjectedFault")
    assert "REBUILT" in plain(render_actions(take_snapshot(brain, tiny, actions=list(recorder.lines)), 6))


def test_lines_typed_into_a_live_run_are_fed_and_a_refused_one_is_said_in_the_view(tiny, capsys, console, lighthouse):
    import queue

    # no culls in 30 ticks: the refusal is the edits panel's only line
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(lighthouse), BrainConfig(budget=128, window=8, seed=1))
    inputs = queue.SimpleQueue()
    for line in ("hello", "z" * 100):
        inputs.put(line)
    c = console(100, 30)
    result = run_live(brain, tiny, Runner(brain, tiny.name, 30, inputs=inputs), show_prompt=True, console=c)
    out = c.export_text()
    assert result.ticks == 30
    sources = [e.source for e in brain.state.mirror.ledger.entries]
    typed_ids = [e.token_id for e in brain.state.mirror.ledger.entries if e.source == "user"]
    assert tiny.decode(typed_ids) == "\nUser: hello\nAssistant:" and sources[-1] == "generated"
    assert "t0 input refused: the line is 118 tokens" in out, "in the edits panel"
    assert "refused" not in capsys.readouterr().err, "nothing written under the view"
    assert live_stopped()


def test_a_loading_line_shows_until_the_view_opens_and_ctrl_c_passes_through_it(console):
    """Ctrl-C while the model loads must reach the CLI (which exits 130) with the line gone."""
    c = console()
    with pytest.raises(KeyboardInterrupt):
        with loading("smollm2", c):
            assert c.is_terminal
            raise KeyboardInterrupt
    assert "loading smollm2 …" in c.export_text()
    assert c._live_stack == [], "the spinner's Live stopped"


def test_a_run_in_compiled_rounds_shows_its_frames_edits_and_typed_lines(tiny, console, lighthouse):
    """`run --compile` under the live view: the ticks are engine rounds (no Observer sees them),
    the edits panel says each round's deletes with their texts, a typed line is read in the
    rounds, and every frame and the summary read the brain handed back up to date."""
    import queue

    from positronic.batch import Batch

    config = BrainConfig(policy="streaming", budget=60, seed=1, temperature=0)
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(lighthouse), config)
    inputs = queue.SimpleQueue()
    inputs.put("hi")
    runner = Runner(brain, tiny.name, 30, inputs=inputs, rounds=Batch(compiled=True, slots=1, texts=True))
    c = console(100, 30)
    result = run_live(brain, tiny, runner, show_prompt=True, console=c)
    out = c.export_text()
    assert result.ticks == 30 and runner.in_rounds and "[finished]" in out and "tick 30/30" in out
    assert re.search(r"t\d+ delete \d+ '", out), "the rounds' edits in words"
    assert out.rindex("--- summary ---") > out.rindex("[finished]") and "now at tick 30" in out
    typed = [e.token_id for e in brain.state.mirror.ledger.entries if e.source == "user"]
    assert tiny.decode(typed) == "\nUser: hi\nAssistant:", "read in the rounds"
    assert brain.tick == 30 and brain.observers == [] and live_stopped()

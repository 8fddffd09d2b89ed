"""The Runner (positronic/brain/runner.py): interrupts land between ticks, broken states are never
saved, and a run interrupted any number of times ends with the stream of an uninterrupted one."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from positronic import mirror
from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.brain.runner import Runner
from positronic.state.manager import StateBrokenError

ROOT = Path(__file__).resolve().parents[3]


class SignalInsideTick:
    """An observer that sends this process `number` in the middle of tick `at` (after the
    plan, before Step 4): exactly where an interrupt used to leave half a tick."""

    def __init__(self, at: int, number: int):
        self.at, self.number = at, number

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.at:
            os.kill(os.getpid(), self.number)

    def after_apply(self, brain, actions, report):
        pass


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_tick_ends_the_run_after_that_tick(tiny, tmp_path, number):
    config, prompt = BrainConfig(budget=48, seed=5), [tiny.bos_id] + list(range(10, 40))
    straight = Brain.start(tiny, prompt, config)
    expected = [straight.step().token_id for _ in range(30)]
    brain = Brain.start(tiny, prompt, config)
    brain.observers.append(SignalInsideTick(12, number))
    handler = signal.getsignal(number)
    events = tmp_path / "events.jsonl"
    result = Runner(brain, tiny.name, 30, events=events, session=tmp_path / "s", save_every=100).run(lambda r, res: None)
    assert result.interrupted and result.signal == number and result.ticks == 12
    assert brain.tick == 12 and len(brain.state.mirror.ledger) == 31 + 12, "the tick under way was completed"
    assert [json.loads(line)["tick"] for line in events.read_text().splitlines()] == [0] + list(range(1, 13))  # header
    assert signal.getsignal(number) is handler, "the handler is given back"
    resumed = sessions.resume(tiny, tmp_path / "s")
    assert resumed.tick == 12
    assert [r.token_id for r in (resumed.step() for _ in range(18))] == expected[12:]


def test_a_state_that_cannot_be_rebuilt_stops_the_run_and_is_never_saved(tiny, tmp_path, monkeypatch):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    session = tmp_path / "s"
    Runner(brain, tiny.name, 5, session=session).run(lambda r, res: None)
    saved = {p.name: p.read_bytes() for p in session.iterdir()}

    def break_tick_8(record, result):  # its forward fails, and so does every rebuild
        if brain.tick == 7:
            monkeypatch.setattr("positronic.state.manager.prefill", lambda *a, **k: 1 / 0)
            brain.state.inject_fault("forward")
    with pytest.raises(StateBrokenError, match="tick 8 failed"):
        Runner(brain, tiny.name, 20, session=session, save_every=1).run(break_tick_8)
    assert {p.name: p.read_bytes() for p in session.iterdir()} != saved, "ticks 6 and 7 were saved"
    assert sessions.load(session)[1]["tick"] == 7, "the broken state was not"


def test_a_run_in_compiled_rounds_logs_saves_and_resumes_as_the_brains_own_ticks(tiny, tmp_path):
    """`run --compile`: the Runner's ticks are rounds of a compiled engine of one slot. Its event
    log has the tokens, ticks, sources and edits of the brain's own ticks (random:tiny, greedy:
    the compiled logits are the eager ones to 1e-5, and the same tokens), a session saved from
    the rounds resumes (into rounds again) to the same stream, and the brain after the run is
    up to date (its tick, its ledger: handed back)."""
    from positronic.batch import Batch

    config, prompt = BrainConfig(policy="h2o", budget=40, temperature=0), [tiny.bos_id] + list(range(40, 70))

    def logged(events: Path) -> list[tuple]:
        return [(r["tick"], r["token_id"], r["source"], sorted(map(repr, r["actions"])))
                for r in map(json.loads, events.read_text().splitlines()) if r["record"] == "tick"]

    own = Brain.start(tiny, prompt, config)
    Runner(own, tiny.name, 60, events=tmp_path / "own.jsonl").run(lambda r, res: None)
    brain = Brain.start(tiny, prompt, config)
    runner = Runner(brain, tiny.name, 35, events=tmp_path / "rounds.jsonl", session=tmp_path / "s", save_every=20,
                    rounds=Batch(compiled=True, slots=1, texts=True))
    assert runner.refusal() is None
    runner.warm()  # the graph (another test's in this process may have made it: graphs are the model's)
    graph = runner.batch.seats.engines[0].state.compiled.graph
    made = graph.compiles
    seen = []
    result = runner.run(lambda record, res: seen.append(runner.in_rounds))
    assert result.ticks == 35 and all(seen), "every tick was a round"
    assert graph.compiles == made, "warmed: the ticks, and the seats taken again after each save, compile nothing"
    assert brain.tick == 35 and len(brain.state.mirror.ledger) == len(prompt) + 35, "handed back at the end"
    resumed = sessions.resume(tiny, tmp_path / "s")
    assert resumed.tick == 35
    Runner(resumed, tiny.name, 25, events=tmp_path / "rounds.jsonl", append_events=True,
           rounds=Batch(compiled=True, slots=1, texts=True)).run(lambda r, res: None)
    assert logged(tmp_path / "rounds.jsonl") == logged(tmp_path / "own.jsonl")
    assert any("delete" in str(actions) for *_, actions in logged(tmp_path / "own.jsonl")), "it evicted"
    assert [(e.token_id, e.state) for e in resumed.state.mirror.ledger] == [(e.token_id, e.state) for e in own.state.mirror.ledger]


def test_run_py_refused_once_the_model_has_loaded_leaves_no_directory_and_no_lock_file(tmp_path, capsys, run_cli):
    """A run holds its --session from before the model loads (a server or another run is refused
    at once); what only the model can tell (a prompt past its positions, a saved run that does
    not check out) still refuses it then, and the session is left as the run found it: a new
    directory and its lock file go, a saved run's files stay as they were, nothing added."""
    new = tmp_path / "runs" / "new"
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "-n", "2", "--session", str(new),
                   "-p", "word " * 600) == 2
    assert "more than random:tiny's 512 positions" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    saved = tmp_path / "saved"
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "-n", "2", "-c", "64", "--session", str(saved)) == 0
    cache = next(saved.glob("kv-*.safetensors"))
    cache.write_bytes(cache.read_bytes()[:-8] + b"damaged!")
    (saved / sessions.LOCK_FILE).unlink(missing_ok=True)  # as a copied session: no lock file of its own
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    capsys.readouterr()
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "-n", "2", "--session", str(saved), "--resume") == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "--model", "random:tiny", "--no-tui", *args]


def tokens(events: Path) -> list[tuple[int, int]]:
    return [(r["tick"], r["token_id"]) for r in map(json.loads, events.read_text().splitlines()) if r["record"] == "tick"]


def logged_tick(events: Path) -> int:
    """The last tick the event log records so far (0: none; a line still being written is skipped)."""
    last = 0
    if events.exists():
        for line in events.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("record") == "tick":
                last = record["tick"]
    return last


def interruptible() -> None:
    """In the child before it starts: Ctrl-C as in a terminal. A test run in the background
    (`nohup`, `cmd &` in a script) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt: the run would go on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def in_our_code(process) -> bool:
    """Whether the child has left the interpreter's own start-up and runs run.py: its first C
    extension from site-packages is mapped. Before that, CPython itself answers a Ctrl-C (killed
    by SIGINT before its handler exists, or a traceback out of `site`), which no program can
    change; on a loaded CI machine that window outlasted a fixed 50 ms delay."""
    try:
        return "site-packages" in Path(f"/proc/{process.pid}/maps").read_text()
    except FileNotFoundError:  # no /proc (macOS), or the child has already exited
        return True


def signal_moment(rng, process, events: Path, done: int, ticks: int, span: int, stale: int) -> None:
    """Return at a random moment of the run: a quarter of the time during start-up (a random
    fraction of a second after run.py began importing), else once the log shows a random tick
    among the next `span` (at most half of what is left). Counted in ticks, not seconds, so
    every signal lands before the run can end however fast or loaded the machine is
    (time-based delays failed both ways); `span` leaves ticks for every stop to come.
    `stale`: the log's last tick before this run started. A run killed between two saves
    leaves ticks past `done` there, which are this run's only once it has made them again:
    counting them sent a Ctrl-C before the interpreter could handle one (killed by SIGINT)."""
    if rng.random() < 0.25:
        deadline = time.monotonic() + 60
        while process.poll() is None and not in_our_code(process) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 1.0))
        return
    start = max(done, stale)
    target = start + rng.randint(1, max(1, min(span, (ticks - start) // 2)))
    deadline = time.monotonic() + 120
    while process.poll() is None and logged_tick(events) < target and time.monotonic() < deadline:
        time.sleep(0.005)


# 4 stops in the suite; the long form (POSITRONIC_LONG_TESTS=1, or a count here) 40
SOAK_STOPS = int(os.environ.get("POSITRONIC_SOAK_STOPS", "40" if os.environ.get("POSITRONIC_LONG_TESTS") else "4"))


@pytest.mark.long
def test_soak_random_sigint_and_sigkill_then_resume_gives_the_uninterrupted_stream(tmp_path):
    """A run stopped again and again at random moments by Ctrl-C or SIGKILL (during start-up,
    mid-run, mid-save), resumed each time, ends with the same tokens, edits and event log
    as a run that was never interrupted. Bounded: 4 interruptions (POSITRONIC_SOAK_STOPS), then
    it runs to the end; the outcome of each is printed (pytest -s shows it)."""
    ticks, common = max(200, 50 * SOAK_STOPS), ["--budget", "64", "--repairer", "bridge"]
    straight = tmp_path / "straight.jsonl"
    subprocess.run(cli("--ticks", str(ticks), "--events", str(straight), *common), check=True,
                   capture_output=True, timeout=300)
    session, events = tmp_path / "s", tmp_path / "events.jsonl"
    rng, stops = random.Random(14), []
    while True:
        saved = session / "mirror.msgpack"
        done = mirror.load(saved)[1]["tick"] if saved.exists() else 0
        if done >= ticks:
            break
        args = cli("--ticks", str(ticks - done), "--session", str(session), "--save-every", "25", "--events", str(events),
                   *common)
        stale = logged_tick(events)
        process = subprocess.Popen(args + (["--resume"] if saved.exists() else ["--overwrite"]),  # a log of a run killed before its first save
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=interruptible)
        if len(stops) < SOAK_STOPS:  # then it runs to the end
            # the suite's stops land in the first half of what is left, as they always have; the
            # long form's many stops each take a share of the ticks, so that every stop has a run to stop
            signal_moment(rng, process, events, done, ticks, span=ticks if SOAK_STOPS <= 8 else ticks // (2 * SOAK_STOPS),
                          stale=stale)
            number = rng.choice([signal.SIGINT, signal.SIGKILL])
            process.send_signal(number)
            stops.append((number, process.wait(timeout=120)))
        else:
            assert process.wait(timeout=300) == 0, process.stderr.read()
        err = process.stderr.read()
        assert "Traceback" not in err, err
    assert tokens(events) == tokens(straight)
    codes = {code for _, code in stops}
    assert codes <= {0, 130, -signal.SIGKILL}, stops  # 0: the run ended before the signal came
    assert len(stops) == SOAK_STOPS
    kinds = {(signal.Signals(number).name, code) for number, code in stops}
    print(f"soak: {ticks} ticks, {len(stops)} stops: "
          + ", ".join(f"{name}->{code}: {sum(1 for n, c in stops if (signal.Signals(n).name, c) == (name, code))}"
                      for name, code in sorted(kinds)) + "; event log equal to the uninterrupted run's")

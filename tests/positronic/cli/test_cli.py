"""The command line's conventions (positronic/cli/): help, version, short flags, no tick
limit, threads, a `run` subcommand, and flags that would be silently lost are refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["run", "-h"], ["eval", "-h"], ["replay", "--help"]])
def test_help_comes_with_short_and_long_flags(args, capsys, run_cli):
    assert run_cli(*args) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage:") and "-h, --help" in out
    if args[0] in ("-h", "--help", "run"):
        assert "-m, --model" in out and "-n, --ticks" in out and "-c, --budget" in out and "-t, --threads" in out


def test_version_prints_the_installed_version(capsys, run_cli):
    from importlib.metadata import version

    assert run_cli("--version") == 0
    assert capsys.readouterr().out == f"positronic-brain {version('positronic-brain')}\n"


def test_run_options_before_a_subcommand_are_refused_not_ignored(capsys, run_cli):
    assert run_cli("--model", "random:tiny", "-n", "5", "eval", "--max-tokens", "5") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: options before `eval` belong to a run (--model, --ticks)") and "after it" in err


def test_a_llama_cpp_alias_and_its_flag_together_are_refused(capsys, run_cli):
    assert run_cli("-m", "random:tiny", "--kv-eviction", "1", "--policy", "h2o", "--no-tui") == 2
    assert "--kv-eviction and --policy set the same thing" in capsys.readouterr().err
    assert run_cli("-m", "random:tiny", "--kv-sink-tokens", "2", "--sinks", "2", "--no-tui") == 2
    assert "--kv-sink-tokens and --sinks" in capsys.readouterr().err


def test_llama_cpps_long_flags_run_the_brain_their_own_flags_run(capsys, run_cli, tmp_path):
    """llama-cli's --ctx-size, --n-predict, --temp, --repeat-penalty, --keep, -f/--file and -ngl
    (issue 73: each was "No such option", and -ngl 0 parsed as -n gl)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hi there, said the fox to the hound.", encoding="utf-8")
    torch_threads = torch.get_num_threads()
    outputs = []
    try:
        for args in (["--ctx-size", "48", "--n-predict", "9", "--temp", "0", "--repeat-penalty", "1.3", "--keep", "2",
                      "-f", str(prompt), "-ngl", "0"],
                     ["--budget", "48", "--ticks", "9", "--temperature", "0", "--repetition-penalty", "1.3",
                      "--protect", "2", "--prompt-file", str(prompt), "--device", "cpu"]):
            assert run_cli("-m", "random:tiny", *args, "--no-tui", "--no-input", "-t", "1") == 0
            outputs.append(capsys.readouterr().out)
    finally:
        torch.set_num_threads(torch_threads)
    assert "ticks 9 in" in outputs[0] and "budget 48" in outputs[0]
    assert outputs[0].split("\n--- summary")[0] == outputs[1].split("\n--- summary")[0]
    assert run_cli("-m", "random:tiny", "-ngl", "0", "--device", "cpu", "--no-tui") == 2
    assert "--n-gpu-layers and --device set the same thing" in capsys.readouterr().err


def test_run_compile_ticks_in_compiled_rounds_and_refuses_what_they_cannot_run(capsys, run_cli, tmp_path):
    """`run --compile`: the same greedy text and edits as the brain's own ticks (random:tiny),
    the compile said before the first tick; a capture, a setting Core v4 does not run and a
    model the compiled round cannot run are refused with the reason."""
    torch_threads = torch.get_num_threads()
    texts, logs = [], []
    try:
        for flag in ("--compile", "--no-compile"):
            events = tmp_path / f"{flag}.jsonl"
            assert run_cli("-m", "random:tiny", flag, "-n", "40", "-c", "48", "--policy", "streaming",
                           "--temperature", "0", "-p", "The fox and the hound", "--events", str(events),
                           "--no-tui", "--no-input", "-t", "1") == 0
            out, err = capsys.readouterr()
            texts.append(out.split("\n--- summary")[0])
            logs.append([(r["token_id"], r["actions"]) for r in map(json.loads, events.read_text().splitlines()[1:])])
            assert ("compiled in" in err) == (flag == "--compile")
        assert texts[0] == texts[1] and logs[0] == logs[1] and any(len(a) > 1 for _, a in logs[0])
        assert run_cli("-m", "random:tiny", "--compile", "--capture", str(tmp_path / "c"), "--no-tui") == 2
        assert "--capture records each tick's action list" in capsys.readouterr().err
        assert run_cli("-m", "random:tiny", "--compile", "--policy", "brightness", "--repairer", "bridge",
                       "--no-tui", "--no-input") == 2
        assert "--compile: repairer='bridge' does not run on Core v4 yet" in capsys.readouterr().err
        assert run_cli("-m", "random:tiny", "--compile", "--weights", "int8", "--no-tui", "--no-input") == 2
        assert "--compile: a compiled round runs float weights or --weights int8-weight-only, not --weights int8" in capsys.readouterr().err
    finally:
        torch.set_num_threads(torch_threads)


def test_reread_is_for_smartkv_with_recall_and_compiled_rounds_default_to_without(capsys, run_cli, tiny, tmp_path):
    """`--reread` (on by default with recall): refused in one line for a policy without SmartKV's
    recall; `run --compile`, whose rounds do not reread yet, runs SmartKV with recall without it
    unless asked, and asked, says why it cannot."""
    from positronic.smartkv.gates import bench_gates

    assert run_cli("-m", "random:tiny", "--policy", "streaming", "--reread", "-n", "2", "--no-tui", "--no-input") == 2
    assert "--reread applies to policy smartkv with recall, not streaming" in capsys.readouterr().err
    gates = ["--policy", "smartkv", "--gates", bench_gates(tiny, tmp_path)[1]]
    assert run_cli("-m", "random:tiny", *gates, "--no-recall", "--reread", "-n", "2", "--no-tui", "--no-input") == 2
    assert "--reread rereads a token with what recall brought back: it needs --recall" in capsys.readouterr().err
    torch_threads = torch.get_num_threads()
    try:
        assert run_cli("-m", "random:tiny", *gates, "--recall", "--compile", "--reread", "-n", "2", "--no-tui",
                       "--no-input", "-t", "1") == 2
        assert "--compile: reread=True does not run on Core v4 yet" in capsys.readouterr().err
        assert run_cli("-m", "random:tiny", *gates, "--recall", "--compile", "-n", "4", "-c", "48", "--no-tui",
                       "--no-input", "-t", "1") == 0
        assert "compiled in" in capsys.readouterr().err
    finally:
        torch.set_num_threads(torch_threads)


def test_short_flags_and_the_run_subcommand_run_the_same_brain(capsys, run_cli):
    torch_threads = torch.get_num_threads()
    try:
        assert run_cli("run", "-m", "random:tiny", "-n", "7", "-p", "Hi there", "-c", "64", "-s", "3", "-t", "1",
                       "--no-tui", "--no-input") == 0
        first = capsys.readouterr().out
        assert torch.get_num_threads() == 1, "-t sets torch's threads"
        assert run_cli("--model", "random:tiny", "--ticks", "7", "--prompt", "Hi there", "--budget", "64",
                       "--seed", "3", "--no-tui", "--no-input") == 0
        second = capsys.readouterr().out
    finally:
        torch.set_num_threads(torch_threads)
    assert "ticks 7 in" in first and "budget 64" in first
    assert first.split("\n--- summary")[0] == second.split("\n--- summary")[0], "same text, same seed"
    assert run_cli("-m", "random:tiny", "-n", "0") == 2
    assert "--ticks must be at least 1, or -1 for no limit" in capsys.readouterr().err


@pytest.mark.long
@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT")
def test_no_tick_limit_runs_until_ctrl_c_and_ends_with_the_summary(tmp_path):
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "-m", "random:tiny", "-n", "-1", "-c", "48",
                             "--no-tui", "--no-input", "--events", str(events)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not events.exists() or events.read_text().count("\n") < 400):
        time.sleep(0.2)  # 400 ticks: past the 300 of the default, and past the budget
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    ticks = events.read_text().count("\n") - 1  # the header
    assert proc.returncode == 130 and ticks >= 400, (proc.returncode, ticks, err[-500:])
    assert f"ticks {ticks} in" in out and "interrupted" in out
    assert "/∞] tick" in err, "the progress line says there is no limit"


def test_an_existing_event_log_is_not_overwritten_without_overwrite(tmp_path, capsys, run_cli):
    events = tmp_path / "events.jsonl"
    events.write_text("an earlier run's log\n")
    args = ["-m", "random:tiny", "-n", "3", "--no-tui", "--no-input", "--events", str(events)]
    assert run_cli(*args) == 2
    assert "already exists; replace it with --overwrite" in capsys.readouterr().err
    assert events.read_text() == "an earlier run's log\n", "refused before anything was written"
    assert run_cli(*args, "--overwrite") == 0
    assert events.read_text().count("\n") == 1 + 3, "a header and three ticks"


@pytest.mark.long
def test_the_process_entry_ignores_ctrl_c_once_the_work_is_done():
    """run.py and the `positronic` command end through `entry`: after `main` (here --help, which
    exits), Ctrl-C is ignored, so one pressed while the interpreter tears down cannot turn a
    finished run's status into "killed by SIGINT" (the soak test met that as exit status -2)."""
    code = ("import signal, sys\nfrom positronic.cli import entry\nsys.argv = ['positronic', '--help']\n"
            "status = 0\ntry:\n    entry()\nexcept SystemExit as exc:\n    status = exc.code\n"
            "print(status, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "0 True", out.stderr[-500:]


@pytest.mark.long
def test_a_run_as_its_own_process_freezes_the_loaded_objects_and_an_in_process_call_does_not(run_cli, capsys):
    """The process entry lets the collector skip the model's and tokenizer's objects once
    loaded (a full collection walked ~378,000 of them for SmolLM2); a caller's own process
    keeps its collector as it was."""
    import gc

    before = gc.get_freeze_count()
    assert run_cli("-m", "random:tiny", "-n", "2", "--no-tui", "--no-input") == 0
    assert gc.get_freeze_count() == before
    code = ("import gc, sys\nfrom positronic.cli import entry\n"
            "sys.argv = ['positronic', '-m', 'random:tiny', '-n', '2', '--no-tui', '--no-input']\n"
            "try:\n    entry()\nexcept SystemExit:\n    pass\nprint('frozen', gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert int(out.stdout.strip().splitlines()[-1].split()[1]) > 10_000, out.stderr[-500:]


def test_dtype_auto_and_a_family_model_run(capsys, run_cli):
    assert run_cli("-h") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "auto: the checkpoint's own dtype" in out and ".gguf file" in out and "random:qwen3" in out
    assert run_cli("--model", "random:qwen3", "--dtype", "auto", "--ticks", "3", "-c", "64", "--no-tui", "--no-input") == 0
    assert "ticks 3 in" in capsys.readouterr().out
    assert run_cli("-m", "random:qwen3", "--dtype", "int8", "-n", "3", "--no-tui", "--no-input") == 2
    assert "bad dtype 'int8': expected auto" in capsys.readouterr().err


# --- nonsense refused before the model loads, with one line naming it --------------------------


@pytest.mark.parametrize("args, message", [
    (["--window", "8", "--policy", "streaming"], "--window sets the recent rows of policies brightness and smartkv"),
    (["--unit", "1000", "-c", "64"], "unit 1000 is more rows than the policy can ever cull"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be in [0.01, 100.0]"),
    (["--repetition-penalty", "1e-30"], "--repetition-penalty must be in [0.01, 100.0]"),
    # issue 75: each of these was accepted, a traceback, or an error that named no flag
    (["--refresh-kl", "inf"], "--refresh-kl must be a finite number >= 0, got inf"),
    (["-c", str(2**64 - 1)], "--budget must be in -2**63..2**63-1"),
    (["-t", "2147483648"], "Invalid value for '-t' / '--threads'"),
    (["-n", str(2**63)], "Invalid value for '-n' / '--ticks'"),
    (["--pin", "not in the prompt"], "--pin 'not in the prompt' does not occur in the prompt"),
    (["--gates", "/dev/null"], "--gates /dev/null: not a regular file (a character device)"),
    (["-s", "-1"], "seed must be in 0..2**63-1"),
    (["-s", str(2**64)], "seed must be in 0..2**63-1"),
    (["--capture", "/dev/null"], "cannot use --capture /dev/null: /dev/null is not a directory"),
    (["--kv-store", "ring", "--policy", "streaming", "--capture", "CAPTURE"], "the ring store has none"),
    (["--prompt-file", "/dev/zero"], "cannot read --prompt-file /dev/zero: more than the 67108864 bytes read"),
])
def test_nonsense_is_refused_with_one_line_before_the_model_loads(args, message, tmp_path, capsys, run_cli,
                                                                  monkeypatch):
    import positronic.cli.run as run_module

    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    args = [str(tmp_path / "c") if a == "CAPTURE" else a for a in args]
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_window_for_a_policy_that_reads_it_is_taken(run_cli, capsys):
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "--window", "8", "--ticks", "2", "-c", "64") == 0


def test_a_prompt_beyond_the_models_positions_fails_before_any_prefill(tmp_path, capsys, run_cli):
    """random:tiny has 512 positions: a 2,000-byte prompt (a token a byte) is refused at once,
    not after prefilling and decoding every token (a 10 MB file took minutes)."""
    text = tmp_path / "long.txt"
    text.write_text("word " * 400)
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "--prompt-file", str(text)) == 2
    assert "the prompt is 2001 tokens, more than random:tiny's 512 positions" in capsys.readouterr().err


def test_events_in_a_directory_that_does_not_exist_yet_are_written_there(tmp_path, run_cli):
    events = tmp_path / "new" / "dir" / "events.jsonl"
    assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "--ticks", "3", "-c", "64", "--events", str(events)) == 0
    assert len(events.read_text().splitlines()) == 4  # the header and three ticks


def test_a_resume_appends_only_to_its_own_event_log(tmp_path, capsys, run_cli):
    """An events file that is not the session's own (a notes file, another run's log) is
    refused and left as it was; the session's own log goes on."""
    session, own, other = tmp_path / "s", tmp_path / "own.jsonl", tmp_path / "other.jsonl"
    base = ["-m", "random:tiny", "--no-tui", "--no-input", "-c", "64", "--ticks", "4"]
    assert run_cli(*base, "--session", str(session), "--events", str(own)) == 0
    assert run_cli(*base, "--session", str(tmp_path / "t"), "--events", str(other)) == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for foreign in (notes, other):
        before = foreign.read_bytes()
        assert run_cli(*base, "--session", str(session), "--resume", "--events", str(foreign)) == 2
        assert "is not this session's event log" in capsys.readouterr().err
        assert foreign.read_bytes() == before
    assert run_cli(*base, "--session", str(session), "--resume", "--events", str(own)) == 0
    records = [json.loads(line) for line in own.read_text().splitlines()]
    headers = [r for r in records if r.get("record") == "header"]
    assert len(headers) == 2 and headers[0]["run_id"] == headers[1]["run_id"]
    assert [r["tick"] for r in records if r.get("record") != "header"] == list(range(1, 9))


def test_a_resume_with_events_that_are_no_regular_file_is_refused_at_once(tmp_path, capsys, run_cli):
    """A resume reads its event log's header and rewrites the log: a FIFO there waited for a
    writer forever, a device or a directory failed later; each is one line now, and nothing
    changes."""
    session = tmp_path / "s"
    base = ["-m", "random:tiny", "--no-tui", "--no-input", "-c", "64", "--ticks", "2", "--session", str(session)]
    assert run_cli(*base) == 0
    saved = (session / "mirror.msgpack").read_bytes()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for events, message in ((fifo, "not a regular file (a FIFO)"), (Path("/dev/null"), "(a character device)"),
                            (tmp_path, "is a directory")):
        capsys.readouterr()
        assert run_cli(*base, "--resume", "--events", str(events)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --events {events}") and message in err and err.count("\n") == 1
    assert (session / "mirror.msgpack").read_bytes() == saved


@pytest.mark.parametrize("args, message", [
    (["--capture-ticks", "all"], "--capture-ticks applies to --capture: give --capture DIR"),
    (["--save-every", "5"], "--save-every applies to --session: give --session DIR"),
    (["--capture", "CAPTURE", "--capture-ticks", "soon"], "--capture-ticks 'soon': expected"),
])
def test_an_option_read_only_with_another_is_refused_alone(args, message, tmp_path, capsys, run_cli):
    """Given alone, these were silently ignored; a bad tick list was found once the model had loaded."""
    args = [str(tmp_path / "c") if a == "CAPTURE" else a for a in args]
    assert run_cli("-m", "no-such-model", "--no-tui", "--no-input", "-n", "1", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "no-such-model" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_on_a_session_in_use_is_refused(tmp_path, capsys, run_cli):
    from positronic.brain import session as sessions

    with sessions.locked(tmp_path / "s", "another run"):
        assert run_cli("-m", "random:tiny", "--no-tui", "--no-input", "--ticks", "2", "-c", "64",
                       "--session", str(tmp_path / "s")) == 2
    assert "is in use by another run (pid" in capsys.readouterr().err


@pytest.mark.smollm2
def test_the_default_policy_is_smartkv_with_recall_where_gates_ship_and_no_recall_turns_recall_off(capsys, run_cli):
    for flags, said in [((), "positronic: policy smartkv with recall, its memory ranked by recent use too "
                             "(--memory-rank recent): the best measured for smollm2"),
                        (("--no-recall",), "positronic: policy smartkv without recall (--no-recall)")]:
        assert run_cli("--model", "smollm2", "-n", "3", "-p", "Hi", "-c", "48", "--no-tui", "--no-input", *flags) == 0
        captured = capsys.readouterr()
        assert said in captured.err
        assert "policy smartkv" in captured.out


@pytest.mark.parametrize("per_head", [False, True])
def test_the_progress_line_shows_what_the_live_view_colours_tokens_by(tiny, tmp_path, per_head):
    """Under shared rows: the live tokens' brightness. Under SmartKV's per-layer rows, which keep
    no brightness (it stayed 255/255/255): how many lanes hold each live token, least / mean /
    most, as the live view colours them."""
    from positronic.brain.loop import Brain, BrainConfig
    from positronic.brain.runner import RunResult
    from positronic.cli.run import progress_line
    from positronic.smartkv.gates import GateSet

    gates = GateSet.for_config(tiny.model.config, seed=3, per_head=per_head, header={"lifespan": {"horizon": 48}})
    with torch.no_grad():  # untrained gates tie; spread as trained ones are, so the lanes keep different rows
        for gate in gates.gates:
            last = [m for m in gate.modules() if isinstance(m, torch.nn.Linear)][-1]
            last.weight.mul_(100.0), last.bias.mul_(100.0)
    gates.save(path := tmp_path / "gates.safetensors")
    prompt = [tiny.bos_id] + [(7 * k) % 250 + 3 for k in range(40)]
    brain = Brain.start(tiny, prompt, BrainConfig(policy="smartkv", budget=24, sinks=2, window=8, gates=str(path)))
    record = [brain.step() for _ in range(12)][-1]
    line = progress_line(brain, record, RunResult(ticks=12, seconds=1.0), 12)
    mirror = brain.state.mirror
    held = mirror.layers.occupancy(mirror.live.ledger_ids)
    lanes = tiny.num_layers * (tiny.num_kv_heads if per_head else 1)
    unit = "kv heads" if per_head else "layers"
    assert mirror.layers.num_layers == lanes and min(held) < max(held) == lanes, "lanes should hold different rows"
    assert line.endswith(f"held by {min(held)}/{sum(held) / len(held):.0f}/{lanes} of {lanes} {unit}"), line
    assert "brightness" not in line and line.startswith("[12/12] tick 12  live 24/24 per layer")

    shared = Brain.start(tiny, prompt, BrainConfig(policy="brightness", budget=24, sinks=2, window=8))
    record = [shared.step() for _ in range(3)][-1]
    line = progress_line(shared, record, RunResult(ticks=3, seconds=1.0), 0)
    assert line.startswith(f"[3/∞] tick 3  live {record.live_length}/24  ") and "held by" not in line
    assert line.endswith(f"brightness {record.brightness_min:.0f}/{record.brightness_mean:.0f}/{record.brightness_max:.0f}")

"""Shared fixtures: the real embedded model (SmolLM2, float32 on CPU), tiny random Llamas, and
the helpers several test modules use (each a fixture, so no test module imports another)."""

import contextlib
import functools
import importlib.util
import io
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from positronic.brain.loop import Brain, BrainConfig
from positronic.cli import main
from positronic.models import load_model
from positronic.models import with_cache

EVAL_TEXT = ("The keeper of the lighthouse wrote in his log every evening. He noted the wind, the ships that "
             "passed, and the colour of the sea. In winter the storms came from the north and the lamp had to "
             "be trimmed twice a night. His daughter learned to read from the log, one line at a time. ") * 3


def pytest_configure(config):
    """Under pytest-xdist (`make test`), the embedded model is converted here, once, before the
    workers start: two workers converting it at once would each pay ~30 s, and one could move the
    other's finished directory aside while it loads."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from positronic.models import ModelNotAvailable
        from positronic.models.smollm2 import smollm2_cache
        try:
            smollm2_cache()
        except ModelNotAvailable:
            pass  # its tests are deselected or fail with the reason, as without xdist


def pytest_collection_modifyitems(config, items):
    """Tests that use `smol` are marked smollm2 as well, so that one marker names every test that
    needs the embedded model (its GGUF, ~98 MB, `positronic fetch-model`): a machine that cannot have it (a
    lent GPU: at most 64 MiB travels) deselects them with -m "not smollm2"; CI runs them all.
    The bench scripts' tests and those that start `serve` as a process are marked long (what
    `make test-fast` leaves out), beside the tests marked so by hand."""
    bench = Path(__file__).resolve().parent / "bench"
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "smol" in names:
            item.add_marker(pytest.mark.smollm2)
        if "serve_process" in names or bench in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.long)


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M from the embedded GGUF (converted once into the user cache)."""
    return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama (float32): fast enough for property tests."""
    return load_model("random:tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_half():
    """The same tiny shape in float16, for drift tests."""
    return load_model("random:tiny", device="cpu", dtype="float16")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def nan_fill(monkeypatch):
    """The NaN-fill test mode for one test (positronic/kv/buffers.py): every cache buffer
    allocated meanwhile starts as NaN (integers: their largest value), so a read of a row
    nobody wrote shows. `make test` also runs the cache suites with POSITRONIC_NAN_FILL=1."""
    monkeypatch.setenv("POSITRONIC_NAN_FILL", "1")


@pytest.fixture(scope="session")
def eval_text() -> str:
    """A short English text for `positronic eval` and friends (~190 SmolLM2 tokens, ~750 bytes)."""
    return EVAL_TEXT


def _run_cli(*args) -> int:
    try:
        main(list(args))
    except SystemExit as exc:
        return exc.code or 0
    return 0


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(*args): the exit code `positronic ARGS` would have, run in this process."""
    return _run_cli


def _layer0_by_prefill(lm, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K/V [1, kv_heads, rows, head_dim] as plain transformers stores them after a
    prefill of `token_ids` at `positions` into a DynamicCache: the model's own forward, none of
    the project's code (check(deep=True) uses forward.fresh_layer0_kv, so that helper cannot
    judge it). Layer 0's K/V depend only on token and position, so the mask does not matter."""
    cache = DynamicCache()  # no config: a sliding-window model's would keep only its window
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([token_ids], device=lm.device),
                 position_ids=torch.tensor([positions], device=lm.device), **with_cache(cache), use_cache=True)
    return cache.layers[0].keys.clone(), cache.layers[0].values.clone()


def _bench_script(name: str):
    """bench/NAME.py loaded as a module (not run as a script): its functions called in-process."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # dataclasses look their module up there
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="session")
def bench_script():
    """bench_script(name) -> bench/NAME.py as a module, see _bench_script."""
    return _bench_script


@dataclass
class ScriptRun:
    """What `python bench/NAME.py ARGV` leaves behind: its exit code and what it printed."""
    returncode: int
    stdout: str
    stderr: str


def _run_script(monkeypatch, name: str, *argv: str, check: bool = False) -> ScriptRun:
    """bench/NAME.py's main() in this process, as `python bench/NAME.py ARGV` runs it: sys.argv
    set, stdout and stderr captured, SystemExit turned into the exit code a process would have
    (a message string: printed to stderr, code 1), any other exception into code 1 and its
    traceback. A fresh copy of the module each call (module-level state as in a new process);
    torch's thread count and the environment, which scripts set, are put back afterwards.
    In-process because each subprocess paid ~4 s of torch import on 2 cores."""
    script = _bench_script(name)
    path = Path(script.__file__)
    monkeypatch.setattr(sys, "argv", [str(path), *map(str, argv)])
    for key in list(os.environ):  # restored at teardown: the scripts set variables for their runs
        monkeypatch.setenv(key, os.environ[key])
    threads, out, err = torch.get_num_threads(), io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = script.main()
            except SystemExit as exit_:
                code = exit_.code
                if isinstance(code, str):
                    print(code, file=sys.stderr)
                    code = 1
            except Exception:  # what the process would print before exiting with 1
                traceback.print_exc()
                code = 1
    finally:
        torch.set_num_threads(threads)
    done = ScriptRun(code or 0, out.getvalue(), err.getvalue())
    if check:
        assert done.returncode == 0, f"bench/{name}.py {' '.join(map(str, argv))} exited {done.returncode}:\n{done.stderr}"
    return done


@pytest.fixture
def run_script(monkeypatch):
    """run_script(name, *argv, check=False) -> ScriptRun: bench/NAME.py run in this process,
    see _run_script."""
    return functools.partial(_run_script, monkeypatch)


@pytest.fixture(scope="session")
def layer0_oracle():
    """layer0_oracle(lm, token_ids, positions) -> (keys, values), see _layer0_by_prefill."""
    return _layer0_by_prefill


def _fresh_logits(lm, token_ids, positions):
    n = len(token_ids)
    mask = torch.full((n, n), torch.finfo(lm.dtype).min).triu(1)[None, None]
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([token_ids]), position_ids=torch.tensor([positions]),
                       attention_mask=mask, use_cache=False)
    return out.logits[0].float()


@pytest.fixture(scope="session")
def fresh_logits():
    """fresh_logits(lm, token_ids, positions) -> [rows, vocab]: the logits of one plain
    transformers forward over the tokens at those positions, causal by row."""
    return _fresh_logits


def _alone(lm, prompt, ticks: int, **config) -> list[int]:
    brain = Brain.start(lm, prompt, BrainConfig(**config))
    return [brain.step().token_id for _ in range(ticks)]


def _batched(lm, prompts, configs: list[dict], ticks: int, *, engine: bool = True):
    from positronic.batch import Batch

    batch = Batch(engine=engine)
    for name, (prompt, config) in enumerate(zip(prompts, configs)):
        batch.join(name, Brain.start(lm, prompt, BrainConfig(**config)))
    got = [[] for _ in configs]
    for _ in range(ticks):
        for name, record in batch.step().items():
            assert not isinstance(record, Exception), record
            assert not record.rebuilt, record.error
            got[name].append(record.token_id)
    return batch, got


@pytest.fixture(scope="session")
def alone():
    """alone(lm, prompt, ticks, **config) -> the tokens one brain (BrainConfig(**config)) makes
    over `ticks` ticks on its own: what a batched sequence must match."""
    return _alone


@pytest.fixture(scope="session")
def batched():
    """batched(lm, prompts, configs, ticks) -> (the Batch, each sequence's tokens): a batch of
    one brain per prompt and config, stepped `ticks` times; every tick goes through (no
    exception, no rebuild)."""
    return _batched

"""The core install runs without the optional extras: `serve` (fastapi, uvicorn,
prometheus_client, llguidance), `eval`'s plot (matplotlib) and `serve --replicas` (ray) are extras, named
by the command that needs them; `make setup` (the README's set-up) installs them all."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVE = {"fastapi", "uvicorn", "prometheus_client", "llguidance"}  # llguidance: the grammars of structured output

# run a command of run.py with the extras' modules missing (an import of one raises ImportError)
WITHOUT = """
import runpy, sys
for name in {names!r}:
    sys.modules[name] = None
sys.argv = ["run.py", *{args!r}]
runpy.run_path("run.py", run_name="__main__")
"""


def without(names: set[str], *args: str) -> subprocess.CompletedProcess:
    code = WITHOUT.format(names=sorted(names), args=list(args))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_extras_are_declared_and_make_setup_installs_them():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("<")[0].split("=")[0] for d in project["dependencies"]}
    assert not core & (SERVE | {"matplotlib"})
    assert {d.split(">")[0] for d in project["optional-dependencies"]["serve"]} == SERVE
    assert project["optional-dependencies"]["eval"] == ["matplotlib"]
    assert not any(d.startswith("ray") for d in project["dependencies"])
    assert [d.split(">")[0] for d in project["optional-dependencies"]["cluster"]] == ["ray[serve]", "fsspec"]
    assert "'.[serve,eval,dev,cluster]'" in (ROOT / "Makefile").read_text()


@pytest.mark.long
def test_the_main_job_runs_without_the_extras_and_serve_says_what_to_install():
    ran = without(SERVE | {"matplotlib"}, "--model", "random:tiny", "--ticks", "5", "--no-tui", "--no-input")
    assert ran.returncode == 0, ran.stderr
    served = without(SERVE, "serve", "-m", "random:tiny", "--port", "0")
    assert served.returncode != 0 and "Traceback" not in served.stderr
    assert "pip install 'positronic-brain[serve]'" in served.stderr and "fastapi" in served.stderr
    held = without({"llguidance"}, "--model", "random:tiny", "--ticks", "5", "--no-tui", "--no-input", "--grammar",
                   'root ::= "a"')
    assert held.returncode == 2 and "Traceback" not in held.stderr
    assert "needs llguidance: pip install 'positronic-brain[serve]'" in held.stderr


@pytest.mark.long
def test_eval_without_matplotlib_writes_its_tables_and_says_the_plot_is_missing(tmp_path, eval_text):
    text, out = tmp_path / "t.txt", tmp_path / "res"
    text.write_text(eval_text)
    ran = without({"matplotlib"}, "eval", "--model", "random:tiny", "--text", str(text), "--budget", "48",
                  "--policy", "h2o", "--max-tokens", "70", "--out", str(out))
    assert ran.returncode == 0, ran.stderr
    assert {p.name for p in out.iterdir()} == {"results.csv", "results.json"}
    assert "pip install 'positronic-brain[eval]'" in ran.stderr

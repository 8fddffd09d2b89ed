"""Packaging: a wheel built from this checkout installs one package, `positronic` (steps/ and
mirror/ as positronic.steps and positronic.mirror, no top-level `steps` or `mirror`), with the
data it reads at run time, and `positronic eval` runs from it outside the checkout on its
default text (texts/alice_ch1-2.txt, shipped as package data).

The wheel goes into a fresh venv. Installing torch there would take minutes, so a .pth file
appends this interpreter's site-packages (torch, transformers, ...) behind the venv's own; that
directory's .pth files are not run from there, so the editable install of this checkout is not
active in the venv, and the venv's own copy of positronic comes first on sys.path anyway.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# not part of a build; a stale build/ (from an older layout) would leak into the wheel
LEFT_OUT = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                  ".hypothesis", "sessions", "eval_results", "runs")
CHECK = """
import importlib.util, json, sysconfig
import positronic, positronic.mirror, positronic.steps, positronic.texts
print(json.dumps({"site": sysconfig.get_paths()["purelib"], "positronic": positronic.__file__,
                  "steps": positronic.steps.__file__, "mirror": positronic.mirror.__file__,
                  "text": str(positronic.texts.DEFAULT_TEXT),
                  "top_level": [n for n in ("steps", "mirror") if importlib.util.find_spec(n)]}))
"""


def run(command: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.long
def test_wheel_installs_positronic_alone_and_eval_runs_outside_the_checkout(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "wheels",
         source], cwd=tmp_path, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("positronic_brain-*.whl")

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
                .stdout.strip())
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=tmp_path, timeout=300)

    # one top-level package: steps and mirror inside it, every package of positronic/ there too
    assert not (site / "steps").exists() and not (site / "mirror").exists()
    for folder in ("steps", "mirror"):
        assert (site / "positronic" / folder / "__init__.py").is_file(), folder
        assert {p.name for p in (site / "positronic" / folder).glob("*.py")} == \
            {p.name for p in (ROOT / folder).glob("*.py")}, folder
    for init in (ROOT / "positronic").rglob("__init__.py"):
        assert (site / init.relative_to(ROOT)).is_file(), f"{init.parent.relative_to(ROOT)} is not in the wheel"
    for name in ("alice_ch1-2.txt", "PROVENANCE.md"):
        assert (site / "positronic" / "texts" / name).read_bytes() == (ROOT / "texts" / name).read_bytes(), name

    found = json.loads(run([python, "-c", CHECK], cwd=tmp_path).stdout)
    assert Path(found["site"]) == site
    for key, where in (("positronic", "positronic"), ("steps", "positronic/steps"), ("mirror", "positronic/mirror")):
        assert Path(found[key]) == site / where / "__init__.py", (key, found[key])
    assert Path(found["text"]) == site / "positronic" / "texts" / "alice_ch1-2.txt"
    assert found["top_level"] == [], f"importable at the top level: {found['top_level']}"

    # the console script, from outside the checkout, on the default text: a tiny eval
    out = tmp_path / "eval"
    done = run([env / "bin" / "positronic", "eval", "--model", "random:tiny", "--policy", "none", "--budget", "48",
                "--max-tokens", "64", "--segments", "1", "--no-probe", "--threads", "1", "--out", out],
               cwd=tmp_path, timeout=300)
    results = json.loads((out / "results.json").read_text())
    assert "alice_ch1-2.txt" in json.dumps(results), done.stdout
    assert (out / "results.csv").is_file() and (out / "nll_by_position.png").is_file()

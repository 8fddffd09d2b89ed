#!/usr/bin/env bash
# What this project checks and measures on a lent GPU, in one go (results: bench/results/gpu.md).
#
#   bash bench/gpu.sh OUTDIR [tests|bench|suite ...]     (default: all three)
#
# tests: the CUDA test modules (tests/test_cuda.py, the fused decode kernel's tests);
# bench: decode against HF generate, cost per cache format (fused and unfused), ring vs splice,
#        all on random:tinyllama (the embedded model's weights stay on the CPU machine);
# suite: the CPU test suite without the embedded model (-m "not slow"), on this machine's
#        torch and transformers (the oldest transformers this project supports, 5.17, on the
#        lent machines).
# Assumes the project's Python dependencies are importable (on the lent machines: the
# preinstalled ones plus wheels carried in .whl/, see the device notes).
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUTDIR [tests|bench|suite ...]}
shift
parts=${*:-tests bench suite}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, transformers
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "none"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, triton {tv}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
PY
for part in $parts; do
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/positronic/kv/test_triton_kernel.py 2>&1 | tee "$out/tests.txt" ;;
    bench)
      python3 bench/decode.py --model random:tinyllama --device cuda --contexts 512 2048 --ticks 32 --repeats 3 \
          --batches 1 8 --repairers none self 2>&1 | tee "$out/decode.txt"
      python3 bench/kv_cost.py --device cuda --contexts 512 2048 --unfused 2>&1 | tee "$out/kv_cost.txt"
      python3 bench/ring.py --models random:tinyllama --device cuda 2>&1 | tee "$out/ring.txt" ;;
    suite) CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider -m "not slow" -x 2>&1 | tee "$out/suite.txt" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

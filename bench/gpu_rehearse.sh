#!/usr/bin/env bash
# The CPU suite as bench/gpu.sh runs it on a lent GPU machine (-m "not slow and not smollm2"),
# here, with the embedded model's wheel hidden (bench/without_smollm2/sitecustomize.py) and an
# empty model cache: a test that needs the embedded model but is not marked `smollm2` fails
# here instead of on a lent GPU. About 7.5 minutes on the 2-core CPU.
#
#   bash bench/gpu_rehearse.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
PYTHONPATH="$PWD/bench/without_smollm2${PYTHONPATH:+:$PYTHONPATH}" POSITRONIC_CACHE="$cache" \
  .venv/bin/python -m pytest -q -rfE -p no:cacheprovider -m "not slow and not smollm2" "$@"

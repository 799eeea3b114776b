# Two entry points (see README): `make example` and `make test`. Both build .venv first.
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
MPIEXEC   := $(VENV)/bin/mpiexec
NP        ?= 4
EXAMPLE   ?= examples/train.py

.PHONY: setup example test test-gpu lint clean

$(VENV)/.installed: setup.cfg pyproject.toml scripts/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt torch
	$(PY) -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[mpich,dev]'
	touch $@

setup: $(VENV)/.installed
	@# the commit-msg hook that keeps subjects within 72 characters (a no-op outside a checkout)
	-@git rev-parse --git-dir >/dev/null 2>&1 && git config core.hooksPath .githooks

example: setup
	timeout --kill-after=30 600 $(MPIEXEC) -n $(NP) $(PY) $(EXAMPLE)

test: setup
	VENV=$(VENV) bash scripts/test-matrix.sh

# The cuda tests and the suite with NCCL, one GPU per local rank (docs/testing.md, "The GPU
# stage"); without a GPU, one line saying what it skipped, and a check that they still collect.
test-gpu: setup
	VENV=$(VENV) bash scripts/test-gpu.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy mpaccel

clean:
	rm -rf $(VENV) $(VENV)-openmpi

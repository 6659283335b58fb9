VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the interpreter the virtual environment is made from (pyproject.toml's requires-python: 3.10 to 3.13)
PYTHON ?= python3

.PHONY: install demo test test-oldest oldest-pins lint bench-gpu gpu-wheels gpu-rehearsal

# A venv without pip (`python3 -m venv` stopped half-way: on Debian and Ubuntu without the python3-venv package)
# is made again from scratch, once that package is installed, instead of failing with "No module named pip".
$(STAMP): pyproject.toml
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) run.py experiment=quickstart

# The suite on TEST_WORKERS processes (pytest-xdist) of TEST_THREADS torch threads each: run in one process on
# both threads it keeps one core busy on average (its CPU time equals its wall time), so on 2 cores two
# single-threaded workers finish it in 0.53x to 0.6x the time (docs/performance.md; tests that need 2 threads set them).
# The tests marked large_memory (a process peak of ~9 GB, which its allocator keeps after the test) run after
# the others, one at a time, in a fresh process on every thread; both runs report before the recipe fails.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1

test: $(STAMP)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not large_memory"; status=$$?; \
	$(PY) -m pytest -q -m large_memory && exit $$status

# The suite on the oldest releases pyproject.toml admits, each `>=` bound of its dependencies pinned with `==`, in
# a venv of their own (OLDEST_VENV): the bounds are true while it passes (its last run: docs/performance.md).
OLDEST_VENV ?= .venv-oldest

OLDEST_PINS = sed -n 's/^  "\([A-Za-z0-9_.-]*\)>=\([0-9.]*\)".*/\1==\2/p' pyproject.toml

oldest-pins:
	@$(OLDEST_PINS)

$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --clear $(OLDEST_VENV)
	$(OLDEST_PINS) > $(OLDEST_VENV)/oldest.txt
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/oldest.txt -e ".[dev]"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(MAKE) --no-print-directory test VENV=$(OLDEST_VENV)

lint: $(STAMP)
	$(VENV)/bin/ruff check flowformer tests run.py

# every GPU figure of docs/performance.md, one process per row: bench.md and bench.json in the run's folder
bench-gpu: $(STAMP)
	$(PY) run.py task=bench bench=gpu

# what a lent GPU machine lacks (its python3 has torch, Lightning, timm...; no registry): wheels to carry there in
# .whl/ for tools/gpu_session.py --wheels .whl (docs/performance.md, "GPU figures")
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl hydra-core==1.3.8 omegaconf==2.3.1
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

# the GPU session's steps on this CPU at tiny sizes: each command parses and starts, the files are written
gpu-rehearsal: $(STAMP)
	$(PY) tools/gpu_session.py --dry-run

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench-gpu

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) run.py experiment=quickstart

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check flowformer tests run.py

# every GPU figure of docs/performance.md, one process per row: bench.md and bench.json in the run's folder
bench-gpu: $(STAMP)
	$(PY) run.py task=bench bench=gpu

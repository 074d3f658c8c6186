# make demo: run the main example end to end on embedded defaults. make test: install and run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export WANDB_SILENT := true

.PHONY: demo test lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

VERL_SRC := $(VENV)/verl-src

$(STAMP): pyproject.toml setup.py metricbus/_speedups.c | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	# verl's sources only (its dependencies are a GPU training stack): the tests load its modules by path
	$(PY) -m pip install -q --no-deps --upgrade --target $(VERL_SRC) verl==0.9.1
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/ppo_grad_accum.py --compare

lint: $(STAMP)
	$(VENV)/bin/ruff check metricbus adapters tests examples benchmarks
	$(VENV)/bin/mypy

test: $(STAMP)
	$(VENV)/bin/ruff check metricbus adapters tests examples benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build dist *.egg-info metricbus/*.so

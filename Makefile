# Two commands do all set-up on a fresh machine: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run test bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev,airflow]'
	# speculators (vLLM's drafter format library, which the tests load our export with), without its dependencies:
	# its torchvision and torchaudio break the CPU torch; pyproject's dev extra lists what it imports
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps speculators==0.9.0
	touch $@

setup: $(STAMP)

run: setup
	$(BIN)/pipeline run $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/pipeline bench $(ARGS)

# `make test` builds .venv from nothing on first use, then runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000

.PHONY: test lint serve clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check ringserve tests bench
	$(BIN)/ruff format --check ringserve tests bench
	$(BIN)/python -m pytest -n 2 -q

serve: $(STAMP)
	$(BIN)/ringserve launch --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check ringserve tests bench
	$(BIN)/ruff format --check ringserve tests bench

clean:
	rm -rf $(VENV)

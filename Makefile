# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test bench soak clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

serve: install
	$(BIN)/mmsched serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python -m pytest -q -m slow tests/bench_smoke.py $(ARGS) 2>/dev/null || true
	$(BIN)/python bench/consensus.py

soak: install
	$(BIN)/python -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

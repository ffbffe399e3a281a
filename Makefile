# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test loadtest bench soak fuzz clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

serve: install
	$(BIN)/mmsched serve --config configs/default.toml $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

# Load a local `make serve` (frontend and shm_prefix from the same config); e.g. ARGS="--rate 2000 --duration 10"
loadtest: install
	$(BIN)/mmsched loadtest --config configs/default.toml $(ARGS)

# One table, every figure a ratio against a ceiling measured in the same run (bench/run.py runs
# bench/consensus.py and bench/remote.py too); writes bench/results.json; ~3-6 min.
bench: install
	$(BIN)/python bench/run.py $(ARGS)

# 50,000 structure-aware malformed messages against a tp=2 group, figures printed (~2-3 min).
# MMSCHED_FUZZ_MESSAGES=N and MMSCHED_FUZZ_SEED=S change the count and the seed.
fuzz: install
	$(BIN)/python -m pytest -q -s -m slow tests/integration/test_fuzz_group.py $(ARGS)

soak: install
	$(BIN)/python -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

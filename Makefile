# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test loadtest bench soak fuzz clean image image-test

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py mmsched/transport/_guarded_copy.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,hf]'
	touch $(STAMP)

serve: install
	$(BIN)/mmsched serve --config configs/default.toml $(ARGS)

# Two xdist workers, each taking whole files (a module's shared servers start once): the suite
# waits on rank start-up about half the time, so two cores finish it in about half the wall
# time. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

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

# The image of docker/Dockerfile, with docker (its daemon running) or else podman. Offline
# (no registry for python:3.11-slim, no torch index): BASE_IMAGE=mmsched-base:bookworm from
# docker/base-image.sh, and TORCH_WHEELS=DIR, a directory holding the torch wheel. PIP_CERT
# (pip's own variable, taken from the environment): a CA bundle the build's pip trusts.
# ALLOW_NO_GUARDED_COPY=1: build even where no C compiler can be installed (pooled segments
# then read with pread; otherwise such a build fails).
IMAGE           ?= mmsched:latest
BASE_IMAGE      ?=
TORCH_INDEX_URL ?=
TORCH_WHEELS    ?=
PIP_CERT        ?=
ALLOW_NO_GUARDED_COPY ?=
comma           := ,
ENGINE          ?= $(shell if docker info >/dev/null 2>&1; then echo docker; elif command -v podman >/dev/null; then echo podman; fi)
# podman builds in a chroot: no OCI runtime (cgroups, rlimits) needed, so it builds in sandboxes too
BUILD_FLAGS     ?= --network=host $(if $(filter podman,$(ENGINE)),--isolation=chroot)

image:
	@test -n "$(ENGINE)" || { echo "make image: needs docker with a running daemon, or podman (apt-get install podman)" >&2; exit 1; }
	$(ENGINE) build -f docker/Dockerfile -t $(IMAGE) $(BUILD_FLAGS) \
	  $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  $(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) \
	  $(if $(TORCH_WHEELS),--build-context torch-wheels=$(TORCH_WHEELS)) \
	  $(if $(ALLOW_NO_GUARDED_COPY),--build-arg ALLOW_NO_GUARDED_COPY=1) \
	  $(if $(PIP_CERT),--secret id=pip-cert$(comma)src=$(PIP_CERT)) .

# Builds the image, then serves from it as compose would and drives it from this host
# (tests/image/test_image.py; several minutes). Takes the variables of `make image`.
image-test: install
	@test -n "$(ENGINE)" || { echo "make image-test: needs docker with a running daemon, or podman (apt-get install podman)" >&2; exit 1; }
	MMSCHED_IMAGE_TEST=1 IMAGE=$(IMAGE) ENGINE=$(ENGINE) BASE_IMAGE=$(BASE_IMAGE) \
	  TORCH_INDEX_URL=$(TORCH_INDEX_URL) TORCH_WHEELS=$(TORCH_WHEELS) ALLOW_NO_GUARDED_COPY=$(ALLOW_NO_GUARDED_COPY) \
	  $(BIN)/python -m pytest -q -s -m slow tests/image $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

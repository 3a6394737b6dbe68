# fedrec-flwr: install / run / test / bench / plot
#
# TORCH_SPEC picks the torch build. torch==2.13.0 is the CPU wheel where pip finds one on
# local disk (this project's dev and CI machines) and the default CUDA wheel on a Linux GPU
# machine elsewhere. Override e.g. `make install TORCH_SPEC="torch==2.13.0+cpu ..."`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# extra arguments of `fedrec run`, e.g. make run ARGS="--seed 3" or ARGS="--set federation.rounds=20"
ARGS ?=
# the folder holding the real datasets (docs/datasets.md), for make bench
DATA ?= data

.PHONY: install run test deploy-test bench plot clean stop-superlink

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[dev]"
	touch $@

# The main job: FedGNN (privacy on) on the embedded synthetic dataset, through `flwr run` (`fedrec run`
# sizes the simulated federation, prints the summary, and exits non-zero if the run fails).
run: install
	$(BIN)/fedrec run --preset quickstart --out outputs/latest $(ARGS)

test: install
	$(BIN)/ruff check .
	PATH="$(CURDIR)/$(BIN):$$PATH" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 $(BIN)/python -m pytest

# A real deployment on loopback: SuperLink with TLS + SuperNode auth, one SuperNode per user / domain,
# the neighbour service, one training round of FedGNN (LDP; user-level DP with SecAgg+) and of FPPDM through
# `flwr run` (6-8 minutes on 2 cores).
deploy-test: install
	PATH="$(CURDIR)/$(BIN):$$PATH" FEDREC_DEPLOY_TEST=1 $(BIN)/python -m pytest tests/test_deploy.py

bench: install
	$(BIN)/fedrec run --preset fedgnn_paper --dataset ml-100k --data-dir $(DATA) --out outputs/bench-ml100k --centralized

plot: install
	$(BIN)/fedrec plot outputs/latest

# The local SuperLink keeps running after `flwr run`; it also keeps the environment it was
# started with (PATH, FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION).
# Stops only this user's local SuperLink of this Flower home, by process id (never other users' or runs').
stop-superlink: install
	$(BIN)/python -m fedrec_flwr.flower.local_superlink

clean:
	rm -rf outputs .cache

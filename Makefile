# memtune — `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memtune-installed
# CPU build of torch by default (on disk on our dev machines). A GPU box installs its CUDA
# torch into .venv first (see README): an importable torch is kept as it is.
TORCH_SPEC ?= torch==2.13.0
# The exact versions the suite passed with (pip constraints; `make relock` moves them).
# LOCK= installs the newest versions pyproject.toml allows instead.
LOCK ?= constraints.txt
PIP_LOCK := $(if $(LOCK),-c $(LOCK))
EXP ?= qwen2.5-7b-4x4090-lora
ARGS ?=
PYTEST_ARGS ?=
# make test's workers (pytest-xdist, a file's tests on one worker): most tests launch 2-rank
# jobs whose start-up and launcher waits leave a core idle; 2 is ~15% faster on 2 cores.
# TEST_WORKERS=0 runs in this process, one test after another. The files go to the workers
# longest first (tests/conftest.py's LONGEST_FILES), not by their number of tests.
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help install relock train test test-compile test-faults test-slurm preprocess plan merge lint format train-4x4090 bench bench-data docs docs-serve docs-reference docs-check clean

help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  make %-14s %s\n", $$1, $$2}'
	@echo "  Variables: EXP=<experiment> (train, preprocess, train-4x4090, plan), ARGS='<hydra overrides>', PYTEST_ARGS='...', TEST_WORKERS=2 (test)"

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_LOCK) --upgrade pip
	$(PY) scripts/torch_floor.py
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_LOCK) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(PIP_LOCK) -e ".[dev]"
	$(PY) -m memtune.launcher.extensions
	touch $@

install: $(STAMP) ## Create .venv and install memtune with its dev tools
	@echo "memtune installed in $(VENV)"

# `make train` is the CPU demo unless EXP= is given (EXP's default names the GPU job's experiment).
TRAIN_EXP := $(if $(filter command line environment,$(origin EXP)),experiment=$(EXP))
# plan and train-4x4090 name EXP's experiment unless ARGS names one (it won silently, as last)
GIVEN_EXP := $(if $(findstring experiment=,$(ARGS)),,experiment=$(EXP))

train: $(STAMP) ## Run the embedded CPU demo (tiny Qwen2, 2 ranks, ZeRO-3); EXP=demo-vl-cpu: the image demo; ARGS= adds overrides
	@$(PY) train.py $(TRAIN_EXP) $(ARGS)

test: $(STAMP) ## Run the test suite (CPU; real DeepSpeed ranks)
	@$(VENV)/bin/memtune machine
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

relock: ## Move constraints.txt to the newest versions pyproject.toml allows, reinstall, run the suite
	rm -rf $(VENV)-relock
	python3 -m venv $(VENV)-relock
	$(VENV)-relock/bin/python -m pip install -q --upgrade pip
	$(VENV)-relock/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)-relock/bin/python -m pip install -q -c <(echo "$(TORCH_SPEC)") -e ".[dev]"
	$(VENV)-relock/bin/python scripts/write_lock.py $(VENV)-relock constraints.txt
	rm -rf $(VENV)-relock
	$(MAKE) install
	$(MAKE) test
	$(MAKE) test-compile
	$(MAKE) test-faults
	@echo "memtune: constraints.txt moved and tested; update the README's tested versions, then commit both"

test-compile: $(STAMP) ## The compiled-layers tests (trainer.compile; ~2 min cold: inductor builds C++ kernels)
	$(PY) -m pytest tests/test_compile.py -m compile $(PYTEST_ARGS)

# Liger's kernels in Triton's interpreter: liger-kernel at the version the GPU check carries
# (bench/gpu_wheels.sh's LIGER_VERSION) and triton at the lent image's, installed apart in
# $(KERNELS_SITE)/ (~650 MB), never in the .venv; reinstalled only when the pins change.
KERNELS_SITE := .kernels-site
KERNELS_PINS := liger-kernel==$(shell sed -n 's/^LIGER_VERSION=//p' bench/gpu_wheels.sh) triton==3.6.0
test-kernels: $(STAMP) ## Liger's rotary kernel run by Triton's interpreter on CPU (installs liger-kernel + triton apart, in .kernels-site/: ~2 min the first time, ~20 s after)
	@grep -qxF "$(KERNELS_PINS)" $(KERNELS_SITE)/.pins 2>/dev/null || { \
	  rm -rf $(KERNELS_SITE) && \
	  $(PY) -m pip install -q --no-deps --target $(KERNELS_SITE) $(KERNELS_PINS) && \
	  echo "$(KERNELS_PINS)" > $(KERNELS_SITE)/.pins; }
	PYTHONPATH=$(CURDIR)/$(KERNELS_SITE) $(PY) -m pytest tests/test_kernels.py -m kernels $(PYTEST_ARGS)

test-faults: $(STAMP) ## Whole jobs stopped, killed, out of memory, resumed on other world sizes (~11 min)
	$(PY) -m pytest -m faults -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-slurm: $(STAMP) ## Slurm tier: a real 2-node cluster on 127.0.0.1 (root; apt-installs Slurm + MariaDB if missing; ~3.5 min plus that install)
	$(PY) -m pytest tests/slurm -m slurm $(PYTEST_ARGS)

test-ssh: $(STAMP) ## The hostfile form over real ssh: two nodes on 127.0.0.1 through an sshd of its own and pdsh (root: a pid namespace, and apt-installs pdsh + openssh-server if missing; ~1.5 min)
	$(PY) -m pytest tests/ssh -m ssh $(PYTEST_ARGS)

preprocess: $(STAMP) ## Tokenize the data into its cache and print the counts (EXP= as for train; ARGS= for data.*)
	$(PY) train.py $(TRAIN_EXP) preprocess_only=true $(ARGS)

plan: $(STAMP) ## Per-rank memory plan of EXP (default qwen2.5-7b-4x4090-lora); launches nothing
	@$(VENV)/bin/memtune plan $(GIVEN_EXP) $(ARGS)

merge: $(STAMP) ## Merge an adapter into its base: ADAPTER=RUN_DIR/adapter OUT=new-dir/ [ARGS=--dtype fp32]
	@test -n "$(ADAPTER)" -a -n "$(OUT)" || { echo "usage: make merge ADAPTER=RUN_DIR/adapter OUT=DIR"; exit 2; }
	$(VENV)/bin/memtune merge "$(ADAPTER)" "$(OUT)" $(ARGS)

lint: $(STAMP) ## ruff (lint + format check) and mypy over src/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP) ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

train-4x4090: $(STAMP) ## The real job: EXP (default qwen2.5-7b-4x4090-lora) on 4 GPUs; ARGS= for data/model paths
	# train.py validates the config and plans memory (exit 2 if it cannot fit); runs the GPU
	# preflight (count, names, memory, driver, a cross-GPU copy and an NCCL all-reduce; prints the
	# NCCL_P2P_DISABLE / NCCL_IB_DISABLE decision, saved as RUN_DIR/preflight.json; exit 2 on a
	# machine without 4 GPUs); tokenizes the data, writes the run dir; then starts the ranks with:
	#   RANK=r LOCAL_RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> CUDA_VISIBLE_DEVICES=<cards> python -u -m memtune.worker <run dir>
	# for r in 0..3 (DeepSpeed's launcher's environment; the cards: the first 4 of CUDA_VISIBLE_DEVICES; 0-3 when it is unset)
	$(PY) train.py $(GIVEN_EXP) launcher.num_ranks=4 $(ARGS)

bench: $(STAMP) ## Training benchmark: memtune as shipped vs HF Trainer + peft, with ablations; the MoE block -> bench/results/ (~18 min)
	$(PY) bench/bench.py $(ARGS)
	$(PY) bench/moe_bench.py $(ARGS)

bench-data: $(STAMP) ## Data benchmark: preprocessing tokens/s and padding efficiency -> bench/results/
	$(PY) bench/data_bench.py $(ARGS)

docs: $(STAMP) ## Build the documentation site into site/ (MkDocs, strict: a warning or a broken link fails)
	$(PY) scripts/docs_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(STAMP) ## Serve the documentation at http://127.0.0.1:8000, rebuilt as you edit docs/
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

docs-reference: $(STAMP) ## Regenerate docs/reference/ (options from the schema's docstrings, refusals from the source)
	$(PY) scripts/docs_reference.py

docs-check: docs ## The built site in headless Chromium: pages render, links resolve, screenshots (apt-installs chromium if missing; root)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { test "$$(id -u)" -eq 0 && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	$(PY) -m pytest tests/test_docs_site.py -m browser -p no:cacheprovider $(PYTEST_ARGS)

clean: ## Remove run outputs (outputs/, multirun/); keeps .venv
	rm -rf outputs multirun

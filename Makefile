# specsplit — one entry point for setup, tests, demo and benchmarks.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/specsplit/v1/*.proto)
PB_DIR := shared/_pb
PB_STAMP := $(PB_DIR)/.generated

# demo options: make demo PROMPT="..." MAX_TOKENS=96 TEMPERATURE=0 K=4
PROMPT ?=
MAX_TOKENS ?= 96
TEMPERATURE ?= 0
K ?= 4

.PHONY: setup proto test lint format demo bench bench-quick clean

setup: $(STAMP) $(PB_STAMP)

# torch goes first and pinned, so pip never resolves a multi-GB CUDA torch on a CPU machine.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[edge,cloud,dev]'
	touch $@

proto: $(STAMP)
	rm -rf $(PB_DIR) && $(MAKE) $(PB_STAMP)

# Stubs are generated, never committed. grpc's generated import is absolute
# ("from specsplit.v1 import ..."); rewrite it to live under shared._pb.
$(PB_STAMP): $(PROTO_SRC) | $(STAMP)
	mkdir -p $(PB_DIR)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(PB_DIR) --pyi_out=$(PB_DIR) \
		--grpc_python_out=$(PB_DIR) $(PROTO_SRC)
	sed -i 's/^from specsplit\.v1 import/from shared._pb.specsplit.v1 import/' \
		$(PB_DIR)/specsplit/v1/*_pb2_grpc.py
	touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup lint
	$(VENV)/bin/pytest -q

demo: setup
	$(PY) -m bench.demo $(if $(PROMPT),--prompt "$(PROMPT)") --max-new-tokens $(MAX_TOKENS) \
		--temperature $(TEMPERATURE) --k $(K)

bench: setup
	$(PY) -m bench.run

bench-quick: setup
	$(PY) -m bench.run --quick

clean:
	rm -rf $(PB_DIR) .pytest_cache .ruff_cache .hypothesis

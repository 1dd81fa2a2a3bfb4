# The two commands of the README, and the builds behind them.
#   make serve  set up a fresh Debian machine, build, serve the built-in demo model on 127.0.0.1:8000
#   make test   set up, build, run every CPU test, the Python module's tests (pip install . + pytest), then the
#               openai / @anthropic-ai/sdk clients (what CI runs)
# Other targets: build, python-test, asan-test (recipe, scheduler and sampler tests under ASan+UBSan), fuzz (build
# the libFuzzer targets), fuzz-ci (each for FUZZ_SECONDS), fuzz-long (each for an hour), bench.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: setup build test python-test sdk-test asan-test fuzz fuzz-ci fuzz-long bench serve clean

setup:
	bash scripts/setup.sh

build: setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	BUILD=$(BUILD) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) bash tests/python/run.sh
	BUILD=$(BUILD) bash tests/sdk/run.sh

# deepseek_recipe: pip install . (the in-tree backend, offline) into $(BUILD)/python-site, then pytest.
python-test: setup
	BUILD=$(BUILD) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) bash tests/python/run.sh

sdk-test: build
	BUILD=$(BUILD) bash tests/sdk/run.sh

# SERVE_ARGS: more flags for the server, e.g. make serve SERVE_ARGS=--dspark-enable
serve: build
	$(BUILD)/apps/deepinfer serve --model-path models/demo --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

asan-test: setup
	cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DDEEPINFER_SANITIZE=ON
	cmake --build build-asan -j $(JOBS) --target recipe_tests engine_tests
	# Each binary as one process, the two at once (ctest's process per test spent 270 s of ASan start-ups on 2
	# cores; this takes 35 s). A sanitizer report aborts its binary; leaks are checked at each one's exit.
	build-asan/tests/recipe_tests --gtest_brief=1 & recipe=$$!; \
	  build-asan/tests/engine_tests --gtest_brief=1; engine=$$?; \
	  wait $$recipe && [ $$engine = 0 ]

fuzz: setup
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDEEPINFER_FUZZ=ON -DDEEPINFER_SANITIZE=ON
	cmake --build build-fuzz -j $(JOBS) --target fuzz_all

# Every fuzz target for FUZZ_SECONDS each (CI: 20), or for hours (fuzz-long: FUZZ_LONG_SECONDS each).
FUZZ_SECONDS ?= 20
FUZZ_LONG_SECONDS ?= 3600
fuzz-ci: fuzz
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

fuzz-long: fuzz
	bash scripts/fuzz.sh $(FUZZ_LONG_SECONDS)

bench: build
	$(BUILD)/bench/bench_recipe
	$(BUILD)/bench/bench_engine

clean:
	rm -rf $(BUILD) build-asan build-fuzz

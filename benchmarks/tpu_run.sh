#!/usr/bin/env bash
# Issue 28 on one TPU v5e chip: install (../shared/TPU.md recipe, .whl-tpu carried along), then
# benchmarks/tpu_bench.py (results in $OUT/tpu_bench.jsonl and $OUT/tpu_bench.md as it goes, log in
# $OUT/log; BENCH=benchmarks/other.py runs another script taking --budget-s and --out), then,
# in the time left of ~570 s, the attention and model tests in one process ($OUT/tests.log).
# Usage on the chip: bash benchmarks/tpu_run.sh [extra tpu_bench.py arguments]
# Environment: LIMIT_S (whole run), BENCH_S (the bench's budget; 0: no bench), TESTS, PYTEST_ARGS,
# TORCH=1 (install the machine's torch CPU wheel, for the parity tests), CHECK=1 (first:
# benchmarks/export_roundtrip_check.py), RECIPE=1 (last: the default job, see below).
# .whl-tpu: the wheels of ../shared/TPU.md plus pydantic==2.14.4 pydantic-core==2.50.5
# annotated-types==0.8.0 typing-inspection==0.4.5 (the pins of requirements-demo.lock), downloaded
# with the same `pip download` flags.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/tpu_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
  --index-url file:///opt/pypi/simple --find-links "$PWD/.whl-tpu" --target /tmp/site \
  flax optax orbax-checkpoint grain gguf transformers tokenizers safetensors datasets pyyaml tqdm \
  tensorboardX pydantic 2>&1 | tail -5 | tee "$OUT/install.log"
if [ "${TORCH:-0}" = 1 ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
    --index-url file:///opt/pypi/simple --find-links /opt/wheels --find-links "$PWD/.whl-tpu" \
    --target /tmp/site torch==2.13.0 2>&1 | tail -3 | tee -a "$OUT/install.log"
fi
# The SmolLM2 tokenizer saved as a directory, for the tests (tests/data_fixtures.py); make it
# here with: python -c "from rewardax.models import *; load_tokenizer(smollm2_gguf_path()).save_pretrained('.tok-smollm2')"
# and carry it with .whl-tpu.
[ -d .tok-smollm2 ] && export REWARDAX_TEST_TOKENIZER=$PWD/.tok-smollm2
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD/src PYTHONUNBUFFERED=1
echo "installed after ${SECONDS}s" | tee -a "$OUT/log"
if [ "${CHECK:-0}" = 1 ]; then  # trained vs exported+reloaded rewards and parameters
  timeout 120 python3 benchmarks/export_roundtrip_check.py --out "$OUT" 2>&1 | grep -v Warning | tail -40 | tee -a "$OUT/log"
fi
# RECIPE=1 (after the tests): the default job (`rewardax train`, configs/default.yaml) on a
# random-init model of SmolLM2-135M's shape with its real tokenizer (the GGUF does not travel):
# wall time and held-out accuracy into $OUT/recipe_summary.json.
# The bench starts no configuration after its budget; the last one may run ~60 s past it.
BUDGET=${BENCH_S:-$((LIMIT_S - SECONDS - 150))}
if [ "$BUDGET" -gt 0 ]; then
  python3 "${BENCH:-benchmarks/tpu_bench.py}" --budget-s "$BUDGET" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log"
  echo "bench exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/log"
fi
LEFT=$((LIMIT_S - SECONDS))
if [ "$LEFT" -gt 40 ]; then
  # TESTS: the test files to run (default: attention and model); PYTEST_ARGS, e.g. "-x".
  # SIGINT first: pytest then stops and still prints the failures it has seen.
  timeout -s INT -k 30 "$((LEFT - 30))" python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:--x} \
    ${TESTS:-tests/test_attention_kernels.py tests/test_models_reward.py} 2>&1 | tee "$OUT/tests.log"
  echo "tests exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/log"
else
  echo "no time left for the tests (${LEFT}s)" | tee -a "$OUT/log"
fi
if [ "${RECIPE:-0}" = 1 ] && [ -d .tok-smollm2 ]; then
  python3 - <<'PY' 2>&1 | tail -2 | tee -a "$OUT/log"
import sys
sys.path.insert(0, "benchmarks")
from flax import nnx
import rewardax as rx
from tpu_bench import model_config
rx.RewardModel(model_config("smollm2-135m", False), rngs=nnx.Rngs(0)).save_pretrained(
    "/tmp/smollm2-shape", tokenizer=rx.load_tokenizer(".tok-smollm2"))
PY
  LEFT=$((LIMIT_S - SECONDS))
  timeout -s INT "$LEFT" python3 -c "import sys; from rewardax.cli import main; sys.exit(main(sys.argv[1:]))" \
    train --model.path=/tmp/smollm2-shape --checkpoint.save_directory=/tmp/recipe --no-report \
    --logging.progress_bar=false 2>&1 | tail -25 | tee "$OUT/recipe.log"
  echo "recipe exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/log"
  cp /tmp/recipe/*/summary.json "$OUT/recipe_summary.json" 2>/dev/null
fi

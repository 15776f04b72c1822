#!/usr/bin/env bash
# GPU check of issue 6: tokens/s and MFU of the default job and of a Qwen2-0.5B-shaped model
# (random weights, bf16, 2k context) on all local accelerators. Meant to finish well under 8 minutes
# on one H200; prints one line per job and a final JSON line. Extra arguments go to gpu_check.py
# (e.g. --steps 5, --peak-tflops 989).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import jax; print('devices:', jax.devices())"
timeout 450 "$PY" benchmarks/gpu_check.py "$@"

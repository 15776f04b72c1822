"""Peak host memory while loading a reward model, compared with the model's own size.

Each load runs in a fresh subprocess, so ``ru_maxrss`` (the process's lifetime peak RSS) measures
that load alone; the baseline is the peak after importing rewardax and initialising JAX. The
safetensors case loads a directory exported from the SmolLM2 GGUF (created once in a temp dir).

Usage:
    .venv/bin/python benchmarks/bench_load_memory.py [--dtypes float32,bfloat16]

Prints one line per case and, last, one JSON object with all figures (MiB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp
from flax import nnx
from rewardax.models import AutoRewardModel

jnp.zeros(1).block_until_ready()  # initialise the backend before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
path, dtype = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
model = AutoRewardModel.from_pretrained(path, dtype=dtype)
jax.block_until_ready(nnx.state(model))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
size = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 2**20
if len(sys.argv) > 3:
    model.save_pretrained(sys.argv[3])
print(json.dumps({"baseline_mib": base, "peak_mib": peak, "model_mib": size, "seconds": seconds}))
"""


def _run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        sys.exit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    from rewardax.models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "smollm2-rm"
        for dtype in args.dtypes.split(","):
            extra = [str(export)] if dtype == "float32" and not export.exists() else []
            results[f"gguf/{dtype}"] = _run(str(gguf), dtype, *extra)
        if not export.exists():
            _run(str(gguf), "float32", str(export))
        for dtype in args.dtypes.split(","):
            results[f"safetensors/{dtype}"] = _run(str(export), dtype)
    for case, r in results.items():
        extra = r["peak_mib"] - r["baseline_mib"]
        print(
            f"{case:22s} model {r['model_mib']:7.1f} MiB  peak RSS {r['peak_mib']:7.1f} MiB "
            f"(+{extra:6.1f} over baseline {r['baseline_mib']:6.1f}) = "
            f"{extra / r['model_mib']:.2f}x model  load {r['seconds']:.1f} s"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

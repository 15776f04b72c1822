"""Attention on long rows: query block size and backward pass, forward + backward time and memory.

    .venv/bin/python benchmarks/bench_attention.py [--rows 2] [--length 2048] [--blocks 256,512]
        [--backward written,autodiff]

Issue #7's model (`compare/bench_common.py`'s MODEL: Llama, hidden 256, 4 layers, 4 heads, MLP 704,
vocabulary 49,152, float32):
the gradient of the summed rewards of `--rows` rows of `--length` tokens, once per value of
`rewardax.models.transformer.ATTENTION_QUERY_BLOCK` (a block >= the length is the old one-block
computation) and of `--backward`: `written` is the library's `transformer.attend` with its
written-out backward; `autodiff` swaps in JAX's autodiff of the very same forward code
(`transformer._attend_forward`), the A/B of that backward. Each setting runs in its own child
process, so peak RSS (`wait4`) is its own. Prints one JSON line per setting: median seconds of 3
timed calls after one compiling call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The side-by-side harness's model (issue #7), defined once in compare/bench_common.py.
sys.path.insert(0, str(Path(__file__).resolve().parent / "compare"))
from bench_common import MODEL


def child(rows: int, length: int, block: int, backward: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import rewardax.models.transformer as transformer
    from rewardax.models import ModelConfig, RewardModel

    transformer.ATTENTION_QUERY_BLOCK = block
    if backward == "autodiff":
        transformer.attend = lambda q, k, v, m, scale: transformer._attend_forward(
            q, k, v, m, scale
        )[0]
    elif backward != "written":
        raise SystemExit(f"--backward {backward!r}: written or autodiff")
    config = ModelConfig(**MODEL)
    model = RewardModel(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (rows, length), 3, 49152)
    mask = jnp.ones((rows, length), jnp.int32)

    @jax.jit
    def grad(params):
        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p, rest)(ids, mask).logits)

        return jax.grad(loss)(params)

    jax.block_until_ready(grad(params))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(grad(params))
        times.append(time.perf_counter() - start)
    return {"median_s": round(sorted(times)[1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--blocks", default="256,512")
    parser.add_argument("--backward", default="written,autodiff")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.rows, args.length, args.child, args.backward)))
        return
    settings = [
        (int(block), backward)
        for block in args.blocks.split(",")
        for backward in args.backward.split(",")
    ]
    for block, backward in settings:
        cmd = [sys.executable, __file__, "--rows", str(args.rows), "--length", str(args.length)]
        cmd += ["--backward", backward, "--child", str(block)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            error = f"child exited with status {status}"
            print(json.dumps({"block": block, "backward": backward, "error": error}))
            continue
        result = json.loads(out.strip().splitlines()[-1])
        result.update(
            block=block,
            backward=backward,
            rows=args.rows,
            length=args.length,
            one_block=block >= args.length,
            peak_rss_mib=round(usage.ru_maxrss / 1024),
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""TPU throughput of RewardTrainer's jitted step, today's kernels against the backend's (issue 28).

    python benchmarks/tpu_bench.py [--set kernels|remat|remat2|tune|offload|offload_attention|microbatch|save_mlp|profile|rope|accumulate|indexed|flash|defaults|tree|attention]
        [--budget-s 420] [--steps 8] [--profile N] [--out DIR] [--tiny]

Random-init models of real shapes (SmolLM2-135M, Qwen2.5-0.5B, Qwen2.5-1.5B), bf16 compute, float32
parameters and Adam moments (bf16 both for 1.5B), padded rows of exactly T tokens, remat `full`,
run through RewardTrainer's own jitted train step. Each configuration runs with
`kernels="cpu"` (today's formulation: written projection backward, blocked XLA attention) and
`kernels="pallas"` (autodiff projections, splash attention). A batch is first compiled
(`.lower().compile()`); one whose compiled program needs more than `--hbm-gib` is skipped, the
next (smaller) batch of its list tried.

Before the models, attention alone (Qwen2.5-0.5B heads: 14 query, 2 key/value heads of 64,
bf16, forward + backward, 16 x 2048 tokens): blocked XLA attention, one-einsum XLA attention and
splash at several tiles; the fastest splash tiles are then used for the models. 64 x 512 last.

MFU = (6 x non-embedding params + 12 x layers x hidden x T) x tokens/s / 197e12 (remat recompute not
counted); attention % of peak = 3.5 x 2 x N x H x T^2 x D (causal half of QK^T and PV forward, 2.5x
that backward) / time / 197e12. HBM = the compiled program's argument + output - aliased + temp
bytes (`memory_analysis()`; the runtime's `memory_stats()` leaves XLA's temporaries out on TPU).

Writes one JSON line per result to OUT/tpu_bench.jsonl as it goes (OUT: `--out`, else $OUT, else
./tpu_bench_out) and rewrites OUT/tpu_bench.md (a table) after each. Every configuration runs in
its own try/except: an error is a result line, not the end of the run. Configurations that would
start after `--budget-s` seconds are skipped. `--tiny` runs tiny shapes for a few steps on any
backend (a check of the script itself; splash in interpret mode off a TPU). Job lists that run on
`Kernels`' default tiles (not kernels, tune, remat, remat2, defaults, tree) combine: `--set
profile,save_mlp`; `--jobs` then indexes the combined list.
`--profile N`: after each job's timing, N more steps traced with `jax.profiler`, their device
time summed per op into OUT/profile.md (`device_profile.py`), the first job's trace kept as
OUT/trace.xplane.pb; the attention bench's timed programs are traced the same way (N calls).
`--set attention`: attention alone with the model's tiles at `ATTENTION_SHAPES`, JAX's splash
kernel called as it is, and rewardax's own kernel (`ATTENTION_FLASH_TILES`); no models.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

START = time.monotonic()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import rewardax as rx  # noqa: E402
from rewardax import data as rdata  # noqa: E402
from rewardax.models.kernels import (  # noqa: E402
    FLASH_TILES,
    Kernels,
    select_kernels,
    xla_attention,
)
from rewardax.models.pallas_attention import splash_attention  # noqa: E402
from rewardax.models.transformer import attention_mask, blocked_attention  # noqa: E402
from rewardax.sharding import global_batch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import device_profile  # noqa: E402

PEAK_FLOPS = 197e12  # TPU v5e, bf16 dense
GIB = 2**30

SHAPES = {  # Hugging Face config.json values
    "smollm2-135m": dict(
        architecture="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=1e5,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        architecture="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        architecture="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
}
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=512,
)


@dataclasses.dataclass
class Job:
    shape: str
    length: int
    kernels: str  # "cpu" (today's), "pallas" (the TPU's) or "xla"
    batches: tuple[int, ...]  # pairs per step, largest first
    param_dtype: str = "float32"
    remat: str = "full"
    tiles: dict | None = None  # splash tiles, `Kernels` fields; None: the attention bench's best
    optim: dict = dataclasses.field(default_factory=dict)  # optim settings, e.g. offload_state
    lora_rank: int = 0  # LoRA adapters (frozen base: 4 x params per token in the MFU)
    microbatches: int = 1  # each step's pairs in this many microbatches (gradient accumulation)


# In priority order (the budget cuts the tail): issue 28's targets, old vs new, then the rest.
JOBS = [
    Job("qwen2.5-0.5b", 2048, "pallas", (16, 8)),
    Job("qwen2.5-0.5b", 2048, "cpu", (8,)),
    Job("qwen2.5-0.5b", 512, "pallas", (64, 32)),
    Job("qwen2.5-0.5b", 512, "cpu", (32,)),
    Job("smollm2-135m", 2048, "pallas", (32, 16)),
    Job("smollm2-135m", 2048, "cpu", (16,)),
    Job("qwen2.5-1.5b", 2048, "pallas", (4, 2), param_dtype="bfloat16"),
    Job("smollm2-135m", 512, "pallas", (64, 32)),
    Job("qwen2.5-1.5b", 2048, "cpu", (2,), param_dtype="bfloat16"),
]
# `--set remat`: where the time goes besides attention. Remat policies that keep more activations
# (smaller batches), splash tiles for 512-token rows, the one-einsum XLA attention at 512.
REMAT_JOBS = [
    Job("qwen2.5-0.5b", 2048, "pallas", (8, 4), remat="save_dots"),
    Job("qwen2.5-0.5b", 2048, "pallas", (4, 2), remat="none"),
    Job(
        "qwen2.5-0.5b",
        512,
        "pallas",
        (32, 16),
        tiles=dict(block_q=256, block_kv=256, fused_backward=True),
    ),
    Job("qwen2.5-0.5b", 512, "pallas", (32, 16), remat="save_dots"),
    Job("qwen2.5-0.5b", 512, "xla", (32, 16)),
    Job("smollm2-135m", 2048, "pallas", (16, 8), remat="save_dots"),
    Job("smollm2-135m", 2048, "pallas", (8, 4), remat="none"),
    Job("qwen2.5-1.5b", 2048, "pallas", (2, 1), param_dtype="bfloat16", remat="save_dots"),
]
# `--set remat2`: remat none (smaller batches) against today's kernels, after `--set remat` showed
# SmolLM2 at 2048 tokens 23.9% -> 32.2% MFU with remat none at 4 pairs.
REMAT2_JOBS = [
    Job("qwen2.5-0.5b", 512, "pallas", (16, 8), remat="none"),
    Job("qwen2.5-0.5b", 512, "cpu", (16, 8), remat="none"),
    Job("smollm2-135m", 2048, "cpu", (4,), remat="none"),
    Job("smollm2-135m", 512, "pallas", (16, 8), remat="none"),
]
# `--set tune`: splash tiles swept with separate forward and backward tiles (the best of each
# composed), then remat "save_attention" (no second attention forward) against "none"/"full".
TUNE_JOBS = [
    Job("smollm2-135m", 2048, "pallas", (16, 8), remat="save_attention"),
    Job("smollm2-135m", 2048, "pallas", (4,), remat="none"),
    Job("qwen2.5-0.5b", 2048, "pallas", (8, 4), remat="save_attention"),
    Job("qwen2.5-0.5b", 512, "pallas", (32, 16), remat="save_attention"),
    Job("qwen2.5-1.5b", 2048, "pallas", (2, 1), param_dtype="bfloat16", remat="save_attention"),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,)),
    Job("smollm2-135m", 512, "pallas", (32, 16), remat="save_attention"),
]
# `--set offload`: host-offloaded optimizer state and master weights (issue #29's settings) and
# LoRA, measured on the chip; remat none at 512 tokens for both kernel formulations.
OFFLOAD_JOBS = [
    Job(
        "qwen2.5-1.5b",
        2048,
        "pallas",
        (2, 1),
        remat="full",
        optim=dict(offload_state=True, offload_params=True),
    ),
    Job(
        "qwen2.5-0.5b",
        2048,
        "pallas",
        (8, 4),
        remat="save_attention",
        optim=dict(offload_state=True),
    ),
    Job(
        "qwen2.5-1.5b",
        2048,
        "pallas",
        (4, 2, 1),
        param_dtype="bfloat16",
        remat="save_attention",
        lora_rank=16,
    ),
    Job("qwen2.5-0.5b", 512, "pallas", (16, 8), remat="none"),
    Job("qwen2.5-0.5b", 512, "cpu", (16, 8), remat="none"),
    Job("qwen2.5-0.5b", 2048, "pallas", (4, 2), remat="none", optim=dict(offload_state=True)),
    Job("smollm2-135m", 512, "pallas", (32, 16), remat="none"),
    Job("smollm2-135m", 512, "cpu", (32, 16), remat="none"),
]
# `--set offload_attention`: remat "offload_attention" (the splash kernel's residuals in host
# memory; `rewardax plan` on a v5e: 0.5B at 8 x 2048 needs 13.40 GiB on the chip, "full" 13.74,
# "save_attention" 23.5) against "full" at the same pairs, and the residuals kept in 128-wide rows
# (`Kernels.dense_residuals`) against as laid out, for both policies that keep them. SmolLM2's
# "save_attention" fits 8 pairs, not 16: timed at 8 (what `auto` picks, as 8 x 2).
DENSE = dict(dense_residuals=True)
OFFLOAD_ATTENTION_JOBS = [
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="offload_attention"),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="full"),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="offload_attention", tiles=DENSE),
    Job("qwen2.5-1.5b", 2048, "pallas", (2,), param_dtype="bfloat16", remat="offload_attention"),
    Job("qwen2.5-1.5b", 2048, "pallas", (2,), param_dtype="bfloat16", remat="full"),
    Job("smollm2-135m", 2048, "pallas", (8,), remat="save_attention"),
    Job("smollm2-135m", 2048, "pallas", (8,), remat="save_attention", tiles=DENSE),
    Job("qwen2.5-0.5b", 2048, "pallas", (4,), remat="save_attention"),
    Job("qwen2.5-0.5b", 2048, "pallas", (4,), remat="save_attention", tiles=DENSE),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="offload_attention", tiles=DENSE),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="full"),
]
# `--set microbatch`: smaller microbatches than `auto` tries today (it stops at 16k tokens a
# microbatch, `plan.MIN_MICROBATCH_TOKENS`, because every fast step measured had that many; 1.5B
# at 2 pairs of 2048, 8k tokens, then reached 61.6% MFU). Less remat on 8k- and 4k-token
# microbatches against what `auto` picks for the same pairs per update (timed in the same run).
# 0.5B at 8 x 2048, compiled for a v5e by `rewardax plan`: save_attention as 2 pairs x 4 needs
# 16.07 GiB (refused; 128-wide residuals save ~0.75 GiB there), as 1 pair x 8 13.55 GiB.
MICROBATCH_JOBS = [
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=4, tiles=DENSE),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="full"),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention", microbatches=4),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention", microbatches=2),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="none", microbatches=4),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="none", microbatches=2),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention"),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=4),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=2),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention"),
]
# `--set save_mlp`: remat "save_attention_mlp" (the splash residuals plus attention's output
# projection and the MLP's gate and up projections: no matmul recomputed) against the best of the
# 2026-12-06 sixth session's runs with the same pairs per update. Compiled for a v5e by
# `rewardax plan` it fits only SmolLM2's microbatches: 4 pairs x 4 of 2048 tokens 11.87 GiB,
# 16 x 2 of 512 11.97 GiB (8 x 2 of 2048: 19.57; Qwen2.5-0.5B 1 x 8 of 2048: 16.23, 4 x 4 of
# 512: 16.26; Qwen2.5-1.5B, bf16 state, 1 x 2 of 2048: 31.64).
SAVE_MLP_JOBS = [
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=4),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=8),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention", microbatches=4),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention_mlp", microbatches=2),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention_mlp", microbatches=4),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=4),
]
# `--set profile` (with `--profile`): what `auto` chose in the 2026-12-06 sixth session's
# `--set defaults` run, and 1.5B's best row, each traced per op after its timing.
PROFILE_JOBS = [
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention"),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="none", microbatches=8),
    Job("qwen2.5-1.5b", 2048, "pallas", (2,), param_dtype="bfloat16", remat="full"),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=4),
]
# `--set rope`: RoPE's rotation as a [D, D] product (`Kernels.rope_matmul`, on by default with
# splash since 2026-12-07) on the shapes of `--set profile`, where the rotation's half-width
# slices took 9-12% of a step, and once without it (the same pairs: A/B in one run).
HALVES = dict(rope_matmul=False)
ROPE_JOBS = [
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention"),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention", tiles=HALVES),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=8),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=4),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention", microbatches=4),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention_mlp", microbatches=4),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention_mlp", microbatches=2),
    Job("qwen2.5-1.5b", 2048, "pallas", (2,), param_dtype="bfloat16", remat="full"),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="none", microbatches=8),
]
# `--set accumulate`: gradient accumulation by reference (`Kernels.accumulate_by_reference`, on
# for a TPU since 2026-12-07 third session: each microbatch's backward pass adds the float32
# gradients into the step's sums in place). For each of `--set defaults`' shapes: `auto`'s
# choice before it, by value and by reference; `auto`'s choice with it (the memory it frees
# lets larger microbatches or less remat fit; compiled, not timed); save_attention_mlp, which
# now fits Qwen2.5-0.5B. The last two (added for the run of 2026-12-07 fourth session):
# save_attention_mlp on one pair a microbatch, one halving past the fastest measured.
# Results: benchmarks/results/tpu_v5e_2026-12-07d_accumulate.md.
BY_VALUE = dict(accumulate_by_reference=False)
ACCUMULATE_JOBS = [
    Job(
        "qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8, tiles=BY_VALUE
    ),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=4),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention_mlp", microbatches=8),
    Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention_mlp", microbatches=4),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="none", microbatches=4),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention_mlp", microbatches=4),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention_mlp", microbatches=8),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="none", microbatches=8, tiles=BY_VALUE),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="none", microbatches=8),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="none", microbatches=4),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=8),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=4, tiles=BY_VALUE),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=4),
    Job("smollm2-135m", 512, "pallas", (32,), remat="none", microbatches=2),
    Job("smollm2-135m", 512, "pallas", (32,), remat="save_attention_mlp", microbatches=4),
    Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention_mlp", microbatches=16),
    Job("smollm2-135m", 2048, "pallas", (16,), remat="save_attention_mlp", microbatches=16),
]
# `--set indexed`: `Kernels.indexed_layers` (the layer loop over indices, each layer's parameters
# read inside the remat'd body) against the loop over the stacked parameters, at the settings
# `auto` chose for `--set defaults`' four shapes on 2026-12-07 (fourth and fifth sessions).
# Compiled for a v5e it leaves out the float32 copy of each MLP matrix's slice of the sums (~19
# ms of 372 at 0.5B 16 x 512 in that profile) and the per-layer bf16 weight copies, in no more
# memory. Timed on the chip (main a0ff8e3, where the flag was still off by default): 0.5B 54.0 ->
# 57.0% MFU at 2048, 51.1 -> 55.9% at 512; SmolLM2 +0.2 points. Now a TPU's default: the jobs
# with SCANNED run the loop over the stacked parameters. Results:
# benchmarks/results/tpu_v5e_2026-12-07e_indexed.md.
SCANNED = dict(indexed_layers=False)
# (shape, T, pairs, microbatches) of save_attention_mlp that `auto` chose (--set defaults).
AUTO_CHOICES = (
    ("qwen2.5-0.5b", 2048, 8, 8),
    ("qwen2.5-0.5b", 512, 16, 8),
    ("smollm2-135m", 2048, 16, 8),
    ("smollm2-135m", 512, 32, 4),
)
INDEXED_JOBS = [
    Job(shape, t, "pallas", (pairs,), remat="save_attention_mlp", microbatches=mb, tiles=tiles)
    for shape, t, pairs, mb in AUTO_CHOICES
    for tiles in (SCANNED, None)
]
# `--set flash`: rewardax's own attention kernels (`Kernels.flash`, a TPU's default since
# 2026-12-08) against splash in the model, at `auto`'s settings (as `--set indexed`) and at
# 1.5B's (bf16 parameters, 2 pairs, remat full).
SPLASH = dict(flash=None)
FLASH_JOBS = [
    Job(shape, t, "pallas", (pairs,), remat="save_attention_mlp", microbatches=mb, tiles=tiles)
    for shape, t, pairs, mb in AUTO_CHOICES
    for tiles in (SPLASH, None)
] + [
    Job("qwen2.5-1.5b", 2048, "pallas", (2,), param_dtype="bfloat16", remat="full", tiles=tiles)
    for tiles in (SPLASH, None)
]
TINY_JOBS = [
    Job("qwen2.5-0.5b", 256, "pallas", (4, 2)),
    Job("qwen2.5-0.5b", 256, "cpu", (2,)),
    Job("smollm2-135m", 128, "pallas", (2,), param_dtype="bfloat16"),
]

# `--set attention` (with `--profile`): attention alone with the model's splash tiles, traced, at
# the attention bench's 16 x 2048 (17.9% of peak, 2026-12-05), at the 2 x 2048 of one call in
# Qwen2.5-0.5B's default step (where the kernels ran at ~27%: 188 ms for 192 calls, 2026-12-07
# fifth session), and at 64 x 512; the per-op times say where the difference goes.
ATTENTION_SHAPES = [(16, 2048), (2, 2048), (64, 512)]
# rewardax's own kernels (`flash_attention`) in `--set attention`: `Kernels.flash` tiles; all
# at the first shape, the first at the others.
ATTENTION_FLASH_TILES = [FLASH_TILES, (512, 512, 512, 512)]
# Splash tiles tried in the attention benchmark: (block_q, block_kv, fused backward).
SPLASH_TILES = [(512, 512, False), (1024, 1024, False), (512, 512, True)]
# `--set tune`: (block_q, block_kv, block_kv_compute, bwd_block_q, bwd_block_kv), fused backward.
# The forward and the backward kernels are timed in one program; the fastest forward tiles
# (by forward time) and the fastest backward tiles (by fwd+bwd - fwd) are composed.
TUNE_TILES = [
    (512, 512, 512, 512, 512),
    (1024, 512, 512, 512, 512),
    (2048, 512, 512, 512, 512),
    (1024, 1024, 512, 512, 512),
    (2048, 1024, 512, 512, 512),
    (1024, 1024, 1024, 1024, 1024),
    (512, 512, 256, 1024, 512),
    (512, 512, 512, 512, 1024),
    (512, 512, 512, 1024, 1024),
    (512, 512, 512, 256, 512),
    (512, 512, 512, 2048, 512),
]


def tile_fields(tiles: tuple[int, ...]) -> dict:
    bq, bkv, bkvc, bbq, bbkv = tiles
    return dict(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkvc,
        bwd_block_q=bbq,
        bwd_block_kv=bbkv,
        fused_backward=True,
    )


def flash_name(tiles: tuple[int, ...]) -> str:
    """rewardax's flash kernels' tiles (`Kernels.flash`' order) -> "flash fwd 1024x1024 bwd ..."."""
    return "flash fwd {}x{} bwd {}x{}".format(*tiles)


def tile_name(k: Any) -> str:
    """`Kernels` (or its tile fields as a dict) -> "splash fwd 512x512/512 bwd 512x512 fused"."""
    get = k.get if isinstance(k, dict) else lambda f: getattr(k, f)
    bq, bkv = get("block_q"), get("block_kv")
    bkvc = get("block_kv_compute") or bkv
    bbq, bbkv = get("bwd_block_q") or bq, get("bwd_block_kv") or bkv
    if isinstance(k, Kernels) and k.flash:  # rewardax's kernels
        return flash_name(k.flash)
    fused = " fused" if get("fused_backward") else ""
    return f"splash fwd {bq}x{bkv}/{bkvc} bwd {bbq}x{bbkv}{fused}"


class Recorder:
    """Appends result lines to OUT/tpu_bench.jsonl and rewrites OUT/tpu_bench.md."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.md = out / "tpu_bench.jsonl", out / "tpu_bench.md"
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        row = {"elapsed_s": round(time.monotonic() - START, 1), **row}
        if row.get("profile", {}).get("ops"):  # `--profile`: one section per job in profile.md
            keys = ("shape", "impl", "rows", "T", "remat", "pairs")
            title = " ".join(f"{row.get(k)}" for k in keys if row.get(k) is not None)
            title += f" ({row['microbatches']} microbatches)" if row.get("microbatches") else ""
            step_ms = 1e3 * row["step_s"] if row.get("step_s") else row.get("fwd_bwd_ms")
            with (self.md.parent / "profile.md").open("a") as f:
                f.write(device_profile.markdown(title, row["profile"], step_ms))
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        self.md.write_text(self.table())

    def table(self) -> str:
        lines = [
            "MFU = (6 x non-embedding params + 12 x layers x hidden x T) x tokens/s / 197e12; "
            "attention % of peak = 3.5 x 2 x N x H x T^2 x D / s / 197e12.",
            "",
            "| model | T | kernels | attention | remat | params | pairs | compile s | step s | "
            "pairs/s | tokens/s | MFU | HBM GiB | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            if r.get("kind") != "train_step":
                continue
            lines.append(
                f"| {r.get('shape')} | {r.get('T')} | {r.get('kernels')} | {r.get('attention', '')} | "
                f"{r.get('remat', '')} | {_state(r)} | {r.get('pairs', '')} | {_f(r.get('compile_s'))} | {_f(r.get('step_s'), 3)} | "
                f"{_f(r.get('pairs_per_s'))} | {_f(r.get('tokens_per_s'), 0)} | "
                f"{_pct(r.get('mfu'))} | {_f(r.get('hbm_gib'))} | {r.get('status')} |"
            )
        lines += [
            "",
            "| attention | N x T | fwd ms | fwd+bwd ms | % of peak (fwd+bwd) | HBM GiB | status |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            if r.get("kind") != "attention":
                continue
            lines.append(
                f"| {r.get('impl')} | {r.get('rows')} x {r.get('T')} | {_f(r.get('fwd_ms'), 2)} | "
                f"{_f(r.get('fwd_bwd_ms'), 2)} | {_pct(r.get('fwd_bwd_peak'))} | "
                f"{_f(r.get('hbm_gib'))} | {r.get('status')} |"
            )
        return "\n".join(lines) + "\n"


def _state(row: dict) -> str:
    """The params column: their dtype, then offload and LoRA settings when set."""
    extra = [k for k, v in (row.get("optim") or {}).items() if v]
    if row.get("lora_rank"):
        extra.append(f"LoRA r{row['lora_rank']}")
    if row.get("defaults"):
        extra.append(f"{row.get('dtype')} compute (defaults)")
    if (row.get("microbatches") or 1) > 1:
        extra.append(f"{row['microbatches']} microbatches")
    return " + ".join([str(row.get("param_dtype", "")), *extra])


def _f(x: Any, digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _pct(x: Any) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def hbm_gib(compiled: Any) -> float | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return total / GIB


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


# ------------------------------------------------------------------------ attention alone


def attention_bench(rows: int, t: int, args, rec: Recorder) -> dict | None:
    """Times each attention at `rows` x `t` (Qwen2.5-0.5B heads); returns the fastest splash
    tiles (`Kernels` fields), or None when none ran. `--set tune`: splash tiles only, the
    fastest forward and backward tiles composed."""
    h, kv, d = (4, 2, 64) if args.tiny else (14, 2, 64)
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(rows, t, h, d)), jnp.bfloat16)
    k = jnp.asarray(r.normal(size=(rows, t, kv, d)), jnp.bfloat16)
    v = jnp.asarray(r.normal(size=(rows, t, kv, d)), jnp.bfloat16)
    seg = jnp.ones((rows, t), jnp.int32)
    scale = 1.0 / np.sqrt(d)
    interpret = jax.default_backend() != "tpu"
    positions = jnp.broadcast_to(jnp.arange(t), (rows, t))

    mask = attention_mask(seg, positions)  # built once, as the model does per step
    # name -> (fn(q, k, v, aux), aux): aux is the mask or the segment ids, an argument of the
    # compiled program (not a constant folded into it).
    impls: dict[str, Any] = {
        "blocked_xla (cpu)": (
            lambda q, k, v, m: blocked_attention(q, k, v, m, scale, jnp.bfloat16, jnp.bfloat16),
            mask,
        ),
        "einsum_xla": (
            lambda q, k, v, m: (
                xla_attention(q.reshape(rows, t, kv, h // kv, d), k, v, m, scale)
                .astype(jnp.bfloat16)
                .reshape(rows, t, h, d)
            ),
            mask,
        ),
    }
    if args.set == "tune":
        impls = {}
        sweep = [(128, 128, 128, 128, 128)] if args.tiny else TUNE_TILES
        tile_sets = [tile_fields(tiles) for tiles in sweep]
    elif args.set == "attention":  # the model's tiles only (`Kernels`' defaults)
        impls = {}
        tiles = ("block_q", "block_kv", "block_kv_compute", "bwd_block_q", "bwd_block_kv")
        chosen = select_kernels("pallas")
        tile_sets = [{f: getattr(chosen, f) for f in (*tiles, "fused_backward")}]
        if args.tiny:
            tile_sets = [{**tile_sets[0], **dict.fromkeys(tiles, 128)}]
        impls |= raw_splash_impls(tile_sets[0], rows, t, h, interpret)
        sweep = (
            ATTENTION_FLASH_TILES if (rows, t) == ATTENTION_SHAPES[0] else ATTENTION_FLASH_TILES[:1]
        )
        for flash_tiles in [(128, 128, 128, 128)] if args.tiny else sweep:
            impls[flash_name(flash_tiles)] = (
                lambda q, k, v, s, tiles=flash_tiles: splash_attention(
                    q, k, v, s, scale, interpret=interpret, flash=tiles
                ),
                seg,
            )
    else:
        sweep = [(128, 128, False)] if args.tiny else SPLASH_TILES
        tile_sets = [dict(block_q=a, block_kv=b, fused_backward=f) for a, b, f in sweep]
    fields_of = {}
    for fields in tile_sets:
        fields_of[tile_name(fields)] = fields
        impls[tile_name(fields)] = (
            lambda q, k, v, s, fields=fields: splash_attention(
                q, k, v, s, scale, interpret=interpret, **fields
            ),
            seg,
        )
    flops = 3.5 * 2 * rows * h * t * t * d
    best: tuple[float, dict] | None = None
    forward_best: tuple[float, dict] | None = None
    backward_best: tuple[float, dict] | None = None
    for name, (fn, aux, *layout) in impls.items():
        # (fn, aux) or (fn, None, layout): fn takes layout(q/k/v) and the segment ids
        operands = (q, k, v, aux) if not layout else (*map(layout[0], (q, k, v)), seg)
        if time.monotonic() - START > args.budget_s - 20:
            rec.add({"kind": "attention", "impl": name, "rows": rows, "T": t, "status": "budget"})
            continue
        row: dict[str, Any] = {"kind": "attention", "impl": name, "rows": rows, "T": t}
        try:
            fwd = jax.jit(fn).lower(*operands).compile()
            both = forward_backward(fn).lower(*operands).compile()
            row["hbm_gib"] = hbm_gib(both)
            row["fwd_ms"] = 1e3 * median_seconds(fwd, operands, args.attn_iters)
            row["fwd_bwd_ms"] = 1e3 * median_seconds(both, operands, args.attn_iters)
            if args.set == "attention":  # back to back, as a training step runs them
                row["fwd_bwd_sync_ms"] = row["fwd_bwd_ms"]
                row["fwd_bwd_ms"] = 1e3 * back_to_back_seconds(both, operands, args.attn_iters)
                row["fwd_ms"] = 1e3 * back_to_back_seconds(fwd, operands, args.attn_iters)
            row["fwd_bwd_peak"] = flops / (row["fwd_bwd_ms"] / 1e3) / PEAK_FLOPS
            row["status"] = "ok"
            if args.profile:
                row["profile"] = profile_calls(both, operands, args)
            if name in fields_of:
                fields = fields_of[name]
                if best is None or row["fwd_bwd_ms"] < best[0]:
                    best = (row["fwd_bwd_ms"], fields)
                if forward_best is None or row["fwd_ms"] < forward_best[0]:
                    forward_best = (row["fwd_ms"], fields)
                backward_ms = row["fwd_bwd_ms"] - row["fwd_ms"]
                if backward_best is None or backward_ms < backward_best[0]:
                    backward_best = (backward_ms, fields)
        except Exception as exc:  # one configuration's failure is a result, not the run's end
            row["status"] = error_text(exc)
            traceback.print_exc()
        rec.add(row)
        gc.collect()
    if args.set == "tune" and forward_best is not None and backward_best is not None:
        fwd, bwd = forward_best[1], backward_best[1]
        composed = {
            **fwd,
            "bwd_block_q": bwd["bwd_block_q"],
            "bwd_block_kv": bwd["bwd_block_kv"],
        }
        if composed != best[1]:  # measure the composition too; keep whichever is faster
            row = {"kind": "attention", "impl": tile_name(composed) + " (composed)"}
            row |= {"rows": rows, "T": t}
            try:
                fn = lambda q, k, v, s: splash_attention(  # noqa: E731
                    q, k, v, s, scale, interpret=interpret, **composed
                )
                both = forward_backward(fn).lower(q, k, v, seg).compile()
                row["fwd_bwd_ms"] = 1e3 * median_seconds(both, (q, k, v, seg), args.attn_iters)
                row["fwd_bwd_peak"] = flops / (row["fwd_bwd_ms"] / 1e3) / PEAK_FLOPS
                row["status"] = "ok"
                if row["fwd_bwd_ms"] < best[0]:
                    best = (row["fwd_bwd_ms"], composed)
            except Exception as exc:
                row["status"] = error_text(exc)
            rec.add(row)
    return None if best is None else best[1]


def raw_splash_impls(fields: dict, rows: int, t: int, heads: int, interpret: bool) -> dict:
    """`--set attention`: JAX's splash kernel called as it is, on q/k/v already [N, H, T, D] and
    already scaled (none of `splash_attention`'s transposes, scaling, padding mask), with and
    without segment ids: what the wrapper and the segment compare cost."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    from rewardax.models.pallas_attention import splash_block_sizes

    sizes = splash_block_sizes(
        t,
        fields["block_q"],
        fields["block_kv"],
        fields["fused_backward"],
        block_kv_compute=fields["block_kv_compute"],
        bwd_block_q=fields["bwd_block_q"],
        bwd_block_kv=fields["bwd_block_kv"],
    )
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * heads)
    major = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731

    def run(q, k, v, seg, segments: bool):
        kernel = splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
        if segments:
            one = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
            return jax.vmap(one)(q, k, v, seg)
        return jax.vmap(kernel)(q, k, v)

    return {
        f"{name} (raw kernel, heads-major{', segments' if segments else ''})": (
            functools.partial(run, segments=segments),
            None,
            major,
        )
        for name, segments in [(tile_name(fields), True), (tile_name(fields), False)]
    }


def forward_backward(fn):
    """jit(q, k, v, aux -> gradients of q, k, v under a cotangent of ones)."""

    def run(q, k, v, aux):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, aux), q, k, v)
        return vjp(jnp.ones_like(out))

    return jax.jit(run)


def profile_calls(fn, fn_args: tuple, args) -> dict:
    """`--profile N`: ``fn(*fn_args)`` run N times under the profiler, the device time per op
    (`device_profile.trace_ops`), or the error."""

    def run_calls() -> None:
        for _ in range(args.profile):
            out = fn(*fn_args)
        jax.block_until_ready(out)

    try:
        return device_profile.trace_ops(run_calls, args.profile, Path(args.out) / "trace.xplane.pb")
    except Exception as exc:  # the timing stands without its trace
        traceback.print_exc()
        return {"error": error_text(exc)}


def back_to_back_seconds(fn, fn_args: tuple, iters: int) -> float:
    """Seconds per call of ``iters`` calls dispatched back to back and waited for once (the
    device's rate; `median_seconds` waits for each call, which adds the host's round trip to a
    millisecond-long program)."""
    jax.block_until_ready(fn(*fn_args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*fn_args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def median_seconds(fn, fn_args: tuple, iters: int) -> float:
    jax.block_until_ready(fn(*fn_args))  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------ train step


def model_config(shape: str, tiny: bool) -> rx.ModelConfig:
    fields = dict(SHAPES[shape], pad_token_id=0, eos_token_id=0, max_position_embeddings=32768)
    if tiny:
        fields.update(TINY)
    return rx.ModelConfig(**fields)


def non_embedding_params(model: rx.RewardModel) -> int:
    params = nnx.state(model, nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(params))
    return total - model.model.embed_tokens.embedding[...].size


def timing_config(workdir: str, run_name: str, **settings) -> rx.RewardConfig:
    """The run settings of a timed job: ``settings`` on a run that resumes nothing, shows no
    progress bar, is long enough for any number of timed steps, and splits the parameters over
    the chips (fsdp)."""
    return rx.RewardConfig(
        max_training_steps=1000,
        save_directory=workdir,
        resume="off",
        progress_bar=False,
        run_name=run_name,
        mesh={"dp": 1, "fsdp": -1, "tp": 1},
        **settings,
    )


def train_job(job: Job, kernels: Kernels, args, rec: Recorder, workdir: str) -> None:
    config = model_config(job.shape, args.tiny)
    base = {
        "kind": "train_step",
        "shape": job.shape + (" (tiny)" if args.tiny else ""),
        "T": job.length,
        "kernels": job.kernels,
        "param_dtype": job.param_dtype,
        "remat": job.remat,
        "device": jax.devices()[0].device_kind,
        **({"optim": job.optim} if job.optim else {}),
        **({"lora_rank": job.lora_rank} if job.lora_rank else {}),
        **({"microbatches": job.microbatches} if job.microbatches > 1 else {}),
    }
    chosen = kernels if job.kernels == "pallas" else select_kernels(job.kernels)
    if job.tiles is not None and chosen.attention == "splash":
        chosen = dataclasses.replace(chosen, **job.tiles)
    base["attention"] = tile_name(chosen) if chosen.attention == "splash" else chosen.attention
    if chosen.attention == "splash" and not chosen.rope_matmul:
        base["attention"] += " (rope: slices)"
    if chosen.attention == "splash" and chosen.dense_residuals:
        base["remat"] += " (dense residuals)"
    if job.microbatches > 1 and not chosen.accumulate_by_reference:
        base["remat"] += " (sums by value)"
    if chosen.indexed_layers:
        base["remat"] += " (indexed layers)"
    for pairs in job.batches:
        if time.monotonic() - START > args.budget_s - args.reserve_s:
            rec.add({**base, "pairs": pairs, "status": "skipped: budget"})
            return
        row = {**base, "pairs": pairs}
        trainer = arrays = compiled = None
        try:
            model = rx.RewardModel(
                config,
                dtype="bfloat16",
                param_dtype=job.param_dtype,
                remat_policy=job.remat,
                kernels=chosen,
                rngs=nnx.Rngs(0),
            )
            per_param = 4.0 if job.lora_rank else 6.0  # a frozen base has no weight gradients
            per_token = per_param * non_embedding_params(model) + 12.0 * (
                config.num_hidden_layers * config.hidden_size * job.length
            )
            trainer = rx.RewardTrainer(
                timing_config(
                    workdir,
                    "tpu_bench",
                    per_device_train_batch_size=pairs // job.microbatches,
                    gradient_accumulation_steps=job.microbatches,
                    max_sequence_length=job.length,
                    dtype="bfloat16",
                    param_dtype=job.param_dtype,
                    remat_policy=job.remat,
                    lora_rank=job.lora_rank,
                    **job.optim,
                ),
                None,  # no tokenizer: batches are made here, nothing is saved
                model=model,
            )
            del model
            batches = [
                global_batch(
                    random_batch(pairs * jax.device_count(), job.length, config, i), trainer.mesh
                )
                for i in range(2)
            ]
            if not time_steps(trainer, batches, per_token, pairs, job.length, row, args):
                rec.add(row)
                continue
            rec.add(row)
            return  # the largest batch that fits is measured
        except Exception as exc:  # one configuration's failure is a result, not the run's end
            row["status"] = error_text(exc)
            traceback.print_exc()
            rec.add(row)
        finally:
            del trainer, arrays, compiled
            gc.collect()


def time_steps(trainer, batches, per_token: float, pairs: int, length: int, row, args) -> bool:
    """Compiles the trainer's step for ``batches``, then times ``args.steps`` steps into ``row``.
    False (and a status in ``row``) when the compiled step needs more than ``--hbm-gib``."""
    arrays = trainer.state.arrays()
    step = trainer.configure_functions().train_step
    t0 = time.perf_counter()
    compiled = step.lower(arrays, batches[0]).compile()
    row["compile_s"] = time.perf_counter() - t0
    row["hbm_gib"] = hbm_gib(compiled)
    if row["hbm_gib"] is not None and row["hbm_gib"] > args.hbm_gib:
        row["status"] = f"skipped: needs {row['hbm_gib']:.1f} GiB > {args.hbm_gib}"
        return False
    arrays, metrics = compiled(arrays, batches[1])  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        arrays, metrics = compiled(arrays, batches[i % 2])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        if time.monotonic() - START > args.budget_s - 10:
            break  # the budget ends: keep the steps measured so far
    step_s = statistics.median(times)
    if args.profile:
        state = {"arrays": arrays}

        def run_steps() -> None:
            for i in range(args.profile):
                state["arrays"], out = compiled(state["arrays"], batches[i % 2])
            jax.block_until_ready(out)

        try:
            keep = Path(args.out) / "trace.xplane.pb"  # the first job's raw trace
            row["profile"] = device_profile.trace_ops(run_steps, args.profile, keep)
        except Exception as exc:  # the timing stands without its trace
            row["profile"] = {"error": error_text(exc)}
            traceback.print_exc()
        arrays = state["arrays"]
    tokens = pairs * jax.device_count() * 2 * length
    row.update(
        steps=len(times),
        step_s=step_s,
        pairs_per_s=pairs * jax.device_count() / step_s,
        tokens_per_s=tokens / step_s,
        mfu=per_token * tokens / step_s / (PEAK_FLOPS * jax.device_count()),
        loss=float(metrics["loss"]),
        status="ok",
    )
    return True


# `--set defaults`: what a user gets who sets the batch and the length and nothing about speed:
# `RewardConfig(per_device_train_batch_size=P, max_sequence_length=T, path=...)`, the model
# loaded by the trainer from a saved random-init model of the shape (float32 weights on disk).
DEFAULT_JOBS = [
    ("qwen2.5-0.5b", 2048, 8),
    ("qwen2.5-0.5b", 512, 16),
    ("smollm2-135m", 2048, 16),
    ("smollm2-135m", 512, 32),
]


def defaults_job(shape: str, length: int, pairs: int, args, rec: Recorder, workdir: str) -> None:
    row: dict[str, Any] = {"kind": "train_step", "shape": shape, "T": length, "pairs": pairs}
    row |= {"kernels": "auto", "device": jax.devices()[0].device_kind, "defaults": True}
    if time.monotonic() - START > args.budget_s - args.reserve_s:
        rec.add({**row, "status": "skipped: budget"})
        return
    trainer = None
    try:
        config = model_config(shape, args.tiny)
        model_dir = Path(workdir) / f"model-{shape}"
        if not model_dir.exists():
            rx.RewardModel(config, rngs=nnx.Rngs(0)).save_pretrained(model_dir)
        t0 = time.perf_counter()
        trainer = rx.RewardTrainer(
            rx.RewardConfig(
                per_device_train_batch_size=pairs,
                max_sequence_length=length,
                path=str(model_dir),
                max_training_steps=1000,
                save_directory=workdir,
                resume="off",
                progress_bar=False,
                run_name="defaults",
            ),
            None,
        )
        row["setup_s"] = time.perf_counter() - t0  # loading + deciding the auto settings
        chosen = trainer.config.model
        row.update(param_dtype=chosen.param_dtype, remat=chosen.remat_policy)
        row.update(dtype=chosen.dtype, remat_tried=list(trainer._remat_tried))
        row["microbatches"] = trainer.config.train.gradient_accumulation_steps
        kernels = select_kernels(chosen.kernels)
        row["attention"] = (
            tile_name(kernels) if kernels.attention == "splash" else kernels.attention
        )
        per_token = 6.0 * non_embedding_params(trainer.state.model) + 12.0 * (
            config.num_hidden_layers * config.hidden_size * length
        )
        batches = [
            global_batch(random_batch(pairs * jax.device_count(), length, config, i), trainer.mesh)
            for i in range(2)
        ]
        time_steps(trainer, batches, per_token, pairs, length, row, args)
    except Exception as exc:  # one configuration's failure is a result, not the run's end
        row["status"] = error_text(exc)
        traceback.print_exc()
    rec.add(row)
    del trainer
    gc.collect()


# `--set tree`: the same pairs (a prompt of P tokens, two responses of R) as padded rows of P + R
# tokens (splash, static mask) and as data.layout=shared_prompt rows of P + 2R (the prompt once,
# the responses as branches): splash on its mask built from the branch ids, then XLA's attention
# on the same rows (what shared_prompt ran on a TPU before 2026-12-06). (shape, P, R, pairs).
TREE_JOBS = [
    ("qwen2.5-0.5b", 1536, 256, 8),
    ("smollm2-135m", 1536, 256, 16),
    ("qwen2.5-0.5b", 256, 768, 8),
]


def tree_batches(
    pairs: int, prompt: int, response: int, config: rx.ModelConfig, seed: int
) -> dict[str, dict[str, np.ndarray]]:
    """One batch of `pairs` random pairs sharing a `prompt`-token prefix, in both layouts:
    {"padded": [pairs, 2, P + R] rows, "shared_prompt": `pack_records`' rows of P + 2R}."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(pairs):
        head = rng.integers(3, config.vocab_size, size=prompt)
        chosen, rejected = rng.integers(3, config.vocab_size, size=(2, response))
        rejected[0] = chosen[0] % (config.vocab_size - 3) + 3  # the prefix ends with the prompt
        records.append(
            {
                "chosen_input_ids": np.concatenate([head, chosen]).astype(np.int32),
                "rejected_input_ids": np.concatenate([head, rejected]).astype(np.int32),
                "margin": 0.0,
            }
        )
    length = prompt + response
    ids = np.stack([[r["chosen_input_ids"], r["rejected_input_ids"]] for r in records])
    padded = {
        "input_ids": ids,
        "attention_mask": np.ones((pairs, 2, length), np.int32),
        "reward_index": np.full((pairs, 2), length - 1, np.int32),
        "margin": np.zeros((pairs,), np.float32),
        "pair_mask": np.ones((pairs,), np.float32),
    }
    shared = rdata.pack_records(
        records,
        0,
        layout="shared_prompt",
        batch_size=pairs,
        row_lengths=(prompt + 2 * response,),
        row_multiple=jax.device_count(),
    )
    return {"padded": padded, "shared_prompt": {k: shared[k] for k in rdata.SHARED_PROMPT_KEYS}}


def tree_job(
    shape: str, prompt: int, response: int, pairs: int, args, rec: Recorder, workdir: str
) -> None:
    """`TREE_JOBS`' three rows for one workload: step seconds and pairs/s of the same pairs
    (remat full, bf16 compute, float32 parameters and moments; tiles: `Kernels`' defaults)."""
    config = model_config(shape, args.tiny)
    layouts = [("padded", "pallas"), ("shared_prompt", "pallas"), ("shared_prompt", "xla")]
    # Two steps' pairs in both layouts, made once for the three rows.
    host_batches = [
        tree_batches(pairs * jax.device_count(), prompt, response, config, i) for i in range(2)
    ]
    for layout, kernels in layouts:
        row: dict[str, Any] = {"kind": "train_step", "set": "tree", "shape": shape}
        row |= {"prompt": prompt, "response": response, "pairs": pairs, "layout": layout}
        row |= {"kernels": f"{kernels}, {layout}", "remat": "full"}
        row |= {"T": f"P {prompt} + R {response}", "device": jax.devices()[0].device_kind}
        if time.monotonic() - START > args.budget_s - args.reserve_s:
            rec.add({**row, "status": "skipped: budget"})
            continue
        trainer = None
        try:
            chosen = select_kernels(kernels)
            row["attention"] = chosen.attention + (" (tree mask)" if layout != "padded" else "")
            model = rx.RewardModel(
                config, dtype="bfloat16", remat_policy="full", kernels=chosen, rngs=nnx.Rngs(0)
            )
            trainer = rx.RewardTrainer(
                timing_config(
                    workdir,
                    "tpu_bench_tree",
                    per_device_train_batch_size=pairs,
                    max_sequence_length=prompt + 2 * response,
                    layout=layout,
                    dtype="bfloat16",
                    remat_policy="full",
                ),
                None,
                model=model,
            )
            del model
            batches = [global_batch(both[layout], trainer.mesh) for both in host_batches]
            time_steps(trainer, batches, 0.0, pairs, prompt + response, row, args)
            # The computed tokens per step (padding included), not the padded layout's.
            row["tokens_per_step"] = int(batches[0]["input_ids"].size)
            for derived in ("tokens_per_s", "mfu"):  # per padded token: not comparable here
                row.pop(derived, None)
        except Exception as exc:  # one configuration's failure is a result, not the run's end
            row["status"] = error_text(exc)
            traceback.print_exc()
        rec.add(row)
        del trainer
        gc.collect()


def random_batch(pairs: int, t: int, config: rx.ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """A padded batch of full rows: chosen and rejected of exactly `t` tokens each."""
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(3, config.vocab_size, size=(pairs, 2, t), dtype=np.int32),
        "attention_mask": np.ones((pairs, 2, t), np.int32),
        "reward_index": np.full((pairs, 2), t - 1, np.int32),
        "margin": np.zeros((pairs,), np.float32),
        "pair_mask": np.ones((pairs,), np.float32),
    }


SETS = {  # --set NAME: its job list (defaults and tree have their own)
    "kernels": JOBS,
    "remat": REMAT_JOBS,
    "remat2": REMAT2_JOBS,
    "tune": TUNE_JOBS,
    "offload": OFFLOAD_JOBS,
    "offload_attention": OFFLOAD_ATTENTION_JOBS,
    "microbatch": MICROBATCH_JOBS,
    "save_mlp": SAVE_MLP_JOBS,
    "profile": PROFILE_JOBS,
    "rope": ROPE_JOBS,
    "accumulate": ACCUMULATE_JOBS,
    "indexed": INDEXED_JOBS,
    "flash": FLASH_JOBS,
    "defaults": [],
    "tree": [],
    "attention": [],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="no job starts after this")
    parser.add_argument(
        "--reserve-s", type=float, default=45.0, help="a train job needs this much budget left"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--attn-iters", type=int, default=10)
    parser.add_argument("--hbm-gib", type=float, default=15.75, help="the chip's memory")
    parser.add_argument("--jobs", default="", help="comma-separated job indices (default all)")
    parser.add_argument(
        "--set",
        default="kernels",
        help="which job list to run (job lists: several, comma-separated)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after timing, trace this many steps and sum the device time per op (profile.md)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "tpu_bench_out")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script")
    args = parser.parse_args()
    names = args.set.split(",")
    if not set(names) <= set(SETS):
        parser.error(f"--set {args.set}: choose among {sorted(SETS)}")
    if len(names) > 1 and set(names) & {"kernels", "tune", "remat", "remat2", "defaults", "tree"}:
        # Those choose their own tiles or run no job list: combined, they would not.
        parser.error(f"--set {args.set}: only job lists run on Kernels' default tiles combine")
    if args.tiny:
        args.steps, args.attn_iters = min(args.steps, 2), 1
    rec = Recorder(Path(args.out))
    rec.add(
        {
            "kind": "start",
            "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "argv": sys.argv[1:],
        }
    )
    # Attention alone first (cheap compiles); its fastest splash tiles serve the models.
    kernels = select_kernels("pallas")
    if args.set in ("remat", "remat2"):  # the kernels run's best (benchmarks/README.md, 12-05)
        kernels = dataclasses.replace(kernels, block_q=512, block_kv=512, fused_backward=True)
    elif args.set == "attention":  # no models: where attention alone spends its time
        for rows, t in [(2, 256)] if args.tiny else ATTENTION_SHAPES:
            try:
                attention_bench(rows, t, args, rec)
            except Exception as exc:
                rec.add({"kind": "attention", "rows": rows, "T": t, "status": error_text(exc)})
        print(rec.table(), flush=True)
        return
    elif args.set in ("kernels", "tune"):  # the others run `Kernels`' default tiles
        try:
            best = attention_bench(2 if args.tiny else 16, 256 if args.tiny else 2048, args, rec)
            if best is not None and not args.tiny:
                kernels = dataclasses.replace(kernels, **best)
        except Exception as exc:
            rec.add({"kind": "attention", "status": error_text(exc)})
    jobs = [job for name in args.set.split(",") for job in SETS[name]]
    if args.tiny:
        jobs = (
            [dataclasses.replace(j, length=128, batches=(2 * j.microbatches,)) for j in jobs]
            if args.set != "kernels"
            else TINY_JOBS
        )
    if args.jobs:
        jobs = [jobs[int(i)] for i in args.jobs.split(",")]
    if args.set == "tree":
        with tempfile.TemporaryDirectory() as workdir:
            for shape, prompt, response, pairs in TREE_JOBS:
                if args.tiny:
                    prompt, response, pairs = 64, 32, 2
                tree_job(shape, prompt, response, pairs, args, rec, workdir)
        print(rec.table(), flush=True)
        return
    if args.set == "defaults":
        with tempfile.TemporaryDirectory() as workdir:
            for shape, length, pairs in DEFAULT_JOBS:
                if args.tiny:
                    length, pairs = 128, 2
                defaults_job(shape, length, pairs, args, rec, workdir)
        print(rec.table(), flush=True)
        return
    with tempfile.TemporaryDirectory() as workdir:
        for job in jobs:
            try:
                train_job(job, kernels, args, rec, workdir)
            except Exception as exc:
                fields = {"shape": job.shape, "T": job.length, "kernels": job.kernels}
                rec.add({"kind": "train_step", **fields, "status": error_text(exc)})
    try:
        if args.set == "kernels" and time.monotonic() - START < args.budget_s - 30:
            attention_bench(2 if args.tiny else 64, 128 if args.tiny else 512, args, rec)
    except Exception as exc:
        rec.add({"kind": "attention", "status": error_text(exc)})
    print(rec.table(), flush=True)
    print(f"total {time.monotonic() - START:.0f} s", flush=True)


if __name__ == "__main__":
    main()

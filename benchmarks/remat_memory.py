"""What each remat policy costs in HBM on one TPU v5e chip, from `rewardax plan` (issue 28).

    PYTHONPATH=.venv/libtpu python benchmarks/remat_memory.py [--out FILE.md] [--quick]

(run from the repository root: `--out benchmarks/results/...`).

Compiles the train step of `configs/plan_tpu.yaml` (bf16 compute, float32 parameters and AdamW
moments; bfloat16 both for Qwen2.5-1.5B) for one v5e chip at 2048 tokens, padded, with remat
`full`, `save_attention` (the splash kernel's residuals kept on the chip) and `offload_attention`
(kept in host memory), each with the residuals as the kernel lays them out (the default; 64-wide
heads: half of each TPU tile empty) and kept in 128-wide rows (`Kernels.dense_residuals`). Then
`auto` for the shapes of `tpu_bench.py --set defaults`: which policy and microbatches it picks
and the memory of each candidate it compiled. Nothing runs: memory only, no speed. Prints one
Markdown row per configuration as it goes. `--quick`: SmolLM2-135M only.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rewardax import plan as planning
from rewardax.config import RewardConfig
from rewardax.errors import RewardaxError
from rewardax.plan import GIB, plan

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "configs" / "plan_tpu.yaml"
TOPOLOGY = "v5e:1x1"
# (shape, tokens per response, pairs per step, extra settings)
SHAPES = [
    ("smollm2-135m", 2048, 16, []),
    ("smollm2-135m", 2048, 8, []),
    ("qwen2.5-0.5b", 2048, 8, []),
    ("qwen2.5-0.5b", 2048, 4, []),
    ("qwen2.5-1.5b", 2048, 2, ["model.param_dtype=bfloat16"]),
]
POLICIES = ("full", "save_attention", "offload_attention")
# `tpu_bench.py --set defaults`: only the batch and the length set.
AUTO_SHAPES = [
    ("qwen2.5-0.5b", 2048, 8),
    ("qwen2.5-0.5b", 512, 16),
    ("smollm2-135m", 2048, 16),
    ("smollm2-135m", 512, 32),
]


def config(shape: str, length: int, pairs: int, settings: list[str]) -> RewardConfig:
    return RewardConfig.from_yaml(
        JOB,
        [
            f"model.path={ROOT / 'configs' / 'shapes' / shape}",
            f"data.max_sequence_length={length}",
            f"train.per_device_train_batch_size={pairs}",
            "mesh.fsdp=1",
            *settings,
        ],
    )


def planned(job: RewardConfig, dense: bool = False) -> planning.Plan:
    """`plan` of ``job`` for one v5e chip, the splash residuals kept dense or not (a `Kernels`
    field, which no config setting reaches: plan's choice of kernels is wrapped here)."""
    choose = planning.select_kernels
    planning.select_kernels = lambda *a: dataclasses.replace(choose(*a), dense_residuals=dense)
    try:
        return plan(job, TOPOLOGY, suggest=False)
    finally:
        planning.select_kernels = choose


def _cell(error: Exception) -> str:
    """An error as one Markdown table cell."""
    return " ".join(str(error).split()).replace("|", "/")


def policy_row(shape: str, length: int, pairs: int, settings: list[str], policy: str, dense: bool):
    what = f"| {shape} | {length} | {pairs} | {policy} | {'dense' if dense else 'as laid out'} |"
    if policy == "full":
        what = f"| {shape} | {length} | {pairs} | {policy} | none kept |"
    job = config(shape, length, pairs, [f"model.remat_policy={policy}", *settings])
    try:
        memory = planned(job, dense).job.memory
    except RewardaxError as exc:
        return f"{what} error: {_cell(exc)} | | |"
    refused = " (refused)" if memory.estimated else ""
    fits = "yes" if memory.hbm <= planning.TPU_HBM_GIB["TPU v5 lite"] * GIB else "no"
    return f"{what} {memory.hbm / GIB:.2f}{refused} | {memory.host / GIB:.2f} | {fits} |"


def auto_row(shape: str, length: int, pairs: int) -> str:
    job = config(shape, length, pairs, ["model.remat_policy=auto", "model.dtype=auto"])
    try:
        result = planned(job)
    except RewardaxError as exc:
        return f"| {shape} | {length} | {pairs} | error: {_cell(exc)} | |"
    resolved = result.resolved
    split = resolved.get("train.gradient_accumulation_steps")
    chosen = resolved["model.remat_policy"] + (
        f" on {resolved['train.per_device_train_batch_size']} pairs x {split}" if split else ""
    )
    return f"| {shape} | {length} | {pairs} | {chosen} | {'; '.join(result.remat_tried)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.quick or s[0] == "smollm2-135m"]
    autos = [s for s in AUTO_SHAPES if not args.quick or s[0] == "smollm2-135m"]
    lines = [
        "| model | T | pairs | remat | residuals | HBM per chip GiB | host GiB | fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for shape, length, pairs, settings in shapes:
        for policy in POLICIES:
            for dense in (False, True) if policy != "full" else (False,):
                lines.append(policy_row(shape, length, pairs, settings, policy, dense))
                print(lines[-1], flush=True)
    lines += [
        "",
        "| model | T | pairs | auto chose | candidates compiled |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines[-3:]), flush=True)
    for shape, length, pairs in autos:
        lines.append(auto_row(shape, length, pairs))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

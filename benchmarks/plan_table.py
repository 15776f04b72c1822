"""Which model shapes fit which TPU v5e slices, from `rewardax plan` (issue 29).

    PYTHONPATH=.venv/libtpu python benchmarks/plan_table.py [--out FILE.md] [--quick]

Compiles the train step of `configs/plan_tpu.yaml` (bf16 compute, float32 parameters and AdamW
moments, one pair of T tokens per chip, fsdp over all chips) for each model shape of
`configs/shapes/` at T = 2048 and 4096 on one v5e chip, with everything on the chip, with the
optimizer state in host memory (`optim.offload_state`), with the parameters there too
(`optim.offload_params`), and with LoRA of rank 16 on a bfloat16 base (`model.lora_rank`), each
with remat `full` (the least activation memory); then Llama-3.1-8B at 4096 on v5e slices of 4, 8
and 16 chips. Prints one Markdown row per configuration as it goes
(HBM per chip, whether it fits 15.75 GiB, host memory, compile seconds). `--quick`: 0.5B only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rewardax.config import RewardConfig
from rewardax.errors import RewardaxError
from rewardax.plan import GIB, plan

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "configs" / "plan_tpu.yaml"
SHAPES = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b"]
MODES = {
    "on chip": [],
    "offload state": ["optim.offload_state=true"],
    "offload state + params": ["optim.offload_state=true", "optim.offload_params=true"],
    "LoRA r16, bf16 base": ["model.lora_rank=16", "model.param_dtype=bfloat16"],
}


def row(shape: str, topology: str, length: int, mode: str, settings: list[str]) -> str:
    overrides = [
        f"model.path={ROOT / 'configs' / 'shapes' / shape}",
        f"data.max_sequence_length={length}",
        "model.remat_policy=full",
        *settings,
    ]
    try:
        result = plan(RewardConfig.from_yaml(JOB, overrides), topology, suggest=False)
    except RewardaxError as exc:
        return f"| {shape} | {topology} | {length} | {mode} | error: {exc} | | | |"
    memory = result.job.memory
    refused = " (refused)" if memory.estimated else ""
    return (
        f"| {shape} | {topology} | {length} | {mode} | {memory.hbm / GIB:.2f}{refused} | "
        f"{'yes' if result.fits else 'no'} | {memory.host / GIB:.2f} | {result.job.compile_s:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    lines = [
        "| model | slice | T | memory | HBM per chip GiB | fits | host GiB | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    jobs = [
        (shape, "v5e:1x1", length, mode, settings)
        for shape in (SHAPES[:1] if args.quick else SHAPES)
        for length in (2048, 4096)
        for mode, settings in MODES.items()
    ]
    if not args.quick:
        jobs += [
            ("llama-3.1-8b", topology, 4096, mode, MODES[mode])
            for topology in ("v5e:2x2", "v5e:2x4", "v5e:4x4")
            for mode in ("on chip", "offload state + params")
        ]
    for job in jobs:
        lines.append(row(*job))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

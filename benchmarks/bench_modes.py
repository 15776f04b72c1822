"""VADER movie sentences: pairs vs 4-response rankings vs pointwise scores (issue #31).

    .venv/bin/python benchmarks/bench_modes.py [--quick] [--steps N] [--modes pairs,plackett_luce,...]

Trains SmolLM2-135M-Instruct from the same starting point (the bundled GGUF, score head seed 42)
once per mode, with the default job's hyperparameters (src/rewardax/configs/default.yaml: AdamW lr
2e-5, 5 warmup steps, linear decay, 64-token responses, one epoch, seed 42), on the same 1,920
training sentences and their mean human ratings, packaged by scripts/build_vader_groups.py:

- `pairs`: the default job itself (960 pairs of train + train_extra, batch 8, bradley_terry).
- `plackett_luce` / `all_pairs_bradley_terry`: the 480 rows ranking 4 of those sentences by rating
  (2 pairs per row), batch 4.
- `mse`: the 1,920 sentences as score rows (score = mean rating), batch 16.

Every mode runs 120 steps of 16 sentence forward passes (one epoch), so the budget of sentences
seen, forward passes and optimizer steps is the same. Group and score losses run with
data.layout=padded (the only layout they took when the figures were measured; they now also take
shared_prompt), the pairs with the default job's shared_prompt layout; the rewards are the same
either way, only the speed differs. Each trained model is then evaluated on the
held-out split, never seen in training: pairwise accuracy on the 256 held-out pairs, and
Spearman ρ / Kendall τ-b of reward against mean rating on their 512 sentences, on all of them and
within the positive (>= +1.5) and negative (<= -1.5) halves, which no pair label orders.
Writes benchmarks/results/vader_modes_<date>[_quick].{json,md}, rewritten after each mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import jax

import rewardax as rx
from rewardax import hostmem
from rewardax.models import smollm2_gguf_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from build_vader_groups import build

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIG = resources.files("rewardax") / "configs" / "default.yaml"
ASSETS = resources.files("rewardax") / "assets"
# mode -> (training file, overrides of the default job); 16 sentences a step in each.
PADDED = ["data.layout=padded", "data.bucket_lengths=[]"]
MODES = {
    "pairs": ("pairs", []),
    "plackett_luce": (
        "groups.train",
        [*PADDED, "train.loss=plackett_luce", "train.max_responses=4",
         "train.per_device_train_batch_size=4"],
    ),
    "mse": ("scores.train", [*PADDED, "train.loss=mse", "train.per_device_train_batch_size=16"]),
    "all_pairs_bradley_terry": (
        "groups.train",
        [*PADDED, "train.loss=all_pairs_bradley_terry", "train.max_responses=4",
         "train.per_device_train_batch_size=4"],
    ),
}  # fmt: skip
SCORE_SETS = ("scores.heldout", "scores.heldout_positive", "scores.heldout_negative")


def held_out_metrics(trainer: rx.RewardTrainer, files: dict[str, Path]) -> dict[str, float]:
    sets = {"pairs": str(ASSETS / "vader_movie_pairs.heldout.jsonl")}
    sets.update({name: str(files[name]) for name in SCORE_SETS})
    out = trainer.evaluate(sets)
    row = {"pair_accuracy": out["pairs"]["accuracy"]}
    for name, suffix in zip(SCORE_SETS, ("", "_positive", "_negative"), strict=True):
        row[f"spearman{suffix}"] = out[name]["spearman"]
        row[f"kendall_tau{suffix}"] = out[name]["kendall_tau"]
    row["reward_mean"], row["reward_std"] = (
        out["scores.heldout"]["reward_mean"],
        out["scores.heldout"]["reward_std"],
    )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def run_mode(mode: str, files: dict[str, Path], tmp: str, steps: int | None, before: bool):
    train_name, overrides = MODES[mode]
    train = (
        [str(ASSETS / f"vader_movie_pairs.{s}.jsonl") for s in ("train", "train_extra")]
        if train_name == "pairs"
        else str(files[train_name])
    )
    config = rx.RewardConfig.from_yaml(
        str(DEFAULT_CONFIG),
        [
            f"model.path={smollm2_gguf_path()}",
            f"checkpoint.save_directory={tmp}",
            f"checkpoint.run_name={mode}",
            "checkpoint.save_steps=null",
            "checkpoint.save_final=false",
            "checkpoint.resume=off",
            "eval.eval_steps=null",
            "eval.eval_at_start=false",
            "logging.progress_bar=false",
            "logging.logging_steps=20",
            *([f"train.max_training_steps={steps}"] if steps else []),
            *overrides,
        ],
    )
    tokenizer = rx.load_tokenizer(smollm2_gguf_path())
    trainer = rx.RewardTrainer(config, tokenizer, train_dataset=train)
    untrained = held_out_metrics(trainer, files) if before else None
    start = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - start
    row = {
        "mode": mode,
        "loss": config.train.loss,
        "layout": config.data.layout,
        "batch_rows": config.train.per_device_train_batch_size,
        "steps": result.metrics["step"],
        "train_s": round(train_s, 1),
        **held_out_metrics(trainer, files),
    }
    return row, untrained


def write(rows: list[dict], meta: dict, stem: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    cols = ["mode", "steps", "pair_accuracy", "spearman", "kendall_tau", "spearman_positive",
            "spearman_negative", "reward_mean", "reward_std", "train_s"]  # fmt: skip
    lines = [f"# {stem}: `{meta['command']}`", "", "| " + " | ".join(cols) + " |"]
    lines.append("|" + "---|" * len(cols))
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="pairs,plackett_luce,mse,all_pairs_bradley_terry")
    parser.add_argument("--steps", type=int, default=None, help="default: one epoch (120)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 steps a mode")
    parser.add_argument("--out", default=None, help="results file stem (default: by date)")
    parser.add_argument(
        "--no-untrained", action="store_true", help="skip the untrained model's evaluation"
    )
    args = parser.parse_args()
    steps = 6 if args.quick and args.steps is None else args.steps
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    hostmem.retain_freed_memory()  # before JAX's CPU backend starts, as `rewardax train` does
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    stem = args.out or f"vader_modes_{date}" + ("_quick" if steps else "")
    meta = {"command": " ".join(["benchmarks/bench_modes.py", *sys.argv[1:]]),
            "devices": str(jax.devices())}  # fmt: skip
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = build(Path(tmp) / "data")
        for i, mode in enumerate(modes):
            row, untrained = run_mode(
                mode, files, tmp, steps, before=i == 0 and not args.no_untrained
            )
            if untrained:
                rows.append({"mode": "untrained", "steps": 0, **untrained})
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, meta, stem)
    print(f"wrote {RESULTS / stem}.json and .md")


if __name__ == "__main__":
    main()

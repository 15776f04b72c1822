"""Do `rewardax score` and `rewardax eval` stream? Peak RSS for N rows vs 10 x N rows (issue #8).

Each command runs as a fresh child process (the console script) on a tiny random llama with
SmolLM2's tokenizer; its peak resident memory is the child's own `ru_maxrss`, read with `os.wait4`
(per child, unlike RUSAGE_CHILDREN, which keeps the maximum over all children). Rows are VADER
sentences repeated: `{"prompt", "response"}` rows for score, `{"prompt", "chosen", "rejected"}`
pairs for eval. Streaming means the peak for 10 x N rows stays within 10% of the peak for N rows.

Usage:
    .venv/bin/python benchmarks/bench_stream_memory.py [--rows 10000,100000] [--commands score,eval]

Prints one line per run and, last, one JSON object with every figure (MiB) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

RX = Path(sys.executable).parent / "rewardax"
ASSET = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"
MAX_LEN = 64


def build_model(directory: Path) -> Path:
    """A tiny random llama (hidden 32, 2 layers) with SmolLM2's tokenizer, as a HF directory."""
    from flax import nnx

    import rewardax as rx
    from rewardax.models import smollm2_gguf_path

    tokenizer = rx.load_tokenizer(smollm2_gguf_path())
    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = directory / "tiny-model"
    rx.RewardModel(config, rngs=nnx.Rngs(0)).save_pretrained(path, tokenizer=tokenizer)
    return path


def write_rows(path: Path, n: int, kind: str) -> Path:
    """n rows cycling over the VADER pairs (each row a little different: its index is in it)."""
    pairs = [json.loads(line) for line in Path(ASSET).read_text().splitlines()]
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            pair = pairs[i % len(pairs)]
            prompt = f"Review {i}:\n"
            if kind == "score":
                row = {"id": i, "prompt": prompt, "response": pair["chosen"][:120]}
            else:
                row = {
                    "prompt": prompt,
                    "chosen": pair["chosen"][:120],
                    "rejected": pair["rejected"][:120],
                }
            fh.write(json.dumps(row) + "\n")
    return path


def run(command: list[str]) -> dict:
    """Runs one child; returns its peak RSS (MiB), wall time and exit status."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    # The child's output goes to /dev/null: only its exit status and peak memory matter here.
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
    pid = os.posix_spawn(command[0], command, env, file_actions=quiet)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} exited with {code}")
    return {"peak_mib": round(usage.ru_maxrss / 1024, 1), "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,100000", help="comma-separated row counts")
    parser.add_argument("--commands", default="score,eval", help="score and/or eval")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences/pairs per batch")
    args = parser.parse_args()
    counts = [int(x) for x in args.rows.split(",")]
    commands = args.commands.split(",")
    results: dict = {"max_sequence_length": MAX_LEN, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory(prefix="rewardax-stream-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp)
        for name in commands:
            results[name] = {}
            for n in counts:
                data = write_rows(tmp / f"{name}-{n}.jsonl", n, name)
                size = data.stat().st_size / 2**20
                if name == "score":
                    cmd = [
                        str(RX),
                        "score",
                        "--model",
                        str(model),
                        "--input",
                        str(data),
                        "--output",
                        str(tmp / f"scored-{n}.jsonl"),
                        "--overwrite",
                        "--max-length",
                        str(MAX_LEN),
                        "--batch-size",
                        str(args.batch_size),
                    ]
                else:
                    cmd = [
                        str(RX),
                        "eval",
                        "--model",
                        str(model),
                        "--data",
                        str(data),
                        "--batch-size",
                        str(args.batch_size),
                        f"--data.max_sequence_length={MAX_LEN}",
                    ]
                figures = {**run(cmd), "input_mib": round(size, 1)}
                results[name][n] = figures
                print(
                    f"{name:5s} {n:>8d} rows ({size:6.1f} MiB input): peak RSS "
                    f"{figures['peak_mib']:8.1f} MiB, {figures['seconds']:6.1f} s",
                    flush=True,
                )
            peaks = [results[name][n]["peak_mib"] for n in counts]
            results[name]["growth"] = round(peaks[-1] / peaks[0] - 1, 4)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

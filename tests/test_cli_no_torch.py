"""The main job's commands as a new user's `.venv` runs them: torch cannot be imported, the run is
epoch-based (no max_training_steps) with a warmup longer than one step, and the held-out rows are
longer than the run's max_sequence_length. `train`, `eval`, `score` and `export` each run as a
subprocess of the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama

# Left out of `make test`, run by `make test-slow`: runs the console scripts as subprocesses with torch blocked.
pytestmark = pytest.mark.slow

RX = Path(sys.executable).parent / "rewardax"
ASSETS = resources.files("rewardax") / "assets"
MAX_LENGTH = 32
# `sys.modules["torch"] = None` makes `import torch` raise ImportError, and
# `importlib.util.find_spec("torch")` (how transformers looks for it) return None, as without torch.
NO_TORCH = 'import sys\nsys.modules["torch"] = None\n'
EPOCH_RUN = f"""
data:
  max_sequence_length: {MAX_LENGTH}
optim:
  learning_rate: 1.0e-3
  schedule: linear
  warmup_steps: 5
train:
  per_device_train_batch_size: 2
  per_device_eval_batch_size: 4
  num_train_epochs: 1
  seed: 0
checkpoint:
  save_steps: 3
logging:
  progress_bar: false
"""


def rows_of(name: str, n: int) -> list[dict]:
    lines = (ASSETS / name).read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(env: dict, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(RX), *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no-torch")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    env = {"JAX_PLATFORMS": "cpu", "PATH": str(RX.parent), "PYTHONPATH": str(site)}
    tokenizer = smollm2_tokenizer()
    model_dir = tmp / "tiny-model"
    tiny_llama(tokenizer).save_pretrained(model_dir, tokenizer=tokenizer)
    train = write_jsonl(tmp / "train.jsonl", rows_of("vader_movie_pairs.train.jsonl", 12))
    heldout = write_jsonl(tmp / "heldout.jsonl", rows_of("vader_movie_pairs.heldout.jsonl", 8))
    (tmp / "epoch.yaml").write_text(EPOCH_RUN)
    proc = run(
        env,
        "train",
        "--config",
        str(tmp / "epoch.yaml"),
        "--train",
        str(train),
        "--eval",
        f"heldout={heldout}",
        f"--model.path={model_dir}",
        f"--checkpoint.save_directory={tmp / 'runs'}",
    )
    return {"tmp": tmp, "env": env, "tokenizer": tokenizer, "train": proc}


def test_torch_is_blocked_in_the_subprocesses(job):
    proc = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=job["env"]
    )
    assert proc.returncode != 0 and "torch" in proc.stderr


def test_epoch_based_run_trains_all_its_steps(job):
    summary = last_json(job["train"])
    # 12 pairs, 2 a step, one epoch; 5 warmup steps fit in 6.
    assert summary["steps"] == 6 and summary["export_dir"]
    run_dir = Path(summary["run_dir"])
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [3, 6]


def long_pairs() -> list[dict]:
    """Held-out pairs of four sentences a side: longer than MAX_LENGTH tokens."""
    rows = rows_of("vader_movie_pairs.heldout.jsonl", 24)
    return [
        {
            "prompt": rows[i]["prompt"],
            "chosen": " ".join(r["chosen"] for r in rows[i : i + 4]),
            "rejected": " ".join(r["rejected"] for r in rows[i : i + 4]),
        }
        for i in range(0, 24, 4)
    ]


def test_eval_on_the_runs_export_truncates_long_rows_and_counts_them(job):
    export = Path(last_json(job["train"])["export_dir"])
    data = write_jsonl(job["tmp"] / "long.jsonl", long_pairs())
    proc = run(job["env"], "eval", "--model", str(export), "--data", str(data))
    metrics = last_json(proc)["metrics"]
    assert metrics["num_pairs"] == 6 and metrics["num_dropped"] == 0
    assert metrics["num_truncated"] == 6  # every pair is longer than the run's 32 tokens
    assert "6 pairs cut to 32 tokens (keep_end)" in proc.stderr


def test_score_on_the_runs_export_keeps_the_end_of_long_rows(job):
    export = Path(last_json(job["train"])["export_dir"])
    pair = long_pairs()[0]
    data = write_jsonl(job["tmp"] / "rows.jsonl", [{"text": pair["chosen"]}])
    out = job["tmp"] / "scored.jsonl"
    run(job["env"], "score", "--model", str(export), "--input", str(data), "--output", str(out))
    reward = json.loads(out.read_text())["reward"]
    # Reference: the last MAX_LENGTH tokens of the text + EOS (keep_end; no prompt, no BOS here).
    tok = job["tokenizer"]
    ids = [*tok(pair["chosen"]).input_ids, tok.eos_token_id]
    assert len(ids) > MAX_LENGTH
    model = rx.AutoRewardModel.from_pretrained(export)
    expected = float(np.asarray(model(np.asarray([ids[-MAX_LENGTH:]], np.int32)).logits)[0, 0])
    assert reward == pytest.approx(expected, abs=1e-4)


def test_export_of_an_epoch_based_run_equals_the_trainers_export(job):
    summary = last_json(job["train"])
    out = job["tmp"] / "exported"
    proc = run(job["env"], "export", "--checkpoint", summary["run_dir"], "--output", str(out))
    assert last_json(proc)["step"] == 6
    ids = np.asarray([job["tokenizer"]("A warm and funny film.").input_ids], np.int32)
    ours = rx.AutoRewardModel.from_pretrained(out)(ids).logits
    trainers = rx.AutoRewardModel.from_pretrained(summary["export_dir"])(ids).logits
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(trainers))


def test_gguf_model_and_tokenizer_load_without_torch(job):
    code = (
        "import json\n"
        "from rewardax.models import AutoRewardModel, load_tokenizer, smollm2_gguf_path\n"
        "tok = load_tokenizer(smollm2_gguf_path())\n"
        "model = AutoRewardModel.from_pretrained(smollm2_gguf_path())\n"
        "print(json.dumps({'ids': tok('A warm film.').input_ids, "
        "'layers': model.config.num_hidden_layers}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=job["env"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == job["tokenizer"]("A warm film.").input_ids
    assert out["layers"] == 30

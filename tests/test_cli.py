"""The `rewardax` CLI end to end on a tiny random llama with SmolLM2's tokenizer: train (a real
subprocess of the console script), eval with a report, score, export, the export in transformers,
error cases, and the README's Python example."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import cli

ROOT = Path(__file__).resolve().parents[1]
RX = Path(sys.executable).parent / "rewardax"
TINY = ROOT / "src" / "rewardax" / "configs" / "tiny.yaml"
PROMPT = "Review:\n"
HELDOUT = resources.files("rewardax") / "assets" / "vader_movie_pairs.heldout.jsonl"
TRAIN = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"


def short_pairs(tokenizer, path, n, limit=30):
    """VADER pairs whose prompt + response fits `limit` tokens (no truncation: exact references)."""
    out = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if all(len(tokenizer(PROMPT + row[k]).input_ids) < limit for k in ("chosen", "rejected")):
            out.append({"prompt": PROMPT, "chosen": row["chosen"], "rejected": row["rejected"]})
        if len(out) == n:
            break
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def work(tokenizer, tmp_path_factory):
    """A tiny HF model dir, data files, and one `rewardax train` run through the console script."""
    tmp = tmp_path_factory.mktemp("cli")
    model_dir = tmp / "tiny-model"
    tiny_llama(tokenizer).save_pretrained(model_dir, tokenizer=tokenizer)
    train = write_jsonl(tmp / "train.jsonl", short_pairs(tokenizer, TRAIN, 24))
    heldout = short_pairs(tokenizer, HELDOUT, 12)
    for i, row in enumerate(heldout):
        row["subset"] = "even" if i % 2 == 0 else "odd"
    heldout_path = write_jsonl(tmp / "heldout.jsonl", heldout)
    runs = tmp / "runs"
    proc = subprocess.run(
        [
            str(RX),
            "train",
            "--config",
            str(TINY),
            "--train",
            str(train),
            "--eval",
            f"heldout={heldout_path}",
            f"--model.path={model_dir}",
            f"--checkpoint.save_directory={runs}",
            "--checkpoint.run_name",
            "run",
            "--eval.eval_at_start=true",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": str(RX.parent)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        "tmp": tmp,
        "model_dir": model_dir,
        "heldout": heldout,
        "heldout_path": heldout_path,
        "run": runs / "run",
        "proc": proc,
    }


def run_main(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def rewards_of(model, tokenizer, texts):
    """Independent reference: each text tokenized as training does (+EOS), one unpadded row each."""
    out = []
    for text in texts:
        ids = [*tokenizer(text).input_ids, tokenizer.eos_token_id]
        out.append(float(np.asarray(model(np.asarray([ids], np.int32)).logits)[0, 0]))
    return np.asarray(out)


def test_train_writes_the_run_and_ends_with_one_json_line(work):
    lines = work["proc"].stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    run = work["run"]
    assert summary["run_dir"] == str(run) and summary["steps"] == 4
    assert set(summary["accuracy_before"]) == {"heldout"} == set(summary["accuracy_after"])
    assert 0.0 <= summary["accuracy_after"]["heldout"] <= 1.0
    assert summary["data"]["pairs_seen"] == 4 * 4  # 4 steps x (2 per device x 2 accumulation)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    assert (run / "metrics.jsonl").is_file() and (run / "report" / "index.html").is_file()
    exported = json.loads((run / "export" / "config.json").read_text())["rewardax"]
    assert exported["trained_steps"] == 4 and exported["reward_normalization"]["std"] > 0
    before, after = summary["accuracy_before"]["heldout"], summary["accuracy_after"]["heldout"]
    assert f"heldout accuracy {before:.4f} -> {after:.4f}\n" in work["proc"].stderr
    assert "summary: {" not in work["proc"].stderr  # no raw dict on the console
    # Evaluated at the start, every eval_steps=2, and once (not twice) at the last step.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "eval/heldout"] == [0, 2, 4]
    page = (run / "report" / "index.html").read_text()
    # The run's facts, before/after and the misranked pairs reach the report.
    assert "Before and after training" in page and "Misranked pairs" in page
    assert str(run / "export") in page and "rewardax score --model" in page


@pytest.mark.slow
def test_eval_report_and_accuracy_match_independent_rewards(work, tokenizer, capsys):
    export, report = work["run"] / "export", work["tmp"] / "report"
    code, out, _ = run_main(
        capsys,
        [
            "eval",
            "--model",
            str(export),
            "--data",
            str(work["heldout_path"]),
            "--report",
            str(report),
        ],
    )
    assert code == 0
    metrics = json.loads(out.strip().splitlines()[-1])["metrics"]
    model = rx.AutoRewardModel.from_pretrained(export)
    rows = work["heldout"]
    chosen = rewards_of(model, tokenizer, [PROMPT + r["chosen"] for r in rows])
    rejected = rewards_of(model, tokenizer, [PROMPT + r["rejected"] for r in rows])
    diff = chosen - rejected
    wins = (diff > 0) + 0.5 * (diff == 0)
    assert metrics["num_pairs"] == len(rows)
    assert metrics["accuracy"] == pytest.approx(wins.mean())
    assert metrics["mean_margin"] == pytest.approx(diff.mean(), abs=1e-4)
    assert metrics["subsets"]["even"]["accuracy"] == pytest.approx(wins[0::2].mean())
    assert metrics["subsets"]["odd"]["num_pairs"] == len(rows) // 2
    for name in ("index.html", "training_curves.png", "reward_histograms.png", "calibration.png"):
        assert (report / name).is_file(), name
    assert (report / "reward_vs_length.png").is_file()


@pytest.mark.slow  # 30 s; `make test` keeps tests/test_scoring.py's score paths
def test_score_jsonl_and_parquet_with_normalize(work, tokenizer, capsys):
    export = work["run"] / "export"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    rows = [
        {"id": 0, "prompt": PROMPT, "response": "A gentle, lovely film."},
        {"id": 1, "text": "Terrible."},
        {"id": 2, "messages": chat},
        *(
            {"id": 3 + i, "prompt": PROMPT, "response": r["chosen"]}
            for i, r in enumerate(work["heldout"])
        ),
    ]
    src = write_jsonl(work["tmp"] / "to_score.jsonl", rows)
    out_path = work["tmp"] / "scored.jsonl"
    code, out, _ = run_main(
        capsys,
        [
            "score",
            "--model",
            str(export),
            "--input",
            str(src),
            "--output",
            str(out_path),
            "--batch-size",
            "4",
        ],
    )
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["rows"] == len(rows)
    scored = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["id"] for r in scored] == [r["id"] for r in rows]
    assert all(isinstance(r["reward"], float) for r in scored)
    model = rx.AutoRewardModel.from_pretrained(export)
    texts = [PROMPT + "A gentle, lovely film.", "Terrible."] + [
        PROMPT + r["chosen"] for r in work["heldout"]
    ]
    expected = rewards_of(model, tokenizer, texts)
    got = np.array([r["reward"] for r in scored])
    np.testing.assert_allclose(got[[0, 1, *range(3, len(rows))]], expected, atol=1e-4)
    # --normalize, parquet in and out.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([r for r in rows if "prompt" in r]), work["tmp"] / "in.parquet"
    )
    norm_out = work["tmp"] / "scored.parquet"
    argv = ["score", "--model", str(export), "--input", str(work["tmp"] / "in.parquet")]
    code, _, _ = run_main(capsys, [*argv, "--output", str(norm_out), "--normalize"])
    assert code == 0
    stats = json.loads((export / "config.json").read_text())["rewardax"]["reward_normalization"]
    normed = pq.read_table(norm_out).to_pylist()
    raw = {r["id"]: r["reward"] for r in scored}
    for row in normed:
        assert row["reward"] == pytest.approx(
            (raw[row["id"]] - stats["mean"]) / stats["std"], abs=1e-4
        )
    # An existing output is not overwritten without --overwrite.
    code, _, err = run_main(capsys, [*argv, "--output", str(norm_out)])
    assert code == 2 and "--overwrite" in err


def test_export_from_checkpoint_equals_trainer_export_and_loads_in_transformers(
    work, capsys, tokenizer
):
    out_dir = work["tmp"] / "exported"
    ckpt = work["run"] / "checkpoints" / "4"
    code, out, _ = run_main(capsys, ["export", "--checkpoint", str(ckpt), "--output", str(out_dir)])
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["step"] == 4
    ours = rx.AutoRewardModel.from_pretrained(out_dir)
    trainers = rx.AutoRewardModel.from_pretrained(work["run"] / "export")
    ids = np.asarray(
        [tokenizer("A bold and strange little movie about grief.").input_ids], np.int32
    )
    ours_r = np.asarray(ours(ids).logits)
    np.testing.assert_array_equal(ours_r, np.asarray(trainers(ids).logits))
    config = json.loads((out_dir / "config.json").read_text())["rewardax"]
    assert config["trained_steps"] == 4 and "reward_normalization" in config
    assert (out_dir / "tokenizer.json").is_file()

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out_dir).eval()
    # Rows whose last token is not the pad id (= EOS here): transformers' pooling reads the last
    # non-pad token, rewardax the last attention-mask one; both are the last token then.
    with torch.no_grad():
        hf_r = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(hf_r, ours_r, atol=1e-4)

    # A non-empty output directory is refused without --overwrite.
    code, _, err = run_main(capsys, ["export", "--checkpoint", str(ckpt), "--output", str(out_dir)])
    last = err.strip().splitlines()[-1]  # transformers' loading bar may precede it
    assert code == 2 and last.startswith("rewardax: error:") and "--overwrite" in last


def test_errors_are_one_line_with_status_2(work, capsys, monkeypatch):
    from huggingface_hub import constants

    data = str(work["heldout_path"])
    # A hub name that is not in the (empty) cache, offline: the command to fetch it.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(work["tmp"] / "empty-hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = run_main(
        capsys, ["eval", "--model", "HuggingFaceTB/SmolLM2-135M", "--data", data]
    )
    assert code == 2 and "HF_HUB_OFFLINE=1" in err and len(err.strip().splitlines()) == 1
    assert "hf download HuggingFaceTB/SmolLM2-135M" in err
    missing = str(work["tmp"] / "nope.jsonl")
    code, _, err = run_main(
        capsys,
        ["score", "--model", str(work["model_dir"]), "--input", missing, "--output", "x.jsonl"],
    )
    assert code == 2 and "does not exist" in err
    # Through the console script: no traceback, status 2.
    proc = subprocess.run(
        [str(RX), "train", "--config", str(work["tmp"] / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": str(RX.parent)},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"rewardax: error: config file {work['tmp'] / 'missing.yaml'} does not exist"
    ]


def test_readme_python_example_runs(work, tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- example -->\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    code = code.replace("smollm2_gguf_path()", repr(str(work["model_dir"])))
    code = code.replace("max_training_steps=40", "max_training_steps=2")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert (tmp_path / "my-reward-model" / "config.json").is_file()
    assert 0.0 <= namespace["metrics"]["heldout"]["accuracy"] <= 1.0


def test_score_chat_row_equals_unpadded_reference(work, tokenizer, capsys):
    # The run's data.max_sequence_length is 32 (tiny.yaml), shorter than SmolLM2's rendered chat
    # (its template adds a system prompt), so scoring at that length truncates with keep_end as
    # training did; --max-length 128 scores the whole conversation.
    export = work["run"] / "export"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    src = write_jsonl(work["tmp"] / "chat.jsonl", [{"messages": chat}])
    out_path = work["tmp"] / "chat_scored.jsonl"
    argv = ["score", "--model", str(export), "--input", str(src), "--output", str(out_path)]
    assert run_main(capsys, [*argv, "--max-length", "128"])[0] == 0
    got = [json.loads(line)["reward"] for line in out_path.read_text().splitlines()]
    model = rx.AutoRewardModel.from_pretrained(export)
    rendered = tokenizer.apply_chat_template(chat, tokenize=False).rstrip()
    chat_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    chat_reward = float(np.asarray(model(np.asarray([chat_ids], np.int32)).logits)[0, 0])
    assert got[0] == pytest.approx(chat_reward, abs=1e-4)


def test_eval_scores_without_an_optimizer_or_a_trainer(work, capsys, monkeypatch):
    """`rewardax eval` loads the model and scores pairs: no optimizer state, no RewardTrainer."""
    import rewardax.optim
    import rewardax.trainer

    def refuse(*args, **kwargs):
        raise AssertionError("eval built an optimizer or a trainer")

    monkeypatch.setattr(rewardax.optim, "build_optimizer", refuse)
    monkeypatch.setattr(rewardax.trainer.RewardTrainer, "__init__", refuse)
    argv = ["eval", "--model", str(work["run"] / "export"), "--data", str(work["heldout_path"])]
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["metrics"]["num_pairs"] == len(work["heldout"])


def test_eval_rewardbench_layouts_equal_rules_applied_to_score_rewards(work, tokenizer, capsys):
    """`rewardax eval` on RewardBench 1 and 2 layouts against the benchmarks' rules applied by
    hand to rewards from `rewardax score` of the same responses."""
    from rewardax import rewardbench as rb

    export, pairs = work["run"] / "export", work["heldout"]
    texts = sorted({r[k] for r in pairs for k in ("chosen", "rejected")})
    to_score = [{"id": i, "prompt": PROMPT, "response": t} for i, t in enumerate(texts)]
    scored_path = work["tmp"] / "rb_scored.jsonl"
    argv = [
        "score",
        "--model",
        str(export),
        "--input",
        str(write_jsonl(work["tmp"] / "rb_in.jsonl", to_score)),
    ]
    assert run_main(capsys, [*argv, "--output", str(scored_path)])[0] == 0
    reward = {
        texts[r["id"]]: r["reward"] for r in map(json.loads, scored_path.read_text().splitlines())
    }

    # RewardBench 1: pairs labelled with its subsets (and one of ours).
    names = ["alpacaeval-easy", "mt-bench-med", "math-prm", "hep-go", "mine"]
    rb1 = [{**r, "subset": names[i % len(names)]} for i, r in enumerate(pairs)]

    def evaluate(name: str, rows: list[dict], *extra: str) -> tuple[dict, str]:
        path = write_jsonl(work["tmp"] / f"{name}.jsonl", rows)
        code, out, err = run_main(
            capsys, ["eval", "--model", str(export), "--data", str(path), *extra]
        )
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1])["metrics"], err

    metrics, err = evaluate("rb1", rb1)
    got = metrics["rewardbench"]
    right = {s: [] for s in names}
    for r in rb1:
        right[r["subset"]].append(reward[r["chosen"]] > reward[r["rejected"]])
    acc = {s: float(np.mean(v)) for s, v in right.items()}
    chat = (acc["alpacaeval-easy"] * 100 + acc["mt-bench-med"] * 40) / 140
    reasoning = (acc["math-prm"] * 984 + acc["hep-go"] * 164) / (984 + 164)
    assert got["sections"] == pytest.approx({"Chat": chat, "Reasoning": reasoning})
    assert got["score"] == pytest.approx((chat + reasoning) / 2)
    assert got["other_subsets"] == ["mine"] and "RewardBench score" in err

    # RewardBench 2: best of 4 in two subsets, and a Ties prompt (ref and tied rows).
    responses = [t for r in pairs for t in (r["chosen"], r["rejected"])]
    rb2 = [
        {
            "prompt": PROMPT,
            "chosen": [responses[4 * i]],
            "rejected": responses[4 * i + 1 : 4 * i + 4],
            "subset": "Focus" if i % 2 else "Math",
            "id": str(i),
        }
        for i in range(4)
    ]
    a, b, c, d = responses[16:20]
    rb2 += [
        {"prompt": PROMPT, "chosen": [a], "rejected": [b, c], "subset": "Ties", "id": "ref:0"},
        {"prompt": PROMPT, "chosen": [a, d], "rejected": [b], "subset": "Ties", "id": "tied:0"},
    ]
    metrics, err = evaluate("rb2", rb2, "--report", str(work["tmp"] / "rb2_report"))
    got = metrics["rewardbench2"]
    best = {"Focus": [], "Math": []}
    for row in rb2[:4]:
        s = [reward[t] for t in row["chosen"] + row["rejected"]]
        best[row["subset"]].append(1.0 / s.count(max(s)) if s[0] == max(s) else 0.0)
    ties = rb.ties_score(
        {
            ("ref", 0): (np.array([reward[a]]), np.array([reward[b], reward[c]])),
            ("tied", 0): (np.array([reward[a], reward[d]]), np.array([reward[b]])),
        }
    )["score"]
    want = {"Focus": np.mean(best["Focus"]), "Math": np.mean(best["Math"]), "Ties": ties}
    assert got["subsets"] == pytest.approx(want, abs=1e-6)
    assert got["score"] == pytest.approx(np.mean(list(want.values())), abs=1e-6)
    assert got["num_unscored"] == 0 and "RewardBench 2 score" in err
    # Rankings (no subset): evaluated as their pairs, ties half as everywhere else.
    ranked = [
        {"prompt": PROMPT, "responses": responses[3 * i : 3 * i + 3], "ranks": [1, 2, 3]}
        for i in range(4)
    ]
    metrics, _ = evaluate("ranked", ranked)
    wins = [
        float(reward[r["responses"][a]] > reward[r["responses"][b]])
        + 0.5 * (reward[r["responses"][a]] == reward[r["responses"][b]])
        for r in ranked
        for a, b in ((0, 1), (0, 2), (1, 2))
    ]
    assert metrics["num_pairs"] == 12 and metrics["accuracy"] == pytest.approx(np.mean(wins))
    top1 = [
        float(max(r["responses"], key=lambda t: reward[t]) == r["responses"][0]) for r in ranked
    ]
    assert metrics["ranking"]["num_rows"] == 4
    assert metrics["ranking"]["top1_accuracy"] == pytest.approx(np.mean(top1))
    page = (work["tmp"] / "rb2_report" / "index.html").read_text()
    assert "rb2: RewardBench 2" in page and "<td>Ties</td>" in page

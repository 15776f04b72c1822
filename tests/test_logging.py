"""MetricsLogger: metrics.jsonl contents, resume truncation, torn lines, TensorBoard, W&B, processes."""

from __future__ import annotations

import json
import math
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from rewardax.errors import ConfigError, DataError
from rewardax.logging import METRICS_FILE, MetricsLogger, read_metrics


def read_tfevents(directory: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the TensorBoard event files under ``directory``.

    Event files are TFRecord streams: [u64 length][u32 crc][payload][u32 crc] per record, with an
    ``Event`` protobuf as payload (tensorboardX ships the proto).
    """
    from tensorboardX.proto.event_pb2 import Event

    scalars = []
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {directory}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = Event.FromString(payload)
            for value in event.summary.value:
                scalars.append((value.tag, event.step, value.simple_value))
    return scalars


def test_lines_are_written_and_parsed_back(tmp_path: Path, capsys) -> None:
    with MetricsLogger(tmp_path, total_steps=20, progress_bar=False) as logger:
        logger.log(10, {"loss": np.float32(0.5), "accuracy": 0.75, "pairs_per_second": 100.0})
        logger.log(10, {"loss": 0.25, "accuracy": 1.0, "num_pairs": 7}, prefix="eval/heldout")
        logger.log(20, {"loss": float("nan"), "grad_norm": float("inf")})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["split"]) for r in rows] == [
        (10, "train"),
        (10, "eval/heldout"),
        (20, "train"),
    ]
    assert rows[0]["loss"] == 0.5 and rows[0]["accuracy"] == 0.75
    assert rows[1]["num_pairs"] == 7 and isinstance(rows[1]["num_pairs"], int)
    assert math.isnan(rows[2]["loss"]) and rows[2]["grad_norm"] == math.inf
    # Strict JSON on disk (no NaN tokens), so jq and friends can read it too.
    for line in (tmp_path / METRICS_FILE).read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    err = capsys.readouterr().err
    assert "step 10/20 loss 0.5000 acc 0.750 pairs/s 100.0" in err
    assert "step 10 eval/heldout: loss 0.2500 acc 1.0000 pairs 7\n" in err
    assert "step 20/20 loss nan" in err


def test_resume_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, progress_bar=False) as logger:
        for step in range(1, 8):
            logger.log(step, {"loss": 1.0 / step})
        logger.log(4, {"accuracy": 0.5}, prefix="eval/a")
    # The run died after step 7; its last checkpoint is step 4. The resumed run logs 5..8.
    with MetricsLogger(tmp_path, progress_bar=False, resume_step=4) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 4]
        for step in range(5, 9):
            logger.log(step, {"loss": 2.0 / step})
    rows = read_metrics(tmp_path)
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[3]["loss"] == 0.25 and train[4]["loss"] == 0.4  # old before, new after
    assert [r["step"] for r in rows if r["split"] == "eval/a"] == [4]


def test_fresh_run_keeps_the_old_file_aside(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, progress_bar=False) as logger:
        logger.log(1, {"loss": 1.0})
    with MetricsLogger(tmp_path, progress_bar=False) as logger:
        logger.log(1, {"loss": 2.0})
    assert [r["loss"] for r in read_metrics(tmp_path)] == [2.0]
    assert [r["loss"] for r in read_metrics(tmp_path / (METRICS_FILE + ".prev"))] == [1.0]


def test_torn_last_line_is_tolerated(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    good = [json.dumps({"step": s, "split": "train", "loss": 0.1 * s}) for s in (1, 2, 3)]
    path.write_text("\n".join(good) + '\n{"step": 4, "split": "tr')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    # Resuming from step 3 removes the torn line, and new lines start on a line of their own.
    with MetricsLogger(tmp_path, progress_bar=False, resume_step=3) as logger:
        logger.log(4, {"loss": 0.4})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    # A record whose newline never made it is still a whole record.
    path.write_text(good[0] + "\n" + good[1])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    # Garbage in the middle is not a torn line: it is reported with its line number.
    path.write_text(good[0] + "\nnot json\n" + good[1] + "\n")
    with pytest.raises(DataError, match="line 2"):
        read_metrics(path)
    with pytest.raises(DataError, match="line 2"):
        MetricsLogger(tmp_path, progress_bar=False, resume_step=3)


def test_tensorboard_scalars_are_readable(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, report_to=["tensorboard"], progress_bar=False) as logger:
        logger.log(5, {"loss": 0.5, "accuracy": 0.75})
        logger.log(5, {"accuracy": 0.625}, prefix="eval/heldout")
        logger.log(10, {"loss": 0.25})
    scalars = read_tfevents(tmp_path / "tensorboard")
    assert ("train/loss", 5, 0.5) in scalars
    assert ("train/accuracy", 5, 0.75) in scalars
    assert ("eval/heldout/accuracy", 5, 0.625) in scalars
    assert ("train/loss", 10, 0.25) in scalars


def test_only_process_zero_writes(tmp_path: Path, capsys) -> None:
    with MetricsLogger(tmp_path / "run", report_to=["tensorboard"], process_index=1) as logger:
        logger.log(1, {"loss": 1.0})
        logger.update(1, {"loss": 1.0})
        logger.summary({"steps": 1})
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ""


def test_bad_settings_are_config_errors(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"unknown target.*'mlflow'"):
        MetricsLogger(tmp_path, report_to=["mlflow"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLogger(tmp_path, report_to=["wandb"])
    with MetricsLogger(tmp_path, progress_bar=False) as logger:
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 3})
        with pytest.raises(TypeError, match="'loss' must be a number"):
            logger.log(1, {"loss": [1, 2]})


def test_wandb_receives_prefixed_scalars_and_keeps_its_run_id(tmp_path: Path, monkeypatch) -> None:
    calls: dict[str, list] = {"init": [], "log": [], "summary": [], "finish": []}

    class FakeRun:
        summary = types.SimpleNamespace(update=lambda d: calls["summary"].append(d))

        def log(self, data, step):
            calls["log"].append((data, step))

        def finish(self):
            calls["finish"].append(True)

    fake = types.SimpleNamespace(
        init=lambda **kw: calls["init"].append(kw) or FakeRun(),
        util=types.SimpleNamespace(generate_id=lambda: "abc123"),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(
        tmp_path, report_to=["wandb"], progress_bar=False, config={"lr": 1e-5}
    ) as lg:
        lg.log(3, {"loss": 0.5}, prefix="eval/x")
        lg.summary({"accuracy": 0.9})
    fake.util.generate_id = lambda: "other"
    with MetricsLogger(tmp_path, report_to=["wandb"], progress_bar=False, resume_step=3):
        pass
    assert calls["log"] == [({"eval/x/loss": 0.5}, 3)]
    assert calls["summary"] == [{"accuracy": 0.9}] and calls["finish"] == [True, True]
    assert calls["init"][0]["id"] == calls["init"][1]["id"] == "abc123"  # resumed: same W&B run
    assert calls["init"][0]["config"] == {"lr": 1e-5} and calls["init"][1]["resume"] == "allow"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"accuracy": 0.9}


def test_an_event_is_one_row_and_one_line_and_no_scalar(tmp_path: Path, capsys) -> None:
    checkpoint = str(tmp_path / "checkpoints" / "5")
    with MetricsLogger(
        tmp_path, report_to=["tensorboard"], progress_bar=False, resume_step=5
    ) as logger:
        logger.event(5, "resume", "resuming run r from step 5 (x)", {"checkpoint": checkpoint})
        logger.log(6, {"loss": 0.5})
        with pytest.raises(ValueError, match="reserved"):
            logger.event(6, "resume", "no", {"step": 3})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["split"]) for r in rows] == [(5, "resume"), (6, "train")]
    assert rows[0]["checkpoint"] == checkpoint and "loss" not in rows[0]
    assert "resuming run r from step 5 (x)\n" in capsys.readouterr().err
    assert [tag for tag, _, _ in read_tfevents(tmp_path / "tensorboard")] == ["train/loss"]
    # Other processes write and print nothing.
    other = tmp_path / "other"
    with MetricsLogger(other, process_index=1, progress_bar=False) as logger:
        logger.event(5, "resume", "resuming", {"checkpoint": checkpoint})
    assert not other.exists() and capsys.readouterr().err == ""

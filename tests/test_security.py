"""Security (issue #8): no pickle, no remote code, sandboxed chat templates, no silent overwrite,
nothing from a data row or a config executed.

Every "would it run?" check plants a payload that creates a sentinel file if it ever runs, and
asserts the sentinel is absent afterwards, besides the error the user sees.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import rewardax as rx
from data_fixtures import smollm2_tokenizer
from rewardax import cli
from rewardax.config import RewardConfig
from rewardax.data import DataConfig, iterate_eval_batches
from rewardax.errors import CheckpointError, ConfigError, DataError, ModelLoadError
from rewardax.scoring import ResponseEncoder

SRC = Path(__file__).resolve().parents[1] / "src" / "rewardax"
SOURCES = sorted(SRC.rglob("*.py"))


# ------------------------------------------------------------------------- the source, statically

BANNED_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "marshal",
    "shelve",
    "torch",  # test-only dependency; torch.load unpickles
    "jinja2",  # templates are rendered only by transformers' sandboxed environment
    "subprocess",
}
BANNED_BUILTINS = {"eval", "exec", "compile", "__import__"}
BANNED_METHODS = {"system", "popen", "unsafe_load", "read_pickle"}  # os.*, yaml.*, pandas


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for name in names:
                if name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{where}:{node.lineno}: imports {name}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if (isinstance(node.func, ast.Name) and name in BANNED_BUILTINS) or (
                isinstance(node.func, ast.Attribute) and node.func.attr in BANNED_METHODS
            ):
                found.append(f"{where}:{node.lineno}: calls {name}")
            if name in ("yaml.load", "np.load", "numpy.load", "torch.load"):
                found.append(f"{where}:{node.lineno}: calls {name} (pickle/unsafe loader)")
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    found.append(f"{where}:{node.lineno}: allow_pickle not False")
                if kw.arg == "trust_remote_code" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    found.append(f"{where}:{node.lineno}: trust_remote_code not False")
                if kw.arg == "shell":
                    found.append(f"{where}:{node.lineno}: shell=")
    return found


def test_the_package_source_has_no_pickle_remote_code_eval_or_raw_jinja():
    assert len(SOURCES) > 20  # the scan sees the whole package
    problems = [p for path in SOURCES for p in _problems(path)]
    assert problems == []


def test_the_scan_catches_what_it_bans(tmp_path):
    """The scanner itself can fail: a file with each banned construct is reported."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import pickle\nimport numpy as np\nfrom transformers import AutoTokenizer\n"
        "np.load('x', allow_pickle=True)\n"
        "AutoTokenizer.from_pretrained('x', trust_remote_code=True)\neval('1')\n"
    )
    assert len(_problems(bad)) == 5, _problems(bad)


def test_yaml_configs_are_read_safely(tmp_path):
    sentinel = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(f"train: !!python/object/apply:os.system ['touch {sentinel}']\n")
    with pytest.raises(ConfigError):
        RewardConfig.from_yaml(config)
    assert not sentinel.exists()


def test_config_values_are_parsed_never_evaluated(tmp_path):
    sentinel = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {sentinel}')"
    with pytest.raises(ConfigError):
        RewardConfig().with_overrides([f"optim.learning_rate={payload}"])
    config = RewardConfig().with_overrides([f"model.path={payload}"])  # a string field: just text
    assert config.model.path == payload
    assert not sentinel.exists()


# --------------------------------------------------------------------------------- model loading


class _Payload:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("security") / "model"
    rx.RewardModel(config, rngs=nnx.Rngs(0)).save_pretrained(path, tokenizer=tokenizer)
    return path


def _pickle_dir(model_dir: Path, target: Path, sentinel: Path, keep_safetensors: bool) -> Path:
    shutil.copytree(model_dir, target)
    if not keep_safetensors:
        (target / "model.safetensors").unlink()
    (target / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(sentinel)))
    return target


def test_a_pickle_checkpoint_is_refused_with_the_conversion_command(model_dir, tmp_path):
    sentinel = tmp_path / "pwned"
    target = _pickle_dir(model_dir, tmp_path / "torch-model", sentinel, keep_safetensors=False)
    for path in (target, target / "pytorch_model.bin"):
        with pytest.raises(ModelLoadError) as info:
            rx.AutoRewardModel.from_pretrained(path)
        message = str(info.value)
        assert "does not unpickle" in message
        assert "save_pretrained(" in message and str(target) in message  # the command to run
    assert not sentinel.exists()


def test_a_pickle_next_to_safetensors_is_never_opened(model_dir, tmp_path):
    sentinel = tmp_path / "pwned"
    target = _pickle_dir(model_dir, tmp_path / "both", sentinel, keep_safetensors=True)
    model = rx.AutoRewardModel.from_pretrained(target)
    assert np.isfinite(np.asarray(model(np.array([[1, 2, 3]], np.int32)).logits)).all()
    assert not sentinel.exists()


def test_cli_refuses_a_pickle_model_in_one_error_line(model_dir, tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    target = _pickle_dir(model_dir, tmp_path / "torch-model", sentinel, keep_safetensors=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    code = cli.main(
        [
            "score",
            "--model",
            str(target),
            "--input",
            str(rows),
            "--output",
            str(tmp_path / "o.jsonl"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("rewardax: error:")
    assert "does not unpickle" in err and "save_pretrained(" in err
    assert not sentinel.exists()


def test_a_tokenizer_with_remote_code_is_refused_without_running_it(model_dir, tmp_path):
    sentinel = tmp_path / "pwned"
    evil = tmp_path / "evil-tokenizer"
    evil.mkdir()
    shutil.copy(model_dir / "tokenizer.json", evil / "tokenizer.json")
    (evil / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]},
            }
        )
    )
    (evil / "evil_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('x')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    with pytest.raises(ModelLoadError, match="custom code"):
        rx.load_tokenizer(evil)
    assert not sentinel.exists()


# ------------------------------------------------------------------------------- chat templates

SANDBOX_ESCAPE = (
    "{{ cycler.__init__.__globals__.os.system('touch SENTINEL') }}"
    "{{ ''.__class__.__mro__[1].__subclasses__() }}"
)


def test_a_malicious_chat_template_is_stopped_by_the_sandbox(tokenizer, tmp_path):
    sentinel = tmp_path / "pwned"
    evil = copy.deepcopy(tokenizer)
    evil.chat_template = SANDBOX_ESCAPE.replace("SENTINEL", str(sentinel))
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    encoder = ResponseEncoder(evil, DataConfig(max_sequence_length=64))
    with pytest.raises(DataError, match="chat template failed: SecurityError"):
        encoder.encode(row, "row 0")
    pairs = [
        {
            "chosen": row["messages"],
            "rejected": [row["messages"][0], {"role": "assistant", "content": "no"}],
        }
    ]
    with pytest.raises(DataError, match="SecurityError"):
        list(iterate_eval_batches(pairs, evil, DataConfig(max_sequence_length=64), batch_size=1))
    assert not sentinel.exists()


def test_a_row_cannot_bring_its_own_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    swap = {"chat_template": "{{ 7 * 7 }}"}
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    with pytest.raises(DataError, match="chat_template_kwargs"):
        encoder.encode({"messages": messages, "chat_template_kwargs": swap}, "row 0")
    pair = {"chosen": messages, "rejected": [*messages[:1], {"role": "assistant", "content": "no"}]}
    with pytest.raises(DataError, match="chat_template_kwargs"):
        list(
            iterate_eval_batches(
                [{**pair, "chat_template_kwargs": swap}],
                tokenizer,
                DataConfig(max_sequence_length=64),
                batch_size=1,
            )
        )


def test_template_and_code_in_a_row_are_just_text(tokenizer, model_dir, tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    payloads = [
        "{{ 7 * 7 }} {% for x in range(3) %}x{% endfor %}",
        f"__import__('os').system('touch {sentinel}')",
        f"$(touch {sentinel}) `touch {sentinel}`",
    ]
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=128))
    for text in payloads:
        row = {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
        }
        rendered = tokenizer.decode(encoder.encode(row, "row 0"))
        assert text in rendered  # verbatim: not rendered as a template, not run
    assert "49" not in tokenizer.decode(encoder.encode({"text": payloads[0]}, "row 1"))

    source, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"text": t, "id": t}) + "\n" for t in payloads))
    code = cli.main(
        ["score", "--model", str(model_dir), "--input", str(source), "--output", str(output)]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == payloads
    assert not sentinel.exists()


# ------------------------------------------------------------------------ no silent overwrite


def _run_cli(capsys, argv):
    code = cli.main(argv)
    return code, capsys.readouterr().err


def test_score_output_is_not_overwritten_without_overwrite(model_dir, tmp_path, capsys):
    source, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"text": "hello"}\n')
    output.write_text("precious\n")
    code, err = _run_cli(
        capsys,
        ["score", "--model", str(model_dir), "--input", str(source), "--output", str(output)],
    )
    assert code == 2 and "--overwrite" in err
    assert output.read_text() == "precious\n"
    code, _ = _run_cli(
        capsys,
        [
            "score",
            "--model",
            str(model_dir),
            "--input",
            str(source),
            "--output",
            str(output),
            "--overwrite",
        ],
    )
    assert code == 0 and "reward" in json.loads(output.read_text())


def test_export_output_dir_is_not_overwritten_without_overwrite(model_dir, tmp_path, capsys):
    output = tmp_path / "export"
    output.mkdir()
    (output / "keep.txt").write_text("precious")
    code, err = _run_cli(
        capsys, ["export", "--checkpoint", str(model_dir), "--output", str(output)]
    )
    assert code == 2 and "--overwrite" in err.strip().splitlines()[-1]
    assert [p.name for p in output.iterdir()] == ["keep.txt"]
    assert (output / "keep.txt").read_text() == "precious"


def test_eval_report_dir_is_not_overwritten_without_overwrite(model_dir, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"chosen": f"good {i}", "rejected": f"bad {i}"}) + "\n" for i in range(4)
        )
    )
    report = tmp_path / "report"
    report.mkdir()
    (report / "keep.txt").write_text("precious")
    code, err = _run_cli(
        capsys,
        [
            "eval",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "--report",
            str(report),
            "--data.max_sequence_length=32",
        ],
    )
    assert code == 2 and "not empty" in err.strip().splitlines()[-1]
    assert [p.name for p in report.iterdir()] == ["keep.txt"]


def test_a_fresh_run_never_reuses_a_folder_holding_checkpoints(tokenizer, model_dir, tmp_path):
    """checkpoint.resume=off into a run folder with checkpoints is refused: saving there would keep
    the old run's checkpoints (a valid checkpoint is never replaced) and mix two runs."""
    from rewardax.checkpoint import TrainCheckpointer

    old = tmp_path / "runs" / "r" / "checkpoints"
    with TrainCheckpointer(old, max_to_keep=None) as ckpt:
        ckpt.save(2, {"w": np.zeros(3, np.float32)}, {"note": "the earlier run"})
    before = sorted(p.name for p in old.iterdir())
    config = RewardConfig.from_yaml(
        SRC / "configs" / "tiny.yaml",
        [
            f"checkpoint.save_directory={tmp_path / 'runs'}",
            "checkpoint.run_name=r",
            "checkpoint.resume=off",
        ],
    )
    pairs = [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(8)]
    model = rx.AutoRewardModel.from_pretrained(model_dir)
    trainer = rx.RewardTrainer(config, tokenizer, model=model, train_dataset=pairs)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        trainer.train()
    assert sorted(p.name for p in old.iterdir()) == before
    assert not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()

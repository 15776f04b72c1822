"""Hugging Face hub names for models and data (rewardax.hub), resolved offline against a hub cache
that each test lays out itself in huggingface_hub's layout:

  <HF_HOME>/hub/models--org--name/blobs/<sha256>
                                 /refs/<branch or tag>            (holds the commit hash)
                                 /snapshots/<commit>/<file> -> ../../blobs/<sha256>
  <HF_HOME>/hub/datasets--org--name/...                           (the same for a dataset repo)

huggingface_hub and datasets read HF_HOME / HF_HUB_OFFLINE when they are imported, so in-process
tests patch the constants they read (and the environment, for subprocesses); the CLI test runs the
console script in a subprocess with only the environment set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import cli
from rewardax.data import load_eval_sources, load_source
from rewardax.errors import DataError, ModelLoadError
from rewardax.hub import MODEL_PATTERNS, parse_dataset_name, parse_model_name, resolve_model_path
from rewardax.models import AutoRewardModel, load_tokenizer, smollm2_gguf_path

RX = Path(sys.executable).parent / "rewardax"
ROWS = [
    {"prompt": "Review:\n", "chosen": f"A fine film, number {i}.", "rejected": f"Dull {i}."}
    for i in range(10)
]


def cache_repo(hub_cache: Path, repo_id: str, files: dict, *, repo_type="model", refs=("main",)):
    """Lay out `files` ({path in repo: bytes or a local file}) as one commit of `repo_id` in the
    hub cache, pointed to by `refs`; returns the commit hash."""
    folder = hub_cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    contents = {
        name: data if isinstance(data, bytes) else Path(data).read_bytes()
        for name, data in files.items()
    }
    digest = hashlib.sha1(repo_id.encode())
    for name in sorted(contents):
        digest.update(name.encode() + hashlib.sha256(contents[name]).digest())
    commit = digest.hexdigest()
    for name, data in contents.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return commit


def dir_files(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def assert_same_weights(a, b):
    for x, y in zip(params(a), params(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """Two tiny HF model directories (different seeds) with SmolLM2's tokenizer."""
    tmp = tmp_path_factory.mktemp("models")
    out = {}
    for seed in (0, 1):
        out[seed] = tmp / f"tiny-{seed}"
        tiny_llama(tokenizer, seed=seed).save_pretrained(out[seed], tokenizer=tokenizer)
    return out


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty offline hub cache under tmp_path/hf (HF_HOME); returns its `hub` directory."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    (home / "hub").mkdir(parents=True)
    return home / "hub"


def test_names_parse():
    assert parse_model_name("Qwen/Qwen2.5-0.5B-Instruct") is not None
    name = parse_model_name("org/name@refs/pr/3")
    assert (name.repo_id, name.revision, name.filename) == ("org/name", "refs/pr/3", None)
    name = parse_model_name("org/name-GGUF/sub/q8_0.gguf@v1")
    assert (name.repo_id, name.filename, name.revision) == ("org/name-GGUF", "sub/q8_0.gguf", "v1")
    name = parse_dataset_name("org/prefs:test[:500]@abc")
    assert (name.repo_id, name.split, name.revision) == ("org/prefs", "test[:500]", "abc")
    # Missing local files and relative paths are not hub names.
    for text in ("runs/model.gguf", "data/train.jsonl", "./org/name", "/abs/path", "a/b/c", "x"):
        assert parse_model_name(text) is None, text
        assert parse_dataset_name(text) is None, text


def test_model_patterns_never_fetch_pickles_or_subfolders():
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "consolidated.pt",
        "model.gguf",
        "original/model.safetensors",
        "onnx/model.onnx",
    ]
    kept = filter_repo_objects(repo, allow_patterns=MODEL_PATTERNS, ignore_patterns=["*/*"])
    assert sorted(kept) == sorted(repo[:6])


def test_hub_name_loads_the_cached_snapshot(hub, models, tokenizer):
    commit = cache_repo(hub, "org/tiny", dir_files(models[0]))
    path = resolve_model_path("org/tiny")
    assert path == hub / "models--org--tiny" / "snapshots" / commit
    assert_same_weights(
        AutoRewardModel.from_pretrained("org/tiny"), AutoRewardModel.from_pretrained(models[0])
    )
    tok = load_tokenizer("org/tiny")
    assert tok("A fine film.").input_ids == tokenizer("A fine film.").input_ids
    assert cli.local_model_path("org/tiny") == str(path)


def test_revision_pins_a_commit(hub, models):
    cache_repo(hub, "org/tiny", dir_files(models[0]))
    pinned = cache_repo(hub, "org/tiny", dir_files(models[1]), refs=("v1",))
    for name in ("org/tiny@v1", f"org/tiny@{pinned}"):
        assert resolve_model_path(name).name == pinned
        assert_same_weights(
            AutoRewardModel.from_pretrained(name), AutoRewardModel.from_pretrained(models[1])
        )
    assert resolve_model_path("org/tiny").name != pinned
    with pytest.raises(ModelLoadError, match=r"org/tiny at revision v2 is not in the Hugging"):
        resolve_model_path("org/tiny@v2")


def test_not_cached_offline_is_one_clear_error(hub, capsys, tmp_path):
    with pytest.raises(ModelLoadError) as info:
        AutoRewardModel.from_pretrained("org/absent")
    text = str(info.value)
    assert "\n" not in text
    assert "org/absent is not a local path" in text and "HF_HUB_OFFLINE=1" in text
    assert "`hf download org/absent`" in text and str(hub) in text
    with pytest.raises(ModelLoadError, match="hf download org/absent --revision v3"):
        load_tokenizer("org/absent@v3")
    with pytest.raises(DataError, match="hf download org/absent-data --repo-type dataset"):
        load_source("org/absent-data")
    # Through the CLI: status 2, one stderr line naming the repo.
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(jsonl(ROWS))
    code = cli.main(["eval", "--model", "org/absent", "--data", str(data)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("rewardax: error: org/absent is not a local path")


def test_pickle_only_repo_is_refused_with_the_conversion(hub, models):
    files = {"config.json": models[0] / "config.json", "pytorch_model.bin": b"not unpickled"}
    cache_repo(hub, "org/pickled", files)
    with pytest.raises(ModelLoadError) as info:
        AutoRewardModel.from_pretrained("org/pickled")
    text = str(info.value)
    assert "only PyTorch pickle weights (pytorch_model.bin)" in text
    assert "from_pretrained('org/pickled').save_pretrained(" in text and "\n" not in text


def test_gguf_repo_needs_a_file_name(hub, tokenizer):
    # The blob is the packaged SmolLM2 GGUF itself (a symlink: it is large).
    folder = hub / "models--org--smol-GGUF"
    commit = "0" * 40
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "b").symlink_to(smollm2_gguf_path())
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / "smol-q8.gguf").symlink_to("../../blobs/b")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    path = resolve_model_path("org/smol-GGUF/smol-q8.gguf")
    assert path.samefile(smollm2_gguf_path())
    tok = load_tokenizer("org/smol-GGUF/smol-q8.gguf")
    assert tok("A fine film.").input_ids == tokenizer("A fine film.").input_ids
    with pytest.raises(ModelLoadError, match=r"GGUF files \(smol-q8.gguf\).*org/smol-GGUF/smol"):
        resolve_model_path("org/smol-GGUF")


def test_existing_local_path_wins(hub, models, tmp_path, monkeypatch):
    cache_repo(hub, "org/tiny", dir_files(models[0]))
    cache_repo(hub, "org/prefs", {"train.jsonl": jsonl(ROWS)}, repo_type="dataset")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models[1], "org/tiny")
    Path("org/prefs").mkdir()
    Path("org/prefs/local.jsonl").write_bytes(jsonl(ROWS[:3]))
    assert resolve_model_path("org/tiny") == Path("org/tiny")
    assert_same_weights(
        AutoRewardModel.from_pretrained("org/tiny"), AutoRewardModel.from_pretrained(models[1])
    )
    source = load_source("org/prefs")
    assert len(source) == 3 and "local.jsonl" in source.where(0)


def test_hub_dataset_splits_and_revisions(hub):
    files = {"data/train.jsonl": jsonl(ROWS[:7]), "data/test.jsonl": jsonl(ROWS[7:])}
    cache_repo(hub, "org/prefs", files, repo_type="dataset")
    cache_repo(hub, "org/prefs", {"train.jsonl": jsonl(ROWS[:2])}, repo_type="dataset", refs=["v1"])
    train = load_source("org/prefs")
    assert (
        len(train) == 7 and train[0] == ROWS[0] and train.where(3) == "hub dataset org/prefs row 3"
    )
    assert len(load_source("org/prefs", default_split="test")) == 3
    assert len(load_eval_sources({"held": "org/prefs"})["held"]) == 3
    assert [r["chosen"] for r in load_source("org/prefs:test[:2]")] == [
        r["chosen"] for r in ROWS[7:9]
    ]
    assert len(load_source("org/prefs@v1")) == 2
    # v1 has one split only: eval data reads it.
    assert len(load_source("org/prefs@v1", default_split="test")) == 2
    with pytest.raises(DataError, match="org/prefs has no split 'dev'; its splits: train, test"):
        load_source("org/prefs:dev")


def test_hub_dataset_without_the_default_split_lists_its_splits(hub, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for split, rows in (("train_prefs", ROWS[:6]), ("test_prefs", ROWS[6:])):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")
        files[f"data/{split}-00000-of-00001.parquet"] = tmp_path / f"{split}.parquet"
    cache_repo(hub, "org/uf", files, repo_type="dataset")
    with pytest.raises(DataError, match=r"no 'test' split; name one of .*test_prefs.*org/uf:"):
        load_source("org/uf", default_split="test")
    assert len(load_source("org/uf:test_prefs")) == 4


def test_cli_eval_on_hub_model_and_dataset_offline(models, tmp_path):
    """`rewardax eval --model org/name --data org/dataset` with only HF_HOME and HF_HUB_OFFLINE."""
    home = tmp_path / "hf"
    cache_repo(home / "hub", "org/tiny", dir_files(models[0]))
    files = {"data/train.jsonl": jsonl(ROWS[:7]), "data/test.jsonl": jsonl(ROWS[7:])}
    cache_repo(home / "hub", "org/prefs", files, repo_type="dataset")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE")
    }
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [str(RX), "eval", "--model", "org/tiny", "--data", "org/prefs"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["metrics"]["num_pairs"] == 3  # the test split
    assert Path(summary["model"]).parent.parent.name == "models--org--tiny"

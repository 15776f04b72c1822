"""Hugging Face export round trips and the errors promised for bad checkpoints."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from model_fixtures import (
    EOS,
    pad_rows,
    random_rows,
    save_tiny_torch_model,
    scrambled_model,
    torch_rewards,
)
from rewardax.errors import ModelLoadError, RewardaxError
from rewardax.models import AutoRewardModel, load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _ours(model, rows, side="right"):
    ids, mask = pad_rows(rows, side)
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits)


def _hf_load(directory):
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(directory), output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
def test_export_round_trip(arch, tmp_path):
    # SmolLM2-style tied embeddings on one of them: the classifier has no lm_head to tie.
    model = scrambled_model(arch, config_overrides={"tie_word_embeddings": arch == "llama3"})
    rows = random_rows(11, [7, 3, 10])
    ours = _ours(model, rows, "left")
    out = model.save_pretrained(tmp_path / "rm", extra_config={"reward_mean": 0.25})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [model.config.hf_sequence_classification_class]
    assert config["num_labels"] == 1 and config["pad_token_id"] == EOS
    assert config["reward_mean"] == 0.25
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["rm"]  # no temp dirs left behind

    hf = _hf_load(out)
    np.testing.assert_allclose(torch_rewards(hf, rows), ours, atol=1e-4, rtol=0)
    # transformers' own pooling (last non-pad token) agrees on right-padded rows whose last
    # real token is not the pad id.
    again = AutoRewardModel.from_pretrained(out)
    np.testing.assert_allclose(_ours(again, rows, "right"), ours, atol=1e-5, rtol=0)
    assert again.config == model.config


def test_sharded_bf16_export_with_tokenizer(tmp_path):
    from rewardax.models.hf import save_pretrained

    model = scrambled_model("llama", dtype="bfloat16", param_dtype="bfloat16")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tiny_tokenizer(), eos_token="</s>", pad_token="</s>"
    )
    out = save_pretrained(model, tmp_path / "rm", tokenizer=tok, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert (out / "tokenizer.json").is_file()
    assert load_tokenizer(out).pad_token == "</s>"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    rows = random_rows(12, [6, 9])
    hf = _hf_load(out)
    again = AutoRewardModel.from_pretrained(out, dtype="bfloat16")
    assert again.score.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(_ours(again, rows), _ours(model, rows))
    # transformers upcast the bf16 weights to f32; our bf16 compute stays within bf16 noise.
    ref = torch_rewards(hf, rows)
    assert np.abs(ref - _ours(model, rows)).max() < 0.1 * np.sqrt(np.mean(ref**2))

    with pytest.raises(ModelLoadError, match="not empty"):
        model.save_pretrained(out)
    model.save_pretrained(out, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 97)}}
    return Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))


def test_causal_lm_gets_a_new_head(tmp_path):
    torch_model, _ = save_tiny_torch_model("qwen2", tmp_path / "lm", causal=True)
    ours = AutoRewardModel.from_pretrained(tmp_path / "lm", num_labels=2, seed=3)
    row = random_rows(13, [8])[0]
    with torch.no_grad():
        expected = torch_model.model(input_ids=torch.tensor([row])).last_hidden_state[0].numpy()
    out = ours(jnp.asarray([row]), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(out.hidden_states[0]), expected, atol=1e-4)
    assert out.logits.shape == (1, 2)
    std = float(np.std(np.asarray(ours.score.kernel[...])))
    assert 0.3 / np.sqrt(65) < std < 3 / np.sqrt(65)


@pytest.fixture(scope="module")
def seq_cls_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("seqcls")
    save_tiny_torch_model("llama", directory)
    return directory


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_inputs_give_clear_errors(seq_cls_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    def fails(path, pattern, **kw):
        with pytest.raises(RewardaxError, match=pattern):
            AutoRewardModel.from_pretrained(path, **kw)

    fails(seq_cls_dir, r"score head has 1 label\(s\) but num_labels=3", num_labels=3)
    # A hub name that is not cached, offline (tests/test_hub.py covers the hub cache itself).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fails("HuggingFaceTB/SmolLM2-135M", "not a local path.*not in the Hugging Face cache")
    fails(tmp_path / "nowhere", "does not exist")

    bad = _copy(seq_cls_dir, tmp_path / "arch")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    fails(bad, "gpt2.*supported architectures: llama, mistral, qwen2, qwen3")

    shape = _copy(seq_cls_dir, tmp_path / "shape")
    (shape / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    fails(shape, r"model.layers.0.mlp.gate_proj.weight has shape \(96, 64\).*\(80, 64\)")

    corrupt = _copy(seq_cls_dir, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    fails(corrupt, "cannot read safetensors")

    (tmp_path / "noconf").mkdir()
    fails(tmp_path / "noconf", "no config.json")

    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    (pickle_dir / "config.json").write_text(json.dumps(cfg))
    (pickle_dir / "pytorch_model.bin").write_bytes(b"not really")
    fails(pickle_dir, "does not unpickle.*save_pretrained")
    fails(pickle_dir / "pytorch_model.bin", "does not unpickle.*save_pretrained")

    from safetensors.numpy import load_file, save_file

    partial = _copy(seq_cls_dir, tmp_path / "partial")
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    fails(partial, "missing tensors: model.layers.1.mlp.up_proj.weight")


def test_load_tokenizer_sets_missing_pad_to_eos(tmp_path):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer(), eos_token="</s>")
    assert tok.pad_token is None
    tok.save_pretrained(str(tmp_path / "tok"))
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.is_fast and loaded.pad_token == "</s>" and loaded.pad_token_id == EOS
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_export_pads_with_a_token_other_than_eos_so_transformers_reads_the_right_token(tmp_path):
    """TRL's and transformers' pooling read the last token that is not the pad id: with pad == EOS
    (SmolLM2, Llama 3) a response ending in EOS would be read one token early. The export pads
    with unk instead, and transformers' own forward then agrees with ours."""
    model = scrambled_model("llama")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tiny_tokenizer(), eos_token="</s>", pad_token="</s>", unk_token="<unk>"
    )
    out = model.save_pretrained(tmp_path / "rm", tokenizer=tok)
    assert tok.pad_token == "</s>"  # the caller's tokenizer is untouched
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0
    exported_tok = load_tokenizer(out)
    assert exported_tok.pad_token == "<unk>" and exported_tok.eos_token == "</s>"

    rows = random_rows(14, [9, 4, 6])  # every row ends with EOS
    ids, _ = pad_rows(rows, "right", pad_id=exported_tok.pad_token_id)
    hf = _hf_load(out)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, _ours(model, rows), atol=1e-4, rtol=0)
    # With pad == EOS, transformers reads one token early: the trap this export avoids.
    eos_ids, _ = pad_rows(rows, "right", pad_id=EOS)
    hf.config.pad_token_id = EOS
    with torch.no_grad():
        trapped = hf(input_ids=torch.tensor(eos_ids)).logits.numpy()
    assert np.abs(trapped - _ours(model, rows)).max() > 1e-2


def _recording_assembly(monkeypatch):
    """Every call of models.loading.assemble_model made by AutoRewardModel: (options, source)."""
    from rewardax.models import auto

    calls = []
    real = auto.assemble_model

    def record(config, read_tensor, available, options, *, source):
        calls.append((options, source))
        return real(config, read_tensor, available, options, source=source)

    monkeypatch.setattr(auto, "assemble_model", record)
    return calls


def test_keywords_and_options_build_the_same_model_through_one_assembly(seq_cls_dir, monkeypatch):
    from rewardax.models import ModelOptions

    calls = _recording_assembly(monkeypatch)
    keywords = {
        "dtype": "bfloat16",
        "param_dtype": "float32",
        "matmul_dtype": "bfloat16",
        "remat_policy": "full",
        "dropout_rate": 0.1,
        "kernels": "xla",
        "seed": 5,
    }
    by_keywords = AutoRewardModel.from_pretrained(seq_cls_dir, **keywords)
    options = ModelOptions(**keywords)
    by_options = AutoRewardModel.load(seq_cls_dir / "config.json", options)
    assert calls == [(options, str(seq_cls_dir))] * 2
    # Each option reached the model.
    assert by_options.dtype == jnp.bfloat16 and by_options.param_dtype == jnp.float32
    assert by_options.matmul_dtype == jnp.bfloat16 and by_options.kernels == "xla"
    assert by_options.model.remat_policy == "full" and by_options.model.dropout_rate == 0.1
    rows = random_rows(4, [5, 7])
    np.testing.assert_array_equal(_ours(by_keywords, rows), _ours(by_options, rows))


def test_options_from_a_run_config_carry_every_model_setting():
    import dataclasses

    from rewardax.config import ModelSection
    from rewardax.models import ModelOptions

    # One field each, besides where the model comes from (path) and the run's seed. LoRA's
    # settings are not how a model is built: the trainer adds adapters to the loaded model
    # (`models.lora.add_adapters`), and `rewardax export` does the same to the checkpoint's.
    lora = {"lora_rank", "lora_alpha", "lora_targets"}
    # model.objectives is ModelOptions' label_names (and its head width).
    section_fields = set(ModelSection.model_fields) - {"path", "objectives"} - lora
    options_fields = {f.name for f in dataclasses.fields(ModelOptions)}
    assert options_fields == section_fields | {"seed", "label_names"}
    section = ModelSection(
        dtype="bfloat16",
        param_dtype="bfloat16",
        matmul_dtype="bfloat16",
        remat_policy="full",
        dropout_rate=0.2,
        num_labels=3,
        kernels="cpu",
    )
    options = ModelOptions.from_section(section, seed=7)
    assert {n: getattr(options, n) for n in section_fields} == {
        n: getattr(section, n) for n in section_fields
    }
    assert options.seed == 7
    scoring = options.for_inference()
    assert (scoring.dropout_rate, scoring.remat_policy) == (0.0, "none")
    assert scoring.replace(dropout_rate=0.2, remat_policy="full") == options
    assert options.label_names is None
    named = ModelOptions.from_section(ModelSection(objectives=["helpful", "safe"]))
    assert (named.num_labels, named.label_names) == (2, ("helpful", "safe"))

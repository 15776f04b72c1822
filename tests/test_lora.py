"""LoRA (`rewardax.models.lora`): adapters start as the base model, only they and the score head
train, and the merged export is a plain model that transformers loads with the same rewards and
the trained head."""

from __future__ import annotations

import json
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax.errors import ConfigError
from rewardax.export import export_checkpoint
from rewardax.models import lora

TRAIN = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"


def small_model() -> rx.RewardModel:
    config = rx.ModelConfig(
        architecture="qwen2",  # q/k/v biases too
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        attention_bias=True,
    )
    return rx.RewardModel(config, rngs=nnx.Rngs(0))


def inputs():
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (3, 10)), jnp.int32)
    return ids, jnp.ones_like(ids)


def test_adapters_start_as_the_base_and_merge_into_the_kernels():
    model = small_model()
    ids, mask = inputs()
    base = np.asarray(model(ids, mask).logits)
    lora.add_adapters(model, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])
    np.testing.assert_array_equal(np.asarray(model(ids, mask).logits), base)  # B = 0

    _, params, rest = lora.split(model)
    names = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert len(names) == 3 * 2 + 1 and all("lora_" in n or "score" in n for n in names)
    assert not any(
        "lora_" in jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(rest)[0]
    )

    for _, proj in lora._projections(model, lora.LORA_TARGETS):
        if getattr(proj, "lora_b", None) is not None:
            b = proj.lora_b[...]
            proj.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(1), b.shape))
    with jax.default_matmul_precision("highest"):
        adapted = np.asarray(model(ids, mask).logits)
        merged = lora.merged(model)
        assert not lora.has_adapters(merged) and lora.has_adapters(model)
        np.testing.assert_allclose(np.asarray(merged(ids, mask).logits), adapted, atol=1e-5)
    assert np.abs(adapted - base).max() > 1e-3  # the adapters change the rewards

    with pytest.raises(ConfigError, match="targets among"):
        lora.add_adapters(small_model(), rank=4, alpha=8.0, targets=["lm_head"])
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        lora.add_adapters(model, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.mark.slow
def test_lora_trains_only_adapters_and_head_and_exports_a_plain_model(tokenizer, tmp_path):
    with open(TRAIN, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(32), f, strict=False)]
    model = tiny_llama(tokenizer)
    start = {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    }
    trainer = rx.RewardTrainer(
        rx.RewardConfig(
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            max_sequence_length=48,
            max_training_steps=5,
            save_steps=5,
            save_directory=str(tmp_path),
            run_name="lora",
            progress_bar=False,
            lora_rank=4,
            lora_alpha=8.0,
        ),
        tokenizer,
        model=model,
        train_dataset=rows,
    )
    trainable = jax.tree.leaves(trainer.state.params)
    n_trainable = sum(x.size for x in trainable)
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_trainable  # Adam's state: adapters + head only
    assert n_trainable < 0.2 * sum(v.size for v in start.values())
    trainer.train()

    # The frozen base did not move; the head did, and the adapters' B left zero.
    rest = {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(trainer.state.rest)[0]
    }
    for key, value in start.items():
        if "score" not in key:
            np.testing.assert_array_equal(rest[key], value, err_msg=key)
    trained = trainer.state.model
    head = np.asarray(trained.score.kernel[...])
    assert np.abs(head - start["['score']['kernel'].value"]).max() > 1e-4
    b = np.asarray(trained.model.layers.self_attn.q_proj.lora_b[...])
    assert np.abs(b).max() > 0

    # The export: a plain model, the trained head, transformers' rewards = the LoRA model's.
    export = tmp_path / "lora" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(export).eval()
    np.testing.assert_array_equal(hf.score.weight.detach().numpy(), head.T)
    ids = np.asarray([tokenizer("A bold and strange little movie.").input_ids], np.int32)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(trained(jnp.asarray(ids)).logits)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)

    # `rewardax export` of the checkpoint merges the same way.
    again = tmp_path / "again"
    export_checkpoint(tmp_path / "lora" / "checkpoints" / "5", again)
    reloaded = rx.AutoRewardModel.from_pretrained(again)
    np.testing.assert_allclose(np.asarray(reloaded(jnp.asarray(ids)).logits), ours, atol=1e-5)

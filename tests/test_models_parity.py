"""Parity with transformers (torch CPU, float32) for every architecture, padding side, pad==EOS."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import jax.numpy as jnp

from model_fixtures import (
    EOS,
    pad_rows,
    random_rows,
    save_tiny_torch_model,
    torch_rewards,
)
from rewardax.models import AutoRewardModel

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
# Mistral's window is 4, so rows of 9-11 tokens exercise it.
LENGTHS = [9, 5, 11, 3]


@pytest.fixture(scope="module", params=ARCHS)
def torch_and_ours(request, tmp_path_factory):
    arch = request.param
    directory = tmp_path_factory.mktemp(f"hf_{arch}")
    torch_model, _ = save_tiny_torch_model(arch, directory)
    return arch, torch_model, AutoRewardModel.from_pretrained(directory)


@pytest.mark.parametrize("side", ["right", "left"])
def test_rewards_match_transformers(torch_and_ours, side):
    arch, torch_model, ours = torch_and_ours
    rows = random_rows(1, LENGTHS)
    expected = torch_rewards(torch_model, rows)
    ids, mask = pad_rows(rows, side, pad_id=EOS)  # pad == EOS: pooling must use the mask
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert got.dtype == np.float32 and got.shape == (len(rows), 1)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=f"{arch} {side}")


def test_per_token_scores_match_transformers(torch_and_ours):
    """Every position of an unpadded row (reward_positions [N, K]) matches HF's per-token score."""
    import torch

    arch, torch_model, ours = torch_and_ours
    row = random_rows(2, [12])[0]
    with torch.no_grad():
        hidden = torch_model.model(input_ids=torch.tensor([row])).last_hidden_state
        expected = torch_model.score(hidden)[0].numpy()  # [T, 1]
    ids = jnp.asarray([row])
    out = ours(ids, reward_positions=jnp.arange(len(row))[None])
    assert out.logits.shape == (1, len(row), 1)
    np.testing.assert_allclose(np.asarray(out.logits[0]), expected, atol=1e-4, rtol=0, err_msg=arch)


def test_mistral_window_changes_the_result(tmp_path):
    """Guard that the sliding-window test can fail: without the window the rewards differ."""
    torch_model, _ = save_tiny_torch_model("mistral", tmp_path / "m")
    ours = AutoRewardModel.from_pretrained(tmp_path / "m")
    windowless = AutoRewardModel.from_pretrained(tmp_path / "m")
    windowless.config = ours.config.replace(sliding_window=None)
    rows = random_rows(1, [11])
    ids = jnp.asarray(rows)
    a = np.asarray(ours(ids).logits)
    b = np.asarray(windowless(ids).logits)
    np.testing.assert_allclose(a, torch_rewards(torch_model, rows), atol=1e-4)
    assert np.abs(a - b).max() > 1e-3

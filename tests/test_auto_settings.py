"""`model.dtype: auto` and `model.remat_policy: auto`, the fast settings of each backend: what they
become on the CPU, and how a TPU's remat policy is chosen from the compiled step's memory (the
compiler faked here; tests/test_plan.py compiles for a real v5e description with libtpu)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import jax
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import plan
from rewardax.models.kernels import compute_dtype, remat_candidates, select_kernels

TRAIN = str(resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl")
GIB = 2**30
ON_CPU = jax.default_backend() == "cpu"
cpu_only = pytest.mark.skipif(
    not ON_CPU, reason="what `auto` becomes on the CPU backend (elsewhere it compiles candidates)"
)


def rows(n):
    with open(TRAIN, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def test_compute_dtype_is_float32_on_the_cpu_and_bfloat16_on_accelerators():
    assert compute_dtype("auto", "cpu") == "float32"
    assert compute_dtype("auto", "tpu") == "bfloat16"
    assert compute_dtype("auto", "gpu") == "bfloat16"
    assert compute_dtype("float32", "tpu") == "float32"  # an explicit choice stays
    assert compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_remat_candidates_are_fastest_first_and_save_attention_only_with_splash():
    assert remat_candidates(select_kernels("pallas", "tpu")) == ("none", "save_attention", "full")
    assert remat_candidates(select_kernels("xla", "gpu")) == ("none", "full")
    assert remat_candidates(select_kernels("cpu", "cpu")) == ("none", "full")


@dataclass
class FakeChip:
    platform: str = "tpu"
    device_kind: str = "TPU v5 lite"  # 15.75 GiB (plan.TPU_HBM_GIB)


def fake_compiler(monkeypatch, gib_by_policy: dict[str, float]) -> list[str]:
    """plan's layout and compile replaced: each policy 'needs' the given GiB. Returns the list
    of policies compiled, in order."""
    compiled: list[str] = []

    def lay_out(config, arch, devices):
        return config.model.remat_policy

    def compile_(policy, settings):
        compiled.append(policy)
        gib = gib_by_policy[policy]
        return plan.Compiled((), plan.Memory(int(gib * GIB), 0, 0, 0, 0), 0.0)

    monkeypatch.setattr(plan, "_lay_out", lay_out)
    monkeypatch.setattr(plan, "_compile", compile_)
    return compiled


def test_auto_takes_the_fastest_remat_policy_that_fits_the_chip(monkeypatch):
    compiled = fake_compiler(monkeypatch, {"none": 17.6, "save_attention": 15.44, "full": 9.0})
    config = rx.RewardConfig(per_device_train_batch_size=4)
    resolved, chosen, tried = plan.resolve_auto(config, object(), [FakeChip()])
    assert chosen == {"model.dtype": "bfloat16", "model.remat_policy": "save_attention"}
    assert (resolved.model.dtype, resolved.model.remat_policy) == ("bfloat16", "save_attention")
    assert compiled == ["none", "save_attention"]  # full is not compiled: one fits before it
    assert tried == ("none: 17.60 GiB", "save_attention: 15.44 GiB")
    assert config.model.dtype == config.model.remat_policy == "auto"  # the input is unchanged


def test_auto_leaves_headroom_and_falls_back_to_full(monkeypatch):
    # 15.70 GiB is under the chip's 15.75 but not under its 128 MiB headroom.
    compiled = fake_compiler(monkeypatch, {"none": 30.0, "save_attention": 15.70, "full": 16.5})
    _, chosen, _ = plan.resolve_auto(rx.RewardConfig(), object(), [FakeChip()])
    assert chosen["model.remat_policy"] == "full"  # none fits: full, and the run says so
    assert compiled == ["none", "save_attention", "full"]
    # Explicit settings are not touched, and nothing is compiled for them.
    compiled.clear()
    explicit = rx.RewardConfig(dtype="float32", remat_policy="save_dots")
    same, chosen, tried = plan.resolve_auto(explicit, object(), [FakeChip()])
    assert (same.model.dtype, same.model.remat_policy) == ("float32", "save_dots")
    assert chosen == {} and tried == () and compiled == []


@cpu_only
def test_on_the_cpu_auto_is_float32_without_remat_and_keeps_the_run_name(tmp_path, monkeypatch):
    def no_compile(*args):
        raise AssertionError("nothing is compiled to decide the CPU's settings")

    monkeypatch.setattr(plan, "_compile", no_compile)
    tokenizer = smollm2_tokenizer()
    model_dir = tmp_path / "model"
    tiny_llama(tokenizer).save_pretrained(str(model_dir), tokenizer=tokenizer)
    common = dict(
        path=str(model_dir),
        per_device_train_batch_size=4,
        max_sequence_length=64,
        max_training_steps=2,
        save_directory=str(tmp_path / "runs"),
        progress_bar=False,
    )
    auto = rx.RewardTrainer(rx.RewardConfig(**common), tokenizer, train_dataset=rows(8))
    assert (auto.config.model.dtype, auto.config.model.remat_policy) == ("float32", "none")
    assert auto.state.model.dtype.name == "float32"
    assert auto.state.model.model.remat_policy == "none"
    # The run's name hashes the decided settings: the same as the explicit ones before `auto`.
    explicit = rx.RewardTrainer(
        rx.RewardConfig(**common, dtype="float32", remat_policy="none"),
        tokenizer,
        train_dataset=rows(8),
    )
    assert auto.run_dir == explicit.run_dir


def test_a_passed_model_keeps_its_own_settings_under_auto(tmp_path):
    tokenizer = smollm2_tokenizer()
    arch = tiny_llama(tokenizer).config
    from flax import nnx

    model = rx.RewardModel(arch, dtype="bfloat16", remat_policy="full", rngs=nnx.Rngs(0))
    trainer = rx.RewardTrainer(
        rx.RewardConfig(
            per_device_train_batch_size=4,
            max_sequence_length=64,
            max_training_steps=2,
            save_directory=str(tmp_path),
            progress_bar=False,
        ),
        tokenizer,
        model=model,
        train_dataset=rows(8),
    )
    assert (trainer.config.model.dtype, trainer.config.model.remat_policy) == ("bfloat16", "full")
    # RewardModel(dtype="auto") is the backend's compute dtype.
    assert rx.RewardModel(arch, dtype="auto", rngs=nnx.Rngs(0)).dtype.name == compute_dtype(
        "auto", jax.default_backend()
    )


@cpu_only
def test_offload_params_with_auto_dtype_on_the_cpu_says_what_to_set(tmp_path):
    tokenizer = smollm2_tokenizer()
    model_dir = tmp_path / "model"
    tiny_llama(tokenizer).save_pretrained(str(model_dir), tokenizer=tokenizer)
    config = rx.RewardConfig(
        path=str(model_dir), offload_state=True, offload_params=True, save_directory=str(tmp_path)
    )
    with pytest.raises(
        rx.ConfigError, match=r"got model\.dtype=float32.*set model\.dtype=bfloat16"
    ):
        rx.RewardTrainer(config, tokenizer, train_dataset=rows(8))

"""`model.dtype: auto` and `model.remat_policy: auto`, the fast settings of each backend: what they
become on the CPU, and how a TPU's remat policy is chosen from the compiled step's memory (the
compiler faked here; tests/test_plan.py compiles for a real v5e description with libtpu)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import plan
from rewardax.models.kernels import (
    compute_dtype,
    halvings_past_fit,
    remat_candidates,
    select_kernels,
)
from test_trainer import TRAIN
from test_trainer import rows as read_rows

GIB = 2**30
ON_CPU = jax.default_backend() == "cpu"
cpu_only = pytest.mark.skipif(
    not ON_CPU, reason="what `auto` becomes on the CPU backend (elsewhere it compiles candidates)"
)


def test_compute_dtype_is_float32_on_the_cpu_and_bfloat16_on_accelerators():
    assert compute_dtype("auto", "cpu") == "float32"
    assert compute_dtype("auto", "tpu") == "bfloat16"
    assert compute_dtype("auto", "gpu") == "bfloat16"
    assert compute_dtype("float32", "tpu") == "float32"  # an explicit choice stays
    assert compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_remat_candidates_are_fastest_first_and_save_attention_only_with_splash():
    splash = select_kernels("pallas", "tpu")
    assert remat_candidates(splash) == ("save_attention_mlp", "save_attention", "full")
    assert remat_candidates(select_kernels("xla", "gpu")) == ("none", "full")
    assert remat_candidates(select_kernels("cpu", "cpu")) == ("none", "full")
    # One more halving of the microbatch after the first fit: only where the v5e measured it.
    assert [halvings_past_fit(splash, p) for p in remat_candidates(splash)] == [1, 0, 0]
    assert halvings_past_fit(select_kernels("xla", "gpu"), "none") == 0


@dataclass
class FakeChip:
    platform: str = "tpu"
    device_kind: str = "TPU v5 lite"  # 15.75 GiB (plan.TPU_HBM_GIB)


def fake_compiler(monkeypatch, gib: dict) -> list:
    """plan's layout and compile replaced: a candidate 'needs' gib[(policy, pairs per
    microbatch)], else gib[policy]. Returns the list of (policy, pairs, microbatches) compiled."""
    compiled: list = []

    def lay_out(config, arch, devices):
        train = config.train
        return (
            config.model.remat_policy,
            train.per_device_train_batch_size,
            (train.gradient_accumulation_steps),
        )

    def compile_(job, settings):
        compiled.append(job)
        need = gib.get(job[:2], gib.get(job[0]))
        return plan.Compiled((), plan.Memory(int(need * GIB), 0, 0, 0, 0), 0.0)

    monkeypatch.setattr(plan, "_lay_out", lay_out)
    monkeypatch.setattr(plan, "_compile", compile_)
    return compiled


def test_auto_takes_the_fastest_remat_policy_that_fits_the_chip(monkeypatch):
    compiled = fake_compiler(
        monkeypatch,
        {"save_attention_mlp": 17.6, "save_attention": 15.44, "full": 9.0},
    )
    # 2 pairs of 512 tokens: too few tokens to split into microbatches.
    config = rx.RewardConfig(per_device_train_batch_size=2, max_sequence_length=512)
    resolved, chosen, tried = plan.resolve_auto(config, object(), [FakeChip()])
    assert chosen == {"model.dtype": "bfloat16", "model.remat_policy": "save_attention"}
    assert (resolved.model.dtype, resolved.model.remat_policy) == ("bfloat16", "save_attention")
    assert compiled == [("save_attention_mlp", 2, 1), ("save_attention", 2, 1)]  # not full
    assert tried == ("save_attention_mlp: 17.60 GiB", "save_attention: 15.44 GiB")
    assert config.model.dtype == config.model.remat_policy == "auto"  # the input is unchanged


def test_auto_prefers_less_remat_on_smaller_microbatches(monkeypatch):
    # Qwen2.5-0.5B, 8 pairs of 2048 tokens, as compiled for a v5e (`rewardax plan`, sums by
    # reference): save_attention_mlp fits on one pair a microbatch (54.0% MFU on the chip).
    compiled = fake_compiler(
        monkeypatch,
        {
            "save_attention_mlp": 40.0,
            ("save_attention_mlp", 4): 25.0,
            ("save_attention_mlp", 2): 17.12,
            ("save_attention_mlp", 1): 13.56,
            "save_attention": 23.5,
            "full": 13.7,
        },
    )
    config = rx.RewardConfig(per_device_train_batch_size=8, max_sequence_length=2048)
    resolved, chosen, tried = plan.resolve_auto(config, object(), [FakeChip()])
    # Halvings down to one pair; nothing else is compiled.
    assert compiled == [
        ("save_attention_mlp", 8, 1),
        ("save_attention_mlp", 4, 2),
        ("save_attention_mlp", 2, 4),
        ("save_attention_mlp", 1, 8),
    ]
    assert chosen["model.remat_policy"] == "save_attention_mlp"
    assert chosen["train.gradient_accumulation_steps"] == "8"
    assert (
        resolved.train.per_device_train_batch_size,
        resolved.train.gradient_accumulation_steps,
    ) == (1, 8)
    assert resolved.global_train_batch_size(1) == config.global_train_batch_size(1) == 8
    assert tried[-1] == "save_attention_mlp (1 pairs x 8): 13.56 GiB"
    # No microbatch below MIN_MICROBATCH_TOKENS: 8 pairs of 128 tokens are 2048 in all.
    compiled.clear()
    short = rx.RewardConfig(per_device_train_batch_size=8, max_sequence_length=128)
    plan.resolve_auto(short, object(), [FakeChip()])
    assert compiled == [(p, 8, 1) for p in ("save_attention_mlp", "save_attention", "full")]
    # A layout that cannot accumulate (shared_prompt) keeps the whole batch.
    compiled.clear()
    shared = rx.RewardConfig(
        per_device_train_batch_size=8, max_sequence_length=2048, layout="shared_prompt"
    )
    _, chosen, _ = plan.resolve_auto(shared, object(), [FakeChip()])
    assert chosen["model.remat_policy"] == "full"
    assert "train.gradient_accumulation_steps" not in chosen
    assert all(acc == 1 for _, _, acc in compiled)
    # An accumulation of the user's own is kept as it is (and not split further).
    compiled.clear()
    own = rx.RewardConfig(
        per_device_train_batch_size=8, max_sequence_length=2048, gradient_accumulation_steps=2
    )
    plan.resolve_auto(own, object(), [FakeChip()])
    assert compiled == [(p, 8, 2) for p in ("save_attention_mlp", "save_attention", "full")]


def test_auto_halves_the_first_microbatch_that_fits_once_more(monkeypatch):
    # Qwen2.5-0.5B, 16 pairs of 512 tokens, compiled for a v5e: save_attention_mlp first fits
    # on 4 pairs x 4 (49.8% MFU on the chip); 2 pairs x 8 ran at 51.0%.
    mlp = {("save_attention_mlp", 8): 17.11, ("save_attention_mlp", 4): 13.50}
    gib = {"save_attention_mlp": 30.0, **mlp, ("save_attention_mlp", 2): 11.42}
    compiled = fake_compiler(monkeypatch, gib | {"save_attention": 20.0})
    config = rx.RewardConfig(per_device_train_batch_size=16, max_sequence_length=512)
    resolved, chosen, tried = plan.resolve_auto(config, object(), [FakeChip()])
    assert compiled == [("save_attention_mlp", 16 // a, a) for a in (1, 2, 4, 8)]
    assert (chosen["model.remat_policy"], chosen["train.gradient_accumulation_steps"]) == (
        "save_attention_mlp",
        "8",
    )
    assert resolved.train.per_device_train_batch_size == 2
    assert tried[-2:] == (
        "save_attention_mlp (4 pairs x 4): 13.50 GiB",
        "save_attention_mlp (2 pairs x 8): 11.42 GiB",
    )
    # A halving that does not fit (a compiler's whim) leaves the first fit.
    compiled = fake_compiler(monkeypatch, gib | {("save_attention_mlp", 2): 15.9})
    _, chosen, _ = plan.resolve_auto(config, object(), [FakeChip()])
    assert chosen["train.gradient_accumulation_steps"] == "4"
    assert len(compiled) == 4
    # save_attention keeps its first fit: 2 pairs x 4 of 2048 ran faster than 1 x 8 there.
    compiled = fake_compiler(
        monkeypatch,
        {
            "save_attention_mlp": 40.0,
            "save_attention": 23.5,
            ("save_attention", 4): 18.9,
            ("save_attention", 2): 13.27,
            ("save_attention", 1): 10.89,
            "full": 13.7,
        },
    )
    long = rx.RewardConfig(per_device_train_batch_size=8, max_sequence_length=2048)
    _, chosen, _ = plan.resolve_auto(long, object(), [FakeChip()])
    assert (chosen["model.remat_policy"], chosen["train.gradient_accumulation_steps"]) == (
        "save_attention",
        "4",
    )
    assert ("save_attention", 1, 8) not in compiled
    # No halving past the first fit on the whole batch when the halves would be too short.
    compiled = fake_compiler(monkeypatch, {"save_attention_mlp": 9.0})
    short = rx.RewardConfig(per_device_train_batch_size=2, max_sequence_length=512)
    _, chosen, _ = plan.resolve_auto(short, object(), [FakeChip()])
    assert chosen["model.remat_policy"] == "save_attention_mlp"
    assert "train.gradient_accumulation_steps" not in chosen
    assert compiled == [("save_attention_mlp", 2, 1)]


def test_auto_leaves_headroom_and_falls_back_to_full(monkeypatch):
    # 15.70 GiB is under the chip's 15.75 but not under its 128 MiB headroom.
    compiled = fake_compiler(
        monkeypatch,
        {"save_attention_mlp": 30.0, "save_attention": 15.70, "full": 16.5, ("full", 1): 12.0},
    )
    config = rx.RewardConfig(per_device_train_batch_size=2, max_sequence_length=512)
    _, chosen, _ = plan.resolve_auto(config, object(), [FakeChip()])
    # Remat full fits on 1 pair a microbatch (it may go below MIN_MICROBATCH_TOKENS: it is the
    # last resort before not fitting).
    assert chosen["model.remat_policy"] == "full"
    assert chosen["train.per_device_train_batch_size"] == "1"
    whole = [(p, 2, 1) for p in ("save_attention_mlp", "save_attention", "full")]
    assert compiled == [*whole, ("full", 1, 2)]
    # Nothing fits: full on the whole batch, and the run says what it tried.
    compiled.clear()
    fake_compiler(
        monkeypatch,
        {"save_attention_mlp": 30.0, "save_attention": 29.0, "full": 16.5},
    )
    _, chosen, tried = plan.resolve_auto(config, object(), [FakeChip()])
    assert chosen == {"model.dtype": "bfloat16", "model.remat_policy": "full"}
    assert len(tried) == 4  # save_attention_mlp, save_attention, full on 2 and 1 pairs
    # Explicit settings are not touched, and nothing is compiled for them.
    compiled = fake_compiler(monkeypatch, {})
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
    auto = rx.RewardTrainer(rx.RewardConfig(**common), tokenizer, train_dataset=read_rows(TRAIN, 8))
    assert (auto.config.model.dtype, auto.config.model.remat_policy) == ("float32", "none")
    assert auto.state.model.dtype.name == "float32"
    assert auto.state.model.model.remat_policy == "none"
    # The run's name hashes the decided settings: the same as the explicit ones before `auto`.
    explicit = rx.RewardTrainer(
        rx.RewardConfig(**common, dtype="float32", remat_policy="none"),
        tokenizer,
        train_dataset=read_rows(TRAIN, 8),
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
        train_dataset=read_rows(TRAIN, 8),
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
        rx.RewardTrainer(config, tokenizer, train_dataset=read_rows(TRAIN, 8))

"""Worker of tests/test_sharding.py and tests/test_multiprocess.py, run in a subprocess.

The host device count must be set before JAX is imported, so each case runs in a fresh interpreter:

    python tests/scale_worker.py CASE OUT.json --devices 8 [--process-id I --num-processes N
        --coordinator HOST:PORT] [--workdir DIR]

It prints nothing useful; everything the tests assert on is written to OUT.json (process 0 only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

WORDS = ["good", "bad", "fine", "great", "awful", "movie", "film", "plot", "actor", "scene"]
WORDS += ["was", "is", "the", "a", "very", "not"]
VOCAB = 32  # model vocabulary (>= the tokenizer's 19 ids), divisible by tp and fsdp up to 8


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--coordinator")
    parser.add_argument("--workdir", default=".")
    return parser.parse_args()


ARGS = parse()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import rewardax as rx  # noqa: E402
from rewardax import data as rdata  # noqa: E402
from rewardax import distributed  # noqa: E402
from rewardax.models import transformer  # noqa: E402
from rewardax.models.kernels import Kernels, select_kernels  # noqa: E402
from rewardax.pair_scoring import PairRewards  # noqa: E402
from rewardax.sharding import bytes_per_device  # noqa: E402
from rewardax.steps import make_train_step  # noqa: E402
from rewardax.trainer import _model_inputs  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def tiny_tokenizer():
    """A word-level fast tokenizer over WORDS, built in memory (no files, no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def pairs(n: int, seed: int = 0) -> list[dict]:
    """Preference rows: `chosen` carries more positive words, so the model can learn something."""
    rng = np.random.default_rng(seed)

    def sentence(bias: str) -> str:
        words = list(rng.choice(WORDS, size=int(rng.integers(3, 12))))
        return " ".join([bias, *words])

    return [{"chosen": sentence("good"), "rejected": sentence("bad")} for _ in range(n)]


def rated_sentence(rng: np.random.Generator, quality: int) -> str:
    """`quality` (0..3) positive words among 3 rated ones, then 0..6 filler words: lengths vary, so
    processes bucket their batches to different T."""
    rated = ["great"] * quality + ["awful"] * (3 - quality)
    return " ".join([*rated, *rng.choice(WORDS[5:], size=int(rng.integers(0, 7)))])


def ranked_rows(n: int, seed: int = 0, ties: bool = False) -> list[dict]:
    """Rows ranking 4 responses by quality (lower rank = better); every third row has 3, so its
    batch pads a response (response_mask 0). With `ties`, qualities are drawn with repeats and
    equal qualities share a rank (Davidson's ties), two distinct ranks at least per row."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = 3 if i % 3 == 2 else 4
        if ties:
            quality = np.concatenate([[0, 3], rng.integers(0, 4, size=k - 2)])[rng.permutation(k)]
            ranks = np.unique(-quality, return_inverse=True)[1]  # dense: 0 = best, ties share
        else:
            quality = rng.permutation(4)[:k]
            ranks = np.argsort(np.argsort(-quality))
        responses = [rated_sentence(rng, int(q)) for q in quality]
        out.append({"prompt": "the movie", "responses": responses, "ranks": ranks.tolist()})
    return out


def score_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of one response with a score (its quality plus noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        quality = int(rng.integers(0, 4))
        score = round(quality + float(rng.normal(0.0, 0.1)), 3)
        out.append({"prompt": "the film", "response": rated_sentence(rng, quality), "score": score})
    return out


def named_score_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of one response with named scores (model.objectives=OBJECTIVES): `quality` as
    `score_rows`' score, `length` its filler words / 10; every third row leaves `length` out."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        quality = int(rng.integers(0, 4))
        response = rated_sentence(rng, quality)
        scores = {"quality": round(quality + float(rng.normal(0.0, 0.1)), 3)}
        if i % 3 != 2:
            scores["length"] = (len(response.split()) - 3) / 10
        out.append({"prompt": "the film", "response": response, "scores": scores})
    return out


OBJECTIVES = ["quality", "length"]


def tiny_model(
    hidden: int = 32, mlp: int = 64, kernels: str | Kernels = "auto", num_labels: int = 1
) -> rx.RewardModel:
    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        num_labels=num_labels,
    )
    return rx.RewardModel(config, rngs=nnx.Rngs(0), kernels=kernels)


def make_config(mesh: dict, **overrides) -> rx.RewardConfig:
    settings = dict(
        per_device_train_batch_size=1,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        max_sequence_length=16,
        max_training_steps=5,
        save_directory=str(Path(ARGS.workdir) / "runs"),
        logging_steps=1,
        progress_bar=False,
        length_group_window=1,  # one batch per window: process slices unite to the same batches
        seed=3,
        resume="off",
    )
    settings.update(overrides)
    return rx.RewardConfig(mesh=mesh, **settings)


def recording(trainer) -> list[float]:
    """Wraps the trainer's jitted step to record each step's loss."""
    fns = trainer.configure_functions()
    losses: list[float] = []

    def step(arrays, batch):
        out = fns.train_step(arrays, batch)
        losses.append(float(jax.device_get(out[1]["loss"])))
        return out

    trainer._functions = fns._replace(train_step=step)
    return losses


def leaves(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(distributed.gather_to_host(tree))[0]
    }


def layout(tree) -> dict[str, dict]:
    """Per parameter: global shape, PartitionSpec, and the shapes of the local device shards."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[jax.tree_util.keystr(path)] = {
            "shape": list(x.shape),
            "spec": [s if s is None or isinstance(s, str) else list(s) for s in x.sharding.spec],
            "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
        }
    return out


# ---- cases ---------------------------------------------------------------------------------------


def case_mesh_parity() -> dict:
    """dp=2 x fsdp=2 x tp=2 through the trainer vs the same pure step on one device."""
    return mesh_parity(tiny_model(), "mesh")


def case_splash_mesh_parity() -> dict:
    """The same with splash attention (Pallas, interpret mode here): XLA cannot partition its
    kernel, which runs per shard under shard_map (rows over dp x fsdp, heads over tp)."""
    # SGD: the updates are the gradients (Adam would turn the float noise of gradients near zero
    # into whole learning-rate steps of either sign).
    model = tiny_model(hidden=128, mlp=64, kernels="pallas")
    return mesh_parity(model, "splash", name="sgd", learning_rate=0.3)


def case_splash_tree_mesh_parity() -> dict:
    """The same on the shared-prompt layout: the splash kernel's mask is built per row from the
    branch ids, which shard_map splits with the rows."""
    model = tiny_model(hidden=128, mlp=64, kernels="pallas")
    rows = [{"prompt": "tell me about it", **row} for row in pairs(64)]
    return mesh_parity(
        model,
        "splash_tree",
        rows=rows,
        name="sgd",
        learning_rate=0.05,
        layout="shared_prompt",
        max_sequence_length=32,
    )


def case_accumulate_mesh_parity() -> dict:
    """The same with 2 microbatches a step whose float32 gradients are added into the running
    sums by each backward pass (`Kernels.accumulate_by_reference`, a TPU's choice), against the
    one-device step on the whole batch. The layers run as a loop, as by reference needs."""
    transformer.UNROLLED_MAX_LAYERS = 1
    kernels = select_kernels("cpu", "cpu")
    kernels = Kernels(**{**vars(kernels), "accumulate_by_reference": True})
    return mesh_parity(
        tiny_model(kernels=kernels),
        "accumulate",
        name="sgd",
        learning_rate=0.3,
        gradient_accumulation_steps=2,
    )


def mesh_parity(
    model: rx.RewardModel, run_name: str, rows: list[dict] | None = None, **settings
) -> dict:
    tok = tiny_tokenizer()
    rows = pairs(64) if rows is None else rows
    trainer = rx.RewardTrainer(
        make_config({"dp": 2, "fsdp": 2, "tp": 2}, run_name=run_name, **settings),
        tok,
        model=model,
        train_dataset=rows,
    )
    start = jax.device_get(trainer.state.arrays())  # host copies: the step donates its inputs
    sharded_layout = layout(trainer.state.params)
    opt_layout = layout(trainer.state.opt_state)
    losses = recording(trainer)
    trainer.train()

    # Reference: the same step function, the same batches, everything on one device.
    step = jax.jit(
        make_train_step(trainer.state.graphdef, trainer.optimizer, trainer.schedule),
        donate_argnums=(0,),
    )
    arrays = jax.device_put(start, jax.devices()[0])
    loader = rdata.PreferenceLoader(
        rows,
        tok,
        trainer.config.data,
        batch_size=trainer.step_batch_size,
        seed=trainer.config.train.seed,
    )
    reference = []
    for _, batch in zip(range(5), loader, strict=False):
        inputs = _model_inputs(batch)  # the layout's keys, as the trainer gives its step
        arrays, metrics = step(arrays, jax.device_put(inputs, jax.devices()[0]))
        reference.append(float(metrics["loss"]))
    one, many = leaves(arrays["params"]), leaves(trainer.state.params)
    return {
        "losses": losses,
        "reference_losses": reference,
        "max_param_diff": max(float(np.max(np.abs(one[k] - many[k]))) for k in one),
        "params_moved": max(
            float(np.max(np.abs(one[k] - np.asarray(v))))
            for k, v in leaves(start["params"]).items()
        ),
        "layout": sharded_layout,
        "opt_layout": opt_layout,
    }


def case_memory() -> dict:
    """Bytes per device of parameters + optimizer state: replicated (dp=8) vs fsdp=8."""
    tok = tiny_tokenizer()
    out = {}
    for name, mesh in (("replicated", {"dp": 8}), ("fsdp", {"dp": 1, "fsdp": 8})):
        trainer = rx.RewardTrainer(
            make_config(mesh, run_name=name), tok, model=tiny_model(hidden=64, mlp=128)
        )
        state = {"params": trainer.state.params, "opt_state": trainer.state.opt_state}
        per_device = bytes_per_device(state)
        out[name] = {"max": max(per_device.values()), "devices": len(per_device)}
    return out


def case_reshard() -> dict:
    """Train 3 steps under fsdp=4 and save; resume under fsdp=2 x tp=2 for 3 more steps; compare
    with 6 uninterrupted steps under fsdp=4."""
    tok = tiny_tokenizer()
    rows = pairs(64)
    fsdp4 = {"dp": 1, "fsdp": 4, "tp": 1}
    fsdp2_tp2 = {"dp": 1, "fsdp": 2, "tp": 2}
    # The global batch must stay the same: 1 pair x 4 data-parallel devices = 2 pairs x 2.
    straight = rx.RewardTrainer(
        make_config(fsdp4, run_name="straight", max_training_steps=6),
        tok,
        model=tiny_model(),
        train_dataset=rows,
    )
    straight_losses = recording(straight)
    straight.train()

    first = rx.RewardTrainer(
        make_config(fsdp4, run_name="split", max_training_steps=6, save_steps=3, resume="auto"),
        tok,
        model=tiny_model(),
        train_dataset=rows,
    )
    first_losses = recording(first)
    fns = first.configure_functions()
    calls = {"n": 0}
    inner = first._functions.train_step

    def stop_after_three(arrays, batch):
        calls["n"] += 1
        out = inner(arrays, batch)
        if calls["n"] == 3:
            first._stop_signal = 15  # as SIGTERM would: finish the step, save, return
        return out

    first._functions = fns._replace(train_step=stop_after_three)
    first.train()
    saved = leaves(first.state.params)

    second = rx.RewardTrainer(
        make_config(
            fsdp2_tp2,
            run_name="split",
            max_training_steps=6,
            save_steps=3,
            per_device_train_batch_size=2,
            resume="auto",
        ),
        tok,
        model=tiny_model(),
        train_dataset=rows,
    )
    second_losses = recording(second)
    # Restore happens inside train(); look at the restored state through a one-off resume.
    ckpt = second.checkpointer()
    restored_step = second._maybe_resume(ckpt)
    restored = leaves(second.state.params)
    restored_layout = layout(second.state.params)
    restored_opt_layout = layout(second.state.opt_state)
    second.train()
    final_straight, final_second = leaves(straight.state.params), leaves(second.state.params)
    return {
        "straight_losses": straight_losses,
        "first_losses": first_losses,
        "second_losses": second_losses,
        "restored_step": restored_step,
        "saved_steps": ckpt.steps(),
        "restore_max_diff": max(float(np.max(np.abs(saved[k] - restored[k]))) for k in saved),
        "final_max_diff": max(
            float(np.max(np.abs(final_straight[k] - final_second[k]))) for k in final_straight
        ),
        "restored_layout": restored_layout,
        "restored_opt_layout": restored_opt_layout,
    }


def distributed_settings() -> dict:
    """The `distributed` section from the command line (all None: one process)."""
    return {
        "coordinator_address": ARGS.coordinator,
        "num_processes": ARGS.num_processes,
        "process_id": ARGS.process_id,
    }


def case_train_distributed() -> dict:
    """The same job on 1 process x 4 devices or 2 processes x 2 devices (jax.distributed)."""
    config = make_config(
        {"dp": 1, "fsdp": 2, "tp": 2},
        run_name="multi",
        per_device_train_batch_size=2,
        save_steps=5,
        distributed=distributed_settings(),
    )
    info = distributed.initialize(config)  # before the model is built (that runs on devices)
    tok = tiny_tokenizer()
    trainer = rx.RewardTrainer(
        config,
        tok,
        model=tiny_model(),
        train_dataset=pairs(64),
        eval_dataset={"heldout": pairs(13, seed=1)},  # 13: uneven over processes and batches
    )
    losses = recording(trainer)
    result = trainer.train()
    params = leaves(trainer.state.params)
    rewards = trainer._last_rewards["heldout"]
    # Resume: every process gets back its own data position from the checkpoint.
    again = rx.RewardTrainer(
        config.with_overrides(["checkpoint.resume=auto"]),
        tok,
        model=tiny_model(),
        train_dataset=pairs(64),
    )
    resumed = again._maybe_resume(again.checkpointer())
    position = again.train_loader.get_state()["position"]
    positions = distributed.gather_json([position, trainer.train_loader.get_state()["position"]])
    return {
        "process_count": info.process_count,
        "device_count": info.device_count,
        "local_device_count": info.local_device_count,
        "losses": losses,
        "eval_accuracy": result.metrics["eval"]["heldout"]["accuracy"],
        "eval_num_pairs": result.metrics["eval"]["heldout"]["num_pairs"],
        "eval_chosen": rewards["chosen"].tolist(),
        "eval_rejected": rewards["rejected"].tolist(),
        "checkpoints": trainer.checkpointer().steps(),
        "params": {k: v.ravel().tolist() for k, v in params.items()},
        "export_exists": (result.run_dir / "export" / "config.json").exists(),
        "resumed_step": resumed,
        "resumed_positions": positions,  # per process: [restored, at the end of training]
    }


def group_runs() -> dict[str, tuple[list[dict], dict, list[str]]]:
    """The group runs of `case_train_distributed_groups`: per run, its training rows, its
    settings and the eval sets it is scored on (`group_eval_sets`; each set's first evaluation
    compiles, so the later runs evaluate only what is new to them)."""
    all_sets = ["ranked", "scores", "one_score"]
    return {
        "plackett_luce": (ranked_rows(40), {"loss": "plackett_luce"}, all_sets),
        "mse": (score_rows(40), {"loss": "mse"}, all_sets),
        # 2 microbatches per update: the strided split mixes the processes' rows.
        "all_pairs_bradley_terry": (
            ranked_rows(40),
            {"loss": "all_pairs_bradley_terry", "gradient_accumulation_steps": 2},
            [],
        ),
        "davidson": (
            ranked_rows(40, ties=True),
            {"loss": "davidson", "log_tie_strength": 0.5},
            ["tied"],
        ),
        "gaussian_nll": (score_rows(40), {"loss": "gaussian_nll", "num_labels": 2}, []),
        # Each objective's mean over the rows of the whole update that score it, accumulated.
        "objectives": (
            named_score_rows(40),
            {
                "loss": "mse",
                "objectives": OBJECTIVES,
                "num_labels": len(OBJECTIVES),
                "objective_weights": {"length": 0.5},
                "gradient_accumulation_steps": 2,
            },
            ["named"],
        ),
    }


def group_eval_sets() -> dict[str, list[dict]]:
    return {
        "ranked": ranked_rows(7, seed=1),  # 36 pairs: uneven over processes and batches
        "tied": ranked_rows(7, seed=1, ties=True),
        "scores": score_rows(13, seed=1),  # 7 + 6 rows: one process adds a padding batch
        "one_score": score_rows(1, seed=2),  # fewer rows than processes
        "named": named_score_rows(13, seed=1),
    }


def eval_rewards(rewards) -> dict[str, list]:
    """An eval set's rewards in source order: a ranked set's pairs (chosen, rejected), a score
    set's rows (and with named scores every head output)."""
    out = {"row_index": rewards.row_index.tolist()}
    if isinstance(rewards, PairRewards):
        out.update(chosen=rewards.chosen.tolist(), rejected=rewards.rejected.tolist())
    else:
        out["rewards"] = rewards.rewards.tolist()
        if rewards.outputs is not None:
            out["outputs"] = rewards.outputs.tolist()
    return out


def case_train_distributed_groups() -> dict:
    """Group losses on 1 process x 4 devices or 2 processes x 2 devices (`group_runs`):
    plackett_luce, all_pairs_bradley_terry and davidson on ranked rows (K = 4, every third row 3
    responses; davidson's with ties), mse and gaussian_nll on score rows, mse on named scores
    (model.objectives); two of them accumulate 2 microbatches per update."""
    mesh = {"dp": 1, "fsdp": 2, "tp": 2}
    settings = dict(per_device_train_batch_size=2, distributed=distributed_settings())
    info = distributed.initialize(make_config(mesh, **settings))
    tok = tiny_tokenizer()
    eval_sets = group_eval_sets()
    out: dict = {"process_count": info.process_count, "device_count": info.device_count}
    for name, (rows, run_settings, sets) in group_runs().items():
        trainer = rx.RewardTrainer(
            make_config(mesh, run_name=name, **settings, **run_settings),
            tok,
            model=tiny_model(num_labels=run_settings.get("num_labels", 1)),
            train_dataset=rows,
            eval_dataset={s: eval_sets[s] for s in sets} or None,
        )
        losses = recording(trainer)
        result = trainer.train()
        out[name] = {
            "losses": losses,
            "train_num_rows": result.metrics["train"]["num_rows"],
            "params": {k: v.ravel().tolist() for k, v in leaves(trainer.state.params).items()},
            "eval": result.metrics.get("eval", {}),
            "rewards": {s: eval_rewards(trainer._last_rewards[s]) for s in sets},
        }
    return out


CASES = {
    "mesh_parity": case_mesh_parity,
    "splash_mesh_parity": case_splash_mesh_parity,
    "accumulate_mesh_parity": case_accumulate_mesh_parity,
    "splash_tree_mesh_parity": case_splash_tree_mesh_parity,
    "memory": case_memory,
    "reshard": case_reshard,
    "train_distributed": case_train_distributed,
    "train_distributed_groups": case_train_distributed_groups,
}

if __name__ == "__main__":
    result = CASES[ARGS.case]()
    if jax.process_index() == 0:
        Path(ARGS.out).write_text(json.dumps(result))
    sys.stdout.flush()

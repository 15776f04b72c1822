"""A reward model loaded for serving: the same tokenization and forward pass as `rewardax score`.

`ServingModel` loads a model directory exactly as `rewardax score` does (the run's data settings
when the directory is `<run>/export`, `--max-length` / `--truncation` overrides, `dtype` and
`num_labels` from the config), encodes rows with `rewardax.scoring.ResponseEncoder`, and runs the
model through one `rewardax.scoring.RewardScorer` per bucket length: each holds one compiled program
of shape [rows_per_batch(bucket), bucket], so a batch of any composition is padded to a shape
compiled at start (`warm()`), and the first request pays no compilation. A multi-objective model
(`model.objectives`, or an export whose config.json names its outputs in id2label) is scored once
per pass for all its objectives: `score` returns the reward (the first objective, normalised when
asked) and every objective's unnormalised output, as `rewardax score` writes `reward` and
`rewards`.

`reward_function` is the in-process form for TRL's GRPO: the offline `score_rows` path itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, DataError, ModelLoadError
from rewardax.model_dirs import load_for_scoring

# Rows of one forward pass are capped so that a program of the shortest bucket does not pad a lone
# request to thousands of rows.
DEFAULT_MAX_BATCH_ROWS = 64
DEFAULT_MAX_BATCH_TOKENS = 16384
# Until `warm()` has timed the programs: a pass costs this many padded tokens' worth of time on
# top of its tokens (a guess; the measured model replaces it).
DEFAULT_PASS_OVERHEAD_TOKENS = 256


@dataclass(frozen=True)
class PassCost:
    """Seconds of one forward pass: ``fixed_s + per_token_s x rows x bucket`` (the program's
    padded shape, whatever the rows in it)."""

    fixed_s: float
    per_token_s: float

    def __call__(self, rows: int, bucket: int) -> float:
        return self.fixed_s + self.per_token_s * rows * bucket

    @classmethod
    def fit(cls, timings: Sequence[tuple[int, float]]) -> PassCost:
        """Least squares over (padded tokens, seconds) of timed passes; fixed >= 0, per token >
        0."""
        tokens = np.asarray([t for t, _ in timings], np.float64)
        seconds = np.asarray([s for _, s in timings], np.float64)
        if len(set(tokens.tolist())) < 2:
            per_token = float(seconds.mean() / max(tokens.mean(), 1.0))
            return cls(0.0, max(per_token, 1e-12))
        slope, intercept = np.polyfit(tokens, seconds, 1)
        slope = max(float(slope), 1e-12)
        return cls(max(float(intercept), 0.0), slope)


def _stored_normalization(path: str) -> dict[str, float] | None:
    """The model's stored `{"mean", "std"}`, or None when it has none (a GGUF file, no eval set)."""
    from rewardax.scoring import normalization_of

    if not Path(path).is_dir():
        return None
    try:
        return normalization_of(path)
    except ModelLoadError:
        return None


def export_hash(path: str | os.PathLike) -> str:
    """sha256 over the model's files (names and bytes, sorted; a .gguf path: that file)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def chat_template_hash(tokenizer: Any) -> str | None:
    """sha256 of the tokenizer's chat template text (None when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ServingModel:
    """Encodes rows and scores token sequences in length buckets, one compiled shape per bucket.

    Args:
      model_dir: a Hugging Face directory, .gguf file or hub name (as `rewardax score --model`).
      overrides: `section.key=value` settings (e.g. `data.max_sequence_length=128`).
      normalize: return (r - mean) / std with the statistics stored in the model's config.json.
      max_batch_tokens: padded tokens (rows x bucket length) one forward pass may hold.
      max_batch_rows: rows one forward pass may hold.
      tokenizer_path: a tokenizer other than the model's own.

    Example:
      model = ServingModel("runs/run/export", normalize=True)
      model.warm()
      ids = model.encode([{"prompt": "Review:\\n", "response": "Great film."}])
      model.rewards(ids)  # -> float64 [1], normalised
      model.score(ids)  # -> (those rewards, float64 [1, K] of K named objectives or None)
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        overrides: Sequence[str] = (),
        normalize: bool = False,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        tokenizer_path: str | None = None,
    ):
        from rewardax.scoring import ResponseEncoder, RewardScorer, normalization_of, pad_id_of

        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ConfigError(
                f"max_batch_tokens ({max_batch_tokens}) and max_batch_rows ({max_batch_rows}) "
                "must be at least 1"
            )
        self.path, self.config, self.tokenizer, model = load_for_scoring(
            str(model_dir), list(overrides), tokenizer_path
        )
        self.normalization = normalization_of(self.path) if normalize else None
        self.stored_normalization = self.normalization or _stored_normalization(self.path)
        self.encoder = ResponseEncoder(self.tokenizer, self.config.data)
        self.max_batch_tokens = int(max_batch_tokens)
        pad_id = pad_id_of(self.tokenizer)
        max_length = self.config.data.max_sequence_length
        # Per bucket, programs of `rows`, rows/4 and rows/16 rows (smallest first): a small group
        # of a gathered batch runs the smallest program that holds it instead of being padded to
        # the full row count (at 64 clients on SmolLM2 that padding cost most of the throughput).
        self.scorers: dict[int, list[RewardScorer]] = {}
        for bucket in _buckets(max_length):
            rows = max(1, min(max_batch_rows, max_batch_tokens // bucket))
            sizes = sorted({rows, max(1, rows // 4), max(1, rows // 16)})
            self.scorers[bucket] = [
                RewardScorer(model, pad_id=pad_id, max_sequence_length=max_length, batch_size=n)
                for n in sizes
            ]
        self.buckets = tuple(self.scorers)
        # A multi-objective head (model.objectives): its output names, in head order. The reward is
        # the first; `score` returns all of them.
        names = self.scorers[self.buckets[0]][0].label_names
        self.objectives: tuple[str, ...] | None = tuple(names) if names else None
        # In units of one pass's fixed cost until `warm()` measures seconds.
        self.pass_cost = PassCost(1.0, 1.0 / DEFAULT_PASS_OVERHEAD_TOKENS)
        self.export_hash = export_hash(self.path)
        self.chat_template_hash = chat_template_hash(self.tokenizer)

    def bucket_of(self, length: int) -> int:
        """The padded length of a sequence of `length` tokens."""
        return next(b for b in self.buckets if b >= length)

    def warm(self, log: Callable[[str], None] | None = None) -> float:
        """Compiles and runs every bucket's program once, then times a second run of each to fit
        `pass_cost` (how `rewards` cuts a batch into passes); returns the seconds it took."""
        start = time.perf_counter()
        programs = 0
        timings: list[tuple[int, float]] = []
        for bucket, ladder in self.scorers.items():
            for scorer in ladder:
                rows = [np.zeros(bucket, dtype=np.int32)] * scorer.batch_size
                scorer(rows)  # compiles
                t0 = time.perf_counter()
                scorer(rows)
                timings.append((scorer.batch_size * bucket, time.perf_counter() - t0))
                programs += 1
        self.pass_cost = PassCost.fit(timings)
        seconds = time.perf_counter() - start
        if log is not None:
            log(
                f"compiled {programs} programs ({len(self.scorers)} buckets) in {seconds:.1f} s; "
                f"a pass takes {1e3 * self.pass_cost.fixed_s:.1f} ms + "
                f"{1e6 * self.pass_cost.per_token_s:.2f} us per padded token"
            )
        return seconds

    def encode(self, rows: Sequence[Any], where: str = "row") -> list[np.ndarray]:
        """Token ids of each row (scoring rules of `rewardax score`); DataError naming the row."""
        return self.encoder.encode_many(rows, [f"{where} {i}" for i in range(len(rows))])

    def rewards(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """Rewards float64 [N] of N sequences, normalised when asked (`score`'s first half)."""
        return self.score(sequences)[0]

    def score(self, sequences: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """(rewards float64 [N], objectives float64 [N, len(self.objectives)] or None) of N
        sequences.

        The reward is the head's first output, normalised when asked; `objectives` holds every
        objective's output, never normalised (as `rewardax score`'s `rewards`), and is None for a
        model without named objectives. Both come from the one forward pass: the head's outputs
        reach the host whole, so a single-output model does no extra work.

        The sequences are sorted by length (longest first) and cut into forward passes, each of
        consecutive sequences padded to the bucket of its longest on the smallest program that
        holds them; the cuts are the ones of least total time under `pass_cost` (`passes`). One
        pass per bucket wasted programs on a few rows each (9 buckets up to 32 tokens: passes of
        3-4 rows); one pass for everything padded short rows to the longest (demo export, 64
        clients: half of offline `score`'s rows/s).
        """
        width = len(self.objectives) if self.objectives else 1
        outputs = np.empty((len(sequences), width), dtype=np.float64)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        lengths = [len(sequences[i]) for i in order]
        for start, end, scorer in self.passes(lengths):
            index = order[start:end]
            outputs[index] = scorer.outputs([sequences[i] for i in index])[:, :width]
        rewards = outputs[:, 0].copy()
        if self.normalization is not None:
            rewards = (rewards - self.normalization["mean"]) / self.normalization["std"]
        return rewards, (outputs if self.objectives else None)

    def passes(self, lengths: Sequence[int]) -> list[tuple[int, int, Any]]:
        """(start, end, program) of each pass over ``lengths`` sorted longest first: the cuts of
        least total `pass_cost`, by dynamic programming over the cut points (a pass starting at
        i holds at most what the largest program of bucket(lengths[i]) holds)."""
        n = len(lengths)
        best = [0.0] * (n + 1)  # best[i]: least seconds for lengths[i:]
        choice: list[tuple[int, Any]] = [(n, None)] * (n + 1)
        for i in range(n - 1, -1, -1):
            bucket = self.bucket_of(lengths[i])
            ladder = self.scorers[bucket]
            best[i] = float("inf")
            for take in range(1, min(n - i, ladder[-1].batch_size) + 1):
                scorer = next(s for s in ladder if s.batch_size >= take)
                cost = self.pass_cost(scorer.batch_size, bucket) + best[i + take]
                if cost < best[i]:
                    best[i], choice[i] = cost, (i + take, scorer)
        out, i = [], 0
        while i < n:
            end, scorer = choice[i]
            out.append((i, end, scorer))
            i = end
        return out

    def info(self) -> dict[str, Any]:
        """What `GET /info` answers."""
        data = self.config.data
        info = {
            "model": self.path,
            "export_hash": self.export_hash,
            "chat_template_hash": self.chat_template_hash,
            "normalization": self.stored_normalization,
            "normalize": self.normalization is not None,
            "max_sequence_length": data.max_sequence_length,
            "truncation_mode": data.truncation_mode,
            "append_eos": data.append_eos,
            "buckets": {
                str(b): [s.batch_size for s in ladder] for b, ladder in self.scorers.items()
            },
            "max_batch_tokens": self.max_batch_tokens,
        }
        # A multi-objective head: its output names. Every route serves the first as the reward
        # and each by name beside it (rewardax.serve.app).
        if self.objectives:
            info["objectives"] = list(self.objectives)
        return info


def _buckets(max_length: int) -> tuple[int, ...]:
    from rewardax.data.collate import default_bucket_lengths

    return tuple(default_bucket_lengths(max_length))


def completion_rows(prompts: Sequence[Any] | None, completions: Sequence[Any]) -> list[dict]:
    """`rewardax score` rows of TRL's (prompts, completions).

    A string completion is a `response` row with its `prompt` (string or chat messages); a
    completion that is a list of messages (TRL's conversational format) is a `messages` row of the
    prompt's messages followed by it.
    """
    if prompts is not None and len(prompts) != len(completions):
        raise DataError(f"{len(prompts)} prompts for {len(completions)} completions")
    rows = []
    for i, completion in enumerate(completions):
        prompt = prompts[i] if prompts is not None else None
        if isinstance(completion, str):
            rows.append(
                {"response": completion}
                if prompt is None
                else {"prompt": prompt, "response": completion}
            )
        elif isinstance(completion, list):
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            rows.append({"messages": [*(prompt or []), *completion]})
        else:
            raise DataError(
                f"completion {i}: expected a string or a list of chat messages, got "
                f"{type(completion).__name__}"
            )
    return rows


def reward_function(
    model_dir: str | os.PathLike,
    *,
    normalize: bool = False,
    batch_size: int = 32,
    overrides: Sequence[str] = (),
) -> Callable[..., list[float]]:
    """A reward function with TRL GRPO's signature, scoring in process on the local accelerator.

    The model is loaded once; each call tokenizes the completions with the rules of `rewardax
    score` (the run's data settings when `model_dir` is `<run>/export`), sorts them by length,
    scores them in batches of `batch_size` and returns the rewards in input order, equal to
    `rewardax score`'s on the same rows.

    Args:
      model_dir: a Hugging Face directory, .gguf file or hub name.
      normalize: (r - mean) / std with the statistics stored in the model's config.json.
      batch_size: sequences per forward pass.
      overrides: `section.key=value` settings, e.g. `["data.max_sequence_length=1024"]`.

    Returns:
      `reward(prompts, completions, **kwargs) -> list[float]`: completions are strings (prompts
      strings) or lists of chat messages (prompts lists of messages); other keyword arguments TRL
      passes (dataset columns, `trainer_state`) are ignored.

    Example:
      from trl import GRPOConfig, GRPOTrainer
      import rewardax

      reward = rewardax.reward_function("runs/run/export", normalize=True)
      reward(["Review:\\n"], ["A moving, funny film."])  # -> [0.83]
      trainer = GRPOTrainer(
          model="HuggingFaceTB/SmolLM2-135M-Instruct",
          reward_funcs=[reward],
          args=GRPOConfig(output_dir="grpo"),
          train_dataset=dataset,  # a "prompt" column
      )
      trainer.train()
    """
    from rewardax.scoring import (
        ResponseEncoder,
        RewardScorer,
        normalization_of,
        pad_id_of,
        score_rows,
    )

    path, config, tokenizer, model = load_for_scoring(str(model_dir), list(overrides))
    normalization = normalization_of(path) if normalize else None
    encoder = ResponseEncoder(tokenizer, config.data)
    scorer = RewardScorer(
        model,
        pad_id=pad_id_of(tokenizer),
        max_sequence_length=config.data.max_sequence_length,
        batch_size=batch_size,
    )

    def reward(prompts: Sequence[Any] | None, completions: Sequence[Any], **kwargs: Any):
        rows = completion_rows(prompts, completions)
        located = ((row, f"completion {i}") for i, row in enumerate(rows))
        scored = score_rows(located, encoder, scorer, normalization=normalization)
        return [row["reward"] for window in scored for row in window]

    reward.__name__ = f"rewardax_{Path(path).name}"
    return reward

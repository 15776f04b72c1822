"""Rewards of every preference pair of a data source, from a model alone (no optimizer, no trainer).

One path for every consumer of pair rewards: `RewardTrainer.evaluate` (the eval hook of training),
`rewardax eval`, and the HTML report that reads their rewards. A `PairScorer` compiles its eval step
once per batch shape and can score several sources with the same (or updated) parameters.

Multi-process: every process reads its own rows of each batch (as training does) and the rewards
of all processes are gathered, so each process returns the whole set in the source's row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from rewardax import data as rdata
from rewardax import distributed
from rewardax.data.config import DataConfig
from rewardax.data.rankings import score_metrics
from rewardax.evaluation import preference_metrics
from rewardax.sharding import (
    batch_sharding,
    global_batch,
    replicated,
    state_shardings,
    traced_in_mesh,
)
from rewardax.steps import make_eval_step, make_group_eval_step

# Per-pair arrays gathered from the eval batches (besides the rewards).
_PAIR_FIELDS = ("row_index", "chosen", "rejected", "margin", "chosen_lengths", "rejected_lengths")


def _batches_in_lockstep(scorer: Any, source: Any, stats: Any, **loader_kwargs: Any):
    """(mine, batches): this process's share of every eval batch of `source` (each process reads
    its own rows; `distributed.lockstep` pads so that all run the same steps), and the indices of
    the rows it supplied in a step's replicated outputs. `scorer` has batch_size, mesh,
    tokenizer and data_config; `loader_kwargs` go to `iterate_eval_batches`."""
    process_count = jax.process_count()
    local_batch_size = scorer.batch_size // process_count
    mine = distributed.local_row_indices(batch_sharding(scorer.mesh), scorer.batch_size)
    batches = rdata.iterate_eval_batches(
        source,
        scorer.tokenizer,
        scorer.data_config,
        batch_size=local_batch_size,
        process_index=jax.process_index(),
        process_count=process_count,
        stats=stats,
        **loader_kwargs,
    )
    pad_id = rdata.pad_token_id(scorer.tokenizer)
    return mine, distributed.lockstep(batches, pad_id)


def _gathered_in_source_order(parts: dict[str, list[np.ndarray]], mask_key: str):
    """(gathered, real, order): every process's parts gathered (they ran the same steps, so they
    line up), `mask_key` popped as the real-row mask, and the order that puts the real rows back
    in the source's order (batches are grouped by length)."""
    gathered = {k: distributed.allgather(np.concatenate(v)).reshape(-1) for k, v in parts.items()}
    real = gathered.pop(mask_key) > 0
    return gathered, real, np.argsort(gathered["row_index"][real], kind="stable")


@dataclass(frozen=True)
class PairRewards:
    """The rewards of a source's pairs, in the order of its rows (filtered rows left out).

    Attributes:
      chosen, rejected: float [N] rewards; margin: float [N] the rows' margins (0 without one).
      chosen_lengths, rejected_lengths: int [N] tokens scored (after truncation).
      row_index: int [N] the source row of each pair.
      num_truncated: pairs cut to data.max_sequence_length by the truncation mode.
      num_dropped: rows left out (truncation_mode=filter, or on_invalid=skip).
    """

    chosen: np.ndarray
    rejected: np.ndarray
    margin: np.ndarray
    chosen_lengths: np.ndarray
    rejected_lengths: np.ndarray
    row_index: np.ndarray
    num_truncated: int
    num_dropped: int

    def __getitem__(self, name: str) -> Any:
        """`rewards["chosen"]`: the mapping view the report and older callers use."""
        return getattr(self, name)

    def all_rewards(self) -> np.ndarray:
        """Every reward, chosen then rejected: [2N]."""
        return np.concatenate([self.chosen, self.rejected])

    def metrics(self, subsets: list[str] | None = None) -> dict[str, Any]:
        """`preference_metrics` of these rewards, with the truncation and drop counts."""
        result = preference_metrics(
            self.chosen,
            self.rejected,
            margin=self.margin,
            chosen_lengths=self.chosen_lengths,
            rejected_lengths=self.rejected_lengths,
            subsets=subsets,
        )
        result["num_truncated"] = self.num_truncated
        result["num_dropped"] = self.num_dropped
        return result


def _model_inputs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the eval step takes of a (padded) eval batch; it also carries row_index."""
    return {k: batch[k] for k in rdata.BATCH_KEYS}


class PairScorer:
    """Scores pairs with a model's parameters on a mesh.

    Args:
      graphdef: the model's `nnx.split(model, nnx.Param, ...)[0]`.
      mesh: where the parameters live and batches are split (data-parallel axes).
      tokenizer, data_config: how rows become sequences (the run's length policy included).
      batch_size: pairs per evaluation step over all processes; a multiple of the mesh's
        data-parallel size.
    """

    def __init__(
        self,
        graphdef: Any,
        *,
        mesh: jax.sharding.Mesh,
        tokenizer: Any,
        data_config: DataConfig,
        batch_size: int,
    ):
        self.mesh = mesh
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.data_config = data_config
        self.batch_size = batch_size
        self._step = jax.jit(
            traced_in_mesh(make_eval_step(graphdef), mesh), out_shardings=replicated(mesh)
        )

    @classmethod
    def for_model(
        cls, model: nnx.Module, *, mesh: jax.sharding.Mesh, **kwargs: Any
    ) -> tuple[PairScorer, dict[str, Any]]:
        """A scorer and the model's arrays placed on `mesh` by the sharding table."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        arrays = {
            "params": jax.device_put(params, state_shardings(params, mesh)),
            "rest": jax.device_put(rest, replicated(mesh)),
        }
        return cls(graphdef, mesh=mesh, **kwargs), arrays

    def __call__(self, arrays: dict[str, Any], source: Any) -> PairRewards:
        """The rewards of every pair of `source` under `arrays` ({"params", "rest"}, placed)."""
        parts: dict[str, list[np.ndarray]] = {k: [] for k in (*_PAIR_FIELDS, "pair_mask")}
        stats = rdata.LoaderStats()
        mine, host_batches = _batches_in_lockstep(self, source, stats)
        for host_batch in host_batches:
            batch = global_batch(_model_inputs(host_batch), self.mesh)
            # The outputs are replicated: keep the rows this process supplied.
            out = jax.device_get(self._step(arrays, batch))
            lengths = np.asarray(host_batch["attention_mask"]).sum(-1)
            parts["pair_mask"].append(np.asarray(host_batch["pair_mask"]))
            parts["row_index"].append(np.asarray(host_batch["row_index"]))
            parts["chosen"].append(np.asarray(out["chosen"])[mine])
            parts["rejected"].append(np.asarray(out["rejected"])[mine])
            parts["margin"].append(np.asarray(host_batch["margin"]))
            parts["chosen_lengths"].append(lengths[:, 0])
            parts["rejected_lengths"].append(lengths[:, 1])
        gathered, real, order = _gathered_in_source_order(parts, "pair_mask")
        return PairRewards(
            **{k: v[real][order] for k, v in gathered.items()},
            num_truncated=round(distributed.process_sum(stats.truncated)),
            num_dropped=round(distributed.process_sum(sum(stats.dropped.values()))),
        )


@dataclass(frozen=True)
class ScoreRewards:
    """The rewards of a source's score rows (`response` + `score`), in the order of its rows
    (filtered rows left out).

    Attributes:
      rewards, scores: float [N]; lengths: int [N] tokens scored; row_index: int [N];
      num_truncated, num_dropped: as in `PairRewards`; with named scores (model.objectives)
      objectives: the L names, outputs: float [N, L] each objective's head output, and
      named: float [N, L] the rows' named scores (NaN where a row does not score one); `scores`
      is then the first objective's.
    """

    rewards: np.ndarray
    scores: np.ndarray
    lengths: np.ndarray
    row_index: np.ndarray
    num_truncated: int
    num_dropped: int
    objectives: tuple[str, ...] | None = None
    outputs: np.ndarray | None = None
    named: np.ndarray | None = None

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def all_rewards(self) -> np.ndarray:
        return self.rewards

    def metrics(self, *, mse: bool) -> dict[str, Any]:
        """`rankings.score_metrics` (Spearman ρ, Kendall τ-b; MSE with `mse`), reward mean and
        std, and the truncation and drop counts. With named scores, the top-level metrics are
        the first objective's (over the rows that score it) and `objectives` holds
        `score_metrics` per objective name, each over the rows that score it."""
        if self.objectives is not None:
            per = {}
            for i, name in enumerate(self.objectives):
                scored = np.isfinite(self.named[:, i])
                per[name] = score_metrics(self.outputs[scored, i], self.named[scored, i], mse=mse)
            result = dict(per[self.objectives[0]])
            result["objectives"] = per
        else:
            result = score_metrics(self.rewards, self.scores, mse=mse)
        result.update(
            reward_mean=float(self.rewards.mean()) if self.rewards.size else None,
            reward_std=float(self.rewards.std()) if self.rewards.size else None,
            num_truncated=self.num_truncated,
            num_dropped=self.num_dropped,
        )
        return result


class ScoreRowScorer:
    """Scores the score rows of a source (`response` + `score`) with a model's parameters: group
    batches of K = 1 (`rewardax.data.groups`) through `steps.make_group_eval_step`. The same
    arguments and multi-process behaviour as `PairScorer`."""

    def __init__(
        self,
        graphdef: Any,
        *,
        mesh: jax.sharding.Mesh,
        tokenizer: Any,
        data_config: DataConfig,
        batch_size: int,
        objectives: list[str] | None = None,
    ):
        self.mesh, self.tokenizer = mesh, tokenizer
        self.data_config, self.batch_size = data_config, batch_size
        self.objectives = tuple(objectives) if objectives else None
        self._step = jax.jit(
            traced_in_mesh(make_group_eval_step(graphdef), mesh), out_shardings=replicated(mesh)
        )

    def __call__(self, arrays: dict[str, Any], source: Any) -> ScoreRewards:
        parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("rewards", "scores", "lengths", "row_index", "row_mask")
        }
        named: dict[str, list[np.ndarray]] = {"outputs": [], "named": []}
        stats = rdata.LoaderStats()
        mine, host_batches = _batches_in_lockstep(
            self,
            source,
            stats,
            loss="mse",  # score rows as groups of one response
            objectives=list(self.objectives) if self.objectives else None,
        )
        for host_batch in host_batches:
            inputs = {k: host_batch[k] for k in rdata.GROUP_KEYS if k in host_batch}
            out = jax.device_get(self._step(arrays, global_batch(inputs, self.mesh)))
            parts["rewards"].append(np.asarray(out["rewards"])[mine][:, 0])
            scores = np.asarray(host_batch["scores"])[:, 0]  # [B] or, named, [B, L]
            if self.objectives is not None:
                values = np.where(np.asarray(host_batch["score_mask"])[:, 0] > 0, scores, np.nan)
                named["named"].append(values)
                named["outputs"].append(np.asarray(out["outputs"])[mine][:, 0])
                scores = values[:, 0]
            parts["scores"].append(scores)
            parts["lengths"].append(np.asarray(host_batch["attention_mask"]).sum(-1)[:, 0])
            parts["row_index"].append(np.asarray(host_batch["row_index"]))
            parts["row_mask"].append(np.asarray(host_batch["row_mask"]))
        gathered, real, order = _gathered_in_source_order(parts, "row_mask")
        extra: dict[str, Any] = {}
        if self.objectives is not None:
            width = len(self.objectives)
            for k, v in named.items():
                # [N, L] rows: gathered as one flat array, then shaped back.
                flat = distributed.allgather(np.concatenate(v).reshape(-1))
                extra[k] = flat.reshape(-1, width)[real][order]
            extra["objectives"] = self.objectives
        return ScoreRewards(
            **{k: v[real][order] for k, v in gathered.items()},
            num_truncated=round(distributed.process_sum(stats.truncated)),
            num_dropped=round(distributed.process_sum(sum(stats.dropped.values()))),
            **extra,
        )

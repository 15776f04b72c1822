"""Rows with K ≥ 2 responses or one scored response: read as pairs, or as groups of K.

Three layouts (decided by the first readable row; every row must then have it):
  - `responses` (K responses: strings, or chat message lists) with `ranks` (K numbers, lower is
    better; equal ranks are ties), and an optional `prompt`;
  - `chosen` and `rejected` as lists of responses (RewardBench 2's layout): every chosen
    response is preferred to every rejected one (as ranks: chosen 0, rejected 1);
  - score rows: `response` (a string or a chat message list, optional `prompt` as for the
    others) with `score`, a finite number (pointwise data, e.g. a mean human rating), or with
    `scores`, named scores `{objective: value}` (HelpSteer's layout) for a run with
    model.objectives: a row may leave an objective out (or null), which then takes no part in
    that objective's loss nor its metrics; it must score at least one.

How they train depends on `train.loss` (`training_view`, which refuses a loss that does not fit):
  - `bradley_terry` (the default): `rankings_as_pairs(source)` presents a ranked source as one
    pair row per ordered (better, worse) couple: K responses without ties give K(K-1)/2 pairs,
    tied responses none between them. The pairs then train and evaluate as any standard or
    conversational pair (a row with more responses weighs more). Score rows have no pairs.
  - `plackett_luce`, `all_pairs_bradley_terry`, `davidson`: `ResponseGroups` presents each ranked row as a
    group of its K responses with their ranks (`rewardax.data.groups` tokenizes and collates
    them into `[B, K, T]` batches, K the largest row, or, with data.layout=shared_prompt, into
    K-branch rows with each prompt once); the step applies the loss of
    `rewardax.ranking_losses` per row, each row weighing the same.
  - `mse`, `gaussian_nll`: `ResponseGroups` presents each score row as a group of one response
    with its score.
Other fields (`prompt`, `subset`, `tools`, `chat_template_kwargs`, ...) are copied into each pair
or group. Errors name the source row and the field.

Evaluation: `ranking_metrics` (Spearman ρ, Kendall τ-b and top-1 accuracy per ranked row, from
each response's reward: `response_rewards`) and `score_metrics` (Spearman ρ and Kendall τ-b
between rewards and scores over all score rows, and their MSE).

Not done here (issue #31): tie-aware losses (Davidson, Rao-Kupper) in the train step, and
streams (group losses need random access).
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from rewardax.data.formats import InvalidRow, is_score_row
from rewardax.data.sources import ListSource
from rewardax.errors import DataError
from rewardax.evaluation import spearman_correlation
from rewardax.losses import RANKING_LOSSES, SCORE_LOSSES, group_metric_sums

if TYPE_CHECKING:  # rewardax.config imports rewardax.data
    from rewardax.config import TrainSection

_RESPONSE_FIELDS = ("responses", "ranks", "chosen", "rejected", "response", "score", "scores")


def ranking_layout(row: Any) -> str | None:
    """ "ranks" (`responses` + `ranks`), "lists" (`chosen`/`rejected` lists of responses),
    "scores" (`response` + `score`) or None (a pair row, or not a dict)."""
    if not isinstance(row, dict):
        return None
    if "responses" in row or "ranks" in row:
        return "ranks"
    if is_score_row(row):
        return "scores"
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        # A conversational pair is a list of messages (dicts); a list of responses holds
        # strings or message lists.
        items = [*chosen, *rejected]
        if items and all(isinstance(x, str | list) for x in items):
            return "lists"
    return None


def _response(value: Any, where: str, field: str) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise DataError(
        f"{where}: every item of `{field}` must be a non-empty string or a list of chat messages, "
        f"got {value!r:.80}"
    )


_LAYOUT_NAMES = {
    "ranks": "list several responses (`responses` + `ranks`",
    "lists": "list several responses (`chosen`/`rejected` lists",
    "scores": "are score rows (`response` + `score`",
}


def _check_layout(row: Any, layout: str, where: str) -> None:
    if ranking_layout(row) != layout:
        found = sorted(row)[:8] if isinstance(row, dict) else type(row).__name__
        raise DataError(
            f"{where}: this dataset's rows {_LAYOUT_NAMES[layout]}, decided by its first row); "
            f"this row does not (it has {found}): keep one kind of row per dataset"
        )


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def named_scores(row: Any, where: str, objectives: list[str]) -> list[float]:
    """A named-score row's `scores`, one value per objective in `objectives` order (NaN where
    the row leaves the objective out or gives null), or DataError naming the row, the field and
    the fix."""
    if "scores" not in row:
        field = "score" if "score" in row else "scores"
        raise DataError(
            f"{where}, field '{field}': model.objectives={list(objectives)} trains named scores; "
            f"give `scores`: {{name: value}} with names from the objectives"
        )
    scores = row["scores"]
    if not isinstance(scores, dict) or not scores:
        raise DataError(
            f"{where}, field 'scores': expected a mapping {{objective: value}}, got {scores!r:.60}"
        )
    for name, value in scores.items():
        if name not in objectives:
            close = difflib.get_close_matches(str(name), list(objectives), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataError(
                f"{where}, field 'scores.{name}': not one of model.objectives="
                f"{list(objectives)}{hint}; rename it, or add it to model.objectives"
            )
        if value is not None and not _finite(value):
            raise DataError(
                f"{where}, field 'scores.{name}': expected a finite number (or null: not scored), "
                f"got {value!r:.40}; fix the score or drop the row"
            )
    values = [scores.get(name) for name in objectives]
    if all(v is None for v in values):
        raise DataError(
            f"{where}, field 'scores': scores none of the objectives {list(objectives)}; drop "
            "the row"
        )
    return [math.nan if v is None else float(v) for v in values]


def score_row(
    row: Any, where: str, objectives: list[str] | None = None
) -> tuple[Any, float | list[float]]:
    """A score row's response and its score (a finite number), or, with `objectives`, its named
    scores (`named_scores`); DataError naming the field."""
    _check_layout(row, "scores", where)
    if row.get("response") is None:
        raise DataError(
            f"{where}, field 'response': missing; a score row needs the response it scores "
            "(a string, or a list of chat messages) next to its `score`"
        )
    response = row["response"]
    if not (isinstance(response, str) and response) and not (
        isinstance(response, list) and response and all(isinstance(m, dict) for m in response)
    ):
        raise DataError(
            f"{where}, field 'response': expected a non-empty string or a list of chat "
            f"messages, got {response!r:.60}"
        )
    if objectives:
        return response, named_scores(row, where, objectives)
    if "scores" in row and "score" not in row:
        raise DataError(
            f"{where}, field 'scores': named scores train a head with one output per name: set "
            f"model.objectives to the names (e.g. model.objectives=[{', '.join(map(str, row['scores']))}]) "
            "and train.loss=mse, or give one `score`"
        )
    score = row.get("score")
    if score is None:
        raise DataError(
            f"{where}, field 'score': missing; give the response's score as a finite number, or "
            "drop the row"
        )
    if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise DataError(
            f"{where}, field 'score': expected a finite number, got {score!r:.40}; fix the score "
            "(a number, not a string, NaN or Inf) or drop the row"
        )
    return response, float(score)


def row_group(
    row: Any, layout: str, where: str, objectives: list[str] | None = None
) -> tuple[list[Any], list[Any]]:
    """A row's responses and one target per response: its ranks (lower is better; `lists`:
    chosen 0, rejected 1) or, for a score row, its score (with `objectives`: its list of named
    scores, NaN where left out)."""
    if layout == "scores":
        response, score = score_row(row, where, objectives)
        return [response], [score]
    responses, _ = row_pairs(row, layout, where)
    if layout == "ranks":
        return responses, [float(r) for r in row["ranks"]]
    chosen = len(row["chosen"])
    return responses, [0.0] * chosen + [1.0] * (len(responses) - chosen)


def row_pairs(row: Any, layout: str, where: str) -> tuple[list[Any], list[tuple[int, int]]]:
    """A K-response row's responses and its (better, worse) index pairs."""
    _check_layout(row, layout, where)
    if layout == "lists":
        chosen = [_response(x, where, "chosen") for x in row["chosen"]]
        rejected = [_response(x, where, "rejected") for x in row["rejected"]]
        if not chosen or not rejected:
            raise DataError(f"{where}: `chosen` and `rejected` each need at least one response")
        c = len(chosen)
        return chosen + rejected, [(a, c + b) for a in range(c) for b in range(len(rejected))]
    responses, ranks = row.get("responses"), row.get("ranks")
    if not isinstance(responses, list) or len(responses) < 2:
        raise DataError(f"{where}: `responses` must be a list of at least 2 responses")
    if (
        not isinstance(ranks, list)
        or len(ranks) != len(responses)
        or not all(isinstance(r, numbers.Real) and not isinstance(r, bool) for r in ranks)
    ):
        raise DataError(
            f"{where}: `ranks` must be a list of {len(responses)} numbers, one per response "
            f"(lower is better, equal for ties), got {ranks!r:.80}"
        )
    responses = [_response(x, where, "responses") for x in responses]
    k = len(responses)
    pairs = [(a, b) for a in range(k) for b in range(k) if ranks[a] < ranks[b]]
    return responses, pairs


class RankedPairs(ListSource):
    """A random-access source of K-response rows, as the pair rows of their rankings.

    Attributes:
      source: the rows; origin: int [P, 3], each pair's (source row, better, worse) indices.
    """

    def __init__(self, source: Any, layout: str):
        super().__init__((), name=getattr(source, "name", "rows"))
        self.source, self.layout = source, layout
        origin = []
        for i in range(len(source)):
            _, pairs = row_pairs(_read(source, i), layout, source.where(i))
            origin += [(i, a, b) for a, b in pairs]
        self.origin = np.asarray(origin, np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.origin)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i, a, b = (int(x) for x in self.origin[int(index)])
        row = _read(self.source, i)
        responses, _ = row_pairs(row, self.layout, self.source.where(i))
        pair = {k: v for k, v in row.items() if k not in _RESPONSE_FIELDS}
        return {**pair, "chosen": responses[a], "rejected": responses[b]}

    def where(self, index: int) -> str:
        i, a, b = (int(x) for x in self.origin[int(index)])
        return f"{self.source.where(i)} (response {a} over {b})"


class ResponseGroups(ListSource):
    """A random-access source of K-response or score rows, as group rows for the group losses.

    Each item is the source row with `responses` (its K_i responses) and `targets` (K_i ranks,
    lower is better, or the one score) in place of its response fields; `prompt`, `tools`,
    `chat_template_kwargs` and other fields are kept. Every row is checked when the view is made.

    Attributes:
      source, layout ("ranks", "lists" or "scores"); width: K, the most responses of any row;
      target_name: "ranks" or "scores" (the batch key of the targets); objectives: the named
      scores' names (score rows with model.objectives), else None.
    """

    def __init__(
        self,
        source: Any,
        layout: str,
        max_responses: int | None = None,
        objectives: list[str] | None = None,
    ):
        super().__init__((), name=getattr(source, "name", "rows"))
        self.source, self.layout = source, layout
        self.objectives = list(objectives) if objectives and layout == "scores" else None
        self.target_name = "scores" if layout == "scores" else "ranks"
        width = 0
        for i in range(len(source)):
            responses, _ = row_group(_read(source, i), layout, source.where(i), self.objectives)
            if max_responses is not None and len(responses) > max_responses:
                raise DataError(
                    f"{source.where(i)}: {len(responses)} responses, more than "
                    f"train.max_responses={max_responses}; raise it (K responses per row cost K "
                    "sequences of every row of a batch) or split the row"
                )
            width = max(width, len(responses))
        self.width = width

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = _read(self.source, int(index))
        responses, targets = row_group(
            row, self.layout, self.source.where(int(index)), self.objectives
        )
        group = {k: v for k, v in row.items() if k not in _RESPONSE_FIELDS}
        return {**group, "responses": responses, "targets": targets}

    def where(self, index: int) -> str:
        return self.source.where(int(index))


def data_layout(source: Any, probe_rows: int = 16) -> str | None:
    """The layout of a random-access source ("ranks", "lists", "scores") from its first readable
    row (of the first `probe_rows`), or None: pairs, a stream, or no readable row."""
    if not has_random_access(source):
        return None
    for i in range(min(len(source), probe_rows)):
        try:
            row = source[i]
        except InvalidRow:
            continue
        return ranking_layout(row)
    return None


def training_view(
    source: Any,
    loss: str,
    max_responses: int | None = None,
    objectives: list[str] | None = None,
) -> Any:
    """`source` as `loss` trains on it: pairs (`rankings_as_pairs`) for bradley_terry, a
    `ResponseGroups` view for the group losses (score rows with `objectives`: named scores,
    targets [1, L]). A loss that does not fit the data is a DataError that names the losses
    that do."""
    layout = data_layout(source)
    name = getattr(source, "name", "the data")
    what = {
        None: "preference pairs (`chosen` / `rejected`)",
        "ranks": "rows ranking several responses (`responses` + `ranks`)",
        "lists": "rows with `chosen` / `rejected` lists of responses",
        "scores": "score rows (`response` + `score`)",
    }[layout]
    fits = {
        None: "train.loss=bradley_terry (plackett_luce and all_pairs_bradley_terry of two "
        "responses are the same loss)",
        "ranks": "train.loss=bradley_terry (over the pairs they imply), plackett_luce, "
        "all_pairs_bradley_terry or davidson (equal ranks as ties)",
        "scores": "train.loss=mse or gaussian_nll",
    }
    fits["lists"] = fits["ranks"]
    if loss == "bradley_terry":
        if layout == "scores":
            raise DataError(f"{name} holds {what}, which have no pairs: use {fits[layout]}")
        return rankings_as_pairs(source)
    wanted = ("ranks", "lists") if loss in RANKING_LOSSES else ("scores",)
    if loss not in RANKING_LOSSES + SCORE_LOSSES:
        raise DataError(f"unknown train.loss={loss!r}")
    if not has_random_access(source):
        raise DataError(
            f"train.loss={loss} needs data it can read by row (a file, a list or a Dataset: every "
            "row is checked and K is the largest row); a stream cannot be: use a file"
        )
    if layout not in wanted:
        raise DataError(
            f"train.loss={loss} does not fit {name}, which holds {what}: use {fits[layout]}"
        )
    return ResponseGroups(source, layout, max_responses, objectives)


def response_rewards(
    pairs: RankedPairs, pair_index: np.ndarray, chosen: np.ndarray, rejected: np.ndarray
) -> list[np.ndarray | None]:
    """Each source row's rewards, one per response (``responses`` order; ``chosen`` then
    ``rejected`` for lists), from its scored pairs.

    ``pair_index``, ``chosen``, ``rejected``: the scored pairs (indices into ``pairs``) and their
    rewards. A response in several pairs takes its first reward. A row with a response in no
    scored pair (its pairs were dropped) is None; a NaN reward stays NaN (a diverged model's
    metrics are NaN, not those of its finite rows).
    """
    source = pairs.source
    tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (rewards, which are set)
    for p, c, r in zip(
        np.asarray(pair_index).tolist(), chosen.tolist(), rejected.tolist(), strict=True
    ):
        row, a, b = (int(x) for x in pairs.origin[p])
        if row not in tables:
            responses, _ = row_pairs(_read(source, row), pairs.layout, source.where(row))
            tables[row] = np.zeros(len(responses)), np.zeros(len(responses), bool)
        table, seen = tables[row]
        for response, reward in ((a, c), (b, r)):
            if not seen[response]:
                table[response], seen[response] = reward, True
    out: list[np.ndarray | None] = [None] * len(source)
    for row, (table, seen) in tables.items():
        out[row] = table if seen.all() else None
    return out


def kendall_tau(x: np.ndarray, y: np.ndarray, block: int = 1024) -> float | None:
    """Kendall's τ-b of two [K] vectors (ties in either allowed); None when undefined.

    Every pair is compared (O(K²) time); `block` rows at a time, so that the score rows of a
    whole eval set (K = N rows) need O(block · N) memory, not O(N²)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    concordance, x_pairs, y_pairs = 0.0, 0, 0
    for start in range(0, len(x), block):
        # Pairs (i, j) with i in this block and j > i.
        i = np.arange(start, min(start + block, len(x)))[:, None]
        j = np.arange(len(x))[None, :]
        later = j > i
        dx = np.where(later, np.sign(x[i] - x[j]), 0.0)
        dy = np.where(later, np.sign(y[i] - y[j]), 0.0)
        concordance += float(np.sum(dx * dy))
        x_pairs += int(np.count_nonzero(dx))
        y_pairs += int(np.count_nonzero(dy))
    denominator = np.sqrt(float(x_pairs) * float(y_pairs))
    return None if denominator == 0 else concordance / denominator


def ranking_metrics(
    rows: list[Any],
    rewards: list[np.ndarray | None],
    loss: str | None = None,
    log_tie_strength: float = 0.0,
) -> dict[str, Any]:
    """How well rewards order each `responses` + `ranks` row: mean Spearman ρ and Kendall τ-b
    between reward and rank (higher reward for a lower rank counts as agreement), and top-1
    accuracy (the highest reward on a best-ranked response; a tie at the top counts 1/k), over
    the rows scored. With ``loss`` (one of `RANKING_LOSSES`, the run's train.loss): also `loss`,
    that loss per row as training computes it (`losses.group_metric_sums`; davidson with
    ``log_tie_strength``), where the pair metrics' loss is Bradley-Terry's over the implied
    pairs."""
    spearman, kendall, top1 = [], [], []
    scored_rows, scored_rewards = [], []
    for row, reward in zip(rows, rewards, strict=True):
        if reward is None:
            continue
        scored_rows.append(row)
        scored_rewards.append(reward)
        if not np.isfinite(reward).all():  # a diverged model: its means are NaN, not hidden
            spearman.append(math.nan), kendall.append(math.nan), top1.append(math.nan)
            continue
        better = -np.asarray(row["ranks"], np.float64)
        rho, tau = spearman_correlation(reward, better), kendall_tau(reward, better)
        if rho is not None:
            spearman.append(rho)
        if tau is not None:
            kendall.append(tau)
        top = reward == reward.max()
        top1.append(float(np.sum(top & (better == better.max())) / np.sum(top)))
    mean = lambda v: float(np.mean(v)) if v else None  # noqa: E731
    metrics = {
        "spearman": mean(spearman),
        "kendall_tau": mean(kendall),
        "top1_accuracy": mean(top1),
        "num_rows": len(top1),
    }
    if loss is not None:
        if loss not in RANKING_LOSSES:
            raise DataError(f"loss={loss!r} is not a ranking loss ({', '.join(RANKING_LOSSES)})")
        metrics["loss"] = _ranking_loss(scored_rows, scored_rewards, loss, log_tie_strength)
    return metrics


def _ranking_loss(
    rows: list[Any], rewards: list[np.ndarray], loss: str, log_tie_strength: float
) -> float | None:
    """Mean per-row ``loss`` of the rows' rewards against their ranks, the rows padded to the
    longest (padding masked out, as in a group batch)."""
    if not rows:
        return None
    width = max(len(r) for r in rewards)
    padded = np.zeros((len(rows), width), np.float32)
    ranks = np.zeros((len(rows), width), np.float32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (row, reward) in enumerate(zip(rows, rewards, strict=True)):
        k = len(reward)
        padded[i, :k], ranks[i, :k], mask[i, :k] = reward, row["ranks"], 1.0
    sums = group_metric_sums(
        padded,
        ranks,
        mask,
        np.ones(len(rows), np.float32),
        loss,
        log_tie_strength=log_tie_strength,
    )
    return float(sums["loss"]) / len(rows)


def pair_view_ranking_metrics(
    pairs: RankedPairs, scored: Any, train: TrainSection
) -> dict[str, Any]:
    """`ranking_metrics` of a ranked source scored as its pairs (`RankedPairs`, either layout;
    `chosen`/`rejected` lists rank chosen 0, rejected 1): each response's reward from its scored
    pairs (`response_rewards`; ``scored``: a `pair_scoring.PairRewards`), set against the row's
    ranks. With the run's ``train.loss`` when that is a ranking loss (and Davidson's tie
    strength): its `loss` too; a pair-trained model is judged by the pair metrics'
    Bradley-Terry loss."""
    per_row = response_rewards(pairs, scored.row_index, scored.chosen, scored.rejected)
    source = pairs.source
    rows = [
        {"ranks": row_group(_read(source, i), pairs.layout, source.where(i))[1]}
        for i in range(len(source))
    ]
    if train.loss not in RANKING_LOSSES:
        return ranking_metrics(rows, per_row)
    return ranking_metrics(rows, per_row, train.loss, train.log_tie_strength)


def score_metrics(rewards: np.ndarray, scores: np.ndarray, *, mse: bool) -> dict[str, Any]:
    """How well rewards follow the scores of N score rows: Spearman ρ and Kendall τ-b over all
    rows (None when undefined), and, with `mse` (a model trained to predict the score: mse or
    gaussian_nll), the mean squared error mean((r − y)²)."""
    rewards, scores = np.asarray(rewards, np.float64), np.asarray(scores, np.float64)
    out: dict[str, Any] = {
        "spearman": spearman_correlation(rewards, scores),
        "kendall_tau": kendall_tau(rewards, scores),
        "num_rows": int(rewards.size),
    }
    if mse:
        out["mse"] = float(np.mean(np.square(rewards - scores))) if rewards.size else None
    return out


def _read(source: Any, index: int) -> Any:
    """Row ``index``; one that cannot be read (bad JSON) is a DataError naming it: a ranked
    dataset is checked whole when it is opened."""
    try:
        return source[index]
    except InvalidRow as bad:
        raise DataError(f"{source.where(index)}: {bad}") from None


def has_random_access(source: Any) -> bool:
    """``len(source)`` and ``source[i]`` work (files, lists, datasets; not streams)."""
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


def rankings_as_pairs(source: Any, probe_rows: int = 16) -> Any:
    """``source`` itself, or a `RankedPairs` view when its first readable row (of the first
    ``probe_rows``) lists several responses. Streams (no random access) are returned as they are;
    unreadable rows are left to the pair pipeline's own errors."""
    if not has_random_access(source):
        return source
    for i in range(min(len(source), probe_rows)):
        try:
            row = source[i]
        except InvalidRow:
            continue
        layout = ranking_layout(row)
        return source if layout in (None, "scores") else RankedPairs(source, layout)
    return source

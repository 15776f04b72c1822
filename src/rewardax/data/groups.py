"""Group rows (`rankings.ResponseGroups`) -> records -> `[B, K, T]` batches, for the group losses.

A group row holds K_i ≤ K responses and one target each (ranks, or the score of a score row).
Each response is tokenized as `rewardax score` tokenizes a `response` row
(`rewardax.scoring.ResponseEncoder`: the training rules of a pair's response, the prompt
prepended, chat messages through the template), so a response's reward in training equals its
reward from `rewardax score` and `rewardax serve`.

Batch format (numpy; what the group train step receives):
  input_ids      int32   [B, K, T]  right-padded with the pad id.
  attention_mask int32   [B, K, T]  1 for real tokens (a padded response attends to its first
                                    position only, so that no softmax row is empty).
  reward_index   int32   [B, K]     each response's last real token; 0 for padding.
  response_mask  float32 [B, K]     1 for real responses, 0 for padded ones (rows with < K).
  ranks | scores float32 [B, K]     the targets (the batch key is the view's `target_name`).
                        [B, K, L]  named scores (score rows with L model.objectives; K = 1).
  score_mask     float32 [B, K, L]  named scores only: 1 where the row scores that objective
                                    (its `scores` entry there is 0, never NaN: a NaN would reach
                                    the gradient through a masked-out branch).
  row_mask       float32 [B]        1 for real rows, 0 for padding rows.
With data.layout=shared_prompt, `pack_group_records` lays the same records out as K-branch rows
instead (each group's prompt once; `rewardax.data.packing.pack_groups`): rows [R, T] with
segment, position and branch ids, `reward_slot` [B, K], and the same response_mask, targets and
row_mask. `GROUP_KEYS` names the keys of both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rewardax.data.config import DataConfig
from rewardax.data.formats import InvalidRow
from rewardax.data.packing import KBRANCH_KEYS, pack_groups
from rewardax.data.tokenize import FilteredPair

# The keys a group train step takes, of either layout: [B, K, T] here, K-branch rows
# (data.layout=shared_prompt, `rewardax.data.packing.KBRANCH_KEYS`) from `pack_group_records`.
GROUP_KEYS = tuple(
    dict.fromkeys(
        (
            "input_ids",
            "attention_mask",
            "reward_index",
            *KBRANCH_KEYS,
            "ranks",
            "scores",
            "score_mask",
        )
    )
)


def response_rows(group: dict) -> list[dict]:
    """The rows `ResponseEncoder` scores, one per response of a group row: `response` (+ its
    `prompt`) for a text response, `messages` (the prompt's messages, then the response's) for
    a chat response."""
    prompt = group.get("prompt")
    extras = {k: group[k] for k in ("tools", "chat_template_kwargs") if k in group}
    rows = []
    for response in group["responses"]:
        if isinstance(response, str):
            rows.append({"response": response, "prompt": prompt, **extras})
            continue
        if prompt is not None and not isinstance(prompt, list):
            raise InvalidRow(
                "wrong_type",
                "prompt",
                "a chat response (a list of messages) needs a chat prompt (a list of messages) "
                f"or none, got {type(prompt).__name__}",
            )
        rows.append({"messages": [*(prompt or []), *response], **extras})
    return rows


class GroupProcessor:
    """Group row -> record, with the interface of `collate.RowProcessor` (picklable for Grain
    workers; bad rows come back as `{"dropped": ...}` records, never raised).

    A record: `responses` (K_i int32 arrays, each ending with its reward token), `targets`
    float32 [K_i], `truncated` (any response cut), `index`.
    """

    def __init__(self, tokenizer: Any, config: DataConfig, layout: str):
        # Imported here: rewardax.scoring imports rewardax.data, which imports this module.
        from rewardax.scoring import ResponseEncoder

        self.config, self.layout = config, layout
        self.encoder = ResponseEncoder(tokenizer, config)

    def process(self, row: Any, index: int, where: str) -> dict:
        return self.process_many([row], [index], lambda _: where)[0]

    def process_many(
        self, rows: Sequence[Any], indices: Sequence[int], where: Callable[[int], str]
    ) -> list[dict]:
        # Every response of every row of the chunk is tokenized together (`ResponseEncoder.fit_many`:
        # one tokenizer call per kind), then each row takes its responses' results back in order.
        responses: list[list[dict] | InvalidRow] = []
        for row in rows:
            try:
                responses.append(response_rows(row))
            except InvalidRow as bad:
                responses.append(bad)
        fitted = iter(
            self.encoder.fit_many([r for rs in responses if isinstance(rs, list) for r in rs])
        )
        out = []
        for row, index, row_responses in zip(rows, indices, responses, strict=True):
            try:
                if isinstance(row_responses, InvalidRow):
                    raise row_responses
                results = [next(fitted) for _ in row_responses]
                out.append({**self._record(row, results), "index": index})
            except InvalidRow as bad:
                message = (
                    f"{where(index)}, field '{bad.field_name}': {bad.expected}. Fix the row, or "
                    "set data.on_invalid=skip to drop such rows (they are counted by reason)."
                )
                out.append(
                    {"dropped": bad.reason, "message": message, "index": index, "fatal": True}
                )
            except FilteredPair as cut:  # truncation_mode=filter: the whole row is left out
                out.append(
                    {
                        "dropped": cut.reason,
                        "message": f"{where(index)}: {cut.reason}",
                        "index": index,
                        "fatal": False,
                    }
                )
        return out

    def _record(self, group: dict, results: list[Any]) -> dict:
        """The record of a group from its responses' `fit_many` results; the first failed
        response, in order, raises."""
        responses, truncated = [], False
        for k, result in enumerate(results):
            if isinstance(result, FilteredPair):
                raise result
            if isinstance(result, InvalidRow):
                # Named as the source row names it: `response`, or the k-th item of `responses`
                # (`chosen` then `rejected` for lists).
                field = result.field_name
                if field in ("response", "messages") or field.startswith("messages["):
                    field = "response" if self.layout == "scores" else f"responses[{k}]"
                raise InvalidRow(result.reason, field, result.expected)
            ids, cut = result
            responses.append(np.asarray(ids, dtype=np.int32))
            truncated |= cut
        return {
            "responses": responses,
            "targets": np.asarray(group["targets"], dtype=np.float32),
            "truncated": truncated,
        }


def collate_groups(
    records: Sequence[dict],
    pad_id: int,
    bucket_lengths: Sequence[int],
    batch_size: int,
    width: int,
    target_name: str,
    num_objectives: int = 0,
) -> dict[str, np.ndarray]:
    """Stack group records into one batch (module docstring) of `batch_size` rows of `width` (K)
    responses; rows with fewer responses, and rows past the records, are padding.

    Args:
      records: `GroupProcessor` records; pad_id: the id of padded positions; bucket_lengths:
        sorted allowed T (the smallest holding the longest response is used); target_name:
        "ranks" or "scores"; num_objectives: L of named-score records (targets [K_i, L]), 0
        for one target per response.
    """
    if len(records) > batch_size:
        raise ValueError(f"{len(records)} records do not fit a batch of {batch_size}")
    lengths = np.zeros((batch_size, width), dtype=np.int32)
    # Named scores: [K_i, L] per record (NaN = not scored) -> [B, K, L] plus score_mask.
    extra = (num_objectives,) if num_objectives else ()
    targets = np.zeros((batch_size, width, *extra), dtype=np.float32)
    for i, record in enumerate(records):
        k = len(record["responses"])
        if k > width:
            raise ValueError(f"a row of {k} responses does not fit K={width}")
        lengths[i, :k] = [len(r) for r in record["responses"]]
        targets[i, :k] = record["targets"]
    longest = max(int(lengths.max()), 1)
    length = next((b for b in bucket_lengths if b >= longest), None)
    if length is None:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the largest bucket {bucket_lengths[-1]}"
        )
    real = np.arange(length, dtype=np.int32) < lengths[..., None]
    input_ids = np.full((batch_size, width, length), pad_id, dtype=np.int32)
    pieces = [r for record in records for r in record["responses"]]
    if pieces:  # the mask's True cells, row-major, are the responses one after the other
        input_ids[real] = np.concatenate(pieces)
    attention_mask = real.astype(np.int32)
    response_mask = (lengths > 0).astype(np.float32)
    attention_mask[..., 0] |= (lengths == 0).astype(np.int32)
    row_mask = np.zeros((batch_size,), dtype=np.float32)
    row_mask[: len(records)] = 1.0
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "reward_index": np.maximum(lengths - 1, 0),
        "response_mask": response_mask,
        target_name: targets,
        "row_mask": row_mask,
    }
    if extra:
        scored = np.isfinite(targets)
        batch["score_mask"] = scored.astype(np.float32)
        batch[target_name] = np.where(scored, targets, 0.0).astype(np.float32)
    return batch


def pack_group_records(
    records: Sequence[dict],
    pad_id: int,
    batch_size: int,
    width: int,
    target_name: str,
    row_lengths: Sequence[int],
    row_multiple: int = 1,
) -> dict[str, np.ndarray]:
    """`GroupProcessor` records as one K-branch batch (data.layout=shared_prompt): each group's
    prompt (the common token prefix of its responses) once, its responses as branches
    (`rewardax.data.packing.pack_groups`, whose batch keys these are). The rewards equal the
    padded layout's."""
    batch = pack_groups(
        [{"responses_input_ids": r["responses"], target_name: r["targets"]} for r in records],
        pad_id,
        group_size=width,
        batch_size=batch_size,
        row_lengths=row_lengths,
        row_multiple=row_multiple,
        per_response=(target_name,),
    )
    if batch[target_name].ndim == 3:  # named scores [G, K, L]: NaN = not scored, as collated
        scored = np.isfinite(batch[target_name])
        batch["score_mask"] = scored.astype(np.float32)
        batch[target_name] = np.where(scored, batch[target_name], 0.0).astype(np.float32)
    return batch

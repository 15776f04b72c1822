"""Recognise a preference row's format and normalise it into one of three shapes.

Formats (decided once per dataset from its first rows, then every row must match):
  - `standard`: `chosen` / `rejected` strings, with an optional `prompt` string. Without `prompt` the
    shared character prefix of the two texts is the prompt; with it, the prompt is prepended unless the
    response already starts with it.
  - `conversational`: `chosen` / `rejected` lists of `{"role", "content"}` messages, optional `prompt`
    message list, per-row `tools` and `chat_template_kwargs`.
  - `sharegpt`: turns as `{"from", "value"}`; the prompt turns are in `conversations` (or `prompt`), the
    responses in `chosen` / `rejected` (one turn or a list of turns).
  - `pretokenized`: `chosen_input_ids` / `rejected_input_ids` (or TRL's `input_ids_chosen` /
    `input_ids_rejected`), optional `prompt_input_ids`.
Every format may carry `margin`, or `score_chosen` / `score_rejected` (used when configured).

Rows that are not pairs are recognised here too, so that a pair dataset names them when they
turn up: score rows (`response` + `score`, `is_score_row`) and rows ranking K responses
(`rewardax.data.rankings`); those datasets are read by `rewardax.data.rankings`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("standard", "conversational", "sharegpt", "pretokenized")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}
_IDS_COLUMNS = (
    ("chosen_input_ids", "rejected_input_ids"),
    ("input_ids_chosen", "input_ids_rejected"),
)


class InvalidRow(Exception):
    """A row cannot become a pair; turned into a DataError (with its location) or a skip count."""

    def __init__(self, reason: str, field_name: str, expected: str):
        super().__init__(f"field '{field_name}': {expected}")
        self.reason = reason
        self.field_name = field_name
        self.expected = expected


@dataclass
class NormalizedPair:
    """One row in a tokenizer-independent shape.

    kind `text`: `chosen` / `rejected` are full strings and `prompt_chars` characters of each are prompt.
    kind `chat`: `chosen` / `rejected` are full message lists (prompt included), `tools` and
      `template_kwargs` go to the chat template.
    kind `ids`: `chosen` / `rejected` are full token-id lists and `prompt_tokens` of each are prompt.
    """

    kind: str
    chosen: Any
    rejected: Any
    prompt_chars: int = 0
    prompt_tokens: int = 0
    tools: Any = None
    template_kwargs: dict = field(default_factory=dict)
    margin: float = 0.0


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_score_row(row: Any) -> bool:
    """A pointwise row: one `response` (a string or chat messages, optional `prompt`) with a
    numeric `score`, or named scores `scores: {objective: value}`, rather than a pair."""
    return (
        isinstance(row, dict)
        and ("score" in row or "scores" in row or "response" in row)
        and not any(k in row for k in ("chosen", "rejected", "responses", "conversations"))
    )


def detect_format(row: Any) -> str | None:
    """Return the format of one row, or None when its fields are too broken to tell."""
    if not isinstance(row, dict):
        return None
    if any(a in row for a, _ in _IDS_COLUMNS):
        return "pretokenized"
    if "conversations" in row:
        return "sharegpt"
    for name in ("chosen", "rejected"):
        value = row.get(name)
        if isinstance(value, str):
            return "standard"
        if isinstance(value, dict) and "from" in value:
            return "sharegpt"
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return "sharegpt" if "from" in value[0] else "conversational"
    return None


def detect_dataset_format(rows: list[Any]) -> str:
    """The format of a dataset from its first rows (the first row that tells decides)."""
    for row in rows:
        fmt = detect_format(row)
        if fmt is not None:
            return fmt
    return "standard"  # every row checked is broken; the per-row checks will name the problem


def _margin(row: dict, margin_from_scores: bool, margin_scale: float) -> float:
    if margin_from_scores:
        scores = []
        for name in ("score_chosen", "score_rejected"):
            value = row.get(name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise InvalidRow(
                    "bad_margin",
                    name,
                    f"expected a finite number (data.margin_from_scores is on), got {_describe(value)}",
                )
            scores.append(float(value))
        return (scores[0] - scores[1]) * margin_scale
    value = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRow(
            "bad_margin", "margin", f"expected a finite number, got {_describe(value)}"
        )
    return float(value)


def check_encodable(value: Any, where: str, depth: int = 0) -> None:
    """Strings must be valid Unicode: a lone surrogate (from a bad decode upstream) would crash the
    tokenizer deep inside Rust, so it is reported here with the field's path."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRow(
                "invalid_text",
                where,
                f"expected valid Unicode text, found an unencodable character at {exc.start} "
                "(a lone surrogate: was the file decoded with errors='surrogateescape'?)",
            ) from None
    elif depth < 8 and isinstance(value, dict):
        for key, item in value.items():
            check_encodable(item, f"{where}.{key}" if where else str(key), depth + 1)
    elif depth < 8 and isinstance(value, list):
        for i, item in enumerate(value):
            check_encodable(item, f"{where}[{i}]", depth + 1)


def _text(row: dict, name: str) -> str:
    value = row.get(name)
    if name not in row or value is None:
        raise InvalidRow(
            "missing_field", name, "expected a non-empty string, the field is missing or None"
        )
    if not isinstance(value, str):
        raise InvalidRow("wrong_type", name, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidRow("empty_field", name, "expected a non-empty string, got an empty one")
    return value


def checked_messages(value: Any, name: str, *, response: bool) -> list[dict]:
    if value is None:
        raise InvalidRow(
            "missing_field", name, "expected a list of messages, the field is missing or None"
        )
    if not isinstance(value, list) or not value:
        raise InvalidRow(
            "wrong_type", name, f"expected a non-empty list of messages, got {_describe(value)}"
        )
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidRow(
                "bad_message",
                where,
                f"expected a dict with 'role' and 'content', got {_describe(message)}",
            )
        # isinstance first: a list or dict role is unhashable and would crash the `in` test.
        if not isinstance(message["role"], str) or message["role"] not in CHAT_ROLES:
            raise InvalidRow(
                "unknown_role",
                where,
                f"role must be one of {sorted(CHAT_ROLES)}, got {message['role']!r}",
            )
        content = message["content"]
        if content is None and not message.get("tool_calls"):
            raise InvalidRow("missing_field", where + ".content", "expected text, got None")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRow(
                "wrong_type", where + ".content", f"expected text, got {type(content).__name__}"
            )
        out.append(message)
    if response and isinstance(out[-1]["content"], str) and not out[-1]["content"].strip():
        raise InvalidRow("empty_field", f"{name}[{len(out) - 1}].content", "the response is empty")
    return out


def _sharegpt_turns(value: Any, name: str) -> list[dict]:
    if isinstance(value, dict):
        value = [value]
    if value is None:
        raise InvalidRow(
            "missing_field", name, "expected ShareGPT turns, the field is missing or None"
        )
    if not isinstance(value, list) or not value:
        raise InvalidRow(
            "wrong_type", name, f"expected a non-empty list of turns, got {_describe(value)}"
        )
    out = []
    for i, turn in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise InvalidRow(
                "bad_message",
                where,
                f"expected a dict with 'from' and 'value', got {_describe(turn)}",
            )
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise InvalidRow(
                "unknown_role",
                where,
                f"'from' must be one of {sorted(SHAREGPT_ROLES)}, got {turn['from']!r}",
            )
        if not isinstance(turn["value"], str):
            raise InvalidRow(
                "wrong_type", where + ".value", f"expected text, got {_describe(turn['value'])}"
            )
        out.append({"role": role, "content": turn["value"]})
    return out


def _token_ids(row: dict, name: str) -> list[int]:
    value = row.get(name)
    if value is None:
        raise InvalidRow(
            "missing_field", name, "expected a list of token ids, the field is missing or None"
        )
    try:
        ids = [int(x) for x in value]
        ok = all(float(x) == int(x) for x in value) if ids else False
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidRow(
            "wrong_type",
            name,
            f"expected a non-empty list of integer token ids, got {_describe(value)}",
        )
    return ids


def _common_prefix(a: str | list, b: str | list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    # Each response keeps at least one unit of its own, so a reward token always lies in the response.
    return min(i, max(n - 1, 0))


_TEMPLATE_CONTROLS = frozenset(
    {
        "chat_template",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def chat_extras(row: dict) -> tuple[Any, dict]:
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise InvalidRow(
                "bad_tools", "tools", f"expected a list of tool schemas (JSON), {err}"
            ) from None
    if tools is not None and not isinstance(tools, list):
        raise InvalidRow(
            "bad_tools", "tools", f"expected a list of tool schemas, got {_describe(tools)}"
        )
    kwargs = row.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRow(
            "wrong_type", "chat_template_kwargs", f"expected a dict, got {_describe(kwargs)}"
        )
    # Template variables only: a row must not swap the template (`chat_template`) or change how
    # apply_chat_template runs (tokenize, return_dict, ...); data is text, never a program.
    if controls := sorted(
        str(k) for k in kwargs if k in _TEMPLATE_CONTROLS or not isinstance(k, str)
    ):
        raise InvalidRow(
            "bad_template_kwargs",
            "chat_template_kwargs",
            f"expected template variables, got apply_chat_template setting(s) {controls}",
        )
    return tools or None, kwargs


def normalize_row(
    row: Any, fmt: str, *, margin_from_scores: bool = False, margin_scale: float = 1.0
) -> NormalizedPair:
    """Turn one row of a dataset in format `fmt` into a NormalizedPair, or raise InvalidRow."""
    if not isinstance(row, dict):
        raise InvalidRow(
            "wrong_type", "<row>", f"expected a mapping of fields, got {type(row).__name__}"
        )
    check_encodable(row, "")
    if is_score_row(row):
        raise InvalidRow(
            "format_mismatch",
            "score",
            f"the dataset is in {fmt} pair format (decided by its first rows), this row is a "
            "score row (`response` + `score`); keep one kind of row per dataset",
        )
    found = detect_format(row)
    if found is not None and found != fmt:
        raise InvalidRow(
            "format_mismatch", "chosen", f"the dataset is in {fmt} format, this row is {found}"
        )
    margin = _margin(row, margin_from_scores, margin_scale)
    if fmt == "standard":
        chosen, rejected = _text(row, "chosen"), _text(row, "rejected")
        prompt = row.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRow(
                "wrong_type", "prompt", f"expected a string, got {type(prompt).__name__}"
            )
        if prompt:
            # EasyDeL drops this column; the prompt is part of what the reward model must read.
            chosen = chosen if chosen.startswith(prompt) else prompt + chosen
            rejected = rejected if rejected.startswith(prompt) else prompt + rejected
            prompt_chars = len(prompt)
        else:
            prompt_chars = _common_prefix(chosen, rejected)
        pair = NormalizedPair("text", chosen, rejected, prompt_chars=prompt_chars, margin=margin)
    elif fmt in ("conversational", "sharegpt"):
        if fmt == "conversational":
            prompt = row.get("prompt")
            prompt = (
                checked_messages(prompt, "prompt", response=False) if prompt is not None else []
            )
            chosen = checked_messages(row.get("chosen"), "chosen", response=True)
            rejected = checked_messages(row.get("rejected"), "rejected", response=True)
        else:
            name = "conversations" if "conversations" in row else "prompt"
            prompt = _sharegpt_turns(row[name], name) if row.get(name) is not None else []
            chosen = _sharegpt_turns(row.get("chosen"), "chosen")
            rejected = _sharegpt_turns(row.get("rejected"), "rejected")
        tools, kwargs = chat_extras(row)
        pair = NormalizedPair(
            "chat",
            prompt + chosen,
            prompt + rejected,
            tools=tools,
            template_kwargs=kwargs,
            margin=margin,
        )
    elif fmt == "pretokenized":
        names = next((n for n in _IDS_COLUMNS if n[0] in row), _IDS_COLUMNS[0])
        chosen, rejected = _token_ids(row, names[0]), _token_ids(row, names[1])
        if row.get("prompt_input_ids") is not None:
            prompt = _token_ids(row, "prompt_input_ids")
            chosen = chosen if chosen[: len(prompt)] == prompt else prompt + chosen
            rejected = rejected if rejected[: len(prompt)] == prompt else prompt + rejected
            prompt_tokens = len(prompt)
        else:
            prompt_tokens = _common_prefix(chosen, rejected)
        pair = NormalizedPair("ids", chosen, rejected, prompt_tokens=prompt_tokens, margin=margin)
    else:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if pair.chosen == pair.rejected:
        raise InvalidRow(
            "identical", "chosen", "chosen and rejected are identical: the pair teaches nothing"
        )
    return pair


def location(path: str | None, index: int, line: int | None = None) -> str:
    """How an error names a row: `file.jsonl:17 (row 16)` or `row 16`."""
    if path is None:
        return f"row {index}"
    name = os.fspath(path)
    return f"{name}:{line} (row {index})" if line is not None else f"{name} (row {index})"

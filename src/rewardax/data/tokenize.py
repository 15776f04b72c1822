"""Turn a NormalizedPair into token ids, apply the length policy and fix the reward token.

The reward token of each response is its last kept token; it is decided here, once: a record's
`chosen_input_ids` / `rejected_input_ids` end with it, and collation writes `reward_index = length - 1`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rewardax.data.formats import InvalidRow, NormalizedPair


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: the tokenizer's pad token, else its EOS, else 0.

    Padding is never used to find the reward token (attention masks are), so pad == EOS is safe.
    """
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if value is not None:
            return int(value)
    return 0


class PairEncoder:
    """Tokenizes NormalizedPairs with one tokenizer and one length policy.

    Args:
      tokenizer: a Hugging Face tokenizer (fast tokenizers give exact prompt/response boundaries).
      max_sequence_length: the most tokens one sequence (prompt + response) may keep.
      truncation_mode: `keep_end` | `keep_start` | `filter`.
      append_eos: append EOS to plain-text sequences that do not end with it.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_sequence_length: int,
        truncation_mode: str = "keep_end",
        append_eos: bool = True,
    ):
        if truncation_mode not in ("keep_end", "keep_start", "filter"):
            raise ValueError(
                f"truncation_mode must be keep_end, keep_start or filter, got {truncation_mode!r}"
            )
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be at least 2, got {max_sequence_length}")
        self.tokenizer = tokenizer
        self.max_sequence_length = int(max_sequence_length)
        self.truncation_mode = truncation_mode
        self.append_eos = append_eos
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.vocab_size = len(tokenizer)
        # Does plain encoding add a BOS? Then a chat render must start with exactly one BOS too.
        probe = tokenizer("a").input_ids
        self.adds_bos = self.bos_id is not None and len(probe) > 0 and probe[0] == self.bos_id
        self.is_fast = bool(getattr(tokenizer, "is_fast", False))

    # -- text -> ids -------------------------------------------------------------------------
    def _encode(
        self, text: str, prompt_chars: int, add_special_tokens: bool
    ) -> tuple[list[int], int]:
        """Token ids of `text` and how many leading tokens lie wholly inside its first prompt_chars."""
        if self.is_fast:
            enc = self.tokenizer(
                text, add_special_tokens=add_special_tokens, return_offsets_mapping=True
            )
            ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
            n_prompt = 0
            # A token that straddles the boundary belongs to the response: keep_end never cuts it.
            while n_prompt < len(ids) and offsets[n_prompt][1] <= prompt_chars:
                n_prompt += 1
            return ids, n_prompt
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        prefix = self.tokenizer(text[:prompt_chars], add_special_tokens=add_special_tokens)[
            "input_ids"
        ]
        n_prompt = 0
        while n_prompt < min(len(prefix), len(ids)) and prefix[n_prompt] == ids[n_prompt]:
            n_prompt += 1
        return ids, n_prompt

    def _render(self, messages: list[dict], pair: NormalizedPair, name: str) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=pair.tools,
                tokenize=False,
                add_generation_prompt=False,
                **pair.template_kwargs,
            )
        except Exception as err:  # jinja raises many types; all mean "this row does not render"
            raise InvalidRow(
                "chat_template",
                name,
                f"the tokenizer's chat template failed: {type(err).__name__}: {err}",
            ) from None
        # Whitespace after the end-of-turn token carries nothing: the reward reads the end-of-turn token.
        return text.rstrip()

    def _sequences(self, pair: NormalizedPair) -> list[tuple[list[int], int]]:
        if pair.kind == "ids":
            for name, ids in (
                ("chosen_input_ids", pair.chosen),
                ("rejected_input_ids", pair.rejected),
            ):
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise InvalidRow(
                        "bad_token_id",
                        name,
                        f"token ids must lie in [0, {self.vocab_size}), got {bad[0]}",
                    )
            return [
                (list(pair.chosen), pair.prompt_tokens),
                (list(pair.rejected), pair.prompt_tokens),
            ]
        if pair.kind == "text":
            out = []
            for text in (pair.chosen, pair.rejected):
                ids, n_prompt = self._encode(text, pair.prompt_chars, add_special_tokens=True)
                if (
                    self.append_eos
                    and self.eos_id is not None
                    and (not ids or ids[-1] != self.eos_id)
                ):
                    ids.append(int(self.eos_id))
                out.append((ids, n_prompt))
            return out
        chosen = self._render(pair.chosen, pair, "chosen")
        rejected = self._render(pair.rejected, pair, "rejected")
        n = min(len(chosen), len(rejected))
        common = 0
        while common < n and chosen[common] == rejected[common]:
            common += 1
        out = []
        for text in (chosen, rejected):
            # The template writes its own special tokens: encoding it with add_special_tokens would
            # give a second BOS. Add one only when the tokenizer wants it and the template left it out.
            ids, n_prompt = self._encode(text, min(common, len(text) - 1), add_special_tokens=False)
            if self.adds_bos and (not ids or ids[0] != self.bos_id):
                ids, n_prompt = [int(self.bos_id), *ids], n_prompt + 1
            out.append((ids, n_prompt))
        return out

    # -- length policy ---------------------------------------------------------------------------
    def _fit(self, ids: list[int], n_prompt: int, name: str) -> tuple[list[int], bool]:
        limit = self.max_sequence_length
        if len(ids) <= limit:
            return ids, False
        if self.truncation_mode == "filter":
            raise _Filtered()
        if self.truncation_mode == "keep_start":
            return ids[:limit], True
        keep_bos = 1 if (n_prompt > 0 and self.bos_id is not None and ids[0] == self.bos_id) else 0
        response = ids[n_prompt:]
        budget = limit - keep_bos - len(response)
        if budget < 0:
            raise InvalidRow(
                "response_too_long",
                name,
                f"the response alone has {len(response)} tokens, more than max_sequence_length="
                f"{limit} allows; raise max_sequence_length or use truncation_mode keep_start/filter",
            )
        return ids[:keep_bos] + ids[n_prompt - budget : n_prompt] + response, True

    def encode(self, pair: NormalizedPair) -> dict:
        """Return the record of a pair, or raise InvalidRow / _Filtered.

        Returns:
          {"chosen_input_ids": int32 [Lc], "rejected_input_ids": int32 [Lr], "margin": float,
           "truncated": bool}; the last id of each is its reward token.
        """
        (c_ids, c_prompt), (r_ids, r_prompt) = self._sequences(pair)
        c_ids, c_cut = self._fit(c_ids, c_prompt, "chosen")
        r_ids, r_cut = self._fit(r_ids, r_prompt, "rejected")
        if c_ids == r_ids:
            raise _Filtered("identical_after_truncation")
        return {
            "chosen_input_ids": np.asarray(c_ids, dtype=np.int32),
            "rejected_input_ids": np.asarray(r_ids, dtype=np.int32),
            "margin": float(pair.margin),
            "truncated": bool(c_cut or r_cut),
        }


class _Filtered(Exception):
    """The length policy drops this pair (counted, never an error)."""

    def __init__(self, reason: str = "too_long"):
        super().__init__(reason)
        self.reason = reason

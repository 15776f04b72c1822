"""Turn a NormalizedPair into token ids, apply the length policy and fix the reward token.

The reward token of each response is its last kept token; it is decided here, once: a record's
`chosen_input_ids` / `rejected_input_ids` end with it, and collation writes `reward_index = length - 1`.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    @classmethod
    def for_data(cls, tokenizer: Any, config: Any) -> PairEncoder:
        """The encoder of a `data` section (`rewardax.data.DataConfig`): its length policy."""
        return cls(
            tokenizer,
            config.max_sequence_length,
            config.truncation_mode,
            append_eos=config.append_eos,
        )

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

    def render(self, messages: list[dict], pair: NormalizedPair, name: str) -> str:
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

    def token_ids(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of many texts in one tokenizer call (the fast tokenizer's batch path).

        One call per chunk instead of one per text: the per-call overhead of `tokenizer(...)`
        (BatchEncoding, settings) is paid once. Offsets are not asked for: the prompt boundary is
        only needed for the few sequences that keep_end truncates (`_prompt_tokens`).
        """
        if not texts:
            return []
        enc = self.tokenizer(
            texts,
            add_special_tokens=add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return enc["input_ids"]  # fresh lists, ours to extend

    def plain_sequence(self, ids: list[int], text: str, prompt_chars: int) -> EncodedSequence:
        """The sequence of a plain text encoded with add_special_tokens (`ids`): one BOS
        (`single_bos`), and EOS appended when `append_eos` and it does not end with one."""
        seq = self.single_bos(EncodedSequence(ids, text, prompt_chars, True))
        if (
            self.append_eos
            and self.eos_id is not None
            and (not seq.ids or seq.ids[-1] != self.eos_id)
        ):
            seq.ids.append(int(self.eos_id))
        return seq

    def rendered_sequence(self, ids: list[int], text: str, prompt_chars: int) -> EncodedSequence:
        """The sequence of a chat render encoded without special tokens (`ids`). The template
        writes its own; encoding it with add_special_tokens would give a second BOS, so one is
        added only when the tokenizer wants it and the template left it out."""
        seq = EncodedSequence(ids, text, min(prompt_chars, len(text) - 1), False)
        if self.adds_bos and (not ids or ids[0] != self.bos_id):
            seq.ids = [int(self.bos_id), *ids]
            seq.bos_shift = 1
        return seq

    def single_bos(self, seq: EncodedSequence) -> EncodedSequence:
        """`seq` (a text encoded with add_special_tokens) with one BOS where the text itself
        started with the BOS token: a chat render sent as text (an RL framework's query) is then
        encoded as the same conversation given as messages is, not with a second BOS."""
        ids = seq.ids
        if self.adds_bos and len(ids) >= 2 and ids[0] == ids[1] == self.bos_id:
            seq.ids = ids[1:]
            seq.bos_shift = -1
        return seq

    def _prompt_tokens(self, seq: EncodedSequence) -> int:
        """How many leading tokens of `seq` are prompt (computed only when truncation needs it)."""
        if seq.prompt_tokens is None:
            _, n_prompt = self._encode(seq.text, seq.prompt_chars, seq.add_special_tokens)
            seq.prompt_tokens = n_prompt + seq.bos_shift
            if seq.bos_shift < 0:  # the text's own BOS, kept, is prompt as the added one was
                seq.prompt_tokens = max(seq.prompt_tokens, 1)
        return seq.prompt_tokens

    def _sequences_many(self, pairs: Sequence[NormalizedPair]) -> list[Any]:
        """Per pair: [chosen EncodedSequence, rejected EncodedSequence], or the InvalidRow it raised."""
        out: list[Any] = [None] * len(pairs)
        # (pair slot, texts) of each tokenizer call kind: plain text adds special tokens, a chat
        # render does not (the template writes its own).
        plain: list[tuple[int, str, str, int]] = []
        chat: list[tuple[int, str, str, int]] = []
        for i, pair in enumerate(pairs):
            try:
                if pair.kind == "ids":
                    out[i] = self._id_sequences(pair)
                elif pair.kind == "text":
                    plain.append((i, pair.chosen, pair.rejected, pair.prompt_chars))
                else:
                    chosen = self.render(pair.chosen, pair, "chosen")
                    rejected = self.render(pair.rejected, pair, "rejected")
                    n = min(len(chosen), len(rejected))
                    common = 0
                    while common < n and chosen[common] == rejected[common]:
                        common += 1
                    chat.append((i, chosen, rejected, common))
            except InvalidRow as bad:
                out[i] = bad
        for jobs, special in ((plain, True), (chat, False)):
            texts = [t for _, c, r, _ in jobs for t in (c, r)]
            ids = self.token_ids(texts, add_special_tokens=special)
            for k, (i, chosen, rejected, mark) in enumerate(jobs):
                seqs = []
                for text, seq_ids in ((chosen, ids[2 * k]), (rejected, ids[2 * k + 1])):
                    if special:
                        seq = self.plain_sequence(seq_ids, text, mark)
                    else:
                        seq = self.rendered_sequence(seq_ids, text, mark)
                    seqs.append(seq)
                out[i] = seqs
        return out

    def _id_sequences(self, pair: NormalizedPair) -> list[EncodedSequence]:
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
            EncodedSequence(list(pair.chosen), None, 0, False, prompt_tokens=pair.prompt_tokens),
            EncodedSequence(list(pair.rejected), None, 0, False, prompt_tokens=pair.prompt_tokens),
        ]

    # -- length policy ---------------------------------------------------------------------------
    def fit(self, seq: EncodedSequence, name: str) -> tuple[list[int], bool]:
        ids, limit = seq.ids, self.max_sequence_length
        if len(ids) <= limit:
            return ids, False
        if self.truncation_mode == "filter":
            raise FilteredPair()
        if self.truncation_mode == "keep_start":
            return ids[:limit], True
        n_prompt = self._prompt_tokens(seq)
        keep_bos = 1 if (n_prompt > 0 and self.bos_id is not None and ids[0] == self.bos_id) else 0
        response = ids[n_prompt:]
        budget = limit - keep_bos - len(response)
        if budget < 0:
            # The response alone is longer than the limit: its end, which holds the reward token,
            # is kept (after BOS); the prompt and the response's start are cut.
            return ids[:keep_bos] + response[len(response) - (limit - keep_bos) :], True
        return ids[:keep_bos] + ids[n_prompt - budget : n_prompt] + response, True

    def encode(self, pair: NormalizedPair) -> dict:
        """Return the record of a pair, or raise InvalidRow / FilteredPair.

        Returns:
          {"chosen_input_ids": int32 [Lc], "rejected_input_ids": int32 [Lr], "margin": float,
           "truncated": bool}; the last id of each is its reward token.
        """
        result = self.encode_many([pair])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def encode_many(
        self, pairs: Sequence[NormalizedPair]
    ) -> list[dict | InvalidRow | FilteredPair]:
        """Records of many pairs (as `encode`), tokenized with one tokenizer call per kind.

        A pair that `encode` would reject yields its InvalidRow / FilteredPair in its slot instead.
        """
        out: list[dict | InvalidRow | FilteredPair] = []
        for pair, seqs in zip(pairs, self._sequences_many(pairs), strict=True):
            if isinstance(seqs, InvalidRow):
                out.append(seqs)
                continue
            try:
                c_ids, c_cut = self.fit(seqs[0], "chosen")
                r_ids, r_cut = self.fit(seqs[1], "rejected")
                if c_ids == r_ids:
                    raise FilteredPair("identical_after_truncation")
            except (InvalidRow, FilteredPair) as err:
                out.append(err)
                continue
            out.append(
                {
                    "chosen_input_ids": np.asarray(c_ids, dtype=np.int32),
                    "rejected_input_ids": np.asarray(r_ids, dtype=np.int32),
                    "margin": float(pair.margin),
                    "truncated": bool(c_cut or r_cut),
                }
            )
        return out


class EncodedSequence:
    """One tokenized response and what is needed to find its prompt boundary later.

    `prompt_tokens` is known for pre-tokenized rows; for text it is computed from `text` and
    `prompt_chars` only when keep_end must cut the prompt (offsets cost time and are rarely used).
    """

    __slots__ = ("add_special_tokens", "bos_shift", "ids", "prompt_chars", "prompt_tokens", "text")

    def __init__(
        self,
        ids: list[int],
        text: str | None,
        prompt_chars: int,
        add_special_tokens: bool,
        prompt_tokens: int | None = None,
    ):
        self.ids, self.text, self.prompt_chars = ids, text, prompt_chars
        self.add_special_tokens, self.prompt_tokens = add_special_tokens, prompt_tokens
        # BOS tokens added (+1) or removed (-1) after encoding `text`: the prompt boundary found
        # by re-encoding the text moves by as many.
        self.bos_shift = 0


class FilteredPair(Exception):
    """The length policy drops this pair (counted, never an error)."""

    def __init__(self, reason: str = "too_long"):
        super().__init__(reason)
        self.reason = reason

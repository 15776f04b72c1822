"""Settings of the data pipeline (the `data` section of RewardConfig)."""

from __future__ import annotations

from typing import ClassVar, Literal

from rewardax.sections import Section

TruncationMode = Literal["keep_end", "keep_start", "filter"]
OnInvalid = Literal["error", "skip"]
Layout = Literal["padded", "packed", "shared_prompt"]


class DataConfig(Section):
    """How preference rows become device batches."""

    section: ClassVar[str] = "data"

    max_sequence_length: int = 512
    """the most tokens one response (prompt + response) may take."""
    truncation_mode: TruncationMode = "keep_end"
    """`keep_end` cuts the prompt from the left and keeps the whole response with its reward token
    (a response longer than max_sequence_length alone keeps its last tokens, after BOS);
    `keep_start` keeps the first tokens and scores the last kept one; `filter` drops the pair.
    Cut pairs are counted (`truncated` in the data statistics and eval metrics).
    """
    on_invalid: OnInvalid = "error"
    """`error` stops at the first malformed row, naming file, row and field; `skip` drops it and
    counts it by reason.
    """
    append_eos: bool = True
    """append the tokenizer's EOS token to plain-text responses that do not end with it."""
    margin_from_scores: bool = False
    """when rows carry `score_chosen` / `score_rejected`, use their difference (times
    `margin_scale`) as the margin.
    """
    margin_scale: float = 1.0
    """factor applied to a margin built from scores."""
    num_workers: int = 0
    """Grain worker processes that tokenize rows (0 tokenizes in a thread of the main process).
    Workers start as fresh processes (seconds each) and pay off only with spare cores: on 2
    cores 0 is fastest, the tokenizer's batch call already uses both.
    """
    shuffle: bool = True
    """shuffle the training rows each epoch (seeded by RewardConfig.seed)."""
    length_group_window: int = 1024
    """rows drawn together and sorted by length before being cut into batches, so batches hold
    pairs of similar length (1 turns length grouping off). Larger windows pad less; a resumed
    run re-reads at most one window. Padded layout only: packed layouts mix lengths on purpose.
    """
    bucket_lengths: tuple[int, ...] = ()
    """the padded lengths a batch may have; empty means the default ladder (see
    buckets_per_octave). max_sequence_length is always included. Packed layouts: the row
    lengths, which may pass max_sequence_length (a row then holds several sequences; [192] packs
    8 VADER pairs into 3 or 4 rows); the longest row a sequence needs (max_row_length) is added
    when no given length reaches it.
    """
    buckets_per_octave: int = 4
    """the default ladder: this many equal steps per doubling (4: 8, 16, ..., 64, 80, 96, 112, 128,
    160, ...; 1: powers of two from 32), twice as many from 1024 tokens on (4: 1024, 1152, 1280,
    ...). Each distinct length a run meets is one XLA compilation: more rungs pad less but
    compile more programs.
    """
    prefetch: int = 2
    """batches prepared ahead of the training step."""
    layout: Layout = "padded"
    """how training pairs are laid out in a batch (evaluation always uses `padded`). `padded`: one
    row per response, padded to the batch's bucket length. `packed`: whole responses side by
    side in fewer rows, each attending only to itself (block-diagonal mask). `shared_prompt`:
    the prompt (the tokens chosen and rejected share at the start) is encoded once per pair and
    both responses attend to it; pays off when prompts are long. Rewards are the same in all
    three. packed and shared_prompt need one process; with gradient accumulation each
    microbatch is packed on its own.
    """

    @property
    def max_row_length(self) -> int:
        """The longest row a batch may have: max_sequence_length, or twice it for shared_prompt,
        whose rows hold a prompt and two responses."""
        return self.max_sequence_length * (2 if self.layout == "shared_prompt" else 1)

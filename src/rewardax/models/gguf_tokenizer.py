"""A ``transformers`` fast tokenizer rebuilt from a GGUF file's tokenizer metadata, without torch.

A GGUF file has no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, a type per
token and the special token ids as metadata (``tokenizer.ggml.*``). We read those with the ``gguf``
package, build the ``tokenizers.Tokenizer`` they describe and wrap it in
``transformers.PreTrainedTokenizerFast``. transformers can do this itself
(``from_pretrained(..., gguf_file=...)``), but from 5.x that path imports torch, which rewardax
never needs at run time.

The tokenizer is built the way transformers' GGUF converter builds it, so both give the same token
ids (``tests/test_gguf_tokenizer.py`` checks this against it). Two tokenizer models are rebuilt
(``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3, Mistral Nemo's Tekken). How the text is
  split before BPE is named by ``tokenizer.ggml.pre``; see ``BYTE_LEVEL_SPLITS``.
* ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral 7B).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rewardax.errors import ModelLoadError

# llama.cpp's token types (gguf.TokenType) of the entries that are not plain text.
_CONTROL = 3  # special, such as <|im_start|>: matched whole, dropped by skip_special_tokens
_USER_DEFINED = 4  # added, such as <think>: matched whole, kept when decoding

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# As Llama 3's, but digits one at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> the regex that cuts text into words before byte-level BPE, as the
# vocabulary's own tokenizer.json did when its merges were learned. None is GPT-2's regex, which
# the ByteLevel pre-tokenizer applies itself. A name not listed here is refused rather than guessed:
# the wrong split gives plausible-looking but different ids.
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "gpt-2": None,
    # llama.cpp cuts digits one by one before GPT-2's regex here; transformers' GGUF converter
    # does not, and we follow it so the ids stay those rewardax has always produced. SmolLM2 has
    # no merge involving a digit, so the two differ only where a run of spaces comes before a
    # digit ("a  1": a Ġ Ġ 1 here, a ĠĠ 1 in llama.cpp).
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}

# SentencePiece (``llama``) vocabularies are rebuilt for these architectures only; Gemma and Phi-3
# files spell spaces differently and need converters of their own.
SENTENCEPIECE_ARCHITECTURES = ("llama", "mistral")

# Attribute of PreTrainedTokenizerFast -> the GGUF key holding that token's id.
_NAMED_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

_USE_HF_DIRECTORY = (
    "pass the model's Hugging Face tokenizer directory instead (`--tokenizer` on the command line)"
)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """``PreTrainedTokenizerFast`` rebuilt from a ``.gguf`` file's tokenizer metadata.

    Args:
      path: a GGUF file, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Returns:
      The tokenizer, with the bos/eos/unk/pad tokens the file names (None where it names none),
      BOS/EOS added as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say, and the file's chat
      template. For SmolLM2: ``tok("Hi!")["input_ids"] == [26843, 17]``, ``tok.bos_token ==
      "<|im_start|>"``, ``tok.eos_token == tok.pad_token == "<|im_end|>"``.

    Raises:
      ModelLoadError: the file cannot be read as GGUF, has no tokenizer, or describes one this
        module does not rebuild.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    metadata = read_tokenizer_metadata(path)
    backend = build_tokenizer(metadata, path)
    tokens = metadata["tokenizer.ggml.tokens"]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        # The backend already adds BOS/EOS; these make `tok.add_bos_token` say so (transformers 5
        # then rebuilds the same post-processor from them).
        add_bos_token=_adds_bos(metadata),
        add_eos_token=_adds_eos(metadata),
        **_named_tokens(metadata, tokens, path),
    )


def read_tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, and ``general.architecture``, as Python values."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"
        }
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({exc}).") from exc
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            f"{path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens); {_USE_HF_DIRECTORY}."
        )
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens."
        )
    return metadata


def build_tokenizer(metadata: dict[str, Any], path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` the metadata describes, with its special and added tokens.

    Args:
      metadata: ``read_tokenizer_metadata(path)``.
      path: the file, named in errors.
    """
    from tokenizers import AddedToken

    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(metadata, path)
        # A byte-level vocabulary spells every token in the 256-character byte alphabet. A CONTROL
        # token outside it is a llama.cpp mislabel; adding it would create an id past the end of
        # the model's embedding, so it stays out (transformers skips it too).
        alphabet: set[str] | None = set(_byte_alphabet().values())
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata, path)
        alphabet = None
    else:
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
            f"rewardax rebuilds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) tokenizers; "
            f"{_USE_HF_DIRECTORY}."
        )

    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    vocab = tokenizer.get_vocab()
    special = [
        token
        for token, kind in zip(tokens, types, strict=True)
        if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    named = [token for token in _named_tokens(metadata, tokens, path).values() if token in vocab]
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in special + named]
    )
    # llama.cpp matches USER_DEFINED tokens whole in the text; as plain BPE they would be cut up.
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED and token in vocab
        ]
    )
    tokenizer.post_processor = _bos_eos_template(metadata, tokens, path)
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any], path: Path) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in BYTE_LEVEL_SPLITS:
        raise ModelLoadError(
            f"{path}: byte-level GGUF tokenizer with pre-tokenizer {pre!r} (tokenizer.ggml.pre) "
            f"is not supported, so how its text is cut into words is unknown; supported: "
            f"{', '.join(sorted(BYTE_LEVEL_SPLITS))}. Re-convert the model with a current "
            f"llama.cpp, or {_USE_HF_DIRECTORY}."
        )
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError(
            f"{path}: byte-level GGUF tokenizer without tokenizer.ggml.merges; {_USE_HF_DIRECTORY}."
        )
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # llama.cpp writes a few tokens as raw text; BPE matches byte-alphabet spellings only.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(metadata["tokenizer.ggml.tokens"])
    }
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_file_merges(metadata["tokenizer.ggml.merges"], path),
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = BYTE_LEVEL_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], path: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    architecture = metadata.get("general.architecture")
    if architecture not in SENTENCEPIECE_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: SentencePiece ('llama') GGUF tokenizer of architecture {architecture!r} is "
            f"not supported (only {', '.join(SENTENCEPIECE_ARCHITECTURES)}); {_USE_HF_DIRECTORY}."
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" in metadata:
        merges = _file_merges(metadata["tokenizer.ggml.merges"], path)
    elif "tokenizer.ggml.scores" in metadata:
        merges = merges_from_scores(tokens, metadata["tokenizer.ggml.scores"])
    else:
        raise ModelLoadError(
            f"{path}: SentencePiece GGUF tokenizer with neither tokenizer.ggml.merges nor "
            f"tokenizer.ggml.scores; {_USE_HF_DIRECTORY}."
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    # Byte fallback: a character missing from the vocabulary becomes its <0xNN> byte tokens.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    # SentencePiece writes spaces as "▁" and puts one before the text; llama.cpp skips that when
    # the file says add_space_prefix = false (transformers ignores the flag; files with it false
    # are rare, and then llama.cpp is the reference).
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    A token that is the concatenation of two vocabulary tokens is a merge of them, ranked by the
    token's score (SentencePiece BPE merges the highest-scoring pair first). Ties go to the longer
    left piece, then the longer right piece, then vocabulary order -- the order transformers uses,
    so both rank ties the same.

    Example: tokens ``["a", "b", "ab", "abb"]`` with scores ``[0, 0, -1, -2]`` give
    ``[("a", "b"), ("ab", "b")]``.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in pairs)
    # list.sort is stable: equal keys keep the vocabulary order built above.
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))
    return [(left, right) for left, right, _ in candidates]


def _file_merges(merges: Sequence[str], path: Path) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not (left and space and right) or " " in right:
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.merges entry {merge!r} is not two tokens separated by "
                "one space."
            )
        pairs.append((left, right))
    return pairs


def _named_tokens(metadata: dict[str, Any], tokens: Sequence[str], path: Path) -> dict[str, Any]:
    named: dict[str, Any] = {}
    for name, key in _NAMED_TOKEN_KEYS.items():
        index = metadata.get(key)
        if index is not None and not 0 <= int(index) < len(tokens):
            raise ModelLoadError(
                f"{path}: {key} = {index} is outside the vocabulary of {len(tokens)} tokens."
            )
        named[name] = None if index is None else tokens[int(index)]
    return named


def _bos_eos_template(metadata: dict[str, Any], tokens: Sequence[str], path: Path) -> Any:
    """``TemplateProcessing`` putting BOS/EOS around each sequence, as the file's flags ask.

    For SmolLM2 (neither flag) it adds nothing; for Llama 2 (BOS only) ``<s>:0 $A:0``.
    """
    from tokenizers import processors

    named = _named_tokens(metadata, tokens, path)
    wanted = [
        name
        for name, flag in (("bos_token", _adds_bos(metadata)), ("eos_token", _adds_eos(metadata)))
        if flag
    ]
    for name in wanted:
        if named[name] is None:
            raise ModelLoadError(
                f"{path}: the tokenizer asks to add its {name.removesuffix('_token').upper()} "
                f"token but names none ({_NAMED_TOKEN_KEYS[name]} is missing)."
            )

    def around(sequence: str, type_id: int) -> list[str]:
        bos = [f"{named['bos_token']}:{type_id}"] if "bos_token" in wanted else []
        eos = [f"{named['eos_token']}:{type_id}"] if "eos_token" in wanted else []
        return [*bos, f"${sequence}:{type_id}", *eos]

    return processors.TemplateProcessing(
        single=around("A", 0),
        pair=around("A", 0) + around("B", 1),
        special_tokens=[(named[name], int(metadata[_NAMED_TOKEN_KEYS[name]])) for name in wanted],
    )


def _adds_bos(metadata: dict[str, Any]) -> bool:
    # Older SentencePiece files have no flag; llama.cpp adds BOS to those, so do we.
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default))


def _adds_eos(metadata: dict[str, Any]) -> bool:
    return bool(metadata.get("tokenizer.ggml.add_eos_token", False))


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the other 68 take
    the characters from U+0100 on, in byte order, so every byte has a visible, unspaced spelling.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in table)
    table.update({byte: chr(256 + offset) for offset, byte in enumerate(shifted)})
    return table

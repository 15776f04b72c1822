"""load_tokenizer: a transformers fast tokenizer from a HF directory or a .gguf file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewardax.errors import ModelLoadError
from rewardax.hub import resolve_model_path
from rewardax.models.gguf_tokenizer import load_gguf_tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """A ``transformers`` fast tokenizer with its chat template.

    Args:
      path: a Hugging Face directory (tokenizer.json / tokenizer_config.json) or a ``.gguf``
        file (the tokenizer is rebuilt from its GGUF metadata by
        ``rewardax.models.gguf_tokenizer``, without torch; same ids as transformers' GGUF loader);
        or, when no such local path exists, a hub name ``org/name[@revision]`` /
        ``org/name/file.gguf`` (``rewardax.hub``).

    Returns:
      The tokenizer. If it has no pad token, the EOS token is set as pad token: rewardax reads
      rewards at the last position whose attention mask is 1, never by searching for the pad id,
      so pad == EOS is harmless (SmolLM2 ships that way).
    """
    path = resolve_model_path(path, kind="tokenizer")
    try:
        if path.is_file() and path.suffix == ".gguf":
            tok = load_gguf_tokenizer(path)
        elif path.is_dir():
            from transformers import AutoTokenizer

            # False, not the default None: None asks on a terminal whether to run the directory's
            # Python code (`auto_map`); rewardax never runs code shipped with a model.
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        else:
            raise ModelLoadError(f"{path}: pass a tokenizer directory or a .gguf file.")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({exc}).") from exc
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(
            f"{path}: only a slow (Python) tokenizer is available; need a fast one."
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok

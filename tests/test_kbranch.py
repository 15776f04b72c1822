"""The K-branch layout (`packing.pack_groups`): a prompt once, K responses as branches of one tree.

Every response's reward read from a packed K-branch batch must equal the reward of the same token
sequence encoded alone in a padded row (float32, <= 1e-5), for K = 2, 3, 4, rows holding one
group or several, groups of fewer than K responses, and every attention implementation; and no
response may see a sibling's tokens (checked bit for bit). Model: a tiny random llama
(`model_fixtures.scrambled_model`, O(0.1) weights so that layout bugs are not hidden by near-zero
outputs).

Measured on CPU (2026-12-06): the largest difference from the rewards alone was 1.7e-6, on
rewards of order 1 (up to 3.2).

Token saving (`test_token_saving_on_vader_groups_of_four`): VADER's train sentences, four to a
prompt (two pairs with the same prompt, 320 groups), SmolLM2-tokenized with its chat template,
8 groups a batch, max length 128. A sequence is 34.8 tokens on average, of which the shared prefix
is 10.0. The K-branch rows hold 0.784x the real tokens of the four sequences apart (the prefix
once instead of four times) and compute 0.474x the tokens of a padded [G, 4, T] batch (T the
smallest bucket holding the batch's longest sequence) and 0.786x those of packing the same
sequences without sharing the prompt.
"""

from __future__ import annotations

import json
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_fixtures import smollm2_tokenizer, tiny_llama
from model_fixtures import EOS, VOCAB, pad_rows, scrambled_model
from rewardax.data import (
    DataConfig,
    collate_records,
    default_bucket_lengths,
    group_row_lengths,
    pack_groups,
    pack_records,
    token_counts,
)
from rewardax.data.collate import RowProcessor
from rewardax.data.packing import choose_shape, row_ladder, shared_prompt_parts
from rewardax.errors import ConfigError
from rewardax.losses import masked_mean
from rewardax.models.transformer import attention_mask
from rewardax.ranking_losses import plackett_luce_loss
from rewardax.steps import group_logits, rewards_by_slot

ATOL = 1e-5  # float32, rewards of order 1


def group_rewards(model, batch):
    """The first head's reward [G, K] of a K-branch batch, as the group train step reads it."""
    return group_logits(model, batch)[..., 0]


def unit_model(kernels: str, arch: str = "llama"):
    """`scrambled_model`'s `arch` with its score head scaled by 1/sqrt(hidden): rewards of order 1
    (the scale `ATOL` is meant for), where its unit-variance head gives rewards of order 8."""
    model = scrambled_model(arch, kernels=kernels)
    kernel = model.score.kernel
    kernel[...] = kernel[...] / np.sqrt(kernel.shape[0])
    return model


@pytest.fixture(scope="module")
def model():
    return unit_model("cpu")


def random_groups(seed: int, sizes: list[int], prompt=(4, 12), response=(1, 8)) -> list[dict]:
    """Groups of `sizes[g]` token sequences sharing a random prompt, each ending with EOS, with
    `ranks` a random permutation. Responses may start with the same token (the shared prefix
    then reaches past the prompt) and one may be a prefix of another."""
    rng = np.random.default_rng(seed)
    groups = []
    for k in sizes:
        head = rng.integers(3, VOCAB, size=int(rng.integers(*prompt))).tolist()
        seqs = []
        for n in rng.integers(*response, size=k):
            seqs.append([*head, *rng.integers(3, VOCAB, size=int(n) - 1).tolist(), EOS])
        groups.append({"responses_input_ids": seqs, "ranks": rng.permutation(k).tolist()})
    return groups


def rewards_alone(model, groups: list[dict]) -> list[np.ndarray]:
    """Each sequence's reward from its own right-padded row (no packing, no branches)."""
    seqs = [s for g in groups for s in g["responses_input_ids"]]
    ids, mask = pad_rows(seqs, "right")
    flat = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits[:, 0])
    out, start = [], 0
    for g in groups:
        k = len(g["responses_input_ids"])
        out.append(flat[start : start + k])
        start += k
    return out


def check_layout(groups: list[dict], batch: dict) -> None:
    """Each response, read back through its reward slot (its segment's prompt, then its own
    branch up to its reward token), is its token sequence at positions 0, 1, ...; the reward
    token ends its branch; and the rows hold nothing else (a prompt counted once)."""
    slots = batch["reward_positions"].shape[1]
    real = 0
    for g, group in enumerate(groups):
        seqs = group["responses_input_ids"]
        for k, seq in enumerate(seqs):
            row, slot = divmod(int(batch["reward_slot"][g, k]), slots)
            end = int(batch["reward_positions"][row, slot])
            seg, branch = batch["segment_ids"][row], batch["branch_ids"][row]
            assert branch[end] == k + 1
            assert end + 1 == seg.size or (seg[end + 1], branch[end + 1]) != (seg[end], k + 1)
            sees = (seg == seg[end]) & ((branch == 0) | (branch == k + 1))
            take = np.flatnonzero(sees & (np.arange(seg.size) <= end))
            assert batch["input_ids"][row, take].tolist() == list(seq)
            assert batch["positions"][row, take].tolist() == list(range(len(seq)))
        real += sum(len(ids) for _, ids, _ in shared_prompt_parts(seqs))
    assert np.count_nonzero(batch["segment_ids"]) == real


def check_rewards(model, groups: list[dict], batch: dict) -> np.ndarray:
    """The packed batch's rewards [G, K] equal each sequence's reward alone; padding slots 0."""
    check_layout(groups, batch)
    got = np.asarray(group_rewards(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    want = rewards_alone(model, groups)
    assert got.shape == batch["response_mask"].shape
    for g, w in enumerate(want):
        np.testing.assert_allclose(got[g, : len(w)], w, atol=ATOL, rtol=0, err_msg=f"group {g}")
    assert np.all(got[batch["response_mask"] == 0] == 0.0)
    return got


def group_size_of(groups: list[dict]) -> list[int]:
    return [
        sum(len(ids) for _, ids, _ in shared_prompt_parts(g["responses_input_ids"])) for g in groups
    ]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_one_group_per_row(model, k):
    # Long prompts and short responses: any two groups together exceed the longest group, so
    # rows of that length hold one group each.
    groups = random_groups(k, [k] * 3, prompt=(20, 21), response=(2, 7))
    sizes = group_size_of(groups)
    assert 2 * min(sizes) > max(sizes)
    batch = pack_groups(groups, EOS, group_size=k, batch_size=3, row_lengths=(max(sizes),))
    assert batch["input_ids"].shape == (3, max(sizes))
    assert batch["segment_ids"].max(axis=1).tolist() == [1, 1, 1]
    check_rewards(model, groups, batch)
    assert set(np.unique(batch["branch_ids"][batch["segment_ids"] > 0])) == set(range(k + 1))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_several_groups_per_row(model, k):
    groups = random_groups(10 + k, [k] * 6)
    longest = max(group_size_of(groups))
    batch = pack_groups(
        groups, EOS, group_size=k, batch_size=8, row_lengths=(longest, 2 * longest, 3 * longest)
    )
    assert batch["segment_ids"].max() > 1  # a row holds several groups
    assert batch["input_ids"].shape[0] < 6
    check_rewards(model, groups, batch)
    np.testing.assert_array_equal(batch["row_mask"], [1.0] * 6 + [0.0] * 2)


@pytest.mark.parametrize(
    "kernels, arch",
    [
        ("cpu", "llama"),
        ("xla", "llama"),
        ("pallas", "llama"),
        ("cpu", "mistral"),
        ("pallas", "mistral"),
    ],
)
def test_groups_of_unequal_size_under_every_attention(kernels, arch):
    """Groups of 1 to 4 responses in a K = 4 batch with padding groups, on each attention
    implementation (`pallas`: the splash kernel in interpret mode, on a mask it builds from the
    branch ids). Mistral's sliding window (4 positions in the tiny config) counts positions,
    which continue from the prompt in every branch: the same keys as alone."""
    model = unit_model(kernels, arch)
    groups = random_groups(3, [1, 2, 3, 4, 2, 4])
    # A response that is a prefix of a sibling: the prompt stops one token short of its end.
    seqs = groups[2]["responses_input_ids"]
    seqs[1] = [*seqs[0], 17, EOS]
    batch = pack_groups(groups, EOS, group_size=4, batch_size=8, row_lengths=(32, 64))
    np.testing.assert_array_equal(batch["response_mask"].sum(axis=1), [1, 2, 3, 4, 2, 4, 0, 0])
    np.testing.assert_array_equal(batch["row_mask"], [1] * 6 + [0] * 2)
    for g, group in enumerate(groups):
        k = len(group["ranks"])
        np.testing.assert_array_equal(batch["ranks"][g, :k], group["ranks"])
        assert np.all(batch["ranks"][g, k:] == 0)
    assert batch["segment_ids"].max() > 1
    check_rewards(model, groups, batch)


def test_a_response_never_sees_a_sibling(model):
    """Changing one response's tokens (prompt and lengths kept, so the layout is the same)
    leaves every sibling's reward bit for bit unchanged, and changes its own."""
    groups = random_groups(7, [4, 3])
    batch = pack_groups(groups, EOS, group_size=4, batch_size=2, row_lengths=(64,))
    prompt = len(shared_prompt_parts(groups[0]["responses_input_ids"])[0][1])
    seq = groups[0]["responses_input_ids"][2]
    assert len(seq) - prompt >= 3
    changed = batch["input_ids"].copy()
    row, slot = divmod(int(batch["reward_slot"][0, 2]), batch["reward_positions"].shape[1])
    end = int(batch["reward_positions"][row, slot])
    changed[row, end - 2 : end + 1] = (changed[row, end - 2 : end + 1] + 5) % (VOCAB - 3) + 3
    run = lambda ids: np.asarray(  # noqa: E731
        group_rewards(model, {**{k: jnp.asarray(v) for k, v in batch.items()}, "input_ids": ids})
    )
    before, after = run(jnp.asarray(batch["input_ids"])), run(jnp.asarray(changed))
    siblings = np.ones((2, 4), bool)
    siblings[0, 2] = False
    assert np.array_equal(before[siblings], after[siblings])
    assert abs(before[0, 2] - after[0, 2]) > 1e-3  # control: the changed response's own reward


def test_listwise_loss_gradient_equals_padded():
    """Under jit, a Plackett-Luce loss on the K-branch batch's rewards has the gradient (every
    parameter) of the same loss on rewards read from one padded row per response: what a group
    train step (`steps.group_logits`) computes."""
    model = unit_model("cpu")
    groups = random_groups(21, [4, 2, 3, 4, 1])
    batch = pack_groups(groups, EOS, group_size=4, batch_size=6, row_lengths=(32, 64))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    seqs = [s for g in groups for s in g["responses_input_ids"]]
    ids, mask = pad_rows(seqs, "right")
    where = np.array([(g, k) for g, grp in enumerate(groups) for k in range(len(grp["ranks"]))])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(rewards):
        per_group = plackett_luce_loss(rewards, batch["ranks"], batch["response_mask"])
        return masked_mean(per_group, batch["row_mask"])

    def packed(p):
        return loss(group_rewards(nnx.merge(graphdef, p, rest), batch))

    def alone(p):
        flat = nnx.merge(graphdef, p, rest)(jnp.asarray(ids), jnp.asarray(mask)).logits[:, 0]
        return loss(jnp.zeros((6, 4)).at[where[:, 0], where[:, 1]].set(flat))

    with jax.default_matmul_precision("highest"):  # the TPU's default is bf16 passes
        got_loss, got = jax.jit(jax.value_and_grad(packed))(params)
        want_loss, want = jax.jit(jax.value_and_grad(alone))(params)
    assert float(want_loss) > 0.1
    np.testing.assert_allclose(got_loss, want_loss, atol=ATOL, rtol=0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_mask_of_four_branches():
    """`transformer.attention_mask` on one segment: prompt 0-1, branches 1..4, then padding."""
    branch = np.array([[0, 0, 1, 1, 2, 3, 3, 4, 0]])
    seg = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 0]])
    mask = np.asarray(
        attention_mask(jnp.asarray(seg), jnp.zeros_like(jnp.asarray(seg)), jnp.asarray(branch))
    )[0]
    for i in range(9):
        for j in range(9):
            want = j <= i and seg[0, i] == seg[0, j] != 0 and branch[0, j] in (0, branch[0, i])
            assert mask[i, j] == want, (i, j)


def test_documented_example_and_pair_packing_as_k_equal_2():
    batch = pack_groups(
        [
            {"responses_input_ids": [[5, 6, 7, 2], [5, 6, 9, 2], [5, 8, 2]], "ranks": [0, 1, 2]},
            {"responses_input_ids": [[4, 3, 2], [4, 9, 2]], "ranks": [1, 0]},
        ],
        pad_id=2,
        group_size=3,
        batch_size=2,
        row_lengths=(16,),
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2, 6, 9, 2, 8, 2, 4, 3, 2, 9, 2, 2, 2]]
    assert batch["branch_ids"].tolist() == [[0, 1, 1, 1, 2, 2, 2, 3, 3, 0, 1, 1, 2, 2, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 3, 1, 2, 3, 1, 2, 0, 1, 2, 1, 2, 0, 0]]
    assert batch["reward_positions"].tolist() == [[3, 6, 8, 11, 13, 0]]
    assert batch["reward_slot"].tolist() == [[0, 1, 2], [3, 4, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    # Several scores per response (named objectives) travel as [G, K, L].
    scored = pack_groups(
        [{"responses_input_ids": [[4, 3, 2], [4, 9, 2]], "scores": [[0.5, 1.0], [2.0, -1.0]]}],
        pad_id=2,
        group_size=3,
        batch_size=2,
        row_lengths=(16,),
    )
    assert scored["scores"].tolist() == [[[0.5, 1.0], [2.0, -1.0], [0, 0]], [[0, 0]] * 3]
    assert "ranks" not in scored
    # shared_prompt pairs are the K = 2 groups [chosen, rejected]: the same rows and slots.
    groups = random_groups(5, [2] * 5)
    pairs = [
        {"chosen_input_ids": np.array(c), "rejected_input_ids": np.array(r), "margin": 0.0}
        for c, r in (g["responses_input_ids"] for g in groups)
    ]
    kw = {"batch_size": 6, "row_lengths": (24, 48)}
    as_pairs = pack_records(pairs, EOS, layout="shared_prompt", **kw)
    as_groups = pack_groups(groups, EOS, group_size=2, **kw)
    for key in ("input_ids", "segment_ids", "positions", "branch_ids"):
        np.testing.assert_array_equal(as_pairs[key], as_groups[key])
    np.testing.assert_array_equal(as_pairs["reward_positions"], as_groups["reward_positions"])
    np.testing.assert_array_equal(as_pairs["reward_slot"], as_groups["reward_slot"])
    np.testing.assert_array_equal(as_pairs["pair_mask"], as_groups["row_mask"])


def test_bad_groups_are_refused():
    kw = {"group_size": 2, "batch_size": 2, "row_lengths": (16,)}
    with pytest.raises(ValueError, match="group 0 has 3 responses"):
        pack_groups([{"responses_input_ids": [[3, 2], [4, 2], [5, 2]]}], EOS, **kw)
    with pytest.raises(ValueError, match="group 0 has 0 responses"):
        pack_groups([{"responses_input_ids": []}], EOS, **kw)
    with pytest.raises(ValueError, match="ranks"):
        pack_groups([{"responses_input_ids": [[3, 2], [4, 2]], "ranks": [0]}], EOS, **kw)
    with pytest.raises(ValueError, match="group 1 has no `scores`"):
        pack_groups(
            [
                {"responses_input_ids": [[3, 2], [4, 2]], "scores": [0.5, 1.0]},
                {"responses_input_ids": [[3, 2]]},
            ],
            EOS,
            **kw,
        )
    with pytest.raises(ValueError, match="3 groups do not fit"):
        pack_groups([{"responses_input_ids": [[3, 2]]}] * 3, EOS, **kw)


def test_rewards_by_slot_masks_padding_slots_and_their_gradient():
    logits = jnp.array([[[0.5], [-1.0], [2.0]]])
    slot = jnp.array([[2, 0], [1, 0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    got = rewards_by_slot(logits, slot, mask)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got[..., 0], [[2.0, 0.5], [-1.0, 0.0]])
    # Slot 0 is read twice, once for a padding slot: only the real read reaches its gradient.
    grad = jax.grad(lambda x: jnp.sum(rewards_by_slot(x, slot, mask) * 3.0))(logits)
    np.testing.assert_array_equal(grad[0, :, 0], [3.0, 3.0, 3.0])
    with pytest.raises(ConfigError, match=r"\[R, S, L\]"):
        rewards_by_slot(logits[..., 0], slot, mask)
    with pytest.raises(ConfigError, match=r"\[G, K\]"):
        rewards_by_slot(logits, slot, mask[:, :1])


def vader_groups(tokenizer, max_len: int) -> list[dict]:
    """VADER train pairs two at a time with the same prompt -> groups of 4 tokenized sequences
    (chat template applied to each response as in a pair row), ranked by their human rating."""
    path = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"
    with open(str(path), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    processor = RowProcessor(tokenizer, DataConfig(max_sequence_length=max_len))
    records = processor.process_many(rows, range(len(rows)), lambda i: f"row {i}")
    groups = []
    for i in range(0, len(rows) - 1, 2):
        a, b = rows[i], rows[i + 1]
        if a["prompt"] != b["prompt"] or "dropped" in records[i] or "dropped" in records[i + 1]:
            continue
        seqs = [
            records[j][side].tolist()
            for j in (i, i + 1)
            for side in ("chosen_input_ids", "rejected_input_ids")
        ]
        scores = [a["score_chosen"], a["score_rejected"], b["score_chosen"], b["score_rejected"]]
        groups.append({"responses_input_ids": seqs, "scores": scores})
    return groups


@pytest.mark.slow  # 11 s over the whole VADER file
def test_token_saving_on_vader_groups_of_four():
    """Computed tokens of K-branch rows against a padded [G, K, T] batch (T: the smallest bucket
    holding the batch's longest sequence) and against packing the sequences without sharing the
    prompt, 8 groups a batch over the whole file; then one batch's rewards on a tiny llama with
    SmolLM2's vocabulary against each sequence alone."""
    tokenizer = smollm2_tokenizer()
    max_len, k, g = 128, 4, 8
    groups = vader_groups(tokenizer, max_len)
    assert len(groups) > 100
    pad = tokenizer.pad_token_id
    buckets = default_bucket_lengths(max_len)
    unshared_lengths = default_bucket_lengths(max_len, longer_rows=True)
    lengths = group_row_lengths(DataConfig(max_sequence_length=max_len), k)
    assert lengths[-1] == k * max_len  # holds any group
    real = {"padded": 0, "unshared": 0, "kbranch": 0}
    computed = dict.fromkeys(real, 0)
    for start in range(0, len(groups), g):
        chunk = groups[start : start + g]
        seqs = [s for grp in chunk for s in grp["responses_input_ids"]]
        t = next(b for b in buckets if b >= max(map(len, seqs)))
        real["padded"] += sum(map(len, seqs))
        computed["padded"] += g * k * t
        r, t_rows, _ = choose_shape([len(s) for s in seqs], unshared_lengths, row_ladder(len(seqs)))
        real["unshared"] += sum(map(len, seqs))
        computed["unshared"] += r * t_rows
        batch = pack_groups(chunk, pad, group_size=k, batch_size=g, row_lengths=lengths)
        got_real, got_computed = token_counts(batch)
        real["kbranch"] += got_real
        computed["kbranch"] += got_computed
    saving = {
        "computed vs padded": computed["kbranch"] / computed["padded"],
        "computed vs unshared packing": computed["kbranch"] / computed["unshared"],
        "real tokens kept": real["kbranch"] / real["padded"],
    }
    print({key: round(v, 3) for key, v in saving.items()})
    assert saving["computed vs padded"] < 0.7
    assert saving["computed vs unshared packing"] < 0.9
    assert saving["real tokens kept"] < 0.85

    model = tiny_llama(tokenizer)
    chunk = groups[:g]
    batch = pack_groups(chunk, pad, group_size=k, batch_size=g, row_lengths=lengths)
    np.testing.assert_array_equal(
        batch["scores"], np.array([grp["scores"] for grp in chunk], np.float32)
    )
    got = np.asarray(group_rewards(model, {key: jnp.asarray(v) for key, v in batch.items()}))
    pairs = [
        {"chosen_input_ids": np.array(s), "rejected_input_ids": np.array(s), "margin": 0.0}
        for grp in chunk
        for s in grp["responses_input_ids"]
    ]
    padded = collate_records(pairs, pad, buckets, len(pairs))
    out = model(
        jnp.asarray(padded["input_ids"][:, 0]),
        jnp.asarray(padded["attention_mask"][:, 0]),
        reward_positions=jnp.asarray(padded["reward_index"][:, 0]),
    )
    want = np.asarray(out.logits[:, 0]).reshape(g, k)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)

"""The loader: resume, process slices, eval coverage, sources, malformed files, workers."""

import json

import numpy as np
import pytest

from data_fixtures import smollm2_tokenizer
from rewardax.data import (
    DataConfig,
    PreferenceLoader,
    ShardedDataSource,
    iterate_eval_batches,
    load_source,
)
from rewardax.errors import CheckpointError, DataError


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def make_rows(n):
    return [
        {
            "prompt": f"Q{i}: ",
            "chosen": "good " * (i % 7 + 1),
            "rejected": "bad " * (i % 5 + 1),
            "margin": i / 8,
        }
        for i in range(n)
    ]


def equal(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


CFG = DataConfig(max_sequence_length=64, length_group_window=12, bucket_lengths=(8, 16, 32, 64))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_continues_at_exact_next_batch(tok, prefetch):
    cfg = DataConfig(**{**CFG.__dict__, "prefetch": prefetch})
    rows = make_rows(37)
    loader = PreferenceLoader(rows, tok, cfg, batch_size=4, seed=3, num_epochs=3)
    it = iter(loader)
    for _ in range(11):  # ends inside a window of the second epoch
        next(it)
    state = json.loads(json.dumps(loader.get_state()))
    rest = list(it)
    fresh = PreferenceLoader(rows, tok, cfg, batch_size=4, seed=3, num_epochs=3)
    fresh.set_state(state)
    again = list(fresh)
    assert len(again) == len(rest) > 0 and all(
        equal(a, b) for a, b in zip(rest, again, strict=True)
    )
    assert fresh.stats.as_dict() == loader.stats.as_dict()
    assert loader.epoch == 3 and loader.stats.pairs_seen == 4 * (11 + len(rest))
    other = PreferenceLoader(rows, tok, cfg, batch_size=8, seed=3)
    with pytest.raises(CheckpointError, match="batch_size"):
        other.set_state(state)


def test_epochs_reshuffle_deterministically_and_lengths_group(tok):
    rows = make_rows(48)

    def margins(seed):
        loader = PreferenceLoader(rows, tok, CFG, batch_size=4, seed=seed, num_epochs=2)
        return [tuple(b["margin"]) for b in loader]

    first = margins(0)
    assert first == margins(0) and first != margins(1)
    assert sorted(x for m in first[:12] for x in m) == sorted(
        i / 8 for i in range(48)
    )  # epoch 1 = every row
    assert first[:12] != first[12:]  # epoch 2 has another order
    fine = DataConfig(**{**CFG.__dict__, "bucket_lengths": tuple(range(4, 65, 2))})
    loader = PreferenceLoader(rows, tok, fine, batch_size=4, seed=0, num_epochs=1)
    grouped = [
        b["attention_mask"].sum(-1).max() - b["attention_mask"].sum(-1).min() for b in loader
    ]
    plain = PreferenceLoader(
        rows,
        tok,
        DataConfig(**{**fine.__dict__, "length_group_window": 1}),
        batch_size=4,
        seed=0,
        num_epochs=1,
    )
    spread = [b["attention_mask"].sum(-1).max() - b["attention_mask"].sum(-1).min() for b in plain]
    assert np.mean(grouped) < np.mean(spread)
    assert loader.stats.padding_efficiency > plain.stats.padding_efficiency


def test_process_slices_are_disjoint_and_complete(tok):
    rows = make_rows(23)
    seen = []
    for pi in range(3):
        loader = PreferenceLoader(
            rows,
            tok,
            CFG,
            batch_size=2,
            seed=5,
            process_index=pi,
            process_count=3,
            num_epochs=1,
            drop_remainder=False,
        )
        seen.append(
            [m for b in loader for m, keep in zip(b["margin"], b["pair_mask"], strict=True) if keep]
        )
    flat = [x for s in seen for x in s]
    assert len(flat) == 23 and sorted(flat) == sorted(i / 8 for i in range(23))


def test_eval_sees_every_pair_once_in_fixed_order(tok):
    rows = make_rows(29)
    rows[4] = {"chosen": "same", "rejected": "same"}
    cfg = DataConfig(**{**CFG.__dict__, "on_invalid": "skip"})
    batches = list(iterate_eval_batches(rows, tok, cfg, batch_size=8))
    index = np.concatenate([b["row_index"] for b in batches])
    mask = np.concatenate([b["pair_mask"] for b in batches])
    assert sorted(index[mask == 1].tolist()) == [i for i in range(29) if i != 4]
    assert (index[mask == 0] == -1).all() and len(index) % 8 == 0
    again = list(iterate_eval_batches(rows, tok, cfg, batch_size=8))
    assert all(equal(a, b) for a, b in zip(batches, again, strict=True))


def test_sources_files_globs_dirs_and_datasets(tok, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(rows[3:]))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    (tmp_path / "d.csv").write_text(
        "chosen,rejected\n" + "".join(f"{r['chosen']},{r['rejected']}\n" for r in rows)
    )
    assert len(ShardedDataSource(tmp_path)) == 18
    assert len(load_source(str(tmp_path / "*.json*"))) == 6
    assert (
        load_source(tmp_path / "c.parquet")[2] == rows[2]
        and load_source(str(tmp_path / "d.csv"))[5] == rows[5]
    )
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert load_source(arrow)[1] == rows[1]
    for source in (ds, ds.to_iterable_dataset(), rows, str(tmp_path / "a.jsonl")):
        batches = list(iterate_eval_batches(source, tok, CFG, batch_size=4))
        assert sum(int(b["pair_mask"].sum()) for b in batches) == (
            3 if isinstance(source, str) else 6
        )


def test_malformed_json_line_names_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"chosen": "a", "rejected": "b"}\n{"chosen": "c", oops}\n{"chosen": "d", "rejected": "e"}\n'
    )
    with pytest.raises(DataError, match=r"bad\.jsonl:2 \(row 1\)"):
        list(iterate_eval_batches(path, tok, CFG, batch_size=2))
    loader = PreferenceLoader(
        path,
        tok,
        DataConfig(**{**CFG.__dict__, "on_invalid": "skip"}),
        batch_size=2,
        seed=0,
        num_epochs=1,
    )
    assert sum(int(b["pair_mask"].sum()) for b in loader) == 2 and loader.stats.dropped == {
        "malformed_json": 1
    }


def test_workers_give_the_same_batches(tok):
    rows = make_rows(30)
    cfg = DataConfig(**{**CFG.__dict__, "num_workers": 2})
    with_workers = list(PreferenceLoader(rows, tok, cfg, batch_size=4, seed=2, num_epochs=1))
    in_process = list(PreferenceLoader(rows, tok, CFG, batch_size=4, seed=2, num_epochs=1))
    assert len(with_workers) == 7 and all(
        equal(a, b) for a, b in zip(with_workers, in_process, strict=True)
    )


def varied_rows(n):
    # Lengths from a few to ~60 tokens, chosen and rejected independent, like real preference data.
    rng = np.random.default_rng(0)
    return [
        {
            "prompt": "Say something. ",
            "chosen": " ".join(["good"] * int(rng.integers(1, 50))),
            "rejected": " ".join(["bad"] * int(rng.integers(1, 50))),
            "margin": float(i),
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunk_size_changes_nothing_even_across_epochs_and_resume(tok, monkeypatch, chunk):
    import rewardax.data.loader as loader_module

    rows = make_rows(37)
    rows[5] = {"chosen": "same", "rejected": "same"}  # dropped: counted in whichever chunk holds it
    cfg = DataConfig(**{**CFG.__dict__, "on_invalid": "skip", "prefetch": 0})

    def run(state=None, take=None):
        loader = PreferenceLoader(rows, tok, cfg, batch_size=4, seed=1, num_epochs=2)
        if state is not None:
            loader.set_state(state)
        out = []
        for batch in loader:
            out.append(batch)
            if take is not None and len(out) == take:
                break
        return out, loader

    reference, ref_loader = run()
    monkeypatch.setattr(loader_module, "_CHUNK_ROWS", chunk)
    small, small_loader = run()
    assert len(small) == len(reference) == 18
    assert all(equal(a, b) for a, b in zip(small, reference, strict=True))
    assert small_loader.stats.as_dict() == ref_loader.stats.as_dict()
    assert small_loader.stats.dropped == {"identical": 2}
    # Resume from a position that is not a chunk boundary.
    _, part = run(take=5)
    rest, _ = run(state=json.loads(json.dumps(part.get_state())))
    assert all(equal(a, b) for a, b in zip(rest, reference[5:], strict=True))
    assert len(rest) == len(reference) - 5


def test_default_ladder_pads_each_batch_to_its_rung(tok):
    """Properties of the bucket ladder that hold by construction, on varied lengths: each batch is
    padded to the smallest rung holding its longest sequence, a rung is less than one ladder step
    above it (a quarter of an octave, from 32 tokens on; 8 tokens below), and on the same batches
    the default ladder never pads more than the old (64, 128) buckets, which it contains."""
    rows = varied_rows(512)
    config = DataConfig(max_sequence_length=128)
    loader = PreferenceLoader(rows, tok, config, batch_size=8, seed=0, num_epochs=1)
    batches = list(loader)
    assert {64, 128} <= set(loader.buckets)
    real = computed = bound = 0
    for batch in batches:
        lengths = batch["attention_mask"].sum(-1)  # [B, 2]
        longest, t = int(lengths.max()), batch["input_ids"].shape[-1]
        assert t == min(b for b in loader.buckets if b >= longest)
        step = max(1 << (longest.bit_length() - 1), 32) // config.buckets_per_octave
        assert t < longest + step
        real += int(lengths.sum())
        computed += batch["attention_mask"].size
        bound += batch["attention_mask"][..., 0].size * (longest + step)
    assert loader.stats.padding_efficiency == pytest.approx(real / computed, rel=1e-12)
    assert loader.stats.padding_efficiency > real / bound
    # The old default buckets on the very same batches (grouping does not look at buckets).
    old = PreferenceLoader(
        rows,
        tok,
        DataConfig(max_sequence_length=128, bucket_lengths=(64, 128)),
        batch_size=8,
        seed=0,
        num_epochs=1,
    )
    old_batches = list(old)
    assert len(old_batches) == len(batches)
    for new_batch, old_batch in zip(batches, old_batches, strict=True):
        np.testing.assert_array_equal(new_batch["margin"], old_batch["margin"])  # same pairs
        assert new_batch["input_ids"].shape[-1] <= old_batch["input_ids"].shape[-1]
    assert old.stats.real_tokens == loader.stats.real_tokens
    # Strictly better here: some batch's longest sequence is under 56 tokens (a rung below 64).
    assert any(int(b["attention_mask"].sum(-1).max()) <= 56 for b in batches)
    assert loader.stats.padding_efficiency > old.stats.padding_efficiency


def test_dropped_remainder_is_random_not_the_longest_pairs():
    from rewardax.data.batching import group_by_length

    records = [
        {"chosen_input_ids": np.zeros(n, np.int32), "rejected_input_ids": np.zeros(1, np.int32)}
        for n in range(1, 38)
    ]
    longest_dropped = 0
    for seed in range(20):
        groups = group_by_length(records, 4, np.random.default_rng(seed))
        assert [len(g) for g in groups] == [4] * 9 + [1]
        assert sorted(len(r["chosen_input_ids"]) for g in groups for r in g) == list(range(1, 38))
        longest_dropped += len(groups[-1][0]["chosen_input_ids"]) == 37
    assert longest_dropped < 5  # cut from the sorted end it would be 20 of 20
    # Without an rng (eval: nothing is dropped) the batches stay sorted, the partial one last.
    plain = group_by_length(records, 4, None)
    assert [len(r["chosen_input_ids"]) for r in plain[-1]] == [37]

"""The HTML report: files written, images that show something, links, escaping, atomic replace.

Over 500 lines: one report is built per module fixture and every section of it is checked here,
so the fixtures and their checks stay together.
"""

import html
import re
import sys

import numpy as np
import pytest

from rewardax import report as report_module
from rewardax.errors import ConfigError, DataError
from rewardax.evaluation import preference_metrics
from rewardax.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _eval_data(seed: int = 0, n: int = 64):
    rng = np.random.default_rng(seed)
    chosen_lengths = rng.integers(5, 60, n)
    rejected_lengths = rng.integers(5, 60, n)
    chosen = rng.normal(1.0, 1.0, n)
    rejected = rng.normal(-1.0, 1.0, n)
    return chosen, rejected, chosen_lengths, rejected_lengths


def _training_rows():
    rows = []
    for step in range(1, 31):
        rows.append(
            {"step": step, "split": "train", "loss": 0.7 / step, "accuracy": 0.5 + step / 60}
        )
        if step % 10 == 0:
            rows.append(
                {"step": step, "split": "eval/heldout", "loss": 0.8 / step, "accuracy": 0.7}
            )
    rows.append({"step": 30, "split": "train", "learning_rate": 1e-5})  # other metrics: ignored
    return rows


def _full_report(path, **kwargs):
    chosen, rejected, cl, rl = _eval_data()
    metrics = preference_metrics(chosen, rejected, chosen_lengths=cl, rejected_lengths=rl)
    return write_report(
        path,
        metrics={"heldout": metrics},
        chosen={"heldout": chosen},
        rejected={"heldout": rejected},
        chosen_lengths={"heldout": cl},
        rejected_lengths={"heldout": rl},
        training_metrics=_training_rows(),
        **kwargs,
    )


def _linked_images(index_html: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', index_html)


def test_report_writes_html_and_readable_pngs(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    out = _full_report(tmp_path / "report")
    assert out == (tmp_path / "report").resolve()
    expected = {
        "training_curves.png",
        "reward_histograms.png",
        "reward_vs_length.png",
        "calibration.png",
    }
    assert {p.name for p in out.iterdir()} == expected | {"index.html"}
    for name in expected:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        pixels = image.imread(out / name)
        height, width = pixels.shape[:2]
        assert height >= 300 and width >= 500, (name, pixels.shape)
        assert float(pixels[..., :3].std()) > 0.05, name  # a drawn plot, not a blank canvas
    page = (out / "index.html").read_text(encoding="utf-8")
    assert sorted(_linked_images(page)) == sorted(expected)
    # Key numbers appear in the summary table.
    assert "Accuracy (ties count ½)" in page
    assert "Spearman ρ(reward, length)" in page
    # No temporary build directory is left next to the report.
    assert [p.name for p in tmp_path.iterdir()] == ["report"]


def test_optional_plots_are_left_out_and_not_linked(tmp_path):
    pytest.importorskip("matplotlib")
    chosen, rejected, _, _ = _eval_data(n=10)
    out = write_report(
        tmp_path / "r",
        metrics=preference_metrics(chosen, rejected),
        chosen=chosen,
        rejected=rejected,
    )
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["calibration.png", "reward_histograms.png"]
    page = (out / "index.html").read_text(encoding="utf-8")
    assert sorted(_linked_images(page)) == pngs
    assert "Spearman" not in page


def test_several_eval_sets_and_subsets(tmp_path):
    pytest.importorskip("matplotlib")
    a = _eval_data(seed=1, n=20)
    b = _eval_data(seed=2, n=12)
    metrics = {
        "easy": preference_metrics(a[0], a[1], subsets=["x"] * 10 + ["y"] * 10),
        "hard": preference_metrics(b[0], b[1], chosen_lengths=b[2], rejected_lengths=b[3]),
    }
    out = write_report(
        tmp_path / "r",
        metrics=metrics,
        chosen={"easy": a[0], "hard": b[0]},
        rejected={"easy": a[1], "hard": b[1]},
        chosen_lengths={"hard": b[2]},
        rejected_lengths={"hard": b[3]},
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<th>easy</th><th>hard</th>" in page
    assert "easy: accuracy per subset" in page
    assert "hard: accuracy by length difference" in page
    assert (out / "reward_vs_length.png").exists()
    with pytest.raises(ConfigError, match="dict keyed by the same names"):
        write_report(tmp_path / "r2", metrics=metrics, chosen=a[0], rejected=a[1])


def test_text_is_escaped(tmp_path):
    pytest.importorskip("matplotlib")
    chosen, rejected, _, _ = _eval_data(n=8)
    name = 'set <b>"1"</b> & $x$'
    metrics = preference_metrics(chosen, rejected, subsets=["<script>alert(1)</script>"] * 8)
    out = write_report(
        tmp_path / "r",
        metrics={name: metrics},
        chosen={name: chosen},
        rejected={name: rejected},
        title="<script>alert('title')</script>",
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<script>" not in page
    assert "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;title&#x27;)&lt;/script&gt;" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "set &lt;b&gt;&quot;1&quot;&lt;/b&gt; &amp; $x$" in page


def test_refuses_to_overwrite_unless_asked(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "report"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        _full_report(target)
    assert (target / "notes.txt").read_text() == "keep me"
    _full_report(target, overwrite=True)
    assert not (target / "notes.txt").exists()
    assert (target / "index.html").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # old copy and temp dir removed


def test_empty_existing_dir_is_fine(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "report").mkdir()
    assert (_full_report(tmp_path / "report") / "index.html").exists()


def test_failure_leaves_no_half_report(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    target = tmp_path / "report"
    target.mkdir()
    (target / "index.html").write_text("previous report")

    def broken(*args, **kwargs):
        raise RuntimeError("disk full while drawing")

    monkeypatch.setattr(report_module, "_plot_calibration", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        _full_report(target, overwrite=True)
    # The previous report is untouched and no temporary directory is left behind.
    assert (target / "index.html").read_text() == "previous report"
    assert [p.name for p in target.iterdir()] == ["index.html"]
    assert [p.name for p in tmp_path.iterdir()] == ["report"]
    with pytest.raises(RuntimeError):
        _full_report(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    with pytest.raises(ConfigError, match=r"pip install 'rewardax\[report\]'"):
        _full_report(tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_bad_inputs(tmp_path):
    pytest.importorskip("matplotlib")
    chosen, rejected, _, _ = _eval_data(n=8)
    metrics = preference_metrics(chosen, rejected)
    with pytest.raises(DataError, match="chosen for eval set 'eval' has 7 values"):
        write_report(tmp_path / "a", metrics=metrics, chosen=chosen[:7], rejected=rejected)
    with pytest.raises(DataError, match="training_metrics row 0 needs 'step' and 'split'"):
        write_report(
            tmp_path / "b",
            metrics=metrics,
            chosen=chosen,
            rejected=rejected,
            training_metrics=[{"loss": 1.0}],
        )
    with pytest.raises(ConfigError, match="preference_metrics"):
        write_report(tmp_path / "c", metrics={"x": 1}, chosen=chosen, rejected=rejected)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        write_report(tmp_path / "file", metrics=metrics, chosen=chosen, rejected=rejected)


# ------------------------------------------------------------------- numbers, run, before/after

ALLOWED_NUMBER = re.compile(
    r"-?\d{1,3}(,\d{3})*"  # count
    r"|[+-]?\d+\.\d{4}"  # score (a change carries its sign)
    r"|-?\d+\.\d"  # seconds, rate, length
    r"|[+-]?\d\.\d{3}e[+-]\d\d"  # very large or very small
)


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        (-0.002509, "auto", "-0.0025"),
        (0.03343, "auto", "0.0334"),
        (np.float32(0.5), "auto", "0.5000"),
        (1.0, "score", "1.0000"),
        (12345, "auto", "12,345"),
        (np.int64(1234567), "auto", "1,234,567"),
        (1000.0, "count", "1,000"),
        (2.5, "count", "2.5000"),
        (1e-5, "score", "1.000e-05"),
        (-3.2e-7, "auto", "-3.200e-07"),
        (1e-4, "score", "0.0001"),
        (999_999.5, "score", "999999.5000"),
        (2.5e6, "rate", "2.500e+06"),
        (0.0, "auto", "0.0000"),
        (-0.0, "score", "0.0000"),
        (3725.44, "seconds", "3725.4"),
        (9.41, "rate", "9.4"),
        (33.75, "length", "33.8"),
        (12, "seconds", "12.0"),
        (float("nan"), "score", "nan"),
        (None, "auto", "—"),
        (True, "auto", "True"),
        ("linear", "auto", "linear"),
    ],
)
def test_format_number(value, kind, expected):
    assert report_module.format_number(value, kind) == expected


def test_format_number_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind 'percent'"):
        report_module.format_number(0.5, "percent")


def _numeric_cells(page: str) -> list[str]:
    """Every number written in a table cell (composite cells split at ±, / and –)."""
    found = []
    for cell in re.findall(r"<td>([^<]*)</td>", page):
        for token in re.split(r" ± | / |–", html.unescape(cell)):
            if re.fullmatch(r"[-+\d.,e]*\d[-+\d.,e]*", token):
                found.append(token)
    return found


def test_every_table_number_follows_one_rule(tmp_path):
    pytest.importorskip("matplotlib")
    out = _full_report(tmp_path / "r")
    page = (out / "index.html").read_text(encoding="utf-8")
    cells = _numeric_cells(page)
    assert len(cells) > 40  # summary, length buckets and calibration bins were all read
    assert [c for c in cells if not ALLOWED_NUMBER.fullmatch(c)] == []
    assert "<td>0.5000–0.5500</td>" in page  # first calibration bin, edges as scores


RUN = {
    "name": "20250101-abc123",
    "started": "2025-01-01T12:00:00+00:00",
    "run_dir": "/runs/20250101-abc123",
    "model": "/models/SmolLM2-135M",
    "train_data": ["data/train.jsonl", "data/more.jsonl"],
    "eval_data": {"heldout": "data/heldout.jsonl"},
    "train_pairs": 12345,
    "steps": 1000,
    "learning_rate": 1e-5,
    "lr_schedule": "cosine",
    "batch_size": 32,
    "wall_time_s": 3725.44,
    "pairs_per_s": 9.41,
    "export_dir": "/runs/my run/<export>",
    "normalization": {"mean": 0.1234, "std": 1.5},
}


def _run_rows(page: str) -> list[tuple[str, str]]:
    table = re.search(r'<table class="facts"><tbody>(.*?)</tbody></table>', page).group(1)
    return re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table)


def test_run_section_lists_the_run_in_order_and_how_to_use_the_export(tmp_path):
    pytest.importorskip("matplotlib")
    page = (_full_report(tmp_path / "r", run=RUN) / "index.html").read_text(encoding="utf-8")
    rows = _run_rows(page)
    assert [label for label, _ in rows] == [
        "Run",
        "Started",
        "Run directory",
        "Model",
        "Training data",
        "Eval data",
        "Training pairs",
        "Steps",
        "Batch size (pairs per step)",
        "Learning rate (peak)",
        "Learning-rate schedule",
        "Wall time",
        "Throughput (pairs/s)",
        "Exported model",
        "Reward normalization",
    ]  # the fixed order, keys not given (seed, dtype, ...) left out
    values = dict(rows)
    assert values["Model"] == "<code>/models/SmolLM2-135M</code>"
    assert (
        values["Training data"] == "<code>data/train.jsonl</code><br><code>data/more.jsonl</code>"
    )
    assert values["Eval data"] == "heldout: <code>data/heldout.jsonl</code>"
    assert values["Learning rate (peak)"] == "1.000e-05"
    assert values["Training pairs"] == "12,345"
    assert values["Wall time"] == "3725.4 s (1:02:05)"
    assert values["Throughput (pairs/s)"] == "9.4"
    assert values["Reward normalization"].startswith("mean 0.1234, std 1.5000")
    assert "Model SmolLM2-135M, trained 1,000 steps on 12,345 training pairs." in page
    # The usage commands quote the path for the shell, then escape it for HTML.
    quoted = "&#x27;/runs/my run/&lt;export&gt;&#x27;"
    assert f"rewardax score --model {quoted} --input rows.jsonl --output scored.jsonl" in page
    assert f"rewardax eval --model {quoted} --data pairs.jsonl" in page
    assert "path = &quot;/runs/my run/&lt;export&gt;&quot;" in page
    assert "AutoModelForSequenceClassification.from_pretrained(path)" in page
    assert "AutoTokenizer.from_pretrained(path)" in page
    assert ".logits[0, 0]" in page
    assert "<export>" not in page


def test_usage_section_needs_an_export_and_run_rejects_unknown_keys(tmp_path):
    pytest.importorskip("matplotlib")
    run = {k: v for k, v in RUN.items() if k != "export_dir"}
    page = (_full_report(tmp_path / "r", run=run) / "index.html").read_text(encoding="utf-8")
    assert "Using the model" not in page
    assert "Exported model" not in page
    page = (_full_report(tmp_path / "plain") / "index.html").read_text(encoding="utf-8")
    assert 'class="facts"' not in page and '<h2 id="run">' not in page
    with pytest.raises(ConfigError, match=r"unknown keys \['lr'\]"):
        _full_report(tmp_path / "bad", run={"lr": 1e-5})
    assert not (tmp_path / "bad").exists()


def _rewards_with_accuracy(wins: int, n: int = 8):
    """chosen/rejected where exactly `wins` of `n` pairs rank chosen first (no ties)."""
    chosen = np.arange(n, dtype=np.float64)
    rejected = chosen + np.where(np.arange(n) < wins, -0.5, 0.5)
    return chosen, rejected


def test_before_and_after_table(tmp_path):
    pytest.importorskip("matplotlib")
    before = preference_metrics(*_rewards_with_accuracy(2))  # accuracy 0.25
    chosen, rejected = _rewards_with_accuracy(6)  # accuracy 0.75
    after = preference_metrics(chosen, rejected)
    out = write_report(
        tmp_path / "r",
        metrics=after,
        chosen=chosen,
        rejected=rejected,
        metrics_before=before,  # one result: the only eval set, "eval"
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<th>metric</th><th>eval before</th><th>eval after</th><th>eval change</th>" in page
    assert (
        "<tr><td>Accuracy (ties count ½)</td><td>0.2500</td><td>0.7500</td><td>+0.5000</td>" in page
    )
    # Margins are ±0.5 either way: mean margin 2·0.5/8 − 6·0.5/8 = −0.25 before, +0.25 after.
    assert (
        "<tr><td>Mean margin r_c − r_r</td><td>-0.2500</td><td>0.2500</td><td>+0.5000</td>" in page
    )
    loss_row = re.search(r"<tr><td>Loss</td><td>([^<]*)</td><td>([^<]*)</td>", page)
    assert loss_row.groups() == (
        report_module.format_number(before["loss"], "score"),
        report_module.format_number(after["loss"], "score"),
    )
    assert "Accuracy: eval 0.2500 → 0.7500." in page
    with pytest.raises(ConfigError, match=r"eval sets \['other'\] that `metrics` lacks"):
        write_report(
            tmp_path / "r2",
            metrics=after,
            chosen=chosen,
            rejected=rejected,
            metrics_before={"other": before},
        )


def test_without_metrics_before_there_is_no_before_table(tmp_path):
    pytest.importorskip("matplotlib")
    page = (_full_report(tmp_path / "r") / "index.html").read_text(encoding="utf-8")
    assert "Before and after training" not in page
    assert "Accuracy: heldout " in page


# ----------------------------------------------------------------------------- misranked pairs

# margins r_c − r_r: 1, −3, −0.5, −0.5, −2, 0 (tie), 0 (tie)
MIXED_CHOSEN = np.array([1.0, -3.0, 0.5, 2.0, -1.0, 0.0, 5.0])
MIXED_REJECTED = np.array([0.0, 0.0, 1.0, 2.5, 1.0, 0.0, 5.0])


def _misranked_report(path, texts, **kwargs):
    perfect_chosen, perfect_rejected = np.array([1.0, 2.0]), np.array([0.0, 2.0])
    metrics = {
        "mixed": preference_metrics(MIXED_CHOSEN, MIXED_REJECTED),
        "perfect": preference_metrics(perfect_chosen, perfect_rejected),
    }
    return write_report(
        path,
        metrics=metrics,
        chosen={"mixed": MIXED_CHOSEN, "perfect": perfect_chosen},
        rejected={"mixed": MIXED_REJECTED, "perfect": perfect_rejected},
        pairs={"mixed": texts, "perfect": [("a", "b"), ("c", "d")]},
        **kwargs,
    )


def _misranked_rows(page: str, eval_set: str) -> list[list[str]]:
    section = page.split(f"<h3>{eval_set}</h3>", 1)[1].split("</table>", 1)[0]
    return [
        re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
        for row in re.findall(r"<tr>(.*?)</tr>", section.split("<tbody>", 1)[1], flags=re.S)
    ]


def test_misranked_pairs_are_the_negative_margins_most_negative_first(tmp_path):
    pytest.importorskip("matplotlib")
    texts = [(f"Q{i}: which? A: good {i}", f"Q{i}: which? A: bad {i}") for i in range(7)]
    out = _misranked_report(tmp_path / "r", texts)
    page = (out / "index.html").read_text(encoding="utf-8")
    rows = _misranked_rows(page, "mixed")
    # Pairs 1 (−3), 4 (−2), then the two −0.5 in pair order; ties (5, 6) and pair 0 are right.
    assert [r[0] for r in rows] == ["1", "4", "2", "3"]
    assert [r[1:4] for r in rows] == [
        ["-3.0000", "-3.0000", "0.0000"],
        ["-2.0000", "-1.0000", "1.0000"],
        ["-0.5000", "0.5000", "1.0000"],
        ["-0.5000", "2.0000", "2.5000"],
    ]
    # The shared prompt is shown once; each response after it.
    assert rows[0][4:] == ["Q1: which? A: ", "good 1", "bad 1"]
    assert "4 of 7 pairs have r_chosen − r_rejected &lt; 0" in page
    assert "<h3>perfect</h3>\n<p>No misranked pairs" in page
    # num_misranked keeps the most negative ones.
    page = (_misranked_report(tmp_path / "r3", texts, num_misranked=3) / "index.html").read_text(
        encoding="utf-8"
    )
    assert [r[0] for r in _misranked_rows(page, "mixed")] == ["1", "4", "2"]


def test_misranked_indices():
    assert report_module.misranked_indices(MIXED_CHOSEN, MIXED_REJECTED, 10).tolist() == [
        1,
        4,
        2,
        3,
    ]
    assert report_module.misranked_indices(MIXED_CHOSEN, MIXED_REJECTED, 1).tolist() == [1]
    assert report_module.misranked_indices(np.ones(3), np.zeros(3), 10).tolist() == []


def test_misranked_texts_are_escaped_and_shortened(tmp_path):
    pytest.importorskip("matplotlib")
    long_text = "word " * 200  # 1,000 characters
    texts = [("x", "y")] * 7
    texts[1] = ("<script>alert('pair')</script>", long_text)
    out = _misranked_report(tmp_path / "r", texts)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;pair&#x27;)&lt;/script&gt;" in page
    shown = _misranked_rows(page, "mixed")[0][6]  # pair 1's rejected text
    assert shown.endswith("…")
    assert shown.startswith("word word")
    assert len(shown) <= report_module.TEXT_PREVIEW_CHARS + 1


def test_split_shared_start_does_not_cut_a_word():
    split = report_module._split_shared_start
    assert split("Q: Is it good? A: Yes", "Q: Is it good? A: Yo") == (
        "Q: Is it good? A: ",
        "Yes",
        "Yo",
    )
    assert split("Yes", "Yo") == ("", "Yes", "Yo")
    assert split("same text", "same text") == ("same text", "", "")


def test_misaligned_or_malformed_pairs_are_refused(tmp_path):
    pytest.importorskip("matplotlib")
    good = [("c", "r")] * 7
    with pytest.raises(
        DataError, match="pairs for eval set 'mixed' has 6 entries but its metrics count 7"
    ):
        _misranked_report(tmp_path / "a", good[:6])
    with pytest.raises(DataError, match="pairs for eval set 'mixed', entry 2: expected a"):
        _misranked_report(tmp_path / "b", [*good[:2], "only one text", *good[3:]])
    with pytest.raises(ConfigError, match="num_misranked must be a positive integer"):
        _misranked_report(tmp_path / "c", good, num_misranked=0)
    chosen, rejected, _, _ = _eval_data(n=4)
    with pytest.raises(ConfigError, match=r"`pairs` has eval sets \['nope'\]"):
        write_report(
            tmp_path / "d",
            metrics=preference_metrics(chosen, rejected),
            chosen=chosen,
            rejected=rejected,
            pairs={"nope": [("a", "b")] * 4},
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- training plot


def test_training_plot_marks_every_evaluation_above_the_train_lines(tmp_path):
    figure_module = pytest.importorskip("matplotlib.figure")
    made = []

    class RecordingFigure(figure_module.Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    series = report_module._training_series(_training_rows())
    report_module._plot_training(RecordingFigure, series, tmp_path / "curves.png")
    for ax in made[0].axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        evaluation = lines["eval/heldout (3 evaluations)"]
        assert evaluation.get_marker() == "o"
        assert evaluation.get_markersize() >= 6
        assert list(evaluation.get_xdata()) == [10, 20, 30]
        assert evaluation.get_zorder() > lines["train (per log)"].get_zorder()


def test_ranked_rows_metrics_are_shown_per_eval_set(tmp_path):
    # An eval set of ranked rows carries `ranking` (rankings.ranking_metrics); a pair set does not.
    chosen, rejected, _, _ = _eval_data(n=12)
    ranked = dict(preference_metrics(chosen, rejected))
    ranking = {"spearman": 0.625, "kendall_tau": 0.4375, "top1_accuracy": 0.75, "num_rows": 4}
    ranked["ranking"] = {**ranking, "loss": 1.25}  # a run trained with a ranking loss
    out = write_report(
        tmp_path / "r",
        metrics={"ranked": ranked, "pairs": preference_metrics(chosen, rejected)},
        chosen={"ranked": chosen, "pairs": chosen},
        rejected={"ranked": rejected, "pairs": rejected},
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    rows = dict(
        (label, (ranked_cell, pairs_cell))
        for label, ranked_cell, pairs_cell in re.findall(
            r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", page
        )
    )
    assert rows["Ranked rows"] == ("4", "—")
    assert rows["Spearman ρ(reward, −rank), mean per ranked row"] == ("0.6250", "—")
    assert rows["Kendall τ-b(reward, −rank), mean per ranked row"] == ("0.4375", "—")
    assert rows["Top-1 accuracy (best-ranked response has the top reward)"] == ("0.7500", "—")
    assert rows["Ranking loss (train.loss of the run), mean per ranked row"] == ("1.2500", "—")
    ranked["ranking"] = ranking  # trained on pairs: no ranking loss, no row for it
    out = write_report(
        tmp_path / "pairs_trained",
        metrics={"ranked": ranked},
        chosen={"ranked": chosen},
        rejected={"ranked": rejected},
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "Ranked rows" in page and "Ranking loss" not in page
    plain = _full_report(tmp_path / "plain").joinpath("index.html").read_text(encoding="utf-8")
    assert "Ranked rows" not in plain

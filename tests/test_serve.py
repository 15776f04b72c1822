"""`rewardax serve` as a real process on loopback, queried over real HTTP: each protocol's shape,
rewards equal to `rewardax score`'s whatever the batching, the bearer key, bad and oversize
requests, 200 concurrent requests, backpressure, SIGTERM under load; and `reward_function`. The
app on uvicorn in this process: a multi-objective model's every objective by name on each route
(equal to the model's own outputs), and a single-output model's answers byte for byte as before."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import cli

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

RX = Path(sys.executable).parent / "rewardax"
HELDOUT = resources.files("rewardax") / "assets" / "vader_movie_pairs.heldout.jsonl"
KEY = "s3cret-key"
MAX_LENGTH = "32"  # 4 buckets (8, 16, 24, 32): a short warm-up; longer rows are cut, as in score
PROMPT = "Review:\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(port, path, body=None, *, key=None, raw=None, timeout=60):
    """(status, headers, JSON) of one HTTP request to 127.0.0.1:`port` (POST when a body is given)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def post_bytes(port, path, body, timeout=60) -> bytes:
    """The raw body of a 200 answer to POSTing `body` (JSON) to 127.0.0.1:`port`."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        return resp.read()


def start_server(model_dir, *args):
    port = free_port()
    proc = subprocess.Popen(
        [
            str(RX),
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--max-length",
            MAX_LENGTH,
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, port


def wait_ready(proc, port, limit_s=120):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if request(port, "/health", timeout=2)[0] == 200:
                return
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server not ready in time")


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny model, two servers (one with a key and tight limits, one for SIGTERM), and the
    rows with their offline `rewardax score` rewards."""
    tmp = tmp_path_factory.mktemp("serve")
    tokenizer = smollm2_tokenizer()
    model_dir = tmp / "tiny-model"
    tiny_llama(tokenizer).save_pretrained(model_dir, tokenizer=tokenizer)
    key_file = tmp / "key.txt"
    key_file.write_text(KEY + "\n")
    main = start_server(
        model_dir,
        "--api-key-file",
        str(key_file),
        "--max-body-bytes",
        "65536",
        "--max-text-chars",
        "2000",
    )
    # Batches wait 400 ms for company: requests stay in flight long enough to SIGTERM under load.
    drain = start_server(model_dir, "--max-wait-ms", "400", "--max-queue-rows", "40")
    texts = [json.loads(line)["chosen"] for line in Path(HELDOUT).read_text().splitlines()[:40]]
    rows = [{"prompt": PROMPT, "response": t} for t in texts[:20]]
    rows += [{"text": t} for t in texts[20:]]
    rows += [
        {"messages": [{"role": "user", "content": "Rate it"}, {"role": "assistant", "content": t}]}
        for t in texts[:4]
    ]
    rows.append({"input_ids": [1, 2, 3, 4, 5]})
    src = tmp / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "scored.jsonl"
    argv = ["score", "--model", str(model_dir), "--input", str(src), "--output", str(out)]
    assert cli.main([*argv, "--max-length", MAX_LENGTH]) == 0
    reference = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
    try:
        for proc, port in (main, drain):
            wait_ready(proc, port)
        yield {
            "model_dir": model_dir,
            "port": main[1],
            "proc": main[0],
            "drain": drain,
            "rows": rows,
            "reference": np.array(reference),
            "texts": texts,
        }
    finally:
        stop(main[0])
        stop(drain[0])


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_each_protocol_answers_its_shape_with_score_rewards(work):
    port, ref, texts = work["port"], work["reference"], work["texts"]
    text_ref = ref[20:40]  # rows 20..39 are {"text": t} rows of texts[20:]
    status, _, body = request(
        port, "/get_reward", {"query": texts[20:], "prompts": [], "labels": []}, key=KEY
    )
    assert status == 200 and set(body) == {"rewards", "scores", "extra_logs"}
    assert body["extra_logs"] == {} and body["rewards"] == body["scores"]
    close(body["rewards"], text_ref)

    status, _, body = request(port, "/classify", {"model": "rm", "input": texts[20:]}, key=KEY)
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["object"] == "list" and body["model"] == "rm"
    assert [d["index"] for d in body["data"]] == list(range(20))
    assert all(set(d) == {"index", "label", "probs", "num_classes"} for d in body["data"])
    close([d["probs"][0] for d in body["data"]], text_ref)
    assert body["usage"]["prompt_tokens"] > 0
    status, _, body = request(port, "/classify", {"input": [1, 2, 3, 4, 5]}, key=KEY)
    close([body["data"][0]["probs"][0]], ref[-1:])
    for i, row in enumerate(work["rows"][40:44]):  # vLLM's chat form: one conversation
        status, _, body = request(port, "/classify", {"messages": row["messages"]}, key=KEY)
        assert status == 200 and [d["index"] for d in body["data"]] == [0]
        close([body["data"][0]["probs"][0]], ref[40 + i : 41 + i])
    status, _, body = request(port, "/classify", {"messages": "not a conversation"}, key=KEY)
    assert status == 422, body

    status, _, body = request(
        port, "/v1/score/evaluation", {"model": "rm", "messages": texts[20:]}, key=KEY
    )
    assert status == 200 and set(body) == {"id", "object", "model", "scores"}
    assert body["object"] == "score.evaluation"
    close(body["scores"], text_ref)

    status, _, body = request(port, "/score", {"rows": work["rows"]}, key=KEY)
    assert status == 200 and set(body) == {"rewards"}
    close(body["rewards"], ref)

    status, _, info = request(port, "/info", key=KEY)
    assert status == 200 and info["model"] == str(work["model_dir"])
    assert len(info["export_hash"]) == 64 and len(info["chat_template_hash"]) == 64
    assert info["normalization"] is None and info["normalize"] is False
    assert info["max_sequence_length"] == int(MAX_LENGTH)


@pytest.mark.slow
def test_key_required_and_compared(work):
    port = work["port"]
    body = {"rows": work["rows"][:1]}
    status, headers, answer = request(port, "/score", body)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert answer["error"]["code"] == 401 and "token" in answer["error"]["message"]
    assert request(port, "/score", body, key=KEY + "x")[0] == 401
    assert request(port, "/info")[0] == 401
    assert request(port, "/score", body, key=KEY)[0] == 200
    assert request(port, "/health")[0] == 200


@pytest.mark.slow
def test_bad_requests_get_json_errors_and_the_server_lives(work):
    port = work["port"]
    cases = [
        (b"{not json", 400),
        (b"\xff\xfe", 400),
        (b"[" * 100_00 + b"]" * 100_00, 400),  # nested deeper than the parser goes
        (json.dumps({"rows": "x"}).encode(), 400),
        (json.dumps([1, 2]).encode(), 400),
        (json.dumps({"rows": []}).encode(), 400),
        (json.dumps({"rows": [{"nothing": 1}]}).encode(), 422),
        (json.dumps({"rows": [{"input_ids": [10**9]}]}).encode(), 422),
        (json.dumps({"rows": [{"text": "a" * 3000}]}).encode(), 422),  # over --max-text-chars
        (json.dumps({"rows": [{"text": "a"}] * 2000}).encode(), 413),  # over the row limit
        (b" " * 70_000, 413),  # over --max-body-bytes
    ]
    for raw, want in cases:
        status, _, answer = request(port, "/score", raw=raw, key=KEY)
        assert status == want, (raw[:40], answer)
        assert answer["error"]["code"] == want and answer["error"]["message"]
    status, _, answer = request(port, "/get_reward", {"query": [3]}, key=KEY)
    assert status == 400 and "query" in answer["error"]["message"]
    assert request(port, "/nowhere", {}, key=KEY)[0] == 404
    assert work["proc"].poll() is None
    assert request(port, "/health")[0] == 200


@pytest.mark.slow
def test_200_concurrent_requests_each_get_their_own_rows(work):
    """Requests of 1-3 rows at once: every answer holds its own rows' rewards, in order, equal to
    the offline ones whatever batch they were gathered into."""
    port, rows, ref = work["port"], work["rows"], work["reference"]
    rng = np.random.default_rng(0)
    picks = [rng.choice(len(rows), size=rng.integers(1, 4), replace=False) for _ in range(200)]

    def one(index):
        return request(port, "/score", {"rows": [rows[i] for i in index]}, key=KEY, timeout=60)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, picks, timeout=120))
    assert [a[0] for a in answers] == [200] * 200
    for index, (_, _, body) in zip(picks, answers, strict=True):
        close(body["rewards"], ref[index])


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(work):
    (proc, port), rows, ref = work["drain"], work["rows"], work["reference"]
    with ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(request, port, "/score", {"rows": rows[2 * i : 2 * i + 2]}, timeout=60)
            for i in range(16)
        ]
        deadline = time.monotonic() + 30
        while request(port, "/info")[2]["queue_rows"] < 32:  # all 16 admitted, waiting
            assert time.monotonic() < deadline, "requests not admitted"
            time.sleep(0.01)
        # The queue holds 32 of its 40 rows: 16 more are refused, with a hint when to retry.
        status, headers, answer = request(port, "/score", {"rows": rows[:16]})
        assert status == 503 and headers["Retry-After"] == "1"
        assert answer["error"]["code"] == 503
        proc.send_signal(signal.SIGTERM)
        answers = [f.result(timeout=60) for f in futures]
    for i, (status, _, body) in enumerate(answers):
        assert status == 200
        close(body["rewards"], ref[2 * i : 2 * i + 2])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["command"] == "serve" and summary["requests"] >= 16


@pytest.mark.slow
def test_reward_function_equals_score(work):
    ref, texts = work["reference"], work["texts"]
    reward = rx.reward_function(
        work["model_dir"], batch_size=8, overrides=[f"data.max_sequence_length={MAX_LENGTH}"]
    )
    got = reward([PROMPT] * 20, texts[:20], trainer_state=None)
    assert isinstance(got, list) and all(isinstance(r, float) for r in got)
    close(got, ref[:20])
    chats = reward(
        [[{"role": "user", "content": "Rate it"}]] * 4,
        [[{"role": "assistant", "content": t}] for t in texts[:4]],
    )
    close(chats, ref[40:44])


@pytest.mark.slow
def test_rows_are_cut_into_the_passes_of_least_time_on_the_smallest_programs(work):
    """Rows per bucket program: 16, 4 and 1. Sorted by length, the rows are cut into the passes
    of least total time under the pass cost model; any batch gives the offline rewards."""
    import itertools

    from rewardax.serve import ServingModel
    from rewardax.serve.model import PassCost

    model = ServingModel(
        work["model_dir"],
        overrides=[f"data.max_sequence_length={MAX_LENGTH}"],
        max_batch_rows=16,
    )
    assert set(map(tuple, model.info()["buckets"].values())) == {(1, 4, 16)}
    assert model.buckets == (8, 16, 24, 32)
    real = model.scorers
    calls: list[tuple[int, int, list[int]]] = []  # (bucket, program rows, lengths given)

    class Program:
        def __init__(self, bucket, batch_size):
            self.bucket, self.batch_size = bucket, batch_size

        def outputs(self, seqs):
            calls.append((self.bucket, self.batch_size, [len(q) for q in seqs]))
            return np.asarray([[float(len(q))] for q in seqs])

    model.scorers = {b: [Program(b, n) for n in (1, 4, 16)] for b in model.buckets}
    lengths = [3, 17, 9, 30, 5, 12, 7, 25, 2, 14, 8, 11, 6, 19, 4, 10, 13, 1, 16, 15]
    seqs = [np.zeros(n, np.int32) for n in lengths]
    # A pass's fixed cost far above its tokens': the fewest passes, then the fewest padded tokens.
    model.pass_cost = PassCost(1e6, 1.0)
    for n, expected in (
        (1, [(8, 1, [3])]),
        (3, [(24, 4, [17, 9, 3])]),
        (5, [(32, 16, [30, 17, 9, 5, 3])]),
        # 2 passes: the 4 longest on 4 rows of 32 tokens and 16 rows of 16 (384 tokens), not 16
        # rows of 32 and 4 of 8 (544) as taking the largest program first would.
        (20, [(32, 4, [30, 25, 19, 17]), (16, 16, sorted(lengths, reverse=True)[4:])]),
    ):
        calls.clear()
        # Each row's reward comes back in its own place (the fake reward is its length).
        assert model.rewards(seqs[:n]).tolist() == lengths[:n]
        assert calls == expected, (n, calls)

    # Any cost model: the cuts are the optimum of every way to cut the sorted rows (brute force).
    def plan_cost(sorted_lengths, cuts):
        total, bounds = 0.0, [0, *cuts, len(sorted_lengths)]
        for a, b in itertools.pairwise(bounds):
            ladder = model.scorers[model.bucket_of(sorted_lengths[a])]
            if b - a > ladder[-1].batch_size:
                return float("inf")
            rows = next(p.batch_size for p in ladder if p.batch_size >= b - a)
            total += model.pass_cost(rows, model.bucket_of(sorted_lengths[a]))
        return total

    rng = np.random.default_rng(0)
    for fixed in (0.0, 20.0, 200.0):
        model.pass_cost = PassCost(fixed, 1.0)
        for _ in range(5):
            some = sorted(rng.integers(1, 33, size=11).tolist(), reverse=True)
            chosen = model.passes(some)
            assert chosen[0][0] == 0 and chosen[-1][1] == len(some)
            got = plan_cost(some, [a for a, _, _ in chosen[1:]])
            optimum = min(
                plan_cost(some, list(cuts))
                for k in range(len(some))
                for cuts in itertools.combinations(range(1, len(some)), k)
            )
            assert got == pytest.approx(optimum), (fixed, some, chosen)
    model.scorers = real
    model.warm()  # measures the cost model on the real programs
    assert model.pass_cost.fixed_s >= 0 and model.pass_cost.per_token_s > 0
    ref, texts = work["reference"], work["texts"]
    rows = [{"prompt": PROMPT, "response": t} for t in texts[:20]]
    ids = model.encode(rows)
    for n in (1, 3, 5, 20):
        close(model.rewards(ids[:n]), ref[:n])


def test_clients_answered_together_are_batched_together_again():
    """Closed-loop clients (each sends its next request once answered, a few ms later, one after
    another) keep meeting in one full pass; a fixed 3 ms window split them into a large and a
    tiny pass forever."""
    import asyncio

    from rewardax.serve.batcher import Batcher

    class FakeModel:
        def __init__(self):
            self.passes: list[int] = []

        def encode(self, rows):
            return [np.zeros(4, np.int32) for _ in rows]

        def bucket_of(self, length):
            return 8

        def score(self, sequences):
            self.passes.append(len(sequences))
            time.sleep(0.1)  # a forward pass
            return np.zeros(len(sequences)), None

    async def run(clients: int, rounds: int) -> tuple[list[int], float]:  # passes, seconds
        model = FakeModel()
        batcher = Batcher(model, max_batch_tokens=1 << 20, max_wait_s=0.003, max_queue_rows=1000)
        batcher.start()

        async def client(i: int) -> None:
            for _ in range(rounds):
                await batcher.score([{"text": "x"}])
                await asyncio.sleep(0.001 * (i + 1))  # answers reach clients one by one

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - start
        await batcher.stop()
        return model.passes, wall

    passes, _ = asyncio.run(run(clients=8, rounds=6))
    assert sum(passes) == 48
    assert passes[1:] == [8] * 5, passes  # after the first pass, every pass holds all 8
    passes, _ = asyncio.run(run(clients=1, rounds=5))
    assert passes == [1] * 5


# ------------------------------------------------------------- multi-objective models, in process

OBJECTIVES = ("helpfulness", "correctness")
STORED_NORMALIZATION = {"mean": 0.25, "std": 2.0}


@contextlib.contextmanager
def in_process(model, **limits):
    """`build_app(model, **limits)` on uvicorn in a thread of this process (the model compiled
    once, here); yields its port."""
    import uvicorn

    from rewardax.serve.app import build_app

    port = free_port()
    app = build_app(model, **limits)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server not up"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A two-objective export (names in config.json's id2label, normalisation stats stored) and a
    single-output one, short texts (no truncation at MAX_LENGTH), and the two-objective model's
    head outputs of each text and of a token-id row from its own forward pass, one unpadded row
    at a time."""
    from flax import nnx

    tmp = tmp_path_factory.mktemp("serve-objectives")
    tokenizer = smollm2_tokenizer()
    single = tiny_llama(tokenizer)
    single.save_pretrained(tmp / "single", tokenizer=tokenizer)
    config = dataclasses.replace(single.config, num_labels=2, label_names=OBJECTIVES)
    model = rx.RewardModel(config, rngs=nnx.Rngs(7))
    model.save_pretrained(tmp / "named", tokenizer=tokenizer)
    hf_config = json.loads((tmp / "named" / "config.json").read_text())
    hf_config.setdefault("rewardax", {})["reward_normalization"] = STORED_NORMALIZATION
    (tmp / "named" / "config.json").write_text(json.dumps(hf_config))

    texts = [json.loads(line)["chosen"] for line in Path(HELDOUT).read_text().splitlines()[:40]]
    # A text row is its tokens with EOS appended (`rewardax score`'s rule); these fit unclipped.
    sequences = [[*tokenizer(t).input_ids, tokenizer.eos_token_id] for t in texts]
    kept = [i for i, ids in enumerate(sequences) if len(ids) <= int(MAX_LENGTH)][:12]
    texts = [texts[i] for i in kept]
    ids_row = [1, 2, 3, 4, 5]
    sequences = [sequences[i] for i in kept] + [ids_row]
    outputs = np.stack([np.asarray(model(np.asarray([ids])).logits)[0] for ids in sequences])
    assert outputs.shape == (len(texts) + 1, 2)
    assert np.abs(outputs[:, 0] - outputs[:, 1]).min() > 1e-3  # the objectives tell apart
    return {
        "single": tmp / "single",
        "named": tmp / "named",
        "texts": texts,
        "ids_row": ids_row,
        "outputs": outputs,  # [texts + the ids row, objective]
    }


def serving(model_dir, **kwargs):
    from rewardax.serve import ServingModel

    overrides = [f"data.max_sequence_length={MAX_LENGTH}"]
    return ServingModel(model_dir, overrides=overrides, **kwargs)


def assert_by_objective(named, want):
    """`named` ({objective: value} per row) holds every objective, in head order, equal to
    `want` [rows, objective]."""
    assert [list(row) for row in named] == [list(OBJECTIVES)] * len(want)
    got = np.asarray([[row[n] for n in OBJECTIVES] for row in named])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_multi_objective_model_answers_each_objective_by_name_on_every_route(exports):
    """Every scoring route adds each objective's output (equal to the model's own forward pass
    per objective, row by row in request order) beside the reward, which is the first one; so do
    concurrent requests gathered into one batch."""
    texts, want = exports["texts"], exports["outputs"]
    text_want = want[:-1]
    model = serving(exports["named"])
    assert model.objectives == OBJECTIVES
    # Batches wait 200 ms for company: the concurrent requests below share passes.
    with in_process(model, max_wait_s=0.2) as port:
        status, _, body = request(port, "/get_reward", {"query": texts})
        assert status == 200
        assert set(body) == {"rewards", "scores", "extra_logs", "objective_rewards"}
        assert_by_objective(body["objective_rewards"], text_want)
        assert body["rewards"] == body["scores"]
        assert body["rewards"] == [r["helpfulness"] for r in body["objective_rewards"]]

        status, _, body = request(port, "/classify", {"input": texts})
        assert status == 200
        assert all(
            set(d) == {"index", "label", "probs", "num_classes", "rewards"} for d in body["data"]
        )
        assert_by_objective([d["rewards"] for d in body["data"]], text_want)
        assert [d["probs"] for d in body["data"]] == [
            [d["rewards"]["helpfulness"]] for d in body["data"]
        ]
        status, _, body = request(port, "/classify", {"input": exports["ids_row"]})
        assert status == 200
        assert_by_objective([body["data"][0]["rewards"]], want[-1:])

        status, _, body = request(port, "/v1/score/evaluation", {"messages": texts})
        assert status == 200
        assert set(body) == {"id", "object", "model", "scores", "objective_rewards"}
        assert_by_objective(body["objective_rewards"], text_want)
        assert body["scores"] == [r["helpfulness"] for r in body["objective_rewards"]]

        # Rows of mixed lengths, reversed: the passes sort them, the answer keeps request order.
        rows = [{"text": t} for t in texts] + [{"input_ids": exports["ids_row"]}]
        status, _, body = request(port, "/score", {"rows": rows[::-1]})
        assert status == 200 and set(body) == {"rewards", "objective_rewards"}
        assert_by_objective(body["objective_rewards"], want[::-1])
        assert body["rewards"] == [r["helpfulness"] for r in body["objective_rewards"]]

        # Requests of 1-3 rows at once: each answer holds its own rows' outputs, in order.
        rng = np.random.default_rng(0)
        picks = [rng.choice(len(rows), size=rng.integers(1, 4), replace=False) for _ in range(12)]
        batches = request(port, "/info")[2]["batches"]
        with ThreadPoolExecutor(12) as pool:
            answers = list(
                pool.map(lambda p: request(port, "/score", {"rows": [rows[i] for i in p]}), picks)
            )
        for index, (status, _, body) in zip(picks, answers, strict=True):
            assert status == 200
            assert_by_objective(body["objective_rewards"], want[index])
        status, _, info = request(port, "/info")
        assert status == 200 and info["objectives"] == list(OBJECTIVES)
        assert info["batches"] - batches < len(picks)  # some requests shared a pass


@pytest.mark.slow
def test_normalize_applies_to_the_reward_not_to_the_objectives(exports):
    """With --normalize the reward is (first objective - mean) / std; the named outputs stay as
    the head gives them, as in `rewardax score`."""
    texts, want = exports["texts"], exports["outputs"][:-1]
    mean, std = STORED_NORMALIZATION["mean"], STORED_NORMALIZATION["std"]
    with in_process(serving(exports["named"], normalize=True)) as port:
        status, _, body = request(port, "/score", {"rows": [{"text": t} for t in texts]})
        assert status == 200
        assert_by_objective(body["objective_rewards"], want)
        close(body["rewards"], (want[:, 0] - mean) / std)
        status, _, body = request(port, "/classify", {"input": texts[:3]})
        assert_by_objective([d["rewards"] for d in body["data"]], want[:3])
        close([d["probs"][0] for d in body["data"]], (want[:3, 0] - mean) / std)


@pytest.mark.slow
def test_single_output_model_answers_are_unchanged_byte_for_byte(exports):
    """No `objective_rewards`, no per-item `rewards`, no `objectives` in /info: each body is the
    bytes Starlette renders of the shape served before named objectives, with the rewards of the
    same rows scored directly (one request alone is one batch: the same passes, the same floats)."""
    from starlette.responses import JSONResponse

    texts = exports["texts"]
    model = serving(exports["single"])
    assert model.objectives is None
    rows = [{"text": t} for t in texts]
    sequences = model.encode(rows)
    rewards = model.rewards(sequences).tolist()
    tokens = sum(len(s) for s in sequences)
    with in_process(model) as port:

        def rendered(content):
            return JSONResponse(content).body

        got = post_bytes(port, "/get_reward", {"query": texts})
        assert got == rendered({"rewards": rewards, "scores": rewards, "extra_logs": {}})
        got = post_bytes(port, "/score", {"rows": rows})
        assert got == rendered({"rewards": rewards})
        got = post_bytes(port, "/v1/score/evaluation", {"model": "rm", "messages": texts})
        answer = json.loads(got)
        want = {"id": answer["id"], "object": "score.evaluation", "model": "rm"}
        assert got == rendered({**want, "scores": rewards})
        got = post_bytes(port, "/classify", {"model": "rm", "input": texts})
        answer = json.loads(got)
        data = [
            {"index": i, "label": "reward", "probs": [r], "num_classes": 1}
            for i, r in enumerate(rewards)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        want = {"id": answer["id"], "object": "list", "created": answer["created"], "model": "rm"}
        assert got == rendered({**want, "data": data, "usage": usage})
        assert "objectives" not in request(port, "/info")[2]

"""The HTTP face of `rewardax serve`: Starlette routes in the shapes RL frameworks send, on uvicorn.

Why Starlette + uvicorn: both are small, widely deployed and actively kept (Encode; FastAPI is
built on Starlette), uvicorn drains in-flight requests on SIGTERM (its graceful shutdown), and
Starlette needs no schema layer: every request is parsed and checked here, with rewardax's own
errors, so FastAPI's pydantic validation would add a dependency and a second set of messages.

Endpoints (JSON in, JSON out; every text is scored as the row shown, with `rewardax score`'s rules):
  POST /get_reward            OpenRLHF: {"query": [str], ...}   -> {"rewards", "scores", "extra_logs"}
                              each query is a `{"text": q}` row.
  POST /classify              vLLM: {"model"?, "input": str | [str] | [int] | [[int]]}
                              -> {"id", "object": "list", "created", "model", "data": [{"index",
                              "label", "probs": [reward], "num_classes": 1}], "usage"}; a string is a
                              `text` row, token ids an `input_ids` row.
  POST /v1/score/evaluation   LLaMA-Factory: {"model"?, "messages": [str]} -> {"id", "object":
                              "score.evaluation", "model", "scores"}; each message is a `text` row.
  POST /score                 {"rows": [row]} with `rewardax score` rows -> {"rewards": [f]}.
  GET  /health                {"status": "ok"} (no key needed).
  GET  /info                  model, export hash, chat template hash, normalisation, buckets;
                              `objectives` (the head's output names) for a multi-objective model.
A multi-objective model (`model.objectives`) answers every scoring route with its first objective as
the reward (normalised with --normalize), and with each objective's output by name beside it, as
`rewardax score` writes `rewards` (never normalised): a `/classify` item adds `"rewards": {name:
f}`; `/get_reward`, `/v1/score/evaluation` and `/score` add `"objective_rewards": [{name: f}]`, one
per row in order (their `rewards`/`scores` already being lists of rewards). A single-output model's
answers have neither.
Errors are `{"error": {"message", "type", "code"}}` with status 400 (bad JSON or shape), 401 (no or
wrong bearer key), 413 (body over the limit), 422 (a row the tokenizer rules refuse, a text over
the length limit), 503 + Retry-After (queue full).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rewardax.errors import DataError
from rewardax.serve.batcher import Batcher, QueueFull, Scored


class RequestError(Exception):
    """A client error answered with `status` and a JSON message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str, headers: dict | None = None):
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while streaming)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(400, "request body is JSON nested too deeply to read") from None


def _field(payload: Any, name: str) -> Any:
    if not isinstance(payload, dict):
        raise RequestError(400, f"expected a JSON object with `{name}`")
    if name not in payload:
        raise RequestError(400, f"missing field `{name}`")
    return payload[name]


def _strings(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(400, f"`{name}` must be a string or a list of strings")
    return value


def _classify_rows(value: Any) -> list[dict]:
    """vLLM's `input`: a string, a list of strings, a list of ids, or a list of id lists (its chat
    form, `messages` instead of `input`, is read by `classify`)."""
    if isinstance(value, str):
        return [{"text": value}]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [{"input_ids": value}]
    if isinstance(value, list) and all(isinstance(v, str | list) for v in value):
        return [{"text": v} if isinstance(v, str) else {"input_ids": v} for v in value]
    raise RequestError(
        400, "`input` must be a string, a list of strings, a list of token ids or of id lists"
    )


def _text_chars(value: Any) -> int:
    """Characters in every string of a row (bounded by the body limit, so recursion is too)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def build_app(
    model: Any,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    max_text_chars: int = 100_000,
    max_rows_per_request: int = 1024,
    max_queue_rows: int = 8192,
    max_wait_s: float = 0.003,
    log: Callable[[str], None] | None = None,
) -> Starlette:
    """The Starlette app serving `model` (a `ServingModel`); limits as in `rewardax serve --help`."""
    batcher = Batcher(
        model,
        max_batch_tokens=model.max_batch_tokens,
        max_wait_s=max_wait_s,
        max_queue_rows=max_queue_rows,
    )
    key = api_key.encode("utf-8") if api_key is not None else None
    name = model.path
    objectives = model.objectives

    def check_key(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Constant-time: the comparison takes as long for a near miss as for a wild guess.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise RequestError(401, "missing or wrong bearer token", "authentication_error")

    async def rewards_of(rows: list[Any]) -> Scored:
        """`rows` scored, after the request limits."""
        if not rows:
            raise RequestError(400, "no rows to score")
        if len(rows) > max_rows_per_request:
            raise RequestError(
                413, f"{len(rows)} rows in one request; the limit is {max_rows_per_request}"
            )
        for i, row in enumerate(rows):
            if (chars := _text_chars(row)) > max_text_chars:
                raise RequestError(
                    422, f"row {i} holds {chars} characters; the limit is {max_text_chars}"
                )
        try:
            return await batcher.score(rows)
        except DataError as error:
            raise RequestError(422, str(error)) from None

    def by_objective(scored: Scored) -> list[dict[str, float]] | None:
        """Each row's {objective: output} for a multi-objective model (`rewardax score`'s
        `rewards`, never normalised); None for a single-output model."""
        if objectives is None:
            return None
        return [
            {n: float(v) for n, v in zip(objectives, row, strict=True)} for row in scored.objectives
        ]

    def with_objectives(answer: dict, scored: Scored) -> dict:
        """`answer` (its rewards a list) plus `objective_rewards`, one {objective: output} per
        row, for a multi-objective model; a single-output model's answer as it is."""
        named = by_objective(scored)
        return answer if named is None else {**answer, "objective_rewards": named}

    def endpoint(handler: Callable[[Any], Awaitable[dict]], *, body: bool = True):
        async def serve(request: Request):
            try:
                check_key(request)
                payload = _parse_json(await _read_body(request, max_body_bytes)) if body else None
                return JSONResponse(await handler(payload))
            except RequestError as error:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
                return error_response(error.status, error.message, error.kind, headers)
            except QueueFull:
                return error_response(
                    503,
                    "the server is busy: too many rows waiting",
                    "overloaded_error",
                    {"Retry-After": "1"},
                )
            except ClientDisconnect:
                return error_response(400, "client disconnected", "invalid_request_error")

        return serve

    async def get_reward(payload: Any) -> dict:
        queries = _strings(_field(payload, "query"), "query")
        scored = await rewards_of([{"text": q} for q in queries])
        answer = {"rewards": scored.rewards, "scores": scored.rewards, "extra_logs": {}}
        return with_objectives(answer, scored)

    async def classify(payload: Any) -> dict:
        if isinstance(payload, dict) and "messages" in payload and "input" not in payload:
            # vLLM's chat form: one conversation, rendered with the model's chat template as a
            # `messages` row of `rewardax score` (and of training) is.
            rows = [{"messages": payload["messages"]}]
        else:
            rows = _classify_rows(_field(payload, "input"))
        scored = await rewards_of(rows)
        data = [
            {"index": i, "label": "reward", "probs": [r], "num_classes": 1}
            for i, r in enumerate(scored.rewards)
        ]
        if (named := by_objective(scored)) is not None:
            for item, rewards in zip(data, named, strict=True):
                item["rewards"] = rewards
        tokens = scored.tokens
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": payload.get("model") or name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    async def llamafactory_score(payload: Any) -> dict:
        texts = _strings(_field(payload, "messages"), "messages")
        scored = await rewards_of([{"text": t} for t in texts])
        answer = {
            "id": f"scoreval-{uuid.uuid4().hex}",
            "object": "score.evaluation",
            "model": payload.get("model") or name,
            "scores": scored.rewards,
        }
        return with_objectives(answer, scored)

    async def score(payload: Any) -> dict:
        rows = _field(payload, "rows")
        if not isinstance(rows, list):
            raise RequestError(400, "`rows` must be a list of rewardax score rows")
        scored = await rewards_of(rows)
        return with_objectives({"rewards": scored.rewards}, scored)

    async def info(_: Any) -> dict:
        return {**model.info(), "queue_rows": batcher.admitted_rows, **batcher.stats}

    async def health(_request: Request):
        return JSONResponse({"status": "ok"})

    async def http_error(_request: Request, error: HTTPException):
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @asynccontextmanager
    async def lifespan(_app):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            if log is not None:
                stats = batcher.stats
                log(f"served {stats['requests']} requests, {stats['rows']} rows")

    routes = [
        Route("/get_reward", endpoint(get_reward), methods=["POST"]),
        Route("/classify", endpoint(classify), methods=["POST"]),
        Route("/v1/score/evaluation", endpoint(llamafactory_score), methods=["POST"]),
        Route("/score", endpoint(score), methods=["POST"]),
        Route("/info", endpoint(info, body=False), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )
    app.state.batcher = batcher
    return app

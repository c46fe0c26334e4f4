"""An OpenAI-compatible HTTP server over any engine backend (Starlette; `make serve` runs it under uvicorn).

    app = create_app(lambda: open_engine("engines/mix/build/embedded"), model_name="mix")

Endpoints: `POST /v1/completions` (prompt as text, token ids, or a list of either),
`POST /v1/chat/completions` (the tokenizer's chat template), `GET /v1/models` and `/v1/models/{id}`, `GET /health`
(200 once the engine serves; 503 while it loads, after it failed to load, and while draining),
`GET /metrics` (Prometheus text: requests by finish reason, running, tokens, HTTP requests being answered).

Fields: model, max_tokens (chat: also max_completion_tokens), temperature, top_p, top_k, seed, stop,
n, stream, stream_options.include_usage, logprobs (completions: an int; chat: a bool with
top_logprobs), user; the vLLM extensions ignore_eos, stop_token_ids, include_stop_str_in_output,
return_token_ids (`prompt_token_ids` and `token_ids` in every choice, streamed as deltas) and
return_tokens_as_token_ids (logprob keys as "token_id:<id>"), and trtllm-serve's detokenize: false
(token_ids instead of text). Fields the engine cannot honour (echo, suffix, best_of other than n,
penalties, logit_bias, tools, response formats other than text) get a 400 that names them rather
than being silently ignored; fields nobody here knows are ignored, as vLLM does.

Semantics follow the API: the stop string is not part of the returned text (unless
include_stop_str_in_output), usage counts prompt and completion tokens (cached_tokens: prompt tokens
served from a reused KV prefix), choice i of n gets seed + i when a seed is given. A client that
disconnects cancels its engine requests (streamed or not). The sampled token's logprob is reported
when it is among the engine's top candidates (the 20 most likely ones are asked for;
greedy always is); otherwise it is null (completions) or -9999.0 (chat, as trtllm-serve does).

This module assembles the HTTP app: routes, the body limit, errors as JSON, client disconnects.
The rest lives beside it: `parsing` (fields into a Job), `api` (generation, the whole response,
metrics), `sse` (the streamed response), `responses` (choice, logprobs and usage objects), `state`
(the engine loading, serving, draining).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from server.openai.api import Api
from server.openai.api_error import ApiError, dumps
from server.openai.job import Job
from server.openai.sse import sse_stream
from server.openai.state import LOADING_RETRY_SECONDS, State

MAX_REQUEST_BYTES = 8 << 20  # default body limit (413 above it); `make serve` --max-request-bytes changes it
# A body must arrive within this many seconds (408 after): a client holding a body open held its bytes in
# memory for as long as it liked
BODY_SECONDS = 60.0
# bodies being read at once may hold at most this many max_request_bytes together (503 for the one that
# passes it): 40 clients each holding an 8 MB body open grew the server by 250 MB, and nothing bounded it
PENDING_BODIES = 16
log = logging.getLogger("server.openai")


def request_id(header: Optional[str]) -> str:
    """The id a response is tagged with: the client's x-request-id cut to 64 visible ASCII characters (what an
    HTTP header may carry back: a value cut to end in a space or holding control bytes made the server drop
    the connection unanswered), or a fresh one."""
    rid = "".join(c for c in (header or "")[:64] if "!" <= c <= "~")
    return rid or uuid.uuid4().hex


class Counted:
    """ASGI middleware: `state.active` counts the HTTP requests being answered (a stream until its
    last byte), so the drain (`server.openai.drain`) knows when none is left."""

    def __init__(self, app: Any, state: State):
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.state.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.active -= 1


def create_app(load: Callable[[], Any], model_name: str,
               on_failure: Optional[Callable[[BaseException], None]] = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, body_seconds: float = BODY_SECONDS,
               pending_body_bytes: Optional[int] = None) -> Any:
    """The Starlette app; `load` opens the engine (run in a thread at startup); `app.state.serving` is the State.
    Bodies over `max_request_bytes` get a 413 before they are read, one not in after `body_seconds` a 408, one
    that takes the bodies being read past `pending_body_bytes` (PENDING_BODIES x max_request_bytes) a 503;
    every failure is an OpenAI-shaped
    JSON error (a server fault: 500, logged with its request id, also sent as `x-request-id`)."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = State(load, model_name, on_failure)

    def error(e: ApiError, rid: str = "") -> JSONResponse:
        headers = {"x-request-id": rid} if rid else {}
        if e.retry_after is not None:
            headers["retry-after"] = str(e.retry_after)
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    reading = {"bytes": 0}  # of the bodies being read now
    pending_budget = pending_body_bytes or PENDING_BODIES * max_request_bytes

    async def read_body(request: HttpRequest) -> bytes:
        """The body, refused with 413 once it is known to pass the limit (from Content-Length, before
        reading; else while reading)."""
        declared = request.headers.get("content-length")
        too_big = (f"the request body is over this server's limit of {max_request_bytes} bytes "
                   "(set by `python -m server.programs.serve --max-request-bytes`)")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, f"Content-Length is not a number (got {declared[:40]!r})") from None
            if size > max_request_bytes:
                raise ApiError(413, f"{too_big}: Content-Length is {size}", code="request_too_large")
        chunks: list[bytes] = []
        got = 0

        async def collect() -> None:
            nonlocal got
            async for chunk in request.stream():
                chunks.append(chunk)
                got += len(chunk)
                reading["bytes"] += len(chunk)
                if got > max_request_bytes:
                    raise ApiError(413, too_big, code="request_too_large")
                if reading["bytes"] > pending_budget:
                    raise ApiError(503, "the server is reading too many request bodies at once; retry", retry_after=1,
                                   type_="server_error", code="server_busy")
        try:
            await asyncio.wait_for(collect(), body_seconds)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {body_seconds:g} s",
                           code="request_timeout") from None
        finally:
            reading["bytes"] -= got
        return b"".join(chunks)

    async def until_disconnect(request: HttpRequest) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def guarded(handler: Callable[[HttpRequest, str], Any]) -> Callable[[HttpRequest], Any]:
        """Every route: ApiErrors as their JSON, anything else a logged JSON 500 with the request id."""
        async def run(request: HttpRequest) -> Response:
            rid = request_id(request.headers.get("x-request-id"))
            try:
                return await handler(request, rid)
            except ApiError as e:
                return error(e, rid)
            except ClientDisconnect:  # the client left while sending its body: nobody to answer, no fault
                return Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - a server fault: said in JSON, logged with the id
                log.exception("request %s (%s %s) failed", rid, request.method, request.url.path)
                return error(ApiError(500, f"internal server error ({type(e).__name__}); request id {rid}",
                                      type_="server_error"), rid)
        return run

    async def safe_stream(api: Api, job: Job, rid: str) -> AsyncIterator[bytes]:
        """The SSE stream; a fault after the headers went out ends it with an error event and [DONE]."""
        try:
            async for chunk in sse_stream(api, job):
                yield chunk
        except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            log.exception("request %s: stream failed", rid)
            err = ApiError(500, f"internal server error ({type(e).__name__}); request id {rid}", type_="server_error")
            yield f"data: {dumps(err.body())}\n\ndata: [DONE]\n\n".encode()

    async def unless_gone(request: HttpRequest, awaitable: Any) -> tuple[bool, Any]:
        """(True, its result), or (False, None) once the client has hung up first: the work is cancelled
        (a parse still queued for the parse thread never runs; engine requests end)."""
        work = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return False, None
        return True, work.result()

    async def generate(request: HttpRequest, rid: str, chat: bool) -> Response:
        api = state.serving()
        here, job = await unless_gone(request, api.parser.parse(await read_body(request), chat))
        if not here:
            return Response(status_code=499)
        if job.stream:
            return StreamingResponse(safe_stream(api, job, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "x-request-id": rid})
        here, answer = await unless_gone(request, api.complete(job))
        if not here:  # the client left: its engine requests are cancelled; nobody reads this answer
            return Response(status_code=499)
        return JSONResponse(answer, headers={"x-request-id": rid})

    async def completions(request: HttpRequest, rid: str) -> Response:
        return await generate(request, rid, chat=False)

    async def chat_completions(request: HttpRequest, rid: str) -> Response:
        return await generate(request, rid, chat=True)

    async def models(request: HttpRequest, rid: str) -> Response:
        return JSONResponse(state.serving().models())

    async def model(request: HttpRequest, rid: str) -> Response:
        """`GET /v1/models/{id}` (the openai client's `models.retrieve`): the served model, else 404."""
        return JSONResponse(state.serving().model(request.path_params["model"]))

    async def health(request: HttpRequest) -> Response:
        status = "draining" if state.draining else "ok" if state.api else "failed" if state.error else "loading"
        body: dict[str, Any] = {"status": status, "model": model_name}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if status == "ok" else 503,
                            headers={"retry-after": str(LOADING_RETRY_SECONDS)} if status == "loading" else None)

    async def metrics(request: HttpRequest) -> Response:
        active = f"# TYPE aimo_http_requests_active gauge\naimo_http_requests_active {state.active}\n"
        return PlainTextResponse((state.api.metrics() if state.api else "") + active)

    async def http_error(request: HttpRequest, exc: Exception) -> Response:
        """Starlette's own refusals (an unknown path, a wrong method) in the API's error shape."""
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(status)
        err = ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', '') or status}"[:300],
                       code=kind)
        return JSONResponse(err.body(), status_code=status, headers=getattr(exc, "headers", None))  # 405: Allow

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.draining = True
            await state.close()

    app = Starlette(routes=[
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error},
        middleware=[Middleware(Counted, state=state)])
    app.state.serving = state
    app.state.reading_body = reading
    return app

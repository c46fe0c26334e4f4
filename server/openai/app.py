"""An OpenAI-compatible HTTP server over any engine backend (Starlette; `make serve` runs it under uvicorn).

    app = create_app(lambda: open_engine("engines/mix/build/embedded"), model_name="mix")

Endpoints: `POST /v1/completions` (prompt as text, token ids, or a list of either),
`POST /v1/chat/completions` (the tokenizer's chat template), `GET /v1/models`, `GET /health`
(200 once the engine serves; 503 while it loads, after it failed to load, and while draining),
`GET /metrics` (Prometheus text: requests by finish reason, running, tokens).

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Optional

from aimo_spec.protocol import Delta, Final, Request, SamplingParams

MAX_LOGPROBS = 20
MAX_N = 128
MAX_REQUEST_BYTES = 8 << 20  # default body limit (413 above it); `make serve` --max-request-bytes changes it
CHAT_ROLES = ("system", "developer", "user", "assistant")  # developer is OpenAI's newer name for system
_SURROGATE = re.compile("[\ud800-\udfff]")
log = logging.getLogger("server.openai")
ENGINE_LOGPROBS = 20  # asked of the engine whenever logprobs are wanted, so the sampled token is nearly always among them


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# ---- request parsing: every field checked, an error names it
def _number(body: dict, name: str, default: Any, lo: Optional[float] = None, hi: Optional[float] = None,
            integer: bool = False, lo_open: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'} (got {v!r})", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number (got {v!r})", name)
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        rng = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"{name} must be {rng} (got {v!r})", name)
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean (got {v!r})", name)
    return v


def _unsupported(body: dict, name: str, ok: Callable[[Any], bool], why: str) -> None:
    v = body.get(name)
    if v is not None and not ok(v):
        raise ApiError(400, f"{name} is not supported by this server ({why}; got {v!r})", name)


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"stop must be a string or a list of strings (got {v!r})", "stop")
    if any(not s for s in items):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return tuple(items)


def invalid_text(obj: Any, path: str = "") -> Optional[tuple[str, int]]:
    """(where, character index) of the first lone surrogate in any string or key of a parsed JSON
    body (`"\\ud800"` escapes parse to one, and no tokenizer or UTF-8 encoder takes it); None if none."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        o, where = stack.pop()
        if isinstance(o, str):
            m = _SURROGATE.search(o)
            if m:
                return where or "body", m.start()
        elif isinstance(o, dict):
            for k, v in o.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"{where}.{k!r}" if where else repr(k), 0
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(o, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(o))
    return None


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or a 400 that says what is wrong (and where)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: {e})"[:500]) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = invalid_text(body)
    if bad:
        where, i = bad
        param = where.split(".")[0].split("[")[0] if where != "body" else None
        raise ApiError(400, f"{where}: not valid Unicode text (a lone surrogate at character {i})", param or where)
    return body


@dataclass
class Job:
    """One validated request: its prompts (token ids), sampling, and what the response carries."""

    kind: str  # completion | chat
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # top entries per token in the response; None: no logprobs
    return_token_ids: bool = False
    text_out: bool = True  # trtllm's detokenize: false sends ids only
    tokens_as_ids: bool = False
    include_stop: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def requests(self) -> list[tuple[int, int, Request]]:
        """(choice index, prompt index, engine request) for every choice."""
        out = []
        for pi, prompt in enumerate(self.prompts):
            for i in range(self.n):
                p = self.params if self.params.seed is None or not i else replace(self.params, seed=self.params.seed + i)
                out.append((pi * self.n + i, pi, Request(prompt, p, f"{self.kind}-{self.id}-{pi * self.n + i}")))
        return out


class Api:
    """Parsing, generation and response shapes over one engine (the HTTP layer is `create_app`)."""

    def __init__(self, engine: Any, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.tokenizer
        self.vocab = len(self.tokenizer)
        self.max_input_len: Optional[int] = getattr(engine, "max_input_len", None)
        self.max_seq_len: Optional[int] = getattr(engine, "max_seq_len", None)
        self.finished: dict[str, int] = {}
        self.running = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self._token_text: dict[int, str] = {}
        # no token spans more characters than the longest vocabulary entry (byte-level and sentencepiece
        # vocabularies hold at least one character per byte); 4x covers normalisers that merge characters.
        # A text longer than max_input_len tokens of that size is refused before it is tokenized.
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        self.max_chars_per_token = 4 * max((len(t) for t in vocab), default=64)
        # parsing, chat templating and tokenizing run here, one at a time (a tokenizer is not safe to share
        # between threads), never on the event loop: a 5 MB prompt must not stall every other client
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-parse")

    async def parse(self, raw: bytes, chat: bool) -> "Job":
        """The validated Job of a request body, parsed and tokenized off the event loop."""
        def work() -> Job:
            body = parse_body(raw)
            return self.parse_chat(body) if chat else self.parse_completion(body)
        return await asyncio.get_running_loop().run_in_executor(self._parser, work)

    def _check_length(self, chars: int, where: str) -> None:
        """Refuse, untokenized, a text that cannot fit max_input_len tokens (see max_chars_per_token)."""
        if self.max_input_len and chars > self.max_input_len * self.max_chars_per_token:
            raise ApiError(400, f"{where}: the prompt has {chars} characters, more than this engine's limit of "
                                f"{self.max_input_len} tokens (max_input_len) can hold", where,
                           code="context_length_exceeded")

    def close(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    # ---- parsing
    def _common(self, body: dict, kind: str, prompts: list[list[int]], prompt_field: str) -> Job:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"model must be a string (got {model!r})", "model")
        if model and model != self.model_name:
            raise ApiError(404, f"The model {model!r} does not exist (this server serves {self.model_name!r})", "model",
                           code="model_not_found")
        for name, value in (("frequency_penalty", 0), ("presence_penalty", 0)):
            _unsupported(body, name, lambda v, d=value: v == d, "no penalties in the engine")
        _unsupported(body, "repetition_penalty", lambda v: v == 1, "no penalties in the engine")
        _unsupported(body, "min_p", lambda v: v == 0, "no min_p sampling in the engine")
        _unsupported(body, "logit_bias", lambda v: not v, "no logit bias in the engine")
        _unsupported(body, "use_beam_search", lambda v: v is False, "no beam search")
        n = _number(body, "n", 1, 1, MAX_N, integer=True)
        _unsupported(body, "best_of", lambda v: v == n, "best_of must equal n")
        limit = self.max_input_len
        for ids in prompts:
            if not ids:
                raise ApiError(400, f"{prompt_field}: the prompt is empty", prompt_field)
            if limit is not None and len(ids) > limit:
                raise ApiError(400, f"{prompt_field}: the prompt has {len(ids)} tokens, over this engine's limit of "
                                    f"{limit} (max_input_len)", prompt_field, code="context_length_exceeded")
        longest = max(len(p) for p in prompts)
        room = (self.max_seq_len - longest) if self.max_seq_len else None
        if room is not None and room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_seq_len} tokens; the prompt has "
                                f"{longest}, which leaves no room for a completion", prompt_field,
                           code="context_length_exceeded")
        name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(name)
        default = (room if room is not None else 4096) if kind == "chat" else min(16, room or 16)
        max_tokens = _number({name: asked}, name, default, 1, integer=True)
        if asked is not None and room is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.max_seq_len} tokens; the prompt has "
                                f"{longest} and {name} asks for {max_tokens} more ({longest + max_tokens} in all). "
                                f"Ask for at most {room}.", name, code="context_length_exceeded")
        stream = _flag(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise ApiError(400, "stream_options must be an object, and only with stream: true", "stream_options")
        include_usage = bool((opts or {}).get("include_usage"))
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise ApiError(400, f"stop_token_ids must be a list of token ids (got {stop_ids!r})", "stop_token_ids")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, f"seed must be an integer (got {seed!r})", "seed")
        temperature = _number(body, "temperature", 1.0, 0, 2)
        top_p = _number(body, "top_p", 1.0, 0, 1, lo_open=True)
        top_k = _number(body, "top_k", 0, -1, integer=True)
        params = SamplingParams(
            temperature=float(temperature), top_p=float(top_p), top_k=max(0, top_k), seed=seed, max_tokens=max_tokens,
            stop=_stops(body), stop_token_ids=tuple(stop_ids), ignore_eos=_flag(body, "ignore_eos"))
        return Job(kind, self.model_name, prompts, params, n=n, stream=stream, include_usage=include_usage,
                   return_token_ids=_flag(body, "return_token_ids"), text_out=_flag(body, "detokenize", True),
                   tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
                   include_stop=_flag(body, "include_stop_str_in_output"))

    def _token_prompt(self, v: Any, where: str) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ApiError(400, f"{where}: a token prompt must be a list of integers", "prompt")
        bad = [t for t in v if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary (0..{self.vocab - 1})", "prompt")
        return list(v)

    def parse_completion(self, body: dict) -> Job:
        _unsupported(body, "echo", lambda v: v is False, "the prompt is not echoed")
        _unsupported(body, "suffix", lambda v: not v, "no insertion")
        prompt = body.get("prompt")
        for x in [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []:
            if isinstance(x, str):
                self._check_length(len(x), "prompt")
        if isinstance(prompt, str):
            prompts = [self.engine.tokenize(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            prompts = [self._token_prompt(prompt, "prompt")]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            prompts = [self.engine.tokenize(x) for x in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            prompts = [self._token_prompt(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
        else:
            raise ApiError(400, "prompt is required: a string, a list of token ids, or a list of either "
                                f"(got {prompt!r})"[:300], "prompt")
        job = self._common(body, "completion", prompts, "prompt")
        job.logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
        return self._with_logprobs(job)

    def parse_chat(self, body: dict) -> Job:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages is required: a non-empty list of {role, content}", "messages")
        for name in ("tools", "functions"):
            _unsupported(body, name, lambda v: not v, "no tool calling; the TIR client runs code itself")
        fmt = body.get("response_format")
        _unsupported(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
                     "no structured output")
        del fmt
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}].role")
            if m["role"] not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role: {m['role']!r}"[:200] + f" is not one of {', '.join(CHAT_ROLES)}",
                               f"messages[{i}].role")
            c = m.get("content")
            if isinstance(c, list):
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in c):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                c = "".join(part["text"] for part in c)
            elif c is None:
                c = ""
            elif not isinstance(c, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
        self._check_length(sum(len(m["content"]) for m in clean), "messages")
        try:
            text = self.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (roles, order)
            raise ApiError(400, f"messages: the chat template refused them ({type(e).__name__}: {e})", "messages") from None
        job = self._common(body, "chat", [self.engine.tokenize(text)], "messages")
        if _flag(body, "logprobs"):
            job.logprobs = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self._with_logprobs(job)

    def _with_logprobs(self, job: Job) -> Job:
        if job.logprobs is not None:
            job.params = replace(job.params, top_logprobs=min(MAX_LOGPROBS, max(job.logprobs, ENGINE_LOGPROBS)))
        return job

    # ---- response pieces
    def _token(self, t: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{t}"
        s = self._token_text.get(t)
        if s is None:
            s = self._token_text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def _logprobs(self, job: Job, ids: tuple[int, ...], tops: Any, offset: int) -> Any:
        """The response's logprobs object for these tokens (completions or chat shape)."""
        k, as_id = job.logprobs or 0, job.tokens_as_ids
        rows = list(tops or ())
        rows += [()] * (len(ids) - len(rows))
        chosen = [next((lp for tid, lp in row if tid == t), None) for t, row in zip(ids, rows)]
        if job.kind == "completion":
            tokens = [self._token(t, as_id) for t in ids]
            offsets, pos = [], offset
            for s in tokens:
                offsets.append(pos)
                pos += len(s)
            return {"tokens": tokens, "token_logprobs": chosen, "text_offset": offsets,
                    "top_logprobs": [{self._token(tid, as_id): lp for tid, lp in row[:k]} for row in rows] if k else
                    [None] * len(ids)}
        content = []
        for t, row, lp in zip(ids, rows, chosen):
            s = self._token(t, as_id)
            content.append({"token": s, "logprob": -9999.0 if lp is None else lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (x := self._token(tid, as_id)), "logprob": v, "bytes": list(x.encode())}
                                             for tid, v in row[:k]]})
        return {"content": content}

    @staticmethod
    def finish_reason(final: Final) -> str:
        return {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "abort"}.get(final.finish_reason,
                                                                                                   final.finish_reason)

    def _strip_stop(self, job: Job, text: str, final: Optional[Final]) -> str:
        if final is not None and final.stop_string and not job.include_stop and text.endswith(final.stop_string):
            return text[: len(text) - len(final.stop_string)]
        return text

    def _count(self, final: Final) -> None:
        self.finished[final.finish_reason] = self.finished.get(final.finish_reason, 0) + 1
        self.generated_tokens += len(final.token_ids)

    def usage(self, job: Job, finals: list[Final]) -> dict[str, Any]:
        firsts = [f for i, f in enumerate(finals) if i % job.n == 0]
        prompt = sum(f.prompt_tokens for f in firsts)
        completion = sum(len(f.token_ids) for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)}}

    # ---- generation
    async def _events(self, job: Job) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, Delta | Final) of every choice, merged; closing it cancels them all."""
        reqs = job.requests()
        self.running += len(reqs)
        self.prompt_tokens += sum(len(p) for p in job.prompts)
        open_ = {i for i, _, _ in reqs}  # choices whose Final has not come: cancelled if the caller leaves
        try:
            if len(reqs) == 1:
                index, _, req = reqs[0]
                async for ev in self.engine.generate(req):
                    if isinstance(ev, Final):
                        self._count(ev)
                        open_.discard(index)
                    yield index, ev
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, req: Request) -> None:
                try:
                    async for ev in self.engine.generate(req):
                        if isinstance(ev, Final):
                            self._count(ev)
                        queue.put_nowait((index, ev))
                except Exception as e:  # noqa: BLE001 - the engine refused it: a Final with the error
                    queue.put_nowait((index, Final(req.request_id, "error", "", (), len(req.prompt), error=str(e))))
            tasks = [asyncio.ensure_future(pump(i, r)) for i, _, r in reqs]
            try:
                left = len(reqs)
                while left:
                    index, ev = await queue.get()
                    if isinstance(ev, Final):
                        left -= 1
                        open_.discard(index)
                    yield index, ev
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.running -= len(reqs)
            if open_:
                self.finished["cancelled"] = self.finished.get("cancelled", 0) + len(open_)

    def _choice(self, job: Job, index: int, text: str, ids: tuple[int, ...], tops: Any, offset: int,
                final: Optional[Final], delta: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": index}
        if job.kind == "chat":
            if delta:
                c["delta"] = {"content": text} if text else {}
            else:
                c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text if job.text_out else ""
        c["logprobs"] = self._logprobs(job, ids, tops, offset) if job.logprobs is not None and ids else None
        c["finish_reason"] = self.finish_reason(final) if final is not None else None
        if final is not None:
            c["stop_reason"] = final.stop_string
        if job.return_token_ids or not job.text_out:
            c["token_ids"] = list(ids)
        return c

    async def complete(self, job: Job) -> dict[str, Any]:
        """The non-streamed response (raises ApiError when an engine request failed)."""
        n = len(job.prompts) * job.n
        finals: list[Optional[Final]] = [None] * n
        tops: list[list] = [[] for _ in range(n)]
        async for index, ev in self._events(job):
            if isinstance(ev, Final):
                finals[index] = ev
            elif ev.logprobs is not None:
                tops[index].extend(ev.logprobs)
        errors = [f.error or f.finish_reason for f in finals if f is None or f.finish_reason == "error"]
        if errors:
            raise ApiError(500, f"the engine failed: {errors[0]}", type_="server_error")
        done = [f for f in finals if f is not None]
        choices = [self._choice(job, i, self._strip_stop(job, f.text, f), f.token_ids, tops[i], 0, f, False)
                   for i, f in enumerate(done)]
        out = {"id": ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.id,
               "object": "chat.completion" if job.kind == "chat" else "text_completion",
               "created": job.created, "model": job.model, "choices": choices, "usage": self.usage(job, done)}
        if job.return_token_ids:
            if job.kind == "chat":
                out["prompt_token_ids"] = job.prompts[0]
            else:
                for i, c in enumerate(choices):
                    c["prompt_token_ids"] = job.prompts[i // job.n]
        return out

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per engine delta, the finish chunk, usage, [DONE]."""
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        head = f'{{"id":"{"chatcmpl-" if job.kind == "chat" else "cmpl-"}{job.id}","object":"{obj}",' \
               f'"created":{job.created},"model":{_dumps(job.model)},'
        n = len(job.prompts) * job.n
        held: dict[int, Delta] = {}  # a delta that ends with a stop string waits for its Final (stripped)
        offsets = [0] * n
        finals: dict[int, Final] = {}
        started: set[int] = set()
        stops = job.params.stop

        def chunk(choice: dict[str, Any], extra: str = "") -> bytes:
            return f'data: {head}"choices":[{_dumps(choice)}]{extra}}}\n\n'.encode()

        def piece(index: int, d: Delta, final: Optional[Final] = None) -> Optional[bytes]:
            text = self._strip_stop(job, d.text, final)
            if not (text or d.token_ids):
                return None
            c = self._choice(job, index, text, d.token_ids, d.logprobs, offsets[index], None, True)
            if job.return_token_ids and job.kind == "completion" and index not in started:
                c["prompt_token_ids"] = job.prompts[index // job.n]
            started.add(index)
            offsets[index] += len(text)
            return chunk(c)
        if job.kind == "chat":
            for i in range(n):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                yield chunk(first, f',"prompt_token_ids":{_dumps(job.prompts[0])}' if job.return_token_ids and not i else "")
        async for index, ev in self._events(job):
            if isinstance(ev, Delta):
                if index in held:
                    out = piece(index, held.pop(index))
                    if out:
                        yield out
                if stops and any(ev.text.endswith(s) for s in stops):
                    held[index] = ev
                    continue
                out = piece(index, ev)
                if out:
                    yield out
                continue
            finals[index] = ev
            if index in held:
                out = piece(index, held.pop(index), ev)
                if out:
                    yield out
            if ev.finish_reason == "error":
                err = ApiError(500, f"the engine failed: {ev.error}", type_="server_error").body()
                yield f"data: {_dumps(err)}\n\n".encode()
                continue
            c = self._choice(job, index, "", (), None, 0, ev, True)
            c.pop("token_ids", None)
            yield chunk(c)
        if job.include_usage:
            done = [finals[i] for i in sorted(finals)]
            yield f'data: {head}"choices":[],"usage":{_dumps(self.usage(job, done))}}}\n\n'.encode()
        yield b"data: [DONE]\n\n"

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "aimo-trt", "max_model_len": self.max_seq_len}]}

    def metrics(self) -> str:
        lines = ["# TYPE aimo_requests_total counter"]
        lines += [f'aimo_requests_total{{finish_reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
        lines += ["# TYPE aimo_requests_running gauge", f"aimo_requests_running {self.running}",
                  "# TYPE aimo_generation_tokens_total counter", f"aimo_generation_tokens_total {self.generated_tokens}",
                  "# TYPE aimo_prompt_tokens_total counter", f"aimo_prompt_tokens_total {self.prompt_tokens}"]
        return "\n".join(lines) + "\n"


class State:
    """The engine as it loads (in a thread, so the server answers 503 meanwhile), serves, and drains."""

    def __init__(self, load: Callable[[], Any], model_name: str, on_failure: Optional[Callable[[BaseException], None]] = None):
        self.model_name = model_name
        self.api: Optional[Api] = None
        self.error: Optional[str] = None
        self.draining = False
        self.started = time.monotonic()
        self.loaded_seconds: Optional[float] = None
        self._load, self._on_failure = load, on_failure
        self._thread = threading.Thread(target=self._run, name="openai-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            engine = self._load()
            self.api = Api(engine, self.model_name)
            self.loaded_seconds = time.monotonic() - self.started
        except BaseException as e:  # noqa: BLE001 - reported by /health and the log
            self.error = f"{type(e).__name__}: {e}"
            if self._on_failure is not None:
                self._on_failure(e)

    def serving(self) -> Api:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type_="service_unavailable", code="draining")
        if self.api is None:
            if self.error:
                raise ApiError(503, f"the engine failed to load: {self.error}", type_="service_unavailable",
                               code="engine_failed")
            raise ApiError(503, f"the engine is loading ({time.monotonic() - self.started:.0f}s so far)",
                           type_="service_unavailable", code="engine_loading")
        return self.api

    async def close(self) -> None:
        self._thread.join(timeout=600)
        if self.api is not None:
            self.api.close()
            await self.api.engine.close()


def create_app(load: Callable[[], Any], model_name: str,
               on_failure: Optional[Callable[[BaseException], None]] = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> Any:
    """The Starlette app; `load` opens the engine (run in a thread at startup); `app.state.serving` is the State.
    Bodies over `max_request_bytes` get a 413 before they are read; every failure is an OpenAI-shaped
    JSON error (a server fault: 500, logged with its request id, also sent as `x-request-id`)."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = State(load, model_name, on_failure)

    def error(e: ApiError, rid: str = "") -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers={"x-request-id": rid} if rid else None)

    async def read_body(request: HttpRequest) -> bytes:
        """The body, refused with 413 once it is known to pass the limit (from Content-Length, before
        reading; else while reading)."""
        declared = request.headers.get("content-length")
        too_big = (f"the request body is over this server's limit of {max_request_bytes} bytes "
                   "(set by `python -m server.openai.serve --max-request-bytes`)")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, f"Content-Length is not a number (got {declared[:40]!r})") from None
            if size > max_request_bytes:
                raise ApiError(413, f"{too_big}: Content-Length is {size}", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise ApiError(413, too_big, code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def until_disconnect(request: HttpRequest) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def guarded(handler: Callable[[HttpRequest, str], Any]) -> Callable[[HttpRequest], Any]:
        """Every route: ApiErrors as their JSON, anything else a logged JSON 500 with the request id."""
        async def run(request: HttpRequest) -> Response:
            rid = (request.headers.get("x-request-id") or uuid.uuid4().hex)[:64]
            try:
                return await handler(request, rid)
            except ApiError as e:
                return error(e, rid)
            except Exception as e:  # noqa: BLE001 - a server fault: said in JSON, logged with the id
                log.exception("request %s (%s %s) failed", rid, request.method, request.url.path)
                return error(ApiError(500, f"internal server error ({type(e).__name__}); request id {rid}",
                                      type_="server_error"), rid)
        return run

    async def safe_stream(api: Api, job: Job, rid: str) -> AsyncIterator[bytes]:
        """The SSE stream; a fault after the headers went out ends it with an error event and [DONE]."""
        try:
            async for chunk in api.stream(job):
                yield chunk
        except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            log.exception("request %s: stream failed", rid)
            err = ApiError(500, f"internal server error ({type(e).__name__}); request id {rid}", type_="server_error")
            yield f"data: {_dumps(err.body())}\n\ndata: [DONE]\n\n".encode()

    async def generate(request: HttpRequest, rid: str, chat: bool) -> Response:
        api = state.serving()
        job = await api.parse(await read_body(request), chat)
        if job.stream:
            return StreamingResponse(safe_stream(api, job, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "x-request-id": rid})
        work = asyncio.ensure_future(api.complete(job))
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left: cancel its engine requests; nobody reads this answer
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        return JSONResponse(work.result(), headers={"x-request-id": rid})

    async def completions(request: HttpRequest, rid: str) -> Response:
        return await generate(request, rid, chat=False)

    async def chat_completions(request: HttpRequest, rid: str) -> Response:
        return await generate(request, rid, chat=True)

    async def models(request: HttpRequest, rid: str) -> Response:
        return JSONResponse(state.serving().models())

    async def health(request: HttpRequest) -> Response:
        status = "draining" if state.draining else "ok" if state.api else "failed" if state.error else "loading"
        body: dict[str, Any] = {"status": status, "model": model_name}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: HttpRequest) -> Response:
        return PlainTextResponse(state.api.metrics() if state.api else "")

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
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.serving = state
    return app

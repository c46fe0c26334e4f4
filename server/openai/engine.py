"""The `openai` backend: engine requests on any OpenAI-compatible server, one or several replicas.

    engine = OpenAIEngine("http://gpu0:8000/v1,http://gpu1:8000/v1", tokenizer_dir="engines/mix/build/embedded/model")

Every request is a streamed `POST /v1/completions` on one connection pool (httpx2) per event
loop, running in the caller's loop: no thread hop per token (measured: handing each token from a
client thread to the caller's loop cost more than the HTTP itself). As on
every backend, the text comes from the token ids through `server.stream` and stop strings are
matched here: they are never sent to the server, and a match (like `cancel` or the deadline) ends
the request by closing its stream, which an OpenAI-compatible server takes as a cancel.

Exact token continuations. Each replica is probed once: does it take the prompt as token ids, and
how does it return the generated ids? `return_token_ids: true` (vLLM >= 0.10.2, `make serve`),
`detokenize: false` (trtllm-serve), or not at all: then the streamed text is re-tokenized (the text
stays byte for byte, the ids of a continuation may differ from the model's own), and a server that
takes no id prompts gets the prompt decoded with its special tokens.

Replicas. A request goes to the replica that served the longest prefix of its prompt (the next
turn of a TIR sample returns to the KV its server kept), else to the least loaded one, so samples
spread over the servers. A replica that fails (unreachable, 5xx, a stream that breaks) is marked
down for a few seconds and the request continues on another one from the tokens it already has
(prompt + generated so far, the rest of max_tokens); when none is left it ends with an error that
names every replica and what went wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from server.stream import EngineBase, RequestStream
from aimo_spec.chat import load_tokenizer

DOWN_SECONDS = 5.0  # a failed replica is tried again after this long
AFFINITY_ENTRIES = 4096  # token histories remembered for routing continuations back to their replica
_HASH_MOD, _HASH_BASE = (1 << 61) - 1, 1_000_003


class ReplicaFailed(Exception):
    """This replica cannot serve now (unreachable, 5xx, a broken stream): the request fails over."""


class RequestRejected(Exception):
    """The server refused the request itself (4xx): another replica would refuse it too."""


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """`http://host:port[/v1]` items, comma-separated or a list, as base URLs ending in /v1."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = []
    for u in items:
        u = u.strip().rstrip("/")
        if not u:
            continue
        if "://" not in u:
            u = "http://" + u
        out.append(u if u.endswith("/v1") else u + "/v1")
    if not out:
        raise ValueError("openai backend: no server URL given (URL=http://host:port[/v1][,http://...])")
    return out


def error_message(body: bytes | str) -> str:
    """The message of an OpenAI error body ({"error": {"message": ...}}), else the body itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(obj.get("message") or obj.get("detail") or err) if isinstance(obj, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:500]


def prefix_hashes(ids: Sequence[int]) -> list[int]:
    """h[i] = hash of ids[:i] (polynomial, so every prefix costs one step)."""
    out, h = [0], 0
    for t in ids:
        h = (h * _HASH_BASE + int(t) + 1) % _HASH_MOD
        out.append(h)
    return out


@dataclass
class Replica:
    url: str
    model: Optional[str] = None
    max_model_len: Optional[int] = None  # the context /v1/models reports (vLLM, make serve): max_tokens is capped to it
    probed: bool = False
    ids_in: bool = True  # the prompt goes as token ids
    ids_out: str = ""  # return_token_ids | detokenize | "" (text re-tokenized)
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    last_error: str = ""

    def up(self, now: float) -> bool:
        return now >= self.down_until

    def describe(self) -> str:
        ids = {"return_token_ids": "token ids back (return_token_ids)", "detokenize": "token ids back (detokenize: false)",
               "": "text back, re-tokenized"}[self.ids_out]
        return f"{self.url} (model {self.model!r}; prompt as {'token ids' if self.ids_in else 'text'}; {ids})"


class _SameLoop:
    """The streams' outbox: this driver runs in its caller's loop, so an event goes straight into the
    caller's queue (no self-pipe wake-up per token)."""

    @staticmethod
    def put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: Any) -> None:
        queue.put_nowait(event)


@dataclass
class _Pending:
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    task: Optional[asyncio.Task] = None
    end_reason: str = "cancelled"
    errors: list[str] = field(default_factory=list)


class OpenAIEngine(EngineBase):
    name = "openai"
    _outbox = _SameLoop()  # type: ignore[assignment]

    def __init__(self, urls: str | Sequence[str], tokenizer_dir: str, model: Optional[str] = None,
                 api_key: Optional[str] = None, connect_timeout: float = 60.0, token_ids: str = "auto",
                 max_connections: int = 1024):
        """`token_ids`: auto (probe each replica) | off (always text). `model`: the served model's
        name (default: the first one each server lists)."""
        if token_ids not in ("auto", "off"):
            raise ValueError(f"openai backend: token_ids must be auto or off (got {token_ids!r})")
        self.replicas = [Replica(u) for u in split_urls(urls)]
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.model, self.token_ids, self.connect_timeout = model, token_ids, connect_timeout
        key = api_key or os.environ.get("OPENAI_API_KEY") or "none"
        self._headers = {"Authorization": f"Bearer {key}"}
        self._max_connections = max_connections
        self._pending: dict[str, _Pending] = {}
        self._affinity: OrderedDict[tuple[int, int], Replica] = OrderedDict()
        self._lengths: dict[int, int] = {}  # history length -> entries of that length in _affinity
        self._closed = False
        self._ssl: Any = None
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()
        failed: list[BaseException] = []

        def connect() -> None:  # a loop of its own: the caller may or may not be inside one
            try:
                asyncio.run(self._connect())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failed.append(e)
        t = threading.Thread(target=connect, name="openai-connect")
        t.start()
        t.join()
        if failed:
            raise failed[0]

    @property
    def ready(self) -> bool:
        now = time.monotonic()
        return not self._closed and any(r.probed and r.up(now) for r in self.replicas)

    # ---- connections
    def _new_client(self) -> Any:
        import httpx2 as httpx

        if self._ssl is None:  # built once: loading the trust store costs ~35 ms, too much for every loop
            import ssl

            self._ssl = ssl.create_default_context()
        return httpx.AsyncClient(timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None), verify=self._ssl,
                                 limits=httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=256))

    def _client(self) -> Any:
        """The running loop's pool (made on first use; it goes with its loop)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self._new_client()
        return client

    async def _connect(self) -> None:
        async with self._new_client() as client:
            deadline = time.monotonic() + self.connect_timeout
            while True:
                await asyncio.gather(*(self._probe_safely(r, client) for r in self.replicas if not r.probed))
                if any(r.probed for r in self.replicas):
                    return
                if time.monotonic() > deadline:
                    raise ConnectionError(f"openai backend: no server ready after {self.connect_timeout:.0f}s: "
                                          + "; ".join(f"{r.url}: {r.last_error}" for r in self.replicas))
                await asyncio.sleep(0.25)

    async def _probe_safely(self, rep: Replica, client: Any) -> None:
        try:
            await self._probe(rep, client)
        except (ReplicaFailed, RequestRejected) as e:
            self._mark_down(rep, str(e))
        except Exception as e:  # noqa: BLE001 - httpx transport errors: not up (yet)
            self._mark_down(rep, f"{type(e).__name__}: {e}")

    async def _probe(self, rep: Replica, client: Any) -> None:
        """The served model's name, and how this server takes prompts and returns ids (see the module doc)."""
        r = await client.get(rep.url + "/models", headers=self._headers, timeout=10)
        if r.status_code != 200:
            raise ReplicaFailed(f"GET /v1/models: HTTP {r.status_code}: {error_message(r.content)}")
        listed = [m for m in (r.json().get("data") or []) if isinstance(m, dict)]
        models = [m.get("id") for m in listed]
        if self.model and models and self.model not in models:
            raise RequestRejected(f"serves {models}, not {self.model!r}")
        if not (self.model or models):
            raise RequestRejected("lists no model (GET /v1/models)")
        rep.model = self.model or models[0]
        length = next((m.get("max_model_len") for m in listed if m.get("id") == rep.model), None)
        rep.max_model_len = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        ids_in, ids_out = False, ""
        if self.token_ids == "auto":
            ids = self.tokenize("1 + 1 =")
            base = {"model": rep.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
            for mode, extra in (("return_token_ids", {"return_token_ids": True}), ("detokenize", {"detokenize": False}),
                                ("", {})):
                resp = await client.post(rep.url + "/completions", json={**base, **extra}, headers=self._headers,
                                               timeout=60)
                if resp.status_code >= 500:
                    raise ReplicaFailed(f"POST /v1/completions: HTTP {resp.status_code}: {error_message(resp.content)}")
                if resp.status_code != 200:
                    continue
                ids_in = True
                choices = resp.json().get("choices") or [{}]
                if mode and isinstance(choices[0].get("token_ids"), list) and choices[0]["token_ids"]:
                    ids_out = mode
                    break
                if not mode:
                    break
        rep.ids_in, rep.ids_out, rep.probed = ids_in, ids_out, True
        rep.down_until, rep.last_error = 0.0, ""

    def _mark_down(self, rep: Replica, error: str) -> None:
        rep.failures += 1
        rep.last_error = error
        rep.down_until = time.monotonic() + DOWN_SECONDS

    # ---- routing
    def _pick(self, hashes: Optional[list[int]], exclude: set[int]) -> Optional[Replica]:
        cands = [r for r in self.replicas if id(r) not in exclude]
        if not cands:
            return None
        now = time.monotonic()
        if hashes is not None:
            n = len(hashes) - 1
            for length in sorted(self._lengths, reverse=True):
                if length <= n:
                    rep = self._affinity.get((length, hashes[length]))
                    if rep is not None and id(rep) not in exclude and rep.up(now):
                        return rep
        up = [r for r in cands if r.up(now)] or [min(cands, key=lambda r: r.down_until)]
        return min(up, key=lambda r: (r.in_flight, r.served))

    def _remember(self, tokens: Sequence[int], rep: Replica) -> None:
        key = (len(tokens), prefix_hashes(tokens)[-1])
        if key in self._affinity:
            self._affinity.move_to_end(key)
        else:
            self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
        self._affinity[key] = rep
        while len(self._affinity) > AFFINITY_ENTRIES:
            (length, _), _ = self._affinity.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    # ---- the driver (generate, tokenize, detokenize, chat_prompt: EngineBase)
    def _submit(self, stream: RequestStream) -> None:
        """Called by `generate` inside the caller's loop: the request runs there as a task."""
        if self._closed:
            stream.finish("error", "openai engine closed")
            return
        p = _Pending(stream, stream.loop)
        self._pending[stream.request_id] = p
        p.task = stream.loop.create_task(self._run(p))
        p.task.add_done_callback(lambda t: self._ended(p, t))

    def cancel(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is not None:
            self._cancel_soon(p, "cancelled")

    def _cancel_soon(self, p: _Pending, reason: str) -> None:
        try:
            p.loop.call_soon_threadsafe(self._cancel_request, p, reason)
        except RuntimeError:  # its loop is closed: nobody waits for it any more
            pass

    def _cancel_request(self, p: _Pending, reason: str) -> None:
        if not p.stream.done and p.task is not None:
            p.end_reason = reason
            p.task.cancel()

    def shutdown(self) -> None:
        """End every request (error: engine closed); a pool whose loop still runs is closed there."""
        if self._closed:
            return
        self._closed = True
        for p in list(self._pending.values()):
            self._cancel_soon(p, "error")
        for loop, client in list(self._clients.items()):
            if loop.is_running():
                try:
                    loop.call_soon_threadsafe(lambda c=client, lp=loop: lp.create_task(c.aclose()))
                except RuntimeError:
                    pass
        self._clients.clear()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        mine = [p.task for p in self._pending.values() if p.loop is loop and p.task is not None]
        self.shutdown()
        if mine:
            await asyncio.wait(mine, timeout=10)
        if client is not None:
            await client.aclose()

    def _ended(self, p: _Pending, task: asyncio.Task) -> None:
        """Whatever happened, the request ends exactly once (a task cancelled before it ran included)."""
        self._pending.pop(p.stream.request_id, None)
        if not p.stream.done:
            err = None if task.cancelled() else task.exception()
            if err is not None:
                p.stream.finish("error", f"openai backend: {type(err).__name__}: {err}")
            else:
                p.stream.finish(p.end_reason, "openai engine closed" if p.end_reason == "error" else "")  # type: ignore[arg-type]

    async def _run(self, p: _Pending) -> None:
        s = p.stream
        deadline = s.request.deadline
        try:
            if deadline is None:
                await self._generate(p)
            else:
                async with asyncio.timeout_at(p.loop.time() + (deadline - time.monotonic())):
                    await self._generate(p)
        except TimeoutError:
            s.finish("timeout")
        except asyncio.CancelledError:
            s.finish(p.end_reason, "openai engine closed" if p.end_reason == "error" else "")  # type: ignore[arg-type]

    async def _generate(self, p: _Pending) -> None:
        s = p.stream
        hashes = prefix_hashes(s.prompt) if len(self.replicas) > 1 else None
        tried: set[int] = set()
        rep: Optional[Replica] = None
        while not s.done:
            rep = self._pick(hashes, tried)
            if rep is None:
                s.finish("error", f"every replica failed ({len(self.replicas)}): " + "; ".join(p.errors))
                return
            tried.add(id(rep))
            rep.in_flight += 1
            try:
                if not rep.probed:
                    try:
                        await self._probe(rep, self._client())
                    except (asyncio.CancelledError, ReplicaFailed):
                        raise
                    except Exception as e:  # noqa: BLE001 - unreachable, or not the model asked for
                        raise ReplicaFailed(f"not usable: {type(e).__name__}: {e}") from None
                await self._stream_once(rep, p, first=len(tried) == 1)
                rep.served += 1
            except RequestRejected as e:
                s.finish("error", f"{rep.url}: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - ReplicaFailed or a transport error: fail over
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, ReplicaFailed) else str(e)
                p.errors.append(f"{rep.url}: {msg}")
                self._mark_down(rep, msg)
            finally:
                rep.in_flight -= 1
        if rep is not None and len(self.replicas) > 1:
            self._remember(s.prompt + s.generated, rep)

    def _body(self, rep: Replica, s: RequestStream) -> dict[str, Any]:
        p = s.params
        history = s.prompt + s.generated
        body: dict[str, Any] = {
            "model": rep.model, "max_tokens": self._room(rep, s), "temperature": p.temperature,
            "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True},
            "prompt": history if rep.ids_in else self.tokenizer.decode(history, skip_special_tokens=False)}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.top_k:
            body["top_k"] = p.top_k
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.top_logprobs:
            body["logprobs"] = p.top_logprobs
        if rep.ids_out == "return_token_ids":
            body["return_token_ids"] = True
            if p.top_logprobs:
                body["return_tokens_as_token_ids"] = True
        elif rep.ids_out == "detokenize":
            body["detokenize"] = False
        return body

    @staticmethod
    def _room(rep: Replica, s: RequestStream) -> int:
        """Tokens left to ask for: the rest of max_tokens, within the replica's context (servers refuse
        a prompt plus max_tokens over it, as vLLM and OpenAI do; the engines here end such a request at
        the context, so capping keeps the same result)."""
        left = s.params.max_tokens - len(s.generated)
        if rep.max_model_len is not None:
            left = min(left, rep.max_model_len - len(s.prompt) - len(s.generated))
        return left

    async def _stream_once(self, rep: Replica, p: _Pending, first: bool) -> None:
        s = p.stream
        if self._room(rep, s) <= 0:
            s.finish("length")
            return
        finish: Optional[str] = None
        async with self._client().stream("POST", rep.url + "/completions", json=self._body(rep, s),
                                         headers=self._headers) as r:
            if r.status_code != 200:
                msg = f"HTTP {r.status_code}: {error_message(await r.aread())}"
                if r.status_code in (408, 429) or r.status_code >= 500:
                    raise ReplicaFailed(msg)
                raise RequestRejected(msg)
            rest = b""
            async for chunk in r.aiter_bytes():  # server-sent events, split here (cheaper than line iterators)
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        s.finish("error", f"{rep.url}: {error_message(data)}")
                        return
                    usage = obj.get("usage")
                    if first and usage:
                        s.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    for c in obj.get("choices") or ():
                        ids = c.get("token_ids") if rep.ids_out else None
                        if ids is None:
                            text = c.get("text") or ""
                            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
                        if ids and self._push(s, ids, self._logprobs(c.get("logprobs"), s.params.top_logprobs)):
                            return
                        finish = c.get("finish_reason") or finish
                else:
                    continue
                break
        if finish is None:
            raise ReplicaFailed("the stream ended before the request finished")
        s.finish("length" if finish == "length" else "stop" if finish == "stop" else "error",
                 "" if finish in ("stop", "length") else f"{rep.url}: finish_reason {finish!r}")

    def _push(self, s: RequestStream, ids: list[int], logprobs: Any) -> bool:
        """Hand ids to the stream; True when that ended the request (a stop string or stop token)."""
        stops = s.params.stop_token_ids
        cut = next((i for i, t in enumerate(ids) if t in stops), None) if stops else None
        if cut is not None:
            matched = s.push(ids[:cut], logprobs[:cut] if logprobs else None)
            if matched is None:
                s.push(ids[cut:cut + 1], logprobs[cut:cut + 1] if logprobs else None, text=False)
            s.finish("stop")
            return True
        if s.push(ids, logprobs) is not None:
            s.finish("stop")
            return True
        return False

    def _logprobs(self, lp: Any, k: int) -> Any:
        """Completions-style logprobs -> per token, the top (id, logprob) pairs."""
        if not k or not isinstance(lp, dict) or not lp.get("top_logprobs"):
            return None
        out = []
        for top in lp["top_logprobs"]:
            pairs = sorted(((self._token_id(t), float(v)) for t, v in (top or {}).items()), key=lambda x: -x[1])
            out.append(tuple(pairs[:k]))
        return tuple(out)

    def _token_id(self, token: str) -> int:
        if token.startswith("token_id:"):
            return int(token[9:])
        ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
        return int(ids[0]) if ids else -1

    def describe(self) -> str:
        return "; ".join(r.describe() if r.probed else f"{r.url} (not reached yet: {r.last_error})" for r in self.replicas)

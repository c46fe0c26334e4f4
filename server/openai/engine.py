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

This module is the driver: requests as tasks in their caller's loop, their end (cancel, deadline,
close), failover across replicas. Beside it: `replicas` (a replica and its failures), `routing`
(which replica), `probe` (what a replica supports), `remote_completion` (one streamed request),
`connections` (the pool of each loop).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from aimo_spec.chat import load_tokenizer
from server.openai.connections import LoopClients
from server.openai.probe import probe
from server.openai.remote_completion import stream_completion
from server.openai.replicas import Replica, ReplicaFailed, RequestRejected, split_urls
from server.openai.routing import Router, prefix_hashes
from server.stream import EngineBase, RequestStream


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
        self._pending: dict[str, _Pending] = {}
        self._router = Router(self.replicas)
        self._closed = False
        self._clients = LoopClients(max_connections)
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
    def separates_cache_salts(self) -> bool:  # type: ignore[override]
        """The salt is forwarded (`cache_salt`): true once every replica was probed keeping salts apart."""
        return all(r.probed and r.salts for r in self.replicas)

    @property
    def max_seq_len(self) -> Optional[int]:
        """The smallest context the probed replicas report (`max_model_len`; None when none does): what
        `make serve --backend openai` reports in its own /v1/models, so a client of that server (this
        backend included) caps max_tokens as it would against the replicas themselves."""
        known = [r.max_model_len for r in self.replicas if r.probed and r.max_model_len]
        return min(known) if known else None

    @property
    def ready(self) -> bool:
        now = time.monotonic()
        return not self._closed and any(r.probed and r.up(now) for r in self.replicas)

    # ---- connecting: every replica probed
    async def _connect(self) -> None:
        async with self._clients.new() as client:
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
            rep.mark_down(str(e))
        except Exception as e:  # noqa: BLE001 - httpx transport errors: not up (yet)
            rep.mark_down(f"{type(e).__name__}: {e}")

    async def _probe(self, rep: Replica, client: Any) -> None:
        """The served model's name, and how this server takes prompts and returns ids (see `probe`)."""
        await probe(rep, client, self._headers, self.model, self.token_ids, self.tokenize)

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
        self._clients.close_all_soon()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop)
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
                why = "openai engine closed" if p.end_reason == "error" else ""
                p.stream.finish(p.end_reason, why)  # type: ignore[arg-type]

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
            rep = self._router.pick(hashes, tried)
            if rep is None:
                s.finish("error", f"every replica failed ({len(self.replicas)}): " + "; ".join(p.errors))
                return
            tried.add(id(rep))
            rep.in_flight += 1
            try:
                if not rep.probed:
                    try:
                        await self._probe(rep, self._clients.current())
                    except (asyncio.CancelledError, ReplicaFailed):
                        raise
                    except Exception as e:  # noqa: BLE001 - unreachable, or not the model asked for
                        raise ReplicaFailed(f"not usable: {type(e).__name__}: {e}") from None
                await stream_completion(self._clients, self._headers, rep, s, self.tokenizer, first=len(tried) == 1)
                rep.served += 1
            except RequestRejected as e:
                s.finish("error", f"{rep.url}: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - ReplicaFailed or a transport error: fail over
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, ReplicaFailed) else str(e)
                p.errors.append(f"{rep.url}: {msg}")
                rep.mark_down(msg)
            finally:
                rep.in_flight -= 1
        if rep is not None and len(self.replicas) > 1:
            self._router.remember(s.prompt + s.generated, rep)

    def describe(self) -> str:
        return "; ".join(r.describe() if r.probed else f"{r.url} (not reached yet: {r.last_error})"
                         for r in self.replicas)

"""Generation over one engine for the HTTP server: a Job's engine requests run and merged, the whole
(non-streamed) response, the model list, and the counters `GET /metrics` reports.

The HTTP layer (`server.openai.app`) holds one Api once the engine has loaded; parsing is its
`parser`, the streamed response is `server.openai.sse`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from aimo_spec.protocol import Final, Request
from server.openai.api_error import ApiError
from server.openai.job import Job
from server.openai.parsing import RequestParser
from server.openai.responses import ResponseShaper


class Api:
    """Parsing, generation and response shapes over one engine (the HTTP layer is `create_app`)."""

    def __init__(self, engine: Any, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.parser = RequestParser(engine, model_name)
        self.responses = ResponseShaper(engine.tokenizer)
        self.finished: dict[str, int] = {}
        self.running = 0
        self._open: set[str] = set()  # engine request ids whose Final has not come (cancel_running)
        self.generated_tokens = 0
        self.prompt_tokens = 0

    def close(self) -> None:
        self.parser.close()

    def _count(self, final: Final) -> None:
        """A finished engine request, in the counters."""
        self.finished[final.finish_reason] = self.finished.get(final.finish_reason, 0) + 1
        self.generated_tokens += len(final.token_ids)

    async def events(self, job: Job) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, Delta | Final) of every choice, merged; closing it cancels them all."""
        reqs = job.requests()
        self.running += len(reqs)
        self.prompt_tokens += sum(len(p) for p in job.prompts)
        open_ = {i for i, _, _ in reqs}  # choices whose Final has not come: cancelled if the caller leaves
        ids = {i: req.request_id for i, _, req in reqs}
        self._open.update(ids.values())
        try:
            if len(reqs) == 1:
                index, _, req = reqs[0]
                async for ev in self.engine.generate(req):
                    if isinstance(ev, Final):
                        self._count(ev)
                        open_.discard(index)
                        self._open.discard(ids[index])
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
                        self._open.discard(ids[index])
                    yield index, ev
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.running -= len(reqs)
            self._open.difference_update(ids.values())
            if open_:
                self.finished["cancelled"] = self.finished.get("cancelled", 0) + len(open_)

    def cancel_running(self) -> None:
        """Cancel every engine request still running (the drain's deadline): each ends with its Final
        ("cancelled"), so its response still ends properly."""
        for rid in list(self._open):
            self.engine.cancel(rid)

    async def complete(self, job: Job) -> dict[str, Any]:
        """The non-streamed response (raises ApiError when an engine request failed)."""
        n = len(job.prompts) * job.n
        finals: list[Optional[Final]] = [None] * n
        tops: list[list] = [[] for _ in range(n)]
        async for index, ev in self.events(job):
            if isinstance(ev, Final):
                finals[index] = ev
            elif ev.logprobs is not None:
                tops[index].extend(ev.logprobs)
        errors = [f.error or f.finish_reason for f in finals if f is None or f.finish_reason == "error"]
        if errors:
            raise ApiError(500, f"the engine failed: {errors[0]}", type_="server_error")
        done = [f for f in finals if f is not None]
        shape = self.responses
        choices = [shape.choice(job, i, shape.strip_stop(job, f.text, f), f.token_ids, tops[i], 0, f, False)
                   for i, f in enumerate(done)]
        out = {"id": ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.id,
               "object": "chat.completion" if job.kind == "chat" else "text_completion",
               "created": job.created, "model": job.model, "choices": choices, "usage": shape.usage(job, done)}
        if job.return_token_ids:
            if job.kind == "chat":
                out["prompt_token_ids"] = job.prompts[0]
            else:
                for i, c in enumerate(choices):
                    c["prompt_token_ids"] = job.prompts[i // job.n]
        return out

    def models(self) -> dict[str, Any]:
        """The `GET /v1/models` answer: the one model served, with its context length."""
        return {"object": "list", "data": [self.model(self.model_name)]}

    def model(self, name: str) -> dict[str, Any]:
        """The `GET /v1/models/{name}` answer: the served model's object, else a 404 `model_not_found`."""
        if name != self.model_name:
            raise ApiError(404, f"The model {name[:200]!r} does not exist (this server serves {self.model_name!r})",
                           "model", code="model_not_found")
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "aimo-trt",
                "max_model_len": self.parser.max_seq_len}

    def metrics(self) -> str:
        """The counters as Prometheus text (`GET /metrics`)."""
        lines = ["# TYPE aimo_requests_total counter"]
        lines += [f'aimo_requests_total{{finish_reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
        lines += ["# TYPE aimo_requests_running gauge", f"aimo_requests_running {self.running}",
                  "# TYPE aimo_generation_tokens_total counter",
                  f"aimo_generation_tokens_total {self.generated_tokens}",
                  "# TYPE aimo_prompt_tokens_total counter", f"aimo_prompt_tokens_total {self.prompt_tokens}"]
        return "\n".join(lines) + "\n"

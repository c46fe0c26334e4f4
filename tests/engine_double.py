"""A scripted engine (test double) implementing the engine protocol, for deterministic harness tests.

Text is tokenized one character per token (id = code point), so token ids and text map exactly.
`top_prob` (optional) gives the probability of the top token for the reported logprobs, per request;
`chunk_prob` per streamed chunk.
A script maps the prompt text to the chunks the "model" streams (each chunk is one step); stop
strings are matched with the product's StopMatcher, across chunk boundaries, as a real backend does.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator, Callable, Optional, Sequence

from aimo_spec.protocol import Delta, Event, Final, Request
from server.textstream import StopMatcher

Script = Callable[[str, Request], list[str]]


class ScriptedEngine:
    name = "scripted"

    def __init__(self, script: Script, step_seconds: float = 0.0, top_prob: Optional[Callable[[Request], float]] = None,
                 chunk_prob: Optional[Callable[[Request, str], float]] = None):
        self.script, self.step_seconds, self.top_prob, self.chunk_prob = script, step_seconds, top_prob, chunk_prob
        self.requests: list[Request] = []
        self.finals: list[Final] = []
        self._cancelled: set[str] = set()

    def tokenize(self, text: str, literal: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in token_ids)

    def chat_prompt(self, problem: str, system_prompt: Optional[str] = None) -> str:
        return f"<user>{problem}</user><assistant>"

    def chat_ids(self, problem: str, system_prompt: Optional[str] = None) -> list[int]:
        return self.tokenize(self.chat_prompt(problem, system_prompt))

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    async def close(self) -> None:
        pass

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        self.requests.append(request)
        prompt = request.prompt if isinstance(request.prompt, str) else self.detokenize(request.prompt)
        chunks = self.script(prompt, request)
        stopper = StopMatcher(request.params.stop)
        text, ids = [], []
        reason, stop_string, overhang = "stop", None, ""
        t0 = time.monotonic()
        for chunk in chunks:
            if self.step_seconds:
                await asyncio.sleep(self.step_seconds)
            else:
                await asyncio.sleep(0)
            if request.request_id in self._cancelled:
                reason = "cancelled"
                break
            if request.deadline is not None and time.monotonic() >= request.deadline:
                reason = "timeout"
                break
            if len(ids) + len(chunk) > request.params.max_tokens:
                chunk = chunk[: request.params.max_tokens - len(ids)]
                reason = "length"
            ids.extend(ord(c) for c in chunk)
            emit, matched, over = stopper.feed(chunk)
            text.append(emit)
            lp = None
            if request.params.top_logprobs and (self.top_prob is not None or self.chunk_prob is not None):
                # two candidates: p and 1 - p; chunk_prob sets p per chunk (entropy near the answer)
                p = self.chunk_prob(request, chunk) if self.chunk_prob is not None else self.top_prob(request)
                lp = tuple(((1, math.log(p)), (2, math.log(1 - p))) for _ in chunk)
            yield Delta(tuple(ord(c) for c in chunk), emit, lp)
            if matched is not None:
                stop_string, overhang, reason = matched, over, "stop"
                break
            if reason == "length":
                break
        if stop_string is None:
            text.append(stopper.flush())
        final = Final(request.request_id, reason, "".join(text), tuple(ids), len(request.prompt),  # type: ignore[arg-type]
                      stop_string, overhang, seconds=time.monotonic() - t0)
        self.finals.append(final)
        yield final

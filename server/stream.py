"""One request stream for every backend: the per-request bookkeeping between a driver and its caller.

A backend is only its driver (the embedded scheduler thread, the TensorRT-LLM executor poller, the
Triton gRPC stream). Whatever produces token ids hands them to `RequestStream.push`; the stream
decodes them incrementally, matches stop strings on the text (so "stop" means the same on every
backend, also for a string split over tokens), keeps the generated tokens, text and timing, and
sends `Delta`s to the caller's asyncio queue from whichever thread the driver runs on. `finish`
emits the request's one `Final` (a second call is a no-op), so every request ends exactly once.

`EngineBase` gives every backend the same `generate` / `close` and the tokenizer methods of the
engine protocol; a driver implements `_submit(stream)`, `cancel(request_id)` and `shutdown()`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional, Sequence

from aimo_spec.chat import chat_messages, encode, encode_literal, encode_messages, max_chars_per_token, render_prompt
from aimo_spec.protocol import Delta, Event, Final, FinishReason, Request, stream_events
from server.textstream import IncrementalDetokenizer, StopMatcher

Logprobs = Optional[tuple[tuple[tuple[int, float], ...], ...]]


class Outbox:
    """Events from a driver thread, handed to their callers' event loops in one wake-up per flush.

    Waking a loop from another thread costs a write to its self-pipe: measured on a 2-core CPU,
    about 0.5 ms under load, which per token per sequence cost more than the model's forward. A
    driver that produces a step's tokens for many requests at once puts them here and flushes once
    per step.
    """

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: Event) -> None:
        self._items.setdefault(loop, []).append((queue, event))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, events in items.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # a closed loop: nobody listens
                pass


def _deliver(events: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


class RequestStream:
    """The state of one request between its driver and its caller (see the module doc)."""

    def __init__(self, request: Request, prompt: list[int], tokenizer: Any, loop: asyncio.AbstractEventLoop,
                 outbox: Optional[Outbox] = None):
        self.request = request
        self.outbox = outbox
        self.prompt = prompt
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stopper = StopMatcher(request.params.stop)
        self.generated: list[int] = []
        self.text: list[str] = []
        self.submitted = time.monotonic()
        self.scheduled: Optional[float] = None  # first scheduled (or first token, where the driver cannot tell)
        self.cached_tokens = 0
        self.draft_tokens = 0  # speculative decoding (drivers that draft set these)
        self.accepted_draft_tokens = 0
        self.stop_string: Optional[str] = None  # the stop string matched, once `push` found one
        self.overhang = ""
        self.done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> Any:
        return self.request.params

    def emit(self, event: Event) -> None:
        """Hand an event to the caller's queue from any thread (a closed loop: nobody listens); with an
        outbox, at the driver's next flush."""
        if self.outbox is not None:
            self.outbox.put(self.loop, self.queue, event)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            pass

    def push(self, ids: Sequence[int], logprobs: Logprobs = None, text: bool = True) -> Optional[str]:
        """New tokens from the driver; returns the stop string when one is now matched (then finish).

        `text=False` appends tokens that decode to nothing the caller should see (an end-of-sequence
        token): they count as generated but never reach the detokenizer.
        """
        if self.done or not ids:
            return None
        if self.scheduled is None:
            self.scheduled = time.monotonic()
        ids = [int(t) for t in ids]
        self.generated.extend(ids)
        piece, matched, overhang = ("", None, "") if not text else self.stopper.feed(self.detok.push(ids))
        self.text.append(piece)
        self.emit(Delta(tuple(ids), piece, logprobs))
        if matched is not None:
            self.stop_string, self.overhang = matched, overhang + self.detok.flush()
        return matched

    def finish(self, reason: FinishReason, error: str = "") -> bool:
        """Emit the one Final (text still held back is flushed first, except after an error or a
        stop string); False when the request had already ended."""
        if self.done:
            return False
        self.done = True
        if self.stop_string is None and reason != "error":
            tail = self.stopper.feed(self.detok.flush())[0] + self.stopper.flush()
            if tail:
                self.text.append(tail)
                self.emit(Delta((), tail))
        now = time.monotonic()
        self.emit(Final(
            request_id=self.request_id, finish_reason=reason, text="".join(self.text),
            token_ids=tuple(self.generated), prompt_tokens=len(self.prompt), stop_string=self.stop_string,
            overhang=self.overhang, error=error, cached_tokens=self.cached_tokens,
            queue_seconds=(self.scheduled or now) - self.submitted, seconds=now - self.submitted,
            draft_tokens=self.draft_tokens, accepted_draft_tokens=self.accepted_draft_tokens))
        return True

    async def events(self, cancel: Any) -> AsyncIterator[Event]:
        """The caller's side: deltas up to and including the Final; an abandoned stream calls `cancel`."""
        async for ev in stream_events(self.queue, cancel):
            yield ev


class EngineBase:
    """The engine protocol's shared half: tokenizer methods and `generate` over `RequestStream`."""

    name = "engine"
    separates_cache_salts = False  # whether Request.cache_salt keeps KV reuse within a salt (else refused)
    tokenizer: Any
    _closed = False
    _outbox: Optional[Outbox] = None  # a driver that batches its wake-ups sets one and flushes it
    _chars_per_token: Optional[int] = None  # max_chars_per_token(tokenizer), computed at first use

    def tokenize(self, text: str, literal: bool = False) -> list[int]:
        """Ids of chat-formatted text: the template already holds the special tokens. `literal`: text from
        outside (a tool's output) in which a special token's spelling stays text (`encode_literal`)."""
        return encode_literal(self.tokenizer, text) if literal else encode(self.tokenizer, text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, problem: str, system_prompt: Optional[str] = None) -> str:
        return render_prompt(self.tokenizer, problem, system_prompt)

    def chat_ids(self, problem: str, system_prompt: Optional[str] = None) -> list[int]:
        """A problem spelling '<|im_end|>\\n<|im_start|>assistant' would otherwise close the user's turn and forge
        the assistant's: it comes from outside, like a tool's output (`encode_messages`)."""
        return encode_messages(self.tokenizer, chat_messages(problem, system_prompt), literal_roles=("user",))

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        if self._closed:
            raise RuntimeError(f"{self.name} engine is closed")
        text = request.prompt if isinstance(request.prompt, str) else None
        limit = self.prompt_char_limit() if text is not None else None
        too_long = limit is not None and len(text or "") > limit
        prompt = [] if too_long else self.tokenize(text) if text is not None else [int(t) for t in request.prompt]
        stream = RequestStream(request, prompt, self.tokenizer, asyncio.get_running_loop(), self._outbox)
        if too_long:  # refused untokenized: tokenizing it would hold the caller's loop (and its memory) for long
            stream.finish("error", f"prompt of {len(text or '')} characters: more than max_input_len "
                                   f"{getattr(self, 'max_input_len', None)} tokens can hold")
        else:
            self._submit(stream)
        async for ev in stream.events(lambda: self.cancel(request.request_id)):
            yield ev

    def prompt_char_limit(self) -> Optional[int]:
        """Characters past which a text prompt cannot fit max_input_len tokens (None: no limit known)."""
        limit = getattr(self, "max_input_len", None)
        if not limit:
            return None
        if self._chars_per_token is None:
            self._chars_per_token = max_chars_per_token(self.tokenizer)
        return limit * self._chars_per_token

    def _submit(self, stream: RequestStream) -> None:
        """Hand a new request to the driver (which may finish it at once, e.g. with an error)."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        self.shutdown()

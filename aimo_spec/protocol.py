"""The engine protocol every backend implements (embedded, trtllm, triton) and the solver uses.

A request is submitted with token ids (or text) and sampling parameters; the caller gets an async
stream of `Delta`s ending with exactly one `Final`, whatever happens: finished, stopped, cancelled,
timed out, or the engine failed. Stop strings are matched on decoded text, so a string split over
several tokens still stops the request; `Final.overhang` is the decoded text of the last token past
the end of the stop string, so that `text + overhang` is what the tokens decode to (the prefix
contract: a continuation can reuse the exact token history).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Literal, Optional, Protocol, Sequence, Union

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "cancelled", "timeout", "error")


# Temperatures below this sample greedily: logits / t overflows float32 from about 1e-37 (NaN probabilities, token 0
# drawn), and long before that the tempered distribution is the argmax (vLLM's floor is the same 1e-5)
GREEDY_BELOW_TEMPERATURE = 1e-5

# Stop strings and ids are matched against every sequence at every step, on the engine's thread: their count and
# length bound that work for every client (OpenAI takes 4 strings; 600k strings stalled an engine for minutes, 100k
# made another client's request 17x slower)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 128  # besides the model's end-of-sequence ids
# (token, logprob) pairs a generated token may carry, as OpenAI's API: every front end (OpenAI, Triton) refuses more
# and the engines hold to it (a top-k over the vocabulary each step, a row of pairs each token)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0: greedy (and any temperature below GREEDY_BELOW_TEMPERATURE)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: Optional[int] = None
    max_tokens: int = 1024
    stop: tuple[str, ...] = ()  # matched on decoded text
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence ids
    top_logprobs: int = 0  # return this many (token id, logprob) pairs per generated token
    ignore_eos: bool = False  # run to max_tokens (benchmarks)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be >= 0 (got {self.temperature})")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not (0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0 or self.max_tokens < 1 or self.top_logprobs < 0:
            raise ValueError(f"SamplingParams: top_k, top_logprobs must be >= 0 and max_tokens >= 1 (got {self})")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop: stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"SamplingParams.stop: at most {MAX_STOP_STRINGS} stop strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters (got {len(self.stop)}, the longest "
                             f"{max(map(len, self.stop))})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids "
                             f"(got {len(self.stop_token_ids)})")
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.top_logprobs: at most {MAX_TOP_LOGPROBS} (got {self.top_logprobs})")


@dataclass
class Request:
    prompt: Union[str, Sequence[int]]  # text (tokenized by the engine) or token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    deadline: Optional[float] = None  # time.monotonic() after which the request ends with 'timeout'
    # KV prefixes are reused only between requests with the same salt: one per tenant of a shared server (reused
    # KV shows in the first-token time and cached_tokens, telling a client how another's prompt began)
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"


_ids = itertools.count()


@dataclass(frozen=True)
class Delta:
    """Newly generated tokens and the text they complete (text may lag tokens by a partial character
    or a possible stop-string prefix; it catches up at the latest in `Final`)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: Optional[tuple[tuple[tuple[int, float], ...], ...]] = None  # per token: top (id, logprob)


@dataclass(frozen=True)
class Final:
    request_id: str
    finish_reason: FinishReason
    text: str  # all generated text, cut right after the stop string when one matched
    token_ids: tuple[int, ...]  # all generated tokens
    prompt_tokens: int
    stop_string: Optional[str] = None
    overhang: str = ""  # decoded text of the tokens past the stop string (see module doc)
    error: str = ""
    cached_tokens: int = 0  # prompt tokens served from a reused KV prefix
    queue_seconds: float = 0.0  # submitted -> first scheduled
    seconds: float = 0.0  # submitted -> final
    draft_tokens: int = 0  # speculative decoding: tokens the drafter proposed for this request
    accepted_draft_tokens: int = 0  # ... and those the target kept (each step also adds one of its own)


Event = Union[Delta, Final]


class Engine(Protocol):
    """What the solver needs from a backend."""

    name: str

    def tokenize(self, text: str, literal: bool = False) -> list[int]: ...  # literal: special-token spellings stay text

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def chat_prompt(self, problem: str, system_prompt: Optional[str] = None) -> str: ...

    def chat_ids(self, problem: str, system_prompt: Optional[str] = None) -> list[int]:
        """The chat prompt's ids with the problem taken literally (its special-token spellings stay text)."""
        ...

    def generate(self, request: Request) -> AsyncIterator[Event]:
        """Submit and stream; ends with one Final. Breaking out of the iterator cancels the request."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ask a request to end; its stream still ends with a Final ('cancelled' unless it had finished)."""
        ...

    async def close(self) -> None: ...


async def stream_events(out: "asyncio.Queue[Event]", cancel: Callable[[], None]) -> AsyncIterator[Event]:
    """A backend's per-request event queue as the caller's stream: up to and including the Final.

    A consumer that stops early (break, exception, task cancelled) cancels the request, so an
    abandoned stream never keeps generating.
    """
    finished = False
    try:
        while True:
            ev = await out.get()
            yield ev
            if isinstance(ev, Final):
                finished = True
                return
    finally:
        if not finished:
            cancel()


async def collect(engine: Engine, request: Request) -> tuple[list[Delta], Optional[Final]]:
    """Run one request to its end: its deltas and its Final."""
    deltas: list[Delta] = []
    final: Optional[Final] = None
    async for ev in engine.generate(request):
        if isinstance(ev, Final):
            final = ev
        else:
            deltas.append(ev)
    return deltas, final

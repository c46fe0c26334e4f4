"""One validated request to the HTTP server, as engine requests: what the parser makes and the rest serves.

Its own module because the parser builds it and generation, streaming and the app read it; it
knows how one HTTP request fans out into engine requests (a prompt list times n choices).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Optional

from aimo_spec.protocol import Request, SamplingParams


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
    cache_salt: str = ""  # KV prefixes are shared only within a salt (Request.cache_salt)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def requests(self) -> list[tuple[int, int, Request]]:
        """(choice index, prompt index, engine request) for every choice."""
        out = []
        for pi, prompt in enumerate(self.prompts):
            for i in range(self.n):
                # choice i samples with seed + i, as the unsigned 64 bits every backend's generator takes
                # (TensorRT-LLM's and Triton's seeds are uint64; torch folds a negative seed the same way)
                seeded = self.params.seed is not None
                p = replace(self.params, seed=(self.params.seed + i) % 2**64) if seeded else self.params
                out.append((pi * self.n + i, pi, Request(prompt, p, f"{self.kind}-{self.id}-{pi * self.n + i}",
                                                            cache_salt=self.cache_salt)))
        return out

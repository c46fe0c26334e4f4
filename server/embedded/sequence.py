"""The records the embedded engine's parts share: one request in flight (`Seq`) and the counters (`EngineStats`).

The scheduler places a `Seq` in a slot, a step policy advances it, and the engine streams its tokens;
each reads and writes the fields below, so they live apart from all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from aimo_spec.protocol import Request, SamplingParams
from server.stream import RequestStream


@dataclass(eq=False)
class Seq:
    """A request in the scheduler: its stream plus where its KV lives. Compared by identity (one object
    a request), not field by field."""

    stream: RequestStream
    gen: torch.Generator
    seed: int  # the device sampler's noise key (the CPU sampler uses `gen`)
    slot: int = -1
    kv_len: int = 0  # tokens whose KV is in the slot
    pending: Optional[int] = None  # sampled, not yet in the cache
    max_new: int = 0
    canonical: int = 0  # deterministic mode: leading positions whose KV came from whole aligned prefill chunks
    hidden: Optional[torch.Tensor] = None  # the target's normed hidden state that produced `pending` (drafting)

    @property
    def req(self) -> Request:
        return self.stream.request

    @property
    def params(self) -> SamplingParams:
        return self.stream.params

    @property
    def prompt(self) -> list[int]:
        return self.stream.prompt

    @property
    def generated(self) -> list[int]:
        return self.stream.generated

    @property
    def tokens(self) -> list[int]:
        return self.stream.prompt + self.stream.generated

    def accept(self, tok: int, top: Any, eos_ids: frozenset[int]) -> Optional[str]:
        """Take one new token (streamed to the request) and say whether it ends the sequence: "stop" at
        an end-of-sequence token or a stop string, "length" at max tokens, else None."""
        self.pending = tok
        eos = (tok in eos_ids and not self.params.ignore_eos) or tok in self.params.stop_token_ids
        matched = self.stream.push((tok,), (top,) if top is not None else None, text=not eos)
        reason = "stop" if eos or matched is not None else "length" if len(self.generated) >= self.max_new else None
        if reason is not None:  # a run cut short: accepted drafts past the end are not kept
            self.kv_len = min(self.kv_len, len(self.tokens))
        return reason


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    forward_seconds: float = 0.0
    prefill_seconds: float = 0.0  # the part of forward_seconds that prefilled prompts (and tool outputs)
    sample_seconds: float = 0.0
    busy_seconds: float = 0.0  # scheduler iterations with work, all included
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    spec_steps: int = 0  # steps that drafted (speculative decoding)
    spec_rows: int = 0  # sequences in those steps, summed
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def tokens_per_spec_step(self) -> float:
        """Tokens a sequence gains per drafting step: 1 + accepted drafts (what the drafter buys)."""
        return 1.0 + self.accepted_draft_tokens / self.spec_rows if self.spec_rows else 0.0

    def speculative(self) -> Optional[dict[str, Any]]:
        """What speculative decoding did (None when it never drafted): for solve/eval/bench reports."""
        if not self.spec_steps:
            return None
        return {"drafting_steps": self.spec_steps, "steps": self.steps, "draft_tokens": self.draft_tokens,
                "accepted_draft_tokens": self.accepted_draft_tokens,
                "acceptance": round(self.accepted_draft_tokens / self.draft_tokens, 4),
                "tokens_per_step": round(self.tokens_per_spec_step, 4),
                "forward_seconds": round(self.forward_seconds, 3)}

    @property
    def bookkeeping_seconds(self) -> float:
        return max(0.0, self.busy_seconds - self.forward_seconds - self.sample_seconds)

    def profile(self) -> dict[str, Any]:
        """Where the engine's busy time went, for solve and eval reports: decode steps (verify included)
        with their mean batch and rate, prefills (prompts and tool outputs past the reused prefix),
        sampling, and the rest (scheduling, KV copies between slots, streaming). Counts since start."""
        decode = self.forward_seconds - self.prefill_seconds
        return {"busy_seconds": round(self.busy_seconds, 3), "decode_seconds": round(decode, 3),
                "steps": self.steps, "decode_tokens": self.decode_tokens,
                "mean_batch": round(sum(self.batch_sizes) / len(self.batch_sizes), 2) if self.batch_sizes else 0.0,
                "decode_tok_s": round(self.decode_tokens / decode, 1) if decode > 0 else 0.0,
                "prefill_seconds": round(self.prefill_seconds, 3), "prefill_tokens": self.prefill_tokens,
                "cached_tokens": self.cached_tokens, "sample_seconds": round(self.sample_seconds, 3),
                "other_seconds": round(self.bookkeeping_seconds, 3)}

    def profile_line(self) -> str:
        """`profile()` in one line of a log."""
        p = self.profile()
        return (f"busy {p['busy_seconds']:.1f} s: decode {p['decode_seconds']:.1f} s ({p['steps']} steps, mean batch "
                f"{p['mean_batch']:.1f}, {p['decode_tok_s']:.0f} tok/s), prefill {p['prefill_seconds']:.1f} s "
                f"({p['prefill_tokens']} tokens, {p['cached_tokens']} reused), sampling {p['sample_seconds']:.1f} s, "
                f"other {p['other_seconds']:.1f} s (scheduling, KV copies, streaming)")

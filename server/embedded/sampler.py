"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, seeded.

Exact but cheap: sorting a 49k vocabulary costs ~2 ms per row on a CPU core, so the nucleus is
first sought among the 256 most likely tokens and the full sort is done only for the rare row whose
nucleus is wider than that. Each request has its own generator, so a sample depends on its seed and
its logits only, not on which other requests share the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from server.protocol import SamplingParams

CANDIDATES = 256


def make_generator(seed: Optional[int]) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    if p.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / p.temperature
    if p.top_k == 0 and p.top_p >= 1.0:
        return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen))
    k = min(p.top_k or CANDIDATES, scaled.numel())
    probs = torch.softmax(scaled, -1)
    top_p, top_i = torch.topk(probs, k)
    if p.top_k == 0 and float(top_p.sum()) < p.top_p and k < scaled.numel():
        top_p, top_i = torch.sort(probs, descending=True)  # nucleus wider than the candidates
    if p.top_p < 1.0:
        cum = torch.cumsum(top_p, -1)
        keep = int(torch.searchsorted(cum, torch.tensor([p.top_p * float(cum[-1])]))) + 1
        top_p, top_i = top_p[:keep], top_i[:keep]
    return int(top_i[torch.multinomial(top_p, 1, generator=gen)])


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator]
           ) -> tuple[list[int], list[Optional[tuple[tuple[int, float], ...]]]]:
    """Next token per row, and the top logprobs (of the untempered distribution) where asked."""
    tokens = [_sample_row(logits[i], p, gens[i]) for i, p in enumerate(params)]
    want = max((p.top_logprobs for p in params), default=0)
    tops: list[Optional[tuple[tuple[int, float], ...]]] = [None] * len(params)
    if want:
        lp = torch.log_softmax(logits, -1)
        val, idx = torch.topk(lp, min(want, lp.shape[-1]), dim=-1)
        for i, p in enumerate(params):
            if p.top_logprobs:
                n = p.top_logprobs
                tops[i] = tuple(zip(idx[i, :n].tolist(), val[i, :n].tolist()))
    return tokens, tops

"""Speculative decoding in the embedded engine: which drafted tokens a sequence keeps.

Each step, every running sequence's pending token p (sampled, not yet in the cache) and the target's
hidden state that produced it go to the ReDrafter head, which drafts L tokens d1..dL greedily; the
target then runs [p, d1..dL] in one forward (`runner.verify`) and this module decides, per row,
how many drafts to keep and which token follows them. Rows keep different numbers of tokens and stay
in one batch; the KV written for rejected drafts is simply never read (a slot is read up to its
length) and is overwritten next step.

The rule is the standard speculative-sampling acceptance for a deterministic proposal (the drafter's
argmax is a point mass q = 1 at d_j): draft j is kept with probability P_j(d_j), where P_j is the
exact distribution the non-speculative sampler would draw from at that position (temperature, top-k,
top-p: `sampler.row_distribution`); at the first rejection the next token is drawn from P_j with d_j
removed and renormalised (max(0, P - q) normalised); when all L are kept the next token is drawn from
P_L. Each emitted token is therefore distributed exactly as without the drafter. At temperature 0
P_j is the argmax, so drafts are kept while they equal the target's argmax and the tokens are the
ones greedy decoding gives (tests/test_speculative.py checks both).

With num_beams > 1 the head beam-searches and the best beam is verified (the acceptance above is
defined for one proposal; multi-candidate verification would need a tree rule). The recipe's
`drafter.greedy: false` (sampled drafting in TensorRT-LLM) does not change serving here: drafting
is always by argmax, which the rule makes exact at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from aimo_spec.protocol import SamplingParams
from server.embedded.sampler import (
    _keep_sorted,
    _truncates,
    draw,
    fused_sampler,
    fused_sampler_failed,
    gumbel_noise,
    hashed_uniform,
    row_distribution,
)
from server.embedded.transfer import to_device

# Largest running batch that still drafts, per device type, when the recipe leaves it at 0; above it
# the engine decodes one token per step. Measured by `make bench` (server/bench/speculative.py) on the
# mix, 2026-12-03 (bench/speculative-*.json): on the 2-core AVX2 CPU drafting gave 1.17-1.20x at
# batch 1, 1.03-1.05x at 4 and 1.00-1.02x at 8 (a 4-token verify costs ~1.5 decode steps there);
# on the H200 1.30-1.73x at every batch measured, 1 to 16.
DEFAULT_MAX_BATCH = {"cpu": 4, "cuda": 16}


@dataclass(frozen=True)
class SpecConfig:
    """What the engine drafts with: L tokens per step, while at most `max_batch` sequences run."""

    draft_len: int
    num_beams: int = 1
    max_batch: int = 0  # 0: DEFAULT_MAX_BATCH for the device


def accept_host(logits: torch.Tensor, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                gens: Sequence[torch.Generator]) -> list[tuple[int, int]]:
    """Per row (kept drafts k, next token). logits [n, L+1, V] on the CPU; each row's uniforms come
    from its own generator, so a row's result does not depend on the rest of the batch."""
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
    argmax = logits[greedy_rows].argmax(-1).tolist() if greedy_rows else []
    out: list[tuple[int, int]] = []
    g = 0
    for i, (p, d) in enumerate(zip(params, drafts)):
        if p.temperature == 0:
            best = argmax[g]
            g += 1
            k = 0
            while k < len(d) and d[k] == best[k]:
                k += 1
            out.append((k, best[k]))
            continue
        out.append(_accept_sampled_row(logits[i], d, p, gens[i]))
    return out


def _accept_sampled_row(logits: torch.Tensor, drafts: Sequence[int], p: SamplingParams,
                        gen: torch.Generator) -> tuple[int, int]:
    for j, d in enumerate(drafts):
        ids, probs = row_distribution(logits[j], p)
        hit = (ids == d).nonzero()
        pd = float(probs[hit[0, 0]]) if hit.numel() else 0.0
        if float(torch.rand((), generator=gen)) < pd:
            continue
        if hit.numel():  # the residual max(0, P - q): P without the rejected draft
            probs = probs.clone()
            probs[hit[0, 0]] = 0.0
        return j, draw(ids, probs, gen)
    ids, probs = row_distribution(logits[len(drafts)], p)
    return len(drafts), draw(ids, probs, gen)


def accept_device(logits: torch.Tensor, drafts: torch.Tensor, params: Sequence[SamplingParams],
                  seeds: Sequence[int], steps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_host` batched on the logits' device: returns (kept drafts [n], next token [n]) as
    device tensors, so the step needs one transfer. logits [n, L+1, V], drafts [n, L] (long).
    On CUDA a few Triton launches (`accept_fused`), else `reference_accept`."""
    if logits.is_cuda and fused_sampler():
        try:
            return accept_fused(logits, drafts, params, seeds, steps)
        except Exception as e:  # noqa: BLE001 - a kernel this GPU's Triton cannot build: the eager rule
            fused_sampler_failed(e)
    return reference_accept(logits, drafts, params, seeds, steps)


def accept_fused(logits: torch.Tensor, drafts: torch.Tensor, params: Sequence[SamplingParams],
                 seeds: Sequence[int], steps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_accept`'s rule as sample_kernel.accept: a stable sort of the scaled logits where a row
    truncates, then a program a row takes its L+1 positions (the draft's share, the uniforms, the draw)."""
    from server.embedded.sample_kernel import accept

    n, t, vocab = logits.shape
    dev = logits.device
    floats = to_device([[p.temperature for p in params], [p.top_p for p in params],
                        [p.temperature or 1.0 for p in params]], torch.float32, dev)
    ints = to_device([[int(s) & ((1 << 62) - 1) for s in seeds], list(steps), [p.top_k or vocab for p in params]],
                     torch.long, dev)
    scaled = (logits.float() / floats[2].view(n, 1, 1)).view(n * t, vocab)
    idx = None
    if _truncates(params):
        scaled, idx = torch.sort(scaled, stable=True, dim=-1, descending=True)
    return accept(scaled, idx, drafts.long().contiguous(), floats[0], ints[2], floats[1], ints[0], ints[1])


def reference_accept(logits: torch.Tensor, drafts: torch.Tensor, params: Sequence[SamplingParams],
                     seeds: Sequence[int], steps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_device` in eager PyTorch: the CPU's path and the oracle of `accept_fused`'s tests."""
    n, t, vocab = logits.shape
    L = t - 1
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    greedy = temps == 0
    best = logits.argmax(-1)  # [n, T]
    ok = drafts == best[:, :L]
    if bool(greedy.all()):
        keep = ok.long().cumprod(-1).sum(-1)
        return keep, best.gather(1, keep.view(n, 1)).squeeze(1)
    seed_t = torch.tensor([int(s) & ((1 << 62) - 1) for s in seeds], dtype=torch.long, device=dev)
    step_t = torch.tensor(list(steps), dtype=torch.long, device=dev)
    top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temps), temps).view(n, 1, 1)
    vals, idx = torch.sort(scaled.view(n * t, vocab), stable=True, dim=-1, descending=True)
    probs = torch.softmax(vals, -1)
    keep_mask = _keep_sorted(probs, top_k.repeat_interleave(t), top_p.repeat_interleave(t))
    probs = torch.where(keep_mask, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter_(1, idx, probs).view(n, t, vocab)  # P_j over the vocabulary
    pd = dense[:, :L].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [n, L]
    u = hashed_uniform(seed_t, step_t, torch.arange(L, device=dev).view(1, L) + 0x51ED)
    accepted = torch.where(greedy.view(n, 1), ok, u < pd)
    keep = accepted.long().cumprod(-1).sum(-1)  # [n]
    final = dense.gather(1, keep.view(n, 1, 1).expand(n, 1, vocab)).squeeze(1)  # P at the first rejection, or P_L
    rejected = keep < L
    drop = torch.nn.functional.one_hot(drafts.gather(1, keep.clamp(max=L - 1).view(n, 1)).squeeze(1), vocab).bool()
    final = torch.where(rejected.view(n, 1) & drop, torch.zeros_like(final), final)
    noise = gumbel_noise(seed_t, step_t + (1 << 20), torch.arange(vocab, device=dev).view(1, vocab))
    drawn = torch.where(final > 0, final.log() + noise, torch.full_like(final, float("-inf"))).argmax(-1)
    greedy_next = best.gather(1, keep.view(n, 1)).squeeze(1)
    return keep, torch.where(greedy, greedy_next, drawn)


def top_logprobs(logits: torch.Tensor, n: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, logprobs) of the top-n tokens per position of the untempered distribution, or None."""
    if n <= 0:
        return None
    val, idx = torch.topk(torch.log_softmax(logits.float(), -1), min(n, logits.shape[-1]), dim=-1)
    return idx, val

"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, seeded.

Exact but cheap: sorting a 49k vocabulary costs ~2-3.5 ms per row on a CPU core, so the nucleus is
first sought among the 256 most likely tokens, then among the 4096 most likely (~0.7 ms), and the full
sort is done only for the rare row whose nucleus is wider than that. Each request has its own
generator, so a sample depends on its seed and its logits only, not on which other requests share the
batch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Optional, Sequence

import torch

from aimo_spec.protocol import SamplingParams
from server.embedded.transfer import to_device

CANDIDATES = 256
WIDER_CANDIDATES = 4096  # where a nucleus wider than CANDIDATES is sought before the whole row is sorted


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A request's generator: `seed` taken modulo 2**64 (a generator's seed is 64 bits; torch folds a
    negative one the same way, and a larger one would raise), or a random seed."""
    g = torch.Generator()
    g.manual_seed(seed % 2**64 if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def _candidates(p: SamplingParams, vocab: int) -> int:
    """How many of the most likely tokens a row's distribution is first sought among (0: all of them)."""
    return 0 if p.top_k == 0 and p.top_p >= 1.0 else min(p.top_k or CANDIDATES, vocab)


def row_distribution(logits: torch.Tensor, p: SamplingParams,
                     ranked: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a row is sampled from, as (token ids, probabilities summing to 1): the
    logits divided by the temperature, then top-k, then top-p over what top-k kept (renormalised;
    the smallest prefix of the sorted probabilities whose mass reaches p, at least one token).
    `sample_device` implements the same rule on a GPU; speculative acceptance reads it too.
    `ranked`: the row's (probabilities, top values, top ids) computed already, with its batch (`sample`)."""
    vocab = logits.numel()
    k = _candidates(p, vocab)
    if ranked is not None:
        probs, top_p, top_i = ranked
    else:
        probs = torch.softmax(logits.float() / p.temperature, -1)
        if k:
            top_p, top_i = torch.topk(probs, k)
    if not k:
        return torch.arange(vocab, device=logits.device), probs
    if p.top_k == 0 and float(top_p.sum()) < p.top_p and k < vocab:
        top_p, top_i = _wider_nucleus(probs, p.top_p)
    if p.top_p < 1.0:
        mass = float(top_p.sum()) if p.top_k else 1.0  # top-k renormalises before top-p
        cum = torch.cumsum(top_p, -1)
        keep = min(int(torch.searchsorted(cum, torch.tensor([p.top_p * mass], device=cum.device))) + 1, top_p.numel())
        top_p, top_i = top_p[:keep], top_i[:keep]
    return top_i, top_p / top_p.sum()


def _wider_nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted candidates of a nucleus wider than CANDIDATES: the WIDER_CANDIDATES most likely when their
    running sum reaches top_p (the same running sum as the whole sorted row's, so the same nucleus; tokens of
    equal probability at its edge may come in another order, as with CANDIDATES), else the whole row sorted."""
    if probs.numel() > WIDER_CANDIDATES:
        vals, ids = torch.topk(probs, WIDER_CANDIDATES)
        if float(torch.cumsum(vals, -1)[-1]) >= top_p:
            return vals, ids
    return torch.sort(probs, descending=True)


def draw(ids: torch.Tensor, probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token of the distribution (ids, probs; not necessarily normalised) drawn with `gen`, as an
    exponential race: the argmax of p / E with E = -log(U), U uniform: what `torch.multinomial` of one
    sample computes, whose `exponential_` takes ~1.2 ms over a 49k vocabulary on a CPU core (this
    ~0.3 ms). Not by inverting the cumulative sum (cheaper still), whose boundaries move with every
    rounding of the logits: a batch's other rows then changed a seeded draw (the Triton test). A
    token of probability 0 is never drawn."""
    race = probs / -torch.log(torch.rand(probs.shape, generator=gen, dtype=probs.dtype, device=probs.device))
    return int(ids[int(torch.argmax(race))])


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    if p.temperature == 0:
        return int(torch.argmax(logits))
    return draw(*row_distribution(logits, p), gen)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator]
           ) -> tuple[list[int], list[Optional[tuple[tuple[int, float], ...]]]]:
    """Next token per row, and the top logprobs (of the untempered distribution) where asked. Rows of
    one temperature and candidate count get their softmax and top candidates in one call each (the
    top-k over the vocabulary is most of a row's cost; row by row, each the same numbers as alone)."""
    tokens: list[int] = [0] * len(params)
    groups: dict[tuple[float, int], list[int]] = {}
    for i, p in enumerate(params):
        k = _candidates(p, logits.shape[-1])
        if p.temperature != 0 and k:
            groups.setdefault((p.temperature, k), []).append(i)
        else:
            tokens[i] = _sample_row(logits[i], p, gens[i])
    for (temperature, k), rows in groups.items():
        probs = torch.softmax(logits[rows].float() / temperature, -1)
        top_p, top_i = torch.topk(probs, k, -1)
        for j, i in enumerate(rows):
            tokens[i] = draw(*row_distribution(logits[i], params[i], (probs[j], top_p[j], top_i[j])), gens[i])
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


# ---- on the device: one batched pass, one host sync per step
_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a well-mixed 32-bit integer hash), on int64 tensors holding 32-bit values."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) that depend only on (request seed, step, token id): a row's sample is the same
    whatever else shares the batch, and no per-request generator state lives on the device. 23 bits of
    the hash, (n + 0.5) / 2**23: the largest is 1 - 2**-24, which float32 holds (24 bits, as
    (n + 0.5) / 2**24, rounded the top one up to exactly 1.0: infinite noise, a token drawn whatever
    its probability, on about 1 step in 110 over a 152k vocabulary)."""
    s = seeds.view(-1, 1)
    x = _hash32(_hash32(s) ^ _hash32((s >> 32) + 0x632BE5AB) ^ _hash32(steps.view(-1, 1) * 0x9E3779B1 + 0x7F4A7C15))
    x = _hash32(x ^ _hash32(token_ids + 0x2545F491))
    return ((x >> 9).float() + 0.5) * UNIFORM_STEP


UNIFORM_STEP = 2.0 ** -23


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise over `hashed_uniform`'s uniforms (finite: they stay below 1)."""
    return -torch.log(-torch.log(hashed_uniform(seeds, steps, token_ids)))


def _keep_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] mask over probabilities sorted in descending order: top-k, then top-p over the
    renormalised top-k mass (the rule of `row_distribution`)."""
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    in_k = rank < top_k.unsqueeze(1)
    cum = torch.cumsum(probs * in_k, -1)
    before = cum - probs  # mass of the kept tokens ranked above
    return in_k & ((before < top_p.unsqueeze(1) * cum[:, -1:]) | (rank == 0))


def sample_device(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
                  ) -> tuple[list[int], list[Optional[tuple[tuple[int, float], ...]]]]:
    """`sample` for logits on a GPU: temperature, top-k and top-p as masks over the sorted row, the
    draw by Gumbel-max over seeded noise; tokens and logprobs come back in one transfer.

    Exactly the same distributions as `sample` (top-p keeps the smallest prefix of the sorted
    probabilities whose mass reaches p, at least one token); a different random stream.
    """
    tokens = draw_device(logits, params, seeds, steps)
    return unpack_draws(pack_draws(logits, tokens, params).tolist(), params)


def draw_device(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
                ) -> torch.Tensor:
    """The next token of each row [n], left on the logits' device (no host round trip), so that the
    engine can feed it to the next step before it reads it (`steps.PlainStep`'s overlap).

    A row's draw depends only on its logits, its seed and `steps` (its number of tokens generated
    so far): not on the other rows, and not on when the host reads it."""
    if all(p.temperature == 0 for p in params):
        return torch.argmax(logits, -1)
    if logits.is_cuda and fused_sampler():
        try:
            return draw_fused(logits, params, seeds, steps)
        except Exception as e:  # noqa: BLE001 - a kernel this GPU's Triton cannot build: the eager rule
            fused_sampler_failed(e)
    return reference_draw(logits, params, seeds, steps)


FUSED_SAMPLER_ENV = "EMBEDDED_FUSED_SAMPLER"  # "0": the eager draw on CUDA too (side-by-side measurements)
_FUSED_FAILED: list[str] = []  # why the fused kernels were given up in this process, if they were


@functools.lru_cache(maxsize=None)
def fused_sampler() -> bool:
    """Whether CUDA draws run `draw_fused` (Triton installed, not turned off by FUSED_SAMPLER_ENV, and
    not given up after a failure in this process)."""
    return (importlib.util.find_spec("triton") is not None and os.environ.get(FUSED_SAMPLER_ENV, "1") != "0"
            and not _FUSED_FAILED)


def fused_sampler_failed(error: Exception) -> None:
    """Give the fused draw and acceptance up for this process (the eager rules take over: the same
    distributions), saying why once on stderr."""
    if not _FUSED_FAILED:
        _FUSED_FAILED.append(f"{type(error).__name__}: {error}")
        print(f"[embedded] the fused sampling kernels failed ({_FUSED_FAILED[0][:300]}); sampling with the eager "
              f"rule from now on", file=sys.stderr, flush=True)
    fused_sampler.cache_clear()


def _truncates(params: Sequence[SamplingParams]) -> bool:
    return any(p.top_k or p.top_p < 1.0 for p in params)


def draw_fused(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
               ) -> torch.Tensor:
    """`reference_draw`'s rule in a few Triton launches (after the sort where a row truncates; the numbers
    and their limits: sample_kernel.py). Float32 logits [n, V]; two host-to-device copies of settings."""
    from server.embedded.sample_kernel import draw_full, draw_sorted

    n, vocab = logits.shape
    dev = logits.device
    # the per-row settings go up without synchronizing (transfer.py): the host must not wait for the step
    floats = to_device([[p.temperature for p in params], [p.top_p for p in params],
                        [p.temperature or 1.0 for p in params]], torch.float32, dev)
    ints = to_device([[int(s) & ((1 << 62) - 1) for s in seeds], list(steps), [p.top_k or vocab for p in params]],
                     torch.long, dev)
    logits = logits.float().contiguous()
    if not _truncates(params):
        return draw_full(logits, floats[0], ints[0], ints[1])
    vals, idx = torch.sort(logits / floats[2].unsqueeze(1), stable=True, dim=-1, descending=True)
    return draw_sorted(vals, idx, floats[0], ints[2], floats[1], ints[0], ints[1])


def reference_draw(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                   steps: Sequence[int]) -> torch.Tensor:
    """`draw_device` in eager PyTorch (115 ops, most over [n, V], where a row truncates; 97 where none
    does): the CPU's path and the oracle of `draw_fused`'s tests."""
    vocab = logits.shape[1]
    dev = logits.device
    tokens = torch.argmax(logits, -1)
    temps = to_device([p.temperature for p in params], torch.float32, dev)
    greedy = temps == 0
    seed_t = to_device([int(s) & ((1 << 62) - 1) for s in seeds], torch.long, dev)
    step_t = to_device(list(steps), torch.long, dev)
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    if _truncates(params):
        top_k = to_device([p.top_k or vocab for p in params], torch.long, dev)
        top_p = to_device([p.top_p for p in params], torch.float32, dev)
        vals, idx = torch.sort(scaled, stable=True, dim=-1, descending=True)  # ties in token order
        probs = torch.softmax(vals, -1)
        keep = _keep_sorted(probs, top_k, top_p)
        noisy = torch.where(keep, vals + gumbel_noise(seed_t, step_t, idx), torch.full_like(vals, float("-inf")))
        drawn = idx.gather(1, noisy.argmax(-1, keepdim=True)).squeeze(1)
    else:
        ids = torch.arange(vocab, device=dev).unsqueeze(0)
        drawn = (scaled + gumbel_noise(seed_t, step_t, ids)).argmax(-1)
    return torch.where(greedy, tokens, drawn)


def pack_draws(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """What the host needs from a step, as one tensor to copy: the tokens [n] alone, or, where some
    request wants top logprobs, rows [n, 1 + 2k] of (token, k ids, k logprobs) in float64 (exact for ids)."""
    want = max((p.top_logprobs for p in params), default=0)
    if not want:
        return tokens
    val, idx = torch.topk(torch.log_softmax(logits.float(), -1), min(want, logits.shape[1]), dim=-1)
    return torch.cat([tokens.view(-1, 1).to(torch.float64), idx.to(torch.float64), val.to(torch.float64)], 1)


def unpack_draws(rows: list, params: Sequence[SamplingParams]
                 ) -> tuple[list[int], list[Optional[tuple[tuple[int, float], ...]]]]:
    """(tokens, top logprobs per row or None) from `pack_draws`'s output read back as a list."""
    tops: list[Optional[tuple[tuple[int, float], ...]]] = [None] * len(params)
    if not rows or not isinstance(rows[0], list):
        return [int(t) for t in rows], tops
    want = (len(rows[0]) - 1) // 2
    for i, p in enumerate(params):
        if p.top_logprobs:
            row, k = rows[i], min(p.top_logprobs, want)
            tops[i] = tuple((int(row[1 + j]), row[1 + want + j]) for j in range(k))
    return [int(r[0]) for r in rows], tops

"""The device sampler's draw as one Triton launch per step (two with the sort top-k / top-p needs).

`sampler.reference_draw` is the rule in eager PyTorch: temperature, top-k and top-p as masks over the
sorted row, the draw by Gumbel-max over noise hashed from (seed, step, token id). Eagerly that is 115
torch ops a step with top-p, 97 without (counted with torch.profiler; most are elementwise over [rows,
vocabulary], the hash alone some forty), each launched from Python: on a GPU the host spends about as
long launching them as a small model's whole decode step, and the device runs them one after another.
Here the mask, the noise and the argmax are one pass over each row in registers (with the settings'
two copies up, the temperature's division and the sort: five launches with top-p, three without):

- `draw_sorted` walks a row sorted by torch.sort (stable, so ties keep the token order): it sums the
  top-k mass, then keeps tokens while the mass ranked above them is under top_p of it (at least one),
  adds the token's noise and keeps the running best; it stops at the first block past the nucleus.
- `draw_full` (no row truncates): logits / temperature + noise, argmax, in one read of the row.

- `accept` (speculative.accept_device's rule): one program a row walks the nuclei of its L+1 positions
  (sorted, or the whole row where no row truncates): each draft's share of its position's nucleus
  against the row's seeded uniform, and at the first rejection the noisy best of the nucleus without
  the rejected draft (with every draft kept, of the last position's).

A greedy row takes the argmax of its logits (`draw_full`) or its sorted row's first token (the
same token: a stable sort puts the first of equal maxima first, as argmax picks it).

The uniforms are `sampler.hashed_uniform`'s, bit for bit; the noise's logs may differ from torch's in
their last bit, and the kernels' exp is the GPU's fast form (ex2.approx), so the top-p boundary and a
draft's share may differ from the eager rule's where they are within a rounding of the threshold (the
sums also run in another order): the same distribution, and a draw that still depends only on the
row's logits, seed and step.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from server.embedded.decode_attention import interpreted

# Tokens a loop iteration reads, and warps a program: one program walks a row, so a row of V tokens is
# V / BLOCK dependent iterations (measured on an H100 with 1024 and 4 warps: the fused draw no faster
# than the eager rule at batch 1, bench/gpu-sampler-h100.json); wider blocks and more warps keep more
# loads in flight. A row split over several programs (two stages) is the next step.
BLOCK = 4096
WARPS = 8


@functools.lru_cache(maxsize=None)
def _kernels():
    # module globals: Triton's interpreter runs a kernel with its module's globals only, not this closure
    global hash32, row_key, uniform, gumbel, top_k_mass, nucleus
    import triton
    import triton.language as tl

    @triton.jit
    def hash32(x):  # lowbias32 on uint32 (sampler._hash32's numbers: its int64 ops masked to 32 bits)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def row_key(s, step):  # the hash of (seed, step) that gumbel_noise mixes each token id into
        lo = s.to(tl.uint32)
        hi = (s >> 32).to(tl.uint32) + 0x632BE5AB
        st = step.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15
        return hash32(hash32(lo) ^ hash32(hi) ^ hash32(st))

    @triton.jit
    def uniform(key, tokens):  # sampler.hashed_uniform's: in (0, 1), the largest 1 - 2**-24
        x = hash32(key ^ hash32(tokens.to(tl.uint32) + 0x2545F491))
        return ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: exact

    @triton.jit
    def gumbel(key, tokens):
        return -tl.log(-tl.log(uniform(key, tokens)))

    @triton.jit
    def draw_full(logits_ptr, temp_ptr, seed_ptr, step_ptr, out_ptr, stride, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
        key = row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
        best_v = tl.full((), float("-inf"), tl.float32)
        best_t = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK):
            t = start + tl.arange(0, BLOCK)
            live = t < V
            x = tl.load(logits_ptr + row * stride + t, mask=live, other=0.0).to(tl.float32)
            score = tl.where(greedy, x, tl.math.div_rn(x, tl.where(greedy, 1.0, temp)) + gumbel(key, t))
            score = tl.where(live, score, float("-inf"))
            v = tl.max(score, 0)
            i = tl.argmax(score, 0)
            better = v > best_v  # strictly: the first of equal scores wins, as torch.argmax picks it
            best_t = tl.where(better, (start + i).to(tl.int64), best_t)
            best_v = tl.where(better, v, best_v)
        tl.store(out_ptr + row, best_t)

    @triton.jit
    def draw_sorted(vals_ptr, idx_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, out_ptr, stride_v, stride_i,
                    V: tl.constexpr, BLOCK: tl.constexpr, RUNTIME_LOOP: tl.constexpr):
        row = tl.program_id(0)
        vrow = vals_ptr + row * stride_v
        irow = idx_ptr + row * stride_i
        first = tl.load(irow)
        if tl.load(temp_ptr + row) == 0.0:  # greedy: the sorted row's first token
            tl.store(out_ptr + row, first)
        else:
            k = tl.minimum(tl.load(topk_ptr + row), V)
            m = tl.load(vrow)  # the row's largest scaled logit: the mass is counted relative to it
            limit = tl.load(topp_ptr + row) * top_k_mass(vrow, m, k, V, BLOCK, RUNTIME_LOOP)
            key = row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
            _, _, _, token = nucleus(vrow, irow, m, k, limit, -1, key, True, False, V, BLOCK)
            tl.store(out_ptr + row, token)

    @triton.jit
    def top_k_mass(vrow, m, k, V: tl.constexpr, BLOCK: tl.constexpr, RUNTIME_LOOP: tl.constexpr):
        """The mass (relative to exp(m)) of a sorted row's first k tokens: on a GPU a loop to k, under the
        interpreter (which needs a constant trip count) to V with the rest masked."""
        acc = tl.zeros((BLOCK,), tl.float32)
        if RUNTIME_LOOP:
            for start in range(0, k, BLOCK):
                r = start + tl.arange(0, BLOCK)
                acc += tl.where(r < k, tl.exp(tl.load(vrow + r, mask=r < k, other=0.0) - m), 0.0)
        else:
            for start in range(0, V, BLOCK):
                r = start + tl.arange(0, BLOCK)
                acc += tl.where(r < k, tl.exp(tl.load(vrow + r, mask=r < k, other=0.0) - m), 0.0)
        return tl.sum(acc, 0)

    @triton.jit
    def nucleus(vrow, irow, m, k, limit, exclude, key, SORTED: tl.constexpr, EXCLUDE: tl.constexpr,
                V: tl.constexpr, BLOCK: tl.constexpr):
        """A row's walk over its nucleus: blocks of the sorted row (tokens are positions where not SORTED),
        keeping tokens while the mass ranked above them is under `limit` (the first always), until a
        block starts past it. Returns (the nucleus' mass, token `exclude`'s share of it, the best noisy
        token other than `exclude` (with EXCLUDE), the best noisy token)."""
        kept = tl.full((), 0.0, tl.float32)
        share = tl.full((), 0.0, tl.float32)
        best_x = tl.full((), float("-inf"), tl.float32)
        tok_x = tl.full((), 0, tl.int64)
        best_i = tl.full((), float("-inf"), tl.float32)
        tok_i = tl.full((), 0, tl.int64)
        above = tl.full((), 0.0, tl.float32)
        start = tl.full((), 0, tl.int32)
        while (start < k) & ((above < limit) | (start == 0)):
            r = start + tl.arange(0, BLOCK)
            live = r < k
            x = tl.load(vrow + r, mask=live, other=0.0)
            e = tl.where(live, tl.exp(x - m), 0.0)
            keep = live & ((above + tl.cumsum(e, 0) - e < limit) | (r == 0))
            if SORTED:
                tokens = tl.load(irow + r, mask=live, other=0)
            else:
                tokens = r.to(tl.int64)
            kept += tl.sum(tl.where(keep, e, 0.0), 0)
            share += tl.sum(tl.where(keep & (tokens == exclude), e, 0.0), 0)
            score = tl.where(keep, x + gumbel(key, tokens), float("-inf"))
            v = tl.max(score, 0)
            t = tl.sum(tl.where(tl.arange(0, BLOCK) == tl.argmax(score, 0), tokens, 0), 0)
            better = v > best_i
            tok_i = tl.where(better, t, tok_i)
            best_i = tl.where(better, v, best_i)
            if EXCLUDE:
                score = tl.where(tokens == exclude, float("-inf"), score)
                v = tl.max(score, 0)
                t = tl.sum(tl.where(tl.arange(0, BLOCK) == tl.argmax(score, 0), tokens, 0), 0)
                better = v > best_x
                tok_x = tl.where(better, t, tok_x)
                best_x = tl.where(better, v, best_x)
            above += tl.sum(e, 0)
            start += BLOCK
        return kept, share, tok_x, tok_i

    @triton.jit
    def accept(vals_ptr, idx_ptr, drafts_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, keep_ptr, next_ptr,
               stride_v, stride_i, L: tl.constexpr, V: tl.constexpr, SORTED: tl.constexpr, BLOCK: tl.constexpr,
               RUNTIME_LOOP: tl.constexpr):
        b = tl.program_id(0)
        greedy = tl.load(temp_ptr + b) == 0.0
        k = tl.minimum(tl.load(topk_ptr + b), V)
        top_p = tl.load(topp_ptr + b)
        seed, step = tl.load(seed_ptr + b), tl.load(step_ptr + b)
        key_u = row_key(seed, step)  # the drafts' uniforms
        key_draw = row_key(seed, step + (1 << 20))  # the next token's noise
        running = tl.full((), 1, tl.int1)
        keep = tl.full((), 0, tl.int32)
        nxt = tl.full((), 0, tl.int64)
        for j in tl.static_range(L + 1):
            vrow = vals_ptr + (b * (L + 1) + j) * stride_v
            irow = idx_ptr + (b * (L + 1) + j) * stride_i
            if SORTED:  # largest first, ties in token order
                m = tl.load(vrow)
                first = tl.load(irow)
            else:
                m = tl.full((), float("-inf"), tl.float32)
                first = tl.full((), 0, tl.int64)
                for start in range(0, V, BLOCK):
                    r = start + tl.arange(0, BLOCK)
                    x = tl.load(vrow + r, mask=r < V, other=float("-inf"))
                    v = tl.max(x, 0)
                    first = tl.where(v > m, (start + tl.argmax(x, 0)).to(tl.int64), first)
                    m = tl.maximum(m, v)
            if SORTED:
                limit = top_p * top_k_mass(vrow, m, k, V, BLOCK, RUNTIME_LOOP)
            else:  # no row truncates: the nucleus is the whole row
                limit = tl.full((), float("inf"), tl.float32)
            if j < L:
                d = tl.load(drafts_ptr + b * L + j)
            else:
                d = tl.full((), -1, tl.int64)
            kept, share, tok_x, tok_i = nucleus(vrow, irow, m, k, limit, d, key_draw, SORTED, True, V, BLOCK)
            if j < L:  # draft j kept with probability P_j(d_j); at the first rejection, P_j without d_j
                u = uniform(key_u, tl.full((), j + 0x51ED, tl.int64))
                ok = tl.where(greedy, d == first, u < share / kept)
                nxt = tl.where(running & (ok == 0), tl.where(greedy, first, tok_x), nxt)
                keep += (running & ok).to(tl.int32)
                running = running & ok
            else:  # every draft kept: the next token from P_L
                nxt = tl.where(running, tl.where(greedy, first, tok_i), nxt)
        tl.store(keep_ptr + b, keep.to(tl.int64))
        tl.store(next_ptr + b, nxt)

    return draw_full, draw_sorted, accept


def draw_full(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Tokens [n] (int64) of logits [n, V] (float32) at temperatures [n] (0: greedy) with no truncation,
    `seeds` and `steps` [n] (int64) seeding each row's noise."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    _kernels()[0][(n,)](logits, temps, seeds, steps, out, logits.stride(0), V=vocab, BLOCK=BLOCK, num_warps=WARPS)
    return out


def draw_sorted(vals: torch.Tensor, idx: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Tokens [n] of rows sorted in descending order (vals [n, V] float32 scaled logits, idx their token
    ids, as a stable torch.sort gives them), with top-k [n] (the vocabulary for none), top-p [n]."""
    n, vocab = vals.shape
    out = torch.empty(n, dtype=torch.long, device=vals.device)
    _kernels()[1][(n,)](vals, idx, temps, top_k, top_p, seeds, steps, out, vals.stride(0), idx.stride(0), V=vocab,
                        BLOCK=BLOCK, RUNTIME_LOOP=not interpreted(), num_warps=WARPS)
    return out


def accept(vals: torch.Tensor, idx: Optional[torch.Tensor], drafts: torch.Tensor, temps: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance (speculative.accept_device's rule) for n rows of L drafts [n, L]: vals
    [n * (L+1), V] the scaled logits of each row's L+1 positions, sorted with their token ids `idx`
    where a row truncates (None: unsorted, no row truncates). Returns (kept drafts [n], next token [n])."""
    n, L = drafts.shape
    vocab = vals.shape[1]
    keep = torch.empty(n, dtype=torch.long, device=vals.device)
    nxt = torch.empty(n, dtype=torch.long, device=vals.device)
    ids = vals if idx is None else idx  # an unused pointer where unsorted
    _kernels()[2][(n,)](vals, ids, drafts, temps, top_k, top_p, seeds, steps, keep, nxt, vals.stride(0),
                        ids.stride(0), L=L, V=vocab, SORTED=idx is not None, BLOCK=BLOCK,
                        RUNTIME_LOOP=not interpreted(), num_warps=WARPS)
    return keep, nxt

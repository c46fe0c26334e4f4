"""The device sampler's draw and the speculative acceptance as a few Triton launches a step.

`sampler.reference_draw` is the rule in eager PyTorch: temperature, top-k and top-p as masks over the
sorted row, the draw by Gumbel-max over noise hashed from (seed, step, token id). Eagerly that is 115
torch ops a step with top-p, 97 without (counted with torch.profiler; most are elementwise over [rows,
vocabulary], the hash alone some forty), each launched from Python: on a GPU the host spends about as
long launching them as a small model's whole decode step, and the device runs them one after another.
Here the mask, the noise and the argmax run in registers. A row is split over chunks of programs where
the work is a reduction over the whole row (one program walking a 152k-token row was as slow as the
eager rule at batch 1 on an H100: bench/gpu-sampler-h100.json):

- `draw_full` (no row truncates): logits / temperature + noise, each chunk's best, then torch picks the
  best chunk (the first of equal ones, as argmax does): one read of the row, three launches.
- `draw_sorted` (some row truncates; after a stable torch.sort, so ties keep the token order):
  `mass_partials` sums each chunk's top-k mass, then one program a row walks the row from its top,
  keeping tokens while the mass ranked above them is under top_p of it (at least one), adding each
  one's noise and keeping the running best; it stops at the first block past the nucleus (short at
  the recipes' top-p).
- `accept` (speculative.accept_device's rule): one program a row takes its L+1 positions in turn:
  each draft's share of its position's nucleus against the row's seeded uniform, and at the first
  rejection the noisy best of the nucleus without the rejected draft (with every draft kept, of the
  last position's). Sorted rows: the nucleus walk as above, after `mass_partials`; where no row
  truncates the nucleus is the whole row, and `position_stats` reduces each chunk of it first (max,
  mass, the draft's share, the best noisy tokens with and without the draft).

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

# Tokens a loop iteration reads, and warps a program (wide: a program's iterations depend on each other)
BLOCK = 4096
WARPS = 8


@functools.lru_cache(maxsize=None)
def _kernels():
    # module globals: Triton's interpreter runs a kernel with its module's globals only, not this closure
    global hash32, row_key, uniform, gumbel, running_best, nucleus
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
    def running_best(score, tokens, best_v, best_t):
        """(best score, its token) after one more block of scores and their token ids: strictly better
        only, so the first of equal scores wins, as torch.argmax picks it (tl.argmax takes the first)."""
        v = tl.max(score, 0)
        t = tl.sum(tl.where(tl.arange(0, score.shape[0]) == tl.argmax(score, 0), tokens, 0), 0).to(tl.int64)
        better = v > best_v
        return tl.where(better, v, best_v), tl.where(better, t, best_t)

    @triton.jit
    def draw_full(logits_ptr, temp_ptr, seed_ptr, step_ptr, best_v_ptr, best_t_ptr, stride, V: tl.constexpr,
                  CHUNK: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        """Chunk c of row r: its best score and token (the first of equal ones) into [r, c]."""
        row, c = tl.program_id(0), tl.program_id(1)
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
        key = row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
        best_v = tl.full((), float("-inf"), tl.float32)
        best_t = tl.full((), 0, tl.int64)
        if c * CHUNK < V:  # a chunk past the row's end (C is a power of two) has nothing to do
            for i in range(0, CHUNK, BLOCK):
                t = c * CHUNK + i + tl.arange(0, BLOCK)
                live = t < V
                x = tl.load(logits_ptr + row * stride + t, mask=live, other=0.0).to(tl.float32)
                score = tl.where(greedy, x, tl.math.div_rn(x, tl.where(greedy, 1.0, temp)) + gumbel(key, t))
                best_v, best_t = running_best(tl.where(live, score, float("-inf")), t, best_v, best_t)
        tl.store(best_v_ptr + row * C + c, best_v)
        tl.store(best_t_ptr + row * C + c, best_t)

    @triton.jit
    def mass_partials(vals_ptr, topk_ptr, part_ptr, stride_v, L1: tl.constexpr, V: tl.constexpr,
                      CHUNK: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        """Chunk c of sorted row r: the mass (relative to exp of the row's first value) of its tokens ranked
        under the row's top-k (the k of batch row r // L1) into [r, c]."""
        r, c = tl.program_id(0), tl.program_id(1)
        k = tl.minimum(tl.load(topk_ptr + r // L1), V)
        vrow = vals_ptr + r * stride_v
        m = tl.load(vrow)
        acc = tl.zeros((BLOCK,), tl.float32)
        if c * CHUNK < k:  # (a chunk with none of the top-k adds nothing)
            for i in range(0, CHUNK, BLOCK):
                pos = c * CHUNK + i + tl.arange(0, BLOCK)
                acc += tl.where(pos < k, tl.exp(tl.load(vrow + pos, mask=pos < k, other=0.0) - m), 0.0)
        tl.store(part_ptr + r * C + c, tl.sum(acc, 0))

    @triton.jit
    def draw_sorted(vals_ptr, idx_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, mass_ptr, out_ptr, stride_v,
                    stride_i, V: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        vrow = vals_ptr + row * stride_v
        irow = idx_ptr + row * stride_i
        first = tl.load(irow)
        if tl.load(temp_ptr + row) == 0.0:  # greedy: the sorted row's first token
            tl.store(out_ptr + row, first)
        else:
            k = tl.minimum(tl.load(topk_ptr + row), V)
            m = tl.load(vrow)  # the row's largest scaled logit: the mass is counted relative to it
            limit = tl.load(topp_ptr + row) * tl.sum(tl.load(mass_ptr + row * C + tl.arange(0, C)), 0)
            key = row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
            _, _, _, token = nucleus(vrow, irow, m, k, limit, -1, key, True, False, V, BLOCK)
            tl.store(out_ptr + row, token)

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
            best_i, tok_i = running_best(score, tokens, best_i, tok_i)
            if EXCLUDE:
                best_x, tok_x = running_best(tl.where(tokens == exclude, float("-inf"), score), tokens, best_x, tok_x)
            above += tl.sum(e, 0)
            start += BLOCK
        return kept, share, tok_x, tok_i

    @triton.jit
    def position_stats(vals_ptr, drafts_ptr, seed_ptr, step_ptr, f_ptr, i_ptr, stride_v, L: tl.constexpr,
                       V: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        """Chunk c of unsorted position row r (batch row r // (L+1), position r % (L+1)): its max and first
        argmax, its mass and the position's draft's share relative to that max, and its best noisy token
        with and without the draft, into f [R, 5, C] (max, mass, share, best, best without) and i [R, 3, C]
        (argmax, best token, best token without): `accept` combines the chunks."""
        r, c = tl.program_id(0), tl.program_id(1)
        b, j = r // (L + 1), r % (L + 1)
        d = tl.where(j < L, tl.load(drafts_ptr + b * L + tl.minimum(j, L - 1)), -1)
        key = row_key(tl.load(seed_ptr + b), tl.load(step_ptr + b) + (1 << 20))  # the next token's noise
        vrow = vals_ptr + r * stride_v
        m = tl.full((), float("-inf"), tl.float32)
        first = tl.full((), 0, tl.int64)
        mass = tl.full((), 0.0, tl.float32)
        share = tl.full((), 0.0, tl.float32)
        bi_v = tl.full((), float("-inf"), tl.float32)
        bi_t = tl.full((), 0, tl.int64)
        bx_v = tl.full((), float("-inf"), tl.float32)
        bx_t = tl.full((), 0, tl.int64)
        if c * CHUNK < V:  # a chunk past the row's end (C is a power of two) has nothing to do
            for i in range(0, CHUNK, BLOCK):
                t = c * CHUNK + i + tl.arange(0, BLOCK)
                live = t < V
                x = tl.load(vrow + t, mask=live, other=float("-inf"))
                m_new, first = running_best(x, t, m, first)
                m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # -inf only in a block past the row's end
                rescale = tl.exp(m - m_ref)
                e = tl.where(live, tl.exp(x - m_ref), 0.0)
                mass = mass * rescale + tl.sum(e, 0)
                share = share * rescale + tl.sum(tl.where(t == d, e, 0.0), 0)
                m = m_new
                score = tl.where(live, x + gumbel(key, t), float("-inf"))
                bi_v, bi_t = running_best(score, t, bi_v, bi_t)
                bx_v, bx_t = running_best(tl.where(t == d, float("-inf"), score), t, bx_v, bx_t)
        tl.store(f_ptr + (r * 5 + 0) * C + c, m)
        tl.store(f_ptr + (r * 5 + 1) * C + c, mass)
        tl.store(f_ptr + (r * 5 + 2) * C + c, share)
        tl.store(f_ptr + (r * 5 + 3) * C + c, bi_v)
        tl.store(f_ptr + (r * 5 + 4) * C + c, bx_v)
        tl.store(i_ptr + (r * 3 + 0) * C + c, first)
        tl.store(i_ptr + (r * 3 + 1) * C + c, bi_t)
        tl.store(i_ptr + (r * 3 + 2) * C + c, bx_t)

    @triton.jit
    def accept(vals_ptr, idx_ptr, drafts_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, mass_ptr, f_ptr, i_ptr,
               keep_ptr, next_ptr, stride_v, stride_i, L: tl.constexpr, V: tl.constexpr, SORTED: tl.constexpr,
               C: tl.constexpr, BLOCK: tl.constexpr):
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
            if j < L:
                d = tl.load(drafts_ptr + b * L + j)
            else:
                d = tl.full((), -1, tl.int64)
            if SORTED:  # largest first, ties in token order
                m = tl.load(vrow)
                first = tl.load(irow)
                limit = top_p * tl.sum(tl.load(mass_ptr + (b * (L + 1) + j) * C + tl.arange(0, C)), 0)
                kept, share, tok_x, tok_i = nucleus(vrow, irow, m, k, limit, d, key_draw, SORTED, True, V, BLOCK)
            else:  # no row truncates: the whole row, from its chunks' statistics (position_stats)
                fr = f_ptr + (b * (L + 1) + j) * 5 * C + tl.arange(0, C)
                ir = i_ptr + (b * (L + 1) + j) * 3 * C
                ms = tl.load(fr)
                m = tl.max(ms, 0)
                first = tl.load(ir + tl.argmax(ms, 0))  # the first chunk holding the max: the first token
                w = tl.where(ms > float("-inf"), tl.exp(ms - m), 0.0)
                kept = tl.sum(tl.load(fr + C) * w, 0)
                share = tl.sum(tl.load(fr + 2 * C) * w, 0)
                tok_i = tl.load(ir + C + tl.argmax(tl.load(fr + 3 * C), 0))
                tok_x = tl.load(ir + 2 * C + tl.argmax(tl.load(fr + 4 * C), 0))
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

    return draw_full, draw_sorted, accept, mass_partials, position_stats


def chunks(vocab: int) -> tuple[int, int]:
    """(tokens a chunk, chunks a row: a power of two, at most MAX_CHUNKS) for the kernels that split a row
    over programs (the draw without truncation, the top-k mass)."""
    blocks = -(-vocab // BLOCK)
    c = min(MAX_CHUNKS, 1 << (blocks - 1).bit_length())
    return -(-blocks // c) * BLOCK, c


MAX_CHUNKS = 64


def top_k_mass(vals: torch.Tensor, top_k: torch.Tensor, rows_per_k: int = 1) -> torch.Tensor:
    """Per sorted row of vals [R, V] and chunk, the mass of its top-k tokens relative to its first
    ([R, chunks] float32; top_k [R // rows_per_k])."""
    rows, vocab = vals.shape
    chunk, c = chunks(vocab)
    part = torch.empty((rows, c), dtype=torch.float32, device=vals.device)
    _kernels()[3][(rows, c)](vals, top_k, part, vals.stride(0), L1=rows_per_k, V=vocab, CHUNK=chunk, C=c,
                             BLOCK=BLOCK, num_warps=WARPS)
    return part


def draw_full(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Tokens [n] (int64) of logits [n, V] (float32) at temperatures [n] (0: greedy) with no truncation,
    `seeds` and `steps` [n] (int64) seeding each row's noise: each row split over chunks, the chunks' best
    reduced by torch (the first chunk of equal bests: the first token, as argmax picks it)."""
    n, vocab = logits.shape
    chunk, c = chunks(vocab)
    best_v = torch.empty((n, c), dtype=torch.float32, device=logits.device)
    best_t = torch.empty((n, c), dtype=torch.long, device=logits.device)
    _kernels()[0][(n, c)](logits, temps, seeds, steps, best_v, best_t, logits.stride(0), V=vocab, CHUNK=chunk, C=c,
                          BLOCK=BLOCK, num_warps=WARPS)
    return best_t.gather(1, best_v.argmax(1, keepdim=True)).squeeze(1)


def draw_sorted(vals: torch.Tensor, idx: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Tokens [n] of rows sorted in descending order (vals [n, V] float32 scaled logits, idx their token
    ids, as a stable torch.sort gives them), with top-k [n] (the vocabulary for none), top-p [n]."""
    n, vocab = vals.shape
    mass = top_k_mass(vals, top_k)
    out = torch.empty(n, dtype=torch.long, device=vals.device)
    _kernels()[1][(n,)](vals, idx, temps, top_k, top_p, seeds, steps, mass, out, vals.stride(0), idx.stride(0),
                        V=vocab, C=mass.shape[1], BLOCK=BLOCK, num_warps=WARPS)
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
    chunk, c = chunks(vocab)
    if idx is not None:
        mass = top_k_mass(vals, top_k, L + 1)
        f, i, ids = mass, keep, idx  # (f and i unused)
    else:  # the rows' statistics a chunk at a time; `accept` combines them
        f = torch.empty((n * (L + 1), 5, c), dtype=torch.float32, device=vals.device)
        i = torch.empty((n * (L + 1), 3, c), dtype=torch.long, device=vals.device)
        _kernels()[4][(n * (L + 1), c)](vals, drafts, seeds, steps, f, i, vals.stride(0), L=L, V=vocab, CHUNK=chunk,
                                        C=c, BLOCK=BLOCK, num_warps=WARPS)
        mass, ids = f, vals  # (unused)
    _kernels()[2][(n,)](vals, ids, drafts, temps, top_k, top_p, seeds, steps, mass, f, i, keep, nxt, vals.stride(0),
                        ids.stride(0), L=L, V=vocab, SORTED=idx is not None, C=c, BLOCK=BLOCK, num_warps=WARPS)
    return keep, nxt

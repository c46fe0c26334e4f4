"""Decode and verify attention over the static slot cache: split-KV (flash-decoding) in Triton.

A decode step has one query token per sequence (a verify step a few), so attention is a read of the
sequence's keys and values and almost no arithmetic: its speed is bytes over bandwidth. With a
handful of sequences, one program per (sequence, KV head) leaves most of a GPU idle at long context,
so the keys of each sequence are cut into chunks read by separate programs (flash-decoding), each
leaving an unnormalised partial output with its running max and sum, and a second kernel combines
the chunks. Grouped-query heads share one read of their KV head: the `group` query heads of a KV
head and the step's `T` tokens are the rows of one [T*group, head_dim] tile.

The kernel reads the cache in place: `[slots, kv_heads, positions, head_dim]`, the slot of each batch
row given by `rows`, the last key a token may see by `pos` (both device tensors, so one CUDA graph
serves any lengths within its context bucket). The cache is bf16/fp16, or FP8 e4m3 with one float32
scale per (slot, KV head, position) (`quantize_kv`): the key scale multiplies the scores and the value
scale the probabilities, so nothing is dequantised in memory.

`reference_attention` is the same computation in PyTorch (dequantise, then SDPA): the CPU's path and
the tests' oracle (tests run the Triton kernel on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = ("auto", "fp8")  # serving.kv_cache_dtype: auto = the model's dtype


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (e4m3 values, float32 scale [...]): one scale per vector, its amax / 448,
    so no value overflows and each vector keeps e4m3's relative precision."""
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_kv(values: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                        ctx: int, scale: float, k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, T, nq, d]; caches [S, nkv, P, d] (scales [S, nkv, P] for FP8); rows [B] (or [B, T], the
    slot repeated along T); pos [B, T] (token t of row b sees keys 0..pos[b, t]); keys read up to `ctx`.
    Returns [B, T, nq, d] in q's dtype."""
    b, t, nq, d = q.shape
    nkv = k.shape[1]
    rows = rows if rows.dim() == 1 else rows[:, 0]
    keys = dequantize_kv(k[rows, :, :ctx], None if k_scale is None else k_scale[rows, :, :ctx], q.dtype)
    values = dequantize_kv(v[rows, :, :ctx], None if v_scale is None else v_scale[rows, :, :ctx], q.dtype)
    mask = (torch.arange(ctx, device=q.device).view(1, 1, ctx) <= pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, ctx]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                       enable_gqa=nq != nkv)
    return o.transpose(1, 2)


def interpreted() -> bool:
    """Triton's CPU interpreter (the tests' way to run the kernels without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels():
    # module globals: Triton's interpreter runs kernels with their module's globals only
    global to_e4m3, combine_rows
    import triton
    import triton.language as tl

    from server.embedded.triton_e4m3 import to_e4m3

    @triton.jit
    def split_kv(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, rows_ptr, pos_ptr, part_o, part_ml, sm_scale, stride_rb,
                 stride_qb, stride_qt, stride_qh, stride_cs, stride_ch, stride_cp, stride_ss, stride_sh,
                 count_ptr, out_ptr, s_ptr, stride_ob, stride_ot, stride_oh,
                 NKV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr,
                 FP8_SCORES: tl.constexpr, RUNTIME_LOOP: tl.constexpr, ONE_PASS: tl.constexpr,
                 QUANT: tl.constexpr):
        pid, split = tl.program_id(0), tl.program_id(1)
        b, h = pid // NKV, pid % NKV
        slot = tl.load(rows_ptr + b * stride_rb).to(tl.int64)
        r = tl.arange(0, BLOCK_M)
        tok, grp = r // G, r % G
        live = r < T * G
        qpos = tl.load(pos_ptr + b * T + tok, mask=live, other=-1)  # last key each row may see
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + tok[:, None] * stride_qt + (h * G + grp)[:, None] * stride_qh
                    + dd[None, :], mask=live[:, None], other=0.0)
        if FP8_SCORES:  # the scores as an e4m3 dot on the keys as cached: the query quantized a row, as
            # quantize_kv quantizes a vector (a lossy step of its own, priced with the FP8 cache's)
            qf = q.to(tl.float32)
            q_scale = tl.maximum(tl.max(tl.abs(qf), 1) / 448.0, 1e-12)
            q8 = to_e4m3(qf, q_scale[:, None])
        if FP8:  # e4m3 widens to fp16 in one instruction (to bf16 it takes several): the dots run in fp16
            q = q.to(tl.float16)
        # This row's keys (the most any of its tokens sees) in whole blocks, dealt evenly over its SPLITS
        # programs: the split follows the row's own length, not the context bucket the graph was
        # captured for (a row just past a power of two would otherwise leave half its programs idle).
        # No program gets more than CHUNK keys, the bucket's chunk.
        keys = tl.max(qpos, 0) + 1
        blocks = tl.cdiv(keys, BLOCK_N)
        start = (split * blocks // SPLITS) * BLOCK_N
        end = tl.minimum(((split + 1) * blocks // SPLITS) * BLOCK_N, keys)
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # running max and sum, in base 2
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        k_base = k_ptr + slot * stride_cs + h * stride_ch
        v_base = v_ptr + slot * stride_cs + h * stride_ch
        s_base = slot * stride_ss + h * stride_sh
        # scores in base 2: sm_scale * log2(e) folds into the key scales (one multiply a key, not a score)
        # and the exponentials are exp2, the GPU's native one
        qk_scale = sm_scale * 1.4426950408889634
        # The loop body holds no branch, so the compiler can prefetch the next block's keys and values
        # while this one computes (loads under an `if` are not pipelined). On a GPU it runs to the
        # chunk's last key; the interpreter needs a constant trip count (the bucket's CHUNK), and blocks
        # past `end` are fully masked (no bytes read, probabilities 0).
        for i in range(0, tl.cdiv(end - start, BLOCK_N) if RUNTIME_LOOP else CHUNK // BLOCK_N):
            n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            kmask = n < end
            kb = tl.load(k_base + n[:, None] * stride_cp + dd[None, :], mask=kmask[:, None], other=0.0)
            vb = tl.load(v_base + n[:, None] * stride_cp + dd[None, :], mask=kmask[:, None], other=0.0)
            if FP8_SCORES:
                s = tl.dot(q8, tl.trans(kb)) * q_scale[:, None]
            else:
                s = tl.dot(q, tl.trans(kb.to(q.dtype)))
            if FP8:
                s = s * (tl.load(ks_ptr + s_base + n, mask=kmask, other=0.0) * qk_scale)[None, :]
            else:
                s = s * qk_scale
            seen = n[None, :] <= qpos[:, None]
            if not RUNTIME_LOOP:  # the constant trip count runs on into the next chunk's keys
                seen = seen & kmask[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8:
                p = p * tl.load(vs_ptr + s_base + n, mask=kmask, other=0.0)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vb.to(q.dtype))
            m_i = m_new
        base = (pid * SPLITS + split) * BLOCK_M
        tl.store(part_o + (base + r)[:, None] * D + dd[None, :], acc)
        tl.store(part_ml + (base + r) * 2, m_i)
        tl.store(part_ml + (base + r) * 2 + 1, l_i)
        if ONE_PASS:  # the last of the row's programs to finish combines the partials (no second launch)
            tl.debug_barrier()  # every thread's partials stored before the release below
            done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            if done == SPLITS - 1:
                combine_rows(part_o, part_ml, out_ptr, q_ptr, s_ptr, stride_ob, stride_ot, stride_oh, pid, NKV, T,
                             G, D, BLOCK_M, SPLITS, QUANT)
                tl.store(count_ptr + pid, 0)  # ready for the next launch (a CUDA graph's replays included)

    @triton.jit
    def combine(part_o, part_ml, out_ptr, q_ptr, s_ptr, stride_ob, stride_ot, stride_oh,
                NKV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                SPLITS: tl.constexpr, QUANT: tl.constexpr):
        combine_rows(part_o, part_ml, out_ptr, q_ptr, s_ptr, stride_ob, stride_ot, stride_oh, tl.program_id(0), NKV,
                     T, G, D, BLOCK_M, SPLITS, QUANT)

    @triton.jit
    def combine_rows(part_o, part_ml, out_ptr, q_ptr, s_ptr, stride_ob, stride_ot, stride_oh, pid,
                     NKV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     SPLITS: tl.constexpr, QUANT: tl.constexpr):
        """Program (row, KV head) `pid`'s partials combined into its output rows. The partials are read
        past the L1 cache (.cg): in the one-pass form other multiprocessors wrote them."""
        b, h = pid // NKV, pid % NKV
        r = tl.arange(0, BLOCK_M)
        dd = tl.arange(0, D)
        m = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        for s in range(SPLITS):
            m = tl.maximum(m, tl.load(part_ml + ((pid * SPLITS + s) * BLOCK_M + r) * 2, cache_modifier=".cg"))
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for s in range(SPLITS):
            base = (pid * SPLITS + s) * BLOCK_M
            w = tl.math.exp2(tl.load(part_ml + (base + r) * 2, cache_modifier=".cg") - m)
            total += tl.load(part_ml + (base + r) * 2 + 1, cache_modifier=".cg") * w
            acc += tl.load(part_o + (base + r)[:, None] * D + dd[None, :], cache_modifier=".cg") * w[:, None]
        tok, grp = r // G, r % G
        live = r < T * G
        o = acc / tl.maximum(total, 1e-30)[:, None]
        if QUANT:  # o_proj's FP8 input, from the output in the model's dtype (q's), as quantize_e4m3 reads it
            o = to_e4m3(o.to(q_ptr.dtype.element_ty).to(tl.float32), tl.load(s_ptr).to(tl.float32))
        tl.store(out_ptr + b * stride_ob + tok[:, None] * stride_ot + (h * G + grp)[:, None] * stride_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows_ptr, pos_ptr, stride_kt, stride_kh, stride_vt,
                 stride_vh, stride_cs, stride_ch, stride_cp, stride_ss, stride_sh, NKV: tl.constexpr, D: tl.constexpr,
                 FP8: tl.constexpr):
        tok, h = tl.program_id(0) // NKV, tl.program_id(0) % NKV
        slot = tl.load(rows_ptr + tok).to(tl.int64)
        p = tl.load(pos_ptr + tok).to(tl.int64)
        dd = tl.arange(0, D)
        k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + dd).to(tl.float32)
        v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + dd).to(tl.float32)
        at = slot * stride_cs + h * stride_ch + p * stride_cp + dd
        if FP8:
            ks = tl.maximum(tl.max(tl.abs(k), 0) / 448.0, 1e-12)
            vs = tl.maximum(tl.max(tl.abs(v), 0) / 448.0, 1e-12)
            tl.store(kc_ptr + at, (k / ks).to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + at, (v / vs).to(vc_ptr.dtype.element_ty))
            tl.store(ks_ptr + slot * stride_ss + h * stride_sh + p, ks)
            tl.store(vs_ptr + slot * stride_ss + h * stride_sh + p, vs)
        else:
            tl.store(kc_ptr + at, k.to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + at, v.to(vc_ptr.dtype.element_ty))

    return split_kv, combine, write_kv


BLOCK_N = 64  # keys a loop iteration reads (the smallest a launch configuration may use)


class SplitConfig(NamedTuple):
    """A launch configuration of the split kernel. (Swapping the dots' operands, so that a block's keys
    are the matrix multiply's M and a tile's few query rows its N, measured no faster over a bf16 cache
    and 1.15-8x slower over an FP8 one: H100, 2026-12-07, bench/attention-forms-h100.json.)"""

    block_n: int  # keys a loop iteration reads
    warps: int
    stages: int  # software pipeline depth
    # FP8 caches: the scores as an e4m3 x e4m3 dot on the keys as cached (no widening to fp16), the query
    # quantized a row as `quantize_kv` quantizes a vector; lossy, so only where measured faster
    fp8_scores: bool = False


# The split kernel's configuration per cache dtype, and for verify steps (several tokens a row) where it
# differs: decode, the fastest or within 1% of it at 14B and 1.5B, batch 1 and 16, 8k keys (`python -m
# server.bench.attention --tune`, H100, bench/attention-tune-h100.json; 128-key blocks gain most at batch
# 1, 14B: 13.9 us against 17.2); an FP8 verify of 4 tokens a row, the fastest at 14B batch 16, 8k keys
# (H100, 2026-12-07, bench/gpu-fp8-verify-h100.json: 149.2 us against 195.1 with decode's; its 32-row
# tiles widen twice the e4m3 keys' work of a decode's 16 rows a block, so half the keys a block; with
# the base-2 softmax 143.6 us and still the fastest, bench/attention-forms-h100.json)
SPLIT_CONFIG = {"model": SplitConfig(128, 4, 3), "fp8": SplitConfig(128, 4, 3), "fp8_verify": SplitConfig(64, 4, 3)}


def launch_key(fp8: bool, tokens: int, table: dict) -> str:
    """The key of `table` (SPLIT_CONFIG, PROGRAMS_PER_SM) for a cache dtype and tokens a row: a verify's
    ("<dtype>_verify") where the table has one, else the dtype's."""
    name = "fp8" if fp8 else "model"
    return f"{name}_verify" if tokens > 1 and f"{name}_verify" in table else name


def split_config(fp8: bool, tokens: int) -> SplitConfig:
    """SPLIT_CONFIG's entry for a cache dtype and tokens a row (a verify's, where it has its own)."""
    return SPLIT_CONFIG[launch_key(fp8, tokens, SPLIT_CONFIG)]


# Programs per (row, KV head) at most: the combine kernel reads the chunks' partials one after another,
# so past this many its serial pass costs more than the parallel reads save (H200,
# bench/attention-h200.json: 1.5B shape, batch 1, 8k keys: 128 chunks of 64 keys 35 us, 32 of 256 16 us)
MAX_SPLITS = 32


def plan_splits(batch: int, kv_heads: int, ctx: int, programs: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(chunk, splits): keys per program and programs per (row, KV head), so that at most about `programs`
    programs run, each reading at least `block_n` keys (a whole number of blocks), and no row is cut
    into more than MAX_SPLITS. The chunk is a row of `ctx` keys'; the kernel cuts a shorter row's
    keys into the same number of smaller chunks (`split_kv`)."""
    # rounded down: programs past a whole wave would run as a second, mostly idle one
    want = min(MAX_SPLITS, max(1, programs // (batch * kv_heads)))
    chunk = max(block_n, -(-ctx // want))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-ctx // chunk)


# Programs a multiprocessor, per cache dtype (and for verify steps where it differs, "<dtype>_verify", as
# in SPLIT_CONFIG): a decode program is one 16-row tile, and a second one
# resident on each multiprocessor hides the other's memory latency (batch 16, 8k keys: 52 us against 71
# with one); `bench.attention --tune` times 1-4 for each dtype (its last column)
PROGRAMS_PER_SM = {"model": 2, "fp8": 2}


@functools.lru_cache(maxsize=None)
def _programs(device: int, fp8: bool, tokens: int) -> int:
    """How many programs the split kernel plans for on CUDA device `device` (PROGRAMS_PER_SM's entry for
    the cache dtype and tokens a row, as `launch_key` picks it)."""
    per_sm = PROGRAMS_PER_SM[launch_key(fp8, tokens, PROGRAMS_PER_SM)]
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                       ctx: int, scale: float, k_scale: Optional[torch.Tensor] = None,
                       v_scale: Optional[torch.Tensor] = None, programs: Optional[int] = None,
                       config: Optional[Sequence] = None, out_scale: Optional[torch.Tensor] = None,
                       counters: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`reference_attention`'s contract, as two Triton launches (one with `counters`). `ctx` bounds the
    keys read (the CUDA graph's context bucket) and, with `programs` (default: PROGRAMS_PER_SM's for the
    cache dtype on CUDA), how many programs a row gets; each row's own keys (up to its `pos`) are dealt
    evenly among them, so a row far shorter than the bucket keeps them all busy. `config` (a
    `SplitConfig` or its fields as a tuple; default `split_config`'s) is for measuring others.
    With `out_scale`, the output comes as the FP8 e4m3 input of the o_proj GEMM that reads it,
    `quantize_e4m3(out, out_scale)`'s bytes without a launch of its own.
    With `counters` (int32 zeros, at least B x kv_heads: `one_pass_counters`), the last program of each
    (row, KV head) to finish combines the partials itself, and leaves its counter at zero again."""
    b, t, nq, d = q.shape
    nkv = k.shape[1]
    out = torch.empty_like(q, dtype=torch.float8_e4m3fn if out_scale is not None else q.dtype)
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < b * nkv):
        raise ValueError(f"split_kv_attention: counters must be int32 zeros, at least {b} x {nkv}")
    part_o, part_ml, splits, block_m = split_partials(q, k, v, rows, pos, ctx, scale, k_scale, v_scale, programs,
                                                      config, out, out_scale, counters)
    if counters is None:
        _kernels()[1][(b * nkv,)](part_o, part_ml, out, q, part_ml if out_scale is None else out_scale,
                                  out.stride(0), out.stride(1), out.stride(2),
                                  NKV=nkv, T=t, G=nq // nkv, D=d, BLOCK_M=block_m, SPLITS=splits,
                                  QUANT=out_scale is not None)
    return out


def one_pass_counters(max_batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed counters `split_kv_attention(counters=...)` needs for up to `max_batch` rows: one
    buffer serves every layer (the launches run one after another, and each leaves it zeroed)."""
    return torch.zeros(max_batch * kv_heads, dtype=torch.int32, device=device)


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                   ctx: int, scale: float, k_scale: Optional[torch.Tensor] = None,
                   v_scale: Optional[torch.Tensor] = None, programs: Optional[int] = None,
                   config: Optional[Sequence] = None, out: Optional[torch.Tensor] = None,
                   out_scale: Optional[torch.Tensor] = None, counters: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The split kernel's launch (split_kv_attention's first half): (partial outputs [B*nkv*splits*block_m,
    d], their running max and sum [.., 2] in base 2 (of scores times log2 e), splits, block_m), the rows
    of program (b, kv head, split) at ((b*nkv + head)*splits + split)*block_m. With `counters` it also
    combines them into `out` (split_kv_attention's one-pass form)."""
    b, t, nq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    if d & (d - 1) or d < 16:
        raise ValueError(f"split_kv_attention: head_dim {d} must be a power of two >= 16")
    if k.stride(-1) != 1 or q.stride(-1) != 1 or pos.stride(1) != 1 or pos.stride(0) != t:
        raise ValueError("split_kv_attention: q and the caches need a contiguous head_dim, pos a contiguous [B, T]")
    fp8 = k_scale is not None
    block_n, warps, stages, fp8_scores = SplitConfig(*config) if config else split_config(fp8, t)
    if fp8_scores and not fp8:
        raise ValueError("split_kv_attention: fp8_scores needs an FP8 cache (k_scale and v_scale)")
    if fp8_scores and d < 32:  # an 8-bit dot's K is at least 32 on NVIDIA GPUs
        raise ValueError(f"split_kv_attention: fp8_scores needs head_dim >= 32, not {d}")
    if block_n < BLOCK_N or block_n & (block_n - 1):
        raise ValueError(f"split_kv_attention: keys per iteration {block_n} must be a power of two >= {BLOCK_N}")
    block_m = max(16, 1 << math.ceil(math.log2(t * g)))
    if programs is None:
        programs = _programs(q.device.index or 0, fp8, t) if q.is_cuda else 8
    chunk, splits = plan_splits(b, nkv, ctx, programs, block_n)
    part_o = torch.empty((b * nkv * splits * block_m, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b * nkv * splits * block_m, 2), dtype=torch.float32, device=q.device)
    ks = k_scale if fp8 else part_ml  # an unused pointer when the cache is not FP8
    vs = v_scale if fp8 else part_ml
    one_pass = counters is not None
    o = out if one_pass else part_o  # unused pointers in the two-launch form
    _kernels()[0][(b * nkv, splits)](
        q, k, v, ks, vs, rows, pos, part_o, part_ml, scale, rows.stride(0),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0,
        counters if one_pass else part_ml, o, out_scale if out_scale is not None else part_ml,
        o.stride(0) if one_pass else 0, o.stride(1) if one_pass else 0, o.stride(2) if one_pass else 0,
        NKV=nkv, T=t, G=g, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=chunk, SPLITS=splits, FP8=fp8,
        FP8_SCORES=bool(fp8_scores), RUNTIME_LOOP=not interpreted(), ONE_PASS=one_pass,
        QUANT=one_pass and out_scale is not None, num_warps=warps, num_stages=stages)
    return part_o, part_ml, splits, block_m


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
             pos: torch.Tensor, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """cache[rows[i], :, pos[i]] := k[i], v[i] for the N new tokens (k, v [N, nkv, d]; rows, pos [N] or any
    shape of N), quantized with their scales for an FP8 cache (`quantize_kv`'s numbers): one launch for
    what indexing does in two (bf16) or fourteen (FP8) kernels."""
    n, nkv, d = k.shape
    rows, pos = rows.reshape(-1), pos.reshape(-1)
    if rows.numel() != n or pos.numel() != n or k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        raise ValueError("write_kv: k and v [N, kv_heads, head_dim] with a contiguous head_dim, N rows and positions")
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused pointers for a model-dtype cache
    _kernels()[2][(n * nkv,)](k, v, k_cache, v_cache, ks, vs, rows.contiguous(), pos.contiguous(),
                              k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                              k_cache.stride(1), k_cache.stride(2),
                              ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, NKV=nkv, D=d, FP8=fp8)

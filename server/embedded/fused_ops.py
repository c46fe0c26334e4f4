"""The elementwise work of a decoder layer's decode step, fused into three Triton kernels.

Around its GEMMs a llama-layout layer does RMSNorm twice, two residual adds, RoPE on q and k, the KV
write and SiLU(gate) * up. Eagerly that is about 30 small kernels a layer (RMSNorm alone is six:
cast, square, mean, rsqrt, two multiplies), each launched and each a round trip through memory: at
batch 1 they, not the weight bytes, set the step time of a 1.5B model, and they cost a 14B step a
third of its time (bench/gpu-h200.json). Here they are three kernels a layer:

- `add_rms_norm`: residual + delta, then RMSNorm of the sum (the next layer's input norm takes the
  MLP's output this way, the post-attention norm the o_proj's);
- `rope_write_kv`: RoPE on the q and k heads of the fused q/k/v projection's output, the rotated k
  and v written into the static slot cache (quantized with its scales for an FP8 cache), the rotated
  q returned for attention;
- `silu_mul`: SiLU(gate) * up of the fused gate/up projection's output.

Each rounds where transformers' eager ops round (to the model's dtype after every multiply and add,
the norm in float32), so the results match the eager layer's up to the order of the norm's sum.
`reference_*` below are those eager ops: the CPU's path and the tests' oracle (tests run the kernels
on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


def reference_add_rms_norm(residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, RMSNorm of it): transformers' Llama/Qwen2 RMSNorm op for op."""
    h = residual if delta is None else residual + delta
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * xf.to(h.dtype)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] rotated at cos/sin [N, d] (the halves-duplicated tables transformers builds)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


@functools.lru_cache(maxsize=None)
def _kernels():
    global to_e4m3  # a module global: Triton's interpreter runs kernels with their module's globals only
    import triton
    import triton.language as tl

    from server.embedded.triton_e4m3 import to_e4m3

    @triton.jit
    def add_rms_norm(res_ptr, delta_ptr, w_ptr, out_res_ptr, out_ptr, s_ptr, stride_r, stride_d, stride_or, stride_o,
                     eps, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, QUANT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        live = c < H
        if QUANT:  # loaded first: its latency overlaps the row's, not added after the reduction
            scale = tl.load(s_ptr).to(tl.float32)
        h = tl.load(res_ptr + row * stride_r + c, mask=live, other=0.0)
        if ADD:  # the sum rounds to the model's dtype, as `residual + delta` does
            h = (h.to(tl.float32) + tl.load(delta_ptr + row * stride_d + c, mask=live, other=0.0).to(tl.float32))
            h = h.to(out_res_ptr.dtype.element_ty)
            tl.store(out_res_ptr + row * stride_or + c, h, mask=live)
        dt = out_res_ptr.dtype.element_ty  # the model's dtype
        x = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        y = (x * inv).to(dt).to(tl.float32)
        w = tl.load(w_ptr + c, mask=live, other=0.0).to(tl.float32)
        out = (w * y).to(dt)
        if QUANT:  # the next FP8 GEMM's input, as gpu_kernels.quantize_e4m3 makes it from `out`
            out = to_e4m3(out.to(tl.float32), scale)
        tl.store(out_ptr + row * stride_o + c, out, mask=live)

    @triton.jit
    def rope_write_kv(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows_ptr,
                      pos_ptr, stride_t, stride_cos, stride_qt, stride_cs, stride_ch, stride_cp, stride_ss, stride_sh,
                      NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, BIAS: tl.constexpr):
        tok, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        half = tl.arange(0, D // 2)
        p = tl.load(pos_ptr + tok).to(tl.int64)
        base = qkv_ptr + tok * stride_t + head * D
        x1 = tl.load(base + half)
        x2 = tl.load(base + D // 2 + half)
        if BIAS:  # the projection's bias, added as `linear(x) + bias` adds it (rounded to the model's dtype)
            x1 = (x1.to(tl.float32) + tl.load(bias_ptr + head * D + half).to(tl.float32)).to(x1.dtype)
            x2 = (x2.to(tl.float32) + tl.load(bias_ptr + head * D + D // 2 + half).to(tl.float32)).to(x2.dtype)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        c1 = tl.load(cos_ptr + p * stride_cos + half).to(tl.float32)
        c2 = tl.load(cos_ptr + p * stride_cos + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + p * stride_cos + half).to(tl.float32)
        s2 = tl.load(sin_ptr + p * stride_cos + D // 2 + half).to(tl.float32)
        dt = q_out_ptr.dtype.element_ty
        # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model's dtype
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if head < NQ:
            q_at = q_out_ptr + tok * stride_qt + head * D
            tl.store(q_at + half, o1)
            tl.store(q_at + D // 2 + half, o2)
        else:  # a KV head: the rotated k and its v go to the row's slot at the token's position
            h = head - NQ
            slot = tl.load(rows_ptr + tok).to(tl.int64)
            at = slot * stride_cs + h * stride_ch + p * stride_cp
            v_base = qkv_ptr + tok * stride_t + (NQ + NKV + h) * D
            v1 = tl.load(v_base + half)
            v2 = tl.load(v_base + D // 2 + half)
            if BIAS:
                b_base = bias_ptr + (NQ + NKV + h) * D
                v1 = (v1.to(tl.float32) + tl.load(b_base + half).to(tl.float32)).to(v1.dtype)
                v2 = (v2.to(tl.float32) + tl.load(b_base + D // 2 + half).to(tl.float32)).to(v2.dtype)
            v1, v2 = v1.to(tl.float32), v2.to(tl.float32)
            k1, k2 = o1.to(tl.float32), o2.to(tl.float32)
            if FP8:  # decode_attention.quantize_kv's numbers: one scale a vector, its amax / 448
                ks = tl.maximum(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)) / 448.0, 1e-12)
                vs = tl.maximum(tl.maximum(tl.max(tl.abs(v1), 0), tl.max(tl.abs(v2), 0)) / 448.0, 1e-12)
                k1, k2, v1, v2 = k1 / ks, k2 / ks, v1 / vs, v2 / vs
                tl.store(ks_ptr + slot * stride_ss + h * stride_sh + p, ks)
                tl.store(vs_ptr + slot * stride_ss + h * stride_sh + p, vs)
            ct = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + at + half, k1.to(ct))
            tl.store(kc_ptr + at + D // 2 + half, k2.to(ct))
            tl.store(vc_ptr + at + half, v1.to(ct))
            tl.store(vc_ptr + at + D // 2 + half, v2.to(ct))

    @triton.jit
    def silu_mul(gu_ptr, out_ptr, s_ptr, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                 QUANT: tl.constexpr):
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        c = blk * BLOCK + tl.arange(0, BLOCK)
        live = c < INTER
        if QUANT:  # loaded first (see add_rms_norm)
            scale = tl.load(s_ptr).to(tl.float32)
        g = tl.load(gu_ptr + row * stride_g + c, mask=live, other=0.0)
        dt = g.dtype  # the model's dtype
        g = g.to(tl.float32)
        u = tl.load(gu_ptr + row * stride_g + INTER + c, mask=live, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds before the product
        out = (act * u).to(dt)
        if QUANT:  # the down projection's FP8 input (the same rounding as in add_rms_norm)
            out = to_e4m3(out.to(tl.float32), scale)
        tl.store(out_ptr + row * stride_o + c, out, mask=live)

    return add_rms_norm, rope_write_kv, silu_mul


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what}: expected a [rows, features] tensor with contiguous features, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x


def add_rms_norm(residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                 quant_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_add_rms_norm` in one launch: (residual + delta, its RMSNorm), both [N, H] new
    tensors (with `delta` None: (residual, its RMSNorm)). With `quant_scale`, the norm comes out as the
    FP8 e4m3 input of the GEMM that reads it: `quantize_e4m3(norm, quant_scale)` without a launch of its own."""
    import triton

    _rows(residual, "add_rms_norm residual")
    n, hidden = residual.shape
    out = torch.empty_like(residual, dtype=torch.float8_e4m3fn if quant_scale is not None else residual.dtype)
    if delta is None:
        summed, d = residual, residual
    else:
        d = _rows(delta, "add_rms_norm delta")
        summed = torch.empty_like(residual)
    block = triton.next_power_of_2(hidden)
    s = quant_scale if quant_scale is not None else weight  # an unused pointer without quantization
    _kernels()[0][(n,)](residual, d, weight, summed, out, s, residual.stride(0), d.stride(0), summed.stride(0),
                        out.stride(0), eps, H=hidden, BLOCK=block, ADD=delta is not None, QUANT=quant_scale is not None,
                        num_warps=min(16, max(1, block // 512)))
    return summed, out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """For the N tokens of a fused q/k/v output `qkv` [N, (nq + 2 nkv) d] (plus `bias` [(nq + 2 nkv) d]
    where the GEMM left it out): RoPE at positions `pos` [N] (cos/sin tables [positions, d]) on the q
    and k heads; cache[rows[i], :, pos[i]] := rotated k and v (quantized, with scales, for an FP8 cache,
    as decode_attention.write_kv); returns the rotated q [N, nq, d]. One launch for what eager ops do
    in about fifteen (the bias: at one row torch adds a linear's bias with a copy kernel of its own,
    as cuBLASLt's bias epilogue takes two rows or more)."""
    _rows(qkv, "rope_write_kv qkv")
    d = k_cache.shape[-1]
    n = qkv.shape[0]
    rows, pos = rows.reshape(-1), pos.reshape(-1)
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or rows.numel() != n or pos.numel() != n:
        raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)} is not [N, ({num_heads} + 2 x {num_kv_heads}) x {d}]"
                         f" with N rows and positions (got {rows.numel()} and {pos.numel()})")
    if d & (d - 1) or d < 4 or k_cache.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope_write_kv: head_dim must be a power of two, the cache's and tables' last dim contiguous")
    if bias is not None and (bias.shape != (qkv.shape[1],) or bias.stride(0) != 1):
        raise ValueError(f"rope_write_kv: bias {tuple(bias.shape)} is not a contiguous [{qkv.shape[1]}]")
    q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused pointers for a model-dtype cache
    _kernels()[1][(n, num_heads + num_kv_heads)](
        qkv, qkv if bias is None else bias, cos, sin, q, k_cache, v_cache, ks, vs, rows.contiguous(), pos.contiguous(),
        qkv.stride(0), cos.stride(0),
        q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, NQ=num_heads, NKV=num_kv_heads, D=d, FP8=fp8,
        BIAS=bias is not None)
    return q


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor, quant_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`reference_silu_mul` in one launch: [N, 2 I] -> [N, I]; with `quant_scale`, as FP8 e4m3 (see add_rms_norm)."""
    _rows(gate_up, "silu_mul gate_up")
    n, two_i = gate_up.shape
    inter = two_i // 2
    dtype = torch.float8_e4m3fn if quant_scale is not None else gate_up.dtype
    out = torch.empty((n, inter), dtype=dtype, device=gate_up.device)
    s = quant_scale if quant_scale is not None else gate_up  # an unused pointer without quantization
    _kernels()[2][(n, -(-inter // SILU_BLOCK))](gate_up, out, s, gate_up.stride(0), out.stride(0), INTER=inter,
                                                BLOCK=SILU_BLOCK, QUANT=quant_scale is not None)
    return out

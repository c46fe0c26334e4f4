"""Quantized GEMMs on a GPU: int8 weight-only through a fused dequantising Triton kernel, FP8 through
`torch._scaled_mm`. Both read the quantized bytes (half of bf16) instead of widening the weight.

- `w8a16_linear(x, w_int8, scale)`: y = (x @ w^T) * scale, int8 weights dequantised in registers,
  fp32 accumulation. Small batches (decode) have few output tiles, so the K loop is split over
  `split` programs whose fp32 partial sums land in a workspace and are added in a fixed order
  (deterministic, unlike atomics).
- `fp8_linear(x, w_fp8, w_scale, x_scale)`: per-tensor FP8 e4m3 as TensorRT-LLM runs ModelOpt's
  FP8 checkpoints: x quantised with the calibrated input scale, one FP8 tensor-core GEMM with both
  scales, bf16 out. Needs SM >= 8.9.

Imported only on CUDA (Triton is a GPU dependency); `available()` says whether each can run.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

FP8_MAX = 448.0


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def available() -> dict[str, bool]:
    if not torch.cuda.is_available():
        return {"w8a16": False, "fp8": False}
    import importlib.util

    w8 = importlib.util.find_spec("triton") is not None
    major, minor = torch.cuda.get_device_capability()
    return {"w8a16": w8, "fp8": (major, minor) >= (8, 9) and hasattr(torch, "_scaled_mm")}


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return w8a16


def _split(m_tiles: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """How many programs share the K loop, so that small batches still fill the GPU (>= 2 waves)."""
    split = 1
    while m_tiles * n_tiles * split < 2 * sms and split * 2 <= max(1, k_blocks // 2):
        split *= 2
    return split


# (BLOCK_N, BLOCK_K, num_warps, num_stages): chosen on an H200 with `python -m server.bench.kernels`;
# W8A16_CONFIG="n,k,warps,stages" overrides it (tuning on another GPU)
CONFIG = tuple(int(v) for v in os.environ.get("W8A16_CONFIG", "64,256,8,3").split(","))


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 config: Optional[tuple[int, int, int, int]] = None, split: Optional[int] = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ int8 weight [N, K] * per-channel scale [N] (+ bias) -> [..., N]."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    block_m = 16 if m <= 16 else 32
    block_n, block_k, warps, stages = config or CONFIG
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    split = split or _split(m_tiles, n_tiles, -(-k // block_k), _sm_count(x.device.index or 0))
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _kernel()[(n_tiles, m_tiles, split)](x2, weight, partial, m, n, k, x2.stride(0), weight.stride(0),
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                                         num_warps=warps, num_stages=stages)
    y = (partial.sum(0) if split > 1 else partial[0]) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape, n)


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               out_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor FP8: x / input_scale -> e4m3, one `_scaled_mm` with both scales (fp32 accumulate)."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:  # weight-only FP8 checkpoint: quantise the activation dynamically
        input_scale = (x2.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
    xq = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, weight_fp8.t(), scale_a=input_scale.reshape(()).float(),
                         scale_b=weight_scale.reshape(()).float(), bias=None, out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*shape, weight_fp8.shape[0])

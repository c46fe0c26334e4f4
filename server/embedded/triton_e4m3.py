"""`to_e4m3`, the Triton function that makes an FP8 GEMM's e4m3 input inside the kernels that produce it
(gpu_kernels.quantize_e4m3, fused_ops' norm and SiLU). Imports Triton: import it only where a kernel is
built (the modules that use it do so lazily).

e4m3(clamp(x / scale, +-448)) for float32 `x`, with x / scale rounded as IEEE division rounds (torch's
eager quantization and TensorRT-LLM's quantize kernels divide) but without `div_rn`'s instruction
sequence a value, which doubled the time of a norm that writes e4m3 (H100 profile at 14B: 4.7 against
2.3 us a launch). One reciprocal a program, then Markstein's correction: q = x * (1 / scale) is within
an ulp of the quotient, the residual x - q * scale is exact in an fma, and q + residual * (1 / scale),
in an fma, is the correctly rounded quotient. Quotients past 512 saturate either way and stay
uncorrected (no inf - inf); a zero residual keeps q as it is (the sign of a zero). A GPU test checks
every finite bf16 value over scales of every kind against torch's division.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x, scale):
    inv = tl.math.div_rn(1.0, scale)
    q = x * inv
    r = tl.fma(-q, scale, x)
    q = tl.where((r != 0.0) & (tl.abs(q) <= 512.0), tl.fma(r, inv, q), q)
    return tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)

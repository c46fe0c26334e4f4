"""Quantized GEMMs on a GPU: int8 weight-only through a fused dequantising Triton kernel, FP8 through
`torch._scaled_mm`. Both read the quantized bytes (half of bf16) instead of widening the weight.

- `weight_only_linear(x, w_8bit, scale)`: y = (x @ w^T) * scale, int8 or FP8 e4m3 weights widened in
  registers, fp32 accumulation, the activation untouched. Small batches (decode) have few output
  tiles, so the K loop is split over `split` programs whose fp32 partial sums land in a workspace and
  are added in a fixed order by a second kernel that also scales and casts (deterministic, unlike
  atomics); without a split, scale, bias and cast happen in the GEMM's kernel: one launch a linear.
  int8 weight-only runs here at every batch; FP8 can (FP8_WEIGHT_ONLY_MAX_ROWS), but measured slower
  than `_scaled_mm` on the H200, so it is off by default.
- `fp8_linear(x, w_fp8, w_scale, x_scale)`: per-tensor FP8 e4m3 as TensorRT-LLM runs ModelOpt's
  FP8 checkpoints: x quantised with the calibrated input scale, one FP8 tensor-core GEMM with both
  scales, bf16 out. Needs SM >= 8.9. Linears of one input concatenated keep one weight scale a
  channel: cuBLASLt's row-wise GEMM from FP8_ROWWISE_MIN_ROWS rows, below it a per-tensor GEMM into
  float32 whose channel scales, bias and cast `reduce_splits` applies (1.11x the engine's FP8 decode
  at 14B batch 1 on an H100: bench/gpu-fp8-decode-h100.json).

Imported lazily; `available()` says whether each can run on CUDA. The tests run the Triton kernels on
a CPU under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
# FP8 weights run weight-only up to this many rows a GEMM, `_scaled_mm` above. 0: measured on the H200
# (bench/kernels-h200.json), `_scaled_mm` with the activation quantized is faster at 14B shapes at every
# batch (1.45x bf16 over a layer's four linears, weight-only 1.22x: widening e4m3 in registers costs more
# than quantizing the activation); weight-only wins only on 1.5B's small linears, where bf16 wins anyway
FP8_WEIGHT_ONLY_MAX_ROWS = int(os.environ.get("FP8_WEIGHT_ONLY_MAX_ROWS", "0"))
# FP8 GEMMs with per-channel weight scales (q/k/v or gate/up concatenated) run cuBLASLt's row-wise kernel
# from this many rows; below it, a per-tensor GEMM into float32 and the channel scales in one more launch:
# profiled on an H100 at 14B batch 1 (`python -m server.bench.profile`), the row-wise kernel picks a
# 128x128 tile for a single row and took 86 us a layer where the bytes allow 59
FP8_ROWWISE_MIN_ROWS = int(os.environ.get("FP8_ROWWISE_MIN_ROWS", "17"))
# FP8 GEMMs on an e4m3 activation of at most this many rows run the Triton kernel (`weight_only_linear`
# with an e4m3 input: split K loops, channel and activation scales, bias and cast in the kernel) instead
# of `_scaled_mm`. 0: measured on the H200 (bench/gpu-fp8kv-8k-h200.json, 14B decode shapes), _scaled_mm
# is faster at 16 rows (the four linears 79.9 against 88.1 us, 81.1 tuned) and one row (80.6 against 85.8;
# 79.2 with a tile tuned for each shape)
FP8_TRITON_MAX_ROWS = int(os.environ.get("FP8_TRITON_MAX_ROWS", "0"))


# 16-bit GEMMs of at most this many rows (decode at small batch) with at most DENSE_TRITON_MAX_ELEMENTS weights
# run the weight-only kernel (the 16-bit weight as it is, a unit scale) instead of cuBLAS, in the
# DENSE_TRITON_CONFIG tile ("n,k,warps,stages" or row bands, as W8A16_CONFIG). Profiled on an H100 (1.5B,
# batch 1), cuBLAS reads the small q/k/v and o_proj weights (3-6 MB) at 1.1 TB/s where gate/up reach 2.5.
# 0: off. Measured on an H100 (1.5B engine, tile 16,256,4,3, one program a K loop; bench/gpu-dense-sampler-h100.json):
# 0.998x cuBLAS at batch 1, 0.985x at 4, with that tile untuned. Tuned over tiles and K splits with each call reading
# a cold weight (bench/kernels-dense-tune-h100.json): q/k/v and o_proj ~6 us whichever kernel (a fixed latency, not
# bytes), gate/up 1.06x, down 1.04x (split 4): about 2.5% of a 1.5B step, so it stays off
DENSE_TRITON_MAX_ROWS = int(os.environ.get("DENSE_TRITON_MAX_ROWS", "0"))
DENSE_TRITON_MAX_ELEMENTS = int(os.environ.get("DENSE_TRITON_MAX_ELEMENTS", str(8 << 20)))
DENSE_TRITON_CONFIG = "DENSE_TRITON_CONFIG"
# programs sharing each K loop: 1 keeps a small linear to one launch (a split adds the reduction's)
DENSE_TRITON_SPLIT = int(os.environ.get("DENSE_TRITON_SPLIT", "1"))
# The MLP's down projection at most this many rows with the SiLU-and-product made in the GEMM's loads
# (`silu_dense_linear`: bf16/fp16 weights; the activation's kernel and its launch gone), in the
# SILU_DOWN_CONFIG tile with SILU_DOWN_SPLIT programs a K loop; the defaults are the down projection's best
# in bench/kernels-dense-tune-h100.json (1.5B, 64,256,4,3 split 4: 14.2 us against cuBLAS's 14.9). 0: off.
# Measured on an H100 (bench/gpu-silu-down-h100.json): the 1.5B step 1.65x SLOWER with it on (517 -> 313 tok/s at
# batch 1): the activation is made in the MMA operand's layout, every warp making the whole 16-row tile a K step
# for one real row. A GEMV form (the activation made once a K block, a reduction instead of tl.dot) is what is left.
SILU_DOWN_MAX_ROWS = int(os.environ.get("SILU_DOWN_MAX_ROWS", "0"))
# ... and weights of at most this many elements (1.5B's down is 13.8M; 7B's and 14B's, 68-71M, are read at
# ~0.87 of the copy bandwidth by cuBLAS, which this tile was not tuned against)
SILU_DOWN_MAX_ELEMENTS = int(os.environ.get("SILU_DOWN_MAX_ELEMENTS", str(16 << 20)))
SILU_DOWN_CONFIG = "SILU_DOWN_CONFIG"
SILU_DOWN_SPLIT = int(os.environ.get("SILU_DOWN_SPLIT", "4"))


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
def _kernels():
    global to_e4m3  # a module global: Triton's interpreter runs kernels with their module's globals only
    import triton
    import triton.language as tl

    from server.embedded.triton_e4m3 import to_e4m3

    @triton.jit
    def w8_gemm(x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, out_ptr, part_ptr, M, N, stride_xm, stride_wn, K: tl.constexpr,
                STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, PER_CHANNEL: tl.constexpr, X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                SILU_GATED: tl.constexpr = False):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, STEPS):  # a fixed trip count (K is per layer): this split's K blocks
            rk = (i * SPLIT + pid_k) * BLOCK_K + tl.arange(0, BLOCK_K)
            live_x = (rm[:, None] < M) & (rk[None, :] < K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=live_x, other=0.0)
            if SILU_GATED:  # x_ptr holds [gate | up] of 2K features: silu(gate) * up, rounded as fused_ops.silu_mul
                dt = x.dtype
                g = x.to(tl.float32)
                u = tl.load(x_ptr + rm[:, None] * stride_xm + K + rk[None, :], mask=live_x, other=0.0).to(tl.float32)
                x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0.0)
            # FP8 x FP8: full fp32 accumulation (Hopper's FP8 MMA otherwise sums in reduced precision
            # across K; _scaled_mm does not either); ignored for 16-bit operands
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), max_num_imprecise_acc=0)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:  # scale, bias and the cast in the same kernel: one launch a linear
            if PER_CHANNEL:
                acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            else:
                acc = acc * tl.load(s_ptr).to(tl.float32)
            if X_SCALE:  # an FP8 activation's scale
                acc = acc * tl.load(xs_ptr).to(tl.float32)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def reduce_splits(part_ptr, s_ptr, xs_ptr, b_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      PER_CHANNEL: tl.constexpr, X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
        """out = sum of the split partials (in split order: deterministic) * scale + bias, cast."""
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = idx < M * N
        n = idx % N
        acc = tl.zeros((BLOCK,), tl.float32)
        for s in range(0, SPLIT):
            acc += tl.load(part_ptr + s * M * N + idx, mask=live, other=0.0)
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + n, mask=live, other=0.0).to(tl.float32)
        else:
            acc = acc * tl.load(s_ptr).to(tl.float32)
        if X_SCALE:
            acc = acc * tl.load(xs_ptr).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def quantize_e4m3(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """out = e4m3(clamp(x / scale, +-448)): an FP8 GEMM's activation in one launch (eager torch takes
        four: widen, divide, clamp, cast). IEEE division and round-to-nearest-even, as torch rounds."""
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = idx < n
        x = tl.load(x_ptr + idx, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + idx, to_e4m3(x, tl.load(s_ptr).to(tl.float32)), mask=live)

    return w8_gemm, reduce_splits, quantize_e4m3


def _split(m_tiles: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """How many programs share the K loop, so that small batches still fill the GPU (>= 2 waves)."""
    split = 1
    while m_tiles * n_tiles * split < 2 * sms and split * 2 <= max(1, k_blocks // 2):
        split *= 2
    return split


# (BLOCK_N, BLOCK_K, num_warps, num_stages) per GPU and row band ({most rows: configuration}; more rows than
# the last band take the last), the best over the 14B decode shapes of `python -m server.bench.kernels
# --tune` there. Rows pad to a 16-row tile, so the batch-16 tuning holds at batch 1; a verify step (1 + 3
# draft tokens a sequence) or a prefill chunk brings 32-64 rows, where the activation tile re-read for
# every BLOCK_N columns costs more than the weight. H100 (2026-12-06: 14B int8 engine 1917 tok/s at
# batch 16 against 1744 with the H200's choice; the 64-row band: the four 14B linears 184 against 220 us,
# a 1+3 verify at batch 16 1.45x a decode step against 1.74x, bench/kernels-tune-h100.json),
# H200 (2026-12-04). Other GPUs take the H200's;
# W8A16_CONFIG overrides them (tuning on another GPU): "n,k,warps,stages" for every row count, or bands as
# "16=n,k,warps,stages;64=n,k,warps,stages"
CONFIGS: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "H100": {16: (64, 128, 4, 3), 32: (64, 128, 4, 3), 64: (128, 128, 4, 3)},
    "H200": {16: (64, 256, 8, 3)},
}
DEFAULT_CONFIGS = CONFIGS["H200"]
CONFIG_ENV = "W8A16_CONFIG"


def band_config(bands: dict[int, tuple[int, int, int, int]], rows: int) -> tuple[int, int, int, int]:
    """The configuration of the smallest band that holds `rows` (the largest band's past them all)."""
    return next((bands[b] for b in sorted(bands) if rows <= b), bands[max(bands)])


def parse_configs(text: str, env: str = CONFIG_ENV) -> dict[int, tuple[int, int, int, int]]:
    """W8A16_CONFIG's value (or `env`'s): "n,k,warps,stages" (every row count) or "rows=n,k,warps,stages;..."."""
    bands = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        rows, _, config = part.rpartition("=")
        values = tuple(int(v) for v in config.split(",")) if config.replace(",", "").isdigit() else ()
        if len(values) != 4 or (rows and not rows.strip().isdigit()):
            raise ValueError(f"{env}={text!r}: {part!r} is not 'n,k,warps,stages' or 'rows=n,k,warps,stages'")
        bands[int(rows) if rows else 1] = values
    if not bands:
        raise ValueError(f"{env}={text!r} names no configuration")
    return bands


@functools.lru_cache(maxsize=None)
def configs_for(device: int) -> dict[int, tuple[int, ...]]:
    """The weight-only kernel's configurations by row band on CUDA device `device` (W8A16_CONFIG wins)."""
    if os.environ.get(CONFIG_ENV):
        return parse_configs(os.environ[CONFIG_ENV])
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else ""
    return next((c for gpu, c in CONFIGS.items() if gpu in name), DEFAULT_CONFIGS)


def config_for(device: int, rows: int = 1) -> tuple[int, ...]:
    """The weight-only kernel's configuration for `rows` activation rows on CUDA device `device`."""
    return band_config(configs_for(device), rows)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, config: Optional[tuple[int, int, int, int]] = None,
                       split: Optional[int] = None, sms: Optional[int] = None,
                       out_dtype: Optional[torch.dtype] = None, x_scale: Optional[torch.Tensor] = None,
                       silu_gated: bool = False) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ 8-bit weight [N, K] (int8, or FP8 e4m3) * scale (+ bias) -> [..., N] in
    x's dtype. `scale`: per output channel [N], or one value (FP8's per-tensor scale). The weight is
    widened in registers (both 8-bit formats are exact in bf16), fp32 accumulation; the activation
    stays as it is. `split` programs share each K loop (default: enough to fill `sms` multiprocessors
    twice); their partials are added in a fixed order (deterministic, unlike atomics).
    An e4m3 `x` with an e4m3 weight is an FP8 GEMM on the tensor cores (W8A8, `fp8_gemm`'s small-batch
    form), its per-tensor scale `x_scale` applied with `scale`, the result in `out_dtype`.
    `silu_gated`: x is [..., 2K], gate and up side by side, and the product's input is silu(gate) * up, made
    as the kernel loads it (the values of `fused_ops.silu_mul`): the MLP's down projection without the
    activation's own launch."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    if silu_gated:
        if k % 2 or x2.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"weight_only_linear: silu_gated takes a 16-bit [gate | up] input, not {x2.dtype} "
                             f"of {k} features")
        k //= 2
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight_only_linear: weight {tuple(weight.shape)} does not take inputs of {k} features")
    if x2.dtype == torch.float8_e4m3fn and (weight.dtype != torch.float8_e4m3fn or out_dtype is None
                                            or x_scale is None):
        raise ValueError("weight_only_linear: an e4m3 input takes an e4m3 weight, its x_scale and an out_dtype")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k, warps, stages = config or (config_for(x.device.index or 0, m) if x.is_cuda
                                                  else band_config(DEFAULT_CONFIGS, m))
    m_tiles, n_tiles, k_blocks = -(-m // block_m), -(-n // block_n), -(-k // block_k)
    if split is None:
        sms = sms or (_sm_count(x.device.index or 0) if x.is_cuda else 8)
        split = _split(m_tiles, n_tiles, k_blocks, sms)
    per_channel = scale.numel() != 1
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out  # unused pointers without a bias or an activation scale
    xs = x_scale if x_scale is not None else scale
    gemm, reduce, _ = _kernels()
    gemm[(n_tiles, m_tiles, split)](x2, weight, scale, xs, b, out, part, m, n, x2.stride(0), weight.stride(0), K=k,
                                    STEPS=-(-k_blocks // split), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                    SPLIT=split, PER_CHANNEL=per_channel, X_SCALE=x_scale is not None,
                                    HAS_BIAS=bias is not None, SILU_GATED=silu_gated, num_warps=warps,
                                    num_stages=stages)
    if split > 1:
        block = 1024
        reduce[(-(-(m * n) // block),)](part, scale, xs, b, out, m, n, SPLIT=split, BLOCK=block,
                                        PER_CHANNEL=per_channel, X_SCALE=x_scale is not None, HAS_BIAS=bias is not None)
    return out.reshape(*shape, n)


@functools.lru_cache(maxsize=None)
def _unit(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`: the weight-only kernel's scale for a 16-bit weight."""
    return torch.ones((), dtype=torch.float32, device=device)


def _row_count(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


@functools.lru_cache(maxsize=None)
def _env_configs(env: str, default: str) -> dict[int, tuple[int, int, int, int]]:
    """A 16-bit GEMM's Triton tile bands from `env` (parse_configs' form), else `default`'s."""
    return parse_configs(os.environ.get(env, default), env)


def _triton_takes(x: torch.Tensor, weight: torch.Tensor, max_rows: int, max_elements: int) -> bool:
    """Whether a 16-bit GEMM of x on `weight` runs the Triton kernel: on CUDA, at most `max_rows` rows of a
    weight of at most `max_elements`, both of one 16-bit dtype, the weight's rows contiguous."""
    return (x.is_cuda and 0 < _row_count(x) <= max_rows and weight.numel() <= max_elements
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1
            and available()["w8a16"])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 16-bit weight: on CUDA at most DENSE_TRITON_MAX_ROWS rows of a weight
    of at most DENSE_TRITON_MAX_ELEMENTS run the weight-only Triton kernel (fp32 accumulation; DENSE_TRITON_SPLIT
    programs a K loop, 0 for the kernel's own choice), everything else cuBLAS."""
    if _triton_takes(x, weight, DENSE_TRITON_MAX_ROWS, DENSE_TRITON_MAX_ELEMENTS):
        return weight_only_linear(x, weight, _unit(x.device), bias,
                                  config=band_config(_env_configs(DENSE_TRITON_CONFIG, "16,256,4,3"), _row_count(x)),
                                  split=DENSE_TRITON_SPLIT or None)
    return F.linear(x, weight, bias)


def silu_dense_applies(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `silu_dense_linear` runs the fused Triton kernel for this [gate | up] input and 16-bit weight
    (CUDA, at most SILU_DOWN_MAX_ROWS rows and SILU_DOWN_MAX_ELEMENTS weights); where it does not, the
    caller keeps silu_mul + its GEMM."""
    return (gate_up.shape[-1] == 2 * weight.shape[1]
            and _triton_takes(gate_up, weight, SILU_DOWN_MAX_ROWS, SILU_DOWN_MAX_ELEMENTS))


def silu_dense_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """`F.linear(silu(gate) * up, weight, bias)` for gate_up [..., 2K] and a 16-bit weight [N, K]: the
    activation made inside the GEMM's loads (SILU_DOWN_SPLIT programs a K loop and their reduction), one
    launch fewer than `fused_ops.silu_mul` followed by the GEMM. Callers check `silu_dense_applies`."""
    return weight_only_linear(gate_up, weight, _unit(gate_up.device), bias,
                              config=band_config(_env_configs(SILU_DOWN_CONFIG, "64,256,4,3"), _row_count(gate_up)),
                              split=SILU_DOWN_SPLIT or None, silu_gated=True)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 config: Optional[tuple[int, int, int, int]] = None, split: Optional[int] = None) -> torch.Tensor:
    """int8 weight-only with per-channel scales (the name the benchmarks and tests use)."""
    return weight_only_linear(x, weight, scale, bias, config, split)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale, +-448)) in one Triton launch: the same values as the eager
    `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    block = 1024
    _kernels()[2][(-(-x.numel() // block),)](x, scale, out, x.numel(), BLOCK=block)
    return out


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               out_dtype: torch.dtype, unit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8: x / input_scale -> e4m3, one `_scaled_mm` with both scales (fp32 accumulate). `weight_scale`
    is one value (ModelOpt's per-tensor scale) or one per output channel (linears of one input
    concatenated, `Fp8Linear.concatenate`), which runs as `_scaled_mm`'s row-wise scaling."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:  # weight-only FP8 checkpoint: quantise the activation dynamically
        input_scale = (x2.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
    if x2.is_cuda and available()["w8a16"]:
        xq = quantize_e4m3(x2, input_scale)
    else:
        xq = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8_gemm(xq, weight_fp8, weight_scale, input_scale, bias, out_dtype, unit).reshape(
        *shape, weight_fp8.shape[0])


def fp8_gemm(xq: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
             bias: Optional[torch.Tensor], out_dtype: torch.dtype, unit: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """The GEMM of `fp8_linear` on an activation already in e4m3 ([M, K], quantized with `input_scale`,
    e.g. by the fused norm or SiLU kernel that produced it): [M, N] in out_dtype. With per-channel
    weight scales and fewer than FP8_ROWWISE_MIN_ROWS rows, `unit` (a float32 1.0 on the device) makes
    it a per-tensor GEMM into float32 whose channel scales, bias and cast one more launch applies (the
    bias added before the one rounding to out_dtype; the row-wise path rounds, then adds it in
    out_dtype: logits of a q/k/v bias model differ by that rounding between the two row counts). Up to
    FP8_TRITON_MAX_ROWS rows it is the Triton kernel instead, one launch (or two with a split K loop)."""
    if 0 < xq.shape[0] <= FP8_TRITON_MAX_ROWS:
        return weight_only_linear(xq, weight_fp8, weight_scale, bias, out_dtype=out_dtype, x_scale=input_scale)
    if weight_scale.numel() != 1 and unit is not None and xq.shape[0] < FP8_ROWWISE_MIN_ROWS:
        y = torch._scaled_mm(xq, weight_fp8.t(), scale_a=input_scale.reshape(()).float(), scale_b=unit.float(),
                             out_dtype=torch.float32)
        m, n = y.shape
        out = torch.empty((m, n), dtype=out_dtype, device=y.device)
        block = 1024
        _kernels()[1][(-(-(m * n) // block),)](y, weight_scale, weight_scale, out if bias is None else bias, out, m,
                                               n, SPLIT=1, BLOCK=block, PER_CHANNEL=True, X_SCALE=False,
                                               HAS_BIAS=bias is not None)
        return out
    if weight_scale.numel() == 1:
        scale_a, scale_b = input_scale.reshape(()).float(), weight_scale.reshape(()).float()
    else:  # row-wise: one scale a row of x (all the same here), one an output channel
        scale_a = input_scale.reshape(1, 1).float().expand(xq.shape[0], 1).contiguous()
        scale_b = weight_scale.reshape(1, -1).float()
    y = torch._scaled_mm(xq, weight_fp8.t(), scale_a=scale_a, scale_b=scale_b, bias=None, out_dtype=out_dtype)
    return y if bias is None else y + bias.to(out_dtype)

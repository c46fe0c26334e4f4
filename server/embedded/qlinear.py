"""Linear layers that execute ModelOpt's quantized exports with their scales applied.

transformers loads a ModelOpt HF export without applying `weight_scale` (silently wrong weights),
so the embedded runtime replaces each quantized Linear with one of these.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# torch's CPU int8-weight GEMM (`_weight_int8pack_mm`, torch 2.13) reads its operands with aligned
# vector loads: a weight, scale or activation that does not start on a 64-byte boundary crashes the
# process (SIGSEGV). Tensors read from a safetensors file start wherever its header puts them, and an
# activation sliced from a larger one (the last position of a prefill) where the slice begins.
CPU_GEMM_ALIGNMENT = 64


def cpu_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where it is contiguous and starts on a CPU_GEMM_ALIGNMENT boundary, else a copy that
    does (the CPU allocator aligns every allocation to 64 bytes); off the CPU, `t.contiguous()`."""
    if t.device.type != "cpu":
        return t.contiguous()
    if t.is_contiguous() and t.data_ptr() % CPU_GEMM_ALIGNMENT == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if out.data_ptr() % CPU_GEMM_ALIGNMENT:
        raise RuntimeError(f"cpu_aligned: the allocator gave a {CPU_GEMM_ALIGNMENT}-byte misaligned tensor")
    return out.copy_(t)


class Int8WeightOnlyLinear(torch.nn.Module):
    """W8A16: int8 weights with a per-output-channel scale, activations in bf16/fp16.

    Weights stay int8 in memory (half of bf16). On CPU the GEMM is torch's int8-weight kernel
    (`_weight_int8pack_mm`), which dequantizes inside the kernel; on CUDA a Triton kernel that
    dequantizes in registers (`gpu_kernels.w8a16_linear`); elsewhere the int8 weight is widened per
    call, which gives the same numbers.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if weight.dtype != torch.int8 or weight.ndim != 2:
            raise ValueError(f"expected a 2-D int8 weight, got {weight.dtype} {tuple(weight.shape)}")
        scale = scale.reshape(-1)
        if scale.numel() != weight.shape[0]:
            raise ValueError(f"weight_scale has {scale.numel()} values for {weight.shape[0]} output channels")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", cpu_aligned(weight))
        self.register_buffer("scale", cpu_aligned(scale.to(dtype)))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self._fused = hasattr(torch, "_weight_int8pack_mm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.scale.dtype)
        if x2.is_cuda and _gpu("w8a16"):
            from server.embedded.gpu_kernels import w8a16_linear

            return w8a16_linear(x2, self.weight, self.scale, self.bias).reshape(*shape, self.out_features).to(x.dtype)
        if self._fused and x2.device.type == "cpu":  # every operand 64-byte aligned (CPU_GEMM_ALIGNMENT)
            y = torch._weight_int8pack_mm(cpu_aligned(x2), cpu_aligned(self.weight), cpu_aligned(self.scale))
        else:
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape, self.out_features).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]


class Fp8Linear(torch.nn.Module):
    """FP8 (e4m3) weights and activations with per-tensor scales, as TensorRT-LLM runs FP8.

    On a GPU with FP8 tensor cores (SM >= 8.9) the weight is kept as e4m3 (half of bf16) and the GEMM
    is one `torch._scaled_mm` with the activation quantized (`gpu_kernels.fp8_linear`); batches of up
    to FP8_WEIGHT_ONLY_MAX_ROWS rows (default 0: measured slower) run weight-only instead
    (`gpu_kernels.weight_only_linear`, the activation not quantized).
    CPUs have no fast FP8 GEMM, so there
    it is emulated exactly: inputs are quantized to e4m3 with the calibrated `input_scale`, the e4m3
    values of both operands are held in bf16 (which represents every e4m3 value exactly), multiplied
    with fp32 accumulation, and the product of the two scales is applied to the result. Numerics
    match FP8; memory and speed do not (bf16-sized weights).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
            raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
        if weight_scale.numel() != 1 or (input_scale is not None and input_scale.numel() != 1):
            raise ValueError("only per-tensor FP8 scales are supported (ModelOpt FP8_DEFAULT_CFG)")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = dtype
        self.register_buffer("weight_e4m3", weight.to(torch.bfloat16))  # exact
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """Moved to a GPU with FP8 tensor cores: keep the weight as e4m3 (the bf16 copy is dropped)."""
        out = super()._apply(fn, recurse)
        w = self.weight_e4m3
        if w is not None and w.is_cuda and w.dtype == torch.bfloat16 and _gpu("fp8"):
            self.weight_e4m3 = w.to(torch.float8_e4m3fn)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_e4m3.dtype == torch.float8_e4m3fn:
            from server.embedded.gpu_kernels import FP8_WEIGHT_ONLY_MAX_ROWS, fp8_linear, weight_only_linear

            if x.numel() // self.in_features <= FP8_WEIGHT_ONLY_MAX_ROWS:  # decode: the activation stays bf16
                return weight_only_linear(x.to(self.dtype), self.weight_e4m3, self.weight_scale, self.bias)
            return fp8_linear(x, self.weight_e4m3, self.weight_scale, self.input_scale, self.bias, self.dtype,
                              getattr(self, "unit_scale", None))
        scale = self.weight_scale
        if self.input_scale is not None:
            xq = (x.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            x = xq.to(torch.bfloat16)
            scale = scale * self.input_scale
        y = F.linear(x.to(torch.bfloat16), self.weight_e4m3).float() * scale
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(self.dtype)

    def e4m3_input_scale(self) -> Optional[torch.Tensor]:
        """The scale this layer quantizes its input with where it runs one FP8 GEMM on it (a GPU with
        FP8 tensor cores, a calibrated input scale): the kernel producing the input may then quantize
        it (fused_ops) and call `forward_e4m3`, at batches above the weight-only rows (`quantized_input`).
        None where the input must stay in the model's dtype."""
        return self.input_scale if self.weight_e4m3.dtype == torch.float8_e4m3fn else None

    def forward_e4m3(self, xq: torch.Tensor) -> torch.Tensor:
        """forward() of an input already quantized with `e4m3_input_scale()`: [M, in] e4m3 -> [M, out]."""
        from server.embedded.gpu_kernels import fp8_gemm

        return fp8_gemm(xq, self.weight_e4m3, self.weight_scale, self.input_scale, self.bias, self.dtype,
                        getattr(self, "unit_scale", None))

    def dequantized(self) -> torch.Tensor:
        scale = self.weight_scale
        return self.weight_e4m3.float() * (scale if scale.numel() == 1 else scale[:, None])

    @classmethod
    def concatenate(cls, mods: list["Fp8Linear"]) -> Optional["Fp8Linear"]:
        """Linears of one input (q/k/v, gate/up) as one: their e4m3 weights stacked, each output channel
        keeping its own module's weight scale (one value where they all agree, else one a channel), so
        one activation quantization and one GEMM serve them all. None where they do not share the
        input scale or their bias kind (quantizing the activation once would then change numbers), or
        where per-channel scales cannot run (`_rowwise_fp8`)."""
        first = mods[0]
        if first.input_scale is None:
            same_input = all(m.input_scale is None for m in mods)
        else:
            same_input = all(m.input_scale is not None and torch.equal(m.input_scale, first.input_scale) for m in mods)
        scales = [m.weight_scale for m in mods]
        same_scale = all(torch.equal(s, scales[0]) for s in scales)
        if (not same_input or any((m.bias is None) != (first.bias is None) for m in mods)
                or not (same_scale or _rowwise_fp8(first))):
            return None
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.dtype = first.in_features, first.dtype
        fused.out_features = sum(m.out_features for m in mods)
        fused.register_buffer("weight_e4m3", torch.cat([m.weight_e4m3 for m in mods], 0))
        if same_scale:
            fused.register_buffer("weight_scale", scales[0].clone())
        else:
            fused.register_buffer("weight_scale", torch.cat([s.reshape(1).expand(m.out_features)
                                                             for s, m in zip(scales, mods)]))
            # 1.0 for the per-tensor GEMM that decode rows run instead of the row-wise one (gpu_kernels.fp8_gemm)
            fused.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, device=first.weight_scale.device))
        fused.register_buffer("input_scale", first.input_scale)
        fused.register_buffer("bias", None if first.bias is None else torch.cat([m.bias for m in mods], 0))
        return fused


def _rowwise_fp8(layer: "Fp8Linear") -> bool:
    """Whether per-channel weight scales can run: torch's row-wise `_scaled_mm` wants bf16 out and an SM 9.0
    GPU; the CPU's emulation takes any."""
    w = layer.weight_e4m3
    if not w.is_cuda:
        return True
    return layer.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w.device) >= (9, 0)


def quantized_input(scale: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """An FP8 GEMM's `e4m3_input_scale` where its input of `rows` rows is to be quantized, None where
    the layer runs weight-only at that many rows (its input stays in the model's dtype)."""
    from server.embedded.gpu_kernels import FP8_WEIGHT_ONLY_MAX_ROWS

    return scale if scale is not None and rows > FP8_WEIGHT_ONLY_MAX_ROWS else None


def project(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """linear(x), or an FP8 layer's GEMM alone where the kernel that made x already quantized it
    (`Fp8Linear.e4m3_input_scale`; the graph runner's fused kernels)."""
    return linear.forward_e4m3(x) if x.dtype == torch.float8_e4m3fn else linear(x)


def _gpu(kernel: str) -> bool:
    from server.embedded.gpu_kernels import available

    return available()[kernel]

"""Load an HF checkpoint folder for the embedded runtime: bf16, or a ModelOpt FP8 / W8A16 export.

For quantized exports the model skeleton comes from config.json (without its quantization block),
the unquantized tensors load as usual, and every quantized Linear is replaced by a layer that
applies the exported scales (server/embedded/qlinear.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from server.embedded.qlinear import Fp8Linear, Int8WeightOnlyLinear

QUANT_CONFIG = "hf_quant_config.json"


def quant_algo(model_dir: Path) -> str | None:
    """'FP8', 'W8A16', ... as written by ModelOpt, or None for an unquantized checkpoint."""
    p = Path(model_dir) / QUANT_CONFIG
    if not p.is_file():
        return None
    try:
        algo = json.loads(p.read_text(encoding="utf-8"))["quantization"]["quant_algo"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, not UTF-8, or not ModelOpt's shape
        raise ValueError(f"{p}: not a ModelOpt quantization config (quantization.quant_algo: "
                         f"{type(e).__name__}: {str(e)[:200]})") from None
    if not (isinstance(algo, str) or algo is None):
        raise ValueError(f"{p}: quantization.quant_algo must be a string (got {algo!r:.200})")
    return algo


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Any:
    """A ready-to-run causal LM (eval mode) with quantization scales applied, on `device`. Unquantized
    checkpoints load straight onto a GPU (no host copy of the weights: a 14B's would be 30 GB of RAM)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    device = torch.device(device)
    algo = quant_algo(model_dir)
    if algo is None:
        on_gpu = {"device_map": str(device)} if device.type != "cpu" else {}
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **on_gpu)
        return model.eval()
    if algo not in ("FP8", "W8A16"):
        raise ValueError(f"{model_dir / QUANT_CONFIG}: quant_algo {algo!r} is not supported by the embedded runtime")

    config = AutoConfig.from_pretrained(str(model_dir))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _read_tensors(model_dir)
    plain: dict[str, torch.Tensor] = {}
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        w = tensors.get(f"{name}.weight")
        if w is None or w.dtype not in (torch.int8, torch.float8_e4m3fn):
            continue
        bias = tensors.pop(f"{name}.bias", None)
        scale = tensors.pop(f"{name}.weight_scale", None)
        if scale is None:
            raise ValueError(f"{model_dir}: {name}.weight is {w.dtype} but {name}.weight_scale is missing")
        if w.dtype == torch.int8:
            q: torch.nn.Module = Int8WeightOnlyLinear(w, scale, bias, dtype)
        else:
            q = Fp8Linear(w, scale, tensors.pop(f"{name}.input_scale", None), bias, dtype)
        del tensors[f"{name}.weight"]
        _set_module(model, name, q)
        replaced += 1
    if replaced == 0:
        raise ValueError(f"{model_dir}: {QUANT_CONFIG} says {algo} but no quantized weights were found")
    for k, v in tensors.items():
        if k.endswith(("_scale", "_amax")):
            continue  # e.g. KV-cache scales: the embedded runtime keeps its KV cache in bf16
        plain[k] = v.to(dtype) if v.is_floating_point() else v
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{model_dir}: tensors the model does not have: {unexpected[:5]}")
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight" and m not in tied]
    # Buffers computed at init (e.g. rotary inv_freq) are not in checkpoints; rebuild them for real.
    _materialize_buffers(model, config, dtype)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if missing and still_meta:
        raise ValueError(f"{model_dir}: tensors missing from the checkpoint: {still_meta[:5]}")
    return model.to(device).eval()  # assembled on the host: the 8-bit weights are half a bf16 copy


def _materialize_buffers(model: torch.nn.Module, config: Any, dtype: torch.dtype) -> None:
    """Re-create non-persistent buffers left on the meta device (rotary embeddings)."""
    for name, module in model.named_modules():
        metas = [b for b, t in module.named_buffers(recurse=False) if t is not None and t.is_meta]
        if not metas:
            continue
        fresh = type(module)(config=config) if "rotary" in type(module).__name__.lower() else None
        if fresh is None:
            raise ValueError(f"cannot materialize buffers {metas} of {name} ({type(module).__name__})")
        for b in metas:
            setattr(module, b, getattr(fresh, b))


def gate_dtype(device: Optional[torch.device] = None) -> torch.dtype:
    """The dtype the build's measurement passes (quality gates) compute in on `device` (default: the
    stages' device, `stage_device()`): bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX);
    float32 on other CPUs, where PyTorch emulates bf16 matmuls and they run several times slower
    (2-core AVX2 CI machine: ~3x at 8 rows). Upcasting bf16 weights is exact, so this changes the
    compute precision of the measurement, never the weights measured."""
    if (device if device is not None else stage_device()).type == "cuda":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if native else torch.float32


STAGE_DEVICE_ENV = "TRTBUILD_DEVICE"


def stage_device() -> torch.device:
    """Where the build's model-running stages (calibration, quality gates, the drafter's hidden states)
    run: the first GPU when there is one (a 14B's gates take hours on host cores), else the CPU;
    TRTBUILD_DEVICE=cpu|cuda[:N] chooses (a GPU too small for two copies of the model, say)."""
    from server.embedded.settings import resolve_device

    choice = os.environ.get(STAGE_DEVICE_ENV, "auto").strip() or "auto"
    try:
        return resolve_device(choice)
    except ValueError as e:
        raise ValueError(f"{STAGE_DEVICE_ENV}={choice!r}: {e}") from None


def use_all_cores() -> None:
    """Torch intra-op threads on every core (stages that run the model on the CPU)."""
    import os

    torch.set_num_threads(max(1, os.cpu_count() or 1))

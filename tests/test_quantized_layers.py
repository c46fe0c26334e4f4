"""The embedded runtime's quantized layers apply ModelOpt's scales (transformers alone would not)."""

from __future__ import annotations

import json

import pytest
import torch

from server.embedded.qlinear import FP8_MAX, Fp8Linear, Int8WeightOnlyLinear


def test_int8_weight_only_matches_dequantized_matmul():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    layer = Int8WeightOnlyLinear(q, scale, None, torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ref = x.float() @ (q.float() * scale.bfloat16().float()[:, None]).T
    y = layer(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert layer.weight.dtype == torch.int8  # really stored as int8


def test_fp8_emulation_is_exact_fp8_gemm():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    ws = w.abs().max() / FP8_MAX
    wq = (w / ws).to(torch.float8_e4m3fn)
    xs = torch.tensor(3.0 / FP8_MAX)
    layer = Fp8Linear(wq, ws, xs, None, torch.bfloat16)
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    ref = (xq @ wq.float().T) * (xs * ws)
    assert (layer(x).float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    # and it really quantizes the activations: a fine-grained input differs from the bf16 product
    assert (layer(x).float() - x.float() @ (wq.float() * ws).T).abs().max() > 0


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="int8"):
        Int8WeightOnlyLinear(torch.zeros(4, 4), torch.ones(4), None, torch.bfloat16)
    with pytest.raises(ValueError, match="output channels"):
        Int8WeightOnlyLinear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3), None, torch.bfloat16)


def test_loader_refuses_a_quantized_weight_without_scale(tmp_path, tiny_models):
    from safetensors.torch import load_file, save_file

    from server.embedded.loader import load_model

    src = tiny_models["llama-cot"]
    t = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    t[name] = torch.zeros_like(t[name], dtype=torch.int8)
    save_file(t, str(tmp_path / "model.safetensors"))
    for f in ("config.json",):
        (tmp_path / f).write_text((src / f).read_text())
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W8A16"}}))
    with pytest.raises(ValueError, match="weight_scale is missing"):
        load_model(tmp_path)

"""The 8-bit weight-only GEMM (server/embedded/gpu_kernels.py) against the dequantized product: int8
with per-channel scales and FP8 e4m3 with one scale, with and without bias, one program per K loop and
split K loops (reduced by the second kernel). On CUDA in bf16; on a CPU under Triton's interpreter
(conftest.py), in fp16. Skipped without either."""

from __future__ import annotations

import importlib.util

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (CUDA or importlib.util.find_spec("triton")),
                                reason="needs CUDA or Triton's interpreter")
DEVICE, DTYPE = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float16)


def _weights(fmt: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(8-bit weight, its scale, the dequantized weight in float32)."""
    if fmt == "int8":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s = torch.rand(n, generator=g) * 0.01 + 1e-3
        return w, s.to(DTYPE), w.float() * s.to(DTYPE).float()[:, None]
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.tensor(0.004)
    return w, s, w.float() * s


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k,split,bias", [(1, 96, 128, 1, False), (3, 100, 72, 1, True), (5, 64, 512, 4, True),
                                               (17, 40, 300, 2, False)])
def test_weight_only_linear_matches_the_dequantized_product(fmt, m, n, k, split, bias):
    from server.embedded.gpu_kernels import weight_only_linear

    g = torch.Generator().manual_seed(m * 7 + n + k)
    w, s, wf = _weights(fmt, n, k, g)
    x = torch.randn(m, k, generator=g).to(DTYPE)
    b = (torch.randn(n, generator=g) * 0.1).to(DTYPE) if bias else None
    ref = x.float() @ wf.t() + (b.float() if bias else 0)
    got = weight_only_linear(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), None if b is None else b.to(DEVICE),
                             config=(32, 64, 4, 2), split=split)
    assert got.dtype == DTYPE and got.shape == (m, n)
    rel = float((got.float().cpu() - ref).abs().max() / ref.abs().max())
    assert rel < 1e-2, rel


@pytest.mark.parametrize("per_channel,split,bias", [(True, 1, False), (False, 1, True), (True, 4, True),
                                                    (False, 2, False)])
def test_the_triton_kernel_runs_fp8_gemms_on_an_e4m3_activation(per_channel, split, bias):
    """e4m3 activation x e4m3 weight (W8A8, `fp8_gemm`'s small-batch form): the product of the e4m3
    values times both scales (+ bias), in the asked dtype, one program per K loop and split."""
    from server.embedded.gpu_kernels import weight_only_linear

    g = torch.Generator().manual_seed(split * 10 + per_channel)
    m, n, k = 5, 72, 256
    x = (torch.randn(m, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(n if per_channel else 1, generator=g) * 1e-3 + 1e-4
    xs = torch.tensor(0.01)
    b = (torch.randn(n, generator=g) * 0.1).to(DTYPE) if bias else None
    ref = (x.float() @ w.float().t()) * ws.view(1, -1) * xs + (b.float() if bias else 0)
    got = weight_only_linear(x.to(DEVICE), w.to(DEVICE), ws.reshape(-1 if per_channel else ()).to(DEVICE),
                             None if b is None else b.to(DEVICE), config=(32, 64, 4, 2), split=split,
                             out_dtype=DTYPE, x_scale=xs.to(DEVICE))
    assert got.dtype == DTYPE and got.shape == (m, n)
    rel = float((got.float().cpu() - ref).abs().max() / ref.abs().max())
    assert rel < 1e-2, rel
    with pytest.raises(ValueError, match="e4m3 input"):
        weight_only_linear(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE))


@pytest.mark.skipif(not CUDA, reason="_scaled_mm runs on a GPU only")
def test_fp8_gemm_gives_scaled_mms_result_through_the_triton_kernel(monkeypatch):
    from server.embedded import gpu_kernels as gk

    if not gk.available()["fp8"]:
        pytest.skip("no FP8 tensor cores")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 512, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    x = (torch.randn(7, 512, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    xs, unit = torch.tensor(0.01, device="cuda"), torch.ones((), device="cuda")
    bias = torch.randn(96, generator=g).to(torch.bfloat16).cuda()
    for ws in (torch.tensor(2e-3, device="cuda"), (torch.rand(96, generator=g) * 1e-3 + 1e-4).cuda()):
        for b in (None, bias):
            monkeypatch.setattr(gk, "FP8_TRITON_MAX_ROWS", 0)
            want = gk.fp8_gemm(x, w, ws, xs, b, torch.bfloat16, unit)
            monkeypatch.setattr(gk, "FP8_TRITON_MAX_ROWS", 16)
            got = gk.fp8_gemm(x, w, ws, xs, b, torch.bfloat16, unit)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_weight_of_the_wrong_width_is_named():
    from server.embedded.gpu_kernels import weight_only_linear

    with pytest.raises(ValueError, match="inputs of 16 features"):
        weight_only_linear(torch.zeros(2, 16, dtype=DTYPE), torch.zeros(8, 32, dtype=torch.int8),
                           torch.ones(8, dtype=DTYPE))


def test_the_fp8_activation_quantization_kernel_rounds_as_torch_does():
    from server.embedded.gpu_kernels import quantize_e4m3

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 700, generator=g) * 3).to(DTYPE)
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # saturates at +-448 (no NaN), keeps signed zeros
    scale = torch.tensor(0.02)
    want = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = quantize_e4m3(x.to(DEVICE), scale.to(DEVICE)).cpu()
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if CUDA:
        assert not differ.any()
    else:  # Triton's interpreter rounds float32 -> e4m3 wrongly in two cases (see test_decode_attention.py):
        # where rounding carries into the exponent it gives half the power of two, and it rounds ties away
        # from zero (torch and the GPU: to even); every other element is exact
        w, v, exact = want.float()[differ], got.float()[differ], (x.float() / scale)[differ]
        carry = (v == w / 2) & (w.abs().log2() == w.abs().log2().round())
        tie = (exact - v).abs() == (exact - w).abs()
        assert (carry | tie).all()
    assert got[0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.skipif(not CUDA, reason="the fma the rounding rests on is fused on a GPU only (not in the interpreter)")
def test_the_fp8_activation_quantization_divides_exactly_for_every_bf16_value():
    """Every finite bf16 value over scales of every kind (all-ones significands, powers of two, tiny,
    huge, random): the reciprocal-and-correction quotient rounds to the same e4m3 bytes as torch's
    division, signed zeros and saturation included."""
    from server.embedded.gpu_kernels import quantize_e4m3

    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)].to(DEVICE)
    g = torch.Generator().manual_seed(11)
    scales = [1.0, 0.5, 2.0 ** -20, 1e-12, 3.0e4, float(torch.tensor(2.0).nextafter(torch.tensor(0.0))),
              float(torch.tensor(1.0).nextafter(torch.tensor(0.0))), 1 / 448, 0.0123, 7.77]
    scales += (torch.rand(40, generator=g) * 10 ** torch.randint(-6, 3, (40,), generator=g).float()).tolist()
    for s in scales:
        scale = torch.tensor(s, dtype=torch.float32, device=DEVICE)
        want = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        got = quantize_e4m3(x, scale)
        bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert bad.numel() == 0, (s, x[bad[:5, 0]].tolist())


def test_the_weight_only_kernel_takes_the_configuration_tuned_on_its_gpu(monkeypatch):
    from server.embedded import gpu_kernels as gk

    monkeypatch.delenv(gk.CONFIG_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in [("NVIDIA H100 80GB HBM3", gk.CONFIGS["H100"]), ("NVIDIA H200", gk.CONFIGS["H200"]),
                       ("NVIDIA A100-SXM4-80GB", gk.DEFAULT_CONFIGS)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        gk.configs_for.cache_clear()
        for rows in (1, 16, 17, 64, 4096):
            assert gk.config_for(0, rows) == gk.band_config(want, rows)
    monkeypatch.setenv(gk.CONFIG_ENV, "32,128,4,2")
    gk.configs_for.cache_clear()
    assert gk.config_for(0) == gk.config_for(0, 64) == (32, 128, 4, 2)
    gk.configs_for.cache_clear()


def test_a_row_band_takes_the_smallest_band_that_holds_it():
    from server.embedded.gpu_kernels import band_config

    bands = {16: "small", 64: "verify"}
    assert [band_config(bands, r) for r in (1, 16, 17, 64, 65)] == ["small", "small", "verify", "verify", "verify"]


def test_the_configuration_override_takes_one_configuration_or_bands_and_names_a_bad_part():
    from server.embedded.gpu_kernels import parse_configs

    assert parse_configs("32,128,4,2") == {1: (32, 128, 4, 2)}
    assert parse_configs("16=64,128,4,3; 64=128,128,8,4;") == {16: (64, 128, 4, 3), 64: (128, 128, 8, 4)}
    for bad in ("", "64,128,4", "x=64,128,4,3", "16=64,128,four,3"):
        with pytest.raises(ValueError, match="W8A16_CONFIG"):
            parse_configs(bad)


@pytest.mark.parametrize("m,split,bias", [(1, 1, True), (3, 2, False), (16, 4, True)])
def test_a_16_bit_weight_with_a_unit_scale_is_the_plain_linear(m, split, bias):
    """`dense_linear`'s Triton form: the model-dtype weight as it is, scale 1.0, against F.linear."""
    from server.embedded.gpu_kernels import _unit, weight_only_linear

    g = torch.Generator().manual_seed(m + split)
    n, k = 80, 512
    x = torch.randn(m, k, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DTYPE).to(DEVICE)
    b = (torch.randn(n, generator=g) * 0.1).to(DTYPE).to(DEVICE) if bias else None
    got = weight_only_linear(x, w, _unit(x.device), b, config=(16, 64, 4, 2), split=split)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert got.dtype == DTYPE and got.shape == (m, n)
    rel = float((got.float() - ref).abs().max() / ref.abs().max())
    assert rel < 1e-2, rel


def test_dense_linear_is_f_linear_off_cuda_and_past_its_bounds(monkeypatch):
    """The dispatch: off CUDA (and past DENSE_TRITON_MAX_ROWS rows or its weight size) it is F.linear, bit
    for bit; the Triton form runs only on CUDA."""
    import torch.nn.functional as F

    from server.embedded import gpu_kernels

    monkeypatch.setattr(gpu_kernels, "DENSE_TRITON_MAX_ROWS", 4)
    x, w, b = torch.randn(2, 32), torch.randn(24, 32), torch.randn(24)
    assert torch.equal(gpu_kernels.dense_linear(x, w, b), F.linear(x, w, b))
    if CUDA:
        xc, wc = x.to("cuda", torch.bfloat16), w.to("cuda", torch.bfloat16)
        monkeypatch.setattr(gpu_kernels, "DENSE_TRITON_MAX_ELEMENTS", wc.numel() - 1)
        assert torch.equal(gpu_kernels.dense_linear(xc, wc), F.linear(xc, wc))
        monkeypatch.setattr(gpu_kernels, "DENSE_TRITON_MAX_ELEMENTS", wc.numel())
        got = gpu_kernels.dense_linear(xc, wc)
        assert float((got.float() - F.linear(xc, wc).float()).abs().max()) < 0.05


@pytest.mark.parametrize("m,split,bias", [(1, 1, False), (3, 4, True), (16, 2, False)])
def test_the_silu_gated_gemm_is_silu_mul_then_the_gemm_bit_for_bit(m, split, bias):
    """`silu_gated` makes silu(gate) * up as the kernel loads it: the values `fused_ops.silu_mul` writes,
    so with the same tile and split the result is the two-launch form's exactly (and F.linear's within
    the accumulation's rounding). K 300 leaves a partial last block in both halves."""
    from server.embedded.fused_ops import reference_silu_mul, silu_mul
    from server.embedded.gpu_kernels import _unit, weight_only_linear

    g = torch.Generator().manual_seed(7 * m + split)
    n, k = 72, 300
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(DTYPE).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DTYPE).to(DEVICE)
    b = (torch.randn(n, generator=g) * 0.1).to(DTYPE).to(DEVICE) if bias else None
    config = (16, 64, 4, 2)
    got = weight_only_linear(gate_up, w, _unit(gate_up.device), b, config=config, split=split, silu_gated=True)
    two_launches = weight_only_linear(silu_mul(gate_up), w, _unit(gate_up.device), b, config=config, split=split)
    assert got.shape == (m, n) and torch.equal(got, two_launches)
    ref = torch.nn.functional.linear(reference_silu_mul(gate_up.float()), w.float(), None if b is None else b.float())
    assert float((got.float() - ref).abs().max() / ref.abs().max()) < 1e-2


def test_the_silu_gated_gemm_refuses_what_it_cannot_split():
    from server.embedded.gpu_kernels import _unit, silu_dense_applies, weight_only_linear

    w = torch.zeros(8, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="silu_gated"):
        weight_only_linear(torch.zeros(2, 33, dtype=DTYPE, device=DEVICE), w, _unit(w.device), silu_gated=True)
    # off CUDA (or past SILU_DOWN_MAX_ROWS, 0 by default) the graph runner keeps silu_mul + its GEMM
    assert not silu_dense_applies(torch.zeros(1, 32, dtype=DTYPE), w.cpu())

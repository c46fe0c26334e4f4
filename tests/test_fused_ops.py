"""The fused elementwise kernels (server/embedded/fused_ops.py) against the eager ops they replace,
and the GraphRunner's decode and verify steps with them against the same steps without.

On CUDA the kernels run compiled; on a CPU with Triton installed they run under Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1), in float16 and float32: the interpreter has no bfloat16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.embedded.decode_attention import dequantize_kv
from server.embedded.fused_ops import reference_add_rms_norm, reference_rope, reference_silu_mul

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float16, torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
def test_add_rms_norm_matches_the_eager_norm(dtype, hidden):
    from server.embedded.fused_ops import add_rms_norm

    g = torch.Generator().manual_seed(hidden)
    res, delta = (torch.randn(5, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    for d in (delta, None):
        want_sum, want = reference_add_rms_norm(res, d, w, 1e-6)
        got_sum, got = add_rms_norm(res, d, w, 1e-6)
        assert torch.equal(got_sum, want_sum)  # the add rounds as `residual + delta` does
        assert got.dtype == dtype and got.shape == want.shape
        # the norm's sum runs in another order: at most a rounding step of the model's dtype apart
        torch.testing.assert_close(got, want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
    assert torch.equal(res, res.clone())  # inputs untouched


def _qkv_case(dtype, n=6, nq=4, nkv=2, d=16, slots=3, positions=40, fp8=False):
    g = torch.Generator().manual_seed(n * 10 + nq + int(fp8))
    qkv = torch.randn(n, (nq + 2 * nkv) * d, generator=g).to(DEVICE, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    rows = torch.tensor([0, 0, 2, 2, 1, 1][:n], device=DEVICE)
    pos = torch.tensor([3, 4, 0, 1, 39, 17][:n], device=DEVICE)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_cache = torch.zeros(slots, nkv, positions, d, device=DEVICE).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.zeros(slots, nkv, positions, device=DEVICE), torch.zeros(slots, nkv, positions, device=DEVICE))
    return qkv, cos, sin, k_cache, v_cache, rows, pos, nq, nkv, d, (scales if fp8 else (None, None))


def same_as_eager(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit under the interpreter; compiled for CUDA, within one rounding of the dtype (the inputs
    are of order 1, so a sum that cancels may differ by a rounding of its terms)."""
    if not CUDA:
        assert torch.equal(got, want)
        return
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_rotates_q_and_writes_rotated_k_and_v_to_their_slots(dtype):
    from server.embedded.fused_ops import rope_write_kv

    qkv, cos, sin, kc, vc, rows, pos, nq, nkv, d, (ks, vs) = _qkv_case(dtype)
    q = rope_write_kv(qkv, cos, sin, kc, vc, rows, pos, nq, nkv)
    q_ref, k_ref, v_ref = qkv.split([nq * d, nkv * d, nkv * d], -1)
    want_q = reference_rope(q_ref.view(-1, nq, d), cos[pos], sin[pos])
    want_k = reference_rope(k_ref.reshape(-1, nkv, d), cos[pos], sin[pos])
    # every product and sum rounds where the eager ops round: exactly so under the interpreter; compiled for
    # a GPU, a product may be contracted into the sum (one rounding fewer; H100: 1 ulp on some elements)
    same_as_eager(q, want_q)
    same_as_eager(kc[rows, :, pos], want_k)
    assert torch.equal(vc[rows, :, pos], v_ref.reshape(-1, nkv, d))
    written = torch.zeros(kc.shape[:3], dtype=torch.bool, device=DEVICE)
    written[rows, :, pos] = True
    assert kc[~written].eq(0).all() and vc[~written].eq(0).all()  # nothing else touched


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_adds_the_bias_the_gemm_left_out(dtype):
    """The q/k/v projection's bias added in the kernel: the same as rotating and writing `qkv + bias`."""
    from server.embedded.fused_ops import rope_write_kv

    qkv, cos, sin, kc, vc, rows, pos, nq, nkv, d, _ = _qkv_case(dtype)
    bias = torch.randn(qkv.shape[1], generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q = rope_write_kv(qkv, cos, sin, kc, vc, rows, pos, nq, nkv, bias=bias)
    want_q = rope_write_kv(qkv + bias, cos, sin, kc2, vc2, rows, pos, nq, nkv)
    assert torch.equal(q, want_q) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="bias"):
        rope_write_kv(qkv, cos, sin, kc, vc, rows, pos, nq, nkv, bias=bias[:-1])


@needs_triton
def test_rope_write_kv_quantizes_for_an_fp8_cache():
    from server.embedded.fused_ops import rope_write_kv

    dtype = DTYPES[0]
    qkv, cos, sin, kc, vc, rows, pos, nq, nkv, d, (ks, vs) = _qkv_case(dtype, fp8=True)
    rope_write_kv(qkv, cos, sin, kc, vc, rows, pos, nq, nkv, ks, vs)
    _, k_ref, v_ref = qkv.split([nq * d, nkv * d, nkv * d], -1)
    want_k = reference_rope(k_ref.reshape(-1, nkv, d), cos[pos], sin[pos]).float()
    for cache, scale, want in ((kc, ks, want_k), (vc, vs, v_ref.reshape(-1, nkv, d).float())):
        amax = want.abs().amax(-1)
        # compiled for CUDA the rotated k may differ from eager by one rounding (see same_as_eager), so its amax too
        eps = torch.finfo(dtype).eps if CUDA else 1.3e-6
        torch.testing.assert_close(scale[rows, :, pos], amax / 448.0, rtol=eps, atol=1e-5)
        back = dequantize_kv(cache[rows, :, pos], scale[rows, :, pos], torch.float32)
        off = (back - want).abs() / amax.unsqueeze(-1) > 0.07  # beyond e4m3's precision relative to the amax
        # Triton's interpreter rounds float32 -> e4m3 wrongly where rounding carries into the exponent
        # (test_decode_attention.py): a few elements there, none on a GPU
        assert off.float().mean() <= (0 if CUDA else 0.02)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_eager_activation(dtype):
    from server.embedded.fused_ops import silu_mul

    gu = (3 * torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(0))).to(DEVICE, dtype)
    got, want = silu_mul(gu), reference_silu_mul(gu)
    assert got.shape == (3, 1500) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-4)


@needs_triton
def test_bad_shapes_are_refused_with_what_is_wrong():
    from server.embedded.fused_ops import add_rms_norm, rope_write_kv

    qkv, cos, sin, kc, vc, rows, pos, nq, nkv, d, _ = _qkv_case(DTYPES[0])
    with pytest.raises(ValueError, match="rope_write_kv: qkv"):
        rope_write_kv(qkv[:, :-d], cos, sin, kc, vc, rows, pos, nq, nkv)
    with pytest.raises(ValueError, match="add_rms_norm residual"):
        add_rms_norm(qkv.t(), None, qkv[0], 1e-6)


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_graph_runner_steps_with_fused_ops_match_the_eager_steps(tiny_models, kv_cache_dtype):
    """Decode and verify steps with the fused kernels against the same runner's eager ops (float32 tiny
    Llama and Qwen2 models): the same greedy tokens, logits equal up to the norm's summation order."""
    if kv_cache_dtype == "fp8" and not CUDA:  # the kernel's FP8 write is checked alone above
        pytest.skip("Triton's interpreter rounds float32 -> e4m3 wrongly where rounding carries into the exponent")
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    for name in ("llama-tir", "qwen-tir"):
        model = load_model(tiny_models[name]).float().to(DEVICE)
        eager = GraphRunner(model, 4, 128, fused_ops=False, kv_cache_dtype=kv_cache_dtype)
        fused = GraphRunner(model, 4, 128, fused_ops=True, kv_cache_dtype=kv_cache_dtype)
        assert fused.fused_ops and not eager.fused_ops
        prompts = [[1, 5, 9, 22, 40], [3, 4], [7, 8, 9, 10, 11, 12, 13]]
        for r in (eager, fused):
            for slot, p in enumerate(prompts):
                r.prefill(slot, p, 0)
        tol = 1e-4
        toks, pos = [5, 6, 7], [5, 2, 7]
        for _ in range(6):
            la, lb = eager.decode(toks, pos), fused.decode(toks, pos)
            torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
            assert torch.equal(la.argmax(-1), lb.argmax(-1)), name
            toks, pos = la.argmax(-1).tolist(), [p + 1 for p in pos]
        (va, ha), (vb, hb) = (r.verify([[1, 2, 3]] * 3, pos, hidden=True) for r in (eager, fused))
        torch.testing.assert_close(vb, va, rtol=tol, atol=tol)
        torch.testing.assert_close(hb, ha, rtol=tol, atol=tol)  # the normed hidden the drafter reads
        for i in range(len(eager.k)):  # the caches hold the same keys and values
            for a, b in ((eager.k[i], fused.k[i]), (eager.v[i], fused.v[i])):
                same = torch.isclose(b.float(), a.float(), rtol=1e-3, atol=1e-3).float().mean()
                assert same == 1.0


@needs_triton
def test_norm_and_silu_kernels_quantize_for_the_next_fp8_gemm_as_the_quantize_kernel_does():
    """With `quant_scale`, add_rms_norm and silu_mul write the e4m3 bytes that quantize_e4m3 makes of
    their model-dtype output (one launch fewer a GEMM), both run on the same Triton (compiled or not)."""
    from server.embedded.fused_ops import add_rms_norm, silu_mul
    from server.embedded.gpu_kernels import quantize_e4m3

    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(5)
    res, delta = (torch.randn(3, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(dtype).to(DEVICE)
    gu = (torch.randn(3, 2 * 80, generator=g) * 4).to(dtype).to(DEVICE)
    scale = torch.tensor(0.01, device=DEVICE)
    for d in (None, delta):
        summed, normed = add_rms_norm(res, d, w, 1e-6)
        summed_q, normed_q = add_rms_norm(res, d, w, 1e-6, quant_scale=scale)
        assert normed_q.dtype == torch.float8_e4m3fn and torch.equal(summed_q, summed)
        assert torch.equal(normed_q.view(torch.uint8), quantize_e4m3(normed, scale).view(torch.uint8))
    act_q = silu_mul(gu, quant_scale=scale)
    assert act_q.dtype == torch.float8_e4m3fn and act_q.shape == (3, 80)
    assert torch.equal(act_q.view(torch.uint8), quantize_e4m3(silu_mul(gu), scale).view(torch.uint8))


@pytest.mark.skipif(not CUDA, reason="FP8 GEMMs (e4m3 weights, _scaled_mm) run on a GPU only")
def test_graph_runner_fp8_steps_with_fused_ops_match_the_eager_steps(tiny_models):
    """FP8 weights: the fused kernels quantize the GEMM inputs themselves (norms, SiLU); the steps give
    the eager path's logits up to rounding and its greedy tokens."""
    from server.bench.gpu import quantize_linears
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    model = load_model(tiny_models["qwen-tir"]).to(DEVICE)
    quantize_linears(model, "fp8")
    eager = GraphRunner(model, 4, 128, fused_ops=False)
    fused = GraphRunner(model, 4, 128, fused_ops=True)
    assert fused.layers[0].qkv_fp8 is not None and fused.layers[0].down_fp8 is not None
    for r in (eager, fused):
        r.prefill(0, [1, 5, 9, 22, 40], 0)
        r.prefill(1, [3, 4], 0)
    toks, pos = [5, 6], [5, 2]
    for _ in range(4):
        la, lb = eager.decode(toks, pos), fused.decode(toks, pos)
        torch.testing.assert_close(lb, la, rtol=0.05, atol=0.05 * float(la.abs().max()))
        assert torch.equal(la.argmax(-1), lb.argmax(-1))
        toks, pos = la.argmax(-1).tolist(), [p + 1 for p in pos]

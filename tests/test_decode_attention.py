"""The split-KV decode attention kernel against its PyTorch reference, and FP8 KV quantization.

The kernel runs on CUDA where there is one; on a CPU with Triton installed it runs under Triton's
interpreter (TRITON_INTERPRET=1, which conftest.py sets before anything imports Triton), in fp16: the
interpreter does not compute bf16 dots. Without Triton the kernel tests skip; the quantization tests always run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.embedded.decode_attention import (
    FP8_MAX,
    MAX_SPLITS,
    dequantize_kv,
    plan_splits,
    quantize_kv,
    reference_attention,
)

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_quantize_kv_keeps_every_vector_in_range_and_close():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 50, 64) * torch.logspace(-3, 3, 50).view(1, 1, 50, 1)  # magnitudes over 6 decades
    q, scale = quantize_kv(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
    assert q.float().abs().amax(-1).le(FP8_MAX).all()
    back = dequantize_kv(q, scale, torch.float32)
    rel = (back - x).abs().amax(-1) / x.abs().amax(-1)
    assert rel.max() < 0.07  # e4m3: 3 mantissa bits, half an ulp at most 1/16 of the vector's amax


def test_zero_vectors_quantize_to_zero():
    q, scale = quantize_kv(torch.zeros(2, 4, 16))
    assert torch.isfinite(scale).all() and dequantize_kv(q, scale, torch.float32).eq(0).all()


def test_plan_splits_covers_the_context_with_whole_blocks():
    for b, nkv, ctx, programs in [(1, 2, 8192, 264), (16, 8, 512, 264), (1, 8, 100, 264), (4, 4, 16384, 8)]:
        chunk, splits = plan_splits(b, nkv, ctx, programs)
        assert chunk % 64 == 0 and chunk * splits >= ctx and chunk * (splits - 1) < ctx
        assert plan_splits(b, nkv, ctx, programs, 256)[0] % 256 == 0
        assert splits <= MAX_SPLITS  # the combine's serial pass stays short
        assert b * nkv * splits <= max(programs, b * nkv)  # one wave at most: no second, mostly idle one


def _case(b: int, t: int, nq: int, nkv: int, d: int, slots: int, positions: int, ctx: int, fp8: bool,
          dtype: torch.dtype, device: str, programs: int):
    g = torch.Generator().manual_seed(b * 1000 + t * 100 + nq + ctx)
    q = torch.randn(b, t, nq, d, generator=g).to(device, dtype)
    k = torch.randn(slots, nkv, positions, d, generator=g).to(device, dtype)
    v = torch.randn(slots, nkv, positions, d, generator=g).to(device, dtype)
    rows = torch.randperm(slots, generator=g)[:b].to(device)
    last = torch.randint(t - 1, ctx, (b, 1), generator=g)  # ragged lengths, one row may see a single key
    last[0] = t - 1
    pos = (last - (t - 1) + torch.arange(t)).to(device).contiguous()
    ks = vs = None
    if fp8:
        k, ks = quantize_kv(k)
        v, vs = quantize_kv(v)
    return q, k, v, rows, pos, ks, vs


CASES = [  # b, t, nq, nkv, d, slots, positions, ctx, fp8, programs
    (1, 1, 4, 2, 16, 3, 200, 200, False, 8),     # one row, context not a multiple of the block
    (3, 2, 6, 2, 32, 5, 300, 260, False, 4),     # verify rows, keys read short of the cache's end
    (2, 4, 12, 2, 16, 4, 128, 128, True, 16),    # FP8 cache, group 6 x 4 tokens = 24 rows
    (2, 1, 4, 4, 16, 4, 64, 64, True, 1),        # no grouping, one split
    (2, 1, 8, 1, 32, 3, 512, 512, False, 64),    # two splits, the second past the short row's end
    (1, 2, 4, 2, 16, 2, 1100, 1100, True, 64),   # five splits, the last one partial
]


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("case", CASES)
def test_split_kv_attention_matches_the_reference(case):
    b, t, nq, nkv, d, slots, positions, ctx, fp8, programs = case
    from server.embedded.decode_attention import split_kv_attention

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    q, k, v, rows, pos, ks, vs = _case(b, t, nq, nkv, d, slots, positions, ctx, fp8, dtype, device, programs)
    ref = reference_attention(q.float(), dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32),
                              rows, pos, ctx, d ** -0.5)
    out = split_kv_attention(q, k, v, rows, pos, ctx, d ** -0.5, ks, vs, programs=programs)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("fp8", [False, True])
def test_split_kv_attention_launch_configurations_give_the_same_result(fp8):
    """Wider key blocks (the chunk then a multiple of them) and other warp/stage counts: the same numbers."""
    from server.embedded.decode_attention import split_kv_attention

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    q, k, v, rows, pos, ks, vs = _case(2, 2, 8, 2, 32, 3, 700, 700, fp8, dtype, device, 8)
    ref = reference_attention(q.float(), dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32),
                              rows, pos, 700, 32 ** -0.5)
    for config in [(64, 4, 3), (128, 8, 2), (256, 4, 1)]:
        out = split_kv_attention(q, k, v, rows, pos, 700, 32 ** -0.5, ks, vs, programs=8, config=config)
        assert (out.float() - ref).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 3e-3), config
    with pytest.raises(ValueError, match="power of two"):
        split_kv_attention(q, k, v, rows, pos, 700, 32 ** -0.5, ks, vs, config=(96, 4, 2))



@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("fp8", [False, True])
def test_split_kv_attention_quantizes_its_output_as_the_quantize_kernel_does(fp8):
    """With `out_scale` the combine kernel writes the e4m3 bytes quantize_e4m3 makes of the model-dtype
    output (o_proj's FP8 input without a launch of its own), verify rows included."""
    from server.embedded.decode_attention import split_kv_attention
    from server.embedded.gpu_kernels import quantize_e4m3

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    q, k, v, rows, pos, ks, vs = _case(2, 2, 8, 2, 32, 3, 300, 300, fp8, dtype, device, 8)
    scale = torch.tensor(0.002, device=device)
    out = split_kv_attention(q, k, v, rows, pos, 300, 32 ** -0.5, ks, vs, programs=8)
    outq = split_kv_attention(q, k, v, rows, pos, 300, 32 ** -0.5, ks, vs, programs=8, out_scale=scale)
    assert outq.dtype == torch.float8_e4m3fn and outq.shape == q.shape
    assert torch.equal(outq.view(torch.uint8), quantize_e4m3(out, scale).view(torch.uint8))


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("case", CASES)
def test_the_one_pass_form_combines_as_the_combine_kernel_does(case):
    """With counters, the last program of each (row, KV head) combines the partials in the split launch:
    the two-launch form's bytes (the same combine code), the e4m3 output included, and the counters are
    zero again after every launch (CUDA graphs replay with them as captured)."""
    b, t, nq, nkv, d, slots, positions, ctx, fp8, programs = case
    from server.embedded.decode_attention import one_pass_counters, split_kv_attention

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    q, k, v, rows, pos, ks, vs = _case(b, t, nq, nkv, d, slots, positions, ctx, fp8, dtype, device, programs)
    counters = one_pass_counters(b + 1, nkv, torch.device(device))
    scale = torch.tensor(0.002, device=device)
    for out_scale in (None, scale):
        want = split_kv_attention(q, k, v, rows, pos, ctx, d ** -0.5, ks, vs, programs=programs, out_scale=out_scale)
        for _ in range(2):
            got = split_kv_attention(q, k, v, rows, pos, ctx, d ** -0.5, ks, vs, programs=programs,
                                     out_scale=out_scale, counters=counters)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert not counters.any()
    with pytest.raises(ValueError, match="counters"):
        split_kv_attention(q, k, v, rows, pos, ctx, d ** -0.5, ks, vs, counters=counters[:1].long())


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_writes_what_indexing_writes(fp8):
    from server.embedded.decode_attention import write_kv

    if fp8 and not CUDA:  # seen with Triton 3.6: float32 125.6 -> e4m3 64 in the interpreter (128 on a GPU)
        pytest.skip("Triton's interpreter rounds float32 -> e4m3 wrongly where rounding carries into the exponent")
    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(6, 3, 32, generator=g) * torch.logspace(-2, 2, 6).view(6, 1, 1)).to(device, dtype)
    v = torch.randn(6, 3, 32, generator=g).to(device, dtype)
    rows = torch.tensor([[0, 0], [2, 2], [3, 3]]).to(device)  # 3 rows x 2 tokens, as a verify writes them
    pos = torch.tensor([[4, 5], [0, 1], [9, 10]]).to(device)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [torch.zeros(4, 3, 16, 32, dtype=cache_dtype, device=device) for _ in range(4)]
    scales = [torch.zeros(4, 3, 16, device=device) for _ in range(4)] if fp8 else [None] * 4
    index = (rows.reshape(-1), slice(None), pos.reshape(-1))
    if fp8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        caches[0][index], scales[0][index], caches[1][index], scales[1][index] = kq, ks, vq, vs
    else:
        caches[0][index], caches[1][index] = k, v
    write_kv(k, v, caches[2], caches[3], rows, pos, scales[2], scales[3])
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())
    if fp8:
        torch.testing.assert_close(scales[2], scales[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(scales[3], scales[1], rtol=1e-6, atol=0)


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("fp8", [False, True])
def test_a_row_shorter_than_the_bucket_spreads_its_keys_over_every_split(fp8):
    """A graph captured for a 1024-key bucket runs rows of 1024 and 300 keys: both rows' keys are dealt
    over all the programs a row gets (each sums some), not the short row's to the first two of them."""
    from server.embedded.decode_attention import split_kv_attention, split_partials

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    q, k, v, rows, _, ks, vs = _case(2, 1, 4, 2, 16, 2, 1024, 1024, fp8, dtype, device, 16)
    pos = torch.tensor([[1023], [299]], device=device)
    _, ml, splits, block_m = split_partials(q, k, v, rows, pos, 1024, 0.25, ks, vs, programs=16, config=(64, 4, 2))
    assert splits == 4
    sums = ml[:, 1].view(2, 2, splits, block_m)[:, :, :, :2]  # (row, KV head, split, the group's 2 query heads)
    assert (sums > 0).all()
    ref = reference_attention(q.float(), dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32),
                              rows, pos, 1024, 0.25)
    out = split_kv_attention(q, k, v, rows, pos, 1024, 0.25, ks, vs, programs=16, config=(64, 4, 2))
    assert (out.float() - ref).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.skipif(not (CUDA or HAS_TRITON), reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("t", [1, 4])
def test_fp8_scores_lose_nothing_for_a_query_on_the_e4m3_grid(t):
    """SplitConfig.fp8_scores quantizes each query row to e4m3 (amax / 448, as quantize_kv does) and dots it
    with the cached e4m3 keys. A query whose rows are e4m3 values times a power of two, each with an
    element at 448 times it, quantizes exactly, so the output is the unquantized query's; an ordinary
    query's moves (the e4m3 dot ran) to the quantized query's. A bf16 cache has no e4m3 keys to dot, and an
    8-bit dot needs head_dim >= 32: asking for it there is an error."""
    from server.embedded.decode_attention import split_config, split_kv_attention

    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float16, "cpu")
    _, k, v, rows, pos, ks, vs = _case(2, t, 8, 2, 32, 3, 300, 300, True, dtype, device, 8)
    g = torch.Generator().manual_seed(t)
    grid = (torch.randn(2, t, 8, 32, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    grid[..., 0] = 448.0
    q = (grid * 2.0 ** torch.randint(-9, -5, (2, t, 8, 1), generator=g)).to(device, dtype)
    ref = reference_attention(q.float(), dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32),
                              rows, pos, 300, 32 ** -0.5)
    config = split_config(True, t)._replace(fp8_scores=True)
    out = split_kv_attention(q, k, v, rows, pos, 300, 32 ** -0.5, ks, vs, programs=8, config=config)
    assert (out.float() - ref).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 3e-3)
    # an ordinary query does go through the e4m3 dot: its output moves off the fp16 dot's. On a GPU it is the
    # output of the query as quantize_kv quantizes it (the interpreter rounds some float32 -> e4m3 wrongly)
    q = torch.randn(2, t, 8, 32, generator=g).to(device, dtype)
    out = split_kv_attention(q, k, v, rows, pos, 300, 32 ** -0.5, ks, vs, programs=8, config=config)
    plain = split_kv_attention(q, k, v, rows, pos, 300, 32 ** -0.5, ks, vs, programs=8, config=config[:3])
    assert not torch.equal(out, plain)
    if CUDA:
        q8 = dequantize_kv(*quantize_kv(q), torch.float32)
        ref = reference_attention(q8, dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32),
                                  rows, pos, 300, 32 ** -0.5)
        assert (out.float() - ref).abs().max().item() < 2e-2
    with pytest.raises(ValueError, match="fp8_scores needs an FP8 cache"):
        split_kv_attention(q, k.float().to(dtype), v.float().to(dtype), rows, pos, 300, 32 ** -0.5, config=config)
    with pytest.raises(ValueError, match="head_dim >= 32"):
        split_kv_attention(q[..., :16].contiguous(), k[..., :16].contiguous(), v[..., :16].contiguous(), rows, pos,
                           300, 0.25, ks, vs, config=config)


def test_a_verify_takes_its_own_launch_entries_where_a_table_has_them():
    from server.embedded.decode_attention import PROGRAMS_PER_SM, SPLIT_CONFIG, launch_key, split_config

    assert split_config(True, 4) == SPLIT_CONFIG["fp8_verify"] and split_config(True, 1) == SPLIT_CONFIG["fp8"]
    assert split_config(False, 4) == SPLIT_CONFIG["model"]  # no bf16 verify entry: the dtype's
    table = {"model": 2, "fp8": 2, "fp8_verify": 3}
    assert [launch_key(True, t, table) for t in (1, 4)] == ["fp8", "fp8_verify"]
    assert launch_key(False, 4, table) == "model" and launch_key(True, 4, PROGRAMS_PER_SM) in PROGRAMS_PER_SM

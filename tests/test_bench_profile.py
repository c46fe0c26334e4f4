"""server.bench.profile's roles: kernel names as the H100 profile of a 14B decode step gave them
(bench/gpu-fp8-decode-h100.json) land in the role they play."""

from __future__ import annotations

import pytest

from server.bench.profile import role


@pytest.mark.parametrize("name, want", [
    ("nvjet_sm90_tst_384x8_64x4_4x1_v_bz_TNT", "gemm"),
    ("nvjet_sm90_qqsss_128x8_128x12_2x1_v_bz_algo2_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "gemm"),
    ("w8_gemm", "gemm (triton: 8-bit, split sums, channel scales)"),
    ("reduce_splits", "gemm (triton: 8-bit, split sums, channel scales)"),
    ("quantize_e4m3", "quantize"), ("split_kv", "attention"), ("combine", "attention"),
    ("add_rms_norm", "norm"), ("rope_write_kv", "rope + kv write"), ("silu_mul", "silu * up"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampling / argmax"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
])
def test_kernels_are_grouped_by_the_role_their_name_says(name, want):
    assert role(name) == want

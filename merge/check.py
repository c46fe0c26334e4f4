"""The merge's exactness check: on sampled tensors, merged == sum_i w_i * theta_i (computed in fp64)
within the output dtype's rounding (half an ulp), since a linear merge is an exact step and must
stay one. torch and safetensors load inside the functions.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from aimo_spec.checkpoint import CheckpointTensors

_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}


def _ulp(x: Any, dtype: Any) -> Any:
    """Spacing of `dtype` numbers around each |x| (2^(e - p) for x = m * 2^e, m in [0.5, 1))."""
    import torch

    bits = _SIGNIFICAND_BITS[str(dtype).replace("torch.", "")]
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - bits).clamp_min(torch.finfo(dtype).tiny)


def check_arithmetic(merged_dir: Path, source_dirs: dict[str, Path], weights: dict[str, float], n: int,
                     seed: int = 0) -> dict[str, Any]:
    """Max error of merged vs the fp32 weighted sum, in absolute terms and in output-dtype ulps."""
    import torch

    out = CheckpointTensors(merged_dir)
    srcs = {k: CheckpointTensors(d) for k, d in source_dirs.items()}
    common = sorted(set(out.files).intersection(*(s.files for s in srcs.values())))
    names = sorted(random.Random(seed).sample(common, min(n, len(common))))
    worst_abs, worst_ulp, within = 0.0, 0.0, True
    for name in names:
        merged = out[name]
        terms = [w * srcs[k][name].double() for k, w in weights.items()]
        expected = sum(terms)
        err = (merged.double() - expected).abs()
        ulp = _ulp(expected, merged.dtype)
        # mergekit sums in fp32: its own error scales with the terms, not with their (maybe ~0) sum
        fp32_slack = 4 * 2.0 ** -24 * sum(t.abs() for t in terms)
        err = (err - fp32_slack).clamp_min(0)
        ratio = float((err / ulp).max())
        worst_abs, worst_ulp = max(worst_abs, float((merged.double() - expected).abs().max())), max(worst_ulp, ratio)
        # one rounding of the fp32 sum to the output dtype: <= 0.5 ulp
        within &= ratio <= (0.5 + 1e-3 if merged.dtype != torch.float32 else 4.0)
    return {"tensors_checked": len(names), "max_abs_error": worst_abs, "max_error_ulps": worst_ulp,
            "within_rounding": within, "dtype": str(merged.dtype).replace("torch.", "")}

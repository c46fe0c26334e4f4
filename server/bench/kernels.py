"""The quantized GEMMs of the GPU engine against bf16 cuBLAS, on the decode shapes of Qwen2 1.5B/14B.

    python -m server.bench.kernels [--out bench/kernels.json]

For each weight shape (the fused q/k/v, o, fused gate/up and down projections) and batch M: bf16
`F.linear`, the int8 weight-only Triton kernel (every configuration of a small grid, and the one the
engine uses), and FP8 `_scaled_mm` with its activation quantization: microseconds (CUDA-graph-free
`triton.testing.do_bench` medians) and the weight bytes read per second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

SHAPES = {"1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
          "14b": [(7168, 5120), (5120, 5120), (27648, 5120), (5120, 13824)]}
GRID = list(itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4)))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA device here", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from server.embedded import gpu_kernels as gk

    rows, totals = [], {c: 0.0 for c in GRID}
    for shape, dims in SHAPES.items():
        for (n, k), m in itertools.product(dims, [int(b) for b in args.batches.split(",")]):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            s = (w.float().abs().amax(1) / 127).clamp_min(1e-8)
            q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
            sb = s.to(torch.bfloat16)
            bf16 = do_bench(lambda: F.linear(x, w), return_mode="median") * 1e3
            per = {}
            for c in GRID:
                try:
                    per[c] = do_bench(lambda: gk.w8a16_linear(x, q, sb, config=c), return_mode="median") * 1e3
                except Exception:  # noqa: BLE001 - a configuration the compiler refuses
                    per[c] = float("inf")
                totals[c] += per[c]
            used = do_bench(lambda: gk.w8a16_linear(x, q, sb), return_mode="median") * 1e3
            row = {"shape": shape, "n": n, "k": k, "m": m, "bf16_us": round(bf16, 1), "w8a16_us": round(used, 1),
                   "w8a16_best_us": round(min(per.values()), 1), "w8a16_best_config": min(per, key=per.get),
                   "bf16_weight_tb_s": round(n * k * 2 / bf16 / 1e6, 2), "w8a16_weight_tb_s": round(n * k / used / 1e6, 2)}
            if gk.available()["fp8"]:
                wf = (w / (w.abs().amax() / 448)).to(torch.float8_e4m3fn)
                ws, xs = (w.abs().amax() / 448).float(), torch.tensor(0.05, device="cuda")
                fp8 = do_bench(lambda: gk.fp8_linear(x, wf, ws, xs, None, torch.bfloat16), return_mode="median") * 1e3
                row.update({"fp8_us": round(fp8, 1), "fp8_weight_tb_s": round(n * k / fp8 / 1e6, 2)})
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = min(totals, key=totals.get)
    print(f"[bench.kernels] best w8a16 configuration over all shapes: {best} (in use: {gk.CONFIG})", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "best_config": best, "config_in_use": gk.CONFIG}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

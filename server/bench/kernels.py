"""The quantized GEMMs of the GPU engine against bf16 cuBLAS, on the decode shapes of Qwen2 1.5B/14B.

    python -m server.bench.kernels [--batches 1,4,16] [--tune] [--out bench/kernels.json]

For each weight shape (the fused q/k/v, o, fused gate/up and down projections) and batch M: bf16
`F.linear`, the 8-bit weight-only Triton kernel with int8 weights (per-channel scales) and with FP8
weights (one scale), FP8 `_scaled_mm` with its activation quantization, and the FP8 GEMM alone on an
e4m3 activation: `_scaled_mm` (`fp8_gemm`) against the Triton kernel with an e4m3 input. Where gemlite is
installed (a well-kept Triton low-bit library; carried to the GPU host as a wheel, not a dependency), its
8-bit linears of the same weight run beside them (`gemlite_*`; `--no-gemlite` skips them). Each is
timed as a CUDA graph replay (as the engine runs it, so its launches count); the weight bytes read per
second beside it. `--tune` also times every configuration of a small grid for the weight-only kernel and names the
best over all shapes for each row band (16, 32, 64 rows; try it with W8A16_CONFIG="16=...;64=...").
`--tune-dense` times `dense_linear`'s Triton tiles (and K splits) against cuBLAS on every bf16 weight shape, every
call reading another copy of the weight so that L2 does not hold it (as in the engine, where each layer's weights
are read once a step); try the best with DENSE_TRITON_CONFIG, DENSE_TRITON_SPLIT, DENSE_TRITON_MAX_ROWS and
DENSE_TRITON_MAX_ELEMENTS (which keeps the larger gate/up and down weights on cuBLAS by default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from server.bench.device import cuda_device, gpu_environment, grid_arguments, write_rows

SHAPES = {"1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
          "14b": [(7168, 5120), (5120, 5120), (27648, 5120), (5120, 13824)]}
GRID = list(itertools.product((32, 64, 128, 256), (128, 256), (4, 8), (3, 4)))
FP8_GRID = list(itertools.product((64, 128), (128, 256), (4, 8), (3, 4)))  # the FP8 Triton GEMM's, --tune
# `dense_linear`'s tiles and K splits (--tune-dense: BLOCK_N, BLOCK_K, warps, stages, split), on every bf16 weight
# shape; each timed call reads another copy of the weight, so that L2 (50 MB on an H100) does not hold it
DENSE_GRID = list(itertools.product((8, 16, 32, 64), (128, 256), (4, 8), (3, 4), (1, 2, 4)))
DENSE_COPIES_BYTES = 256 << 20


# gemlite's 8-bit linears (gemlite.helper's processors), each quantizing the weight a scale a channel:
# int8 and FP8 weight-only with bf16 activations, and FP8 weights on a dynamically quantized FP8 activation
GEMLITE = {"gemlite_a16w8_int8": "A16W8_INT8", "gemlite_a16w8_fp8": "A16W8_FP8", "gemlite_a8w8_fp8": "A8W8_fp8_dynamic"}
GEMLITE_KEYS = tuple(f"{name}_" for name in GEMLITE)  # a row's figures (or error) of each


def gemlite_linears(w: torch.Tensor) -> dict[str, object]:
    """GEMLITE's linears of the bf16 weight `w` [n, k] on its device, each a callable or, where gemlite
    failed to make it, the error's text; empty where gemlite is not installed."""
    try:
        import gemlite.helper as helper
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "gemlite":
            return {}
        raise
    out: dict[str, object] = {}
    for name, processor in GEMLITE.items():
        try:
            out[name] = getattr(helper, processor)(device=str(w.device), dtype=w.dtype).from_weights(w.clone())
        except Exception as e:  # noqa: BLE001 - a library failure is a figure, not a crash
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def dense_tune(x: torch.Tensor, w: torch.Tensor, gk) -> dict[str, object]:
    """cuBLAS against the weight-only kernel on the bf16 weight (unit scale) over DENSE_GRID's tiles and K
    splits, each call reading another copy of `w` (DENSE_COPIES_BYTES of them: none stays in L2)."""
    from server.bench.attention import time_graph

    copies = [w.clone() for _ in range(max(2, DENSE_COPIES_BYTES // (w.numel() * w.element_size())))]
    unit = torch.ones((), device=w.device)

    def rotating(call):
        turn = itertools.cycle(copies)
        return lambda: call(next(turn))
    cublas = time_graph(rotating(lambda wc: F.linear(x, wc)))
    per = {}
    for tile in DENSE_GRID:  # (BLOCK_N, BLOCK_K, warps, stages, split)
        try:
            per[tile] = time_graph(rotating(lambda wc, t=tile: gk.weight_only_linear(x, wc, unit, config=t[:4],
                                                                                      split=t[4])))
        except Exception:  # noqa: BLE001 - a configuration the compiler refuses
            continue
    best = min(per, key=per.get) if per else None
    one = min((t for t in per if t[4] == 1), key=per.get, default=None)  # one launch (no reduction kernel)
    size = w.numel() * w.element_size()
    return {"dense_cublas_us": round(cublas, 2), "dense_cublas_tb_s": round(size / cublas / 1e6, 2),
            "dense_best_us": round(per[best], 2) if best else None, "dense_best_config": best,
            "dense_best_vs_cublas": round(cublas / per[best], 3) if best else None,
            "dense_best_tb_s": round(size / per[best] / 1e6, 2) if best else None,
            "dense_one_launch_us": round(per[one], 2) if one else None, "dense_one_launch_config": one}


def row_band(m: int) -> int:
    """The band of `gpu_kernels.CONFIGS` that `m` rows fall in (the kernel's row tile: 16, 32 or 64)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.kernels", description=__doc__.splitlines()[0])
    grid_arguments(ap, SHAPES, shapes="1.5b,14b", batches="1,4,16")
    ap.add_argument("--tune", action="store_true", help="time the weight-only kernel's configuration grid too")
    ap.add_argument("--tune-fp8", action="store_true", help="time the FP8 Triton GEMM over a small grid too")
    ap.add_argument("--no-gemlite", action="store_true", help="skip gemlite's linears even where it is installed")
    ap.add_argument("--tune-dense", action="store_true",
                    help="time dense_linear's Triton tiles against cuBLAS on bf16 weights, read from past L2")
    args = ap.parse_args(argv)
    from server.bench.attention import time_graph

    if cuda_device("bench.kernels") is None:
        return 2
    from server.embedded import gpu_kernels as gk

    rows, totals = [], {}  # (row band, configuration): microseconds over the shapes
    for shape in args.shapes:
        for (n, k), m in itertools.product(SHAPES[shape], args.batches):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            s = (w.float().abs().amax(1) / 127).clamp_min(1e-8)
            q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
            sb = s.to(torch.bfloat16)
            ws = (w.abs().amax() / 448).float()
            wf = (w / ws).to(torch.float8_e4m3fn)
            bf16 = time_graph(lambda: F.linear(x, w))
            int8 = time_graph(lambda: gk.weight_only_linear(x, q, sb))
            fp8_wo = time_graph(lambda: gk.weight_only_linear(x, wf, ws))
            row = {"shape": shape, "n": n, "k": k, "m": m, "bf16_us": round(bf16, 1), "int8_wo_us": round(int8, 1),
                   "fp8_wo_us": round(fp8_wo, 1), "int8_wo_vs_bf16": round(bf16 / int8, 2),
                   "fp8_wo_vs_bf16": round(bf16 / fp8_wo, 2), "bf16_weight_tb_s": round(n * k * 2 / bf16 / 1e6, 2),
                   "int8_wo_weight_tb_s": round(n * k / int8 / 1e6, 2)}
            if gk.available()["fp8"]:
                xs = torch.tensor(0.05, device="cuda")
                fp8 = time_graph(lambda: gk.fp8_linear(x, wf, ws, xs, None, torch.bfloat16))
                row.update({"fp8_scaled_mm_us": round(fp8, 1), "fp8_scaled_mm_vs_bf16": round(bf16 / fp8, 2)})
                # the GEMM alone on an e4m3 activation (the fused kernels quantize it), as the engine runs
                # it: concatenated linears (q/k/v, gate/up) with a scale a channel, the others one scale
                xq = gk.quantize_e4m3(x, xs)
                wsc = ws.expand(n).contiguous() if (n, k) in (SHAPES[shape][0], SHAPES[shape][2]) else ws
                unit = torch.ones((), device="cuda")
                gemm = time_graph(lambda: gk.fp8_gemm(xq, wf, wsc, xs, None, torch.bfloat16, unit))
                row["fp8_gemm_scaled_mm_us"] = round(gemm, 1)
                try:
                    tri = time_graph(lambda: gk.weight_only_linear(xq, wf, wsc, out_dtype=torch.bfloat16, x_scale=xs))
                    row.update({"fp8_gemm_triton_us": round(tri, 1),
                                "fp8_gemm_triton_weight_tb_s": round(n * k / tri / 1e6, 2)})
                except Exception as e:  # noqa: BLE001 - e.g. an FP8 dot this tile size cannot compile to
                    row["fp8_gemm_triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if args.tune_fp8:
                    per = {}
                    for c in FP8_GRID:
                        try:
                            per[c] = time_graph(lambda: gk.weight_only_linear(xq, wf, wsc, config=c,
                                                                              out_dtype=torch.bfloat16, x_scale=xs))
                        except Exception:  # noqa: BLE001 - a configuration the compiler refuses
                            per[c] = float("inf")
                    row.update({"fp8_gemm_triton_best_us": round(min(per.values()), 1),
                                "fp8_gemm_triton_best_config": min(per, key=per.get)})
            if not args.no_gemlite:
                try:
                    peers = gemlite_linears(w)
                except Exception as e:  # noqa: BLE001 - a library failure is a figure, not a crash
                    peers, row["gemlite_error"] = {}, f"{type(e).__name__}: {str(e)[:200]}"
                ref = F.linear(x, w).float()
                for name, linear in peers.items():
                    if isinstance(linear, str):
                        row[f"{name}_error"] = linear
                        continue
                    try:
                        err = ((linear(x).float() - ref).norm() / ref.norm()).item()
                        us = time_graph(lambda: linear(x))
                        row.update({f"{name}_us": round(us, 1), f"{name}_vs_bf16": round(bf16 / us, 2),
                                    f"{name}_rel_err": round(err, 4)})
                    except Exception as e:  # noqa: BLE001 - e.g. a kernel this GPU cannot compile
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if args.tune_dense:
                row.update(dense_tune(x, w, gk))
            if args.tune:
                per = {}
                for c in GRID:
                    try:
                        per[c] = time_graph(lambda: gk.weight_only_linear(x, q, sb, config=c))
                    except Exception:  # noqa: BLE001 - a configuration the compiler refuses
                        per[c] = float("inf")
                    totals[row_band(m), c] = totals.get((row_band(m), c), 0.0) + per[c]
                row.update({"int8_wo_best_us": round(min(per.values()), 1),
                            "int8_wo_best_config": min(per, key=per.get)})
            rows.append(row)
            print(json.dumps(row), flush=True)
    bands = sorted({row_band(m) for m in args.batches})
    meta = {**gpu_environment(), "config_in_use": {b: gk.config_for(0, b) for b in bands}}
    if any(k.startswith(GEMLITE_KEYS) for row in rows for k in row):  # gemlite made some linear: its version
        import gemlite

        meta["gemlite"] = getattr(gemlite, "__version__", "installed")
    if args.tune:
        meta["best_config"] = {b: min((c for band, c in totals if band == b), key=lambda c: totals[b, c])
                               for b in bands}
        meta["best_config_env"] = ";".join(f"{b}={','.join(map(str, c))}" for b, c in meta["best_config"].items())
        for b in bands:
            print(f"[bench.kernels] rows <= {b}: best configuration over all shapes {meta['best_config'][b]}, "
                  f"{totals[b, meta['best_config'][b]]:.0f} us against {totals.get((b, gk.config_for(0, b)), 0):.0f} "
                  f"us in use {gk.config_for(0, b)}", file=sys.stderr)
    write_rows(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

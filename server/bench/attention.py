"""Decode attention on a GPU: the forms the engine can use, side by side, against the bytes they must read.

    python -m server.bench.attention [--shapes 1.5b,7b,14b] [--batches 1,4,16] [--contexts 512,8192,16384]
                                     [--tokens 1,4] [--fill 1.0] [--out bench/attention.json]

One layer's attention over the static slot cache, at each shape's head counts, for a batch of rows
whose keys fill the context (the CUDA graph's bucket; `--fill` of it, as rows past a power of two
do): SDPA with the group's query heads as query rows (`rows`), SDPA's grouped-query form (`gqa`),
the split-KV Triton kernel over a bf16 cache (`split`) and over an FP8 cache with per-vector scales
(`split_fp8`), the latter also with its scores as an e4m3 dot (`split_fp8_scores`: the query quantized
a row, `SplitConfig.fp8_scores`), and both caches' one-pass forms (`split_one_pass`, `split_fp8_one_pass`:
the last program of a row's KV head combines the partials, one launch instead of two). Each is timed
as a CUDA-graph replay of 20 calls (median of 5), as the engine runs it; the bound is the cache bytes
the call must read over the measured copy bandwidth. Each form's output is checked against `reference_attention` first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from server.bench.device import comma_ints, copy_bandwidth, cuda_device, gpu_environment, grid_arguments, write_rows

HEADS = {"1.5b": (12, 2, 128), "7b": (28, 4, 128), "14b": (40, 8, 128)}  # query heads, KV heads, head_dim
REPLAYS = 20


def time_graph(fn: Callable[[], object]) -> float:
    """Microseconds per call: REPLAYS calls captured in one CUDA graph, median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / REPLAYS * 1e6)
    return statistics.median(times)


def forms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor,
          vs: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, ctx: int, scale: float
          ) -> dict[str, Callable[[], torch.Tensor]]:
    from server.embedded.decode_attention import one_pass_counters, split_config, split_kv_attention

    b, t, nq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    fp8_scores = split_config(True, t)._replace(fp8_scores=True)
    counters = one_pass_counters(b, nkv, q.device)  # the one-pass forms: the last program combines
    mask = (torch.arange(ctx, device=q.device).view(1, 1, ctx) <= pos.unsqueeze(-1))  # [B, T, ctx]
    gqa_mask, rows_mask = mask.unsqueeze(1), mask.repeat_interleave(g, 1).unsqueeze(1)

    def gqa() -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k[:b, :, :ctx], v[:b, :, :ctx], attn_mask=gqa_mask,
                                           scale=scale, enable_gqa=g > 1)
        return o.transpose(1, 2)

    def by_rows() -> torch.Tensor:
        qr = q.view(b, t, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, nkv, t * g, d)
        o = F.scaled_dot_product_attention(qr, k[:b, :, :ctx], v[:b, :, :ctx], attn_mask=rows_mask, scale=scale)
        return o.view(b, nkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, nq, d)

    return {"rows": by_rows, "gqa": gqa,
            "split": lambda: split_kv_attention(q, k, v, rows, pos, ctx, scale),
            "split_fp8": lambda: split_kv_attention(q, kq, vq, rows, pos, ctx, scale, ks, vs),
            "split_fp8_scores": lambda: split_kv_attention(q, kq, vq, rows, pos, ctx, scale, ks, vs,
                                                           config=fp8_scores),
            "split_one_pass": lambda: split_kv_attention(q, k, v, rows, pos, ctx, scale, counters=counters),
            "split_fp8_one_pass": lambda: split_kv_attention(q, kq, vq, rows, pos, ctx, scale, ks, vs,
                                                             counters=counters)}


# an FP8 cache moves half the bytes an iteration for the same softmax work, so its best may want longer
# iterations, deeper pipelines or more resident programs than bf16's (those the shared memory refuses
# fail to compile and are skipped)
TUNE_CONFIGS = [(bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
FP8_SCORES = (False, True)  # the FP8 cache's configurations also with its scores as an e4m3 dot
PROGRAMS_PER_SM = (1, 2, 3, 4)


def tune_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
               ks: torch.Tensor, vs: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, ctx: int, scale: float,
               ref: torch.Tensor, caches: tuple[str, ...] = ("split", "split_fp8"),
               per_sms: tuple[int, ...] = PROGRAMS_PER_SM) -> dict[str, list]:
    """The split kernel's time per (keys an iteration, warps, stages[, e4m3 scores], programs a
    multiprocessor), over the bf16 (`split`) and FP8 (`split_fp8`, also with e4m3 scores) caches named in
    `caches`, fastest first (the three best of each); a configuration that fails or is wrong is skipped."""
    from server.embedded.decode_attention import split_kv_attention

    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    out: dict[str, list] = {}
    for name, (kc, vc, ksc, vsc) in {"split": (k, v, None, None), "split_fp8": (kq, vq, ks, vs)}.items():
        if name not in caches:
            continue
        timed = []
        configs = [(*c, fs) for c in TUNE_CONFIGS for fs in FP8_SCORES] if ksc is not None else TUNE_CONFIGS
        for config in configs:
            for per_sm in per_sms:
                def fn(config=config, per_sm=per_sm) -> torch.Tensor:
                    return split_kv_attention(q, kc, vc, rows, pos, ctx, scale, ksc, vsc, programs=per_sm * sms,
                                              config=config)
                try:
                    if (fn().float() - ref).abs().max().item() > 0.1:
                        continue
                    timed.append((round(time_graph(fn), 1), *config, per_sm))
                except Exception as e:  # noqa: BLE001 - e.g. shared memory exceeded: not a candidate
                    print(f"[bench.attention] {name} {config} x{per_sm}: {type(e).__name__}", file=sys.stderr)
        out[name] = sorted(timed)[:3]  # (us, keys an iteration, warps, stages[, e4m3 scores], programs an SM)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.attention", description=__doc__.splitlines()[0])
    grid_arguments(ap, HEADS, shapes="1.5b,7b,14b", batches="1,4,16", contexts="512,8192,16384")
    ap.add_argument("--tokens", type=comma_ints, default=[1, 4],
                    help="query tokens per row (1: decode, 4: a 1+3 verify)")
    ap.add_argument("--fill", type=float, default=1.0,
                    help="the fraction of the context (the CUDA graph's bucket) each row's keys fill: 0.51 is a "
                         "row just past the previous power of two")
    ap.add_argument("--tune", action="store_true",
                    help="also time the split kernel over launch configurations and programs a multiprocessor "
                         "(row key 'tune': the fastest first), to set decode_attention.SPLIT_CONFIG")
    ap.add_argument("--tune-caches", default="split,split_fp8", help="the forms --tune times: split, split_fp8")
    ap.add_argument("--tune-programs", type=comma_ints, default=list(PROGRAMS_PER_SM),
                    help="programs a multiprocessor --tune tries")
    args = ap.parse_args(argv)
    from server.embedded.decode_attention import quantize_kv, reference_attention

    dev = cuda_device("bench.attention")
    if dev is None:
        return 2
    bandwidth = copy_bandwidth(dev)
    print(f"[bench.attention] copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    meta = {**gpu_environment(), "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2)}
    results: list[dict] = []
    for shape in args.shapes:
        nq, nkv, d = HEADS[shape]
        for ctx in args.contexts:
            for b in args.batches:
                k = torch.randn(b + 1, nkv, ctx, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                kq, ks = quantize_kv(k)
                vq, vs = quantize_kv(v)
                for t in args.tokens:
                    q = torch.randn(b, t, nq, d, device=dev, dtype=torch.bfloat16)
                    rows = torch.arange(b, device=dev)
                    keys = max(t, int(ctx * args.fill))  # the keys each row holds; ctx is the graph's bucket
                    pos = (torch.arange(t, device=dev) + keys - t).view(1, t).expand(b, t).contiguous()
                    ref = reference_attention(q, k, v, rows, pos, ctx, d ** -0.5).float()
                    row = {"shape": shape, "batch": b, "context": ctx, "keys": keys, "tokens": t}
                    bf16_bytes = 2 * b * nkv * keys * d * 2
                    for name, fn in forms(q, k, v, kq, vq, ks, vs, rows, pos, ctx, d ** -0.5).items():
                        try:
                            err = (fn().float() - ref).abs().max().item()
                            us = time_graph(fn)
                        except Exception as e:  # noqa: BLE001 - e.g. FP8 dots on a GPU without them
                            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                            continue
                        read = bf16_bytes // 2 + 2 * b * nkv * keys * 4 if "fp8" in name else bf16_bytes
                        row[name] = {"us": round(us, 1), "max_abs_err": round(err, 4),
                                     "of_bound": round(read / bandwidth / (us * 1e-6), 3)}
                    if args.tune:
                        row["tune"] = tune_split(q, k, v, kq, vq, ks, vs, rows, pos, ctx, d ** -0.5, ref,
                                                 tuple(args.tune_caches.split(",")), tuple(args.tune_programs))
                    row["bound_bf16_us"] = round(bf16_bytes / bandwidth * 1e6, 1)
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    write_rows(args.out, meta, results)
                del k, v, kq, vq, ks, vs
    return 0


if __name__ == "__main__":
    sys.exit(main())

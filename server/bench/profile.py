"""Where a GPU decode step's time goes: the GraphRunner's kernels, timed by the profiler, per step.

    python -m server.bench.profile [--shapes 14b] [--formats bf16,fp8] [--batches 1] [--contexts 512]
                                   [--kv-cache auto] [--tokens 1,4] [--steps 16] [--out bench/profile.json]

`server.bench.gpu` says how far a step is from the bytes it reads; this says which kernels hold the
rest. For each (shape, format, KV dtype, batch, context) the same random-weight model as bench.gpu is
built and its captured decode step replayed under torch.profiler; every CUDA kernel's time is summed
by name and divided by the steps, and kernels are also grouped by role (GEMM, attention, norm, ...)
from their names. The step's wall time beside the kernels' sum shows the device's idle gaps (launch
and host time the graph does not hide).
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
from typing import Any, Optional

import torch

from server.bench.device import comma_ints, cuda_device, gpu_environment, grid_arguments, write_rows
from server.bench.gpu import SHAPES, build, log
from server.tables import format_table

# a kernel's role from its name (first match wins): cuBLAS/CUTLASS GEMMs, the engine's Triton kernels
ROLES = [("quantize", r"quantize_e4m3"), ("gemm (triton: 8-bit, split sums, channel scales)", r"w8_gemm|reduce_splits"),
         ("gemm", r"gemm|gemv|cutlass|sm90_xmma|nvjet|_scaled_mm|splitKreduce"),
         ("attention", r"attention|attn|flash|split_kv|combine|sdpa|fmha"),
         ("norm", r"rms_norm|add_rms"), ("rope + kv write", r"rope|write_kv"), ("silu * up", r"silu"),
         ("sampling / argmax", r"argmax|max_|topk|softmax|sort"), ("copy / fill", r"copy|fill|cat|index")]


def role(name: str) -> str:
    for label, pattern in ROLES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


@torch.inference_mode()
def profile_steps(runner: Any, vocab: int, b: int, context: int, steps: int, tokens: int = 1
                  ) -> tuple[float, dict[str, float], float]:
    """(median wall ms of a step, {kernel name: device us a step}, kernels a step) over `steps` decode
    steps, or verify steps of `tokens` tokens a row (a speculative step's target forward), the wall
    time measured apart from the profiled steps, whose tracing costs time."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    for slot in range(b):
        runner.prefill(slot, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0)
    ids = torch.randint(0, vocab, (b,), generator=gen).tolist()
    drafts = torch.randint(0, vocab, (b, tokens), generator=gen).tolist()
    pos = context

    def step() -> float:
        nonlocal ids, pos
        torch.cuda.synchronize()
        t = time.perf_counter()
        if tokens > 1:  # the same rows each time: a verify writes its tokens' keys but keeps the position
            runner.verify(drafts, [context] * b).argmax(-1).tolist()
        else:
            ids = runner.decode(ids, [pos] * b).argmax(-1).tolist()
            pos += 1
        return time.perf_counter() - t

    for _ in range(5):  # graphs captured, kernels compiled
        step()
    walls = [step() for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            kernels[e.name] = kernels.get(e.name, 0.0) + us / steps
            launches += 1
    return statistics.median(walls) * 1e3, kernels, launches / steps


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.profile", description=__doc__.splitlines()[0])
    grid_arguments(ap, SHAPES, shapes="14b", batches="1", contexts="512")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--kv-cache", default="auto", help="KV cache dtypes: auto (the model's), fp8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens", type=comma_ints, default=[1], help="query tokens a row: 1 decode, 4 a 1+3 verify")
    ap.add_argument("--top", type=int, default=12, help="kernels printed a row (all are written)")
    args = ap.parse_args(argv)
    dev = cuda_device("bench.profile")
    if dev is None:
        return 2
    from server.embedded.graph_runner import GraphRunner

    rows = []
    for shape in args.shapes:
        for fmt in args.formats.split(","):
            model = build(shape, fmt, dev)
            vocab = model.config.vocab_size
            for kv in args.kv_cache.split(","):
                runner = GraphRunner(model, max(args.batches), max(args.contexts) + 2 * args.steps + 16,
                                     kv_cache_dtype=kv)
                for context in args.contexts:
                    for b, tokens in ((b, t) for b in args.batches for t in args.tokens):
                        wall, kernels, launches = profile_steps(runner, vocab, b, context, args.steps, tokens)
                        roles: dict[str, float] = {}
                        for name, us in kernels.items():
                            roles[role(name)] = roles.get(role(name), 0.0) + us
                        busy = sum(kernels.values())
                        row = {"shape": shape, "format": fmt, "kv_cache": kv, "batch": b, "context": context,
                               "tokens": tokens, "step_ms": round(wall, 3), "kernels_ms": round(busy / 1e3, 3),
                               "idle_ms": round(wall - busy / 1e3, 3),
                               "kernels_a_step": round(launches, 1),
                               "roles_us": {k: round(v, 1) for k, v in sorted(roles.items(), key=lambda kv: -kv[1])},
                               "kernels_us": {k: round(v, 1) for k, v in sorted(kernels.items(),
                                                                                 key=lambda kv: -kv[1])}}
                        rows.append(row)
                        log(f"{shape} {fmt} kv={kv} b={b} ctx={context} tokens={tokens}: step {wall:.3f} ms, "
                            f"kernels {busy / 1e3:.3f} ms")
                        top = list(row["kernels_us"].items())[:args.top]
                        table = ([{"what": k, "us": v} for k, v in row["roles_us"].items()]
                                 + [{"what": "  " + k[:90], "us": v} for k, v in top])
                        print(format_table(table, [("role / kernel", "what", "<92"), ("us a step", "us", ">10.1f")]),
                              flush=True)
                del runner
                gc.collect()
                torch.cuda.empty_cache()
            del model
            gc.collect()
            torch.cuda.empty_cache()
    write_rows(args.out, gpu_environment(), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

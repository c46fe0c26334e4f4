"""Triton overhead: the same load through a real Triton server (gRPC streaming) and on the engine directly.

    python -m server.bench.triton --engine engines/mix/build/embedded --out bench/triton.json

Runs in the Triton environment. For 1, 4 and 8 concurrent requests of `--tokens` tokens each (end of
sequence ignored), median of `--repeats`: aggregate tokens/s and mean per-token latency (time between
streamed tokens) on the embedded engine in this process, then through `make triton`'s server on the
same weights; the ratios are the price of the server. Also the server's startup time (process start
to ready, model load included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from aimo_spec.protocol import Delta, Final, Request, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


async def load(engine: Any, prompt: list[int], n: int, tokens: int) -> tuple[float, float, int]:
    """(aggregate tokens/s, mean seconds between streamed tokens, tokens)."""
    gaps: list[float] = []

    async def one(seed: int) -> int:
        last, count = time.perf_counter(), 0
        req = Request(prompt, SamplingParams(temperature=0.7, seed=seed, max_tokens=tokens, ignore_eos=True))
        async for ev in engine.generate(req):
            if isinstance(ev, Delta) and ev.token_ids:
                now = time.perf_counter()
                gaps.append((now - last) / len(ev.token_ids))
                last, count = now, count + len(ev.token_ids)
            elif isinstance(ev, Final):
                return len(ev.token_ids)
        return count
    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t
    return sum(counts) / wall, statistics.mean(gaps), sum(counts)


def measure(engine: Any, prompt: list[int], levels: list[int], tokens: int, repeats: int) -> dict[int, dict]:
    asyncio.run(load(engine, prompt, 2, 8))  # warm-up
    out = {}
    for n in levels:
        runs = [asyncio.run(load(engine, prompt, n, tokens)) for _ in range(repeats)]
        out[n] = {"tok_s": statistics.median(r[0] for r in runs), "token_latency_ms": statistics.median(r[1] for r in runs) * 1000}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.triton", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from server.embedded.engine import EmbeddedEngine
    from server.triton.engine import TritonEngine

    levels = [int(x) for x in args.levels.split(",")]
    direct = EmbeddedEngine.from_dir(args.engine)
    prompt = direct.tokenize(direct.chat_prompt("What is the sum of the first 20 primes?"))
    print(f"[bench] direct embedded engine, {args.tokens} tokens per request, median of {args.repeats}", file=sys.stderr)
    try:
        base = measure(direct, prompt, levels, args.tokens, args.repeats)
    finally:
        direct.shutdown()
    grpc, http, metrics = free_port(), free_port(), free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "server.programs.triton_embedded", "--engine", str(args.engine),
                             "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        engine = TritonEngine(f"localhost:{grpc}", str(args.engine / "model" if (args.engine / "model").is_dir()
                                                         else args.engine), connect_timeout=300)
        startup = time.monotonic() - t0
        print(f"[bench] Triton server ready in {startup:.1f}s", file=sys.stderr)
        via = measure(engine, prompt, levels, args.tokens, args.repeats)
        engine.shutdown()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rows = [{"concurrent": n, "direct_tok_s": round(base[n]["tok_s"], 1), "triton_tok_s": round(via[n]["tok_s"], 1),
             "throughput_ratio": round(via[n]["tok_s"] / base[n]["tok_s"], 3),
             "direct_token_ms": round(base[n]["token_latency_ms"], 2),
             "triton_token_ms": round(via[n]["token_latency_ms"], 2),
             "latency_ratio": round(via[n]["token_latency_ms"] / base[n]["token_latency_ms"], 3)} for n in levels]
    print(f"Triton (PyTriton tritonserver, gRPC streaming) vs the embedded engine directly; server startup "
          f"{startup:.1f}s")
    print(f"{'concurrent':>10} {'direct tok/s':>12} {'triton tok/s':>12} {'ratio':>6} {'direct ms/tok':>13} "
          f"{'triton ms/tok':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrent']:>10} {r['direct_tok_s']:>12} {r['triton_tok_s']:>12} {r['throughput_ratio']:>6} "
              f"{r['direct_token_ms']:>13} {r['triton_token_ms']:>13} {r['latency_ratio']:>6}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"startup_seconds": round(startup, 2), "tokens": args.tokens,
                                        "repeats": args.repeats, "rows": rows}, indent=2))
        print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

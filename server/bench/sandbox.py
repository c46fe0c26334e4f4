"""Sandbox benchmark: per-cell latency and throughput, measured side by side in one run.

    python -m server.bench.sandbox [--cells 200] [--out bench/sandbox.json]

Latency (median, p90) of one small cell through: the warm pool (fork from a preimported worker),
a stateful session, a fresh isolated worker per cell (what a harness without a pool pays), and a
fresh plain `python -c` per cell (no isolation, no preimports). Throughput: cells/s through the
pool at 1, 8 and 32 concurrent callers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sandbox import SandboxConfig, SandboxPool
from sandbox.pool import SLOTS
from sandbox.worker import Worker

CELL = "print(sum(i * i for i in range(1000)))"


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))], "n": len(s)}


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run(cells: int) -> dict:
    config = SandboxConfig()
    pool = SandboxPool(config)
    results: dict = {"machine": {"cpus": os.cpu_count(), "isolation": pool.isolation_reason, "pool_size": pool.size},
                     "latency": {}, "throughput": {}}
    try:
        for _ in range(10):
            pool.run(CELL)  # warm-up
        results["latency"]["warm pool"] = _stats(_timed(lambda: pool.run(CELL), cells))
        with pool.session() as s:
            results["latency"]["stateful session"] = _stats(_timed(lambda: s.run(CELL), cells))

        slot = SLOTS.take()  # a uid of its own, like any worker

        def fresh_worker() -> None:
            w = Worker(config, pool.mechanism, slot=slot)
            w.request({"op": "run", "code": CELL, "timeout": 10}, 10)
            w.close()

        results["latency"]["fresh isolated worker"] = _stats(_timed(fresh_worker, max(5, cells // 20)))
        SLOTS.give(slot)
        fresh = lambda: subprocess.run([sys.executable, "-I", "-c", CELL], capture_output=True, check=True)  # noqa: E731
        results["latency"]["fresh python -c"] = _stats(_timed(fresh, max(10, cells // 4)))

        async def burst(callers: int, total: int) -> float:
            sem = asyncio.Semaphore(callers)

            async def one() -> None:
                async with sem:
                    r = await pool.arun(CELL)
                    assert r.status == "ok", r

            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(total)))
            return total / (time.perf_counter() - t)

        for callers in (1, 8, 32):
            rates = [asyncio.run(burst(callers, max(callers * 4, cells // 2))) for _ in range(3)]
            results["throughput"][f"{callers} callers"] = {"cells_per_s": statistics.median(rates)}
    finally:
        pool.close()
    base = results["latency"]["warm pool"]["median_ms"]
    for k, v in results["latency"].items():
        v["vs_warm_pool"] = v["median_ms"] / base
    return results


def table(results: dict) -> str:
    m = results["machine"]
    lines = [f"sandbox bench ({m['cpus']} CPUs, pool of {m['pool_size']}, {m['isolation']})",
             f"{'cell latency':<24}{'median ms':>10}{'p90 ms':>10}{'x warm':>8}"]
    for k, v in results["latency"].items():
        lines.append(f"{k:<24}{v['median_ms']:>10.2f}{v['p90_ms']:>10.2f}{v['vs_warm_pool']:>8.1f}")
    lines.append(f"{'pool throughput':<24}{'cells/s':>10}")
    for k, v in results["throughput"].items():
        lines.append(f"{k:<24}{v['cells_per_s']:>10.0f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--out", default="bench/sandbox.json")
    args = ap.parse_args()
    results = run(args.cells)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

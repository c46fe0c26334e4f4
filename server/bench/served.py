"""Served vs direct: what the Triton and OpenAI overhead benchmarks share (not a program itself).

Both put the same load on the engine in this process and then through a server program on the same
weights, and report the ratios: the price of the server. Here: the load (n concurrent streamed
requests, end of sequence ignored, seeded sampling), its median over repeats, and the server run
(its own process group, killed with its children on the way out, whatever happens).
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
from typing import Any, Callable, Optional, Sequence

from aimo_spec.protocol import Delta, Final, Request, SamplingParams
from server.tables import format_table

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the sum of the first 20 primes?"


def arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The options both benchmarks take; each adds its own."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--engine", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--out", type=Path, default=None)
    return ap


async def load(engine: Any, prompt: list[int], n: int, tokens: int) -> dict[str, float]:
    """n requests at once: aggregate tokens/s; mean ms between streamed tokens after each stream's first
    delta (token_ms) and counting the wait for the first delta too, spread over its tokens
    (stream_token_ms); mean time to the first token (ttft_ms)."""
    gaps: list[float] = []
    first_gaps: list[float] = []
    firsts: list[float] = []

    async def one(seed: int) -> int:
        t0 = last = time.perf_counter()
        count = 0
        req = Request(prompt, SamplingParams(temperature=0.7, seed=seed, max_tokens=tokens, ignore_eos=True))
        async for ev in engine.generate(req):
            if isinstance(ev, Delta) and ev.token_ids:
                now = time.perf_counter()
                gap = (now - last) / len(ev.token_ids)
                if count == 0:
                    firsts.append(now - t0)
                    first_gaps.append(gap)
                else:
                    gaps.append(gap)
                last, count = now, count + len(ev.token_ids)
            elif isinstance(ev, Final):
                return len(ev.token_ids)
        return count
    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t
    return {"tok_s": sum(counts) / wall, "token_ms": statistics.mean(gaps) * 1000 if gaps else float("nan"),
            "stream_token_ms": statistics.mean(gaps + first_gaps) * 1000, "ttft_ms": statistics.mean(firsts) * 1000}


def measure(engine: Any, prompt: list[int], levels: list[int], tokens: int, repeats: int) -> dict[int, dict]:
    """Per concurrency level, the median of each figure of `load` over `repeats` runs (after a warm-up)."""
    asyncio.run(load(engine, prompt, 2, 8))  # warm-up
    out = {}
    for n in levels:
        runs = [asyncio.run(load(engine, prompt, n, tokens)) for _ in range(repeats)]
        out[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_direct(direct: Any, label: str, levels: list[int], tokens: int, repeats: int
                   ) -> tuple[list[int], dict[int, dict]]:
    """The engine in this process (shut down after): the benchmark's prompt and its figures."""
    prompt = direct.tokenize(direct.chat_prompt(QUESTION))
    print(f"[bench] {label}, {tokens} tokens per request, median of {repeats}", file=sys.stderr)
    try:
        return prompt, measure(direct, prompt, levels, tokens, repeats)
    finally:
        direct.shutdown()


def measure_served(program: list[str], connect: Callable[[], Any], ready: Callable[[Any, float], str],
                   prompt: list[int], levels: list[int], tokens: int, repeats: int) -> tuple[dict[int, dict], float]:
    """`python -m <program...>` started here, `connect()`ed to (waiting until it serves), measured, killed:
    its figures and its startup seconds (process start to ready, model load included)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", *program], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        engine = connect()
        startup = time.monotonic() - t0
        print(f"[bench] {ready(engine, startup)}", file=sys.stderr)
        via = measure(engine, prompt, levels, tokens, repeats)
        engine.shutdown()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return via, startup


# (row name, figure of `load`, digits, name of the served/direct ratio or None)
Measure = tuple[str, str, int, Optional[str]]
HEADERS = {"tok_s": "tok/s", "token_ms": "ms/tok", "ttft_ms": "TTFT ms"}


def side_by_side(levels: list[int], direct: dict[int, dict], served: dict[int, dict], name: str,
                 measures: Sequence[Measure]) -> list[dict[str, Any]]:
    """One row a concurrency level: each measure direct and served (`name`), and their ratio."""
    rows = []
    for n in levels:
        row: dict[str, Any] = {"concurrent": n}
        for what, figure, digits, ratio in measures:
            row[f"direct_{what}"] = round(direct[n][figure], digits)
            row[f"{name}_{what}"] = round(served[n][figure], digits)
            if ratio:
                row[ratio] = round(served[n][figure] / direct[n][figure], 3)
        rows.append(row)
    return rows


def report(args: argparse.Namespace, title: str, name: str, measures: Sequence[Measure], rows: list[dict[str, Any]],
           record: dict[str, Any]) -> None:
    """The table on stdout; with --out, `record` and the rows as JSON."""
    columns = [("concurrent", "concurrent", ">10")]
    for what, _, _, ratio in measures:
        for side in ("direct", name):
            header = f"{side} {HEADERS[what]}"
            columns.append((header, f"{side}_{what}", f">{max(len(header), 6)}"))
        if ratio:
            columns.append(("ratio", ratio, ">6"))
    print(title)
    print(format_table(rows, columns))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**record, "tokens": args.tokens, "repeats": args.repeats,
                                        "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
        print(f"[bench] wrote {args.out}", file=sys.stderr)

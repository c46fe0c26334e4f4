"""OpenAI-serving overhead: the same load through `make serve` (HTTP, SSE) and on the engine in process.

    python -m server.bench.openai --engine engines/mix/build/embedded --out bench/openai.json

For 1, 4 and 8 concurrent requests of `--tokens` tokens each (end of sequence ignored, seeded
sampling), median of `--repeats`: aggregate tokens/s, mean per-token latency (time between streamed
tokens) and time to first token, first on the embedded engine in this process, then through the
OpenAI-compatible server on the same weights, driven by the `openai` backend (what the solver
uses: token-id prompts, ids back, one connection pool). The ratios are the price of the HTTP layer,
client included. Also the server's startup (process start to ready, model load included).
`--engine` takes an engine folder or an HF checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from server.bench.served import arguments, free_port, measure_direct, measure_served


def open_direct(folder: Path, threads: Optional[int]) -> Any:
    from server.backends import driver, open_engine

    kw = {"threads": threads} if threads else {}
    return open_engine(folder, **kw) if (folder / "engine.json").is_file() else driver("embedded").from_dir(folder, **kw)


def tokenizer_dir(folder: Path) -> Path:
    if (folder / "engine.json").is_file():
        return folder / json.loads((folder / "engine.json").read_text()).get("model_dir", "model")
    return folder


def main(argv: Optional[list[str]] = None) -> int:
    ap = arguments("python -m server.bench.openai", __doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both engines (default: the engine's)")
    args = ap.parse_args(argv)
    from server.openai.engine import OpenAIEngine

    if not (args.engine / "engine.json").is_file() and not (args.engine / "config.json").is_file():
        print(f"bench.openai: {args.engine}: no engine folder or HF checkpoint; run `make engine` first", file=sys.stderr)
        return 2
    levels = [int(x) for x in args.levels.split(",")]
    direct = open_direct(args.engine, args.threads)
    prompt, base = measure_direct(direct, "the engine in process", levels, args.tokens, args.repeats)
    port = free_port()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server below is killed on the way out
    program = ["server.programs.serve", "--engine", str(args.engine), "--port", str(port),
               *(["--threads", str(args.threads)] if args.threads else [])]

    def connect() -> Any:
        return OpenAIEngine(f"http://127.0.0.1:{port}/v1", str(tokenizer_dir(args.engine)), connect_timeout=300)
    via, startup = measure_served(program, connect, lambda engine, s: f"server ready in {s:.1f}s: {engine.describe()}",
                                  prompt, levels, args.tokens, args.repeats)
    rows = [{"concurrent": n, "direct_tok_s": round(base[n]["tok_s"], 1), "http_tok_s": round(via[n]["tok_s"], 1),
             "throughput_ratio": round(via[n]["tok_s"] / base[n]["tok_s"], 3),
             "direct_token_ms": round(base[n]["token_ms"], 2), "http_token_ms": round(via[n]["token_ms"], 2),
             "latency_ratio": round(via[n]["token_ms"] / base[n]["token_ms"], 3),
             "direct_ttft_ms": round(base[n]["ttft_ms"], 1), "http_ttft_ms": round(via[n]["ttft_ms"], 1)} for n in levels]
    print(f"make serve (OpenAI HTTP + SSE, driven by the openai backend) vs the engine in process; "
          f"server startup {startup:.1f}s; {os.cpu_count()} CPU cores")
    print(f"{'concurrent':>10} {'direct tok/s':>12} {'http tok/s':>10} {'ratio':>6} {'direct ms/tok':>13} "
          f"{'http ms/tok':>11} {'ratio':>6} {'direct TTFT ms':>14} {'http TTFT ms':>12}")
    for r in rows:
        print(f"{r['concurrent']:>10} {r['direct_tok_s']:>12} {r['http_tok_s']:>10} {r['throughput_ratio']:>6} "
              f"{r['direct_token_ms']:>13} {r['http_token_ms']:>11} {r['latency_ratio']:>6} {r['direct_ttft_ms']:>14} "
              f"{r['http_ttft_ms']:>12}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"startup_seconds": round(startup, 2), "tokens": args.tokens, "repeats": args.repeats,
                                        "threads": args.threads,
                                        "engine": str(args.engine), "machine": f"{os.cpu_count()} CPU cores",
                                        "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
        print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

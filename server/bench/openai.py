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
from pathlib import Path
from typing import Any, Optional

from server.bench.served import arguments, free_port, measure_direct, measure_served, report, side_by_side


def open_direct(folder: Path, threads: Optional[int]) -> Any:
    from server.backends import driver, open_engine

    kw = {"threads": threads} if threads else {}
    if (folder / "engine.json").is_file():
        return open_engine(folder, **kw)
    return driver("embedded").from_dir(folder, **kw)


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
        print(f"bench.openai: {args.engine}: no engine folder or HF checkpoint; run `make engine` first",
              file=sys.stderr)
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
    measures = [("tok_s", "tok_s", 1, "throughput_ratio"), ("token_ms", "token_ms", 2, "latency_ratio"),
                ("ttft_ms", "ttft_ms", 1, None)]
    report(args, f"make serve (OpenAI HTTP + SSE, driven by the openai backend) vs the engine in process; "
                 f"server startup {startup:.1f}s; {os.cpu_count()} CPU cores", "http", measures,
           side_by_side(levels, base, via, "http", measures),
           {"startup_seconds": round(startup, 2), "threads": args.threads, "engine": str(args.engine),
            "machine": f"{os.cpu_count()} CPU cores"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

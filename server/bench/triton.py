"""Triton overhead: the same load through a real Triton server (gRPC streaming) and on the engine directly.

    python -m server.bench.triton --engine engines/mix/build/embedded --out bench/triton.json

Runs in the Triton environment. For 1, 4 and 8 concurrent requests of `--tokens` tokens each (end of
sequence ignored), median of `--repeats`: aggregate tokens/s and mean per-token latency (time between
streamed tokens) on the embedded engine in this process, then through `make triton`'s server on the
same weights; the ratios are the price of the server. Also the server's startup time (process start
to ready, model load included).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from server.bench.served import arguments, free_port, measure_direct, measure_served, report, side_by_side


def main(argv: Optional[list[str]] = None) -> int:
    args = arguments("python -m server.bench.triton", __doc__.splitlines()[0]).parse_args(argv)
    from server.embedded.engine import EmbeddedEngine
    from server.triton.engine import TritonEngine

    levels = [int(x) for x in args.levels.split(",")]
    direct = EmbeddedEngine.from_dir(args.engine)
    prompt, base = measure_direct(direct, "direct embedded engine", levels, args.tokens, args.repeats)
    grpc, http, metrics = free_port(), free_port(), free_port()
    program = ["server.programs.triton_embedded", "--engine", str(args.engine), "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", str(metrics)]

    def connect() -> Any:
        return TritonEngine(f"localhost:{grpc}", str(args.engine / "model" if (args.engine / "model").is_dir()
                                                     else args.engine), connect_timeout=300)
    via, startup = measure_served(program, connect, lambda engine, s: f"Triton server ready in {s:.1f}s",
                                  prompt, levels, args.tokens, args.repeats)
    measures = [("tok_s", "tok_s", 1, "throughput_ratio"), ("token_ms", "stream_token_ms", 2, "latency_ratio")]
    report(args, f"Triton (PyTriton tritonserver, gRPC streaming) vs the embedded engine directly; server startup "
                 f"{startup:.1f}s", "triton", measures, side_by_side(levels, base, via, "triton", measures),
           {"startup_seconds": round(startup, 2), "engine": str(args.engine)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

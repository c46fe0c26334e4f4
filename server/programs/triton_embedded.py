"""The embedded engine behind a real Triton Inference Server (the tritonserver PyTriton bundles; CPU-only).

    python -m server.programs.triton_embedded --engine engines/mix/build/embedded [--recipe engines/mix.yaml] \
        [--grpc-port 8001 ...]

`make triton MODEL=mix` runs it; the server itself: server/triton/embedded_server.py. Runs in the
Triton environment (.venv-triton); SIGTERM or SIGHUP stops tritonserver too, then the process.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Optional

from aimo_spec.recipe import RecipeError, load_recipe
from server.embedded.settings import serving_settings
from server.triton.embedded_server import serve


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.triton_embedded", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, type=Path, help="an embedded engine folder (build/embedded/)")
    ap.add_argument("--recipe", type=Path, default=None,
                    help="the recipe whose serving settings the engine runs with (default: the defaults)")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    args = ap.parse_args(argv)
    if not (args.engine / "engine.json").is_file() and not (args.engine / "config.json").is_file():
        print(f"triton: {args.engine}: no embedded engine; run `make engine` first", file=sys.stderr)
        return 2
    try:
        serving = serving_settings(load_recipe(args.recipe, check_paths=False) if args.recipe else None)
    except (RecipeError, ValueError) as e:
        print(f"triton: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through Triton's context: tritonserver stops too
        signal.signal(sig, lambda *_: sys.exit(0))
    serve(args.engine, args.grpc_port, args.http_port, args.metrics_port,
          log=lambda m: print(m, file=sys.stderr, flush=True), serving=serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())

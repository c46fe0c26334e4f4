"""`make triton MODEL=... BACKEND=trtllm`: the tensorrtllm_backend repository for the built engine, and its launch.

    python -m server.programs.triton_deploy --recipe engines/mix.yaml --out engines/mix/triton [--launch]

Writes the model repository (server/triton/repository.py) and prints the tritonserver command (one
MPI rank per GPU for tp > 1); with --launch it runs it (on the GPU host, in NVIDIA's Triton
TensorRT-LLM container). `make solve BACKEND=triton` then solves through it unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from aimo_spec.recipe import RecipeError, load_recipe
from server.triton.repository import launch_command, make_repository


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.triton_deploy", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--templates", type=Path, default=None, help="tensorrtllm_backend all_models/inflight_batcher_llm")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--launch", action="store_true", help="run tritonserver after writing the repository")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, check_paths=False)  # the built engine, not the sources
        engine_dir = recipe.layout.engine("trtllm")
        if not (engine_dir / "engine.json").is_file():
            raise FileNotFoundError(f"{engine_dir}/engine.json: no TensorRT-LLM engine; run "
                                    f"`make engine MODEL={recipe.name} BACKEND=trtllm` first")
        report = make_repository(engine_dir, args.out, args.templates)
    except (RecipeError, FileNotFoundError, ValueError) as e:
        print(f"triton: {e}", file=sys.stderr)
        return 2
    cmd = launch_command(args.out.resolve(), recipe.build.tp_size, args.grpc_port, args.http_port, args.metrics_port)
    print(f"[triton] model repository: {args.out} (templates {report['templates']})", file=sys.stderr)
    for model, r in report["models"].items():
        print(f"[triton]   {model}: {len(r['filled'])} keys filled, {len(r['backend_defaults'])} at the backend's "
              "defaults", file=sys.stderr)
    print(shlex.join(cmd))
    if args.launch:
        os.execvp(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How a trtllm process is started: plain for tp = 1, under `mpirun -n <tp>` (MPI leader mode) above.

    python -m server.programs.trtllm_launch --tp 2 -- python -m server.programs.solve --recipe ... --backend trtllm
    python -m server.programs.trtllm_launch --recipe engines/mix.yaml -- ...   (tp from build.tp_size)

prints (with --print) or runs the command. Every rank opens the engine; rank 0 serves and the
others wait inside the executor until it shuts down (`TrtllmEngine.from_dir`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional


def mpirun_command(tp_size: int, argv: list[str], as_root: Optional[bool] = None) -> list[str]:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1 (got {tp_size})")
    if tp_size == 1:
        return list(argv)
    as_root = (os.geteuid() == 0) if as_root is None else as_root
    return ["mpirun", "-n", str(tp_size), *(["--allow-run-as-root"] if as_root else []), "--oversubscribe", *argv]


def main(args: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.trtllm_launch", description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--tp", type=int, help="tensor parallel size")
    group.add_argument("--recipe", help="take the tensor parallel size from this recipe's build.tp_size")
    ap.add_argument("--print", action="store_true", help="print the command instead of running it")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    ns = ap.parse_args(args)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        ap.error("give the command to launch after --")
    if ns.recipe:
        from aimo_spec.recipe import RecipeError, load_recipe

        try:
            ns.tp = load_recipe(ns.recipe, check_paths=False).build.tp_size
        except RecipeError as e:
            print(f"launch: {e}", file=sys.stderr)
            return 2
    full = mpirun_command(ns.tp, cmd)
    if ns.print:
        print(" ".join(full))
        return 0
    if ns.tp > 1 and shutil.which("mpirun") is None:
        print("launch: tp > 1 needs mpirun (OpenMPI; NVIDIA's TensorRT-LLM container has it)", file=sys.stderr)
        return 2
    os.execvp(full[0], full)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

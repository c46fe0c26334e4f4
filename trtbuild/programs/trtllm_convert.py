"""HF checkpoint -> TensorRT-LLM checkpoint, bf16 or int8 weight-only (W8A16); runs in TensorRT-LLM's env.

    $TRTLLM_PYTHON -m trtbuild.programs.trtllm_convert --model_dir M --output_dir C --tp_size 2 --quant_algo W8A16

The build stage runs it (trtbuild/trtllm/build.py); the conversion itself: trtbuild/trtllm/convert.py.
Only the standard library is imported before tensorrt_llm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from trtbuild.trtllm.convert import QUANT_ALGOS, convert


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.programs.trtllm_convert", description=__doc__.splitlines()[0])
    ap.add_argument("--model_dir", required=True, type=Path)
    ap.add_argument("--output_dir", required=True, type=Path)
    ap.add_argument("--tp_size", type=int, default=1)
    ap.add_argument("--quant_algo", choices=QUANT_ALGOS, default="none")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = ap.parse_args(argv)
    try:
        convert(args.model_dir, args.output_dir, args.tp_size, args.quant_algo, args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HF checkpoint -> TensorRT-LLM checkpoint, bf16 or int8 weight-only (W8A16); runs in TensorRT-LLM's env.

    $TRTLLM_PYTHON -m trtbuild.trtllm.convert --model_dir M --output_dir C --tp_size 2 --quant_algo W8A16

Weight-only int8 needs no calibration: the model class converts and quantizes the HF weights itself
(`from_hugging_face(..., quant_config=QuantConfig(quant_algo=W8A16))`), one rank at a time, and
rank 0 writes config.json. Only the standard library is imported before tensorrt_llm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from trtbuild.trtllm.preflight import MODEL_CLASSES

QUANT_ALGOS = ("none", "W8A16")


def convert(model_dir: Path, output_dir: Path, tp_size: int, quant_algo: str, dtype: str = "bfloat16") -> dict:
    import tensorrt_llm.models as models
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    hf_config = json.loads((model_dir / "config.json").read_text())
    arch = (hf_config.get("architectures") or [""])[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(f"{model_dir}/config.json: architecture {arch!r} is not supported ({', '.join(MODEL_CLASSES)})")
    cls = getattr(models, MODEL_CLASSES[arch])
    quant = QuantConfig(quant_algo=QuantAlgo.W8A16) if quant_algo == "W8A16" else QuantConfig()
    output_dir.mkdir(parents=True, exist_ok=True)
    seconds = []
    for rank in range(tp_size):
        t = time.time()
        mapping = Mapping(world_size=tp_size, rank=rank, tp_size=tp_size)
        model = cls.from_hugging_face(str(model_dir), dtype=dtype, mapping=mapping, quant_config=quant)
        model.save_checkpoint(str(output_dir), save_config=(rank == 0))
        del model
        seconds.append(round(time.time() - t, 2))
        print(f"[convert] rank {rank}/{tp_size}: {MODEL_CLASSES[arch]} {quant_algo} in {seconds[-1]}s", flush=True)
    return {"model_class": MODEL_CLASSES[arch], "quant_algo": quant_algo, "tp_size": tp_size, "seconds": seconds}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.trtllm.convert", description=__doc__.splitlines()[0])
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

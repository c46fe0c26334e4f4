"""HF checkpoint -> TensorRT-LLM checkpoint, bf16 or int8 weight-only (W8A16); runs in TensorRT-LLM's env.

    $TRTLLM_PYTHON -m trtbuild.programs.trtllm_convert --model_dir M --output_dir C --tp_size 2 --quant_algo W8A16

Weight-only int8 needs no calibration: the model class converts and quantizes the HF weights itself
(`from_hugging_face(..., quant_config=QuantConfig(quant_algo=W8A16, exclude_modules=[...]))`), one rank
at a time, and rank 0 writes config.json. The exclusion list is explicit because ReDrafter's converter
adds the drafter to `exclude_modules` only when it is a list: with None, trtllm-build would quantize
the drafter's linears and stop for lack of their scales. Only the standard library is imported before
tensorrt_llm.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from trtbuild.trtllm.preflight import MODEL_CLASSES

QUANT_ALGOS = ("none", "W8A16")
# What TensorRT-LLM's quantize_layers excludes when exclude_modules is None (tensorrt_llm/quantization/
# quantize.py); an explicit list must keep these out of quantization too. tests/upstream pins it.
DEFAULT_EXCLUDE_MODULES = ("*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                           "*shared_expert_gate", "*fused_a")


def quant_config_kwargs(quant_algo: str) -> dict:
    """QuantConfig's arguments: W8A16 with the explicit default exclusions, or no quantization."""
    if quant_algo != "W8A16":
        return {}
    return {"quant_algo": "W8A16", "exclude_modules": list(DEFAULT_EXCLUDE_MODULES)}


def ensure_exclusion_list(config_path: Path) -> bool:
    """Make a quantized checkpoint's `quantization.exclude_modules` an explicit list (the defaults) where
    it is null, so the ReDrafter converter can add the drafter to it; True when the file changed."""
    config = json.loads(config_path.read_text())
    quant = config.get("quantization") or {}
    if not (quant.get("quant_algo") or quant.get("kv_cache_quant_algo")) or quant.get("exclude_modules") is not None:
        return False
    quant["exclude_modules"] = list(DEFAULT_EXCLUDE_MODULES)
    config["quantization"] = quant
    config_path.write_text(json.dumps(config, indent=4))
    return True


def convert(model_dir: Path, output_dir: Path, tp_size: int, quant_algo: str, dtype: str = "bfloat16") -> dict:
    import tensorrt_llm.models as models
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    hf_config = json.loads((model_dir / "config.json").read_text())
    arch = (hf_config.get("architectures") or [""])[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(f"{model_dir}/config.json: architecture {arch!r} is not supported "
                         f"({', '.join(MODEL_CLASSES)})")
    cls = getattr(models, MODEL_CLASSES[arch])
    kw = quant_config_kwargs(quant_algo)
    if kw:
        kw["quant_algo"] = QuantAlgo.W8A16
    quant = QuantConfig(**kw)
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

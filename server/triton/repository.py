"""A tensorrtllm_backend model repository for a built TensorRT-LLM engine, and its launch command.

tensorrtllm_backend ships the model templates (`all_models/inflight_batcher_llm/{preprocessing,
tensorrt_llm,postprocessing,ensemble,tensorrt_llm_bls}`, with `${key}` placeholders, and the
pre/post-processing model.py files); NVIDIA's Triton TensorRT-LLM container has them under
/app/all_models. `make_repository` copies those templates and fills them from the recipe and the
engine's `engine.json`, with the keys upstream's `tools/fill_template.py` always fills (`max_queue_size`,
`max_queue_delay_microseconds`: 0). It then reads the filled text: a `${...}` left outside a string (a
queue size, a data type) makes config.pbtxt unparseable, and one left inside a string must be a
parameter the toolkit deliberately leaves to the backend's default (`BACKEND_DEFAULTS`); anything else
fails naming the file and key, since the templates then belong to another backend version. What was
filled and what was left is recorded in `repository.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

TEMPLATES_ENV = "TRTLLM_BACKEND_MODELS"  # .../all_models/inflight_batcher_llm of tensorrtllm_backend v1.2.x
DEFAULT_TEMPLATES = ("/app/all_models/inflight_batcher_llm",)
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# keys each model's template must have (the ones that decide how the engine is served)
REQUIRED = {
    "tensorrt_llm": ("triton_max_batch_size", "decoupled_mode", "engine_dir", "batching_strategy",
                     "kv_cache_free_gpu_mem_fraction", "enable_kv_cache_reuse", "exclude_input_in_output",
                     "max_queue_delay_microseconds"),
    "preprocessing": ("tokenizer_dir", "triton_max_batch_size"),
    "postprocessing": ("tokenizer_dir", "triton_max_batch_size"),
    "ensemble": ("triton_max_batch_size",),
    "tensorrt_llm_bls": ("triton_max_batch_size", "decoupled_mode"),
}
# tools/fill_template.py substitutes these in every template unless told otherwise
FILL_TEMPLATE_DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}
# string parameters left as "${key}": the backend (or its python model) reads each with a fallback
BACKEND_DEFAULTS = {
    "tensorrt_llm": frozenset((
        "encoder_engine_dir", "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length",
        "batch_scheduler_policy", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks",
        "enable_trt_overlap", "stats_check_period_ms", "iter_stats_max_iterations", "request_stats_max_iterations",
        "normalize_log_probs", "gpu_device_ids", "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size",
        "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes",
        "lora_prefetch_dir", "decoding_mode", "lookahead_window_size", "lookahead_ngram_size",
        "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
        "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
        "speculative_decoding_fast_logits", "guided_decoding_backend", "xgrammar_tokenizer_info_path")),
    "preprocessing": frozenset(("multimodal_model_path", "max_num_images", "hf_model_path")),
    "postprocessing": frozenset(),
    "ensemble": frozenset(),
    "tensorrt_llm_bls": frozenset(("multimodal_encoders_name",)),
}


def templates_dir() -> Optional[Path]:
    for p in ([os.environ[TEMPLATES_ENV]] if os.environ.get(TEMPLATES_ENV) else []) + list(DEFAULT_TEMPLATES):
        if all((Path(p) / m / "config.pbtxt").is_file() for m in MODELS[:4]):
            return Path(p)
    return None


def values(engine_dir: Path, spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The placeholder values per model, from engine.json (what the build decided: limits, files, the trtllm
    section)."""
    t, limits = spec.get("trtllm") or {}, spec["limits"]
    tokenizer = str((engine_dir / spec.get("model_dir", "model")).resolve())
    engine = str((engine_dir / spec.get("engine_dir", "engine")).resolve())
    batch = str(limits["max_batch_size"])
    queue = {"max_queue_size": str(t.get("max_queue_size", 0)),
             "max_queue_delay_microseconds": str(t.get("max_queue_delay_microseconds", 0))}
    common = {**FILL_TEMPLATE_DEFAULTS, "triton_max_batch_size": batch, "logits_datatype": "TYPE_FP32",
              "prompt_embedding_table_data_type": "TYPE_FP16"}  # the backend docs' value
    trt = {
        **common, **queue, "triton_backend": "tensorrtllm", "decoupled_mode": "true",  # streaming needs decoupled
        "engine_dir": engine, "tokenizer_dir": tokenizer,
        "batching_strategy": "inflight_fused_batching", "max_beam_width": "1",
        "kv_cache_free_gpu_mem_fraction": str(t.get("kv_cache_free_gpu_mem_fraction", 0.9)),
        "enable_kv_cache_reuse": str(bool(t.get("enable_kv_cache_reuse", True))).lower(),
        "enable_chunked_context": str(bool(t.get("enable_chunked_context", True))).lower(),
        "exclude_input_in_output": "true", "cancellation_check_period_ms": "100",
        "encoder_input_features_data_type": "TYPE_FP16",
    }
    if t.get("gpu_device_ids"):
        trt["gpu_device_ids"] = ",".join(str(i) for i in t["gpu_device_ids"])
    if spec.get("drafter"):
        trt["decoding_mode"] = "redrafter"  # also detected from the engine; said explicitly
    return {
        "tensorrt_llm": trt,
        # prompts arrive chat-formatted with their special tokens: add none
        "preprocessing": {**common, **queue, "tokenizer_dir": tokenizer, "add_special_tokens": "false",
                          "preprocessing_instance_count": "1", "engine_dir": engine},
        "postprocessing": {**common, "tokenizer_dir": tokenizer, "skip_special_tokens": "true",
                           "postprocessing_instance_count": "1"},
        "ensemble": dict(common),
        "tensorrt_llm_bls": {**common, "decoupled_mode": "true", "bls_instance_count": "1",
                             "accumulate_tokens": "false", "tensorrt_llm_model_name": "tensorrt_llm",
                             "tensorrt_llm_draft_model_name": ""},
    }


def fill(text: str, vals: dict[str, str]) -> tuple[str, list[str], list[str]]:
    """(filled text, keys filled, placeholders left for the backend's defaults)."""
    filled, left = [], []

    def sub(m: re.Match) -> str:
        key = m.group(1)
        if key in vals:
            filled.append(key)
            return vals[key]
        left.append(key)
        return m.group(0)
    return PLACEHOLDER.sub(sub, text), sorted(set(filled)), sorted(set(left))


def unfilled(text: str) -> tuple[list[str], list[str]]:
    """(placeholders left outside quotes, placeholders left inside a string), comment lines skipped."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    quoted = set(re.findall(r'"[^"\n]*\$\{(\w+)\}[^"\n]*"', body))
    left = set(PLACEHOLDER.findall(body))
    return sorted(left - quoted), sorted(left & quoted)


def check_filled(text: str, model: str, where: Path) -> list[str]:
    """The placeholders left to the backend's defaults; raise for any other `${...}` still in the text."""
    bare, in_strings = unfilled(text)
    if bare:
        raise ValueError(f"{where}: {', '.join('${' + k + '}' for k in bare)} left unfilled outside a string: "
                         "Triton could not parse this config.pbtxt (templates of another backend version?)")
    unknown = [k for k in in_strings if k not in BACKEND_DEFAULTS[model]]
    if unknown:
        raise ValueError(f"{where}: no value for {', '.join('${' + k + '}' for k in unknown)} and not a parameter "
                         "the toolkit leaves to the backend's default (templates of another backend version?)")
    return in_strings


def make_repository(engine_dir: Path, out: Path, templates: Optional[Path] = None) -> dict[str, Any]:
    """Copy the backend's templates to `out` and fill them for the engine in `engine_dir` (build/trtllm/)."""
    spec_file = engine_dir / "engine.json"
    spec = json.loads(spec_file.read_text())
    if spec.get("backend") != "trtllm":
        raise ValueError(f"{spec_file}: backend {spec.get('backend')!r}: the tensorrtllm_backend repository "
                         "serves TensorRT-LLM engines (for the embedded engine use `make triton`)")
    templates = templates or templates_dir()
    if templates is None:
        raise FileNotFoundError(f"tensorrtllm_backend model templates not found: set {TEMPLATES_ENV} to "
                                "<tensorrtllm_backend v1.2.x>/all_models/inflight_batcher_llm")
    vals = values(engine_dir, spec)
    report: dict[str, Any] = {"templates": str(templates), "models": {}}
    if out.exists():
        shutil.rmtree(out)
    for model in MODELS:
        src = templates / model
        if not src.is_dir():
            if model == "tensorrt_llm_bls":
                continue  # optional
            raise FileNotFoundError(f"{src}: missing from the templates")
        shutil.copytree(src, out / model)
        config = out / model / "config.pbtxt"
        text, filled, left = fill(config.read_text(), vals[model])
        missing = [k for k in REQUIRED[model] if k not in filled]
        if missing:
            raise ValueError(f"{src / 'config.pbtxt'}: no placeholder for {', '.join(missing)}: these templates "
                             "are not tensorrtllm_backend v1.2.x's")
        left = check_filled(text, model, src / "config.pbtxt")
        config.write_text(text)
        report["models"][model] = {"filled": {k: vals[model][k] for k in filled}, "backend_defaults": left}
    (out / "repository.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def launch_command(model_repo: Path, world_size: int, grpc_port: int = 8001, http_port: int = 8000,
                   metrics_port: int = 8002, tritonserver: str = "tritonserver") -> list[str]:
    """tritonserver for one GPU; for tensor parallelism one MPI rank per GPU (leader mode), each with its
    own python shared-memory prefix: rank 0 serves every model and the network endpoints, the other
    ranks load only tensorrt_llm, with HTTP, gRPC and metrics off."""
    def rank(i: int) -> list[str]:
        cmd = [tritonserver, f"--model-repository={model_repo}", "--disable-auto-complete-config",
               f"--backend-config=python,shm-region-prefix-name=prefix{i}_"]
        if i == 0:
            return cmd + [f"--grpc-port={grpc_port}", f"--http-port={http_port}", f"--metrics-port={metrics_port}"]
        return cmd + ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
                      "--model-control-mode=explicit", "--load-model=tensorrt_llm"]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    if world_size == 1:
        return rank(0)
    cmd = ["mpirun", "--allow-run-as-root"]
    for i in range(world_size):
        cmd += ["-n", "1", *rank(i)] + ([":"] if i < world_size - 1 else [])
    return cmd

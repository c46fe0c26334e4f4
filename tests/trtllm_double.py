"""A test double of the TensorRT-LLM 1.2.x surface this toolkit uses (tests only; contract tests).

`install(monkeypatch)` puts a fake `tensorrt_llm` package into sys.modules. Constructors take the
real keyword names (from the 1.2.x bindings and model classes) and no others, so a misspelt or
invented argument fails the test with TypeError. Calls are recorded in `CALLS`.

The fake `Executor` is a small in-flight batching simulator: a thread advances every running request
by one token per step from a script (prompt ids -> token ids), streams `Response`s the way the C++
executor does (only the new tokens, `is_final` with a `FinishReason`), honours `cancel_request`, and
can be told to fail a request or to die.

`FLAGS` lists the command-line flags of the three TensorRT-LLM commands the build runs, and
`FakeRunner` checks each command against them before "running" it (the convert step really runs
`trtbuild.trtllm.convert` in-process against the fake module).
"""

from __future__ import annotations

import enum
import json
import queue
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

CALLS: list[tuple[str, dict[str, Any]]] = []


# ------------------------------------------------------------------ tensorrt_llm.quantization / models
class QuantAlgo(str, enum.Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    FP8 = "FP8"
    INT8 = "INT8"


@dataclass
class QuantConfig:
    quant_algo: Optional[QuantAlgo] = None
    kv_cache_quant_algo: Optional[QuantAlgo] = None
    group_size: int = 128
    exclude_modules: Optional[list[str]] = None


@dataclass
class Mapping:
    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    cp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1


class _FakeModel:
    architecture = ""

    def __init__(self, hf_dir: str, dtype: str, mapping: Mapping, quant_config: QuantConfig):
        self.hf_dir, self.dtype, self.mapping, self.quant_config = hf_dir, dtype, mapping, quant_config

    @classmethod
    def from_hugging_face(cls, hf_model_or_dir: Any, dtype: str = "auto", mapping: Optional[Mapping] = None,
                          quant_config: Optional[QuantConfig] = None, **kwargs: Any) -> "_FakeModel":
        assert not kwargs, f"unexpected from_hugging_face kwargs {kwargs}"
        CALLS.append((f"{cls.__name__}.from_hugging_face", dict(hf_model_or_dir=hf_model_or_dir, dtype=dtype,
                                                                mapping=mapping, quant_config=quant_config)))
        return cls(hf_model_or_dir, dtype, mapping or Mapping(), quant_config or QuantConfig())

    def save_checkpoint(self, output_dir: str, save_config: bool = True) -> None:
        CALLS.append(("save_checkpoint", dict(output_dir=output_dir, save_config=save_config, rank=self.mapping.rank)))
        out = Path(output_dir)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"fake")
        if save_config:
            algo = self.quant_config.quant_algo
            (out / "config.json").write_text(json.dumps({
                "architecture": self.architecture, "dtype": self.dtype,
                "mapping": {"world_size": self.mapping.world_size, "tp_size": self.mapping.tp_size},
                "quantization": {"quant_algo": algo.value if algo else None}}))


class LLaMAForCausalLM(_FakeModel):
    architecture = "LlamaForCausalLM"


class QWenForCausalLM(_FakeModel):
    architecture = "Qwen2ForCausalLM"


# ------------------------------------------------------------------ tensorrt_llm.bindings.executor
class ModelType(enum.Enum):
    DECODER_ONLY = 0
    ENCODER_ONLY = 1
    ENCODER_DECODER = 2


class BatchingType(enum.Enum):
    STATIC = 0
    INFLIGHT = 1


class CommunicationType(enum.Enum):
    MPI = 0


class CommunicationMode(enum.Enum):
    LEADER = 0
    ORCHESTRATOR = 1


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class DecodingMode:
    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def ExplicitDraftTokens() -> "DecodingMode":  # noqa: N802 - the binding's name
        return DecodingMode("ExplicitDraftTokens")

    @staticmethod
    def TopKTopP() -> "DecodingMode":  # noqa: N802
        return DecodingMode("TopKTopP")

    def isExplicitDraftTokens(self) -> bool:  # noqa: N802
        return self.name == "ExplicitDraftTokens"


def _record(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    CALLS.append((name, kw))
    return kw


class _KwObject:
    """Holds its keyword arguments as attributes (like the bindings' read-write properties)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(_record(type(self).__name__, kw))


class DecodingConfig(_KwObject):
    def __init__(self, *, decoding_mode: Optional[DecodingMode] = None, lookahead_decoding_config: Any = None,
                 medusa_choices: Any = None, eagle_config: Any = None):
        super().__init__(decoding_mode=decoding_mode, lookahead_decoding_config=lookahead_decoding_config,
                         medusa_choices=medusa_choices, eagle_config=eagle_config)


class KvCacheConfig(_KwObject):
    def __init__(self, enable_block_reuse: bool = True, max_tokens: Optional[int] = None,
                 max_attention_window: Optional[list[int]] = None, sink_token_length: Optional[int] = None,
                 free_gpu_memory_fraction: Optional[float] = None, host_cache_size: Optional[int] = None,
                 onboard_blocks: bool = True, cross_kv_cache_fraction: Optional[float] = None,
                 secondary_offload_min_priority: Optional[int] = None, event_buffer_max_size: int = 0, *,
                 enable_partial_reuse: bool = True, copy_on_partial_reuse: bool = True, use_uvm: bool = False,
                 runtime_defaults: Any = None):
        super().__init__(enable_block_reuse=enable_block_reuse, max_tokens=max_tokens,
                         free_gpu_memory_fraction=free_gpu_memory_fraction, host_cache_size=host_cache_size)


class ParallelConfig(_KwObject):
    def __init__(self, communication_type: CommunicationType = CommunicationType.MPI,
                 communication_mode: CommunicationMode = CommunicationMode.LEADER,
                 device_ids: Optional[list[int]] = None, participant_ids: Optional[list[int]] = None,
                 orchestrator_config: Any = None, num_nodes: Optional[int] = None):
        super().__init__(communication_type=communication_type, communication_mode=communication_mode,
                         device_ids=device_ids, participant_ids=participant_ids)


class ExecutorConfig(_KwObject):
    def __init__(self, max_beam_width: int = 1, scheduler_config: Any = None, kv_cache_config: Any = None,
                 enable_chunked_context: bool = False, normalize_log_probs: bool = True,
                 iter_stats_max_iterations: int = 1000, request_stats_max_iterations: int = 0,
                 batching_type: BatchingType = BatchingType.INFLIGHT, max_batch_size: Optional[int] = None,
                 max_num_tokens: Optional[int] = None, parallel_config: Any = None, peft_cache_config: Any = None,
                 logits_post_processor_config: Any = None, decoding_config: Any = None,
                 use_gpu_direct_storage: bool = False, gpu_weights_percent: float = 1.0,
                 max_queue_size: Optional[int] = None, extended_runtime_perf_knob_config: Any = None,
                 debug_config: Any = None, recv_poll_period_ms: int = 0, max_seq_idle_microseconds: int = 0,
                 spec_dec_config: Any = None, guided_decoding_config: Any = None, additional_model_outputs: Any = None,
                 cache_transceiver_config: Any = None, gather_generation_logits: bool = False,
                 mm_embedding_offloading: bool = False, enable_trt_overlap: bool = False):
        super().__init__(max_beam_width=max_beam_width, kv_cache_config=kv_cache_config,
                         enable_chunked_context=enable_chunked_context, batching_type=batching_type,
                         max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, parallel_config=parallel_config,
                         decoding_config=decoding_config)


class SamplingConfig(_KwObject):
    def __init__(self, beam_width: int = 1, *, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 top_p_min: Optional[float] = None, top_p_reset_ids: Optional[int] = None,
                 top_p_decay: Optional[float] = None, seed: Optional[int] = None, temperature: Optional[float] = None,
                 min_tokens: Optional[int] = None, beam_search_diversity_rate: Optional[float] = None,
                 repetition_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
                 frequency_penalty: Optional[float] = None, length_penalty: Optional[float] = None,
                 early_stopping: Optional[int] = None, no_repeat_ngram_size: Optional[int] = None,
                 num_return_sequences: Optional[int] = None, min_p: Optional[float] = None,
                 beam_width_array: Optional[list[int]] = None):
        super().__init__(beam_width=beam_width, top_k=top_k, top_p=top_p, seed=seed, temperature=temperature)


class OutputConfig(_KwObject):
    def __init__(self, return_log_probs: bool = False, return_context_logits: bool = False,
                 return_generation_logits: bool = False, exclude_input_from_output: bool = False,
                 return_encoder_output: bool = False, return_perf_metrics: bool = False,
                 additional_model_outputs: Any = None):
        super().__init__(return_log_probs=return_log_probs, exclude_input_from_output=exclude_input_from_output,
                         return_perf_metrics=return_perf_metrics)


class Request(_KwObject):
    def __init__(self, input_token_ids: list[int], max_tokens: int, *, streaming: bool = False,
                 sampling_config: Optional[SamplingConfig] = None, output_config: Optional[OutputConfig] = None,
                 end_id: Optional[int] = None, pad_id: Optional[int] = None, position_ids: Any = None,
                 bad_words: Optional[list[list[int]]] = None, stop_words: Optional[list[list[int]]] = None,
                 embedding_bias: Any = None, external_draft_tokens_config: Any = None, prompt_tuning_config: Any = None,
                 multimodal_input: Any = None, multimodal_embedding: Any = None, mrope_config: Any = None,
                 lora_config: Any = None, lookahead_config: Any = None, kv_cache_retention_config: Any = None,
                 logits_post_processor_name: Any = None, logits_post_processor: Any = None,
                 encoder_input_token_ids: Any = None, client_id: Optional[int] = None,
                 return_all_generated_tokens: bool = False, priority: float = 0.5, type: Any = None,
                 context_phase_params: Any = None, encoder_input_features: Any = None, encoder_output_length: Any = None,
                 cross_attention_mask: Any = None, num_return_sequences: int = 1, eagle_config: Any = None,
                 skip_cross_attn_blocks: Any = None, guided_decoding_params: Any = None,
                 language_adapter_uid: Any = None, allotted_time_ms: Any = None):
        super().__init__(input_token_ids=list(input_token_ids), max_tokens=max_tokens, streaming=streaming,
                         sampling_config=sampling_config, output_config=output_config, end_id=end_id, pad_id=pad_id,
                         stop_words=stop_words, return_all_generated_tokens=return_all_generated_tokens)


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class RequestPerfMetrics:
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)


@dataclass
class Result:
    is_final: bool = False
    output_token_ids: list[list[int]] = field(default_factory=list)
    log_probs: Optional[list[list[float]]] = None
    finish_reasons: list[FinishReason] = field(default_factory=list)
    request_perf_metrics: Optional[RequestPerfMetrics] = None


class Response:
    def __init__(self, request_id: int, result: Optional[Result] = None, error_msg: str = ""):
        self.request_id, self._result, self.error_msg = request_id, result, error_msg

    def has_error(self) -> bool:
        return bool(self.error_msg)

    @property
    def result(self) -> Result:
        if self._result is None:
            raise RuntimeError("a Response with an error has no result")  # what the binding does
        return self._result


# A script maps a request's prompt ids to the token ids the "model" generates; an int -1 in the list
# makes the executor report an error for that request at that point.
ExecScript = Callable[[list[int]], list[int]]


@dataclass
class _Running:
    rid: int
    req: Request
    tokens: list[int]
    pos: int = 0
    reused_blocks: int = 0


class Executor:
    """In-flight batching simulator: each step advances every running request by one token."""

    script: ExecScript = staticmethod(lambda prompt: [])
    step_seconds: float = 0.002
    tokens_per_block: int = 4
    instances: list["Executor"] = []
    leader: bool = True

    def __init__(self, model_path: Any, model_type: ModelType, executor_config: ExecutorConfig):
        _record("Executor", dict(model_path=model_path, model_type=model_type, executor_config=executor_config))
        assert Path(model_path).is_dir(), f"{model_path}: engine folder missing"
        self.config = executor_config
        self.requests: dict[int, Request] = {}
        self._running: dict[int, _Running] = {}
        self._ready: "queue.Queue[Response]" = queue.Queue()
        self._next = 1
        self._lock = threading.Lock()
        self._alive = True
        self._dead: Optional[str] = None
        self._seen_prefixes: list[list[int]] = []
        self.cancelled: list[int] = []
        self.shutdown_called = False
        Executor.instances.append(self)
        self._thread = threading.Thread(target=self._steps, daemon=True)
        self._thread.start()

    def can_enqueue_requests(self) -> bool:
        return type(self).leader

    def enqueue_request(self, request: Request) -> int:
        assert request.streaming, "the toolkit streams every request"
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self.requests[rid] = request
            prompt = list(request.input_token_ids)
            reused = max((self._common(prompt, p) for p in self._seen_prefixes), default=0) // self.tokens_per_block
            tokens = list(type(self).script(prompt))[: request.max_tokens]
            self._running[rid] = _Running(rid, request, tokens, reused_blocks=reused)
        return rid

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def cancel_request(self, id: int) -> None:  # noqa: A002 - the binding's argument name
        with self._lock:
            self.cancelled.append(id)
            r = self._running.pop(id, None)
        if r is not None:
            self._ready.put(Response(id, Result(True, [[]], None, [FinishReason.CANCELLED], RequestPerfMetrics())))

    def await_responses(self, timeout: Any = None) -> list[Response]:
        if self._dead:
            raise RuntimeError(self._dead)
        out = []
        try:
            out.append(self._ready.get(timeout=timeout.total_seconds() if timeout is not None else None))
            while True:
                out.append(self._ready.get_nowait())
        except queue.Empty:
            pass
        return out

    def die(self, message: str) -> None:
        self._dead = message

    def shutdown(self) -> None:
        self.shutdown_called = True
        self._alive = False

    def _steps(self) -> None:
        while self._alive:
            time.sleep(self.step_seconds)
            with self._lock:
                for rid, r in list(self._running.items()):
                    if r.pos >= len(r.tokens):
                        end = r.req.end_id is not None and r.req.end_id >= 0 and r.tokens[-1:] == [r.req.end_id]
                        reason = FinishReason.END_ID if end else FinishReason.LENGTH
                        self._finish(rid, r, reason, [])
                        continue
                    tok = r.tokens[r.pos]
                    r.pos += 1
                    if tok == -1:
                        self._running.pop(rid)
                        self._ready.put(Response(rid, None, "scripted executor error"))
                        continue
                    lps = [[-0.25]] if r.req.output_config.return_log_probs else None
                    if r.req.end_id is not None and tok == r.req.end_id:
                        self._finish(rid, r, FinishReason.END_ID, [tok])
                    elif r.pos >= r.req.max_tokens:
                        self._finish(rid, r, FinishReason.LENGTH, [tok])
                    else:
                        self._ready.put(Response(rid, Result(False, [[tok]], lps, [FinishReason.NOT_FINISHED])))

    def _finish(self, rid: int, r: _Running, reason: FinishReason, last: list[int]) -> None:
        self._running.pop(rid, None)
        self._seen_prefixes.append(list(r.req.input_token_ids) + r.tokens[: r.pos])
        metrics = RequestPerfMetrics(KvCacheMetrics(num_reused_blocks=r.reused_blocks))
        lps = [[-0.25] * len(last)] if r.req.output_config.return_log_probs else None
        self._ready.put(Response(rid, Result(True, [last], lps, [reason], metrics)))


# ------------------------------------------------------------------ installing the fake package
def install(monkeypatch: Any, version: str = "1.2.1") -> types.ModuleType:
    CALLS.clear()
    Executor.instances = []
    Executor.leader = True
    root = types.ModuleType("tensorrt_llm")
    root.__version__ = version
    models = types.ModuleType("tensorrt_llm.models")
    models.LLaMAForCausalLM, models.QWenForCausalLM = LLaMAForCausalLM, QWenForCausalLM
    modeling_utils = types.ModuleType("tensorrt_llm.models.modeling_utils")
    modeling_utils.QuantConfig = QuantConfig
    mapping = types.ModuleType("tensorrt_llm.mapping")
    mapping.Mapping = Mapping
    quantization = types.ModuleType("tensorrt_llm.quantization")
    quantization.QuantAlgo = QuantAlgo
    bindings = types.ModuleType("tensorrt_llm.bindings")
    executor = types.ModuleType("tensorrt_llm.bindings.executor")
    for obj in (ModelType, BatchingType, CommunicationType, CommunicationMode, FinishReason, DecodingMode,
                DecodingConfig, KvCacheConfig, ParallelConfig, ExecutorConfig, SamplingConfig, OutputConfig, Request,
                Response, Result, Executor):
        setattr(executor, obj.__name__, obj)
    root.models, root.mapping, root.quantization, root.bindings = models, mapping, quantization, bindings
    models.modeling_utils, bindings.executor = modeling_utils, executor
    for name, mod in {"tensorrt_llm": root, "tensorrt_llm.models": models,
                      "tensorrt_llm.models.modeling_utils": modeling_utils, "tensorrt_llm.mapping": mapping,
                      "tensorrt_llm.quantization": quantization, "tensorrt_llm.bindings": bindings,
                      "tensorrt_llm.bindings.executor": executor}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return root


# ------------------------------------------------------------------ the command-line contract
# Flags of the TensorRT-LLM 1.2.x commands the build runs (a subset: the ones a recipe can reach).
FLAGS = {
    "trtllm-build": {"--checkpoint_dir", "--output_dir", "--gemm_plugin", "--use_paged_context_fmha",
                     "--kv_cache_type", "--max_batch_size", "--max_seq_len", "--max_input_len", "--max_num_tokens",
                     "--max_beam_width", "--workers", "--speculative_decoding_mode", "--use_fp8_context_fmha",
                     "--remove_input_padding", "--context_fmha", "--gpt_attention_plugin"},
    "quantize.py": {"--model_dir", "--dtype", "--qformat", "--calib_dataset", "--calib_size", "--calib_max_seq_length",
                    "--batch_size", "--tp_size", "--pp_size", "--seed", "--output_dir", "--kv_cache_dtype",
                    "--device", "--tokenizer_max_seq_length", "--awq_block_size"},
    "convert_checkpoint.py": {"--base_model_checkpoint_dir", "--drafter_model_dir", "--output_dir", "--dtype",
                              "--tp_size", "--redrafter_num_beams", "--redrafter_draft_len_per_beam",
                              "--redrafter_no_greedy_search", "--workers"},
}
BOOLEAN_FLAGS = {"--redrafter_no_greedy_search"}


def parse_flags(tool: str, argv: list[str]) -> dict[str, Optional[str]]:
    """{flag: value}; fails on a flag the tool does not have or a flag without its value."""
    out: dict[str, Optional[str]] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag in FLAGS[tool], f"{tool} has no flag {flag}"
        if flag in BOOLEAN_FLAGS:
            out[flag], i = None, i + 1
        else:
            assert i + 1 < len(argv) and not argv[i + 1].startswith("--"), f"{tool} {flag} needs a value"
            out[flag], i = argv[i + 1], i + 2
    return out


class FakeRunner:
    """Checks each step's command against the contract, then produces what the real command writes."""

    def __init__(self, fail_step: Optional[str] = None):
        self.commands: list[tuple[str, list[str], dict[str, str]]] = []
        self.fail_step = fail_step

    def __call__(self, step: Any, cmd: list[str], env: dict[str, str]) -> None:
        self.commands.append((step.name, cmd, env))
        if step.name == self.fail_step:
            raise RuntimeError(f"trtllm {step.name} step failed (exit 1): {' '.join(cmd)}")
        if cmd[1:3] == ["-m", "trtbuild.trtllm.convert"]:
            from trtbuild.trtllm.convert import main

            assert main(cmd[3:]) == 0
            return
        script = len(cmd) > 1 and cmd[1].endswith(".py")  # [python, examples/.../x.py, ...] or [trtllm-build, ...]
        tool, args = (Path(cmd[1]).name, cmd[2:]) if script else (Path(cmd[0]).name, cmd[1:])
        flags = parse_flags(tool, args)
        out = Path(flags["--output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        tp = int(flags.get("--tp_size") or flags.get("--workers") or 1)
        if tool == "trtllm-build":
            src = json.loads((Path(flags["--checkpoint_dir"]) / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({"pretrained_config": src, "build_config": {
                "max_batch_size": int(flags["--max_batch_size"]), "plugin_config": {"tokens_per_block": 4}}}))
            for r in range(src.get("mapping", {}).get("tp_size", 1)):
                (out / f"rank{r}.engine").write_bytes(b"engine")
        else:
            config: dict[str, Any] = {"mapping": {"tp_size": tp}, "tool": tool}
            if tool == "convert_checkpoint.py":
                config["architecture"] = "ReDrafterForCausalLM"
            (out / "config.json").write_text(json.dumps(config))
            for r in range(tp):
                (out / f"rank{r}.safetensors").write_bytes(b"fake")

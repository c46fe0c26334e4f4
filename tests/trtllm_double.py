"""A test double of the TensorRT-LLM 1.2.x surface this toolkit uses (tests only; contract tests).

`install(monkeypatch)` puts a fake `tensorrt_llm` package into sys.modules. What the fake accepts comes
from upstream source, through the snapshot `tests/upstream/trtllm_1_2.json` (see `tests/upstream/extract.py`):
the bindings' positional and keyword names (a misspelt or invented argument is a TypeError), QuantConfig's
fields, and the streaming semantics (`output_token_ids` only the new tokens, `log_probs` cumulative over everything
generated). Calls are recorded in `CALLS`.

The fake `Executor` is a small in-flight batching simulator: a thread advances every running request by
`tokens_per_step` tokens per step (ReDrafter accepts several) from a script (prompt ids -> token ids),
streams `Response`s as the C++ executor does, honours `cancel_request`, and can fail a request or die.

The command-line side (the build's commands checked against upstream's flags, and what they write)
is tests/trtllm_command_double.py.
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

from upstream import snapshot

CALLS: list[tuple[str, dict[str, Any]]] = []
UP = snapshot()


# ------------------------------------------------------------------ tensorrt_llm.quantization / models
class QuantAlgo(str, enum.Enum):  # the members the toolkit uses (mode.py not read: see the snapshot's not_read)
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    FP8 = "FP8"
    INT8 = "INT8"


_QUANT_DEFAULTS = {"group_size": 128, "smoothquant_val": 0.5, "use_meta_recipe": False, "has_zero_point": False,
                   "pre_quant_scale": False}


class QuantConfig:
    """QuantConfig with upstream's field names only (`quantization.quant_config_fields`)."""

    FIELDS = tuple(UP["quantization"]["quant_config_fields"])

    def __init__(self, **kw: Any):
        unknown = sorted(set(kw) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"QuantConfig has no field(s) {unknown} (upstream fields: {list(self.FIELDS)})")
        for name in self.FIELDS:
            setattr(self, name, kw.get(name, _QUANT_DEFAULTS.get(name)))

    def to_dict(self) -> dict[str, Any]:
        out = {n: getattr(self, n) for n in self.FIELDS}
        for k in ("quant_algo", "kv_cache_quant_algo"):
            out[k] = out[k].value if isinstance(out[k], QuantAlgo) else out[k]
        return out


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
        """Writes what PretrainedConfig.to_dict writes for the parts the later steps read."""
        CALLS.append(("save_checkpoint", dict(output_dir=output_dir, save_config=save_config, rank=self.mapping.rank)))
        out = Path(output_dir)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"fake")
        if save_config:
            (out / "config.json").write_text(json.dumps({
                "architecture": self.architecture, "dtype": self.dtype,
                "mapping": {"world_size": self.mapping.world_size, "tp_size": self.mapping.tp_size},
                "quantization": self.quant_config.to_dict()}))


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


FinishReason = enum.Enum("FinishReason", UP["executor"]["finish_reasons"], start=0)


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


class _Bound:
    """Constructed as the binding is: upstream's positional and keyword names (the snapshot), no others.

    The arguments given become attributes (the bindings' read-write properties); the others read as
    `DEFAULTS` or None.
    """

    DEFAULTS: dict[str, Any] = {}

    def __init__(self, *args: Any, **kw: Any):
        name = type(self).__name__
        spec = UP["executor"]["keywords"][name]
        if len(args) > len(spec["positional"]):
            raise TypeError(f"{name}() takes {len(spec['positional'])} positional arguments, got {len(args)}")
        bound = dict(zip(spec["positional"], args))
        for k in kw:
            if k not in spec["keyword"]:
                raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")
            if k in bound:
                raise TypeError(f"{name}() got multiple values for argument {k!r}")
        bound.update(kw)
        missing = [r for r in spec["required"] if r not in bound]
        if missing:
            raise TypeError(f"{name}() missing required argument(s) {missing}")
        self.__dict__.update({k: self.DEFAULTS.get(k) for k in spec["keyword"]})
        self.__dict__.update(_record(name, bound))


class DecodingConfig(_Bound):
    pass


class KvCacheConfig(_Bound):
    DEFAULTS = {"enable_block_reuse": True}


class ParallelConfig(_Bound):
    DEFAULTS = {"communication_type": CommunicationType.MPI, "communication_mode": CommunicationMode.LEADER}


class ExecutorConfig(_Bound):
    DEFAULTS = {"max_beam_width": 1, "enable_chunked_context": False, "batching_type": BatchingType.INFLIGHT}


class SamplingConfig(_Bound):
    DEFAULTS = {"beam_width": 1}


class OutputConfig(_Bound):
    DEFAULTS = {"return_log_probs": False, "exclude_input_from_output": False, "return_perf_metrics": False}


class Request(_Bound):
    DEFAULTS = {"streaming": False, "return_all_generated_tokens": False}

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.input_token_ids = list(self.input_token_ids)
        self.output_config = self.output_config or OutputConfig()


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
    sent: int = 0  # tokens already sent in responses


class Executor:
    """In-flight batching simulator: each step advances every running request by `tokens_per_step` tokens."""

    script: ExecScript = staticmethod(lambda prompt: [])
    step_seconds: float = 0.002
    tokens_per_step: int = 1  # ReDrafter: up to draft_len + 1 tokens per step
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
                    self._advance(rid, r)

    def _advance(self, rid: int, r: "_Running") -> None:
        """One decoding step of one request: up to `tokens_per_step` tokens, then one response."""
        end_id = r.req.end_id if r.req.end_id is not None and r.req.end_id >= 0 else None
        if r.pos >= len(r.tokens):
            ended = end_id is not None and r.tokens[-1:] == [end_id]
            self._respond(rid, r, FinishReason.END_ID if ended else FinishReason.LENGTH)
            return
        for _ in range(type(self).tokens_per_step):
            if r.pos >= len(r.tokens):
                break
            tok = r.tokens[r.pos]
            if tok == -1:
                self._running.pop(rid)
                self._ready.put(Response(rid, None, "scripted executor error"))
                return
            r.pos += 1
            if end_id is not None and tok == end_id:
                self._respond(rid, r, FinishReason.END_ID)
                return
            if r.pos >= r.req.max_tokens:
                self._respond(rid, r, FinishReason.LENGTH)
                return
        self._respond(rid, r, None)

    def _respond(self, rid: int, r: "_Running", reason: Optional[FinishReason]) -> None:
        """A streamed Result as createResult builds it: the tokens since the last response (all of them
        with return_all_generated_tokens), log_probs over every generated token so far."""
        first = 0 if r.req.return_all_generated_tokens else r.sent
        tokens = r.tokens[first:r.pos]
        r.sent = r.pos
        lps = [[logprob_of(i) for i in range(r.pos)]] if r.req.output_config.return_log_probs else None
        if reason is None:
            self._ready.put(Response(rid, Result(False, [tokens], lps, [FinishReason.NOT_FINISHED])))
            return
        self._running.pop(rid, None)
        self._seen_prefixes.append(list(r.req.input_token_ids) + r.tokens[: r.pos])
        metrics = RequestPerfMetrics(KvCacheMetrics(num_reused_blocks=r.reused_blocks))
        self._ready.put(Response(rid, Result(True, [tokens], lps, [reason], metrics)))


def logprob_of(position: int) -> float:
    """The scripted log-probability of the generated token at `position` (distinct per position, so a
    consumer that slices the cumulative list wrongly gets the wrong values)."""
    return -(position + 1) / 100


# ------------------------------------------------------------------ installing the fake package
def install(monkeypatch: Any, version: str = "1.2.1") -> types.ModuleType:
    CALLS.clear()
    Executor.instances = []
    Executor.leader = True
    Executor.tokens_per_step = 1
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

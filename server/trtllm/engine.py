"""TensorRT-LLM's executor (in-flight batching, paged KV with block reuse) behind the engine protocol.

One poller thread waits on `Executor.await_responses` and routes each streamed response to its
request's asyncio queue; decoding to text, stop strings and deadlines are handled here, with the
same `textstream` code as the embedded backend, so "stop" means the same on every backend:
TensorRT-LLM's own stop words are token sequences and miss strings split differently by the
tokenizer (NeMo-Skills matches decoded text too). A matched stop string, a deadline or a caller's
cancel all end in `Executor.cancel_request`, and every request ends with exactly one `Final`.

The turns of one TIR sample resubmit the whole token history; with `enable_block_reuse` the
executor serves the common prefix from KV blocks it kept (`Final.cached_tokens` reports it, from
the request's KV-cache metrics). Tensor parallelism uses MPI leader mode: start the process with
`mpirun -n <tp>` (see `server/programs/trtllm_launch.py`); ranks other than 0 wait inside `from_dir` until
the leader shuts down, then exit.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from aimo_spec.chat import load_tokenizer
from aimo_spec.protocol import FinishReason, Request, SamplingParams
from server.stream import EngineBase, RequestStream

POLL = datetime.timedelta(milliseconds=20)
CANCEL_GRACE_SECONDS = 5.0  # a cancelled request the executor never finalises is finalised here
FINISH: dict[str, FinishReason] = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "TIMED_OUT": "timeout",
          "CANCELLED": "cancelled", "NOT_FINISHED": "length"}


def executor_module() -> Any:
    """`tensorrt_llm.bindings.executor`, imported only when a trtllm engine is opened."""
    try:
        import tensorrt_llm.bindings.executor as tle
    except ImportError as e:
        raise RuntimeError(f"the trtllm backend needs TensorRT-LLM 1.2.x in this python ({sys.executable}): {e}; "
                           "run it with TRTLLM_PYTHON (see README 'GPU workflow')") from e
    return tle


def executor_config(tle: Any, spec: dict[str, Any]) -> Any:
    """ExecutorConfig from engine.json (the recipe's build limits and trtllm section)."""
    t, limits = spec.get("trtllm") or {}, spec["limits"]
    kw: dict[str, Any] = dict(
        max_beam_width=1,
        kv_cache_config=tle.KvCacheConfig(enable_block_reuse=bool(t.get("enable_kv_cache_reuse", True)),
                                          free_gpu_memory_fraction=float(t.get("kv_cache_free_gpu_mem_fraction", 0.9))),
        enable_chunked_context=bool(t.get("enable_chunked_context", True)),
        batching_type=tle.BatchingType.INFLIGHT,
        max_batch_size=int(limits["max_batch_size"]),
        max_num_tokens=int(limits["max_num_tokens"]),
    )
    if t.get("gpu_device_ids"):
        kw["parallel_config"] = tle.ParallelConfig(communication_type=tle.CommunicationType.MPI,
                                                   communication_mode=tle.CommunicationMode.LEADER,
                                                   device_ids=[int(i) for i in t["gpu_device_ids"]])
    if spec.get("drafter"):  # ReDrafter engines decode with explicit draft tokens
        kw["decoding_config"] = tle.DecodingConfig(decoding_mode=tle.DecodingMode.ExplicitDraftTokens())
    return tle.ExecutorConfig(**kw)


def sampling_config(tle: Any, p: SamplingParams) -> Any:
    if p.temperature == 0:  # greedy: the executor's argmax path
        return tle.SamplingConfig(beam_width=1, top_k=1, seed=p.seed)
    return tle.SamplingConfig(beam_width=1, temperature=p.temperature, top_p=p.top_p,
                              top_k=p.top_k if p.top_k > 0 else None, seed=p.seed)


@dataclass
class _Req:
    """A request in the executor: its stream and the executor's id for it."""

    stream: RequestStream
    exec_id: int
    cancel_at: Optional[float] = None  # when we asked the executor to cancel
    cancel_reason: FinishReason = "cancelled"

    @property
    def req(self) -> Request:
        return self.stream.request


class TrtllmEngine(EngineBase):
    name = "trtllm"

    def __init__(self, executor: Any, tle: Any, tokenizer: Any, spec: dict[str, Any], tokens_per_block: int = 32):
        self.executor, self.tle, self.tokenizer, self.spec = executor, tle, tokenizer, spec
        limits = spec["limits"]
        self.max_input_len, self.max_seq_len = int(limits["max_input_len"]), int(limits["max_seq_len"])
        self.tokens_per_block = tokens_per_block
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._lock = threading.Lock()
        self._by_exec: dict[int, _Req] = {}
        self._by_id: dict[str, _Req] = {}
        self._closed = False
        self._poller = threading.Thread(target=self._poll, name="trtllm-poller", daemon=True)
        self._poller.start()

    # ---- construction
    @classmethod
    def from_dir(cls, engine_dir: str | Path) -> "TrtllmEngine":
        """Serve `build/trtllm/` from `make engine BACKEND=trtllm` (engine.json, engine/, model/ tokenizer)."""
        engine_dir = Path(engine_dir)
        spec_file = engine_dir / "engine.json"
        if not spec_file.is_file():
            raise FileNotFoundError(f"{spec_file}: no trtllm engine; run `make engine MODEL=... BACKEND=trtllm` first")
        spec = json.loads(spec_file.read_text())
        if spec.get("backend") != "trtllm":
            raise ValueError(f"{spec_file}: backend is {spec.get('backend')!r}, not 'trtllm'")
        trt_dir = engine_dir / spec.get("engine_dir", "engine")
        config = trt_dir / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{config}: the TensorRT engine folder is incomplete; rebuild it")
        plugin = json.loads(config.read_text()).get("build_config", {}).get("plugin_config", {})
        tle = executor_module()
        tokenizer = load_tokenizer(engine_dir / spec.get("model_dir", "model"))
        executor = tle.Executor(trt_dir, tle.ModelType.DECODER_ONLY, executor_config(tle, spec))
        if not executor.can_enqueue_requests():
            # an MPI worker rank (tp > 1, leader mode): serve the leader until it shuts down, then leave
            executor.shutdown()
            raise SystemExit(0)
        return cls(executor, tle, tokenizer, spec, int(plugin.get("tokens_per_block", 32)))

    # ---- the driver (generate, tokenize, detokenize, chat_prompt: EngineBase)
    def _request(self, prompt: list[int], p: SamplingParams) -> Any:
        tle = self.tle
        return tle.Request(
            input_token_ids=prompt, max_tokens=min(p.max_tokens, self.max_seq_len - len(prompt)), streaming=True,
            sampling_config=sampling_config(tle, p),
            output_config=tle.OutputConfig(return_log_probs=p.top_logprobs > 0, exclude_input_from_output=True,
                                           return_perf_metrics=True),
            end_id=-1 if p.ignore_eos else self.eos_id, pad_id=self.pad_id,
            stop_words=[[int(t)] for t in p.stop_token_ids] or None,
        )

    def _submit(self, stream: RequestStream) -> None:
        prompt = stream.prompt
        if not 0 < len(prompt) <= self.max_input_len or len(prompt) >= self.max_seq_len:
            stream.finish("error", f"prompt of {len(prompt)} tokens: must be 1..{self.max_input_len} (max_input_len) "
                                   f"and leave room below max_seq_len {self.max_seq_len}")
            return
        with self._lock:  # the poller must not see responses of an unregistered request
            try:
                exec_id = self.executor.enqueue_request(self._request(prompt, stream.params))
            except Exception as e:  # noqa: BLE001 - the executor rejects bad requests with its own message
                stream.finish("error", f"enqueue failed: {e}")
                return
            r = _Req(stream, exec_id)
            self._by_exec[exec_id], self._by_id[stream.request_id] = r, r

    def cancel(self, request_id: str) -> None:
        with self._lock:
            r = self._by_id.get(request_id)
            if r is not None and not r.stream.done and r.cancel_at is None:
                r.cancel_at = time.monotonic()
                self.executor.cancel_request(r.exec_id)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poller.join(timeout=10)
        with self._lock:
            for r in list(self._by_exec.values()):
                self._finish(r, "error", error="engine shut down")
        self.executor.shutdown()

    # ---- the poller thread
    def _poll(self) -> None:
        while not self._closed:
            try:
                responses = self.executor.await_responses(timeout=POLL)
            except Exception as e:  # noqa: BLE001 - the executor died: fail everything in flight
                with self._lock:
                    for r in list(self._by_exec.values()):
                        self._finish(r, "error", error=f"executor failed: {e}")
                time.sleep(POLL.total_seconds())
                continue
            with self._lock:
                for resp in responses:
                    r = self._by_exec.get(resp.request_id)
                    if r is not None:
                        self._on_response(r, resp)
                self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for r in list(self._by_exec.values()):
            if r.req.deadline is not None and now >= r.req.deadline and r.cancel_at is None:
                r.cancel_at, r.cancel_reason = now, "timeout"
                self.executor.cancel_request(r.exec_id)
                self._finish(r, "timeout")
            elif r.cancel_at is not None and now - r.cancel_at > CANCEL_GRACE_SECONDS:
                self._finish(r, r.cancel_reason)

    def _on_response(self, r: _Req, resp: Any) -> None:
        if resp.has_error():
            self._finish(r, "error", error=str(resp.error_msg))
            return
        res = resp.result
        # streaming: output_token_ids holds the tokens since the last response, log_probs all so far
        new = [int(t) for t in (res.output_token_ids[0] if res.output_token_ids else [])]
        logprobs = None
        if r.req.params.top_logprobs > 0 and res.log_probs:
            lps = list(res.log_probs[0])[-len(new):] if new else []
            logprobs = tuple(((tok, float(lp)),) for tok, lp in zip(new, lps))
        if r.stream.push(new, logprobs) is not None:
            if not res.is_final:
                r.cancel_at = time.monotonic()
                self.executor.cancel_request(r.exec_id)
            self._finish(r, "stop", result=res)
            return
        if res.is_final:
            reason = res.finish_reasons[0].name if res.finish_reasons else "END_ID"
            finish = FINISH.get(reason, "stop")
            if finish == "cancelled" and r.cancel_reason == "timeout":
                finish = "timeout"
            self._finish(r, finish, result=res)

    def _finish(self, r: _Req, reason: FinishReason, error: str = "", result: Any = None) -> None:
        """End `r` (later responses for it are dropped); cached tokens from its KV-cache metrics."""
        if r.stream.done:
            return
        self._by_exec.pop(r.exec_id, None)
        self._by_id.pop(r.req.request_id, None)
        metrics = getattr(result, "request_perf_metrics", None) if result is not None else None
        if metrics is not None:
            reused = int(metrics.kv_cache_metrics.num_reused_blocks) * self.tokens_per_block
            r.stream.cached_tokens = min(len(r.stream.prompt), reused)
        r.stream.finish(reason, error)

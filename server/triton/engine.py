"""The `triton` backend: any Triton deployment of the `ensemble` interface, through tritonclient gRPC streaming.

    engine = TritonEngine("localhost:8001", tokenizer_dir="engines/mix/build/embedded/model")

All requests share one bidirectional gRPC stream (decoupled mode); responses are routed to each
request's asyncio queue by request id. As on the other backends, the text comes from the token ids
through `textstream` and stop strings are matched on it here; a match, a deadline or `cancel` sends
the stop signal the deployment honours, and the request always ends with one `Final`:
- the embedded deployment: a request with parameter `stop: true` and the same `request_key`;
- tensorrtllm_backend (the server has a `tensorrt_llm` model with a `stop` input): its ensemble has no
  stop input and ignores parameters, so requests go to `tensorrt_llm` directly, token ids in and out
  (exact), and the stop is a request with the same id and `stop: true`, which the backend turns into
  the executor's cancelRequest.
If the stream breaks (the server
died or restarted), every request in flight ends with an error that says so, and the next request
reconnects. A request the server refuses ends alone: tritonclient hands such an error over without its
request, so the embedded deployment names the request's key in it, and otherwise the requests not yet
answered are the candidates (each is stopped and ends with the error); what the interface's types or
the embedded server's ranges refuse is refused here, before it is sent. Request keys are random: a
key is what a stop names, so another client must neither guess nor reuse it.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from aimo_spec.chat import load_tokenizer
from aimo_spec.protocol import FINISH_REASONS, FinishReason, SamplingParams
from server.stream import EngineBase, RequestStream
from server.triton.interface import (
    INPUTS,
    KEY_PARAMETER,
    MAX_TEMPERATURE,
    MODEL,
    STOP_PARAMETER,
    TRTLLM_INPUTS,
    TRTLLM_MODEL,
    TRTLLM_STOP_INPUTS,
    Field,
)

CANCEL_GRACE_SECONDS = 5.0
SHUTDOWN_GRACE_SECONDS = 2.0  # for the server to confirm the stops `shutdown` sends
KEY_IN_ERROR = re.compile(rf"\[{KEY_PARAMETER} ([0-9a-f]{{32}})\]")  # the embedded server names the refused key
INT32_MAX = 2**31 - 1  # max_tokens and top_k travel as INT32: larger is the same as the most


def infer_inputs(values: dict[str, Any], fields: tuple[Field, ...] = INPUTS) -> list:
    """tritonclient inputs from numpy arrays named as the interface's inputs (their Triton types from it)."""
    import tritonclient.grpc as grpcclient

    types = {f.name: f.triton_type for f in fields}
    out = []
    for name, arr in values.items():
        x = grpcclient.InferInput(name, list(arr.shape), types[name])
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def _has_stop_input(client: Any, model: str) -> bool:
    """Whether the server has tensorrtllm_backend's `model` with its `stop` input (False on PyTriton)."""
    try:
        if not client.is_model_ready(model, client_timeout=5):
            return False
        meta = client.get_model_metadata(model, as_json=True, client_timeout=10)
    except Exception:  # noqa: BLE001 - no such model on this server
        return False
    return any(i["name"] == "stop" for i in meta.get("inputs", []))


@dataclass
class _Pending:
    """A request on the gRPC stream: its stream plus the stop signal's state."""

    stream: RequestStream
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    answered: bool = False  # a response came: a refusal without a key is not this request's
    stop_sent: Optional[float] = None
    end_reason: FinishReason = "cancelled"
    end_error: str = ""  # the error its stop ends it with (shutdown)

    @property
    def done(self) -> bool:
        return self.stream.done


class TritonEngine(EngineBase):
    name = "triton"

    def __init__(self, url: str, tokenizer_dir: str, model: str = MODEL, connect_timeout: float = 10.0):
        self.url, self.model = url, model
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._client: Any = None
        self._broken: list[Any] = []
        self._exact_ids = False
        self._direct = False  # tensorrtllm_backend: requests go to its tensorrt_llm model
        self._target = model
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="triton-watchdog", daemon=True)
        self._connect()
        self._watchdog.start()

    # ---- connection
    def _connect(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                if client.is_server_ready(client_timeout=5) and client.is_model_ready(self.model, client_timeout=5):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(f"Triton at {self.url}: model {self.model!r} not ready after "
                                      f"{self.connect_timeout:.0f}s (start it with `make triton`)")
            time.sleep(0.2)
        meta = client.get_model_metadata(self.model, as_json=True, client_timeout=10)
        self._exact_ids = any(i["name"] == "input_ids" for i in meta.get("inputs", []))
        self._direct = self.model == MODEL and _has_stop_input(client, TRTLLM_MODEL)
        self._target = TRTLLM_MODEL if self._direct else self.model
        client.start_stream(callback=self._on_response)
        self._client = client

    def _on_response(self, result: Any, error: Any) -> None:
        """tritonclient's stream thread: route one response, a refusal or a stream error to its requests."""
        if error is not None:
            with self._lock:
                if getattr(error, "status", lambda: None)() is not None:  # gRPC's own status: the stream broke
                    self._drop_client()  # the next request reconnects
                    for p in list(self._pending.values()):
                        self._finish(p, "error", error=f"Triton stream failed ({self.url}): {error}")
                    return
                message = str(getattr(error, "message", lambda: error)()).strip().splitlines()
                said = next((line for line in reversed(message) if line.strip()), "refused")
                for p in self._refused(str(error)):
                    self._send_stop(p, "error")
                    self._finish(p, "error", error=f"Triton refused the request ({self.url}): {said}")
            return
        resp = result.get_response()
        with self._lock:
            p = self._pending.get(resp.id)
            if p is None or p.done:
                return
            p.answered = True
            final = resp.parameters.get("triton_final_response")
            is_final = bool(final.bool_param) if final is not None else False
            if not is_final or resp.outputs:
                self._on_output(p, result)
            if is_final and not p.done:  # a server that sends no finish_reason (tensorrtllm_backend)
                ran_out = len(p.stream.generated) >= p.stream.params.max_tokens
                self._finish(p, p.end_reason if p.stop_sent else ("length" if ran_out else "stop"), p.end_error)

    def _on_output(self, p: _Pending, result: Any) -> None:
        if self._direct:
            self._on_trtllm_output(p, result)
            return
        names = {o.name for o in result.get_response().outputs}
        reason = result.as_numpy("finish_reason") if "finish_reason" in names else None
        if "token_ids" in names:
            new = [int(t) for t in result.as_numpy("token_ids").reshape(-1)]
        else:
            raw = result.as_numpy("text_output").reshape(-1)
            piece = b"".join(x if isinstance(x, bytes) else str(x).encode() for x in raw).decode("utf-8", "replace")
            new = self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        if new and not p.done:
            logprobs = None
            k = p.stream.params.top_logprobs
            if k and "logprobs" in names:
                flat = result.as_numpy("logprobs").reshape(-1, 2)
                logprobs = tuple(tuple((int(t), float(lp)) for t, lp in flat[i * k:(i + 1) * k])
                                 for i in range(len(flat) // k))
            if p.stream.push(new, logprobs) is not None:
                self._send_stop(p, "stop")
                self._finish(p, "stop")
                return
        if reason is not None and not p.done:
            r = reason.reshape(-1)[0]
            r = (r.decode() if isinstance(r, bytes) else str(r)).strip()
            head, _, err = r.partition(": ")
            if head in FINISH_REASONS:
                stopped = head == "cancelled" and p.stop_sent
                self._finish(p, p.end_reason if stopped else head, error=p.end_error if stopped else err)

    def _on_trtllm_output(self, p: _Pending, result: Any) -> None:
        """tensorrt_llm's streamed response: output_ids holds the new tokens, output_log_probs all so far."""
        names = {o.name for o in result.get_response().outputs}
        if "output_ids" not in names or p.done:
            return
        new = [int(t) for t in result.as_numpy("output_ids").reshape(-1)]
        if not new:
            return
        logprobs = None
        if p.stream.params.top_logprobs and "output_log_probs" in names:
            lps = [float(x) for x in result.as_numpy("output_log_probs").reshape(-1)][-len(new):]
            logprobs = tuple(((tok, lp),) for tok, lp in zip(new, lps))
        if p.stream.push(new, logprobs) is not None:
            self._send_stop(p, "stop")
            self._finish(p, "stop")

    # ---- the driver (generate, tokenize, detokenize, chat_prompt: EngineBase)
    def _trtllm_inputs(self, prompt: list[int], p: SamplingParams) -> list:
        import numpy as np

        def one(value: Any, dtype: Any) -> Any:
            return np.array([[value]], dtype=dtype)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        values: dict[str, Any] = {
            "input_ids": np.array([prompt], dtype=np.int32), "input_lengths": one(len(prompt), np.int32),
            "request_output_len": one(min(p.max_tokens, INT32_MAX), np.int32), "streaming": one(True, bool),
            "end_id": one(-1 if p.ignore_eos else eos, np.int32), "pad_id": one(pad, np.int32),
        }
        if p.temperature == 0:  # greedy, as the trtllm backend asks the executor
            values["runtime_top_k"] = one(1, np.int32)
        else:
            values.update(temperature=one(p.temperature, np.float32), runtime_top_p=one(p.top_p, np.float32))
            if p.top_k > 0:
                values["runtime_top_k"] = one(min(p.top_k, INT32_MAX), np.int32)
        if p.seed is not None:
            values["seed"] = one(p.seed % 2**64, np.uint64)  # a negative seed as the same 64 bits
        if p.top_logprobs:
            values["return_log_probs"] = one(True, bool)
        return infer_inputs(values, TRTLLM_INPUTS)

    def _inputs(self, prompt: list[int], p: SamplingParams) -> list:
        import numpy as np

        if self._direct:
            return self._trtllm_inputs(prompt, p)
        values: dict[str, Any] = {
            "text_input": np.array([self.tokenizer.decode(prompt, skip_special_tokens=False).encode()], dtype=object),
            "max_tokens": np.array([min(p.max_tokens, INT32_MAX)], dtype=np.int32),
            "stream": np.array([True]), "temperature": np.array([p.temperature], dtype=np.float32),
            "top_p": np.array([p.top_p], dtype=np.float32),
            "top_k": np.array([min(p.top_k, INT32_MAX)], dtype=np.int32),
        }
        if p.seed is not None:
            values["seed"] = np.array([p.seed % 2**64], dtype=np.uint64)  # a negative seed as the same 64 bits
        if p.ignore_eos:
            values["end_id"] = np.array([-1], dtype=np.int32)
        if self._exact_ids:
            values["input_ids"] = np.array(prompt, dtype=np.int32)
            if p.top_logprobs:
                values["top_logprobs"] = np.array([p.top_logprobs], dtype=np.int32)
        return infer_inputs(values)

    def _submit(self, stream: RequestStream) -> None:
        p = _Pending(stream)
        request = stream.request
        with self._lock:
            broken, self._broken = self._broken, []
        for old in broken:  # outside the lock: its stream thread may be waiting on it to deliver a response
            try:
                old.stop_stream(cancel_requests=True)
                old.close()
            except Exception:  # noqa: BLE001 - already broken
                pass
        wrong = _refused_here(request.params)
        if wrong:
            p.stream.finish("error", f"not sent to Triton: {wrong}")
            return
        try:
            with self._lock:
                if self._client is None:
                    self._connect()
        except Exception as e:  # noqa: BLE001 - a dead server is an error of this request, said plainly
            with self._lock:
                self._drop_client()
                self._finish(p, "error", error=f"Triton at {self.url} unreachable: {e}")
            return
        try:
            inputs = self._inputs(stream.prompt, request.params)
        except Exception as e:  # noqa: BLE001 - this request's values, not the connection
            p.stream.finish("error", f"not sent to Triton: its inputs could not be encoded: {e}")
            return
        try:
            with self._lock:
                self._pending[request.request_id] = p
                self._client.async_stream_infer(self._target, inputs, request_id=request.request_id,
                                                parameters=None if self._direct else {KEY_PARAMETER: p.key},
                                                enable_empty_final_response=True)
        except Exception as e:  # noqa: BLE001 - a dead server is an error of this request, said plainly
            with self._lock:
                self._drop_client()
                self._finish(p, "error", error=f"Triton at {self.url} unreachable: {e}")

    def cancel(self, request_id: str) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is not None and not p.done:
                self._send_stop(p, "cancelled")

    def shutdown(self) -> None:
        """Stop what is in flight on the server too (it would generate on to max_tokens: Triton passes no
        disconnect to a Python model), wait briefly for it to confirm, then close the stream."""
        if self._closed:
            return
        with self._lock:
            for p in list(self._pending.values()):
                self._send_stop(p, "error", "engine closed")
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending or self._client is None:
                    break
            time.sleep(0.02)
        self._closed = True
        with self._lock:
            for p in list(self._pending.values()):
                self._finish(p, "error", error="engine closed")
            client, self._client = self._client, None
        if client is not None:
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    # ---- internals (lock held)
    def _refused(self, message: str) -> list[_Pending]:
        """The requests a refusal without its request is about: the one whose key it names (the embedded
        server's), else those not answered yet (a request the server refuses gets no other response)."""
        named = KEY_IN_ERROR.search(message)
        if named:
            return [p for p in self._pending.values() if p.key == named.group(1)]
        return [p for p in self._pending.values() if not p.answered]

    def _drop_client(self) -> None:
        """Forget a broken connection; it is closed later from a caller's thread (closing it from the
        stream's own thread, where its error arrives, would join that thread)."""
        if self._client is not None:
            self._broken.append(self._client)
        self._client = None

    def _send_stop(self, p: _Pending, reason: FinishReason, error: str = "") -> None:
        if p.stop_sent is not None:
            return
        p.stop_sent, p.end_reason, p.end_error = time.monotonic(), reason, error
        if self._client is None:
            return
        import numpy as np

        try:
            if self._direct:  # same request id + stop: the backend cancels it in the executor
                values = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
                          "request_output_len": np.zeros((1, 1), np.int32), "stop": np.ones((1, 1), bool)}
                self._client.async_stream_infer(self._target, infer_inputs({k: values[k] for k in TRTLLM_STOP_INPUTS},
                                                                           TRTLLM_INPUTS),
                                                request_id=p.stream.request_id)
                return
            inputs = infer_inputs({"text_input": np.array([b""], dtype=object),
                                   "max_tokens": np.array([1], dtype=np.int32)})
            self._client.async_stream_infer(self.model, inputs, request_id=f"{p.stream.request_id}/stop",
                                            parameters={KEY_PARAMETER: p.key, STOP_PARAMETER: True})
        except Exception:  # noqa: BLE001 - the grace timer finalises it
            pass

    def _watch(self) -> None:
        """Deadlines and stops the server never confirmed."""
        while not self._closed:
            time.sleep(0.05)
            now = time.monotonic()
            with self._lock:
                for p in list(self._pending.values()):
                    if (p.stream.request.deadline is not None and now >= p.stream.request.deadline
                            and p.stop_sent is None):
                        self._send_stop(p, "timeout")
                        self._finish(p, "timeout")
                    elif p.stop_sent is not None and now - p.stop_sent > CANCEL_GRACE_SECONDS:
                        self._finish(p, p.end_reason, p.end_error)

    def _finish(self, p: _Pending, reason: FinishReason, error: str = "") -> None:
        if p.done:
            return
        self._pending.pop(p.stream.request_id, None)
        p.stream.finish(reason, error)


def _refused_here(p: SamplingParams) -> str:
    """Why the embedded server would refuse `p` ('' when it would not), said before sending: a refusal from
    the server comes back without its request."""
    if p.temperature > MAX_TEMPERATURE:  # top_logprobs' bound is SamplingParams' own
        return f"temperature {p.temperature} is over {MAX_TEMPERATURE}"
    return ""

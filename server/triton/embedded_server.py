"""The embedded engine behind a real Triton Inference Server (the tritonserver PyTriton bundles; CPU-only).

The program: server/programs/triton_embedded.py (`make triton`).

Serves the `ensemble` interface (server/triton/interface.py) in decoupled (streaming) mode from an
async generator, so many requests share one in-flight batch. The model is loaded before it is bound:
Triton's readiness endpoint says ready only once the engine can serve. A request with parameter
`stop: true` ends the running request of the same `request_key` (its stream ends with finish_reason
'cancelled'); a key already running is refused (a client's keys must not collide with another's: the solver's
are random), and a refusal names the input and the request's key, so a client on a shared stream can tell
which of its requests it ends. The engine runs with the serving settings it is given (the program passes the recipe's,
resolved by `serving_settings`, or the defaults). Runs in the Triton environment (.venv-triton:
PyTriton needs numpy<2).
"""

from __future__ import annotations

import os
import sysconfig
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from aimo_spec.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from aimo_spec.recipe import ServingSpec
from server.triton.interface import (
    INPUTS,
    KEY_PARAMETER,
    MAX_TEMPERATURE,
    MODEL,
    OUTPUTS,
    STOP_PARAMETER,
)


class BadRequest(ValueError):
    """A request the ensemble interface refuses; its message names the input (PyTriton sends it to the client)."""


def _scalar(req: Any, name: str, default: Any = None) -> Any:
    """The first element of input `name` as a Python value (BYTES inputs arrive as numpy object arrays of
    `bytes`, which have no `.item()`); `default` when absent or empty."""
    if name not in req.data:
        return default
    v = req.data[name].reshape(-1)
    if not v.size:
        return default
    x = v[0]
    return x.item() if hasattr(x, "item") else x


def _required(req: Any, name: str) -> Any:
    v = _scalar(req, name)
    if v is None:
        raise BadRequest(f"input '{name}' is required (the ensemble's inputs: text_input and max_tokens; "
                         "optional: stream, temperature, top_p, top_k, seed, stop_words, end_id, input_ids, "
                         "top_logprobs)")
    return v


def _text(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


class Servable:
    """The infer callable: one engine, a registry of running requests by key for the stop signal."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.running: dict[str, str] = {}  # request_key -> engine request id
        self.requests = 0

    def request_from(self, req: Any) -> Any:
        import numpy as np

        from aimo_spec.protocol import Request, SamplingParams

        text = _text(_required(req, "text_input"))
        max_tokens = int(_required(req, "max_tokens"))
        if max_tokens < 1:
            raise BadRequest(f"input 'max_tokens' must be >= 1 (got {max_tokens})")
        ids = np.asarray(req.data["input_ids"]).reshape(-1) if "input_ids" in req.data else np.zeros(0)
        limit = getattr(self.engine, "max_input_len", None)
        if limit and ids.size > limit:
            raise BadRequest(f"input 'input_ids' holds {ids.size} tokens, over max_input_len {limit}")
        prompt: Any = [int(i) for i in ids] if ids.size else text
        if not prompt:
            raise BadRequest("input 'text_input' is empty (and no input_ids were given)")
        stops = (tuple(_text(s) for s in np.asarray(req.data["stop_words"]).reshape(-1)) if "stop_words" in req.data
                 else ())
        stops = tuple(s for s in stops if s)
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise BadRequest(f"input 'stop_words': at most {MAX_STOP_STRINGS} of at most {MAX_STOP_STRING_CHARS} "
                             f"characters (got {len(stops)}, the longest {max(map(len, stops))}): each is matched "
                             "against every token of every request")
        end_id = _scalar(req, "end_id")
        temperature, top_p = float(_scalar(req, "temperature", 0.0)), float(_scalar(req, "top_p", 1.0))
        if not 0.0 <= temperature <= MAX_TEMPERATURE:  # NaN fails both comparisons
            raise BadRequest(f"input 'temperature' must be in [0, {MAX_TEMPERATURE:g}] (got {temperature})")
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"input 'top_p' must be in (0, 1] (got {top_p})")
        top_k, top_logprobs = int(_scalar(req, "top_k", 0)), int(_scalar(req, "top_logprobs", 0))
        if top_k < 0:
            raise BadRequest(f"input 'top_k' must be >= 0 (got {top_k})")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"input 'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}] (got {top_logprobs})")
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=_scalar(req, "seed"),
            max_tokens=max_tokens, stop=stops,
            stop_token_ids=(int(end_id),) if end_id is not None and end_id >= 0 else (),
            top_logprobs=top_logprobs)
        return Request(prompt, params)

    async def __call__(self, requests: list) -> AsyncIterator[list[dict]]:
        import numpy as np

        from aimo_spec.protocol import Delta, Final

        req = requests[0]
        params = req.parameters or {}
        key = str(params.get(KEY_PARAMETER, ""))
        if params.get(STOP_PARAMETER):
            rid = self.running.get(key)
            if rid is not None:
                self.engine.cancel(rid)
            yield [{"text_output": np.array([b""], dtype=object),
                    "finish_reason": np.array([b"stop_sent"], dtype=object)}]
            return
        try:
            if key in self.running:
                raise BadRequest(f"parameter '{KEY_PARAMETER}' names a request still running (keys must be unique)")
            request = self.request_from(req)
        except BadRequest as e:
            raise BadRequest(f"{e} [{KEY_PARAMETER} {key}]" if key else str(e)) from None
        stream = bool(_scalar(req, "stream", True))
        if key:
            self.running[key] = request.request_id
        self.requests += 1
        text, ids, tops = [], [], []
        try:
            async for ev in self.engine.generate(request):
                if isinstance(ev, Delta):
                    if not stream:  # all in the final response, logprobs too
                        text.append(ev.text)
                        ids.extend(ev.token_ids)
                        tops.extend(ev.logprobs or ())
                        continue
                    out = {"text_output": np.array([ev.text.encode()], dtype=object),
                           "token_ids": np.array(ev.token_ids, dtype=np.int32)}
                    if ev.logprobs:
                        out["logprobs"] = np.array([p for top in ev.logprobs for p in top],
                                                   dtype=np.float32).reshape(-1, 2)
                    yield [out]
                elif isinstance(ev, Final):
                    tail = "".join(text) if not stream else ""
                    reason = ev.finish_reason + (f": {ev.error}" if ev.error else "")
                    last = {"text_output": np.array([tail.encode()], dtype=object),
                            "token_ids": np.array(ids, dtype=np.int32),
                            "finish_reason": np.array([reason.encode()], dtype=object)}
                    if tops:
                        last["logprobs"] = np.array([p for top in tops for p in top], dtype=np.float32).reshape(-1, 2)
                    yield [last]
        finally:
            if key and self.running.get(key) == request.request_id:
                del self.running[key]


def tensors(fields: tuple, inputs: bool = True) -> list:
    import numpy as np
    from pytriton.model_config import Tensor

    def dtype(f: Any) -> Any:
        return bytes if f.numpy_type == "object" else np.dtype(f.numpy_type).type
    # outputs cannot be optional in a model config; a response may still carry only some of them
    return [Tensor(name=f.name, dtype=dtype(f), shape=f.shape, optional=f.optional and inputs) for f in fields]


def serve(engine_dir: Path, grpc_port: int, http_port: int, metrics_port: int, log: Any = print,
          serving: Optional[ServingSpec] = None) -> None:
    """Serve `engine_dir` with `serving` (the command's serving settings; None: the defaults) until stopped."""
    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig

    from server.embedded.engine import EmbeddedEngine

    # the python backend stub loads libpython: pyenv builds keep it outside the default library path
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and libdir not in os.environ.get("LD_LIBRARY_PATH", ""):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    t0 = time.time()
    engine = EmbeddedEngine.from_dir(engine_dir, serving=serving)
    log(f"[triton] engine loaded from {engine_dir} in {time.time() - t0:.1f}s")
    servable = Servable(engine)
    config = TritonConfig(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port, exit_timeout_secs=5)
    with Triton(config=config) as triton:
        triton.bind(MODEL, servable, inputs=tensors(INPUTS), outputs=tensors(OUTPUTS, inputs=False),
                    config=ModelConfig(decoupled=True, batching=False), strict=False)
        log(f"[triton] ready: model {MODEL!r} on grpc :{grpc_port}, http :{http_port} "
            f"({time.time() - t0:.1f}s after start)")
        try:
            triton.serve()
        finally:
            engine.shutdown()

"""Test doubles of tensorrtllm_backend, built from the upstream snapshot (tests/upstream/trtllm_1_2.json).

`write_templates(root)` writes an `all_models/inflight_batcher_llm` folder whose config.pbtxt files hold
every `${...}` placeholder of the upstream templates, in the same kind of position (inside a string, or
bare where a number, a bool or a data type goes: those make the file unparseable when left), and each
model's inputs with their data types. The layout around them is generic, not upstream's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from upstream import snapshot

PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


def template_text(model: str, drop: tuple[str, ...] = (), extra_bare: tuple[str, ...] = (),
                  extra_quoted: tuple[str, ...] = ()) -> str:
    facts = snapshot()["triton"]["templates"][model]
    bare = [k for k in facts["bare_placeholders"] if k not in drop] + list(extra_bare)
    quoted = [k for k in facts["placeholders"] if k not in facts["bare_placeholders"] and k not in drop]
    quoted += list(extra_quoted)
    lines = [f'name: "{model}"']
    typed = {t["data_type"] for t in facts["inputs"].values()}
    lines += [f"setting_{k}: ${{{k}}}" for k in bare if f"${{{k}}}" not in typed]
    lines.append("input [")
    entries = []
    for name, t in facts["inputs"].items():
        dtype = t["data_type"]
        if dtype.startswith("${") and dtype[2:-1] in drop:
            dtype = "TYPE_FP32"
        entries.append(f'  {{ name: "{name}" data_type: {dtype} dims: [ -1 ]'
                       f'{" optional: true" if t["optional"] else ""} }}')
    lines += [",\n".join(entries), "]"]
    lines += [f'parameters: {{ key: "{k}" value: {{ string_value: "${{{k}}}" }} }}' for k in quoted]
    return "\n".join(lines) + "\n"


def write_templates(root: Path, drop: Optional[tuple[str, str]] = None, extra_bare: tuple[str, str] = ("", ""),
                    extra_quoted: tuple[str, str] = ("", "")) -> Path:
    """The templates folder; `drop` (model, key) removes a placeholder, `extra_*` (model, key) adds one."""
    out = root / "inflight_batcher_llm"
    for model in snapshot()["triton"]["templates"]:
        (out / model / "1").mkdir(parents=True)
        text = template_text(model, drop=(drop[1],) if drop and drop[0] == model else (),
                             extra_bare=(extra_bare[1],) if extra_bare[0] == model else (),
                             extra_quoted=(extra_quoted[1],) if extra_quoted[0] == model else ())
        (out / model / "config.pbtxt").write_text(text)
        if model in PYTHON_MODELS:
            (out / model / "1" / "model.py").write_text("# the backend's python model\n")
    return out


# ------------------------------------------------------------------ a tensorrtllm_backend server (gRPC streaming)
import itertools  # noqa: E402 - the server double below needs these, the templates above do not
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

CLIENT_TYPES = {"TYPE_STRING": "BYTES"}  # Triton's config names -> tritonclient's (TYPE_ stripped otherwise)


def client_type(config_type: str) -> str:
    return CLIENT_TYPES.get(config_type, config_type.removeprefix("TYPE_"))


class InferInput:
    def __init__(self, name: str, shape: list[int], datatype: str):
        self.name, self.shape, self.datatype, self.data = name, list(shape), datatype, None

    def set_data_from_numpy(self, arr: np.ndarray) -> None:
        assert list(arr.shape) == self.shape, f"{self.name}: shape {arr.shape} != declared {self.shape}"
        self.data = arr


@dataclass
class _Running:
    request_id: str
    model: str
    tokens: list[int]
    max_tokens: int
    pos: int = 0
    cancelled: bool = False
    done: bool = False
    log_probs: bool = False


@dataclass
class _Result:
    rid: str
    outputs: dict[str, np.ndarray]
    final: bool

    def get_response(self) -> Any:
        return types.SimpleNamespace(id=self.rid, outputs=[types.SimpleNamespace(name=n) for n in self.outputs],
                                     parameters={"triton_final_response": types.SimpleNamespace(bool_param=self.final)})

    def as_numpy(self, name: str) -> np.ndarray:
        return self.outputs[name]


@dataclass
class FakeTensorrtllmServer:
    """tensorrtllm_backend as the client sees it: `ensemble` (text in and out, no stop input, request
    parameters ignored) and `tensorrt_llm` (token ids; a request with the same id and `stop: true` cancels
    the running one and gets one empty final response, as model_instance_state.cc does). Inputs are
    checked against the upstream templates' names, types and optional flags. `script(prompt ids) -> ids`."""

    tokenizer: Any
    script: Callable[[list[int]], list[int]]
    step_seconds: float = 0.005
    requests: dict[str, _Running] = field(default_factory=dict)
    stop_requests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.models = {m: snapshot()["triton"]["templates"][m]["inputs"] for m in ("ensemble", "tensorrt_llm")}
        self.stop = snapshot()["triton"]["stop"]
        self._lock = threading.Lock()
        self._callback: Any = None
        self._alive = True
        self._outbox: "queue.Queue[tuple[_Result, Any]]" = queue.Queue()
        threading.Thread(target=self._steps, daemon=True).start()
        threading.Thread(target=self._deliver, daemon=True).start()

    # ---- what the client calls (through FakeClient)
    def metadata(self, model: str) -> dict[str, Any]:
        return {"name": model, "inputs": [{"name": n, "datatype": client_type(t["data_type"])}
                                          for n, t in self.models[model].items()]}

    def infer(self, model: str, inputs: list[InferInput], request_id: str, parameters: Any) -> None:
        declared = self.models[model]
        given = {i.name: i for i in inputs}
        for name, x in given.items():
            if name not in declared:
                return self._error(request_id, f"unexpected inference input '{name}' for model '{model}'")
            want = client_type(declared[name]["data_type"])
            if x.datatype != want:
                return self._error(request_id, f"{model}: input '{name}' has datatype {x.datatype}, expected {want}")
        missing = [n for n, t in declared.items() if not t["optional"] and n not in given]
        if missing:
            return self._error(request_id, f"{model}: expected inputs {missing}")
        if (model == "tensorrt_llm" and self.stop["input"] in given
                and bool(given[self.stop["input"]].data.reshape(-1)[0])):
            with self._lock:
                self.stop_requests.append(request_id)
                r = self.requests.get(request_id)
                if r is not None and not r.done:
                    r.cancelled = True
            self._send(_Result(request_id, {}, True))  # the stop request's own (empty, final) response
            return None
        if model == "ensemble":
            text = given["text_input"].data.reshape(-1)[0]
            prompt = self.tokenizer(text.decode() if isinstance(text, bytes) else text,
                                    add_special_tokens=False)["input_ids"]
            max_tokens, logp = int(given["max_tokens"].data.reshape(-1)[0]), False
        else:
            prompt = [int(t) for t in given["input_ids"].data[0]]
            max_tokens = int(given["request_output_len"].data.reshape(-1)[0])
            logp = "return_log_probs" in given and bool(given["return_log_probs"].data.reshape(-1)[0])
        with self._lock:
            self.requests[request_id] = _Running(request_id, model, list(self.script(prompt)), max_tokens,
                                                 log_probs=logp)
        return None

    def cancel_all(self) -> None:
        with self._lock:
            for r in self.requests.values():
                r.cancelled = r.cancelled or not r.done

    # ---- the server side
    def _error(self, request_id: str, message: str) -> None:
        self._outbox.put((_Result(request_id, {}, True), RuntimeError(message)))

    def _send(self, result: _Result) -> None:
        self._outbox.put((result, None))

    def _deliver(self) -> None:
        """Callbacks come from a thread of their own, as tritonclient's stream thread."""
        while self._alive:
            try:
                result, error = self._outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            callback = self._callback
            if callback is not None:
                callback(result, error)

    def _steps(self) -> None:
        while self._alive:
            time.sleep(self.step_seconds)
            with self._lock:
                running = [r for r in self.requests.values() if not r.done]
            for r in running:
                self._advance(r)

    def _advance(self, r: _Running) -> None:
        if r.cancelled or r.pos >= min(len(r.tokens), r.max_tokens):
            r.done = True
            self._send(_Result(r.request_id, {}, True))
            return
        tok = r.tokens[r.pos]
        r.pos += 1
        if r.model == "ensemble":
            self._send(_Result(r.request_id, {"text_output": np.array([self.tokenizer.decode([tok]).encode()],
                                                                      dtype=object)}, False))
            return
        outputs = {"output_ids": np.array([[[tok]]], dtype=np.int32),
                   "sequence_length": np.array([[r.pos]], dtype=np.int32)}
        if r.log_probs:  # all generated tokens so far (llmRequest.cpp), one beam
            outputs["output_log_probs"] = np.array([[[logprob_of(i) for i in range(r.pos)]]], dtype=np.float32)
        self._send(_Result(r.request_id, outputs, False))

    def shutdown(self) -> None:
        self._alive = False


def logprob_of(position: int) -> float:
    return -(position + 1) / 100


class FakeClient:
    """tritonclient.grpc.InferenceServerClient over a FakeTensorrtllmServer (one stream per client)."""

    server: FakeTensorrtllmServer

    def __init__(self, url: str, **kw: Any):
        self.url = url

    def is_server_ready(self, client_timeout: Any = None) -> bool:
        return True

    def is_model_ready(self, model: str, client_timeout: Any = None) -> bool:
        return model in self.server.models

    def get_model_metadata(self, model: str, as_json: bool = False, client_timeout: Any = None) -> dict:
        return self.server.metadata(model)

    def start_stream(self, callback: Callable, stream_timeout: Any = None) -> None:
        self.server._callback = callback

    def async_stream_infer(self, model_name: str, inputs: list, request_id: str = "", parameters: Any = None,
                           enable_empty_final_response: bool = False, outputs: Any = None) -> None:
        self.server.infer(model_name, inputs, request_id, parameters)

    def stop_stream(self, cancel_requests: bool = False) -> None:
        if cancel_requests:
            self.server.cancel_all()
        self.server._callback = None

    def close(self) -> None:
        pass


_ids = itertools.count()


def install_client(monkeypatch: Any, server: FakeTensorrtllmServer) -> None:
    """Put a fake `tritonclient.grpc` bound to `server` into sys.modules."""
    import sys

    grpc = types.ModuleType("tritonclient.grpc")
    client_cls = type(f"InferenceServerClient{next(_ids)}", (FakeClient,), {"server": server})
    grpc.InferenceServerClient, grpc.InferInput = client_cls, InferInput
    root = types.ModuleType("tritonclient")
    root.grpc = grpc
    monkeypatch.setitem(sys.modules, "tritonclient", root)
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", grpc)

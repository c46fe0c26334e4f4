"""End to end through a real Triton Inference Server (PyTriton's tritonserver, CPU) and tritonclient.

Runs in the Triton environment (`make test` runs this file with .venv-triton's python; the main
environment skips it). The server serves a tiny random model with the embedded engine; the server
process is always killed at the end, whatever happens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from hang_guard import fail_after  # noqa: E402
from streams import cancel_after  # noqa: E402

from aimo_spec.protocol import Final, Request, SamplingParams, collect  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEST_SECONDS = 240  # no test here may hang CI: past this, stacks are dumped and the test fails
hang_guard = fail_after(TEST_SECONDS)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    """A tritonserver subprocess in its own process group."""

    def __init__(self, engine_dir: Path, log: Path):
        self.engine_dir, self.log = engine_dir, log
        self.grpc, self.http, self.metrics = free_ports(3)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"localhost:{self.grpc}"

    def start(self, wait: bool = True) -> float:
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.programs.triton_embedded", "--engine", str(self.engine_dir),
             "--grpc-port", str(self.grpc), "--http-port", str(self.http), "--metrics-port", str(self.metrics)],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if wait:
            self.wait_ready()
        return time.monotonic() - t0

    def wait_ready(self, timeout: float = 120.0) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tritonserver exited: {self.log.read_text()[-3000:]}"
            try:
                if client.is_server_ready(client_timeout=5) and client.is_model_ready("ensemble", client_timeout=5):
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = Server(tiny_models["llama-tir"], tmp_path_factory.mktemp("triton") / "server.log")
    try:
        srv.startup_seconds = srv.start()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def engine(server, tiny_models):
    from server.triton.engine import TritonEngine

    eng = TritonEngine(server.url, str(tiny_models["llama-tir"]))
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def ready_now(srv: Server) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(srv.url)
        return bool(client.is_server_ready(client_timeout=5) and client.is_model_ready("ensemble", client_timeout=5))
    except Exception:  # noqa: BLE001 - nothing listening
        return False


def test_ready_only_once_the_model_is_loaded_and_greedy_equals_the_embedded_engine(server, engine, tiny_models):
    """Readiness comes after the engine loaded; greedy tokens through Triton are the engine's own."""
    from server.embedded.engine import EmbeddedEngine

    assert engine._exact_ids  # the embedded deployment advertises exact token ids
    prompt = engine.tokenize(engine.chat_prompt("What is 6 times 7?"))
    params = SamplingParams(temperature=0, max_tokens=24)
    deltas, via_triton = run(collect(engine, Request(prompt, params)))
    direct = EmbeddedEngine.from_dir(tiny_models["llama-tir"])
    try:
        _, local = run(collect(direct, Request(prompt, params)))
    finally:
        direct.shutdown()
    assert via_triton.token_ids == local.token_ids and via_triton.text == local.text
    assert via_triton.finish_reason == local.finish_reason and len(deltas) > 1


def test_concurrent_streams_seeds_logprobs_and_stop_strings(engine):
    prompt = engine.tokenize(engine.chat_prompt("Sum of 1 to 10?"))

    async def go():
        reqs = [Request(prompt, SamplingParams(temperature=0.8, seed=s % 3, max_tokens=16, top_logprobs=2,
                                               ignore_eos=True)) for s in range(6)]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))
    results = run(go())
    assert all(f.finish_reason == "length" and len(f.token_ids) == 16 for _, f in results)
    assert results[0][1].token_ids == results[3][1].token_ids  # same seed, same tokens, batched or not
    assert all(len(top) == 2 for d, _ in results for delta in d for top in (delta.logprobs or ()))
    text = results[0][1].text
    stop = text[5:9] if len(text) > 9 else None
    if stop:
        _, f = run(collect(engine, Request(prompt, SamplingParams(temperature=0.8, seed=0, max_tokens=16,
                                                                   ignore_eos=True, stop=(stop,)))))
        assert f.finish_reason == "stop" and f.stop_string == stop and f.text.endswith(stop)


def test_stop_a_request_mid_stream_and_the_server_moves_on(engine):
    prompt = engine.tokenize(engine.chat_prompt("Count."))
    req = Request(prompt, SamplingParams(temperature=0.5, seed=1, max_tokens=400, ignore_eos=True))
    t = time.monotonic()
    events = run(cancel_after(engine, req, 4))
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "cancelled" and len(final.token_ids) < 400
    assert sum(isinstance(e, Final) for e in events) == 1 and time.monotonic() - t < 10
    _, after = run(collect(engine, Request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))))
    assert after.finish_reason == "length"


def test_solver_runs_tir_over_triton(server, tiny_models, tmp_path):
    """The solver, the TIR client and the sandbox, unchanged, over the triton backend."""
    from aimo_spec.recipe import SolverSpec
    from sandbox import Limits, SandboxConfig, SandboxPool
    from server.solver import Solver
    from server.tir import TIRClient
    from server.triton.engine import TritonEngine

    eng = TritonEngine(server.url, str(tiny_models["llama-tir"]))
    try:
        with SandboxPool(SandboxConfig(limits=Limits(wall_seconds=3), pool_size=2)) as pool:
            client = TIRClient(eng, pool, sampling=SamplingParams(temperature=0.7, max_tokens=48))
            solver = Solver(eng, client, SolverSpec(samples=4, early_stop_first=3, early_stop_agree=2,
                                                    enough_finished=4))
            result = run(solver.solve("p", "What is 6 times 7?", deadline=time.monotonic() + 90))
    finally:
        eng.shutdown()
    assert len(result.traces) == 4 and all(t.finish in ("stop", "length", "cancelled") for t in result.traces)
    assert all(t.tokens > 0 for t in result.traces)


def test_server_killed_mid_request_then_restarted(tiny_models, tmp_path):
    from server.triton.engine import TritonEngine

    srv = Server(tiny_models["llama-tir"], tmp_path / "server.log")
    try:
        srv.start()
        eng = TritonEngine(srv.url, str(tiny_models["llama-tir"]))
        prompt = eng.tokenize(eng.chat_prompt("Count."))

        async def killed():
            req = Request(prompt, SamplingParams(temperature=0.5, seed=1, max_tokens=2000, ignore_eos=True))
            async for ev in eng.generate(req):
                if not isinstance(ev, Final):
                    srv.kill()
                else:
                    return ev
        final = run(asyncio.wait_for(killed(), 60))
        assert final.finish_reason == "error" and "Triton" in final.error
        _, refused = run(collect(eng, Request(prompt, SamplingParams(max_tokens=4))))
        assert refused.finish_reason == "error" and srv.url in refused.error
        srv.start(wait=False)  # same ports; not ready (not even listening) until the engine has loaded
        assert not ready_now(srv)
        srv.wait_ready()
        _, again = run(collect(eng, Request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))))
        assert again.finish_reason == "length" and len(again.token_ids) == 6
        eng.shutdown()
    finally:
        srv.kill()


def stream_infer(server: Server, values: dict, timeout: float = 60.0,
                 parameters: dict | None = None) -> tuple[list, list[str]]:
    """One decoupled request with exactly these inputs, as a plain tritonclient user sends it: the
    responses' outputs, and the error messages the server sent back."""
    import queue

    import tritonclient.grpc as grpcclient

    from server.triton.engine import infer_inputs

    inputs = infer_inputs(values)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True, parameters=parameters)
        outputs, errors = [], []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result, error = got.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                errors.append(str(error))
                break
            response = result.get_response()
            if (response.parameters.get("triton_final_response")
                    and response.parameters["triton_final_response"].bool_param):
                break
            outputs.append(result)
        return outputs, errors
    finally:
        client.stop_stream()
        client.close()


def test_the_documented_ensemble_inputs_alone_are_served(server):
    """text_input and max_tokens only (tensorrtllm_backend's ensemble interface): text comes back, and
    as many tokens as asked at most; the optional sampling and stop inputs are taken too."""
    import numpy as np

    outputs, errors = stream_infer(server, {"text_input": np.array([b"What is 2 + 2?"], dtype=object),
                                            "max_tokens": np.array([5], dtype=np.int32)})
    assert not errors, errors
    text = b"".join(o.as_numpy("text_output")[0] for o in outputs if o.as_numpy("text_output") is not None)
    ids = [int(t) for o in outputs if o.as_numpy("token_ids") is not None for t in o.as_numpy("token_ids")]
    assert text and 1 <= len(ids) <= 5
    outputs, errors = stream_infer(server, {
        "text_input": np.array([b"Count:"], dtype=object), "max_tokens": np.array([6], dtype=np.int32),
        "temperature": np.array([0.7], dtype=np.float32), "top_p": np.array([0.9], dtype=np.float32),
        "top_k": np.array([20], dtype=np.int32), "seed": np.array([7], dtype=np.uint64),
        "stop_words": np.array([b"\n\n"], dtype=object), "stream": np.array([False])})
    assert not errors, errors
    assert outputs[-1].as_numpy("finish_reason")[0].decode() in ("stop", "length")


@pytest.mark.parametrize("missing", ["max_tokens", "text_input"])
def test_a_request_missing_a_required_input_is_refused_by_name(server, missing):
    import numpy as np

    values = {"text_input": np.array([b"hello"], dtype=object), "max_tokens": np.array([4], dtype=np.int32)}
    del values[missing]
    outputs, errors = stream_infer(server, values)
    assert errors and f"'{missing}'" in errors[0] and "required" in errors[0], (outputs, errors)
    # the server is still serving
    outputs, errors = stream_infer(server, {"text_input": np.array([b"hi"], dtype=object),
                                            "max_tokens": np.array([2], dtype=np.int32)})
    assert not errors and outputs


def test_nan_temperature_is_refused_by_name(server):
    import numpy as np

    outputs, errors = stream_infer(server, {"text_input": np.array([b"hi"], dtype=object),
                                            "max_tokens": np.array([2], dtype=np.int32),
                                            "temperature": np.array([np.nan], dtype=np.float32)})
    assert errors and "'temperature'" in errors[0], (outputs, errors)


def test_a_refused_request_ends_alone_and_the_engine_goes_on(engine, tiny_models):
    """tritonclient hands a refusal over without its request: one refused request used to end every request
    in flight (as a broken stream), and the next submission deadlocked. The server names the refused key;
    what the server would refuse for its values is refused before it is sent."""
    prompt = engine.tokenize(engine.chat_prompt("Count."))
    long = SamplingParams(temperature=0.5, max_tokens=60, ignore_eos=True)

    async def go():
        valid = [asyncio.ensure_future(collect(engine, Request(prompt, replace(long, seed=i)))) for i in range(3)]
        await asyncio.sleep(0.3)
        too_long = await collect(engine, Request([5] * 5000, SamplingParams(max_tokens=4)))
        not_sent = await collect(engine, Request(prompt, SamplingParams(temperature=150.0, max_tokens=4)))
        return too_long[1], not_sent[1], [f for _, f in await asyncio.gather(*valid)]
    too_long, not_sent, valid = run(go())
    assert too_long.finish_reason == "error" and "max_input_len" in too_long.error, too_long
    assert not_sent.finish_reason == "error" and "not sent to Triton" in not_sent.error, not_sent
    assert [(f.finish_reason, len(f.token_ids)) for f in valid] == [("length", 60)] * 3, valid
    _, after = run(collect(engine, Request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))))
    assert after.finish_reason == "length"


def test_one_clients_stop_never_ends_another_clients_request(server, tiny_models):
    """The stop names the request's key: keys were the request ids, a per-process counter, so a second solver's
    req-0 was the first one's and its stop ended both. Keys are random now."""
    from server.triton.engine import TritonEngine

    a, b = (TritonEngine(server.url, str(tiny_models["llama-tir"])) for _ in range(2))
    try:
        prompt = a.tokenize(a.chat_prompt("Count."))
        params = SamplingParams(temperature=0.5, seed=3, max_tokens=80, ignore_eos=True)

        async def go():
            theirs = asyncio.ensure_future(collect(b, Request(prompt, params, request_id="req-0")))
            mine = await cancel_after(a, Request(prompt, params, request_id="req-0"), 3)
            return mine[-1], (await theirs)[1]
        mine, theirs = run(go())
        assert mine.finish_reason == "cancelled" and (theirs.finish_reason, len(theirs.token_ids)) == ("length", 80)
    finally:
        a.shutdown()
        b.shutdown()


def test_bounds_of_the_embedded_inputs_are_refused_by_name(server):
    """Stop words are matched against every token of every request (100k of them made another client 17x
    slower); top_p 0 was taken as 1; a key already running would be overwritten, its stop lost."""
    import numpy as np

    base = {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([2], dtype=np.int32)}
    for extra, name in (({"stop_words": np.array([b"w%d" % i for i in range(17)], dtype=object)}, "stop_words"),
                        ({"stop_words": np.array([b"x" * 257], dtype=object)}, "stop_words"),
                        ({"top_p": np.array([0.0], dtype=np.float32)}, "top_p"),
                        ({"top_logprobs": np.array([21], dtype=np.int32)}, "top_logprobs")):
        outputs, errors = stream_infer(server, {**base, **extra}, parameters={"request_key": "k" * 32})
        assert errors and f"'{name}'" in errors[0] and "[request_key " + "k" * 32 + "]" in errors[0], errors
    outputs, errors = stream_infer(server, base)
    assert not errors and outputs


def test_logprobs_come_back_without_streaming_too(server):
    import numpy as np

    outputs, errors = stream_infer(server, {"text_input": np.array([b"Count:"], dtype=object),
                                            "max_tokens": np.array([4], dtype=np.int32),
                                            "top_logprobs": np.array([2], dtype=np.int32),
                                            "stream": np.array([False])})
    assert not errors, errors
    tops = [o.as_numpy("logprobs") for o in outputs if o.as_numpy("logprobs") is not None]
    ids = [t for o in outputs if o.as_numpy("token_ids") is not None for t in o.as_numpy("token_ids")]
    assert len(tops) == 1 and tops[0].shape == (2 * len(ids), 2) and len(ids) >= 1, (tops, ids)

"""Contract test of the `triton` backend against a tensorrtllm_backend deployment (no Triton here).

The server is a test double (tests/triton_double.py) whose models, inputs and stop behaviour come
from the upstream snapshot: the ensemble has no `stop` input and ignores request parameters; the
`tensorrt_llm` model cancels a request when a request with the same id carries `stop: true`. What
the tests check is that a stop string, a cancel and a deadline stop generation *on the server*.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import triton_double as tdbl
from upstream import snapshot

from aimo_spec.protocol import Delta, Request, SamplingParams, collect

LONG = 150


@pytest.fixture
def deployment(tiny_models, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["qwen-tir"]))
    text = "x = 6 * 7\nprint(x)\n```\n" + "more tokens that keep coming " * 30
    reply = tok(text, add_special_tokens=False)["input_ids"][:LONG]
    server = tdbl.FakeTensorrtllmServer(tok, lambda prompt: reply)
    tdbl.install_client(monkeypatch, server)
    from server.triton.engine import TritonEngine

    engine = TritonEngine("fake:8001", str(tiny_models["qwen-tir"]), connect_timeout=2)
    yield engine, server, reply
    engine.shutdown()
    server.shutdown()


def server_side(server, rid):
    deadline = time.monotonic() + 3
    r = server.requests[rid]
    while not r.done and time.monotonic() < deadline:
        time.sleep(0.01)
    return r


def test_the_upstream_stop_is_the_tensorrt_llm_models_not_the_ensembles():
    stop = snapshot()["triton"]["stop"]
    assert stop["input"] == "stop" and not stop["ensemble_has_stop_input"]
    assert stop["input"] in snapshot()["triton"]["templates"]["tensorrt_llm"]["inputs"]
    from server.triton.interface import TRTLLM_INPUTS, TRTLLM_STOP_INPUTS

    inputs = snapshot()["triton"]["templates"]["tensorrt_llm"]["inputs"]
    assert list(TRTLLM_STOP_INPUTS) == stop["stop_request_inputs"]
    for f in TRTLLM_INPUTS:  # every input the client sends exists upstream with that type
        assert tdbl.client_type(inputs[f.name]["data_type"]) == f.triton_type, f.name


def test_item5_a_stop_string_stops_generation_on_the_server(deployment):
    engine, server, reply = deployment
    req = Request(reply[:3], SamplingParams(temperature=0, max_tokens=LONG, stop=("```\n",)))
    _, final = asyncio.run(collect(engine, req))
    assert final.finish_reason == "stop" and final.stop_string == "```\n"
    r = server_side(server, req.request_id)
    assert r.cancelled and r.pos < LONG, f"the server generated {r.pos} of {LONG} tokens: the stop never reached it"
    assert req.request_id in server.stop_requests


def test_item5_cancel_and_deadline_stop_generation_on_the_server(deployment):
    engine, server, reply = deployment

    async def cancel_after_three():
        req = Request(reply[:3], SamplingParams(temperature=0.7, max_tokens=LONG, seed=1))
        seen = 0
        async for ev in engine.generate(req):
            seen += isinstance(ev, Delta)
            if seen == 3:
                engine.cancel(req.request_id)
            final = ev
        return req, final
    req, final = asyncio.run(cancel_after_three())
    assert final.finish_reason == "cancelled"
    r = server_side(server, req.request_id)
    assert r.cancelled and r.pos < LONG

    req = Request(reply[:3], SamplingParams(temperature=0, max_tokens=LONG), deadline=time.monotonic() + 0.1)
    _, final = asyncio.run(collect(engine, req))
    assert final.finish_reason == "timeout"
    r = server_side(server, req.request_id)
    assert r.cancelled and r.pos < LONG


def test_tensorrt_llm_direct_gives_exact_ids_and_each_deltas_own_logprobs(deployment):
    engine, server, reply = deployment
    req = Request(reply[:3], SamplingParams(temperature=0, max_tokens=20, top_logprobs=1))
    deltas, final = asyncio.run(collect(engine, req))
    assert final.finish_reason == "length" and list(final.token_ids) == reply[:20]
    got = [lp for d in deltas for ((_, lp),) in (d.logprobs or ())]
    assert got == pytest.approx([tdbl.logprob_of(i) for i in range(20)])

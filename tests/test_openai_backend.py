"""The `openai` backend against real `make serve` servers on loopback (two replicas, the embedded engine
on a tiny random model): exact token continuations, stop strings, cancel, deadline, the text-only
mode, the solver with the TIR client and the real sandbox spread over both replicas, and a replica
killed mid-run (its requests fail over; with none left, a clear error)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("httpx2")
pytest.importorskip("uvicorn")

from openai_servers import ServerProcess, hang_guard  # noqa: E402,F401

from aimo_spec.protocol import Delta, Final, Request, SamplingParams, collect  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def replicas(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    servers = [ServerProcess(tiny_models["llama-tir"], logs / f"r{i}.log").start() for i in range(2)]
    try:
        yield [s.wait_ready() for s in servers]
    finally:
        for s in servers:
            s.kill()


@pytest.fixture(scope="module")
def local(tiny_models):
    from server.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine.from_dir(tiny_models["llama-tir"], max_batch_size=8, max_seq_len=384, threads=1)
    yield eng
    eng.shutdown()


def engine_for(urls, tiny_models, **kw):
    from server.openai.engine import OpenAIEngine

    return OpenAIEngine(urls, str(tiny_models["llama-tir"]), **kw)


def run(coro):
    return asyncio.run(coro)


def test_urls_and_error_bodies():
    from server.openai.replicas import error_message, split_urls

    assert split_urls("localhost:8000, http://h:1/v1/,") == ["http://localhost:8000/v1", "http://h:1/v1"]
    with pytest.raises(ValueError, match="URL="):
        split_urls(" , ")
    assert error_message(b'{"error": {"message": "bad top_p"}}') == "bad top_p"
    assert error_message('{"detail": "nope"}') == "nope" and error_message("plain") == "plain"


def test_a_server_in_front_of_the_replicas_reports_their_context(replicas, tiny_models):
    """`make serve BACKEND=openai` serves an OpenAIEngine: its /v1/models carries the smallest context its
    replicas report (it was null, so a client of that server lost the cap on max_tokens), and a prompt
    plus max_tokens over it is refused as the replicas would."""
    from server.openai.api import Api
    from server.openai.api_error import ApiError

    eng = engine_for([r.url for r in replicas], tiny_models)
    try:
        api = Api(eng, "tiny")
        assert eng.max_seq_len == 384 and api.models()["data"][0]["max_model_len"] == 384
        with pytest.raises(ApiError, match="Ask for at most"):
            run(api.parser.parse(b'{"prompt": [5, 6, 7], "max_tokens": 400}', chat=False))
        # a replica probed later that reports less lowers the server's context from its next request on
        eng.replicas[-1].max_model_len = 200
        assert api.models()["data"][0]["max_model_len"] == 200
        with pytest.raises(ApiError, match="maximum context length is 200 tokens"):
            run(api.parser.parse(b'{"prompt": [5, 6, 7], "max_tokens": 300}', chat=False))
        api.close()
    finally:
        eng.shutdown()


def test_greedy_tokens_and_continuations_are_exact_through_http(replicas, local, tiny_models):
    eng = engine_for(replicas[0].url, tiny_models)
    try:
        rep = eng.replicas[0]
        assert rep.ids_in and rep.ids_out == "return_token_ids" and eng.ready
        prompt = eng.tokenize(eng.chat_prompt("What is 6 times 7?"))
        deltas, a = run(collect(eng, Request(prompt, GREEDY)))
        _, ref = run(collect(local, Request(prompt, GREEDY)))
        assert a.token_ids == ref.token_ids and a.text == ref.text == "".join(d.text for d in deltas)
        # a TIR turn: the history resubmitted as ids with an output block appended continues exactly
        turn2 = prompt + list(a.token_ids) + eng.tokenize("```output\n42\n```\n")
        _, b = run(collect(eng, Request(turn2, GREEDY)))
        _, ref2 = run(collect(local, Request(turn2, GREEDY)))
        assert b.token_ids == ref2.token_ids and b.cached_tokens >= len(prompt)  # the server reused its KV
        # stop strings: matched here, on the text, across tokens; overhang as on every backend
        stop = ref.text[7:10]
        _, c = run(collect(eng, Request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))))
        _, ref3 = run(collect(local, Request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))))
        assert (c.finish_reason, c.text, c.stop_string, c.overhang, c.token_ids) == \
               (ref3.finish_reason, ref3.text, ref3.stop_string, ref3.overhang, ref3.token_ids)
        # seeded sampling and logprobs come back as the engine made them
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, top_logprobs=2)
        d1, s1 = run(collect(eng, Request(prompt, params)))
        d2, s2 = run(collect(local, Request(prompt, params)))
        assert s1.token_ids == s2.token_ids
        lp1 = [row for d in d1 for row in d.logprobs or ()]
        lp2 = [row for d in d2 for row in d.logprobs or ()]
        # the same values (tied ids may come in another order: the server asks for 20)
        assert len(lp1) == len(lp2) == 12
        assert [[round(v, 4) for _, v in row] for row in lp1] == [[round(v, 4) for _, v in row] for row in lp2]
    finally:
        eng.shutdown()


def test_text_only_mode_keeps_the_text(replicas, local, tiny_models):
    """token_ids=off: what a server without id prompts or ids back gets; the text stays byte for byte."""
    eng = engine_for(replicas[0].url, tiny_models, token_ids="off")
    try:
        assert not eng.replicas[0].ids_in and eng.replicas[0].ids_out == ""
        prompt = eng.tokenize(eng.chat_prompt("What is 2 + 2?"))
        _, a = run(collect(eng, Request(prompt, GREEDY)))
        _, ref = run(collect(local, Request(prompt, GREEDY)))
        assert a.text == ref.text and a.finish_reason == ref.finish_reason
    finally:
        eng.shutdown()


def test_the_cache_salt_travels_to_the_replica(replicas, tiny_models):
    """A salted request reaches the replica with its salt: there KV is reused within the salt only."""
    eng = engine_for(replicas[0].url, tiny_models)
    try:
        assert eng.replicas[0].salts and eng.separates_cache_salts  # probed: this server keeps salts apart
        prompt = eng.tokenize(eng.chat_prompt("What is 5 times 9?"))
        finals = [run(collect(eng, Request(prompt, GREEDY, cache_salt=salt)))[1]
                  for salt in ("backend-a", "backend-b", "backend-a")]
        assert [f.cached_tokens for f in finals] == [0, 0, len(prompt) - 1]
    finally:
        eng.shutdown()


def test_cancel_deadline_and_a_closed_engine(replicas, local, tiny_models):
    srv = replicas[0]
    eng = engine_for(srv.url, tiny_models)
    key = 'aimo_requests_total{finish_reason="cancelled"}'
    try:
        prompt = eng.tokenize(eng.chat_prompt("Keep going."))
        long = SamplingParams(temperature=0.8, max_tokens=300, ignore_eos=True)
        before = srv.metrics().get(key, 0)

        async def cancel_after(n):
            req = Request(prompt, long)
            got = 0
            async for ev in eng.generate(req):
                if isinstance(ev, Delta):
                    got += 1
                    if got == n:
                        eng.cancel(req.request_id)
                else:
                    return ev
        final = run(cancel_after(3))
        assert final.finish_reason == "cancelled" and 3 <= len(final.token_ids) < 300
        deadline = time.monotonic() + 20
        while srv.metrics().get(key, 0) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.metrics().get(key, 0) == before + 1  # the server's engine request ended too

        async def abandon():  # breaking out of the stream cancels it, as on every backend
            async for ev in eng.generate(Request(prompt, long)):
                break
        run(abandon())
        _, t = run(collect(eng, Request(prompt, SamplingParams(temperature=0.8, max_tokens=340, ignore_eos=True),
                                        deadline=time.monotonic() + 0.2)))
        assert t.finish_reason == "timeout"
    finally:
        eng.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        run(collect(eng, Request([1, 2], GREEDY)))


def test_the_solver_with_the_sandbox_over_two_replicas(replicas, local, tiny_models):
    """The TIR client and solver, unchanged: code tags taken from the random model's greedy text, so
    it really closes a code block; the code runs in the real sandbox, its output block is appended, and
    each sample's next turn goes back to the replica that holds its history (the KV is reused)."""
    from aimo_spec.recipe import CodeTags, SolverSpec
    from sandbox import Limits, SandboxConfig, SandboxPool
    from server.solver import Solver
    from server.tir import TIRClient

    eng = engine_for(",".join(s.url for s in replicas), tiny_models)
    before = [s.metrics().get("aimo_prompt_tokens_total", 0) for s in replicas]
    problem = "What is 6 times 7?"
    prompt = eng.tokenize(eng.chat_prompt(problem))
    greedy = run(collect(local, Request(prompt, SamplingParams(temperature=0, max_tokens=40))))[1].text
    end = next(greedy[k:k + 3] for k in range(6, 30) if greedy.index(greedy[k:k + 3]) >= 4)
    tags = CodeTags(code_start=greedy[:2], code_end=end, output_start="\n<out>\n", output_end="</out>\n")
    try:
        with SandboxPool(SandboxConfig(limits=Limits(wall_seconds=3), pool_size=2)) as pool:
            client = TIRClient(eng, pool, tags, SamplingParams(temperature=0, max_tokens=60), max_code_calls=2)
            solver = Solver(eng, client, SolverSpec(samples=4, early_stop_first=4, early_stop_agree=4,
                                                    enough_finished=4))
            result = run(solver.solve("p", problem, deadline=time.monotonic() + 60))
    finally:
        eng.shutdown()
    assert len(result.traces) == 4 and isinstance(result.answer, int)
    for t in result.traces:
        assert t.finish in ("stop", "length") and not t.error
        assert t.code_calls and t.code_calls[0].status in ("ok", "error") and "<out>" in t.text
        assert t.turns >= 2 and t.cached_tokens > len(prompt)  # its own history, kept on its replica
    after = [s.metrics().get("aimo_prompt_tokens_total", 0) for s in replicas]
    assert all(a > b for a, b in zip(after, before))  # both replicas served samples


def test_a_replica_killed_mid_run_fails_over_then_a_clear_error(replicas, local, tiny_models):
    """Last in this file: it kills both servers."""
    eng = engine_for(",".join(s.url for s in replicas), tiny_models)
    prompt = eng.tokenize(eng.chat_prompt("Talk."))
    victim = replicas[1]
    try:
        async def go():
            counts = [0] * 6

            async def one(i):
                req = Request(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=300, ignore_eos=True))
                async for ev in eng.generate(req):
                    if isinstance(ev, Delta):
                        counts[i] += len(ev.token_ids)
                    elif isinstance(ev, Final):
                        return ev
            tasks = [asyncio.ensure_future(one(i)) for i in range(6)]
            for _ in range(12000):  # a minute at most; each request streaming before the kill
                if min(counts) >= 5 or any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
            assert min(counts) >= 5, counts
            os.killpg(victim.proc.pid, signal.SIGKILL)
            at_kill = list(counts)
            return await asyncio.gather(*tasks), at_kill
        finals, at_kill = run(go())
        assert all(f.finish_reason == "length" and len(f.token_ids) == 300 for f in finals), [f.error for f in finals]
        assert min(at_kill) < 300 and eng.replicas[1].failures >= 1  # some were cut on the dead one, and went on
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
        # the solver still answers with one replica gone
        from aimo_spec.recipe import SolverSpec
        from sandbox import Limits, SandboxConfig, SandboxPool
        from server.solver import Solver
        from server.tir import TIRClient

        with SandboxPool(SandboxConfig(limits=Limits(wall_seconds=3), pool_size=2)) as pool:
            client = TIRClient(eng, pool, sampling=SamplingParams(temperature=0.7, max_tokens=32))
            result = run(Solver(eng, client, SolverSpec(samples=3, early_stop_first=3, early_stop_agree=3,
                                                        enough_finished=3)).solve("q", "What is 1 + 1?",
                                                                                  time.monotonic() + 60))
        assert isinstance(result.answer, int) and all(t.finish in ("stop", "length") for t in result.traces)
        # with no replica left, a request ends with an error naming each one
        replicas[0].kill()
        _, f = run(collect(eng, Request(prompt, GREEDY)))
        assert f.finish_reason == "error" and replicas[0].url in f.error and victim.url in f.error
    finally:
        eng.shutdown()


class _ScriptedReplica:
    """A client double whose POSTs answer from a script: (status, cached_tokens or None for no details)."""

    def __init__(self, answers):
        self.answers, self.bodies = list(answers), []

    async def post(self, url, json, headers, timeout):
        self.bodies.append(json)
        status, cached = self.answers.pop(0)
        details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
        usage = {"prompt_tokens": 60, **details}

        class Response:
            status_code, content = status, b'{"error": {"message": "no"}}'

            @staticmethod
            def json():
                return {"usage": usage}
        return Response()


@pytest.mark.parametrize("answers, keeps_apart", [
    ([(200, 0), (200, 48), (200, 0)], True),
    ([(200, 0), (200, 48), (200, 48)], False),  # ignores the salt: reuses across salts
    ([(200, None), (200, None), (200, None)], False),  # reports no cached tokens: cannot tell
    ([(200, 0), (200, 0), (200, 0)], False),
    ([(400, 0)], False),  # refuses the field
])
def test_a_replica_is_trusted_with_salts_only_once_probed_keeping_them_apart(answers, keeps_apart):
    from server.openai.probe import _separates_salts
    from server.openai.replicas import Replica

    client = _ScriptedReplica(answers)
    assert run(_separates_salts(Replica("http://r/v1", model="m"), client, {})) is keeps_apart
    salts = [b["cache_salt"] for b in client.bodies]
    assert len(set(salts[:2])) == 1 and (len(salts) < 3 or salts[2] != salts[0])
    with pytest.raises(Exception, match="HTTP 503"):
        run(_separates_salts(Replica("http://r/v1", model="m"), _ScriptedReplica([(503, 0)]), {}))

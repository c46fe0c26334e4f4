"""`make serve` under hostile input and load: every bad request gets an OpenAI-shaped 4xx naming what is
wrong, a server fault a JSON 500 with its request id, nothing stalls the event loop, and a load of
concurrent streams with disconnects ends with every request accounted for.

The server is the real app under real uvicorn on loopback, over the real tiny engine; the checks are
counts, statuses, error shapes and equalities, never how long something took on this machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
httpx2 = pytest.importorskip("httpx2")

from openai_servers import ServerProcess, free_port, hang_guard, wait_for  # noqa: E402,F401


class InProcessServer:
    """create_app over an engine made by `make_engine`, served by uvicorn in a thread."""

    def __init__(self, make_engine, **app_args):
        import uvicorn

        from server.openai.app import create_app

        self.engine = None

        def load():
            self.engine = make_engine()
            return self.engine
        self.app = create_app(load, "tiny", **app_args)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self):
        return self.app.state.serving.api

    def __enter__(self) -> "InProcessServer":
        self.thread.start()
        assert wait_for(lambda: self.server.started and self.app.state.serving.api is not None, 90)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def tiny_engine(tiny_models, **kw):
    from server.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_dir(tiny_models["llama-tir"], max_batch_size=kw.pop("max_batch_size", 8),
                                   max_seq_len=kw.pop("max_seq_len", 384), threads=1, **kw)


@pytest.fixture(scope="module")
def served(tiny_models):
    with InProcessServer(lambda: tiny_engine(tiny_models)) as srv:
        yield srv


def post_raw(base: str, path: str, body: bytes, **kw):
    return httpx2.post(base + path, content=body, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def assert_openai_error(r, status: int, param=None, code=None):
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field,literal", [("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity"),
                                           ("top_p", "-Infinity")])
def test_non_finite_numbers_are_a_400_naming_the_field(served, path, field, literal):
    head = '"messages":[{"role":"user","content":"hi"}]' if path == CHAT else '"prompt":"hi"'
    r = post_raw(served.base, path, f'{{{head},"max_tokens":2,"{field}":{literal}}}'.encode())
    assert "finite" in assert_openai_error(r, 400, field)["message"]


@pytest.mark.parametrize("path,body,param", [
    (CHAT, b'{"messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}', "messages"),
    (CHAT, b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}],"max_tokens":2}', "messages"),
    (COMPLETIONS, b'{"prompt":"x\\udc80","max_tokens":2}', "prompt"),
    (COMPLETIONS, b'{"prompt":["ok","\\ud83d"],"max_tokens":2}', "prompt"),
    (COMPLETIONS, b'{"prompt":"ok","stop":["\\ud800"],"max_tokens":2}', "stop"),
])
def test_text_that_is_not_unicode_is_a_400(served, path, body, param):
    err = assert_openai_error(post_raw(served.base, path, body), 400, param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("role", ["wizard", "", "USER", "tool", "function"])
def test_unknown_roles_are_a_400(served, role):
    body = json.dumps({"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}).encode()
    err = assert_openai_error(post_raw(served.base, CHAT, body), 400, "messages[0].role")
    assert "system, developer, user, assistant" in err["message"]


def test_developer_is_a_system_message(served):
    r = post_raw(served.base, CHAT, json.dumps({"messages": [{"role": "developer", "content": "Be brief."},
                                                             {"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "temperature": 0}).encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,field", [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"),
                                        (COMPLETIONS, "max_tokens")])
def test_max_tokens_beyond_the_context_is_a_400_with_both_numbers(served, path, field):
    head = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    r = post_raw(served.base, path, json.dumps({**head, field: 1_000_000_000}).encode())
    err = assert_openai_error(r, 400, field, "context_length_exceeded")
    assert "384" in err["message"] and "1000000000" in err["message"], err  # the context and the ask


def test_a_prompt_that_fills_the_context_is_refused_and_one_that_fits_is_served(served):
    prompt = [5] * 383
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
    assert_openai_error(r, 400, "max_tokens", "context_length_exceeded")
    # the default max_tokens of a completion fits what is left instead of being refused
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": prompt, "temperature": 0}).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("seed,n", [(2 ** 64, 1), (10 ** 30, 1), (-(2 ** 63) - 1, 1), (2 ** 64 - 1, 2)])
def test_a_seed_a_generator_cannot_take_is_a_400(served, seed, n):
    """A seed is 64 bits; choice i of n samples with seed + i, so the last must fit too (these were 500s)."""
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 2, "seed": seed, "n": n}).encode())
    assert "seed must lie in" in assert_openai_error(r, 400, "seed")["message"]
    ok = {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 64 - 2, "n": 2}
    assert post_raw(served.base, COMPLETIONS, json.dumps(ok).encode()).status_code == 200


def test_a_request_of_too_many_completions_is_a_400_before_it_queues(served):
    """prompts x n is capped (MAX_CHOICES): one body of a thousand prompts at n=128 would queue 128k requests
    ahead of every other client."""
    from server.openai.parsing import MAX_CHOICES

    before = served.engine.stats.requests
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": ["a"] * 1000, "n": 128, "max_tokens": 1}).encode())
    assert "1000 x 128" in assert_openai_error(r, 400, "n")["message"]
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": ["a"] * (MAX_CHOICES + 1), "max_tokens": 1}).encode())
    assert_openai_error(r, 400, "prompt")
    assert served.engine.stats.requests == before  # neither reached the engine


def test_stop_token_ids_outside_the_vocabulary_are_a_400(served):
    for ids in ([-1], [10 ** 30], [1, 2, 1_000_000]):
        r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 2,
                                                          "stop_token_ids": ids}).encode())
        assert_openai_error(r, 400, "stop_token_ids")


def test_a_refused_value_is_quoted_back_cut_short(served):
    """An error quotes what it refused, not megabytes of it."""
    for body in ({"prompt": "hi", "model": "m" * 1_000_000}, {"prompt": "hi", "stop": [1] * 200_000},
                 {"prompt": "hi", "max_tokens": "9" * 1_000_000}, {"prompt": "hi", "stop_token_ids": ["x"] * 10 ** 5}):
        r = post_raw(served.base, COMPLETIONS, json.dumps(body).encode())
        assert r.status_code in (400, 404) and len(r.content) < 2000, (r.status_code, len(r.content))
    key = "k" * 1_000_000 + "\\ud800"  # a lone surrogate in a megabyte-long key
    r = post_raw(served.base, COMPLETIONS, ('{"prompt": "hi", "' + key + '": 1}').encode())
    assert r.status_code == 400 and "surrogate" in r.text and len(r.content) < 2000, (r.status_code, len(r.content))


def test_malformed_bodies_are_a_400(served):
    for body in (b"", b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b"[" * 100_000):
        assert_openai_error(post_raw(served.base, CHAT, body), 400)
    # a Content-Length that is not a number (no client library sends one: a raw socket does)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        status = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status.split()[1] == b"400", status


def test_a_server_fault_is_a_json_500_with_the_request_id(tiny_models):
    """An engine that breaks with an unexpected exception: the client gets the OpenAI error shape with
    the request id (its own x-request-id when it sent one), streamed or not; the server goes on."""
    class Faulty:
        def __init__(self):
            self.inner = tiny_engine(tiny_models)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def generate(self, request):
            if "boom" in self.inner.detokenize(list(request.prompt)):
                raise TypeError("an engine bug")
            async for ev in self.inner.generate(request):
                yield ev
    with InProcessServer(Faulty) as srv:
        r = post_raw(srv.base, COMPLETIONS, b'{"prompt":"boom","max_tokens":2}', )
        err = assert_openai_error(r, 500)
        assert err["type"] == "server_error" and r.headers["x-request-id"] in err["message"]
        r = httpx2.post(srv.base + COMPLETIONS, json={"prompt": "boom", "max_tokens": 2}, timeout=30,
                        headers={"x-request-id": "client-chosen-id"})
        assert r.status_code == 500 and "client-chosen-id" in r.json()["error"]["message"]
        with httpx2.stream("POST", srv.base + COMPLETIONS, json={"prompt": "boom", "max_tokens": 2, "stream": True},
                           timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert json.loads(events[0][5:])["error"]["type"] == "server_error" and events[-1] == "data: [DONE]"
        ok = post_raw(srv.base, COMPLETIONS, b'{"prompt":"fine","max_tokens":2}')
        assert ok.status_code == 200


def test_an_oversized_body_is_a_413_before_it_is_read_and_health_keeps_answering(tiny_models):
    limit = 1 << 20
    with InProcessServer(lambda: tiny_engine(tiny_models), max_request_bytes=limit) as srv:
        big = b'{"prompt":"' + b"a" * (20 << 20) + b'"}'
        err = assert_openai_error(post_raw(srv.base, COMPLETIONS, big), 413, code="request_too_large")
        assert str(limit) in err["message"]

        def chunks():  # no Content-Length: refused while reading
            yield b'{"prompt":"'
            for _ in range(40):
                yield b"b" * (64 << 10)
            yield b'"}'
        r = httpx2.post(srv.base + COMPLETIONS, content=chunks(), timeout=60)
        assert_openai_error(r, 413, code="request_too_large")
        assert httpx2.get(srv.base + "/health", timeout=30).status_code == 200
        # under the byte limit but longer than any max_input_len prompt can be: refused before tokenizing
        text = "word " * ((limit - 1000) // 5)
        api = srv.api
        assert len(text) > api.parser.max_input_len * api.parser.max_chars_per_token
        r = post_raw(srv.base, COMPLETIONS, json.dumps({"prompt": text, "max_tokens": 2}).encode())
        assert_openai_error(r, 400, "prompt", "context_length_exceeded")


def test_the_event_loop_answers_health_while_a_request_is_being_tokenized(tiny_models):
    """Tokenizing runs off the event loop: with a tokenizer held mid-call, /health, /metrics and other
    requests' streams still answer; released, the held request completes."""
    release, entered = threading.Event(), threading.Event()

    class SlowTokenizer:
        def __init__(self):
            self.inner = tiny_engine(tiny_models)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def tokenize(self, text):
            if "hold me" in text:
                entered.set()
                assert release.wait(60)
            return self.inner.tokenize(text)
    with InProcessServer(SlowTokenizer) as srv:
        held = {}

        def send():
            held["r"] = post_raw(srv.base, COMPLETIONS, b'{"prompt":"hold me","max_tokens":2,"temperature":0}')
        t = threading.Thread(target=send)
        t.start()
        try:
            assert entered.wait(30)
            for _ in range(5):
                assert httpx2.get(srv.base + "/health", timeout=10).status_code == 200
                assert httpx2.get(srv.base + "/metrics", timeout=10).status_code == 200
            assert httpx2.get(srv.base + "/v1/models", timeout=10).status_code == 200
        finally:
            release.set()
            t.join(60)
        assert held["r"].status_code == 200


def test_memory_returns_after_refused_oversized_requests(tiny_models, tmp_path):
    """The real `make serve` process: three 20 MB bodies are refused (413) without the server holding
    them: its resident memory stays within a few MB of where it was."""
    srv = ServerProcess(tiny_models["llama-tir"], tmp_path / "server.log", "--max-request-bytes", str(1 << 20)).start()
    try:
        srv.wait_ready()

        def rss_mb() -> float:
            for line in open(f"/proc/{srv.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
            raise AssertionError("no VmRSS")
        assert httpx2.get(srv.base + "/health", timeout=30).status_code == 200
        before = rss_mb()
        big = b'{"prompt":"' + b"a" * (20 << 20) + b'"}'
        for _ in range(3):
            assert post_raw(srv.base, COMPLETIONS, big).status_code == 413
        assert httpx2.get(srv.base + "/health", timeout=30).status_code == 200
        assert rss_mb() - before < 15, (before, rss_mb())
    finally:
        srv.kill()


def test_load_with_disconnects_accounts_for_every_request(served):
    """24 concurrent streams; every third client hangs up after its first chunk. Every request ends
    (finished or cancelled), the counters add up, nothing is left running, and the server serves after."""
    api = served.api
    before = dict(api.finished)

    async def one(i: int, client) -> str:
        body = {"prompt": f"Stream {i}:", "max_tokens": 40, "temperature": 0.8, "seed": i, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", served.base + COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if i % 3 == 0 and line.startswith("data:"):
                    return "left"
                if line == "data: [DONE]":
                    return "done"
        return "cut"

    async def main():
        async with httpx2.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(i, client) for i in range(24)))
    outcomes = asyncio.run(main())
    assert outcomes.count("done") == 16 and outcomes.count("left") == 8
    after = lambda k: api.finished.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert wait_for(lambda: api.running == 0 and sum(after(k) for k in api.finished) == 24)
    assert after("length") + after("cancelled") == 24 and after("length") >= 16
    r = post_raw(served.base, COMPLETIONS, b'{"prompt":"after","max_tokens":3,"temperature":0}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_stop_lists_are_bounded(served):
    """Stop strings and stop ids are matched against every token of every sequence on the engine's thread: a
    request may not bring thousands of them (a 600k-string list stalled every client for minutes)."""
    from aimo_spec.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    before = served.engine.stats.requests
    for extra in ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, {"stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
                  {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}):
        r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 2, **extra}).encode())
        assert_openai_error(r, 400, next(iter(extra)))
    assert served.engine.stats.requests == before
    ok = {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)],
          "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS}
    assert post_raw(served.base, COMPLETIONS, json.dumps(ok).encode()).status_code == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_cache_salt_keeps_prefix_reuse_within_its_tenant(served, monkeypatch, path):
    """Reused KV shows in cached_tokens and the first-token time, telling a client how another's prompt began:
    requests with a cache_salt share KV only with their salt (vLLM's field); a backend that cannot keep salts
    apart refuses the field rather than ignore it; a refused salt is not echoed (it is its tenant's secret)."""
    import uuid

    from server.openai.parsing import MAX_CACHE_SALT_CHARS

    def body(salt="absent", **extra):
        text = f"The tenant's secret preamble {path}: 1, 2, 3, 4,"
        head = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
        return {**head, "max_tokens": 2, **({} if salt == "absent" else {"cache_salt": salt}), **extra}

    def cached(salt="absent"):
        r = post_raw(served.base, path, json.dumps(body(salt)).encode())
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    assert cached(a) == 0 and cached(b) == 0 and cached(a) > 0
    assert cached() == 0 and cached(None) > 0 and cached(uuid.uuid4().hex) == 0  # null: unsalted
    secret = "s3cret-" + "x" * MAX_CACHE_SALT_CHARS
    for bad in (7, "", secret, ["a"]):
        r = post_raw(served.base, path, json.dumps(body(bad)).encode())
        assert "s3cret" not in assert_openai_error(r, 400, "cache_salt")["message"]
    monkeypatch.setattr(served.engine, "separates_cache_salts", False)
    r = post_raw(served.base, path, json.dumps(body("a")).encode())
    assert "shares its KV cache" in assert_openai_error(r, 400, "cache_salt")["message"]


def test_a_tiny_temperature_samples_greedily(served):
    """logits / 1e-38 overflows float32 (NaN probabilities drew token 0): temperatures under 1e-5 are greedy."""
    def tokens(t):
        body = {"prompt": "Count: 1, 2,", "max_tokens": 6, "temperature": t, "seed": 3, "ignore_eos": True,
                "return_token_ids": True}
        r = post_raw(served.base, COMPLETIONS, json.dumps(body).encode())
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    greedy = tokens(0)
    assert tokens(1e-38) == greedy and tokens(5e-324) == greedy and tokens(1e-6) == greedy


def test_a_request_id_is_echoed_only_as_a_header_can_carry_it(served):
    """An id whose 64-character cut ends in a space (or holds control bytes) got no HTTP answer at all."""
    for header, expect in (("a" * 63 + " tail", "a" * 63), ("id\twith tab", "idwithtab"), (b"\xe9\xe9", None)):
        r = httpx2.post(served.base + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1},
                        headers={"x-request-id": header}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == expect if expect else len(r.headers["x-request-id"]) == 32


def test_length_guards_hold_before_templating_and_tokenizing(served, monkeypatch):
    """Chat: more messages than max_input_len tokens can hold (empty ones passed the character guard and were
    templated and tokenized: seconds of the one parse thread) are refused untemplated. Completions: a list of
    prompts stops at the first one over the limit, the rest never tokenized."""
    api = served.api
    r = post_raw(served.base, CHAT, json.dumps({"messages": [{"role": "user"}] * (api.parser.max_input_len + 1),
                                                "max_tokens": 1}).encode())
    assert_openai_error(r, 400, "messages", "context_length_exceeded")
    calls = []
    tokenize = api.parser.engine.tokenize
    monkeypatch.setattr(api.parser.engine, "tokenize", lambda text: calls.append(len(text)) or tokenize(text))
    over = "word " * api.parser.max_input_len  # over the token limit, under the character guard
    r = post_raw(served.base, COMPLETIONS, json.dumps({"prompt": [over] * 5, "max_tokens": 1}).encode())
    assert_openai_error(r, 400, "prompt", "context_length_exceeded")
    assert len(calls) == 1


def test_a_client_that_hangs_up_mid_body_is_not_a_server_fault(served, caplog):
    """A body cut short by the client is a 499 for nobody, not an 'internal server error' with a traceback."""
    import logging
    import time

    caplog.set_level(logging.ERROR)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    assert httpx2.get(served.base + "/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and served.api is None:
        time.sleep(0.1)
    assert post_raw(served.base, COMPLETIONS, b'{"prompt":"hi","max_tokens":1}').status_code == 200
    assert not [r for r in caplog.records if "failed" in r.getMessage()], [r.getMessage() for r in caplog.records]


def _hold_body(port: int, declared: int, sent: int) -> socket.socket:
    """A connection that declares a body of `declared` bytes, sends `sent` of them and waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % declared + b"{\"prompt\": \"" + b"a" * (sent - 12))
    return sock


def _status(sock: socket.socket) -> int:
    return int(sock.recv(4096).split(b"\r\n", 1)[0].split()[1])


def test_bodies_being_read_at_once_are_bounded_in_bytes_together(tiny_models):
    """Bodies being read at once may hold at most pending_body_bytes together (503 for the one past it):
    clients holding bodies open held server memory without bound. Their bytes are let go when they leave."""
    import time

    with InProcessServer(lambda: tiny_engine(tiny_models), max_request_bytes=10_000, body_seconds=600,
                         pending_body_bytes=25_000) as srv:
        held = [_hold_body(srv.port, 10_000, 9_000) for _ in range(2)]
        deadline = time.monotonic() + 30
        while srv.app.state.reading_body["bytes"] < 18_000 and time.monotonic() < deadline:
            time.sleep(0.02)
        third = _hold_body(srv.port, 10_000, 9_000)
        assert _status(third) == 503
        for s in held + [third]:
            s.close()
        deadline = time.monotonic() + 30
        while srv.app.state.reading_body["bytes"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.app.state.reading_body["bytes"] == 0
        assert post_raw(srv.base, COMPLETIONS, b'{"prompt":"hi","max_tokens":1}').status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_a_408(tiny_models):
    with InProcessServer(lambda: tiny_engine(tiny_models), body_seconds=1) as srv:
        sock = _hold_body(srv.port, 10_000, 5_000)
        assert _status(sock) == 408
        sock.close()
        assert post_raw(srv.base, COMPLETIONS, b'{"prompt":"hi","max_tokens":1}').status_code == 200

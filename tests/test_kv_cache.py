"""The FP8 KV cache of the embedded runners: both runners keep the same cache (values and scales) and
give the same logits (up to another CPU's kernel rounding), prefix copies, swaps and a growing cache
included; its logits stay close to the model-dtype cache's without being equal (it quantizes); the
engine serves with it end to end."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aimo_spec.protocol import Request, SamplingParams, collect

PROMPTS = [[1, 5, 9, 22, 40], [3, 4], [7, 8, 9, 10, 11, 12, 13]]


def _prefilled(runner):
    for slot, p in enumerate(PROMPTS):
        runner.prefill(slot, p, 0)
    runner.copy(2, 3, 7)
    runner.swap(0, 1, 5)
    return runner


def test_both_runners_keep_the_same_fp8_cache_and_logits(tiny_models):
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model
    from server.embedded.runner import SlotRunner

    for name in ("llama-tir", "qwen-tir"):
        model = load_model(tiny_models[name])
        # the slot runner starts with 8 positions: its FP8 cache and scales grow twice during the test
        a = _prefilled(SlotRunner(model, 4, 128, initial_capacity=8, kv_cache_dtype="fp8"))
        b = _prefilled(GraphRunner(model, 4, 128, kv_cache_dtype="fp8"))
        assert a.k[0].dtype == b.k[0].dtype == torch.float8_e4m3fn and a.k_scale and b.v_scale
        toks, pos = [5, 6, 7, 8], [2, 5, 7, 7]
        for _ in range(20):  # bit for bit on the CI machine; another CPU's SDPA kernels may round otherwise
            la, lb = a.decode(toks, pos), b.decode(toks, pos)
            torch.testing.assert_close(la, lb, rtol=0.02, atol=0.02, msg=name)
            toks, pos = la.argmax(-1).tolist(), [p + 1 for p in pos]
        assert a.capacity == 32
        for i in range(len(a.k)):
            n = a.capacity
            assert torch.equal(a.k[i][:4, :, :n].float(), b.k[i][:4, :, :n].float())
            assert torch.equal(a.v_scale[i][:4, :, :n], b.v_scale[i][:4, :, :n])
        va, vb = a.verify([[1, 2, 3]] * 4, pos), b.verify([[1, 2, 3]] * 4, pos)
        torch.testing.assert_close(va, vb, rtol=0.02, atol=0.02, msg=name)


def test_the_fp8_cache_quantizes_and_stays_close(tiny_models):
    from server.embedded.loader import load_model
    from server.embedded.runner import SlotRunner

    model = load_model(tiny_models["qwen-tir"]).float()
    exact = _prefilled(SlotRunner(model, 4, 64))
    fp8 = _prefilled(SlotRunner(model, 4, 64, kv_cache_dtype="fp8"))
    toks, pos = [5, 6, 7, 8], [2, 5, 7, 7]
    worst_kl = 0.0
    for _ in range(10):
        le, lf = exact.decode(toks, pos), fp8.decode(toks, pos)
        assert not torch.equal(le, lf)  # the cache is quantized, not kept at the model's precision
        kl = torch.nn.functional.kl_div(lf.log_softmax(-1), le.log_softmax(-1), log_target=True, reduction="none")
        worst_kl = max(worst_kl, kl.sum(-1).max().item())
        toks, pos = le.argmax(-1).tolist(), [p + 1 for p in pos]
    assert worst_kl < 0.05, worst_kl


def test_a_kv_cache_dtype_the_runner_does_not_know_is_named(tiny_models):
    from server.embedded.loader import load_model
    from server.embedded.runner import SlotRunner

    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        SlotRunner(load_model(tiny_models["llama-tir"]), 2, 32, kv_cache_dtype="int4")


def test_the_split_kernel_is_cuda_only_in_the_graph_runner(tiny_models):
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    model = load_model(tiny_models["llama-tir"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA kernel"), pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")  # the tests run it under the interpreter (test_graph_prefill.py)
            GraphRunner(model, 2, 32, attention="split")
    assert GraphRunner(model, 2, 32, kv_cache_dtype="fp8").attention == "rows"  # the CPU reads it dequantized
    runner = GraphRunner(model, 2, 32)  # auto: the split kernel on CUDA (every step shape), rows on a CPU
    want = "split" if torch.cuda.is_available() else "rows"
    assert runner.attention == want  # one form for every step shape (decode, verify, any context)


def test_the_engine_serves_with_an_fp8_cache(tiny_models):
    from server.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine.from_dir(tiny_models["llama-tir"], device="cpu", kv_cache_dtype="fp8", max_batch_size=2,
                                  max_seq_len=256)
    try:
        assert eng.runner.kv_fp8
        _, out = asyncio.run(collect(eng, Request("What is 2+2?", SamplingParams(temperature=0, max_tokens=12,
                                                                                 ignore_eos=True))))
        assert out.finish_reason == "length" and len(out.token_ids) == 12 and not out.error
    finally:
        eng.shutdown()


class _CountingRunner:
    """A runner double whose next token is the last one plus 1 (a row's own arithmetic), so each reply
    is known in advance: what `runner_replies` must do with rows that end at different steps."""

    vocab = 8

    def __init__(self):
        self.last: dict[int, int] = {}
        self.decodes: list[tuple[list[int], list[int]]] = []

    def _logits(self, tokens):
        return torch.nn.functional.one_hot(torch.tensor([(t + 1) % self.vocab for t in tokens]), self.vocab).float()

    def prefill(self, slot, prompt, start):
        self.last[slot] = prompt[-1]
        return self._logits([prompt[-1]])

    def decode(self, tokens, positions):
        self.decodes.append((list(tokens), list(positions)))
        return self._logits(tokens)


class _Tok:
    eos_token_id = 5

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


@pytest.mark.parametrize("slots", [1, 3, 4])
def test_batched_greedy_replies_end_each_row_at_its_eos_or_limit(slots):
    from trtbuild.kv_price import runner_replies

    prompts = [[7, 1], [3], [4], [0]]  # replies 2 3 4 5 | 4 5 | 5 | 1 2 3 4 (the limit)
    runner = _CountingRunner()
    got = runner_replies(runner, _Tok(), prompts, 4, slots)
    assert got.tokens == [[2, 3, 4, 5], [4, 5], [5], [1, 2, 3, 4]]
    assert got.texts[1] == "4 5" and got.prompts == prompts
    if slots == 4:  # one batch: 3 decode steps for all rows; ended rows rewrite their last cell
        assert [len(t) for t, _ in runner.decodes] == [4, 4, 4]
        assert runner.decodes[-1] == ([4, 5, 5, 3], [4, 2, 1, 3])

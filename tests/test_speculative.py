"""Speculative decoding in the embedded engine is exact.

- The acceptance rule (host and device versions) leaves every emitted token distributed as the
  non-speculative sampler's: checked on synthetic distributions by frequency, and shown to catch a
  wrong rule (the same check fails on a rule that resamples from P without removing the draft).
- At temperature 0 the engine's tokens with a drafter are those without it, on both runners, with
  sequences joining a running batch and keeping different numbers of drafts per step; stop strings
  that end inside an accepted run, max_tokens, end of sequence, deadlines behave as without it.
- At temperature > 0 the engine's token frequencies with a drafter match those without it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from streams import engine_thread_held

from aimo_spec.protocol import Request, SamplingParams, collect
from server.embedded import speculative
from server.embedded.engine import EmbeddedEngine
from server.embedded.redrafter import DrafterConfig, ReDrafter
from server.embedded.sampler import draw, row_distribution
from server.embedded.speculative import SpecConfig, accept_device, accept_host

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


# ---- drafters: real ReDrafter modules with chosen weights
def repeat_drafter(model) -> ReDrafter:
    """Drafts 'the previous token again' (logits = E . emb(x)): tiny random models at temperature 0
    fall into repetitions, so many drafts are accepted and runs of different lengths occur."""
    cfg = model.config
    h = cfg.hidden_size
    d = ReDrafter(DrafterConfig(hidden_size=h, vocab_size=cfg.vocab_size, exit_dim=h, num_draft_layers=0, rnn=False))
    with torch.no_grad():
        d.input_proj.weight.zero_()
        d.input_proj.weight[:, h:] = torch.eye(h)
        d.input_proj.bias.zero_()
        d.lm_head[-1].weight.copy_(model.get_input_embeddings().weight.float())
    return d.eval()


def random_drafter(model, seed: int = 0) -> ReDrafter:
    torch.manual_seed(seed)
    cfg = model.config
    return ReDrafter(DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, exit_dim=cfg.hidden_size,
                                   num_draft_layers=1)).eval()


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM

    from aimo_spec.chat import load_tokenizer

    path = tiny_models["llama-cot"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, load_tokenizer(path)


def make_engine(hf, drafter=None, draft_len=3, runner="slot", max_batch=3, **kw):
    spec = SpecConfig(draft_len=draft_len, max_batch=kw.pop("spec_max_batch", 8)) if drafter is not None else None
    return EmbeddedEngine(*hf, max_batch_size=max_batch, max_seq_len=256, threads=1, runner=runner, device="cpu",
                          drafter=drafter, speculative=spec, **kw)


def prompts(tok, n):
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i * 7}?"}], tokenize=False,
                                    add_generation_prompt=True) for i in range(n)]


def run_all(engine, texts, params, stagger=True):
    """Finals in order; `params` is one SamplingParams or one per text."""
    ps = params if isinstance(params, list) else [params] * len(texts)

    async def go():
        first = [asyncio.ensure_future(collect(engine, Request(t, p))) for t, p in zip(texts[:2], ps)]
        if stagger:
            await asyncio.sleep(0.02)  # the others join a running batch
        rest = [asyncio.ensure_future(collect(engine, Request(t, p))) for t, p in zip(texts[2:], ps[2:])]
        return await asyncio.gather(*first, *rest)

    return [final for _, final in asyncio.run(go())]


# ---- the rule on synthetic distributions
def _tv(counts: Counter, probs: dict[int, float], n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def _tv_bound(probs: dict[int, float], n: int) -> float:
    """Three times the expected total-variation distance of n draws from probs (sampling noise only)."""
    import math

    return 3 * 0.5 * sum(math.sqrt(2 * q * (1 - q) / (math.pi * n)) for q in probs.values()) + 1e-3


def _dist(logits_row, p) -> dict[int, float]:
    ids, probs = row_distribution(logits_row, p)
    return {int(i): float(q) for i, q in zip(ids, probs)}


def _wrong_rule(logits, drafts, params, gens):
    """Accepts like the real rule but resamples from P itself at a rejection (the draft not removed):
    the emitted token then over-represents the draft."""
    out = []
    for i, (p, d) in enumerate(zip(params, drafts)):
        for j, tok in enumerate(d):
            ids, probs = row_distribution(logits[i, j], p)
            pd = float(probs[ids == tok].sum())
            if float(torch.rand((), generator=gens[i])) >= pd:
                out.append((j, draw(ids, probs, gens[i])))
                break
        else:
            ids, probs = row_distribution(logits[i, len(d)], p)
            out.append((len(d), draw(ids, probs, gens[i])))
    return out


SYNTH_PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                SamplingParams(temperature=1.3, top_p=0.8)]


def _emitted_frequencies(rule, params, n=6000, device=False):
    """First and second emitted tokens of n independent rows over the same logits and drafts."""
    torch.manual_seed(0)
    vocab, L = 7, 2
    logits = (torch.randn(1, L + 1, vocab) * 1.5).expand(n, L + 1, vocab).contiguous()
    row0 = logits[0, 0]
    # a plausible draft (second most likely), so both acceptance and rejection happen often
    d0 = int(torch.argsort(row0, descending=True)[1])
    d1 = int(torch.argsort(logits[0, 1], descending=True)[0])
    drafts = [[d0, d1]] * n
    ps = [params] * n
    if device:
        keep, nxt = rule(logits, torch.tensor(drafts), ps, list(range(n)), [5] * n)
        verdicts = list(zip(keep.tolist(), nxt.tolist()))
    else:
        verdicts = rule(logits, drafts, ps, [torch.Generator().manual_seed(i) for i in range(n)])
    first, second = Counter(), Counter()
    for k, nxt in verdicts:
        emitted = drafts[0][:k] + [nxt]
        first[emitted[0]] += 1
        if emitted[0] == d0 and len(emitted) > 1:
            second[emitted[1]] += 1
    return logits[0], d0, first, second


@pytest.mark.parametrize("params", SYNTH_PARAMS, ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_acceptance_keeps_the_target_distribution(params, device):
    rule = accept_device if device else accept_host
    logits, d0, first, second = _emitted_frequencies(rule, params, device=device)
    n = sum(first.values())
    p0, p1 = _dist(logits[0], params), _dist(logits[1], params)
    assert _tv(first, p0, n) < _tv_bound(p0, n)
    m = sum(second.values())  # given the first draft was emitted, the next token ~ P_1
    assert m > 300 and _tv(second, p1, m) < _tv_bound(p1, m)


def test_the_frequency_check_catches_a_wrong_rule():
    params = SYNTH_PARAMS[0]
    logits, d0, first, _ = _emitted_frequencies(_wrong_rule, params)
    p0, n = _dist(logits[0], params), sum(first.values())
    assert _tv(first, p0, n) > 2 * _tv_bound(p0, n)


def test_greedy_acceptance_is_the_argmax_run():
    logits = torch.zeros(2, 4, 5)
    for j, t in enumerate([1, 2, 3, 4]):
        logits[:, j, t] = 5.0
    drafts = [[1, 2, 0], [1, 2, 3]]
    g = SamplingParams(temperature=0.0)
    assert accept_host(logits, drafts, [g, g], [torch.Generator()] * 2) == [(2, 3), (3, 4)]
    keep, nxt = accept_device(logits, torch.tensor(drafts), [g, g], [0, 1], [0, 0])
    assert keep.tolist() == [2, 3] and nxt.tolist() == [3, 4]


# ---- the engine
@pytest.mark.parametrize("runner", ["slot", "graph"])
@pytest.mark.parametrize("kind", ["repeat", "random"])
def test_greedy_tokens_identical_with_and_without_the_drafter(hf, runner, kind):
    texts = prompts(hf[1], 5)
    plain = make_engine(hf, runner=runner)
    drafter = repeat_drafter(hf[0]) if kind == "repeat" else random_drafter(hf[0])
    spec = make_engine(hf, drafter, runner=runner)
    try:
        want = run_all(plain, texts, GREEDY)
        got = run_all(spec, texts, GREEDY)
    finally:
        plain.shutdown()
        spec.shutdown()
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert b.draft_tokens > 0 and a.draft_tokens == 0
    st = spec.stats
    assert st.spec_steps > 0 and st.draft_tokens == sum(f.draft_tokens for f in got)
    assert st.accepted_draft_tokens == sum(f.accepted_draft_tokens for f in got)
    assert max(st.batch_sizes) == 3
    if kind == "repeat":  # runs of several accepted drafts, so fewer steps than tokens
        assert st.accepted_draft_tokens > 0.3 * st.draft_tokens
        assert st.steps < 0.7 * plain.stats.steps


def test_stop_string_inside_an_accepted_run_and_limits(hf):
    text = prompts(hf[1], 1)[0]
    plain = make_engine(hf)
    spec = make_engine(hf, repeat_drafter(hf[0]))
    try:
        ref = run_all(plain, [text], SamplingParams(temperature=0.0, max_tokens=40))[0]
        tok = hf[1]
        # a stop string made of the text of tokens 5..7: it ends inside a run of kept drafts
        pieces = [tok.decode(ref.token_ids[:i]) for i in range(len(ref.token_ids) + 1)]
        stop = pieces[8][len(pieces[5]):]
        assert stop.strip()
        cases = [SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)),
                 SamplingParams(temperature=0.0, max_tokens=7),
                 SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(ref.token_ids[6],))]
        for params in cases:
            a = run_all(plain, [text], params)[0]
            b = run_all(spec, [text], params)[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_string) == (a.token_ids, a.text, a.finish_reason,
                                                                            a.stop_string), params
        assert spec.stats.accepted_draft_tokens > 0
        # the next turn reuses the finished sequence's KV exactly, accepted drafts included
        turn2 = spec.tokenize(text) + list(b.token_ids) + spec.tokenize("```output\n42\n```\n")
        a2 = run_all(plain, [turn2], GREEDY)[0]
        b2 = run_all(spec, [turn2], GREEDY)[0]
        assert b2.token_ids == a2.token_ids and b2.cached_tokens > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_above_max_batch_the_engine_decodes_without_drafting(hf):
    texts = prompts(hf[1], 3)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (40, 8, 8)]  # the last 32 steps run alone
    spec = make_engine(hf, repeat_drafter(hf[0]), spec_max_batch=1)
    plain = make_engine(hf)
    try:
        got = run_all(spec, texts, params, stagger=False)
        want = run_all(plain, texts, params, stagger=False)
    finally:
        spec.shutdown()
        plain.shutdown()
    assert [f.token_ids for f in got] == [f.token_ids for f in want]
    assert spec.stats.steps > spec.stats.spec_steps > 0  # both kinds of step ran


def test_sampled_token_frequencies_match_non_speculative(hf):
    """Temperature 1, top-k 5: frequencies of the first three generated tokens over 600 seeds."""
    text = prompts(hf[1], 1)[0]
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=3, seed=s, ignore_eos=True) for s in range(600)]

    def freqs(engine):
        async def go():
            return await asyncio.gather(*(collect(engine, Request(text, p)) for p in params))

        finals = [f for _, f in asyncio.run(go())]
        return [Counter(f.token_ids[j] for f in finals) for j in range(3)], Counter(f.token_ids[:2] for f in finals)

    plain = make_engine(hf, max_batch=8)
    spec = make_engine(hf, repeat_drafter(hf[0]), max_batch=8)
    try:
        (p_pos, p_pair), (s_pos, s_pair) = freqs(plain), freqs(spec)
        accepted = spec.stats.accepted_draft_tokens
    finally:
        plain.shutdown()
        spec.shutdown()
    n = len(params)
    for a, b in zip([*p_pos, p_pair], [*s_pos, s_pair]):  # both sides are samples: sqrt(2) x the noise
        ref = {k: v / n for k, v in a.items()}
        assert _tv(b, ref, n) < 1.5 * _tv_bound(ref, n)
    assert accepted > 0


def test_spec_config_and_drafter_shape_are_checked(hf):
    model, tok = hf
    bad = ReDrafter(DrafterConfig(hidden_size=model.config.hidden_size + 1, vocab_size=model.config.vocab_size,
                                  exit_dim=8, num_draft_layers=0))
    with pytest.raises(ValueError, match="hidden_size"):
        make_engine(hf, bad)
    with pytest.raises(ValueError, match="both a drafter"):
        EmbeddedEngine(model, tok, device="cpu", drafter=repeat_drafter(model))
    default = make_engine(hf, repeat_drafter(model), spec_max_batch=0)  # 0: the device's measured default
    try:
        assert default.spec_max_batch == speculative.DEFAULT_MAX_BATCH["cpu"]
        final = run_all(default, prompts(tok, 1), GREEDY)[0]
        drafted = default.stats.spec_steps > 0
    finally:
        default.shutdown()
    assert drafted == (speculative.DEFAULT_MAX_BATCH["cpu"] >= 1) and final.finish_reason in ("stop", "length")


def test_cancel_and_deadline_with_the_drafter(hf):
    import time

    text = prompts(hf[1], 1)[0]
    spec = make_engine(hf, repeat_drafter(hf[0]))
    try:
        async def go():
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            expired = Request(text, long, deadline=time.monotonic() + 0.05)
            cancelled = Request(text, long)

            async def cancel_midway() -> list:
                events = []
                async for ev in spec.generate(cancelled):
                    events.append(ev)
                    if len(events) == 1:  # streaming: the engine thread waits at its next step for the cancel
                        async with engine_thread_held(spec, queued=1):
                            spec.cancel(cancelled.request_id)
                return events
            return await asyncio.gather(collect(spec, expired), cancel_midway())

        (_, timed_out), events = asyncio.run(go())
        cancelled = events[-1]
        again = run_all(spec, [text], GREEDY)[0]  # the engine serves on after both
    finally:
        spec.shutdown()
    assert timed_out.finish_reason == "timeout" and len(timed_out.token_ids) < 200
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 200
    assert again.finish_reason in ("stop", "length") and not spec.scheduler.running

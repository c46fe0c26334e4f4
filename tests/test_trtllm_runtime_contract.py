"""Contract tests of the TensorRT-LLM 1.2.x runtime over the executor (no GPU and no TensorRT-LLM here;
NOT a GPU run): an engine built against the `tensorrt_llm` double (tests/trtllm_double.py) is opened
by `server.trtllm.engine`, and these tests pin its handling of streamed responses, final responses,
errors, deadlines, cancellation, batching and KV reuse, and what the solver does through it. The
build side is tests/test_trtllm_contract.py; what neither can show is what `make gpu-smoke` checks.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import trtllm_double as dbl
from trtllm_command_double import FakeRunner
from trtllm_contract_kit import drafter_folder, engine_dir, examples, gpu_env, open_engine, project, run  # noqa: F401
from upstream import snapshot

from aimo_spec.protocol import Delta, Final, Request, SamplingParams, collect
from trtbuild import build as build_stage


# ------------------------------------------------------------------ the runtime over the executor
def test_executor_is_configured_for_inflight_batching_and_kv_reuse(engine_dir):
    eng = open_engine(engine_dir, lambda p: [])
    try:
        (_, call), = [c for c in dbl.CALLS if c[0] == "Executor"]
        assert Path(call["model_path"]) == engine_dir / "engine" and call["model_type"] == dbl.ModelType.DECODER_ONLY
        cfg = call["executor_config"]
        assert cfg.max_beam_width == 1 and cfg.batching_type == dbl.BatchingType.INFLIGHT
        assert cfg.max_batch_size == 4 and cfg.max_num_tokens == 1024 and cfg.enable_chunked_context is True
        assert cfg.kv_cache_config.enable_block_reuse is True and cfg.kv_cache_config.free_gpu_memory_fraction == 0.9
        assert cfg.decoding_config is None and eng.tokens_per_block == 4
    finally:
        eng.shutdown()
    assert dbl.Executor.instances[-1].shutdown_called


def test_redrafter_engines_decode_with_explicit_draft_tokens(project, examples, tmp_path):
    recipe = project(drafter={"kind": "redrafter", "path": str(drafter_folder(tmp_path))})
    out = build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=FakeRunner())
    eng = open_engine(out, lambda p: [])
    try:
        cfg = dbl.Executor.instances[-1].config
        assert cfg.decoding_config.decoding_mode.isExplicitDraftTokens()
    finally:
        eng.shutdown()


def test_streams_tokens_then_one_final_and_sends_the_right_request(engine_dir):
    eng = open_engine(engine_dir, None or (lambda p: []))
    reply = eng.tokenize("The answer is 42.") + [eng.eos_id]
    dbl.Executor.script = staticmethod(lambda p: reply)
    try:
        prompt = eng.tokenize(eng.chat_prompt("What is 6 times 7?"))
        deltas, final = run(collect(eng, Request(prompt, SamplingParams(temperature=0, max_tokens=50, seed=7))))
        assert final.finish_reason == "stop" and final.text == "The answer is 42."
        assert list(final.token_ids) == reply and len(deltas) >= len(reply) - 1
        assert "".join(d.text for d in deltas) == final.text and final.prompt_tokens == len(prompt)
        req = dbl.Executor.instances[-1].requests[1]
        assert req.streaming and req.input_token_ids == prompt and req.max_tokens == 50
        assert req.end_id == eng.eos_id and req.output_config.exclude_input_from_output
        assert req.sampling_config.top_k == 1 and req.sampling_config.seed == 7  # temperature 0: greedy
        run(collect(eng, Request(prompt, SamplingParams(temperature=0.7, top_p=0.95, seed=3, max_tokens=5))))
        sc = dbl.Executor.instances[-1].requests[2].sampling_config
        assert (sc.temperature, sc.top_p, sc.top_k, sc.seed) == (0.7, 0.95, None, 3)
    finally:
        eng.shutdown()


def test_stop_string_across_tokens_cancels_the_request(engine_dir):
    eng = open_engine(engine_dir, lambda p: [])
    text = "x = 6 * 7\nprint(x)\n```\nrest that must not appear"
    dbl.Executor.script = staticmethod(lambda p: eng.tokenize(text))
    try:
        _, final = run(collect(eng, Request(eng.tokenize("hi"), SamplingParams(temperature=0, max_tokens=200,
                                                                              stop=("```\n",)))))
        assert final.finish_reason == "stop" and final.stop_string == "```\n"
        assert final.text == "x = 6 * 7\nprint(x)\n```\n"
        assert (final.text + final.overhang) == eng.detokenize(final.token_ids)
        assert 1 in dbl.Executor.instances[-1].cancelled
    finally:
        eng.shutdown()


def test_length_error_cancel_deadline_and_too_long_prompts(engine_dir):
    eng = open_engine(engine_dir, lambda p: [], step=0.01)
    long = eng.tokenize("one two three four five six seven eight nine ten " * 4)
    try:
        dbl.Executor.script = staticmethod(lambda p: long)
        _, final = run(collect(eng, Request([5, 6], SamplingParams(temperature=0, max_tokens=4))))
        assert final.finish_reason == "length" and len(final.token_ids) == 4

        dbl.Executor.script = staticmethod(lambda p: long[:3] + [-1])
        _, final = run(collect(eng, Request([5, 6], SamplingParams(temperature=0, max_tokens=50))))
        assert final.finish_reason == "error" and "scripted executor error" in final.error

        dbl.Executor.script = staticmethod(lambda p: long)

        async def cancel_midway():
            req = Request([5, 6], SamplingParams(temperature=0, max_tokens=100))
            got = []
            async for ev in eng.generate(req):
                got.append(ev)
                if isinstance(ev, Delta) and len(got) == 3:
                    eng.cancel(req.request_id)
            return got
        got = run(cancel_midway())
        assert isinstance(got[-1], Final) and got[-1].finish_reason == "cancelled"
        assert sum(isinstance(e, Final) for e in got) == 1 and len(got[-1].token_ids) < len(long)

        import time as _t
        # 100 tokens at the double's 10 ms a step take over a second: a 0.5 s deadline ends the reply with some
        # tokens (an 80 ms one could pass before the first, three threads away, on a loaded box)
        dbl.Executor.script = staticmethod(lambda p: long * 10)
        _, final = run(collect(eng, Request([5, 6], SamplingParams(temperature=0, max_tokens=100),
                                            deadline=_t.monotonic() + 0.5)))
        assert final.finish_reason == "timeout" and 0 < len(final.token_ids) < 100

        _, final = run(collect(eng, Request(list(range(300)), SamplingParams(max_tokens=5))))
        assert final.finish_reason == "error" and "max_input_len" in final.error
    finally:
        eng.shutdown()
    ex = dbl.Executor.instances[-1]
    assert len(ex.cancelled) >= 2 and len(ex.requests) == 4  # the too-long prompt was never enqueued


def test_concurrent_requests_batch_and_reuse_the_kv_prefix(engine_dir):
    eng = open_engine(engine_dir, lambda p: [], step=0.005)
    dbl.Executor.script = staticmethod(lambda p: [p[-1]] * 6)
    try:
        async def many():
            reqs = [Request(list(range(10, 30)) + [40 + i], SamplingParams(temperature=0, max_tokens=6))
                    for i in range(4)]
            return await asyncio.gather(*(collect(eng, r) for r in reqs))
        results = run(many())
        assert [f.finish_reason for _, f in results] == ["length"] * 4
        assert [f.token_ids[0] for _, f in results] == [40, 41, 42, 43]
        _, again = run(collect(eng, Request(list(range(10, 30)) + [40] + [40] * 6 + [99],
                                            SamplingParams(max_tokens=2))))
        assert again.cached_tokens >= 24  # whole KV blocks of the earlier turn (blocks of 4 tokens)
    finally:
        eng.shutdown()


def test_a_dead_executor_fails_every_request_in_flight(engine_dir):
    eng = open_engine(engine_dir, lambda p: [7] * 1000, step=0.01)
    try:
        async def go():
            task = asyncio.ensure_future(collect(eng, Request([5, 6], SamplingParams(max_tokens=900))))
            await asyncio.sleep(0.05)
            dbl.Executor.instances[-1].die("CUDA error: an illegal memory access")
            return await asyncio.wait_for(task, 10)
        _, final = run(go())
        assert final.finish_reason == "error" and "illegal memory access" in final.error
    finally:
        eng.shutdown()


def test_worker_ranks_wait_for_the_leader_and_exit(engine_dir):
    from server.trtllm.engine import TrtllmEngine

    dbl.Executor.leader = False
    with pytest.raises(SystemExit):
        TrtllmEngine.from_dir(engine_dir)
    assert dbl.Executor.instances[-1].shutdown_called


def test_solve_runs_tir_through_the_trtllm_backend(engine_dir, project, tmp_path, capsys):
    """`server.programs.solve --backend trtllm` end to end: TIR code run in the real sandbox, answers voted."""
    from server.programs.solve import main as solve_main
    from server.trtllm.engine import TrtllmEngine

    recipe = project()
    eng = open_engine(engine_dir, lambda p: [])
    tok = eng.tokenizer
    eng.shutdown()

    def script(prompt):
        if "```output" in tok.decode(prompt):
            return tok("The answer is \\boxed{42}.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return tok("```python\nprint(6 * 7)\n```\nignored", add_special_tokens=False)["input_ids"]
    dbl.Executor.script = staticmethod(script)
    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\nsix,What is 6 times 7?,42\n")
    out = tmp_path / "run"
    assert TrtllmEngine  # the backend solve opens
    rc = solve_main(["--recipe", str(recipe.path), "--problems", str(problems), "--backend", "trtllm",
                     "--samples", "3", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "results.json").read_text())
    assert summary["correct"] == 1 and summary["results"][0]["answer"] == 42
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert traces and all(t["code_calls"] and t["code_calls"][0]["status"] == "ok" for t in traces)


def test_sampled_token_logprob_estimates_the_entropy():
    """TensorRT-LLM returns only the sampled token's logprob: its surprisal stands in for the entropy."""
    from server.tir import topk_entropy

    assert topk_entropy(((5, -0.25),)) == 0.25
    assert topk_entropy(((5, 0.0),)) == 0.0
    assert abs(topk_entropy(((1, -0.6931471805599453), (2, -0.6931471805599453))) - 0.6931471805599453) < 1e-12


def test_streamed_log_probs_are_cumulative_and_the_engine_keeps_only_each_deltas(engine_dir):
    """llmRequest.cpp: a streamed Result's output_token_ids are the new tokens, its log_probs cover every
    token so far; ReDrafter responses carry several tokens. Each Delta must pair its own tokens with
    their own logprobs."""
    st = snapshot()["executor"]["streaming"]
    assert st["output_token_ids_per_delta"] and st["log_probs_cumulative"]
    eng = open_engine(engine_dir, lambda p: list(range(30, 41)))
    dbl.Executor.tokens_per_step = 3
    try:
        deltas, final = run(collect(eng, Request([5, 6], SamplingParams(temperature=0, max_tokens=11,
                                                                         top_logprobs=1))))
        got = [(tok, lp) for d in deltas for ((tok, lp),) in (d.logprobs or ())]
        assert list(final.token_ids) == list(range(30, 41))
        assert got == [(30 + i, dbl.logprob_of(i)) for i in range(11)]
        assert max(len(d.token_ids) for d in deltas) == 3  # several tokens per response
    finally:
        eng.shutdown()

"""`make solve MODEL=mix PROBLEMS=path.csv`: solve a problems file with a built engine.

    python -m server.solve --recipe engines/mix.yaml --problems engines/problems/smoke.csv

Prints progress per problem (stderr), then the results table and the whole-run figures (stdout);
writes `results.json` and `traces.jsonl` (one line per sample) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Optional

from server.protocol import SamplingParams
from trtbuild.recipe import Recipe, RecipeError, load_recipe

BACKENDS = ("auto", "embedded", "trtllm", "triton")


def engine_backend(recipe: Recipe, backend: str) -> str:
    """auto: the trtllm engine when one was built and TensorRT-LLM imports here, else the embedded one."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: solve serves {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    import importlib.util

    built = (recipe.out_dir / "build" / "trtllm" / "engine.json").is_file()
    return "trtllm" if built and importlib.util.find_spec("tensorrt_llm") is not None else "embedded"


def open_engine(recipe: Recipe, backend: str, triton_url: str = "localhost:8001") -> Any:
    if backend == "triton":  # whichever engine the server runs; the tokenizer comes from its build folder
        from server.triton.client import TritonEngine

        for kind in ("trtllm", "embedded"):
            model_dir = recipe.out_dir / "build" / kind / "model"
            if (model_dir / "tokenizer_config.json").is_file():
                return TritonEngine(triton_url, str(model_dir))
        raise FileNotFoundError(f"{recipe.out_dir}/build: no engine (its tokenizer); run `make engine` first")
    chosen = engine_backend(recipe, backend)
    engine_dir = recipe.out_dir / "build" / chosen
    if not (engine_dir / "engine.json").is_file():
        raise FileNotFoundError(f"{engine_dir}/engine.json: no {chosen} engine; run "
                                f"`make engine MODEL={recipe.name} BACKEND={chosen}` first")
    if chosen == "trtllm":
        from server.trtllm.engine import TrtllmEngine

        return TrtllmEngine.from_dir(engine_dir)
    from server.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_dir(engine_dir)


def make_solver(recipe: Recipe, engine: Any, sandbox: Any, samples: Optional[int] = None) -> Any:
    return make_solver_for(recipe.serving, engine, sandbox, samples)


def make_solver_for(s: Any, engine: Any, sandbox: Any, samples: Optional[int] = None) -> Any:
    """A solver from a `serving` section (a recipe's, or the copy in an engine's engine.json)."""
    from server.solver import Solver, SolverConfig
    from server.tir import Tags, TIRClient

    sampling = SamplingParams(temperature=s.sampling.temperature, top_p=s.sampling.top_p, top_k=s.sampling.top_k,
                              max_tokens=s.sampling.max_tokens)
    cfg = SolverConfig.from_spec(s.solver, s.system_prompt)
    if samples:
        cfg = SolverConfig(samples, min(cfg.first, samples), min(cfg.agree, samples), min(cfg.enough, samples),
                           cfg.vote, cfg.modulus, cfg.default_answer, cfg.system_prompt)
    client = TIRClient(engine, sandbox, Tags.from_spec(s.code_tags), sampling, s.max_code_calls, s.output_chars,
                       s.tool.wall_seconds, s.tool.stateful, s.solver.top_logprobs if s.solver.vote == "entropy" else 0)
    return Solver(engine, client, cfg)


def make_sandbox(recipe: Recipe) -> Any:
    from sandbox import Limits, SandboxConfig, SandboxPool

    t = recipe.serving.tool
    return SandboxPool(SandboxConfig(limits=Limits(wall_seconds=t.wall_seconds, memory_mb=t.memory_mb)))


async def _main(args: argparse.Namespace) -> int:
    from server.budget import TimeBudget
    from server.run import log, read_problems, run_problems

    recipe = load_recipe(args.recipe)
    problems = read_problems(args.problems)
    out = Path(args.out or f"runs/{recipe.name}/{Path(args.problems).stem}")
    out.mkdir(parents=True, exist_ok=True)
    log(f"[solve] {len(problems)} problems from {args.problems}; loading the {recipe.name} engine")
    engine = open_engine(recipe, args.backend, args.triton_url)
    sandbox = make_sandbox(recipe)
    log(f"[solve] sandbox: {sandbox.size} warm workers, isolation {sandbox.mechanism}")
    try:
        solver = make_solver(recipe, engine, sandbox, args.samples)
        budget = TimeBudget.from_spec(recipe.serving.budget, len(problems))
        stats = getattr(engine, "stats", None)
        report = await run_problems(solver, problems, budget, out / "traces.jsonl",
                                    (lambda: stats.busy_seconds) if stats else None)
    finally:
        sandbox.close()
        await engine.close()
    print(report.table())
    summary = report.summary()
    summary["results"] = [{"id": r.problem_id, "answer": r.answer, "expected": r.expected, "correct": r.correct,
                           "votes": {str(k): v for k, v in r.votes.items()}, "seconds": r.seconds,
                           "finished": r.finished, "cancelled": r.cancelled, "code_calls": r.code_calls,
                           "tokens": r.tokens, "stop": r.stop_rule, "default_used": r.default_used}
                          for r in report.results]
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    log(f"[solve] wrote {out}/results.json and {out}/traces.jsonl")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.solve", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--problems", required=True, help="CSV with columns id, problem[, answer]")
    ap.add_argument("--backend", default="auto", help="auto | embedded | trtllm | triton (tp > 1: start under mpirun, "
                                                    "see server/trtllm/launch.py)")
    ap.add_argument("--triton-url", default="localhost:8001", help="with --backend triton: the server's gRPC address")
    ap.add_argument("--samples", type=int, default=None, help="override serving.solver.samples")
    ap.add_argument("--out", default=None, help="output folder (default runs/<model>/<problems file stem>)")
    args = ap.parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (RecipeError, ValueError, FileNotFoundError, RuntimeError, ConnectionError) as e:
        print(f"solve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

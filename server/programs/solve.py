"""`make solve MODEL=mix PROBLEMS=path.csv`: solve a problems file with a built engine.

    python -m server.programs.solve --recipe engines/mix.yaml --problems engines/problems/smoke.csv

Prints progress per problem (stderr), then the results table and the whole-run figures (stdout);
writes `results.json` and `traces.jsonl` (one line per sample) to --out. `results.json` is rewritten
atomically after every problem, so a crash, a full disk or Ctrl-C keeps every answer already
computed (Ctrl-C also prints the table of what was done and exits 130).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from aimo_spec.atomic import write_atomic
from aimo_spec.recipe import RecipeError, load_recipe
from server.assembly import build_solver, sandbox_for
from server.backends import SERVING_BACKENDS, open_for_recipe
from server.embedded.settings import serving_settings

INTERRUPTED = 130


def results_json(report: Any) -> str:
    summary = report.summary()
    if report.speculative:
        summary["speculative"] = report.speculative
    if report.engine:
        summary["engine"] = report.engine
    summary["results"] = [{"id": r.problem_id, "answer": r.answer, "expected": r.expected, "correct": r.correct,
                           "votes": {str(k): v for k, v in r.votes.items()}, "seconds": r.seconds,
                           "finished": r.finished, "cancelled": r.cancelled, "code_calls": r.code_calls,
                           "tokens": r.tokens, "stop": r.stop_rule, "default_used": r.default_used}
                          for r in report.results]
    return json.dumps(summary, indent=2)


class ResultsWriter:
    """results.json after every problem; a failed write is logged and remembered, the run goes on."""

    def __init__(self, path: Path, log: Any):
        self.path, self.log = path, log
        self.error: Optional[str] = None

    def __call__(self, report: Any) -> None:
        try:
            write_atomic(self.path, results_json(report))
            self.error = None
        except OSError as e:
            self.error = str(e)
            self.log(f"[solve] WRITE FAILED: {e}; answers so far: "
                     + ", ".join(f"{r.problem_id}={r.answer}" for r in report.results))


RUN_FILES = ("results.json", "traces.jsonl")


def prepare_out(out: Path, log: Any) -> None:
    """The run's folder, made before the engine loads (an error names --out); an earlier run's results and
    traces there are moved into `previous-<time>/` beside them rather than overwritten."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: the folder cannot be made ({e.strerror or e})") from None
    earlier = [out / name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    if not earlier:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.lstat().st_mtime for p in earlier)))
    aside = out / f"previous-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = out / f"previous-{stamp}-{n}"
    try:
        aside.mkdir()
        for p in earlier:
            p.rename(aside / p.name)
    except OSError as e:
        raise ValueError(f"--out {out}: the earlier run's {', '.join(p.name for p in earlier)} could not be moved "
                         f"aside ({e.strerror or e}); pick another --out") from None
    log(f"[solve] {out} held an earlier run: its {', '.join(p.name for p in earlier)} moved to {aside}")


async def _main(args: argparse.Namespace) -> int:
    from server.budget import TimeBudget
    from server.problems import log, read_problems, run_problems

    recipe = load_recipe(args.recipe, check_paths=False)  # serving needs the built engine, not the sources
    serving = serving_settings(recipe)
    problems = read_problems(args.problems)
    out = Path(args.out or f"runs/{recipe.name}/{Path(args.problems).stem}")
    prepare_out(out, log)
    log(f"[solve] {len(problems)} problems from {args.problems}; loading the {recipe.name} engine")
    engine = open_for_recipe(recipe, args.backend, args.triton_url, args.url, serving)
    sandbox = sandbox_for(serving.tool)
    log(f"[solve] sandbox: {sandbox.size} warm workers, isolation {sandbox.mechanism}")
    try:
        solver = build_solver(serving, engine, sandbox, args.samples)
        budget = TimeBudget(serving.budget, len(problems))
        stats = getattr(engine, "stats", None)
        writer = ResultsWriter(out / "results.json", log)
        report = await run_problems(solver, problems, budget, out / "traces.jsonl",
                                    (lambda: stats.busy_seconds) if stats else None, on_result=writer)
    finally:
        sandbox.close()
        await engine.close()
    print(report.table())
    spec = stats.speculative() if stats is not None and hasattr(stats, "speculative") else None
    if spec:
        report.speculative = spec  # results.json carries it (results_json)
        log(f"[solve] speculative decoding: {spec['accepted_draft_tokens']}/{spec['draft_tokens']} drafts accepted "
            f"({100 * spec['acceptance']:.0f}%), {spec['tokens_per_step']:.2f} tokens per sequence per step "
            f"({spec['drafting_steps']} of {spec['steps']} steps drafted)")
    if stats is not None and hasattr(stats, "profile"):
        report.engine = stats.profile()
        log(f"[solve] engine {stats.profile_line()}")
    writer(report)  # the final figures (engine time) too
    if writer.error:
        log(f"[solve] {out}/results.json could not be written ({writer.error}); the table above has every answer")
        return 1
    log(f"[solve] wrote {out}/results.json and {out}/traces.jsonl")
    return INTERRUPTED if report.interrupted else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.solve", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--problems", required=True, help="CSV with columns id, problem[, answer]")
    ap.add_argument("--backend", default="auto", help=" | ".join(SERVING_BACKENDS) + " (tp > 1: start under mpirun, "
                                                    "see server/programs/trtllm_launch.py)")
    ap.add_argument("--triton-url", default="localhost:8001", help="with --backend triton: the server's gRPC address")
    ap.add_argument("--url", default="", help="with --backend openai: OpenAI-compatible server(s), comma-separated "
                                             "(replicas: samples spread over them)")
    ap.add_argument("--samples", type=int, default=None, help="override serving.solver.samples")
    ap.add_argument("--out", default=None, help="output folder (default runs/<model>/<problems file stem>)")
    args = ap.parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:  # after _main printed and wrote what was done
        print("solve: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (RecipeError, ValueError, OSError, RuntimeError, ConnectionError) as e:
        print(f"solve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

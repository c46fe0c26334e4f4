"""`make eval MODEL=mix DATA=problems.csv`: k samples per problem for several variants, side by side.

    python -m server.evaluate --recipe engines/mix.yaml --data engines/problems/smoke.csv --k 8 \
        --variants cot,tir,merged,int8_wo,fp8

Every variant (a source, the merged bf16 model, each quantized export) answers every problem with k
samples run to completion (no early stop), through the real embedded engine, TIR client and sandbox.
The report gives maj@k and pass@k for k = 1..K, computed exactly over all k-subsets; mean reply
length; code calls per solution; tool error and timeout rates; the no-answer rate. It writes
`eval.json` (every sample, for `server.replay`), `report.md`, and plots: accuracy vs k, accuracy vs
wall-clock seconds per problem, reply-length distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from server.metrics import accuracy_at_budget, maj_at_k, pass_at_k


def variant_dirs(recipe: Any) -> dict[str, Path]:
    """Every model the recipe builds that the embedded engine can serve, by name."""
    layout = recipe.layout
    out = {name: recipe.source_model(name) for name in recipe.sources}
    out["merged"] = layout.merged
    for fmt in recipe.quantize.formats:
        out[fmt] = layout.quantized(fmt)
    return out


def sample_record(t: Any, t0: float) -> dict[str, Any]:
    statuses = [c.status for c in t.code_calls]
    return {"answer": t.answer, "tokens": t.tokens, "finish": t.finish, "seconds": round(t.seconds, 3),
            "finished_at": round(t.started - t0 + t.seconds, 3), "code_calls": len(statuses),
            "tool_errors": sum(s in ("error", "killed") for s in statuses),
            "tool_timeouts": sum(s == "timeout" for s in statuses)}


async def _run_variant(engine: Any, sandbox: Any, serving: Any, problems: list, k: int, seconds: float,
                       log: Any) -> list[dict[str, Any]]:
    from server.assembly import build_solver

    solver = build_solver(serving, engine, sandbox, k, all_samples=True)
    out = []
    for i, p in enumerate(problems, start=1):
        t0 = time.monotonic()
        r = await solver.solve(p.id, p.text, time.monotonic() + seconds, p.answer)
        out.append({"id": p.id, "truth": p.answer, "seconds": round(r.seconds, 2),
                    "samples": [sample_record(t, t0) for t in sorted(r.traces, key=lambda t: t.sample)]})
        log(f"  [{i}/{len(problems)}] {p.id}: answers {[s['answer'] for s in out[-1]['samples']]} (truth {p.answer})")
    return out


def summarize(results: list[dict[str, Any]], k: int) -> dict[str, Any]:
    scored = [r for r in results if r["truth"] is not None]
    samples = [s for r in results for s in r["samples"]]
    calls = sum(s["code_calls"] for s in samples)
    ks = list(range(1, k + 1))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0
    return {
        "problems": len(results), "samples": len(samples),
        "maj_at_k": {str(j): round(mean([maj_at_k([s["answer"] for s in r["samples"]], r["truth"], j)
                                         for r in scored if len(r["samples"]) >= j]), 4) for j in ks},
        "pass_at_k": {str(j): round(mean([pass_at_k([s["answer"] for s in r["samples"]], r["truth"], j)
                                          for r in scored if len(r["samples"]) >= j]), 4) for j in ks},
        "reply_tokens_mean": round(mean([s["tokens"] for s in samples]), 1),
        "reply_tokens_median": statistics.median([s["tokens"] for s in samples]) if samples else 0,
        "code_calls_per_solution": round(calls / max(1, len(samples)), 3),
        "tool_error_rate": round(sum(s["tool_errors"] for s in samples) / max(1, calls), 4),
        "tool_timeout_rate": round(sum(s["tool_timeouts"] for s in samples) / max(1, calls), 4),
        "no_answer_rate": round(sum(s["answer"] is None for s in samples) / max(1, len(samples)), 4),
        "seconds_per_problem": round(mean([r["seconds"] for r in results]), 2),
    }


def budget_curve(results: list[dict[str, Any]], grid: list[float]) -> list[float]:
    scored = [r for r in results if r["truth"] is not None]
    return [sum(accuracy_at_budget([(s["answer"], s["finished_at"]) for s in r["samples"]], r["truth"], g)
                for r in scored) / max(1, len(scored)) for g in grid]


def plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["variants"])
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        m = report["variants"][n]["summary"]["maj_at_k"]
        ax.plot([int(j) for j in m], list(m.values()), marker="o", label=n)
    ax.set_xlabel("k (samples per problem)"), ax.set_ylabel("maj@k"), ax.set_title("Accuracy vs k"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "accuracy_vs_k.png", dpi=110), plt.close(fig)
    files.append("accuracy_vs_k.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        c = report["variants"][n]["budget_curve"]
        ax.plot(report["budget_grid"], c, label=n)
    ax.set_xlabel("seconds per problem (all samples launched together)"), ax.set_ylabel("accuracy (majority of finished)")
    ax.set_title("Accuracy vs wall-clock budget"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "accuracy_vs_budget.png", dpi=110), plt.close(fig)
    files.append("accuracy_vs_budget.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([[s["tokens"] for r in report["variants"][n]["results"] for s in r["samples"]] for n in names],
            bins=20, label=names)
    ax.set_xlabel("reply length (model tokens)"), ax.set_ylabel("samples"), ax.set_title("Reply lengths"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "lengths.png", dpi=110), plt.close(fig)
    files.append("lengths.png")
    return files


def markdown(report: dict[str, Any], files: list[str]) -> str:
    k = report["k"]
    names = list(report["variants"])
    s = {n: report["variants"][n]["summary"] for n in names}
    lines = [f"# Evaluation: {report['recipe']} on {report['data']} ({report['problems']} problems, k = {k}, "
             f"at most {report.get('max_tokens')} tokens per sample)", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for j in sorted({1, (k + 1) // 2, k}):
        lines.append(f"| maj@{j} | " + " | ".join(f"{s[n]['maj_at_k'][str(j)]:.3f}" for n in names) + " |")
    for j in sorted({1, k}):
        lines.append(f"| pass@{j} | " + " | ".join(f"{s[n]['pass_at_k'][str(j)]:.3f}" for n in names) + " |")
    for key, label in (("reply_tokens_mean", "mean reply tokens"), ("code_calls_per_solution", "code calls / solution"),
                       ("tool_error_rate", "tool error rate"), ("tool_timeout_rate", "tool timeout rate"),
                       ("no_answer_rate", "no-answer rate"), ("seconds_per_problem", "seconds / problem (k samples)")):
        lines.append(f"| {label} | " + " | ".join(f"{s[n][key]}" for n in names) + " |")
    lines += ["", f"Generated {report['date']} on {report['machine']}; maj@k and pass@k are exact over all k-subsets "
              "(ties go to the answer of the lowest-numbered sample, as the solver's vote).", ""]
    lines += [f"![{f}]({f})" for f in files]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--variants", default="", help="comma list (default: every source, merged, each quantized format)")
    ap.add_argument("--seconds", type=float, default=120.0, help="deadline per problem and variant")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each sample's tokens (default: the recipe's)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--url", default="", help="evaluate what OpenAI-compatible server(s) serve (comma-separated "
                                             "replicas; one variant, 'served') instead of the recipe's variants")
    args = ap.parse_args(argv)
    import os
    import platform

    from server.assembly import sandbox_for
    from server.embedded.engine import EmbeddedEngine
    from server.problems import log, read_problems
    from trtbuild.core.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
        problems = read_problems(args.data)
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    serving = recipe.serving
    if args.max_tokens:
        import dataclasses

        serving = dataclasses.replace(serving, sampling=dataclasses.replace(serving.sampling, max_tokens=args.max_tokens))
    dirs = variant_dirs(recipe) if not args.url else {"served": Path(args.url)}
    names = [v for v in args.variants.split(",") if v] or list(dirs) if not args.url else ["served"]
    missing = [n for n in names if n not in dirs or not args.url and not (dirs[n] / "config.json").is_file()]
    if missing:
        print(f"eval: variants {missing} not built or unknown (known: {', '.join(dirs)}); run `make engine` first",
              file=sys.stderr)
        return 2
    out = args.out or Path("runs") / recipe.name / "eval"
    out.mkdir(parents=True, exist_ok=True)
    t = recipe.serving.tool
    report: dict[str, Any] = {"recipe": str(args.recipe), "data": str(args.data), "k": args.k,
                              "max_tokens": serving.sampling.max_tokens, "seconds_per_problem": args.seconds,
                              "problems": len(problems), "date": time.strftime("%Y-%m-%d"),
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "variants": {}}
    with sandbox_for(t) as pool:
        for name in names:
            log(f"[eval] {name}: {dirs[name]}")
            if args.url:
                from server.backends import open_for_recipe

                try:
                    engine = open_for_recipe(recipe, "openai", url=args.url)
                except (FileNotFoundError, ConnectionError, ValueError) as e:
                    print(f"eval: {e}", file=sys.stderr)
                    return 2
            else:
                engine = EmbeddedEngine.from_dir(dirs[name])
            try:
                t0 = time.monotonic()
                results = asyncio.run(_run_variant(engine, pool, serving, problems, args.k, args.seconds, log))
            finally:
                engine.shutdown()
            report["variants"][name] = {"dir": args.url or str(dirs[name]), "results": results, "summary": summarize(results, args.k),
                                        "seconds": round(time.monotonic() - t0, 1)}
            stats = getattr(engine, "stats", None)
            spec = stats.speculative() if stats is not None and hasattr(stats, "speculative") else None
            if spec:
                report["variants"][name]["speculative"] = spec
                log(f"[eval] {name}: speculative decoding {spec['tokens_per_step']:.2f} tokens per step, "
                    f"{100 * spec['acceptance']:.0f}% of drafts accepted")
            s = report["variants"][name]["summary"]
            log(f"[eval] {name}: maj@{args.k} {s['maj_at_k'][str(args.k)]:.3f}, pass@{args.k} "
                f"{s['pass_at_k'][str(args.k)]:.3f}, {s['reply_tokens_mean']} tokens, "
                f"{s['code_calls_per_solution']} code calls per solution")
    finishes = sorted(s["finished_at"] for v in report["variants"].values() for r in v["results"] for s in r["samples"])
    top = finishes[-1] if finishes else 1.0
    report["budget_grid"] = [round(top * i / 20, 2) for i in range(1, 21)]
    for v in report["variants"].values():
        v["budget_curve"] = budget_curve(v["results"], report["budget_grid"])
    files = plots(report, out)
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    md = markdown(report, files)
    (out / "report.md").write_text(md)
    print(md)
    log(f"[eval] wrote {out}/eval.json, report.md, {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

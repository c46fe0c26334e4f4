"""`make eval MODEL=mix DATA=problems.csv`: k samples per problem for several variants, side by side.

    python -m server.evaluate --recipe engines/mix.yaml --data engines/problems/smoke.csv --k 8 \
        --variants cot,tir,merged,int8_wo,fp8

Every variant (a source, the merged bf16 model, each quantized export) answers every problem with k
samples run to completion (no early stop), through the real embedded engine, TIR client and sandbox.
The report gives maj@k and pass@k for k = 1..K, computed exactly over all k-subsets; mean reply
length; code calls per solution; tool error and timeout rates; the no-answer rate; and a table of
tool-error kinds (NameError by name, ImportError by module, timeouts, output cut), so preimports and
limits are set from data. It writes `eval.json` (every sample with its entropies, for
`server.replay`), `report.md`, and plots: accuracy vs k, accuracy vs wall-clock seconds per
problem, reply-length distributions.

`--tool-settings before=stateless/200/5,after=stateful/1000/10` runs every variant under each named
tool setting (session kind / output characters fed back / seconds per call), side by side as
`<variant>@<setting>` columns: how the harness defaults are chosen from measurement.
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
from server.toolerrors import error_table


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
            "tool_timeouts": sum(s == "timeout" for s in statuses),
            "error_kinds": [c.error for c in t.code_calls if c.error],
            "output_cut": sum(c.cut for c in t.code_calls), "tool_seconds": round(t.tool_seconds, 3),
            "mean_entropy": t.mean_entropy, "local_entropy": t.local_entropy}


def parse_tool_settings(text: str) -> dict[str, tuple[bool, int, float]]:
    """'before=stateless/200/5,after=stateful/1000/10' -> {name: (stateful, output_chars, seconds)}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, spec = item.partition("=")
        parts = spec.split("/")
        try:
            if not name or len(parts) != 3 or parts[0] not in ("stateful", "stateless"):
                raise ValueError
            out[name] = (parts[0] == "stateful", int(parts[1]), float(parts[2]))
        except ValueError:
            raise ValueError(f"--tool-settings: {item!r} is not NAME=stateful|stateless/CHARS/SECONDS") from None
        if out[name][1] < 1 or out[name][2] <= 0:
            raise ValueError(f"--tool-settings: {item!r}: characters must be >= 1 and seconds > 0")
    return out


def with_tool_setting(serving: Any, setting: tuple[bool, int, float]) -> Any:
    """`serving` with the tool setting (stateful, output_chars, seconds per call)."""
    import dataclasses

    stateful, chars, seconds = setting
    return dataclasses.replace(serving, output_chars=chars,
                               tool=dataclasses.replace(serving.tool, stateful=stateful, wall_seconds=seconds))


async def _run_variant(engine: Any, sandbox: Any, serving: Any, problems: list, k: int, seconds: float,
                       log: Any) -> list[dict[str, Any]]:
    from server.assembly import build_solver
    from server.problems import tools_note

    solver = build_solver(serving, engine, sandbox, k, all_samples=True, logprobs=True)
    out = []
    for i, p in enumerate(problems, start=1):
        t0 = time.monotonic()
        r = await solver.solve(p.id, p.text, time.monotonic() + seconds, p.answer)
        # samples whose code calls the sandbox lost measure the sandbox, not the model: a problem that
        # lost its tools was retried (server.solver); its first k sound samples are the ones scored
        ordered = sorted(r.traces, key=lambda t: t.sample)
        sound = [t for t in ordered if not t.tool_faults] + [t for t in ordered if t.tool_faults]
        out.append({"id": p.id, "truth": p.answer, "seconds": round(r.seconds, 2),
                    "samples": [sample_record(t, t0) for t in sound[:k]],
                    "tool_faults": r.tool_faults, "tools_lost": tools_note(r) if r.tool_failure else None})
        log(f"  [{i}/{len(problems)}] {p.id}: answers {[s['answer'] for s in out[-1]['samples']]} (truth {p.answer})"
            + (f"; LOST ITS TOOLS: {out[-1]['tools_lost']}" if r.tool_failure else ""))
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
        "output_cut_rate": round(sum(s.get("output_cut", 0) for s in samples) / max(1, calls), 4),
        "code_calls": calls,
        # error kinds, and "output cut" for calls whose output was cut to the cap (a limit to set from data too)
        "tool_error_kinds": error_table([k for s in samples for k in s.get("error_kinds", [])]
                                        + ["output cut"] * sum(s.get("output_cut", 0) for s in samples), calls),
        "no_answer_rate": round(sum(s["answer"] is None for s in samples) / max(1, len(samples)), 4),
        "seconds_per_problem": round(mean([r["seconds"] for r in results]), 2),
        "tool_faults": sum(r.get("tool_faults", 0) for r in results),
        "tools_lost": {r["id"]: r["tools_lost"] for r in results if r.get("tools_lost")},
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
                       ("output_cut_rate", "output cut rate"),
                       ("no_answer_rate", "no-answer rate"), ("seconds_per_problem", "seconds / problem (k samples)")):
        lines.append(f"| {label} | " + " | ".join(f"{s[n].get(key, '')}" for n in names) + " |")
    lines += ["", *tool_error_lines(s, names)]
    lost = [(n, pid, why) for n in names for pid, why in s[n].get("tools_lost", {}).items()]
    if lost:
        lines += ["", "Problems that lost their tools (code calls lost by the sandbox itself, not the code's errors; "
                  "samples with a lost call are scored only when too few others remain):", ""]
        lines += [f"- {n}: {pid}: {why}" for n, pid, why in lost]
    lines += ["", f"Generated {report['date']} on {report['machine']}; maj@k and pass@k are exact over all k-subsets "
              "(ties go to the answer of the lowest-numbered sample, as the solver's vote).", ""]
    lines += [f"![{f}]({f})" for f in files]
    return "\n".join(lines) + "\n"


def tool_error_lines(summaries: dict[str, dict[str, Any]], names: list[str], top: int = 15) -> list[str]:
    """The tool-error table: per kind, count (share of code calls) per column; the most frequent first."""
    totals: dict[str, int] = {}
    for n in names:
        for kind, count, _ in summaries[n].get("tool_error_kinds", []):
            totals[kind] = totals.get(kind, 0) + count
    if not totals:
        return ["No tool errors (" + ", ".join(f"{n}: {summaries[n].get('code_calls', 0)} code calls" for n in names) + ")."]
    lines = ["Tool errors by kind, count (share of code calls):", "",
             "| kind | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind in sorted(totals, key=lambda k: (-totals[k], k))[:top]:
        cells = []
        for n in names:
            row = next((r for r in summaries[n].get("tool_error_kinds", []) if r[0] == kind), None)
            cells.append(f"{row[1]} ({row[2]:.1%})" if row else "0")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| code calls | " + " | ".join(str(summaries[n].get("code_calls", 0)) for n in names) + " |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--variants", default="", help="comma list (default: every source, merged, each quantized format)")
    ap.add_argument("--seconds", type=float, default=120.0, help="deadline per problem and variant")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each sample's tokens (default: the recipe's)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tool-settings", default="", help="run each variant under these named tool settings, side by "
                                                         "side: NAME=stateful|stateless/CHARS/SECONDS[,...]")
    ap.add_argument("--url", default="", help="evaluate what OpenAI-compatible server(s) serve (comma-separated "
                                             "replicas; one variant, 'served') instead of the recipe's variants")
    args = ap.parse_args(argv)
    import os
    import platform

    from server.assembly import sandbox_for
    from server.embedded.engine import EmbeddedEngine
    from server.embedded.settings import serving_settings
    from server.problems import log, read_problems
    from aimo_spec.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
        serving = serving_settings(recipe)
        problems = read_problems(args.data)
        settings = parse_tool_settings(args.tool_settings)
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
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
    t = serving.tool
    if settings:
        import dataclasses

        t = dataclasses.replace(t, wall_seconds=max(s[2] for s in settings.values()))
    runs = [(name, "", serving) for name in names] if not settings else [
        (name, f"@{label}", with_tool_setting(serving, setting)) for name in names for label, setting in settings.items()]
    report: dict[str, Any] = {"recipe": str(args.recipe), "data": str(args.data), "k": args.k,
                              "max_tokens": serving.sampling.max_tokens, "seconds_per_problem": args.seconds,
                              "problems": len(problems), "date": time.strftime("%Y-%m-%d"),
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "variants": {},
                              "tool_settings": {k: {"stateful": v[0], "output_chars": v[1], "seconds": v[2]}
                                                for k, v in settings.items()}}
    with sandbox_for(t) as pool:
        for name, suffix, run_serving in runs:
            log(f"[eval] {name}{suffix}: {dirs[name]} (stateful {run_serving.tool.stateful}, "
                f"{run_serving.output_chars} characters, {run_serving.tool.wall_seconds} s per call)")
            if args.url:
                from server.backends import open_for_recipe

                try:
                    engine = open_for_recipe(recipe, "openai", url=args.url)
                except (FileNotFoundError, ConnectionError, ValueError) as e:
                    print(f"eval: {e}", file=sys.stderr)
                    return 2
            else:
                engine = EmbeddedEngine.from_dir(dirs[name], serving=serving)
            try:
                t0 = time.monotonic()
                results = asyncio.run(_run_variant(engine, pool, run_serving, problems, args.k, args.seconds, log))
            finally:
                engine.shutdown()
            report["variants"][name + suffix] = {"dir": args.url or str(dirs[name]), "results": results,
                                                 "summary": summarize(results, args.k),
                                                 "seconds": round(time.monotonic() - t0, 1)}
            stats = getattr(engine, "stats", None)
            spec = stats.speculative() if stats is not None and hasattr(stats, "speculative") else None
            if spec:
                report["variants"][name + suffix]["speculative"] = spec
                log(f"[eval] {name}{suffix}: speculative decoding {spec['tokens_per_step']:.2f} tokens per step, "
                    f"{100 * spec['acceptance']:.0f}% of drafts accepted")
            s = report["variants"][name + suffix]["summary"]
            log(f"[eval] {name}{suffix}: maj@{args.k} {s['maj_at_k'][str(args.k)]:.3f}, pass@{args.k} "
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

"""Stage `merge`: mergekit linear merge of the recipe's sources, then two checks.

1. Arithmetic: on sampled tensors, merged == sum_i w_i * theta_i (in fp32) within the output
   dtype's rounding (half an ulp): an exact step must stay exact.
2. Price: KL / token agreement / reply length of the merged model against each source.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import yaml

from merge.config import effective_weights, mergekit_config
from trtbuild import manifest as mf
from trtbuild import sources
from trtbuild.core.recipe import Recipe

VERSION = 1  # bump when the output of this stage changes for the same inputs
STAGE = "merge"


class _TensorIndex:
    """name -> tensor across the safetensors shards of one checkpoint folder."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as s:
                for k in s.keys():
                    self.files[k] = f

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), "pt") as s:
            return s.get_tensor(name)


_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}


def _ulp(x: Any, dtype: Any) -> Any:
    """Spacing of `dtype` numbers around each |x| (2^(e - p) for x = m * 2^e, m in [0.5, 1))."""
    import torch

    bits = _SIGNIFICAND_BITS[str(dtype).replace("torch.", "")]
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - bits).clamp_min(torch.finfo(dtype).tiny)


def check_arithmetic(merged_dir: Path, source_dirs: dict[str, Path], weights: dict[str, float], n: int, seed: int = 0) -> dict[str, Any]:
    """Max error of merged vs the fp32 weighted sum, in absolute terms and in output-dtype ulps."""
    import torch

    out = _TensorIndex(merged_dir)
    srcs = {k: _TensorIndex(d) for k, d in source_dirs.items()}
    common = sorted(set(out.files).intersection(*(s.files for s in srcs.values())))
    names = sorted(random.Random(seed).sample(common, min(n, len(common))))
    worst_abs, worst_ulp, within = 0.0, 0.0, True
    for name in names:
        merged = out.get(name)
        terms = [w * srcs[k].get(name).double() for k, w in weights.items()]
        expected = sum(terms)
        err = (merged.double() - expected).abs()
        ulp = _ulp(expected, merged.dtype)
        # mergekit sums in fp32: its own error scales with the terms, not with their (maybe ~0) sum
        fp32_slack = 4 * 2.0 ** -24 * sum(t.abs() for t in terms)
        err = (err - fp32_slack).clamp_min(0)
        ratio = float((err / ulp).max())
        worst_abs, worst_ulp = max(worst_abs, float((merged.double() - expected).abs().max())), max(worst_ulp, ratio)
        # one rounding of the fp32 sum to the output dtype: <= 0.5 ulp
        within &= ratio <= (0.5 + 1e-3 if merged.dtype != torch.float32 else 4.0)
    return {"tensors_checked": len(names), "max_abs_error": worst_abs, "max_error_ulps": worst_ulp,
            "within_rounding": within, "dtype": str(merged.dtype).replace("torch.", "")}


def fingerprint(recipe: Recipe) -> str:
    return mf.fingerprint({
        "merge": recipe.section("merge"), "quality": recipe.section("quality"),
        "sources": sources.fingerprint(recipe), "version": VERSION,
    })


def run(recipe: Recipe) -> Path:
    final = recipe.out_dir / STAGE
    fp = fingerprint(recipe)
    if mf.up_to_date(final, fp, STAGE):
        return final
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    started = time.time()
    dirs = {name: sources.source_dir(recipe, name) for name in recipe.merge.weights}
    for name, d in dirs.items():
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"merge: source {name!r} has no checkpoint at {d}: run the sources stage first")
    cfg = mergekit_config(recipe.merge, dirs)
    weights = effective_weights(recipe.merge)
    mf.log(STAGE, "linear merge " + " + ".join(f"{w:g}*{k}" for k, w in weights.items()) + " (mergekit) ...")
    with mf.stage_dir(final) as tmp:
        (tmp / "mergekit.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        model_dir = tmp / "model"
        t = time.time()
        run_merge(MergeConfiguration.model_validate(cfg), str(model_dir),
                  MergeOptions(cuda=False, copy_tokenizer=True, lazy_unpickle=False, quiet=True, write_model_card=False))
        merge_seconds = time.time() - t
        check = check_arithmetic(model_dir, dirs, weights, recipe.merge.check_tensors)
        mf.log(STAGE, f"arithmetic check on {check['tensors_checked']} tensors: max error {check['max_abs_error']:.3g} "
               f"({check['max_error_ulps']:.3f} ulp of {check['dtype']}) -> "
               f"{'within rounding' if check['within_rounding'] else 'NOT within rounding'}")
        if not check["within_rounding"]:
            raise RuntimeError(f"merge: merged tensors differ from the weighted sum beyond rounding: {check}")
        quality = _price_against_sources(recipe, model_dir, dirs)
        mf.write_manifest(
            tmp, STAGE, fp, started,
            inputs={k: {"dir": str(d), "files": mf.hash_tree(d)} for k, d in dirs.items()},
            weights=weights, mergekit_config=cfg, merge_seconds=round(merge_seconds, 2),
            arithmetic_check=check, quality=quality, model_dir=str(final / "model"),
        )
    mf.log(STAGE, f"done in {time.time() - started:.1f}s -> {final}")
    return final


def _price_against_sources(recipe: Recipe, merged_dir: Path, dirs: dict[str, Path]) -> dict[str, Any]:
    from trtbuild.core.chat import load_tokenizer
    from server.embedded.loader import use_all_cores
    from trtbuild.quality import price, quality_prompts, record_replies
    from server.embedded.loader import load_model

    use_all_cores()
    tok = load_tokenizer(merged_dir)
    prompts = quality_prompts(recipe, tok)
    merged = load_model(merged_dir)
    q = recipe.quality
    merged_replies = record_replies(merged, tok, prompts, q.max_new_tokens)
    out: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": q.max_new_tokens,
                           "example_reply": merged_replies.texts[0]}
    for name, d in dirs.items():
        mf.log(STAGE, f"quality: merged vs {name} on {len(prompts)} recorded prompts ...")
        src = load_model(d)
        ref = record_replies(src, tok, prompts, q.max_new_tokens)
        p = price(src, merged, tok, ref, q.max_new_tokens, recipe.serving.code_tags, cand=merged_replies)
        mf.log(STAGE, f"quality vs {name}: {p.summary()}")
        out[f"vs_{name}"] = p.as_dict()
        del src
    return out

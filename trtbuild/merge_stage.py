"""Stage `merge`: mergekit linear merge of the recipe's sources, then two checks.

1. Arithmetic (`merge.check`): on sampled tensors, merged == sum_i w_i * theta_i within the output
   dtype's rounding (half an ulp): an exact step must stay exact.
2. Price: KL / token agreement / reply length of the merged model against each source.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from aimo_spec.recipe import Recipe, RecipeError
from merge.check import check_arithmetic
from merge.config import effective_weights, mergekit_config
from trtbuild import manifest as mf
from trtbuild import stages

VERSION = 1  # bump when the output of this stage changes for the same inputs
STAGE = "merge"


# Bytes a merged shard holds (mergekit's `out_shard_size` counts tensor bytes, whatever its help says).
# mergekit keeps a shard's tensors in host memory until it is full: at its default (5e9 bytes) that is
# the whole merged model of anything up to 2.5B parameters in bf16 (a 1.5B's merge peaked at 3.7x its
# bf16 size on an H100 host, bench/scale-gpu-h100.json). 1 GB bounds the held output whatever the
# model; a 14B writes 30 shards (with their index, as HF's do).
SHARD_BYTES = 1_000_000_000


def fingerprint(recipe: Recipe) -> str:
    return mf.fingerprint({
        "merge": recipe.section("merge"), "quality": recipe.section("quality"),
        "sources": stages.fingerprint(recipe, "sources"), "version": VERSION,
    })


def run(recipe: Recipe) -> Path:
    final = recipe.layout.merge
    started = time.time()
    stages.produce(STAGE, final, fingerprint(recipe), lambda tmp: _merge(recipe, tmp, final))
    if time.time() - started > 1:
        mf.log(STAGE, f"done in {time.time() - started:.1f}s -> {final}")
    return final


def same_tensors(recipe: Recipe, dirs: dict[str, Path]) -> None:
    """A linear merge adds tensors of one name and shape: refuse, naming the first difference, sources whose
    common tensors differ in shape (read from their headers), before mergekit loads them and fails midway.
    A tensor one source lacks is mergekit's to judge (a tied lm_head is optional there)."""
    from trtbuild.sources import checkpoint_tensors

    seen: dict[str, tuple[list[int], str]] = {}  # tensor -> (shape, the first source that has it)
    for name, d in dirs.items():
        for tensor, shape in sorted(checkpoint_tensors(d, f"{recipe.path}: sources.{name}").items()):
            first, ref = seen.setdefault(tensor, (shape, name))[::-1]
            if ref != shape:  # sources of .bin files only have no shapes here: not compared
                raise RecipeError(f"{recipe.path}: merge.weights: sources {first!r} and {name!r} cannot be merged "
                                  f"linearly: tensor {tensor[:200]!r} is {ref} in {first!r} and {shape} in "
                                  f"{name!r} (the same architecture and size is needed)")


def _merge(recipe: Recipe, tmp: Path, final: Path) -> dict[str, Any]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    dirs = {name: recipe.source_model(name) for name in recipe.merge.weights}
    for name, d in dirs.items():
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"merge: source {name!r} has no checkpoint at {d}: run the sources stage first")
    same_tensors(recipe, dirs)
    cfg = mergekit_config(recipe.merge, dirs)
    weights = effective_weights(recipe.merge)
    mf.log(STAGE, "linear merge " + " + ".join(f"{w:g}*{k}" for k, w in weights.items()) + " (mergekit) ...")
    (tmp / "mergekit.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    model_dir = tmp / "model"
    t = time.time()
    run_merge(MergeConfiguration.model_validate(cfg), str(model_dir),
              MergeOptions(cuda=False, copy_tokenizer=True, lazy_unpickle=False, quiet=True, write_model_card=False,
                           out_shard_size=SHARD_BYTES))
    merge_seconds = time.time() - t
    check = check_arithmetic(model_dir, dirs, weights, recipe.merge.check_tensors)
    mf.log(STAGE, f"arithmetic check on {check['tensors_checked']} tensors: max error {check['max_abs_error']:.3g} "
           f"({check['max_error_ulps']:.3f} ulp of {check['dtype']}) -> "
           f"{'within rounding' if check['within_rounding'] else 'NOT within rounding'}")
    if not check["within_rounding"]:
        raise RuntimeError(f"merge: merged tensors differ from the weighted sum beyond rounding: {check}")
    quality = _price_against_sources(recipe, model_dir, dirs)
    return dict(inputs={k: {"dir": str(d), "files": mf.hash_tree(d)} for k, d in dirs.items()},
                weights=weights, mergekit_config=cfg, merge_seconds=round(merge_seconds, 2),
                arithmetic_check=check, quality=quality, model_dir=str(final / "model"))


def _price_against_sources(recipe: Recipe, merged_dir: Path, dirs: dict[str, Path]) -> dict[str, Any]:
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import gate_dtype, load_model, stage_device, use_all_cores
    from trtbuild.quality import price, quality_prompts, record_replies

    use_all_cores()
    dev = stage_device()
    dtype = gate_dtype(dev)  # the merge's price is in its weights; compute where it is fast
    tok = load_tokenizer(merged_dir)
    prompts = quality_prompts(recipe, tok)
    merged = load_model(merged_dir, dtype=dtype, device=dev)
    q = recipe.quality
    merged_replies = record_replies(merged, tok, prompts, q.max_new_tokens)
    out: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": q.max_new_tokens,
                           "example_reply": merged_replies.texts[0]}
    for name, d in dirs.items():
        mf.log(STAGE, f"quality: merged vs {name} on {len(prompts)} recorded prompts ...")
        src = load_model(d, dtype=dtype, device=dev)
        ref = record_replies(src, tok, prompts, q.max_new_tokens)
        p = price(src, merged, tok, ref, q.max_new_tokens, recipe.serving.code_tags, cand=merged_replies)
        mf.log(STAGE, f"quality vs {name}: {p.summary()}")
        out[f"vs_{name}"] = p.as_dict()
        del src
    return out

"""Stage `drafter`: train (or take) a ReDrafter head for the served model and measure its acceptance.

`drafter.kind: redrafter` without `path` trains one on the target's own generations; with `path`
the given folder is measured as is. Output `engines/<model>/drafter/`: `model/` (config.json +
model.safetensors, what the trtllm build attaches), `acceptance.json`, and the manifest (data sizes,
training curve and cost, acceptance). `kind: none` skips the stage.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from aimo_spec.recipe import Recipe
from trtbuild import manifest as mf
from trtbuild import stages

VERSION = 1  # bump when the output of this stage changes for the same inputs
STAGE = "drafter"


def target_dir(recipe: Recipe) -> Path:
    """The weights the engine serves: the drafter must match them (quantized, if so)."""
    return recipe.layout.weights(recipe.build.quantization)


def fingerprint(recipe: Recipe) -> str:
    q = recipe.build.quantization
    upstream = stages.weights_fingerprint(recipe)
    s = recipe.section("serving")
    given = recipe.resolve(recipe.drafter.path) / "model.safetensors" if recipe.drafter.path else None
    return mf.fingerprint({
        "drafter": recipe.section("drafter"), "upstream": upstream, "quantization": q,
        "serving": {k: s[k] for k in ("code_tags", "sampling", "max_code_calls", "output_chars", "system_prompt")},
        "given": mf.sha256_file(given) if given and given.is_file() else None, "version": VERSION})


def run(recipe: Recipe) -> Optional[Path]:
    d = recipe.drafter
    if d.kind == "none":
        mf.log(STAGE, "drafter.kind is none: nothing to do")
        return None
    final = recipe.layout.drafter
    return stages.produce(STAGE, final, fingerprint(recipe), lambda tmp: _make(recipe, final, tmp))


def _make(recipe: Recipe, final: Path, tmp: Path) -> dict[str, Any]:
    from server.embedded.loader import load_model, stage_device, use_all_cores
    from trtbuild.drafter import acceptance, data, train

    d = recipe.drafter
    target = target_dir(recipe)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"drafter: no {recipe.build.quantization} weights at {target}: "
                                "run the earlier stages first")
    log = lambda msg: mf.log(STAGE, msg)  # noqa: E731
    t = time.time()
    train_seqs, held = data.generate(recipe, target, train=not d.path, log=log)
    generation_seconds = time.time() - t
    use_all_cores()
    model = load_model(target, device=stage_device())  # hidden states and verification on a GPU when there is one
    training = None
    if d.path:
        drafter = train.load(recipe.resolve(d.path))
        log(f"measuring the given drafter {d.path}")
    else:
        log(f"training: K={d.train.draft_steps} draft steps, {d.train.layers} residual blocks, "
            f"{d.train.steps} steps of {d.train.batch_size}")
        drafter, training = train.train(model, train_seqs, held, d.train, log=log)
        train.export(drafter, tmp / "model")
    t = time.time()
    log(f"acceptance: {d.num_beams} beam(s) x {d.draft_len_per_beam} drafts, greedy verification by the target "
        f"on {d.train.eval_positions} held-out positions ...")
    acc = acceptance.measure(model, drafter, held, d.num_beams, d.draft_len_per_beam, d.train.eval_positions,
                             seed=d.train.seed)
    acc["seconds"] = round(time.time() - t, 1)
    log(f"acceptance: {acc['tokens_per_step']:.3f} tokens per step (speed-up bound), per draft position "
        f"{acc['acceptance_at_position']}")
    (tmp / "acceptance.json").write_text(json.dumps(acc, indent=2) + "\n")
    return dict(
        target=str(target), given=d.path,
        model_dir=str(recipe.resolve(d.path) if d.path else final / "model"),
        config=drafter.config.to_json(),
        data={"train_samples": len(train_seqs), "train_model_tokens": sum(s.model_tokens for s in train_seqs),
              "heldout_samples": len(held), "heldout_model_tokens": sum(s.model_tokens for s in held),
              "generation_seconds": round(generation_seconds, 1)},
        training=training, acceptance=acc,
        files=mf.hash_tree(tmp / "model") if (tmp / "model").is_dir() else {})

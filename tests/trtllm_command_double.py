"""The command-line side of the TensorRT-LLM 1.2.x test double (tests only; contract tests).

`FakeRunner` checks each build command against the upstream flags before "running" it and produces
what the real step writes, including the behaviour that matters between steps: quantize.py's checkpoint
config, the ReDrafter converter excluding the drafter from quantization only when `exclude_modules` is a
list, and trtllm-build failing on quantized drafter layers without scales. The flags, their choices and
the ReDrafter converter's module lists come from the upstream snapshot (`tests/upstream/trtllm_1_2.json`),
as the fake `tensorrt_llm` package's do (tests/trtllm_double.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from upstream import snapshot

UP = snapshot()


# ------------------------------------------------------------------ the command-line contract
# The flags of the three TensorRT-LLM commands the build runs, as upstream's argparse declares them.
COMMANDS = UP["commands"]
FLAGS = {tool: set(c["flags"]) for tool, c in COMMANDS.items()}
BOOLEAN_FLAGS = {f for c in COMMANDS.values() for f, info in c["flags"].items() if not info["takes_value"]}
REDRAFTER = UP["redrafter"]


def parse_flags(tool: str, argv: list[str]) -> dict[str, Optional[str]]:
    """{flag: value}; fails on a flag the tool does not have, a missing value or a value outside its choices."""
    out: dict[str, Optional[str]] = {}
    flags = COMMANDS[tool]["flags"]
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag in flags, f"{tool} has no flag {flag}"
        if not flags[flag]["takes_value"]:
            out[flag], i = None, i + 1
            continue
        assert i + 1 < len(argv) and not argv[i + 1].startswith("--"), f"{tool} {flag} needs a value"
        value, choices = argv[i + 1], flags[flag]["choices"]
        if isinstance(choices, list):
            assert value in [str(c) for c in choices if c is not None], f"{tool} {flag}: {value!r} not in {choices}"
        out[flag], i = value, i + 2
    missing = [f for f, info in flags.items() if info["required"] and f not in out]
    assert not missing, f"{tool}: required flags missing: {missing}"
    return out


def drafter_modules(num_layers: int, rnn: bool) -> list[str]:
    """The modules the ReDrafter converter adds to exclude_modules (the snapshot's lists, expanded)."""
    names = list(REDRAFTER["drafter_modules"]) + (list(REDRAFTER["drafter_modules_rnn"]) if rnn else [])
    for layer in range(num_layers):
        names += [p.replace("{lyrnum}", str(layer)) for p in REDRAFTER["drafter_modules_per_layer"]]
    return names


class FakeRunner:
    """Checks each step's command against the contract, then produces what the real command writes."""

    def __init__(self, fail_step: Optional[str] = None):
        self.commands: list[tuple[str, list[str], dict[str, str]]] = []
        self.fail_step = fail_step

    def __call__(self, step: Any, cmd: list[str], env: dict[str, str]) -> None:
        self.commands.append((step.name, cmd, env))
        if step.name == self.fail_step:
            raise RuntimeError(f"trtllm {step.name} step failed (exit 1): {' '.join(cmd)}")
        if cmd[1:3] == ["-m", "trtbuild.programs.trtllm_convert"]:
            from trtbuild.programs.trtllm_convert import main

            assert main(cmd[3:]) == 0
            return
        script = len(cmd) > 1 and cmd[1].endswith(".py")  # [python, examples/.../x.py, ...] or [trtllm-build, ...]
        tool, args = (Path(cmd[1]).name, cmd[2:]) if script else (Path(cmd[0]).name, cmd[1:])
        flags = parse_flags(tool, args)
        out = Path(flags["--output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        {"trtllm-build": self._build, "quantize.py": self._quantize,
         "convert_checkpoint.py": self._redrafter}[tool](flags, out)

    @staticmethod
    def _ranks(out: Path, tp: int) -> None:
        for r in range(tp):
            (out / f"rank{r}.safetensors").write_bytes(b"fake")

    def _quantize(self, flags: dict[str, Optional[str]], out: Path) -> None:
        """quantize.py's checkpoint: int8_wo is W8A16 (weights quantized at build), fp8 is FP8. What ModelOpt
        writes as exclude_modules was not read (snapshot not_read): modelled as null, the case that breaks."""
        algo = {"fp8": "FP8", "int8_wo": "W8A16", "full_prec": None}[flags["--qformat"] or "full_prec"]
        kv = {"fp8": "FP8", "int8": "INT8", None: None}[flags.get("--kv_cache_dtype")]
        tp = int(flags.get("--tp_size") or 1)
        (out / "config.json").write_text(json.dumps({
            "architecture": "Qwen2ForCausalLM", "mapping": {"tp_size": tp, "world_size": tp}, "tool": "quantize.py",
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": None}}))
        self._ranks(out, tp)

    def _redrafter(self, flags: dict[str, Optional[str]], out: Path) -> None:
        """convert_checkpoint.py: the base config with the drafter added; the drafter joins exclude_modules
        only when the base checkpoint has a list there (upstream's rule)."""
        base = json.loads((Path(flags["--base_model_checkpoint_dir"]) / "config.json").read_text())
        drafter = json.loads((Path(flags["--drafter_model_dir"]) / "config.json").read_text())
        config = dict(base, base_model_architecture=base.get("architecture"),
                      architecture=REDRAFTER["architecture_map"].get(base.get("architecture"), "unsupported"),
                      redrafter_num_layers=drafter["num_draft_layers"], redrafter_is_rnn=drafter["rnn"])
        quant = dict(config.get("quantization") or {})
        if quant.get("exclude_modules") is not None:
            quant["exclude_modules"] = list(quant["exclude_modules"]) + drafter_modules(drafter["num_draft_layers"],
                                                                                        drafter["rnn"])
        config["quantization"] = quant
        tp = int(flags.get("--tp_size") or 1)
        config["mapping"] = {"tp_size": tp, "world_size": tp}
        (out / "config.json").write_text(json.dumps(config))
        self._ranks(out, tp)

    def _build(self, flags: dict[str, Optional[str]], out: Path) -> None:
        """trtllm-build: a quantized ReDrafter checkpoint whose drafter is not excluded has drafter linears
        turned into quantized layers whose scales the checkpoint lacks: the build stops."""
        src = json.loads((Path(flags["--checkpoint_dir"]) / "config.json").read_text())
        quant = src.get("quantization") or {}
        if src.get("architecture", "").startswith("ReDrafter") and quant.get("quant_algo"):
            excluded = set(quant.get("exclude_modules") or [])
            needed = drafter_modules(src["redrafter_num_layers"], src["redrafter_is_rnn"])
            if not set(needed) <= excluded:
                raise RuntimeError(f"trtllm-build: Required but not provided tensors: drafter.layers.0.linear "
                                   f"per-channel scales ({quant['quant_algo']} drafter; exclude_modules "
                                   f"{quant.get('exclude_modules')})")
        (out / "config.json").write_text(json.dumps({"pretrained_config": src, "build_config": {
            "max_batch_size": int(flags["--max_batch_size"]), "plugin_config": {"tokens_per_block": 4}}}))
        for r in range(src.get("mapping", {}).get("tp_size", 1)):
            (out / f"rank{r}.engine").write_bytes(b"engine")

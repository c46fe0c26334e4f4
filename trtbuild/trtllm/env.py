"""Where TensorRT-LLM lives on this host and what the GPUs can do, without importing it.

`probe()` is cheap and never raises: `make doctor` prints it and the trtllm backend refuses to start
with its reasons. `import tensorrt_llm` needs libcuda and takes seconds, so the version comes from
package metadata, asked of the TensorRT-LLM interpreter in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SUPPORTED = "1.2."
PYTHON_ENV = "TRTLLM_PYTHON"  # the interpreter of the TensorRT-LLM environment
EXAMPLES_ENV = "TRTLLM_EXAMPLES"  # TensorRT-LLM's examples/ folder (quantize.py, redrafter/convert_checkpoint.py)
DEFAULT_EXAMPLES = ("/app/tensorrt_llm/examples",)  # where NVIDIA's release container keeps them

_VERSION_SCRIPT = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for name in ('tensorrt-llm', 'tensorrt', 'torch', 'transformers', 'nvidia-modelopt', 'numpy', 'pyyaml'):\n"
    "    try: out[name] = m.version(name)\n"
    "    except m.PackageNotFoundError: pass\n"
    "print(json.dumps(out))\n"
)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_mib: int

    @property
    def sm(self) -> int:
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    @property
    def supports_fp8(self) -> bool:
        """FP8 GEMMs need Ada (SM 8.9) or Hopper (9.0) and later."""
        return self.sm >= 89


@dataclass
class TrtllmEnv:
    python: str
    packages: dict[str, str] = field(default_factory=dict)
    examples: Optional[Path] = None
    gpus: list[Gpu] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def version(self) -> Optional[str]:
        return self.packages.get("tensorrt-llm")

    @property
    def usable(self) -> bool:
        return not self.problems

    def tool(self, name: str) -> str:
        """A console script of the TensorRT-LLM environment (e.g. trtllm-build): next to its python, else PATH."""
        beside = Path(self.python).parent / name
        return str(beside) if beside.is_file() else name

    def summary(self) -> str:
        if self.usable:
            gpus = ", ".join(f"{g.name} (SM {g.sm})" for g in self.gpus)
            return f"TensorRT-LLM {self.version} in {self.python}; GPUs: {gpus}"
        return "; ".join(self.problems)


def python_path() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def examples_dir() -> Optional[Path]:
    for p in ([os.environ[EXAMPLES_ENV]] if os.environ.get(EXAMPLES_ENV) else []) + list(DEFAULT_EXAMPLES):
        if (Path(p) / "quantization" / "quantize.py").is_file():
            return Path(p)
    return None


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Lines of `nvidia-smi --query-gpu=index,name,compute_cap,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            major, minor = (int(x) for x in parts[2].split("."))
            gpus.append(Gpu(int(parts[0]), parts[1], (major, minor), int(float(parts[3]))))
        except ValueError:
            continue
    return gpus


def query_gpus() -> tuple[list[Gpu], Optional[str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no NVIDIA driver (nvidia-smi not found)"
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    gpus = parse_nvidia_smi(out.stdout)
    if out.returncode != 0 or not gpus:
        return [], f"nvidia-smi lists no GPU ({(out.stderr or out.stdout).strip()[:200] or 'no output'})"
    return gpus, None


def query_packages(python: str) -> tuple[dict[str, str], Optional[str]]:
    try:
        out = subprocess.run([python, "-c", _VERSION_SCRIPT], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"{python}: cannot run ({e}); set {PYTHON_ENV} to the TensorRT-LLM environment's python"
    if out.returncode != 0:
        return {}, f"{python}: {out.stderr.strip()[-200:]}"
    return json.loads(out.stdout), None


def probe(python: Optional[str] = None) -> TrtllmEnv:
    env = TrtllmEnv(python=python or python_path())
    env.packages, err = query_packages(env.python)
    if err:
        env.problems.append(err)
    elif env.version is None:
        env.problems.append(f"TensorRT-LLM is not installed in {env.python} (needs {SUPPORTED}x on a GPU host; "
                            f"set {PYTHON_ENV} to its python; see docs/trtllm.md)")
    elif not env.version.startswith(SUPPORTED):
        env.problems.append(f"TensorRT-LLM {env.version} in {env.python}; this toolkit targets {SUPPORTED}x "
                            "(the engine + ReDrafter path is removed from later releases)")
    env.gpus, err = query_gpus()
    if err:
        env.problems.append(err)
    env.examples = examples_dir()  # only FP8 calibration and ReDrafter need it: preflight checks per recipe
    return env

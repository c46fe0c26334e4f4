from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be on before anything (torch's
# compiler included) imports Triton, or its language functions are compiled-only (tests/test_decode_attention.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hang_guard import fail_after, phase_guards  # noqa: E402

# Every test fails (stacks dumped) rather than hang the suite past CI's limit: 10 minutes, 15 times the
# slowest test on a 2-core box. A module that starts servers narrows it with its own `hang_guard`.
hang_guard = fail_after(600)
# ... and with its fixtures of every scope (servers, models), which the function-scoped guard does not see
pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown = phase_guards(900)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random 2-layer checkpoints: a CoT/TIR pair per architecture, sharing one tokenizer."""
    from trtbuild.tiny_model import make_model

    root = tmp_path_factory.mktemp("tiny")
    llama_cot = make_model(root / "llama-cot", "llama", seed=1)
    return {
        "llama-cot": llama_cot,
        "llama-tir": make_model(root / "llama-tir", "llama", seed=2, tokenizer_from=llama_cot),
        "qwen-cot": make_model(root / "qwen-cot", "qwen2", seed=3, tokenizer_from=llama_cot),
        "qwen-tir": make_model(root / "qwen-tir", "qwen2", seed=4, tokenizer_from=llama_cot),
    }

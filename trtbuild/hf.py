"""Small helpers around transformers shared by the stages (imported only by stages that need torch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def use_all_cores() -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))


def load_model(path: Path, dtype: str = "bfloat16") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    model.eval()
    return model


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def render_prompt(tokenizer: Any, problem: str, system_prompt: str | None = None) -> str:
    """The chat-formatted prompt text, ending where the assistant starts writing."""
    from trtbuild.tir_data import chat_messages

    return tokenizer.apply_chat_template(
        chat_messages(problem, system_prompt), tokenize=False, add_generation_prompt=True
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already chat-formatted text (the template supplies special tokens)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]

"""`engine.json`: what the build wrote about an engine folder, checked before anything is loaded from it.

An engine folder is copied between machines (a Kaggle dataset, a GPU host) and may be edited by hand, so
every value the serving code reads from its `engine.json` is checked here, once, with an error naming the
file, the key and the value: a `max_batch_size` of 0 let the engine load and then never admit a request,
a `max_seq_len` of 10^12 had the process killed for memory, `limits` missing or a list for the backend
ended in KeyError / TypeError tracebacks, `num_beams: 0` failed every request with an IndexError, and a
folder key could point outside the engine folder. Standard library only.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

BACKENDS = ("embedded", "trtllm")
FOLDER_KEYS = ("model_dir", "cpu_model_dir", "drafter_dir", "engine_dir")  # folders inside the engine folder
REQUIRED_LIMITS = ("max_batch_size", "max_input_len", "max_seq_len")
OPTIONAL_LIMITS = ("max_num_tokens", "tp_size")
MAX_SEQ_TOKENS = 1 << 22  # 4M tokens a sequence: past any model's positions, and a cache no host holds
MAX_BATCH = 1 << 14
MAX_DRAFT_TOKENS = 64  # ReDrafter drafts a few tokens a beam; the verify step holds 1 + beams x tokens


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_engine_spec(spec: Any, path: Path) -> dict[str, Any]:
    """`spec` (engine.json's parsed content) when every value the serving code reads is sound; else a
    ValueError "<path>: <key>: <what is wrong> (got <value>)"."""
    def fail(key: str, what: str, value: Any) -> None:
        raise ValueError(f"{path}: {key}: {what} (got {repr(value)[:200]}); rebuild the folder with `make build`")

    if not isinstance(spec, dict):
        raise ValueError(f"{path}: an engine file is a JSON object (got a {type(spec).__name__}); rebuild the folder "
                         "with `make build`")
    backend = spec.get("backend")
    if not isinstance(backend, str) or backend not in BACKENDS:
        fail("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    for key in FOLDER_KEYS:
        value = spec.get(key)
        if value is None and not (key == "model_dir" and backend == "embedded"):
            continue
        parts = PurePosixPath(value).parts if isinstance(value, str) else ()
        if not parts or value.startswith("/") or "\\" in value or ".." in parts:
            fail(key, "a folder inside the engine folder, named relative to it", value)
    limits = spec.get("limits")
    if not isinstance(limits, dict):
        fail("limits", f"a mapping of {', '.join(REQUIRED_LIMITS)} (and {', '.join(OPTIONAL_LIMITS)})", limits)
    for key in (*REQUIRED_LIMITS, *(k for k in OPTIONAL_LIMITS if k in limits)):
        if not _is_count(limits.get(key)):
            fail(f"limits.{key}", "an integer >= 1", limits.get(key))
    if limits["max_seq_len"] > MAX_SEQ_TOKENS:
        fail("limits.max_seq_len", f"at most {MAX_SEQ_TOKENS} tokens", limits["max_seq_len"])
    if limits["max_batch_size"] > MAX_BATCH:
        fail("limits.max_batch_size", f"at most {MAX_BATCH} sequences", limits["max_batch_size"])
    if limits["max_input_len"] > limits["max_seq_len"]:
        fail("limits.max_input_len", f"at most limits.max_seq_len ({limits['max_seq_len']})", limits["max_input_len"])
    drafter = spec.get("drafter")
    if drafter is not None:
        if not isinstance(drafter, dict):
            fail("drafter", "a mapping (the recipe's drafter section) or null", drafter)
        for key in ("num_beams", "draft_len_per_beam"):
            if key in drafter and not (_is_count(drafter[key]) and drafter[key] <= MAX_DRAFT_TOKENS):
                fail(f"drafter.{key}", f"an integer in 1..{MAX_DRAFT_TOKENS}", drafter[key])
    return spec

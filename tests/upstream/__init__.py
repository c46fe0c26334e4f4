"""The TensorRT-LLM 1.2.x contract as extracted from upstream source (`extract.py` -> `trtllm_1_2.json`).

The test doubles and the contract tests read facts from here instead of restating them by hand.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("trtllm_1_2.json")


@functools.lru_cache(maxsize=1)
def snapshot() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())

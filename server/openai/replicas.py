"""The replicas of the `openai` backend: their URLs, what each was found to support, their health,
and the two failures a request can meet on one (the replica's fault, or the request's).

Its own module because the engine, the probe and the completion stream all read and update a
Replica, and the failure kinds decide between failing over and giving up.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional, Sequence

DOWN_SECONDS = 5.0  # a failed replica is tried again after this long


class ReplicaFailed(Exception):
    """This replica cannot serve now (unreachable, 5xx, a broken stream): the request fails over."""


class RequestRejected(Exception):
    """The server refused the request itself (4xx): another replica would refuse it too."""


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """`http://host:port[/v1]` items, comma-separated or a list, as base URLs ending in /v1."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = []
    for u in items:
        u = u.strip().rstrip("/")
        if not u:
            continue
        if "://" not in u:
            u = "http://" + u
        out.append(u if u.endswith("/v1") else u + "/v1")
    if not out:
        raise ValueError("openai backend: no server URL given (URL=http://host:port[/v1][,http://...])")
    return out


def error_message(body: bytes | str) -> str:
    """The message of an OpenAI error body ({"error": {"message": ...}}), else the body itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(obj.get("message") or obj.get("detail") or err) if isinstance(obj, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:500]


@dataclass
class Replica:
    """One server: its model and context (/v1/models), how it takes and returns ids (probed), its load."""

    url: str
    model: Optional[str] = None
    max_model_len: Optional[int] = None  # the context /v1/models reports (vLLM, make serve): caps max_tokens
    probed: bool = False
    ids_in: bool = True  # the prompt goes as token ids
    ids_out: str = ""  # return_token_ids | detokenize | "" (text re-tokenized)
    salts: bool = False  # keeps KV reuse within a cache_salt (probed)
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    last_error: str = ""

    def up(self, now: float) -> bool:
        return now >= self.down_until

    def mark_down(self, error: str) -> None:
        """A failure: not picked again for DOWN_SECONDS (unless no replica is up)."""
        self.failures += 1
        self.last_error = error
        self.down_until = time.monotonic() + DOWN_SECONDS

    def describe(self) -> str:
        ids = {"return_token_ids": "token ids back (return_token_ids)",
               "detokenize": "token ids back (detokenize: false)", "": "text back, re-tokenized"}[self.ids_out]
        return f"{self.url} (model {self.model!r}; prompt as {'token ids' if self.ids_in else 'text'}; {ids})"

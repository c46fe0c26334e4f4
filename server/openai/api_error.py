"""The OpenAI-shaped error every failure of the HTTP server becomes, and the compact JSON it is sent as.

Its own module because every layer of the server raises or sends it: request parsing (400s),
generation (an engine failure), the loading state (503s) and the app (413s, 500s).
"""

from __future__ import annotations

import json
from typing import Any, Optional


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error", code: Optional[str] = None, retry_after: Optional[int] = None):
        """`retry_after`: seconds for a `Retry-After` header (a 503 that passes: loading, too many bodies),
        which the openai client waits before its own retry instead of guessing."""
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def dumps(obj: Any) -> str:
    """Compact JSON with the text as is (no ASCII escapes): what responses and stream events carry."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)

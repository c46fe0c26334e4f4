"""A request's JSON body and its typed fields, each checked so that a bad one gets a 400 that names it.

Separate from the request parser because these checks know nothing of the engine: they turn raw
bytes into a JSON object with valid text, and read numbers, flags and stop strings out of it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Optional

from aimo_spec.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from server.openai.api_error import ApiError

_SURROGATE = re.compile("[\ud800-\udfff]")
ECHO_CHARS = 200  # of a refused value, quoted back in the error


def quoted(value: Any) -> str:
    """A refused value as an error message quotes it: repr, cut to ECHO_CHARS (a body may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


def number_field(body: dict, name: str, default: Any, lo: Optional[float] = None, hi: Optional[float] = None,
                 integer: bool = False, lo_open: bool = False) -> Any:
    """A number in range (or `default` when absent); `lo_open`: the low bound itself is out."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'} (got {quoted(v)})", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number (got {quoted(v)})", name)
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        rng = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"{name} must be {rng} (got {quoted(v)})", name)
    return v


def flag_field(body: dict, name: str, default: bool = False) -> bool:
    """A JSON boolean (or `default` when absent)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean (got {quoted(v)})", name)
    return v


def refuse_unsupported(body: dict, name: str, ok: Callable[[Any], bool], why: str) -> None:
    """A 400 naming the field when it asks for what the engine cannot do (`ok` says what it can)."""
    v = body.get(name)
    if v is not None and not ok(v):
        raise ApiError(400, f"{name} is not supported by this server ({why}; got {quoted(v)})", name)



def stop_strings(body: dict) -> tuple[str, ...]:
    """`stop`: one string or a list of at most MAX_STOP_STRINGS, none empty or over MAX_STOP_STRING_CHARS."""
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"stop must be a string or a list of strings (got {quoted(v)})", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(items)})", "stop")
    if any(not s for s in items):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in items):
        raise ApiError(400, f"stop: a stop string has at most {MAX_STOP_STRING_CHARS} characters "
                            f"(got {max(len(s) for s in items)})", "stop")
    return tuple(items)


def invalid_text(obj: Any, path: str = "") -> Optional[tuple[str, int]]:
    """(where, character index) of the first lone surrogate in any string or key of a parsed JSON
    body (`"\\ud800"` escapes parse to one, and no tokenizer or UTF-8 encoder takes it); None if none."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        o, where = stack.pop()
        if isinstance(o, str):
            m = _SURROGATE.search(o)
            if m:
                return where or "body", m.start()
        elif isinstance(o, dict):
            for k, v in o.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"{where}.{k!r}" if where else repr(k), 0
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(o, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(o))
    return None


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or a 400 that says what is wrong (and where)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: {e})"[:500]) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = invalid_text(body)
    if bad:
        where, i = bad
        param = where.split(".")[0].split("[")[0] if where != "body" else None
        where = where if len(where) <= ECHO_CHARS else where[:ECHO_CHARS] + "..."  # a key may be megabytes long
        param = (param or where)[:ECHO_CHARS]
        raise ApiError(400, f"{where}: not valid Unicode text (a lone surrogate at character {i})", param)
    return body

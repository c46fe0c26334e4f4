"""What one replica serves and how it speaks, asked once before it gets requests.

`GET /v1/models` names the model (the one asked for, else the first listed) and its context. Then,
unless token ids are off, a one-token completion with the prompt as token ids asks for the generated
ids back: `return_token_ids: true` (vLLM >= 0.10.2, `make serve`), else `detokenize: false`
(trtllm-serve), else plain text (the ids are re-tokenized from it). A server that refuses all three
takes no id prompts: it gets the prompt as text.

Then whether it keeps KV reuse within a `cache_salt` (`_separates_salts`): only then does this server take
salted requests for it.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Mapping, Optional

from server.openai.replicas import Replica, ReplicaFailed, RequestRejected, error_message


async def probe(rep: Replica, client: Any, headers: Mapping[str, str], model: Optional[str], token_ids: str,
                tokenize: Callable[[str], list[int]]) -> None:
    """Fill in `rep` (model, context, ids in and out) and mark it probed and up; `model`: the one
    asked for (None: the first listed); `token_ids`: auto (probe) | off (text both ways).
    Raises ReplicaFailed (try again later) or RequestRejected (this replica will not do)."""
    r = await client.get(rep.url + "/models", headers=headers, timeout=10)
    if r.status_code != 200:
        raise ReplicaFailed(f"GET /v1/models: HTTP {r.status_code}: {error_message(r.content)}")
    listed = [m for m in (r.json().get("data") or []) if isinstance(m, dict)]
    models = [m.get("id") for m in listed]
    if model and models and model not in models:
        raise RequestRejected(f"serves {models}, not {model!r}")
    if not (model or models):
        raise RequestRejected("lists no model (GET /v1/models)")
    rep.model = model or models[0]
    length = next((m.get("max_model_len") for m in listed if m.get("id") == rep.model), None)
    usable = isinstance(length, int) and not isinstance(length, bool) and length > 0
    rep.max_model_len = length if usable else None
    ids_in, ids_out = False, ""
    if token_ids == "auto":
        ids = tokenize("1 + 1 =")
        base = {"model": rep.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        for mode, extra in (("return_token_ids", {"return_token_ids": True}),
                            ("detokenize", {"detokenize": False}), ("", {})):
            resp = await client.post(rep.url + "/completions", json={**base, **extra}, headers=headers, timeout=60)
            if resp.status_code >= 500:
                raise ReplicaFailed(f"POST /v1/completions: HTTP {resp.status_code}: {error_message(resp.content)}")
            if resp.status_code != 200:
                continue
            ids_in = True
            choices = resp.json().get("choices") or [{}]
            if mode and isinstance(choices[0].get("token_ids"), list) and choices[0]["token_ids"]:
                ids_out = mode
                break
            if not mode:
                break
    rep.salts = await _separates_salts(rep, client, headers)
    rep.ids_in, rep.ids_out, rep.probed = ids_in, ids_out, True
    rep.down_until, rep.last_error = 0.0, ""


# long enough for caches that reuse whole blocks only (vLLM's are 16 tokens)
SALT_PROBE_PROMPT = "Count with me: " + ", ".join(str(i) for i in range(1, 41))


async def _separates_salts(rep: Replica, client: Any, headers: Mapping[str, str]) -> bool:
    """Whether `rep` reuses KV within a cache_salt only: one prompt under a fresh salt twice reports cached
    tokens the second time, and under another fresh salt none. A replica that refuses the field, reports
    no cached tokens or reuses them across salts is not trusted with salts (its clients' requests would
    share KV while this server said they do not)."""
    cached = []
    for salt in [secrets.token_hex(16)] * 2 + [secrets.token_hex(16)]:
        body = {"model": rep.model, "prompt": SALT_PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0,
                "cache_salt": salt}
        resp = await client.post(rep.url + "/completions", json=body, headers=headers, timeout=60)
        if resp.status_code >= 500:
            raise ReplicaFailed(f"POST /v1/completions: HTTP {resp.status_code}: {error_message(resp.content)}")
        if resp.status_code != 200:
            return False
        details = (resp.json().get("usage") or {}).get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens") or 0)
    return isinstance(cached[1], int) and cached[1] > 0 and cached[2] == 0

"""One streamed `POST /v1/completions` to one replica, into a RequestStream.

The request carries the tokens so far (prompt + generated: a continuation after a failover asks
for the rest of max_tokens only, within the replica's context), as ids or as text, and asks for ids
back the way the probe found. The server-sent events are split here; each choice's ids (or its
text, re-tokenized) go to the stream, which matches stop strings: a match, a stop token, or the
end of max_tokens ends the request. A replica's fault (408, 429, 5xx, a stream that ends early)
raises ReplicaFailed, so the engine fails over; any other refusal raises RequestRejected.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from server.openai.connections import LoopClients
from server.openai.replicas import Replica, ReplicaFailed, RequestRejected, error_message
from server.stream import RequestStream


def request_body(rep: Replica, s: RequestStream, tokenizer: Any) -> dict[str, Any]:
    """The streamed completion request for what `s` still needs from `rep`."""
    p = s.params
    history = s.prompt + s.generated
    body: dict[str, Any] = {
        "model": rep.model, "max_tokens": room(rep, s), "temperature": p.temperature,
        "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True},
        "prompt": history if rep.ids_in else tokenizer.decode(history, skip_special_tokens=False)}
    if p.seed is not None:
        body["seed"] = p.seed
    if s.request.cache_salt:
        body["cache_salt"] = s.request.cache_salt
    if p.top_k:
        body["top_k"] = p.top_k
    if p.ignore_eos:
        body["ignore_eos"] = True
    if p.top_logprobs:
        body["logprobs"] = p.top_logprobs
    if rep.ids_out == "return_token_ids":
        body["return_token_ids"] = True
        if p.top_logprobs:
            body["return_tokens_as_token_ids"] = True
    elif rep.ids_out == "detokenize":
        body["detokenize"] = False
    return body


def room(rep: Replica, s: RequestStream) -> int:
    """Tokens left to ask for: the rest of max_tokens, within the replica's context (servers refuse
    a prompt plus max_tokens over it, as vLLM and OpenAI do; the engines here end such a request at
    the context, so capping keeps the same result)."""
    left = s.params.max_tokens - len(s.generated)
    if rep.max_model_len is not None:
        left = min(left, rep.max_model_len - len(s.prompt) - len(s.generated))
    return left


async def stream_completion(clients: LoopClients, headers: Mapping[str, str], rep: Replica, s: RequestStream,
                            tokenizer: Any, first: bool) -> None:
    """Stream one completion from `rep` into `s`; `first`: the request's first replica (its usage gives
    cached_tokens)."""
    if room(rep, s) <= 0:
        s.finish("length")
        return
    finish: Optional[str] = None
    async with clients.current().stream("POST", rep.url + "/completions", json=request_body(rep, s, tokenizer),
                                        headers=headers) as r:
        if r.status_code != 200:
            msg = f"HTTP {r.status_code}: {error_message(await r.aread())}"
            if r.status_code in (408, 429) or r.status_code >= 500:
                raise ReplicaFailed(msg)
            raise RequestRejected(msg)
        rest = b""
        async for chunk in r.aiter_bytes():  # server-sent events, split here (cheaper than line iterators)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    s.finish("error", f"{rep.url}: {error_message(data)}")
                    return
                usage = obj.get("usage")
                if first and usage:
                    s.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for c in obj.get("choices") or ():
                    ids = c.get("token_ids") if rep.ids_out else None
                    if ids is None:
                        text = c.get("text") or ""
                        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
                    if ids and push(s, ids, top_logprobs(c.get("logprobs"), s.params.top_logprobs, tokenizer)):
                        return
                    finish = c.get("finish_reason") or finish
            else:
                continue
            break
    if finish is None:
        raise ReplicaFailed("the stream ended before the request finished")
    s.finish("length" if finish == "length" else "stop" if finish == "stop" else "error",
             "" if finish in ("stop", "length") else f"{rep.url}: finish_reason {finish!r}")


def push(s: RequestStream, ids: list[int], logprobs: Any) -> bool:
    """Hand ids to the stream; True when that ended the request (a stop string or stop token)."""
    stops = s.params.stop_token_ids
    cut = next((i for i, t in enumerate(ids) if t in stops), None) if stops else None
    if cut is not None:
        matched = s.push(ids[:cut], logprobs[:cut] if logprobs else None)
        if matched is None:
            s.push(ids[cut:cut + 1], logprobs[cut:cut + 1] if logprobs else None, text=False)
        s.finish("stop")
        return True
    if s.push(ids, logprobs) is not None:
        s.finish("stop")
        return True
    return False


def top_logprobs(lp: Any, k: int, tokenizer: Any) -> Any:
    """Completions-style logprobs -> per token, the top (id, logprob) pairs."""
    if not k or not isinstance(lp, dict) or not lp.get("top_logprobs"):
        return None
    out = []
    for top in lp["top_logprobs"]:
        pairs = sorted(((token_id(t, tokenizer), float(v)) for t, v in (top or {}).items()), key=lambda x: -x[1])
        out.append(tuple(pairs[:k]))
    return tuple(out)


def token_id(token: str, tokenizer: Any) -> int:
    """The id of a logprobs key: `token_id:<id>`, else the token string's first id (-1: none)."""
    if token.startswith("token_id:"):
        return int(token[9:])
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if ids else -1

"""The pieces of an OpenAI response: choice objects, logprobs, usage and finish reasons, from engine events.

Shared by the whole response (`Api.complete`) and the streamed one (`server.openai.sse`), in both
shapes (completions and chat); the tokenizer turns ids into the token strings logprobs show.
"""

from __future__ import annotations

from typing import Any, Optional

from aimo_spec.protocol import Final
from server.openai.job import Job


class ResponseShaper:
    """Response objects for one tokenizer (its token strings cached: logprobs repeat them a lot)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def _token(self, t: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{t}"
        s = self._token_text.get(t)
        if s is None:
            s = self._token_text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def _logprobs(self, job: Job, ids: tuple[int, ...], tops: Any, offset: int) -> Any:
        """The response's logprobs object for these tokens (completions or chat shape)."""
        k, as_id = job.logprobs or 0, job.tokens_as_ids
        rows = list(tops or ())
        rows += [()] * (len(ids) - len(rows))
        chosen = [next((lp for tid, lp in row if tid == t), None) for t, row in zip(ids, rows)]
        if job.kind == "completion":
            tokens = [self._token(t, as_id) for t in ids]
            offsets, pos = [], offset
            for s in tokens:
                offsets.append(pos)
                pos += len(s)
            return {"tokens": tokens, "token_logprobs": chosen, "text_offset": offsets,
                    "top_logprobs": [{self._token(tid, as_id): lp for tid, lp in row[:k]} for row in rows] if k else
                    [None] * len(ids)}
        content = []
        for t, row, lp in zip(ids, rows, chosen):
            s = self._token(t, as_id)
            content.append({"token": s, "logprob": -9999.0 if lp is None else lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (x := self._token(tid, as_id)), "logprob": v,
                                              "bytes": list(x.encode())} for tid, v in row[:k]]})
        return {"content": content}

    @staticmethod
    def finish_reason(final: Final) -> str:
        return {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "abort"}.get(final.finish_reason,
                                                                                                   final.finish_reason)

    def strip_stop(self, job: Job, text: str, final: Optional[Final]) -> str:
        """The text without the stop string that ended it (unless include_stop_str_in_output)."""
        if final is not None and final.stop_string and not job.include_stop and text.endswith(final.stop_string):
            return text[: len(text) - len(final.stop_string)]
        return text

    def usage(self, job: Job, finals: list[Final]) -> dict[str, Any]:
        """Token counts: each prompt once (not once per choice), every choice's completion."""
        firsts = [f for i, f in enumerate(finals) if i % job.n == 0]
        prompt = sum(f.prompt_tokens for f in firsts)
        completion = sum(len(f.token_ids) for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)}}

    def choice(self, job: Job, index: int, text: str, ids: tuple[int, ...], tops: Any, offset: int,
               final: Optional[Final], delta: bool) -> dict[str, Any]:
        """One choice: whole (`message`/`text`) or a stream delta; `offset`: text already sent (logprob offsets)."""
        c: dict[str, Any] = {"index": index}
        if job.kind == "chat":  # detokenize: false sends ids only, as on completions
            text = text if job.text_out else ""
            if delta:
                c["delta"] = {"content": text} if text else {}
            else:
                c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text if job.text_out else ""
        c["logprobs"] = self._logprobs(job, ids, tops, offset) if job.logprobs is not None and ids else None
        c["finish_reason"] = self.finish_reason(final) if final is not None else None
        if final is not None:
            c["stop_reason"] = final.stop_string
        if job.return_token_ids or not job.text_out:
            c["token_ids"] = list(ids)
        return c

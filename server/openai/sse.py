"""The streamed response: a Job's engine events as OpenAI server-sent events.

One chunk per engine delta, each choice's finish chunk, usage when asked, then `[DONE]`. Its own
module because the streamed shape has rules the whole response lacks: a delta that ends with a
stop string is held until its Final says whether to strip it, chat opens each choice with a role
chunk, and an engine failure after the headers went out is an error event, not a status code.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from aimo_spec.protocol import Delta, Final
from server.openai.api import Api
from server.openai.api_error import ApiError, dumps
from server.openai.job import Job


async def sse_stream(api: Api, job: Job) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per engine delta, the finish chunk, usage, [DONE]."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    head = f'{{"id":"{"chatcmpl-" if job.kind == "chat" else "cmpl-"}{job.id}","object":"{obj}",' \
           f'"created":{job.created},"model":{dumps(job.model)},'
    n = len(job.prompts) * job.n
    shape = api.responses
    held: dict[int, Delta] = {}  # a delta that ends with a stop string waits for its Final (stripped)
    offsets = [0] * n
    finals: dict[int, Final] = {}
    started: set[int] = set()
    stops = job.params.stop

    def chunk(choice: dict[str, Any], extra: str = "") -> bytes:
        return f'data: {head}"choices":[{dumps(choice)}]{extra}}}\n\n'.encode()

    def piece(index: int, d: Delta, final: Optional[Final] = None) -> Optional[bytes]:
        text = shape.strip_stop(job, d.text, final)
        if not (text or d.token_ids):
            return None
        c = shape.choice(job, index, text, d.token_ids, d.logprobs, offsets[index], None, True)
        if job.return_token_ids and job.kind == "completion" and index not in started:
            c["prompt_token_ids"] = job.prompts[index // job.n]
        started.add(index)
        offsets[index] += len(text)
        return chunk(c)
    if job.kind == "chat":
        for i in range(n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield chunk(first, f',"prompt_token_ids":{dumps(job.prompts[0])}' if job.return_token_ids and not i else "")
    async for index, ev in api.events(job):
        if isinstance(ev, Delta):
            if index in held:
                out = piece(index, held.pop(index))
                if out:
                    yield out
            if stops and any(ev.text.endswith(s) for s in stops):
                held[index] = ev
                continue
            out = piece(index, ev)
            if out:
                yield out
            continue
        finals[index] = ev
        if index in held:
            out = piece(index, held.pop(index), ev)
            if out:
                yield out
        if ev.finish_reason == "error":
            err = ApiError(500, f"the engine failed: {ev.error}", type_="server_error").body()
            yield f"data: {dumps(err)}\n\n".encode()
            continue
        c = shape.choice(job, index, "", (), None, 0, ev, True)
        c.pop("token_ids", None)
        yield chunk(c)
    if job.include_usage:
        done = [finals[i] for i in sorted(finals)]
        yield f'data: {head}"choices":[],"usage":{dumps(shape.usage(job, done))}}}\n\n'.encode()
    yield b"data: [DONE]\n\n"

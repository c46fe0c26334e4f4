"""Request bodies into validated Jobs for one engine: its model name, vocabulary and length limits.

Every OpenAI field is checked here (a 400 or 404 that names it), prompts are tokenized and chat
messages templated. All of it runs on one worker thread, never on the event loop (a 5 MB prompt
must not stall every other client) and never two at a time (a tokenizer is not safe to share
between threads).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional

from aimo_spec.chat import encode_messages, max_chars_per_token
from aimo_spec.protocol import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingParams
from server.openai.api_error import ApiError
from server.openai.body import flag_field, number_field, parse_body, quoted, refuse_unsupported, stop_strings
from server.openai.job import Job

MAX_N = 128
# completions one request may ask for (prompts x n): each is a request in the engine's queue, and one body
# of a thousand prompts at n=128 would otherwise queue 128k of them ahead of every other client
MAX_CHOICES = 4096
MAX_CACHE_SALT_CHARS = 256  # a tenant's secret (128 random bits are 32 hex digits), not a payload
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what a torch generator's seed takes; choice i of n gets seed + i
CHAT_ROLES = ("system", "developer", "user", "assistant")  # developer is OpenAI's newer name for system
# asked of the engine whenever logprobs are wanted: the sampled token is nearly always among them
ENGINE_LOGPROBS = MAX_TOP_LOGPROBS


class RequestParser:
    """The parsing side of the server over one engine (see the module doc)."""

    def __init__(self, engine: Any, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.tokenizer
        self.vocab = len(self.tokenizer)
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)  # a longer text is refused untokenized
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-parse")

    @property
    def max_input_len(self) -> Optional[int]:
        return getattr(self.engine, "max_input_len", None)

    @property
    def max_seq_len(self) -> Optional[int]:
        """Read per request: a proxy's context is the smallest its replicas report, and a replica probed
        later can lower it."""
        return getattr(self.engine, "max_seq_len", None)

    async def parse(self, raw: bytes, chat: bool) -> "Job":
        """The validated Job of a request body, parsed and tokenized off the event loop."""
        def work() -> Job:
            body = parse_body(raw)
            return self.parse_chat(body) if chat else self.parse_completion(body)
        return await asyncio.get_running_loop().run_in_executor(self._worker, work)

    def _check_length(self, chars: int, where: str) -> None:
        """Refuse, untokenized, a text that cannot fit max_input_len tokens (see max_chars_per_token)."""
        if self.max_input_len and chars > self.max_input_len * self.max_chars_per_token:
            raise ApiError(400, f"{where}: the prompt has {chars} characters, more than this engine's limit of "
                                f"{self.max_input_len} tokens (max_input_len) can hold", where,
                           code="context_length_exceeded")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _check_tokens(self, ids: list[int], prompt_field: str) -> list[int]:
        """`ids`, refused when empty or over max_input_len."""
        if not ids:
            raise ApiError(400, f"{prompt_field}: the prompt is empty", prompt_field)
        limit = self.max_input_len
        if limit is not None and len(ids) > limit:
            raise ApiError(400, f"{prompt_field}: the prompt has {len(ids)} tokens, over this engine's limit of "
                                f"{limit} (max_input_len)", prompt_field, code="context_length_exceeded")
        return ids

    def _common(self, body: dict, kind: str, prompts: list[list[int]], prompt_field: str) -> Job:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"model must be a string (got {quoted(model)})", "model")
        if model and model != self.model_name:
            raise ApiError(404, f"The model {quoted(model)} does not exist (this server serves {self.model_name!r})",
                           "model", code="model_not_found")
        for name, value in (("frequency_penalty", 0), ("presence_penalty", 0)):
            refuse_unsupported(body, name, lambda v, d=value: v == d, "no penalties in the engine")
        refuse_unsupported(body, "repetition_penalty", lambda v: v == 1, "no penalties in the engine")
        refuse_unsupported(body, "min_p", lambda v: v == 0, "no min_p sampling in the engine")
        refuse_unsupported(body, "logit_bias", lambda v: not v, "no logit bias in the engine")
        refuse_unsupported(body, "use_beam_search", lambda v: v is False, "no beam search")
        n = number_field(body, "n", 1, 1, MAX_N, integer=True)
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"a request may ask for at most {MAX_CHOICES} completions (prompts x n); this one "
                                f"asks for {len(prompts)} x {n}", "n" if n > 1 else prompt_field)
        refuse_unsupported(body, "best_of", lambda v: v == n, "best_of must equal n")
        for ids in prompts:
            self._check_tokens(ids, prompt_field)
        longest = max(len(p) for p in prompts)
        context = self.max_seq_len  # once a request (a proxy's can change as its replicas are probed)
        room = (context - longest) if context else None
        if room is not None and room < 1:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has "
                                f"{longest}, which leaves no room for a completion", prompt_field,
                           code="context_length_exceeded")
        newer = kind == "chat" and body.get("max_completion_tokens") is not None
        name = "max_completion_tokens" if newer else "max_tokens"
        asked = body.get(name)
        default = (room if room is not None else 4096) if kind == "chat" else min(16, room or 16)
        max_tokens = number_field({name: asked}, name, default, 1, integer=True)
        if asked is not None and room is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has "
                                f"{longest} and {name} asks for {max_tokens} more ({longest + max_tokens} in all). "
                                f"Ask for at most {room}.", name, code="context_length_exceeded")
        stream = flag_field(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise ApiError(400, "stream_options must be an object, and only with stream: true", "stream_options")
        include_usage = bool((opts or {}).get("include_usage"))
        stop_ids = body.get("stop_token_ids") or []
        if (not isinstance(stop_ids, list)
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in stop_ids)):
            raise ApiError(400, f"stop_token_ids must be a list of token ids in 0..{self.vocab - 1} "
                                f"(got {quoted(stop_ids)})", "stop_token_ids")
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:  # each is checked against every token generated
            raise ApiError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids (got {len(stop_ids)})",
                           "stop_token_ids")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, f"seed must be an integer (got {quoted(seed)})", "seed")
        if seed is not None and not (SEED_RANGE[0] <= seed and seed + n - 1 <= SEED_RANGE[1]):
            raise ApiError(400, f"seed must lie in {SEED_RANGE[0]}..{SEED_RANGE[1] - n + 1} (choice i of n samples "
                                f"with seed + i; got {quoted(seed)})", "seed")
        temperature = number_field(body, "temperature", 1.0, 0, 2)
        top_p = number_field(body, "top_p", 1.0, 0, 1, lo_open=True)
        top_k = number_field(body, "top_k", 0, -1, integer=True)
        params = SamplingParams(
            temperature=float(temperature), top_p=float(top_p), top_k=max(0, top_k), seed=seed, max_tokens=max_tokens,
            stop=stop_strings(body), stop_token_ids=tuple(stop_ids), ignore_eos=flag_field(body, "ignore_eos"))
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
            raise ApiError(400, f"cache_salt must be a string of 1..{MAX_CACHE_SALT_CHARS} characters (got {got})",
                           "cache_salt")  # not echoed: a salt is its tenant's secret
        if salt and not getattr(self.engine, "separates_cache_salts", False):
            raise ApiError(400, f"cache_salt: this server's {getattr(self.engine, 'name', 'engine')} backend shares "
                                "its KV cache between requests whatever their salt", "cache_salt")
        return Job(kind, self.model_name, prompts, params, n=n, stream=stream, include_usage=include_usage,
                   cache_salt=salt or "",
                   return_token_ids=flag_field(body, "return_token_ids"), text_out=flag_field(body, "detokenize", True),
                   tokens_as_ids=flag_field(body, "return_tokens_as_token_ids"),
                   include_stop=flag_field(body, "include_stop_str_in_output"))

    def _token_prompt(self, v: Any, where: str) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ApiError(400, f"{where}: a token prompt must be a list of integers", "prompt")
        bad = [t for t in v if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary (0..{self.vocab - 1})",
                           "prompt")
        return list(v)

    def parse_completion(self, body: dict) -> Job:
        refuse_unsupported(body, "echo", lambda v: v is False, "the prompt is not echoed")
        refuse_unsupported(body, "suffix", lambda v: not v, "no insertion")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not isinstance(prompt[0], int):
            raise ApiError(400, f"prompt: at most {MAX_CHOICES} prompts a request (got {len(prompt)})", "prompt")
        for x in [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []:
            if isinstance(x, str):
                self._check_length(len(x), "prompt")
        if isinstance(prompt, str):
            prompts = [self.engine.tokenize(prompt)]
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt)):
            prompts = [self._token_prompt(prompt, "prompt")]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            # one at a time: the first over the limit ends the request before the rest are tokenized
            prompts = [self._check_tokens(self.engine.tokenize(x), "prompt") for x in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            prompts = [self._token_prompt(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
        else:
            raise ApiError(400, "prompt is required: a string, a list of token ids, or a list of either "
                                f"(got {quoted(prompt)})", "prompt")
        job = self._common(body, "completion", prompts, "prompt")
        job.logprobs = number_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        return self._with_logprobs(job)

    def parse_chat(self, body: dict) -> Job:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages is required: a non-empty list of {role, content}", "messages")
        for name in ("tools", "functions"):
            refuse_unsupported(body, name, lambda v: not v, "no tool calling; the TIR client runs code itself")
        # vLLM's fields that change the prompt: only their no-op values (the tokenizer's own template,
        # ending with the assistant's open turn) are what this server does
        refuse_unsupported(body, "add_generation_prompt", lambda v: v is True,
                           "the prompt always ends with the assistant's open turn")
        refuse_unsupported(body, "continue_final_message", lambda v: v is False,
                           "the last message is never continued; send it as a completions prompt")
        refuse_unsupported(body, "chat_template", lambda v: not v, "the tokenizer's own chat template is used")
        refuse_unsupported(body, "chat_template_kwargs", lambda v: v == {}, "the chat template takes no arguments")
        fmt = body.get("response_format")
        refuse_unsupported(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
                     "no structured output")
        del fmt
        if self.max_input_len and len(msgs) > self.max_input_len:  # each message adds template tokens
            raise ApiError(400, f"messages: {len(msgs)} messages cannot fit this engine's limit of "
                                f"{self.max_input_len} tokens (max_input_len)", "messages",
                           code="context_length_exceeded")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}].role")
            if m["role"] not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role: {quoted(m['role'])} is not one of {', '.join(CHAT_ROLES)}",
                               f"messages[{i}].role")
            c = m.get("content")
            if isinstance(c, list):
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in c):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   f"messages[{i}].content")
                c = "".join(part["text"] for part in c)
            elif c is None:
                c = ""
            elif not isinstance(c, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
        self._check_length(sum(len(m["content"]) for m in clean), "messages")
        try:  # the messages' special-token spellings stay text: no forged turns (encode_messages)
            ids = encode_messages(self.tokenizer, clean)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (roles, order)
            raise ApiError(400, f"messages: the chat template refused them ({type(e).__name__}: {e})",
                           "messages") from None
        job = self._common(body, "chat", [ids], "messages")
        if flag_field(body, "logprobs"):
            job.logprobs = number_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self._with_logprobs(job)

    def _with_logprobs(self, job: Job) -> Job:
        if job.logprobs is not None:
            job.params = replace(job.params, top_logprobs=min(MAX_TOP_LOGPROBS, max(job.logprobs, ENGINE_LOGPROBS)))
        return job

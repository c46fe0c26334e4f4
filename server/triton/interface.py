"""The request interface both Triton deployments expose: tensorrtllm_backend's `ensemble` model.

Inputs text_input (BYTES) and max_tokens (INT32); optional stream, temperature, top_p, top_k,
seed (UINT64), stop_words (BYTES), end_id; output text_output, streamed in decoupled mode. The
embedded deployment adds optional extras the TensorRT-LLM ensemble lacks: input_ids (the exact
token history, so continuations keep the prefix contract), top_logprobs, and the outputs token_ids,
logprobs and finish_reason. A request parameter `request_key` names a request; a later request
with parameter `stop: true` and the same key ends it (Triton does not pass a client's cancellation
on to a Python model, so the stop is a request of its own).

tensorrtllm_backend's ensemble has no stop input and ignores request parameters, so on that
deployment the client talks to its `tensorrt_llm` model directly (`TRTLLM_INPUTS`: token ids in, token
ids out, exact): the backend stops a request when a request with the same id carries `stop: true`
(model_instance_state.cc), which is what `TRTLLM_STOP_INPUTS` sends, as upstream's own client does.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "ensemble"
STOP_PARAMETER = "stop"
KEY_PARAMETER = "request_key"
# the embedded deployment's bounds, which the `triton` backend checks before sending (a refusal from the server
# comes back without its request); top_logprobs' is the protocol's MAX_TOP_LOGPROBS
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class Field:
    name: str
    triton_type: str  # as tritonclient names it
    numpy_type: str  # numpy dtype name ('object' for BYTES)
    shape: tuple[int, ...]
    optional: bool = True


INPUTS = (
    Field("text_input", "BYTES", "object", (1,), optional=False),
    Field("max_tokens", "INT32", "int32", (1,), optional=False),
    Field("stream", "BOOL", "bool", (1,)),
    Field("temperature", "FP32", "float32", (1,)),
    Field("top_p", "FP32", "float32", (1,)),
    Field("top_k", "INT32", "int32", (1,)),
    Field("seed", "UINT64", "uint64", (1,)),
    Field("stop_words", "BYTES", "object", (-1,)),
    Field("end_id", "INT32", "int32", (1,)),
    # embedded extensions
    Field("input_ids", "INT32", "int32", (-1,)),
    Field("top_logprobs", "INT32", "int32", (1,)),
)
OUTPUTS = (
    Field("text_output", "BYTES", "object", (1,), optional=False),
    Field("token_ids", "INT32", "int32", (-1,)),
    Field("logprobs", "FP32", "float32", (-1, 2)),  # per token: (token id, logprob) of its top entries, flattened
    Field("finish_reason", "BYTES", "object", (1,)),
)


# tensorrtllm_backend's `tensorrt_llm` model (inputs batched: shape [1, ...] per request)
TRTLLM_MODEL = "tensorrt_llm"
TRTLLM_INPUTS = (
    Field("input_ids", "INT32", "int32", (1, -1)),
    Field("input_lengths", "INT32", "int32", (1, 1), optional=False),
    Field("request_output_len", "INT32", "int32", (1, 1), optional=False),
    Field("streaming", "BOOL", "bool", (1, 1)),
    Field("end_id", "INT32", "int32", (1, 1)),
    Field("pad_id", "INT32", "int32", (1, 1)),
    Field("temperature", "FP32", "float32", (1, 1)),
    Field("runtime_top_k", "INT32", "int32", (1, 1)),
    Field("runtime_top_p", "FP32", "float32", (1, 1)),
    Field("seed", "UINT64", "uint64", (1, 1)),
    Field("return_log_probs", "BOOL", "bool", (1, 1)),
    Field("stop", "BOOL", "bool", (1, 1)),
)
TRTLLM_STOP_INPUTS = ("input_ids", "input_lengths", "request_output_len", "stop")
TRTLLM_OUTPUTS = ("output_ids", "sequence_length", "output_log_probs")  # output_ids [1, beams, new tokens]

"""Tiny random Llama / Qwen2 checkpoints made on the fly (no download), with a real BPE tokenizer.

Used by the test suite and by `make gpu-smoke`. The tokenizer is trained in milliseconds on the
project's own synthetic TIR text and carries a ChatML template, so prompts, code tags and EOS
behave as with SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from aimo_spec.recipe import CodeTags
    from trtbuild.tir_data import make_traces

    corpus = [t.problem + "\n" + t.reply for t in make_traces(60, 99, CodeTags())] + ["system user assistant"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return fast


def make_model(out: Path, arch: str = "llama", seed: int = 0, tokenizer_from: Path | None = None,
               hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               intermediate_size: int | None = None, sharpen: bool = True) -> Path:
    """A random model of `arch` (llama | qwen2) saved as an HF folder with tokenizer. `sharpen` scales
    the matrices 4x (distinct, peaked outputs for small test models; off for the scale benchmark's
    deep ones, whose activations it would blow up)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from else make_tokenizer(out)
    if tokenizer_from:
        tok.save_pretrained(str(out))
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=1024,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = (LlamaConfig(**common, tie_word_embeddings=True) if arch == "llama"
              else Qwen2Config(**common, tie_word_embeddings=False))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters() if sharpen else ():  # larger than the default init: distinct, peaked outputs
            p.mul_(4.0) if p.ndim == 2 else None
    model.save_pretrained(str(out))
    return out

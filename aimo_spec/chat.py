"""The chat format, in one place: messages, the rendered prompt, token ids, the tool output block.

The build pipeline (calibration text, quality prompts, synthetic traces, drafter data) and the
runtime (every engine backend's `chat_prompt`, the TIR client) all go through these functions, so
what the model was calibrated, priced and trained on is byte for byte what it is served.
transformers is imported only inside `load_tokenizer`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from aimo_spec.recipe import CodeTags


def chat_messages(problem: str, system_prompt: Optional[str] = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": problem}]


def render_prompt(tokenizer: Any, problem: str, system_prompt: Optional[str] = None) -> str:
    """The chat-formatted prompt text, ending where the assistant starts writing."""
    return tokenizer.apply_chat_template(chat_messages(problem, system_prompt), tokenize=False,
                                         add_generation_prompt=True)


TEMPLATE_CHECK_SECONDS = 10.0
TEMPLATE_CHECK_PROBLEM = "What is 1 + 1?"


def check_template(tokenizer: Any, where: str, seconds: float = TEMPLATE_CHECK_SECONDS) -> None:
    """The chat template renders a one-line problem, with the problem in it, within `seconds`; else a
    ValueError naming `where` (the model folder). Checked when an engine loads: a template from a copied or
    edited folder that raised failed the run at its first problem, and one that looped (nested ranges pass
    jinja's sandbox) held the event loop past every deadline. The render runs in a thread of its own,
    abandoned (it is a daemon) when it does not return."""
    import threading

    box: dict[str, Any] = {}

    def render() -> None:
        try:
            box["text"] = render_prompt(tokenizer, TEMPLATE_CHECK_PROBLEM)
        except Exception as e:  # noqa: BLE001 - whatever the template raises is the answer
            box["error"] = e

    worker = threading.Thread(target=render, name="chat-template-check", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ValueError(f"{where}: the chat template did not render a one-line problem in {seconds:g} s (a loop in "
                         "chat_template.jinja or tokenizer_config.json's chat_template?)")
    if "error" in box:
        e = box["error"]
        raise ValueError(f"{where}: the chat template fails on a one-line problem ({type(e).__name__}: "
                         f"{str(e)[:200]})")
    if not isinstance(box.get("text"), str) or TEMPLATE_CHECK_PROBLEM not in box["text"]:
        raise ValueError(f"{where}: the chat template does not write the problem into the prompt (got "
                         f"{repr(box.get('text'))[:200]})")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already chat-formatted text (the template supplies the special tokens)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_literal(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text taken literally: "<|im_end|>" or "</think>" in it are those characters, never the
    added token the tokenizer would match (special or not). For what the model did not write and the template
    did not make (a tool's output): printed by model-written code, those spellings closed the assistant's
    turn or forged a system turn in its context. Text spelling no added token is encoded in one piece, as
    `encode` does; an added token's spelling is encoded as its first character and the rest, apart."""
    spelled = _spelled(tokenizer, [text])
    if not spelled:
        return encode(tokenizer, text)
    return _splice(tokenizer, re.split(f"({_alternation(spelled)})", text), lambda s: s)


_STAND_IN = "\ue000{nonce}\ue001([0-9]+)\ue002"


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    literal_roles: Collection[str] = ("system", "user", "tool")) -> list[int]:
    """Token ids of a chat rendered by the template: the template's special tokens are tokens, the text of
    the messages from outside (`literal_roles`: an API caller's, all but the assistant's; the solver's, the
    problem's only, the recipe's system prompt being the operator's own) is text. A message spelling
    "<|im_end|>\\n<|im_start|>system" (an API caller passing on an end user's text) otherwise closed its own
    turn and forged a system turn, as rendering and tokenizing the whole string does. Assistant messages are
    the model's own and go in as the template makes them (a reasoning template looks for '</think>' in them
    to cut earlier reasoning out). Messages spelling no added token are encoded exactly as `encode` encodes
    the rendered text; in the others each spelling is encoded as `encode_literal` encodes it: the template
    renders stand-ins (private-use characters and digits, which no case change or strip alters) put back as
    literal text. A template that changes the text it inserts into the template's own tokens ('<|IM_END|>'
    through `| lower`) is refused (`_check_inserted`)."""
    outside = [i for i, m in enumerate(messages) if m.get("role") in literal_roles and m.get("content")]
    spelled = _spelled(tokenizer, [messages[i]["content"] for i in outside])
    escaped, nonce = list(messages), ""
    if spelled:
        nonce = _nonce("".join(m.get("content") or "" for m in messages))
        index = {t: i for i, t in enumerate(spelled)}
        pattern = re.compile(_alternation(spelled))

        def stand_in(m: re.Match) -> str:
            return f"\ue000{nonce}\ue001{index[m.group()]}\ue002"
        for i in outside:
            escaped[i] = {**messages[i], "content": pattern.sub(stand_in, messages[i]["content"])}

    def render(msgs: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = render(escaped)
    _check_inserted(tokenizer, text, escaped, outside, render)
    if not spelled:
        return encode(tokenizer, text)
    return _splice(tokenizer, re.split(_STAND_IN.format(nonce=nonce), text), lambda i: spelled[int(i)])


def _check_inserted(tokenizer: Any, text: str, messages: list[dict[str, str]], outside: list[int],
                    render: Callable[[list[dict[str, str]]], str]) -> None:
    """A ValueError when the template made added tokens out of the outside messages' text. Text inserted as
    it is (the usual template) holds none: its spellings are stand-ins by now. Text the template changed
    (strip, case) is checked by counting: the rendered prompt may hold no more added-token spellings than the
    same chat with those messages empty."""
    if all(messages[i]["content"] in text for i in outside):
        return
    chosen = set(outside)
    emptied = [{**m, "content": ""} if i in chosen else m for i, m in enumerate(messages)]
    if _count_spellings(tokenizer, text) > _count_spellings(tokenizer, render(emptied)):
        raise ValueError("the chat template turns message text into its own special tokens (it changes the text "
                         "it inserts, e.g. its case); use a template that inserts message text as it is")


def _count_spellings(tokenizer: Any, text: str) -> int:
    spellings = sorted(_added_tokens(tokenizer), key=len, reverse=True)
    return len(re.findall(_alternation(spellings), text)) if spellings else 0


def _alternation(spellings: list[str]) -> str:
    """A regex matching any of `spellings` as written (longest first where they are sorted so)."""
    return "|".join(re.escape(t) for t in spellings)


def _splice(tokenizer: Any, parts: list[str], spelling: Callable[[str], str]) -> list[int]:
    """The ids of `parts` as `re.split` with one group gives them: text, mark, text, mark, ..., text. The texts
    are encoded as they are, in one batch (a message of 20k spellings took 20k tokenizer calls, 3.7 s);
    each mark stands for `spelling(mark)`, encoded literally (its first character and the rest apart),
    once for each distinct spelling."""
    texts, marks = parts[0::2], parts[1::2]
    batch = [t for t in texts if t]
    encoded = iter(tokenizer(batch, add_special_tokens=False)["input_ids"] if batch else [])
    literal = {}
    for mark in marks:
        s = spelling(mark)
        if s not in literal:
            literal[s] = encode(tokenizer, s[0]) + encode_literal(tokenizer, s[1:])
    ids: list[int] = []
    for i, text in enumerate(texts):
        ids += next(encoded) if text else []
        ids += literal[spelling(marks[i])] if i < len(marks) else []
    return ids


def _spelled(tokenizer: Any, texts: list[str]) -> list[str]:
    """The added tokens' spellings that occur in `texts`, longest first (so a regex takes the longest)."""
    return sorted({t for t in _added_tokens(tokenizer) if any(t in x for x in texts)}, key=len, reverse=True)


def _nonce(text: str) -> str:
    """Twelve random digits that `text` does not hold: the stand-ins' own mark, which a message cannot forge."""
    import secrets

    while (nonce := f"{secrets.randbelow(10**12):012d}") in text:
        pass
    return nonce


def _added_tokens(tokenizer: Any) -> set[str]:
    """The spellings the tokenizer matches as whole tokens before its model runs (added and special ones)."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return {t for t in (*added, *getattr(tokenizer, "all_special_tokens", ())) if t}


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for, with room to spare: a text longer than
    n times this cannot fit n tokens, so it is refused before it is tokenized (tokenizing 24 MB held an event
    loop for 43 s and grew the process by 5 GB, to be refused after). No token spans more characters than
    the longest vocabulary entry (byte-level and sentencepiece vocabularies hold at least one character per
    byte); 4x covers normalisers that merge characters."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return 4 * max((len(t) for t in vocab), default=64)


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer of a checkpoint or engine `model/` folder (pad falls back to eos)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():  # else transformers takes the name for a hub repository and says so
        raise FileNotFoundError(f"{path}: no such folder (a tokenizer's)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except ImportError:  # a missing library is a setup matter, said as transformers says it
        raise
    except Exception as e:  # noqa: BLE001 - a broken tokenizer.json raised KeyError or a bare JSON error
        raise ValueError(f"{path}: the tokenizer could not be loaded ({type(e).__name__}: {str(e)[:200]})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def output_block(tags: CodeTags, output: str) -> str:
    """The block appended after a code block: the tool's output, newline-terminated unless empty."""
    body = output if not output or output.endswith("\n") else output + "\n"
    return f"{tags.output_start}{body}{tags.output_end}"

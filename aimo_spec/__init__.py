"""The bottom floor: the nouns that every other package of the project stands on.

- `schema` and `recipe`: the one recipe schema (`engines/<model>.yaml` -> a validated `Recipe`).
- `layout`: where each stage's output lives under `engines/<model>/` (one object, no path joins).
- `chat`: the chat format (messages, prompt rendering, tokenizer loading, the tool output block).
- `protocol`: the engine protocol (`Request`, `SamplingParams`, `Delta`, `Final`, `Engine`).
- `atomic`: whole-or-nothing file writes for outputs that hold finished work.

Nothing here imports the pipeline (`trtbuild`, `merge`), the runtime (`server`) or the sandbox;
only the standard library and pyyaml at import time (transformers loads inside the functions that
need it). `tests/test_layers.py` holds every package to its floor.
"""

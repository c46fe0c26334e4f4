"""The bottom layer: the nouns that the build pipeline and the runtime both stand on.

- `recipe`: the one recipe schema (`engines/<model>.yaml` -> a validated `Recipe`).
- `layout`: where each stage's output lives under `engines/<model>/` (one object, no path joins).
- `chat`: the chat format (messages, prompt rendering, tokenizer loading, the tool output block).

Nothing here imports the pipeline (`trtbuild.*` outside `core`, `merge`) or the runtime (`server`,
`sandbox`); only the standard library and pyyaml at import time (transformers loads inside the
functions that need it).
"""

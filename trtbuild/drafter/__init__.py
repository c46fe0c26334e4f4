"""ReDrafter (Apple's recurrent drafter): a small head that drafts tokens for speculative decoding.

data.py generates the target's own TIR traces with the project's runtime; model.py is the head
(the tensor names TensorRT-LLM's converter reads); train.py trains it on the frozen target's hidden
states; acceptance.py measures what it buys before any GPU hour is spent; stage.py is the
`drafter` stage of `make engine`.
"""

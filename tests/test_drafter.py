"""The ReDrafter head: export layout (a contract with TensorRT-LLM's converter), beam search,
training, the acceptance measurement against the real target, and the `drafter` stage end to end."""

from __future__ import annotations

import json

import pytest
import torch

from server.embedded.redrafter import DrafterConfig, ReDrafter
from trtbuild.drafter import acceptance
from trtbuild.drafter import train as dtrain
from trtbuild.drafter.data import Sequence

# The tensor names examples/redrafter/convert_checkpoint.py (TensorRT-LLM 1.2.x) reads from the drafter
# folder, for 2 residual blocks: input_proj only when exit_dim != 2 * hidden_size.
CONVERTER_NAMES = {"lm_head.0.linear.weight", "lm_head.0.linear.bias", "lm_head.1.linear.weight",
                   "lm_head.1.linear.bias", "lm_head.2.weight", "rnn_u.weight", "rnn_u.bias", "rnn_w.weight"}


@pytest.fixture(scope="module")
def target(tiny_models):
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import load_model

    return load_model(tiny_models["llama-tir"]), load_tokenizer(tiny_models["llama-tir"])


def greedy_sequences(model, tok, n=3, new=24) -> list[Sequence]:
    out = []
    for i, text in enumerate(["What is 6 times 7?", "Sum of 1 to 10?", "How many primes below 20?"][:n]):
        from aimo_spec.chat import encode, render_prompt

        prompt = encode(tok, render_prompt(tok, text))
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new):  # greedy, by full forwards (the reference numerics)
                ids.append(int(model(input_ids=torch.tensor([ids], device=dtrain.device_of(model)))
                               .logits[0, -1].argmax()))
        out.append(Sequence(ids, [False] * len(prompt) + [True] * new, text, "length"))
    return out


def test_export_has_the_converters_names_shapes_and_dtypes(target, tmp_path):
    from safetensors import safe_open

    from trtbuild.trtllm import preflight

    model, _ = target
    h, v = model.config.hidden_size, model.config.vocab_size
    for exit_dim, with_proj in ((h, True), (2 * h, False)):
        d = ReDrafter(DrafterConfig(hidden_size=h, vocab_size=v, exit_dim=exit_dim, num_draft_layers=2,
                                    trained_draft_len=3))
        out = dtrain.export(d, tmp_path / f"d{exit_dim}")
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            shapes = {k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}
        expected = CONVERTER_NAMES | ({"input_proj.weight", "input_proj.bias"} if with_proj else set())
        assert set(shapes) == expected
        assert all(dt == torch.bfloat16 for _, dt in shapes.values())
        e = exit_dim
        assert shapes["lm_head.0.linear.weight"][0] == (e, e) and shapes["lm_head.1.linear.bias"][0] == (e,)
        assert shapes["lm_head.2.weight"][0] == (v, e)
        assert (shapes["rnn_u.weight"][0] == (h, h) and shapes["rnn_u.bias"][0] == (h,)
                and shapes["rnn_w.weight"][0] == (h, h))
        if with_proj:
            assert shapes["input_proj.weight"][0] == (e, 2 * h) and shapes["input_proj.bias"][0] == (e,)
        config = json.loads((out / "config.json").read_text())
        assert {k: config[k] for k in ("hidden_size", "exit_dim", "num_draft_layers", "rnn", "vocab_size")} == \
            {"hidden_size": h, "exit_dim": e, "num_draft_layers": 2, "rnn": True, "vocab_size": v}
        assert config[preflight.TRAINED_DRAFT_LEN_KEY] == 3
        back = dtrain.load(out)
        for k, t in d.state_dict().items():
            assert torch.equal(back.state_dict()[k], t.to(torch.bfloat16).float()), k


def test_beam_search_one_beam_is_the_greedy_recurrence(target):
    model, _ = target
    embed = model.get_input_embeddings()
    h = model.config.hidden_size
    torch.manual_seed(0)
    d = ReDrafter(DrafterConfig(hidden_size=h, vocab_size=model.config.vocab_size, exit_dim=h, num_draft_layers=2))
    ctx = torch.randn(h)
    beams, _ = d.beam_search(ctx, 5, embed, num_beams=1, draft_len=4)
    state, tok, manual = torch.zeros(1, h), 5, []
    with torch.no_grad():
        for _ in range(4):
            state = d.next_state(state, embed(torch.tensor([tok])).float())
            tok = int(d.logits(ctx[None], state).argmax())
            manual.append(tok)
    assert beams[0].tolist() == manual
    wide, scores = d.beam_search(ctx, 5, embed, num_beams=4, draft_len=4)
    assert wide.shape == (4, 4) and len({tuple(b) for b in wide.tolist()}) == 4
    assert torch.all(scores[:-1] >= scores[1:])


class OracleDrafter(ReDrafter):
    """Test double: drafts the target's true greedy continuation (or, `wrong`, never it)."""

    def __init__(self, model, seqs, wrong=False):
        h = model.config.hidden_size
        super().__init__(DrafterConfig(hidden_size=h, vocab_size=model.config.vocab_size, exit_dim=h,
                                       num_draft_layers=1))
        self.model, self.wrong, self.calls = model, wrong, 0
        self.contexts = {}
        for s in seqs:
            hid = dtrain.hidden_states(model, s.ids).float()
            for t in range(len(s.ids)):
                self.contexts[tuple(hid[t].tolist())] = s.ids[:t + 1]

    def beam_search(self, context, init_token, embed, num_beams, draft_len):
        self.calls += 1
        ids = list(self.contexts[tuple(context.tolist())]) + [init_token]
        cont = []
        dev = dtrain.device_of(self.model)
        with torch.no_grad():
            for _ in range(draft_len):
                nxt = int(self.model(input_ids=torch.tensor([ids], device=dev)).logits[0, -1].argmax())
                cont.append(nxt)
                ids.append(nxt)
        beams = torch.tensor([cont] * num_beams, device=dev)
        if self.wrong:
            beams = (beams + 1) % self.config.vocab_size
        return beams, torch.zeros(num_beams)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
def test_acceptance_is_verified_by_the_real_target(target, device):
    model, tok = target
    model = model.to(device)
    seqs = greedy_sequences(model, tok)
    oracle = OracleDrafter(model, seqs)
    right = acceptance.measure(model, oracle, seqs, num_beams=2, draft_len=3, n_positions=20, seed=1)
    assert oracle.calls == 20 and right["positions"] == 20
    assert right["tokens_per_step"] == 4.0 and right["acceptance_at_position"] == [1.0, 1.0, 1.0]
    wrong = acceptance.measure(model, OracleDrafter(model, seqs, wrong=True), seqs, 2, 3, 20, seed=1)
    assert wrong["tokens_per_step"] == 1.0 and wrong["histogram"]["0"] == 20
    model.to("cpu")


def test_training_raises_heldout_top1(target):
    from aimo_spec.recipe import DrafterTrainSpec

    model, tok = target
    seqs = greedy_sequences(model, tok, n=3, new=40)
    spec = DrafterTrainSpec(draft_steps=2, layers=1, steps=40, batch_size=16, lr=3e-3, seed=0)
    drafter, report = dtrain.train(model, seqs[:2], seqs[2:], spec, log=lambda m: None)
    assert report["positions"] > 50 and len(report["heldout_top1"]) == 2
    assert report["train_loss_last"] < 0.5 * report["train_loss_first"]
    assert drafter.config.trained_draft_len == 2 and next(drafter.parameters()).device.type == "cpu"


def test_drafter_stage_in_make_engine(tiny_models, tmp_path, capfd):
    """`engine` with drafter.kind redrafter: trained on the target's own TIR generations, measured, attached."""
    from small_recipes import write_recipe

    from aimo_spec.recipe import load_recipe
    from trtbuild import manifest as mf
    from trtbuild.__main__ import main

    path = write_recipe(tmp_path, "tinyd", {"cot": {"kind": "hf", "path": str(tiny_models["llama-cot"])},
                                            "tir": {"kind": "hf", "path": str(tiny_models["llama-tir"])}},
                        quantize={"formats": ["int8_wo"]},
                        drafter={"kind": "redrafter", "num_beams": 2, "draft_len_per_beam": 2,
                                 "train": {"prompts": 4, "heldout_prompts": 2, "samples_per_prompt": 1,
                                           "max_tokens": 24, "draft_steps": 2, "layers": 1, "steps": 6, "batch_size": 8,
                                           "eval_positions": 6}},
                        serving={"tool": {"wall_seconds": 3}})
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    recipe = load_recipe(path)
    out = recipe.out_dir / "drafter"
    m = mf.read_manifest(out)
    assert (out / "model" / "config.json").is_file() and (out / "model" / "model.safetensors").is_file()
    acc = json.loads((out / "acceptance.json").read_text())
    assert acc["num_beams"] == 2 and acc["draft_len_per_beam"] == 2 and 0 < acc["positions"] <= 6
    assert 1.0 <= acc["tokens_per_step"] <= 3.0 and len(acc["acceptance_at_position"]) == 2
    assert m["data"]["train_samples"] == 4 and m["data"]["heldout_samples"] == 2
    assert m["training"]["steps"] == 6 and m["config"]["trained_draft_len"] == 2
    built = recipe.out_dir / "build" / "embedded"
    spec = json.loads((built / "engine.json").read_text())
    assert spec["drafter"]["kind"] == "redrafter" and spec["drafter_dir"] == "drafter"
    assert (built / "drafter" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    # the folder serves with its drafter (2 beams x 2: the best beam is verified), tokens as without it
    import asyncio

    from aimo_spec.protocol import Request, SamplingParams, collect
    from server.embedded.engine import EmbeddedEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    finals = {}
    for mode in ("on", "off"):
        # drafting is off by default on CPUs (measured slower there): max_batch turns it on
        eng = EmbeddedEngine.from_dir(built, speculative=mode, speculative_max_batch=4, device="cpu")
        try:
            assert (eng.spec is not None) == (mode == "on")
            finals[mode] = asyncio.run(collect(eng, Request(eng.chat_prompt("What is 2 + 3?"), greedy)))[1]
        finally:
            eng.shutdown()
    assert finals["on"].token_ids == finals["off"].token_ids and finals["on"].draft_tokens > 0
    capfd.readouterr()
    assert main(["drafter", "--recipe", str(path)]) == 0
    assert "up to date" in capfd.readouterr().err


def test_draft_length_beyond_training_is_a_recipe_error(tmp_path):
    from small_recipes import write_recipe

    from aimo_spec.recipe import RecipeError, load_recipe

    path = write_recipe(tmp_path, "bad", {"cot": {"kind": "hf", "path": "x"}, "tir": {"kind": "hf", "path": "y"}},
                        drafter={"kind": "redrafter", "draft_len_per_beam": 4, "train": {"draft_steps": 3}})
    with pytest.raises(RecipeError, match="drafter.draft_len_per_beam: must not exceed drafter.train.draft_steps"):
        load_recipe(path, check_paths=False)

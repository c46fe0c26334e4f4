"""engine.json and the engine folder under a hostile probe (stop 51): every value the serving code reads is
checked before anything loads, with the file, key and value named; files the loaders read are checked from
their headers (a FIFO where the weights go no longer blocks the check)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aimo_spec.engine_file import check_engine_spec
from aimo_spec.safetensors_header import SafetensorsError, read_header

GOOD = {"backend": "embedded", "model_dir": "model", "drafter_dir": "drafter",
        "limits": {"max_batch_size": 16, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 8192,
                   "tp_size": 1},
        "drafter": {"num_beams": 1, "draft_len_per_beam": 3}}


def changed(path: str, value: object) -> dict:
    spec = json.loads(json.dumps(GOOD))
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return spec


def test_a_built_engine_file_passes():
    assert check_engine_spec(GOOD, Path("e/engine.json")) is GOOD


@pytest.mark.parametrize("path, value, words", [
    ("limits.max_batch_size", 0, "limits.max_batch_size: an integer >= 1 (got 0)"),  # loaded, then admitted nothing
    ("limits.max_seq_len", 10 ** 12, "limits.max_seq_len: at most"),  # the process was killed for memory
    ("limits.max_seq_len", -5, "limits.max_seq_len: an integer >= 1 (got -5)"),
    ("limits.max_seq_len", 4096.5, "limits.max_seq_len: an integer >= 1"),
    ("limits.max_batch_size", "16", "limits.max_batch_size: an integer >= 1 (got '16')"),
    ("limits.max_input_len", 100000, "limits.max_input_len: at most limits.max_seq_len (4096)"),
    ("limits.tp_size", True, "limits.tp_size: an integer >= 1 (got True)"),
    ("limits", KeyError, "limits: a mapping"),  # KeyError: 'limits' before
    ("limits", "big", "limits: a mapping"),
    ("backend", ["embedded"], "backend: must be one of embedded, trtllm"),  # TypeError: unhashable before
    ("model_dir", KeyError, "model_dir: a folder inside the engine folder"),
    ("model_dir", 5, "model_dir: a folder inside the engine folder, named relative to it (got 5)"),
    ("model_dir", "../../etc", "model_dir: a folder inside the engine folder"),
    ("drafter_dir", "/abs/drafter", "drafter_dir: a folder inside the engine folder"),
    ("drafter.num_beams", 0, "drafter.num_beams: an integer in 1..64 (got 0)"),  # IndexError in every request
    ("drafter.draft_len_per_beam", "x", "drafter.draft_len_per_beam: an integer in 1..64"),
    ("drafter", [1], "drafter: a mapping"),
])
def test_a_bad_value_is_named_with_its_file_and_key(path, value, words):
    with pytest.raises(ValueError) as e:
        check_engine_spec(changed(path, value), Path("e/engine.json"))
    assert str(e.value).startswith("e/engine.json: ") and words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="an engine file is a JSON object"):
        check_engine_spec([GOOD], Path("e/engine.json"))


def test_a_fifo_where_the_weights_go_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(SafetensorsError, match="not a regular file"):
        read_header(fifo)


def test_the_engine_check_reads_the_drafter_and_the_json_files(tmp_path, tiny_models):
    from kaggle_kit import engine_folder

    from server.engine_check import EngineFolderError, check_engine_folder

    folder = engine_folder(tmp_path, tiny_models)
    spec = check_engine_folder(folder)
    (folder / "model" / "tokenizer.json").write_text('{"garbage": ')
    with pytest.raises(EngineFolderError, match=r"model/tokenizer.json: not valid JSON"):
        check_engine_folder(folder)
    (folder / "model" / "tokenizer.json").unlink()
    if not (folder / "model" / "tokenizer_config.json").is_file():
        return
    (folder / "drafter").mkdir(exist_ok=True)
    (folder / "engine.json").write_text(json.dumps({**spec, "drafter_dir": "drafter"}))
    with pytest.raises(EngineFolderError, match=r"drafter/config.json: missing \(the engine's drafter"):
        check_engine_folder(folder)


@pytest.mark.parametrize("template, words", [
    ("{{ raise_exception('boom') }}", "fails on a one-line problem (TemplateError: boom)"),
    ("nothing of the messages", "does not write the problem into the prompt"),
])
def test_a_chat_template_that_loops_raises_or_drops_the_problem_is_named(tiny_models, template, words):
    """A looping template held solve past every budget (nested ranges pass jinja's sandbox), a raising one
    failed the run at its first problem with a traceback: the engine checks it when it loads."""
    from aimo_spec.chat import check_template, load_tokenizer

    tokenizer = load_tokenizer(tiny_models["llama-tir"])
    check_template(tokenizer, "m")
    tokenizer.chat_template = template
    with pytest.raises(ValueError) as e:
        check_template(tokenizer, "model-folder")
    assert str(e.value).startswith("model-folder: the chat template") and words in str(e.value), str(e.value)


def test_a_chat_template_that_does_not_return_is_abandoned_in_time():
    """The probe's template looped 99999 x 99999 times (nested ranges pass jinja's sandbox) and held solve
    past every budget; here a render that waits stands for it (no CPU burnt), released after the check."""
    import threading

    from aimo_spec.chat import check_template

    release = threading.Event()

    class Stuck:
        def apply_chat_template(self, *args, **kwargs):
            release.wait(60)
            return ""
    try:
        with pytest.raises(ValueError, match="model-folder: the chat template did not render a one-line problem in "
                                             "0.2 s"):
            check_template(Stuck(), "model-folder", seconds=0.2)
    finally:
        release.set()


def test_a_broken_tokenizer_is_named_by_its_folder(tmp_path, tiny_models):
    import shutil

    from aimo_spec.chat import load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama-tir"], folder)
    load_tokenizer(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')  # valid JSON of the wrong shape: KeyError before
    with pytest.raises(ValueError, match=f"{folder}: the tokenizer could not be loaded"):
        load_tokenizer(folder)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_tokenizer(tmp_path / "nope")


def test_weights_that_do_not_fit_their_config_are_named_by_their_folder(tmp_path, tiny_models):
    """A config whose sizes do not match the weights failed with torch's 'size mismatch for ...', naming no
    folder (the probe: vocab_size changed in model/config.json)."""
    import shutil

    from server.embedded.engine import EmbeddedEngine

    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama-tir"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 100}))
    with pytest.raises(ValueError, match=f"{folder}: the weights could not be loaded"):
        EmbeddedEngine.from_dir(folder, device="cpu")


@pytest.mark.parametrize("check_folder", [True, False])
def test_open_engine_passes_the_serving_settings_whether_it_checks_the_folder_or_not(tmp_path, tiny_models,
                                                                                      monkeypatch, check_folder):
    """The Kaggle predictor opens its engine without a second check (check_folder=False); its serving settings
    must reach the engine all the same (a slip in 3b9c78b dropped them there)."""
    from kaggle_kit import engine_folder

    from aimo_spec.recipe import ServingSpec
    from server import backends

    folder = engine_folder(tmp_path, tiny_models)
    got = {}

    class Driver:
        @staticmethod
        def from_dir(path, **kw):
            got.update(kw)
            return "engine"
    monkeypatch.setattr(backends, "driver", lambda name: Driver)
    serving = ServingSpec(device="cpu")
    assert backends.open_engine(folder, serving, check_folder=check_folder) == "engine"
    assert got["serving"] is serving

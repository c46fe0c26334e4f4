"""Extract the TensorRT-LLM 1.2.x contract from upstream source files into a snapshot the tests read.

    python tests/upstream/extract.py --upstream /tmp/upstream --out tests/upstream/trtllm_1_2.json

`--upstream` is a folder holding upstream files as `<owner>/<repo>/<commit>/<path>` plus `manifest.json`
(each file's repo, path, commit, role, and whether it is the whole file or an excerpt). The script reads
only those files: argparse calls, binding keyword lists, `${...}` placeholders, fill_template's default
substitutions and a few behaviours stated in the source (streamed log_probs, the stop input, ReDrafter's
quantization exclusions). It writes facts as data, never upstream text, and never downloads anything.
Standard library only, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

SNAPSHOT_VERSION = 1


class ExtractError(ValueError):
    """A manifest entry or upstream file that does not say what the extractor expects."""


# ------------------------------------------------------------------ files
def load_manifest(root: Path) -> dict[str, Any]:
    path = root / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExtractError(f"{path}: not found (the folder must hold manifest.json)") from None


def local_path(root: Path, entry: dict[str, Any]) -> Path:
    return root / entry["repo"] / entry["commit"] / entry["path"]


def read(root: Path, entry: dict[str, Any]) -> str:
    path = local_path(root, entry)
    if not path.is_file():
        raise ExtractError(f"{path}: missing ({entry['repo']} {entry['path']} @ {entry['commit']})")
    return path.read_text()


def entries(manifest: dict[str, Any], role: str) -> list[dict[str, Any]]:
    found = [e for e in manifest["files"] if e["role"] == role]
    if not found:
        raise ExtractError(f"manifest.json: no file with role {role!r}")
    return found


# ------------------------------------------------------------------ python sources (ast, never executed)
def _calls(tree: ast.AST, attr: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
            yield node


def _literal(node: Optional[ast.AST]) -> Any:
    """The value of a literal node; source text for anything else (e.g. BuildConfig.max_batch_size)."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def argparse_flags(text: str, where: str) -> dict[str, dict[str, Any]]:
    """{flag: {takes_value, choices, default, required, aliases}} from every `*.add_argument(...)` call."""
    flags: dict[str, dict[str, Any]] = {}
    for call in _calls(ast.parse(text, where), "add_argument"):
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        names = [n for n in names if n.startswith("--")]
        if not names:
            continue  # a positional argument or a short option only
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        action = _literal(kw.get("action"))
        info = {"takes_value": action not in ("store_true", "store_false"), "choices": _literal(kw.get("choices")),
                "default": _literal(kw.get("default")), "required": bool(_literal(kw.get("required"))),
                "aliases": names[1:]}
        for n in names:
            flags[n] = info
    if not flags:
        raise ExtractError(f"{where}: no add_argument calls found")
    return flags


def _assigned(tree: ast.AST, name: str) -> Optional[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    return None


def plugin_flags(text: str, where: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """trtllm-build's plugin flags (PluginConfig fields named in cli_plugin_args) and every field's default."""
    tree = ast.parse(text, where)
    cli = _literal(_assigned(tree, "cli_plugin_args"))
    if not isinstance(cli, list):
        raise ExtractError(f"{where}: cli_plugin_args not found")
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PluginConfig"), None)
    if cls is None:
        raise ExtractError(f"{where}: class PluginConfig not found")
    aliases = {t.id: ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name) and ast.unparse(n.value).startswith("Literal[")}
    defaults: dict[str, Any] = {}
    types: dict[str, str] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and any(k.arg == "default" for k in value.keywords):
                value = next(k.value for k in value.keywords if k.arg == "default")
            defaults[node.target.id] = _literal(value)
            kind = ast.unparse(node.annotation)
            for alias, literal in aliases.items():
                kind = re.sub(r"\b" + alias + r"\b", literal, kind)
            types[node.target.id] = kind
    flags = {}
    for name in cli:
        if name not in types:
            raise ExtractError(f"{where}: cli_plugin_args names {name!r}, which PluginConfig lacks")
        choices = ["enable", "disable"] if types[name] == "bool" else None
        literal = re.search(r"Literal\[([^\]]*)\]", types[name])
        if literal:
            choices = [a or b or "disable"
                       for a, b, _ in re.findall(r"'([^']*)'|\"([^\"]*)\"|(None)", literal.group(1))]
        flags["--" + name] = {"takes_value": True, "choices": choices, "default": defaults[name], "required": False,
                              "aliases": []}
    return flags, defaults


def dict_literal(text: str, name: str, where: str) -> dict[str, Any]:
    value = _literal(_assigned(ast.parse(text, where), name))
    if not isinstance(value, dict):
        raise ExtractError(f"{where}: no dict literal assigned to {name}")
    return value


def dataclass_fields(text: str, cls_name: str, where: str) -> list[str]:
    tree = ast.parse(text, where)
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        raise ExtractError(f"{where}: class {cls_name} not found")
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def default_exclusions(text: str, where: str) -> list[str]:
    """The list quantize_layers falls back to when QuantConfig.exclude_modules is None."""
    for node in ast.walk(ast.parse(text, where)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "exclude_modules"
                                                for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.List) and sub.elts and all(isinstance(e, ast.Constant) for e in sub.elts):
                    return [e.value for e in sub.elts]
    raise ExtractError(f"{where}: no default exclude_modules list found")


def infer_input_names(text: str, function: str, where: str) -> list[str]:
    """Names given to InferInput(...) inside `function` (the upstream client's stop request)."""
    tree = ast.parse(text, where)
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function), None)
    if fn is None:
        raise ExtractError(f"{where}: function {function} not found")
    return [c.args[0].value for c in _calls(fn, "InferInput") if c.args and isinstance(c.args[0], ast.Constant)]


# ------------------------------------------------------------------ C++ bindings and sources (regex)
def binding_keywords(text: str, where: str) -> dict[str, dict[str, list[str]]]:
    """{class: {positional, keyword, required}} from nanobind/pybind `arg("name")` lists (required: no default)."""
    out: dict[str, dict[str, list[str]]] = {}
    pieces = re.split(r'(?:nb|py|nano)::class_<[\w:]+>\(m, "(\w+)"\)', text)
    for cls, body in zip(pieces[1::2], pieces[2::2]):
        init = body.split(".def_", 1)[0]
        names, positional, required, kw_only = [], [], [], False
        for m in re.finditer(r'::(kw_only)\(\)|::arg(_v)?\("(\w+)"(\)\s*=|,)?', init):
            if m.group(1):
                kw_only = True
                continue
            names.append(m.group(3))
            if not kw_only:
                positional.append(m.group(3))
            if not (m.group(2) or m.group(4)):
                required.append(m.group(3))
        if names:
            out[cls] = {"positional": positional, "keyword": names, "required": required}
    if not out:
        raise ExtractError(f"{where}: no binding keyword lists found")
    return out


def enum_values(text: str, enum: str) -> list[str]:
    m = re.search(r'enum_<[\w:]+>\(m, "' + enum + r'"\)(.*?);', text, re.S)
    return re.findall(r'\.value\("(\w+)"', m.group(1)) if m else []


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def streaming_semantics(text: str, where: str) -> dict[str, Any]:
    """What a streamed executor Result carries, from LlmRequest::createResult."""
    flat = _flat(text)
    delta = re.search(r"mReturnAllGeneratedTokens \? maxNbTokens - getOrigPromptLen\(\) "
                      r": maxNbTokens - getMaxSentTokenLen\(\)", flat)
    whole = re.search(r"result\.logProbs = sliceBeams\(getLogProbs\(\)\)", flat)
    if not (delta and whole):
        raise ExtractError(f"{where}: createResult no longer reads as expected (token slicing / logProbs)")
    return {"output_token_ids": "new tokens since the last response (all generated tokens when "
                                "return_all_generated_tokens)",
            "output_token_ids_per_delta": True,
            "log_probs": "all generated tokens so far (not sliced like output_token_ids)",
            "log_probs_cumulative": True}


def stop_semantics(cc: str, utils_h: str, where: str) -> dict[str, Any]:
    """How the tensorrt_llm model stops a request, from model_instance_state.cc and utils.h."""
    name = re.search(r'kStopInputTensorName = "(\w+)"', utils_h)
    flat = _flat(cc)
    keyed = re.search(r"handleStopRequest\(request, tritonRequestId\)", flat)
    cancels = re.search(r"handleStopRequest.*?mExecutor->cancelRequest\(requestId\)", flat)
    polled = re.search(r"TRITONBACKEND_ResponseFactoryIsCancelled.*?mExecutor->cancelRequest\(requestId\)", flat)
    period = re.search(r"int cancellationCheckPeriodMs = (\d+);", flat)
    if not (name and keyed and cancels and polled and period):
        raise ExtractError(f"{where}: the stop / cancellation code no longer reads as expected")
    return {"input": name.group(1), "keyed_by": "triton request id", "executor_call": "cancelRequest",
            "stop_response": "one empty final response to the stop request itself",
            "client_cancellation_polled": True, "cancellation_check_period_ms_default": int(period.group(1))}


# ------------------------------------------------------------------ Triton model configs
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def _blocks(section: str) -> list[str]:
    """Top-level `{...}` blocks of a pbtxt list body."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(section):
        if ch == "{":
            depth += 1
            if depth == 1:
                start = i
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append(section[start:i + 1])
    return out


def _list_section(text: str, key: str) -> str:
    m = re.search(r"^\s*" + key + r"\s*\[", text, re.M)
    if not m:
        return ""
    depth, i = 1, m.end()
    while depth and i < len(text):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def _tensors(section: str) -> dict[str, dict[str, Any]]:
    out = {}
    for block in _blocks(section):
        name = re.search(r'name:\s*"(\w+)"', block)
        if name:
            dtype = re.search(r"data_type:\s*([\w${}]+)", block)
            out[name.group(1)] = {"data_type": dtype.group(1) if dtype else None,
                                  "optional": bool(re.search(r"optional:\s*true", block))}
    return out


def template_facts(text: str) -> dict[str, Any]:
    """Placeholders (and which sit outside quotes: unfilled, they make config.pbtxt unparseable), inputs, outputs."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    names = sorted(set(PLACEHOLDER.findall(body)))
    quoted = set(re.findall(r'"\$\{(\w+)\}"', body))
    return {"placeholders": names, "bare_placeholders": sorted(set(names) - quoted),
            "inputs": _tensors(_list_section(body, "input")),
            "outputs": sorted(_tensors(_list_section(body, "output")))}


def docs_mandatory(text: str) -> dict[str, list[str]]:
    """Per model, the backend docs' *Mandatory parameters* table."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"^### (\w+) model\s*$(.*?)(?=^### |\Z)", text, re.M | re.S):
        mand = re.search(r"\*Mandatory parameters\*(.*?)(?=\*Optional|\Z)", m.group(2), re.S)
        if mand:
            out[m.group(1)] = re.findall(r"^\|\s*`(\w+)`", mand.group(1), re.M)
    return out


def docs_fill_keys(text: str) -> dict[str, list[str]]:
    """Per model, the keys the backend docs' fill_template.py examples pass."""
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"fill_template\.py -i \S*?/(\w+)/config\.pbtxt (\S+)", text):
        keys = {kv.split(":", 1)[0] for kv in m.group(2).split(",") if ":" in kv}
        out.setdefault(m.group(1), set()).update(keys)
    return {k: sorted(v) for k, v in out.items()}


# ------------------------------------------------------------------ the snapshot
def source_record(root: Path, entry: dict[str, Any]) -> dict[str, Any]:
    path = local_path(root, entry)
    rec = {k: entry[k] for k in ("repo", "path", "commit", "role", "kind") if k in entry}
    rec.update({k: entry[k] for k in ("model", "note") if k in entry})
    rec["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return rec


def commands(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    (build,) = entries(manifest, "trtllm_build_args")
    (plugin,) = entries(manifest, "trtllm_build_plugin_args")
    trt = argparse_flags(read(root, build), build["path"])
    pflags, pdefaults = plugin_flags(read(root, plugin), plugin["path"])
    versions = {e["commit"]: argparse_flags(read(root, e), e["path"]) for e in entries(manifest, "quantize_args")}
    common = set.intersection(*(set(v) for v in versions.values()))
    first = next(iter(versions.values()))
    (rd,) = entries(manifest, "redrafter_args")
    return {
        "trtllm-build": {"flags": {**trt, **pflags}, "from": [build["commit"], plugin["commit"]]},
        "quantize.py": {"flags": {f: first[f] for f in sorted(common)},
                        "per_version": {c: sorted(v) for c, v in versions.items()},
                        "qformat_choices_per_version": {c: v["--qformat"]["choices"] for c, v in versions.items()},
                        "note": "flags: those every stored version accepts"},
        "convert_checkpoint.py": {"flags": argparse_flags(read(root, rd), rd["path"]), "from": [rd["commit"]]},
    }, pdefaults


def redrafter(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    (rd,) = entries(manifest, "redrafter_args")
    text = read(root, rd)
    flat = _flat(text)
    only_when = re.search(r'getattr\(tllm_config\.quantization, "exclude_modules", None\) is not None', flat)
    if not only_when:
        raise ExtractError(f"{rd['path']}: the drafter exclusion block no longer reads as expected")
    listed = re.search(r"redrafter_exclude_modules = \[(.*?)\]", flat)
    return {"architecture_map": dict_literal(text, "REDRAFTER_MAP", rd["path"]),
            "excludes_drafter_only_when_exclude_modules_is_a_list": True,
            "drafter_modules": re.findall(r"'([\w.]+)'", listed.group(1)) if listed else [],
            "drafter_modules_rnn": ["drafter.rnn_u", "drafter.rnn_w"] if "'drafter.rnn_u'" in text else [],
            "drafter_modules_per_layer": re.findall(r"f'(drafter\.layers\.\{lyrnum\}[\w.]*)'", text)}


def quantization(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    (qc,) = entries(manifest, "quant_config")
    (dx,) = entries(manifest, "quant_default_exclusions")
    (wo,) = entries(manifest, "quantize_wo")
    wo_text = _flat(read(root, wo))
    empty = re.search(r'"int8_wo": EMPTY_CFG', wo_text)
    w8a16 = re.search(r'if qformat == "int8_wo": tensorrt_llm_config\["quantization"\]\[ "quant_algo"\] = '
                      r'QuantAlgo\.W8A16', wo_text)
    kv_block = re.search(r"KV_QUANT_CFG_CHOICES = \{(.*?)\}", wo_text)  # passages, not a parseable module
    kv = re.findall(r'"(\w+)":', kv_block.group(1)) if kv_block else []
    if not (empty and w8a16):
        raise ExtractError(f"{wo['path']}: the int8_wo route no longer reads as expected")
    return {"quant_config_fields": dataclass_fields(read(root, qc), "QuantConfig", qc["path"]),
            "default_exclude_modules": default_exclusions(read(root, dx), dx["path"]),
            "quantize_py_int8_wo": {"modelopt_weights": "unquantized (EMPTY_CFG)", "checkpoint_quant_algo": "W8A16",
                                    "kv_cache_dtypes": sorted(kv)}}


def executor(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    keywords: dict[str, Any] = {}
    reasons: list[str] = []
    for e in entries(manifest, "bindings"):
        text = read(root, e)
        keywords.update(binding_keywords(text, e["path"]))
        reasons = reasons or enum_values(text, "FinishReason")
    (st,) = entries(manifest, "streaming")
    return {"keywords": keywords, "finish_reasons": reasons,
            "streaming": streaming_semantics(read(root, st), st["path"])}


def triton(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    (ft,) = entries(manifest, "fill_template")
    templates = {e["model"]: template_facts(read(root, e)) for e in entries(manifest, "template")}
    (cc,) = entries(manifest, "stop_backend")
    (uh,) = entries(manifest, "stop_backend_names")
    (cl,) = entries(manifest, "stop_client")
    (dm,) = entries(manifest, "backend_docs")
    (dl,) = entries(manifest, "backend_fill_examples")
    stop = stop_semantics(read(root, cc), read(root, uh), cc["path"])
    stop["stop_request_inputs"] = infer_input_names(read(root, cl), "prepare_stop_signals", cl["path"])
    stop["ensemble_has_stop_input"] = stop["input"] in templates["ensemble"]["inputs"]
    older = {e["model"]: template_facts(read(root, e))["placeholders"] for e in entries(manifest, "older_template")}
    return {"fill_template_defaults": dict_literal(read(root, ft), "sub_dict", ft["path"]),
            "templates": templates, "older_template_placeholders": older,
            "docs_mandatory_parameters": docs_mandatory(read(root, dm)),
            "docs_fill_keys": docs_fill_keys(read(root, dl)), "stop": stop}


def snapshot(root: Path) -> dict[str, Any]:
    manifest = load_manifest(root)
    cmds, plugin_defaults = commands(root, manifest)
    return {
        "snapshot_version": SNAPSHOT_VERSION,
        "generated_by": "tests/upstream/extract.py",
        "about": manifest.get("note", ""),
        "sources": [source_record(root, e) for e in manifest["files"]],
        "not_read": manifest.get("not_read", []),
        "commands": cmds,
        "plugin_defaults": {k: plugin_defaults[k] for k in ("tokens_per_block", "use_paged_context_fmha",
                                                             "use_fp8_context_fmha", "remove_input_padding")},
        "redrafter": redrafter(root, manifest),
        "quantization": quantization(root, manifest),
        "executor": executor(root, manifest),
        "triton": triton(root, manifest),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/upstream/extract.py", description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, type=Path, help="folder with manifest.json and the upstream files")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("trtllm_1_2.json"))
    args = ap.parse_args(argv)
    try:
        data = snapshot(args.upstream)
    except (ExtractError, SyntaxError) as e:
        print(f"extract: {e}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"extract: {len(data['sources'])} upstream files -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

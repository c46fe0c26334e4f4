"""The direction of dependency, checked on the source: no import runs back up a floor.

Floors, bottom up: `aimo_spec` (recipe schema, layout, chat format, engine protocol); `sandbox` and
`merge` (stand on aimo_spec only); the runtime `server` (stands on aimo_spec and sandbox, never on
the pipeline); the build pipeline `trtbuild` (may use everything: its quality gates and the drafter
run the real runtime).
Inside the runtime: the request nouns and stream, then the backend drivers, then the TIR client and
solver, then the surfaces (evaluation, Kaggle, Triton deployment). Imports inside functions count too.
Programs (what `python -m` runs) are the top floor and live in their packages' programs places only:
no other module has an `if __name__ == "__main__"` block, and no library module imports a program.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("aimo_spec", "trtbuild", "merge", "server", "sandbox")

ALLOWED = {  # package -> what its modules may import from the project
    "aimo_spec": ("aimo_spec",),
    "merge": ("merge", "aimo_spec"),
    "sandbox": ("sandbox", "aimo_spec"),
    "server": ("server", "sandbox", "aimo_spec"),
    "trtbuild": PROJECT,
}
PROGRAM_PLACES = ("server.programs", "server.bench", "trtbuild.programs", "trtbuild.__main__", "sandbox._worker")
RUNTIME_FLOORS = (  # inside server/: module prefixes per floor, bottom up; anything else is a surface
    ("server.textstream", "server.stream", "server.answers", "server.answer_latex", "server.budget", "server.tables"),
    ("server.embedded.", "server.trtllm.engine", "server.triton.engine", "server.triton.interface",
     "server.openai.engine", "server.openai.replicas", "server.openai.routing", "server.openai.probe",
     "server.openai.remote_completion", "server.openai.connections", "server.backends", "server.engine_check"),
    ("server.toolerrors", "server.tir", "server.solver", "server.metrics", "server.problems", "server.assembly"),
)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out.update(n for n in names if n.split(".")[0] in PROJECT)
    return out


def sources() -> list[Path]:
    return sorted(p for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py"))


def is_program(module: str) -> bool:
    return any(_within(module, place) for place in PROGRAM_PLACES)


def has_main_block(source: str) -> bool:
    """Whether the source has an `if __name__ == "__main__":` block (either operand order)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.comparators) == 1:
            operands = [node.test.left, node.test.comparators[0]]
            if (any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands)
                    and any(isinstance(o, ast.Constant) and o.value == "__main__" for o in operands)):
                return True
    return False


def floor(module: str) -> int:
    for i, prefixes in enumerate(RUNTIME_FLOORS):
        if any(module == p or module.startswith(p if p.endswith(".") else p + ".") for p in prefixes):
            return i
    return len(RUNTIME_FLOORS)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package(module: str) -> str | None:
    matches = [p for p in ALLOWED if _within(module, p)]
    return max(matches, key=len) if matches else None


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_up_a_floor(path):
    module = module_name(path)
    pkg = _package(module)
    bad = []
    for name in sorted(project_imports(path)):
        if pkg is not None and not any(_within(name, a) for a in ALLOWED[pkg]):
            bad.append(f"{name} (a {pkg} module may import only {', '.join(ALLOWED[pkg])})")
        elif module.startswith("server") and name.startswith("server") and floor(name) > floor(module):
            bad.append(f"{name} (floor {floor(name)} above {module}'s floor {floor(module)})")
    assert not bad, f"{path.relative_to(ROOT)} imports up a floor: " + "; ".join(bad)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_programs_live_in_the_programs_places(path):
    module = module_name(path)
    if is_program(module):
        return
    assert not has_main_block(path.read_text()), (
        f"{path.relative_to(ROOT)} has an `if __name__ == \"__main__\"` block: a program belongs in one of "
        f"{', '.join(PROGRAM_PLACES)} (its library part stays where it is)")
    imported = sorted(n for n in project_imports(path) if is_program(n))
    assert not imported, f"{path.relative_to(ROOT)} is library but imports programs: {', '.join(imported)}"


def test_the_rules_bite():
    """The checks themselves: the imports the old layout had are caught, and so are programs out of place."""
    assert _package("server.textstream") == "server" and not any(_within("trtbuild.tir_data", a)
                                                                 for a in ALLOWED["server"])
    assert floor("server.stream") < floor("server.tir") < floor("server.programs.solve")
    assert _package("aimo_spec.chat") == "aimo_spec" and _package("trtbuild.quality") == "trtbuild"
    assert not any(_within(m, a) for m in ("server.stream", "trtbuild.build", "sandbox.pool")
                   for a in ALLOWED["aimo_spec"])
    assert is_program("server.programs.solve") and is_program("trtbuild.__main__") and is_program("server.bench.gpu")
    assert not is_program("server.solver") and not is_program("trtbuild.programs_list")
    assert has_main_block('import sys\nif "__main__" == __name__:\n    sys.exit(0)\n')
    assert not has_main_block('RUNNER = """\nexec(code, {"__name__": "__main__"})\n"""\n')

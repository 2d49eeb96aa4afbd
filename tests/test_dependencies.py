"""Every module that the package, the tests, the examples or the notebook import is declared in
``pyproject.toml`` (or is the standard library, torch's own dependencies, or the project's own code):
a package installed by hand on one machine must not hide a missing declaration from a fresh install."""

import ast
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("autoplan", "solvers", "tests", "examples")


def _requirement_name(spec: str) -> str:
    """The distribution a requirement string names, normalised as the registry does."""
    return _normalise(re.split(r"[\s\[<>=!~;(]", spec.strip(), maxsplit=1)[0])


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """Distributions ``pip install -e '.[dev]'`` (with every extra) installs directly, and those torch
    installs with itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    names = {_requirement_name(s) for s in specs}
    names |= {_requirement_name(r) for r in importlib.metadata.requires("torch") or [] if "extra ==" not in r}
    return names


def _imports_of(source: str) -> set[str]:
    """Top-level names of every absolute import in ``source``, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value.split(".")[0])
    return found


def imports_by_file() -> dict[str, set[str]]:
    """Imported top-level names per source file (notebook code cells included)."""
    files = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            files[str(path.relative_to(ROOT))] = _imports_of(path.read_text())
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        files[str(path.relative_to(ROOT))] = _imports_of(code)
    return files


def _local_names() -> set[str]:
    """The project's own importable names: its packages and every module beside a test or example."""
    names = {"autoplan", "solvers"}
    for folder in ("tests", "examples"):
        names |= {p.stem for p in (ROOT / folder).glob("*.py")}
    return names


def undeclared(files: dict[str, set[str]], allowed: set[str]) -> list[str]:
    """'file: module (distribution)' for every import no declared distribution provides."""
    providers = importlib.metadata.packages_distributions()
    local, problems = _local_names(), []
    for file, modules in files.items():
        for module in sorted(modules):
            if module in sys.stdlib_module_names or module in local:
                continue
            dists = {_normalise(d) for d in providers.get(module, [])}
            if not dists & allowed:
                problems.append(f"{file}: imports {module!r} ({', '.join(sorted(dists)) or 'not installed'})")
    return problems


def test_every_import_is_a_declared_dependency():
    problems = undeclared(imports_by_file(), declared())
    assert not problems, "undeclared imports (add them to pyproject.toml):\n" + "\n".join(problems)


def test_the_check_names_the_module_and_file_when_a_declaration_is_removed():
    """Dropping hypothesis (tests) or highspy (the solvers) from what is declared is caught, naming
    the importing file."""
    files, allowed = imports_by_file(), declared()
    for dist, file in (("hypothesis", "tests/test_fuzz.py"), ("highspy", "solvers/highs_backend.py")):
        problems = undeclared(files, allowed - {dist})
        assert any(p.startswith(f"{file}: imports {dist!r}") for p in problems), problems

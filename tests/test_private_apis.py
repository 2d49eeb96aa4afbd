"""Private torch APIs are used only in ``autoplan/adapters/``: a torch upgrade that moves or renames
one should touch only the adapter modules. This walks the syntax of every other module of the
package, the solvers and the examples, and names each place that reaches a private torch module or
attribute directly."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("autoplan", "solvers", "examples")
ADAPTERS = ROOT / "autoplan" / "adapters"

# Private attributes of torch objects (tensors, DTensors, op overloads, modules, autograd nodes) that
# code outside the adapters could reach on a value, with no ``torch`` name in sight. Autoplan gives
# none of its own objects an attribute of these names, so every access found is torch's.
PRIVATE_ATTRIBUTES = frozenset(
    {
        "_local_tensor",
        "_local_tensors",
        "_schema",
        "_opname",
        "_overloadname",
        "_forward_pre_hooks",
        "_forward_hooks",
        "_backward_hooks",
        "_buffers",
        "_parameters",
        "_modules",
        "_spec",
        "_non_persistent_buffers_set",
        "_register_load_state_dict_pre_hook",
        "_sequence_nr",
        "_version",
    }
)
# A dotted torch path with a private part, as text (a logger name, a module to import by name).
_TORCH_PATH = re.compile(r"\btorch(?:\.\w+)+")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_path(dotted: str) -> bool:
    """Whether a dotted torch path reaches a private part; op names (``torch.ops.aten._foo``) are
    names of operators, not private APIs."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False
    return any(_private(p) for p in parts[1:])


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` unless the chain is rooted at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes: naming a private API in prose is not a use of it."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _torch_names(tree: ast.Module) -> dict[str, str]:
    """Each name the source binds to a torch module or object by importing it, with its full path
    (``import torch.distributed as dist`` binds ``dist`` to ``torch.distributed``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if alias.asname:
                        names[alias.asname] = alias.name
                    else:
                        names["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def violations(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every direct use of a private torch API in ``source``."""
    tree = ast.parse(source, filename)
    docstrings = _docstrings(tree)
    torch_names = _torch_names(tree)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_path(alias.name):
                    report(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private_path(node.module):
                report(node, f"imports from {node.module}")
            else:
                for alias in node.names:
                    if _private_path(f"{node.module}.{alias.name}"):
                        report(node, f"imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES:
                report(node, f"reads or writes .{node.attr}")
            elif _private(node.attr):
                chain = _chain(node)
                if chain is not None and chain[0] in torch_names:
                    dotted = ".".join([torch_names[chain[0]], *chain[1:]])
                    if _private_path(dotted):
                        report(node, f"uses {dotted}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in PRIVATE_ATTRIBUTES:
                report(node, f"names the attribute {node.value!r}")
            for match in _TORCH_PATH.finditer(node.value):
                if _private_path(match.group()):
                    report(node, f"names {match.group()}")
    return sorted(found, key=lambda v: int(v.split(":")[-2]))


def _checked_files() -> list[Path]:
    files = []
    for folder in SOURCES:
        files += [p for p in sorted((ROOT / folder).rglob("*.py")) if ADAPTERS not in p.parents]
    return files


def test_private_torch_apis_only_in_adapters():
    files = _checked_files()
    assert any(p.name == "tracing.py" for p in files)  # the walk found the package
    problems = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not problems, "private torch APIs outside autoplan/adapters/:\n" + "\n".join(problems)


def test_checker_reports_each_kind():
    source = '''"""A docstring may name torch._subclasses.fake_tensor."""
import logging

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.utils import _pytree
from torch.utils._pytree import tree_map
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor


def f(op, t, m):
    kind = torch._ops.OpOverload
    aten_op = torch.ops.aten._scaled_dot_product_flash_attention.default
    c10d = torch.ops._c10d_functional
    group = dist._functional_collectives
    dispatcher = DTensor._op_dispatcher
    logging.getLogger("torch._subclasses.fake_tensor")
    m._forward_pre_hooks.clear()
    t._local_tensor = t._local_tensor
    setattr(t, "_spec", None)
    return op._schema, op._opname, m._buffers, m.__dict__, torch.nn.functional
'''
    found = violations(source)
    expected = [
        ":5: imports torch._inductor.config",
        ":7: imports torch.utils._pytree",
        ":8: imports from torch.utils._pytree",
        ":9: imports from torch.testing._internal.distributed.fake_pg",
        ":14: uses torch._ops",
        ":17: uses torch.distributed._functional_collectives",
        ":18: uses torch.distributed.tensor.DTensor._op_dispatcher",
        ":19: names torch._subclasses.fake_tensor",
        ":20: reads or writes ._forward_pre_hooks",
        ":21: reads or writes ._local_tensor",
        ":22: names the attribute '_spec'",
        ":23: reads or writes ._schema",
        ":23: reads or writes ._opname",
        ":23: reads or writes ._buffers",
    ]
    for e in expected:
        assert any(v.endswith(e) for v in found), f"{e!r} not reported in {found}"
    assert sum(v.endswith(":21: reads or writes ._local_tensor") for v in found) == 2
    # op names under torch.ops, dunders, public paths and the docstring pass
    assert len(found) == len(expected) + 1, found

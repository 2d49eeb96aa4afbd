"""How ``input_fn``'s value becomes the model's call, and a parallel module's call the graph's inputs.

``input_fn`` returns one of (``split_call``):

- a tensor: ``model(x)``;
- a tuple or list: the positional arguments, ``model(*value)``;
- a dict (any mapping with string keys): the keyword arguments, ``model(**value)``;
- an ``(args, kwargs)`` pair: exactly a 2-tuple whose first item is a tuple or list and whose second
  is a dict, ``model(*args, **kwargs)``. So two positional arguments that are a tuple and a dict
  are written ``((t, d), {})``, and one positional dict ``(d,)``.

Arguments may nest tuples, lists and dicts. Their tensor leaves are the graph's inputs, in the order
the call holds them (positional arguments, then keyword arguments in the dict's order); ``None``,
bools, ints and floats are constants baked into the trace: no graph inputs, no placement, and the
parallel module must be called with the same values (``InputSpec.bind`` checks it).

Every leaf has a name, the parameter of ``forward`` it binds to, however it was passed
(``input_ids`` positionally or as a keyword), with the path inside it for a nested argument
(``batch['mask']``); what ``forward`` takes through ``*args`` is ``args[0]``, ``args[1]``...,
through ``**kwargs`` its keyword. Input constraints name inputs so, or by position: the leaf's
index in the call (``input_fn``'s order).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoplan.adapters import pytree
from autoplan.cost.devices import dtype_name
from autoplan.errors import ConstraintError, InputMismatchError

CONSTANTS = (type(None), bool, int, float)  # what may stand where forward takes a non-tensor


def split_call(value: Any) -> tuple[tuple, dict]:
    """``input_fn``'s value as the model call's ``(args, kwargs)`` (the module docstring's rule)."""
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], (tuple, list))
        and isinstance(value[1], Mapping)
    ):
        args, kwargs = tuple(value[0]), dict(value[1])
    elif isinstance(value, (tuple, list)):
        args, kwargs = tuple(value), {}
    elif isinstance(value, Mapping):
        args, kwargs = (), dict(value)
    else:
        args, kwargs = (value,), {}
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise ConstraintError(
            f"input_fn returned a dict with the key {bad[0]!r}: a dict holds forward's keyword arguments, keyed by"
            " their names (return ((d,), {}) to pass the dict itself as one positional argument)"
        )
    return args, kwargs


@dataclass
class Parameters:
    """What naming the arguments needs of ``forward``'s signature."""

    positional: tuple[str, ...] = ()  # the parameters that take positions, in order
    var_positional: str = "args"  # the ``*args`` parameter (the name of extra positions without one)
    defaults: dict[str, Any] = field(default_factory=dict)  # parameters with a constant default -> it

    @classmethod
    def of(cls, forward: Callable | None) -> Parameters:
        try:
            sig = inspect.signature(forward) if forward is not None else None
        except (TypeError, ValueError):  # a builtin or a C extension: positions only
            sig = None
        if sig is None:
            return cls()
        kinds = inspect.Parameter
        params = sig.parameters.items()
        return cls(
            tuple(n for n, p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
            next((n for n, p in params if p.kind is kinds.VAR_POSITIONAL), "args"),
            {n: p.default for n, p in params if p.default is not kinds.empty and isinstance(p.default, CONSTANTS)},
        )

    def position_name(self, p: int) -> str:
        n = len(self.positional)
        return self.positional[p] if p < n else f"{self.var_positional}[{p - n}]"


@dataclass(frozen=True)
class TensorInput:
    """A tensor leaf of the traced call: graph input ``index``, of this dtype and global shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return f"a tensor ({dtype_name(self.dtype)}{list(self.shape)})"


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor ({dtype_name(v.dtype)}{list(v.shape)})"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _named(params: Parameters, args: tuple, kwargs: dict) -> tuple[list[tuple[str, Any]], pytree.Spec, list[str]]:
    """Each leaf of ``model(*args, **kwargs)`` with its name, the call's spec, and the names of the
    arguments passed (a name twice: passed by position and by keyword)."""
    flat, spec = pytree.leaves_with_paths((tuple(args), dict(kwargs)))
    named = []
    for path, leaf in flat:
        side, top = pytree.key(path[0]), pytree.key(path[1])
        name = params.position_name(top) if side == 0 else str(top)
        named.append((name + pytree.path_text(path[2:]), leaf))
    return named, spec, [params.position_name(p) for p in range(len(args))] + list(kwargs)


def _twice(given: list[str]) -> list[str]:
    return sorted({n for n in given if given.count(n) > 1})


@dataclass
class InputSpec:
    """The traced call: where its tensors (the graph's inputs) and constants sit, and their names."""

    params: Parameters
    spec: pytree.Spec  # of the traced (args, kwargs)
    leaves: list  # per leaf of the traced call: a ``TensorInput`` or the constant itself
    names: list[str]  # per leaf
    expected: dict[str, Any]  # by name: every leaf, and the constant defaults of forward's arguments not passed

    @classmethod
    def of_call(cls, forward: Callable | None, args: tuple, kwargs: dict) -> InputSpec:
        """The spec of ``forward(*args, **kwargs)``, the call ``input_fn`` gave (``split_call``)."""
        params = Parameters.of(forward)
        named, spec, given = _named(params, args, kwargs)
        if _twice(given):
            raise ConstraintError(
                f"input_fn passes argument {_twice(given)[0]!r} twice, by position and by keyword: pass it once"
            )
        leaves: list = []
        n_tensors = 0
        for name, leaf in named:
            if isinstance(leaf, torch.Tensor):
                leaves.append(TensorInput(n_tensors, leaf.dtype, tuple(leaf.shape)))
                n_tensors += 1
            elif isinstance(leaf, CONSTANTS):
                leaves.append(leaf)
            else:
                raise ConstraintError(
                    f"input_fn returned a {type(leaf).__name__} for argument {name!r}: it must return the model's"
                    " inputs as tensors (None, int, float and bool pass as constants), as one tensor, a tuple or list"
                    " (positional arguments), a dict (keyword arguments) or an (args, kwargs) pair"
                )
        names = [name for name, _ in named]
        expected = dict(zip(names, leaves))
        expected.update({n: v for n, v in params.defaults.items() if n not in given})
        return cls(params, spec, leaves, names, expected)

    @classmethod
    def positional(cls, vals: Sequence[torch.Tensor]) -> InputSpec:
        """A call of tensors alone, by position (a graph traced without a spec)."""
        return cls.of_call(None, tuple(vals), {})

    @property
    def tensors(self) -> list[tuple[str, TensorInput]]:
        """The graph's inputs in order, with their names."""
        return [(n, v) for n, v in zip(self.names, self.leaves) if isinstance(v, TensorInput)]

    def call(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """The traced call's ``(args, kwargs)`` with ``tensors`` (the graph's inputs) in its tensor slots."""
        leaves = [tensors[v.index] if isinstance(v, TensorInput) else v for v in self.leaves]
        return pytree.unflatten(leaves, self.spec)

    def bind(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's inputs from a call ``(*args, **kwargs)`` of the parallel module, which may pass
        each argument by position or keyword and leave out what has the traced value as its default.
        ``InputMismatchError`` names each argument that differs from the traced call: a tensor where a
        constant was traced or the reverse, another constant, or one missing or extra."""
        named, _, given = _named(self.params, args, kwargs)
        problems = [f"argument {n!r} is given twice, by position and by keyword" for n in _twice(given)]
        got = dict(named)
        got.update({n: v for n, v in self.params.defaults.items() if n not in given})
        tensors: list = [None] * sum(isinstance(v, TensorInput) for v in self.leaves)
        for name, want in self.expected.items():
            if name not in got:
                problems.append(f"argument {name!r} is missing: the plan was traced with {_show(want)} there")
                continue
            have = got[name]
            if isinstance(want, TensorInput):
                if isinstance(have, torch.Tensor):
                    tensors[want.index] = have
                else:
                    problems.append(f"argument {name!r} is {_show(have)}, but the plan was traced with {_show(want)}")
            elif isinstance(have, torch.Tensor):
                problems.append(
                    f"argument {name!r} is {_show(have)}, but the plan was traced with {_show(want)} there:"
                    " a constant baked into the plan, not a graph input"
                )
            elif not _same_constant(have, want):
                problems.append(
                    f"argument {name!r} is {_show(have)}, but the plan was traced with {_show(want)}:"
                    " constants are baked into the plan"
                )
        problems += [
            f"argument {name!r} ({_show(v)}) is not in the call the plan was traced with"
            for name, v in got.items()
            if name not in self.expected
        ]
        if problems:
            raise InputMismatchError(
                problems,
                "the parallel module was called otherwise than the plan was traced:\n  "
                + "\n  ".join(problems)
                + "\nPass tensors where input_fn gave tensors and the same constants, or plan again with an"
                " input_fn that gives this call.",
            )
        return tensors

    def position(self, key: Any) -> int:
        """The leaf an input constraint names: by position (``input_fn``'s order) or by name."""
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(self.leaves):
            return key
        if isinstance(key, str) and key in self.names:
            return self.names.index(key)
        raise ConstraintError(
            f"input constraint on {key!r}: the model has no such input; its inputs are {self.describe()}"
        )

    def describe(self) -> str:
        """The leaves of the traced call: ``0: input_ids, a tensor (int64[8, 12]); 3: scale = 2.0, a constant``."""
        parts = [
            f"{i}: {n}, {v!r}" if isinstance(v, TensorInput) else f"{i}: {n} = {_show(v)}, a constant"
            for i, (n, v) in enumerate(zip(self.names, self.leaves))
        ]
        return "; ".join(parts) or "none"


_TENSOR = object()  # an output leaf that is one of the graph's outputs


@dataclass(frozen=True)
class OutputSpec:
    """What ``forward`` returned when traced: its structure (a tensor, tuples, dicts, Hugging Face's
    ``ModelOutput``), with a slot per tensor (the graph's outputs, in order) and every other leaf
    kept as a constant (``None``, a number) or, for an object no plan runs (a KV cache object that
    does not flatten), ``None``. The parallel module returns what the model returns."""

    spec: pytree.Spec
    leaves: tuple
    n_tensors: int  # the tensor slots: the graph's outputs the structure takes

    @classmethod
    def of(cls, out: Any) -> OutputSpec:
        flat, spec = pytree.tree_flatten(out)
        kept = tuple(
            _TENSOR if isinstance(t, torch.Tensor) else t if isinstance(t, (*CONSTANTS, str)) else None for t in flat
        )
        return cls(spec, kept, sum(leaf is _TENSOR for leaf in kept))

    def build(self, tensors: Sequence) -> Any:
        """The model's return value with ``tensors`` (the graph's outputs) in its tensor slots."""
        it = iter(tensors)
        return pytree.unflatten([next(it) if leaf is _TENSOR else leaf for leaf in self.leaves], self.spec)

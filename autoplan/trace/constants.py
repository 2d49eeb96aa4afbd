"""Values known while tracing: tensors computed only from factory ops and Python constants.

A model may read a value it built itself in ``forward``: ``nn.Transformer`` compares a causal mask
made with ``torch.triu(torch.full(...))`` against one of its own (``_detect_is_causal_mask``) to
pick the causal kernel, a model checks ``if mask.any()``. Fake tensors have no data, so such a read
stopped the trace, although the value depends on no input and no parameter: it is the same in
every step. ``KnownValues`` (a dispatch mode over the trace's fake, proxy and functionalization
modes, so the graph still records every op) keeps the real value of each such tensor beside its
fake one, computed on the CPU as the op runs: factory ops (``full``, ``zeros``, ``arange``,
``eye``, ``torch.tensor``, ``empty`` then ``fill_``...), ops whose result never reads its
arguments' values (``zeros_like``, ``new_ones``...), and any op of known tensors (``triu``, ``==``,
views, in-place writes of known values). A read of a known tensor (``.item()``, ``bool(t)``,
``torch.equal``) then answers what the model sees when it runs; a read of one that depends on the
inputs or parameters still fails, named (``trace_errors``).

A tensor's value is kept while it has at most ``NUMEL_LIMIT`` elements, and while the trace's kept
values stay under ``BYTES_LIMIT``: the values models read are masks and positions over a sequence,
and a (2048, 2048) mask is 2**22 elements (16 MiB in fp32, a few milliseconds per op on one core),
so a trace's extra work stays small next to tracing itself. A longer sequence's full mask (8192**2
elements, 256 MiB in fp32 per op) is not computed: a read of it fails, saying so.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autoplan.adapters.ops import OpOverload, TorchDispatchMode, outside_modes, schema

aten = torch.ops.aten

NUMEL_LIMIT = 1 << 22  # elements of one tensor whose value is kept
BYTES_LIMIT = 256 << 20  # bytes of the values kept at once, over one trace

# ops that hand a tensor's data to Python: answered from the real value when it is known
READS = frozenset({aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default})
# the nested-tensor fast path's check of ``nn.TransformerEncoder`` (in eval mode, with a padding
# mask), which reads the mask: answered False (fake mode's own answer is True, whatever the mask),
# since a graph holds no nested tensor and the padded path is the one a trace can take
NOT_LEFT_ALIGNED = aten._nested_tensor_from_mask_left_aligned.default
# ops whose values never read their tensor arguments' values, only their shape, dtype and device
SHAPE_ONLY = frozenset(
    {
        aten.empty_like.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    }
)
# ops that allocate without writing: their kept value is zeros, so a read is the same every trace
UNINITIALISED = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_permuted.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
_TOO_LARGE = object()  # the value of a tensor made from known ones, too large to keep


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of an ATen call (they sit at most one list deep)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


@functools.cache
def _writes(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """Position and name of each argument an op writes (its in-place ``self``, its ``out=``)."""
    return tuple(
        (i, a.name) for i, a in enumerate(schema(func).arguments) if a.alias_info is not None and a.alias_info.is_write
    )


@functools.cache
def _seeded(func: OpOverload) -> bool:
    """Whether an op draws random numbers (its values are new every step)."""
    return torch.Tag.nondeterministic_seeded in func.tags


def _written(func: OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes."""
    found = []
    for i, name in _writes(func):
        found.extend(_tensors((args[i] if i < len(args) else kwargs.get(name),), {}))
    return found


def _plain(t: torch.Tensor) -> bool:
    """A real tensor with data (``torch.tensor(...)``'s value before fake mode lifts it)."""
    return type(t) is torch.Tensor and t.device.type != "meta"


class KnownValues(TorchDispatchMode):
    """While tracing, the real value (on the CPU) of every tensor computed only from factory ops
    and Python constants, and the reads of those values answered from it (see the module's notes).
    Enter it around a trace; what it keeps lives as long as the mode and the fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.values = WeakIdKeyDictionary()  # fake (or functional) tensor -> its real value, or _TOO_LARGE
        self.kept_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, OpOverload) or func.namespace == "prim":
            return func(*args, **kwargs)
        if func is NOT_LEFT_ALIGNED:
            return False
        if func in READS:
            tensors = _tensors(args, kwargs)
            known = self._known(tensors)
            if any(v is None or v is _TOO_LARGE for v in known):
                return self._read_unknown(func, args, kwargs, known)
            real_args, real_kwargs = _real_call(args, kwargs, tensors, known)
            with outside_modes():
                return func(*real_args, **real_kwargs)
        out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def _known(self, tensors: list[torch.Tensor]) -> list:
        """Each tensor's real value, ``_TOO_LARGE``, or ``None`` where it is not known."""
        return [t if _plain(t) else self.values.get(t) for t in tensors]

    def _read_unknown(self, func: OpOverload, args: tuple, kwargs: dict, known: list):
        """Let the fake mode refuse the read (the trace names it), saying so where the value was
        only too large to keep."""
        try:
            return func(*args, **kwargs)
        except Exception as e:
            if all(v is not None for v in known):
                e.autoplan_hint = (
                    "the value is made from factory ops alone, but through tensors larger than the"
                    f" {NUMEL_LIMIT} elements (or {BYTES_LIMIT >> 20} MiB in all) whose values tracing keeps:"
                    " compute it outside the model and pass it in, or do not read it"
                )
            raise

    def _follow(self, func: OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep the real values of ``out`` where the call's tensors are all known (computed now, on
        the CPU); forget those of the tensors it writes where they are not."""
        shape_only = func in SHAPE_ONLY  # only the metadata is read: stand-ins of the same layout will do
        tensors = [] if shape_only else _tensors(args, kwargs)
        known = self._known(tensors)
        outputs = _tensors(out if isinstance(out, (list, tuple)) else (out,), {})
        written = _written(func, args, kwargs)
        if _seeded(func) or any(v is None for v in known):
            self._forget(written)
            return
        if not outputs and not written:
            return
        new_bytes = sum(o.numel() * o.element_size() for o in outputs if o not in self.values)
        too_large = any(v is _TOO_LARGE for v in known) or any(o.numel() > NUMEL_LIMIT for o in outputs)
        if too_large or self.kept_bytes + new_bytes > BYTES_LIMIT:
            self._forget(written)
            for o in outputs:
                self.values[o] = _TOO_LARGE
            return
        try:
            with outside_modes():
                if shape_only:
                    args = tuple(_like(a) for a in args)
                real_args, real_kwargs = _real_call(args, kwargs, tensors, known)
                result = func(*real_args, **real_kwargs)
                results = _tensors(result if isinstance(result, (list, tuple)) else (result,), {})
                if func in UNINITIALISED:
                    for r in results:
                        r.zero_()
        except Exception:  # noqa: BLE001 - an op the CPU cannot run on these values: they stay unknown
            self._forget([*written, *outputs])
            return
        if len(results) != len(outputs):
            self._forget([*written, *outputs])
            return
        for o, r in zip(outputs, results):
            if r.shape != o.shape or r.dtype != o.dtype:
                self._forget([o])
                continue
            if o not in self.values:
                nbytes = r.numel() * r.element_size()
                self.kept_bytes += nbytes
                weakref.finalize(o, self._release, nbytes)
            self.values[o] = r

    def _release(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes

    def _forget(self, written: list[torch.Tensor]) -> None:
        """These tensors were written with values not known: they, and every known tensor sharing
        their storage (their views, their bases), are no longer known."""
        for t in written:
            real = self.values.pop(t, None)
            if real is None or real is _TOO_LARGE or not real.numel():
                continue
            storage = real.untyped_storage().data_ptr()
            for k, v in list(self.values.items()):
                if v is not _TOO_LARGE and v.numel() and v.untyped_storage().data_ptr() == storage:
                    del self.values[k]


def _like(a: Any) -> Any:
    """A CPU tensor of ``a``'s layout (no values) where ``a`` is a tensor."""
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
    return a


def _real_call(args: tuple, kwargs: dict, tensors: list[torch.Tensor], known: list) -> tuple[tuple, dict]:
    """The call with each of ``tensors`` replaced by its real value in ``known``, on the CPU."""
    swap = {id(t): v for t, v in zip(tensors, known)}

    def real(a):
        if isinstance(a, torch.Tensor):
            return swap.get(id(a), a)
        if isinstance(a, (list, tuple)):
            return type(a)(real(x) for x in a)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}

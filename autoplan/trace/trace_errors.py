"""Errors torch raises while tracing a model, re-raised as ``TracingError``s that name the failing
op, the module it ran in and the line of model code that called it, with a way out where one is known."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable

import torch

from autoplan.adapters.fake import fake_tensor_log
from autoplan.adapters.ops import OpOverload
from autoplan.errors import AutoplanError, TracingError

_AUTOPLAN_DIR = os.path.dirname(os.path.dirname(__file__))  # the package, not just this stage's folder
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, _AUTOPLAN_DIR + os.sep)  # torch, autoplan
_OUR_MODELS = os.path.join(_AUTOPLAN_DIR, "bench", "models") + os.sep  # model code, though shipped with autoplan
_DATA_DEPENDENT = "DataDependentOutputException DynamicOutputShapeException GuardOnDataDependentSymNode".split()
_OP_HINTS = {
    "aten.embedding.default": "an embedding reads integer indices: does input_fn return token ids as"
    " torch.long (torch.randint), not floats?",
}
# torch functions that read a value to choose a path, and how to tell them the answer instead
_READER_HINTS = {
    "_detect_is_causal_mask": "nn.Transformer compares an attention mask given as an input with a causal one:"
    " pass tgt_is_causal= (is_causal= to an encoder) True or False to say whether it is, or build the mask"
    " in forward from factory ops (torch.triu(torch.full(...))), whose values tracing knows",
}


def _reader_hint(tb) -> str | None:
    """The way out for a read made by a torch function listed in ``_READER_HINTS``, innermost first."""
    for frame in reversed(traceback.extract_tb(tb)):
        if frame.name in _READER_HINTS and frame.filename.startswith(_LIBRARY_DIRS[0]):
            return _READER_HINTS[frame.name]
    return None


def source_line(tb) -> str | None:
    """The innermost frame outside torch and autoplan: the line of model code that made the failing call."""
    for frame in reversed(traceback.extract_tb(tb)):
        if frame.filename.startswith(_OUR_MODELS) or not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return None


def failing_op(exc: BaseException) -> str | None:
    """The ATen op torch was running: fake-tensor errors carry it, else the innermost dispatch frame's."""
    op = getattr(exc, "func", None)
    tb = exc.__traceback__
    while op is None and tb is not None:
        candidate = tb.tb_frame.f_locals.get("func")
        if isinstance(candidate, OpOverload):
            op = candidate
        tb = tb.tb_next
    return None if op is None else str(op)


def _raised_in_torch(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_LIBRARY_DIRS[0])


def reads_data(err: TracingError) -> bool:
    """Whether tracing stopped where the model read a tensor's value (or shaped one by its data)."""
    return type(err.__cause__).__name__ in _DATA_DEPENDENT


def _tracing_error(exc: BaseException, module_path: str) -> TracingError:
    """Name the op, the module and the model's source line of an error torch raised while tracing."""
    op, source = failing_op(exc), source_line(exc.__traceback__)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if type(exc).__name__ in _DATA_DEPENDENT:
        first = "its result's shape or a Python value read from it depends on tensor data"
        # a value read from the inputs or parameters (values built from constants alone are known:
        # ``autoplan.trace.constants``, which sets ``autoplan_hint`` where one was too large to keep)
        way_out = (
            getattr(exc, "autoplan_hint", None)
            or _reader_hint(exc.__traceback__)
            or (
                "a plan is made for one static graph (.item(), nonzero, boolean indexing and data-dependent routing"
                " are not): compute it with static shapes (a Hugging Face MoE: its default experts kernel,"
                " experts_implementation='grouped_mm'), outside the model and pass it in as an input, or in an"
                " autoplan.local_map(..., traced=False) region, which runs it as written on each rank"
            )
        )
    else:
        way_out = _OP_HINTS.get(op or "", "the op's checks failed on fake tensors, as they would on the target device")
    lines = [
        f"tracing failed in {op or 'an op'} (module {module_path or '<top level>'}): {first}",
        f"  at {source or '<no model source line>'}",
        f"  {way_out}",
    ]
    return TracingError("\n".join(lines), op=op, module_path=module_path, source=source)


def _not_meta_failure(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def named_failures(module_path: Callable[[], str]):
    """Re-raise errors torch raises while tracing as ``TracingError`` (the original is the cause),
    naming the module ``module_path()`` says was running.

    Fake-tensor mode also logs a failing meta kernel with its full stack; the error says it better.
    """
    fake_log = fake_tensor_log()
    fake_log.addFilter(_not_meta_failure)
    try:
        yield
    except AutoplanError:
        raise
    except Exception as e:
        if not _raised_in_torch(e):
            raise
        raise _tracing_error(e, module_path()) from e
    finally:
        fake_log.removeFilter(_not_meta_failure)

"""Adapter over Inductor's private entry points: graph compilation and the AOT backend pieces.

Lowered regions are already functional ATen graphs with static shapes: Dynamo has nothing to
capture in them, so they go to Inductor directly (no bytecode tracing, no guards to check on
every call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx as fx


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
    """``gm`` compiled by Inductor for inputs like ``example_inputs`` (same shapes, strides, dtypes)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # Inductor's lazily traced patterns must not see a caller's mode
        return compile_fx(gm, list(example_inputs))


def aot_backend(partition_fn: Callable) -> Callable:
    """A ``torch.compile`` backend: AOT autograd with Inductor's decompositions and compilers, and
    our own forward/backward partition."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(
        fw_compiler=compile_fx_inner,
        bw_compiler=compile_fx_inner,
        partition_fn=partition_fn,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


def profile_cpp_kernels() -> None:
    """From now on Inductor's C++ kernels record themselves, so the profiler lists each one run."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True

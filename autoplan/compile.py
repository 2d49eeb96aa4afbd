"""``torch.compile`` backend for parallel modules: Inductor kernels, the plan's graph decisions.

Dynamo captures the parallel module's forward/backward graphs (they run inside one
``autograd.Function``), AOTAutograd re-traces them into one joint graph, and Inductor compiles
the two halves. The split between them is autoplan's own (save what backward reads, never re-run
a collective), not Inductor's min-cut rematerialisation, so the compiled module keeps the
collectives and saved tensors the plan was costed with.
"""

from __future__ import annotations

from collections.abc import Callable


def _plan_partition(joint, _joint_inputs, *, num_fwd_outputs: int, **_unused):
    from autoplan.lowering import partition

    return partition(joint, num_fwd_outputs)


def backend() -> Callable:
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(
        fw_compiler=compile_fx_inner,
        bw_compiler=compile_fx_inner,
        partition_fn=_plan_partition,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )

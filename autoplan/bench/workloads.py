"""What to plan without a cluster: named models, user model factories and fake meshes.

Shared by the ``autoplan`` command, the benchmarks and the examples. Errors are ``ValueError``s
that say what was expected; the command-line front ends turn them into exit messages.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

MESH_DIM_NAMES = ("dp", "tp", "cp", "pp")


def parse_mesh(spec: str) -> tuple[int, ...]:
    """``"16x8"`` -> ``(16, 8)``."""
    try:
        shape = tuple(int(x) for x in spec.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape) or len(shape) > len(MESH_DIM_NAMES):
        raise ValueError(f"a mesh is sizes joined by 'x' (e.g. 128 or 16x8), up to 4 dims; got {spec!r}")
    return shape


def fake_mesh(shape: tuple[int, ...], device_type: str = "cpu"):
    """A mesh of ``shape`` on a fake process group (started here if none is): collectives are
    no-ops, so any size plans on one machine. Dims are named dp, tp, cp, pp in order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from autoplan.adapters.fake import fake_store

    size, names = math.prod(shape), MESH_DIM_NAMES[: len(shape)]
    if not dist.is_initialized():
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=size)
    if dist.get_world_size() == size:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if dist.get_world_size() < size:
        raise ValueError(f"mesh {shape} needs {size} ranks; the process group has {dist.get_world_size()}")
    return DeviceMesh(device_type, torch.arange(size).reshape(shape), mesh_dim_names=names)  # a larger world


def model_config(name: str, layers: int | None = None, mesh_ndim: int = 2):
    """The config of a named model, optionally with another number of layers: ``llama3-<size>``
    (``autoplan.bench.models.llama3``) or a mixture of experts (``autoplan.bench.models.moe``:
    ``deepseek-v3-16b``, ``qwen3-30b-a3b``, ``deepseek-v3-671b``, ``moe-debug``), whose routing
    regions are declared for a mesh of ``mesh_ndim`` dims; with ``-grouped`` after the name, its
    experts are grouped matmuls over tokens sorted by expert instead (``MoEConfig.experts``)."""
    from autoplan.bench.models.llama3 import LLAMA3_CONFIGS
    from autoplan.bench.models.moe import MODEL_NAMES, MOE_CONFIGS

    moe = {full: size for size, full in MODEL_NAMES.items()}
    family, _, size = name.partition("-")
    base, grouped = name.removesuffix("-grouped"), name.endswith("-grouped")
    if base in moe:
        experts = "grouped" if grouped else "capacity"
        cfg = dataclasses.replace(MOE_CONFIGS[moe[base]], mesh_ndim=mesh_ndim, experts=experts)
    elif family == "llama3" and size in LLAMA3_CONFIGS:
        cfg = LLAMA3_CONFIGS[size]
    else:
        known = [f"llama3-{k}" for k in LLAMA3_CONFIGS] + list(moe) + [f"{m}-grouped" for m in moe]
        raise ValueError(f"unknown model {name!r}; choose from " + ", ".join(known))
    if layers is not None and layers < 1:
        raise ValueError(f"the number of layers must be at least 1, got {layers}")
    return cfg if layers is None else dataclasses.replace(cfg, n_layers=layers)


def named_model(name: str, dtype: torch.dtype, layers: int | None = None, mesh_ndim: int = 2):
    """A named model (``model_config``) on the meta device (no memory) and its config."""
    from autoplan.bench.models.llama3 import Transformer
    from autoplan.bench.models.moe import MoEConfig, MoETransformer

    cfg = model_config(name, layers, mesh_ndim)
    with torch.device("meta"):
        model = (MoETransformer if isinstance(cfg, MoEConfig) else Transformer)(cfg).to(dtype)
    return model, cfg


def model_batch(cfg, batch: int | None, seq: int | None, dp: int) -> tuple[int, int]:
    """Global batch and sequence length of a LLaMA workload: by default ``max(32, dp)`` sequences
    (the batch must split over the first mesh dim) of ``min(8192, the model's max)`` tokens."""
    return batch or max(32, dp), seq or min(8192, cfg.max_seq_len)


def load_factory(spec: str, **kwargs: Any) -> tuple[torch.nn.Module, Callable[[], Any]]:
    """``"package.module:factory"``: call ``factory(**kwargs)``, which returns ``(model, input_fn)``.

    The module is looked for in the current folder first, as ``python -m`` does: the installed
    ``autoplan`` command starts with the folder of its script on the path, not the user's."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"a model factory is 'module:function', got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"cannot load model factory {spec!r}: {e} (looked in the current folder {cwd} and on the Python path)"
        ) from e
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {spec!r}: {e}") from e
    try:
        made = factory(**kwargs)
    except TypeError as e:
        if not kwargs:
            raise
        raise ValueError(f"model factory {spec!r} does not take {', '.join(kwargs)}: {e}") from e
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1])):
        raise ValueError(f"model factory {spec!r} must return (model, input_fn), got {type(made).__name__}")
    return made


MP_CHOICES = ("none", "bf16", "fp16")
MP_HELP = (
    "mixed precision as FSDP2's MixedPrecisionPolicy: fp32 parameters and optimizer states, compute and"
    " parameter gathers in bf16 (or fp16), gradients reduced in fp32; the model is then built in fp32"
)


def mp_policy(name: str | None):
    """The ``MixedPrecisionPolicy`` the ``--mp`` option names (``None`` for ``"none"``): parameters
    cast to bf16 or fp16 for compute, gradients reduced in fp32, as torchtitan trains."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name in (None, "none"):
        return None
    if name not in MP_CHOICES:
        raise ValueError(f"--mp is one of {', '.join(MP_CHOICES)}, got {name!r}")
    compute = torch.bfloat16 if name == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def resolve_dtype(args) -> None:
    """Set ``args.dtype`` where it was left out: the parameters' dtype, fp32 under ``--mp`` (the
    master weights), else bf16. Raise ``ValueError`` for a name that is no torch dtype."""
    if getattr(args, "dtype", "") is None:
        args.dtype = "float32" if mp_policy(getattr(args, "mp", None)) else "bfloat16"
    if getattr(args, "dtype", None) and not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise ValueError(f"--dtype must name a torch dtype (e.g. bfloat16, float32), got {args.dtype!r}")

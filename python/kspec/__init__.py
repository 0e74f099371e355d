"""kspec: JIT-specialized GPU kernels for sequence models.

Kernel templates are specialized at run time for the problem's shapes, dtype, tile sizes and state
size, compiled with NVRTC, cached on disk and launched through one op registry shared with C++.

    import kspec
    y = kspec.ops.norm_act(x, w, b, norm="rmsnorm", act="silu")
    kspec.list_ops(); kspec.compile("norm_act.fwd", dtype="bf16", hidden=4096)
    kspec.tune("norm_act.fwd", dtype="bf16", shape={"rows": 16384, "hidden": 4096}, budget=30)
"""
from __future__ import annotations

from . import _C


def _nvidia_dirs() -> list:
    """The directories of pip's `nvidia` namespace package (nvidia-cuda-nvrtc, nvidia-cuda-runtime; torch
    brings them): where NVRTC and CUDA's headers are looked for after KSPEC_NVRTC / KSPEC_CUDA_INCLUDE."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return [str(d) for d in (spec.submodule_search_locations or [])] if spec else []


_C._set_nvidia_dirs(_nvidia_dirs())
from ._C import CacheError, CompileError, CudaError, Error, InternalError, InvalidArgument, Unsupported
from ._log import KspecWarning, install as _install_log_sink
from ._core import call, compile, explain, list_ops, op_info
from . import ops
from .tuning import tune

__version__ = _C.version()
_install_log_sink(_C)  # C++ diagnostics to logging.getLogger("kspec") and warnings

__all__ = ["call", "compile", "explain", "list_ops", "op_info", "ops", "tune", "counters", "doctor", "knobs",
           "Error", "InvalidArgument", "Unsupported", "CompileError", "CudaError", "CacheError",
           "InternalError", "KspecWarning"]


def counters() -> dict:
    """This process's compile / disk-hit / memory-hit / launch counts."""
    return _C.counters()


def doctor() -> list:
    """(name, value) facts about the driver, toolkit, NVRTC, GPUs and cache directory."""
    return _C.doctor()


def knobs() -> list:
    """Every KSPEC_* environment variable: (name, type, default, doc)."""
    return _C.knobs()


def check(op: str, case: str = "", dtypes=(), device: int = 0, include_large: bool = False,
          config: str | list[str] | None = None, seed: int = 0) -> list:
    """Run an op on the GPU against its float64 reference (fresh random inputs, NaN-poisoned outputs).
    Returns one dict per (case, dtype) with per-output relative errors and pass/fail; with a list of
    configs, one per (case, dtype, config), the configs run on the same inputs against one reference."""
    return _C.check_op(op, case, list(dtypes), device, include_large, config, seed)


def _register_torch() -> None:
    import sys

    if "torch" in sys.modules:
        from . import _native

        _native._load()  # the torch C++ extension, where built and enabled
        from . import _difflogic, _e79, _mhc, _mlstm, _torch  # noqa: F401  (register the custom ops)


try:  # torch is optional; when present, the custom ops register at import
    import torch  # noqa: F401

    _register_torch()
    from . import optim  # noqa: F401  (kspec.optim.AdamW)
    from . import nn  # noqa: F401  (kspec.nn.E79Cell, kspec.nn.E79CoupledMatrix)
except ImportError:
    pass

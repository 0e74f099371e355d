"""kspec's optional torch C++ extension (kspec._torch_ext, python/src/torch_ext/), loaded with the torch glue
when it was built (torch importable at build time) and KSPEC_TORCH_EXT is on; else kspec keeps its pure path.

It serves kspec.call for torch tensors (read as at::Tensor, outputs from at::empty, torch's current
stream), so every surface that calls kspec.call (ops.*, the custom ops' kernels, the backward) takes it.
And each registry op a torch surface uses (a Family's ops) is registered with the dispatcher as
kspec_ops::<op, dots as underscores>, a C++ kernel whose schema is generated here from op_info: the op's
inputs in order (Tensor, or Tensor? when optional), its params keyword-only and optional (None: not
given), every output returned (an empty tensor for an absent one). Their fake kernels evaluate the
schema (kspec._schema), so symbolic sizes stay symbolic under torch.compile."""
from __future__ import annotations

from . import _C, _core, _schema

NAMESPACE = "kspec_ops"
_PARAM_TYPES = {"int": "int", "float": "float", "bool": "bool", "choice": "str"}

ext = None  # kspec._torch_ext once loaded and enabled
_defined: dict = {}  # registry op -> its dispatcher op (torch.ops.kspec_ops.<name>.default)


def _load():
    global ext
    if not _C.torch_ext_enabled():
        return None
    try:
        from . import _torch_ext
    except ImportError:  # not built: torch was not importable when kspec was built
        return None
    _torch_ext.init(_C._ext_api)
    ext = _torch_ext
    _torch_ext.set_call_fallback(_core._call_python)
    _core.use_torch_ext(ext.call, ext.call_some, ext.kspec_call)
    return ext


def op_name(op: str) -> str:
    return op.replace(".", "_")


def schema(op: str) -> str:
    """The dispatcher schema of registry op `op`, from its op_info."""
    info = _schema._info(op)
    args = [("Tensor? " if d["optional"] else "Tensor ") + d["name"] for d in info["inputs"]]
    params = [f"{_PARAM_TYPES[p['type']]}? {p['name']}=None" for p in info["params"]]
    rets = ", ".join(["Tensor"] * len(info["outputs"]))
    return f"{op_name(op)}({', '.join(args + (['*'] + params if params else []))}) -> ({rets})"


def _fake_kernel(op: str, derived: dict):
    n_in = len(_schema._info(op)["inputs"])

    def fake(*args, **params):
        import torch

        tensors = args[:n_in]
        specs = _schema.output_specs(op, [None if t is None else tuple(t.shape) for t in tensors],
                                     [None if t is None else str(t.dtype).removeprefix("torch.") for t in tensors],
                                     derived, None, params)
        first = next(t for t in tensors if t is not None)
        outs = tuple(first.new_empty(0) if s is None else first.new_empty(s[1], dtype=getattr(torch, s[0]))
                     for s in specs)
        return outs[0] if len(outs) == 1 else outs

    return fake


def define(op: str, derived=None):
    """Registers registry op `op` with the dispatcher (once); returns its OpOverload, or None without the
    extension."""
    if ext is None or op is None:
        return None
    if op not in _defined:
        import torch

        ext.define(NAMESPACE, op, schema(op), __name__)
        torch.library.register_fake(f"{NAMESPACE}::{op_name(op)}", _fake_kernel(op, derived or {}))
        _defined[op] = getattr(getattr(torch.ops, NAMESPACE), op_name(op)).default
    return _defined[op]


def defined() -> dict:
    """{registry op: dispatcher op} of every op registered so far."""
    return dict(_defined)

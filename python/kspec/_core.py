"""The generic entry: kspec.call(name, *inputs, **params) validates in C++, allocates the outputs with
the caller's framework, launches on the caller's current stream and returns the outputs."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import _C
from ._tensors import current_stream, describe, empty, framework_of
from ._typing import Array, Arrays


# torch tensors' path: described, allocated and launched in one C++ call; kspec._torch_ext's (at::Tensor,
# at::empty) when kspec._native loads it, else _C's (the Python C API, torch.empty).
_call_torch = _C.call_torch
_call_some = None  # kspec._torch_ext.call_some where the extension is loaded


def use_torch_ext(fn, some=None, entry=None) -> None:
    """The torch extension's doors: `fn` for torch tensors (NotImplemented for the rest), `some` for call_some,
    `entry` (kspec._torch_ext.kspec_call) kspec.call itself, in one C++ call, handing what it declines to
    _call_python (without it, kspec.call is _call_python)."""
    global _call_torch, _call_some, call
    _call_torch, _call_some = fn, some
    entry = entry or _call_python
    import sys

    pkg = sys.modules.get(__package__)
    if pkg is not None and getattr(pkg, "call", None) is call:
        setattr(pkg, "call", entry)  # (mypy: a module has no attribute `call` to assign)
    call = entry


def call_some(op: str, inputs: tuple, out: tuple, params: dict):
    """kspec.call(op, *inputs, out=..., **params) for torch tensors with outputs allocated in C++ (the torch
    extension's at::empty): each entry of `out` a tensor (given), None (allocated where the op has that
    output without being given it; an optional one stays absent) or a shape tuple (allocated with it, the
    op's dtype). NotImplemented where the extension does not take the call: the caller then allocates
    the outputs itself and calls kspec.call, which raises what it raises."""
    if _call_some is None:
        return NotImplemented
    return _call_some(op, inputs, out, params)


def _call_python(op: str, *inputs: Array, config: str | None = None, out: Sequence[Array] | None = None,
                 **params: Any) -> Arrays:
    """Run a registered op. Inputs are positional as in the op's schema (None for a left-out optional
    input); params by keyword. Returns the op's outputs as a tuple (None for absent ones).

    `out` may pass preallocated outputs (a sequence like the schema's outputs); without it the outputs
    are allocated with the inputs' framework (torch or CuPy), which is then needed."""
    if config is None:
        r = _call_torch(op, inputs, out, params)
        if r is not NotImplemented:
            return r
    return _call_general(op, inputs, config, out, params)


# kspec.call: _call_python, or the torch extension's kspec_call (the same signature and results, one C++ call for
# torch tensors: no Python frame, no tuple of the inputs nor dict of the params) once kspec._native loads it.
call = _call_python


def _call_general(op: str, inputs, config, out, params: dict):
    """Any framework: each argument described in Python (_tensors.describe), outputs allocated with the
    inputs' framework; every error of a call is raised here with its argument's name."""
    descs = _describe_args(op, inputs, "input")
    fw = framework_of(inputs)
    device = _device_of(descs)
    if out is None:
        specs = _C.infer_outputs(op, descs, params)  # cached in C++ by the inputs' signature
        if fw is None:
            raise _C.InvalidArgument(f"{op}: no framework to allocate the outputs with (neither torch nor CuPy is "
                                     "installed): pass them with out=, or install torch or cupy")
        out = tuple(None if s is None else empty(fw, s[0], s[1], device) for s in specs)
    elif not isinstance(out, (list, tuple)):
        raise _C.InvalidArgument(f"{op}: out= expects a sequence of outputs ({_names(op, 'outputs')}), "
                                 f"got {type(out).__name__}")
    out_descs = _describe_args(op, out, "output")
    stream = current_stream(fw, device) if device >= 0 else 0
    _C.call(op, descs, out_descs, params, stream, config)
    return tuple(out)


def _names(op: str, kind: str) -> str:
    return ", ".join(t["name"] for t in _C.op_info(op)[kind])


def _describe_args(op: str, tensors, kind: str) -> list:
    """describe() each argument; an object it cannot read is reported by the argument's name."""
    descs = []
    for i, t in enumerate(tensors):
        try:
            descs.append(describe(t))
        except (_C.InvalidArgument, TypeError) as e:
            defs = _C.op_info(op)[kind + "s"]
            name = f"'{defs[i]['name']}'" if i < len(defs) else str(i)
            raise type(e)(f"{op}: {kind} {name}: {str(e).removeprefix('kspec: ')}") from None
    return descs


def _device_of(descs) -> int:
    for d in descs:
        if isinstance(d, list):
            if d:
                return d[0][4]
        elif d is not None:
            return d[4]
    return 0


class Explanation(str):
    """What a call would use, as text (print it); the same facts as attributes: op, signature (the
    specialization), bucket, config, config_source ("forced", "tuned" or "heuristic"), note, tuning_db,
    tuning_key, tune_mode, kernels (name, arch, key, cache_entry)."""

    info: dict

    def __new__(cls, info: dict):
        s = super().__new__(cls, info["text"])
        s.info = info
        for k, v in info.items():
            if k != "text":
                setattr(s, k, v)
        return s


def explain(op: str, *inputs: Array, dtype: str = "f32", arch: str = "sm_90", without: Sequence[str] = (),
            tensor_dtypes: Mapping[str, str] | None = None, alt_shapes: Sequence = (), **params: Any) -> Explanation:
    """What a call would use: the specialization, the config and where it came from (tuned, heuristic),
    the tuning database's file and key, and each kernel's cache entry.

    With tensors: exactly the call `kspec.call(op, *inputs, **params)`. Without tensors (no GPU
    needed): the problem described by dtype, arch, dims and params, e.g.
    `kspec.explain("norm_act.fwd", dtype="bf16", rows=16384, hidden=4096, act="silu")`. "linear": what
    kspec.ops.linear(x, weight, bias, act=...) would run, with the operands it copies first."""
    if op == "linear" and inputs:
        from .ops import explain_linear

        return explain_linear(*inputs, **params)
    if not inputs:
        return Explanation(_C.explain_request(op, dtype, arch, params, list(without), dict(tensor_dtypes or {}),
                                              list(alt_shapes)))
    descs = _describe_args(op, inputs, "input")
    specs = _C.infer_outputs(op, descs, params)
    fw = framework_of(inputs)
    device = _device_of(descs)
    if fw is None:
        raise _C.InvalidArgument(f"{op}: explain with tensors allocates outputs like the call: neither torch nor "
                                 "CuPy is installed (describe the problem without tensors instead)")
    # The outputs stay alive until the plan is explained: freed one by one, the caching allocator would
    # hand the next one the same memory and validation would refuse them as overlapping.
    held = [None if s is None else empty(fw, s[0], s[1], device) for s in specs]
    outs = [None if t is None else describe(t) for t in held]
    return Explanation(_C.explain_plan(op, descs, outs, params))


def compile(op: str, dtype: str = "f32", arch: str = "sm_90", without: Sequence[str] = (),
            tensor_dtypes: Mapping[str, str] | None = None, config: str | None = None, alt_shapes: Sequence = (),
            **params: Any) -> list[dict]:
    """Specialize and compile (no GPU needed). Returns one report dict per kernel:
    key, source ("compiled"/"disk"/"memory"), compile_ms, registers, spill_bytes, shared_bytes, path..."""
    return _C.compile(op, dtype, arch, params, list(without), dict(tensor_dtypes or {}), config,
                      list(alt_shapes))


def list_ops() -> list[str]:
    """Names of every registered op."""
    return list(_C.list_ops())


def op_info(op: str) -> dict:
    """The op's schema: inputs, outputs, params, dims, tuning axes, reference."""
    return _C.op_info(op)

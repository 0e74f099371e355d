"""Tensors in and out: describe any GPU tensor (torch, CuPy, __cuda_array_interface__, DLPack) as the
(ptr, dtype, shape, strides, device) tuple the C++ core validates, allocate outputs with the caller's
framework, and find the caller's current CUDA stream."""
from __future__ import annotations

import sys

_TYPESTR = {"<f4": "float32", "<f2": "float16", "<f8": "float64", "<i4": "int32", "<i8": "int64", "|u1": "uint8"}
_torch_dtypes: dict = {}


def _torch():
    return sys.modules.get("torch")


def _torch_dtype_name(dt) -> str:
    name = _torch_dtypes.get(dt)
    if name is None:
        name = str(dt).replace("torch.", "")
        _torch_dtypes[dt] = name
    return name


def describe(t):
    """(ptr, dtype, shape, strides in elements, device ordinal or -1 for host memory[, True if read-only]),
    or None. A malformed object raises kspec.InvalidArgument (the caller adds the argument's name)."""
    if t is None:
        return None
    if isinstance(t, (list, tuple)):  # a TensorList argument
        return [describe(x) for x in t]
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return (t.data_ptr(), _torch_dtype_name(t.dtype), tuple(t.shape), t.stride(), t.get_device())
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:
        return _describe_cai(t, cai)
    if hasattr(t, "__dlpack__"):
        from . import _C

        return _C.dlpack_describe(_dlpack_capsule(t))
    raise TypeError(
        f"kspec: expected a GPU tensor (torch.Tensor, CuPy array, __cuda_array_interface__ or DLPack), "
        f"got {type(t).__name__}")


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def _dlpack_capsule(t):
    """t.__dlpack__() as the array API standard has a consumer call it: asking for a v1.0 capsule (older
    producers, whose __dlpack__ has no max_version, give the unversioned one), and for CUDA memory with
    `stream=` the stream kspec will launch on, so the producer orders its pending work before it."""
    stream = None
    dev = getattr(t, "__dlpack_device__", None)
    if dev is not None:
        dev_type, dev_id = dev()
        if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            # The stream the call will use (see _core): DLPack spells the legacy default stream 1, not 0.
            try:
                stream = current_stream(framework_of([t]), dev_id) or 1
            except (RuntimeError, AssertionError):  # no usable CUDA here: validation refuses the call by name
                stream = None
    try:
        return t.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0 (no max_version)
        return t.__dlpack__(stream=stream)


def _bad(what: str):
    from . import _C

    return _C.InvalidArgument(f"__cuda_array_interface__: {what}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v, key: str) -> tuple:
    if not isinstance(v, (tuple, list)) or not all(_is_int(x) for x in v):
        raise _bad(f"'{key}' must be a tuple of ints, got {v!r}")
    return tuple(v)


def _describe_cai(t, cai):
    """The CUDA Array Interface (v2/v3): the dict is the producer's, so every key is checked."""
    if not isinstance(cai, dict):
        raise _bad(f"expected a dict, got {type(cai).__name__}")
    missing = [k for k in ("shape", "typestr", "data") if k not in cai]
    if missing:
        raise _bad(f"missing key(s) {', '.join(map(repr, missing))}")
    typestr = cai["typestr"]
    if typestr not in _TYPESTR:
        raise _bad(f"unsupported typestr {typestr!r} (kspec takes {', '.join(_TYPESTR)})")
    itemsize = int(typestr[2:])
    shape = _ints(cai["shape"], "shape")
    if any(d < 0 for d in shape):
        raise _bad(f"negative size in shape {shape}")
    data = cai["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2 or not _is_int(data[0]) or not isinstance(data[1], bool):
        raise _bad(f"'data' must be (pointer: int, read_only: bool), got {data!r}")
    ptr, read_only = data
    if not 0 <= ptr < 2**64:
        raise _bad(f"data pointer {ptr} is not an address")
    if cai.get("mask") is not None:
        raise _bad("masked arrays are not supported ('mask' must be None)")
    if cai.get("strides") is None:
        strides, s = [], 1
        for d in reversed(shape):
            strides.append(s)
            s *= d
        strides = tuple(reversed(strides))
    else:
        byte_strides = _ints(cai["strides"], "strides")
        if len(byte_strides) != len(shape):
            raise _bad(f"{len(byte_strides)} strides for {len(shape)} dims")
        for st in byte_strides:
            if st % itemsize:
                raise _bad(f"stride {st} bytes is not a multiple of the element size {itemsize}")
        strides = tuple(st // itemsize for st in byte_strides)
    dev = getattr(t, "device", None)
    device = getattr(dev, "id", None)
    if not _is_int(device):
        device = _pointer_device(ptr)
    desc = (ptr, _TYPESTR[typestr], shape, strides, device)
    return desc + (True,) if read_only else desc


def _pointer_device(ptr: int) -> int:
    from . import _C

    return _C.pointer_device(ptr)


_cupy_module = []  # [module or None] once looked for


def _cupy():
    if not _cupy_module:
        try:
            import cupy
        except ImportError:
            cupy = None
        _cupy_module.append(cupy)
    return _cupy_module[0]


def framework_of(tensors):
    """"torch" or "cupy": what allocates outputs and names the current stream, the tensors' own
    framework first; None when neither is installed (outputs must then be given, the stream is 0)."""
    torch = _torch()
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, (list, tuple)):
            if t:
                fw = framework_of(t)
                if fw is not None:
                    return fw
            continue
        if torch is not None and isinstance(t, torch.Tensor):
            return "torch"
        mod = type(t).__module__.split(".")[0]
        if mod == "cupy":
            return "cupy"
    if torch is not None:
        return "torch"
    return "cupy" if _cupy() is not None else None


def current_stream(framework, device: int) -> int:
    if framework == "torch":
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~0.2 µs against ~4 µs
        if raw is not None:
            return raw(device)
        return torch.cuda.current_stream(device).cuda_stream
    if framework is None:  # the legacy default stream
        return 0
    return _cupy().cuda.get_current_stream().ptr


_torch_devices: dict = {}


def empty(framework: str, dtype: str, shape, device: int):
    if framework == "torch":
        torch = _torch()
        dev = _torch_devices.get(device)
        if dev is None:  # parsing "cuda:N" on every call costs about a microsecond
            # host inputs get host outputs: the call then refuses them with kspec's own message
            dev = _torch_devices[device] = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        return torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    if framework is None:
        from . import _C

        raise _C.InvalidArgument("kspec: no framework to allocate outputs with (neither torch nor CuPy is "
                                 "installed): pass the outputs with out=, or install torch or cupy")
    cupy = _cupy()
    if dtype == "bfloat16":
        raise TypeError("kspec: CuPy has no bfloat16 arrays; pass torch tensors for bf16")
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=dtype)

"""The torch fast path of kspec.call (_C.call_torch: tensors described in C++, outputs allocated by one
cached torch.empty call, kspec::call's signature cache) against the general path (kspec._core._call_general):
the same errors for every bad call, the same outputs on a GPU, and the per-call checks (overlap, a
misaligned pointer) still made once a signature is cached."""
import subprocess
import sys
import textwrap

import pytest

from helpers import case_inputs

# Runs in a fresh interpreter with a stand-in `torch` module (this machine may have no torch; the real one
# must not be replaced in the test process): tensors with the attributes the fast path reads, an
# allocator and a current stream. Each bad call must raise the same exception type and message through
# kspec.call (fast path) as through the general path, twice (nothing about a failed call is cached).
_FAKE_TORCH = textwrap.dedent('''
    import sys, types
    import kspec  # first: with no torch yet it registers no custom ops; the fast path finds torch per call
    torch = types.ModuleType("torch")
    class dtype:
        def __init__(self, name): self.name = name
        def __str__(self): return "torch." + self.name
    for n in ("float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "complex64"):
        setattr(torch, n, dtype(n))
    SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "uint8": 1,
             "complex64": 8}
    class Size(tuple):
        pass
    class Tensor:
        next_ptr = 1 << 32
        def __init__(self, shape, dt, device=0, strides=None, ptr=None):
            self.shape, self.dtype, self._device = Size(shape), dt, device
            if strides is None:
                strides, s = [], 1
                for d in reversed(shape):
                    strides.insert(0, s)
                    s *= d
            self._strides = tuple(strides)
            if ptr is None:
                ptr = Tensor.next_ptr
                Tensor.next_ptr += 1 << 20
            self._ptr = ptr
        def data_ptr(self): return self._ptr
        def stride(self): return self._strides
        def get_device(self): return self._device
    torch.Tensor = Tensor
    def empty(shape, dtype=None, device=None):
        return Tensor(tuple(shape), dtype, device.index)
    torch.empty = empty
    class device:
        def __init__(self, kind, index): self.type, self.index = kind, index
    torch.device = device
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda d: 0)
    sys.modules["torch"] = torch
''')

_CASES = textwrap.dedent('''
    from kspec import _C
    from kspec._core import _call_general
    T, bf, f32 = torch.Tensor, torch.bfloat16, torch.float32
    x, w = T((4, 256), bf), T((256,), bf)
    cases = {
        "wrong dtype": ("norm_act.fwd", (T((4, 256), torch.int32), w, None), None, {}),
        "unsupported dtype": ("norm_act.fwd", (T((4, 256), torch.complex64), w, None), None, {}),
        "wrong shape": ("norm_act.fwd", (x, T((128,), bf), None), None, {}),
        "host tensor": ("norm_act.fwd", (T((4, 256), bf, device=-1), w, None), None, {}),
        "misaligned": ("norm_act.fwd", (T((4, 256), bf, ptr=(1 << 40) + 1), w, None), None, {}),
        "null pointer": ("norm_act.fwd", (T((4, 256), bf, ptr=0), w, None), None, {}),
        "row stride": ("norm_act.fwd", (T((4, 256), bf, strides=(256, 2)), w, None), None, {}),
        "missing input": ("norm_act.fwd", (x,), None, {}),
        "unknown param": ("norm_act.fwd", (x, w, None), None, {"bogus": 1}),
        "bad choice": ("norm_act.fwd", (x, w, None), None, {"norm": "batchnorm"}),
        "param type": ("norm_act.fwd", (x, w, None), None, {"eps": [1]}),
        "unknown op": ("no_such.op", (x, w, None), None, {}),
        "out not a sequence": ("norm_act.fwd", (x, w, None), x, {}),
        "out overlaps": ("norm_act.fwd", (x, w, None), (x, T((4,), f32), T((4,), f32)), {}),
        "out wrong shape": ("norm_act.fwd", (x, w, None), (T((4, 128), bf), T((4,), f32), T((4,), f32)), {}),
        "out not a tensor": ("norm_act.fwd", (x, w, None), ("y", T((4,), f32), T((4,), f32)), {}),
        "device mix": ("norm_act.fwd", (x, T((256,), bf, device=1), None), None, {}),
    }
    def outcome(fn):
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
        return "no error", ""
    for name, (op, ins, out, params) in cases.items():
        for attempt in range(2):
            fast = outcome(lambda: kspec.call(op, *ins, out=out, **params))
            general = outcome(lambda: _call_general(op, ins, None, out, params))
            print(name, "|", fast[0], "|", fast[1] == general[1], "|", fast[1])
            assert fast == general, (name, fast, general)
            assert fast[0] != "no error", name
    print("ALL SAME")
''')


def test_fast_path_errors_match_general_path():
    r = subprocess.run([sys.executable, "-c", _FAKE_TORCH + _CASES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ALL SAME" in r.stdout
    assert r.stdout.count("| True |") == 2 * 17


def test_fast_path_declines_other_objects():
    """Anything but torch tensors and None goes to the general path (NotImplemented)."""
    from kspec import _C

    assert _C.call_torch("norm_act.fwd", (1, 2, None), None, {}) is NotImplemented
    assert _C.call_torch("norm_act.fwd", (None, None, None), None, {}) is NotImplemented


@pytest.mark.gpu
@pytest.mark.parametrize("alloc", [True, False])
def test_fast_path_same_outputs_as_general(alloc):
    import torch
    import kspec
    from kspec._core import _call_general

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 1000, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, generator=g)
    params = dict(norm="rmsnorm", act="silu", eps=1e-5)

    def outs():
        return (torch.full_like(x, float("nan")), torch.full((33,), float("nan"), device="cuda"),
                torch.full((33,), float("nan"), device="cuda"))
    for _ in range(3):  # the first call validates and caches, the next ones take the cached signature
        fast = kspec.call("norm_act.fwd", x, w, None, **params) if alloc else \
            kspec.call("norm_act.fwd", x, w, None, out=outs(), **params)
        general = _call_general("norm_act.fwd", (x, w, None), None, None if alloc else outs(), params)
        for a, b in zip(fast, general):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cached_signature_still_checks_pointers():
    """Once a signature is validated, a call with the same layout but overlapping outputs, or a pointer
    of another alignment, is still refused with validation's message."""
    import torch
    import kspec

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    y, m, r = torch.empty_like(x), torch.empty(4, device="cuda"), torch.empty(4, device="cuda")
    kspec.call("norm_act.fwd", x, w, None, out=(y, m, r))
    with pytest.raises(kspec.InvalidArgument, match="shares memory with input 'x'"):
        kspec.call("norm_act.fwd", x, w, None, out=(x, m, r))  # x's layout is y's: same signature
    with pytest.raises(kspec.InvalidArgument, match="outputs must not overlap"):
        kspec.call("norm_act.fwd", x, w, None, out=(y, m, m))
    big = torch.randn(4 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    x_odd = big[1:].view(4, 256)  # 2-byte aligned: another signature, validated again, and accepted
    kspec.call("norm_act.fwd", x_odd, w, None, out=(y, m, r))
    torch.cuda.synchronize()
    ref = kspec.call("norm_act.fwd", x_odd.contiguous(), w, None)[0]
    assert torch.equal(y, ref)


def test_one_tolerance_table_and_constants():
    """Tests and benchmarks read C++'s tolerance table; op_info exports constants and scaled tolerances."""
    import helpers
    from kspec import _C

    assert helpers.TOL == _C.tolerances()
    assert _C.tolerances()["float16"] == 1e-2 and _C.tolerances()["float32"] == 1e-5
    info = _C.op_info("selective_scan.fwd")
    assert info["constants"] == {"state_stride": 16}
    assert info["tolerances"]["bfloat16"] == 4 * _C.tolerances()["bfloat16"]  # a long recurrence's scale
    assert _C.op_info("norm_act.fwd")["tolerances"] == _C.tolerances()


def test_schema_shapes_match_infer_outputs():
    """kspec._schema.output_specs (what the torch fake kernels evaluate, symbolic sizes included) gives
    C++ infer_outputs' dtypes and shapes for every case of every op (TensorList ops aside)."""
    from kspec import _C, _schema

    # Ops whose output has a dim no input binds and no family rule gives (packing: ceil(batch / w) words,
    # unpack's batch): the caller sizes the output (out=).
    caller_sized = {"difflogic.pack", "difflogic.unpack", "difflogic.packed.group_sum", "difflogic.packed.net"}
    compared = 0
    for op in _C.list_ops():
        info = _C.op_info(op)
        if any(d["shape"] == ["tensors"] for d in info["inputs"]) or op in caller_sized:
            continue
        for case in info["cases"]:
            if case["large"]:
                continue
            got = case_inputs(info, case)
            if got is None:
                continue
            shapes, dtypes = got
            descs, ptr = [], 1 << 32
            for shape, dt in zip(shapes, dtypes):
                if shape is None:
                    descs.append(None)
                    continue
                strides, s = [], 1
                for n in reversed(shape):
                    strides.insert(0, s)
                    s *= n
                descs.append((ptr, dt, shape, tuple(strides), 0))
                ptr += 1 << 30
            want = [None if s is None else (s[0], tuple(s[1])) for s in _C.infer_outputs(op, descs, case["params"])]
            assert _schema.output_specs(op, shapes, dtypes, params=case["params"]) == want, (op, case["name"])
            compared += 1
    assert compared >= 40, compared


@pytest.mark.gpu
def test_fast_path_threads_share_the_cache():
    """Four threads, each on its own stream, call one signature 50 times at once: every result equals the
    single-threaded one (the caches are shared under a lock; each call keeps its own tensors and stream)."""
    import threading

    import torch
    import kspec

    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    want = kspec.call("norm_act.fwd", x, w, None, norm="layernorm", act="silu")[0]
    torch.cuda.synchronize()
    bad = []

    def worker():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(50):
                y = kspec.call("norm_act.fwd", x, w, None, norm="layernorm", act="silu")[0]
            s.synchronize()
            if not torch.equal(y, want):
                bad.append(1)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not bad

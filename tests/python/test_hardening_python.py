"""Issue 26, the Python surface, without a GPU: malformed DLPack capsules (built with ctypes) and
__cuda_array_interface__ dicts give a clean kspec.InvalidArgument naming the argument, never a crash;
kspec.call needs no framework when out= is given; outputs that overlap inputs or are read-only are
refused; every kspec exception is a kspec.Error and the CLI reports each in one line."""
import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

import helpers

import kspec
from kspec import _C

# ---- DLPack capsules built by hand ----


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_keep = []  # the structs and arrays the capsules point into live as long as the tests

CUDA, CPU, CUDA_HOST, CUDA_MANAGED = 2, 1, 3, 13
FAKE_PTR = 0x7F0000000000  # validation happens before any launch: the pointer is never read


def capsule(shape=(4, 8), strides=None, ndim=None, data=FAKE_PTR, device_type=CUDA, device_id=0,
            dtype=(2, 32, 1), byte_offset=0, name=b"dltensor", null_shape=False):
    """A capsule over a ctypes DLManagedTensor; every field may be set to something hostile."""
    m = DLManagedTensor()
    t = m.dl_tensor
    t.data = data
    t.device = DLDevice(device_type, device_id)
    t.ndim = len(shape) if ndim is None else ndim
    t.dtype = DLDataType(*dtype)
    if not null_shape:
        arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        _keep.append(arr)
        t.shape = ctypes.cast(arr, ctypes.POINTER(ctypes.c_int64))
    if strides is not None:
        sarr = (ctypes.c_int64 * max(len(strides), 1))(*strides)
        _keep.append(sarr)
        t.strides = ctypes.cast(sarr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = byte_offset
    _keep.append(m)
    return _new_capsule(ctypes.addressof(m), name, None)


class Dl:
    """An object exposing a capsule through __dlpack__, as torch/CuPy/JAX arrays do."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, stream=None):
        return self.cap

    def __dlpack_device__(self):
        return (CUDA, 0)


def test_well_formed_capsules_are_described():
    assert _C.dlpack_describe(capsule()) == (FAKE_PTR, "float32", (4, 8), (8, 1), 0)
    # strides NULL means compact row-major; given strides are kept; byte_offset is added
    assert _C.dlpack_describe(capsule(shape=(2, 3, 5), dtype=(4, 16, 1)))[1:4] == ("bfloat16", (2, 3, 5), (15, 5, 1))
    assert _C.dlpack_describe(capsule(strides=(1, 4)))[3] == (1, 4)
    assert _C.dlpack_describe(capsule(byte_offset=64))[0] == FAKE_PTR + 64
    # an empty tensor may have a null data pointer; a 0-d tensor a null shape
    assert _C.dlpack_describe(capsule(shape=(0, 8), data=None))[2] == (0, 8)
    assert _C.dlpack_describe(capsule(shape=(), null_shape=True))[2] == ()
    # pageable host memory is described as such, for validation to refuse by name (pinned: refused below)
    assert _C.dlpack_describe(capsule(device_type=CPU))[4] == -1
    assert _C.dlpack_describe(capsule(device_type=CUDA_MANAGED, device_id=1))[4] == 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(shape=(4, 8), null_shape=True), "null shape"),
    (dict(shape=(4, 8), ndim=100000), "ndim 100000"),
    (dict(shape=(4, 8), ndim=-1), "ndim -1"),
    (dict(shape=(4, 8), data=None), "null data pointer"),
    (dict(shape=(4, -8)), "negative size"),
    (dict(shape=(2**40, 2**40)), "2**63"),
    (dict(dtype=(2, 32, 4)), "lanes 4"),
    (dict(dtype=(2, 8, 1)), "dtype code 2 bits 8"),
    (dict(dtype=(6, 8, 1)), "dtype code 6"),
    (dict(dtype=(99, 16, 1)), "dtype code 99"),
    (dict(device_type=4), "device type 4"),
    (dict(device_type=10), "device type 10"),
    (dict(device_id=-3), "negative CUDA device id"),
    (dict(data=2**64 - 16, byte_offset=64), "overflows"),
    (dict(name=b"used_dltensor"), "already consumed"),
    (dict(name=b"used_dltensor_versioned"), "already consumed"),
    (dict(name=None), "named 'dltensor' or 'dltensor_versioned'"),
    (dict(device_type=CUDA_HOST), "pinned host memory"),
])
def test_malformed_capsule_is_invalid_argument(kwargs, fragment):
    with pytest.raises(kspec.InvalidArgument, match="DLPack") as e:
        _C.dlpack_describe(capsule(**kwargs))
    assert fragment in str(e.value)


def test_malformed_capsule_through_call_names_the_argument():
    w = Dl(capsule(shape=(8,)))
    with pytest.raises(kspec.InvalidArgument, match=r"norm_act.fwd: input 'x': DLPack: ndim 2 with a null shape"):
        kspec.call("norm_act.fwd", Dl(capsule(null_shape=True)), w, None)
    with pytest.raises(kspec.InvalidArgument, match=r"input 'weight': DLPack: ndim 100000"):
        kspec.call("norm_act.fwd", Dl(capsule()), Dl(capsule(shape=(8, 8), ndim=100000)), None)
    # __dlpack__ returning something that is no capsule
    with pytest.raises(kspec.InvalidArgument, match=r"input 'x': DLPack: __dlpack__\(\) returned a str"):
        kspec.call("norm_act.fwd", Dl("not a capsule"), w, None)
    # a host capsule reaches validation and is refused by name
    with pytest.raises(kspec.InvalidArgument, match="input 'x': expected a CUDA tensor"):
        kspec.call("norm_act.fwd", Dl(capsule(device_type=CPU)), w, None, out=(None, None, None))


# ---- DLPack 1.0: versioned capsules, stream=, max_version ----


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


def versioned(shape=(4, 8), major=1, minor=0, flags=0, device_type=CUDA, name=b"dltensor_versioned"):
    """A 'dltensor_versioned' capsule (dlpack.h 1.0's DLManagedTensorVersioned)."""
    m = DLManagedTensorVersioned()
    m.version = DLPackVersion(major, minor)
    m.flags = flags
    t = m.dl_tensor
    t.data = FAKE_PTR
    t.device = DLDevice(device_type, 0)
    t.ndim = len(shape)
    t.dtype = DLDataType(2, 32, 1)
    arr = (ctypes.c_int64 * len(shape))(*shape)
    _keep.extend([arr, m])
    t.shape = ctypes.cast(arr, ctypes.POINTER(ctypes.c_int64))
    return _new_capsule(ctypes.addressof(m), name, None)


def test_versioned_capsules_are_read():
    assert ctypes.sizeof(DLManagedTensorVersioned) == 80  # dlpack.h 1.0 on LP64
    assert _C.dlpack_describe(versioned()) == (FAKE_PTR, "float32", (4, 8), (8, 1), 0)
    assert _C.dlpack_describe(versioned(minor=3)) == (FAKE_PTR, "float32", (4, 8), (8, 1), 0)
    # the read-only flag (DLPACK_FLAG_BITMASK_READ_ONLY) marks the descriptor, so it is refused as an output
    assert _C.dlpack_describe(versioned(flags=1))[5] is True
    with pytest.raises(kspec.InvalidArgument, match=r"version 2\.0; kspec reads major version 1"):
        _C.dlpack_describe(versioned(major=2))
    with pytest.raises(kspec.InvalidArgument, match="pinned host memory"):
        _C.dlpack_describe(versioned(device_type=CUDA_HOST))


class Producer:
    """A DLPack 1.0 producer that records how it was asked (the array API's __dlpack__ signature)."""

    def __init__(self, cap, device=(CUDA, 0), legacy=False):
        self.cap, self.device, self.calls = cap, device, []
        if legacy:  # before DLPack 1.0: no max_version
            self.__dlpack__ = lambda stream=None: (self.calls.append({"stream": stream}), self.cap)[1]

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        return self.cap

    def __dlpack_device__(self):
        return self.device


def test_dlpack_is_asked_for_v1_on_the_calls_stream(monkeypatch):
    from kspec import _tensors

    monkeypatch.setattr(_tensors, "current_stream", lambda fw, device: 0x5EED)
    p = Producer(versioned())
    assert _tensors.describe(p)[:3] == (FAKE_PTR, "float32", (4, 8))
    assert p.calls == [{"stream": 0x5EED, "max_version": (1, 0)}]
    # the legacy default stream is 1 in DLPack (0 is not allowed for CUDA)
    monkeypatch.setattr(_tensors, "current_stream", lambda fw, device: 0)
    p = Producer(versioned())
    _tensors.describe(p)
    assert p.calls[0]["stream"] == 1
    # a producer older than 1.0 is asked without max_version, still with the stream
    p = Producer(capsule(), legacy=True)
    assert _tensors.describe(p)[2] == (4, 8) and p.calls == [{"stream": 1}]
    # host memory: no stream (the standard wants None for non-CUDA devices)
    p = Producer(capsule(device_type=CPU), device=(CPU, 0))
    _tensors.describe(p)
    assert p.calls[0]["stream"] is None


def test_pinned_dlpack_through_call_is_refused_by_name():
    w = Dl(capsule(shape=(8,)))
    with pytest.raises(kspec.InvalidArgument, match=r"input 'x': DLPack: pinned host memory"):
        kspec.call("norm_act.fwd", Producer(versioned(device_type=CUDA_HOST), device=(CUDA_HOST, 0)), w, None)


# ---- __cuda_array_interface__ ----


class Dev:
    def __init__(self, i):
        self.id = i


class Cai:
    """A CUDA array by the interface alone (like Numba's), on a fake device pointer."""

    def __init__(self, shape, typestr="<f4", ptr=FAKE_PTR, readonly=False, strides=None, **extra):
        self.device = Dev(0)
        self.__cuda_array_interface__ = dict(shape=tuple(shape), typestr=typestr, data=(ptr, readonly),
                                             strides=strides, version=3, **extra)


def cai_with(**changes):
    c = Cai((4, 8))
    for k, v in changes.items():
        if v is KeyError:
            del c.__cuda_array_interface__[k]
        else:
            c.__cuda_array_interface__[k] = v
    return c


@pytest.mark.parametrize("changes, fragment", [
    (dict(shape=KeyError), "missing key(s) 'shape'"),
    (dict(typestr=KeyError, data=KeyError), "'typestr', 'data'"),
    (dict(shape=(4, "8")), "'shape' must be a tuple of ints"),
    (dict(shape=4), "'shape' must be a tuple of ints"),
    (dict(shape=(4, True)), "'shape' must be a tuple of ints"),
    (dict(shape=(4, -8)), "negative size"),
    (dict(typestr=">f4"), "unsupported typestr '>f4'"),
    (dict(typestr=7), "unsupported typestr 7"),
    (dict(data=FAKE_PTR), "'data' must be (pointer: int, read_only: bool)"),
    (dict(data=(FAKE_PTR,)), "'data' must be"),
    (dict(data=("0x10", False)), "'data' must be"),
    (dict(data=(-16, False)), "not an address"),
    (dict(strides=(32,)), "1 strides for 2 dims"),
    (dict(strides=(32, "4")), "'strides' must be a tuple of ints"),
    (dict(strides=(32, 6)), "not a multiple of the element size"),
    (dict(mask=object()), "masked arrays"),
])
def test_malformed_interface_is_invalid_argument(changes, fragment):
    bad = cai_with(**changes)
    with pytest.raises(kspec.InvalidArgument, match="norm_act.fwd: input 'x': __cuda_array_interface__") as e:
        kspec.call("norm_act.fwd", bad, Cai((8,)), None, out=(Cai((4, 8), ptr=FAKE_PTR + (1 << 20)), None, None))
    assert fragment in str(e.value)


def test_interface_not_a_dict():
    bad = Cai((4, 8))
    bad.__cuda_array_interface__ = [1, 2]
    with pytest.raises(kspec.InvalidArgument, match="input 'x': __cuda_array_interface__: expected a dict, got list"):
        kspec.call("norm_act.fwd", bad, Cai((8,)), None)


def test_descriptor_values_that_do_not_fit_are_invalid_argument():
    # the C++ side checks the tuple too: a 25-digit size is not pybind's "Unable to cast"
    x = Cai((4, 10**25))
    with pytest.raises(kspec.InvalidArgument, match="norm_act.fwd: input 'x': tensor descriptor: .* 64 bits"):
        kspec.call("norm_act.fwd", x, Cai((8,)), None, out=(None, None, None))
    with pytest.raises(kspec.InvalidArgument, match=r"input 'x': tensor descriptor: .* more than 2\*\*63"):
        kspec.call("norm_act.fwd", Cai((2**40, 2**40)), Cai((8,)), None, out=(None, None, None))
    with pytest.raises(kspec.InvalidArgument, match="output 'mean': tensor descriptor: .* 64 bits"):
        kspec.call("norm_act.fwd", Cai((4, 8)), Cai((8,)), None, out=(None, Cai((2**70,)), None))
    # descriptors given to the core directly (as kspec.optim does): checked the same way
    desc = (FAKE_PTR, "float32", (4, 8), (8, 1), 0)
    with pytest.raises(kspec.InvalidArgument, match=r"input 'x'\[1\]: tensor descriptor: negative size"):
        _C.infer_outputs("norm_act.fwd", [[desc, (FAKE_PTR, "float32", (4, -8), (8, 1), 0)]], {})
    with pytest.raises(kspec.InvalidArgument, match="input 'weight': tensor descriptor: shape: expected an int"):
        _C.infer_outputs("norm_act.fwd", [desc, (FAKE_PTR, "float32", ("8",), (1,), 0)], {})
    with pytest.raises(kspec.InvalidArgument, match="input 'weight': tensor descriptor: device 2147483648"):
        _C.infer_outputs("norm_act.fwd", [desc, (FAKE_PTR, "float32", (8,), (1,), 2**31)], {})
    with pytest.raises(kspec.InvalidArgument, match="input 'x': tensor descriptor: pointer -1"):
        _C.infer_outputs("norm_act.fwd", [(-1, "float32", (4, 8), (8, 1), 0)], {})


def _out(shape=(4, 8), offset=1 << 20, **kw):
    return Cai(shape, ptr=FAKE_PTR + offset, **kw)


def test_read_only_output_is_refused_by_name():
    x, w = Cai((4, 8), readonly=True), Cai((8,), ptr=FAKE_PTR + (2 << 20))  # a read-only input is fine
    y, mean, rstd = _out(readonly=True), _out((4,), 3 << 20), _out((4,), 4 << 20)
    with pytest.raises(kspec.InvalidArgument, match="norm_act.fwd: output 'y': the buffer is read-only"):
        kspec.call("norm_act.fwd", x, w, None, out=(y, mean, rstd))
    with pytest.raises(kspec.InvalidArgument, match="output 'rstd': the buffer is read-only"):
        kspec.call("norm_act.fwd", x, w, None, out=(_out(), mean, _out((4,), 4 << 20, readonly=True)))


@pytest.mark.parametrize("y_offset, names", [
    (0, ("output 'y'", "input 'x'")),          # the same buffer
    (32, ("output 'y'", "input 'x'")),         # one row into x
    ("w", ("output 'y'", "input 'weight'")),   # on the weight
])
def test_output_overlapping_an_input_is_refused(y_offset, names):
    x, w = Cai((4, 8)), Cai((8,), ptr=FAKE_PTR + (2 << 20))
    y = Cai((4, 8), ptr=FAKE_PTR + (2 << 20) if y_offset == "w" else FAKE_PTR + y_offset)
    with pytest.raises(kspec.InvalidArgument, match="shares memory") as e:
        kspec.call("norm_act.fwd", x, w, None, out=(y, _out((4,), 3 << 20), _out((4,), 4 << 20)))
    assert all(n in str(e.value) for n in names), str(e.value)


def test_output_overlapping_another_output_is_refused():
    x, w = Cai((4, 8)), Cai((8,), ptr=FAKE_PTR + (2 << 20))
    mean = _out((4,), 3 << 20)
    with pytest.raises(kspec.InvalidArgument, match="output 'rstd'.*shares memory with output 'mean'"):
        kspec.call("norm_act.fwd", x, w, None, out=(_out(), mean, mean))


def test_out_must_be_a_sequence():
    with pytest.raises(kspec.InvalidArgument, match=r"out= expects a sequence of outputs \(y, mean, rstd\)"):
        kspec.call("norm_act.fwd", Cai((4, 8)), Cai((8,)), None, out=_out())


# ---- no torch, no CuPy: a framework is needed only to allocate outputs ----

_BLOCKER = """
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cupy"):
            raise ImportError(f"{name} is blocked for this test")
        return None


sys.meta_path.insert(0, _Block())
"""

_NO_FRAMEWORK = """
import sys
import kspec
from kspec import _C

assert "torch" not in sys.modules and "cupy" not in sys.modules
P = 0x7F0000000000


class Dev:
    id = 0


class Cai:
    def __init__(self, shape, ptr):
        self.device = Dev()
        self.__cuda_array_interface__ = dict(shape=shape, typestr="<f4", data=(ptr, False), strides=None, version=3)


x, w = Cai((4, 8), P), Cai((8,), P + (1 << 20))
out = (Cai((4, 8), P + (2 << 20)), None, None)
seen = {}
for name, f in {
    "x_none_out": lambda: kspec.call("norm_act.fwd", None, w, None, out=out),
    "x_none": lambda: kspec.call("norm_act.fwd", None, w, None),
    "no_out": lambda: kspec.call("norm_act.fwd", x, w, None),
    "bad_shape_out": lambda: kspec.call("norm_act.fwd", x, w, None, out=(Cai((4, 9), P + (2 << 20)), None, None)),
}.items():
    try:
        f()
        seen[name] = "no error"
    except kspec.Error as e:
        seen[name] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - what the test is about
        seen[name] = f"NOT KSPEC {type(e).__name__}: {e}"
for k, v in seen.items():
    print(f"{k}|{v}")
"""


def test_call_without_torch_or_cupy(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    (tmp_path / "probe.py").write_text(_NO_FRAMEWORK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = dict(line.split("|", 1) for line in r.stdout.splitlines() if "|" in line)
    # validation comes first, whether or not outputs are given
    assert seen["x_none_out"].startswith("InvalidArgument: norm_act.fwd: input 'x' is required"), seen
    assert seen["x_none"].startswith("InvalidArgument: norm_act.fwd: input 'x' is required"), seen
    # without out= and without a framework: a kspec error saying what to do
    assert seen["no_out"].startswith("InvalidArgument: norm_act.fwd: no framework to allocate"), seen
    assert "out=" in seen["no_out"] and "torch" in seen["no_out"], seen
    # with out=: no framework is imported, the outputs are validated
    assert seen["bad_shape_out"].startswith("InvalidArgument: norm_act.fwd: output 'y'"), seen


# ---- the exception hierarchy and the CLI ----


@pytest.mark.parametrize("name, builtin", [("InvalidArgument", ValueError), ("Unsupported", NotImplementedError),
                                           ("CacheError", OSError), ("CompileError", RuntimeError),
                                           ("CudaError", RuntimeError), ("InternalError", RuntimeError)])
def test_every_kspec_exception_is_a_kspec_error_and_its_builtin(name, builtin):
    cls = getattr(kspec, name)
    assert issubclass(cls, kspec.Error) and issubclass(cls, builtin)
    with pytest.raises(kspec.Error):
        raise cls("x")
    with pytest.raises(builtin):
        raise cls("x")


def test_errors_from_cpp_are_caught_as_kspec_error():
    with pytest.raises(kspec.Error, match="unknown op"):
        kspec.compile("nope.fwd")
    with pytest.raises(ValueError, match="unknown op"):
        kspec.compile("nope.fwd")


def cli(*args, env=None):
    return helpers.cli(*args, env=env, check=False, timeout=120)


def assert_clean_error(r, fragment):
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kspec: error: ")]
    assert len(lines) == 1 and fragment in lines[0], r.stderr


def test_cli_missing_import_file_is_an_error(tmp_path):
    r = cli("tune", "--import", str(tmp_path / "missing.json"), env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(r, "missing.json")
    assert "merged" not in r.stdout


# (Record-by-record checks of an import's entries are the C++ import's; these are the file's own fields.)
@pytest.mark.parametrize("doc", [
    {"version": 1, "gpu": 5, "entries": {}},
    {"version": 1, "toolkit": 12, "entries": {}},
    {"version": 1, "entries": []},
    [1, 2],
])
def test_cli_wrong_typed_import_is_one_line(tmp_path, doc):
    f = tmp_path / "team.json"
    f.write_text(json.dumps(doc))
    r = cli("tune", "--import", str(f), env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(r, "team.json")


def test_cli_reports_file_errors_in_one_line(tmp_path):
    # a precompile list that is missing, or not JSON
    r = cli("precompile", "--file", str(tmp_path / "nope.jsonl"), env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(r, "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json")
    r = cli("precompile", "--file", str(bad), env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(r, "")


def test_cli_cache_error_is_one_line(tmp_path):
    # kspec.CacheError raised anywhere under the CLI is reported without a traceback.
    script = textwrap.dedent("""
        import sys
        from kspec import cli, _C

        def boom(a):
            raise _C.CacheError("cache: cannot write /x (disk full)")

        cli.cmd_doctor = boom
        sys.exit(cli.main(["doctor"]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 5 and r.stderr.strip() == "kspec: error: CacheError: cache: cannot write /x (disk full)", r.stderr

"""The Python layer of kspec.ops.* per call (no GPU: the registry call stubbed): what runs for torch tensors
in the common case, counted with a profile hook. A host-bound training step calls these per layer, so the
wrappers must not run importlib per call (`from . import`), nor checks and layout walks that the common
case does not need (tools/bench/NOTES.md, "host path")."""
import sys

import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _torch  # noqa: E402


def frames(fn, kspec_only=False) -> list:
    """Names of the Python functions (and generator resumptions) one fn() call runs; kspec_only: those of
    kspec's own files (test_scan_one_call.py reads the scan's backward with it)."""
    names = []

    def hook(frame, event, arg):
        if event == "call" and (not kspec_only or "kspec" in frame.f_code.co_filename):
            names.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def _python_calls(fn, kspec_only=False) -> list:
    """frames() of one fn() call after a warm-up call."""
    fn()
    return frames(fn, kspec_only)[:-1]  # the last is setprofile's own exit


NOT_PER_CALL = {"_handle_fromlist", "_check_arrays", "gemm_reads_in_place", "canonical_act", "_contiguous",
                "_torch_glue"}


def test_selective_scan_fn_runs_no_import_or_generic_checks(monkeypatch):
    u = torch.randn(1, 4, 8)
    A, B = -torch.rand(4, 16), torch.randn(1, 1, 16, 8)

    def stub(op, *inputs, out=None, **params):
        return torch.empty_like(u), torch.empty(1, 4, 16), None

    monkeypatch.setattr(_torch, "call", stub)
    names = _python_calls(lambda: kspec.ops.selective_scan_fn(u, u, A, B, B, delta_softplus=True))
    assert not NOT_PER_CALL & set(names), names
    assert names.count("_is_torch") == 1, names  # u's type is tested once
    assert len(names) <= 15, names


def test_torch_entries_read_the_glue_module_without_an_import():
    """kspec._torch hands itself to kspec.ops at import: the torch entries read a global (an import
    statement per call ran importlib's fast path, ~0.4 us)."""
    from kspec import ops

    assert ops._torch is _torch
    assert ops._torch_glue() is _torch


def test_mhc_entries_run_no_import_and_one_forward_call_without_grad(monkeypatch):
    """kspec.ops.mhc_pre / mhc_post / mhc_post_pre at decode (no gradient): the glue module read from a global that
    kspec._mhc sets (not `from . import _mhc`, importlib's _handle_fromlist per call), then one call of the
    forward op (mhc_pre's with save_stats=False); the public outputs are its first ones."""
    from kspec import _mhc, ops

    assert ops._mhc is _mhc and ops._mhc_glue() is _mhc
    x, f = torch.randn(8, 4, 64), torch.randn(8, 64)
    phi, alpha, bias = torch.zeros(24, 256), torch.full((3,), 0.01), torch.zeros(24)
    calls, saves = [], []

    def stub(op, *inputs, out=None, **params):
        calls.append(op)
        saves.append(params.get("save_stats"))
        n = {"mhc.pre.fwd": 6, "mhc.post.fwd": 1, "mhc.post_pre.fwd": 7}[op]
        return tuple(torch.full((1,), float(i)) for i in range(n))

    monkeypatch.setattr(_mhc, "call", stub)
    monkeypatch.setattr(_mhc, "_forward", lambda op, inputs, params: stub(op, *inputs, **params))
    with torch.no_grad():
        for fn, n_out in ((lambda: kspec.ops.mhc_pre(x, phi, alpha, bias), 4),
                          (lambda: kspec.ops.mhc_post(x, f, torch.rand(8, 4), torch.rand(8, 4, 4)), 1),
                          (lambda: kspec.ops.mhc_post_pre(x, f, torch.rand(8, 4), torch.rand(8, 4, 4), phi, alpha, bias),
                           5)):
            calls.clear()
            names = _python_calls(fn)
            assert not NOT_PER_CALL & set(names) and "_handle_fromlist" not in names, names
            assert calls == [calls[0]] * 2, calls  # the warm-up call and the counted one: one op call each
            if calls[0] == "mhc.pre.fwd":  # no backward to follow: neither inv nor h allocated
                assert saves[-1] is False, saves
            out = fn()
            got = [out] if n_out == 1 else list(out)
            assert [float(t[0]) for t in got] == list(range(n_out))


@pytest.mark.parametrize("weight_t", [False, True])
def test_linear_reads_contiguous_operands_without_the_layout_walk(monkeypatch, weight_t):
    x = torch.randn(4, 32)
    w = torch.randn(16, 32)
    if weight_t:  # a transposed weight: the layout rule runs for it alone (it is read in place)
        w = torch.randn(32, 16).t()
    monkeypatch.setattr(_torch, "call", lambda op, *inputs, **params: (torch.empty(4, 16), None))
    names = _python_calls(lambda: kspec.ops.linear(x, w, None, "relu"))
    assert names.count("gemm_reads_in_place") == int(weight_t), names
    assert not (NOT_PER_CALL - {"gemm_reads_in_place"}) & set(names), names


def test_scan_surface_runs_no_generator(monkeypatch):
    """The surface's forward (its public outputs) and backward (Surface._grads_of's gradient mapping) build
    their tuples from list comprehensions, not generators resumed once per item."""
    b, d, t, n = 1, 4, 8, 16

    def stub(op, *inputs, out=None, **params):
        if op == "selective_scan.fwd":
            return out if out is not None else (torch.zeros(b, d, t), torch.zeros(b, d, n), None)
        return tuple(None if x is None else torch.zeros_like(x) for x in inputs[1:10])

    monkeypatch.setattr(_torch, "call", stub)
    monkeypatch.setattr(_torch, "call_some", lambda *args: NotImplemented)
    # the record path (the C++ node of call_grad runs no Python: tests/python/test_scan_one_call.py)
    monkeypatch.setattr(_torch.selective_scan, "grad_call", None)
    leaves = [v.requires_grad_() for v in (torch.randn(b, d, t), torch.rand(b, d, t), -torch.rand(d, n),
                                           torch.randn(b, 1, n, t), torch.randn(b, 1, n, t))]
    dout = torch.randn(b, d, t)
    names = _python_calls(lambda: kspec.ops.selective_scan_fn(*leaves, delta_softplus=True).backward(dout),
                          kspec_only=True)
    assert "_grads_of" in names and "<genexpr>" not in names, " ".join(names)
    # the wrapper's contiguity pass and _grads_of's two; the record path picks with itemgetter and map
    assert names.count("<listcomp>") == 3, " ".join(names)


def test_linear_without_grad_is_one_gemm_call_without_the_surface(monkeypatch):
    """kspec.ops.linear with no gradient wanted: one gemm call, straight (no Surface.__call__, no forward
    function), whatever the act."""
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    calls = []

    def stub(op, *inputs, **params):
        calls.append((op, params))
        return torch.empty(4, 16), None

    monkeypatch.setattr(_torch, "call", stub)
    for act in ("none", "relu", "gelu_tanh"):
        calls.clear()
        names = _python_calls(lambda: kspec.ops.linear(x, w, None, act), kspec_only=True)
        assert calls == [("gemm", {"act": act, "tf32": False})] * 2, calls  # the warm-up call and the one counted
        assert not {"__call__", "_linear_fwd", "_readable"} & set(names), names


class _FakeExt:
    """The extension with call_grad recorded (no kernels on CPU)."""

    def __init__(self):
        self.seen = []

    def call_grad(self, name, fwd_op, bwd_op, inputs, params, bwd_params, codes, grad_of):
        self.seen.append((name, fwd_op, bwd_op, params, bwd_params, codes, grad_of))
        x, w = inputs[0], inputs[1]
        return torch.empty(*x.shape[:-1], w.shape[0]), None


def test_linear_with_grad_is_one_call_grad_for_none_and_relu(monkeypatch):
    """With a gradient wanted, act none or relu: one call_grad (gemm, then gemm.bwd reading (dy, x, weight,
    saved) = (the gradient of y, x, weight, nothing / y)); gelu_tanh (GELU's input kept) and an empty x
    stay with the surface."""
    from kspec import _native

    fake = _FakeExt()
    monkeypatch.setattr(_native, "ext", fake)
    x, w, b = torch.randn(4, 32, requires_grad=True), torch.randn(16, 32), torch.randn(16)
    for act, codes in (("none", (2000, 0, 1, -1)), ("relu", (2000, 0, 1, 1000))):
        fake.seen.clear()
        y = kspec.ops.linear(x, w, b, act)
        assert fake.seen == [("LinearBackward", "gemm", "gemm.bwd", {"act": act, "tf32": False}, ("act", "tf32"),
                              codes, (0, 1, 2))]
        assert y.shape == (4, 16)
    assert kspec.ops.linear(x[0], w, b, "relu").shape == (16,)  # a 1-d x: one row, squeezed back

    surface = []
    monkeypatch.setattr(_torch, "linear_surface", lambda *args: surface.append(args) or torch.empty(4, 16))
    fake.seen.clear()
    kspec.ops.linear(x, w, b, "gelu_tanh")
    kspec.ops.linear(torch.randn(0, 32, requires_grad=True), w, b, "relu")
    assert not fake.seen and len(surface) == 2


def test_mhc_forward_calls_the_torch_fast_path_straight(monkeypatch):
    """kspec._mhc._forward (the no-grad entries' one call): kspec._core's current torch fast path with the inputs
    as a tuple and the params as a dict (no keyword packing), and kspec.call where that path returns NotImplemented
    (the pure path's answer for what it does not read)."""
    from kspec import _core, _mhc

    seen = []
    monkeypatch.setattr(_core, "_call_torch", lambda op, inputs, out, params: seen.append((op, inputs, out, params))
                        or ("out",))
    monkeypatch.setattr(_mhc, "call", lambda op, *inputs, **params: pytest.fail("kspec.call ran"))
    assert _mhc._forward("mhc.post.fwd", (1, 2, 3, 4), {"a": 1}) == ("out",)
    assert seen == [("mhc.post.fwd", (1, 2, 3, 4), None, {"a": 1})]
    monkeypatch.setattr(_core, "_call_torch", lambda *a: NotImplemented)
    monkeypatch.setattr(_mhc, "call", lambda op, *inputs, **params: (op, inputs, params))
    assert _mhc._forward("mhc.post.fwd", (1, 2), {"a": 1}) == ("mhc.post.fwd", (1, 2), {"a": 1})

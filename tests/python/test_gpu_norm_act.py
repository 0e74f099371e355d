"""norm_act on the GPU through Python: forward and autograd backward against the float64 reference for
every dtype, odd sizes, T=1/T=2-like edge rows and a large case; kspec's error at most 2x torch's at the
same precision; torch.compile through the custom op; CuPy and DLPack inputs; bad input errors; the
caller's stream."""
import numpy as np
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import norm_act as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# 12289 and 20000: rows too long for registers, streamed.
SHAPES = [(1, 1), (2, 33), (33, 33), (17, 4095), (9, 8192), (3, 5, 768), (129, 640), (64, 1000), (6, 12289),
          (2, 3, 20000)]
COMBOS = [("layernorm", "identity"), ("layernorm", "gelu_erf"), ("rmsnorm", "silu"), ("rmsnorm", "gelu_tanh")]


def _torch_expr(x, w, b, norm, act, eps):
    h = x.shape[-1]
    if norm == "layernorm":
        y = torch.nn.functional.layer_norm(x, (h,), w, b, eps)
    else:
        y = torch.nn.functional.rms_norm(x, (h,), w, eps)
        if b is not None:
            y = y + b
    return {"identity": lambda t: t, "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "gelu_erf": torch.nn.functional.gelu}[act](y)


def _np(t):
    return t.detach().double().cpu().numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("norm,act", COMBOS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_forward_and_backward_match_reference(dtype, shape, norm, act, bias):
    hidden = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True) if bias else None
    y = kspec.ops.norm_act(x, w, b, norm=norm, act=act, eps=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, _, _ = ref.norm_act_fwd(_np(x), _np(w), None if b is None else _np(b), norm, act, 1e-5)
    dxr, dwr, dbr = ref.norm_act_bwd(_np(dy), _np(x), _np(w), None if b is None else _np(b), norm, act, 1e-5)
    tol = TOL[str(dtype).split(".")[1]]
    errs = {"y": rel_err(_np(y), yr), "dx": rel_err(_np(x.grad), dxr), "dw": rel_err(_np(w.grad), dwr)}
    if bias:
        errs["db"] = rel_err(_np(b.grad), dbr)
    # torch at the same precision, for the "no worse than 2x torch" rule
    xt, wt = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    bt = b.detach().clone().requires_grad_() if bias else None
    yt = _torch_expr(xt, wt, bt, norm, act, 1e-5)
    yt.backward(dy)
    terrs = {"y": rel_err(_np(yt), yr), "dx": rel_err(_np(xt.grad), dxr), "dw": rel_err(_np(wt.grad), dwr)}
    if bias:
        terrs["db"] = rel_err(_np(bt.grad), dbr)
    for k, e in errs.items():
        if k == "dx" and norm == "rmsnorm" and hidden == 1:
            # dx = rstd·dxhat·(1 − xhat²) with 1 − xhat² = eps/(x²+eps) ≈ 1e-5: the condition number is
            # ~1e5, so any fp32 rounding shows at 1e-3..1e-2 and neither kspec nor torch can do better.
            # In half precision a large |x| can leave 1 − xhat² below fp32's resolution of xhat² (torch's
            # dx is then as wrong as kspec's): kspec may not be worse than torch.
            assert e <= max(0.1, 2 * terrs[k]), f"dx: kspec {e:.2e} (ill-conditioned case, torch {terrs[k]:.2e})"
            continue
        # Where torch itself misses the tolerance the problem is ill-conditioned (rmsnorm of one element:
        # dx ∝ 1 - xhat² with xhat² = x²/(x²+eps)); then kspec must stay within 2x of torch.
        assert e <= max(tol, 2 * terrs[k]), f"{k}: kspec {e:.2e} > tolerance {tol} (torch {terrs[k]:.2e})"
        # The 2x rule needs errors averaged over many elements; a handful of half-precision values
        # can differ from torch's by one rounding (up to tol), which says nothing about accuracy.
        few = {"y": y, "dx": x, "dw": w, "db": b}[k].numel() < 64
        floor = tol if few else tol / 10
        assert e <= max(2 * terrs[k], floor), f"{k}: kspec {e:.2e} > 2x torch's {terrs[k]:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_large_and_fp32_weights(dtype):
    x = torch.randn(16384, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=torch.float32)
    b = torch.randn(4096, device="cuda", dtype=torch.float32)
    y, mean, rstd = kspec.ops.norm_act_fwd(x, w, b, norm="layernorm", act="gelu_tanh")
    rows = slice(0, 16384, 97)  # a strided sample of rows keeps the float64 reference quick
    yr, mr, rr = ref.norm_act_fwd(_np(x[rows]), _np(w), _np(b), "layernorm", "gelu_tanh", 1e-5)
    tol = TOL[str(dtype).split(".")[1]]
    assert rel_err(_np(y[rows]), yr) <= tol
    assert rel_err(_np(rstd[rows]), rr) <= 1e-5
    dy = torch.randn_like(y)
    dx, dw, db = kspec.ops.norm_act_bwd(dy, x, w, b, mean, rstd, norm="layernorm", act="gelu_tanh")
    assert dw.dtype == torch.float32 and not torch.isnan(dx).any()
    dxr, _, _ = ref.norm_act_bwd(_np(dy[rows]), _np(x[rows]), _np(w), _np(b), "layernorm", "gelu_tanh", 1e-5)
    assert rel_err(_np(dx[rows]), dxr) <= tol
    # dweight over all rows, against float64 torch (the NumPy reference would be slow at this size)
    xd, dyd = x.double(), dy.double()
    xhat = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    h = xhat * w.double() + b.double()
    g = dyd * torch.autograd.functional.vjp(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), h,
                                            torch.ones_like(h))[1]
    assert rel_err(_np(dw), _np((g * xhat).sum(0))) <= tol
    assert rel_err(_np(db), _np(g.sum(0))) <= tol


def test_torch_compile_through_custom_op():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(x, w):
        return (kspec.ops.norm_act(x * 2, w, None, norm="rmsnorm", act="silu") ** 2).sum()

    cf = torch.compile(f, fullgraph=True)
    out = cf(x, w)
    out.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    assert torch.allclose(out.float(), f(x, w).float(), rtol=1e-2)
    assert rel_err(_np(gx), _np(x.grad)) < 1e-2 and rel_err(_np(gw), _np(w.grad)) < 1e-2


def test_uses_callers_stream():
    s = torch.cuda.Stream()
    x = torch.randn(4096, 2048, device="cuda")
    w = torch.randn(2048, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so a default-stream launch would race ahead
        y = kspec.ops.norm_act(x, w, None, norm="rmsnorm")
        z = y * 1.0
    s.synchronize()
    yr = _torch_expr(x, w, None, "rmsnorm", "identity", 1e-5)
    assert rel_err(_np(z), _np(yr)) < 1e-5


def test_noncontiguous_rows_and_batch_first_views():
    base = torch.randn(8, 40, 1024 + 64, device="cuda")
    x = base[..., :1024]  # row stride 1088
    w = torch.randn(1024, device="cuda")
    y = kspec.ops.norm_act(x, w, None, norm="layernorm", act="silu")
    assert torch.allclose(y, _torch_expr(x.contiguous(), w, None, "layernorm", "silu", 1e-5), atol=1e-5)


def test_bad_input_errors():
    w = torch.randn(64, device="cuda")
    with pytest.raises(ValueError, match="input 'x'.*dtype"):
        kspec.ops.norm_act(torch.ones(2, 64, device="cuda", dtype=torch.int32), w)
    with pytest.raises(ValueError, match="input 'weight'.*hidden"):
        kspec.ops.norm_act(torch.randn(2, 64, device="cuda"), torch.randn(63, device="cuda"))
    with pytest.raises(ValueError, match="CUDA tensor"):
        kspec.call("norm_act.fwd", torch.randn(2, 64), torch.randn(64), None)
    with pytest.raises(ValueError, match="contiguous"):
        kspec.ops.norm_act(torch.randn(64, 2, device="cuda").t(), w)
    with pytest.raises(ValueError, match="unknown parameter"):
        kspec.call("norm_act.fwd", torch.randn(2, 64, device="cuda"), w, None, gamma=1.0)
    with pytest.raises(ValueError, match="act"):
        kspec.ops.norm_act(torch.randn(2, 64, device="cuda"), w, act="relu")


def test_cupy_and_dlpack_inputs():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((37, 300), dtype=cupy.float32)
    w = cupy.random.standard_normal((300,), dtype=cupy.float32)
    (y, mean, rstd) = kspec.call("norm_act.fwd", x, w, None, norm="rmsnorm", act="gelu_erf")
    assert isinstance(y, cupy.ndarray)
    yr, _, _ = ref.norm_act_fwd(cupy.asnumpy(x), cupy.asnumpy(w), None, "rmsnorm", "gelu_erf", 1e-5)
    assert rel_err(cupy.asnumpy(y), yr) < 1e-5

    class OnlyDlpack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    xt = torch.randn(5, 96, device="cuda")
    wt = torch.randn(96, device="cuda")
    y2 = kspec.call("norm_act.fwd", OnlyDlpack(xt), OnlyDlpack(wt), None)[0]
    assert rel_err(_np(y2), ref.norm_act_fwd(_np(xt), _np(wt), None, "layernorm", "identity", 1e-5)[0]) < 1e-5


def test_dlpack_producer_is_asked_for_v1_on_the_current_stream():
    """A DLPack-only tensor (torch's capsules behind a plain object) on a side stream: kspec asks for a
    1.0 capsule with stream= the stream it launches on (torch's current one), and the result is right."""
    calls = []

    class V1:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            calls.append((stream, max_version))
            try:
                return self.t.__dlpack__(stream=stream, max_version=max_version)
            except TypeError:  # a torch without DLPack 1.0
                return self.t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        xt = torch.randn(5, 96, device="cuda")
        wt = torch.randn(96, device="cuda")
        y = kspec.call("norm_act.fwd", V1(xt), V1(wt), None)[0]
        assert calls == [(side.cuda_stream, (1, 0))] * 2
    side.synchronize()
    assert rel_err(_np(y), ref.norm_act_fwd(_np(xt), _np(wt), None, "layernorm", "identity", 1e-5)[0]) < 1e-5
    pinned = torch.randn(5, 96).pin_memory()
    with pytest.raises(kspec.InvalidArgument, match="input 'x'"):
        kspec.call("norm_act.fwd", V1(pinned), V1(wt), None)


def test_every_visible_device():
    for d in range(torch.cuda.device_count()):
        x = torch.randn(33, 257, device=f"cuda:{d}", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(257, device=f"cuda:{d}", dtype=torch.bfloat16)
        y = kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
        assert y.device == x.device
        y.sum().backward()
        yr, _, _ = ref.norm_act_fwd(_np(x), _np(w), None, "rmsnorm", "silu", 1e-5)
        assert rel_err(_np(y), yr) < 1e-2


def test_cpp_checker_from_python():
    rows = kspec.check("norm_act.bwd", case="hidden_4095")
    assert rows and all(r["passed"] for r in rows), rows

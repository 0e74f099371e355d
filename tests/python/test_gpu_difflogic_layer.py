"""The layer ops' feature-major kernels from Python, each config by name (issue 30 Speed): lanes 0 (the flat
kernels) and 4, 8, 16 (the batch-tiled ones; kspec.nn.LogicLayer's default is 8) through kspec.call with
config=, fp32 / fp16 / bf16, B = 1, 33 (rows not 16-byte aligned: scalar accesses) and 1032 (aligned, a
partial last tile), self-paired gates and an unread input, against the float64 reference; two runs bitwise
equal. The GoogleTest twin with more shapes: tests/cpp/test_difflogic.cpp DiffLogicGpuTiled."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec._core import call  # noqa: E402
from kspec._difflogic import consumers  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402

pytestmark = pytest.mark.gpu

# fwd, bwd bounds (max|got - ref| / max|ref|): fp32 issue 30's 1e-4; halves their rounding of y and dx
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1e-2, 2e-2)}


def _err(got, want):
    got = got.detach().double().cpu().numpy()
    assert got.shape == np.shape(want) and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _fm(t):
    """The same values as a (B, n) view of a contiguous (n, B) tensor."""
    return t.t().contiguous().t()


@pytest.mark.parametrize("lanes", [0, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,n_in,n_out", [(1, 7, 33), (33, 65, 1000), (1032, 300, 257)])
def test_feature_major_config_matches_reference(lanes, dtype, B, n_in, n_out):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + n_in + lanes)
    x = torch.rand(B, n_in, device="cuda", generator=g).to(dtype)
    logits = torch.randn(n_out, 16, device="cuda", generator=g) * 1.5
    a = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g, dtype=torch.int32)  # n_in - 1 unread
    b = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g, dtype=torch.int32)
    b[::3] = a[::3]  # self-paired gates
    dy = torch.randn(B, n_out, device="cuda", generator=g).to(dtype)
    csr = consumers(n_in, a, b)
    config = f"threads=256,lanes={lanes}"
    xf, dyf = _fm(x), _fm(dy)

    def fwd():
        y = torch.empty(n_out, B, dtype=dtype, device="cuda").t()
        return call("difflogic.layer.fwd", xf, logits, a, b, layout="feature_major", config=config, out=(y,))[0]

    def bwd():
        dx = torch.empty(n_in, B, dtype=dtype, device="cuda").t()
        return call("difflogic.layer.bwd", xf, logits, a, b, dyf, csr, grad_factor=0.5, layout="feature_major",
                    config=config, out=(dx, torch.empty_like(logits)))

    xs, lg, wa, wb = x.double().cpu().numpy(), logits.double().cpu().numpy(), a.cpu().numpy(), b.cpu().numpy()
    want_dx, want_dl = dl_ref.layer_bwd(dy.double().cpu().numpy(), xs, lg, wa, wb, 0.5)
    fwd_tol, bwd_tol = TOL[dtype]
    y = fwd()
    assert _err(y, dl_ref.layer_fwd(xs, lg, wa, wb)) <= fwd_tol
    dx, dl = bwd()
    assert _err(dx, want_dx) <= bwd_tol and _err(dl, want_dl) <= bwd_tol
    assert torch.all(dx[:, n_in - 1] == 0)
    dx2, dl2 = bwd()
    assert torch.equal(fwd(), y) and torch.equal(dx2, dx) and torch.equal(dl2, dl)  # no atomics: the same bits


def test_row_major_refuses_the_tiled_kernels():
    """lanes > 0 needs layout feature_major: a clear error naming the axis, not a wrong answer."""
    x = torch.rand(4, 8, device="cuda")
    logits = torch.zeros(8, 16, device="cuda")
    a = torch.arange(8, device="cuda", dtype=torch.int32)
    with pytest.raises(kspec.InvalidArgument, match="lanes"):
        call("difflogic.layer.fwd", x, logits, a, a, config="threads=256,lanes=8")

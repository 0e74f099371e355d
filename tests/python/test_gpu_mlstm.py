"""mlstm on the GPU through kspec.call: the named regression fp16_S64_seed0 of issue 29 (the recipe that
gave a user's CUDA mLSTM a NaN at S = 64 from the order of a rescale), forward and backward of the
chunkwise and the parallel form against the float64 reference of the same fp16 inputs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import mlstm as ref  # noqa: E402

pytestmark = pytest.mark.gpu


def _np(t):
    return t.detach().double().cpu().numpy()


def _rel_max(out, want):
    out = _np(out)
    assert np.all(np.isfinite(out)), "non-finite values"
    return float(np.abs(out - want).max() / np.abs(want).max())


def _seed0_inputs():
    """B = NH = 1, S = 64, DH = 32; torch.manual_seed(0); q, k, v, i, f, dh = randn on CUDA in that
    order, cast to fp16 (issue 29's recipe, exactly)."""
    torch.manual_seed(0)
    B, NH, S, DH = 1, 1, 64, 32
    q, k, v = (torch.randn(B, NH, S, DH, device="cuda") for _ in range(3))
    i, f = (torch.randn(B, NH, S, device="cuda") for _ in range(2))
    dh = torch.randn(B, NH, S, DH, device="cuda")
    return [t.half() for t in (q, k, v, i, f, dh)]


def _nan_like(t, dtype=None):
    return torch.full_like(t, float("nan"), dtype=dtype)


@pytest.mark.parametrize("form", ["chunkwise", "parallel"])
def test_fp16_S64_seed0(form):
    q, k, v, i, f, dh = _seed0_inputs()
    rows = _nan_like(i, torch.float32)
    h, nrm, m_rows = _nan_like(v), rows.clone(), rows.clone()
    if form == "chunkwise":
        kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, None, None, None,
                   out=(h, nrm, m_rows, None, None, None), chunk=64)
    else:
        kspec.call("mlstm.parallel.fwd", q, k, v, i, f, out=(h, nrm, m_rows))
    grads = [_nan_like(q), _nan_like(k), _nan_like(v), _nan_like(i), _nan_like(f)]
    if form == "chunkwise":
        kspec.call("mlstm.chunkwise.bwd", q, k, v, i, f, None, None, nrm, m_rows, dh, None,
                   out=(*grads, None), chunk=64)
    else:
        kspec.call("mlstm.parallel.bwd", q, k, v, i, f, nrm, m_rows, dh, out=tuple(grads))
    torch.cuda.synchronize()
    x = [_np(t) for t in (q, k, v, i, f)]
    if form == "chunkwise":
        want_h, want_nrm, want_m, _ = ref.mlstm_chunkwise_fwd(*x, chunk=64)
        want = ref.mlstm_chunkwise_bwd(_np(dh), *x, chunk=64)
    else:
        want_h, want_nrm, want_m = ref.mlstm_parallel_fwd(*x)
        want = ref.mlstm_parallel_bwd(_np(dh), *x)
    assert _rel_max(h, want_h) <= 3e-3  # the fp16 forward tolerance
    assert _rel_max(nrm, want_nrm) <= 1e-4 and _rel_max(m_rows, want_m) <= 1e-4  # fp32 in the kernels
    for name, g in zip(("dq", "dk", "dv", "di", "df"), grads):
        assert _rel_max(g, want[name]) <= 1e-2, name  # the fp16 gradient tolerance

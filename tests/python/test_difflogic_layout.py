"""The logic layer's layouts without a GPU (issue 30 Speed): a row-major x is transposed once to the
feature-major layout (difflogic.transpose) and runs the feature-major ops, y comes back feature-major, a
row-major dy is transposed once and dx comes back row-major (x's layout: layer.bwd's dx_layout row_major);
feature-major x and chains of layers (with a torch op between them) transpose nothing more;
row_major="direct" and B = 1 keep the row-major ops.
The ops are stood in for by the float64 references on CPU (a kspec.call that checks the layout param against
every activation's strides, as the ops' check_call does, and counts the calls), so the layout plumbing and the
gradients are checked exactly; the kernels themselves: test_gpu_difflogic_layer.py."""
import collections

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _difflogic  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402

CALLS = collections.Counter()


def _layout_ok(t, layout):
    """check_call's rule: row_major contiguous, feature_major strides (1, batch); a size-1 dim is free."""
    want = (1, t.shape[0]) if layout == "feature_major" else (t.shape[1], 1)
    return all(t.shape[d] == 1 or t.stride(d) == want[d] for d in range(2))


def _np(t):
    return t.detach().double().cpu().numpy()


def reference_call(op, *args, out=None, **params):
    """kspec.call on CPU: the float64 references, written into out= (or a row-major result)."""
    CALLS[op] += 1
    if op == "difflogic.transpose":
        (x,) = args
        assert x.is_contiguous()
        return (x.t().contiguous(),)
    layout = params.get("layout", "row_major")
    x, logits, a, b = args[:4]
    acts = [(x, layout)] + ([(args[4], layout)] if op == "difflogic.layer.bwd" else [])
    if out is not None:  # y, or dx (row-major under dx_layout row_major)
        acts.append((out[0], "row_major" if params.get("dx_layout") == "row_major" else layout))
    for t, want in acts:
        assert _layout_ok(t, want), (op, want, t.shape, t.stride())
    if op == "difflogic.layer.fwd":
        y = dl_ref.layer_fwd(_np(x), _np(logits), a.numpy(), b.numpy(), hard=params["mode"] == "hard")
        xt = x.t().contiguous() if params.get("save_xt") else None  # row-major x only (the op checks)
        assert xt is None or layout == "row_major"
        CALLS["save_xt"] += xt is not None
        res = (torch.from_numpy(y).to(x.dtype).contiguous(), xt)
    else:
        assert op == "difflogic.layer.bwd"
        dx, dl = dl_ref.layer_bwd(_np(args[4]), _np(x), _np(logits), a.numpy(), b.numpy(), params["grad_factor"])
        res = (torch.from_numpy(dx).to(x.dtype).contiguous(), torch.from_numpy(dl).float().contiguous())
    if out is None:
        return res
    for o, r in zip(out, res):
        if o is not None:
            o.copy_(r)
    return tuple(out)


@pytest.fixture(autouse=True)
def on_reference(monkeypatch):
    monkeypatch.setattr(_difflogic, "call", reference_call)
    CALLS.clear()


def _wiring(g, n_in, n_out):
    a = torch.randint(0, n_in, (n_out,), generator=g)
    b = torch.randint(0, n_in, (n_out,), generator=g)
    b[::3] = a[::3]  # self-paired gates
    return a, b


def _layer(x, logits, a, b, **kw):
    return kspec.ops.logic_layer(x, logits, a, b, grad_factor=1.5, **kw)


@pytest.mark.parametrize("B,n_in,n_out", [(5, 7, 9), (33, 4, 64)])
def test_row_major_x_runs_feature_major_once(B, n_in, n_out):
    g = torch.Generator().manual_seed(B)
    x = torch.rand(B, n_in, generator=g, dtype=torch.float64)
    logits = torch.randn(n_out, 16, generator=g, dtype=torch.float64).float()
    a, b = _wiring(g, n_in, n_out)
    dy = torch.randn(B, n_out, generator=g, dtype=torch.float64)
    xl, ll = x.float().requires_grad_(), logits.clone().requires_grad_()
    y = _layer(xl, ll, a, b)
    assert _difflogic.feature_major(y) and CALLS["difflogic.transpose"] == 1
    y.backward(dy.float())  # a row-major dy: transposed once; dx written row-major by the backward op
    assert CALLS["difflogic.transpose"] == 2 and CALLS["difflogic.layer.bwd"] == 1
    assert xl.grad.is_contiguous()  # x's layout
    want_dx, want_dl = dl_ref.layer_bwd(_np(dy.float()), _np(x.float()), _np(logits), a.numpy(), b.numpy(), 1.5)
    want_y = dl_ref.layer_fwd(_np(x.float()), _np(logits), a.numpy(), b.numpy())
    assert np.allclose(_np(y), want_y, rtol=1e-6, atol=1e-6)
    assert np.allclose(_np(xl.grad), want_dx, rtol=1e-5, atol=1e-6)
    assert np.allclose(_np(ll.grad), want_dl, rtol=1e-5, atol=1e-6)
    # the row-major ops (row_major="direct"): the same values, y row-major, no transposes
    CALLS.clear()
    xd, ld = x.float().requires_grad_(), logits.clone().requires_grad_()
    yd = _layer(xd, ld, a, b, row_major="direct")
    yd.backward(dy.float())
    assert yd.is_contiguous() and CALLS["difflogic.transpose"] == 0
    assert torch.equal(yd, y) and torch.equal(xd.grad, xl.grad) and torch.equal(ld.grad, ll.grad)


def test_feature_major_x_and_dy_transpose_nothing():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 5, generator=g).t().contiguous().t().requires_grad_()
    logits = torch.randn(8, 16, generator=g)
    a, b = _wiring(g, 5, 8)
    y = _layer(x, logits, a, b, row_major="transpose")
    dy = torch.randn(8, 6, generator=g).t()  # feature-major, as a following layer's dx comes
    y.backward(dy)
    assert CALLS["difflogic.transpose"] == 0
    assert _difflogic.feature_major(y) and _difflogic.feature_major(x.grad)


def test_expanded_dy_and_single_sample():
    """sum().backward() gives an expanded dy (torch's copy, not the transpose op); B = 1 (both layouts at
    once) keeps the row-major ops."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4, 6, generator=g).requires_grad_()
    logits = torch.randn(5, 16, generator=g)
    a, b = _wiring(g, 6, 5)
    _layer(x, logits, a, b).sum().backward()
    assert CALLS["difflogic.transpose"] == 1  # x alone: dx comes row-major
    want_dx, _ = dl_ref.layer_bwd(np.ones((4, 5)), _np(x), _np(logits), a.numpy(), b.numpy(), 1.5)
    assert np.allclose(_np(x.grad), want_dx, rtol=1e-5, atol=1e-6) and x.grad.is_contiguous()
    CALLS.clear()
    one = torch.rand(1, 6, generator=g)
    assert _layer(one, logits, a, b).is_contiguous() and CALLS["difflogic.transpose"] == 0


def test_chain_of_layers_transposes_once_each_way():
    """Row-major input -> LogicLayer -> a torch op -> LogicLayer -> LogicLayer: one transpose forward (the first
    layer's x), one backward (the loss's row-major dy at the last layer; the first layer's dx comes out
    row-major); every value
    and gradient equal to the same chain on the row-major ops."""
    def chain(row_major):
        torch.manual_seed(0)
        layers = [kspec.nn.LogicLayer(n_in, n_out, device="cpu", row_major=row_major)
                  for n_in, n_out in ((7, 9), (9, 6), (6, 6))]
        return layers

    g = torch.Generator().manual_seed(3)
    x = torch.rand(10, 7, generator=g)
    dy = torch.randn(10, 6, generator=g)
    results = {}
    for row_major in ("auto", "direct"):
        CALLS.clear()
        layers = chain(row_major)
        xl = x.clone().requires_grad_()
        h = layers[0](xl)
        h = layers[2](layers[1](h * 0.5 + 0.25))
        h.backward(dy)
        results[row_major] = (h, xl.grad, [m.weights.grad for m in layers], CALLS["difflogic.transpose"],
                              _difflogic.feature_major(h))
    h, dx, dw, transposes, fm = results["auto"]
    assert transposes == 2 and fm and dx.is_contiguous()
    hd, dxd, dwd, transposes_d, fm_d = results["direct"]
    assert transposes_d == 0 and not fm_d
    assert torch.equal(h, hd) and torch.equal(dx, dxd) and all(torch.equal(p, q) for p, q in zip(dw, dwd))


def test_row_major_option_is_checked():
    x, logits = torch.rand(2, 3), torch.zeros(2, 16)
    a = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="row_major"):
        kspec.ops.logic_layer(x, logits, a, a, row_major="sometimes")
    with pytest.raises(ValueError, match="row_major"):
        kspec.nn.LogicLayer(3, 2, device="cpu", row_major="never")
    assert _difflogic.transposes(x) and _difflogic.transposes(x, "transpose")
    assert not _difflogic.transposes(x, "direct") and not _difflogic.transposes(x.t().contiguous().t())


@pytest.mark.parametrize("fits", [True, False])
def test_no_grad_row_major_x_reads_x_once_where_staging_pays(monkeypatch, fits):
    """Without a gradient (torch.no_grad, or nothing requiring grad) "auto" runs the row-major forward op (its
    staged kernel reads x once) where enough rows of x fit in shared memory (stage_pays): no transpose, y
    row-major; elsewhere the transpose path as in training. The same values either way."""
    monkeypatch.setattr(_difflogic, "stage_pays", lambda x: fits)
    g = torch.Generator().manual_seed(6)
    x = torch.rand(9, 7, generator=g)
    logits = torch.randn(12, 16, generator=g).requires_grad_()
    a, b = _wiring(g, 7, 12)
    with torch.no_grad():
        y = _layer(x, logits, a, b, mode="hard")
    assert CALLS["difflogic.transpose"] == (0 if fits else 1)
    assert y.is_contiguous() if fits else _difflogic.feature_major(y)
    want = dl_ref.layer_fwd(_np(x), _np(logits), a.numpy(), b.numpy(), hard=True)
    assert np.allclose(_np(y), want, rtol=1e-6, atol=1e-6)
    CALLS.clear()
    y2 = _layer(x, logits.detach(), a, b, mode="hard")  # grad enabled, nothing requires it
    assert CALLS["difflogic.transpose"] == (0 if fits else 1) and torch.equal(y2, y)
    CALLS.clear()
    _layer(x, logits, a, b)  # logits require grad: training, transposed as before
    assert CALLS["difflogic.transpose"] == 1


def test_staged_option_writes_xt_in_the_forward(monkeypatch):
    """row_major="staged" in training: the forward reads the row-major x (no transpose, y row-major) and writes x
    transposed beside y (save_xt), which the backward reads: it transposes the row-major dy alone and writes dx
    row-major; values and gradients equal to "auto"'s."""
    monkeypatch.setattr(_difflogic, "stage_pays", lambda x: True)
    g = torch.Generator().manual_seed(7)
    x = torch.rand(11, 6, generator=g)
    logits = torch.randn(10, 16, generator=g)
    a, b = _wiring(g, 6, 10)
    dy = torch.randn(11, 10, generator=g)
    out = {}
    for row_major in ("staged", "auto"):
        CALLS.clear()
        xl, ll = x.clone().requires_grad_(), logits.clone().requires_grad_()
        y = _layer(xl, ll, a, b, row_major=row_major)
        fwd_transposes = CALLS["difflogic.transpose"]
        y.backward(dy)
        out[row_major] = (y, xl.grad, ll.grad, fwd_transposes, CALLS["difflogic.transpose"], CALLS["save_xt"])
    y, dx, dl, fwd_t, all_t, xts = out["staged"]
    assert y.is_contiguous() and fwd_t == 0 and all_t == 1 and dx.is_contiguous() and xts == 1
    ya, dxa, dla, fwd_ta, all_ta, xts_a = out["auto"]
    assert fwd_ta == 1 and all_ta == 2 and xts_a == 0
    assert torch.equal(y, ya) and torch.equal(dx, dxa) and torch.equal(dl, dla)
    want_dx, want_dl = dl_ref.layer_bwd(_np(dy), _np(x), _np(logits), a.numpy(), b.numpy(), 1.5)
    assert np.allclose(_np(dx), want_dx, rtol=1e-5, atol=1e-6) and np.allclose(_np(dl), want_dl, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no gradient: the row-major forward alone
        CALLS.clear()
        assert _layer(x, logits, a, b, row_major="staged").is_contiguous() and CALLS["difflogic.transpose"] == 0


def test_staging_pays_from_8_bytes_a_pass():
    """stage_pays's rule on the H100's 227 KB: 16k fp32 (3 rows a pass) and 16k bf16 (7) stage; 32k fp32 and 64k
    bf16 (1 row: 24 B of a gate's wires and T a pass against 4 or 2 B of output) and 64k fp32 (no row) take the
    transpose; tiny widths stage (8 rows)."""
    h100 = 232448
    assert _difflogic.staged_pass_pays(16000, 4, h100) and _difflogic.staged_pass_pays(16000, 2, h100)
    assert not _difflogic.staged_pass_pays(32000, 4, h100) and not _difflogic.staged_pass_pays(64000, 2, h100)
    assert not _difflogic.staged_pass_pays(64000, 4, h100)
    assert _difflogic.staged_pass_pays(1, 4, h100) and _difflogic.staged_pass_pays(7, 2, h100)
    assert not _difflogic.stage_pays(torch.rand(4, 16))  # not on a GPU


def test_staged_option_is_auto_where_staging_does_not_pay(monkeypatch):
    """row_major="staged" where no rows pay (64k fp32 has none: the op would run its flat gather) is "auto": the
    transpose path, y feature-major."""
    monkeypatch.setattr(_difflogic, "stage_pays", lambda x: False)
    g = torch.Generator().manual_seed(8)
    x = torch.rand(5, 6, generator=g).requires_grad_()
    logits = torch.randn(7, 16, generator=g)
    a, b = _wiring(g, 6, 7)
    y = _layer(x, logits, a, b, row_major="staged")
    assert _difflogic.feature_major(y) and CALLS["difflogic.transpose"] == 1
    with torch.no_grad():
        assert _difflogic.feature_major(_layer(x, logits, a, b, row_major="staged"))


@pytest.mark.parametrize("hybrid", [True, False])
def test_no_grad_hybrid_forward_where_staging_does_not_pay(monkeypatch, hybrid):
    """With HYBRID_IN_AUTO (off until the H100 times it), "auto" without a gradient where staging does not pay
    runs the row-major forward op at config stage 8 (the hybrid kernel: x read once, y row-major, no transpose);
    with it off, the transpose path. Training, and x where staging pays, are unchanged; the same values."""
    monkeypatch.setattr(_difflogic, "stage_pays", lambda x: False)
    monkeypatch.setattr(_difflogic, "HYBRID_IN_AUTO", hybrid)
    configs = []

    def recording_call(op, *args, **params):
        configs.append((op, params.get("config")))
        return reference_call(op, *args, **params)

    monkeypatch.setattr(_difflogic, "call", recording_call)
    g = torch.Generator().manual_seed(9)
    x = torch.rand(9, 7, generator=g)
    logits = torch.randn(12, 16, generator=g).requires_grad_()
    a, b = _wiring(g, 7, 12)
    with torch.no_grad():
        y = _layer(x, logits, a, b)
    assert CALLS["difflogic.transpose"] == (0 if hybrid else 1)
    assert (("difflogic.layer.fwd", _difflogic.HYBRID_FWD_CONFIG) in configs) == hybrid
    assert y.is_contiguous() if hybrid else _difflogic.feature_major(y)
    want = dl_ref.layer_fwd(_np(x), _np(logits), a.numpy(), b.numpy())
    assert np.allclose(_np(y), want, rtol=1e-6, atol=1e-6)
    CALLS.clear()
    configs.clear()
    _layer(x, logits, a, b)  # training: the transpose path either way
    assert CALLS["difflogic.transpose"] == 1 and ("difflogic.layer.fwd", _difflogic.HYBRID_FWD_CONFIG) not in configs
    monkeypatch.setattr(_difflogic, "stage_pays", lambda x: True)
    CALLS.clear()
    configs.clear()
    with torch.no_grad():  # staging pays: the staged kernel's default config
        _layer(x, logits, a, b)
    assert CALLS["difflogic.transpose"] == 0 and ("difflogic.layer.fwd", _difflogic.HYBRID_FWD_CONFIG) not in configs

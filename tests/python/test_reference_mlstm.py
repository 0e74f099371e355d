"""Tests of the float64 NumPy mLSTM reference: the exact backward and the constant-(n, m) backward
against central differences (the latter of the forward with nrm and m frozen), chunkwise == recurrent
for several chunk lengths, parallel == recurrent up to eps e^m, two calls passing states == one call,
log-sigmoid accuracy, and pinned values shared with the C++ twin's test (tests/cpp/test_mlstm_reference.cpp)."""

from decimal import Decimal, getcontext

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


ref = load_reference("mlstm")

STEP = 1e-6


def _inputs(seed, B, NH, S, DK, DV, with_init, rng=None):
    rng = rng or np.random.default_rng(seed)
    x = dict(q=rng.normal(size=(B, NH, S, DK)), k=rng.normal(size=(B, NH, S, DK)),
             v=rng.normal(size=(B, NH, S, DV)), i=rng.normal(size=(B, NH, S)),
             f=rng.normal(size=(B, NH, S)) + 1.0)
    if with_init:
        x.update(C0=rng.normal(size=(B, NH, DK, DV)), n0=rng.normal(size=(B, NH, DK)),
                 m0=rng.normal(size=(B, NH)))
    return x, rng


def _frozen_fwd(q, k, v, i, f, nrm, m, C0=None, m0=None, eps=ref.EPS):
    """The forward with the per-step nrm, m given (the function whose gradient the default backward is):
    C_t = e^(a_t + m_(t-1) - m_t) C_(t-1) + e^(i_t - m_t) k_t v_t^T, h_t = (s q_t)^T C_t / (nrm_t + eps)."""
    B, NH, S, DK = q.shape
    a = ref.logsigmoid(f)
    C = np.zeros((B, NH, DK, v.shape[3])) if C0 is None else C0
    m_prev = np.zeros((B, NH)) if m0 is None else m0
    h = np.empty(v.shape)
    for t in range(S):
        C = (np.exp(a[..., t] + m_prev - m[..., t])[..., None, None] * C
             + np.exp(i[..., t] - m[..., t])[..., None, None] * np.einsum("bhd,bhe->bhde", k[:, :, t], v[:, :, t]))
        h[:, :, t] = np.einsum("bhd,bhde->bhe", q[:, :, t] * DK ** -0.5, C) / (nrm[..., t] + eps)[..., None]
        m_prev = m[..., t]
    return h, C


@pytest.mark.parametrize("S,with_init,with_dC", [(1, False, False), (3, True, True), (4, False, True),
                                                 (5, True, False)])
def test_constant_nm_backward_matches_frozen_central_differences(S, with_init, with_dC):
    B, NH, DK, DV = 1, 2, 3, 2
    x, rng = _inputs(100 + S, B, NH, S, DK, DV, with_init)
    dh = rng.normal(size=(B, NH, S, DV))
    dC = rng.normal(size=(B, NH, DK, DV)) if with_dC else None
    _, nrm, m, _ = ref.mlstm_recurrent_fwd(**x)
    frozen = dict(x)
    frozen.pop("n0", None)

    def loss():
        h, C = _frozen_fwd(**frozen, nrm=nrm, m=m)
        return np.sum(dh * h) + (np.sum(dC * C) if with_dC else 0.0)

    g = ref.mlstm_recurrent_bwd(dh, **x, dC_last=dC)
    for L in (1, 2, 3, 64):
        gc = ref.mlstm_chunkwise_bwd(dh, **x, dC_last=dC, chunk=L)
        for key in ref.GRAD_KEYS:
            if g[key] is None:
                assert gc[key] is None
            else:
                np.testing.assert_allclose(gc[key], g[key], rtol=1e-10, atol=1e-12, err_msg=f"{key} L={L}")
    for name in ("q", "k", "v", "i", "f", "C0"):
        if name not in x:
            assert g["d" + name] is None
            continue
        assert_grad_close(g["d" + name], central_diff(loss, x[name], STEP), 1e-9, "d" + name)
    if with_init:
        assert not g["dn0"].any() and not g["dm0"].any()


@pytest.mark.parametrize("S,with_init,with_dlast", [(1, True, True), (2, False, False), (4, True, True),
                                                    (5, True, False)])
def test_exact_backward_matches_central_differences(S, with_init, with_dlast):
    B, NH, DK, DV = 1, 2, 3, 2
    x, rng = _inputs(200 + S, B, NH, S, DK, DV, with_init)
    # A large eps makes the e^m term (all the exact gradient adds through m) visible to the check.
    eps = 0.3
    dh = rng.normal(size=(B, NH, S, DV))
    up = dict(dC_last=rng.normal(size=(B, NH, DK, DV)), dn_last=rng.normal(size=(B, NH, DK)),
              dm_last=rng.normal(size=(B, NH))) if with_dlast else {}

    def loss():
        h, _, _, (C, n, m) = ref.mlstm_recurrent_fwd(**x, eps=eps)
        total = np.sum(dh * h)
        if with_dlast:
            total += np.sum(up["dC_last"] * C) + np.sum(up["dn_last"] * n) + np.sum(up["dm_last"] * m)
        return total

    g = ref.mlstm_recurrent_bwd(dh, **x, **up, exact=True, eps=eps)
    for name in ("q", "k", "v", "i", "f", "C0", "n0", "m0"):
        if name not in x:
            assert g["d" + name] is None
            continue
        assert_grad_close(g["d" + name], central_diff(loss, x[name], STEP), 1e-9, "d" + name)


def test_parallel_backward_matches_frozen_central_differences():
    B, NH, S, DK, DV = 1, 2, 5, 3, 2
    x, rng = _inputs(300, B, NH, S, DK, DV, False)
    dh = rng.normal(size=(B, NH, S, DV))
    _, nrm, m = ref.mlstm_parallel_fwd(**x)

    def loss():
        h, _ = _frozen_fwd(**x, nrm=nrm, m=m, m0=np.full((B, NH), -np.inf))
        return np.sum(dh * h)

    g = ref.mlstm_parallel_bwd(dh, **x)
    for name in ("q", "k", "v", "i", "f"):
        assert_grad_close(g["d" + name], central_diff(loss, x[name], STEP), 1e-9, "d" + name)


@pytest.mark.parametrize("S", [1, 2, 7, 16, 17])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunkwise_equals_recurrent(S, with_init):
    x, _ = _inputs(400 + S, 2, 2, S, 4, 3, with_init)
    want = ref.mlstm_recurrent_fwd(**x)
    for L in (1, 2, 3, 4, 5, 16, 64):
        got = ref.mlstm_chunkwise_fwd(**x, chunk=L)
        for a, b in zip(got[:3] + got[3], want[:3] + want[3]):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13, err_msg=f"L={L}")


def test_parallel_equals_recurrent_up_to_eps_e_m():
    """h e^m (nrm e^m + eps e^m) is the same in both forms (m differs: the recurrence's m0 = 0 term), so
    with eps = 0 they agree, and with eps the difference is eps e^m / (nrm e^m)-small."""
    x, _ = _inputs(500, 2, 3, 33, 4, 5, False)
    h_p, _, _ = ref.mlstm_parallel_fwd(**x, eps=0.0)
    h_r, _, m_r, _ = ref.mlstm_recurrent_fwd(**x, eps=0.0)
    np.testing.assert_allclose(h_p, h_r, rtol=1e-11, atol=1e-13)
    eps = 0.1  # large, so the eps e^m difference is far above rounding
    h_p, nrm_p, m_p = ref.mlstm_parallel_fwd(**x, eps=eps)
    h_r, nrm_r, m_r, _ = ref.mlstm_recurrent_fwd(**x, eps=eps)
    assert np.all(m_r >= m_p - 1e-12)
    np.testing.assert_allclose(nrm_p * np.exp(m_p), nrm_r * np.exp(m_r), rtol=1e-11)
    # h = N / (X + eps e^m) with N and X = nrm e^m shared: |h_p - h_r| <= |h_r| eps |e^m_r - e^m_p| / X.
    scale = eps * np.abs(np.exp(m_r) - np.exp(m_p)) / (nrm_r * np.exp(m_r))
    diff = np.abs(h_p - h_r)
    assert np.all(diff <= np.abs(h_r) * scale[..., None] + 1e-13 * np.abs(h_r).max())
    assert diff.max() > 1e-6
    dh = np.random.default_rng(5).normal(size=h_r.shape)
    gp = ref.mlstm_parallel_bwd(dh, **x, eps=0.0)
    gr = ref.mlstm_recurrent_bwd(dh, **x, eps=0.0)
    for key in ("dq", "dk", "dv", "di", "df"):
        np.testing.assert_allclose(gp[key], gr[key], rtol=1e-10, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("split", [1, 5, 9])
def test_two_calls_passing_states_equal_one(split):
    S = 10
    x, rng = _inputs(600 + split, 2, 2, S, 3, 4, True)
    dh = rng.normal(size=(2, 2, S, 4))
    dC = rng.normal(size=(2, 2, 3, 4))
    h, nrm, m, (C, n, mm) = ref.mlstm_chunkwise_fwd(**x, chunk=4)
    first = {key: (val[:, :, :split] if val.ndim >= 3 and key not in ("C0", "n0") else val) for key, val in x.items()}
    second = {key: val[:, :, split:] for key, val in x.items() if key in ("q", "k", "v", "i", "f")}
    h1, _, _, (C1, n1, m1) = ref.mlstm_chunkwise_fwd(**first, chunk=4)
    h2, _, _, (C2, n2, m2) = ref.mlstm_chunkwise_fwd(**second, C0=C1, n0=n1, m0=m1, chunk=4)
    for a, b in ((np.concatenate([h1, h2], axis=2), h), (C2, C), (n2, n), (m2, mm)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    g = ref.mlstm_chunkwise_bwd(dh, **x, dC_last=dC, chunk=4)
    g2 = ref.mlstm_chunkwise_bwd(dh[:, :, split:], **second, C0=C1, n0=n1, m0=m1, dC_last=dC, chunk=4)
    g1 = ref.mlstm_chunkwise_bwd(dh[:, :, :split], **first, dC_last=g2["dC0"], chunk=4)
    for key in ("dq", "dk", "dv", "di", "df"):
        np.testing.assert_allclose(np.concatenate([g1[key], g2[key]], axis=2), g[key], rtol=1e-10, atol=1e-12,
                                   err_msg=key)
    np.testing.assert_allclose(g1["dC0"], g["dC0"], rtol=1e-10, atol=1e-12)


def test_dC_last_reaches_df():
    """The deliberate difference from mlstm_kernels: <dC_last, C_last> depends on every f."""
    x, rng = _inputs(700, 1, 1, 6, 3, 2, False)
    dh = np.zeros((1, 1, 6, 2))
    g = ref.mlstm_chunkwise_bwd(dh, **x, dC_last=rng.normal(size=(1, 1, 3, 2)), chunk=4)
    assert np.all(np.abs(g["df"][..., 1:]) > 0)


def _logsigmoid_exact(x):
    getcontext().prec = 50
    return float(-(Decimal(1) + (-Decimal(x)).exp()).ln())


def test_logsigmoid_accuracy():
    xs = np.linspace(-40.0, 40.0, 1601)
    got = ref.logsigmoid(xs)
    want = np.array([_logsigmoid_exact(x) for x in xs])
    np.testing.assert_allclose(got, want, rtol=4e-16, atol=0)
    assert np.all(np.isfinite(ref.logsigmoid(np.array([-1e4, 1e4]))))


def _formula(n, c, scale):
    """The inputs both references' pinned tests use: scale * sin(0.37 j + c), j = 0..n-1."""
    return scale * np.sin(0.37 * np.arange(n) + c)


def pinned_inputs():
    B, NH, S, DK, DV = 1, 2, 5, 3, 2
    return dict(q=_formula(B * NH * S * DK, 0.1, 1.0).reshape(B, NH, S, DK),
                k=_formula(B * NH * S * DK, 0.2, 1.0).reshape(B, NH, S, DK),
                v=_formula(B * NH * S * DV, 0.3, 1.0).reshape(B, NH, S, DV),
                i=_formula(B * NH * S, 0.4, 2.0).reshape(B, NH, S),
                f=_formula(B * NH * S, 0.5, 3.0).reshape(B, NH, S) + 1.0,
                C0=_formula(B * NH * DK * DV, 0.6, 1.0).reshape(B, NH, DK, DV),
                n0=_formula(B * NH * DK, 0.7, 1.0).reshape(B, NH, DK),
                m0=_formula(B * NH, 0.8, 1.0).reshape(B, NH))


# Also in tests/cpp/test_mlstm_reference.cpp: both references must give these numbers.
PINNED = dict(h_sum=0.43726196266025785, C_sum=2.6052150746786054, dq_sum=-0.33060256511663555,
              df_sum=-2.750880048091661)


def pinned_values():
    x = pinned_inputs()
    h, _, _, (C, _, _) = ref.mlstm_chunkwise_fwd(**x, chunk=2)
    dh = _formula(h.size, 0.9, 1.0).reshape(h.shape)
    dC = _formula(C.size, 1.0, 1.0).reshape(C.shape)
    g = ref.mlstm_chunkwise_bwd(dh, **x, dC_last=dC, chunk=2)
    w = lambda a: float(np.sum(a.ravel() * np.cos(np.arange(a.size))))  # noqa: E731  weighted: order matters
    return dict(h_sum=w(h), C_sum=w(C), dq_sum=w(g["dq"]), df_sum=w(g["df"]))


def test_pinned_values_shared_with_cpp():
    got = pinned_values()
    for key, want in PINNED.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key

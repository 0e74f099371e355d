"""Tests of the float64 NumPy mHC reference: the backward of the pre op, the post op and Sinkhorn-Knopp
against central finite differences of their forwards (n, D, T, t_max 1 and 20, each upstream gradient
alone), R doubly stochastic at eps = 0, and values pinned on closed-form inputs that the C++ twin's test
(tests/cpp/test_mhc_reference.cpp) pins to the same numbers, so both references agree."""

import itertools

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


ref = load_reference("mhc")

STEP = 1e-6
EPS = {"eps_rms": 1e-6, "eps_pre": 1e-6, "eps_sk": 1e-6}


def _nonzero(rng, shape, lo, hi):
    """Uniform in +-[lo, hi]: random signs, magnitudes bounded away from zero."""
    return rng.uniform(lo, hi, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def _pre_inputs(rng, T, n, D, pre_only, with_gamma):
    M = ref.proj_rows(n, pre_only)
    return {
        "x": _nonzero(rng, (T, n, D), 0.1, 1.5),
        "phi": _nonzero(rng, (M, n * D), 0.05, 0.6),
        "alpha": _nonzero(rng, (1,) if pre_only else (3,), 0.3, 1.2),
        "bias": _nonzero(rng, (M,), 0.05, 0.8),
        "gamma": _nonzero(rng, (n * D,), 0.5, 1.5) if with_gamma else None,
    }


def _check_grads(loss, grads, params, fd_noise):
    for name, value in params.items():
        if value is None:
            assert grads["d" + name] is None, name
            continue
        assert grads["d" + name].shape == value.shape, name
        assert_grad_close(grads["d" + name], central_diff(loss, value, STEP), fd_noise, "d" + name)


PRE_CASES = [  # T, n, D, t_max, pre_only, gamma, upstream grads given
    (3, 2, 3, 20, False, True, ("dy", "dh_pre", "dh_post", "dr", "dx_post")),
    (2, 3, 2, 1, False, True, ("dy", "dh_pre", "dh_post", "dr")),
    (1, 4, 3, 20, False, False, ("dy", "dh_post", "dr")),
    (2, 1, 5, 20, False, True, ("dy", "dr")),
    (2, 2, 4, 3, True, True, ("dy", "dh_pre", "dx_post")),
    (1, 3, 1, 20, True, False, ("dy",)),
] + [(2, 2, 3, 20, False, True, ("dy",) + (alone,)) for alone in ("dh_pre", "dh_post", "dr", "dx_post")]


@pytest.mark.parametrize("T,n,D,t_max,pre_only,with_gamma,given", PRE_CASES)
def test_pre_backward_matches_central_differences(T, n, D, t_max, pre_only, with_gamma, given):
    rng = np.random.default_rng(T * 1000 + n * 100 + D * 10 + t_max + 7 * pre_only + len(given))
    p = _pre_inputs(rng, T, n, D, pre_only, with_gamma)
    up = {"dy": _nonzero(rng, (T, D), 0.1, 1.0), "dh_pre": _nonzero(rng, (T, n), 0.1, 1.0),
          "dh_post": _nonzero(rng, (T, n), 0.1, 1.0), "dr": _nonzero(rng, (T, n, n), 0.1, 1.0),
          "dx_post": _nonzero(rng, (T, n, D), 0.1, 1.0)}
    up = {k: (v if k in given else None) for k, v in up.items()}
    kw = dict(EPS, pre_only=pre_only, t_max=t_max)

    def loss():
        o = ref.mhc_pre_fwd(**p, **kw)
        total = np.sum(up["dy"] * o["y"])
        for name, out in (("dh_pre", "h_pre"), ("dh_post", "h_post"), ("dr", "r")):
            if up[name] is not None:
                total += np.sum(up[name] * o[out])
        if up["dx_post"] is not None:
            total += np.sum(up["dx_post"] * p["x"])  # dx_post enters dx as the gradient of <dx_post, x>
        return total

    grads = ref.mhc_pre_bwd(up["dy"], **p, dh_pre=up["dh_pre"], dh_post=up["dh_post"], dr=up["dr"],
                            dx_post=up["dx_post"], **kw)
    _check_grads(loss, grads, p, 1e-9 * (1.0 + abs(loss())))


@pytest.mark.parametrize("T,n,D", [(1, 1, 1), (2, 3, 4), (3, 4, 5)])
def test_post_backward_matches_central_differences(T, n, D):
    rng = np.random.default_rng(100 + T * 10 + n)
    p = {"x": _nonzero(rng, (T, n, D), 0.1, 1.5), "f": _nonzero(rng, (T, D), 0.1, 1.5),
         "h_post": _nonzero(rng, (T, n), 0.1, 2.0), "r": _nonzero(rng, (T, n, n), 0.05, 1.0)}
    dout = _nonzero(rng, (T, n, D), 0.1, 1.0)
    grads = ref.mhc_post_bwd(dout, **p)
    grads = {"dx": grads["dx"], "df": grads["df"], "dh_post": grads["dh_post"], "dr": grads["dr"]}
    _check_grads(lambda: np.sum(dout * ref.mhc_post_fwd(**p)), grads, p, 1e-9)


@pytest.mark.parametrize("n,t_max,eps,scale", list(itertools.product((1, 3, 4, 8), (1, 20), (0.0, 1e-6), (1.0, 30.0))))
def test_sinkhorn_backward_matches_central_differences(n, t_max, eps, scale):
    """Logits up to +-30 (saturated softmax rows) stay finite, and the gradient exact."""
    rng = np.random.default_rng(n * 100 + t_max + int(scale))
    z = rng.uniform(-scale, scale, (2, n, n))
    dR = _nonzero(rng, (2, n, n), 0.1, 1.0)
    r = ref.sinkhorn_fwd(z, t_max, eps)
    assert np.all(np.isfinite(r))
    g = ref.sinkhorn_bwd(z, dR, t_max, eps)
    assert np.all(np.isfinite(g))
    # Saturated rows make the function steep: the step's rounding error scales with the loss.
    assert_grad_close(g, central_diff(lambda: np.sum(dR * ref.sinkhorn_fwd(z, t_max, eps)), z, STEP),
                      1e-9 * (1.0 + np.abs(dR).sum()) * (30.0 if scale > 1 else 1.0), "dlogits")


@pytest.mark.parametrize("n,t_max", list(itertools.product((1, 2, 3, 4, 8), (1, 2, 20))))
def test_sinkhorn_eps0_columns_sum_to_one(n, t_max):
    """eps = 0 is the paper's Eq. 9 with H_res = R^T: every output stream is a convex combination."""
    z = np.random.default_rng(n + 10 * t_max).normal(0.0, 2.0, (5, n, n))
    r = ref.sinkhorn_fwd(z, t_max, 0.0)
    assert np.all(r >= 0)
    np.testing.assert_allclose(r.sum(axis=1), 1.0, rtol=0, atol=1e-14)
    # Rows only approach 1: more rounds, closer.
    row_err = np.abs(r.sum(axis=2) - 1.0).max()
    assert row_err <= np.abs(ref.sinkhorn_fwd(z, 1, 0.0).sum(axis=2) - 1.0).max() + 1e-15
    assert t_max < 20 or row_err < 0.05


def test_sinkhorn_t_max_1_is_softmax_then_column_normalization():
    z = np.random.default_rng(5).normal(size=(3, 4, 4))
    p = np.exp(z) / np.exp(z).sum(axis=2, keepdims=True)
    a = p + 1e-6
    np.testing.assert_allclose(ref.sinkhorn_fwd(z, 1, 1e-6), a / (a.sum(axis=1, keepdims=True) + 1e-6),
                               rtol=1e-14, atol=0)


def test_pre_only_matches_full_op_h_pre_and_y():
    """pre_only's M = n rows are the full op's first n rows with alpha[0]."""
    rng = np.random.default_rng(11)
    p = _pre_inputs(rng, 3, 4, 5, False, True)
    full = ref.mhc_pre_fwd(**p, **EPS)
    head = ref.mhc_pre_fwd(p["x"], p["phi"][:4], p["alpha"][:1], p["bias"][:4], p["gamma"], pre_only=True, **EPS)
    np.testing.assert_allclose(head["y"], full["y"], rtol=1e-14)
    np.testing.assert_allclose(head["h_pre"], full["h_pre"], rtol=1e-14)
    assert head["h_post"] is None and head["r"] is None


def test_plain_residual_initialisation():
    """phi = 0, alpha = 0.01, bias giving H_pre = 1/n, H_post = 1 and R ~ I: y is the stream mean and
    post(x, f) = f + x per stream (the initialisation the issue's HyperConnection uses)."""
    T, n, D = 2, 4, 3
    rng = np.random.default_rng(1)
    x = rng.normal(size=(T, n, D))
    b_pre = np.log((1.0 / n) / (1.0 - 1.0 / n))
    bias = np.concatenate([np.full(n, b_pre), np.zeros(n), (np.eye(n) * 40.0).ravel()])
    o = ref.mhc_pre_fwd(x, np.zeros((n * n + 2 * n, n * D)), np.full(3, 0.01), bias, eps_pre=0.0, eps_sk=0.0)
    np.testing.assert_allclose(o["y"], x.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(o["h_post"], 1.0, rtol=1e-15)
    np.testing.assert_allclose(o["r"], np.broadcast_to(np.eye(n), (T, n, n)), atol=1e-15)
    f = rng.normal(size=(T, D))
    np.testing.assert_allclose(ref.mhc_post_fwd(x, f, o["h_post"], o["r"]), x + f[:, None, :], atol=1e-14)


# ---- the values the C++ twin pins too ----

def closed_form(count, salt):
    """The inputs both references' tests build: sin(0.7 (i + 1) + salt) * 0.9, no RNG to port."""
    return 0.9 * np.sin(0.7 * (np.arange(count) + 1.0) + salt)


def checksum(a):
    """sum_i a_i * cos(0.3 i): one number that moves with every element (and its position)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    return float(np.sum(a * np.cos(0.3 * np.arange(a.size))))


def pinned_outputs(T=3, n=3, D=5, t_max=20):
    M = ref.proj_rows(n)
    x = closed_form(T * n * D, 0.0).reshape(T, n, D)
    phi = 0.3 * closed_form(M * n * D, 1.0).reshape(M, n * D)
    alpha = np.array([0.8, -0.6, 1.1])
    bias = 0.5 * closed_form(M, 2.0)
    gamma = 1.0 + 0.3 * closed_form(n * D, 3.0)
    dy = closed_form(T * D, 4.0).reshape(T, D)
    dh_pre = closed_form(T * n, 5.0).reshape(T, n)
    dh_post = closed_form(T * n, 6.0).reshape(T, n)
    dr = closed_form(T * n * n, 7.0).reshape(T, n, n)
    f = closed_form(T * D, 8.0).reshape(T, D)
    dout = closed_form(T * n * D, 9.0).reshape(T, n, D)
    o = ref.mhc_pre_fwd(x, phi, alpha, bias, gamma, t_max=t_max)
    g = ref.mhc_pre_bwd(dy, x, phi, alpha, bias, gamma, dh_pre=dh_pre, dh_post=dh_post, dr=dr, t_max=t_max)
    post = ref.mhc_post_fwd(x, f, o["h_post"], o["r"])
    pg = ref.mhc_post_bwd(dout, x, f, o["h_post"], o["r"])
    values = {k: checksum(o[k]) for k in ("y", "h_pre", "h_post", "r", "inv", "h")}
    values.update({k: checksum(g[k]) for k in ("dx", "dphi", "dalpha", "dbias", "dgamma")})
    values["out"] = checksum(post)
    values.update({"post_" + k: checksum(pg[k]) for k in ("dx", "df", "dh_post", "dr")})
    return values


# Printed by pinned_outputs(); the same numbers are in tests/cpp/test_mhc_reference.cpp.
PINNED = {
    "y": 3.017817788663582,
    "h_pre": 1.2060452877637107,
    "h_post": 2.0949119161888716,
    "r": 1.3300626882935802,
    "inv": 4.37085853963657,
    "h": -3.241566664675921,
    "dx": -0.7863426025632474,
    "dphi": -1.2150502707106994,
    "dalpha": -0.8625092874771964,
    "dbias": 0.005157388729150891,
    "dgamma": -0.15776035321579543,
    "out": 1.4418592359881426,
    "post_dx": 1.091260926556428,
    "post_df": -1.186236579516973,
    "post_dh_post": 1.080366588968266,
    "post_dr": -0.020640251053114844,
}


def test_pinned_values_shared_with_cpp():
    got = pinned_outputs()
    assert set(got) == set(PINNED)
    for k, v in PINNED.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-13), k

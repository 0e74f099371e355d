"""Tests of the float64 NumPy norm+activation reference: its backward against central finite
differences of its forward, its handling of leading dimensions, and its forward against known values."""

import itertools
import math

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


_ref = load_reference("norm_act")
ACTS, NORMS, norm_act_bwd, norm_act_fwd = _ref.ACTS, _ref.NORMS, _ref.norm_act_bwd, _ref.norm_act_fwd

EPS = 1e-5
STEP = 1e-5


def _nonzero(rng, shape, lo, hi):
    """Uniform in +-[lo, hi]: random signs, magnitudes bounded away from zero."""
    return rng.uniform(lo, hi, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def _inputs(seed, rows, hidden, has_bias):
    rng = np.random.default_rng(seed)
    x = _nonzero(rng, (rows, hidden), 0.1, 2.0)
    dy = _nonzero(rng, (rows, hidden), 0.1, 1.0)
    w = _nonzero(rng, (hidden,), 0.5, 1.5)
    b = _nonzero(rng, (hidden,), 0.1, 1.0) if has_bias else None
    return x, dy, w, b


@pytest.mark.parametrize(
    "norm,act,has_bias,hidden,rows",
    list(itertools.product(NORMS, ACTS, [False, True], [1, 7, 33], [1, 3])),
)
def test_backward_matches_central_differences(norm, act, has_bias, hidden, rows):
    x, dy, w, b = _inputs(hidden * 10 + rows, rows, hidden, has_bias)

    def loss():
        return float(np.sum(dy * norm_act_fwd(x, w, b, norm, act, EPS)[0]))

    dx, dw, db = norm_act_bwd(dy, x, w, b, norm, act, EPS)
    y = norm_act_fwd(x, w, b, norm, act, EPS)[0]
    fd_noise = 1e-10 * (1.0 + np.abs(dy * y).sum())
    assert_grad_close(dx, central_diff(loss, x, STEP), fd_noise, "dx")
    assert_grad_close(dw, central_diff(loss, w, STEP), fd_noise, "dw")
    if has_bias:
        assert_grad_close(db, central_diff(loss, b, STEP), fd_noise, "db")
    else:
        assert db is None


@pytest.mark.parametrize("norm,act", list(itertools.product(NORMS, ACTS)))
def test_leading_dims_flatten_like_rows(norm, act):
    rng = np.random.default_rng(7)
    shape = (2, 3, 5, 16)
    x = _nonzero(rng, shape, 0.1, 2.0)
    dy = _nonzero(rng, shape, 0.1, 1.0)
    w = _nonzero(rng, (16,), 0.5, 1.5)
    b = _nonzero(rng, (16,), 0.1, 1.0)

    y, mean, rstd = norm_act_fwd(x, w, b, norm, act, EPS)
    y2, mean2, rstd2 = norm_act_fwd(x.reshape(-1, 16), w, b, norm, act, EPS)
    assert y.shape == shape and mean.shape == shape[:-1] and rstd.shape == shape[:-1]
    np.testing.assert_array_equal(y.reshape(-1, 16), y2)
    np.testing.assert_array_equal(mean.reshape(-1), mean2)
    np.testing.assert_array_equal(rstd.reshape(-1), rstd2)

    dx, dw, db = norm_act_bwd(dy, x, w, b, norm, act, EPS)
    dx2, dw2, db2 = norm_act_bwd(dy.reshape(-1, 16), x.reshape(-1, 16), w, b, norm, act, EPS)
    assert dx.shape == shape and dw.shape == (16,) and db.shape == (16,)
    np.testing.assert_array_equal(dx.reshape(-1, 16), dx2)
    np.testing.assert_array_equal(dw, dw2)
    np.testing.assert_array_equal(db, db2)

    # One row alone gives the same row as in the batch: no statistic leaks across rows.
    y_row = norm_act_fwd(x[1, 2, 3], w, b, norm, act, EPS)[0]
    np.testing.assert_allclose(y_row, y[1, 2, 3], rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("hidden", [2, 7, 33, 4096])
def test_normalized_rows_have_unit_moments(hidden):
    rng = np.random.default_rng(hidden)
    x = 3.0 * _nonzero(rng, (3, hidden), 0.1, 2.0) + 50.0
    w = np.ones(hidden)
    y, mean, _ = norm_act_fwd(x, w, np.zeros(hidden), "layernorm", "identity", 0.0)
    np.testing.assert_allclose(y.mean(axis=1), 0.0, atol=1e-12)
    np.testing.assert_allclose((y * y).mean(axis=1), 1.0, rtol=1e-10)
    np.testing.assert_allclose(mean, x.mean(axis=1), rtol=1e-14)
    y, mean, _ = norm_act_fwd(x, w, None, "rmsnorm", "identity", 0.0)
    np.testing.assert_allclose((y * y).mean(axis=1), 1.0, rtol=1e-12)
    assert np.all(mean == 0.0)


def test_activation_values():
    # LayerNorm over one element gives xhat = 0, so y = act(b).
    expected = {
        "identity": 1.0,
        "silu": 1.0 / (1.0 + math.exp(-1.0)),
        "gelu_tanh": 0.8411919906082768,
        "gelu_erf": 0.5 * (1.0 + math.erf(1.0 / math.sqrt(2.0))),
    }
    for act, value in expected.items():
        y = norm_act_fwd(np.array([[0.7]]), np.array([1.3]), np.array([1.0]), "layernorm", act, EPS)[0]
        assert y[0, 0] == pytest.approx(value, rel=1e-15, abs=1e-15)


def test_rejects_bad_arguments():
    x, w = np.ones((2, 3)), np.ones(3)
    with pytest.raises(ValueError):
        norm_act_fwd(x, np.ones(4), None, "layernorm", "identity", EPS)
    with pytest.raises(ValueError):
        norm_act_fwd(x, w, None, "batchnorm", "identity", EPS)
    with pytest.raises(ValueError):
        norm_act_fwd(x, w, None, "layernorm", "relu", EPS)
    with pytest.raises(ValueError):
        norm_act_bwd(np.ones((3, 3)), x, w, None, "layernorm", "identity", EPS)

"""Tests of the float64 NumPy E79 reference: its backward against central finite differences of its
forward for every bias mode, with and without initial states and final-state gradients, and a
sequence run in two chunks against one run."""

import itertools

import numpy as np
import pytest

from helpers import central_diff, load_reference


ref = load_reference("e79")

STEP = 1e-6
BIAS_MODES = ("none", "fixed", "input")


def _nonzero(rng, shape, lo, hi):
    """Uniform in +-[lo, hi]: random signs, magnitudes bounded away from zero and small enough that
    no sigmoid saturates."""
    return rng.uniform(lo, hi, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def _inputs(seed, T, B, n, bias_mode, with_init):
    rng = np.random.default_rng(seed)
    x = {name: _nonzero(rng, (T, B, n), 0.1, 0.6) for name in ("k", "v", "q", "m")}
    bias_shape = {"none": None, "fixed": (n,), "input": (T, B, n)}[bias_mode]
    for name in ("b_s", "b_m"):
        x[name] = None if bias_shape is None else _nonzero(rng, bias_shape, 0.1, 0.5)
    for name in ("S0", "M0"):
        x[name] = _nonzero(rng, (B, n, n), 0.1, 0.5) if with_init else None
    return x, rng


@pytest.mark.parametrize(
    "bias_mode,with_init,with_dfinal,T,B,n",
    [(b, i, d, T, 2, 3) for b, i, d in itertools.product(BIAS_MODES, (False, True), (False, True))
     for T in (1, 3)] + [("input", True, True, 2, 1, 2)],
)
def test_backward_matches_central_differences(bias_mode, with_init, with_dfinal, T, B, n):
    seed = ((BIAS_MODES.index(bias_mode) * 2 + with_init) * 2 + with_dfinal) * 1000 + T * 100 + B * 10 + n
    x, rng = _inputs(seed, T, B, n, bias_mode, with_init)
    dout = _nonzero(rng, (T, B, n), 0.1, 1.0)
    dS = _nonzero(rng, (B, n, n), 0.1, 1.0) if with_dfinal else None
    dM = _nonzero(rng, (B, n, n), 0.1, 1.0) if with_dfinal else None

    def loss():
        out, S, M = ref.e79_fwd(**x)
        total = np.sum(dout * out)
        if with_dfinal:
            total += np.sum(dS * S) + np.sum(dM * M)
        return total

    grads = ref.e79_bwd(dout, **x, dS=dS, dM=dM)
    assert set(grads) == set(ref.GRAD_KEYS)
    out, S, M = ref.e79_fwd(**x)
    scale = np.sum(np.abs(dout * out))
    if with_dfinal:
        scale += np.sum(np.abs(dS * S)) + np.sum(np.abs(dM * M))
    fd_noise = 1e-9 * (1.0 + scale)
    for name in ("k", "v", "q", "m", "b_s", "b_m", "S0", "M0"):
        grad = grads["d" + name]
        if x[name] is None:
            assert grad is None, name
            continue
        assert grad.shape == x[name].shape, name
        numeric = central_diff(loss, x[name], STEP)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=fd_noise, err_msg="d" + name)


def _slice(x, t0, t1, bias_mode):
    r = dict(x)
    for name in ("k", "v", "q", "m") + (("b_s", "b_m") if bias_mode == "input" else ()):
        r[name] = x[name][t0:t1]
    return r


@pytest.mark.parametrize("bias_mode,with_init,T", list(itertools.product(BIAS_MODES, (False, True), (2, 5))))
def test_two_chunks_equal_one_run(bias_mode, with_init, T):
    """Running [0, 1) then [1, T) from its final states is one run; in the backward the second chunk's
    dS0, dM0 are the first chunk's dS, dM."""
    B, n = 2, 3
    x, rng = _inputs(17 + T, T, B, n, bias_mode, with_init)
    dout = _nonzero(rng, (T, B, n), 0.1, 1.0)
    dS = _nonzero(rng, (B, n, n), 0.1, 1.0)
    dM = _nonzero(rng, (B, n, n), 0.1, 1.0)

    out, S, M = ref.e79_fwd(**x)
    x1, x2 = _slice(x, 0, 1, bias_mode), _slice(x, 1, T, bias_mode)
    out1, S1, M1 = ref.e79_fwd(**x1)
    x2["S0"], x2["M0"] = S1, M1
    out2, S2, M2 = ref.e79_fwd(**x2)
    np.testing.assert_allclose(np.concatenate([out1, out2]), out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(S2, S, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(M2, M, rtol=1e-12, atol=1e-14)

    g = ref.e79_bwd(dout, **x, dS=dS, dM=dM)
    g2 = ref.e79_bwd(dout[1:], **x2, dS=dS, dM=dM)
    g1 = ref.e79_bwd(dout[:1], **x1, dS=g2["dS0"], dM=g2["dM0"])
    for key in ("dk", "dv", "dq", "dm"):
        np.testing.assert_allclose(np.concatenate([g1[key], g2[key]]), g[key], rtol=1e-12, atol=1e-14)
    for key in ("db_s", "db_m"):
        if bias_mode == "none":
            assert g[key] is None and g1[key] is None
        elif bias_mode == "fixed":
            np.testing.assert_allclose(g1[key] + g2[key], g[key], rtol=1e-12, atol=1e-14)
        else:
            np.testing.assert_allclose(np.concatenate([g1[key], g2[key]]), g[key], rtol=1e-12, atol=1e-14)
    for key in ("dS0", "dM0"):
        if with_init:
            np.testing.assert_allclose(g1[key], g[key], rtol=1e-12, atol=1e-14)
        else:
            assert g[key] is None


def test_rejects_mismatched_shapes():
    x, _ = _inputs(3, 2, 1, 3, "fixed", True)
    bad = dict(x, b_s=np.ones((2, 3)))
    with pytest.raises(ValueError):
        ref.e79_fwd(**bad)
    with pytest.raises(ValueError):
        ref.e79_fwd(**dict(x, b_m=None))
    with pytest.raises(ValueError):
        ref.e79_fwd(**dict(x, M0=np.ones((1, 3, 2))))

"""Tests of the float64 NumPy selective-scan reference: its backward against central finite differences
of its forward, its B/C group layouts, chunked scans against one full scan, and a hand computation
(the same numbers as the C++ twin's test, so both references pin one value)."""

import itertools
import math
import zlib

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


ref = load_reference("selective_scan")

STEP = 1e-6
OPTIONAL = ("D", "z", "delta_bias", "h0")
# B/C layouts: name -> (B kind, C kind, groups); kind "fixed" (dim, dstate), "v3" (batch, dstate,
# seqlen), "v4" (batch, groups, dstate, seqlen).
BC_LAYOUTS = {
    "fixed": ("fixed", "fixed", 1),
    "v3": ("v3", "v3", 1),
    "v4_g1": ("v4", "v4", 1),
    "v4_g2": ("v4", "v4", 2),
    "v4B_fixedC_g2": ("v4", "fixed", 2),
    "fixedB_v3C": ("fixed", "v3", 1),
}


def _nonzero(rng, shape, lo, hi):
    """Uniform in +-[lo, hi]: random signs, magnitudes bounded away from zero."""
    return rng.uniform(lo, hi, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def _seed(*params):
    """A seed fixed by the test's parameters (hash() of a str changes from run to run)."""
    return zlib.crc32(repr(params).encode())


def _bc(rng, kind, batch, dim, dstate, seqlen, groups):
    if kind == "fixed":
        return _nonzero(rng, (dim, dstate), 0.1, 1.5)
    if kind == "v3":
        return _nonzero(rng, (batch, dstate, seqlen), 0.1, 1.5)
    return _nonzero(rng, (batch, groups, dstate, seqlen), 0.1, 1.5)


def _inputs(seed, layout, optional, softplus, batch=2, dim=4, dstate=4, seqlen=7):
    """Inputs like a real Mamba layer's: A = -exp(N(0, 0.5)), and a positive time step when no
    softplus makes it so. Returns the keyword arguments of selective_scan_fwd."""
    rng = np.random.default_rng(seed)
    b_kind, c_kind, groups = BC_LAYOUTS[layout]
    shape = (batch, dim, seqlen)
    kw = {
        "u": _nonzero(rng, shape, 0.1, 1.5),
        "delta": _nonzero(rng, shape, 0.1, 1.5) if softplus else rng.uniform(0.2, 1.0, shape),
        "A": -np.exp(rng.normal(0.0, 0.5, (dim, dstate))),
        "B": _bc(rng, b_kind, batch, dim, dstate, seqlen, groups),
        "C": _bc(rng, c_kind, batch, dim, dstate, seqlen, groups),
        "delta_softplus": softplus,
    }
    if "D" in optional:
        kw["D"] = _nonzero(rng, (dim,), 0.1, 1.5)
    if "z" in optional:
        kw["z"] = _nonzero(rng, shape, 0.1, 2.0)
    if "delta_bias" in optional:
        kw["delta_bias"] = _nonzero(rng, (dim,), 0.1, 1.0) if softplus else rng.uniform(0.05, 0.3, (dim,))
    if "h0" in optional:
        kw["h0"] = _nonzero(rng, (batch, dim, dstate), 0.1, 1.5)
    return kw


def _upstream(seed, kw):
    rng = np.random.default_rng(seed + 1000)
    batch, dim, seqlen = kw["u"].shape
    dstate = kw["A"].shape[1]
    return _nonzero(rng, (batch, dim, seqlen), 0.1, 1.0), _nonzero(rng, (batch, dim, dstate), 0.1, 1.0)


def _loss_fn(kw, dout, dlast):
    def loss():
        out, last = ref.selective_scan_fwd(**kw)
        return float(np.sum(dout * out) + (0.0 if dlast is None else np.sum(dlast * last)))

    out, last = ref.selective_scan_fwd(**kw)
    scale = np.abs(dout * out).sum() + (0.0 if dlast is None else np.abs(dlast * last).sum())
    return loss, 1e-9 * (1.0 + scale)  # the difference quotient's rounding: ~4 * 2.2e-16 / STEP, with room


def _grad_name(name):
    return "d" + name


# Every element of every input, on small shapes: the optional inputs all on or all off.
@pytest.mark.parametrize(
    "layout,softplus,optional,dstate,seqlen,with_dlast",
    [
        (layout, softplus, optional, dstate, seqlen, with_dlast)
        for layout, softplus, optional, (dstate, seqlen), with_dlast in itertools.product(
            ["fixed", "v3", "v4_g2", "v4B_fixedC_g2"], [False, True], [(), OPTIONAL], [(1, 2), (4, 7)],
            [False, True])
    ],
)
def test_backward_matches_central_differences(layout, softplus, optional, dstate, seqlen, with_dlast):
    seed = _seed(layout, softplus, optional, dstate, seqlen)
    kw = _inputs(seed, layout, optional, softplus, batch=2, dim=2, dstate=dstate, seqlen=seqlen)
    dout, dlast = _upstream(seed, kw)
    dlast = dlast if with_dlast else None
    loss, fd_noise = _loss_fn(kw, dout, dlast)
    grads = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    assert set(grads) == set(ref.GRAD_KEYS)
    for name in ("u", "delta", "A", "B", "C") + OPTIONAL:
        if name in kw:
            assert_grad_close(grads[_grad_name(name)], central_diff(loss, kw[name], STEP), fd_noise, name)
        else:
            assert grads[_grad_name(name)] is None, name


# The wider matrix (each optional input on and off alone, seqlen 1, 2, 7, every layout), checked along
# one random direction per input: d/de loss(x + e v) = <grad, v>, two forward runs per input.
@pytest.mark.parametrize(
    "layout,softplus,optional,seqlen",
    list(
        itertools.product(
            BC_LAYOUTS, [False, True], [()] + [(o,) for o in OPTIONAL] + [OPTIONAL], [1, 2, 7]
        )
    ),
)
def test_backward_matches_directional_differences(layout, softplus, optional, seqlen):
    seed = _seed(layout, softplus, optional, seqlen, "dir")
    kw = _inputs(seed, layout, optional, softplus, seqlen=seqlen)
    dout, dlast = _upstream(seed, kw)
    loss, fd_noise = _loss_fn(kw, dout, dlast)
    grads = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    rng = np.random.default_rng(seed)
    for name in ("u", "delta", "A", "B", "C") + OPTIONAL:
        if name not in kw:
            assert grads[_grad_name(name)] is None, name
            continue
        param = kw[name]
        direction = _nonzero(rng, param.shape, 0.5, 1.0)
        saved = param.copy()
        param += STEP * direction
        up = loss()
        param[...] = saved - STEP * direction
        down = loss()
        param[...] = saved
        numeric = (up - down) / (2.0 * STEP)
        analytic = float(np.sum(grads[_grad_name(name)] * direction))
        tol = 1e-6 * np.abs(grads[_grad_name(name)] * direction).sum() + fd_noise
        assert abs(analytic - numeric) <= tol, f"{name}: {analytic} vs {numeric}"


def test_seqlen_one_matches_hand_computation():
    kw = {
        "u": np.array([[[0.7]]]),
        "delta": np.array([[[-0.3]]]),
        "A": np.array([[-0.5, -2.0]]),
        "B": np.array([[[0.9], [-1.1]]]),
        "C": np.array([[[0.4], [1.3]]]),
        "D": np.array([0.25]),
        "z": np.array([[[-0.6]]]),
        "delta_bias": np.array([0.8]),
        "delta_softplus": True,
        "h0": np.array([[[1.5, -0.2]]]),
    }
    dt = math.log(1.0 + math.exp(-0.3 + 0.8))
    x0 = math.exp(dt * -0.5) * 1.5 + dt * 0.9 * 0.7
    x1 = math.exp(dt * -2.0) * -0.2 + dt * -1.1 * 0.7
    out_expected = (0.4 * x0 + 1.3 * x1 + 0.25 * 0.7) * (-0.6 / (1.0 + math.exp(0.6)))
    out, last = ref.selective_scan_fwd(**kw)
    assert out.shape == (1, 1, 1) and last.shape == (1, 1, 2)
    assert out[0, 0, 0] == pytest.approx(out_expected, rel=1e-15, abs=1e-15)
    np.testing.assert_allclose(last[0, 0], [x0, x1], rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("layout", list(BC_LAYOUTS))
def test_zero_h0_equals_no_h0(layout):
    kw = _inputs(5, layout, ("D", "z", "delta_bias"), True)
    dout, dlast = _upstream(5, kw)
    zero = dict(kw, h0=np.zeros((2, 4, 4)))
    for a, b in zip(ref.selective_scan_fwd(**kw), ref.selective_scan_fwd(**zero)):
        np.testing.assert_array_equal(a, b)
    ga = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    gb = ref.selective_scan_bwd(dout, **zero, dlast_state=dlast)
    for key in ref.GRAD_KEYS:
        if key != "dh0":
            np.testing.assert_array_equal(ga[key], gb[key])
    assert ga["dh0"] is None and gb["dh0"].shape == (2, 4, 4)


def _time_slice(kw, t0, t1):
    r = dict(kw)
    for name in ("u", "delta", "z"):
        if name in kw:
            r[name] = kw[name][..., t0:t1]
    for name in ("B", "C"):
        if kw[name].ndim > 2:
            r[name] = kw[name][..., t0:t1]
    return r


@pytest.mark.parametrize("layout", list(BC_LAYOUTS))
@pytest.mark.parametrize("optional", [(), OPTIONAL])
@pytest.mark.parametrize("split", [1, 3, 6])
def test_chunked_equals_full(layout, optional, split):
    """Scanning [0, split) and then the rest from its last state equals one scan; backwards, the second
    chunk's dh0 is the first chunk's dlast_state."""
    kw = _inputs(17, layout, optional, bool(optional))
    dout, dlast = _upstream(17, kw)
    out, last = ref.selective_scan_fwd(**kw)
    kw1, kw2 = _time_slice(kw, 0, split), _time_slice(kw, split, None)
    out1, last1 = ref.selective_scan_fwd(**kw1)
    kw2["h0"] = last1
    out2, last2 = ref.selective_scan_fwd(**kw2)
    np.testing.assert_allclose(np.concatenate([out1, out2], axis=-1), out, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(last2, last, rtol=1e-13, atol=1e-13)

    g = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    g2 = ref.selective_scan_bwd(dout[..., split:], **kw2, dlast_state=dlast)
    g1 = ref.selective_scan_bwd(dout[..., :split], **kw1, dlast_state=g2["dh0"])
    for key, name in (("du", "u"), ("ddelta", "delta"), ("dz", "z"), ("dB", "B"), ("dC", "C"),
                      ("dA", "A"), ("dD", "D"), ("ddelta_bias", "delta_bias")):
        if g[key] is None:
            assert g1[key] is None
            continue
        per_time = name in ("u", "delta", "z") or kw[name].ndim > 2
        joined = np.concatenate([g1[key], g2[key]], axis=-1) if per_time else g1[key] + g2[key]
        np.testing.assert_allclose(joined, g[key], rtol=1e-13, atol=1e-13, err_msg=key)
    if "h0" in kw:
        np.testing.assert_allclose(g1["dh0"], g["dh0"], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("layout", list(BC_LAYOUTS))
@pytest.mark.parametrize("stride", [1, 3, 16])
def test_states_are_the_prefix_scans_last_states(layout, stride):
    """states[:, :, k] (selective_scan.fwd's output for the backward) is the state entering step k *
    stride: h0 for k = 0, else the last state of the scan over the first k * stride steps."""
    kw = _inputs(23, layout, OPTIONAL, True, seqlen=37)
    out, last, states = ref.selective_scan_fwd(**kw, state_stride=stride)
    assert states.shape == (2, 4, -(-37 // stride), 4)
    np.testing.assert_array_equal(out, ref.selective_scan_fwd(**kw)[0])
    np.testing.assert_allclose(states[:, :, 0], kw["h0"], rtol=0, atol=0)
    for k in range(1, states.shape[2]):
        prefix = ref.selective_scan_fwd(**_time_slice(kw, 0, k * stride))[1]
        np.testing.assert_allclose(states[:, :, k], prefix, rtol=1e-13, atol=1e-13)


def test_groups_layouts_agree():
    """(batch, dstate, seqlen) is one group; with two groups each half of the channels scans with its
    own group's B and C; and a fixed B is a variable one with dim groups, constant over batch and time."""
    kw = _inputs(29, "v4_g2", OPTIONAL, True)
    dout, dlast = _upstream(29, kw)
    out, last = ref.selective_scan_fwd(**kw)
    g = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    assert g["dB"].shape == kw["B"].shape and g["dC"].shape == kw["C"].shape
    for grp, ch in ((0, slice(0, 2)), (1, slice(2, 4))):
        part = {k: v for k, v in kw.items() if k == "delta_softplus"}
        for name in ("u", "delta", "z", "A", "D", "delta_bias", "h0"):
            part[name] = kw[name][:, ch] if kw[name].ndim == 3 else kw[name][ch]
        part["B"], part["C"] = kw["B"][:, grp], kw["C"][:, grp]
        out_p, last_p = ref.selective_scan_fwd(**part)
        np.testing.assert_allclose(out_p, out[:, ch], rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(last_p, last[:, ch], rtol=1e-14, atol=1e-14)
        g_p = ref.selective_scan_bwd(dout[:, ch], **part, dlast_state=dlast[:, ch])
        assert g_p["dB"].shape == (2, 4, 7)
        np.testing.assert_allclose(g_p["dB"], g["dB"][:, grp], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(g_p["dC"], g["dC"][:, grp], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(g_p["du"], g["du"][:, ch], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(g_p["dA"], g["dA"][ch], rtol=1e-13, atol=1e-13)

    one = dict(kw, B=kw["B"][:, :1], C=kw["C"][:, :1])
    three = dict(kw, B=kw["B"][:, 0], C=kw["C"][:, 0])
    for a, b in zip(ref.selective_scan_fwd(**one), ref.selective_scan_fwd(**three)):
        np.testing.assert_array_equal(a, b)
    g1 = ref.selective_scan_bwd(dout, **one, dlast_state=dlast)
    g3 = ref.selective_scan_bwd(dout, **three, dlast_state=dlast)
    np.testing.assert_array_equal(g1["dB"][:, 0], g3["dB"])
    np.testing.assert_array_equal(g1["dC"][:, 0], g3["dC"])

    fixed = _inputs(31, "fixed", OPTIONAL, True)
    variable = dict(fixed, B=np.broadcast_to(fixed["B"][None, :, :, None], (2, 4, 4, 7)).copy())
    np.testing.assert_allclose(ref.selective_scan_fwd(**variable)[0], ref.selective_scan_fwd(**fixed)[0],
                               rtol=1e-14, atol=1e-14)
    gf = ref.selective_scan_bwd(dout, **fixed, dlast_state=dlast)
    gv = ref.selective_scan_bwd(dout, **variable, dlast_state=dlast)
    np.testing.assert_allclose(gv["dB"].sum(axis=(0, 3)), gf["dB"], rtol=1e-13, atol=1e-13)


def test_long_sequence_runs():
    """seqlen 65536 through the backward (which runs the forward too): a loop, not recursion; the states
    it keeps are (seqlen + 1) * 4 doubles. The backward alone keeps the test short: each time step is a
    handful of small NumPy calls."""
    kw = _inputs(37, "v3", OPTIONAL, True, batch=1, dim=1, dstate=4, seqlen=65536)
    dout, dlast = _upstream(37, kw)
    g = ref.selective_scan_bwd(dout, **kw, dlast_state=dlast)
    for key in ref.GRAD_KEYS:
        assert g[key].shape == kw[key[1:]].shape, key
        assert np.all(np.isfinite(g[key])), key


def test_rejects_bad_arguments():
    kw = _inputs(41, "v4_g2", OPTIONAL, False)
    with pytest.raises(ValueError):
        ref.selective_scan_fwd(**dict(kw, B=kw["B"][..., :-1]))
    with pytest.raises(ValueError):
        ref.selective_scan_fwd(**dict(kw, C=np.ones((2, 3, 4, 7))))
    with pytest.raises(ValueError):
        ref.selective_scan_fwd(**dict(kw, D=np.ones(5)))
    with pytest.raises(ValueError):
        ref.selective_scan_bwd(np.ones((2, 4, 6)), **kw)
    with pytest.raises(ValueError):
        ref.selective_scan_bwd(np.ones((2, 4, 7)), **kw, dlast_state=np.ones((2, 4, 3)))

"""Tests of the float64 NumPy difflogic reference: the 16 truth tables against their multilinear
extensions, the T-form against sum_i p_i op_i, the soft backward (dlogits, dx with repeated wires,
self-paired gates, grad_factor) against central differences, binarize, Philox's known answers, the
Gumbel noise's distribution, the straight-through estimator's backward on logits + G against central
differences, hard mode's ties, packed inference equal
to the hard forward bit for bit (w = 32, 64, B not a multiple of w), GroupSum and its packed counts,
the consumers CSR, errors naming the argument, and pinned values shared with the C++ twin's test
(tests/cpp/test_difflogic_reference.cpp)."""

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


ref = load_reference("difflogic")

STEP = 1e-6


def _layer(seed, B, n_in, n_out, self_pairs=True):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.05, 0.95, size=(B, n_in))
    logits = rng.normal(scale=1.5, size=(n_out, 16))
    a = rng.integers(0, n_in, size=n_out)
    b = rng.integers(0, n_in, size=n_out)
    if self_pairs:
        b[::3] = a[::3]
    return rng, x, logits, a, b


def test_truth_tables_are_the_multilinear_extensions_at_corners():
    for i in range(16):
        for u in (0, 1):
            for v in (0, 1):
                assert ref.OPS[i](float(u), float(v)) == ref.TRUTH[i, 2 * u + v] == (i >> (3 - (2 * u + v))) & 1
    # Named ops: AND, XOR, NAND, OR.
    assert list(ref.TRUTH[1]) == [0, 0, 0, 1] and list(ref.TRUTH[6]) == [0, 1, 1, 0]
    assert list(ref.TRUTH[14]) == [1, 1, 1, 0] and list(ref.TRUTH[7]) == [0, 1, 1, 1]


def test_t_form_equals_the_mixture_of_ops():
    _, x, logits, a, b = _layer(1, 6, 5, 9)
    p = ref.softmax(logits)
    want = sum(p[:, i] * ref.OPS[i](x[:, a], x[:, b]) for i in range(16))
    np.testing.assert_allclose(ref.layer_fwd(x, logits, a, b), want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("B,n_in,n_out,grad_factor", [(1, 1, 1, 1.0), (3, 4, 7, 1.0), (2, 5, 9, 2.5), (4, 2, 6, 0.5)])
def test_soft_backward_matches_central_differences(B, n_in, n_out, grad_factor):
    rng, x, logits, a, b = _layer(10 + n_out, B, n_in, n_out)
    dout = rng.normal(size=(B, n_out))
    dx, dlogits = ref.layer_bwd(dout, x, logits, a, b, grad_factor)

    def loss():
        return float(np.sum(dout * ref.layer_fwd(x, logits, a, b)))

    assert_grad_close(dx, grad_factor * central_diff(loss, x, STEP), 1e-9, "dx")
    assert_grad_close(dlogits, central_diff(loss, logits, STEP), 1e-9, "dlogits")


def test_self_paired_gate_gives_da_plus_db():
    # One XOR-leaning gate reading input 0 on both wires: y = f(x, x), dy/dx = da + db, not da alone.
    logits = np.zeros((1, 16))
    logits[0, 6] = 3.0
    x = np.array([[0.3, 0.8]])
    dx, _ = ref.layer_bwd(np.ones((1, 1)), x, logits, [0], [0])
    h = 1e-6
    xp, xm = x.copy(), x.copy()
    xp[0, 0] += h
    xm[0, 0] -= h
    fd = (ref.layer_fwd(xp, logits, [0], [0]) - ref.layer_fwd(xm, logits, [0], [0]))[0, 0] / (2 * h)
    assert dx[0, 0] == pytest.approx(fd, rel=1e-7)
    assert dx[0, 1] == 0.0  # unread input


def test_consumers_csr_orders_readers_and_handles_unread_and_heavily_read_inputs():
    a = np.array([2, 0, 2, 3])
    b = np.array([0, 0, 3, 2])
    offsets, entries = ref.consumers(5, a, b)
    assert list(offsets) == [0, 3, 3, 6, 8, 8]
    assert list(entries) == [1, 2, 3, 0, 4, 7, 5, 6]  # 2 g + side, ascending per input
    # An input read by 2048 gates (4 inputs -> 2048 gates) and an unread one.
    n_out = 2048
    a = np.zeros(n_out, dtype=np.int64)
    b = np.full(n_out, 1)
    b[::2] = 0
    rng = np.random.default_rng(3)
    x = rng.uniform(size=(2, 4))
    logits = rng.normal(size=(n_out, 16))
    dout = rng.normal(size=(2, n_out))
    dx, _ = ref.layer_bwd(dout, x, logits, a, b)
    assert np.all(dx[:, 2:] == 0.0)
    p = ref.softmax(logits)
    t = p @ ref.TRUTH
    xa, xb = x[:, a], x[:, b]
    da = dout * ((t[:, 2] - t[:, 0]) * (1 - xb) + (t[:, 3] - t[:, 1]) * xb)
    db = dout * ((t[:, 1] - t[:, 0]) * (1 - xa) + (t[:, 3] - t[:, 2]) * xa)
    np.testing.assert_allclose(dx[:, 0], da.sum(1) + (db * (b == 0)).sum(1), rtol=1e-11)


def test_hard_mode_takes_the_argmax_with_ties_to_the_lower_index():
    logits = np.zeros((3, 16))
    logits[1, [3, 7]] = 2.0
    logits[2, [14, 9]] = 1.0
    assert list(ref.hard_ops(logits)) == [0, 3, 9]
    x = np.array([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.25, 0.5]])
    y = ref.layer_fwd(x, logits, [0, 0, 0], [1, 1, 1], hard=True)
    want = np.stack([ref.OPS[i](x[:, 0], x[:, 1]) for i in (0, 3, 9)], axis=1)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("w", [32, 64])
@pytest.mark.parametrize("B", [1, 33, 64, 100])
def test_packed_equals_hard_forward_on_bits(w, B):
    rng, _, _, _, _ = _layer(B, 1, 1, 1)
    n_in, widths = 12, [20, 16, 10]
    x = (rng.uniform(size=(B, n_in)) < 0.5).astype(np.float64)
    words = ref.pack(x, w)
    assert words.shape == (n_in, -(-B // w))
    np.testing.assert_array_equal(ref.unpack(words, B, w), x)
    for n_out in widths:
        logits = rng.normal(size=(n_out, 16))
        a = rng.integers(0, x.shape[1], size=n_out)
        b = rng.integers(0, x.shape[1], size=n_out)
        b[::4] = a[::4]
        x = ref.layer_fwd(x, logits, a, b, hard=True)
        words = ref.packed_fwd(words, B, w, ref.hard_ops(logits), a, b)
        np.testing.assert_array_equal(ref.unpack(words, B, w), x)
        np.testing.assert_array_equal(words, ref.pack(x, w))  # padding bits cleared: canonical
    counts = ref.packed_group_sum(words, B, w, 5)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, ref.group_sum(x, 5, 1.0))


def test_every_op_packed_at_every_corner():
    x = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    for w in (32, 64):
        out = ref.unpack(ref.packed_fwd(ref.pack(x, w), 4, w, np.arange(16), np.zeros(16, int), np.ones(16, int)), 4, w)
        np.testing.assert_array_equal(out, ref.TRUTH.T)


def test_group_sum_and_its_backward():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 12))
    y = ref.group_sum(x, 4, tau=2.0)
    np.testing.assert_allclose(y, x.reshape(3, 4, 3).sum(-1) / 2.0)
    dy = rng.normal(size=(3, 4))
    dx = ref.group_sum_bwd(dy, 12, tau=2.0)
    assert_grad_close(dx, central_diff(lambda: float(np.sum(dy * ref.group_sum(x, 4, 2.0))), x, STEP), 1e-9, "dx")


def test_errors_name_the_argument():
    x = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"b\[1\] = 3 is outside \[0, 3\)"):
        ref.layer_fwd(x, np.zeros((2, 16)), [0, 1], [2, 3])
    with pytest.raises(ValueError, match=r"a\[0\] = -1"):
        ref.layer_fwd(x, np.zeros((1, 16)), [-1], [0])
    with pytest.raises(ValueError, match="logits must be"):
        ref.layer_fwd(x, np.zeros((2, 15)), [0, 1], [0, 1])
    with pytest.raises(ValueError, match="divide n"):
        ref.group_sum(np.zeros((2, 10)), 3)
    with pytest.raises(ValueError, match="w = 16"):
        ref.pack(x, 16)
    with pytest.raises(ValueError, match="only 0 and 1"):
        ref.pack(x + 0.5, 32)


# ---- values shared with tests/cpp/test_difflogic_reference.cpp ----

def _formula(n, c, scale, shift=0.0):
    """scale * sin(0.37 j + c) + shift, j = 0..n-1: the inputs both sides compute."""
    return scale * np.sin(0.37 * np.arange(n) + c) + shift


def pinned_values():
    B, n_in, n_out = 3, 5, 7
    x = _formula(B * n_in, 0.1, 0.45, 0.5).reshape(B, n_in)
    logits = _formula(n_out * 16, 0.2, 2.0).reshape(n_out, 16)
    a = (3 * np.arange(n_out) + 1) % n_in
    b = (2 * np.arange(n_out)) % n_in  # gate 1 reads input 2 on both wires
    dout = _formula(B * n_out, 0.3, 1.0).reshape(B, n_out)
    y = ref.layer_fwd(x, logits, a, b)
    dx, dlogits = ref.layer_bwd(dout, x, logits, a, b, grad_factor=1.5)
    bits = (x > 0.5).astype(np.float64)
    hard = ref.unpack(ref.packed_fwd(ref.pack(bits, 32), B, 32, ref.hard_ops(logits), a, b), B, 32)
    w = lambda v: float(np.sum(v.ravel() * np.cos(np.arange(v.size))))  # noqa: E731  weighted: order matters
    return dict(y=w(y), dx=w(dx), dlogits=w(dlogits), hard=w(hard))


PINNED = dict(y=1.3609391835026599, dx=-0.11917770680712834, dlogits=-0.05810427339926578, hard=0.8392275169378114)


def test_pinned_values_shared_with_cpp():
    got = pinned_values()
    for key, want in PINNED.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key


def test_binarize_thresholds_at_one_half():
    x = np.array([0.0, 1.0, 0.5, np.nextafter(0.5, 1.0), 0.49, -3.0, 7.0, np.nan])
    np.testing.assert_array_equal(ref.binarize(x), [0, 1, 0, 1, 0, 0, 1, 0])


def pinned_bits():
    """GroupSum, binarize + pack (w = 32, 64) and packed GroupSum on formula inputs, as the C++ twin's test."""
    B, n = 37, 12
    x = _formula(B * n, 0.4, 0.6, 0.5).reshape(B, n)
    bits = ref.binarize(x)
    w = lambda v: float(np.sum(np.asarray(v, dtype=np.float64).ravel() * np.cos(np.arange(v.size))))  # noqa: E731
    return dict(group_sum=w(ref.group_sum(x, 4, 2.5)), group_sum_bwd=w(ref.group_sum_bwd(x[:, :4], 12, 2.5)),
                pack32=w(ref.pack(bits, 32)), pack64=w(ref.pack(bits, 64).astype(np.float64) / 2.0**32),
                counts=w(ref.packed_group_sum(ref.pack(bits, 64), B, 64, 4)))


PINNED_BITS = dict(group_sum=3.932900446562618, group_sum_bwd=-0.21024730192034558, pack32=-462858463.86566114,
                   pack64=-27.214010749434678, counts=7.922464655066591)


def test_pinned_bits_shared_with_cpp():
    got = pinned_bits()
    for key, want in PINNED_BITS.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key


# ---- the straight-through estimator's Gumbel noise ----

def test_philox_known_answers():
    """Random123's published known-answer vectors for Philox4x32-10."""
    got = [int(v) for v in ref.philox4x32_10((0, 0, 0, 0), (0, 0))]
    assert got == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = [int(v) for v in ref.philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)]
    assert got == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_gumbel_noise_is_gumbel_and_depends_on_seed_and_gate_only():
    g = ref.gumbel_noise(4096, 7)
    assert abs(g.mean() - np.euler_gamma) < 0.02  # std of the mean: (pi / sqrt 6) / 256 = 0.005
    assert abs(g.var() - np.pi**2 / 6) < 0.06
    np.testing.assert_array_equal(ref.gumbel_noise(10, 7), g[:10])  # a gate's noise: (seed, g) alone
    assert not np.any(ref.gumbel_noise(10, 8) == g[:10])
    assert not np.any(ref.gumbel_noise(10, 7 + 2**32) == g[:10])  # the seed's high word is part of the key


@pytest.mark.parametrize("B,n_in,n_out", [(1, 1, 1), (3, 4, 7), (2, 5, 9)])
def test_straight_through_gumbel_backward_matches_central_differences(B, n_in, n_out):
    """The estimator's backward is the soft layer's on logits + G, G fixed by the seed."""
    rng, x, logits, a, b = _layer(20 + n_out, B, n_in, n_out)
    dout = rng.normal(size=(B, n_out))
    noise = ref.gumbel_noise(n_out, 99)
    dx, dlogits = ref.layer_bwd(dout, x, logits + noise, a, b)

    def loss():
        return float(np.sum(dout * ref.layer_fwd(x, logits + noise, a, b)))

    assert_grad_close(dx, central_diff(loss, x, STEP), 1e-9, "dx")
    assert_grad_close(dlogits, central_diff(loss, logits, STEP), 1e-9, "dlogits")
    # Its forward: the hard layer of argmax(logits + G).
    hard = ref.layer_fwd(x, logits + noise, a, b, hard=True)
    ops = ref.hard_ops(logits + noise)
    np.testing.assert_allclose(hard, np.stack([ref.OPS[o](x[:, a[g]], x[:, b[g]]) for g, o in enumerate(ops)], 1),
                               rtol=0, atol=1e-15)


def pinned_gumbel():
    B, n_in, n_out = 3, 5, 7
    x = _formula(B * n_in, 0.1, 0.45, 0.5).reshape(B, n_in)
    logits = _formula(n_out * 16, 0.2, 2.0).reshape(n_out, 16)
    a = (3 * np.arange(n_out) + 1) % n_in
    b = (2 * np.arange(n_out)) % n_in
    dout = _formula(B * n_out, 0.3, 1.0).reshape(B, n_out)
    noise = ref.gumbel_noise(n_out, 0x123456789)
    dx, dlogits = ref.layer_bwd(dout, x, logits + noise, a, b, grad_factor=1.5)
    w = lambda v: float(np.sum(v.ravel() * np.cos(np.arange(v.size))))  # noqa: E731
    return dict(noise=w(noise), hard=w(ref.layer_fwd(x, logits + noise, a, b, hard=True)), dx=w(dx),
                dlogits=w(dlogits))


PINNED_GUMBEL = dict(noise=-8.145101570081561, hard=0.7226733450030891, dx=-0.3453163755311174,
                     dlogits=-0.13913343765147065)


def test_pinned_gumbel_shared_with_cpp():
    got = pinned_gumbel()
    for key, want in PINNED_GUMBEL.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key

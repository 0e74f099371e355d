"""Tests of the float64 NumPy DiffLogic CA step (kspec.reference.difflogic.ca_step / ca_step_bwd): the
backward (state through kept cells, the update network and every neighbour's perception; every
perception kernel's and update layer's logits) against central differences, zero-padded and periodic,
with and without a fire mask, and values pinned by the C++ twin's test
(tests/cpp/test_difflogic_ca_reference.cpp)."""

import numpy as np
import pytest

from helpers import assert_grad_close, central_diff, load_reference


ref = load_reference("difflogic")


def _wires(rng, n_in, width):
    a = rng.integers(0, n_in, size=width)
    b = rng.integers(0, n_in, size=width)
    b[::4] = a[::4]
    return a, b


def _small_ca(seed, C, K):
    """perception 9 -> 8 -> 4 -> 2, update (C + 2 C K) -> 6 -> C."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation([0, 1, 2, 3, 5, 6, 7, 8])
    perception = [_wires(rng, 8, 4), _wires(rng, 4, 2)]
    update = [_wires(rng, C + 2 * C * K, 6), _wires(rng, 6, C)]
    plog = [rng.uniform(-2, 2, size=(K, w, 16)) for w in (8, 4, 2)]
    ulog = [rng.uniform(-2, 2, size=(w, 16)) for w in (6, C)]
    return perm, perception, update, plog, ulog


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_ca_step_backward_matches_central_differences(periodic, masked):
    B, H, W, C, K = 2, 3, 4, 2, 2
    perm, perception, update, plog, ulog = _small_ca(2 * periodic + masked, C, K)
    rng = np.random.default_rng(5)
    state = rng.uniform(0.05, 0.95, size=(B, H, W, C))
    dnew = rng.uniform(-1, 1, size=(B, H, W, C))
    fire = (np.arange(B * H * W) % 3 != 1).astype(np.float64).reshape(B, H, W) if masked else None
    dstate, dplog, dulog = ref.ca_step_bwd(dnew, state, perm, perception, update, plog, ulog, periodic, fire)

    def loss():
        return float(np.sum(dnew * ref.ca_step(state, perm, perception, update, plog, ulog, periodic, fire)))

    assert_grad_close(dstate, central_diff(loss, state, 1e-6), 1e-9, "dstate")
    for l, lg in enumerate(plog):
        assert_grad_close(dplog[l], central_diff(loss, lg, 1e-6), 1e-9, f"dperception[{l}]")
    for l, lg in enumerate(ulog):
        assert_grad_close(dulog[l], central_diff(loss, lg, 1e-6), 1e-9, f"dupdate[{l}]")


def test_kept_cells_keep_their_state():
    B, H, W, C, K = 1, 2, 3, 2, 2
    perm, perception, update, plog, ulog = _small_ca(3, C, K)
    state = np.random.default_rng(1).uniform(size=(B, H, W, C))
    fire = np.zeros((B, H, W))
    np.testing.assert_array_equal(ref.ca_step(state, perm, perception, update, plog, ulog, True, fire), state)
    fire[0, 1, 2] = 1
    out = ref.ca_step(state, perm, perception, update, plog, ulog, True, fire)
    assert np.all(out[0, 0] == state[0, 0]) and np.all(out[0, 1, :2] == state[0, 1, :2])
    assert np.all(out[0, 1, 2] != state[0, 1, 2])


def _formula(n, c, scale, shift=0.0):
    return scale * np.sin(0.37 * np.arange(n) + c) + shift


def pinned_values():
    B, H, W, C, K = 1, 3, 3, 2, 2
    perm = np.array([8, 7, 6, 5, 3, 2, 1, 0])

    def wires(n_in, width, m):
        g = np.arange(width)
        return (m * g + 1) % n_in, (2 * g) % n_in

    perception = [wires(8, 4, 3), wires(4, 2, 1)]
    update = [wires(C + 2 * C * K, 6, 5), wires(6, C, 1)]
    c = 0.2
    plog, ulog = [], []
    for w in (8, 4, 2):
        c += 0.1
        plog.append(_formula(K * w * 16, c, 2.0).reshape(K, w, 16))
    for w in (6, C):
        c += 0.1
        ulog.append(_formula(w * 16, c, 2.0).reshape(w, 16))
    state = _formula(B * H * W * C, 0.1, 0.45, 0.5).reshape(B, H, W, C)
    dnew = _formula(B * H * W * C, 0.3, 1.0).reshape(B, H, W, C)
    fire = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=np.float64).reshape(B, H, W)
    nxt = ref.ca_step(state, perm, perception, update, plog, ulog, True, fire)
    dstate, dplog, dulog = ref.ca_step_bwd(dnew, state, perm, perception, update, plog, ulog, True, fire)
    w = lambda v: float(np.sum(v.ravel() * np.cos(np.arange(v.size))))  # noqa: E731
    return dict(next=w(nxt), dstate=w(dstate), dperc0=w(dplog[0]), dupdate0=w(dulog[0]))


PINNED = dict(next=-0.8070537881094376, dstate=-1.956605101685864, dperc0=0.007162407501578153,
              dupdate0=-0.06100627529083135)


def test_pinned_values_shared_with_cpp():
    got = pinned_values()
    for key, want in PINNED.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key

"""The AdamW float64 reference (CPU): the first step's closed form, clipping, unscaling and the skipped
step, bias correction, AMSGrad and maximize; and, where torch is installed, torch.optim.AdamW itself in
float64 for every option (the reference is the spec the GPU kernel is tested against)."""
import math

import numpy as np
import pytest

from helpers import load_reference

ref = load_reference("adamw")


def _state(shapes, seed):
    rng = np.random.default_rng(seed)
    ps = [rng.standard_normal(s) for s in shapes]
    gs = [rng.standard_normal(s) for s in shapes]
    return ps, gs, [np.zeros(s) for s in shapes], [np.zeros(s) for s in shapes]


def test_first_step_closed_form():
    ps, gs, ms, vs = _state([(3, 4), (5,)], 0)
    p0 = [p.copy() for p in ps]
    lr, wd, eps = 1e-2, 0.1, 1e-8
    ref.adamw_step(ps, gs, ms, vs, lr=lr, weight_decay=wd, eps=eps, step=1)
    for p, q, g in zip(ps, p0, gs):  # m̂ = g, v̂ = g²: p = p(1 - lr wd) - lr g / (|g| + eps)
        np.testing.assert_allclose(p, q * (1 - lr * wd) - lr * g / (np.abs(g) + eps), rtol=1e-12, atol=1e-15)


def test_clipping_unscaling_and_found_inf():
    ps, gs, ms, vs = _state([(7,), (2, 3)], 1)
    norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
    found, n = ref.adamw_step(ps, [g * 8 for g in gs], ms, vs, grad_scale=8.0, max_norm=0.5, step=1)
    assert not found and abs(n - norm) < 1e-12
    coef = 0.5 / (norm + 1e-6)
    np.testing.assert_allclose(ms[0], 0.1 * gs[0] * coef, rtol=1e-12)
    p_before = [p.copy() for p in ps]
    gs[1][0, 1] = np.inf
    found, _ = ref.adamw_step(ps, gs, ms, vs, step=2)
    assert found and all(np.array_equal(a, b) for a, b in zip(ps, p_before))


try:
    import torch
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adamw_in_float64(amsgrad, maximize, wd):
    shapes = [(4, 3), (10,), (1,)]
    ps, gs, ms, vs = _state(shapes, 2)
    vmax = [np.zeros(s) for s in shapes] if amsgrad else None
    tp = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in ps]
    opt = torch.optim.AdamW(tp, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, amsgrad=amsgrad,
                            maximize=maximize, foreach=False)
    rng = np.random.default_rng(3)
    for step in range(1, 6):
        grads = [rng.standard_normal(s) for s in shapes]
        for t, g in zip(tp, grads):
            t.grad = torch.tensor(g)
        opt.step()
        ref.adamw_step(ps, grads, ms, vs, vmax, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=wd,
                       step=step, maximize=maximize)
        for t, p in zip(tp, ps):
            np.testing.assert_allclose(t.detach().numpy(), p, rtol=1e-12, atol=1e-14)

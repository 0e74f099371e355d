"""kspec.nn.DiffLogicCA and GroupSum's torch surface on the GPU (issue 30), against the float64 references
(kspec.reference.difflogic): the checkerboard (C=8, K=16, 9-8-4-2, 264-256x10-128-64-32-16-8-8) through a
20-step rollout, loss sum((s_T[..., 0] - target)^2), gradients of the initial state and of both logits
within 1e-3 (fp32; max|x - ref| / max|ref|), with and without fire masks, cached and checkpointed; two
runs bitwise equal; the clamp at +-100. The CPU twin (the rollout's wiring on the references):
test_difflogic_ca_nn.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402

from test_difflogic_ca_nn import split  # noqa: E402

pytestmark = pytest.mark.gpu


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def _err(got, want):
    got = _np(got)
    assert got.shape == np.shape(want) and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _reference_bptt(ca, s0, target, fire, steps):
    """Loss gradients (state, perception logits, update logits) of the float64 rollout."""
    perception, update, pls, uls = split(ca.arch, _np(ca.wires).astype(np.int64), _np(ca.perception_logits),
                                         _np(ca.update_logits))
    perm = ca.perm.cpu().numpy()
    states = [s0]
    for t in range(steps):
        states.append(dl_ref.ca_step(states[-1], perm, perception, update, pls, uls, periodic=ca.periodic,
                                     fire=None if fire is None else fire[t]))
    d = np.zeros_like(s0)
    d[..., 0] = 2 * (states[-1][..., 0] - target)
    dp = [np.zeros_like(x) for x in pls]
    du = [np.zeros_like(x) for x in uls]
    for t in reversed(range(steps)):
        d, gp, gu = dl_ref.ca_step_bwd(d, states[t], perm, perception, update, pls, uls, periodic=ca.periodic,
                                       fire=None if fire is None else fire[t])
        d = d.reshape(s0.shape)
        dp = [a + b for a, b in zip(dp, gp)]
        du = [a + b for a, b in zip(du, gu)]
    return states[-1], d, np.concatenate(dp, axis=1), np.concatenate(du)


def _checkerboard(seed, periodic=True):
    torch.manual_seed(seed)
    ca = kspec.nn.DiffLogicCA(periodic=periodic, grad_clip=None, device="cuda")
    with torch.no_grad():  # near the pass-through init, but every gate's gradient nonzero
        ca.perception_logits.add_(torch.randn_like(ca.perception_logits) * 2)
        ca.update_logits.add_(torch.randn_like(ca.update_logits) * 2)
    return ca


@pytest.mark.parametrize("masked,checkpoint", [(False, False), (True, True)])
def test_checkerboard_20_step_bptt_vs_reference(masked, checkpoint):
    ca = _checkerboard(0)
    g = torch.Generator(device="cuda").manual_seed(1)
    B, H, W, T = 2, 16, 16, 20
    s0 = torch.rand(B, H, W, 8, device="cuda", generator=g)
    target = (torch.arange(H, device="cuda")[:, None] + torch.arange(W, device="cuda")[None, :]) % 2
    target = target.float().expand(B, H, W)
    fire = (torch.rand(T, B, H, W, device="cuda", generator=g) < 0.6).float() if masked else None

    def run():
        ca.zero_grad()
        s = s0.clone().requires_grad_()
        out = ca.rollout(s, T, fire_masks=fire, checkpoint=checkpoint)
        ((out[..., 0] - target) ** 2).sum().backward()
        return out.detach(), s.grad, ca.perception_logits.grad.clone(), ca.update_logits.grad.clone()

    got = run()
    want = _reference_bptt(ca, _np(s0), _np(target), _np(fire), T)
    for x, w, name in zip(got, want, ("s_T", "dstate", "dperception_logits", "dupdate_logits")):
        err = _err(x, w)
        assert err <= 1e-3, f"{name}: max rel error {err:.2e}"
    again = run()
    for x, y in zip(got, again):
        assert torch.equal(x, y)  # bitwise: no atomics, sums in a fixed order


def test_rollout_clamps_the_logits_gradients():
    ca = _checkerboard(2)
    ca.grad_clip = 100.0
    s0 = torch.rand(64, 16, 16, 8, device="cuda")
    (ca.rollout(s0, 20)[..., 0] ** 2).sum().mul(1e4).backward()
    assert ca.update_logits.grad.abs().max() <= 100.0
    ca.grad_clip = None
    ca.zero_grad()
    (ca.rollout(s0, 20)[..., 0] ** 2).sum().mul(1e4).backward()
    assert ca.update_logits.grad.abs().max() > 100.0  # the clamp above did something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_sum_surface(dtype):
    x = torch.rand(33, 40, device="cuda").to(dtype).requires_grad_()
    y = kspec.ops.group_sum(x, 10, tau=2.0)
    want = x.detach().double().reshape(33, 10, 4).sum(-1) / 2.0
    assert y.dtype == dtype and _err(y, _np(want)) <= (1e-6 if dtype == torch.float32 else 1e-2)
    dy = torch.randn(33, 10, device="cuda").to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx.float(), (dy.float()[:, :, None] / 2.0).expand(33, 10, 4).reshape(33, 40).to(dtype).float())
    m = kspec.nn.GroupSum(10, tau=2.0)
    assert torch.equal(m(x), y)

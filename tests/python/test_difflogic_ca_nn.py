"""kspec.nn.DiffLogicCA without a GPU (issue 30): construction (the notebook's checkerboard sizes, pass-through
init, wiring in range and drawn from torch's seed), errors naming the argument, and the rollout's backward
through time on CPU with the float64 references standing in for the step ops (a kspec.call that runs
kspec.reference.difflogic.ca_step / ca_step_bwd): gradients of state and both logits against central
differences of the reference rollout, cached and checkpointed alike, and the clamp. The GPU twin:
test_gpu_difflogic_ca.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _difflogic_ca  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402


def split(arch, wires, perception_logits, update_logits):
    """The ops' flat layout as the reference's lists: wires (2, wired) -> [(a, b)] per perception layer after
    the first and per update layer; logits (K, Gp, 16) / (Gu, 16) -> one array per layer."""
    _, _, perceive, update = _difflogic_ca.ARCHS[arch]
    w = np.asarray(wires)
    cols = np.cumsum((0,) + perceive[1:] + update)
    layers = [(w[0, a:b], w[1, a:b]) for a, b in zip(cols[:-1], cols[1:])]
    pc, uc = np.cumsum((0,) + perceive), np.cumsum((0,) + update)
    pl, ul = np.asarray(perception_logits, dtype=np.float64), np.asarray(update_logits, dtype=np.float64)
    return (layers[:len(perceive) - 1], layers[len(perceive) - 1:],
            [pl[:, a:b] for a, b in zip(pc[:-1], pc[1:])], [ul[a:b] for a, b in zip(uc[:-1], uc[1:])])


def _np(t):
    return None if t is None else t.detach().cpu().double().numpy()


def reference_call(op, state, perm, wires, pl, ul, fire, *rest, arch, periodic, mode="soft"):
    perception, update, pls, uls = split(arch, wires, _np(pl), _np(ul))
    args = (perm.numpy(), perception, update, pls, uls)
    if op == "difflogic.ca.step.fwd":
        out = dl_ref.ca_step(_np(state), *args, periodic=periodic, fire=_np(fire), hard=mode == "hard")
        return (torch.from_numpy(out).to(state.dtype),)
    assert op == "difflogic.ca.step.bwd"
    ds, dp, du = dl_ref.ca_step_bwd(_np(rest[0]), _np(state), *args, periodic=periodic, fire=_np(fire))
    return (torch.from_numpy(ds).reshape(state.shape).to(state.dtype),
            torch.from_numpy(np.concatenate(dp, axis=1)).to(pl.dtype), torch.from_numpy(np.concatenate(du)).to(ul.dtype))


@pytest.fixture
def on_reference(monkeypatch):
    monkeypatch.setattr(_difflogic_ca, "call", reference_call)


def test_checkerboard_construction():
    torch.manual_seed(3)
    ca = kspec.nn.DiffLogicCA()  # the notebook's checkerboard
    assert ca.arch == "checkerboard"
    assert ca.perception_logits.shape == (16, 14, 16) and ca.update_logits.shape == (2816, 16)
    assert 16 * 14 + 2816 == 3040  # the gate count
    for p in (ca.perception_logits, ca.update_logits):
        assert (p[..., 3] == 10).all() and (p[..., :3] == 0).all() and (p[..., 4:] == 0).all()
    assert sorted(ca.perm.tolist()) == [0, 1, 2, 3, 5, 6, 7, 8] and ca.perm.dtype == torch.int32
    assert ca.wires.shape == (2, 14 - 8 + 2816) and ca.wires.dtype == torch.int32
    ca.wiring()  # every layer's wires in range
    # The first update layer (264 inputs, 256 gates) reads every input: state and perception.
    first = ca.wires[:, 6:6 + 256]
    assert set(first.flatten().tolist()) == set(range(264))
    torch.manual_seed(3)
    again = kspec.nn.DiffLogicCA()
    assert torch.equal(again.wires, ca.wires) and torch.equal(again.perm, ca.perm)
    assert set(ca.state_dict()) == {"perception_logits", "update_logits", "perm", "wires"}
    assert "arch='checkerboard'" in repr(ca)


def test_errors_name_the_argument():
    with pytest.raises(NotImplementedError, match="no compiled architecture has channels=4.*checkerboard: channels=8"):
        kspec.nn.DiffLogicCA(channels=4)
    ca = kspec.nn.DiffLogicCA(2, 2, (8, 4, 2), (6, 2))
    with pytest.raises(ValueError, match=r"state must be a \(batch, height, width, 2\) tensor, got \(1, 3, 3, 3\)"):
        ca.rollout(torch.rand(1, 3, 3, 3), 2)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        ca.rollout(torch.rand(1, 3, 3, 2), 0)
    with pytest.raises(ValueError, match=r"fire_masks must be \(steps, batch, height, width\) = \(2, 1, 3, 3\)"):
        ca.rollout(torch.rand(1, 3, 3, 2), 2, fire_masks=torch.ones(1, 1, 3, 3))
    with torch.no_grad():
        ca.wires[0, 12] = 6  # the update's second layer (columns 12, 13) has 6 inputs
    with pytest.raises(ValueError, match=r"wires\[:, 12:14\] \(a layer of 2 gates on 6 inputs\) must lie in \[0, 6\)"):
        ca.rollout(torch.rand(1, 3, 3, 2), 1)
    with torch.no_grad():
        ca.perm[0] = 4
    with pytest.raises(ValueError, match="perm must be a permutation"):
        ca.rollout(torch.rand(1, 3, 3, 2), 1)


def _model(seed, periodic, clip=None):
    torch.manual_seed(seed)
    ca = kspec.nn.DiffLogicCA(2, 2, (8, 4, 2), (6, 2), periodic=periodic, grad_clip=clip).double()
    with torch.no_grad():  # away from the pass-through init, so every gate's gradient matters
        ca.perception_logits.normal_(0, 2)
        ca.update_logits.normal_(0, 2)
    return ca


def _reference_rollout(ca, s0, fire):
    perception, update, pls, uls = split(ca.arch, ca.wires, _np(ca.perception_logits), _np(ca.update_logits))
    s = s0
    for t in range(fire.shape[0] if fire is not None else 3):
        s = dl_ref.ca_step(s, ca.perm.numpy(), perception, update, pls, uls, periodic=ca.periodic,
                           fire=None if fire is None else fire[t])
    return s


@pytest.mark.parametrize("periodic,masked", [(False, False), (True, True)])
def test_rollout_bptt_matches_central_differences(on_reference, periodic, masked):
    ca = _model(5, periodic)
    g = torch.Generator().manual_seed(1)
    s0 = torch.rand(2, 3, 4, 2, generator=g, dtype=torch.float64)
    fire = (torch.rand(3, 2, 3, 4, generator=g) < 0.7).double() if masked else None
    w = torch.randn(2, 3, 4, 2, generator=g, dtype=torch.float64)
    grads = {}
    for checkpoint in (False, True):
        s = s0.clone().requires_grad_()
        out = ca.rollout(s, 3, fire_masks=fire, checkpoint=checkpoint)
        np.testing.assert_allclose(_np(out), _reference_rollout(ca, _np(s0), _np(fire)), atol=1e-12)
        ca.zero_grad()
        (out * w).sum().backward()
        grads[checkpoint] = [s.grad.clone(), ca.perception_logits.grad.clone(), ca.update_logits.grad.clone()]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)  # recomputed states are the cached ones
    rng = np.random.default_rng(0)

    def loss():
        return float((_reference_rollout(ca, _np(s0), _np(fire)) * _np(w)).sum())

    for tensor, grad in zip((s0, ca.perception_logits.data, ca.update_logits.data), grads[False]):
        flat, gflat = tensor.view(-1), grad.view(-1)
        for j in rng.choice(flat.numel(), 8, replace=False):
            old = float(flat[j])
            flat[j] = old + 1e-6
            up = loss()
            flat[j] = old - 1e-6
            down = loss()
            flat[j] = old
            assert abs((up - down) / 2e-6 - float(gflat[j])) <= 1e-6 * max(1.0, abs(float(gflat[j]))), (j, tensor.shape)


def test_rollout_gradient_clamp_and_hard(on_reference):
    ca = _model(7, False, clip=1e-3)
    s0 = torch.rand(1, 3, 3, 2, dtype=torch.float64)
    ca.rollout(s0, 2).sum().backward()
    assert ca.update_logits.grad.abs().max() == 1e-3  # clamped (the unclamped gradient is larger)
    ca.grad_clip = None
    ca.zero_grad()
    ca.rollout(s0, 2).sum().backward()
    assert ca.update_logits.grad.abs().max() > 1e-3
    hard = ca.rollout(s0, 2, hard=True)
    assert not hard.requires_grad
    perception, update, pls, uls = split(ca.arch, ca.wires, _np(ca.perception_logits), _np(ca.update_logits))
    want = _np(s0)
    for _ in range(2):
        want = dl_ref.ca_step(want, ca.perm.numpy(), perception, update, pls, uls, hard=True)
    np.testing.assert_allclose(_np(hard), want, atol=1e-12)

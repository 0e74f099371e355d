"""The fused AdamW op and kspec.optim.AdamW on the GPU: against the float64 reference for every option
(fp32 params, bf16/fp16 params with fp32 master, AMSGrad, maximize, clipping, grad scaling with a
skipped step), tensors of odd sizes in long lists, against torch.optim.AdamW(fused=True) itself, and the
state_dict round trip with torch's AdamW."""
import numpy as np
import pytest

from helpers import rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import adamw as ref  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(1,), (3,), (33, 7), (4097,), (65536 + 5,), (2, 3, 5), (130000,)]


def _np(t):
    return t.detach().double().cpu().numpy()


def _lists(shapes, dtype, gdtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    master = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    params = [m.to(dtype) for m in master]
    grads = [torch.randn(s, device="cuda", generator=g).to(gdtype) for s in shapes]
    m = [torch.randn(s, device="cuda", generator=g) * 0.1 for s in shapes]
    v = [torch.rand(s, device="cuda", generator=g) * 0.01 for s in shapes]
    return params, grads, m, v, master


@pytest.mark.parametrize("pdt,gdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
@pytest.mark.parametrize("scale", [None, 1024.0])
@pytest.mark.parametrize("config", [None, "threads=256,vec=1,chunk=16384", "threads=512,vec=4,chunk=16384"])
def test_op_matches_reference(pdt, gdt, amsgrad, maximize, max_norm, scale, config):
    params, grads, m, v, master = _lists(SHAPES, pdt, gdt, 0)
    if scale:
        grads = [(g.float() * scale).to(gdt) for g in grads]
    vmax = [x * 2 for x in v] if amsgrad else None
    low = pdt != torch.float32
    rp = [_np(x) for x in (master if low else params)]
    rm, rv = [_np(x) for x in m], [_np(x) for x in v]
    rvmax = [_np(x) for x in vmax] if amsgrad else None
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=3, maximize=maximize,
              max_norm=max_norm)
    found, norm = ref.adamw_step(rp, [_np(g) for g in grads], rm, rv, rvmax,
                                 grad_scale=scale, **{k: v_ for k, v_ in kw.items()})
    fi, gn = torch.full((1,), 7.0, device="cuda"), torch.full((1,), 7.0, device="cuda")
    gs = torch.tensor([scale], device="cuda") if scale else None
    kspec.call("adamw", params, grads, m, v, master if low else None, vmax, gs, out=(fi, gn), config=config, **kw)
    assert fi.item() == 0.0 and not found
    assert abs(gn.item() - norm) <= 1e-5 * norm
    got = master if low else params
    for i in range(len(SHAPES)):
        assert rel_err(_np(got[i]), rp[i]) <= 1e-5, f"param {i}"
        assert rel_err(_np(m[i]), rm[i]) <= 1e-5 and rel_err(_np(v[i]), rv[i]) <= 1e-5, f"moments {i}"
        if amsgrad:
            assert rel_err(_np(vmax[i]), rvmax[i]) <= 1e-5
        if low:  # the parameter is the master's rounding
            assert torch.equal(params[i], master[i].to(pdt))


def test_inf_gradient_skips_the_step():
    params, grads, m, v, _ = _lists(SHAPES, torch.float32, torch.float32, 1)
    grads[3][17] = float("nan")
    before = [t.clone() for t in params + m + v]
    fi = torch.zeros(1, device="cuda")
    kspec.call("adamw", params, grads, m, v, None, None, torch.tensor([2.0], device="cuda"), out=(fi, None), step=1)
    assert fi.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v))


def test_many_tensors_and_determinism():
    shapes = [(int(n),) for n in np.random.default_rng(0).integers(1, 5000, size=700)]
    a = _lists(shapes, torch.float32, torch.float32, 2)
    b = [[t.clone() for t in lst] for lst in a]
    for lists in (a, b):
        kspec.call("adamw", *lists[:4], None, None, None, out=(None, torch.zeros(1, device="cuda")), step=1,
                   max_norm=0.5)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_optimizer_matches_torch_fused_adamw(amsgrad, maximize):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 7)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 7)).cuda()
    twin.load_state_dict(model.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    ours = kspec.optim.AdamW(model.parameters(), **kw)
    theirs = torch.optim.AdamW(twin.parameters(), fused=True, **kw)
    for _ in range(5):
        x = torch.randn(16, 33, device="cuda")
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert rel_err(_np(a), _np(b)) <= 1e-5
    # state_dict names and values compatible both ways
    sd = ours.state_dict()
    theirs2 = torch.optim.AdamW(twin.parameters(), fused=True, **kw)
    theirs2.load_state_dict(sd)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert k in sd["state"][0]
    assert float(sd["state"][0]["step"]) == 5.0
    ours2 = kspec.optim.AdamW(model.parameters(), **kw)
    ours2.load_state_dict(theirs.state_dict())
    assert float(ours2.state[next(model.parameters())]["step"]) == 5.0


def test_optimizer_bf16_master_and_clipping():
    torch.manual_seed(1)
    p32 = torch.randn(1000, 33, device="cuda")
    p = torch.nn.Parameter(p32.to(torch.bfloat16))
    opt = kspec.optim.AdamW([p], lr=1e-2, weight_decay=0.0, max_grad_norm=0.1)
    g = torch.randn(1000, 33, device="cuda")
    p.grad = g.to(torch.bfloat16)
    opt.step()
    # the master copy starts from the bf16 parameter the optimizer was given (it never saw p32)
    rp, rm, rv = [_np(p32.to(torch.bfloat16))], [np.zeros(p.shape)], [np.zeros(p.shape)]
    ref.adamw_step(rp, [_np(p.grad)], rm, rv, lr=1e-2, weight_decay=0.0, step=1, max_norm=0.1)
    assert rel_err(_np(opt.state[p]["master"]), rp[0]) <= 1e-5
    assert opt.grad_norm is not None and abs(opt.grad_norm.item() - np.linalg.norm(_np(p.grad))) < 1e-2

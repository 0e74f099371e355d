"""kspec.nn's drop-ins: RMSNorm / LayerNorm (torch.nn's and Liger's state dicts, strictly, both ways; a
fused activation) and the Mamba block (mamba_ssm.modules.mamba_simple.Mamba's parameter names and
shapes, checked against a float64 torch implementation of the same block written here). Without a GPU
the modules run their torch paths; on a GPU kspec's kernels against the same references (and against
mamba_ssm itself where it is installed)."""
import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kspec  # noqa: E402
import kspec.nn  # noqa: E402

# ---- RMSNorm / LayerNorm ----

ACTS = {"none": lambda t: t, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "gelu_erf": F.gelu}


def _randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("make, theirs", [
    (lambda: kspec.nn.RMSNorm(64), lambda: torch.nn.RMSNorm(64)),
    (lambda: kspec.nn.RMSNorm((4, 16), eps=1e-6), lambda: torch.nn.RMSNorm((4, 16), eps=1e-6)),
    (lambda: kspec.nn.RMSNorm(64, elementwise_affine=False), lambda: torch.nn.RMSNorm(64, elementwise_affine=False)),
    (lambda: kspec.nn.LayerNorm(64), lambda: torch.nn.LayerNorm(64)),
    (lambda: kspec.nn.LayerNorm(64, bias=False), lambda: torch.nn.LayerNorm(64, bias=False)),
    (lambda: kspec.nn.LayerNorm(64, elementwise_affine=False),
     lambda: torch.nn.LayerNorm(64, elementwise_affine=False)),
], ids=["rms", "rms_2d", "rms_no_affine", "ln", "ln_no_bias", "ln_no_affine"])
def test_norm_state_dicts_load_strictly_both_ways(make, theirs):
    ours, ref = make(), _randomize(theirs())
    ours.load_state_dict(ref.state_dict(), strict=True)
    _randomize(ours, seed=1)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, ours.state_dict()[k]), k
    x = torch.randn(3, 5, *ref.normalized_shape)
    torch.testing.assert_close(ours(x), ref(x))  # the torch path off CUDA


def test_norm_loads_liger_state_dicts():
    """LigerRMSNorm(hidden_size) has `weight` only; LigerLayerNorm(hidden_size) always has `weight` and
    `bias` (its bias flag picks their initialization)."""
    kspec.nn.RMSNorm(32).load_state_dict({"weight": torch.randn(32)}, strict=True)
    kspec.nn.LayerNorm(32).load_state_dict({"weight": torch.randn(32), "bias": torch.randn(32)}, strict=True)


@pytest.mark.parametrize("act", ["none", "silu", "gelu_tanh", "gelu_erf", "identity", "gelu", None])
def test_norm_activation_off_cuda(act):
    ours = _randomize(kspec.nn.LayerNorm(48, act=act))
    ref = torch.nn.LayerNorm(48)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(7, 48)
    canonical = kspec.ops.canonical_act(act)
    assert ours.act == canonical and (canonical == "none" or f"act={canonical!r}" in repr(ours))
    torch.testing.assert_close(ours(x), ACTS[canonical](ref(x)))


def test_norm_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kspec.nn.RMSNorm: act must be one of none, silu, gelu_tanh, gelu_erf"):
        kspec.nn.RMSNorm(8, act="relu")
    with pytest.raises(ValueError, match="does not end in normalized_shape"):
        kspec.nn.LayerNorm(8)(torch.randn(2, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "ln", "ln_no_bias", "rms_no_affine"])
@pytest.mark.parametrize("act", ["none", "silu", "gelu"])
def test_gpu_norm_forward_backward_vs_torch(kind, act, dtype):
    hidden = 1024
    ours = {"rms": lambda: kspec.nn.RMSNorm(hidden, eps=1e-6, act=act),
            "ln": lambda: kspec.nn.LayerNorm(hidden, act=act),
            "ln_no_bias": lambda: kspec.nn.LayerNorm(hidden, bias=False, act=act),
            "rms_no_affine": lambda: kspec.nn.RMSNorm(hidden, elementwise_affine=False, act=act)}[kind]()
    ref = {"rms": lambda: torch.nn.RMSNorm(hidden, eps=1e-6), "ln": lambda: torch.nn.LayerNorm(hidden),
           "ln_no_bias": lambda: torch.nn.LayerNorm(hidden, bias=False),
           "rms_no_affine": lambda: torch.nn.RMSNorm(hidden, elementwise_affine=False)}[kind]()
    _randomize(ours)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours, ref = ours.cuda().to(dtype), ref.cuda().double()
    x = torch.randn(4, 33, hidden, device="cuda", dtype=dtype, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    y, yr = ours(x), ACTS[kspec.ops.canonical_act(act)](ref(xr))
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    assert y.dtype == dtype and rel(y, yr) <= tol
    assert rel(x.grad, xr.grad) <= tol
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, q.grad) <= tol * 4, n  # summed over 132 rows


# ---- Mamba ----

def mamba_param_shapes(d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", conv_bias=True, bias=False):
    """mamba_ssm.modules.mamba_simple.Mamba's state dict: names and shapes (its source, read for facts)."""
    di = int(expand * d_model)
    r = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
    shapes = {"A_log": (di, d_state), "D": (di,), "in_proj.weight": (2 * di, d_model),
              "conv1d.weight": (di, 1, d_conv), "x_proj.weight": (r + 2 * d_state, di),
              "dt_proj.weight": (di, r), "dt_proj.bias": (di,), "out_proj.weight": (d_model, di)}
    if conv_bias:
        shapes["conv1d.bias"] = (di,)
    if bias:
        shapes["in_proj.bias"] = (2 * di,)
        shapes["out_proj.bias"] = (d_model,)
    return shapes


def mamba_reference(sd, h, d_state, dt_rank):
    """The Mamba-1 block in float64 from a state dict, written from the paper's equations (not kspec's
    code): h (batch, L, d_model) -> (out, conv_state (batch, d_inner, d_conv): the last d_conv inputs
    of the conv, zeros before the first; ssm_state (batch, d_inner, d_state): the last state)."""
    sd = {k: v.double() for k, v in sd.items()}
    h = h.double()
    batch, L, _ = h.shape
    xz = h @ sd["in_proj.weight"].T + sd.get("in_proj.bias", 0.0)
    di = xz.shape[-1] // 2
    x, z = xz[..., :di], xz[..., di:]
    w = sd["conv1d.weight"][:, 0]  # (di, K)
    K = w.shape[1]
    xp = torch.cat([torch.zeros(batch, K - 1, di, dtype=h.dtype), x], dim=1)  # causal: K - 1 zeros before
    xc = sum(xp[:, k:k + L] * w[:, k] for k in range(K)) + sd.get("conv1d.bias", 0.0)
    new_conv = xp[:, -K:].transpose(1, 2)
    x = xc * torch.sigmoid(xc)
    dbl = x @ sd["x_proj.weight"].T
    dt, B, C = dbl[..., :dt_rank], dbl[..., dt_rank:dt_rank + d_state], dbl[..., dt_rank + d_state:]
    dt = F.softplus(dt @ sd["dt_proj.weight"].T + sd["dt_proj.bias"])  # (batch, L, di)
    A = -torch.exp(sd["A_log"])
    s = torch.zeros(batch, di, d_state, dtype=h.dtype)
    ys = []
    for t in range(L):
        s = torch.exp(dt[:, t, :, None] * A) * s + (dt[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((s * C[:, t, None, :]).sum(-1) + sd["D"] * x[:, t])
    y = torch.stack(ys, dim=1) * (z * torch.sigmoid(z))
    return y @ sd["out_proj.weight"].T + sd.get("out_proj.bias", 0.0), new_conv, s


def random_mamba_state(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(s, generator=g, dtype=torch.float64) / math.sqrt(s[-1]) for k, s in shapes.items()}
    sd["A_log"] = torch.log(torch.rand(shapes["A_log"], generator=g, dtype=torch.float64) * 4 + 0.5)
    sd["dt_proj.bias"] = torch.rand(shapes["dt_proj.bias"], generator=g, dtype=torch.float64) * 4 - 5
    return sd


MAMBA_CONFIGS = {"default": dict(d_model=32), "biases": dict(d_model=24, bias=True, d_state=8, expand=1.5),
                 "no_conv_bias": dict(d_model=40, conv_bias=False, d_conv=3, dt_rank=5)}


@pytest.mark.parametrize("cfg", list(MAMBA_CONFIGS))
def test_mamba_parameters_match_mamba_ssm(cfg):
    kw = MAMBA_CONFIGS[cfg]
    m = kspec.nn.Mamba(**kw)
    shapes = mamba_param_shapes(**kw)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == shapes
    sd = random_mamba_state(shapes)
    m.load_state_dict(sd, strict=True)  # mamba_ssm's keys load strictly ...
    assert m.state_dict().keys() == sd.keys()  # ... and kspec's state dict is one mamba_ssm loads strictly
    # mamba_ssm's initialization: A = -(1..d_state), D = 1, softplus(dt bias) in [dt_min, dt_max]
    m = kspec.nn.Mamba(**kw)
    torch.testing.assert_close(m.A_log, torch.log(torch.arange(1, m.d_state + 1.0)).repeat(m.d_inner, 1))
    assert torch.equal(m.D.detach(), torch.ones(m.d_inner)) and m.A_log.dtype == m.D.dtype == torch.float32
    dt = F.softplus(m.dt_proj.bias.detach())
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001


@pytest.mark.parametrize("cfg", list(MAMBA_CONFIGS))
def test_mamba_torch_path_matches_reference(cfg):
    """Off CUDA the block runs its torch loop: the wiring (splits, conv, scan, gate) against the
    reference in float64, forward and backward."""
    kw = MAMBA_CONFIGS[cfg]
    m = kspec.nn.Mamba(**kw).double()
    sd = random_mamba_state(mamba_param_shapes(**kw))
    m.load_state_dict(sd)
    h = torch.randn(2, 11, kw["d_model"], dtype=torch.float64, requires_grad=True)
    ref_sd = {k: v.clone().requires_grad_() for k, v in sd.items()}
    hr = h.detach().clone().requires_grad_()
    out = m(h)
    want, _, _ = mamba_reference(ref_sd, hr, m.d_state, m.dt_rank)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-9, atol=1e-12)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref_sd[k].grad, rtol=1e-9, atol=1e-12, msg=k)


def test_mamba_decode_matches_forward_off_cuda():
    """step() token by token and forward() with inference params (prefill, then one token per call)
    give the full forward's outputs and the reference's states."""
    kw = MAMBA_CONFIGS["biases"]
    m = kspec.nn.Mamba(**kw, layer_idx=0).double()
    m.load_state_dict(random_mamba_state(mamba_param_shapes(**kw), seed=3))
    h = torch.randn(3, 9, kw["d_model"], dtype=torch.float64)
    with torch.no_grad():
        full = m(h)
        conv, ssm = m.allocate_inference_cache(3, 9, dtype=torch.float64)
        assert conv.shape == (3, m.d_inner, m.d_conv) and ssm.shape == (3, m.d_inner, m.d_state)
        outs = [m.step(h[:, t:t + 1], conv, ssm)[0] for t in range(9)]
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
        _, want_conv, want_ssm = mamba_reference(m.state_dict(), h, m.d_state, m.dt_rank)
        torch.testing.assert_close(conv, want_conv)
        torch.testing.assert_close(ssm, want_ssm)

        params = types.SimpleNamespace(key_value_memory_dict={0: m.allocate_inference_cache(3, 9, torch.float64)},
                                       seqlen_offset=0)
        first = m(h[:, :5], params)
        params.seqlen_offset = 5
        rest = [m(h[:, t:t + 1], params) for t in range(5, 9)]
        torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-10, atol=1e-12)


def test_mamba_bad_arguments():
    with pytest.raises(ValueError, match="dt_init must be"):
        kspec.nn.Mamba(16, dt_init="normal")
    m = kspec.nn.Mamba(16)
    conv, ssm = m.allocate_inference_cache(2, 4)
    assert ssm.dtype == torch.float32 and conv.dtype == m.conv1d.weight.dtype
    with pytest.raises(ValueError, match=r"step: hidden_states must be \(batch, 1, d_model\)"):
        m.step(torch.randn(2, 3, 16), conv, ssm)
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(2, 3, 16), types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", list(MAMBA_CONFIGS))
def test_gpu_mamba_forward_backward_vs_reference(cfg, dtype):
    kw = MAMBA_CONFIGS[cfg]
    m = kspec.nn.Mamba(**kw)
    sd = random_mamba_state(mamba_param_shapes(**kw), seed=5)
    m.load_state_dict(sd)
    m = m.cuda().to(dtype)
    h = torch.randn(2, 77, kw["d_model"], device="cuda", dtype=dtype, requires_grad=True)
    out = m(h)
    ref_sd = {k: v.cpu().double().requires_grad_() for k, v in m.state_dict().items()}  # the rounded weights
    hr = h.detach().cpu().double().requires_grad_()
    want, _, _ = mamba_reference(ref_sd, hr, m.d_state, m.dt_rank)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy.cpu().double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and _rel(out.cpu(), want) <= tol
    assert _rel(h.grad.cpu(), hr.grad) <= tol
    for k, p in m.named_parameters():
        assert _rel(p.grad.cpu(), ref_sd[k].grad) <= 2 * tol, k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mamba_step_matches_forward(dtype):
    kw = MAMBA_CONFIGS["default"]
    m = kspec.nn.Mamba(**kw)
    m.load_state_dict(random_mamba_state(mamba_param_shapes(**kw), seed=7))
    m = m.cuda().to(dtype)
    h = torch.randn(3, 20, kw["d_model"], device="cuda", dtype=dtype)
    with torch.no_grad():
        full = m(h)
        conv, ssm = m.allocate_inference_cache(3, 20)
        outs = torch.cat([m.step(h[:, t:t + 1], conv, ssm)[0] for t in range(20)], dim=1)
        _, _, want_ssm = mamba_reference({k: v.cpu() for k, v in m.state_dict().items()}, h.cpu(), m.d_state,
                                         m.dt_rank)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(outs, full) <= tol and _rel(ssm.cpu(), want_ssm) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mamba_vs_mamba_ssm(dtype):
    """mamba_ssm's own block and kspec's, each strictly loading the other's state dict: forward, the input's
    and every parameter's gradient (paired by name), and 8 decode steps with their final conv and SSM
    states agree to the dtype's tolerance."""
    mamba_simple = pytest.importorskip("mamba_ssm.modules.mamba_simple")
    torch.manual_seed(0)
    ours = kspec.nn.Mamba(64).cuda().to(dtype)
    theirs = mamba_simple.Mamba(64).cuda().to(dtype)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    h = torch.randn(2, 128, 64, device="cuda", dtype=dtype, requires_grad=True)
    h2 = h.detach().clone().requires_grad_()
    a, b = ours(h), theirs(h2)
    dy = torch.randn_like(a)
    a.backward(dy)
    b.backward(dy)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert _rel(a, b) <= tol and _rel(h.grad, h2.grad) <= tol
    their_params = dict(theirs.named_parameters())
    assert their_params.keys() == dict(ours.named_parameters()).keys()
    for k, p in ours.named_parameters():
        q = their_params[k]
        assert p.grad is not None and q.grad is not None, k
        assert _rel(p.grad, q.grad) <= 2 * tol, k
    with torch.no_grad():
        c1, s1 = ours.allocate_inference_cache(2, 8)
        c2, s2 = theirs.allocate_inference_cache(2, 8, dtype=torch.float32)
        c2 = c2.to(c1.dtype)
        for t in range(8):
            y1 = ours.step(h[:, t:t + 1].detach(), c1, s1)[0]
            y2 = theirs.step(h[:, t:t + 1].detach(), c2, s2)[0]
            assert _rel(y1, y2) <= tol
        assert _rel(c1, c2) <= tol and _rel(s1.float(), s2.float()) <= tol

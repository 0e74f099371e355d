"""torch glue for mhc (issue 34): the family specs of the pre op (and its pre_only head), the post op and
Sinkhorn-Knopp, and post(l) fused with pre(l + 1) (kspec._surface makes the custom ops kspec::mhc_pre_fwd/_bwd,
mhc_pre_only_*, mhc_post_*, mhc_sinkhorn_*, mhc_post_pre_*, their fakes from the OpDefs' schemas, autograd and
the eager path). The pre op's inv and h (100 B a token at n = 4) are what its backward reads; they carry no
gradient."""
from __future__ import annotations

import sys

import torch

from . import _core, ops
from ._core import call
from ._surface import Family, build

EPS = 1e-6
T_MAX = 20


def _c(t):
    """A gradient as the kernels read it: autograd's may be any view (y.sum() gives strides 0)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _pre_bwd(dy, x, phi, alpha, bias, gamma, inv, h, dh_pre, dh_post, dr, eps_rms, eps_pre, eps_sk, t_max):
    if dy is None:
        dy = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    return call("mhc.pre.bwd", _c(dy), x, phi, alpha, bias, gamma, inv, h, _c(dh_pre), _c(dh_post), _c(dr), None,
                eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk, t_max=t_max)


def _pre_only_bwd(dy, x, phi, alpha, bias, gamma, inv, h, dh_pre, eps_rms, eps_pre):
    if dy is None:
        dy = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    return call("mhc.pre_only.bwd", _c(dy), x, phi, alpha, bias, gamma, inv, h, _c(dh_pre), None,
                eps_rms=eps_rms, eps_pre=eps_pre)


def _pre_bwd_fake(dy, x, phi, alpha, bias, gamma, *_):
    return (x.new_empty(x.shape), torch.empty_like(phi), torch.empty_like(alpha), torch.empty_like(bias),
            None if gamma is None else torch.empty_like(gamma))


_PARAMS = "Tensor x, Tensor phi, Tensor alpha, Tensor bias, Tensor? gamma"
_SAVED = "Tensor inv, Tensor h"
_OUT = ("dx", "dphi", "dalpha", "dbias", "dgamma")


# inv and h are outputs only where a backward will read them (save_stats): without a gradient the forward
# allocates and writes neither.
def _pre_fwd(x, phi, alpha, bias, gamma, eps_rms, eps_pre, eps_sk, t_max, save_stats, save):
    return call("mhc.pre.fwd", x, phi, alpha, bias, gamma, eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk,
                t_max=t_max, save_stats=bool(save_stats and save))


def _pre_only_fwd(x, phi, alpha, bias, gamma, eps_rms, eps_pre, save_stats, save):
    return call("mhc.pre_only.fwd", x, phi, alpha, bias, gamma, eps_rms=eps_rms, eps_pre=eps_pre,
                save_stats=bool(save_stats and save))

# The backward ops' arguments in their inputs' order (one_call: with the torch extension a call wanting a
# gradient is one C++ call, whose node runs mhc.pre.bwd without Python; a gradient that did not come is
# passed absent where the op takes it so, zeros for dy).
pre = build(Family(
    name="mhc_pre", ops=("mhc.pre.fwd", "mhc.pre.bwd"),
    fwd=_PARAMS + ", float eps_rms, float eps_pre, float eps_sk, int t_max, bool save_stats=True",
    fwd_out=("y", "h_pre", "h_post", "r", "inv", "h"), forward=_pre_fwd, save_arg="save_stats", save_required=True,
    bwd="Tensor? dy, " + _PARAMS + ", " + _SAVED + ", Tensor? dh_pre, Tensor? dh_post, Tensor? dr"
    + ", float eps_rms, float eps_pre, float eps_sk, int t_max",
    bwd_out=_OUT, backward=_pre_bwd, public=(0, 1, 2, 3), bwd_fake=_pre_bwd_fake, one_call=True))

pre_only = build(Family(
    name="mhc_pre_only", ops=("mhc.pre_only.fwd", "mhc.pre_only.bwd"),
    fwd=_PARAMS + ", float eps_rms, float eps_pre, bool save_stats=True", fwd_out=("y", "h_pre", "inv", "h"),
    forward=_pre_only_fwd, save_arg="save_stats", save_required=True,
    bwd="Tensor? dy, " + _PARAMS + ", " + _SAVED + ", Tensor? dh_pre, float eps_rms, float eps_pre",
    bwd_out=_OUT, backward=_pre_only_bwd, public=(0, 1), bwd_fake=_pre_bwd_fake, one_call=True))


def _post_bwd(dout, x, f, h_post, h_res):
    return call("mhc.post.bwd", _c(dout), x, f, h_post, h_res)


post = build(Family(
    name="mhc_post", ops=("mhc.post.fwd", "mhc.post.bwd"),
    fwd="Tensor x, Tensor f, Tensor h_post, Tensor h_res", fwd_out=("out",),
    bwd="Tensor dout, Tensor x, Tensor f, Tensor h_post, Tensor h_res", bwd_out=("dx", "df", "dh_post", "dh_res"),
    backward=_post_bwd, one_call=True))


def _sinkhorn_bwd(dr, logits, eps_sk, t_max):
    return call("mhc.sinkhorn.bwd", logits, _c(dr), eps_sk=eps_sk, t_max=t_max)


sinkhorn = build(Family(
    name="mhc_sinkhorn", ops=("mhc.sinkhorn.fwd", "mhc.sinkhorn.bwd"),
    fwd="Tensor logits, float eps_sk, int t_max", fwd_out=("r",),
    bwd="Tensor dr, Tensor logits, float eps_sk, int t_max", bwd_out=("dlogits",),
    backward=_sinkhorn_bwd, bwd_fake=lambda dr, logits, eps_sk, t_max: (torch.empty_like(logits),)))


def _post_pre_bwd(dx_next, dy, dh_pre, dh_post_next, dr_next, x, f, h_post, h_res, x_next, phi, alpha, bias, gamma,
                  inv, h, eps_rms, eps_pre, eps_sk, t_max):
    if dy is None:
        dy = f.new_zeros(f.shape)
    return call("mhc.post_pre.bwd", _c(dx_next), _c(dy), _c(dh_pre), _c(dh_post_next), _c(dr_next), x, f, h_post,
                h_res, x_next, phi, alpha, bias, gamma, inv, h, eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk,
                t_max=t_max)


# Layer l's post fused with layer l + 1's pre: x_next is written once and projected on chip (one read of
# the n streams less than post then pre); the backward runs pre.bwd's kernels then post.bwd's.
post_pre = build(Family(
    name="mhc_post_pre", ops=("mhc.post_pre.fwd", "mhc.post_pre.bwd"),
    fwd="Tensor x, Tensor f, Tensor h_post, Tensor h_res, Tensor phi, Tensor alpha, Tensor bias, Tensor? gamma, "
        "float eps_rms, float eps_pre, float eps_sk, int t_max",
    fwd_out=("x_next", "y", "h_pre", "h_post_next", "r_next", "inv", "h"),
    bwd="Tensor? dx_next, Tensor? dy, Tensor? dh_pre, Tensor? dh_post_next, Tensor? dr_next, Tensor x, Tensor f, "
        "Tensor h_post, Tensor h_res, Tensor x_next, Tensor phi, Tensor alpha, Tensor bias, Tensor? gamma, "
        "Tensor inv, Tensor h, float eps_rms, float eps_pre, float eps_sk, int t_max",
    bwd_out=("dx", "df", "dh_post", "dh_res", "dphi", "dalpha", "dbias", "dgamma"),
    backward=_post_pre_bwd, public=(0, 1, 2, 3, 4),
    bwd_fake=lambda dx_next, dy, dh_pre, dh_post_next, dr_next, x, f, h_post, h_res, x_next, phi, alpha, bias,
    gamma, *_: (x.new_empty(x.shape), f.new_empty(f.shape), torch.empty_like(h_post), torch.empty_like(h_res),
                torch.empty_like(phi), torch.empty_like(alpha), torch.empty_like(bias),
                None if gamma is None else torch.empty_like(gamma))))


# ---- the entries kspec.ops and the modules call ----
# With no gradient to record (torch.no_grad, inference_mode: a decode step) and outside torch.compile, one
# call of the forward op (_forward: the torch fast path, tensors read in C++, outputs allocated there), without
# the Surface's per-call planning; else the Surface (autograd, the custom ops under torch.compile).


def _forward(op, inputs, params):
    """kspec.call(op, *inputs, **params) without a gradient: the torch fast path called straight (no keyword
    packing: 0.4 of 4.0 us a call on the mock driver), kspec.call where it does not take the call."""
    outs = _core._call_torch(op, inputs, None, params)
    return call(op, *inputs, **params) if outs is NotImplemented else outs


# The grad check inline (not a helper: a frame less a call), then the forward alone.
def run_pre(x, phi, alpha, bias, gamma, eps_rms, eps_pre, eps_sk, t_max):
    """(y, h_pre, h_post, r)."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # no backward: inv and h are not kept (save_stats=False)
        return _forward("mhc.pre.fwd", (x, phi, alpha, bias, gamma), {
            "eps_rms": eps_rms, "eps_pre": eps_pre, "eps_sk": eps_sk, "t_max": t_max, "save_stats": False})[:4]
    return pre(x, phi, alpha, bias, gamma, eps_rms, eps_pre, eps_sk, t_max, True)  # every argument: no _full


def run_pre_only(x, phi, alpha, bias, gamma, eps_rms, eps_pre):
    """(y, h_pre)."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _forward("mhc.pre_only.fwd", (x, phi, alpha, bias, gamma),
                        {"eps_rms": eps_rms, "eps_pre": eps_pre, "save_stats": False})[:2]
    return pre_only(x, phi, alpha, bias, gamma, eps_rms, eps_pre, True)


def run_post(x, f, h_post, h_res):
    """out."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _forward("mhc.post.fwd", (x, f, h_post, h_res), {})[0]
    return post(x, f, h_post, h_res)


def run_post_pre(x, f, h_post, h_res, phi, alpha, bias, gamma, eps_rms, eps_pre, eps_sk, t_max):
    """(x_next, y, h_pre, h_post_next, r_next)."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _forward("mhc.post_pre.fwd", (x, f, h_post, h_res, phi, alpha, bias, gamma),
                        {"eps_rms": eps_rms, "eps_pre": eps_pre, "eps_sk": eps_sk, "t_max": t_max})[:5]
    return post_pre(x, f, h_post, h_res, phi, alpha, bias, gamma, eps_rms, eps_pre, eps_sk, t_max)


# ---- modules ----

RESIDUAL_LOGIT = 10.0  # R's diagonal logit at initialisation: R[j, j] > 0.9995 for n <= 8 (R ~ I)
INIT_ALPHA = 0.01


def expand(x, n: int):
    """x (..., D) -> (..., n, D): the n residual streams start as copies of x (contiguous)."""
    return x.unsqueeze(-2).repeat(*([1] * (x.dim() - 1)), n, 1)


def _init_bias(n: int, eps_pre: float, pre_only: bool, device):
    """h = bias at initialisation (phi = 0): H_pre = 1/n, H_post = 1, R ~ I."""
    pre = torch.full((n,), torch.logit(torch.tensor(1.0 / n - eps_pre, dtype=torch.float64)).item(), device=device)
    if pre_only:
        return pre
    res = torch.eye(n, device=device).flatten() * RESIDUAL_LOGIT
    return torch.cat([pre, torch.zeros(n, device=device), res])


class HyperConnection(torch.nn.Module):
    """mHC around a sublayer: x (..., n, D) -> (..., n, D), the residual widened to n streams.

    y, H_pre, H_post, R = pre(x); f = sublayer(y, *args); out = post(x, f, H_post, R) (kspec.ops.mhc_pre /
    mhc_post: out[k] = H_post[k] f + sum_j R[j, k] x[j]). Parameters phi (n*n + 2n, n*dim), alpha (3,),
    bias (n*n + 2n,), gamma (n*dim,) fp32, initialised as a plain residual: phi = 0, alpha = 0.01, H_pre = 1/n,
    H_post = 1, R ~ I (out[k] ~ x[k] + sublayer(mean of the streams)). DeepSeek-V4's hc_*_fn, hc_*_scale,
    hc_*_base load with load_deepseek(fn, scale, base)."""

    def __init__(self, dim: int, n: int = 4, sublayer=None, *, t_max: int = 20, eps_rms: float = 1e-6,
                 eps_pre: float = 1e-6, eps_sk: float = 1e-6, device=None):
        super().__init__()
        self.dim, self.n, self.sublayer = dim, n, sublayer
        self.t_max, self.eps_rms, self.eps_pre, self.eps_sk = t_max, eps_rms, eps_pre, eps_sk
        M = n * n + 2 * n
        self.phi = torch.nn.Parameter(torch.zeros(M, n * dim, device=device))
        self.alpha = torch.nn.Parameter(torch.full((3,), INIT_ALPHA, device=device))
        self.bias = torch.nn.Parameter(_init_bias(n, eps_pre, False, device))
        self.gamma = torch.nn.Parameter(torch.ones(n * dim, device=device))

    def pre(self, x):
        """(y (..., dim), H_pre, H_post, R) of x (..., n, dim)."""
        return run_pre(x, self.phi, self.alpha, self.bias, self.gamma, float(self.eps_rms),
                       float(self.eps_pre), float(self.eps_sk), int(self.t_max))

    def post(self, x, f, h_post, r):
        """The next layer's streams (..., n, dim)."""
        return run_post(x, f, h_post, r)

    def post_pre(self, x, f, h_post, r):
        """The previous layer's post (its output f, H_post, R on its input x) fused with this layer's pre:
        (x_next (..., n, dim), y, H_pre, H_post, R), as post then self.pre but reading the streams once less."""
        return run_post_pre(x, f, h_post, r, self.phi, self.alpha, self.bias, self.gamma, float(self.eps_rms),
                            float(self.eps_pre), float(self.eps_sk), int(self.t_max))

    def forward(self, x, *args, **kwargs):
        if self.sublayer is None:
            raise ValueError("kspec.nn.HyperConnection: no sublayer (construct with one, or call .pre/.post)")
        y, _, h_post, r = self.pre(x)
        return self.post(x, self.sublayer(y, *args, **kwargs), h_post, r)

    @torch.no_grad()
    def load_deepseek(self, fn, scale, base):
        """DeepSeek-V4's hc_*_fn (M, n*dim), hc_*_scale (3,), hc_*_base (M,) as phi, alpha, bias."""
        for name, p, t in (("fn", self.phi, fn), ("scale", self.alpha, scale), ("base", self.bias, base)):
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"kspec.nn.HyperConnection.load_deepseek: {name} must be {tuple(p.shape)}, got "
                                 f"{tuple(t.shape)}")
            p.copy_(t)

    def extra_repr(self):
        return f"dim={self.dim}, n={self.n}, t_max={self.t_max}"


class HyperConnectionHead(torch.nn.Module):
    """The final collapse of the n streams: x (..., n, dim) -> y (..., dim) = sum_i H_pre[i] x[i]
    (kspec.ops.mhc_pre(pre_only=True)). Parameters phi (n, n*dim), alpha (1,), bias (n,), gamma (n*dim,),
    initialised to the mean of the streams (phi = 0, H_pre = 1/n)."""

    def __init__(self, dim: int, n: int = 4, *, eps_rms: float = 1e-6, eps_pre: float = 1e-6, device=None):
        super().__init__()
        self.dim, self.n, self.eps_rms, self.eps_pre = dim, n, eps_rms, eps_pre
        self.phi = torch.nn.Parameter(torch.zeros(n, n * dim, device=device))
        self.alpha = torch.nn.Parameter(torch.full((1,), INIT_ALPHA, device=device))
        self.bias = torch.nn.Parameter(_init_bias(n, eps_pre, True, device))
        self.gamma = torch.nn.Parameter(torch.ones(n * dim, device=device))

    def forward(self, x):
        return run_pre_only(x, self.phi, self.alpha, self.bias, self.gamma, float(self.eps_rms),
                            float(self.eps_pre))[0]


class HyperConnectionStack(torch.nn.Module):
    """HyperConnection layers applied in turn, x (..., n, dim) -> (..., n, dim), with each layer's post fused
    with the next one's pre (kspec.ops.mhc_post_pre): the same result as x = layer(x) for each layer, one read
    of the n streams less per boundary (537 MB at T 16384, n 4, D 4096 bf16). The layers keep their own
    parameters and sublayers (a state dict's keys are layers.<i>.*); args and kwargs go to every sublayer."""

    def __init__(self, layers):
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("kspec.nn.HyperConnectionStack: layers must hold at least one HyperConnection")
        for i, layer in enumerate(layers):
            if not isinstance(layer, HyperConnection) or layer.sublayer is None:
                raise ValueError(f"kspec.nn.HyperConnectionStack: layers[{i}] must be a HyperConnection with a "
                                 f"sublayer, got {type(layer).__name__}")
            if (layer.dim, layer.n) != (layers[0].dim, layers[0].n):
                raise ValueError(f"kspec.nn.HyperConnectionStack: layers[{i}] has dim={layer.dim}, n={layer.n}; "
                                 f"layers[0] has dim={layers[0].dim}, n={layers[0].n}")
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, *args, **kwargs):
        first = self.layers[0]
        y, _, h_post, r = first.pre(x)
        f = first.sublayer(y, *args, **kwargs)
        for layer in self.layers[1:]:
            x, y, _, h_post, r = layer.post_pre(x, f, h_post, r)
            f = layer.sublayer(y, *args, **kwargs)
        return self.layers[-1].post(x, f, h_post, r)


ops._mhc = sys.modules[__name__]  # kspec.ops' mhc entries read it per call (no import statement)

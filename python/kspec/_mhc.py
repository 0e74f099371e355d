"""torch glue for mhc (issue 34): the family specs of the pre op (and its pre_only head), the post op and
Sinkhorn-Knopp (kspec._surface makes the custom ops kspec::mhc_pre_fwd/_bwd, mhc_pre_only_*, mhc_post_*,
mhc_sinkhorn_*, their fakes from the OpDefs' schemas, autograd and the eager path). The pre op's inv and h
(100 B a token at n = 4) are what its backward reads; they carry no gradient."""
from __future__ import annotations

import torch

from ._core import call
from ._surface import Family, build

EPS = 1e-6
T_MAX = 20


def _c(t):
    """A gradient as the kernels read it: autograd's may be any view (y.sum() gives strides 0)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _pre_bwd(dy, dh_pre, dh_post, dr, x, phi, alpha, bias, gamma, inv, h, eps_rms, eps_pre, eps_sk, t_max):
    if dy is None:
        dy = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    return call("mhc.pre.bwd", _c(dy), x, phi, alpha, bias, gamma, inv, h, _c(dh_pre), _c(dh_post), _c(dr), None,
                eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk, t_max=t_max)


def _pre_only_bwd(dy, dh_pre, x, phi, alpha, bias, gamma, inv, h, eps_rms, eps_pre):
    if dy is None:
        dy = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    return call("mhc.pre_only.bwd", _c(dy), x, phi, alpha, bias, gamma, inv, h, _c(dh_pre), None,
                eps_rms=eps_rms, eps_pre=eps_pre)


_PARAMS = "Tensor x, Tensor phi, Tensor alpha, Tensor bias, Tensor? gamma"
_SAVED = "Tensor inv, Tensor h"
_OUT = ("dx", "dphi", "dalpha", "dbias", "dgamma")

pre = build(Family(
    name="mhc_pre", ops=("mhc.pre.fwd", "mhc.pre.bwd"),
    fwd=_PARAMS + ", float eps_rms, float eps_pre, float eps_sk, int t_max",
    fwd_out=("y", "h_pre", "h_post", "r", "inv", "h"),
    bwd="Tensor? dy, Tensor? dh_pre, Tensor? dh_post, Tensor? dr, " + _PARAMS + ", " + _SAVED
    + ", float eps_rms, float eps_pre, float eps_sk, int t_max",
    bwd_out=_OUT, backward=_pre_bwd, public=(0, 1, 2, 3),
    bwd_fake=lambda dy, dh_pre, dh_post, dr, x, phi, alpha, bias, gamma, *_: (
        x.new_empty(x.shape), torch.empty_like(phi), torch.empty_like(alpha), torch.empty_like(bias),
        None if gamma is None else torch.empty_like(gamma))))

pre_only = build(Family(
    name="mhc_pre_only", ops=("mhc.pre_only.fwd", "mhc.pre_only.bwd"),
    fwd=_PARAMS + ", float eps_rms, float eps_pre", fwd_out=("y", "h_pre", "inv", "h"),
    bwd="Tensor? dy, Tensor? dh_pre, " + _PARAMS + ", " + _SAVED + ", float eps_rms, float eps_pre",
    bwd_out=_OUT, backward=_pre_only_bwd, public=(0, 1),
    bwd_fake=lambda dy, dh_pre, x, phi, alpha, bias, gamma, *_: (
        x.new_empty(x.shape), torch.empty_like(phi), torch.empty_like(alpha), torch.empty_like(bias),
        None if gamma is None else torch.empty_like(gamma))))


def _post_bwd(dout, x, f, h_post, h_res):
    return call("mhc.post.bwd", _c(dout), x, f, h_post, h_res)


post = build(Family(
    name="mhc_post", ops=("mhc.post.fwd", "mhc.post.bwd"),
    fwd="Tensor x, Tensor f, Tensor h_post, Tensor h_res", fwd_out=("out",),
    bwd="Tensor dout, Tensor x, Tensor f, Tensor h_post, Tensor h_res", bwd_out=("dx", "df", "dh_post", "dh_res"),
    backward=_post_bwd))


def _sinkhorn_bwd(dr, logits, eps_sk, t_max):
    return call("mhc.sinkhorn.bwd", logits, _c(dr), eps_sk=eps_sk, t_max=t_max)


sinkhorn = build(Family(
    name="mhc_sinkhorn", ops=("mhc.sinkhorn.fwd", "mhc.sinkhorn.bwd"),
    fwd="Tensor logits, float eps_sk, int t_max", fwd_out=("r",),
    bwd="Tensor dr, Tensor logits, float eps_sk, int t_max", bwd_out=("dlogits",),
    backward=_sinkhorn_bwd, bwd_fake=lambda dr, logits, eps_sk, t_max: (torch.empty_like(logits),)))


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
        return pre(x, self.phi, self.alpha, self.bias, self.gamma, float(self.eps_rms), float(self.eps_pre),
                   float(self.eps_sk), int(self.t_max))

    def post(self, x, f, h_post, r):
        """The next layer's streams (..., n, dim)."""
        return post(x, f, h_post, r)

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
        return pre_only(x, self.phi, self.alpha, self.bias, self.gamma, float(self.eps_rms), float(self.eps_pre))[0]

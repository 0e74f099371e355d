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

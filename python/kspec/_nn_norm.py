"""kspec.nn.RMSNorm and kspec.nn.LayerNorm: torch.nn's modules (same arguments, parameter names and
shapes, so state dicts load strictly both ways; Liger's LigerRMSNorm and LigerLayerNorm too) with an
optional activation fused into kspec's norm_act kernel. CUDA tensors run kspec.ops.norm_act (forward and
backward kernels); others run torch's functional norm and activation, so a module works on any device."""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops

_TORCH_ACT = {"none": lambda t: t, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
              "gelu_erf": F.gelu}


class _NormAct(nn.Module):
    """What RMSNorm and LayerNorm share: normalized_shape (the trailing dims normalized together: kspec
    flattens them into one), the affine parameters, the activation and the forward."""

    _norm = ""  # "rmsnorm" or "layernorm": norm_act's name
    _torch_norm: Callable[[torch.Tensor, float], torch.Tensor]  # each subclass's torch.nn.functional norm

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, act, device, dtype):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        if not self.normalized_shape or any(d < 1 for d in self.normalized_shape):
            raise ValueError(f"kspec.nn.{type(self).__name__}: normalized_shape must be positive sizes, got "
                             f"{normalized_shape}")
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.act = ops.canonical_act(act, ops._ACTS, f"kspec.nn.{type(self).__name__}")
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _eps(self, x: torch.Tensor) -> float:
        return float(self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., *normalized_shape) -> act(norm(x) * weight + bias), like x."""
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k:]) != self.normalized_shape:
            raise ValueError(f"kspec.nn.{type(self).__name__}: input of shape {tuple(x.shape)} does not end in "
                             f"normalized_shape {self.normalized_shape}")
        eps = self._eps(x)
        if not x.is_cuda:
            return _TORCH_ACT[self.act](self._torch_norm(x, eps))
        hidden = math.prod(self.normalized_shape)
        w, b = self.weight, self.bias
        if w is None:  # no affine: norm_act's weight is ones
            w = torch.ones(hidden, dtype=x.dtype, device=x.device)
        # norm_act takes a weight like x or fp32, the bias like the weight
        if w.dtype not in (x.dtype, torch.float32):
            w = w.to(x.dtype)
        if b is not None and b.dtype != w.dtype:
            b = b.to(w.dtype)
        y = ops.norm_act(x.reshape(*x.shape[:x.dim() - k], hidden), w.reshape(hidden),
                         None if b is None else b.reshape(hidden), norm=self._norm, act=self.act, eps=eps)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine and self._norm == "layernorm":
            s += f", bias={self.bias is not None}"
        return s + (f", act={self.act!r}" if self.act != "none" else "")


class RMSNorm(_NormAct):
    """torch.nn.RMSNorm, optionally followed by a fused activation: y = act(x / rms(x) * weight).

    normalized_shape: int or trailing dims; eps: None (torch's default: torch.finfo(x.dtype).eps) or a
    float; elementwise_affine: a `weight` of normalized_shape (else none); act: None/"none", "silu",
    "gelu_tanh" or "gelu_erf" (aliases as kspec.ops.ACTIVATION_ALIASES). Parameters as torch.nn.RMSNorm's
    and LigerRMSNorm's (`weight` only), so either's state dict loads strictly."""

    _norm = "rmsnorm"

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, *, act: Optional[str] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, act, device, dtype)

    def _eps(self, x):
        return torch.finfo(x.dtype).eps if self.eps is None else float(self.eps)

    def _torch_norm(self, x, eps):
        return F.rms_norm(x, self.normalized_shape, self.weight, eps)


class LayerNorm(_NormAct):
    """torch.nn.LayerNorm, optionally followed by a fused activation: y = act((x - mean) / std * weight
    + bias).

    normalized_shape: int or trailing dims; eps: 1e-5 as torch's; elementwise_affine: `weight` (and with
    bias=True `bias`) of normalized_shape; act: as RMSNorm's. Parameters as torch.nn.LayerNorm's and
    LigerLayerNorm's (which always has `bias`: use bias=True), so their state dicts load strictly."""

    _norm = "layernorm"

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, act: Optional[str] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, act, device, dtype)

    def _torch_norm(self, x, eps):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, eps)

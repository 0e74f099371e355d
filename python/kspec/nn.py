"""kspec.nn: drop-in modules backed by kspec's kernels.

RMSNorm and LayerNorm are torch.nn's (and Liger's) with an optional fused activation (kspec.ops.norm_act);
Mamba is mamba_ssm's Mamba-1 block (kspec.ops.selective_scan_fn, selective_state_update): their state
dicts load strictly both ways.

E79Cell and E79CoupledMatrix have the parameters, buffers and names of the public E79 reference model
(kspec.reference.e79_torch), so its state dicts load with strict=True; on CUDA tensors they run the
fused projection (kspec's gemm) and the E79 kernels (kspec.ops.e79), elsewhere the torch loop.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from ._nn_mamba import Mamba
from ._nn_norm import LayerNorm, RMSNorm
from .reference import e79_torch as _ref

__all__ = ["E79Cell", "E79CoupledMatrix", "LayerNorm", "Mamba", "RMSNorm"]

_BIAS = ("none", "fixed", "input")


def _mode(bias: Optional[str], use_bias: Optional[bool], input_bias: Optional[bool]) -> str:
    """bias="fixed"|"none"|"input", or the reference model's use_bias / input_bias flags."""
    if use_bias is not None or input_bias is not None:
        mode = "input" if input_bias else "fixed" if (use_bias is None or use_bias) else "none"
        if bias is not None and bias != mode:
            raise ValueError(f"E79: bias={bias!r} contradicts use_bias={use_bias}, input_bias={input_bias}")
        return mode
    mode = "fixed" if bias is None else bias
    if mode not in _BIAS:
        raise ValueError(f"E79: bias must be one of {_BIAS}, got {mode!r}")
    return mode


class E79Cell(_ref.E79CoupledMatrixCell):
    """The E79 cell: x (T, B, dim) (or (B, T, dim) with batch_first=True) -> (out, S, M).

    Parameters as the reference: W_kvqm (4n, dim); bias="fixed": b_s_gate, b_m_gate (n,);
    bias="input": W_bs, W_bm (n, dim) and zero buffers b_s_gate, b_m_gate; bias="none": the zero
    buffers. States S, M (B, n, n) are fp32. chunk: steps between the saved states (memory 8 n^2 / chunk
    bytes per token and sequence during training). config: a tuning config forced on the kernels, e.g.
    "split=16,cluster=4" (kspec.ops.e79_cell), or None (tuned or heuristic)."""

    def __init__(self, dim: int, n_state: int = 64, bias: Optional[str] = None, *, chunk: int = 16,
                 use_bias: Optional[bool] = None, input_bias: Optional[bool] = None, use_cuda: bool = True,
                 config: Optional[str] = None) -> None:
        mode = _mode(bias, use_bias, input_bias)
        super().__init__(dim, n_state=n_state, use_bias=mode != "none", input_bias=mode == "input")
        self.chunk = chunk
        self.config = config

    def forward(self, x: torch.Tensor, S: Optional[torch.Tensor] = None, M: Optional[torch.Tensor] = None,
                batch_first: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not x.is_cuda:
            out, S, M = super().forward(x.transpose(0, 1) if batch_first else x, S, M)
            return (out.transpose(0, 1) if batch_first else out), S, M
        mode, dt = self.bias_mode, x.dtype
        W_bs = self.W_bs.to(dt) if mode == "input" else None
        W_bm = self.W_bm.to(dt) if mode == "input" else None
        b_s = self.b_s_gate if mode == "fixed" else None
        b_m = self.b_m_gate if mode == "fixed" else None
        return ops.e79(x, self.W_kvqm.to(dt), b_s, b_m, W_bs, W_bm, S, M, bias=mode, batch_first=batch_first,
                       chunk=self.chunk, config=self.config)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, n_state={self.n_state}, bias={self.bias_mode!r}, chunk={self.chunk}"
        return s + (f", config={self.config!r}" if self.config else "")


class E79CoupledMatrix(nn.Module):
    """The full E79 layer, batch-first: x (B, T, dim) -> (out (B, T, dim), (S, M)).

    in_proj (dim -> d_inner, no bias) -> optional depthwise causal conv1d -> silu -> E79Cell ->
    out_proj (n -> dim, no bias) -> dropout; the reference's names, so its state dicts load strictly."""

    def __init__(self, dim: int, expansion: float = 1.0, n_state: int = 64, dropout: float = 0.0,
                 use_conv: bool = False, d_conv: int = 4, bias: Optional[str] = None, *, chunk: int = 16,
                 use_cuda: bool = True, use_bias: Optional[bool] = None, input_bias: Optional[bool] = None,
                 **kwargs: object) -> None:
        super().__init__()
        self.dim, self.d_inner, self.n_state, self.use_conv = dim, int(dim * expansion), n_state, use_conv
        self.in_proj = nn.Linear(dim, self.d_inner, bias=False)
        if use_conv:
            self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, padding=d_conv - 1,
                                    groups=self.d_inner, bias=True)
        self.cell = E79Cell(self.d_inner, n_state, _mode(bias, use_bias, input_bias), chunk=chunk)
        self.out_proj = nn.Linear(n_state, dim, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.xavier_uniform_(self.out_proj.weight)

    def forward(self, x: torch.Tensor, hidden: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                **kwargs: object) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        T = x.shape[1]
        S, M = hidden if hidden is not None else (None, None)
        h = self.in_proj(x)
        if self.use_conv:
            h = self.conv1d(h.transpose(1, 2))[:, :, :T].transpose(1, 2)
        h = F.silu(h)
        out, S, M = self.cell(h, S, M, batch_first=True)
        return self.dropout(self.out_proj(out)), (S, M)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, d_inner={self.d_inner}, n_state={self.n_state}"


# difflogic's modules (issue 30), on kspec's logic layer kernels
from ._difflogic import GroupSum, LogicLayer, from_difflogic  # noqa: E402

__all__ += ["LogicLayer", "GroupSum", "from_difflogic"]

# The DiffLogic cellular automaton (issue 30), on the CA step kernels
from ._difflogic_ca import DiffLogicCA  # noqa: E402

__all__ += ["DiffLogicCA"]

# mHC (issue 34), on kspec's mhc ops
from ._mhc import HyperConnection, HyperConnectionHead, HyperConnectionStack, expand as mhc_expand  # noqa: E402

__all__ += ["HyperConnection", "HyperConnectionHead", "HyperConnectionStack", "mhc_expand"]

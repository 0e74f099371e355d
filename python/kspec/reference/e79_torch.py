"""Pure-torch E79 modules with the public reference model's parameter names and layout (the `elman`
project's E79CoupledMatrixCell and E79CoupledMatrix): the eager loop over time that kspec replaces,
used as the peer in tools/bench/e79.py and as the state-dict format kspec.nn must load.

Parameters and buffers of the cell: W_kvqm (4n, dim) rows [k | v | q | m]; with fixed biases
b_s_gate, b_m_gate (n,) parameters; with input biases W_bs, W_bm (n, dim) parameters and zero
buffers b_s_gate, b_m_gate; without biases the zero buffers alone. The layer: in_proj (dim -> d_inner,
no bias), conv1d (depthwise causal, with bias; only with use_conv), cell, out_proj (n -> dim, no bias).
The states here are fp32 whatever x's dtype (kspec keeps them in fp32 too).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def e79_cell_loop(kvqm: torch.Tensor, n: int, b_s=None, b_m=None, S=None, M=None):
    """The recurrence on a projection kvqm (T, B, 4n) [k | v | q | m], or (T, B, 6n) with per-step
    biases [.. | b_s | b_m]; b_s, b_m: (n,) fixed biases or None. Arithmetic in fp32.
    Returns (out (T, B, n) in kvqm's dtype, S, M (B, n, n) fp32)."""
    T, B, C = kvqm.shape
    x = kvqm.float()
    S = torch.zeros(B, n, n, device=x.device) if S is None else S.float()
    M = torch.zeros(B, n, n, device=x.device) if M is None else M.float()
    per_step = C == 6 * n
    outs = []
    for t in range(T):
        k, v, q, m = (x[t, :, j * n:(j + 1) * n] for j in range(4))
        if per_step:
            bs, bm = x[t, :, 4 * n:5 * n], x[t, :, 5 * n:]
        else:
            bs = 0.0 if b_s is None else b_s.float()
            bm = 0.0 if b_m is None else b_m.float()
        kh = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
        mh = m / (m.norm(dim=-1, keepdim=True) + 1e-6)
        s_row = torch.sigmoid(torch.einsum("bij,bj->bi", M, kh) + bs)
        s_col = torch.sigmoid(torch.einsum("bji,bj->bi", M, kh) + bs)
        s_delta = v - torch.einsum("bij,bj->bi", S, kh)
        S = s_row.unsqueeze(-1) * S * s_col.unsqueeze(1) + torch.einsum("bi,bj->bij", s_delta, kh)
        m_row = torch.sigmoid(torch.einsum("bij,bj->bi", S, mh) + bm)
        m_col = torch.sigmoid(torch.einsum("bji,bj->bi", S, mh) + bm)
        m_delta = s_delta - torch.einsum("bij,bj->bi", M, mh)
        M = m_row.unsqueeze(-1) * M * m_col.unsqueeze(1) + torch.einsum("bi,bj->bij", m_delta, mh)
        sq = torch.einsum("bij,bj->bi", S, q)
        outs.append(sq * F.silu(sq))
    return torch.stack(outs, 0).to(kvqm.dtype), S, M


def _bias_mode(use_bias: bool, input_bias: bool) -> str:
    return "input" if input_bias else "fixed" if use_bias else "none"


class E79CoupledMatrixCell(nn.Module):
    """x (T, B, dim) -> (out (T, B, n), S, M); the reference model's constructor flags."""

    def __init__(self, dim: int, n_state: int = 64, use_cuda: bool = False, use_bias: bool = True,
                 input_bias: bool = False):
        super().__init__()
        self.dim, self.n_state = dim, n_state
        self.use_bias, self.input_bias = use_bias, input_bias
        self.bias_mode = _bias_mode(use_bias, input_bias)
        self.W_kvqm = nn.Parameter(torch.empty(4 * n_state, dim))
        if self.bias_mode == "fixed":
            self.b_s_gate = nn.Parameter(torch.zeros(n_state))
            self.b_m_gate = nn.Parameter(torch.zeros(n_state))
        else:
            if self.bias_mode == "input":
                self.W_bs = nn.Parameter(torch.empty(n_state, dim))
                self.W_bm = nn.Parameter(torch.empty(n_state, dim))
            self.register_buffer("b_s_gate", torch.zeros(n_state))
            self.register_buffer("b_m_gate", torch.zeros(n_state))
        self._init_weights()

    def _init_weights(self):
        n = self.n_state
        for j in range(4):
            nn.init.xavier_uniform_(self.W_kvqm[j * n:(j + 1) * n])
        if self.bias_mode == "fixed":
            nn.init.constant_(self.b_s_gate, 2.0)
            nn.init.constant_(self.b_m_gate, 2.5)
        elif self.bias_mode == "input":
            nn.init.xavier_uniform_(self.W_bs)
            nn.init.xavier_uniform_(self.W_bm)

    def forward(self, x: torch.Tensor, S: Optional[torch.Tensor] = None, M: Optional[torch.Tensor] = None):
        W = self.W_kvqm
        if self.bias_mode == "input":
            W = torch.cat([self.W_kvqm, self.W_bs, self.W_bm], 0)
        kvqm = x @ W.T
        fixed = self.bias_mode == "fixed"
        return e79_cell_loop(kvqm, self.n_state, self.b_s_gate if fixed else None,
                             self.b_m_gate if fixed else None, S, M)


class E79CoupledMatrix(nn.Module):
    """The full layer, batch-first: x (B, T, dim) -> (out (B, T, dim), (S, M))."""

    def __init__(self, dim: int, expansion: float = 1.0, n_state: int = 64, dropout: float = 0.0,
                 use_conv: bool = False, d_conv: int = 4, use_cuda: bool = False, use_bias: bool = True,
                 input_bias: bool = False, **kwargs):
        super().__init__()
        self.dim, self.d_inner, self.n_state, self.use_conv = dim, int(dim * expansion), n_state, use_conv
        self.in_proj = nn.Linear(dim, self.d_inner, bias=False)
        if use_conv:
            self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, padding=d_conv - 1,
                                    groups=self.d_inner, bias=True)
        self.cell = E79CoupledMatrixCell(self.d_inner, n_state=n_state, use_bias=use_bias, input_bias=input_bias)
        self.out_proj = nn.Linear(n_state, dim, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.xavier_uniform_(self.out_proj.weight)

    def forward(self, x: torch.Tensor, hidden: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, **kwargs):
        B, T, _ = x.shape
        S, M = hidden if hidden is not None else (None, None)
        h = self.in_proj(x)
        if self.use_conv:
            h = self.conv1d(h.transpose(1, 2))[:, :, :T].transpose(1, 2)
        h = F.silu(h)
        out, S, M = self.cell(h.transpose(0, 1), S, M)
        return self.dropout(self.out_proj(out.transpose(0, 1))), (S, M)

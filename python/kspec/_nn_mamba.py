"""kspec.nn.Mamba: the Mamba-1 block with mamba_ssm.modules.mamba_simple.Mamba's arguments, parameter
names, shapes and initialization, so its state dicts load with strict=True either way. The selective
scan is kspec.ops.selective_scan_fn (forward and backward kernels) and a decode step
kspec.ops.selective_state_update on CUDA tensors; elsewhere the same block runs as a torch loop."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops


def _scan_torch(u, delta, A, B, C, D, z, delta_bias, h0=None):
    """The selective scan as a loop over time in fp32 (fp64 for fp64 inputs), the block off CUDA: u, delta,
    z (batch, dim, L); A (dim, n); B, C (batch, n, L); D, delta_bias (dim,); h0 (batch, dim, n) or None.
    Returns (out like u, last_state (batch, dim, n) in the compute dtype)."""
    ct = torch.promote_types(u.dtype, torch.float32)
    dt = F.softplus(delta.to(ct) + delta_bias.to(ct)[:, None])
    x = u.new_zeros((u.shape[0], u.shape[1], A.shape[1]), dtype=ct) if h0 is None else h0.to(ct)
    A, Bf, Cf, uf = A.to(ct), B.to(ct), C.to(ct), u.to(ct)
    ys = []
    for t in range(u.shape[2]):
        x = torch.exp(dt[:, :, t, None] * A) * x + (dt[:, :, t] * uf[:, :, t])[:, :, None] * Bf[:, None, :, t]
        ys.append((x * Cf[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) + D.to(ct)[:, None] * uf
    return (y * F.silu(z.to(ct))).to(u.dtype), x


class Mamba(nn.Module):
    """The Mamba-1 block, hidden_states (batch, seqlen, d_model) -> (batch, seqlen, d_model):

        x, z = in_proj(h).chunk(2)                 (d_inner = expand * d_model channels each)
        x = silu(causal depthwise conv1d(x))       (kernel d_conv)
        dt, B, C = x_proj(x).split(dt_rank, d_state, d_state);  dt = dt_proj.weight @ dt
        y = selective_scan(x, dt, A = -exp(A_log), B, C, D, z, delta_bias = dt_proj.bias, softplus)
        out = out_proj(y)

    Arguments, parameters (in_proj, conv1d, x_proj, dt_proj, out_proj, A_log, D) and initialization as
    mamba_ssm.modules.mamba_simple.Mamba; use_fast_path is accepted and has no effect (kspec runs its own
    scan kernel). Decoding: allocate_inference_cache(batch, max_seqlen) -> (conv_state, ssm_state), then
    step(hidden_states (batch, 1, d_model), conv_state, ssm_state) per token (states updated in place),
    or forward(hidden_states, inference_params) with mamba_ssm's InferenceParams (key_value_memory_dict,
    seqlen_offset): a prefill fills the states, later calls step."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dt_rank: int | str = "auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random", dt_scale: float = 1.0,
                 dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False, use_fast_path: bool = True,
                 layer_idx: Optional[int] = None, device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.activation = "silu"

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **kw)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, **kw)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **kw)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **kw)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **kw)

        # dt_proj: weights that keep the variance (constant or uniform in +-dt_rank^-0.5 * dt_scale), and a
        # bias whose softplus is log-uniform in [dt_min, dt_max] (floored at dt_init_floor).
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise ValueError(f"kspec.nn.Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")
        dt = torch.exp(torch.rand(self.d_inner, **kw) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.dt_proj.bias._no_reinit = True  # type: ignore[attr-defined]  # mamba_ssm's markers
        # S4D-real A = -(1..d_state) per channel, kept as log(-A) in fp32; D (the skip) ones in fp32.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True  # type: ignore[attr-defined]

    # ---- full sequences ----

    def forward(self, hidden_states: torch.Tensor, inference_params: Any = None) -> torch.Tensor:
        """hidden_states: (batch, seqlen, d_model) -> (batch, seqlen, d_model). Differentiable."""
        batch, seqlen, _ = hidden_states.shape
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                return self.step(hidden_states, conv_state, ssm_state)[0]
        xz = self.in_proj(hidden_states).transpose(1, 2)  # (batch, 2 d_inner, seqlen)
        x, z = xz.chunk(2, dim=1)
        if conv_state is not None:  # the last d_conv inputs (zeros before the first)
            conv_state.copy_(F.pad(x, (self.d_conv - seqlen, 0)))
        x = F.silu(self.conv1d(x)[..., :seqlen])
        x_dbl = self.x_proj(x.transpose(1, 2))  # (batch, seqlen, dt_rank + 2 d_state)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # (batch, d_inner, seqlen); bias in the scan
        B = B.transpose(1, 2).contiguous()
        C = C.transpose(1, 2).contiguous()
        if x.is_cuda:
            A = -torch.exp(self.A_log.float())
            y, last = ops.selective_scan_fn(x, dt, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(),
                                            delta_softplus=True, return_last_state=True)
        else:
            y, last = _scan_torch(x, dt, -torch.exp(self.A_log), B, C, self.D, z, self.dt_proj.bias)
        if ssm_state is not None:
            ssm_state.copy_(last)
        return self.out_proj(y.transpose(1, 2))

    # ---- decoding ----

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
             ssm_state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: hidden_states (batch, 1, d_model); conv_state (batch, d_inner, d_conv) and ssm_state
        (batch, d_inner, d_state), updated in place. Returns (out (batch, 1, d_model), conv_state,
        ssm_state). Not differentiable."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"kspec.nn.Mamba.step: hidden_states must be (batch, 1, d_model), got "
                             f"{tuple(hidden_states.shape)}")
        dtype = hidden_states.dtype
        x, z = self.in_proj(hidden_states[:, 0]).chunk(2, dim=-1)  # (batch, d_inner) each
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        x = (conv_state * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            x = x + self.conv1d.bias
        x = F.silu(x).to(dtype)
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)
        if x.is_cuda:
            A = -torch.exp(self.A_log.float())
            y = ops.selective_state_update(ssm_state, x, dt, A, B, C, self.D, z=z, dt_bias=self.dt_proj.bias,
                                           dt_softplus=True)
        else:
            y, last = _scan_torch(x[..., None], dt[..., None], -torch.exp(self.A_log), B[..., None], C[..., None],
                                  self.D, z[..., None], self.dt_proj.bias, ssm_state)
            y = y[..., 0]
            ssm_state.copy_(last)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int = 0, dtype: Optional[torch.dtype] = None,
                                 **kwargs: object) -> Tuple[torch.Tensor, torch.Tensor]:
        """(conv_state (batch, d_inner, d_conv) in conv1d's dtype, ssm_state (batch, d_inner, d_state)
        fp32), zeros; dtype: both in this dtype instead. ssm_state is fp32 by default (mamba_ssm keeps it
        in the weights' dtype): kspec's step updates an fp32 state in place, others through a copy."""
        device = self.out_proj.weight.device
        conv = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device,
                           dtype=self.conv1d.weight.dtype if dtype is None else dtype)
        ssm = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                          dtype=torch.float32 if dtype is None else dtype)
        return conv, ssm

    def _states_from_cache(self, inference_params, batch_size: int):
        if self.layer_idx is None:
            raise ValueError("kspec.nn.Mamba: inference_params needs the block's layer_idx")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, 0)
        return cache[self.layer_idx]

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, expand={self.expand}, "
                f"dt_rank={self.dt_rank}")

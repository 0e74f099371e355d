"""kspec.optim: optimizers on kspec's fused kernels.

    opt = kspec.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)

AdamW is a drop-in torch.optim.Optimizer: param_groups, add_param_group, zero_grad, state_dict and
load_state_dict with torch.optim.AdamW's state names (step, exp_avg, exp_avg_sq, max_exp_avg_sq), so a
checkpoint moves between the two. One kernel launch updates every tensor of a group."""
from __future__ import annotations

import torch

from ._core import call


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on one fused multi-tensor kernel (kspec op "adamw").

    Extra options: maximize; max_grad_norm (clip all gradients of the step to this global L2 norm first,
    computed deterministically on the GPU); bf16/fp16 parameters keep an fp32 master copy in
    state["master"] (the update runs on it, the parameter receives its rounding). step(grad_scale=...)
    divides the gradients by an AMP loss scale and skips the step when one is inf/nan (self.found_inf)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm=None):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"kspec.optim.AdamW: invalid hyperparameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.found_inf = None
        self.grad_norm = None

    def _init_state(self, p, amsgrad):
        state = self.state[p]
        if len(state) == 0 or "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if p.dtype != torch.float32 and "master" not in state:
            state["master"] = p.detach().float().contiguous()
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):  # after load_state_dict
            if k in state and state[k].dtype != torch.float32:
                state[k] = state[k].float()
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("kspec.optim.AdamW does not support sparse gradients")
                state = self._init_state(p, group["amsgrad"])
                key = (gi, p.device, p.dtype, p.grad.dtype, int(state["step"].item()))
                buckets.setdefault(key, []).append(p)
        clip = self.max_grad_norm is not None and self.max_grad_norm > 0
        if clip and len(buckets) > 1:
            raise NotImplementedError("kspec.optim.AdamW: max_grad_norm needs every parameter in one launch (one "
                                      "group, one device, one dtype, one step count)")
        check = grad_scale is not None or clip
        self.found_inf = self.grad_norm = None
        for (gi, device, _, _, step), ps in buckets.items():
            group = self.param_groups[gi]
            states = [self.state[p] for p in ps]
            beta1, beta2 = group["betas"]
            found = torch.zeros(1, device=device) if check else None
            norm = torch.zeros(1, device=device) if check else None
            call("adamw", list(ps), [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
                 [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                 [s["master"] for s in states] if ps[0].dtype != torch.float32 else None,
                 [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None,
                 grad_scale, out=(found, norm),
                 lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                 weight_decay=float(group["weight_decay"]), step=step + 1, maximize=bool(group["maximize"]),
                 max_norm=float(self.max_grad_norm) if clip else 0.0)
            skipped = bool(found.item()) if found is not None else False  # a host sync, as GradScaler has
            if found is not None:
                self.found_inf, self.grad_norm = found, norm
            if not skipped:
                for s in states:
                    s["step"] += 1
        return loss

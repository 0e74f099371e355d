"""kspec.optim: optimizers on kspec's fused kernels.

    opt = kspec.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)

AdamW is a drop-in torch.optim.Optimizer: param_groups, add_param_group, zero_grad, state_dict and
load_state_dict with torch.optim.AdamW's state names (step, exp_avg, exp_avg_sq, max_exp_avg_sq), so a
checkpoint moves between the two. One kernel launch updates every tensor of a group."""
from __future__ import annotations

from operator import attrgetter, itemgetter

import torch

from . import _C
from ._core import call
from ._tensors import current_stream, describe


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
        clip = self.max_grad_norm is not None and self.max_grad_norm > 0
        check = grad_scale is not None or clip
        launches = []
        for gi, group in enumerate(self.param_groups):
            launches += self._launches(gi, group, grad_scale, check)
        if clip and len(launches) > 1:
            raise NotImplementedError("kspec.optim.AdamW: max_grad_norm needs every parameter in one launch (one "
                                      "group, one device, one dtype, one step count)")
        self.found_inf = self.grad_norm = None
        for b in launches:
            group = self.param_groups[b.group]
            beta1, beta2 = group["betas"]
            found = torch.zeros(1, device=b.device) if check else None
            norm = torch.zeros(1, device=b.device) if check else None
            hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), step=b.step + 1,
                         max_norm=float(self.max_grad_norm) if clip else 0.0)
            if b.lists is None:  # a gradient that is not contiguous: its copy is new every step
                call("adamw", *self._lists(b), grad_scale, out=(found, norm), maximize=bool(group["maximize"]),
                     **hyper)
            else:
                outs = [describe(found), describe(norm)]
                if b.bound is None:  # every tensor validated once, the table uploaded once
                    b.bound = _C.BoundCall("adamw", b.lists + [describe(grad_scale)], outs,
                                           dict(hyper, maximize=bool(group["maximize"])))
                b.bound.run(hyper, outs, current_stream("torch", b.device.index or 0))
            skipped = bool(found.item()) if found is not None else False  # a host sync, as GradScaler has
            if found is not None:
                self.found_inf, self.grad_norm = found, norm
            if not skipped:
                b.advance()
        return loss

    def state_dict(self):
        """torch's state_dict; each step tensor a copy (the live ones are views of one buffer per launch)."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v, step=v["step"].clone()) if "step" in v else v for k, v in sd["state"].items()}
        return sd

    # ---- the per-group launch cache ----
    # A step's host time used to grow with the number of tensors (GPT-350M: 243 tensors, 2.9 ms): per
    # tensor state checks and step reads, six descriptors, their conversion and validation in C++, and
    # the table of tensors and chunks built and uploaded again. Now a group's launches (a BoundCall each:
    # validated, planned and uploaded once) are kept with a key made of everything they were built from:
    # the parameters (identity, pointer, size), the gradients (pointer, dtype), every state tensor's
    # pointer, the step tensors (identity, and their versions, so an edited step count is seen), the
    # state dict itself, grad_scale's pointer and the group's compiled options. Any difference builds
    # the launches again, through the full checks.

    def _launches(self, gi, group, grad_scale, check):
        cache = self.__dict__.setdefault("_cache", {})
        ps = group["params"]
        have = cache.get(gi)
        if have is not None:
            key = self._key(group, ps, grad_scale, check)
            if key is not None and key == have[0] and all(b.steps._version == b.version for b in have[1]):
                return have[1]
        buckets = {}
        for p in ps:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("kspec.optim.AdamW does not support sparse gradients")
            state = self._init_state(p, group["amsgrad"])
            key = (p.device, p.dtype, p.grad.dtype, int(state["step"].item()))
            buckets.setdefault(key, []).append(p)
        launches = []
        for (device, _, _, step), bps in buckets.items():
            b = _Launch(gi, device, bps, [self.state[p] for p in bps], step)
            if all(p.grad.is_contiguous() for p in bps):
                b.lists = [[describe(t) for t in lst] if lst is not None else None for lst in self._lists(b)]
            launches.append(b)
        # The launches replaced may have kernels in flight that read their tables: keep them until they are
        # idle rather than wait for them here.
        retired = self.__dict__.setdefault("_retired", [])
        retired[:] = [b for b in retired if not b.idle()]
        if have is not None:
            retired += [b.bound for b in have[1] if b.bound is not None]
        key = self._key(group, ps, grad_scale, check)
        if key is None:
            cache.pop(gi, None)
        else:
            cache[gi] = (key, launches)
        return launches

    def _lists(self, b):
        ps, states = b.params, b.states
        group = self.param_groups[b.group]
        return (list(ps), [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["master"] for s in states] if ps[0].dtype != torch.float32 else None,
                [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None)

    def _key(self, group, ps, grad_scale, check):
        """What a group's launches were built from (see above), or None when they cannot be kept. Built with
        map() over C-level getters: about 0.5 µs per tensor instead of a Python loop's 3."""
        live = [p for p in ps if p.grad is not None]
        grads = list(map(_grad, live))
        sts = list(map(self.state.get, live))
        try:
            if None in sts or not all(map(_has_moments, sts)) or not all(map(_Tensor.is_contiguous, grads)):
                return None
        except RuntimeError:  # a sparse gradient: the full path says what is wrong
            return None
        if group["amsgrad"] and not all("max_exp_avg_sq" in s for s in sts):
            return None
        ptr = _Tensor.data_ptr
        amsgrad = group["amsgrad"]
        low = [s for s in sts if "master" in s]
        return (id(self.state), amsgrad, bool(group["maximize"]), check,
                None if grad_scale is None else grad_scale.data_ptr(),
                tuple(map(id, live)), tuple(map(ptr, live)), tuple(map(_Tensor.numel, live)),
                tuple(map(ptr, grads)), tuple(map(_dtype, grads)), tuple(map(id, sts)),
                tuple(map(ptr, map(_exp_avg, sts))), tuple(map(ptr, map(_exp_avg_sq, sts))),
                tuple(map(ptr, map(_master, low))), len(low),
                tuple(map(ptr, map(_max_exp_avg_sq, sts))) if amsgrad else (),
                tuple(map(id, map(_step, sts))))


_Tensor = torch.Tensor
_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
_exp_avg, _exp_avg_sq, _master, _max_exp_avg_sq, _step = (
    itemgetter(k) for k in ("exp_avg", "exp_avg_sq", "master", "max_exp_avg_sq", "step"))


def _has_moments(state) -> bool:
    return "exp_avg" in state and "step" in state


class _Launch:
    """One fused launch of a step: a group's parameters with one device, dtype and step count; `lists`
    their descriptors (None when a gradient must be copied each step) and `bound` the BoundCall built
    from them on first use.

    Each parameter keeps its own state["step"] tensor (torch's layout, for state_dict), but as a view of
    one buffer per launch: a step adds 1 to the buffer (one op; torch._foreach_add_ over 243 host
    scalars took 1 ms), and an edit of any step tensor bumps the buffer's version, which the cache sees."""

    __slots__ = ("group", "device", "params", "states", "steps", "step", "version", "lists", "bound")

    def __init__(self, group, device, params, states, step):
        self.group, self.device, self.params, self.states, self.step = group, device, params, states, step
        self.steps = torch.full((len(states),), float(step))
        for i, s in enumerate(states):
            s["step"] = self.steps[i]
        self.version = self.steps._version
        self.lists = None
        self.bound = None

    def advance(self):
        self.steps.add_(1)
        self.step += 1
        self.version = self.steps._version

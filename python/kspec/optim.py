"""kspec.optim: optimizers on kspec's fused kernels.

    opt = kspec.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)

AdamW is a drop-in torch.optim.Optimizer: param_groups, add_param_group, zero_grad, state_dict and
load_state_dict with torch.optim.AdamW's state names (step, exp_avg, exp_avg_sq, max_exp_avg_sq), so a
checkpoint moves between the two. One kernel launch updates every tensor of a group."""
from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterable

import torch

from . import _C
from ._core import call
from ._tensors import current_stream, describe


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on one fused multi-tensor kernel (kspec op "adamw").

    Takes every torch.optim.AdamW argument (torch 2.11's signature):
      lr (a float, or a 1-element tensor: read each step), betas (floats or 1-element tensors), eps,
      weight_decay, amsgrad, maximize: as torch's.
      foreach, fused: accepted and recorded in param_groups, no effect: kspec always runs its own fused
      kernel (one launch per group, device and dtype).
      capturable=True: as torch's, the step counts live on the parameters' device and step() reads
      nothing back to the host, so `torch.cuda.graph` can capture it (after a warm-up step outside the
      graph, which builds the launch): the kernel reads the step count, and a Tensor lr (float32, on the
      parameters' device), from device memory and computes the bias corrections there; a step skipped
      for an inf/nan gradient (grad_scale) is taken back on the device. A float lr is a launch argument:
      a graph replays the captured value, as torch's does.
      differentiable=True: NotImplementedError (the kernel updates in place, outside autograd).
    param_groups carry torch's keys (decoupled_weight_decay=True included) and the state torch's names
    (step, exp_avg, exp_avg_sq, max_exp_avg_sq), so state_dict()/load_state_dict() go both ways between
    this and torch.optim.AdamW. bf16/fp16 parameters keep fp32 moments and an fp32 master copy in
    state["master"] (torch keeps moments in the parameter's dtype: a state dict from torch is widened at
    the next step, and torch narrows kspec's on load and ignores "master").

    Extra options: max_grad_norm (clip all gradients of the step to this global L2 norm first, computed
    deterministically on the GPU); step(grad_scale=...) divides the gradients by an AMP loss scale and
    skips the step when one is inf/nan (self.found_inf)."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, max_grad_norm: float | None = None) -> None:
        for name, v in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1])):
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise ValueError(f"kspec.optim.AdamW: Tensor {name} must be 1-element, got shape {tuple(v.shape)}")
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"kspec.optim.AdamW: invalid hyperparameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        if differentiable:
            raise NotImplementedError(_NOT_DIFFERENTIABLE)
        if capturable and isinstance(lr, torch.Tensor) and lr.dtype != torch.float32:
            raise ValueError(f"kspec.optim.AdamW: capturable=True reads a Tensor lr on the device as float32, "
                             f"got {lr.dtype}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.found_inf: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None

    def __setstate__(self, state):
        """As torch.optim.AdamW's: a group from an older or other state dict gets torch's defaults."""
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                         ("differentiable", False), ("fused", None)):
                group.setdefault(k, v)
            group["decoupled_weight_decay"] = True

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
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: torch.Tensor | None = None) -> Any:
        """One AdamW step of every parameter with a gradient; `closure` as torch's. Returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        max_norm = float(self.max_grad_norm) if self.max_grad_norm is not None and self.max_grad_norm > 0 else 0.0
        clip = max_norm > 0
        check = grad_scale is not None or clip
        launches = []
        for gi, group in enumerate(self.param_groups):
            if group["differentiable"]:  # a group loaded from a torch state dict, or edited
                raise NotImplementedError(_NOT_DIFFERENTIABLE)
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
            lr, device_lr = group["lr"], None
            if b.capturable:
                if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                    device_lr = _device_lr(lr, b.device)
                b.steps.add_(1)  # the step being taken, counted on the device; taken back below if skipped
            hyper: dict[str, Any] = dict(
                lr=float(lr) if device_lr is None else 0.0, beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                step=1 if b.capturable else b.step + 1, max_norm=max_norm)
            on_device = (b.steps[:1] if b.capturable else None, device_lr)
            if b.lists is None:  # a gradient that is not contiguous: its copy is new every step
                if b.capturable and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("kspec.optim.AdamW: a captured step needs contiguous gradients (the "
                                       "launch's table of their copies would be uploaded from host memory)")
                call("adamw", *self._lists(b), grad_scale, *on_device, out=(found, norm),
                     maximize=bool(group["maximize"]), **hyper)
            else:
                outs = [describe(found), describe(norm)]
                if b.bound is None:  # every tensor validated once, the table uploaded once
                    b.bound = _C.BoundCall("adamw", b.lists + [describe(grad_scale)] + [describe(t) for t in on_device],
                                           outs, dict(hyper, maximize=bool(group["maximize"])))
                b.bound.run(hyper, outs, current_stream("torch", b.device.index or 0))
            if found is not None:
                self.found_inf, self.grad_norm = found, norm
            if b.capturable:
                if found is not None:
                    b.steps.sub_(found)
                b.version = b.steps._version
            elif not (found is not None and bool(found.item())):  # a host sync, as GradScaler has
                b.advance()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, except that fp32 state of a bf16/fp16 parameter stays fp32: torch casts
        every state tensor to its parameter's dtype, which would round kspec's fp32 moments and master
        copy (a torch state dict's bf16 moments are widened at the next step)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        current = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, current):
            st = state_dict["state"].get(i, {})
            for k in _FP32_STATE:
                v = st.get(k)
                if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and p.dtype != torch.float32:
                    self.state[p][k] = v.to(device=p.device)

    def state_dict(self) -> dict[str, Any]:
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
            b = _Launch(gi, device, bps, [self.state[p] for p in bps], step, bool(group["capturable"]))
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
        lr = group["lr"]
        return (id(self.state), amsgrad, bool(group["maximize"]), check, bool(group["capturable"]),
                lr.data_ptr() if isinstance(lr, torch.Tensor) and group["capturable"] else None,
                None if grad_scale is None else grad_scale.data_ptr(),
                tuple(map(id, live)), tuple(map(ptr, live)), tuple(map(_Tensor.numel, live)),
                tuple(map(ptr, grads)), tuple(map(_dtype, grads)), tuple(map(id, sts)),
                tuple(map(ptr, map(_exp_avg, sts))), tuple(map(ptr, map(_exp_avg_sq, sts))),
                tuple(map(ptr, map(_master, low))), len(low),
                tuple(map(ptr, map(_max_exp_avg_sq, sts))) if amsgrad else (),
                tuple(map(id, map(_step, sts))))


_NOT_DIFFERENTIABLE = ("kspec.optim.AdamW: differentiable=True is not supported (the fused kernel updates the "
                       "parameters in place, outside autograd); use torch.optim.AdamW(differentiable=True)")


def _device_lr(lr, device):
    """A capturable step's Tensor lr as the kernel reads it: the tensor itself (a float32 [1] view), so that
    a scheduler's lr.fill_() reaches every replay of a captured step."""
    if lr.dtype != torch.float32 or lr.device != device:
        raise ValueError(f"kspec.optim.AdamW: capturable=True reads a Tensor lr on the parameters' device "
                         f"({device}) as float32, got {lr.dtype} on {lr.device}")
    return lr.detach().reshape(1)

_FP32_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")  # kept in fp32 for any parameter dtype
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
    scalars took 1 ms), and an edit of any step tensor bumps the buffer's version, which the cache sees.
    With capturable=True the buffer is on the parameters' device (torch's layout for it) and the kernel
    reads the count from it."""

    __slots__ = ("group", "device", "params", "states", "steps", "step", "version", "lists", "bound", "capturable")

    def __init__(self, group, device, params, states, step, capturable):
        self.group, self.device, self.params, self.states, self.step = group, device, params, states, step
        self.capturable = capturable
        self.steps = torch.full((len(states),), float(step), device=device if capturable else "cpu")
        for i, s in enumerate(states):
            s["step"] = self.steps[i]
        self.version = self.steps._version
        self.lists = None
        self.bound = None

    def advance(self):
        self.steps.add_(1)
        self.step += 1
        self.version = self.steps._version

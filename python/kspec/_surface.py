"""The torch surface of every differentiable op family, made from one short spec per family (`Family`):
the two torch.library custom ops (kspec::<name>_fwd, kspec::<name>_bwd, what torch.compile traces), their
fake kernels (by default evaluated from the OpDef's schema by kspec._schema, so symbolic sizes stay
symbolic under dynamic shapes), their autograd, and the eager path (an autograd.Function on the same
forward and backward, without torch.library's dispatch cost; the forward alone when no gradient is wanted).

The backward is paired with the forward by name, as the OpDefs name their tensors: a backward argument
`d<out>` is the gradient of forward output <out>; any other backward argument is the forward argument or
output of that name (saved for the backward when it is a tensor), or an `extra` computed from them; a
backward output `d<arg>` is the gradient of forward argument <arg> (None where that argument was None)."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from operator import is_, itemgetter
from typing import Callable, Optional

import torch

from . import _native, _schema
from ._core import call

FAMILIES: dict = {}  # name -> Family, in registration order
# call_grad's codes: forward output i is _OUT + i, its gradient _GRAD + i (_GRAD_OPTIONAL + i where the backward op
# takes that gradient absent: none made of zeros when it did not come)
_OUT, _GRAD, _GRAD_OPTIONAL = 1000, 2000, 3000


def _args(schema: str):
    """[(name, type)] of a custom op's arguments in torch schema syntax ("Tensor x, Tensor? bias, str act",
    "bool save_stats=True": a default is allowed)."""
    out = []
    for part in schema.split(","):
        typ, name = part.split()
        out.append((name.split("=")[0], typ))
    return out


def _defaults(schema: str) -> tuple:
    """The values of the trailing arguments with defaults ("bool save_stats=True" -> (True,)): torch.library
    leaves out an argument equal to its default when it calls a custom op's kernel, fake or autograd."""
    tail = []
    for part in schema.split(","):
        _, name = part.split()
        if "=" in name:
            tail.append(ast.literal_eval(name.split("=", 1)[1]))
        elif tail:
            raise ValueError(f"{schema}: an argument without a default after one with")
    return tuple(tail)


def _is_tensor(typ: str) -> bool:
    return typ in ("Tensor", "Tensor?")


@dataclass(frozen=True)
class CeilDiv:
    """A Family's `derived` rule ceil(dims[dim] / by) (the scan's nstates = ceil(seqlen / 16)): callable as
    every rule is (symbolic sizes stay symbolic), and readable by call_grad, which sizes such an output in C++."""
    dim: str
    by: int

    def __call__(self, dims):
        return -(-dims[self.dim] // self.by)


@dataclass(eq=False)
class Family:
    """One op family's torch surface.

    name: the custom ops are kspec::<name>_fwd and kspec::<name>_bwd.
    fwd, bwd: their arguments in torch schema syntax; fwd_out, bwd_out: their outputs' names.
    forward(*fwd args, save=bool) -> a tuple like fwd_out (None for an absent output); `save` says whether
    a backward will run (keep what only it reads). backward(*bwd args) -> a tuple like bwd_out (None for
    an absent gradient). Either left out: one kspec.call of ops[0] / ops[1] with the tensor arguments in
    order and the non-tensor arguments the op has as params. They only ever see real tensors (fakes come
    from `fake`/`bwd_fake`, or from the schema of `ops`).
    public: the forward outputs the public function returns (one: the tensor itself, more: a tuple).
    save_arg: the forward's bool argument that allows keeping what only the backward reads (under
    torch.compile and in the eager path it is and-ed with "a gradient is wanted"); save_required: the
    backward needs it (raise when it was off) rather than recomputing what was not kept.
    extra: backward argument -> fn(env) for one that is neither a gradient nor a forward argument/output
    (env: the forward's arguments and outputs by name).
    ops: (forward op, backward op) in the registry, whose schemas give the default fakes (the custom
    op's tensor arguments in the op's input order); derived: {dim: fn(dims)} for an output dim no input
    binds. fake, bwd_fake: (*args) -> outputs like forward/backward's, where the schema's rule is not the
    one (other layouts, composite ops).
    one_call: forward and backward compute what one call of ops[0] / ops[1] does (the tensor arguments in
    the op's input order, every other argument a param of the forward op or the save_arg, which is on): with
    the torch extension a call that wants a gradient is then one C++ call (kspec._torch_ext.call_grad: the
    forward op and a C++ graph node whose backward runs ops[1] without Python). An output with a dim no input
    binds (the scan's states) needs a CeilDiv rule in `derived`: call_grad allocates it from the inputs' sizes."""
    name: str
    fwd: str
    fwd_out: tuple
    bwd: str
    bwd_out: tuple
    forward: Optional[Callable] = None
    backward: Optional[Callable] = None
    public: tuple = (0,)
    save_arg: Optional[str] = None
    save_required: bool = False
    extra: dict = field(default_factory=dict)
    ops: tuple = (None, None)
    derived: dict = field(default_factory=dict)
    fake: Optional[Callable] = None
    bwd_fake: Optional[Callable] = None
    one_call: bool = False


def _absent(args):
    """Custom ops cannot return None inside a tuple: an empty tensor stands for an absent output."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    return first.new_empty(0)


def _filled(outs, args):
    return tuple(_absent(args) if o is None else o for o in outs)


def _returns(n: int) -> str:
    """A custom op's return type for n outputs."""
    return "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"


def _unwrapped(outs: tuple, one: bool):
    return outs[0] if one else outs


def _dtype_name(t):
    return str(t.dtype).removeprefix("torch.")


def _schema_fake(op, tensors, derived, present):
    """Outputs of registry op `op` for these (fake) inputs, from its schema; None for absent ones."""
    specs = _schema.output_specs(op, [None if t is None else tuple(t.shape) for t in tensors],
                                 [None if t is None else _dtype_name(t) for t in tensors], derived, present)
    device = next(t.device for t in tensors if t is not None)
    return tuple(None if s is None else torch.empty(s[1], dtype=getattr(torch, s[0]), device=device) for s in specs)


def _picker(indices):
    """fn(seq) -> tuple of a tuple's items at `indices` (operator.itemgetter, always a tuple; one index as a
    one-item slice: no Python frame per call, as the scan's one param, delta_softplus, is picked per call)."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        return itemgetter(slice(indices[0], indices[0] + 1))
    return itemgetter(*indices)


def _one_call(op, arg_types):
    """fn(*args, **ignored) -> kspec.call(op, tensors..., **params): the default forward or backward."""
    params = {p["name"] for p in _schema._info(op)["params"]}
    tensor_pos = [i for i, (_, t) in enumerate(arg_types) if _is_tensor(t)]
    param_pos = [(n, i) for i, (n, t) in enumerate(arg_types) if not _is_tensor(t) and n in params]

    def run(*args, **_):
        return call(op, *[args[i] for i in tensor_pos], **{n: args[i] for n, i in param_pos})

    return run


class Surface:
    """What build() makes of a Family: the custom ops (.fwd_op, .bwd_op), their implementations (.fwd_kernel,
    .bwd_kernel: what a CPU test may register for CPU tensors) and __call__, the public entry."""

    def __init__(self, f: Family):
        self.fwd_args = _args(f.fwd)
        self.bwd_args = _args(f.bwd)
        self.fwd_defaults = _defaults(f.fwd)
        if f.forward is None or f.backward is None:
            f = replace(f, forward=f.forward or _one_call(f.ops[0], self.fwd_args),
                        backward=f.backward or _one_call(f.ops[1], self.bwd_args))
        self.family = f
        self.fwd_names = [n for n, _ in self.fwd_args]
        self.tensor_pos = [i for i, (_, t) in enumerate(self.fwd_args) if _is_tensor(t)]
        self.pick_tensors = _picker(self.tensor_pos)
        self.nones = (None,) * len(self.fwd_args)  # for the absent flags: map(is_, args, nones), no Python frame
        self.save_pos = self.fwd_names.index(f.save_arg) if f.save_arg else None
        bwd_names = [n for n, _ in self.bwd_args]
        # forward outputs with a gradient argument in the backward; the others are non-differentiable
        self.diff_out = [i for i, o in enumerate(f.fwd_out) if "d" + o in bwd_names]
        # Where each backward argument comes from, resolved once: (0, i) the gradient of forward output
        # i, (1, k) the k-th saved tensor, (2, k) the k-th non-tensor; what is saved: (0, i) forward
        # argument i, (1, i) forward output i, (2, name) an extra.
        self.bwd_plan, keep_saved, keep_cfg = [], [], []
        for n, t in self.bwd_args:
            if n.startswith("d") and n[1:] in f.fwd_out:
                self.bwd_plan.append((0, f.fwd_out.index(n[1:])))
                continue
            keep = keep_saved if _is_tensor(t) else keep_cfg
            self.bwd_plan.append((1 if keep is keep_saved else 2, len(keep)))
            keep.append((2, n) if n in f.extra else (0, self.fwd_names.index(n)) if n in self.fwd_names
                        else (1, f.fwd_out.index(n)))
        # the saved tensors and non-tensors as one C-level pick from (args, outputs, extras)
        n_args, n_out, extras = len(self.fwd_names), len(f.fwd_out), list(f.extra)
        self.pick_saved, self.pick_cfg = (_picker([i if kind == 0 else n_args + i if kind == 1
                                                   else n_args + n_out + extras.index(i) for kind, i in keep])
                                          for keep in (keep_saved, keep_cfg))
        # zeros for an unused output only where the backward cannot take None for its gradient (the scan's
        # unused last_state gets none: its `dlast_state` is optional; an allocation and a fill kernel per
        # training step saved). The C++ node decides per differentiable output; the autograd.Function and
        # the custom op let torch materialize where every differentiable output needs it, else make the
        # zeros themselves (zero_outs) from the outputs' metadata kept at the forward.
        need = {i for (k, i), (_, t) in zip(self.bwd_plan, self.bwd_args) if k == 0 and t == "Tensor"}
        self.materialize_out = tuple(i in need for i in self.diff_out)
        self.materialize = need == set(self.diff_out)
        self.zero_outs = () if self.materialize else tuple(sorted(need))
        # forward argument -> index of its gradient among the backward's outputs (-1: none)
        self.grad_plan = [f.bwd_out.index("d" + n) if "d" + n in f.bwd_out else -1 for n in self.fwd_names]
        # One output: the op returns a Tensor, not a tuple (torch reads "-> (Tensor)" as one Tensor).
        self.one_fwd, self.one_bwd = len(f.fwd_out) == 1, len(f.bwd_out) == 1
        fwd_ret, bwd_ret = _returns(len(f.fwd_out)), _returns(len(f.bwd_out))
        self.fwd_op = torch.library.custom_op(f"kspec::{f.name}_fwd", self.fwd_kernel, mutates_args=(),
                                              device_types="cuda", schema=f"({f.fwd}) -> {fwd_ret}")
        self.bwd_op = torch.library.custom_op(f"kspec::{f.name}_bwd", self.bwd_kernel, mutates_args=(),
                                              device_types="cuda", schema=f"({f.bwd}) -> {bwd_ret}")
        self.fwd_op.register_fake(self._fwd_fake)
        self.bwd_op.register_fake(self._bwd_fake)
        self.fwd_op.register_autograd(self._op_backward, setup_context=self._op_setup)
        self.function = self._eager_function()
        self.grad_call = self._grad_call_plan() if f.one_call else None
        self.grad_sized = self._sized_plan() if f.one_call else None  # call_grad's `sized`

    # ---- the custom ops ----

    def _save_flag(self, args) -> bool:
        return True if self.save_pos is None else bool(args[self.save_pos])

    def _full(self, args) -> tuple:
        """args with the defaults torch.library left out put back (every forward argument, in order)."""
        missing = len(self.fwd_args) - len(args)
        return tuple(args) + self.fwd_defaults[len(self.fwd_defaults) - missing:] if missing else tuple(args)

    def fwd_kernel(self, *args):
        args = self._full(args)
        return _unwrapped(_filled(self.family.forward(*args, save=self._save_flag(args)), args), self.one_fwd)

    def bwd_kernel(self, *args):
        return _unwrapped(_filled(self.family.backward(*args), args), self.one_bwd)

    def _fwd_call(self, *args):
        """The forward custom op's outputs, always a tuple."""
        outs = self.fwd_op(*args)
        return (outs,) if self.one_fwd else outs

    def _bwd_call(self, *args):
        """The backward custom op's outputs, always a tuple."""
        outs = self.bwd_op(*args)
        return (outs,) if self.one_bwd else outs

    def _fwd_fake(self, *args):
        args = self._full(args)
        f = self.family
        if f.fake is not None:
            return _unwrapped(_filled(f.fake(*args), args), self.one_fwd)
        present = None
        if self.save_pos is not None:  # the schema's optional outputs are what only the backward reads
            keep = bool(args[self.save_pos])
            present = {d["name"]: keep for d in _schema._info(f.ops[0])["outputs"] if d["optional"]}
        tensors = [args[i] for i in self.tensor_pos]
        return _unwrapped(_filled(_schema_fake(f.ops[0], tensors, f.derived, present), args), self.one_fwd)

    def _bwd_fake(self, *args):
        f = self.family
        if f.bwd_fake is not None:
            return _unwrapped(_filled(f.bwd_fake(*args), args), self.one_bwd)
        tensors = [a for a, (_, t) in zip(args, self.bwd_args) if _is_tensor(t)]
        return _unwrapped(_filled(_schema_fake(f.ops[1], tensors, f.derived, None), args), self.one_bwd)

    # ---- autograd, shared by the custom op and the eager Function ----

    def _setup(self, ctx, args, outs):
        env = args + tuple(outs)
        if self.family.extra:
            named = dict(zip(self.fwd_names + list(self.family.fwd_out), env))
            env += tuple(fn(named) for fn in self.family.extra.values())
        ctx.save_for_backward(*self.pick_saved(env))
        ctx.kspec_cfg = self.pick_cfg(env)
        ctx.kspec_absent = [a is None for a in args]
        ctx.kspec_saved = self._save_flag(args)
        if not self.materialize:
            ctx.set_materialize_grads(False)
            ctx.kspec_zeros = [(i, outs[i].shape, outs[i].dtype, outs[i].device) for i in self.zero_outs
                               if outs[i] is not None]

    def _grads(self, ctx, grads, bwd):
        """The forward arguments' gradients; grads: one per forward output (None: none came)."""
        if self.zero_outs:
            grads = list(grads)
            for i, shape, dtype, device in ctx.kspec_zeros:
                if grads[i] is None:
                    grads[i] = torch.zeros(shape, dtype=dtype, device=device)
        return self._grads_of(ctx.saved_tensors, ctx.kspec_cfg, ctx.kspec_absent, ctx.kspec_saved, grads, bwd)

    def _grads_of(self, saved, cfg, absent, kept, grads, bwd):
        f = self.family
        if f.save_required and not kept:
            raise RuntimeError(f"kspec::{f.name}_fwd ran with {f.save_arg}=False: it kept nothing for the backward")
        res = bwd(*[grads[i] if k == 0 else saved[i] if k == 1 else cfg[i] for k, i in self.bwd_plan])
        # a list comprehension, not a generator: one frame instead of one resumption per argument
        return tuple([None if j < 0 or a else res[j] for j, a in zip(self.grad_plan, absent)])

    def _op_setup(self, ctx, inputs, output):
        inputs = self._full(inputs)
        output = (output,) if self.one_fwd else output
        self._setup(ctx, inputs, output)
        nondiff = [output[i] for i in range(len(output)) if i not in self.diff_out]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)

    def _op_backward(self, ctx, *grads):
        return self._grads(ctx, grads, self._bwd_call)

    def _eager_function(self):
        """An autograd.Function on the family's forward and backward, returning the public outputs; made
        with type() so that its graph node is named for the family (NormActBackward)."""
        surface, f = self, self.family
        public, n_out = f.public, len(f.fwd_out)
        nondiff = [i for i in public if i not in self.diff_out]

        def forward(ctx, *args):
            save = surface._save_flag(args) and any(ctx.needs_input_grad)
            outs = f.forward(*args, save=save)
            surface._setup(ctx, args, outs)
            ctx.kspec_saved = save
            present = [outs[i] for i in nondiff if outs[i] is not None]  # an absent output is None
            if present:
                ctx.mark_non_differentiable(*present)
            return outs[public[0]] if len(public) == 1 else tuple([outs[i] for i in public])

        def backward(ctx, *grads):
            full = [None] * n_out
            for i, g in zip(public, grads):
                full[i] = g
            return surface._grads(ctx, full, f.backward)

        name = "".join(p.title() for p in f.name.split("_"))
        self.node_name = name + "Backward"
        return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                       "backward": staticmethod(backward)})

    # ---- the eager path's graph node made in C++ (kspec._torch_ext.record), where the extension is ----

    def _native_apply(self, args):
        """What the eager autograd.Function does, without its Python apply: the forward without grad, then
        one C++ node (SurfaceBackward) that saves what the spec says and calls _native_backward."""
        f = self.family
        save = self._save_flag(args)
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            outs = f.forward(*args, save=save)
        finally:
            torch._C._set_grad_enabled(enabled)
        env = args + tuple(outs)
        if f.extra:
            named = dict(zip(self.fwd_names + list(f.fwd_out), env))
            env += tuple(fn(named) for fn in f.extra.values())
        ctx = (self.pick_cfg(env), tuple(map(is_, args, self.nones)), save)
        _native.ext.record(self.node_name, self._native_backward, ctx, self.materialize_out,
                           self.pick_tensors(args), outs, self.diff_out, self.pick_saved(env))
        public = f.public
        return outs[public[0]] if len(public) == 1 else tuple([outs[i] for i in public])

    def _native_backward(self, saved, grads, ctx):
        """The tensor arguments' gradients; grads: one per differentiable output (None: none came)."""
        full = [None] * len(self.family.fwd_out)
        for i, g in zip(self.diff_out, grads):
            full[i] = g
        return self.pick_tensors(self._grads_of(saved, ctx[0], ctx[1], ctx[2], full, self.family.backward))

    # ---- one C++ call with a C++ node (kspec._torch_ext.call_grad), for a one_call family ----

    def _grad_call_plan(self):
        """call_grad's constant arguments, resolved once: (fwd op, bwd op, the param names, fn(args) -> their
        values, the backward's params, its arguments coded as call_grad takes them, the inputs' gradients)."""
        f = self.family
        optional = [t["optional"] for t in _schema._info(f.ops[1])["inputs"]]
        codes, bwd_params = [], []
        for n, t in self.bwd_args:
            if n.startswith("d") and n[1:] in f.fwd_out:
                codes.append((_GRAD_OPTIONAL if optional[len(codes)] else _GRAD) + f.fwd_out.index(n[1:]))
            elif n in f.extra:
                raise ValueError(f"{f.name}: one_call with an extra ({n})")
            elif not _is_tensor(t):
                bwd_params.append(n)
            elif n in self.fwd_names:
                codes.append(self.tensor_pos.index(self.fwd_names.index(n)))
            else:
                codes.append(_OUT + f.fwd_out.index(n))
        op_params = {p["name"] for p in _schema._info(f.ops[0])["params"]}
        param_pos = []
        for i, (n, t) in enumerate(self.fwd_args):
            if _is_tensor(t) or n == f.save_arg and n not in op_params:
                continue  # the save_arg that is no param of the op: the outputs `sized` allocates
            if n not in op_params:
                raise ValueError(f"{f.name}: one_call with a forward argument that is no param of {f.ops[0]} ({n})")
            param_pos.append(i)
        names = tuple(self.fwd_names[i] for i in param_pos)
        grad_of = tuple(self.grad_plan[i] for i in self.tensor_pos)
        return f.ops[0], f.ops[1], names, _picker(param_pos), tuple(bwd_params), tuple(codes), grad_of

    def _sized_plan(self):
        """call_grad's `sized`: None where no forward output has a dim that no input binds, else per output None
        or its dims as (input, dim, divisor) triples (the input by its place among the tensor arguments), read
        from the op's schema: a dim from the first required input that has it, a derived one by its CeilDiv."""
        f = self.family
        info = _schema._info(f.ops[0])
        where = {}  # dim -> (tensor argument index, its dim)
        for k, d in enumerate(info["inputs"]):
            if d["optional"] or d["alt_shape"] or any(tok.startswith("...") for tok in d["shape"]):
                continue  # absent, or of another shape, in some calls
            for j, tok in enumerate(d["shape"]):
                where.setdefault(tok, (k, j))
        rules, any_derived = [], False
        for d in info["outputs"]:
            if not any(tok in f.derived for tok in d["shape"]):
                rules.append(None)
                continue
            dims = []
            for tok in d["shape"]:
                rule = f.derived.get(tok)
                if rule is not None and not isinstance(rule, CeilDiv):
                    raise ValueError(f"{f.name}: one_call sizes output '{d['name']}' only by a CeilDiv rule for '{tok}'")
                src = rule.dim if rule is not None else tok
                if src not in where:
                    raise ValueError(f"{f.name}: no required input binds '{src}' of output '{d['name']}'")
                dims.append((*where[src], rule.by if rule is not None else 1))
            rules.append(tuple(dims))
            any_derived = True
        return tuple(rules) if any_derived else None

    # ---- the public entry ----

    def __call__(self, *args):
        """The public outputs of the forward, with autograd: the custom op under torch.compile, the forward
        alone when no gradient is wanted, else the eager path's node (C++ with the torch extension, else
        the autograd.Function)."""
        public = self.family.public
        if len(args) < len(self.fwd_args):
            args = self._full(args)
        # Whether autograd wants a gradient, inline (no helper, no list): this runs once per op call, and
        # each Python frame saved is ~0.1 us of a host-bound step. (Not operator.itemgetter: torch.compile
        # traces this function, and dynamo cannot trace an itemgetter's call.)
        grad = False
        if torch.is_grad_enabled():
            for i in self.tensor_pos:
                t = args[i]
                if t is not None and t.requires_grad:
                    grad = True
                    break
        if torch.compiler.is_compiling():
            if self.save_pos is not None:
                args = list(args)
                args[self.save_pos] = bool(args[self.save_pos]) and grad
            outs = self._fwd_call(*args)
        elif not grad:
            outs = self.family.forward(*args, save=False)
        elif _native.ext is not None:
            # a one_call family's saving forward in C++ (save_arg off: the general node, whose backward raises),
            # written out here rather than in a helper: one Python frame less per call
            if self.grad_call is not None and (self.save_pos is None or args[self.save_pos]):
                # the params as (names, values), no dict per call; only the public outputs come back (no
                # Python object made and dropped for each one only saved: norm_act's mean and rstd)
                fwd_op, bwd_op, names, pick, bwd_params, codes, grad_of = self.grad_call
                outs = _native.ext.call_grad(self.node_name, fwd_op, bwd_op, self.pick_tensors(args),
                                             (names, pick(args)), bwd_params, codes, grad_of,
                                             public[0] if len(public) == 1 else public, self.grad_sized)
                if outs is NotImplemented:  # kspec.call's C++ path would decline: nothing ran
                    return self._native_apply(args)
                return outs
            else:
                return self._native_apply(args)
        else:
            return self.function.apply(*args)
        return outs[public[0]] if len(public) == 1 else tuple([outs[i] for i in public])


def build(family: Family) -> Surface:
    """Registers the family's custom ops and autograd; the returned Surface is its public entry. With the
    torch extension its registry ops are dispatcher ops too (kspec._native; .native: theirs or None)."""
    s = Surface(family)
    FAMILIES[family.name] = s
    s.native = tuple(_native.define(op, family.derived) for op in family.ops)
    return s

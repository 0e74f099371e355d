"""An op's output shapes and dtypes from its schema (kspec.op_info), evaluated in Python: the rule C++'s
infer_outputs applies, for callers that have no tensors to hand it — torch's fake (meta) kernels under
torch.compile, where the sizes are symbolic (SymInt): the evaluation only reads, binds and repeats dims,
so symbolic sizes stay symbolic and dynamic shapes need no recompile.

A dim no input binds (selective_scan.fwd's `nstates`, e79's `nchk`) comes from `derived`, the family's
rule over the bound dims and params (e.g. nstates = ceil(seqlen / state_stride))."""
from __future__ import annotations

from functools import lru_cache

from . import _C


@lru_cache(maxsize=None)
def _info(op: str) -> dict:
    return _C.op_info(op)


def _bind(info: dict, shapes, dtypes):
    """(dims, leading, alt, dtype by tensor name) from the inputs' shapes (None: absent)."""
    dims: dict = {}
    leading: dict = {}
    alt: dict = {}
    dtype: dict = {}
    for d, shape, dt in zip(info["inputs"], shapes, dtypes):
        if shape is None:
            continue
        dtype[d["name"]] = dt
        use_alt = bool(d["alt_shape"]) and len(shape) == len(d["alt_shape"])
        alt[d["name"]] = use_alt
        tokens = d["alt_shape"] if use_alt else d["shape"]
        lead = 0
        if tokens and tokens[0].startswith("..."):
            lead = len(shape) - (len(tokens) - 1)
            name = tokens[0][3:]
            leading.setdefault(name, tuple(shape[:lead]))
            tokens = tokens[1:]
        for tok, v in zip(tokens, shape[lead:]):
            if not tok.isdigit():
                dims.setdefault(tok, v)
    return dims, leading, alt, dtype


def output_specs(op: str, shapes, dtypes, derived=None, present=None, params=None):
    """[(dtype name, shape tuple) or None] for each output of `op`, as kspec.call would allocate them.

    shapes, dtypes: per input in schema order (None for an absent one). derived: {dim: f(dims)} for dims
    no input binds. present: {output name: bool} for optional outputs without a present_with rule (by
    default absent, as C++ allocates them) or whose rule is a bool param (by default the param's value in
    `params`, else its default: norm_act.fwd's mean and rstd follow save_stats)."""
    info = _info(op)
    flags = {p["name"]: p["default"] for p in info["params"] if p["type"] == "bool"}
    dims, leading, alt, dtype = _bind(info, shapes, dtypes)
    for name, rule in (derived or {}).items():
        dims.setdefault(name, rule(dims))
    out = []
    for d in info["outputs"]:
        rule = d["present_with"]
        if rule in flags:
            given = (params or {}).get(rule)
            here = (present or {}).get(d["name"], bool(flags[rule] if given is None else given))
        elif rule:
            here = rule in dtype
        else:
            here = (present or {}).get(d["name"], not d["optional"])
        if not here:
            out.append(None)
            continue
        use_alt = bool(d["alt_shape"]) and bool(d["dtype_of"]) and alt.get(d["dtype_of"], False)
        shape = []
        for tok in d["alt_shape"] if use_alt else d["shape"]:
            if tok.startswith("..."):
                shape.extend(leading[tok[3:]])
            elif tok.isdigit():
                shape.append(int(tok))
            else:
                if tok not in dims:
                    raise _C.InvalidArgument(f"{op}: output '{d['name']}': no input binds its dim '{tok}' "
                                             "(the family's spec must give a rule for it)")
                shape.append(dims[tok])
        dt = dtype[d["dtype_of"]] if d["dtype_of"] else d["dtypes"][0]
        out.append((dt, tuple(shape)))
    return out

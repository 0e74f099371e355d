"""The XLA custom-call targets (kspec._C's table, generated from the op registry), without importing jax:
what kspec.jax registers, and the table the README's JAX and Nx sections print."""
from __future__ import annotations

import json

from . import _C


def available() -> bool:
    """Whether this kspec was built with XLA's FFI headers (jax installed at build time)."""
    return _C._xla_available()


def targets() -> list:
    """One dict per target: target, op, operands, results, attributes (name, type, doc)."""
    return json.loads(_C._xla_targets())


def markdown() -> str:
    """The target table as Markdown (target, op, operands, results, attributes)."""
    rows = ["| target | op | operands (in order; optional: *italic*) | results | attributes |",
            "|---|---|---|---|---|"]

    def names(ts):
        return ", ".join(f"*{t['name']}*" if t["note"].startswith(("optional", "with")) else t["name"] for t in ts)

    for t in targets():
        attrs = ", ".join(f"{a['name']}: {a['type'].split(' ')[0]}" for a in t["attributes"])
        rows.append(f"| `{t['target']}` | {t['op']} | {names(t['operands'])} | {names(t['results'])} | {attrs} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())

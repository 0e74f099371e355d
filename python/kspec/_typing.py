"""Type aliases of kspec's public signatures. kspec takes any GPU array (a torch tensor, a CuPy array,
anything with __cuda_array_interface__ or __dlpack__) and returns the caller's framework's tensors, so an
array is duck-typed: `Array` names the role, it constrains nothing."""
from __future__ import annotations

from typing import Any, Tuple

Array = Any
Arrays = Tuple[Array, ...]  # an op's outputs, in its schema's order (None for an absent one)

"""Which parameters a forward's outputs cannot reach: marked ready when backward starts.

A parameter that the forward did not use gets no gradient, so its hook never fires and its
bucket would wait for the end of backward. torch DDP with ``find_unused_parameters=True``
(Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3) instead walks the autograd graph
from the forward's outputs once the forward ends: every parameter whose ``AccumulateGrad`` node
is not reached gets no gradient in the coming backward, so its slot can be filled and its
bucket launched the moment backward starts. This is that walk.

The premise is that the loss depends on the parameters only through the outputs. A loss that
reads parameters directly (an L2 penalty written as ``sum(p.pow(2).sum() ...)``) breaks it;
the engine then raises, naming the parameter, as torch DDP does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def unreachable_params(outputs: Any, params: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``params`` that no tensor in ``outputs`` (any nesting of lists, tuples and
    dicts) depends on through autograd; [] when every parameter is reachable."""
    index_of = {id(p): i for i, p in enumerate(params)}
    reached: set[int] = set()
    stack: list[Any] = []
    for leaf in tree_leaves(outputs):
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
            continue
        if leaf.grad_fn is None:
            if id(leaf) in index_of:  # a parameter returned as it is
                reached.add(index_of[id(leaf)])
        else:
            stack.append(leaf.grad_fn)
    seen: dict[int, Any] = {}  # holding the nodes keeps their ids from being reused
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if variable is not None and id(variable) in index_of:
            reached.add(index_of[id(variable)])
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return [i for i in range(len(params)) if i not in reached]

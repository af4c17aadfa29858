"""Float MoE experts on mlx's CPU backend, in float32 a bounded group at a time.

mlx's CPU ``gather_mm`` is float32-only, so bf16/fp16 experts cannot run there as stored. Casting
a whole expert stack to float32 doubles it: the 397B head's 512 experts are ~13 GB in bf16 and
~26 GB in float32. ``BoundedSwitchGLU`` keeps the stack as stored and runs mlx-lm's
``SwitchGLU`` forward (``BoundedSwitchMLP``: its non-gated ``SwitchMLP``, ``fc1``, activation, ``fc2``, the relu²
experts of Nemotron-H) a group of experts at a time: the (token, slot) pairs are sorted by expert
(as mlx-lm's own sorted path does), the experts the router picked are split into groups of
``experts_per_group`` (from a float32 byte budget), and each group's experts are gathered,
cast to float32, multiplied with only the pairs routed to them and evaluated before the next
group, so at most one group's float32 copy is resident.

bf16 -> float32 is exact and every pair meets the same weights, in the same sorted order and
with the same rows per expert as the stock sorted path, so the outputs are bit-identical to
casting the whole stack (tests/test_experts.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# float32 bytes of the experts (all three projections) cast at once. The gather's stored copy
# (half as much again for bf16) is alive beside it while a group is cast: ~0.75 GiB transient.
FLOAT32_EXPERT_BUDGET_BYTES = 512 << 20

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # SwitchGLU's
MLP_PROJECTIONS = ("fc1", "fc2")  # SwitchMLP's


def expert_float32_bytes(glu: nn.Module, names=PROJECTIONS) -> int:
    """float32 bytes of one expert of ``glu``: its projections ``names`` (and biases)."""
    per_expert = 0
    for name in names:
        proj = getattr(glu, name)
        per_expert += proj["weight"][0].size + (proj["bias"][0].size if "bias" in proj else 0)
    return per_expert * 4


def experts_per_group(glu: nn.Module, budget_bytes: int, names=PROJECTIONS) -> int:
    """How many experts fit the float32 budget at once (at least one)."""
    return max(1, budget_bytes // expert_float32_bytes(glu, names))


def expert_groups(flat_indices: np.ndarray, group: int) -> Tuple[np.ndarray, List[Tuple[np.ndarray, int, int]]]:
    """The (token, slot) pairs sorted by expert, and per group of at most ``group`` distinct experts:
    (the experts' ids, first and last+1 position of their pairs in the sorted order)."""
    order = np.argsort(flat_indices, kind="stable")
    experts, starts = np.unique(flat_indices[order], return_index=True)
    bounds = list(starts) + [flat_indices.size]
    groups = []
    for g in range(0, experts.size, group):
        stop = min(experts.size, g + group)
        groups.append((experts[g:stop], int(bounds[g]), int(bounds[stop])))
    return order, groups


def _float32_rows(proj: nn.Module, key: str, experts: mx.array) -> Optional[mx.array]:
    return proj[key][experts].astype(mx.float32) if key in proj else None


def _project(proj: nn.Module, experts: mx.array, x: mx.array, local: mx.array) -> mx.array:
    """``SwitchLinear.__call__`` (sorted indices) with only ``experts``' rows, in float32."""
    y = mx.gather_mm(x, _float32_rows(proj, "weight", experts).swapaxes(-1, -2), rhs_indices=local,
                     sorted_indices=True)
    bias = _float32_rows(proj, "bias", experts)
    return y if bias is None else y + mx.expand_dims(bias[local], -2)


class BoundedSwitchGLU(nn.Module):
    """mlx-lm's ``SwitchGLU`` forward over float experts kept as stored, at most
    ``experts_per_group`` of them in float32 at once (module docstring)."""

    def __init__(self, glu: nn.Module, budget_bytes: Optional[int] = None):
        super().__init__()
        for name in PROJECTIONS:  # the stored SwitchLinears, under the same parameter names
            setattr(self, name, getattr(glu, name))
        self.activation = glu.activation
        self.group = experts_per_group(glu, FLOAT32_EXPERT_BUDGET_BYTES if budget_bytes is None else budget_bytes)

    def _group_forward(self, x: mx.array, experts: np.ndarray, local: np.ndarray) -> mx.array:
        ids, idx = mx.array(experts), mx.array(local)
        up = _project(self.up_proj, ids, x, idx)
        gate = _project(self.gate_proj, ids, x, idx)
        y = _project(self.down_proj, ids, self.activation(up, gate), idx)
        mx.eval(y)  # this group's float32 experts are freed before the next group is cast
        return y

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return _by_groups(x, indices, self.group, self._group_forward)


class BoundedSwitchMLP(nn.Module):
    """mlx-lm's ``SwitchMLP`` forward (``fc2(activation(fc1(x)))``) the same way."""

    def __init__(self, mlp: nn.Module, budget_bytes: Optional[int] = None):
        super().__init__()
        self.fc1, self.fc2, self.activation = mlp.fc1, mlp.fc2, mlp.activation
        self.group = experts_per_group(mlp, FLOAT32_EXPERT_BUDGET_BYTES if budget_bytes is None else budget_bytes,
                                       MLP_PROJECTIONS)

    def _group_forward(self, x: mx.array, experts: np.ndarray, local: np.ndarray) -> mx.array:
        ids, idx = mx.array(experts), mx.array(local)
        y = _project(self.fc2, ids, self.activation(_project(self.fc1, ids, x, idx)), idx)
        mx.eval(y)
        return y

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return _by_groups(x, indices, self.group, self._group_forward)


def _by_groups(x: mx.array, indices: mx.array, group: int, group_forward) -> mx.array:
    """The experts' outputs of every (token, slot) pair, ``group_forward`` run on at most ``group`` experts at once."""
    k = indices.shape[-1]
    rows = x.reshape(-1, 1, x.shape[-1])  # one row per token, as mlx-lm's _gather_sort flattens it
    flat = np.array(mx.stop_gradient(indices).reshape(-1))
    order, groups = expert_groups(flat, group)
    parts = []
    for experts, lo, hi in groups:
        pairs = order[lo:hi]
        local = np.searchsorted(experts, flat[pairs])  # expert id -> row of the gathered group
        parts.append(group_forward(rows[mx.array(pairs // k)], experts, local))
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    y = y[mx.array(np.argsort(order))]  # back to (token, slot) order
    return y.reshape(*indices.shape, y.shape[-1])


def _float_stack(m: nn.Module, names) -> bool:
    """Every projection in ``names`` a float expert stack (``switch_linear_classes``) not already float32."""
    classes = switch_linear_classes()
    return all(type(p := getattr(m, n, None)) in classes and p["weight"].dtype != mx.float32 for n in names)


def is_float_switch_glu(m: nn.Module) -> bool:
    """A ``SwitchGLU`` whose three projections are unquantized and not float32: mlx-lm's, or mlx-vlm's copy of it
    (whose MoE block calls any other module as ``switch_mlp(x, indices)`` and combines the result itself)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    glu = isinstance(m, SwitchGLU) or (type(m).__name__ == "SwitchGLU" and type(m).__module__.startswith("mlx_vlm."))
    return glu and _float_stack(m, PROJECTIONS)


def is_float_switch_mlp(m: nn.Module) -> bool:
    """A ``SwitchMLP`` whose two projections are unquantized and not float32."""
    from mlx_lm.models.switch_layers import SwitchMLP

    return isinstance(m, SwitchMLP) and _float_stack(m, MLP_PROJECTIONS)


def bound_float_experts(module: nn.Module, budget_bytes: Optional[int] = None) -> int:
    """On the CPU, swap every float non-float32 ``SwitchGLU`` (``SwitchMLP``) under ``module`` for a
    ``BoundedSwitchGLU`` (``BoundedSwitchMLP``; quantized experts use ``gather_qmm`` and stay; None: the budget is
    ``FLOAT32_EXPERT_BUDGET_BYTES``). Returns the count; does nothing off the CPU."""
    if mx.default_device() != mx.cpu:
        return 0
    n = 0

    def swap(m):
        nonlocal n
        n += 1
        return BoundedSwitchGLU(m, budget_bytes) if is_float_switch_glu(m) else BoundedSwitchMLP(m, budget_bytes)

    for _, parent in list(module.named_modules()):  # listed first: swapping edits the tree
        children = {name: swap(child) for name, child in parent.children().items()
                    if isinstance(child, nn.Module) and (is_float_switch_glu(child) or is_float_switch_mlp(child))}
        if children:
            parent.update_modules(children)
    # mlx-vlm's stacks, whose SwitchGLU has a forward of its own, cast whole (mlx-lm's are bounded above)
    return n + cast_float_experts(module, switch_linear_classes()[1:])


def switch_linear_classes() -> tuple:
    """The float expert-stack classes: mlx-lm's ``SwitchLinear`` and, where installed, mlx-vlm's."""
    from mlx_lm.models.switch_layers import SwitchLinear

    try:
        from mlx_vlm.models.switch_layers import SwitchLinear as VlmSwitchLinear
    except ImportError:
        return (SwitchLinear,)
    return (SwitchLinear, VlmSwitchLinear)


def cast_float_experts(module: nn.Module, classes: Optional[tuple] = None) -> int:
    """On the CPU, cast every float expert stack (of ``classes``; None: ``switch_linear_classes``) that is not
    float32 to float32, whole; return how many."""
    if mx.default_device() != mx.cpu:
        return 0
    classes = switch_linear_classes() if classes is None else classes
    cast = 0
    for _, m in module.named_modules():
        if type(m) in classes and m.weight.dtype != mx.float32:
            m.weight = m.weight.astype(mx.float32)
            cast += 1
    return cast

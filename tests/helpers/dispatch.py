"""Counting the calls of one operator, as torch dispatches them (below autograd: each a kernel on a GPU)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Dispatched(TorchDispatchMode):
    """Counts the calls of one operator dispatched while it is active."""

    def __init__(self, operator: torch._ops.OpOverload) -> None:
        super().__init__()
        self.operator = operator
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.operator
        return func(*args, **(kwargs or {}))


# a tensor made from Python data (`torch.tensor`, `new_tensor`), each a copy from the host, which on a GPU waits
# for every queued kernel
HOST_TENSOR = torch.ops.aten.lift_fresh.default
# a dtype cast where autograd records it (grad mode and torch.no_grad; torch.inference_mode dispatches `aten.to`)
CAST = torch.ops.aten._to_copy.default
# a tensor's value read by the host (`.item()`, `bool()`), which on a GPU waits for every queued kernel
HOST_READ = torch.ops.aten._local_scalar_dense.default

"""How FlowFormer spends memory on its three terms that grow with (H/8·W/8)², within `memory_budget_gb`.

At 1/8 resolution with N = H1·W1 source pixels, the official computation holds:
- the cost volume, B·N·N·heads fp32, and the patchify activations of all N cost maps at once;
- the global sub-sampled attention logits of the cost encoder, B·K·8 heads·N·N/16 fp32 (keys on a 4x4-strided
  grid): our cost encoder uses fused attention, which never holds them, so the plan leaves them out;
- GMA's global motion attention map in the decoder, B·N·N fp32.
With a budget, the plan keeps the dense computation when its estimate fits and otherwise bounds each of the
two remaining terms to a quarter of the budget: cost maps computed in blocks of `cost_rows` source pixels (a
FeatureCostVolume), the motion attention evaluated for `gma_queries` queries at a time. A bounded plan also
gives the layers whose transients grow linearly with the pixels a quarter of the budget, `activation_bytes`,
which they spend on blocks of rows: the image encoders' transformer blocks (Twins), then the cost encoder's
layers over the cost memory (at 1080p each AGT layer's transients reach gigabytes), then the decoder's convex
upsampling (about 1 GB at 4K). They run one after the other, so they share the quarter. The numbers are the
same either way (to float rounding). Estimates count fp32 bytes of the named tensors (softmax keeps a second
copy), not the allocator's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_BYTES = 4  # bytes per fp32 value, for every memory estimate of the models
SOFTMAX_COPIES = 2  # logits and their softmax exist together


@dataclass(frozen=True)
class MemoryPlan:
    """None everywhere: the dense (official) computation."""

    cost_rows: int | None = None
    gma_queries: int | None = None
    activation_bytes: int | None = None

    @property
    def dense(self) -> bool:
        return self.cost_rows is None and self.gma_queries is None and self.activation_bytes is None


def plan_memory(
    budget_gb: float | None,
    *,
    batch: int,
    h1: int,
    w1: int,
    heads: int,
    cost_map_bytes: int,
) -> MemoryPlan:
    """The plan for one forward pass at 1/8-resolution size h1 x w1 (None budget: dense); cost_map_bytes: what
    the cost encoder holds per cost map while encoding it (`CostEncoder.cost_map_bytes`)."""
    if budget_gb is None:
        return MemoryPlan()
    budget = budget_gb * 2**30
    n = h1 * w1
    per_gma_query = batch * n * FLOAT_BYTES * SOFTMAX_COPIES
    dense = batch * n * n * heads * FLOAT_BYTES + batch * n * cost_map_bytes + n * per_gma_query
    if dense <= budget:
        return MemoryPlan()
    share = budget / 4
    return MemoryPlan(
        cost_rows=max(1, min(batch * n, int(share // cost_map_bytes))),
        gma_queries=max(1, min(n, int(share // per_gma_query))),
        activation_bytes=int(share),
    )

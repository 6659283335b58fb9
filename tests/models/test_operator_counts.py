"""The operators (aten calls, each one kernel launch or more on a GPU) the tiny backbone dispatches per decoder
iteration and per training step, counted as task=bench counts them for every row (`bench.count_operators`), on
the CPU. Pinned exactly, so that launch overhead cannot grow unnoticed.

To update a count after a deliberate change (a new operator in the decoder, or fewer): run this file, read the
new count in the failure message, write it below with the change's reason in the commit message, and its
before/after in docs/performance.md ("Operators dispatched"). A new torch version may dispatch other operators
for the same code: re-pin the counts then, in a commit of its own."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowformer.tasks import bench

from helpers.compose import compose_tiny_config

# tiny backbone, one 64x96 pair, 2 decoder iterations, fp32, dense, on the CPU, torch 2.x
# the attentions of at most 8x64 logits written out (layers.UNFUSED_MAX_LOGITS: faster on the CPU and the GPU,
# more operators): 95, 142, 120 and 2377 with torch's fused attention; bilinear_sample's divisor made on the
# device (no copy from the host) one fewer in inference; the GRU's gates from its weights' slices (no
# concatenation, the context's share once per forward: 98, 158, 136 and 2518 before): a pass of the GRU three
# adds and two splits (views) more, one sigmoid and two concatenations fewer; the weights sliced once a forward;
# the convex upsampling's own backward (layers._ConvexCombination: 159 and 2543 before): no detach of the
# softmax's output recorded for autograd in the training forward, and in its backward one copy of the incoming
# gradient in place of three detaches and an expand; the decoder's one-query attention by products and sums
# (layers.single_query_attention: 101, 156, 138 and 2535 before): three operators more in inference, ten fewer in
# training and under autocast, where the two batched products' reshapes and casts go
FORWARD_OPERATORS_PER_DECODER_ITERATION = 104  # inference (bench.mode=forward); 128 before issue 35
TRAINING_OPERATORS_PER_DECODER_ITERATION = 146  # the training forward; 188 before issue 35
# inference under bf16-mixed autocast: 158 when inference_mode made autocast cast every weight at every call,
# 147 while every iteration cast GMA's attention map to bf16 and the flow update to fp32
BF16_FORWARD_OPERATORS_PER_DECODER_ITERATION = 128
# forward, sequence loss, backward, clipping, AdamW (its foreach kernel on the CPU); 4657 before issue 35; the cost
# patch embedding channels-last on the CPU (cost_encoder.PatchEmbed: 2505 before): its copy and its backward's;
# 2511 since its one-head input is a channels-last view (a view and a permute, and a permute in backward)
TRAINING_OPERATORS_PER_STEP = 2511


def counts(mode: str, precision: str = "32-true") -> dict:
    cfg = bench.row_config(
        compose_tiny_config("bench.device=cpu", f"bench.mode={mode}", "bench.iters=2"), [64, 96], None, precision
    )
    torch.manual_seed(0)
    images = (torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255)
    net, step = bench.build_step(cfg, torch.device("cpu"), *images)
    return bench.count_operators(cfg, net, step, images)


@pytest.mark.parametrize(
    ("mode", "per_iteration"),
    [("forward", FORWARD_OPERATORS_PER_DECODER_ITERATION), ("train", TRAINING_OPERATORS_PER_DECODER_ITERATION)],
)
def test_operators_per_decoder_iteration_are_pinned(mode, per_iteration):
    assert counts(mode)["operators_per_decoder_iteration"] == per_iteration


def test_bf16_inference_casts_each_weight_once_per_forward():
    assert counts("forward", "bf16-mixed")["operators_per_decoder_iteration"] == (
        BF16_FORWARD_OPERATORS_PER_DECODER_ITERATION
    )


def test_operators_per_training_step_are_pinned():
    assert counts("train")["operators_per_step"] == TRAINING_OPERATORS_PER_STEP


def test_the_counter_counts_every_operator_once():
    x = torch.ones(3)
    assert bench.operators_dispatched(lambda: (x + 1) * 2) == 2
    assert bench.operators_dispatched(lambda: None) == 0


class HostTensors(TorchDispatchMode):
    """Counts the tensors made from Python data (`torch.tensor`, `new_tensor`: aten.lift_fresh), each a copy
    from the host, which on a GPU waits for every queued kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_decoder_iteration_makes_no_tensor_from_host_data(mode):
    """Nothing in the refinement loop is copied from the host: on a GPU each such copy would stop the CPU until
    the GPU has run everything queued, at every iteration."""
    cfg = bench.row_config(compose_tiny_config("bench.device=cpu", f"bench.mode={mode}"), [64, 96], None, "32-true")
    images = (torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255)
    net, _ = bench.build_step(cfg, torch.device("cpu"), *images)
    made = []
    for iters in (1, 3):
        with torch.set_grad_enabled(mode == "train"), HostTensors() as host:
            net(*images, iters=iters)
        made.append(host.count)
    assert made[1] == made[0]

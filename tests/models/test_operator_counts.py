"""The operators (aten calls, each one kernel launch or more on a GPU) the tiny backbone dispatches per decoder
iteration and per training step, counted as task=bench counts them for every row (`bench.count_operators`), on
the CPU. Pinned exactly, so that launch overhead cannot grow unnoticed.

To update a count after a deliberate change (a new operator in the decoder, or fewer): run this file, read the
new count in the failure message, write it below with the change's reason in the commit message, and its
before/after in docs/performance.md ("Operators dispatched"). A new torch version may dispatch other operators
for the same code: re-pin the counts then, in a commit of its own."""

from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from flowformer.data.io import write_image
from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.eval.protocol import Protocol
from flowformer.models import FlowFormer, save_backbone
from flowformer.tasks import bench, infer
from flowformer.tasks.eval import evaluate_set
from flowformer.tasks.runtime import InferenceContext, load_network

from helpers.compose import compose_tiny_config
from helpers.dispatch import CAST, HOST_TENSOR, Dispatched

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
# 147 while every iteration cast GMA's attention map to bf16 and the flow update to fp32, 128 while the cost
# query's output was cast to fp32 to join the cost crop and the two cast back to bf16 for the update block
BF16_FORWARD_OPERATORS_PER_DECODER_ITERATION = 127
# forward, sequence loss, backward, clipping, AdamW (its foreach kernel on the CPU); 4657 before issue 35; the cost
# patch embedding channels-last on the CPU (cost_encoder.PatchEmbed: 2505 before): its copy and its backward's;
# 2511 since its one-head input is a channels-last view (a view and a permute, and a permute in backward)
TRAINING_OPERATORS_PER_STEP = 2511
# The counts above are torch 2.14's. An older torch dispatches other operators for the same code (torch 2.6, the
# oldest pyproject.toml admits: one more per training and bf16 iteration, 2724 a training step), so they are
# checked on the torch they were pinned on and newer ones; a newer one that dispatches others fails: re-pin then.
PINNED_ON_TORCH = "2.14"
pinned_counts = pytest.mark.skipif(
    torch.__version__ < PINNED_ON_TORCH,
    reason=f"operator counts are pinned on torch {PINNED_ON_TORCH}; torch {torch.__version__} dispatches others",
)


def counts(mode: str, precision: str = "32-true") -> dict:
    cfg = bench.row_config(
        compose_tiny_config("bench.device=cpu", f"bench.mode={mode}", "bench.iters=2"), [64, 96], None, precision
    )
    torch.manual_seed(0)
    images = (torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255)
    net, step = bench.build_step(cfg, torch.device("cpu"), *images)
    return bench.count_operators(cfg, net, step, images)


@pinned_counts
@pytest.mark.parametrize(
    ("mode", "per_iteration"),
    [("forward", FORWARD_OPERATORS_PER_DECODER_ITERATION), ("train", TRAINING_OPERATORS_PER_DECODER_ITERATION)],
)
def test_operators_per_decoder_iteration_are_pinned(mode, per_iteration):
    assert counts(mode)["operators_per_decoder_iteration"] == per_iteration


@pinned_counts
def test_bf16_inference_casts_each_weight_once_per_forward():
    assert counts("forward", "bf16-mixed")["operators_per_decoder_iteration"] == (
        BF16_FORWARD_OPERATORS_PER_DECODER_ITERATION
    )


@pinned_counts
def test_operators_per_training_step_are_pinned():
    assert counts("train")["operators_per_step"] == TRAINING_OPERATORS_PER_STEP


def test_the_counter_counts_every_operator_once():
    x = torch.ones(3)
    assert bench.operators_dispatched(lambda: (x + 1) * 2) == 2
    assert bench.operators_dispatched(lambda: None) == 0


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_decoder_iteration_makes_no_tensor_from_host_data(mode):
    """Nothing in the refinement loop is copied from the host: on a GPU each such copy would stop the CPU until
    the GPU has run everything queued, at every iteration."""
    cfg = bench.row_config(compose_tiny_config("bench.device=cpu", f"bench.mode={mode}"), [64, 96], None, "32-true")
    images = (torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255)
    net, _ = bench.build_step(cfg, torch.device("cpu"), *images)
    made = []
    for iters in (1, 3):
        with torch.set_grad_enabled(mode == "train"), Dispatched(HOST_TENSOR) as host:
            net(*images, iters=iters)
        made.append(host.count)
    assert made[1] == made[0]


# the tiny backbone's weights and biases that bf16 autocast casts in a forward (convolutions, linear layers)
TINY_WEIGHT_CASTS_PER_FORWARD = 166


def casts_per_forward(run: Callable[[], object]) -> list[int]:
    """The casts dispatched inside each FlowFormer forward while `run()` runs (module hooks of torch, which
    reach the network a task loads itself)."""
    per_forward: list[int] = []
    casts = Dispatched(CAST)

    def entered(module: torch.nn.Module, *_) -> None:
        if isinstance(module, FlowFormer):
            per_forward.append(casts.count)

    def left(module: torch.nn.Module, *_) -> None:
        if isinstance(module, FlowFormer):
            per_forward.append(casts.count - per_forward.pop())

    hooks = [register_module_forward_pre_hook(entered), register_module_forward_hook(left)]
    try:
        with casts:
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return per_forward


def bf16_forwards(kept: bool) -> tuple[list[int], list[torch.Tensor]]:
    """Two bf16 inference forwards of the tiny backbone, each in its InferenceContext, within
    `keeping_weight_casts` or not: (the casts of each, the flows)."""
    torch.manual_seed(0)
    net = load_network(compose_tiny_config().backbone, None, torch.device("cpu"))
    images = (torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255)
    context = InferenceContext(torch.device("cpu"), "bf16-mixed", "test")
    flows = []

    def two_forwards() -> None:
        with context.keeping_weight_casts() if kept else nullcontext():
            for _ in range(2):
                with context:
                    flows.append(net(*images, iters=2)["flow"])

    return casts_per_forward(two_forwards), flows


def test_a_run_of_bf16_forwards_casts_each_weight_at_its_first_forward_only():
    """`InferenceContext.keeping_weight_casts` (task=eval's and task=infer's pairs, bench's forward steps): the
    forwards after the first cast no weight, with bitwise the same flow. It rests on torch keeping autocast's cast
    weights while any autocast region, even a disabled one, is open: this test fails if a torch version stops."""
    each, flows = bf16_forwards(kept=False)
    kept, kept_flows = bf16_forwards(kept=True)
    assert each[0] == each[1] == kept[0]
    assert kept[1] == each[0] - TINY_WEIGHT_CASTS_PER_FORWARD
    assert all(torch.equal(flow, flows[0]) for flow in [flows[1], *kept_flows])


def test_a_bf16_forward_row_of_bench_counts_a_step_after_the_weights_were_cast():
    """bench's forward rows run their steps as task=eval runs pairs: a steady step casts no weight."""
    cfg = bench.row_config(
        compose_tiny_config("bench.device=cpu", "bench.iters=2", "bench.warmup=0", "bench.repeats=1"),
        [64, 96], None, "bf16-mixed",
    )
    assert bench.measure(cfg)["operators_per_step"] == (
        counts("forward", "bf16-mixed")["operators_per_step"] - TINY_WEIGHT_CASTS_PER_FORWARD
    )


def test_task_eval_and_task_infer_cast_the_weights_at_their_first_pair_only(tmp_path):
    """Under bf16-mixed the forwards after the first of task=eval's set and of task=infer's frames cast no weight."""
    torch.manual_seed(0)
    net = load_network(compose_tiny_config().backbone, None, torch.device("cpu"))
    checkpoint = tmp_path / "tiny.pt"
    save_backbone(checkpoint, net)
    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(4):
        write_image(folder / f"f{i}.png", np.full((64, 96, 3), 40 * i, dtype=np.uint8))
    infer_cfg = compose_tiny_config(
        f"infer.input={folder}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={tmp_path / 'out'}",
        "infer.iters=2", "infer.device=cpu", "infer.precision=bf16-mixed", "infer.save_video=false",
    )
    data = SyntheticFlowDataset(num_samples=3, size=(64, 96), seed=0)
    runs = {
        "eval": lambda: evaluate_set(net, data, Protocol(kind="flow", iters=2), name="synthetic",
                                     device=torch.device("cpu"), precision="bf16-mixed"),
        "infer": lambda: infer.run(infer_cfg),
    }
    for name, run in runs.items():
        first, *others = casts_per_forward(run)
        assert others == [first - TINY_WEIGHT_CASTS_PER_FORWARD] * 2, name

"""`backbone.activation_checkpoint`: the stages it names keep (almost) nothing for backward and recompute their
activations there instead, and training computes the same loss and gradients, bitwise, on the dense and the
memory-bounded path."""

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from flowformer.losses import sequence_loss
from flowformer.models import FlowFormer
from flowformer.models.build import ACTIVATION_CHECKPOINT_STAGES, build_flowformer
from flowformer.models.checkpoint import current_backbone_config
from flowformer.models.encoders import TwinsEncoder
from flowformer.models.memory_plan import MemoryPlan

from helpers.configs import backbone_kwargs, build_backbone


def labelled(label: list[str], name: str, method: Callable) -> Callable:
    def run(*args, **kwargs):
        outer, label[0] = label[0], name
        try:
            return method(*args, **kwargs)
        finally:
            label[0] = outer

    return run


def training_step(
    net: FlowFormer, forward_context: AbstractContextManager | None = None
) -> tuple[dict[str, int], list[torch.Tensor], dict[str, torch.Tensor]]:
    """One supervised step on a fixed pair, the forward within `forward_context` (the backward outside, as
    Lightning runs it) -> (bytes autograd keeps for backward per stage, the flow predictions, the gradients). A storage counts once in each stage that saves it (the decoder keeps the
    cost volume that the cost encoder read, too)."""
    label = ["other"]
    net.encode_images = labelled(label, "image_encoders", net.encode_images)
    net.encode_cost = labelled(label, "cost_layers", net.encode_cost)
    net.cost_encoder.tokenize = labelled(label, "tokenize", net.cost_encoder.tokenize)
    net.decode = labelled(label, "decoder", net.decode)
    kept: dict[str, int] = defaultdict(int)
    storages = set()

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if (label[0], storage.data_ptr()) not in storages:
            storages.add((label[0], storage.data_ptr()))
            kept[label[0]] += storage.nbytes()
        return tensor

    g = torch.Generator().manual_seed(0)
    image1 = torch.rand(2, 3, 48, 64, generator=g) * 255
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    flow = torch.zeros(2, 2, 48, 64)
    flow[:, 0], flow[:, 1] = 3.0, 2.0
    with (
        forward_context or nullcontext(),
        torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor),
    ):
        predictions = net(image1, image2, iters=3)["flow_predictions"]
    loss, _ = sequence_loss(predictions, flow, torch.ones(2, 48, 64), gamma=0.8, max_flow=400.0)
    loss.backward()
    grads = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
    return dict(kept), [p.detach() for p in predictions], grads


@pytest.mark.parametrize("bounded", [False, True], ids=["dense", "bounded"])
@pytest.mark.parametrize("stages", [[stage] for stage in ACTIVATION_CHECKPOINT_STAGES] + [["all"]])
def test_checkpointed_stages_keep_little_and_give_the_same_gradients(stages, bounded, monkeypatch):
    stages = list(ACTIVATION_CHECKPOINT_STAGES) if stages == ["all"] else stages
    if bounded:  # cost maps from the features in blocks, the AGT layers one latent row / 7 pixels a block
        monkeypatch.setattr(FlowFormer, "memory_plan", lambda *a: MemoryPlan(7, 9, 1))
    torch.manual_seed(0)
    keeping = build_backbone()
    recomputing = build_backbone(activation_checkpoint=stages)
    recomputing.load_state_dict(keeping.state_dict())
    kept, flows, grads = training_step(keeping)
    kept_recomputing, flows_recomputing, grads_recomputing = training_step(recomputing)
    for stage in ACTIVATION_CHECKPOINT_STAGES:
        if stage in stages:
            assert kept_recomputing.get(stage, 0) < kept[stage] / 3, stage
        else:
            assert kept_recomputing[stage] == kept[stage], stage
    assert all(torch.equal(a, b) for a, b in zip(flows, flows_recomputing, strict=True))
    assert grads.keys() == grads_recomputing.keys()
    assert all(torch.equal(grads[name], grads_recomputing[name]) for name in grads)


def test_recomputation_keeps_the_autocast_of_the_forward():
    """Under bf16 autocast (the GPU recipe's precision) the recomputed stages run in the forward's precision
    again, though backward runs outside autocast, so the gradients stay those of keeping the activations."""
    torch.manual_seed(0)
    nets = [build_backbone(activation_checkpoint=stages) for stages in ([], ACTIVATION_CHECKPOINT_STAGES, [])]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    contexts = [torch.autocast("cpu", dtype=torch.bfloat16) for _ in range(2)] + [None]
    (_, flows, grads), (_, flows_recomputing, grads_recomputing), (_, _, grads_fp32) = map(
        training_step, nets, contexts
    )
    assert all(torch.equal(a, b) for a, b in zip(flows, flows_recomputing, strict=True))
    assert grads.keys() == grads_recomputing.keys() == grads_fp32.keys()
    assert all(torch.equal(grads[name], grads_recomputing[name]) for name in grads)
    assert not all(torch.equal(grads[name], grads_fp32[name]) for name in grads)  # autocast did change them


def test_inference_is_unaffected():
    torch.manual_seed(0)
    plain = build_backbone().eval()
    recomputing = build_backbone(activation_checkpoint=list(ACTIVATION_CHECKPOINT_STAGES)).eval()
    recomputing.load_state_dict(plain.state_dict())
    image1 = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(1)) * 255
    image2 = torch.roll(image1, shifts=(1, 2), dims=(2, 3))
    with torch.no_grad():
        assert torch.equal(
            plain(image1, image2, iters=2)["flow"], recomputing(image1, image2, iters=2)["flow"]
        )


def test_the_knob_names_stages():
    with pytest.raises(ValueError, match=r"activation_checkpoint takes stages from .*got \['gru'\]"):
        build_backbone(activation_checkpoint=["decoder", "gru"])
    with pytest.raises(TypeError, match="is a list of stages, e.g. \\[decoder\\]"):
        build_backbone(activation_checkpoint="decoder")
    stored = build_backbone(activation_checkpoint=("decoder",)).config["activation_checkpoint"]
    assert stored == ["decoder"]  # plain values, as checkpoints store the knobs


@pytest.mark.parametrize("old, now", [(True, ["tokenize"]), (False, [])])
def test_configs_stored_with_the_old_tokenize_checkpoint_still_build(old, now):
    stored = {k: v for k, v in backbone_kwargs().items() if k != "activation_checkpoint"}
    net = build_flowformer(**current_backbone_config({**stored, "tokenize_checkpoint": old}))
    assert net.config["activation_checkpoint"] == now
    assert net.cost_encoder.checkpoint_tokenize == old


def test_twins_blocks_are_recomputed_one_at_a_time():
    """The official image encoder (the tiny backbone's is the CNN): each transformer block, on the dense path and
    over row blocks, keeps only its input and gives the same gradients."""
    image = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        encoder = TwinsEncoder(checkpoint_blocks=recompute)
        for budget in (None, 1):
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t, kept=kept: kept.append(t.numel()) or t, lambda t: t
            ):
                features = encoder(image, activation_budget=budget)
            features.square().mean().backward()
            grads = [p.grad.clone() for p in encoder.parameters() if p.grad is not None]
            encoder.zero_grad()
            results.append((sum(kept), features.detach(), grads))
    for (kept, features, grads), (kept_recomputing, features_recomputing, grads_recomputing) in zip(
        results[:2], results[2:]
    ):
        assert kept_recomputing < kept / 3
        assert torch.equal(features, features_recomputing)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputing, strict=True))

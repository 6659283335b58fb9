"""MCVAPretrainModule on the tiny backbone: replayable draws, freezing, masked tokenisation, rounds, knobs, logging."""

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from torch.utils.data import DataLoader

from flowformer.lit.mcva import MCVAPretrainModule, mask_panel, patch_panel
from flowformer.models import FlowFormer, TokenMask, sample_cost_window
from flowformer.models.mcva import (
    normalize_per_pixel,
    recon_locations,
    reconstruction_loss,
)

from helpers.configs import backbone_config, mask_generator, mcva_settings, refuse_dense_volume
from helpers.trainers import cpu_trainer

H, W = 96, 128  # 1/8 res: 12 x 16 source pixels, 2 x 2 cost-map tokens each


def make_module(backbone_overrides: dict | None = None, **kwargs) -> MCVAPretrainModule:
    torch.manual_seed(0)
    kwargs.setdefault("query_num", 3)
    return MCVAPretrainModule(backbone=backbone_config(**(backbone_overrides or {})), **mcva_settings(**kwargs))


def image_pair(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    image1 = torch.rand(batch, 3, H, W, generator=gen) * 255
    return image1, torch.roll(image1, shifts=(2, 3), dims=(-2, -1))


def draws(module: MCVAPretrainModule, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    noise = module.mask_generator.noise(batch, H // 8, W // 8, generator=gen)
    return noise, torch.rand(module.hparams.query_num, batch, 2, H // 8, W // 8, generator=gen)


def test_injected_draws_replay_the_step_exactly_and_are_used():
    module = make_module()
    images = image_pair()
    noise, uniform = draws(module)
    first = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
    again = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
    assert torch.equal(first.loss, again.loss) and torch.equal(first.round_losses, again.round_losses)
    other_locations = module.pretrain_step(*images, mask_noise=noise, query_uniform=torch.rand_like(uniform))
    assert not torch.equal(other_locations.round_losses, first.round_losses)
    other_mask = module.pretrain_step(*images, mask_noise=torch.rand_like(noise), query_uniform=uniform)
    assert not torch.equal(other_mask.round_losses, first.round_losses)


def test_memory_budget_bounds_the_step_with_the_same_loss_and_gradients(monkeypatch):
    """backbone.memory_budget_gb applies to pretraining: the cost maps come in blocks from the features, the
    query and target windows are sampled from each block's maps, and loss and gradients stay those of the dense
    step (fixture C checks the same against the official step)."""
    dense, bounded = make_module(), make_module({"memory_budget_gb": 1e-6})
    images = image_pair()
    noise, uniform = draws(dense)
    assert not bounded.backbone.memory_plan(2, H // 8, W // 8).dense
    dense_out = dense.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
    dense_out.loss.backward()
    monkeypatch.setattr(bounded.backbone, "cost_volume", refuse_dense_volume)
    bounded_out = bounded.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
    bounded_out.loss.backward()
    torch.testing.assert_close(bounded_out.round_losses, dense_out.round_losses, rtol=1e-5, atol=0)
    grads = {name: p.grad for name, p in dense.backbone.named_parameters() if p.grad is not None}
    bounded_grads = {name: p.grad for name, p in bounded.backbone.named_parameters() if p.grad is not None}
    assert bounded_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(bounded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_keeps_less_with_the_same_loss_and_gradients():
    """backbone.activation_checkpoint applies to pretraining: masked tokenisation, the AGT layers and each query
    round recomputed in backward keep a fraction of the activations and give the keeping step's loss and
    gradients bitwise (encoders unfrozen, so they are checked too)."""
    unfrozen = {"freeze_image_encoder": False, "freeze_context_encoder": False}
    stages = ["image_encoders", "tokenize", "cost_layers", "decoder"]
    modules = make_module(**unfrozen), make_module({"activation_checkpoint": stages}, **unfrozen)
    images = image_pair()
    noise, uniform = draws(modules[0])
    results = []
    for module in modules:
        kept = {}  # bytes of each storage autograd keeps for backward

        def keep(tensor: torch.Tensor, kept: dict = kept) -> torch.Tensor:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
        out.loss.backward()
        grads = {n: p.grad for n, p in module.backbone.named_parameters() if p.grad is not None}
        results.append((sum(kept.values()), out.round_losses, grads))
    (kept, losses, grads), (kept_recomputing, losses_recomputing, grads_recomputing) = results
    assert kept_recomputing < kept / 5  # 0.27 without recomputing the query rounds (`decoder`), 0.16 with
    assert torch.equal(losses, losses_recomputing)
    assert grads.keys() == grads_recomputing.keys()
    assert all(torch.equal(grads[name], grads_recomputing[name]) for name in grads)


def test_loss_is_the_left_to_right_sum_of_rounds_of_normalised_target_mse():
    module = make_module(query_num=4)
    images = image_pair()
    noise, uniform = draws(module)
    output = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform, keep_rounds=1)
    torch.testing.assert_close(output.loss, output.round_losses.sum(), rtol=1e-6, atol=0)
    # round 0 by hand, from the network's stages
    net = module.backbone
    feat1, feat2, context = net.encode_images(*images)
    cost_maps = net.cost_volume(feat1, feat2)
    memory = net.encode_cost(cost_maps, context, token_mask=mask_generator().token_mask(noise))
    coords = recon_locations(uniform[0], shape=(2, H // 8, W // 8), recon_size=15, location="random")
    target = sample_cost_window(cost_maps, coords, 7)  # [B, 225, H1, W1]
    prediction = net.pretrain_head(net.query_cost_memory(memory, cost_maps, coords))
    torch.testing.assert_close(
        output.round_losses[0], reconstruction_loss(prediction, target, normalize="target"), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(output.targets[0], normalize_per_pixel(target))
    assert output.predictions[0].shape == (2, 225, H // 8, W // 8)


def test_frozen_encoders_get_no_gradient_and_stay_in_eval_mode():
    module = make_module().train()
    output = module.pretrain_step(*image_pair())
    output.loss.backward()
    net = module.backbone
    for frozen in net.feature_encoder_modules() + net.context_encoder_modules():
        assert not frozen.training
        assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    trained = ["memory_encoder.cost_perceiver_encoder.", "memory_decoder.flow_token_encoder.",
               "memory_decoder.decoder_layer.", "memory_decoder.pretrain_head."]  # fmt: skip
    params = dict(net.named_parameters())
    for prefix in trained:
        grads = [p.grad for n, p in params.items() if n.startswith(prefix)]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), prefix
    assert all(p.grad is None for n, p in params.items() if n.startswith("memory_decoder.update_block."))


def test_unfreezing_each_encoder_lets_it_learn():
    module = make_module(freeze_image_encoder=False, freeze_context_encoder=False).train()
    module.pretrain_step(*image_pair()).loss.backward()
    net = module.backbone
    assert net.context_encoder.training and net.memory_encoder.feat_encoder.training
    for encoder in net.feature_encoder_modules() + net.context_encoder_modules():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())


def test_masked_cost_patches_do_not_reach_the_cost_memory(tiny_net: FlowFormer):
    """Masked convolution over the 3-level mask pyramid + gathering the visible tokens before the latent
    cross-attention: whatever a removed 8x8 patch contains, the cost memory is the same."""
    net = tiny_net.eval()
    h1, w1 = 16, 24
    cost_maps = torch.randn(h1 * w1, 1, h1, w1) * 10  # [B*H1*W1, 1, H1, W1], B = 1
    context = torch.randn(1, 64, h1, w1)
    mask = mask_generator(mask_ratio=0.5).token_mask(torch.rand(1, h1, w1, 6))
    # removed [N, 6] over the 2x3 token grid -> pixel mask [N, 1, 16, 24] by 8x8 repetition
    pixel_removed = mask.removed.view(-1, 1, 2, 3).repeat_interleave(8, 2).repeat_interleave(8, 3)
    junk = torch.randn_like(cost_maps) * 100
    with torch.no_grad():
        memory = net.encode_cost(cost_maps, context, token_mask=mask)
        memory_junk = net.encode_cost(cost_maps + junk * pixel_removed, context, token_mask=mask)
        memory_visible_change = net.encode_cost(
            cost_maps + junk * (1 - pixel_removed), context, token_mask=mask
        )
    torch.testing.assert_close(memory_junk, memory, rtol=1e-5, atol=1e-5)
    assert (memory_visible_change - memory).abs().max() > 1e-2
    assert isinstance(mask, TokenMask) and mask.ids_keep.shape == (h1 * w1, 3)


@pytest.mark.parametrize(
    "backbone_overrides,module_kwargs",
    [
        ({"recon_size": 25}, {}),
        ({"recon_head_depth": 1}, {}),
        ({"recon_head_depth": 5}, {}),
        ({"decoder_query": "pe"}, {"recon_location": "fixed"}),
        ({}, {"masking": "random", "mask_ratio": 0.75}),
        ({}, {"normalize": "prediction"}),
    ],
)
def test_every_ablation_knob_builds_and_trains(backbone_overrides, module_kwargs):
    module = make_module(backbone_overrides, **module_kwargs).train()
    output = module.pretrain_step(*image_pair(), keep_rounds=1)
    output.loss.backward()
    size = backbone_overrides.get("recon_size", 15)
    assert output.predictions[0].shape == (2, size * size, H // 8, W // 8)
    convs = [m for m in module.backbone.pretrain_head.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == backbone_overrides.get("recon_head_depth", 3)
    assert torch.isfinite(output.loss)
    if module_kwargs.get("normalize") == "prediction":  # raw target kept; the prediction side is normalised
        assert output.targets[0].var(1).mean() > 10
    if "mask_ratio" in module_kwargs:
        assert output.token_mask.ids_keep.shape[1] == int(4 * (1 - module_kwargs["mask_ratio"]))


def test_fixed_locations_repeat_the_same_round():
    module = make_module(recon_location="fixed", query_num=2)
    output = module.pretrain_step(*image_pair())
    assert torch.equal(output.round_losses[0], output.round_losses[1])


def test_clear_errors_for_a_backbone_without_head_and_for_bad_sizes():
    with pytest.raises(ValueError, match="flowformer_pp"):
        MCVAPretrainModule(backbone=backbone_config(variant="flowformer"), **mcva_settings())
    module = make_module()
    with pytest.raises(ValueError, match="multiples of 8"):
        module.pretrain_step(torch.zeros(1, 3, 60, 96), torch.zeros(1, 3, 60, 96))
    with pytest.raises(ValueError, match="query_uniform"):
        module.pretrain_step(*image_pair(), query_uniform=torch.rand(1, 2, 2, H // 8, W // 8))
    with pytest.raises(ValueError, match="query_num"):
        make_module(query_num=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # each failed at the first step (the noise's own check, or torch.cat of no patch), naming no setting
        ({"min_block": 20}, r"^model.min_block=20, model.max_block=15: expected 1 <= min_block <= max_block"),
        ({"max_block": 0}, r"^model.min_block=4, model.max_block=0: expected"),
        ({"num_logged_patches": 0}, r"^model.num_logged_patches=0: expected a whole number >= 1$"),
        # a negative interval logged pictures (Python's modulo) where 0 logs none
        ({"log_images_every_n_steps": -5}, r"^model.log_images_every_n_steps=-5: expected a whole number >= 0$"),
    ],
)
def test_masking_and_picture_settings_are_checked_when_the_module_is_built(settings, message):
    with pytest.raises(ValueError, match=message):
        make_module(**settings)


def test_block_sizes_do_not_matter_to_random_masking():
    make_module(masking="random", min_block=20)


def test_panels_show_patches_transposed_and_blocks_as_colours():
    predictions = torch.arange(9.0).reshape(1, 9, 1, 1).expand(1, 9, 5, 5)
    panel = patch_panel(predictions, predictions, num_pixels=2)
    assert panel.dtype == np.uint8 and panel.shape == (7 * 8, 7 * 8, 3)
    # channel k = i*3 + j with i the x offset: the row below the top-left (y=1, x=0) holds channel 1
    assert panel[8, 0, 0] == int(255 * 1 / 8) and panel[0, 8, 0] == int(255 * 3 / 8)
    removed = torch.zeros(4 * 6, 4)
    removed[:12, :2] = 1  # top half one mask, bottom half another
    image = mask_panel(removed, 4, 6)
    assert image.shape == (32, 48, 3)
    assert (image[:16] == image[0, 0]).all() and (image[16:] == image[-1, -1]).all()
    assert not (image[0, 0] == image[-1, -1]).all()


class ImageLogger(Logger):
    """A logger with the wandb-style image API, recording what it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, list] = {}
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.update(metrics)

    def log_image(self, key: str, images: list, step: int | None = None, **kwargs) -> None:
        self.images.setdefault(key, []).extend(images)


def pair_loader(batch: int = 2) -> DataLoader:
    image1, image2 = image_pair(batch=4)
    items = [{"img1": image1[i], "img2": image2[i]} for i in range(4)]
    return DataLoader(items, batch_size=batch)


def test_training_logs_loss_lr_visible_ratio_and_pictures(tmp_path):
    module = make_module(query_num=2, log_images_every_n_steps=1, num_logged_patches=3)
    image_logger = ImageLogger()
    csv = CSVLogger(tmp_path)  # no image API: it only gets the scalars
    loggers = [image_logger, csv]
    trainer = cpu_trainer(
        max_steps=2, logger=loggers, log_every_n_steps=1, gradient_clip_val=1.0, default_root_dir=tmp_path
    )
    trainer.fit(module, pair_loader())
    for key in ("train/loss", "train/lr", "train/visible_ratio", "train/loss_per_round"):
        assert key in image_logger.metrics, key
    assert image_logger.metrics["train/visible_ratio"] == 0.5
    assert 0 < image_logger.metrics["train/lr"] < 5e-4
    assert len(image_logger.images["train/recon_patches"]) == 2
    assert image_logger.images["train/recon_patches"][0].shape == (47 * 8, 31 * 8, 3)
    assert image_logger.images["train/block_mask"][0].shape == (H, W, 3)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == 2 + 100 and scheduler.optimizer.defaults["weight_decay"] == 1e-5


def test_bf16_autocast_keeps_the_loss_and_targets_in_fp32():
    module = make_module()
    images = image_pair()
    noise, uniform = draws(module)
    reference = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = module.pretrain_step(*images, mask_noise=noise, query_uniform=uniform, keep_rounds=1)
    assert mixed.loss.dtype == torch.float32 and mixed.targets[0].dtype == torch.float32
    assert abs(mixed.loss.item() - reference.loss.item()) < 0.02 * reference.loss.item()
    mixed.loss.backward()


def test_draws_differ_between_ranks_and_resume_from_checkpoint(monkeypatch):
    images = image_pair()
    module = make_module()
    checkpoint: dict = {}
    module.pretrain_step(*images)
    module.on_save_checkpoint(checkpoint)
    continued = module.pretrain_step(*images)
    resumed = make_module()
    resumed.load_state_dict(module.state_dict())
    resumed.on_load_checkpoint(checkpoint)
    assert torch.equal(resumed.pretrain_step(*images).round_losses, continued.round_losses)
    rank0 = make_module()._generator("mask", "cpu").initial_seed()
    monkeypatch.setattr(MCVAPretrainModule, "global_rank", property(lambda self: 1))
    assert make_module()._generator("mask", "cpu").initial_seed() != rank0

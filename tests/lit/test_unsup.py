"""The unsupervised pretraining baseline (model=unsup, flowformer/lit/unsup.py and flowformer/unsupervised_loss.py):
kornia's image operations against direct computations, the loss on a synthetic pair with known flow, the
forward-backward occlusion mask, the settings it refuses, the module kind of its checkpoints, and a tiny
experiment=unsup_pretrain through run.py whose checkpoint initialises finetuning."""

import csv
import math
import warnings

import hydra
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from flowformer.lit.checkpointing import check_resume_checkpoint
from flowformer.lit.flow import FlowModule
from flowformer.lit.unsup import UnsupervisedPretrainModule
from flowformer.unsupervised_loss import (
    UnsupervisedLossSettings,
    backward_warp,
    census_transform,
    edge_aware_smoothness,
    photometric_maps,
    unsupervised_loss,
    visible_pixels,
)

from helpers.compose import compose_run_config, compose_tiny_config
from helpers.configs import backbone_config, flow_settings, model_settings
from helpers.run import run_py

LOSS_KNOBS = (
    "l1_weight",
    "ssim_weight",
    "census_weight",
    "smooth_weight",
    "smooth_order",
    "edge_constant",
    "mask_occlusions",
    "occlusion_relative",
    "occlusion_absolute",
    "gamma",
)


def loss_settings(**overrides) -> UnsupervisedLossSettings:
    """The loss settings of conf/model/unsup.yaml, with `overrides` applied."""
    settings = model_settings("unsup", **overrides)
    return UnsupervisedLossSettings(**{knob: settings[knob] for knob in LOSS_KNOBS})


def texture(height: int = 32, width: int = 48, seed: int = 0) -> torch.Tensor:
    """Smooth random colours [1, 3, H, W] in 0..255 (noise blurred over a few pixels: informative for the
    photometric terms at any sub-pixel position)."""
    noise = torch.rand(1, 3, height // 4, width // 4, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(noise, size=(height, width), mode="bicubic", align_corners=False).clamp(0, 1) * 255


# ---- kornia's operations, each against a direct computation --------------------------------------------------


def test_backward_warp_samples_image_2_where_the_flow_points():
    image = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(1, 2, 4, 5)
    flow = torch.zeros(1, 2, 4, 5)
    flow[:, 0] = 1.0  # one pixel right
    flow[:, 1, 2:] = -1.0  # and, on rows 2 and 3, one pixel up
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # none of kornia's names it uses is deprecated
        warped, inside = backward_warp(image, flow)
    for y in range(4):
        for x in range(4):
            assert torch.equal(warped[0, :, y, x], image[0, :, y - (y >= 2), x + 1])
    assert not inside[0, 0, :, 4].any() and inside[0, 0, :, :4].all()
    assert torch.equal(warped[0, :, :, 4], torch.zeros(2, 4))  # outside the frame: zeros

    half = torch.full((1, 2, 4, 5), 0.5)
    warped, _ = backward_warp(image, half)
    corners = image[..., :-1, :-1] + image[..., :-1, 1:] + image[..., 1:, :-1] + image[..., 1:, 1:]
    torch.testing.assert_close(warped[..., :-1, :-1], corners / 4)  # bilinear between the four neighbours


def test_the_ssim_term_is_the_structural_similarity_of_3x3_gaussian_windows():
    generator = torch.Generator().manual_seed(1)
    image1, image2 = torch.rand(2, 1, 3, 6, 7, generator=generator)
    error = photometric_maps(image1, image2, {"l1": 0.0, "ssim": 1.0, "census": 0.0})["ssim"]  # [1, 1, 6, 7]
    taps = torch.exp(-torch.tensor([1.0, 0.0, 1.0]) / (2 * 1.5**2))  # kornia's window: sigma 1.5
    window = torch.outer(taps, taps) / taps.sum() ** 2
    c1, c2 = 0.01**2, 0.03**2  # SSIM's constants for images in 0..1
    for y in range(1, 5):
        for x in range(1, 6):
            values = []
            for channel in range(3):
                a = image1[0, channel, y - 1 : y + 2, x - 1 : x + 2]
                b = image2[0, channel, y - 1 : y + 2, x - 1 : x + 2]
                mean_a, mean_b = (window * a).sum(), (window * b).sum()
                var_a = (window * a * a).sum() - mean_a**2
                var_b = (window * b * b).sum() - mean_b**2
                cov = (window * a * b).sum() - mean_a * mean_b
                similarity = (2 * mean_a * mean_b + c1) * (2 * cov + c2)
                similarity = similarity / ((mean_a**2 + mean_b**2 + c1) * (var_a + var_b + c2))
                values.append(((1 - similarity) / 2).clamp(0, 1))
            torch.testing.assert_close(error[0, 0, y, x], torch.stack(values).mean(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("order", [1, 2])
def test_the_smoothness_is_the_edge_weighted_derivative_of_the_flow(order):
    generator = torch.Generator().manual_seed(2)
    flow, image = torch.rand(1, 2, 5, 6, generator=generator), torch.rand(1, 3, 5, 6, generator=generator)
    edge_constant = 10.0
    penalties = []
    for y in range(1, 4):
        for x in range(1, 5):
            for dy, dx in ((0, 1), (1, 0)):  # d/dx, then d/dy
                slope = (image[0, :, y + dy, x + dx] - image[0, :, y - dy, x - dx]).abs().mean() / 2
                after, here, before = flow[0, :, y + dy, x + dx], flow[0, :, y, x], flow[0, :, y - dy, x - dx]
                derivative = (after - before) / 2 if order == 1 else after - 2 * here + before
                penalties.append(torch.exp(-edge_constant * slope) * derivative.abs())
    expected = torch.cat(penalties).mean()
    got = edge_aware_smoothness(flow, image, order=order, edge_constant=edge_constant)
    torch.testing.assert_close(got, expected)


def test_the_census_transform_is_the_soft_sign_of_each_neighbours_difference_in_grey():
    image = torch.rand(1, 3, 9, 10, generator=torch.Generator().manual_seed(5))
    transform = census_transform(image)  # [1, 49, 9, 10]
    grey = (0.299 * image[0, 0] + 0.587 * image[0, 1] + 0.114 * image[0, 2]) * 255  # ITU-R 601, kornia's weights
    y, x = 4, 5  # the 7x7 window fits
    neighbours = grey[y - 3 : y + 4, x - 3 : x + 4].reshape(-1)  # row-major, as the 49 channels
    difference = neighbours - grey[y, x]
    torch.testing.assert_close(transform[0, :, y, x], difference / torch.sqrt(0.81 + difference**2))


def test_the_loss_is_fp32_under_bf16_autocast():
    """Lightning's bf16-mixed runs the training step under autocast: the loss of bf16 flows is computed in fp32,
    as the same flows in fp32 give it."""
    image1, image2, flow = known_pair()
    first, second = torch.cat([image1, image2]), torch.cat([image2, image1])
    flows = [torch.cat([flow, -flow]) + 0.3 * torch.rand(2, 2, *flow.shape[-2:])]
    as_bf16 = [flow.to(torch.bfloat16) for flow in flows]
    expected = unsupervised_loss([flow.float() for flow in as_bf16], first, second, loss_settings())[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = unsupervised_loss(as_bf16, first, second, loss_settings())[0]
    assert loss.dtype == torch.float32
    assert torch.equal(loss, expected)


# ---- the loss on a pair with known flow --------------------------------------------------------------------


def known_pair(shift: tuple[int, int] = (3, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image 1, image 2 = image 1 moved by `shift` (x, y) pixels, and that flow [1, 2, H, W] from 1 to 2 (the
    pixels moved in from outside are where the flow back leaves the frame, so the loss leaves them out)."""
    image1 = texture()
    image2 = image1.roll(shifts=(shift[1], shift[0]), dims=(-2, -1))
    flow = torch.tensor(shift, dtype=torch.float32).view(1, 2, 1, 1).expand(1, 2, *image1.shape[-2:])
    return image1, image2, flow


def loss_of(flow: torch.Tensor, image1: torch.Tensor, image2: torch.Tensor, settings) -> torch.Tensor:
    """The loss of a constant flow used in both directions: the batch holds (1, 2) and (2, 1)."""
    first, second = torch.cat([image1, image2]), torch.cat([image2, image1])
    return unsupervised_loss([torch.cat([flow, -flow])], first, second, settings)[0]


@pytest.mark.parametrize(
    "photometric",
    [
        {},  # the defaults: 0.15 L1 + 0.85 SSIM
        {"l1_weight": 0.0, "ssim_weight": 0.0, "census_weight": 1.0},
    ],
    ids=["l1_ssim", "census"],
)
def test_the_loss_is_lowest_at_the_true_flow(photometric):
    image1, image2, flow = known_pair()
    settings = loss_settings(**photometric)
    at_truth = loss_of(flow, image1, image2, settings)
    matched = loss_of(torch.zeros_like(flow), image1, image1, settings)  # the loss of identical images
    assert at_truth == pytest.approx(matched.item(), abs=1e-5)  # the warped image matches where visible
    assert at_truth < loss_of(torch.zeros_like(flow), image1, image2, settings)
    for offset in ((1.5, 0.0), (0.0, -2.0)):
        shifted = flow + torch.tensor(offset).view(1, 2, 1, 1)
        assert at_truth < loss_of(shifted, image1, image2, settings)


def test_census_prefers_the_true_flow_under_a_change_of_brightness():
    """Why census is there: image 2 darker and offset, as between video frames."""
    image1, image2, flow = known_pair()
    image2 = image2 * 0.6 + 40
    census = loss_settings(l1_weight=0.0, ssim_weight=0.0, census_weight=1.0)
    assert loss_of(flow, image1, image2, census) < loss_of(torch.zeros_like(flow), image1, image2, census)


def test_the_loss_weighs_iterations_by_gamma():
    """Iteration i of N weighs gamma^(N-1-i); every iteration is scored on the pixels the last finds visible."""
    image1, image2, flow = known_pair()
    first, second = torch.cat([image1, image2]), torch.cat([image2, image1])
    sequence = [torch.zeros(2, 2, *flow.shape[-2:]), torch.cat([flow, -flow])]  # zero flow, then the truth

    def loss(flows: list[torch.Tensor], gamma: float) -> torch.Tensor:
        return unsupervised_loss(flows, first, second, loss_settings(gamma=gamma))[0]

    last_only, summed = loss(sequence, 0.0), loss(sequence, 1.0)
    assert last_only == loss(sequence[1:], 0.8)
    torch.testing.assert_close(loss(sequence, 0.5), 0.5 * (summed - last_only) + last_only)
    assert summed - last_only > last_only  # the zero flow scored worse, on the same pixels


# ---- occlusion ---------------------------------------------------------------------------------------------


def moving_square() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4x4 square moving 4 pixels right over a still background (16x16): the flows (1 -> 2) and (2 -> 1)
    [1, 2, H, W] and the pixels each direction cannot see in the other frame [1, 1, H, W]: the background the
    square covers in frame 2, and the background it uncovers."""
    forward, backward = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
    forward[:, 0, 4:8, 4:8] = 4.0  # the square in frame 1 ...
    backward[:, 0, 4:8, 8:12] = -4.0  # ... and in frame 2
    covered, uncovered = torch.zeros(1, 1, 16, 16, dtype=torch.bool), torch.zeros(1, 1, 16, 16, dtype=torch.bool)
    covered[..., 4:8, 8:12] = True
    uncovered[..., 4:8, 4:8] = True
    return forward, backward, covered, uncovered


def test_pixels_that_a_known_forward_backward_pair_occludes_are_masked():
    forward, backward, covered, uncovered = moving_square()
    keep, fractions = visible_pixels(torch.cat([forward, backward]), loss_settings())
    assert torch.equal(keep[:1], ~covered)
    assert torch.equal(keep[1:], ~uncovered)
    assert fractions["occluded_fraction"] == pytest.approx(32 / (2 * 256))
    assert fractions["outside_fraction"] == 0

    unmasked, fractions = visible_pixels(torch.cat([forward, backward]), loss_settings(mask_occlusions=False))
    assert unmasked.all() and fractions["occluded_fraction"] == 0


def test_occluded_pixels_add_nothing_to_the_photometric_loss():
    forward, backward, covered, uncovered = moving_square()
    image1, image2 = texture(16, 16, seed=3), texture(16, 16, seed=4)
    l1_only = loss_settings(ssim_weight=0.0, smooth_weight=0.0)
    flows = [torch.cat([forward, backward])]

    def loss(image1: torch.Tensor, image2: torch.Tensor) -> torch.Tensor:
        return unsupervised_loss(flows, torch.cat([image1, image2]), torch.cat([image2, image1]), l1_only)[0]

    before = loss(image1, image2)
    changed1 = torch.where(covered, 255.0 - image1, image1)  # only where frame 1 is occluded in frame 2
    changed2 = torch.where(uncovered, 255.0 - image2, image2)
    assert loss(changed1, changed2) == before
    assert loss(255.0 - image1, image2) != before  # a visible pixel changes it


# ---- the module ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"train_iters": 0}, "model.train_iters=0"),
        ({"smooth_weight": -1.0}, "model.smooth_weight=-1.0: must be >= 0"),
        ({"l1_weight": 0.0, "ssim_weight": 0.0}, "the loss needs a photometric term"),
        ({"smooth_order": 3}, "model.smooth_order=3: expected 1 or 2"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(override, message):
    with pytest.raises(ValueError, match=message):
        UnsupervisedPretrainModule(backbone=backbone_config(), **model_settings("unsup", **override))


@pytest.mark.parametrize("saved_by", ["unsup", "flow"])
def test_an_unsup_checkpoint_resumes_only_as_unsup(tmp_path, saved_by):
    """FlowModule and UnsupervisedPretrainModule share gamma and train_iters: the kind is the one whose
    settings the checkpoint holds most of."""
    unsup = UnsupervisedPretrainModule(backbone=backbone_config(), **model_settings("unsup"))
    flow = FlowModule(backbone=backbone_config(), **flow_settings())
    saver, resumer = (unsup, flow) if saved_by == "unsup" else (flow, unsup)
    path = tmp_path / "other.ckpt"
    checkpoint = {"state_dict": saver.state_dict(), "global_step": 1, "loops": {}, "optimizer_states": []}
    torch.save({**checkpoint, "hyper_parameters": dict(saver.hparams)}, path)
    with pytest.raises(ValueError, match=f"saved by {type(saver).__name__}, but this run trains"):
        check_resume_checkpoint(path, resumer, max_steps=2)
    check_resume_checkpoint(path, saver, max_steps=2)


@pytest.mark.slow
def test_a_tiny_unsup_pretrain_run_initialises_finetuning(tmp_path):
    """`experiment=unsup_pretrain` through run.py, then the finetuning command an MCVA run is followed by,
    `experiment=chairs model.init_from=<its last.ckpt>`, takes its weights."""
    run_dir = tmp_path / "pretrain"
    run_py(
        "experiment=unsup_pretrain",
        "backbone=tiny",
        "data=synthetic_video",
        "trainer=cpu",
        "data.batch_size=2",
        "model.train_iters=2",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        f"hydra.run.dir={run_dir}",
    )
    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row["train/loss"]]
    assert len(rows) == 2
    for term in ("loss", "l1", "ssim", "smoothness", "occluded_fraction", "outside_fraction"):
        assert all(math.isfinite(float(row[f"train/{term}"])) for row in rows), term
    last = run_dir / "checkpoints" / "last.ckpt"
    pretrained = torch.load(last, weights_only=True)
    assert pretrained["global_step"] == 2

    finetune_cfg = compose_tiny_config("experiment=chairs", "backbone=tiny", f"model.init_from={last}")
    finetune = hydra.utils.instantiate(finetune_cfg.model)
    assert isinstance(finetune, FlowModule)
    weights = {k.removeprefix("backbone."): v for k, v in pretrained["state_dict"].items()}
    state = finetune.backbone.state_dict()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[key], weights[key]) for key in weights)


def test_unsup_pretrain_is_mcva_pretrain_with_another_objective():
    """The paper's comparison: `experiment=mcva_pretrain` and `experiment=unsup_pretrain` pretrain the same
    network on the same data for the same steps (backbone.activation_checkpoint trades memory, not numbers)."""
    mcva, unsup = (compose_run_config([f"experiment={name}"]) for name in ("mcva_pretrain", "unsup_pretrain"))
    assert unsup.model._target_ == "flowformer.lit.unsup.UnsupervisedPretrainModule"
    assert (unsup.task, unsup.name) == ("pretrain", "unsup_pretrain")
    for group in ("data", "trainer", "callbacks"):
        assert unsup[group] == mcva[group], group
    backbones = [OmegaConf.to_container(cfg.backbone, resolve=True) for cfg in (mcva, unsup)]
    for backbone in backbones:
        del backbone["activation_checkpoint"]
    assert backbones[0] == backbones[1]

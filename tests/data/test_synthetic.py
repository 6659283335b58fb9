"""Built-in synthetic data: exact flow (warp test), masks, determinism, any size, clips for MCVA."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from flowformer.data.synthetic import (
    SyntheticFlowDataset,
    SyntheticVideoDataset,
    _power,
    _sample_front,
    _to_image,
    _to_layer,
    procedural_textures,
)
from flowformer.tasks.bench import operators_dispatched

from helpers.warping import visible, warp_error

SIZE = (64, 96)


def test_item_follows_the_data_contract() -> None:
    item = SyntheticFlowDataset(num_samples=2, size=SIZE, seed=0)[1]
    assert set(item) == {"img1", "img2", "flow", "valid", "occlusion", "meta"}
    for key in ("img1", "img2"):
        assert item[key].shape == (3, *SIZE) and item[key].dtype == torch.float32
        assert 0 <= item[key].min() and item[key].max() <= 255
        assert item[key].std() > 10  # textured, not flat
    assert item["flow"].shape == (2, *SIZE) and item["flow"].dtype == torch.float32
    for key in ("valid", "occlusion"):
        assert item[key].shape == SIZE and item[key].dtype == torch.float32
        assert set(item[key].unique().tolist()) <= {0.0, 1.0}
    assert item["meta"] == {"dataset": "synthetic", "seed": 0, "index": 1}


@pytest.mark.parametrize("size", [SIZE, (37, 53)])
def test_warping_image2_by_gt_flow_recovers_image1(size: tuple[int, int]) -> None:
    dataset = SyntheticFlowDataset(num_samples=4, size=size, seed=3)
    errors, zero_errors = [], []
    for index in range(len(dataset)):
        item = dataset[index]
        assert visible(item).float().mean() > 0.4
        errors.append(warp_error(item, item["flow"]))
        zero_errors.append(warp_error(item, torch.zeros_like(item["flow"])))
    mean_error = sum(errors) / len(errors)
    assert mean_error < 2.0, errors  # grey levels, on non-occluded valid pixels
    assert max(errors) < 3.5, errors
    assert sum(zero_errors) / len(zero_errors) > 4 * mean_error  # the flow, not the scene, explains frame 2


def test_flow_is_non_trivial_and_scales_with_size() -> None:
    small = SyntheticFlowDataset(num_samples=4, size=SIZE, seed=1)
    magnitudes = [small[i]["flow"].norm(dim=0).mean().item() for i in range(4)]
    assert sum(magnitudes) / 4 > 3.0, magnitudes
    # max_translation is given at 368x496 and scales with sqrt(H*W); the scene geometry scales with the image.
    # Without rotation and scaling every layer only translates, so the flow takes at most num_layers + 1
    # values, and doubling both sides doubles each of them.
    kwargs = {"num_samples": 1, "seed": 1, "max_rotation": 0.0, "max_scale_change": 0.0}
    small_flow = SyntheticFlowDataset(size=SIZE, **kwargs)[0]["flow"]
    big_flow = SyntheticFlowDataset(size=(2 * SIZE[0], 2 * SIZE[1]), **kwargs)[0]["flow"]

    def motions(flow: torch.Tensor) -> torch.Tensor:
        return (flow * 100).round().flatten(1).unique(dim=1).T / 100  # [n, 2]

    small, big = motions(small_flow), motions(big_flow)
    assert 2 <= len(small) <= 5 and len(big) == len(small)
    assert torch.cdist(2 * small, big).min(dim=1).values.max() < 0.05


def test_masks_are_consistent_with_the_flow() -> None:
    item = SyntheticFlowDataset(num_samples=1, size=SIZE, seed=5, max_translation=300.0)[0]
    height, width = SIZE
    ys, xs = torch.meshgrid(torch.arange(height).float(), torch.arange(width).float(), indexing="ij")
    tx, ty = xs + item["flow"][0], ys + item["flow"][1]
    outside = (tx < 0) | (tx > width - 1) | (ty < 0) | (ty > height - 1)
    assert outside.any()
    assert torch.equal(item["valid"] == 0, outside)
    assert (item["occlusion"][outside] == 1).all()  # leaving the image counts as occluded
    assert (item["occlusion"][~outside] == 1).any()  # and some surfaces are hidden by other layers


def test_a_scene_of_background_only() -> None:
    item = SyntheticFlowDataset(num_samples=1, size=SIZE, seed=2, num_layers=0)[0]
    # nothing in front of anything: occluded exactly where the target leaves the image
    assert 0 < item["valid"].mean() < 1 and torch.equal(item["occlusion"], 1 - item["valid"])


def test_deterministic_from_seed_and_index() -> None:
    first = SyntheticFlowDataset(num_samples=4, size=SIZE, seed=7)
    again = SyntheticFlowDataset(num_samples=4, size=SIZE, seed=7)
    _ = again[0]  # the order of access does not matter
    reference, repeat = first[2], again[2]
    for key in ("img1", "img2", "flow", "valid", "occlusion"):
        assert torch.equal(reference[key], repeat[key])
    assert not torch.equal(reference["img1"], first[1]["img1"])
    other_seed = SyntheticFlowDataset(num_samples=4, size=SIZE, seed=8)
    assert not torch.equal(reference["img1"], other_seed[2]["img1"])
    assert torch.equal(first[-2]["flow"], reference["flow"])
    with pytest.raises(IndexError, match="out of range"):
        first[4]


def test_batches_through_a_dataloader() -> None:
    batch = next(iter(DataLoader(SyntheticFlowDataset(num_samples=4, size=SIZE, seed=0), batch_size=2)))
    assert batch["img1"].shape == (2, 3, *SIZE) and batch["valid"].shape == (2, *SIZE)
    assert batch["meta"]["index"].tolist() == [0, 1]


def recording_painting(dataset: SyntheticFlowDataset) -> list[tuple[int, int]]:
    """The dataset's procedural textures, each call recorded as (thread, scenes painted) in the list returned."""
    calls = []

    def procedural_recording_its_calls(gens, layers, height, width):
        calls.append((threading.get_ident(), len(gens)))
        return procedural_textures(gens, layers, height, width)

    dataset.textures = procedural_recording_its_calls
    return calls


@pytest.mark.parametrize("size", [SIZE, (37, 53)])
def test_a_loader_renders_its_batch_together_each_pair_that_of_its_index_alone(size: tuple[int, int]) -> None:
    """A DataLoader's batch is rendered at once (one call of the dataset's __getitems__, in the loading thread,
    which paints the batch's textures in one call), on the process's threads, which are left as they were. Each
    pair is bitwise the pair of `dataset[index]`, also at a size whose pixels are not a multiple of the CPU's
    vector width and on two threads."""
    dataset = SyntheticFlowDataset(num_samples=100, size=size, seed=3)
    painting = recording_painting(dataset)
    indices = [17, 3, 99, 42, 0, 58, 71, 8]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batches = []
        batch_operators = operators_dispatched(
            lambda: batches.append(next(iter(DataLoader(dataset, batch_size=8, sampler=indices))))
        )
        assert torch.get_num_threads() == 2
        pair_operators = operators_dispatched(lambda: dataset[0])
    finally:
        torch.set_num_threads(previous)
    assert painting[0] == (threading.get_ident(), 8)
    # the scenes' random numbers are drawn pair by pair; the painting and rendering are the batch's, not 8
    # times a pair's operators
    assert batch_operators < 4 * pair_operators, (batch_operators, pair_operators)
    batch = batches[0]
    for position, index in enumerate(indices):
        alone = dataset[index]
        for key in ("img1", "img2", "flow", "valid", "occlusion"):
            assert torch.equal(batch[key][position], alone[key])
    assert batch["meta"]["index"].tolist() == indices


def test_large_scenes_are_rendered_in_chunks_of_bounded_pixels() -> None:
    """At 256x256 two scenes fill a chunk (2^17 pixels): a batch of 3 paints 2 scenes, then 1, each pair still
    that of its index alone."""
    dataset = SyntheticFlowDataset(num_samples=10, size=(256, 256), seed=1)
    painting = recording_painting(dataset)
    batch = next(iter(DataLoader(dataset, batch_size=3, sampler=[4, 0, 9])))
    assert [scenes for _, scenes in painting] == [2, 1]
    for position, index in enumerate([4, 0, 9]):
        assert torch.equal(batch["flow"][position], dataset[index]["flow"])
        assert torch.equal(batch["img2"][position], dataset[index]["img2"])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_of_clip_pairs_is_each_clip_alone(workers: int) -> None:
    """Also from a loader's worker process (one torch thread, the batch collated into shared memory)."""
    video = SyntheticVideoDataset(num_samples=10, size=(37, 53), seed=4, num_frames=4, frame_gap=2)
    batch = next(iter(DataLoader(video, batch_size=3, sampler=[7, 2, 5], num_workers=workers)))
    for position, index in enumerate([7, 2, 5]):
        clip = video.clip(index)
        assert torch.equal(batch["img1"][position], clip[0]) and torch.equal(batch["img2"][position], clip[2])


def test_one_lookup_per_pixel_equals_every_layers_reflected_lookup() -> None:
    """A frame's colour at a pixel is one bilinear lookup in its front layer's texture (the layers stacked); it
    equals sampling every layer with grid_sample's reflection padding and keeping the front one, also at points
    several image sizes outside the texture, on its edges and on its pixel centres."""
    gen = torch.Generator().manual_seed(0)
    layers, height, width = 4, 20, 30
    textures = torch.rand(layers, 3, height, width, generator=gen) * 255
    x = torch.rand(layers, 16, 24, generator=gen) * 7 * width - 3 * width
    y = torch.rand(layers, 16, 24, generator=gen) * 7 * height - 3 * height
    x[:, 0, :4] = torch.tensor([-0.5, width - 0.5, 0.0, width - 1.0])  # the edges of reflection, pixel centres
    y[:, 0, :4] = torch.tensor([height - 0.5, -0.5, height - 1.0, 0.0])
    points = torch.complex(x, y)  # [L, 16, 24] layer points
    front = torch.randint(0, layers, (16, 24), generator=gen)

    colours = _sample_front(SimpleNamespace(textures=textures[None]), points[None], front[None])[0]

    size = torch.tensor([width, height], dtype=torch.float32)
    grid = (torch.view_as_real(points) + 0.5) / size * 2 - 1
    every_layer = F.grid_sample(textures, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    expected = every_layer.gather(0, front.expand(1, 3, -1, -1))[0]  # [3, 16, 24]
    assert colours.shape == (3, 16, 24)
    torch.testing.assert_close(colours, expected, rtol=0, atol=1e-2)


def test_shape_powers_by_logarithms_equal_pow() -> None:
    base = torch.cat([torch.zeros(1), torch.rand(10000, generator=torch.Generator().manual_seed(1)) * 100])
    for exponent in (1.0, 2.0, 6.0, 1 / 2, 1 / 6):  # the superellipses' exponents and their inverses
        expected = base**exponent
        torch.testing.assert_close(_power(base.clone(), torch.tensor(exponent)), expected, rtol=1e-5, atol=0)


def test_layer_and_image_motions_are_inverse() -> None:
    scenes = SyntheticFlowDataset(num_samples=2, size=SIZE, seed=5)._scenes([0, 1])
    gen = torch.Generator().manual_seed(2)
    points = torch.complex(torch.rand(1, 1, 8, 8, generator=gen) * 96, torch.rand(1, 1, 8, 8, generator=gen) * 64)
    for t in (0.0, 0.5, 1.0):
        there_and_back = _to_image(scenes, _to_layer(scenes, points, t), t)  # [2, L, 8, 8]: every layer's motion
        assert there_and_back.shape == (2, 5, 8, 8)
        torch.testing.assert_close(there_and_back, points.expand_as(there_and_back), rtol=0, atol=1e-4)
    assert not torch.allclose(_to_layer(scenes, points, 1.0), points.expand(2, 5, -1, -1))


def test_video_clips_are_scenes_of_the_same_kind() -> None:
    video = SyntheticVideoDataset(num_samples=2, size=SIZE, seed=4, num_frames=3)
    pairs = SyntheticFlowDataset(num_samples=2, size=SIZE, seed=4)
    clip = video.clip(1)
    assert clip.shape == (3, 3, *SIZE) and clip.dtype == torch.float32
    # Frames are evenly spaced in time from 0 to 1, so the clip's ends are the labelled pair of the same scene.
    assert torch.equal(clip[0], pairs[1]["img1"]) and torch.equal(clip[2], pairs[1]["img2"])
    assert not torch.equal(clip[1], clip[0]) and not torch.equal(clip[1], clip[2])
    item = video[1]
    assert set(item) == {"img1", "img2", "meta"}
    assert torch.equal(item["img1"], clip[0]) and torch.equal(item["img2"], clip[2])
    gap_one = SyntheticVideoDataset(num_samples=2, size=SIZE, seed=4, num_frames=5, frame_gap=1)
    assert torch.equal(gap_one[0]["img2"], gap_one.clip(0)[1])


def test_bad_settings_are_reported() -> None:
    with pytest.raises(ValueError, match="size must be"):
        SyntheticFlowDataset(num_samples=1, size=(4, 96))
    with pytest.raises(ValueError, match="num_samples"):
        SyntheticFlowDataset(num_samples=0, size=SIZE)
    with pytest.raises(ValueError, match="num_frames must be >= 3"):
        SyntheticVideoDataset(num_samples=1, size=SIZE, num_frames=2)
    with pytest.raises(ValueError, match="frame_gap"):
        SyntheticVideoDataset(num_samples=1, size=SIZE, num_frames=3, frame_gap=3)

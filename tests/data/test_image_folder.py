"""Pairs and clips rendered from a folder of photographs: exact flow, the file split, folder errors, the
zero-download default, the configs, and tiny training and MCVA pretraining runs on a folder of PNGs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from flowformer.data.datamodules import FlowDataModule, PretrainDataModule
from flowformer.data.image_folder import (
    SKIMAGE_PHOTOS,
    ImageFolderError,
    ImageFolderFlowDataset,
    ImageFolderVideoDataset,
)
from flowformer.data.io import read_image
from flowformer.data.sampling import SampleKey
from flowformer.data.transforms import FlowAugmentor, ImagePairAugmentor
from flowformer.tasks.train import fit

from helpers.compose import compose_tiny_config
from helpers.configs import CONF_DIR, REPO_DIR
from helpers.run import fresh_checkout, run_py
from helpers.warping import visible, warp_error

SIZE = (48, 64)


def _photo(seed: int, height: int = 72, width: int = 96) -> np.ndarray:
    """A colour texture, uint8 [H, W, 3]: blurred noise and a few rectangles, with edges about 3 px wide."""
    rng = np.random.default_rng(seed)
    image = cv2.GaussianBlur(rng.uniform(0, 255, (height, width, 3)).astype(np.float32), (0, 0), 2.0)
    image = (image - image.mean()) * 4 + 128
    for _ in range(4):
        y, x = rng.integers(0, height - 10), rng.integers(0, width - 10)
        image[y : y + rng.integers(5, 20), x : x + rng.integers(5, 20)] = rng.uniform(0, 255, 3)
    return np.clip(cv2.GaussianBlur(image, (0, 0), 1.5), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 usable photographs in nested folders (two share a name), one too small, one that is not an image."""
    root = tmp_path_factory.mktemp("photos")
    names = ["a.png", "b.jpg", "sub/c.png", "sub/deeper/d.PNG", "sub/a.png", "e.jpeg", "f.png", "g.png"]
    for seed, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(root / name), _photo(seed))
    cv2.imwrite(str(root / "sub" / "tiny.png"), _photo(99, 20, 20))
    (root / "notes.png").write_bytes(b"not an image")
    (root / "readme.txt").write_text("ignored: not an image suffix")
    return root


def test_warping_frame2_by_the_flow_recovers_frame1(photos: Path) -> None:
    dataset = ImageFolderFlowDataset(root=photos, num_samples=4, size=SIZE, seed=3)
    errors, zero_errors = [], []
    for index in range(len(dataset)):
        item = dataset[index]
        assert set(item) == {"img1", "img2", "flow", "valid", "occlusion", "meta"}
        assert item["meta"] == {"dataset": "image_folder", "seed": 3, "index": index}
        assert visible(item).float().mean() > 0.3
        errors.append(warp_error(item, item["flow"]))
        zero_errors.append(warp_error(item, torch.zeros_like(item["flow"])))
    mean_error = sum(errors) / len(errors)
    assert mean_error < 2.0 and max(errors) < 3.5, errors  # grey levels, as the synthetic pairs' test
    assert sum(zero_errors) / len(zero_errors) > 4 * mean_error  # the flow, not the scene, explains frame 2


def test_the_split_is_by_file_and_never_shares_a_photograph(photos: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        train = ImageFolderFlowDataset(root=photos, num_samples=6, size=SIZE, val_fraction=0.3)
        # val at another size, as a validation set at the training crop: the split does not depend on it
        val = ImageFolderFlowDataset(root=photos, split="val", num_samples=6, size=(32, 40), val_fraction=0.3)
    train_files, val_files = set(train.textures.files), set(val.textures.files)
    assert val_files and not train_files & val_files
    assert len(train_files | val_files) == 8  # every usable photograph (sub/a.png and a.png are two)
    assert {p.name for p in train_files | val_files} >= {"a.png", "d.PNG", "e.jpeg"}
    # the small and the unreadable file are skipped, with one line, in whichever split holds them
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert sum(" 1 smaller than the render size" in line for line in skipped) == 1
    assert sum(" 1 not readable as images" in line for line in skipped) == 1
    for index in range(len(val)):  # the validation scenes decode validation photographs only
        val[index]
    assert set(val.textures._cache) <= val_files


def test_links_lead_to_each_photograph_once_and_a_loop_is_not_followed(tmp_path: Path, caplog) -> None:
    """8 photographs under a root holding a symbolic-link loop (sub/loop -> the root) and a link to a file:
    each photograph is found once, in one split, and one warning line says what was skipped."""
    for seed in range(8):
        path = tmp_path / ("sub" if seed % 2 else "") / f"{seed}.png"
        path.parent.mkdir(exist_ok=True)
        cv2.imwrite(str(path), _photo(seed))
    (tmp_path / "sub" / "loop").symlink_to("..")
    (tmp_path / "link.png").symlink_to("0.png")
    with caplog.at_level(logging.WARNING):
        train = ImageFolderFlowDataset(root=tmp_path, num_samples=1, size=SIZE, val_fraction=0.25)
        val = ImageFolderFlowDataset(root=tmp_path, split="val", num_samples=1, size=SIZE, val_fraction=0.25)
    photographs = [path.resolve() for path in [*train.textures.files, *val.textures.files]]
    assert len(photographs) == len(set(photographs)) == 8  # each once, so in one split only
    assert (len(train.textures.files), len(val.textures.files)) == (6, 2)
    skipped = f"{tmp_path}: skipped 1 folders already visited (a symbolic-link loop or a second link to one"
    assert sum(f"{skipped} folder) and 1 files" in message for message in caplog.messages) == 2  # each split


def test_folder_errors_are_one_line_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def error_for(root: Path) -> str:
        with pytest.raises(ImageFolderError) as caught:
            ImageFolderFlowDataset(root=root, num_samples=1, size=SIZE)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "does not exist" in error_for(tmp_path / "missing")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("x")
    assert "holds no images" in error_for(tmp_path / "empty")
    (tmp_path / "small").mkdir()
    cv2.imwrite(str(tmp_path / "small" / "x.png"), _photo(0, 20, 20))
    assert "at least 2 images" in error_for(tmp_path / "small")
    cv2.imwrite(str(tmp_path / "small" / "y.png"), _photo(1, 20, 20))
    assert "is usable: 1 smaller than the render size 48x64; lower the dataset's size" in error_for(tmp_path / "small")
    locked = tmp_path / "locked"
    locked.mkdir()
    scandir = os.scandir

    def denied(path):  # what os.walk meets in a folder without read permission (root ignores chmod)
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    assert f"cannot read the image folder {locked} (Permission denied)" in error_for(locked)


def test_a_folder_of_16_bit_pngs_is_refused_as_not_8_bit(tmp_path: Path, caplog) -> None:
    """`python run.py task=train ... data=image_folder data.train.root=<16-bit PNGs>`: one line saying that
    8-bit images are expected (as task=infer says), not that the images do not decode; beside 8-bit
    photographs, the 16-bit ones are skipped with one warning line counting them."""
    deep = tmp_path / "deep"
    deep.mkdir()
    for seed in range(4):  # two colour and two grey 16-bit PNGs, larger than data=image_folder's render size
        photo = _photo(seed, 120, 160).astype(np.uint16) * 257
        cv2.imwrite(str(deep / f"{seed}.png"), photo if seed % 2 else photo[..., 0])
    result = run_py(
        "task=train",
        "backbone=tiny",
        "trainer=cpu",
        "data=image_folder",
        f"data.train.root={deep}",
        "trainer.max_steps=1",
        expect_ok=False,
        cwd=fresh_checkout(tmp_path / "checkout"),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert error.endswith(
        f"none of the 1 images of the val split of {deep} is usable: 1 not 8-bit (8-bit images are expected, "
        "as task=infer expects); convert them to 8-bit (config: data.val.image_folder.dataset)"
    )
    for seed in range(4, 8):
        cv2.imwrite(str(deep / f"{seed}.png"), _photo(seed))
    with caplog.at_level(logging.WARNING):
        dataset = ImageFolderFlowDataset(root=deep, num_samples=1, size=SIZE, val_fraction=0.25)
    assert len(dataset.textures.files) + sum(
        int(line.split("skipped ")[1].split()[0]) for line in caplog.messages if "not 8-bit" in line
    ) == 6
    assert all(read_image(path).dtype == np.uint8 for path in dataset.textures.files)


def test_photographs_deleted_during_training_stop_it_at_once_saving_last_ckpt(tmp_path: Path) -> None:
    """`python run.py ... data=image_folder +data.train.cache_mb=0` whose photographs are deleted after step 2:
    the run stops with one line saying they disappeared, last.ckpt saved, instead of training on with the one
    photograph in memory."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for seed in range(8):
        cv2.imwrite(str(photos / f"{seed}.png"), _photo(seed))
    run_dir = tmp_path / "run"
    result = run_py(
        "task=train",
        "backbone=tiny",
        "trainer=cpu",
        "data=image_folder",
        f"data.train.root={photos}",
        "data.batch_size=2",
        "data.val.image_folder.dataset.num_samples=2",
        "model.train_iters=2",
        "trainer.val_check_interval=20",
        "+data.train.cache_mb=0",
        "data.train.size=[40,56]",
        "data.train.augmentor.crop_size=[32,48]",
        "trainer.max_steps=40",
        "+callbacks.delete._target_=helpers.faults.DeleteFolderAtStep",
        "+callbacks.delete.step=2",
        f"+callbacks.delete.folder={photos}",
        f"hydra.run.dir={run_dir}",
        env={"PYTHONPATH": str(REPO_DIR / "tests")},
        expect_ok=False,
        timeout=600,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert f"photographs of the train split of {photos} disappeared during the run" in error
    assert "using the next image instead" not in result.stdout + result.stderr
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert 2 <= checkpoint["global_step"] < 40


def test_a_file_that_fails_to_decode_is_replaced_by_the_next(tmp_path: Path, caplog) -> None:
    for seed in range(4):
        cv2.imwrite(str(tmp_path / f"{seed}.jpg"), _photo(seed))
    dataset = ImageFolderFlowDataset(root=tmp_path, num_samples=1, size=SIZE, val_fraction=0.25)
    broken = dataset.textures.files[0]
    broken.write_bytes(broken.read_bytes()[:-200])  # the header still reads; the scan is cut short
    with caplog.at_level(logging.WARNING):
        image = dataset.textures._decoded(0)
    assert "truncated JPEG" in caplog.text and str(broken) in caplog.text
    assert image.shape == (72, 96, 3) and dataset.textures.files[1] in dataset.textures._cache


def test_deterministic_resumable_and_augmented(photos: Path) -> None:
    augmentor = FlowAugmentor(crop_size=[40, 56], min_scale=-0.1, max_scale=1.0)
    dataset = ImageFolderFlowDataset(root=photos, num_samples=4, size=SIZE, seed=5, augmentor=augmentor)
    again = ImageFolderFlowDataset(root=photos, num_samples=4, size=SIZE, seed=5, augmentor=augmentor)
    first, repeat = dataset[SampleKey(2, 77)], again[SampleKey(2, 77)]  # a training draw: its own seed
    assert set(first) == {"img1", "img2", "flow", "valid", "meta"}
    assert first["img1"].shape == (3, 40, 56) and first["flow"].shape == (2, 40, 56)
    assert bool(first["valid"].all())
    for key in ("img1", "img2", "flow"):
        assert torch.equal(first[key], repeat[key])
    assert not torch.equal(first["img1"], dataset[SampleKey(2, 78)]["img1"])  # another draw, another crop
    keys = [SampleKey(2, 77), SampleKey(0, 5), SampleKey(2, 78)]
    batch = next(iter(DataLoader(dataset, batch_size=3, sampler=keys)))  # rendered together, each augmented
    for position, key in enumerate(keys):
        alone = dataset[key]
        assert all(torch.equal(batch[name][position], alone[name]) for name in ("img1", "img2", "flow", "valid"))
    clips = ImageFolderVideoDataset(
        root=photos, num_samples=4, size=SIZE, seed=5, augmentor=ImagePairAugmentor(crop_size=[40, 56])
    )
    batch = next(iter(DataLoader(clips, batch_size=2, sampler=keys[:2])))
    assert batch["img1"].shape == (2, 3, 40, 56)
    for position, key in enumerate(keys[:2]):
        assert torch.equal(batch["img2"][position], clips[key]["img2"])
    seed5, seed0 = (ImageFolderFlowDataset(root=photos, num_samples=4, size=SIZE, seed=s) for s in (5, 0))
    assert not torch.equal(seed5[2]["img1"], seed0[2]["img1"])
    with pytest.raises(TypeError, match="augmentor must be ImagePairAugmentor or null, got FlowAugmentor"):
        ImageFolderVideoDataset(root=photos, num_samples=1, size=SIZE, augmentor=augmentor)


def test_clips_render_the_same_scenes(photos: Path) -> None:
    clips = ImageFolderVideoDataset(root=photos, num_samples=2, size=SIZE, seed=4, num_frames=4)
    pairs = ImageFolderFlowDataset(root=photos, num_samples=2, size=SIZE, seed=4)
    clip = clips.clip(1)
    assert clip.shape == (4, 3, *SIZE)
    assert torch.equal(clip[0], pairs[1]["img1"]) and torch.equal(clip[3], pairs[1]["img2"])
    assert not torch.equal(clip[1], clip[0]) and not torch.equal(clip[2], clip[3])
    assert torch.equal(clips[1]["img2"], clip[3])


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_zero_download_default_configs_and_eval_set() -> None:
    """root null: scikit-image's bundled photographs (read from disk), train and val disjoint, real motion."""
    data = instantiate(_compose("data=image_folder").data)
    assert isinstance(data, FlowDataModule) and data.val_names == ["image_folder"]
    train, val = data.train_set.textures, data.val_sets["image_folder"].dataset.textures
    assert {p.name for p in train.files} | {p.name for p in val.files} == set(SKIMAGE_PHOTOS)
    assert not set(train.files) & set(val.files) and len(val.files) == 2
    batch = next(iter(data.val_dataloader()[0]))
    assert batch["img1"].shape == (4, 3, 64, 96) and batch["img1"].std() > 20
    assert data.train_set[0]["img1"].shape == (3, 64, 96)

    pretrain = instantiate(_compose("data=image_folder_video", "data.batch_size=2").data)
    assert isinstance(pretrain, PretrainDataModule) and pretrain.train_set[0]["img1"].shape == (3, 64, 96)

    eval_set = instantiate(_compose("task=eval", "eval=synthetic").eval.benchmarks.image_folder)
    assert eval_set.kind == "flow" and eval_set.dataset.textures.files == val.files
    flows = [eval_set[i]["flow"] for i in range(3)]
    assert flows[0].shape == (2, 256, 384)
    assert max(float(flow.norm(dim=0).max()) for flow in flows) > 40


def test_a_tiny_training_run_on_a_folder_of_pngs(photos: Path, tmp_path: Path) -> None:
    """`python run.py task=train backbone=tiny data=image_folder data.train.root=<folder> ...`, in this process."""
    cfg = compose_tiny_config(
        "task=train",
        "trainer=cpu",
        "data=image_folder",
        f"data.train.root={photos}",
        "data.train.size=[40,56]",
        "data.train.augmentor.crop_size=[32,48]",
        "data.train.num_samples=4",
        "data.val.image_folder.dataset.num_samples=2",
        "data.batch_size=2",
        "data.val_batch_size=2",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "model.train_iters=2",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'run'}",
    )
    _, trainer = fit(cfg)
    assert trainer.global_step == 2 and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert "val/image_folder/epe" in trainer.callback_metrics


def test_a_tiny_mcva_pretraining_run_on_clips_of_the_folder(photos: Path, tmp_path: Path) -> None:
    """`python run.py task=pretrain model=mcva data=image_folder_video data.train.root=<folder> ...`."""
    cfg = compose_tiny_config(
        "task=pretrain",
        "model=mcva",
        "trainer=cpu",
        "data=image_folder_video",
        f"data.train.root={photos}",
        "data.train.size=[72,96]",  # the photographs' size
        "data.train.augmentor.crop_size=[64,88]",  # MCVA masks patches of the 1/8 cost maps: not much smaller
        "data.train.num_samples=4",
        "data.batch_size=2",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "model.query_num=4",
        "model.log_images_every_n_steps=0",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'run'}",
    )
    _, trainer = fit(cfg)
    assert trainer.global_step == 2 and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_tiff_photographs_are_read_and_16_bit_ones_skipped(tmp_path: Path, caplog) -> None:
    """Photographs saved as TIFF (`.tif`, `.tiff`) are photographs of the folder, as `task=infer` reads TIFF
    frames; a 16-bit TIFF is skipped with the 16-bit PNGs' warning."""
    root = tmp_path / "photos"
    root.mkdir()
    for seed in range(4):
        assert cv2.imwrite(str(root / f"{seed}.tif"), _photo(seed))
    assert cv2.imwrite(str(root / "deep.tiff"), _photo(4).astype(np.uint16) * 257)
    with caplog.at_level(logging.WARNING):
        dataset = ImageFolderFlowDataset(root=root, num_samples=1, size=SIZE, val_fraction=0.25)
    assert {path.suffix for path in dataset.textures.files} == {".tif"}
    assert sum(int(line.split("skipped ")[1].split()[0]) for line in caplog.messages if "not 8-bit" in line) == 1

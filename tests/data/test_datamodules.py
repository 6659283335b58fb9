"""DataModules and every conf/data config, instantiated by Hydra on tiny real-format trees."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from flowformer.data.datamodules import FlowDataModule, PretrainDataModule
from flowformer.data.datasets import FlyingThings3D, MpiSintel, WeightedConcatDataset
from flowformer.data.io import write_kitti_flow
from flowformer.data.synthetic import SyntheticFlowDataset, SyntheticVideoDataset

from helpers.configs import CONF_DIR
from helpers.trainers import cpu_trainer
from helpers.trees import (
    chairs_tree,
    frames_folder,
    kitti_tree,
    sintel_tree,
    sparse_flow,
    things_tree,
    write_image,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("datasets")
    chairs_tree(root, [1, 1, 2])
    things_tree(root / "FlyingThings3D")
    sintel_tree(root / "Sintel")
    kitti_tree(root / "KITTI")
    for j in range(3):
        write_image(root / "HD1k/hd1k_input/image_2" / f"000000_{j:04d}.png", j)
        write_kitti_flow(root / "HD1k/hd1k_flow_gt/flow_occ" / f"000000_{j:04d}.png", *sparse_flow(j))
    for split in ("train_all_frames", "valid_all_frames", "test_all_frames"):
        frames_folder(root / "youtube-vos" / split / "JPEGImages" / "video", 13)
    frames_folder(root / "videos" / "clip", 12)
    return root


def _data(name: str, data_dir: Path, *overrides: str) -> L.LightningDataModule:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[f"data={name}", f"paths.data_dir={data_dir}", "data.num_workers=0", *overrides],
        )
    return instantiate(cfg.data)


@pytest.mark.parametrize(
    ("name", "val_names"),
    [
        ("chairs", ["chairs"]),
        ("things", ["sintel_clean", "sintel_final", "kitti"]),
        ("sintel", ["sintel_clean", "sintel_final"]),
        ("sintel_mix", ["sintel_clean", "sintel_final"]),
        ("kitti", ["kitti"]),
        ("hd1k", []),
        ("synthetic", ["synthetic"]),
    ],
)
def test_flow_configs_instantiate_with_stage_validation_sets(
    name: str, val_names: list[str], data_dir: Path
) -> None:
    datamodule = _data(name, data_dir)
    assert isinstance(datamodule, FlowDataModule)
    assert datamodule.val_names == val_names
    assert len(datamodule.val_dataloader()) == len(val_names)
    for loader in datamodule.val_dataloader():
        item = loader.dataset[0]
        assert item["img1"].shape[0] == 3 and item["flow"].shape[0] == 2


def test_stage_datasets_and_official_augmentation(data_dir: Path) -> None:
    chairs = _data("chairs", data_dir)
    assert len(chairs.train_set) == 2 and len(chairs.val_sets["chairs"]) == 1
    assert chairs.train_set.augmentor.crop_size == (368, 496) and chairs.batch_size == 8
    things = _data("things", data_dir)
    assert isinstance(things.train_set, FlyingThings3D)
    assert {s.meta["pass"] for s in things.train_set.samples} == {"clean", "final"}
    assert (things.train_set.augmentor.min_scale, things.train_set.augmentor.max_scale) == (-0.4, 0.8)
    kitti = _data("kitti", data_dir)
    assert kitti.train_set.augmentor.do_flip is False and kitti.train_set.augmentor.crop_size == (432, 960)


def test_sintel_mix_multipliers_and_one_crop_knob(data_dir: Path) -> None:
    mix = _data("sintel_mix", data_dir, "data.train.parts.0.dataset.augmentor.crop_size=[16,24]")
    train = mix.train_set
    assert isinstance(train, WeightedConcatDataset) and train.repeats == [100, 200, 5, 1]
    sintel, kitti, hd1k, things = train.datasets
    assert isinstance(sintel, MpiSintel) and len(sintel) == 6  # clean + final
    assert len(kitti) == 2 and len(hd1k) == 2 and len(things) == 8  # things: clean only
    assert len(train) == 100 * 6 + 200 * 2 + 5 * 2 + 8
    for dataset in train.datasets:
        assert dataset.augmentor.crop_size == (16, 24)
    for index in (0, 600, 1000, len(train) - 1):  # one item of every part
        item = train[index]
        assert item["img1"].shape == (3, 16, 24) and item["valid"].shape == (16, 24)


@pytest.mark.parametrize("name", ["youtube_vos", "video_folder", "synthetic_video"])
def test_pretraining_configs(name: str, data_dir: Path) -> None:
    crop = [] if name == "synthetic_video" else ["data.train.augmentor.crop_size=[32,40]"]  # the frames' 40x48
    datamodule = _data(name, data_dir, "data.batch_size=2", *crop)
    assert isinstance(datamodule, PretrainDataModule) and datamodule.val_names == []
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["img1"].shape[0] == 2 and set(batch) == {"img1", "img2", "meta"}


def test_missing_dataset_fails_at_instantiation_with_tree(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="FlyingChairs_release") as err:
        _data("chairs", tmp_path)
    assert "data=synthetic" in str(err.value)
    with pytest.raises(Exception, match="data=synthetic_video"):
        _data("youtube_vos", tmp_path)


class _Recorder(L.LightningModule):
    """Counts validation batches per dataloader index; trains one dummy parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, int] = {}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return (self.weight - batch["flow"].mean()) ** 2

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen[dataloader_idx] = self.seen.get(dataloader_idx, 0) + batch["img1"].shape[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(datamodule: L.LightningDataModule) -> _Recorder:
    model = _Recorder()
    trainer = cpu_trainer(max_steps=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=datamodule)
    return model


def test_flow_datamodule_order_batches_and_errors() -> None:
    train = SyntheticFlowDataset(num_samples=5, size=(16, 24), seed=0)
    val = {
        "second": SyntheticFlowDataset(num_samples=3, size=(16, 24), seed=1),
        "first": SyntheticFlowDataset(num_samples=2, size=(16, 24), seed=2),
    }
    datamodule = FlowDataModule(train=train, val=val, batch_size=2)
    assert datamodule.val_names == ["second", "first"]
    assert [len(loader.dataset) for loader in datamodule.val_dataloader()] == [3, 2]
    assert len(datamodule.train_dataloader()) == 2  # 5 items, drop_last
    model = _fit(datamodule)
    assert model.seen == {0: 3, 1: 2}
    _fit(FlowDataModule(train=train, val={}, batch_size=2))  # no validation set: nothing to run

    with pytest.raises(ValueError, match="no training dataset"):
        FlowDataModule(val=val).train_dataloader()
    with pytest.raises(ValueError, match="data.batch_size"):
        FlowDataModule(train=train, batch_size=8).train_dataloader()
    with pytest.raises(ValueError, match=r"^data.batch_size=0: expected a whole number >= 1$"):
        PretrainDataModule(train=SyntheticVideoDataset(num_samples=2, size=(16, 24)), batch_size=0)
    # named data.batch_size ("FlowDataModule (val): batch_size must be >= 1, got 0 (set data.batch_size)")
    with pytest.raises(ValueError, match=r"^data.val_batch_size=0: expected a whole number >= 1$"):
        FlowDataModule(train=train, val=val, batch_size=2, val_batch_size=0)


def test_a_validation_set_whose_config_names_no_class_is_refused_naming_it() -> None:
    """`+data.val.extra.dataset.num_samples=2` (or a debug preset's keys merged into another data config): Hydra
    leaves a node without `_target_` as its settings, which the loader failed to index with a traceback."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["data=synthetic", "+data.val.extra.dataset.num_samples=2"])
    with pytest.raises(InstantiationException) as refusal:  # Hydra's, around the module's ValueError
        instantiate(cfg.data, train=None)
    assert isinstance(refusal.value.__cause__, ValueError)
    assert str(refusal.value.__cause__) == (
        "FlowDataModule: validation set 'extra' is the settings {'dataset': {'num_samples': 2}}, not a dataset: "
        "data.val.extra names no class (_target_); give it a set of conf/eval/sets/, as a data config's defaults "
        "do (`/eval/sets@val.extra: <set>`), or remove it"
    )

"""The stage experiments compose to the official hyperparameters: configs/{default,things,sintel,kitti}.py of
FlowFormer and FlowFormer++ and the stages of their core/datasets.py fetch_dataloader; each states only what
differs from the defaults of its config groups."""

from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
from omegaconf import DictConfig, OmegaConf

from flowformer.data.io import write_flo, write_kitti_flow
from flowformer.lit.flow import FlowModule
from flowformer.tasks.batches import per_process_batch, set_per_process_batch

from helpers.compose import compose_run_config
from helpers.configs import CONF_DIR

# stage -> (data, lr, weight decay, steps, batch, {variant: gamma}, validation sets)
STAGES = {
    "chairs": ("chairs", 2.5e-4, 1e-4, 120_000, 8, {"flowformer": 0.8, "flowformer_pp": 0.8}, ["chairs"]),
    "things": (
        "things",
        1.25e-4,
        1e-4,
        120_000,
        6,
        {"flowformer": 0.8, "flowformer_pp": 0.8},
        ["sintel_clean", "sintel_final", "kitti"],
    ),
    "sintel": (
        "sintel_mix",
        1.25e-4,
        1e-5,
        120_000,
        6,
        {"flowformer": 0.85, "flowformer_pp": 0.75},
        ["sintel_clean", "sintel_final"],
    ),
    "kitti": ("kitti", 1.25e-4, 1e-5, 50_000, 6, {"flowformer": 0.85, "flowformer_pp": 0.85}, ["kitti"]),
}
# stage -> the previous stage's checkpoint file (FF restore_ckpt names, e.g. 'checkpoints/chairs.pth')
PREVIOUS = {"things": "chairs.pth", "sintel": "things.pth", "kitti": "sintel.pth"}


@pytest.mark.parametrize("variant", ["flowformer", "flowformer_pp"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_hyperparameters(stage: str, variant: str) -> None:
    data, lr, wd, steps, batch, gammas, val_sets = STAGES[stage]
    cfg = compose_run_config([f"experiment={stage}", f"backbone={variant}"])
    assert cfg.backbone.variant == variant
    assert cfg.hydra.runtime.choices["data"] == data
    assert cfg.model._target_ == "flowformer.lit.flow.FlowModule"
    assert cfg.model.optimizer.lr == pytest.approx(lr)
    assert cfg.model.optimizer.weight_decay == pytest.approx(wd)
    assert cfg.model.gamma == pytest.approx(gammas[variant])
    assert cfg.model.add_noise is (variant == "flowformer")  # FF always adds pixel noise, FF++ never
    scheduler = cfg.model.scheduler
    assert scheduler.total_steps is None and scheduler.pct_start == pytest.approx(0.05)  # OneCycle max+100
    assert cfg.model.train_iters == 12 and cfg.model.val_iters == 12
    assert cfg.model.max_flow == pytest.approx(400.0)
    assert cfg.trainer.max_steps == steps
    assert cfg.trainer.gradient_clip_val == pytest.approx(1.0)
    assert per_process_batch(cfg) == batch  # the global batch, all of it on one GPU
    assert list(cfg.data.val) == val_sets
    assert list(cfg.eval.sets) == val_sets
    assert cfg.name == stage
    init_from = cfg.model.init_from
    if stage == "chairs":
        # FF: ImageNet Twins only; FF++: its MCVA pretraining output (restore_ckpt of FF++ configs/default.py)
        assert (init_from is None) == (variant == "flowformer")
    else:
        assert init_from == f"/root/checkpoints/{variant}/{PREVIOUS[stage]}"
    override = compose_run_config(
        [f"experiment={stage}", f"backbone={variant}", "model.init_from=/ckpt/last.ckpt"]
    )
    assert override.model.init_from == "/ckpt/last.ckpt"


def test_stage_augmentation_matches_official() -> None:
    # (crop, min scale, max scale, flip) per stage, as the official fetch_dataloader
    chairs = compose_run_config(["experiment=chairs"]).data.train.augmentor
    assert (list(chairs.crop_size), chairs.min_scale, chairs.max_scale, chairs.do_flip) == (
        [368, 496],
        -0.1,
        1.0,
        True,
    )
    things = compose_run_config(["experiment=things"]).data.train
    assert list(things.passes) == ["clean", "final"]
    aug = things.augmentor
    assert (list(aug.crop_size), aug.min_scale, aug.max_scale, aug.do_flip) == ([432, 960], -0.4, 0.8, True)
    kitti = compose_run_config(["experiment=kitti"]).data.train.augmentor
    assert kitti._target_.endswith("SparseFlowAugmentor")
    assert (list(kitti.crop_size), kitti.min_scale, kitti.max_scale, kitti.do_flip) == (
        [432, 960],
        -0.2,
        0.4,
        False,
    )
    mix = compose_run_config(["experiment=sintel"]).data.train.parts
    # 100 x Sintel (clean and final share it), 200 x KITTI, 5 x HD1K, 1 x Things clean
    assert [part.repeat for part in mix] == [100, 200, 5, 1]
    scales = [(part.dataset.augmentor.min_scale, part.dataset.augmentor.max_scale) for part in mix]
    assert scales == [(-0.2, 0.6), (-0.3, 0.5), (-0.5, 0.2), (-0.2, 0.6)]
    assert list(mix[3].dataset.passes) == ["clean"]


def _write_image(path: Path, rng: np.random.Generator, size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def training_datamodule(cfg: DictConfig):
    """The DataModule a training run builds: the batch of each process set first, as fit does."""
    set_per_process_batch(cfg)
    return hydra.utils.instantiate(cfg.data)


def _sizes(datamodule) -> dict:
    return {
        "train": len(datamodule.train_set),
        "val": {name: len(dataset) for name, dataset in datamodule.val_sets.items()},
    }


def test_stage_datamodules_instantiate_on_tiny_trees(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    chairs = tmp_path / "FlyingChairs_release" / "data"
    for i in range(1, 4):
        _write_image(chairs / f"{i:05d}_img1.ppm", rng, (24, 32))
        _write_image(chairs / f"{i:05d}_img2.ppm", rng, (24, 32))
        write_flo(chairs / f"{i:05d}_flow.flo", rng.normal(size=(24, 32, 2)).astype(np.float32))
    (chairs / "chairs_split.txt").write_text("1\n2\n1\n")
    kitti = tmp_path / "KITTI" / "training"
    for i in range(2):
        _write_image(kitti / "image_2" / f"{i:06d}_10.png", rng, (20, 40))
        _write_image(kitti / "image_2" / f"{i:06d}_11.png", rng, (20, 40))
        write_kitti_flow(
            kitti / "flow_occ" / f"{i:06d}_10.png", rng.normal(size=(20, 40, 2)).astype(np.float32)
        )

    chairs_dm = training_datamodule(compose_run_config(["experiment=chairs", f"paths.data_dir={tmp_path}"]))
    assert _sizes(chairs_dm) == {"train": 2, "val": {"chairs": 1}}
    item = chairs_dm.val_sets["chairs"][0]
    assert item["img1"].shape == (3, 24, 32) and item["flow"].shape == (2, 24, 32)

    kitti_dm = training_datamodule(compose_run_config(["experiment=kitti", f"paths.data_dir={tmp_path}"]))
    assert _sizes(kitti_dm) == {"train": 2, "val": {"kitti": 2}}
    assert kitti_dm.batch_size == 6


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_model_instantiates(stage: str) -> None:
    """The stage's model config is a valid FlowModule (the tiny backbone stands in for the paper's)."""
    cfg = compose_run_config([f"experiment={stage}", "backbone=tiny", "model.init_from=null"])
    module = hydra.utils.instantiate(cfg.model)
    assert isinstance(module, FlowModule)
    assert module.hparams.gamma == pytest.approx(STAGES[stage][5][cfg.backbone.variant])
    assert module.hparams.optimizer["lr"] == pytest.approx(STAGES[stage][1])


def plain(value):
    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def stated_values(node: DictConfig, prefix: str):
    """(dotted key, value) of every value an experiment file writes out (interpolations are references)."""
    for key in node:
        path = f"{prefix}.{key}"
        if OmegaConf.is_interpolation(node, key):
            continue
        if isinstance(node[key], DictConfig):
            yield from stated_values(node[key], path)
        else:
            yield path, plain(node[key])


@pytest.mark.parametrize("experiment", [*STAGES, "mcva_pretrain"])
def test_stage_experiments_state_only_what_differs_from_the_defaults(experiment: str) -> None:
    groups = ("backbone", "model", "data", "trainer", "callbacks", "eval")
    choices = compose_run_config([f"experiment={experiment}"]).hydra.runtime.choices
    defaults = compose_run_config([f"{group}={choices[group]}" for group in groups])
    stated = OmegaConf.load(CONF_DIR / "experiment" / f"{experiment}.yaml")
    for group in groups:
        for key, value in stated_values(stated.get(group, DictConfig({})), group):
            assert plain(OmegaConf.select(defaults, key)) != value, f"{key}: {value} is the default"


def test_validation_takes_the_training_iterations_unless_set():
    assert compose_run_config(["experiment=things", "model.train_iters=5"]).model.val_iters == 5
    assert compose_run_config(["model.train_iters=5", "model.val_iters=7"]).model.val_iters == 7

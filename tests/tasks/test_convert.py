"""task=convert convert.to_official=true on a training run's Lightning `last.ckpt` (task=train's FlowModule,
task=pretrain's MCVAPretrainModule): in one step, the same official state dict as converting to our backbone file
first and then to the official layout, loading back into the network with the run's weights; an official .pth and
a checkpoint that does not store its architecture are refused with what to do instead."""

from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from flowformer.lit.flow import FlowModule
from flowformer.models import export_official, load_backbone_weights
from flowformer.models.encoders import TwinsEncoder
from flowformer.tasks import run_task

from helpers.configs import flow_settings
from helpers.run import fresh_checkout, run_py
from helpers.trainers import cpu_trainer

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def config(*overrides: str) -> DictConfig:
    """conf/config.yaml with the tiny backbone and `overrides`, as a task receives it."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=["backbone=tiny", *overrides])


def convert(src: Path, dst: Path, *overrides: str) -> None:
    """python run.py task=convert backbone=tiny convert.input=src convert.output=dst <overrides>, in process."""
    run_task(
        config(
            "task=convert",
            f"convert.input={src}",
            f"convert.output={dst}",
            f"paths.output_dir={dst.parent / ('run_' + dst.stem)}",
            *overrides,
        )
    )


def save_lightning_checkpoint(module: L.LightningModule, path: Path) -> Path:
    """The module's Lightning checkpoint, the whole training state as a run's checkpoints/last.ckpt holds it."""
    trainer = cpu_trainer()
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path, weights_only=False)
    return path


@pytest.fixture(params=["flow", "mcva"])
def run_checkpoint(request, tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """last.ckpt of model=flow (task=train) or model=mcva (task=pretrain) with the tiny backbone, and the
    backbone's weights in it."""
    torch.manual_seed(0)
    module = hydra.utils.instantiate(config(f"model={request.param}").model)
    path = save_lightning_checkpoint(module, tmp_path / "last.ckpt")
    return path, {k: v.detach().clone() for k, v in module.backbone.state_dict().items()}


def test_to_official_takes_a_lightning_checkpoint_in_one_step(run_checkpoint, tmp_path):
    last, weights = run_checkpoint
    convert(last, tmp_path / "one_step.pth", "convert.to_official=true")
    convert(last, tmp_path / "ours.ckpt")
    convert(tmp_path / "ours.ckpt", tmp_path / "two_steps.pth", "convert.to_official=true")
    one_step = torch.load(tmp_path / "one_step.pth", weights_only=True)
    two_steps = torch.load(tmp_path / "two_steps.pth", weights_only=True)
    assert list(one_step) == list(two_steps) == ["module." + k for k in weights]
    assert all(torch.equal(one_step[k], two_steps[k]) for k in two_steps)
    net = hydra.utils.instantiate(config().backbone)
    assert load_backbone_weights(net, tmp_path / "one_step.pth").source == "official"
    assert all(torch.equal(v, weights[k]) for k, v in net.state_dict().items())


def test_a_run_checkpoint_converted_with_another_backbone_names_its_kind_and_the_settings_that_build_it(tmp_path):
    """`python run.py task=convert convert.input=<tiny run>/last.ckpt convert.output=ours.ckpt` (the default
    backbone, the paper's FlowFormer): the error called the run's checkpoint an "official checkpoint" and said
    no more than to check backbone.variant; it now names the settings stored in it that differ."""
    torch.manual_seed(0)
    last = save_lightning_checkpoint(hydra.utils.instantiate(config("model=flow").model), tmp_path / "last.ckpt")
    result = run_py(
        "task=convert", f"convert.input={last}", f"convert.output={tmp_path / 'ours.ckpt'}",
        cwd=fresh_checkout(tmp_path / "checkout"), expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error (CheckpointMismatchError): lightning checkpoint {last} (variant='flowformer') does not match" in (
        result.stderr
    )
    assert 'backbone.image_encoder="cnn" (here "twins")' in result.stderr.splitlines()[-1]
    assert not (tmp_path / "ours.ckpt").exists()


def test_to_official_refuses_an_official_file(tmp_path, capsys):
    official = tmp_path / "official.pth"
    export_official(hydra.utils.instantiate(config().backbone), official)
    with pytest.raises(SystemExit) as exit_info:
        convert(official, tmp_path / "again.pth", "convert.to_official=true")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"{official} is already in the official layout" in err
    assert "load_official(path, variant=" in err and not (tmp_path / "again.pth").exists()


def test_to_official_names_a_lightning_checkpoint_without_its_backbone_config(tmp_path, capsys):
    module = FlowModule(backbone=hydra.utils.instantiate(config().backbone), **flow_settings())
    last = save_lightning_checkpoint(module, tmp_path / "last.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        convert(last, tmp_path / "official.pth", "convert.to_official=true")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"{last}: a Lightning checkpoint without `backbone` hyper-parameters" in err
    assert "convert.to_official=false" in err and not (tmp_path / "official.pth").exists()


def test_to_official_needs_no_imagenet_file_a_run_started_from(tmp_path):
    """A run's backbone config names the local ImageNet Twins file it started from (backbone.twins_weights, as in
    experiment=chairs); those weights are in last.ckpt, so the conversion works where that file is not."""
    twins = tmp_path / "twins_svt_large.pth"
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in TwinsEncoder().svt.state_dict().items()}
    torch.save({k: torch.randn(shape) for k, shape in shapes.items()}, twins)
    twins_run = (
        "backbone.image_encoder=twins",
        "backbone.feature_dim=256",
        "backbone.twins_widths=[128,256]",
        f"backbone.twins_weights={twins}",
    )
    module = hydra.utils.instantiate(config(*twins_run).model)
    last = save_lightning_checkpoint(module, tmp_path / "last.ckpt")
    twins.unlink()
    convert(last, tmp_path / "official.pth", "convert.to_official=true")
    official = torch.load(tmp_path / "official.pth", weights_only=True)
    weights = module.backbone.state_dict()
    assert list(official) == ["module." + k for k in weights]
    assert all(torch.equal(official["module." + k], v) for k, v in weights.items())

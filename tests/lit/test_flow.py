"""FlowModule in a real Lightning loop on the tiny backbone: metrics, exact resume, weights_only, NaN stop."""

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, default_collate

from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.eval.protocol import EvalSet
from flowformer.lit.base import NonFiniteLossError
from flowformer.lit.flow import FlowModule
from flowformer.metrics import NothingScoredError
from flowformer.models.checkpoint import LIGHTNING_PREFIX

from helpers.configs import backbone_config, flow_settings
from helpers.trainers import cpu_trainer

SIZE = (64, 96)


class FixedOrderData(L.LightningDataModule):
    """Two training pairs in a fixed order (so a resumed run sees the same batches) and one named val set."""

    @property
    def val_names(self) -> list[str]:
        return ["synthetic"]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SyntheticFlowDataset(num_samples=2, size=SIZE, seed=1), batch_size=1, shuffle=False)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(SyntheticFlowDataset(num_samples=1, size=(60, 90), seed=2), batch_size=1)]


def make_module(**overrides) -> FlowModule:
    return FlowModule(backbone=backbone_config(), **flow_settings(train_iters=2, val_iters=2, **overrides))


def make_trainer(tmp_path: Path, max_steps: int, callbacks=(), every_n: int = 2, logger=False) -> L.Trainer:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, every_n_train_steps=every_n)
    return cpu_trainer(
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=logger,
        enable_checkpointing=True,
        callbacks=[checkpoint, *callbacks],
        default_root_dir=tmp_path,
    )


class ImageLogger(CSVLogger):
    """A logger with wandb's `log_image`, recording what it was given."""

    def __init__(self, save_dir: Path) -> None:
        super().__init__(save_dir)
        self.images: dict[str, tuple] = {}

    def log_image(self, key: str, images: list, step: int) -> None:
        self.images[key] = (images[0].shape, images[0].dtype, step)


def test_fit_logs_named_val_metrics_panels_and_checkpoint_loads_weights_only(tmp_path):
    L.seed_everything(0)
    module = make_module(num_val_panels=1)
    logger = ImageLogger(tmp_path)
    trainer = make_trainer(tmp_path, max_steps=2, logger=logger)
    trainer.fit(module, datamodule=FixedOrderData())
    # image | ground truth | prediction | error, at the validation image size 60x90
    assert logger.images == {"val/synthetic/panel_0": ((60, 360, 3), np.uint8, 2)}
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/epe", "val/synthetic/epe", "val/synthetic/1px", "val/synthetic/f1_all"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2
    assert checkpoint["hyper_parameters"]["backbone"]["_target_"] == "flowformer.models.build_flowformer"
    assert all(key.startswith(LIGHTNING_PREFIX) for key in checkpoint["state_dict"])  # what init_from reads
    # OneCycle length is trainer.max_steps + 100, as the official training loops
    assert checkpoint["lr_schedulers"][0]["total_steps"] == 102
    restored = FlowModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in module.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)


def test_checkpoint_with_the_retired_decoder_iters_still_loads(tmp_path):
    module = make_module()
    old_backbone = {**module.hparams["backbone"], "decoder_iters": 12}  # as checkpoints saved before its removal
    hparams = {**module.hparams, "backbone": old_backbone}
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": L.__version__},
        tmp_path / "old.ckpt",
    )
    restored = FlowModule.load_from_checkpoint(tmp_path / "old.ckpt", weights_only=True)
    assert restored.backbone.config == module.backbone.config
    for key, value in module.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)


class StopAfter(L.Callback):
    """Stops training after `step` optimiser steps, like a killed job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_resume_continues_step_schedule_and_optimizer_exactly(tmp_path):
    L.seed_everything(0)
    straight = make_module()
    make_trainer(tmp_path / "a", max_steps=4).fit(straight, datamodule=FixedOrderData())

    L.seed_everything(0)
    first = make_module()  # the same 4-step run, interrupted after step 2
    make_trainer(tmp_path / "b", max_steps=4, callbacks=[StopAfter(2)]).fit(first, datamodule=FixedOrderData())
    assert first.trainer.global_step == 2
    resumed = make_module()
    trainer = make_trainer(tmp_path / "c", max_steps=4)
    trainer.fit(resumed, datamodule=FixedOrderData(), ckpt_path=tmp_path / "b" / "checkpoints" / "last.ckpt")

    assert trainer.global_step == 4
    ours, theirs = trainer.optimizers[0], straight.trainer.optimizers[0]
    assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"])
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    for key, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    some_param = next(p for p in resumed.parameters() if p.requires_grad)
    reference_param = next(p for p in straight.parameters() if p.requires_grad)
    torch.testing.assert_close(ours.state[some_param]["exp_avg"], theirs.state[reference_param]["exp_avg"])


class PoisonBatch(L.Callback):
    """Turns the images of the batch at global step 2 into NaN."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            batch["img1"].fill_(float("nan"))


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path):
    L.seed_everything(0)
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[PoisonBatch()], every_n=1)
    with pytest.raises(NonFiniteLossError, match="global step 2"):
        trainer.fit(make_module(), datamodule=FixedOrderData())
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


def test_pixel_noise_stays_in_range_and_changes_images():
    module = make_module(add_noise=True)
    torch.manual_seed(0)
    image = torch.full((1, 3, 8, 8), 128.0)
    noisy1, noisy2 = module._add_pixel_noise(image, image.clone())
    assert noisy1.min() >= 0 and noisy1.max() <= 255
    assert not torch.equal(noisy1, image) and not torch.equal(noisy1, noisy2)


def test_validation_scores_each_set_with_the_bundle_of_its_kind():
    """A set's kind, not its name, picks its metrics: val/<set>/epe of a kitti set is the per-image mean."""
    module = make_module()
    data = SyntheticFlowDataset(num_samples=1, size=SIZE, seed=3)
    module.set_validation_sets({"a": EvalSet(data, kind="kitti"), "kitti": EvalSet(data, kind="sintel"), "b": data})
    assert [module.val_protocols[name].kind for name in ("a", "kitti", "b")] == ["kitti", "sintel", "flow"]
    batch = default_collate([data[0]])
    module.validation_step(batch, batch_idx=0, dataloader_idx=0)
    module.validation_step(batch, batch_idx=0, dataloader_idx=1)
    assert set(module.val_metrics["a"].compute()) >= {"epe", "epe_pooled", "f1_all", "f1_all_per_image"}
    assert "epe_pooled" not in module.val_metrics["kitti"].compute()
    with pytest.raises(ValueError, match="model.val_iters"):
        module.set_validation_sets({"a": EvalSet(data, kind="kitti", iters=24)})


def test_a_validation_set_without_a_valid_pixel_is_an_error_naming_it():
    """Never val/<set>/epe 0 over nothing (the best checkpoint would follow it)."""
    module = make_module()
    data = SyntheticFlowDataset(num_samples=1, size=SIZE, seed=3)
    module.set_validation_sets({"sparse": EvalSet(data, kind="kitti")})
    batch = default_collate([data[0]])
    module.validation_step({**batch, "valid": torch.zeros_like(batch["valid"])}, batch_idx=0)
    with pytest.raises(NothingScoredError, match="validation set sparse: no pixel was scored"):
        module.on_validation_epoch_end()

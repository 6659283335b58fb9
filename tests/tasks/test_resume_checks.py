"""ckpt_path is checked against the run before any work: steps left to train, the length of the schedule it
resumes, the kind of module that saved it, the settings that differ from it, and another run's best
checkpoint (in-process runs of the tiny backbone: debug=tiny, a few steps)."""

import logging
from pathlib import Path

import hydra
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from flowformer.lit.checkpointing import best_checkpoint_callback, changed_settings, check_resume_checkpoint
from flowformer.lit.flow import FlowModule
from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.tasks.train import fit

from helpers.compose import compose_tiny_config
from helpers.configs import backbone_config, flow_settings, mcva_settings

FIRST_STEPS = 4  # debug=tiny: 4 batches an epoch, validation every 2


def tiny_run(run_dir: Path, *overrides: str):
    """task=train with debug=tiny in this process, its run directory `run_dir`; returns the trainer."""
    cfg = compose_tiny_config(
        "debug=tiny", f"paths.root_dir={run_dir.parent}", f"paths.output_dir={run_dir}", *overrides
    )
    return fit(cfg)[1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """last.ckpt of a tiny run trained to step 4 (its OneCycle schedule: total_steps 4 + 100)."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    tiny_run(run_dir, f"trainer.max_steps={FIRST_STEPS}")
    return run_dir / "checkpoints" / "last.ckpt"


def flow_module() -> FlowModule:
    return hydra.utils.instantiate(compose_tiny_config().model)


@pytest.mark.parametrize("max_steps", [2, FIRST_STEPS])
def test_a_resume_with_nothing_left_to_train_is_refused(finished_run, max_steps):
    with pytest.raises(ValueError, match=f"is at step 4 and trainer.max_steps={max_steps}: nothing is left"):
        check_resume_checkpoint(finished_run, flow_module(), max_steps)


def test_a_resume_past_the_end_of_its_schedule_is_refused(finished_run):
    total_steps = FIRST_STEPS + 100
    check_resume_checkpoint(finished_run, flow_module(), total_steps)  # up to the schedule's last step
    with pytest.raises(ValueError, match=f"total_steps={total_steps}, which a resumed run keeps"):
        check_resume_checkpoint(finished_run, flow_module(), total_steps + 1)


@pytest.mark.parametrize("saved_by", [FlowModule, MCVAPretrainModule])
def test_a_checkpoint_of_another_kind_of_module_names_both(tmp_path, saved_by):
    """MCVA pretraining and flow training share the backbone, so only the kind of module tells them apart
    (their optimisers hold different parameter groups)."""
    backbone = backbone_config(variant="flowformer_pp")  # the backbone both kinds can train
    flow = FlowModule(backbone=backbone, **flow_settings())
    mcva = MCVAPretrainModule(backbone=backbone, **mcva_settings())
    saver, resumer = (flow, mcva) if saved_by is FlowModule else (mcva, flow)
    path = tmp_path / "other.ckpt"
    checkpoint = {"state_dict": saver.state_dict(), "global_step": 1, "loops": {}, "optimizer_states": []}
    torch.save({**checkpoint, "hyper_parameters": dict(saver.hparams)}, path)
    expected = f"saved by {type(saver).__name__}, but this run trains {type(resumer).__name__}"
    with pytest.raises(ValueError, match=expected):
        check_resume_checkpoint(path, resumer, max_steps=2)
    check_resume_checkpoint(path, saver, max_steps=2)  # the kind that saved it resumes it


def test_settings_written_under_their_former_names_are_compared_by_their_setting_now():
    module = flow_module()
    saved = {name: value for name, value in module.hparams.items() if name not in ("optimizer", "scheduler")}
    former = {"lr": module.hparams.optimizer["lr"] * 2, "weight_decay": module.hparams.optimizer["weight_decay"]}
    changes = changed_settings({"hyper_parameters": {**saved, **former}}, module)
    assert changes == [f"model.optimizer.lr={module.hparams.optimizer['lr']!r} (checkpoint: {former['lr']!r})"]


def test_a_resume_warns_once_of_changed_settings_keeps_the_checkpoints_schedule_and_not_its_best(
    tmp_path, finished_run, caplog
):
    """Lightning restores the optimiser and schedule from the checkpoint (a changed lr or schedule length has
    no effect), and would restore the best checkpoint path of the directory the checkpoint was saved in."""
    checkpoint = torch.load(finished_run, weights_only=True)
    [saved_best] = [s for s in checkpoint["callbacks"].values() if "best_model_path" in s]
    assert Path(saved_best["best_model_path"]).is_file()
    restored = ModelCheckpoint(dirpath=tmp_path / "elsewhere")
    restored.load_state_dict(saved_best)
    assert restored.best_model_path == saved_best["best_model_path"]  # what Lightning does on its own

    with caplog.at_level(logging.WARNING):
        trainer = tiny_run(
            tmp_path / "resumed",
            f"ckpt_path={finished_run}",
            f"trainer.max_steps={FIRST_STEPS + 1}",  # one step, no validation: no new best checkpoint
            "model.optimizer.lr=1e-3",
            "seed=7",
        )
    warnings = [r.getMessage() for r in caplog.records if "differ from the checkpoint's" in r.getMessage()]
    assert len(warnings) == 1
    for change in ("model.optimizer.lr=0.001 (checkpoint: 0.00025)", "seed=7 (checkpoint: 1234)"):
        assert change in warnings[0]
    assert trainer.global_step == FIRST_STEPS + 1
    # the checkpoint's schedule: its length and peak, not this run's max_steps + 100 and lr
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == FIRST_STEPS + 100
    assert trainer.optimizers[0].param_groups[0]["max_lr"] == 2.5e-4
    assert best_checkpoint_callback(trainer).best_model_path == ""  # not the first run's best

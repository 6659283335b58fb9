"""run.py end to end in subprocesses (tiny backbone, small synthetic data, CPU): run records, checkpoints,
stage chaining, resume with its wandb run (offline), multirun sweeps and clean errors."""

import importlib
import json
import logging
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from omegaconf import OmegaConf

from flowformer.tasks import TASKS, run_task
from flowformer.tasks.run_setup import (
    build_callbacks,
    check_validation_monitor,
    monitored_settings,
    warn_random_twins,
)

from helpers.compose import compose_run_config
from helpers.configs import build_backbone
from helpers.run import fresh_checkout, run_py


def test_train_records_checkpoints_chaining_and_wandb_resume(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_py("debug=tiny", "logger=many", "name=pytest", f"hydra.run.dir={first}", "tags=[unit]")

    # the run record: resolved config, git SHA, package versions and the network's parameter counts
    info = json.loads((first / "run_info.json").read_text())
    assert len(info["git"]["sha"]) == 40 and torch.__version__.startswith(info["packages"]["torch"])
    net = build_backbone("tiny")
    parameters = info["parameters"]
    assert parameters["total"] == parameters["trainable"] == sum(p.numel() for p in net.parameters())
    assert set(parameters["by_part"]) == {"image_encoders", "cost_encoder", "decoder"}
    assert sum(parameters["by_part"].values()) == parameters["total"]
    assert f"parameters: {parameters['total'] / 1e6:.2f}M total" in (first / "run.log").read_text()
    assert "_target_: flowformer.models.build_flowformer" in (first / "config_resolved.yaml").read_text()
    assert (first / "csv" / "metrics.csv").is_file()

    # last + best checkpoints; plain hyperparameters, so weights_only loading works
    checkpoints = sorted(p.name for p in (first / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in checkpoints and any(name.startswith("best-") for name in checkpoints)
    last = torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2 and last["hyper_parameters"]["backbone"]["agt_depth"] == 1

    # the offline wandb run id is stored beside the checkpoints ...
    run_id = (first / "checkpoints" / "wandb_run_id.txt").read_text().strip()
    assert list((first / "wandb").glob(f"offline-run-*-{run_id}"))

    # ... and resuming from that checkpoint continues the step count and the same wandb run; the stage's
    # initialisation is not read again (the checkpoint holds the weights), so a moved init file does not matter
    resumed_run = run_py(
        "debug=tiny",
        "logger=wandb",
        f"hydra.run.dir={second}",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        f"model.init_from={tmp_path / 'moved_away.ckpt'}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        env={"WANDB_SILENT": "false"},  # wandb's own lines printed, as a user sees them
    )
    assert "wandb: Tracking run with wandb" in resumed_run.stderr
    assert "anonymous setting" not in resumed_run.stderr  # Lightning's unset anonymous=None is not passed on
    assert "model.init_from is not loaded" in (second / "run.log").read_text()
    resumed = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4
    assert (second / "checkpoints" / "wandb_run_id.txt").read_text().strip() == run_id
    assert list((second / "wandb").glob(f"offline-run-*-{run_id}"))

    # a finished stage initialises the next one through config ...
    third = tmp_path / "third"
    result = run_py("debug=tiny", f"hydra.run.dir={third}", f"model.init_from={first / 'checkpoints' / 'last.ckpt'}")
    assert "initialised the backbone from" in (third / "run.log").read_text()
    # ... and a checkpoint that does not fit the backbone is refused with the mismatching keys
    result = run_py(
        "debug=tiny",
        f"hydra.run.dir={tmp_path / 'fourth'}",
        f"model.init_from={first / 'checkpoints' / 'last.ckpt'}",
        "backbone.agt_depth=2",
        expect_ok=False,
    )
    assert result.returncode == 1
    assert "error (CheckpointMismatchError)" in result.stderr and "Traceback" not in result.stderr
    assert "layers.1" in result.stderr or "missing" in result.stderr.lower()


def test_multirun_sweep_gives_each_job_its_directory(tmp_path):
    run_py(
        "sweep=agt_depth",
        "debug=tiny",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "backbone.agt_depth=1,2",  # the command line narrows the sweep's grid
        f"hydra.sweep.dir={tmp_path}",
    )
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 2
    for depth, job in zip((1, 2), jobs, strict=True):
        assert job.startswith(f"{depth - 1}_backbone.agt_depth={depth},")  # <job number>_<overrides>
        assert (tmp_path / job / "checkpoints" / "last.ckpt").is_file()
        assert f"agt_depth: {depth}" in (tmp_path / job / "config_resolved.yaml").read_text()


def test_missing_dataset_root_is_one_clear_message(tmp_path):
    result = run_py(
        "data=chairs",
        "backbone=tiny",
        "trainer=cpu",
        f"paths.data_dir={tmp_path / 'nowhere'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        expect_ok=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert str(tmp_path / "nowhere") in result.stderr


@pytest.mark.parametrize("task", ["nonsense"])
def test_unknown_task_is_refused(task, tmp_path):
    result = run_py(f"task={task}", f"hydra.run.dir={tmp_path}", expect_ok=False)
    assert result.returncode != 0 and "task='nonsense' is unknown" in result.stderr


def test_help_lists_every_task_and_config_group_and_writes_nothing(tmp_path):
    """`python run.py --help`, from a fresh directory: each task of the dispatch with what it does, the config
    groups with their options, and how to see the whole config; no run directory is claimed."""
    checkout = fresh_checkout(tmp_path)
    before = set(checkout.iterdir())
    result = run_py("--help", cwd=checkout)
    lines = result.stdout.splitlines()
    for task in TASKS:
        assert any(line.split()[:1] == [task] and len(line.split()) > 2 for line in lines), task
    groups = {line.split(":")[0]: line.split(": ")[1].split(", ") for line in lines if ": " in line}
    assert "quickstart" in groups["experiment"] and "smoke" in groups["protocol"] and "tiny" in groups["backbone"]
    assert "--cfg job" in result.stdout and "powered by Hydra" not in result.stdout
    assert set(checkout.iterdir()) == before


def test_training_whose_console_is_no_terminal_logs_its_progress(tmp_path):
    """A run whose output goes to a file (a SLURM job's, a CI log), where the bar is not drawn: a line of its step,
    loss, rate and time left every callbacks.progress_log.every_s seconds, on the console and in run.log."""
    run_py("debug=tiny", "trainer.max_steps=3", "callbacks.progress_log.every_s=0", f"hydra.run.dir={tmp_path}")
    lines = [line for line in (tmp_path / "run.log").read_text().splitlines() if "flowformer.lit.progress" in line]
    steps = [line.split(" - ")[1].split(":")[0] for line in lines]
    assert steps == ["step 1/3 (33%)", "step 2/3 (67%)", "step 3/3 (100%)"]
    assert all(re.search(r": train/loss [\d.]+, [\d.]+ steps/s, \d+:\d\d:\d\d left$", line) for line in lines), lines


@pytest.mark.parametrize("bar", [True, False])
def test_progress_bar_switch_drops_the_rich_bar(bar):
    """trainer.enable_progress_bar=false alone works: Lightning refuses a RichProgressBar with the bar off."""
    cfg = compose_run_config([f"trainer.enable_progress_bar={bar}"])
    callbacks = build_callbacks(cfg)
    assert any(isinstance(c, RichProgressBar) for c in callbacks) == bar
    assert any(isinstance(c, ModelCheckpoint) for c in callbacks)
    L.Trainer(enable_progress_bar=bar, callbacks=callbacks, logger=False)  # refused before the fix


def test_the_training_progress_bar_redraws_ten_times_a_second():
    """The run's Rich bar as Lightning starts it: its display refreshed at most 10 times a second (Lightning's
    default, 100, wakes a thread every 10 ms that takes the interpreter from the training loop)."""
    [bar] = [c for c in build_callbacks(compose_run_config([])) if isinstance(c, RichProgressBar)]
    bar._init_progress(L.Trainer(callbacks=[bar], logger=False))
    try:
        assert bar.progress.live.refresh_per_second == 10
    finally:
        bar.progress.stop()


@pytest.mark.parametrize(
    ("limits", "descriptions"),
    [
        ({"max_steps": 5, "max_epochs": -1}, ["Step 3/5", "Step 5/5"]),
        ({"max_steps": -1, "max_epochs": 2}, ["Epoch 0/1", "Epoch 1/1"]),
    ],
    ids=["by steps", "by epochs"],
)
def test_the_training_bar_says_the_step_of_max_steps(limits, descriptions):
    """The run's bar in a step-based fit (trainer.max_epochs: -1): the optimizer step of max_steps, current at each
    batch, where Lightning's reads 'Epoch 1/-2'; with an epoch limit, Lightning's own."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    [bar] = [c for c in build_callbacks(compose_run_config([])) if isinstance(c, RichProgressBar)]
    seen = []

    class Described(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append(bar.progress.tasks[bar.train_progress_bar_id].description.strip())

    class ThreeBatches(BoringModel):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(3, 32), batch_size=1)

    trainer = L.Trainer(
        **limits, callbacks=[bar, Described()], logger=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(ThreeBatches())
    assert seen == descriptions


@pytest.mark.parametrize(
    ("validates", "line"),
    [
        (True, "val/synthetic/epe = 0.5"),
        (False, ("val/synthetic/epe: not measured: no validation ran in its 3 training steps "
                 "(trainer.val_check_interval=500)")),
    ],
    ids=["validated", "stopped before validating"],
)
def test_a_fit_ends_with_its_monitored_value_or_why_it_has_none(validates, line, caplog):
    """The last line of a fit: the monitored metric's value, or, where training stopped before its first
    validation, that no validation ran, with the steps taken and trainer.val_check_interval (not '= None')."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from flowformer.tasks.run_setup import PreparedRun
    from flowformer.tasks.train import monitored_value

    class Validated(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("val/synthetic/epe", 0.5)

    trainer = L.Trainer(
        max_steps=3, val_check_interval=3 if validates else 500, check_val_every_n_epoch=None, limit_val_batches=1,
        logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(Validated())
    with caplog.at_level(logging.INFO, logger="flowformer.tasks.train"):
        value = monitored_value(PreparedRun(trainer, "val/synthetic/epe"))
    assert value == (0.5 if validates else None)
    assert caplog.messages[-1] == line


def test_twins_from_random_weights_in_a_fresh_run_is_one_warning(caplog):
    cfg = compose_run_config(["experiment=chairs"])  # FlowFormer's stage 1: ImageNet Twins
    settings = {
        "imagenet": {},
        "from scratch": {"backbone.twins_weights": None},
        "initialised": {"backbone.twins_weights": None, "model.init_from": "/runs/mcva.ckpt"},
        "resumed": {"backbone.twins_weights": None, "ckpt_path": "/runs/last.ckpt"},
        "cnn": {"backbone.twins_weights": None, "backbone.image_encoder": "cnn"},
    }
    warnings = {}
    for name, changes in settings.items():
        changed = cfg.copy()
        for key, value in changes.items():
            OmegaConf.update(changed, key, value, force_add=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_random_twins(changed)
        warnings[name] = [record.getMessage() for record in caplog.records]
    (line,) = warnings.pop("from scratch")
    assert line.startswith("backbone.twins_weights is null and nothing initialises the network")
    assert "1.29" in line and "set backbone.twins_weights=imagenet" in line
    assert warnings == {name: [] for name in warnings}


def test_user_errors_are_reported_once_task_reports_module_is_imported(capsys):
    """flowformer.tasks.report (task=report) imported, as by run.py task=report or the test session, becomes the
    package's attribute `report`; run_task's error line does not go through that name."""
    importlib.import_module("flowformer.tasks.report")
    with pytest.raises(SystemExit) as exited:
        run_task(compose_run_config(["task=nonsense"]))
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith("error (ValueError): task='nonsense' is unknown")


def test_a_monitored_metric_is_one_a_validation_set_logs_whichever_setting_names_it():
    """`monitor`, or a callback's own monitor; the kitti set's keys are its bundle's (epe_pooled beside epe); a
    run without validation sets (MCVA pretraining) logs no val/ metric."""
    cfg = compose_run_config(["debug=tiny", "callbacks.model_checkpoint.monitor=val/kitti/epe_pooled"])
    cfg.monitor = "val/synthetic/epe"
    assert monitored_settings(cfg) == {
        "monitor": "val/synthetic/epe",
        "callbacks.model_checkpoint.monitor": "val/kitti/epe_pooled",
    }
    with pytest.raises(ValueError, match=re.escape(
        "callbacks.model_checkpoint.monitor=val/kitti/epe_pooled is not a metric this run logs: its validation "
        "sets log val/synthetic/{epe,1px,3px,5px,f1_all}; give one of them (monitor=null: val/synthetic/epe)"
    )):
        check_validation_monitor("val/kitti/epe_pooled", "callbacks.model_checkpoint.monitor", {"synthetic": None})
    with pytest.raises(ValueError, match=re.escape("monitor=val/synthetic/epe: this run has no validation set")):
        check_validation_monitor("val/synthetic/epe", "monitor", {})
    check_validation_monitor("val/synthetic/f1_all", "monitor", {"synthetic": None})

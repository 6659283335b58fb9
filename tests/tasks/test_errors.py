"""Errors through run.py: one line, printed once, naming the file; corrupt data read by DataLoader workers
too (training, evaluation and pretraining); FLOWFORMER_TRACEBACK=1 shows the traceback also for errors raised while Hydra builds objects; a run that
fails before it starts leaves no run directory behind."""

from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from flowformer.device_settings import NO_GPU_HERE
from flowformer.tasks import find_user_error, user_error_message

from helpers.run import fresh_checkout, run_py
from helpers.trees import H, W, frames_folder, kitti_tree, sintel_tree, things_tree

pytestmark = pytest.mark.slow

def corrupt_kitti_tree(root: Path) -> Path:
    """Two KITTI-2015 pairs whose flow PNGs are 8-bit RGB (a common download mistake)."""
    kitti_tree(root)
    for flow_path in (root / "training" / "flow_occ").glob("*.png"):
        cv2.imwrite(str(flow_path), np.zeros((H, W, 3), dtype=np.uint8))
    return root


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "FlowFileError" in line or line.startswith("error")]


@pytest.mark.parametrize("task", ["train", "eval"])
def test_corrupt_flow_read_by_workers_is_one_line_naming_the_file(tmp_path, task):
    corrupt_kitti_tree(tmp_path / "KITTI")
    common = ["backbone=tiny", f"paths.data_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"]
    if task == "train":
        overrides = [
            "data=kitti",
            "trainer=cpu",
            "data.num_workers=2",
            "data.batch_size=1",
            "data.train.augmentor=null",
            "trainer.max_steps=1",
            "model.train_iters=1",
        ]
    else:
        overrides = ["task=eval", "eval.sets=[kitti]", "eval.num_workers=2", "eval.device=cpu"]
    result = run_py(*common, *overrides, expect_ok=False)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    lines = error_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert "flow_occ/00000" in lines[0] and "expected a 3-channel 16-bit KITTI flow PNG" in lines[0]
    assert "Traceback" not in output and "DataLoader worker" not in output


def test_unreadable_pretraining_frames_read_by_workers_are_one_line_naming_a_file(tmp_path):
    clip = tmp_path / "videos" / "clip"
    clip.mkdir(parents=True)
    for i in range(4):
        (clip / f"{i:05d}.png").write_bytes(b"not a png")
    result = run_py(
        "task=pretrain",
        "model=mcva",
        "backbone=tiny",
        "trainer=cpu",
        "data=video_folder",
        f"data.train.root={tmp_path / 'videos'}",
        "data.train.frame_gap=1",
        "data.train.stride=1",
        "data.train.augmentor=null",
        "+data.train.max_skips=2",
        "data.num_workers=2",
        "data.batch_size=1",
        "trainer.max_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        expect_ok=False,
    )
    assert result.returncode == 1
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.startswith("error")]
    assert len(lines) == 1, output[-3000:]
    assert "clip/0000" in lines[0] and "consecutive pairs" in lines[0]
    assert "Traceback" not in output and "DataLoader worker" not in output


def test_missing_root_is_printed_once_and_leaves_no_run_directory(tmp_path):
    result = run_py(
        "data=kitti",
        "backbone=tiny",
        "trainer=cpu",
        f"paths.data_dir={tmp_path}",
        f"paths.log_dir={tmp_path / 'logs'}",
        expect_ok=False,
    )
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert output.count("the dataset root does not exist") == 1, output[-3000:]
    assert not list((tmp_path / "logs").rglob("run.log"))


def test_a_folder_of_photographs_too_small_is_one_line_naming_the_config_node_it_fails(tmp_path):
    """The dataset's constructor knows its class, not the setting: "lower the dataset's size" named neither
    data.val.image_folder.dataset nor its size. The node Hydra was building is added to the line."""
    checkout = fresh_checkout(tmp_path)
    photos = tmp_path / "photos"
    photos.mkdir()
    for index in range(3):
        cv2.imwrite(str(photos / f"{index}.png"), np.full((20, 30, 3), 40 * index, dtype=np.uint8))
    command = ("backbone=tiny", "data=image_folder", f"data.train.root={photos}", "trainer=cpu")
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith("error (ImageFolderError): ImageFolderFlowDataset: none of the 1 images of the val split")
    assert "smaller than the render size 64x96" in line
    assert line.endswith("(config: data.val.image_folder.dataset)")
    assert list((checkout / "logs").rglob("*")) == []


def test_hydra_names_the_node_whose_constructor_failed_and_a_message_naming_it_is_left_as_it_is():
    """user_error_message reads the node from the end of Hydra's InstantiationException (`full_key: ...`)."""
    dataset = {"_target_": "flowformer.data.synthetic.SyntheticFlowDataset", "num_samples": 2, "size": [3, 3]}
    config = OmegaConf.create({"data": {"val": {"synthetic": {"dataset": dataset}}}})
    with pytest.raises(InstantiationException) as caught:
        hydra.utils.instantiate(config.data)
    error = find_user_error(caught.value)
    assert isinstance(error, ValueError) and "size must be (H, W)" in str(error)
    assert user_error_message(error, caught.value) == f"{error} (config: data.val.synthetic.dataset)"
    assert user_error_message(error, error) == str(error)  # not raised by a constructor Hydra called
    named = ValueError("data.val.synthetic.dataset.size: expected (H, W)")
    named.__cause__ = None
    wrapper = InstantiationException("Error in call to target 'x':\nValueError()\nfull_key: data.val.synthetic.dataset")
    wrapper.__cause__ = named
    assert user_error_message(named, wrapper) == str(named)


@pytest.mark.parametrize(
    ("command", "setting"),
    [
        (["debug=tiny", "~model.gamma"], "model.gamma"),  # FlowModule's TypeError for its missing argument
        (["task=pipeline", "protocol=smoke", "~pipeline.evaluate"], "pipeline.evaluate"),  # omegaconf's: not in struct
        (["debug=tiny", "~paths.data_dir"], "paths.data_dir"),  # omegaconf's missing `${paths.data_dir}`: a ValueError
    ],
    ids=["a constructor's argument", "a key the task reads", "a key another setting refers to"],
)
def test_a_setting_the_command_deletes_and_the_run_needs_is_one_line_naming_it(tmp_path, command, setting):
    """`~<key>` deletes a setting (Hydra's syntax): one the run needs was a traceback from wherever it was read."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    expected = f"{setting} is needed by this run, but the command deletes it (~{setting}); give it a value instead"
    assert error_lines(result.stderr) == [f"error (ValueError): {expected}"]
    assert list((checkout / "logs").rglob("*")) == []


def test_a_stage_without_the_checkpoint_it_starts_from_is_one_line_naming_model_init_from(tmp_path):
    """experiment=things starts from the released chairs.pth's path by default; without it the line said
    "checkpoint .../chairs.pth does not exist; check the path", naming no setting and not what to give."""
    checkout = fresh_checkout(tmp_path / "checkout")
    things_tree(tmp_path / "data" / "FlyingThings3D")
    sintel_tree(tmp_path / "data" / "Sintel")  # its validation sets
    kitti_tree(tmp_path / "data" / "KITTI")
    command = ("experiment=things", "backbone=tiny", "trainer=cpu", f"paths.data_dir={tmp_path / 'data'}")
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        (
            f"error (FileNotFoundError): model.init_from: checkpoint {checkout}/checkpoints/flowformer_pp/chairs.pth "
            "does not exist; give the weights to start from: the previous stage's, "
            "model.init_from=<its run>/checkpoints/last.ckpt, or the released checkpoint at that path"
        )
    ]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("command", "precision"),
    [(["debug=tiny"], "bf16-true"), (["task=pipeline", "protocol=smoke"], "64-true")],
    ids=["a training run", "a pipeline, before its first stage"],
)
def test_a_precision_the_network_cannot_train_at_is_one_line_before_training(tmp_path, command, precision):
    """Lightning's bf16-true / 16-true / 64-true cast every weight, but the cost volume stays fp32: the first
    training step failed with a traceback from the cost encoder's convolution (a pipeline's, in its first stage)."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, f"trainer.precision={precision}", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith(
        f"error (ValueError): trainer.precision={precision}: the network trains at 32-true, bf16-mixed or 16-mixed"
    )
    assert not list((checkout / "logs").rglob("*.ckpt")) and not list((checkout / "logs").rglob("stage_*"))


def test_an_empty_dict_for_a_setting_that_holds_entries_is_refused_as_changing_nothing(tmp_path):
    """`pipeline.evaluate={}` reads as "no evaluations", but Hydra merges it into the protocol's: the pipeline
    trained and evaluated as without it."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=pipeline", "protocol=smoke", "pipeline.evaluate={}", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        (
            "error (ValueError): pipeline.evaluate={} changes nothing: Hydra merges it into pipeline.evaluate, "
            "which keeps its entries (plain, tiled); to remove them give pipeline.evaluate=null where "
            "pipeline.evaluate may be null, or ~pipeline.evaluate.<entry> for each"
        )
    ]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["~paths.log_dir"], "hydra.run.dir is built from paths.log_dir, which the command deletes (~paths.log_dir)"),
        (["~paths.root_dir"], "hydra.run.dir is built from paths.root_dir, which the command deletes (~paths.root_dir)"),
        (["paths.log_dir=null"], "hydra.run.dir is built from paths.log_dir, which is null"),
        (["-m", "~paths.log_dir", "seed=1,2"], "hydra.sweep.dir is built from paths.log_dir, which the command deletes (~paths.log_dir)"),
    ],
    ids=["deleted", "deleted, two references down", "null", "a sweep's"],
)
def test_a_run_directory_built_from_a_deleted_or_null_setting_is_one_line_naming_it(tmp_path, command, line):
    """A deleted one was a traceback from inside Hydra (its callback's error is a warning, then its own
    resolution fails); a null one made the run's folder under a directory named "None"."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, "debug=tiny", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    setting = line.split(" is built from ")[1].split(",")[0]
    assert result.stderr.strip().splitlines()[-1] == f"error: {line}; give {setting} a value"
    assert not (checkout / "None").exists() and list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("command", "setting"),
    [
        (["task=infer", "infer.checkpoint=nope.ckpt", "infer.input=frames"], "infer.checkpoint"),
        (["task=eval", "eval=synthetic", "eval.checkpoint=nope.ckpt"], "eval.checkpoint"),
        (["experiment=quickstart", "task=train", "ckpt_path=nope.ckpt"], "ckpt_path"),
        (["task=convert", "convert.input=nope.ckpt", "convert.output=ours.ckpt"], "convert.input"),
    ],
)
def test_a_missing_checkpoint_is_one_line_naming_its_setting_before_the_network_is_built(tmp_path, command, setting):
    """The line said "checkpoint nope.ckpt does not exist; check the path", naming no setting, and infer and eval
    built the network (its parameter counts logged) before looking for the file."""
    checkout = fresh_checkout(tmp_path / "checkout")
    frames_folder(checkout / "frames", count=2)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        f"error (FileNotFoundError): {setting}: checkpoint nope.ckpt does not exist; check the path"
    ]
    assert "parameters:" not in result.stderr
    assert not (checkout / "ours.ckpt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU answers")
@pytest.mark.parametrize(
    ("command", "line"),
    [
        (
            ["debug=tiny", "trainer=gpu"],
            (
                f"trainer.accelerator=gpu (trainer=gpu and trainer=ddp) asks for a GPU, but {NO_GPU_HERE}; train on "
                "the CPU with trainer=cpu"
            ),
        ),
        (["task=bench", "bench=gpu"], f"bench.device=cuda asks for CUDA, but {NO_GPU_HERE}; use bench.device=cpu"),
    ],
    ids=["trainer=gpu", "make bench-gpu"],
)
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line_naming_the_setting(tmp_path, command, line):
    """The README's `trainer=gpu` and `make bench-gpu`'s command, run from a fresh checkout where torch sees no
    GPU: one line naming the setting and what to set instead, no traceback, no run directory left."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    lines = error_lines(result.stderr)
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error (ValueError): {line}") and "torch sees no GPU here (no NVIDIA" in line
    assert "Traceback" not in result.stderr
    assert not list((checkout / "logs").rglob("*.log"))


@pytest.mark.parametrize(
    ("command", "setting"),
    [
        (["task=infer", "infer.checkpoint=things.pth"], "infer.input"),
        (["task=convert", "convert.input=things.pth"], "convert.output"),
    ],
)
def test_a_setting_left_to_the_command_line_and_not_given_is_one_line_naming_it(tmp_path, command, setting):
    """The README's task=infer and task=convert without a setting their configs leave to the command line (`???`):
    one line naming it, no traceback, no run directory left."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        f"error (ValueError): {setting} is not set, and has no default: add {setting}=<value> to the command"
    ]
    assert "Traceback" not in result.stderr
    assert not list((checkout / "logs").rglob("*.log"))


def test_a_setting_lightning_refuses_is_one_line_naming_it(tmp_path):
    """A trainer.* value Lightning calls misconfigured: before, Hydra's "Error in call to target
    'lightning.pytorch.Trainer'" lines, with the run directory left behind. Now one line with the settings the
    command gave and the reason, no run directory (`instantiate_setting`, which builds the loggers and callbacks
    too)."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("debug=tiny", "trainer.devices=0", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith(
        "error (ValueError): the trainer.* settings are refused by lightning.pytorch.Trainer (the command sets "
        "trainer.devices=0): MisconfigurationException: `Trainer(devices=0)` value is not a valid input"
    )
    assert "Error in call to target" not in result.stderr
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            ["trainer.max_epochs=abc", "trainer.log_every_n_steps=abc", "trainer.benchmark=maybe"],
            (
                "trainer.max_epochs='abc' (lightning.pytorch.Trainer takes a whole number or null); "
                "trainer.log_every_n_steps='abc' (lightning.pytorch.Trainer takes a whole number or null); "
                "trainer.benchmark='maybe' (lightning.pytorch.Trainer takes true or false or null): "
                "set them to such a value"
            ),
        ),
        (
            ["task=eval", "eval=synthetic", "eval.tile=maybe", "eval.num_workers=abc"],
            ("eval.tile='maybe' (takes true or false, as its shipped value false); eval.num_workers='abc' (takes a "
            "number, as its shipped value 0): set them to such a value"),
        ),
        (
            ["model.gamma=abc"],
            "model.gamma='abc' (flowformer.lit.flow.FlowModule takes a number): set it to such a value",
        ),
        (
            ["model.optimizer.lr=abc"],
            "model.optimizer.lr='abc' (torch.optim.AdamW takes a number): set it to such a value",
        ),
        (
            ["callbacks.last_checkpoint.every_n_train_steps=abc"],
            (
                "callbacks.last_checkpoint.every_n_train_steps='abc' (flowformer.lit.checkpointing.LastCheckpoint "
                "takes a whole number): set it to such a value"
            ),
        ),
    ],
)
def test_a_word_given_for_a_number_is_one_line_naming_each_such_setting(tmp_path, settings, expected):
    """Before, `trainer.max_epochs=abc` failed inside fit with a bare AssertionError, `log_every_n_steps=abc` and
    `benchmark=maybe` with tracebacks (a comparison of str and int; cudnn's "expects a bool"), the run directory
    left behind, and so did `model.gamma=abc` and `eval.num_workers=abc`; `every_n_train_steps=abc` named no
    setting; `eval.tile=maybe` evaluated tiled (Python reads any word as true); `model.optimizer.lr=abc` named
    the optimiser but not the setting ("'<=' not supported between instances of 'float' and 'str'"). Each value
    is now checked against the type its class annotates (`check_setting_types`; the optimiser's as the module
    builds it), or, in a node built from no class, against the kind of its shipped value
    (`check_against_shipped`), and no run directory is left."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("debug=tiny", *settings, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [f"error (ValueError): {expected}"]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    "setting", ["data._target_=flowformer.data.SyntheticData", "model.scheduler._target_=torch.optim.lr_scheduler.OneCycle"]
)
def test_a_target_that_names_no_class_is_one_line_naming_the_setting(tmp_path, setting):
    """A misspelt class (SyntheticFlowDataModule, OneCycleLR) was Hydra's logged error and a traceback."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("debug=tiny", setting, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "Error getting class" not in result.stderr  # Hydra's own log of the same error
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error (ValueError): {setting} is not a class that can be imported")
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("command", "data"),
    [(["debug=tiny", "data=image_folder"], "image_folder"), (["experiment=mcva_pretrain", "debug=tiny"], "youtube_vos")],
)
def test_the_tiny_debug_preset_on_other_data_is_one_line_naming_debug_fdr(tmp_path, command, data):
    """debug=tiny sets data=synthetic's own keys: with data=image_folder its validation set had no dataset class
    and the loader failed with a traceback; with experiment=mcva_pretrain YouTubeVOS refused num_samples, a key
    the command never gave."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    expected = (
        f"error (ValueError): debug=tiny is a smoke run on data=synthetic (conf/debug/tiny.yaml sets its sizes), and "
        f"this run's data is data={data} (chosen by the command or its experiment): for a smoke run on data={data} "
        "use debug=fdr (one training and one validation batch), or leave out debug=tiny and shorten the run "
        "(trainer.max_steps=2 backbone=tiny)"
    )
    assert error_lines(result.stderr) == [expected]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["task=infer", "backbone=tiny", "infer.checkpoint=x.ckpt", "infer.input=[a.png,b.png]", "infer.iters=0"],
            "infer.iters=0: the decoder iterations must be >= 1",
        ),
        (["task=bench", "backbone=tiny", "bench.iters=0"], "bench.iters=0: expected a whole number >= 1"),
        (  # torch's "num_workers option should be non-negative", naming no setting
            ["task=eval", "eval=synthetic", "backbone=tiny", "eval.checkpoint=x.ckpt", "eval.num_workers=-1"],
            "eval.num_workers=-1: expected auto or a whole number >= 0",
        ),
        (["task=bench", "bench=data", "data=synthetic", "bench.repeats=0"], "bench.repeats=0: expected a whole number >= 1"),
        (["experiment=quickstart", "quickstart.finetune_steps=0"], "quickstart.finetune_steps=0: expected a whole number >= 1"),
        (["debug=tiny", "trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0: expected a whole number >= 1"),
        (
            ["debug=tiny", "trainer.check_val_every_n_epoch=0"],
            (
                "trainer.check_val_every_n_epoch=0: expected a whole number of epochs >= 1, or null (validation every "
                "trainer.val_check_interval steps alone)"
            ),
        ),
        (
            ["experiment=quickstart", "quickstart.max_epe_ratio=-1"],
            "quickstart.max_epe_ratio=-1: expected a fraction of the zero-flow EPE > 0 (0.5: the demo passes at half of it)",
        ),
    ],
)
def test_a_count_below_its_least_is_one_line_before_any_work(tmp_path, command, expected):
    """infer.iters=0 failed in the network's forward naming no setting; bench.iters=0 and bench.repeats=0 failed
    in every row (a ZeroDivisionError for repeats), and bench=data's repeats=0 with a traceback. The demo with
    quickstart.finetune_steps=0 pretrained, then failed naming trainer.val_check_interval=0; with a ratio below
    zero it trained for minutes to a verdict that could never pass. Lightning takes trainer.accumulate_grad_batches=0
    and divides by it at the first step, trainer.check_val_every_n_epoch=0 as the first epoch ends (each a
    ZeroDivisionError traceback)."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(*command, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [f"error (ValueError): {expected}"]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize("pad_mode", ["null", "sintell"])
def test_an_unknown_infer_padding_is_one_line_before_any_work(tmp_path, pad_mode):
    """`infer.pad_mode=null` failed at the first pair, the network built and the output folder made;
    `sintell` was refused naming no setting ("padding mode 'sintell' is unknown")."""
    checkout = fresh_checkout(tmp_path)
    command = ["task=infer", "backbone=tiny", "infer.checkpoint=x.ckpt", "infer.input=[a.png,b.png]"]
    result = run_py(*command, f"infer.pad_mode={pad_mode}", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    value = None if pad_mode == "null" else pad_mode
    expected = (
        f"error (ValueError): infer.pad_mode={value!r} is unknown; expected one of ['default', 'downzero', "
        "'kitti376', 'kitti400', 'kitti432', 'sintel']"
    )
    assert error_lines(result.stderr) == [expected]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        # Lightning clips nothing below 0; torch's clip_grad_norm_, which clips a fused optimiser under
        # bf16-mixed, turned every gradient around with it (the step ascended the loss)
        (
            "trainer.gradient_clip_val=-1",
            "trainer.gradient_clip_val=-1: expected a gradient norm > 0 (official: 1.0), or 0 or null for no clipping",
        ),
        # a TypeError traceback ('<=' between str and int): Lightning 2.6 takes a string, an interval of time
        ("trainer.val_check_interval=abc", "trainer.val_check_interval"),
    ],
)
def test_trainer_values_it_cannot_train_with_are_one_line_before_any_work(tmp_path, setting, expected):
    checkout = fresh_checkout(tmp_path)
    result = run_py("debug=tiny", setting, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith("error (ValueError): ") and expected in line, line
    assert list((checkout / "logs").rglob("*")) == []


def test_a_monitored_metric_no_validation_set_logs_is_one_line_before_training(tmp_path):
    """Lightning's checkpoint callback refused it at the first validation, after the training before it (hours
    for experiment=chairs), with a MisconfigurationException traceback."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("debug=tiny", "monitor=val/sintel/epe", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        (
            "error (ValueError): monitor=val/sintel/epe is not a metric this run logs: its validation sets log "
            "val/synthetic/{epe,1px,3px,5px,f1_all}; give one of them (monitor=null: val/synthetic/epe)"
        )
    ]
    assert "Training" not in result.stdout + result.stderr and list((checkout / "logs").rglob("*")) == []


def test_a_run_refused_in_its_first_step_leaves_no_run_directory(tmp_path):
    """The network refuses a crop size that is not a multiple of 8 as the first step starts; by then the
    learning rate of step 0 is in metrics.csv, which is no result."""
    logs = tmp_path / "logs"
    result = run_py("debug=tiny", "data.train.size=[60,90]", "trainer.max_steps=1", f"paths.log_dir={logs}",
                    expect_ok=False)
    assert result.returncode == 1
    assert len(error_lines(result.stderr)) == 1 and "training pairs are 60x90, not a multiple of 8" in result.stderr
    assert "data.train.size" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(logs.rglob("*")) == []


def test_flowformer_traceback_shows_errors_raised_while_hydra_instantiates(tmp_path):
    result = run_py(
        "data=kitti",
        "backbone=tiny",
        "trainer=cpu",
        f"paths.data_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"FLOWFORMER_TRACEBACK": "1"},
        expect_ok=False,
    )
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "DatasetRootError" in result.stderr and "instantiate" in result.stderr  # the whole chain
    stderr = result.stderr
    assert stderr.count("error (DatasetRootError)") == 1
    assert stderr.index("Traceback") < stderr.index("error (DatasetRootError)")  # the message comes last

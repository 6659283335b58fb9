"""A full disk: every writer says one line naming the file and the OS error (exit 1), leaves no partial file and
keeps the earlier files whole (flowformer/models/output_files.py).

The disk is a real 30 MB tmpfs where this machine lets the tests mount one (root); elsewhere the `disk` fixture
warns that it simulates ENOSPC in the package's one low-level write (tests/helpers/faults.py: fill_disk).
"""

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from flowformer.data.io import read_flo
from flowformer.lit.metrics_csv import SafeCSVLogger
from flowformer.models import output_files, save_backbone
from flowformer.models.output_files import OutputWriteError, atomic_write
from flowformer.tasks import convert as convert_task
from flowformer.tasks import eval as eval_task
from flowformer.tasks import infer, run_dirs, run_task

from helpers.compose import compose_tiny_config as config
from helpers.configs import REPO_DIR
from helpers.faults import fill_disk
from helpers.run import run_py

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


@dataclass
class Disk:
    folder: Path
    way: str  # "tmpfs" or "simulated"
    monkeypatch: pytest.MonkeyPatch

    def fill(self) -> None:
        assert fill_disk(self.folder, lambda *patch: self.monkeypatch.setattr(*patch, raising=False)) == self.way

    def open(self, path: Path, mode: str):
        """A file of this disk opened as the package opens its outputs (the simulation's, where simulated)."""
        return getattr(output_files, "open", open)(path, mode)


@pytest.fixture
def disk(tmp_path, request, monkeypatch) -> Disk:
    """A folder on a 30 MB tmpfs (unmounted afterwards), or, where mounting is not permitted, a plain folder
    whose full disk is simulated (with a warning saying so)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mount = shutil.which("mount")
    mounted = mount is not None and subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(folder)], capture_output=True, check=False
    ).returncode == 0
    if mounted:
        request.addfinalizer(lambda: subprocess.run(["umount", str(folder)], check=True))
    else:
        warnings.warn("no tmpfs could be mounted (not root?): the full disk is simulated", stacklevel=1)
    way = "tmpfs" if mounted else "simulated"
    request.node.user_properties.append(("full disk", way))
    return Disk(folder, way, monkeypatch)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


def partial_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.name.endswith(".partial")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_backbone(path, hydra.utils.instantiate(config().backbone))
    return path


def test_torch_save_into_a_full_disk_raises_the_os_error_or_a_runtime_error_from_it(disk):
    """What atomic_write relies on: torch.save into a file object whose write fails raises that OSError, or a
    RuntimeError (its C++ writer's) raised while handling it."""
    disk.fill()
    file = disk.open(disk.folder / "x.pt", "wb")
    with pytest.raises((OSError, RuntimeError)) as raised:
        torch.save(torch.zeros(1 << 20), file)
    with contextlib.suppress(OSError):  # what is left in the buffer does not fit either
        file.close()
    error = raised.value
    assert (error if isinstance(error, OSError) else error.__context__).errno == errno.ENOSPC


def test_a_checkpoint_that_does_not_fit_is_one_line_and_the_previous_last_ckpt_stays(tmp_path, disk):
    checkpoints = disk.folder / "checkpoints"
    result = run_py(
        "debug=tiny",
        "trainer.max_steps=3",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        f"callbacks.last_checkpoint.dirpath={checkpoints}",
        f"logger.csv.save_dir={disk.folder}",  # its rows pending at the failure are a warning, not the error
        f"hydra.run.dir={tmp_path / 'run'}",
        "+callbacks.full_disk._target_=helpers.faults.FillDiskAtStep",
        f"+callbacks.full_disk.folder={disk.folder}",
        "+callbacks.full_disk.step=1",
        env={"PYTHONPATH": str(REPO_DIR / "tests")},
        expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = error_lines(result.stderr)
    assert f"cannot write {checkpoints / 'last.ckpt'} ({NO_SPACE}); the previous last.ckpt is intact" in line
    assert "the last metrics rows were not saved" in result.stdout + result.stderr
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 1
    assert partial_files(disk.folder) == []


def test_infer_outputs_that_do_not_fit_are_one_line_and_the_earlier_ones_stay(tmp_path, disk, checkpoint, capsys):
    frames = tmp_path / "frames"
    frames.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c"):
        cv2.imwrite(str(frames / f"{name}.png"), rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
    write_flo = infer.write_flo

    def write_flo_then_fill(path, flow):  # the disk fills after the first flow file
        write_flo(path, flow)
        disk.fill()

    disk.monkeypatch.setattr(infer, "write_flo", write_flo_then_fill)
    out = disk.folder / "flow"
    with pytest.raises(SystemExit) as exit_info:
        run_task(config("task=infer", f"infer.input={frames}", f"infer.checkpoint={checkpoint}",
                        f"infer.output_dir={out}", "infer.iters=1", "infer.device=cpu", "infer.save_video=false"))
    assert exit_info.value.code == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"cannot write {out / 'a_flow.png'} ({NO_SPACE}); no partial a_flow.png is left" in line
    assert sorted(p.name for p in out.iterdir()) == ["a.flo"]
    assert read_flo(out / "a.flo").shape == (40, 48, 2)


def test_a_convert_output_that_does_not_fit_is_one_line_and_no_partial_file(disk, checkpoint, capsys):
    convert = convert_task.convert

    def fill_then_convert(*args, **kwargs):  # the disk fills after the output folder was checked
        disk.fill()
        return convert(*args, **kwargs)

    disk.monkeypatch.setattr(convert_task, "convert", fill_then_convert)
    output = disk.folder / "official.pth"
    with pytest.raises(SystemExit) as exit_info:
        run_task(config("task=convert", f"convert.input={checkpoint}", f"convert.output={output}",
                        "convert.to_official=true"))
    assert exit_info.value.code == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"cannot write {output} ({NO_SPACE}); no partial official.pth is left" in line
    assert not output.exists() and partial_files(disk.folder) == []


def test_eval_results_that_do_not_fit_are_one_line_and_no_partial_file(tmp_path, disk, capsys):
    write_results = eval_task.write_results

    def fill_then_write(*args):  # the disk fills during the evaluation
        disk.fill()
        write_results(*args)

    disk.monkeypatch.setattr(eval_task, "write_results", fill_then_write)
    results = disk.folder / "results.json"
    with pytest.raises(SystemExit) as exit_info:
        run_task(config("task=eval", "eval=synthetic", f"eval.results_json={results}", "eval.max_samples=1",
                        "eval.benchmarks.synthetic.iters=1", f"paths.root_dir={tmp_path}",
                        f"paths.output_dir={tmp_path / 'out'}"))
    assert exit_info.value.code == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"cannot write {results} ({NO_SPACE}); no partial results.json is left" in line
    assert not results.exists() and partial_files(disk.folder) == []


def test_a_run_started_on_a_full_disk_is_one_line_and_leaves_no_run_directory(disk, monkeypatch, capsys):
    disk.fill()
    monkeypatch.setattr(run_dirs, "_claimed", {})
    runs = disk.folder / "logs" / "runs"
    run_dir = run_dirs.fresh_dir(str(runs))  # as conf/hydra/default.yaml names it: made empty
    with pytest.raises(SystemExit) as exit_info:  # Hydra calls it before writing .hydra/ and run.log
        run_dirs.RunDirGuard().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": run_dir}, "overrides": {"task": []}}}))
    assert exit_info.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"error: cannot write hydra.run.dir {run_dir}: {NO_SPACE}; choose another location"
    assert list(runs.iterdir()) == []


def test_metrics_rows_that_do_not_fit_are_one_error_and_the_earlier_rows_stay(disk, caplog):
    logger = SafeCSVLogger(disk.folder, name="csv", version="")
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.save()
    metrics = Path(logger.experiment.metrics_file_path)
    earlier = metrics.read_bytes()
    disk.fill()
    logger.log_metrics({"train/loss": 0.5, "val/epe": 2.0}, step=1)  # a new column: the whole file again
    with pytest.raises(OutputWriteError, match=f"cannot write {metrics} \\({NO_SPACE}\\); the previous"):
        logger.save()
    assert metrics.read_bytes() == earlier and partial_files(disk.folder) == []
    logger.log_metrics({"train/loss": 0.25}, step=2)
    with caplog.at_level(logging.WARNING):
        logger.finalize("failed")  # after another error: a warning, so that error is the one reported
    assert "the last metrics rows were not saved" in caplog.text
    assert metrics.read_bytes() == earlier


def test_a_run_log_on_a_full_disk_is_one_warning_not_a_traceback_per_line(disk, capsys):
    handler = run_dirs.RunLogHandler(disk.folder / "run.log")
    log = logging.getLogger("test_full_disk")
    log.addHandler(handler)
    try:
        disk.fill()
        handler.setStream(disk.open(handler.baseFilename, "a"))
        for _ in range(3):
            log.warning("%s", "x" * 5000)  # more than the page the file has begun
    finally:
        log.removeHandler(handler)
        handler.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: cannot write {disk.folder / 'run.log'} ({NO_SPACE})")


def test_atomic_write_removes_its_partial_file_on_ctrl_c(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"earlier")
    with pytest.raises(KeyboardInterrupt), atomic_write(target) as file:
        file.write(b"half")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"] and target.read_bytes() == b"earlier"

"""Preemption and signals: SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) stop training and pretraining after the step in progress with
last.ckpt at that step, one line in run.log and a non-zero status (DataLoader workers that get the signal too
included); a run stopped during a validation (or killed after last.ckpt at that step) resumes by running that
whole validation, then as the uninterrupted run; under SLURM (one task, and a DDP job step of two in srun's
environment), SIGUSR1 requeues the job once last.ckpt is written and the requeued job resumes from that
last.ckpt, continuing its metrics.csv; task=eval stops at once and task=infer after the pair in progress with
complete files and a playable flow.mp4; Ctrl-C during a checkpoint write leaves no temporary file."""

import contextlib
import csv
import gc
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import Dataset

from flowformer.data.datamodules import FlowDataModule
from flowformer.data.io import read_flo
from flowformer.data.sampling import item_index
from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.eval.protocol import Protocol
from flowformer.lit.checkpointing import LastCheckpoint, RandomStates, SafeCheckpointIO, validation_restart
from flowformer.lit.metrics_csv import SafeCSVLogger
from flowformer.models import save_backbone
from flowformer.stop_signals import STOP_SIGNALS, StoppedBySignal, stopping_at_once
from flowformer.tasks.eval import evaluate_set
from flowformer.tasks.preemption import Preemption

from helpers.configs import REPO_DIR, build_backbone
from helpers.faults import SignalAtStep
from helpers.protocols import checkout_with_protocol, record
from helpers.run import (
    free_port,
    fresh_checkout,
    run_job_step,
    run_py,
    start_run_py,
    stub_scontrol,
)
from helpers.trainers import LinearModule, cpu_trainer, linear_loader

ENV = {"PYTHONPATH": str(REPO_DIR / "tests")}
TRAIN = ("debug=tiny", "trainer.max_steps=8", "data.num_workers=2")
PRETRAIN = (
    "task=pretrain",
    "model=mcva",
    "data=synthetic_video",
    "backbone=tiny",
    "trainer=cpu",
    "data.train.num_samples=8",
    "data.batch_size=2",
    "data.num_workers=2",
    "model.query_num=2",
    "trainer.max_steps=8",
    "trainer.enable_progress_bar=false",
    "callbacks.progress_bar=null",
)


def signal_at(step: int, name: str, group: bool = False) -> list[str]:
    """The overrides of a helpers.faults.SignalAtStep callback."""
    return [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep",
        f"+callbacks.stop.step={step}",
        f"+callbacks.stop.signal_name={name}",
        f"+callbacks.stop.group={group}",
    ]


def saved_step(checkpoint: Path) -> int:
    return torch.load(checkpoint, weights_only=True)["global_step"]




@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_lightning_stops_after_the_step_a_signal_came_in(tmp_path, name):
    """What the stop builds on: Lightning notes SIGTERM (Preemption turns SIGUSR1 and SIGINT into it: Lightning
    alone ends a fit at once on Ctrl-C, unsaved), finishes the step, raises SIGTERMException out of fit, and puts
    the signal handlers back when the trainer tears down."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    preemption = Preemption()
    trainer = cpu_trainer(
        enable_checkpointing=True,
        max_steps=50,
        callbacks=[SignalAtStep(step=3, signal_name=name), preemption, LastCheckpoint(tmp_path, 100)],
        plugins=[SafeCheckpointIO()],
    )
    with pytest.raises(SIGTERMException):
        trainer.fit(LinearModule(), train_dataloaders=linear_loader())
    assert trainer.global_step == 4 and preemption.received == getattr(signal, name)
    assert saved_step(tmp_path / "last.ckpt") == 4  # only the stop wrote it (every 100 steps otherwise)
    assert {signum: signal.getsignal(signum) for signum in before} == before


@pytest.mark.parametrize(("task", "name"), [("train", "SIGTERM"), ("pretrain", "SIGUSR1"), ("train", "SIGINT")])
def test_a_signal_to_the_whole_job_saves_last_ckpt_at_that_step_and_fails(tmp_path, task, name):
    """As SLURM or a terminal does it (Ctrl-C: SIGINT, status 130): the signal reaches the DataLoader workers
    too."""
    overrides = TRAIN if task == "train" else PRETRAIN
    run_dir = tmp_path / "run"
    result = run_py(
        *overrides,
        f"hydra.run.dir={run_dir}",
        *signal_at(2, name, group=True),
        env=ENV,
        expect_ok=False,
        new_session=True,
        timeout=240,
    )
    assert result.returncode == 128 + getattr(signal, name), result.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert saved_step(last) == 3  # the signal came during step 3; the periodic save is every 500
    lines = [line for line in (run_dir / "run.log").read_text().splitlines() if "stopped by" in line]
    assert (
        len(lines) == 1
        and f"training stopped by {name} at step 3" in lines[0]
        and f"ckpt_path={last}" in lines[0]
    )
    assert "Traceback" not in result.stderr and "DataLoader worker" not in result.stderr
    assert not list(run_dir.rglob("*.partial"))


def test_ctrl_c_to_a_sweep_prints_a_resume_command_that_runs_as_typed(tmp_path):
    """`python run.py -m debug=tiny model.optimizer.lr=2e-4,1e-4 ...`, Ctrl-C during the first job's step 3: its
    line's command, typed in a shell as printed (the job's folder holds `=` and `,`), resumes it from that step.
    Before, the line printed the path unquoted and Hydra refused it ("mismatched input '='")."""
    checkout = fresh_checkout(tmp_path / "checkout")
    command = ("debug=tiny", "trainer.max_steps=5", "trainer.val_check_interval=5")
    stopped = run_py(
        "-m", *command, "model.optimizer.lr=2e-4,1e-4", *signal_at(2, "SIGINT", group=True), cwd=checkout, env=ENV,
        expect_ok=False, new_session=True, timeout=240,
    )
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signal.SIGINT, output[-3000:]
    [line] = [line for line in output.splitlines() if "training stopped by SIGINT at step 3" in line]
    typed = line.split("; resume with ")[1]
    assert "=" in typed.partition("=")[2] and "," in typed  # the job's folder: the case that needs quoting
    resumed = run_py(*command, "model.optimizer.lr=2e-4", *shlex.split(typed), cwd=checkout, expect_ok=False)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    [run_dir] = (checkout / "logs" / "train" / "default" / "runs").iterdir()
    assert saved_step(run_dir / "checkpoints" / "last.ckpt") == 5


def test_ctrl_c_to_a_ddp_run_stops_both_processes_after_one_step_with_last_ckpt(tmp_path):
    """Ctrl-C (SIGINT to every process, as a terminal sends it) during step 3 of a 2-process DDP run that
    Lightning launched (gloo, CPU): both processes stop after that step, last.ckpt holds it, status 130, no hang.
    Lightning 2.6's SIGTERM handler broadcast from inside the signal handler, which deadlocked such a run whose
    processes were in another collective (docs/reliability.md)."""
    run_dir = tmp_path / "run"
    ddp = ("trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.precision=32-true")
    result = run_py(
        *TRAIN, *ddp, "trainer.max_steps=50", f"hydra.run.dir={run_dir}", *signal_at(2, "SIGINT", group=True),
        env={**ENV, "OMP_NUM_THREADS": "1"}, expect_ok=False, new_session=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGINT, output[-3000:]
    assert saved_step(run_dir / "checkpoints" / "last.ckpt") == 3
    assert output.count("training stopped by SIGINT at step 3") == 2  # one line from each process


def test_ctrl_c_in_the_demos_finetuning_stops_its_pipeline_saved_and_says_how_to_continue(tmp_path):
    """`make demo`'s command in a fresh checkout, Ctrl-C (SIGINT to the whole job, as a terminal sends it) while
    its finetuning stage trains in the pipeline's process: status 130, the stage's last.ckpt at the step in
    progress, pipeline.json "stopped", and one line saying to continue the pipeline, not the stage's run."""
    checkout = fresh_checkout(tmp_path)
    process = start_run_py("experiment=quickstart", cwd=checkout, new_session=True)
    runs = checkout / "logs" / "quickstart" / "quickstart" / "runs"
    deadline = time.monotonic() + 300

    while not list(runs.glob("*/finetune/run_info.json")):  # written as the stage's trainer starts fitting
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the finetuning stage did not start: {process.communicate()[1][-3000:]}")
        time.sleep(0.5)
    time.sleep(8)  # inside its 1200 steps (3.5 a second here), its stop signals handled from its first
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, stderr[-3000:]
    [run_dir] = runs.iterdir()
    record = json.loads((run_dir / "pipeline.json").read_text())
    assert record["status"] == "stopped" and [stage["status"] for stage in record["stages"]] == ["done", "stopped"]
    assert 0 < saved_step(run_dir / "finetune" / "checkpoints" / "last.ckpt") < 1200
    lines = [line for line in (stdout + stderr).splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stdout[-3000:] + stderr[-3000:]
    assert lines[0].endswith(  # `make demo` runs `.venv/bin/python run.py experiment=quickstart`: the command to type
        "pipeline stage 2/2 finetune was stopped by SIGINT (its last.ckpt is kept); continue with "
        f"{sys.executable} run.py experiment=quickstart pipeline.resume={run_dir}"
    )


def test_a_stopped_demos_line_continues_it_in_its_own_run_directory(tmp_path):
    """The demo's command (shortened: 2 and 3 steps), Ctrl-C as its pretraining ends: it stops before its
    finetuning with a line giving the command to continue it: its own with pipeline.resume=<its run dir>. That
    command, run as typed in a shell, continues the demo there: the pretraining is kept, the finetuning starts
    from its checkpoint, and the verdict (metrics.json, the picture) is written there. Before, the quickstart
    ignored pipeline.resume: it ran both stages again in a new run directory."""
    ctrl_c = f"+callbacks.ctrl_c={{_target_:helpers.faults.CtrlCOnce,at:train_end,marker:'{tmp_path / 'pressed'}'}}"
    checkout = fresh_checkout(tmp_path / "checkout")
    command = ("experiment=quickstart", "quickstart.pretrain_steps=2", "quickstart.finetune_steps=3",
               "quickstart.max_epe_ratio=100", ctrl_c)
    stopped = run_py(*command, cwd=checkout, env=ENV, new_session=True, expect_ok=False)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signal.SIGINT, output[-4000:]
    runs = checkout / "logs" / "quickstart" / "quickstart" / "runs"
    [run_dir] = runs.iterdir()
    lines = [line for line in output.splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == 1 and "Traceback" not in output, output[-4000:]
    ending = f"the finished stages are kept in {run_dir} (pipeline.json); continue with "
    assert f"pipeline stopped by SIGINT before stage 2/2 finetune: {ending}" in lines[0]
    typed = lines[0].split(ending)[1]
    assert typed == f"{shlex.join([sys.executable, 'run.py', *command])} pipeline.resume={run_dir}"
    pretrained = record(run_dir)["stages"][0]["checkpoint"]

    finished = subprocess.run(  # the line's command, as a shell runs it
        shlex.split(typed), cwd=checkout, env={**os.environ, "WANDB_MODE": "offline", **ENV}, capture_output=True,
        text=True, timeout=600, check=False,
    )
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    assert "pipeline: stage 1/2 pretrain finished already" in finished.stdout + finished.stderr
    done = record(run_dir)
    assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done", "done"]
    assert done["stages"][0]["checkpoint"] == pretrained and done["stages"][1]["init_from"] == pretrained
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["pass"] is True and metrics["panel"] == str(run_dir / "heldout_pairs.png")
    assert (run_dir / "heldout_pairs.png").is_file()
    assert [folder for folder in runs.iterdir() if (folder / "metrics.json").exists()] == [run_dir]


@pytest.mark.parametrize("stage", ["chairs", "things"])
def test_ctrl_c_as_a_tables_stage_ends_stops_the_table_and_its_line_finishes_every_row(tmp_path, stage):
    """A two-row table in one process (`python run.py -m task=pipeline protocol=<its own>
    model.optimizer.lr=2e-4,1e-4`), Ctrl-C as a stage of the first row ends, after its last step: too late to
    stop that stage, which is kept done; the table stops before the row's next stage, or once the row is done
    when it was its last (status 130, one line, the second row not started). It ran to its end before: the
    stage's stop handler took the signal and nothing asked for it afterwards. The line's command, the table's
    with pipeline.resume=<sweep dir>, finishes the first row and runs the second, which the table had not
    started (refused before: its folder is missing)."""
    ctrl_c = f"+callbacks.ctrl_c={{_target_:helpers.faults.CtrlCOnce,at:train_end,marker:'{tmp_path / 'pressed'}'}}"
    stages = {"chairs": [], "things": []}
    stages[stage].append(ctrl_c)
    checkout = checkout_with_protocol(tmp_path, "stopped_table", evaluate=False, **stages)
    command = ("-m", "task=pipeline", "protocol=stopped_table", "model.optimizer.lr=2e-4,1e-4")
    stopped = run_py(*command, cwd=checkout, env=ENV, new_session=True, expect_ok=False, timeout=600)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signal.SIGINT, output[-4000:]
    [sweep] = (checkout / "logs" / "pipeline" / "stopped_table" / "multiruns").iterdir()
    first, second = sweep / "0_model.optimizer.lr=0.0002", sweep / "1_model.optimizer.lr=0.0001"
    assert not second.exists()
    if stage == "chairs":
        assert record(first)["status"] == "stopped"
        assert [entry["status"] for entry in record(first)["stages"]] == ["done", "pending"]
        ending = f"before stage 2/2 things: the finished stages are kept in {first} (pipeline.json); continue with"
    else:
        assert record(first)["status"] == "done"
        ending = f"as it finished: its record is {first / 'pipeline.json'}; continue the table with"
    lines = [line for line in output.splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == 1 and "Traceback" not in output, output[-4000:]
    assert lines[0].endswith(
        f"pipeline stopped by SIGINT {ending} the table's command and pipeline.resume={sweep}"
    )

    finished = run_py(*command, f"pipeline.resume={sweep}", cwd=checkout, env=ENV, timeout=600)
    assert "pipeline: stage 1/2 chairs finished already" in finished.stdout + finished.stderr
    for row in (first, second):
        assert record(row)["status"] == "done" and [s["status"] for s in record(row)["stages"]] == ["done", "done"]


def test_ctrl_c_while_a_pipelines_stage_starts_stops_it_after_its_first_step(tmp_path):
    """`python run.py task=pipeline protocol=<its own>`, Ctrl-C while its first stage's training starts, before
    training's stop handlers are in place (a GPU's start-up takes seconds): the stage stops after its first step
    with last.ckpt there (status 130, the pipeline's one line). Before, Python's KeyboardInterrupt ended the
    pipeline there, with Lightning's "Detected KeyboardInterrupt" and status 1."""
    ctrl_c = f"+callbacks.ctrl_c={{_target_:helpers.faults.CtrlCOnce,at:fit_start,marker:'{tmp_path / 'pressed'}'}}"
    checkout = checkout_with_protocol(tmp_path, "started", evaluate=False, chairs=["trainer.max_steps=4", ctrl_c])
    stopped = run_py("task=pipeline", "protocol=started", cwd=checkout, env=ENV, new_session=True, expect_ok=False)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signal.SIGINT, output[-4000:]
    [run_dir] = (checkout / "logs" / "pipeline" / "started" / "runs").iterdir()
    assert record(run_dir)["status"] == "stopped" and saved_step(run_dir / "chairs" / "checkpoints" / "last.ckpt") == 1
    lines = [line for line in output.splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == 1 and "Traceback" not in output, output[-4000:]
    assert lines[0].endswith(
        "pipeline stage 1/1 chairs was stopped by SIGINT (its last.ckpt is kept); continue with "
        f"{sys.executable} run.py task=pipeline protocol=started pipeline.resume={run_dir}"
    )


SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "1",
    "SLURM_NNODES": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def test_slurm_requeues_on_sigusr1_and_the_requeued_job_resumes_from_last_ckpt(tmp_path):
    """SIGUSR1 under SLURM (`#SBATCH --signal=SIGUSR1@90 --requeue`) during step 3: the run stops after that
    step with last.ckpt, then `scontrol requeue <job>` runs (no hpc_ckpt of Lightning's, written mid-step), and
    the SIGTERM of the requeue finds the run finished: status 138. The requeued job resumes from that last.ckpt."""
    first, requeued = tmp_path / "first", tmp_path / "requeued"
    stub = stub_scontrol(tmp_path / "bin", first)
    env = {**ENV, **SLURM_JOB, "PATH": f"{stub}:{os.environ['PATH']}"}
    command = (
        "debug=tiny",
        "trainer.max_steps=6",
        f"paths.log_dir={tmp_path / 'logs'}",
        *signal_at(2, "SIGUSR1"),
    )

    result = run_py(*command, f"hydra.run.dir={first}", env=env, expect_ok=False, new_session=True, timeout=240)
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    last = first / "checkpoints" / "last.ckpt"
    assert (stub / "calls").read_text() == f"requeue 4242\n{last}\n"  # after last.ckpt was written
    assert saved_step(last) == 3 and not list(first.glob("hpc_ckpt_*.ckpt"))
    log = (first / "run.log").read_text()
    assert log.count("SLURM job 4242 is requeued (scontrol requeue 4242)") == 1
    assert "training stopped by SIGUSR1 at step 3" in log

    # SLURM starts the same command again, with the same job id
    run_py(*command, f"hydra.run.dir={requeued}", env={**env, "SLURM_RESTART_COUNT": "1"}, timeout=240)
    resumed = f"requeued SLURM job 4242 (restart 1): resuming from ckpt_path={last}"
    assert resumed in (requeued / "run.log").read_text()
    with open(requeued / "csv" / "metrics.csv") as metrics:
        steps = {int(row["step"]) for row in csv.DictReader(metrics)}
    assert saved_step(requeued / "checkpoints" / "last.ckpt") == 6 and min(steps) >= 3, steps


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_a_ddp_job_step_under_srun_signalled_by_slurm_stops_with_last_ckpt(tmp_path, name):
    """The DDP command of docs/reliability.md's sbatch script as srun starts it on one node (two processes of
    the command, each with its task's SLURM variables, one process group; not a SLURM cluster; gloo on the
    CPU), the signal to every process (DataLoader workers too) during step 3, as SLURM sends its warning
    (SIGUSR1) or scancel and a time limit send SIGTERM: both stop after that step with last.ckpt, no hang, and
    on SIGUSR1 rank 0 alone runs `scontrol requeue` once last.ckpt holds that step. Lightning's own requeue
    handler saved a checkpoint (a collective) inside the signal handler, before last.ckpt; a SIGTERM that
    SLURM sent killed the DataLoader workers (torch's worker handler), and training failed unsaved. The
    requeued job step (the same command, SLURM_RESTART_COUNT=1) resumes from that last.ckpt in the same
    directory, and its metrics.csv holds every step once (Lightning's logger deleted the earlier rows)."""
    logs = tmp_path / "logs"
    stub = stub_scontrol(tmp_path / "bin", logs)
    command = (
        *TRAIN, "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.precision=32-true",
        "trainer.max_steps=6", f"paths.log_dir={logs}", *signal_at(2, name, group=True),
    )
    env = {**ENV, "OMP_NUM_THREADS": "1", "PATH": f"{stub}:{os.environ['PATH']}"}
    port = free_port()

    output = run_job_step(*command, port=port, env=env)
    status = 128 + getattr(signal, name)
    assert output.endswith(f"srun: task exit statuses {[status] * 2}\n"), output[-6000:]
    [last] = logs.rglob("last.ckpt")
    assert last.parent.parent.name == "slurm-4242.0" and saved_step(last) == 3
    requeued = (stub / "calls").read_text() if (stub / "calls").exists() else None
    assert requeued == (f"requeue 4242\n{last}\n" if name == "SIGUSR1" else None)
    assert output.count(f"training stopped by {name} at step 3") == 2  # one line from each process
    assert "Traceback" not in output
    if name == "SIGTERM":
        return

    output = run_job_step(*command, port=port, env=env, restarts=1)
    assert output.endswith("srun: task exit statuses [0, 0]\n"), output[-6000:]
    assert output.count(f"requeued SLURM job 4242 (restart 1): resuming from ckpt_path={last}") == 2
    assert saved_step(last) == 6
    with open(last.parent.parent / "csv" / "metrics.csv") as metrics:
        steps = [int(row["step"]) for row in csv.DictReader(metrics) if row["train/loss"]]
    assert steps == list(range(6)), steps


@pytest.mark.parametrize("scontrol", ["missing", "refusing"])
def test_sigusr1_under_slurm_that_cannot_requeue_saves_last_ckpt_and_fails_saying_why(tmp_path, scontrol):
    """In a container with SLURM's variables but no `scontrol` on PATH, or where `scontrol requeue` fails (a
    job submitted without --requeue), the job is not requeued: the warning signal still stops the run after
    the step in progress, with last.ckpt, status 138 and one line saying why."""
    bin_dir = tmp_path / "bin"  # the PATH of a container: a shell, no SLURM tools
    bin_dir.mkdir()
    (bin_dir / "sh").symlink_to(shutil.which("sh"))
    if scontrol == "refusing":
        (bin_dir / "scontrol").write_text('#!/bin/sh\necho "Requested operation is presently disabled" >&2\nexit 1\n')
        (bin_dir / "scontrol").chmod(0o755)
    env = {**ENV, **SLURM_JOB, "PATH": str(bin_dir)}
    run_dir = tmp_path / "run"
    command = ("debug=tiny", "trainer.max_steps=6", f"hydra.run.dir={run_dir}", *signal_at(2, "SIGUSR1"))
    result = run_py(*command, env=env, expect_ok=False, timeout=240)
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    assert saved_step(run_dir / "checkpoints" / "last.ckpt") == 3
    log = (run_dir / "run.log").read_text()
    why = {
        "missing": f"SIGUSR1: SLURM job 4242 cannot be requeued: scontrol is not on PATH ({bin_dir}); resubmit it",
        "refusing": "SIGUSR1: SLURM job 4242 could not be requeued: scontrol requeue 4242 ended with status 1 "
        "(Requested operation is presently disabled); resubmit it",
    }
    assert log.count(why[scontrol]) == 1
    assert "training stopped by SIGUSR1 at step 3" in log


@pytest.fixture
def frame_folder(tmp_path) -> Path:
    folder = tmp_path / "frames"
    folder.mkdir()
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (40, 200, 3), dtype=np.uint8)
    for i in range(60):
        cv2.imwrite(str(folder / f"f{i:03d}.png"), np.ascontiguousarray(base[:, i : i + 56]))
    return folder


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """The tiny network's random weights, in our backbone file."""
    path = tmp_path / "tiny.pt"
    save_backbone(path, build_backbone())
    return path


def test_sigterm_during_infer_leaves_complete_files_and_a_playable_video(tmp_path, frame_folder, checkpoint):
    out = tmp_path / "out"
    process = start_run_py(
        "task=infer",
        "backbone=tiny",
        f"infer.checkpoint={checkpoint}",
        f"infer.input={frame_folder}",
        f"infer.output_dir={out}",
        "infer.iters=2",
        "infer.device=cpu",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("*.flo")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]

    flows = sorted(out.glob("*.flo"))
    assert 0 < len(flows) < 59 and not list(out.glob(".*.partial"))
    assert all(read_flo(path).shape == (40, 56, 2) for path in flows)
    video = cv2.VideoCapture(str(out / "flow.mp4"))
    assert video.isOpened() and int(video.get(cv2.CAP_PROP_FRAME_COUNT)) == len(flows)
    ok, picture = video.read()
    assert ok and picture.shape == (40, 56, 3)
    video.release()
    log = (tmp_path / "run" / "run.log").read_text()
    assert f"task=infer stopped by SIGTERM after {len(flows)} of 59 pairs" in log


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_during_eval_ends_it_at_once_with_one_line_and_no_results_file(tmp_path, checkpoint, name):
    """task=eval on 100000 synthetic pairs loaded by 2 workers, Ctrl-C or scancel (SIGINT or SIGTERM to its
    process group, as a terminal or SLURM sends it) once it evaluates: status 130 or 143, no results file, one
    line saying so, no traceback (Python's KeyboardInterrupt; torch's "DataLoader worker is killed by signal",
    its workers' own SIGTERM handler ending them on a SIGTERM their parent did not send)."""
    run_dir = tmp_path / "run"
    process = start_run_py(
        "task=eval",
        "backbone=tiny",
        "eval=synthetic",
        f"eval.checkpoint={checkpoint}",
        "eval.benchmarks.synthetic.dataset.num_samples=100000",
        "eval.num_workers=2",
        f"hydra.run.dir={run_dir}",
        new_session=True,
    )
    deadline, log = time.monotonic() + 120, run_dir / "run.log"
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    while not log.is_file() or "evaluating synthetic" not in log.read_text() or len(children.read_text().split()) < 2:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the evaluation did not start its workers: {process.communicate()[1][-3000:]}")
        time.sleep(0.1)
    time.sleep(1)  # the loader's workers are started; it evaluates
    os.killpg(process.pid, getattr(signal, name))
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"task=eval did not stop: {process.communicate()[1][-3000:]}")
    assert process.returncode == 128 + getattr(signal, name), stderr[-3000:]
    assert "Traceback" not in stderr and not (run_dir / "eval_results.json").exists()
    lines = [line for line in log.read_text().splitlines() if "stopped by" in line]
    assert len(lines) == 1
    assert lines[0].endswith(f"task=eval stopped by {name}: {run_dir / 'eval_results.json'} is not written; run it again")


class ZeroFlow(torch.nn.Module):
    def forward(self, image1: torch.Tensor, image2: torch.Tensor, iters: int = 12) -> dict:
        flow = image1.new_zeros(image1.shape[0], 2, *image1.shape[2:])
        return {"flow": flow, "flow_low": flow[..., ::8, ::8]}


def test_ctrl_c_while_evals_loader_starts_its_workers_stops_once_it_has_them(tmp_path):
    """Ctrl-C in the moment task=eval's loader starts its 2 workers (SIGINT 0.5 ms after the first fork, handled
    wherever the main thread then is): the stop is raised once the loader's iterator is built, so its teardown
    ends both workers and prints nothing. Raised inside the iterator's constructor (5 of 6 runs before the fix),
    it left a half-built iterator whose __del__ failed ("Exception ignored in ...
    _MultiProcessingDataLoaderIter.__del__") before the run's line."""
    armed, unraisable = [True], []

    def ctrl_c_after_the_first_fork() -> None:  # Ctrl-C from outside: a handler run where the main thread is
        if armed:
            armed.clear()
            signal.setitimer(signal.ITIMER_REAL, 0.0005)

    os.register_at_fork(after_in_parent=ctrl_c_after_the_first_fork)  # disarmed after its one use
    alarm = signal.signal(signal.SIGALRM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(StoppedBySignal) as stop, stopping_at_once(lambda signum: f"stopped by {signum.name}"):
            evaluate_set(
                ZeroFlow(),
                SyntheticFlowDataset(num_samples=8, size=(32, 48), seed=0),
                Protocol(kind="flow", iters=1),
                name="synthetic",
                device=torch.device("cpu"),
                num_workers=2,
            )
        signum, message = stop.value.signum, stop.value.message
        del stop  # its traceback holds the loader's iterator, as the run's exit releases it
        gc.collect()
    finally:
        armed.clear()
        signal.signal(signal.SIGALRM, alarm)
        sys.unraisablehook = hook
    assert signum == signal.SIGINT and message == "stopped by SIGINT"
    assert [entry.exc_value for entry in unraisable] == []
    # both workers were started and ended: at the teardown, or on torch 2.6 a moment after it (within 0.1 s)
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("earlier", [True, False], ids=["earlier last.ckpt", "first write"])
def test_ctrl_c_during_a_checkpoint_write_leaves_no_temporary_file(tmp_path, monkeypatch, earlier):
    target = tmp_path / "last.ckpt"
    io = SafeCheckpointIO()
    if earlier:
        io.save_checkpoint({"global_step": 1}, target)
    real_save = torch.save

    def interrupted_save(obj, file):
        real_save(obj, file)  # some bytes are written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2, "weights": torch.zeros(1000)}, target)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["last.ckpt"] if earlier else [])
    if earlier:
        assert torch.load(target, weights_only=True) == {"global_step": 1}


# A stop during a validation, in this process: a linear layer fitted to 32 points in batches of 4 (8 steps an
# epoch) with noise drawn from the global torch stream, validated every 4 steps on 12 points (3 batches), so
# step 4 is validated mid-epoch and step 8 at an epoch's end; with the callbacks, CSV logger and resumable
# training data of a run of run.py.
STEPS, VALIDATION_INTERVAL, VALIDATION_BATCHES = 12, 4, 3


class NoisyLinear(LinearModule):
    """LinearModule whose training points get noise from the global torch stream, validated on its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.validated: list[tuple[int, int]] = []  # (global step, batch index) of each validation step

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0] + 0.1 * torch.randn_like(batch[0])).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.validated.append((self.global_step, batch_idx))
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())


class Points(Dataset):
    """`count` random 2-vectors, by plain index or by the training sampler's SampleKey."""

    def __init__(self, count: int, seed: int) -> None:
        self.points = torch.randn(count, 2, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, item):
        return (self.points[item_index(item)],)


class SignalInValidation(L.Callback):
    """SIGTERM to this process when batch `batch` of the validation after `step` optimiser steps starts."""

    def __init__(self, step: int, batch: int) -> None:
        self.step, self.batch = step, batch

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.step and batch_idx == self.batch:
            self.stop()

    def stop(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class CrashInValidation(SignalInValidation):
    """A crash instead of the signal: the run ends as by `kill -9`, without a save."""

    def stop(self) -> None:
        raise RuntimeError("crashed")


def fit_points(
    run_dir: Path,
    *callbacks: L.Callback,
    module: NoisyLinear | None = None,
    every_n: int = 100,
    ckpt_path: Path | None = None,
) -> NoisyLinear:
    """Trains (or resumes) to STEPS with `callbacks` added, last.ckpt every `every_n` steps; a stop signal
    ends it as it ends task=train (SIGTERMException once last.ckpt is written)."""
    L.seed_everything(0)  # the datamodule keys its draws by the seed, as conf/config.yaml's
    val = {"points": Points(12, seed=1)}
    data = FlowDataModule(train=Points(32, seed=0), val=val, batch_size=4, val_batch_size=4)
    module = module or NoisyLinear()
    trainer = cpu_trainer(
        enable_checkpointing=True,
        max_steps=STEPS,
        val_check_interval=VALIDATION_INTERVAL,
        log_every_n_steps=1,
        logger=SafeCSVLogger(run_dir, name="csv", version=""),
        callbacks=[
            LastCheckpoint(run_dir / "checkpoints", every_n), RandomStates(), Preemption(), *callbacks
        ],
        plugins=[SafeCheckpointIO()],
    )
    with contextlib.suppress(SIGTERMException):
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


def logged(run_dir: Path) -> list[tuple[int, str, str]]:
    """metrics.csv's rows as (step, train/loss, val/loss), in order."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return [(int(row["step"]), row["train/loss"], row["val/loss"]) for row in csv.DictReader(handle)]


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def points_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("points_uninterrupted")
    fit_points(run_dir)
    return run_dir


@pytest.mark.parametrize(
    ("stop", "every_n", "step"),
    [
        (SignalAtStep(step=7, signal_name="SIGTERM"), 100, 8),  # during step 8, which a validation follows
        (SignalInValidation(step=8, batch=0), 100, 8),  # during that validation's first batch
        (SignalInValidation(step=8, batch=VALIDATION_BATCHES - 1), 100, 8),  # its last: it ends, then stops
        (SignalInValidation(step=4, batch=1), 100, 4),  # a validation mid-epoch
        (CrashInValidation(step=8, batch=1), 4, 8),  # killed: last.ckpt is the periodic one of step 8
    ],
    ids=["step-before", "first-batch", "last-batch", "mid-epoch", "crash"],
)
def test_a_run_stopped_during_validation_resumes_as_the_uninterrupted_one(
    points_reference, tmp_path, stop, every_n, step
):
    """last.ckpt holds the step the validation followed; the resumed run runs that whole validation and goes
    on as the uninterrupted run: the same rows of metrics.csv at the same logged steps, bitwise the same
    weights. Resumed in the stopped run's own directory (a requeued SLURM job step's), metrics.csv then holds
    the uninterrupted run's rows: the earlier rows continued, those logged again replaced."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    with contextlib.suppress(RuntimeError):
        fit_points(first, stop, every_n=every_n)
    assert last_checkpoint(first)["global_step"] == step

    module = fit_points(resumed, ckpt_path=first / "checkpoints" / "last.ckpt")
    assert module.validated[:VALIDATION_BATCHES] == [(step, batch) for batch in range(VALIDATION_BATCHES)]
    # the validation after step N is logged at step N - 1 (Lightning's logged step advances after it)
    expected = [row for row in logged(points_reference) if row[0] >= step or (row[0] == step - 1 and row[2])]
    assert logged(resumed) == expected
    final, reference = last_checkpoint(resumed), last_checkpoint(points_reference)
    assert final["global_step"] == reference["global_step"] == STEPS
    assert all(torch.equal(final["state_dict"][key], value) for key, value in reference["state_dict"].items())

    if not isinstance(stop, CrashInValidation):  # a crash leaves the rows since the last flush unwritten
        fit_points(first, ckpt_path=first / "checkpoints" / "last.ckpt")
        assert logged(first) == logged(points_reference)


class SaveAt(L.Callback):
    """Saves `path` at the end of training step `step`; notes the fit loop's state when validation starts."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step
        self.at_validation_start: dict | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.step:
            self.at_validation_start = trainer.fit_loop.state_dict()


class SaveInsideValidation(NoisyLinear):
    """Saves `path` inside the first validation step after `step` optimiser steps."""

    def __init__(self, path: Path, step: int) -> None:
        super().__init__()
        self.path, self.step = path, step

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking and self.global_step == self.step and batch_idx == 0:
            self.trainer.save_checkpoint(self.path)
        return super().validation_step(batch, batch_idx)


def test_lightning_reruns_a_validation_saved_inside_its_first_batch_and_skips_one_saved_before_it(tmp_path):
    """What LastCheckpoint builds on (validation_restart): a checkpoint Lightning saves inside a validation's
    first step holds validation_restart(the fit loop's state as the validation started), and Lightning resumes
    it by running every batch of that validation, then logs the next training step at the step the
    uninterrupted run did; a checkpoint saved at the end of the training step before resumes without running
    that validation at all."""
    inside, before = tmp_path / "inside.ckpt", tmp_path / "before.ckpt"
    save_at = SaveAt(before, step=4)
    fit_points(tmp_path / "first", save_at, module=SaveInsideValidation(inside, step=4))
    saved = torch.load(inside, weights_only=True)["loops"]["fit_loop"]
    assert saved == validation_restart(save_at.at_validation_start)

    from_inside = fit_points(tmp_path / "from_inside", ckpt_path=inside)
    assert from_inside.validated[:4] == [(4, 0), (4, 1), (4, 2), (8, 0)]
    first_rows = logged(tmp_path / "from_inside")[:2]
    assert [(step, bool(val)) for step, _, val in first_rows] == [(3, True), (4, False)]  # validation, step 4
    from_before = fit_points(tmp_path / "from_before", ckpt_path=before)
    assert from_before.validated[0] == (8, 0)
    assert logged(tmp_path / "from_before")[0][:2] == logged(tmp_path / "from_inside")[1][:2]

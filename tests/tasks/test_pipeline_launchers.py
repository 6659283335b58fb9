"""task=pipeline under the launchers a single run works under (issue 34 item 3): Lightning's own DDP launcher
(`trainer=ddp`, whose new processes run the command line again), torchrun (a pipeline, a table, two nodes
simulated on this machine), srun's environment (not a SLURM cluster), and a table's rows as jobs of Hydra's
submitit launcher. One process owns the pipeline's folders and records; a stage killed mid-way resumes with
pipeline.resume; a table's failed row (refused, failing on every process or on one) leaves the processes in
step for the next; a table's pipeline.resume names its sweep directory; a pipeline under srun warned by SLURM
is requeued and its requeued job step finishes it. Two gloo processes on the CPU stand for two GPUs."""

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flowformer.tasks.sweeps import failed_jobs

from helpers.configs import REPO_DIR
from helpers.protocols import checkout_with_protocol, record
from helpers.run import free_port, fresh_checkout, run_job_step, run_py, srun_task, stub_scontrol

# DDP on the CPU (gloo), as tests/tasks/test_ddp.py runs it; helpers.faults importable in every process.
GLOO = ("trainer.accelerator=cpu", "trainer.precision=32-true", "data.batch_size=1")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_DIR / "tests")}


def test_a_table_under_lightning_ddp_runs_every_row_with_one_set_of_records(tmp_path):
    """`python run.py -m task=pipeline ... trainer=ddp trainer.devices=2`: the rank Lightning starts runs the
    stage, not the table again; every row is done once, nothing is set aside."""
    checkout = checkout_with_protocol(tmp_path, "ddp_table", things=[])
    result = run_py(
        "-m", "task=pipeline", "protocol=ddp_table", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4", cwd=checkout, env=ENV, timeout=900, expect_ok=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    [sweep] = (checkout / "logs" / "pipeline" / "ddp_table" / "multiruns").iterdir()
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir() and not path.name.startswith("."))
    rows = [[override for override in record(job)["row"] if override.startswith("model.optimizer.lr=")] for job in jobs]
    assert [float(row[0].split("=")[1]) for row in rows] == [2e-4, 1e-4]
    for job in jobs:
        done = record(job)
        assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
        assert sorted(path.name for path in job.iterdir() if path.is_dir() and path.name != ".hydra") == sorted(
            [Path(entry["dir"]).name for entry in [*done["stages"], *done["evaluations"]]]
        )
        assert torch.load(job / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert output.count("MEMBER: 2/2") == 2  # each row's stage trained on two processes



def ctrl_c_table(tmp_path: Path, protocol: str, sender: str) -> tuple[Path, tuple[str, ...]]:
    """A checkout with `protocol` (one 6-step DDP stage that sends SIGINT once during its step 3, as
    SignalAtStep's `sender`: `group` or `launcher`) and the command of its two-row table."""
    ctrl_c = [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep", "+callbacks.stop.step=2",
        "+callbacks.stop.signal_name=SIGINT", f"+callbacks.stop.{sender}=true",
        f"+callbacks.stop.marker={tmp_path / 'pressed'}",
    ]
    checkout = checkout_with_protocol(
        tmp_path, protocol, evaluate=False, things=["trainer.max_steps=6", "trainer.val_check_interval=6", *ctrl_c]
    )
    command = ("-m", "task=pipeline", f"protocol={protocol}", "trainer=ddp", "trainer.devices=2", *GLOO,
               "model.optimizer.lr=2e-4,1e-4")
    return checkout, command


def check_stopped_then_finished(checkout: Path, protocol: str, output: str, finish: Callable[..., object]) -> None:
    """The table of `ctrl_c_table` stopped in its first row's step 3: that row is recorded stopped with its
    last.ckpt at step 3, the second did not start, one line says to continue with the table's command and
    pipeline.resume=<sweep dir>; `finish(<that override>)`, the table's command with it, then finishes the first
    row from that last.ckpt (its stage's folder set aside) and runs the second."""
    sweep, [first] = sweep_jobs(checkout, protocol)
    assert record(first)["status"] == "stopped", output[-6000:]
    last = first / "things" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    line = (
        "pipeline stage 1/1 things was stopped by SIGINT (its last.ckpt is kept); continue with the table's command "
        f"and pipeline.resume={sweep}"
    )
    assert output.count(line) == 1, output[-6000:]

    finished = finish(f"pipeline.resume={sweep}")
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-6000:]
    [second] = sweep.glob("1_*")  # its folder, made by this run
    for row in (first, second):
        assert record(row)["status"] == "done", output[-6000:]
    interrupted = first / "things.interrupted" / "checkpoints" / "last.ckpt"
    assert record(first)["stages"][0]["resumed_from"] == [str(interrupted)]
    assert torch.load(interrupted, weights_only=True)["global_step"] == 3
    assert torch.load(last, weights_only=True)["global_step"] == 6


def test_ctrl_c_to_a_table_under_lightnings_launcher_stops_it_and_its_line_finishes_the_table(tmp_path):
    """`python run.py -m task=pipeline ... trainer=ddp trainer.devices=2` of two rows, Ctrl-C (SIGINT to the
    whole process group, as a terminal sends it: the table's process and both of the stage's) during step 3 of
    the first row's stage: both stop after that step with its last.ckpt, the row is recorded stopped, the second
    row does not start (status 130, one line from the table, no traceback), and that line's command (the table's
    with pipeline.resume=<sweep dir>) finishes the first row from that last.ckpt and runs the second."""
    checkout, command = ctrl_c_table(tmp_path, "ddp_table_ctrl_c", "group")
    stopped = run_py(*command, cwd=checkout, env=ENV, new_session=True, timeout=900, expect_ok=False)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signal.SIGINT and "Traceback" not in output, output[-6000:]
    check_stopped_then_finished(
        checkout, "ddp_table_ctrl_c", output,
        lambda resume: run_py(*command, resume, cwd=checkout, env=ENV, timeout=900, expect_ok=False),
    )


def test_a_stage_failing_on_one_process_under_lightnings_launcher_fails_its_row_with_that_error(tmp_path):
    """`python run.py -m task=pipeline ... trainer=ddp trainer.devices=2`, the process Lightning started (rank 1)
    out of memory during step 2 of the first row's stage: that row fails, its record naming rank 1's error
    beside how the stage's main process ended, and the next row trains on both processes."""
    checkout = checkout_with_protocol(tmp_path, "ddp_oom", evaluate=False, things=[out_of_memory_once(tmp_path)])
    result = run_py(
        "-m", "task=pipeline", "protocol=ddp_oom", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4", cwd=checkout, env=ENV, timeout=900, expect_ok=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert output.count("error: 1 job(s) of this sweep failed: #0") == 1
    _, (failed, trained) = sweep_jobs(checkout, "ddp_oom")
    error = record(failed)["stages"][0]["error"]
    assert error.endswith("; the first error of its processes: rank 1: OutOfMemoryError: CUDA out of memory on rank 1 (helpers.faults)")
    assert record(trained)["status"] == "done"
    assert torch.load(trained / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert output.count("MEMBER: 2/2") == 2  # both rows' stages started on two processes

def test_a_ddp_stage_killed_mid_way_resumes_with_pipeline_resume(tmp_path):
    """The whole job killed (SIGKILL to every process) during step 2 of its DDP stage, then the same command
    with pipeline.resume: the finished stage is kept, the killed one resumes from its last.ckpt to the end."""
    kill = f"+callbacks.kill={{_target_:helpers.faults.KillGroupOnceAtStep,step:1,marker:'{tmp_path / 'killed'}'}}"
    ddp = ["trainer=ddp", "trainer.devices=2", "trainer.max_steps=3", "callbacks.last_checkpoint.every_n_train_steps=1"]
    checkout = checkout_with_protocol(tmp_path, "ddp_killed", chairs=[], things=[*ddp, kill])
    command = ("task=pipeline", "protocol=ddp_killed", *GLOO)
    run_dir = tmp_path / "run"
    killed = run_py(
        *command, f"hydra.run.dir={run_dir}", cwd=checkout, env=ENV, new_session=True, timeout=900, expect_ok=False
    )
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-4000:]
    assert [stage["status"] for stage in record(run_dir)["stages"]] == ["done", "running"]

    resumed = run_py(
        *command, f"pipeline.resume={run_dir}", f"hydra.run.dir={tmp_path / 'resuming'}", cwd=checkout, env=ENV,
        timeout=900, expect_ok=False,
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "pipeline: stage 1/2 chairs finished already" in output
    done = record(run_dir)
    assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done", "done"]
    interrupted = run_dir / "things.interrupted" / "checkpoints" / "last.ckpt"
    assert done["stages"][1]["resumed_from"] == [str(interrupted)]
    assert torch.load(interrupted, weights_only=True)["global_step"] == 1
    assert torch.load(done["stages"][1]["checkpoint"], weights_only=True)["global_step"] == 3
    assert "MEMBER: 2/2" in output


def torchrun(checkout: Path, *args: str, rdzv_id: str | None = None, new_session: bool = False):
    """`torchrun --nproc-per-node=2 run.py <args>` on this machine (`--standalone`, or with `--rdzv-id`) in
    `checkout`, to its end."""
    rendezvous = ["--standalone"]
    if rdzv_id is not None:
        rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={rdzv_id}"]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node=2", "run.py", *args],
        cwd=checkout, env={**os.environ, "WANDB_MODE": "offline", **ENV}, capture_output=True, text=True, timeout=900,
        check=False, start_new_session=new_session,
    )


def test_a_pipeline_under_torchrun_is_owned_by_rank_0_and_trained_by_both(tmp_path):
    """`torchrun --nproc-per-node=2 run.py task=pipeline ...`: both processes train every stage in one process
    group; rank 0 alone moves, writes and evaluates (the others never touch the pipeline's folders)."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_table", chairs=[], things=[])
    result = torchrun(checkout, "task=pipeline", "protocol=torchrun_table", "trainer=ddp", "trainer.devices=2", *GLOO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    [run_dir] = (checkout / "logs" / "pipeline" / "torchrun_table" / "runs").iterdir()
    assert run_dir.name.startswith("torchrun-")  # the directory both processes share
    done = record(run_dir)
    assert done["status"] == "done" and done["metric"] is not None
    assert [entry["status"] for entry in [*done["stages"], *done["evaluations"]]] == ["done", "done", "done"]
    assert sorted(path.name for path in run_dir.iterdir() if path.is_dir()) == [".hydra", "chairs", "eval_plain", "things"]
    for stage in ("chairs", "things"):
        assert f"pipeline: rank 1 trains {run_dir / stage}" in output
    assert torch.load(run_dir / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_a_job_killed_mid_way_and_run_again_continues_its_pipeline(tmp_path):
    """Both processes killed (SIGKILL) during step 2 of the last stage (torchrun, seeing a worker die, ends the
    job), then the same command again, as a requeued SLURM job runs it: in the job's own run directory
    (`torchrun-<rdzv id>`, `slurm-<job>.<step>`) it continues the pipeline there. Rank 0 keeps the finished
    stage and both processes resume the killed one from its last.ckpt."""
    kill = f"+callbacks.kill={{_target_:helpers.faults.KillGroupOnceAtStep,step:1,marker:'{tmp_path / 'killed'}'}}"
    last_every_step = ["trainer.max_steps=3", "callbacks.last_checkpoint.every_n_train_steps=1", kill]
    checkout = checkout_with_protocol(tmp_path, "torchrun_killed", chairs=[], things=last_every_step)
    command = ("task=pipeline", "protocol=torchrun_killed", "trainer=ddp", "trainer.devices=2", *GLOO)
    killed = torchrun(checkout, *command, rdzv_id="job7", new_session=True)
    assert killed.returncode != 0, (killed.stdout + killed.stderr)[-4000:]
    run_dir = checkout / "logs" / "pipeline" / "torchrun_killed" / "runs" / "torchrun-job7"
    chairs, things = record(run_dir)["stages"]
    assert chairs["status"] == "done" and things["status"] != "done"

    again = torchrun(checkout, *command, rdzv_id="job7")
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert "pipeline: stage 1/2 chairs finished already" in output
    done = record(run_dir)
    assert done["status"] == "done" and done["stages"][1]["resumed_from"] == [
        str(run_dir / "things.interrupted" / "checkpoints" / "last.ckpt")
    ]
    assert f"pipeline: rank 1 trains {run_dir / 'things'}" in output
    assert torch.load(done["stages"][1]["checkpoint"], weights_only=True)["global_step"] == 3


def test_ctrl_c_to_a_pipeline_under_torchrun_stops_it_saved_and_its_line_continues_it(tmp_path):
    """Ctrl-C in torchrun's terminal (SIGINT to torchrun alone, which passes it on to its workers) during step 3
    of a pipeline's stage: both processes stop after that step with the stage's last.ckpt, the pipeline is
    recorded stopped, each process says so in one line (the one traceback is torchrun's, raised by the signal
    once its workers ended), and rank 0's line (`pipeline.resume=<run dir>`) continues it: the stage resumes
    from that last.ckpt and the pipeline is done."""
    ctrl_c = [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep", "+callbacks.stop.step=2",
        "+callbacks.stop.signal_name=SIGINT", "+callbacks.stop.launcher=true",
    ]
    checkout = checkout_with_protocol(
        tmp_path, "torchrun_ctrl_c", evaluate=False, things=["trainer.max_steps=6", "trainer.val_check_interval=6", *ctrl_c]
    )
    command = ("task=pipeline", "protocol=torchrun_ctrl_c", "trainer=ddp", "trainer.devices=2", *GLOO)
    stopped = torchrun(checkout, *command, new_session=True)
    output = stopped.stdout + stopped.stderr
    [run_dir] = (checkout / "logs" / "pipeline" / "torchrun_ctrl_c" / "runs").iterdir()
    last = run_dir / "things" / "checkpoints" / "last.ckpt"
    assert record(run_dir)["status"] == "stopped", output[-6000:]
    assert torch.load(last, weights_only=True)["global_step"] == 3
    line = f"pipeline stage 1/1 things was stopped by SIGINT (its last.ckpt is kept); continue with pipeline.resume={run_dir}"
    assert output.count(line) == 1
    assert output.count("Traceback") == output.count("SignalException: Process") == 1  # torchrun's own, at its end
    assert output.count("pipeline: rank 1 stopped by SIGINT with the stage's other processes") == 1

    again = torchrun(checkout, *command, f"pipeline.resume={run_dir}")
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-6000:]
    done = record(run_dir)
    assert done["status"] == "done" and torch.load(last, weights_only=True)["global_step"] == 6


@pytest.mark.skipif(shutil.which("srun") is not None, reason="what a machine without SLURM answers")
def test_a_table_sent_to_slurm_from_a_machine_without_it_is_one_line_before_any_folder(tmp_path):
    """docs/cluster.md's table command with `hydra/launcher=submitit_slurm`, typed on a workstation: submitit's
    traceback ('Could not detect "srun"') with the sweep directory left behind, before. Now one line saying
    where to run it and what runs the rows here, status 1, nothing written."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(
        "-m", "task=pipeline", "protocol=smoke", "sweep=paper_pe", "hydra/launcher=submitit_slurm",
        cwd=checkout, expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=submitit_slurm submits each job to SLURM, but SLURM's commands are not on this "
        "machine (no srun on PATH): run the command on the cluster's login node, or run the jobs here with "
        "hydra/launcher=submitit_local (or without a launcher setting, one after another)"
    )
    assert list((checkout / "logs").rglob("*")) == []


def test_a_table_through_hydras_submitit_launcher_runs_each_row_as_a_job(tmp_path):
    """`hydra/launcher=submitit_local` (the optional extra `.[slurm]`): each row a job of its own process, with
    DDP inside, every job in the sweep directory the command names."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason='pip install -e ".[slurm]"')
    checkout = checkout_with_protocol(tmp_path, "submitit_table", things=[])
    result = run_py(
        "-m", "task=pipeline", "protocol=submitit_table", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4", "hydra/launcher=submitit_local", cwd=checkout, env=ENV, timeout=900,
        expect_ok=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    [sweep] = (checkout / "logs" / "pipeline" / "submitit_table" / "multiruns").iterdir()
    assert (sweep / ".submitit").is_dir()  # the jobs' scripts and logs
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir() and not path.name.startswith("."))
    assert len(jobs) == 2
    for job in jobs:
        done = record(job)
        assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
        assert not [path for path in job.iterdir() if path.name.endswith(".interrupted")]
        assert torch.load(job / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_a_stage_of_a_submitit_table_killed_mid_way_resumes_with_pipeline_resume(tmp_path):
    """A table under `hydra/launcher=submitit_local`, one row's DDP stage killed (SIGKILL to its rank 0) during
    step 2: that row fails, the other finishes, the table ends with status 1. The table's command again with
    pipeline.resume=<sweep dir> keeps the finished row and resumes the killed stage from its last.ckpt."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason='pip install -e ".[slurm]"')
    kill = f"+callbacks.kill={{_target_:helpers.faults.KillRankZeroOnceAtStep,step:1,marker:'{tmp_path / 'killed'}'}}"
    last_every_step = ["callbacks.last_checkpoint.every_n_train_steps=1", kill]
    checkout = checkout_with_protocol(tmp_path, "submitit_killed", evaluate=False, things=last_every_step)
    command = (
        "-m", "task=pipeline", "protocol=submitit_killed", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4", "hydra/launcher=submitit_local",
    )
    killed = run_py(*command, cwd=checkout, env=ENV, timeout=900, expect_ok=False)
    output = killed.stdout + killed.stderr
    assert killed.returncode == 1, output[-4000:]
    sweep, jobs = sweep_jobs(checkout, "submitit_killed")
    statuses = {job: record(job)["stages"][0]["status"] for job in jobs}
    [stopped] = [job for job, status in statuses.items() if status == "failed"]
    [finished] = [job for job, status in statuses.items() if status == "done"]
    assert f"1 job(s) of this sweep failed: #{stopped.name.split('_')[0]}" in output
    assert "its training run killed by SIGKILL" in record(stopped)["stages"][0]["error"]
    [failure] = failed_jobs(sweep)  # where the table's last line points
    assert failure["error"].endswith(f"continue with the table's command and pipeline.resume={sweep}")

    resumed = run_py(*command, f"pipeline.resume={sweep}", cwd=checkout, env=ENV, timeout=900, expect_ok=False)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    for job in jobs:
        done = record(job)
        assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
        assert torch.load(done["stages"][0]["checkpoint"], weights_only=True)["global_step"] == 2
    assert record(finished)["stages"][0]["resumed_from"] == []
    [again] = [path for path in sweep.parent.iterdir() if path != sweep]
    # a job's Hydra console (Lightning's lines among them) is its _log.out, its warnings its _log.err
    job_logs = [
        err.with_name(err.name.replace("_log.err", "_log.out")).read_text() + err.read_text()
        for err in (again / ".submitit").glob("*/*_log.err")
    ]
    assert len(job_logs) == 2 and sum("MEMBER: 2/2" in text for text in job_logs) == 1  # the killed row alone trains
    interrupted = stopped / "things.interrupted" / "checkpoints" / "last.ckpt"
    assert record(stopped)["stages"][0]["resumed_from"] == [str(interrupted)]
    assert torch.load(interrupted, weights_only=True)["global_step"] == 1


def sweep_jobs(checkout: Path, name: str) -> tuple[Path, list[Path]]:
    """The one sweep directory of `name`'s multirun in `checkout` and its jobs' run directories."""
    [sweep] = (checkout / "logs" / "pipeline" / name / "multiruns").iterdir()
    return sweep, sorted(path for path in sweep.iterdir() if path.is_dir() and not path.name.startswith("."))


def test_a_table_under_torchrun_runs_each_row_once_in_one_sweep_directory(tmp_path):
    """`torchrun --standalone --nproc-per-node=2 run.py -m task=pipeline ...`: every process runs Hydra's
    multirun itself. They name one sweep directory after the torchrun job (not the start time, which may differ
    by a second between them) and each row's folder in it; both train each row's stage there, and rank 0
    alone writes each row's record."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_rows", evaluate=False, things=[])
    result = torchrun(
        checkout, "-m", "task=pipeline", "protocol=torchrun_rows", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    sweep, jobs = sweep_jobs(checkout, "torchrun_rows")
    assert sweep.name.startswith("torchrun-") and len(jobs) == 2
    for job, lr in zip(jobs, ("0.0002", "0.0001"), strict=True):
        done = record(job)
        assert f"model.optimizer.lr={lr}" in done["row"]
        assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
        assert sorted(path.name for path in job.iterdir() if path.is_dir()) == [".hydra", "things"]
        assert f"pipeline: rank 1 trains {job / 'things'}" in (job / "run.log").read_text()
        assert torch.load(job / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_ctrl_c_to_a_table_under_torchrun_stops_every_process_and_its_line_finishes_the_table(tmp_path):
    """`torchrun --standalone --nproc-per-node=2 run.py -m task=pipeline ...` of two rows, Ctrl-C in torchrun's
    terminal (SIGINT to torchrun, which passes it on to its workers) during step 3 of the first row's stage: both
    processes stop after that step with its last.ckpt, the row is recorded stopped, the second row does not
    start on either, and rank 0's line (the table's command with pipeline.resume=<sweep dir>) finishes the first
    row from that last.ckpt and runs the second."""
    checkout, command = ctrl_c_table(tmp_path, "torchrun_table_ctrl_c", "launcher")
    stopped = torchrun(checkout, *command, new_session=True)
    output = stopped.stdout + stopped.stderr
    assert output.count("pipeline: rank 1 stopped by SIGINT with the stage's other processes") == 1, output[-6000:]
    assert output.count("Traceback") == output.count("SignalException: Process") == 1  # torchrun's own, at its end
    check_stopped_then_finished(
        checkout, "torchrun_table_ctrl_c", output, lambda resume: torchrun(checkout, *command, resume)
    )


def test_a_row_refused_before_its_stages_under_torchrun_keeps_the_processes_in_step(tmp_path):
    """A row whose plan is refused (its global batch does not divide) ends that row on every process: the
    next row is trained by both in its own folder, and the table ends with the refused row named, not with the
    other process waiting on a row rank 0 had left ('Connection closed by peer')."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_refused", evaluate=False, things=[])
    result = torchrun(
        checkout, "-m", "task=pipeline", "protocol=torchrun_refused", "trainer=ddp", "trainer.devices=2",
        "trainer.accelerator=cpu", "trainer.precision=32-true", "data.batch_size=null",
        "+global_batch={stage:things,size:2}", "trainer.accumulate_grad_batches=3,1",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "the things stage's global batch of 2 (global_batch.size) does not divide" in output
    assert "Connection closed by peer" not in output
    _, jobs = sweep_jobs(checkout, "torchrun_refused")
    [trained] = [job for job in jobs if job.name.startswith("1_")]
    assert record(trained)["status"] == "done"
    assert f"pipeline: rank 1 trains {trained / 'things'}" in (trained / "run.log").read_text()


def test_rows_refused_before_their_pipeline_starts_under_torchrun_end_on_every_process(tmp_path):
    """pipeline.resume naming a sweep directory that holds none of the rows: each row is refused before its
    pipeline is set up, on rank 0, which tells the other process; so both go through every row rather than
    rank 1 waiting in row #0 until rank 0 has left ('Connection closed by peer')."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_not_started", evaluate=False, things=[])
    (tmp_path / "empty_sweep").mkdir()
    result = torchrun(
        checkout, "-m", "task=pipeline", "protocol=torchrun_not_started", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4", f"pipeline.resume={tmp_path / 'empty_sweep'}",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert output.count("error: 2 job(s) of this sweep failed") == 1
    assert "Connection closed by peer" not in output


def test_a_row_failing_in_its_stage_under_torchrun_leaves_the_next_row_and_its_evaluation_whole(tmp_path):
    """A row whose stage fails in both processes (an invalid learning rate): rank 1 waits for rank 0 to end that
    row before it reports the failure, so both train the next row; rank 1, done first, ends without an error
    status, which would make torchrun stop rank 0 in the last row's evaluation. Rank 0 names the failed row."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_failing", things=[])
    failed, trained = torchrun_table_failing_its_first_row(checkout, "torchrun_failing", "-1,1e-4")
    assert record(failed)["status"] == "failed" and "Invalid learning rate: -1" in record(failed)["stages"][0]["error"]
    done = record(trained)
    assert done["status"] == "done" and [entry["status"] for entry in [*done["stages"], *done["evaluations"]]] == [
        "done", "done"
    ]
    assert f"pipeline: rank 1 trains {trained / 'things'}" in (trained / "run.log").read_text()

def torchrun_table_failing_its_first_row(checkout: Path, protocol: str, learning_rates: str) -> tuple[Path, Path]:
    """A two-row table (`model.optimizer.lr=<learning_rates>`) of `protocol` under torchrun on two processes,
    whose first row fails: it ends with status 1 and names that row once. Its (failed, trained) rows' folders."""
    result = torchrun(
        checkout, "-m", "task=pipeline", f"protocol={protocol}", "trainer=ddp", "trainer.devices=2", *GLOO,
        f"model.optimizer.lr={learning_rates}",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert output.count("error: 1 job(s) of this sweep failed: #0") == 1
    _, (failed, trained) = sweep_jobs(checkout, protocol)
    return failed, trained


def out_of_memory_once(tmp_path: Path) -> str:
    """The override that makes rank 1 alone run out of memory during step 2 of the first row's stage only."""
    marker = tmp_path / "out_of_memory"
    return f"+callbacks.oom={{_target_:helpers.faults.OutOfMemoryOnRankOnceAtStep,step:1,rank:1,marker:'{marker}'}}"


def test_a_stage_failing_on_one_process_of_a_torchrun_table_ends_on_all_and_the_next_row_trains(tmp_path):
    """One process out of memory (rank 1, step 2 of the first row's stage) while the other waits for it in its
    step's collective: the stage ends on both at once, not when the process group times out (30 minutes); the
    row is recorded failed with rank 1's error, both train the next row in a new process group, and the table
    ends with status 1 naming the failed row."""
    checkout = checkout_with_protocol(tmp_path, "torchrun_oom", evaluate=False, things=[out_of_memory_once(tmp_path)])
    failed, trained = torchrun_table_failing_its_first_row(checkout, "torchrun_oom", "2e-4,1e-4")
    assert record(failed)["status"] == "failed"
    assert record(failed)["stages"][0]["error"] == "rank 1: OutOfMemoryError: CUDA out of memory on rank 1 (helpers.faults)"
    assert record(trained)["status"] == "done"
    assert f"pipeline: rank 1 trains {trained / 'things'}" in (trained / "run.log").read_text()
    assert torch.load(trained / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2

def run_together(*processes: tuple[list[str], Path, dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """Each (command, working directory, environment added) started at once, as a cluster starts a job's
    processes, each then run to its end."""
    started = [
        subprocess.Popen(
            command, cwd=cwd, env={**os.environ, "WANDB_MODE": "offline", **ENV, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for command, cwd, env in processes
    ]
    results = []
    for process in started:
        output, _ = process.communicate(timeout=900)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, output))
    return results


def test_a_pipeline_on_two_nodes_of_torchrun_is_owned_by_global_rank_0(tmp_path):
    """docs/cluster.md's two-node torchrun command on one machine: two torchrun launchers (`--nnodes=2
    --node-rank=0/1`, one process each) meeting at a c10d rendezvous, each started in a clone of its own.
    The pipeline completes; the clone of global rank 0's node holds its folders and record, the other
    clone's run directory only Hydra's files."""
    clones = [checkout_with_protocol(tmp_path / f"node{node}", "two_nodes", evaluate=False, things=[]) for node in (0, 1)]
    rendezvous = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=job5"]
    command = ["task=pipeline", "protocol=two_nodes", "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2", *GLOO]
    results = run_together(*[
        ([sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--node-rank={node}", "--nproc-per-node=1",
          "run.py", *command], clone, {})
        for node, clone in enumerate(clones)
    ])
    assert [result.returncode for result in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    run_dirs = [clone / "logs" / "pipeline" / "two_nodes" / "runs" / "torchrun-job5" for clone in clones]
    [owner] = [run_dir for run_dir in run_dirs if (run_dir / "pipeline.json").is_file()]
    [other] = [run_dir for run_dir in run_dirs if run_dir != owner]
    done = record(owner)
    assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
    assert torch.load(owner / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(path.name for path in other.iterdir()) == [".hydra", "run.log"]
    assert f"pipeline: rank 1 trains {owner / 'things'}" in (other / "run.log").read_text()


def test_a_pipeline_under_srun_runs_in_the_job_step_directory(tmp_path):
    """docs/cluster.md's srun command as srun starts it: two processes of the same command, each with the
    variables srun sets for its task (srun's environment on one machine, not a real SLURM cluster: no
    scheduler, no sbatch). Lightning finds them as SLURM's; the pipeline completes in slurm-<job>.<step>
    with one record, both processes training and rank 0 evaluating."""
    checkout = checkout_with_protocol(tmp_path, "srun_tasks", things=[])
    command = [sys.executable, "run.py", "task=pipeline", "protocol=srun_tasks", "trainer=ddp", "trainer.devices=2", *GLOO]
    port = free_port()
    results = run_together(*[(command, checkout, srun_task(rank, port)) for rank in (0, 1)])
    assert [result.returncode for result in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    [run_dir] = (checkout / "logs" / "pipeline" / "srun_tasks" / "runs").iterdir()
    assert run_dir.name == "slurm-4242.0"
    done = record(run_dir)
    assert done["status"] == "done" and done["metric"] is not None
    assert [entry["status"] for entry in [*done["stages"], *done["evaluations"]]] == ["done", "done"]
    assert sorted(path.name for path in run_dir.iterdir() if path.is_dir()) == [".hydra", "eval_plain", "things"]
    assert f"pipeline: rank 1 trains {run_dir / 'things'}" in results[1].stdout
    assert "pipeline: evaluation" not in results[1].stdout


def test_a_pipeline_under_srun_warned_by_slurm_is_requeued_and_its_requeued_job_step_finishes_it(tmp_path):
    """docs/cluster.md's time limits: the srun command of a pipeline (as the test above) in an sbatch script
    with `--signal=SIGUSR1@90 --requeue`, SIGUSR1 to every process during its stage's step 3 (a stub
    `scontrol` that records when it ran and sends SIGTERM to the job, as SLURM's requeue does): both tasks stop
    after that step with the stage's last.ckpt, rank 0 requeues the job once, and the pipeline is recorded
    stopped (status 138, one line from each process; rank 1 left before rank 0 told it the stages were over,
    and rank 0 failed on its gone peer). The requeued job step (the same command, SLURM_RESTART_COUNT=1) continues the
    pipeline in slurm-<job>.<step>: the stage resumes from that last.ckpt and the pipeline is done."""
    stop = [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep", "+callbacks.stop.step=2",
        "+callbacks.stop.signal_name=SIGUSR1", "+callbacks.stop.group=true",
    ]
    checkout = checkout_with_protocol(
        tmp_path, "srun_requeue", evaluate=False, things=["trainer.max_steps=6", "trainer.val_check_interval=6", *stop]
    )
    stub = stub_scontrol(tmp_path / "bin", checkout / "logs")
    command = ["task=pipeline", "protocol=srun_requeue", "trainer=ddp", "trainer.devices=2", *GLOO]
    env = {**ENV, "PATH": f"{stub}:{os.environ['PATH']}"}
    port = free_port()

    output = run_job_step(*command, port=port, env=env, cwd=checkout)
    assert output.endswith("srun: task exit statuses [138, 138]\n"), output[-6000:]
    run_dir = checkout / "logs" / "pipeline" / "srun_requeue" / "runs" / "slurm-4242.0"
    last = run_dir / "things" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert (stub / "calls").read_text() == f"requeue 4242\n{last}\n"
    assert record(run_dir)["status"] == "stopped" and "Traceback" not in output
    assert output.count("pipeline stage 1/1 things was stopped by SIGUSR1 (its last.ckpt is kept)") == 1
    assert output.count("pipeline: rank 1 stopped by SIGUSR1 with the stage's other processes") == 1

    output = run_job_step(*command, port=port, env=env, restarts=1, cwd=checkout)
    assert output.endswith("srun: task exit statuses [0, 0]\n"), output[-6000:]
    done = record(run_dir)
    assert done["status"] == "done" and [stage["status"] for stage in done["stages"]] == ["done"]
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert (stub / "calls").read_text() == f"requeue 4242\n{last}\n"  # not requeued again


def test_a_tables_resume_naming_one_rows_run_directory_is_refused_before_any_job(tmp_path):
    """The table's command with pipeline.resume=<one row's run directory> instead of its sweep directory would
    resume that row in every job: refused in one line naming the setting, what was given and the sweep
    directory to give, status 1, before any job starts (no new sweep, the rows' records untouched)."""
    checkout = checkout_with_protocol(tmp_path, "row_resume", evaluate=False, things=[])
    command = ("-m", "task=pipeline", "protocol=row_resume", "model.optimizer.lr=2e-4,1e-4")
    run_py(*command, cwd=checkout, env=ENV, timeout=900)
    sweep, jobs = sweep_jobs(checkout, "row_resume")
    records = [(job / "pipeline.json").read_text() for job in jobs]
    row = f"pipeline.resume='{jobs[0]}'"  # quoted: a row's folder name holds '=' and ','
    refused = run_py(*command, row, cwd=checkout, env=ENV, timeout=900, expect_ok=False)
    assert refused.returncode == 1, (refused.stdout + refused.stderr)[-4000:]
    line = (
        f"error: pipeline.resume={jobs[0]} is one row's run directory (it holds pipeline.json), which every row of "
        f"this table (-m) would resume; give its table's sweep directory, pipeline.resume={sweep}, where each row "
        "finds its own"
    )
    assert (refused.stdout + refused.stderr).count(line) == 1
    assert sweep_jobs(checkout, "row_resume") == (sweep, jobs)
    assert [(job / "pipeline.json").read_text() for job in jobs] == records


def test_a_table_under_srun_runs_every_row_in_the_job_steps_sweep_directory(tmp_path):
    """docs/cluster.md's table command under srun's environment (as the test above: two processes of the
    command, each with its task's SLURM variables; not a SLURM cluster), `-m` with two rows, rank 1 alone out
    of memory in the first row's stage: both processes run the multirun in `multiruns/slurm-<job>.<step>`, the
    first row fails with rank 1's error, both train the second in a new process group (on the store rank 0
    serves, srun having none), and rank 0 alone ends with status 1 naming the failed row."""
    checkout = checkout_with_protocol(tmp_path, "srun_rows", evaluate=False, things=[out_of_memory_once(tmp_path)])
    command = [
        sys.executable, "run.py", "-m", "task=pipeline", "protocol=srun_rows", "trainer=ddp", "trainer.devices=2", *GLOO,
        "model.optimizer.lr=2e-4,1e-4",
    ]
    port = free_port()
    results = run_together(*[(command, checkout, srun_task(rank, port)) for rank in (0, 1)])
    assert [result.returncode for result in results] == [1, 0], "\n".join(r.stdout[-3000:] for r in results)
    assert "error: 1 job(s) of this sweep failed: #0" in results[0].stdout
    sweep, (failed, trained) = sweep_jobs(checkout, "srun_rows")
    assert sweep.name == "slurm-4242.0"
    assert record(failed)["stages"][0]["error"] == "rank 1: OutOfMemoryError: CUDA out of memory on rank 1 (helpers.faults)"
    assert record(trained)["status"] == "done"
    assert f"pipeline: rank 1 trains {trained / 'things'}" in results[1].stdout
    assert torch.load(trained / "things" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2

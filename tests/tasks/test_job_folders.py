"""Multirun job folders are one plain folder name within the file-name limit whatever the overrides hold, and
task=report finds every job of a sweep (also one laid out in nested folders) and says how many of the jobs the
sweep launched it found; a run whose name cannot be a folder is refused in one line. Run from a fresh checkout
with no hydra.sweep.dir, as a user types the commands."""

import csv
import json

import pytest
import yaml

from flowformer.tasks.run_dirs import JOB_FOLDER_MAX

from helpers.run import fresh_checkout, run_py

# Ordinary settings of a tiny training run, as many as a user may set on one command line.
FOURTEEN_OVERRIDES = [
    "debug=tiny",
    "trainer.max_steps=1",
    "trainer.val_check_interval=1",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.gradient_clip_val=0.5",
    "trainer.num_sanity_val_steps=0",
    "data.val_batch_size=2",
    "model.num_val_panels=0",
    "model.gamma=0.85",
    "model.optimizer.weight_decay=0.0002",
    "data.train.num_samples=4",
    "runtime.matmul_precision=highest",
    "seed=1,2",
]


@pytest.fixture
def checkout(tmp_path):
    return fresh_checkout(tmp_path / "checkout")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fresh checkout where `python run.py debug=tiny trainer.max_steps=1` ran: (the checkout, its last.ckpt),
    for the tests that sweep an evaluation over that checkpoint, each into a sweep of its own."""
    checkout = fresh_checkout(tmp_path_factory.mktemp("trained") / "checkout")
    run_py("debug=tiny", "trainer.max_steps=1", cwd=checkout)
    [checkpoint] = (checkout / "logs" / "train" / "default" / "runs").glob("*/checkpoints/last.ckpt")
    return checkout, checkpoint


def report_rows(sweep):
    with (sweep / "report.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def eval_sweep(checkout, checkpoint, *hydra_settings):
    """`python run.py -m task=eval ... eval.checkpoint=<absolute path> eval.max_samples=1,2`: its sweep dir (the
    one it added)."""
    sweeps = checkout / "logs" / "eval" / "default" / "multiruns"
    before = set(sweeps.iterdir()) if sweeps.is_dir() else set()
    run_py(
        "-m",
        "task=eval",
        "backbone=tiny",
        "eval=synthetic",
        "eval.benchmarks.synthetic.iters=2",
        f"eval.checkpoint={checkpoint}",
        "eval.max_samples=1,2",
        *hydra_settings,
        cwd=checkout,
    )
    [sweep] = set(sweeps.iterdir()) - before
    return sweep


def test_a_sweep_over_a_checkpoint_path_keeps_one_folder_per_job_and_reports_both(trained):
    """The `/` of an absolute path in an override nested each job's folder; the report found neither job."""
    checkout, checkpoint = trained
    sweep = eval_sweep(checkout, checkpoint)
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir())
    assert [job.name.partition("_")[0] for job in jobs] == ["0", "1"]
    assert all((job / "eval_results.json").is_file() for job in jobs)
    assert "%2F" in jobs[0].name and len(jobs[0].name.encode()) <= JOB_FOLDER_MAX
    assert f"eval.checkpoint={checkpoint}" in yaml.safe_load(
        (jobs[0] / ".hydra" / "overrides.yaml").read_text()
    )

    result = run_py("task=report", f"report.runs={sweep}", cwd=checkout)
    assert "report: 2 jobs of the 2 launched: 2 done" in result.stdout
    rows = report_rows(sweep)
    assert [row["job"] for row in rows] == ["eval.max_samples=1", "eval.max_samples=2"]
    for row, job in zip(rows, jobs, strict=True):
        measured = json.loads((job / "eval_results.json").read_text())["results"]["synthetic"]["epe"]
        assert float(row["synthetic/epe"]) == pytest.approx(measured)


def test_the_report_finds_the_jobs_of_a_sweep_laid_out_in_nested_folders(trained):
    """A sweep run with the earlier job folder names (`<n>_<overrides>` as Hydra writes them: the path's `/`
    make folders) is still reported in full."""
    checkout, checkpoint = trained
    sweep = eval_sweep(
        checkout, checkpoint, "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"
    )
    assert not any((folder / "eval_results.json").is_file() for folder in sweep.iterdir())  # nested deeper
    result = run_py("task=report", f"report.runs={sweep}", cwd=checkout)
    assert "report: 2 jobs of the 2 launched: 2 done" in result.stdout
    assert [row["job"] for row in report_rows(sweep)] == ["eval.max_samples=1", "eval.max_samples=2"]


def test_a_sweep_with_fourteen_overrides_runs_in_shortened_folders(checkout):
    run_py("-m", *FOURTEEN_OVERRIDES, cwd=checkout)
    [sweep] = (checkout / "logs" / "train" / "default" / "multiruns").iterdir()
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir())
    assert len(jobs) == 2 and jobs[0].name != jobs[1].name
    for number, job in enumerate(jobs):
        assert (
            job.name.startswith(f"{number}_data.train.num_samples=4,")
            and len(job.name.encode()) <= JOB_FOLDER_MAX
        )
        assert (job / "checkpoints" / "last.ckpt").is_file()
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert overrides == [*FOURTEEN_OVERRIDES[:-1], f"seed={number + 1}"]  # the record keeps them all
    result = run_py("task=report", f"report.runs={sweep}", cwd=checkout)
    assert "report: 2 jobs of the 2 launched: 2 done" in result.stdout
    assert [row["job"] for row in report_rows(sweep)] == ["seed=1", "seed=2"]


@pytest.mark.parametrize("multirun", [False, True])
def test_a_name_longer_than_a_folder_name_can_be_is_refused_in_one_line(checkout, multirun):
    name = "n" * 300
    result = run_py(
        *(["-m"] if multirun else []), "debug=tiny", f"name={name}", cwd=checkout, expect_ok=False
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: name='nnnn") and "at most 255 bytes; this one has 300" in line
    assert not (checkout / "logs" / "train").exists() or not any((checkout / "logs" / "train").iterdir())

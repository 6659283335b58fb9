"""task=report over a sweep whose files were damaged after it ran writes the report for every readable job,
lists each unreadable one with the file and why, and exits with status 1 in one line. The sweeps are real
(tiny training and evaluation runs from a fresh checkout, no hydra.sweep.dir), damaged afterwards."""

import csv
import json

import pytest

from helpers.run import fresh_checkout, run_py

PYTHON_TAG = "!!python/object/apply:os.system ['touch owned']\n"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    checkout = fresh_checkout(tmp_path_factory.mktemp("checkout"))
    run_py(
        "-m",
        "debug=tiny",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "seed=1,2,3,4,5,6",
        cwd=checkout,
    )
    return checkout


def report(checkout, sweep):
    """task=report on `sweep`: the run's result and report.csv's rows by job."""
    result = run_py("task=report", f"report.runs={sweep}", cwd=checkout, expect_ok=False)
    with (sweep / "report.csv").open(newline="") as file:
        return result, {row["job"]: row for row in csv.DictReader(file)}


def test_damaged_training_jobs_are_listed_with_their_file_and_the_rest_reported(checkout):
    [sweep] = (checkout / "logs" / "train" / "default" / "multiruns").iterdir()
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir())
    with (jobs[0] / "csv" / "metrics.csv").open("a") as file:
        file.write("garbage,not,a,number\n")
    (jobs[1] / "config_resolved.yaml").write_text(PYTHON_TAG)
    (jobs[2] / ".hydra" / "overrides.yaml").write_text("")
    (jobs[3] / "pipeline.json").write_text("[]")
    (jobs[4] / ".hydra" / "overrides.yaml").write_text(PYTHON_TAG)

    result, rows = report(checkout, sweep)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error (ValueError): 5 of the jobs could not be read (") and "report.md" in line
    assert "report: 6 jobs of the 6 launched: 5 unreadable, 1 done" in result.stdout
    assert not (checkout / "owned").exists()  # the tags were never run
    done = rows[jobs[5].name]  # the one job whose overrides are known: named by its folder
    assert done["status"] == "done" and float(done["synthetic/epe"]) > 0
    errors = {name: row["error"] for name, row in rows.items() if row["status"] == "unreadable"}
    assert sorted(errors) == [job.name for job in jobs[:5]]  # named by their folders: no overrides to read
    assert errors[jobs[0].name].startswith(f"{jobs[0] / 'csv' / 'metrics.csv'}: line ")
    assert errors[jobs[0].name].endswith("is not numbers (could not convert string to float: 'garbage')")
    assert errors[jobs[1].name].startswith(f"{jobs[1] / 'config_resolved.yaml'}: not readable as YAML (")
    assert "python/object/apply:os.system" in errors[jobs[1].name]
    assert errors[jobs[2].name] == (
        f"{jobs[2] / '.hydra' / 'overrides.yaml'}: expected the list of the job's overrides, found nothing"
    )
    assert errors[jobs[3].name].startswith(f"{jobs[3] / 'pipeline.json'}: unexpected content (AttributeError")
    assert errors[jobs[4].name].startswith(f"{jobs[4] / '.hydra' / 'overrides.yaml'}: not readable as YAML (")
    markdown = (sweep / "report.md").read_text()
    assert (
        f"| {jobs[0].name} | unreadable |" in markdown
        and f"- {jobs[3].name}: {errors[jobs[3].name]}" in markdown
    )


def test_a_damaged_evaluation_and_failed_jobs_record_are_listed_and_the_rest_reported(checkout):
    checkpoint = next(
        (checkout / "logs" / "train" / "default" / "multiruns").glob("*/5_*/checkpoints/last.ckpt")
    )
    run_py(
        "-m",
        "task=eval",
        "backbone=tiny",
        "eval=synthetic",
        "eval.benchmarks.synthetic.iters=2",
        f"eval.checkpoint='{checkpoint}',missing.ckpt",
        "eval.max_samples=1,2",
        cwd=checkout,
        expect_ok=False,
    )
    [sweep] = (checkout / "logs" / "eval" / "default" / "multiruns").iterdir()
    evaluated = sorted(path for path in sweep.iterdir() if (path / "eval_results.json").is_file())
    assert len(evaluated) == 2
    results = json.loads((evaluated[0] / "eval_results.json").read_text())
    (evaluated[0] / "eval_results.json").write_text(
        json.dumps({key: value for key, value in results.items() if key != "results"})
    )
    failed = (sweep / "failed_jobs.jsonl").read_text().splitlines()
    assert len(failed) == 2
    (sweep / "failed_jobs.jsonl").write_text(failed[0] + "\n" + failed[1][: len(failed[1]) // 2])

    result, rows = report(checkout, sweep)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"error (ValueError): 2 of the jobs could not be read ({evaluated[0] / 'eval_results.json'}: no "
    )
    assert (
        "4 jobs of the 4 launched: 2 unreadable, 1 done, 1 failed"
        in (sweep / "report.md").read_text()
    )
    statuses = {name: row["status"] for name, row in rows.items()}
    assert sorted(statuses.values()) == ["done", "failed", "unreadable", "unreadable"]
    assert rows[evaluated[0].name]["error"] == f"{evaluated[0] / 'eval_results.json'}: no 'results' field"
    assert rows["failed_jobs.jsonl line 2"]["error"].startswith(
        f"{sweep / 'failed_jobs.jsonl'}: line 2: unexpected content (JSONDecodeError: "
    )
    [done] = [row for row in rows.values() if row["status"] == "done"]
    assert float(done["synthetic/epe"]) > 0

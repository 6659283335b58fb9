"""task=pipeline's record through run.py, as a user meets it: a pipeline moved to another folder resumes there,
damaged records are one line, a damaged evaluation result is evaluated again, a stage that trained to its end but
could not record it is finished, SIGUSR1 during an evaluation stops it as training stops, and a name with a
comma runs. Each pipeline is one tiny stage of protocol=smoke and one evaluation of 2 pairs, run from a fresh
checkout."""

import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flowformer.tasks import pipeline

from helpers.configs import REPO_DIR
from helpers.run import fresh_checkout, run_py, start_run_py

pytestmark = pytest.mark.slow

STAGE = "{name:a,overrides:['task=train','model=flow','data=synthetic']}"
ONE_STAGE = ("task=pipeline", "protocol=smoke", f"pipeline.stages=[{STAGE}]", "~pipeline.evaluate.tiled")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return fresh_checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="module")
def finished(checkout, tmp_path_factory) -> Path:
    """A finished one-stage pipeline's run directory."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_py(*ONE_STAGE, f"hydra.run.dir={run_dir}", cwd=checkout)
    return run_dir


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / pipeline.RECORD).read_text())


def resume(checkout: Path, run_dir: Path, *overrides: str, stages: tuple[str, ...] = ONE_STAGE, **kwargs):
    """`python run.py <stages> pipeline.resume=<run_dir>` in a run directory of its own."""
    own = run_dir.with_name(f"{run_dir.name}_resume_{time.monotonic_ns()}")
    resume_from = f"pipeline.resume={run_dir}"
    return run_py(*stages, *overrides, resume_from, f"hydra.run.dir={own}", cwd=checkout, expect_ok=False, **kwargs)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error")]


def test_a_moved_pipeline_resumes_in_its_new_folder(checkout, tmp_path):
    """Written in scratch/, moved to project/ (the scratch copy gone): every finished part is found there."""
    scratch, project = tmp_path / "scratch" / "run", tmp_path / "project" / "run"
    run_py(*ONE_STAGE, f"hydra.run.dir={scratch}", cwd=checkout)
    project.parent.mkdir()
    shutil.move(scratch, project)
    result = resume(checkout, project)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "pipeline: stage 1/1 a finished already" in output
    assert "pipeline: evaluation plain finished already" in output
    moved = record(project)
    assert moved["status"] == "done" and moved["run_dir"] == str(project)
    assert moved["stages"][0]["checkpoint"] == str(project / "a" / "checkpoints" / "last.ckpt")
    assert moved["evaluations"][0]["results_json"] == str(project / "eval_plain" / "eval_results.json")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda written: [], "it holds a JSON list, not a record"),
        (lambda written: {**written, "stages": [{k: v for k, v in written["stages"][0].items() if k != "name"}]},
         "stages[0] lacks name"),
    ],
    ids=["empty-list", "stage-without-name"],
)
def test_a_damaged_record_is_one_line_naming_it(checkout, finished, tmp_path, damage, problem):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    (run_dir / pipeline.RECORD).write_text(json.dumps(damage(record(finished))))
    result = resume(checkout, run_dir)
    assert result.returncode == 1
    expected = (
        f"error (ValueError): pipeline.resume: {run_dir / pipeline.RECORD} is damaged ({problem}); put back a good "
        "copy of it, or start a fresh run (without pipeline.resume)"
    )
    assert error_lines(result) == [expected]
    assert "Traceback" not in result.stderr


def test_a_damaged_evaluation_result_is_evaluated_again(checkout, finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    results = run_dir / "eval_plain" / "eval_results.json"
    results.write_text(results.read_text()[:100])  # truncated
    result = resume(checkout, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert f"pipeline: evaluation plain finished, but {results} is not a task=eval results file" in output
    assert "evaluating it again" in output
    assert record(run_dir)["evaluations"][0]["status"] == "done"
    assert json.loads(results.read_text())["results"] == json.loads(
        (finished / "eval_plain" / "eval_results.json").read_text()
    )["results"]


def test_a_stage_that_trained_to_its_end_but_could_not_record_it_is_finished_on_resume(checkout, tmp_path):
    """The disk fills as stage b's training ends (its last.ckpt written at trainer.max_steps): the run stops;
    once there is room again, the resume records b as finished from that checkpoint and goes on."""
    run_dir = tmp_path / "run"
    fill = f"'+callbacks.full_disk._target_=helpers.faults.FillDiskAtFitEnd','+callbacks.full_disk.folder={run_dir}'"
    stage_b = f"{{name:b,overrides:['task=train','model=flow','data=synthetic',{fill}]}}"
    stages = ("task=pipeline", "protocol=smoke", f"pipeline.stages=[{STAGE},{stage_b}]", "~pipeline.evaluate.tiled")
    env = {"PYTHONPATH": str(REPO_DIR / "tests")}
    full = run_py(*stages, f"hydra.run.dir={run_dir}", cwd=checkout, env=env, expect_ok=False)
    assert full.returncode == 1 and "No space left on device" in full.stderr, full.stderr[-3000:]
    assert record(run_dir)["stages"][1]["status"] != "done"
    checkpoint = run_dir / "b" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()

    result = resume(checkout, run_dir, stages=stages, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert f"pipeline: stage 2/2 b had trained to its last step ({checkpoint}): recorded as finished" in output
    resumed = record(run_dir)
    assert resumed["status"] == "done"
    assert resumed["stages"][1]["checkpoint"] == str(checkpoint)
    assert resumed["stages"][1]["checkpoint_sha256"] == pipeline.file_sha256(checkpoint)
    assert json.loads(Path(resumed["evaluations"][0]["results_json"]).read_text())["checkpoint"] == str(checkpoint)


def test_sigusr1_during_an_evaluation_stops_the_pipeline_as_in_training(checkout, finished, tmp_path):
    """A resume adds an evaluation of 100000 pairs; SIGUSR1 while it runs stops it: exit status 138, the
    evaluation and the pipeline recorded "stopped", one line saying how to continue."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    long = "+pipeline.evaluate.long=['eval=synthetic','eval.benchmarks.synthetic.iters=2',"
    long += "'eval.benchmarks.synthetic.dataset.num_samples=100000']"
    process = start_run_py(
        *ONE_STAGE, long, f"pipeline.resume={run_dir}", f"hydra.run.dir={tmp_path / 'own'}", cwd=checkout
    )
    deadline = time.monotonic() + 300
    while [e["status"] for e in record(run_dir)["evaluations"]] != ["done", "running"]:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the evaluation did not start: {process.communicate()[1][-3000:]}")
        time.sleep(0.2)
    time.sleep(2)  # well inside the evaluation
    process.send_signal(signal.SIGUSR1)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    stopped = record(run_dir)
    assert stopped["status"] == "stopped"
    assert [e["status"] for e in stopped["evaluations"]] == ["done", "stopped"]
    lines = [line for line in (stdout + stderr).splitlines() if "stopped by SIGUSR1" in line]
    assert len(lines) == 1 and "Traceback" not in stderr
    assert lines[0].endswith(
        f"pipeline evaluation long stopped by SIGUSR1: the finished stages are kept in {run_dir} "
        f"({pipeline.RECORD}); continue with {shlex.join([sys.executable, 'run.py', *ONE_STAGE, long])} "
        f"pipeline.resume={run_dir}, which runs evaluation long again"
    )


def test_a_name_with_a_comma_and_a_quote_runs(checkout, tmp_path):
    name = "ablation v2,seed1 'b'"
    run_dir = tmp_path / "run"
    result = run_py(*ONE_STAGE, f'name="{name}"', f"hydra.run.dir={run_dir}", cwd=checkout, expect_ok=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record(run_dir)["name"] == name
    assert OmegaConf.load(run_dir / "a" / "config_resolved.yaml").name == name

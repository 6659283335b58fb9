"""task=pipeline: stages chained through last.ckpt, a table's rows as one multirun, the record, exact resume,
stale checkpoints refused and a failing stage reported in one line.

The multirun goes through run.py (Hydra's sweep, the failed-job record); the resume tests continue copies of its
first job in this process."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from flowformer.stop_signals import StoppedBySignal
from flowformer.tasks import pipeline
from flowformer.tasks.sweeps import failed_jobs

from helpers.configs import CONF_DIR
from helpers.run import fresh_checkout, run_py

# The multirun's two rows (data.val_batch_size 2 | 0, which the validation loader refuses) of the smoke protocol,
# with an existing sweep narrowed to one value (sweep=mask_ratio) and backbone.num_latent_tokens in every job.
ROWS = ("sweep=mask_ratio", "model.mask_ratio=0.2", "data.val_batch_size=2,0", "backbone.num_latent_tokens=2")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("sweep")
    result = run_py("-m", "task=pipeline", "protocol=smoke", *ROWS, f"hydra.sweep.dir={sweep_dir}", expect_ok=False)
    jobs = sorted(path for path in sweep_dir.iterdir() if path.is_dir() and not path.name.startswith("."))
    return result, sweep_dir, jobs


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / pipeline.RECORD).read_text())


def test_a_multirun_trains_every_row_through_the_protocol(sweep):
    result, _, jobs = sweep
    assert [job.name for job in jobs] == [
        "0_backbone.num_latent_tokens=2,data.val_batch_size=2,model.mask_ratio=0.2",
        "1_backbone.num_latent_tokens=2,data.val_batch_size=0,model.mask_ratio=0.2",
    ]
    done = record(jobs[0])
    assert done["status"] == "done"
    assert [(stage["name"], stage["task"], stage["status"]) for stage in done["stages"]] == [
        ("pretrain", "pretrain", "done"),
        ("chairs", "train", "done"),
        ("things", "train", "done"),
    ]
    # each stage started from the previous stage's last.ckpt, as it was when that stage finished
    pretrain, chairs, things = done["stages"]
    assert pretrain["init_from"] is None
    assert chairs["init_from"] == pretrain["checkpoint"] == str(jobs[0] / "pretrain" / "checkpoints" / "last.ckpt")
    assert things["init_from"] == chairs["checkpoint"]
    assert things["init_from_sha256"] == pipeline.file_sha256(chairs["checkpoint"])
    # the row and the protocol's shared knobs: backbone knobs reach every stage, MCVA knobs only the MCVA stage,
    # flow knobs only the stages with a flow model and data
    assert "backbone.num_latent_tokens=2" in pretrain["overrides"] and "model.mask_ratio=0.2" in pretrain["overrides"]
    assert {"data.val_batch_size=2", "model.train_iters=2"} <= set(pretrain["dropped"])
    assert chairs["dropped"] == things["dropped"] == [
        "model.query_num=2",
        "model.log_images_every_n_steps=0",
        "model.mask_ratio=0.2",
    ]
    stage_configs = {name: OmegaConf.load(jobs[0] / name / "config_resolved.yaml") for name in ("pretrain", "things")}
    assert stage_configs["pretrain"].model.mask_ratio == 0.2 and "mask_ratio" not in stage_configs["things"].model
    assert {cfg.backbone.num_latent_tokens for cfg in stage_configs.values()} == {2}
    # the evaluations, with and without tiling, of the last stage's checkpoint with its backbone
    for evaluation in done["evaluations"]:
        results = json.loads(Path(evaluation["results_json"]).read_text())
        assert results["checkpoint"] == things["checkpoint"] and results["backbone"]["num_latent_tokens"] == 2
    tiled = [json.loads(Path(e["results_json"]).read_text())["protocol"]["synthetic"]["tile"] for e in done["evaluations"]]
    assert tiled == [False, True]
    assert done["metric"] == pipeline.first_epe(done["evaluations"][0]["results_json"])
    for index, name in enumerate(["pretrain", "chairs", "things"], 1):
        assert f"pipeline: stage {index}/3 {name} (task=" in result.stdout + result.stderr


def test_a_failing_stage_stops_its_pipeline_in_one_line_and_keeps_the_finished_stages(sweep):
    result, sweep_dir, jobs = sweep
    assert result.returncode == 1
    failed = record(jobs[1])
    assert failed["status"] == "failed"
    assert [stage["status"] for stage in failed["stages"]] == ["done", "failed", "pending"]
    assert Path(failed["stages"][0]["checkpoint"]).is_file()
    assert "batch_size" in failed["stages"][1]["error"]
    [job] = failed_jobs(sweep_dir)
    assert job["error"].startswith("error (PipelineStageError): pipeline stage 2/3 chairs failed: ValueError:")
    assert f"continue with the table's command and pipeline.resume={sweep_dir}" in job["error"]
    assert "\n" not in job["error"]
    assert "Traceback" not in result.stderr


def test_a_sweep_run_again_with_pipeline_resume_continues_each_job_where_it_stopped(sweep, tmp_path):
    _, sweep_dir, jobs = sweep
    before = record(jobs[0])
    again = run_py(
        "-m", "task=pipeline", "protocol=smoke", *ROWS, f"pipeline.resume={sweep_dir}", f"hydra.sweep.dir={tmp_path}",
        expect_ok=False,
    )
    output = again.stdout + again.stderr
    # each job found its own pipeline in the sweep directory: the finished work is kept, the failed stage runs again
    assert output.count("pipeline: stage 1/3 pretrain finished already") == 2
    assert "pipeline: evaluation tiled finished already" in output
    assert record(jobs[0])["stages"] == before["stages"]
    assert record(jobs[1])["stages"][1]["status"] == "failed"
    assert [job["job"] for job in failed_jobs(tmp_path)] == [1]


def copy_of_job(job: Path, copy: Path, unfinished: tuple[str, ...] = ()) -> Path:
    """The pipeline of a job copied to `copy` (its record's paths with it), its stages named in `unfinished` and
    its evaluations taken back to not started, as if it had stopped before them."""
    shutil.copytree(job, copy)
    copied = json.loads((copy / pipeline.RECORD).read_text().replace(str(job), str(copy)))
    for key, entries in (("name", copied["stages"]), ("label", copied["evaluations"])):
        for index, entry in enumerate(entries):
            if key == "label" or entry["name"] in unfinished:
                shutil.rmtree(entry["dir"])
                entries[index] = {key: entry[key], "dir": entry["dir"], "status": "pending", "resumed_from": [], "wall_s": None}
    (copy / pipeline.RECORD).write_text(json.dumps(copied))
    return copy


def resume(run_dir: Path, row: list[str]) -> dict:
    """task=pipeline protocol=smoke pipeline.resume=run_dir with that row, in this process; its record."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "protocol=smoke",
                f"paths.root_dir={run_dir.parent}",
                f"paths.output_dir={run_dir.parent / 'resuming'}",
                f"pipeline.resume={run_dir}",
            ],
        )
        with open_dict(cfg):
            cfg.pipeline.row = row
        pipeline.run(cfg)
    return record(run_dir)


def stop_stage_at_step(name: str, step: int, real_fit=pipeline.fit):
    """pipeline's fit, with a real SIGTERM to this process during step `step` + 1 of the stage `name`."""

    def fit(cfg):
        if Path(cfg.paths.output_dir).name == name:
            with open_dict(cfg):
                cfg.callbacks.stop = {"_target_": "helpers.faults.SignalAtStep", "step": step, "signal_name": "SIGTERM"}
        return real_fit(cfg)

    return fit


def test_an_interrupted_pipeline_resumes_to_the_uninterrupted_result(sweep, tmp_path, monkeypatch, caplog):
    """The multirun's first job, stopped by SIGTERM during step 1 of its last stage and resumed, ends as it did."""
    job = sweep[2][0]
    reference = record(job)
    run_dir = copy_of_job(job, tmp_path / "run", unfinished=("things",))
    monkeypatch.setattr(pipeline, "fit", stop_stage_at_step("things", 0))
    with pytest.raises(StoppedBySignal):
        resume(run_dir, reference["row"])
    stopped = record(run_dir)
    assert [stage["status"] for stage in stopped["stages"]] == ["done", "done", "stopped"]
    assert stopped["status"] == "stopped"
    monkeypatch.undo()

    caplog.set_level("INFO", logger=pipeline.__name__)
    resumed = resume(run_dir, reference["row"])
    assert "pipeline: stage 2/3 chairs finished already" in caplog.text
    assert resumed["stages"][2]["resumed_from"] == [str(run_dir / "things.interrupted" / "checkpoints" / "last.ckpt")]
    assert resumed["status"] == "done"
    # the same numbers as the pipeline that was never stopped: the last stage's last values (but its timings,
    # time/*, which no two runs share) and the evaluations
    def values(entry: dict) -> dict:
        return {key: value for key, value in entry["metrics"].items() if not key.startswith("time/")}

    assert values(resumed["stages"][2]) == values(reference["stages"][2])
    assert "train/loss" in values(reference["stages"][2])
    for ours, theirs in zip(resumed["evaluations"], reference["evaluations"], strict=True):
        results = [json.loads(Path(e["results_json"]).read_text())["results"] for e in (ours, theirs)]
        assert results[0] == results[1]
    assert resumed["metric"] == reference["metric"]


def test_resume_refuses_other_overrides_and_missing_checkpoints(sweep, tmp_path):
    job = sweep[2][0]
    row = record(job)["row"]
    run_dir = copy_of_job(job, tmp_path / "run")
    with pytest.raises(pipeline.StaleResumeError, match="stage 1/3 pretrain ran with the overrides"):
        resume(run_dir, [*row, "model.optimizer.lr=1.0e-3"])
    (run_dir / "chairs" / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(pipeline.StaleResumeError, match="stage 2/3 chairs finished, but its checkpoint .* is missing"):
        resume(run_dir, row)
    assert not (run_dir / "things.interrupted").exists() and record(run_dir)["stages"][2]["status"] == "done"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ckpt_path=/x/last.ckpt"], "ckpt_path=/x/last.ckpt resumes one training run; a pipeline resumes with"),
        (["pipeline.stages=[chairs,chairs]"], r"stage names \['chairs'\] do not fit: each names the stage's folder"),
        (["pipeline.stages=[]"], "pipeline.stages is empty: choose a protocol"),
        (["pipeline.resume=/nowhere"], "pipeline.resume=/nowhere: /nowhere/pipeline.json does not exist"),
    ],
)
def test_settings_that_cannot_make_a_pipeline_are_refused_before_any_work(overrides, message, tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["protocol=smoke", f"paths.output_dir={tmp_path}", *overrides])
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            pipeline.run(cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_stage_is_one_line_and_leaves_no_run_directory(tmp_path):
    """`pipeline.stages=[chairs,chiars]` was Hydra's "Could not find 'experiment/chiars'" over 15 lines, with the
    pipeline's run directory left behind."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=pipeline", "protocol=smoke", "pipeline.stages=[chairs,chiars]", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert lines == [
        "error (ValueError): pipeline stage chiars (experiment=chiars) names a config that does not exist: In 'config': "
        "Could not find 'experiment/chiars'; Available options in 'experiment': "
        + ", ".join(sorted(path.stem for path in (CONF_DIR / "experiment").glob("*.yaml")))
    ]
    assert list((checkout / "logs").rglob("*")) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # composed after every stage had trained: a misspelt `eval=` failed at the table's end, in Hydra's 12
        # lines, the record left "running"
        (
            ['pipeline.evaluate.plain=["eval=sintell"]'],
            (
                "pipeline evaluation plain (eval=sintell) names a config that does not exist: In 'config': Could not "
                "find 'eval/sintell'; Available options in 'eval': flowformer, flowformer_pp, synthetic"
            ),
        ),
        # one string of overrides where no list is shipped was read letter by letter, as overrides 'e', 'v', ...
        (
            ['+pipeline.evaluate.more="eval=synthetic"'],
            (
                "pipeline.evaluate.more='eval=synthetic': expected a list of overrides, e.g. "
                """[backbone=flowformer_pp,trainer.max_steps=100] (in a command, quoted: '["backbone=flowformer_pp"]')"""
            ),
        ),
        (['pipeline.stages=[{name:a,overrides:"debug=tiny"}]'], "pipeline.stages[0].overrides='debug=tiny': expected a list"),
        # Hydra's errors, its run directory left
        (
            ['pipeline.stages=[{name:a,overrides:["debug=tiny","tiny"]}]'],
            "pipeline stage a (debug=tiny tiny): Error parsing override 'tiny' missing EQUAL at '<EOF>'",
        ),
        (
            ['pipeline.stages=[{name:a,overrides:["debug=tiny","trainer.max_stepz=3"]}]'],
            "pipeline stage a (debug=tiny trainer.max_stepz=3): Could not override 'trainer.max_stepz'.",
        ),
        # refused as the second stage started, after the first had trained
        (
            ['pipeline.stages=[{name:a,overrides:["debug=tiny"]},{name:b,overrides:["debug=tiny","model.gamma=abc"]}]'],
            (
                "pipeline stage b (debug=tiny model.gamma=abc): model.gamma='abc' (flowformer.lit.flow.FlowModule "
                "takes a number): set it to such a value"
            ),
        ),
        # int()'s "invalid literal for int() with base 10: 'abc'"
        (
            ['pipeline.stages=[{name:a,overrides:["debug=tiny","trainer.max_steps=abc"]}]'],
            (
                "pipeline stage a (debug=tiny trainer.max_steps=abc): trainer.max_steps='abc' "
                "(lightning.pytorch.Trainer takes a whole number): set it to such a value"
            ),
        ),
        # refused as the first stage started, the pipeline's run directory and record made
        pytest.param(
            ["trainer=gpu"],
            "trainer.accelerator=gpu (trainer=gpu and trainer=ddp) asks for a GPU, but torch sees no GPU here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="asks for the GPU there is"),
        ),
        # refused as the stage started, after the stages before it had trained
        (
            ['pipeline.stages=[chairs,{name:a,overrides:["debug=tiny","task=eval"]}]'],
            "pipeline stage a (debug=tiny task=eval): task=eval, where a stage trains (task=train or task=pretrain)",
        ),
    ],
)
def test_stages_and_evaluations_that_cannot_run_are_one_line_before_any_training(overrides, message, tmp_path):
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=pipeline", "protocol=smoke", *overrides, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith(f"error (ValueError): {message}"), result.stderr[-3000:]
    assert list((checkout / "logs").rglob("*")) == []


# Each protocol's stages as (name, task, variant, steps), and its evaluations' tiling: the paper's numbers.
PROTOCOLS = {
    "paper_ablation": ([("chairs", "train", "flowformer", 100000), ("things", "train", "flowformer", 60000)], [False, True]),
    "paper_gma": ([("chairs", "train", "flowformer", 120000), ("things", "train", "flowformer", 120000)], [False, True]),
    "main_ct": ([("chairs", "train", "flowformer", 120000), ("things", "train", "flowformer", 120000)], [False, True]),
    "mcva_ablation": (
        [
            ("mcva_pretrain", "pretrain", "flowformer_pp", 50000),
            ("chairs", "train", "flowformer_pp", 120000),
            ("things", "train", "flowformer_pp", 120000),
        ],
        [False, True],
    ),
    "main_ctskh": (
        [(name, "train", "flowformer", 120000) for name in ("chairs", "things", "sintel")],
        [False, False],
    ),
}


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_the_paper_protocols_compose_with_their_schedules(protocol, tmp_path):
    stages, tiling = PROTOCOLS[protocol]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"protocol={protocol}", f"paths.root_dir={tmp_path}"])
        composed, tiles = [], []
        for stage in pipeline.read_stages(cfg.pipeline):
            stage_cfg = compose("config", overrides=[*cfg.pipeline.shared, *stage.overrides])
            composed.append((stage.name, stage_cfg.task, stage_cfg.backbone.variant, stage_cfg.trainer.max_steps))
        for overrides in cfg.pipeline.evaluate.values():
            tiles.append(compose("config", overrides=[*cfg.pipeline.shared, "task=eval", *overrides]).eval.tile)
    assert (cfg.task, cfg.name, composed, tiles) == ("pipeline", protocol, stages, tiling)


def test_with_wandb_each_stage_run_has_the_stage_as_its_job_type(tmp_path):
    """logger=wandb: every run of the pipeline passes its folder's name as the wandb job type (the group is the
    job's name, the table), and the stage's composed logger carries it; without wandb nothing is added."""
    overrides = ["task=pipeline", "protocol=smoke", f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "logger=wandb"])
        stages = pipeline.read_stages(cfg.pipeline)
        through = pipeline.Pipeline(cfg, tmp_path, stages).pass_through(tmp_path / stages[0].name)
        assert f"logger.wandb.job_type='{stages[0].name}'" in through
        stage_cfg = compose("config", overrides=["logger=wandb", *through])
        assert stage_cfg.logger.wandb.job_type == stages[0].name
        assert stage_cfg.logger.wandb.group == cfg.name
        csv_cfg = compose("config", overrides=overrides)
        assert not any("job_type" in o for o in pipeline.Pipeline(csv_cfg, tmp_path, stages).pass_through(tmp_path))

"""task=pipeline: stages chained through last.ckpt, a table's rows as one multirun, the record, exact resume,
stale checkpoints refused and a failing stage reported in one line.

The multirun goes through run.py (Hydra's sweep, the failed-job record); the resume tests run pipelines in this
process on two short supervised stages of protocol=smoke."""

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from flowformer.tasks import pipeline
from flowformer.tasks.preemption import StoppedBySignal
from flowformer.tasks.sweeps import failed_jobs

from helpers.configs import CONF_DIR
from helpers.run import run_py

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
    # the row: backbone knobs reach every stage, an MCVA knob only the MCVA stage, a flow-data knob only the
    # stages with flow data
    assert "backbone.num_latent_tokens=2" in pretrain["overrides"] and "model.mask_ratio=0.2" in pretrain["overrides"]
    assert pretrain["dropped"] == ["data.val_batch_size=2"]
    assert chairs["dropped"] == things["dropped"] == ["model.mask_ratio=0.2"]
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
    assert f"pipeline.resume={jobs[1]}" in job["error"] and "\n" not in job["error"]
    assert "Traceback" not in result.stderr


# Two supervised stages of protocol=smoke, the second one 4 steps long, evaluated without tiling.
SUPERVISED = [
    "task=train",
    "model=flow",
    "data=synthetic",
    "model.train_iters=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "data.val_batch_size=2",
    "data.val.synthetic.dataset.num_samples=2",
    "model.num_val_panels=0",
]
STAGES = [
    {"name": "first", "overrides": SUPERVISED},
    {"name": "second", "overrides": [*SUPERVISED, "trainer.max_steps=4", "callbacks.last_checkpoint.every_n_train_steps=100"]},
]


def run_pipeline(run_dir: Path, *overrides: str) -> dict:
    """task=pipeline of STAGES in this process, writing to run_dir (or the run pipeline.resume names)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "protocol=smoke",
                f"paths.root_dir={run_dir.parent}",
                f"paths.output_dir={run_dir}",
                *overrides,
            ],
        )
        with open_dict(cfg):
            cfg.pipeline.stages = STAGES
            cfg.pipeline.evaluate = {"plain": cfg.pipeline.evaluate.plain}
        pipeline.run(cfg)
    return record(run_dir if not cfg.pipeline.resume else Path(cfg.pipeline.resume))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    return run_dir, run_pipeline(run_dir)


def stop_second_stage_at_step(step: int, real_fit=pipeline.fit):
    """pipeline's fit, with a real SIGTERM to this process during step `step` + 1 of the stage `second`."""

    def fit(cfg):
        if Path(cfg.paths.output_dir).name == "second":
            with open_dict(cfg):
                cfg.callbacks.stop = {"_target_": "helpers.faults.SignalAtStep", "step": step, "signal_name": "SIGTERM"}
        return real_fit(cfg)

    return fit


def test_an_interrupted_pipeline_resumes_to_the_uninterrupted_result(uninterrupted, tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(pipeline, "fit", stop_second_stage_at_step(1))
    with pytest.raises(StoppedBySignal):
        run_pipeline(run_dir)
    stopped = record(run_dir)
    assert [stage["status"] for stage in stopped["stages"]] == ["done", "stopped"]
    assert stopped["status"] == "stopped"
    monkeypatch.undo()

    caplog.set_level("INFO", logger=pipeline.__name__)
    resumed = run_pipeline(tmp_path / "resuming", f"pipeline.resume={run_dir}")
    assert "pipeline: stage 1/2 first finished already" in caplog.text
    assert resumed["stages"][1]["resumed_from"] == [str(run_dir / "second.interrupted" / "checkpoints" / "last.ckpt")]
    assert resumed["status"] == "done"
    # the same numbers as the pipeline that was never stopped: the last stage's last values and the evaluation
    reference = uninterrupted[1]
    assert resumed["stages"][1]["metrics"] == reference["stages"][1]["metrics"]
    assert json.loads(Path(resumed["evaluations"][0]["results_json"]).read_text())["results"] == json.loads(
        Path(reference["evaluations"][0]["results_json"]).read_text()
    )["results"]
    assert resumed["metric"] == reference["metric"]


def test_resume_refuses_other_overrides_and_missing_checkpoints(uninterrupted, tmp_path):
    run_dir, _ = uninterrupted
    with pytest.raises(pipeline.StaleResumeError, match="stage 1/2 first ran with the overrides"):
        run_pipeline(tmp_path / "other", f"pipeline.resume={run_dir}", "pipeline.row=['model.optimizer.lr=1.0e-3']")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    text = (copy / pipeline.RECORD).read_text().replace(str(run_dir), str(copy))
    (copy / pipeline.RECORD).write_text(text)
    (copy / "first" / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(pipeline.StaleResumeError, match="stage 1/2 first finished, but its checkpoint .* is missing"):
        run_pipeline(tmp_path / "missing", f"pipeline.resume={copy}")
    assert record(copy)["stages"][1]["status"] == "done"  # nothing ran


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
        runs = pipeline.Pipeline(cfg, tmp_path, pipeline.read_stages(cfg.pipeline))
        composed = []
        for stage in runs.stages:
            stage_cfg, _, _ = runs.compose([*runs.shared, *stage.overrides], [], tmp_path / stage.name)
            composed.append((stage.name, stage_cfg.task, stage_cfg.backbone.variant, stage_cfg.trainer.max_steps))
        tiles = [runs.compose([*runs.shared, "task=eval", *e], [], tmp_path)[0].eval.tile for e in runs.evaluate.values()]
    assert (cfg.task, cfg.name, composed, tiles) == ("pipeline", protocol, stages, tiling)

"""task=report: the tile table trained by its smoke command, one job, comes out as the paper's two rows, each
with the measured values of the evaluation it names, the paper's numbers and their difference, the parameter
count and training time; a failed or running job is so in both rows; jobs are matched to the paper's rows by
their overrides."""

import csv
import json
import shutil

import pytest
import yaml

from flowformer.tasks import report

from helpers.compose import compose_tiny_config
from helpers.configs import CONF_DIR
from helpers.run import fresh_checkout, run_py


def report_config(runs, *overrides):
    return compose_tiny_config("task=report", f"report.runs={runs}", *overrides)


TILE_ROWS = ["FlowFormer, w/ tile", "FlowFormer, w/o tile"]  # conf/paper/paper_tile.yaml's labels, in order


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """The README's smoke command of the tile table, `python run.py -m task=pipeline protocol=smoke
    sweep=paper_tile`, in a fresh checkout, then the same with a row override that fails its training
    (backbone.agt_depth=-1), then task=report on both multiruns: (the two multirun directories, the report's
    rows as (row, job) -> row)."""
    checkout = fresh_checkout(tmp_path_factory.mktemp("checkout"))
    command = ["-m", "task=pipeline", "protocol=smoke", "sweep=paper_tile"]
    run_py(*command, cwd=checkout, env={"OMP_NUM_THREADS": "1"})
    result = run_py(*command, "backbone.agt_depth=-1", cwd=checkout, expect_ok=False)
    assert result.returncode == 1, result.stderr[-3000:]  # the sweep names its failed job
    done, failed = sorted((checkout / "logs" / "pipeline" / "paper_tile" / "multiruns").iterdir())
    report.run(report_config(f"[{done},{failed}]"))
    with (done / "report.csv").open(newline="") as file:
        rows = {(row["row"], row["job"]): row for row in csv.DictReader(file)}
    return done, failed, rows


def test_the_tile_tables_command_trains_one_pipeline_evaluated_with_and_without_tiles(table_run):
    done, _, _ = table_run
    [job] = report.job_directories(done)
    record = json.loads((job / "pipeline.json").read_text())
    assert record["status"] == "done"
    assert [stage["name"] for stage in record["stages"]] == ["chairs", "things"]  # trained once
    assert [(evaluation["label"], evaluation["status"]) for evaluation in record["evaluations"]] == [
        ("plain", "done"),
        ("tiled", "done"),
    ]
    assert report.launched_jobs(done) == 1


def test_the_one_job_fills_both_rows_beside_the_papers_numbers(table_run):
    done, _, rows = table_run
    published = yaml.safe_load((CONF_DIR / "paper" / "paper_tile.yaml").read_text())["rows"]
    assert published["tile"]["published"]["sintel_clean/epe"] == 0.94  # the paper's FlowFormer, tiled
    [folder] = report.job_directories(done)
    record = json.loads((folder / "pipeline.json").read_text())
    plain = json.loads((folder / "eval_plain" / "eval_results.json").read_text())["results"]
    tiled = json.loads((folder / "eval_tiled" / "eval_results.json").read_text())["results"]
    for label, name in zip(TILE_ROWS, ["tile", "no_tile"], strict=True):
        row = rows[(label, folder.name)]  # named by its folder: its overrides are every job's but one
        assert row["status"] == "done" and row["other_overrides"] == ""
        for column, number in published[name]["published"].items():
            assert float(row[f"{column} paper"]) == number
            assert row[column] == row[f"{column} diff"] == ""  # not measured: no Sintel in the smoke protocol
        assert float(row["plain:synthetic/epe"]) == pytest.approx(plain["synthetic"]["epe"])
        assert float(row["tiled:synthetic/f1_all"]) == pytest.approx(tiled["synthetic"]["f1_all"])
        assert "plain:synthetic/epe paper" not in row  # no paper number for it
        last_stage = json.loads((folder / "things" / "run_info.json").read_text())
        assert float(row["params_m"]) == pytest.approx(last_stage["parameters"]["total"] / 1e6)
        assert float(row["train_s"]) == pytest.approx(sum(stage["wall_s"] for stage in record["stages"]))
    text = (done / "report.md").read_text()
    assert "FlowFormer with v.s. without tile" in text and "2 jobs of the 2 launched: 1 done, 1 failed" in text
    assert f"Compared, of a pipeline's evaluations: {TILE_ROWS[0]}: tiled; {TILE_ROWS[1]}: plain." in text
    assert (done / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_row_compares_the_evaluation_it_names(table_run, tmp_path):
    """The tile table as written, its published numbers read as the synthetic pairs' EPE the smoke protocol
    measures: the w/ tile row is the tiled evaluation's, the w/o tile row the plain one's, from one job."""
    done, _, _ = table_run
    table = yaml.safe_load((CONF_DIR / "paper" / "paper_tile.yaml").read_text())
    for row in table["rows"].values():
        row["published"] = {"synthetic/epe": row["published"]["sintel_clean/epe"]}
    (tmp_path / "paper_tile.yaml").write_text(yaml.safe_dump(table, sort_keys=False))
    report.run(report_config(done, f"report.tables_dir={tmp_path}", f"report.output_dir={tmp_path}"))
    tile, no_tile = csv.DictReader((tmp_path / "report.csv").open(newline=""))
    [folder] = report.job_directories(done)
    for row, label, evaluation, published in zip([tile, no_tile], TILE_ROWS, ["tiled", "plain"], [0.94, 1.01]):
        results = json.loads((folder / f"eval_{evaluation}" / "eval_results.json").read_text())["results"]
        assert (row["row"], row["job"], row["status"]) == (label, folder.name, "done")
        assert float(row["synthetic/epe"]) == pytest.approx(results["synthetic"]["epe"])
        assert float(row["synthetic/epe diff"]) == pytest.approx(results["synthetic"]["epe"] - published)
    assert tile["synthetic/epe"] != no_tile["synthetic/epe"]  # tiling changed the flow


def test_a_failed_job_is_failed_in_both_rows(table_run):
    done, _, rows = table_run
    for label in TILE_ROWS:
        row = rows[(label, "backbone.agt_depth=-1")]
        assert row["status"] == "failed" and "backbone.agt_depth must be >= 0, got -1" in row["error"]
        assert row["plain:synthetic/epe"] == "" and row["sintel_clean/epe paper"] != ""
    text = (done / "report.md").read_text()
    assert f"| {TILE_ROWS[1]} | backbone.agt_depth=-1 | failed |" in text
    assert f"- {TILE_ROWS[0]}: error (PipelineStageError): pipeline stage 1/2 chairs failed" in text


def test_a_job_still_running_is_running_in_both_rows(table_run, tmp_path):
    """A pipeline in its last stage: pipeline.json as the pipeline writes it then (that stage running, the
    evaluations pending)."""
    done, _, _ = table_run
    [folder] = report.job_directories(done)
    running = tmp_path / folder.name
    shutil.copytree(folder, running)
    record = json.loads((running / "pipeline.json").read_text())
    record["status"] = record["stages"][-1]["status"] = "running"
    for evaluation in record["evaluations"]:
        evaluation.update(status="pending", results_json=None)
    (running / "pipeline.json").write_text(json.dumps(record))
    report.run(report_config(tmp_path))
    rows = list(csv.DictReader((tmp_path / "report.csv").open(newline="")))
    assert [(row["row"], row["status"]) for row in rows] == [(label, "running") for label in TILE_ROWS]
    assert [row["sintel_clean/epe"] for row in rows] == ["", ""]  # nothing measured yet
    assert [row["sintel_clean/epe paper"] for row in rows] == ["0.94", "1.01"]
    assert "1 jobs: 1 running" in (tmp_path / "report.md").read_text()


def test_a_job_is_the_row_whose_overrides_it_has():
    table = report.load_table(CONF_DIR / "paper", "mcva_masking", explicit=True)

    def job(*overrides):
        return report.Job(name="0", directory=None, overrides=list(overrides), row=list(overrides))

    assert report.match_row(table, job("model.mask_ratio=0.50", "model.masking=random", "seed=3"))["label"] == (
        "Random, 50%"
    )
    assert report.match_row(table, job("model.mask_ratio=0.5")) is None  # the masking is part of the row
    pe = report.load_table(CONF_DIR / "paper", "paper_pe", explicit=True)
    rows = list(pe["rows"]["no_token_pe"]["overrides"])
    assert report.match_row(pe, report.Job("0", None, [], rows))["label"] == "w/o token PE"
    with_token_pe = report.Job("0", None, [], [*rows[:-1], "backbone.token_pe=true"])
    assert report.match_row(pe, with_token_pe)["label"] == "FlowFormer"  # the row whose every override it has


def test_the_papers_columns_are_its_evaluation_measured_minus_published():
    """The MCVA tables' numbers are tiled: a pipeline's tiled evaluation is compared with them."""
    table = report.load_table(CONF_DIR / "paper", "mcva_head_depth", explicit=True)
    assert table["evaluation"] == "tiled"
    job = report.Job("0", None, ["backbone.recon_head_depth=5"], ["backbone.recon_head_depth=5"])
    job.evaluations = ["plain", "tiled"]
    job.results = {"plain:sintel_clean/epe": 1.5, "tiled:sintel_clean/epe": 1.0, "tiled:chairs/epe": 2.0}
    row = report.report_rows([job], table, ["epe"])[0]
    assert row["sintel_clean/epe"] == 1.0 and row["sintel_clean/epe paper"] == 0.94
    assert row["sintel_clean/epe diff"] == pytest.approx(0.06)
    assert row["kitti/f1_all"] is None and row["kitti/f1_all paper"] == 14.64
    assert row["plain:sintel_clean/epe"] == 1.5 and row["tiled:chairs/epe"] == 2.0  # the rest, as measured


def test_a_row_that_names_its_evaluation_is_compared_with_that_one_alone():
    """A main_ct pipeline whose tiled evaluation was left out: its w/o tile row has the plain evaluation's
    number, its w/ tile row none (not the plain one in its place)."""
    table = report.load_table(CONF_DIR / "paper", "paper_tile", explicit=True)
    job = report.Job("0", None, ["task=pipeline", "protocol=main_ct"], [], evaluations=["plain"])
    job.results = {"plain:sintel_clean/epe": 1.5}
    tile, no_tile = report.report_rows([job], table, ["epe"])
    assert (tile["row"], tile["sintel_clean/epe"], tile["sintel_clean/epe paper"]) == (TILE_ROWS[0], None, 0.94)
    assert (no_tile["row"], no_tile["sintel_clean/epe"]) == (TILE_ROWS[1], 1.5)
    assert no_tile["sintel_clean/epe diff"] == pytest.approx(0.49)


def test_a_sweep_of_no_paper_table_names_each_row_by_what_it_sweeps_and_lists_the_rest_beside():
    """A plain sweep's report: each row is named by the overrides its job does not share with the others,
    "other overrides" holds the shared ones only, and no line speaks of the paper's numbers."""
    shared = ["backbone=tiny", "data=synthetic"]
    jobs = [report.Job(str(n), None, [*shared, f"model.train_iters={n}"], []) for n in (2, 3)]
    for job, epe in zip(jobs, (5.79, 6.01), strict=True):
        job.status, job.results = "done", {"synthetic/epe": epe}
    rows = report.report_rows(jobs, None, ["epe"])
    assert [(row["row"], row["other_overrides"], row["synthetic/epe"]) for row in rows] == [
        ("model.train_iters=2", "backbone=tiny data=synthetic", 5.79),
        ("model.train_iters=3", "backbone=tiny data=synthetic", 6.01),
    ]
    text = report.markdown("Report of a sweep", None, rows, report.found_line(jobs, rows, 2))
    assert "paper" not in text.lower()
    assert "| model.train_iters=2 | model.train_iters=2 | done | 5.79 | - | backbone=tiny data=synthetic |" in text


def test_report_table_that_names_no_table_is_one_line(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("[]\n")
    with pytest.raises(FileNotFoundError, match="report.table=nonsense: no .*nonsense.yaml; the paper's tables are"):
        report.run(report_config(tmp_path, "report.table=nonsense"))


def test_a_protocol_run_is_its_row_of_the_main_table():
    """The main table's rows are protocols (a job's command line): C+T numbers compared with the tiled
    evaluation, C+T+S+K+H train-set numbers with the plain one, as the paper measured them."""
    table = report.load_table(CONF_DIR / "paper", "paper_comparison", explicit=True)
    job = report.Job("0", None, ["task=pipeline", "protocol=mcva_ablation"], [], evaluations=["plain", "tiled"])
    job.results = {"plain:sintel_clean/epe": 1.5, "tiled:sintel_clean/epe": 1.0}
    row = report.report_rows([job], table, ["epe"])[0]
    assert row["row"] == "C+T, FlowFormer+MCVA" and row["sintel_clean/epe diff"] == pytest.approx(0.1)
    job.overrides = ["task=pipeline", "protocol=main_ctskh"]
    row = report.report_rows([job], table, ["epe"])[0]
    assert row["sintel_clean/epe"] == 1.5 and row["sintel_clean/epe paper"] == 0.48
    assert row["sintel_test_clean/epe"] is None and row["sintel_test_clean/epe paper"] == 1.16


def test_with_wandb_the_report_is_a_wandb_table_in_the_tables_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = report_config(tmp_path, "logger=wandb", f"paths.output_dir={tmp_path}")
    rows = [{"job": "pipeline.paper_row=no_agt_pe", "status": "done", "sintel_clean/epe": 1.25, "error": None}]
    run = report.log_to_wandb(cfg, "paper_pe", rows, None)
    assert (run.group, run.job_type) == ("paper_pe", "report")
    [table] = (tmp_path / "wandb").glob("offline-run-*/files/media/table/report_*.table.json")
    assert json.loads(table.read_text()) == {
        "columns": ["job", "status", "sintel_clean/epe", "error"],
        "data": [["pipeline.paper_row=no_agt_pe", "done", 1.25, None]],
    }
    assert report.log_to_wandb(report_config(tmp_path), "paper_pe", rows, None) is None  # logger=csv: no run


def test_a_folder_of_assorted_runs_reports_its_training_runs_and_leaves_out_the_others(tmp_path):
    """`report.runs=logs`: a multirun's jobs (numbered) beside a single run (whose Hydra job number is '???')
    failed to sort (a TypeError traceback), and the report's own earlier runs were jobs "running"."""
    checkout = fresh_checkout(tmp_path)
    tiny = ("debug=tiny", "trainer.max_steps=1", "trainer.val_check_interval=1")
    run_py("-m", *tiny, "seed=1,2", cwd=checkout)
    run_py(*tiny, cwd=checkout)
    [single] = (checkout / "logs" / "train" / "default" / "runs").iterdir()
    run_py("task=report", f"report.runs={single}", cwd=checkout)
    result = run_py("task=report", "report.runs=logs", cwd=checkout)
    assert "report: 3 jobs: 3 done -> logs/report.md" in result.stdout
    # the earlier report's run and this one's
    assert "logs: 2 runs of tasks that give no result left out (2 task=report)" in result.stdout
    with (checkout / "logs" / "report.csv").open(newline="") as file:
        assert sorted(row["job"] for row in csv.DictReader(file)) == sorted(["seed=1", "seed=2", single.name])

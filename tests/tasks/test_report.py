"""task=report: a table's rows trained by one multirun of the smoke protocol come out as one report row per job,
with the measured values, the paper's numbers of the job's row and their difference, the parameter count and
training time, and the failed job listed as failed; jobs are matched to the paper's rows by their overrides."""

import csv
import json
import shutil

import pytest
import yaml

from flowformer.tasks import report

from helpers.compose import compose_tiny_config
from helpers.configs import CONF_DIR
from helpers.run import run_py


def report_config(runs, *overrides):
    return compose_tiny_config("task=report", f"report.runs={runs}", *overrides)


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """`python run.py -m task=pipeline protocol=smoke sweep=paper_tile` with a third job naming no row of the
    table (it fails before training), then task=report on its directory."""
    sweep = tmp_path_factory.mktemp("sweep")
    result = run_py(
        "-m",
        "task=pipeline",
        "protocol=smoke",
        "sweep=paper_tile",
        "pipeline.paper_row=tile,no_tile,no_such_row",
        f"hydra.sweep.dir={sweep}",
        expect_ok=False,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the sweep names its failed job
    report.run(report_config(sweep))
    with (sweep / "report.csv").open(newline="") as file:
        rows = {row["job"]: row for row in csv.DictReader(file)}
    return sweep, rows


def test_each_job_is_a_row_beside_its_papers_numbers(table_run):
    sweep, rows = table_run
    published = yaml.safe_load((CONF_DIR / "paper" / "paper_tile.yaml").read_text())["rows"]
    assert published["tile"]["published"]["sintel_clean/epe"] == 0.94  # the paper's FlowFormer, tiled
    assert list(rows) == ["pipeline.paper_row=tile", "pipeline.paper_row=no_tile", "pipeline.paper_row=no_such_row"]
    for job, name in enumerate(["tile", "no_tile"]):
        row = rows[f"pipeline.paper_row={name}"]
        folder = sweep / f"{job}_pipeline.paper_row={name}"
        assert row["status"] == "done" and row["row"] == published[name]["label"]
        for column, number in published[name]["published"].items():
            assert float(row[f"{column} paper"]) == number
            assert row[column] == row[f"{column} diff"] == ""  # not measured: no Sintel in the smoke protocol
        record = json.loads((folder / "pipeline.json").read_text())
        plain = json.loads((folder / "eval_plain" / "eval_results.json").read_text())["results"]
        tiled = json.loads((folder / "eval_tiled" / "eval_results.json").read_text())["results"]
        assert float(row["plain:synthetic/epe"]) == pytest.approx(plain["synthetic"]["epe"])
        assert float(row["tiled:synthetic/f1_all"]) == pytest.approx(tiled["synthetic"]["f1_all"])
        assert "plain:synthetic/epe paper" not in row  # no paper number for it
        last_stage = json.loads((folder / "things" / "run_info.json").read_text())
        assert float(row["params_m"]) == pytest.approx(last_stage["parameters"]["total"] / 1e6)
        assert float(row["train_s"]) == pytest.approx(sum(stage["wall_s"] for stage in record["stages"]))


def test_a_failed_job_is_listed_as_failed(table_run):
    sweep, rows = table_run
    failed = rows["pipeline.paper_row=no_such_row"]
    assert failed["status"] == "failed" and "no_such_row" in failed["error"]
    assert failed["row"] == "pipeline.paper_row=no_such_row" and failed["plain:synthetic/epe"] == ""
    text = (sweep / "report.md").read_text()
    assert "FlowFormer with v.s. without tile" in text and "2 done, 1 failed" in text
    assert "| pipeline.paper_row=no_such_row | pipeline.paper_row=no_such_row | failed |" in text
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_still_running_is_listed_as_running(table_run, tmp_path):
    """A pipeline in its last stage: pipeline.json as the pipeline writes it then (that stage running, the
    evaluations pending)."""
    sweep, _ = table_run
    running = tmp_path / "0_pipeline.paper_row=tile"
    shutil.copytree(sweep / running.name, running)
    record = json.loads((running / "pipeline.json").read_text())
    record["status"] = record["stages"][-1]["status"] = "running"
    for evaluation in record["evaluations"]:
        evaluation.update(status="pending", results_json=None)
    (running / "pipeline.json").write_text(json.dumps(record))
    report.run(report_config(tmp_path))
    row, missing = csv.DictReader((tmp_path / "report.csv").open(newline=""))
    assert row["status"] == "running" and row["row"] == "FlowFormer, w/ tile"
    assert row["sintel_clean/epe"] == "" and row["sintel_clean/epe paper"] == "0.94"  # nothing measured yet
    assert (missing["row"], missing["status"]) == ("FlowFormer, w/o tile", "missing")  # the row no job ran
    assert missing["sintel_clean/epe paper"] == "1.01"
    assert "1 jobs: 1 running, 1 missing" in (tmp_path / "report.md").read_text()


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

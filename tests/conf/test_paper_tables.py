"""The paper's tables (conf/paper/) and the sweeps that run them: every table is well formed and transcribed
consistently, a paper_* sweep's jobs are exactly its table's rows and each job's pipeline.row is its row's
overrides, the MCVA grids (conf/sweep/mcva_*.yaml) cover their tables, and the README's smoke command of every
table sweep, `python run.py -m task=pipeline protocol=smoke sweep=<table>`, trains every row to the end through
a smoke version of the table's own protocol, each row with its own results (one table from a fresh checkout in
a subprocess, the others in this process: the same run.py, without an interpreter's start-up per table), and
one table's stages with the configs that their recorded overrides compose."""

import itertools
import json
import math
from pathlib import Path

import hydra
import pytest
import torch
import yaml
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from flowformer.overrides import path_value
from flowformer.tasks.pipeline import first_epe, read_stages
from flowformer.tasks.report import PAPER_COLUMNS, PARAMS_KEY, override_values

from helpers.compose import compose_run_config
from helpers.configs import CONF_DIR
from helpers.run import fresh_checkout, run_py, run_py_in_this_process

TABLES = sorted(path.stem for path in (CONF_DIR / "paper").glob("*.yaml"))
PAPER_SWEEPS = sorted(path.stem for path in (CONF_DIR / "sweep").glob("paper_*.yaml"))
# every sweep that trains a table's rows, one job per row: the paper tables' and the MCVA grids
TABLE_SWEEPS = [*PAPER_SWEEPS, *sorted(path.stem for path in (CONF_DIR / "sweep").glob("mcva_*.yaml"))]
# the table whose smoke command runs as a user types it, in a fresh checkout
IN_A_FRESH_CHECKOUT = "paper_agt_mlp_conv"
# the table whose jobs' stages are also composed from their records (`assert_trained_as_composed`): its rows
# differ in the pretraining objective (model=unsup or MCVA), which only the pretraining stage takes
COMPOSED_FROM_RECORDS = "paper_unsupervised"
# the sections of a stage's config that the routing of the shared and row overrides decides
ROUTED = ("task", "backbone", "model", "trainer", "data")


def read_table(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "paper" / f"{name}.yaml").read_text())


# The rows of the tables of paper_* sweeps (the MCVA tables' rows are the grids of conf/sweep/mcva_*.yaml, whose
# knobs tests/conf/test_mcva.py follows into the pretraining module).
PAPER_ROWS = [(table, row) for table in PAPER_SWEEPS for row in read_table(table)["rows"]]

def test_every_table_has_its_caption_and_rows_with_overrides_and_published_numbers():
    for name in TABLES:
        table = read_table(name)
        assert table["title"] and table["caption"] and table["training"], name
        for row_name, row in table["rows"].items():
            # a row is made by its overrides, or is one evaluation of a job that fills several rows (paper_tile)
            assert row["label"] and (row["overrides"] or row.get("evaluation")), (name, row_name)
            parsed = override_values(list(row["overrides"]))  # Hydra parses every override
            assert len(parsed) == len(row["overrides"]), (name, row_name)
            assert set(row["published"]) <= {*PAPER_COLUMNS, PARAMS_KEY}, (name, row_name)


def test_rows_the_paper_repeats_have_the_same_numbers():
    """The paper reports some configurations in several tables: transcribed once each, they must agree."""

    def published(name, row):
        numbers = dict(read_table(name)["rows"][row]["published"])
        numbers.pop(PARAMS_KEY, None)
        return numbers

    assert published("paper_arch_ablation", "agt1") == published("paper_agt_mlp_conv", "trans_trans")
    assert published("paper_arch_ablation", "agt3") == published("paper_pe", "flowformer")
    mcva = published("mcva_masking", "block_50")  # FlowFormer+MCVA as published: 0.90 / 2.30 / 3.93 / 14.13
    assert mcva == {"sintel_clean/epe": 0.90, "sintel_final/epe": 2.30, "kitti/epe": 3.93, "kitti/f1_all": 14.13}
    for name, row in [
        ("mcva_head_depth", "depth3"),
        ("mcva_recon_design", "random_pe_crop"),
        ("mcva_target_size", "size15"),
        ("mcva_freeze", "freeze_ie_freeze_ce"),
        ("paper_unsupervised", "mcva"),
        ("paper_comparison", "mcva_ct"),
    ]:
        assert published(name, row) == mcva, (name, row)


@pytest.mark.parametrize("sweep", [sweep for sweep in PAPER_SWEEPS if sweep != "paper_tile"])
def test_a_paper_sweep_runs_one_pipeline_per_row_of_its_table(sweep):
    rows = read_table(sweep)["rows"]
    cfg = compose_run_config(["task=pipeline", "protocol=smoke", f"sweep={sweep}"])
    assert cfg.hydra.sweeper.params["pipeline.paper_row"].split(",") == list(rows)
    assert cfg.name == sweep  # the runs' folder and the wandb group
    for row_name, row in rows.items():
        cfg.pipeline.paper_row = row_name  # what the sweeper sets for the job of this row
        assert OmegaConf.to_container(cfg.pipeline.row, resolve=True) == row["overrides"]


def test_the_tile_table_is_one_pipeline_evaluated_as_each_row_compares():
    """Its two rows are one C+T model evaluated with and without tiles: sweep=paper_tile is a multirun of one
    job (no swept values), whose protocol runs the evaluation each row names."""
    rows = read_table("paper_tile")["rows"].values()
    assert [row["evaluation"] for row in rows] == ["tiled", "plain"]
    for protocol in ["main_ct", "smoke"]:
        cfg = compose_run_config(["task=pipeline", f"protocol={protocol}", "sweep=paper_tile"])
        assert cfg.hydra.mode == RunMode.MULTIRUN and not cfg.hydra.sweeper.params, protocol
        evaluate = OmegaConf.to_container(cfg.pipeline.evaluate)
        assert "eval.tile=true" in evaluate["tiled"] and "eval.tile=true" not in evaluate["plain"], protocol


@pytest.mark.parametrize("table", [name for name in TABLES if name.startswith("mcva_")])
def test_an_mcva_grid_runs_every_row_of_its_table(table):
    params = compose_run_config([f"sweep={table}"]).hydra.sweeper.params
    grid = [dict(zip(params, values)) for values in itertools.product(*(p.split(",") for p in params.values()))]
    jobs = [override_values(f"{key}={value}" for key, value in job.items()) for job in grid]
    for row in read_table(table)["rows"].values():
        wanted = override_values(list(row["overrides"]))
        assert any(all(job.get(key) == value for key, value in wanted.items()) for job in jobs), row["label"]


def test_the_main_tables_rows_are_protocols():
    """Its rows differ in their whole training (one run each, no sweep): each row's overrides compose a
    pipeline, compared with the evaluation the row names."""
    for row in read_table("paper_comparison")["rows"].values():
        cfg = compose_run_config(row["overrides"])
        assert cfg.task == "pipeline" and row["evaluation"] in cfg.pipeline.evaluate, row["label"]


def test_the_rows_with_gmas_cnn_encoders_have_the_papers_parameter_counts():
    """At the paper's size (backbone=flowformer with the row's overrides), to the paper's rounding: RAFT, GMA,
    the LCT rows and FlowFormer (small). (The Twins rows are about 2M under the paper's: docs/ablations.md.)"""
    for table in PAPER_SWEEPS:
        for name, row in read_table(table)["rows"].items():
            if "backbone.image_encoder=cnn" not in row["overrides"] or PARAMS_KEY not in row["published"]:
                continue
            network = hydra.utils.instantiate(compose_run_config(["backbone=flowformer", *row["overrides"]]).backbone)
            millions = sum(parameter.numel() for parameter in network.parameters()) / 1e6
            assert round(millions, 1) == row["published"][PARAMS_KEY], (table, name, millions)


def test_each_flowformer_row_of_the_main_table_has_its_flowformer_mcva_row():
    """FlowFormer+MCVA's row of each setting (C+T, C+T+S+K+H, its KITTI test) pretrains with MCVA, then trains
    FlowFormer's stages of that row, evaluated on the same sets (with FlowFormer++'s evaluation protocol)."""
    rows = read_table("paper_comparison")["rows"]
    for name, row in rows.items():
        if not name.startswith("flowformer_"):
            continue
        flowformer = compose_run_config(row["overrides"]).pipeline
        mcva = compose_run_config(rows[name.replace("flowformer_", "mcva_")]["overrides"]).pipeline
        assert list(mcva.stages) == ["mcva_pretrain", *flowformer.stages], name
        assert evaluated_sets(mcva) == evaluated_sets(flowformer), name


def evaluated_sets(pipeline) -> dict[str, list[str]]:
    """A pipeline's evaluations without their protocol choice (eval=): the sets, tiling, submissions."""
    return {label: [o for o in overrides if not o.startswith("eval=")] for label, overrides in pipeline.evaluate.items()}


def table_protocol(sweep: str) -> str:
    """The protocol that trains a table sweep's rows: its table's (conf/paper/<table>.yaml `protocol`); the MCVA
    grids without a table are MCVA ablations."""
    path = CONF_DIR / "paper" / f"{sweep}.yaml"
    return read_table(sweep)["protocol"] if path.is_file() else "mcva_ablation"


def test_every_paper_sweeps_table_names_the_protocol_its_documented_command_runs():
    for sweep in PAPER_SWEEPS:
        protocol = table_protocol(sweep)
        assert (CONF_DIR / "protocol" / f"{protocol}.yaml").is_file(), sweep
        assert f"protocol={protocol} sweep={sweep}" in (CONF_DIR / "sweep" / f"{sweep}.yaml").read_text(), sweep


def test_the_smoke_protocol_shrinks_each_tables_protocol_stage_for_stage():
    """protocol=smoke trains the stages of the protocol a table names: as many, pretraining where it pretrains
    (its MCVA stage), supervised where it trains on flow."""
    smoke = compose_run_config(["task=pipeline", "protocol=smoke"])
    for protocol in sorted({table_protocol(sweep) for sweep in TABLE_SWEEPS}):
        with open_dict(smoke):
            smoke.paper_table = {"protocol": protocol}  # as a sweep=paper_* loads its table
        real = read_stages(compose_run_config([f"protocol={protocol}"]).pipeline)
        shrunk = read_stages(smoke.pipeline)
        assert len(shrunk) == len(real), protocol
        for real_stage, smoke_stage in zip(real, shrunk):
            pretrains = any(override.startswith("experiment=mcva_pretrain") for override in real_stage.overrides)
            assert ("task=pretrain" in smoke_stage.overrides) == pretrains, (protocol, real_stage.name)


def job_results(record: dict) -> tuple:
    """What a finished pipeline job measured: each stage's last training loss, each evaluation's first epe."""
    losses = [stage["metrics"]["train/loss"] for stage in record["stages"]]
    return (*losses, *(first_epe(evaluation["results_json"]) for evaluation in record["evaluations"]))


def assert_trained_as_composed(record: dict) -> None:
    """Every stage of a job of a multirun, whose jobs share the probes that route their rows (`Pipeline.probe`),
    trained with the config that `python run.py <the stage's recorded overrides>` composes."""
    pretraining = record["stages"][0]["overrides"]
    assert ("model=unsup" in pretraining) == ("model=unsup" in record["row"])
    for stage in record["stages"]:
        ran = yaml.safe_load((Path(stage["dir"]) / "config_resolved.yaml").read_text())
        composed = compose_run_config([*stage["overrides"], f"paths.output_dir={path_value(stage['dir'])}"])
        for key in ROUTED:
            section = OmegaConf.to_container(composed[key], resolve=True) if key != "task" else composed.task
            assert ran[key] == section, (stage["dir"], key)


@pytest.fixture
def one_torch_thread():
    """torch on one thread while the table runs: its tiny networks take longer on two threads of two shared
    cores, whose waits for each other dominate (the subprocess: OMP_NUM_THREADS=1); tests/conftest.py puts the
    process's count back after the test."""
    torch.set_num_threads(1)


@pytest.mark.parametrize("sweep", TABLE_SWEEPS)
def test_the_smoke_command_of_a_table_trains_every_row_through_its_protocol(sweep, tmp_path, one_torch_thread):
    command = ["-m", "task=pipeline", "protocol=smoke", f"sweep={sweep}"]
    if sweep == IN_A_FRESH_CHECKOUT:
        root = fresh_checkout(tmp_path / "checkout")
        run_py(*command, cwd=root, timeout=900, env={"OMP_NUM_THREADS": "1"})
    else:
        root = tmp_path
        assert run_py_in_this_process(*command, cwd=root) == 0
    [sweep_dir] = (root / "logs" / "pipeline").glob("*/multiruns/*")
    records = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob("*/pipeline.json"))]
    params = compose_run_config(command[1:]).hydra.sweeper.params or {}  # none: one job (paper_tile)
    assert len(records) == math.prod(len(str(values).split(",")) for values in params.values())
    assert all(record["status"] == "done" for record in records)
    pretrains = table_protocol(sweep) == "mcva_ablation"
    for record in records:
        assert [stage["task"] for stage in record["stages"]] == ["pretrain"] * pretrains + ["train", "train"]
        if "backbone.twins_weights=imagenet" in record["row"]:  # run with the tiny Twins' stand-in weights
            assert all("backbone.twins_weights=standin" in stage["overrides"] for stage in record["stages"])
        if "backbone.decoder_query=pe" in record["row"]:  # the query of pretraining only: finetuning has the method's
            assert ["backbone.decoder_query=pe" in stage["overrides"] for stage in record["stages"]] == [True, False, False]
    assert len({job_results(record) for record in records}) == len(records)  # every row its own results
    if sweep == COMPOSED_FROM_RECORDS:
        for record in records:
            assert_trained_as_composed(record)
    if sweep in PAPER_SWEEPS:  # each job's record has its row's overrides as written: task=report's match
        rows = {tuple(row["overrides"]) for row in read_table(sweep)["rows"].values()}  # paper_tile's are one
        assert sorted(record["row"] for record in records) == sorted(map(list, rows))

"""The paper's tables (conf/paper/) and the sweeps that run them: every table is well formed and transcribed
consistently, a paper_* sweep's jobs are exactly its table's rows and each job's pipeline.row is its row's
overrides, the MCVA grids (conf/sweep/mcva_*.yaml) cover their tables, and every row of those tables builds and
trains 2 steps on the tiny sizes at 64x96 (in this process, through the training task's fit, as a pipeline's
stage runs it)."""

import itertools

import pytest
import yaml
from omegaconf import OmegaConf

from flowformer.tasks.report import PAPER_COLUMNS, PARAMS_KEY, override_values
from flowformer.tasks.train import fit

from helpers.compose import compose_run_config, compose_tiny_config
from helpers.configs import CONF_DIR

TABLES = sorted(path.stem for path in (CONF_DIR / "paper").glob("*.yaml"))
PAPER_SWEEPS = sorted(path.stem for path in (CONF_DIR / "sweep").glob("paper_*.yaml"))


def read_table(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "paper" / f"{name}.yaml").read_text())


# The rows of the tables of paper_* sweeps (the MCVA tables' rows are the grids of conf/sweep/mcva_*.yaml, whose
# knobs tests/conf/test_mcva.py follows into the pretraining module).
PAPER_ROWS = [(table, row) for table in PAPER_SWEEPS for row in read_table(table)["rows"]]

# The settings of a training run on the tiny sizes, 2 steps, as the smoke protocol's stages: supervised for a row
# of network knobs, pretraining for a row that sets the pretraining objective or its knobs (model=, model.*).
SUPERVISED = ["debug=tiny", "trainer.limit_val_batches=0", "callbacks=none"]
PRETRAINING = [
    "backbone=tiny",
    "task=pretrain",
    "data=synthetic_video",
    "trainer=cpu",
    "trainer.max_steps=2",
    "data.batch_size=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
]
MCVA_QUICK = ["model.query_num=2", "model.log_images_every_n_steps=0"]  # 2 query rounds a step, no pictures


def test_every_table_has_its_caption_and_rows_with_overrides_and_published_numbers():
    for name in TABLES:
        table = read_table(name)
        assert table["title"] and table["caption"] and table["training"], name
        for row_name, row in table["rows"].items():
            assert row["label"] and row["overrides"], (name, row_name)
            assert override_values(list(row["overrides"])), (name, row_name)  # Hydra parses every override
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


@pytest.mark.parametrize("sweep", PAPER_SWEEPS)
def test_a_paper_sweep_runs_one_pipeline_per_row_of_its_table(sweep):
    rows = read_table(sweep)["rows"]
    cfg = compose_run_config(["task=pipeline", "protocol=smoke", f"sweep={sweep}"])
    assert cfg.hydra.sweeper.params["pipeline.paper_row"].split(",") == list(rows)
    assert cfg.name == sweep  # the runs' folder and the wandb group
    for row_name, row in rows.items():
        cfg.pipeline.paper_row = row_name  # what the sweeper sets for the job of this row
        assert OmegaConf.to_container(cfg.pipeline.row, resolve=True) == row["overrides"]


@pytest.mark.parametrize("table", [name for name in TABLES if name.startswith("mcva_")])
def test_an_mcva_grid_runs_every_row_of_its_table(table):
    params = compose_run_config([f"sweep={table}"]).hydra.sweeper.params
    grid = [dict(zip(params, values)) for values in itertools.product(*(p.split(",") for p in params.values()))]
    jobs = [override_values(f"{key}={value}" for key, value in job.items()) for job in grid]
    for row in read_table(table)["rows"].values():
        wanted = override_values(list(row["overrides"]))
        assert any(all(job.get(key) == value for key, value in wanted.items()) for job in jobs), row["label"]


def tiny_run_overrides(row_overrides: list[str]) -> list[str]:
    """A row's overrides on the tiny sizes: the Twins encoder without ImageNet weights (none on a test machine)
    and with its 256 channels (the tiny backbone has 64), on the supervised or the pretraining settings."""
    row = [override for override in row_overrides if not override.startswith("backbone.twins_weights=")]
    if "backbone.image_encoder=twins" in row:
        row += ["backbone.feature_dim=256"]
    if not any(override.startswith("model") for override in row):
        return [*SUPERVISED, *row]
    model = next((override for override in row if override.startswith("model=")), "model=mcva")
    quick = MCVA_QUICK if model == "model=mcva" else ["model.train_iters=2"]
    return [*PRETRAINING, model, *quick, *(override for override in row if override != model)]


@pytest.mark.parametrize(("table", "row"), PAPER_ROWS)
def test_every_row_builds_and_trains_two_steps_on_the_tiny_sizes(table, row, tmp_path):
    row_overrides = read_table(table)["rows"][row]["overrides"]
    overrides = tiny_run_overrides(row_overrides)
    cfg = compose_tiny_config(*overrides, f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}")
    trainer = fit(cfg)[1]
    assert trainer.global_step == 2
    built = trainer.lightning_module.backbone.config
    for key, value in override_values(overrides).items():
        if key.startswith("backbone."):
            assert built[key.removeprefix("backbone.")] == value, key


def test_the_main_tables_rows_are_protocols():
    """Its rows differ in their whole training (one run each, no sweep): each row's overrides compose a
    pipeline, compared with the evaluation the row names."""
    for row in read_table("paper_comparison")["rows"].values():
        cfg = compose_run_config(row["overrides"])
        assert cfg.task == "pipeline" and row["evaluation"] in cfg.pipeline.evaluate, row["label"]

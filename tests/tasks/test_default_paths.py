"""The paths a user gets by setting none (issue 37 item 3): the tests elsewhere mostly pass paths.data_dir,
paths.output_dir or hydra.run.dir; here README commands run in a fresh checkout with no paths.* or hydra.*
setting, the data in the checkout's data/ and the run in logs/<task>/<name>/runs/<time>/."""

import json
import re

from helpers.run import fresh_checkout, run_py
from helpers.trees import sintel_tree

TIME = re.compile(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(_\d+)?")
# What every training run writes into its directory (README, "Where things are written").
RUN_FILES = (
    "config_resolved.yaml",
    "run_info.json",
    "run.log",
    ".hydra/config.yaml",
    "checkpoints/last.ckpt",
)


def test_the_readme_training_example_writes_the_documented_run_directory(tmp_path):
    """`python run.py task=train backbone=tiny data=synthetic trainer=cpu` (README, Tasks) with a step limit:
    the default callbacks, progress bar and logger, and the run directory README's "Where things are written"
    draws."""
    checkout = fresh_checkout(tmp_path)
    readme_example = ("task=train", "backbone=tiny", "data=synthetic", "trainer=cpu")
    run_py(*readme_example, "trainer.max_steps=2", cwd=checkout)
    [run_dir] = (checkout / "logs" / "train" / "default" / "runs").iterdir()
    assert TIME.fullmatch(run_dir.name)
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "run_info.json").read_text())["command"]


def test_datasets_linked_into_the_checkouts_data_folder_are_found(tmp_path):
    """data/README.md: with no paths.data_dir, datasets are read from the checkout's data/ (symlinked there).
    `python run.py task=eval backbone=tiny eval.sets=[sintel_clean]` scores the linked Sintel tree."""
    checkout = fresh_checkout(tmp_path / "checkout")
    (checkout / "data" / "Sintel").symlink_to(sintel_tree(tmp_path / "datasets" / "Sintel"))
    run_py("task=eval", "backbone=tiny", "eval.sets=[sintel_clean]", cwd=checkout)
    [run_dir] = (checkout / "logs" / "eval" / "default" / "runs").iterdir()
    results = json.loads((run_dir / "eval_results.json").read_text())["results"]
    assert results["sintel_clean"]["epe"] > 0

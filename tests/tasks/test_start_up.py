"""What a run pays for before it starts: `python run.py` imports the libraries of the parts it builds. A run that
builds neither a Twins encoder nor a ConvNeXt cost layer (timm) nor the unsupervised loss (kornia), and logs to
CSV (wandb), imports none of them: about a second of every run's start-up."""

from helpers.run import fresh_checkout, run_py


def imported_packages(stderr: str) -> set[str]:
    """The top-level packages a run imported, from what `python -X importtime` (PYTHONPROFILEIMPORTTIME=1)
    writes to its stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.split("|")[-1].strip().split(".")[0] for line in lines}


def test_a_tiny_training_run_imports_neither_timm_nor_kornia_nor_wandb(tmp_path):
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=train", "debug=tiny", cwd=checkout, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = imported_packages(result.stderr)
    assert {"torch", "lightning", "hydra"} <= imported  # what it trains with, as the report shows it
    assert not {"timm", "kornia", "wandb"} & imported

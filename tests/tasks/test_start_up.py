"""What a run pays for before it starts: `python run.py` imports the libraries of the parts it builds. A run that
builds neither a Twins encoder nor a ConvNeXt cost layer (timm) nor the unsupervised loss (kornia), and logs to
CSV (wandb), imports none of them: about a second of every run's start-up. A task that never trains (eval, report,
infer, convert, bench's forward rows) imports no Lightning either: two seconds of CPU time; nor torch's compiler
where nothing else imports it (report, convert, bench's forward rows, infer), for runtime.compile=true only: 1.5 s;
nor, unless it scores flow (eval), torchmetrics."""

import subprocess
import sys

import cv2
import numpy as np

from flowformer.models import save_backbone

from helpers.configs import build_backbone
from helpers.run import fresh_checkout, run_py


def imported_modules(stderr: str) -> set[str]:
    """The modules a run imported, from what `python -X importtime` (PYTHONPROFILEIMPORTTIME=1) writes to its
    stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.split("|")[-1].strip() for line in lines}


def imported_packages(stderr: str) -> set[str]:
    """The top-level packages a run imported."""
    return {module.split(".")[0] for module in imported_modules(stderr)}


def test_a_tiny_training_run_imports_neither_timm_nor_kornia_nor_wandb(tmp_path):
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=train", "debug=tiny", cwd=checkout, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = imported_packages(result.stderr)
    assert {"torch", "lightning", "hydra"} <= imported  # what it trains with, as the report shows it
    assert not {"timm", "kornia", "wandb"} & imported


def test_an_evaluation_and_its_report_import_no_lightning_and_the_report_no_compiler(tmp_path):
    checkout = fresh_checkout(tmp_path)
    profile = {"PYTHONPROFILEIMPORTTIME": "1"}
    evaluation = run_py(
        "task=eval",
        "backbone=tiny",
        "eval=synthetic",
        "eval.max_samples=1",
        "eval.benchmarks.synthetic.iters=2",
        cwd=checkout,
        env=profile,
    )
    runs = checkout / "logs" / "eval" / "default" / "runs"
    report = run_py("task=report", f"report.runs={runs}", cwd=checkout, env=profile)
    assert "report: 1 jobs: 1 done" in report.stdout
    for result in (evaluation, report):
        imported = imported_packages(result.stderr)
        assert {"torch", "hydra"} <= imported and "lightning" not in imported
    # nor torch's compiler (1.5 s of CPU), which only runtime.compile=true uses; an evaluation imports it anyway
    # through torchmetrics (torchvision)
    assert "torch._dynamo" not in imported_modules(report.stderr)


def test_inference_imports_neither_lightning_nor_the_metrics_nor_the_compiler(tmp_path):
    """task=infer scores nothing: no torchmetrics (3 s of CPU at import, with the torchvision and torch._dynamo
    it imports), which task=eval imports to score."""
    checkout = fresh_checkout(tmp_path / "checkout")
    checkpoint = tmp_path / "tiny.pt"
    save_backbone(checkpoint, build_backbone("tiny"))
    frames = np.random.default_rng(0).integers(0, 255, (2, 48, 64, 3), dtype=np.uint8)
    for name, frame in zip(("a.png", "b.png"), frames):
        cv2.imwrite(str(tmp_path / name), frame)
    pair = f"infer.input=[{tmp_path / 'a.png'},{tmp_path / 'b.png'}]"
    output = f"infer.output_dir={tmp_path / 'flow'}"
    result = run_py("task=infer", "backbone=tiny", f"infer.checkpoint={checkpoint}", pair, output, "infer.iters=2",
                    cwd=checkout, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert (tmp_path / "flow" / "a.flo").is_file()
    imported = imported_modules(result.stderr)
    assert "torch" in imported and not {"lightning", "torchmetrics"} & imported
    # nor torch's compiler (1.5 s of CPU), which only runtime.compile=true uses, where einops does not register its
    # operations with it as it is imported (einops does on torch before 2.8: pyproject.toml admits 2.6 and 2.7)
    if not einops_imports_the_compiler():
        assert "torch._dynamo" not in imported


def einops_imports_the_compiler() -> bool:
    """Whether einops, as installed here, imports torch._dynamo with its torch functions (in a fresh process)."""
    probe = "import sys, einops._torch_specific; print('torch._dynamo' in sys.modules)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "True\n"

"""task=quickstart (experiment=quickstart): pretrain -> finetune -> evaluate.

Every stage is a full run.py run composed from `quickstart.shared` + `quickstart.<stage>` (so it can be
repeated by hand), written to <run dir>/<stage>/. With `quickstart.compare_from_scratch=true` a second
model is finetuned from random weights for comparison. Prints and writes <run dir>/metrics.json with the
held-out EPE of the finetuned model(s) next to the zero-flow EPE, and returns the EPE of the
pretrained-then-finetuned model; exits with status 1 when that EPE is above `quickstart.max_epe_ratio` of the
zero-flow EPE.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from flowformer.lit.checkpointing import last_checkpoint_path
from flowformer.metrics import FlowMetrics
from flowformer.models.output_files import atomic_write_text
from flowformer.tasks import close_loggers
from flowformer.tasks import eval as eval_task
from flowformer.tasks.train import fit

log = logging.getLogger(__name__)


def compose_stage(cfg: DictConfig, stage_dir: Path, overrides: list[str]) -> DictConfig:
    """The config `python run.py <overrides>` would get, writing to stage_dir, with this run's logger/seed."""
    passthrough = [f"seed={cfg.seed}", f"name={cfg.name}", f"paths.output_dir={stage_dir}"]
    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("logger")
        passthrough.append(f"logger={choice}" if choice else "logger=null")
    return hydra.compose("config", overrides=[*cfg.quickstart.shared, *overrides, *passthrough])


def zero_flow_epe(dataset_cfg: DictConfig) -> float:
    """EPE of predicting zero flow on the evaluation set, with the same (pixel-pooled) metric."""
    metric = FlowMetrics()
    for batch in DataLoader(hydra.utils.instantiate(dataset_cfg), batch_size=4):
        metric.update(torch.zeros_like(batch["flow"]), batch["flow"], batch["valid"])
    return float(metric.compute()["epe"])


def run(cfg: DictConfig) -> float:
    run_dir = Path(cfg.paths.output_dir)
    stages = cfg.quickstart

    pretrain_cfg = compose_stage(cfg, run_dir / "pretrain", list(stages.pretrain))
    _, pretrainer = fit(pretrain_cfg)
    close_loggers()
    pretrained = str(last_checkpoint_path(pretrainer))

    runs = {"with_mcva": [f"model.init_from={pretrained}"]}
    if stages.compare_from_scratch:
        runs["from_scratch"] = []
    checkpoints = {}
    for label, extra in runs.items():
        stage_cfg = compose_stage(cfg, run_dir / f"finetune_{label}", [*stages.finetune, *extra])
        _, trainer = fit(stage_cfg)
        close_loggers()
        checkpoints[label] = str(last_checkpoint_path(trainer))

    epe = {}
    for label, checkpoint in checkpoints.items():
        eval_cfg = compose_stage(
            cfg, run_dir / f"eval_{label}", [*stages.evaluate, f"eval.checkpoint={checkpoint}"]
        )
        epe[label] = eval_task.run(eval_cfg)
    zero = zero_flow_epe(eval_cfg.eval.benchmarks.synthetic.dataset)

    metrics = {"zero_flow_epe": zero}
    for label, value in epe.items():
        metrics[f"epe_finetuned_{label}"] = value
        metrics[f"ratio_{label}"] = value / zero
    metrics |= {
        "max_epe_ratio": stages.max_epe_ratio,
        "pass": epe["with_mcva"] <= stages.max_epe_ratio * zero,
        "checkpoints": {"pretrain": pretrained, **checkpoints},
    }
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2))
    titles = {"with_mcva": "finetuned from MCVA pretraining", "from_scratch": "finetuned from scratch"}
    rows = "".join(
        f"  {titles[label]:<31} {value:8.3f}  ({value / zero:.0%} of zero flow)\n" for label, value in epe.items()
    )
    summary = (
        "\nquickstart: held-out synthetic EPE (lower is better)\n"
        f"  {'zero flow':<31} {zero:8.3f}\n{rows}"
        f"  {'PASS' if metrics['pass'] else 'FAIL'}: at most {stages.max_epe_ratio:.0%} of zero flow required; "
        f"details in {run_dir / 'metrics.json'}\n"
    )
    print(summary)
    if not metrics["pass"]:
        raise SystemExit(
            f"quickstart: the finetuned model's EPE {epe['with_mcva']:.3f} is above "
            f"{stages.max_epe_ratio:.0%} of the zero-flow EPE {zero:.3f}; see {run_dir / 'metrics.json'}"
        )
    return epe["with_mcva"]

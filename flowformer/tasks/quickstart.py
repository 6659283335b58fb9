"""task=quickstart (experiment=quickstart): pretrain -> finetune -> evaluate, a pipeline with a verdict.

The stages are task=pipeline's (`pipeline.*` of conf/experiment/quickstart.yaml, run by
flowformer/tasks/pipeline.py into <run dir>/<stage>/ with <run dir>/pipeline.json); with
`quickstart.compare_from_scratch=true` the stages after pretraining run once more from random weights, as a
pipeline of their own in <run dir>/from_scratch/. Prints and writes <run dir>/metrics.json with the held-out
EPE of the finetuned model(s) next to the zero-flow EPE, writes <run dir>/heldout_pairs.png (image | ground
truth | prediction | error of `quickstart.panel_pairs` held-out pairs) and returns the EPE of the
pretrained-then-finetuned model; exits with status 1 when that EPE is above `quickstart.max_epe_ratio` of the
zero-flow EPE. A stop signal (Ctrl-C) stops it with its work kept, as task=pipeline's, and the same command
with `pipeline.resume=<run dir>` (its line names it) continues it there.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
from pathlib import Path

import torch
from omegaconf import DictConfig

from flowformer.data.io import write_image
from flowformer.eval.baselines import baseline_methods
from flowformer.models.output_files import atomic_write_text
from flowformer.overrides import command_again, shell_override
from flowformer.setting_types import count_at_least
from flowformer.stop_signals import StoppedBySignal, StopSignals, stopping_at_once
from flowformer.tasks.eval import open_sets, score_baselines
from flowformer.tasks.pipeline import RECORD, Pipeline, pipeline_dir, read_record, read_stages
from flowformer.tasks.runtime import load_network, pick_device
from flowformer.viz import flow_panel, stack_panels

log = logging.getLogger(__name__)

PANEL = "heldout_pairs.png"


def zero_flow_epe(eval_cfg: DictConfig) -> float:
    """EPE of zero flow on the evaluation's first set, scored as the evaluation scores the model: task=eval's
    `zero` baseline (eval.baselines)."""
    name, pair = next(iter(open_sets(eval_cfg.eval).items()))
    return score_baselines(baseline_methods(["zero"]), {name: pair}, eval_cfg.eval)["zero"][name]["epe"]


def write_heldout_panel(eval_cfg: DictConfig, path: Path, pairs: int) -> None:
    """image | ground truth | prediction | error of the first `pairs` pairs of the evaluation's first set, one
    row each, predicted as the evaluation does (its checkpoint, protocol and iterations)."""
    protocol, dataset = next(iter(open_sets(eval_cfg.eval).values()))
    device = pick_device(eval_cfg.eval.device, "eval.device")
    net = load_network(eval_cfg.backbone, eval_cfg.eval.checkpoint, device, "eval.checkpoint")
    panels = []
    for index in range(min(pairs, len(dataset))):
        item = dataset[index]
        with torch.inference_mode():
            flow = protocol.predict(net, item["img1"][None].to(device), item["img2"][None].to(device))["flow"]
        panels.append(flow_panel(item["img1"], flow[0].cpu(), item["flow"], item.get("valid")))
    write_image(path, stack_panels(panels))


def summary(epe: dict[str, float], zero: float, max_ratio: float, run_dir: Path, passed: bool) -> str:
    """The table the demo prints: zero flow, each finetuned model, the verdict, where the details are."""
    titles = {"with_mcva": "finetuned from MCVA pretraining", "from_scratch": "finetuned from scratch"}
    rows = "".join(
        f"  {titles[label]:<31} {value:8.3f}  ({value / zero:.0%} of zero flow)\n" for label, value in epe.items()
    )
    return (
        "\nquickstart: held-out synthetic EPE (lower is better)\n"
        f"  {'zero flow':<31} {zero:8.3f}\n{rows}"
        f"  {'PASS' if passed else 'FAIL'}: at most {max_ratio:.0%} of zero flow required; "
        f"details in {run_dir / 'metrics.json'}\n"
        f"  held-out pairs (image | ground truth | prediction | error): {run_dir / PANEL}\n"
    )


def stopped_before_verdict(signum: signal.Signals, run_dir: Path) -> str:
    return (
        f"quickstart stopped by {signum.name} before its verdict: its finished stages and evaluations are kept in "
        f"{run_dir} ({RECORD}); continue with "
        f"{command_again(shell_override('pipeline.resume', run_dir))}"
    )


def check_settings(settings: DictConfig) -> None:
    """The quickstart.* settings, refused before any stage: a count below one would fail a stage or the picture
    after the work before it (`finetune_steps=0` in the finetuning's trainer settings, after the pretraining),
    and a ratio of zero or below could never pass."""
    for key in ("pretrain_steps", "finetune_steps", "panel_pairs"):
        count_at_least(settings[key], f"quickstart.{key}", 1)
    if not settings.max_epe_ratio > 0:
        raise ValueError(
            f"quickstart.max_epe_ratio={settings.max_epe_ratio}: expected a fraction of the zero-flow EPE > 0 "
            "(0.5: the demo passes at half of it)"
        )


def run(cfg: DictConfig) -> float:
    """The demo's pipelines, then its verdict; `pipeline.resume=<run dir>` continues a stopped demo (a stop
    signal's line names it) in that run directory: finished stages and evaluations are kept."""
    settings = cfg.quickstart
    check_settings(settings)
    stages = read_stages(cfg.pipeline)
    run_dir, earlier = pipeline_dir(cfg)
    pipelines = {"with_mcva": Pipeline(cfg, run_dir, stages, earlier)}
    if settings.compare_from_scratch:
        scratch_dir = run_dir / "from_scratch"
        scratch_earlier = read_record(scratch_dir) if earlier and (scratch_dir / RECORD).is_file() else None
        pipelines["from_scratch"] = Pipeline(cfg, scratch_dir, stages[1:], scratch_earlier, resume_dir=run_dir)
    # a signal after a pipeline's last stage or evaluation, or between the pipelines, stops the next pipeline
    # before its first stage, or the demo before its verdict
    with StopSignals() as signals:
        records = {label: pipeline.run() for label, pipeline in pipelines.items()}
        if (signum := signals.received) is not None:
            raise StoppedBySignal(signum, stopped_before_verdict(signum, run_dir))
        with stopping_at_once(functools.partial(stopped_before_verdict, run_dir=run_dir)):
            return verdict(settings, pipelines["with_mcva"], records, run_dir)


def verdict(settings: DictConfig, pipeline: Pipeline, records: dict[str, dict], run_dir: Path) -> float:
    """metrics.json, the held-out pairs' picture and the printed summary; returns the EPE of the pretrained
    then finetuned model, or exits with status 1 when it is above the required fraction of zero flow's."""
    eval_cfg = pipeline.configs[f"eval_{next(iter(pipeline.evaluate))}"]
    zero = zero_flow_epe(eval_cfg)
    write_heldout_panel(eval_cfg, run_dir / PANEL, settings.panel_pairs)

    epe = {label: record["metric"] for label, record in records.items()}
    metrics = {"zero_flow_epe": zero}
    for label, value in epe.items():
        metrics[f"epe_finetuned_{label}"] = value
        metrics[f"ratio_{label}"] = value / zero
    passed = epe["with_mcva"] <= settings.max_epe_ratio * zero
    metrics |= {
        "max_epe_ratio": settings.max_epe_ratio,
        "pass": passed,
        "checkpoints": {
            "pretrain": records["with_mcva"]["stages"][0]["checkpoint"],
            **{label: record["stages"][-1]["checkpoint"] for label, record in records.items()},
        },
        "panel": str(run_dir / PANEL),
    }
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2))
    print(summary(epe, zero, settings.max_epe_ratio, run_dir, passed))
    if not passed:
        raise SystemExit(
            f"quickstart: the finetuned model's EPE {epe['with_mcva']:.3f} is above "
            f"{settings.max_epe_ratio:.0%} of the zero-flow EPE {zero:.3f}; see {run_dir / 'metrics.json'}"
        )
    return epe["with_mcva"]

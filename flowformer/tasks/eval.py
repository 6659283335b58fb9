"""task=eval: evaluate a checkpoint on the benchmark sets with the official protocol.

    python run.py task=eval backbone=flowformer eval.checkpoint=checkpoints/things.pth
    python run.py task=eval backbone=flowformer eval=flowformer eval.tile=true            # Gaussian tiling
    python run.py task=eval backbone=flowformer_pp eval=flowformer_pp eval.checkpoint=sintel.pth
    python run.py task=eval backbone=tiny eval=synthetic                                   # no downloads
    python run.py task=eval backbone=flowformer eval.checkpoint=sintel.pth \
        eval.sets=[sintel_test_clean,sintel_test_final] eval.tile=true                      # Sintel submission

The checkpoint may be ours, an official .pth (with or without `module.`) or a Lightning .ckpt; it must fit
the chosen backbone config. Each entry of `eval.benchmarks` is a set of `conf/eval/sets/` (its dataset, metric
kind, padding and tile geometry; the same files define the validation sets of `conf/data/`) plus its decoder
iterations `iters` (FF: 32 Sintel, 24 KITTI; FF++: 12). Kinds and their metrics (`flowformer/metrics.py`):

- `sintel`: pixel-pooled EPE over all pixels (no valid mask, as the official `validate_sintel`; pixels whose
  ground truth is NaN or inf are left out with a warning, in every kind), 1/3/5 px
  and the s0-10 / s10-40 / s40+ speed split;
- `kitti`: `epe` per image (the official kitti-epe) and `f1_all` pixel-pooled (the official kitti-f1) over
  the valid pixels, with `epe_pooled`, `f1_all_per_image` and 1/3/5 px beside them;
- `flow`: pixel-pooled EPE, 1/3/5 px, F1-all over the valid pixels (chairs, synthetic);
- `sintel_submission` / `kitti_submission`: test sets; write .flo trees / 16-bit PNGs.

`eval.tile=true` switches every set from padding to Gaussian tiling with its `tile_size` and `tile_pad_mode`.
`eval.warm_start=true` (not tiled) starts each pair of a sequence (a Sintel scene, in frame order) from the
previous pair's flow projected forward, as `infer.warm_start` does (`flowformer/eval/protocol.py`).
A progress bar shows each set's pairs per second and the time left.
`eval.baselines=[zero,dis]` also scores those methods (`flowformer/eval/baselines.py`) on every scored set, in
rows `<set> (<method>)` and under `baselines` in the results file.
Writes `eval.results_json` and prints a table; returns the first scored set's `epe` (for sweepers). An
existing `eval.results_json` or submission folder is refused before any work unless `eval.overwrite=true`.
Ctrl-C (or SIGTERM, SIGUSR1) ends the run at once with one line and status 128 + the signal's number.
"""

from __future__ import annotations

import json
import logging
import math
import signal
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from flowformer.data.loader_settings import auto_workers, worker_start_method
from flowformer.eval.baselines import baseline_methods
from flowformer.eval.protocol import EvalSet, FlowNet, Protocol, WarmStart, require_finite_flow
from flowformer.metrics import NothingScoredError, SetMetrics
from flowformer.models.output_files import atomic_write_text
from flowformer.setting_types import count_at_least, whole_number
from flowformer.stop_signals import deferred_stop, stopping_at_once, worker_ignores_stop_signals
from flowformer.tasks.run_dirs import OutputPathError, ensure_writable_dir, refuse_existing
from flowformer.tasks.runtime import (
    InferenceContext,
    compile_network,
    load_network,
    pair_progress,
    pick_device,
)

log = logging.getLogger(__name__)

KITTI_NOTE = "kitti: official kitti-epe = epe (per-image mean), kitti-f1 = f1_all (pooled over pixels)"


def submission_writer(kind: str) -> Callable[[Path, Any, Mapping[str, Any]], None]:
    """(out_dir, flow [H,W,2] numpy, item meta) -> writes one test pair's flow in the benchmark's layout."""
    from flowformer.eval import submission

    return submission.write_sintel_item if kind == "sintel_submission" else submission.write_kitti_item


def submission_folder(submission_dir: Path, protocol: Protocol) -> Path:
    """Where a test set's submission goes: `submission_dir`/sintel or `submission_dir`/kitti."""
    return submission_dir / protocol.kind.removesuffix("_submission")


def _single(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader collate for batch_size 1: the item itself (images of a set may differ in size)."""
    return batch[0]


def evaluate_set(
    net: nn.Module,
    dataset: Dataset,
    protocol: Protocol,
    *,
    name: str,
    device: torch.device,
    precision: str = "32-true",
    max_samples: int | None = None,
    num_workers: int = 0,
    submission_dir: Path | None = None,
    warm_start: bool = False,
) -> dict[str, float]:
    """Runs `net` (eval mode, B = 1 as the official scripts) over `dataset` with `protocol` and returns the set's
    metrics (an empty dict for submission sets, which write `submission_dir`/sintel/<pass>/<scene>/frame%04d.flo
    or `submission_dir`/kitti/<frame_id> instead, as the official submission writers). With `warm_start`, each
    pair that continues the previous pair's sequence starts from its projected flow (`WarmStart`). A progress
    bar shows the pairs per second and the time left."""
    if protocol.writes_submission and submission_dir is None:
        raise ValueError(f"eval set {name} writes a submission; set eval.submission_dir")
    metrics = None if protocol.writes_submission else protocol.metrics()
    count = pairs_to_evaluate(dataset, name, max_samples)
    loader = DataLoader(
        torch.utils.data.Subset(dataset, range(count)),
        batch_size=1,
        num_workers=num_workers,
        collate_fn=_single,
        worker_init_fn=worker_ignores_stop_signals,
        multiprocessing_context=worker_start_method(num_workers),
    )
    warm = WarmStart() if warm_start else None
    missing_truth = 0  # ground-truth pixels that are NaN or inf: left out as invalid (flowformer/metrics.py)
    inference = InferenceContext(device, precision, "eval.precision")
    with deferred_stop:
        pairs = iter(loader)  # starts the workers
    with pair_progress() as progress, inference.keeping_weight_casts():
        for index, item in enumerate(progress.track(pairs, total=count, description=name)):
            image1 = item["img1"][None].to(device)  # [1,3,H,W]
            image2 = item["img2"][None].to(device)
            with inference:
                if warm is None:
                    flow = protocol.predict(net, image1, image2)["flow"]  # [1,2,H,W] fp32
                else:
                    flow = warm.predict(protocol, net, image1, image2, item.get("meta", {}))["flow"]
            require_finite_flow(flow, f"eval set {name}, pair {index}")
            if metrics is None:
                write_submission_item(submission_dir, protocol, flow, item)
            else:
                missing_truth += score_item(metrics, flow, item, name, protocol)
    log.info("%s: %d pairs in %.1f s", name, count, progress.tasks[0].elapsed or 0.0)
    if missing_truth:
        log.warning("%s: %d ground-truth pixels are NaN or inf and were left out as invalid", name, missing_truth)
    if warm is not None:
        log.info("%s: %d of %d pairs started from the previous pair's flow", name, warm.continued, count)
    if metrics is None:
        return {}
    try:
        return {key: float(value) for key, value in metrics.compute().items()}
    except NothingScoredError as error:
        raise NothingScoredError(f"eval set {name}: {error} in its {count} pairs") from None


def pairs_to_evaluate(dataset: Dataset, name: str, max_samples: int | None) -> int:
    """How many pairs of `dataset` to evaluate: all, or the first eval.max_samples."""
    if max_samples is not None and (max_samples := whole_number(max_samples, "eval.max_samples")) < 1:
        raise ValueError(
            f"eval.max_samples={max_samples}: expected a positive number of pairs per set, or null for every pair"
        )
    count = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    if count == 0:
        raise ValueError(f"eval set {name} is empty; check its dataset root and split")
    return count


def write_submission_item(
    submission_dir: Path, protocol: Protocol, flow: Tensor, item: Mapping[str, Any]
) -> None:
    """A test pair's flow [1,2,H,W] into the benchmark's submission folder, named by the item's meta."""
    folder = submission_folder(submission_dir, protocol)
    submission_writer(protocol.kind)(folder, flow[0].permute(1, 2, 0).cpu().numpy(), item.get("meta", {}))


def score_item(
    metrics: SetMetrics, flow: Tensor, item: Mapping[str, Any], name: str, protocol: Protocol
) -> int:
    """Scores a pair's flow [1,2,H,W] against its ground truth (and valid mask, where the set has one); returns
    how many of its ground-truth pixels are NaN or inf, which no metric counts."""
    if "flow" not in item:
        raise ValueError(
            f"eval set {name} (kind {protocol.kind}) has no ground-truth flow; use a training "
            "split, or kind sintel_submission / kitti_submission for test splits"
        )
    valid = item.get("valid")
    metrics.update(flow.cpu(), item["flow"][None].float(), None if valid is None else valid[None].float())
    return int((~torch.isfinite(item["flow"]).all(dim=0)).sum())


def format_table(results: Mapping[str, Mapping[str, float]], kinds: Mapping[str, str]) -> str:
    """{set: {metric: value}} -> a plain-text table, one row per set (metrics a set lacks are left blank);
    `kinds` ({set: kind}) adds the note on KITTI's averagings when a kitti set is in it."""
    columns: list[str] = []
    for values in results.values():
        columns += [k for k in values if k not in columns]
    width = max([len(name) for name in results] + [3])
    header = f"{'set':<{width}}  " + "  ".join(f"{c:>16}" for c in columns)
    lines = [header, "-" * len(header)]
    for name, values in results.items():
        cells = [
            f"{values[c]:>16.4f}" if c in values and not math.isnan(values[c]) else f"{'':>16}"
            for c in columns
        ]
        if not values:
            cells = [f"{'(submission written)':>16}"]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    if "kitti" in kinds.values():
        lines.append(KITTI_NOTE)
    return "\n".join(lines)


def open_set(name: str, node: Mapping[str, Any]) -> EvalSet:
    """The set `eval.benchmarks.<name>`; a missing dataset tree names the set and the zero-download
    alternative, a setting the set refuses (`iters=0`) names the set."""
    try:
        eval_set = hydra.utils.instantiate(node)
    except Exception as error:  # Hydra wraps the dataset's own error as __cause__
        cause = error.__cause__ or error
        if type(cause) is ValueError:
            raise ValueError(f"eval.benchmarks.{name}: {cause}") from None
        if not isinstance(cause, FileNotFoundError):
            raise
        raise FileNotFoundError(
            f"eval set '{name}': {cause}\n  task=eval: pick the sets whose data you have with eval.sets=[...], "
            "or evaluate on the built-in synthetic pairs with eval=synthetic"
        ) from None
    if not isinstance(eval_set, EvalSet):
        raise TypeError(
            f"eval.benchmarks.{name} must build a flowformer.eval.protocol.EvalSet (copy a conf/eval/sets/ file)"
        )
    if eval_set.iters is None:
        raise ValueError(f"eval.benchmarks.{name}.iters is not set: give its decoder iterations")
    return eval_set


def open_sets(settings: DictConfig) -> dict[str, tuple[Protocol, EvalSet]]:
    """The sets `eval.sets` names, each with its protocol under this run's tiling settings; every set is checked
    (its definition, protocol and dataset tree) before the network is built."""
    benchmarks = settings.benchmarks
    if not settings.sets:
        raise ValueError(f"eval.sets is empty: name the sets to evaluate, of eval.benchmarks {list(benchmarks)}")
    unknown = [name for name in settings.sets if name not in benchmarks]
    if unknown:
        raise ValueError(
            f"eval.sets names {unknown}, which eval.benchmarks does not define; defined: {list(benchmarks)}"
        )
    if settings.warm_start and settings.tile:
        raise ValueError(
            "eval.warm_start=true with eval.tile=true: tiled prediction starts every tile from zero flow and has "
            "no 1/8-resolution flow of the whole image to carry to the next pair; set one of them to false"
        )
    run_settings = {
        "tile": bool(settings.tile),
        "sigma": float(settings.sigma),
        "min_overlap": int(settings.min_overlap),
        "deduplicate_tiles": bool(settings.deduplicate_tiles),
    }
    sets: dict[str, tuple[Protocol, EvalSet]] = {}
    for name in settings.sets:
        eval_set = open_set(name, benchmarks[name])
        try:
            sets[name] = (eval_set.protocol(eval_set.iters, **run_settings), eval_set)
        except ValueError as error:
            raise ValueError(f"eval set {name}: {error}") from None
    return sets


def load_eval_network(cfg: DictConfig, device: torch.device) -> nn.Module:
    """cfg.backbone with eval.checkpoint (random weights, seeded, when it is null), compiled as `runtime` says."""
    torch.manual_seed(cfg.seed)
    checkpoint = cfg.eval.get("checkpoint") or None
    if checkpoint is None:
        log.warning("eval.checkpoint is null: evaluating randomly initialised weights (smoke tests only)")
    net = load_network(cfg.backbone, checkpoint, device, "eval.checkpoint")
    compile_network(net, cfg.runtime)
    return net


def check_eval_workers(setting: object) -> None:
    """eval.num_workers: auto or a count >= 0 (torch's own error names no setting)."""
    if setting == "auto":
        return
    try:
        count_at_least(setting, "eval.num_workers", 0)
    except ValueError:
        raise ValueError(f"eval.num_workers={setting!r}: expected auto or a whole number >= 0") from None


def eval_workers(setting: int | str, device: torch.device) -> int:
    """The DataLoader workers of eval.num_workers for a set evaluated on `device`: `auto` as data.num_workers=auto
    (none on a CPU, whose cores the network keeps busy; on a GPU the cores less one, at most 8)."""
    return auto_workers(device.type) if setting == "auto" else int(setting)


def score_baselines(
    methods: Mapping[str, FlowNet], sets: Mapping[str, tuple[Protocol, EvalSet]], settings: DictConfig
) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {set: metrics}}: each baseline on every scored set, with the set's protocol, on the CPU."""
    return {
        method_name: {
            name: evaluate_set(
                method,
                dataset,
                protocol,
                name=f"{name} ({method_name})",
                device=torch.device("cpu"),
                max_samples=settings.get("max_samples"),
                num_workers=eval_workers(settings.num_workers, torch.device("cpu")),
            )
            for name, (protocol, dataset) in sets.items()
            if not protocol.writes_submission
        }
        for method_name, method in methods.items()
    }


def write_results(
    cfg: DictConfig,
    results: Mapping[str, Mapping[str, float]],
    protocols: Mapping[str, Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Mapping[str, float]]],
) -> None:
    """eval.results_json: the checkpoint, the backbone config, every set's metrics and protocol, and the
    baselines' metrics ({method: {set: metrics}})."""
    output = Path(cfg.eval.results_json)
    record = {
        "checkpoint": cfg.eval.get("checkpoint"),
        "backbone": OmegaConf.to_container(cfg.backbone, resolve=True),
        "results": results,
        "protocol": protocols,
        "baselines": baselines,
        "notes": {"kitti": KITTI_NOTE, "averaging": "see flowformer/metrics.py"},
    }
    atomic_write_text(output, json.dumps(record, indent=2, default=str))
    log.info("wrote %s", output)


def check_outputs(settings: DictConfig, protocols: list[Protocol], submission_dir: Path | None) -> None:
    """Before any work: eval.results_json is not the checkpoint nor a folder, and an existing results file or
    submission folder (sintel/, kitti/) that this run would write is kept unless eval.overwrite=true."""
    results_json = Path(settings.results_json)
    if results_json.is_dir():  # with eval.overwrite=true it failed once every set was evaluated
        raise OutputPathError(
            f"eval.results_json={results_json} is a folder: give the results file's path, e.g. "
            f"eval.results_json={results_json / 'eval_results.json'}"
        )
    if settings.get("checkpoint") and results_json.resolve() == Path(settings.checkpoint).resolve():
        raise OutputPathError(
            f"eval.results_json {results_json} is eval.checkpoint: the results would replace the weights "
            "(also with eval.overwrite=true); choose another eval.results_json"
        )
    refuse_existing([results_json], "eval.results_json", "eval.overwrite", settings.overwrite)
    if submission_dir is None:
        return
    folders = sorted({submission_folder(submission_dir, p) for p in protocols if p.writes_submission})
    submitted = [path for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()]
    refuse_existing(submitted, "eval.submission_dir", "eval.overwrite", settings.overwrite)


def run(cfg: DictConfig) -> float | None:
    """task=eval: `evaluate`, which a stop signal (Ctrl-C, SIGTERM, SIGUSR1) ends at once with one line: the
    results file is written once every set is evaluated, so it is not begun."""

    def stopped(signum: signal.Signals) -> str:
        submission = Path(cfg.eval.get("submission_dir") or "")
        again = "run it again"
        if submission.name and submission.is_dir() and any(submission.iterdir()):
            again += f" with eval.overwrite=true (a submission was begun in {submission})"
        return f"task=eval stopped by {signum.name}: {cfg.eval.results_json} is not written; {again}"

    with stopping_at_once(stopped):
        return evaluate(cfg)


def evaluate(cfg: DictConfig) -> float | None:
    """Scores the checkpoint on every set of cfg.eval (module docstring); writes eval.results_json."""
    settings = cfg.eval
    sets = open_sets(settings)
    methods = baseline_methods(settings.get("baselines") or [])
    check_eval_workers(settings.num_workers)
    ensure_writable_dir(Path(settings.results_json).parent, "the folder of eval.results_json")
    submission_dir = None
    if settings.get("submission_dir"):
        submission_dir = ensure_writable_dir(settings.submission_dir, "eval.submission_dir")
    check_outputs(settings, [protocol for protocol, _ in sets.values()], submission_dir)
    device = pick_device(settings.device, "eval.device")
    net = load_eval_network(cfg, device)

    results: dict[str, dict[str, float]] = {}
    protocols: dict[str, dict[str, Any]] = {}
    workers = eval_workers(settings.num_workers, device)
    read_by = f"read by {workers} loader worker{'s' * (workers > 1)}" if workers else "read in this process"
    for name, (protocol, dataset) in sets.items():
        count = pairs_to_evaluate(dataset, name, settings.get("max_samples"))
        log.info("evaluating %s (%d of its %d pairs, %s): %s", name, count, len(dataset), read_by, protocol)
        results[name] = evaluate_set(
            net,
            dataset,
            protocol,
            name=name,
            device=device,
            precision=settings.precision,
            max_samples=count,
            num_workers=workers,
            submission_dir=submission_dir,
            warm_start=settings.warm_start,
        )
        protocols[name] = {
            **asdict(protocol),
            "pairs": count,
            "pairs_in_set": len(dataset),
            "warm_start": settings.warm_start,
        }

    baselines = score_baselines(methods, sets, settings)
    rows = dict(results)
    for method, scores in baselines.items():
        rows |= {f"{name} ({method})": values for name, values in scores.items()}
    print(format_table(rows, {name: protocol.kind for name, (protocol, _) in sets.items()}))
    write_results(cfg, results, protocols, baselines)
    return next((values["epe"] for values in results.values() if "epe" in values), None)

"""task=eval: evaluate a checkpoint on the benchmark sets with the official protocol (SPEC §7).

    python run.py task=eval backbone=flowformer eval.checkpoint=checkpoints/things.pth
    python run.py task=eval backbone=flowformer eval=flowformer eval.tile=true            # tiled (SPEC §7.3)
    python run.py task=eval backbone=flowformer_pp eval=flowformer_pp eval.checkpoint=sintel.pth
    python run.py task=eval backbone=tiny eval=synthetic                                   # no downloads
    python run.py task=eval backbone=flowformer eval.checkpoint=sintel.pth \
        eval.sets=[sintel_test_clean,sintel_test_final] eval.tile=true                      # Sintel submission

The checkpoint may be ours, an official .pth (with or without `module.`) or a Lightning .ckpt; it must fit
the chosen backbone config. Each entry of `eval.benchmarks` names a dataset and its protocol:

- `kind`: `sintel` (pixel-pooled EPE over all pixels, no valid mask as in the official code, 1/3/5 px and the
  s0-10 / s10-40 / s40+ speed split), `kitti` (EPE and F1-all over the valid pixels, per-image and
  pixel-pooled, labelled), `flow` (pixel-pooled EPE, 1/3/5 px, F1-all over the valid pixels: chairs,
  synthetic), `sintel_submission` / `kitti_submission` (test sets: write .flo trees / 16-bit PNGs);
- `iters`: decoder iterations (FF: 32 Sintel, 24 KITTI; FF++: 12; SPEC §7, §9.1.10);
- `pad_mode`: the non-tiled padding (flowformer/eval/padding.py; the official script uses `sintel`);
- `tile_size`, `tile_pad_mode`: the Gaussian-tiling protocol used when `eval.tile` is true (zero padding).

Writes `eval.results_json` and prints a table; returns the first set's headline EPE (for sweepers).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from flowformer.eval.padding import InputPadder
from flowformer.eval.tiling import FlowFn, tiled_flow
from flowformer.metrics import FlowMetrics, KittiMetrics, SpeedBinnedEPE
from flowformer.tasks.run_dirs import ensure_writable_dir
from flowformer.tasks.runtime import autocast_context, load_network, pick_device

log = logging.getLogger(__name__)

KINDS = ("sintel", "kitti", "flow", "sintel_submission", "kitti_submission")
# the value run() returns for sweepers, per kind: the official kitti-epe is per image (SPEC §7.1)
HEADLINE = {"sintel": "epe", "flow": "epe", "kitti": "epe_per_image"}
PROTOCOL_KEYS = {"kind", "iters", "pad_mode", "tile_size", "tile_pad_mode", "dataset"}
KITTI_NOTE = (
    "kitti: official kitti-epe = epe_per_image (per-image mean), kitti-f1 = f1_all_pooled (per pixel)"
)


@dataclass(frozen=True)
class Protocol:
    """How one benchmark set is evaluated (one entry of `eval.benchmarks`, minus its dataset)."""

    name: str
    kind: str
    iters: int
    pad_mode: str = "sintel"
    tile_size: tuple[int, int] | None = None
    tile_pad_mode: str | None = None

    @classmethod
    def from_config(cls, name: str, node: Mapping[str, Any]) -> Protocol:
        unknown = sorted(set(node) - PROTOCOL_KEYS)
        if unknown:
            raise ValueError(
                f"eval.benchmarks.{name} has unknown keys {unknown}; expected {sorted(PROTOCOL_KEYS)}"
            )
        kind = node.get("kind")
        if kind not in KINDS:
            raise ValueError(f"eval.benchmarks.{name}.kind={kind!r}: expected one of {', '.join(KINDS)}")
        tile = node.get("tile_size")
        return cls(
            name=name,
            kind=kind,
            iters=int(node.get("iters", 12)),
            pad_mode=str(node.get("pad_mode", "sintel")),
            tile_size=None if tile is None else (int(tile[0]), int(tile[1])),
            tile_pad_mode=node.get("tile_pad_mode"),
        )


def predict_flow(
    flow_fn: FlowFn,
    image1: Tensor,
    image2: Tensor,
    protocol: Protocol,
    *,
    tile: bool = False,
    sigma: float = 0.05,
    min_overlap: int = 20,
    deduplicate_tiles: bool = False,
) -> Tensor:
    """Full-resolution flow of [B,3,H,W] images -> [B,2,H,W] (fp32) with the protocol's padding or tiling.

    flow_fn(image1, image2) runs the network on padded [B,3,H',W'] images and returns its `flow` [B,2,H',W'].
    """
    if not tile:
        padder = InputPadder(image1.shape, mode=protocol.pad_mode)
        return padder.unpad(flow_fn(*padder.pad(image1, image2))).float()
    if protocol.tile_size is None:
        raise ValueError(
            f"eval.tile=true but eval.benchmarks.{protocol.name}.tile_size is not set; give the tile size, "
            "e.g. [432, 960] (SPEC §7.3)"
        )
    # the official Sintel and FF++ KITTI protocols tile the image as it is (tile_pad_mode null)
    padder = (
        InputPadder(image1.shape, mode=protocol.tile_pad_mode, fill="zeros")
        if protocol.tile_pad_mode
        else None
    )
    padded = padder.pad(image1, image2) if padder else (image1, image2)
    flow = tiled_flow(
        flow_fn,
        *padded,
        tile_size=protocol.tile_size,
        sigma=sigma,
        min_overlap=min_overlap,
        deduplicate=deduplicate_tiles,
    )
    return padder.unpad(flow) if padder else flow


class BenchmarkMetrics:
    """The metrics of one set: `update(pred, gt, valid)` per image and `compute()` -> {name: float}."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "sintel":
            self.metrics: list[Any] = [FlowMetrics(), SpeedBinnedEPE()]
        elif kind == "kitti":
            self.metrics = [KittiMetrics()]
        else:
            self.metrics = [FlowMetrics()]

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor | None) -> None:
        if self.kind == "sintel":
            valid = None  # validate_sintel averages over every pixel (SPEC §7.1)
        elif valid is None:
            raise ValueError(f"a '{self.kind}' benchmark needs `valid` in every dataset item")
        for metric in self.metrics:
            metric.update(pred, gt, valid)

    def compute(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for metric in self.metrics:
            values.update({k: float(v) for k, v in metric.compute().items()})
        if self.kind == "sintel":
            values.pop("f1_all")  # not a Sintel metric
        return values


def submission_writer(kind: str) -> Callable[[Path, Any, Mapping[str, Any]], None]:
    """(out_dir, flow [H,W,2] numpy, item meta) -> writes one test pair's flow in the benchmark's layout."""
    from flowformer.eval import submission

    return submission.write_sintel_item if kind == "sintel_submission" else submission.write_kitti_item


def _single(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader collate for batch_size 1: the item itself (images of a set may differ in size)."""
    return batch[0]


def evaluate_set(
    net: nn.Module,
    dataset: Dataset,
    protocol: Protocol,
    *,
    device: torch.device,
    precision: str = "32-true",
    tile: bool = False,
    sigma: float = 0.05,
    min_overlap: int = 20,
    deduplicate_tiles: bool = False,
    max_samples: int | None = None,
    num_workers: int = 0,
    submission_dir: Path | None = None,
) -> dict[str, float]:
    """Runs `net` (eval mode, B = 1 as the official scripts) over `dataset` and returns the set's metrics
    (an empty dict for submission sets, which write `submission_dir`/sintel/<pass>/<scene>/frame%04d.flo or
    `submission_dir`/kitti/<frame_id> instead, SPEC §7.4)."""
    is_submission = protocol.kind.endswith("_submission")
    if is_submission and submission_dir is None:
        raise ValueError(f"eval set {protocol.name} writes a submission; set eval.submission_dir")
    write_item = submission_writer(protocol.kind) if is_submission else None
    metrics = None if is_submission else BenchmarkMetrics(protocol.kind)
    count = len(dataset) if max_samples is None else min(len(dataset), int(max_samples))
    if count == 0:
        raise ValueError(f"eval set {protocol.name} is empty; check its dataset root and split")
    loader = DataLoader(
        torch.utils.data.Subset(dataset, range(count)),
        batch_size=1,
        num_workers=num_workers,
        collate_fn=_single,
    )

    def flow_fn(image1: Tensor, image2: Tensor) -> Tensor:
        with autocast_context(device, precision, "eval.precision"):
            return net(image1, image2, iters=protocol.iters)["flow"]

    for index, item in enumerate(loader):
        image1 = item["img1"][None].to(device)  # [1,3,H,W]
        image2 = item["img2"][None].to(device)
        with torch.inference_mode():
            flow = predict_flow(
                flow_fn,
                image1,
                image2,
                protocol,
                tile=tile,
                sigma=sigma,
                min_overlap=min_overlap,
                deduplicate_tiles=deduplicate_tiles,
            )
        if write_item is not None:
            family = protocol.kind.removesuffix("_submission")
            write_item(submission_dir / family, flow[0].permute(1, 2, 0).cpu().numpy(), item.get("meta", {}))
        else:
            if "flow" not in item:
                raise ValueError(
                    f"eval set {protocol.name} (kind {protocol.kind}) has no ground-truth flow; use a training "
                    "split, or kind sintel_submission / kitti_submission for test splits"
                )
            valid = item.get("valid")
            metrics.update(
                flow.cpu(), item["flow"][None].float(), None if valid is None else valid[None].float()
            )
        if (index + 1) % 100 == 0:
            log.info("%s: %d / %d", protocol.name, index + 1, count)
    return {} if metrics is None else metrics.compute()


def format_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """{set: {metric: value}} -> a plain-text table, one row per set (metrics a set lacks are left blank)."""
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
    if any("epe_per_image" in values for values in results.values()):
        lines.append(KITTI_NOTE)
    return "\n".join(lines)


def open_dataset(name: str, node: Mapping[str, Any]) -> Dataset:
    """The set's dataset; a missing dataset tree names the set and the zero-download alternative."""
    try:
        return hydra.utils.instantiate(node["dataset"])
    except Exception as error:  # Hydra wraps the dataset's own error as __cause__
        cause = error.__cause__ or error
        if not isinstance(cause, FileNotFoundError):
            raise
        raise FileNotFoundError(
            f"eval set '{name}': {cause}\n  task=eval: pick the sets whose data you have with eval.sets=[...], "
            "or evaluate on the built-in synthetic pairs with eval=synthetic"
        ) from None


def run(cfg: DictConfig) -> float | None:
    settings = cfg.eval
    benchmarks = settings.benchmarks
    unknown = [name for name in settings.sets if name not in benchmarks]
    if unknown:
        raise ValueError(
            f"eval.sets names {unknown}, which eval.benchmarks does not define; defined: {list(benchmarks)}"
        )
    # every set is checked (protocol and dataset tree) before the network is built
    sets = {
        name: (Protocol.from_config(name, benchmarks[name]), open_dataset(name, benchmarks[name]))
        for name in settings.sets
    }
    ensure_writable_dir(Path(settings.results_json).parent, "the folder of eval.results_json")
    submission_dir = None
    if settings.get("submission_dir"):
        submission_dir = ensure_writable_dir(settings.submission_dir, "eval.submission_dir")
    device = pick_device(settings.device)
    torch.manual_seed(cfg.seed)
    checkpoint = settings.get("checkpoint") or None
    if checkpoint is None:
        log.warning("eval.checkpoint is null: evaluating randomly initialised weights (smoke tests only)")
    net = load_network(cfg.backbone, checkpoint, device)

    results: dict[str, dict[str, float]] = {}
    protocols: dict[str, dict[str, Any]] = {}
    for name, (protocol, dataset) in sets.items():
        log.info("evaluating %s (%d pairs): %s, tile=%s", name, len(dataset), protocol, settings.tile)
        results[name] = evaluate_set(
            net,
            dataset,
            protocol,
            device=device,
            precision=settings.precision,
            tile=settings.tile,
            sigma=settings.sigma,
            min_overlap=settings.min_overlap,
            deduplicate_tiles=settings.deduplicate_tiles,
            max_samples=settings.get("max_samples"),
            num_workers=settings.num_workers,
            submission_dir=submission_dir,
        )
        protocols[name] = {**asdict(protocol), "tile": bool(settings.tile), "pairs": len(dataset)}

    table = format_table(results)
    print(table)
    output = Path(settings.results_json)
    record = {
        "checkpoint": settings.get("checkpoint"),
        "backbone": OmegaConf.to_container(cfg.backbone, resolve=True),
        "results": results,
        "protocol": protocols,
        "notes": {"kitti": KITTI_NOTE, "averaging": "see flowformer/metrics.py"},
    }
    output.write_text(json.dumps(record, indent=2, default=str))
    log.info("wrote %s", output)
    for name, values in results.items():
        headline = HEADLINE.get(benchmarks[name].kind)
        if headline in values:
            return values[headline]
    return None

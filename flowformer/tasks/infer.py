"""task=infer: optical flow for an image pair, a folder of frames or a video file.

    python run.py task=infer backbone=flowformer infer.checkpoint=sintel.pth infer.input=[a.png,b.png]
    python run.py task=infer backbone=flowformer_pp infer.checkpoint=last.ckpt infer.input=frames/
    python run.py task=infer backbone=flowformer infer.checkpoint=things.pth infer.input=clip.mp4 infer.format=kitti

Each consecutive pair (i, i+1) gives `<name of frame i>.flo` (or a KITTI 16-bit `.png`) and, with
`infer.save_png`, a Middlebury colour-wheel picture `<name>_flow.png` in `infer.output_dir`. Any image size
works: inputs are padded to a multiple of 8 and the flow cropped back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import torch
from omegaconf import DictConfig, ListConfig
from rich.progress import track

from flowformer.data.io import FlowFileError, read_image, write_flo, write_kitti_flow
from flowformer.eval.padding import InputPadder
from flowformer.tasks.run_dirs import ensure_writable_dir
from flowformer.tasks.runtime import load_network, pick_device
from flowformer.viz import flow_to_color

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm", ".bmp", ".tif", ".tiff", ".webp")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg")


def list_frames(source: str | list[str]) -> tuple[list[str], Iterator[np.ndarray], int]:
    """infer.input -> (frame names, an iterator of uint8 [H,W,3] RGB frames, number of frames)."""
    if isinstance(source, (list, tuple, ListConfig)):
        paths = [Path(p) for p in source]
        if len(paths) < 2:
            raise ValueError(f"infer.input lists {len(paths)} image(s); give at least two, e.g. [a.png,b.png]")
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(
                f"infer.input={source!r} does not exist; give [img1,img2], a folder of frames or a video file"
            )
        if path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES:
            return video_frames(path)
        if not path.is_dir():
            raise ValueError(
                f"infer.input={source!r} is neither a folder of frames nor a video ({', '.join(VIDEO_SUFFIXES)})"
            )
        paths = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if len(paths) < 2:
            raise ValueError(
                f"infer.input folder {path} holds {len(paths)} image(s) with suffix {', '.join(IMAGE_SUFFIXES)}; "
                "it needs at least two frames"
            )
    return [p.stem for p in paths], (read_image(p) for p in paths), len(paths)


def video_frames(path: Path) -> tuple[list[str], Iterator[np.ndarray], int]:
    capture = cv2.VideoCapture(str(path))
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    if not capture.isOpened() or count < 2:
        raise FlowFileError(path, f"OpenCV cannot read it as a video with at least two frames (got {count})")

    def frames() -> Iterator[np.ndarray]:
        try:
            while True:
                ok, frame = capture.read()
                if not ok:
                    return
                yield cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        finally:
            capture.release()

    return [f"frame_{i:06d}" for i in range(count)], frames(), count


def to_tensor(image: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 [H,W,3] -> float [1,3,H,W] in 0..255."""
    return torch.from_numpy(image).permute(2, 0, 1).float()[None].to(device)


def run(cfg: DictConfig) -> None:
    settings = cfg.infer
    if settings.format not in ("flo", "kitti"):
        raise ValueError(f"infer.format={settings.format!r}: expected 'flo' or 'kitti'")
    if not settings.checkpoint:
        raise ValueError(
            "infer.checkpoint is null; give the weights to run (ours, an official .pth or a Lightning .ckpt)"
        )
    names, frames, count = list_frames(settings.input)
    output_dir = ensure_writable_dir(settings.output_dir, "the flow output directory (infer.output_dir)")
    device = pick_device(settings.device)
    net = load_network(cfg.backbone, settings.checkpoint, device)

    previous = to_tensor(next(frames), device)
    for index, frame in enumerate(track(frames, total=count - 1, description="flow"), start=0):
        current = to_tensor(frame, device)
        if current.shape != previous.shape:
            raise ValueError(
                f"infer.input: frame {names[index + 1]} is {tuple(current.shape[-2:])}, but frame "
                f"{names[index]} is {tuple(previous.shape[-2:])}; all frames must have one size"
            )
        padder = InputPadder(previous.shape, mode=settings.pad_mode)
        with torch.inference_mode():
            output = net(*padder.pad(previous, current), iters=settings.iters)
        flow = padder.unpad(output["flow"])[0].permute(1, 2, 0).float().cpu().numpy()  # [H,W,2]
        stem = output_dir / names[index]
        if settings.format == "flo":
            write_flo(stem.with_suffix(".flo"), flow)
        else:
            write_kitti_flow(stem.with_suffix(".png"), flow)
        if settings.save_png:
            picture = flow_to_color(flow)  # uint8 [H,W,3] RGB
            cv2.imwrite(str(output_dir / f"{names[index]}_flow.png"), cv2.cvtColor(picture, cv2.COLOR_RGB2BGR))
        previous = current
    log.info("wrote %d flow fields to %s", count - 1, output_dir)

"""task=infer: optical flow for an image pair, a folder of frames or a video file.

    python run.py task=infer backbone=flowformer infer.checkpoint=sintel.pth infer.input=[a.png,b.png]
    python run.py task=infer backbone=flowformer_pp infer.checkpoint=last.ckpt infer.input=frames/
    python run.py task=infer backbone=flowformer infer.checkpoint=things.pth infer.input=clip.mp4 infer.format=kitti

Each consecutive pair (i, i+1) gives `<name of frame i>.flo` (or a KITTI 16-bit `.png`) and, with
`infer.save_png`, a Middlebury colour-wheel picture `<name>_flow.png` in `infer.output_dir`; with
`infer.save_video`, the colour-coded flow of every pair also goes to `flow.mp4` there. Outputs that exist
already are refused before any work unless `infer.overwrite=true`; `infer.output_dir` is never the input
folder and an output never replaces an input, with or without it. A run holds `infer.output_dir` while it
writes there (`claim_output_dir`): a second run given the same folder meanwhile is refused. Any image size works:
inputs are padded to a multiple of 8 and the flow cropped back. Frames are decoded one at a time, and the
progress bar shows pairs per second. Prediction is task=eval's (`flowformer/eval/protocol.py`,
`Protocol.predict`) with `infer.iters` iterations and `infer.pad_mode` padding.

`infer.warm_start=true` starts each pair's refinement from the previous pair's 1/8-resolution flow, projected
forward along itself (`flowformer/eval/protocol.py`, `WarmStart`), as task=eval's `eval.warm_start` does.
`infer.precision=auto` runs bf16 autocast on a GPU and fp32 on the CPU. Memory is bounded by default: with
`backbone.memory_budget_gb` auto, infer plans for half of the device's free memory (flowformer/device_settings.py,
`choose_memory_budget`), which keeps the dense computation whenever it fits; a number sets the budget, null
keeps the dense computation.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import cv2
import numpy as np
import torch
from omegaconf import DictConfig, ListConfig
from torch import nn

from flowformer.data.io import (
    IMAGE_SUFFIXES,
    FlowFileError,
    image_header,
    read_image,
    write_flo,
    write_image,
    write_kitti_flow,
)
from flowformer.data.video_datasets import VIDEO_SUFFIXES, image_frames, stated_frame_count
from flowformer.eval.padding import InputPadder
from flowformer.eval.protocol import Protocol, WarmStart, check_pad_mode, require_finite_flow
from flowformer.setting_types import whole_number
from flowformer.stop_signals import StoppedBySignal, StopSignals
from flowformer.tasks.run_dirs import OutputPathError, ensure_writable_dir, refuse_existing, run_owner
from flowformer.tasks.runtime import (
    InferenceContext,
    compile_network,
    load_network,
    pair_progress,
    pick_device,
)
from flowformer.viz import flow_to_color

log = logging.getLogger(__name__)

VIDEO_NAME = "flow.mp4"  # the colour-coded flow of every pair, in infer.output_dir
CLAIM_FILE = ".infer_claim"  # in infer.output_dir while a run writes there (claim_output_dir)


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
        paths = image_frames(path)
        if len(paths) < 2:
            raise ValueError(
                f"infer.input folder {path} holds {len(paths)} image(s) with suffix {', '.join(IMAGE_SUFFIXES)}; "
                "it needs at least two frames"
            )
    check_frame_sizes(paths)
    return [p.stem for p in paths], (read_image(p) for p in paths), len(paths)


def check_frame_sizes(paths: list[Path]) -> None:
    """The image frames of infer.input, checked from their headers before the network is built (a folder's
    odd frame was found only when its pair came, after the flows before it): each must be an 8-bit image
    (where its header says otherwise, its decoding gives the error, naming the file), and all of one size."""
    sizes: dict[tuple[int, int], list[str]] = {}
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"infer.input: {path} is not a file; give [img1,img2,...], a folder or a video")
        header = image_header(path)
        if header is None or not header[2]:  # read_image says what is wrong; a format PIL cannot read may decode
            height, width = read_image(path).shape[:2]
        else:
            height, width = header[:2]
        sizes.setdefault((height, width), []).append(path.name)
    if len(sizes) > 1:
        listed = " and ".join(
            f"{height}x{width} ({len(names)} frame{'s' * (len(names) > 1)}: {', '.join(names[:3])}"
            f"{', ...' * (len(names) > 3)})"
            for (height, width), names in sizes.items()
        )
        raise ValueError(
            f"infer.input: its frames have {len(sizes)} sizes, {listed}; a pair's flow needs both frames at one "
            "size: resize the frames, or give the frames of one size"
        )


def video_frames(path: Path) -> tuple[list[str], Iterator[np.ndarray], int]:
    """A video file's frame names (frame_000000, ...), its frames read in order, and their number: the number
    its container states, or, where it states none (a WebM without a duration), counted by reading it once."""
    capture = cv2.VideoCapture(str(path))
    count = (stated_frame_count(capture) or count_frames(path)) if capture.isOpened() else 0
    if count < 2:
        capture.release()
        raise FlowFileError(path, f"OpenCV cannot read it as a video with at least two frames (got {count})")

    def frames() -> Iterator[np.ndarray]:
        try:
            for _ in range(count):
                ok, frame = capture.read()
                if not ok:
                    return
                yield cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            if capture.grab():
                log.warning("%s has more frames than the %d its container states: the rest are not read", path, count)
        finally:
            capture.release()

    return [f"frame_{i:06d}" for i in range(count)], frames(), count


def count_frames(path: Path) -> int:
    """The frames of a video file, counted by reading it through (without converting them)."""
    capture = cv2.VideoCapture(str(path))
    count = 0
    while capture.grab():
        count += 1
    capture.release()
    return count


def to_tensor(image: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 [H,W,3] -> float [1,3,H,W] in 0..255."""
    return torch.from_numpy(image).permute(2, 0, 1).float()[None].to(device)


def output_paths(settings: DictConfig, output_dir: Path, name: str) -> tuple[Path, Path]:
    """Where the pair that starts at frame `name` goes: its flow (`<name>.flo`, or `<name>.png` in KITTI's
    format) and its colour picture (`<name>_flow.png`)."""
    suffix = ".flo" if settings.format == "flo" else ".png"
    return output_dir / f"{name}{suffix}", output_dir / f"{name}_flow.png"


def check_outputs(settings: DictConfig, names: list[str], output_dir: Path) -> None:
    """Before any work: no two pairs' outputs share a name, the outputs never replace an input, the output folder
    is not the input folder (a later run would read the flow pictures as frames), and an earlier run's outputs
    are kept unless infer.overwrite=true."""
    sources = settings.input if isinstance(settings.input, (list, tuple, ListConfig)) else [settings.input]
    inputs = {Path(source).resolve() for source in sources}
    if output_dir.resolve() in inputs:
        raise OutputPathError(
            f"infer.output_dir {output_dir} is the input folder: a later run would read the flow pictures as "
            "frames, and KITTI .png flow would replace frames; choose another infer.output_dir"
        )
    shared = [name for name, starts in Counter(names[:-1]).items() if starts > 1]
    if shared:
        raise ValueError(
            f"infer.input: {len(shared)} name(s) start more than one pair ({', '.join(shared[:3])}: frames whose names "
            "differ only in their suffix or folder), and each pair's outputs are named by its first frame, so one "
            "would replace another; rename the frames so that their names without suffix differ"
        )
    outputs = []
    for name in names[:-1]:
        flow_path, picture_path = output_paths(settings, output_dir, name)
        outputs += [flow_path, picture_path] if settings.save_png else [flow_path]
    if settings.save_video:
        outputs.append(output_dir / VIDEO_NAME)
    if clash := next((path for path in outputs if path.resolve() in inputs), None):
        raise OutputPathError(
            f"infer.output_dir: the output {clash} would replace that input (also with infer.overwrite=true); "
            "choose another infer.output_dir"
        )
    refuse_existing(outputs, "infer.output_dir", "infer.overwrite", settings.overwrite)


def check_settings(settings: DictConfig) -> None:
    """The infer settings that no input can fix, refused before any work."""
    if settings.format not in ("flo", "kitti"):
        raise ValueError(f"infer.format={settings.format!r}: expected 'flo' or 'kitti'")
    if whole_number(settings.iters, "infer.iters") < 1:
        raise ValueError(f"infer.iters={settings.iters}: the decoder iterations must be >= 1")
    check_pad_mode(settings.pad_mode, "infer.pad_mode")
    if settings.save_video and not settings.video_fps > 0:
        raise ValueError(
            f"infer.video_fps={settings.video_fps}: expected frames per second > 0 (or infer.save_video=false)"
        )
    if not settings.checkpoint:
        raise ValueError(
            "infer.checkpoint is null; give the weights to run (ours, an official .pth or a Lightning .ckpt)"
        )


def prepare_network(cfg: DictConfig) -> tuple[torch.device, InferenceContext, nn.Module]:
    """(device, inference context (`InferenceContext`), the network loaded from infer.checkpoint, bounded and
    compiled as set)."""
    settings = cfg.infer
    device = pick_device(settings.device, "infer.device")
    precision = settings.precision
    if precision == "auto":
        precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    inference = InferenceContext(device, precision, "infer.precision")
    net = load_network(cfg.backbone, settings.checkpoint, device, "infer.checkpoint")
    compile_network(net, cfg.runtime)
    return device, inference, net


@contextmanager
def claim_output_dir(output_dir: Path) -> Iterator[None]:
    """infer.output_dir is this run's alone while it writes there: it holds an exclusive lock (flock) on the
    folder's CLAIM_FILE, which the system drops when the process ends however it ends (a kill -9 too), so of two
    runs given one folder at the same time the second is refused. The file goes when the run ends."""
    path = output_dir / CLAIM_FILE
    while True:
        claim = open(path, "a+")  # noqa: SIM115 - held open, and locked, until the run ends
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            claim.seek(0)
            holder = claim.read().strip() or "another process"
            claim.close()
            raise OutputPathError(
                f"infer.output_dir {output_dir} is being written by another task=infer run ({holder}); wait for "
                "it to end or choose another infer.output_dir"
            ) from None
        except OSError as error:  # a file system without locks: run, unguarded
            reason = error.strerror or error
            log.warning(
                "infer.output_dir %s cannot be locked (%s): a second run into it is not refused", output_dir, reason
            )
            break
        if path.exists() and os.path.samefile(path, claim.fileno()):
            break
        claim.close()  # the file was removed by the run that held it before this one locked it: lock the new one
    try:
        claim.truncate(0)
        claim.write(run_owner(output_dir))
        claim.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        claim.close()


def run(cfg: DictConfig) -> None:
    settings = cfg.infer
    check_settings(settings)
    names, frames, count = list_frames(settings.input)
    output_dir = ensure_writable_dir(settings.output_dir, "the flow output directory (infer.output_dir)")
    with claim_output_dir(output_dir):
        check_outputs(settings, names, output_dir)
        pairs = predict_pairs(cfg, names, frames, count, output_dir)
    report_pairs(settings.input, pairs, count, output_dir)


def predict_pairs(
    cfg: DictConfig, names: list[str], frames: Iterator[np.ndarray], count: int, output_dir: Path
) -> int:
    """The flow of each consecutive pair of `frames` (`names`, `count` of them) into `output_dir`, as
    infer.* says; returns the number of pairs written."""
    settings = cfg.infer
    device, inference, net = prepare_network(cfg)
    protocol = Protocol(iters=settings.iters, pad_mode=settings.pad_mode)  # task=eval's padding, no scoring

    video = None
    first = next(frames, None)
    if first is None:
        raise ValueError(f"infer.input {settings.input}: not one frame could be decoded, so no flow was written")
    check_network_takes(net, first.shape[:2], protocol)
    previous = to_tensor(first, device)
    pairs = 0
    warm_start = WarmStart() if settings.warm_start else None
    kept = inference.keeping_weight_casts()
    with pair_progress() as progress, StopSignals() as stop, ExitStack() as on_exit, kept:
        for index, frame in enumerate(progress.track(frames, total=count - 1, description="flow")):
            if stop.received:  # a stop signal: the pairs done are complete, flow.mp4 is closed on exit
                raise StoppedBySignal(
                    stop.received,
                    f"task=infer stopped by {stop.received.name} after {index} of {count - 1} pairs: their "
                    f"outputs are in {output_dir}",
                )
            current = to_tensor(frame, device)
            if current.shape != previous.shape:  # a video's frames (image frames are checked before: check_frame_sizes)
                raise ValueError(
                    f"infer.input: frame {names[index + 1]} is {tuple(current.shape[-2:])}, but frame "
                    f"{names[index]} is {tuple(previous.shape[-2:])}; all frames must have one size"
                )
            with inference:
                if warm_start is None:
                    output = protocol.predict(net, previous, current)
                else:  # the frames are one sequence
                    output = warm_start.predict(protocol, net, previous, current, {"frame": index})
            require_finite_flow(output["flow"], f"infer.input pair {names[index]} -> {names[index + 1]}")
            flow = output["flow"][0].permute(1, 2, 0).cpu().numpy()  # [H,W,2]
            flow_path, picture_path = output_paths(settings, output_dir, names[index])
            if settings.format == "flo":
                write_flo(flow_path, flow)
            else:
                write_kitti_flow(flow_path, flow)
            picture = flow_to_color(flow)  # uint8 [H,W,3] RGB
            if settings.save_png:
                write_image(picture_path, picture)
            if settings.save_video:
                if video is None:
                    video = open_video(output_dir / VIDEO_NAME, settings.video_fps, picture.shape)
                    on_exit.callback(video.release)  # also on an error or a stop: playable, with the pairs done
                video.write(cv2.cvtColor(picture, cv2.COLOR_RGB2BGR))
            previous = current
            pairs += 1
    return pairs


def check_network_takes(net: nn.Module, size: tuple[int, int], protocol: Protocol) -> None:
    """Frames of `size` (height, width), padded as `protocol` pads them, refused before the first flow where they
    are smaller than the network takes (`FlowFormer.smallest_image`): the network's own line would give the
    padded size, which is not the frames'."""
    padding = InputPadder(size, mode=protocol.pad_mode).padding  # (left, right, top, bottom)
    padded = (size[0] + padding[2] + padding[3], size[1] + padding[0] + padding[1])
    side, part = net.smallest_image()
    if min(padded) < side:
        raise ValueError(
            f"infer.input: its frames are {size[0]}x{size[1]} pixels ({padded[0]}x{padded[1]} once padded by "
            f"infer.pad_mode={protocol.pad_mode}), smaller than the {side}x{side} that {part} of this network "
            "needs; upscale the frames"
        )


def report_pairs(source: object, pairs: int, count: int, output_dir: Path) -> None:
    """Logs the flow fields written; a video that decoded fewer frames than it declares is said so, and one
    that gave no pair at all is an error (nothing is reported that did not happen)."""
    if pairs == 0:
        raise ValueError(f"infer.input {source}: fewer than two frames could be decoded, so no flow was written")
    if pairs < count - 1:
        log.warning("infer.input %s: only %d of its %d frames could be decoded", source, pairs + 1, count)
    log.info("wrote %d flow fields to %s", pairs, output_dir)


def open_video(path: Path, fps: float, shape: tuple[int, ...]) -> cv2.VideoWriter:
    """An mp4 (MPEG-4 Part 2, which OpenCV's bundled FFmpeg writes everywhere) for [H, W, 3] BGR frames."""
    height, width = shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise OSError(f"OpenCV cannot write the flow video {path}; set infer.save_video=false")
    return writer

"""Unlabeled video pairs for MCVA pretraining: YouTube-VOS (FlowFormer++ ``core/pretrain_maemask_datasets.py``)
and any folder of videos or frames.

Items are ``img1``, ``img2`` float32 [3, H, W] in 0..255 and ``meta`` (``dataset``, ``name``, ``video``,
``frame1``, ``frame2``); there is no flow. The MCVA mask is drawn by the model on the fly, not read from the
official pre-generated ``mae_mask/*.npy`` files (docs/departures.md).

As in the official loader, a pair that cannot be used (a frame fails to read, the two sizes differ, or the
image is smaller than the augmentor's crop) is skipped for the next index, with a warning; after
``max_skips`` consecutive failures the last problem is raised (a FlowFileError naming that file).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import cv2
import numpy as np
from torch.utils.data import Dataset

from flowformer.data.datasets import DatasetRootError, to_chw
from flowformer.data.io import IMAGE_SUFFIXES, FlowFileError, image_header, read_image
from flowformer.data.sampling import SampleKey, unpack_item
from flowformer.data.transforms import ImagePairAugmentor, WorkerRNG
from flowformer.setting_types import count_at_least

__all__ = ["VideoFolder", "YouTubeVOS", "pair_indices"]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg")
NUMBER = re.compile(r"(\d+)")


def frame_order(path: Path) -> tuple[list[str | int], str]:
    """The key that puts a folder's frames in time order: names compared with their numbers as numbers, so that
    `2.png` comes before `10.png` (frames written as `%d.png`, which a plain sort would pair 1 -> 10 -> 100);
    zero-padded names (`00009.jpg`, `frame_0001.png`) keep their order."""
    parts = NUMBER.split(path.name)  # text, number, text, ...: every key has text at even and numbers at odd places
    return [int(part) if index % 2 else part for index, part in enumerate(parts)], path.name


def image_frames(folder: Path) -> list[Path]:
    """The image files of `folder` (IMAGE_SUFFIXES), in time order (`frame_order`)."""
    frames = (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return sorted(frames, key=frame_order)


def check_pair_spacing(frame_gap: int, stride: int) -> None:
    """A pretraining video set's pair spacing (data.train.frame_gap, data.train.stride): whole numbers >= 1."""
    count_at_least(frame_gap, "data.train.frame_gap", 1)
    count_at_least(stride, "data.train.stride", 1)


def pair_indices(
    num_frames: int, *, frame_gap: int, stride: int, both_directions: bool, end: int | None = None
) -> list[tuple[int, int]]:
    """Frame index pairs (i - gap, i) [and (i, i - gap)] for i = gap, gap + stride, ... while i < end.

    ``end`` defaults to ``num_frames``; YouTube-VOS uses ``num_frames - 1`` like the official loop.
    """
    check_pair_spacing(frame_gap, stride)
    pairs: list[tuple[int, int]] = []
    for i in range(frame_gap, num_frames if end is None else end, stride):
        pairs.append((i - frame_gap, i))
        if both_directions:
            pairs.append((i, i - frame_gap))
    return pairs


class _Frame(NamedTuple):
    path: Path  # an image file, or a video file
    index: int | None  # the frame number inside the video file; None for an image file


class _Pair(NamedTuple):
    frame1: _Frame
    frame2: _Frame
    video: str  # the video's path relative to the root


def _read_frame(frame: _Frame) -> np.ndarray:
    """-> uint8 [H, W, 3] RGB."""
    if frame.index is None:
        return read_image(frame.path)
    capture = cv2.VideoCapture(str(frame.path))
    try:
        if not capture.isOpened():
            raise FlowFileError(frame.path, "OpenCV cannot open the video (missing codec or corrupt file?)")
        capture.set(cv2.CAP_PROP_POS_FRAMES, frame.index)
        ok, bgr = capture.read()
    finally:
        capture.release()
    if not ok or bgr is None:
        raise FlowFileError(frame.path, f"cannot decode frame {frame.index}")
    if bgr.ndim == 2:
        return np.repeat(bgr[:, :, None], 3, axis=2)
    return np.ascontiguousarray(bgr[:, :, 2::-1])


def stated_frame_count(capture: cv2.VideoCapture) -> int | None:
    """The number of frames an opened video's container states; None where it states none: OpenCV gives 0 or a
    negative number for a WebM or Matroska file without a duration (as browsers record them), in which it also
    cannot seek (a seek reads the first frame again)."""
    count = capture.get(cv2.CAP_PROP_FRAME_COUNT)
    return int(count) if count >= 1 else None


def _video_header(path: Path) -> tuple[int | None, tuple[int, int]]:
    """(`stated_frame_count` of the video file, 0 where OpenCV cannot open it; its frames' (height, width) as the
    container states them)."""
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            return 0, (0, 0)
        size = (int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)), int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)))
        return stated_frame_count(capture), size
    finally:
        capture.release()


class _PairDataset(Dataset):
    """Base: a list of frame pairs, read with the official skip-on-failure loop and optional augmentation."""

    dataset_name = "video"
    alternative = "data=synthetic_video"

    def __init__(self, *, root: PathLike, augmentor: ImagePairAugmentor | None, max_skips: int) -> None:
        if augmentor is not None and not isinstance(augmentor, ImagePairAugmentor):
            raise TypeError(
                f"{type(self).__name__}: augmentor must be an ImagePairAugmentor, got {type(augmentor).__name__}"
            )
        self.root = Path(root)
        self.augmentor = augmentor
        self.max_skips = max_skips
        self.pairs: list[_Pair] = []
        self._rng = WorkerRNG()
        if not self.root.is_dir():
            self._fail("the dataset root does not exist")

    def _fail(self, problem: str) -> NoReturn:
        raise DatasetRootError(type(self), self.root, problem, alternative=self.alternative)

    def __len__(self) -> int:
        return len(self.pairs)

    def _load(self, pair: _Pair) -> tuple[np.ndarray, np.ndarray]:
        img1, img2 = _read_frame(pair.frame1), _read_frame(pair.frame2)
        if img1.shape != img2.shape:
            raise FlowFileError(
                pair.frame2.path, f"frame size {img2.shape[:2]} differs from {img1.shape[:2]}"
            )
        if self.augmentor is not None:
            crop_h, crop_w = self.augmentor.crop_size
            if img1.shape[0] < crop_h or img1.shape[1] < crop_w:
                raise FlowFileError(
                    pair.frame1.path, f"frame {img1.shape[:2]} is smaller than the crop {(crop_h, crop_w)}"
                )
        return img1, img2

    def __getitem__(self, item: int | SampleKey) -> dict[str, Any]:
        index, rng = unpack_item(item, self._rng)
        error: FlowFileError | None = None
        for attempt in range(self.max_skips):
            pair = self.pairs[(index + attempt) % len(self.pairs)]
            try:
                img1, img2 = self._load(pair)
            except FlowFileError as err:
                log.warning("%s: skipping pair %d: %s", type(self).__name__, index + attempt, err)
                error = err
                continue
            if self.augmentor is not None:
                img1, img2 = self.augmentor(img1, img2, rng)
            frame1 = pair.frame1.index if pair.frame1.index is not None else pair.frame1.path.stem
            frame2 = pair.frame2.index if pair.frame2.index is not None else pair.frame2.path.stem
            meta = {
                "dataset": self.dataset_name,
                "name": f"{pair.video}/{frame1}-{frame2}",
                "video": pair.video,
                "frame1": str(frame1),
                "frame2": str(frame2),
            }
            return {"img1": to_chw(img1), "img2": to_chw(img2), "meta": meta}
        # a FlowFileError naming the last bad file, so a DataLoader worker's failure reads as the same one line
        raise FlowFileError(
            error.path,
            f"{error.problem} ({type(self).__name__}: the last of {self.max_skips} consecutive pairs from index "
            f"{index} that could not be used; check the dataset files)",
        )


class YouTubeVOS(_PairDataset):
    """YouTube-VOS, *all-frames* releases (the official MCVA pretraining data, FlowFormer++ ``YoutubeVOS``).

    Expected tree::

        youtube-vos/                                   <- root
            train_all_frames/JPEGImages/<video>/00000.jpg, 00001.jpg, ...
            valid_all_frames/JPEGImages/<video>/00000.jpg, ...
            test_all_frames/JPEGImages/<video>/00000.jpg, ...

    For a video with n frames (sorted by name), and i = 9, 12, 15, ... while i < n - 1, the pairs
    (f[i-9], f[i]) and (f[i], f[i-9]) are added: a 9-frame gap, stride 3, both directions (``frame_gap``
    and ``stride`` change these). ``splits`` lists the sub-trees to read; the official code reads all three.
    Videos are sorted (the official ``os.listdir`` order is filesystem dependent; docs/departures.md).
    """

    dataset_name = "youtube_vos"

    def __init__(
        self,
        *,
        root: PathLike,
        splits: Sequence[str] = ("train_all_frames", "valid_all_frames", "test_all_frames"),
        frame_gap: int = 9,
        stride: int = 3,
        augmentor: ImagePairAugmentor | None = None,
        max_skips: int = 100,
    ) -> None:
        check_pair_spacing(frame_gap, stride)  # before the root is searched: a setting, not the data
        super().__init__(root=root, augmentor=augmentor, max_skips=max_skips)
        if isinstance(splits, str) or not splits:
            raise ValueError(f"YouTubeVOS: splits must be a non-empty list of folder names, got {splits!r}")
        for split in splits:
            split_root = self.root / split / "JPEGImages"
            if not split_root.is_dir():
                self._fail(
                    f"missing folder '{split_root}' (list only the splits you have, e.g. "
                    "`data.train.splits=[train_all_frames]`)"
                )
            for video_dir in sorted(p for p in split_root.iterdir() if p.is_dir()):
                frames = image_frames(video_dir)
                video = f"{split}/{video_dir.name}"
                indices = pair_indices(
                    len(frames), frame_gap=frame_gap, stride=stride, both_directions=True, end=len(frames) - 1
                )
                for a, b in indices:
                    self.pairs.append(_Pair(_Frame(frames[a], None), _Frame(frames[b], None), video))
        if not self.pairs:
            self._fail(f"found no video with more than {frame_gap + 1} frames")


class VideoFolder(_PairDataset):
    """Any folder of videos and/or frame folders, searched recursively.

    Expected tree::

        <root>/                       <- root
            clip_a.mp4                (video files: .mp4 .avi .mov .mkv .webm .m4v .mpg .mpeg, read with OpenCV)
            holiday/beach.avi
            scene_b/0001.jpg, 0002.jpg, ...   (frame folders: any folder holding .jpg/.png/... frames)

    Each video file, and each folder that directly holds image frames (sorted by name), is one video. Pairs
    are (f[i - frame_gap], f[i]) for i = frame_gap, frame_gap + stride, ... < n, plus the reversed pair when
    ``both_directions``. Video lengths come from the container's frame count; frames that fail to decode are
    skipped at read time.
    """

    dataset_name = "video_folder"

    def __init__(
        self,
        *,
        root: PathLike,
        frame_gap: int = 1,
        stride: int = 1,
        both_directions: bool = True,
        augmentor: ImagePairAugmentor | None = None,
        max_skips: int = 100,
    ) -> None:
        check_pair_spacing(frame_gap, stride)  # before the root is searched: a setting, not the data
        super().__init__(root=root, augmentor=augmentor, max_skips=max_skips)
        folders = [self.root, *sorted(p for p in self.root.rglob("*") if p.is_dir())]
        unusable: list[str] = []  # video files OpenCV cannot open, or with too few frames for a pair
        unseekable: list[str] = []  # video files stating no frame count: pairs read from them would be wrong
        small: list[str] = []  # videos whose frames are smaller than the augmentor's crop: no pair of them is read
        crop = tuple(augmentor.crop_size) if augmentor is not None else (0, 0)
        for folder in folders:
            video = folder.relative_to(self.root).as_posix() or "."
            frames = image_frames(folder)
            header = image_header(frames[0]) if frames else None
            if header is not None and (header[0] < crop[0] or header[1] < crop[1]):
                small.append(f"{video}/ ({header[0]}x{header[1]})")
                frames = []
            for a, b in pair_indices(
                len(frames), frame_gap=frame_gap, stride=stride, both_directions=both_directions
            ):
                self.pairs.append(_Pair(_Frame(frames[a], None), _Frame(frames[b], None), video))
            for path in sorted(
                p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES
            ):
                length, (height, width) = _video_header(path)
                name = path.relative_to(self.root).as_posix()
                if length is None:
                    unseekable.append(name)
                    continue
                if length and (height < crop[0] or width < crop[1]):
                    small.append(f"{name} ({height}x{width})")
                    continue
                indices = pair_indices(
                    length, frame_gap=frame_gap, stride=stride, both_directions=both_directions
                )
                if not indices:
                    unusable.append(name)
                for a, b in indices:
                    self.pairs.append(_Pair(_Frame(path, a), _Frame(path, b), name))
        if unusable:
            log.warning(
                "%s %s: skipped %d video file(s) that cannot be read or have at most %d frame(s) (frame_gap): %s",
                type(self).__name__, self.root, len(unusable), frame_gap, ", ".join(unusable[:5]),
            )
        if unseekable:
            log.warning(
                "%s %s: skipped %d video file(s) whose container states no frame count (a WebM or Matroska file "
                "without a duration?), in which OpenCV cannot seek to a frame: %s; remux each (ffmpeg -i <file> -c "
                "copy <new file>) or extract its frames into a folder",
                type(self).__name__, self.root, len(unseekable), ", ".join(unseekable[:5]),
            )
        if small:
            log.warning(
                "%s %s: skipped %d video(s) whose frames are smaller than the crop %dx%d "
                "(data.train.augmentor.crop_size): %s",
                type(self).__name__, self.root, len(small), *crop, ", ".join(small[:5]),
            )
        if not self.pairs and small:
            self._fail(
                f"found no video of more than {frame_gap} frames at least as large as the crop {crop[0]}x{crop[1]}: "
                f"{len(small)} smaller; lower data.train.augmentor.crop_size or add larger videos"
            )
        if not self.pairs:
            self._fail(f"found no video file or frame folder with more than {frame_gap} frames")

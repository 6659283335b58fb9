"""Dataset trees in the real formats (.ppm, .flo, .pfm, .png, 16-bit KITTI png, video frames), laid out as the
datasets are downloaded, with tiny images whose red channel names the frame."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import cv2
import numpy as np
import torch

from flowformer.data.io import write_flo, write_kitti_flow

H, W = 24, 32  # flow-dataset images
FRAME_H, FRAME_W = 40, 48  # video frames


def write_image(path: Path, value: int) -> None:
    """An RGB image whose red channel is ``value`` everywhere (identifies the frame)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rgb = np.zeros((H, W, 3), dtype=np.uint8)
    rgb[..., 0] = value
    rgb[..., 1] = np.arange(W, dtype=np.uint8)[None, :]
    assert cv2.imwrite(str(path), rgb[..., ::-1])


def flow_field(value: float) -> np.ndarray:
    flow = np.full((H, W, 2), value, dtype=np.float32)
    flow[..., 1] = -value
    return flow


def write_pfm(path: Path, flow: np.ndarray) -> None:
    """3-channel little-endian PFM, rows stored bottom-to-top (the FlyingThings3D flow format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.concatenate([flow, np.zeros_like(flow[..., :1])], axis=-1)[::-1].astype("<f4")
    path.write_bytes(f"PF\n{W} {H}\n-1.0\n".encode() + data.tobytes())


def red(image: torch.Tensor) -> int:
    return int(image[0, 0, 0])


def sparse_flow(value: float) -> tuple[np.ndarray, np.ndarray]:
    valid = np.zeros((H, W), dtype=np.float32)
    valid[::3, ::2] = 1.0
    return flow_field(value) * valid[..., None], valid


def chairs_tree(
    root: Path, split: list[int], split_in_parent: bool = False, split_name: str | None = "chairs_split.txt"
) -> Path:
    """FlyingChairs_release/data/ with one pair per entry of `split` (pair i: images 10i and 10i+1, flow i), and
    the split file `split_name` in data/ or beside it (None: no split file, as FlyingChairs.zip unpacks)."""
    data = root / "FlyingChairs_release" / "data"
    for i in range(len(split)):
        write_image(data / f"{i + 1:05d}_img1.ppm", 10 * i)
        write_image(data / f"{i + 1:05d}_img2.ppm", 10 * i + 1)
        write_flo(data / f"{i + 1:05d}_flow.flo", flow_field(float(i)))
    if split_name is not None:
        split_dir = data.parent if split_in_parent else data
        (split_dir / split_name).write_text("".join(f"{s}\n" for s in split))
    return data


def things_tree(root: Path, frames: int = 3) -> Path:
    for pass_dir, offset in (("frames_cleanpass", 0), ("frames_finalpass", 100)):
        for seq in ("A/0000", "B/0001"):
            for j in range(frames):
                write_image(root / pass_dir / "TRAIN" / seq / "left" / f"{6 + j:04d}.png", offset + j)
    for seq in ("A/0000", "B/0001"):
        for j in range(frames):
            future = flow_field(float(j))
            future[0, 0] = 1e4  # an invalid marker: |u| >= 1000
            write_pfm(
                root
                / "optical_flow/TRAIN"
                / seq
                / "into_future/left"
                / f"OpticalFlowIntoFuture_{6 + j:04d}_L.pfm",
                future,
            )
            write_pfm(
                root
                / "optical_flow/TRAIN"
                / seq
                / "into_past/left"
                / f"OpticalFlowIntoPast_{6 + j:04d}_L.pfm",
                flow_field(-float(j)),
            )
    return root


def sintel_tree(root: Path) -> Path:
    for scene, frames in (("market_2", 3), ("alley_1", 2)):  # created out of order on purpose
        for j in range(frames):
            for pass_name, offset in (("clean", 0), ("final", 100)):
                write_image(root / "training" / pass_name / scene / f"frame_{j + 1:04d}.png", offset + j)
                write_image(root / "test" / pass_name / scene / f"frame_{j + 1:04d}.png", offset + j)
            if j < frames - 1:
                write_flo(root / "training/flow" / scene / f"frame_{j + 1:04d}.flo", flow_field(float(j + 1)))
    return root


def kitti_tree(root: Path, pairs: int = 2) -> Path:
    for i in range(pairs):
        for split in ("training", "testing"):
            write_image(root / split / "image_2" / f"{i:06d}_10.png", 2 * i)
            write_image(root / split / "image_2" / f"{i:06d}_11.png", 2 * i + 1)
        write_kitti_flow(root / "training/flow_occ" / f"{i:06d}_10.png", *sparse_flow(1.5 + i))
    return root


def video_frame(value: int) -> np.ndarray:
    rgb = np.zeros((FRAME_H, FRAME_W, 3), dtype=np.uint8)
    rgb[..., 0] = value
    rgb[..., 2] = 200
    return rgb


def video_without_duration(path: Path, count: int) -> Path:
    """A Matroska video of `count` frames (frame j: video_frame(30 * j)) whose header holds no duration, as
    browsers record WebM: OpenCV states no frame count for it (`stated_frame_count`) and cannot seek in it."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (FRAME_W, FRAME_H))
    for j in range(count):
        writer.write(video_frame(30 * j)[..., ::-1].copy())
    writer.release()
    data = bytearray(path.read_bytes())
    at = data.find(b"\x44\x89")  # the Duration element: its ID, its size (one byte: 0x80 | n), its n-byte float
    assert at > 0 and data[at + 2] & 0x80, "OpenCV's Matroska header has changed"
    length = 3 + (data[at + 2] & 0x7F)
    data[at : at + length] = bytes([0xEC, 0x80 | (length - 2)]) + bytes(length - 2)  # a Void element as long
    path.write_bytes(data)
    return path


def frames_folder(folder: Path, count: int, suffix: str = ".jpg") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for j in range(count):
        assert cv2.imwrite(str(folder / f"{j:05d}{suffix}"), video_frame(10 * j)[..., ::-1])


@contextmanager
def image_size(height: int, width: int) -> Iterator[None]:
    """The flow-dataset trees written inside it have images and flow of height x width instead of H x W: the
    datasets' own sizes (FlyingChairs 384x512, ...) for measuring what reading and augmenting them costs."""
    global H, W
    saved = H, W
    H, W = height, width
    try:
        yield
    finally:
        H, W = saved


def hd1k_tree(root: Path, pairs: int = 2) -> Path:
    """HD1k/ with one sequence of `pairs` + 1 frames and their sparse 16-bit flow."""
    for j in range(pairs + 1):
        write_image(root / "hd1k_input/image_2" / f"000000_{j:04d}.png", j)
        write_kitti_flow(root / "hd1k_flow_gt/flow_occ" / f"000000_{j:04d}.png", *sparse_flow(float(j)))
    return root


def dataset_sized_trees(root: Path) -> Path:
    """The trees data=chairs, data=things and data=sintel_mix read under `root` (their paths.data_dir), each at
    its dataset's image size: 24 chairs training pairs and 1 validation pair (384x512); FlyingThings3D 540x960 with 8 frames a sequence (28
    clean + 28 final pairs a direction); Sintel 436x1024 (3 pairs a pass), 1 KITTI pair (375x1242), 3 HD1K
    pairs (1080x2560), which the sintel mix weighs 600 : 200 : 15 : 28 (the full datasets: 208200 : 40000 :
    5235 : about 40000); for data=youtube_vos one 25-frame video a split (720x1280 JPEGs, YouTube-VOS's most
    common size), 30 pairs in all."""
    with image_size(384, 512):
        chairs_tree(root, [1] * 24 + [2])  # red channel 10 i: at most 25 pairs
    with image_size(540, 960):
        things_tree(root / "FlyingThings3D", frames=8)
    with image_size(436, 1024):
        sintel_tree(root / "Sintel")
    with image_size(375, 1242):
        kitti_tree(root / "KITTI", pairs=1)
    with image_size(1080, 2560):
        hd1k_tree(root / "HD1k", pairs=3)
    with image_size(720, 1280):
        for split in ("train_all_frames", "valid_all_frames", "test_all_frames"):
            for frame in range(25):
                write_image(root / "youtube-vos" / split / "JPEGImages" / "video" / f"{frame:05d}.jpg", 10 * frame)
    return root

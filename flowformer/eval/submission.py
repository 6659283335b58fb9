"""Benchmark submission writers, as the official ones: the MPI-Sintel test tree of ``.flo`` files and
KITTI-2015 PNGs.

- Sintel: ``<out>/<pass>/<scene>/frame%04d.flo`` where the number is the 0-based index of the pair's first
  frame within its scene plus one (frame_0001.png -> frame0001.flo), written with :func:`write_flo`.
- KITTI: ``<out>/<frame_id>``, e.g. ``<out>/000000_10.png``, a 16-bit PNG with valid = 1 everywhere, written
  with :func:`write_kitti_flow`.

``write_sintel_item`` / ``write_kitti_item`` take a dataset item's ``meta`` (Sintel: ``pass``, ``scene``,
``frame``; KITTI: ``frame_id``), so evaluation code can write any test item with one call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flowformer.data.io import write_flo, write_kitti_flow

__all__ = [
    "kitti_submission_path",
    "sintel_submission_path",
    "write_kitti_item",
    "write_kitti_submission",
    "write_sintel_item",
    "write_sintel_submission",
]

PathLike = str | os.PathLike


def _path_part(value: Any, what: str) -> str:
    """A single, non-empty path component (no separators, not '.' or '..')."""
    text = str(value)
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise ValueError(f"submission: {what} must be a plain file or folder name, got {value!r}")
    return text


def sintel_submission_path(out_dir: PathLike, *, pass_name: str, scene: str, frame: int) -> Path:
    """Where the flow of pair ``frame`` (0-based) of ``scene`` goes: ``<out>/<pass>/<scene>/frame%04d.flo``."""
    if int(frame) != frame or frame < 0:
        raise ValueError(f"submission: Sintel frame must be a 0-based integer index, got {frame!r}")
    return (
        Path(out_dir) / _path_part(pass_name, "the Sintel pass") / _path_part(scene, "the Sintel scene")
    ) / f"frame{int(frame) + 1:04d}.flo"


def write_sintel_submission(
    out_dir: PathLike, flow: np.ndarray, *, pass_name: str, scene: str, frame: int
) -> Path:
    """Write flow [H, W, 2] (Sintel test size 436x1024) into the Sintel submission tree; returns the path."""
    path = sintel_submission_path(out_dir, pass_name=pass_name, scene=scene, frame=frame)
    write_flo(path, flow)
    return path


def kitti_submission_path(out_dir: PathLike, *, frame_id: str) -> Path:
    """Where the flow of test image ``frame_id`` (``000000_10.png``, or without ``.png``) goes."""
    name = _path_part(frame_id, "the KITTI frame_id")
    suffix = Path(name).suffix
    if suffix == "":
        name += ".png"
    elif suffix.lower() != ".png":
        raise ValueError(
            f"submission: KITTI frame_id must name a .png file (e.g. 000000_10.png), got {frame_id!r}"
        )
    return Path(out_dir) / name


def write_kitti_submission(out_dir: PathLike, flow: np.ndarray, *, frame_id: str) -> Path:
    """Write flow [H, W, 2] as a KITTI 16-bit PNG with valid = 1 everywhere; returns the path."""
    path = kitti_submission_path(out_dir, frame_id=frame_id)
    write_kitti_flow(path, flow)
    return path


def _require(meta: Mapping[str, Any], keys: tuple[str, ...], writer: str) -> list[Any]:
    missing = [key for key in keys if key not in meta]
    if missing:
        raise ValueError(
            f"{writer}: the item's meta lacks {missing} (has {sorted(meta)}); use the test split of the "
            "matching dataset class, whose items carry these names"
        )
    return [meta[key] for key in keys]


def write_sintel_item(out_dir: PathLike, flow: np.ndarray, meta: Mapping[str, Any]) -> Path:
    """Write one Sintel test pair's flow [H, W, 2] using its meta (``pass``, ``scene``, ``frame``)."""
    pass_name, scene, frame = _require(meta, ("pass", "scene", "frame"), "write_sintel_item")
    return write_sintel_submission(out_dir, flow, pass_name=pass_name, scene=scene, frame=frame)


def write_kitti_item(out_dir: PathLike, flow: np.ndarray, meta: Mapping[str, Any]) -> Path:
    """Write one KITTI test pair's flow [H, W, 2] using its meta (``frame_id``)."""
    (frame_id,) = _require(meta, ("frame_id",), "write_kitti_item")
    return write_kitti_submission(out_dir, flow, frame_id=frame_id)

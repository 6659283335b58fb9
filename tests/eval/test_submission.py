"""Submission writers: the Sintel .flo tree and KITTI 16-bit PNGs, read back with io.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowformer.data.io import read_flo, read_kitti_flow
from flowformer.eval.submission import (
    kitti_submission_path,
    sintel_submission_path,
    write_kitti_item,
    write_kitti_submission,
    write_sintel_item,
    write_sintel_submission,
)


@pytest.fixture
def flow() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((6, 10, 2)) * 30).astype(np.float32)


def test_sintel_tree_numbers_frames_from_one(tmp_path: Path, flow: np.ndarray) -> None:
    path = write_sintel_submission(tmp_path, flow, pass_name="clean", scene="ambush_1", frame=0)
    assert path == tmp_path / "clean" / "ambush_1" / "frame0001.flo"
    np.testing.assert_array_equal(read_flo(path), flow)
    meta = {"dataset": "sintel", "pass": "final", "scene": "cave_3", "frame": 41}
    path = write_sintel_item(tmp_path, -flow, meta)
    assert path == tmp_path / "final" / "cave_3" / "frame0042.flo"
    np.testing.assert_array_equal(read_flo(path), -flow)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.flo")) == [
        "clean/ambush_1/frame0001.flo",
        "final/cave_3/frame0042.flo",
    ]


def test_kitti_png_is_16_bit_with_valid_one(tmp_path: Path, flow: np.ndarray) -> None:
    path = write_kitti_item(
        tmp_path, flow, {"dataset": "kitti", "name": "000007", "frame_id": "000007_10.png"}
    )
    assert path == tmp_path / "000007_10.png"
    back, valid = read_kitti_flow(path)
    np.testing.assert_allclose(back, flow, atol=0.5 / 64 + 1e-6)  # stored in 1/64 px steps
    assert (valid == 1).all()
    assert write_kitti_submission(tmp_path, flow, frame_id="000008_10") == tmp_path / "000008_10.png"


def test_bad_names_and_meta_are_reported(tmp_path: Path, flow: np.ndarray) -> None:
    with pytest.raises(ValueError, match="lacks \\['scene', 'frame'\\]"):
        write_sintel_item(tmp_path, flow, {"pass": "clean"})
    with pytest.raises(ValueError, match="lacks \\['frame_id'\\]"):
        write_kitti_item(tmp_path, flow, {"name": "000000"})
    with pytest.raises(ValueError, match="plain file or folder name"):
        sintel_submission_path(tmp_path, pass_name="clean", scene="../x", frame=0)
    with pytest.raises(ValueError, match="0-based integer"):
        sintel_submission_path(tmp_path, pass_name="clean", scene="a", frame=-1)
    with pytest.raises(ValueError, match=r"\.png"):
        kitti_submission_path(tmp_path, frame_id="000000_10.jpg")

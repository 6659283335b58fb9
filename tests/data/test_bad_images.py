"""Inputs that decode into something wrong are refused in one line naming the file (issue 27 item 11): a
truncated JPEG (OpenCV fills its missing half with grey), a PNG whose header claims more pixels than OpenCV
decodes (cv2.error), a 0x0 .pfm (an empty array); and
unreadable videos in a pretraining folder are counted in one warning."""

import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest

from flowformer.data.io import FlowFileError, read_image, read_pfm
from flowformer.data.video_datasets import VideoFolder

from helpers.trees import FRAME_H, FRAME_W, frames_folder, video_frame


def test_a_truncated_jpeg_is_refused_and_a_whole_one_reads(tmp_path: Path) -> None:
    picture = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "whole.jpg"), picture)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    assert read_image(tmp_path / "whole.jpg").shape == (64, 64, 3)
    with pytest.raises(FlowFileError, match=r"cut\.jpg: truncated JPEG"):
        read_image(tmp_path / "cut.jpg")


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_a_png_claiming_too_many_pixels_is_one_error(tmp_path: Path) -> None:
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)  # 100000x100000 RGB, 8 bits
    png = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(bytes(100)))
    (tmp_path / "huge.png").write_bytes(png + png_chunk(b"IEND", b""))
    with pytest.raises(FlowFileError, match=r"huge\.png: cannot decode the file as an image \(OpenCV: .*PIXELS"):
        read_image(tmp_path / "huge.png")


def test_a_0x0_pfm_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.pfm").write_bytes(b"PF\n0 0\n-1.0\n")
    with pytest.raises(FlowFileError, match=r"empty\.pfm: empty \.pfm: size 0x0"):
        read_pfm(tmp_path / "empty.pfm")


def test_unusable_videos_in_a_pretraining_folder_are_counted_in_one_warning(tmp_path: Path, caplog) -> None:
    root = tmp_path / "videos"
    frames_folder(root / "scene", 3, suffix=".png")
    (root / "junk.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    writer = cv2.VideoWriter(str(root / "one.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10, (FRAME_W, FRAME_H))
    writer.write(video_frame(0)[..., ::-1].copy())
    writer.release()
    with caplog.at_level("WARNING"):
        dataset = VideoFolder(root=root, frame_gap=1, both_directions=False)
    assert {pair.video for pair in dataset.pairs} == {"scene"}
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 2 video file(s)" in warnings[0]
    assert "junk.mp4" in warnings[0] and "one.avi" in warnings[0]

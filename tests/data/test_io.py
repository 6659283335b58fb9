"""Flow and image file I/O: round trips, both PFM byte orders, and one error per failure mode."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from flowformer.data.io import (
    FlowFileError,
    read_flo,
    read_flow,
    read_image,
    read_kitti_flow,
    read_pfm,
    write_flo,
    write_kitti_flow,
)


@pytest.fixture
def flow() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((7, 11, 2)) * 20).astype(np.float32)


def _write_pfm(path: Path, data: np.ndarray, little_endian: bool) -> None:
    """Write a PFM the way the format stores it: rows bottom-to-top, byte order given by the scale sign."""
    height, width = data.shape[:2]
    tag = b"PF" if data.ndim == 3 else b"Pf"
    scale = -1.0 if little_endian else 1.0
    dtype = "<f4" if little_endian else ">f4"
    header = tag + b"\n" + f"{width} {height}\n{scale}\n".encode()
    path.write_bytes(header + np.ascontiguousarray(np.flipud(data), dtype=dtype).tobytes())


def test_flo_round_trip_and_layout(tmp_path: Path, flow: np.ndarray) -> None:
    path = tmp_path / "sub" / "a.flo"
    write_flo(path, flow)
    data = path.read_bytes()
    assert np.frombuffer(data, "<f4", 1)[0] == np.float32(202021.25)
    assert tuple(np.frombuffer(data, "<i4", 2, 4)) == (11, 7)  # width, height
    assert np.frombuffer(data, "<f4", 2, 12).tolist() == flow[0, 0].tolist()  # (u, v) interleaved
    back = read_flo(path)
    assert back.dtype == np.float32 and back.shape == (7, 11, 2)
    np.testing.assert_array_equal(back, flow)


def test_flo_wrong_magic(tmp_path: Path, flow: np.ndarray) -> None:
    path = tmp_path / "bad.flo"
    write_flo(path, flow)
    data = bytearray(path.read_bytes())
    data[:4] = np.array([1.0], "<f4").tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(FlowFileError, match=r"bad\.flo.*magic"):
        read_flo(path)


def test_flo_truncated_and_wrong_size(tmp_path: Path, flow: np.ndarray) -> None:
    path = tmp_path / "t.flo"
    write_flo(path, flow)
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(FlowFileError, match=r"t\.flo.*truncated"):
        read_flo(path)
    path.write_bytes(data[:6])
    with pytest.raises(FlowFileError, match=r"t\.flo.*truncated"):
        read_flo(path)
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(FlowFileError, match=r"t\.flo.*wrong .flo size"):
        read_flo(path)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.flo"
    for reader in (read_flo, read_pfm, read_image, read_kitti_flow):
        with pytest.raises(FlowFileError, match="nope.flo.*not found"):
            reader(missing)
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not a png at all")
    with pytest.raises(FlowFileError, match="garbage.png.*cannot decode"):
        read_image(garbage)
    with pytest.raises(FlowFileError, match="garbage.png.*cannot decode"):
        read_kitti_flow(garbage)
    assert issubclass(FlowFileError, ValueError)


@pytest.mark.parametrize("little_endian", [True, False])
def test_pfm_three_channels_both_byte_orders(tmp_path: Path, little_endian: bool) -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((5, 6, 3)).astype(np.float32)
    path = tmp_path / "f.pfm"
    _write_pfm(path, data, little_endian)
    flow = read_pfm(path)
    assert flow.shape == (5, 6, 2) and flow.dtype == np.float32
    np.testing.assert_array_equal(flow, data[:, :, :2])  # rows flipped back, third channel dropped
    np.testing.assert_array_equal(read_flow(path)[0], data[:, :, :2])


@pytest.mark.parametrize("little_endian", [True, False])
def test_pfm_one_channel(tmp_path: Path, little_endian: bool) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "d.pfm"
    _write_pfm(path, data, little_endian)
    np.testing.assert_array_equal(read_pfm(path), data)
    with pytest.raises(FlowFileError, match="1-channel"):
        read_flow(path)


def test_pfm_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.pfm"
    path.write_bytes(b"P6\n4 3\n255\n" + b"\0" * 36)
    with pytest.raises(FlowFileError, match=r"x\.pfm.*header"):
        read_pfm(path)
    _write_pfm(path, np.zeros((3, 4, 3), np.float32), little_endian=True)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(FlowFileError, match=r"x\.pfm.*truncated"):
        read_pfm(path)


def test_kitti_png_round_trip_with_valid(tmp_path: Path, flow: np.ndarray) -> None:
    valid = np.ones(flow.shape[:2], np.float32)
    valid[2, 3] = 0
    quantised = np.round(flow * 64) / 64
    path = tmp_path / "k" / "000000_10.png"
    write_kitti_flow(path, quantised, valid)
    back, back_valid = read_kitti_flow(path)
    np.testing.assert_array_equal(back, quantised)
    np.testing.assert_array_equal(back_valid, valid)
    # The raw file is uint16 BGR for OpenCV: B = valid, G = v*64 + 2^15, R = u*64 + 2^15.
    raw = cv2.imread(str(path), cv2.IMREAD_ANYDEPTH | cv2.IMREAD_COLOR)
    assert raw.dtype == np.uint16
    assert raw[0, 0, 2] == quantised[0, 0, 0] * 64 + 2**15
    assert raw[0, 0, 1] == quantised[0, 0, 1] * 64 + 2**15
    assert raw[2, 3, 0] == 0 and raw[0, 0, 0] == 1
    write_kitti_flow(path, quantised)  # valid defaults to ones
    assert read_kitti_flow(path)[1].min() == 1.0


def test_kitti_png_wrong_kind(tmp_path: Path) -> None:
    path = tmp_path / "eight_bit.png"
    cv2.imwrite(str(path), np.zeros((4, 5, 3), np.uint8))
    with pytest.raises(FlowFileError, match="eight_bit.png.*16-bit"):
        read_kitti_flow(path)
    with pytest.raises(FlowFileError, match=r"out\.png.*\[H, W, 2\]"):
        write_kitti_flow(tmp_path / "out.png", np.zeros((4, 5, 3), np.float32))
    with pytest.raises(FlowFileError, match=r"out\.png.*valid mask shape"):
        write_kitti_flow(tmp_path / "out.png", np.zeros((4, 5, 2), np.float32), np.ones((5, 4)))


@pytest.mark.parametrize(
    ("name", "pixels", "got"),
    [
        ("grey16.png", np.full((4, 5), 2**15, np.uint16), "1 channel(s) of dtype uint16"),
        ("rgba16.png", np.full((4, 5, 4), 2**15, np.uint16), "4 channel(s) of dtype uint16"),
        ("rgb8.png", np.full((4, 5, 3), 128, np.uint8), "3 channel(s) of dtype uint8"),
    ],
)
def test_kitti_png_must_be_three_channels_of_16_bits(
    tmp_path: Path, name: str, pixels: np.ndarray, got: str
) -> None:
    """OpenCV's colour read turns a grey 16-bit PNG into 3 equal channels, which decoded as ~512 px of flow."""
    path = tmp_path / name
    assert cv2.imwrite(str(path), pixels)
    with pytest.raises(FlowFileError) as err:
        read_kitti_flow(path)
    assert str(err.value).startswith(f"{path}: expected a 3-channel 16-bit KITTI flow PNG, got {got}; ")
    with pytest.raises(FlowFileError, match=name):
        read_flow(path)


def test_read_image_grey_rgb_rgba(tmp_path: Path) -> None:
    rgb = np.random.default_rng(2).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "rgb.png"), rgb[:, :, ::-1])
    out = read_image(tmp_path / "rgb.png")
    assert out.dtype == np.uint8 and out.shape == (6, 8, 3)
    np.testing.assert_array_equal(out, rgb)

    grey = rgb[:, :, 0]
    cv2.imwrite(str(tmp_path / "grey.png"), grey)
    np.testing.assert_array_equal(read_image(tmp_path / "grey.png"), np.stack([grey] * 3, axis=2))

    rgba = np.concatenate([rgb, np.full((6, 8, 1), 7, np.uint8)], axis=2)
    cv2.imwrite(str(tmp_path / "rgba.png"), rgba[:, :, [2, 1, 0, 3]])
    np.testing.assert_array_equal(read_image(tmp_path / "rgba.png"), rgb)

    cv2.imwrite(str(tmp_path / "deep.png"), np.zeros((4, 4), np.uint16))
    with pytest.raises(FlowFileError, match="deep.png: expected an 8-bit image, got 16-bit values.*convert the images"):
        read_image(tmp_path / "deep.png")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_read_image_turns_a_jpeg_as_its_exif_orientation_says(tmp_path: Path, orientation: int) -> None:
    """A 160x240 JPEG tagged with each EXIF orientation reads as PIL.ImageOps.exif_transpose shows it (what
    viewers show: 240x160 for 5-8)."""
    blocks = np.random.default_rng(0).integers(0, 255, (10, 15, 3), dtype=np.uint8)
    stored = Image.fromarray(np.kron(blocks, np.ones((16, 16, 1), dtype=np.uint8)))  # [160, 240]
    exif = stored.getexif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.jpg"
    stored.save(path, exif=exif, quality=95)
    with Image.open(path) as image:
        shown = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    assert shown.shape == ((160, 240, 3) if orientation < 5 else (240, 160, 3))
    np.testing.assert_array_equal(read_image(path), shown)


def test_read_flow_dispatch(tmp_path: Path, flow: np.ndarray) -> None:
    write_flo(tmp_path / "a.flo", flow)
    dense, valid = read_flow(tmp_path / "a.flo")
    assert valid is None and np.array_equal(dense, flow)
    with pytest.raises(FlowFileError, match=r"a\.txt.*extension"):
        read_flow(tmp_path / "a.txt")

"""Bad inputs end in one clear error: corrupt flow files read in DataLoader workers, images too small for the
network, and an iteration count that is not a positive integer."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from flowformer.data.io import FlowFileError, read_kitti_flow, read_pfm
from flowformer.models import FlowFormer, build_flowformer


class OneFileDataset(Dataset):
    """One item: `reader(path)`, as a flow dataset's __getitem__ would call it."""

    def __init__(self, reader: Callable, path: Path) -> None:
        self.reader = reader
        self.path = path

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        return self.reader(self.path)


def _bad_pfm(tmp_path: Path) -> Path:
    path = tmp_path / "bad.pfm"
    path.write_bytes(b"P6\n4 3\n255\n" + b"\0" * 36)
    return path


def _eight_bit_kitti(tmp_path: Path) -> Path:
    path = tmp_path / "000000_10.png"
    cv2.imwrite(str(path), np.zeros((4, 5, 3), np.uint8))
    return path


@pytest.mark.parametrize(("reader", "make_file"), [(read_pfm, _bad_pfm), (read_kitti_flow, _eight_bit_kitti)])
def test_flow_file_error_from_a_dataloader_worker_is_the_same_one_line(
    tmp_path: Path, reader: Callable, make_file: Callable[[Path], Path]
) -> None:
    path = make_file(tmp_path)
    with pytest.raises(FlowFileError) as in_process:
        next(iter(DataLoader(OneFileDataset(reader, path), num_workers=0)))
    with pytest.raises(FlowFileError) as in_worker:
        next(iter(DataLoader(OneFileDataset(reader, path), num_workers=1)))
    assert str(in_worker.value) == str(in_process.value)
    assert str(in_worker.value).startswith(f"{path}: ") and "Traceback" not in str(in_worker.value)
    assert in_worker.value.path == str(path)
    assert in_worker.value.problem == in_process.value.problem


def test_flow_file_error_survives_pickling() -> None:
    err = FlowFileError("/data/a.flo", "truncated .flo data")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.path, back.problem) == (
        FlowFileError,
        str(err),
        err.path,
        err.problem,
    )


def test_flow_file_error_needs_a_path_and_a_problem() -> None:
    with pytest.raises(TypeError, match="FlowFileError needs"):
        FlowFileError("no separator here")


@pytest.mark.parametrize("size", [(8, 8), (1, 1), (8, 16), (16, 8), (12, 12)])
def test_too_small_images_name_the_minimum_for_the_cnn_encoder(
    tiny_net: FlowFormer, size: tuple[int, int]
) -> None:
    image = torch.zeros(1, 3, *size)
    expected = f"cnn image encoder needs images of at least 16x16 pixels, got {size[0]}x{size[1]};"
    with pytest.raises(ValueError, match=expected):
        tiny_net(image, image, iters=1)


@pytest.mark.parametrize("size", [(16, 16), (16, 24), (24, 16)])
def test_16x16_is_enough_for_the_cnn_encoder(tiny_net: FlowFormer, size: tuple[int, int]) -> None:
    net = tiny_net.train()
    image = torch.rand(2, 3, *size) * 255
    out = net(image, image.flip(-1), iters=2)
    out["flow"].abs().mean().backward()
    assert out["flow"].shape == (2, 2, *size) and torch.isfinite(out["flow"]).all()


@pytest.mark.parametrize("size", [(24, 32), (32, 24), (8, 64)])
def test_too_small_images_name_the_minimum_for_the_twins_encoder(size: tuple[int, int]) -> None:
    with torch.device("meta"):
        net = build_flowformer(variant="flowformer")
        image = torch.zeros(1, 3, *size)
    expected = f"twins image encoder needs images of at least 32x32 pixels, got {size[0]}x{size[1]};"
    with pytest.raises(ValueError, match=expected):
        net(image, image, iters=1)


def test_32x32_is_enough_for_the_twins_encoder() -> None:
    torch.manual_seed(0)
    net = build_flowformer(variant="flowformer").eval()
    image = torch.rand(1, 3, 32, 32) * 255
    with torch.no_grad():
        flow = net(image, image.flip(-1), iters=1)["flow"]
    assert flow.shape == (1, 2, 32, 32) and torch.isfinite(flow).all()


@pytest.mark.parametrize("iters", [0, -3, 2.5, True, "12", None])
def test_iters_must_be_a_positive_integer(tiny_net: FlowFormer, iters: object) -> None:
    image = torch.rand(1, 3, 16, 16) * 255
    with pytest.raises(
        ValueError, match=rf"FlowFormer.forward: iters must be an integer >= 1 .*got {iters!r}"
    ):
        tiny_net(image, image, iters=iters)
    with pytest.raises(TypeError, match="iters"):  # no default: every caller says how many iterations
        tiny_net(image, image)
    assert tiny_net(image, image, iters=1)["flow"].shape == (1, 2, 16, 16)

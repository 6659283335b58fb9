"""Checkpoint paths that are not checkpoint files (issue 27 item 12): a named pipe is refused at once instead of
blocking the reader, and a small zip whose records declare gigabytes is refused before a record is read."""

import os
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from flowformer.lit.checkpointing import check_resume_checkpoint
from flowformer.lit.flow import FlowModule
from flowformer.models.checkpoint import CheckpointReadError, load_backbone_weights

from helpers.configs import backbone_config, build_backbone, flow_settings


def unblock_later(pipe: Path) -> None:
    """Should a reader have opened `pipe` (and blocked), give it a byte after 5 s: it then fails another way."""

    def write() -> None:
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO when no reader opened it: nothing to unblock
        except OSError:
            return
        os.write(fd, b"x")
        os.close(fd)

    timer = threading.Timer(5, write)
    timer.daemon = True
    timer.start()


def test_a_named_pipe_is_refused_without_blocking(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe.ckpt"
    os.mkfifo(pipe)
    unblock_later(pipe)
    # infer.checkpoint, eval.checkpoint and model.init_from are read by load_backbone_weights; ckpt_path here
    with pytest.raises(CheckpointReadError, match=rf"checkpoint {pipe} is not a regular file \(a named pipe\)"):
        load_backbone_weights(build_backbone(), pipe)
    module = FlowModule(backbone=backbone_config(), **flow_settings())
    with pytest.raises(CheckpointReadError, match=rf"checkpoint {pipe} is not a regular file \(a named pipe\)"):
        check_resume_checkpoint(pipe, module, max_steps=10)


def test_records_declaring_far_more_than_the_network_are_refused_unread(tmp_path: Path) -> None:
    net = build_backbone()
    torch.save(net.state_dict(), tmp_path / "good.pth")
    bomb = tmp_path / "bomb.pth"
    with zipfile.ZipFile(tmp_path / "good.pth") as good, zipfile.ZipFile(bomb, "w") as out:
        for entry in good.infolist():
            data = good.read(entry)
            if entry.filename.endswith("/data/0"):  # the first tensor's record: 200 MiB of zeros, deflated
                out.writestr(entry.filename, bytes(200 * 2**20), zipfile.ZIP_DEFLATED)
            else:
                out.writestr(entry, data)
    assert bomb.stat().st_size < 5 * 2**20
    with pytest.raises(CheckpointReadError, match=rf"checkpoint {bomb} declares 2\d\d MiB of records, more than 8x"):
        load_backbone_weights(net, bomb)
    assert load_backbone_weights(net, tmp_path / "good.pth").source == "official"

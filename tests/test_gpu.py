"""What only a GPU shows (skipped without CUDA): bf16 autocast on CUDA, bf16-mixed training and MCVA
pretraining through run.py, and DDP over NCCL launched by Lightning."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowformer.models import FlowFormer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[1]


def run_py(run_dir: Path, *overrides: str) -> str:
    result = subprocess.run(
        [sys.executable, "run.py", *overrides, "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def test_bf16_autocast_on_cuda_stays_close_to_fp32() -> None:
    cfg = yaml.safe_load((REPO / "conf" / "backbone" / "tiny.yaml").read_text())
    cfg.pop("_target_")
    torch.manual_seed(0)
    net = FlowFormer(**cfg).cuda().eval()
    image1, image2 = (torch.rand(2, 3, 64, 96, device="cuda") * 255 for _ in range(2))
    with torch.no_grad():
        ref = net(image1, image2, iters=3)["flow"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feat1, feat2, _ = net.encode_images(image1, image2)
            assert feat1.dtype == torch.bfloat16  # the encoders do run in bf16
            assert net.cost_volume(feat1, feat2).dtype == torch.float32  # the cost volume stays fp32
            low = net(image1, image2, iters=3)["flow"]
    assert low.dtype == torch.float32
    diff = (low - ref).abs()
    assert diff.max() < 0.5 and diff.mean() < 0.05, (diff.max(), diff.mean())


def test_bf16_mixed_training_on_one_gpu(tmp_path) -> None:
    output = run_py(tmp_path, "debug=tiny", "trainer=gpu", "trainer.max_steps=3", "trainer.val_check_interval=3")
    assert "bf16" in output  # Lightning announces the autocast precision
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


def test_mcva_pretraining_bf16_on_one_gpu(tmp_path) -> None:
    run_py(
        tmp_path,
        "task=pretrain",
        "model=mcva",
        "backbone=tiny",
        "data=synthetic_video",
        "data.batch_size=2",
        "trainer=gpu",
        "trainer.max_steps=3",
        "model.query_num=4",
        "model.log_images_every_n_steps=0",
    )  # trainer.enable_progress_bar=false without debug=tiny (which drops the Rich bar callback itself)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3


def test_ddp_over_nccl_launched_by_lightning(tmp_path) -> None:
    devices = torch.cuda.device_count()  # NCCL needs one GPU per process
    output = run_py(
        tmp_path,
        "debug=tiny",
        "trainer=ddp",
        f"trainer.devices={devices}",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
    )
    assert "distributed_backend=nccl" in output
    assert f"MEMBER: {devices}/{devices}" in output
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3

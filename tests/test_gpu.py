"""What only a GPU shows (skipped without CUDA): bf16-mixed training and MCVA pretraining through run.py, DDP
over NCCL launched by Lightning, TF32 under the default runtime.matmul_precision, an inductor-compiled
network, the memory activation checkpointing saves and the logged gradient norm's foreach kernels. bf16 autocast
against fp32 on CUDA is in test_models_network.py."""

from pathlib import Path

import pytest
import torch

from flowformer.lit.flow import FlowModule
from flowformer.models.build import ACTIVATION_CHECKPOINT_STAGES
from flowformer.tasks.bench import operators_dispatched
from flowformer.tasks.runtime import compile_network, configure_runtime

from helpers.compose import compose_tiny_config
from helpers.configs import backbone_config, build_backbone, flow_settings
from helpers.run import run_py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def run_on_gpu(run_dir: Path, *overrides: str) -> str:
    result = run_py(*overrides, "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", timeout=600)
    return result.stdout + result.stderr


def test_bf16_mixed_training_on_one_gpu(tmp_path) -> None:
    output = run_on_gpu(tmp_path, "debug=tiny", "trainer=gpu", "trainer.max_steps=3", "trainer.val_check_interval=3")
    assert "bf16" in output  # Lightning announces the autocast precision
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


def test_mcva_pretraining_bf16_on_one_gpu(tmp_path) -> None:
    run_on_gpu(
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
    output = run_on_gpu(
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


@pytest.mark.usefixtures("restore_matmul_precision")
def test_tf32_by_default_and_an_inductor_compiled_forward_matches_eager() -> None:
    configure_runtime(compose_tiny_config().runtime)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    # compiled against eager, without TF32 rounding in either
    configure_runtime(compose_tiny_config("runtime.matmul_precision=highest").runtime)
    torch.manual_seed(0)
    net = build_backbone().eval().cuda()
    reference = build_backbone().eval().cuda()
    reference.load_state_dict(net.state_dict())
    compile_network(net, compose_tiny_config("runtime.compile=true").runtime)  # inductor
    image1, image2 = (torch.rand(1, 3, 64, 96, device="cuda") * 255 for _ in range(2))
    with torch.no_grad():
        flow = net(image1, image2, iters=4)["flow"]
        expected = reference(image1, image2, iters=4)["flow"]
    torch.testing.assert_close(flow, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("restore_matmul_precision")
def test_reduce_overhead_cuda_graphs_give_the_eager_flow_and_train(tmp_path) -> None:
    """runtime.compile_mode=reduce-overhead: inductor with CUDA graphs over the compiled regions. Recorded and
    replayed forwards (12 iterations, one fixed shape) give the eager flow, and run.py trains with it."""
    configure_runtime(compose_tiny_config("runtime.matmul_precision=highest").runtime)
    torch.manual_seed(0)
    net = build_backbone().eval().cuda()
    reference = build_backbone().eval().cuda()
    reference.load_state_dict(net.state_dict())
    compile_network(net, compose_tiny_config("runtime.compile=true", "runtime.compile_mode=reduce-overhead").runtime)
    image1, image2 = (torch.rand(1, 3, 64, 96, device="cuda") * 255 for _ in range(2))
    with torch.no_grad():
        expected = reference(image1, image2, iters=12)["flow"]
        for _ in range(3):  # warm-up, recording, replay
            torch.testing.assert_close(net(image1, image2, iters=12)["flow"], expected, rtol=1e-3, atol=1e-3)
    run_on_gpu(
        tmp_path, "debug=tiny", "trainer=gpu", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "runtime.compile=true", "runtime.compile_mode=reduce-overhead",
    )
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


def test_activation_checkpointing_lowers_the_peak_of_a_bf16_training_step() -> None:
    """backbone.activation_checkpoint on CUDA under bf16 autocast: a lower peak of allocated memory and the same
    gradients, up to the rounding of CUDA's atomic-add backward kernels (grid_sample's), which are not bitwise
    repeatable: so the whole gradient is compared by direction and length."""
    g = torch.Generator().manual_seed(0)
    image1 = (torch.rand(2, 3, 192, 256, generator=g) * 255).cuda()
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    torch.manual_seed(0)
    nets = [
        build_backbone(activation_checkpoint=stages).cuda() for stages in ([], ACTIVATION_CHECKPOINT_STAGES)
    ]
    nets[1].load_state_dict(nets[0].state_dict())
    peaks, grads = [], []
    for net in nets:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            predictions = net(image1, image2, iters=6)["flow_predictions"]
        sum(p.float().square().mean() for p in predictions).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        grads.append(torch.cat([p.grad.float().flatten() for p in net.parameters() if p.grad is not None]))
    assert peaks[1] < 0.6 * peaks[0]
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.999
    assert torch.isclose(grads[1].norm(), grads[0].norm(), rtol=1e-2)


def test_the_logged_gradient_norm_takes_a_few_operators_on_cuda() -> None:
    """BackboneModule.on_before_optimizer_step takes the norm of every gradient by torch's foreach kernels on
    CUDA: a few operators for the tiny network's gradients, where one norm per parameter went before (and goes
    on the CPU, which has no foreach kernels)."""
    module = FlowModule(backbone=backbone_config(), **flow_settings(train_iters=2, val_iters=2)).cuda()
    parameters = module.trainable_parameters()
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    optimizer = torch.optim.SGD(parameters, lr=0.0)
    assert operators_dispatched(lambda: module.on_before_optimizer_step(optimizer)) < 20 < len(parameters)

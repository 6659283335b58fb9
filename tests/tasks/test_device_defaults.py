"""Settings chosen for the device (flowformer/device_settings.py): backbone.tokenize_chunk,
backbone.memory_budget_gb and backbone.activation_checkpoint `auto` (the defaults; the last from an estimate of
the training step) and the optimiser's `fused: auto`, each chosen from the device the network runs on and said
in one line; a number, null or true/false set by the user is kept. The device is read in
one function, `describe_device`, which the tests replace to simulate a GPU. The numbers are the same whichever
path the choice takes (also the chunked tokenization tests: tests/models/test_network.py, test_agt_knobs.py;
fixture A: test_parity.py)."""

import json
import logging
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from flowformer import device_settings
from flowformer.device_settings import (
    DEVICE_CHOSEN_SETTINGS,
    FAST_PATH_FREE_GB,
    DeviceMemory,
    TrainingStep,
    choose_fused_optimizer,
    choose_memory_budget,
    choose_setting,
    choose_tokenize_chunk,
    device_memory_settings,
    estimate_step_memory,
    training_device,
)
from flowformer.losses import sequence_loss
from flowformer.models.build import BOUNDED_TOKENIZE_CHUNK
from flowformer.tasks.pipeline_plan import training_crop
from flowformer.tasks.runtime import load_network
from flowformer.tasks.train import build_model, training_step

from helpers.compose import compose_run_config, compose_tiny_config
from helpers.configs import build_backbone
from helpers.run import fresh_checkout, run_py

CPU = DeviceMemory(kind="cpu", name="cpu", free_gb=20.0)
LARGE_GPU = DeviceMemory(kind="cuda", name="NVIDIA H200", free_gb=139.3)
SMALL_GPU = DeviceMemory(kind="cuda", name="Tesla T4", free_gb=14.6)


def values(choices: dict) -> dict:
    return {setting: value for setting, (value, _) in choices.items()}


def forward_only_settings(device: DeviceMemory) -> dict:
    """{setting: (value, why)} for each of DEVICE_CHOSEN_SETTINGS where the network runs forward only."""
    backbone = compose_tiny_config().backbone
    return {
        setting: choose_setting(setting, device, training=False, step=None, backbone_cfg=backbone)
        for setting in DEVICE_CHOSEN_SETTINGS
    }


def test_the_choice_for_a_cpu_a_large_gpu_and_a_small_gpu():
    assert choose_tokenize_chunk(CPU) == (512, "on the cpu, the bounded path is also the faster")
    assert choose_tokenize_chunk(LARGE_GPU) == (None, "NVIDIA H200 has 139.3 GiB free, at least 32: all at once")
    assert choose_tokenize_chunk(SMALL_GPU) == (512, "Tesla T4 has 14.6 GiB free, under 32: the bounded path")
    at_the_threshold = DeviceMemory(kind="cuda", name="GPU", free_gb=FAST_PATH_FREE_GB)
    assert choose_tokenize_chunk(at_the_threshold)[0] is None and BOUNDED_TOKENIZE_CHUNK == 512
    # forward only (eval, infer): half of the free memory, against which the plan sizes each image
    assert values(forward_only_settings(CPU)) == {"tokenize_chunk": 512, "memory_budget_gb": 10.0,
                                                  "activation_checkpoint": []}
    large = values(forward_only_settings(LARGE_GPU))
    assert large == {"tokenize_chunk": None, "memory_budget_gb": 69.65, "activation_checkpoint": []}
    small = values(forward_only_settings(SMALL_GPU))
    assert small == {"tokenize_chunk": 512, "memory_budget_gb": 7.3, "activation_checkpoint": []}
    for device in (CPU, LARGE_GPU, SMALL_GPU):  # training keeps the dense computation
        assert choose_memory_budget(device, training=True) == (None, "training keeps the dense computation")
    assert choose_fused_optimizer("cuda", "32-true") == (True, "torch has a fused kernel for cuda parameters")
    assert choose_fused_optimizer("cpu", "32-true") == (True, "torch has a fused kernel for cpu parameters")
    assert choose_fused_optimizer("meta", "32-true")[0] is None
    assert choose_fused_optimizer("cuda", "bf16-mixed")[0] is True
    assert choose_fused_optimizer("cuda", "16-mixed") == (
        None, "under 16-mixed the gradients are clipped before a fused optimiser unscales them: torch's choice"
    )


@pytest.fixture
def simulated_device(monkeypatch):
    """Makes `describe_device`, the one function that reads the device, report the DeviceMemory given."""

    def simulate(described: DeviceMemory | None) -> None:
        def describe(device: torch.device) -> DeviceMemory:
            if described is None:
                raise AssertionError(f"the device ({device}) was read although no setting says auto")
            return described

        monkeypatch.setattr(device_settings, "describe_device", describe)

    return simulate


def test_a_task_takes_the_choice_for_its_device_and_keeps_a_value_the_user_set(simulated_device, caplog):
    backbone = compose_tiny_config().backbone
    chosen = {}
    for device in (CPU, LARGE_GPU, SMALL_GPU):
        simulated_device(device)
        with caplog.at_level(logging.INFO, logger="flowformer.device_settings"):
            settings = device_memory_settings(backbone, torch.device(device.kind), training=False)
        chosen[device.name] = (settings.tokenize_chunk, settings.memory_budget_gb, settings.activation_checkpoint)
    assert chosen == {"cpu": (512, 10.0, []), "NVIDIA H200": (None, 69.65, []), "Tesla T4": (512, 7.3, [])}
    assert (
        "backbone.memory_budget_gb=auto -> 7.3 (50% of the 14.6 GiB free on the Tesla T4: dense wherever the "
        "image's estimate fits; set backbone.memory_budget_gb to choose)"
    ) in caplog.text
    simulated_device(None)
    user = OmegaConf.merge(backbone, {"tokenize_chunk": 64, "memory_budget_gb": None, "activation_checkpoint": []})
    assert device_memory_settings(user, torch.device("cuda"), training=False) == user


def test_the_numbers_are_the_same_whichever_path_the_choice_takes(simulated_device):
    """On the CPU, the network chosen for a large GPU (every cost map at once, a budget that keeps the dense plan)
    and for a GPU with almost no memory free (512 cost maps at a time, a budget that bounds the plan) give the
    same flow."""
    image1, image2 = torch.rand(2, 1, 3, 256, 256, generator=torch.Generator().manual_seed(0)) * 255
    flows, plans = [], []
    for device in (LARGE_GPU, DeviceMemory(kind="cuda", name="a full GPU", free_gb=0.002)):
        simulated_device(device)
        chosen = device_memory_settings(compose_tiny_config().backbone, torch.device("cuda"), training=False)
        torch.manual_seed(0)
        net = load_network(chosen, None, torch.device("cpu"))
        plans.append(net.memory_plan(1, 32, 32).dense)
        with torch.no_grad():
            flows.append(net(image1, image2, iters=3)["flow"])
    assert plans == [True, False]  # the dense computation, then the bounded one
    torch.testing.assert_close(flows[1], flows[0], rtol=0, atol=1e-4)


def test_bench_says_what_it_chose_for_the_cpu_and_keeps_a_value_the_user_set(tmp_path):
    checkout = fresh_checkout(tmp_path)
    common = ("task=bench", "backbone=tiny", "bench.device=cpu", "bench.sizes=[[64,96]]", "bench.iters=1",
              "bench.repeats=1", "bench.warmup=0")
    chosen = run_py(*common, "hydra.run.dir=chosen", cwd=checkout, timeout=600)
    said = "backbone.tokenize_chunk=auto -> 512 (on the cpu, the bounded path is also the faster; set"
    assert said in chosen.stdout + chosen.stderr
    assert "backbone.memory_budget_gb=auto -> " in chosen.stdout + chosen.stderr
    [row] = json.loads((checkout / "chosen" / "bench.json").read_text())["rows"]
    assert row["tokenize_chunk"] == 512 and row["memory_budget_gb"] > 0  # half of this machine's free memory
    assert row["path"] == f"budget {row['memory_budget_gb']:g} GB"
    user = ("backbone.tokenize_chunk=null", "backbone.memory_budget_gb=null", "backbone.activation_checkpoint=[]",
            "hydra.run.dir=kept")
    kept = run_py(*common, *user, cwd=checkout, timeout=600)
    assert "=auto" not in kept.stdout + kept.stderr
    [row] = json.loads((checkout / "kept" / "bench.json").read_text())["rows"]
    assert row["tokenize_chunk"] is None and row["memory_budget_gb"] is None and row["path"] == "dense"


def test_training_records_what_it_chose_in_run_info_and_keeps_what_the_user_set(tmp_path):
    """A CPU training run (debug=tiny) chooses tokenize_chunk 512, the dense computation, no recomputation (a CPU
    keeps every activation) and the fused AdamW, says so, records the memory settings in run_info.json and trains with that
    optimiser; the same command with the user's values keeps them; under bf16-mixed the fused AdamW's step is the
    unfused one's."""
    checkout = fresh_checkout(tmp_path)
    chosen = run_py("debug=tiny", "trainer.max_steps=1", "hydra.run.dir=chosen", cwd=checkout, timeout=600)
    said = chosen.stdout + chosen.stderr
    assert "backbone.memory_budget_gb=auto -> null (training keeps the dense computation; set" in said
    assert "model.optimizer.fused=auto -> True (torch has a fused kernel for cpu parameters; set" in said
    assert "backbone.activation_checkpoint=auto -> [] (on the cpu every activation is kept: " in said
    run_info = json.loads((checkout / "chosen" / "run_info.json").read_text())
    assert run_info["memory_settings"] == {"tokenize_chunk": 512, "memory_budget_gb": None, "activation_checkpoint": []}
    assert optimizer_settings(checkout / "chosen")["fused"] is True

    user = ("backbone.tokenize_chunk=64", "backbone.memory_budget_gb=2", "model.optimizer.fused=null",
            "backbone.activation_checkpoint=[decoder]", "hydra.run.dir=kept")
    kept = run_py("debug=tiny", "trainer.max_steps=1", *user, cwd=checkout, timeout=600)
    assert "=auto" not in kept.stdout + kept.stderr
    run_info = json.loads((checkout / "kept" / "run_info.json").read_text())
    recorded = {"tokenize_chunk": 64, "memory_budget_gb": 2, "activation_checkpoint": ["decoder"]}
    assert run_info["memory_settings"] == recorded
    assert optimizer_settings(checkout / "kept")["fused"] is None

    # bf16-mixed (trainer=gpu's precision), whose fused optimiser the module clips itself (Lightning's plugin
    # refuses it): the weights after a clipped step are those of torch's own kernel clipped by Lightning
    weights = {}
    for fused in ("auto", "null"):
        run_py("debug=tiny", "trainer.precision=bf16-mixed", f"model.optimizer.fused={fused}",  # 2 steps
               f"hydra.run.dir=mixed_{fused}", cwd=checkout, timeout=600)
        checkpoint = torch.load(checkout / f"mixed_{fused}" / "checkpoints" / "last.ckpt")
        assert checkpoint["optimizer_states"][0]["param_groups"][0]["fused"] is (True if fused == "auto" else None)
        weights[fused] = checkpoint["state_dict"]
    for key, value in weights["null"].items():
        torch.testing.assert_close(weights["auto"][key], value, rtol=0, atol=1e-6)


def test_under_bf16_mixed_the_module_clips_a_fused_optimisers_gradients():
    """Lightning's mixed-precision plugin refuses to clip a fused optimiser's gradients (for 16-mixed, where the
    optimiser unscales them in its step); under bf16-mixed the module clips them itself, to the trainer's norm."""
    model = build_model(compose_tiny_config("trainer=cpu"))
    model.trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=2, logger=False)
    optimizer = model.configure_optimizers()["optimizer"]
    assert optimizer.param_groups[0]["fused"] is True
    for parameter in model.trainable_parameters():
        parameter.grad = torch.full_like(parameter, 10.0)
    model.configure_gradient_clipping(optimizer, gradient_clip_val=1.0)
    norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in model.trainable_parameters()])
    assert torch.linalg.vector_norm(norms).item() == pytest.approx(1.0, rel=1e-5)


def optimizer_settings(run_dir: Path) -> dict:
    """The settings of the optimiser a run trained with, from its last checkpoint (one parameter group)."""
    [param_group] = torch.load(run_dir / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"]
    return param_group


def test_training_builds_the_backbone_with_the_choice_for_the_trainer_device(caplog):
    with caplog.at_level(logging.INFO, logger="flowformer.device_settings"):
        model = build_model(compose_tiny_config("trainer=cpu"))
    assert "backbone.tokenize_chunk=auto -> 512 (on the cpu" in caplog.text
    assert model.backbone.cost_encoder.tokenize_chunk == 512 and model.hparams.backbone["tokenize_chunk"] == 512
    assert model.backbone.memory_budget_gb is None and model.hparams.backbone["memory_budget_gb"] is None
    kept = build_model(compose_tiny_config("trainer=cpu", "backbone.tokenize_chunk=7"))
    assert kept.backbone.cost_encoder.tokenize_chunk == 7
    if torch.cuda.is_available():
        assert training_device(compose_tiny_config("trainer=gpu").trainer) == torch.device("cuda")
    else:  # refused before any work (tests/tasks/test_errors.py runs it)
        with pytest.raises(ValueError, match=r"trainer.accelerator=gpu \(trainer=gpu and trainer=ddp\) asks for a GPU"):
            training_device(compose_tiny_config("trainer=gpu").trainer)
    assert training_device(compose_tiny_config("trainer=cpu").trainer) == torch.device("cpu")


def test_a_network_built_without_a_device_takes_the_bounded_tokenization_and_the_dense_plan():
    net = build_backbone()  # conf/backbone/tiny.yaml as it is: tokenize_chunk and memory_budget_gb auto
    assert net.config["tokenize_chunk"] == "auto" and net.cost_encoder.tokenize_chunk == BOUNDED_TOKENIZE_CHUNK
    assert net.config["memory_budget_gb"] == "auto" and net.memory_budget_gb is None
    assert net.config["activation_checkpoint"] == "auto"  # and nothing recomputed:
    flags = ("checkpoint_tokenize", "checkpoint_layers", "checkpoint_iterations", "checkpoint_blocks")
    assert not any(getattr(module, flag, False) for module in net.modules() for flag in flags)
    assert any(hasattr(module, "checkpoint_iterations") for module in net.modules())
    with pytest.raises(ValueError, match="backbone.tokenize_chunk must be a positive number of cost maps, null or"):
        build_backbone(tokenize_chunk="fast")
    with pytest.raises(ValueError, match=r"backbone.memory_budget_gb must be a number of GB > 0, null \(dense\) or"):
        build_backbone(memory_budget_gb="dense")


def a_step(*overrides: str) -> tuple[TrainingStep, DictConfig]:
    """The training step `python run.py <overrides>` sizes backbone.activation_checkpoint for, and its config."""
    cfg = compose_run_config(list(overrides))
    return training_step(cfg), cfg


def saved_by_a_real_step(cfg: DictConfig, stages: list[str]) -> float:
    """GiB of the storages a real training step of cfg.model on the CPU keeps for backward (each storage once, the
    weights apart): the module's own loss (the sequence loss, MCVA's pretrain_step) on random images."""
    backbone = OmegaConf.merge(cfg.backbone, {"activation_checkpoint": stages, "twins_weights": None})
    torch.manual_seed(0)
    module = hydra.utils.instantiate(cfg.model, backbone=backbone).train()
    weights = {parameter.untyped_storage().data_ptr() for parameter in module.parameters()}
    saved = {}

    def count(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    (height, width), batch = training_crop(OmegaConf.to_container(cfg.data.train, resolve=True)), cfg.data.batch_size
    image1, image2 = torch.rand(2, batch, 3, height, width) * 255
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        if cfg.task == "pretrain":
            module.pretrain_step(image1, image2).loss.backward()
        else:
            predictions = module.backbone(image1, image2, iters=module.hparams.train_iters)["flow_predictions"]
            flow = torch.randn(batch, 2, height, width)
            sequence_loss(predictions, flow, torch.ones(batch, height, width))[0].backward()
    return sum(saved.values()) / 2**30


@pytest.mark.parametrize("objective", [
    ("backbone=tiny", "data=synthetic", "trainer=cpu"),
    ("experiment=mcva_pretrain", "backbone=tiny", "data=synthetic_video", "trainer=cpu", "data.batch_size=2"),
], ids=["supervised", "mcva"])
def test_the_estimate_is_what_a_real_step_keeps_for_backward(objective):
    """The estimate, from fake tensors with every cost map tokenized at once, against the tensors a real step on
    the CPU keeps tokenizing 50 cost maps at a time (tiny network, 64x96, batch 2 or 4: 192 or 384 cost maps),
    keeping everything and recomputing two stages."""
    step, cfg = a_step(*objective)
    backbone_yaml = OmegaConf.to_yaml(OmegaConf.merge(cfg.backbone, {"tokenize_chunk": None}), resolve=True)
    cfg = OmegaConf.merge(cfg, {"backbone": {"tokenize_chunk": 50}})
    for stages in ([], ["tokenize", "decoder"]):
        estimate = estimate_step_memory(step, backbone_yaml, tuple(stages), False).saved_gb
        assert estimate == pytest.approx(saved_by_a_real_step(cfg, stages), rel=0.02), stages


# backbone.activation_checkpoint chosen for (experiment, device); the estimates, stage by stage: docs/performance.md
EXPECTED_CHOICES = {
    ("mcva_pretrain", "cpu"): [],  # not sized: a CPU keeps every activation
    ("mcva_pretrain", "NVIDIA H200"): [],
    ("mcva_pretrain", "Tesla T4"): ["decoder", "cost_layers", "tokenize"],
    ("chairs", "cpu"): [],
    ("chairs", "NVIDIA H200"): [],
    ("chairs", "Tesla T4"): ["cost_layers", "image_encoders"],
}


def test_recomputation_is_chosen_for_the_step_on_a_cpu_an_h200_and_a_t4(simulated_device, caplog):
    """backbone.activation_checkpoint=auto (the default) for the MCVA experiment (batch 24) and the supervised
    chairs stage (batch 8), both 368x496 under bf16-mixed: every activation kept where the estimated step fits
    the GPU's free memory, else the stages freeing the most memory per recomputed FLOP first; on a CPU, every
    activation kept without sizing the step (a CPU-second per training run)."""
    chosen = {}
    for experiment in ("mcva_pretrain", "chairs"):
        step, cfg = a_step(f"experiment={experiment}")
        assert (step.batch, step.height, step.width, step.precision) == (
            24 if experiment == "mcva_pretrain" else 8, 368, 496, "bf16-mixed"
        )
        for device in (CPU, LARGE_GPU, SMALL_GPU):
            simulated_device(device)
            with caplog.at_level(logging.INFO, logger="flowformer.device_settings"):
                settings = device_memory_settings(cfg.backbone, torch.device(device.kind), training=True, step=step)
            chosen[experiment, device.name] = list(settings.activation_checkpoint)
    assert chosen == EXPECTED_CHOICES
    assert "backbone.activation_checkpoint=auto -> [] (the step's estimated peak, " in caplog.text
    assert "auto -> [] (on the cpu every activation is kept: recomputation is sized for a GPU's memory;" in caplog.text
    simulated_device(None)
    user = ("backbone.tokenize_chunk=512", "backbone.memory_budget_gb=null", "backbone.activation_checkpoint=[]")
    step, cfg = a_step("experiment=mcva_pretrain", *user)
    kept = device_memory_settings(cfg.backbone, torch.device("cuda"), training=True, step=step)
    assert list(kept.activation_checkpoint) == []


def test_the_stages_chosen_for_a_full_device_give_the_same_loss_and_gradients(simulated_device):
    """The tiny network chosen for an H200 (nothing recomputed) and for a GPU with almost nothing free (stages
    recomputed) trains to bitwise the same loss and gradients on the same batch."""
    cfg = compose_tiny_config("trainer=cpu")
    image1, image2 = torch.rand(2, 2, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 255
    flow = torch.randn(2, 2, 64, 96, generator=torch.Generator().manual_seed(1))
    results = {}
    for device in (LARGE_GPU, DeviceMemory(kind="cuda", name="a full GPU", free_gb=0.001)):
        simulated_device(device)
        torch.manual_seed(0)
        module = build_model(cfg)
        predictions = module.backbone(image1, image2, iters=2)["flow_predictions"]
        loss = sequence_loss(predictions, flow, torch.ones(2, 64, 96))[0]
        loss.backward()
        gradients = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
        results[device.name] = (module.hparams.backbone["activation_checkpoint"], loss, gradients)
    (kept, loss, gradients), (recomputed, loss_again, gradients_again) = results.values()
    assert kept == [] and len(recomputed) >= 3
    assert torch.equal(loss, loss_again) and gradients.keys() == gradients_again.keys()
    for name, gradient in gradients.items():
        assert torch.equal(gradient, gradients_again[name]), name

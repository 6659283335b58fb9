"""What a training or validation step through Lightning asks of the device, counted as torch dispatches it
(bf16-mixed on the CPU, tiny backbone, a trainer built from conf/trainer):

- Casts: each weight once per step, as the bench's steps (whose GPU times docs/performance.md reports). Lightning
  2.6 opens autocast without its weight cache, so without `each_weight_cast_once` every decoder iteration (every
  MCVA query round) cast every weight again; the trainer configs validate under torch.no_grad
  (`inference_mode: false`), where autocast keeps its casts.
- Host reads: one a training step, the loss and the gradient norm checked together before the optimiser step
  (`defer_finite_check`); on a GPU each read waits for every queued kernel."""

import hydra
import lightning as L
import pytest
import torch

from flowformer.eval.protocol import validation_protocol
from flowformer.tasks import bench
from flowformer.tasks.runtime import InferenceContext
from flowformer.tasks.train import build_model

from helpers.compose import compose_tiny_config
from helpers.dispatch import CAST, HOST_READ, Dispatched

# {module: (its run's overrides, the knob that repeats the network's rounds, bench.mode of its step)}
STEPS = {
    "flow": (["debug=tiny"], "model.train_iters", "train"),
    "mcva": (
        ["experiment=mcva_pretrain", "backbone=tiny", "data=synthetic_video", "trainer=cpu", "data.batch_size=2"],
        "model.query_num",
        "pretrain",
    ),
}


class Gradients(L.Callback):
    """The names of the parameters that have a gradient when the optimiser steps."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.names = {name for name, p in pl_module.named_parameters() if p.grad is not None}


def trainer_from_config(cfg, tmp_path, callbacks=()) -> L.Trainer:
    """The trainer of the run's config (conf/trainer and its overrides), without loggers, checkpoints or the
    run's own callbacks."""
    return hydra.utils.instantiate(
        cfg.trainer, logger=False, callbacks=list(callbacks), enable_checkpointing=False, default_root_dir=tmp_path
    )


def fit_one_step(overrides: list[str], precision: str, tmp_path) -> tuple[int, set[str]]:
    """(casts dispatched, names of the parameters with a gradient) in one training step of
    `python run.py <overrides>`'s module and data, at `precision`."""
    cfg = compose_tiny_config(*overrides, f"trainer.precision={precision}", "trainer.max_steps=1")
    torch.manual_seed(0)
    model = build_model(cfg)
    gradients = Gradients()
    trainer = trainer_from_config(cfg, tmp_path, [gradients])
    with Dispatched(CAST) as casts:
        trainer.fit(model, datamodule=hydra.utils.instantiate(cfg.data))
    return casts.count, gradients.names


def bench_step_casts(overrides: list[str], mode: str) -> int:
    """Casts dispatched in one steady bf16 step of bench's row for the same module (after the step that creates
    the optimizer's state), at the training crop of debug=tiny's data."""
    cfg = bench.row_config(
        compose_tiny_config(*overrides, "bench.device=cpu", f"bench.mode={mode}"), [64, 96], None, "bf16-mixed"
    )
    images = (torch.rand(2, 3, 64, 96) * 255, torch.rand(2, 3, 64, 96) * 255)
    _, step = bench.build_step(cfg, torch.device("cpu"), *images)
    step()
    with Dispatched(CAST) as casts:
        step()
    return casts.count


@pytest.mark.parametrize("module", list(STEPS))
def test_a_bf16_training_step_casts_per_round_as_the_bench_step(module, tmp_path):
    """Each round more (a decoder iteration; an MCVA query round) adds the same casts to Lightning's step as to
    the bench's, whose autocast keeps the weights' casts: those of its activations, no weight. Every parameter
    that has a gradient in full precision has one in bf16 (none lost to a cast kept from a torch.no_grad block)."""
    overrides, knob, mode = STEPS[module]
    lightning, gradients = {}, {}
    for rounds in (2, 4):
        lightning[rounds], gradients[rounds] = fit_one_step([*overrides, f"{knob}={rounds}"], "bf16-mixed", tmp_path)
    bench_casts = {
        rounds: bench_step_casts([*overrides, f"{knob}={rounds}", f"bench.iters={rounds}"], mode) for rounds in (2, 4)
    }
    assert lightning[4] - lightning[2] == bench_casts[4] - bench_casts[2]
    _, full_precision = fit_one_step([*overrides, f"{knob}=2"], "32-true", tmp_path)
    assert gradients[2] == full_precision and gradients[4] == full_precision


def test_a_bf16_validation_step_casts_per_iteration_as_task_eval(tmp_path):
    """Validation through the trainer config (`inference_mode: false`): a decoder iteration more adds the casts
    of task=eval's forward (torch.no_grad, autocast's cache), those of its activations, no weight."""
    per_run = {}
    for iters in (2, 4):
        cfg = compose_tiny_config("debug=tiny", f"model.val_iters={iters}", "trainer.precision=bf16-mixed")
        torch.manual_seed(0)
        model = build_model(cfg)
        with Dispatched(CAST) as casts:
            trainer_from_config(cfg, tmp_path).validate(
                model, datamodule=hydra.utils.instantiate(cfg.data), verbose=False
            )
        per_run[iters] = casts.count
    images = (torch.rand(2, 3, 64, 96) * 255, torch.rand(2, 3, 64, 96) * 255)
    network = model.backbone.eval()
    per_forward = {}
    for iters in (2, 4):
        with InferenceContext(torch.device("cpu"), "bf16-mixed", "test"), Dispatched(CAST) as casts:
            validation_protocol(None, iters).predict(network, *images)
        per_forward[iters] = casts.count
    assert per_run[4] - per_run[2] == per_forward[4] - per_forward[2]


class HostReads(L.Callback):
    """The host reads dispatched in the second training step, from its batch to its optimiser step."""

    def __init__(self) -> None:
        self.counter = Dispatched(HOST_READ)
        self.count: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            self.counter.__exit__(None, None, None)
            self.count = self.counter.count


# the supervised and the photometric steps; MCVA's step also reads the block sizes and offsets of its masks, drawn
# on the host by a CPU generator (nothing a GPU waits for)
READING_STEPS = {
    "flow": ["debug=tiny"],
    "unsup": ["experiment=unsup_pretrain", "backbone=tiny", "data=synthetic_video", "trainer=cpu", "data.batch_size=2"],
}


@pytest.mark.parametrize("module", list(READING_STEPS))
def test_a_training_step_reads_one_value_from_the_device(module, tmp_path):
    """The loss is not read after the forward (the CPU would wait for it before queuing the backward): it is
    checked with the gradient norm, in one read, before the optimiser step."""
    overrides = READING_STEPS[module]
    cfg = compose_tiny_config(*overrides, "model.train_iters=2", "trainer.max_steps=2", "trainer.limit_val_batches=0")
    torch.manual_seed(0)
    reads = HostReads()
    trainer = trainer_from_config(cfg, tmp_path, [reads])
    trainer.fit(build_model(cfg), datamodule=hydra.utils.instantiate(cfg.data))
    assert reads.count == 1

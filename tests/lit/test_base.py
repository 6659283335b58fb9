"""BackboneModule, the base of FlowModule and MCVAPretrainModule: the optimiser and LR schedule of the
composed config are the official AdamW + linear OneCycle, the constructor arguments are saved once as plain
values, a non-finite gradient stops training, and checkpoints written before model.optimizer / model.scheduler
still resume, initialise and load with load_from_checkpoint (or are refused in one line naming them)."""

import inspect
import re

import hydra
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.device_settings import choose_fused_optimizer
from flowformer.lit.base import NonFiniteLossError
from flowformer.lit.checkpointing import changed_settings, check_resume_checkpoint
from flowformer.lit.flow import FlowModule
from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.models.checkpoint import BackboneTargetError

from helpers.compose import compose_run_config
from helpers.configs import backbone_config, flow_settings, mcva_settings
from helpers.trainers import cpu_trainer

MAX_STEPS = 300
# The official fetch_optimizer and training loops: AdamW(eps=1e-8) and OneCycleLR(max_lr=lr,
# total_steps=num_steps + 100, pct_start=0.05, cycle_momentum=False, anneal_strategy="linear").
OFFICIAL_EPS, OFFICIAL_PCT_START, OFFICIAL_EXTRA_STEPS = 1e-8, 0.05, 100
TOTAL_STEPS = MAX_STEPS + OFFICIAL_EXTRA_STEPS
WARMUP_END = int(OFFICIAL_PCT_START * TOTAL_STEPS) - 1  # OneCycleLR's step of the peak LR
CHECKED_STEPS = (0, 1, WARMUP_END, WARMUP_END + 1, TOTAL_STEPS // 2, TOTAL_STEPS - 1)

# composed config -> (the official lr, weight decay) of that recipe
RECIPES = {
    "model=flow": ((), 2.5e-4, 1e-4),
    "experiment=things": (("experiment=things", "model.init_from=null"), 1.25e-4, 1e-4),
    "experiment=kitti": (("experiment=kitti", "model.init_from=null"), 1.25e-4, 1e-5),
    "experiment=mcva_pretrain": (("experiment=mcva_pretrain",), 5e-4, 1e-5),
}


def attach_trainer(module: L.LightningModule, max_steps: int = MAX_STEPS) -> L.LightningModule:
    module.trainer = cpu_trainer(max_steps=max_steps)
    return module


def learning_rates(optimizer: torch.optim.Optimizer, scheduler, steps: tuple[int, ...]) -> list[float]:
    """The LR at each of `steps`, stepping the schedule as the training loop does (once per iteration)."""
    rates = []
    for step in range(max(steps) + 1):
        if step in steps:
            rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_composed_optimiser_and_schedule_are_the_official_adamw_onecycle(recipe):
    overrides, lr, weight_decay = RECIPES[recipe]
    cfg = compose_run_config([*overrides, "backbone=tiny"])
    module = attach_trainer(hydra.utils.instantiate(cfg.model))
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]
    assert schedule["interval"] == "step"

    trainable = [p for p in module.backbone.parameters() if p.requires_grad]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    # conf/model/optimizer/adamw.yaml: fused auto, chosen for the CPU at the trainer's precision
    fused, _ = choose_fused_optimizer("cpu", module.trainer.precision)
    expected_optimizer = torch.optim.AdamW(copies, lr=lr, weight_decay=weight_decay, eps=OFFICIAL_EPS, fused=fused)
    expected_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        expected_optimizer, max_lr=lr, total_steps=TOTAL_STEPS, pct_start=OFFICIAL_PCT_START,
        cycle_momentum=False, anneal_strategy="linear",
    )  # fmt: skip
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults == expected_optimizer.defaults
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in trainable]
    if isinstance(module, MCVAPretrainModule):  # the frozen encoders are not optimised
        assert len(trainable) < len(list(module.backbone.parameters()))
    scheduler = schedule["scheduler"]
    assert type(scheduler) is torch.optim.lr_scheduler.OneCycleLR and scheduler.total_steps == TOTAL_STEPS
    got = learning_rates(optimizer, scheduler, CHECKED_STEPS)
    assert got == pytest.approx(
        learning_rates(expected_optimizer, expected_scheduler, CHECKED_STEPS), rel=1e-12
    )
    assert got[2] == pytest.approx(lr)  # the peak at the warm-up's end


@pytest.mark.parametrize("module_class", [FlowModule, MCVAPretrainModule])
def test_every_constructor_argument_is_saved_once_as_a_plain_value(module_class):
    model = "flow" if module_class is FlowModule else "mcva"
    cfg = compose_run_config([f"model={model}", "backbone=tiny"])
    module = hydra.utils.instantiate(cfg.model)
    assert list(module.hparams) == list(inspect.signature(module_class).parameters)
    for name in ("backbone", "optimizer", "scheduler"):
        assert type(module.hparams[name]) is dict, name
    assert module.hparams.scheduler["max_lr"] == module.hparams.optimizer["lr"]  # resolved, not `${...}`


def make_module(module_class):
    if module_class is FlowModule:
        return FlowModule(backbone=backbone_config(), **flow_settings(train_iters=2, val_iters=2))
    return MCVAPretrainModule(backbone=backbone_config(), **mcva_settings(query_num=2))


@pytest.mark.parametrize("module_class", [FlowModule, MCVAPretrainModule])
def test_a_non_finite_gradient_is_refused_before_the_step(module_class):
    module = make_module(module_class)
    parameters = module.trainable_parameters()
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    parameters[-1].grad[...] = float("nan")
    with pytest.raises(NonFiniteLossError, match="gradient norm"):
        module.on_before_optimizer_step(torch.optim.SGD(parameters, lr=0.0))


def test_an_optimizer_config_without_partial_is_refused_with_its_name():
    settings = flow_settings()
    settings["optimizer"] = {key: value for key, value in settings["optimizer"].items() if key != "_partial_"}
    module = attach_trainer(FlowModule(backbone=backbone_config(), **settings))
    with pytest.raises(ValueError, match=r"model.optimizer must be a Hydra partial \(`_partial_: true`\)"):
        module.configure_optimizers()


@pytest.mark.parametrize(
    ("group", "setting", "value", "message"),
    [
        ("optimizer", "lr", -1, "model.optimizer (torch.optim.AdamW) refuses its settings: Invalid learning rate: -1"),
        ("optimizer", "foo", 1, "model.optimizer (torch.optim.AdamW) refuses its settings: AdamW.__init__() got an"),
        ("scheduler", "pct_start", 2, "model.scheduler (torch.optim.lr_scheduler.OneCycleLR) refuses its settings: E"),
        ("optimizer", "lr", "abc", "model.optimizer.lr='abc' (torch.optim.AdamW takes a number): set it to such"),
        ("optimizer", "fused", "maybe", "model.optimizer.fused='maybe' (torch.optim.AdamW takes true or false or null)"),
        ("scheduler", "pct_start", "abc", "model.scheduler.pct_start='abc' (torch.optim.lr_scheduler.OneCycleLR takes a"),
        ("scheduler", "anneal_strategy", "lin", "model.scheduler.anneal_strategy='lin' (torch.optim.lr_scheduler.One"),
        ("scheduler", "total_steps", "abc", "model.scheduler.total_steps='abc': expected a whole number"),
    ],
)
def test_a_setting_the_optimizer_or_schedule_refuses_is_one_line_naming_it(group, setting, value, message):
    """`model.optimizer.lr=-1`, `+model.optimizer.foo=1`, `model.scheduler.pct_start=2`: torch's own error (a
    traceback for the TypeErrors) named no setting; now a ValueError naming the group. A word where torch's class
    takes a number, true/false or one of some words (`model.optimizer.lr=abc`: torch compared it with 0;
    `model.scheduler.pct_start=abc`: it multiplied the word by the steps; `model.scheduler.total_steps=abc`: a
    traceback) is refused naming the setting and what the class takes, before torch is called."""
    settings = flow_settings()
    settings[group][setting] = value
    module = attach_trainer(FlowModule(backbone=backbone_config(), **settings))
    with pytest.raises(ValueError) as error:
        module.configure_optimizers()
    assert str(error.value).startswith(message)


def test_a_schedule_length_hydra_read_as_a_float_is_the_whole_number_it_counts():
    """`model.scheduler.total_steps=1e3`: Hydra reads 1000.0, which torch's OneCycleLR refused."""
    settings = flow_settings()
    settings["scheduler"]["total_steps"] = 1e3
    schedule = attach_trainer(FlowModule(backbone=backbone_config(), **settings)).configure_optimizers()
    assert schedule["lr_scheduler"]["scheduler"].total_steps == 1000


def test_a_schedule_of_null_length_needs_trainer_max_steps():
    with pytest.raises(ValueError, match="trainer.max_steps is -1"):
        attach_trainer(make_module(FlowModule), max_steps=-1).configure_optimizers()


def test_a_schedule_shorter_than_trainer_max_steps_is_refused_before_training():
    """torch's OneCycleLR would stop the run with 'Tried to step 5 times' one step past its end."""
    settings = flow_settings()
    settings["scheduler"]["total_steps"] = 4
    module = FlowModule(backbone=backbone_config(), **settings)
    with pytest.raises(ValueError, match=r"model.scheduler.total_steps=4 is below trainer.max_steps=5"):
        attach_trainer(module, max_steps=5).configure_optimizers()
    attach_trainer(module, max_steps=4).configure_optimizers()  # a schedule covering the run


def test_a_checkpoint_with_the_former_optimiser_hyperparameters_resumes_and_initialises(tmp_path):
    """Checkpoints written before model.optimizer / model.scheduler hold lr, weight_decay, total_steps and
    pct_start as hyperparameters: resuming rebuilds the module from the config and initialising reads only
    `backbone`, so both still work."""
    data = DataLoader(SyntheticFlowDataset(num_samples=3, size=(64, 96), seed=1), batch_size=1)

    def fit(module: FlowModule, max_steps: int, ckpt_path=None) -> L.Trainer:
        trainer = cpu_trainer(max_steps=max_steps, default_root_dir=tmp_path, limit_val_batches=0)
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return trainer

    trained = make_module(FlowModule)
    fit(trained, max_steps=2).save_checkpoint(tmp_path / "new.ckpt")
    checkpoint = torch.load(tmp_path / "new.ckpt", weights_only=True)
    hparams = {k: v for k, v in checkpoint["hyper_parameters"].items() if k not in ("optimizer", "scheduler")}
    former = {"lr": 2.5e-4, "weight_decay": 1e-4, "total_steps": None, "pct_start": 0.05}
    checkpoint["hyper_parameters"] = {**hparams, **former}
    torch.save(checkpoint, tmp_path / "former.ckpt")

    initialised = FlowModule(
        backbone=backbone_config(), **flow_settings(init_from=str(tmp_path / "former.ckpt"))
    )
    for key, value in trained.backbone.state_dict().items():
        torch.testing.assert_close(initialised.backbone.state_dict()[key], value)
    # run.py's checks before a resume: the former names are compared by their setting now, all equal here
    resuming = make_module(FlowModule)
    assert changed_settings(check_resume_checkpoint(tmp_path / "former.ckpt", resuming, 3), resuming) == []
    resumed = fit(resuming, max_steps=3, ckpt_path=tmp_path / "former.ckpt")
    assert resumed.global_step == 3
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == 3

    # Lightning's own loader: the former values are the partials they meant, here conf/model/flow.yaml's
    loaded = FlowModule.load_from_checkpoint(tmp_path / "former.ckpt", weights_only=True)
    settings = flow_settings()
    unfused = {key: value for key, value in settings["optimizer"].items() if key != "fused"}
    assert loaded.hparams.optimizer == unfused  # they were built with torch's default AdamW kernel
    assert loaded.hparams.scheduler == settings["scheduler"]
    for key, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    configured = attach_trainer(loaded, max_steps=2).configure_optimizers()
    assert configured["optimizer"].defaults["lr"] == former["lr"]


def former_checkpoint(path, drop=(), **hparams) -> str:
    """A Lightning checkpoint of a tiny FlowModule in the former shape (lr, weight_decay, total_steps and
    pct_start instead of optimizer and scheduler) without the hyper-parameters `drop`, with `hparams`."""
    module = make_module(FlowModule)
    current = {k: v for k, v in module.hparams.items() if k not in ("optimizer", "scheduler", *drop)}
    former = {"lr": 2.5e-4, "weight_decay": 1e-4, "total_steps": None, "pct_start": 0.05}
    former = {name: value for name, value in former.items() if name not in drop}
    hparams = {**current, **former, **hparams}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams}
    torch.save({**checkpoint, "pytorch-lightning_version": L.__version__}, path)
    return str(path)


@pytest.mark.parametrize(
    ("drop", "hparams", "error", "message"),
    [
        (("weight_decay",), {}, ValueError, r"hold lr, total_steps, pct_start without weight_decay, so they"),
        ((), {"optimizer": {"lr": 1.0}}, ValueError, r"hold lr, .* beside optimizer, so they cannot be"),
        (("gamma",), {}, ValueError, r"lacks the hyper-parameters gamma that FlowModule takes"),
        ((), {"backbone": {"_target_": "builtins.print"}}, BackboneTargetError, r"`_target_: builtins.print"),
    ],
    ids=["some-former-names", "former-and-current", "missing-argument", "backbone-target"],
)
def test_a_former_checkpoint_that_cannot_be_loaded_is_one_line_naming_it(
    tmp_path, drop, hparams, error, message
):
    path = former_checkpoint(tmp_path / "former.ckpt", drop, **hparams)
    with pytest.raises(error, match=rf"^checkpoint {re.escape(path)}\b.*{message}") as info:
        FlowModule.load_from_checkpoint(path, weights_only=True)
    assert "\n" not in str(info.value)


def test_partials_passed_to_load_from_checkpoint_replace_settings_that_cannot_be_mapped(tmp_path):
    path = former_checkpoint(tmp_path / "former.ckpt", ("weight_decay",))
    settings = flow_settings()
    loaded = FlowModule.load_from_checkpoint(
        path, weights_only=True, optimizer=settings["optimizer"], scheduler=settings["scheduler"]
    )
    assert loaded.hparams.optimizer == settings["optimizer"] and "lr" not in loaded.hparams


@pytest.mark.parametrize(
    ("group", "partial"),
    [
        ("optimizer", {"_target_": "builtins.print", "_partial_": True}),
        ("optimizer", {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": {"_target_": "builtins.print"}}),
        ("scheduler", {"_target_": "torch.optim.os.system", "_partial_": True}),
    ],
    ids=["other-code", "nested-target", "through-a-module"],
)
def test_a_checkpoint_whose_optimiser_names_other_code_is_refused_by_load_from_checkpoint(
    tmp_path, group, partial
):
    """Fitting the loaded module would call the stored partial (and first, through Hydra, what it nests)."""
    module = make_module(FlowModule)
    path = tmp_path / "stored.ckpt"
    hparams = {**module.hparams, group: partial}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams}
    torch.save({**checkpoint, "pytorch-lightning_version": L.__version__}, path)
    refused = rf"^checkpoint {re.escape(str(path))} names model.{group} `_target_: "
    with pytest.raises(ValueError, match=refused):
        FlowModule.load_from_checkpoint(path, weights_only=True)
    with open(path, "rb") as file, pytest.raises(ValueError, match=refused):  # a file object too
        FlowModule.load_from_checkpoint(file, weights_only=True)

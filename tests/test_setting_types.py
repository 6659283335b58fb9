"""The trainer, logger and callback settings checked against the types the installed Lightning (and our own
callbacks) annotate: what the shipped configs give passes unchanged, a word given for a number is refused naming
each setting, and a count written as a float is counted."""

import itertools

import pytest
from omegaconf import OmegaConf

from flowformer.device_settings import optimizer_device_settings
from flowformer.setting_types import (
    check_against_shipped,
    check_setting_types,
    in_plain_node,
    instantiate_partial,
)
from flowformer.tasks.run_setup import instantiate_setting

from helpers.compose import compose_run_config
from helpers.configs import CONF_DIR

EXPERIMENTS = sorted(path.stem for path in (CONF_DIR / "experiment").glob("*.yaml"))
TRAINERS = sorted(path.stem for path in (CONF_DIR / "trainer").glob("*.yaml"))
GIVEN_BY_THE_CODE = ("logger", "callbacks", "plugins", "backbone")


def built_nodes(cfg):
    """(setting, node) of everything a training run builds from the config: the data, the model (its backbone
    is the network's, `BackboneConfig`), the trainer, callbacks, loggers."""
    yield "data", cfg.data
    yield "model", cfg.model
    yield "trainer", cfg.trainer
    for group in ("callbacks", "logger"):
        for key, node in (cfg.get(group) or {}).items():
            if node is not None and "_target_" in node:
                yield f"{group}.{key}", node


@pytest.mark.parametrize(("experiment", "trainer"), list(itertools.product(EXPERIMENTS, TRAINERS)))
def test_every_shipped_setting_has_the_type_its_class_annotates(experiment, trainer):
    """If Lightning changes an annotation so that a shipped value no longer fits, this fails here rather than
    refusing a user's run."""
    # data.batch_size: the batch of a process, which a training run sets first (from the experiment's global one)
    cfg = compose_run_config([f"experiment={experiment}", f"trainer={trainer}", "logger=many", "data.batch_size=2"])
    for setting, node in built_nodes(cfg):
        before = OmegaConf.to_yaml(node)
        check_setting_types(node, setting, given_elsewhere=GIVEN_BY_THE_CODE)
        assert OmegaConf.to_yaml(node) == before, setting


@pytest.mark.parametrize(("experiment", "trainer"), list(itertools.product(EXPERIMENTS, TRAINERS)))
def test_every_shipped_optimizer_and_schedule_setting_has_the_type_torch_annotates(experiment, trainer):
    """The optimiser and LR schedule partials are checked against torch's classes when the module builds them
    (`instantiate_partial`, with what it passes: the fused kernel chosen for the device, the schedule's length):
    if torch changes an annotation so that a shipped value no longer fits, this fails here."""
    cfg = compose_run_config([f"experiment={experiment}", f"trainer={trainer}"])
    optimizer = OmegaConf.to_container(cfg.model.optimizer, resolve=True)
    on_device = optimizer_device_settings(optimizer, "cpu", str(cfg.trainer.precision), "model.optimizer")
    instantiate_partial(optimizer, "model.optimizer", **on_device)
    scheduler = OmegaConf.to_container(cfg.model.scheduler, resolve=True)
    instantiate_partial(scheduler, "model.scheduler", total_steps=scheduler["total_steps"] or 100)


@pytest.mark.parametrize("data", sorted(path.stem for path in (CONF_DIR / "data").glob("*.yaml")))
def test_every_shipped_data_config_has_the_types_its_data_module_annotates(data):
    cfg = compose_run_config([f"data={data}", "data.batch_size=8"])
    before = OmegaConf.to_yaml(cfg.data)
    check_setting_types(cfg.data, "data")
    assert OmegaConf.to_yaml(cfg.data) == before


def test_a_model_setting_of_the_wrong_type_names_the_lightning_module():
    cfg = compose_run_config(["experiment=mcva_pretrain", "model.mask_ratio=high", "model.masking=blocks"])
    with pytest.raises(ValueError) as refusal:
        check_setting_types(cfg.model, "model", given_elsewhere=("backbone",))
    assert str(refusal.value) == (
        "model.masking='blocks' (flowformer.lit.mcva.MCVAPretrainModule takes 'block' or 'random'); "
        "model.mask_ratio='high' (flowformer.lit.mcva.MCVAPretrainModule takes a number): set them to such a value"
    )


def trainer_node(**settings):
    return OmegaConf.create({"_target_": "lightning.pytorch.Trainer", **settings})


def test_each_value_of_the_wrong_type_is_named_with_what_it_takes():
    node = trainer_node(
        max_epochs="abc", precision=17, devices=[0, "x"], limit_val_batches=0.5, accelerator="cpu"
    )
    with pytest.raises(ValueError) as refusal:
        check_setting_types(node, "trainer")
    assert str(refusal.value).startswith(
        "trainer.max_epochs='abc' (lightning.pytorch.Trainer takes a whole number or null); "
        "trainer.precision=17 (lightning.pytorch.Trainer takes 64, 32, 16, "
    )
    assert "'bf16-mixed'" in str(refusal.value)
    assert str(refusal.value).endswith(
        "trainer.devices=[0, 'x'] (lightning.pytorch.Trainer takes a list (each a whole number), a string or a "
        "whole number): set them to such a value"
    )


def test_a_target_that_cannot_be_imported_or_is_no_class_names_the_setting():
    node = trainer_node()
    node._target_ = "lightning.Trainr"
    with pytest.raises(ValueError) as refusal:
        check_setting_types(node, "trainer")
    assert str(refusal.value).startswith(
        "trainer._target_=lightning.Trainr is not a class that can be imported (Error loading 'lightning.Trainr': "
    )
    with pytest.raises(ValueError) as refusal:
        instantiate_partial({"_target_": "torch.optim.adamw", "_partial_": True}, "model.optimizer")
    assert str(refusal.value) == (
        "model.optimizer._target_=torch.optim.adamw is not a class that can be imported (Located non-class of type "
        "'module' while loading 'torch.optim.adamw'): set it to the dotted path of a class, as the shipped configs do"
    )


@pytest.mark.parametrize(
    ("setting", "value"),
    [("benchmark", "maybe"), ("benchmark", 1), ("max_steps", True), ("accumulate_grad_batches", 2.5)],
)
def test_values_that_only_look_like_the_type_are_refused(setting, value):
    """1 is no bool for cudnn's benchmark, true no step count, 2.5 no whole number of batches."""
    with pytest.raises(ValueError, match=f"^trainer.{setting}="):
        check_setting_types(trainer_node(**{setting: value}), "trainer")


def test_a_count_written_as_a_float_is_counted_and_a_number_where_a_string_fits_is_that_string(tmp_path):
    """`trainer.max_epochs=1e3` (Hydra reads 1000.0; Lightning asserts an int) trains 1000 epochs; a wandb
    project written as a number (`logger.wandb.project=2026`) is that name, though one of WandbLogger's annotations
    names a type only type checkers import; a fraction stays a fraction."""
    trainer = instantiate_setting(
        trainer_node(
            max_epochs=1e3, limit_val_batches=0.5, enable_progress_bar=False, enable_model_summary=False
        ),
        "trainer",
        logger=False,
    )
    assert trainer.max_epochs == 1000 and isinstance(trainer.max_epochs, int)
    assert trainer.limit_val_batches == 0.5
    logger = instantiate_setting(
        OmegaConf.create(
            {
                "_target_": "lightning.pytorch.loggers.WandbLogger",
                "project": 2026,
                "save_dir": str(tmp_path),
                "offline": True,
            }
        ),
        "logger.wandb",
    )
    assert logger._wandb_init["project"] == "2026"


@pytest.mark.parametrize(
    ("setting", "value", "refusal"),
    [
        ("eval.tile", "maybe", "eval.tile='maybe' (takes true or false, as its shipped value false)"),
        ("infer.video_fps", "abc", "infer.video_fps='abc' (takes a number, as its shipped value 24)"),
        ("runtime.compile", 1, "runtime.compile=1 (takes true or false, as its shipped value false)"),
        ("seed", "abc", "seed='abc' (takes a number, as its shipped value 1234)"),
        ("infer.video_fps", 29.97, None),  # a number of another kind than the shipped 24
        ("eval.device", 3, None),  # shipped as a word (auto): nothing to judge by
        ("eval.max_samples", "abc", None),  # shipped null: eval reads it (`whole_number`)
    ],
)
def test_a_plain_setting_takes_the_kind_of_its_shipped_value(setting, value, refusal):
    shipped = compose_run_config([])
    cfg = compose_run_config([])
    OmegaConf.update(cfg, setting, value)
    if refusal is None:
        check_against_shipped([setting], cfg, shipped)
        return
    with pytest.raises(ValueError) as refused:
        check_against_shipped([setting], cfg, shipped)
    assert str(refused.value) == f"{refusal}: set it to such a value"


def test_only_settings_of_nodes_built_from_no_class_are_judged_by_their_shipped_value():
    """`trainer.devices=auto` (shipped 1) is Lightning's to judge, by its annotation; `eval.tile` is nobody's."""
    cfg = compose_run_config(["debug=tiny"])
    built = ["trainer.devices", "model.gamma", "data.train.num_samples", "callbacks.last_checkpoint.dirpath"]
    plain = ["eval.tile", "seed", "paths.log_dir", "runtime.compile", "infer.video_fps"]
    assert [key for key in built + plain if in_plain_node(cfg, key)] == plain


@pytest.mark.parametrize(
    ("setting", "value", "meant"),
    [("eval.sets", "synthetic", ["synthetic"]), ("eval.baselines", "zero", ["zero"]), ("tags", 2026, [2026])],
)
def test_one_value_where_a_list_is_shipped_is_that_list_of_one(setting, value, meant):
    """`eval.sets=synthetic` was read letter by letter ("eval.sets names ['s', 'y', 'n', ...]")."""
    cfg = compose_run_config([])
    OmegaConf.update(cfg, setting, value)
    assert check_against_shipped([setting, "eval.tile"], cfg, compose_run_config([])) == {setting: meant}

"""The configs and networks the tests share: the repository, its conf/ folder and the official fixtures; the
backbones of conf/backbone/ (the tiny one above all) as plain configs and as built networks; the MCVA module's
and FlowModule's settings of conf/model/."""

import copy
from functools import cache
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from flowformer.models import FlowFormer, build_flowformer
from flowformer.models.mcva import CostMaskGenerator

REPO_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_DIR / "conf"
FIXTURES_DIR = REPO_DIR.parent / "shared" / "fixtures"  # the official outputs, beside the checkout


@cache
def _composed_backbone(name: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR / "backbone"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=name))


def backbone_config(name: str = "tiny", **overrides) -> dict:
    """conf/backbone/<name>.yaml with the files it inherits, as a plain dict (with its `_target_`), with
    `overrides` applied."""
    return {**_composed_backbone(name), **overrides}


def backbone_kwargs(name: str = "tiny", **overrides) -> dict:
    """The `build_flowformer` knobs of conf/backbone/<name>.yaml (its config without `_target_`)."""
    config = backbone_config(name, **overrides)
    assert config.pop("_target_") == "flowformer.models.build_flowformer"
    return config


def build_backbone(name: str = "tiny", **overrides) -> FlowFormer:
    """FlowFormer built from conf/backbone/<name>.yaml with `overrides`, in training mode."""
    return build_flowformer(**backbone_kwargs(name, **overrides))


@cache
def _composed_model(name: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR / "model"), version_base="1.3"):
        config = compose(config_name=name)
    with open_dict(config):
        del config["backbone"]  # `${backbone}`: the run config's backbone, which the tests pass themselves
    return OmegaConf.to_container(config, resolve=True)


def model_settings(name: str, **overrides) -> dict:
    """The module settings of conf/model/<name>.yaml with its optimizer and scheduler (without `_target_` and
    the backbone), with `overrides` applied."""
    config = copy.deepcopy(_composed_model(name))
    for key in ("_target_", "_recursive_"):
        config.pop(key)
    return {**config, **overrides}


def flow_settings(**overrides) -> dict:
    """FlowModule's settings of conf/model/flow.yaml, with `overrides` applied."""
    return model_settings("flow", **overrides)


def mcva_settings(**overrides) -> dict:
    """MCVAPretrainModule's settings of conf/model/mcva.yaml, with `overrides` applied."""
    return model_settings("mcva", **overrides)


def mask_generator(**overrides) -> CostMaskGenerator:
    """The MCVA mask of conf/model/mcva.yaml, with `overrides` applied."""
    settings = mcva_settings(**overrides)
    return CostMaskGenerator(**{k: settings[k] for k in ("masking", "mask_ratio", "min_block", "max_block")})


def refuse_dense_volume(*args):
    """Stands in for `FlowFormer.cost_volume` where a memory-bounded path must not build the dense volume."""
    raise AssertionError("the dense cost volume was built")

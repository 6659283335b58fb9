"""What the test files share: the repository and its conf/ folder, the backbones of conf/backbone/ (the tiny
one above all) as plain configs and as built networks, and the MCVA module's settings of conf/model/mcva.yaml.
Test files import the helpers (`from conftest import ...`) and request the fixtures by name."""

from functools import cache
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flowformer.models import FlowFormer, build_flowformer
from flowformer.models.mcva import CostMaskGenerator

REPO_DIR = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_DIR / "conf"


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


def mcva_settings(**overrides) -> dict:
    """MCVAPretrainModule's settings of conf/model/mcva.yaml (without `_target_` and the backbone), with
    `overrides` applied."""
    config = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "mcva.yaml"))
    for key in ("_target_", "_recursive_", "backbone"):
        config.pop(key)
    return {**config, **overrides}


@pytest.fixture
def tiny_config() -> dict:
    """conf/backbone/tiny.yaml as a plain dict, as Hydra hands it to FlowModule / MCVAPretrainModule."""
    return backbone_config()


@pytest.fixture
def tiny_net() -> FlowFormer:
    """A fresh tiny FlowFormer, its random weights drawn after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return build_backbone()


def mask_generator(**overrides) -> CostMaskGenerator:
    """The MCVA mask of conf/model/mcva.yaml, with `overrides` applied."""
    settings = mcva_settings(**overrides)
    return CostMaskGenerator(**{k: settings[k] for k in ("masking", "mask_ratio", "min_block", "max_block")})


def refuse_dense_volume(*args):
    """Stands in for `FlowFormer.cost_volume` where a memory-bounded path must not build the dense volume."""
    raise AssertionError("the dense cost volume was built")


@pytest.fixture
def restore_matmul_precision():
    """Puts torch's fp32 precision settings (runtime.matmul_precision, flowformer/tasks/runtime.py) back."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    cpu_matmul = torch.backends.mkldnn.matmul.fp32_precision
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.backends.mkldnn.matmul.fp32_precision = cpu_matmul

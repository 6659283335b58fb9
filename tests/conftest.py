"""What the test files share: the repository and its conf/ folder, and the backbones of conf/backbone/ (the tiny
one above all) as plain configs and as built networks. Test files import the helpers (`from conftest import ...`)
and request the fixtures by name."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from flowformer.models import FlowFormer

REPO_DIR = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_DIR / "conf"


def backbone_config(name: str = "tiny", **overrides) -> dict:
    """conf/backbone/<name>.yaml as a plain dict (with its `_target_`), with `overrides` applied."""
    return {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "backbone" / f"{name}.yaml")), **overrides}


def backbone_kwargs(name: str = "tiny", **overrides) -> dict:
    """The FlowFormer constructor arguments of conf/backbone/<name>.yaml (its config without `_target_`)."""
    config = backbone_config(name, **overrides)
    assert config.pop("_target_") == "flowformer.models.FlowFormer"
    return config


def build_backbone(name: str = "tiny", **overrides) -> FlowFormer:
    """FlowFormer built from conf/backbone/<name>.yaml with `overrides`, in training mode."""
    return FlowFormer(**backbone_kwargs(name, **overrides))


@pytest.fixture
def tiny_config() -> dict:
    """conf/backbone/tiny.yaml as a plain dict, as Hydra hands it to FlowModule / MCVAPretrainModule."""
    return backbone_config()


@pytest.fixture
def tiny_net() -> FlowFormer:
    """A fresh tiny FlowFormer, its random weights drawn after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return build_backbone()

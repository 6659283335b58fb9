"""The resolved-config views the tests share: `python run.py <overrides>` composed without running."""

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from helpers.configs import CONF_DIR


def compose_run_config(overrides: list[str]) -> DictConfig:
    """conf/config.yaml with overrides (and the hydra node, for sweeps), with fixed root and output paths."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "config",
            overrides=["paths.root_dir=/root", "paths.output_dir=/out", *overrides],
            return_hydra_config=True,
        )


def compose_tiny_config(*overrides: str) -> DictConfig:
    """conf/config.yaml with the tiny backbone and overrides, as a task receives it (no hydra node; the run
    directory is the config's own unless an override sets paths.output_dir)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["backbone=tiny", *overrides])

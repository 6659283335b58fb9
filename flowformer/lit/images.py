"""Pictures to loggers: wandb-style `log_image` or TensorBoard's `add_image`; loggers without images (CSV)
are skipped."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


def image_api(logger: Any) -> str | None:
    """'log_image' (wandb-style loggers), 'add_image' (TensorBoard) or None (no image support, e.g. CSV)."""
    if callable(getattr(logger, "log_image", None)):
        return "log_image"
    if callable(getattr(getattr(logger, "experiment", None), "add_image", None)):
        return "add_image"
    return None


def log_images(loggers: Iterable[Any], images: Mapping[str, np.ndarray], step: int) -> None:
    """images: key -> uint8 [H, W, 3]."""
    for logger in loggers:
        api = image_api(logger)
        for key, image in images.items():
            if api == "log_image":
                logger.log_image(key=key, images=[image], step=step)
            elif api == "add_image":
                logger.experiment.add_image(key, image, step, dataformats="HWC")

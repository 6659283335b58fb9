"""task=pretrain: MCVA pretraining (model=mcva) or the unsupervised baseline (model=unsup) on unlabeled video
(data=synthetic_video | youtube_vos | video_folder).

The same Lightning loop as task=train; only the LightningModule and the data differ.
"""

from __future__ import annotations

from omegaconf import DictConfig

from flowformer.tasks.train import fit


def run(cfg: DictConfig) -> float | None:
    return fit(cfg)[0]

"""The Lightning trainer of the tests that train in process, and the smallest module and data to train."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def cpu_trainer(**settings) -> L.Trainer:
    """A CPU trainer without logger, checkpoints, progress bar or model summary; `settings` add to these or
    replace them (a ModelCheckpoint callback needs enable_checkpointing=True)."""
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **settings})


class LinearModule(L.LightningModule):
    """One linear layer fitted to zero by SGD: a training loop with nothing of the network in it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def linear_loader() -> DataLoader:
    """64 random 2-vectors in batches of 4 (16 steps an epoch), for :class:`LinearModule`."""
    return DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4)

"""A dataset that says which process loads its pairs (tests/data/test_loader_settings.py)."""

import os

import torch
from torch.utils.data import Dataset


class ForkedFromTheLoader(Dataset):
    """`pairs` 8x8 flow pairs (zero flow) that load only in the process that built the set or in a child forked
    from it: a DataLoader worker started any other way (the child of a fork server, a spawned process) raises,
    naming its parent."""

    def __init__(self, pairs: int = 4) -> None:
        self.pairs = pairs
        self.loading_pid = os.getpid()

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.loading_pid not in (os.getpid(), os.getppid()):
            raise RuntimeError(
                f"pair {index} loaded in process {os.getpid()}, a child of {os.getppid()}, not of the loading "
                f"process {self.loading_pid}"
            )
        return {
            "img1": torch.zeros(3, 8, 8),
            "img2": torch.zeros(3, 8, 8),
            "flow": torch.zeros(2, 8, 8),
            "valid": torch.ones(8, 8),
        }

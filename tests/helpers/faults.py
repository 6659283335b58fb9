"""Faults for the reliability tests: callbacks that break a run on purpose (`+callbacks.<name>._target_=...`)
and a full disk (`fill_disk`)."""

import builtins
import errno
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from flowformer.models import output_files


class KillAtStep(L.Callback):
    """SIGKILL the process when the batch after `step` optimiser steps starts: no handler, no cleanup."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class DeleteFolderAtStep(L.Callback):
    """Delete `folder` (a dataset's files) when the batch after `step` optimiser steps starts, as a user
    cleaning up scratch space while the run goes on."""

    def __init__(self, step: int, folder: str) -> None:
        self.step = step
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            shutil.rmtree(self.folder)


class KillGroupOnceAtStep(L.Callback):
    """SIGKILL the whole process group when the batch after `step` optimiser steps starts, unless `marker`
    exists (it is created first): a job killed once mid-way (a lost node, the OOM killer), its processes gone
    without a handler or cleanup. Only for a run started in a session of its own."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step and not self.marker.exists():
            self.marker.touch()
            os.killpg(os.getpgrp(), signal.SIGKILL)


class SignalAtStep(L.Callback):
    """Send the process `signal_name` (SIGTERM, SIGUSR1, ...) when the batch after `step` optimiser steps starts:
    the signal arrives during step `step` + 1. With `group`, the whole process group gets it (DataLoader workers
    too), as from SLURM or a terminal: sent by another process, as theirs is (torch's DataLoader
    workers end quietly on a SIGTERM from their parent, and die of one from any other process); only for a run
    started in a session of its own. With `launcher`, global rank 0 sends it to its parent, the launcher
    (torchrun), as Ctrl-C in torchrun's terminal reaches torchrun alone (its workers run in sessions of their
    own), which passes it on to every worker. With `marker`, global rank 0 sends it once: unless that file
    exists (sent, it is made), for a command run again or a table's next row."""

    def __init__(
        self, step: int, signal_name: str, group: bool = False, launcher: bool = False, marker: str | None = None
    ) -> None:
        self.step = step
        self.signal_name = signal_name
        self.group = group
        self.launcher = launcher
        self.marker = None if marker is None else Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step != self.step:
            return
        if self.marker is not None:
            if trainer.global_rank != 0 or self.marker.exists():
                return
            self.marker.touch()
        if self.launcher:
            if trainer.global_rank == 0:
                os.kill(os.getppid(), getattr(signal, self.signal_name))
        elif self.group:
            signal_group(self.signal_name)
        else:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


class CtrlCOnce(L.Callback):
    """Ctrl-C (SIGINT to the whole process group, sent from another process as a terminal's is) unless `marker`
    exists (it is created first): `at` "fit_start", while the run starts, before its stop handlers are in
    place; "train_end", after its last step, too late to stop it. Only for a run started in a session of its
    own."""

    def __init__(self, at: str, marker: str) -> None:
        self.at = at
        self.marker = Path(marker)

    def on_fit_start(self, *args) -> None:
        self._press("fit_start")

    def on_train_end(self, *args) -> None:
        self._press("train_end")

    def _press(self, now: str) -> None:
        if now == self.at and not self.marker.exists():
            self.marker.touch()
            signal_group("SIGINT")


def signal_group(signal_name: str) -> None:
    """`signal_name` to this process's whole group, sent by another process as SLURM's and a terminal's are;
    returns once it is sent. Where two processes of one group signal it at once (both ranks of a job step), one's
    sender can get the other's signal while it is still in the group, between its fork and its own session, with
    the default action (CPython's child resets the handlers): it dies of that signal, which the group got."""
    signum = getattr(signal, signal_name)
    sender = f"import os, signal; os.killpg({os.getpgrp()}, {int(signum)})"
    sent = subprocess.run([sys.executable, "-c", sender], check=False, start_new_session=True)
    if sent.returncode not in (0, -signum):
        raise subprocess.CalledProcessError(sent.returncode, sent.args)


def fill_disk(folder: str | Path, patch: Callable[[object, str, object], None] = setattr) -> str:
    """Make the disk of `folder` full and say how. On a tmpfs mounted at `folder` ("tmpfs"), a filler file grows
    until the kernel answers ENOSPC. Elsewhere ("simulated": where mounting one is not permitted), every write
    the package makes under `folder` from now on (flowformer/models/output_files.py's `open`) writes half its
    bytes and fails with ENOSPC; `patch` installs that (setattr, or a pytest monkeypatch's, which undoes it)."""
    folder = Path(folder)
    if os.path.ismount(folder):
        descriptor = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(descriptor, bytes(1 << 20))
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
        finally:
            os.close(descriptor)
        return "tmpfs"
    real_open = builtins.open

    def open_on_full_disk(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writes = any(flag in mode for flag in "wax+")
        return FullDiskFile(handle) if writes and Path(file).resolve().is_relative_to(folder.resolve()) else handle

    patch(output_files, "open", open_on_full_disk)
    return "simulated"


class FullDiskFile:
    """A file on a simulated full disk: a write stores half its bytes, then fails with ENOSPC."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def write(self, data) -> int:
        data = data if isinstance(data, str) else bytes(data)
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._handle.close()

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


class FillDiskAtStep(L.Callback):
    """`fill_disk(folder)` when the batch after `step` optimiser steps starts."""

    def __init__(self, folder: str, step: int) -> None:
        self.folder = folder
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            fill_disk(self.folder)


class FillDiskAtFitEnd(L.Callback):
    """`fill_disk(folder)` when training has ended, its last.ckpt written: the writes after it fail."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_end(self, trainer: L.Trainer, *args) -> None:
        fill_disk(self.folder)


class KillRankZeroOnceAtStep(L.Callback):
    """SIGKILL global rank 0 of a training run when the batch after `step` optimiser steps starts, unless
    `marker` exists (created first, exclusively: of the runs that share it, one is killed): a stage's main
    process killed mid-way (the OOM killer), the processes around it left to notice. Safe beside other jobs:
    it signals no process group."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        try:
            self.marker.touch(exist_ok=False)
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)



class OutOfMemoryOnRankOnceAtStep(L.Callback):
    """Raise CUDA's out-of-memory error (torch.OutOfMemoryError) on global rank `rank` alone when the batch
    after `step` optimiser steps starts, unless `marker` exists (created first, exclusively: of the runs that
    share it, one fails): one GPU of a DDP run out of memory, the other processes left waiting for it in their
    next collective."""

    def __init__(self, step: int, rank: int, marker: str) -> None:
        self.step = step
        self.rank = rank
        self.marker = Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        try:
            self.marker.touch(exist_ok=False)
        except FileExistsError:
            return
        raise torch.OutOfMemoryError(f"CUDA out of memory on rank {self.rank} (helpers.faults)")

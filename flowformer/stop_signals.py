"""Stop signals (SIGTERM, SIGUSR1, and SIGINT: Ctrl-C) for work that is not a Lightning training run: task=infer
stops at the end of the image pair in progress (:class:`StopSignals`); task=eval and a pipeline's evaluation stop
at once (:func:`stopping_at_once`): they have nothing to save midway, and running them again evaluates again.
Either way the run exits with status 128 + the signal's number (:class:`StoppedBySignal`). Training's handling
builds on these (flowformer/tasks/preemption.py); this module imports no Lightning, so the tasks that never train
start without it."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, ClassVar

from typing_extensions import Self  # typing's is Python 3.11's

# SIGINT is Ctrl-C in a terminal, which signals every process of the job as SLURM does: it stops a run as
# SIGTERM does (status 130), with its work saved, where Python's KeyboardInterrupt would leave training's steps
# since its last periodic last.ckpt unsaved
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StoppedBySignal(SystemExit):
    """A run stopped by a stop signal once its work so far was saved: the process exits with status 128 + the
    signal's number; `message` is the line the run logs."""

    def __init__(self, signum: signal.Signals, message: str) -> None:
        super().__init__(128 + int(signum))
        self.signum = signum
        self.message = message


class StopSignals:
    """``with StopSignals() as stop:`` the stop signals set ``stop.received`` (the first one) instead of
    ending the process, for work that stops at a safe point of its own; the handlers before are put back where
    its own are still in place (a SLURM requeue's SIGTERM stays ignored to the process's end). Handlers that
    take its place for a part of the work (training's, an evaluation's, a child process's) tell it of the
    signals they get (:func:`note_stop`), so that the work around stops once that part is over, also where the
    part finished anyway (the signal came after its last step). A block inside another passes what it received
    on to the blocks around it when it ends."""

    entered: ClassVar[list[StopSignals]] = []

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Self:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)
        StopSignals.entered.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        StopSignals.entered.remove(self)
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._note:  # not one set meanwhile (requeue_if_warned's SIG_IGN)
                signal.signal(signum, handler)
        if self.received is not None:
            note_stop(self.received)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum)


def note_stop(signum: int) -> None:
    """A handler in place of the entered StopSignals' handlers got `signum`: each of them notes it."""
    for stop in StopSignals.entered:
        stop._note(signum, None)


def stop_noted() -> signal.Signals | None:
    """The first stop signal an entered StopSignals noted (work that starts stops at once), else None."""
    return next((stop.received for stop in StopSignals.entered if stop.received is not None), None)


class DeferredStop:
    """``with deferred_stop:`` a stop that :func:`stopping_at_once` raises is raised where the block ends instead,
    for a step that a stop must not cut midway: a DataLoader's iterator starting its workers, whose ``__del__``,
    cut there, fails on what it had not yet set ("Exception ignored in ... __del__") before the run's line. A
    block that fails drops the stop (the failure ends the run). Not blocking the signals: the process's other
    threads would still take them, and Python runs the handler in the main thread at once."""

    def __init__(self) -> None:
        self.active = False
        self.pending: StoppedBySignal | None = None

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.active = False
        stop, self.pending = self.pending, None
        if stop is not None and exc_type is None:
            raise stop


deferred_stop = DeferredStop()


@contextmanager
def stopping_at_once(stopped: Callable[[signal.Signals], str]) -> Iterator[None]:
    """``with stopping_at_once(line):`` the first stop signal raises StoppedBySignal (its line:
    ``line(signal)``) wherever the main thread is (outside :data:`deferred_stop`), for work with nothing to save
    midway (files are written atomically, so none is left half-written); later ones are ignored. Processes
    forked meanwhile (DataLoader workers) ignore them; the handlers before are put back."""
    received: list[signal.Signals] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        note_stop(signum)
        if not received:
            received.append(signal.Signals(signum))
            stopped_run = StoppedBySignal(received[0], stopped(received[0]))
            if deferred_stop.active:
                deferred_stop.pending = stopped_run
            else:
                raise stopped_run

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    forked_children.ignore_stop_signals = True
    try:
        yield
    finally:
        forked_children.ignore_stop_signals = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ForkedChildren:
    """Whether a child forked now ignores the stop signals (the hook runs in every child of an ``os.fork``)."""

    def __init__(self) -> None:
        self.ignore_stop_signals = False
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        if self.ignore_stop_signals:
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)


forked_children = ForkedChildren()


def worker_ignores_stop_signals(worker_id: int) -> None:
    """A DataLoader's worker_init_fn (or part of one): a worker forked to ignore the stop signals
    (:data:`forked_children`) ignores them again, except its parent's SIGTERM, which ends it quietly; every
    worker drops the connection errors of a training process that stopped (`quiet_when_the_reader_is_gone`).

    Torch's worker loop installs its own SIGTERM handler after the fork: it ends the worker quietly on its
    parent's SIGTERM (multiprocessing terminates the daemon workers of a process that exits without shutting
    them down, after an error) and kills it on any other. So SLURM's SIGTERM (scancel, a time limit) and
    another task's killed the workers, and the training process failed on a dead worker before it could save.
    Here SIGTERM is blocked in the worker and taken by a thread of its own, which ends the worker when the
    parent sent it and drops it otherwise."""
    quiet_when_the_reader_is_gone()
    if not forked_children.ignore_stop_signals:
        return
    for signum in STOP_SIGNALS:
        if signum != signal.SIGTERM:
            signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not ignored: an ignored signal is dropped before it is waited for
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # in every thread the worker starts from now on
    threading.Thread(target=_end_on_parents_sigterm, args=(os.getppid(),), daemon=True).start()


def quiet_when_the_reader_is_gone() -> None:
    """In a DataLoader worker: a connection reset or broken by the training process is dropped, not printed. The
    thread of multiprocessing's resource sharer that hands a batch's shared memory to the training process
    reports it through sys.excepthook (a "ConnectionResetError: [Errno 104]" traceback) when that process stopped
    while it took the batch (Ctrl-C, a stop signal); the worker ends with it. Other errors reach the hook."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        if not issubclass(kind, (ConnectionResetError, BrokenPipeError)):
            previous(kind, value, trace)

    sys.excepthook = hook


def _end_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)

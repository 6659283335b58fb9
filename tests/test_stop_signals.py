"""flowformer/stop_signals.py: a StopSignals block notes the signals that handlers in its place got, passes on
to the blocks around it what it took, and puts back the handlers before it only where its own are still in
place."""

import os
import signal
import subprocess
import sys

from flowformer.stop_signals import StopSignals, note_stop, stop_noted


def test_a_block_notes_what_handlers_in_its_place_got_and_only_while_entered():
    assert stop_noted() is None
    with StopSignals() as outer, StopSignals() as inner:
        note_stop(signal.SIGUSR1)  # as training's handler, in the block's place, does
        note_stop(signal.SIGTERM)
        assert outer.received == inner.received == signal.SIGUSR1 == stop_noted()
    assert stop_noted() is None
    note_stop(signal.SIGTERM)  # no block entered: nothing to note it
    assert outer.received == signal.SIGUSR1


def test_a_handler_set_inside_the_block_stays_after_it():
    """A SLURM requeue ignores SIGTERM for the rest of the process inside a pipeline's block
    (preemption.requeue_if_warned); the block's end put the default back, and the requeue's SIGTERM then ended
    the process before it could exit with its own status."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with StopSignals():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]  # its own handler there: put back
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_block_inside_another_passes_on_the_signal_it_took_when_it_ends():
    """A signal goes to the innermost block's handler alone (a pipeline's inside experiment=quickstart's); the
    block around learns of it when the inner one ends, and stops the work after it (the demo's verdict)."""
    with StopSignals() as outer:
        with StopSignals() as inner:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert inner.received == signal.SIGUSR1 and outer.received is None
        assert outer.received == signal.SIGUSR1


# A DataLoader worker's start, then what multiprocessing's resource sharer does (sys.excepthook with the error) when
# the training process resets or breaks the connection of a batch it takes, and with another error.
WORKER = """
import sys
from flowformer.stop_signals import worker_ignores_stop_signals
worker_ignores_stop_signals(0)
for error in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"), KeyError("k")):
    try:
        raise error
    except BaseException:
        sys.excepthook(*sys.exc_info())
"""


def test_a_worker_drops_the_connection_errors_of_a_stopping_reader_and_reports_others():
    """Ctrl-C while `task=bench bench=data` read through 2 workers printed, once in a CI run, a worker's
    "ConnectionResetError: [Errno 104] Connection reset by peer" traceback from multiprocessing's resource sharer:
    the training process had stopped while it took a batch. A worker drops those; other errors still print."""
    result = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, check=True)
    assert "ConnectionResetError" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert result.stderr.count("Traceback") == 1 and "KeyError: 'k'" in result.stderr

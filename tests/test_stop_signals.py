"""flowformer/stop_signals.py: a StopSignals block notes the signals that handlers in its place got, passes on
to the blocks around it what it took, and puts back the handlers before it only where its own are still in
place."""

import os
import signal

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

"""flowformer/stop_signals.py: a StopSignals block notes the signals that handlers in its place got, and puts
back the handlers before it only where its own are still in place."""

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

"""What the suite relies on to compare a run in a test's process with runs in the subprocesses it starts, bit for
bit: both on the same number of torch threads. `make test` starts its workers with OMP_NUM_THREADS=1, which the
subprocesses inherit, and tests/conftest.py puts the process's own count back after every test (the parity
tests set 2)."""

import os
import subprocess
import sys

import torch


def test_a_test_starts_on_the_thread_count_of_the_subprocesses_it_starts():
    started = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True,
    )
    assert torch.get_num_threads() == int(started.stdout)
    if "OMP_NUM_THREADS" in os.environ:  # make test's workers
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])

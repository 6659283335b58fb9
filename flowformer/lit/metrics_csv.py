"""``metrics.csv`` that a full disk cannot truncate and a run resumed in its own directory continues:
:class:`SafeCSVLogger` (``conf/logger/csv.yaml``).

Lightning's ``CSVLogger`` appends each batch of rows to ``metrics.csv`` and rewrites the file in place when a new
metric appears, so a failed write (disk full) leaves a half row or an empty file and a traceback. Here every
flush writes the whole file (the earlier rows and the new ones) through ``atomic_write``: a failed write is one
``OutputWriteError`` naming ``metrics.csv``, and the rows written before stay whole.

Lightning also deletes an existing ``metrics.csv`` when its logger starts. A run resumes in the directory of the
run it continues where a launcher names the directory after the job: a requeued SLURM job step with several
tasks (``slurm-<job>.<step>``, flowformer/tasks/run_dirs.py). There the file is kept: the resumed run's rows
follow the earlier run's rows of the steps before its first one (those of later steps, which the resume runs
again, are replaced), so the file holds the whole run as the uninterrupted run would.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from flowformer.models.output_files import OutputWriteError, atomic_write_text

log = logging.getLogger(__name__)


def logged_metrics(row: dict[str, object]) -> frozenset[str]:
    """The metrics a row of metrics.csv holds (the names with a value, besides its step and epoch)."""
    return frozenset(key for key, value in row.items() if key not in ("step", "epoch") and value not in ("", None))


def replayed(row: dict[str, str], first: int, again: set[frozenset[str]]) -> bool:
    """Whether an earlier run's `row` is one its resumed run logs again, whose first rows are of step `first`
    and hold the metrics `again`: rows of later steps, and those of that step that hold the same metrics (a
    validation run again, whose row is logged at the step before the checkpoint's)."""
    step = int(row["step"])
    return step > first or (step == first and logged_metrics(row) in again)


class ContinuingWriter(ExperimentWriter):
    """Lightning's metrics writer that keeps an existing ``metrics.csv`` (Lightning's deletes it):
    :meth:`SafeCSVLogger.save` continues it."""

    def _check_log_dir_exists(self) -> None:
        pass


class SafeCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` whose flushes rewrite ``metrics.csv`` atomically, continuing the rows of an
    earlier run in the same directory."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def save(self) -> None:
        writer = self.experiment
        if not writer.metrics:
            return
        rows, writer.metrics = writer.metrics, []  # a failed write is reported once, not again at finalize
        path = Path(writer.metrics_file_path)
        earlier = ""
        if path.is_file():
            with path.open(newline="") as file:
                earlier = file.read()
        earlier_rows = csv.DictReader(io.StringIO(earlier, newline=""))
        if not writer.metrics_keys:  # this run's first flush (a row always has its step): an earlier run's rows
            first = min(row["step"] for row in rows)  # stay, but those this run logs again
            again = {logged_metrics(row) for row in rows if row["step"] == first}
            earlier_rows = [row for row in earlier_rows if not replayed(row, first, again)]
            earlier, writer.metrics_keys = "", sorted(set().union(*earlier_rows))
        keys = sorted(set(writer.metrics_keys).union(*rows))
        text = io.StringIO()
        table = csv.DictWriter(text, fieldnames=keys)
        if keys != writer.metrics_keys or not earlier:  # a new column: the header and the earlier rows again
            table.writeheader()
            table.writerows(earlier_rows)
            earlier = ""
        table.writerows(rows)
        atomic_write_text(path, earlier + text.getvalue())
        writer.metrics_keys = keys

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """After another error (status "failed"), rows that cannot be written are one warning line, so that
        error is the one reported."""
        try:
            super().finalize(status)
        except OutputWriteError as error:
            if status != "failed":
                raise
            log.warning("the last metrics rows were not saved: %s", error)

"""``metrics.csv`` that a full disk cannot truncate: :class:`SafeCSVLogger` (``conf/logger/csv.yaml``).

Lightning's ``CSVLogger`` appends each batch of rows to ``metrics.csv`` and rewrites the file in place when a new
metric appears, so a failed write (disk full) leaves a half row or an empty file and a traceback. Here every
flush writes the whole file (the earlier rows and the new ones) through ``atomic_write``: a failed write is one
``OutputWriteError`` naming ``metrics.csv``, and the rows written before stay whole.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from flowformer.models.output_files import OutputWriteError, atomic_write_text

log = logging.getLogger(__name__)


class SafeCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` whose flushes rewrite ``metrics.csv`` atomically."""

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
        keys = sorted(set(writer.metrics_keys).union(*rows))
        text = io.StringIO()
        table = csv.DictWriter(text, fieldnames=keys)
        if keys != writer.metrics_keys or not earlier:  # a new column: the header and the earlier rows again
            table.writeheader()
            table.writerows(csv.DictReader(io.StringIO(earlier, newline="")))
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

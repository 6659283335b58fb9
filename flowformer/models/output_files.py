"""Output files that are whole or absent: the one way the package writes a file (checkpoints, flow files,
pictures, results, metrics).

:func:`atomic_write` writes to a hidden ``.<name>.partial`` beside the target and renames it over the target
only when every byte is written. A failed write (disk full, no permission, also torch's ``RuntimeError`` around
the ``OSError`` of a failed ``torch.save``) leaves no partial file, keeps the earlier file whole, and is raised
as :class:`OutputWriteError`, one line naming the file and the OS error; any other exception (Ctrl-C too) also
removes the temporary file. Here in ``models/`` because the network package imports nothing else from the
package and its checkpoint writers use it too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

DEFAULT_ADVICE = "Free disk space or choose another location"


class OutputWriteError(OSError):
    """A file could not be written (disk full, no permission); no partial file is left and an earlier one is
    whole. ``path``: the file."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        super().__init__(message)
        self.path = Path(path)


def partial_path(path: str | os.PathLike) -> Path:
    """The hidden temporary file :func:`atomic_write` writes before renaming it to ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def file_in_the_way(folder: str | os.PathLike) -> Path | None:
    """The file at ``folder`` or at one of its parents, which keeps ``folder`` from being a folder; else None."""
    folder = Path(folder)
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)


def check_room(folder: str | os.PathLike, size: int) -> None:
    """Write ``size`` bytes to a hidden probe file in ``folder`` and remove it: the OSError of the write when
    they do not fit (disk full, quota) or ``folder`` cannot be written."""
    probe = Path(folder) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as file:
            file.write(bytes(size))
    finally:
        probe.unlink(missing_ok=True)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: the error itself, or the one torch's RuntimeError was raised from."""
    if isinstance(error, OSError):
        return error
    around = error.__cause__ or error.__context__
    if isinstance(error, RuntimeError) and isinstance(around, OSError):
        return around
    return None


@contextmanager
def atomic_write(path: str | os.PathLike, advice: str = DEFAULT_ADVICE) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the block ends without an
    error (parent folders are created). A failed write raises :class:`OutputWriteError` ending in ``advice``."""
    path = Path(path)
    if path.is_dir():  # os.replace would fail once every byte is written, which "free disk space" does not help
        raise OutputWriteError(path, f"cannot write {path}: it is a folder, where a file is expected; give a file's path")
    partial = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as file:
            yield file
        os.replace(partial, path)
    except BaseException as error:
        if partial.exists():  # False when the folder could not be made
            partial.unlink()
        cause = _os_error(error)
        if cause is None:
            raise
        blocker = file_in_the_way(path.parent)
        reason = f"{blocker} is a file" if blocker is not None else cause.strerror or str(cause)
        kept = f"the previous {path.name} is intact" if path.exists() else f"no partial {path.name} is left"
        raise OutputWriteError(path, f"cannot write {path} ({reason}); {kept}. {advice}") from error



def atomic_write_text(path: str | os.PathLike, text: str, advice: str = DEFAULT_ADVICE) -> None:
    """``text`` (UTF-8) as the whole new content of ``path``, through :func:`atomic_write`."""
    with atomic_write(path, advice) as file:
        file.write(text.encode())

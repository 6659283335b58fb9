"""The Lightning trainer of the tests that train in process."""

import lightning as L


def cpu_trainer(**settings) -> L.Trainer:
    """A CPU trainer without logger, checkpoints, progress bar or model summary; `settings` add to these or
    replace them (a ModelCheckpoint callback needs enable_checkpointing=True)."""
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **settings})

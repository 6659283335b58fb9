"""The wandb run id a resumed run reads beside its checkpoint is checked (issue 27 item 12): a file holding a
path or other text is one line naming the file, not wandb's traceback."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flowformer.tasks.run_setup import WANDB_ID_FILE, build_loggers, read_wandb_id


def resume_config(checkpoint_dir: Path) -> OmegaConf:
    wandb = {"_target_": "lightning.pytorch.loggers.WandbLogger", "name": "run", "offline": True}
    return OmegaConf.create({"logger": {"wandb": wandb}, "ckpt_path": str(checkpoint_dir / "last.ckpt")})


@pytest.mark.parametrize("content", ["../../etc/passwd", "a b", "", "x" * 65, "id\nother"])
def test_a_recorded_id_that_is_not_a_wandb_id_is_refused(tmp_path: Path, content: str) -> None:
    id_file = tmp_path / WANDB_ID_FILE
    id_file.write_text(content)
    with pytest.raises(ValueError, match=rf"{id_file} holds .*, not a wandb run id"):
        build_loggers(resume_config(tmp_path))


def test_a_recorded_wandb_id_is_read(tmp_path: Path) -> None:
    (tmp_path / WANDB_ID_FILE).write_text("a1b2c3d4\n")  # as record_wandb_id writes wandb's own ids
    assert read_wandb_id(tmp_path / WANDB_ID_FILE) == "a1b2c3d4"

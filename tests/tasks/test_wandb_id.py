"""The wandb run id a resumed run reads beside its checkpoint is checked (issue 27 item 12): a file holding a
path or other text is one line naming the file, not wandb's traceback; so is a wandb run wandb refuses to start."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flowformer.tasks.run_setup import WANDB_ID_FILE, build_loggers, read_wandb_id

from helpers.run import fresh_checkout, run_py


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


def test_wandb_on_a_machine_not_logged_in_is_one_line_saying_how_to_log_in_or_offline(tmp_path: Path) -> None:
    """The README's `python run.py ... logger=wandb logger.wandb.project=my-flow` where no one ran `wandb login`
    (no API key in the environment, ~/.netrc or wandb's settings): one line before any training saying how to log
    in or log offline, no traceback, no run directory left."""
    checkout = fresh_checkout(tmp_path / "checkout")
    home = tmp_path / "home"
    home.mkdir()
    not_logged_in = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(home), "WANDB_CONFIG_DIR": str(home)}
    result = run_py("debug=tiny", "logger=wandb", "logger.wandb.project=my-flow", cwd=checkout, env=not_logged_in,
                    expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    # wandb's own words in the brackets: "No API key configured. Use `wandb login` to log in." (0.31), "api_key not
    # configured (no-tty). call wandb.login(key=[your_api_key])" (0.17.2, the oldest pyproject.toml admits)
    line = re.escape(
        "error (ValueError): logger=wandb: wandb did not start its run (<reason>); log in once with `wandb login` (or "
        "set WANDB_API_KEY), or log without an account or network with WANDB_MODE=offline (`wandb sync <run "
        "dir>/wandb/offline-run-*` uploads it later), or log to CSV only with logger=csv"
    ).replace("<reason>", "(?i:.*api[ _]key.*)")
    (error,) = [text for text in result.stderr.splitlines() if text.startswith("error")]
    assert re.fullmatch(line, error), error
    assert not list((checkout / "logs").rglob("*.log"))

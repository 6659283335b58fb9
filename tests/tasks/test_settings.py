"""Settings that trained silently or ended in a traceback are refused in one line naming the setting, where
the value is consumed; a run refused early leaves nothing in paths.log_dir."""

import pytest

from flowformer.lit.flow import FlowModule
from flowformer.models.build import build_flowformer
from flowformer.tasks import infer
from flowformer.tasks.run_setup import check_validation_interval, seed_run

from helpers.compose import compose_tiny_config
from helpers.configs import backbone_config, backbone_kwargs, flow_settings
from helpers.run import run_py


@pytest.mark.parametrize(("knob", "value", "least"), [("agt_depth", -1, 0), ("num_latent_tokens", 0, 1)])
def test_backbone_knobs_below_their_least_value_are_refused(knob, value, least):
    with pytest.raises(ValueError, match=f"backbone.{knob} must be >= {least}, got {value}"):
        build_flowformer(**backbone_kwargs(**{knob: value}))
    build_flowformer(**backbone_kwargs(**{knob: least}))  # the least value builds


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("gamma", -5, "model.gamma=-5: .* gamma must be >= 0"),  # trained to a loss of -12.6
        ("train_iters", 0, "model.train_iters=0: the decoder needs at least 1 iteration"),
        ("val_iters", 0, "model.val_iters=0: the decoder needs at least 1 iteration"),
        ("max_flow", 0, "model.max_flow=0: the loss counts .* expected > 0"),  # trained on a loss of 0
        ("max_flow", float("nan"), "model.max_flow=nan: "),
        ("num_val_panels", -1, "model.num_val_panels=-1: expected a whole number >= 0"),
    ],
)
def test_flow_module_settings_are_checked_when_it_is_built(setting, value, message):
    with pytest.raises(ValueError, match=message):
        FlowModule(backbone=backbone_config(), **flow_settings(**{setting: value}))


def test_a_seed_out_of_range_or_not_whole_names_seed():
    with pytest.raises(ValueError, match=r"^seed=-1: .*not in bounds"):
        seed_run(-1)
    with pytest.raises(ValueError, match=r"^seed=2.5: expected a whole number$"):
        seed_run(2.5)


@pytest.mark.parametrize("interval", [0, -2, 0.0])
def test_a_validation_interval_below_one_step_names_the_setting(interval):
    with pytest.raises(ValueError, match=f"trainer.val_check_interval={interval}: expected"):
        check_validation_interval(interval)
    check_validation_interval(None)  # once an epoch


@pytest.mark.parametrize("every_n_epochs", [0, -1])
def test_validation_every_zero_epochs_names_the_setting(every_n_epochs):
    """Lightning takes trainer.check_val_every_n_epoch=0 and divides by it as the first epoch ends."""
    with pytest.raises(ValueError, match=f"^trainer.check_val_every_n_epoch={every_n_epochs}: expected a whole"):
        check_validation_interval(2, every_n_epochs)
    check_validation_interval(2, None)  # by steps alone


def test_a_video_of_zero_frames_per_second_is_refused_before_any_work(tmp_path):
    cfg = compose_tiny_config(
        "infer.video_fps=0", f"infer.input={tmp_path / 'clip.mp4'}", f"infer.checkpoint={tmp_path / 'none.pt'}"
    )
    with pytest.raises(ValueError, match="infer.video_fps=0: expected frames per second > 0"):
        infer.run(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("name=../escape", "error: name='../escape' names a folder"),  # wrote a run outside paths.log_dir
        ("name=a/b", "error: name='a/b' names a folder"),
        ("task=nonsense", "task='nonsense' is unknown"),
        ("model.train_iters=0", "model.train_iters=0: the decoder needs at least 1 iteration"),
    ],
)
def test_a_run_refused_early_leaves_nothing_in_the_log_dir(tmp_path, override, message):
    log_dir = tmp_path / "logs"
    result = run_py("debug=tiny", f"paths.log_dir={log_dir}", override, expect_ok=False)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert [path for path in tmp_path.rglob("*") if path != log_dir] == []

"""A checkpoint's stored backbone settings never name code to run (issue 27 item 13): every path that rebuilds a
network from them calls only the package's builders, so a `_target_` such as builtins.open, top-level or nested,
is refused (naming the file and the target) and never called."""

from pathlib import Path

import lightning as L
import pytest
import torch

from flowformer.lit.flow import FlowModule
from flowformer.models.checkpoint import BackboneTargetError, load_backbone, load_backbone_weights
from flowformer.models.convert import main as convert

from helpers.configs import backbone_config, build_backbone, flow_settings
from helpers.run import run_py


def lightning_file(path: Path, backbone: dict) -> Path:
    """A Lightning .ckpt of a tiny FlowModule (plain values: it loads with weights_only=True) whose `backbone`
    hyper-parameters are `backbone`."""
    module = FlowModule(backbone=backbone_config(), **flow_settings(train_iters=2, val_iters=2))
    hparams = {**module.hparams, "backbone": backbone}
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": hparams,
        "pytorch-lightning_version": L.__version__,
    }
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("keep")
    return path


def opens(victim: Path) -> dict:
    return {"_target_": "builtins.open", "file": str(victim), "mode": "w"}


def test_load_from_checkpoint_refuses_a_target_that_is_not_a_builder(tmp_path: Path, victim: Path) -> None:
    ckpt = lightning_file(tmp_path / "bad.ckpt", opens(victim))
    with pytest.raises(
        BackboneTargetError, match=rf"checkpoint {ckpt}: .*`_target_: builtins.open`.* refused"
    ):
        FlowModule.load_from_checkpoint(ckpt, weights_only=True)
    assert victim.read_text() == "keep"


def test_nested_targets_are_not_instantiated(tmp_path: Path) -> None:
    created = tmp_path / "created.txt"
    nested = {
        **backbone_config(),
        "twins_weights": {"_target_": "builtins.open", "file": str(created), "mode": "w"},
    }
    ckpt = lightning_file(tmp_path / "nested.ckpt", nested)
    with pytest.raises(ValueError, match="backbone.twins_weights"):  # a value, given to the builder as it is
        FlowModule.load_from_checkpoint(ckpt, weights_only=True)
    assert not created.exists()


def test_the_other_load_paths_refuse_it_or_never_build_from_it(tmp_path: Path, victim: Path, capsys) -> None:
    ckpt = lightning_file(tmp_path / "bad.ckpt", opens(victim))
    with pytest.raises(
        BackboneTargetError, match=rf"lightning checkpoint {ckpt} names `_target_: builtins.open`"
    ):
        load_backbone(ckpt)
    with pytest.raises(SystemExit):  # convert --to-official rebuilds the network from the stored config
        convert([str(ckpt), str(tmp_path / "out.pth"), "--to-official"])
    assert "builtins.open" in capsys.readouterr().err
    # init_from, eval and infer load the weights into the run's own network: the stored config is not read
    assert load_backbone_weights(build_backbone(), ckpt).source == "lightning"
    assert victim.read_text() == "keep"


def test_task_convert_refuses_it_in_one_line(tmp_path: Path, victim: Path) -> None:
    ckpt = lightning_file(tmp_path / "bad.ckpt", opens(victim))
    result = run_py(
        "task=convert",
        f"convert.input={ckpt}",
        f"convert.output={tmp_path / 'out.pth'}",
        "convert.to_official=true",
        f"paths.log_dir={tmp_path / 'logs'}",
        expect_ok=False,
    )
    assert result.returncode == 1
    assert "`_target_: builtins.open`, which is refused" in result.stderr and "Traceback" not in result.stderr
    assert victim.read_text() == "keep" and not (tmp_path / "out.pth").exists()


def test_a_legitimate_checkpoint_still_loads(tmp_path: Path) -> None:
    ckpt = lightning_file(tmp_path / "good.ckpt", backbone_config())
    assert FlowModule.load_from_checkpoint(ckpt, weights_only=True).backbone.config == build_backbone().config
    assert load_backbone(ckpt).config == build_backbone().config

"""Pretraining -> finetuning handoff: a MCVAPretrainModule checkpoint (ours) or an official FlowFormer++
pretraining state_dict initialises FlowModule through `model.init_from`, strictly on the shared keys, with the
skipped reconstruction-head keys reported."""

import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from flowformer.lit.flow import FlowModule
from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.models import load_backbone_weights
from flowformer.models.checkpoint import CheckpointMismatchError

from helpers.configs import FIXTURES_DIR, backbone_config, flow_settings, mcva_settings
from helpers.trainers import cpu_trainer

FIXTURE_C = FIXTURES_DIR / "flowformer_pp_c"
HEAD = "memory_decoder.pretrain_head."


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[Path, dict]:
    """Two MCVA steps of the tiny backbone, saved by Lightning as last.ckpt."""
    root = tmp_path_factory.mktemp("mcva")
    torch.manual_seed(0)
    module = MCVAPretrainModule(
        backbone=backbone_config(), **mcva_settings(query_num=2, log_images_every_n_steps=0)
    )
    before = {k: v.clone() for k, v in module.backbone.state_dict().items()}
    images = torch.rand(4, 3, 64, 96) * 255
    items = [{"img1": images[i], "img2": images[i].roll(2, -1)} for i in range(4)]
    trainer = cpu_trainer(
        max_steps=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)],
        gradient_clip_val=1.0,
        default_root_dir=root,
    )
    trainer.fit(module, DataLoader(items, batch_size=2))
    after = {k: v.detach().clone() for k, v in module.backbone.state_dict().items()}
    assert not torch.equal(before[HEAD + "0.bias"], after[HEAD + "0.bias"]), "pretraining did not update"
    return root / "last.ckpt", after


def test_finetuning_loads_our_pretraining_checkpoint_strictly(pretrained):
    path, weights = pretrained
    assert torch.load(path, weights_only=True)["hyper_parameters"]["query_num"] == 2  # plain values only
    finetune = FlowModule(backbone=backbone_config(), **flow_settings(init_from=str(path)))
    state = finetune.backbone.state_dict()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    finetune.backbone.eval()
    with torch.no_grad():
        out = finetune.backbone(torch.rand(1, 3, 64, 96) * 255, torch.rand(1, 3, 64, 96) * 255, iters=2)
    assert out["flow"].shape == (1, 2, 64, 96)


def test_a_different_reconstruction_head_is_skipped_and_reported(pretrained, caplog):
    path, weights = pretrained
    other_head = backbone_config(recon_size=25)
    with pytest.raises(CheckpointMismatchError, match="pretrain_head"):
        FlowModule(backbone=other_head, **flow_settings(init_from=str(path)))
    with caplog.at_level(logging.INFO):
        finetune = FlowModule(
            backbone=other_head, **flow_settings(init_from=str(path), skip_init_prefixes=[HEAD])
        )
    assert HEAD + "4.weight" in caplog.text  # the skipped keys are reported
    state = finetune.backbone.state_dict()
    shared = [k for k in weights if not k.startswith(HEAD)]
    assert all(torch.equal(state[k], weights[k]) for k in shared)
    assert state[HEAD + "4.weight"].shape[0] == 625
    report = load_backbone_weights(finetune.backbone, path, skip_prefixes=(HEAD,))
    assert report.source == "lightning" and report.loaded == len(shared)
    assert report.skipped == sorted(k for k in weights if k.startswith(HEAD))


@pytest.mark.slow
def test_finetuning_loads_an_official_flowformer_pp_pretraining_state_dict():
    path = FIXTURE_C / "weights_fp16.pth"
    if not path.exists():
        pytest.skip(f"fixture C not found at {FIXTURE_C}")
    official = {k.removeprefix("module."): v for k, v in torch.load(path, weights_only=True).items()}
    finetune = FlowModule(
        backbone=backbone_config("flowformer_pp"), **flow_settings(init_from=str(path))
    )
    state = finetune.backbone.state_dict()
    assert state.keys() == official.keys()
    assert all(torch.equal(state[k], official[k].to(state[k].dtype)) for k in official)

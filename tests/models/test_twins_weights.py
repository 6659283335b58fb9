"""backbone.twins_weights: timm's ImageNet twins_svt_large weights through timm's own loader, from its Hugging
Face cache (`imagenet`) or a local copy, and one line saying where to place a copy when there is no network.
Nothing here downloads: the hub is put in offline mode and its cache in a temporary folder."""

from pathlib import Path

import huggingface_hub
import hydra
import pytest
import safetensors.torch
import timm
import torch

from flowformer.models import save_backbone
from flowformer.models.encoders import TWINS_IMAGENET_FILE, TwinsEncoder, imagenet_weights_url
from flowformer.tasks import run_task
from flowformer.tasks.runtime import load_network
from flowformer.tasks.train import build_model

from helpers.compose import compose_run_config, compose_tiny_config


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The Hugging Face hub offline (as without a network) with an empty cache folder; returns the folder."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def imagenet_like_state() -> dict[str, torch.Tensor]:
    """Random weights under twins_svt_large's ImageNet keys: stages 0-1 and `norm` in their shapes, plus entries
    of the stages and the head that are not built."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in TwinsEncoder().svt.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    state |= {"blocks.2.0.attn.q.weight": torch.zeros(4, 4), "head.weight": torch.zeros(3, 2)}
    return state


def place_in_hub_cache(cache: Path, state: dict[str, torch.Tensor]) -> None:
    """`state` where the hub's cache keeps timm's default twins_svt_large weights once downloaded:
    models--<org>--<name>/snapshots/<commit>/model.safetensors, with refs/main naming the commit."""
    hub_id = timm.models.get_pretrained_cfg("twins_svt_large").hf_hub_id
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    safetensors.torch.save_file(state, str(snapshot / TWINS_IMAGENET_FILE))


def test_imagenet_comes_from_timms_cache_and_a_local_copy_gives_the_same_weights(offline_hub, tmp_path):
    state = imagenet_like_state()
    place_in_hub_cache(offline_hub, state)
    encoder = TwinsEncoder(twins_weights="imagenet")
    # a local copy: the hub's file, or a .pth with the official wrapper's keys (svt.) under `state_dict`
    local = tmp_path / TWINS_IMAGENET_FILE
    safetensors.torch.save_file(state, str(local))
    wrapped = tmp_path / "twins.pth"
    torch.save({"state_dict": {f"svt.{k}": v for k, v in state.items()}}, wrapped)
    for source in ("imagenet", local, wrapped):
        if source != "imagenet":
            with torch.no_grad():
                for value in encoder.svt.state_dict().values():
                    value.zero_()
            encoder.load_imagenet(source)
        weights = encoder.svt.state_dict()
        assert all(torch.equal(weights[k], state[k]) for k in weights), source


def test_without_a_network_or_a_cached_copy_one_line_says_where_to_place_one(offline_hub):
    with pytest.raises(FileNotFoundError) as raised, torch.device("meta"):
        TwinsEncoder(twins_weights="imagenet")
    message = str(raised.value)
    assert "\n" not in message and raised.value.__cause__ is None
    assert message.startswith("backbone.twins_weights=imagenet: timm tried to download")
    assert "found no network" in message
    assert imagenet_weights_url() in message and str(offline_hub) in message
    assert message.endswith("set backbone.twins_weights=<path to model.safetensors>.")
    assert not any(offline_hub.iterdir())  # nothing was fetched


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["experiment=chairs"], "imagenet"),  # FlowFormer's stage 1
        (["experiment=chairs", "backbone=flowformer_pp"], None),  # from its MCVA pretraining, which holds them
        (["experiment=mcva_pretrain"], "imagenet"),
    ],
)
def test_the_papers_fresh_stages_start_from_imagenet_twins(overrides, expected):
    assert compose_run_config(overrides).backbone.twins_weights == expected


def test_a_stage_without_network_fails_before_any_work_in_one_line(offline_hub, tmp_path, capsys):
    """experiment=chairs (FlowFormer, ImageNet Twins) offline: task=train stops when the network is built, before
    the run record, the trainer or any data is touched, with one line and exit status 1."""
    cfg = compose_run_config(
        ["experiment=chairs", "trainer=cpu", "data=synthetic", f"paths.output_dir={tmp_path / 'run'}"]
    )
    with pytest.raises(SystemExit) as exited:
        run_task(cfg)
    assert exited.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith("error (FileNotFoundError): backbone.twins_weights=imagenet: timm tried")
    assert error.count("\n") == 1 and "Traceback" not in error
    assert not (tmp_path / "run").exists()  # no run record, no checkpoint folder


def test_a_checkpoint_to_run_replaces_the_imagenet_weights_unread(offline_hub, tmp_path):
    """task=eval / task=infer with an experiment's backbone (twins_weights=imagenet) and a checkpoint: the
    checkpoint's weights are loaded and the ImageNet weights are not fetched (offline, nothing cached)."""
    twins = ["backbone.image_encoder=twins", "backbone.feature_dim=256", "backbone.twins_widths=[128,256]"]
    backbone = compose_tiny_config(*twins, "backbone.twins_weights=imagenet").backbone
    trained = hydra.utils.instantiate(backbone, twins_weights=None)
    save_backbone(tmp_path / "twins.pt", trained)
    net = load_network(backbone, str(tmp_path / "twins.pt"), torch.device("cpu"))
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in net.state_dict().items())


def test_a_resumed_run_and_its_checkpoint_do_not_read_the_imagenet_weights(offline_hub, tmp_path):
    """Resuming (ckpt_path) a run whose backbone says twins_weights=imagenet builds the network without fetching
    them (offline, nothing cached): the checkpoint holds the weights. Its hyper-parameters store null, so a
    later FlowModule.load_from_checkpoint does not fetch them either."""
    twins = [
        "backbone.image_encoder=twins",
        "backbone.feature_dim=256",
        "backbone.twins_widths=[128,256]",
        "backbone.twins_weights=imagenet",
    ]
    cfg = compose_tiny_config(*twins, f"ckpt_path={tmp_path / 'last.ckpt'}")
    model = build_model(cfg)
    assert model.hparams["backbone"]["twins_weights"] is None
    with pytest.raises(Exception, match="backbone.twins_weights=imagenet: timm tried"):  # Hydra wraps it
        build_model(compose_tiny_config(*twins))

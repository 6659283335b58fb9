"""State-dict layout against the official key lists, checkpoint loading/saving/export, the converter CLI and the
optional Twins ImageNet weights."""

import random
import re
import traceback
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from flowformer.models import (
    FlowFormer,
    build_flowformer,
    export_official,
    load_backbone_weights,
    load_official,
    save_backbone,
)
from flowformer.models.checkpoint import (
    MISMATCH_KEYS_LISTED,
    CheckpointMismatchError,
    CheckpointReadError,
    current_backbone_config,
    load_backbone,
    read_checkpoint,
)
from flowformer.models.convert import main as convert
from flowformer.models.encoders import TwinsEncoder
from flowformer.models.output_files import OutputWriteError

from helpers.configs import CONF_DIR, FIXTURES_DIR, backbone_config, backbone_kwargs, build_backbone

REFERENCE = FIXTURES_DIR.parent / "reference"


def meta_net(**kwargs) -> FlowFormer:
    with torch.device("meta"):
        return build_flowformer(**kwargs)


def read_key_list(name: str) -> list[tuple[str, tuple[int, ...]]]:
    rows = []
    for line in (REFERENCE / name).read_text().splitlines():
        key, shape = line.split(" ", 1)
        rows.append((key, tuple(int(s) for s in shape.strip("()").split(",") if s.strip())))
    return rows


@pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"reference key lists not found at {REFERENCE}")
@pytest.mark.parametrize(
    ("variant", "key_list", "n_params"),
    [
        ("flowformer", "state_dict_flowformer.txt", 16_168_113),
        ("flowformer_pp", "state_dict_flowformerpp.txt", 16_152_338),
    ],
)
def test_state_dict_equals_official_key_list(variant: str, key_list: str, n_params: int) -> None:
    net = meta_net(variant=variant)
    ours = [(k, tuple(v.shape)) for k, v in net.state_dict().items()]
    assert ours == read_key_list(key_list)
    assert sum(p.numel() for p in net.parameters()) == n_params  # the official models' counts (rel_ind is a buffer)


@pytest.mark.parametrize("name", ["flowformer", "flowformer_pp", "small", "tiny"])
def test_backbone_configs_instantiate_with_hydra(name: str) -> None:
    cfg = backbone_config(name)
    with torch.device("meta"):
        net = instantiate(cfg)
    assert isinstance(net, FlowFormer) and net.variant == cfg["variant"]


def test_small_is_the_papers_flowformer_small() -> None:
    net = meta_net(**backbone_kwargs("small"))
    keys = net.state_dict()
    assert keys["memory_encoder.cost_perceiver_encoder.latent_tokens"].shape == (1, 4, 32)
    assert len(net.memory_encoder.cost_perceiver_encoder.encoder_layers) == 1
    assert not any("context_proj" in k for k in keys)  # vert_c_dim = 0: context-free AGT
    assert (
        "memory_encoder.feat_encoder.layer3.1.conv2.weight" in keys and "context_encoder.conv2.weight" in keys
    )


def official_file(tmp_path: Path, net: FlowFormer, *, prefix: bool = True) -> Path:
    state = export_official(net)
    if not prefix:
        state = {k.removeprefix("module."): v for k, v in state.items()}
    path = tmp_path / ("official.pth" if prefix else "plain.pth")
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, path)
    return path


def test_export_official_round_trips_exactly(tmp_path: Path) -> None:
    net = build_backbone()
    exported = export_official(net, tmp_path / "o.pth")
    assert all(k.startswith("module.") for k in exported)
    again = build_backbone()
    load_backbone_weights(again, tmp_path / "o.pth")
    back = export_official(again)
    assert exported.keys() == back.keys() and all(torch.equal(exported[k], back[k]) for k in exported)


@pytest.mark.parametrize("prefix", [True, False])
def test_official_file_loads_with_or_without_module_prefix(tmp_path: Path, prefix: bool) -> None:
    src = build_backbone()
    dst = build_backbone()
    report = load_backbone_weights(dst, official_file(tmp_path, src, prefix=prefix))
    assert report.source == "official" and report.skipped == []
    for key, value in src.state_dict().items():
        expect = value.half().float() if value.is_floating_point() else value
        assert torch.equal(dst.state_dict()[key], expect)


def test_mismatch_lists_missing_unexpected_and_shapes(tmp_path: Path) -> None:
    state = export_official(build_backbone())
    del state["module.memory_decoder.proj.bias"]
    state["module.extra.weight"] = torch.zeros(1)
    state["module.memory_decoder.proj.weight"] = torch.zeros(3, 3, 1, 1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(CheckpointMismatchError) as err:
        load_backbone_weights(build_backbone(), tmp_path / "bad.pth")
    text = str(err.value)
    assert "missing keys (1)" in text and "memory_decoder.proj.bias" in text
    assert "unexpected keys (1)" in text and "extra.weight" in text
    assert "shape mismatches (1)" in text and "memory_decoder.proj.weight: checkpoint (3, 3, 1, 1)" in text


def test_a_checkpoint_of_other_backbone_settings_names_them_as_overrides(tmp_path: Path) -> None:
    """A backbone file loaded into a network of other knobs (`task=infer backbone=<another>`): the error ends
    with each knob the checkpoint's network was built with, as the override that builds it (knobs that shape
    no weight, such as tokenize_chunk, left out)."""
    save_backbone(tmp_path / "tiny.pt", build_backbone(tokenize_chunk=None))
    with pytest.raises(CheckpointMismatchError) as err:
        load_backbone_weights(build_backbone(agt_depth=2, decoder_dim=64), tmp_path / "tiny.pt")
    assert str(err.value).endswith(
        "The checkpoint's network was built with other backbone settings: backbone.agt_depth=1 (here 2), "
        "backbone.decoder_dim=32 (here 64); run with those (or the backbone=<config> it was trained with)."
    )


def test_a_mismatch_of_many_keys_lists_the_first_of_each_kind_and_counts_them(tmp_path: Path) -> None:
    """An eval of a tiny checkpoint in the official-size network (`backbone=` forgotten) differs in hundreds of
    keys: each kind lists its first MISMATCH_KEYS_LISTED keys and how many more, so the settings line that
    says what to change stays in view (it was 486 lines)."""
    save_backbone(tmp_path / "tiny.pt", build_backbone())
    network = build_backbone(agt_depth=3)
    missing = set(network.state_dict()) - set(build_backbone().state_dict())
    assert len(missing) > MISMATCH_KEYS_LISTED
    with pytest.raises(CheckpointMismatchError) as err:
        load_backbone_weights(network, tmp_path / "tiny.pt")
    lines = str(err.value).splitlines()
    at = lines.index(f"  missing keys ({len(missing)}):")
    listed = lines[at + 1 : at + 1 + MISMATCH_KEYS_LISTED]
    assert [line.strip() for line in listed] == sorted(missing)[:MISMATCH_KEYS_LISTED]
    assert lines[at + 1 + MISMATCH_KEYS_LISTED] == f"    ... and {len(missing) - MISMATCH_KEYS_LISTED} more"
    assert len(lines) <= 3 * (MISMATCH_KEYS_LISTED + 2) + 3
    assert lines[-1].startswith("The checkpoint's network was built with other backbone settings:")


def test_load_official_refuses_the_other_variant_and_names_the_files_variant(tmp_path: Path) -> None:
    """A released FlowFormer file loaded as FlowFormer++ (or the reverse, `task=convert` without
    `backbone=flowformer_pp`): the error ends naming the variant the file's weights are."""
    path = official_file(tmp_path, build_backbone(variant="flowformer"))
    with pytest.raises(CheckpointMismatchError, match="channel_convertor") as err:
        load_official(path, variant="flowformer_pp", **tiny_kwargs())
    assert str(err.value).endswith(
        "The checkpoint has memory_encoder.channel_convertor.weight, which only FlowFormer has: FlowFormer's "
        "weights? Set backbone.variant=flowformer (the published FlowFormer: backbone=flowformer)."
    )
    (tmp_path / "pp").mkdir()
    plus_plus = official_file(tmp_path / "pp", build_backbone(variant="flowformer_pp"))
    with pytest.raises(CheckpointMismatchError) as err:
        load_official(plus_plus, variant="flowformer", **tiny_kwargs())
    assert str(err.value).endswith("FlowFormer++'s weights? Set backbone.variant=flowformer_pp (the published "
                                   "FlowFormer++: backbone=flowformer_pp).")
    net = load_official(path, variant="flowformer", **tiny_kwargs())
    assert not net.training and all(p.device.type == "cpu" for p in net.state_dict().values())


def tiny_kwargs() -> dict:
    return {k: v for k, v in backbone_kwargs().items() if k != "variant"}


def test_lightning_checkpoint_with_skip_prefixes(tmp_path: Path) -> None:
    src = build_backbone()
    ckpt = {"state_dict": {f"backbone.{k}": v for k, v in src.state_dict().items()}, "epoch": 3}
    ckpt["state_dict"]["backbone.memory_decoder.pretrain_head.4.weight"] = torch.zeros(9, 64, 1, 1)
    ckpt["state_dict"]["metric.total"] = torch.zeros(1)
    torch.save(ckpt, tmp_path / "last.ckpt")
    dst = build_backbone()
    before = dst.memory_decoder.pretrain_head[4].weight.clone()
    with pytest.raises(CheckpointMismatchError, match="pretrain_head.4.weight"):
        load_backbone_weights(dst, tmp_path / "last.ckpt")
    report = load_backbone_weights(
        dst, tmp_path / "last.ckpt", skip_prefixes=("memory_decoder.pretrain_head.",)
    )
    assert report.source == "lightning"
    assert "memory_decoder.pretrain_head.4.weight" in report.skipped
    assert torch.equal(dst.memory_decoder.pretrain_head[4].weight, before)  # skipped keys keep their values
    assert torch.equal(dst.memory_decoder.proj.weight, src.memory_decoder.proj.weight)


def test_save_backbone_is_plain_and_rebuilds(tmp_path: Path) -> None:
    net = build_backbone(tokenize_chunk=64)
    save_backbone(tmp_path / "b.ckpt", net)
    obj = torch.load(tmp_path / "b.ckpt", weights_only=True)
    assert obj["format"] == "flowformer-backbone" and obj["config"]["tokenize_chunk"] == 64
    rebuilt = load_backbone(tmp_path / "b.ckpt")
    assert rebuilt.config == net.config
    assert all(torch.equal(v, rebuilt.state_dict()[k]) for k, v in net.state_dict().items())
    other = build_backbone()
    assert load_backbone_weights(other, tmp_path / "b.ckpt").source == "backbone"


def old_backbone_config(config: dict) -> dict:
    """A stored backbone config as versions before the composable network wrote it: with the retired
    decoder_iters, without the cost_encoder knob (there was one cost encoder)."""
    return {**{k: v for k, v in config.items() if k != "cost_encoder"}, "decoder_iters": 12}


def test_backbone_file_written_by_older_versions_still_loads(tmp_path: Path) -> None:
    net = build_backbone()
    save_backbone(tmp_path / "b.ckpt", net)
    obj = torch.load(tmp_path / "b.ckpt", weights_only=True)
    torch.save({**obj, "config": old_backbone_config(obj["config"])}, tmp_path / "old.ckpt")
    rebuilt = load_backbone(tmp_path / "old.ckpt")
    assert rebuilt.config == net.config
    assert all(torch.equal(v, rebuilt.state_dict()[k]) for k, v in net.state_dict().items())


def test_lightning_backbone_hyperparameters_of_older_versions_still_build() -> None:
    """Lightning checkpoints store the backbone's Hydra config; older ones name FlowFormer itself as `_target_`."""
    old = {"_target_": "flowformer.models.FlowFormer", **old_backbone_config(backbone_kwargs())}
    net = instantiate(current_backbone_config(old))
    assert isinstance(net, FlowFormer) and net.config == build_backbone().config


def test_convert_cli_both_directions(tmp_path: Path) -> None:
    official = official_file(tmp_path, build_backbone(variant="flowformer"))
    ours, back = tmp_path / "ours.ckpt", tmp_path / "back.pth"
    tiny_yaml = CONF_DIR / "backbone" / "tiny.yaml"
    convert([str(official), str(ours), "--variant", "flowformer", "--backbone", str(tiny_yaml)])
    assert load_backbone(ours).variant == "flowformer"
    convert([str(ours), str(back), "--to-official"])
    a = torch.load(official, weights_only=True)
    b = torch.load(back, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k]) for k in a)


class CreatesFileWhenUnpickled:
    """Unpickling it runs code: it creates the file `target`."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __setstate__(self, state: dict) -> None:
        Path(state["target"]).touch()
        self.__dict__.update(state)


def test_read_checkpoint_returns_the_dict_and_names_a_missing_file(tmp_path: Path) -> None:
    torch.save({"a": torch.arange(3)}, tmp_path / "ok.pth")
    assert torch.equal(read_checkpoint(tmp_path / "ok.pth")["a"], torch.arange(3))
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nope\.pth does not exist"):
        read_checkpoint(tmp_path / "nope.pth")
    with pytest.raises(
        CheckpointReadError, match=rf"checkpoint {re.escape(str(tmp_path))} is not a regular file \(a directory\)"
    ):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_a_run_directory_given_for_a_checkpoint_names_its_last_checkpoint(tmp_path: Path, given: str) -> None:
    """`eval.checkpoint=<run dir>` (or its checkpoints/ folder): the error names the file to give instead."""
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"a": torch.arange(3)}, last)
    message = rf"checkpoint {re.escape(str(tmp_path / given))} is not a regular file \(a directory\); give its "
    with pytest.raises(CheckpointReadError, match=message + re.escape(str(last)) + "$"):
        read_checkpoint(tmp_path / given)


def _random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def _truncated(path: Path) -> None:
    torch.save({"a": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (_random_bytes, "torch.load cannot parse it"),
        (_truncated, "torch.load cannot parse it"),
        (_empty, "empty"),
    ],
)
def test_read_checkpoint_reports_bytes_that_are_not_a_checkpoint(tmp_path: Path, make, detail: str) -> None:
    path = tmp_path / "model.pth"
    make(path)
    with pytest.raises(CheckpointReadError) as err:
        read_checkpoint(path)
    text = str(err.value)
    assert (
        text.startswith(f"{path} is not a PyTorch checkpoint or is corrupt or truncated (") and detail in text
    )
    assert "\n" not in text
    assert "weights_only=False" not in "".join(traceback.format_exception(err.value))


@pytest.mark.parametrize("force_unsafe_env", [False, True])
def test_read_checkpoint_never_unpickles_classes(tmp_path: Path, monkeypatch, force_unsafe_env: bool) -> None:
    marker = tmp_path / "created_by_unpickling"
    path = tmp_path / "model.pth"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": CreatesFileWhenUnpickled(marker)}, path)
    torch.load(path, weights_only=False)  # a full unpickle does run the file's code
    assert marker.exists()
    marker.unlink()
    if force_unsafe_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointReadError) as err:
        read_checkpoint(path)
    assert not marker.exists()
    text = str(err.value)
    assert text.startswith(f"checkpoint {path} holds pickled classes or functions (found ")
    assert "CreatesFileWhenUnpickled)" in text and "\n" not in text
    assert "weights_only=False" not in "".join(traceback.format_exception(err.value))


def test_read_checkpoint_wants_a_dict(tmp_path: Path) -> None:
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(CheckpointReadError, match=r"list\.pth holds a list, expected a dict"):
        read_checkpoint(tmp_path / "list.pth")
    with pytest.raises(CheckpointReadError, match=r"list\.pth holds a list"):
        load_backbone_weights(build_backbone(), tmp_path / "list.pth")


def _backbone_file(tmp_path: Path) -> Path:
    save_backbone(tmp_path / "ours.ckpt", build_backbone())
    return tmp_path / "ours.ckpt"


def _random_file(tmp_path: Path) -> Path:
    _random_bytes(tmp_path / "random.pth")
    return tmp_path / "random.pth"


def _missing_file(tmp_path: Path) -> Path:
    return tmp_path / "missing.pth"


@pytest.mark.parametrize(
    ("src", "dst", "expect"),
    [
        (_missing_file, "out.pth", "checkpoint {tmp}/missing.pth does not exist"),
        (_random_file, "out.pth", "{tmp}/random.pth is not a PyTorch checkpoint"),
        (_backbone_file, "ours.ckpt/out.pth", "cannot write {tmp}/ours.ckpt/out.pth ({tmp}/ours.ckpt is a file)"),
    ],
)
def test_convert_cli_reports_bad_input_in_one_line(
    tmp_path: Path, capsys, src, dst: str, expect: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        convert([str(src(tmp_path)), str(tmp_path / dst), "--to-official"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {expect.format(tmp=tmp_path)}") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err


def test_save_backbone_makes_missing_folders_and_names_an_unwritable_destination(tmp_path: Path) -> None:
    save_backbone(tmp_path / "new" / "b.ckpt", build_backbone())
    load_backbone(tmp_path / "new" / "b.ckpt")
    with pytest.raises(OutputWriteError) as err:
        save_backbone(tmp_path / "new" / "b.ckpt" / "x", build_backbone())
    assert str(err.value).startswith(f"cannot write {tmp_path}/new/b.ckpt/x ({tmp_path}/new/b.ckpt is a file)")


def test_convert_cli_keeps_an_existing_dst_unless_overwrite_and_never_writes_src(tmp_path: Path, capsys) -> None:
    official = official_file(tmp_path, build_backbone(variant="flowformer"))
    ours = tmp_path / "ours.ckpt"
    ours.write_bytes(b"an earlier result")
    official_bytes = official.read_bytes()
    tiny = ["--variant", "flowformer", "--backbone", str(CONF_DIR / "backbone" / "tiny.yaml")]
    for argv, expect in (
        ([str(official), str(ours), *tiny], f"error: dst {ours} exists already; choose another dst, or pass --overwrite"),
        ([str(official), str(official), *tiny, "--overwrite"], f"error: dst {official} is src"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            convert(argv)
        assert exit_info.value.code == 1 and capsys.readouterr().err.startswith(expect)
    assert ours.read_bytes() == b"an earlier result"
    assert official.read_bytes() == official_bytes
    convert([str(official), str(ours), *tiny, "--overwrite"])
    assert load_backbone(ours).variant == "flowformer"


def test_convert_cli_reports_mismatching_keys(tmp_path: Path, capsys) -> None:
    official = official_file(tmp_path, build_backbone(variant="flowformer"))
    with pytest.raises(SystemExit) as exit_info:
        convert([str(official), str(tmp_path / "ours.ckpt"), "--variant", "flowformer"])  # not the tiny knobs
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: official checkpoint {official} (variant='flowformer') does not match the network"
    )
    assert "Traceback" not in err and not (tmp_path / "ours.ckpt").exists()


def test_twins_weights_from_a_local_file(tmp_path: Path) -> None:
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in TwinsEncoder().svt.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    state["blocks.2.0.attn.qkv.weight"] = torch.zeros(3)  # later stages and the head are ignored
    state["head.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "twins_svt_large.pth")
    encoder = TwinsEncoder(twins_weights=str(tmp_path / "twins_svt_large.pth"))
    assert torch.equal(encoder.svt.patch_embeds[0].proj.weight, state["patch_embeds.0.proj.weight"])
    del state["norm.weight"]
    state["patch_embeds.0.proj.bias"] = torch.zeros(5)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(
        ValueError, match=r"missing=\['norm.weight'\].*shape-mismatched=\['patch_embeds.0.proj.bias'\]"
    ):
        encoder.load_imagenet(tmp_path / "bad.pth")

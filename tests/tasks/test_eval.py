"""task=eval: the per-set protocol (padding, tiling, iterations) and its metrics, with stand-in networks."""

import json
import logging
import re
from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn
from torch.utils.data import Dataset

from flowformer.data import loader_settings
from flowformer.data.io import read_flo, read_kitti_flow, write_flo
from flowformer.eval.padding import InputPadder
from flowformer.eval.protocol import EvalSet, Protocol, WarmStart, forward_project
from flowformer.metrics import FlowMetrics, NothingScoredError
from flowformer.models import save_backbone
from flowformer.tasks.eval import eval_workers, evaluate_set, format_table, run

from helpers.configs import CONF_DIR
from helpers.run import fresh_checkout, run_py
from helpers.trees import H, W, sintel_tree


class ConstantFlowSet(Dataset):
    """Pairs with a constant ground-truth flow (3, 4): |gt| = 5 everywhere; `valid_rows` rows are valid."""

    def __init__(self, sizes: list[tuple[int, int]], valid_rows: int | None = None) -> None:
        self.sizes = sizes
        self.valid_rows = valid_rows

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> dict:
        h, w = self.sizes[index]
        valid = torch.ones(h, w)
        if self.valid_rows is not None:
            valid[self.valid_rows :] = 0
        flow = torch.stack([torch.full((h, w), 3.0), torch.full((h, w), 4.0)])
        return {
            "img1": torch.rand(3, h, w) * 255,
            "img2": torch.rand(3, h, w) * 255,
            "flow": flow,
            "valid": valid,
        }


class RecordingNet(nn.Module):
    """Returns a constant flow and records the input sizes and iteration counts it was called with."""

    def __init__(self, flow: tuple[float, float]) -> None:
        super().__init__()
        self.flow = flow
        self.calls: list[tuple[tuple[int, int], int]] = []

    def forward(self, image1: torch.Tensor, image2: torch.Tensor, iters: int = 12) -> dict:
        b, _, h, w = image1.shape
        self.calls.append(((h, w), iters))
        flow = torch.tensor(self.flow).view(1, 2, 1, 1).expand(b, 2, h, w)
        return {"flow": flow.clone(), "flow_low": flow[..., ::8, ::8]}


CPU = torch.device("cpu")


def test_sintel_protocol_pads_uses_iters_and_reports_speed_bins() -> None:
    net = RecordingNet((0.0, 0.0))  # error = |gt| = 5 on every pixel
    protocol = Protocol(kind="sintel", iters=32, pad_mode="sintel")
    data = ConstantFlowSet([(36, 60), (36, 60)], valid_rows=0)
    result = evaluate_set(net, data, protocol, name="sintel_clean", device=CPU)
    assert net.calls == [((40, 64), 32)] * 2  # 'sintel' padding to multiples of 8, FF's 32 iterations
    # Sintel ignores the valid mask (all pixels count, as the official validate_sintel), so an all-invalid
    # mask changes nothing
    assert result["epe"] == pytest.approx(5.0)
    assert result["1px"] == result["3px"] == result["5px"] == 0.0
    assert result["s0-10"] == pytest.approx(5.0)
    assert "f1_all" not in result


def test_kitti_protocol_uses_valid_pixels_and_labels_both_averagings() -> None:
    net = RecordingNet((3.0, 0.0))  # error (0, 4) -> epe 4 > 3 and > 5 % of 5: every pixel is an outlier
    protocol = Protocol(kind="kitti", iters=24)
    data = ConstantFlowSet([(20, 30), (20, 62)], valid_rows=5)
    result = evaluate_set(net, data, protocol, name="kitti", device=CPU)
    assert result["epe"] == pytest.approx(4.0)  # per image, the official kitti-epe
    assert result["epe_pooled"] == pytest.approx(4.0)
    assert result["f1_all"] == pytest.approx(100.0)  # pooled, the official kitti-f1
    assert result["f1_all_per_image"] == pytest.approx(100.0)
    assert [iters for _, iters in net.calls] == [24, 24]


def test_a_set_with_nothing_to_score_or_a_non_finite_flow_is_an_error_naming_it() -> None:
    data = ConstantFlowSet([(20, 30), (20, 30)])
    flow = Protocol(kind="flow", iters=2)
    with pytest.raises(ValueError, match=r"eval.max_samples=-1: expected a positive number"):
        evaluate_set(RecordingNet((0.0, 0.0)), data, flow, name="synthetic", device=CPU, max_samples=-1)
    with pytest.raises(ValueError, match=r"eval.max_samples=1.5: expected a whole number"):
        evaluate_set(RecordingNet((0.0, 0.0)), data, flow, name="synthetic", device=CPU, max_samples=1.5)
    no_valid_pixel = ConstantFlowSet([(20, 30), (20, 30)], valid_rows=0)
    with pytest.raises(NothingScoredError, match="eval set kitti: no pixel was scored .* in its 2 pairs"):
        evaluate_set(RecordingNet((0.0, 0.0)), no_valid_pixel, Protocol(kind="kitti", iters=2), name="kitti",
                     device=CPU)
    nan_net = RecordingNet((float("nan"), 0.0))
    with pytest.raises(FloatingPointError, match="eval set synthetic, pair 0: .* non-finite flow"):
        evaluate_set(nan_net, data, flow, name="synthetic", device=CPU)


def test_tiled_protocol_runs_the_official_tile_grid() -> None:
    net = RecordingNet((3.0, 4.0))  # perfect prediction -> EPE 0 after blending
    protocol = Protocol(kind="kitti", iters=2, tile=True, tile_size=(24, 40), tile_pad_mode="kitti376")
    with pytest.raises(ValueError, match="376"):
        evaluate_set(net, ConstantFlowSet([(380, 60)]), protocol, name="kitti", device=CPU)
    protocol = Protocol(kind="flow", iters=2, tile=True, tile_size=(24, 40), min_overlap=8)
    result = evaluate_set(net, ConstantFlowSet([(30, 60)]), protocol, name="synthetic", device=CPU)
    # hs = [0, 6], ws = [0, 20] (last entries flush with the border): 4 tiles of 24x40
    assert net.calls == [((24, 40), 2)] * 4
    assert result["epe"] == pytest.approx(0.0, abs=1e-5)


def test_tiling_needs_a_tile_size_and_refuses_a_warm_start() -> None:
    with pytest.raises(ValueError, match="tile_size"):
        Protocol(kind="flow", iters=1, tile=True)
    image = torch.zeros(1, 3, 16, 16)
    tiled = Protocol(kind="flow", iters=1, tile=True, tile_size=(8, 8), min_overlap=2)
    with pytest.raises(ValueError, match="flow_init"):
        tiled.predict(RecordingNet((0.0, 0.0)), image, image, flow_init=torch.zeros(1, 2, 2, 2))


def test_eval_set_checks_its_config_and_table() -> None:
    with pytest.raises(ValueError, match="kind"):
        EvalSet(ConstantFlowSet([(8, 8)]), kind="middlebury")
    with pytest.raises(ValueError, match="pad_mode"):
        EvalSet(ConstantFlowSet([(8, 8)]), kind="flow", pad_mode="reflect")
    with pytest.raises(Exception, match="tile_szie"):
        hydra.utils.instantiate(
            {"_target_": "flowformer.eval.protocol.EvalSet", "dataset": None, "kind": "flow", "tile_szie": [8, 8]}
        )
    eval_set = EvalSet(ConstantFlowSet([(8, 8)]), kind="kitti", iters=24, tile_size=[376, 720])
    protocol = eval_set.protocol(eval_set.iters, tile=True)
    assert (protocol.tile_size, protocol.pad_mode, protocol.iters) == ((376, 720), "sintel", 24)
    table = format_table(
        {"sintel_clean": {"epe": 1.0, "s40+": float("nan")}, "kitti": {"epe": 2.0}},
        {"sintel_clean": "sintel", "kitti": "kitti"},
    )
    assert "sintel_clean" in table and "1.0000" in table and "kitti-epe = epe (per-image mean)" in table


def test_eval_task_end_to_end_tiny_backbone_on_synthetic(tmp_path: Path, caplog) -> None:
    """task=eval composed by Hydra: loads our checkpoint, evaluates, writes JSON; plain and tiled. With
    eval.max_samples=2 of the set's 8 pairs, the log and the record say that 2 pairs were scored."""
    overrides = [
        "task=eval",
        "backbone=tiny",
        "eval=synthetic",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'out'}",
        f"eval.checkpoint={tmp_path / 'tiny.pt'}",
        "eval.max_samples=2",
        "eval.benchmarks.synthetic.iters=2",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        tiled_cfg = compose(
            "config", overrides=[*overrides, "eval.tile=true", f"eval.results_json={tmp_path / 't.json'}"]
        )
    torch.manual_seed(7)  # weights that differ from what run() would initialise with its own seed
    net = hydra.utils.instantiate(cfg.backbone).eval()
    save_backbone(tmp_path / "tiny.pt", net)

    with caplog.at_level(logging.INFO):
        value = run(cfg)
    record = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    result = record["results"]["synthetic"]
    assert set(result) == {"epe", "1px", "3px", "5px", "f1_all"}
    assert value == pytest.approx(result["epe"]) and value > 0
    assert record["protocol"]["synthetic"]["iters"] == 2
    assert (record["protocol"]["synthetic"]["pairs"], record["protocol"]["synthetic"]["pairs_in_set"]) == (2, 8)
    assert "evaluating synthetic (2 of its 8 pairs, read in this process)" in caplog.text

    # the same numbers by hand: the saved weights, 'sintel' padding, valid-masked pixel-pooled metrics
    dataset = hydra.utils.instantiate(cfg.eval.benchmarks.synthetic.dataset)
    expected = FlowMetrics()
    with torch.inference_mode():
        for i in range(2):
            item = dataset[i]
            padder = InputPadder(item["img1"][None].shape, mode="sintel")
            flow = net(*padder.pad(item["img1"][None], item["img2"][None]), iters=2)["flow"]
            expected.update(padder.unpad(flow), item["flow"][None], item["valid"][None])
    assert result["epe"] == pytest.approx(expected.compute()["epe"].item(), rel=1e-5)

    tiled = run(tiled_cfg)
    assert tiled == pytest.approx(
        json.loads((tmp_path / "t.json").read_text())["results"]["synthetic"]["epe"]
    )
    assert tiled > 0 and tiled != pytest.approx(
        value, rel=1e-6
    )  # 4 tiles of 64x96 instead of one padded pass


def test_non_finite_ground_truth_is_left_out_never_a_nan_metric(tmp_path: Path) -> None:
    """A Sintel .flo with NaN and inf pixels: `python run.py task=eval ... eval.baselines=[zero]` scores the
    network and zero flow over the finite pixels only, and says how many it left out."""
    sintel = sintel_tree(tmp_path / "data" / "Sintel")
    flo = sintel / "training/flow/alley_1/frame_0001.flo"  # flow (1, -1); market_2's two pairs: (1, -1), (2, -2)
    flow = read_flo(flo)
    flow[:4, :5] = np.nan
    flow[5, 6, 0] = np.inf
    write_flo(flo, flow)
    result = run_py(
        "task=eval",
        "backbone=tiny",
        "eval.sets=[sintel_clean]",
        "eval.baselines=[zero]",
        "eval.benchmarks.sintel_clean.iters=1",
        "eval.num_workers=0",
        f"paths.data_dir={tmp_path / 'data'}",
        f"paths.output_dir={tmp_path / 'out'}",
        cwd=fresh_checkout(tmp_path / "checkout"),
    )
    record = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    scores = [record["results"]["sintel_clean"], record["baselines"]["zero"]["sintel_clean"]]
    # every metric is a number (the speed bins above 10 px hold no pixel here: NaN, as always for an empty bin)
    assert all(np.isfinite(metrics[key]) for metrics in scores for key in ("epe", "1px", "3px", "5px", "s0-10"))
    missing = 4 * 5 + 1
    zero_epe = np.sqrt(2) * (H * W - missing + H * W + 2 * H * W) / (3 * H * W - missing)
    assert scores[1]["epe"] == pytest.approx(zero_epe, rel=1e-6)
    for name in ("sintel_clean", "sintel_clean (zero)"):
        assert f"{name}: {missing} ground-truth pixels are NaN or inf and were left out as invalid" in result.stdout


def test_eval_task_writes_sintel_and_kitti_submissions(tmp_path: Path, caplog) -> None:
    """Test splits (no flow) go through DATA-A's writers: Sintel .flo tree and KITTI 16-bit PNGs; without
    eval.checkpoint the network keeps its random weights, with a warning."""
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for name in ("frame_0001.png", "frame_0002.png", "frame_0003.png"):
        path = data / "Sintel" / "test" / "clean" / "alley_9" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), rng.integers(0, 256, (36, 60, 3), dtype=np.uint8))
    for name in ("000000_10.png", "000000_11.png"):
        path = data / "KITTI" / "testing" / "image_2" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), rng.integers(0, 256, (20, 44, 3), dtype=np.uint8))
    overrides = [
        "task=eval",
        "backbone=tiny",
        "eval.sets=[sintel_test_clean,kitti_test]",
        "eval.num_workers=0",
        f"paths.data_dir={data}",
        f"paths.output_dir={tmp_path / 'out'}",
        "eval.benchmarks.sintel_test_clean.iters=1",
        "eval.benchmarks.kitti_test.iters=1",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with caplog.at_level(logging.WARNING):
        assert run(cfg) is None  # nothing to score on test splits
    assert "eval.checkpoint is null: evaluating randomly initialised weights" in caplog.text
    submission = tmp_path / "out" / "submission"
    flows = sorted(p.relative_to(submission).as_posix() for p in submission.rglob("*.flo"))
    assert flows == ["sintel/clean/alley_9/frame0001.flo", "sintel/clean/alley_9/frame0002.flo"]
    assert read_flo(submission / flows[0]).shape == (36, 60, 2)  # unpadded back to the image size
    flow, valid = read_kitti_flow(submission / "kitti" / "000000_10.png")
    assert flow.shape == (20, 44, 2) and valid.all()


@pytest.mark.parametrize("preset", ["flowformer", "flowformer_pp"])
def test_eval_presets_follow_the_official_protocols(preset: str) -> None:
    """The official iterations (FF: 32 Sintel, 24 KITTI; FF++: 12), padding and tile protocols per set."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=eval", f"eval={preset}"])
    cfg.eval.benchmarks = {  # empty lists stand in for the datasets: the protocols need no data trees
        name: {**node, "dataset": {"_target_": "builtins.list"}} for name, node in cfg.eval.benchmarks.items()
    }
    sets = {name: hydra.utils.instantiate(node) for name, node in cfg.eval.benchmarks.items()}
    ff = preset == "flowformer"
    assert cfg.eval.sigma == 0.05 and cfg.eval.min_overlap == 20 and cfg.eval.precision == "32-true"
    for name in ("sintel_clean", "sintel_final", "sintel_test_clean", "sintel_test_final"):
        assert sets[name].iters == (32 if ff else 12)
        assert (sets[name].pad_mode, sets[name].tile_size, sets[name].tile_pad_mode) == (
            "sintel",
            (432, 960),
            None,
        )
    kitti = sets["kitti"]
    assert kitti.kind == "kitti" and kitti.iters == (24 if ff else 12) and kitti.pad_mode == "sintel"
    assert (kitti.tile_size, kitti.tile_pad_mode) == (((376, 720), "kitti376") if ff else ((288, 960), None))
    test = sets["kitti_test"]
    assert (test.kind, test.iters, test.tile_size, test.tile_pad_mode) == (
        "kitti_submission",
        24 if ff else 12,
        (432, 960),
        "kitti432",
    )


def test_the_sintel_command_on_a_cpu_reads_its_pairs_in_its_own_process(tmp_path: Path) -> None:
    """`python run.py task=eval backbone=tiny eval.sets=[sintel_clean]`: eval.num_workers was 4 wherever it ran,
    so on 2 cores torch warned at every set that 4 workers exceed the 2 it suggests, and they took cores from the
    network's forward. Now auto: none on a CPU, as training's loader."""
    sintel_tree(tmp_path / "data" / "Sintel")
    result = run_py(
        "task=eval",
        "backbone=tiny",
        "eval.sets=[sintel_clean]",
        f"paths.data_dir={tmp_path / 'data'}",
        cwd=fresh_checkout(tmp_path / "checkout"),
    )
    assert "evaluating sintel_clean (3 of its 3 pairs, read in this process): " in result.stdout
    assert "worker processes in total" not in result.stderr


def test_auto_eval_workers_are_none_on_a_cpu_and_the_cores_less_one_on_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(loader_settings, "available_cores", lambda: 16)
    assert eval_workers("auto", torch.device("cpu")) == 0
    assert eval_workers("auto", torch.device("cuda")) == 8  # at most MAX_AUTO_WORKERS
    assert eval_workers(3, torch.device("cpu")) == 3
    monkeypatch.setattr(loader_settings, "available_cores", lambda: 3)
    assert eval_workers("auto", torch.device("cuda")) == 2


def test_missing_dataset_fails_before_the_network_with_the_eval_alternative(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=eval", "backbone=flowformer", f"paths.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=r"eval set 'sintel_clean'(.|\n)*eval=synthetic"):
        run(cfg)


def test_no_set_to_evaluate_is_refused_before_the_network(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=eval", "backbone=flowformer", "eval.sets=[]"])
    with pytest.raises(ValueError, match=r"eval.sets is empty: name the sets to evaluate, of eval.benchmarks \["):
        run(cfg)


@pytest.mark.parametrize(
    ("iters", "message"),
    [(0, "iters=0: the decoder iterations must be >= 1"), ("abc", "iters='abc': expected a whole number")],
)
def test_a_sets_decoder_iterations_are_checked_before_the_network_naming_the_set(iters, message) -> None:
    """`eval.benchmarks.synthetic.iters=0` failed in the network's forward, naming no setting; `=abc` was
    int()'s "invalid literal for int() with base 10"."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config", overrides=["task=eval", "eval=synthetic", "backbone=tiny", f"eval.benchmarks.synthetic.iters={iters}"]
        )
    with pytest.raises(ValueError) as refusal:
        run(cfg)
    assert str(refusal.value) == f"eval.benchmarks.synthetic: {message}"


def test_warm_start_carries_each_scenes_flow_to_its_next_pair(tmp_path: Path) -> None:
    """eval.warm_start=true on a Sintel-shaped test tree (alley_1: one pair, market_2: two): the first pair of
    each scene is as without it, the second pair of market_2 starts from the first's projected 1/8 flow."""
    sintel_tree(tmp_path / "data" / "Sintel")
    overrides = [
        "task=eval",
        "backbone=tiny",
        "eval.sets=[sintel_test_clean]",
        "eval.num_workers=0",
        f"paths.data_dir={tmp_path / 'data'}",
        f"eval.checkpoint={tmp_path / 'tiny.pt'}",
        "eval.benchmarks.sintel_test_clean.iters=1",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        configs = {
            warm: compose(
                "config",
                overrides=[*overrides, f"eval.warm_start={warm}", f"paths.output_dir={tmp_path / warm}"],
            )
            for warm in ("false", "true")
        }
        tiled = compose("config", overrides=[*overrides, "eval.warm_start=true", "eval.tile=true"])
    net = hydra.utils.instantiate(configs["true"].backbone).eval()
    save_backbone(tmp_path / "tiny.pt", net)
    with pytest.raises(ValueError, match="eval.warm_start=true with eval.tile=true: .* one of them to false"):
        run(tiled)
    names = ("alley_1/frame0001.flo", "market_2/frame0001.flo", "market_2/frame0002.flo")
    flows = {}
    for warm, cfg in configs.items():
        run(cfg)
        record = json.loads((tmp_path / warm / "eval_results.json").read_text())
        assert record["protocol"]["sintel_test_clean"]["warm_start"] == (warm == "true")
        flows[warm] = [read_flo(tmp_path / warm / "submission" / "sintel" / "clean" / name) for name in names]
    for first in (0, 1):  # each scene's first pair
        np.testing.assert_array_equal(flows["true"][first], flows["false"][first])
    assert not np.allclose(flows["true"][2], flows["false"][2])
    # the second pair is the network started from infer's forward projection of the first pair's 1/8 flow
    scenes = hydra.utils.instantiate(configs["true"].eval.benchmarks.sintel_test_clean.dataset)
    pairs = [(scenes[i]["img1"][None], scenes[i]["img2"][None]) for i in (1, 2)]  # market_2 (after alley_1)
    protocol = Protocol(iters=1, pad_mode="sintel")
    with torch.inference_mode():
        first = protocol.predict(net, *pairs[0])
        second = protocol.predict(net, *pairs[1], flow_init=forward_project(first["flow_low"]))
    np.testing.assert_allclose(flows["true"][2], second["flow"][0].permute(1, 2, 0).numpy(), atol=1e-5)


def test_evaluation_shows_a_progress_bar_with_pairs_per_second_and_time_left(capsys) -> None:
    flow_set, protocol = ConstantFlowSet([(16, 16)] * 3), Protocol(kind="flow", iters=1)
    evaluate_set(RecordingNet((0.0, 0.0)), flow_set, protocol, name="demo", device=CPU)
    assert re.search(r"demo .* 3/3 .*pairs/s \d+:\d\d:\d\d", capsys.readouterr().out)


class InitRecordingNet(nn.Module):
    """Returns zero flow and a 1/8 flow of (1, 0); records whether each call got a flow_init."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[bool] = []

    def forward(self, image1: torch.Tensor, image2: torch.Tensor, iters: int, flow_init=None) -> dict:
        self.started.append(flow_init is not None)
        b, _, h, w = image1.shape
        flow_low = torch.zeros(b, 2, h // 8, w // 8)
        flow_low[:, 0] = 1.0
        return {"flow": torch.zeros(b, 2, h, w), "flow_low": flow_low}


def test_a_warm_start_continues_only_the_next_frame_of_the_same_sequence() -> None:
    net, warm_start, image = InitRecordingNet(), WarmStart(), torch.zeros(1, 3, 16, 16)
    sintel = {"dataset": "sintel", "pass": "clean", "scene": "alley_1"}
    metas = [
        {**sintel, "frame": 0},
        {**sintel, "frame": 1},  # continues
        {**sintel, "frame": 3},  # a frame left out
        {**sintel, "pass": "final", "frame": 4},  # another pass
        {**sintel, "pass": "final", "frame": 5},  # continues
        {**sintel, "scene": "ambush_2", "frame": 6},  # another scene
        {"dataset": "kitti", "frame_id": "000000_10.png"},  # no frame: pairs of two frames
        {"dataset": "kitti", "frame_id": "000001_10.png"},
    ]
    for meta in metas:
        warm_start.predict(Protocol(iters=1), net, image, image, meta)
    assert net.started == [False, True, False, False, True, False, False, False]
    assert warm_start.continued == 2

"""task=infer on a frame folder and a video (odd sizes, .flo and KITTI PNG output) on CPU, the infer and bench
config groups, and the device / precision / network helpers the tasks share (task=bench: tests/tasks/test_bench.py)."""

import logging
import subprocess
from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch
from PIL import Image

from flowformer import device_settings
from flowformer.data.io import read_flo, read_kitti_flow
from flowformer.device_settings import DeviceMemory, available_memory_gb
from flowformer.eval.protocol import forward_project
from flowformer.models import save_backbone
from flowformer.models.checkpoint import CheckpointMismatchError, export_official, load_backbone
from flowformer.tasks import infer, run_task
from flowformer.tasks.runtime import autocast_context, load_network

from helpers.compose import compose_run_config
from helpers.compose import compose_tiny_config as config
from helpers.run import fresh_checkout, run_py
from helpers.trees import video_without_duration

CPU = torch.device("cpu")
HEIGHT, WIDTH = 50, 70  # not multiples of 8: the task pads and crops back


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_backbone(path, hydra.utils.instantiate(config().backbone))
    return path


def frames(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (HEIGHT, WIDTH + 2 * count, 3), dtype=np.uint8)
    return [np.ascontiguousarray(base[:, 2 * i : 2 * i + WIDTH]) for i in range(count)]


def frame_folder(folder: Path) -> Path:
    """`folder` holding three consecutive frames f00.png .. f02.png."""
    folder.mkdir()
    for i, frame in enumerate(frames(3)):
        cv2.imwrite(str(folder / f"f{i:02d}.png"), frame)
    return folder


def test_infer_frame_folder_writes_flo_and_colour_pictures(tmp_path, checkpoint):
    folder = frame_folder(tmp_path / "frames")
    out = tmp_path / "out"
    infer.run(config(f"infer.input={folder}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                     "infer.iters=2", "infer.device=cpu"))
    assert sorted(p.name for p in out.iterdir()) == [
        "f00.flo", "f00_flow.png", "f01.flo", "f01_flow.png", "flow.mp4"
    ]
    assert read_flo(out / "f00.flo").shape == (HEIGHT, WIDTH, 2)
    assert cv2.imread(str(out / "f01_flow.png")).shape == (HEIGHT, WIDTH, 3)


def test_a_folder_of_frames_numbered_without_zeros_is_paired_in_time_order(tmp_path, checkpoint):
    """Frames written as `%d.png` (1.png ... 11.png): the pairs are 1 -> 2, ..., 9 -> 10, 10 -> 11, each named
    by its first frame (a plain sort by name would pair 1 -> 10 -> 11 -> 2 ... -> 9 and write no 9.flo)."""
    folder = tmp_path / "frames"
    folder.mkdir()
    for number, frame in enumerate(frames(11), start=1):
        cv2.imwrite(str(folder / f"{number}.png"), frame)
    out = tmp_path / "out"
    infer.run(config(f"infer.input={folder}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                     "infer.iters=1", "infer.device=cpu", "infer.save_png=false", "infer.save_video=false"))
    assert sorted(int(path.stem) for path in out.glob("*.flo")) == list(range(1, 11))


def test_frames_whose_names_differ_only_in_their_suffix_are_refused_before_any_output(tmp_path, checkpoint):
    """a.jpg, a.png, b.png: the pairs a.jpg -> a.png and a.png -> b.png would both write a.flo."""
    folder = tmp_path / "frames"
    folder.mkdir()
    for name, frame in zip(["a.jpg", "a.png", "b.png"], frames(3), strict=True):
        cv2.imwrite(str(folder / name), frame)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"1 name\(s\) start more than one pair \(a: "):
        infer.run(config(f"infer.input={folder}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                         "infer.device=cpu"))
    assert list(out.iterdir()) == []


def refused_infer(checkout: Path, checkpoint: Path, folder: Path) -> subprocess.CompletedProcess:
    """`python run.py task=infer` of the tiny network on `folder` in `checkout`, which must fail with one line and
    no traceback."""
    result = run_py(
        "task=infer", "backbone=tiny", f"infer.checkpoint={checkpoint}", f"infer.input={folder}",
        cwd=checkout, expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    return result


def test_a_folder_of_frames_of_two_sizes_is_refused_naming_them_before_any_flow(tmp_path, checkpoint):
    """f00.png and f01.png at 50x70, f02.png cropped to 40x64: the size was found when the pair f01 -> f02 came,
    after the network was built and f00's flow written."""
    checkout = fresh_checkout(tmp_path / "checkout")
    folder = frame_folder(tmp_path / "frames")
    cv2.imwrite(str(folder / "f02.png"), frames(3)[2][:40, :64])
    result = refused_infer(checkout, checkpoint, folder)
    assert result.stderr.splitlines()[-1] == (
        "error (ValueError): infer.input: its frames have 2 sizes, 50x70 (2 frames: f00.png, f01.png) and 40x64 "
        "(1 frame: f02.png); a pair's flow needs both frames at one size: resize the frames, or give the frames "
        "of one size"
    )
    assert "parameters:" not in result.stdout + result.stderr  # refused before the network was built
    assert list((checkout / "logs").rglob("*.flo")) == []


def test_frames_smaller_than_the_network_takes_are_refused_naming_their_own_size(tmp_path, checkpoint):
    """5x6 frames are padded to 8x8, which the tiny network's CNN encoder (16x16 at least) refuses: its line said
    "got 8x8", a size the user's frames do not have."""
    checkout = fresh_checkout(tmp_path / "checkout")
    folder = tmp_path / "frames"
    folder.mkdir()
    for index, frame in enumerate(frames(2)):
        cv2.imwrite(str(folder / f"f{index:02d}.png"), frame[:5, :6])
    result = refused_infer(checkout, checkpoint, folder)
    assert result.stderr.splitlines()[-1] == (
        "error (ValueError): infer.input: its frames are 5x6 pixels (8x8 once padded by infer.pad_mode=sintel), "
        "smaller than the 16x16 that the cnn image encoder of this network needs; upscale the frames"
    )
    assert list((checkout / "logs").rglob("*.flo")) == []


def test_a_video_stating_no_frame_count_gets_the_flow_of_every_pair(tmp_path, checkpoint):
    """A Matroska file without a duration (a browser's WebM recording), for which OpenCV states no frame count:
    its frames are counted by reading it once, then each pair's flow is written."""
    video = video_without_duration(tmp_path / "recording.mkv", 5)
    out = tmp_path / "out"
    infer.run(config(f"infer.input={video}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                     "infer.iters=1", "infer.device=cpu", "infer.save_png=false"))
    assert sorted(path.name for path in out.iterdir()) == ["flow.mp4", *(f"frame_{i:06d}.flo" for i in range(4))]


def test_infer_under_bf16_mixed_writes_every_pair_of_a_folder(tmp_path, checkpoint):
    """One inference context (no autograd, bf16 autocast) entered again for each pair."""
    folder = frame_folder(tmp_path / "frames")
    out = tmp_path / "out"
    infer.run(config(f"infer.input={folder}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                     "infer.iters=2", "infer.device=cpu", "infer.precision=bf16-mixed", "infer.save_video=false"))
    flows = [read_flo(out / f"f0{i}.flo") for i in range(2)]
    assert all(flow.shape == (HEIGHT, WIDTH, 2) and np.isfinite(flow).all() for flow in flows)


def test_a_jpeg_pair_tagged_on_its_side_gets_its_flow_as_viewers_show_it(tmp_path, checkpoint):
    """JPEGs stored 50x70 with EXIF orientation 6 (turn 90 degrees clockwise) show as 70x50: their flow and
    flow picture are 70x50."""
    paths = []
    for i, frame in enumerate(frames(2)):
        image = Image.fromarray(frame)
        exif = image.getexif()
        exif[0x0112] = 6
        paths.append(tmp_path / f"f{i}.jpg")
        image.save(paths[-1], exif=exif)
    out = tmp_path / "out"
    infer.run(config(f"infer.input=[{paths[0]},{paths[1]}]", f"infer.checkpoint={checkpoint}",
                     f"infer.output_dir={out}", "infer.iters=1", "infer.device=cpu", "infer.save_video=false"))
    assert read_flo(out / "f0.flo").shape == (WIDTH, HEIGHT, 2)
    assert cv2.imread(str(out / "f0_flow.png")).shape == (WIDTH, HEIGHT, 3)


def test_a_non_finite_flow_is_an_error_naming_the_pair_and_is_not_written(tmp_path):
    net = hydra.utils.instantiate(config().backbone)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.fill_(float("nan"))
    save_backbone(tmp_path / "nan.pt", net)
    folder, out = tmp_path / "frames", tmp_path / "out"
    folder.mkdir()
    for i, frame in enumerate(frames(2)):
        cv2.imwrite(str(folder / f"f{i:02d}.png"), frame)
    with pytest.raises(FloatingPointError, match="infer.input pair f00 -> f01: the network predicted a non-finite"):
        infer.run(config(f"infer.input={folder}", f"infer.checkpoint={tmp_path / 'nan.pt'}",
                         f"infer.output_dir={out}", "infer.iters=2", "infer.device=cpu"))
    assert not list(out.glob("*.flo"))


@pytest.mark.parametrize("decoded", [0, 1, 2])
def test_a_video_that_decodes_fewer_frames_than_it_declares_reports_what_was_done(
    tmp_path, checkpoint, monkeypatch, caplog, decoded
):
    video = write_video(tmp_path / "clip.avi", 4)
    declared = infer.video_frames(video)
    monkeypatch.setattr(  # the container declares 4 frames; only `decoded` of them decode
        infer, "video_frames", lambda path: (declared[0], iter(frames(decoded)), declared[2])
    )
    settings = [f"infer.input={video}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={tmp_path / 'out'}",
                "infer.iters=1", "infer.device=cpu", "infer.save_video=false"]
    if decoded < 2:
        with pytest.raises(ValueError, match=f"infer.input {video}: .*no flow was written"):
            infer.run(config(*settings))
        return
    with caplog.at_level(logging.INFO, logger="flowformer.tasks.infer"):
        infer.run(config(*settings))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.flo")) == ["frame_000000.flo"]
    assert "only 2 of its 4 frames could be decoded" in caplog.text and "wrote 1 flow fields" in caplog.text


def write_video(path: Path, count: int) -> Path:
    """A Motion-JPEG .avi of `count` frames of `frames`."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 5, (WIDTH, HEIGHT))
    for frame in frames(count):
        writer.write(frame)
    writer.release()
    return path


def test_infer_video_writes_kitti_pngs(tmp_path, checkpoint):
    video = write_video(tmp_path / "clip.avi", 3)
    out = tmp_path / "out"
    infer.run(config(f"infer.input={video}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                     "infer.iters=2", "infer.device=cpu", "infer.format=kitti", "infer.save_png=false"))
    assert sorted(p.name for p in out.iterdir()) == ["flow.mp4", "frame_000000.png", "frame_000001.png"]
    flow, valid = read_kitti_flow(out / "frame_000000.png")
    assert flow.shape == (HEIGHT, WIDTH, 2) and valid.all()


def test_video_warm_start_changes_the_flow_and_the_flow_video_opens(tmp_path, checkpoint):
    video = write_video(tmp_path / "clip.avi", 4)
    flows = {}
    for warm in ("false", "true"):
        out = tmp_path / f"warm_{warm}"
        infer.run(config(f"infer.input={video}", f"infer.checkpoint={checkpoint}", f"infer.output_dir={out}",
                         "infer.iters=2", "infer.device=cpu", f"infer.warm_start={warm}", "infer.save_png=false"))
        flows[warm] = [read_flo(out / f"frame_{i:06d}.flo") for i in range(3)]
        capture = cv2.VideoCapture(str(out / "flow.mp4"))
        assert capture.isOpened() and int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
        ok, picture = capture.read()
        assert ok and picture.shape == (HEIGHT, WIDTH, 3)
        capture.release()
    # the first pair has no predecessor; the later ones start from the projected previous flow
    np.testing.assert_array_equal(flows["true"][0], flows["false"][0])
    assert not np.allclose(flows["true"][1], flows["false"][1])


def test_forward_project_moves_flow_to_where_it_points():
    flow = torch.zeros(1, 2, 6, 8)
    flow[0, 0, 2, 3] = 2.0  # pixel (x=3, y=2) moves 2 px right
    projected = forward_project(flow)
    assert projected[0, 0, 2, 5] > 0  # its flow now sits at (x=5, y=2)
    assert projected[0, 0, 2, 3] == 0  # where it came from is left empty and filled from zero-flow neighbours
    uniform = torch.ones(1, 2, 6, 8) * torch.tensor([3.0, 0.0]).view(1, 2, 1, 1)
    # everything shifts right: the first 3 columns are filled from their neighbours with the same flow
    torch.testing.assert_close(forward_project(uniform), uniform)


def test_infer_refuses_missing_input(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        infer.run(config(f"infer.input={tmp_path / 'nope'}", f"infer.checkpoint={checkpoint}"))


def test_unreadable_image_is_one_clear_message(tmp_path, checkpoint, capsys):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    cfg = config("task=infer", f"infer.input=[{broken},{broken}]", f"infer.checkpoint={checkpoint}",
                 "infer.device=cpu", f"infer.output_dir={tmp_path / 'out'}")
    with pytest.raises(SystemExit) as exit_info:
        run_task(cfg)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "error (FlowFileError)" in err and str(broken) in err


def test_infer_and_bench_settings_are_config_groups():
    cfg = compose_run_config(["task=infer", "infer.input=[a.png,b.png]", "infer.checkpoint=c.pt"])
    assert cfg.hydra.runtime.choices.infer == "default" and cfg.hydra.runtime.choices.bench == "default"
    assert list(cfg.infer.input) == ["a.png", "b.png"] and cfg.infer.checkpoint == "c.pt"
    settings = (cfg.infer.output_dir, cfg.infer.iters, cfg.infer.format, cfg.infer.pad_mode, cfg.infer.device)
    assert settings == ("/out/flow", 12, "flo", "sintel", "auto")
    cfg = compose_run_config(["task=bench", "bench.sizes=[[432,960]]"])
    assert (cfg.bench.mode, cfg.bench.sizes, cfg.bench.iters) == ("forward", [[432, 960]], 12)
    # the backbone's, chosen for bench.device when the rows run
    assert cfg.bench.precisions == ["32-true"] and cfg.bench.memory_budgets_gb == ["auto"]


def test_infer_refuses_a_null_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="infer.checkpoint is null"):
        infer.run(config(f"infer.input={tmp_path}", "infer.checkpoint=null"))


def test_load_network_loads_the_checkpoint_strictly_in_eval_mode(checkpoint):
    net = load_network(config().backbone, str(checkpoint), CPU)
    saved = load_backbone(checkpoint).state_dict()
    assert not net.training and all(torch.equal(value, saved[key]) for key, value in net.state_dict().items())
    assert load_network(config().backbone, None, CPU).state_dict().keys() == saved.keys()  # random weights
    with pytest.raises(CheckpointMismatchError):
        load_network(config("backbone.agt_depth=2").backbone, str(checkpoint), CPU)


def test_autocast_context_follows_the_precision_and_names_the_setting():
    with autocast_context(CPU, "bf16-mixed", "bench.precision"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast_context(CPU, "32-true", "bench.precision"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match=r"eval.precision='fp8': expected one of 32-true, bf16-mixed, 16-mixed"):
        autocast_context(CPU, "fp8", "eval.precision")


def test_infer_bounds_memory_by_default(monkeypatch):
    """infer's network (`load_network`) plans for half of the free memory (tiny.yaml: memory_budget_gb auto)."""
    assert available_memory_gb(CPU) > 0
    monkeypatch.setattr(device_settings, "describe_device", lambda device: DeviceMemory("cpu", "cpu", 0.002))
    pair_at_one_eighth = (1, 32, 32)  # one 256x256 pair
    bounded = load_network(config().backbone, None, CPU)
    assert bounded.memory_budget_gb == 0.001 and not bounded.memory_plan(*pair_at_one_eighth).dense
    dense = load_network(config("backbone.memory_budget_gb=null").backbone, None, CPU)
    assert dense.memory_budget_gb is None and dense.memory_plan(*pair_at_one_eighth).dense
    assert load_network(config("backbone.memory_budget_gb=3").backbone, None, CPU).memory_budget_gb == 3


def test_convert_is_a_task_like_the_others(tmp_path):
    torch.manual_seed(0)
    net = hydra.utils.instantiate(config("backbone.variant=flowformer").backbone)
    official = export_official(net, tmp_path / "released.pth")
    ours, back = tmp_path / "ours.ckpt", tmp_path / "back.pth"
    run_task(config("task=convert", "backbone.variant=flowformer", f"convert.input={tmp_path / 'released.pth'}",
                    f"convert.output={ours}", f"paths.output_dir={tmp_path / 'run1'}"))
    converted = load_backbone(ours)
    assert converted.variant == "flowformer"
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in converted.state_dict().items())
    run_task(config("task=convert", f"convert.input={ours}", f"convert.output={back}", "convert.to_official=true",
                    f"paths.output_dir={tmp_path / 'run2'}"))
    released_again = torch.load(back, weights_only=True)
    assert released_again.keys() == official.keys()
    assert all(torch.equal(released_again[k], official[k]) for k in official)

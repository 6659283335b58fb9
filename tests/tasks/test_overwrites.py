"""Earlier results are never destroyed: a run refuses another run's run or checkpoint directory (and of two
runs given one directory at the same time exactly one gets it); task=convert, task=infer and task=eval refuse
to replace existing outputs unless their `overwrite` setting is true, and never write over (or read back)
their own inputs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch

from flowformer.data.io import read_flo
from flowformer.models import save_backbone
from flowformer.models.checkpoint import export_official, load_backbone
from flowformer.tasks import run_dirs, run_task

from helpers.compose import compose_tiny_config as config
from helpers.configs import REPO_DIR
from helpers.run import run_py, start_run_py


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The run directory of a 6-step debug=tiny run (its checkpoints/last.ckpt at step 6)."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    result = run_py("debug=tiny", "trainer.max_steps=6", f"hydra.run.dir={run_dir}")
    (run_dir.parent / "stderr.txt").write_text(result.stderr)
    return run_dir


def test_a_claimed_checkpoint_directory_is_not_reported_as_not_empty(finished_run):
    """The claim file is the run's own: Lightning's 'exists and is not empty' warning would misread it."""
    assert (finished_run / "checkpoints" / run_dirs.CLAIM_FILE).is_file()
    assert "exists and is not empty" not in (finished_run.parent / "stderr.txt").read_text()


def test_a_run_given_another_runs_checkpoint_dirpath_is_refused(finished_run, tmp_path):
    checkpoints = finished_run / "checkpoints"
    last = checkpoints / "last.ckpt"
    before = last.read_bytes()
    result = run_py(
        "debug=tiny",
        f"hydra.run.dir={tmp_path / 'second'}",
        f"callbacks.last_checkpoint.dirpath={checkpoints}",
        f"callbacks.model_checkpoint.dirpath={checkpoints}",
        expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (error,) = error_lines(result.stderr)
    assert f"callbacks.last_checkpoint.dirpath {checkpoints} is not empty" in error
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert not (tmp_path / "second").exists()  # refused before any work: nothing left behind


def test_the_run_dir_of_a_finished_run_is_refused(finished_run):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    result = run_py("debug=tiny", f"hydra.run.dir={finished_run}", expect_ok=False)
    assert result.returncode == 1
    (error,) = error_lines(result.stderr)
    assert f"hydra.run.dir {finished_run} is not empty" in error
    assert {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()} == before


# python run.py, with Hydra's first write into the run directory (run.log) 5 s after its checks, as on a slow
# filesystem: two runs started together both check the directory before either writes into it.
SLOW_FIRST_WRITE = (
    "import runpy, time, hydra.core.utils as hydra_utils; configure_log = hydra_utils.configure_log; "
    "hydra_utils.configure_log = lambda *args: (time.sleep(5), configure_log(*args)); "
    "runpy.run_path('run.py', run_name='__main__')"
)


def test_two_runs_started_together_in_one_explicit_run_dir_one_wins(tmp_path):
    run_dir = tmp_path / "shared"
    command = [sys.executable, "-c", SLOW_FIRST_WRITE, "debug=tiny", "trainer.max_steps=1"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    runs = [
        subprocess.Popen(
            [*command, f"hydra.run.dir={run_dir}"],
            cwd=REPO_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    stderrs = [run.communicate(timeout=600)[1] for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 1], [stderr[-2000:] for stderr in stderrs]
    refused = stderrs[codes.index(1)]
    (error,) = error_lines(refused)
    assert f"hydra.run.dir {run_dir}" in error
    assert (run_dir / "run.log").read_text().count("monitored metric") == 1  # one run's log, not two
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1


def test_of_two_claims_that_both_found_the_directory_empty_the_second_is_refused(tmp_path, monkeypatch):
    run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the first run")
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(()))  # it listed the directory before that claim
    with pytest.raises(run_dirs.OutputPathError, match="was just claimed by another run"):
        run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the second run")
    monkeypatch.undo()
    assert (tmp_path / run_dirs.CLAIM_FILE).read_text() == "the first run"
    run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the first run")  # its own directory: still its own


def test_a_claim_is_given_back_only_where_its_run_wrote_nothing(tmp_path):
    unused, used = tmp_path / "unused", tmp_path / "used"
    for directory in (unused, used):
        directory.mkdir()
        run_dirs.claim_dir(directory, "callbacks.last_checkpoint.dirpath", "this run")
    (used / "last.ckpt").write_bytes(b"a checkpoint")
    run_dirs.release_unused_claims()
    assert not list(unused.iterdir())
    assert sorted(p.name for p in used.iterdir()) == [run_dirs.CLAIM_FILE, "last.ckpt"]


def refusal(cfg, capsys) -> str:
    """run_task(cfg) must exit 1 with one error line; that line."""
    with pytest.raises(SystemExit) as exit_info:
        run_task(cfg)
    assert exit_info.value.code == 1
    (error,) = error_lines(capsys.readouterr().err)
    return error


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def official(tmp_path) -> Path:
    """A released-layout .pth of the tiny backbone."""
    torch.manual_seed(0)
    path = tmp_path / "released.pth"
    export_official(hydra.utils.instantiate(config().backbone), path)
    return path


def convert_config(source: Path, output: Path, *overrides: str):
    return config("task=convert", f"convert.input={source}", f"convert.output={output}", *overrides)


def test_convert_never_writes_its_input_even_with_overwrite(official, capsys):
    before = official.read_bytes()
    error = refusal(convert_config(official, official, "convert.overwrite=true"), capsys)
    assert f"convert.output {official} is convert.input" in error
    assert official.read_bytes() == before


def test_a_folder_given_for_an_output_file_is_named_so_and_left_untouched(official, tmp_path, capsys):
    """`convert.output=<a folder> convert.overwrite=true` wrote the whole checkpoint beside it, then failed to
    rename it over the folder: "cannot write <folder> (Is a directory) ... Free disk space or choose another
    location". Every file the package writes goes through the same writer (flowformer/models/output_files.py)."""
    folder = tmp_path / "converted"
    (folder / "kept").mkdir(parents=True)
    error = refusal(convert_config(official, folder, "convert.overwrite=true"), capsys)
    assert error == (
        f"error (OutputWriteError): cannot write {folder}: it is a folder, where a file is expected; give a file's path"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["converted", "released.pth"]  # no partial file
    assert [path.name for path in folder.iterdir()] == ["kept"]


def test_convert_keeps_an_existing_output_unless_overwrite(official, tmp_path, capsys):
    output = tmp_path / "ours.ckpt"
    output.write_bytes(b"an earlier conversion")
    error = refusal(convert_config(official, output), capsys)
    assert f"convert.output: {output} exists already" in error and "convert.overwrite=true" in error
    assert output.read_bytes() == b"an earlier conversion"
    run_task(convert_config(official, output, "convert.overwrite=true"))
    released = torch.load(official, weights_only=True)
    assert sorted(f"module.{key}" for key in load_backbone(output).state_dict()) == sorted(released)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """Our backbone file of the tiny backbone."""
    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    save_backbone(path, hydra.utils.instantiate(config().backbone))
    return path


def write_frames(folder: Path, names: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = [folder / name for name in names]
    for path in paths:
        cv2.imwrite(str(path), rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
    return paths


def infer_config(source, output_dir: Path, checkpoint: Path, *overrides: str):
    return config(
        "task=infer",
        f"infer.input={source}",
        f"infer.output_dir={output_dir}",
        f"infer.checkpoint={checkpoint}",
        "infer.iters=1",
        "infer.device=cpu",
        *overrides,
    )


def test_infer_keeps_earlier_outputs_unless_overwrite(tmp_path, checkpoint, capsys):
    frames, out = tmp_path / "frames", tmp_path / "out"
    write_frames(frames, ["a.png", "b.png", "c.png"])
    run_task(infer_config(frames, out, checkpoint))
    earlier = contents(out)
    assert sorted(earlier) == ["a.flo", "a_flow.png", "b.flo", "b_flow.png", "flow.mp4"]
    error = refusal(infer_config(frames, out, checkpoint), capsys)
    assert "infer.output_dir: 5 of its files exist already" in error and "infer.overwrite=true" in error
    assert contents(out) == earlier
    run_task(infer_config(frames, out, checkpoint, "infer.overwrite=true"))
    assert sorted(contents(out)) == sorted(earlier)


def test_infer_refuses_the_input_folder_as_output_dir_even_with_overwrite(tmp_path, checkpoint, capsys):
    frames = tmp_path / "frames"
    write_frames(frames, ["a.png", "b.png"])
    before = contents(frames)
    error = refusal(infer_config(frames, frames, checkpoint, "infer.overwrite=true"), capsys)
    assert f"infer.output_dir {frames} is the input folder" in error
    assert contents(frames) == before  # no a_flow.png a later run would read as a frame


def test_infer_never_replaces_an_input_frame(tmp_path, checkpoint, capsys):
    first, second = write_frames(tmp_path / "pair", ["a.png", "b.png"])
    before = contents(tmp_path / "pair")
    overrides = ("infer.format=kitti", "infer.overwrite=true")  # KITTI flow of pair a -> b is a.png
    error = refusal(infer_config(f"[{first},{second}]", tmp_path / "pair", checkpoint, *overrides), capsys)
    assert f"the output {first} would replace that input" in error
    assert contents(tmp_path / "pair") == before


def test_infer_gives_frames_with_dots_in_their_names_their_own_flow_files(tmp_path, checkpoint):
    frames, out = tmp_path / "frames", tmp_path / "out"
    write_frames(frames, ["clip.0001.png", "clip.0002.png", "clip.0003.png"])
    run_task(infer_config(frames, out, checkpoint, "infer.save_png=false", "infer.save_video=false"))
    assert sorted(contents(out)) == ["clip.0001.flo", "clip.0002.flo"]


def test_a_second_infer_run_into_a_folder_being_written_is_refused(tmp_path, checkpoint):
    """Two `task=infer` runs given one infer.output_dir: while the first writes there (stopped with SIGSTOP
    after its first flow file), the second is refused in one line, also with infer.overwrite=true. Killed with
    SIGKILL, the first holds nothing: the next run writes there."""
    frames, out = tmp_path / "frames", tmp_path / "out"
    write_frames(frames, [f"{i:02d}.png" for i in range(20)])

    def infer(run: str) -> list[str]:
        return [
            "task=infer",
            "backbone=tiny",
            f"infer.input={frames}",
            f"infer.output_dir={out}",
            f"infer.checkpoint={checkpoint}",
            "infer.iters=1",
            "infer.save_video=false",
            "infer.overwrite=true",
            f"hydra.run.dir={tmp_path / run}",
        ]

    first = start_run_py(*infer("first"))
    while not (out / "00.flo").exists():
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)
    second = run_py(*infer("second"), expect_ok=False, timeout=600)
    first.kill()
    first.communicate()
    assert second.returncode == 1, second.stderr[-2000:]
    (error,) = error_lines(second.stderr)
    assert f"infer.output_dir {out} is being written by another task=infer run (host" in error
    assert f"pid {first.pid}" in error

    run_py(*infer("third"), timeout=600)
    assert sorted(path.name for path in out.glob("*.flo")) == [f"{i:02d}.flo" for i in range(19)]
    assert not (out / ".infer_claim").exists()


def eval_config(tmp_path: Path, *overrides: str):
    return config(
        "task=eval",
        "eval=synthetic",
        "eval.max_samples=1",
        "eval.benchmarks.synthetic.iters=1",
        f"paths.output_dir={tmp_path / 'out'}",
        *overrides,
    )


def test_eval_keeps_an_existing_results_json_unless_overwrite(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text("an earlier evaluation")
    error = refusal(eval_config(tmp_path, f"eval.results_json={results}"), capsys)
    assert f"eval.results_json: {results} exists already" in error and "eval.overwrite=true" in error
    assert results.read_text() == "an earlier evaluation"
    run_task(eval_config(tmp_path, f"eval.results_json={results}", "eval.overwrite=true"))
    assert "synthetic" in json.loads(results.read_text())["results"]


def test_eval_never_writes_its_checkpoint_even_with_overwrite(tmp_path, checkpoint, capsys):
    before = checkpoint.read_bytes()
    overrides = (f"eval.checkpoint={checkpoint}", f"eval.results_json={checkpoint}", "eval.overwrite=true")
    error = refusal(eval_config(tmp_path, *overrides), capsys)
    assert f"eval.results_json {checkpoint} is eval.checkpoint" in error
    assert checkpoint.read_bytes() == before


def test_eval_refuses_a_folder_as_its_results_file_before_any_work(tmp_path, checkpoint, capsys):
    """With eval.overwrite=true, `eval.results_json=<a folder>` evaluated every set, then failed to write
    ("cannot write <folder> (Is a directory) ... Free disk space or choose another location")."""
    folder = tmp_path / "results"
    folder.mkdir()
    overrides = (f"eval.checkpoint={checkpoint}", f"eval.results_json={folder}", "eval.overwrite=true")
    error = refusal(eval_config(tmp_path, *overrides), capsys)
    assert error == (
        f"error (OutputPathError): eval.results_json={folder} is a folder: give the results file's path, e.g. "
        f"eval.results_json={folder / 'eval_results.json'}"
    )


def test_eval_keeps_an_earlier_submission_unless_overwrite(tmp_path, capsys):
    data = tmp_path / "data"
    write_frames(data / "Sintel" / "test" / "clean" / "alley_9", ["frame_0001.png", "frame_0002.png"])
    submission = tmp_path / "submission"
    earlier = submission / "sintel" / "clean" / "alley_9" / "frame0001.flo"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"an earlier submission")
    overrides = (
        "eval.sets=[sintel_test_clean]",
        "eval.benchmarks.sintel_test_clean.iters=1",
        f"paths.data_dir={data}",
        f"eval.submission_dir={submission}",
    )
    error = refusal(eval_config(tmp_path, *overrides), capsys)
    assert f"eval.submission_dir: {earlier} exists already" in error and "eval.overwrite=true" in error
    assert earlier.read_bytes() == b"an earlier submission"
    run_task(eval_config(tmp_path, *overrides, "eval.overwrite=true"))
    assert read_flo(earlier).shape == (40, 48, 2)

"""Pretraining pair datasets: YouTube-VOS all-frames pairing, video files and frame folders, skip loop."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import pytest

from flowformer.data.datasets import DatasetRootError
from flowformer.data.io import FlowFileError
from flowformer.data.transforms import ImagePairAugmentor
from flowformer.data.video_datasets import VideoFolder, YouTubeVOS, pair_indices, stated_frame_count

from helpers.trees import FRAME_H as H
from helpers.trees import FRAME_W as W
from helpers.trees import frames_folder, video_frame, video_without_duration


def test_pair_indices_official_youtube_rule() -> None:
    # n = 14 frames: i = 9, 12 (i < n - 1 = 13) -> (0, 9), (9, 0), (3, 12), (12, 3)
    assert pair_indices(14, frame_gap=9, stride=3, both_directions=True, end=13) == [
        (0, 9),
        (9, 0),
        (3, 12),
        (12, 3),
    ]
    assert pair_indices(4, frame_gap=2, stride=1, both_directions=False) == [(0, 2), (1, 3)]
    with pytest.raises(ValueError, match="frame_gap"):
        pair_indices(4, frame_gap=0, stride=1, both_directions=False)


@pytest.mark.parametrize("dataset", [VideoFolder, YouTubeVOS])
@pytest.mark.parametrize(("spacing", "message"), [({"frame_gap": 0}, "data.train.frame_gap=0"), ({"stride": -1}, "data.train.stride=-1")])
def test_a_pair_spacing_below_one_names_its_setting_before_the_root_is_read(tmp_path, dataset, spacing, message):
    """It was "frame_gap and stride must be >= 1", and only where a video long enough for a pair was found: a
    root without one reported the root instead."""
    with pytest.raises(ValueError, match=f"^{message}: expected a whole number >= 1$"):
        dataset(root=tmp_path / "nothing here", **spacing)


def test_youtube_vos_tree(tmp_path: Path) -> None:
    root = tmp_path / "youtube-vos"
    frames_folder(root / "train_all_frames/JPEGImages/vid_b", 14)
    frames_folder(root / "train_all_frames/JPEGImages/vid_a", 10)  # 9 < n - 1 = 9 fails: no pair
    frames_folder(root / "valid_all_frames/JPEGImages/vid_c", 11)
    dataset = YouTubeVOS(root=root, splits=["train_all_frames", "valid_all_frames"])
    assert len(dataset) == 4 + 2
    item = dataset[1]  # vid_b, (9, 0)
    assert set(item) == {"img1", "img2", "meta"} and item["img1"].shape == (3, H, W)
    assert abs(float(item["img1"][0, 0, 0]) - 90) <= 3 and abs(float(item["img2"][0, 0, 0])) <= 3
    assert item["meta"]["video"] == "train_all_frames/vid_b" and item["meta"]["frame1"] == "00009"
    with pytest.raises(DatasetRootError, match="test_all_frames") as err:
        YouTubeVOS(root=root)  # the default lists all three splits
    assert "data=synthetic_video" in str(err.value) and "JPEGImages/<video>/00000.jpg" in str(err.value)


def test_a_frame_folder_numbered_without_zeros_pairs_its_frames_in_time_order(tmp_path: Path) -> None:
    """Frames `1.png` ... `12.png` (ffmpeg's `%d.png`): each pair is two neighbours in time, 9 -> 10 among them;
    a plain sort by name would pair 1 -> 10, 10 -> 11, 11 -> 12, 12 -> 2."""
    root = tmp_path / "videos"
    root.mkdir()
    for number in range(1, 13):
        assert cv2.imwrite(str(root / f"{number}.png"), video_frame(10 * number)[..., ::-1])
    dataset = VideoFolder(root=root, frame_gap=1, both_directions=False)
    pairs = [(item["meta"]["frame1"], item["meta"]["frame2"]) for item in (dataset[i] for i in range(len(dataset)))]
    assert pairs == [(str(number), str(number + 1)) for number in range(1, 12)]
    assert float(dataset[8]["img1"][0, 0, 0]) == 90.0 and float(dataset[8]["img2"][0, 0, 0]) == 100.0


def test_a_folder_of_tiff_frames_is_a_video_as_for_task_infer(tmp_path: Path) -> None:
    """Frames saved as TIFF (`.tif`, `.tiff`, as microscopes and image tools write them) are a video's frames, as
    `task=infer` reads such a folder: one list of image suffixes (IMAGE_SUFFIXES) for both."""
    root = tmp_path / "videos"
    frames_folder(root / "scene", 3, suffix=".tif")
    frames_folder(root / "other", 2, suffix=".tiff")
    dataset = VideoFolder(root=root, frame_gap=1, both_directions=False)
    pairs = {(pair.video, pair.frame1.path.name, pair.frame2.path.name) for pair in dataset.pairs}
    assert pairs == {
        ("scene", "00000.tif", "00001.tif"),
        ("scene", "00001.tif", "00002.tif"),
        ("other", "00000.tiff", "00001.tiff"),
    }
    item = dataset[[pair.frame1.path.name for pair in dataset.pairs].index("00001.tif")]
    assert float(item["img1"][0, 0, 0]) == 10.0 and float(item["img2"][0, 0, 0]) == 20.0


def test_a_video_stating_no_frame_count_is_skipped_with_what_to_do(tmp_path: Path, caplog) -> None:
    """A Matroska file without a duration (a browser's WebM recording): OpenCV states no frame count and a seek
    reads frame 0 again, so its pairs would be a frame and itself; it is skipped with a warning saying why and
    how to remux it, and the frame folder beside it is used."""
    root = tmp_path / "videos"
    frames_folder(root / "scene", 3, suffix=".png")
    video = video_without_duration(root / "recording.mkv", 6)
    capture = cv2.VideoCapture(str(video))
    assert capture.isOpened() and stated_frame_count(capture) is None
    capture.set(cv2.CAP_PROP_POS_FRAMES, 3)
    assert capture.read()[1][0, 0, 2] < 8  # frame 0 (red 0), not frame 3 (red 90): no seeking in it
    capture.release()
    with caplog.at_level(logging.WARNING):
        dataset = VideoFolder(root=root, frame_gap=1, both_directions=False)
    assert {pair.video for pair in dataset.pairs} == {"scene"}
    assert "1 video file(s) whose container states no frame count" in caplog.text
    assert "recording.mkv; remux each (ffmpeg -i <file> -c copy <new file>)" in caplog.text


def test_video_folder_videos_and_frame_folders(tmp_path: Path) -> None:
    root = tmp_path / "videos"
    frames_folder(root / "scene" / "frames", 4, suffix=".png")
    writer = cv2.VideoWriter(str(root / "clip.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10, (W, H))
    assert writer.isOpened()
    for j in range(5):
        writer.write(video_frame(40 * j)[..., ::-1].copy())
    writer.release()

    dataset = VideoFolder(root=root, frame_gap=2, stride=1, both_directions=False)
    videos = [pair.video for pair in dataset.pairs]
    assert videos.count("clip.avi") == 3 and videos.count("scene/frames") == 2
    video_item = dataset[videos.index("clip.avi") + 1]  # frames (1, 3)
    assert (
        abs(float(video_item["img1"][0, 20, 20]) - 40) < 8
        and abs(float(video_item["img2"][0, 20, 20]) - 120) < 8
    )
    assert video_item["meta"]["frame1"] == "1" and video_item["meta"]["frame2"] == "3"
    folder_item = dataset[videos.index("scene/frames")]
    assert float(folder_item["img2"][0, 0, 0]) == 20.0

    augmented = VideoFolder(root=root, frame_gap=1, augmentor=ImagePairAugmentor(crop_size=(32, 40)))
    assert augmented[0]["img1"].shape == (3, 32, 40)
    with pytest.raises(DatasetRootError, match="data=synthetic_video"):
        VideoFolder(root=tmp_path / "missing")


def test_videos_smaller_than_the_crop_are_skipped_when_listed_and_none_larger_is_one_line(
    tmp_path: Path, caplog
) -> None:
    """A folder of videos smaller than the MCVA crop (368x496 by default) trained until 100 pairs in a row had
    failed, then stopped naming a file; they are now skipped as the folder is listed, naming the crop's
    setting, and a folder with none as large is refused before training."""
    root = tmp_path / "videos"
    frames_folder(root / "scene", 4, suffix=".png")  # 40x48 frames
    writer = cv2.VideoWriter(str(root / "large.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10, (80, 60))
    for j in range(4):
        writer.write(cv2.resize(video_frame(40 * j), (80, 60)))
    writer.release()
    with caplog.at_level(logging.WARNING):
        dataset = VideoFolder(root=root, frame_gap=1, augmentor=ImagePairAugmentor(crop_size=(48, 64)))
    assert {pair.video for pair in dataset.pairs} == {"large.avi"}
    skipped = "skipped 1 video(s) whose frames are smaller than the crop 48x64 (data.train.augmentor.crop_size)"
    assert f"{skipped}: scene/ (40x48)" in caplog.text
    assert dataset[0]["img1"].shape == (3, 48, 64)
    with pytest.raises(DatasetRootError) as refusal:
        VideoFolder(root=root, frame_gap=1, augmentor=ImagePairAugmentor(crop_size=(368, 496)))
    assert (
        "found no video of more than 1 frames at least as large as the crop 368x496: 2 smaller; lower "
        "data.train.augmentor.crop_size or add larger videos"
    ) in str(refusal.value)


def test_unreadable_pairs_are_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "frames"
    frames_folder(root, 3)
    (root / "00000.jpg").write_bytes(b"not a jpeg")
    dataset = VideoFolder(root=root, frame_gap=1, both_directions=False, max_skips=3)
    with caplog.at_level(logging.WARNING):
        item = dataset[0]  # (0, 1) is unreadable -> (1, 2)
    assert item["meta"]["frame1"] == "00001" and "skipping pair 0" in caplog.text
    (root / "00002.jpg").write_bytes(b"broken too")
    with pytest.raises(FlowFileError, match=r"\.jpg: .*consecutive pairs"):
        dataset[0]

"""Supervised flow datasets in their official layouts (the readers of the official ``core/datasets.py``) and
the sintel stage mix.

Every item follows the data contract: ``img1``, ``img2`` float32 [3, H, W] in 0..255, ``flow`` float32
[2, H, W], ``valid`` float32 [H, W] (1 = valid) and ``meta`` (strings and ints: ``dataset``, ``name`` and the
dataset's own keys). Test splits (no ground truth) yield ``img1``, ``img2`` and ``meta`` only.

Dense datasets (Chairs, Things, Sintel) mark ``valid = |u| < 1000 & |v| < 1000``; sparse ones (KITTI, HD1K)
take ``valid`` from the third channel of the 16-bit PNG. Each class documents its expected tree; a missing or
malformed root raises :class:`DatasetRootError`, which names the path, draws that tree and points to
``data/README.md`` and to the zero-download ``data=synthetic``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch
from torch.utils.data import Dataset

from flowformer.data.io import FlowFileError, read_flow, read_image, read_kitti_flow
from flowformer.data.sampling import SampleKey, item_index, unpack_item
from flowformer.data.transforms import FlowAugmentor, SparseFlowAugmentor, WorkerRNG

__all__ = [
    "HD1K",
    "KITTI",
    "DatasetRootError",
    "FlowDataset",
    "FlyingChairs",
    "FlyingThings3D",
    "MpiSintel",
    "WeightedConcatDataset",
    "expected_tree",
    "to_chw",
]

PathLike = str | os.PathLike

log = logging.getLogger(__name__)


def expected_tree(cls: type) -> str:
    """The indented block after the line ending in ``tree::`` in ``cls``'s docstring."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.rstrip().endswith("tree::")), None)
    if start is None:
        return "(see data/README.md)"
    block: list[str] = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip("\n")


class DatasetRootError(FileNotFoundError):
    """A dataset root is missing or does not hold the expected tree; the message says what to do."""

    def __init__(self, dataset: type, root: PathLike, problem: str, *, alternative: str) -> None:
        self.root = str(root)
        message = (
            f"{dataset.__name__}: {problem}\n"
            f"  root: {Path(root).absolute()}\n"
            f"  expected tree under the root:\n{_indent(expected_tree(dataset), '    ')}\n"
            "  Set the root in the data config (e.g. `paths.data_dir=/path/to/datasets`, or the dataset's "
            "`root` key); data/README.md says where to download each dataset. "
            f"To run without any download, use `{alternative}`."
        )
        super().__init__(message)

    def __repr__(self) -> str:
        # Hydra reports a failed `_target_` with repr(error): keep the tree readable there too.
        return f"{type(self).__name__}: {self}"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def to_chw(image: np.ndarray) -> torch.Tensor:
    """uint8/float [H, W, C] -> float32 tensor [C, H, W]."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()


class FlowSample(NamedTuple):
    img1: Path
    img2: Path
    flow: Path | None  # None for test splits
    meta: dict[str, str | int]


class FlowDataset(Dataset):
    """Base class: a list of :class:`FlowSample` read on demand, with optional augmentation.

    Subclasses fill ``self.samples`` in their constructor. ``augmentor`` must be a
    :class:`~flowformer.data.transforms.SparseFlowAugmentor` for sparse datasets and a
    :class:`~flowformer.data.transforms.FlowAugmentor` for dense ones. Items are indices or training draws
    (:class:`~flowformer.data.sampling.SampleKey`): a draw carries its augmentation seed, a plain index
    augments from a numpy Generator per DataLoader worker (:class:`~flowformer.data.transforms.WorkerRNG`).
    """

    sparse: bool = False
    alternative = "data=synthetic"

    def __init__(
        self, *, root: PathLike, augmentor: FlowAugmentor | SparseFlowAugmentor | None = None
    ) -> None:
        self.root = Path(root)
        expected = SparseFlowAugmentor if self.sparse else FlowAugmentor
        if augmentor is not None and not isinstance(augmentor, expected):
            raise TypeError(
                f"{type(self).__name__}: augmentor must be a {expected.__name__} "
                f"({'sparse' if self.sparse else 'dense'} ground truth), got {type(augmentor).__name__}"
            )
        self.augmentor = augmentor
        self.samples: list[FlowSample] = []
        self._rng = WorkerRNG()

    def _fail(self, problem: str) -> NoReturn:
        raise DatasetRootError(type(self), self.root, problem, alternative=self.alternative)

    def _require_dir(self, path: Path) -> Path:
        if not path.is_dir():
            what = "the dataset root does not exist" if path == self.root else f"missing folder '{path}'"
            self._fail(what)
        return path

    def _require_samples(self) -> None:
        if not self.samples:
            self._fail("found no image pairs (empty or wrongly laid out folder?)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int | SampleKey) -> dict[str, Any]:
        index, rng = unpack_item(item, self._rng)
        sample = self.samples[index]
        img1, img2 = read_image(sample.img1), read_image(sample.img2)
        if img1.shape != img2.shape:
            raise FlowFileError(sample.img2, f"image size {img2.shape[:2]} differs from {sample.img1}")
        meta = dict(sample.meta)
        if sample.flow is None:
            return {"img1": to_chw(img1), "img2": to_chw(img2), "meta": meta}

        if self.sparse:
            flow, valid = read_kitti_flow(sample.flow)
        else:
            flow, valid = read_flow(sample.flow)
        if flow.shape[:2] != img1.shape[:2]:
            raise FlowFileError(
                sample.flow, f"flow size {flow.shape[:2]} differs from the image {sample.img1}"
            )
        if self.augmentor is not None:
            if isinstance(self.augmentor, SparseFlowAugmentor):
                img1, img2, flow, valid = self.augmentor(img1, img2, flow, valid, rng)
            else:
                img1, img2, flow = self.augmentor(img1, img2, flow, rng)
        if valid is None:  # dense ground truth: |u| or |v| >= 1000 marks invalid pixels, as the official reader
            valid = (np.abs(flow[..., 0]) < 1000) & (np.abs(flow[..., 1]) < 1000)
        return {
            "img1": to_chw(img1),
            "img2": to_chw(img2),
            "flow": to_chw(flow),
            "valid": torch.from_numpy(np.ascontiguousarray(valid, dtype=np.float32)),
            "meta": meta,
        }


def _sorted_files(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern))


_CHAIRS_SPLIT_NAMES = ("FlyingChairs_train_val.txt", "chairs_split.txt")


class FlyingChairs(FlowDataset):
    """FlyingChairs (22,872 pairs; 22,232 training / 640 validation by the split file).

    Expected tree::

        FlyingChairs_release/
            data/                       <- root
                00001_img1.ppm
                00001_img2.ppm
                00001_flow.flo
                ...
            FlyingChairs_train_val.txt  <- the split file, one line per pair: 1 = training, 2 = validation
                                           (or chairs_split.txt; either name, here or in data/)

    Pairs are (images[2i], images[2i+1]) with flows[i] over the sorted ``*.ppm`` and ``*.flo`` lists
    (official ``FlyingChairs``). The split file is read under its published name
    ``FlyingChairs_train_val.txt`` or the official code's ``chairs_split.txt`` (the same content), in the root
    or one level up; when both are present ``FlyingChairs_train_val.txt`` is read, and the log says so.
    ``split_file`` names another file. ``split`` is ``training`` or ``validation`` (the official default
    'train' matched neither and gave an empty set; docs/departures.md).
    """

    def __init__(
        self,
        *,
        root: PathLike,
        split: str = "training",
        split_file: PathLike | None = None,
        augmentor: FlowAugmentor | None = None,
    ) -> None:
        super().__init__(root=root, augmentor=augmentor)
        split_ids = {"training": 1, "validation": 2}
        if split not in split_ids:
            raise ValueError(f"FlyingChairs: split must be 'training' or 'validation', got {split!r}")
        self._require_dir(self.root)
        images = _sorted_files(self.root, "*.ppm")
        flows = _sorted_files(self.root, "*.flo")
        if not flows:
            self._fail("found no *_flow.flo files")
        if len(images) != 2 * len(flows):
            self._fail(f"found {len(images)} .ppm images for {len(flows)} .flo flows; expected two per flow")
        split_list = self._read_split(split_file, len(flows))
        for i, flow in enumerate(flows):
            if split_list[i] == split_ids[split]:
                name = flow.name.split("_")[0]
                meta = {"dataset": "chairs", "name": name}
                self.samples.append(FlowSample(images[2 * i], images[2 * i + 1], flow, meta))

    def _find_split_file(self) -> Path:
        """The first split file present: ``FlyingChairs_train_val.txt`` before ``chairs_split.txt``, each
        looked for in the root, then one level up."""
        folders = (self.root, self.root.parent)
        candidates = [folder / name for name in _CHAIRS_SPLIT_NAMES for folder in folders]
        found = [path for path in candidates if path.is_file()]
        if not found:
            self._fail(
                f"missing the split file: put {_CHAIRS_SPLIT_NAMES[0]} (from the FlyingChairs download page) "
                f"or {_CHAIRS_SPLIT_NAMES[1]} (the same file, as the official code names it) in "
                f"'{folders[1]}' or '{folders[0]}', or name it with the dataset's `split_file` key"
            )
        if len(found) > 1:
            also = ", ".join(str(path) for path in found[1:])
            log.info("FlyingChairs: reading the split file %s (also present, not read: %s)", found[0], also)
        return found[0]

    def _read_split(self, split_file: PathLike | None, num_pairs: int) -> np.ndarray:
        path = Path(split_file) if split_file else self._find_split_file()
        if not path.is_file():
            self._fail(
                f"`split_file` names '{path}', which does not exist; point it at {_CHAIRS_SPLIT_NAMES[0]} "
                "or leave it unset to look in the root and one level up"
            )
        try:
            split_list = np.loadtxt(path, dtype=np.int64).reshape(-1)
        except ValueError as err:
            raise FlowFileError(path, f"expected one integer (1 or 2) per line ({err})") from None
        if len(split_list) != num_pairs:
            raise FlowFileError(path, f"has {len(split_list)} entries but the root holds {num_pairs} pairs")
        return split_list


_THINGS_PASS_DIRS = {"clean": "frames_cleanpass", "final": "frames_finalpass"}
_THINGS_DIRECTIONS = ("into_future", "into_past")
_THINGS_CAMERAS = {"left": ("left",), "right": ("right",), "both": ("left", "right")}


class FlyingThings3D(FlowDataset):
    """FlyingThings3D (the full release, not the DispNet/FlowNet2.0 subset), both directions, left camera
    by default.

    Expected tree::

        FlyingThings3D/                              <- root
            frames_cleanpass/TRAIN/{A,B,C}/0000/left/0006.png ...
            frames_cleanpass/TRAIN/{A,B,C}/0000/right/0006.png ...     (read with camera right or both)
            frames_finalpass/TRAIN/{A,B,C}/0000/left/0006.png ...
            optical_flow/TRAIN/{A,B,C}/0000/into_future/left/OpticalFlowIntoFuture_0006_L.pfm ...
            optical_flow/TRAIN/{A,B,C}/0000/into_past/left/OpticalFlowIntoPast_0006_L.pfm ...
            optical_flow/TRAIN/{A,B,C}/0000/into_future/right/OpticalFlowIntoFuture_0006_R.pfm ...
            (TEST/ alike, for split='test')

    Official pairing (``FlyingThings3D`` in ``core/datasets.py``), per sequence with sorted images and flows,
    i = 0 .. len(flows)-2:
    ``into_future`` -> (img[i], img[i+1]) with flow[i]; ``into_past`` -> (img[i+1], img[i]) with flow[i+1].
    The official code has **no exclusion list and no subset filtering** (nothing like the "unused frames"
    list of other codebases): every TRAIN sequence is used, and so is every sequence here. Sequences are
    matched by name (the official code zips two sorted lists: the same on a complete tree; docs/departures.md).
    ``passes`` lists ``clean`` and/or ``final`` (the things stage uses both, the sintel mix clean only).
    ``camera`` is ``left`` (the official reader's only camera), ``right`` or ``both``; each camera's images
    pair with the flows of its own folder. Samples are ordered by pass, camera (left, then right), direction,
    then sequence: the order of torchvision's ``FlyingThings3D``.
    """

    def __init__(
        self,
        *,
        root: PathLike,
        passes: Sequence[str] = ("clean",),
        split: str = "training",
        camera: str = "left",
        directions: Sequence[str] = _THINGS_DIRECTIONS,
        augmentor: FlowAugmentor | None = None,
    ) -> None:
        super().__init__(root=root, augmentor=augmentor)
        _check_choices("FlyingThings3D", "passes", passes, _THINGS_PASS_DIRS)
        _check_choices("FlyingThings3D", "directions", directions, _THINGS_DIRECTIONS)
        if camera not in _THINGS_CAMERAS:
            raise ValueError(
                f"FlyingThings3D: camera must be 'left', 'right' or 'both', got {camera!r} (the dataset's "
                "`camera` key, e.g. data.train.camera in conf/data/things.yaml)"
            )
        if split not in ("training", "test"):
            raise ValueError(f"FlyingThings3D: split must be 'training' or 'test', got {split!r}")
        split_dir = "TRAIN" if split == "training" else "TEST"
        self._require_dir(self.root)
        flow_root = self._require_dir(self.root / "optical_flow" / split_dir)
        for pass_name in passes:
            image_root = self._require_dir(self.root / _THINGS_PASS_DIRS[pass_name] / split_dir)
            for view, direction in itertools.product(_THINGS_CAMERAS[camera], directions):
                for seq_dir in sorted(p for p in image_root.glob("*/*") if p.is_dir()):
                    scene = f"{seq_dir.parent.name}/{seq_dir.name}"
                    meta = {
                        "dataset": "things",
                        "pass": pass_name,
                        "camera": view,
                        "direction": direction,
                        "scene": scene,
                    }
                    flow_dir = flow_root / scene / direction / view
                    self._add_sequence(seq_dir / view, flow_dir, f"{split_dir}/{scene}", meta)
        self._require_samples()

    def _add_sequence(self, image_dir: Path, flow_dir: Path, sequence: str, meta: dict[str, str]) -> None:
        """The pairs of one sequence (``TRAIN/A/0000``), camera and direction (official pairing, above)."""
        images = _sorted_files(image_dir, "*.png")
        flows = _sorted_files(flow_dir, "*.pfm")
        if len(flows) != len(images):
            self._fail(
                f"sequence {sequence}: {len(images)} {meta['camera']} images in {image_dir} but "
                f"{len(flows)} {meta['direction']} flows in {flow_dir}"
            )
        for i in range(len(flows) - 1):
            pair = (images[i], images[i + 1], flows[i])
            if meta["direction"] == "into_past":
                pair = (images[i + 1], images[i], flows[i + 1])
            name = f"{meta['pass']}/{sequence}/{meta['direction']}/{meta['camera']}/{pair[0].stem}"
            self.samples.append(FlowSample(*pair, {**meta, "name": name, "frame": i}))


class MpiSintel(FlowDataset):
    """MPI-Sintel, clean and/or final pass, training (with flow) or test (images only).

    Expected tree::

        Sintel/                                   <- root
            training/clean/<scene>/frame_0001.png ...
            training/final/<scene>/frame_0001.png ...
            training/flow/<scene>/frame_0001.flo ...   (one fewer than the frames)
            test/clean/<scene>/frame_0001.png ...
            test/final/<scene>/frame_0001.png ...

    Pairs are consecutive frames of a scene; flow[i] belongs to (frame[i], frame[i+1]). Scenes are sorted
    (the official ``os.listdir`` order depends on the filesystem; docs/departures.md). ``meta`` carries
    ``pass``, ``scene`` and the 0-based ``frame`` (the official submission file is ``frame_{frame+1:04d}.flo``).
    """

    def __init__(
        self,
        *,
        root: PathLike,
        split: str = "training",
        passes: Sequence[str] = ("clean",),
        augmentor: FlowAugmentor | None = None,
    ) -> None:
        super().__init__(root=root, augmentor=augmentor)
        _check_choices("MpiSintel", "passes", passes, ("clean", "final"))
        if split not in ("training", "test"):
            raise ValueError(f"MpiSintel: split must be 'training' or 'test', got {split!r}")
        self._require_dir(self.root)
        for pass_name in passes:
            image_root = self._require_dir(self.root / split / pass_name)
            for scene_dir in sorted(p for p in image_root.iterdir() if p.is_dir()):
                images = _sorted_files(scene_dir, "*.png")
                flows: list[Path | None] = [None] * max(len(images) - 1, 0)
                if split == "training":
                    flow_dir = self.root / "training" / "flow" / scene_dir.name
                    flows = list(_sorted_files(flow_dir, "*.flo"))
                    if len(flows) != len(images) - 1:
                        self._fail(
                            f"scene '{scene_dir.name}': {len(images)} frames in {scene_dir} need "
                            f"{len(images) - 1} flows in {flow_dir}, found {len(flows)}"
                        )
                for i, flow in enumerate(flows):
                    meta = {
                        "dataset": "sintel",
                        "name": f"{pass_name}/{scene_dir.name}/{images[i].stem}",
                        "pass": pass_name,
                        "scene": scene_dir.name,
                        "frame": i,
                    }
                    self.samples.append(FlowSample(images[i], images[i + 1], flow, meta))
        self._require_samples()


class KITTI(FlowDataset):
    """KITTI-2015 scene flow benchmark, flow part (200 training and 200 testing pairs).

    Expected tree::

        KITTI/                                    <- root
            training/image_2/000000_10.png, 000000_11.png, ...
            training/flow_occ/000000_10.png, ...  (16-bit PNG: u, v, valid)
            testing/image_2/000000_10.png, 000000_11.png, ...

    Ground truth is ``flow_occ`` (all pixels, occluded included), read as sparse flow with its valid channel.
    ``meta`` carries ``frame_id`` (``000000_10.png``, the official submission file name).
    """

    sparse = True

    def __init__(
        self, *, root: PathLike, split: str = "training", augmentor: SparseFlowAugmentor | None = None
    ) -> None:
        super().__init__(root=root, augmentor=augmentor)
        if split not in ("training", "testing"):
            raise ValueError(f"KITTI: split must be 'training' or 'testing', got {split!r}")
        self._require_dir(self.root)
        image_dir = self._require_dir(self.root / split / "image_2")
        images1 = _sorted_files(image_dir, "*_10.png")
        images2 = _sorted_files(image_dir, "*_11.png")
        if len(images1) != len(images2):
            self._fail(f"{image_dir} holds {len(images1)} *_10.png but {len(images2)} *_11.png frames")
        flows: list[Path | None] = [None] * len(images1)
        if split == "training":
            flow_dir = self._require_dir(self.root / "training" / "flow_occ")
            flows = list(_sorted_files(flow_dir, "*_10.png"))
            if len(flows) != len(images1):
                self._fail(f"{flow_dir} holds {len(flows)} flows for {len(images1)} image pairs")
        for img1, img2, flow in zip(images1, images2, flows, strict=True):
            meta = {"dataset": "kitti", "name": img1.stem.split("_")[0], "frame_id": img1.name}
            self.samples.append(FlowSample(img1, img2, flow, meta))
        self._require_samples()


class HD1K(FlowDataset):
    """HD1K benchmark (Heidelberg), sparse ground truth; ``split`` is ``training`` or ``test`` (no flow).

    Expected tree::

        HD1k/                                              <- root
            hd1k_input/image_2/000000_0000.png, 000000_0001.png, ...
            hd1k_flow_gt/flow_occ/000000_0000.png, ...     (16-bit PNG like KITTI)
            hd1k_challenge/image_2/000000_0010.png, 000000_0011.png, ...   (split='test')

    Training files are ``<sequence>_<frame>.png``. Per sequence, pair i is (image[i], image[i+1]) with
    flow[i], for i up to len(flows)-2 (official ``HD1K``). The official loop stops at the first missing
    sequence number; here every sequence present is read (docs/departures.md). The test split pairs each
    ``hd1k_challenge/image_2/<name>10.png`` with its ``<name>11.png`` (one pair per sequence), as KITTI's test
    split; ``meta`` carries ``frame_id``, the first image's file name (``000000_0010.png``).
    """

    sparse = True
    _NAME = re.compile(r"^(\d+)_(\d+)\.png$")

    def __init__(
        self, *, root: PathLike, split: str = "training", augmentor: SparseFlowAugmentor | None = None
    ) -> None:
        super().__init__(root=root, augmentor=augmentor)
        if split not in ("training", "test"):
            raise ValueError(f"HD1K: split must be 'training' or 'test', got {split!r}")
        self._require_dir(self.root)
        if split == "test":
            self._add_challenge_pairs(self._require_dir(self.root / "hd1k_challenge" / "image_2"))
        else:
            self._add_training_pairs()
        self._require_samples()

    def _add_training_pairs(self) -> None:
        flow_dir = self._require_dir(self.root / "hd1k_flow_gt" / "flow_occ")
        image_dir = self._require_dir(self.root / "hd1k_input" / "image_2")
        flows = self._by_sequence(flow_dir)
        images = self._by_sequence(image_dir)
        for seq, seq_flows in sorted(flows.items()):
            seq_images = images.get(seq, [])
            if len(seq_images) < len(seq_flows):
                self._fail(f"sequence {seq}: {len(seq_flows)} flows but {len(seq_images)} images")
            for i in range(len(seq_flows) - 1):
                meta = {"dataset": "hd1k", "name": seq_flows[i].stem, "sequence": seq, "frame": i}
                self.samples.append(FlowSample(seq_images[i], seq_images[i + 1], seq_flows[i], meta))

    def _add_challenge_pairs(self, image_dir: Path) -> None:
        firsts = _sorted_files(image_dir, "*10.png")
        seconds = _sorted_files(image_dir, "*11.png")
        partners = [first.with_name(first.name[: -len("10.png")] + "11.png") for first in firsts]
        unpaired = [f.name for f, p in zip(firsts, partners, strict=True) if not p.is_file()]
        unpaired += [second.name for second in seconds if second not in partners]
        if unpaired:
            self._fail(
                f"{image_dir}: {', '.join(unpaired)} lack the other frame of the pair "
                "(each <name>10.png needs its <name>11.png)"
            )
        for first, second in zip(firsts, partners, strict=True):
            meta = {"dataset": "hd1k", "name": first.stem.split("_")[0], "frame_id": first.name}
            self.samples.append(FlowSample(first, second, None, meta))

    def _by_sequence(self, folder: Path) -> dict[str, list[Path]]:
        groups: dict[str, list[Path]] = {}
        for path in _sorted_files(folder, "*.png"):
            match = self._NAME.match(path.name)
            if match:
                groups.setdefault(match.group(1), []).append(path)
        return groups


def _check_choices(dataset: str, key: str, values: Sequence[str], allowed: Sequence[str]) -> None:
    if isinstance(values, str) or not values or any(v not in allowed for v in values):
        raise ValueError(
            f"{dataset}: {key} must be a non-empty list drawn from {list(allowed)}, got {values!r}"
        )


class WeightedConcatDataset(Dataset):
    """Datasets joined with integer multipliers, e.g. the official sintel stage mix (``fetch_dataloader``)::

        100 x Sintel-clean + 100 x Sintel-final + 200 x KITTI + 5 x HD1K + 1 x Things-clean

    ``parts`` is a list of ``{dataset: <Dataset>, repeat: <int>}``. Repeating a dataset n times is the same
    as the official list multiplication (``n * dataset``): index i of a part maps to ``i % len(dataset)``.
    """

    def __init__(self, *, parts: Sequence[Mapping[str, Any]]) -> None:
        self.datasets: list[Dataset] = []
        self.repeats: list[int] = []
        for i, part in enumerate(parts):
            if not isinstance(part, Mapping) or "dataset" not in part:
                raise ValueError(
                    f"WeightedConcatDataset: part {i} must be {{dataset: ..., repeat: n}}, got {part!r}"
                )
            repeat = int(part.get("repeat", 1))
            if repeat < 1:
                raise ValueError(
                    f"WeightedConcatDataset: part {i} has repeat={repeat}; expected an integer >= 1"
                )
            if len(part["dataset"]) == 0:
                raise ValueError(
                    f"WeightedConcatDataset: part {i} ({type(part['dataset']).__name__}) is empty"
                )
            self.datasets.append(part["dataset"])
            self.repeats.append(repeat)
        if not self.datasets:
            raise ValueError("WeightedConcatDataset: parts is empty")
        self._ends = np.cumsum([len(d) * r for d, r in zip(self.datasets, self.repeats, strict=True)])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, item: int | SampleKey) -> dict[str, Any]:
        """Item ``index`` of the concatenation; a ``SampleKey`` keeps its augmentation seed."""
        index = item_index(item)
        if not 0 <= index < len(self):
            raise IndexError(f"WeightedConcatDataset: index {index} out of range for {len(self)} items")
        part = int(np.searchsorted(self._ends, index, side="right"))
        start = 0 if part == 0 else int(self._ends[part - 1])
        dataset = self.datasets[part]
        local = (index - start) % len(dataset)
        return dataset[item._replace(index=local) if isinstance(item, SampleKey) else local]

    def describe(self) -> str:
        """E.g. ``100 x MpiSintel (2082) + 200 x KITTI (200) = 248200 items``."""
        terms = [
            f"{r} x {type(d).__name__} ({len(d)})" for d, r in zip(self.datasets, self.repeats, strict=True)
        ]
        return " + ".join(terms) + f" = {len(self)} items"

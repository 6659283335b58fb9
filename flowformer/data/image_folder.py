"""Training pairs and clips rendered from the photographs of any folder (FlyingChairs-style data).

The scenes are those of ``flowformer/data/synthetic.py`` (layers with affine motions, exact flow, occlusion
masks, deterministic from ``(seed, index)``); only the layers' textures differ: each layer is a crop of a
photograph instead of procedural noise (:class:`PhotoTextures`, the synthetic module's ``TextureSource``).
FlyingChairs is this kind of data (chairs over Flickr photographs).

- The photographs are the image files under ``root`` (``.jpg .png``, also ``.jpeg .ppm .bmp .tif .tiff .webp``:
  IMAGE_SUFFIXES), searched recursively, each file once however many links lead to it (a link loop is not
  followed, a warning counts what was skipped); with ``root`` null, photographs that ship inside scikit-image
  (:data:`SKIMAGE_PHOTOS`), so nothing is downloaded.
- ``split`` ``train`` or ``val``: the files are ordered by a hash of their path relative to the root and
  the first ``round(n * val_fraction)`` (at least 1, at most n - 1) are held out for ``val``. A file is in
  one split only, whatever the render size, so a validation scene never shows a training photograph.
- Images smaller than the render size are skipped, with one warning line counting them; so are files whose
  header cannot be read and images that are not 8-bit (16-bit PNG or TIFF), as task=infer refuses them. A file that fails to decode later is replaced by the next one, with a warning; files that disappear while
  the run goes on stop it at once (:class:`~flowformer.data.io.InputsGoneError`, training saves last.ckpt).
- Each layer crops a window ``zoom`` times the render size (log-uniform in ``[1, max_zoom]``, as far as the
  photograph allows), at a random place, mirrored with probability 1/2, resized to the render size.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from flowformer.data.datasets import to_chw
from flowformer.data.io import IMAGE_SUFFIXES, FlowFileError, InputsGoneError, image_header, read_image
from flowformer.data.sampling import SampleKey, unpack_item
from flowformer.data.synthetic import SyntheticFlowDataset, SyntheticVideoDataset
from flowformer.data.transforms import FlowAugmentor, ImagePairAugmentor, WorkerRNG

__all__ = [
    "SKIMAGE_PHOTOS",
    "ImageFolderError",
    "ImageFolderFlowDataset",
    "ImageFolderVideoDataset",
    "PhotoTextures",
]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike

# The real photographs bundled in the scikit-image wheel (skimage/data/, read from disk: no download), each
# with a licence statement in its skimage.data docstring: public domain, CC0 or "no known copyright
# restrictions". Left out: motorcycle_left/right (a stereo pair shipped with its disparity: evaluation data),
# moon and page (no licence statement), cell and text (nearly uniform), microaneurysms and lfw_subset (102 px
# and 25 px), and the drawings (chessboard, color, logo, phantom, horse).
SKIMAGE_PHOTOS = (
    "astronaut.png",  # NASA, public domain
    "brick.png",  # CC0 (grey)
    "camera.png",  # CC0, Lav Varshney (grey)
    "chelsea.png",  # CC0, Stefan van der Walt (300x451)
    "coffee.png",  # CC0, Rachel Michetti
    "coins.png",  # Brooklyn Museum, no known copyright restrictions (grey, 303x384)
    "grass.png",  # CC0 (grey)
    "gravel.png",  # CC0 (grey)
    "hubble_deep_field.jpg",  # NASA, public domain
    "ihc.png",  # skimage.data.immunohistochemistry, no known copyright restrictions (microscopy)
    "retina.jpg",  # CC0, Mikael Häggström
    "rocket.jpg",  # SpaceX, public domain
)
SPLITS = ("train", "val")


class ImageFolderError(FileNotFoundError):
    """The photograph folder is missing, unreadable or holds no usable image; the message is one line."""


def skimage_photo_dir() -> Path:
    """The folder of scikit-image's bundled sample images (skimage/data/ in the installed package)."""
    import skimage.data  # imported here: only the zero-download default needs it

    return Path(skimage.data.__file__).parent


def find_images(root: Path, owner: str) -> list[Path]:
    """Every image file under ``root`` (recursive, each file once: :func:`_walk_once`), sorted; one-line
    ImageFolderError when there is none."""
    if not root.exists():
        raise ImageFolderError(
            f"{owner}: the image folder {root} does not exist; set the dataset's root (data.train.root with "
            "data=image_folder)"
        )
    if not root.is_dir():
        raise ImageFolderError(f"{owner}: the image folder {root} is not a folder; set root to a folder")

    def unreadable(error: OSError) -> None:
        raise ImageFolderError(
            f"{owner}: cannot read the image folder {error.filename} ({error.strerror}); check its "
            "permissions"
        )

    found, repeated_folders, repeated_files = _walk_once(root, unreadable)
    if repeated_folders or repeated_files:
        log.warning(
            "%s: %s: skipped %d folders already visited (a symbolic-link loop or a second link to one folder) "
            "and %d files that are another path to an image already found; each image is used once",
            owner, root, repeated_folders, repeated_files,
        )
    if not found:
        raise ImageFolderError(
            f"{owner}: the image folder {root} holds no images ({' '.join(IMAGE_SUFFIXES)}, searched "
            "recursively); put photographs there, or leave root null for scikit-image's photographs"
        )
    return sorted(found)


def _walk_once(root: Path, onerror: Callable[[OSError], None]) -> tuple[list[Path], int, int]:
    """The image files under ``root``, following symbolic links but entering each folder and taking each
    file (by device and inode: links and hard links are one file) once, in sorted order, so a link loop ends
    and a photograph reached by two paths is found once -> (files, folders skipped, files skipped)."""
    folders: set[tuple[int, int]] = set()
    files: dict[tuple[int, int], Path] = {}
    broken: list[Path] = []  # links to nothing: kept, the header check counts them as not readable
    repeated_folders = repeated_files = 0
    for folder, subfolders, names in os.walk(root, onerror=onerror, followlinks=True):
        subfolders.sort()
        status = os.stat(folder)
        if (status.st_dev, status.st_ino) in folders:
            subfolders.clear()
            repeated_folders += 1
            continue
        folders.add((status.st_dev, status.st_ino))
        for name in sorted(names):
            path = Path(folder) / name
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                status = path.stat()
            except OSError:
                broken.append(path)
                continue
            if (status.st_dev, status.st_ino) in files:
                repeated_files += 1
            else:
                files[(status.st_dev, status.st_ino)] = path
    return [*files.values(), *broken], repeated_folders, repeated_files


def split_files(files: list[Path], root: Path, split: str, val_fraction: float, owner: str) -> list[Path]:
    """The files of ``split``: ordered by the SHA-1 of their path relative to ``root``, the first
    ``round(n * val_fraction)`` (at least 1, at most n - 1) are ``val``, the others ``train``."""
    if split not in SPLITS:
        raise ValueError(f"{owner}: split must be one of {SPLITS}, got {split!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"{owner}: val_fraction must be in (0, 1), got {val_fraction}")
    if len(files) < 2:
        raise ImageFolderError(
            f"{owner}: {root} holds {len(files)} image; a train and a val split need at least 2 images"
        )

    def key(path: Path) -> bytes:
        return hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()

    ordered = sorted(files, key=key)
    held_out = min(max(1, round(len(files) * val_fraction)), len(files) - 1)
    return ordered[:held_out] if split == "val" else ordered[held_out:]


class PhotoTextures:
    """Layer textures cropped from the photographs of one split: a ``TextureSource`` of the synthetic scenes.

    Args:
        root: the folder of photographs (recursive), or None for :data:`SKIMAGE_PHOTOS`.
        split, val_fraction: which files (:func:`split_files`).
        size: the render size (H, W); smaller images are skipped.
        max_zoom: the largest crop, as a multiple of the render size (1 = crops at the photograph's scale).
        cache_mb: decoded photographs kept in memory per process (least recently used dropped first).
        owner: the dataset's name, for messages.
    """

    def __init__(
        self,
        root: PathLike | None,
        *,
        split: str,
        val_fraction: float,
        size: tuple[int, int],
        max_zoom: float,
        cache_mb: float,
        owner: str,
    ) -> None:
        if max_zoom < 1:
            raise ValueError(f"{owner}: max_zoom must be >= 1 (crops >= the render size), got {max_zoom}")
        self.root = skimage_photo_dir() if root is None else Path(root)
        found = find_images(self.root, owner) if root is not None else [self.root / n for n in SKIMAGE_PHOTOS]
        self.split = split
        self.size = size
        self.max_zoom = float(max_zoom)
        self.cache_bytes = int(cache_mb * 2**20)
        self.owner = owner
        self.files = self._usable(split_files(found, self.root, split, val_fraction, owner))
        self._cache: OrderedDict[Path, np.ndarray] = OrderedDict()

    def _usable(self, files: list[Path]) -> list[Path]:
        """The 8-bit files of at least the render size (read from their headers); one warning line counts the
        others."""
        height, width = self.size
        headers = {path: image_header(path) for path in files}
        unreadable = [path for path, header in headers.items() if header is None]
        deep = [path for path, header in headers.items() if header is not None and not header[2]]
        small = [
            path
            for path, header in headers.items()
            if header is not None and header[2] and (header[0] < height or header[1] < width)
        ]
        skipped = [*small, *deep, *unreadable]
        kinds = (  # the files skipped for one reason, the reason, and what to do about it
            (small, f"smaller than the render size {height}x{width}", "lower the dataset's size or add larger images"),
            (deep, "not 8-bit (8-bit images are expected, as task=infer expects)", "convert them to 8-bit"),
            (unreadable, "not readable as images", "remove them"),
        )
        why = ", ".join(f"{len(paths)} {reason}" for paths, reason, _ in kinds if paths)
        if skipped and len(skipped) < len(files):
            names = ", ".join(path.relative_to(self.root).as_posix() for path in skipped[:5])
            log.warning(
                "%s (%s split of %s): skipped %d of %d images: %s (e.g. %s)",
                self.owner, self.split, self.root, len(skipped), len(files), why, names,
            )
        if len(skipped) == len(files):
            advice = " or ".join(act for paths, _, act in kinds if paths)
            raise ImageFolderError(
                f"{self.owner}: none of the {len(files)} images of the {self.split} split of {self.root} is "
                f"usable: {why}; {advice}"
            )
        kept = set(files).difference(skipped)
        return [path for path in files if path in kept]

    def _decoded(self, index: int) -> np.ndarray:
        """Photograph ``index`` (uint8 [h, w, 3]); one that fails to decode is replaced by the next one."""
        for attempt in range(len(self.files)):
            path = self.files[(index + attempt) % len(self.files)]
            if path in self._cache:
                self._cache.move_to_end(path)
                return self._cache[path]
            try:
                image = read_image(path)
            except FlowFileError as error:
                if not path.exists():
                    self._stop_if_gone()
                log.warning("%s: using the next image instead of %s", self.owner, error)
                continue
            self._cache[path] = image
            while len(self._cache) > 1 and sum(a.nbytes for a in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)  # the least recently used
            return image
        raise ImageFolderError(f"{self.owner}: none of the {len(self.files)} images of {self.root} decodes")

    def _stop_if_gone(self) -> None:
        """InputsGoneError when this split's photographs are missing from the folder (deleted or moved while
        the run goes on): the next one is not tried, and training stops at once, saving last.ckpt."""
        gone = [path for path in self.files if not path.exists()]
        if gone:
            raise InputsGoneError(
                f"{self.owner}: {len(gone)} of the {len(self.files)} photographs of the {self.split} split of "
                f"{self.root} disappeared during the run (e.g. {gone[0]}); put them back and resume from "
                "last.ckpt (ckpt_path=<its path>)"
            )

    def _crop(self, draw: np.ndarray, height: int, width: int) -> np.ndarray:
        """One layer's texture from its five uniform draws (image, zoom, y, x, mirror) -> uint8 [H, W, 3]."""
        image = self._decoded(min(int(draw[0] * len(self.files)), len(self.files) - 1))
        image_h, image_w = image.shape[:2]
        largest = max(1.0, min(self.max_zoom, image_h / height, image_w / width))
        zoom = largest ** draw[1]  # log-uniform in [1, largest]
        crop_h, crop_w = min(image_h, round(height * zoom)), min(image_w, round(width * zoom))
        y0, x0 = int(draw[2] * (image_h - crop_h + 1)), int(draw[3] * (image_w - crop_w + 1))
        crop = image[y0 : y0 + crop_h, x0 : x0 + crop_w]
        if draw[4] < 0.5:
            crop = crop[:, ::-1]
        if crop.shape[:2] != (height, width):  # area averaging: a zoomed-out crop is not aliased
            return cv2.resize(np.ascontiguousarray(crop), (width, height), interpolation=cv2.INTER_AREA)
        return crop

    def __call__(self, gens: list[torch.Generator], layers: int, height: int, width: int) -> torch.Tensor:
        """Textures [B, layers, 3, H, W] in 0..255, float32: each scene's crops from five draws a layer."""
        draws = [torch.rand(layers, 5, generator=gen, dtype=torch.float64).numpy() for gen in gens]
        crops = np.stack([[self._crop(draw, height, width) for draw in scene] for scene in draws])  # [B, L, H, W, 3]
        return torch.from_numpy(crops).permute(0, 1, 4, 2, 3).float()

    def describe(self) -> str:
        return f"{len(self.files)} {self.split} photographs of {self.root}"


def _to_hwc(image: torch.Tensor) -> np.ndarray:
    """A rendered frame, float32 [3, H, W] of 8-bit levels -> uint8 [H, W, 3] (exact)."""
    return image.permute(1, 2, 0).to(torch.uint8).numpy()


class _FromPhotographs:
    """The photograph settings shared by the pair and the clip datasets, taken before the scene parameters.

    Args:
        root: the folder of photographs (recursive); None: :data:`SKIMAGE_PHOTOS`.
        split: ``train`` or ``val``; val_fraction: the share of files held out for ``val``.
        max_zoom, cache_mb: see :class:`PhotoTextures`.
        augmentor: photometric and spatial augmentation of the rendered frames, or None.
        scene: the scene parameters of the synthetic dataset (``num_samples``, ``size`` = the render size,
            ``seed``, ``num_layers``, motions; clips add ``num_frames``, ``frame_gap``).
    """

    augmentor_type: type
    dataset_name = "image_folder"

    def __init__(
        self,
        *,
        root: PathLike | None = None,
        split: str = "train",
        val_fraction: float = 0.2,
        max_zoom: float = 4.0,
        cache_mb: float = 256.0,
        augmentor: FlowAugmentor | ImagePairAugmentor | None = None,
        **scene: Any,
    ) -> None:
        super().__init__(**scene)
        owner = type(self).__name__
        if augmentor is not None and not isinstance(augmentor, self.augmentor_type):
            expected = self.augmentor_type.__name__
            raise TypeError(f"{owner}: augmentor must be {expected} or null, got {type(augmentor).__name__}")
        self.textures = PhotoTextures(
            root,
            split=split,
            val_fraction=val_fraction,
            size=self.size,
            max_zoom=max_zoom,
            cache_mb=cache_mb,
            owner=owner,
        )
        self.augmentor = augmentor
        self._rng = WorkerRNG()

    def __getitems__(self, items: list[int | SampleKey]) -> list[dict[str, object]]:
        """The scenes' pairs or clips' frames (rendered together), each augmented with its item's draw."""
        samples = super().__getitems__(items)  # type: ignore[misc]  # the synthetic dataset mixed in
        if self.augmentor is None:
            return samples
        return [self._augmented(item, sample) for item, sample in zip(items, samples)]

    def describe(self) -> str:
        height, width = self.size
        scenes = f"{len(self)} scenes at {height}x{width}"
        return f"{type(self).__name__} ({scenes} over {self.textures.describe()})"


class ImageFolderFlowDataset(_FromPhotographs, SyntheticFlowDataset):
    """Image pairs with exact flow over photograph-textured layers; arguments of :class:`_FromPhotographs`.

    Without an augmentor, items are those of :class:`SyntheticFlowDataset` (``occlusion`` included). With a
    :class:`FlowAugmentor` (FlyingChairs' colour, eraser, scale, flips and crop), an item is the augmented
    crop and its ``valid`` is 1 everywhere: the flow is exact at every pixel, also where it leaves the frame,
    as FlyingChairs' is; there is no ``occlusion`` then (the augmentor transforms only the flow).
    """

    augmentor_type = FlowAugmentor

    def _augmented(self, item: int | SampleKey, sample: dict[str, object]) -> dict[str, object]:
        _, rng = unpack_item(item, self._rng)
        flow = sample["flow"].permute(1, 2, 0).numpy()  # [H, W, 2]
        img1, img2, flow = self.augmentor(_to_hwc(sample["img1"]), _to_hwc(sample["img2"]), flow, rng)
        return {
            "img1": to_chw(img1),
            "img2": to_chw(img2),
            "flow": to_chw(flow),
            "valid": torch.ones(flow.shape[:2]),
            "meta": sample["meta"],
        }


class ImageFolderVideoDataset(_FromPhotographs, SyntheticVideoDataset):
    """Clips of photograph-textured scenes for MCVA pretraining: :class:`SyntheticVideoDataset` (``clip(i)``:
    ``num_frames`` >= 3 frames of one scene; items: the pair (frame 0, frame ``frame_gap``)) with the
    arguments of :class:`_FromPhotographs`; an :class:`ImagePairAugmentor` augments the pairs."""

    augmentor_type = ImagePairAugmentor

    def _augmented(self, item: int | SampleKey, sample: dict[str, object]) -> dict[str, object]:
        _, rng = unpack_item(item, self._rng)
        img1, img2 = self.augmentor(_to_hwc(sample["img1"]), _to_hwc(sample["img2"]), rng)
        return {"img1": to_chw(img1), "img2": to_chw(img2), "meta": sample["meta"]}

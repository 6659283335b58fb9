"""Flow and image file I/O: Middlebury ``.flo``, ``.pfm``, KITTI 16-bit PNG flow and 8-bit images (turned
as their EXIF orientation says).

Formats as the official ``core/utils/frame_utils.py`` reads them. Every reader returns numpy arrays in
(H, W, C) layout; every failure (missing or unreadable file, wrong magic, truncated data, wrong size) raises
:class:`FlowFileError`, which names the file and says what was wrong. Every writer goes through
``atomic_write`` (``flowformer/models/output_files.py``): a file is whole or absent, and a failed write (disk
full) raises ``OutputWriteError`` naming it.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from flowformer.models.output_files import atomic_write

__all__ = [
    "FLO_MAGIC",
    "FlowFileError",
    "InputsGoneError",
    "exif_orientation",
    "image_header",
    "read_flo",
    "read_flow",
    "read_image",
    "read_kitti_flow",
    "read_pfm",
    "write_flo",
    "write_image",
    "write_kitti_flow",
]

# the image files read_image reads, by suffix (lower case), wherever a folder's images are listed: task=infer's
# frames, pretraining frame folders (data=video_folder) and data=image_folder's photographs
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm", ".bmp", ".tif", ".tiff", ".webp")
FLO_MAGIC = 202021.25  # the float32 tag at the start of every Middlebury .flo file
_KITTI_OFFSET = 2.0**15  # u = (R - 2^15) / 64, official readFlowKITTI
_KITTI_SCALE = 64.0

PathLike = str | os.PathLike


class FlowFileError(ValueError):
    """A flow or image file is missing, unreadable or malformed; the message names the file.

    Built as ``FlowFileError(path, problem)``. torch's DataLoader re-raises an error from a worker process as
    ``FlowFileError(text)`` with one argument, the worker's formatted traceback, whose last line is
    ``...FlowFileError: <path>: <problem>``; that line is taken back apart here so the main process sees the
    same one-line message as with ``num_workers=0`` (a path that itself contains ": " is split at its first
    ": ", so only ``.path`` and ``.problem`` may then be cut in the wrong place, never the message).
    """

    def __init__(self, path: PathLike, problem: str | None = None) -> None:
        if problem is None:
            path, problem = _split_single_message(str(path))
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class InputsGoneError(FileNotFoundError):
    """Input files a run found when it started are gone while it runs (deleted or moved): nothing more can be
    read, while the training state is whole, so training saves last.ckpt before it stops
    (``flowformer/lit/checkpointing.py``, ``LastCheckpoint``). The message is one line."""


def _split_single_message(text: str) -> tuple[str, str]:
    """'<path>: <problem>', alone or as the last line of a traceback (DataLoader worker) -> (path, problem)."""
    lines = text.rstrip().splitlines()
    last = lines[-1] if lines else ""
    _, tag, message = last.partition(f"{FlowFileError.__name__}: ")
    path, sep, problem = (message if tag else last).partition(": ")
    if not sep:
        raise TypeError(f"FlowFileError needs (path, problem), got the single message {text!r}")
    return path, problem


def _read_bytes(path: PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FlowFileError(path, "file not found; check the dataset root and the file name") from None
    except OSError as err:
        raise FlowFileError(path, f"cannot read the file ({err.strerror or err})") from None


def _check_flow_array(path: PathLike, flow: np.ndarray) -> np.ndarray:
    flow = np.asarray(flow)
    if flow.ndim != 3 or flow.shape[2] != 2:
        raise FlowFileError(path, f"expected a flow array of shape [H, W, 2], got {tuple(flow.shape)}")
    return flow


def read_flo(path: PathLike) -> np.ndarray:
    """Read a Middlebury ``.flo`` file -> float32 [H, W, 2] (u, v).

    Layout (little-endian, official ``readFlow``/``writeFlow``): float32 magic 202021.25, int32 width, int32
    height, then H*W*2 float32 values, (u, v) interleaved, row-major.
    """
    data = _read_bytes(path)
    if len(data) < 12:
        raise FlowFileError(path, f"truncated .flo header: {len(data)} bytes, expected at least 12")
    magic = np.frombuffer(data, dtype="<f4", count=1)[0]
    if magic != np.float32(FLO_MAGIC):
        raise FlowFileError(
            path, f"wrong .flo magic number {magic!r}, expected {FLO_MAGIC} (not a .flo file?)"
        )
    width, height = (int(v) for v in np.frombuffer(data, dtype="<i4", count=2, offset=4))
    if width <= 0 or height <= 0 or width > 100_000 or height > 100_000:
        raise FlowFileError(path, f"implausible .flo size width={width}, height={height}")
    expected = 12 + 4 * 2 * width * height
    if len(data) < expected:
        raise FlowFileError(
            path, f"truncated .flo data: {len(data)} bytes, expected {expected} for {width}x{height}"
        )
    if len(data) > expected:
        raise FlowFileError(
            path, f"wrong .flo size: {len(data)} bytes, expected {expected} for {width}x{height}"
        )
    flow = np.frombuffer(data, dtype="<f4", count=2 * width * height, offset=12)
    return flow.reshape(height, width, 2).astype(np.float32)


def write_flo(path: PathLike, flow: np.ndarray) -> None:
    """Write float [H, W, 2] flow as a Middlebury ``.flo`` file (parent folders are created; whole or not at
    all: ``atomic_write``)."""
    flow = _check_flow_array(path, flow)
    height, width = flow.shape[:2]
    header = np.array([FLO_MAGIC], dtype="<f4").tobytes() + np.array([width, height], dtype="<i4").tobytes()
    with atomic_write(path) as file:
        file.write(header + np.ascontiguousarray(flow, dtype="<f4").tobytes())


_PFM_HEADER = re.compile(rb"^(PF|Pf)\s+(\d+)\s+(\d+)\s+([-+0-9.eE]+)\s")


def read_pfm(path: PathLike) -> np.ndarray:
    """Read a ``.pfm`` file -> float32 [H, W, 2] for 3-channel ``PF`` files (u, v kept, the third channel
    dropped, as for FlyingThings3D flow), or [H, W] for 1-channel ``Pf`` files.

    A negative scale means little-endian data, a positive one big-endian; rows are stored bottom-to-top and
    are flipped here (the official ``readPFM`` applies ``flipud``).
    """
    data = _read_bytes(path)
    match = _PFM_HEADER.match(data)
    if match is None:
        raise FlowFileError(
            path,
            "wrong .pfm header: expected 'PF' or 'Pf', then 'width height', then a scale, each on a line",
        )
    channels = 3 if match.group(1) == b"PF" else 1
    width, height = int(match.group(2)), int(match.group(3))
    if width == 0 or height == 0:
        raise FlowFileError(path, f"empty .pfm: size {width}x{height}, expected at least 1x1")
    try:
        scale = float(match.group(4))
    except ValueError:
        raise FlowFileError(path, f"wrong .pfm scale {match.group(4)!r}: expected a number") from None
    if scale == 0:
        raise FlowFileError(path, "wrong .pfm scale 0: expected a negative (little-endian) or positive value")
    dtype = "<f4" if scale < 0 else ">f4"
    count = width * height * channels
    offset = match.end()
    available = len(data) - offset
    if available < 4 * count:
        raise FlowFileError(
            path,
            f"truncated .pfm data: {available} bytes after the header, expected {4 * count} "
            f"for {width}x{height}x{channels}",
        )
    rows_up = np.flipud(np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(height, width, channels))
    # one copy: the rows flipped, the flow's two channels kept, the bytes in this machine's float32
    return np.array(rows_up[:, :, :2] if channels == 3 else rows_up[:, :, 0], dtype=np.float32, order="C")


def read_kitti_flow(path: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read a KITTI/HD1K 16-bit PNG flow -> (flow float32 [H, W, 2], valid float32 [H, W]).

    Channels (R, G, B) = (u*64 + 2^15, v*64 + 2^15, valid) as uint16 (official
    ``readFlowKITTI``). Pillow cannot decode
    these 3-channel 16-bit PNGs; OpenCV can (it returns BGR, so the channels are reversed here).
    """
    if not Path(path).is_file():
        raise FlowFileError(path, "file not found; check the dataset root and the file name")
    # IMREAD_UNCHANGED: OpenCV's colour modes would turn a grey or RGBA PNG into 3 channels and pass the check
    raw = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if raw is None:
        raise FlowFileError(path, "cannot decode the file as a PNG image (corrupt or not an image?)")
    channels = 1 if raw.ndim == 2 else raw.shape[2]
    if raw.dtype != np.uint16 or channels != 3:
        raise FlowFileError(
            path,
            f"expected a 3-channel 16-bit KITTI flow PNG, got {channels} channel(s) of dtype {raw.dtype}; "
            "check that the path points at a flow file, not an image or a disparity map",
        )
    rgb = raw[:, :, ::-1].astype(np.float32)
    flow = (rgb[:, :, :2] - _KITTI_OFFSET) / _KITTI_SCALE
    valid = rgb[:, :, 2]
    return np.ascontiguousarray(flow), np.ascontiguousarray(valid)


def write_kitti_flow(path: PathLike, flow: np.ndarray, valid: np.ndarray | None = None) -> None:
    """Write float [H, W, 2] flow as a KITTI 16-bit PNG (whole or not at all); ``valid`` [H, W] defaults to
    all ones.

    Values are rounded to 1/64 px and clipped to the representable range (about +-512 px).
    """
    flow = _check_flow_array(path, flow)
    height, width = flow.shape[:2]
    if valid is None:
        valid = np.ones((height, width), dtype=np.float32)
    valid = np.asarray(valid)
    if valid.shape != (height, width):
        raise FlowFileError(
            path, f"valid mask shape {tuple(valid.shape)} does not match flow {(height, width)}"
        )
    encoded = np.rint(flow.astype(np.float64) * _KITTI_SCALE + _KITTI_OFFSET)
    encoded = np.clip(np.nan_to_num(encoded, nan=_KITTI_OFFSET), 0, 2**16 - 1)
    rgb = np.concatenate([encoded, (valid > 0.5)[:, :, None]], axis=2).astype(np.uint16)
    if Path(path).suffix.lower() != ".png":
        raise FlowFileError(path, "a KITTI flow file is a 16-bit PNG: name it <name>.png")
    _write_picture(path, rgb)


def write_image(path: PathLike, image: np.ndarray) -> None:
    """Write uint8 [H, W, 3] RGB in the format of the file name's extension (.png, .jpg, ...); parent folders
    are created, and the file is whole or not written."""
    _write_picture(path, image)


def _write_picture(path: PathLike, rgb: np.ndarray) -> None:
    """[H, W, 3] RGB -> an image file at `path`, encoded by its extension, through `atomic_write`."""
    suffix = Path(path).suffix
    try:
        encoded, data = cv2.imencode(suffix, np.ascontiguousarray(rgb[:, :, ::-1]))
    except cv2.error:
        encoded = False
    if not encoded:
        raise FlowFileError(
            path, f"OpenCV cannot write a {rgb.dtype} [H, W, 3] picture as {suffix!r}; use .png"
        )
    with atomic_write(path) as file:
        file.write(data.tobytes())


# EXIF orientation (tag 0x0112) -> how the stored pixels become the picture viewers show: numpy's view of the
# transform PIL.ImageOps.exif_transpose applies (5-8 swap height and width)
EXIF_ORIENTATION_TAG = 0x0112
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],  # mirrored left-right
    3: lambda a: a[::-1, ::-1],  # rotated 180
    4: lambda a: a[::-1],  # mirrored top-bottom
    5: lambda a: a.swapaxes(0, 1),  # transposed
    6: lambda a: np.rot90(a, -1),  # to be turned 90 degrees clockwise
    7: lambda a: a[::-1, ::-1].swapaxes(0, 1),  # transversed
    8: lambda a: np.rot90(a, 1),  # to be turned 90 degrees counter-clockwise
}


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image (1, as stored, when it has none or an unknown value). A PNG's
    is read from an eXIf chunk before its pixels (PIL's getexif would decode them all to look behind them)."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    orientation = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    return orientation if orientation in _ORIENT else 1


def image_header(path: Path) -> tuple[int, int, bool] | None:
    """(height, width as viewers show it, upright; 8-bit channels or not) from the file's header (nothing
    decoded); None when it is not a readable image. A 16-bit PNG or TIFF has mode I;16 (grey) or a raw mode ';16' (colour, which PIL would
    reduce to 8 bits); OpenCV, which every image read goes through, decodes it to 16 bits."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            # before getexif, which may read a PNG's pixels and drop its tiles
            raw_modes = [tile.args if isinstance(tile.args, str) else tile.args[0] for tile in image.tile]
            eight_bit = not image.mode.startswith(("I", "F")) and not any(";16" in mode for mode in raw_modes)
            if exif_orientation(image) >= 5:  # stored on its side: read_image turns it upright
                width, height = height, width
    except (OSError, ValueError, IndexError, Image.DecompressionBombError):
        return None
    return height, width, eight_bit


def _upright(encoded: bytes, image: np.ndarray) -> np.ndarray:
    """`image` decoded from `encoded` turned as its EXIF orientation says (as every viewer shows it)."""
    try:
        with Image.open(io.BytesIO(encoded)) as header:
            orientation = exif_orientation(header)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        orientation = 1  # a format PIL does not read (OpenCV did) carries no EXIF that PIL could give
    return image if orientation == 1 else np.ascontiguousarray(_ORIENT[orientation](image))


# OpenCV's conversion of a decoded image (grey, BGR or BGRA) to RGB: the same bytes as numpy's copy of the
# channels reversed or repeated, about 20x faster (0.14 against 2.7 ms at 540x960)
_TO_RGB = {1: cv2.COLOR_GRAY2RGB, 3: cv2.COLOR_BGR2RGB, 4: cv2.COLOR_BGRA2RGB}


def read_image(path: PathLike) -> np.ndarray:
    """Read an 8-bit image -> uint8 [H, W, 3] RGB, turned as its EXIF orientation says (as viewers show it).
    Grey images become 3 channels, RGBA drops alpha."""
    if not Path(path).is_file():
        raise FlowFileError(path, "file not found; check the dataset root and the file name")
    encoded = Path(path).read_bytes()  # read once: decoded and checked for truncation from the same bytes
    try:
        raw = cv2.imdecode(np.frombuffer(encoded, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error as err:  # e.g. a header claiming more pixels than OpenCV decodes
        raise FlowFileError(path, f"cannot decode the file as an image (OpenCV: {err.err})") from None
    if _truncated_jpeg(encoded):  # imread would fill the missing part with grey
        raise FlowFileError(path, "truncated JPEG: no end-of-image marker after its last scan; re-download or re-export it")
    if raw is None:
        raise FlowFileError(path, "cannot decode the file as an image (corrupt or unsupported format?)")
    if raw.dtype != np.uint8:
        raise FlowFileError(
            path,
            f"expected an 8-bit image, got {raw.dtype.itemsize * 8}-bit values ({raw.dtype}); the network takes "
            "8 bits a channel: convert the images to 8 bits, scaled to their own range",
        )
    channels = 1 if raw.ndim == 2 else raw.shape[2]
    if channels not in _TO_RGB:
        raise FlowFileError(path, f"expected 1, 3 or 4 image channels, got {channels}")
    return _upright(encoded, cv2.cvtColor(raw, _TO_RGB[channels]))


def _truncated_jpeg(encoded: bytes) -> bool:
    """A JPEG (FF D8 FF) without the end-of-image marker (FF D9) after the start of its last scan (FF DA)."""
    if not encoded.startswith(b"\xff\xd8\xff"):
        return False
    return encoded.rfind(b"\xff\xd9", 3) < encoded.rfind(b"\xff\xda", 3)


def read_flow(path: PathLike) -> tuple[np.ndarray, np.ndarray | None]:
    """Read any supported flow file by extension -> (flow [H, W, 2], valid [H, W] or None for dense flow)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".flo":
        return read_flo(path), None
    if suffix == ".pfm":
        flow = read_pfm(path)
        if flow.ndim != 3:
            raise FlowFileError(path, "expected a 3-channel ('PF') flow .pfm, got a 1-channel ('Pf') file")
        return flow, None
    if suffix == ".png":
        return read_kitti_flow(path)
    raise FlowFileError(path, f"unknown flow file extension {suffix!r}; expected .flo, .pfm or .png")

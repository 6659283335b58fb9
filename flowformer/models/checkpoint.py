"""Checkpoint handoff: official FlowFormer/FlowFormer++ `.pth` files, our own backbone files, Lightning `.ckpt`.

Our module names equal the official ones, so the key map between the two layouts is only the `module.` prefix
that `nn.DataParallel` adds (the released files were saved from it): `from_official` strips it, `to_official`
adds it back, and a round trip is exact. Our backbone format is `{"format": "flowformer-backbone", "version": 1, "config": {...}, "state_dict": ...}`,
plain values only, so `torch.load(weights_only=True)` reads it.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import stat
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowformer.models.build import build_flowformer
from flowformer.models.flowformer import FlowFormer
from flowformer.models.output_files import atomic_write

log = logging.getLogger(__name__)

BACKBONE_FORMAT = "flowformer-backbone"
OFFICIAL_PREFIX = "module."
# Lightning .ckpt keys of the network: FlowModule, MCVAPretrainModule and UnsupervisedPretrainModule
# (flowformer/lit/) hold it as their `backbone` attribute. Spelled out here rather than read from those classes
# because models/ must not import lit/.
LIGHTNING_PREFIX = "backbone."
# Stored backbone configs (our backbone files, the `backbone` hyper-parameters of Lightning checkpoints) written by
# older versions are brought up to date wherever they are read (`current_backbone_config`), so they still load:
# - a knob no longer taken gives way to the knobs its value now means (RETIRED_BACKBONE_KEYS): decoder_iters, the old
#   default of forward's `iters`, to none (every caller now passes it); tokenize_checkpoint (a bool) to one stage
#   of activation_checkpoint;
# - the old `_target_`: FlowFormer took the knobs itself before it was assembled from parts by build_flowformer.
RETIRED_BACKBONE_KEYS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "decoder_iters": lambda _: {},
    "tokenize_checkpoint": lambda on: {"activation_checkpoint": ["tokenize"] if on else []},
}
RETIRED_TARGETS = {"flowformer.models.FlowFormer": "flowformer.models.build_flowformer"}
# The builders a backbone config may name as its `_target_` (that of conf/backbone/*.yaml): a network is rebuilt
# from settings, stored ones included, only by calling one of these with the knobs, never by Hydra's instantiate,
# which would call whatever a checkpoint names (builtins.open, ...) and the `_target_`s nested in its values.
BACKBONE_BUILDERS: dict[str, Callable[..., FlowFormer]] = {"flowformer.models.build_flowformer": build_flowformer}


@dataclass
class LoadReport:
    """What `load_backbone_weights` did: where the weights came from, how many loaded, which keys it skipped."""

    source: str
    loaded: int
    skipped: list[str] = field(default_factory=list)


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not fit the network."""


class CheckpointReadError(ValueError):
    """A checkpoint file cannot be read: not a checkpoint, corrupt or truncated, or holding non-plain objects."""


class BackboneTargetError(CheckpointReadError):
    """A backbone config names a `_target_` that is not one of the package's builders (BACKBONE_BUILDERS)."""


def from_official(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Official layout (with or without `module.`) -> our state_dict keys."""
    return {k.removeprefix(OFFICIAL_PREFIX): v for k, v in state.items()}


def to_official(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our state_dict keys -> the released-checkpoint layout (`module.` prefix, as saved by DataParallel)."""
    return {OFFICIAL_PREFIX + k: v for k, v in state.items()}


def export_official(net: FlowFormer, path: str | Path | None = None) -> dict[str, Tensor]:
    """The network's weights in the official layout; also written to `path` when given."""
    state = to_official({k: v.detach().cpu() for k, v in net.state_dict().items()})
    if path is not None:
        _write(state, path)
    return state


# How torch's weights-only unpickler names a class or function it refuses to create (its other unpickling errors
# mean bytes that are not a checkpoint).
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


# A checkpoint holds the network's weights and, in a Lightning .ckpt, the optimiser's state (AdamW: two more
# copies) and small extras; its records may declare at most this many times the weights' bytes (plus the floor).
DECLARED_BYTES_FACTOR = 8
DECLARED_BYTES_FLOOR = 64 * 2**20
# Where a run directory (or its checkpoints/ folder) given in place of a checkpoint holds its last one.
RUN_CHECKPOINTS = ("checkpoints/last.ckpt", "last.ckpt")


def checkpoint_file(path: str | Path, setting: str | None = None, advice: str = "check the path") -> Path:
    """`path` as a Path once it is known to be a regular file: FileNotFoundError when it does not exist (the line
    ends with `advice`), CheckpointReadError when it cannot be looked at or is not a regular file (a named pipe
    would block; for a run directory the line names the run's last.ckpt). `setting` (e.g. "infer.checkpoint")
    starts the line, so that a caller that knows which setting gave the path can check it before building
    anything."""
    path = Path(path)
    named = f"{setting}: checkpoint {path}" if setting else f"checkpoint {path}"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{named} does not exist; {advice}") from None
    except OSError as err:
        raise CheckpointReadError(f"cannot read {named} ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a device"
        inside = [path / name for name in RUN_CHECKPOINTS if stat.S_ISDIR(mode) and (path / name).is_file()]
        expected = f"give its {inside[0]}" if inside else "expected a checkpoint file"
        raise CheckpointReadError(f"{named} is not a regular file ({kind}); {expected}")
    return path


def read_checkpoint(path: str | Path, network: nn.Module | None = None) -> dict:
    """Load a checkpoint onto the CPU with the weights-only unpickler (never running code from the file).

    Returns the loaded dict. Raises FileNotFoundError and CheckpointReadError as `checkpoint_file` does, and
    CheckpointReadError when it cannot be read, is not a checkpoint (or is corrupt or truncated), holds pickled classes or functions, or does not hold a
    dict. With `network`, a file in torch's zip format whose records declare far more bytes than that network's
    weights (DECLARED_BYTES_FACTOR) is refused before a record is read (a small file can declare records that
    inflate to gigabytes).
    """
    path = checkpoint_file(path)
    if network is not None:
        _check_declared_size(path, network)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist; check the path") from None
    except OSError as err:
        raise CheckpointReadError(
            f"cannot read checkpoint {path} ({err.strerror or err}); expected a readable checkpoint file"
        ) from None
    except pickle.UnpicklingError as err:
        refused = _REFUSED_GLOBAL.search(str(err))
        if refused is None:
            raise CheckpointReadError(_not_a_checkpoint(path)) from None
        raise CheckpointReadError(
            f"checkpoint {path} holds pickled classes or functions (found {refused.group(1)}), which are not "
            "loaded because unpickling them could run code; re-save it with plain values only (tensors, numbers, "
            "strings, lists and dicts), as flowformer.models.save_backbone does"
        ) from None
    # other bytes that are not a checkpoint make torch raise RuntimeError, EOFError, KeyError, ...
    except Exception as err:
        raise CheckpointReadError(_not_a_checkpoint(path)) from err
    if not isinstance(obj, dict):
        raise CheckpointReadError(
            f"checkpoint {path} holds a {type(obj).__name__}, expected a dict (a state dict, a {BACKBONE_FORMAT} "
            "file or a Lightning .ckpt)"
        )
    return obj


def _check_declared_size(path: Path, network: nn.Module) -> None:
    """Refuse a zip-format checkpoint whose entries declare (uncompressed, read from the zip directory without
    inflating anything) more than DECLARED_BYTES_FACTOR times `network`'s weights, plus DECLARED_BYTES_FLOOR."""
    if not zipfile.is_zipfile(path):  # the legacy format, or not a checkpoint: torch.load says which
        return
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(entry.file_size for entry in archive.infolist())
    except (zipfile.BadZipFile, OSError):
        raise CheckpointReadError(_not_a_checkpoint(path)) from None
    needed = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    limit = DECLARED_BYTES_FACTOR * needed + DECLARED_BYTES_FLOOR
    if declared > limit:
        raise CheckpointReadError(
            f"checkpoint {path} declares {declared / 2**20:.0f} MiB of records, more than {DECLARED_BYTES_FACTOR}x "
            f"the network's {needed / 2**20:.1f} MiB of weights (plus {DECLARED_BYTES_FLOOR // 2**20} MiB); not "
            "read: it is not a checkpoint of this network (or is corrupt); re-download or re-save it"
        )


def _not_a_checkpoint(path: Path) -> str:
    detail = "the file is empty" if path.stat().st_size == 0 else "torch.load cannot parse it"
    return (
        f"{path} is not a PyTorch checkpoint or is corrupt or truncated ({detail}); re-download or re-save it"
    )


def _write(obj: object, path: str | Path) -> None:
    """torch.save, atomically (`atomic_write`): a failed write is one OutputWriteError naming `path`."""
    with atomic_write(path) as file:
        torch.save(obj, file)


def _unwrap(obj: dict, path: str | Path) -> tuple[dict[str, Tensor], str, Mapping[str, Any] | None]:
    """Any supported file -> (state dict with our keys, source kind, the backbone config stored with it: our
    file's `config`, a Lightning .ckpt's `backbone` hyper-parameters (None where its module was given a built
    network), None for an official .pth, which stores none)."""
    if obj.get("format") == BACKBONE_FORMAT:
        return dict(obj["state_dict"]), "backbone", obj["config"]
    if "state_dict" in obj and isinstance(obj["state_dict"], Mapping):  # Lightning .ckpt
        inner = obj["state_dict"]
        state = {
            k.removeprefix(LIGHTNING_PREFIX): v for k, v in inner.items() if k.startswith(LIGHTNING_PREFIX)
        }
        if not state:
            raise ValueError(
                f"{path}: a Lightning checkpoint without `{LIGHTNING_PREFIX}` keys; expected the state of "
                "FlowModule, MCVAPretrainModule or UnsupervisedPretrainModule"
            )
        return state, "lightning", obj.get("hyper_parameters", {}).get("backbone")
    if obj and all(isinstance(v, Tensor) for v in obj.values()):
        return from_official(obj), "official", None
    raise ValueError(f"{path}: not an official .pth, a {BACKBONE_FORMAT} file or a Lightning .ckpt")


# keys listed of each kind of mismatch: a network of other backbone settings differs in hundreds (a tiny checkpoint
# in the official-size network: 486 lines), and the settings line after the lists says what to change
MISMATCH_KEYS_LISTED = 10
# the one weight that tells the published variants apart: FlowFormer's bias-free 1x1 convolution on the features
# before the cost volume, which FlowFormer++ has not (`channel_convertor` of build.py's VARIANTS)
VARIANT_KEY = "memory_encoder.channel_convertor.weight"


def check_compatible(
    net: nn.Module, state: Mapping[str, Tensor], source: str, skip_prefixes: Iterable[str] = ()
) -> list[str]:
    """Raise `CheckpointMismatchError` listing missing, unexpected and shape-mismatched keys (outside
    `skip_prefixes`; the first MISMATCH_KEYS_LISTED of each, with the count); return the skipped keys."""
    skip = tuple(skip_prefixes)
    own = net.state_dict()
    skipped = sorted(k for k in set(own) | set(state) if k.startswith(skip)) if skip else []
    own_keys = {k for k in own if not (skip and k.startswith(skip))}
    got_keys = {k for k in state if not (skip and k.startswith(skip))}
    missing = sorted(own_keys - got_keys)
    unexpected = sorted(got_keys - own_keys)
    mismatched = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs network {tuple(own[k].shape)}"
        for k in own_keys & got_keys
        if state[k].shape != own[k].shape
    )
    if missing or unexpected or mismatched:

        def block(title: str, items: list[str]) -> str:
            listed = "".join(f"\n    {i}" for i in items[:MISMATCH_KEYS_LISTED])
            more = len(items) - MISMATCH_KEYS_LISTED
            return f"\n  {title} ({len(items)}):{listed}" + (f"\n    ... and {more} more" if more > 0 else "")

        raise CheckpointMismatchError(
            f"{source} does not match the network"
            + block("missing keys", missing)
            + block("unexpected keys", unexpected)
            + block("shape mismatches", mismatched)
            + "\nCheck backbone.variant and the architecture knobs, or pass skip_prefixes for parts you re-initialise."
            + variant_hint(missing, unexpected)
        )
    return skipped


def variant_hint(missing: list[str], unexpected: list[str]) -> str:
    """A line naming the variant a checkpoint's weights are, where they lack (missing) or hold (unexpected) the
    one weight only FlowFormer has (VARIANT_KEY); '' otherwise."""
    if VARIANT_KEY in missing:
        has, variant, name = "has no", "flowformer_pp", "FlowFormer++"
    elif VARIANT_KEY in unexpected:
        has, variant, name = "has", "flowformer", "FlowFormer"
    else:
        return ""
    return (
        f"\nThe checkpoint {has} {VARIANT_KEY}, which only FlowFormer has: {name}'s weights? Set "
        f"backbone.variant={variant} (the published {name}: backbone={variant})."
    )


def check_fits(
    net: nn.Module,
    state: Mapping[str, Tensor],
    source: str,
    stored: Mapping[str, Any] | None,
    skip_prefixes: Iterable[str] = (),
) -> list[str]:
    """`check_compatible`, its error followed by the backbone settings that would build the checkpoint's network
    where the checkpoint stores them (`stored`: `architecture_difference`); returns the skipped keys."""
    try:
        return check_compatible(net, state, source, skip_prefixes)
    except CheckpointMismatchError as error:
        if (differing := architecture_difference(stored, getattr(net, "config", None))) is None:
            raise
        raise CheckpointMismatchError(f"{error}\n{differing}") from None


def _as_network_dtypes(net: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cast floating tensors (e.g. fp16 released weights) to the network's dtypes; integer buffers stay."""
    own = net.state_dict()
    return {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in state.items()}


def load_backbone_weights(
    net: FlowFormer, path: str | Path, *, skip_prefixes: Iterable[str] = ()
) -> LoadReport:
    """Load our backbone file, an official `.pth` (with or without `module.`) or a Lightning `.ckpt` of a
    FlowModule/MCVAPretrainModule/UnsupervisedPretrainModule into `net`, strictly except for keys starting with
    one of `skip_prefixes`."""
    state, kind, stored = _unwrap(read_checkpoint(path, net), path)
    skip = tuple(skip_prefixes)
    skipped = check_fits(net, state, f"{kind} checkpoint {path}", stored, skip)
    kept = {k: v for k, v in _as_network_dtypes(net, state).items() if not (skip and k.startswith(skip))}
    net.load_state_dict(kept, strict=not skip)
    if skipped:
        log.info("load_backbone_weights(%s): skipped %d keys: %s", path, len(skipped), skipped)
    return LoadReport(source=kind, loaded=len(kept), skipped=skipped)


# Backbone knobs that set how a network computes or where its first weights come from, not which weights it has.
COMPUTATION_KNOBS = ("twins_weights", "tokenize_chunk", "memory_budget_gb", "activation_checkpoint")


def architecture_difference(stored: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> str | None:
    """For a checkpoint that does not fit a network: the line naming each knob of the backbone the checkpoint
    stores (`stored`: our file's config, a Lightning .ckpt's `backbone` hyper-parameters) that the network's
    knobs (`config`) set otherwise, as overrides that would build the checkpoint's network; None where either is
    unknown (an official .pth stores none) or no knob differs."""
    if stored is None or config is None:
        return None
    knobs = current_backbone_config(stored)

    def written(value: Any) -> str:  # as an override's value: null, true, [16,24,32], "cnn"
        return json.dumps(value, separators=(",", ":"))

    differing = [
        f"backbone.{key}={written(value)} (here {written(config.get(key))})"
        for key, value in knobs.items()
        if key != "_target_" and key not in COMPUTATION_KNOBS and value != config.get(key)
    ]
    if not differing:
        return None
    return (
        "The checkpoint's network was built with other backbone settings: "
        + ", ".join(differing)
        + "; run with those (or the backbone=<config> it was trained with)."
    )


def load_official(path: str | Path, variant: str = "flowformer", **overrides) -> FlowFormer:
    """Build the official architecture of `variant` (Twins encoders, paper knobs) and load a released checkpoint
    (or our file, or a Lightning .ckpt: a mismatch then names the backbone settings stored in it) strictly; returns
    the network in eval mode. `overrides` change backbone knobs (e.g. tokenize_chunk=4096)."""
    with torch.device("meta"):
        net = build_flowformer(variant=variant, **overrides)
    state, kind, stored = _unwrap(read_checkpoint(path, net), path)
    check_fits(net, state, f"{kind} checkpoint {path} (variant={variant!r})", stored)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    net.load_state_dict(state, strict=True, assign=True)
    return net.eval()


def current_backbone_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored backbone config as today's builder takes it: RETIRED_BACKBONE_KEYS replaced by the knobs they now
    mean, an old `_target_` replaced (RETIRED_TARGETS)."""
    current: dict[str, Any] = {}
    for key, value in config.items():
        current |= RETIRED_BACKBONE_KEYS[key](value) if key in RETIRED_BACKBONE_KEYS else {key: value}
    if "_target_" in current:
        current["_target_"] = RETIRED_TARGETS.get(current["_target_"], current["_target_"])
    return current


def backbone_builder(config: Mapping[str, Any], source: str) -> tuple[Callable[..., FlowFormer], dict[str, Any]]:
    """The package builder a backbone config names (BACKBONE_BUILDERS; build_flowformer where it names none, as our
    backbone files) and its knobs (`current_backbone_config`); a BackboneTargetError naming `source` otherwise."""
    knobs = current_backbone_config(config)
    target = knobs.pop("_target_", "flowformer.models.build_flowformer")
    if target not in BACKBONE_BUILDERS:
        raise BackboneTargetError(
            f"{source} names `_target_: {target}`, which is refused: a network is rebuilt from settings only by "
            f"the package's builders ({', '.join(BACKBONE_BUILDERS)}, the `_target_` of conf/backbone/*.yaml), so "
            "a checkpoint cannot name code to run; use a checkpoint written by this package"
        )
    return BACKBONE_BUILDERS[target], knobs


def save_backbone(path: str | Path, net: FlowFormer) -> None:
    """Write the network in our backbone format (plain values; readable with weights_only=True)."""
    if net.config is None:
        raise ValueError(
            "save_backbone needs a network built by flowformer.models.build_flowformer (its knobs rebuild it); "
            "for a network assembled by hand, save its state_dict"
        )
    _write(
        {
            "format": BACKBONE_FORMAT,
            "version": 1,
            "config": dict(net.config),
            "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        },
        path,
    )


def load_backbone(path: str | Path) -> FlowFormer:
    """Rebuild a network from a file that stores its backbone config, our backbone file or a
    FlowModule/MCVAPretrainModule/UnsupervisedPretrainModule Lightning `.ckpt` (its `backbone` hyper-parameters),
    and load it strictly."""
    state, kind, config = _unwrap(read_checkpoint(path), path)
    if kind == "official":
        raise ValueError(
            f"{path} is already in the official layout (a released .pth), which stores no backbone config to "
            "rebuild the network from; use it as it is, or load it with load_official(path, variant=...)"
        )
    if config is None:
        raise ValueError(
            f"{path}: a Lightning checkpoint without `backbone` hyper-parameters (its module was given a built "
            "network), so the network cannot be rebuilt from it; load it into a network of its architecture with "
            f"load_backbone_weights(net, path), or convert it to a {BACKBONE_FORMAT} file first (task=convert "
            "with its backbone and convert.to_official=false)"
        )
    # the ImageNet Twins weights a run started from are in the state dict, so their file is not read again
    builder, knobs = backbone_builder(config, f"{kind} checkpoint {path}")
    with torch.device("meta"):
        net = builder(**knobs | {"twins_weights": None})
    check_compatible(net, state, f"{kind} checkpoint {path}")
    net.load_state_dict(state, strict=True, assign=True)
    return net

"""Checkpoint handoff: official FlowFormer/FlowFormer++ `.pth` files, our own backbone files, Lightning `.ckpt`.

Our module names equal the official ones, so the key map between the two layouts is only the `module.` prefix
that `nn.DataParallel` adds (SPEC §3): `from_official` strips it, `to_official` adds it back, and a round trip is
exact. Our backbone format is `{"format": "flowformer-backbone", "version": 1, "config": {...}, "state_dict": ...}`,
plain values only, so `torch.load(weights_only=True)` reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from flowformer.models.flowformer import FlowFormer

log = logging.getLogger(__name__)

BACKBONE_FORMAT = "flowformer-backbone"
OFFICIAL_PREFIX = "module."
LIGHTNING_PREFIX = "backbone."


@dataclass
class LoadReport:
    """What `load_backbone_weights` did: where the weights came from, how many loaded, which keys it skipped."""

    source: str
    loaded: int
    skipped: list[str] = field(default_factory=list)


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not fit the network."""


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
        torch.save(state, path)
    return state


def _read(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # re-raised with the file name and the fix
        raise ValueError(
            f"cannot read {path} with torch.load(weights_only=True): {err}. Checkpoints must hold plain values "
            "(tensors, numbers, strings, dicts); re-save it with flowformer.models.save_backbone."
        ) from err


def _unwrap(obj: dict, path: str | Path) -> tuple[dict[str, Tensor], str]:
    """Any supported file -> (state dict with our keys, source kind)."""
    if obj.get("format") == BACKBONE_FORMAT:
        return dict(obj["state_dict"]), "backbone"
    if "state_dict" in obj and isinstance(obj["state_dict"], Mapping):  # Lightning .ckpt
        inner = obj["state_dict"]
        state = {
            k.removeprefix(LIGHTNING_PREFIX): v for k, v in inner.items() if k.startswith(LIGHTNING_PREFIX)
        }
        if not state:
            raise ValueError(
                f"{path}: a Lightning checkpoint without `backbone.` keys; expected the state of "
                "FlowModule or MCVAPretrainModule"
            )
        return state, "lightning"
    if obj and all(isinstance(v, Tensor) for v in obj.values()):
        return from_official(obj), "official"
    raise ValueError(f"{path}: not an official .pth, a {BACKBONE_FORMAT} file or a Lightning .ckpt")


def check_compatible(
    net: nn.Module, state: Mapping[str, Tensor], source: str, skip_prefixes: Iterable[str] = ()
) -> list[str]:
    """Raise `CheckpointMismatchError` listing missing, unexpected and shape-mismatched keys (outside
    `skip_prefixes`); return the skipped keys."""
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
            return f"\n  {title} ({len(items)}):" + "".join(f"\n    {i}" for i in items)

        raise CheckpointMismatchError(
            f"{source} does not match the network"
            + block("missing keys", missing)
            + block("unexpected keys", unexpected)
            + block("shape mismatches", mismatched)
            + "\nCheck backbone.variant and the architecture knobs, or pass skip_prefixes for parts you re-initialise."
        )
    return skipped


def _as_network_dtypes(net: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cast floating tensors (e.g. fp16 released weights) to the network's dtypes; integer buffers stay."""
    own = net.state_dict()
    return {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in state.items()}


def load_backbone_weights(
    net: FlowFormer, path: str | Path, *, skip_prefixes: Iterable[str] = ()
) -> LoadReport:
    """Load our backbone file, an official `.pth` (with or without `module.`) or a FlowModule/MCVAPretrainModule
    Lightning `.ckpt` into `net`, strictly except for keys starting with one of `skip_prefixes`."""
    state, kind = _unwrap(_read(path), path)
    skip = tuple(skip_prefixes)
    skipped = check_compatible(net, state, f"{kind} checkpoint {path}", skip)
    kept = {k: v for k, v in _as_network_dtypes(net, state).items() if not (skip and k.startswith(skip))}
    net.load_state_dict(kept, strict=not skip)
    if skipped:
        log.info("load_backbone_weights(%s): skipped %d keys: %s", path, len(skipped), skipped)
    return LoadReport(source=kind, loaded=len(kept), skipped=skipped)


def load_official(path: str | Path, variant: str = "flowformer", **overrides) -> FlowFormer:
    """Build the official architecture of `variant` (Twins encoders, paper knobs) and load a released checkpoint
    strictly; returns the network in eval mode. `overrides` change constructor knobs (e.g. decoder_iters=32)."""
    state, _ = _unwrap(_read(path), path)
    with torch.device("meta"):
        net = FlowFormer(variant=variant, **overrides)
    check_compatible(net, state, f"official checkpoint {path} (variant={variant!r})")
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    net.load_state_dict(state, strict=True, assign=True)
    return net.eval()


def save_backbone(path: str | Path, net: FlowFormer) -> None:
    """Write the network in our backbone format (plain values; readable with weights_only=True)."""
    torch.save(
        {
            "format": BACKBONE_FORMAT,
            "version": 1,
            "config": dict(net.config),
            "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        },
        path,
    )


def load_backbone(path: str | Path) -> FlowFormer:
    """Rebuild a network from one of our backbone files (its stored config) and load it strictly."""
    obj = _read(path)
    if obj.get("format") != BACKBONE_FORMAT:
        raise ValueError(f"{path} is not a {BACKBONE_FORMAT} file; use load_official for released .pth files")
    with torch.device("meta"):
        net = FlowFormer(**obj["config"])
    check_compatible(net, obj["state_dict"], f"backbone checkpoint {path}")
    net.load_state_dict(obj["state_dict"], strict=True, assign=True)
    return net

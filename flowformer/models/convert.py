"""Convert checkpoints between the official layout and our backbone format.

    python -m flowformer.models.convert things.pth things_ours.ckpt --variant flowformer
    python -m flowformer.models.convert ours.ckpt official.pth --to-official

or, like every other task, `python run.py task=convert backbone=flowformer convert.input=things.pth
convert.output=things_ours.ckpt` (flowformer/tasks/convert.py).

The first form reads a released FlowFormer / FlowFormer++ `.pth` (with or without `module.`), loads it strictly
into the official architecture of `--variant` (or the knobs of `--backbone conf/backbone/<name>.yaml`) and writes
our backbone file. `--to-official` writes our backbone file or a Lightning `.ckpt` (of task=train or task=pretrain)
in the released layout, rebuilding the network from the architecture stored in it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flowformer.models.checkpoint import export_official, load_backbone, load_official, save_backbone


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flowformer.models.convert", description=__doc__.split("\n")[0]
    )
    parser.add_argument("src", type=Path, help="input checkpoint")
    parser.add_argument("dst", type=Path, help="output checkpoint")
    parser.add_argument(
        "--variant",
        choices=("flowformer", "flowformer_pp"),
        default=None,
        help="architecture of an official input (default: the --backbone file's, else flowformer)",
    )
    parser.add_argument(
        "--backbone",
        type=Path,
        default=None,
        help="conf/backbone/*.yaml whose knobs (with those it inherits) describe the architecture "
        "(default: the paper's)",
    )
    parser.add_argument(
        "--to-official",
        action="store_true",
        help="convert our backbone file or a Lightning .ckpt to the official layout",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dst (never src itself)")
    args = parser.parse_args(argv)
    if args.dst.resolve() == args.src.resolve():
        parser.exit(1, f"error: dst {args.dst} is src: the conversion would replace the file it reads\n")
    if args.dst.exists() and not args.overwrite:
        parser.exit(1, f"error: dst {args.dst} exists already; choose another dst, or pass --overwrite\n")
    try:
        _convert(args)
    except (OSError, ValueError) as err:  # missing or unreadable files, mismatching keys, bad knobs
        parser.exit(1, f"error: {err}\n")


def _convert(args: argparse.Namespace) -> None:
    knobs: dict = {}
    if args.backbone is not None:
        knobs = backbone_knobs(args.backbone)
    if args.variant is not None:
        knobs["variant"] = args.variant
    print(convert(args.src, args.dst, to_official=args.to_official, knobs=knobs))


def convert(src: str | Path, dst: str | Path, *, to_official: bool, knobs: dict) -> str:
    """Official `.pth` -> our backbone file, built with the backbone `knobs` (variant included; default the
    paper's FlowFormer), or with `to_official` our file or a Lightning `.ckpt` -> the official layout (the network
    rebuilt from the architecture stored in the file). Returns what was written."""
    if to_official:
        export_official(load_backbone(src), dst)
        return f"wrote official-layout state dict to {dst}"
    knobs = dict(knobs)
    variant = knobs.pop("variant", "flowformer")
    save_backbone(dst, load_official(src, variant=variant, **knobs))
    return f"wrote {variant} backbone checkpoint to {dst}"


def backbone_knobs(path: Path) -> dict:
    """The knobs of a conf/backbone/*.yaml file, composed with the files it inherits (its `defaults`)."""
    if not path.is_file():
        raise FileNotFoundError(f"--backbone {path}: no such file; pass one of conf/backbone/*.yaml")
    with initialize_config_dir(config_dir=str(path.resolve().parent), version_base="1.3"):
        knobs = OmegaConf.to_container(compose(config_name=path.stem), resolve=True)
    knobs.pop("_target_", None)
    return knobs


if __name__ == "__main__":
    main()

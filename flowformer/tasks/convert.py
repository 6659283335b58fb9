"""task=convert: a released FlowFormer / FlowFormer++ `.pth` -> our backbone file, its architecture the `backbone`
config group's as for eval and infer; or with `convert.to_official=true` our backbone file or a training run's
Lightning `.ckpt` -> the released layout, the architecture the one stored in the file.

    python run.py task=convert backbone=flowformer convert.input=things.pth convert.output=things_ours.ckpt
    python run.py task=convert convert.input=<run>/checkpoints/last.ckpt convert.output=ff.pth \
        convert.to_official=true

The same conversion as `python -m flowformer.models.convert` (flowformer/models/convert.py). An existing
`convert.output` is refused unless `convert.overwrite=true`; `convert.input` itself is never written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flowformer.models.checkpoint import checkpoint_file
from flowformer.models.convert import convert
from flowformer.tasks.run_dirs import OutputPathError, ensure_writable_dir, refuse_existing

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> None:
    settings = cfg.convert
    output = Path(settings.output)  # read first: an unset convert.output is named before convert.input is checked
    checkpoint_file(settings.input, "convert.input")
    if output.resolve() == Path(settings.input).resolve():
        raise OutputPathError(
            f"convert.output {output} is convert.input: the conversion would replace the file it reads (also "
            "with convert.overwrite=true); choose another convert.output"
        )
    ensure_writable_dir(output.parent, "the directory of convert.output")
    refuse_existing([output], "convert.output", "convert.overwrite", settings.overwrite)
    knobs = OmegaConf.to_container(cfg.backbone, resolve=True)
    knobs.pop("_target_", None)
    message = convert(settings.input, output, to_official=settings.to_official, knobs=knobs)
    log.info("convert: %s", message)
    print(message)

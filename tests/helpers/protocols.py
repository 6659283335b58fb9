"""A fresh checkout with a pipeline protocol of its own: supervised stages on synthetic data at the smoke
protocol's sizes, for the tests that run a pipeline or a table as its command runs it."""

import json
from pathlib import Path

from helpers.run import fresh_checkout

# A protocol of one or two supervised stages, each {name: [its own overrides]}, with the smoke protocol's sizes.
PROTOCOL = """\
# @package _global_
task: pipeline
name: {name}
pipeline:
  shared: [backbone=tiny, trainer=cpu, trainer.max_steps=2, trainer.val_check_interval=2, trainer.limit_val_batches=1,
    trainer.log_every_n_steps=1, trainer.enable_progress_bar=false, callbacks.progress_bar=null, data.batch_size=2,
    data.val_batch_size=2, data.val.synthetic.dataset.num_samples=2, model.train_iters=2, model.num_val_panels=0]
  stages: {stages}
  evaluate: {evaluate}
"""
# Its evaluation; a test of where the processes train leaves it out (`evaluate=False`): a process of its own.
EVALUATE = "{plain: [eval=synthetic, eval.benchmarks.synthetic.iters=2, eval.max_samples=2]}"


def checkout_with_protocol(tmp_path: Path, name: str, evaluate: bool = True, **stages: list[str]) -> Path:
    """A fresh checkout whose conf/protocol/<name>.yaml trains `stages` on synthetic data (then evaluates the
    last one, unless not `evaluate`)."""
    checkout = fresh_checkout(tmp_path / "checkout")
    entries = [{"name": stage, "overrides": ["task=train", "model=flow", "data=synthetic", *own]} for stage, own in stages.items()]
    text = PROTOCOL.format(name=name, stages=json.dumps(entries), evaluate=EVALUATE if evaluate else "{}")
    (checkout / "conf" / "protocol" / f"{name}.yaml").write_text(text)
    return checkout


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "pipeline.json").read_text())

"""The single entry point: `python run.py task=<train|pretrain|eval|infer|bench> [experiment=...] [key=value]`.

Examples: `python run.py experiment=quickstart`, `python run.py -m sweep=mask_ratio experiment=mcva_pretrain`.
Returns the monitored metric, so Hydra sweepers (grid, Optuna) can optimise it.
"""

import hydra
from omegaconf import DictConfig

from flowformer.tasks import run_task
from flowformer.tasks.run_dirs import register_resolvers

register_resolvers()  # ${fresh_dir:...} of conf/hydra/default.yaml, ${launch_dir:} of conf/paths/default.yaml


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_task(cfg)


if __name__ == "__main__":
    main()

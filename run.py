"""The single entry point: `python run.py [task=<task>] [experiment=...] [key=value]`; `python run.py --help` lists
the tasks (flowformer/tasks/) and the config groups (conf/hydra/default.yaml writes the help).

Examples: `python run.py experiment=quickstart`, `python run.py -m sweep=mask_ratio experiment=mcva_pretrain`.
Returns the monitored metric, so Hydra sweepers (grid, Optuna) can optimise it.
"""

import os
import sys
from pathlib import Path

# torch reads this once, at its first CPU allocation, so it is set before torch is imported: CPU tensors of 2 MiB
# and more get huge pages advised (madvise), 512x fewer page faults where the kernel allows them
# (/sys/kernel/mm/transparent_hugepage/enabled: always or madvise). THP_MEM_ALLOC_ENABLE=0 in the environment
# keeps 4 KiB pages. With the host allocator of flowformer/tasks/runtime.py, configure_host_allocator: a
# 440x1024 forward in 0.7x to 0.9x the time (docs/performance.md, "The host allocator").
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import hydra
from omegaconf import DictConfig

from flowformer.overrides import expand_home, missing_plugin
from flowformer.tasks import run_task
from flowformer.tasks.run_dirs import register_resolvers

register_resolvers()  # ${fresh_dir:...} of conf/hydra/default.yaml, ${launch_dir:} of conf/paths/default.yaml


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_task(cfg)


if __name__ == "__main__":
    sys.argv[1:] = expand_home(sys.argv[1:])  # `key=~/path` as bash passes it, also from sh, dash or zsh
    if (plugin := missing_plugin(sys.argv[1:], Path(__file__).parent / "conf")) is not None:
        print(f"error: {plugin}", file=sys.stderr)  # before Hydra, which names the option it cannot find
        raise SystemExit(1)
    main()

"""Hydra overrides: the command line's with `~` expanded (`expand_home`), their keys (`override_key`), values
written for the commands a pipeline runs (`path_value`, `override_value`: Hydra reads the value back unchanged),
the commands a line tells the user to run (`shell_override`, `command_again`: typed in a POSIX shell as
printed, Hydra reads the same values), and the Hydra plugins a command selects that are not installed
(`missing_plugin`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig

# Values that Hydra reads and a shell passes as they are: no quoting, so that the usual paths print plainly.
PLAIN_VALUE = re.compile(r"[\w./:@+-]+")


# A value of `key=value`, or an item of `key=[a,b]`, that starts at a home directory: `~`, `~/...`, `~user/...`.
HOME_PREFIX = re.compile(r"(?<=[=\[,])~[\w.-]*(?=/|$|,|\])")


def expand_home(arguments: list[str]) -> list[str]:
    """Command-line overrides with `~` at the start of a value (or of a list's item) expanded to the home
    directory, as bash does for `key=~/path` and sh, dash and zsh do not: Hydra's parser refuses the `~` they pass
    on (`LexerNoViableAltException: paths.log_dir=~/flow_logs`). Flags and quoted values stay."""
    return [
        argument if argument.startswith("-") else HOME_PREFIX.sub(lambda home: os.path.expanduser(home[0]), argument)
        for argument in arguments
    ]


def override_key(override: str) -> str:
    """`model.mask_ratio` of `model.mask_ratio=0.7` (also of `+key=...`, `++key=...`, `~key`)."""
    return override.split("=", 1)[0].lstrip("+~")


def path_value(path: str | Path) -> str:
    """A path or name as an override's value, quoted so that Hydra reads it back unchanged: a multirun job's
    folder holds `=` and `,` (e.g. `0_model.mask_ratio=0.7,backbone.agt_depth=1`), a name may hold `,` or `'`
    (Hydra's escapes: `\\'` for a quote, backslashes before a quote or the closing quote doubled)."""
    text = re.sub(r"(\\*)'", lambda match: match.group(1) * 2 + "\\'", str(path))
    return "'" + re.sub(r"(\\+)$", lambda match: match.group(1) * 2, text) + "'"


def override_value(value: Any) -> str:
    """A plain value (None, bool, number, string, list, dict) in Hydra's override syntax."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return f"[{','.join(map(override_value, value))}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{override_value(item)}" for key, item in value.items()) + "}"
    return path_value(str(value))


def shell_override(key: str, path: str | Path) -> str:
    """`key=<path>` as a line tells the user to type it: plain where nothing needs quoting, else Hydra's quotes
    (`path_value`: a multirun job's folder holds `=` and `,`, which Hydra refuses unquoted) inside the shell's
    (double quotes where nothing in it is special to them)."""
    text = str(path)
    if PLAIN_VALUE.fullmatch(text):
        return f"{key}={text}"
    override = f"{key}={path_value(text)}"
    return f'"{override}"' if not re.search(r'["$`\\!]', override) else shlex.quote(override)


# What a run again does not take from this run's command: its own resume and run directory, and the mode Hydra
# adds to every run's overrides (hydra.mode=RUN).
NOT_AGAIN = ("pipeline.resume", "hydra.run.dir", "hydra.mode")


def command_again(*overrides: str) -> str:
    """This run's command as typed in a shell (its interpreter, relative to the working directory where it is
    inside it, as `make demo`'s .venv/bin/python; its script; a `--config-name` other than run.py's `config`; its
    command-line overrides, Hydra's `hydra.*` too, but NOT_AGAIN), with `overrides` (shell-typed) after; only
    `overrides` where no command composed this run (a pipeline run in a Python session)."""
    if not HydraConfig.initialized():
        return " ".join(overrides)
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    hydra = HydraConfig.get()
    config = [] if hydra.job.config_name == "config" else [f"--config-name={hydra.job.config_name}"]
    given = [*hydra.overrides.hydra, *hydra.overrides.task]
    kept = [override for override in given if override_key(override) not in NOT_AGAIN]
    return " ".join([shlex.join([str(python), sys.argv[0], *config, *kept]), *overrides])


# The Hydra plugins a command may select, by the option they add to Hydra's config groups: the module that holds
# each and how to install it (pyproject.toml's extras where it has one; the others are Hydra's own plugins).
PLUGINS = {
    "hydra/sweeper=optuna": ("hydra_plugins.hydra_optuna_sweeper", 'pip install -e ".[optuna]"'),
    "hydra/sweeper=nevergrad": ("hydra_plugins.hydra_nevergrad_sweeper", "pip install hydra-nevergrad-sweeper"),
    "hydra/sweeper=ax": ("hydra_plugins.hydra_ax_sweeper", "pip install hydra-ax-sweeper"),
    "hydra/launcher=submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", 'pip install -e ".[slurm]"'),
    "hydra/launcher=submitit_local": ("hydra_plugins.hydra_submitit_launcher", 'pip install -e ".[slurm]"'),
    "hydra/launcher=joblib": ("hydra_plugins.hydra_joblib_launcher", "pip install hydra-joblib-launcher"),
    "hydra/launcher=ray": ("hydra_plugins.hydra_ray_launcher", "pip install hydra-ray-launcher"),
    "hydra/launcher=rq": ("hydra_plugins.hydra_rq_launcher", "pip install hydra-rq-launcher"),
}


def missing_plugin(arguments: list[str], conf_dir: Path) -> str | None:
    """What to install for a Hydra plugin the command selects that is not installed, where Hydra would say only
    that it cannot find the option: given as `hydra/sweeper=optuna`, or by a config the command picks from
    `conf_dir` whose defaults list overrides Hydra's group (`sweep=optuna`: `override /hydra/sweeper: optuna`)."""
    for argument in arguments:
        if argument.startswith("-") or "=" not in argument:
            continue
        group, option = override_key(argument), argument.split("=", 1)[1]
        selected = {f"{group}={option}": None} if group.startswith("hydra/") else {}  # choice -> the config
        chosen = conf_dir / group / f"{option}.yaml"
        if re.fullmatch(r"[\w/]+", group) and re.fullmatch(r"[\w-]+", option) and chosen.is_file():
            for entry in (yaml.safe_load(chosen.read_text()) or {}).get("defaults", []):
                for key, value in entry.items() if isinstance(entry, dict) else ():
                    if key.startswith("override /hydra/"):
                        selected[f"{key.removeprefix('override /')}={value}"] = argument
        for choice, given in selected.items():
            if choice in PLUGINS and importlib.util.find_spec(PLUGINS[choice][0]) is None:
                module, install = PLUGINS[choice]
                picked = f"{choice} is" if given is None else f"{given} selects {choice},"
                return f"{picked} a Hydra plugin that is not installed (no module {module}); install it: {install}"
    return None

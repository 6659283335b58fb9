"""The overrides a stop line tells the user to type (`shell_override`) reach Hydra unchanged through a POSIX shell,
for paths that need quoting in either: a multirun job's folder (`=` and `,`), spaces, quotes, `$`, backslashes;
the command it prints (`command_again`) is the run's own; a value at `~` reaches it expanded (`expand_home`); a
Hydra plugin the command selects and the machine lacks is named with what to install (`missing_plugin`)."""

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from flowformer.overrides import command_again, expand_home, missing_plugin, shell_override
from flowformer.setting_types import whole_number

from helpers.configs import CONF_DIR
from helpers.run import fresh_checkout, run_py

AWKWARD = [
    "/logs/train/default/multiruns/2026-11-29_23-52-12/0_backbone.agt_depth=1,model.optimizer.lr=0.0002/last.ckpt",
    "/home/me/My Runs/last.ckpt",
    "/home/me/it's/last.ckpt",
    '/data/a"b$HOME`x`!/last.ckpt',
    "/data/back\\slash\\",
    "/data/[brackets]/{braces}/last.ckpt",
]


@pytest.mark.parametrize("path", AWKWARD)
def test_an_awkward_path_typed_as_printed_reaches_hydra_unchanged(path):
    [argument] = shlex.split(shell_override("ckpt_path", path))  # what the shell hands run.py
    override = OverridesParser.create().parse_overrides([argument])[0]
    assert (override.key_or_group, override.value()) == ("ckpt_path", path)


def test_a_plain_path_prints_unquoted():
    path = "/logs/train/default/runs/2026-11-29_23-52-12/checkpoints/last.ckpt"
    assert shell_override("ckpt_path", path) == f"ckpt_path={path}"


def test_the_command_again_keeps_the_config_name_and_hydras_overrides_but_not_the_runs_own(tmp_path, monkeypatch):
    """command_again of a run started as `python run.py --config-name=mine hydra.searchpath=[...] hydra.verbose=true
    debug=tiny pipeline.resume=<dir>` (a root config of the user's own, found on a search path): the same
    interpreter, script, config name and overrides, Hydra's among them, without this run's resume or mode."""
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    searchpath = f"hydra.searchpath=[file://{CONF_DIR}]"
    given = [searchpath, "hydra.verbose=true", "debug=tiny", "pipeline.resume=/logs/run"]
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose("mine", overrides=given, return_hydra_config=True)
    monkeypatch.setattr(sys, "argv", ["run.py", "--config-name=mine", *given])
    monkeypatch.setattr(HydraConfig.instance(), "cfg", cfg)
    again = shlex.split(command_again(shell_override("pipeline.resume", "/logs/run 2")))
    assert again[1:] == [
        "run.py", "--config-name=mine", searchpath, "hydra.verbose=true", "debug=tiny", "pipeline.resume='/logs/run 2'"
    ]
    assert Path(again[0]).resolve() == Path(sys.executable).resolve()


def test_a_value_at_the_home_directory_is_expanded_as_bash_does(monkeypatch):
    """What sh, dash and zsh pass for `key=~/path` (bash expands it itself): the value, or each item of a list or
    a sweep, that starts at `~` reads from the home directory; flags, `~` inside a value and quoted values stay."""
    monkeypatch.setenv("HOME", "/home/me")
    given = ["paths.log_dir=~/flow_logs", "infer.input=[~/a.png,~/b.png]", "paths.data_dir=~/a,~", "x=a~/b",
             "name='~/quoted'", "--config-name=~mine", "~trainer.max_steps"]
    assert expand_home(given) == [
        "paths.log_dir=/home/me/flow_logs",
        "infer.input=[/home/me/a.png,/home/me/b.png]",
        "paths.data_dir=/home/me/a,/home/me",
        *given[3:],
    ]


def test_a_run_given_its_log_dir_at_home_as_sh_passes_it_writes_there(tmp_path):
    """`python run.py ... paths.log_dir=~/flow_logs` typed in sh (which passes the `~` on, and Hydra's parser
    refused it): the run is written under the home directory."""
    checkout, home = fresh_checkout(tmp_path / "checkout"), tmp_path / "home"
    run_py("debug=tiny", "trainer.max_steps=1", "paths.log_dir=~/flow_logs", cwd=checkout, env={"HOME": str(home)})
    assert list((home / "flow_logs" / "train" / "default" / "runs").glob("*/checkpoints/last.ckpt"))
    assert not (checkout / "~").exists()


@pytest.mark.parametrize(("value", "count"), [(100000, 100000), (1e5, 100000), (2.0, 2)])
def test_a_count_written_as_a_whole_float_is_that_number(value, count):
    assert whole_number(value, "trainer.max_steps") == count and type(whole_number(value, "x")) is int


@pytest.mark.parametrize("value", ["10k", 2.5, True, None])
def test_a_count_that_is_not_a_whole_number_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=re.escape(f"data.batch_size={value!r}: expected a whole number")):
        whole_number(value, "data.batch_size")


def test_a_run_given_its_steps_as_1e_trains_that_many(tmp_path):
    """`trainer.max_steps=2e0` (as `1e5` is written): Hydra reads a float, and the OneCycle schedule derived from
    it refused the run ("Expected positive integer total_steps, but got 102.0"). It trains 2 steps."""
    checkout = fresh_checkout(tmp_path)
    run_py("debug=tiny", "trainer.max_steps=2e0", cwd=checkout)
    (last,) = (checkout / "logs").rglob("last.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == 2


OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper"


@pytest.mark.skipif(importlib.util.find_spec(OPTUNA_SWEEPER) is not None, reason="the optuna extra is installed")
def test_the_readmes_optuna_sweep_without_its_extra_is_one_line_saying_what_to_install(tmp_path):
    """The README's command, where `pip install -e ".[optuna]"` was not run: Hydra said only that it could not find
    'hydra/sweeper/optuna' (its options: basic)."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("experiment=mcva_pretrain", "sweep=optuna", "hydra.sweeper.n_trials=30", cwd=checkout,
                    expect_ok=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            "error: sweep=optuna selects hydra/sweeper=optuna, a Hydra plugin that is not installed (no module "
            f'{OPTUNA_SWEEPER}); install it: pip install -e ".[optuna]"'
        )
    ]
    assert not (checkout / "logs").exists()


def test_a_hydra_plugin_option_is_checked_where_the_command_or_its_configs_select_it():
    """Hydra's own plugins by name (joblib: not a dependency), the extras' by the configs that select them; an
    installed plugin (submitit, of the dev extra), a plain setting or a flag is no error."""
    assert missing_plugin(["-m", "+hydra/launcher=joblib", "seed=1,2"], CONF_DIR) == (
        "hydra/launcher=joblib is a Hydra plugin that is not installed (no module hydra_plugins.hydra_joblib_launcher); "
        "install it: pip install hydra-joblib-launcher"
    )
    optuna_line = missing_plugin(["debug=tiny", "+sweep=optuna"], CONF_DIR)
    if importlib.util.find_spec(OPTUNA_SWEEPER) is None:
        assert optuna_line.startswith("+sweep=optuna selects hydra/sweeper=optuna, a Hydra plugin that is not")
    else:
        assert optuna_line is None
    installed = ["-m", "hydra/launcher=submitit_local", "sweep=mask_ratio", "model.mask_ratio=0.3", "--cfg", "job"]
    assert importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    assert missing_plugin(installed, CONF_DIR) is None

"""The overrides a stop line tells the user to type (`shell_override`) reach Hydra unchanged through a POSIX shell,
for paths that need quoting in either: a multirun job's folder (`=` and `,`), spaces, quotes, `$`, backslashes."""

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from flowformer.overrides import shell_override

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

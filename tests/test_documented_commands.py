"""Every command the documentation gives composes as written (issue 34 item 1).

Each `python run.py ...` command of README.md, data/README.md and docs/*.md (also the `torchrun ... run.py ...`
and `srun python run.py ...` lines, and those behind an environment setting or `/usr/bin/time -v`) is one case
below. It is composed from a fresh checkout of its own, as that checkout's run.py composes it: Hydra's own
entry (`_run_app`: the run mode, `-m` or a sweep file's `hydra.mode: MULTIRUN`, then the sweeper and the
launcher), run.py's search path and task name, the checkout as the working directory and every job's
callbacks; only the job's task is replaced by resolving its config. A sweep composes every job of its grid. A
training job's batch of each process is derived too (a stage's global batch must divide over its processes).
A command that no longer composes fails with the command and Hydra's error.

The documented placeholders are replaced as PLACEHOLDERS says (composing reads no file, so the paths need not
exist); a command with a placeholder the table does not know, or a launcher `launch_args` does not know, fails.
The launchers (torchrun, srun) start processes that each compose the same config: tests/tasks/test_ddp.py runs
them. The commands documented as CPU-sized are run to the end by their own tests (tests/tasks/test_pipeline.py,
test_quickstart.py, test_sweeps_as_documented.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra._internal.hydra import Hydra
from hydra._internal.utils import _run_app, create_automatic_config_search_path, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from flowformer.tasks.batches import per_process_batch
from flowformer.tasks.run_dirs import register_resolvers

from helpers.configs import REPO_DIR
from helpers.run import fresh_checkout, run_py

DOCUMENTS = [
    REPO_DIR / "README.md",
    REPO_DIR / "data" / "README.md",
    *sorted((REPO_DIR / "docs").glob("*.md")),
]

# What a placeholder of the documentation stands for when its command is composed.
PLACEHOLDERS = {
    "<ckpt>": "logs/train/chairs/runs/2026-01-01_00-00-00/checkpoints/last.ckpt",
    "<run>": "logs/train/chairs/runs/2026-01-01_00-00-00",
    "<pretrain run>": "logs/pretrain/mcva_pretrain/runs/2026-01-01_00-00-00",
    "<that run>": "logs/pretrain/mcva_pretrain/runs/2026-01-01_00-00-00",
    "<chairs run>": "logs/train/chairs/runs/2026-01-01_00-00-00",
    "<things run>": "logs/train/things/runs/2026-01-01_00-00-00",
    "<sintel run>": "logs/train/sintel/runs/2026-01-01_00-00-00",
    "<multirun dir>": "logs/pipeline/paper_agt_mlp_conv/multiruns/2026-01-01_00-00-00",
    "<sweep dir>": "logs/pipeline/paper_agt_mlp_conv/multiruns/2026-01-01_00-00-00",
    "<time>": "2026-01-01_00-00-00",
    "<table>": "paper_agt_mlp_conv",  # one of the tables
    "$HOST": "localhost",
    "...": "",  # a part the text leaves out (`task=bench ...`, `[...]`): the command without it
}
UNKNOWN_PLACEHOLDER = re.compile(r"<[^<>]*>|\$\w+|\.\.\.")

# The optional extras a command needs (pyproject.toml), by the override that needs it.
EXTRAS = {"sweep=optuna": "hydra_plugins.hydra_optuna_sweeper"}

FENCE = re.compile(r"^\s*(```|~~~)")
FENCED_COMMENT = re.compile(r"(^|\s)#.*$")
CODE_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
# `python run.py`, `.venv/bin/python run.py`, `srun python run.py`, `torchrun --opt=v ... run.py`, each up to the
# end of its code or a `#` comment.
COMMAND = re.compile(
    r"(?P<launch>(?:srun\s+)?(?:[\w./-]*/)?python\s+|torchrun\s+(?:--\S+\s+)*)run\.py(?P<args>(?:\s+(?!#)\S+)*)"
)
# NAME=value settings right before the command (after them, perhaps `/usr/bin/time -v`).
ENVIRONMENT = re.compile(r"((?:[A-Z_][A-Z0-9_]*=\S*\s+)+)(?:/usr/bin/time\s+-v\s+)?$")


@dataclass(frozen=True)
class Command:
    """A documented command: where it is, the environment it sets (NAME=value), its launcher (`python`,
    `srun python`, `torchrun ...`) and run.py's arguments, as written."""

    where: str
    environment: tuple[str, ...]
    launch: str
    args: str

    def __str__(self) -> str:
        return " ".join([*self.environment, self.launch, "run.py", self.args]).strip()


def code_texts(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced code line (a line ending in `\\` joined with the next) and of each
    inline code span (which may wrap onto the next lines), in the order they appear."""
    texts, fenced, pending, prose = [], False, None, []
    for number, line in enumerate(markdown.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose.append((number, line))
            continue
        start, text = pending or (number, "")
        text = f"{text} {FENCED_COMMENT.sub('', line).strip()}".strip()
        pending = (start, text[:-1]) if text.endswith("\\") else None
        if pending is None:
            texts.append((start, " ".join(text.split())))
    paragraph = "\n".join(line for _, line in prose)
    for span in CODE_SPAN.finditer(paragraph):
        line_number = prose[paragraph.count("\n", 0, span.start())][0]
        texts.append((line_number, " ".join(span.group(1).split())))
    return sorted(texts, key=lambda item: item[0])


def documented_commands(path: Path, root: Path = REPO_DIR) -> list[Command]:
    """Every run.py command of a Markdown file, each named by the file's path in `root` and its line."""
    commands = []
    for number, text in code_texts(path.read_text(encoding="utf-8")):
        for found in COMMAND.finditer(text):
            settings = ENVIRONMENT.search(text[: found.start()])
            environment = tuple(settings.group(1).split()) if settings else ()
            launch, args = " ".join(found.group("launch").split()), found.group("args").strip()
            commands.append(Command(f"{path.relative_to(root)}:{number}", environment, launch, args))
    return commands


def launch_args(command: Command) -> list[str]:
    """run.py's arguments with the placeholders replaced; an unknown placeholder or launcher fails."""
    known_launchers = ("python", ".venv/bin/python", "srun python", "torchrun ")
    assert command.launch in known_launchers[:3] or command.launch.startswith(known_launchers[3]), (
        f"{command.where}: `{command}`: an unknown launcher"
    )
    text = command.args
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    unknown = UNKNOWN_PLACEHOLDER.findall(text)
    assert not unknown, f"{command.where}: `{command}`: add {unknown} to PLACEHOLDERS"
    return shlex.split(text)


COMMANDS = [command for document in DOCUMENTS for command in documented_commands(document)]
# One case per distinct command, named after where it is given first.
CASES = [command for n, command in enumerate(COMMANDS) if str(command) not in map(str, COMMANDS[:n])]


def given_at(command: Command) -> str:
    """Every place the documentation gives `command`."""
    return ", ".join(other.where for other in COMMANDS if str(other) == str(command))


def compose_jobs(checkout: Path, args: list[str]) -> list[dict]:
    """The resolved config of every job `python run.py <args>` starts in `checkout` (the working directory),
    composed as run.py's @hydra.main composes it; the jobs do nothing else."""
    register_resolvers()
    parsed = get_args_parser().parse_args(args)
    jobs: list[dict] = []

    def resolve(cfg) -> float:
        jobs.append(OmegaConf.to_container(cfg, resolve=True))
        return 0.0

    search_path = create_automatic_config_search_path(str(checkout / "run.py"), None, "conf")
    hydra = Hydra.create_main_hydra2(task_name="run", config_search_path=search_path)
    try:
        mode = hydra.get_mode(config_name="config", overrides=parsed.overrides)
        _run_app(not parsed.multirun, parsed.multirun, mode, hydra, "config", resolve, parsed.overrides)
    finally:
        GlobalHydra.instance().clear()
    return jobs


@pytest.mark.parametrize("command", CASES, ids=lambda command: command.where)
def test_documented_command_composes(command: Command, tmp_path, monkeypatch, capsys):
    args = launch_args(command)
    for override, module in EXTRAS.items():
        if override in args:
            pytest.importorskip(module, reason=f"`{override}` needs an optional extra")
    checkout = fresh_checkout(tmp_path)
    monkeypatch.chdir(checkout)
    for setting in command.environment:
        monkeypatch.setenv(*setting.split("=", 1))
    try:
        jobs = compose_jobs(checkout, args)
    except SystemExit:
        pytest.fail(f"{given_at(command)}: `{command}` does not compose:\n{capsys.readouterr().err[-3000:]}")
    assert jobs, f"{given_at(command)}: `{command}` composed no job"
    for job in jobs:
        if job["task"] in ("train", "pretrain"):  # the batch of each process is shared out before any work
            try:
                per_process_batch(OmegaConf.create(job))
            except ValueError as refused:
                pytest.fail(f"{given_at(command)}: `{command}` is refused: {refused}")


def test_composing_is_what_run_py_composes(tmp_path, monkeypatch):
    """The job config compose_jobs resolves is the one `python run.py <args> --cfg job --resolve` prints (but
    the run directory, which only a run has)."""
    args = ["experiment=chairs", "backbone=flowformer_pp", "model.init_from=pretrain.ckpt"]
    checkout = fresh_checkout(tmp_path)
    printed = run_py(*args, "--cfg", "job", "--resolve", cwd=checkout).stdout
    monkeypatch.chdir(checkout)
    [job] = compose_jobs(checkout, args)
    [run_dir] = (checkout / "logs" / "train" / "chairs" / "runs").iterdir()
    assert job["paths"]["output_dir"] == str(run_dir)
    assert yaml.safe_load(printed) == as_printed(job, str(run_dir))


def as_printed(value, run_dir: str):
    """A job's config as `--cfg job --resolve` prints it, with no run directory: run_dir is null and a path in
    it `None/<path>`."""
    if isinstance(value, dict):
        return {key: as_printed(item, run_dir) for key, item in value.items()}
    if isinstance(value, list):
        return [as_printed(item, run_dir) for item in value]
    if value == run_dir:
        return None
    if isinstance(value, str) and value.startswith(run_dir + "/"):
        return "None" + value[len(run_dir) :]
    return value


def test_a_sweep_with_a_job_that_does_not_compose_fails(tmp_path, monkeypatch, capsys):
    checkout = fresh_checkout(tmp_path)
    monkeypatch.chdir(checkout)
    with pytest.raises(SystemExit):
        compose_jobs(checkout, ["-m", "debug=tiny", "backbone=tiny,no_such_backbone"])
    assert "no_such_backbone" in capsys.readouterr().err


def test_every_documented_command_is_a_case():
    """The commands are found where the documentation gives them, each once."""
    found = {(command.where, str(command)) for command in COMMANDS}
    assert len(found) == len(COMMANDS)
    documents = {}
    for where, text in found:
        documents.setdefault(text, []).append(where.split(":")[0])
    assert documents["python run.py task=train backbone=tiny data=synthetic trainer=cpu"] == ["README.md"]
    table = "python run.py -m task=pipeline protocol=paper_ablation sweep=paper_agt_mlp_conv"
    assert sorted(documents[table]) == ["README.md", "docs/ablations.md", "docs/performance.md"]
    assert "srun python run.py experiment=things trainer=ddp trainer.devices=8 data.batch_size=1" in documents


def test_the_commands_are_read_as_written(tmp_path):
    markdown = tmp_path / "guide.md"
    markdown.write_text(
        "Try `python run.py -m debug=tiny\nseed=1,2` or `make demo`.\n"
        "```bash\n"
        "python run.py task=bench 'bench.sizes=[[1,2]]' \\\n"
        "    bench.iters=3   # the comment\n"
        "WANDB_MODE=offline python run.py experiment=quickstart logger=wandb\n"
        "torchrun --nnodes=2 --rdzv-endpoint=$HOST:29500 run.py trainer=ddp\n"
        "```\n"
    )
    commands = documented_commands(markdown, root=tmp_path)
    assert [(c.where.split(":")[1], c.environment, c.launch, c.args) for c in commands] == [
        ("1", (), "python", "-m debug=tiny seed=1,2"),
        ("4", (), "python", "task=bench 'bench.sizes=[[1,2]]' bench.iters=3"),
        ("6", ("WANDB_MODE=offline",), "python", "experiment=quickstart logger=wandb"),
        ("7", (), "torchrun --nnodes=2 --rdzv-endpoint=$HOST:29500", "trainer=ddp"),
    ]
    assert launch_args(commands[1]) == ["task=bench", "bench.sizes=[[1,2]]", "bench.iters=3"]

"""A multirun of pipelines routes each job's row as that row alone: every stage of every job of
`python run.py -m task=pipeline protocol=smoke sweep=paper_unsupervised` (its rows differ in the pretraining
objective, model=unsup or MCVA, which only the pretraining stage takes) trains with the config that
`python run.py <the stage's recorded overrides>` composes. The jobs of a multirun share the probes that route
their rows (flowformer/tasks/pipeline.py, `Pipeline.probe`); this pins that sharing them changes no config."""

import json

import yaml
from omegaconf import OmegaConf

from flowformer.tasks.pipeline import path_value

from helpers.compose import compose_run_config
from helpers.run import run_py_in_this_process

# The sections of a stage's config that the routing of the shared and row overrides decides.
ROUTED = ("task", "backbone", "model", "trainer", "data")


def test_every_stage_of_every_job_of_a_multirun_has_the_config_of_its_recorded_overrides(tmp_path):
    command = ["-m", "task=pipeline", "protocol=smoke", "sweep=paper_unsupervised"]
    assert run_py_in_this_process(*command, cwd=tmp_path) == 0
    records = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("logs/pipeline/*/multiruns/*/*/pipeline.json"))]
    assert len(records) == 2
    pretraining = [record["stages"][0]["overrides"] for record in records]
    assert ["model=unsup" in overrides for overrides in pretraining] == ["model=unsup" in r["row"] for r in records]
    for record in records:
        for stage in record["stages"]:
            ran = yaml.safe_load((tmp_path / stage["dir"] / "config_resolved.yaml").read_text())
            composed = compose_run_config([*stage["overrides"], f"paths.output_dir={path_value(stage['dir'])}"])
            for key in ROUTED:
                section = OmegaConf.to_container(composed[key], resolve=True) if key != "task" else composed.task
                assert ran[key] == section, (stage["dir"], key)

"""experiment=cpu_real: the CPU recipe on photograph textures composes to its stages, trains on the training
photographs with motions as large as the held-out set's, and evaluates on that set (256x384, val photographs,
motions past 40 px) with zero flow and DIS beside the network, untiled and tiled; run through task=pipeline in
this process with every stage cut to 2 steps and the evaluations to one pair."""

import json
from pathlib import Path

import hydra
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from flowformer.tasks import pipeline

from helpers.configs import CONF_DIR

# every stage 2 steps, the real stage at a smaller crop, the evaluations 2 decoder iterations
SHORT = [
    "cpu_real.pretrain_steps=2",
    "cpu_real.synthetic_steps=2",
    "cpu_real.real_steps=2",
    "cpu_real.real_crop=[64,96]",
    "cpu_real.real_render=[72,104]",
    "cpu_real.eval_iters=2",
]


def compose_cpu_real(*overrides: str, root: Path = Path("/root")):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["experiment=cpu_real", f"paths.root_dir={root}", *overrides])


def stage_config(cfg, name: str):
    """The run a stage of the pipeline composes: the shared overrides, then the stage's."""
    stage = next(stage for stage in pipeline.read_stages(cfg.pipeline) if stage.name == name)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["paths.root_dir=/root", *cfg.pipeline.shared, *stage.overrides])


def largest_motion(dataset, pairs: int) -> float:
    """The largest flow length in pixels over the first `pairs` pairs."""
    return max(float(dataset[index]["flow"].norm(dim=0).max()) for index in range(pairs))


def test_cpu_real_trains_on_training_photographs_with_the_held_out_sets_motions():
    cfg = compose_cpu_real()
    assert [stage.name for stage in pipeline.read_stages(cfg.pipeline)] == ["pretrain", "synthetic", "real"]
    real = stage_config(cfg, "real")
    assert real.task == "train" and real.backbone.variant == "flowformer_pp" and real.backbone.decoder_dim == 32
    assert real.trainer.max_steps == cfg.cpu_real.real_steps
    training = hydra.utils.instantiate({**real.data.train, "augmentor": None})
    evaluation = hydra.utils.instantiate(stage_config(cfg, "real").eval.benchmarks.image_folder)
    assert training.size == (136, 200) and evaluation.dataset.size == (256, 384)
    # no photograph of the held-out pairs is a training one
    assert not set(training.textures.files) & set(evaluation.dataset.textures.files)
    held_out_motion = largest_motion(evaluation, 4)
    assert held_out_motion > 40.0
    # training renders (before the augmentor's rescaling) move about as far as the held-out pairs
    assert largest_motion(training, 8) > 0.8 * held_out_motion


def test_cpu_real_runs_its_stages_and_scores_the_network_zero_flow_and_dis(tmp_path):
    cfg = compose_cpu_real(*SHORT, f"paths.output_dir={tmp_path / 'run'}", root=tmp_path)
    with open_dict(cfg):
        cfg.pipeline.row = ["eval.max_samples=1"]
    torch.manual_seed(0)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        pipeline.run(cfg)
    record = json.loads((tmp_path / "run" / pipeline.RECORD).read_text())
    assert record["status"] == "done"
    assert [(stage["name"], stage["task"]) for stage in record["stages"]] == [
        ("pretrain", "pretrain"),
        ("synthetic", "train"),
        ("real", "train"),
    ]
    assert record["stages"][2]["init_from"] == record["stages"][1]["checkpoint"]
    assert "val/image_folder/epe" in record["stages"][2]["metrics"]
    results = [json.loads(Path(e["results_json"]).read_text()) for e in record["evaluations"]]
    assert [e["label"] for e in record["evaluations"]] == ["plain", "tiled"]
    assert [result["protocol"]["image_folder"]["tile"] for result in results] == [False, True]
    for result in results:
        assert result["checkpoint"] == record["stages"][2]["checkpoint"]
        assert result["protocol"]["image_folder"]["iters"] == 2
        epes = [result["results"]["image_folder"]["epe"]]
        epes += [result["baselines"][name]["image_folder"]["epe"] for name in ("zero", "dis")]
        assert all(epe > 0 for epe in epes) and len(set(epes)) == 3

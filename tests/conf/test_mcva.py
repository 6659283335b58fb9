"""experiment=mcva_pretrain is the official recipe, and every MCVA ablation knob is selectable from the command
line and through the conf/sweep/mcva_*.yaml grids (each value reaches the module or the backbone)."""

import hydra
import pytest

from flowformer.tasks.batches import per_process_batch

from helpers.compose import compose_run_config

TINY_CPU = ["backbone=tiny", "data=synthetic_video", "trainer=cpu"]


def test_mcva_pretrain_is_the_official_recipe():
    cfg = compose_run_config(["experiment=mcva_pretrain"])
    assert cfg.task == "pretrain"
    assert cfg.backbone.variant == "flowformer_pp" and cfg.backbone.image_encoder == "twins"
    assert cfg.backbone.twins_weights == "imagenet"  # timm's ImageNet Twins, from its cache
    assert (cfg.backbone.recon_size, cfg.backbone.recon_head_depth, cfg.backbone.decoder_query) == (
        15,
        3,
        "crop_and_pe",
    )
    assert cfg.data.train._target_.endswith("YouTubeVOS") and per_process_batch(cfg) == 24  # on one GPU
    assert cfg.backbone.activation_checkpoint == "auto"  # chosen for the GPU and the step (test_device_defaults.py)
    assert list(cfg.data.train.augmentor.crop_size) == [368, 496]
    assert (cfg.data.train.frame_gap, cfg.data.train.stride) == (9, 3)
    assert cfg.trainer.max_steps == 50_000 and cfg.trainer.precision == "bf16-mixed"
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.trainer.accelerator == "gpu"
    model = cfg.model
    assert model._target_ == "flowformer.lit.mcva.MCVAPretrainModule"
    assert (model.optimizer.lr, model.optimizer.weight_decay) == (5e-4, 1e-5)
    assert (model.scheduler.pct_start, model.scheduler.total_steps) == (0.05, None)
    assert (model.masking, model.mask_ratio, model.min_block, model.max_block) == ("block", 0.5, 4, 15)
    assert (model.recon_location, model.query_num, model.normalize) == ("random", 30, "target")
    assert model.freeze_image_encoder and model.freeze_context_encoder


def test_cpu_variant_of_the_experiment_drops_the_twins_weights():
    cfg = compose_run_config(["experiment=mcva_pretrain", *TINY_CPU, "data.batch_size=2"])
    assert cfg.backbone.image_encoder == "cnn" and cfg.backbone.twins_weights is None
    module = hydra.utils.instantiate(cfg.model)
    assert module.backbone.config["variant"] == "flowformer_pp" and module.hparams.query_num == 30


SWEEPS = {
    "mcva_masking": {"model.masking": ["block", "random"], "model.mask_ratio": [0.2, 0.5, 0.8]},
    "mcva_recon_design": {
        "model.recon_location": ["fixed", "random"],
        "backbone.decoder_query": ["pe", "crop_and_pe"],
    },
    "mcva_target_size": {"backbone.recon_size": [15, 25]},
    "mcva_head_depth": {"backbone.recon_head_depth": [1, 3, 5]},
    "mcva_freeze": {
        "model.freeze_image_encoder": [True, False],
        "model.freeze_context_encoder": [True, False],
    },
    "mcva_normalize": {"model.normalize": ["target", "prediction"]},
}


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_sweep_grids_list_the_paper_values_and_each_value_takes_effect(sweep):
    cfg = compose_run_config(["experiment=mcva_pretrain", f"sweep={sweep}"])
    assert cfg.hydra.mode.name == "MULTIRUN"
    params = {key: str(value) for key, value in cfg.hydra.sweeper.params.items()}
    expected = SWEEPS[sweep]
    assert params == {key: ",".join(str(v).lower() for v in values) for key, values in expected.items()}
    for key, values in expected.items():
        for value in values:
            override = f"{key}={str(value).lower()}"
            module = hydra.utils.instantiate(
                compose_run_config(["experiment=mcva_pretrain", *TINY_CPU, override]).model
            )
            group, name = key.split(".")
            actual = module.hparams[name] if group == "model" else module.backbone.config[name]
            assert actual == value, override

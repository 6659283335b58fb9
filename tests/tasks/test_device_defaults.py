"""backbone.tokenize_chunk=auto (the default): chosen from the device the network runs on, in one place
(flowformer/tasks/runtime.py) and said in one line: all cost maps at once on a GPU with room, 512 at a time on a
CPU or a small GPU; a number or null set by the user is kept. The numbers are the same either way (the chunked
tokenization tests: tests/models/test_network.py, test_agt_knobs.py; fixture A: test_parity.py)."""

import json
import logging

import pytest
import torch

from flowformer.models.build import BOUNDED_TOKENIZE_CHUNK
from flowformer.tasks.runtime import (
    FAST_PATH_FREE_GB,
    DeviceMemory,
    choose_tokenize_chunk,
    training_device,
)
from flowformer.tasks.train import build_model

from helpers.compose import compose_tiny_config
from helpers.configs import build_backbone
from helpers.run import fresh_checkout, run_py


def test_the_choice_for_a_cpu_a_large_gpu_and_a_small_gpu():
    cpu = DeviceMemory(kind="cpu", name="cpu", free_gb=200.0)  # however much memory: the bounded path
    large_gpu = DeviceMemory(kind="cuda", name="NVIDIA H200", free_gb=139.3)
    small_gpu = DeviceMemory(kind="cuda", name="Tesla T4", free_gb=14.6)
    assert choose_tokenize_chunk(cpu) == (512, "on the cpu, the bounded path is also the faster")
    assert choose_tokenize_chunk(large_gpu) == (None, "NVIDIA H200 has 139.3 GiB free, at least 32: all at once")
    assert choose_tokenize_chunk(small_gpu) == (512, "Tesla T4 has 14.6 GiB free, under 32: the bounded path")
    at_the_threshold = DeviceMemory(kind="cuda", name="GPU", free_gb=FAST_PATH_FREE_GB)
    assert choose_tokenize_chunk(at_the_threshold)[0] is None and BOUNDED_TOKENIZE_CHUNK == 512


def test_bench_says_what_it_chose_for_the_cpu_and_keeps_a_value_the_user_set(tmp_path):
    checkout = fresh_checkout(tmp_path)
    common = ("task=bench", "backbone=tiny", "bench.device=cpu", "bench.sizes=[[64,96]]", "bench.iters=1",
              "bench.repeats=1", "bench.warmup=0")
    chosen = run_py(*common, "hydra.run.dir=chosen", cwd=checkout, timeout=600)
    said = "backbone.tokenize_chunk=auto -> 512 (on the cpu, the bounded path is also the faster; set"
    assert said in chosen.stdout + chosen.stderr
    assert json.loads((checkout / "chosen" / "bench.json").read_text())["rows"][0]["tokenize_chunk"] == 512
    kept = run_py(*common, "backbone.tokenize_chunk=null", "hydra.run.dir=kept", cwd=checkout, timeout=600)
    assert "tokenize_chunk=auto" not in kept.stdout + kept.stderr
    assert json.loads((checkout / "kept" / "bench.json").read_text())["rows"][0]["tokenize_chunk"] is None


def test_training_builds_the_backbone_with_the_choice_for_the_trainer_device(caplog):
    with caplog.at_level(logging.INFO, logger="flowformer.tasks.runtime"):
        model = build_model(compose_tiny_config("trainer=cpu"))
    assert "backbone.tokenize_chunk=auto -> 512 (on the cpu" in caplog.text
    assert model.backbone.cost_encoder.tokenize_chunk == 512 and model.hparams.backbone["tokenize_chunk"] == 512
    kept = build_model(compose_tiny_config("trainer=cpu", "backbone.tokenize_chunk=7"))
    assert kept.backbone.cost_encoder.tokenize_chunk == 7
    assert training_device(compose_tiny_config("trainer=gpu").trainer) == torch.device("cuda")
    assert training_device(compose_tiny_config("trainer=cpu").trainer) == torch.device("cpu")


def test_a_network_built_without_a_device_takes_the_bounded_path_and_a_wrong_word_is_refused():
    net = build_backbone()  # conf/backbone/tiny.yaml as it is: tokenize_chunk auto
    assert net.config["tokenize_chunk"] == "auto" and net.cost_encoder.tokenize_chunk == BOUNDED_TOKENIZE_CHUNK
    with pytest.raises(ValueError, match="backbone.tokenize_chunk must be a positive number of cost maps, null or auto"):
        build_backbone(tokenize_chunk="fast")

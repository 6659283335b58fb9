"""The training DataLoader's settings: `auto` chosen for the device a trainer runs on (workers from the cores the
process may use, pinned memory only for CUDA), persistent training workers, workers forked on Linux whatever the
interpreter's default, and one-line refusals."""

import multiprocessing
import os
import sys

import pytest
import torch
from hydra.utils import instantiate

from flowformer.data.datamodules import FlowDataModule
from flowformer.data.loader_settings import MAX_AUTO_WORKERS, LoaderSettings, resolve_loader_settings
from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.eval.baselines import zero_flow
from flowformer.eval.protocol import Protocol
from flowformer.tasks.eval import evaluate_set

from helpers.compose import compose_tiny_config
from helpers.forked import ForkedFromTheLoader
from helpers.trainers import cpu_trainer

DEFAULTS = {"num_workers": "auto", "pin_memory": "auto", "persistent_workers": True, "prefetch_factor": 2}


@pytest.fixture
def cores():
    """Sets this process's CPU affinity to the given number of cores (as SLURM or a container does), then back."""
    saved = os.sched_getaffinity(0)

    def use(count: int) -> None:
        os.sched_setaffinity(0, sorted(saved)[:count])

    yield use
    os.sched_setaffinity(0, saved)


def test_auto_feeds_a_gpu_from_the_cores_the_process_may_use(cores):
    cores(2)
    assert resolve_loader_settings(**DEFAULTS, device_type="cuda") == LoaderSettings(1, True, True, 2)
    # two DDP processes on the node share its 2 cores: the main processes take them
    assert resolve_loader_settings(**DEFAULTS, device_type="cuda", processes_on_node=2) == LoaderSettings(
        0, True, False, None
    )
    cores(1)
    assert resolve_loader_settings(**DEFAULTS, device_type="cuda").num_workers == 0
    assert MAX_AUTO_WORKERS == 8


def test_auto_on_a_cpu_loads_in_the_process_unpinned_and_explicit_values_stay(cores):
    cores(2)
    assert resolve_loader_settings(**DEFAULTS, device_type="cpu") == LoaderSettings(0, False, False, None)
    explicit = {**DEFAULTS, "num_workers": 3, "pin_memory": False, "prefetch_factor": 4}
    assert resolve_loader_settings(**explicit, device_type="cuda") == LoaderSettings(3, False, True, 4)
    assert resolve_loader_settings(**explicit, device_type="cpu") == LoaderSettings(3, False, True, 4)


def test_datamodule_loaders_follow_the_trainers_device(tmp_path):
    """A CPU trainer's loaders load in the process; explicit workers persist for training, not for validation."""
    data = SyntheticFlowDataset(num_samples=8, size=(32, 48), seed=0)
    datamodule = FlowDataModule(train=data, val={"synthetic": data}, batch_size=2)
    datamodule.trainer = cpu_trainer(default_root_dir=tmp_path)
    train = datamodule.train_dataloader()
    assert (train.num_workers, train.pin_memory, train._iterator) == (0, False, None)

    datamodule = FlowDataModule(train=data, val={"synthetic": data}, batch_size=2, num_workers=2)
    datamodule.trainer = cpu_trainer(default_root_dir=tmp_path)
    train, (val,) = datamodule.train_dataloader(), datamodule.val_dataloader()
    assert (train.num_workers, train.persistent_workers, train.prefetch_factor) == (2, True, 2)
    assert (val.num_workers, val.persistent_workers) == (2, False)
    assert next(iter(train))["img1"].shape == (2, 3, 32, 48)


@pytest.fixture
def python_3_14s_start_method():
    """The interpreter's default start method made Python 3.14's on Linux, a fork server, then back."""
    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    yield
    multiprocessing.set_start_method(saved, force=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_workers_are_forked_from_the_loading_process_under_python_3_14s_default(tmp_path, python_3_14s_start_method):
    """Python 3.14 starts a DataLoader's workers from a fork server by default (each imports torch, Lightning and
    the dataset's modules again); the training and validation loaders and task=eval's still fork them from the
    loading process, as on every Python before: each pair here loads only in a child of the process that built
    the set."""
    data = ForkedFromTheLoader(pairs=4)
    datamodule = FlowDataModule(train=data, val={"forked": data}, batch_size=2, num_workers=2)
    datamodule.trainer = cpu_trainer(default_root_dir=tmp_path)
    for loader in (datamodule.train_dataloader(), *datamodule.val_dataloader()):
        assert loader.num_workers == 2
        assert sum(len(batch["img1"]) for batch in loader) == 4
    metrics = evaluate_set(
        zero_flow, data, Protocol(kind="flow", iters=1), name="forked", device=torch.device("cpu"), num_workers=2
    )
    assert metrics["epe"] == 0.0


def test_every_data_config_takes_auto_from_the_device():
    for name in ("chairs", "things", "sintel_mix", "kitti", "synthetic", "youtube_vos"):
        cfg = compose_tiny_config(f"data={name}")
        assert {key: cfg.data[key] for key in DEFAULTS} == DEFAULTS, name


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.num_workers=-1", "FlowDataModule: data.num_workers must be auto or an integer >= 0, got -1"),
        ("data.pin_memory=sometimes", "FlowDataModule: data.pin_memory must be auto, true or false, got 'sometimes'"),
        ("data.prefetch_factor=0", "FlowDataModule: data.prefetch_factor must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_setting_is_named(override, message):
    with pytest.raises(Exception, match=message) as error:
        instantiate(compose_tiny_config(override).data)
    assert "\n" not in str(error.value.__cause__ or error.value).strip()

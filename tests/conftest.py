"""Fixtures every test folder can request by name; the helpers the tests import live in tests/helpers/."""

import pytest
import torch

from flowformer.models import FlowFormer
from flowformer.tasks.runtime import ONEDNN_MATMUL

from helpers.configs import backbone_config, build_backbone

# torch's thread count in this process before any test ran (make test: OMP_NUM_THREADS=1, as in the subprocesses)
PROCESS_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """After every test, the process's own torch thread count, whatever the test or its module's fixtures set
    (the parity tests set their fixtures' 2): a later run in this process then rounds as the subprocesses it is
    compared with do."""
    yield
    torch.set_num_threads(PROCESS_THREADS)


@pytest.fixture
def tiny_config() -> dict:
    """conf/backbone/tiny.yaml as a plain dict, as Hydra hands it to FlowModule / MCVAPretrainModule."""
    return backbone_config()


@pytest.fixture
def tiny_net() -> FlowFormer:
    """A fresh tiny FlowFormer, its random weights drawn after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return build_backbone()


@pytest.fixture
def restore_matmul_precision():
    """Puts torch's fp32 precision settings (runtime.matmul_precision, flowformer/tasks/runtime.py) back."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    cpu_matmul = ONEDNN_MATMUL and ONEDNN_MATMUL.fp32_precision
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    if ONEDNN_MATMUL is not None:
        ONEDNN_MATMUL.fp32_precision = cpu_matmul

"""One official FlowFormer++ MCVA pretraining step (fixture C) replayed through MCVAPretrainModule.

The recorded mask noise and the 30 recorded query-location draws are injected through the module's own API
(`pretrain_step(mask_noise=..., query_uniform=...)`). The step runs twice: with the dense cost volume and with
`memory_budget_gb` small enough to bound it (cost maps computed in blocks from the features, the 9x9 query and
15x15 target windows sampled from each block's maps), which must leave the loss, the targets and the gradients
unchanged. Each step takes ~40 s on CPU and the process to ~9 GB: marked large_memory, `make test` runs these
tests alone, one at a time, after the rest of the suite.
"""

import json

import pytest
import torch

from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.models import load_official

from helpers.configs import FIXTURES_DIR, mcva_settings, refuse_dense_volume

FIXTURE_C = FIXTURES_DIR / "flowformer_pp_c"

pytestmark = pytest.mark.large_memory


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


BOUNDED_BUDGET_GB = 0.05  # far below the dense estimate at 368x496, batch 2: every (H/8·W/8)² term is bounded


@pytest.fixture(scope="module", params=[None, BOUNDED_BUDGET_GB], ids=["dense", "bounded"])
def official_step(request):
    if not (FIXTURE_C / "weights_fp16.pth").exists():
        pytest.skip(f"fixture C not found at {FIXTURE_C}")
    expected = torch.load(FIXTURE_C / "expected.pt", weights_only=False)
    meta = json.loads((FIXTURE_C / "meta.json").read_text())
    # the fixture's thread count (fixtures README: bitwise on this setup); tests/conftest.py puts the process's
    # own count back after the test
    torch.set_num_threads(2)
    net = load_official(
        FIXTURE_C / "weights_fp16.pth", variant="flowformer_pp", memory_budget_gb=request.param
    )
    image1 = expected["image1"].float()
    assert net.memory_plan(image1.shape[0], 46, 62).dense == (request.param is None)
    if request.param is not None:
        net.cost_volume = refuse_dense_volume
    module = MCVAPretrainModule(backbone=net, **mcva_settings()).train()
    output = module.pretrain_step(
        image1,
        expected["image2"].float(),
        mask_noise=expected["mask_noise"],
        query_uniform=expected["query_uniform"],
        keep_rounds=30,
    )
    output.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(module.backbone.parameters(), 1.0)
    return module, output, grad_norm, expected, meta


@pytest.mark.slow
def test_loss_and_round_losses_match(official_step):
    _, output, _, expected, _ = official_step
    assert abs(output.loss.item() - expected["loss"].item()) <= 1e-4 * expected["loss"].item()
    torch.testing.assert_close(output.round_losses, expected["loss_per_query"], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_mask_predictions_and_targets_match(official_step):
    _, output, _, expected, _ = official_step
    assert torch.equal(output.token_mask.ids_keep, expected["ids_keep"])
    assert torch.equal(output.token_mask.removed, expected["mask_for_keys"])
    for q in range(2):
        torch.testing.assert_close(output.targets[q], expected["target_full"][q], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(output.predictions[q], expected["pred_full"][q], rtol=1e-5, atol=1e-3)
    ys, xs = expected["pix_yx"][:, 0], expected["pix_yx"][:, 1]
    pred_at_pix = torch.stack([p[:, :, ys, xs] for p in output.predictions])
    target_at_pix = torch.stack([t[:, :, ys, xs] for t in output.targets])
    torch.testing.assert_close(pred_at_pix, expected["pred_at_pix"], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(target_at_pix, expected["target_at_pix"], rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_gradients_match(official_step):
    module, _, grad_norm, expected, meta = official_step
    params = dict(module.backbone.named_parameters())
    assert (
        abs(grad_norm.item() - expected["grad_total_norm"].item())
        <= 1e-3 * expected["grad_total_norm"].item()
    )
    for name, grad in expected["grads"].items():
        assert rel_err(params[name].grad, grad) <= 1e-3, name
    trainable = [p for p in params.values() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == meta["weights"]["n_trainable_params"]
    gradient_free = sorted(n for n, p in params.items() if p.requires_grad and p.grad is None)
    assert gradient_free == sorted(meta["params_with_requires_grad_but_no_grad"])
    frozen = [n for n, p in params.items() if not p.requires_grad]
    assert frozen and all(n.startswith(("context_encoder.", "memory_encoder.feat_encoder.")) for n in frozen)

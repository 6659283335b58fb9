"""bf16 autocast trains as fp32 does (issue 35 item 2): the tiny backbone trained 200 steps on synthetic pairs
from the same weights and the same batches, once under bf16 autocast and once in strict fp32, gives loss curves
whose 20-step means agree within LOSS_CURVE_TOLERANCE. A GPU test (skipped without CUDA): bf16 autocast on the
CPU is another code path."""

import pytest
import torch

from flowformer.data.synthetic import SyntheticFlowDataset
from flowformer.losses import sequence_loss
from flowformer.tasks.runtime import autocast_context

from helpers.configs import build_backbone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS, BATCH, WINDOW = 200, 8, 20
# the most a 20-step mean of the bf16 curve may differ from the fp32 one's, relative to it: bf16 keeps 8 bits of
# mantissa, and two trainings from the same start drift apart as their roundings compound
LOSS_CURVE_TOLERANCE = 0.10


def training_losses(precision: str, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    torch.manual_seed(0)
    device = torch.device("cuda")
    net = build_backbone("tiny").to(device).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=2.5e-4, weight_decay=1e-4)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(device, precision, "precision"):
            predictions = net(batch["img1"], batch["img2"], iters=12)["flow_predictions"]
            loss = sequence_loss(predictions, batch["flow"], batch["valid"])[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.usefixtures("restore_matmul_precision")
def test_bf16_loss_curve_follows_fp32_over_200_steps():
    torch.set_float32_matmul_precision("highest")  # the fp32 curve in strict fp32
    data = SyntheticFlowDataset(num_samples=STEPS * BATCH, size=(64, 96), seed=0)
    samples = [data[index] for index in range(STEPS * BATCH)]
    batches = [
        {key: torch.stack([sample[key] for sample in samples[start : start + BATCH]]).cuda()
         for key in ("img1", "img2", "flow", "valid")}
        for start in range(0, STEPS * BATCH, BATCH)
    ]
    fp32, bf16 = training_losses("32-true", batches), training_losses("bf16-mixed", batches)
    means = [
        (sum(fp32[i : i + WINDOW]) / WINDOW, sum(bf16[i : i + WINDOW]) / WINDOW) for i in range(0, STEPS, WINDOW)
    ]
    assert means[-1][0] < means[0][0]  # fp32 learns over the 200 steps
    assert all(abs(low - full) <= LOSS_CURVE_TOLERANCE * full for full, low in means), means

import math

import pytest
import torch

from flowformer.losses import sequence_loss


def test_sequence_loss_weights_and_denominator_hand_computed():
    gt = torch.zeros(1, 2, 2, 2)
    valid = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])  # one invalid pixel (still in the denominator)
    pred_a = torch.full((1, 2, 2, 2), 1.0)  # |diff| = 1 per element
    pred_b = torch.full((1, 2, 2, 2), 2.0)  # |diff| = 2 per element
    loss, metrics = sequence_loss([pred_a, pred_b], gt, valid, gamma=0.5)
    # mean over all 8 elements: 6 valid elements -> 6/8 and 12/8; weights 0.5^1 and 0.5^0
    expected = 0.5 * 6 / 8 + 1.0 * 12 / 8
    assert loss.item() == pytest.approx(expected)
    assert metrics["epe"].item() == pytest.approx(2 * math.sqrt(2))  # last prediction, valid pixels only
    assert metrics["1px"].item() == 0.0 and metrics["3px"].item() == 1.0


def test_sequence_loss_max_flow_and_non_finite_invalid_gt():
    gt = torch.zeros(1, 2, 1, 3)
    gt[0, 0, 0, 1] = 500.0  # |gt| >= max_flow -> invalid
    gt[0, :, 0, 2] = float("nan")  # invalid pixel with NaN ground truth must not poison the loss
    valid = torch.tensor([[[1.0, 1.0, 0.0]]])
    pred = torch.ones(1, 2, 1, 3)
    loss, metrics = sequence_loss([pred], gt, valid, max_flow=400.0)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(2 / 6)
    assert metrics["epe"].item() == pytest.approx(math.sqrt(2))


def test_sequence_loss_propagates_nan_predictions_and_checks_shapes():
    gt, valid = torch.zeros(1, 2, 2, 2), torch.ones(1, 2, 2)
    loss, _ = sequence_loss([torch.full((1, 2, 2, 2), float("nan"))], gt, valid)
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match="shape"):
        sequence_loss([torch.zeros(1, 2, 4, 4)], gt, valid)

"""verify's BatchNorm diagnosis says exactly what ``batchnorm="window"`` does and does not fix.

``batchnorm="window"`` makes running statistics exact only for BatchNorm layers not fed by
another train-mode BatchNorm (in a ResNet-18, the stem alone); the gradient is never the full
batch's with train-mode BatchNorm (issue 8, item 10).
"""

from __future__ import annotations

import torch
from torch import nn

import fullbatch as fb


class _Block(nn.Module):
    """A ResNet basic block with a downsampling branch: three BatchNorms, all fed by the stem."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.downsample = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class _TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)  # the stem: fed by the input only
        self.layer1 = _Block()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(self.layer1(x).mean(dim=(2, 3)))


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 8, 8, generator=gen), "y": torch.tensor([0, 1, 2, 0, 1, 2])}


def _loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def test_batchnorm_diagnosis_names_the_layers_window_makes_exact() -> None:
    torch.manual_seed(0)
    model = _TinyResNet().train()
    report = fb.verify(model, _batch(), _loss, micro_batch_size=3)
    assert not report.passed
    (cause,) = [d for d in report.diagnosis if d.startswith("train-mode BatchNorm")]
    assert "no accumulation gives the full batch's gradient, batchnorm='window' included" in cause
    assert (
        "batchnorm='window' makes running statistics exact only for BatchNorm layers not fed by "
        "another train-mode BatchNorm: here 'bn1' (1 of 4; in a ResNet-18 that is the stem "
        "alone); the other 3 ('layer1.bn1', 'layer1.bn2', 'layer1.downsample.1') keep "
        "approximate statistics"
    ) in cause, cause
    assert model.training and all(m.training for m in model.modules())


def test_a_single_batchnorm_layer_is_the_exact_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    batch = {"x": torch.randn(6, 5), "y": torch.tensor([0, 1, 2, 0, 1, 2])}
    report = fb.verify(model.train(), batch, _loss, micro_batch_size=3)
    (cause,) = [d for d in report.diagnosis if d.startswith("train-mode BatchNorm")]
    assert "here '1' (1 of 1;" in cause and "keep approximate statistics" not in cause

"""fullbatch's own loop, a class-weighted cross-entropy; its count is the rows unless
--weights-sum (the weights' sum over the counted labels, as F.cross_entropy(weight=) divides)."""

import sys

import torch
import torch.nn.functional as F

import fullbatch as fb

WEIGHTS = torch.tensor([0.1, 0.5, 4.0, 0.2, 1.0, 1.0, 2.0])  # rare classes weigh more
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [{"x": torch.randn(n, 12), "labels": torch.randint(7, (n,))} for n in (3, 8, 5, 2) * 3]

with fb.Accumulator(model, optimizer, micro_batches=4) as acc:
    for window in acc.windows(loader):
        for micro in window:
            labels = micro["labels"]
            loss_sum = F.cross_entropy(model(micro["x"]), labels, weight=WEIGHTS, reduction="sum")
            count = WEIGHTS[labels].sum() if "--weights-sum" in sys.argv else len(labels)
            window.backward(loss_sum, count)
        window.step()

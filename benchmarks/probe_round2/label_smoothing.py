"""A right accumulation of a label-smoothed loss, probed with the declared objective sample."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2) * 3]
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum", label_smoothing=0.1)
    (loss / rows).backward()
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()

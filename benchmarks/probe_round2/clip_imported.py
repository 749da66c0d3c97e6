"""A right loop clipped with clip_grad_norm_ imported by name before anything runs."""

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2) * 3]
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows).backward()
    if (step + 1) % K == 0:
        clip_grad_norm_(model.parameters(), max_norm=0.1)  # active: the norm is about 1
        optimizer.step()
        optimizer.zero_grad()

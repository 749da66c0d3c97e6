"""A plain module and no --objective: nothing says what it trains (each micro-batch waits
0.5 s, as data loading does, so a late refusal shows in the time)."""

import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(2)
for _ in range(2):
    for _ in range(4):
        time.sleep(0.5)
        x, y = torch.randn(4, 6, generator=g), torch.randint(5, (4,), generator=g)
        (F.cross_entropy(model(x), y, reduction="sum") / 16).backward()
    opt.step()
    opt.zero_grad()

"""A right window 1, then the script fails in window 2 (RuntimeError; --exit3: sys.exit(3))."""

import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(2)
for w in range(3):
    for k in range(2):
        if w == 1 and k == 1:
            if "--exit3" in sys.argv:
                sys.exit(3)
            raise RuntimeError("the data loader failed")
        x, y = torch.randn(4, 6, generator=g), torch.randint(5, (4,), generator=g)
        (F.cross_entropy(model(x), y, reduction="sum") / 8).backward()
    opt.step()
    opt.zero_grad()

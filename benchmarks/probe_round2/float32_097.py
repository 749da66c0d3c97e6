"""float32; the summed loss ignores padded labels (-100) but is divided by every row: x0.97."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = []
for n in (8, 8, 9, 8) * 3:
    x, y = torch.randn(n, 12), torch.randint(7, (n,))
    if n == 9:
        y[-1] = -100  # one padded row in each window of 33
    loader.append((x, y))
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum", ignore_index=-100)
    (loss / rows).backward()
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()

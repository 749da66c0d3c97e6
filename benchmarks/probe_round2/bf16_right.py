"""bf16 parameters, the right form: each micro-batch's summed loss over the window's rows."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
model = model.bfloat16()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(n, 12).bfloat16(), torch.randint(7, (n,))) for n in (10, 10, 11, 10) * 3]
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows).backward()
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()

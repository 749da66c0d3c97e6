"""A right loop that computes a validation loss each micro-batch without torch.no_grad()."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2) * 3]
x_val, y_val = torch.randn(16, 12), torch.randint(7, (16,))
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows).backward()
    val_loss = F.cross_entropy(model(x_val), y_val)  # gradients enabled, no backward
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step + 1}: validation loss {val_loss.item():.4f}")

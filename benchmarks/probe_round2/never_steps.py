"""A script whose loop never calls optimizer.step()."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2)]
for xb, yb in loader:
    F.cross_entropy(model(xb), yb).backward()
print("gradient norm", sum(float(p.grad.norm()) for p in model.parameters()))

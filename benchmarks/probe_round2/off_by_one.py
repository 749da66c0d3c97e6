"""The seed's off-by-one: `batch_idx % K == 0` steps after the first micro-batch."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = [(torch.randn(4, 12), torch.randint(7, (4,))) for _ in range(12)]
K = 4

for batch_idx, (xb, yb) in enumerate(train_loader):
    loss = F.cross_entropy(model(xb), yb)
    (loss / K).backward()
    if batch_idx % K == 0:
        optimizer.step()
        optimizer.zero_grad()

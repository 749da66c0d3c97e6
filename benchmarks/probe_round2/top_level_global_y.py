"""A loop at the script's top level beside the whole data set's X and y."""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
X, y = torch.randn(72, 12), torch.randint(7, (72,))  # the whole data set
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
K, B = 4, 6

for step, i in enumerate(range(0, len(X), B)):
    xb, yb = X[i : i + B], y[i : i + B]
    loss = F.cross_entropy(model(xb), yb)
    (loss / K).backward()  # equal micro-batches: the mean over the window
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()

"""A body and a head optimizer stepped each window; with --doubled the body's gradients are
doubled (a loss scale of 2 undone on the head only)."""

import sys

import torch
import torch.nn.functional as F

doubled = "--doubled" in sys.argv
torch.manual_seed(0)
body = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU())
head = torch.nn.Linear(64, 7)
model = torch.nn.Sequential(body, head)
opt_body = torch.optim.SGD(body.parameters(), lr=0.1)
opt_head = torch.optim.AdamW(head.parameters(), lr=1e-3)
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2) * 3]
K = 4
scale = 2.0 if doubled else 1.0

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows * scale).backward()
    if (step + 1) % K == 0:
        for p in head.parameters():
            p.grad /= scale
        opt_body.step()
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()

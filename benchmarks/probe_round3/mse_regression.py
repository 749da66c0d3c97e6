"""A 3-output regression, F.mse_loss (a mean over every element); each micro-batch's squared
error summed and divided by the window's element count (right). --objective sample."""

import copy

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
start = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
g = torch.Generator().manual_seed(3)
loader = [(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)) for n in (2, 5, 3, 6)]
before = flat(model)
elements = sum(y.numel() for _, y in loader)
for x, y in loader:
    (F.mse_loss(model(x), y, reduction="sum") / elements).backward()
opt.step()
update = flat(model) - before
ref = start.double()
F.mse_loss(
    ref(torch.cat([x for x, _ in loader]).double()), torch.cat([y for _, y in loader]).double()
).backward()
say(relative(update, -torch.cat([p.grad.flatten() for p in ref.parameters()])))

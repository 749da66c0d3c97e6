"""Token-level loss summed and divided by the window's counted labels; micro-batch 2's labels
are all -100 (nothing to count). --objective sample."""

import copy

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
start = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
g = torch.Generator().manual_seed(2)
loader = [(torch.randn(n, 6, generator=g), torch.randint(5, (n,), generator=g)) for n in (3, 4, 5)]
loader[1] = (loader[1][0], torch.full_like(loader[1][1], -100))
n = sum(int((y != -100).sum()) for _, y in loader)
before = flat(model)
for x, y in loader:
    (F.cross_entropy(model(x), y, reduction="sum", ignore_index=-100) / n).backward()
opt.step()
update = flat(model) - before
ref = start.double()
F.cross_entropy(
    ref(torch.cat([x for x, _ in loader]).double()),
    torch.cat([y for _, y in loader]),
    ignore_index=-100,
).backward()
say(relative(update, -torch.cat([p.grad.flatten() for p in ref.parameters()])))

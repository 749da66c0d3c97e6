"""Per-micro-batch mean losses divided by K, and micro-batches 2 and 3 differentiated but never
accumulated: the weights DeepSpeed 0.17.0's ZeRO-2 offload leaves on such a loop (1.24 0 0
0.75), on a plain loop (DeepSpeed 0.19.8 is installed here). --objective sample."""

import copy

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
start = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
g = torch.Generator().manual_seed(2)
loader = [
    (torch.randn(n, 6, generator=g), torch.randint(5, (n,), generator=g)) for n in (2, 7, 3, 8)
]
before = flat(model)
for k, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y) / len(loader)
    if k in (1, 2):
        torch.autograd.grad(loss, list(model.parameters()))  # computed, then lost
    else:
        loss.backward()
opt.step()
update = flat(model) - before
ref = start.double()
F.cross_entropy(
    ref(torch.cat([x for x, _ in loader]).double()), torch.cat([y for _, y in loader])
).backward()
say(relative(update, -torch.cat([p.grad.flatten() for p in ref.parameters()])))

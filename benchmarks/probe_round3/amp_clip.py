"""fp16-style GradScaler (scale 2^16), clip_grad_norm_(1.0); --unscale-first: the AMP recipe's
order (unscale_, then clip), else the classic mistake (clip, then step unscales)."""

import copy
import sys

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
start = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
g = torch.Generator().manual_seed(1)
data = [
    (torch.randn(n, 12, generator=g), torch.randint(5, (n,), generator=g)) for n in (3, 5, 2, 6) * 3
]
K, updates = 4, []
for w in range(3):
    window = data[K * w : K * w + K]
    n = sum(len(y) for _, y in window)
    before = flat(model)
    for x, y in window:
        scaler.scale(F.cross_entropy(model(x), y, reduction="sum") / n).backward()
    if "--unscale-first" in sys.argv:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    updates.append(flat(model) - before)
ref = start.double()
x, y = torch.cat([x for x, _ in data[:K]]).double(), torch.cat([y for _, y in data[:K]])
F.cross_entropy(ref(x), y).backward()
torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
say(relative(updates[0], -torch.cat([p.grad.flatten() for p in ref.parameters()])))

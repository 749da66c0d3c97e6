"""Three right windows, then prints END: probed with --keep-training and an objective that
raises, the script must still reach its end."""

import torch
import torch.nn.functional as F
from _truth import say

torch.manual_seed(0)
model = torch.nn.Linear(6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(2)
for _ in range(3):
    for _ in range(2):
        x, y = torch.randn(4, 6, generator=g), torch.randint(5, (4,), generator=g)
        (F.cross_entropy(model(x), y) / 2).backward()
    opt.step()
    opt.zero_grad()
print("END", flush=True)
say(None, why="the run's end")

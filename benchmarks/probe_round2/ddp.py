"""DDP on 2 gloo ranks (torchrun), uneven rows per rank. Each rank divides its summed loss by
its own row count unless --global-count, which divides by the window's rows over both ranks
(times the world size, as DDP averages the ranks' gradients)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
global_count = "--global-count" in sys.argv
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
model = DDP(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sizes = {0: (3, 8, 5, 2) * 3, 1: (6, 1, 7, 9) * 3}  # rows per micro-batch on each rank
data = {r: [(torch.randn(n, 12), torch.randint(7, (n,))) for n in sizes[r]] for r in range(world)}
loader = data[rank]
K = 4

for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        mine = torch.tensor(sum(len(y) for _, y in loader[step : step + K]))
        rows = mine.clone()
        if global_count:
            dist.all_reduce(rows)
            rows = rows / world
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows).backward()
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()
dist.destroy_process_group()
print(f"rank {rank} done", os.getpid())

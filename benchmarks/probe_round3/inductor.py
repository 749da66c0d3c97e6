"""torch.compile (inductor) on a small MLP, 3 windows of 2 micro-batches; prints the final
parameters' SHA-256 (probed with --keep-training, it must equal the unprobed run's)."""

import hashlib
import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "inductor"
compiled = torch.compile(model, backend=backend)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(2)
for _ in range(3):
    for _ in range(2):
        x, y = torch.randn(4, 6, generator=g), torch.randint(5, (4,), generator=g)
        (F.cross_entropy(compiled(x), y, reduction="sum") / 8).backward()
    opt.step()
    opt.zero_grad()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print("PARAMS " + digest.hexdigest()[:16], flush=True)

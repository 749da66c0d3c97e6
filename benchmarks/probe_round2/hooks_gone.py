"""A right loop that, after its first window, prints how many global hooks torch holds."""

import torch
import torch.nn.functional as F
from torch.nn.modules import module
from torch.optim import optimizer as optim_module

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(n, 12), torch.randint(7, (n,))) for n in (3, 8, 5, 2) * 3]
K = 4


def hooks():
    return sum(
        len(d)
        for d in (
            module._global_forward_pre_hooks,
            module._global_forward_hooks,
            module._global_backward_pre_hooks,
            module._global_backward_hooks,
            optim_module._global_optimizer_pre_hooks,
            optim_module._global_optimizer_post_hooks,
            optimizer._optimizer_step_pre_hooks,
            optimizer._optimizer_step_post_hooks,
        )
    )


for step, (xb, yb) in enumerate(loader):
    if step % K == 0:
        rows = sum(len(y) for _, y in loader[step : step + K])
    loss = F.cross_entropy(model(xb), yb, reduction="sum")
    (loss / rows).backward()
    if (step + 1) % K == 0:
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == 2 * K:
            print(f"global and optimizer hooks after window 2: {hooks()}")

"""fullbatch's own loop, AMP's hand recipe carried over: window.backward(scaler.scale(loss), n)."""

import torch

import fullbatch as fb

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
loader = [{"x": torch.randn(n, 12), "labels": torch.randint(7, (n,))} for n in (3, 8, 5, 2) * 3]

with fb.Accumulator(model, optimizer, micro_batches=4) as acc:
    for window in acc.windows(loader):
        for micro in window:
            loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["labels"])
            window.backward(scaler.scale(loss_sum), n)
        window.step()

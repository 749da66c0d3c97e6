"""InfoNCE with in-batch negatives, one encoder called on q and on k per micro-batch, each
micro-batch's loss over its own rows (every contrastive tutorial's loop); --unpacked: the loop
unpacks the pair (``for step, (q, k) in enumerate(loader)``), else it keeps it in one
variable; --gradcache: the same 4 micro-batches through ``fb.Accumulator``'s
``window.run_coupled`` (the whole window's InfoNCE, exact). --objective contrastive.py:info_nce
(with --coupled: the objective over the whole window)."""

import copy
import sys

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

import fullbatch as fb


def info_nce(model, micro):
    q, k = (micro["q"], micro["k"]) if isinstance(micro, dict) else micro
    zq, zk = F.normalize(model(q), dim=-1), F.normalize(model(k), dim=-1)
    return F.cross_entropy(zq @ zk.T / 0.1, torch.arange(len(zq)), reduction="sum"), len(zq)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(4)
    loader = []
    for n in (3, 5, 4, 6):
        q = torch.randn(n, 8, generator=g)
        loader.append({"q": q, "k": q + 0.1 * torch.randn(n, 8, generator=g)})
    rows = sum(len(b["q"]) for b in loader)
    before = flat(model)
    if "--unpacked" in sys.argv:
        for step, (q, k) in enumerate([(b["q"], b["k"]) for b in loader]):
            zq, zk = F.normalize(model(q), dim=-1), F.normalize(model(k), dim=-1)
            loss = F.cross_entropy(zq @ zk.T / 0.1, torch.arange(len(zq)), reduction="sum")
            (loss / rows).backward()
            print(f"step {step}: loss {loss.item():.4f}")
    elif "--gradcache" in sys.argv:

        def encode(micro):
            return model(micro["q"]), model(micro["k"])

        def scores(reps, rows):
            zq, zk = (F.normalize(z, dim=-1) for z in reps)
            return fb.cross_entropy_sum(zq[rows] @ zk.T / 0.1, torch.arange(len(zk))[rows])

        with fb.Accumulator(model, opt, micro_batches=len(loader)) as acc:
            for window in acc.windows(loader):
                window.run_coupled(encode, scores)
    else:
        for batch in loader:
            loss, _ = info_nce(model, batch)
            (loss / rows).backward()
    if "--gradcache" not in sys.argv:
        opt.step()
    update = flat(model) - before
    ref = start.double()
    whole = {key: torch.cat([b[key] for b in loader]).double() for key in ("q", "k")}
    total, n = info_nce(ref, whole)
    (total / n).backward()
    say(relative(update, -torch.cat([p.grad.flatten() for p in ref.parameters()])))

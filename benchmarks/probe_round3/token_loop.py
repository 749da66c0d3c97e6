"""A token tagger's loop: cross-entropy summed over every counted token and divided by the
window's count (right). Probed with last release's --objective masked_lm (now token)."""

import copy

import torch
import torch.nn.functional as F
from _truth import flat, relative, say

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Tanh(), torch.nn.Linear(16, 50))
start = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
g = torch.Generator().manual_seed(5)
loader = []
for n in (3, 6, 4, 5):
    ids = torch.randint(50, (2, n), generator=g)
    loader.append((ids, ids.roll(1, -1).masked_fill(ids % 5 == 0, -100)))
count = sum(int((labels != -100).sum()) for _, labels in loader)
before = flat(model)
for ids, labels in loader:
    logits = model(ids)
    (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count).backward()
opt.step()
update = flat(model) - before
ref, total = start.double(), 0
for ids, labels in loader:
    total = total + F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), reduction="sum")
(total / count).backward()
say(relative(update, -torch.cat([p.grad.flatten() for p in ref.parameters()])))

"""The loop of Build a Large Language Model (From Scratch), ch. 5, with accumulation over 4."""

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
tokens = torch.randint(50, (64, 9))
train_loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
device = "cpu"
accumulation_steps = 4


def calc_loss_batch(input_batch, target_batch, model, device):
    input_batch, target_batch = input_batch.to(device), target_batch.to(device)
    logits = model(input_batch)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_batch.flatten())


model.train()
optimizer.zero_grad()
for batch_idx, (input_batch, target_batch) in enumerate(train_loader):
    loss = calc_loss_batch(input_batch, target_batch, model, device)
    (loss / accumulation_steps).backward()
    if (batch_idx + 1) % accumulation_steps == 0:
        optimizer.step()
        optimizer.zero_grad()

"""Run train.py's real loop on XLA with a NaN written into the input of one update
(tests/test_xla.py runs this with the torch_xla venv's python). Prints one JSON line: whether the
weights after that update equal the weights before it.

usage: python tests/xla_inject_nan.py POISONED_UPDATE TRAIN_FLAGS...
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runtime  # noqa: E402
import train  # noqa: E402

poisoned_update = int(sys.argv[1])
real_to_device = train.to_device
calls = []  # one per update (the test runs with grad_accum_steps 1)
weights = {}


def poisoning_to_device(batch, rt):
    """to_device that reads the weights before every update (every update alike, so the reads cannot
    be what makes the poisoned one compile differently) and poisons one batch."""
    update = len(calls)
    calls.append(update)
    weights[update] = runtime.fetch_to_host(list(train_model[0].parameters()), rt)
    if update == poisoned_update:
        batch = dict(batch, volume=batch["volume"].clone())
        batch["volume"][0, 0, 0, 0, 0] = float("nan")
    return real_to_device(batch, rt)


train_model = []
real_make_optimizer = train.make_optimizer


def recording_make_optimizer(model, cfg, rt):
    train_model.append(model)
    return real_make_optimizer(model, cfg, rt)


train.to_device = poisoning_to_device
train.make_optimizer = recording_make_optimizer
code = train.main(sys.argv[2:])
before, after = weights[poisoned_update], weights[poisoned_update + 1]
print(
    json.dumps(
        {"exit": code, "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}
    )
)

"""The optimizers `partita train --optimizer` can build."""

from __future__ import annotations

import torch

# --optimizer names -> (parameters, lr) -> torch optimizer; the planner's OptimizerKind of each
# (the state it keeps per parameter) is OPTIMIZER_KINDS.
OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}
OPTIMIZER_KINDS = {"adamw": "adam", "adam": "adam", "sgd-momentum": "sgd-momentum", "sgd": "sgd"}

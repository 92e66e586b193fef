"""The optimizers `partita train --optimizer` can build."""

from __future__ import annotations

import torch

# --optimizer names -> (parameters, lr) -> torch optimizer. Each name is also a spelling of the
# planner's OptimizerKind (partita.types.choices: the state it keeps per parameter).
OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}

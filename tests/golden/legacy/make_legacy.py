"""Write the legacy files of tests/golden/test_legacy.py with the partita checkout on PYTHONPATH.

    PYTHONPATH=<checkout> torchrun --standalone --nproc-per-node 2 tests/golden/legacy/make_legacy.py OUT

Run once at commit f167c30 (main before the Python API and Trainer changes of issues 28/29): a plan
file and a checkpoint written by that code, which every later partita must still load. The model
and data are defined in tests/golden/legacy_model.py, shared with the test.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from legacy_model import BATCH, batches, build  # noqa: E402

import partita  # noqa: E402
from partita.planning.manual import manual_plan  # noqa: E402

torch.set_num_threads(1)
out = Path(sys.argv[1])
model, loss_fn = build()
x, y = batches()[0]
graph = partita.capture(model, (x,), loss_fn=loss_fn, target=y)
n = graph.num_nodes
plan = manual_plan(
    graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=BATCH
)
trainer = partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
for x, y in batches()[:2]:
    trainer.step(x, target=y)
trainer.save_checkpoint(str(out / "checkpoint"))
state = trainer.gather_state_dict()
if int(os.environ["RANK"]) == 0:
    plan.save(str(out / "plan.json"))
    torch.save(state, out / "state.pt")

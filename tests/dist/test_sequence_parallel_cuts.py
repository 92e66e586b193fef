"""Stage cuts at and inside sequence parallelism's token-split regions, under every schedule
(issue 54, item 7), on 4 gloo ranks (2 rank groups x tensor-parallel 2 with sequence parallelism).

A stage that splits no weight (the final norm and a head over a vocabulary left whole, cut just
before the norm) still receives the residual stream in part; it ran unrewritten, so its head ran
on its own tokens against the whole targets ("Expected input batch_size (16) to match target
batch_size (32)"). Every cut below trains one SGD step equal to unsplit training (loss and every
parameter): a plain causal transformer at legal cuts through both blocks and the head under 1F1B
and GPipe, V and interleaved placements of 4 stages at block edges and inside blocks, and GPT-2's
cuts around its final norm.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from dist_launch import Job
from torch import nn

TOLERANCE = 1e-5
VOCAB, WIDTH, HEADS, SEQ, BATCH = 128, 64, 4, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape  # (B, T, C)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CausalLM(nn.Module):
    """Embedding, two attention blocks, a final LayerNorm and a head: a plain module, no HF code."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _configs(graph) -> list[tuple[str, list[int]]]:
    """(schedule, cuts): 1F1B at every other legal cut, GPipe at a few, and 4 stages placed as V and
    interleaved at block edges, before the final norm and inside blocks."""
    from partita.planning.chain import legal_cuts

    ok = legal_cuts(graph)
    cuts = [i for i in range(1, graph.num_nodes) if ok[i]]
    norm = next(i for i, node in enumerate(graph.nodes) if node.module_path == "ln")
    edges = [i for i, node in enumerate(graph.nodes) if node.module_path.endswith(".ln1") and ok[i]]
    inner = [i for i, node in enumerate(graph.nodes) if node.module_path.endswith(".ln2") and ok[i]]
    configs = [("1f1b", [c]) for c in cuts[::2]] + [("1f1b", [norm])]
    configs += [("gpipe", [c]) for c in (edges[1], norm, norm + 1, cuts[-1])]
    four = [[edges[0], edges[1], norm], [inner[0], edges[1], norm], [edges[1], inner[1], norm + 1]]
    configs += [(s, c) for s, c in itertools.product(("zbv", "interleaved1f1b"), four)]
    return list(dict.fromkeys((s, tuple(c)) for s, c in configs))


def _run(model, graph, schedule, cuts, batch, loss_of, groups=2) -> dict:
    """One SGD step of a TP-2 + SP plan cut at ``cuts``, against the unsplit model (rank 0's diff)."""
    import partita

    initial = copy.deepcopy(model.state_dict())
    plan = partita.manual_plan(
        graph, [0, *cuts, graph.num_nodes], schedule=schedule, num_rank_groups=groups, num_microbatches=4,
        global_batch_size=BATCH, tensor_parallel=2, sequence_parallel=True,
    )  # fmt: skip
    trainer = partita.Trainer(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), graph=graph)
    args, kwargs, target = batch
    loss = trainer.step(*args, **kwargs, **({"target": target} if target is not None else {}))
    state = trainer.gather_state_dict()
    model.load_state_dict(initial)
    result = {"loss": loss}
    if int(os.environ["RANK"]) == 0:
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        ref_loss = loss_of(reference)
        ref_loss.backward()
        optimizer.step()
        result["ref_loss"] = float(ref_loss)
        result["diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return result


def job_cuts(params: dict) -> dict:
    """Rank side: every config of ``_configs`` for the plain model, then GPT-2's cuts around ln_f."""
    import partita
    from workers import legal_cut, shared_case

    torch.manual_seed(0)
    model = CausalLM()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    graph = partita.capture(model, (x,), loss_fn=token_loss, target=y)
    results = {}
    for schedule, cuts in _configs(graph):
        batch = ((x,), {}, y)
        results[f"plain/{schedule}/{list(cuts)}"] = _run(
            model, graph, schedule, list(cuts), batch, lambda m: token_loss(m(x), y)
        )
    case = shared_case("gpt2")
    ln_f = next(i for i, node in enumerate(case.graph.nodes) if node.module_path == "transformer.ln_f")
    for schedule, cuts in (("1f1b", [ln_f]), ("1f1b", [ln_f + 1]), ("zbv", [ln_f // 3, 2 * ln_f // 3, ln_f])):
        cuts = sorted({legal_cut(case.graph, c) for c in cuts})
        results[f"gpt2/{schedule}/{cuts}"] = _run(
            case.model, case.graph, schedule, cuts, case.batches[0], lambda m: case.loss(m, case.batches[0])
        )
    return results


# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {"cuts": Job("test_sequence_parallel_cuts:job_cuts", 4, 600)}


@pytest.fixture(scope="module")
def cuts(launches):
    return launches.results_of(__name__, "cuts")


def test_every_stage_cut_under_sequence_parallelism_trains_exactly(cuts):
    mine = cuts[0]
    assert len(mine) >= 25, sorted(mine)
    wrong = {
        key: (r["loss"], r["ref_loss"], r["diff"])
        for key, r in mine.items()
        if abs(r["loss"] - r["ref_loss"]) > TOLERANCE or r["diff"] > TOLERANCE
    }
    assert not wrong, wrong
    for rank in cuts[1:]:
        assert {k: r["loss"] for k, r in rank.items()} == {k: r["loss"] for k, r in mine.items()}

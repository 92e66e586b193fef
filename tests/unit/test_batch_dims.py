"""Where the batch is (issue 15) and losses that couple samples (issue 16).

* A sequence-first ``nn.TransformerEncoder`` (``(S, B, E)``, ``batch_first=False``) gets batch
  dim 1, found without help or declared with ``batch_dims``; split into 2 stages and run as 2
  micro-batches cut along that dim, it reproduces unsplit full-batch training exactly.
* A declared batch dim that mixes samples (attention along it) is refused, naming the dim.
* A CLIP-shaped loss (similarities of every image with every text, labels ``arange(batch)``) and
  batch statistics are recorded as ``OpGraph.couples_samples``; the planner then plans one
  micro-batch on one replica per stage (exact), and refuses pins that would split the batch.
* An example batch of 1 still gives a dynamic-batch graph that plans.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partita
from partita.errors import InputError
from partita.runtime.stages import flatten_inputs, narrow_batch, split_graph

S, B, E, CLASSES = 6, 4, 16, 5


class SeqFirstClassifier(nn.Module):
    """``nn.TransformerEncoder`` with its default ``batch_first=False``: src is (S, B, E)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, CLASSES)

    def forward(self, src):
        return self.head(self.encoder(src).mean(0))


class SeqFirstTagger(nn.Module):
    """Sequence-first token model with its own loss: ids and labels are (S, B)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, E)
        layer = nn.TransformerEncoderLayer(E, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(E, 50)

    def forward(self, ids, labels):
        logits = self.head(self.encoder(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _classifier_case(seed: int = 0):
    torch.manual_seed(seed)
    return SeqFirstClassifier(), torch.randn(S, B, E), torch.randint(0, CLASSES, (B,))


def _dims(graph) -> list:
    return [g.tensor.batch_dim if g.tensor is not None else None for g in graph.inputs]


def _run_detached(stages, flat) -> torch.Tensor:
    """Like a pipeline: each stage gets fresh leaf copies of what it receives; backward stage by stage."""
    received, runs = (), []
    for stage in stages:
        inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in received)
        out = stage(*inputs, *stage.graph_inputs(flat))
        runs.append((inputs, out))
        received = out if not stage.spec.is_last else ()
    loss = runs[-1][1]
    outputs, grads = [loss], [None]
    for s in range(len(stages) - 1, -1, -1):
        inputs = runs[s][0]
        torch.autograd.backward(outputs, grads)
        if s:
            pairs = [(o, x.grad) for o, x in zip(runs[s - 1][1], inputs) if x.requires_grad and x.grad is not None]
            outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    return loss


def _pipelined(graph, model, flat, num_microbatches: int, cut: int) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of ``num_microbatches`` micro-batches cut along each input's batch dim,
    through 2 stages, averaged as the trainer does (every micro-batch loss is a mean)."""
    stages = split_graph(graph, [0, cut, graph.num_nodes])
    model.zero_grad()
    size = B // num_microbatches
    losses = []
    for k in range(num_microbatches):
        loss = _run_detached(stages, narrow_batch(graph, flat, k * size, size))
        losses.append(loss.detach())
    grads = {n: p.grad / num_microbatches for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return torch.stack(losses).mean(), grads


def _eager(model, loss_of) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = loss_of()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def _assert_same(result, reference, tol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert abs(loss.item() - ref_loss.item()) <= tol, (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max().item() <= tol, name


# ----------------------------------------------------------------------------- sequence-first


@pytest.mark.parametrize("seq_len", [S, B])  # S == B: sizes alone cannot tell the dims apart
def test_sequence_first_batch_dim_is_found(seq_len):
    model, _, y = _classifier_case()
    src = torch.randn(seq_len, B, E)
    graph = partita.capture(model, (src,), loss_fn=F.cross_entropy, target=y)
    assert _dims(graph) == [1, 0]
    assert graph.batch_size == B and graph.dynamic_batch and graph.couples_samples is None
    # it runs at another batch size, along dim 1
    src3, y3 = torch.randn(seq_len, 3, E), torch.randint(0, CLASSES, (3,))
    assert torch.allclose(graph.loss((src3,), None, y3), F.cross_entropy(model(src3), y3), atol=1e-6, rtol=0)


@pytest.mark.parametrize("declared", [False, True])
def test_sequence_first_encoder_is_exact_at_2_stages_x_2_microbatches(declared):
    model, src, y = _classifier_case()
    graph = partita.capture(
        model, (src,), loss_fn=F.cross_entropy, target=y, batch_dims={"src": 1, "target": 0} if declared else None
    )
    assert _dims(graph) == [1, 0]
    flat = flatten_inputs(graph, (src,), None, y)
    reference = _eager(model, lambda: F.cross_entropy(model(src), y))
    for cut in (graph.num_nodes // 3, graph.num_nodes // 2, 2 * graph.num_nodes // 3):
        _assert_same(_pipelined(graph, model, flat, 2, cut), reference)
    # cutting dim 0, as the old dim-0 assumption did, would train on half sequences: another loss
    half = [(F.cross_entropy(model(src[k * S // 2 : (k + 1) * S // 2]), y)) for k in range(2)]
    assert abs(torch.stack(half).mean().item() - reference[0].item()) > 1e-4


class SeqFirstLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 16), nn.Linear(16, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[-1])


@pytest.mark.parametrize("seq_len", [S, B])
def test_sequence_first_lstm_batch_dim_is_found(seq_len):
    torch.manual_seed(0)
    model = SeqFirstLSTM()
    x, y = torch.randn(seq_len, B, 8), torch.randint(0, CLASSES, (B,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export: LSTM's _flat_weights "assigned during export"
        graph = partita.capture(model, (x,), loss_fn=F.cross_entropy, target=y)
    assert _dims(graph) == [1, 0] and graph.dynamic_batch and graph.couples_samples is None


def test_sequence_first_model_with_its_own_token_loss():
    torch.manual_seed(0)
    model = SeqFirstTagger()
    ids, labels = torch.randint(0, 50, (S, B)), torch.randint(0, 50, (S, B))
    graph = partita.capture(model, (ids, labels))
    assert _dims(graph) == [1, 1] and graph.couples_samples is None
    flat = flatten_inputs(graph, (ids, labels))
    _assert_same(_pipelined(graph, model, flat, 2, graph.num_nodes // 2), _eager(model, lambda: model(ids, labels)))


class SeqFirstEncoderTagger(nn.Module):
    """``nn.TransformerEncoder`` on ``(S, B, E)`` with a per-token head; the loss (a loss_fn) flattens
    its ``(S, B, C)`` logits against ``(S, B)`` targets, so export cannot tie the two inputs' dims."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x))


def _token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, CLASSES), target.reshape(-1))


def test_sequence_first_encoder_with_per_token_targets_gets_dim_1_for_both():
    """Issue 54, item 13: targets (S, B) beside an (S, B, E) input; capture took dim 0 (S) for the batch."""
    torch.manual_seed(0)
    model = SeqFirstEncoderTagger()
    x, y = torch.randn(16, B, E), torch.randint(0, CLASSES, (16, B))
    graph = partita.capture(model, (x,), loss_fn=_token_loss, target=y)
    assert _dims(graph) == [1, 1] and graph.batch_size == B and graph.couples_samples is None
    plan = partita.manual_plan(
        graph, [0, graph.num_nodes // 2, graph.num_nodes], schedule="gpipe", num_rank_groups=2,
        num_microbatches=2, global_batch_size=B,
    )  # fmt: skip
    assert plan.num_microbatches == 2
    flat = flatten_inputs(graph, (x,), target=y)
    _assert_same(
        _pipelined(graph, model, flat, 2, graph.num_nodes // 2), _eager(model, lambda: _token_loss(model(x), y))
    )


def test_a_global_batch_found_in_another_dim_than_the_coupled_one_is_refused_at_planning():
    """CLIP captured at batch 8 with 12 image features, planned for a global batch of 12: samples mix
    along dim 0, and dim 1 has the global batch: the message names both dims and batch_dims."""
    model, images, tokens = _clip_case()
    graph = partita.capture(model, (images, tokens))
    cluster = partita.Cluster(device="h100", num_devices=2)
    with pytest.raises(InputError) as info:
        partita.plan(graph, cluster=cluster, global_batch_size=12, options=partita.PlanOptions(costs="analytic"))
    text = str(info.value)
    assert "capture took args[0] dim 0 and args[1] dim 0 for the batch (8 in the example)" in text, text
    assert "args[0] dim 1 has 12" in text and "batch_dims={'args[0]': 1}" in text, text
    with pytest.raises(InputError, match="args\\[0\\] dim 1 has 12"):
        partita.manual_plan(graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1,
                            num_microbatches=1, global_batch_size=12)  # fmt: skip
    declared = partita.capture(model, (images, tokens), batch_dims={"images": 0, "tokens": 0})
    assert declared.couples_samples is not None and declared.couples_samples.declared
    with pytest.warns(UserWarning, match="couples the samples"):
        plan = partita.plan(
            declared, cluster=cluster, global_batch_size=12, options=partita.PlanOptions(costs="analytic")
        )
    assert plan.global_batch_size == 12


def test_a_declared_batch_dim_that_mixes_samples_is_refused():
    model, src, y = _classifier_case()
    with pytest.raises(InputError) as info:
        partita.capture(model, (src,), loss_fn=F.cross_entropy, target=y, batch_dims={"src": 0})
    text = str(info.value)
    assert "args[0] dim 0" in text and "attends along the batch dim" in text and "'src': 1" in text


@pytest.mark.parametrize(
    "batch_dims, words",
    [
        ({"nope": 1}, "no input of the model"),
        ({"src": 3}, "has shape (6, 4, 16)"),
        ({"src": 1.5}, "must be an int dim or None"),
        ({"src": 0, "target": 0}, None),  # sizes 6 and 4
        ([1], "must be a dict"),
    ],
)
def test_bad_batch_dims_are_input_errors(batch_dims, words):
    model, src, y = _classifier_case()
    with pytest.raises(InputError) as info:
        partita.capture(model, (src,), loss_fn=F.cross_entropy, target=y, batch_dims=batch_dims)
    assert words is None or words in str(info.value)


def test_batch_dims_by_position_and_path_and_none():
    model, src, y = _classifier_case()
    for spec in ({0: 1}, {"args[0]": 1, "target": 0}):
        assert _dims(partita.capture(model, (src,), loss_fn=F.cross_entropy, target=y, batch_dims=spec)) == [1, 0]


def test_plan_takes_batch_dims_and_plans_micro_batches():
    model, src, y = _classifier_case()
    cluster = partita.Cluster(device="h100", num_devices=2)
    options = partita.PlanOptions(costs="analytic", num_stages=2, schedules="gpipe", num_microbatches=2)
    plan = partita.plan(
        model,
        (src,),
        loss_fn=F.cross_entropy,
        target=y,
        cluster=cluster,
        global_batch_size=8,
        options=options,
        batch_dims={"src": 1},
    )
    assert plan.num_stages == 2 and plan.num_microbatches == 2


# ----------------------------------------------------------------------------- coupled samples


class TinyCLIP(nn.Module):
    """Two encoders, a similarity matrix between every image and every text, arange labels."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.embed, self.text = nn.Embedding(30, 16), nn.Linear(16, 8)
        self.log_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, images, tokens):
        a = F.normalize(self.image(images), dim=-1)
        b = F.normalize(self.text(self.embed(tokens).mean(1)), dim=-1)
        logits = self.log_scale.exp() * a @ b.t()
        labels = torch.arange(images.shape[0], device=images.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _clip_case():
    torch.manual_seed(0)
    return TinyCLIP(), torch.randn(8, 12), torch.randint(0, 30, (8, 5))


def test_clip_loss_is_recorded_as_coupling_samples():
    model, images, tokens = _clip_case()
    graph = partita.capture(model, (images, tokens))
    coupling = graph.couples_samples
    assert coupling is not None and graph.dynamic_batch
    assert coupling.target == "aten.matmul.default" and "shape (B, B)) has the batch B in two dims" in coupling.reason
    assert graph.nodes[coupling.index].name == coupling.node
    assert "args[0] dim 0" in coupling.describe() and "test_batch_dims.py" in coupling.source


def test_clip_plans_one_microbatch_on_one_replica_per_stage():
    model, images, tokens = _clip_case()
    graph = partita.capture(model, (images, tokens))
    cluster = partita.Cluster(device="h100", num_devices=4)
    with pytest.warns(UserWarning, match="couples the samples"):
        plan = partita.plan(graph, cluster=cluster, global_batch_size=16, options=partita.PlanOptions(costs="analytic"))
    assert plan.num_microbatches == 1 and all(s.num_replicas == 1 for s in plan.stages)
    for pins in (dict(num_microbatches=2), dict(replicas=2), dict(uniform_replicas=False)):
        with pytest.raises(InputError, match=r"would split the batch.*couples the samples.*matmul"):
            partita.plan(
                graph, cluster=cluster, global_batch_size=16, options=partita.PlanOptions(costs="analytic", **pins)
            )


def test_plans_not_made_by_the_search_are_checked_too():
    from partita.types.whole_batch import check_whole_batch

    model, images, tokens = _clip_case()
    graph = partita.capture(model, (images, tokens))
    check_whole_batch(graph, 1, [1, 1])
    for m, replicas in ((2, [1, 1]), (1, [1, 2])):
        with pytest.raises(InputError, match="splits every step's batch.*couples the samples"):
            check_whole_batch(graph, m, replicas)


def test_clip_one_microbatch_plan_is_exact():
    """What the plan runs: the whole batch through the stages; the same loss and gradients."""
    model, images, tokens = _clip_case()
    graph = partita.capture(model, (images, tokens))
    stages = split_graph(graph, [0, graph.num_nodes // 2, graph.num_nodes])
    model.zero_grad()
    loss = _run_detached(stages, flatten_inputs(graph, (images, tokens)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_same((loss.detach(), grads), _eager(model, lambda: model(images, tokens)))


class _Statistic(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(4, 3)

    def forward(self, x, y):
        if self.kind == "centre":
            x = x - x.mean(0)
        z = self.proj(x)
        if self.kind == "std":
            return F.relu(1 - z.std(0)).mean() + F.cross_entropy(z, y)
        if self.kind == "softmax":
            return (z.softmax(0) * z).sum()
        if self.kind == "first":
            return F.cross_entropy(z[:1], y[:1])
        return F.cross_entropy(z, y) + 0.1 * z.pow(2).mean()  # "mean": sums and means only


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("centre", "statistic of the whole batch"),
        ("std", "non-linear statistic"),
        ("softmax", "softmax along the batch"),
        ("first", "fixed part of the batch"),
        ("mean", None),
    ],
)
def test_batch_statistics_couple_samples_and_means_do_not(kind, reason):
    graph = partita.capture(_Statistic(kind), (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    if reason is None:
        assert graph.couples_samples is None
    else:
        assert graph.couples_samples is not None and reason in graph.couples_samples.reason, graph.couples_samples


def test_batch_norm_is_the_documented_exception():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5))
    graph = partita.capture(
        model, (torch.randn(4, 3, 8, 8),), loss_fn=F.cross_entropy, target=torch.randint(0, 5, (4,))
    )
    assert graph.couples_samples is None and _dims(graph) == [0, 0]


@pytest.mark.slow  # captures every zoo family
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5", "vit", "mixtral"])
def test_zoo_models_do_not_couple_samples(family):
    pytest.importorskip("transformers")
    from partita import examples

    ex = examples.build(family, batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    assert graph.couples_samples is None, graph.couples_samples
    assert all(g.tensor is None or g.tensor.batch_dim in (0, None) for g in graph.inputs)


def test_a_per_sample_index_by_arange_is_not_coupling():
    """GPT-2 sequence classification picks each sample's last token: logits[arange(B), last]."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, num_labels=3, pad_token_id=0, use_cache=False
    )
    model = transformers.GPT2ForSequenceClassification(config)
    kwargs = {
        "input_ids": torch.randint(1, 64, (4, 8)),
        "labels": torch.randint(0, 3, (4,)),
        "attention_mask": torch.ones(4, 8, dtype=torch.long),
    }
    graph = partita.capture(model, (), kwargs)
    assert graph.couples_samples is None and graph.dynamic_batch


def test_hf_clip_fixes_its_batch_and_planning_says_where():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        projection_dim=16,
    )
    model = transformers.CLIPModel(config).train()
    kwargs = dict(input_ids=torch.randint(3, 64, (4, 7)), pixel_values=torch.randn(4, 3, 16, 16), return_loss=True)
    graph = partita.capture(model, (), kwargs)
    assert not graph.dynamic_batch and "modeling_clip.py" in graph.batch_fixed_at
    with pytest.raises(InputError, match=r"static batch dimension.*modeling_clip\.py:\d+ in contrastive_loss"):
        partita.plan(
            graph,
            cluster=partita.Cluster(device="h100", num_devices=2),
            global_batch_size=8,
            options=partita.PlanOptions(costs="analytic"),
        )


# ----------------------------------------------------------------------------- batch of 1


def test_an_example_batch_of_one_gives_a_dynamic_graph_that_plans():
    pytest.importorskip("transformers")
    from partita import examples

    ex = examples.build("gpt2", batch_size=1, seq_len=32)
    before = {k: v.clone() for k, v in ex.kwargs.items()}
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    assert graph.dynamic_batch and graph.batch_size == 2 and _dims(graph)[:2] == [0, 0]
    assert graph.inputs[0].tensor.shape == (2, 32)
    assert all(torch.equal(before[k], v) for k, v in ex.kwargs.items())  # the user's inputs are untouched
    cluster = partita.Cluster(device="h100", num_devices=8, devices_per_node=8)
    plan = partita.plan(graph, cluster=cluster, global_batch_size=16, options=partita.PlanOptions(costs="analytic"))
    assert plan.global_batch_size == 16
    # the graph runs at batch 1 too, with the eager model's loss
    assert torch.allclose(graph.loss(ex.args, ex.kwargs), ex.model(**ex.kwargs).loss, atol=1e-6, rtol=0)


def test_a_batch_of_one_on_meta_plans():
    """An example batch of 1 on meta plans as an example of the whole batch does: the same plan file,
    but for the graph fingerprint, which hashes the example's shapes."""
    pytest.importorskip("transformers")
    from partita import examples

    def plan_from_example(batch_size: int) -> partita.Plan:
        ex = examples.build("gpt2", batch_size=batch_size, seq_len=64, device="meta")
        return partita.plan(
            ex.model,
            ex.args,
            ex.kwargs,
            cluster=partita.Cluster(device="h100", num_devices=2),
            global_batch_size=4,
            options=partita.PlanOptions(costs="analytic"),
        )

    one, whole = plan_from_example(1), plan_from_example(4)
    assert one.global_batch_size == 4 and one.graph_fingerprint != whole.graph_fingerprint
    assert dataclasses.replace(one, graph_fingerprint=whole.graph_fingerprint).to_json() == whole.to_json()


def test_static_capture_is_still_refused_by_the_planner():
    model = nn.Sequential(nn.Linear(4, 3))
    graph = partita.capture(
        model,
        (torch.randn(4, 4),),
        loss_fn=F.cross_entropy,
        target=torch.zeros(4, dtype=torch.long),
        dynamic_batch=False,
    )
    assert not graph.dynamic_batch and graph.batch_fixed_at == ""
    with warnings.catch_warnings(), pytest.raises(InputError, match="static batch dimension.*dynamic_batch=True"):
        partita.plan(graph, cluster=partita.Cluster(device="h100", num_devices=2), global_batch_size=8)


def test_copy_of_graph_inputs_is_independent():
    """Widening copies: the captured example tensors are not the user's (no aliasing of batch-1 inputs)."""
    model, src, y = _classifier_case()
    src1, y1 = src[:, :1].clone(), y[:1].clone()
    graph = partita.capture(copy.deepcopy(model), (src1,), loss_fn=F.cross_entropy, target=y1, batch_dims={"src": 1})
    assert graph.batch_size == 2 and _dims(graph) == [1, 0] and src1.shape == (S, 1, E)

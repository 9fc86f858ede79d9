"""Evaluation is the model's eval mode, and parameter groups read the original shapes (issue
"The model's own math, second pass", items 1 and 4).

`prog.eval_step` (the trainer's evaluation) and `prog.eval(); prog(...)` run the model traced in
eval mode: dropout off, BatchNorm on its running statistics and nothing updated, forward only --
under a pipeline schedule the schedule's forwards alone, no backward, no gradient touched. Held
to one process's `model.eval()` loss on the same batch: GPT-2 with dropout 0.3 at dp=2, tp=2 and
pp=2 (1f1b, interleaved, zb-v), repeated evaluations identical, weights, optimizer state and
gradient norm unchanged; a model with an auxiliary head used in training only, its layers named
in the tp plan, at tp=2 (the eval graph's plan covers the layers it holds); a BatchNorm model at dp=2 on its running statistics, left as they were.

`prog.original_shape(name)`: the parameter's shape in the model, whatever the rank holds (a flat
1-d piece under zero=3), so "no weight decay on 1-d parameters" written over it trains at zero=3
dp=2 as in one process.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxtron
from fxtron.tools.testing import cases_fixture, max_abs_diff, ranks_of, reference_training
from fxtron.trainer.optim import original_dims, param_groups
from tp_models import Case, batch, batches, make

LR = 1e-3
DECAY = 0.1


class BNModel(torch.nn.Module):
    """Embedding, a BatchNorm over the hidden features, a head and a mean cross entropy."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.BatchNorm1d(dim)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        h = self.emb(idx)                                        # (B, T, D)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        logits = self.head(self.drop(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class AuxModel(torch.nn.Module):
    """Embedding, an MLP block, a head; in training also an auxiliary head's loss (a layer the
    eval-mode graph does not hold)."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.aux_up, self.aux_down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, 1)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + self.down(torch.relu(self.up(h)))
        loss = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
        if self.training:
            loss = loss + 0.1 * self.aux_down(torch.relu(self.aux_up(h))).pow(2).mean()
        return loss


class TrainingLoss(torch.nn.Module):
    """Embedding, a head; in training an auxiliary mean cross entropy over every position
    (ignored labels as class 0) and the main loss class-weighted, in evaluation the plain
    mean cross entropy of the counted labels: the two graphs' batch statistics differ (the
    eval graph's token count is not the training graph's, nor under the same name)."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("weight", torch.linspace(0.5, 2.0, vocab))

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.emb(idx))).flatten(0, 1)
        targets = targets.flatten()
        if not self.training:
            return torch.nn.functional.cross_entropy(logits, targets)
        aux = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0))
        return 0.1 * aux + torch.nn.functional.cross_entropy(logits, targets, weight=self.weight)


AUX_PLAN = {"up": "colwise", "down": "rowwise", "aux_up": "colwise", "aux_down": "rowwise"}


def _bn_model() -> BNModel:
    torch.manual_seed(0)
    m = BNModel()
    with torch.no_grad():       # running statistics other than the defaults, as after training
        m.norm.running_mean.uniform_(-0.5, 0.5)
        m.norm.running_var.uniform_(0.5, 2.0)
        m.norm.num_batches_tracked.fill_(7)
    return m


def _model(case: Case) -> torch.nn.Module:
    if case.name == "bn":
        return _bn_model()
    if case.name == "aux":
        torch.manual_seed(0)
        return AuxModel()
    if case.name == "training-loss":
        torch.manual_seed(0)
        return TrainingLoss()
    return make(case.name, dropout=0.3, layers=case.kw.get("layers", 2))


def _batch(case: Case, seed: int):
    if case.name in ("bn", "aux", "training-loss"):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 64, (8, 9), generator=g)
        labels = ids[:, 1:].clone()
        if case.name == "training-loss":     # ignored labels, more in the first dp rank's rows
            labels[:4, :5] = -100
            labels[4:, :1] = -100
        return (ids[:, :-1].clone(), labels), {}
    return batch(case.name, 8, 8, seed)


def _eval_reference(case: Case, state: dict, rows: list[int] | None = None) -> float:
    """One process: model.eval()'s loss on the evaluation batch (its `rows`), with the weights
    and buffers `state` (the program's after its training step)."""
    m = _model(case)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(m.named_parameters())], (missing, unexpected)
    m.eval()
    args, kwargs = _batch(case, 5)
    if rows is not None:
        args = tuple(a[rows] for a in args)
    with torch.no_grad():
        out = m(*args, **kwargs)
    return float(out if isinstance(out, torch.Tensor) else out.loss)


def _full(prog) -> dict:
    return {k: v.detach().clone() for k, v in prog.full_state_dict().items()}


def _opt_state(prog, opt) -> list:
    inner = prog.zero.optimizer if prog.zero is not None else opt
    return [t.detach().clone() for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]


def _run_eval(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    kw = {k: v for k, v in case.kw.items() if k != "layers"}
    model = _model(case)
    args, kwargs = _batch(case, 0)
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs or None, **kw)
    prog = pm.program(rank)
    opt = torch.optim.AdamW(prog.parameters(), lr=LR)
    if case.name != "bn":     # a step: the optimizer has state. (BatchNorm's training at dp=2: test_batch_coupled.py)
        prog.train_step(args, opt, kwargs=kwargs)
    norm = prog.last_grad_norm
    before, state = _full(prog), _opt_state(prog, opt)
    grads = [None if p.grad is None else p.grad.detach().clone() for p in prog.parameters()]
    buffers = {k: v.detach().clone() for k, v in prog.grad_buffers.items() if hasattr(v, "detach")}
    eargs, ekwargs = _batch(case, 5)
    losses = [prog.eval_step(eargs, kwargs=ekwargs) for _ in range(3)]
    out = {"losses": losses, "timeline": [(e.kind, e.microbatch, e.stage) for e in prog.timeline()],
           "reference": _eval_reference(case, before)}
    if case.kw.get("microbatches", 1) > 1 and mesh.pp == 1:
        # batches whose rank shares (1 and 3 rows) do not divide into the microbatches: evaluated
        # in 1 microbatch a rank (padding uneven over the ranks), as one process evaluates them
        out["undivided"] = [(prog.eval_step(tuple(a[rows] for a in eargs)), _eval_reference(case, before, rows))
                            for rows in ([0, 5], [0, 1, 2, 3, 4, 5])]
    after = _full(prog)
    out["weights"] = max_abs_diff(before, after)[0]
    out["opt_state"] = max((float((a - b).abs().max()) for a, b in zip(state, _opt_state(prog, opt)) if a.numel()),
                           default=0.0)
    out["norm_kept"] = prog.last_grad_norm == norm
    out["grads_kept"] = all((g is None and p.grad is None) or (g is not None and p.grad is not None and
                                                                torch.equal(g, p.grad))
                            for g, p in zip(grads, prog.parameters()))
    out["buffers_kept"] = all(torch.equal(v, prog.grad_buffers[k].detach()) for k, v in buffers.items())
    if case.name == "bn":
        out["bn"] = {k: v for k, v in after.items() if k.startswith("norm.running") or k.endswith("tracked")}
        out["bn_before"] = {k: v for k, v in before.items() if k in out["bn"]}
    if mesh.pp == 1 and case.name != "training-loss":   # an nn.Module's eval(): the program's forward runs the
        # eval graph too (on the rank's own batch, outside a step: its token mean is the rank's, so not with padding)
        prog.eval()
        local_args, local_kwargs = prog.local_batch(eargs, ekwargs)
        with torch.no_grad():
            out["forward_eval"] = prog._global_loss(prog(*local_args, **local_kwargs).detach())
        prog.train()
        out["training_again"] = prog.training
        # the plain loop's backward of prog(...)'s loss: refused where the step syncs the
        # gradients after its backward (dp), allowed where the backward leaves them whole (tp)
        out["own_backward"] = []
        for mode in (prog.train, prog.eval):        # (the eval graph's loss takes gradients too)
            mode()
            try:
                prog(*local_args, **local_kwargs).backward()
                out["own_backward"].append(None)
            except fxtron.ParallelizeError as e:
                out["own_backward"].append(str(e))
        prog.train()
    return out


def _run_groups(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    """3 steps of AdamW with weight decay on the >= 2-d parameters (by their original shape)."""
    model = make(case.name)
    items = batches(case.name, 8, [16, 12, 16], seed=10)
    args, kwargs = items[0]
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs or None, **case.kw)
    prog = pm.program(rank)
    decay = [p for n, p in prog.named_parameters() if len(prog.original_shape(n)) >= 2]
    plain = [p for n, p in prog.named_parameters() if len(prog.original_shape(n)) < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR, eps=1e-6,
                            weight_decay=DECAY)
    losses = [prog.train_step(a, opt, kwargs=k) for a, k in items]
    out = {"losses": losses, "state": _full(prog), "flat": all(p.dim() == 1 for p in prog.parameters()),
           "shapes": {n: tuple(s) for n, s in prog.original_shapes().items()},
           "trainer_groups": [len(g["params"]) for g in param_groups(prog.named_parameters(), original_dims(prog))],
           "groups": [len(decay), len(plain)]}
    # the same grouping by the pieces' own p.dim(): the decay group empty, said
    by_dim = torch.optim.AdamW([{"params": [p for p in prog.parameters() if p.dim() >= 2]},
                                {"params": [p for p in prog.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog.train_step(args, by_dim, kwargs=kwargs)
    out["by_dim"] = [str(w.message) for w in caught if issubclass(w.category, fxtron.ParallelizeWarning)]
    return out


EVAL_CASES = {
    fxtron.Mesh(2): [Case("hf-gpt2"), Case("bn"), Case("training-loss"), Case("training-loss", microbatches=2)],
    fxtron.Mesh(2, tp=2): [Case("hf-gpt2"), Case("aux", plan=AUX_PLAN)],
    fxtron.Mesh(2, pp=2): [Case("hf-gpt2", schedule="1f1b", microbatches=2),
                           Case("hf-gpt2", schedule="interleaved", virtual_stages=2, microbatches=2, layers=4),
                           Case("hf-gpt2", schedule="zb-v", microbatches=2, layers=4)],
}
GROUP_MESH, GROUP_CASE = fxtron.Mesh(2), Case("gpt", zero=3)


def _run(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    return _run_groups(rank, mesh, case) if case.kw.get("zero") == 3 else _run_eval(rank, mesh, case)


results = cases_fixture({2: [(m, cs) for m, cs in EVAL_CASES.items()] + [(GROUP_MESH, [GROUP_CASE])]}, _run)

PARAMS = [pytest.param(m, c, id=f"{m}-{c.key}") for m, cs in EVAL_CASES.items() for c in cs]


def test_original_shape_without_processes():
    model = make("gpt")
    args, kwargs = batch("gpt", 2, 8, 0)
    prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=args).program(0)
    assert prog.original_shapes() == {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(fxtron.ParallelizeError, match="not a parameter"):
        prog.original_shape("nope.weight")


def test_layers_used_in_training_only_leave_the_eval_graph_its_plan():
    """A plan naming a training-only layer (an auxiliary head) was checked against the eval-mode
    graph too, where the layer is not: evaluation raised "matches no linear"; without a plan,
    its unused parameters' placeholders failed the check that both graphs hold the weights
    alike. The eval graph's plan and that check cover the parameters it reads."""
    args = _batch(Case("aux"), 0)[0]
    for plan in (AUX_PLAN, None):
        pm = fxtron.parallelize(_model(Case("aux")), fxtron.Mesh(2, tp=2), example_inputs=args, plan=plan)
        for rank in range(2):
            ev = " ".join(str(n.target) for n in pm.compiled_eval(rank).gm.graph.nodes if n.users)
            assert "aux" not in " ".join(n.name for n in pm.compiled_eval(rank).gm.graph.nodes if n.users), ev
        if plan is not None:
            assert pm.compiled(0).local["aux_up.weight"].local_shape == (32, 16)
            assert pm.compiled_eval(0).local["up.weight"].local_shape == (32, 16)
    # the eval plan keeps entries by the layers they name: a tied LM head's weight bears the
    # embedding's name (lm_head's is wte.weight), and its entry stays
    gpt_args = batch("gpt", 2, 8, 0)[0]
    for plan, mode, split in (({"wte": "replicate", "lm_head": "replicate"}, "override", False),
                              ({"wte": "vocab", "lm_head": "colwise"}, "replace", True)):
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(2, tp=2), example_inputs=gpt_args, plan=plan, plan_mode=mode)
        assert (pm.compiled_eval(1).local["wte.weight"].local_shape[0] == 128) == split, (plan, mode)


def test_eval_step_in_one_process_is_model_eval():
    model = make("hf-gpt2", dropout=0.3)
    args, kwargs = batch("hf-gpt2", 4, 8, 0)
    prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=args, example_kwargs=kwargs).program(0)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = float(ref(*args, **kwargs).loss)
    got = [prog.eval_step(args, kwargs=kwargs) for _ in range(3)]
    assert max(abs(g - want) for g in got) < 2e-6, (got, want)
    train = [float(prog(*args, **kwargs).detach()) for _ in range(2)]
    assert train[0] != train[1]      # dropout on in training mode
    prog.eval()
    assert abs(float(prog(*args, **kwargs).detach()) - want) < 2e-6
    prog.train()
    assert prog.training and all(m.training for m in prog.modules())


@pytest.mark.slow
@pytest.mark.parametrize("mesh,case", PARAMS)
def test_eval_step_is_model_eval(results, mesh, case):
    ranks = ranks_of(results, mesh, case)
    for rank, got in enumerate(ranks):
        want = got["reference"]
        losses = got["losses"]
        print(f"{mesh} {case.key} rank {rank}: eval_step {losses} vs model.eval() {want}: {abs(losses[0] - want):.2e}")
        assert losses[0] == losses[1] == losses[2], f"rank {rank}: evaluations differ: {losses}"
        assert abs(losses[0] - want) < 2e-6, f"rank {rank}: eval_step {losses[0]} vs model.eval() {want}"
        assert got["weights"] == 0.0 and got["opt_state"] == 0.0, f"rank {rank}: evaluation changed the weights"
        assert got["norm_kept"] and got["grads_kept"] and got["buffers_kept"], f"rank {rank}: gradients touched"
        for got_small, want_small in got.get("undivided", []):
            assert abs(got_small - want_small) < 2e-6, f"rank {rank}: eval_step {got_small} vs model.eval() {want_small}"
        if "forward_eval" in got:
            assert abs(got["forward_eval"] - want) < 2e-6, (rank, got["forward_eval"], want)
            assert got["training_again"]
            for said in got["own_backward"]:
                if mesh.dp > 1:     # (it used to train each rank on its own rows' gradients, without a word)
                    assert "own rows only" in said and "dp gradient reduction over 2 ranks" in said, said
                else:
                    assert said is None, said
        if case.name == "bn":      # running statistics read, not updated (num_batches_tracked too)
            assert set(got["bn"]) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
            for k, v in got["bn"].items():
                assert torch.equal(v, got["bn_before"][k]), f"rank {rank}: {k} changed by evaluation"
        if mesh.pp > 1:            # forward only: no B or W, stage 0 receives nothing, the last sends nothing
            kinds = {k for k, _, _ in got["timeline"]}
            assert kinds <= {"F", "recv", "send"}, kinds
            assert sum(1 for k, _, _ in got["timeline"] if k == "F") == 2 * (2 if "virtual_stages" in case.kw
                                                                            or case.kw.get("schedule") == "zb-v"
                                                                            else 1)
            if case.kw.get("schedule") == "1f1b":
                assert not any(k == "recv" for k, _, _ in ranks[0]["timeline"]), ranks[0]["timeline"]
                assert not any(k == "send" for k, _, _ in ranks[1]["timeline"]), ranks[1]["timeline"]


@pytest.mark.slow
def test_weight_decay_by_original_shape_at_zero3(results):
    model = make(GROUP_CASE.name)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR, eps=1e-6,
                            weight_decay=DECAY)
    ref = reference_training(model, batches(GROUP_CASE.name, 8, [16, 12, 16], seed=10), opt)
    for rank, got in enumerate(ranks_of(results, GROUP_MESH, GROUP_CASE)):
        assert got["flat"], "zero=3 holds flat 1-d pieces"
        assert got["shapes"] == {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert got["groups"] == [len(decay), len(plain)] == got["trainer_groups"]
        assert any("param group 0 of AdamW is empty" in m and "original_shape" in m for m in got["by_dim"]), got["by_dim"]
        dl = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        assert dl < 2e-6, (rank, got["losses"], ref["losses"])
        dw, where = max_abs_diff(got["state"], {k: v for k, v in ref["state"].items() if k in got["state"]})
        print(f"zero=3 dp=2, decay on >= 2-d by original shape, rank {rank}: losses {dl:.2e}, weights {dw:.2e} ({where})")
        assert dw < 1e-5, f"rank {rank}: {where} differs by {dw:.3g} after 3 steps"

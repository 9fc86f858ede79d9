"""Mixed precision: programs compute in bf16 (or fp16 with dynamic loss scaling) while AdamW
updates fp32 parameters from fp32 gradients; compared at tp=2 (and, for a few cases, tp=4)
with the single-process model under the same policy (fp32 parameters, forward with 16-bit
copies).

Tolerances fit 16-bit arithmetic: the two runs round in different places (the tp run sums
bf16 partial products across ranks and computes the cross entropy in fp32), so losses agree
to a couple of bf16 ulps, first-step gradients to 2^-5 (bf16) / 2^-8 (fp16) of the largest
gradient, and weights after 3 AdamW steps to within two runs moving apart by their full
updates (2 x 3 x lr: each AdamW step moves a weight by at most about lr), since
Adam turns rounding-level gradient noise into full-size updates.
"""
from __future__ import annotations

import os

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, max_abs_diff, reference_training, run_on_ranks, shared_dir, \
    shared_dir_path, train_program
from tp_models import batch, batches, make

pytestmark = pytest.mark.slow      # gloo jobs of 2 and 4 processes

LR, STEPS = 1e-3, 3
# (model, dtype, sequence parallel)
CASES = [("gpt", torch.bfloat16, False), ("llama", torch.bfloat16, False), ("llama", torch.bfloat16, True),
         ("hf-gpt2", torch.bfloat16, False), ("hf-llama", torch.bfloat16, True), ("gpt", torch.float16, False)]
GRAD_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}
# clipping under fp16's loss scale: the norm and the coefficient are the model's, not the scaled
# gradients' (0.05: below the global norm, ~3, so every step clips)
CLIP = 0.05
# tp=4 (a second job of 4 processes): a shipped and a transformers model, with and without sp
CASES_TP4 = [("gpt", torch.bfloat16, True), ("hf-llama", torch.bfloat16, False)]
_opt = adamw(LR)


def _batches(name):
    return batches(name, 4, [16, 12, 16], seed=100)


def _key(name, dtype, sp):
    return f"{name}-{str(dtype)[6:]}" + ("-sp" if sp else "")


def _job(rank: int, mesh: fxtron.Mesh, cases: list) -> dict:
    out = {}
    for name, dtype, sp in cases:
        a, kw = batch(name, 2, 8, seed=0)
        pm = fxtron.parallelize(make(name), mesh, example_inputs=a, example_kwargs=kw, dtype=dtype,
                                sequence_parallel=sp)
        prog = pm.program(rank)
        opt = _opt(prog.parameters())
        res = {**train_program(prog, _batches(name), opt), "dtypes": {p.dtype for p in prog.parameters()}}
        if dtype == torch.float16:
            clipped = fxtron.parallelize(make(name), mesh, example_inputs=a, example_kwargs=kw, dtype=dtype,
                                         sequence_parallel=sp, clip_grad=CLIP).program(rank)
            copt = _opt(clipped.parameters())
            res["clipped"] = {**train_program(clipped, _batches(name), copt), "skipped": clipped.scaler.skipped}
        if prog.scaler is not None:
            res["scale"], res["skipped"] = prog.scaler.scale, prog.scaler.skipped
            prog.scaler.scale = 1e38                       # force an overflow: the step is skipped
            before = {n: p.detach().clone() for n, p in prog.named_parameters()}
            a, kw = _batches(name)[0]
            prog.train_step(a, opt, kwargs=kw)
            res["overflow"] = (prog.scaler.skipped, prog.scaler.scale,
                               all(torch.equal(before[n], p) for n, p in prog.named_parameters()),
                               prog.last_step_skipped)
            # the scaler's state travels with a checkpoint: a resumed run goes on at its scale
            prog.scaler.scale, prog.scaler.clean_steps = 1024.0, 7
            path = os.path.join(shared_dir_path("mixed-precision"), _key(name, dtype, sp))
            prog.save(path)
            resumed = pm.program(rank)
            resumed.load(path)
            res["resumed_scaler"] = resumed.scaler.state_dict()
            res["saved_scaler"] = prog.scaler.state_dict()
        out[_key(name, dtype, sp)] = res
    return out


def _reference(name: str, dtype: torch.dtype) -> dict:
    """The same policy in one process: fp32 parameters, forward with 16-bit copies."""
    return reference_training(make(name), _batches(name), _opt, dtype=dtype)


@pytest.fixture(scope="module", autouse=True)
def _checkpoints():
    with shared_dir("mixed-precision"):
        yield


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(2, tp=2)
    return run_on_ranks(_job, mesh, mesh, CASES)


@pytest.fixture(scope="module")
def results_tp4():
    mesh = fxtron.Mesh(4, tp=4)
    return run_on_ranks(_job, mesh, mesh, CASES_TP4)


ALL = [(2,) + c for c in CASES] + [(4,) + c for c in CASES_TP4]


@pytest.mark.parametrize("tp,name,dtype,sp", ALL, ids=[f"tp{c[0]}-" + _key(*c[1:]) for c in ALL])
def test_16bit_training_matches_the_same_policy_in_one_process(request, tp, name, dtype, sp):
    results = request.getfixturevalue("results" if tp == 2 else "results_tp4")
    ref = _reference(name, dtype)
    for rank, res in enumerate(results):
        got = res[_key(name, dtype, sp)]
        assert got["dtypes"] == {torch.float32}          # the optimizer's parameters stay fp32
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 2.0**-6 * abs(b), (rank, got["losses"], ref["losses"])
        gmax = max(g.abs().max().item() for g in ref["grads"].values())
        dg, where = max_abs_diff(got["grads"], ref["grads"])
        assert dg <= GRAD_TOL[dtype] * gmax, f"rank {rank}: gradient of {where} off by {dg:.3g} (max {gmax:.3g})"
        state = {k: v for k, v in ref["state"].items() if k in got["state"]}
        dw, where = max_abs_diff(got["state"], state)
        assert dw <= 2 * STEPS * LR, f"rank {rank}: weight {where} off by {dw:.3g}"


def test_fp16_dynamic_loss_scaling(results):
    for res in results:
        got = res[_key("gpt", torch.float16, False)]
        # GPT computes its cross entropy in fp32 (it upcasts 16-bit logits): torch's GradScaler's
        # start, 2^16, no step skipped (an fp16 loss caps it at 2^15: the tests below)
        assert got["scale"] == 2.0**16 and got["skipped"] == 0
        skipped, scale, unchanged, said = got["overflow"]
        assert skipped == 1 and scale == 0.5e38 and unchanged and said    # the trainer reads `said`
        assert got["resumed_scaler"] == got["saved_scaler"] and got["saved_scaler"]["scale"] == 1024.0


def test_fp16_clips_the_model_s_gradients_not_the_scaled_ones(results):
    """clip_grad under fp16: the global norm reported and clipped to is the model's (the scaled
    gradients' over the loss scale), as the one-process model's clip_grad_norm_ sees it."""
    ref = reference_training(make("gpt"), _batches("gpt"), _opt, dtype=torch.float16, clip_grad=CLIP)
    for rank, res in enumerate(results):
        got = res[_key("gpt", torch.float16, False)]["clipped"]
        assert got["skipped"] == 0
        for a, b in zip(got["norms"], ref["norms"]):
            assert abs(a - b) <= 2.0**-6 * b, (rank, got["norms"], ref["norms"])
        state = {k: v for k, v in ref["state"].items() if k in got["state"]}
        dw, where = max_abs_diff(got["state"], state)
        assert dw <= 2 * STEPS * LR, f"rank {rank}: weight {where} off by {dw:.3g}"


class _Head(torch.nn.Module):
    """An embedding and a head whose loss is the model's own fp16 number: a cross entropy, or a
    plain mean over every element (an MSE-like loss)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.emb, self.head = kind, torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        if self.kind == "ce":
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (logits * logits).mean()


def _head_data(b: int, s: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (b, s), generator=g), torch.randint(0, 32, (b, s), generator=g)


# a rank's share of the losses' elements past fp16's 65504: 8 x 4096 tokens, 2 x 1024 x 32 logits
HEAD_CASES = {"ce": (16, 4096), "mean": (4, 1024)}


def _head_job(rank: int, mesh: fxtron.Mesh) -> dict:
    out = {}
    for kind, (b, s) in HEAD_CASES.items():
        torch.manual_seed(0)
        prog = fxtron.parallelize(_Head(kind), mesh, example_inputs=_head_data(2, 8), dtype=torch.float16).program(rank)
        loss = prog.train_step(_head_data(b, s), torch.optim.SGD(prog.parameters(), lr=0.0))
        out[kind] = (loss, {n: g.float().norm().item() for n, g in prog.full_grads().items()},
                     prog.scaler.skipped, prog.scaler.scale)
    return out


def _fp16_loss_gpt() -> torch.nn.Module:
    """GPT whose cross entropy takes its 16-bit logits as they are (the shipped model upcasts
    them): a loss in fp16."""
    model = make("gpt")

    class Fp16Loss(type(model)):
        def forward(self, idx, targets):
            return torch.nn.functional.cross_entropy(super().forward(idx).flatten(0, 1), targets.flatten())
    model.__class__ = Fp16Loss
    return model


def _pp_job(rank: int, mesh: fxtron.Mesh) -> tuple:
    """A pipeline of one microbatch whose loss is fp16 (a cross entropy of fp16 logits): the
    first stage never sees the loss, and caps the scale as the last does (the trace's dtype)."""
    (args, _), = batches("gpt", 4, [8], seed=0)
    pp = fxtron.parallelize(_fp16_loss_gpt(), mesh, example_inputs=args, dtype=torch.float16).program(rank)
    loss = pp.train_step(args, torch.optim.SGD(pp.parameters(), lr=0.0))
    return loss, _fp16_loss_gpt().half()(*args).item(), pp.scaler.skipped, pp.scaler.scale, pp.last_step_skipped


def _head_reference(kind: str) -> tuple[float, dict]:
    """The one-process fp16 model, its mean accumulated in fp32 as CUDA's kernels do (the CPU's
    fp16 cross entropy accumulates in fp16 and overflows itself)."""
    torch.manual_seed(0)
    model = _Head(kind)
    ps = {n: p.detach().half().requires_grad_() for n, p in model.named_parameters()}
    ids, labels = _head_data(*HEAD_CASES[kind])
    logits = (ps["emb.weight"][ids] @ ps["head.weight"].t() + ps["head.bias"]).float()
    loss = (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if kind == "ce"
            else (logits * logits).mean())
    loss.backward()
    return loss.item(), {n: p.grad.float().norm().item() for n, p in ps.items()}


@pytest.fixture(scope="module")
def heads():
    return run_on_ranks(_head_job, fxtron.Mesh(2), fxtron.Mesh(2))


@pytest.mark.parametrize("kind", list(HEAD_CASES))
def test_fp16_losses_over_more_elements_than_fp16_counts(heads, kind):
    """An fp16 mean over more than 65504 elements a rank (dp=2): the global count and the sum
    behind the mean are fp32, as the mean's own kernel accumulates; an fp16 count was inf (the
    mean 0, every gradient 0), an fp16 sum of the token losses inf. The loss is fp16 here, so the
    first step's scale is capped where fp16 holds it (2^15), not skipped."""
    ref_loss, ref_norms = _head_reference(kind)
    for rank, (loss, norms, skipped, scale) in enumerate(r[kind] for r in heads):
        assert abs(loss - ref_loss) <= 2.0**-8 * abs(ref_loss), (rank, loss, ref_loss)
        for n, v in ref_norms.items():
            assert abs(norms[n] - v) <= 2e-2 * v, (rank, n, norms[n], v)
        assert skipped == 0 and scale == 2.0**15, (skipped, scale)


def test_fp16_pipeline_of_one_microbatch_caps_the_scale_on_every_stage():
    """pp=2, one microbatch, an fp16 loss: backward's first gradient is the scale itself, so
    2^16 (inf in fp16) skipped the first step; every stage caps it at 2^15 and the step runs."""
    for rank, r in enumerate(run_on_ranks(_pp_job, fxtron.Mesh(2, pp=2), fxtron.Mesh(2, pp=2))):
        loss, ref, skipped, scale, last_skipped = r
        assert skipped == 0 and not last_skipped and scale == 2.0**15, (rank, skipped, scale)
        assert abs(loss - ref) <= 2.0**-8 * abs(ref), (rank, loss, ref)


def _held_pp_job(rank: int, mesh: fxtron.Mesh, path: str) -> dict:
    """A model held in bf16, trained on fp32 masters at pp=2, written by save_pretrained in
    shards of 200 KB: each stage's ranks decide its tensors' dtype (the model's 16 bits)."""
    (args, _), = batches("gpt", 4, [8], seed=0)
    prog = fxtron.parallelize(make("gpt").to(torch.bfloat16), mesh, example_inputs=args, dtype="bf16",
                              microbatches=2).program(rank)
    prog.train_step(args, torch.optim.AdamW(prog.parameters(), lr=1e-2))
    prog.save_pretrained(path, max_shard_size="200KB")
    return prog.full_state_dict()


def test_a_16_bit_model_written_from_a_pipeline_is_one_set_of_files(tmp_path):
    """Every rank plans every stage's files: with each tensor's dtype known only to the rank
    holding it, rank 0 planned stage 1's weights in fp32 and rank 1 in bf16 -- the index named
    a file neither wrote, and its total_size was not the bytes written."""
    import json

    from safetensors.torch import load_file
    path = str(tmp_path / "hf")
    full = {}
    for got in run_on_ranks(_held_pp_job, fxtron.Mesh(2, pp=2), fxtron.Mesh(2, pp=2), path):
        full.update(got)
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    files = set(index["weight_map"].values())
    assert all(os.path.isfile(os.path.join(path, f)) for f in files), (files, os.listdir(path))
    written = {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in written.values())
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    assert all(torch.equal(v, full[k].to(torch.bfloat16)) for k, v in written.items())


def test_dtype_is_checked():
    with pytest.raises(fxtron.ParallelizeError, match="dtype"):
        fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0], dtype=torch.int8)


class _Fp16CrossEntropyPlusFp32(torch.nn.Module):
    """A loss that is fp32 although fp16 receives its gradient whole: an fp16 cross entropy
    (16-bit logits) plus an fp32 term, as a mixture of experts adds its fp32 load-balancing loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.aux = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(32, 1)

    def forward(self, idx, targets):
        h = torch.tanh(self.emb(idx))
        lm = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
        return lm + self.aux(h).float().pow(2).mean() * 0.01


def test_fp16_cross_entropy_beside_an_fp32_loss_caps_the_scale_compiled_or_not():
    """The sum is fp32, but backward hands the fp16 cross entropy the scale itself: 2^16 was inf
    there and skipped every step at it uncompiled, while compiled regions, keeping the cast in
    fp32, took them -- the two trained apart by a step. The scale is capped at 2^15 and the compiled
    regions round 16-bit casts as the uncompiled program: the same steps taken, the losses the
    one-process fp16 model's to fp16's round-off."""
    g = torch.Generator().manual_seed(0)
    data = [(ids[:, :-1].clone(), ids[:, 1:].clone()) for ids in (torch.randint(0, 64, (4, 17), generator=g)
                                                                 for _ in range(4))]
    ref = reference_training(_Fp16CrossEntropyPlusFp32(), data, _opt, dtype=torch.float16)
    runs = {}
    for compiled in (False, True):
        prog = fxtron.parallelize(_Fp16CrossEntropyPlusFp32(), fxtron.Mesh(1), example_inputs=data[0],
                                  dtype="fp16", compile=compiled).program(0)
        opt = _opt(prog.parameters())
        losses, skipped = zip(*[(prog.train_step(b, opt), prog.last_step_skipped) for b in data])
        assert prog.scaler.max_scale == 2.0**15 and not any(skipped), (compiled, skipped)
        assert all(abs(a - b) <= 2.0**-8 * abs(b) for a, b in zip(losses, ref["losses"])), (compiled, losses, ref)
        runs[compiled] = prog.full_state_dict()
    assert max_abs_diff(runs[True], runs[False])[0] <= 2 * len(data) * LR * 0.05


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_model_held_in_16_bits_gets_fp32_masters(dtype, tmp_path):
    """A model loaded in bf16 (from_pretrained(torch_dtype=torch.bfloat16)) and parallelized with
    dtype="bf16" kept its weights in bf16, and the optimizer updated them there: 78,276 of
    125,248 weights never moved in 5 SGD steps (their updates rounded away), where fp32 masters
    leave 4,368. Now the program holds fp32 masters of them, as of an fp32 model: it trains bit
    for bit as the same weights held in fp32 do under the same compute dtype."""
    torch.manual_seed(0)
    narrow = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    held = make("llama").to(narrow)
    widened = make("llama").to(narrow).float()
    data = batches("llama", 4, [16, 12, 16], seed=3)
    states, progs = [], []
    for model in (held, widened):
        prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=data[0][0], dtype=dtype).program(0)
        assert {p.dtype for p in prog.parameters()} == {torch.float32}
        opt = torch.optim.SGD(prog.parameters(), lr=0.01)
        losses = [prog.train_step(args, opt) for args, _ in data]
        states.append(({k: v.clone() for k, v in prog.state_dict().items()}, losses))
    (a, la), (b, lb) = states
    assert la == lb and max_abs_diff(a, b)[0] == 0.0, (la, lb, max_abs_diff(a, b))
    moved = sum(int((a[k] != held.state_dict()[k].float()).sum()) for k in a if a[k].is_floating_point())
    assert moved > 0.9 * sum(p.numel() for p in held.parameters()), moved
    # save_pretrained writes the weights in the dtype the model held them in (as transformers saves
    # the model it loaded), the masters rounded once; dtype= still chooses
    from safetensors.torch import load_file
    for given, want in ((None, narrow), (torch.float32, torch.float32)):
        out = tmp_path / f"saved-{given}"
        progs_held = fxtron.parallelize(held, fxtron.Mesh(1), example_inputs=data[0][0], dtype=dtype).program(0)
        progs_held.load_state_dict(a)
        progs_held.save_pretrained(str(out), dtype=given)
        written = load_file(str(out / "model.safetensors"))
        assert {v.dtype for v in written.values() if v.is_floating_point()} == {want}, given
        assert all(torch.equal(written[k], a[k].to(want)) for k in written), given


def test_optimizer_state_saved_beside_16_bit_weights_loads_onto_fp32_masters(tmp_path):
    """A checkpoint of a 16-bit model trained without a compute dtype (its AdamW moments bf16,
    the rule of its save) loaded into the same model under dtype="bf16", whose parameters are
    now fp32 masters, or the reverse: the moments were loaded in their saved dtype, and torch's
    AdamW refused the mixed dtypes one step later ('expected dtype c10::BFloat16 for end'), SGD's
    momentum rounding silently. Per-element state is made its parameter's dtype at the load."""
    data = batches("llama", 4, [12, 12, 12], seed=5)
    for saved_dtype, loaded_dtype in ((None, "bf16"), ("bf16", None)):
        prog = fxtron.parallelize(make("llama").to(torch.bfloat16), fxtron.Mesh(1), example_inputs=data[0][0],
                                  dtype=saved_dtype).program(0)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        for args, _ in data[:2]:
            prog.train_step(args, opt)
        moments = {n: opt.state[p]["exp_avg"].clone() for n, p in prog.named_parameters()}
        path = str(tmp_path / f"ck_{saved_dtype}")
        prog.save(path, opt)
        other = fxtron.parallelize(make("llama").to(torch.bfloat16), fxtron.Mesh(1), example_inputs=data[0][0],
                                   dtype=loaded_dtype).program(0)
        opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
        other.load(path, opt2)
        for n, p in other.named_parameters():
            got = opt2.state[p]["exp_avg"]
            assert got.dtype == p.dtype and torch.equal(got, moments[n].to(p.dtype)), (n, got.dtype, p.dtype)
        assert other.train_step(data[2][0], opt2) > 0


class _FloatInputs(torch.nn.Module):
    """A regression head over float features (a vision or audio front end's input)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(torch.relu(self.up(x))), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float_inputs_that_meet_16_bit_weights_are_named_at_parallelize(dtype):
    """dtype=bf16/fp16 with fp32 features fed to a linear: the step crashed (mat1 and mat2 must
    have the same dtype); parallelize names the input to cast. Inputs are left as given (a loss
    mask, a value the model reads in fp32, keep their precision), and in 16 bits they train as
    the model does on them."""
    torch.manual_seed(0)
    model = _FloatInputs()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with pytest.raises(fxtron.ParallelizeError, match=rf"%linear \(up\) multiplies user input 0 \(torch.float32\) "
                                                      rf"with {dtype} weights.*pass that input as {dtype}"):
        fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(x, y), dtype=dtype)
    x, y = x.to(dtype), y.to(dtype)
    prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(x, y), dtype=dtype).program(0)
    got = prog.train_step((x, y), torch.optim.SGD(prog.parameters(), lr=0.1))
    params = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    assert got == float(torch.func.functional_call(model, params, (x, y)))


class _MegatronScaler:
    """Megatron-LM's DynamicGradScaler (optimizer/grad_scaler.py), as its update reads: an
    overflow resets the growth count and spends one of the hysteresis; none left, the scale
    backs off (not below min); `window` clean steps in a row grow it and restore the hysteresis."""

    def __init__(self, initial, minimum, window, hysteresis):
        self.scale, self.min, self.window, self.hysteresis = initial, minimum, window, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * 2.0


def _overflows(seed: int, steps: int) -> list[bool]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(steps, generator=g) < 0.3).tolist()


@pytest.mark.parametrize("hysteresis, window, minimum", [(1, 3, 1.0), (2, 3, 1.0), (3, 2, 64.0), (2, 1000, 1.0)])
def test_the_loss_scaler_follows_megatron_s_dynamic_scaler(hysteresis, window, minimum):
    """The precision section's initial_loss_scale, min_loss_scale, loss_scale_window and
    hysteresis (Megatron's --initial-loss-scale, --min-loss-scale, --loss-scale-window,
    --hysteresis) give the scale Megatron's scaler gives over 200 steps of random overflows, each
    overflowing step skipped; the state resumes the hysteresis left."""
    from fxtron.config.sections import PrecisionConfig
    from fxtron.runtime.precision import LossScaler
    cfg = PrecisionConfig(dtype="fp16", initial_loss_scale=1024.0, min_loss_scale=minimum, loss_scale_window=window,
                          hysteresis=hysteresis)
    ours, ref = LossScaler.for_loss(torch.float32, cfg), _MegatronScaler(1024.0, minimum, window, hysteresis)
    for step, inf in enumerate(_overflows(hysteresis + window, 200)):
        grad = torch.full((3,), float("inf") if inf else ours.scale)
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = grad
        assert ours.unscale_and_check([p], None) == (not inf), step
        ref.update(inf)
        assert ours.scale == ref.scale, (step, ours.scale, ref.scale)
        if step == 100:
            resumed = LossScaler.for_loss(torch.float32, cfg)
            resumed.load_state_dict(ours.state_dict())
            ours = resumed
    assert ours.skipped == sum(_overflows(hysteresis + window, 200))      # (carried by the state)


def test_a_static_loss_scale_never_moves_and_still_skips():
    """loss_scale= (Megatron's --loss-scale): a static scale; a step whose gradients overflow is
    skipped, the scale kept, also when a checkpoint saved another scale."""
    pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0], dtype=torch.float16,
                            loss_scale=128.0)
    prog = pm.program(0)
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
    for args, _ in batches("gpt", 2, [8, 8, 8], seed=1):
        prog.train_step(args, opt)
        assert prog.scaler.scale == 128.0 and not prog.last_step_skipped
    with torch.no_grad():
        next(p for n, p in prog.named_parameters() if n.endswith("wte.weight")).mul_(1e30)
    prog.train_step(batches("gpt", 2, [8], seed=2)[0][0], opt)
    assert prog.last_step_skipped and prog.scaler.scale == 128.0 and prog.scaler.skipped == 1
    prog.scaler.load_state_dict({**prog.scaler.state_dict(), "scale": 4.0})
    assert prog.scaler.scale == 128.0
    # a loss in fp16 receives the scale as its gradient: a static scale past fp16's range would
    # skip every step (a dynamic one is capped at 2^15 instead)
    idx, targets = batch("gpt", 2, 8, 0)[0]
    with pytest.raises(fxtron.ParallelizeError, match=r"loss_scale=65536.0: the loss itself is fp16.*<= 32768"):
        fxtron.parallelize(_Fp16CrossEntropyPlusFp32(), fxtron.Mesh(1), example_inputs=(idx % 64, targets % 64),
                           dtype=torch.float16, loss_scale=2.0**16).program(0)
    dynamic = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0],
                                 dtype=torch.float16, initial_loss_scale=512.0, hysteresis=2).program(0)
    assert dynamic.scaler.scale == 512.0 and dynamic.scaler.hysteresis_left == 2 and not dynamic.scaler.static


@pytest.mark.parametrize("options, match", [
    (dict(dtype=torch.bfloat16, hysteresis=2), r"hysteresis=2 set\(s\) fp16's loss scaler, and dtype='bf16' has none"),
    (dict(loss_scale=8.0), r"loss_scale=8.0 set\(s\) fp16's loss scaler, and dtype='fp32'"),
    (dict(dtype=torch.float16, loss_scale=8.0, loss_scale_window=10),
     r"loss_scale=8.0 is a static scale, and loss_scale_window=10 set\(s\) the dynamic scaling"),
    (dict(dtype=torch.float16, initial_loss_scale=4.0, min_loss_scale=8.0), "min_loss_scale=8.0 is above"),
    (dict(dtype=torch.float16, hysteresis=0), "hysteresis"),
    (dict(dtype=torch.float16, loss_scale=-1.0), "loss_scale")])
def test_loss_scaler_options_are_checked(options, match):
    with pytest.raises(fxtron.ParallelizeError, match=match):
        fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0], **options)


def test_a_16_bit_model_without_dtype_is_said_to_train_in_16_bits():
    """A model held in bf16 parallelized without dtype= trains in bf16 as in one process, with no
    fp32 masters: pm.summary() says so and what dtype= gives (it said its linears were fp32)."""
    args = batch("gpt", 2, 8, 0)[0]
    pm = fxtron.parallelize(make("gpt").to(torch.bfloat16), fxtron.Mesh(1), example_inputs=args)
    text = pm.summary()
    assert "precision: the model holds 124,672 in bfloat16 of its 124,672 parameters, and no dtype= was given" in text
    assert "dtype='bf16' gives Megatron's mixed precision" in text and "linears: fp32" not in text
    assert {p.dtype for p in pm.program(0).parameters()} == {torch.bfloat16}
    assert "precision:" not in fxtron.parallelize(make("gpt").to(torch.bfloat16), fxtron.Mesh(1), example_inputs=args,
                                                  dtype="bf16").summary()

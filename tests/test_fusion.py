"""Gradient accumulation fusion in compiled programs: linears become fxtron::linear where it
changes something (16-bit compute, tp, zero=3, ...), their weight gradients land in fp32
main_grad buffers, and training is unchanged; an fp32 linear nothing defers is autograd's."""
from __future__ import annotations

import torch

import fxtron
from fxtron.core import meta
from fxtron.models import build, example_inputs
from fxtron.ops.linear import kernel_name


def _prog(fusion: bool):
    model = build("llama-tiny", seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=example_inputs("llama-tiny"),
                            gradient_accumulation_fusion=fusion)
    return pm, pm.program(0)


def test_linears_are_fused_where_it_changes_something_and_show_their_kernel():
    """A linear is fused where the fused linear computes another number or does what autograd
    cannot (compiler/passmanager.py linears_to_autograd): under tp (its GEMM deferred behind the
    input gradient's all-reduce) and under 16-bit compute (its weight gradient accumulated in
    fp32). An fp32 linear nothing defers at world 1 stays an aten op: autograd's weight gradient
    is the same fp32 number, added into main_grad in place, without a Python autograd Function
    per linear."""
    from fxtron.compiler.passmanager import linears_to_autograd

    def fused(pm):
        return [n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    pm, _ = _prog(True)
    linears = [n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert not fused(pm) and len(linears) == 2 * 7 + 1       # 7 linears per layer and the LM head
    assert linears_to_autograd(pm.config, pm.mesh.view(0))
    assert "left to autograd" in pm.summary()
    x = example_inputs("llama-tiny")
    tp = fxtron.parallelize(build("llama-tiny", seed=0), fxtron.Mesh(2, tp=2), example_inputs=x)
    assert len(fused(tp)) == 2 * 7 + 1 and all(meta.get(n, meta.KERNEL) == "wgrad:addmm_fp32" for n in fused(tp))
    assert "wgrad:addmm_fp32" in tp.graph(0) and "left to autograd" not in tp.summary()
    half = fxtron.parallelize(build("llama-tiny", seed=0), fxtron.Mesh(1), example_inputs=x, dtype="bf16")
    kernels = {meta.get(n, meta.KERNEL) for n in fused(half)}
    assert len(fused(half)) == 2 * 7 + 1 and kernels == {kernel_name(torch.device("cpu"), torch.bfloat16)}
    for kw in (dict(zero=3), dict(grad_reduce_dtype=torch.bfloat16)):
        assert fused(fxtron.parallelize(build("llama-tiny", seed=0), fxtron.Mesh(2), example_inputs=x, **kw)), kw
    pm, _ = _prog(False)
    assert not fused(pm) and "left to autograd" not in pm.summary()


def test_weight_gradients_accumulate_into_main_grad_and_match_the_model():
    """At world 1 in fp32 the linears' weight gradients land in the persistent fp32 buffer, as
    the fused linear's do, and equal the unmodified model's; the same with the fusion off."""
    batches = [example_inputs("llama-tiny", batch=4, seq=s, seed=i) for i, s in enumerate([16, 12])]
    model = build("llama-tiny", seed=0)
    for fusion in (True, False):
        _, prog = _prog(fusion)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        buffers = []
        for i, b in enumerate(batches):
            if i == 0:
                loss = model(*b)
                (loss[1] if isinstance(loss, tuple) else loss).backward()
            prog.train_step(b, opt)
            buffers.append(prog.get_parameter("layers.0.mlp.w1.weight").grad)
            if i == 0:
                for name, p in model.named_parameters():
                    torch.testing.assert_close(prog.get_parameter(name).grad, p.grad, rtol=0, atol=1e-6, msg=name)
                model.zero_grad(set_to_none=True)
        # one persistent fp32 buffer, reused every step: no per-step weight-gradient tensor
        assert buffers[0] is buffers[1] and buffers[0].dtype == torch.float32
        assert buffers[0].data_ptr() == prog.grads._views["layers.0.mlp.w1.weight"].data_ptr()
        assert not hasattr(prog.get_parameter("layers.0.mlp.w1.weight"), "main_grad")


def test_programs_run_the_ops_in_their_run_time_forms():
    """The inspected graph keeps fxtron::linear; the program's own copy calls its run-time
    form (an autograd Function, no custom-op dispatch), whose values, input gradients and
    main_grad accumulation equal the op's."""
    from fxtron.ops.linear import linear_eager
    pm = fxtron.parallelize(build("llama-tiny", seed=0), fxtron.Mesh(1), example_inputs=example_inputs("llama-tiny"),
                            dtype="bf16")        # (16-bit compute: the linears fused at world 1)
    assert any(n.target == torch.ops.fxtron.linear.default for n in pm.compiled(0).gm.graph.nodes)
    targets = {n.target for n in pm.program(0).graph_module.graph.nodes if n.op == "call_function"}
    assert linear_eager in targets and torch.ops.fxtron.linear.default not in targets

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 5, 8, generator=gen)
    dy = torch.randn(3, 5, 6, generator=gen)
    results = []
    for fn in (torch.ops.fxtron.linear, linear_eager):
        for weight_in_out in (False, True):
            x = x0.clone().requires_grad_(True)
            shape = (8, 6) if weight_in_out else (6, 8)
            w = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(1)))
            w.main_grad = torch.ones(*shape)
            b = torch.randn(6, generator=torch.Generator().manual_seed(2), requires_grad=True)
            y = fn(x, w, b, weight_in_out)
            y.backward(dy)
            results.append((y.detach(), x.grad, b.grad, w.main_grad, w.grad))
    for a, e in zip(results[:2], results[2:]):
        for u, v in zip(a[:4], e[:4]):
            assert torch.equal(u, v)
        assert a[4] is None and e[4] is None            # the weight gradient went to main_grad only
    ref = 1 + dy.reshape(-1, 6).double().t() @ x0.reshape(-1, 8).double()      # [out, in]
    torch.testing.assert_close(results[0][3].double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(results[1][3].double(), ref.t(), rtol=0, atol=1e-5)


def test_backward_runs_only_the_gemms_whose_inputs_take_a_gradient():
    """A frozen weight's gradient GEMM is not run, outside a step and in one, nor the
    input gradient of a linear whose input takes none: the backward's matmul FLOPs are those of the gradients asked for, and
    the gradients given equal autograd's through F.linear."""
    from torch.utils.flop_counter import FlopCounterMode
    from fxtron.core.records import GRAD_REPORTS, GradReport
    from fxtron.ops.linear import linear_eager
    gen = torch.Generator().manual_seed(0)
    x0, w0, b0 = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
    gemm = 2 * 4 * 8 * 6                      # one [4, 8] x [8, 6] product
    for x_grad, w_grad in ((True, True), (True, False), (False, True)):
        grads = []
        for fn in (linear_eager, torch.nn.functional.linear):
            x, w, b = (t.clone().requires_grad_(g) for t, g in ((x0, x_grad), (w0, w_grad), (b0, w_grad)))
            args = (x, w, b, False) if fn is linear_eager else (x, w, b)
            y = fn(*args)
            with FlopCounterMode(display=False) as flops:
                y.sum().backward()
            if fn is linear_eager:
                assert flops.get_total_flops() == gemm * (x_grad + w_grad), (x_grad, w_grad)
            grads.append([t.grad for t in (x, w, b)])
        for got, want in zip(*grads):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # in a step (a main_grad on every weight): a frozen weight's GEMM is not run either, its
    # main_grad left as it was and its input not saved for it; a trainable one's accumulates
    for w_grad in (False, True):
        x, w = x0.clone().requires_grad_(True), torch.nn.Parameter(w0.clone(), requires_grad=w_grad)
        w.main_grad = torch.zeros(6, 8)
        reported = []
        GRAD_REPORTS.set(w, GradReport(lambda: reported.append(1)))
        y = linear_eager(x, w, None, False)
        assert len(y.grad_fn.saved_tensors) == w_grad        # a frozen weight's input is not kept
        with FlopCounterMode(display=False) as flops:
            y.sum().backward()
        if not w_grad:           # (the accumulating GEMM, addmm_ into main_grad, is not counted)
            assert flops.get_total_flops() == gemm
        assert bool(w.main_grad.abs().sum() > 0) == w_grad and w.grad is None
        assert reported == [1]         # done, frozen too: a data-parallel bucket does not wait for it
        GRAD_REPORTS.pop(w)


def test_master_linear_returns_the_fp32_accumulated_weight_gradient():
    """fxtron::master_linear (a compiled region's linear under 16-bit compute): its output and
    input gradient are the 16-bit linear's, and the gradient it returns for the fp32 master
    weight is the GEMM accumulated in fp32 -- within fp32's round-off of float64's, where the
    16-bit compute copy's own gradient is rounded to bf16 -- eager and traced by torch.compile."""
    from fxtron.ops.linear import _linear, master_linear_eager
    g = torch.Generator().manual_seed(0)
    for weight_in_out in (False, True):
        x = torch.randn(4, 24, 32, generator=g).to(torch.bfloat16)
        w = torch.randn(*((32, 48) if weight_in_out else (48, 32)), generator=g)
        b = torch.randn(48, generator=g).to(torch.bfloat16)
        dy = torch.randn(4, 24, 48, generator=g).to(torch.bfloat16)
        ref = (x.double().reshape(-1, 32).t() @ dy.double().reshape(-1, 48) if weight_in_out
               else dy.double().reshape(-1, 48).t() @ x.double().reshape(-1, 32))
        # the 16-bit path autograd takes through a compute copy (the fused linear's forward GEMM)
        xs, ws, bs = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        y16 = _linear(xs, ws.to(torch.bfloat16), bs, weight_in_out)
        y16.backward(dy)
        for fn in (master_linear_eager, torch.compile(master_linear_eager, fullgraph=True)):
            xm, wm, bm = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
            y = fn(xm, wm, bm, weight_in_out)
            y.backward(dy)
            assert y.dtype == torch.bfloat16 and torch.equal(y, y16.detach())
            assert torch.equal(xm.grad, xs.grad) and torch.equal(bm.grad, bs.grad)
            assert wm.grad.dtype == torch.float32
            err = (wm.grad.double() - ref).abs().max().item()
            assert err < 1e-5 * ref.abs().max().item(), err
            # autograd's gradient of the compute copy: rounded to bf16, ~100x further off
            assert (ws.grad.double() - ref).abs().max().item() > 50 * max(err, 1e-9)


def test_master_linear_takes_only_the_gradients_asked_for():
    """A frozen master weight: no weight-gradient GEMM where master_linear runs eagerly (a
    recomputed region), none under torch.compile either; the input's gradient as before."""
    from fxtron.ops.linear import master_linear_eager
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 16, generator=g)
    dy = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    for fn in (master_linear_eager, torch.compile(master_linear_eager, fullgraph=True)):
        xm = x.clone().requires_grad_()
        wm = w.clone()                       # frozen
        fn(xm, wm, None, False).backward(dy)
        assert wm.grad is None and torch.equal(xm.grad, dy @ w.to(torch.bfloat16))


def test_autograd_gradients_accumulate_in_place_into_main_grad():
    """Direct accumulation (runtime/grads.py): each step sets the .grad of every parameter
    autograd computes a gradient of (norms, embeddings, biases) to its main_grad, so that
    AccumulateGrad adds there in place -- no hook copies a transient gradient. The gradients
    equal the unmodified model's; a 16-bit gradient buffer (another dtype than the parameter's)
    takes the hook's path instead."""
    model = build("llama-tiny", seed=0)
    x = example_inputs("llama-tiny", batch=4, seq=16, seed=1)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=x)
    prog = pm.program(0)
    assert prog.grads.direct
    norm = prog.get_parameter("layers.0.attn_norm.weight")
    seen = []
    norm.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.data_ptr() == p.main_grad.data_ptr()))
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
    prog.train_step(x, opt)
    first = norm.grad
    loss = model(*x)
    (loss[1] if isinstance(loss, tuple) else loss).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(prog.get_parameter(name).grad, p.grad, rtol=0, atol=1e-6, msg=name)
    prog.train_step(x, opt)
    assert seen == [True, True]            # added in place, every backward
    assert norm.grad is first              # the buffer's view, every step: no per-step tensor
    half = fxtron.parallelize(build("llama-tiny", seed=0), fxtron.Mesh(1), example_inputs=x,
                              grad_reduce_dtype=torch.bfloat16).program(0)
    assert not half.grads.direct



def test_a_program_calls_its_aten_ops_directly_with_the_same_numbers():
    """codegen/calls.py: the bound graphs' forwards call each aten overload's entry point
    (`OpOverload._op`), not `torch.ops.aten.X.Y`'s Python frame -- the training graph's, the
    eval graph's and each uncompiled recomputed region's --; the code users read stays fx's, and a
    traceback reads the generated lines; the losses, gradients and eval loss are bitwise those of
    fx's own forward."""
    import copy
    import linecache
    from tp_models import batch, make
    model, (args, _) = make("gpt"), batch("gpt", 2, 8, seed=0)

    def graphs(prog):
        return [prog.graph_module] + [m.region for m in prog.graph_module.modules() if hasattr(m, "region")]

    got = {}
    for direct in (True, False):
        prog = fxtron.parallelize(copy.deepcopy(model), fxtron.Mesh(1), example_inputs=args,
                                  recompute="full").program(0)
        assert len(graphs(prog)) > 1, "recompute='full' outlines the layers into regions"
        for gm in graphs(prog):
            code = type(gm).forward.__code__
            if direct:
                assert code.co_filename.startswith("<fxtron-direct-calls") and "torch.ops.aten." in gm.code
                assert "_aten_" in "".join(linecache.getlines(code.co_filename))
            else:
                gm.recompile()                   # fx's own forward back
        loss = prog.train_step(args, torch.optim.SGD(prog.parameters(), lr=0.0))
        ev = prog.eval_step(args)
        assert type(prog.eval_graphs().gm).forward.__code__.co_filename.startswith("<fxtron-direct-calls")
        got[direct] = (loss, ev, {n: g.clone() for n, g in prog.full_grads().items()})
    assert got[True][:2] == got[False][:2], got
    assert all(torch.equal(got[True][2][n], g) for n, g in got[False][2].items())

"""The user's entry point: `parallelize(model, mesh, example_inputs=..., config=...) -> ParallelModel`.

Compile-only: tracing and the per-rank passes run here, with no processes. A ParallelModel
answers questions about any rank (`graph`, `summary`, `collectives`) and builds a rank's runnable
`program(rank)` inside that rank's process. Its reports are compiler/report.py's.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable

import torch
import torch.fx as fx

import sympy

from fxtron.codegen.calls import direct_calls
from fxtron.codegen.regions import Compiler
from fxtron.compiler import passmanager, report
from fxtron.compiler.show import format_graph
from fxtron.compiler.trace import check_example_sizes, trace
from fxtron.config import Config
from fxtron.core import meta
from fxtron.errors import ParallelizeError, warn_or_raise
from fxtron.mesh import Mesh
from fxtron.passes.cp_documents import check_documents
from fxtron.passes.ep import check_experts
from fxtron.passes.recompute import region_labels
from fxtron.passes.pp import StageAssignment, assign_stages
from fxtron.passes.tp_plan import TPPlan, find_layers, make_tp_plan, plan_matches, router_weights, unused_weights
from fxtron.runtime import groups as G
from fxtron.runtime.pp import schedules
from fxtron.runtime import materialize
from fxtron.runtime.batch import tensors_of
from fxtron.runtime.build import build_program
from fxtron.tools import step_comm
from fxtron.runtime.program import Program


def parallelize(model: torch.nn.Module, mesh: Mesh, *, example_inputs: tuple = (),
                example_kwargs: dict | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                config: Config | None = None, **options) -> "ParallelModel":
    """Compile `model` for every rank of `mesh`.

    Options come as a typed `config` (fxtron.config.Config: sections tensor, pipeline,
    data_parallel, context, experts, recompute, precision, debug, inputs) and/or as keyword
    shorthand for its fields, applied over it: `schedule="1f1b"` sets config.pipeline.schedule,
    `cp_comm_type=` config.context.comm_type, and so on (`Config.fields_by_shorthand()` lists
    them). Every value is checked before anything is traced: a ParallelizeError names the
    field, the value and the choices. `pm.config` is the resolved configuration.

    model(*example_inputs, **example_kwargs) must return the loss (a scalar tensor, or an
    output with `.loss`), or `loss_fn(output)` must take it from the output. The example
    batch must hold at least 2 samples of at least 2 tokens. The same call on every rank gives
    the same programs (tracing is deterministic).

    With mesh.tp > 1 the linears are split Megatron's way, found on the graph; `plan` maps
    module path patterns to "colwise" / "rowwise" / "vocab" / "replicate" (or
    fxtron.Colwise(gather_output=True), fxtron.Rowwise(input_is_parallel=False)) and
    refines the automatic plan (plan_mode="override") or replaces it ("replace").
    `sequence_parallel=True` (tp > 1) runs norms, dropout and residual adds on 1/tp of the
    tokens, with reduce-scatter / all-gather in place of each all-reduce (the sequence length
    must then be divisible by tp). `gradient_accumulation_fusion` (default on) accumulates each
    linear's weight gradient straight into an fp32 main_grad and defers it behind the
    tensor-parallel all-reduce of the input gradient. `dtype=torch.bfloat16` (or float16, with
    dynamic loss scaling) computes in 16 bits while the optimizer updates the fp32 parameters
    from fp32 gradients (Megatron's Float16Module and mixed-precision optimizer).

    Pipeline parallel (mesh.pp > 1): the graph is cut between transformer layers into pp
    stages (pp x virtual_stages for the interleaved schedule, 2pp in a V for zb-v), balanced by FLOPs and
    parameters or cut before the layers named in `split_points` (["blocks.6"]); `pm.stages()`
    shows the cut. Each step runs `microbatches` microbatches per data-parallel rank with
    `schedule` "gpipe", "1f1b" (default), "interleaved" (virtual_stages >= 2, microbatches a
    multiple of pp), "zb-h1" (weight gradients deferred into the bubbles; needs
    gradient_accumulation_fusion) or "zb-v" (two chunks per rank in a V, rank 0 holding the
    first and the last stage, weight gradients in the bubbles: 1F1B's activation memory, a
    bubble of (pp-1) chunk forwards). `scatter_gather=True` (tp > 1) sends each stage boundary
    as 1/tp slices and all-gathers it on arrival. microbatches > 1 without pipeline parallel
    is gradient accumulation.

    `trace_layers_once` (default): a model whose layers are one program over different weights
    is exported with two of them and the graph repeats the rest (the same graph, ~10x faster to
    trace a deep model); `pm.summary()` says which way it was traced. False exports it whole.

    `device` ("cuda" or "cpu"; default: cuda where torch sees a GPU) is the device type the
    programs will run on: the graphs record the kernels chosen for it (a bf16 linear's weight
    gradient runs the Triton kernel on CUDA) and name no device of another type, whatever
    device the model was built on (meta, the CPU); a rank's program runs on its own device.
    Inspect a GPU job's graphs on a laptop with device="cuda"; a program built on another
    device records its own kernels.

    Context parallel (mesh.cp > 1): every input that carries the sequence is split over the cp
    ranks, load-balanced as Megatron does (the sequence seen as 2 x cp chunks, cp rank r holding
    chunks r and 2cp-1-r, so causal attention costs every rank the same; the sequence length
    must be a multiple of 2 x cp), and attention exchanges keys and values: `cp_comm_type`
    "p2p" (default, Megatron's: key/value blocks travel around the cp ranks while a block is
    computed), "all_gather" (Llama 3's: keys and values gathered, their gradients
    reduce-scattered), "a2a" (DeepSpeed-Ulysses: all-to-alls from the sequence split to a head
    split and back) or "a2a+p2p" with `cp_a2a_size=k` (Megatron's hierarchical cp: a2a inside
    groups of k consecutive cp ranks, the ring across the groups). Weights are whole on every
    cp rank; their gradients are summed over cp. A mixture-of-experts layer routes each rank's
    own tokens: their copies sorted by expert on the rank (a rank-local order,
    passes/rules/order.py), nothing communicated over cp inside the experts.

    Expert parallel (mesh.ep > 1): each mixture-of-experts layer (grouped GEMMs over 3-D expert
    weights, found on the graph) holds E/ep experts per rank; the copies of the rank's tokens
    go to the ranks of their experts and come back by all-to-all, dropless (Megatron's
    dispatcher); the experts' gradients are reduced over expert-dp. Under cp the ep ranks are
    drawn from dp x cp, as Megatron's expert layout draws them.

    The model's own math (passes/statistics.py): what it computes over its batch is the global
    batch's, as in one process. A mean loss over tokens divides by the global batch's counted
    tokens (ignored labels spread unevenly over ranks and microbatches change nothing), a loss
    summed over tokens stays a sum, and a statistic the loss uses nonlinearly (a load-balancing
    loss's tokens per expert and router probabilities) is summed over the data-parallel ranks,
    per microbatch as gradient accumulation computes it. `moe_aux_loss="local"` (Megatron's
    default) opts out of the last: each dp rank's own statistics, a change of the model the
    summary names. BatchNorm in training normalizes with every dp rank's samples (SyncBatchNorm;
    with microbatches > 1 an error); a contrastive loss over in-batch negatives (InfoNCE, CLIP)
    gathers the negatives over dp. A reduction over the batch fxtron cannot make global, and other
    math across the batch dim (a softmax over the batch), is a ParallelizeError.
    Routing is dropless (the single-process model's); `moe_capacity_factor=c` opts into
    Switch/GShard capacity instead: each expert takes at most ceil(c x k T / E) of each rank's k T
    copies (the first in token order), the rest dropped -- a change of the model, since which
    tokens drop depends on how the batch is split; `prog.last_dispatch.dropped` counts them.
    With it, `moe_pad_to_capacity=True` pads every expert's rows with zeros to that capacity
    (Megatron's moe_pad_expert_input_to_capacity): every all-to-all then has the same splits
    and every expert GEMM the same shape whatever the routing (no number changes; more bytes).

    Activation recomputation (Megatron's --recompute-granularity / --recompute-method /
    --recompute-num-layers): `recompute="selective"` keeps no activation of any attention core
    (scores, softmax, attention dropout: the 5as/h term) and recomputes them in backward from q,
    k and v; `recompute="full"` keeps only the inputs of whole layers -- `recompute_method`
    "uniform" (default) in groups of `recompute_layers` (default 1) consecutive layers, "block"
    only the first `recompute_layers` layers of every pipeline stage. Dropout draws the same
    masks again (the random streams are set back), a recomputed layer's collectives run again,
    and the gradients are the run's without recomputation bit for bit.

    Never silent: where fxtron does less than the mesh asks, correctly -- a linear left
    replicated at tp > 1, an op with no sharding rule run replicated on gathered inputs -- it
    warns (fxtron.ParallelizeWarning) and `pm.summary()` lists each with why; `strict=True`
    raises ParallelizeError instead.
    """
    if not isinstance(mesh, Mesh):
        raise ParallelizeError(f"mesh must be a fxtron.Mesh, got {type(mesh).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ParallelizeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = resolve_config(config, options)
    config.check(mesh)
    unsharded = report.unsharded_zero(config, mesh)
    if unsharded:
        warn_or_raise(unsharded, strict=config.debug.strict,
                      fix=": use a mesh with dp x cp > 1, or zero=0", stacklevel=2)
    seq_dim, sequence_parallel = config.inputs.seq_dim, config.tensor.sequence_parallel
    wide = next((n for n, p in model.named_parameters() if p.dtype == torch.float64), None)
    if wide is not None and mesh.tp > 1:
        raise ParallelizeError(
            f"parameter {wide} is float64: tensor parallel's ops (the vocab-parallel cross entropy, the fused "
            "weight-gradient kernels, the shared-memory transport) compute in 32 bits or less, so a float64 model "
            "would not keep float64 precision at tp > 1; use model.float() (or bfloat16 with dtype=), or tp=1 "
            "(data, pipeline and context parallel keep float64)")
    # a 16-bit program is traced in 16 bits (casts such as a norm's .float() ... .type_as(x) only
    # mean something then), on a meta replica so the model's weights are never copied
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ParallelizeError(f"example_kwargs holds the model's keyword inputs as a dict (name -> tensor), not a "
                               f"{type(example_kwargs).__name__}; positional inputs go in example_inputs")
    if isinstance(example_inputs, (tuple, list, torch.Tensor)):
        check_example_sizes(example_inputs, example_kwargs, config.inputs.batch_dim, seq_dim)
    dtype = config.precision.torch_dtype
    subject = materialize.meta_replica(model, dtype) if dtype is not None else model
    traced = trace(subject, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                   batch_dim=config.inputs.batch_dim, seq_dim=seq_dim, layers_once=config.inputs.trace_layers_once)
    if dtype in (torch.bfloat16, torch.float16):
        _check_gemm_dtypes(traced, dtype)
    if mesh.cp > 1 and not any("seq" in dims for dims in meta.info(traced).user_dims):
        raise ParallelizeError(
            f"context parallel splits the sequence, but no input of the model has a sequence dim (seq_dim={seq_dim}; "
            f"the inputs' shapes are {', '.join(str(tuple(x.shape)) for x in tensors_of((example_inputs, example_kwargs)))})"
            "; give the dim that holds the sequence")
    ti = meta.info(traced)
    fixed = [i for i, (dims, sig) in enumerate(zip(ti.user_dims, ti.signature))
             if sig is not None and "seq" in dims and not sympy.sympify(sig[1][dims.index("seq")]).free_symbols]
    if (sequence_parallel or mesh.cp > 1) and fixed:
        lengths = sorted({int(ti.signature[i][1][ti.user_dims[i].index("seq")]) for i in fixed})
        ones = [i for i in fixed if int(ti.signature[i][1][ti.user_dims[i].index("seq")]) == 1]
        if ones:
            shapes = [tuple(int(d) if not sympy.sympify(d).free_symbols else str(d) for d in ti.signature[i][1])
                      for i in ones]
            raise ParallelizeError(
                f"{'sequence parallel' if sequence_parallel else 'context parallel'} splits dim seq_dim={seq_dim} of "
                f"every input as the sequence, but input {ones[0]} (traced as {shapes[0]}) has size 1 there: that dim "
                "is not its sequence but one it broadcasts (a 4-D attention mask's head dim, (B, 1, S, S)); pass the "
                "mask as (B, S) (transformers builds its 4-D mask from it) or position_ids for packed documents; a "
                "per-sample mask of another form (a prefix-LM's) cannot be split over the sequence")
        squares = [(i, d) for i in fixed for d, (role, e) in enumerate(zip(ti.user_dims[i], ti.signature[i][1]))
                   if role is None and not sympy.sympify(e).free_symbols and int(e) in lengths]
        if squares:
            i, d = squares[0]
            shape = tuple(int(e) if not sympy.sympify(e).free_symbols else str(e) for e in ti.signature[i][1])
            raise ParallelizeError(
                f"{'sequence parallel' if sequence_parallel else 'context parallel'} splits dim seq_dim={seq_dim} of "
                f"every input as the sequence, but the trace fixed its length to the example's ({lengths[0]}), and "
                f"input {i} (traced as {shape}) has that length in dim {d} too. If it is a mask of queries by keys, "
                "per sample, torch.export fixed the length there: a per-sample (S, S) mask given as an input cannot "
                "be split over the sequence -- pass a (B, S) padding mask, or position_ids (and a document-id input "
                "with cp_documents) for packed documents, from which the model builds its mask; an (S, S) mask the "
                "same for every sample can be one (S, S) input. If not, the length was fixed by something the model "
                "equates with a constant -- typically a position table or causal-mask buffer as long as the "
                "example: trace with a shorter example sequence")
        raise ParallelizeError(
            f"{'sequence parallel' if sequence_parallel else 'context parallel'} splits the sequence, but the trace "
            f"fixed its length to the example's ({', '.join(map(str, lengths))}): torch.export specializes a length "
            f"the model equates with a constant -- typically a position table or causal-mask buffer as long as the "
            f"example (slicing [:T] of a {lengths[0] if lengths else '?'}-long buffer). Trace with a shorter example "
            f"sequence (the programs still take any length up to the model's limit)")
    _check_batch_not_fixed(ti, mesh.dp * config.pipeline.microbatches, config.inputs.batch_dim,
                           tensors_of((example_inputs, example_kwargs)))
    if mesh.ep > 1:
        check_experts(traced, mesh.ep)     # experts that do not divide over ep: an error now
    if config.context.documents is not None:   # THD: proved not to change the model's numbers, or an error now
        ti.documents = check_documents(traced, config.context.documents)
    # the model-wide passes, once for every rank: a batch statistic it cannot make global is an error now
    prepared = passmanager.prepare(traced, mesh, config=config)
    pm = ParallelModel(model, mesh, traced, config, prepared=prepared)
    # evaluation runs the model's eval-mode graph (dropout off, norms on running statistics),
    # traced the same way when a program first evaluates
    pm._trace_eval = functools.partial(_trace_in_eval_mode, subject, example_inputs, example_kwargs=example_kwargs,
                                       loss_fn=loss_fn, batch_dim=config.inputs.batch_dim, seq_dim=seq_dim,
                                       layers_once=config.inputs.trace_layers_once)
    pm._check_plan()
    pm.stage_assignment            # a bad stage cut is an error now, not at the first program
    return pm


#: ops whose floating operands must share a dtype (eager raises "mat1 and mat2 must have the same dtype")
_GEMMS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
          torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
          torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
          torch.ops.aten.convolution.default}


def _check_gemm_dtypes(traced, dtype: torch.dtype) -> None:
    """ParallelizeError where a 16-bit program's traced GEMM multiplies a wider float the user
    passed with its 16-bit weights (fp32 features under dtype=bf16: a crash at the first step).
    Megatron's Float16Module casts the first stage's inputs; fxtron leaves inputs as given (a
    loss mask, or a value the model reads in fp32, keeps its precision) and names the one to cast."""
    def origin(n):      # the user input a value comes from through reshapes and casts, if any
        while isinstance(n, fx.Node) and n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        spec = meta.get(n, meta.INPUT) if isinstance(n, fx.Node) else None
        return spec if spec is not None and spec.kind == "user" else None
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.target not in _GEMMS:
            continue
        floats = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                  and a.meta["val"].is_floating_point()]
        if len({a.meta["val"].dtype for a in floats}) < 2:
            continue
        wide = next((a for a in floats if a.meta["val"].dtype != dtype), None)
        spec = origin(wide)
        given = f"user input {spec.index} ({wide.meta['val'].dtype})" if spec is not None else \
            f"%{wide.name} ({wide.meta['val'].dtype})"
        raise ParallelizeError(
            f"%{node.name} ({meta.get(node, meta.MODULE) or 'top level'}) multiplies {given} with {dtype} weights: "
            f"under dtype={dtype} the program computes with 16-bit weights, and fxtron leaves float inputs as given "
            f"(a loss mask or a value the model reads in fp32 keeps its precision); pass that input as {dtype} "
            f"(x.to({dtype})), as Megatron's Float16Module casts the first stage's inputs")


def _check_batch_not_fixed(ti, pieces: int, batch_dim: int, examples: list) -> None:
    """ParallelizeError where the trace fixed the batch size (torch.export specializes a size
    the model reads as a Python number) and the step cuts the batch into `pieces` (dp x
    microbatches): each piece would run a program that believes it holds the whole example
    batch (a sum over the batch divided by float(B) would give each rank half the loss). An
    input static at batch_dim with another size than the example's batch (most `examples`'
    size there) is not a batch: the step refuses it for what it is."""
    if pieces == 1:
        return
    sizes = collections.Counter(x.shape[batch_dim] for x in examples if x.dim() > batch_dim)
    batch = sizes.most_common(1)[0][0] if sizes else None
    for i, (dims, sig) in enumerate(zip(ti.user_dims, ti.signature)):
        if sig is None or "batch" not in dims:
            continue
        size = sig[1][dims.index("batch")]
        if not sympy.sympify(size).free_symbols and int(size) > 1 and int(size) == batch:
            shape = "(" + ", ".join(str(d) for d in sig[1]) + ")"
            raise ParallelizeError(
                f"the trace fixed the batch size at the example's {int(size)} (input {i}, traced as {shape}): the "
                f"model reads its batch size as a Python number -- float(x.shape[{batch_dim}]), int(...), "
                f"math.log(x.shape[{batch_dim}]), a Python loop over the rows -- or equates it with a buffer's size, "
                f"and torch.export specializes it; cut into {pieces} pieces (dp x microbatches), each would run as "
                f"if it held {int(size)} rows. Keep the size a tensor expression (loss.sum() / x.shape[{batch_dim}] "
                f"without float(), or .mean()), or run with dp=1 and microbatches=1 on batches of {int(size)}")


def _trace_in_eval_mode(model: torch.nn.Module, example_inputs, **options) -> fx.GraphModule:
    """`trace` of `model` with every module in eval mode (dropout off, BatchNorm on its
    running statistics, nothing updated); the modules' modes are restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return trace(model, example_inputs, **options)
    finally:
        for m, training in modes:
            m.training = training


def resolve_config(config: Config | None, options: dict) -> Config:
    """`config` (default: the defaults) with the keyword shorthand applied, every value checked,
    and the device made concrete. Old spellings still taken: dtype=None is fp32, a
    torch.device or "cuda:1" names its type."""
    if config is not None and not isinstance(config, Config):
        raise ParallelizeError(f"config must be a fxtron.config.Config, got {type(config).__name__}")
    options = dict(options)
    if "dtype" in options and options["dtype"] is None:
        options["dtype"] = "fp32"
    if isinstance(options.get("device"), (str, torch.device)):
        try:       # "cuda:1" or a torch.device names its type; anything else the config refuses by name
            options["device"] = torch.device(options["device"]).type
        except (RuntimeError, TypeError):
            pass
    config = (config if config is not None else Config()).replace(**options)
    made = sorted(k for k in ("shm", "check_collectives", "flight_dir") if k in options)
    if made:
        warn_or_raise(f"{', '.join(made)} take effect where the process groups are made -- fxtron.launch(..., "
                      f"shm_transport=, check_collectives=, flight_dir=) or fxtron.init_distributed(..., "
                      f"shm_transport=, check_collectives=) -- not in parallelize, whose programs use the groups as "
                      f"they were made", strict=config.debug.strict,
                      fix=": give them to launch or init_distributed (or set FXTRON_SHM, FXTRON_CHECK_COLLECTIVES, "
                          "FXTRON_FLIGHT_DIR)", stacklevel=3)
    if config.inputs.device is None:
        config = config.replace(device=config.inputs.resolved_device())
    return config


def _init_note(model) -> str:
    """How a model built on the meta device is initialized, shard by shard, per parameter
    (runtime/materialize.py): which init wrote it and what it drew; the buffers its init
    computes; what is made whole first or got fxtron's default. '' for a model with values."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return ""
    m = materialize.MetaMaterializer(model, 0)
    m._ensure()
    text = "initialization (built on meta: each rank makes its own shards): " + report.grouped(m.init_of)
    if m.buffers:
        text += f"; buffers computed by the init: {', '.join(sorted(m.buffers))}"
    if m.uncomputed:
        text += f"; meta buffers no init computes (pm.program will refuse them): {report._few(m.uncomputed)}"
    if m.defaulted:
        text += f"; no init of their own, fxtron's default given: {report._few(m.defaulted)}"
    return text


#: a model configuration's head counts: (query fields, key/value fields), the first present of each
_HEAD_FIELDS = (("num_attention_heads", "n_head", "num_heads", "n_heads"),
                ("num_key_value_heads", "n_kv_head", "num_kv_heads", "n_kv_heads"))


def head_counts(model: torch.nn.Module) -> dict[str, int]:
    """The head counts a model's configuration states ({'num_attention_heads': 32,
    'num_key_value_heads': 8}; transformers' and fxtron's own field names), {} if none."""
    cfg = getattr(model, "config", None)
    out = {}
    for names in _HEAD_FIELDS:
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out[name] = value
                break
    return out


def _check_heads(model: torch.nn.Module, tp: int, unsplit: dict[str, str]) -> None:
    """A head count tp does not divide is a ParallelizeError naming the configuration's fields
    and the tp values that work, where it left linears replicated that Megatron would split
    (attention cannot be cut between heads). A plan that replicates the attention on purpose
    leaves none of them unsplit, and passes."""
    heads = head_counts(model)
    bad = {n: v for n, v in heads.items() if v % tp}
    cut = sorted(p for p, why in unsplit.items() if "cannot be split" in why)
    if not bad or not cut:
        return
    g = math.gcd(*heads.values())
    works = [d for d in range(2, g + 1) if g % d == 0]
    fields = ", ".join(f"{n}={v}" for n, v in heads.items())
    glob = sorted({".".join("*" if part.isdigit() else part for part in p.split(".")) for p in cut})
    choose = (f"Choose a tp that divides them ({', '.join(map(str, works))})" if works
              else "No tp > 1 divides them: use tp=1")
    keep = ", ".join(f"'{pattern}': 'replicate'" for pattern in glob)
    raise ParallelizeError(
        f"tp={tp} does not divide the model's head counts ({fields}): attention splits over tp by whole heads "
        f"(Megatron's), so {len(cut)} linear(s) could not be split ({', '.join(glob)}). {choose}, or keep the "
        f"attention whole on purpose: plan={{{keep}}}")


def _used_params(gm: fx.GraphModule) -> set[str]:
    """The parameters `gm` reads (a placeholder with users), by name."""
    return {name for node in gm.graph.nodes
            if node.op == "placeholder" and node.users and (name := meta.param_name(node)) is not None}


class ParallelModel:
    """The compiled model: per-rank graphs and programs for every rank of the mesh."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, traced: fx.GraphModule, config: Config,
                 prepared: fx.GraphModule | None = None):
        self.model = model
        self.mesh = mesh
        self.traced = traced
        self.config = config
        self._prepared = prepared     # traced after the model-wide passes (passmanager.prepare)
        self._compiled: dict[int, passmanager.RankGraph] = {}   # rank -> its compilation, made once
        self._compiled_eval: dict[int, passmanager.RankGraph] = {}   # rank -> its eval graph's compilation
        self._trace_eval: Callable[[], fx.GraphModule] | None = None   # parallelize sets it
        self._warned: set[str] = set()     # each kind of warning once per model, not per rank

    @functools.cached_property
    def tp_plan(self) -> TPPlan | None:
        """The model's tensor-parallel plan (passes/tp_plan.py), made once for every rank: which
        linears split by columns / rows, every parameter's tp placement. None at tp=1."""
        t = self.config.tensor
        if self.mesh.tp == 1:
            if t.plan:       # its entries checked all the same: a misspelt one is found on a one-process run too
                make_tp_plan(self.traced, tp=1, user_plan=t.plan, mode=t.plan_mode)
            return None
        return make_tp_plan(self.traced, tp=self.mesh.tp, user_plan=t.plan, mode=t.plan_mode)

    @functools.cached_property
    def stage_assignment(self) -> StageAssignment | None:
        """Which layers each pipeline stage runs (None at pp=1), made once for every rank."""
        if self.mesh.pp == 1:
            return None
        p = self.config.pipeline
        return assign_stages(self.traced, pp=self.mesh.pp, virtual=p.chunks,
                             split_points=list(p.split_points) if p.split_points else None,
                             v_shape=p.schedule == "zb-v")

    def _warn_once(self, kind: str, message: str, *, fix: str, advice: str = "") -> None:
        """warn_or_raise the first time a kind of shortfall is found on this model."""
        if kind not in self._warned:
            self._warned.add(kind)
            warn_or_raise(message, strict=self.config.debug.strict, fix=fix, advice=advice, stacklevel=4)

    def _check_plan(self) -> None:
        """Warn (strict: raise) when the tp plan leaves linears replicated that Megatron would split,
        and when expert parallel under tp moves more than Megatron's dispatcher."""
        note = report.ep_tp_note(self.mesh, self.traced, self.tp_plan)
        if note:
            self._warn_once("ep_tp", note, fix="; use tp=1 with ep, or strict=False")
        plan = self.tp_plan
        loud = plan.unsplit() if plan is not None else {}
        _check_heads(self.model, self.mesh.tp, loud)
        if loud:
            self._warn_once("unsplit", f"at tp={self.mesh.tp}, {len(loud)} linear(s) stay replicated (every tp rank "
                            f"holds and computes them whole): {report.grouped(loud)}",
                            fix=". Give each a style in plan= ('colwise', 'rowwise'), or 'replicate' to keep it whole "
                                "on purpose")

    def fallbacks(self, rank: int = 0) -> list[str]:
        """The ops of rank's graphs that had no sharding rule for their inputs' placements and
        run replicated on inputs made whole (a correct fallback that communicates more than
        Megatron would): one line each, naming the node, its op, module and axis."""
        return report.fallback_lines(self.compiled(rank).graphs)

    def gathers(self, rank: int = 0) -> list[str]:
        """The all-gathers in rank's graphs that make a split value whole because an op's
        sharding rule needs it whole (BLOOM's batch and heads folded into one dim, say): not
        the gathers a plan asks for (gather_output) or sequence parallel's into a region. One
        line each: the node, its module, and which value went whole for which op."""
        return report.gather_lines(self.compiled(rank).graphs)

    def stages(self) -> StageAssignment:
        """Which layers each pipeline stage runs, with its parameters and FLOPs (`str()` prints
        a table); ParallelizeError without pipeline parallel."""
        if self.stage_assignment is None:
            raise ParallelizeError("the mesh has pp=1: the whole model is one stage")
        return self.stage_assignment

    def schedule_chart(self, path: str, timelines: list | None = None, *, memory: list | None = None,
                       t_f=1, t_b=1, t_w=1) -> str:
        """Draw the schedule of every pipeline rank as a timeline picture at `path` (.png or
        .svg): the measured `timelines` (each rank's `prog.timeline()` from a step; ranks in
        mesh order, one per pipeline rank) or, by default, the simulation of the compiled
        schedule with pass times t_f, t_b (input gradient), t_w (weight gradient: its own pass
        under zb-h1, part of B otherwise); unit costs by default. With measured timelines,
        `memory` (each rank's `prog.memory_timeline()` of the same step) is drawn below on the
        same time axis. Returns the path."""
        from fxtron.tools import chart
        p = self.config.pipeline
        if timelines is None:
            sim = schedules.simulate(p.schedule, self.mesh.pp, p.microbatches, p.chunks,
                                     t_f=t_f, t_b=t_b, t_w=t_w)
            return chart.draw_simulation(sim, path, title=self._schedule_title())
        return chart.draw_timelines(timelines, path, title=self._schedule_title(), memory=memory)

    def _schedule_title(self) -> str:
        p = self.config.pipeline
        v = f", v={p.virtual_stages}" if p.schedule == "interleaved" else ""
        return f"{p.schedule}: pp={self.mesh.pp}, m={p.microbatches}{v}"

    def compiled(self, rank: int, dump: str | None = None) -> passmanager.RankGraph:
        """The per-rank compilation result (graph module and parameter shard specs), made once
        per rank. With `dump` (or config.debug.dump, FXTRON_DUMP's default) a directory, the
        graph after every pass is written there as readable Python (rank<r>/<nn>_<pass>.py)."""
        self._check_rank(rank)
        if dump is None and rank in self._compiled:
            return self._compiled[rank]
        dump = dump or self.config.debug.dump
        observer = None
        if dump:
            from fxtron.tools.inspect import PassDump
            observer = PassDump(dump, rank)
        rg = passmanager.compile_rank(self.traced, self.mesh, rank, plan=self.tp_plan,
                                      stage_assignment=self.stage_assignment, config=self.config, observer=observer,
                                      prepared=None if observer is not None else self._prepared)
        self._compiled.setdefault(rank, rg)
        self._check_compiled(rank, rg)
        return rg

    @functools.cached_property
    def eval_traced(self) -> fx.GraphModule:
        """The model traced in eval mode (dropout off, BatchNorm on its running statistics,
        no buffer updated): what `prog.eval_step` and an eval-mode program run. Traced on first
        use; its parameters must be the training graph's, in the same order."""
        if self._trace_eval is None:
            raise ParallelizeError("this ParallelModel was not made by fxtron.parallelize: it has no eval-mode trace")
        gm = self._trace_eval()
        train, ev = meta.info(self.traced), meta.info(gm)
        if list(ev.params) != list(train.params):
            raise ParallelizeError(
                f"the model traced in eval mode has other parameters than in training mode (only in training: "
                f"{sorted(set(train.params) - set(ev.params))[:4]}, only in eval: "
                f"{sorted(set(ev.params) - set(train.params))[:4]}): evaluation must run on the training weights")
        if self.config.context.documents is not None:
            ev.documents = check_documents(gm, self.config.context.documents)
        return gm

    @functools.cached_property
    def _eval_prepared(self) -> fx.GraphModule:
        return passmanager.prepare(self.eval_traced, self.mesh, config=self.config)

    @functools.cached_property
    def _eval_used(self) -> set[str]:
        """The parameters the eval graph reads (one trained only -- an auxiliary head -- it holds
        as a placeholder no op reads)."""
        return _used_params(self.eval_traced)

    @functools.cached_property
    def _eval_plan(self) -> TPPlan | None:
        """The eval graph's tp plan: its layers are found on that graph (node names), and it
        must split every parameter it uses as the training plan does. Layers used in training
        only (an auxiliary head, a training-only loss) are not in it: plan entries naming only
        them (checked on the training graph) are left out."""
        if self.mesh.tp == 1:
            return None
        t = self.config.tensor
        used = self._eval_used
        layers = find_layers(self.eval_traced)      # entries name layers (a tied head's weight has
        user_plan = None if t.plan is None else {   # its embedding's name), or parameters kept whole
            k: v for k, v in t.plan.items() if plan_matches(k, layers) or plan_matches(k, used)}
        plan = make_tp_plan(self.eval_traced, tp=self.mesh.tp, user_plan=user_plan, mode=t.plan_mode)
        train = self.tp_plan
        differ = sorted(n for n in used if plan.params.get(n) != train.params.get(n)
                        or plan.interleave.get(n) != train.interleave.get(n))
        if differ:
            raise ParallelizeError(f"the model in eval mode splits its parameters over tp otherwise than in training "
                                   f"({', '.join(differ[:4]) or 'interleaving'}): evaluation cannot share the weights")
        return plan

    def compiled_eval(self, rank: int) -> passmanager.RankGraph:
        """Rank's compilation of the eval-mode graph (`eval_traced`), made once per rank with the
        training graph's tp plan and stage assignment: the same parameters, shards and pieces
        as `compiled(rank)` (checked), so a program runs both on one set of weights."""
        self._check_rank(rank)
        if rank in self._compiled_eval:
            return self._compiled_eval[rank]
        train = self.compiled(rank)
        rg = passmanager.compile_rank(self.eval_traced, self.mesh, rank, plan=self._eval_plan,
                                      stage_assignment=self.stage_assignment, config=self.config,
                                      prepared=self._eval_prepared)
        # the parameters the eval graph reads, laid out alike (gradient fields aside)
        def layout(lp):
            return None if lp is None else (lp.local_shape, lp.dtype, lp.shards, lp.flat)
        used = self._eval_used
        differ = sorted(n for n in rg.local if n in used and layout(rg.local[n]) != layout(train.local.get(n)))
        if differ or any(train.shared.get(n) != ranks for n, ranks in rg.shared.items() if n in used):
            raise ParallelizeError(
                f"rank {rank}: the eval-mode graph holds its parameters otherwise than the training graph "
                f"({', '.join(differ[:4]) or 'tied weights'}): evaluation cannot share the weights")
        self._compiled_eval.setdefault(rank, rg)
        return rg

    def _check_compiled(self, rank: int, rg: passmanager.RankGraph) -> None:
        """Warn (strict: raise) of what a rank's compilation does less well than asked."""
        fell = report.fallback_lines(rg.graphs)
        if fell:
            self._warn_once("fallbacks", f"{len(fell)} op(s) have no sharding rule for their inputs' placements and "
                            f"run replicated on gathered inputs (correct, more communication than Megatron): "
                            f"{'; '.join(fell)}", fix=". Register a rule with fxtron.register_rule",
                            advice=". Register a rule with fxtron.register_rule, or pass strict=True to make this an "
                                   "error")
        if self.mesh.tp > 1:
            _, held = report.held_whole(rg.local, self.tp_plan, self._routers, self._unused)
            unruled = [h for h in held if h.why == report.NO_RULE]
            if unruled:
                total = sum(math.prod(lp.full_shape) for lp in rg.local.values())
                names = [n for h in unruled for n in h.names]
                self._warn_once("held_whole", f"at tp={self.mesh.tp}, {len(names)} parameter(s) "
                                f"({100 * sum(h.numel for h in unruled) / total:.1f}% of rank {rank}'s model "
                                f"parameters) have no rule that splits them and are held whole on every tp rank: "
                                f"{', '.join(report.by_pattern({n: '' for n in names}))}",
                                fix=f". Keep them whole on purpose with plan={{{names[0]!r}: 'replicate'}} (a "
                                    "pattern or module path may name several), or register a rule that splits "
                                    "their ops (fxtron.register_rule)")
        gathered = report.gather_lines(rg.graphs)
        if gathered:
            self._warn_once("gathers", f"{len(gathered)} all-gather(s) on rank {rank} make a split value whole for an "
                            f"op whose sharding rule needs it whole (correct, communication Megatron's layers would "
                            f"not issue): {'; '.join(gathered)}",
                            fix=". Replicate the layers named after 'split by' (parallelize(..., plan={'<layer>': "
                                "'replicate'})), or register a rule that keeps the value split (fxtron.register_rule)")
        if self.config.recompute.granularity == "selective" and not all(region_labels(g) for g in rg.graphs):
            self._warn_once("recompute", f"recompute='selective' found no attention core to recompute on rank {rank} "
                            f"(a matmul -> softmax -> [dropout] -> matmul whose scores and probabilities have no other "
                            f"use, or an attention op); its activations are kept",
                            fix=": use recompute='full' (a model with a layer list) or None, or write the attention as "
                                "those ops")
        m = self.config.pipeline.microbatches
        stats = meta.info(rg.gm).statistics_report
        if m > 1 and stats is not None and stats.per_microbatch:
            self._warn_once("per_microbatch", report.per_microbatch_note(self.mesh, m, stats.per_microbatch),
                            fix=": train with microbatches=1 (a larger batch per step), or write the loss so that it "
                                "uses them linearly",
                            advice=" (a change of the model that pm.summary() says too; strict=True makes it an error)")
        comm = self.config.context.comm_type
        unringed = report.unringed_attention(rg.graphs) if comm != "all_gather" else []
        if unringed:
            self._warn_once("unringed", f"attention written out by hand ({', '.join(unringed)}) exchanges keys and "
                            f"values over cp by all-gather (cp_comm_type='all_gather'); cp_comm_type={comm!r} "
                            "takes scaled_dot_product_attention",
                            fix=": call F.scaled_dot_product_attention in the model, or pass "
                                "cp_comm_type='all_gather'")

    @functools.cached_property
    def _routers(self) -> set[str]:
        """The parameters that pick experts (tp_plan.router_weights on the traced graph)."""
        return router_weights(self.traced)

    @functools.cached_property
    def _unused(self) -> set[str]:
        """The parameters the traced forward never reads (tp_plan.unused_weights)."""
        return unused_weights(self.traced)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ParallelizeError(f"rank must be an int in 0..{self.mesh.world_size - 1}, not {rank!r} "
                                   f"({type(rank).__name__})")
        if not 0 <= rank < self.mesh.world_size:
            raise ParallelizeError(f"rank {rank} is outside the mesh (world_size {self.mesh.world_size})")

    # ------------------------------------------------------------ inspection
    def graph(self, rank: int = 0) -> str:
        """The per-rank graph as a table: every node with its local symbolic shape."""
        rg = self.compiled(rank)
        if rg.stages is None:
            return format_graph(rg.gm, title=f"# {self.mesh.describe(rank)}")
        return "\n\n".join(
            format_graph(s.gm, title=f"# {self.mesh.describe(rank)}, stage {s.index} (chunk {i}): "
                         f"receives {', '.join(s.inputs) or '-'}; sends {', '.join(s.outputs) or '-'}")
            for i, s in enumerate(rg.stages))

    def collectives(self, rank: int = 0, *, graphs_only: bool = False) -> list[report.CollectiveRecord]:
        """Every collective and transfer rank issues in a step, with its group, local shape and
        bytes as formulas in B and S (B a microbatch's batch): its graphs' (forward and
        backward, over whichever mesh axis each communicates), then, unless `graphs_only`, the
        pipeline's sends and receives per microbatch, the data-parallel gradient reduction per
        bucket, the sums after backward and the loss's (fxtron/tools/step_comm.py; `per` says which
        run per microbatch and which per step). `report.format_collectives(...)` prints them;
        `step_comm.step_bytes(records, microbatches, batch, seq)` totals what the rank sends."""
        out = [r for g in self.compiled(rank).graphs for r in report.collectives(g, self.mesh, rank)]
        if not graphs_only:
            out += step_comm.step_records(self, rank)
        return out

    def summary(self, *, batch: int | None = None, seq: int | None = None) -> str:
        """Per rank: coordinates, local parameters and bytes, tensor-parallel collectives and
        the bytes they move per step (formula in B and S, evaluated when batch and seq are
        given), and the data-parallel gradient sync. Ranks that differ only in their dp
        coordinate compile to the same program and are shown once.

        With microbatches (pipeline parallel or gradient accumulation) B is one microbatch of
        one rank and the tp figures are per microbatch; the table then also gives each rank's
        pipeline stages and the bytes it sends to its neighbours per microbatch (activations
        forward, their gradients backward)."""
        for name, n in (("batch", batch), ("seq", seq)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ParallelizeError(f"summary({name}={n!r}): the {name} the figures are evaluated at is a "
                                       "positive int")
        p = self.config.pipeline
        bubble = ""
        if self.stage_assignment is not None:
            bubble = str(schedules.bubble_fraction(p.schedule, self.mesh.pp, p.microbatches, p.chunks))
        return report.summary(model=self.model, mesh=self.mesh, traced=self.traced, config=self.config,
                              tp_plan=self.tp_plan, stage_assignment=self.stage_assignment, compiled=self.compiled,
                              schedule=self._schedule_title(), bubble=bubble, batch=batch, seq=seq,
                              init=_init_note(self.model), step_records=lambda r: step_comm.step_records(self, r))

    # ------------------------------------------------------------ running
    def program(self, rank: int, groups: G.ProcessGroups | None = None, *, seed: int = 0) -> Program:
        """An nn.Module holding rank's parameters, ready for an optimizer and `train_step`.

        `seed` seeds the program's random streams (dropout): the replicated stream alike on
        every rank, the sharded one per tp rank (Megatron's seed + 2718 + tp_rank).

        `groups` defaults to the ones fxtron.launch / init_distributed made in this process for
        this mesh; on a 1-rank mesh none are needed.

        `prog.eval_step` (and `prog(...)` after `prog.eval()`) runs the model's eval-mode graph,
        compiled for the rank on first use (`compiled_eval`) over the same parameters.
        """
        self._check_rank(rank)
        groups = groups or G.groups_for(self.mesh)
        if groups is None and self.mesh.world_size > 1:
            raise ParallelizeError(
                f"program({rank}) needs this mesh's process groups: call it inside fxtron.launch, or "
                "after fxtron.init_distributed(mesh) under torchrun, or pass groups=")
        if groups is not None and groups.rank != rank:
            raise ParallelizeError(f"program({rank}) built in the process of rank {groups.rank}")
        return build_program(self.model, self.compiled(rank).spec(), groups, self.config, seed=seed,
                             eval_spec=lambda: self.compiled_eval(rank).spec(),
                             compiler=Compiler(comm=passmanager.linears_in_regions(self.config, self.mesh.view(rank)))
                             if self.config.codegen.compile else None, emit=direct_calls)

"""Core, configuration sections: the typed tree `parallelize` takes -- one frozen dataclass per
section, each checking its fields together (`_rules`) and against the mesh (`check`), and
`Config`, the tree of them, whose fields are set by shorthand (`Config.replace`).

Sections are grouped as Megatron-core groups its configs (ModelParallelConfig, TransformerConfig's
recompute and moe fields, DistributedDataParallelConfig, OptimizerConfig) and torchtitan its job
config (parallelism, activation checkpointing, training):

    Config                        what parallelize takes
      inputs          batch and sequence dims of the example, tracing, the programs' device
      tensor          the tp plan, its mode, sequence parallel
      pipeline        microbatches, schedule, virtual stages, split points, scatter/gather
      data_parallel   buckets, reduce dtype, overlap, the distributed optimizer, clipping
      context         how attention exchanges keys over cp
      experts         the load-balancing loss's statistics, capacity, padding
      recompute       activation recomputation (Megatron's --recompute-*)
      precision       compute dtype, weight-gradient fusion
      codegen         each rank's program compiled by Inductor, its step captured in a CUDA graph
      debug           strict, the verifier, the collective check, the flight recorder, dumps

The trainer's tree (fxtron/trainer/config.py: TrainConfig) subclasses `Config` with its own
sections; nothing here knows it.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from fxtron.config import toml
from fxtron.config.fields import Section, _closest, _shorthand, env_flag, env_str, option, torch_dtype
from fxtron.errors import ParallelizeError

# ----------------------------------------------------------------------------- choices
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
PlanMode = Literal["override", "replace"]
CPCommType = Literal["p2p", "all_gather", "a2a", "a2a+p2p"]
AuxLoss = Literal["local", "global"]
Granularity = Literal["selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
DType = Literal["fp32", "bf16", "fp16"]
Device = Literal["cpu", "cuda"]
ZeroStage = Literal[0, 1, 2, 3]


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class InputsConfig(Section):
    """The example batch's layout, how it is traced, and where the programs run."""

    _name = "inputs"
    batch_dim: int = option(0, minimum=0, help="the inputs' batch dim")
    seq_dim: int | None = option(1, minimum=0, help="the inputs' sequence dim (None: the inputs have none)")
    trace_layers_once: bool = option(True, help="export two of a model's identical layers and repeat the graph for "
                                                "the rest (about 10x faster for a deep model)")
    device: Device | None = option(None, help="the device type the programs run on, whose kernels the graphs "
                                              "record (default: cuda where torch sees a GPU)")

    def _rules(self) -> None:
        if self.seq_dim is not None and self.seq_dim == self.batch_dim:
            raise ParallelizeError(f"batch_dim and seq_dim are both {self.batch_dim}; give two different dims")

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class TensorConfig(Section):
    """Tensor parallel (Megatron's ModelParallelConfig, tensor part)."""

    _name = "tensor"
    plan: dict | None = option(None, cli=False, help="module path pattern -> 'colwise' / 'rowwise' / 'vocab' / "
                                                     "'replicate' (or fxtron.Colwise(...), fxtron.Rowwise(...))")
    plan_mode: PlanMode = option("override", help="the plan refines the automatic one (override) or replaces it")
    sequence_parallel: bool = option(False, help="norms, dropout and residual adds on 1/tp of the tokens, "
                                                 "reduce-scatter / all-gather in place of each all-reduce")

    def check(self, mesh) -> None:
        if self.sequence_parallel and mesh.tp == 1:
            raise ParallelizeError("sequence_parallel=True needs tensor parallel (mesh.tp > 1): it shards the "
                                   "sequence over the tp ranks; set tp or drop sequence_parallel")
        if self.plan_mode == "replace" and mesh.tp > 1 and not self.plan:
            raise ParallelizeError("plan_mode='replace' replaces the automatic tp plan with plan=, which is empty: "
                                   "give a plan, or use plan_mode='override'")


@dataclass(frozen=True)
class PipelineConfig(Section):
    """Pipeline parallel and microbatching."""

    _name = "pipeline"
    microbatches: int = option(1, positive=True, help="microbatches per step and data-parallel rank (pipeline "
                                                      "parallel; gradient accumulation without it)")
    schedule: Schedule = option("1f1b", help="the pipeline schedule")
    virtual_stages: int = option(1, positive=True, help="model chunks per pipeline rank (schedule interleaved; "
                                                        "zb-v always runs two, in a V)")
    split_points: tuple[str, ...] | None = option(None, help="cut stages before these modules (blocks.6 ...) "
                                                             "instead of balancing")
    scatter_gather: bool = option(False, help="send stage boundaries as 1/tp slices, all-gathered on arrival")

    def _rules(self) -> None:
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ParallelizeError("schedule='interleaved' needs virtual_stages >= 2 (model chunks per pipeline rank); "
                                   "with one chunk use schedule='1f1b'")
        if self.schedule == "zb-v" and self.virtual_stages not in (1, 2):
            raise ParallelizeError(f"schedule='zb-v' runs two model chunks per pipeline rank, in a V; "
                                   f"virtual_stages={self.virtual_stages} asks for more: use schedule='interleaved'")
        if self.schedule not in ("interleaved", "zb-v") and self.virtual_stages != 1:
            raise ParallelizeError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved' "
                                   f"(got {self.schedule!r})")

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: virtual_stages interleaved, two for zb-v, else one."""
        return 2 if self.schedule == "zb-v" else self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """The schedule runs input gradients (B) and weight gradients (W) as separate passes."""
        return self.schedule in ("zb-h1", "zb-v")

    def check(self, mesh) -> None:
        self.check_pp(mesh.pp)
        if self.split_points and mesh.pp == 1:
            raise ParallelizeError("split_points cut pipeline stages; the mesh has pp=1")
        if self.scatter_gather and mesh.tp == 1:
            raise ParallelizeError("scatter_gather=True splits stage boundaries over tensor-parallel ranks; the mesh "
                                   "has tp=1")

    def check_pp(self, pp: int) -> None:
        if self.schedule == "zb-v" and pp < 2:
            raise ParallelizeError("schedule='zb-v' places two model chunks on every pipeline rank in a V and needs "
                                   "pipeline parallel (mesh.pp > 1); at pp=1 use schedule='1f1b'")
        if self.schedule == "interleaved":
            if pp < 2:
                raise ParallelizeError("schedule='interleaved' needs pipeline parallel (mesh.pp > 1)")
            if self.microbatches % pp:
                m = self.microbatches
                below, above = max(pp, m // pp * pp), (m // pp + 1) * pp
                use = f"{below} or {above}" if below != above else f"{above}"
                raise ParallelizeError(
                    f"the interleaved schedule runs microbatches in groups of pp={pp}; microbatches={m} is not a "
                    f"multiple of {pp}: use {use}")


@dataclass(frozen=True)
class DataParallelConfig(Section):
    """Data parallel: gradient buffers and sync (Megatron's DistributedDataParallelConfig), the
    distributed optimizer and clipping (its OptimizerConfig, in part)."""

    _name = "data_parallel"
    bucket_size: int | None = option(None, positive=True, help="elements per gradient bucket (default: Megatron's "
                                                               "max(4e7, 1e6 x dp))")
    grad_reduce_dtype: DType | None = option(None, help="the gradient buffer's dtype (default: fp32 main_grad)")
    overlap_grad_reduce: bool = option(True, help="start each bucket's collective during backward")
    zero: ZeroStage = option(0, help="1: the distributed optimizer (optimizer state sharded over dp, each rank "
                                     "stepping its shard of the fp32 parameters, then all-gathered); 2: and the "
                                     "gradients, reduce-scattered during backward, the rank's shards kept after it; "
                                     "3: and the parameters (FSDP), each layer gathered just before use")
    gather_per_step: bool = option(False, help="zero=3: gather each layer once per step and keep it until the step "
                                               "ends (no gather again in backward or per microbatch), holding the "
                                               "whole parameters during the step")
    dp_shard: int | None = option(None, positive=True,
                                  help="zero=3: shard over groups of this many consecutive data-parallel ranks and "
                                       "replicate across the groups (HSDP; torchtitan's data_parallel_shard_degree); "
                                       "default: over all of them")
    overlap_param_gather: bool = option(False, help="zero=1/2: the updated parameters are all-gathered bucket by "
                                                    "bucket during the next forward, each layer waiting only for its "
                                                    "own buckets (Megatron's overlap_param_gather); between steps "
                                                    "they are current after prog.settle()")
    clip_grad: float | None = option(None, minimum=0.0, help="clip the global gradient norm to this (0: no "
                                                              "clipping, as Megatron's --clip-grad 0)")

    def _rules(self) -> None:
        if self.clip_grad == 0:          # Megatron clips only where clip_grad > 0
            object.__setattr__(self, "clip_grad", None)
        if self.overlap_param_gather and self.zero not in (1, 2):
            raise ParallelizeError(f"overlap_param_gather=True overlaps the distributed optimizer's all-gather of the "
                                   f"updated parameters with the next forward; zero={self.zero} has none: use zero=1 "
                                   f"or zero=2 (zero=3 gathers each layer before use anyway)")
        if self.dp_shard is not None and self.zero != 3:
            raise ParallelizeError(f"dp_shard={self.dp_shard} shards zero=3's parameters over groups of that many "
                                   f"ranks; zero={self.zero} does not shard parameters: use zero=3")
        if self.gather_per_step and self.zero != 3:
            raise ParallelizeError(f"gather_per_step=True keeps zero=3's gathered layers for the whole step; "
                                   f"zero={self.zero} does not gather layers: use zero=3 or drop gather_per_step")

    def check(self, mesh) -> None:
        d = mesh.dp * mesh.cp
        if self.dp_shard is not None and (d % self.dp_shard or self.dp_shard > d):
            raise ParallelizeError(f"dp_shard={self.dp_shard} must divide the {d} data-parallel ranks that hold the same "
                                   f"weights (dp={mesh.dp} x cp={mesh.cp}): use one of "
                                   f"{', '.join(str(k) for k in range(1, d + 1) if d % k == 0)}")


@dataclass(frozen=True)
class ContextConfig(Section):
    """Context parallel."""

    _name = "context"
    comm_type: CPCommType = option("p2p", shorthand="cp_comm_type",
                                   help="how attention exchanges keys and values over cp: p2p (the ring), "
                                        "all_gather, a2a (Ulysses: all-to-alls from a sequence split to a "
                                        "head split and back), or a2a+p2p (a2a inside groups of cp_a2a_size "
                                        "consecutive cp ranks, the ring across the groups)")
    a2a_size: int | None = option(None, positive=True, shorthand="cp_a2a_size",
                                  help="cp_comm_type='a2a+p2p': the cp ranks of one all-to-all group "
                                       "(Megatron's hierarchical_context_parallel_sizes [a2a_size, cp / a2a_size])")
    documents: str | None = option(None, shorthand="cp_documents",
                                   help="the keyword input holding each token's document id (B, S): each row's "
                                        "tokens are reordered so a rank holds chunks r and 2cp-1-r of every document "
                                        "(Megatron's THD load balancing of packed sequences), once proved not to "
                                        "change what the model computes")

    def _rules(self) -> None:
        if (self.comm_type == "a2a+p2p") != (self.a2a_size is not None):
            raise ParallelizeError(
                f"cp_comm_type={self.comm_type!r} with cp_a2a_size={self.a2a_size}: cp_a2a_size sizes the all-to-all "
                f"groups of cp_comm_type='a2a+p2p' and goes with it alone; set both, or neither")

    def check(self, mesh) -> None:
        if self.comm_type != "p2p" and mesh.cp == 1:
            raise ParallelizeError(f"cp_comm_type={self.comm_type!r} chooses how context parallel exchanges keys and "
                                   "values; the mesh has cp=1: set cp or drop cp_comm_type")
        if self.documents is not None and mesh.cp == 1:
            raise ParallelizeError(f"cp_documents={self.documents!r} balances packed documents over the context-"
                                   "parallel ranks; the mesh has cp=1: set cp or drop cp_documents")
        k = self.a2a_size
        if k is not None and (mesh.cp % k or k == 1 or k == mesh.cp):
            sizes = [str(d) for d in range(2, mesh.cp) if mesh.cp % d == 0]
            raise ParallelizeError(
                f"cp_a2a_size={k} must divide cp={mesh.cp} and lie strictly between 1 and cp (1 is "
                f"cp_comm_type='p2p', cp is 'a2a'): " + (f"use one of {', '.join(sizes)}" if sizes else
                                                          f"cp={mesh.cp} has no such size; use 'p2p' or 'a2a'"))


@dataclass(frozen=True)
class ExpertsConfig(Section):
    """Mixtures of experts (TransformerConfig's moe_* fields)."""

    _name = "experts"
    aux_loss: AuxLoss = option("global", shorthand="moe_aux_loss",
                               help="batch statistics the loss uses nonlinearly (a load-balancing loss's tokens per "
                                    "expert and router probabilities): over the global batch, as one process computes "
                                    "them (global), or each data-parallel rank's own (local: Megatron's default, a "
                                    "change of the model)")
    capacity_factor: float | None = option(None, positive=True, shorthand="moe_capacity_factor",
                                           help="cap each expert at ceil(c k T / E) of a rank's copies (None: "
                                                "dropless)")
    pad_to_capacity: bool = option(False, shorthand="moe_pad_to_capacity",
                                   help="pad every expert's rows to its capacity (fixed all-to-all splits)")

    def _rules(self) -> None:
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ParallelizeError("moe_pad_to_capacity=True pads every expert's rows to its capacity, but there is no "
                                   "capacity: routing is dropless; give moe_capacity_factor (1.0-1.25, Switch's) too, "
                                   "or drop moe_pad_to_capacity")

    def check(self, mesh) -> None:
        if self.capacity_factor is not None and mesh.ep == 1:
            raise ParallelizeError(f"moe_capacity_factor={self.capacity_factor} caps what each expert-parallel "
                                   f"dispatch sends an expert, but the mesh has ep=1 (the model runs dropless, as "
                                   f"written); use a mesh with ep > 1 or moe_capacity_factor=None")


@dataclass(frozen=True)
class RecomputeConfig(Section):
    """Activation recomputation (Megatron's --recompute-granularity / -method / -num-layers)."""

    _name = "recompute"
    granularity: Granularity | None = option(None, shorthand="recompute",
                                             help="recompute the attention cores (selective) or whole layers (full)")
    method: RecomputeMethod | None = option(None, shorthand="recompute_method",
                                            help="full: groups of --recompute-layers layers (uniform, default) or "
                                                 "the first of every stage (block)")
    num_layers: int | None = option(None, positive=True, shorthand="recompute_layers",
                                    help="full: layers per group, or recomputed per stage (default 1)")

    def _rules(self) -> None:
        if self.granularity is None:
            if self.method is not None or self.num_layers is not None:
                raise ParallelizeError("recompute_method / recompute_layers need recompute='full'")
        elif self.granularity == "selective":
            if self.method is not None or self.num_layers is not None:
                raise ParallelizeError("recompute='selective' recomputes every layer's attention core; "
                                       "recompute_method and recompute_layers belong to recompute='full' (as "
                                       "Megatron's --recompute-num-layers must be unset with --recompute-granularity "
                                       "selective)")

    def resolved(self) -> tuple[str | None, str | None, int | None]:
        """(granularity, method, num_layers) with full's defaults filled in (uniform groups of
        one layer, Megatron's); the fields keep what was given, so a configuration that changes
        the granularity later carries no default it did not choose."""
        if self.granularity != "full":
            return self.granularity, None, None
        return "full", self.method or "uniform", 1 if self.num_layers is None else self.num_layers


@dataclass(frozen=True)
class PrecisionConfig(Section):
    """Mixed precision and the fused weight-gradient accumulation."""

    _name = "precision"
    dtype: DType = option("fp32", help="compute dtype: bf16 or fp16 (dynamic loss scaling) compute in 16 bits while "
                                       "the optimizer updates fp32 parameters from fp32 gradients")
    gradient_accumulation_fusion: bool = option(True, help="accumulate each linear's weight gradient straight into "
                                                           "an fp32 main_grad, deferrable behind communication")
    # fp16's loss scaler (runtime/precision.py LossScaler), Megatron's flags and meanings
    loss_scale: float | None = option(None, positive=True, help="fp16: a static loss scale (steps whose gradients "
                                                                "overflow are still skipped); none: dynamic scaling")
    initial_loss_scale: float = option(2.0**16, positive=True, help="fp16's dynamic loss scaling: the first scale "
                                                                    "(torch's GradScaler's; Megatron starts at 2^32)")
    min_loss_scale: float = option(1.0, positive=True, help="fp16's dynamic loss scaling: the scale halves no "
                                                            "lower than this")
    loss_scale_window: int = option(1000, minimum=1, help="fp16's dynamic loss scaling: clean steps in a row "
                                                          "before the scale doubles")
    hysteresis: int = option(1, minimum=1, help="fp16's dynamic loss scaling: overflowing steps (counted since the "
                                                "last growth) before the scale halves; Megatron's default is 2")

    #: the loss scaler's fields and their defaults
    _SCALER = {"loss_scale": None, "initial_loss_scale": 2.0**16, "min_loss_scale": 1.0, "loss_scale_window": 1000,
               "hysteresis": 1}

    def _rules(self) -> None:
        given = [f"{k}={getattr(self, k)!r}" for k, v in self._SCALER.items() if getattr(self, k) != v]
        if given and self.dtype != "fp16":
            raise ParallelizeError(f"{', '.join(given)} set(s) fp16's loss scaler, and dtype={self.dtype!r} has none "
                                   f"(bf16 and fp32 need no loss scaling): use dtype='fp16', or drop "
                                   f"{'it' if len(given) == 1 else 'them'}")
        if self.loss_scale is not None and len(given) > 1:
            raise ParallelizeError(f"loss_scale={self.loss_scale!r} is a static scale, and {', '.join(given[1:])} "
                                   "set(s) the dynamic scaling it turns off: give one or the other")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ParallelizeError(f"min_loss_scale={self.min_loss_scale!r} is above initial_loss_scale="
                                   f"{self.initial_loss_scale!r}: the scale starts at or above its floor")

    @property
    def torch_dtype(self):
        """The compute dtype as torch's, None for fp32 (no compute copies)."""
        return None if self.dtype == "fp32" else torch_dtype(self.dtype)


@dataclass(frozen=True)
class CodegenConfig(Section):
    """What each rank's program is turned into: its graph interpreted op by op, or compiled; its
    training step replayed from a CUDA graph."""

    _name = "codegen"
    compile: bool = option(False, help="compile each rank's forward and backward with Inductor between fxtron's "
                                       "collectives and kernels (norms, rotary, activations, residual adds and the "
                                       "loss fused); the first step pays the compilation")
    cuda_graphs: bool = option(False, help="capture the whole training step (forward, backward, gradient sync, "
                                           "optimizer) in one CUDA graph after the warm-up steps and replay it: one "
                                           "launch a step. NCCL only, one input shape, no pipeline, microbatches, "
                                           "zero, fp16, recomputation, cp, ep, random draws or data-dependent shapes "
                                           "(refused, naming the reason); torch.optim.Adam / AdamW made capturable")
    cuda_graph_warmup: int = option(2, minimum=1, help="with cuda_graphs: the steps run eagerly on a side stream "
                                                       "before the next one is captured (NCCL's communicators, the "
                                                       "optimizer's state and the buffers made there)")

    def _rules(self) -> None:
        if self.cuda_graph_warmup != 2 and not self.cuda_graphs:
            raise ParallelizeError(f"cuda_graph_warmup={self.cuda_graph_warmup} sets the eager steps before a CUDA "
                                   "graph's capture; cuda_graphs is off: turn it on or drop cuda_graph_warmup")


@dataclass(frozen=True)
class DebugConfig(Section):
    """Checks and records for finding what went wrong; the FXTRON_* variables set the defaults."""

    _name = "debug"
    strict: bool = option(False, help="what fxtron would do less well than asked (a linear left replicated, an op "
                                      "run replicated, more bytes than Megatron) raises instead of warning")
    verify: bool = option(factory=lambda: env_flag("FXTRON_VERIFY", True), env="FXTRON_VERIFY",
                          help="check every pass's output graph (placements, a collective at every mismatch); on by "
                               "default, it adds about a third to a rank's compilation: turn it off for huge graphs")
    check_collectives: bool = option(factory=lambda: env_flag("FXTRON_CHECK_COLLECTIVES", False),
                                     env="FXTRON_CHECK_COLLECTIVES",
                                     help="before every collective, check every rank of its group issues the same one "
                                          "(read where the process groups are made: fxtron train, launch, "
                                          "init_distributed)")
    flight_dir: str | None = option(factory=lambda: env_str("FXTRON_FLIGHT_DIR"), env="FXTRON_FLIGHT_DIR",
                                    help="the flight recorder's directory: each rank's last collectives, written on "
                                         "a failure or a timeout (read where the process groups are made)")
    dump: str | None = option(factory=lambda: env_str("FXTRON_DUMP"), env="FXTRON_DUMP",
                              help="write the graph after every pass to this directory")
    shm: bool = option(factory=lambda: env_flag("FXTRON_SHM", True), env="FXTRON_SHM",
                       help="tensor-parallel collectives of one host through shared memory (read where the "
                            "process groups are made)")
    p2p_tags: bool = option(factory=lambda: env_flag("FXTRON_P2P_TAGS", True), env="FXTRON_P2P_TAGS",
                            help="tag pipeline messages by microbatch and chunk (off for backends without tags)")


SECTIONS: dict[str, type] = {"inputs": InputsConfig, "tensor": TensorConfig, "pipeline": PipelineConfig,
                             "data_parallel": DataParallelConfig, "context": ContextConfig, "experts": ExpertsConfig,
                             "recompute": RecomputeConfig, "precision": PrecisionConfig, "codegen": CodegenConfig,
                             "debug": DebugConfig}

# ----------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class Config:
    """Every option of parallelize, in sections (see the module docstring)."""

    inputs: InputsConfig = field(default_factory=InputsConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    codegen: CodegenConfig = field(default_factory=CodegenConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            want = typing.get_type_hints(type(self))[f.name]
            if not isinstance(getattr(self, f.name), want):
                raise ParallelizeError(f"the configuration's {f.name} section must be a {want.__name__}, not "
                                       f"{type(getattr(self, f.name)).__name__}")
        self._rules()

    def _rules(self) -> None:
        if self.pipeline.split_backward and not self.precision.gradient_accumulation_fusion:
            raise ParallelizeError(f"schedule={self.pipeline.schedule!r} defers the linears' weight-gradient GEMMs "
                                   "into the pipeline bubbles, which needs gradient_accumulation_fusion=True")
        if self.tensor.sequence_parallel and self.inputs.seq_dim is None:
            raise ParallelizeError("sequence_parallel=True needs the inputs' sequence dim (seq_dim)")
        if self.data_parallel.grad_reduce_dtype == "fp16" and self.precision.dtype != "fp16":
            raise ParallelizeError(
                f"grad_reduce_dtype='fp16' accumulates and reduces the gradients in fp16, whose largest value is "
                f"65504, but dtype={self.precision.dtype!r} has no loss scaler to find an overflow and skip its step "
                "(a gradient past it is inf, then NaN weights, silently) nor to lift small gradients above fp16's "
                "smallest: use grad_reduce_dtype='bf16' (fp32's range in 16 bits), or dtype='fp16' whose dynamic "
                "loss scaling checks every step")
        if self.codegen.cuda_graphs:
            self._cuda_graph_rules()

    def _cuda_graph_rules(self, mesh=None) -> None:
        """ParallelizeError for what a captured step (cuda_graphs=True, runtime/graphs.py) cannot
        hold: a host synchronization or a varying schedule inside the step, or another device
        than CUDA. The graph's own ops and the process groups are checked at program build."""
        off = "; or turn cuda_graphs off"
        refusals = []
        if self.inputs.device == "cpu":
            refusals.append("the programs run on the CPU (device='cpu'): CUDA graphs capture CUDA kernels alone; "
                            "run on GPUs (device='cuda')" + off)
        if self.precision.dtype == "fp16":
            refusals.append("fp16's dynamic loss scaling reads the gradients' overflow check on the host every step "
                            "(it decides the skip and the scale there): use dtype='bf16' (no loss scaling)" + off)
        if self.pipeline.microbatches > 1 or (mesh is not None and mesh.pp > 1):
            refusals.append("a pipeline schedule or gradient accumulation (pp > 1 or microbatches > 1) runs its "
                            "passes and transfers from the host, microbatch by microbatch, in an order the graph "
                            "would fix: use pp=1 and microbatches=1 (a larger batch in one step)" + off)
        if self.data_parallel.zero:
            refusals.append(f"zero={self.data_parallel.zero} overlaps the parameters' all-gathers (or zero=3's "
                            "gathers and frees) across steps and waits for them from the host: use zero=0" + off)
        if self.recompute.granularity is not None:
            refusals.append(f"recompute={self.recompute.granularity!r} replays regions whose random streams are "
                            "restored from the host: use recompute=None" + off)
        if mesh is not None and mesh.cp > 1:
            refusals.append(f"context parallel (cp={mesh.cp}) reads its attention's masks and document pieces on the "
                            "host (ops/cp/pieces.py, ops/cp/blocks.py): use cp=1" + off)
        if mesh is not None and mesh.ep > 1:
            refusals.append(f"expert parallel (ep={mesh.ep}) sizes each all-to-all from the tokens' counts per expert, "
                            "read on the host every step (data-dependent shapes): use ep=1" + off)
        if self.debug.check_collectives:
            refusals.append("check_collectives agrees every collective with its peers over gloo from the host: "
                            "turn it off (FXTRON_CHECK_COLLECTIVES=0)" + off)
        if refusals:
            raise ParallelizeError("cuda_graphs=True cannot capture this step: " + "; ".join(refusals))

    # ---------------------------------------------------------------- the mesh
    def check(self, mesh) -> None:
        """ParallelizeError for what this mesh cannot run: each section's own check."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).check(mesh)
        if mesh.cp > 1 and self.inputs.seq_dim is None:
            raise ParallelizeError("context parallel (mesh.cp > 1) splits the inputs' sequence dim; give seq_dim")
        if self.codegen.cuda_graphs:
            self._cuda_graph_rules(mesh)

    # ---------------------------------------------------------------- fields by shorthand
    @classmethod
    def fields_by_shorthand(cls) -> dict[str, tuple[str, dataclasses.Field]]:
        """shorthand -> (section, field), over the whole tree."""
        out: dict[str, tuple[str, dataclasses.Field]] = {}
        for sf in dataclasses.fields(cls):
            for f in dataclasses.fields(typing.get_type_hints(cls)[sf.name]):
                key = _shorthand(f)
                if key in out:
                    raise TypeError(f"shorthand {key!r} names both {out[key][0]}.{out[key][1].name} and {sf.name}.{f.name}")
                out[key] = (sf.name, f)
        return out

    def replace(self, **shorthand) -> "Config":
        """A copy with fields set by their shorthand (`schedule="interleaved"`, `cp_comm_type=...`);
        an unknown name is a ParallelizeError with the closest ones."""
        known = self.fields_by_shorthand()
        unknown = [k for k in shorthand if k not in known]
        if unknown:
            k = unknown[0]
            raise ParallelizeError(f"unknown option {k}={shorthand[k]!r}{_closest(k, known)}; the options are "
                                   f"{', '.join(sorted(known))}")
        by_section: dict[str, dict[str, Any]] = {}
        for k, v in shorthand.items():
            section, f = known[k]
            by_section.setdefault(section, {})[f.name] = v
        return self.replace_sections(by_section)

    def replace_sections(self, values: dict[str, dict[str, Any]]) -> "Config":
        """A copy with {section: {field: value}} set (the fields' own names)."""
        sections = {}
        for section, changes in values.items():
            current = getattr(self, section)
            kw = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)}
            kw.update(changes)
            sections[section] = type(current)(**kw)
        return dataclasses.replace(self, **sections)

    def options(self) -> dict[str, Any]:
        """Every field by its shorthand."""
        return {k: getattr(getattr(self, s), f.name) for k, (s, f) in self.fields_by_shorthand().items()}

    # ---------------------------------------------------------------- TOML (config/toml.py)
    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}} with the values TOML can hold (see `toml.to_dict`)."""
        return toml.to_dict(self)

    def to_toml(self) -> str:
        """The tree as TOML text."""
        return toml.to_toml(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: "Config | None" = None, source: str = "the configuration"):
        """The tree from {section: {field: value}} over `base` (see `toml.from_dict`)."""
        return toml.from_dict(cls, data, base=base, source=source)

    @classmethod
    def from_toml(cls, path: str, *, base: "Config | None" = None):
        """The tree from a TOML file over `base` (see `toml.from_toml`)."""
        return toml.from_toml(cls, path, base=base)

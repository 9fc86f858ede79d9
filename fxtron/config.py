"""Core: the typed configuration -- every option of `parallelize`, of both command lines and of
the trainer, in one tree of frozen dataclasses.

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
      debug           strict, the verifier, the collective check, the flight recorder, dumps
    TrainConfig(Config)           the trainer's tree: the above plus
      mesh, model, data, optimizer, training

Every field has one *shorthand*, unique over the whole tree: the keyword `parallelize` takes for it
(today's keyword names: `schedule=`, `cp_comm_type=`, `recompute_layers=` ...) and, with dashes, its
command-line flag (`--cp-comm-type`). `Config.replace(**shorthand)` sets fields by shorthand;
`to_toml` / `from_toml` write and read the tree; `add_arguments` / `from_arguments` generate the
argparse flags of `fxtron train` and `fxtron inspect` from it.

A value is checked when its section is made: a ParallelizeError names the field, the value and the
choices (with the closest one), on any mesh. `Config.check(mesh)` adds what needs the mesh. The
FXTRON_* environment variables set the debug section's defaults, each read here and nowhere else.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

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

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def torch_dtype(name: str | None):
    """The torch dtype of a configuration's dtype name ("bf16" -> torch.bfloat16); None stays None."""
    import torch
    return None if name is None else getattr(torch, _DTYPE_NAMES[name])


# ----------------------------------------------------------------------------- the environment
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An FXTRON_* switch: unset or empty gives `default`; 0/false/no/off is False, anything else True."""
    value = os.environ.get(name, "").strip().lower()
    return default if value == "" else value not in _FALSE


def env_str(name: str) -> str | None:
    """An FXTRON_* setting that names something (a directory); None when unset or empty."""
    return os.environ.get(name) or None


def option(default: Any = dataclasses.MISSING, *, help: str, shorthand: str | None = None, flag: str | None = None,
           env: str | None = None, cli: bool = True, minimum: float | None = None, positive: bool = False,
           factory: Any = dataclasses.MISSING) -> Any:
    """A field of a section: `help` for the flag and the docs; `shorthand` the keyword of
    parallelize and (with dashes) the flag, default the field's own name; `env` the variable that
    sets the default; `cli=False` for a field only Python or TOML can give (a plan);
    `minimum` / `positive` bound a number."""
    meta = dict(help=help, shorthand=shorthand, flag=flag, env=env, cli=cli, minimum=minimum, positive=positive)
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- checking one value
def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


def _closest(value: Any, candidates) -> str:
    near = difflib.get_close_matches(str(value), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _where(section: str, f: dataclasses.Field) -> str:
    flag = _flag(f) if f.metadata.get("cli", True) else None
    return f"{section}.{f.name} in the configuration" + (f", {flag} on the command line" if flag else "")


def _shorthand(f: dataclasses.Field) -> str:
    return f.metadata.get("shorthand") or f.name


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + _shorthand(f).replace("_", "-")


def _optional(tp) -> tuple[Any, bool]:
    """(the type inside Optional, whether None is allowed)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _check_value(section: str, f: dataclasses.Field, tp, value: Any) -> Any:
    """`value` made canonical for field `f` of type `tp`, or a ParallelizeError naming the field,
    the value and what it takes."""
    inner, nullable = _optional(tp)
    name = _shorthand(f)

    def bad(what: str, hint: str = "") -> ParallelizeError:
        return ParallelizeError(f"{name} must be {what}{' or None' if nullable else ''}, not {value!r}{hint} "
                                f"({_where(section, f)})")

    if value is None:
        if nullable:
            return None
        raise bad(_describe(inner))
    if get_origin(inner) is Literal and set(get_args(inner)) == set(_DTYPE_NAMES):
        value = _dtype_name(value)
    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if isinstance(value, bool) or value not in choices:
            raise bad(f"one of {_choices(choices)}", _closest(value, choices))
        return value
    if inner is bool:
        if not isinstance(value, bool):
            raise bad("True or False")
        return value
    if inner is int or inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (inner is int and not isinstance(value, int)):
            raise bad(_describe(inner, f))
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(_describe(inner, f))
        lo, positive = f.metadata.get("minimum"), f.metadata.get("positive")
        if (lo is not None and value < lo) or (positive and not value > 0):
            raise bad(_describe(inner, f))
        return float(value) if inner is float else value
    if inner is str:
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if get_origin(inner) is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return tuple(value)
    if get_origin(inner) is dict or inner is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad("a dict keyed by strings")
        return dict(value)
    return value


def _dtype_name(value: Any) -> Any:
    """A torch dtype or one of its names as the configuration's name ("bf16"); anything else as is."""
    try:
        import torch
        if isinstance(value, torch.dtype):
            return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(value, str(value))
    except ImportError:       # pragma: no cover
        pass
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value, value)
    return value


def _describe(tp, f: dataclasses.Field | None = None) -> str:
    if tp is int or tp is float:
        kind = "an int" if tp is int else "a number"
        if f is not None and f.metadata.get("positive"):
            return f"a positive {'int' if tp is int else 'number'}"
        if f is not None and f.metadata.get("minimum") is not None:
            return f"{kind} of at least {f.metadata['minimum']}"
        return kind
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


# ----------------------------------------------------------------------------- sections
class Section:
    """A frozen dataclass whose fields check themselves when it is made (`__post_init__`), then
    `_rules()` checks the fields together, and `check(mesh)` what needs the mesh."""

    _name = "section"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check_value(self._name, f, hints[f.name], getattr(self, f.name)))
        self._rules()

    def _rules(self) -> None:
        pass

    def check(self, mesh) -> None:
        pass


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
    zero: ZeroStage = option(0, help="1: the distributed optimizer (optimizer state and main parameters sharded "
                                     "over dp); 2: and the gradients, reduce-scattered during backward; 3: and the "
                                     "parameters (FSDP), each layer gathered just before use")
    gather_per_step: bool = option(False, help="zero=3: gather each layer once per step and keep it until the step "
                                               "ends (no gather again in backward or per microbatch), holding the "
                                               "whole parameters during the step")
    dp_shard: int | None = option(None, positive=True,
                                  help="zero=3: shard over groups of this many consecutive data-parallel ranks and "
                                       "replicate across the groups (HSDP; torchtitan's data_parallel_shard_degree); "
                                       "default: over all of them")
    overlap_param_gather: bool = option(False, help="zero=1/2: the updated parameters are all-gathered bucket by "
                                                    "bucket during the next forward, each layer waiting only for its "
                                                    "own buckets (Megatron's overlap_param_gather)")
    clip_grad: float | None = option(None, positive=True, help="clip the global gradient norm to this")

    def _rules(self) -> None:
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
        k = self.a2a_size
        if k is not None and (mesh.cp % k or k == 1 or k == mesh.cp):
            raise ParallelizeError(
                f"cp_a2a_size={k} must divide cp={mesh.cp} and lie strictly between 1 and cp (1 is "
                f"cp_comm_type='p2p', cp is 'a2a'): use one of "
                f"{', '.join(str(d) for d in range(2, mesh.cp) if mesh.cp % d == 0) or 'none at this cp'}")


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

    @property
    def torch_dtype(self):
        """The compute dtype as torch's, None for fp32 (no compute copies)."""
        return None if self.dtype == "fp32" else torch_dtype(self.dtype)


@dataclass(frozen=True)
class DebugConfig(Section):
    """Checks and records for finding what went wrong; the FXTRON_* variables set the defaults."""

    _name = "debug"
    strict: bool = option(False, help="what fxtron would do less well than asked (a linear left replicated, an op "
                                      "run replicated, more bytes than Megatron) raises instead of warning")
    verify: bool = option(factory=lambda: env_flag("FXTRON_VERIFY", False), env="FXTRON_VERIFY",
                          help="check every pass's output graph (placements, a collective at every mismatch)")
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
                             "recompute": RecomputeConfig, "precision": PrecisionConfig, "debug": DebugConfig}


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

    # ---------------------------------------------------------------- the mesh
    def check(self, mesh) -> None:
        """ParallelizeError for what this mesh cannot run: each section's own check."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).check(mesh)
        if mesh.cp > 1 and self.inputs.seq_dim is None:
            raise ParallelizeError("context parallel (mesh.cp > 1) splits the inputs' sequence dim; give seq_dim")

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

    # ---------------------------------------------------------------- TOML
    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}} with the values TOML can hold: a None whose default is not
        None is written "none"; other Nones are left out (the default)."""
        out: dict[str, dict[str, Any]] = {}
        for sf in dataclasses.fields(self):
            sec = getattr(self, sf.name)
            body: dict[str, Any] = {}
            for f in dataclasses.fields(sec):
                v = getattr(sec, f.name)
                if v is None:
                    if _default(f) is not None:
                        body[f.name] = "none"
                    continue
                if isinstance(v, tuple):
                    v = list(v)
                if isinstance(v, dict):
                    odd = {k: x for k, x in v.items() if not isinstance(x, str)}
                    if odd:
                        k = next(iter(odd))
                        raise ParallelizeError(f"{sf.name}.{f.name} holds {k!r}: {odd[k]!r}, which TOML cannot write; "
                                               f"give its style as a string ('colwise', 'rowwise', 'vocab', 'replicate')")
                body[f.name] = v
            out[sf.name] = body
        return out

    def to_toml(self) -> str:
        import tomli_w
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: "Config | None" = None, source: str = "the configuration"):
        """The tree from {section: {field: value}} over `base` (default: the defaults): unknown
        sections and fields are ParallelizeErrors naming them and the closest known ones."""
        base = base if base is not None else cls()
        names = [f.name for f in dataclasses.fields(cls)]
        changes: dict[str, dict[str, Any]] = {}
        for section, body in data.items():
            if section not in names:
                raise ParallelizeError(f"{source} has a section [{section}]{_closest(section, names)}; the sections "
                                       f"are {', '.join(names)}")
            if not isinstance(body, dict):
                raise ParallelizeError(f"{source}: {section} must be a table ([{section}]), not {body!r}")
            fields_ = {f.name: f for f in dataclasses.fields(getattr(base, section))}
            hints = typing.get_type_hints(type(getattr(base, section)))
            for key, value in body.items():
                if key not in fields_:
                    raise ParallelizeError(f"{source}: [{section}] has no field {key!r}{_closest(key, fields_)}; its "
                                           f"fields are {', '.join(fields_)}")
                changes.setdefault(section, {})[key] = _from_text(hints[key], value)
        return base.replace_sections(changes)

    @classmethod
    def from_toml(cls, path: str, *, base: "Config | None" = None):
        import tomllib
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ParallelizeError(f"configuration file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ParallelizeError(f"configuration file {path} is not valid TOML: {e}") from None
        try:
            return cls.from_dict(data, base=base, source=path)
        except ParallelizeError as e:
            if str(e).startswith(path):
                raise
            raise ParallelizeError(f"{path}: {e}") from None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _from_text(tp, value: Any) -> Any:
    """A value read from TOML or a flag: "none" is None where the field takes None."""
    inner, nullable = _optional(tp)
    if nullable and inner is not str and isinstance(value, str) and value.lower() == "none":
        return None
    return value


# ----------------------------------------------------------------------------- the trainer's sections
@dataclass(frozen=True)
class MeshConfig(Section):
    """The device mesh (fxtron.Mesh)."""

    _name = "mesh"
    world_size: int | None = option(None, positive=True, help="number of ranks (default: the command's; in Python "
                                                              "tp x pp x cp x ep, dp=1)")
    tp: int = option(1, positive=True, help="tensor parallel size")
    pp: int = option(1, positive=True, help="pipeline parallel size")
    cp: int = option(1, positive=True, help="context parallel size")
    ep: int = option(1, positive=True, help="expert parallel size")
    order: str = option("tp-cp-ep-dp-pp", help="axis order, fastest first")

    def mesh(self):
        from fxtron.mesh import Mesh
        world = self.world_size if self.world_size is not None else self.tp * self.pp * self.cp * self.ep
        return Mesh(world, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, order=self.order)


@dataclass(frozen=True)
class ModelConfig(Section):
    """Which model to train (built on the meta device; each rank makes only its shards)."""

    _name = "model"
    name: str = option("gpt-tiny", shorthand="model",
                       help="a shipped preset (fxtron.models.list_presets()), hf:<architecture> (hf:llama), "
                            "package.module:factory, or a transformers directory (config.json; its weights are "
                            "loaded when it has them)")
    config: tuple[str, ...] | None = option(None, shorthand="model_config",
                                            help="KEY=VALUE fields of an hf:<architecture>'s transformers config "
                                                 "(num_hidden_layers=4 hidden_size=256)")


DecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class DataConfig(Section):
    """What the trainer reads, and how much of it per step."""

    _name = "data"
    path: tuple[str, ...] | None = option(None, shorthand="data",
                                          help="Megatron indexed dataset PREFIX (PREFIX.bin/.idx), or a blend "
                                               "'W1 PREFIX1 W2 PREFIX2' (default: byte-level text, --text)")
    split: str = option("969,30,1", help="train, valid and test weights over the datasets' documents (Megatron's "
                                         "--split)")
    text: str | None = option(None, help="without --data: a text file to train on byte by byte (default: Python's "
                                         "standard library sources)")
    max_bytes: int = option(4_000_000, positive=True, help="read at most this many bytes of the text")
    batch: int = option(8, positive=True, help="global batch (samples per step, Megatron's --global-batch-size)")
    seq: int = option(64, positive=True, help="tokens per sample (Megatron's --seq-length)")
    eod_id: int | None = option(None, minimum=0, help="the end-of-document token's id in the data (preprocess "
                                                      "appends it to every document), for the three options below")
    reset_position_ids: bool = option(False, help="positions restart at 0 after each end-of-document token (Megatron's "
                                                  "--reset-position-ids)")
    reset_attention_mask: bool = option(False, help="a token attends only its own document (Megatron's "
                                                    "--reset-attention-mask)")
    eod_mask_loss: bool = option(False, help="no loss where the input token is the end of a document (Megatron's "
                                             "--eod-mask-loss)")

    def __post_init__(self):
        if isinstance(self.path, str) and self.path:          # one dataset's prefix
            object.__setattr__(self, "path", (self.path,))
        super().__post_init__()

    def _rules(self) -> None:
        wanted = [f"--{n.replace('_', '-')}" for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                  if getattr(self, n)]
        if wanted and self.eod_id is None:
            raise ParallelizeError(f"{', '.join(wanted)} find the documents by their end-of-document token: give its id "
                                   "(--eod-id, the tokenizer's eos/eod id that preprocessing appended)")

    @property
    def packed(self) -> bool:
        """Are the samples' documents kept apart (positions or attention)?"""
        return self.reset_position_ids or self.reset_attention_mask


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """AdamW and its learning-rate schedule (Megatron's names and formulas); weight decay leaves
    biases and 1-d weights (norms) out, as Megatron does."""

    _name = "optimizer"
    lr: float = option(3e-3, positive=True, help="peak learning rate")
    min_lr: float = option(0.0, minimum=0, help="learning rate at the end of the decay")
    lr_warmup_steps: int = option(0, minimum=0, help="steps of linear warm-up from 0 (Megatron's --lr-warmup-iters)")
    lr_decay_style: DecayStyle = option("constant", help="after warm-up: constant, linear or cosine to min_lr")
    lr_decay_steps: int | None = option(None, positive=True, help="steps over which the learning rate decays "
                                                                  "(default: --steps)")
    weight_decay: float = option(0.1, minimum=0, help="AdamW's decoupled weight decay (not on biases and norms)")
    adam_beta1: float = option(0.9, minimum=0, help="AdamW's beta1")
    adam_beta2: float = option(0.95, minimum=0, help="AdamW's beta2")
    adam_eps: float = option(1e-8, positive=True, help="AdamW's epsilon")

    def _rules(self) -> None:
        if self.min_lr > self.lr:
            raise ParallelizeError(f"optimizer.min_lr = {self.min_lr} is above optimizer.lr = {self.lr}; give a "
                                   "min_lr at most the peak")


@dataclass(frozen=True)
class TrainingConfig(Section):
    """The run: its length, evaluation, checkpoints and metrics."""

    _name = "training"
    steps: int = option(50, positive=True, help="the run's total training steps (Megatron's --train-iters): a "
                                                "resumed run continues up to it")
    seed: int = option(0, minimum=0, help="seeds the model, the data order and dropout")
    compare: bool = option(False, help="train again in one process and report the largest loss difference")
    trace: str | None = option(None, help="write the last step's passes and memory per rank to this directory "
                                          "(trace.json for Perfetto, schedule.png)")
    eval_interval: int | None = option(None, positive=True, help="every this many steps, the loss on the valid split")
    eval_iters: int = option(2, positive=True, help="global batches of the valid split per evaluation")
    save: str | None = option(None, help="checkpoint directory (Megatron's layout: DIR/iter_0000004, "
                                         "DIR/latest_checkpointed_iteration.txt); a run there is resumed")
    save_interval: int | None = option(None, positive=True, help="save every this many steps (and at the end)")
    keep_last: int | None = option(None, positive=True, help="keep only the newest K checkpoints (default: all)")
    load: str | None = option(None, help="resume from the latest complete checkpoint of this directory, on any "
                                         "mesh (default: --save)")
    export_hf: str | None = option(None, help="at the end, write the model as transformers' save_pretrained does")
    log_interval: int = option(1, positive=True, help="one log line every this many steps")
    log_file: str | None = option(None, help="append one JSON object per step to this .jsonl file")
    tensorboard_dir: str | None = option(None, help="write the metrics as TensorBoard events here")
    max_skipped: int = option(3, positive=True, help="stop when this many steps in a row had a non-finite loss "
                                                     "or gradient norm (each is skipped)")
    peak_flops: float | None = option(None, positive=True, help="peak FLOP/s of one device for MFU (default: the "
                                                                "device's, when known)")

    def _rules(self) -> None:
        if self.save_interval is not None and self.save is None:
            raise ParallelizeError("training.save_interval needs training.save (--save DIR)")


@dataclass(frozen=True)
class TrainConfig(Config):
    """The trainer's whole tree: parallelize's sections and the run's."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def parallel(self) -> Config:
        """The sections parallelize reads."""
        return Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Config)})

    def check(self, mesh=None) -> None:
        super().check(mesh if mesh is not None else self.mesh.mesh())


# ----------------------------------------------------------------------------- command lines
_DEST = "cfg."


def add_arguments(parser: argparse.ArgumentParser, cls: type = Config, *, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every command-line field of `cls`'s sections (but the sections in `skip`),
    one argument group per section: names, types, choices and help from the fields. A flag not
    given leaves the field as the file or the defaults have it (see `from_arguments`)."""
    hints_cls = typing.get_type_hints(cls)
    for sf in dataclasses.fields(cls):
        if sf.name in skip:
            continue
        sec_cls = hints_cls[sf.name]
        group = parser.add_argument_group(sf.name, (sec_cls.__doc__ or "").strip().splitlines()[0])
        hints = typing.get_type_hints(sec_cls)
        for f in dataclasses.fields(sec_cls):
            if not f.metadata.get("cli", True):
                continue
            inner, nullable = _optional(hints[f.name])
            default = _default(f)
            env = f" (env {f.metadata['env']})" if f.metadata.get("env") else ""
            kw: dict[str, Any] = dict(dest=f"{_DEST}{sf.name}.{f.name}", default=argparse.SUPPRESS,
                                      help=f"{f.metadata['help']} [default: {_show(default)}]{env}")
            if inner is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif get_origin(inner) is Literal:
                choices = list(get_args(inner))
                kind = type(choices[0])
                kw.update(type=_parser(kind, nullable), choices=choices + ([None] if nullable else []),
                          metavar="{" + ",".join(map(str, choices)) + ("," + "none" if nullable else "") + "}")
            elif get_origin(inner) is tuple:
                kw.update(nargs="+", metavar="NAME")
            else:
                kw.update(type=_parser(inner, nullable), metavar=_shorthand(f).upper())
            group.add_argument(_flag(f), **kw)


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def _parser(kind: type, nullable: bool):
    def parse(text: str):
        if nullable and text.lower() == "none":
            return None
        return kind(text)
    parse.__name__ = kind.__name__
    return parse


def given(namespace: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the configuration flags given on the command line."""
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(namespace).items():
        if dest.startswith(_DEST):
            section, name = dest[len(_DEST):].split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def from_arguments(namespace: argparse.Namespace, cls: type = Config, *, base: Config | None = None) -> Config:
    """The configuration of a command line: `base` (the defaults, or the file --config names),
    then the flags given."""
    if base is None:
        path = getattr(namespace, "config", None)
        base = cls.from_toml(path) if path else cls()
    return base.replace_sections(given(namespace))


__all__ = ["Config", "ContextConfig", "DataConfig", "DataParallelConfig", "DebugConfig", "ExpertsConfig",
           "InputsConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "PipelineConfig", "PrecisionConfig",
           "RecomputeConfig", "SECTIONS", "TensorConfig", "TrainConfig", "TrainingConfig", "add_arguments",
           "env_flag", "env_str", "from_arguments", "given", "torch_dtype"]

"""Trainer, configuration: the trainer's tree `TrainConfig` -- parallelize's sections
(fxtron.config.Config) and the run's own: the mesh, the model, the data, the optimizer and its
learning-rate schedule, and the run (length, evaluation, checkpoints, metrics, export).

Every field has one shorthand, unique over the whole tree, and with dashes its flag of
`fxtron train` (fxtron/cli.py hands this class to fxtron.config's flag and TOML machinery).
Only the trainer and the command line read these sections; the core layers know `Config` alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from fxtron.config import Config, Section, option
from fxtron.errors import ParallelizeError


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
        if self.path and self.text is not None:
            raise ParallelizeError(f"data.path ({' '.join(self.path)}) and data.text ({self.text}) are two sources of "
                                   "training data: give --data (Megatron datasets) or --text (bytes of a file), not both")
        if not self.path and self.split != _default(type(self), "split"):
            raise ParallelizeError(f"data.split = {self.split!r} splits Megatron datasets (--data); the byte-level text "
                                   "(--text) is split 98/2 between train and valid: drop --split or give --data")
        wanted = [f"--{n.replace('_', '-')}" for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                  if getattr(self, n)]
        if wanted and self.eod_id is None:
            raise ParallelizeError(f"{', '.join(wanted)} find the documents by their end-of-document token: give its id "
                                   "(--eod-id, the tokenizer's eos/eod id that preprocessing appended)")

    @property
    def packed(self) -> bool:
        """Are the samples' documents kept apart (positions or attention)?"""
        return self.reset_position_ids or self.reset_attention_mask


def _default(section: type, name: str):
    """A field's default (a rule tells a value given from the default it leaves alone)."""
    return next(f.default for f in dataclasses.fields(section) if f.name == name)


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
    override_lr_schedule: bool = option(False, help="on resume, train with this run's schedule settings (--lr, "
                                                    "--min-lr, --lr-warmup-steps, --lr-decay-style, --lr-decay-steps) "
                                                    "instead of refusing where the checkpoint's differ; its position "
                                                    "is kept (Megatron's --override-opt_param-scheduler)")
    weight_decay: float = option(0.1, minimum=0, help="AdamW's decoupled weight decay (not on biases and norms)")
    adam_beta1: float = option(0.9, minimum=0, help="AdamW's beta1")
    adam_beta2: float = option(0.95, minimum=0, help="AdamW's beta2")
    adam_eps: float = option(1e-8, positive=True, help="AdamW's epsilon")

    def _rules(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ParallelizeError(f"optimizer.{name} = {getattr(self, name)}: AdamW's betas are in [0, 1) "
                                       "(Megatron's defaults: 0.9 and 0.999; fxtron's beta2: 0.95)")
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
    eval_interval: int | None = option(None, positive=True, help="every this many steps and after the last, the loss on the valid split")
    eval_iters: int = option(2, positive=True, help="global batches of the valid split per evaluation")
    save: str | None = option(None, help="checkpoint directory (Megatron's layout: DIR/iter_0000004, "
                                         "DIR/latest_checkpointed_iteration.txt); a run there is resumed")
    save_interval: int | None = option(None, positive=True, help="save every this many steps (and at the end)")
    keep_last: int | None = option(None, positive=True, help="keep only the newest K checkpoints (default: all)")
    load: str | None = option(None, help="resume from the latest complete checkpoint of this directory, on any "
                                         "mesh (default: --save; a newer one of --save's wins: a restarted run "
                                         "continues)")
    export_hf: str | None = option(None, help="at the end, write the model as transformers' save_pretrained does "
                                                "(a transformers model's; fxtron's own: its weights alone)")
    log_interval: int = option(1, positive=True, help="one log line every this many steps")
    log_file: str | None = option(None, help="append one JSON object per step to this .jsonl file")
    tensorboard_dir: str | None = option(None, help="write the metrics as TensorBoard events here")
    max_skipped: int = option(3, positive=True, help="stop when this many steps in a row had a non-finite loss "
                                                     "or gradient norm (each is skipped; fp16's overflows count "
                                                     "once its loss scale is at its minimum, and always under a "
                                                     "static --loss-scale)")
    peak_flops: float | None = option(None, positive=True, help="peak FLOP/s of one device for MFU (default: the "
                                                                "device's, when known)")

    def _rules(self) -> None:
        if self.save_interval is not None and self.save is None:
            raise ParallelizeError("training.save_interval needs training.save (--save DIR)")
        if self.keep_last is not None and self.save is None:
            raise ParallelizeError("training.keep_last prunes the checkpoints of training.save: it needs --save DIR")
        if self.eval_interval is None and self.eval_iters != _default(type(self), "eval_iters"):
            raise ParallelizeError(f"training.eval_iters = {self.eval_iters} sets how many batches an evaluation takes, "
                                   "but this run does not evaluate: give --eval-interval N (fxtron evaluates only "
                                   "where asked; Megatron's default is every 1000 steps)")


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

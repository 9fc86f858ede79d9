"""Core, configuration: the typed tree of every option of `parallelize` -- frozen dataclasses,
one per section, checked when made, written and read as TOML, and the command lines' flags
generated from it.

    fields.py     how a section's field is declared and checks itself (`option`, `Section`), the
                  closest choice or key for a misspelling, dtype names, the FXTRON_* switches
    sections.py   the sections the compiler and runtime read and `Config`, their tree
    toml.py       the tree as TOML and back
    flags.py      the argparse flags of a tree and the tree a command line gives

Every field has one *shorthand*, unique over the whole tree: the keyword `parallelize` takes for it
(today's keyword names: `schedule=`, `cp_comm_type=`, `recompute_layers=` ...) and, with dashes, its
command-line flag (`--cp-comm-type`). `Config.replace(**shorthand)` sets fields by shorthand;
`to_toml` / `from_toml` write and read the tree; `add_arguments` / `from_arguments` generate the
argparse flags of `fxtron train` and `fxtron inspect` from it.

A value is checked when its section is made: a ParallelizeError names the field, the value and the
choices (with the closest one), on any mesh. `Config.check(mesh)` adds what needs the mesh. The
FXTRON_* environment variables set the debug section's defaults, each read here and nowhere else.

The trainer's own sections (mesh, model, data, optimizer, training) and their tree `TrainConfig`
live above, in fxtron/trainer/config.py: this layer holds what `parallelize` takes and no more,
and the flag and TOML machinery takes the tree to work on as an argument.
"""
from fxtron.config.fields import Section, env_flag, env_str, option, torch_dtype
from fxtron.config.flags import add_arguments, from_arguments, given
from fxtron.config.sections import (SECTIONS, AuxLoss, CodegenConfig, Config, ContextConfig, CPCommType,
                                    DataParallelConfig,
                                    DebugConfig, Device, DType, ExpertsConfig, Granularity, InputsConfig,
                                    PipelineConfig, PlanMode, PrecisionConfig, RecomputeConfig, RecomputeMethod,
                                    Schedule, TensorConfig, ZeroStage)

__all__ = ["CodegenConfig", "Config", "ContextConfig", "DataParallelConfig", "DebugConfig", "ExpertsConfig",
           "InputsConfig",
           "PipelineConfig", "PrecisionConfig", "RecomputeConfig", "SECTIONS", "Section", "TensorConfig",
           "add_arguments", "env_flag", "env_str", "from_arguments", "given", "option", "torch_dtype",
           "AuxLoss", "CPCommType", "DType", "Device", "Granularity", "PlanMode", "RecomputeMethod", "Schedule",
           "ZeroStage"]

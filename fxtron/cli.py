"""Command line: `python -m fxtron {mesh,train,inspect,bench,export,preprocess} ...` (also installed as `fxtron`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from fxtron import config
from fxtron.errors import LaunchError, ParallelizeError, RefusalError
from fxtron.runtime.launch import torchrun_world
from fxtron.trainer.config import TrainConfig


#: the sections of the configuration tree `fxtron inspect` takes (all but the trainer's own run)
INSPECT_SKIP = ("model", "data", "optimizer", "training")
#: how long a torchrun rank other than 0 waits before exiting on a refused run, so that rank 0 says
#: why: it costs nothing when rank 0 does (torchrun ends the job when rank 0 exits, the others
#: with it) and only bounds a rank 0 that never does; 5 s was shorter than rank 0's lag on a
#: loaded machine, and the job then ended without the reason
REFUSED_GRACE_S = 60.0
#: the sections `fxtron mesh` takes
MESH_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "mesh")


def _config_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The configuration's flags (fxtron.config generates them) and --config FILE.toml."""
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read the configuration from this TOML file (--print-config writes one); flags override it. "
                        "inspect also takes KEY=VALUE,... here: an hf:<architecture>'s configuration (--model-config)")
    config.add_arguments(p, TrainConfig, skip=skip)


def _with_world(cfg: TrainConfig, default: int) -> TrainConfig:
    """The command's default world size where none was given: `default` ranks when the
    model-parallel sizes divide it, else one data-parallel replica."""
    if cfg.mesh.world_size is not None:
        return cfg
    m = cfg.mesh
    model_parallel = m.tp * m.pp * m.cp * m.ep
    return cfg.replace(world_size=default if default % model_parallel == 0 else model_parallel)


def _seq_for(traced, a) -> int:
    """The sequence length inspect evaluates its figures at: --seq, within what the model takes
    (passes/limits.py seq_limit: a position table's rows); its default cut to that, said."""
    from fxtron.passes.limits import seq_limit
    limit = seq_limit(traced)
    if limit is None or a.seq <= limit.tokens:
        return a.seq
    if a.seq_given:
        raise ParallelizeError(f"--seq {a.seq}: the model takes at most {limit.tokens} tokens ({limit.why}); "
                               f"give --seq {limit.tokens} or less")
    print(f"--seq: the default {a.seq} is more than the model takes ({limit.why}): figures at {limit.tokens} tokens",
          file=sys.stderr)
    return limit.tokens


def _sets(path: str | None, section: str, name: str) -> bool:
    """Whether the TOML file at `path` sets [section] name."""
    if path is None:
        return False
    import tomllib
    with open(path, "rb") as fh:
        return name in tomllib.load(fh).get(section, {})


def _cmd_mesh(a) -> int:
    print(_with_world(config.from_arguments(a, TrainConfig), 8).mesh.mesh().format_table())
    return 0


def _cmd_train(a) -> int:
    from fxtron.trainer.loop import preflight_run, run

    try:
        cfg = config.from_arguments(a, TrainConfig)       # the TOML file's mistakes too
        if a.print_config:
            print(_with_world(cfg, 4).to_toml(), end="")
            return 0
        if torchrun_world() is None:
            cfg = _with_world(cfg, 4)
        # before starting processes: every option against the mesh, the model, the data, the heads
        cfg = preflight_run(cfg)
    except ParallelizeError as e:
        e.refused = True
        raise
    run(cfg, checked=True)
    return 0


def _cmd_inspect(a) -> int:
    import json

    import fxtron
    from fxtron.tools import planner
    from fxtron.tools.inspect import inspect, load_model

    if a.config and "=" in a.config and not os.path.exists(a.config):
        # `--config key=value,...`: the hf:<architecture>'s configuration, as --model-config takes it
        a.model_config, a.config = [*a.model_config, *a.config.split(",")], None
    cfg = _with_world(config.from_arguments(a, TrainConfig), 8)
    from fxtron.trainer.models import key_values
    if a.svg and not os.path.isdir(os.path.dirname(os.path.abspath(a.svg))):
        raise ParallelizeError(f"--svg {a.svg}: the directory {os.path.dirname(os.path.abspath(a.svg))} does not "
                               "exist; give a path in one that does")
    model, args, kwargs = load_model(a.model, overrides=key_values(a.model_config))
    a.seq_given, a.seq = a.seq is not None, a.seq or 2048
    if a.what_if:
        from fxtron.compiler.trace import trace
        chosen = {f"--{k.replace('_', '-')}" for section in config.given(a).values() for k in section} - {"--world-size"}
        if chosen:
            raise ParallelizeError(f"inspect --what-if searches the meshes and options itself over --world-size; "
                                   f"{', '.join(sorted(chosen))} would be ignored: drop {'them' if len(chosen) > 1 else 'it'}, "
                                   "or inspect that one configuration without --what-if")
        traced = trace(model, args, example_kwargs=kwargs)
        a.seq = _seq_for(traced, a)
        dims = planner.dims_of(traced)
        hw = planner.Hardware(memory=a.gpu_memory, flops_per_s=a.flops, efficiency=a.efficiency,
                             intra_node_bw=a.intra_node_bw, inter_node_bw=a.inter_node_bw,
                             gpus_per_node=a.gpus_per_node)
        world = cfg.mesh.mesh().world_size
        measured = (None if a.formulas else
                    planner.MeasuredActivations(model, args, kwargs, micro_batch=1, seq=a.seq, dtype="bf16"))
        ps = planner.candidates(dims, hw, world=world, global_batch=a.global_batch, seq=a.seq, activations=measured)
        if measured is not None and measured.errors:
            print("activations by the formulas where the model could not run on fake tensors: "
                  + "; ".join(f"tp={k[0]} sp={k[1]} recompute={k[2]}: {e}" for k, e in list(measured.errors.items())[:2]))
        if a.json:
            print(json.dumps({"dims": dims.__dict__, "hardware": hw.__dict__, "candidates": [p.as_dict() for p in ps]}))
            return 0
        print(f"{a.model}: {dims.params:,} parameters, {dims.layers} layers, hidden {dims.hidden}, {dims.heads} heads, "
              f"vocab {dims.vocab}; {world} GPUs, global batch {a.global_batch} x {a.seq} tokens")
        if not ps:
            print(f"no mesh fits in {a.gpu_memory / 2**30:.1f} GiB per GPU; the smallest needs "
                  f"{min(p.memory_bytes for p in planner.candidates(dims, hw, world=world, global_batch=a.global_batch, seq=a.seq, fits_only=False, activations=measured)) / 2**30:.1f} GiB")
            return 1
        print(f"{len(ps)} meshes fit, fastest first (modeled):")
        print(planner.format_candidates(ps, hw, top=a.top))
        return 0
    mesh = cfg.mesh.mesh()
    if mesh.pp > 1 and "microbatches" not in config.given(a).get("pipeline", {}) and \
            not _sets(a.config, "pipeline", "microbatches"):
        cfg = cfg.replace(microbatches=2 * mesh.pp)      # inspect's default: 2 microbatches per stage
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs, config=cfg.parallel())
    a.seq = _seq_for(pm.traced, a)
    rank = a.rank if a.rank is not None else 0
    report = inspect(pm, rank, model_name=a.model, batch=a.batch, seq=a.seq)
    if a.svg:
        from fxtron.compiler.draw import draw_graph
        rg = pm.compiled(rank)
        for i, g in enumerate(rg.graphs):
            path = a.svg if len(rg.graphs) == 1 else a.svg.replace(".svg", f".chunk{i}.svg")
            draw_graph(g, path, title=f"{a.model} rank {rank}")
    print(json.dumps(report.as_dict()) if a.json else report.text(graph=not a.no_graph))
    return 0


def _cmd_bench(a) -> int:
    from fxtron.tools.bench import run
    return run(quick=a.quick, output=a.output, extra=a.pytest_args)


def _cmd_export(a) -> int:
    from fxtron.runtime.checkpoint.hf import export
    files = export(a.checkpoint, a.out, like=a.like, max_shard_size=a.max_shard_size, dtype=a.dtype)
    print(f"wrote {a.out}: {', '.join(files)}")
    return 0


def _cmd_preprocess(a) -> int:
    from fxtron.data.preprocess import preprocess
    counts = preprocess(a.input, a.tokenizer, a.output_prefix, json_key=a.json_key, eod_token=a.eod_token,
                        append_eod=a.append_eod)
    print(f"wrote {a.output_prefix}.bin and {a.output_prefix}.idx: {counts['documents']:,} documents, "
          f"{counts['tokens']:,} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: mesh, train, inspect, export, preprocess and bench, the configuration's flags
    generated."""
    parser = argparse.ArgumentParser(prog="fxtron", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("mesh", allow_abbrev=False, help="print a mesh's rank layout (Megatron's groups)")
    config.add_arguments(p, TrainConfig, skip=MESH_ONLY)
    p.set_defaults(fn=_cmd_mesh)

    p = sub.add_parser("train", allow_abbrev=False, help="train a shipped model on local processes and compare with one process",
                       description="Every option is a field of fxtron.trainer.config.TrainConfig: --print-config "
                                   "writes the resolved configuration as TOML, --config reads one, flags override it.")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    _config_args(p)
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("inspect", allow_abbrev=False, help="compile one rank of a mesh without processes and describe it")
    p.add_argument("model", help="preset (gpt-tiny .. llama-7b), hf:<architecture> (hf:llama), module:factory, or a "
                                 "transformers directory (config.json), as train's --model")
    p.add_argument("--rank", type=int, default=None, help="the rank to compile (default 0)")
    p.add_argument("--model-config", nargs="+", default=[], metavar="KEY=VALUE",
                   help="fields of an hf:<architecture>'s transformers config (num_hidden_layers=4 hidden_size=1024)")
    p.add_argument("--batch", type=_positive(int), default=1, help="sequences per rank and microbatch, to evaluate the formulas")
    p.add_argument("--seq", type=_positive(int), default=None,
                   help="tokens per sequence, to evaluate the formulas (default: 2048, or what the model takes)")
    p.add_argument("--json", action="store_true", help="the same as data")
    p.add_argument("--no-graph", action="store_true", help="leave the per-rank graph out of the text")
    p.add_argument("--svg", default=None, help="draw the rank's graph to this .svg (or .png) file")
    p.add_argument("--what-if", "--plan", dest="what_if", action="store_true",
                   help="the meshes of --world-size that fit, fastest first (modeled)")
    p.add_argument("--gpu-memory", default="80GiB", type=_bytes, help="memory per GPU (--what-if): 80GiB, 141 GB, ...")
    p.add_argument("--global-batch", type=_positive(int), default=512, help="sequences per step (--what-if)")
    p.add_argument("--flops", type=_positive(float), default=312e12, help="peak FLOP/s per GPU (--what-if)")
    p.add_argument("--efficiency", type=_positive(float), default=0.5, help="fraction of peak reached (--what-if)")
    p.add_argument("--intra-node-bw", type=_positive(float), default=300e9, help="bytes/s per GPU inside a node (--what-if)")
    p.add_argument("--inter-node-bw", type=_positive(float), default=25e9, help="bytes/s per GPU between nodes (--what-if)")
    p.add_argument("--gpus-per-node", type=_positive(int), default=8)
    p.add_argument("--top", type=_positive(int), default=10, help="meshes to list (--what-if)")
    p.add_argument("--formulas", action="store_true",
                   help="--what-if: activations by Korthikanti's formulas, not measured on fake tensors")
    _config_args(p, skip=INSPECT_SKIP)
    p.set_defaults(fn=_cmd_inspect)

    p = sub.add_parser("export", allow_abbrev=False, help="write an fxtron checkpoint (any mesh) as a transformers directory",
                       description="Reads the checkpoint tensor by tensor in this one process and writes what "
                                   "transformers' save_pretrained writes: safetensors shards with an index, "
                                   "transformers' key layout, config.json, generation_config.json and the tokenizer's "
                                   "files (tokenizer.json, tokenizer_config.json, ...) from --like.")
    p.add_argument("checkpoint", help="a checkpoint directory prog.save wrote")
    p.add_argument("out", help="the directory to write")
    p.add_argument("--like", required=True, metavar="DIR",
                   help="the transformers directory (or its config.json) whose configuration the model has")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="write the floating tensors in this dtype (default: as saved)")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("preprocess", allow_abbrev=False, help="tokenize .jsonl / .txt into Megatron's indexed dataset (PREFIX.bin/.idx)",
                       description="Megatron's tools/preprocess_data.py format: one document per JSON line or .txt "
                                   "file, an end-of-document token appended, uint16 tokens below 65,500 of "
                                   "vocabulary, else int32.")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl or .txt files")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json (transformers' tokenizers) or its directory")
    p.add_argument("--output-prefix", required=True, help="write OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--json-key", default="text", help="the field of each JSON line holding the text")
    p.add_argument("--eod-token", default=None, help="the end-of-document token (default: tokenizer_config.json's "
                                                     "eos_token, else <|endoftext|>, </s>, ...)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the end-of-document token to every document")
    p.set_defaults(fn=_cmd_preprocess)

    p = sub.add_parser("bench", allow_abbrev=False, help="run the benchmark suite and print every figure beside its baseline")
    p.add_argument("--quick", action="store_true", help="the fast benchmarks only (a few minutes on 2 cores)")
    p.add_argument("--output", default=".benchmarks/latest.json", help="pytest-benchmark JSON to write")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest")
    p.set_defaults(fn=_cmd_bench)
    return parser


def _positive(kind):
    """An argparse type: a number of `kind` above zero (argparse's one-line error otherwise)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return v
    parse.__name__ = kind.__name__
    return parse


def _bytes(text: str) -> float:
    """An argparse type: a memory size ('80GiB', '141 GB', '512MiB', bytes)."""
    from fxtron.tools.planner import parse_bytes
    try:
        v = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give a number with TiB, GiB, MiB, TB, GB, MB or B "
                                         "(80GiB)") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return v


#: Megatron's flags whose fxtron counterpart differs in meaning (the rest are named in the flags' help)
MEGATRON_NAMES = {"--micro-batch-size": "--microbatches, a count per data-parallel rank: the global --batch over "
                                        "dp x --micro-batch-size",
                  "--tensor-model-parallel-size": "--tp", "--pipeline-model-parallel-size": "--pp",
                  "--context-parallel-size": "--cp", "--expert-model-parallel-size": "--ep",
                  "--use-distributed-optimizer": "--zero 1"}


def _unknown(parser: argparse.ArgumentParser, cmd: str, extras: list[str]) -> None:
    """Refuse arguments the command does not take under the command's own usage, suggesting
    the nearest flag it has (argparse would print the top-level usage, no suggestion)."""
    import difflib
    import re
    sub = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    flags = sorted({o for action in sub._actions for o in action.option_strings if o.startswith("--")})
    # Megatron's names for the flags whose help names them ("Megatron's --train-iters"): a Megatron
    # user's flag is answered with fxtron's, not with the nearest spelling (--eval-iters)
    megatron = {**MEGATRON_NAMES, **{m: f"{action.option_strings[-1]}" for action in sub._actions if action.option_strings
                                     for m in re.findall(r"Megatron's (--[\w-]+)", action.help or "")}}
    words = []
    for arg in extras:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            if name in megatron:
                words.append(f"{name} (Megatron's name; fxtron's: {megatron[name]})")
                continue
            if name in ("--dp", "--data-parallel-size") and "--world-size" in flags:
                words.append(f"{name} (dp is what the world leaves: --world-size / (tp x pp x cp), as Megatron's)")
                continue
            near = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            words.append(f"{name}" + (f" (did you mean {near[0]}?)" if near else ""))
    if not words:
        words = [" ".join(extras)]
    sub.error(f"unrecognized argument{'s' if len(words) > 1 else ''}: {', '.join(words)}")


def _torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if torchrun_world() is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a, extras = parser.parse_known_args(argv)
    if extras:
        _unknown(parser, a.cmd, extras)
    try:
        return a.fn(a)
    except (ParallelizeError, LaunchError) as e:
        # a run refused before any rank started says so once: under torchrun rank 0 alone; the
        # others wait a moment first, for torchrun ends the job at the first rank to exit
        if getattr(e, "refused", False) and _torchrun_rank() not in (None, 0):
            import time
            time.sleep(REFUSED_GRACE_S)
            return 2
        kind = "ParallelizeError" if isinstance(e, RefusalError) else type(e).__name__   # (the ranks' own)
        print(f"fxtron {a.cmd}: {kind}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m fxtron {mesh,train,inspect,bench} ...` (also installed as `fxtron`)."""
from __future__ import annotations

import argparse
import sys

from fxtron.errors import LaunchError, ParallelizeError


def _mesh_args(p: argparse.ArgumentParser, world_default: int) -> None:
    p.add_argument("--world-size", type=int, default=world_default, help="number of ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")


def _cmd_mesh(a) -> int:
    from fxtron.mesh import Mesh

    print(Mesh(a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, order=a.order).format_table())
    return 0


def _cmd_train(a) -> int:
    from fxtron.train import TrainConfig, run

    cfg = TrainConfig(model=a.model, world_size=a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep,
                      steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, seed=a.seed, data=a.data,
                      microbatches=a.microbatches, schedule=a.schedule, trace=a.trace, recompute=a.recompute,
                      recompute_method=a.recompute_method, recompute_layers=a.recompute_layers)
    cfg.mesh()  # validate before starting processes
    run(cfg, compare=not a.no_compare)
    return 0


def _cmd_inspect(a) -> int:
    import json

    import fxtron
    from fxtron import planner
    from fxtron.inspection import inspect, load_model

    model, args, kwargs = load_model(a.model)
    if a.what_if:
        from fxtron.compiler.trace import trace
        traced = trace(model, args, example_kwargs=kwargs)
        dims = planner.dims_of(traced)
        hw = planner.Hardware(memory=planner.parse_bytes(a.gpu_memory), flops_per_s=a.flops, efficiency=a.efficiency,
                             intra_node_bw=a.intra_node_bw, inter_node_bw=a.inter_node_bw,
                             gpus_per_node=a.gpus_per_node)
        ps = planner.candidates(dims, hw, world=a.world_size, global_batch=a.global_batch, seq=a.seq)
        if a.json:
            print(json.dumps({"dims": dims.__dict__, "hardware": hw.__dict__, "candidates": [p.as_dict() for p in ps]}))
            return 0
        print(f"{a.model}: {dims.params:,} parameters, {dims.layers} layers, hidden {dims.hidden}, {dims.heads} heads, "
              f"vocab {dims.vocab}; {a.world_size} GPUs, global batch {a.global_batch} x {a.seq} tokens")
        if not ps:
            print(f"no mesh fits in {a.gpu_memory} per GPU; the smallest needs "
                  f"{min(p.memory_bytes for p in planner.candidates(dims, hw, world=a.world_size, global_batch=a.global_batch, seq=a.seq, fits_only=False)) / 2**30:.1f} GiB")
            return 1
        print(f"{len(ps)} meshes fit, fastest first (modeled):")
        print(planner.format_candidates(ps, hw, top=a.top))
        return 0
    mesh = fxtron.Mesh(a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep)
    m = a.microbatches or (2 * a.pp if a.pp > 1 else 1)
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs,
                            sequence_parallel=a.sequence_parallel, microbatches=m, schedule=a.schedule,
                            virtual_stages=a.virtual_stages, zero=a.zero, cp_comm_type=a.cp_comm_type,
                            recompute=a.recompute, recompute_method=a.recompute_method,
                            recompute_layers=a.recompute_layers)
    rank = a.rank if a.rank is not None else 0
    if a.dump:
        pm.compiled(rank, a.dump)
    report = inspect(pm, rank, model_name=a.model, batch=a.batch, seq=a.seq, zero=a.zero)
    if a.svg:
        from fxtron.compiler.draw import draw_graph
        rg = pm.compiled(rank)
        for i, g in enumerate(rg.graphs):
            path = a.svg if len(rg.graphs) == 1 else a.svg.replace(".svg", f".chunk{i}.svg")
            draw_graph(g, path, title=f"{a.model} rank {rank}")
    print(json.dumps(report.as_dict()) if a.json else report.text(graph=not a.no_graph))
    return 0


def _cmd_bench(a) -> int:
    from fxtron.bench import run
    return run(quick=a.quick, output=a.output, extra=a.pytest_args)


def _recompute_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recompute", default=None, choices=["selective", "full"],
                   help="activation recomputation: the attention cores (selective) or whole layers (full)")
    p.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full: groups of --recompute-layers layers (uniform) or the first of every stage (block)")
    p.add_argument("--recompute-layers", type=int, default=None, help="full: layers per group, or recomputed per stage")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxtron", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("mesh", help="print a mesh's rank layout (Megatron's groups)")
    _mesh_args(p, 8)
    p.add_argument("--order", default="tp-cp-ep-dp-pp", help="axis order, fastest first")

    p.set_defaults(fn=_cmd_mesh)

    p = sub.add_parser("train", help="train a shipped model on local processes and compare with one process")
    p.add_argument("--model", default="gpt-tiny", help="shipped preset (fxtron.models.list_presets())")
    _mesh_args(p, 4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file to train on (default: Python's standard library sources)")
    p.add_argument("--microbatches", type=int, default=1, help="per step and data-parallel rank")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, zb-h1")
    p.add_argument("--no-compare", action="store_true", help="skip the one-process reference run")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the last step's passes and memory per rank to DIR (trace.json for Perfetto or "
                        "chrome://tracing, schedule.png)")
    _recompute_args(p)
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("inspect", help="compile one rank of a mesh without processes and describe it")
    p.add_argument("model", help="preset (gpt-tiny .. llama-7b), hf:<architecture> (hf:llama), or module:factory")
    _mesh_args(p, 8)
    p.add_argument("--rank", type=int, default=None, help="the rank to compile (default 0)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp-comm-type", default="p2p", help="context parallel attention: p2p (the ring) or all_gather")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=None, help="per step (default 2 x pp)")
    p.add_argument("--zero", type=int, default=0, help="1: distributed optimizer (memory per rank)")
    _recompute_args(p)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank and microbatch, to evaluate the formulas")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence, to evaluate the formulas")
    p.add_argument("--json", action="store_true", help="the same as data")
    p.add_argument("--no-graph", action="store_true", help="leave the per-rank graph out of the text")
    p.add_argument("--dump", default=None, help="write the graph after every pass to this directory")
    p.add_argument("--svg", default=None, help="draw the rank's graph to this .svg (or .png) file")
    p.add_argument("--what-if", "--plan", dest="what_if", action="store_true",
                   help="the meshes of --world-size that fit, fastest first (modeled)")
    p.add_argument("--gpu-memory", default="80GiB")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step (--what-if)")
    p.add_argument("--flops", type=float, default=312e12, help="peak FLOP/s per GPU (--what-if)")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak reached (--what-if)")
    p.add_argument("--intra-node-bw", type=float, default=300e9, help="bytes/s per GPU inside a node (--what-if)")
    p.add_argument("--inter-node-bw", type=float, default=25e9, help="bytes/s per GPU between nodes (--what-if)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--top", type=int, default=10, help="meshes to list (--what-if)")
    p.set_defaults(fn=_cmd_inspect)

    p = sub.add_parser("bench", help="run the benchmark suite and print every figure beside its baseline")
    p.add_argument("--quick", action="store_true", help="the fast benchmarks only (a few minutes on 2 cores)")
    p.add_argument("--output", default=".benchmarks/latest.json", help="pytest-benchmark JSON to write")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest")
    p.set_defaults(fn=_cmd_bench)

    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except (ParallelizeError, LaunchError) as e:
        print(f"fxtron {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

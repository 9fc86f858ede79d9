"""Command line: `python -m fxtron {mesh,train} ...` (also installed as `fxtron`)."""
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
                      steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, seed=a.seed, data=a.data)
    cfg.mesh()  # validate before starting processes
    run(cfg, compare=not a.no_compare)
    return 0


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
    p.add_argument("--no-compare", action="store_true", help="skip the one-process reference run")
    p.set_defaults(fn=_cmd_train)

    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except (ParallelizeError, LaunchError) as e:
        print(f"fxtron {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

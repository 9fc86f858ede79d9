"""A picture of a per-rank graph (SVG or PNG): nodes top to bottom in execution order, each
value in a lane of its own while it is live (so the residual stream runs down one lane and
each branch leaves and rejoins it), an edge from every producer to its consumers labelled
with the placement it carries, collectives in red, parameters folded into their users.
matplotlib draws it; no graphviz needed."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.fx as fx  # noqa: E402

from fxtron.core import meta  # noqa: E402
from fxtron.ops import registry  # noqa: E402


def _label(node: fx.Node) -> str:
    t = node.target
    name = getattr(t, "__name__", str(t)).split(".")[0] if node.op == "call_function" else node.op
    return f"%{node.name}: {name}"


def _is_collective(node: fx.Node) -> bool:
    spec = registry.spec_of(node.target) if node.op == "call_function" else None
    return spec is not None and (spec.forward is not None or spec.backward is not None)


def draw_graph(gm: fx.GraphModule, path: str, title: str = "") -> str:
    """Draw `gm` to `path` (.svg or .png); returns the path."""
    nodes = [n for n in gm.graph.nodes if not meta.is_param(n)]
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max([index[u] for u in n.users if u in index], default=index[n]) for n in nodes}
    lanes: dict[fx.Node, int] = {}
    free_at: list[int] = []          # lane -> index after which it is free
    for n in nodes:
        i = index[n]
        lane = next((k for k, f in enumerate(free_at) if f < i), None)
        if lane is None:
            lane = len(free_at)
            free_at.append(0)
        lanes[n] = lane
        free_at[lane] = last_use[n]
    width = max(len(free_at), 1)
    fig, ax = plt.subplots(figsize=(4 + 2.2 * width, 0.32 * len(nodes) + 1))
    for n in nodes:
        x, y = lanes[n], -index[n]
        for u in n.users:
            if u not in index:
                continue
            ux, uy = lanes[u], -index[u]
            ax.plot([x, x, ux], [y, uy + 0.3, uy], color="#BBBBBB", linewidth=0.6, zorder=1)
            pl = meta.get(n, meta.PLACEMENT)
            if pl is not None and str(pl) and ux != x:
                ax.text((x + ux) / 2, uy + 0.35, str(pl), fontsize=5, color="#555555", ha="center")
        params = [a for a in n.all_input_nodes if a not in index]
        text = _label(n) + (f"  [{', '.join(a.name for a in params)}]" if params else "")
        shape = meta.get(n, meta.LOCAL_SHAPE)
        if shape is not None:
            text += "  (" + ", ".join(str(s) for s in shape) + ")"
        color = "#C44E52" if _is_collective(n) else ("#4C72B0" if n.op == "call_function" else "#55A868")
        ax.scatter([x], [y], s=18, color=color, zorder=3)
        ax.text(x + 0.08, y, text, fontsize=6, va="center", color=color if _is_collective(n) else "black", zorder=4)
    ax.set_xlim(-0.5, width + 2.5)
    ax.set_ylim(-len(nodes), 1)
    ax.axis("off")
    ax.set_title(title + "  (red: collectives; edge labels: placements)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

"""Draw the computation graph of one self-attention head (docs/img/self_attention_graph.svg).

The nodes and edges are attngrad.derivation.chain_rule.GRAPH, the structure whose paths are
the terms of the chain-rule sums, so the picture cannot disagree with the code.

    python docs/draw_graph.py [OUTPUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from attngrad.derivation.chain_rule import GRAPH  # noqa: E402

# where each node sits, how it is written (mathtext), and what it is
POSITIONS = {
    "x": (0.0, 2.2), "x'": (0.0, 0.0), "q": (3.6, 1.1), "W_K": (2.5, -1.1), "W_Q": (4.7, -1.1),
    "p": (6.3, 1.1), "y": (8.7, 2.2), "f": (10.7, 2.2),
}
LABELS = {"x": r"$x_i$", "x'": r"$x'_j$", "W_K": r"$W_K$", "W_Q": r"$W_Q$", "q": r"$q_{ij}$",
          "p": r"$p_{ij}$", "y": r"$y_j$", "f": r"$f$"}
ROLES = {"x": "input as keys\nand values", "x'": "the same input\nas queries", "W_K": "weight", "W_Q": "weight",
         "q": "score", "p": "column\nsoftmax", "y": "output", "f": "loss"}
# where each edge's label goes, relative to the edge's midpoint: (dx, dy, horizontal alignment)
LABEL_AT = {
    ("x", "q"): (-0.1, 0.25, "center"), ("x'", "q"): (-0.6, -0.42, "center"), ("W_K", "q"): (-0.2, -0.35, "right"),
    ("W_Q", "q"): (0.2, -0.35, "left"), ("q", "p"): (0.0, 0.15, "center"), ("p", "y"): (-0.2, 0.2, "right"),
    ("x", "y"): (0.0, 1.42, "center"), ("y", "f"): (0.0, 0.15, "center"),
}
CURVED = {("x", "y"): -0.28}  # the direct value path arcs over the softmax


def draw(output: Path) -> list[tuple[str, str]]:
    """Draw GRAPH to `output` (SVG or PNG by suffix); return the edges drawn."""
    plt.rcParams["svg.hashsalt"] = "attngrad"  # stable ids, so the file only changes with the graph
    fig, ax = plt.subplots(figsize=(12, 5.2))
    ax.set_xlim(-1.6, 11.4)
    ax.set_ylim(-1.9, 4.0)
    ax.axis("off")
    for name, (px, py) in POSITIONS.items():
        weight = name.startswith("W_")
        ax.text(px, py, LABELS[name], ha="center", va="center", fontsize=17, zorder=3,
                bbox=dict(boxstyle="round,pad=0.45", fc="#eef3fb" if not weight else "#fbf3e6",
                          ec="#3b5b92" if not weight else "#a8742a", lw=1.4))
        if name in ("x", "x'"):  # inputs: role on the left, out of the edges' way
            ax.text(px - 0.45, py, ROLES[name], ha="right", va="center", fontsize=8.5, color="#555555")
        elif name == "q":  # the weights arrive from below
            ax.text(px, py + 0.4, ROLES[name], ha="center", va="bottom", fontsize=8.5, color="#555555")
        else:
            ax.text(px, py - 0.4, ROLES[name], ha="center", va="top", fontsize=8.5, color="#555555")
    drawn = []
    for edge in GRAPH:
        (x0, y0), (x1, y1) = POSITIONS[edge.source], POSITIONS[edge.target]
        rad = CURVED.get((edge.source, edge.target), 0.0)
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=16, lw=1.3,
                                     color="#333333", shrinkA=22, shrinkB=22,
                                     connectionstyle=f"arc3,rad={rad}", zorder=2))
        dx, dy, align = LABEL_AT.get((edge.source, edge.target), (0.0, 0.15, "center"))
        ax.text((x0 + x1) / 2 + dx, (y0 + y1) / 2 + dy, edge.local, ha=align, va="center", fontsize=10,
                color="#1f4e9c", zorder=4,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
        drawn.append((edge.source, edge.target))
    ax.set_title("One self-attention head: x and x' hold the same values in two roles; "
                 "every path from an input to f is one term of the chain rule", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, metadata={"Date": None} if output.suffix == ".svg" else None)
    plt.close(fig)
    return drawn


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "img" / "self_attention_graph.svg"
    target.parent.mkdir(parents=True, exist_ok=True)
    draw(target)
    print(f"wrote {target}")

"""A picture of what every encoding in positional_embeddings.py does to attention.

One small panel per class in ``docs/figures/gallery.png`` and one larger figure per class in
``docs/figures/gallery/<name>.png``. Every module is drawn as built (``torch.manual_seed(0)``,
untrained): learned tables (learned absolute, T5, TUPE, ...) therefore show their random
initialisation, and the panel title says "init". What is drawn depends on the kind:

* ``"bias"``: the bias matrix ``[Nq, Nk]`` of ``attention_bias`` for head 0 and the last
  head, side by side (row = query, column = key; grey = ``-inf``, i.e. masked).
* ``"qk"`` and ``"logits"``: the logits of ``forward_attn(q, k)`` with the SAME FIXED q and k
  at every position: ``q = k = (1, ..., 1)`` (the all-ones head vector). The content
  part ``q . k`` is then one constant, so the matrix shows only what position adds (for a
  rotation: ``1^T R_i^T R_j 1``). Head 0, and the last head in the per-class figure.
* ``"input"``: the cosine similarity of the position codes of every pair of positions;
  a code is ``pe.embed(p)`` where the class has ``embed``, else ``forward_input(x) - x`` for
  the constant sequence ``x = 1`` (Heinsen's recurrence, convolutions).
* grid encodings (2 position axes), on an 8 x 8 grid: the same quantity between the centre
  token (row 4, column 4) and every token, drawn as an 8 x 8 image. Positions are integer
  (row, column), except for coordinate encodings (Fourier features), which get them scaled
  to ``[-1, 1]``; window biases (Swin's table) index the window's tokens in row-major order.
* the tree encoding, on the complete binary tree of depth 3 (15 nodes, breadth-first ids):
  the logits from node 4 to every node, drawn on the tree (and the 15 x 15 matrix).

Classes are listed in ``GALLERY`` (name -> factory); those the library does not have yet
sit behind ``hasattr`` guards. A panel that fails to draw shows the error instead of
stopping the figure, and the script reports encoding classes of ``__all__`` with no entry.

    python benchmarks/gallery.py                        # docs/figures/gallery.png and docs/figures/gallery/*.png
    python benchmarks/gallery.py --out-dir /tmp/g       # somewhere else
    python benchmarks/gallery.py --only rotary,alibi    # a few classes
"""

import argparse
import math
import os
import pathlib
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import positional_embeddings as pe_lib  # noqa: E402

Tensor = torch.Tensor

NUM_HEADS, HEAD_DIM = 8, 32
DIM = NUM_HEADS * HEAD_DIM
SEQ_LEN = 32
GRID = (8, 8)
CENTRE = (GRID[0] // 2, GRID[1] // 2)
TREE_DEPTH, TREE_QUERY = 3, 4


@dataclass(frozen=True)
class Entry:
    """One class to draw: ``build()`` returns the module; ``layout`` is seq, grid or tree."""

    name: str
    class_name: str
    build: Callable
    layout: str = "seq"
    learned: bool = False         # drawn at initialisation: the picture is the init, not a trained model
    unit_coordinates: bool = False   # grid positions as floats in [-1, 1] (coordinate encodings), not indices


def _gallery() -> dict:
    has = lambda name: hasattr(pe_lib, name)
    H, Dh, D = NUM_HEADS, HEAD_DIM, DIM
    entries = [
        Entry("sinusoidal", "SinusoidalPositionalEmbedding", lambda: pe_lib.SinusoidalPositionalEmbedding(D)),
        Entry("learned", "LearnedPositionalEmbedding", lambda: pe_lib.LearnedPositionalEmbedding(SEQ_LEN, D),
              learned=True),
        Entry("rotary", "RotaryPositionalEmbedding", lambda: pe_lib.RotaryPositionalEmbedding(Dh)),
        Entry("t5", "T5PositionalEmbedding", lambda: pe_lib.T5PositionalEmbedding(H, bidirectional=False),
              learned=True),
        Entry("alibi", "ALiBiPositionalEmbedding", lambda: pe_lib.ALiBiPositionalEmbedding(H)),
        Entry("tupe", "UnifiedPositionalEmbedding", lambda: pe_lib.UnifiedPositionalEmbedding(SEQ_LEN, H, Dh),
              learned=True),
        Entry("transformer_xl", "TransformerXLPositionalEmbedding",
              lambda: pe_lib.TransformerXLPositionalEmbedding(H, Dh), learned=True),
        Entry("enformer", "EnformerPositionalEmbedding",
              lambda: pe_lib.EnformerPositionalEmbedding(H, Dh, num_features=36, length_scale=SEQ_LEN), learned=True),
        Entry("algebraic_seq", "AlgebraicSequencePositionalEmbedding",
              lambda: pe_lib.AlgebraicSequencePositionalEmbedding(Dh, H), learned=True),
        Entry("heinsen", "HeinsenPositionalEmbedding", lambda: pe_lib.HeinsenPositionalEmbedding(D, D), learned=True),
        Entry("sinusoidal_2d", "SinusoidalPositionalEmbedding",
              lambda: pe_lib.SinusoidalPositionalEmbedding(D, num_axes=2), "grid"),
        Entry("rotary_2d", "RotaryPositionalEmbedding",
              lambda: pe_lib.RotaryPositionalEmbedding(Dh, sections=[Dh // 4, Dh // 4], axis_spectrum="per_axis"), "grid"),
        Entry("algebraic_grid", "AlgebraicGridPositionalEmbedding",
              lambda: pe_lib.AlgebraicGridPositionalEmbedding(Dh, H), "grid", learned=True),
        Entry("algebraic_tree", "AlgebraicTreePositionalEmbedding",
              lambda: pe_lib.AlgebraicTreePositionalEmbedding(Dh, H, branching_factor=2, max_depth=TREE_DEPTH),
              "tree", learned=True),
    ]
    # classes that land later: one guarded line each
    if has("NoPositionalEmbedding"):
        entries.append(Entry("nope", "NoPositionalEmbedding", lambda: pe_lib.NoPositionalEmbedding()))
    if has("XPosPositionalEmbedding"):
        entries.append(Entry("xpos", "XPosPositionalEmbedding", lambda: pe_lib.XPosPositionalEmbedding(Dh, scale_base=16.0)))
    if has("QueryTemperaturePositionalEmbedding"):
        entries.append(Entry("query_temperature", "QueryTemperaturePositionalEmbedding",
                             lambda: pe_lib.QueryTemperaturePositionalEmbedding(length=4.0, scale=0.5)))
    if has("PolarPositionalEmbedding"):
        entries.append(Entry("polar", "PolarPositionalEmbedding",
                             lambda: pe_lib.PolarPositionalEmbedding(Dh, H, phase_init="uniform"), learned=True))
    if has("FoPEPositionalEmbedding"):
        entries.append(Entry("fope", "FoPEPositionalEmbedding",
                             lambda: pe_lib.FoPEPositionalEmbedding(Dh, H, train_length=SEQ_LEN)))
    if has("HoPEPositionalEmbedding"):
        entries.append(Entry("hope", "HoPEPositionalEmbedding", lambda: pe_lib.HoPEPositionalEmbedding(Dh, train_length=SEQ_LEN)))
    if has("KerplePositionalEmbedding"):
        entries.append(Entry("kerple_log", "KerplePositionalEmbedding",
                             lambda: pe_lib.KerplePositionalEmbedding(H, kernel="log"), learned=True))
        entries.append(Entry("kerple_power", "KerplePositionalEmbedding",
                             lambda: pe_lib.KerplePositionalEmbedding(H, kernel="power"), learned=True))
    if has("SandwichPositionalEmbedding"):
        entries.append(Entry("sandwich", "SandwichPositionalEmbedding", lambda: pe_lib.SandwichPositionalEmbedding(H, D)))
    if has("FIREPositionalEmbedding"):
        entries.append(Entry("fire", "FIREPositionalEmbedding", lambda: pe_lib.FIREPositionalEmbedding(H), learned=True))
    if has("CoPEPositionalEmbedding"):
        entries.append(Entry("cope", "CoPEPositionalEmbedding", lambda: pe_lib.CoPEPositionalEmbedding(H, Dh), learned=True))
    if has("ReRoPEPositionalEmbedding"):
        entries.append(Entry("rerope", "ReRoPEPositionalEmbedding", lambda: pe_lib.ReRoPEPositionalEmbedding(Dh, window=8)))
    if has("SelfExtendPositionalEmbedding"):
        entries.append(Entry("self_extend", "SelfExtendPositionalEmbedding", lambda: pe_lib.SelfExtendPositionalEmbedding(
            pe_lib.RotaryPositionalEmbedding(Dh), group_size=4, window=8)))
    if has("StickBreakingPositionalEmbedding"):
        entries.append(Entry("stick_breaking", "StickBreakingPositionalEmbedding",
                             lambda: pe_lib.StickBreakingPositionalEmbedding()))
    if has("RandomizedPositionalEmbedding"):
        entries.append(Entry("randomized_rope", "RandomizedPositionalEmbedding", lambda: pe_lib.RandomizedPositionalEmbedding(
            pe_lib.RotaryPositionalEmbedding(Dh), 4 * SEQ_LEN, generator=torch.Generator().manual_seed(0))))
    if has("DualChunkPositionalEmbedding"):
        entries.append(Entry("dual_chunk", "DualChunkPositionalEmbedding", lambda: pe_lib.DualChunkPositionalEmbedding(
            pe_lib.RotaryPositionalEmbedding(Dh), chunk_size=10, local_size=3)))
    if has("ForgettingPositionalEmbedding"):
        entries.append(Entry("forgetting", "ForgettingPositionalEmbedding",
                             lambda: pe_lib.ForgettingPositionalEmbedding(D, H), learned=True))
    if has("InklingPositionalEmbedding"):
        entries.append(Entry("inkling", "InklingPositionalEmbedding",
                             lambda: pe_lib.InklingPositionalEmbedding(D, H, d_rel=4, max_distance=16, init_std=0.5),
                             learned=True))
    if has("PaTHPositionalEmbedding"):
        entries.append(Entry("path", "PaTHPositionalEmbedding", lambda: pe_lib.PaTHPositionalEmbedding(D, H), learned=True))
    if has("ShawPositionalEmbedding"):
        entries.append(Entry("shaw", "ShawPositionalEmbedding", lambda: pe_lib.ShawPositionalEmbedding(H, Dh), learned=True))
    if has("DebertaPositionalEmbedding"):
        entries.append(Entry("deberta", "DebertaPositionalEmbedding",
                             lambda: pe_lib.DebertaPositionalEmbedding(D, H, max_relative_positions=SEQ_LEN,
                                                                       position_buckets=SEQ_LEN // 2), learned=True))
    if has("RelativePositionBias2D"):
        entries.append(Entry("relative_bias_2d", "RelativePositionBias2D",
                             lambda: pe_lib.RelativePositionBias2D(H, GRID), "grid", learned=True))
    if has("ContinuousPositionBias"):
        entries.append(Entry("continuous_bias", "ContinuousPositionBias",
                             lambda: pe_lib.ContinuousPositionBias(H, GRID), "grid", learned=True))
    if has("DynamicPositionBias"):
        entries.append(Entry("dynamic_bias", "DynamicPositionBias",
                             lambda: pe_lib.DynamicPositionBias(H, num_axes=2), "grid", learned=True))
    if has("MixedRotaryPositionalEmbedding"):
        entries.append(Entry("mixed_rotary", "MixedRotaryPositionalEmbedding",
                             lambda: pe_lib.MixedRotaryPositionalEmbedding(Dh, H, 2), "grid", learned=True))
    if has("LieREPositionalEmbedding"):
        entries.append(Entry("liere", "LieREPositionalEmbedding",
                             lambda: pe_lib.LieREPositionalEmbedding(Dh, H, 2), "grid", learned=True))
    if has("ComRoPEPositionalEmbedding"):
        entries.append(Entry("comrope", "ComRoPEPositionalEmbedding",
                             lambda: pe_lib.ComRoPEPositionalEmbedding(Dh, H, init_std=0.3), "grid", learned=True))
    if has("STRINGPositionalEmbedding"):
        entries.append(Entry("string", "STRINGPositionalEmbedding",
                             lambda: pe_lib.STRINGPositionalEmbedding(Dh, H), "grid", learned=True))
    if has("VideoRotaryPositionalEmbedding"):   # one frame of the grid, in the diagonal layout
        entries.append(Entry("video_rope", "VideoRotaryPositionalEmbedding",
                             lambda: pe_lib.VideoRotaryPositionalEmbedding(Dh), "grid"))
    if has("DiffusersCompatRotaryEmbedding"):   # ERNIE-Image's (h, w) angles, not a rotation
        entries.append(Entry("diffusers_compat_ernie_image", "DiffusersCompatRotaryEmbedding",
                             lambda: pe_lib.DiffusersCompatRotaryEmbedding(Dh, sections=[Dh // 4, Dh // 4],
                                                                           axis_spectrum="per_axis", base=256.0),
                             "grid"))
    if has("ConvolutionalPositionalEmbedding"):
        entries.append(Entry("conv_peg", "ConvolutionalPositionalEmbedding",
                             lambda: pe_lib.ConvolutionalPositionalEmbedding(D, kernel_size=3, num_axes=2), "grid",
                             learned=True))
    if has("FourierFeaturePositionalEmbedding"):
        entries.append(Entry("fourier_features", "FourierFeaturePositionalEmbedding",
                             lambda: pe_lib.FourierFeaturePositionalEmbedding(2, D), "grid", unit_coordinates=True))
    if has("LearnableFourierPositionalEmbedding"):
        entries.append(Entry("learnable_fourier", "LearnableFourierPositionalEmbedding",
                             lambda: pe_lib.LearnableFourierPositionalEmbedding(2, D, gamma=0.5), "grid",
                             learned=True, unit_coordinates=True))
    if has("LaplacianPositionalEmbedding"):
        entries.append(Entry("laplacian", "LaplacianPositionalEmbedding",
                             lambda: pe_lib.LaplacianPositionalEmbedding(D, 8).eval(), "grid", learned=True))
    if has("RandomWalkPositionalEmbedding"):
        entries.append(Entry("random_walk", "RandomWalkPositionalEmbedding",
                             lambda: pe_lib.RandomWalkPositionalEmbedding(D, 8), "grid", learned=True))
    if has("GraphormerPositionalEmbedding"):   # bound to the grid's lattice graph: the bias of hop distances
        lattice = lambda: (grid_positions().unsqueeze(1) - grid_positions().unsqueeze(0)).abs().sum(-1) == 1
        entries.append(Entry("graphormer", "GraphormerPositionalEmbedding",
                             lambda: pe_lib.GraphormerPositionalEmbedding(H).bind(lattice()), "grid", learned=True))
    if has("AbacusPositionalEmbedding"):
        entries.append(Entry("abacus", "AbacusPositionalEmbedding",
                             lambda: pe_lib.AbacusPositionalEmbedding(D, range(10), max_len=SEQ_LEN + 100).eval(),
                             learned=True))
    if has("Time2VecPositionalEmbedding"):
        entries.append(Entry("time2vec", "Time2VecPositionalEmbedding",
                             lambda: pe_lib.Time2VecPositionalEmbedding(D), learned=True))
    return {entry.name: entry for entry in entries}


GALLERY = _gallery()


def uncovered_classes() -> list:
    """Encoding classes of ``__all__`` that no gallery entry draws."""
    covered = {entry.class_name for entry in GALLERY.values()} | {"PositionalEmbedding", "EmbedPosition"}
    return [name for name in getattr(pe_lib, "__all__", [])
            if isinstance(getattr(pe_lib, name, None), type)
            and issubclass(getattr(pe_lib, name), pe_lib.PositionalEmbedding) and name not in covered]


# ---------------------------------------------------------------------------
# What to draw
# ---------------------------------------------------------------------------


@dataclass
class Picture:
    """Matrices to show (one per head shown) and how to read them."""

    images: list                  # of [rows, cols] float tensors (NaN = masked / -inf)
    labels: list                  # one caption per image
    quantity: str                 # colour bar label
    tree_values: Optional[Tensor] = None   # [nodes] values drawn on the tree
    text: Optional[str] = None    # instead of images (nothing to draw)


def grid_positions() -> Tensor:
    rows, cols = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(-1, 2)                                 # [N, 2]


def _finite(t: Tensor) -> Tensor:
    t = t.detach().double()
    return torch.where(torch.isfinite(t), t, torch.full_like(t, float("nan")))


def _cosine(codes: Tensor) -> Tensor:
    """[N, D] -> [N, N] cosine similarity (NaN where a code is zero)."""
    codes = codes.double()
    norms = codes.norm(dim=-1, keepdim=True)
    unit = codes / torch.where(norms > 0, norms, torch.full_like(norms, float("nan")))
    return unit @ unit.T


def input_codes(pe, n: int, positions: Optional[Tensor], grid_shape: Optional[tuple]) -> Tensor:
    """Position codes [N, D]: ``embed(positions)``, else what forward_input adds to x = 1."""
    default = torch.arange(n) if positions is None else positions
    if hasattr(pe, "embed"):
        return pe.embed(default).reshape(n, -1)
    x = torch.ones(1, n, getattr(pe, "dim", None) or getattr(pe, "d_emb", None) or DIM)
    try:
        out = pe.forward_input(x, positions)
    except (TypeError, ValueError):
        if grid_shape is None:
            raise
        out = pe(x, grid_shape)   # convolutional encodings take the grid's shape
    return (out - x).reshape(n, -1)


def _bind_states(pe, n: int):
    """Data-dependent encodings (the forget gate, PaTH) bound to a constant token sequence x = 1."""
    if isinstance(pe, getattr(pe_lib, "_BoundTokens", ())) or \
            isinstance(pe, getattr(pe_lib, "ForgettingPositionalEmbedding", ())):
        return pe(torch.ones(1, n, DIM))
    return pe


def attention_logits(pe, n: int, positions: Optional[Tensor]) -> Tensor:
    """``[H, N, N]`` logits (qk / logits kinds) for q = k = all-ones, or the bias (bias kinds).

    ``positions`` ``[N, A]`` reach only encodings with several position axes; one-axis window
    encodings (Swin's table) index the window's tokens, which are the grid in row-major order.
    """
    pe = _bind_states(pe, n)
    if getattr(pe, "num_axes", 1) == 1 and positions is not None and positions.dim() > 1:
        positions = None
    if pe.kind == "bias":
        return pe.attention_bias(n, n, positions, positions).reshape(-1, n, n)
    heads = getattr(pe, "num_heads", None) or NUM_HEADS   # None: a wrapper of a head-free encoding
    q = k = torch.ones(1, heads, n, HEAD_DIM)
    return pe.forward_attn(q, k, positions, positions)[0]


def picture(entry: Entry, pe) -> Picture:
    """What to show for one module (see the module docstring)."""
    with torch.no_grad():
        if entry.layout == "seq":
            n = SEQ_LEN
            if pe.kind == "input":
                codes = input_codes(pe, n, None, None)
                if not codes.abs().sum():
                    return Picture([], [], "", text="identity: adds nothing\n(attention is plain SDPA)")
                return Picture([_cosine(codes)], ["cos(code_i, code_j)"], "cosine similarity")
            values = attention_logits(pe, n, None)                                             # [H, N, N]
            what = "bias" if pe.kind == "bias" else "logit, q = k = 1"
            if pe.kind == "logits" and type(pe).attention_weights is not pe_lib.PositionalEmbedding.attention_weights:   # stick-breaking
                values, what = pe.attention_weights(values).clamp(min=1e-6).log10(), "log10 weight, q = k = 1"
            values = _finite(values)
            last = values.shape[0] - 1
            return Picture([values[0], values[last]], [f"head 0", f"head {last}"], what)
        if entry.layout == "grid":
            positions = grid_positions()
            if entry.unit_coordinates:   # NeRF-style octaves are degenerate on integers: sin(pi 2^k p) = 0
                positions = 2 * positions / torch.tensor([GRID[0] - 1, GRID[1] - 1]) - 1
            if hasattr(pe, "temporal_spacing"):   # VideoRoPE: the grid as one frame, (t, t + row, t + column) centred
                positions = pe.positions([(1, *GRID)])
            if hasattr(pe, "graph_positions"):   # graph encodings: the grid's lattice graph, node by node
                positions = pe.graph_positions((positions.unsqueeze(1) - positions.unsqueeze(0)).abs().sum(-1) == 1)
            n, centre = positions.shape[0], CENTRE[0] * GRID[1] + CENTRE[1]
            if pe.kind == "input":
                row = _cosine(input_codes(pe, n, positions, GRID))[centre]
                return Picture([row.view(GRID)], [f"centre {CENTRE} vs every token"], "cosine similarity")
            values = _finite(attention_logits(pe, n, positions))[:, centre].view(-1, *GRID)     # [H, h, w]
            last = values.shape[0] - 1
            what = "bias" if pe.kind == "bias" else "logit, q = k = 1"
            return Picture([values[0], values[last]], ["head 0", f"head {last}"], what)
        nodes = 2 ** (TREE_DEPTH + 1) - 1
        values = _finite(attention_logits(pe, nodes, torch.arange(nodes)))                     # [H, N, N]
        return Picture([values[0]], ["head 0, node i to node j"], "logit, q = k = 1", tree_values=values[0, TREE_QUERY])


def describe(entry: Entry, pe) -> str:
    kind = getattr(pe, "kind", "?")
    if entry.layout == "grid":
        return f"{kind}, {GRID[0]}x{GRID[1]} grid, centre token"
    if entry.layout == "tree":
        return f"{kind}, binary tree, from node {TREE_QUERY}"
    if kind == "input":
        return "input: cosine of codes"
    if kind == "bias":
        return "bias: head 0 | last head"
    return f"{kind}: logits, q = k = 1"


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------


def _cmap(name: str):
    import matplotlib
    return matplotlib.colormaps[name].with_extremes(bad="lightgrey")


def tree_layout(depth: int) -> list:
    """(x, y) of each breadth-first node of a complete binary tree, root on top."""
    coords = []
    for node in range(2 ** (depth + 1) - 1):
        level = int(math.log2(node + 1))
        index = node + 1 - 2 ** level
        coords.append(((index + 0.5) / 2 ** level, -level))
    return coords


def draw_tree(ax, values: Tensor, cmap) -> object:
    coords = tree_layout(TREE_DEPTH)
    for node in range(1, len(coords)):
        parent = (node - 1) // 2
        ax.plot([coords[node][0], coords[parent][0]], [coords[node][1], coords[parent][1]], color="grey", lw=0.8, zorder=1)
    xs, ys = zip(*coords)
    scatter = ax.scatter(xs, ys, c=values.tolist(), cmap=cmap, s=150, zorder=2, edgecolors="black", linewidths=0.4)
    ax.scatter([coords[TREE_QUERY][0]], [coords[TREE_QUERY][1]], s=260, facecolors="none", edgecolors="red",
               linewidths=1.6, zorder=3)
    for node, (x, y) in enumerate(coords):
        ax.text(x, y - 0.38, str(node), ha="center", va="top", fontsize=6)
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-TREE_DEPTH - 0.7, 0.5)
    ax.set_xticks([])
    ax.set_yticks([])
    return scatter


def draw_panel(ax, entry: Entry, pic: Optional[Picture], subtitle: str, error: Optional[str]) -> Optional[object]:
    """One small panel of the overview figure; returns the mappable (or None)."""
    ax.set_title(f"{entry.name}{' (init)' if entry.learned else ''}\n{subtitle}", fontsize=7)
    if error or pic is None or pic.text:
        ax.text(0.5, 0.5, error or pic.text, ha="center", va="center", fontsize=6, wrap=True,
                transform=ax.transAxes, color="firebrick" if error else "black")
        ax.set_xticks([])
        ax.set_yticks([])
        return None
    if pic.tree_values is not None:
        return draw_tree(ax, pic.tree_values, _cmap("viridis"))
    if len(pic.images) == 2:   # two heads, each on its own colour scale (no colour bar here)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
        for slot, (image, label) in enumerate(zip(pic.images, pic.labels)):
            inset = ax.inset_axes((0.52 * slot, 0.0, 0.48, 0.9))
            inset.imshow(image.numpy(), cmap=_cmap("viridis"), interpolation="nearest", aspect="auto")
            inset.set_xticks([])
            inset.set_yticks([])
            inset.text(0.5, 1.02, label, transform=inset.transAxes, ha="center", va="bottom", fontsize=6)
        return None
    mappable = ax.imshow(pic.images[0].numpy(), cmap=_cmap("viridis"), interpolation="nearest", aspect="auto")
    ax.set_xticks([])
    ax.set_yticks([])
    return mappable


def draw_class(path: pathlib.Path, entry: Entry, pe, pic: Picture) -> None:
    """The per-class figure: each image with its own colour bar (and the tree)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(pic.images) + (1 if pic.tree_values is not None else 0)
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 4.0), squeeze=False)
    axes = list(axes[0])
    if pic.tree_values is not None:
        mappable = draw_tree(axes[0], pic.tree_values, _cmap("viridis"))
        fig.colorbar(mappable, ax=axes[0], fraction=0.046, pad=0.02).set_label(pic.quantity, fontsize=8)
        axes[0].set_title(f"from node {TREE_QUERY} (red ring) to every node", fontsize=9)
        axes = axes[1:]
    for ax, image, label in zip(axes, pic.images, pic.labels):
        mappable = ax.imshow(image.numpy(), cmap=_cmap("viridis"), interpolation="nearest")
        fig.colorbar(mappable, ax=ax, fraction=0.046, pad=0.02).set_label(pic.quantity, fontsize=8)
        ax.set_title(label, fontsize=9)
        if entry.layout == "grid":
            ax.set_xlabel("column")
            ax.set_ylabel("row")
            ax.plot([CENTRE[1]], [CENTRE[0]], marker="+", color="red", markersize=9)
        else:
            ax.set_xlabel("key position j" if entry.layout == "seq" else "key node j")
            ax.set_ylabel("query position i (or code i)" if entry.layout == "seq" else "query node i")
    init = "; learned parameters at initialisation (seed 0)" if entry.learned else ""
    fig.suptitle(f"{entry.class_name} ({pe.kind}){init}\n{describe(entry, pe)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_text(path: pathlib.Path, entry: Entry, text: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 2.0))
    ax.text(0.5, 0.5, f"{entry.class_name}\n{text}", ha="center", va="center", fontsize=9, wrap=True)
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_gallery(out_dir: Optional[str] = None, only: Optional[list] = None) -> dict:
    """Draw everything; returns {name: path or error text}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = pathlib.Path(out_dir) if out_dir else REPO / "docs" / "figures"
    entries = [GALLERY[name] for name in (only or GALLERY)]
    columns = 6
    rows = math.ceil(len(entries) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.3 * columns, 2.45 * rows), squeeze=False)
    outcome = {}
    for ax, entry in zip(axes.flat, entries):
        torch.manual_seed(0)
        pic, error, pe = None, None, None
        try:
            pe = entry.build()
            pic = picture(entry, pe)
        except Exception as exc:   # one broken panel must not hide the others
            error = f"could not draw:\n{type(exc).__name__}: {str(exc)[:80]}"
            print(f"gallery.py: {entry.name}: {error}\n{traceback.format_exc()}", file=sys.stderr)
        subtitle = describe(entry, pe) if pe is not None else "?"
        mappable = draw_panel(ax, entry, pic, subtitle, error)
        if mappable is not None:
            colorbar = fig.colorbar(mappable, ax=ax, fraction=0.046, pad=0.03)
            colorbar.ax.tick_params(labelsize=5)
        path = figures / "gallery" / f"{entry.name}.png"
        if error:
            outcome[entry.name] = error
        elif pic.text:
            draw_text(path, entry, pic.text)
            outcome[entry.name] = str(path)
        else:
            draw_class(path, entry, pe, pic)
            outcome[entry.name] = str(path)
    for ax in list(axes.flat)[len(entries):]:
        ax.axis("off")
    fig.suptitle("What each encoding does to attention (untrained modules, seed 0). bias: the bias of head 0 | last "
                 "head; qk/logits: logits for q = k = all-ones at every position; input: cosine similarity of position "
                 "codes;\ngrids: centre token vs every token of an 8x8 grid; tree: node 4 vs every node. Grey: -inf "
                 "(masked). \"(init)\": learned parameters at their initialisation (the algebraic encodings start as "
                 "RoPE).\nTwo-head panels: each head on its own colour scale (values in docs/figures/gallery/<name>.png).",
                 fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / "gallery.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    outcome["gallery"] = str(path)
    return outcome


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=None, help="folder for gallery.png and gallery/ (default docs/figures)")
    parser.add_argument("--only", default=None, help=f"comma-separated, from: {', '.join(GALLERY)}")
    args = parser.parse_args(argv)
    only = None
    if args.only:
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in only if n not in GALLERY]
        if unknown:
            parser.error(f"unknown names {', '.join(unknown)}; choose from {', '.join(GALLERY)}")
    missing = uncovered_classes()
    if missing:
        print(f"gallery.py: classes of __all__ with no gallery entry: {', '.join(missing)}", file=sys.stderr)
    outcome = make_gallery(args.out_dir, only)
    for name, result in outcome.items():
        print(f"{name}: {result}")


if __name__ == "__main__":
    main()

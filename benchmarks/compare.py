"""Train one tiny transformer with each positional encoding on synthetic tasks; print a table.

Not a test and not a leaderboard: three seeds, 600 optimiser steps each, on a 2-core CPU.
It shows which encodings can learn tasks where position matters, at the trained length and
at twice that length, with the same model, data, optimiser and budget for every encoding.

The model (identical for every encoding): a token embedding (PyTorch's N(0, 1) init), 2
pre-LayerNorm blocks (d_model 64, 4 heads of dim 16, MLP 4x with GELU), a final LayerNorm and
a linear read-out at every token; AdamW (lr 3e-3, warm-up then cosine decay, no weight
decay), gradients clipped at 1. Encodings plug in through the library's interface:
``kind == "input"`` encodings run ``pe.forward_input(x, positions)`` on the token
embeddings before the first block; every other kind is passed to
``attention(q, k, v, pe, positions_q=..., positions_k=..., causal=...)`` in both blocks (one
encoding module shared by the two layers; the forget gate is bound to each block's normalised
token states). "nope" runs plain attention. Each encoding is
built as in the library's ``_demo_modules``, sized for this model, with these choices: the
learned table starts at the token embeddings' scale (``init_std=1.0``; BERT's 0.02 matches
BERT's 0.02 token table, and at 0.02 next to N(0, 1) tokens it did not learn ``reverse``);
T5, ALiBi, TUPE, KERPLE, Sandwich and FIRE are bidirectional on bidirectional tasks; xPos,
CoPE and the forget gate are causal by construction and run on the causal task only;
Enformer's basis is scaled to the longest evaluated sequence (``length_scale``) with 36
features. On the grid, Swin's table and Swin-v2's continuous bias cover a window the size of
the long grid (6 x 12) and read each cell's token index in it; the convolution (CPVT's PEG)
takes the grid shape; the other grid encodings take ``(row, column)`` positions.

Tasks (inputs drawn from a seeded ``torch.Generator``; every encoding sees the same batches):

* ``reverse`` (sequence, bidirectional): ``[BOS] x_0 .. x_{L-1} [EOS]``, 16 symbols; at the
  token of ``x_i`` predict ``x_{L-1-i}``. Train L = 16, evaluate at L and 2L = 32.
* ``recall`` (sequence, causal): multi-query associative recall. ``n`` key-value pairs
  ``k_1 v_1 .. k_n v_n`` (distinct keys out of 32, values out of 16), then the ``n`` keys
  again in a random order; at each query predict its value. Train n = 8 (24 tokens),
  evaluate at n = 8 and n = 16 (48 tokens).
* ``grid`` (2-D, bidirectional): an H x W grid of 16 symbols, flattened row-major; at each
  cell predict the symbol of the cell above it (the first row is not scored). Train
  6 x 6 (36 tokens), evaluate at 6 x 6 and 6 x 12 (72 tokens: twice as wide, so the cell
  above is 12 tokens back in the flattening instead of 6). Grid encodings get ``[N, 2]``
  (row, column) positions; 1-D encodings see the row-major flattening.
* ``tree`` (bidirectional): a complete binary tree of depth D with random labels, flattened
  breadth-first; at each node predict its parent's label (the root is not scored).
  Train D = 4 (31 nodes), evaluate at D = 4 and D = 5 (63 nodes). The tree encoding gets
  breadth-first node ids; sequence encodings see the breadth-first order.

Accuracy is over the predicted tokens of held-out samples (drawn from a second generator).
Learned tables (``learned``, TUPE) are sized for the long evaluation, so their rows past the
training length exist but were never trained; the notes column says so.

Run it from the repository root:

    python benchmarks/compare.py                      # everything, 3 seeds: about an hour on 2 idle cores
    python benchmarks/compare.py --quick              # 5 encodings, 1 seed, 200 steps: about 1.5 minutes
    python benchmarks/compare.py --markdown --csv benchmarks/results/compare.csv   # the docs table
    python benchmarks/compare.py --tasks reverse,tree --encodings rotary,nope --steps 300 --seeds 1
    python benchmarks/compare.py --quick --steps 2 --eval-batches 1   # smoke test (seconds)

Progress goes to stderr, the table (mean over seeds, with the range) and a legend to stdout;
``--csv`` also writes every seed's row. Results are deterministic given the seed (and the
thread count); wall times are not. The script sets
``OMP_WAIT_POLICY=PASSIVE`` (unless already set) so that another process on the machine
slows it down proportionally instead of 30x.
"""

import argparse
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

# OpenMP threads that spin while waiting make every step of this small model 3x to 30x slower
# as soon as another process holds one of the 2 cores; sleeping waiters cost ~10% on an idle
# machine. Must be set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import positional_embeddings as pe_lib  # noqa: E402

Tensor = torch.Tensor

D_MODEL, NUM_HEADS, NUM_LAYERS, MLP_RATIO = 64, 4, 2, 4
HEAD_DIM = D_MODEL // NUM_HEADS
IGNORE = -100  # target of tokens that are not predicted


# ---------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A synthetic task: how to sample it at a size, and where its tokens sit.

    ``sample(size, batch, generator)`` returns ``(tokens [B, N], targets [B, N])`` with
    ``IGNORE`` where nothing is predicted. ``grid_positions`` / ``node_ids`` give the
    multi-axis positions ``[N, 2]`` / tree node ids ``[N]`` of a size (None if not applicable).
    """

    name: str
    kind: str                     # "sequence", "grid" or "tree": which encodings apply
    causal: bool
    vocab: int                    # input and output classes
    train_size: object
    long_size: object
    sample: Callable
    num_tokens: Callable          # size -> N
    measures: str
    chance: float
    grid_positions: Optional[Callable] = None
    node_ids: Optional[Callable] = None
    size_label: Callable = str    # size -> text for the legend


SYMBOLS = 16  # payload alphabet of every task


def sample_reverse(length: int, batch: int, generator: torch.Generator) -> tuple:
    """[BOS] x [EOS] -> reversed x at the positions of x: two [B, L + 2]."""
    bos, eos = SYMBOLS, SYMBOLS + 1
    symbols = torch.randint(SYMBOLS, (batch, length), generator=generator)              # [B, L]
    tokens = torch.cat([torch.full((batch, 1), bos), symbols, torch.full((batch, 1), eos)], dim=1)
    targets = torch.full_like(tokens, IGNORE)                                            # [B, L + 2]
    targets[:, 1:-1] = symbols.flip(-1)
    return tokens, targets


RECALL_KEYS, RECALL_VALUES = 32, 16


def sample_recall(pairs: int, batch: int, generator: torch.Generator) -> tuple:
    """k_1 v_1 .. k_n v_n q_1 .. q_n -> the value of each query q_j: two [B, 3n]."""
    keys = torch.rand(batch, RECALL_KEYS, generator=generator).argsort(-1)[:, :pairs]    # [B, n] distinct
    values = torch.randint(RECALL_KEYS, RECALL_KEYS + RECALL_VALUES, (batch, pairs), generator=generator)
    order = torch.rand(batch, pairs, generator=generator).argsort(-1)                    # [B, n]
    queries, answers = keys.gather(1, order), values.gather(1, order)                    # [B, n] each
    context = torch.stack([keys, values], dim=-1).flatten(1)                             # [B, 2n]
    tokens = torch.cat([context, queries], dim=1)                                        # [B, 3n]
    targets = torch.cat([torch.full_like(context, IGNORE), answers], dim=1)              # [B, 3n]
    return tokens, targets


def sample_grid(shape: tuple, batch: int, generator: torch.Generator) -> tuple:
    """An H x W grid -> the symbol of the cell above each cell (row 0 not scored): two [B, H * W]."""
    height, width = shape
    symbols = torch.randint(SYMBOLS, (batch, height, width), generator=generator)        # [B, H, W]
    targets = torch.full_like(symbols, IGNORE)
    targets[:, 1:] = symbols[:, :-1]
    return symbols.flatten(1), targets.flatten(1)                                        # [B, H * W] each


def grid_positions(shape: tuple) -> Tensor:
    """(row, column) of each cell in row-major order: [H * W, 2]."""
    rows, cols = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(-1, 2)


def tree_size(depth: int) -> int:
    return 2 ** (depth + 1) - 1


def sample_tree(depth: int, batch: int, generator: torch.Generator) -> tuple:
    """Labels of a complete binary tree in breadth-first order -> each node's parent label (the
    root is not scored): two [B, N]."""
    labels = torch.randint(SYMBOLS, (batch, tree_size(depth)), generator=generator)      # [B, N]
    parents = (torch.arange(1, labels.shape[1]) - 1) // 2                                # [N - 1]
    targets = torch.full_like(labels, IGNORE)
    targets[:, 1:] = labels[:, parents]
    return labels, targets


TASKS = {
    "reverse": Task(
        "reverse", "sequence", causal=False, vocab=SYMBOLS + 2, train_size=16, long_size=32,
        sample=sample_reverse, num_tokens=lambda n: n + 2, chance=1 / SYMBOLS,
        measures="absolute position relative to both ends (bidirectional)",
        size_label=lambda n: f"{n} symbols ({n + 2} tokens)"),
    "recall": Task(
        "recall", "sequence", causal=True, vocab=RECALL_KEYS + RECALL_VALUES, train_size=8, long_size=16,
        sample=sample_recall, num_tokens=lambda n: 3 * n, chance=1 / RECALL_VALUES,
        measures="binding each value to the key just before it, then content lookup (causal)",
        size_label=lambda n: f"{n} pairs ({3 * n} tokens)"),
    "grid": Task(
        "grid", "grid", causal=False, vocab=SYMBOLS, train_size=(6, 6), long_size=(6, 12),
        sample=sample_grid, num_tokens=lambda s: s[0] * s[1], chance=1 / SYMBOLS,
        measures="a fixed 2-D offset (one row up), on a wider grid at 2L (bidirectional)",
        grid_positions=grid_positions, size_label=lambda s: f"{s[0]}x{s[1]} ({s[0] * s[1]} tokens)"),
    "tree": Task(
        "tree", "tree", causal=False, vocab=SYMBOLS, train_size=4, long_size=5,
        sample=sample_tree, num_tokens=tree_size, chance=1 / SYMBOLS,
        measures="the parent relation in a tree, one level deeper at 2L (bidirectional)",
        node_ids=lambda depth: torch.arange(tree_size(depth)),
        size_label=lambda d: f"depth {d} ({tree_size(d)} nodes)"),
}
TASK_KINDS = {"sequence": ["reverse", "recall"], "grid": ["grid"], "tree": ["tree"]}


# ---------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoding:
    """How to build one encoding for a task and which positions it reads.

    ``axes``: "flat" (default positions: the sequence, row-major or breadth-first order),
    "grid" (``[N, 2]`` row and column), "window" (token indices into a window the size of
    the long grid, as Swin's tables take them), "grid_shape" (the ``(H, W)`` tuple a
    convolution over the token grid takes) or "tree" (breadth-first node ids).
    ``causal_only``: the encoding is causal by construction (runs on causal tasks only).
    """

    name: str
    build: Callable               # Task -> PositionalEmbedding or None
    axes: str = "flat"
    causal_only: bool = False


def _max_tokens(task: Task) -> int:
    return task.num_tokens(task.long_size)


ENCODINGS = {e.name: e for e in [
    Encoding("nope", lambda task: pe_lib.NoPositionalEmbedding()),
    Encoding("sinusoidal", lambda task: pe_lib.SinusoidalPositionalEmbedding(D_MODEL)),
    # init at the token embeddings' scale, N(0, 1): BERT's 0.02 is the scale of BERT's token table
    Encoding("learned", lambda task: pe_lib.LearnedPositionalEmbedding(_max_tokens(task), D_MODEL, init_std=1.0)),
    Encoding("rotary", lambda task: pe_lib.RotaryPositionalEmbedding(HEAD_DIM)),
    Encoding("t5", lambda task: pe_lib.T5PositionalEmbedding(NUM_HEADS, bidirectional=not task.causal)),
    Encoding("alibi", lambda task: pe_lib.ALiBiPositionalEmbedding(NUM_HEADS, bidirectional=not task.causal)),
    Encoding("tupe", lambda task: pe_lib.UnifiedPositionalEmbedding(
        _max_tokens(task), NUM_HEADS, HEAD_DIM, bidirectional=not task.causal)),
    Encoding("transformer_xl", lambda task: pe_lib.TransformerXLPositionalEmbedding(NUM_HEADS, HEAD_DIM)),
    # basis scaled to the longest evaluated sequence; 36 features = 6 of each of the 6 families
    Encoding("enformer", lambda task: pe_lib.EnformerPositionalEmbedding(
        NUM_HEADS, HEAD_DIM, num_features=36, length_scale=_max_tokens(task))),
    Encoding("algebraic_seq", lambda task: pe_lib.AlgebraicSequencePositionalEmbedding(HEAD_DIM, NUM_HEADS)),
    Encoding("heinsen", lambda task: pe_lib.HeinsenPositionalEmbedding(D_MODEL, D_MODEL)),
    Encoding("xpos", lambda task: pe_lib.XPosPositionalEmbedding(HEAD_DIM), causal_only=True),
    Encoding("kerple_log", lambda task: pe_lib.KerplePositionalEmbedding(
        NUM_HEADS, kernel="log", bidirectional=not task.causal)),
    Encoding("kerple_power", lambda task: pe_lib.KerplePositionalEmbedding(
        NUM_HEADS, kernel="power", bidirectional=not task.causal)),
    Encoding("sandwich", lambda task: pe_lib.SandwichPositionalEmbedding(
        NUM_HEADS, D_MODEL, bidirectional=not task.causal)),
    Encoding("fire", lambda task: pe_lib.FIREPositionalEmbedding(NUM_HEADS, bidirectional=not task.causal)),
    Encoding("cope", lambda task: pe_lib.CoPEPositionalEmbedding(NUM_HEADS, HEAD_DIM), causal_only=True),
    Encoding("forgetting", lambda task: pe_lib.ForgettingPositionalEmbedding(D_MODEL, NUM_HEADS), causal_only=True),
    Encoding("shaw", lambda task: pe_lib.ShawPositionalEmbedding(NUM_HEADS, HEAD_DIM)),
    Encoding("deberta", lambda task: pe_lib.DebertaPositionalEmbedding(D_MODEL, NUM_HEADS)),
    Encoding("sinusoidal_2d", lambda task: pe_lib.SinusoidalPositionalEmbedding(D_MODEL, num_axes=2), "grid"),
    Encoding("rotary_2d", lambda task: pe_lib.RotaryPositionalEmbedding(
        HEAD_DIM, sections=[HEAD_DIM // 4, HEAD_DIM // 4], axis_spectrum="per_axis"), "grid"),
    Encoding("algebraic_grid", lambda task: pe_lib.AlgebraicGridPositionalEmbedding(HEAD_DIM, NUM_HEADS), "grid"),
    Encoding("swin_bias", lambda task: pe_lib.RelativePositionBias2D(NUM_HEADS, task.long_size), "window"),
    Encoding("swinv2_cpb", lambda task: pe_lib.ContinuousPositionBias(NUM_HEADS, task.long_size), "window"),
    Encoding("dynamic_bias_2d", lambda task: pe_lib.DynamicPositionBias(NUM_HEADS, num_axes=2), "grid"),
    Encoding("mixed_rope", lambda task: pe_lib.MixedRotaryPositionalEmbedding(HEAD_DIM, NUM_HEADS), "grid"),
    Encoding("liere", lambda task: pe_lib.LieREPositionalEmbedding(HEAD_DIM, NUM_HEADS), "grid"),
    Encoding("conv_peg", lambda task: pe_lib.ConvolutionalPositionalEmbedding(D_MODEL), "grid_shape"),
    # Gaussian Fourier features of the integer (row, column): frequencies ~ N(0, 0.1^2) cycles per cell
    Encoding("fourier_2d", lambda task: pe_lib.FourierFeaturePositionalEmbedding(
        2, D_MODEL, sampling="gaussian", scale=0.1), "grid"),
    Encoding("algebraic_tree", lambda task: pe_lib.AlgebraicTreePositionalEmbedding(
        HEAD_DIM, NUM_HEADS, branching_factor=2, max_depth=task.long_size), "tree"),
]}

# which encodings run on each task kind, in table order (causal_only ones on causal tasks only)
SEQUENCE_ENCODINGS = ["sinusoidal", "learned", "rotary", "t5", "alibi", "tupe", "transformer_xl", "enformer",
                      "algebraic_seq", "heinsen", "xpos", "kerple_log", "kerple_power", "sandwich", "fire",
                      "cope", "forgetting", "shaw", "deberta", "nope"]
KIND_ENCODINGS = {
    "sequence": SEQUENCE_ENCODINGS,
    "grid": ["sinusoidal_2d", "rotary_2d", "algebraic_grid", "swin_bias", "swinv2_cpb", "dynamic_bias_2d",
             "mixed_rope", "liere", "conv_peg", "fourier_2d", "sinusoidal", "rotary", "nope"],
    "tree": ["algebraic_tree", "rotary", "learned", "nope"],
}
QUICK_ENCODINGS = ["rotary", "rotary_2d", "algebraic_grid", "algebraic_tree", "nope"]


def applies(encoding: Encoding, task: Task) -> bool:
    return task.causal or not encoding.causal_only


def positions_for(encoding: Encoding, task: Task, size):
    """What an encoding is given at a size: None (default arange), [N, 2], window token
    indices [N], the grid shape (H, W) or tree node ids [N]."""
    if encoding.axes == "grid":
        return task.grid_positions(size)
    if encoding.axes == "window":
        rows_cols = task.grid_positions(size)                                            # [N, 2]
        return rows_cols[:, 0] * task.long_size[1] + rows_cols[:, 1]
    if encoding.axes == "grid_shape":
        return tuple(size)
    if encoding.axes == "tree":
        return task.node_ids(size)
    return None


def notes_for(encoding: Encoding, task: Task) -> str:
    """What makes a row structurally different from the others (empty if nothing)."""
    notes = []
    if encoding.axes == "flat" and task.kind != "sequence" and encoding.name != "nope":
        notes.append("1-D over the " + ("row-major" if task.kind == "grid" else "breadth-first") + " order")
    if encoding.name in ("learned", "tupe"):
        notes.append(f"table of {_max_tokens(task)}; rows >= {task.num_tokens(task.train_size)} never trained")
    if encoding.name in ("alibi", "kerple_log", "kerple_power", "sandwich", "fire") and not task.causal:
        notes.append("bidirectional: symmetric in i - j, no left/right")
    if encoding.name == "t5":
        notes.append("logits scaled by 1/sqrt(Dh) (T5 uses 1)")
    if encoding.name == "enformer":
        notes.append(f"length_scale {_max_tokens(task)}, 36 features")
    if encoding.name == "heinsen":
        notes.append("order from a left-to-right recurrence")
    if encoding.name == "forgetting":
        notes.append("gate reads each block's normalised token states")
    if encoding.name == "shaw":
        notes.append("distances clipped at 16")
    if encoding.axes == "window":
        height, width = task.long_size
        notes.append(f"window {height}x{width}; column offsets >= {task.train_size[1]} never trained")
    return "; ".join(notes)


def add_input_encoding(pe, x: Tensor, positions) -> Tensor:
    """An "input" encoding on the token embeddings: the convolution takes the grid shape."""
    if isinstance(positions, tuple):
        return pe(x, positions)
    return pe.forward_input(x, positions)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP_RATIO * D_MODEL), nn.GELU(),
                                 nn.Linear(MLP_RATIO * D_MODEL, D_MODEL))

    def forward(self, x: Tensor, pe: Optional[pe_lib.PositionalEmbedding], positions, causal: bool) -> Tensor:
        batch, n, _ = x.shape
        h = self.ln_attn(x)                                                              # [B, N, D]
        qkv = self.qkv(h).view(batch, n, 3, NUM_HEADS, HEAD_DIM)                         # [B, N, 3, H, Dh]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                                    # [B, H, N, Dh] each
        if isinstance(pe, pe_lib.ForgettingPositionalEmbedding):   # the gate reads this block's states
            pe = pe(h)
        y = pe_lib.attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=causal)
        x = x + self.out(y.transpose(1, 2).reshape(batch, n, D_MODEL))                   # [B, N, D]
        return x + self.mlp(self.ln_mlp(x))


class TinyTransformer(nn.Module):
    """Token embedding -> (input encoding) -> 2 blocks sharing one attention-side encoding -> logits."""

    def __init__(self, vocab: int, causal: bool, make_pe: Callable) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.ln_final = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab)
        self.causal = causal
        self.pe = make_pe()   # built after the trunk: with one seed, every encoding gets the same trunk

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """tokens [B, N] -> logits [B, N, vocab]."""
        x = self.embed(tokens)                                                           # [B, N, D]
        attn_pe, attn_positions = self.pe, positions
        if self.pe is not None and self.pe.kind == "input":   # added to the tokens once, not in attention
            x, attn_pe, attn_positions = add_input_encoding(self.pe, x, positions), None, None
        for block in self.blocks:
            x = block(x, attn_pe, attn_positions, self.causal)
        return self.head(self.ln_final(x))                                               # [B, N, vocab]


# ---------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Training and evaluation budget of every run."""

    steps: int
    batch_size: int
    eval_batches: int
    lr: float


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    encoding: str
    task: str
    acc_train_len: float
    acc_long: Optional[float]
    params: int
    seconds: float
    seed: int
    notes: str


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def masked_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy over the predicted tokens: logits [B, N, V], targets [B, N]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def train(model: TinyTransformer, task: Task, positions: Optional[Tensor], budget: Budget, seed: int) -> None:
    """AdamW on fresh batches of the training size; the batch stream depends only on the seed."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=budget.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    for step in range(budget.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, budget.steps, budget.lr)
        tokens, targets = task.sample(task.train_size, budget.batch_size, generator)
        loss = masked_loss(model(tokens, positions), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


@torch.no_grad()
def accuracy(model: TinyTransformer, task: Task, size, positions: Optional[Tensor], budget: Budget,
             seed: int) -> float:
    """Fraction of predicted tokens right, over ``eval_batches`` held-out batches of ``size``."""
    generator = torch.Generator().manual_seed(seed + 1_000_003)   # a different stream from training's
    model.eval()
    right = total = 0
    for _ in range(budget.eval_batches):
        tokens, targets = task.sample(size, budget.batch_size, generator)
        predicted = model(tokens, positions).argmax(-1)                                  # [B, N]
        scored = targets != IGNORE
        right += (predicted[scored] == targets[scored]).sum().item()
        total += scored.sum().item()
    return right / total


def run(task: Task, encoding: Encoding, budget: Budget, seed: int) -> Row:
    """Build, train and evaluate one (task, encoding) pair."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = TinyTransformer(task.vocab, task.causal, lambda: encoding.build(task))
    params = sum(p.numel() for p in model.pe.parameters()) if model.pe is not None else 0
    train(model, task, positions_for(encoding, task, task.train_size), budget, seed)
    acc_train_len = accuracy(model, task, task.train_size, positions_for(encoding, task, task.train_size), budget, seed)
    acc_long = None
    if task.long_size is not None:
        acc_long = accuracy(model, task, task.long_size, positions_for(encoding, task, task.long_size), budget, seed)
    return Row(encoding.name, task.name, acc_train_len, acc_long, params, time.perf_counter() - start, seed,
               notes_for(encoding, task))


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """The rows of one (task, encoding) pair over its seeds."""

    rows: list

    def spread(self, values: list) -> str:
        """Mean, and the range over seeds when there is more than one: 0.912 (0.85-0.97)."""
        mean = sum(values) / len(values)
        return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ({min(values):.2f}-{max(values):.2f})"

    def cells(self) -> list:
        first = self.rows[0]
        at_l = self.spread([row.acc_train_len for row in self.rows])
        at_2l = "-" if first.acc_long is None else self.spread([row.acc_long for row in self.rows])
        seconds = sum(row.seconds for row in self.rows) / len(self.rows)
        return [first.encoding, first.task, at_l, at_2l, str(first.params), f"{seconds:.1f}",
                ",".join(str(row.seed) for row in self.rows), first.notes]


COLUMNS = ["encoding", "task", "acc@L", "acc@2L", "params", "s/seed", "seeds", "notes"]


def format_table(summaries: list, markdown: bool) -> str:
    cells = [COLUMNS] + [summary.cells() for summary in summaries]
    if markdown:
        lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in cells]
        lines.insert(1, "|" + "|".join("---" if i in (0, 1, 6, 7) else "---:" for i in range(len(COLUMNS))) + "|")
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    right = {2, 3, 4, 5}
    fmt = lambda line: "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))).rstrip()
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(line) for line in cells[1:]])


def write_csv(path: str, rows: list) -> None:
    """One line per (task, encoding, seed)."""
    import csv
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "encoding", "seed", "acc_at_L", "acc_at_2L", "params", "seconds", "notes"])
        for row in rows:
            long = "" if row.acc_long is None else f"{row.acc_long:.4f}"
            writer.writerow([row.task, row.encoding, row.seed, f"{row.acc_train_len:.4f}", long, row.params,
                             f"{row.seconds:.1f}", row.notes])


def legend(tasks: list, budget: Budget, seeds: list) -> str:
    lines = [f"Model: {NUM_LAYERS} pre-LN layers, d_model {D_MODEL}, {NUM_HEADS} heads, MLP {MLP_RATIO}x; "
             f"{budget.steps} AdamW steps of batch {budget.batch_size}; accuracy over "
             f"{budget.eval_batches} x {budget.batch_size} held-out samples. params: of the encoding module only."]
    for task in tasks:
        lines.append(f"- {task.name}: {task.measures}. L = {task.size_label(task.train_size)}, "
                     f"2L = {task.size_label(task.long_size)}; chance {task.chance:.3f}.")
    lines.append(f"Accuracies are the mean over seeds {', '.join(map(str, seeds))}"
                 + (" with the (min-max) range over seeds." if len(seeds) > 1 else ".")
                 + " xPos, CoPE and the forget gate are causal by construction: they run on the causal task only.")
    return "\n".join(lines)


def header(argv: list) -> str:
    deterministic = torch.are_deterministic_algorithms_enabled()
    return "\n".join([
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"deterministic algorithms: {deterministic}",
        "command: " + " ".join(shlex.quote(a) for a in ["python", *argv]),
    ])


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer steps, one seed and only {', '.join(QUICK_ENCODINGS)} (every task kind still runs)")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per run (default 600, quick 200)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick 0)")
    parser.add_argument("--tasks", default=None,
                        help=f"comma-separated tasks or kinds: {', '.join([*TASKS, *TASK_KINDS])} (default: all)")
    parser.add_argument("--encodings", default=None,
                        help=f"comma-separated encodings: {', '.join(ENCODINGS)} (default: all that apply)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--csv", default=None, help="also write one line per (task, encoding, seed) to this file")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 200 if args.quick else 600
    if args.seeds is None:
        args.seeds = "0" if args.quick else "0,1,2"
    try:
        args.seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        raise SystemExit(f"compare.py: --seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        raise SystemExit("compare.py: --seeds names no seed")
    return args


def split_names(text: Optional[str], known: dict, what: str) -> Optional[list]:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"compare.py: unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def selected_tasks(args: argparse.Namespace) -> list:
    names = split_names(args.tasks, {**TASKS, **TASK_KINDS}, "task")
    if names is None:
        return list(TASKS.values())
    chosen = [task for name in names for task in (TASK_KINDS.get(name) or [name])]
    return [TASKS[name] for name in TASKS if name in chosen]


def selected_pairs(args: argparse.Namespace) -> list:
    """(task, encoding) pairs to run, in table order."""
    wanted = split_names(args.encodings, ENCODINGS, "encoding")
    if wanted is None and args.quick:
        wanted = QUICK_ENCODINGS
    return [(task, ENCODINGS[name]) for task in selected_tasks(args) for name in KIND_ENCODINGS[task.kind]
            if (wanted is None or name in wanted) and applies(ENCODINGS[name], task)]


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    budget = Budget(args.steps, args.batch_size, args.eval_batches, args.lr)
    pairs = selected_pairs(args)
    if not pairs:
        raise SystemExit("compare.py: no encoding of --encodings applies to the tasks of --tasks")
    print(header([sys.argv[0], *argv]), flush=True)
    summaries, start, runs = [], time.perf_counter(), len(pairs) * len(args.seeds)
    for index, (task, encoding) in enumerate(pairs):
        rows = []
        for number, seed in enumerate(args.seeds, 1):
            row = run(task, encoding, budget, seed)
            rows.append(row)
            long = "-" if row.acc_long is None else f"{row.acc_long:.3f}"
            print(f"[{index * len(args.seeds) + number}/{runs}] {task.name} / {encoding.name} / seed {seed}: "
                  f"acc@L {row.acc_train_len:.3f}, acc@2L {long} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)
            if args.csv:  # after every run: a long run that stops keeps what it measured
                write_csv(args.csv, [row for summary in summaries for row in summary.rows] + rows)
        summaries.append(Summary(rows))
    print()
    print(format_table(summaries, args.markdown))
    print()
    print(legend([task for task in TASKS.values() if any(t is task for t, _ in pairs)], budget, args.seeds))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

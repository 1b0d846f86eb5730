"""Length extrapolation of every 1-D encoding: a byte-level language model on Python source.

Trains the same small causal transformer once per (encoding, seed) at a context of ``L``
bytes and measures bits per byte at ``L, 2L, 4L, 8L, 16L``, writing a CSV, PNG figures and
a Markdown table. Only the encoding changes between runs; model, data, optimiser, budget and
the order of training batches are shared.

The corpus: the Python standard library's own source, present on every machine with no
download. Rule: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by
relative POSIX path, skipping any file under a directory named ``test``, ``tests``,
``idle_test``, ``site-packages``, ``dist-packages`` or ``__pycache__`` and the
machine-generated ``_sysconfigdata*.py``. A file goes to validation when
``zlib.crc32(relative_path) % 10 == 0`` (about 10% of the files, a split by file that does
not move when other files are added or removed), else to training. Each split is the
concatenation of its files' bytes in sorted order. The exact byte counts depend on the
Python version; the script prints them and a SHA-256 prefix of each split. With CPython 3.11.7
that is 733 files: 658 for training (10,913,891 bytes), 75 for validation (1,167,907 bytes).

The model (identical for every encoding, see ``TinyLM``): byte embedding (256 symbols,
N(0, 1) init), 2 pre-LayerNorm blocks (d_model 64, 4 heads of dim 16, MLP 4x with GELU), a
final LayerNorm and a linear read-out of the next byte. AdamW (lr 3e-3, betas 0.9/0.98, no
weight decay), linear warm-up over 10% of the steps then cosine decay to 10% of the peak,
gradients clipped at 1. Training batches are random windows of ``L + 1`` bytes of the
training split drawn from a ``torch.Generator`` seeded by the seed, so every encoding sees
the same batches for a seed; the trunk is initialised before the encoding, so every
encoding also starts from the same trunk for a seed.

Encodings plug in through the library's interface: ``kind == "input"`` runs
``pe.forward_input(x)`` on the byte embeddings before the first block; every other kind goes
to ``attention(q, k, v, pe, causal=True)`` in both blocks (one module shared by the two
layers); the forget gate is bound to each block's normalised token states. Encodings are
listed in ``ENCODINGS`` (a name -> factory registry). Every run reports which 1-D classes of ``positional_embeddings.__all__`` no entry covers.

Choices that matter for extrapolation (the ``notes`` column repeats them):

* ``learned`` and ``tupe`` hold a table of ``16L`` rows; rows ``>= L`` are never trained
  (they keep their initial values), so beyond ``L`` those models read random position
  vectors. That is what extending such a model naively does; "cannot extrapolate" is the
  expected reading, and the curve measures how badly.
* ``t5`` (causal buckets, 32 buckets, max distance 128): buckets of distances ``>= L`` are
  never trained and stay at their initial values.
* ``enformer``: basis scaled to the training length (``length_scale = L``), 36 features;
  the model never learns about the evaluation lengths.
* ``nope`` is plain causal attention (``NoPositionalEmbedding``).
* ``heinsen`` encodes order by a recurrence, which runs at any length.

Evaluation: ``--eval-segments`` segments of ``16L + 1`` bytes at evenly spaced offsets of the
validation split. At length ``n`` each segment is cut into ``16L / n`` non-overlapping
windows of ``n`` inputs (and their ``n`` next bytes), so every length scores exactly the
same bytes; only the context each byte sees changes. ``bpb`` is the mean over all scored
bytes (each window restarts its context, as in Press et al.'s non-overlapping evaluation);
``bpb_beyond_L`` only scores bytes at window positions ``>= L`` (empty at ``n = L``), the
positions that never occur in training. Windows are evaluated in chunks of at most
``--eval-chunk-tokens`` tokens (at least one window), so ``16L`` stays memory-safe for the
kinds that materialise ``[B, H, N, N]`` logits. Uniform guessing is 8 bits per byte.

Run it from the repository root:

    python benchmarks/extrapolation.py                 # full: every encoding x 3 seeds, L = 64, 1500 steps
    python benchmarks/extrapolation.py --estimate      # time a few steps of each encoding, print the full-run estimate
    python benchmarks/extrapolation.py --quick         # 4 encodings, 1 seed, L = 16, 100 steps: about 10 s (to SCRATCH)

The full run was sized to about an hour on 2 idle cores for the 20 encodings of the second
round (measured per-step times, see docs/extrapolation.md); every full run first prints its
own estimate for the machine it runs on (about 15 s of probing), so adjust ``--steps`` there
(with ``--write-results`` if that run is to replace the committed study):
    python benchmarks/extrapolation.py --encodings rotary,alibi,nope --seeds 0 --steps 300

On a machine shared with other work, one process per seed (``--seeds 1 --threads 1
--out-dir DIR1``, ...) uses the cores better than one process with two threads on this
small model; ``--merge DIR0,DIR1,DIR2`` then combines their CSVs into the usual outputs,
figures and tables without training anything.

Outputs: ``extrapolation.csv`` (one row per encoding x seed x length),
``extrapolation_positions.csv`` (bits per byte by position inside the ``16L`` windows),
``extrapolation.png``, ``extrapolation_position.png`` and ``extrapolation_cost.png``. Where
they go:

* the full study (no option that changes what is trained or measured) and ``--merge``
  replace the committed ``benchmarks/results/*.csv`` and ``docs/figures/*.png``;
* every other run (``--quick``, a subset of encodings or seeds, other sizes) writes into
  ``<tempdir>/positional_embeddings_extrapolation/`` (``SCRATCH``), so trying the script never
  overwrites the published study; ``--write-results`` sends such a run to the committed
  files on purpose;
* ``--out-dir DIR`` puts all five files in ``DIR``.

The last line of the output names the files written. Progress goes to stderr; the Markdown
table goes to stdout. matplotlib is needed for the figures only (the CSV and table are
written without it).
"""

import argparse
import csv
import hashlib
import math
import os
import pathlib
import platform
import shlex
import statistics
import sys
import sysconfig
import tempfile
import time
import zlib
from dataclasses import dataclass, fields
from typing import Callable, Optional

# Sleeping OpenMP waiters: on a shared 2-core machine spinning ones make each step 3x-30x
# slower. Must be set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import positional_embeddings as pe_lib  # noqa: E402

Tensor = torch.Tensor

D_MODEL, NUM_HEADS, NUM_LAYERS, MLP_RATIO = 64, 4, 2, 4
HEAD_DIM = D_MODEL // NUM_HEADS
VOCAB = 256
LENGTH_FACTORS = (1, 2, 4, 8, 16)
UNIFORM_BPB = 8.0


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
VALIDATION_MODULUS = 10


@dataclass(frozen=True)
class Corpus:
    train: Tensor                 # [T] int64 bytes
    valid: Tensor                 # [V] int64 bytes
    root: str
    train_files: int
    valid_files: int
    train_sha: str
    valid_sha: str


def corpus_files(root: pathlib.Path) -> list:
    """The corpus rule: sorted ``*.py`` under the stdlib, no test or site-packages dirs."""
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS & set(relative.parts[:-1]) or relative.name.startswith("_sysconfigdata"):
            continue
        if path.is_file():
            files.append(relative.as_posix())
    return sorted(files)


def is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VALIDATION_MODULUS == 0


def load_corpus(root: Optional[str] = None) -> Corpus:
    root_path = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    parts = {True: [], False: []}
    for relative in corpus_files(root_path):
        parts[is_validation(relative)].append((root_path / relative).read_bytes())
    train, valid = b"".join(parts[False]), b"".join(parts[True])
    if not train or not valid:
        raise SystemExit(f"extrapolation.py: no Python sources found under {root_path}")
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    sha = lambda data: hashlib.sha256(data).hexdigest()[:12]
    return Corpus(as_tensor(train), as_tensor(valid), str(root_path), len(parts[False]), len(parts[True]),
                  sha(train), sha(valid))


# ---------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoding:
    """One registry entry: ``build(train_len, max_len)`` returns a module (or None)."""

    name: str
    class_name: str               # the library class it exercises ("" for none)
    build: Callable
    note: str = ""


def _registry() -> dict:
    """Every 1-D encoding of the library, by short name, in table order."""
    entries = [
        Encoding("nope", "NoPositionalEmbedding", lambda L, M: pe_lib.NoPositionalEmbedding(),
                 "no position information: plain causal attention"),
        Encoding("sinusoidal", "SinusoidalPositionalEmbedding",
                 lambda L, M: pe_lib.SinusoidalPositionalEmbedding(D_MODEL)),
        # init at the byte embeddings' scale, N(0, 1), as benchmarks/compare.py does
        Encoding("learned", "LearnedPositionalEmbedding",
                 lambda L, M: pe_lib.LearnedPositionalEmbedding(M, D_MODEL, init_std=1.0),
                 "table of 16L rows; rows >= L never trained"),
        Encoding("rotary", "RotaryPositionalEmbedding", lambda L, M: pe_lib.RotaryPositionalEmbedding(HEAD_DIM)),
        Encoding("t5", "T5PositionalEmbedding",
                 lambda L, M: pe_lib.T5PositionalEmbedding(NUM_HEADS, bidirectional=False),
                 "causal buckets; buckets of distances >= L never trained"),
        Encoding("alibi", "ALiBiPositionalEmbedding", lambda L, M: pe_lib.ALiBiPositionalEmbedding(NUM_HEADS)),
        Encoding("tupe", "UnifiedPositionalEmbedding",
                 lambda L, M: pe_lib.UnifiedPositionalEmbedding(M, NUM_HEADS, HEAD_DIM, bidirectional=False),
                 "table of 16L rows; rows >= L never trained"),
        Encoding("transformer_xl", "TransformerXLPositionalEmbedding",
                 lambda L, M: pe_lib.TransformerXLPositionalEmbedding(NUM_HEADS, HEAD_DIM)),
        Encoding("enformer", "EnformerPositionalEmbedding",
                 lambda L, M: pe_lib.EnformerPositionalEmbedding(NUM_HEADS, HEAD_DIM, num_features=36, length_scale=L),
                 "basis scaled to L, 36 features"),
        Encoding("algebraic_seq", "AlgebraicSequencePositionalEmbedding",
                 lambda L, M: pe_lib.AlgebraicSequencePositionalEmbedding(HEAD_DIM, NUM_HEADS)),
        Encoding("heinsen", "HeinsenPositionalEmbedding",
                 lambda L, M: pe_lib.HeinsenPositionalEmbedding(D_MODEL, D_MODEL), "order from a recurrence"),
        Encoding("xpos", "XPosPositionalEmbedding", lambda L, M: pe_lib.XPosPositionalEmbedding(HEAD_DIM)),
        Encoding("query_temperature", "QueryTemperaturePositionalEmbedding",
                 lambda L, M: pe_lib.QueryTemperaturePositionalEmbedding(length=L / 8, scale=0.1),
                 "NoPE with Llama 4's query temperature, its floor at L/8"),
        Encoding("polar", "PolarPositionalEmbedding",
                 lambda L, M: pe_lib.PolarPositionalEmbedding(HEAD_DIM, NUM_HEADS), "q/k twice as wide"),
        Encoding("fope", "FoPEPositionalEmbedding",
                 lambda L, M: pe_lib.FoPEPositionalEmbedding(HEAD_DIM, NUM_HEADS, train_length=L),
                 "frequencies below 2 pi / L clipped; sigma 0.3, fixed"),
        Encoding("hope", "HoPEPositionalEmbedding",
                 lambda L, M: pe_lib.HoPEPositionalEmbedding(HEAD_DIM, train_length=L),
                 "pairs with theta < 2 pi / L unrotated"),
        Encoding("kerple_log", "KerplePositionalEmbedding",
                 lambda L, M: pe_lib.KerplePositionalEmbedding(NUM_HEADS, kernel="log")),
        Encoding("kerple_power", "KerplePositionalEmbedding",
                 lambda L, M: pe_lib.KerplePositionalEmbedding(NUM_HEADS, kernel="power")),
        Encoding("sandwich", "SandwichPositionalEmbedding",
                 lambda L, M: pe_lib.SandwichPositionalEmbedding(NUM_HEADS, D_MODEL)),
        Encoding("fire", "FIREPositionalEmbedding", lambda L, M: pe_lib.FIREPositionalEmbedding(NUM_HEADS)),
        Encoding("cope", "CoPEPositionalEmbedding", lambda L, M: pe_lib.CoPEPositionalEmbedding(NUM_HEADS, HEAD_DIM)),
        Encoding("rerope", "ReRoPEPositionalEmbedding",
                 lambda L, M: pe_lib.ReRoPEPositionalEmbedding(HEAD_DIM, window=L // 2), "window L/2"),
        Encoding("self_extend", "SelfExtendPositionalEmbedding",
                 lambda L, M: pe_lib.SelfExtendPositionalEmbedding(pe_lib.RotaryPositionalEmbedding(HEAD_DIM),
                                                                   group_size=2 * M // L, window=L // 2),
                 "window L/2, G = 2M/L: every distance within L"),
        Encoding("stick_breaking", "StickBreakingPositionalEmbedding",
                 lambda L, M: pe_lib.StickBreakingPositionalEmbedding(), "no positions; stick-breaking weights"),
        Encoding("randomized_rope", "RandomizedPositionalEmbedding",
                 lambda L, M: pe_lib.RandomizedPositionalEmbedding(pe_lib.RotaryPositionalEmbedding(HEAD_DIM), M),
                 "RoPE on sorted draws from [0, M) in training"),
        Encoding("dual_chunk", "DualChunkPositionalEmbedding",
                 lambda L, M: pe_lib.DualChunkPositionalEmbedding(pe_lib.RotaryPositionalEmbedding(HEAD_DIM),
                                                                  chunk_size=3 * L // 4, local_size=L // 8),
                 "ChunkLlama's defaults: chunk 3L/4, local L/8"),
        Encoding("forgetting", "ForgettingPositionalEmbedding",
                 lambda L, M: pe_lib.ForgettingPositionalEmbedding(D_MODEL, NUM_HEADS),
                 "gate reads each block's normalised token states"),
        Encoding("inkling", "InklingPositionalEmbedding",
                 lambda L, M: pe_lib.InklingPositionalEmbedding(D_MODEL, NUM_HEADS, max_distance=L),
                 "profiles mixed by each block's normalised token states; extent E = L (0 beyond)"),
        Encoding("path", "PaTHPositionalEmbedding",
                 lambda L, M: pe_lib.PaTHPositionalEmbedding(D_MODEL, NUM_HEADS),
                 "Householder transitions read each block's normalised token states"),
        Encoding("shaw", "ShawPositionalEmbedding",
                 lambda L, M: pe_lib.ShawPositionalEmbedding(NUM_HEADS, HEAD_DIM), "distances clipped at 16"),
        Encoding("deberta", "DebertaPositionalEmbedding",
                 lambda L, M: pe_lib.DebertaPositionalEmbedding(D_MODEL, NUM_HEADS),
                 "log buckets (256 buckets, max relative 512)"),
    ]
    return {entry.name: entry for entry in entries}


ENCODINGS = _registry()
QUICK_ENCODINGS = ["nope", "sinusoidal", "rotary", "alibi"]
# Classes deliberately not in the registry: grids, trees, coordinates and timestamps, not token order
NOT_1D = {"LearnableFourierPositionalEmbedding", "Time2VecPositionalEmbedding", "LaplacianPositionalEmbedding",
          "RandomWalkPositionalEmbedding", "GraphormerPositionalEmbedding", "AbacusPositionalEmbedding", "AlgebraicGridPositionalEmbedding", "AlgebraicTreePositionalEmbedding", "RelativePositionBias2D",
          "ContinuousPositionBias", "DynamicPositionBias", "MixedRotaryPositionalEmbedding",
          "LieREPositionalEmbedding", "ComRoPEPositionalEmbedding", "STRINGPositionalEmbedding",
          "VideoRotaryPositionalEmbedding", "ConvolutionalPositionalEmbedding", "FourierFeaturePositionalEmbedding",
          "PositionalEmbedding", "EmbedPosition"}
# compatibility modes that reproduce checkpoints, not encodings to choose for a new model
COMPATIBILITY = {"DiffusersCompatRotaryEmbedding"}


def uncovered_classes() -> list:
    """Encoding classes in the library's ``__all__`` that no registry entry exercises."""
    covered = {entry.class_name for entry in ENCODINGS.values()}
    names = []
    for name in getattr(pe_lib, "__all__", []):
        obj = getattr(pe_lib, name, None)
        if isinstance(obj, type) and issubclass(obj, pe_lib.PositionalEmbedding) and \
                name not in covered | NOT_1D | COMPATIBILITY:
            names.append(name)
    return names


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def attend(q: Tensor, k: Tensor, v: Tensor, pe, states: Tensor) -> Tensor:
    """Causal ``attention()``; an encoding that reads the token states (the forget gate, Inkling, PaTH) is bound
    to the block's first."""
    if isinstance(pe, (pe_lib.ForgettingPositionalEmbedding, getattr(pe_lib, "_BoundTokens", ()))):
        pe = pe(states)
    return pe_lib.attention(q, k, v, pe, causal=True)


class Block(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP_RATIO * D_MODEL), nn.GELU(),
                                 nn.Linear(MLP_RATIO * D_MODEL, D_MODEL))

    def forward(self, x: Tensor, pe) -> Tensor:
        batch, n, _ = x.shape
        h = self.ln_attn(x)                                                              # [B, N, D]
        qkv = self.qkv(h).view(batch, n, 3, NUM_HEADS, HEAD_DIM)                         # [B, N, 3, H, Dh]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                                    # [B, H, N, Dh] each
        y = attend(q, k, v, pe, h)                                                       # [B, H, N, Dh]
        x = x + self.out(y.transpose(1, 2).reshape(batch, n, D_MODEL))                   # [B, N, D]
        return x + self.mlp(self.ln_mlp(x))


class TinyLM(nn.Module):
    """Byte embedding -> (input encoding) -> 2 causal blocks sharing one encoding -> next-byte logits."""

    def __init__(self, make_pe: Callable) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.ln_final = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.pe = make_pe()   # built after the trunk: for one seed every encoding gets the same trunk

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, N] -> logits [B, N, 256]."""
        x = self.embed(tokens)                                                           # [B, N, D]
        attn_pe = self.pe
        if self.pe is not None and self.pe.kind == "input":   # added to the tokens once
            x, attn_pe = self.pe.forward_input(x), None
        for block in self.blocks:
            x = block(x, attn_pe)
        return self.head(self.ln_final(x))                                               # [B, N, 256]


# ---------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    train_len: int
    steps: int
    batch_size: int
    lr: float
    eval_segments: int
    eval_chunk_tokens: int

    @property
    def lengths(self) -> list:
        return [self.train_len * f for f in LENGTH_FACTORS]


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_batch(data: Tensor, length: int, batch: int, generator: torch.Generator) -> tuple:
    """Random windows of ``length + 1`` bytes: inputs and next bytes, two [B, length]."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)    # [B]
    windows = data[starts[:, None] + torch.arange(length + 1)]                              # [B, length + 1]
    return windows[:, :-1], windows[:, 1:]


def build_model(encoding: Encoding, config: Config, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(lambda: encoding.build(config.train_len, config.lengths[-1]))


def train(model: TinyLM, data: Tensor, config: Config, seed: int, steps: Optional[int] = None) -> None:
    """AdamW on random training windows; the batch stream depends only on the seed."""
    steps = config.steps if steps is None else steps
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config.steps, config.lr)
        inputs, targets = train_batch(data, config.train_len, config.batch_size, generator)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def eval_segments(valid: Tensor, config: Config) -> Tensor:
    """``eval_segments`` segments of ``16L + 1`` bytes at evenly spaced offsets: [S, 16L + 1]."""
    span = config.lengths[-1] + 1
    if valid.numel() < span:
        raise SystemExit(f"extrapolation.py: validation split ({valid.numel()} bytes) shorter than 16L + 1 = {span}")
    count = config.eval_segments
    stride = (valid.numel() - span) // max(1, count - 1) if count > 1 else 0
    starts = torch.arange(count) * stride                                                    # [S]
    return valid[starts[:, None] + torch.arange(span)]                                       # [S, 16L + 1]


@torch.no_grad()
def position_losses(model: TinyLM, segments: Tensor, length: int, chunk_tokens: int) -> Tensor:
    """Loss in bits of every scored byte, laid out by window position: [windows, length]."""
    model.eval()
    inputs = segments[:, :-1].reshape(-1, length)                                           # [S * 16L / n, n]
    targets = segments[:, 1:].reshape(-1, length)
    per_chunk = max(1, chunk_tokens // length)
    losses = []
    for start in range(0, inputs.shape[0], per_chunk):
        logits = model(inputs[start:start + per_chunk])                                     # [c, n, 256]
        nats = F.cross_entropy(logits.flatten(0, 1), targets[start:start + per_chunk].flatten(), reduction="none")
        losses.append(nats.view(-1, length) / math.log(2))
    return torch.cat(losses)                                                                # [W, n]


@dataclass
class Result:
    encoding: str
    class_name: str
    kind: str
    seed: int
    train_len: int
    eval_len: int
    bpb: float
    bpb_beyond_L: float
    eval_bytes: int
    train_seconds: float
    eval_seconds: float
    steps: int
    pe_params: int
    notes: str


BINS_PER_OCTAVE = 2   # bins of window position for the 16L position curve


def position_curve(bits: Tensor, train_len: int) -> list:
    """(first, last, mean bits) over half-octave bins of window position: [W, n] -> rows."""
    n = bits.shape[1]
    per_position = bits.mean(0)                                                              # [n]
    octaves = math.log2(n) * BINS_PER_OCTAVE
    edges = {0, n, train_len} | {int(round(2 ** (e / BINS_PER_OCTAVE))) for e in range(int(octaves) + 1)}
    edges = sorted(e for e in edges if 0 <= e <= n)
    return [(a, b - 1, per_position[a:b].mean().item()) for a, b in zip(edges[:-1], edges[1:])]


def run_one(encoding: Encoding, corpus: Corpus, segments: Tensor, config: Config, seed: int) -> tuple:
    """Train and evaluate one (encoding, seed): Results per length and the 16L position curve."""
    model = build_model(encoding, config, seed)
    start = time.perf_counter()
    train(model, corpus.train, config, seed)
    train_seconds = time.perf_counter() - start
    pe_params = sum(p.numel() for p in model.pe.parameters()) if model.pe is not None else 0
    kind = model.pe.kind if model.pe is not None else "none"
    results, curve = [], []
    for length in config.lengths:
        start = time.perf_counter()
        bits = position_losses(model, segments, length, config.eval_chunk_tokens)          # [W, n]
        eval_seconds = time.perf_counter() - start
        beyond = bits[:, config.train_len:]
        results.append(Result(
            encoding.name, encoding.class_name if model.pe is not None else "(pe=None)",
            kind, seed, config.train_len, length, bits.mean().item(),
            beyond.mean().item() if beyond.numel() else float("nan"), bits.numel(), train_seconds, eval_seconds,
            config.steps, pe_params, encoding.note))
        if length == config.lengths[-1]:
            curve = position_curve(bits, config.train_len)
    return results, curve


def estimate(encodings: list, corpus: Corpus, segments: Tensor, config: Config, seeds: list,
             probe_steps: int = 3) -> tuple:
    """Seconds for the full run, from timing ``probe_steps`` training steps (after one warm-up
    step) and one evaluation chunk at each length, per encoding; and the per-encoding figures."""
    per_encoding = {}
    for encoding in encodings:
        model = build_model(encoding, config, 0)
        train(model, corpus.train, config, 0, steps=1)
        start = time.perf_counter()
        train(model, corpus.train, config, 0, steps=probe_steps)
        step_seconds = (time.perf_counter() - start) / probe_steps
        eval_seconds = 0.0
        for length in config.lengths:
            per_chunk = max(1, config.eval_chunk_tokens // length)
            windows = segments.shape[0] * config.lengths[-1] // length
            start = time.perf_counter()
            position_losses(model, segments[:1], length, length * min(per_chunk, config.lengths[-1] // length))
            chunk = time.perf_counter() - start
            eval_seconds += chunk * math.ceil(windows / min(per_chunk, config.lengths[-1] // length))
        per_encoding[encoding.name] = (step_seconds, step_seconds * config.steps + eval_seconds)
    total = sum(seconds for _, seconds in per_encoding.values()) * len(seeds)
    return total, per_encoding


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


CSV_FIELDS = list(Result.__dataclass_fields__)


def write_csv(path: pathlib.Path, results: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            row = {field: getattr(r, field) for field in CSV_FIELDS}
            for field in ("bpb", "bpb_beyond_L"):
                row[field] = "nan" if math.isnan(row[field]) else f"{row[field]:.5f}"
            for field in ("train_seconds", "eval_seconds"):
                row[field] = f"{row[field]:.2f}"
            writer.writerow(row)


def write_position_csv(path: pathlib.Path, curves: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["encoding", "seed", "first_position", "last_position", "bpb"])
        for (name, seed), curve in curves.items():
            for first, last, bits in curve:
                writer.writerow([name, seed, first, last, f"{bits:.5f}"])


def read_csv(path: pathlib.Path) -> list:
    """The rows ``write_csv`` wrote, as ``Result``s."""
    types = {field.name: field.type for field in fields(Result)}
    with open(path, newline="") as handle:
        return [Result(**{k: (float(v) if types[k] in (float, "float") else int(v) if types[k] in (int, "int") else v)
                          for k, v in row.items()}) for row in csv.DictReader(handle)]


def read_position_csv(path: pathlib.Path) -> dict:
    """The curves ``write_position_csv`` wrote: (encoding, seed) -> [(first, last, bits)]."""
    curves = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            curves.setdefault((row["encoding"], int(row["seed"])), []).append(
                (int(row["first_position"]), int(row["last_position"]), float(row["bpb"])))
    return curves


def mean_spread(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value) of the finite values."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary(results: list, field: str) -> dict:
    """{encoding: {eval_len: (mean, sd, values)}} of ``field`` over seeds."""
    table = {}
    for r in results:
        table.setdefault(r.encoding, {}).setdefault(r.eval_len, []).append(getattr(r, field))
    return {name: {n: (*mean_spread(v), v) for n, v in by_len.items()} for name, by_len in table.items()}


def markdown_table(results: list, config: Config, field: str = "bpb") -> str:
    stats = summary(results, field)
    seeds = sorted({r.seed for r in results})
    train_time = summary(results, "train_seconds")
    head = ["encoding", *[f"{f}L = {config.train_len * f}" if f > 1 else f"L = {config.train_len}" for f in LENGTH_FACTORS],
            "train s", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    notes = {r.encoding: r.notes for r in results}
    for name, by_len in stats.items():
        cells = [name]
        for length in config.lengths:
            mean, sd, _ = by_len.get(length, (float("nan"), float("nan"), []))
            cells.append("n/a" if math.isnan(mean) else (f"{mean:.3f} ± {sd:.3f}" if len(seeds) > 1 else f"{mean:.3f}"))
        cells.append(f"{train_time[name][config.train_len][0]:.0f}")
        cells.append(notes[name].replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _style(index: int) -> dict:
    import matplotlib.pyplot as plt
    colors = plt.get_cmap("tab20").colors
    return {"color": colors[(2 * index) % 20 + (index // 10) % 2], "linestyle": ["-", "--", ":"][(index // 20) % 3]}


def plot_extrapolation(path: pathlib.Path, results: list, config: Config, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    panels = [("bpb", "all bytes of each window"), ("bpb_beyond_L", f"bytes at window positions >= L = {config.train_len}")]
    finite = [getattr(r, f) for r in results for f in ("bpb", "bpb_beyond_L") if not math.isnan(getattr(r, f))]
    low = min(finite) if finite else 0.0
    top = min(max(finite) if finite else UNIFORM_BPB, 12.0)
    for ax, (field, subtitle) in zip(axes, panels):
        stats = summary(results, field)
        for index, (name, by_len) in enumerate(stats.items()):
            xs = [n for n in config.lengths if not math.isnan(by_len.get(n, (float("nan"),))[0])]
            if not xs:
                continue
            means = [by_len[n][0] for n in xs]
            lows = [min(by_len[n][2]) for n in xs]
            highs = [max(by_len[n][2]) for n in xs]
            style = _style(index)
            ax.plot(xs, means, marker="o", markersize=3.5, label=name, **style)
            ax.fill_between(xs, lows, highs, color=style["color"], alpha=0.18, linewidth=0)
        ax.axhline(UNIFORM_BPB, color="grey", linewidth=0.8, linestyle="--")
        ax.axvline(config.train_len, color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(config.lengths)
        ax.set_xticklabels([f"{n}\n({f}L)" if f > 1 else f"{n}\n(L)" for n, f in zip(config.lengths, LENGTH_FACTORS)])
        ax.set_xlabel("evaluation length (bytes)")
        ax.set_title(subtitle, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bits per byte (validation; lower is better)")
    axes[0].set_ylim(max(0.0, low - 0.2), top + 0.3)
    axes[1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, "line: mean over seeds; band: min to max over seeds; dashed: uniform (8 bits); "
             "values above 12 are off the chart", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_positions(path: pathlib.Path, curves: dict, config: Config, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {}
    for (name, _seed), curve in curves.items():
        by_name.setdefault(name, []).append(curve)
    fig, ax = plt.subplots(figsize=(9, 5))
    for index, (name, runs) in enumerate(by_name.items()):
        xs = [(first + last) / 2 + 1 for first, last, _ in runs[0]]
        ys = [statistics.fmean(run[i][2] for run in runs) for i in range(len(xs))]
        ax.plot(xs, [min(y, 12.0) for y in ys], marker=".", markersize=3, label=name, **_style(index))
    ax.axvline(config.train_len, color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"position inside a {config.lengths[-1]}-byte (16L) window (1 = first byte; dotted: L)")
    ax.set_ylabel("bits per byte (mean over seeds, clipped at 12)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cost(path: pathlib.Path, results: list, config: Config, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = summary([r for r in results if r.eval_len == config.train_len], "train_seconds")
    names = sorted(stats, key=lambda n: stats[n][config.train_len][0])
    means = [stats[n][config.train_len][0] for n in names]
    lows = [means[i] - min(stats[n][config.train_len][2]) for i, n in enumerate(names)]
    highs = [max(stats[n][config.train_len][2]) - means[i] for i, n in enumerate(names)]
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(names) + 1.5))
    ax.barh(names, means, xerr=[lows, highs], color="tab:blue", alpha=0.75, capsize=3)
    for y, value in enumerate(means):
        ax.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    ax.set_xlabel(f"training seconds ({config.steps} steps of {config.batch_size} x {config.train_len} bytes; "
                  "bar: mean, whiskers: min-max over seeds)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header(argv: list, corpus: Corpus, config: Config, seeds: list) -> str:
    return "\n".join([
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}, "
        f"{platform.machine()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
        "command: " + " ".join(shlex.quote(a) for a in ["python", *argv]),
        f"corpus: {corpus.root}: {corpus.train_files} training files ({corpus.train.numel():,} bytes, "
        f"sha256 {corpus.train_sha}), {corpus.valid_files} validation files ({corpus.valid.numel():,} bytes, "
        f"sha256 {corpus.valid_sha})",
        f"model: {NUM_LAYERS} pre-LN blocks, d_model {D_MODEL}, {NUM_HEADS} heads of {HEAD_DIM}; "
        f"L = {config.train_len}, {config.steps} steps of {config.batch_size} windows, lr {config.lr}; "
        f"eval on {config.eval_segments} x {config.lengths[-1]} validation bytes at "
        f"{', '.join(map(str, config.lengths))}; seeds {', '.join(map(str, seeds))}",
    ])


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


FULL = dict(train_len=64, steps=1500, batch_size=32, eval_segments=64)
QUICK = dict(train_len=16, steps=100, batch_size=16, eval_segments=8)
SCRATCH = pathlib.Path(tempfile.gettempdir()) / "positional_embeddings_extrapolation"   # runs that are not the study


def parse_args(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_ENCODINGS)}; one seed; L={QUICK['train_len']}, {QUICK['steps']} steps")
    parser.add_argument("--estimate", action="store_true", help="only time a few steps per encoding and print "
                        "the estimated run time of this configuration")
    parser.add_argument("--encodings", default=None, help=f"comma-separated, from: {', '.join(ENCODINGS)} (default: all)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick: 0)")
    parser.add_argument("--train-len", type=int, default=None, help=f"L (default {FULL['train_len']})")
    parser.add_argument("--steps", type=int, default=None, help=f"optimiser steps (default {FULL['steps']})")
    parser.add_argument("--batch-size", type=int, default=None, help=f"windows per step (default {FULL['batch_size']})")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-segments", type=int, default=None,
                        help=f"validation segments of 16L bytes (default {FULL['eval_segments']})")
    parser.add_argument("--eval-chunk-tokens", type=int, default=4096,
                        help="tokens per evaluation forward (at least one window)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--corpus-root", default=None, help="folder of .py files (default: the stdlib)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=None,
                       help="write the CSVs and PNGs into this folder instead of benchmarks/results and docs/figures "
                            f"(full study, --merge) or {SCRATCH} (any other run)")
    where.add_argument("--write-results", action="store_true",
                       help="write a run that is not the full study into the committed benchmarks/results and "
                            "docs/figures anyway")
    parser.add_argument("--no-figures", action="store_true")
    parser.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                        help="train nothing: combine the CSVs that runs with --out-dir DIR wrote (e.g. one process "
                             "per seed) into the outputs, figures and tables")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if s.strip()]
    names = QUICK_ENCODINGS if args.quick and args.encodings is None else (
        list(ENCODINGS) if args.encodings is None else [n.strip() for n in args.encodings.split(",") if n.strip()])
    unknown = [n for n in names if n not in ENCODINGS]
    if unknown:
        parser.error(f"unknown encodings {', '.join(unknown)}; choose from {', '.join(ENCODINGS)}")
    args.encoding_names = names
    return args


def is_full_study(args: argparse.Namespace) -> bool:
    """Whether ``args`` trains and measures exactly what the committed results hold (threads and
    evaluation chunking change the speed only)."""
    return (not args.quick and args.corpus_root is None and args.encoding_names == list(ENCODINGS)
            and args.seeds == [0, 1, 2] and args.lr == 3e-3
            and all(getattr(args, key) == value for key, value in FULL.items()))


def output_paths(args: argparse.Namespace) -> dict:
    """The five output files: the committed ones only for the full study, ``--merge`` or
    ``--write-results``; ``SCRATCH`` for any other run; everything in ``--out-dir`` if given."""
    if args.out_dir:
        results = figures = pathlib.Path(args.out_dir)
    elif args.merge or args.write_results or is_full_study(args):
        results, figures = REPO / "benchmarks" / "results", REPO / "docs" / "figures"
    else:
        results = figures = SCRATCH
    return {"csv": results / "extrapolation.csv", "positions": results / "extrapolation_positions.csv",
            "figure": figures / "extrapolation.png", "position_figure": figures / "extrapolation_position.png",
            "cost": figures / "extrapolation_cost.png"}


def main(argv: Optional[list] = None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = Config(args.train_len, args.steps, args.batch_size, args.lr, args.eval_segments, args.eval_chunk_tokens)
    if args.merge:
        results, curves = merged_results([d for d in args.merge.split(",") if d.strip()])
        report(results, curves, config, args, output_paths(args), time.perf_counter())
        return results
    corpus = load_corpus(args.corpus_root)
    segments = eval_segments(corpus.valid, config)
    encodings = [ENCODINGS[name] for name in args.encoding_names]
    print(header([sys.argv[0], *argv], corpus, config, args.seeds), flush=True)
    missing = uncovered_classes()
    if missing:
        print(f"note: 1-D classes of the library with no registry entry: {', '.join(missing)}", file=sys.stderr)
    if args.estimate or not args.quick:
        start = time.perf_counter()
        total, per_encoding = estimate(encodings, corpus, segments, config, args.seeds)
        for name, (step, seconds) in per_encoding.items():
            print(f"  {name:<16} {step * 1e3:7.1f} ms/step  ~{seconds:6.0f} s per seed", file=sys.stderr)
        print(f"estimated run time: {total / 60:.1f} min for {len(encodings)} encodings x {len(args.seeds)} seeds "
              f"at {torch.get_num_threads()} threads (probe took {time.perf_counter() - start:.0f} s)", flush=True)
        if args.estimate:
            return []
    else:  # warm-up, so the first run's training time is not charged for the allocator's start-up
        train(build_model(encodings[0], config, 0), corpus.train, config, 0, steps=2)
    results, curves, start = [], {}, time.perf_counter()
    paths = output_paths(args)
    runs = [(encoding, seed) for seed in args.seeds for encoding in encodings]
    for index, (encoding, seed) in enumerate(runs, 1):
        rows, curve = run_one(encoding, corpus, segments, config, seed)
        results.extend(rows)
        curves[(encoding.name, seed)] = curve
        write_csv(paths["csv"], results)   # after every run: a long run that stops keeps what it measured
        write_position_csv(paths["positions"], curves)
        print(f"[{index}/{len(runs)}] {encoding.name} seed {seed}: "
              + ", ".join(f"{r.eval_len}: {r.bpb:.3f}" for r in rows)
              + f" bits/byte (train {rows[0].train_seconds:.1f} s, eval {sum(r.eval_seconds for r in rows):.1f} s)",
              file=sys.stderr, flush=True)
    report(results, curves, config, args, paths, start)
    return results


def merged_results(dirs: list) -> tuple:
    """Results and position curves of several ``--out-dir`` folders; a run found twice is an error."""
    results, curves = [], {}
    for folder in dirs:
        base = pathlib.Path(folder)
        results.extend(read_csv(base / "extrapolation.csv"))
        for key, curve in read_position_csv(base / "extrapolation_positions.csv").items():
            if key in curves:
                raise SystemExit(f"extrapolation.py: --merge: {key[0]} seed {key[1]} appears twice")
            curves[key] = curve
    return results, curves


def report(results: list, curves: dict, config: Config, args: argparse.Namespace, paths: dict, start: float) -> None:
    """Sorted CSVs, the figures and the Markdown tables of a finished (or merged) run."""
    order = {name: i for i, name in enumerate(ENCODINGS)}
    results.sort(key=lambda r: (order.get(r.encoding, len(order)), r.seed, r.eval_len))
    write_csv(paths["csv"], results)
    write_position_csv(paths["positions"], curves)
    seeds = sorted({r.seed for r in results})
    title = (f"byte-level LM on the Python stdlib, trained at L = {config.train_len} ({config.steps} steps, "
             f"seeds {', '.join(map(str, seeds))})")
    if not args.no_figures:
        try:
            plot_extrapolation(paths["figure"], results, config, title)
            plot_positions(paths["position_figure"], curves, config, title)
            plot_cost(paths["cost"], results, config, title)
        except ImportError:
            print("matplotlib is not installed: no figures", file=sys.stderr)
    print()
    print(markdown_table(results, config))
    print()
    print("bits per byte (mean ± sample sd over seeds) over all bytes of non-overlapping windows; "
          f"uniform = {UNIFORM_BPB:.0f}. Positions >= L only:")
    print()
    print(markdown_table(results, config, "bpb_beyond_L"))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    main()

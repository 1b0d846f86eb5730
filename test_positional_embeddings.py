"""Tests for positional_embeddings.py.

Layout, in the library's order:

- shared setup: imports, sizes, fixtures, helpers and ``CASES`` (one or more ``Case`` per class, grouped by kind);
- the base's contract: property tests over every case (``TestEveryClass``), argument checks, positions as a
  caller writes them, ``attention()`` (masks, causal rule, grouped-query heads), packed documents and the
  FlexAttention path;
- one section per class, grouped by kind (input; q/k rotation; pairwise bias; logits), each a banner and one
  ``TestXxx`` class holding the class's float64 oracle, reference comparisons, edge cases and regressions;
- cross-cutting tests at the end: export and compile, distributed (sequence shards, DDP, FSDP2 on spawned
  gloo processes: marker ``distributed``), vendoring, docs, README and benchmark scripts.

Heavy tests run in full only with ``PE_SLOW=1`` (``.ci/run`` does); the default run keeps a representative
subset of each and skips the rest, which carries the ``slow`` marker: ``PE_SLOW=1 python3 -m pytest -m slow``
runs exactly what the default run leaves out.
"""

import collections
import copy
import csv
import doctest
import functools
import importlib
import inspect
import itertools
import json
import math
import os
import pathlib
import pickle
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import positional_embeddings as pe_lib

from positional_embeddings import (
    ALiBiPositionalEmbedding,
    AlgebraicGridPositionalEmbedding,
    AlgebraicSequencePositionalEmbedding,
    AlgebraicTreePositionalEmbedding,
    CoPEPositionalEmbedding,
    DiffusersCompatRotaryEmbedding,
    ReRoPEPositionalEmbedding,
    SelfExtendPositionalEmbedding,
    DualChunkPositionalEmbedding,
    RandomizedPositionalEmbedding,
    randomized_positions,
    StickBreakingPositionalEmbedding,
    PaTHPositionalEmbedding,
    ContinuousPositionBias,
    ConvolutionalPositionalEmbedding,
    DebertaPositionalEmbedding,
    DynamicPositionBias,
    EnformerPositionalEmbedding,
    FIREPositionalEmbedding,
    ForgettingPositionalEmbedding,
    InklingPositionalEmbedding,
    QueryTemperaturePositionalEmbedding,
    layer_encodings,
    multimodal_position_ids,
    FourierFeaturePositionalEmbedding,
    LearnableFourierPositionalEmbedding,
    Time2VecPositionalEmbedding,
    LaplacianPositionalEmbedding,
    GraphormerPositionalEmbedding,
    RandomWalkPositionalEmbedding,
    AbacusPositionalEmbedding,
    digit_positions,
    HeinsenPositionalEmbedding,
    KerplePositionalEmbedding,
    LearnedPositionalEmbedding,
    LieREPositionalEmbedding,
    STRINGPositionalEmbedding,
    ComRoPEPositionalEmbedding,
    VideoRotaryPositionalEmbedding,
    MixedRotaryPositionalEmbedding,
    NoPositionalEmbedding,
    PositionalEmbedding,
    RelativePositionBias2D,
    RotaryPositionalEmbedding,
    HoPEPositionalEmbedding,
    SandwichPositionalEmbedding,
    ShawPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    T5PositionalEmbedding,
    TransformerXLPositionalEmbedding,
    UnifiedPositionalEmbedding,
    XPosPositionalEmbedding,
    PolarPositionalEmbedding,
    FoPEPositionalEmbedding,
    attention,
    deberta_log_bucket,
    document_positions,
    heinsen_forward_sharded,
    permute_rotary_weight,
    rope_coordinates,
    augment_positions,
    shard_positions,
    sharded_log_linear_scan,
    t5_relative_position_bucket,
)
from positional_embeddings import (
    _alibi_kwargs_from_config,
    _LogLinearScanFunction,
    _rotary_kwargs_from_config,
    _t5_kwargs_from_config,
)


B, H, N, DH = 2, 4, 16, 32
D = H * DH

# PE_SLOW=1: the heavy tests run in full. Without it each keeps a representative subset; the rest carries the
# ``slow`` marker and skips (PE_SLOW=1 python3 -m pytest -m slow runs exactly that rest, as .ci/run does).
# A few slow parameters per base also carry ``sample``: on the oldest and newest torch, .ci/run runs the
# default part and ``PE_SLOW=1 python3 -m pytest -m "slow and sample"`` (compile, export, flex per base).
SLOW = bool(os.environ.get("PE_SLOW"))
SLOW_MARKS = (pytest.mark.slow, pytest.mark.skipif(not SLOW, reason="slow: runs with PE_SLOW=1"))
SAMPLE_MARKS = (*SLOW_MARKS, pytest.mark.sample)


def slow(test):
    """Decorator: the whole test is slow (marker ``slow``, skipped unless PE_SLOW=1)."""
    for mark in SLOW_MARKS:
        test = mark(test)
    return test


def quick_or_slow(values, quick, ids=None, sample=()):
    """``values`` as parameters: those whose id is in ``quick`` run by default, the others are slow; those in
    ``sample`` are slow and also in the per-base sample of the slow part (marker ``sample``)."""
    ids = [str(v) for v in values] if ids is None else list(ids)
    unknown = (set(quick) | set(sample)) - set(ids)
    assert not unknown, f"quick or sample ids not among the parameters: {sorted(unknown)}"
    assert not set(quick) & set(sample), "a quick parameter runs by default: it needs no sample mark"
    marks = lambda i: () if i in quick else SAMPLE_MARKS if i in sample else SLOW_MARKS   # noqa: E731
    return [pytest.param(v, id=i, marks=marks(i)) for v, i in zip(values, ids)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------
# Cases: how to build every class and feed it in the shared tests (one or more per class)
# ---------------------------------------------------------------------------


@dataclass
class Case:
    """How to build an encoding and feed it in the generic tests."""

    name: str
    make: Callable[[], PositionalEmbedding]
    # positions for N tokens when the class requires them (grids, trees), else None
    required_positions: Optional[Callable[[int], torch.Tensor]] = None
    has_offset: bool = True          # forward(x, positions, offset=...) on one tensor
    takes_positions: bool = True     # positions may be passed (Heinsen: order is the recurrence)
    token_dim: int = D               # last dim of x for forward_input

    def __repr__(self):
        return self.name

    def positions(self, nq, nk):
        """(positions_q, positions_k) for forward_attn: required ones bottom-right aligned, else None."""
        if self.required_positions is None:
            return None, None
        p = self.required_positions(max(nq, nk))
        return p[max(nk - nq, 0) : max(nk - nq, 0) + nq], p[:nk]

    def attn(self, pe, q, k):
        return pe.forward_attn(q, k, *self.positions(q.shape[-2], k.shape[-2]))

    def forward_input(self, pe, x):
        """``pe.forward_input(x)``, with the positions an input kind requires (graph nodes)."""
        if pe.kind != "input" or self.required_positions is None:
            return pe.forward_input(x)
        return pe.forward_input(x, self.required_positions(x.shape[-2]).to(x.device))

    def own_call_args(self, pe, q, k, x):
        """Arguments of the class's own forward: tokens, one of q/k, lengths, or q and k."""
        if pe.kind == "input":
            return (x,) if self.required_positions is None else (x, self.required_positions(x.shape[-2]))
        if pe.kind == "bias":
            return (q.shape[-2], k.shape[-2])
        positions_q, positions_k = self.positions(q.shape[-2], k.shape[-2])
        if pe.kind == "logits":
            return (q, k, positions_q, positions_k)
        return (q,) if positions_q is None else (q, positions_q)


@dataclass(repr=False)
class BoundCase(Case):
    """An encoding that reads the token states: ``unbound`` builds it, ``make`` binds it to ``FOX_STATES``."""

    unbound: Callable[[], PositionalEmbedding] = None


def bound_case(name: str, unbound: Callable[[], PositionalEmbedding]) -> BoundCase:
    return BoundCase(name, lambda: unbound()(FOX_STATES), unbound=unbound, has_offset=False, takes_positions=False)


@dataclass(repr=False)
class PairCase(Case):
    """A "qk" class whose own call takes q and k together: ``forward(q, k, positions_q, positions_k)``."""

    def own_call_args(self, pe, q, k, x):
        return (q, k, *self.positions(q.shape[-2], k.shape[-2]))


class GridBiasCase(Case):
    """A bias class whose own ``forward(q_len, k_len, positions_q, positions_k)`` needs ``[N, A]`` positions."""

    def own_call_args(self, pe, q, k, x):
        return (q.shape[-2], k.shape[-2], *self.positions(q.shape[-2], k.shape[-2]))


def grid_positions(n, width=4):
    return torch.stack([torch.arange(n) // width, torch.arange(n) % width], -1)


def video_tthw(n, spacing=2.0):
    """VideoRoPE positions of the first n tokens of 2 text tokens, 3 frames of 2 x 3, then text (a prefix of
    a longer sequence is the shorter one's positions)."""
    return VideoRotaryPositionalEmbedding(DH, temporal_spacing=spacing).positions([2, (3, 2, 3), max(n, 20)])[:n]


def grid_rc(n, cols=4):
    """(row, col) integer positions of n tokens on a grid with `cols` columns: [n, 2]."""
    return torch.stack([torch.arange(n) // cols, torch.arange(n) % cols], -1)


# Fixed token states for the shared property tests of the forget gate: the unbound module
# has no q/k work (its bias needs the tokens), so its Case binds these. Batch 1: shared by
# every batch row, so the batch-1 gradcheck runs too.
FOX_STATES = torch.randn(1, N, D, generator=torch.Generator().manual_seed(1))


# Plain config dicts (no transformers needed): the shared tests run on what from_config builds
LLAMA3_DICT = {"model_type": "llama", "hidden_size": H * DH, "num_attention_heads": H, "max_position_embeddings": 64,
               "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
NEOX_DICT = {"model_type": "gpt_neox", "hidden_size": H * DH, "num_attention_heads": H, "rotary_pct": 0.5,
             "rotary_emb_base": 10000}
GPTJ_DICT = {"model_type": "gptj", "n_embd": H * DH, "n_head": H, "rotary_dim": DH // 2}
QWEN2_VL_DICT = {"model_type": "qwen2_vl", "text_config": {
    "model_type": "qwen2_vl_text", "hidden_size": H * DH, "num_attention_heads": H,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, "rope_theta": 1e6}}
T5_DECODER_DICT = {"model_type": "t5", "num_heads": H, "relative_attention_num_buckets": 8,
                   "relative_attention_max_distance": 12, "is_decoder": True}


CASES = [
    # input kind: added to the tokens
    Case("sinusoidal", lambda: SinusoidalPositionalEmbedding(D)),
    Case("sinusoidal_concat", lambda: SinusoidalPositionalEmbedding(D, layout="concat")),
    Case("sinusoidal_fairseq", lambda: SinusoidalPositionalEmbedding(D, spectrum="fairseq", layout="concat")),
    Case("sinusoidal_sections", lambda: SinusoidalPositionalEmbedding(D, layout="concat", num_axes=3,
                                                                      sections=[D // 8, 3 * D // 16, 3 * D // 16]),
         required_positions=lambda n: torch.stack([torch.arange(n) // 6, torch.arange(n) % 6 // 3,
                                                   torch.arange(n) % 3], -1), has_offset=False),
    Case("learned", lambda: LearnedPositionalEmbedding(64, D)),
    Case("learned_axes_normalized", lambda: LearnedPositionalEmbedding((16, 4), D, normalize=True),
         required_positions=grid_rc, has_offset=False),
    Case("nope", lambda: NoPositionalEmbedding(dim=D)),
    Case("conv_peg_1d", lambda: ConvolutionalPositionalEmbedding(D, num_axes=1), has_offset=False,
         takes_positions=False),
    Case("conv_wav2vec2", lambda: ConvolutionalPositionalEmbedding(D, kernel_size=4, num_axes=1, groups=4,
                                                                   weight_norm=True, activation="gelu"),
         has_offset=False, takes_positions=False),
    Case("fourier_octave", lambda: FourierFeaturePositionalEmbedding(1, 16, scale=0.01), token_dim=16),
    Case("fourier_gaussian", lambda: FourierFeaturePositionalEmbedding(1, D, sampling="gaussian", scale=0.1)),
    Case("learnable_fourier", lambda: LearnableFourierPositionalEmbedding(1, D, fourier_dim=16, hidden_dim=8, gamma=8.0)),
    Case("time2vec", lambda: Time2VecPositionalEmbedding(D)),
    Case("time2vec_cos", lambda: Time2VecPositionalEmbedding(D, activation="cos")),
    Case("laplacian", lambda: LaplacianPositionalEmbedding(D, 4).eval(),
         required_positions=lambda n: graph_nodes(LaplacianPositionalEmbedding(D, 4), n), has_offset=False),
    Case("laplacian_signnet", lambda: LaplacianPositionalEmbedding(D, 3, sign_invariant=True, hidden_dim=4),
         required_positions=lambda n: graph_nodes(LaplacianPositionalEmbedding(D, 3), n), has_offset=False),
    Case("random_walk", lambda: RandomWalkPositionalEmbedding(D, 5),
         required_positions=lambda n: graph_nodes(RandomWalkPositionalEmbedding(D, 5), n), has_offset=False),
    Case("abacus", lambda: AbacusPositionalEmbedding(D, range(10), max_len=64, max_k=8).eval(),
         required_positions=lambda n: digit_positions(torch.arange(n) % 13, range(10)), has_offset=False),
    Case("heinsen", lambda: HeinsenPositionalEmbedding(D, 16), has_offset=False, takes_positions=False),
    # q/k rotation kind
    Case("rotary", lambda: RotaryPositionalEmbedding(DH)),
    Case("rotary_interleaved_partial", lambda: RotaryPositionalEmbedding(DH, interleaved=True, rotary_dim=DH // 2)),
    Case("rotary_yarn", lambda: RotaryPositionalEmbedding(
        DH, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})),
    Case("rotary_chunks", lambda: RotaryPositionalEmbedding(DH, sections=[4, 4, 4, 4], axis_spectrum="per_axis",
                                                            chunk_size=DH // 4),   # Allegro's layout, 4 axes
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3, torch.arange(n) % 5], -1),
         has_offset=False),
    Case("rotary_mrope", lambda: RotaryPositionalEmbedding(DH, sections=[4, 6, 6]),
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3], -1),
         has_offset=False),
    Case("diffusers_compat_ernie_image", lambda: DiffusersCompatRotaryEmbedding(DH, sections=[4, 6, 6],
                                                                                axis_spectrum="per_axis", base=256.0),
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3], -1), has_offset=False),
    Case("diffusers_compat_pooled", lambda: DiffusersCompatRotaryEmbedding(DH, mode="pooled", sections=[4, 6, 6],
                                                                           axis_spectrum="per_axis"),
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3], -1)[..., None] * 2 + torch.arange(2),
         has_offset=False),
    Case("hope", lambda: HoPEPositionalEmbedding(DH, train_length=64)),
    Case("hope_interleaved", lambda: HoPEPositionalEmbedding(DH, train_length=300, base=500.0, interleaved=True)),
    Case("video_rope", lambda: VideoRotaryPositionalEmbedding(DH, sections=[4, 6, 6]), required_positions=video_tthw,
         has_offset=False),
    Case("rotary_from_llama3_config", lambda: RotaryPositionalEmbedding(**_rotary_kwargs_from_config(LLAMA3_DICT))),
    Case("rotary_from_gptj_config", lambda: RotaryPositionalEmbedding(**_rotary_kwargs_from_config(GPTJ_DICT))),
    PairCase("xpos_interleaved", lambda: XPosPositionalEmbedding(DH, interleaved=True, scale_base=8.0),
             has_offset=False),
    PairCase("polar", lambda: PolarPositionalEmbedding(DH, H, phase_init="uniform"), has_offset=False),
    PairCase("query_temperature", lambda: QueryTemperaturePositionalEmbedding(length=4.0, scale=0.5), has_offset=False),
    Case("fope", lambda: FoPEPositionalEmbedding(DH, H, train_length=64, learnable=True)),
    Case("fope_authors", lambda: FoPEPositionalEmbedding(DH, H, train_length=64, num_pairs=DH // 4, padded="ones")),
    Case("mixed_rope", lambda: MixedRotaryPositionalEmbedding(DH, H), required_positions=grid_rc, has_offset=False),
    Case("mixed_rope_one_axis", lambda: MixedRotaryPositionalEmbedding(DH, H, 1, base=10.0)),
    Case("mixed_rope_mochi_split", lambda: MixedRotaryPositionalEmbedding(DH, H, 3),   # 3 axes, 16 pairs
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3], -1), has_offset=False),
    Case("liere_blocks", lambda: LieREPositionalEmbedding(DH, H, block_size=4), required_positions=grid_rc,
         has_offset=False),
    Case("liere_full_one_axis", lambda: LieREPositionalEmbedding(DH, H, 1)),
    Case("comrope_ap", lambda: ComRoPEPositionalEmbedding(DH, H, block_size=8), required_positions=grid_rc,
         has_offset=False),
    Case("comrope_ld_one_axis", lambda: ComRoPEPositionalEmbedding(DH, H, 1, variant="ld", block_size=4)),
    Case("string_cayley", lambda: STRINGPositionalEmbedding(DH, H), required_positions=grid_rc, has_offset=False),
    Case("string_circulant_one_axis", lambda: STRINGPositionalEmbedding(DH, H, 1, variant="circulant", init_std=0.1)),
    Case("algebraic_sequence", lambda: AlgebraicSequencePositionalEmbedding(DH, H)),
    Case("algebraic_grid", lambda: AlgebraicGridPositionalEmbedding(DH, H),
         required_positions=lambda n: torch.stack([torch.arange(n) // 4, torch.arange(n) % 4], -1), has_offset=False),
    Case("algebraic_tree", lambda: AlgebraicTreePositionalEmbedding(DH, H, branching_factor=2, max_depth=5)),
    # pairwise bias kind
    Case("t5", lambda: T5PositionalEmbedding(H, num_buckets=8, max_distance=12), has_offset=False),
    Case("t5_causal", lambda: T5PositionalEmbedding(H, bidirectional=False), has_offset=False),
    Case("t5_from_decoder_config", lambda: T5PositionalEmbedding(**_t5_kwargs_from_config(T5_DECODER_DICT)),
         has_offset=False),
    Case("alibi", lambda: ALiBiPositionalEmbedding(H), has_offset=False),
    Case("alibi_bidirectional", lambda: ALiBiPositionalEmbedding(H, bidirectional=True), has_offset=False),
    Case("tupe", lambda: UnifiedPositionalEmbedding(64, H, DH, cls_token=True, num_buckets=8, max_distance=12),
         has_offset=False),
    Case("kerple_log", lambda: KerplePositionalEmbedding(H), has_offset=False),
    Case("kerple_power_bidirectional", lambda: KerplePositionalEmbedding(H, kernel="power", bidirectional=True),
         has_offset=False),
    Case("sandwich", lambda: SandwichPositionalEmbedding(H, DH), has_offset=False),
    Case("fire_bidirectional", lambda: FIREPositionalEmbedding(H, hidden_dim=8, init_L=4.0, bidirectional=True),
         has_offset=False),
    Case("dynamic_bias", lambda: DynamicPositionBias(H, hidden_dim=16), has_offset=False),
    Case("dynamic_bias_log_norm", lambda: DynamicPositionBias(H, hidden_dim=16, depth=3, log_distance=True, norm=True),
         has_offset=False),
    GridBiasCase("dynamic_bias_2d", lambda: DynamicPositionBias(H, num_axes=2, hidden_dim=16),
                 required_positions=grid_positions, has_offset=False),
    Case("relpos2d", lambda: RelativePositionBias2D(H, (4, 5)), has_offset=False),
    Case("relpos2d_cls", lambda: RelativePositionBias2D(H, (4, 5), num_prefix_tokens=1), has_offset=False),
    Case("swinv2_cpb", lambda: ContinuousPositionBias(H, (4, 5), hidden_dim=32), has_offset=False),
    Case("swinv2_cpb_pretrained", lambda: ContinuousPositionBias(H, (4, 5), hidden_dim=32, pretrained_window_size=3),
         has_offset=False),
    bound_case("forgetting", lambda: ForgettingPositionalEmbedding(D, H)),
    bound_case("inkling", lambda: InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6, init_std=0.5)),
    bound_case("inkling2", lambda: InklingPositionalEmbedding(D, H, d_rel=4, max_distance=N + 3, bias=True,
                                                              clip_threshold=0.5, log_scaling_n_floor=4, init_std=0.5)),
    Case("graphormer", lambda: GraphormerPositionalEmbedding(H).bind(GRAPH), has_offset=False, takes_positions=False),
    Case("graphormer_token", lambda: GraphormerPositionalEmbedding(H, num_spatial=4, graph_token=True, attend_within=3).bind(
        GRAPH[:-1, :-1]), has_offset=False, takes_positions=False),
    # logits kind
    Case("transformer_xl", lambda: TransformerXLPositionalEmbedding(H, DH), has_offset=False),
    Case("enformer", lambda: EnformerPositionalEmbedding(H, DH, num_features=12, length_scale=64),
         has_offset=False),
    Case("shaw", lambda: ShawPositionalEmbedding(H, DH, max_distance=5), has_offset=False),
    Case("shaw_key_query_asymmetric", lambda: ShawPositionalEmbedding(H, DH, max_distance=(6, 3), key_query=True),
         has_offset=False),
    Case("shaw_no_values", lambda: ShawPositionalEmbedding(H, DH, max_distance=4, values=False), has_offset=False),
    Case("deberta", lambda: DebertaPositionalEmbedding(D, H, max_relative_positions=12, position_buckets=4),
         has_offset=False),
    Case("deberta_c2p_unbucketed", lambda: DebertaPositionalEmbedding(
        D, H, max_relative_positions=6, position_buckets=None, pos_att_type=("c2p",), layer_norm=False),
         has_offset=False),
    Case("rerope_leaky", lambda: ReRoPEPositionalEmbedding(DH, window=5, leak=4.0, log_scaling_length=8),
         has_offset=False),
    Case("self_extend", lambda: SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH, interleaved=True),
                                                               group_size=3, window=4), has_offset=False),
    Case("self_extend_code_shift", lambda: SelfExtendPositionalEmbedding(
        RotaryPositionalEmbedding(DH, rotary_dim=DH // 2), group_size=3, window=5, shift="code",
        log_scaling_length=6), has_offset=False),
    Case("dual_chunk", lambda: DualChunkPositionalEmbedding(RotaryPositionalEmbedding(DH), chunk_size=5, local_size=2),
         has_offset=False),
    Case("dual_chunk_interleaved", lambda: DualChunkPositionalEmbedding(
        RotaryPositionalEmbedding(DH, interleaved=True), chunk_size=6, local_size=1), has_offset=False),
    Case("stick_breaking", lambda: StickBreakingPositionalEmbedding(), has_offset=False, takes_positions=False),
    bound_case("path", lambda: PaTHPositionalEmbedding(D, H, block_size=8)),
    bound_case("path_fox_gqa", lambda: PaTHPositionalEmbedding(D, H, num_kv_heads=2, w_rank=None, conv_size=None,
                                                                forget_gate=True, block_size=6)),
    Case("stick_breaking_current", lambda: StickBreakingPositionalEmbedding(attend_current=True, remainder="current"),
         has_offset=False, takes_positions=False),
    # wrappers, in eval mode (arange positions; training draws are tested in TestRandomized)
    PairCase("randomized_rope", lambda: RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64).eval(),
             has_offset=False),
    Case("randomized_sinusoidal", lambda: RandomizedPositionalEmbedding(SinusoidalPositionalEmbedding(D), 64).eval()),
    Case("randomized_alibi", lambda: RandomizedPositionalEmbedding(ALiBiPositionalEmbedding(H), 64).eval(),
         has_offset=False),
    Case("randomized_shaw", lambda: RandomizedPositionalEmbedding(ShawPositionalEmbedding(H, DH, max_distance=5),
                                                                  64).eval(), has_offset=False),
    Case("cope", lambda: CoPEPositionalEmbedding(H, DH, max_position=8, init_std=0.5), has_offset=False,
         takes_positions=False),
    Case("cope_per_head", lambda: CoPEPositionalEmbedding(H, DH, per_head=True, init_std=0.5), has_offset=False,
         takes_positions=False),
]


def qkv(nq=N, nk=N, dtype=torch.float32, dh=DH):
    q = torch.randn(B, H, nq, dh, dtype=dtype)
    k = torch.randn(B, H, nk, dh, dtype=dtype)
    v = torch.randn(B, H, nk, dh, dtype=dtype)
    return q, k, v


def ring_with_chords(n: int) -> torch.Tensor:
    """A connected undirected test graph on n nodes: a ring plus the chords i -- 3i + 1 (mod n), [n, n]."""
    adjacency = torch.zeros(n, n)
    for i in range(n):
        for j in ((i + 1) % n, (3 * i + 1) % n):
            if j != i:
                adjacency[i, j] = adjacency[j, i] = 1.0
    return adjacency


GRAPH = ring_with_chords(N)   # the graph Graphormer's cases bind (made here: a case may be built on the meta device)


def graph_nodes(pe, n: int) -> torch.Tensor:
    """Node positions of ``ring_with_chords(n)`` for a graph encoding: ``[n, A]``."""
    return pe.graph_positions(ring_with_chords(n))


def tokens(case, n=N, dtype=torch.float32):
    return torch.randn(B, n, case.token_dim, dtype=dtype)


def paired_positions(nq, nk):
    """Default positions written out: keys 0..nk-1, queries the last nq of them."""
    return [i + max(nk - nq, 0) for i in range(nq)], list(range(nk))


def case_outputs(case, pe, q, k, x):
    """What the encoding computes: the tokens it encodes for an input kind (whose ``forward_attn`` is plain
    ``q k^T`` and never reads the encoding), else its logits."""
    return case.forward_input(pe, x) if pe.kind == "input" else case.attn(pe, q, k)


def attention_positions(pe, positions) -> dict:
    """attention()'s position keywords for a case's ``(positions_q, positions_k)``: none for an input kind, whose
    positions went to the tokens (attention() refuses them)."""
    return {} if pe.kind == "input" else dict(zip(("positions_q", "positions_k"), positions))


def skip_input_kind(pe, why: str) -> None:
    if pe.kind == "input":
        pytest.skip(f"input kind: forward_attn does not read the encoding ({why})")


# ===========================================================================
# The base's contract: every class
# ===========================================================================


# ---------------------------------------------------------------------------
# Property tests over every case
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=repr)
class TestEveryClass:
    def test_is_positional_embedding_with_kind(self, case):
        pe = case.make()
        assert isinstance(pe, PositionalEmbedding)
        assert pe.kind in ("input", "qk", "bias", "logits")
        assert pe_lib.__all__.count(type(pe).__name__) == 1
        assert repr(pe).startswith(type(pe).__name__ + "(") and repr(pe) != type(pe).__name__ + "()"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
    def test_shape_and_dtype_kept(self, case, dtype):
        pe = case.make().to(dtype)
        x = tokens(case, dtype=dtype)
        y = case.forward_input(pe, x)
        assert y.shape == x.shape and y.dtype == dtype
        q, k, _ = qkv(N - 3, N, dtype=dtype)
        logits = case.attn(pe, q, k)
        assert logits.shape == (B, H, N - 3, N) and logits.dtype == dtype

    def test_nothing_cached_in_state_dict(self, case):
        pe = case.make()
        case_outputs(case, pe, *qkv()[:2], tokens(case))
        assert set(pe.state_dict()) == {name for name, _ in pe.named_parameters()}

    def test_load_state_dict_round_trips(self, case):
        a, b = case.make(), case.make()
        for p in b.parameters():
            torch.nn.init.normal_(p)
        a.load_state_dict(b.state_dict())
        q, k, _ = qkv()
        x = tokens(case)
        torch.testing.assert_close(case_outputs(case, a, q, k, x), case_outputs(case, b, q, k, x))

    @pytest.mark.parametrize("cast", ["bfloat16", "half", "double"])
    def test_dtype_cast_keeps_buffers_precise(self, case, cast):
        reference = case.make()
        cast_pe = getattr(copy.deepcopy(reference), cast)()
        for (name, want), (_, got) in zip(reference.named_buffers(), cast_pe.named_buffers()):
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    def test_deepcopy_and_pickle(self, case):
        pe = case.make()
        q, k, _ = qkv()
        x = tokens(case)
        want = case_outputs(case, pe, q, k, x)
        for clone in (copy.deepcopy(pe), pickle.loads(pickle.dumps(pe))):
            torch.testing.assert_close(case_outputs(case, clone, q, k, x), want)

    def test_meta_device_construction(self, case):
        normal = case.make()
        with torch.device("meta"):
            meta = case.make()
        assert all(p.is_meta for p in meta.parameters())
        meta.to_empty(device="cpu")
        meta.reset_parameters()
        meta.load_state_dict(normal.state_dict())
        for (name, want), (_, got) in zip(normal.named_buffers(), meta.named_buffers()):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        q, k, _ = qkv()
        torch.testing.assert_close(case.attn(meta, q, k), case.attn(normal, q, k))
        x = tokens(case)
        torch.testing.assert_close(case.forward_input(meta, x), case.forward_input(normal, x))

    def test_moves_to_meta(self, case):
        pe = case.make()
        moved = copy.deepcopy(pe).to("meta")
        assert all(t.is_meta for t in list(moved.parameters()) + list(moved.buffers()))

    @pytest.mark.parametrize("module_device, inputs_device", [
        ("cpu", "meta"), ("meta", "cpu"),
        *(pytest.param(*devices, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))
          for devices in (("cpu", "cuda:0"), ("cuda:0", "cpu")))])
    def test_inputs_off_the_module_device_raise_value_error(self, case, module_device, inputs_device):
        """q and k (x for input kinds) on another device than the module's tensors: a ValueError naming the
        class and both devices, from attention(), forward_attn and the class's own call. (STRING returned an
        uninitialised CPU tensor for meta q/k, a batched matmul of meta and CPU giving CPU; most classes
        raised torch's own error.) A module holding no tensors takes inputs on any device."""
        pe = case.make().to(module_device)
        name = type(pe).__name__
        q, k, v = (t.to(inputs_device) for t in qkv())
        x = tokens(case).to(inputs_device)
        positions_q, positions_k = (None if p is None else p.to(inputs_device) for p in case.positions(N, N))
        if pe.kind == "input":
            calls = {"forward_input": (lambda: pe.forward_input(x, positions_q), "x")}
        else:
            calls = {"forward_attn": (lambda: pe.forward_attn(q, k, positions_q, positions_k), "q"),
                     "attention": (lambda: attention(q, k, v, pe, positions_q=positions_q, positions_k=positions_k),
                                   "q")}
        if pe.kind != "bias":   # a bias's own call takes lengths, and positions checked against the module's device
            argument = "x" if pe.kind == "input" or (pe.kind == "qk" and not isinstance(case, PairCase)) else "q"
            calls["forward"] = (lambda: _own_call_with_positions(pe, case, q, k, x, positions_q, positions_k),
                                argument)
        holds_tensors = any(True for _ in itertools.chain(pe.parameters(), pe.buffers()))
        for entry, (call, argument) in calls.items():
            if not holds_tensors:
                out = call()
                assert all(t.device == torch.device(inputs_device) for t in (out if isinstance(out, tuple) else
                                                                             (out,))), entry
                continue
            with pytest.raises(ValueError, match=re.escape(f"{name}: {argument} must be on the module's device "
                                                           f"({module_device}), got {argument} on {inputs_device}")):
                call()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    def test_cuda_matches_cpu(self, case):
        pe = case.make()
        if pe.kind == "input":   # attention() never reads it: compare the tokens it encodes
            x = tokens(case)
            got = case.forward_input(copy.deepcopy(pe).cuda(), x.cuda())
            torch.testing.assert_close(got.cpu(), case.forward_input(pe, x), rtol=1e-4, atol=1e-4)
            return
        q, k, v = qkv()
        positions = case.positions(N, N)
        want = attention(q, k, v, pe, positions_q=positions[0], positions_k=positions[1])
        on_gpu = [None if p is None else p.cuda() for p in positions]
        got = attention(q.cuda(), k.cuda(), v.cuda(), copy.deepcopy(pe).cuda(), positions_q=on_gpu[0],
                        positions_k=on_gpu[1])
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)

    def test_explicit_arange_positions_equal_default(self, case):
        if not case.takes_positions or case.required_positions is not None:
            pytest.skip("no default positions")
        pe = case.make()
        q, k, _ = qkv(N - 5, N)
        pos_q, pos_k = torch.arange(5, N), torch.arange(N)
        torch.testing.assert_close(pe.forward_attn(q, k, pos_q, pos_k), pe.forward_attn(q, k))
        batched = (pos_q.expand(B, -1), pos_k.expand(B, -1))
        torch.testing.assert_close(pe.forward_attn(q, k, *batched), pe.forward_attn(q, k))
        x = tokens(case)
        torch.testing.assert_close(pe.forward_input(x, torch.arange(N)), pe.forward_input(x))

    def test_pair_alone_equals_pair_in_full_call(self, case):
        if not case.takes_positions:
            pytest.skip("order is encoded by the recurrence")
        pe = case.make()
        skip_input_kind(pe, "no pairs: test_token_by_token_offset_equals_full decodes its tokens")
        q, k, _ = qkv(N - 4, N, dtype=torch.float64)
        pe = pe.double()
        pos_q, pos_k = case.positions(N - 4, N)
        full = pe.forward_attn(q, k, pos_q, pos_k)
        if pos_q is None:
            pos_q, pos_k = torch.arange(4, N), torch.arange(N)
        for i, j in ((0, 0), (1, N - 1), (N - 5, 2), (3, 9), (6, 6)):   # upper triangle included
            alone = pe.forward_attn(q[..., i : i + 1, :], k[..., j : j + 1, :], pos_q[i : i + 1], pos_k[j : j + 1])
            torch.testing.assert_close(alone, full[..., i : i + 1, j : j + 1])

    def test_token_by_token_attn_equals_full(self, case):
        pe = case.make()
        skip_input_kind(pe, "test_token_by_token_offset_equals_full decodes its tokens")
        q, k, _ = qkv()
        full = case.attn(pe, q, k)
        for t in (0, 5, N - 1):
            step = case.attn(pe, q[..., t : t + 1, :], k[..., : t + 1, :])
            torch.testing.assert_close(step, full[..., t : t + 1, : t + 1])

    def test_token_by_token_offset_equals_full(self, case):
        if not case.has_offset:
            pytest.skip("no offset argument")
        pe = case.make()
        x = tokens(case) if pe.kind == "input" else qkv()[0]
        full = pe(x)
        for t in (0, 7, N - 1):
            torch.testing.assert_close(pe(x[..., t : t + 1, :], offset=t), full[..., t : t + 1, :])

    def test_gradients_reach_every_parameter(self, case):
        pe = case.make()
        q, k, v = qkv()
        q.requires_grad_(True)
        logits = case.attn(pe, q, k)
        logits = logits.masked_fill(logits == float("-inf"), 0.0)   # causal ALiBi
        loss = logits.square().sum() + case.forward_input(pe, tokens(case)).square().sum()
        if pe.kind != "input":
            positions = dict(zip(("positions_q", "positions_k"), case.positions(N, N)))
            loss = loss + attention(q, k, v, pe, **positions).square().sum()
        loss.backward()
        assert q.grad is not None and q.grad.abs().sum() > 0
        for name, p in pe.named_parameters():
            if p.requires_grad:   # frozen ones (FIRE's init_L, as in its reference) get none
                assert p.grad is not None and p.grad.abs().sum() > 0, name

    def test_gradcheck_float64(self, case):
        pe = case.make().double()
        q, k, v = qkv(4, 5, dtype=torch.float64)
        x = tokens(case, n=5, dtype=torch.float64)[:1]
        q, k, v = q[:1].requires_grad_(), k[:1].requires_grad_(), v[:1]
        positions = case.positions(4, 5)
        named = dict(zip(("positions_q", "positions_k"), positions))
        finite = lambda t: torch.where(torch.isfinite(t), t, 0.0)                              # noqa: E731
        assert torch.autograd.gradcheck(lambda q, k: finite(pe.forward_attn(q, k, *positions)), (q, k), fast_mode=True)
        if pe.kind != "input":
            assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, pe, **named), (q, k, v.requires_grad_()),
                                            fast_mode=True)
        if pe.kind == "input":
            assert torch.autograd.gradcheck(lambda x: case.forward_input(pe, x), (x.requires_grad_(),), fast_mode=True)
        params = [p for p in pe.parameters() if p.requires_grad]
        if not params:
            return
        weights = torch.randn_like(finite(pe.forward_attn(q, k, *positions)))
        out_weights = torch.randn(1, H, 4, DH, dtype=torch.float64)

        def loss():
            total = (finite(pe.forward_attn(q, k, *positions)) * weights).sum()
            if pe.kind != "input":
                total = total + (attention(q, k, v, pe, **named) * out_weights).sum()
            return total + (case.forward_input(pe, x) * x).sum() if pe.kind == "input" else total

        grads = torch.autograd.grad(loss(), params)
        direction = [torch.randn_like(p) for p in params]
        analytic = sum((g * d).sum() for g, d in zip(grads, direction))
        eps = 1e-6
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(eps * d)
            plus = loss()
            for p, d in zip(params, direction):
                p.sub_(2 * eps * d)
            minus = loss()
            for p, d in zip(params, direction):
                p.add_(eps * d)
        assert (plus - minus).item() / (2 * eps) == pytest.approx(analytic.item(), rel=1e-5, abs=1e-6)

    def test_attention_matches_explicit_softmax(self, case):
        pe = case.make()
        for nq, causal in ((N, False), (N, True), (N - 6, True)):
            if pe.is_causal and not causal:  # a ValueError there (TestCausalRule)
                continue
            q, k, v = qkv(nq, N, dtype=torch.float64)
            pe64 = copy.deepcopy(pe).double()
            positions = case.positions(nq, N)
            logits = case.attn(pe64, q, k)
            if causal:
                i = torch.arange(nq)[:, None] + (N - nq)
                logits = logits.masked_fill(torch.arange(N)[None, :] > i, float("-inf"))
            softmax = type(pe64).attention_weights is pe_lib.PositionalEmbedding.attention_weights
            weights = torch.softmax(logits, dim=-1) if softmax else pe64.attention_weights(logits)   # stick-breaking
            want = weights @ v
            extra = pe64.attention_values(weights, *positions)           # the value term, if the class has one
            want = want if extra is None else want + extra
            got = attention(q, k, v, pe64, causal=causal, **attention_positions(pe, positions))
            torch.testing.assert_close(got, want)

    def test_low_precision_module_stays_finite_and_close(self, case):
        pe = case.make()
        q, k, _ = qkv()
        x = tokens(case)
        want = case_outputs(case, pe, q, k, x).float()
        for cast in ("bfloat16", "half"):
            low = getattr(copy.deepcopy(pe), cast)()
            got = case_outputs(case, low, q, k, x.to(getattr(torch, cast))).float()   # an input kind takes its dtype
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), finite)
            error = (got[finite] - want[finite]).norm() / want[finite].norm()
            assert error < 0.05, f"{cast}: relative error {error:.3f}"

    def test_batched_positions_with_extra_leading_dims(self, case):
        if not case.takes_positions:
            pytest.skip("order is encoded by the recurrence")
        pe = case.make()
        skip_input_kind(pe, "test_explicit_arange_positions_equal_default passes its positions to forward_input")
        q, k = torch.randn(2, B, 3, H, N, DH, dtype=torch.float64).unbind(0)
        pe = pe.double()
        base_q, base_k = case.positions(N, N)
        if base_q is None:
            base_q = base_k = torch.arange(N)
        pos_q, pos_k = torch.stack([base_q, base_q + 3]), torch.stack([base_k, base_k + 3])
        if isinstance(pe, (pe_lib.LearnedPositionalEmbedding, UnifiedPositionalEmbedding)):
            pos_q, pos_k = torch.stack([base_q, base_q.flip(0)]), torch.stack([base_k, base_k.flip(0)])
        full = pe.forward_attn(q, k, pos_q, pos_k)
        for b in range(B):
            torch.testing.assert_close(full[b], pe.forward_attn(q[b], k[b], pos_q[b], pos_k[b]))

    def test_narrow_integer_positions(self, case):
        if not case.takes_positions:
            pytest.skip("order is encoded by the recurrence")
        pe = case.make()
        q, k, _ = qkv()
        pos_q, pos_k = case.positions(N, N)
        if pos_q is None:
            pos_q = pos_k = torch.arange(N)
        if pe.kind == "input":
            x, pos = tokens(case), pos_q if case.required_positions is None else case.required_positions(N)
            if pos.is_floating_point() or pos.dim() != 1:
                pytest.skip("its positions are not integer positions (graph nodes)")
            want = pe.forward_input(x, pos)
            for dtype in (torch.int32, torch.int16, torch.uint8):
                torch.testing.assert_close(pe.forward_input(x, pos.to(dtype)), want)
            return
        want = pe.forward_attn(q, k, pos_q, pos_k)
        for dtype in (torch.int32, torch.int16, torch.uint8):
            torch.testing.assert_close(pe.forward_attn(q, k, pos_q.to(dtype), pos_k.to(dtype)), want)

    def test_empty_queries(self, case):
        pe = case.make()
        q, k, v = qkv(0, N)
        positions_q, positions_k = case.positions(1, N)
        if positions_q is not None:
            positions_q = positions_q[:0]
        out = attention(q, k, v, pe, **attention_positions(pe, (positions_q, positions_k)))
        assert out.shape == (B, H, 0, DH)

    def test_wrong_head_count_is_value_error(self, case):
        pe = case.make()
        if getattr(pe, "num_heads", None) is None:
            pytest.skip("not per head")
        q, k, _ = qkv()
        with pytest.raises(ValueError, match=type(pe).__name__ + ": q and k must be \\[..., H=4"):
            case.attn(pe, q[:, :3], k[:, :3])

    def test_bad_head_dims_raise_value_error(self, case):
        pe = case.make()
        q, k, _ = qkv()
        with pytest.raises(ValueError, match=type(pe).__name__ + ".*q and k"):
            case.attn(pe, q, k[..., :-2])

    def test_bad_positions_raise_value_error(self, case):
        if not case.takes_positions:
            pytest.skip("order is encoded by the recurrence")
        pe = case.make()
        q, k, _ = qkv()
        with pytest.raises(ValueError, match=type(pe).__name__ + ".*positions"):
            pe.forward_attn(q, k, torch.arange(N + 1), torch.arange(N))
        with pytest.raises(TypeError, match=type(pe).__name__ + ".*positions"):
            pe.forward_attn(q, k, [0, 1], torch.arange(N))

    def test_float_positions_error_names_argument_and_given_dtype(self, case):
        """Classes that index tables, buckets or nodes reject floats before widening them."""
        pe = case.make()
        if not pe.integer_positions:
            pytest.skip("takes float positions")
        q, k, v = qkv()
        floats = torch.arange(N, dtype=torch.float32)
        message = type(pe).__name__ + ": {} must be an integer tensor .*got dtype=torch.float32"
        if pe.kind == "input":
            with pytest.raises(TypeError, match=message.format("positions")):
                pe(torch.randn(1, N, case.token_dim), floats)
            return
        with pytest.raises(TypeError, match=message.format("positions_k")):
            attention(q, k, v, pe, positions_q=torch.arange(N), positions_k=floats)
        with pytest.raises(TypeError, match=message.format("positions_q")):
            pe.forward_attn(q, k, floats, torch.arange(N))

    def test_bad_tokens_raise(self, case):
        pe = case.make()
        if pe.kind != "input":
            pytest.skip("identity on tokens")
        with pytest.raises(ValueError, match=type(pe).__name__ + ".*x"):
            case.forward_input(pe, torch.randn(B, N, case.token_dim + 1))
        with pytest.raises(TypeError, match=type(pe).__name__ + ".*x"):
            case.forward_input(pe, torch.zeros(B, N, case.token_dim, dtype=torch.long))

    def test_attention_rejects_a_wrong_head_count_or_head_dim(self, case):
        """A wrong (or swapped) constructor argument must not run: every attention-side class built for a head
        count or a head width checks q against it at attention()'s entry, naming itself."""
        pe = case.make()
        heads, head_dim = getattr(pe, "num_heads", None), getattr(pe, "head_dim", None)
        if pe.kind == "input":
            pytest.skip("added to the tokens: attention() never sees its widths")
        if heads is None and head_dim is None and case.name.startswith(("stick_breaking", "query_temperature")):
            pytest.skip("built for no head count or width: any head count and width")
        if heads is None and head_dim is None:
            pytest.fail(f"{case.name}: an attention-side class with neither num_heads nor head_dim")
        positions = dict(zip(("positions_q", "positions_k"), case.positions(N, N)))
        name = type(pe).__name__
        for h, dh in ((H + 1, DH), (1, DH), (H, 2 * DH), (H, DH // 2)):
            q, k, v = (torch.randn(B, h, N, dh) for _ in range(3))
            wrong = (heads is not None and h != heads) or (head_dim is not None and dh != head_dim)
            if not wrong:   # a bias built for H heads takes any head dim; RoPE any head count
                assert attention(q, k, v, pe, **positions).shape == (B, h, N, dh)
                continue
            with pytest.raises(ValueError, match=f"{name}: q must be \\[\\.\\.\\., H(={heads})?, N, Dh(={head_dim})?\\], "
                                                 f"got \\({B}, {h}, {N}, {dh}\\)"):
                attention(q, k, v, pe, **positions)


# ---------------------------------------------------------------------------
# Argument checks: every flag a real bool, every numeric argument typed and ranged with a message
# naming the class and the argument, the constructor keywords, meta init == normal init bitwise
# ---------------------------------------------------------------------------


_HEINSEN_X = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(2))


# (owner in the message, call taking the flag as a keyword, flag name)
FLAG_ARGS = [
    ("RotaryPositionalEmbedding", lambda **kw: RotaryPositionalEmbedding(8, **kw), "interleaved"),
    ("t5_relative_position_bucket", lambda **kw: t5_relative_position_bucket(torch.arange(3), **kw), "bidirectional"),
    ("T5PositionalEmbedding", lambda **kw: T5PositionalEmbedding(2, **kw), "bidirectional"),
    ("ALiBiPositionalEmbedding", lambda **kw: ALiBiPositionalEmbedding(2, **kw), "bidirectional"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, **kw), "relative_bias"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, **kw), "cls_token"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, **kw), "bidirectional"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, relative_bias=False, **kw),
     "bidirectional"),
    ("EnformerPositionalEmbedding", lambda **kw: EnformerPositionalEmbedding(2, 4, num_features=6, length_scale=16,
                                                                             **kw), "symmetric"),
    ("XPosPositionalEmbedding", lambda **kw: XPosPositionalEmbedding(8, **kw), "interleaved"),
    ("KerplePositionalEmbedding", lambda **kw: KerplePositionalEmbedding(2, **kw), "bidirectional"),
    ("SandwichPositionalEmbedding", lambda **kw: SandwichPositionalEmbedding(2, 8, **kw), "bidirectional"),
    ("FIREPositionalEmbedding", lambda **kw: FIREPositionalEmbedding(2, hidden_dim=4, **kw), "bidirectional"),
    ("CoPEPositionalEmbedding", lambda **kw: CoPEPositionalEmbedding(2, 4, **kw), "per_head"),
    ("ShawPositionalEmbedding", lambda **kw: ShawPositionalEmbedding(2, 4, **kw), "key_query"),
    ("ShawPositionalEmbedding", lambda **kw: ShawPositionalEmbedding(2, 4, **kw), "values"),
    ("ShawPositionalEmbedding", lambda **kw: ShawPositionalEmbedding.from_bert(torch.zeros(5, 4), 2, **kw),
     "key_query"),
    ("DebertaPositionalEmbedding", lambda **kw: DebertaPositionalEmbedding(8, 2, max_relative_positions=8,
                                                                           position_buckets=4, **kw), "layer_norm"),
    ("DynamicPositionBias", lambda **kw: DynamicPositionBias(2, hidden_dim=4, **kw), "log_distance"),
    ("DynamicPositionBias", lambda **kw: DynamicPositionBias(2, hidden_dim=4, **kw), "norm"),
    ("ConvolutionalPositionalEmbedding", lambda **kw: ConvolutionalPositionalEmbedding(4, num_axes=1, **kw),
     "weight_norm"),
    ("HeinsenPositionalEmbedding", lambda **kw: HeinsenPositionalEmbedding(4, 2)(_HEINSEN_X, **kw),
     "using_prev_context"),
    ("HeinsenPositionalEmbedding", lambda **kw: HeinsenPositionalEmbedding(4, 2)(_HEINSEN_X, **kw), "return_state"),
    ("attention", lambda **kw: attention(*qkv(4, 4), **kw), "causal"),
]


# flags checked before the process group is looked for (a valid call needs torch.distributed)
SHARDED_FLAG_ARGS = [
    ("HeinsenPositionalEmbedding", lambda **kw: heinsen_forward_sharded(HeinsenPositionalEmbedding(4, 2), _HEINSEN_X,
                                                                        **kw), "using_prev_context"),
    ("HeinsenPositionalEmbedding", lambda **kw: heinsen_forward_sharded(HeinsenPositionalEmbedding(4, 2), _HEINSEN_X,
                                                                        **kw), "return_state"),
    ("sharded_log_linear_scan", lambda **kw: sharded_log_linear_scan(-torch.ones(3, 2), torch.ones(3, 2), **kw),
     "return_state"),
]


def _tiny_numeric(owner, make, name, value, error, want):
    return pytest.param(owner, make, name, value, error, want, id=f"{owner}-{name}-{value!r}")


# (owner, call taking the argument as a keyword, argument, bad value, error, what the message says)
# The message must read "<owner>: <argument> must <want>" (an entry "<argument>[i]" for a sequence), with
# the value in it; <want> starts with "be" unless given as a whole "must ..." phrase.
NUMERIC_ARGS = [_tiny_numeric(*row) for row in [
    ("EnformerPositionalEmbedding", lambda **kw: EnformerPositionalEmbedding(2, 4, num_features=6, length_scale=16,
                                                                             **kw),
     "min_half_life", "3", TypeError, "a real number, got str '3'"),
    ("EnformerPositionalEmbedding", lambda **kw: EnformerPositionalEmbedding(2, 4, length_scale=16, **kw),
     "num_features", 12.0, TypeError, "an int, got float 12.0"),
    ("EnformerPositionalEmbedding", lambda **kw: EnformerPositionalEmbedding(2, 4, num_features=6, **kw),
     "length_scale", "16", TypeError, "an int, got str '16'"),
    ("TransformerXLPositionalEmbedding", lambda **kw: TransformerXLPositionalEmbedding(2, 4, **kw),
     "d_model", "8", TypeError, "an int, got str '8'"),
    ("TransformerXLPositionalEmbedding", lambda **kw: TransformerXLPositionalEmbedding(2, 4, **kw),
     "clamp_len", 2.5, TypeError, "an int, got float 2.5"),
    ("TransformerXLPositionalEmbedding", lambda **kw: TransformerXLPositionalEmbedding(2, 4, **kw),
     "init_std", -1.0, ValueError, "a finite number >= 0.0, got init_std=-1.0"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, **kw),
     "init_std", "0.02", TypeError, "a real number, got str '0.02'"),
    ("UnifiedPositionalEmbedding", lambda **kw: UnifiedPositionalEmbedding(8, 2, 4, relative_bias=False, **kw),
     "num_buckets", 0, ValueError, "a positive int, got num_buckets=0"),
    ("CoPEPositionalEmbedding", lambda **kw: CoPEPositionalEmbedding(2, 4, **kw),
     "init_std", "0.1", TypeError, "a real number, got str '0.1'"),
    ("ForgettingPositionalEmbedding", lambda **kw: ForgettingPositionalEmbedding(8, 2, **kw),
     "init_std", None, TypeError, "a real number, got NoneType None"),
    ("ShawPositionalEmbedding", lambda **kw: ShawPositionalEmbedding(2, 4, **kw),
     "init_std", -0.5, ValueError, "a finite number >= 0.0, got init_std=-0.5"),
    ("DebertaPositionalEmbedding", lambda **kw: DebertaPositionalEmbedding(8, 2, **kw),
     "init_std", "0.02", TypeError, "a real number, got str '0.02'"),
    ("DebertaPositionalEmbedding", lambda **kw: DebertaPositionalEmbedding(8, 2, **kw),
     "layer_norm_eps", "1e-7", TypeError, "a real number, got str '1e-7'"),
    ("deberta_log_bucket", lambda **kw: deberta_log_bucket(torch.arange(3), **kw),
     "position_buckets", 1, ValueError, "an int >= 2, got position_buckets=1"),
    ("deberta_log_bucket", lambda **kw: deberta_log_bucket(torch.arange(3), position_buckets=8, **kw),
     "max_relative_positions", 5, ValueError, "must exceed position_buckets // 2 \\+ 1 = 5 .*got max_relative_positions=5"),
    ("deberta_log_bucket", lambda **kw: deberta_log_bucket(**kw),
     "relative_position", torch.zeros(3), TypeError, "an integer tensor, got a tensor of shape \\[3\\]"),
    ("AlgebraicTreePositionalEmbedding", lambda **kw: AlgebraicTreePositionalEmbedding(4, 2, 2, 3, **kw),
     "init_std", float("inf"), ValueError, "a finite number >= 0.0, got init_std=inf"),
    ("AlgebraicGridPositionalEmbedding", lambda **kw: AlgebraicGridPositionalEmbedding(8, 2, **kw),
     "base", "100", TypeError, "a real number, got str '100'"),
    ("RelativePositionBias2D", lambda **kw: RelativePositionBias2D(2, 3, **kw),
     "init_std", "0.02", TypeError, "a real number, got str '0.02'"),
    ("RelativePositionBias2D", lambda **kw: RelativePositionBias2D(2, 3, **kw),
     "num_prefix_tokens", -1, ValueError, "a non-negative int, got num_prefix_tokens=-1"),
    ("RelativePositionBias2D", lambda **kw: RelativePositionBias2D(2, **kw),
     "window_size", (3, 0), ValueError, "a positive int, got window_size\\[1\\]=0"),
    ("LieREPositionalEmbedding", lambda **kw: LieREPositionalEmbedding(8, 2, **kw),
     "block_size", "4", TypeError, "an int, got str '4'"),
    ("ConvolutionalPositionalEmbedding", lambda **kw: ConvolutionalPositionalEmbedding(4, **kw),
     "kernel_size", 0, ValueError, "a positive int, got kernel_size=0"),
    ("ConvolutionalPositionalEmbedding", lambda **kw: ConvolutionalPositionalEmbedding(4, **kw),
     "num_prefix_tokens", 1.5, TypeError, "an int, got float 1.5"),
    ("ConvolutionalPositionalEmbedding", lambda **kw: ConvolutionalPositionalEmbedding(4, **kw),
     "grid_shape", (2, 3, 4), ValueError, "a sequence of 2 positive ints, got grid_shape=\\(2, 3, 4\\)"),
    ("FourierFeaturePositionalEmbedding", lambda **kw: FourierFeaturePositionalEmbedding(1, 4, **kw),
     "seed", 1.5, TypeError, "an int, got float 1.5"),
    ("FourierFeaturePositionalEmbedding", lambda **kw: FourierFeaturePositionalEmbedding(1, 4, **kw),
     "scale", "1", TypeError, "a real number, got str '1'"),
    ("LearnableFourierPositionalEmbedding", lambda **kw: LearnableFourierPositionalEmbedding(2, 4, **kw),
     "fourier_dim", 5, ValueError, "a positive even int, got fourier_dim=5"),
    ("LearnableFourierPositionalEmbedding", lambda **kw: LearnableFourierPositionalEmbedding(2, 4, **kw),
     "init", "xavier", ValueError, "one of 'paper', 'port', got init='xavier'"),
    ("LearnableFourierPositionalEmbedding", lambda **kw: LearnableFourierPositionalEmbedding(2, 4, **kw),
     "gamma", -1.0, ValueError, "a finite number > 0.0, got gamma=-1.0"),
    ("Time2VecPositionalEmbedding", lambda **kw: Time2VecPositionalEmbedding(4, **kw),
     "activation", "tanh", ValueError, "one of 'sin', 'cos', got activation='tanh'"),
    ("Time2VecPositionalEmbedding", lambda **kw: Time2VecPositionalEmbedding(4, **kw),
     "num_axes", 0, ValueError, "a positive int, got num_axes=0"),
    ("LaplacianPositionalEmbedding", lambda **kw: LaplacianPositionalEmbedding(4, **kw),
     "k", 0, ValueError, "a positive int, got k=0"),
    ("LaplacianPositionalEmbedding", lambda **kw: LaplacianPositionalEmbedding(4, 2, **kw),
     "hidden_dim", 1.5, TypeError, "an int, got float 1.5"),
    ("RandomWalkPositionalEmbedding", lambda **kw: RandomWalkPositionalEmbedding(4, **kw),
     "walk_length", -2, ValueError, "a positive int, got walk_length=-2"),
    ("GraphormerPositionalEmbedding", lambda **kw: GraphormerPositionalEmbedding(4, **kw),
     "num_spatial", 2, ValueError, "an int >= 3, got num_spatial=2"),
    ("GraphormerPositionalEmbedding", lambda **kw: GraphormerPositionalEmbedding(4, **kw),
     "attend_within", 0, ValueError, "a positive int, got attend_within=0"),
    ("GraphormerPositionalEmbedding", lambda **kw: GraphormerPositionalEmbedding(4, **kw),
     "dim", 2.0, TypeError, "an int, got float 2.0"),
    ("AbacusPositionalEmbedding", lambda **kw: AbacusPositionalEmbedding(4, range(10), **kw),
     "max_k", -1, ValueError, "a non-negative int, got max_k=-1"),
    ("AbacusPositionalEmbedding", lambda **kw: AbacusPositionalEmbedding(4, range(10), **kw),
     "max_len", 0, ValueError, "a positive int, got max_len=0"),
    ("rope_coordinates", lambda **kw: rope_coordinates((2, 2), **kw),
     "shift", -1.0, ValueError, "a finite number >= 0.0, got shift=-1.0"),
    ("HeinsenPositionalEmbedding", lambda **kw: HeinsenPositionalEmbedding(4, **kw),
     "d_hid", 2.5, TypeError, "an int, got float 2.5"),
    ("permute_rotary_weight", lambda **kw: permute_rotary_weight(torch.zeros(8, 2), to="half_split", **kw),
     "head_dim", "4", TypeError, "an int, got str '4'"),
    ("permute_rotary_weight", lambda **kw: permute_rotary_weight(torch.zeros(8, 2), 4, to="half_split", **kw),
     "rotary_dim", 0, ValueError, "a positive int, got rotary_dim=0"),
    ("permute_rotary_weight", lambda **kw: permute_rotary_weight(torch.zeros(8, 2), 4, **kw),
     "to", "halfsplit", ValueError, "one of 'half_split', 'interleaved', got to='halfsplit'"),
    ("shard_positions", lambda **kw: shard_positions(8, 0, 2, **kw),
     "offset", 1.5, TypeError, "an int, got float 1.5"),
]]


# Builds taking sizes and reals, once with Python numbers and once with numpy's (given as
# `num`): both must give the same module (numpy ints and floats are accepted as such).
NUMPY_BUILDS = [
    lambda num: UnifiedPositionalEmbedding(num.int64(8), num.int32(2), num.int64(4), num_buckets=num.int64(8),
                                           max_distance=num.int64(12), init_std=num.float32(0.5)),
    lambda num: TransformerXLPositionalEmbedding(num.int64(2), num.int64(4), d_model=num.int64(6),
                                                 clamp_len=num.int64(5), init_std=num.float64(0.5)),
    lambda num: EnformerPositionalEmbedding(num.int64(2), num.int64(4), num_features=num.int64(6),
                                            length_scale=num.int64(16), min_half_life=num.float32(2.0)),
    lambda num: CoPEPositionalEmbedding(num.int64(2), num.int64(4), max_position=num.int64(4),
                                        init_std=num.float32(0.5)),
    lambda num: ForgettingPositionalEmbedding(num.int64(8), num.int64(2), init_std=num.float32(0.5)),
    lambda num: DebertaPositionalEmbedding(num.int64(8), num.int64(2), max_relative_positions=num.int64(8),
                                           position_buckets=num.int64(4), layer_norm_eps=num.float64(1e-5),
                                           init_std=num.float64(0.5)),
    lambda num: AlgebraicTreePositionalEmbedding(num.int64(4), num.int64(2), num.int64(2), num.int64(3),
                                                 init_std=num.float32(0.5)),
    lambda num: RelativePositionBias2D(num.int64(2), (num.int64(3), num.int32(2)), num_prefix_tokens=num.int64(1),
                                       init_std=num.float32(0.5)),
    lambda num: ConvolutionalPositionalEmbedding(num.int64(4), kernel_size=num.int64(3), num_axes=num.int64(1),
                                                 num_prefix_tokens=num.int64(1), groups=num.int64(2)),
    lambda num: FourierFeaturePositionalEmbedding(num.int64(1), num.int64(4), sampling="gaussian",
                                                  scale=num.float32(0.5), seed=num.int64(3)),
    lambda num: LearnableFourierPositionalEmbedding(num.int64(4), num.int64(6), fourier_dim=num.int64(4),
                                                    hidden_dim=num.int64(3), groups=num.int64(2),
                                                    gamma=num.float32(2.0)),
    lambda num: Time2VecPositionalEmbedding(num.int64(4), num_axes=num.int64(2)),
    lambda num: LaplacianPositionalEmbedding(num.int64(4), num.int64(3), sign_invariant=True, hidden_dim=num.int64(2)),
    lambda num: RandomWalkPositionalEmbedding(num.int64(4), num.int64(3)),
    lambda num: GraphormerPositionalEmbedding(num.int64(4), num_spatial=num.int64(8), attend_within=num.int32(3),
                                              dim=num.int64(6), num_degree=num.int64(5), init_std=num.float32(0.5)),
    lambda num: AbacusPositionalEmbedding(num.int64(4), [num.int64(d) for d in range(10)], max_len=num.int64(16),
                                          max_k=num.int32(3)),
    lambda num: LieREPositionalEmbedding(num.int64(8), num.int64(2), block_size=num.int64(4)),
    lambda num: HeinsenPositionalEmbedding(num.int64(4), num.int64(2)),
]


# Every property-test case, plus options whose parameters the cases do not cover.
META_CASES = [pytest.param(case.make, id=case.name) for case in CASES] + [
    pytest.param(lambda: UnifiedPositionalEmbedding(16, 2, 4, relative_bias=False), id="tupe_absolute_only"),
    pytest.param(lambda: EnformerPositionalEmbedding(2, 4, num_features=6, length_scale=16, symmetric=True),
                 id="enformer_symmetric"),
    pytest.param(lambda: MixedRotaryPositionalEmbedding(12, 2, 3), id="mixed_rope_three_axes"),
    pytest.param(lambda: ForgettingPositionalEmbedding(8, 2), id="forgetting_unbound"),
    pytest.param(lambda: ConvolutionalPositionalEmbedding(8, num_axes=3), id="conv_peg_3d"),
    pytest.param(lambda: DebertaPositionalEmbedding(8, 2, max_relative_positions=8, position_buckets=4,
                                                    pos_att_type="p2c"), id="deberta_p2c"),
]


# (class, keyword arguments): every class built for a head width takes it as head_dim=, every per-head
# class its head count as num_heads=; dim= is a token width (or Sandwich's sinusoid width).
KEYWORD_BUILDS = [
    (RotaryPositionalEmbedding, dict(head_dim=DH)),
    (XPosPositionalEmbedding, dict(head_dim=DH)),
    (QueryTemperaturePositionalEmbedding, dict(length=16.0, scale=0.5, shift=0)),   # keyword-only, no widths
    (AlgebraicSequencePositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (AlgebraicGridPositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (MixedRotaryPositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (LieREPositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (ComRoPEPositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (STRINGPositionalEmbedding, dict(head_dim=DH, num_heads=H)),
    (VideoRotaryPositionalEmbedding, dict(head_dim=DH)),
    (TransformerXLPositionalEmbedding, dict(num_heads=H, head_dim=DH)),
    (EnformerPositionalEmbedding, dict(num_heads=H, head_dim=DH)),
    (CoPEPositionalEmbedding, dict(num_heads=H, head_dim=DH)),
    (ShawPositionalEmbedding, dict(num_heads=H, head_dim=DH)),
    (DebertaPositionalEmbedding, dict(dim=D, num_heads=H)),
    (UnifiedPositionalEmbedding, dict(max_len=64, num_heads=H, head_dim=DH)),
    (T5PositionalEmbedding, dict(num_heads=H)),
    (ALiBiPositionalEmbedding, dict(num_heads=H)),
    (KerplePositionalEmbedding, dict(num_heads=H)),
    (SandwichPositionalEmbedding, dict(num_heads=H, dim=DH)),
    (FIREPositionalEmbedding, dict(num_heads=H)),
    (DynamicPositionBias, dict(num_heads=H)),
    (ForgettingPositionalEmbedding, dict(dim=D, num_heads=H)),
    (InklingPositionalEmbedding, dict(dim=D, num_heads=H)),
    (SinusoidalPositionalEmbedding, dict(dim=D)),
    (LearnedPositionalEmbedding, dict(max_len=64, dim=D)),
    (ConvolutionalPositionalEmbedding, dict(dim=D, num_axes=1)),
    (NoPositionalEmbedding, dict(dim=D)),
]


class TestArgumentChecks:
    @pytest.mark.parametrize("bad", ["false", 1, None], ids=["str", "int", "None"])
    @pytest.mark.parametrize("owner, make, name", [pytest.param(*row, id=f"{row[0]}-{row[2]}")
                                                   for row in FLAG_ARGS + SHARDED_FLAG_ARGS])
    def test_flags_must_be_real_bools(self, owner, make, name, bad):
        if (owner, name, bad) == ("attention", "causal", None):     # None: follow the encoding's own mode
            make(causal=None)
            return
        with pytest.raises(TypeError, match=f"^{owner}: {name} must be a bool, got {type(bad).__name__} {bad!r}$"):
            make(**{name: bad})

    @pytest.mark.parametrize("owner, make, name", [pytest.param(*row, id=f"{row[0]}-{row[2]}") for row in FLAG_ARGS])
    def test_numpy_bools_are_accepted_as_flags(self, owner, make, name):
        numpy = pytest.importorskip("numpy")
        make(**{name: numpy.bool_(False)})   # the same call with a bad flag is the TypeError above

    @pytest.mark.parametrize("owner, make, name, value, error, want", NUMERIC_ARGS)
    def test_numeric_arguments_are_typed_and_ranged(self, owner, make, name, value, error, want):
        want = want[len("must "):] if want.startswith("must ") else "be " + want
        with pytest.raises(error, match=f"^{owner}: {name}(\\[\\d+\\])? must {want}"):
            make(**{name: value})

    @pytest.mark.parametrize("build", NUMPY_BUILDS, ids=["tupe", "transformer_xl", "enformer", "cope", "forgetting",
                                                         "deberta", "algebraic_tree", "relpos2d", "conv", "fourier",
                                                         "learnable_fourier", "time2vec", "laplacian",
                                                         "random_walk", "graphormer", "abacus", "liere", "heinsen"])
    def test_numpy_numbers_build_the_same_module(self, build):
        numpy = pytest.importorskip("numpy")
        python = type("PythonNumbers", (), {"int64": int, "int32": int, "float32": float, "float64": float})
        torch.manual_seed(0)
        plain = build(python)
        torch.manual_seed(0)
        from_numpy = build(numpy)
        assert repr(from_numpy) == repr(plain)
        want, got = plain.state_dict(), from_numpy.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[key], got[key]) for key in want)
        stored = [(name, value) for name, value in vars(from_numpy).items()
                  for item in (value if isinstance(value, tuple) else (value,)) if isinstance(item, numpy.generic)]
        assert not stored, stored   # sizes are kept as Python ints

    @pytest.mark.parametrize("make", META_CASES)
    def test_meta_init_then_reset_equals_normal_init_bitwise(self, make):
        torch.manual_seed(0)
        normal = make()
        torch.manual_seed(0)
        with torch.device("meta"):
            meta = make()
        meta.to_empty(device="cpu")
        meta.reset_parameters()
        want = dict(normal.named_parameters()) | dict(normal.named_buffers())
        got = dict(meta.named_parameters()) | dict(meta.named_buffers())
        assert want.keys() == got.keys()
        differ = [name for name in want if want[name].dtype != got[name].dtype or not torch.equal(want[name], got[name])]
        assert not differ, differ

    @pytest.mark.parametrize("cls, kwargs", KEYWORD_BUILDS, ids=[cls.__name__ for cls, _ in KEYWORD_BUILDS])
    def test_constructor_keywords_read_the_same(self, cls, kwargs):
        pe = cls(**kwargs)
        assert kwargs
        for name, value in kwargs.items():
            assert getattr(pe, name) == value, name

    def test_num_heads_is_checked_once_for_every_class(self):
        """Issue 43: the shared ``_ARGUMENTS`` own ``num_heads``; every class that takes it, rebuilt from its demo
        entry's own attributes (as its repr reads them), refuses 0 with the shared message."""
        checked = []
        for pe in pe_lib._demo_modules(H, DH, 16).values():
            cls, parameters = type(pe), inspect.signature(type(pe).__init__).parameters
            if "num_heads" not in parameters:
                continue
            kwargs = {name: getattr(pe, name) for name in list(parameters)[1:] if hasattr(pe, name)}
            try:
                cls(**kwargs)
            except TypeError:   # a learned or derived attribute (ALiBi's slopes tensor, FIRE's init_L) is no argument
                continue
            with pytest.raises(ValueError, match=f"^{cls.__name__}: num_heads must be a positive int, got num_heads=0$"):
                cls(**{**kwargs, "num_heads": 0})
            checked.append(cls.__name__)
        assert len(set(checked)) >= 24, checked

    @pytest.mark.parametrize("cls", [RotaryPositionalEmbedding, XPosPositionalEmbedding])
    def test_head_dim_alias_of_dim(self, cls):
        torch.manual_seed(0)
        q, k, _ = qkv()
        torch.testing.assert_close(cls(head_dim=DH).forward_attn(q, k), cls(DH).forward_attn(q, k))
        assert cls(head_dim=DH).dim == DH
        name = cls.__name__
        with pytest.raises(TypeError, match=f"{name}: pass dim or head_dim, not both .* got dim=32 and head_dim=16"):
            cls(DH, head_dim=16)
        with pytest.raises(TypeError, match=f"{name}: pass dim or head_dim, not both"):
            cls(dim=DH, head_dim=DH)
        with pytest.raises(TypeError, match=f"{name}: missing the required argument dim \\(or its keyword alias head_dim\\)"):
            cls()


# ---------------------------------------------------------------------------
# Positions as a caller writes them: on another device, raw batched rows for a bias, float positions
# with gradients where a query and a key share a position (distance 0)
# ---------------------------------------------------------------------------


def _own_call_with_positions(pe, case, q, k, x, positions_q, positions_k):
    """The class's own forward, given explicit positions."""
    if pe.kind == "input":
        return pe(x, positions_q)
    if pe.kind == "bias":
        return pe(q.shape[-2], k.shape[-2], positions_q=positions_q, positions_k=positions_k)
    if pe.kind == "logits" or isinstance(case, PairCase):
        return pe(q, k, positions_q, positions_k)
    return pe(q, positions_q)


BIAS_CASES = [case for case in CASES if case.takes_positions and case.make().kind == "bias"]
QK_CASES = [case for case in CASES if case.make().kind == "qk"]


# Every class that takes float positions (the shared cases), plus options the cases leave out whose
# formula has its own behaviour at distance 0.
FLOAT_POSITION_CASES = [case for case in CASES if case.takes_positions] + [
    Case("alibi_2d", lambda: ALiBiPositionalEmbedding(H, bidirectional=True, num_axes=2),
         required_positions=grid_rc, has_offset=False),
    Case("kerple_power_causal", lambda: KerplePositionalEmbedding(H, kernel="power"), has_offset=False),
    Case("enformer_per_distance_symmetric", lambda: EnformerPositionalEmbedding(
        H, DH, num_features=6, length_scale=64, symmetric=True, gamma_normalization="per_distance"),
         has_offset=False),
    Case("fire_causal", lambda: FIREPositionalEmbedding(H, hidden_dim=8, init_L=4.0), has_offset=False),
    Case("sandwich_bidirectional", lambda: SandwichPositionalEmbedding(H, DH, bidirectional=True), has_offset=False),
    Case("dynamic_bias_log_2d", lambda: DynamicPositionBias(H, num_axes=2, hidden_dim=16, log_distance=True),
         required_positions=grid_rc, has_offset=False),
    Case("liere_full_2d", lambda: LieREPositionalEmbedding(8, H), required_positions=grid_rc, has_offset=False),
]


# Cases whose logits jump at distance 0 (a kink is fine, a jump has no derivative to compare with):
# causal ALiBi's -inf on keys after the query, Enformer's sign(d) features.
JUMP_AT_DISTANCE_0 = {"alibi", "enformer", "randomized_alibi"}


def _float_positions(case, n):
    """Distinct float64 positions (no distance a multiple of 1 but 0, so no step of a basis is
    crossed by a small perturbation): the case's own ones or ``arange(n)``, scaled by 1/sqrt(2)."""
    base = case.positions(n, n)[1]
    base = torch.arange(n) if base is None else base
    return base.double() / math.sqrt(2.0) + 0.3


def _position_loss(pe, case, inputs, weights):
    """A scalar function of the positions: logits (and attention output) of self-attention, or the
    encoded tokens of an input encoding."""
    finite = lambda t: torch.where(torch.isfinite(t), t, 0.0)                                   # noqa: E731
    if pe.kind == "input":
        x = inputs[0]
        return lambda pq, pk: (pe.forward_input(x, pq) * weights[0]).sum()
    q, k, v = inputs

    def loss(pq, pk):
        total = (finite(pe.forward_attn(q, k, pq, pk)) * weights[0]).sum()
        return total + (attention(q, k, v, pe, positions_q=pq, positions_k=pk) * weights[1]).sum()
    return loss


class TestPositions:
    @pytest.mark.parametrize("case", [case for case in CASES if case.takes_positions], ids=repr)
    def test_positions_on_another_device_raise_value_error(self, case):
        pe = case.make()
        q, k, v = qkv()
        x = tokens(case)
        positions_q, positions_k = case.positions(N, N)
        if positions_q is None:
            positions_q = positions_k = torch.arange(N)
        on_meta_q, on_meta_k = positions_q.to("meta"), positions_k.to("meta")
        name = type(pe).__name__
        calls = {
            "attention": (lambda: attention(q, k, v, pe, positions_q=positions_q, positions_k=on_meta_k), "positions_k"),
            "forward_attn": (lambda: pe.forward_attn(q, k, on_meta_q, positions_k), "positions_q"),
            "forward_input": (lambda: pe.forward_input(x, on_meta_k), "positions"),
            "forward": (lambda: _own_call_with_positions(pe, case, q, k, x, on_meta_q, positions_k),
                        "positions" if pe.kind == "input" else "positions_q"),
        }
        if pe.kind == "input":
            del calls["attention"]         # attention() refuses positions for input kinds (TestAttention)
        else:
            del calls["forward_input"]     # attention-side encodings leave the tokens alone
            if pe.kind == "qk" and not isinstance(case, PairCase):
                calls["forward"] = (calls["forward"][0], "positions")
        for entry, (call, argument) in calls.items():
            with pytest.raises(ValueError, match=f"{name}: {argument} must be on the device of the inputs \\(cpu\\), "
                                                 f"got {argument} on meta"):
                call()

    @pytest.mark.parametrize("case", BIAS_CASES, ids=repr)
    @pytest.mark.parametrize("batch", [H, 3, 1])
    def test_attention_bias_with_raw_batched_positions_is_per_batch(self, case, batch):
        """[B, N] positions give [B, H, Nq, Nk] (B == H used to broadcast batch against heads), each row the
        bias of that row's [N] positions; int32 positions equal int64 ones."""
        pe = case.make()
        n = 6
        base_q, base_k = case.positions(n, n)
        if base_q is None:
            base_q = base_k = torch.arange(n)
        rows_q = torch.stack([base_q.roll(b, 0) if not pe.integer_positions else base_q for b in range(batch)])
        rows_k = torch.stack([base_k + (0 if pe.integer_positions else b) for b in range(batch)])
        if isinstance(pe, (RelativePositionBias2D, ContinuousPositionBias)):   # token indices in the window
            rows_q = torch.stack([base_q.flip(0) if b % 2 else base_q for b in range(batch)])
        got = pe.attention_bias(n, n, rows_q, rows_k)
        assert got.shape == (batch, H, n, n)
        for b in range(batch):
            torch.testing.assert_close(got[b], pe.attention_bias(n, n, rows_q[b], rows_k[b]))
            torch.testing.assert_close(got[b], pe(n, n, positions_q=rows_q[b], positions_k=rows_k[b]))
        torch.testing.assert_close(pe.attention_bias(n, n, rows_q.int(), rows_k.int()), got)

    @pytest.mark.parametrize("case", QK_CASES, ids=repr)
    def test_encode_qk_takes_forward_batched_positions(self, case):
        """encode_qk given ``[B, N(, A)]`` positions, as ``forward`` takes them, equals one call per row with that
        row's ``[N(, A)]`` (it wanted ``[B, 1, N]``: torch's broadcasting error, and B == H paired batch rows
        with heads silently); the ``[B, 1, N]`` that attention() passes gives the same; a wrong length raises."""
        pe = case.make()
        q, k = torch.randn(H, H, N, DH), torch.randn(H, H, N, DH)                        # B == H
        base_q, base_k = case.positions(N, N)
        if base_q is None:
            base_q = base_k = torch.arange(N)
        rows_q = torch.stack([base_q.flip(0) if b % 2 else base_q for b in range(H)])   # [B, N(, A)]
        rows_k = torch.stack([base_k.flip(0) if b % 2 else base_k for b in range(H)])
        got = pe.encode_qk(q, k, rows_q, rows_k)
        for b in range(H):
            want = pe.encode_qk(q[b : b + 1], k[b : b + 1], rows_q[b], rows_k[b])
            for side in range(2):
                torch.testing.assert_close(got[side][b : b + 1], want[side])
        for side, again in enumerate(pe.encode_qk(q, k, rows_q.unsqueeze(1), rows_k.unsqueeze(1))):   # [B, 1, N]
            torch.testing.assert_close(again, got[side])
        with pytest.raises(ValueError, match=f"{type(pe).__name__}: positions_k must have shape"):
            pe.encode_qk(q, k, rows_q, rows_k[:, :-1])

    @pytest.mark.parametrize("case", BIAS_CASES, ids=repr)
    def test_attention_bias_with_wrong_positions_raises(self, case):
        pe = case.make()
        n = 6
        base_q, base_k = case.positions(n, n)
        if base_q is None:
            base_q = base_k = torch.arange(n)
        name = type(pe).__name__
        with pytest.raises(ValueError, match=f"{name}: positions_k must have shape"):
            pe.attention_bias(n, n, base_q, base_k[:-1])
        with pytest.raises(ValueError, match=f"{name}: positions_q and positions_k must have the same batch size"):
            pe.attention_bias(n, n, torch.stack([base_q] * 2), torch.stack([base_k] * 3))

    # float positions: n tokens, checked against central differences
    n = 6

    def float_position_setup(self, case):
        pe = case.make().double()
        if pe.integer_positions:
            pytest.skip("integer positions only")
        n, dh = self.n, getattr(pe, "head_dim", None) or DH
        if pe.kind == "input":
            inputs = (torch.randn(1, n, case.token_dim, dtype=torch.float64),)
            weights = (torch.randn(1, n, case.token_dim, dtype=torch.float64),)
        else:
            inputs = tuple(torch.randn(1, H, n, dh, dtype=torch.float64) for _ in range(3))
            weights = (torch.randn(1, H, n, n, dtype=torch.float64), torch.randn(1, H, n, dh, dtype=torch.float64))
        # ALiBi's and Sandwich's biases are float32 whatever the module's dtype: difference them coarsely
        coarse = pe.kind == "bias" and pe.attention_bias(2, 2, *case.positions(2, 2)).dtype == torch.float32
        self.step, self.rel = (1e-3, 1e-3) if coarse else (1e-6, 1e-5)
        return pe, _position_loss(pe, case, inputs, weights), _float_positions(case, n)

    @staticmethod
    def grads(value, tensors):
        """Gradients of ``value`` to ``tensors``; zeros for a tensor it does not depend on (NoPE)."""
        if not value.requires_grad:
            return [torch.zeros_like(t) for t in tensors]
        grads = torch.autograd.grad(value, tensors, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]

    @pytest.mark.parametrize("case", FLOAT_POSITION_CASES, ids=repr)
    def test_shared_positions_gradient_is_finite_and_matches_central_differences(self, case):
        """Self-attention (one tensor for queries and keys): every diagonal pair sits at distance 0."""
        pe, loss, p = self.float_position_setup(case)
        p = p.requires_grad_()
        (grad,) = self.grads(loss(p, p), [p])
        assert torch.isfinite(grad).all(), grad
        direction = torch.randn_like(p)
        step = self.step
        with torch.no_grad():
            numeric = (loss(p + step * direction, p + step * direction)
                       - loss(p - step * direction, p - step * direction)) / (2 * step)
        assert (grad * direction).sum().item() == pytest.approx(numeric.item(), rel=self.rel, abs=self.rel / 10)

    @pytest.mark.parametrize("case", FLOAT_POSITION_CASES, ids=repr)
    def test_separate_positions_gradient_is_finite_and_a_one_sided_bound(self, case):
        """Queries and keys as two tensors with equal values: distance 0 is a kink for |d| kernels.
        The gradient of one query position must be finite and lie between the two one-sided
        difference quotients (equal to both where the function is differentiable there)."""
        pe, loss, p = self.float_position_setup(case)
        pq, pk = p.clone().requires_grad_(), p.clone().requires_grad_()
        grad_q, grad_k = self.grads(loss(pq, pk), [pq, pk])   # input kinds take one tensor: grad_k is 0
        assert torch.isfinite(grad_q).all() and torch.isfinite(grad_k).all(), (grad_q, grad_k)
        if case.name in JUMP_AT_DISTANCE_0:
            return
        i, step = self.n // 2, self.step
        direction = torch.zeros_like(p)
        direction[i] = 1.0
        with torch.no_grad():
            middle = loss(pq, pk).item()
            right = (loss(pq + step * direction, pk).item() - middle) / step
            left = (middle - loss(pq - step * direction, pk).item()) / step
        slope = (grad_q * direction).sum().item()
        tolerance = self.rel * 10 * (1 + abs(slope))
        assert min(left, right) - tolerance <= slope <= max(left, right) + tolerance, (left, slope, right)


# ---------------------------------------------------------------------------
# attention(): masks, alignment, grouped-query heads, the causal rule
# ---------------------------------------------------------------------------


def _attention_kwargs(case, n):
    positions_q, positions_k = case.positions(n, n)
    return {"positions_q": positions_q, "positions_k": positions_k}


class TestAttention:
    def test_no_encoding_equals_sdpa(self):
        q, k, v = qkv()
        torch.testing.assert_close(attention(q, k, v), F.scaled_dot_product_attention(q, k, v))

    @pytest.mark.parametrize("case", [c for c in CASES if c.make().kind == "input"] + [None],
                             ids=lambda c: "none" if c is None else c.name)
    def test_positions_with_no_or_an_input_encoding_raise(self, case):
        """Issue 41: sinusoidal, learned, ... silently ignored them, Heinsen and the PEG raised: now all raise."""
        pe = None if case is None else case.make()
        q, k, v = qkv()
        name = "no encoding is given" if pe is None else f"{type(pe).__name__} is added to the tokens"
        for given in ({"positions_q": torch.arange(N)}, {"positions_k": torch.arange(N)}):
            with pytest.raises(ValueError, match=f"^attention: {next(iter(given))} must be None: {name}"):
                attention(q, k, v, pe, causal=True, **given)

    def test_causal_is_bottom_right_when_fewer_queries(self):
        q, k, v = qkv(N, N, dtype=torch.float64)
        full = attention(q, k, v, causal=True)
        tail = attention(q[..., -3:, :], k, v, causal=True)
        torch.testing.assert_close(tail, full[..., -3:, :])

    def test_causal_with_more_queries_than_keys_is_top_left(self):
        q, k, v = qkv(6, 4, dtype=torch.float64)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(DH)
        allowed = torch.tensor([[j <= i for j in range(4)] for i in range(6)])
        want = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v
        torch.testing.assert_close(attention(q, k, v, causal=True), want)

    # one case per attention() path: plain SDPA (an input kind), q/k transforms, a bias (dense and
    # FlexAttention), explicit logits
    SINK_CASES = ("sinusoidal", "rotary", "rotary_yarn", "alibi", "t5_causal", "kerple_log", "transformer_xl", "cope")

    @staticmethod
    def sink_oracle(logits, v, sinks, allowed):
        """float64 loop: each query's softmax over its allowed logits and one more term, ``sinks[h]``,
        whose value is 0; ``allowed`` ``[Nq, Nk]`` bool."""
        batch, heads, q_len, k_len = logits.shape
        group = heads // v.shape[1]
        out = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float64)
        for b, h, i in itertools.product(range(batch), range(heads), range(q_len)):
            terms = [(logits[b, h, i, j].item(), v[b, h // group, j]) for j in range(k_len)
                     if allowed[i, j] and logits[b, h, i, j] > -math.inf]
            top = max([t for t, _ in terms] + [sinks[h].item()])
            total = sum(math.exp(t - top) for t, _ in terms) + math.exp(sinks[h].item() - top)
            for t, value in terms:
                out[b, h, i] += math.exp(t - top) / total * value
        return out

    @pytest.mark.parametrize("name", SINK_CASES)
    def test_sinks_equal_a_float64_softmax_with_one_more_term(self, name):
        """Issue 41: learned per-head sink logits (gpt-oss), on every path, causal and not, fewer queries
        than keys, against the loop above on the encoding's own logits."""
        case = next(c for c in CASES if c.name == name)
        pe = case.make().double()
        q, k, v = qkv(N - 3, N, dtype=torch.float64)
        sinks = torch.randn(H, dtype=torch.float64) * 2
        input_kind = pe.kind == "input"
        logits = q @ k.transpose(-1, -2) / math.sqrt(DH) if input_kind else case.attn(pe, q, k)
        given = attention_positions(pe, case.positions(N - 3, N))
        paths = [{}] + ([{"use_flex": True}, {"use_flex": False}] if pe.kind == "bias" else [])
        for causal, path in itertools.product((True, False), paths):
            if not causal and pe.is_causal:
                continue
            allowed = torch.ones(N - 3, N, dtype=torch.bool)
            allowed = allowed.tril(diagonal=3) if causal else allowed
            got = attention(q, k, v, pe, causal=causal, sinks=sinks, **given, **path)
            torch.testing.assert_close(got, self.sink_oracle(logits, v, sinks, allowed), msg=f"{causal} {path}")

    @pytest.mark.parametrize("name", ["none", "rotary", "alibi"])
    def test_sinks_with_grouped_heads_documents_and_a_mask(self, name):
        """GQA (2 query heads per key head), packed documents and a boolean mask that hides every key
        from one query: that query gets 0 (all its softmax on the sink), as the oracle says."""
        pe = None if name == "none" else next(c for c in CASES if c.name == name).make().double()
        q, _, _ = qkv(dtype=torch.float64)
        _, k, v = (t[:, : H // 2] for t in qkv(dtype=torch.float64))
        sinks = torch.randn(H, dtype=torch.float64)
        ids = torch.tensor([0] * 6 + [1] * (N - 6))
        mask = torch.rand(N, N) > 0.3
        mask[9] = False
        allowed = mask & (ids[:, None] == ids[None]) & torch.ones(N, N, dtype=torch.bool).tril()
        logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(DH)
        if pe is not None and pe.kind == "bias":
            logits = logits + pe.attention_bias(N, N, document_positions(ids), document_positions(ids))
        elif pe is not None:
            positions = document_positions(ids)
            rotated_q, rotated_k = pe.encode_qk(q, k.repeat_interleave(2, 1), positions, positions)
            logits = rotated_q @ rotated_k.transpose(-1, -2) / math.sqrt(DH)
        want = self.sink_oracle(logits, v, sinks, allowed)
        for path in ([{}, {"use_flex": True}] if name == "alibi" else [{}]):
            got = attention(q, k, v, pe, causal=True, attn_mask=mask, document_ids=ids, sinks=sinks, **path)
            torch.testing.assert_close(got, want, msg=str(path))
            assert got[:, :, 9].abs().max() == 0

    def test_sinks_on_the_dense_bias_in_query_blocks(self, monkeypatch):
        """Without gradient a large dense bias runs a block of queries at a time: each block's mask gets its
        own sink column, and the output is the whole bias's."""
        pe = T5PositionalEmbedding(H, bidirectional=False).double()
        q, k, v = qkv(dtype=torch.float64)
        sinks = torch.randn(H, dtype=torch.float64)
        with torch.no_grad():
            want = attention(q, k, v, pe, sinks=sinks, use_flex=False)
            monkeypatch.setattr(pe_lib, "_DENSE_BIAS_BUDGET", H * N * 4 * 3)               # 3 float32 rows a block
            assert pe_lib._bias_chunk_rows(pe, q, k, v, None, None) == 3
            torch.testing.assert_close(attention(q, k, v, pe, sinks=sinks, use_flex=False), want)

    @pytest.mark.parametrize("name", ["none", "alibi", "transformer_xl"])
    def test_sink_gradients_pass_gradcheck(self, name):
        """The sinks' and the queries' gradients on the SDPA path (a zero key) and the logits path (a column)."""
        pe = None if name == "none" else next(c for c in CASES if c.name == name).make().double()
        q, k, v = (t[:1, :, :5] for t in qkv(dtype=torch.float64))
        q, sinks = q.requires_grad_(), torch.randn(H, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda q, s: attention(q, k, v, pe, causal=True, sinks=s), (q, sinks))

    def test_sinks_equal_gpt_oss_attention_layers(self):
        """transformers 5.24's GPT-OSS (eager: its logits, the sink column, softmax, the column dropped): every
        layer's attention (sliding and full, 2 query heads per key head) from the layer's own rotated q, k, v,
        mask and learned sinks."""
        transformers = pytest.importorskip("transformers")
        modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
        torch.manual_seed(0)
        config = transformers.GptOssConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
        model = modeling.GptOssModel(config).eval()
        for layer in model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 2.0)
        calls, eager = [], modeling.eager_attention_forward

        def eager_spy(module, query, key, value, attention_mask, *args, **kwargs):
            out = eager(module, query, key, value, attention_mask, *args, **kwargs)
            calls.append((module, query, key, value, attention_mask, out[0]))
            return out

        modeling.eager_attention_forward = eager_spy
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(0, 64, (2, 9)), use_cache=False)
        finally:
            modeling.eager_attention_forward = eager
        assert len(calls) == 2
        for module, query, key, value, mask, theirs in calls:
            ours = attention(query, key, value, attn_mask=mask, scale=module.scaling, sinks=module.sinks)
            family = f"gpt_oss {module.layer_type} attention with sinks"
            MAX_DIFF[family] = (ours.transpose(1, 2) - theirs).abs().max().item()
            assert MAX_DIFF[family] < 1e-6, family
            without = attention(query, key, value, attn_mask=mask, scale=module.scaling)
            assert (without.transpose(1, 2) - theirs).abs().max() > 1e-2   # the sinks matter here

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    @pytest.mark.parametrize("name", ["t5_causal", "alibi", "rotary"])
    def test_cuda_sinks_outputs_and_gradients_equal_the_cpu(self, name):
        """FlexAttention's backward through its log-sum-exp (bias kinds on CUDA), and the zero key on the SDPA
        path: output and gradients (q, k, v, the sinks, a learned table) against the CPU's dense path, float32."""
        pe = next(c for c in CASES if c.name == name).make()
        q, k, v = qkv()
        sinks = torch.randn(H)

        def run(device, use_flex):
            module = copy.deepcopy(pe).to(device)
            leaves = [t.to(device).requires_grad_() for t in (q, k, v, sinks)] + list(module.parameters())
            flex = {} if module.kind != "bias" else {"use_flex": use_flex}
            out = attention(*leaves[:3], module, causal=True, sinks=leaves[3], **flex)
            out.square().sum().backward()
            return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]

        for got, want in zip(run("cuda", True), run("cpu", False)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    @pytest.mark.skipif(not pe_lib._FLEX_TRACES, reason="dynamo traces create_block_mask from torch 2.7")
    def test_sinks_compile_fullgraph_on_the_flex_path(self):
        pe = ALiBiPositionalEmbedding(H)
        q, k, v = qkv()
        sinks = torch.randn(H)
        call = lambda q, k, v, s: attention(q, k, v, pe, sinks=s, use_flex=True)
        torch._dynamo.reset()
        compiled = torch.compile(call, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v, sinks), attention(q, k, v, pe, sinks=sinks, use_flex=False))

    def test_bad_sinks_raise(self):
        q, k, v = qkv()
        for sinks, error, says in [
            ([0.0] * H, TypeError, "sinks must be a torch.Tensor, got list"),
            (torch.zeros(H, dtype=torch.long), TypeError, "sinks must be a floating tensor, got dtype=torch.int64"),
            (torch.zeros(H + 1), ValueError, rf"sinks must have shape \[H\] = \({H},\), one logit per query head, "
                                             rf"got shape \({H + 1},\)"),
            (torch.zeros(1, H), ValueError, r"sinks must have shape \[H\] = \(4,\), .*got shape \(1, 4\)"),
            (torch.zeros(H, device="meta"), ValueError, r"sinks must be on q's device \(cpu\), got sinks on meta"),
            (torch.tensor([0.0, math.nan, 0.0, 0.0]), ValueError, r"sinks must be finite, got \[nan\]"),
        ]:
            with pytest.raises(error, match="^attention: " + says):
                attention(q, k, v, sinks=sinks)
        with pytest.raises(ValueError, match=r"^attention: sinks need q with a head axis, \[\.\.\., H, Nq, Dh\], "
                                             r"got q of shape \(16, 32\)"):
            attention(q[0, 0], k[0, 0], v[0, 0], sinks=torch.zeros(1))
        with pytest.raises(ValueError, match="^attention: sinks need softmax attention weights; "
                                             "StickBreakingPositionalEmbedding replaces the softmax"):
            attention(q, k, v, StickBreakingPositionalEmbedding(), causal=True, sinks=torch.zeros(H))

    def test_boolean_and_float_masks(self):
        q, k, v = qkv(dtype=torch.float64)
        keep = torch.rand(N, N) > 0.3
        keep[:, 0] = True
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(DH)
        want = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ v
        torch.testing.assert_close(attention(q, k, v, attn_mask=keep), want)
        additive = torch.randn(N, N, dtype=torch.float64)
        want = torch.softmax(logits + additive, -1) @ v
        torch.testing.assert_close(attention(q, k, v, attn_mask=additive), want)

    def test_integer_and_misshaped_masks_are_rejected(self):
        q, k, v = qkv()
        with pytest.raises(TypeError, match="attention: attn_mask must be a bool .* or float .* tensor, got torch.int64"):
            attention(q, k, v, attn_mask=torch.ones(N, N, dtype=torch.long))
        with pytest.raises(ValueError, match="attention: attn_mask must broadcast to \\[2, 4, 16, 16\\], got \\[3, 16\\]"):
            attention(q, k, v, attn_mask=torch.ones(3, N, dtype=torch.bool))

    def test_fully_masked_rows_give_zeros_for_every_kind(self):
        q, k, v = qkv()
        keep = torch.ones(N, N, dtype=torch.bool)
        keep[3] = False
        for pe in (None, TransformerXLPositionalEmbedding(H, DH), T5PositionalEmbedding(H)):
            out = attention(q, k, v, pe, attn_mask=keep)
            assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all()

    def test_logits_kinds_softmax_in_float32(self):
        xl = TransformerXLPositionalEmbedding(H, DH)
        q, k, v = qkv(64, 64)
        want = attention(q.double(), k.double(), v.double(), copy.deepcopy(xl).double())
        got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), xl)
        assert (got.double() - want).abs().max() < 0.05

    def test_custom_scale(self):
        q, k, v = qkv(dtype=torch.float64)
        want = torch.softmax(0.3 * q @ k.transpose(-1, -2), -1) @ v
        torch.testing.assert_close(attention(q, k, v, scale=0.3), want)

    def test_bad_inputs(self):
        q, k, v = qkv()
        with pytest.raises(ValueError, match="attention: v"):
            attention(q, k, v[..., :-1, :])
        with pytest.raises(TypeError, match="attention: pe"):
            attention(q, k, v, pe="rope")
        with pytest.raises(TypeError, match="attention: q"):
            attention(q.long(), k, v)

    @pytest.mark.parametrize("case", [c for c in CASES if c.make().kind != "input"], ids=repr)
    def test_grouped_query_attention_equals_repeated_kv(self, case):
        """k, v with H / 2 heads give what the same k, v repeated per query head give."""
        pe = case.make()
        q = torch.randn(B, H, N, DH)
        k, v = torch.randn(B, H // 2, N, DH), torch.randn(B, H // 2, N, DH)
        kwargs = _attention_kwargs(case, N)
        want = attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), pe, causal=True, **kwargs)
        torch.testing.assert_close(attention(q, k, v, pe, causal=True, **kwargs), want)

    def test_grouped_query_attention_checks_head_counts(self):
        q, k = torch.randn(B, 4, N, DH), torch.randn(B, 3, N, DH)
        with pytest.raises(ValueError, match="attention: k and v must have as many heads as q or divide them"):
            attention(q, k, k)

    BLOCKED = {"t5": lambda: T5PositionalEmbedding(H, bidirectional=False),
               "alibi": lambda: ALiBiPositionalEmbedding(H),
               "fire": lambda: FIREPositionalEmbedding(H, hidden_dim=4),
               "dpb": lambda: DynamicPositionBias(H, hidden_dim=8),
               "tupe": lambda: UnifiedPositionalEmbedding(64, H, DH, cls_token=True),
               "swin": lambda: RelativePositionBias2D(H, (4, 5))}

    @pytest.mark.parametrize("name", list(BLOCKED))
    def test_dense_bias_in_query_blocks_equals_the_whole(self, name, monkeypatch):
        """Issue 42.4: without gradient a large dense bias is built and used one block of queries at a time
        (here blocks of 3 rows, 2 with batched positions); every output equals the whole bias's."""
        pe = self.BLOCKED[name]()
        q, k, v = qkv()
        positions = torch.stack([torch.arange(N) * 2 % 20, torch.arange(N) + 3])
        calls = [dict(causal=pe.is_causal or None), dict(attn_mask=torch.rand(B, 1, N, N) > 0.3, causal=True),
                 dict(attn_mask=torch.randn(N, N)), dict(document_ids=torch.tensor([0] * 5 + [1] * 7 + [2] * 4)),
                 dict(positions_q=positions, positions_k=positions), dict(q=q[..., 5:, :], causal=True),
                 dict(k=k[:, :2], v=v[:, :2])]
        for call in calls:
            call = {"q": q, "k": k, "v": v, **call}
            if pe.is_causal and call.get("causal") is False or name == "swin" and "positions_q" in call:
                continue
            with torch.no_grad():
                want = attention(pe=pe, use_flex=False, **call)
                monkeypatch.setattr(pe_lib, "_DENSE_BIAS_BUDGET", 3 * H * N * 4 * 2 + 1)
                got = attention(pe=pe, use_flex=False, **call)
                monkeypatch.undo()
            torch.testing.assert_close(got, want)
        calls_made = []
        monkeypatch.setattr(pe_lib, "_DENSE_BIAS_BUDGET", 3 * H * N * 4)
        monkeypatch.setattr(pe_lib, "_sdpa", lambda *args, **kwargs: calls_made.append(args[0].shape[-2]) or
                            F.scaled_dot_product_attention(*args, **kwargs))
        with torch.no_grad():
            attention(q, k, v, pe, use_flex=False)
        assert calls_made == [3, 3, 3, 3, 3, 1]                                         # the blocks were used

    def test_dense_bias_memory_is_bounded_without_grad(self, monkeypatch):
        """Issue 42.4: T5's dense bias at 1024 tokens is 16 MiB; with a 1 MiB block budget the call holds a few
        blocks of it (T5 at 32768 tokens asked for 32 GiB; bench.py bias_paths measures it). With gradient the
        whole bias is kept (the backward needs it)."""
        pe, n = T5PositionalEmbedding(H, bidirectional=False), 1024
        q, k, v = (torch.randn(1, H, n, DH) for _ in range(3))
        monkeypatch.setattr(pe_lib, "_DENSE_BIAS_BUDGET", 2**20)
        with torch.no_grad():
            assert peak_bytes(lambda: attention(q, k, v, pe)) < 6 * 2**20
        assert peak_bytes(lambda: attention(q, k, v, pe)) > 16 * 2**20


CAUSAL_MODE_EXTRA = {
    "fire_causal": lambda: FIREPositionalEmbedding(H, hidden_dim=8, init_L=4.0),
    "kerple_power_causal": lambda: KerplePositionalEmbedding(H, kernel="power"),
    "tupe_causal": lambda: UnifiedPositionalEmbedding(64, H, DH, bidirectional=False, num_buckets=8, max_distance=12),
}


# the causal-mode cases, read from their constructors: bidirectional=False (or a decoder config), or causal by
# construction (CoPE, the forget gate)
CAUSAL_MODE_CASES = {"t5_causal", "alibi", "kerple_log", "sandwich", "cope", "cope_per_head", "forgetting", "rerope_leaky",
                     "t5_from_decoder_config", "self_extend", "self_extend_code_shift", "dual_chunk",
                     "dual_chunk_interleaved", "randomized_alibi",
                     "stick_breaking", "stick_breaking_current", "path", "path_fox_gqa"}


class TestCausalRule:
    @pytest.mark.parametrize("case", CASES, ids=repr)
    def test_is_causal_attribute(self, case):
        assert case.make().is_causal is (case.name in CAUSAL_MODE_CASES)

    @pytest.mark.parametrize("name", sorted(CAUSAL_MODE_CASES | set(CAUSAL_MODE_EXTRA)))
    def test_last_token_does_not_move_token_zero_by_default(self, name):
        """Issue 22.11: a causal-mode encoding masks the future under attention()'s default call."""
        pe = CAUSAL_MODE_EXTRA[name]() if name in CAUSAL_MODE_EXTRA else next(c for c in CASES if c.name == name).make()
        assert pe.is_causal
        q, k, v = qkv(dtype=torch.float64)
        pe = pe.double()
        out = attention(q, k, v, pe)
        q2, k2, v2 = (t.clone() for t in (q, k, v))
        for t in (q2, k2, v2):
            t[..., -1, :] += 5.0                                         # change the last token only
        moved = attention(q2, k2, v2, pe)
        torch.testing.assert_close(moved[..., 0, :], out[..., 0, :], rtol=0, atol=1e-12)
        assert not torch.allclose(moved[..., -1, :], out[..., -1, :])   # the change does reach the last token
        torch.testing.assert_close(out, attention(q, k, v, pe, causal=True))

    @pytest.mark.parametrize("name", sorted(CAUSAL_MODE_CASES | set(CAUSAL_MODE_EXTRA)))
    def test_explicit_non_causal_call_is_rejected(self, name):
        pe = CAUSAL_MODE_EXTRA[name]() if name in CAUSAL_MODE_EXTRA else next(c for c in CASES if c.name == name).make()
        q, k, v = qkv()
        with pytest.raises(ValueError, match=f"attention: causal=False with {type(pe).__name__}, a causal-mode "
                                             f"encoding .*pass causal=True or leave causal unset"):
            attention(q, k, v, pe, causal=False)

    def test_bidirectional_encodings_stay_bidirectional_by_default(self):
        q, k, v = qkv()
        for pe in (None, RotaryPositionalEmbedding(DH), T5PositionalEmbedding(H),
                   ALiBiPositionalEmbedding(H, bidirectional=True), FIREPositionalEmbedding(H, bidirectional=True)):
            torch.testing.assert_close(attention(q, k, v, pe), attention(q, k, v, pe, causal=False))

    def test_causal_must_be_a_bool_or_none(self):
        q, k, v = qkv()
        with pytest.raises(TypeError, match="attention: causal must be a bool, got str"):
            attention(q, k, v, causal="yes")


# ---------------------------------------------------------------------------
# Packed documents: document_ids on the dense and the FlexAttention path
# ---------------------------------------------------------------------------


class TestPackedDocuments:
    """``document_ids``: each document attends alone, on the dense path and on FlexAttention's."""
    @pytest.mark.parametrize("case", [c for c in CASES if c.make().kind != "input" and c.required_positions is None
                                      and c.make().takes_positions], ids=repr)
    def test_packed_documents_equal_each_document_alone(self, case):
        """Oracle: each document run alone with its own default positions."""
        pe = case.make()
        q, k, v = qkv()
        ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
        got = attention(q, k, v, pe, causal=True, document_ids=ids)
        start = 0
        for length in (5, 7, 4):
            piece = slice(start, start + length)
            want = attention(q[..., piece, :], k[..., piece, :], v[..., piece, :], pe, causal=True)
            torch.testing.assert_close(got[..., piece, :], want)
            start += length

    def test_packed_documents_batched_ids_and_positions(self):
        ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
        assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
        pe = ALiBiPositionalEmbedding(H)
        q, k, v = qkv(6, 6)
        got = attention(q, k, v, pe, causal=True, document_ids=ids)
        for row in range(2):
            for doc in ids[row].unique():
                keep = ids[row] == doc
                want = attention(q[row:row + 1, :, keep], k[row:row + 1, :, keep], v[row:row + 1, :, keep], pe, causal=True)
                torch.testing.assert_close(got[row:row + 1, :, keep], want)
        with pytest.raises(TypeError, match="attention: document_ids must be an integer tensor"):
            attention(q, k, v, pe, document_ids=torch.zeros(6))

    BIAS_MAKERS = {
        "t5": lambda: T5PositionalEmbedding(H, num_buckets=8, max_distance=12),
        "alibi": lambda: ALiBiPositionalEmbedding(H),
        "alibi_bidirectional": lambda: ALiBiPositionalEmbedding(H, bidirectional=True),
        "tupe": lambda: UnifiedPositionalEmbedding(32, H, DH, cls_token=True, num_buckets=8, max_distance=12),
        "kerple": lambda: KerplePositionalEmbedding(H),
        "fire": lambda: FIREPositionalEmbedding(H),
        "sandwich": lambda: SandwichPositionalEmbedding(H, 16),
        "dynamic": lambda: DynamicPositionBias(H),
    }

    QUICK = {"t5", "alibi"}                                                # FlexAttention by default; all: PE_SLOW=1
    LENGTHS = (5, 7, 4)                                                    # [N] ids: three documents, N = 16

    ROWS = ([3, 9, 4], [10, 6])                                            # [B, N] ids: other boundaries per row

    @staticmethod
    def ids_of(lengths):
        return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])

    @staticmethod
    def pieces(lengths):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return [slice(s, s + n) for s, n in zip(starts, lengths)]

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("name", quick_or_slow(list(BIAS_MAKERS), QUICK, sample={"fire", "kerple"}))
    def test_flex_documents_equal_dense_and_each_document_alone(self, name, causal):
        pe = self.BIAS_MAKERS[name]()
        q, k, v = qkv()
        ids = self.ids_of(self.LENGTHS)
        got = attention(q, k, v, pe, causal=causal or None, document_ids=ids, use_flex=True)
        torch.testing.assert_close(got, attention(q, k, v, pe, causal=causal or None, document_ids=ids, use_flex=False))
        for piece in self.pieces(self.LENGTHS):  # oracle: the document alone, default positions from 0
            alone = attention(q[..., piece, :], k[..., piece, :], v[..., piece, :], pe, causal=causal or None, use_flex=False)
            torch.testing.assert_close(got[..., piece, :], alone)
        batched = torch.stack([self.ids_of(r) for r in self.ROWS])                          # [B, N]
        got = attention(q, k, v, pe, causal=causal or None, document_ids=batched, use_flex=True)
        torch.testing.assert_close(got, attention(q, k, v, pe, causal=causal or None, document_ids=batched, use_flex=False))
        for row, lengths in enumerate(self.ROWS):
            for piece in self.pieces(lengths):
                alone = attention(q[row:row + 1, :, piece], k[row:row + 1, :, piece], v[row:row + 1, :, piece], pe,
                                  causal=causal or None, use_flex=False)
                torch.testing.assert_close(got[row:row + 1, :, piece], alone)

    @pytest.mark.parametrize("name", quick_or_slow(["t5", "fire", "alibi"], QUICK))
    def test_flex_documents_with_extra_dims_shared_rows_and_grouped_heads(self, name):
        pe = self.BIAS_MAKERS[name]()
        ids = torch.stack([self.ids_of(r) for r in self.ROWS])
        q5, k5, v5 = (torch.randn(B, 3, H, N, DH) for _ in range(3))                       # [B, G, H, N, Dh]
        for doc in (ids, ids[:1], ids[0]):
            want = attention(q5, k5, v5, pe, causal=True, document_ids=doc, use_flex=False)
            torch.testing.assert_close(attention(q5, k5, v5, pe, causal=True, document_ids=doc, use_flex=True), want)
        shared = document_positions(ids[:1]) * 2                                            # [1, N] explicit positions
        want = attention(q5, k5, v5, pe, positions_q=shared, positions_k=shared, use_flex=False)
        torch.testing.assert_close(attention(q5, k5, v5, pe, positions_q=shared, positions_k=shared, use_flex=True), want)
        q, k, v = torch.randn(B, H, N, DH), torch.randn(B, H // 2, N, DH), torch.randn(B, H // 2, N, DH)
        want = attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), pe, causal=True, document_ids=ids,
                         use_flex=False)
        torch.testing.assert_close(attention(q, k, v, pe, causal=True, document_ids=ids, use_flex=True), want)

    def test_flex_documents_build_no_dense_mask(self, monkeypatch):
        def dense_mask(*args):
            raise AssertionError("a dense [N, N] document mask was built")

        monkeypatch.setattr(pe_lib, "_document_mask", dense_mask)
        pe, (q, k, v) = ALiBiPositionalEmbedding(H), qkv()
        ids = self.ids_of(self.LENGTHS)
        assert attention(q, k, v, pe, causal=True, document_ids=ids, use_flex=True).shape == (B, H, N, DH)
        with pytest.raises(AssertionError, match="dense"):  # the dense path does build it: the patch is live
            attention(q, k, v, pe, causal=True, document_ids=ids, use_flex=False)

    def test_block_mask_skips_blocks_across_documents(self):
        ids = torch.arange(256) // 128                                                      # two documents of one block each
        blocks = pe_lib._block_mask(ids, False, 256, 256, ids.device).to_dense()                  # [1, 1, 2, 2] visited blocks
        assert blocks.reshape(2, 2).tolist() == [[1, 0], [0, 1]]
        one = pe_lib._block_mask(torch.zeros(256, dtype=torch.long), True, 256, 256, ids.device).to_dense()
        assert one.reshape(2, 2).tolist() == [[1, 0], [1, 1]]
        rows = torch.stack([ids, torch.zeros(256, dtype=torch.long)])                       # per-row documents
        assert pe_lib._block_mask(rows, False, 256, 256, ids.device).to_dense().reshape(2, 2, 2).tolist() == \
            [[[1, 0], [0, 1]], [[1, 1], [1, 1]]]


# ---------------------------------------------------------------------------
# FlexAttention path: score_mod against the dense bias, the CPU default, block masks
# ---------------------------------------------------------------------------


class _ScoreModIndexRecorder(torch.overrides.TorchFunctionMode):
    """What FlexAttention's backward refuses in a ``score_mod`` (seen on CUDA, torch 2.11: "multiple
    indexing operations on the same tensor that requires gradients"), found on the CPU.

    Inside a ``score_mod`` torch turns ``t[ints or tensors]`` into an op whose gradient must flow
    straight into ``t``'s own gradient. So a tensor that needs a gradient may be indexed so at most
    once, and never one made inside the ``score_mod`` (its gradient would pass through another op).
    Nor may it be viewed (``t[..., i]``, slices): the view's gradient needs a buffer the backward
    kernel cannot make ("Buffers cannot be created while lowering a pointwise subgraph": FIRE on CUDA,
    torch 2.11, and the same lowering on the CPU, torch 2.13)."""

    def __init__(self):
        super().__init__()
        self.indexed, self.made, self.problems = {}, {}, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func is torch.Tensor.__getitem__ and isinstance(target, torch.Tensor) and target.requires_grad:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if not all(isinstance(i, (torch.Tensor, int)) for i in index):
                self.problems.append(f"a {tuple(target.shape)} tensor that needs a gradient is viewed")
            else:
                if id(target) in self.indexed:
                    self.problems.append(f"a {tuple(target.shape)} tensor indexed twice")
                if id(target) in self.made:
                    self.problems.append(f"a {tuple(target.shape)} tensor made inside the score_mod is indexed")
                self.indexed[id(target)] = target                                       # kept alive: ids stay unique
        out = func(*args, **kwargs)
        inputs = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and id(o) not in inputs:
                self.made[id(o)] = o
        return out


def peak_bytes(fn) -> int:
    """Peak bytes of tensors allocated and not yet freed while ``fn`` runs: ``benchmarks/bench.py``'s
    ``peak_memory`` (the profiler's memory events, independent of the allocator's reuse)."""
    return _load_benchmark("bench").peak_memory(fn)


def block_oracle(keep, q_len, k_len, rows=1, size=128):
    """The blocks of a token mask ``keep(b, q, k)`` (plain loops over a dense [Nq, Nk] mask, padded with False as
    torch pads): (partial, full) bool [rows, Q, K], a block partial when some pair is kept but not all."""
    q_blocks, k_blocks = -(-q_len // size), -(-k_len // size)
    partial = torch.zeros(rows, q_blocks, k_blocks, dtype=torch.bool)
    full = torch.zeros_like(partial)
    for b in range(rows):
        dense = torch.zeros(q_blocks * size, k_blocks * size, dtype=torch.bool)
        dense[:q_len, :k_len] = torch.tensor([[keep(b, i, j) for j in range(k_len)] for i in range(q_len)])
        for i in range(q_blocks):
            for j in range(k_blocks):
                tile = dense[i * size:(i + 1) * size, j * size:(j + 1) * size]
                full[b, i, j], partial[b, i, j] = bool(tile.all()), bool(tile.any() and not tile.all())
    return partial, full


class TestFlexAttention:
    @pytest.mark.parametrize("make", [lambda: T5PositionalEmbedding(H), lambda: ALiBiPositionalEmbedding(H),
                                      lambda: ALiBiPositionalEmbedding(H, bidirectional=True),
                                      lambda: UnifiedPositionalEmbedding(32, H, DH, cls_token=True)])
    @pytest.mark.parametrize("causal", [False, True])
    def test_score_mod_matches_dense_bias(self, make, causal):
        from torch.nn.attention.flex_attention import flex_attention

        pe = make()
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, pe, causal=causal or None, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, pe, causal=causal or None, use_flex=True), want)
        if not causal:
            got = flex_attention(q, k, v, score_mod=pe.score_mod(N - 3, N), scale=pe.logit_scale(DH))
            torch.testing.assert_close(got, want)

    def test_score_mod_with_batched_positions(self):
        pe = T5PositionalEmbedding(H)
        q, k, v = qkv()
        positions = torch.stack([torch.arange(N) * 3, torch.arange(N) + 50])
        want = attention(q, k, v, pe, positions_q=positions, positions_k=positions, use_flex=False)
        got = attention(q, k, v, pe, positions_q=positions, positions_k=positions, use_flex=True)
        torch.testing.assert_close(got, want)

    BIAS_MAKERS = [lambda: T5PositionalEmbedding(H, num_buckets=8, max_distance=12), lambda: ALiBiPositionalEmbedding(H),
                   lambda: ALiBiPositionalEmbedding(H, bidirectional=True),
                   lambda: UnifiedPositionalEmbedding(64, H, DH, cls_token=True, num_buckets=8, max_distance=12)]
    # T5 on FlexAttention in the default run, every maker with PE_SLOW=1 (each flex call traces its score_mod)
    BIAS_PARAMS = quick_or_slow(BIAS_MAKERS, {"t5"}, ids=["t5", "alibi", "alibi_bidirectional", "tupe"],
                                sample={"tupe"})

    @pytest.mark.parametrize("make", BIAS_PARAMS)
    @pytest.mark.parametrize("rows", ["batched", "shared", "narrow"])
    def test_flex_equals_dense_with_positions_and_batch_unlike_heads(self, make, rows):
        """Issue 12.3: [B, N] with B != H, [1, N] with B > 1 and uint8 positions, flex vs dense."""
        pe = make()
        batch = 3                                                        # != H, so batch and head cannot be mixed up
        q, k, v = (torch.randn(batch, H, N, DH) for _ in range(3))
        base = torch.stack([torch.arange(N) * 2, torch.arange(N) + 5, torch.arange(N).flip(0)])
        positions = {"batched": base, "shared": base[:1], "narrow": base[:1].to(torch.uint8)}[rows]
        for causal in (False, True):
            want = attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=causal or None, use_flex=False)
            got = attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=causal or None, use_flex=True)
            torch.testing.assert_close(got, want)
        if rows == "narrow":  # uint8 0 - 2 must be -2, not 254: compare with the int64 positions
            wide = attention(q, k, v, pe, positions_q=base[:1], positions_k=base[:1], use_flex=False)
            torch.testing.assert_close(attention(q, k, v, pe, positions_q=positions, positions_k=positions), wide)

    @pytest.mark.parametrize("make", BIAS_PARAMS)
    def test_flex_takes_3d_and_5d_inputs_like_the_dense_path(self, make):
        pe = make()
        q, k, v = qkv()
        positions = torch.stack([torch.arange(N) * 2, torch.arange(N) + 5])
        for shape in ((H, N, DH), (B, 3, H, N, DH)):
            q5, k5, v5 = (torch.randn(shape) for _ in range(3))
            for pos in (None, positions if len(shape) == 5 else None):
                want = attention(q5, k5, v5, pe, positions_q=pos, positions_k=pos, causal=True, use_flex=False)
                got = attention(q5, k5, v5, pe, positions_q=pos, positions_k=pos, causal=True, use_flex=True)
                torch.testing.assert_close(got, want)

    def test_score_mod_validates_positions_itself(self):
        pe = ALiBiPositionalEmbedding(H)
        with pytest.raises(ValueError, match="ALiBiPositionalEmbedding: positions_q must have shape \\[4\\]"):
            pe.score_mod(4, 4, torch.arange(5), None)
        with pytest.raises(TypeError, match="T5PositionalEmbedding: positions_q must be an integer tensor"):
            T5PositionalEmbedding(H).score_mod(4, 4, torch.arange(4.0), None)

    def test_cpu_default_path(self, monkeypatch):
        """Issues 22.2 and 42.3: on the CPU the default runs the dense bias eagerly (eager FlexAttention is
        unfused), and FlexAttention when traced without gradient for a bias read per logit (inductor's CPU
        kernel lowers it; torch 2.13 has no CPU FlexAttention backward)."""
        flex, calls = pe_lib._flex_attention, []

        def spy(*args):
            calls.append(1)
            return flex(*args)

        monkeypatch.setattr(pe_lib, "_flex_attention", spy)
        pe, (q, k, v) = T5PositionalEmbedding(H, bidirectional=False), qkv()
        want = attention(q, k, v, pe, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, pe), want)
        assert calls == []
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: attention(q, k, v, pe), fullgraph=True, backend="eager")
        traced = [1] if pe_lib._FLEX_TRACES else []                                     # torch 2.6: dense
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v), want)
        assert calls == traced
        torch.testing.assert_close(compiled(q, k, v), want)                             # the table needs a gradient
        assert calls == traced

    def test_bias_path_rule(self, monkeypatch):
        """Issue 42.3: attention()'s one rule for a bias, every branch (CUDA as a device object: no GPU needed)."""
        cuda, cpu, meta = torch.device("cuda"), torch.device("cpu"), torch.device("meta")

        def path(device, **changes):
            options = dict(use_flex=None, grad=False, compiling=False, float_mask=False, dropout=False, q_len=8,
                           k_len=8, head_dim=16, indexes_first=True)
            return pe_lib._bias_path(device, **{**options, **changes})

        monkeypatch.setattr(pe_lib, "_FLEX_TRACES", True)                               # torch >= 2.7
        assert path(cuda) == path(cuda, grad=True) == path(cuda, compiling=True) == "flex"
        assert path(cuda, indexes_first=False, q_len=3) == "flex" and path(cuda, head_dim=8) == "dense"
        assert path(cuda, dropout=True) == path(cuda, float_mask=True) == "dense"
        assert path(cuda, use_flex=True, dropout=True) == "dense"
        assert path(cuda, use_flex=False) == "dense" and path(cpu, use_flex=True) == "flex"
        assert path(cpu) == path(cpu, grad=True) == "dense"                             # eager: unfused
        assert path(cpu, compiling=True) == "flex"
        assert path(cpu, compiling=True, grad=True) == path(cpu, compiling=True, q_len=3) == "dense"
        assert path(cpu, compiling=True, indexes_first=False) == path(cpu, compiling=True, float_mask=True) == "dense"
        assert path(meta, compiling=True) == "dense"
        monkeypatch.setattr(pe_lib, "_FLEX_TRACES", False)                              # torch 2.6: no traced masks
        assert path(cuda, compiling=True) == path(cpu, compiling=True) == "dense" and path(cuda) == "flex"
        assert path(cpu, compiling=True, use_flex=True) == "flex"

    def test_flex_kernel_options_for_learned_tables(self):
        """Issue 42.5: one pipeline stage on CUDA for a score_mod reading a tensor that needs a gradient (the
        default stages overflow an H100's or H200's shared memory), torch's defaults otherwise."""
        assert pe_lib._flex_kernel_options(torch.device("cuda"), True) == {"num_stages": 1}
        assert pe_lib._flex_kernel_options(torch.device("cuda"), False) is None
        assert pe_lib._flex_kernel_options(torch.device("cpu"), True) is None
        assert pe_lib._reads_learned(T5PositionalEmbedding(H))
        assert not pe_lib._reads_learned(ALiBiPositionalEmbedding(H))
        assert not pe_lib._reads_learned(T5PositionalEmbedding(H).requires_grad_(False))

    @pytest.mark.parametrize("make", [lambda: T5PositionalEmbedding(H, bidirectional=False),
                                      lambda: KerplePositionalEmbedding(H),
                                      lambda: FIREPositionalEmbedding(H, hidden_dim=4),
                                      lambda: GraphormerPositionalEmbedding(H, num_spatial=4, graph_token=True,
                                                                            attend_within=3).bind(GRAPH[:-1, :-1])],
                             ids=["t5", "kerple", "fire", "graphormer_token"])
    def test_learned_table_gradient_through_flex_equals_dense(self, make, monkeypatch):
        """Issue 42.5: a learned table's gradient through (eager) FlexAttention is the dense path's, in float64;
        the kernel options attention() asks for are the pure function's (None on the CPU)."""
        import torch.nn.attention.flex_attention as flex_module

        pe = make().double()
        q, k, v = (t.double() for t in qkv(N - 3, N))
        seen, flex = [], flex_module.flex_attention

        def recording(*args, **kwargs):
            seen.append(kwargs.get("kernel_options"))
            return flex(*args, **kwargs)

        monkeypatch.setattr(flex_module, "flex_attention", recording)
        grads = []
        for use_flex in (False, True):
            pe.zero_grad()
            attention(q, k, v, pe, causal=True, use_flex=use_flex).square().sum().backward()
            grads.append([p.grad for p in pe.parameters()])
        assert seen == [None]
        for got, want in zip(grads[1], grads[0]):
            assert (got is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    @pytest.mark.parametrize("case", [case for case in CASES if case.make().kind == "bias"], ids=repr)
    def test_score_mod_has_a_flex_backward(self, case):
        """Every bias's ``score_mod`` (default and explicit positions) indexes each tensor that needs a
        gradient at most once, and none it makes itself: what the CUDA kernel's backward takes (also with
        bfloat16 parameters, whose casts must come after the index)."""
        scalars = [torch.tensor(i) for i in (0, 1, N - 4, 2)]                           # b, h, q_idx, kv_idx
        for pe, positions in itertools.product((case.make(), case.make().bfloat16()),
                                               {(None, None), case.positions(N - 3, N)}):
            if positions == (None, None) and case.required_positions is not None:
                continue
            mod = pe.score_mod(N - 3, N, *positions)
            with _ScoreModIndexRecorder() as recorder:
                mod(torch.tensor(0.5), *scalars)
            assert recorder.problems == [], recorder.problems

    def test_score_mod_recorder_finds_a_double_index(self):
        weight = torch.randn(4, requires_grad=True)
        with _ScoreModIndexRecorder() as recorder:
            weight[torch.tensor(1)] - weight[torch.tensor(2)]
        assert recorder.problems == ["a (4,) tensor indexed twice"]
        with _ScoreModIndexRecorder() as recorder:
            (weight * 2)[torch.tensor(1)]
        assert recorder.problems == ["a (4,) tensor made inside the score_mod is indexed"]
        with _ScoreModIndexRecorder() as recorder:
            weight[..., 1] + weight[torch.tensor(0)]
        assert recorder.problems == ["a (4,) tensor that needs a gradient is viewed"]
        with _ScoreModIndexRecorder() as recorder:
            weight.detach()[..., 1] + weight[torch.tensor(0)]
        assert recorder.problems == []

    def test_causal_flex_skips_blocks_above_the_diagonal(self):
        mask = pe_lib._block_mask(None, True, 384, 384, torch.device("cpu")).to_dense().reshape(3, 3)
        assert mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
        assert pe_lib._block_mask(None, False, 384, 384, torch.device("cpu")) is None
        tail = pe_lib._block_mask(None, True, 128, 384, torch.device("cpu")).to_dense().reshape(1, 3)
        assert tail.tolist() == [[1, 1, 1]]                              # bottom-right: the last query sees every key

    @staticmethod
    def captured_ints(fn, seen=None) -> list:
        """The Python ints a function closes over, through nested functions, tuples and lists (not modules)."""
        seen = set() if seen is None else seen
        if id(fn) in seen:
            return []
        seen.add(id(fn))
        found = []
        for cell in getattr(fn, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, int) and not isinstance(value, bool):
                found.append(value)
            elif callable(value) and not isinstance(value, torch.nn.Module) or isinstance(value, (tuple, list)):
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    found += TestFlexAttention.captured_ints(item, seen)
        return found

    @pytest.mark.parametrize("case", [case for case in CASES if case.make().kind == "bias"], ids=repr)
    def test_score_mod_and_mask_mod_hold_no_sizes(self, case):
        """Issue 42.2: a score_mod (or mask_mod) closing over a length made compiled flex_attention specialise
        on it, then fail to lower it as a symbol at the next length (T5 and ALiBi, 16384 after 65536 on CUDA)."""
        pe = case.make()
        for q_len, k_len in ((N - 3, N), (N - 6, N - 1)):
            if case.required_positions is None:
                assert self.captured_ints(pe.score_mod(q_len, k_len)) == [], (q_len, k_len)
            assert self.captured_ints(pe.score_mod(q_len, k_len, *case.positions(q_len, k_len))) == []
            assert self.captured_ints(pe_lib._block_mask(None, True, q_len, k_len, torch.device("cpu")).mask_mod) == []

    @slow   # two inductor compilations of the CPU FlexAttention kernel (about a minute each on a loaded CPU)
    @pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                        reason="inductor's CPU FlexAttention kernel needs AVX2")
    def test_compiled_flex_at_a_second_length(self):
        """Issue 42.2: the same compiled flex_attention at a second length recompiles with symbolic sizes; a
        score_mod closing over Nq - 1 failed there (C++ compile error on the CPU, a LoweringException on CUDA)."""
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        pe = ALiBiPositionalEmbedding(H)
        for n in (256, 128):
            q, k, v = (torch.randn(1, H, n, DH) for _ in range(3))
            mask = pe_lib._block_mask(None, True, n, n, q.device)
            with torch.no_grad():
                got = flex(q, k, v, score_mod=pe.score_mod(n, n), block_mask=mask)
            torch.testing.assert_close(got, attention(q, k, v, pe, causal=True, use_flex=False))

    @slow   # an inductor compilation per class (a minute each on a loaded CPU)
    @pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                        reason="inductor's CPU FlexAttention kernel needs AVX2")
    @pytest.mark.parametrize("case", [case for case in CASES if case.make().kind == "bias"], ids=repr)
    def test_score_mod_compiles_with_inductor_on_cpu(self, case, monkeypatch):
        """Issue 42.6: every bias's score_mod lowers in inductor's CPU FlexAttention kernel (forward: torch 2.13
        has no CPU backward) with the dense path's output. Its tensors come from outside the compiled function,
        as in attention()'s eager call: inside a graph, that kernel takes no tensor made there."""
        import torch.nn.attention.flex_attention as flex_module

        torch._dynamo.reset()
        monkeypatch.setattr(flex_module, "flex_attention", torch.compile(flex_module.flex_attention))
        pe = case.make()
        positions_q, positions_k = case.positions(N - 3, N)
        q, k, v = qkv(N - 3, N)
        with torch.no_grad():
            got = attention(q, k, v, pe, positions_q=positions_q, positions_k=positions_k, causal=True, use_flex=True)
        monkeypatch.undo()
        want = attention(q, k, v, pe, positions_q=positions_q, positions_k=positions_k, causal=True, use_flex=False)
        torch.testing.assert_close(got, want)

    @pytest.mark.parametrize("q_shape, mask_shape", [((B, H, N, DH), (N, N)), ((B, H, N, DH), (B, 1, N, N)),
                                                      ((B, H, N, DH), (1, H, N, N)), ((B, H, N, DH), (B, H, N, N)),
                                                      ((H, N, DH), (N, N)), ((B, 3, H, N, DH), (3, H, N, N))])
    def test_flex_takes_a_boolean_mask(self, q_shape, mask_shape):
        """Issue 42.3: a boolean attn_mask runs on FlexAttention too (with causality and documents), as the
        dense path (every query keeps a key: there FlexAttention gives 0 and SDPA NaN)."""
        pe = T5PositionalEmbedding(H, num_buckets=8, max_distance=12)
        q, k, v = (torch.randn(q_shape) for _ in range(3))
        allowed = (torch.rand(mask_shape) > 0.5) | torch.eye(N, dtype=torch.bool)
        for extra in (dict(causal=False), dict(causal=True), dict(document_ids=torch.tensor([0] * 9 + [1] * 7)) if
                      len(q_shape) == 4 else dict(causal=True)):
            want = attention(q, k, v, pe, attn_mask=allowed, use_flex=False, **extra)
            torch.testing.assert_close(attention(q, k, v, pe, attn_mask=allowed, use_flex=True, **extra), want)

    def test_block_mask_of_a_boolean_mask(self):
        """Issue 42.3: a boolean mask's blocks (with causality): those with a kept pair, those all kept."""
        allowed = torch.ones(2, 1, 256, 384, dtype=torch.bool)
        allowed[0, 0, :128, 256:] = False                                               # a block wholly masked
        allowed[1, 0, 200, 5] = False                                                   # one pair masked
        pe_lib._BLOCK_MASKS.clear()
        pe_lib._block_mask(None, True, 256, 384, torch.device("cpu"))                   # cached, without the mask
        mask = pe_lib._block_mask(None, True, 256, 384, torch.device("cpu"), allowed)
        keep = lambda b, i, j: bool(allowed[b, 0, i, j]) and j <= i + 128
        partial, full = block_oracle(keep, 256, 384, rows=2)
        torch.testing.assert_close(mask.to_dense().bool()[:, 0], partial | full)
        torch.testing.assert_close(mask.full_kv_num_blocks[:, 0], full.sum(-1, dtype=torch.int32))
        assert len(pe_lib._BLOCK_MASKS) == 1                                            # a tensor mask is not cached

    DOCS = torch.repeat_interleave(torch.arange(5), torch.tensor([100, 200, 30, 50, 132]))          # 512 tokens

    @pytest.mark.parametrize("ids, causal, q_len, k_len", [
        (None, True, 384, 384), (None, True, 300, 300), (None, True, 200, 333), (None, True, 1, 300),
        (DOCS, False, 512, 512), (DOCS[:300], True, 300, 300), (torch.stack([DOCS, DOCS.flip(0)]), True, 512, 512)],
        ids=["causal", "causal_ragged", "causal_tail", "one_query", "documents", "documents_causal", "rows"])
    def test_block_mask_from_block_indices(self, ids, causal, q_len, k_len):
        """Issue 42.1: the blocks come from block indices, equal to those of the dense mask (a loop oracle),
        with the same mask inside them; at multiples of 128, the very mask create_block_mask builds."""
        from torch.nn.attention.flex_attention import create_block_mask

        pe_lib._BLOCK_MASKS.clear()
        mask = pe_lib._block_mask(ids, causal, q_len, k_len, torch.device("cpu"))
        offset = max(k_len - q_len, 0)
        rows = None if ids is None else ids.reshape(-1, ids.shape[-1])

        def keep(b, i, j):
            same = rows is None or bool(rows[b, i] == rows[b, j])
            return same and (not causal or j <= i + offset)

        partial, full = block_oracle(keep, q_len, k_len, 1 if rows is None else rows.shape[0])
        dense = mask.to_dense().bool()[:, 0]                                            # [R, Q, K] visited blocks
        torch.testing.assert_close(dense, partial | full)
        torch.testing.assert_close(mask.full_kv_num_blocks[:, 0], full.sum(-1, dtype=torch.int32))
        b, q, k = (torch.tensor(x) for x in (rows.shape[0] - 1 if rows is not None else 0, q_len - 1, 0))
        assert bool(mask.mask_mod(b, torch.tensor(0), q, k)) == keep(int(b), int(q), int(k))
        if q_len % 128 == 0 and k_len % 128 == 0:
            torch_mask = create_block_mask(lambda b, h, i, j: (rows is None or rows[b, i] == rows[b, j])
                                           & ((j <= i + offset) if causal else True), None if rows is None else
                                           rows.shape[0], None, q_len, k_len, device="cpu")
            for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
                torch.testing.assert_close(getattr(mask, name), getattr(torch_mask, name))
            torch.testing.assert_close(mask.to_dense(), torch_mask.to_dense())

    def test_causal_block_mask_at_64k_tokens_is_small(self):
        """Issue 42.1: the causal mask of 65536 tokens took an [N, N] mask (16 GiB; 2.5 GiB at 16384), now
        its 512 x 512 blocks (measured: 10 MiB)."""
        pe_lib._BLOCK_MASKS.clear()
        n = 65536
        assert peak_bytes(lambda: pe_lib._block_mask(None, True, n, n, torch.device("cpu"))) < 32 * 2**20
        mask = pe_lib._block_mask(None, True, n, n, torch.device("cpu"))
        assert mask.kv_indices.shape == (1, 1, 512, 512) and mask.seq_lengths == (n, n)
        assert mask.kv_num_blocks.flatten().tolist() == [1] * 512                       # the diagonal block
        assert mask.full_kv_num_blocks.flatten().tolist() == list(range(512))             # every block below it

    @pytest.mark.skipif(not pe_lib._FLEX_TRACES, reason="dynamo traces FlexAttention's block mask from torch 2.7")
    @pytest.mark.parametrize("ids", [None, DOCS[:300]], ids=["causal", "documents_causal"])
    def test_traced_block_mask_comes_from_block_indices(self, monkeypatch, ids):
        """Issue 42: traced by torch.compile the mask is built from block indices as in eager mode, not by
        create_block_mask (which evaluated the mask_mod at every pair: compiled causal ALiBi on a 2-core CPU at
        4096 tokens went from 2.68x to 2.60x SDPA); the output equals the eager path's."""
        import torch.nn.attention.flex_attention as flex_module

        alibi = ALiBiPositionalEmbedding(H)
        q, k, v = qkv(300, 300)
        expected = attention(q, k, v, alibi, use_flex=True, document_ids=ids)
        monkeypatch.setattr(flex_module, "create_block_mask", lambda *args, **kwargs: 1 / 0)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: attention(q, k, v, alibi, use_flex=True, document_ids=ids),
                                 backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), expected)

    def test_block_masks_are_cached(self):
        """Issue 42.1: one mask per (lengths, causality, device, ids), the newest _BLOCK_MASK_CACHE_SIZE of them;
        ids are the same tensor unchanged (identity and version), inference-mode ids are not cached."""
        cpu = torch.device("cpu")
        pe_lib._BLOCK_MASKS.clear()
        first = pe_lib._block_mask(None, True, 256, 256, cpu)
        assert pe_lib._block_mask(None, True, 256, 256, cpu) is first
        assert pe_lib._block_mask(None, True, 128, 256, cpu) is not first
        ids = self.DOCS.clone()
        by_ids = pe_lib._block_mask(ids, False, 512, 512, cpu)
        assert pe_lib._block_mask(ids, False, 512, 512, cpu) is by_ids
        assert pe_lib._block_mask(ids.clone(), False, 512, 512, cpu) is not by_ids      # equal ids, another tensor
        assert by_ids.full_kv_num_blocks[0, 0, 3] == 1                                  # the last block: one document
        ids[-1] = 9                                                                     # in place: a new version
        changed = pe_lib._block_mask(ids, False, 512, 512, cpu)
        assert changed is not by_ids and changed.full_kv_num_blocks[0, 0, 3] == 0
        with torch.inference_mode():
            frozen = self.DOCS.clone()
        assert pe_lib._block_mask(frozen, True, 512, 512, cpu) is not pe_lib._block_mask(frozen, True, 512, 512, cpu)
        for n in range(1, 2 * pe_lib._BLOCK_MASK_CACHE_SIZE):
            pe_lib._block_mask(None, True, n, n, cpu)
        assert len(pe_lib._BLOCK_MASKS) == pe_lib._BLOCK_MASK_CACHE_SIZE
        assert pe_lib._block_mask(None, True, 256, 256, cpu) is not first                # the oldest went first

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    @pytest.mark.parametrize("case", [case for case in CASES if case.make().kind == "bias"], ids=repr)
    def test_cuda_flex_is_compiled(self, case):
        """On CUDA ``use_flex=True`` runs every bias through the compiled FlexAttention kernel: fused (eager
        flex warns that it is unfused; that warning fails here), with the dense path's output and gradients
        (q, k, v and every parameter). A per-head constant has gradient 0 in exact arithmetic (softmax
        ignores it), so parameter gradients are compared to 1e-3 absolute: two summation orders of N^2 terms."""
        import warnings

        torch._dynamo.reset()                    # a fresh process: no other class's score_mod in the cache
        pe = case.make().cuda()
        positions = [None if p is None else p.cuda() for p in case.positions(N - 3, N)]
        q, k, v = (t.cuda().requires_grad_() for t in qkv(N - 3, N))
        leaves = [q, k, v, *pe.parameters()]

        def output_and_grads(use_flex):
            for t in leaves:
                t.grad = None
            out = attention(q, k, v, pe, positions_q=positions[0], positions_k=positions[1], causal=True,
                            use_flex=use_flex)
            out.square().sum().backward()
            return [out.detach()] + [t.grad for t in leaves]

        want = output_and_grads(False)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*without torch.compile")
            got = output_and_grads(True)
        for index, (g, w) in enumerate(zip(got, want)):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 if index < 4 else 1e-3)


# ===========================================================================
# Input kind: added to the tokens
# ===========================================================================


# ---------------------------------------------------------------------------
# Sinusoidal (+ options: MAE 2D tables, fairseq spectrum)
# ---------------------------------------------------------------------------


def sinusoid_oracle(positions, dim, base=10000.0, layout="interleaved"):
    """Vaswani et al.'s formula, one entry at a time, in float64."""
    out = torch.zeros(len(positions), dim, dtype=torch.float64)
    for row, p in enumerate(positions):
        for i in range(dim // 2):
            angle = float(p) / base ** (2 * i / dim)
            if layout == "interleaved":
                out[row, 2 * i], out[row, 2 * i + 1] = math.sin(angle), math.cos(angle)
            else:
                out[row, i], out[row, dim // 2 + i] = math.sin(angle), math.cos(angle)
    return out


def mae_2d_sincos(embed_dim, grid_size, cls_token):
    """facebookresearch/mae util/pos_embed.py get_2d_sincos_pos_embed, ported to torch float64 loops."""
    grid_w, grid_h = torch.meshgrid(torch.arange(grid_size, dtype=torch.float64),
                                    torch.arange(grid_size, dtype=torch.float64), indexing="xy")   # np.meshgrid(w, h)
    grid = [grid_w.reshape(-1), grid_h.reshape(-1)]

    def one_d(dim, pos):
        out = torch.zeros(len(pos), dim, dtype=torch.float64)
        for m, p in enumerate(pos):
            for d in range(dim // 2):
                omega = 1.0 / 10000 ** (d / (dim / 2.0))
                out[m, d], out[m, dim // 2 + d] = math.sin(float(p) * omega), math.cos(float(p) * omega)
        return out

    emb = torch.cat([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], 1)
    return torch.cat([torch.zeros(1, embed_dim, dtype=torch.float64), emb]) if cls_token else emb


def fairseq_oracle(positions, dim, padding_idx):
    """fairseq SinusoidalPositionalEmbedding.get_embedding, one entry at a time (float64)."""
    half = dim // 2
    out = torch.zeros(len(positions), dim, dtype=torch.float64)
    for row, p in enumerate(positions):
        if int(p) == padding_idx:
            continue
        for i in range(half):
            angle = float(p) * math.exp(-i * math.log(10000) / (half - 1))
            out[row, i], out[row, half + i] = math.sin(angle), math.cos(angle)
    return out


class TestSinusoidal:
    @pytest.mark.parametrize("layout", ["interleaved", "concat"])
    def test_matches_loop_oracle(self, layout):
        positions = torch.tensor([0, 1, 2, 7, 100, 4095])
        pe = SinusoidalPositionalEmbedding(16, layout=layout)
        torch.testing.assert_close(pe.embed(positions).double(), sinusoid_oracle(positions, 16, layout=layout),
                                   rtol=0, atol=1e-7)

    def test_matches_seed_formula(self):
        # The seeds' notebook: div_term = exp(arange(0, d, 2) * -log(1e4) / d); sin on even, cos on odd.
        d, n = 32, 50
        position = torch.arange(n, dtype=torch.float64)[:, None]
        div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(1e4) / d))
        table = torch.zeros(n, d, dtype=torch.float64)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        torch.testing.assert_close(SinusoidalPositionalEmbedding(d).embed(torch.arange(n)).double(), table,
                                   rtol=0, atol=1e-7)

    def test_published_values(self):
        # PE[p, 0] = sin(p) and PE[p, 1] = cos(p) for every dim.
        table = SinusoidalPositionalEmbedding(8).embed(torch.tensor([1]))
        torch.testing.assert_close(table[0, :2], torch.tensor([0.8414709848, 0.5403023059]))

    def test_forward_adds_to_tokens(self):
        pe = SinusoidalPositionalEmbedding(D)
        x = torch.randn(B, N, D)
        torch.testing.assert_close(pe(x), x + pe.embed(torch.arange(N)))
        torch.testing.assert_close(pe(x, offset=9), x + pe.embed(torch.arange(9, 9 + N)))

    def test_negative_float_and_huge_positions(self):
        positions = torch.tensor([-3.0, -0.5, 0.25, 12.75, 999_999.0, 1_000_000.0], dtype=torch.float64)
        pe = SinusoidalPositionalEmbedding(64)
        got = pe.embed(positions.float())
        want = sinusoid_oracle(positions.tolist(), 64)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-7)

    def test_million_positions_no_max_len(self):
        pe = SinusoidalPositionalEmbedding(4)
        x = torch.zeros(1, 1_000_000, 4)
        out = pe(x)
        last = sinusoid_oracle([999_999], 4)[0]
        torch.testing.assert_close(out[0, -1].double(), last, rtol=0, atol=2e-7)

    def test_batched_positions(self):
        pe = SinusoidalPositionalEmbedding(D)
        positions = torch.stack([torch.arange(N), torch.arange(N) + 100])
        x = torch.randn(B, N, D)
        out = pe(x, positions)
        torch.testing.assert_close(out[1], x[1] + pe.embed(torch.arange(N) + 100))

    def test_multi_axis_splits_channels(self):
        pe = SinusoidalPositionalEmbedding(24, num_axes=3)
        positions = torch.tensor([[0, 1, 2], [5, 3, 9], [2, 2, 2]])
        got = pe.embed(positions).double()
        for a in range(3):
            torch.testing.assert_close(got[:, 8 * a : 8 * (a + 1)], sinusoid_oracle(positions[:, a], 8),
                                       rtol=0, atol=1e-7)
        x = torch.randn(B, 3, 24)
        torch.testing.assert_close(pe(x, positions), x + got.float())

    @pytest.mark.parametrize("layout", ["interleaved", "concat"])
    def test_sections_give_unequal_slices(self, layout):
        # axis a on 2 * sections[a] channels with its own spectrum base ** (-2i / (2 sections[a])), in axis order
        pe = SinusoidalPositionalEmbedding(32, layout=layout, num_axes=3, sections=[4, 6, 6])
        positions = torch.tensor([[0.0, 1.5, 2.0], [5.0, 3.25, 9.0], [40.0, 2.0, 0.5]])
        got, start = pe.embed(positions.double()), 0
        for a, width in enumerate((8, 12, 12)):
            want = sinusoid_oracle(positions[:, a], width, layout=layout)
            torch.testing.assert_close(got[:, start:start + width], want, rtol=0, atol=1e-12)
            start += width
        assert "sections=[4, 6, 6]" in repr(pe)
        with pytest.raises(ValueError, match=r"SinusoidalPositionalEmbedding: sections must hold num_axes=3 sizes "
                                             r"summing to dim / 2 = 16, got sections=\[4, 6, 4\]"):
            SinusoidalPositionalEmbedding(32, num_axes=3, sections=[4, 6, 4])
        with pytest.raises(ValueError, match="sections must hold num_axes=2 sizes"):
            SinusoidalPositionalEmbedding(32, num_axes=2, sections=[4, 6, 6])
        with pytest.raises(ValueError, match=r"each at least 2 with spectrum='fairseq', got sections=\[1, 7\]"):
            SinusoidalPositionalEmbedding(16, num_axes=2, spectrum="fairseq", sections=[1, 7])
        with pytest.raises(ValueError, match=r"SinusoidalPositionalEmbedding: sections\[1\] must be a positive int"):
            SinusoidalPositionalEmbedding(32, num_axes=3, sections=[4, 0, 12])

    def test_float64_positions_give_float64_table(self):
        table = SinusoidalPositionalEmbedding(8).embed(torch.tensor([0.5], dtype=torch.float64))
        assert table.dtype == torch.float64

    def test_bf16_output_is_rounded_exact_value(self):
        pe = SinusoidalPositionalEmbedding(64)
        x = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
        out = pe(x, offset=999_996)
        want = sinusoid_oracle(list(range(999_996, 1_000_000)), 64).to(torch.bfloat16)
        torch.testing.assert_close(out[0], want, rtol=0, atol=0)

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(dim=7), ValueError, "dim must be a positive multiple of 2"),
        (dict(dim=12, num_axes=4), ValueError, "dim must be a positive multiple of 2 \\* num_axes = 8, got dim=12"),
        (dict(dim=8, base=-1.0), ValueError, "base must be a finite number > 1.0, got base=-1.0"),
        (dict(dim=8, base="1e4"), TypeError, "base must be a real number, got str '1e4'"),
        (dict(dim=8, layout="sin"), ValueError, "layout must be one of 'interleaved', 'concat', got layout='sin'"),
        (dict(dim=8, num_axes=True), TypeError, "num_axes must be an int, got bool True"),
    ])
    def test_bad_arguments(self, kwargs, error, message):
        with pytest.raises(error, match="SinusoidalPositionalEmbedding: " + message):
            SinusoidalPositionalEmbedding(**kwargs)

    def test_bad_multi_axis_positions(self):
        pe = SinusoidalPositionalEmbedding(8, num_axes=2)
        with pytest.raises(ValueError, match="positions must have shape"):
            pe(torch.randn(1, 3, 8), torch.zeros(3, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="positions is required"):
            pe(torch.randn(1, 3, 8))

    def test_mae_table_with_cls_token(self):
        size, dim = 5, 16
        pe = SinusoidalPositionalEmbedding(dim, layout="concat", num_axes=2, num_prefix_tokens=1).double()
        cols_rows = torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="xy"), -1)
        x = torch.zeros(1, 1 + size * size, dim, dtype=torch.float64)
        torch.testing.assert_close(pe(x, cols_rows.reshape(-1, 2).double())[0], mae_2d_sincos(dim, size, True),
                                   rtol=0, atol=1e-12)
        # the rows and columns order: rows are (row, col) -> MAE needs (col, row)
        rows_cols = cols_rows.reshape(-1, 2).flip(-1)
        assert not torch.allclose(pe(x, rows_cols)[0], mae_2d_sincos(dim, size, True))

    @pytest.mark.parametrize("dim", [16, 17])
    def test_fairseq_matches_loop_oracle(self, dim):
        padding_idx = 1
        pe = SinusoidalPositionalEmbedding(dim, spectrum="fairseq", layout="concat", padding_idx=padding_idx)
        tokens_ids = torch.tensor([[5, 6, 7, 8, 1, 1], [9, 9, 1, 1, 1, 1]])   # right padding with id 1
        mask = tokens_ids.ne(padding_idx).long()
        positions = torch.cumsum(mask, dim=1) * mask + padding_idx                # fairseq make_positions
        x = torch.zeros(2, 6, dim, dtype=torch.float64)
        got = pe(x, positions)
        for b in range(2):
            torch.testing.assert_close(got[b], fairseq_oracle(positions[b], dim, padding_idx), rtol=0, atol=1e-7)  # float32 table
        # default positions start at padding_idx + 1, offset continues them (incremental decoding)
        torch.testing.assert_close(pe(x[:1, :4]), fairseq_oracle(torch.arange(2, 6), dim, padding_idx)[None])
        torch.testing.assert_close(pe(x[:1, :1], offset=3), fairseq_oracle(torch.tensor([5]), dim, padding_idx)[None])

    def test_padding_idx_needs_one_axis(self):
        # fairseq's padding marks a token by its one position; per axis it made a mask the table could not take
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: padding_idx \\(fairseq's\\) needs one "
                                             "position axis, got padding_idx=1 with num_axes=2"):
            SinusoidalPositionalEmbedding(8, spectrum="fairseq", layout="concat", num_axes=2, padding_idx=1)

    def test_fairseq_float32_reference(self):
        # fairseq's get_embedding computes in float32; large positions differ by its rounding only
        half, num = 64, 1024
        emb = math.log(10000) / (half - 1)
        emb = torch.exp(torch.arange(half, dtype=torch.float) * -emb)
        emb = torch.arange(num, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        table = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
        table[1, :] = 0
        got = SinusoidalPositionalEmbedding(128, spectrum="fairseq", layout="concat", padding_idx=1).embed(torch.arange(num))
        assert (got - table).abs().max() < 2e-4
        assert (got[:64] - table[:64]).abs().max() < 1e-5

    @pytest.mark.parametrize("kwargs, text", [
        ({}, "dim=16, base=10000.0, layout='interleaved', num_axes=1"),
        ({"layout": "concat"}, "dim=16, base=10000.0, layout='concat', num_axes=1"),
        ({"num_axes": 2, "base": 100.0}, "dim=16, base=100.0, layout='interleaved', num_axes=2"),
    ])
    def test_defaults_match_the_oracle_and_repr(self, kwargs, text):
        """The defaults against the float64 loop (each axis takes dim / num_axes channels) and a written repr."""
        pe = SinusoidalPositionalEmbedding(16, **kwargs)
        axes = kwargs.get("num_axes", 1)
        p = torch.randint(-50, 5000, (3, 7) + ((axes,) if axes > 1 else ()))
        flat = p.reshape(-1, axes)
        want = torch.cat([sinusoid_oracle(flat[:, a].tolist(), 16 // axes, kwargs.get("base", 10000.0),
                                          kwargs.get("layout", "interleaved")) for a in range(axes)], -1)
        torch.testing.assert_close(pe.embed(p).double(), want.reshape(3, 7, 16), rtol=0, atol=2e-7)
        assert repr(pe) == f"SinusoidalPositionalEmbedding({text})"

    def test_bad_input(self):
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: spectrum must be one of 'vaswani', 'fairseq'"):
            SinusoidalPositionalEmbedding(16, spectrum="t2t")
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: dim must be a positive multiple of 2 \\* num_axes = 2"):
            SinusoidalPositionalEmbedding(17)
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: spectrum='fairseq' needs at least 2 frequencies"):
            SinusoidalPositionalEmbedding(2, spectrum="fairseq")
        with pytest.raises(TypeError, match="SinusoidalPositionalEmbedding: padding_idx must be an int, got float 1.0"):
            SinusoidalPositionalEmbedding(16, padding_idx=1.0)
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: num_prefix_tokens must be a non-negative int"):
            SinusoidalPositionalEmbedding(16, num_prefix_tokens=-1)
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: positions must have shape \\[4\\]"):
            SinusoidalPositionalEmbedding(16, num_prefix_tokens=1)(torch.randn(2, 5, 16), torch.arange(5))

    def test_sinusoidal_embed_rejects_non_finite_positions(self):
        pe = SinusoidalPositionalEmbedding(8)
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: positions must be finite, got \\["):
                pe.embed(torch.tensor([bad, 1.0]))


# ---------------------------------------------------------------------------
# Learned
# ---------------------------------------------------------------------------


class TestLearned:
    def test_rows_are_added(self):
        pe = LearnedPositionalEmbedding(32, 8)
        x = torch.randn(B, 5, 8)
        torch.testing.assert_close(pe(x, offset=3), x + pe.weight[3:8])
        positions = torch.tensor([[0, 4, 4, 31, 2], [1, 1, 1, 1, 1]])
        out = pe(x, positions)
        torch.testing.assert_close(out[0, 3], x[0, 3] + pe.weight[31])
        torch.testing.assert_close(out[1], x[1] + pe.weight[1])

    @pytest.mark.parametrize("normalize", [False, True])
    def test_per_axis_tables_are_summed(self, normalize):
        # max_len=(L_1, ..., L_A): row p_a of table a (rows first_a .. of weight), summed over the axes; normalize
        # divides the sum by eps + its root mean square (Cosmos 1.0)
        pe = LearnedPositionalEmbedding((3, 4, 5), 6, init_std=1.0, normalize=normalize, eps=0.25).double()
        positions = torch.tensor([[0, 0, 0], [2, 3, 4], [1, 0, 3], [2, 1, 0]])
        weight, want = pe.weight.detach(), torch.zeros(4, 6, dtype=torch.float64)
        for n, position in enumerate(positions.tolist()):
            for d in range(6):
                want[n, d] = weight[position[0], d] + weight[3 + position[1], d] + weight[7 + position[2], d]
            if normalize:
                want[n] /= 0.25 + math.sqrt(sum(float(v) ** 2 for v in want[n]) / 6)
        assert pe.weight.shape == (12, 6) and pe.num_axes == 3
        torch.testing.assert_close(pe.embed(positions), want, rtol=0, atol=1e-6)   # the norm is float32
        x = torch.randn(2, 4, 6, dtype=torch.float64)
        torch.testing.assert_close(pe(x, positions), x + pe.embed(positions))
        assert repr(pe).endswith(f"(max_len=(3, 4, 5), dim=6, init_std=1.0{', normalize=True, eps=0.25' * normalize})")

    def test_per_axis_tables_refuse_bad_positions(self):
        pe = LearnedPositionalEmbedding((3, 4), 8)
        with pytest.raises(ValueError, match=r"LearnedPositionalEmbedding: positions\[..., 1\] must lie in "
                                             r"\[0, max_len=4\), got position 4"):
            pe.embed(torch.tensor([[0, 4]]))
        with pytest.raises(ValueError, match=r"LearnedPositionalEmbedding: positions must have shape \[..., N, 2\]"):
            pe.embed(torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="positions is required for 2 axes"):
            pe(torch.randn(1, 3, 8))
        with pytest.raises(ValueError, match=r"resize interpolates one table; these are 2 per-axis tables"):
            pe.resize(8)
        with pytest.raises(ValueError, match=r"LearnedPositionalEmbedding: max_len\[1\] must be a positive int"):
            LearnedPositionalEmbedding((3, 0), 8)

    @pytest.mark.parametrize("max_len", [(5,), [5], torch.Size([5])])
    def test_one_per_axis_length_is_the_one_table(self, max_len):
        # a sequence of one length is one table of that many rows (positions [N]), as max_len=5 builds it
        pe = LearnedPositionalEmbedding(max_len, 4)
        assert pe.max_len == 5 and pe.num_axes == 1 and pe.weight.shape == (5, 4)
        x, positions = torch.randn(2, 3, 4), torch.tensor([4, 0, 2])
        torch.testing.assert_close(pe(x, positions), x + pe.weight[positions], rtol=0, atol=0)
        torch.testing.assert_close(pe(x, offset=2), x + pe.weight[2:5], rtol=0, atol=0)
        assert repr(pe) == "LearnedPositionalEmbedding(max_len=5, dim=4, init_std=0.02)"

    def test_init_std(self):
        pe = LearnedPositionalEmbedding(4096, 64)
        assert abs(pe.weight.std().item() - 0.02) < 1e-3

    @pytest.mark.parametrize("positions, bad", [(torch.tensor([0, 32]), 32), (torch.tensor([-1, 3]), -1)])
    def test_out_of_range_is_value_error(self, positions, bad):
        pe = LearnedPositionalEmbedding(32, 8)
        with pytest.raises(ValueError, match=f"LearnedPositionalEmbedding: .*max_len=32.*got position {bad}"):
            pe(torch.randn(1, 2, 8), positions)

    def test_offset_past_end_is_value_error(self):
        pe = LearnedPositionalEmbedding(8, 4)
        with pytest.raises(ValueError, match="max_len=8"):
            pe(torch.randn(1, 4, 4), offset=5)

    def test_float_positions_are_type_error(self):
        with pytest.raises(TypeError, match="integer tensor"):
            LearnedPositionalEmbedding(8, 4)(torch.randn(1, 2, 4), torch.tensor([0.0, 1.0]))

    def test_resize_1d_matches_linear_interpolation_oracle(self):
        old, new, dim = 5, 8, 3
        pe = LearnedPositionalEmbedding(old, dim)
        table = pe.weight.detach().double().clone()
        pe.resize(new)
        want = torch.zeros(new, dim, dtype=torch.float64)
        for j in range(new):
            s = min(max((j + 0.5) * old / new - 0.5, 0.0), old - 1)
            lo = int(math.floor(s))
            hi = min(lo + 1, old - 1)
            want[j] = table[lo] * (1 - (s - lo)) + table[hi] * (s - lo)
        assert pe.max_len == new and pe.weight.shape == (new, dim)
        torch.testing.assert_close(pe.weight.detach().double(), want, rtol=0, atol=1e-6)

    def test_resize_same_size_is_identity(self):
        pe = LearnedPositionalEmbedding(16, 4)
        before = pe.weight.detach().clone()
        torch.testing.assert_close(pe.resize(16).weight.detach(), before)
        torch.testing.assert_close(pe.resize((4, 4)).weight.detach(), before)

    def test_resize_grid_keeps_row_major_layout_and_prefix(self):
        h, w = 3, 4
        rows = [[0.0, 0.0]] + [[float(r), float(c)] for r in range(h) for c in range(w)]  # [CLS] first
        pe = LearnedPositionalEmbedding(1 + h * w, 2)
        with torch.no_grad():
            pe.weight.copy_(torch.tensor(rows))
        pe.resize((6, 8), old_grid=(h, w), num_prefix_tokens=1, mode="bilinear")
        grid = pe.weight.detach()[1:].reshape(6, 8, 2)
        assert pe.max_len == 1 + 48
        torch.testing.assert_close(pe.weight.detach()[0], torch.zeros(2))
        # channel 0 varies along rows only, channel 1 along columns only
        torch.testing.assert_close(grid[..., 0], grid[:, :1, 0].expand(6, 8))
        torch.testing.assert_close(grid[..., 1], grid[:1, :, 1].expand(6, 8))
        assert (grid[1:, 0, 0] >= grid[:-1, 0, 0]).all() and grid[-1, 0, 0] > grid[0, 0, 0]

    def test_bad_resize(self):
        pe = LearnedPositionalEmbedding(10, 4)
        with pytest.raises(ValueError, match="old_grid must multiply to 10"):
            pe.resize((4, 4))
        with pytest.raises(ValueError, match="new_size must be"):
            pe.resize(0)

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(max_len=0, dim=4), ValueError, "max_len must be a positive int, got max_len=0"),
        (dict(max_len=4, dim=-1), ValueError, "dim must be a positive int, got dim=-1"),
        (dict(max_len=2.5, dim=4), TypeError, "max_len must be an int, got float 2.5"),
        (dict(max_len=4, dim=4, init_std=-0.1), ValueError, "init_std must be a finite number >= 0.0"),
        (dict(max_len=4, dim=4, init_std="0.02"), TypeError, "init_std must be a real number, got str"),
    ])
    def test_bad_arguments(self, kwargs, error, message):
        with pytest.raises(error, match="LearnedPositionalEmbedding: " + message):
            LearnedPositionalEmbedding(**kwargs)

    def test_numpy_sizes_are_ints(self):
        numpy = pytest.importorskip("numpy")
        pe = LearnedPositionalEmbedding(numpy.int64(8), numpy.int32(4))
        assert type(pe.max_len) is int and pe.weight.shape == (8, 4)

    def test_resize_checks_prefix_and_mode(self):
        pe = LearnedPositionalEmbedding(10, 4)
        with pytest.raises(ValueError, match="num_prefix_tokens must be a non-negative int, got num_prefix_tokens=-1"):
            pe.resize(12, num_prefix_tokens=-1)
        with pytest.raises(ValueError, match="mode must be one of 'nearest'"):
            pe.resize(12, mode="cubic")

    @staticmethod
    def bicubic_oracle(table, old, new, antialias):
        """A row-major ``[h0 * w0, D]`` table resampled to ``new = (h, w)`` bicubically (pixel
        centres, ``align_corners=False``), in float64: each axis's weights one entry at a time,
        either the plain cubic convolution (``a = -0.75``, edge rows repeated) or, with
        ``antialias``, PIL's kernel (``a = -0.5``) stretched by the shrink factor and renormalised."""
        def cubic(x, a):
            x = abs(x)
            if x < 1:
                return ((a + 2) * x - (a + 3)) * x * x + 1
            return (((x - 5) * x + 8) * x - 4) * a if x < 2 else 0.0

        def axis_weights(n_in, n_out):                                     # [n_out, n_in]
            w, scale = torch.zeros(n_out, n_in, dtype=torch.float64), n_in / n_out
            for i in range(n_out):
                if antialias:
                    stretch, centre = max(scale, 1.0), (i + 0.5) * scale
                    for j in range(max(int(centre - 2 * stretch + 0.5), 0), min(int(centre + 2 * stretch + 0.5), n_in)):
                        w[i, j] = cubic((j + 0.5 - centre) / stretch, -0.5)
                    w[i] /= w[i].sum()
                else:
                    source = (i + 0.5) * scale - 0.5
                    first = math.floor(source)
                    for j in range(first - 1, first + 3):
                        w[i, min(max(j, 0), n_in - 1)] += cubic(source - j, -0.75)
            return w

        grid = table.double().reshape(*old, -1)                            # [h0, w0, D]
        out = torch.einsum("ij,jkd,lk->ild", axis_weights(old[0], new[0]), grid, axis_weights(old[1], new[1]))
        return out.reshape(new[0] * new[1], -1)                            # [h * w, D]

    @pytest.mark.parametrize("antialias", [False, True])
    @pytest.mark.parametrize("old, new", [((5, 5), (7, 7)), ((8, 6), (4, 3)), ((4, 6), (6, 4))])
    def test_resize_grid_antialias_matches_oracle(self, old, new, antialias):
        """Issue 22 item 13: ``antialias=`` (default False, today's kernel) against a plain oracle
        of both kernels, growing, shrinking and both at once, with a [CLS] row kept."""
        pe = LearnedPositionalEmbedding(1 + old[0] * old[1], 3)
        table = pe.weight.detach().clone()
        pe.resize(new, old_grid=old, num_prefix_tokens=1, antialias=antialias)
        torch.testing.assert_close(pe.weight.detach()[0], table[0], rtol=0, atol=0)
        want = self.bicubic_oracle(table[1:], old, new, antialias)
        torch.testing.assert_close(pe.weight.detach()[1:].double(), want, rtol=0, atol=2e-6)
        other = self.bicubic_oracle(table[1:], old, new, not antialias)
        assert (want - other).abs().max() > 1e-3   # the two kernels do differ here: the test can tell them apart
        if not antialias:
            default = LearnedPositionalEmbedding(1 + old[0] * old[1], 3)
            default.weight.data.copy_(table)
            torch.testing.assert_close(default.resize(new, old_grid=old, num_prefix_tokens=1).weight, pe.weight)

    @pytest.mark.parametrize("antialias", [False, True])
    def test_resize_grid_equals_timm_when_installed(self, antialias):
        """timm's ``resample_abs_pos_embed`` with the same ``antialias``, to the bit (timm needs a
        torchvision that matches torch; skipped otherwise)."""
        try:
            from timm.layers.pos_embed import resample_abs_pos_embed
        except Exception as error:   # absent, or present with a mismatched torchvision
            pytest.skip(f"timm unavailable: {error}")
        for old, new in [((14, 14), (20, 20)), ((24, 24), (12, 12)), ((6, 8), (9, 5))]:
            pe = LearnedPositionalEmbedding(1 + old[0] * old[1], 16)
            want = resample_abs_pos_embed(pe.weight.detach()[None].clone(), list(new), list(old),
                                          num_prefix_tokens=1, antialias=antialias)[0]
            pe.resize(new, old_grid=old, num_prefix_tokens=1, antialias=antialias)
            torch.testing.assert_close(pe.weight.detach(), want, rtol=0, atol=0)

    def test_resize_grid_equals_transformers_vit_interpolation(self):
        """transformers' ``ViTEmbeddings.interpolate_pos_encoding`` (bicubic, no antialias) to the bit."""
        transformers = pytest.importorskip("transformers")
        embeddings = transformers.models.vit.modeling_vit.ViTEmbeddings(
            transformers.ViTConfig(hidden_size=8, image_size=20, patch_size=4))   # a 5 x 5 grid + [CLS]
        with torch.no_grad():
            embeddings.position_embeddings.normal_()
            table = embeddings.position_embeddings.detach()[0].clone()                # [26, 8]
            want = embeddings.interpolate_pos_encoding(torch.zeros(1, 1 + 7 * 7, 8), 28, 28)[0]   # a 7 x 7 grid
        pe = LearnedPositionalEmbedding(26, 8)
        pe.weight.data.copy_(table)
        torch.testing.assert_close(pe.resize((7, 7), num_prefix_tokens=1).weight.detach(), want, rtol=0, atol=0)

    @pytest.mark.parametrize("call, error, message", [
        (lambda pe: pe.resize((4, 4), old_grid=(2.0, 4.0)), TypeError, "old_grid must be an int, got float 2.0"),
        (lambda pe: pe.resize((4, 4), old_grid=(8,)), ValueError, "old_grid must be an \\(h, w\\) pair"),
        (lambda pe: pe.resize((4, 4), old_grid=8), ValueError, "old_grid must be an \\(h, w\\) pair"),
        (lambda pe: pe.resize(12, old_grid=(2, 4)), ValueError, "old_grid describes a 2-D table"),
        (lambda pe: pe.resize((4, 4), old_grid=(2, 4), antialias=1), TypeError, "antialias must be a bool"),
        (lambda pe: pe.resize(12, antialias=True), ValueError, "antialias=True needs an \\(h, w\\) new_size"),
        (lambda pe: pe.resize((4, 4), old_grid=(2, 4), mode="nearest", antialias=True), ValueError,
         "antialias=True needs .* mode 'bilinear' or 'bicubic', got new_size=\\(4, 4\\), mode='nearest'"),
    ])
    def test_bad_resize_grid_arguments(self, call, error, message):
        """Issue 22 item 6: ``old_grid=(2.0, 4.0)`` raised reshape()'s TypeError naming neither."""
        pe = LearnedPositionalEmbedding(8, 4)
        before = pe.weight.detach().clone()
        with pytest.raises(error, match="LearnedPositionalEmbedding: " + message):
            call(pe)
        assert torch.equal(pe.weight.detach(), before) and pe.max_len == 8   # untouched

    def test_learned_embed_takes_any_integer_dtype_and_checks_the_device(self):
        pe = LearnedPositionalEmbedding(8, 4)
        positions = torch.tensor([0, 3, 7])
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
            torch.testing.assert_close(pe.embed(positions.to(dtype)), pe.weight[positions])
        with pytest.raises(ValueError, match=r"LearnedPositionalEmbedding: positions must be on the device of the "
                                             r"table \(cpu\), got positions on meta"):
            pe.embed(positions.to("meta"))


# ---------------------------------------------------------------------------
# NoPE
# ---------------------------------------------------------------------------


class TestNoPE:
    def test_identity_and_plain_sdpa(self):
        nope = NoPositionalEmbedding()
        x = torch.randn(B, N, 24)
        assert nope(x) is x and nope.forward_input(x) is x and nope(x, torch.arange(N), offset=3) is x
        q, k, v = qkv(dtype=torch.float64)
        for causal in (False, True):
            torch.testing.assert_close(attention(q, k, v, nope, causal=causal),
                                       F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        torch.testing.assert_close(nope.forward_attn(q, k), q @ k.transpose(-1, -2) / math.sqrt(DH))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="NoPositionalEmbedding: dim must be a positive int, got dim=0"):
            NoPositionalEmbedding(dim=0)
        nope = NoPositionalEmbedding(dim=8)
        with pytest.raises(ValueError, match="NoPositionalEmbedding: x must have last dim 8, got shape \\(2, 16, 9\\)"):
            nope(torch.randn(B, N, 9))
        with pytest.raises(TypeError, match="NoPositionalEmbedding: x must be a floating tensor"):
            nope(torch.zeros(B, N, 8, dtype=torch.long))
        with pytest.raises(ValueError, match="NoPositionalEmbedding: positions must have shape \\[16\\]"):
            nope(torch.randn(B, N, 8), torch.arange(N + 1))
        with pytest.raises(TypeError, match="NoPositionalEmbedding: offset must be an int"):
            nope(torch.randn(B, N, 8), offset=1.5)



    def test_offset_past_the_position_range_is_a_value_error(self):
        # arange(offset, offset + N) overflowed int64: torch's "value cannot be converted to type int64_t"
        with pytest.raises(ValueError, match="NoPositionalEmbedding: offset must keep the default positions offset "
                                             "\\.\\. offset \\+ N - 1 in \\[-2\\*\\*62 \\+ 1, 2\\*\\*62 - 1\\] "
                                             "\\(as given positions\\), got offset=9223372036854775808 with N=3"):
            NoPositionalEmbedding()(torch.randn(2, 3, 4), offset=2**63)
        x = torch.randn(3, 4)
        assert NoPositionalEmbedding()(x, offset=2**62 - 3) is x                          # the last that fits

# ---------------------------------------------------------------------------
# Convolutional (PEG, wav2vec 2.0)
# ---------------------------------------------------------------------------


def depthwise_conv_oracle(grid, weight, bias):
    """Zero-padded 'same' depthwise 2-D convolution, one output at a time (float64).
    grid [Hg, Wg, D], weight [D, 1, k, k] -> [Hg, Wg, D]; even k: pad k//2 and keep the first outputs."""
    rows, cols, dim = grid.shape
    k = weight.shape[-1]
    out = torch.zeros(rows, cols, dim, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            for ch in range(dim):
                total = float(bias[ch])
                for i in range(k):
                    for j in range(k):
                        rr, cc = r + i - k // 2, c + j - k // 2
                        if 0 <= rr < rows and 0 <= cc < cols:
                            total += float(weight[ch, 0, i, j]) * float(grid[rr, cc, ch])
                out[r, c, ch] = total
    return out


class TestConvolutional:
    @pytest.mark.parametrize("kernel_size", [3, 4])
    def test_matches_loop_oracle(self, kernel_size):
        pe = ConvolutionalPositionalEmbedding(3, kernel_size=kernel_size, num_prefix_tokens=1).double()
        x = torch.randn(2, 1 + 3 * 5, 3, dtype=torch.float64)
        got = pe(x, (3, 5))
        torch.testing.assert_close(got[:, 0], x[:, 0], rtol=0, atol=0)
        for b in range(2):
            grid = x[b, 1:].reshape(3, 5, 3)
            want = grid + depthwise_conv_oracle(grid, pe.weight.detach(), pe.bias.detach())
            torch.testing.assert_close(got[b, 1:], want.reshape(15, 3), rtol=0, atol=1e-12)

    def test_matches_timm_posconv_with_same_weights(self):
        # timm/models/twins.py PosConv (CPVT's PEG), ported: proj = Sequential(Conv2d(C, C, 3, 1, 1, groups=C)),
        # x = proj(feat) + feat, on the patch tokens (CPVT keeps the class token aside).
        dim, size = 8, (4, 6)
        proj = torch.nn.Sequential(torch.nn.Conv2d(dim, dim, 3, 1, 1, bias=True, groups=dim)).double()
        pe = ConvolutionalPositionalEmbedding(dim).double()
        with torch.no_grad():
            pe.weight.copy_(proj[0].weight)
            pe.bias.copy_(proj[0].bias)
        x = torch.randn(2, 24, dim, dtype=torch.float64)
        feat = x.transpose(1, 2).view(2, dim, *size)
        want = (proj(feat) + feat).flatten(2).transpose(1, 2)
        torch.testing.assert_close(pe(x, size), want, rtol=0, atol=1e-12)

    @pytest.mark.parametrize("kernel_size", [8, 7])
    def test_matches_transformers_wav2vec2_with_same_weights(self, kernel_size):
        transformers = pytest.importorskip("transformers")
        from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2PositionalConvEmbedding

        config = transformers.Wav2Vec2Config(hidden_size=32, num_conv_pos_embeddings=kernel_size,
                                             num_conv_pos_embedding_groups=4, feat_extract_activation="gelu")
        ref = Wav2Vec2PositionalConvEmbedding(config).double().eval()
        pe = ConvolutionalPositionalEmbedding(32, kernel_size=kernel_size, num_axes=1, groups=4, weight_norm=True,
                                              activation="gelu").double()
        with torch.no_grad():
            ref.conv.parametrizations.weight.original0.normal_()
            pe.weight_g.copy_(ref.conv.parametrizations.weight.original0)
            pe.weight_v.copy_(ref.conv.parametrizations.weight.original1)
            pe.bias.copy_(ref.conv.bias.normal_())
        x = torch.randn(2, 21, 32, dtype=torch.float64)
        torch.testing.assert_close(pe(x), x + ref(x), rtol=0, atol=1e-12)

    def test_init_follows_wav2vec2(self):
        pe = ConvolutionalPositionalEmbedding(64, kernel_size=16, num_axes=1, groups=4, weight_norm=True)
        torch.testing.assert_close(pe.conv_weight(), pe.weight_v.detach())          # g = |v| at init
        assert abs(pe.weight_v.std().item() - 2 / math.sqrt(16 * 64)) < 0.01
        assert (pe.bias == 0).all()

    def test_forward_input_uses_stored_grid(self):
        pe = ConvolutionalPositionalEmbedding(8, grid_shape=(2, 3))
        x = torch.randn(2, 6, 8)
        torch.testing.assert_close(pe.forward_input(x), pe(x, (2, 3)))
        assert not torch.allclose(pe(x, (2, 3)), pe(x, (3, 2)))

    def test_video_grid(self):
        pe = ConvolutionalPositionalEmbedding(4, num_axes=3).double()
        x = torch.randn(1, 2 * 3 * 4, 4, dtype=torch.float64)
        maps = x[0].T.reshape(1, 4, 2, 3, 4)
        want = maps + F.conv3d(maps, pe.weight, pe.bias, padding=1, groups=4)
        torch.testing.assert_close(pe(x, (2, 3, 4)), want.reshape(4, 24).T[None])

    def test_bad_input(self):
        with pytest.raises(ValueError, match="ConvolutionalPositionalEmbedding: groups must divide dim=12, got groups=5"):
            ConvolutionalPositionalEmbedding(12, groups=5)
        with pytest.raises(ValueError, match="ConvolutionalPositionalEmbedding: weight_norm is wav2vec 2.0's 1-D option"):
            ConvolutionalPositionalEmbedding(12, weight_norm=True)
        with pytest.raises(TypeError, match="ConvolutionalPositionalEmbedding: weight_norm must be a bool"):
            ConvolutionalPositionalEmbedding(12, num_axes=1, weight_norm="false")
        pe = ConvolutionalPositionalEmbedding(8, num_prefix_tokens=1)
        with pytest.raises(ValueError, match="ConvolutionalPositionalEmbedding: grid_shape is required for 2 axes"):
            pe(torch.randn(1, 7, 8))
        with pytest.raises(ValueError, match="ConvolutionalPositionalEmbedding: x must have num_prefix_tokens \\+ prod\\(grid_shape\\) = 1 \\+ 6 tokens"):
            pe(torch.randn(1, 6, 8), (2, 3))
        with pytest.raises(ValueError, match="ConvolutionalPositionalEmbedding: positions must be None"):
            pe.forward_input(torch.randn(1, 7, 8), torch.arange(7))

    @pytest.mark.parametrize("shape, grid", [((0, 5, 16), None), ((2, 0, 5, 16), None), ((0, 3, 4, 16), (2, 2))])
    def test_convolutional_peg_with_an_empty_batch_returns_empty(self, shape, grid):
        pe = ConvolutionalPositionalEmbedding(16, num_axes=1 if grid is None else 2)
        x = torch.randn(shape)
        out = pe(x, grid)
        assert out.shape == x.shape
        full = pe(torch.randn(1, *shape[-2:]), grid)   # and a non-empty batch still works
        assert full.shape == (1, *shape[-2:])


    def test_one_axis_without_grid_tokens_names_x(self):
        # the 1-D grid is taken from x: an empty x was blamed on grid_shape[0]=0, an argument not given
        for prefix, n in ((0, 0), (1, 1)):
            peg = ConvolutionalPositionalEmbedding(4, num_axes=1, num_prefix_tokens=prefix)
            with pytest.raises(ValueError, match=f"ConvolutionalPositionalEmbedding: x must have tokens past "
                                                 f"num_prefix_tokens={prefix} \\(the 1-D grid is the rest of the "
                                                 f"sequence\\), got shape \\(2, {n}, 4\\)"):
                peg(torch.randn(2, n, 4))

# ---------------------------------------------------------------------------
# Fourier features
# ---------------------------------------------------------------------------


class TestFourierFeatures:
    def test_octave_matches_nerf_formula(self):
        pe = FourierFeaturePositionalEmbedding(3, 24)                       # L = 4 octaves
        p = torch.rand(5, 3, dtype=torch.float64) * 2 - 1
        got = pe.embed(p)
        for n in range(5):
            row = []
            for k in range(4):
                row += [math.sin(2 ** k * math.pi * float(p[n, a])) for a in range(3)]
                row += [math.cos(2 ** k * math.pi * float(p[n, a])) for a in range(3)]
            torch.testing.assert_close(got[n], torch.tensor(row, dtype=torch.float64), rtol=0, atol=1e-12)

    def test_octave_with_scale_one_over_pi_is_nerf_pytorch(self):
        # nerf-pytorch Embedder (ported, include_input=False, log_sampling): bands 2 ** linspace(0, L - 1, L)
        x = torch.rand(7, 3, dtype=torch.float64)
        bands = 2.0 ** torch.linspace(0.0, 9.0, steps=10, dtype=torch.float64)
        want = torch.cat([fn(x * freq) for freq in bands for fn in (torch.sin, torch.cos)], -1)
        torch.testing.assert_close(FourierFeaturePositionalEmbedding(3, 60, scale=1 / math.pi).embed(x), want)

    def test_gaussian_matches_tancik_formula(self):
        pe = FourierFeaturePositionalEmbedding(2, 8, sampling="gaussian", scale=10.0)
        p = torch.rand(4, 2, dtype=torch.float64)
        got = pe.embed(p)
        for n in range(4):
            for j in range(4):
                angle = 2 * math.pi * sum(float(pe.B[j, a]) * float(p[n, a]) for a in range(2))
                assert got[n, j].item() == pytest.approx(math.cos(angle), abs=1e-12)
                assert got[n, 4 + j].item() == pytest.approx(math.sin(angle), abs=1e-12)

    def test_gaussian_B_is_reproducible_and_scaled(self):
        a = FourierFeaturePositionalEmbedding(2, 20000, sampling="gaussian", scale=3.0)
        assert abs(a.B.std().item() - 3.0) < 0.1 and abs(a.B.mean().item()) < 0.1
        torch.manual_seed(123)                                   # the global RNG plays no part
        b = FourierFeaturePositionalEmbedding(2, 20000, sampling="gaussian", scale=3.0)
        assert torch.equal(a.B, b.B) and a.B.dtype == torch.float64
        assert not torch.equal(a.B, FourierFeaturePositionalEmbedding(2, 20000, sampling="gaussian", scale=3.0,
                                                                      seed=1).B)
        with torch.device("meta"):
            meta = FourierFeaturePositionalEmbedding(2, 20000, sampling="gaussian", scale=3.0)
        meta.to_empty(device="cpu")
        meta.reset_parameters()
        assert torch.equal(meta.B, a.B) and list(meta.state_dict()) == []
        assert torch.equal(copy.deepcopy(a).bfloat16().B, a.B)

    def test_forward_adds_features_of_grid_coordinates(self):
        pe = FourierFeaturePositionalEmbedding(2, 16)
        x, p = torch.randn(2, 6, 16), rope_coordinates((2, 3))
        torch.testing.assert_close(pe(x, p), x + pe.embed(p).float())
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: positions is required for 2 axes"):
            pe(x)

    def test_bad_input(self):
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: dim must be a multiple of 6 for sampling='octave', got dim=16"):
            FourierFeaturePositionalEmbedding(3, 16)
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: sampling must be one of 'octave', 'gaussian'"):
            FourierFeaturePositionalEmbedding(2, 16, sampling="uniform")
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: scale must be a finite number > 0"):
            FourierFeaturePositionalEmbedding(2, 16, scale=0.0)
        with pytest.raises(TypeError, match="FourierFeaturePositionalEmbedding: seed must be an int"):
            FourierFeaturePositionalEmbedding(2, 16, seed=True)
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: positions must have shape \\[..., N, 2\\]"):
            FourierFeaturePositionalEmbedding(2, 16).embed(torch.rand(5, 3))

    def test_fourier_embed_rejects_non_finite_positions_like_forward(self):
        pe = FourierFeaturePositionalEmbedding(2, 16)
        bad = torch.tensor([[float("nan"), 0.0]])
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: positions must be finite"):
            pe.embed(bad)
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: positions must be finite"):
            pe(torch.randn(1, 16), bad)



    def test_one_token_batched_positions_stay_per_row(self):
        # [B, 1] positions of x [B, 1, D] used to reach embed as [N=B, A=1]: the output broadcast to [B, B, D]
        pe = FourierFeaturePositionalEmbedding(1, 4, scale=0.3)
        x, times = torch.randn(3, 1, 4), torch.tensor([[0.5], [1.25], [-2.0]])
        want = [[math.sin(math.pi * 0.3 * t), math.cos(math.pi * 0.3 * t),
                 math.sin(2 * math.pi * 0.3 * t), math.cos(2 * math.pi * 0.3 * t)] for t in (0.5, 1.25, -2.0)]
        got = pe(x, times)
        assert got.shape == (3, 1, 4)
        torch.testing.assert_close(got, x + torch.tensor(want).unsqueeze(1), rtol=1e-6, atol=1e-6)

    def test_zero_dim_positions_are_a_value_error(self):
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: positions must have shape "
                                             "\\[..., N, 1\\], got \\(\\)"):
            FourierFeaturePositionalEmbedding(1, 4).embed(torch.tensor(1.0))


    def test_seed_past_the_generator_range_is_a_value_error(self):
        with pytest.raises(ValueError, match="FourierFeaturePositionalEmbedding: seed must lie in \\[-2\\*\\*63, "
                                             "2\\*\\*64 - 1\\] \\(a torch.Generator seed\\), got seed=" + str(2**64)):
            FourierFeaturePositionalEmbedding(1, 4, sampling="gaussian", seed=2**64)
        edge = FourierFeaturePositionalEmbedding(1, 4, sampling="gaussian", seed=2**64 - 1)
        torch.testing.assert_close(edge.B, torch.randn(2, 1, generator=torch.Generator().manual_seed(2**64 - 1),
                                                       dtype=torch.float64), rtol=0, atol=0)


    def test_overflowing_angles_are_a_value_error(self):
        # 1025 octaves: the top band 2**1024 pi is inf in float64, so every feature was NaN (0 * inf); huge
        # float64 positions overflowed the angle likewise
        match = "FourierFeaturePositionalEmbedding: positions times the frequencies must stay finite in float64 \\(cos / sin of inf is NaN\\)"
        with pytest.raises(ValueError, match=match):
            FourierFeaturePositionalEmbedding(1, 2050).embed(torch.tensor([0.0, 0.5]))
        with pytest.raises(ValueError, match=match):
            FourierFeaturePositionalEmbedding(1, 8).embed(torch.tensor([1e308], dtype=torch.float64))
        with pytest.raises(ValueError, match=match):
            FourierFeaturePositionalEmbedding(1, 8, sampling="gaussian", scale=1e300).embed(
                torch.tensor([1e300], dtype=torch.float64))
        assert torch.isfinite(FourierFeaturePositionalEmbedding(1, 2046).embed(torch.tensor([0.0, 0.5]))).all()

# ---------------------------------------------------------------------------
# Learnable Fourier features
# ---------------------------------------------------------------------------


def learnable_fourier_oracle(pe: LearnableFourierPositionalEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 of Li et al. 2021, token by token and group by group, in float64: ``[N, A]`` -> ``[N, D]``."""
    wr = pe.Wr.weight.detach().double()                                     # [F/2, M]
    w1, b1, w2, b2 = (t.detach().double() for t in (pe.mlp[0].weight, pe.mlp[0].bias, pe.mlp[2].weight, pe.mlp[2].bias))
    half, m = wr.shape
    rows = []
    for point in positions.double():
        row = []
        for g in range(pe.groups):
            x = point[g * m:(g + 1) * m]
            angles = [sum(float(wr[f, a]) * float(x[a]) for a in range(m)) for f in range(half)]
            features = torch.tensor([math.cos(t) for t in angles] + [math.sin(t) for t in angles],
                                    dtype=torch.float64) / math.sqrt(2 * half)
            hidden = w1 @ features + b1
            hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))   # exact GELU
            row.append(w2 @ hidden + b2)
        rows.append(torch.cat(row))
    return torch.stack(rows)


class TestLearnableFourier:
    @pytest.mark.parametrize("groups,num_axes", [(1, 1), (1, 3), (2, 4), (3, 3)])
    def test_matches_algorithm_1(self, groups, num_axes):
        torch.manual_seed(0)
        pe = LearnableFourierPositionalEmbedding(num_axes, 6 * groups, fourier_dim=10, hidden_dim=5, groups=groups,
                                                 gamma=0.5)
        positions = torch.randn(7, num_axes, dtype=torch.float64) * 3
        torch.testing.assert_close(pe.embed(positions), learnable_fourier_oracle(pe, positions), rtol=0, atol=1e-12)
        x = torch.randn(2, 7, 6 * groups)
        one_axis = positions.squeeze(-1) if num_axes == 1 else positions           # forward takes [N] for one axis
        torch.testing.assert_close(pe(x, one_axis.float()), x + learnable_fourier_oracle(pe, positions).float(),
                                   rtol=1e-5, atol=1e-5)

    def test_groups_are_independent(self):
        pe = LearnableFourierPositionalEmbedding(4, 8, groups=2)
        p = torch.rand(5, 4)
        moved = p.clone()
        moved[:, 2:] += 1.0                                                 # only the second group
        a, b = pe.embed(p), pe.embed(moved)
        assert torch.equal(a[:, :4], b[:, :4]) and not torch.allclose(a[:, 4:], b[:, 4:])

    def test_matches_the_pypi_port_with_the_same_weights(self):
        port = pytest.importorskip("learnable_fourier_positional_encoding")
        torch.manual_seed(0)
        ref = port.LearnableFourierPositionalEncoding(3, 17, 128, 32, 96, 10.0)   # G, M, F, H, D, gamma
        ours = LearnableFourierPositionalEmbedding(51, 96, fourier_dim=128, hidden_dim=32, groups=3, gamma=10.0)
        ours.load_state_dict(ref.state_dict())                              # the port's names: Wr, mlp.0, mlp.2
        x = torch.randn(97, 3, 17)
        torch.testing.assert_close(ours.embed(x.flatten(-2)), ref(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.embed(x.flatten(-2).double()),
                                   learnable_fourier_oracle(ours, x.flatten(-2)), rtol=0, atol=1e-12)

    def test_init_conventions(self):
        # the paper draws W_r from N(0, gamma^-2) (a variance: std 1/gamma); the port uses std gamma^-2
        torch.manual_seed(0)
        paper = LearnableFourierPositionalEmbedding(1, 4, fourier_dim=40000, hidden_dim=2, gamma=2.0)
        port = LearnableFourierPositionalEmbedding(1, 4, fourier_dim=40000, hidden_dim=2, gamma=2.0, init="port")
        assert paper.Wr.weight.std().item() == pytest.approx(0.5, rel=0.03)
        assert port.Wr.weight.std().item() == pytest.approx(0.25, rel=0.03)

    def test_bad_input(self):
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: groups must divide num_axes and "
                                             "dim, got groups=2, num_axes=3, dim=8"):
            LearnableFourierPositionalEmbedding(3, 8, groups=2)
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: positions must have shape "
                                             "\\[..., N, 2\\], got \\(5, 3\\)"):
            LearnableFourierPositionalEmbedding(2, 8).embed(torch.rand(5, 3))
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: positions is required for 2 axes"):
            LearnableFourierPositionalEmbedding(2, 8)(torch.randn(1, 5, 8))



    def test_one_token_batched_positions_stay_per_row(self):
        # [B, 1] positions of x [B, 1, D] used to reach embed as [N=B, A=1]: the output broadcast to [B, B, D]
        torch.manual_seed(0)
        pe = LearnableFourierPositionalEmbedding(1, 6, fourier_dim=4, hidden_dim=5)
        x, times = torch.randn(3, 1, 6), torch.tensor([[0.5], [1.25], [-2.0]])
        got = pe(x, times)
        assert got.shape == (3, 1, 6)
        want = learnable_fourier_oracle(pe, times).float().unsqueeze(1)                     # [3, 1, 6]
        torch.testing.assert_close(got, x + want, rtol=1e-5, atol=1e-5)


    def test_gamma_whose_std_overflows_is_a_value_error(self):
        # init="port": gamma ** -2 raised Python's OverflowError in reset_parameters
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: gamma must leave W_r's standard "
                                             "deviation \\(gamma \\*\\* -2\\) finite, got gamma=1e-200"):
            LearnableFourierPositionalEmbedding(1, 4, gamma=1e-200, init="port")
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: gamma must leave W_r's standard "
                                             "deviation \\(1 / gamma\\) finite, got gamma=5e-324"):
            LearnableFourierPositionalEmbedding(1, 4, gamma=5e-324)


    def test_overflowing_angles_are_a_value_error(self):
        pe = LearnableFourierPositionalEmbedding(1, 4)
        with torch.no_grad():
            pe.Wr.weight.fill_(10.0)
        with pytest.raises(ValueError, match="LearnableFourierPositionalEmbedding: positions times the frequencies must stay finite in float64 \\(cos / sin of inf is NaN\\)"):
            pe.embed(torch.tensor([1e308], dtype=torch.float64))                       # NaN features before

# ---------------------------------------------------------------------------
# Time2Vec
# ---------------------------------------------------------------------------


def time2vec_oracle(pe: Time2VecPositionalEmbedding, times: torch.Tensor) -> torch.Tensor:
    """The paper's t2v, component by component in float64: times ``[N, A]`` -> ``[N, D]``."""
    periodic = math.sin if pe.activation == "sin" else math.cos
    omega, phi = pe.omega.detach().double(), pe.phi.detach().double()
    rows = []
    for tau in times.double():
        z = [sum(float(omega[a, i]) * float(tau[a]) for a in range(len(tau))) + float(phi[i]) for i in range(pe.dim)]
        rows.append([z[0]] + [periodic(v) for v in z[1:]])
    return torch.tensor(rows, dtype=torch.float64)


class TestTime2Vec:
    @pytest.mark.parametrize("activation,num_axes", [("sin", 1), ("cos", 1), ("sin", 3)])
    def test_matches_the_paper_formula(self, activation, num_axes):
        torch.manual_seed(0)
        pe = Time2VecPositionalEmbedding(9, num_axes=num_axes, activation=activation)
        times = torch.rand(6, num_axes, dtype=torch.float64) * 50
        torch.testing.assert_close(pe.embed(times), time2vec_oracle(pe, times), rtol=0, atol=1e-12)

    def test_irregular_times_and_batches(self):
        pe = Time2VecPositionalEmbedding(8)
        times = torch.tensor([[0.0, 0.7, 3.2, 3.3], [1.0, 1.5, 2.0, 9.5]])
        x = torch.randn(2, 4, 8)
        want = torch.stack([time2vec_oracle(pe, t.unsqueeze(-1)) for t in times]).float()
        torch.testing.assert_close(pe(x, times), x + want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pe(x), x + time2vec_oracle(pe, torch.arange(4.0).unsqueeze(-1)).float(),
                                   rtol=1e-6, atol=1e-6)                   # default: arange(N)

    def test_linear_component_is_linear_and_the_rest_periodic(self):
        pe = Time2VecPositionalEmbedding(6)
        period = 2 * math.pi / pe.omega[0, 3].double().item()
        t = torch.tensor([0.3, 1.3, 2.3], dtype=torch.float64)
        z = pe.embed(t)
        assert (z[2, 0] - 2 * z[1, 0] + z[0, 0]).abs().item() < 1e-12
        assert (z[:, 1:].abs() <= 1).all()
        shifted = pe.embed(t + period)
        torch.testing.assert_close(shifted[:, 3], z[:, 3], rtol=0, atol=1e-9)

    def test_large_times_keep_float32_accuracy(self):
        pe = Time2VecPositionalEmbedding(16)
        times = torch.tensor([1e6, 1e6 + 0.5, 3.25e6])
        want = time2vec_oracle(pe, times.unsqueeze(-1))
        got = pe.embed(times)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got[:, 1:].double(), want[:, 1:], rtol=0, atol=1e-7)
        torch.testing.assert_close(got[:, 0].double(), want[:, 0], rtol=1e-7, atol=0)

    def test_gradients_match_the_derivative(self):
        pe = Time2VecPositionalEmbedding(5)
        t = torch.tensor([0.5, 2.0, 7.25])
        pe.embed(t).sum().backward()
        z = (t.double().unsqueeze(-1) * pe.omega.double() + pe.phi.double()).detach()   # [N, D]
        want_omega = torch.cat([t.double().sum().view(1), (t.double().unsqueeze(-1) * z[:, 1:].cos()).sum(0)])
        want_phi = torch.cat([torch.tensor([3.0], dtype=torch.float64), z[:, 1:].cos().sum(0)])
        torch.testing.assert_close(pe.omega.grad[0].double(), want_omega, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pe.phi.grad.double(), want_phi, rtol=1e-6, atol=1e-6)

    def test_bad_input(self):
        with pytest.raises(ValueError, match="Time2VecPositionalEmbedding: dim must be at least 2 \\(one linear and "
                                             "one periodic component\\), got dim=1"):
            Time2VecPositionalEmbedding(1)
        with pytest.raises(ValueError, match="Time2VecPositionalEmbedding: positions must be finite"):
            Time2VecPositionalEmbedding(4).embed(torch.tensor([0.0, float("nan")]))
        with pytest.raises(TypeError, match="Time2VecPositionalEmbedding: positions must be an integer or float tensor"):
            Time2VecPositionalEmbedding(4).embed(torch.tensor([True]))



    def test_one_token_batched_positions_stay_per_row(self):
        # [B, 1] positions of x [B, 1, D] used to reach embed as [N=B, A=1]: the output broadcast to [B, B, D]
        pe = Time2VecPositionalEmbedding(5)
        x, times = torch.randn(3, 1, 5), torch.tensor([[0.5], [1.25], [-2.0]])
        got = pe(x, times)
        assert got.shape == (3, 1, 5)
        torch.testing.assert_close(got, x + time2vec_oracle(pe, times).float().unsqueeze(1), rtol=1e-6, atol=1e-6)


    def test_times_overflowing_the_linear_component_are_a_value_error(self):
        # omega_0 * tau past float32's range gave an inf feature silently (float64 times: NaN-free but inf)
        pe = Time2VecPositionalEmbedding(4)
        with torch.no_grad():
            pe.omega.fill_(2.0)
        with pytest.raises(ValueError, match="Time2VecPositionalEmbedding: positions must keep omega \\. tau \\+ phi "
                                             "finite in torch.float32 \\(the linear component\\), got times up to 3e\\+38"):
            pe.embed(torch.tensor([3e38, 0.0]))
        with pytest.raises(ValueError, match="Time2VecPositionalEmbedding: positions must keep omega \\. tau \\+ phi "
                                             "finite in torch.float64"):
            pe.embed(torch.tensor([1e308, 0.0], dtype=torch.float64))
        assert torch.isfinite(pe.embed(torch.tensor([1e38, 0.0]))).all()                 # 2e38 still fits float32

# ---------------------------------------------------------------------------
# Numbers: Abacus embeddings, digit places for position coupling
# ---------------------------------------------------------------------------


def digit_places_oracle(tokens: list, digits: set, count_from: str = "start") -> list:
    """Each token's place in its run of digits (1, 2, ...), 0 elsewhere, by walking the list."""
    order = tokens if count_from == "start" else tokens[::-1]
    places, run = [], 0
    for token in order:
        run = run + 1 if token in digits else 0
        places.append(run)
    return places if count_from == "start" else places[::-1]


class TestAbacus:
    @pytest.mark.parametrize("count_from", ["start", "end"])
    def test_digit_positions_match_the_oracle(self, count_from):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 14, (3, 40), generator=g)                                 # 0..9 digits, 10..13 others
        got = digit_positions(tokens, range(10), count_from=count_from)
        want = [digit_places_oracle(row, set(range(10)), count_from) for row in tokens.tolist()]
        assert got.tolist() == want and got.dtype == torch.int64
        assert digit_positions(tokens[0], torch.arange(10), count_from=count_from).tolist() == want[0]

    def test_digit_positions_bad_shapes_and_ids(self):
        """A 0-d token tensor was a TypeError saying only "got torch.int64"; an id past int64 raised torch's
        "Overflow when unpacking long long" without the function's name."""
        with pytest.raises(ValueError, match=r"^digit_positions: token_ids must have shape \[\.\.\., N\], got shape \(\)"):
            digit_positions(torch.tensor(3), range(10))
        with pytest.raises(ValueError, match=r"^digit_positions: digit_ids must be token ids within int64"):
            digit_positions(torch.tensor([3]), [3, 2**70])
        extremes = torch.tensor([2**63 - 1, -2**63, 5, 2**63 - 1])
        assert digit_positions(extremes, [2**63 - 1, -2**63]).tolist() == [1, 2, 0, 1]

    def test_position_coupling_aligns_significance(self):
        # "0653+0049=0702", most significant digit first: digits of equal significance share a place
        plus, equals = 10, 11
        tokens = torch.tensor([0, 6, 5, 3, plus, 0, 0, 4, 9, equals, 0, 7, 0, 2])
        assert digit_positions(tokens, range(10), count_from="end").tolist() == \
            [4, 3, 2, 1, 0, 4, 3, 2, 1, 0, 4, 3, 2, 1]

    def test_embed_eval_and_training_offsets(self):
        pe = AbacusPositionalEmbedding(6, range(10), max_len=32, max_k=5, generator=torch.Generator().manual_seed(0))
        places = digit_positions(torch.tensor([[3, 5, 6, 10, 9, 4, 11, 2]]), range(10))      # [[1, 2, 3, 0, 1, 2, 0, 1]]
        table = pe.embedding.weight
        torch.testing.assert_close(pe.eval().embed(places), table[places], rtol=0, atol=0)
        pe.train()
        offsets = set()
        for _ in range(60):
            codes = pe.embed(places)
            ks = [k for k in range(6) if torch.equal(codes, table[torch.where(places > 0, places + k, places)])]
            assert len(ks) == 1                                                             # one k moves every digit
            offsets.add(ks[0])
        assert offsets == set(range(6))                                                     # k is uniform on 0..max_k
        x = torch.randn(1, 8, 6)
        pe.eval()
        torch.testing.assert_close(pe(x, places), x + table[places])

    @pytest.mark.parametrize("digit_ids", [[1.5, 2.7], "0123456789", "0123", [], [True, False], 7,
                                           torch.tensor([1.0, 2.0]), torch.zeros(2, 5, dtype=torch.long)],
                             ids=["floats", "string", "short_string", "empty", "bools", "int", "float_tensor", "2d"])
    def test_digit_ids_are_one_check_for_the_module_and_the_function(self, digit_ids):
        # the module truncated floats, took a string's characters as ids and accepted no digits at all
        want = "digit_ids must be a non-empty sequence of ints, got "
        with pytest.raises(TypeError, match="^AbacusPositionalEmbedding: " + want):
            AbacusPositionalEmbedding(4, digit_ids)
        with pytest.raises(TypeError, match="^digit_positions: " + want):
            digit_positions(torch.tensor([1, 2]), digit_ids)

    def test_digit_ids_accepted_forms(self):
        np = pytest.importorskip("numpy")
        for ids in (range(3), (0, 1, 2), torch.arange(3), [np.int64(0), np.int64(1), np.int64(2)]):
            pe = AbacusPositionalEmbedding(4, ids)
            assert pe.digit_ids == (0, 1, 2) and all(type(i) is int for i in pe.digit_ids)
            assert digit_positions(torch.tensor([2, 5, 0, 1]), ids).tolist() == [1, 0, 1, 2]

    def test_the_offset_and_the_rows_read_are_public(self):
        """draw_digit_offset() draws the k a training call uses (the same generator stream), table_rows gives the
        rows read (p + k for digits, 0 for other tokens: a plain loop), and embed takes an explicit k."""
        places = torch.tensor([[1, 2, 3, 0, 1, 2, 0, 1]])
        pe = AbacusPositionalEmbedding(6, range(10), max_len=32, max_k=5, generator=torch.Generator().manual_seed(0))
        twin = AbacusPositionalEmbedding(6, range(10), max_len=32, max_k=5, generator=torch.Generator().manual_seed(0))
        table = pe.embedding.weight
        for _ in range(20):
            k = twin.draw_digit_offset()
            assert k.dtype == torch.int64 and k.dim() == 0 and 0 <= int(k) <= 5
            want = [[p + int(k) if p > 0 else 0 for p in row] for row in places.tolist()]
            assert pe.table_rows(places).tolist() == want                               # the draw it makes itself
            torch.testing.assert_close(pe.embed(places, digit_offset=k), table[torch.tensor(want)], rtol=0, atol=0)
        pe.eval()
        state = pe.generator.get_state()
        assert int(pe.draw_digit_offset()) == 0 and pe.table_rows(places).tolist() == places.tolist()
        assert torch.equal(pe.generator.get_state(), state)                              # eval draws nothing
        assert pe.table_rows(places, digit_offset=3).tolist() == [[4, 5, 6, 0, 4, 5, 0, 4]]   # given: any mode
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: digit_offset must be a non-negative int, "
                                             "got digit_offset=-1"):
            pe.embed(places, digit_offset=-1)
        with pytest.raises(TypeError, match="AbacusPositionalEmbedding: digit_offset must be an int, got float 2.5"):
            pe.table_rows(places, digit_offset=2.5)
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: positions \\+ the training offset k must lie"):
            pe.table_rows(places, digit_offset=29)

    def test_reference_state_dict_loads(self):
        # the reference module keeps its table as self.embedding (nn.Embedding(max_seq_length, dim))
        reference = {"embedding.weight": torch.randn(40, 8)}
        pe = AbacusPositionalEmbedding(8, range(10), max_len=40, max_k=9)
        pe.load_state_dict(reference)
        assert torch.equal(pe.eval().embed(torch.tensor([0, 1, 2])), reference["embedding.weight"][:3])

    def test_bad_input(self):
        pe = AbacusPositionalEmbedding(4, range(10), max_len=8, max_k=3)
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: positions is required \\(no default\\): "
                                             "digit_positions\\(token_ids\\)"):
            pe(torch.randn(1, 5, 4))
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: positions must lie in \\[0, max_len=8\\), "
                                             "got position 8"):
            pe.eval().embed(torch.tensor([1, 8]))
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: positions \\+ the training offset k must lie"):
            AbacusPositionalEmbedding(4, range(10), max_len=8, max_k=6).embed(torch.tensor([7] * 50))
        with pytest.raises(TypeError, match="AbacusPositionalEmbedding: positions must be an integer tensor"):
            pe.embed(torch.tensor([1.0]))
        with pytest.raises(ValueError, match="AbacusPositionalEmbedding: max_k must be below max_len - 1"):
            AbacusPositionalEmbedding(4, range(10), max_len=8, max_k=7)
        with pytest.raises(TypeError, match="digit_positions: token_ids must be an integer tensor"):
            digit_positions(torch.tensor([1.0, 2.0]), range(10))
        with pytest.raises(TypeError, match="digit_positions: digit_ids must be a non-empty sequence of ints"):
            digit_positions(torch.tensor([1, 2]), [])
        with pytest.raises(ValueError, match="digit_positions: count_from must be one of 'start', 'end'"):
            digit_positions(torch.tensor([1, 2]), range(10), count_from="left")



    def test_digit_offset_past_the_table_is_a_value_error(self):
        # 2**63 raised torch's "Overflow when unpacking long long"
        abacus = AbacusPositionalEmbedding(4, range(10), max_len=16, max_k=5)
        for k in (15, 2**63):
            with pytest.raises(ValueError, match=f"AbacusPositionalEmbedding: digit_offset must be at most max_len - 2 "
                                                 f"= 14 \\(room for place 1\\), got digit_offset={k}"):
                abacus.embed(torch.tensor([1, 0]), digit_offset=k)
        torch.testing.assert_close(abacus.embed(torch.tensor([1, 0]), digit_offset=14),
                                   abacus.embedding.weight[[15, 0]], rtol=0, atol=0)

# ---------------------------------------------------------------------------
# Graphs: Laplacian eigenvectors, random walks
# ---------------------------------------------------------------------------


def random_graph(n: int, p: float, seed: int, weighted: bool = False, directed: bool = False) -> torch.Tensor:
    """A random graph's adjacency [n, n] (float64) with a ring inside, so it is connected."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.rand(n, n, generator=g) < p).double()
    if weighted:
        a = a * (0.5 + torch.rand(n, n, generator=g, dtype=torch.float64))
    a.fill_diagonal_(0)
    for i in range(n):
        a[i, (i + 1) % n] = 1.0
    return a if directed else torch.triu(a, 1) + torch.triu(a, 1).T


def random_walk_oracle(adjacency: torch.Tensor, k: int) -> torch.Tensor:
    """[P_ii, (P^2)_ii, ...] with P[i, j] = A[i, j] / sum_j A[i, j] (a zero row stays zero), by plain loops
    in float64."""
    n = adjacency.shape[0]
    a = adjacency.tolist()
    p = [[a[i][j] / sum(a[i]) if sum(a[i]) > 0 else 0.0 for j in range(n)] for i in range(n)]
    walk, out = [row[:] for row in p], []
    for _ in range(k):
        out.append([walk[i][i] for i in range(n)])
        walk = [[sum(walk[i][m] * p[m][j] for m in range(n)) for j in range(n)] for i in range(n)]
    return torch.tensor(out, dtype=torch.float64).T                                  # [n, k]


def normalised_laplacian_oracle(adjacency: torch.Tensor) -> torch.Tensor:
    """I - D^-1/2 A D^-1/2 entry by entry (an isolated node's row is e_i), float64."""
    n = adjacency.shape[0]
    degree = [float(adjacency[i].sum()) for i in range(n)]
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            scale = 0.0 if degree[i] == 0 or degree[j] == 0 else 1 / math.sqrt(degree[i] * degree[j])
            out[i, j] = (1.0 if i == j else 0.0) - float(adjacency[i, j]) * scale
    return out


def jacobi_eigh(matrix: torch.Tensor, sweeps: int = 30) -> tuple:
    """Eigenvalues (ascending, a list) and eigenvectors (columns, float64) of a symmetric matrix by
    cyclic Jacobi rotations in plain Python: an oracle independent of LAPACK."""
    n = matrix.shape[0]
    a, v = matrix.tolist(), [[float(i == j) for j in range(n)] for i in range(n)]
    for _ in range(sweeps):
        if sum(a[i][j] ** 2 for i in range(n) for j in range(n) if i != j) < 1e-30:
            break
        for p in range(n):
            for q in range(p + 1, n):
                if abs(a[p][q]) < 1e-300:
                    continue
                theta = (a[q][q] - a[p][p]) / (2 * a[p][q])
                t = math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1))
                c = 1 / math.sqrt(t * t + 1)
                s = t * c
                for k in range(n):                                                          # A <- A J
                    akp, akq = a[k][p], a[k][q]
                    a[k][p], a[k][q] = c * akp - s * akq, s * akp + c * akq
                for k in range(n):                                                          # A <- J^T A
                    apk, aqk = a[p][k], a[q][k]
                    a[p][k], a[q][k] = c * apk - s * aqk, s * apk + c * aqk
                for k in range(n):                                                          # V <- V J
                    vkp, vkq = v[k][p], v[k][q]
                    v[k][p], v[k][q] = c * vkp - s * vkq, s * vkp + c * vkq
    order = sorted(range(n), key=lambda i: a[i][i])
    vectors = torch.tensor(v, dtype=torch.float64)[:, order]
    return [a[i][i] for i in order], vectors


def same_up_to_sign(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    """Columns of a equal those of b, each up to its sign."""
    signs = torch.where((a * b).sum(0) < 0, -1.0, 1.0).to(a.dtype)
    torch.testing.assert_close(a * signs, b.to(a.dtype), rtol=0, atol=atol)


class TestGraphEncodings:
    def test_random_walk_matches_the_loop_oracle(self):
        light = random_graph(9, 0.3, 1, weighted=True, directed=True) * 0.1               # weighted degrees below 1
        for adjacency in (random_graph(9, 0.3, 0), random_graph(9, 0.3, 1, weighted=True, directed=True), light):
            got = RandomWalkPositionalEmbedding(8, 5).graph_positions(adjacency)
            torch.testing.assert_close(got, random_walk_oracle(adjacency, 5), rtol=0, atol=1e-12)
        doubled = torch.tensor([[0, 0, 1, 2], [1, 1, 0, 0]])                               # 0 -> 1 twice: weight 2
        torch.testing.assert_close(
            RandomWalkPositionalEmbedding(8, 3).graph_positions(edge_index=doubled, num_nodes=3).double(),
            random_walk_oracle(torch.tensor([[0.0, 2, 0], [1, 0, 0], [1, 0, 0]]), 3))

    def test_random_walk_matches_pyg_on_unweighted_graphs(self):
        # PyG 2.8.1 drops edge weights (pyg-team #10098), so only unweighted graphs are compared
        pyg = pytest.importorskip("torch_geometric.transforms")
        data_cls = pytest.importorskip("torch_geometric.data").Data
        for seed, directed in ((0, True), (1, False)):
            edge_index = random_graph(15, 0.25, seed, directed=directed).nonzero().T
            want = pyg.AddRandomWalkPE(6)(data_cls(edge_index=edge_index, num_nodes=15)).random_walk_pe
            got = RandomWalkPositionalEmbedding(8, 6).graph_positions(edge_index=edge_index, num_nodes=15)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    def test_laplacian_eigenvectors_against_the_oracle_laplacian(self):
        adjacency = random_graph(10, 0.3, 2)
        laplacian = normalised_laplacian_oracle(adjacency)
        values, reference = jacobi_eigh(laplacian)
        vectors = LaplacianPositionalEmbedding(8, 4).graph_positions(adjacency)             # [10, 4]
        assert vectors.dtype == torch.float64
        torch.testing.assert_close(vectors.T @ vectors, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
        for j in range(4):                                                                  # L v = lambda v
            torch.testing.assert_close(laplacian @ vectors[:, j], values[j + 1] * vectors[:, j], rtol=0, atol=1e-12)
        same_up_to_sign(vectors, reference[:, 1:5], atol=1e-10)

    def test_laplacian_of_a_cycle_has_the_closed_form_spectrum(self):
        # the cycle C_n: L = I - A / 2, eigenvalues 1 - cos(2 pi j / n)
        n = 12
        ring = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            ring[i, (i + 1) % n] = ring[(i + 1) % n, i] = 1.0
        vectors = LaplacianPositionalEmbedding(8, 5).graph_positions(ring)
        rayleigh = ((vectors * (normalised_laplacian_oracle(ring) @ vectors)).sum(0)).tolist()
        want = [1 - math.cos(2 * math.pi * j / n) for j in (1, 1, 2, 2, 3)]
        assert rayleigh == pytest.approx(want, abs=1e-12)

    def test_laplacian_matches_pyg_up_to_sign(self):
        pyg = pytest.importorskip("torch_geometric.transforms")
        data_cls = pytest.importorskip("torch_geometric.data").Data
        adjacency = random_graph(20, 0.2, 3)
        values, _ = jacobi_eigh(normalised_laplacian_oracle(adjacency))
        assert min(b - a for a, b in zip(values[:6], values[1:7])) > 1e-3                    # distinct: sign is the only freedom
        edge_index = adjacency.nonzero().T
        torch.manual_seed(0)
        want = pyg.AddLaplacianEigenvectorPE(5, is_undirected=True)(data_cls(edge_index=edge_index, num_nodes=20))
        got = LaplacianPositionalEmbedding(8, 5).graph_positions(edge_index=edge_index, num_nodes=20)
        same_up_to_sign(got.double(), want.laplacian_eigenvector_pe, atol=1e-5)

    def test_small_graphs_pad_and_isolated_nodes(self):
        path = torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 0]])                           # node 2 isolated
        vectors = LaplacianPositionalEmbedding(4, 4).graph_positions(path)
        assert vectors.shape == (3, 4) and torch.equal(vectors[:, 2:], torch.zeros(3, 2))
        torch.testing.assert_close(normalised_laplacian_oracle(path)[2], torch.tensor([0.0, 0, 1], dtype=torch.float64))
        returns = RandomWalkPositionalEmbedding(4, 3).graph_positions(path)
        torch.testing.assert_close(returns[2], torch.zeros(3))                              # no walk from an isolated node
        torch.testing.assert_close(returns[0], torch.tensor([0.0, 1, 0]))

    def test_edge_index_dense_and_batched_agree(self):
        adjacency = torch.stack([random_graph(7, 0.4, seed) for seed in (4, 5)])
        for pe in (LaplacianPositionalEmbedding(8, 3), RandomWalkPositionalEmbedding(8, 4)):
            batched = pe.graph_positions(adjacency)                                         # [2, 7, A]
            for b in range(2):
                edges = adjacency[b].nonzero().T
                torch.testing.assert_close(pe.graph_positions(edge_index=edges, num_nodes=7).double(), batched[b])
            x = torch.randn(2, 7, 8)
            torch.testing.assert_close(pe.eval()(x, batched.float()), x + pe.embed(batched.float()))

    def test_a_batch_vector_gives_each_graph_its_own_positions_as_pyg(self):
        """PyG's batch (node -> graph): three graphs in one edge_index (two of one size), each with the
        positions PyG's transforms give it alone (random walks exactly, eigenvectors up to sign), in any node
        order. A dense batch padded to one size would change the Laplacian's (the padding joins the spectrum)."""
        pyg = pytest.importorskip("torch_geometric.transforms")
        data_cls = pytest.importorskip("torch_geometric.data").Data
        graphs = [random_graph(8, 0.3, 10), random_graph(11, 0.3, 11), random_graph(8, 0.3, 12)]
        for adjacency in graphs:                                            # distinct: sign is the only freedom
            values, _ = jacobi_eigh(normalised_laplacian_oracle(adjacency))
            assert min(b - a for a, b in zip(values[:4], values[1:5])) > 1e-2
        starts = [0, 8, 19]
        edge_index = torch.cat([a.nonzero().T + start for a, start in zip(graphs, starts)], 1)
        batch = torch.cat([torch.full((a.shape[0],), g) for g, a in enumerate(graphs)])
        lap, walk = LaplacianPositionalEmbedding(8, 3), RandomWalkPositionalEmbedding(8, 4)
        vectors = lap.graph_positions(edge_index=edge_index, batch=batch)                  # [27, 3]
        returns = walk.graph_positions(edge_index=edge_index, batch=batch)                 # [27, 4]
        assert vectors.shape == (27, 3) and returns.dtype == torch.float32
        for adjacency, start in zip(graphs, starts):
            data = data_cls(edge_index=adjacency.nonzero().T, num_nodes=adjacency.shape[0])
            rows = slice(start, start + adjacency.shape[0])
            torch.testing.assert_close(returns[rows], pyg.AddRandomWalkPE(4)(data.clone()).random_walk_pe,
                                       rtol=0, atol=1e-6)
            torch.manual_seed(0)
            want = pyg.AddLaplacianEigenvectorPE(3, is_undirected=True)(data.clone()).laplacian_eigenvector_pe
            same_up_to_sign(vectors[rows].double(), want, atol=1e-5)
        # what the batch vector avoids: in a dense batch padded to 11 nodes, a triangle (eigenvalues 0, 1.5, 1.5)
        # takes the padding nodes' eigenvalue-1 eigenvectors, zero on its own nodes, instead of its own
        triangle = torch.ones(3, 3, dtype=torch.float64) - torch.eye(3, dtype=torch.float64)
        two = LaplacianPositionalEmbedding(8, 2)
        padded = two.graph_positions(torch.stack([F.pad(triangle, (0, 8, 0, 8)), graphs[1]]))[0, :3]   # [3, 2]
        both = two.graph_positions(edge_index=torch.cat([triangle.nonzero().T, graphs[1].nonzero().T + 3], 1),
                                   batch=torch.tensor([0] * 3 + [1] * 11)).double()[:3]
        assert padded.abs().max() < 1e-12
        torch.testing.assert_close(normalised_laplacian_oracle(triangle) @ both, 1.5 * both, rtol=0, atol=1e-6)
        torch.testing.assert_close(both.T @ both, torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-6)
        order = torch.randperm(27, generator=torch.Generator().manual_seed(0))          # node i is old node order[i]
        relabel = torch.empty_like(order)
        relabel[order] = torch.arange(27)
        shuffled = walk.graph_positions(edge_index=relabel[edge_index], batch=batch[order], num_nodes=27)
        torch.testing.assert_close(shuffled, returns[order], rtol=0, atol=1e-6)

    def test_positions_follow_the_modules_dtype(self):
        edge_index = random_graph(9, 0.3, 0).nonzero().T
        want = random_walk_oracle(random_graph(9, 0.3, 0), 5)
        for dtype in (torch.float64, torch.float16, torch.float32):
            pe = RandomWalkPositionalEmbedding(8, 5).to(dtype)
            for batch in (None, torch.zeros(9, dtype=torch.long)):
                got = pe.graph_positions(edge_index=edge_index, num_nodes=9, batch=batch)
                assert got.dtype == dtype
                torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-3)
        lap = LaplacianPositionalEmbedding(8, 3).double()
        assert lap.graph_positions(edge_index=edge_index, num_nodes=9).dtype == torch.float64
        assert lap.float().graph_positions(random_graph(9, 0.3, 0)).dtype == torch.float64   # a float64 adjacency

    def test_batch_vector_bad_input(self):
        walk = RandomWalkPositionalEmbedding(8, 2)
        edges, batch = torch.tensor([[0, 1, 2], [1, 0, 3]]), torch.tensor([0, 0, 1, 1])
        owner = "RandomWalkPositionalEmbedding: "
        with pytest.raises(ValueError, match=owner + "edge_index must join nodes of the same graph \\(batch\\), got "
                                                     "the edge 2 -> 3 from graph 0 to graph 1"):
            walk.graph_positions(edge_index=edges, batch=torch.tensor([0, 0, 0, 1]))
        with pytest.raises(ValueError, match=owner + "batch \\(PyG's node -> graph ids\\) goes with edge_index, "
                                                     "got adjacency"):
            walk.graph_positions(torch.ones(4, 4), batch=batch)
        with pytest.raises(TypeError, match=owner + "batch must be an integer tensor \\[N\\]"):
            walk.graph_positions(edge_index=edges, batch=batch.float())
        with pytest.raises(ValueError, match=owner + "batch must hold a graph id >= 0 for each of the num_nodes=5 nodes"):
            walk.graph_positions(edge_index=edges, batch=batch, num_nodes=5)
        with pytest.raises(ValueError, match=owner + "batch must hold a graph id >= 0 .* holding ids -1 to 0"):
            walk.graph_positions(edge_index=edges, batch=torch.tensor([-1, -1, 0, 0]))

    def test_sign_flips_in_training_only(self):
        nodes = LaplacianPositionalEmbedding(8, 3).graph_positions(random_graph(9, 0.3, 6)).float()
        pe = LaplacianPositionalEmbedding(8, 3, generator=torch.Generator().manual_seed(0))
        plain = lambda v: F.linear(v, pe.proj.weight, pe.proj.bias)                           # noqa: E731
        patterns = list(itertools.product((1.0, -1.0), repeat=3))
        seen = []
        for _ in range(60):
            codes = pe.embed(nodes)
            match = [s for s in patterns if torch.allclose(codes, plain(nodes * torch.tensor(s)), atol=1e-6)]
            assert len(match) == 1
            seen.append(match[0])
        assert set(seen) == set(patterns)                                                   # one sign per eigenvector
        torch.testing.assert_close(pe.eval().embed(nodes), plain(nodes))                    # none in eval
        twin = LaplacianPositionalEmbedding(8, 3, generator=torch.Generator().manual_seed(0))
        twin.load_state_dict(pe.state_dict())
        pe.train().generator.manual_seed(0)
        assert all(torch.equal(pe.embed(nodes), twin.embed(nodes)) for _ in range(5))      # the generator decides

    def test_signnet_is_sign_invariant(self):
        pe = LaplacianPositionalEmbedding(8, 3, sign_invariant=True)
        nodes = pe.graph_positions(random_graph(9, 0.3, 7)).float()
        flipped = nodes * torch.tensor([-1.0, 1.0, -1.0])
        assert torch.equal(pe.embed(nodes), pe.embed(flipped))
        assert not torch.allclose(pe.embed(nodes), pe.embed(nodes.roll(1, 0)))             # still reads the vectors

    def test_bad_input(self):
        lap = LaplacianPositionalEmbedding(8, 2)
        with pytest.raises(ValueError, match="LaplacianPositionalEmbedding: give the graph as adjacency .* got neither"):
            lap.graph_positions()
        with pytest.raises(ValueError, match="LaplacianPositionalEmbedding: the graph must be undirected"):
            lap.graph_positions(torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
        with pytest.raises(ValueError, match="RandomWalkPositionalEmbedding: edge_index must hold node ids in "
                                             "\\[0, 3\\) for num_nodes=3, got ids from 0 to 3"):
            RandomWalkPositionalEmbedding(8, 2).graph_positions(edge_index=torch.tensor([[0, 1], [1, 3]]), num_nodes=3)
        with pytest.raises(ValueError, match="RandomWalkPositionalEmbedding: edge weights must be finite and >= 0"):
            RandomWalkPositionalEmbedding(8, 2).graph_positions(torch.tensor([[0.0, -1.0], [1.0, 0.0]]))
        with pytest.raises(ValueError, match="RandomWalkPositionalEmbedding: adjacency must have shape \\[..., N, N\\]"):
            RandomWalkPositionalEmbedding(8, 2).graph_positions(torch.ones(3, 4))
        with pytest.raises(ValueError, match="LaplacianPositionalEmbedding: positions is required"):
            lap(torch.randn(3, 8))
        with pytest.raises(ValueError, match="RandomWalkPositionalEmbedding: positions must have shape \\[3, 2\\]"):
            RandomWalkPositionalEmbedding(8, 2)(torch.randn(3, 8), torch.rand(3, 5))



    @pytest.mark.parametrize("cls", [RandomWalkPositionalEmbedding, LaplacianPositionalEmbedding])
    def test_one_axis_takes_graph_positions_as_given(self, cls):
        # k = 1: graph_positions gives [N, 1], which forward refused ("must have shape [N]"); [B, N, 1] too
        pe = cls(4, 1).eval()
        ring = torch.tensor([[0, 1, 2, 1, 2, 0], [1, 2, 0, 0, 1, 2]])
        nodes = pe.graph_positions(edge_index=ring, num_nodes=3)                          # [3, 1]
        assert nodes.shape == (3, 1)
        proj = pe.proj
        want = (nodes.double() @ proj.weight.double().T + proj.bias.double()).float()      # [3, 4]
        x = torch.randn(2, 3, 4)
        torch.testing.assert_close(pe(x[0], nodes), x[0] + want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pe(x, torch.stack([nodes, nodes])), x + want, rtol=1e-6, atol=1e-6)

# ---------------------------------------------------------------------------
# Heinsen: the log-space scan, streaming, packed documents, second derivatives, forward mode
# ---------------------------------------------------------------------------


def heinsen_oracle(pe, x, state=None):
    """A plain loop over tokens in float64: s_t = logaddexp(log_p_t + s_{t-1}, h_t), y = x + R(s)."""
    x64 = x.double()
    w_h, b_h = pe.H.weight.double(), pe.H.bias.double()
    w_r, b_r = pe.R.weight.double(), pe.R.bias.double()
    logits = x64 @ w_h.T + b_h
    log_p, h = F.logsigmoid(logits[..., : pe.d_hid]), logits[..., pe.d_hid :]
    s = torch.zeros(*x.shape[:-2], pe.d_hid, dtype=torch.float64) if state is None else state.double()[..., 0, :]
    states = []
    for t in range(x.shape[-2]):
        s = torch.logaddexp(log_p[..., t, :] + s, h[..., t, :])
        states.append(s)
    states = torch.stack(states, dim=-2)
    return x64 + states @ w_r.T + b_r, states


def heinsen_reference(pe, x, prev_context=None):
    """The reference algorithm (cumsum + logcumsumexp over the sequence, zero or cached state first)."""
    log_p, h = pe.H(x).split(pe.d_hid, dim=-1)
    log_p = F.logsigmoid(log_p)
    first = torch.zeros_like(h[..., :1, :]) if prev_context is None else prev_context
    prepended = torch.cat([first, h], dim=-2)
    a = F.pad(log_p.cumsum(dim=-2), (0, 0, 1, 0))
    s = (a + torch.logcumsumexp(prepended - a, dim=-2))[..., 1:, :]
    return x + pe.R(s), s[..., -1:, :]


class HeinsenForwardMode:
    """The scan's jvp rule with parameters that require grad: it used to run the ``out=`` scan on
    tensors autograd tracks (a RuntimeError); now its tangent is recorded, checked here against
    central differences in float64 (step 1e-6: truncation error ~1e-12, rounding ~1e-10)."""

    def __init__(self):
        torch.manual_seed(0)
        self.pe = HeinsenPositionalEmbedding(8, 8).double()
        self.x = torch.randn(1, 10, 8, dtype=torch.float64)
        self.t = torch.randn_like(self.x)

    def tangent(self, x):
        return torch.func.jvp(self.pe.forward_input, (x,), (self.t[:, :x.shape[1]],))[1]


class TestHeinsen:
    @pytest.mark.parametrize("n", [1, 5, 128, 300, 517])
    def test_matches_float64_loop_oracle(self, n):
        pe = HeinsenPositionalEmbedding(12, 7)
        x = torch.randn(2, n, 12)
        want, _ = heinsen_oracle(pe, x)
        torch.testing.assert_close(pe(x).double(), want, rtol=0, atol=2e-5)
        torch.testing.assert_close(pe.double()(x.double()), want, rtol=0, atol=1e-10)

    @pytest.mark.parametrize("n", [100, 700])
    def test_strong_decay_and_large_updates_match_oracle(self, n):
        # log_p ~ -30 per token and |h| up to ~40: within a block the closed form would cancel
        # numbers of size ~4000; the blocks' own scan and the float64 chain must not
        pe = HeinsenPositionalEmbedding(6, 5)
        with torch.no_grad():
            pe.H.bias[:5] -= 30.0
            pe.H.weight.mul_(10.0)
        x = torch.randn(2, n, 6)
        want, _ = heinsen_oracle(pe, x)
        torch.testing.assert_close(pe(x).double(), want, rtol=0, atol=5e-5)

    def test_traced_blocked_scan_matches_oracle(self):
        # torch.compile traces the closed form inside each block instead of the eager loop
        pe = HeinsenPositionalEmbedding(6, 5)
        x = torch.randn(2, 300, 6)
        compiled = torch.compile(lambda t: pe(t), backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x).double(), heinsen_oracle(pe, x)[0], rtol=0, atol=2e-5)

    def test_equals_reference_algorithm(self):
        pe = HeinsenPositionalEmbedding(8, 6).double()
        x = torch.randn(3, 200, 8, dtype=torch.float64)
        want, _ = heinsen_reference(pe, x)
        torch.testing.assert_close(pe(x), want)

    def test_reference_checkpoint_loads_unchanged(self):
        pe = HeinsenPositionalEmbedding(8, 6)
        assert set(pe.state_dict()) == {"H.weight", "H.bias", "R.weight", "R.bias"}
        checkpoint = {"H.weight": torch.randn(12, 8), "H.bias": torch.randn(12),
                      "R.weight": torch.randn(8, 6), "R.bias": torch.randn(8)}
        pe.load_state_dict(checkpoint)
        x = torch.randn(40, 8)
        pe(x)
        assert "prev_context" not in pe.state_dict()
        torch.testing.assert_close(pe(x), heinsen_oracle(pe, x)[0].float(), rtol=1e-5, atol=5e-5)
        assert pe_lib.EmbedPosition is HeinsenPositionalEmbedding

    def test_chunks_with_cached_context_equal_one_pass(self):
        pe = HeinsenPositionalEmbedding(10, 8)
        x = torch.randn(2, 400, 10)
        full = pe(x)
        chunks = [pe(x[:, :50])] + [pe(x[:, a:b], using_prev_context=True) for a, b in ((50, 120), (120, 400))]
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)

    def test_chunks_match_reference_streaming(self):
        pe = HeinsenPositionalEmbedding(6, 4).double()
        x = torch.randn(3, 90, 6, dtype=torch.float64)
        y1, context = heinsen_reference(pe, x[:, :40])
        y2, _ = heinsen_reference(pe, x[:, 40:], context)
        torch.testing.assert_close(pe(x[:, :40]), y1)
        torch.testing.assert_close(pe(x[:, 40:], using_prev_context=True), y2)

    def test_explicit_state_and_gradients_across_chunks(self):
        pe = HeinsenPositionalEmbedding(6, 5).double()
        x = torch.randn(2, 30, 6, dtype=torch.float64, requires_grad=True)
        full = pe(x)
        grad_full, = torch.autograd.grad(full[:, -1].sum(), x)
        y1, state = pe(x[:, :12], return_state=True)
        y2, final = pe(x[:, 12:], state=state, return_state=True)
        torch.testing.assert_close(torch.cat([y1, y2], 1), full)
        torch.testing.assert_close(final, heinsen_oracle(pe, x.detach())[1][:, -1:])
        grad_chunked, = torch.autograd.grad(y2[:, -1].sum(), x)
        torch.testing.assert_close(grad_chunked, grad_full)               # flows into the first chunk
        y2_cut = pe(x[:, 12:], state=state.detach())
        grad_cut, = torch.autograd.grad(y2_cut[:, -1].sum(), x)
        assert grad_cut[:, :12].abs().max() == 0                           # truncated

    def test_gradients_match_autograd_of_the_reference(self):
        # the scan has a hand-written backward; compare it with autograd through the reference
        pe = HeinsenPositionalEmbedding(5, 4).double()
        x = torch.randn(2, 300, 5, dtype=torch.float64, requires_grad=True)
        state = torch.randn(2, 1, 4, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(2, 300, 5, dtype=torch.float64)
        ours = torch.autograd.grad((pe(x, state=state) * weights).sum(), [x, state, *pe.parameters()])
        reference = torch.autograd.grad((heinsen_reference(pe, x, state)[0] * weights).sum(),
                                        [x, state, *pe.parameters()])
        for got, want in zip(ours, reference):
            torch.testing.assert_close(got, want)
        assert torch.autograd.gradcheck(lambda t, s: pe(t, state=s), (x[:, :40].detach().requires_grad_(), state))

    def test_per_sequence_states_for_batched_streaming(self):
        pe = HeinsenPositionalEmbedding(4, 3)
        a, b = torch.randn(1, 20, 4), torch.randn(1, 20, 4)
        _, state_a = pe(a[:, :10], return_state=True)
        _, state_b = pe(b[:, :10], return_state=True)
        batch = pe(torch.cat([a[:, 10:], b[:, 10:]]), state=torch.cat([state_a, state_b]))
        torch.testing.assert_close(batch[1:], pe(b)[:, 10:], rtol=0, atol=1e-6)

    def test_cached_context_follows_to_and_keeps_precision(self):
        pe = HeinsenPositionalEmbedding(4, 3)
        pe(torch.randn(2, 7, 4))
        context = pe.prev_context.clone()
        pe.bfloat16()
        assert pe.prev_context.dtype == torch.float32
        torch.testing.assert_close(pe.prev_context, context, rtol=0, atol=0)
        pe.to("meta")
        assert pe.prev_context.is_meta
        pe.reset_context()
        assert pe.prev_context is None

    def test_bf16_is_within_a_few_roundings(self):
        pe = HeinsenPositionalEmbedding(32, 32).bfloat16()
        x = torch.randn(2, 1000, 32).bfloat16()
        want, _ = heinsen_oracle(pe, x)
        got = pe(x)
        assert got.dtype == torch.bfloat16
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 7)        # bf16 spacing at the largest output
        assert (got.double() - want).abs().max() <= 4 * ulp

    def test_precision_at_length(self):
        torch.manual_seed(1)
        pe = HeinsenPositionalEmbedding(8, 8)
        x = torch.randn(1, 30_000, 8)
        want = pe.double()(x.double())        # the blocked scan in float64: ~1e-11 from exact
        pe.float()
        ours = (pe(x).double() - want).abs().max().item()
        reference = (heinsen_reference(pe, x)[0].double() - want).abs().max().item()
        assert ours < 3e-5 < reference

    def test_meta_init_resets_layers_inside_custom_h(self):
        make = lambda: HeinsenPositionalEmbedding(8, 8, H=torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)))
        with torch.device("meta"):
            pe = make()
        pe.to_empty(device="cpu")
        pe.reset_parameters()
        assert pe.H[0].weight.abs().max() <= 1 / math.sqrt(8)       # nn.Linear's init bound

    def test_empty_chunk_leaves_the_stream_alone(self):
        pe = HeinsenPositionalEmbedding(8, 4)
        x = torch.randn(2, 10, 8)
        want = pe(x)
        pe(x[:, :6])
        empty, state = pe(x[:, 6:6], using_prev_context=True, return_state=True)
        assert empty.shape == (2, 0, 8) and state.shape == (2, 1, 4)
        torch.testing.assert_close(pe(x[:, 6:], using_prev_context=True), want[:, 6:], rtol=0, atol=1e-6)

    def test_context_cached_under_inference_mode_continues_in_training(self):
        pe = HeinsenPositionalEmbedding(8, 4)
        with torch.inference_mode():
            pe(torch.randn(2, 5, 8))
        pe(torch.randn(2, 5, 8), using_prev_context=True).sum().backward()
        assert pe.H.weight.grad is not None

    def test_custom_h_and_r(self):
        h = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        pe = HeinsenPositionalEmbedding(6, 4, H=h, R=torch.nn.Linear(4, 6, bias=False))
        assert pe(torch.randn(3, 9, 6)).shape == (3, 9, 6)

    def test_bad_input(self):
        pe = HeinsenPositionalEmbedding(4, 3)
        with pytest.raises(ValueError, match="HeinsenPositionalEmbedding: using_prev_context=True but no context"):
            pe(torch.randn(2, 5, 4), using_prev_context=True)
        pe(torch.randn(2, 5, 4))
        with pytest.raises(ValueError, match="cached context must have shape \\[3, 1, 3\\] to continue a chunk "
                                             "of shape \\[3, 5, 4\\], got \\[2, 1, 3\\]"):
            pe(torch.randn(3, 5, 4), using_prev_context=True)
        with pytest.raises(ValueError, match="x must have last dim 4"):
            pe(torch.randn(2, 5, 5))
        with pytest.raises(ValueError, match="positions must be None"):
            pe.forward_input(torch.randn(2, 5, 4), torch.arange(5) + 1)
        with pytest.raises(ValueError, match="d_hid must be a positive int, got d_hid=0"):
            HeinsenPositionalEmbedding(4, 0)

    # -- the scan: second derivatives, torch.func transforms, argument checks
    @staticmethod
    def scan_oracle(log_p, h, initial):
        """The recurrence as a plain loop: s_t = logaddexp(log_p_t + s_{t-1}, h_t), s_0 = initial."""
        s, states = initial[..., 0, :], []
        for t in range(log_p.shape[-2]):
            s = torch.logaddexp(log_p[..., t, :] + s, h[..., t, :])
            states.append(s)
        return torch.stack(states, dim=-2)

    @staticmethod
    def scan_inputs(b=2, n=6, d=3):
        log_p = F.logsigmoid(torch.randn(b, n, d, dtype=torch.float64))
        h = torch.randn(b, n, d, dtype=torch.float64)
        initial = torch.randn(b, 1, d, dtype=torch.float64)                 # a non-zero state
        return log_p, h, initial

    @pytest.mark.parametrize("block, n", [(128, 6), (4, 10)])   # one block; three chained, the last padded
    def test_gradgradcheck(self, monkeypatch, block, n):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", block)
        inputs = [t.requires_grad_() for t in self.scan_inputs(n=n)]
        assert torch.autograd.gradcheck(pe_lib._scan_apply, inputs, check_forward_ad=True)
        assert torch.autograd.gradgradcheck(pe_lib._scan_apply, inputs)

    @pytest.mark.parametrize("block", [128, 4])
    def test_hessian_vector_product_matches_oracle(self, monkeypatch, block):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", block)
        inputs = self.scan_inputs(n=10)
        weights = torch.randn(2, 10, 3, dtype=torch.float64)
        vector = tuple(torch.randn_like(t) for t in inputs)
        loss = lambda fn: lambda *args: (fn(*args) * weights).sum()
        _, got = torch.autograd.functional.hvp(loss(pe_lib._scan_apply), inputs, vector)
        _, want = torch.autograd.functional.hvp(loss(self.scan_oracle), inputs, vector)
        for g, w in zip(got, want):
            assert w.abs().max() > 1e-3                                      # the second-order term is there
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)

    def test_module_second_derivative_matches_oracle(self):
        # the scan's second-order term used to be dropped silently (once_differentiable)
        pe = HeinsenPositionalEmbedding(5, 4).double()
        x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
        state = torch.randn(2, 1, 4, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(2, 9, 5, dtype=torch.float64)

        def penalty(y):
            grad_x, grad_state = torch.autograd.grad((y * weights).sum(), [x, state], create_graph=True)
            return (grad_x ** 2).sum() + (grad_state ** 2).sum()

        got = torch.autograd.grad(penalty(pe(x, state=state)), [x, state, pe.H.weight])
        want = torch.autograd.grad(penalty(heinsen_reference(pe, x, state)[0]), [x, state, pe.H.weight])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)

    def test_func_grad_matches_oracle(self):
        inputs = self.scan_inputs()
        weights = torch.randn(2, 6, 3, dtype=torch.float64)
        loss = lambda fn: lambda *args: (fn(*args) * weights).sum()
        got = torch.func.grad(loss(pe_lib._scan_apply), argnums=(0, 1, 2))(*inputs)
        want = torch.func.grad(loss(self.scan_oracle), argnums=(0, 1, 2))(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        hessian = torch.func.jacrev(torch.func.jacrev(loss(pe_lib._scan_apply), argnums=1), argnums=1)(*inputs)
        hessian_want = torch.func.jacrev(torch.func.jacrev(loss(self.scan_oracle), argnums=1), argnums=1)(*inputs)
        torch.testing.assert_close(hessian, hessian_want, rtol=0, atol=1e-12)

    def test_func_vmap_equals_a_loop(self):
        log_p, h, initial = self.scan_inputs(b=3)
        log_p_t = log_p.transpose(0, 1).contiguous()                          # batch dim 1
        got = torch.func.vmap(pe_lib._scan_apply, in_dims=(1, 0, None))(log_p_t, h, initial[0])
        want = torch.stack([pe_lib._scan_apply(log_p[i], h[i], initial[0]) for i in range(3)])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, self.scan_oracle(log_p, h, initial[:1].expand(3, 1, 3)), rtol=0, atol=1e-12)
        # per-sample gradients: vmap over grad
        per_sample = torch.func.vmap(torch.func.grad(lambda *a: pe_lib._scan_apply(*a).sin().sum(), argnums=(0, 1, 2)))
        want = torch.func.vmap(torch.func.grad(lambda *a: self.scan_oracle(*a).sin().sum(), argnums=(0, 1, 2)))
        for g, w in zip(per_sample(log_p, h, initial), want(log_p, h, initial)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)

    def test_func_jvp_matches_oracle_and_finite_differences(self):
        inputs = self.scan_inputs(n=7)
        tangents = tuple(torch.randn_like(t) for t in inputs)
        value, got = torch.func.jvp(pe_lib._scan_apply, inputs, tangents)
        _, want = torch.func.jvp(self.scan_oracle, inputs, tangents)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        eps = 1e-6
        plus = pe_lib._scan_apply(*[t + eps * d for t, d in zip(inputs, tangents)])
        minus = pe_lib._scan_apply(*[t - eps * d for t, d in zip(inputs, tangents)])
        torch.testing.assert_close(got, (plus - minus) / (2 * eps), rtol=0, atol=1e-8)
        # a tangent on one input only (the others get None)
        _, only_h = torch.func.jvp(lambda h: pe_lib._scan_apply(inputs[0], h, inputs[2]), (inputs[1],), (tangents[1],))
        _, only_h_want = torch.func.jvp(lambda h: self.scan_oracle(inputs[0], h, inputs[2]), (inputs[1],), (tangents[1],))
        torch.testing.assert_close(only_h, only_h_want, rtol=0, atol=1e-12)

    def test_compiled_module_still_traces_and_backpropagates(self):
        pe = HeinsenPositionalEmbedding(6, 5)
        x = torch.randn(2, 20, 6, requires_grad=True)
        compiled = torch.compile(lambda t: pe(t), backend="eager", fullgraph=True)
        grad, = torch.autograd.grad(compiled(x).sin().sum(), x)
        want, = torch.autograd.grad(pe(x).sin().sum(), x)
        torch.testing.assert_close(grad, want)

    @pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
    def test_state_must_be_floating(self, dtype):
        pe = HeinsenPositionalEmbedding(4, 3)
        state = torch.zeros(2, 1, 3, dtype=dtype)
        with pytest.raises(TypeError, match=f"HeinsenPositionalEmbedding: state must be a floating tensor, "
                                            f"got dtype={dtype}"):
            pe(torch.randn(2, 5, 4), state=state)

    @pytest.mark.parametrize("name", ["H", "R"])
    def test_h_and_r_must_be_modules(self, name):
        with pytest.raises(TypeError, match=f"HeinsenPositionalEmbedding: {name} must be an nn.Module or None, "
                                            f"got str 'linear'"):
            HeinsenPositionalEmbedding(4, 3, **{name: "linear"})

    def test_output_widths_of_custom_h_and_r(self):
        x = torch.randn(2, 5, 4)
        pe = HeinsenPositionalEmbedding(4, 3, H=torch.nn.Linear(4, 3))
        with pytest.raises(ValueError, match=r"HeinsenPositionalEmbedding: H must output last dim 2 \* d_hid = 6, "
                                             r"got shape \[2, 5, 3\] \(last dim 3\)"):
            pe(x)
        pe = HeinsenPositionalEmbedding(4, 3, R=torch.nn.Linear(3, 1))
        with pytest.raises(ValueError, match=r"HeinsenPositionalEmbedding: R must output last dim d_emb = 4, "
                                             r"got shape \[2, 5, 1\] \(last dim 1\)"):
            pe(x)

    # -- packed documents: within-document positions restart the recurrence
    @staticmethod
    def heinsen_loop(pe, x, positions):
        """float64 plain loop of ``s_t = log(exp(log_p_t + s_{t-1}) + exp(h_t))``, ``s = 0`` where a position is 0."""
        weight, bias = pe.H.weight.detach().double().tolist(), pe.H.bias.detach().double().tolist()
        d, out = pe.d_hid, []
        for row in range(x.shape[0]):
            pos = (positions if positions.dim() == 1 else positions[row]).tolist()
            s, states = [0.0] * d, []
            for t in range(x.shape[1]):
                token = x[row, t].detach().double().tolist()
                z = [sum(w * e for w, e in zip(weight[i], token)) + bias[i] for i in range(2 * d)]
                s = [0.0] * d if pos[t] == 0 else s
                s = [math.log(math.exp(-math.log1p(math.exp(-z[i])) + s[i]) + math.exp(z[d + i])) for i in range(d)]
                states.append(s)
            out.append(states)
        s = torch.tensor(out, dtype=torch.float64)
        return x.detach().double() + F.linear(s, pe.R.weight.detach().double(), pe.R.bias.detach().double())

    @staticmethod
    def reset_scan_oracle(log_p, h, starts):
        """The scan as a differentiable loop: the state is set to 0 (not decayed) where a document starts."""
        s, states = torch.zeros_like(h[..., 0, :]), []
        for t in range(h.shape[-2]):
            s = torch.where(starts[..., t, :], torch.zeros_like(s), s)
            s = torch.logaddexp(log_p[..., t, :] + s, h[..., t, :])
            states.append(s)
        return torch.stack(states, dim=-2)

    @staticmethod
    def library_scan(log_p, h, starts):
        """What the module hands the scan: a decay of exactly 0 and ``h = logaddexp(log_p, h)`` at starts."""
        h = torch.where(starts, torch.logaddexp(log_p, h), h)
        return pe_lib._scan_apply(log_p.masked_fill(starts, float("-inf")), h, torch.zeros_like(h[..., :1, :]), True)

    @pytest.mark.parametrize("block", [128, 4])                   # one block; many, with starts inside and on edges
    def test_heinsen_packed_equals_float64_loop_and_each_document_alone(self, monkeypatch, block):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", block)
        pe = HeinsenPositionalEmbedding(6, 5)
        x = torch.randn(B, N, 6)
        ids = TestPackedDocuments.ids_of(TestPackedDocuments.LENGTHS)
        got = pe.forward_input(x, document_positions(ids))
        torch.testing.assert_close(got.double(), self.heinsen_loop(pe, x, document_positions(ids)), rtol=0, atol=1e-5)
        for piece in TestPackedDocuments.pieces(TestPackedDocuments.LENGTHS):
            torch.testing.assert_close(got[:, piece], pe.forward_input(x[:, piece]))
        batched = document_positions(torch.stack([TestPackedDocuments.ids_of(r) for r in TestPackedDocuments.ROWS]))    # [B, N], rows differ
        got = pe.forward_input(x, batched)
        torch.testing.assert_close(got.double(), self.heinsen_loop(pe, x, batched), rtol=0, atol=1e-5)
        for row, lengths in enumerate(TestPackedDocuments.ROWS):
            for piece in TestPackedDocuments.pieces(lengths):
                torch.testing.assert_close(got[row:row + 1, piece], pe.forward_input(x[row:row + 1, piece]))
        torch.testing.assert_close(pe.forward_input(x, torch.arange(N)), pe.forward_input(x))   # one document

    @pytest.mark.parametrize("block", [128, 4])
    def test_heinsen_packed_gradients_equal_each_document_alone(self, monkeypatch, block):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", block)
        pe = HeinsenPositionalEmbedding(6, 5).double()
        x = torch.randn(B, N, 6, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(B, N, 6, dtype=torch.float64)
        leaves = [x, *pe.parameters()]
        positions = document_positions(torch.stack([TestPackedDocuments.ids_of(r) for r in TestPackedDocuments.ROWS]))
        got = torch.autograd.grad((pe.forward_input(x, positions) * weights).sum(), leaves)
        total = sum((pe.forward_input(x[row:row + 1, piece]) * weights[row:row + 1, piece]).sum()
                    for row, lengths in enumerate(TestPackedDocuments.ROWS) for piece in TestPackedDocuments.pieces(lengths))
        want = torch.autograd.grad(total, leaves)
        for g, w in zip(got, want):
            assert w.abs().max() > 1e-3
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)

    def test_heinsen_packed_gradcheck_and_gradgradcheck(self, monkeypatch):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", 4)
        pe = HeinsenPositionalEmbedding(3, 2).double()
        positions = document_positions(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 4, 4, 5, 5, 5, 5]]))
        x = torch.randn(2, 10, 3, dtype=torch.float64, requires_grad=True)
        weight = pe.H.weight
        run = lambda x, weight: torch.func.functional_call(pe, {"H.weight": weight}, (x,), {"positions": positions})
        assert torch.autograd.gradcheck(run, (x, weight), fast_mode=True)
        assert torch.autograd.gradgradcheck(run, (x, weight), fast_mode=True)
        pe.requires_grad_(False)  # forward mode through the module (parameters need no gradient there)
        assert torch.autograd.gradcheck(lambda x: pe.forward_input(x, positions), (x,), check_forward_ad=True,
                                        check_backward_ad=False, fast_mode=True)

    @pytest.mark.parametrize("block", [128, 4])
    def test_heinsen_packed_scan_derivatives_match_reset_oracle(self, monkeypatch, block):
        monkeypatch.setattr(pe_lib, "_SCAN_BLOCK", block)
        positions = document_positions(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3],
                                                     [5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 8]]))
        starts = (positions == 0).unsqueeze(-1)                                              # [B, N, 1]
        log_p = F.logsigmoid(torch.randn(2, 12, 3, dtype=torch.float64))
        h = torch.randn(2, 12, 3, dtype=torch.float64)
        oracle = lambda log_p, h: self.reset_scan_oracle(log_p, h, starts)
        mine = lambda log_p, h: self.library_scan(log_p, h, starts)
        torch.testing.assert_close(mine(log_p, h), oracle(log_p, h), rtol=0, atol=1e-12)
        weights = torch.randn(2, 12, 3, dtype=torch.float64)
        loss = lambda fn: lambda *args: (fn(*args) * weights).sum()
        for g, w in zip(torch.func.grad(loss(mine), argnums=(0, 1))(log_p, h),
                        torch.func.grad(loss(oracle), argnums=(0, 1))(log_p, h)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        hessian = torch.func.jacrev(torch.func.jacrev(loss(mine), argnums=1), argnums=1)(log_p, h)
        want = torch.func.jacrev(torch.func.jacrev(loss(oracle), argnums=1), argnums=1)(log_p, h)
        assert want.abs().max() > 1e-3 and torch.isfinite(hessian).all()
        torch.testing.assert_close(hessian, want, rtol=0, atol=1e-12)
        tangents = (torch.randn_like(log_p), torch.randn_like(h))
        torch.testing.assert_close(torch.func.jvp(mine, (log_p, h), tangents)[1],
                                   torch.func.jvp(oracle, (log_p, h), tangents)[1], rtol=0, atol=1e-12)
        stacked = torch.stack([h, h.flip(-1)])                                               # vmap over a new batch dim
        got = torch.func.vmap(lambda h: mine(log_p, h))(stacked)
        torch.testing.assert_close(got, torch.stack([oracle(log_p, t) for t in stacked]), rtol=0, atol=1e-12)

    def test_heinsen_positions_must_be_document_positions(self):
        pe = HeinsenPositionalEmbedding(4, 3)
        x = torch.randn(2, 5, 4)
        for bad in (torch.arange(5) + 1, torch.tensor([0, 2, 3, 4, 5]), torch.tensor([0, 1, 0, 2, 3]),
                    torch.tensor([[0, 1, 2, 3, 4], [0, 1, 1, 2, 3]])):
            with pytest.raises(ValueError, match="HeinsenPositionalEmbedding: positions must be None or "
                                                 "within-document positions"):
                pe.forward_input(x, bad)
        with pytest.raises(ValueError, match="HeinsenPositionalEmbedding: positions must have shape \\[5\\]"):
            pe.forward_input(x, torch.arange(6))
        with pytest.raises(ValueError, match="HeinsenPositionalEmbedding: positions start a new document"):
            pe(x, state=torch.zeros(2, 1, 3), positions=torch.arange(5))
        positions = torch.tensor([0, 1, 2, 0, 1])
        torch.testing.assert_close(pe.forward_input(x, positions.double()), pe.forward_input(x, positions))
        # streaming: a packed chunk, then the last document goes on in the next chunk
        more = torch.randn(2, 3, 4)
        pe.forward_input(x, positions)
        continued = pe(more, using_prev_context=True)
        alone = pe(torch.cat([x[:, 3:], more], dim=1))
        torch.testing.assert_close(continued, alone[:, 2:])

    # -- forward mode with live parameters (jvp, jacfwd, a gradient of a jvp): HeinsenForwardMode
    def test_forward_mode_jvp_matches_central_difference(self):
        fm = HeinsenForwardMode()
        assert all(p.requires_grad for p in fm.pe.parameters())
        step = 1e-6
        numeric = (fm.pe.forward_input(fm.x + step * fm.t) - fm.pe.forward_input(fm.x - step * fm.t)) / (2 * step)
        torch.testing.assert_close(fm.tangent(fm.x), numeric, atol=1e-8, rtol=0)

    def test_forward_mode_gradient_of_jvp_matches_central_difference(self):
        fm = HeinsenForwardMode()
        weights = torch.randn(1, 10, 8, dtype=torch.float64)
        params = list(fm.pe.parameters())[:3]   # R's bias does not reach the tangent
        grads = torch.autograd.grad((fm.tangent(fm.x) * weights).sum(), params)
        for param, grad in zip(params, grads):
            direction = torch.randn_like(param)

            def loss(scale):
                with torch.no_grad():
                    param.add_(scale * direction)
                value = (fm.tangent(fm.x) * weights).sum().item()
                with torch.no_grad():
                    param.sub_(scale * direction)
                return value
            numeric = (loss(1e-6) - loss(-1e-6)) / 2e-6
            assert math.isfinite(numeric) and abs((grad * direction).sum().item() - numeric) < 1e-7

    def test_forward_mode_jacfwd_equals_jacrev(self):
        fm = HeinsenForwardMode()
        x = fm.x[:, :4]
        forward = torch.func.jacfwd(fm.pe.forward_input)(x)
        reverse = torch.func.jacrev(fm.pe.forward_input)(x)
        torch.testing.assert_close(forward, reverse, atol=1e-12, rtol=0)


# ===========================================================================
# Q/K rotation kind: rotates queries and keys
# ===========================================================================


    def test_non_finite_state_is_a_value_error(self):
        # a NaN or +inf log-state ran, every output NaN / inf; -inf (an empty state) stays valid
        torch.manual_seed(0)
        pe = HeinsenPositionalEmbedding(4, 3).double()
        x = torch.randn(2, 5, 4, dtype=torch.float64)
        for bad in (float("nan"), float("inf")):
            state = torch.zeros(2, 1, 3, dtype=torch.float64)
            state[1, 0, 2] = bad
            with pytest.raises(ValueError, match=f"HeinsenPositionalEmbedding: state must be a log-state \\(finite, or "
                                                 f"-inf for an empty state\\), got \\[{bad}\\]"):
                pe(x, state=state)
        empty = pe(x, state=torch.full((2, 1, 3), float("-inf"), dtype=torch.float64))
        _, s = pe(x[:, :1], return_state=True)
        torch.testing.assert_close(pe(x[:, 1:], state=s), pe(x)[:, 1:], rtol=1e-12, atol=1e-12)
        assert torch.isfinite(empty).all()

# ---------------------------------------------------------------------------
# Rotary (+ from_config against transformers, and the from_config census of every model type)
# ---------------------------------------------------------------------------


def rope_oracle(x, positions, inv_freq, *, interleaved=False, rotary_dim=None, factor=1.0):
    """Rotate x [..., N, D] by explicit D x D rotation matrices built per position, in float64.

    positions: a list (one per token) of positions; a position is a number, or a tuple of
    per-axis numbers with ``axis_of_pair`` giving the axis of each pair.
    """
    x = x.double()
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    out = torch.empty_like(x)
    for n, p in enumerate(positions):
        rot = torch.eye(d, dtype=torch.float64)
        for i in range(r // 2):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
            theta = float(p[i] if isinstance(p, (tuple, list)) else p) * inv_freq[i]
            c, s = math.cos(theta) * factor, math.sin(theta) * factor
            rot[a, a], rot[a, b], rot[b, a], rot[b, b] = c, -s, s, c
        out[..., n, :] = x[..., n, :] @ rot.T
    return out


def rope_oracle_from_angles(x, angles):
    """Half-split rotation of x [..., N, D] by angles [N, D/2], one pair at a time (float64 loop)."""
    out = x.clone().double()
    half = x.shape[-1] // 2
    for n in range(x.shape[-2]):
        for i in range(half):
            c, s_ = math.cos(angles[n, i]), math.sin(angles[n, i])
            a, b = x[..., n, i].double(), x[..., n, i + half].double()
            out[..., n, i], out[..., n, i + half] = a * c - b * s_, b * c + a * s_
    return out.to(x.dtype)


def plain_inv_freq(dim, base=10000.0):
    return [base ** (-2 * i / dim) for i in range(dim // 2)]


def aten_ops(fn) -> list:
    """The aten ops ``fn()`` runs that do work (views and allocations left out), by name: one CUDA launch each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "_local_scalar_dense"}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in free:
                ops.append(name)
            return func(*args, **(kwargs or {}))

    ops = []
    with Recorder():
        fn()
    return ops


def fused_rotation_on_cpu(monkeypatch, fn=None) -> dict:
    """Let the library's compiled rotation serve the CPU, from a fresh state (``fn``: its compiled function,
    default the library's own, with inductor); returns that state."""
    state = {} if fn is None else {"fn": fn}
    monkeypatch.setattr(pe_lib, "_FUSED_ROTATION_DEVICES", ("cpu",))
    monkeypatch.setattr(pe_lib, "_FUSED_ROTATION", state)
    return state


def fresh_rotation_formula():
    """``_rotate_formula`` with a code object of its own: dynamo's cache of it starts empty (that cache lives
    on the code object, shared by every torch.compile of the function)."""
    formula = pe_lib._rotate_formula
    return type(formula)(formula.__code__.replace(), formula.__globals__, formula.__name__)


def yarn_oracle(dim, base, factor, original, beta_fast=32, beta_slow=1, truncate=True, mscale=None,
                mscale_all_dim=None):
    """YaRN, written from the paper and Hugging Face's definition, one pair at a time."""
    def m(scale, ms=1.0):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0
    attention = m(factor, mscale) / m(factor, mscale_all_dim) if mscale and mscale_all_dim else m(factor)
    def index(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = index(beta_fast), index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    freqs = []
    for i, f in enumerate(plain_inv_freq(dim, base)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(f / factor * ramp + f * (1 - ramp))
    return freqs, attention


def llama3_oracle(dim, base, factor, low_ff, high_ff, original):
    freqs = []
    for f in plain_inv_freq(dim, base):
        wavelength = 2 * math.pi / f
        if wavelength < original / high_ff:
            freqs.append(f)
        elif wavelength > original / low_ff:
            freqs.append(f / factor)
        else:
            s = (original / wavelength - low_ff) / (high_ff - low_ff)
            freqs.append((1 - s) * f / factor + s * f)
    return freqs


# from_config against transformers: helpers

# largest |difference| against transformers per family, printed at the end of the run (for the README table)
MAX_DIFF = {}


class _MaxDiffSummary:
    """A pytest plugin printing MAX_DIFF in the terminal summary: a report, not a test."""

    def pytest_terminal_summary(self, terminalreporter):
        if MAX_DIFF:
            terminalreporter.section("largest differences against the reference implementations")
            for family, diff in sorted(MAX_DIFF.items()):
                terminalreporter.write_line(f"| {family} | {diff:.2e} |")


@pytest.fixture(scope="session", autouse=True)
def _print_max_differences(request):
    if not request.config.pluginmanager.has_plugin("max_diff_summary"):
        request.config.pluginmanager.register(_MaxDiffSummary(), "max_diff_summary")


def hf_module(model: str, name: str):
    pytest.importorskip("transformers")
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)


def hf_config(name: str, **kwargs):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, name)(**kwargs)


def lib_accepts(cls, argument: str) -> bool:
    return argument in inspect.signature(cls.__init__).parameters


def hf_cos_sin(rotary, positions, **kwargs):
    """transformers' cos, sin [N, R] for int positions [N] ([A, N] for M-RoPE), fresh module state."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[..., None, :], **kwargs)   # position_ids [1, N] or [A, 1, N]
    return cos[0].double(), sin[0].double()


def ours_cos_sin(kwargs, positions):
    pe = RotaryPositionalEmbedding(**kwargs)
    cos, sin = pe.cos_sin(positions, positions.shape[0])
    return pe, cos.double(), sin.double()


def compare_cos_sin(family, kwargs, hf_cos, hf_sin, positions, atol=2e-5, interleaved_output=False):
    """Our [N, R/2] cos/sin equal transformers' [N, R]; record the largest difference."""
    pe, cos, sin = ours_cos_sin(kwargs, positions)
    half = cos.shape[-1]
    assert hf_cos.shape[-1] == 2 * half, (hf_cos.shape, cos.shape)
    # transformers' layout: cat(f, f) (half-split pairs) or repeat_interleave(f, 2) (Cohere)
    first = hf_cos[..., 0::2] if interleaved_output else hf_cos[..., :half]
    second = hf_cos[..., 1::2] if interleaved_output else hf_cos[..., half:]
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    hf_sin = hf_sin[..., 0::2] if interleaved_output else hf_sin[..., :half]
    diff = max((cos - first).abs().max().item(), (sin - hf_sin).abs().max().item())
    MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), diff)
    assert diff <= atol, f"{family}: max |cos/sin| difference {diff:.3g} > {atol}"
    return pe


def rotate_half_split(x, cos, sin):
    """Plain float64 half-split rotation of the first 2 * cos.shape[-1] channels (test oracle)."""
    r = 2 * cos.shape[-1]
    a, b, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


POSITIONS = torch.arange(0, 200)          # past every original_max_position_embeddings below (16-64)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, intermediate_size=32,
            vocab_size=32)


# from_config census: every model type from_config accepts, against the model's own module
#
CENSUS_N = 40


# rope types tried on every model type besides its config's own (max_position_embeddings is set to 16)
CENSUS_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16},
}


# (model type, rope type) pairs not tried: transformers' legacy Phi-3 configs spell longrope "yarn", and
# from_config reads them so (test_phi3_longrope), where the 5.x module would compute YaRN for the dict
# Gemma 4: its proportional full-attention layers only (other rope types with its partial factor: not checked)
CENSUS_SKIP = {("phi3", "yarn")} | {(model_type, name) for name in CENSUS_SCALINGS for model_type in ("gemma4_text", "pixtral")}


# transformers 5.24's HunYuan-VL takes the two halves of a half-split pair from different position axes (not a
# rotation); from_config follows the model as trained (Tencent's XD-RoPE, vLLM: one axis per pair), which agrees
# with it where every axis carries the same position. The census compares there; TestPairAxes holds the
# distinct-axis case against Tencent's recipe.
CENSUS_EQUAL_AXES = {"hunyuan_vl", "hunyuan_vl_text"}


# default configs whose head dims are odd or inconsistent: the smallest change that makes them valid
# (released GLM-4V and Qwen4-exp configs set the partial_rotary_factor that their default sections assume)
CENSUS_CONFIG_FIXES = {"glm4_moe": {"head_dim": 64}, "glm4v_moe": {"head_dim": 64}, "glm4v_moe_text": {"head_dim": 64},
                       "qwen3_omni_moe_text": {"head_dim": 128}, "qwen3_omni_moe_thinker": {"head_dim": 128},
                       "glm4v": {"partial_rotary_factor": 0.5}, "glm4v_text": {"partial_rotary_factor": 0.5},
                       "qwen4_exp": {"partial_rotary_factor": 0.25}, "qwen4_exp_text": {"partial_rotary_factor": 0.25}}


@functools.lru_cache(maxsize=None)
def census_modeling(model_type: str):
    """The transformers modeling module of a model type (each module imported once)."""
    from transformers.models.auto import configuration_auto
    name = configuration_auto.model_type_to_module_name(model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def census_config(model_type: str):
    """A fresh default config of the model type, or a skip where the installed transformers lacks it."""
    pytest.importorskip("transformers")
    from transformers.models.auto import configuration_auto
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {pytest.importorskip('transformers').__version__} has no {model_type!r}")
    config = copy.deepcopy(census_default_config(model_type))
    text = census_text(config)
    for key, value in CENSUS_CONFIG_FIXES.get(model_type, {}).items():
        if key == "partial_rotary_factor":
            text.rope_parameters = {**text.rope_parameters, key: value}
        else:
            setattr(text, key, value)
    return config


# model types whose default config the census cannot read: a tiny config of theirs instead
# (Gemma 4's default is heterogeneous per layer: its head_dim is read per layer through per_layer_config)
HUNYUAN_VL_TEXT = dict(head_dim=32, hidden_size=128, num_attention_heads=4, rope_parameters={
    "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0, "mrope_section": [4, 4, 4, 4]})
CENSUS_CONFIG_KWARGS = {"hunyuan_vl": dict(text_config=HUNYUAN_VL_TEXT), "hunyuan_vl_text": HUNYUAN_VL_TEXT,
                        "gemma4_text": dict(
    **{**TINY, "num_hidden_layers": 2}, head_dim=16, global_head_dim=32, max_position_embeddings=64,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.25,
                                        "rope_theta": 1e6}})}


@functools.lru_cache(maxsize=None)
def census_default_config(model_type: str):
    """The default (or CENSUS_CONFIG_KWARGS) config, built once (census_config hands out copies to change)."""
    from transformers.models.auto import configuration_auto
    return configuration_auto.CONFIG_MAPPING[model_type](**CENSUS_CONFIG_KWARGS.get(model_type, {}))


def census_text(config):
    get = getattr(config, "get_text_config", None)
    return config if get is None else get(decoder=True)


def census_rotary(model_type: str, text):
    """The model's own text rotary module (the first ``*RotaryEmbedding`` class built from a config)."""
    module = census_modeling(model_type)
    errors = []
    for name, cls in vars(module).items():
        if not (inspect.isclass(cls) and name.endswith("RotaryEmbedding") and cls.__module__ == module.__name__):
            continue
        if list(inspect.signature(cls.__init__).parameters)[1:2] != ["config"]:
            continue
        try:
            return module, cls(text)
        except Exception as error:       # a vision rotary class that rejects the text config
            errors.append(f"{name}: {error!r}")
    raise RuntimeError(f"{model_type}: no rotary class takes its text config: {errors}")


def census_apply(model_type: str, module, text, out, q, k):
    """q, k rotated as the model's attention does with its rotary module's output."""
    if model_type in ("gptj", "codegen"):
        raise AssertionError("GPT-J / CodeGen build no rotary module")
    if isinstance(out, torch.Tensor):                   # complex freqs_cis (Llama 4, DeepSeek-V2)
        try:
            a, b = module.apply_rotary_emb(q, k, out)
            if a.shape == q.shape:
                return a, b
        except RuntimeError:
            pass
        a, b = module.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), out)    # [B, N, H, Dh]
        return a.transpose(1, 2), b.transpose(1, 2)
    cos, sin = out
    interleave = getattr(module, "apply_rotary_pos_emb_interleave", None)
    plain = getattr(module, "apply_rotary_pos_emb", None)
    fn = interleave if interleave is not None and (plain is None or getattr(text, "rope_interleave", False)) else plain
    try:
        return fn(q, k, cos, sin)
    except (TypeError, RuntimeError):
        pass
    if len(inspect.signature(fn).parameters) <= 4:       # one tensor at a time (DeepSeek-V4)
        return fn(q, cos, sin), fn(k, cos, sin)
    width = cos.shape[-1]                                # partial rotary: the attention slices the leading channels
    a, b = fn(q[..., :width], k[..., :width], cos, sin)
    return torch.cat([a, q[..., width:]], -1), torch.cat([b, k[..., width:]], -1)


def census_positions(num_axes: int) -> torch.Tensor:
    """Positions [N] (one axis) or [N, A] with a different sequence on every axis."""
    base = torch.arange(CENSUS_N)
    columns = [base, base % 7 * 3 + 1, base % 5 * 11 + 2, base % 3 * 5][:num_axes]
    return base if num_axes == 1 else torch.stack(columns, -1)


def census_gptj(model_type: str, config, q, k, positions):
    module = census_modeling(model_type)
    rotary_dim = config.rotary_dim or q.shape[-1]
    table = module.create_sinusoidal_positions(int(positions.max()) + 1, rotary_dim)[positions]   # [N, sin | cos]
    sin, cos = table[None].chunk(2, -1)
    rotate = lambda x: torch.cat([module.apply_rotary_pos_emb(x.transpose(1, 2)[..., :rotary_dim], sin, cos),
                                  x.transpose(1, 2)[..., rotary_dim:]], -1).transpose(1, 2)   # noqa: E731
    return rotate(q), rotate(k)


def census_compare(model_type: str, config, layer_type=None, scaling_name=None) -> Optional[float]:
    """Largest |q . k logit difference| between the model's module and from_config; None where the
    model's module does not accept the rope type."""
    text = census_text(config)
    # from_config(config) is RotaryPositionalEmbedding(**kwargs); a short table keeps the census cheap
    ours = RotaryPositionalEmbedding(**_rotary_kwargs_from_config(config, layer_type=layer_type), cache_len=CENSUS_N)
    num_axes = ours.num_axes
    positions = census_positions(num_axes)
    if model_type in CENSUS_EQUAL_AXES:
        positions = positions[:, :1].expand(-1, num_axes)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, CENSUS_N, ours.dim, generator=g) for _ in range(2))
    if model_type in ("gptj", "codegen"):
        hf_q, hf_k = census_gptj(model_type, text, q, k, positions)
    else:
        try:
            module, rotary = census_rotary(model_type, text)
        except Exception:          # noqa: BLE001
            if scaling_name is None:
                raise
            return None       # the model's module rejects this rope type
        ids = positions[None] if num_axes == 1 else positions.T[:, None]                  # [1, N] or [A, 1, N]
        if model_type == "pixtral":                                                        # (row, column) [N, 2]
            out = tuple(table[None] for table in rotary(q, positions))
        else:
            out = rotary(q, ids) if layer_type is None else rotary(q, ids, layer_type=layer_type)
        hf_q, hf_k = census_apply(model_type, module, text, out, q, k)
        if num_axes == 1:          # a model with several position axes must not pass for a one-axis one
            try:
                multi = rotary(q, census_positions(3).T[:, None]) if layer_type is None else None
                wide, _ = census_apply(model_type, module, text, multi, q, k) if multi is not None else (None, None)
            except Exception:      # noqa: BLE001 - a one-axis module rejects [3, B, N] ids
                wide = None
            assert wide is None or wide.shape != q.shape, f"{model_type}: its module takes 3 position axes"
    logits = lambda a, b: a.double() @ b.double().transpose(-1, -2)   # noqa: E731
    return (logits(ours(q, positions), ours(k, positions)) - logits(hf_q, hf_k)).abs().max().item()


def census_set_scaling(config, layer_type, scaling: dict, half: int) -> None:
    """Replace the config's rope type (of one layer type) by ``scaling``; lengths shrink to 16."""
    text = census_text(config)
    scaling = dict(scaling)
    if scaling["rope_type"] == "longrope":
        scaling.update(short_factor=[1.0 + 0.1 * i for i in range(half)], long_factor=[2.0 + 0.5 * i for i in range(half)])
    params = dict(text.rope_parameters)
    if layer_type is None:
        params = {key: value for key, value in params.items() if key in ("rope_theta", "partial_rotary_factor",
                                                                        "mrope_section", "mrope_interleaved")}
        params.update(scaling)
    else:
        keep = {key: value for key, value in params[layer_type].items() if key in ("rope_theta", "partial_rotary_factor")}
        params[layer_type] = {**keep, **scaling}
    text.rope_parameters = params
    text.max_position_embeddings = 16
    if getattr(text, "original_max_position_embeddings", None) is not None:
        text.original_max_position_embeddings = 16


def census_layer_types(config) -> list:
    params = getattr(census_text(config), "rope_parameters", None) or {}
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    return nested or [None]


# census model types of the default run (one per layout: half-split, interleaved, partial, complex freqs_cis,
# one tensor at a time, multi-axis sections of both layouts, per-layer rope types, proportional, longrope,
# a config fix, a query temperature); PE_SLOW=1 runs every model type of _ROPE_MODEL_TYPES
CENSUS_QUICK = {"llama", "gptj", "gpt_neox", "cohere", "deepseek_v2", "deepseek_v4", "llama4_text", "qwen2_vl",
                "qwen3_vl", "gemma3_text", "gemma4_text", "phi3", "glm4v", "ministral3", "ernie4_5_vl_moe", "hunyuan_vl",
                "pixtral"}


@pytest.fixture
def one_thread():
    """The census runs hundreds of tiny ops: one intra-op thread spares the pool's start-up (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TestRotary:
    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("rotary_dim", [None, 8])
    def test_matches_rotation_matrix_oracle(self, interleaved, rotary_dim):
        rope = RotaryPositionalEmbedding(16, interleaved=interleaved, rotary_dim=rotary_dim)
        x = torch.randn(2, 3, 7, 16)
        positions = [0, 1, 2, 5, 11, 100, 4097]
        got = rope(x, torch.tensor(positions))
        want = rope_oracle(x, positions, plain_inv_freq(rotary_dim or 16), interleaved=interleaved,
                           rotary_dim=rotary_dim)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)

    def test_constructor_checks_are_declared(self):
        """Issue 43: RoPE's constructor checks are declared (``arguments``, the rule ``_check_rotary_arguments``),
        none inline in the constructors of RoPE and its subclasses; the rule names the subclass built."""
        import ast
        import textwrap
        for cls in (RotaryPositionalEmbedding, HoPEPositionalEmbedding, VideoRotaryPositionalEmbedding):
            init = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.__init__))))
            assert not [node for node in ast.walk(init) if isinstance(node, ast.Raise)], cls.__name__
        assert RotaryPositionalEmbedding.argument_rules == (pe_lib._check_rotary_arguments,)
        with pytest.raises(ValueError, match=r"^HoPEPositionalEmbedding: dim must be a positive even int, got dim=7$"):
            HoPEPositionalEmbedding(7, train_length=64)
        with pytest.raises(ValueError, match=r"^VideoRotaryPositionalEmbedding: sections must be positive and sum to "
                                             r"rotary_dim / 2 = 8, got sections=\[2, 2, 2\]$"):
            VideoRotaryPositionalEmbedding(16, sections=[2, 2, 2])

    def test_preserves_norms(self):
        rope = RotaryPositionalEmbedding(64)
        x = torch.randn(2, 4, 50, 64)
        torch.testing.assert_close(rope(x, torch.arange(50) * 37).norm(dim=-1), x.norm(dim=-1))

    @pytest.mark.parametrize("dtype", [torch.long, torch.float64])
    def test_scores_depend_only_on_distance(self, dtype):
        rope = RotaryPositionalEmbedding(32)
        q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)
        scores = []
        for m in (0, 7, 1000, 123456):
            shift = torch.tensor([m], dtype=dtype) + (torch.tensor([0.25], dtype=dtype) if dtype != torch.long else 0)
            scores.append((rope(q, shift) * rope(k, shift + 5)).sum().item())
        assert max(scores) - min(scores) < 2e-5 * abs(scores[0]) + 1e-5

    def test_attention_logits_relative_with_float_positions(self):
        rope = RotaryPositionalEmbedding(DH)
        q, k, _ = qkv(dtype=torch.float64)
        positions = torch.rand(N, dtype=torch.float64) * 50
        base = rope.forward_attn(q, k, positions, positions)
        shifted = rope.forward_attn(q, k, positions + 1234.5, positions + 1234.5)
        torch.testing.assert_close(shifted, base)

    def test_fp32_accurate_at_a_million(self):
        rope = RotaryPositionalEmbedding(128, base=500000.0)
        x = torch.randn(1, 2, 4, 128)
        positions = [999_997, 999_998, 999_999, 1_000_000]
        got = rope(x, torch.tensor(positions))
        want = rope_oracle(x, positions, plain_inv_freq(128, 500000.0))
        assert (got.double() - want).abs().max() < 1e-4
        got_default = rope(x, offset=999_997)
        assert (got_default.double() - want).abs().max() < 1e-4

    def test_bf16_as_accurate_as_rounding_allows(self):
        rope = RotaryPositionalEmbedding(64)
        x = torch.randn(2, 2, 8, 64).bfloat16()
        positions = list(range(999_992, 1_000_000))
        got = rope(x, offset=999_992)
        assert got.dtype == torch.bfloat16
        want = rope_oracle(x, positions, plain_inv_freq(64))
        spacing = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)   # bf16 ulp
        assert ((got.double() - want).abs() <= 0.5 * spacing * 1.001 + 1e-6).all()

    def test_module_cast_to_bf16_keeps_fp32_tables(self):
        rope = RotaryPositionalEmbedding(64).bfloat16()
        assert rope.inv_freq.dtype == torch.float64
        x = torch.randn(1, 1, 4, 64)
        want = RotaryPositionalEmbedding(64)(x, offset=1_000_000)
        torch.testing.assert_close(rope(x, offset=1_000_000), want)

    def test_cache_grows_and_serves_explicit_positions(self):
        rope = RotaryPositionalEmbedding(32, cache_len=16)
        x = torch.randn(1, 1, 3000, 32)
        rope(x[..., :10, :])
        assert rope.cos_sin_cached.shape[1] == 16
        out = rope(x)
        assert rope.cos_sin_cached.shape[1] >= 3000
        torch.testing.assert_close(out, RotaryPositionalEmbedding(32, cache_len=0)(x))
        torch.testing.assert_close(rope(x[..., 5:9, :], torch.tensor([5, 6, 7, 8])), out[..., 5:9, :])
        # a lone position far past the table is computed directly, without growing it
        rope(x[..., :1, :], torch.tensor([10**7]))
        assert rope.cos_sin_cached.shape[1] < 10**7
        assert "cos_sin_cached" not in rope.state_dict()

    def test_cache_grown_under_inference_mode_serves_training(self):
        rope = RotaryPositionalEmbedding(16, cache_len=8)
        with torch.inference_mode():
            rope(torch.randn(1, 1, 32, 16))
        x = torch.randn(1, 1, 24, 16, requires_grad=True)
        rope(x).square().sum().backward()
        assert x.grad is not None

    @pytest.mark.parametrize("scaling", [
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [3.0] * 8,
         "original_max_position_embeddings": 16, "factor": 4.0},
    ])
    def test_length_dependent_scaling_shares_frequencies_between_q_and_k(self, scaling):
        rope = RotaryPositionalEmbedding(16, scaling=scaling)
        q = torch.randn(1, 1, 1, 16)
        k = q.expand(1, 1, 64, 16).contiguous()
        logits = rope.forward_attn(q, k, torch.tensor([10]), torch.arange(64), scale=1.0)
        factor = rope._scale_fn(16, 10000.0, rope.scaling, 64)[1]
        torch.testing.assert_close(logits[0, 0, 0, 10], (q * q).sum() * factor ** 2)

    def test_batched_positions_left_padding(self):
        rope = RotaryPositionalEmbedding(DH)
        x = torch.randn(B, H, N, DH)
        positions = torch.stack([torch.arange(N), (torch.arange(N) - 3).clamp(min=0)])
        out = rope(x, positions)
        torch.testing.assert_close(out[0], rope(x[0:1], torch.arange(N))[0])
        torch.testing.assert_close(out[1, :, 3:], rope(x[1:2, :, 3:], torch.arange(N - 3))[0])

    def test_float64_input_runs_in_float64(self):
        rope = RotaryPositionalEmbedding(16)
        x = torch.randn(1, 1, 3, 16, dtype=torch.float64)
        positions = [0.5, 1e6 + 0.25, 3.0]
        want = rope_oracle(x, positions, plain_inv_freq(16))
        torch.testing.assert_close(rope(x, torch.tensor(positions, dtype=torch.float64)), want, rtol=0, atol=1e-9)

    def test_gradient_is_inverse_rotation(self):
        rope = RotaryPositionalEmbedding(8, interleaved=True, rotary_dim=6)
        x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: rope(t, torch.arange(5) * 3), (x,))
        assert torch.autograd.gradgradcheck(lambda t: rope(t), (x,))

    def test_gradient_reaches_float_positions(self):
        rope = RotaryPositionalEmbedding(8)
        positions = torch.tensor([0.5, 2.0, 3.25], dtype=torch.float64, requires_grad=True)
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        assert torch.autograd.gradcheck(lambda p: rope(x, p), (positions,))

    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("rotary_dim, trailing", [(8, False), (6, False), (6, True)])
    def test_q_and_k_turned_in_one_call_gradcheck_and_equal_the_formula(self, interleaved, rotary_dim, trailing):
        """Issue 42: the eager rotation turns q and k in one autograd call, each by its own angles (q and k of
        different lengths here); float64 gradcheck and gradgradcheck, and the plain formula's outputs and
        gradients (autograd's through it)."""
        q = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
        angles = [torch.rand(n, rotary_dim // 2, dtype=torch.float64) * 20 for n in (5, 3)]
        cos, sin = tuple(a.cos() for a in angles), tuple(a.sin() for a in angles)
        fast = lambda q, k: pe_lib._rotate_all((q, k), cos, sin, interleaved, rotary_dim, trailing)
        plain = lambda q, k: pe_lib._rotate_formula((q, k), cos, sin, interleaved, rotary_dim, trailing)
        assert torch.autograd.gradcheck(fast, (q, k))
        assert torch.autograd.gradgradcheck(fast, (q, k))
        grads = (torch.randn_like(q), torch.randn_like(k))
        got, want = fast(q, k), plain(q, k)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for g, w in zip(torch.autograd.grad(got, (q, k), grads), torch.autograd.grad(want, (q, k), grads)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)

    def test_torch_func_transforms_take_the_formula(self):
        """torch.func's vmap and jvp see the plain formula (the eager autograd Function has no functorch rule:
        both raised a RuntimeError): per-sample outputs and the tangent (a rotation is linear) equal the
        float64 oracle's."""
        rope = RotaryPositionalEmbedding(8, rotary_dim=6, interleaved=True)
        x, tangent = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
        want = lambda t: rope_oracle(t, list(range(5)), plain_inv_freq(6), interleaved=True, rotary_dim=6).float()
        torch.testing.assert_close(torch.func.vmap(rope)(x), want(x))
        value, derivative = torch.func.jvp(rope, (x,), (tangent,))
        torch.testing.assert_close(value, want(x))
        torch.testing.assert_close(derivative, want(tangent))

    @pytest.mark.parametrize("kwargs, per_tensor", [({}, 4), ({"interleaved": True}, 4),
                                                    ({"rotary_dim": 16, "rotated_channels": "trailing"}, 5)],
                             ids=["half_split", "interleaved", "trailing"])
    def test_eager_rotation_stays_in_the_input_dtype(self, kwargs, per_tensor):
        """Issue 42: the eager rotation (the CPU's path) of bf16 q and k casts neither to float32 nor the result
        back, builds no default positions, and runs 4 full-size ops per tensor (2 multiplies, 2 fused
        multiply-adds; plus the pass-through copy), as many backward: 8 and 16 for q and k, where it ran 13
        forward and 29 forward + backward."""
        rope = RotaryPositionalEmbedding(32, **kwargs)
        q, k = (torch.randn(2, 4, 16, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grads = (torch.randn_like(q), torch.randn_like(k))
        forward = aten_ops(lambda: rope.encode_qk(q, k))
        both = aten_ops(lambda: torch.autograd.grad(rope.encode_qk(q, k), (q, k), grads))
        assert "_to_copy" not in both and "arange" not in both
        assert (len(forward), len(both)) == (2 * per_tensor, 4 * per_tensor)

    # (dtype, layout): the compiled rotation on the CPU (inductor compiles each for seconds: one runs by default)
    FUSED = [(dtype, layout) for dtype in ("float32", "bfloat16") for layout in ("half_split", "interleaved", "trailing")]

    @pytest.mark.parametrize("combo", quick_or_slow(FUSED, {"bfloat16-half_split"}, ids=[f"{d}-{l}" for d, l in FUSED]))
    def test_compiled_rotation_equals_eager_on_cpu(self, monkeypatch, combo):
        """Issue 42: the rotation the library compiles for CUDA, run with inductor on the CPU: q', k' and their
        gradients equal the eager path's, the output rounded once from float32 (within half a bf16 ulp of the
        float64 oracle), in one compilation."""
        dtype, layout = getattr(torch, combo[0]), combo[1]
        kwargs = {"half_split": {}, "interleaved": {"interleaved": True},
                  "trailing": {"rotary_dim": 16, "rotated_channels": "trailing"}}[layout]
        rope = RotaryPositionalEmbedding(32, **kwargs)
        q, k = (torch.randn(2, 4, 24, 32, dtype=dtype, requires_grad=True) for _ in range(2))
        grads = (torch.randn_like(q), torch.randn_like(k))

        def rotated_and_grads():
            out = rope.encode_qk(q, k)
            return (*out, *torch.autograd.grad(out, (q, k), grads))

        want = rotated_and_grads()
        state = fused_rotation_on_cpu(monkeypatch)
        got = rotated_and_grads()
        assert len(state["kinds"]) == 1 and "error" not in state
        for g, w in zip(got, want):
            assert g.dtype == dtype
            torch.testing.assert_close(g, w)
        if layout != "trailing":
            oracle = rope_oracle(q.detach(), list(range(24)), plain_inv_freq(32), interleaved=layout == "interleaved")
            spacing = 2.0 ** (torch.floor(torch.log2(oracle.abs().clamp_min(1e-30))) - (7 if dtype == torch.bfloat16 else 23))
            assert ((got[0].double() - oracle).abs() <= 0.5 * spacing * 1.001 + 1e-6).all()

    def test_compiled_rotation_compiles_once_per_kind_of_call(self, monkeypatch):
        """Issue 42: the compiled rotation's sizes are dynamic, so new lengths and batch sizes reuse one
        compilation (not one per length); decoding (one query), no_grad and float64 are new kinds, and the
        kinds the library counts are dynamo's compilations (a counting backend)."""
        from torch._dynamo.testing import CompileCounter

        counter = CompileCounter()
        state = fused_rotation_on_cpu(monkeypatch, torch.compile(fresh_rotation_formula(), backend=counter))
        rope = RotaryPositionalEmbedding(16)

        def check(q, k):
            got = rope.encode_qk(q, k)
            monkeypatch.setattr(pe_lib, "_FUSED_ROTATION_DEVICES", ())
            want = rope.encode_qk(q, k)
            monkeypatch.setattr(pe_lib, "_FUSED_ROTATION_DEVICES", ("cpu",))
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)

        for batch, heads, n in ((2, 3, 24), (2, 3, 40), (3, 3, 100), (5, 6, 7)):
            check(*(torch.randn(batch, heads, n, 16, requires_grad=True) for _ in range(2)))
        assert counter.frame_count == 1
        for cached in (10, 11, 30):   # decoding: one query after a cache of keys
            check(torch.randn(2, 3, 1, 16, requires_grad=True), torch.randn(2, 3, cached, 16, requires_grad=True))
        assert counter.frame_count == 2
        with torch.no_grad():
            check(torch.randn(2, 3, 24, 16), torch.randn(2, 3, 24, 16))
        check(torch.randn(2, 3, 24, 16, dtype=torch.float64), torch.randn(2, 3, 24, 16, dtype=torch.float64))
        assert counter.frame_count == len(state["kinds"]) == 4

    def test_compiled_rotation_stays_within_its_budget(self, monkeypatch):
        """Issue 42: past ``_FUSED_ROTATION_KINDS`` kinds of call a new kind runs eagerly instead of recompiling
        (past dynamo's own recompile limit it would run the unfused formula, with a warning); the kinds
        compiled keep the compiled path."""
        from torch._dynamo.testing import CompileCounter

        counter, calls = CompileCounter(), []
        compiled = torch.compile(fresh_rotation_formula(), backend=counter)
        state = fused_rotation_on_cpu(monkeypatch, lambda *args: calls.append(args) or compiled(*args))
        monkeypatch.setattr(pe_lib, "_FUSED_ROTATION_KINDS", 2)
        rope = RotaryPositionalEmbedding(16)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float32):
            x = torch.randn(2, 3, 8, 16, dtype=dtype)
            want = rope_oracle(x, list(range(8)), plain_inv_freq(16)).to(dtype)
            torch.testing.assert_close(rope.encode_qk(x, x)[1], want)
        assert counter.frame_count == len(state["kinds"]) == 2
        assert [args[0][0].dtype for args in calls] == [torch.float32, torch.float64, torch.float32]

    def test_compiled_rotation_failure_warns_once_and_runs_eagerly(self, monkeypatch):
        """Issue 42: where the compiler fails (no triton, no C++ compiler) the rotation warns once and takes the
        eager path from then on."""
        import warnings

        def broken(*args):
            raise torch._dynamo.exc.TorchDynamoException("no working C++ compiler")

        state = fused_rotation_on_cpu(monkeypatch, broken)
        rope = RotaryPositionalEmbedding(16)
        q, k = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
        with pytest.warns(UserWarning, match=r"compiled rotation failed \(TorchDynamoException: no working C\+\+"):
            got = rope.encode_qk(q, k)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = rope.encode_qk(q, k)
        assert "error" in state
        for g, a, x in zip(got, again, (q, k)):
            want = rope_oracle(x, list(range(8)), plain_inv_freq(16)).float()
            torch.testing.assert_close(g, want)
            torch.testing.assert_close(a, want)

    def test_rotation_traced_by_torch_compile_is_the_plain_formula(self, monkeypatch):
        """Issue 42: inside the user's torch.compile the rotation is the plain formula, for the user's compiler
        to fuse: the library's own compiled rotation is not called from traced code."""
        state = fused_rotation_on_cpu(monkeypatch, lambda *args: pytest.fail("the library's compiled rotation ran"))
        rope = RotaryPositionalEmbedding(16, interleaved=True)
        q, k = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
        got = torch.compile(rope.encode_qk, backend="eager", fullgraph=True)(q, k)
        for g, x in zip(got, (q, k)):
            torch.testing.assert_close(g, rope_oracle(x, list(range(8)), plain_inv_freq(16), interleaved=True).float())
        assert "kinds" not in state

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_cuda_rotation_is_compiled(self, monkeypatch, dtype):
        """Issue 42: on CUDA eager RoPE runs the library's compiled rotation (q and k together, forward and
        backward), with the eager path's outputs and gradients."""
        monkeypatch.setattr(pe_lib, "_FUSED_ROTATION", {})
        rope = RotaryPositionalEmbedding(64, rotary_dim=48).cuda()
        q, k = (torch.randn(2, 4, 40, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        grads = (torch.randn_like(q), torch.randn_like(k))

        def rotated_and_grads():
            out = rope.encode_qk(q, k)
            return (*out, *torch.autograd.grad(out, (q, k), grads))

        got = rotated_and_grads()
        assert len(pe_lib._FUSED_ROTATION["kinds"]) == 1 and "error" not in pe_lib._FUSED_ROTATION
        monkeypatch.setattr(pe_lib, "_FUSED_ROTATION_DEVICES", ())
        for g, w in zip(got, rotated_and_grads()):
            assert g.dtype == dtype
            torch.testing.assert_close(g, w)

    def test_permuted_weights_give_same_attention(self):
        heads, head_dim, model_dim, n = 2, 8, 12, 6
        wq, wk = torch.randn(heads * head_dim, model_dim), torch.randn(heads * head_dim, model_dim)
        x = torch.randn(1, n, model_dim)

        def logits(wq, wk, interleaved):
            rope = RotaryPositionalEmbedding(head_dim, interleaved=interleaved)
            q = (x @ wq.T).unflatten(-1, (heads, head_dim)).transpose(1, 2)
            k = (x @ wk.T).unflatten(-1, (heads, head_dim)).transpose(1, 2)
            return rope.forward_attn(q, k)

        want = logits(wq, wk, interleaved=True)
        to_half = [pe_lib.permute_rotary_weight(w, head_dim, to="half_split") for w in (wq, wk)]
        torch.testing.assert_close(logits(*to_half, interleaved=False), want)
        back = [pe_lib.permute_rotary_weight(w, head_dim, to="interleaved") for w in to_half]
        torch.testing.assert_close(back[0], wq, rtol=0, atol=0)
        torch.testing.assert_close(back[1], wk, rtol=0, atol=0)

    def test_permutation_index_map(self):
        # Meta row 2j + c goes to Hugging Face row c * D/2 + j (D = 8)
        w = torch.arange(8.0)[:, None]
        got = pe_lib.permute_rotary_weight(w, 8, to="half_split")[:, 0].tolist()
        assert got == [0, 2, 4, 6, 1, 3, 5, 7]
        partial = pe_lib.permute_rotary_weight(w, 8, to="half_split", rotary_dim=4)[:, 0].tolist()
        assert partial == [0, 2, 1, 3, 4, 5, 6, 7]

    def test_linear(self):
        rope = RotaryPositionalEmbedding(16, scaling={"rope_type": "linear", "factor": 4.0})
        x = torch.randn(1, 1, 5, 16)
        torch.testing.assert_close(rope(x, torch.arange(5) * 4), RotaryPositionalEmbedding(16)(x))

    def test_dynamic_is_driven_by_the_largest_position(self):
        scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
        rope = RotaryPositionalEmbedding(16, scaling=scaling)
        x = torch.randn(1, 1, 100, 16)
        torch.testing.assert_close(rope(x[..., :64, :]), RotaryPositionalEmbedding(16)(x[..., :64, :]))
        # length 100 > 64: base' = base * (2 * 100 / 64 - 1) ** (16 / 14)
        new_base = 10000.0 * (2.0 * 100 / 64 - 1.0) ** (16 / 14)
        want = rope_oracle(x, list(range(100)), plain_inv_freq(16, new_base))
        torch.testing.assert_close(rope(x).double(), want, rtol=0, atol=2e-6)
        # stateless: a short call afterwards is plain RoPE again
        torch.testing.assert_close(rope(x[..., :10, :]), RotaryPositionalEmbedding(16)(x[..., :10, :]))

    @pytest.mark.parametrize("config", [
        dict(base=1e6, dim=128, factor=4.0, original=32768),                     # Qwen3-style
        dict(base=150000.0, dim=64, factor=32.0, original=4096, truncate=False),  # gpt-oss-style
        dict(base=10000.0, dim=64, factor=40.0, original=4096, beta_fast=32, beta_slow=1, mscale=1.0,
             mscale_all_dim=0.707),                                               # DeepSeek-style
    ])
    def test_yarn(self, config):
        dim, base = config.pop("dim"), config.pop("base")
        factor, original = config["factor"], config["original"]
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        scaling.update({k: v for k, v in config.items() if k not in ("factor", "original")})
        rope = RotaryPositionalEmbedding(dim, base=base, scaling=scaling)
        freqs, attention = yarn_oracle(dim, base, **config)
        torch.testing.assert_close(rope.inv_freq, torch.tensor(freqs, dtype=torch.float64), rtol=1e-12, atol=0)
        assert rope.attention_factor == pytest.approx(attention, rel=1e-12)
        x = torch.randn(1, 1, 3, dim)
        want = rope_oracle(x, [0, 1000, 50000], freqs, factor=attention)
        torch.testing.assert_close(rope(x, torch.tensor([0, 1000, 50000])).double(), want, rtol=0, atol=1e-5)

    def test_yarn_published_values(self):
        # Qwen3 with factor 4 over 32768 positions: ramp from pair 23 to 40, attention factor 1 + 0.1 ln 4
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        rope = RotaryPositionalEmbedding(128, base=1e6, scaling=scaling)
        plain = torch.tensor(plain_inv_freq(128, 1e6), dtype=torch.float64)
        kept = (rope.inv_freq == plain).nonzero().flatten().tolist()
        divided = torch.isclose(rope.inv_freq, plain / 4, rtol=1e-12).nonzero().flatten().tolist()
        assert kept == list(range(0, 24)) and divided == list(range(40, 64))
        assert rope.attention_factor == pytest.approx(1.1386294361, rel=1e-9)

    def test_longrope_switches_past_original_length(self):
        short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                   "original_max_position_embeddings": 32, "max_position_embeddings": 1024}
        rope = RotaryPositionalEmbedding(16, scaling=scaling)
        attention = math.sqrt(1 + math.log(1024 / 32) / math.log(32))
        x = torch.randn(1, 1, 33, 16)
        for n, factors in ((32, short), (33, long)):
            freqs = [f / s for f, s in zip(plain_inv_freq(16), factors)]
            want = rope_oracle(x[..., :n, :], list(range(n)), freqs, factor=attention)
            torch.testing.assert_close(rope(x[..., :n, :]).double(), want, rtol=0, atol=2e-6)

    def test_longrope_published_attention_factor(self):
        # Phi-3-mini-128k: 131072 / 4096 positions -> sqrt(1 + ln 32 / ln 4096) = 1.190238
        scaling = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
                   "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
        assert RotaryPositionalEmbedding(96, scaling=scaling).attention_factor == pytest.approx(1.190238, abs=1e-6)

    def test_llama3(self):
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        rope = RotaryPositionalEmbedding(128, base=500000.0, scaling=scaling)
        freqs = llama3_oracle(128, 500000.0, 8.0, 1.0, 4.0, 8192)
        torch.testing.assert_close(rope.inv_freq, torch.tensor(freqs, dtype=torch.float64), rtol=1e-12, atol=0)
        # Llama-3.1-8B: pairs 0-28 unchanged, 29-34 smoothed, 35-63 divided by 8
        plain = torch.tensor(plain_inv_freq(128, 500000.0), dtype=torch.float64)
        assert (rope.inv_freq[:29] == plain[:29]).all()
        torch.testing.assert_close(rope.inv_freq[35:], plain[35:] / 8, rtol=1e-12, atol=0)
        assert ((rope.inv_freq[29:35] < plain[29:35]) & (rope.inv_freq[29:35] > plain[29:35] / 8)).all()

    def test_scaling_setter_rebuilds_tables(self):
        rope = RotaryPositionalEmbedding(16)
        x = torch.randn(1, 1, 8, 16)
        rope(x)
        rope.scaling = {"rope_type": "linear", "factor": 2.0}
        torch.testing.assert_close(rope(x, torch.arange(8) * 2), RotaryPositionalEmbedding(16)(x))

    @pytest.mark.parametrize("scaling", [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 128},
        {"rope_type": "longrope", "short_factor": [1.0 + i / 32 for i in range(32)],
         "long_factor": [2.0 + i / 8 for i in range(32)], "original_max_position_embeddings": 128},
    ])
    def test_same_cos_sin_as_hugging_face_when_installed(self, scaling):
        llama = pytest.importorskip("transformers.models.llama.modeling_llama")
        config = llama.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=256,
                                   rope_parameters={**scaling, "rope_theta": 10000.0})
        ours_scaling = dict(scaling, max_position_embeddings=256) if scaling["rope_type"] == "longrope" else scaling
        rope = RotaryPositionalEmbedding(64, scaling=ours_scaling)
        for n in (100, 500):  # below and above the original length (dynamic, longrope switch)
            cos, sin = llama.LlamaRotaryEmbedding(config)(torch.zeros(1, 64), torch.arange(n)[None])
            ours_cos, ours_sin = rope.cos_sin(None, n)
            # Hugging Face builds angles in fp32: ~1e-7 relative error per unit of angle
            torch.testing.assert_close(torch.cat([ours_cos] * 2, -1), cos[0], rtol=0, atol=2e-4)
            torch.testing.assert_close(torch.cat([ours_sin] * 2, -1), sin[0], rtol=0, atol=2e-4)

    def test_mrope_sections_match_oracle(self):
        rope = RotaryPositionalEmbedding(32, sections=[4, 6, 6])
        positions = torch.tensor([[0, 0, 0], [1, 2, 3], [4, 0, 7], [9, 9, 2]])
        axis = [0] * 4 + [1] * 6 + [2] * 6
        x = torch.randn(2, 4, 32)
        per_pair = [tuple(int(p[axis[i]]) for i in range(16)) for p in positions]
        want = rope_oracle(x, per_pair, plain_inv_freq(32))
        torch.testing.assert_close(rope(x, positions).double(), want, rtol=0, atol=2e-6)

    def test_mrope_text_tokens_equal_1d_rope(self):
        # Qwen2-VL: a text token has t = h = w = its index
        rope = RotaryPositionalEmbedding(32, sections=[4, 6, 6])
        x = torch.randn(1, 2, 10, 32)
        torch.testing.assert_close(rope(x, torch.arange(10)[:, None].expand(10, 3)), RotaryPositionalEmbedding(32)(x))

    def test_axial_per_axis_spectrum(self):
        rope = RotaryPositionalEmbedding(16, interleaved=True, sections=[4, 4], axis_spectrum="per_axis")
        positions = torch.tensor([[2, 5], [7, 1]])
        freqs = plain_inv_freq(8) + plain_inv_freq(8)
        per_pair = [tuple([int(p[0])] * 4 + [int(p[1])] * 4) for p in positions]
        x = torch.randn(3, 2, 16)
        torch.testing.assert_close(rope(x, positions).double(),
                                   rope_oracle(x, per_pair, freqs, interleaved=True), rtol=0, atol=2e-6)

    def test_multi_axis_scores_relative_per_axis(self):
        rope = RotaryPositionalEmbedding(DH, sections=[4, 6, 6])
        q, k, _ = qkv(dtype=torch.float64)
        grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(4), indexing="ij"), -1)
        positions = grid.reshape(N, 3)
        base = rope.forward_attn(q, k, positions, positions)
        shift = torch.tensor([5, -3, 11])
        torch.testing.assert_close(rope.forward_attn(q, k, positions + shift, positions + shift), base)

    def test_scaling_dict_conventions_of_transformers(self):
        """Issue 12.6: partial_rotary_factor inside scaling is honoured, rope_type wins over type,
        None values are absent, Qwen2-VL's legacy {'type': 'mrope', 'mrope_section'} gives sections."""
        partial = RotaryPositionalEmbedding(16, scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
        assert partial.rotary_dim == 8
        x = torch.randn(1, 2, 5, 16)
        torch.testing.assert_close(partial(x), RotaryPositionalEmbedding(16, rotary_dim=8)(x))
        both = RotaryPositionalEmbedding(16, scaling={"type": "linear", "rope_type": "default", "factor": 4.0})
        assert both.scaling["rope_type"] == "default"
        nones = RotaryPositionalEmbedding(16, scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": None,
                                                       "beta_fast": None, "original_max_position_embeddings": 8})
        yarn = RotaryPositionalEmbedding(16, scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 8})
        torch.testing.assert_close(nones(x), yarn(x))
        qwen2_vl = RotaryPositionalEmbedding(16, scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        assert qwen2_vl.sections == [2, 3, 3] and qwen2_vl.scaling["rope_type"] == "default"

    def test_proportional_matches_gemma4_formula(self):
        """Issue 13.4: the first int(p * Dh / 2) pairs keep base ** (-2i / Dh), the rest do not turn."""
        dim, proportion, base = 16, 0.25, 10000.0
        rope = RotaryPositionalEmbedding(dim, scaling={"rope_type": "proportional", "partial_rotary_factor": proportion})
        rotated = int(proportion * dim // 2)
        want = [base ** (-2 * i / dim) if i < rotated else 0.0 for i in range(dim // 2)]
        torch.testing.assert_close(rope.inv_freq, torch.tensor(want, dtype=torch.float64))
        same = RotaryPositionalEmbedding(dim, rotary_dim=4, scaling={"rope_type": "proportional"})
        torch.testing.assert_close(same.inv_freq, rope.inv_freq)
        x = torch.randn(1, 1, 6, dim, dtype=torch.float64)
        torch.testing.assert_close(rope(x)[..., 2:8], x[..., 2:8])       # zero-frequency pairs (half-split)

    def test_interleaved_sections_follow_qwen3_vl_order(self):
        rope = RotaryPositionalEmbedding(16, sections=[4, 2, 2], section_layout="interleaved")
        # Qwen3-VL: pair i takes axis 1 if i % 3 == 1 and i < 3 * sections[1], axis 2 likewise, else axis 0
        want = [1 if i % 3 == 1 and i < 6 else 2 if i % 3 == 2 and i < 6 else 0 for i in range(8)]
        assert rope.axis_of_pair.tolist() == want
        positions = torch.randint(0, 50, (5, 3))
        x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
        angles = torch.stack([positions[:, a] for a in want], -1).double() * rope.inv_freq    # [N, F]
        torch.testing.assert_close(rope(x, positions), rope_oracle_from_angles(x, angles))

    def test_seq_dim_minus_3_equals_transposed_layout(self):
        rope = RotaryPositionalEmbedding(16)
        x = torch.randn(2, 7, 3, 16)                                      # [B, N, H, Dh]
        positions = torch.randint(0, 100, (2, 7))
        want = rope(x.transpose(1, 2), positions).transpose(1, 2)
        torch.testing.assert_close(rope(x, positions, seq_dim=-3), want)
        with pytest.raises(ValueError, match="seq_dim must be -2 .* or -3"):
            rope(x, seq_dim=1)

    def test_cache_growth_is_atomic_across_threads(self):
        """Issue 12.2: two threads growing the cache while others read: every output is right."""
        import threading

        rope = RotaryPositionalEmbedding(8, cache_len=1)
        x = torch.randn(1, 1, 64, 8, dtype=torch.float32)
        want = [RotaryPositionalEmbedding(8)(x[..., :n, :]) for n in range(1, 65)]
        errors = []

        def work(seed):
            generator = torch.Generator().manual_seed(seed)
            for _ in range(200):
                n = int(torch.randint(1, 65, (1,), generator=generator))
                if not torch.allclose(rope(x[..., :n, :]), want[n - 1], atol=1e-6):
                    errors.append(n)
            rope._grow_cache(1)  # shrink again so growth keeps happening

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(dim=15), ValueError, "dim must be a positive even int, got dim=15"),
        (dict(dim=16, rotary_dim=7), ValueError, "rotary_dim must be a positive even int <= dim=16, got rotary_dim=7"),
        (dict(dim=16, rotary_dim=32), ValueError, "rotary_dim must be .*, got rotary_dim=32"),
        (dict(dim=16, scaling={"rope_type": "ntk"}), ValueError, "scaling\\['rope_type'\\] must be one of .*got 'ntk'"),
        (dict(dim=16, scaling={"rope_type": "linear"}), ValueError, "scaling with rope_type='linear' needs 'factor'"),
        (dict(dim=16, scaling={"rope_type": "yarn", "factor": 2.0}), ValueError, "scaling with rope_type='yarn' needs 'original_max_position_embeddings'"),
        (dict(dim=16, scaling={"rope_type": "linear", "factr": 2.0}), ValueError, "scaling has unknown keys \\['factr'\\]"),
        (dict(dim=16, scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8,
                               "original_max_position_embeddings": 8, "factor": 2.0}),
         ValueError, "scaling\\['short_factor'\\] must have rotary_dim / 2 = 8 entries, got 1"),
        (dict(dim=16, scaling="yarn"), TypeError, "scaling must be a dict"),
        (dict(dim=16, sections=[2, 2]), ValueError, "sections must be positive and sum to rotary_dim / 2 = 8"),
        # issue 12.5 / 12.6: flags are bools, scaling values are checked where they enter
        (dict(dim=16, interleaved="false"), TypeError, "interleaved must be a bool, got str 'false'"),
        (dict(dim=16, scaling={"rope_type": "linear", "factor": math.inf}), ValueError,
         "scaling\\['factor'\\] must be a finite number > 0.0, got scaling\\['factor'\\]=inf"),
        (dict(dim=16, scaling={"rope_type": "linear", "factor": "2"}), TypeError, "scaling\\['factor'\\] must be a real number"),
        (dict(dim=16, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": -8}),
         ValueError, "scaling\\['original_max_position_embeddings'\\] must be a positive int, got .*=-8"),
        (dict(dim=16, scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
         ValueError, "scaling\\['original_max_position_embeddings'\\] must be a positive int, got .*=0"),
        (dict(dim=16, scaling={"rope_type": "longrope", "short_factor": [0.0] * 8, "long_factor": [1.0] * 8,
                               "original_max_position_embeddings": 8, "factor": 2.0}),
         ValueError, "scaling\\['short_factor'\\] must be a finite number > 0.0"),
        (dict(dim=16, scaling={"rope_type": "linear", "factor": None}), ValueError, "scaling with rope_type='linear' needs 'factor'"),
        (dict(dim=16, sections=[2.5, 5.5]), TypeError, "sections must be an int, got float 2.5"),
        (dict(dim=16, rotary_dim=8, scaling={"rope_type": "default", "partial_rotary_factor": 0.25}), ValueError,
         "rotary_dim=8 disagrees with scaling\\['partial_rotary_factor'\\]=0.25"),
        (dict(dim=16, scaling={"rope_type": "linear", "factr": 2.0}), ValueError, "scaling has unknown keys \\['factr'\\]; allowed keys: \\['attention_factor'"),
        (dict(dim=16, sections=[2, 6], section_layout="interleaved"), ValueError, "section_layout='interleaved' \\(Qwen3-VL\\) needs three sections"),
        (dict(dim=16, section_layout="mixed"), ValueError, "section_layout must be one of 'contiguous', 'interleaved'"),
    ])
    def test_bad_arguments(self, kwargs, error, message):
        with pytest.raises(error, match="RotaryPositionalEmbedding: " + message):
            RotaryPositionalEmbedding(**kwargs)

    def test_bad_inputs(self):
        rope = RotaryPositionalEmbedding(16)
        with pytest.raises(ValueError, match="x must have at least 2 dims"):
            rope(torch.randn(16))
        with pytest.raises(ValueError, match="x must have last dim 16"):
            rope(torch.randn(2, 3, 8))
        with pytest.raises(ValueError, match="positions must have shape \\[3\\] or \\[2, 3\\], got \\(4,\\)"):
            rope(torch.randn(2, 3, 16), torch.arange(4))
        with pytest.raises(ValueError, match="positions must be finite"):
            rope(torch.randn(2, 3, 16), torch.tensor([0.0, float("nan"), 1.0]))
        with pytest.raises(ValueError, match="positions is required for 3 axes"):
            RotaryPositionalEmbedding(16, sections=[2, 3, 3])(torch.randn(2, 3, 16))

    def test_permute_rotary_weight_rejects_numpy_arrays(self):
        numpy = pytest.importorskip("numpy")
        with pytest.raises(TypeError, match="^permute_rotary_weight: weight must be a torch.Tensor .*got ndarray"):
            permute_rotary_weight(numpy.zeros((8, 2)), 4, to="half_split")

    def test_permute_rotary_weight_rejects_more_than_two_dims(self):
        """A stacked [layers, heads * head_dim, in] (or [heads, head_dim, in]) whose first size divides by
        head_dim had its first dim permuted silently: the layers (heads) moved, not the rows."""
        with pytest.raises(ValueError, match=r"^permute_rotary_weight: weight must be a weight \[heads \* head_dim, "
                                             r"in\] or a bias \[heads \* head_dim\], got a tensor of shape \[8, 16, 3\]"):
            permute_rotary_weight(torch.zeros(8, 16, 3), 8, to="half_split")

    def test_attention_rejects_rotary_built_for_another_head_dim(self):
        """The one-argument swap of the issue: RotaryPositionalEmbedding(4) (a head count) on head dim 32."""
        q, k, v = qkv()
        with pytest.raises(ValueError, match=r"RotaryPositionalEmbedding: q must be \[\.\.\., H, N, Dh=4\], got \(2, 4, 16, 32\)"):
            attention(q, k, v, RotaryPositionalEmbedding(4))
        with pytest.raises(ValueError, match=r"RotaryPositionalEmbedding: q and k must be \[\.\.\., H, N, Dh=4\]"):
            RotaryPositionalEmbedding(4).forward_attn(q, k)

    def test_interleaved_sections_too_large_raise_value_error(self):
        # h (axis 1) takes pairs 1, 4, 7: pair 7 does not exist among 7 pairs (was an IndexError)
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: section_layout='interleaved' gives axis a .*"
                                             "must be < rotary_dim / 2 = 7; got sections=\\[1, 3, 3\\]"):
            RotaryPositionalEmbedding(14, sections=[1, 3, 3], section_layout="interleaved")
        with pytest.raises(ValueError, match="must be < rotary_dim / 2 = 5; got sections=\\[1, 1, 3\\]"):   # w too large
            RotaryPositionalEmbedding(10, sections=[1, 1, 3], section_layout="interleaved")
        RotaryPositionalEmbedding(10, sections=[3, 1, 1], section_layout="interleaved")
        RotaryPositionalEmbedding(64, sections=[11, 11, 10], section_layout="interleaved")   # Qwen3.5: fits

    # -- from_config: every family against the model's own rotary module
    @pytest.mark.parametrize("scaling", [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
         "attention_factor": 0.9},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
    ], ids=lambda s: "default" if s is None else "-".join(str(v) for v in s.values())[:40])
    @pytest.mark.parametrize("top", [40, 200])   # dynamic: below and above max_position_embeddings
    def test_llama(self, scaling, top):
        config = hf_config("LlamaConfig", **TINY, max_position_embeddings=64, rope_theta=5e5,
                           rope_scaling=None if scaling is None else dict(scaling))
        positions = POSITIONS[:top]
        kwargs = _rotary_kwargs_from_config(config)
        family = f"llama/{'default' if scaling is None else scaling['rope_type']}"
        hf_cos, hf_sin = hf_cos_sin(hf_module("llama", "LlamaRotaryEmbedding")(config), positions)
        pe = compare_cos_sin(family, kwargs, hf_cos, hf_sin, positions)
        # and the rotated queries, through transformers' own apply_rotary_pos_emb
        apply = hf_module("llama", "apply_rotary_pos_emb")
        q = torch.randn(2, 4, top, 16)
        want, _ = apply(q, q, hf_cos.float()[None], hf_sin.float()[None])
        torch.testing.assert_close(pe(q, positions), want, atol=3e-5, rtol=1e-5)

    def test_qwen3_explicit_head_dim(self):
        config = hf_config("Qwen3Config", **TINY, head_dim=24, max_position_embeddings=64,
                           rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["dim"] == 24
        hf_cos, hf_sin = hf_cos_sin(hf_module("qwen3", "Qwen3RotaryEmbedding")(config), POSITIONS)
        compare_cos_sin("qwen3/yarn (head_dim=24)", kwargs, hf_cos, hf_sin, POSITIONS)

    def test_qwen2_legacy_type_key(self):
        config = hf_config("Qwen2Config", **TINY, max_position_embeddings=64,
                           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
        hf_cos, hf_sin = hf_cos_sin(hf_module("qwen2", "Qwen2RotaryEmbedding")(config), POSITIONS)
        compare_cos_sin("qwen2/yarn", _rotary_kwargs_from_config(config), hf_cos, hf_sin, POSITIONS)

    @pytest.mark.parametrize("top", [30, 200])   # short factors below the original length, long above
    @pytest.mark.parametrize("partial", [1.0, 0.75])
    def test_phi3_longrope(self, top, partial):
        half = int(16 * partial) // 2
        config = hf_config("Phi3Config", **TINY, max_position_embeddings=128, original_max_position_embeddings=32,
                           partial_rotary_factor=partial, pad_token_id=0,
                           rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                         "long_factor": [2.0 + 0.5 * i for i in range(half)]})
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["scaling"]["original_max_position_embeddings"] == 32
        hf_cos, hf_sin = hf_cos_sin(hf_module("phi3", "Phi3RotaryEmbedding")(config), POSITIONS[:top])
        compare_cos_sin("phi3/longrope", kwargs, hf_cos, hf_sin, POSITIONS[:top])

    def test_phi_partial_rotary_factor(self):
        config = hf_config("PhiConfig", **TINY, max_position_embeddings=64)   # partial_rotary_factor 0.5
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["rotary_dim"] == 8
        hf_cos, hf_sin = hf_cos_sin(hf_module("phi", "PhiRotaryEmbedding")(config), POSITIONS)
        compare_cos_sin("phi (partial 0.5)", kwargs, hf_cos, hf_sin, POSITIONS)

    def test_gpt_neox_rotary_pct(self):
        config = hf_config("GPTNeoXConfig", **TINY, max_position_embeddings=64, rotary_pct=0.5, rotary_emb_base=20000)
        kwargs = _rotary_kwargs_from_config(config)
        assert (kwargs["rotary_dim"], kwargs["base"]) == (8, 20000.0)
        hf_cos, hf_sin = hf_cos_sin(hf_module("gpt_neox", "GPTNeoXRotaryEmbedding")(config), POSITIONS)
        pe = compare_cos_sin("gpt_neox (rotary_pct 0.5)", kwargs, hf_cos, hf_sin, POSITIONS)
        apply = hf_module("gpt_neox", "apply_rotary_pos_emb")     # rotates the first 8 channels, passes 8
        q = torch.randn(2, 4, 200, 16)
        want, _ = apply(q, q, hf_cos.float()[None], hf_sin.float()[None])
        torch.testing.assert_close(pe(q, POSITIONS), want, atol=3e-5, rtol=1e-5)

    def test_gptj_rotary_dim_interleaved(self):
        config = hf_config("GPTJConfig", n_embd=64, n_head=4, n_layer=1, rotary_dim=8, n_positions=256, vocab_size=32)
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs == {"dim": 16, "base": 10000.0, "rotary_dim": 8, "interleaved": True}
        table = hf_module("gptj", "create_sinusoidal_positions")(256, 8)[POSITIONS].double()   # [N, sin | cos]
        hf_sin, hf_cos = table[:, :4], table[:, 4:]
        both = lambda t: torch.cat([t, t], -1)   # noqa: E731  (compare_cos_sin takes [N, R])
        pe = compare_cos_sin("gptj (rotary_dim, interleaved)", kwargs, both(hf_cos), both(hf_sin), POSITIONS)
        apply = hf_module("gptj", "apply_rotary_pos_emb")           # tensor [B, N, H, R]
        q = torch.randn(2, 200, 4, 16)
        want = torch.cat([apply(q[..., :8], hf_sin.float()[None], hf_cos.float()[None]), q[..., 8:]], -1)
        torch.testing.assert_close(pe(q.transpose(1, 2), POSITIONS).transpose(1, 2), want, atol=3e-5, rtol=1e-5)

    def test_cohere_interleaved(self):
        config = hf_config("CohereConfig", **TINY, max_position_embeddings=64)
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["interleaved"] is True
        rotary = hf_module("cohere", "CohereRotaryEmbedding")(config)
        hf_cos, hf_sin = hf_cos_sin(rotary, POSITIONS)
        pe = compare_cos_sin("cohere (interleaved)", kwargs, hf_cos, hf_sin, POSITIONS, interleaved_output=True)
        q = torch.randn(2, 4, 200, 16)
        want, _ = hf_module("cohere", "apply_rotary_pos_emb")(q, q, hf_cos.float()[None], hf_sin.float()[None])
        torch.testing.assert_close(pe(q, POSITIONS), want, atol=3e-5, rtol=1e-5)

    def test_llama4_interleaved(self):
        # Llama 4 rotates adjacent pairs through complex numbers (view_as_complex), whatever the config says
        config = hf_config("Llama4TextConfig", **TINY, head_dim=16, max_position_embeddings=64)
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["interleaved"] is True
        freqs_cis = hf_module("llama4", "Llama4TextRotaryEmbedding")(config)(torch.zeros(1), POSITIONS[None])  # [1, N, 8]
        pe = compare_cos_sin("llama4 (interleaved)", kwargs, freqs_cis.real[0].double().repeat_interleave(2, -1),
                             freqs_cis.imag[0].double().repeat_interleave(2, -1), POSITIONS, interleaved_output=True)
        q = torch.randn(2, 200, 4, 16)                                                       # Llama 4's [B, N, H, Dh]
        want, _ = hf_module("llama4", "apply_rotary_emb")(q, q, freqs_cis)
        torch.testing.assert_close(pe(q, POSITIONS, seq_dim=-3), want, atol=3e-5, rtol=1e-5)

    def test_glm_partial_interleaved(self):
        config = hf_config("GlmConfig", **TINY, max_position_embeddings=64, head_dim=16, partial_rotary_factor=0.5)
        kwargs = _rotary_kwargs_from_config(config)
        assert (kwargs["rotary_dim"], kwargs["interleaved"]) == (8, True)
        hf_cos, hf_sin = hf_cos_sin(hf_module("glm", "GlmRotaryEmbedding")(config), POSITIONS)
        pe = compare_cos_sin("glm (partial, interleaved)", kwargs, hf_cos, hf_sin, POSITIONS)
        q = torch.randn(2, 4, 200, 16)
        want, _ = hf_module("glm", "apply_rotary_pos_emb")(q, q, hf_cos.float()[None], hf_sin.float()[None])
        torch.testing.assert_close(pe(q, POSITIONS), want, atol=3e-5, rtol=1e-5)

    def test_gemma(self):
        config = hf_config("GemmaConfig", **TINY, head_dim=32, max_position_embeddings=64)
        hf_cos, hf_sin = hf_cos_sin(hf_module("gemma", "GemmaRotaryEmbedding")(config), POSITIONS)
        compare_cos_sin("gemma (head_dim=32)", _rotary_kwargs_from_config(config), hf_cos, hf_sin, POSITIONS)

    @pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
    def test_gemma3_per_layer_type(self, layer_type):
        config = hf_config("Gemma3TextConfig", **{**TINY, "num_hidden_layers": 2}, head_dim=16, max_position_embeddings=64,
                           layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6}})
        kwargs = _rotary_kwargs_from_config(config, layer_type=layer_type)
        rotary = hf_module("gemma3", "Gemma3RotaryEmbedding")(config)
        hf_cos, hf_sin = hf_cos_sin(rotary, POSITIONS, layer_type=layer_type)
        compare_cos_sin(f"gemma3/{layer_type}", kwargs, hf_cos, hf_sin, POSITIONS)
        with pytest.raises(ValueError, match=r"RotaryPositionalEmbedding.from_config: .*pass layer_type"):
            _rotary_kwargs_from_config(config)

    def test_falcon_rope(self):
        config = hf_config("FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                           vocab_size=32, max_position_embeddings=64, rope_theta=1e4)
        hf_cos, hf_sin = hf_cos_sin(hf_module("falcon", "FalconRotaryEmbedding")(config), POSITIONS)
        compare_cos_sin("falcon (alibi=False)", _rotary_kwargs_from_config(config), hf_cos, hf_sin, POSITIONS)

    def test_deepseek_v3_yarn_mscale_interleaved(self):
        scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                   "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
        config = hf_config("DeepseekV3Config", **TINY, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=64, rope_scaling=scaling,
                           n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1)
        kwargs = _rotary_kwargs_from_config(config)
        assert (kwargs["dim"], kwargs["interleaved"]) == (8, True)
        hf_cos, hf_sin = hf_cos_sin(hf_module("deepseek_v3", "DeepseekV3RotaryEmbedding")(config), POSITIONS)
        pe = compare_cos_sin("deepseek_v3/yarn (mscale_all_dim)", kwargs, hf_cos, hf_sin, POSITIONS)
        assert pe.attention_factor != 1.0   # mscale / mscale_all_dim reaches cos and sin
        # DeepSeek de-interleaves while rotating (output half-split); ours keeps pairs in place: the
        # outputs differ by one fixed permutation of channels, so every q . k logit is the same
        apply = hf_module("deepseek_v3", "apply_rotary_pos_emb_interleave")
        q, k = torch.randn(2, 4, 200, 8), torch.randn(2, 4, 200, 8)
        hf_q, hf_k = apply(q, k, hf_cos.float()[None], hf_sin.float()[None])
        torch.testing.assert_close(pe(q, POSITIONS) @ pe(k, POSITIONS).transpose(-1, -2),
                                   hf_q @ hf_k.transpose(-1, -2), atol=2e-4, rtol=1e-5)

    def test_qwen2_vl_mrope(self):
        config = hf_config("Qwen2VLConfig", text_config=dict(**TINY, max_position_embeddings=64,
                                                              rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}))
        kwargs = _rotary_kwargs_from_config(config)                # read through text_config
        assert kwargs["sections"] == [2, 3, 3] and "section_layout" not in kwargs
        axes = torch.stack([POSITIONS // 50, POSITIONS % 50 // 7, POSITIONS % 7 * 3])       # [3, N]: t, h, w
        rotary = hf_module("qwen2_vl", "Qwen2VLRotaryEmbedding")(config.text_config)
        hf_cos, hf_sin = hf_cos_sin(rotary, axes)
        compare_cos_sin("qwen2_vl (mrope)", kwargs, hf_cos, hf_sin, axes.T)

    def qwen3_vl(self):
        config = hf_config("Qwen3VLConfig", text_config=dict(**TINY, head_dim=16, max_position_embeddings=64,
                                                              rope_parameters={"rope_type": "default",
                                                                               "mrope_section": [4, 2, 2],
                                                                               "mrope_interleaved": True}))
        axes = torch.stack([POSITIONS // 50, POSITIONS % 50 // 7, POSITIONS % 7 * 3])       # [3, N]: t, h, w
        rotary = hf_module("qwen3_vl", "Qwen3VLTextRotaryEmbedding")(config.text_config)
        return config, axes, hf_cos_sin(rotary, axes)

    def test_qwen3_vl_kwargs_mean_interleaved_sections(self):
        # the section_layout="interleaved" contract, checked against transformers with a plain oracle:
        # pair i turns with axis a in (1, 2) when i % 3 == a and i < 3 * sections[a], else with axis 0
        config, axes, (hf_cos, hf_sin) = self.qwen3_vl()
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["sections"] == [4, 2, 2] and kwargs["section_layout"] == "interleaved"
        sections, half = kwargs["sections"], kwargs["dim"] // 2
        axis_of_pair = [next((a for a in (1, 2) if i % 3 == a and i < 3 * sections[a]), 0) for i in range(half)]
        assert axis_of_pair == [0, 1, 2, 0, 1, 2, 0, 0]
        for n in range(0, 200, 37):
            for i in range(half):
                angle = axes[axis_of_pair[i], n].item() * kwargs["base"] ** (-2 * i / kwargs["dim"])
                assert hf_cos[n, i].item() == pytest.approx(math.cos(angle), abs=2e-5)
                assert hf_sin[n, i].item() == pytest.approx(math.sin(angle), abs=2e-5)
        assert _rotary_kwargs_from_config(config.to_dict()) == kwargs                     # the config.json reads the same

    def test_qwen3_vl_interleaved_mrope(self):
        config, axes, (hf_cos, hf_sin) = self.qwen3_vl()
        compare_cos_sin("qwen3_vl (interleaved mrope)", _rotary_kwargs_from_config(config), hf_cos, hf_sin, axes.T)

    def test_qwen3_vl_interleaved_without_the_flag(self):
        # transformers interleaves for the qwen3_vl model type even when mrope_interleaved is absent
        config = hf_config("Qwen3VLConfig", text_config=dict(**TINY, head_dim=16))
        kwargs = _rotary_kwargs_from_config(config)
        assert kwargs["sections"] == [24, 20, 20] and kwargs["section_layout"] == "interleaved"

    def gemma4(self):
        config = hf_config("Gemma4TextConfig", **{**TINY, "num_hidden_layers": 2}, head_dim=16, global_head_dim=32, max_position_embeddings=64,
                           layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "proportional", "factor": 2.0,
                                                               "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
        rotary = hf_module("gemma4", "Gemma4TextRotaryEmbedding")(config)
        return config, hf_cos_sin(rotary, POSITIONS, layer_type="full_attention")

    def test_gemma4_kwargs_mean_proportional(self):
        # the rope_type="proportional" contract, checked against transformers with a plain oracle: the first
        # int(p * dim / 2) pairs turn at base ** (-2i / dim) / factor (exponent over the FULL head dim),
        # the other pairs have frequency 0
        config, (hf_cos, hf_sin) = self.gemma4()
        kwargs = _rotary_kwargs_from_config(config, layer_type="full_attention")
        assert kwargs == {"dim": 32, "base": 1e6, "scaling": {"rope_type": "proportional", "factor": 2.0,
                                                               "partial_rotary_factor": 0.25}}
        assert _rotary_kwargs_from_config(config.to_dict(), layer_type="full_attention") == kwargs
        assert _rotary_kwargs_from_config(config, layer_type="sliding_attention") == {"dim": 16, "base": 10000.0}
        dim, rotated = kwargs["dim"], int(0.25 * kwargs["dim"] // 2)
        for n in range(0, 200, 37):
            for i in range(dim // 2):
                freq = kwargs["base"] ** (-2 * i / dim) / 2.0 if i < rotated else 0.0
                assert hf_cos[n, i].item() == pytest.approx(math.cos(n * freq), abs=2e-5)
                assert hf_sin[n, i].item() == pytest.approx(math.sin(n * freq), abs=2e-5)

    def test_gemma4_proportional(self):
        config, (hf_cos, hf_sin) = self.gemma4()
        compare_cos_sin("gemma4/proportional", _rotary_kwargs_from_config(config, layer_type="full_attention"),
                        hf_cos, hf_sin, POSITIONS)

    @pytest.mark.parametrize("name, kwargs", [
        ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
        ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
        ("GPTNeoXConfig", {}), ("PhiConfig", {}), ("GPTJConfig", {}), ("CohereConfig", {}), ("FalconConfig", {}),
        ("Qwen2VLConfig", {}), ("Qwen3VLConfig", {}), ("DeepseekV3Config", {}), ("Phi3Config", {}),
    ])
    def test_dict_config_gives_same_kwargs(self, name, kwargs):
        config = hf_config(name, **kwargs)
        assert _rotary_kwargs_from_config(config.to_dict()) == _rotary_kwargs_from_config(config)

    def test_raw_legacy_config_json(self):
        # a config.json as old checkpoints ship it: top-level rope_theta, rope_scaling with "type"
        raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
               "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
        config = hf_config("LlamaConfig", **{k: v for k, v in raw.items() if k != "model_type"})
        assert _rotary_kwargs_from_config(raw) == _rotary_kwargs_from_config(config) == {
            "dim": 16, "base": 5e5, "scaling": {"rope_type": "linear", "factor": 2.0}}
        neox = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4}   # rotary_pct default 0.25
        assert _rotary_kwargs_from_config(neox) == {"dim": 16, "base": 10000.0, "rotary_dim": 4}
        assert _rotary_kwargs_from_config(NEOX_DICT)["rotary_dim"] == DH // 2
        # legacy Qwen2-VL: "type": "mrope" is default RoPE with sections, read through text_config
        assert _rotary_kwargs_from_config(QWEN2_VL_DICT) == {"dim": DH, "base": 1e6, "sections": [4, 6, 6]}

    def test_dynamic_reads_max_position_embeddings(self):
        # transformers' dynamic NTK is relative to max_position_embeddings even when the dict names another length
        raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
               "rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}}
        assert _rotary_kwargs_from_config(raw)["scaling"] == {"rope_type": "dynamic", "factor": 2.0,
                                                              "max_position_embeddings": 64}

    def test_bad_configs(self):
        owner = "RotaryPositionalEmbedding.from_config"
        with pytest.raises(TypeError, match=f"{owner}: config must be a Hugging Face config object or its "
                                            f"to_dict\\(\\), got str"):
            _rotary_kwargs_from_config("meta-llama/Llama-3-8B")
        with pytest.raises(ValueError, match=f"{owner}: config \\(model_type='gpt2'\\) has no rotary embedding"):
            _rotary_kwargs_from_config({"model_type": "gpt2", "n_embd": 64, "n_head": 4})
        with pytest.raises(ValueError, match=f"{owner}: config has alibi=True .*ALiBiPositionalEmbedding.from_config"):
            _rotary_kwargs_from_config({"model_type": "falcon", "alibi": True, "rope_theta": 1e4, "hidden_size": 64,
                                        "num_attention_heads": 4})
        gemma3 = {"model_type": "gemma3_text", "head_dim": 16, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
        with pytest.raises(ValueError, match=f"{owner}: layer_type must be one of .*got 'global'"):
            _rotary_kwargs_from_config(gemma3, layer_type="global")
        with pytest.raises(ValueError, match=f"{owner}: the rotated dim must be even .*rotary_dim=3"):
            _rotary_kwargs_from_config({"model_type": "phi", "hidden_size": 64, "num_attention_heads": 4,
                                        "rope_theta": 1e4, "partial_rotary_factor": 0.2})

    def test_unchecked_model_type_needs_the_layout_stated(self):
        owner = "RotaryPositionalEmbedding.from_config"
        raw = {"model_type": "my_new_model", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
        with pytest.raises(ValueError, match=f"{owner}: model_type='my_new_model' \\(config field model_type\\) is not "
                                             f"among .*from_config\\(config, interleaved=True or False\\)"):
            RotaryPositionalEmbedding.from_config(raw)
        assert RotaryPositionalEmbedding.from_config(raw, interleaved=True).interleaved is True
        assert _rotary_kwargs_from_config(raw, interleaved=False) == {"dim": 16, "base": 1e4}
        # a multi-axis config needs its section layout too
        multi = {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}}
        with pytest.raises(ValueError, match="or how mrope_section maps pairs to axes.*section_layout='contiguous' "
                                             "or 'interleaved'"):
            RotaryPositionalEmbedding.from_config(multi, interleaved=False)
        pe = RotaryPositionalEmbedding.from_config(multi, interleaved=False, section_layout="interleaved")
        assert (pe.sections, pe.section_layout) == ([4, 2, 2], "interleaved")
        # the keywords override an accepted model type's config (the caller takes responsibility)
        llama = {**raw, "model_type": "llama"}
        assert _rotary_kwargs_from_config(llama, interleaved=True, rotary_dim=8) == {
            "dim": 16, "base": 1e4, "rotary_dim": 8, "interleaved": True}
        with pytest.raises(TypeError, match=f"{owner}: interleaved must be a bool"):
            _rotary_kwargs_from_config(llama, interleaved="yes")

    @pytest.mark.parametrize("model_type, message", [
        ("nanochat", "minus the angle"), ("mistral_large4", "layer_encodings.*rope_alpha"),
        ("mistral_large4_text", "learned in the checkpoint")])
    def test_refused_rope_model_types(self, model_type, message):
        raw = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
        for stated in ({}, {"interleaved": False, "section_layout": "contiguous"}):   # keywords do not help
            with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported .*{message}"):
                RotaryPositionalEmbedding.from_config(raw, **stated)

    def test_the_issue_models_are_now_read_exactly(self):
        # layouts the census holds against the models' modules (the raw dicts need no transformers)
        read = lambda model_type, **fields: _rotary_kwargs_from_config(      # noqa: E731
            {"model_type": model_type, "rope_theta": 1e4, **fields})
        for model_type in ("cohere2_moe", "ernie4_5", "moonshine", "openai_privacy_filter", "pe_audio_encoder",
                           "glm4v_text", "deepseek_v2"):
            assert read(model_type, head_dim=16)["interleaved"] is True, model_type
        qwen3_5 = read("qwen3_5_text", head_dim=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "partial_rotary_factor": 0.25})
        assert (qwen3_5["sections"], qwen3_5["section_layout"], qwen3_5["rotary_dim"]) == ([11, 11, 10],
                                                                                          "interleaved", 64)
        hy = read("hy_v4_vl_text", head_dim=128)
        assert (hy["interleaved"], hy["section_layout"]) == (True, "interleaved")
        v4 = _rotary_kwargs_from_config({"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64,
                                         "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 0.125}}},
                                        layer_type="main")
        assert v4 == {"dim": 512, "base": 1e4, "rotary_dim": 64, "interleaved": True,     # not 8: the factor once
                      "rotated_channels": "trailing", "rotate_values": True}
        # a raw config.json (flat rope_scaling, compress_rope_theta) would read as one full-width RoPE: refused
        raw_v4 = {"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64, "rope_theta": 1e4,
                  "compress_rope_theta": 1.6e5, "rope_scaling": {"type": "yarn", "factor": 16,
                                                                 "original_max_position_embeddings": 65536}}
        for layer_type in ("main", "compress"):
            with pytest.raises(ValueError, match="deepseek_v4' has one RoPE per layer type .*DeepseekV4Config"):
                RotaryPositionalEmbedding.from_config(raw_v4, layer_type=layer_type)
        ministral = read("ministral3", head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16,
            "llama_4_scaling_beta": 0.1})
        assert "llama_4_scaling_beta" not in ministral["scaling"]

    def test_ministral3_query_temperature_stays_with_the_model(self):
        # the rotation is exact (census); the model's q scale 1 + beta log(1 + floor(p / L)) is not a RoPE term
        modeling = census_modeling("ministral3") if pytest.importorskip("transformers") else None
        positions = torch.arange(0, 100)
        scale = modeling.get_llama_4_attn_scale(positions[None], 0.1, 16)[0, :, :, 0]           # [1, N]
        want = 1 + 0.1 * torch.log1p(torch.floor(positions / 16.0))
        torch.testing.assert_close(scale[0], want)
        # and the library's class with Ministral 3's arguments gives the model's own factor
        ours = QueryTemperaturePositionalEmbedding(length=16, scale=0.1, shift=0).factor(positions, torch.float64)
        torch.testing.assert_close(ours, scale[0].double(), rtol=0, atol=1e-6)

    # -- from_config census: every accepted model type against its own module
    @pytest.mark.usefixtures("one_thread")
    @pytest.mark.parametrize("model_type", quick_or_slow(sorted(pe_lib._ROPE_MODEL_TYPES), CENSUS_QUICK))
    def test_model_type_matches_its_module(self, model_type):
        config = census_config(model_type)
        for layer_type in census_layer_types(config):
            diff = census_compare(model_type, config, layer_type)
            family = f"census {model_type}"
            MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), diff)
            assert diff <= 1e-3, f"{model_type} ({layer_type}): q . k logits differ by {diff:.3g}"
            for name, scaling in CENSUS_SCALINGS.items():
                if model_type in ("gptj", "codegen"):
                    break
                if (model_type, name) in CENSUS_SKIP:
                    continue
                scaled = census_config(model_type)
                kwargs = _rotary_kwargs_from_config(scaled, layer_type=layer_type)
                half = kwargs.get("rotary_dim", kwargs["dim"]) // 2
                census_set_scaling(scaled, layer_type, scaling, half)
                diff = census_compare(model_type, scaled, layer_type, name)
                if diff is None:
                    continue
                MAX_DIFF[family] = max(MAX_DIFF[family], diff)
                assert diff <= 1e-3, f"{model_type} ({layer_type}, {name}): q . k logits differ by {diff:.3g}"


# diffusers transformer configs (RotaryPositionalEmbedding.from_config with a config that has _class_name): each
# model built tiny from its config, its own position module against ours on the same positions.

def diffusers_model(name: str, config: dict):
    """A tiny diffusers model built from a config.json-style dict: its ``config`` (a FrozenDict) carries _class_name."""
    models = pytest.importorskip("diffusers.models.transformers")
    return getattr(models, name).from_config({"_class_name": name, **config})


def diffusers_ids(grid: tuple, *, text: int = 0, first: float = 0.0):
    """Flux-style float ids [N, A]: ``text`` tokens at zero, then the grid ``(h, w)`` (or more axes) row-major,
    its first axis at ``first`` (Flux Kontext puts reference images at 1)."""
    axes = torch.meshgrid(*[torch.arange(size, dtype=torch.float32) for size in grid], indexing="ij")
    image = torch.stack([torch.full_like(axes[0], first), *axes], -1).reshape(-1, 1 + len(grid))     # [N_img, A]
    return torch.cat([torch.zeros(text, 1 + len(grid)), image])                                        # [N, A]


def diffusers_grid(sizes: tuple):
    """The (t, h, w) grid [N, 3] a video model's RoPE module walks, row-major."""
    axes = torch.meshgrid(*[torch.arange(size) for size in sizes], indexing="ij")
    return torch.stack(axes, -1).reshape(-1, len(sizes))


def diffusers_rope_case(name: str, model):
    """(positions [N, A], rotate) for ``model``: ``rotate(x [1, N, H, D])`` is what the model's attention does to
    q and k, with its own position module and its own apply function (diffusers.models.embeddings' where the
    attention calls it)."""
    from diffusers.models.embeddings import (apply_rotary_emb, get_1d_rotary_pos_embed, get_2d_rotary_pos_embed,
                                             get_3d_rotary_pos_embed)
    real = lambda table, **kw: lambda x: apply_rotary_emb(x, table, sequence_dim=1, **kw)   # noqa: E731
    complex_ = lambda freqs: lambda x: apply_rotary_emb(x, freqs, use_real=False)           # noqa: E731
    if name in ("HiDreamImageTransformer2DModel",):
        from diffusers.models.transformers.transformer_hidream_image import apply_rope
        ids = diffusers_ids((3, 4), text=2)
        freqs = model.pe_embedder(ids[None])                                             # [1, N, 1, D/2, 2, 2]
        return ids, lambda x: apply_rope(x, x, freqs)[0]
    if name in ("ZImageTransformer2DModel", "BriaFibo2Transformer2DModel"):
        ids = diffusers_ids((3, 4), text=2, first=5).long()                              # integer ids into tables
        return ids, complex_(model.rope_embedder(ids)[None])                             # [1, N, D/2] complex
    if name == "Lumina2Transformer2DModel":
        ids = diffusers_ids((3, 4), text=2, first=2).int()
        return ids, complex_(model.rope_embedder._get_freqs_cis(ids[None]))
    if name.startswith("Kandinsky"):
        from diffusers.models.transformers.transformer_hidream_image import apply_rope   # the same 2 x 2 product
        sizes, scale = (2, 3, 4), (1.0, 2.0, 2.0)
        axes = [torch.arange(s) for s in sizes]
        if name == "Kandinsky5Transformer3DModel":
            rope = model.visual_rope_embeddings((1, *sizes), axes, scale)
        else:
            rope = model.visual_rope_embeddings(axes, scale)
        half = rope.shape[-3]
        freqs = rope.reshape(1, -1, 1, half, 2, 2)                                        # [1, N, 1, D/2, 2, 2]
        return diffusers_grid(sizes) / torch.tensor(scale), lambda x: apply_rope(x, x, freqs)[0]
    if name in ("QwenImageTransformer2DModel", "NucleusMoEImageTransformer2DModel"):
        if name == "QwenImageTransformer2DModel":
            from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen as apply
        else:
            from diffusers.models.transformers.transformer_nucleusmoe_image import _apply_rotary_emb_nucleus as apply
        (f, h, w), text = (1, 3, 4), 3
        vid, txt = model.pos_embed([(f, h, w)], device=torch.device("cpu"), max_txt_seq_len=text)
        grid = diffusers_grid((f, h, w)) - torch.tensor([0, h - h // 2, w - w // 2])    # h, w centred (scale_rope)
        diagonal = (max(h // 2, w // 2) + torch.arange(text))[:, None].expand(text, 3)  # text after the image
        return torch.cat([grid, diagonal]), lambda x: apply(x, torch.cat([vid, txt]), use_real=False)
    if name == "MiniMaxH3Transformer3DModel":
        from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb
        ids = torch.cat([torch.arange(3)[:, None].expand(3, 3), diffusers_grid((2, 3, 4)) + 3])   # [N, 3]
        cos, sin = model.rope(ids)
        return ids, lambda x: _apply_rotary_emb(x, cos, sin)
    if name.startswith("AnyFlow"):
        from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb   # on [B, H, N, D]
        cpu = torch.device("cpu")
        if name == "AnyFlowTransformer3DModel":
            positions = diffusers_grid((2, 3, 4)).double()
            freqs = model.rope(layout_cfg={"total_frames": 2, "full_frame_shape": (3, 4)}, device=cpu)["query"]
        else:   # FAR: 1 compressed frame of 2 x 2 tokens (each pooling a 2 x 2 window), then 2 frames of 3 x 4
            compressed = diffusers_grid((1, 2, 2)) * torch.tensor([1, 2, 2]) + torch.tensor([0.0, 0.5, 0.5])
            positions = torch.cat([compressed.double(), diffusers_grid((2, 3, 4)) + torch.tensor([1, 0, 0])])
            freqs = model.rope(far_cfg={"total_frames": 3, "full_frame_shape": (3, 4), "compressed_frame_shape": (2, 2),
                                        "num_compressed_frames": 1}, device=cpu)["query"]
        return positions, lambda x: apply_rotary_emb(x.transpose(1, 2), freqs).transpose(1, 2)
    if name == "JoyImageEditPlusTransformer3DModel":   # two components, the second's frames after the first's
        from diffusers.models.transformers.transformer_joyimage_edit_plus import _apply_rotary_emb_batched
        tables = [model._get_rotary_pos_embed_for_range((0, 0, 0), (1, 3, 4)),
                  model._get_rotary_pos_embed_for_range((1, 0, 0), (3, 2, 3))]
        cos, sin = (torch.cat([table[i] for table in tables])[None] for i in (0, 1))         # [1, N, D]
        positions = torch.cat([diffusers_grid((1, 3, 4)), diffusers_grid((2, 2, 3)) + torch.tensor([1, 0, 0])])
        return positions, lambda x: _apply_rotary_emb_batched(x, x, (cos, sin))[0]
    if name == "WanAnimate2Transformer3DModel":   # a reference stream: axes offset (1, 0, 3), frames every 2nd
        from diffusers.models.transformers.transformer_wan_animate_2 import rope_apply
        freqs = model._rope_freqs((1, 0, 3), torch.device("cpu"))
        positions = diffusers_grid((2, 3, 4)) * torch.tensor([2, 1, 1]) + torch.tensor([1, 0, 3])
        return positions, lambda x: rope_apply(x, torch.tensor([[2, 3, 4]]), freqs, time_stride=2)
    if name == "JoyImageEditTransformer3DModel":
        from diffusers.models.transformers.transformer_joyimage import _apply_rotary_emb
        sizes, text = (2, 3, 4), 3   # text after the largest visual index, on every axis
        vis, txt = model.get_rotary_pos_embed(list(sizes), text)
        positions = torch.cat([diffusers_grid(sizes), (max(sizes) + torch.arange(text))[:, None].expand(text, 3)])
        table = tuple(torch.cat([a, b]) for a, b in zip(vis, txt))
        return positions, lambda x: _apply_rotary_emb(x, x, table)[0]
    if name == "QwenImage21Transformer2DModel":
        from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen
        # text advances one position per token on all axes; an image block sits at the next one on the frame axis,
        # its (h, w) centred on zero, and the text after it resumes max(h, w) later
        (h, w), before, after = (3, 4), 2, 3
        mask = torch.tensor([False] * before + [True] * h * w + [False] * after)
        freqs = model.pos_embed([(1, h, w)], mask, device=torch.device("cpu"))                 # [N, D/2] complex
        text = lambda p: p[:, None].expand(-1, 3)                                              # noqa: E731
        grid = diffusers_grid((1, h, w)) - torch.tensor([0, h - h // 2, w - w // 2]) + torch.tensor([before, 0, 0])
        positions = torch.cat([text(torch.arange(before)), grid, text(before + max(h, w) + torch.arange(after))])
        return positions, lambda x: apply_rotary_emb_qwen(x, freqs, use_real=False)
    if name in ("CogView4Transformer2DModel", "GlmImageTransformer2DModel"):
        h, w = 3, 5
        cos, sin = model.rope(torch.zeros(1, 1, 2 * h, 2 * w))                           # patch_size 2
        positions = diffusers_grid((h, w))
        if name == "CogView4Transformer2DModel":                                          # i * rope_axes_dim // n
            positions = positions * torch.tensor(model.config.rope_axes_dim) // torch.tensor([h, w])
        return positions, real((cos, sin), use_real_unbind_dim=-2)
    if name == "PRXTransformer2DModel":
        from diffusers.models.transformers.transformer_prx import apply_rope
        ids = diffusers_ids((3, 4))[:, 1:]                                                  # (row, col)
        freqs = model.pe_embedder(ids[None])                                               # [1, 1, N, D/2, 2, 2]
        return ids, lambda x: apply_rope(x.transpose(1, 2), freqs).transpose(1, 2)
    if name in ("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel", "EasyAnimateTransformer3DModel",
                "HunyuanDiT2DModel"):
        # linspace positions over a crop region of the base grid: the pipeline's (EasyAnimate: the module's)
        (t, h, w), crop = (2, 3, 4), ((1, 2), (4, 6))
        if name == "EasyAnimateTransformer3DModel":
            crop = model.rope_embedding.get_resize_crop_region_for_grid((h, w), 90 // 2, 60 // 2)
            cos, sin = model.rope_embedding(torch.zeros(1, 1, t, 2 * h, 2 * w))           # patch_size 2
        elif name == "HunyuanDiT2DModel":
            cos, sin = get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, crop, (h, w))
        else:
            cos, sin = get_3d_rotary_pos_embed(model.config.attention_head_dim, crop, (h, w), t)
        (top, left), (bottom, right) = crop
        hs = torch.linspace(top, bottom * (h - 1) / h, h, dtype=torch.float64)
        ws = torch.linspace(left, right * (w - 1) / w, w, dtype=torch.float64)
        if name == "HunyuanDiT2DModel":   # (column, row): get_2d_rotary_pos_embed's first half takes the column
            rows, cols = torch.meshgrid(hs, ws, indexing="ij")
            return torch.stack([cols, rows], -1).reshape(-1, 2), real((cos, sin))
        axes = torch.meshgrid(torch.arange(t, dtype=torch.float64), hs, ws, indexing="ij")
        return torch.stack(axes, -1).reshape(-1, 3), real((cos, sin))
    if name in ("Ideogram4Transformer2DModel", "Cosmos3OmniTransformer"):
        # (t, h, w) ids: text on the diagonal, then an image at t = 4 (Ideogram 4's image ids start at 65536,
        # where diffusers' float32 angles lose ~1e-2: the test keeps them small)
        text = torch.arange(4)[:, None].expand(4, 3)
        ids = torch.cat([text, diffusers_grid((1, 3, 4)) + torch.tensor([4, 8, 8])])           # [N, 3]
        if name == "Ideogram4Transformer2DModel":
            from diffusers.models.transformers.transformer_ideogram4 import _rotate_half
            cos, sin = model.rotary_emb(ids[None])                                             # [1, N, D]
        else:
            from diffusers.models.transformers.transformer_cosmos3 import _rotate_half
            cos, sin = model.rotary_emb(ids.T[:, None], torch.device("cpu"), torch.float32)
        cos, sin = cos[:, :, None], sin[:, :, None]                                            # [1, N, 1, D]
        return ids, lambda x: x * cos + _rotate_half(x) * sin
    if name == "AceStepTransformer1DModel":
        from diffusers.models.transformers.ace_step_transformer import _ace_step_rotary_freqs
        cos, sin = _ace_step_rotary_freqs(12, model.head_dim, model.rope_theta, torch.device("cpu"), torch.float32)
        return torch.arange(12), real((cos, sin), use_real_unbind_dim=-2)
    if name == "LongCatAudioDiTTransformer":
        from diffusers.models.transformers.transformer_longcat_audio_dit import _apply_rotary_emb
        table = model.rotary_embed(torch.zeros(1, 12, 1))                                     # [N, D] each
        return torch.arange(12), lambda x: _apply_rotary_emb(x, table)
    if name == "MiniMaxMusic3Transformer1DModel":
        from diffusers.models.transformers.transformer_minimax_music3 import _apply_partial_rotary_emb
        table = model.rotary_emb(12, torch.device("cpu"))
        return torch.arange(12), lambda x: _apply_partial_rotary_emb(x, table)
    if name == "StableAudio3DiTModel":   # its memory tokens come first, at positions 0, 1, ...
        from diffusers.models.transformers.transformer_stable_audio3 import _apply_rotary_partial
        freqs = model.rotary_pos_emb(12, torch.device("cpu"))                                  # [N, D / 2]
        return torch.arange(12), lambda x: _apply_rotary_partial(x, freqs)
    if name == "StableAudioDiTModel":
        n = 12       # the pipeline's table: attention_head_dim // 2 channels, half-split, on the leading slice
        cos, sin = get_1d_rotary_pos_embed(model.config.attention_head_dim // 2, n, use_real=True,
                                           repeat_interleave_real=False)
        rot = cos.shape[-1]
        return torch.arange(n), lambda x: torch.cat(
            [apply_rotary_emb(x[..., :rot], (cos, sin), use_real_unbind_dim=-2, sequence_dim=1), x[..., rot:]], -1)
    module = getattr(model, "pos_embed", None) or getattr(model, "rotary_emb", None) or model.rope
    if "Video" in name or name.startswith(("Wan", "SkyReels", "SanaVideo", "ChronoEdit")):
        sizes = (2, 3, 4)                                                                # patch 1 x 2 x 2
        cos, sin = module(torch.zeros(1, 1, sizes[0], 2 * sizes[1], 2 * sizes[2]))
        n, grid = math.prod(sizes), diffusers_grid(sizes)
        if name == "ChronoEditTransformer3DModel":   # two frames sit at 0 and rope_temporal_skip_len - 1
            grid = grid * torch.tensor([model.config.rope_temporal_skip_len - 1, 1, 1])
        return grid, real((cos.reshape(n, -1), sin.reshape(n, -1)))
    if name == "HunyuanImageTransformer2DModel":
        cos, sin = module(torch.zeros(1, 1, 3, 4))                                       # patch 1 x 1
        return diffusers_grid((3, 4)), real((cos, sin))
    axes = len(model.config.axes_dims_rope)
    ids = diffusers_ids((3, 4) if axes == 3 else (2, 3, 4), text=2, first=1)
    return ids, real(module(ids))


# name -> a tiny config (head 16 or 32, one layer of each kind)
FLUX_TINY = {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
             "axes_dims_rope": (4, 6, 6), "joint_attention_dim": 32, "in_channels": 4}
DIFFUSERS_ROPE_CONFIGS = {
    "FluxTransformer2DModel": {**FLUX_TINY, "pooled_projection_dim": 32},
    "ChromaTransformer2DModel": {**FLUX_TINY, "approximator_hidden_dim": 32, "approximator_layers": 1},
    "LongCatImageTransformer2DModel": {**FLUX_TINY, "pooled_projection_dim": 32},
    "OvisImageTransformer2DModel": {**FLUX_TINY},
    "Krea2Transformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "intermediate_size": 32, "text_hidden_dim": 32,
                                "num_text_layers": 1, "text_num_attention_heads": 2, "text_num_key_value_heads": 2,
                                "text_intermediate_size": 32, "num_layerwise_text_blocks": 1,
                                "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6), "rope_theta": 1000.0,
                                "in_channels": 4},
    "Flux2Transformer2DModel": {**FLUX_TINY, "axes_dims_rope": (4, 4, 4, 4), "rope_theta": 2000},
    "Flux3Transformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                "axes_dims_rope": (4, 4, 4, 4), "rope_theta": 10000},
    "BriaTransformer2DModel": {**FLUX_TINY, "pooled_projection_dim": 32, "rope_theta": 500},
    "BriaFiboTransformer2DModel": {**FLUX_TINY, "pooled_projection_dim": 32, "rope_theta": 500},
    "HiDreamImageTransformer2DModel": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                                       "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6),
                                       "caption_channels": [16, 16], "text_emb_dim": 16, "llama_layers": [0, 0],
                                       "in_channels": 4, "out_channels": 4, "patch_size": 2},
    "ZImageTransformer2DModel": {"dim": 32, "n_heads": 2, "n_kv_heads": 2, "n_layers": 1, "n_refiner_layers": 1,
                                 "cap_feat_dim": 16, "axes_dims": (4, 6, 6), "axes_lens": (16, 8, 8),
                                 "rope_theta": 256.0, "in_channels": 4},
    "BriaFibo2Transformer2DModel": {"dim": 32, "n_heads": 2, "n_layers": 1, "n_refiner_layers": 1,
                                    "cap_feat_dim": 16, "axes_dims": (4, 6, 6), "axes_lens": (16, 8, 8),
                                    "injection_layer_ids": (0,), "perceiver_num_layers": 1, "in_channels": 4},
    "Lumina2Transformer2DModel": {"hidden_size": 32, "num_attention_heads": 2, "num_kv_heads": 2, "num_layers": 1,
                                  "num_refiner_layers": 1, "multiple_of": 16, "axes_dim_rope": (4, 6, 6),
                                  "axes_lens": (16, 8, 8), "cap_feat_dim": 16, "in_channels": 4},
    "HunyuanVideoTransformer3DModel": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                                       "num_attention_heads": 2, "rope_axes_dim": (4, 6, 6), "rope_theta": 256.0,
                                       "text_embed_dim": 16, "pooled_projection_dim": 16, "in_channels": 4},
    "HunyuanVideo15Transformer3DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                         "rope_axes_dim": (4, 6, 6), "text_embed_dim": 16, "in_channels": 4,
                                         "patch_size": 2},
    "MotifVideoTransformer3DModel": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                                     "num_attention_heads": 2, "rope_axes_dim": (4, 6, 6), "in_channels": 4},
    "HunyuanImageTransformer2DModel": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                                       "num_attention_heads": 2, "rope_axes_dim": (8, 8), "text_embed_dim": 16,
                                       "in_channels": 4},
    "WanTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                              "text_dim": 16, "ffn_dim": 32, "rope_max_seq_len": 64, "in_channels": 4},
    "WanVACETransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                  "text_dim": 16, "ffn_dim": 32, "vace_layers": [0], "vace_in_channels": 4,
                                  "in_channels": 4},
    "WanAnimateTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                     "text_dim": 16, "ffn_dim": 32, "image_dim": 16, "motion_encoder_size": 64,
                                     "motion_style_dim": 16, "motion_encoder_dim": 16, "face_encoder_hidden_dim": 16},
    "SkyReelsV2Transformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                     "text_dim": 16, "ffn_dim": 32, "in_channels": 4},
    "SanaVideoTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                    "cross_attention_head_dim": 16, "cross_attention_dim": 32,
                                    "caption_channels": 16, "in_channels": 4},
    "Kandinsky5Transformer3DModel": {"model_dim": 64, "ff_dim": 32, "time_dim": 16, "in_text_dim": 16,
                                     "in_text_dim2": 16, "num_text_blocks": 1, "num_visual_blocks": 1,
                                     "axes_dims": (8, 12, 12)},
    "CogVideoXTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                    "text_embed_dim": 16, "time_embed_dim": 16, "in_channels": 4,
                                    "use_rotary_positional_embeddings": True},
    "ConsisIDTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                   "text_embed_dim": 16, "time_embed_dim": 16, "in_channels": 4,
                                   "use_rotary_positional_embeddings": True},
    "EasyAnimateTransformer3DModel": {"num_layers": 1, "mmdit_layers": 1, "attention_head_dim": 32,
                                      "num_attention_heads": 2, "text_embed_dim": 16, "time_embed_dim": 16,
                                      "in_channels": 4, "out_channels": 4, "patch_size": 2},
    "ChronoEditTransformer3DModel": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
                                     "text_dim": 16, "ffn_dim": 32, "in_channels": 4, "rope_temporal_skip_len": 5},
    "HunyuanDiT2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2, "hidden_size": 32,
                          "cross_attention_dim": 16, "cross_attention_dim_t5": 16, "pooled_projection_dim": 16,
                          "text_len": 4, "text_len_t5": 4, "in_channels": 4, "patch_size": 2, "sample_size": 8},
    "PRXTransformer2DModel": {"hidden_size": 32, "num_heads": 2, "axes_dim": (8, 8), "depth": 1,
                              "context_in_dim": 16, "in_channels": 4, "theta": 500},
    "GlmImageTransformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                   "text_embed_dim": 16, "time_embed_dim": 16, "condition_dim": 4,
                                   "prior_vq_quantizer_codebook_size": 16, "in_channels": 4},
    "QwenImageTransformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                    "axes_dims_rope": (4, 6, 6), "joint_attention_dim": 16, "in_channels": 4},
    "NucleusMoEImageTransformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                          "axes_dims_rope": (4, 6, 6), "joint_attention_dim": 16, "in_channels": 4,
                                          "moe_enabled": False},
    "Kandinsky6Transformer3DModel": {"model_dim": 64, "ff_dim": 32, "time_dim": 16, "in_text_dim": 16,
                                     "in_text_dim2": 16, "num_text_blocks": 1, "num_visual_blocks": 1,
                                     "axes_dims": (8, 12, 12), "in_visual_dim": 4, "out_visual_dim": 4},
    "Kandinsky6SRTransformer3DModel": {"model_dim": 64, "ff_dim": 32, "time_dim": 16, "num_visual_blocks": 1,
                                       "axes_dims": (8, 12, 12), "in_visual_dim": 4, "out_visual_dim": 4},
    "MiniMaxH3Transformer3DModel": {"num_layers": 1, "num_refiner_layers": 1, "attention_head_dim": 32,
                                    "num_attention_heads": 2, "hidden_size": 64, "ffn_dim": 32, "text_dim": 16,
                                    "freq_dim": 16, "time_embed_hidden_dim": 16, "time_embed_dim": 16,
                                    "rope_freq_dim": 4, "rope_theta": 500.0, "in_channels": 4,
                                    "audio_in_channels": 4},
    "JoyImageEditTransformer3DModel": {"hidden_size": 32, "num_attention_heads": 2, "text_dim": 16,
                                       "num_layers": 1, "rope_dim_list": (4, 6, 6), "theta": 256, "in_channels": 4},
    "JoyImageEditPlusTransformer3DModel": {"hidden_size": 32, "num_attention_heads": 2, "text_dim": 16,
                                           "num_layers": 1, "rope_dim_list": (4, 6, 6), "theta": 256,
                                           "in_channels": 4},
    **{name: {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2, "text_dim": 16, "ffn_dim": 32,
              "freq_dim": 16, "in_channels": 4, "out_channels": 4, "rope_max_seq_len": 64}
       for name in ("AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel")},
    "WanAnimate2Transformer3DModel": {"dim": 64, "num_heads": 2, "ffn_dim": 32, "freq_dim": 16, "text_dim": 16,
                                      "num_layers": 1, "in_dim": 4, "out_dim": 4, "text_len": 8,
                                      "use_img_emb": False},
    "QwenImage21Transformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                      "axes_dims_rope": (4, 6, 6), "context_in_dim": 16, "in_channels": 4,
                                      "out_channels": 4},
    "CogView4Transformer2DModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                   "text_embed_dim": 16, "time_embed_dim": 16, "condition_dim": 4,
                                   "rope_axes_dim": (16, 16), "in_channels": 4},
    "Ideogram4Transformer2DModel": {"in_channels": 4, "num_layers": 1, "attention_head_dim": 32,
                                    "num_attention_heads": 2, "intermediate_size": 32, "adaln_dim": 16,
                                    "llm_features_dim": 16, "rope_theta": 50000, "mrope_section": (4, 3, 3)},
    "Cosmos3OmniTransformer": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                               "head_dim": 16, "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 16,
                               "patch_latent_dim": 8, "rope_axes_dim": (4, 2, 2), "rope_theta": 50000.0},
    "AceStepTransformer1DModel": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                                  "head_dim": 16, "num_hidden_layers": 1, "intermediate_size": 32,
                                  "in_channels": 8, "audio_acoustic_hidden_dim": 4, "rope_theta": 1e5},
    "LongCatAudioDiTTransformer": {"dit_dim": 32, "dit_depth": 1, "dit_heads": 2, "dit_text_dim": 16,
                                   "latent_dim": 4},
    "MiniMaxMusic3Transformer1DModel": {"in_channels": 4, "condition_dim": 16, "num_layers": 1,
                                        "num_attention_heads": 2, "attention_head_dim": 16, "ff_inner_dim": 32,
                                        "rotary_dim": 8, "fourier_embedding_dim": 16},
    "StableAudio3DiTModel": {"io_channels": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "cond_token_dim": 16,
                             "global_cond_dim": 16, "local_add_cond_dim": 4, "timestep_features_dim": 16,
                             "num_memory_tokens": 2},
    "StableAudioDiTModel": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                            "num_key_value_attention_heads": 1, "cross_attention_dim": 16,
                            "cross_attention_input_dim": 16, "global_states_input_dim": 16, "time_proj_dim": 16,
                            "in_channels": 4},
}


def diffusers_transformer_classes() -> set:
    """Every model class (a ConfigMixin) in diffusers/models/transformers/*.py, read from the sources."""
    import ast
    models = pytest.importorskip("diffusers.models.transformers")
    names = set()
    for path in sorted(pathlib.Path(models.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any("ConfigMixin" in ast.unparse(base) for base in node.bases):
                names.add(node.name)
    return names


class TestDiffusersCompatRotary:
    """``DiffusersCompatRotaryEmbedding``: diffusers' position code that is not a rotation, against float64 loops."""

    @staticmethod
    def ernie_oracle(x, positions, axes, theta):
        """ERNIE-Image's apply, one channel at a time: angles f (per axis, Flux's spectrum) repeated twice,
        channel c paired half-split with c +- Dh / 2 and turned by its own angle f[c // 2]."""
        out, dh = torch.zeros_like(x), x.shape[-1]
        for n, p in enumerate(positions.tolist()):
            f = [p[a] * theta ** (-2 * j / width) for a, width in enumerate(axes) for j in range(width // 2)]
            for c in range(dh):
                partner = -x[n, c + dh // 2] if c < dh // 2 else x[n, c - dh // 2]
                out[n, c] = x[n, c] * math.cos(f[c // 2]) + partner * math.sin(f[c // 2])
        return out

    def test_ernie_image_matches_a_float64_loop(self):
        pe = DiffusersCompatRotaryEmbedding.from_config({"_class_name": "ErnieImageTransformer2DModel",
                                                         "hidden_size": 64, "num_attention_heads": 2,
                                                         "rope_axes_dim": [8, 12, 12], "rope_theta": 256})
        positions = torch.tensor([[5.0, 0, 0], [5, 1, 2], [0, 0, 0], [3, 0, 0], [7.5, 2, 9]], dtype=torch.float64)
        x = torch.randn(5, 32, dtype=torch.float64)
        torch.testing.assert_close(pe(x, positions), self.ernie_oracle(x, positions, (8, 12, 12), 256.0),
                                   rtol=0, atol=1e-12)
        # the attention path (encode_qk) and the seq_dim=-3 layout turn q and k as forward does
        q, k = torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32)
        turned = pe.encode_qk(q, k, positions.float(), positions.float())
        torch.testing.assert_close(turned[0], pe(q, positions.float()))
        torch.testing.assert_close(turned[1], pe(k, positions.float()))
        torch.testing.assert_close(pe(q.transpose(1, 2), positions.float(), seq_dim=-3).transpose(1, 2), turned[0])

    def test_pooled_matches_a_float64_loop(self):
        # FramePack / Helios history tokens: per pair, cos and sin averaged over the token's K positions on the
        # pair's axis, applied to the interleaved pair (2i, 2i + 1)
        pe = DiffusersCompatRotaryEmbedding(16, mode="pooled", sections=[2, 3, 3], axis_spectrum="per_axis", base=256.0)
        positions = torch.tensor([[[0, 0], [1, 1], [2, 2]], [[4, 5], [0, 1], [3, 3]], [[9, 9], [2, 2], [6, 7]]],
                                 dtype=torch.float64)                                     # [N, A, K]
        x = torch.randn(3, 16, dtype=torch.float64)
        want = torch.zeros_like(x)
        for n in range(3):
            pair = 0
            for a, width in enumerate((4, 6, 6)):
                for j in range(width // 2):
                    w = 256.0 ** (-2 * j / width)
                    c = sum(math.cos(w * float(p)) for p in positions[n, a]) / 2
                    s = sum(math.sin(w * float(p)) for p in positions[n, a]) / 2
                    x0, x1 = x[n, 2 * pair], x[n, 2 * pair + 1]
                    want[n, 2 * pair], want[n, 2 * pair + 1] = x0 * c - x1 * s, x0 * s + x1 * c
                    pair += 1
        out = pe(x, positions)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        # the cost: an ordinary token (its position repeated) keeps its norm, a pooled one loses some
        assert abs(out[0].norm() - x[0].norm()) < 1e-12 and out[1].norm() < x[1].norm() - 1e-3
        q, k = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
        turned = pe.encode_qk(q, k, positions.float(), positions.float())
        torch.testing.assert_close(turned[0], pe(q, positions.float()))
        torch.testing.assert_close(turned[1], pe(k, positions.float()))
        with pytest.raises(ValueError, match=r"DiffusersCompatRotaryEmbedding: mode='pooled' needs positions "
                                             r"\[..., N, 3, K\]"):
            pe(x, positions[..., 0])

    def test_ernie_image_is_not_a_rotation(self):
        # what the docs say it costs: norms change with position, and q . k is not a function of p_q - p_k
        pe = DiffusersCompatRotaryEmbedding(32, sections=[4, 6, 6], axis_spectrum="per_axis", base=256.0)
        x = torch.randn(1, 32, dtype=torch.float64)
        at = lambda *p: pe(x, torch.tensor([p], dtype=torch.float64))[0]                   # noqa: E731
        assert abs(at(0, 5, 3).norm() - x.norm()) > 1e-3
        assert abs(at(0, 0, 0) @ at(0, 0, 1) - at(0, 0, 7) @ at(0, 0, 8)) > 1e-3
        with pytest.raises(TypeError, match="DiffusersCompatRotaryEmbedding: mode='ernie_image' is not a rotation"):
            pe.rerotate(x, torch.zeros(1, 3), torch.ones(1, 3))
        with pytest.raises(ValueError, match="DiffusersCompatRotaryEmbedding: mode must be one of"):
            DiffusersCompatRotaryEmbedding(32, mode="framepack")

    def test_pooled_refuses_bad_positions_naming_the_pooled_shape(self):
        pe = DiffusersCompatRotaryEmbedding(16, mode="pooled", sections=[2, 3, 3])
        x = torch.randn(2, 4, 16)
        with pytest.raises(ValueError, match=r"DiffusersCompatRotaryEmbedding: mode='pooled' needs positions "
                                             r"\[..., N, 3, K\] \(K >= 1 positions per axis, averaged\), got a "
                                             r"tensor of shape \[4, 3, 0\]"):
            pe(x, torch.zeros(4, 3, 0))
        with pytest.raises(ValueError, match=r"needs positions_k \[..., N, 3, K\] \(K >= 1"):
            pe.encode_qk(x, x, torch.zeros(4, 3, 1), torch.zeros(4, 3, 0))
        # a wrong N is reported with the [..., N, A, K] tensor given, not only its [..., N, A] slice
        with pytest.raises(ValueError, match=r"positions must have shape \[4, 3\] or \[2, 4, 3\], got \(5, 3\) "
                                             r"\(mode='pooled' checks each \[..., N, 3\] slice of positions "
                                             r"\[..., N, 3, K\], got positions \[5, 3, 2\]\)"):
            pe(x, torch.zeros(5, 3, 2))
        with pytest.raises(ValueError, match=r"positions_q must have shape \[4, 3\] .*got positions_q \[5, 3, 2\] "
                                             r"and positions_k \[4, 3, 2\]\)"):
            attention(x[:, None], x[:, None], x[:, None], pe, positions_q=torch.zeros(5, 3, 2),
                      positions_k=torch.zeros(4, 3, 2))

    @pytest.mark.parametrize("mode", ["ernie_image", "pooled"])
    def test_repr_names_the_constructor_arguments_and_rebuilds(self, mode):
        pe = DiffusersCompatRotaryEmbedding(16, mode=mode, base=256.0, sections=[2, 3, 3], axis_spectrum="per_axis")
        assert repr(pe) == (f"DiffusersCompatRotaryEmbedding(mode={mode!r}, dim=16, base=256.0, sections=[2, 3, 3], "
                            f"axis_spectrum='per_axis')")
        rebuilt = eval(repr(pe))
        x, positions = torch.randn(2, 5, 16), torch.randint(0, 9, (5, 3)).float()
        positions = positions.unsqueeze(-1).expand(5, 3, 2) if mode == "pooled" else positions
        assert torch.equal(rebuilt(x, positions), pe(x, positions))


class TestDiffusersConfig:
    """``from_config`` on diffusers transformer configs (``_class_name``): each accepted model class against its
    own position module and attention's apply function (diffusers 0.42.1), and the refusals with their reasons."""

    @pytest.mark.parametrize("name", sorted(DIFFUSERS_ROPE_CONFIGS))
    def test_rotary_model_matches_its_module(self, name):
        pytest.importorskip("diffusers")
        model = diffusers_model(name, DIFFUSERS_ROPE_CONFIGS[name])
        rope = RotaryPositionalEmbedding.from_config(model.config)            # the loaded FrozenDict
        # the raw config.json and a hand-written dict (our defaults are the model's) read the same
        saved = json.loads(model.to_json_string())
        stated = {"_class_name": name, **DIFFUSERS_ROPE_CONFIGS[name]}
        assert _rotary_kwargs_from_config(saved) == _rotary_kwargs_from_config(stated) == \
            _rotary_kwargs_from_config(model.config)
        positions, rotate = diffusers_rope_case(name, model)
        x = torch.randn(1, positions.shape[0], 2, rope.dim)                    # [1, N, H, D], diffusers' layout
        ours = rope(x.transpose(1, 2), positions).transpose(1, 2)
        diff = (ours - rotate(x)).abs().max().item()
        MAX_DIFF[f"diffusers {name}"] = diff
        # float32 rounding: most modules compute their angles in float32, a few ulps of the largest angle
        tolerance = 1e-6 + 4e-7 * positions.abs().max().item()
        assert diff < tolerance, f"{name}: rotated q differs by {diff:.3g} (tolerance {tolerance:.3g})"

    # -- diffusers_positions: the ids each pipeline (or model) feeds, through our encoding, against the model
    DIFFUSERS_POSITIONS = ("FluxTransformer2DModel", "ChromaTransformer2DModel", "BriaTransformer2DModel",
                           "BriaFiboTransformer2DModel", "Flux2Transformer2DModel", "HunyuanVideoTransformer3DModel",
                           "HunyuanVideo15Transformer3DModel", "MotifVideoTransformer3DModel",
                           "WanTransformer3DModel", "WanVACETransformer3DModel", "WanAnimateTransformer3DModel",
                           "SkyReelsV2Transformer3DModel", "QwenImageTransformer2DModel")

    @pytest.mark.parametrize("name", DIFFUSERS_POSITIONS)
    def test_positions_through_from_config_match_the_model(self, name):
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb
        model = diffusers_model(name, DIFFUSERS_ROPE_CONFIGS[name])
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, h, w), text = (2, 3, 4), 5
        if name == "QwenImageTransformer2DModel":   # its module's text and image tables, in the joint order
            from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
            ids = pe_lib.diffusers_positions(model.config, height=h, width=w, text_len=text)
            vid, txt = model.pos_embed([(1, h, w)], device=torch.device("cpu"), max_txt_seq_len=text)
            x = torch.randn(1, ids.shape[0], 2, rope.dim)                                 # [1, N, H, D]
            ours = rope(x.transpose(1, 2), ids).transpose(1, 2)
            theirs = apply_rotary_emb_qwen(x, torch.cat([txt, vid]), use_real=False)
            assert (ours - theirs).abs().max().item() < 1e-6
            return
        if "Video" in name or name.startswith(("Wan", "SkyReels")):   # the model's module walks its latent grid
            ids = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w)
            module = getattr(model, "rope", None) or model.rotary_emb
            cos, sin = module(torch.zeros(1, 1, t, 2 * h, 2 * w))                        # patch 1 x 2 x 2
            cos, sin = cos.reshape(t * h * w, -1), sin.reshape(t * h * w, -1)             # [N, D]
        else:                                                                             # the pipeline's ids
            ids = pe_lib.diffusers_positions(model.config, height=h, width=w, text_len=text)
            pipe = pytest.importorskip(f"diffusers.pipelines.{'flux2' if 'Flux2' in name else 'flux'}")
            if name == "Flux2Transformer2DModel":
                pipeline = pipe.Flux2Pipeline
                reference = torch.cat([pipeline._prepare_text_ids(torch.zeros(1, text, 1))[0],
                                       pipeline._prepare_latent_ids(torch.zeros(1, 1, h, w))[0]])
            else:
                reference = torch.cat([torch.zeros(text, 3), pipe.FluxPipeline._prepare_latent_image_ids(
                    1, h, w, torch.device("cpu"), torch.float32)])
            assert torch.equal(ids, reference.float())
            cos, sin = model.pos_embed(ids)
        x = torch.randn(1, ids.shape[0], 2, rope.dim)                                     # [1, N, H, D]
        ours = rope(x.transpose(1, 2), ids).transpose(1, 2)
        diff = (ours - apply_rotary_emb(x, (cos, sin), sequence_dim=1)).abs().max().item()
        assert diff < 1e-6, f"{name}: rotated q differs by {diff:.3g}"

    @pytest.mark.parametrize("layers, grid, condition", [(3, (3, 4), (5, 2)), (1, (2, 2), None), (2, (1, 5), (4, 4))])
    def test_qwen_image_layered_ids_match_its_layer3d_rope(self, layers, grid, condition):
        # QwenImageLayeredPipeline: layers + 1 grids of the output size, then the condition image; the model's
        # QwenEmbedLayer3DRope puts layer l at frame l, the condition at frame -1, the text after every grid
        pytest.importorskip("diffusers")
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
        name = "QwenImageTransformer2DModel"
        model = diffusers_model(name, dict(DIFFUSERS_ROPE_CONFIGS[name], use_layer3d_rope=True))
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (h, w), text = grid, 4
        shapes = [(1, h, w)] * (layers + 1) + [(1, *(condition or grid))]
        vid, txt = model.pos_embed([shapes], max_txt_seq_len=text, device=torch.device("cpu"))
        ids = pe_lib.diffusers_positions(model.config, height=h, width=w, text_len=text, layers=layers,
                                         reference=condition)
        assert ids.shape == (text + sum(f * a * b for f, a, b in shapes), 3)
        x = torch.randn(1, ids.shape[0], 2, rope.dim)                                     # [1, N, H, D]
        ours = rope(x.transpose(1, 2), ids).transpose(1, 2)
        diff = (ours - apply_rotary_emb_qwen(x, torch.cat([txt, vid]), use_real=False)).abs().max().item()
        MAX_DIFF[f"diffusers {name} Layer3D"] = max(diff, MAX_DIFF.get(f"diffusers {name} Layer3D", 0.0))
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"

    def test_qwen_image_layers_only_where_layered(self):
        qwen = {"_class_name": "QwenImageTransformer2DModel"}
        with pytest.raises(ValueError, match="^diffusers_positions: QwenImageTransformer2DModel: layers must be the "
                                             "pipeline's layers \\(an int >= 1\\), got layers=None$"):
            pe_lib.diffusers_positions(dict(qwen, use_layer3d_rope=True), height=2, width=2)
        with pytest.raises(ValueError, match="^diffusers_positions: QwenImageTransformer2DModel: layers must be None "
                                             "\\(use_layer3d_rope=False\\), got layers=2$"):
            pe_lib.diffusers_positions(qwen, height=2, width=2, layers=2)
        with pytest.raises(ValueError, match="^diffusers_positions: QwenImageTransformer2DModel: reference must be "
                                             "None \\(use_layer3d_rope=False\\), got reference=\\(2, 2\\)$"):
            pe_lib.diffusers_positions(qwen, height=2, width=2, reference=(2, 2))
        with pytest.raises(ValueError, match="^diffusers_positions: FluxTransformer2DModel: only Qwen-Image-Layered "
                                             "\\(QwenImageTransformer2DModel\\) takes layers; layers must be None, "
                                             "got layers=2$"):
            pe_lib.diffusers_positions({"_class_name": "FluxTransformer2DModel"}, height=2, width=2, layers=2)

    def test_flux_kontext_reference_matches_its_pipeline(self):
        # FluxKontextPipeline: text at zero, the image at (0, row, col), then its reference image (here another
        # size) at (1, row, col), through the model's pos_embed
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.pipelines.flux.pipeline_flux_kontext import FluxKontextPipeline as Kontext
        model = diffusers_model("FluxTransformer2DModel", DIFFUSERS_ROPE_CONFIGS["FluxTransformer2DModel"])
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (h, w), (rh, rw), text = (3, 4), (2, 5), 5
        pipeline = type("Pipeline", (), {"vae_scale_factor": 8, "latent_channels": 4,
                                         **{name: staticmethod(getattr(Kontext, name))
                                            for name in ("_pack_latents", "_prepare_latent_image_ids")}})()
        _, _, latent_ids, image_ids = Kontext.prepare_latents(     # the reference given as latents: 2 x 2 patches
            pipeline, torch.zeros(1, 4, 2 * rh, 2 * rw), 1, 4, 16 * h, 16 * w, torch.float32, torch.device("cpu"))
        want = torch.cat([torch.zeros(text, 3), latent_ids, image_ids])                    # as its __call__ joins them
        ids = pe_lib.diffusers_positions(model.config, height=h, width=w, text_len=text, reference=(rh, rw))
        assert torch.equal(ids, want)
        cos, sin = model.pos_embed(ids)
        x = torch.randn(1, ids.shape[0], 2, rope.dim)                                     # [1, N, H, D]
        ours = rope(x.transpose(1, 2), ids).transpose(1, 2)
        diff = (ours - apply_rotary_emb(x, (cos, sin), sequence_dim=1)).abs().max().item()
        MAX_DIFF["diffusers FluxTransformer2DModel Kontext reference"] = diff
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"
        with pytest.raises(ValueError, match="^diffusers_positions: reference must be a sequence of 2 positive ints, "
                                             "got reference=3$"):
            pe_lib.diffusers_positions(model.config, height=h, width=w, reference=3)
        with pytest.raises(ValueError, match="^diffusers_positions: ChromaTransformer2DModel: only Flux.1 "
                                             "\\(FluxKontextPipeline\\) and Qwen-Image-Layered take a reference image; "
                                             "reference must be None, got reference=\\(2, 2\\)$"):
            pe_lib.diffusers_positions({"_class_name": "ChromaTransformer2DModel"}, height=2, width=2,
                                       reference=(2, 2))

    @pytest.mark.parametrize("kwargs, error", [
        ({"height": 2, "width": 2, "frames": 2}, "FluxTransformer2DModel: frames must be None"),
        ({"height": 0, "width": 2}, "height must be a positive int, got height=0"),
        ({"height": 2, "width": 2, "text_len": -1}, "text_len must be a non-negative int"),
    ])
    def test_positions_refuse_bad_sizes(self, kwargs, error):
        with pytest.raises(ValueError, match=f"diffusers_positions: .*{re.escape(error)}"):
            pe_lib.diffusers_positions({"_class_name": "FluxTransformer2DModel"}, **kwargs)
        sd3 = {"_class_name": "SD3Transformer2DModel", "pos_embed_max_size": 8}
        with pytest.raises(ValueError, match=r"diffusers_positions: SD3Transformer2DModel: the latent grid 9 x 4 "
                                             r"exceeds pos_embed_max_size=8"):
            pe_lib.diffusers_positions(sd3, height=9, width=4)
        with pytest.raises(ValueError, match="SD3Transformer2DModel: its text tokens take no positions"):
            pe_lib.diffusers_positions(sd3, height=2, width=2, text_len=1)

    def test_positions_refuse_models_not_built(self):
        with pytest.raises(ValueError, match="diffusers_positions: WanTransformer3DModel: frames must be the latent"):
            pe_lib.diffusers_positions({"_class_name": "WanTransformer3DModel"}, height=2, width=2)
        with pytest.raises(ValueError, match="its text tokens take no positions"):
            pe_lib.diffusers_positions({"_class_name": "WanTransformer3DModel"}, height=2, width=2, frames=1,
                                       text_len=3)
        with pytest.raises(ValueError, match="the position ids of OvisImageTransformer2DModel are not built yet"):
            pe_lib.diffusers_positions({"_class_name": "OvisImageTransformer2DModel"}, height=2, width=2)
        with pytest.raises(ValueError, match="diffusers_positions: SanaWMTransformer3DModel .* camera matrices"):
            pe_lib.diffusers_positions({"_class_name": "SanaWMTransformer3DModel"}, height=2, width=2)

    # -- tables added to the tokens: the patch embedding with its projection zeroed returns the table it adds
    @staticmethod
    def added_table(patch_embed, latent):
        """What ``patch_embed(latent)`` adds to the projected patches: its position table (the projection zeroed)."""
        with torch.no_grad():
            for param in patch_embed.proj.parameters():
                param.zero_()
            return patch_embed(latent)[0]                                                     # [N, D]

    @pytest.mark.parametrize("name, config, size, positions", [
        # DiT: a grid of sample_size / patch_size, positions (column, row) / (grid / base_size)
        ("DiTTransformer2DModel", {"sample_size": 8}, (6, 10), lambda h, w: (torch.arange(w) / (w / 4),
                                                                            torch.arange(h) / (h / 4))),
        # PixArt: the same divided by interpolation_scale
        ("PixArtTransformer2DModel", {"sample_size": 8, "interpolation_scale": 2, "caption_channels": 16},
         (4, 4), lambda h, w: (torch.arange(w) / 2, torch.arange(h) / 2)),
        # SD3: the pos_embed_max_size^2 table's centre crop; base size sample_size / patch_size = 4
        ("SD3Transformer2DModel", {"sample_size": 8, "pos_embed_max_size": 7, "joint_attention_dim": 16,
                                   "caption_projection_dim": 16, "pooled_projection_dim": 16},
         (3, 6), lambda h, w: ((torch.arange(w) + (7 - w) // 2) / (7 / 4), (torch.arange(h) + (7 - h) // 2) / (7 / 4))),
        # Latte: its spatial table as DiT's
        ("LatteTransformer3DModel", {"sample_size": 8, "patch_size": 2, "caption_channels": 16,
                                     "cross_attention_dim": 16, "num_embeds_ada_norm": 1000,
                                     "norm_type": "ada_norm_single"},
         (4, 4), lambda h, w: (torch.arange(w) / 1.0, torch.arange(h) / 1.0)),
        # Sana: a table only with interpolation_scale; Transformer2DModel: PixArt's default max(sample_size // 64, 1)
        ("SanaTransformer2DModel", {"sample_size": 8, "patch_size": 2, "interpolation_scale": 2,
                                    "num_cross_attention_heads": 2, "cross_attention_head_dim": 8,
                                    "cross_attention_dim": 16, "caption_channels": 16},
         (6, 10), lambda h, w: (torch.arange(w) / (w / 4) / 2, torch.arange(h) / (h / 4) / 2)),
        ("Transformer2DModel", {"sample_size": 8, "patch_size": 2, "norm_type": "ada_norm_zero",
                                "num_embeds_ada_norm": 1000},
         (4, 4), lambda h, w: (torch.arange(w) / 1.0, torch.arange(h) / 1.0)),
    ])
    def test_sincos_table_matches_its_patch_embedding(self, name, config, size, positions):
        pytest.importorskip("diffusers")
        config = {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1, "in_channels": 4, **config}
        model = diffusers_model(name, config)
        pe = SinusoidalPositionalEmbedding.from_config(model.config)
        assert pe.dim == 16 and pe.layout == "concat" and pe.num_axes == 2
        h, w = size
        patch_embed = model.patch_embed if name == "SanaTransformer2DModel" else model.pos_embed
        theirs = self.added_table(patch_embed, torch.zeros(1, 4, 2 * h, 2 * w))               # patch size 2
        cols, rows = positions(h, w)
        grid = torch.stack(torch.meshgrid(cols.double(), rows.double(), indexing="xy"), -1)  # [h, w, 2]: (col, row)
        diff = (pe.embed(grid.reshape(-1, 2)).float() - theirs).abs().max().item()
        MAX_DIFF[f"diffusers {name}"] = diff
        if name in ("DiTTransformer2DModel", "SD3Transformer2DModel"):   # diffusers_positions builds them
            ids = pe_lib.diffusers_positions(model.config, height=h, width=w)
            assert torch.equal(ids, grid.reshape(-1, 2).float())
            assert (pe.embed(ids).float() - theirs).abs().max().item() < 1e-6
        assert diff < 1e-6, f"{name}: the sin-cos table differs by {diff:.3g}"
        if name == "LatteTransformer3DModel":   # its temporal table: 1-D, concat, over the frames
            frames = SinusoidalPositionalEmbedding(pe.dim, layout="concat").embed(torch.arange(16))
            torch.testing.assert_close(frames, model.temp_pos_embed[0], rtol=0, atol=1e-6)

    @pytest.mark.parametrize("name", ["CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel"])
    def test_cogvideox_3d_sincos_table_matches_its_patch_embedding(self, name):
        # CogVideoX 1.0 2B: get_3d_sincos_pos_embed, (t, column, row) on D / 4, 3 D / 8, 3 D / 8 channels, positions
        # divided by the interpolation scales; its text tokens get zeros
        pytest.importorskip("diffusers")
        model = diffusers_model(name, {
            "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2, "in_channels": 4,
            "text_embed_dim": 8, "time_embed_dim": 8, "sample_width": 8, "sample_height": 6, "sample_frames": 5,
            "max_text_seq_length": 3, "temporal_interpolation_scale": 2.0})
        pe = SinusoidalPositionalEmbedding.from_config(model.config)
        assert (pe.dim, pe.layout, pe.num_axes, pe.sections) == (16, "concat", 3, [2, 3, 3])
        with pytest.raises(ValueError, match=f"RotaryPositionalEmbedding.from_config: {name}: use_rotary_positional_"
                                             f"embeddings=False: .*SinusoidalPositionalEmbedding"):
            RotaryPositionalEmbedding.from_config(model.config)
        embed = model.patch_embed
        with torch.no_grad():
            for param in [*embed.proj.parameters(), *embed.text_proj.parameters()]:
                param.zero_()
        diff = 0.0
        for t, h, w in ((2, 3, 4), (3, 5, 2)):        # the stored table (the sample size), then one rebuilt
            with torch.no_grad():
                added = embed(torch.zeros(1, 3, 8), torch.zeros(1, t, 4, 2 * h, 2 * w))[0]          # patch 2
            assert not added[:3].any()
            axes = torch.meshgrid(torch.arange(t, dtype=torch.float32) / 2.0,                   # float32, as theirs
                                  torch.arange(h, dtype=torch.float32) / 1.875,
                                  torch.arange(w, dtype=torch.float32) / 1.875, indexing="ij")
            positions = torch.stack([axes[0], axes[2], axes[1]], -1).reshape(-1, 3)             # (t, column, row)
            diff = max(diff, (pe.embed(positions) - added[3:]).abs().max().item())
        MAX_DIFF[f"diffusers {name} (sin-cos)"] = diff
        assert diff < 1e-6, f"the 3-D sin-cos table differs by {diff:.3g}"
        with pytest.raises(ValueError, match="use_rotary_positional_embeddings=True: the model rotates q and k"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": name, "use_rotary_positional_embeddings": True})
        with pytest.raises(ValueError, match="must be a multiple of 16 .*got 24"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": name, "num_attention_heads": 2,
                                                       "attention_head_dim": 12})

    @pytest.mark.parametrize("name", ["CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel"])
    def test_cogvideox_learned_table_matches_its_patch_embedding(self, name):
        # CogVideoX 1.0 5B I2V: a learned table over text + patches at the sample size, beside its RoPE
        pytest.importorskip("diffusers")
        model = diffusers_model(name, {
            "num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2, "in_channels": 4,
            "text_embed_dim": 8, "time_embed_dim": 8, "sample_width": 8, "sample_height": 6, "sample_frames": 9,
            "max_text_seq_length": 5, "use_rotary_positional_embeddings": True,
            "use_learned_positional_embeddings": True})
        learned = LearnedPositionalEmbedding.from_config(model.config)
        embed = model.patch_embed
        assert learned.weight.shape == embed.pos_embedding.shape[1:] == (5 + 3 * 3 * 4, 32)    # T = (9 - 1) // 4 + 1
        with torch.no_grad():
            embed.pos_embedding.normal_()                                                   # a checkpoint's values
            learned.weight.copy_(embed.pos_embedding[0])
            text, video = torch.randn(1, 5, 8), torch.randn(1, 3, 4, 6, 8)
            added = embed(text, video)
            embed.use_learned_positional_embeddings = False                                 # the tokens alone
            assert torch.equal(learned(embed(text, video)), added)
        assert RotaryPositionalEmbedding.from_config(model.config).dim == 16                # the RoPE beside it
        with pytest.raises(ValueError, match=f"LearnedPositionalEmbedding.from_config: {name}: "
                                             f"use_learned_positional_embeddings=False: the model has no learned table"):
            LearnedPositionalEmbedding.from_config({"_class_name": name})
        with pytest.raises(ValueError, match="patch_size_t=2 \\(CogVideoX 1.5\\) does not fit the model's tokens"):
            LearnedPositionalEmbedding.from_config({"_class_name": name, "use_learned_positional_embeddings": True,
                                                    "patch_size_t": 2})

    def test_cogview3plus_table_matches_its_patch_embedding(self):
        # the top-left corner of a pos_embed_max_size^2 table (base size = the table's), text tokens get zeros
        pytest.importorskip("diffusers")
        model = diffusers_model("CogView3PlusTransformer2DModel", {
            "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2, "in_channels": 4, "text_embed_dim": 8,
            "time_embed_dim": 8, "condition_dim": 4, "pos_embed_max_size": 7, "sample_size": 8})
        pe = SinusoidalPositionalEmbedding.from_config(model.config)
        with torch.no_grad():
            for param in [*model.patch_embed.proj.parameters(), *model.patch_embed.text_proj.parameters()]:
                param.zero_()
            added = model.patch_embed(torch.zeros(1, 4, 6, 10), torch.zeros(1, 2, 8))[0]      # 2 text + 3 x 5
        assert not added[:2].any()
        cols_rows = torch.stack(torch.meshgrid(torch.arange(5), torch.arange(3), indexing="xy"), -1).reshape(-1, 2)
        diff = (pe.embed(cols_rows) - added[2:]).abs().max().item()
        MAX_DIFF["diffusers CogView3PlusTransformer2DModel"] = diff
        assert diff < 1e-6

    def test_learned_1d_tables_match_their_models(self):
        pytest.importorskip("diffusers")
        prior = diffusers_model("PriorTransformer", {
            "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1, "embedding_dim": 8,
            "num_embeddings": 5, "additional_embeddings": 3})
        rvq = diffusers_model("MiniMaxMusic3RVQDepthDecoder", {
            "hidden_size": 16, "num_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
            "audio_vocab_size": 8, "num_codebooks": 2, "max_position_embeddings": 6})
        film = diffusers_model("T5FilmDecoder", {"input_dims": 4, "targets_length": 7, "d_model": 16,
                                                 "num_layers": 1, "num_heads": 2, "d_kv": 8, "d_ff": 16})
        for model, table, init_std in ((prior, prior.positional_embedding[0], 0.0),
                                       (rvq, rvq.pos_embedding.weight, 1.0),
                                       (film, film.position_encoding.weight, 1.0)):
            pe = LearnedPositionalEmbedding.from_config(model.config)
            assert (pe.max_len, pe.dim, pe.init_std) == (*table.shape, init_std)
            with torch.no_grad():
                pe.weight.copy_(table)
                assert torch.equal(pe.embed(torch.arange(table.shape[0])), table)       # row p for token p
        MAX_DIFF["diffusers PriorTransformer, MiniMaxMusic3RVQDepthDecoder, T5FilmDecoder"] = 0.0

    def test_temporal_transformer_matches_its_blocks_table(self):
        # AnimateDiff's temporal transformer: diffusers' SinusoidalPositionalEmbedding (Vaswani's) in each block
        pytest.importorskip("diffusers")
        model = diffusers_model("TransformerTemporalModel", {
            "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 16, "norm_num_groups": 4,
            "positional_embeddings": "sinusoidal", "num_positional_embeddings": 24})
        pe = SinusoidalPositionalEmbedding.from_config(model.config)
        theirs = model.transformer_blocks[0].pos_embed.pe[0]                                   # [24, D]
        diff = (pe.embed(torch.arange(24)) - theirs).abs().max().item()
        MAX_DIFF["diffusers TransformerTemporalModel"] = diff
        assert diff < 1e-5, f"the temporal table differs by {diff:.3g}"    # diffusers' angles are float32

    def test_auraflow_learned_table_matches_its_crop(self):
        pytest.importorskip("diffusers")
        model = diffusers_model("AuraFlowTransformer2DModel", {
            "sample_size": 8, "num_mmdit_layers": 1, "num_single_dit_layers": 1, "attention_head_dim": 8,
            "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16,
            "pos_embed_max_size": 64})
        pe = LearnedPositionalEmbedding.from_config(model.config)
        assert (pe.max_len, pe.dim, pe.init_std) == (64, 16, 0.1)
        with torch.no_grad():
            pe.weight.copy_(model.pos_embed.pos_embed[0])                                     # the checkpoint's table
        h, w = 3, 6                                                                            # the 8 x 8 grid's centre
        rows, cols = torch.arange(h) + 8 // 2 - h // 2, torch.arange(w) + 8 // 2 - w // 2
        positions = (rows[:, None] * 8 + cols[None, :]).reshape(-1)                           # row-major indices
        theirs = self.added_table(model.pos_embed, torch.zeros(1, 4, 2 * h, 2 * w))
        with torch.no_grad():
            assert torch.equal(pe.embed(positions), theirs)
        MAX_DIFF["diffusers AuraFlowTransformer2DModel"] = 0.0

    def test_per_axis_learned_tables_match_vq_diffusion_and_cosmos(self):
        # VQ-Diffusion (Transformer2DModel over discrete latents): row and column tables summed; Cosmos 1.0: (t, h, w)
        # tables summed, then divided by 1e-6 + their RMS. Loaded with weight = cat of the model's tables.
        pytest.importorskip("diffusers")
        vq = diffusers_model("Transformer2DModel", {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1,
                                                    "num_vector_embeds": 9, "sample_size": 4,
                                                    "num_embeds_ada_norm": 10, "norm_type": "ada_norm"})
        pe = LearnedPositionalEmbedding.from_config(vq.config)
        assert (pe.max_len, pe.dim, pe.init_std, pe.normalize) == ((4, 4), 16, 1.0, False)
        module = vq.latent_image_embedding
        with torch.no_grad():
            pe.weight.copy_(torch.cat([module.height_emb.weight, module.width_emb.weight]))
            module.emb.weight.zero_()                                                     # only the positions
            theirs = module(torch.zeros(1, 14, dtype=torch.long))[0]                      # the first 14 of 4 x 4
            diff = (pe.embed(diffusers_grid((4, 4))[:14]) - theirs).abs().max().item()
        cosmos = diffusers_model("CosmosTransformer3DModel", {
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1,
            "text_embed_dim": 16, "adaln_lora_dim": 8, "max_size": (4, 8, 8)})
        pe = LearnedPositionalEmbedding.from_config(cosmos.config)
        assert (pe.max_len, pe.dim, pe.normalize, pe.eps) == ((4, 4, 4), 32, True, 1e-6)
        module = cosmos.learnable_pos_embed
        with torch.no_grad():
            for table in (module.pos_emb_t, module.pos_emb_h, module.pos_emb_w):
                table.normal_()
            pe.weight.copy_(torch.cat([module.pos_emb_t, module.pos_emb_h, module.pos_emb_w]))
            theirs = module(torch.zeros(1, 4, 2, 6, 8))[0]                                # 2 x 3 x 4 patches
            diff = max(diff, (pe.embed(diffusers_grid((2, 3, 4))) - theirs).abs().max().item())
        MAX_DIFF["diffusers Transformer2DModel (VQ-Diffusion), CosmosTransformer3DModel (learned)"] = diff
        assert diff < 1e-6, f"the per-axis tables differ by {diff:.3g}"
        with pytest.raises(ValueError, match="LearnedPositionalEmbedding.from_config: CosmosTransformer3DModel: "
                                             "extra_pos_embed_type=None: the model adds no learned table"):
            LearnedPositionalEmbedding.from_config(dict(cosmos.config, extra_pos_embed_type=None))
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding.from_config: Transformer2DModel: "
                                             "num_vector_embeds is set: .*LearnedPositionalEmbedding.from_config"):
            SinusoidalPositionalEmbedding.from_config(vq.config)
        with pytest.raises(ValueError, match="LearnedPositionalEmbedding.from_config: Transformer2DModel: "
                                             "num_vector_embeds=None: only discrete"):
            LearnedPositionalEmbedding.from_config({"_class_name": "Transformer2DModel", "patch_size": 2})

    def test_omnigen_longrope_and_table_match_its_modules(self):
        # OmniGen has two encodings: Phi-3's longrope in attention (short factors up to
        # original_max_position_embeddings, long past it, one attention factor) and a cropped 2-D table on patches
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb
        model = diffusers_model("OmniGenTransformer2DModel", {
            "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32,
            "num_layers": 1, "vocab_size": 16, "pad_token_id": 0, "time_step_dim": 16, "pos_embed_max_size": 12,
            "original_max_position_embeddings": 8, "max_position_embeddings": 32,
            "rope_scaling": {"short_factor": [1.0 + i / 8 for i in range(8)],
                             "long_factor": [1.0 + i for i in range(8)]}})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        diff = 0.0
        for n in (6, 12):                                 # the largest position below, then past the original length
            cos, sin = model.rope(torch.zeros(1), torch.arange(n)[None])
            x = torch.randn(1, n, 2, 16)
            theirs = apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-2, sequence_dim=1)
            diff = max(diff, (rope(x.transpose(1, 2), torch.arange(n)).transpose(1, 2) - theirs).abs().max().item())
        table = SinusoidalPositionalEmbedding.from_config(model.config)
        h, w, top, left = 3, 5, (12 - 3) // 2, (12 - 5) // 2            # the centre crop, base size 64
        rows, cols = torch.meshgrid(torch.arange(h) + top, torch.arange(w) + left, indexing="ij")
        positions = torch.stack([cols, rows], -1).reshape(-1, 2) / (12 / 64)
        theirs = model.patch_embedding._cropped_pos_embed(2 * h, 2 * w)[0]
        diff = max(diff, (table.embed(positions.double()).float() - theirs).abs().max().item())
        MAX_DIFF["diffusers OmniGenTransformer2DModel"] = diff
        assert diff < 1e-5, f"OmniGen differs by {diff:.3g}"

    def test_wan_split_against_a_float64_oracle(self):
        # Wan's head split (h = w = 2 (D // 6), t the rest), each axis its own spectrum, interleaved pairs
        rope = RotaryPositionalEmbedding.from_config({"_class_name": "WanTransformer3DModel", "attention_head_dim": 32})
        widths = [12, 10, 10]
        inv_freq = [10000.0 ** (-2 * j / w) for w in widths for j in range(w // 2)]
        axis = [a for a, w in enumerate(widths) for _ in range(w // 2)]
        positions = diffusers_grid((2, 3, 4)) * torch.tensor([7, 1, 3])            # spread the axes apart
        x = torch.randn(2, 24, 32, dtype=torch.float64)
        want = rope_oracle(x, [tuple(float(p[a]) for a in axis) for p in positions.tolist()], inv_freq,
                           interleaved=True)
        torch.testing.assert_close(rope(x, positions), want, rtol=0, atol=1e-12)

    @pytest.mark.parametrize("fps", [None, 16])
    def test_cosmos_matches_its_module(self, fps):
        # a base per axis (rope_scale), half-split pairs; frames at frame / fps * 24 for a video, else numbered
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb
        model = diffusers_model("CosmosTransformer3DModel", {
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 32, "num_layers": 1,
            "text_embed_dim": 16, "adaln_lora_dim": 8, "max_size": (8, 16, 16), "rope_scale": (2.0, 3.0, 1.5)})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, h, w) = (3, 4, 5)
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w, fps=fps)
        cos, sin = model.rope(torch.zeros(1, 5, t, 2 * h, 2 * w), fps=fps)                  # patch 1 x 2 x 2
        x = torch.randn(1, 2, t * h * w, 32)                                                # [B, H, N, D]
        diff = (rope(x, positions) - apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-2)).abs().max()
        MAX_DIFF[f"diffusers CosmosTransformer3DModel fps={fps}"] = diff.item()
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"

    def test_cosmos_bases_match_a_loop_oracle(self):
        # axis a: w_a channels (Wan's split: h = w = 2 (D // 6), t the rest) at theta_a ** (-2j / w_a),
        # theta_a = 10000 * rope_scale[a] ** (w_a / (w_a - 2)); pair i is (i, i + D / 2)
        rope = RotaryPositionalEmbedding.from_config({"_class_name": "CosmosTransformer3DModel",
                                                      "attention_head_dim": 20, "rope_scale": [2.0, 3.0, 0.5]}).double()
        widths, scales = (8, 6, 6), (2.0, 3.0, 0.5)
        inv_freq, axis = [], []
        for a in range(3):
            theta = 10000.0 * scales[a] ** (widths[a] / (widths[a] - 2))
            for j in range(widths[a] // 2):
                inv_freq.append(theta ** (-2 * j / widths[a]))
                axis.append(a)
        positions = diffusers_grid((2, 3, 4)) * torch.tensor([1.5, 1, 1])
        x = torch.randn(2, 24, 20, dtype=torch.float64)
        want = rope_oracle(x, [tuple(float(p[a]) for a in axis) for p in positions.tolist()], inv_freq)
        torch.testing.assert_close(rope(x, positions), want, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="diffusers_positions: CosmosTransformer3DModel: .*fps must be a finite "
                                             "number > 0.0, got fps=0"):
            pe_lib.diffusers_positions({"_class_name": "CosmosTransformer3DModel"}, frames=1, height=1, width=1, fps=0)
        with pytest.raises(ValueError, match="diffusers_positions: WanTransformer3DModel: its positions take no frame "
                                             "rate; fps must be None, got fps=24"):
            pe_lib.diffusers_positions({"_class_name": "WanTransformer3DModel"}, frames=1, height=1, width=1, fps=24)

    def test_allegro_matches_its_module(self):
        # a 1-D RoPE per third of the head, half-split inside each; the pipeline's tables over the grid divided by
        # the interpolation scales, indexed by the (t, h, w) grid
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb_allegro
        from diffusers.pipelines.allegro.pipeline_allegro import AllegroPipeline
        model = diffusers_model("AllegroTransformer3DModel", {
            "num_attention_heads": 2, "attention_head_dim": 24, "num_layers": 1, "cross_attention_dim": 48,
            "caption_channels": 16, "interpolation_scale_t": 2.2, "interpolation_scale_h": 1.5})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, h, w) = (3, 4, 5)
        pipeline = type("Pipeline", (), {"vae_scale_factor_spatial": 8, "transformer": model})()
        freqs, grid = AllegroPipeline._prepare_rotary_positional_embeddings(
            pipeline, 1, 16 * h, 16 * w, t, torch.device("cpu"))                            # patch 2, VAE 8
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w)
        assert torch.equal(torch.stack(grid, -1)[0].float() / torch.tensor([2.2, 1.5, 2.0]), positions)
        x = torch.randn(1, 2, t * h * w, 24)                                                # [B, H, N, D]
        diff = (rope(x, positions) - apply_rotary_emb_allegro(x, freqs, grid)).abs().max().item()
        MAX_DIFF["diffusers AllegroTransformer3DModel"] = diff
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"

    @pytest.mark.parametrize("name, patch_t, grid", [
        ("CogVideoXTransformer3DModel", None, (4, 5)), ("CogVideoXTransformer3DModel", None, (4, 7)),
        ("CogVideoXTransformer3DModel", 2, (4, 5)), ("ConsisIDTransformer3DModel", None, (3, 8))])
    def test_cogvideox_positions_match_its_pipeline(self, name, patch_t, grid):
        # 1.0 (and ConsisID): the grid's linspace over its crop of the base grid 6 x 10, fractional; 1.5 (patch_size_t):
        # the plain grid, the frames ceil(num_frames / patch_size_t)
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline
        from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline
        fields = {} if patch_t is None else {"patch_size_t": patch_t}
        model = diffusers_model(name, {**DIFFUSERS_ROPE_CONFIGS[name], "sample_height": 12, "sample_width": 20,
                                       **fields})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, (h, w)) = (3, grid)
        pipeline = type("Pipeline", (), {"vae_scale_factor_spatial": 8, "transformer": model})()
        prepare = (ConsisIDPipeline if name.startswith("ConsisID") else CogVideoXPipeline)
        cos, sin = prepare._prepare_rotary_positional_embeddings(
            pipeline, 16 * h, 16 * w, t * (patch_t or 1) - (patch_t or 1) + 1, torch.device("cpu"))  # VAE 8, patch 2
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w)
        assert positions.dtype == torch.float32 and positions.shape == (t * h * w, 3)
        assert (patch_t is None) != torch.equal(positions, diffusers_grid((t, h, w)))   # 1.0 crops: fractional
        x = torch.randn(1, 2, t * h * w, 32)                                                # [B, H, N, D]
        diff = (rope(x, positions) - apply_rotary_emb(x, (cos, sin))).abs().max().item()
        MAX_DIFF[f"diffusers {name} positions patch_size_t={patch_t} grid={grid}"] = diff
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"

    def test_cogvideox_positions_refuse_what_its_pipeline_cannot_build(self):
        config = {"_class_name": "CogVideoXTransformer3DModel", "use_rotary_positional_embeddings": True,
                  "patch_size_t": 2, "sample_height": 12, "sample_width": 20}
        with pytest.raises(ValueError, match="^diffusers_positions: CogVideoXTransformer3DModel: the latent grid 7 x 5 "
                                             "exceeds the base grid 6 x 10 \\(sample_height, sample_width over "
                                             "patch_size\\)$"):
            pe_lib.diffusers_positions(config, frames=2, height=7, width=5)
        with pytest.raises(ValueError, match="^diffusers_positions: ConsisIDTransformer3DModel: "
                                             "use_rotary_positional_embeddings=False: the positions of its 3-D sin-cos "
                                             "table are not built$"):
            pe_lib.diffusers_positions({"_class_name": "ConsisIDTransformer3DModel"}, frames=2, height=3, width=3)

    def test_lumina_next_map_matches_a_loop_oracle(self):
        # pair 2k turns with the row, 2k + 1 with the column, both at 10000 ** (-4k / D); pairs (2i, 2i + 1)
        rope = RotaryPositionalEmbedding.from_config({"_class_name": "LuminaNextDiT2DModel", "hidden_size": 32,
                                                      "num_attention_heads": 2}).double()
        inv_freq = [10000.0 ** (-4 * (i // 2) / 16) for i in range(8)]
        positions = diffusers_grid((3, 4)) * torch.tensor([3, 1])
        x = torch.randn(2, 12, 16, dtype=torch.float64)
        want = rope_oracle(x, [tuple(float(p[i % 2]) for i in range(8)) for p in positions.tolist()], inv_freq,
                           interleaved=True)
        torch.testing.assert_close(rope(x, positions), want, rtol=0, atol=1e-12)

    @pytest.mark.parametrize("linear, ntk", [(1.0, 1.0), (2.0, 1.0), (1.0, 1.5)])
    def test_lumina_next_matches_its_module(self, linear, ntk):
        # (row, col) pairs alternating, each axis a spectrum over D / 2; the pipeline's time-aware factors as
        # docs/diffusers.md builds them: the linear factor divides the frequencies, the NTK factor the base's
        pytest.importorskip("diffusers")
        from diffusers.models.embeddings import apply_rotary_emb, get_2d_rotary_pos_embed_lumina
        model = diffusers_model("LuminaNextDiT2DModel", {
            "hidden_size": 48, "num_attention_heads": 2, "num_kv_heads": 2, "num_layers": 1, "cross_attention_dim": 16,
            "sample_size": 8, "in_channels": 4})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        assert rope.dim == model.head_dim == 24
        frequencies = [(10000.0 * ntk) ** (-4 * (i // 2) / 24) / linear for i in range(12)]
        if (linear, ntk) != (1.0, 1.0):
            rope = RotaryPositionalEmbedding(24, interleaved=True, pair_axes=rope.pair_axes, frequencies=frequencies)
        torch.testing.assert_close(rope.inv_freq, torch.tensor(frequencies, dtype=torch.float64), rtol=1e-15, atol=0)
        (h, w) = (5, 6)
        positions = pe_lib.diffusers_positions(model.config, height=h, width=w)
        freqs = get_2d_rotary_pos_embed_lumina(24, h, w, linear_factor=linear, ntk_factor=ntk)    # [h, w, 12]
        x = torch.randn(1, h * w, 2, 24)                                                     # [B, N, H, D]
        theirs = apply_rotary_emb(x, freqs.flatten(0, 1)[None], use_real=False)
        diff = (rope(x.transpose(1, 2), positions).transpose(1, 2) - theirs).abs().max().item()
        MAX_DIFF[f"diffusers LuminaNextDiT2DModel linear={linear} ntk={ntk}"] = diff
        assert diff < 1e-6, f"rotated q differs by {diff:.3g}"
        with pytest.raises(ValueError, match="diffusers_positions: LuminaNextDiT2DModel: its text tokens take no "
                                             "positions; text_len must be 0, got text_len=3"):
            pe_lib.diffusers_positions(model.config, height=h, width=w, text_len=3)

    def test_ltx_video_matches_its_module(self):
        # D = H Dh = 20: F = 3 rising frequencies over t h w interleaved pairs, 2 padding channels ahead (2 % 6 of D)
        pytest.importorskip("diffusers")
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb
        model = diffusers_model("LTXVideoTransformer3DModel", {
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10,
            "cross_attention_dim": 20, "num_layers": 1, "caption_channels": 16, "patch_size_t": 2})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, h, w), fps = (3, 4, 5), 24
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w, fps=fps)
        scale = (8 / fps, 32, 32)
        assert torch.equal(model.rope._prepare_video_coords(1, t, h, w, scale, torch.device("cpu"))[0] * 2 - 1,
                           positions)
        cos, sin = model.rope(torch.zeros(1, t * h * w, 20), t, h, w, rope_interpolation_scale=scale)
        x = torch.randn(1, t * h * w, 20)                                                  # q before the head split
        diff = (rope(x, positions) - apply_rotary_emb(x, (cos, sin))).abs().max().item()
        MAX_DIFF["diffusers LTXVideoTransformer3DModel"] = diff
        # diffusers' float32 angles, up to 10000 pi / 2 * |2 g - 1|: a few ulps of ~1.6e4
        tolerance = 4e-7 * max(rope.frequencies) * positions.abs().max().item()
        assert diff < tolerance, f"rotated q differs by {diff:.3g} (tolerance {tolerance:.3g})"
        assert torch.equal(rope(x, positions)[..., :2], x[..., :2])                         # the padding channels

    @pytest.mark.parametrize("name, rope_type", [("LTX2VideoTransformer3DModel", "interleaved"),
                                                 ("LTX2VideoTransformer3DModel", "split"),
                                                 ("SanaWMLTX2RefinerTransformer3DModel", "split")])
    def test_ltx2_matches_its_module(self, name, rope_type):
        # D = H Dh = 20: one padding pair, then 9 rising pairs; split: each head's 5 pairs half-split in its slice;
        # positions the midpoints of each patch's pixel span over the base sizes, as 2 g - 1
        pytest.importorskip("diffusers")
        model = diffusers_model(name, {
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10,
            "cross_attention_dim": 20, "num_layers": 1, "caption_channels": 16, "audio_in_channels": 4,
            "audio_out_channels": 4, "audio_num_attention_heads": 2, "audio_attention_head_dim": 4,
            "audio_cross_attention_dim": 8, "rope_type": rope_type, "rope_theta": 5000.0, "patch_size": 2})
        rope = RotaryPositionalEmbedding.from_config(model.config)
        (t, h, w), fps = (3, 2, 4), 25.0
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w, fps=fps)
        coords = model.rope.prepare_video_coords(1, t, 2 * h, 2 * w, torch.device("cpu"), fps=fps)   # patch 2
        bases = torch.tensor([20, 2048, 2048])
        assert torch.equal(((coords[..., 0] + coords[..., 1]) / 2.0)[0].T / bases * 2 - 1, positions)
        cos, sin = model.rope(coords)
        module = importlib.import_module(type(model).__module__)
        x = torch.randn(1, t * h * w, 20)                                                  # q before the head split
        apply = module.apply_split_rotary_emb if rope_type == "split" else module.apply_interleaved_rotary_emb
        theirs = apply(x, (cos, sin))
        theirs = theirs.swapaxes(1, 2).flatten(2) if theirs.dim() == 4 else theirs   # [B, H, N, Dh] -> [B, N, D]
        diff = (rope(x, positions) - theirs).abs().max().item()
        MAX_DIFF[f"diffusers {name} {rope_type}"] = diff
        tolerance = 4e-7 * max(rope.frequencies) * positions.abs().max().item()
        assert diff < tolerance, f"rotated q differs by {diff:.3g} (tolerance {tolerance:.3g})"

    def test_ltx_layouts_match_a_loop_oracle(self):
        # pair i after the padding: axis i % 3, frequency theta ** (k / (F - 1)) * pi / 2 with k = i // 3
        for config, chunk in (({"_class_name": "LTXVideoTransformer3DModel"}, None),
                              ({"_class_name": "LTX2VideoTransformer3DModel", "rope_type": "split",
                                "rope_theta": 100.0}, 10)):
            rope = RotaryPositionalEmbedding.from_config({**config, "num_attention_heads": 2,
                                                          "attention_head_dim": 10}).double()
            theta = config.get("rope_theta", 10000.0)
            axes = [0] + [i % 3 for i in range(9)]
            freqs = [0.0] + [theta ** ((i // 3) / 2) * math.pi / 2 for i in range(9)]
            positions = torch.rand(6, 3, dtype=torch.float64) * 2 - 1
            x = torch.randn(2, 6, 20, dtype=torch.float64)
            want = TestPairAxes.oracle(x, positions, axes, freqs, interleaved=chunk is None, chunk=chunk)
            torch.testing.assert_close(rope(x, positions), want, rtol=0, atol=1e-9)

    def test_mochi_matches_its_module(self):
        # RoPE-Mixed at head dim 128 over 3 axes (64 pairs): its learned pos_frequencies copied into freqs, its
        # (t, h, w) positions from diffusers_positions, against MochiRoPE's cos/sin and its processor's rotation
        pytest.importorskip("diffusers")
        model = diffusers_model("MochiTransformer3DModel", {
            "num_attention_heads": 2, "attention_head_dim": 128, "num_layers": 1, "pooled_projection_dim": 16,
            "in_channels": 4, "text_embed_dim": 16, "time_embed_dim": 16})
        pe = MixedRotaryPositionalEmbedding.from_config(model.config)
        assert (pe.head_dim, pe.num_heads, pe.num_axes) == (128, 2, 3)
        with torch.no_grad():
            model.pos_frequencies.normal_(std=0.05)
            pe.freqs.copy_(model.pos_frequencies)
        (t, h, w) = (2, 3, 4)
        positions = pe_lib.diffusers_positions(model.config, frames=t, height=h, width=w)
        assert torch.equal(positions, model.rope._get_positions(t, h, w, dtype=torch.float32))
        cos, sin = model.rope(model.pos_frequencies, t, h, w, dtype=torch.float32)          # [N, H, 64]
        x = torch.randn(1, t * h * w, 2, 128)                                               # [B, N, H, D]
        even, odd = x[..., 0::2], x[..., 1::2]   # MochiAttnProcessor2_0's inline apply_rotary_emb
        theirs = torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
        with torch.no_grad():
            ours = pe(x.transpose(1, 2), positions).transpose(1, 2)
        diff = (ours - theirs).abs().max().item()
        MAX_DIFF["diffusers MochiTransformer3DModel"] = diff
        assert diff < 2e-6, f"rotated q differs by {diff:.3g}"   # its float32 angles, up to ~8 rad

    def test_anyflow_far_pooled_frames_are_rope_at_the_midpoint(self):
        # AnyFlow FAR's compressed frames: cos and sin averaged over k positions, each pair rescaled to unit length,
        # are RoPE at k p + (k - 1) / 2 for k <= 6 (the reader's limit); at k = 7 the fastest pair points backwards
        config = {"_class_name": "AnyFlowFARTransformer3DModel", "attention_head_dim": 32}
        rope = RotaryPositionalEmbedding.from_config(config)
        inv_freq = [10000.0 ** (-2 * j / w) for w in (12, 10, 10) for j in range(w // 2)]   # Wan's split of 32
        unit = torch.tensor([1.0, 0.0], dtype=torch.float64).repeat(16)[None]                # every pair (1, 0)
        for k in (2, 3, 6, 7):
            for p in (0, 3):
                pooled = []
                for w in inv_freq:
                    c = sum(math.cos(w * (k * p + j)) for j in range(k)) / k
                    s = sum(math.sin(w * (k * p + j)) for j in range(k)) / k
                    pooled += [c / math.hypot(c, s), s / math.hypot(c, s)]
                mid = torch.full((1, 3), k * p + (k - 1) / 2, dtype=torch.float64)
                gap = (rope(unit, mid)[0] - torch.tensor(pooled, dtype=torch.float64)).abs().max().item()
                assert (gap < 1e-12) == (k <= 6), (k, p, gap)
        with pytest.raises(ValueError, match=r"RotaryPositionalEmbedding.from_config: AnyFlowFARTransformer3DModel: "
                                             r"compressed_patch_size / patch_size = \[1, 7, 7\]: a pooling window "
                                             r"over 6 positions flips"):
            RotaryPositionalEmbedding.from_config({**config, "compressed_patch_size": (1, 14, 14)})
        # plain AnyFlow's module walks the latent grid, as Wan's does
        assert torch.equal(pe_lib.diffusers_positions({"_class_name": "AnyFlowTransformer3DModel"}, frames=2,
                                                      height=3, width=4), diffusers_grid((2, 3, 4)).float())

    def test_ernie_image_compat_matches_its_attention(self, monkeypatch):
        # its attention processor, with identity projections and no q/k norm, hands the turned q, k to the kernel
        pytest.importorskip("diffusers")
        from diffusers.models.transformers import transformer_ernie_image
        model = diffusers_model("ErnieImageTransformer2DModel", {
            "hidden_size": 64, "num_attention_heads": 2, "num_layers": 1, "ffn_hidden_size": 32, "in_channels": 4,
            "out_channels": 4, "text_in_dim": 16, "rope_axes_dim": (8, 12, 12)})
        pe = DiffusersCompatRotaryEmbedding.from_config(model.config)
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding.from_config: ErnieImageTransformer2DModel .* "
                                             "uses DiffusersCompatRotaryEmbedding"):
            RotaryPositionalEmbedding.from_config(model.config)
        attn = model.layers[0].self_attention
        with torch.no_grad():
            for linear in (attn.to_q, attn.to_k):
                linear.weight.copy_(torch.eye(64))
        attn.norm_q = attn.norm_k = None
        seen = {}
        monkeypatch.setattr(transformer_ernie_image, "dispatch_attention_fn",
                            lambda q, k, v, **kw: seen.update(q=q, k=k) or v)
        # its ids: the image at (text length, row, col), then the text at (i, 0, 0)
        text = torch.arange(3.0)[:, None] * torch.tensor([1.0, 0, 0])
        ids = torch.cat([torch.cat([torch.full((12, 1), 3.0), diffusers_grid((3, 4)).float()], -1), text])
        x = torch.randn(1, 15, 64)
        attn(x, image_rotary_emb=model.pos_embed(ids[None]))
        ours = pe(x.unflatten(-1, (2, 32)), ids, seq_dim=-3)                                # [1, N, H, Dh]
        diff = max((ours - seen["q"]).abs().max().item(), (ours - seen["k"]).abs().max().item())
        MAX_DIFF["diffusers ErnieImageTransformer2DModel (compatibility mode)"] = diff
        assert diff < 1e-6, f"ERNIE-Image's turned q differs by {diff:.3g}"

    @pytest.mark.parametrize("name", ["HunyuanVideoFramepackTransformer3DModel", "HeliosTransformer3DModel"])
    def test_pooled_history_matches_the_model(self, name):
        # history tokens: the model's cos/sin over the latent grid, replicate-padded and averaged over 2 x 2 x 2
        # windows; ours averages each axis's window (its frames' indices, rows, columns, clamped at the edges)
        pytest.importorskip("diffusers")
        config = {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2, "in_channels": 4}
        if name == "HeliosTransformer3DModel":
            from diffusers.models.transformers import transformer_helios as module
            config.update(rope_dim=(4, 6, 6), text_dim=16, ffn_dim=32, freq_dim=16, out_channels=4)
        else:
            from diffusers.models.transformers import transformer_hunyuan_video_framepack as module
            config.update(num_single_layers=1, rope_axes_dim=(4, 6, 6), text_embed_dim=16, pooled_projection_dim=16,
                          image_condition_type=None)
        model = diffusers_model(name, config)
        pe = DiffusersCompatRotaryEmbedding.from_config(model.config)
        with pytest.raises(ValueError, match=f"RotaryPositionalEmbedding.from_config: {name} .* uses "
                                             f"DiffusersCompatRotaryEmbedding"):
            RotaryPositionalEmbedding.from_config(model.config)
        frames, (h, w) = torch.tensor([0, 4, 9]), (3, 5)
        x = torch.randn(1, 2 * 2 * 3, 2, 16)                                                # 2 x 2 x 3 pooled tokens
        if name == "HeliosTransformer3DModel":
            table = model.rope(frame_indices=frames[None], height=h, width=w, device=torch.device("cpu"))
            table = module.center_down_sample_3d(module.pad_for_3d_conv(table, (2, 2, 2)), (2, 2, 2))
            theirs = module.apply_rotary_emb_transposed(x, table.flatten(2).transpose(1, 2))
        else:
            from diffusers.models.embeddings import apply_rotary_emb
            cos, sin = model.rope(frame_indices=frames, height=2 * h, width=2 * w, device=torch.device("cpu"))
            theirs = apply_rotary_emb(x, model._pad_rotary_emb((cos, sin), h, w, (2, 2, 2)), sequence_dim=1)
        windows = [frames[[0, 1]], frames[[2, 2]]], [torch.tensor([0, 1]), torch.tensor([2, 2])], \
            [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 4])]               # replicate padding
        positions = torch.stack([torch.stack([t, r, c]) for t in windows[0] for r in windows[1] for c in windows[2]])
        ours = pe(x, positions.float(), seq_dim=-3)                                          # [N, 3, 2] positions
        diff = (ours - theirs).abs().max().item()
        MAX_DIFF[f"diffusers {name} (pooled history)"] = diff
        assert diff < 1e-6, f"{name}: the pooled history tokens differ by {diff:.3g}"

    def test_every_model_class_is_read_or_refused(self):
        classes = diffusers_transformer_classes()
        read, refused = set(pe_lib._DIFFUSERS_MODELS), set(pe_lib._DIFFUSERS_REFUSED)
        assert not read & refused
        assert classes == read | refused, (sorted(classes - read - refused), sorted((read | refused) - classes))
        tables = {"DiTTransformer2DModel", "PixArtTransformer2DModel", "SD3Transformer2DModel",
                  "LatteTransformer3DModel", "TransformerTemporalModel", "AuraFlowTransformer2DModel",
                  "CogView3PlusTransformer2DModel", "PriorTransformer", "MiniMaxMusic3RVQDepthDecoder",
                  "SanaTransformer2DModel", "Transformer2DModel", "T5FilmDecoder", "OmniGenTransformer2DModel",
                  "CosmosTransformer3DModel", "ErnieImageTransformer2DModel",
                  "HunyuanVideoFramepackTransformer3DModel", "HeliosTransformer3DModel"}
        own_tests = {"MochiTransformer3DModel", "CosmosTransformer3DModel", "AllegroTransformer3DModel",
                     "LuminaNextDiT2DModel", "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel",
                     "SanaWMLTX2RefinerTransformer3DModel"}   # rotary constructs compared in a test of their own
        assert read == set(DIFFUSERS_ROPE_CONFIGS) | tables | own_tests     # every accepted class has its comparison
        page = (pathlib.Path(__file__).parent / "docs" / "diffusers.md").read_text()
        assert [name for name in sorted(read | refused) if name not in page] == []   # the docs name each one

    # a field of the wrong type, sign or length, as a hand-written config gets it by accident: refused naming the
    # function, the model, the field and the value (before: truncated by int(), read as the default, a deep error)
    @pytest.mark.parametrize("build, config, kwargs, error", [
        (RotaryPositionalEmbedding, {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 128.5}, None,
         (TypeError, "FluxTransformer2DModel: attention_head_dim must be an int, got float 128.5")),
        (RotaryPositionalEmbedding, {"_class_name": "FluxTransformer2DModel", "axes_dims_rope": ["16", 56, 56]}, None,
         (TypeError, "FluxTransformer2DModel: axes_dims_rope[0] must be an int, got str '16'")),
        (RotaryPositionalEmbedding, {"_class_name": "LuminaNextDiT2DModel", "num_attention_heads": 0}, None,
         (ValueError, "LuminaNextDiT2DModel: num_attention_heads must be a positive int, got num_attention_heads=0")),
        (RotaryPositionalEmbedding, {"_class_name": "HunyuanVideoTransformer3DModel", "rope_theta": None}, None,
         (TypeError, "HunyuanVideoTransformer3DModel: rope_theta must be a real number, got NoneType None")),
        (LearnedPositionalEmbedding, {"_class_name": "CosmosTransformer3DModel", "max_size": (8, 16)}, None,
         (ValueError, "CosmosTransformer3DModel: max_size must be a list of 3 entries, got max_size=(8, 16)")),
        (RotaryPositionalEmbedding, {"_class_name": "LTX2VideoTransformer3DModel", "rope_type": "splt"}, None,
         (ValueError, "LTX2VideoTransformer3DModel: rope_type must be 'interleaved' or 'split', got rope_type='splt'")),
        (RotaryPositionalEmbedding, {"_class_name": "Ideogram4Transformer2DModel", "mrope_section": (24, 20)}, None,
         (ValueError, "Ideogram4Transformer2DModel: mrope_section must be a list of 3 entries")),
        (RotaryPositionalEmbedding, {"_class_name": "Cosmos3OmniTransformer",
                                     "rope_scaling": {"mrope_section": [24.5, 20, 20]}}, None,
         (TypeError, "Cosmos3OmniTransformer: rope_scaling: mrope_section[0] must be an int, got float 24.5")),
        (RotaryPositionalEmbedding, {"_class_name": "QwenImageTransformer2DModel", "use_layer3d_rope": "no"}, None,
         (TypeError, "QwenImageTransformer2DModel: use_layer3d_rope must be a bool, got str 'no'")),
        (pe_lib.diffusers_positions, {"_class_name": "AllegroTransformer3DModel", "interpolation_scale_t": 0},
         {"frames": 2}, (ValueError, "AllegroTransformer3DModel: interpolation_scale_t must be a finite number > 0.0, "
                                     "got interpolation_scale_t=0")),
        (pe_lib.diffusers_positions, {"_class_name": "LTX2VideoTransformer3DModel", "vae_scale_factors": (8, 32)},
         {"frames": 2}, (ValueError, "LTX2VideoTransformer3DModel: vae_scale_factors must be a list of 3 entries")),
        (pe_lib.diffusers_positions, {"_class_name": "CogVideoXTransformer3DModel", "patch_size": "2",
                                      "use_rotary_positional_embeddings": True}, {"frames": 2},
         (TypeError, "CogVideoXTransformer3DModel: patch_size must be an int, got str '2'")),
        (pe_lib.diffusers_positions, {"_class_name": "CosmosTransformer3DModel"}, {"frames": 2, "fps": 1e-300},
         (ValueError, "CosmosTransformer3DModel: fps=1e-300 puts the frames past float32's range")),
    ])
    def test_config_fields_are_checked(self, build, config, kwargs, error):
        call = build.from_config if kwargs is None else functools.partial(build, height=3, width=4, **kwargs)
        owner = f"{build.__name__}.from_config" if kwargs is None else "diffusers_positions"
        with pytest.raises(error[0], match=f"^{owner}: {re.escape(error[1])}"):
            call(config)
        # what the models do take still reads: a field at 0 where it may be, None where the model reads None
        assert LearnedPositionalEmbedding.from_config({"_class_name": "PriorTransformer",
                                                       "additional_embeddings": 0}).max_len == 77
        ltx2 = {"_class_name": "LTX2VideoTransformer3DModel", "num_attention_heads": 2, "attention_head_dim": 12}
        assert RotaryPositionalEmbedding.from_config({**ltx2, "causal_offset": 0}).dim == 24

    def test_refusals_name_the_model_and_why(self):
        owner = "RotaryPositionalEmbedding.from_config"
        for name, why in pe_lib._DIFFUSERS_REFUSED.items():
            with pytest.raises(ValueError, match=f"^{owner}: {name} \\(diffusers config _class_name\\) is not "
                                                 f"supported: {re.escape(why)}$"):
                RotaryPositionalEmbedding.from_config({"_class_name": name})
        with pytest.raises(ValueError, match=f"{owner}: _class_name='UNet2DConditionModel' is not a diffusers "
                                             f"transformer model this file reads"):
            RotaryPositionalEmbedding.from_config({"_class_name": "UNet2DConditionModel"})
        with pytest.raises(ValueError, match=f"{owner}: this diffusers config has no _class_name .*"
                                             f"dict\\(model.config, _class_name=type\\(model\\).__name__\\)"):
            RotaryPositionalEmbedding.from_config({"attention_head_dim": 64, "_use_default_values": []})
        flux = {"_class_name": "FluxTransformer2DModel"}
        with pytest.raises(ValueError, match=f"{owner}: a diffusers config \\(FluxTransformer2DModel\\) fixes its "
                                             f"layout; interleaved do not apply, got {{'interleaved': False}}"):
            RotaryPositionalEmbedding.from_config(flux, interleaved=False)
        with pytest.raises(ValueError, match=f"{owner}: CogVideoXTransformer3DModel: "
                                             f"use_rotary_positional_embeddings=False: .*3-D sin-cos table"):
            RotaryPositionalEmbedding.from_config({"_class_name": "CogVideoXTransformer3DModel"})
        # Qwen-Image-Layered's Layer3D RoPE turns by Qwen-Image's angles (its ids differ: diffusers_positions)
        assert repr(RotaryPositionalEmbedding.from_config({"_class_name": "QwenImageTransformer2DModel",
                                                           "use_layer3d_rope": True})) == \
            repr(RotaryPositionalEmbedding.from_config({"_class_name": "QwenImageTransformer2DModel"}))
        # HiDream's defaults (32, 32) do not fill its 128-channel heads (its checkpoints say (64, 32, 32))
        with pytest.raises(ValueError, match=f"{owner}: HiDreamImageTransformer2DModel: the per-axis rotary widths "
                                             f"must be positive, even and sum to the head dim 128, got \\[32, 32\\] "
                                             f"\\(config field axes_dims_rope\\)"):
            RotaryPositionalEmbedding.from_config({"_class_name": "HiDreamImageTransformer2DModel"})
        assert RotaryPositionalEmbedding.from_config({"_class_name": "HiDreamImageTransformer2DModel",
                                                      "axes_dims_rope": [64, 32, 32]}).sections == [32, 16, 16]
        # a field a config.json sets to null is read as the model reads it, not replaced by the default
        assert RotaryPositionalEmbedding.from_config({"_class_name": "PRXTransformer2DModel",
                                                      "axes_dim": None}).sections == [16, 16]
        joy = {"_class_name": "JoyImageEditTransformer3DModel", "hidden_size": 96, "num_attention_heads": 2,
               "rope_dim_list": None}
        assert RotaryPositionalEmbedding.from_config(joy).sections == [8, 8, 8]   # D // 3 channels each
        # each model names the class that builds its encoding; the table classes read diffusers configs only
        with pytest.raises(ValueError, match=f"{owner}: SD3Transformer2DModel \\(diffusers config _class_name\\) uses "
                                             f"SinusoidalPositionalEmbedding; call SinusoidalPositionalEmbedding"):
            RotaryPositionalEmbedding.from_config({"_class_name": "SD3Transformer2DModel"})
        with pytest.raises(ValueError, match="LearnedPositionalEmbedding.from_config: FluxTransformer2DModel .* uses "
                                             "RotaryPositionalEmbedding"):
            LearnedPositionalEmbedding.from_config({"_class_name": "FluxTransformer2DModel"})
        with pytest.raises(ValueError, match="LearnedPositionalEmbedding.from_config: OmniGenTransformer2DModel .* "
                                             "uses RotaryPositionalEmbedding and SinusoidalPositionalEmbedding"):
            LearnedPositionalEmbedding.from_config({"_class_name": "OmniGenTransformer2DModel"})
        with pytest.raises(ValueError, match=f"{owner}: OmniGenTransformer2DModel: rope_scaling must hold short_factor "
                                             f"and long_factor"):
            RotaryPositionalEmbedding.from_config({"_class_name": "OmniGenTransformer2DModel"})
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding.from_config: config must be a diffusers "
                                             "model config .*with _class_name"):
            SinusoidalPositionalEmbedding.from_config({"model_type": "llama"})
        with pytest.raises(TypeError, match="SinusoidalPositionalEmbedding.from_config: config must be a diffusers"):
            SinusoidalPositionalEmbedding.from_config("facebook/DiT-XL-2-256")
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding.from_config: TransformerTemporalModel: "
                                             "positional_embeddings=None: the model adds no position encoding"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": "TransformerTemporalModel"})
        sincos = "SinusoidalPositionalEmbedding.from_config"
        with pytest.raises(ValueError, match=f"{sincos}: SanaTransformer2DModel: interpolation_scale=None: the model "
                                             f"adds no position encoding"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": "SanaTransformer2DModel"})
        with pytest.raises(ValueError, match=f"{sincos}: Transformer2DModel: patch_size=None: continuous inputs"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": "Transformer2DModel"})
        with pytest.raises(ValueError, match=f"{sincos}: Transformer2DModel: num_vector_embeds is set: VQ-Diffusion"):
            SinusoidalPositionalEmbedding.from_config({"_class_name": "Transformer2DModel", "num_vector_embeds": 9})
        # DreamLite's refusal is the model's own: no block holds a position table
        if importlib.util.find_spec("diffusers") is not None:
            dreamlite = diffusers_model("DreamLiteTransformer2DModel", {
                "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "norm_num_groups": 4})
            assert all(getattr(module, "pos_embed", None) is None for module in dreamlite.modules())


LENGTH_DEPENDENT_SCALINGS = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0 + i / 4 for i in range(8)],
                 "original_max_position_embeddings": 8, "max_position_embeddings": 32},
}


class TestAtLength:
    """``at_length``: dynamic / longrope frequencies fixed for a whole sequence, so a KV cache of rotated keys
    decodes exactly like the full pass across the original length (transformers PR #33129's failure)."""

    @staticmethod
    def _decode(rope, q, k, v):
        """One token per step, keys rotated once at their own position and cached."""
        keys, outputs = [], []
        for t in range(q.shape[-2]):
            keys.append(rope(k[..., t : t + 1, :], offset=t))
            step_q = rope(q[..., t : t + 1, :], offset=t)
            outputs.append(attention(step_q, torch.cat(keys, -2), v[..., : t + 1, :], None, causal=True))
        return torch.cat(outputs, -2)

    @pytest.mark.parametrize("name", list(LENGTH_DEPENDENT_SCALINGS))
    def test_decoding_equals_the_full_pass_across_the_switch(self, name):
        rope = RotaryPositionalEmbedding(16, scaling=LENGTH_DEPENDENT_SCALINGS[name])
        q, k, v = qkv(dh=16)                                                              # N = 16 > 8
        fixed = rope.at_length(N)
        torch.testing.assert_close(self._decode(fixed, q, k, v), attention(q, k, v, fixed, causal=True))
        # per-call frequencies (Hugging Face's behaviour with a cache): cached keys keep the frequencies of their
        # own step, so the steps past the original length match neither the full pass nor each other
        assert (self._decode(rope, q, k, v) - attention(q, k, v, rope, causal=True)).abs().max() > 1e-2

    @pytest.mark.parametrize("name", list(LENGTH_DEPENDENT_SCALINGS))
    def test_fixed_frequencies_are_those_of_a_call_that_long(self, name):
        rope = RotaryPositionalEmbedding(16, scaling=LENGTH_DEPENDENT_SCALINGS[name])
        x = torch.randn(2, 4, 12, 16, dtype=torch.float64)
        assert torch.equal(rope.at_length(12)(x), rope(x))                               # a call of 12 tokens
        short = rope.at_length(30)(x[..., :3, :], offset=4)
        long_call = rope(torch.cat([x[..., :3, :], x.new_zeros(2, 4, 23, 16)], -2), offset=4)   # positions 4..29
        assert torch.equal(short, long_call[..., :3, :])

    def test_other_scalings_and_bad_input(self):
        rope = RotaryPositionalEmbedding(16)
        assert rope.at_length(100) is rope
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: length must be a positive int"):
            RotaryPositionalEmbedding(16, scaling=LENGTH_DEPENDENT_SCALINGS["dynamic"]).at_length(0)
        assert "fixed_length=12" in repr(RotaryPositionalEmbedding(16, scaling=LENGTH_DEPENDENT_SCALINGS["dynamic"])
                                         .at_length(12))


class TestValueRotation:
    """``rotated_channels="trailing"`` and ``rotate_values`` (DeepSeek-V4): the last R channels turn, and in
    attention() the values turn at the key positions and the output back at the query positions."""

    @staticmethod
    def _oracle(q, k, v, rotary_dim, base, positions_q, positions_k, causal):
        """Plain float64 loops: rotate the trailing interleaved pairs of q, k, v; softmax; turn the output back."""
        dh, q64, k64, v64 = q.shape[-1], q.double(), k.double(), v.double()

        def rotate(x, position, sign=1.0):
            x = x.clone()
            for i in range(rotary_dim // 2):
                angle = sign * float(position) * base ** (-2 * i / rotary_dim)
                a, b = x[..., dh - rotary_dim + 2 * i].clone(), x[..., dh - rotary_dim + 2 * i + 1].clone()
                x[..., dh - rotary_dim + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
                x[..., dh - rotary_dim + 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
            return x

        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
        for m, pm in enumerate(positions_q.tolist()):
            qm = rotate(q64[..., m, :], pm)
            keys = [n for n in range(k.shape[-2]) if not causal or n <= m + k.shape[-2] - q.shape[-2]]
            logits = torch.stack([(qm * rotate(k64[..., n, :], positions_k[n])).sum(-1) for n in keys], -1) / dh ** 0.5
            weights = logits.softmax(-1)
            mixed = sum(weights[..., j, None] * rotate(v64[..., n, :], positions_k[n]) for j, n in enumerate(keys))
            out[..., m, :] = rotate(mixed, pm, -1.0)
        return out

    @pytest.mark.parametrize("causal", [False, True])
    def test_attention_equals_the_plain_loop(self, causal):
        rope = RotaryPositionalEmbedding(16, rotary_dim=6, interleaved=True, rotated_channels="trailing",
                                         rotate_values=True, base=100.0)
        q, k, v = (torch.randn(2, 3, 7, 16, dtype=torch.float64) for _ in range(3))
        positions_q, positions_k = torch.tensor([3, 8, 9, 20, 21, 22, 40]), torch.tensor([0, 3, 8, 9, 20, 21, 22])
        got = attention(q, k, v, rope, positions_q=positions_q, positions_k=positions_k, causal=causal)
        want = self._oracle(q, k, v, 6, 100.0, positions_q, positions_k, causal)
        assert (got - want).abs().max().item() < 1e-12

    def test_defaults_decode_and_relative_positions(self):
        rope = RotaryPositionalEmbedding(16, rotary_dim=8, interleaved=True, rotated_channels="trailing",
                                         rotate_values=True)
        q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
        full = attention(q, k, v, rope, causal=True)
        want = self._oracle(q, k, v, 8, 10000.0, torch.arange(9), torch.arange(9), True)
        torch.testing.assert_close(full.double(), want, atol=2e-6, rtol=0)
        # decoding: the last query against every key is the full pass's last row (default positions bottom-right)
        torch.testing.assert_close(attention(q[..., -1:, :], k, v, rope, causal=True), full[..., -1:, :])
        # grouped-query attention: k and v with 2 heads read as repeated
        k2, v2 = k[:, :2], v[:, :2]
        torch.testing.assert_close(attention(q, k2, v2, rope, causal=True),
                                   attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), rope, causal=True))
        # relative in the values too: shifting every position leaves the output; without the way back it does not
        shifted = attention(q, k, v, rope, causal=True, positions_q=torch.arange(9) + 1000,
                            positions_k=torch.arange(9) + 1000)
        torch.testing.assert_close(shifted, full, atol=1e-5, rtol=0)
        rope.decode_output = lambda out, *args: out                                    # an instance attribute
        assert (attention(q, k, v, rope, causal=True) - full).abs().max() > 1e-2

    def test_trailing_channels_are_the_leading_ones_moved(self):
        lead = RotaryPositionalEmbedding(16, rotary_dim=6)
        trail = RotaryPositionalEmbedding(16, rotary_dim=6, rotated_channels="trailing")
        x = torch.randn(2, 3, 5, 16, requires_grad=True)
        move = torch.cat([torch.arange(10, 16), torch.arange(10)])                     # trailing slice first
        got = trail(x)
        torch.testing.assert_close(got[..., move], lead(x[..., move]), atol=0, rtol=0)
        got.square().sum().backward()                                                  # the fast path's backward
        x2 = x.detach()[..., move].requires_grad_()
        lead(x2).square().sum().backward()
        torch.testing.assert_close(x.grad[..., move], x2.grad)
        assert "rotated_channels='trailing'" in repr(trail) and "rotate_values" not in repr(trail)

    def test_values_off_is_the_identity_and_bad_input(self):
        rope = RotaryPositionalEmbedding(16)
        v = torch.randn(1, 2, 5, 16)
        assert rope.encode_v(v, 5) is v and rope.decode_output(v, 5) is v
        with pytest.raises(ValueError, match="rotated_channels must be one of 'leading', 'trailing', got "
                                             "rotated_channels='middle'"):
            RotaryPositionalEmbedding(16, rotated_channels="middle")
        with pytest.raises(TypeError, match="rotate_values must be a bool, got str"):
            RotaryPositionalEmbedding(16, rotate_values="yes")
        values = RotaryPositionalEmbedding(16, rotate_values=True)
        q = torch.randn(1, 2, 5, 16)
        with pytest.raises(ValueError, match=r"RotaryPositionalEmbedding: v \(rotate_values=True turns the values "
                                             r"as the keys\) must have last dim 16, got shape \(1, 2, 5, 8\)"):
            attention(q, q, torch.randn(1, 2, 5, 8), values)

    def test_value_hooks_check_their_inputs_and_take_forward_positions(self):
        """encode_v and decode_output called directly: one check for both (the output's width as v's, the
        other side's length an int, positions of the right length), and ``[B, N]`` positions as ``forward``
        takes them equal ``[B, 1, N]`` (B == H broadcast batch rows against heads, silently)."""
        rope = RotaryPositionalEmbedding(16, rotary_dim=8, interleaved=True, rotated_channels="trailing",
                                         rotate_values=True)
        v = torch.randn(2, 4, 6, 16)
        owner = "RotaryPositionalEmbedding"
        with pytest.raises(ValueError, match=rf"{owner}: out \(rotate_values=True turns the output back by the query "
                                             r"positions\) must have last dim 16, got shape \(2, 4, 6, 12\)"):
            rope.decode_output(torch.randn(2, 4, 6, 12), 6)
        with pytest.raises(ValueError, match=rf"{owner}: positions_k must have shape \[6\] or \[2, 6\], got \(1,\)"):
            rope.encode_v(v, 6, torch.arange(6), torch.arange(1))                     # broadcast, before
        with pytest.raises(ValueError, match=rf"{owner}: positions_q must have shape \[6\] or \[2, 6\], got \(3,\)"):
            rope.decode_output(v, 6, torch.arange(3), torch.arange(6))
        with pytest.raises(TypeError, match=f"{owner}: q_len must be an int, got str '5'"):
            rope.encode_v(v, "5")
        with pytest.raises(TypeError, match=f"{owner}: k_len must be an int, got str '5'"):
            rope.decode_output(v, "5")
        x = torch.randn(4, 4, 6, 16, dtype=torch.float64)                               # B == H
        rows = torch.stack([torch.arange(6) * (b + 1) for b in range(4)])               # [B, N]
        for hook in (rope.encode_v, rope.decode_output):
            got = hook(x, 6, rows, rows)
            torch.testing.assert_close(hook(x, 6, rows[:, None], rows[:, None]), got)
            for b in range(4):
                torch.testing.assert_close(got[b], hook(x[b], 6, rows[b], rows[b]))
        # the oracle: encode_v turns the trailing interleaved pairs of each row by that row's key positions
        oracle = x.clone()
        for b, h, n, i in itertools.product(range(4), range(4), range(6), range(4)):
            angle = float(rows[b, n]) * 10000.0 ** (-2 * i / 8)
            a, c = x[b, h, n, 8 + 2 * i], x[b, h, n, 9 + 2 * i]
            oracle[b, h, n, 8 + 2 * i] = a * math.cos(angle) - c * math.sin(angle)
            oracle[b, h, n, 9 + 2 * i] = c * math.cos(angle) + a * math.sin(angle)
        torch.testing.assert_close(rope.encode_v(x, 6, rows, rows), oracle)

    def test_deepseek_v4_attention_layers(self):
        """Every attention layer of a tiny DeepSeek-V4 (sliding / CSA / HCA): the output our attention() gives from
        the layer's unrotated q and kv (k = v), with from_config's RoPE of the layer's type, equals the layer's
        output after its inverse rotation. The layers' learned sinks (drawn here: zero after init) go to
        attention(sinks=)."""
        transformers = pytest.importorskip("transformers")
        modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
        torch.manual_seed(0)
        config = transformers.DeepseekV4Config(
            vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, q_lora_rank=16, partial_rotary_factor=0.25, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, sliding_window=4,
            o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=3, hc_mult=2,
            hc_sinkhorn_iters=3, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32, "beta_slow": 1})
        model = modeling.DeepseekV4Model(config).eval()
        for layer in model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 2.0)
        rotations, cores, outputs = [], [], {}
        apply, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward

        def apply_spy(x, cos, sin, unsqueeze_dim=1):
            frame = sys._getframe(1)
            layer = frame.f_locals.get("layer_idx", getattr(frame.f_locals.get("self"), "layer_idx", None))
            rotations.append((type(frame.f_locals.get("self")).__name__, layer, x.clone()))
            return apply(x, cos, sin, unsqueeze_dim)

        def eager_spy(module, query, key, value, attention_mask, *args, **kwargs):
            cores.append((module.layer_idx, attention_mask.clone(), key.shape[-2]))
            return eager(module, query, key, value, attention_mask, *args, **kwargs)

        for index, layer in enumerate(model.layers):
            layer.self_attn.o_a_proj.register_forward_pre_hook(
                lambda module, args, index=index: outputs.__setitem__(index, args[0].clone()))
        modeling.apply_rotary_pos_emb, modeling.eager_attention_forward = apply_spy, eager_spy
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(0, 64, (1, 9)), use_cache=False)
        finally:
            modeling.apply_rotary_pos_emb, modeling.eager_attention_forward = apply, eager
        n, heads, dh = 9, config.num_attention_heads, config.head_dim
        positions = torch.arange(n)
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            rope = RotaryPositionalEmbedding.from_config(config, layer_type=attn.rope_layer_type)
            assert (rope.rotated_channels, rope.rotate_values, rope.rotary_dim) == ("trailing", True, 8)
            q, kv = [x for owner, layer_index, x in rotations if owner == "DeepseekV4Attention"
                     and layer_index == index][:2]                                     # [B, H, N, Dh], [B, 1, N, Dh]
            keys = positions
            if attn.compressor is not None:   # compressed entries at window starts, rotated as keys are
                ratio = attn.compressor.compress_rate
                entries = [x for owner, layer_index, x in rotations if owner == type(attn.compressor).__name__
                           and layer_index == index][0]
                kv = torch.cat([kv, entries], -2)
                keys = torch.cat([positions, torch.arange(entries.shape[-2]) * ratio])
            mask = next(mask for layer_index, mask, _ in cores if layer_index == index)
            ours = attention(q, kv, kv, rope, positions_q=positions, positions_k=keys, attn_mask=mask == 0,
                             scale=attn.scaling, sinks=attn.sinks)
            theirs = outputs[index].reshape(1, n, heads, dh).transpose(1, 2)
            family = f"deepseek_v4 {attn.layer_type} attention output"
            MAX_DIFF[family] = (ours - theirs).abs().max().item()
            assert MAX_DIFF[family] < 2e-6, attn.layer_type


class TestRotaryOptionsTogether:
    """The new RoPE options against the rest of the library: wrappers, the scaling setter, weight permutation,
    reprs and from_config's edges."""

    def test_one_axis_maps_are_plain_rope(self):
        x = torch.randn(2, 3, 5, 8)
        plain = RotaryPositionalEmbedding(8, frequencies=[1.0, 0.5, 0.25, 0.125])
        for one_axis in (RotaryPositionalEmbedding(8, pair_axes=[0] * 4, frequencies=plain.frequencies),
                         RotaryPositionalEmbedding(8, sections=[4], axis_spectrum="strided", base=16.0)):
            assert one_axis.num_axes == 1 and one_axis.pair_axes is None
        torch.testing.assert_close(RotaryPositionalEmbedding(8, pair_axes=[0] * 4, frequencies=plain.frequencies)(x),
                                   plain(x), atol=0, rtol=0)
        assert (plain(x) - x).abs().max() > 0.1

    def test_a_refused_scaling_leaves_the_module_as_it_was(self):
        for rope in (RotaryPositionalEmbedding(8, frequencies=[1.0, 0.5, 0.25, 0.125]),
                     RotaryPositionalEmbedding(8, sections=[2, 2], axis_spectrum="strided")):
            x, before = torch.randn(1, 1, 6, 8), repr(rope)
            want = rope(x, torch.arange(12).reshape(6, 2) if rope.num_axes == 2 else None)
            with pytest.raises(ValueError, match="takes no scaling, got rope_type='linear'"):
                rope.scaling = {"rope_type": "linear", "factor": 2.0}
            assert repr(rope) == before and rope.scaling["rope_type"] == "default"
            torch.testing.assert_close(rope(x, torch.arange(12).reshape(6, 2) if rope.num_axes == 2 else None), want)

    def test_wrappers_and_value_rotation(self):
        values = RotaryPositionalEmbedding(16, rotary_dim=8, interleaved=True, rotated_channels="trailing",
                                           rotate_values=True)
        q, k, v = (torch.randn(1, 2, 6, 16) for _ in range(3))
        randomized = RandomizedPositionalEmbedding(values, 64).eval()       # eval: the wrapped encoding exactly
        torch.testing.assert_close(attention(q, k, v, randomized, causal=True), attention(q, k, v, values, causal=True))
        with pytest.raises(ValueError, match="rope must not rotate the values"):
            SelfExtendPositionalEmbedding(values, group_size=2, window=4)
        two_axes = RotaryPositionalEmbedding(16, pair_axes=[0, 1] * 4)
        with pytest.raises(ValueError, match="rope must rotate one position axis, got num_axes=2"):
            SelfExtendPositionalEmbedding(two_axes, group_size=2, window=4)

    @pytest.mark.parametrize("rotated_channels", ["leading", "trailing"])
    def test_weight_permutation_keeps_the_logits(self, rotated_channels):
        torch.manual_seed(0)
        w, x = torch.randn(2 * 16, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
        meta = RotaryPositionalEmbedding(16, rotary_dim=8, interleaved=True, rotated_channels=rotated_channels)
        hf = RotaryPositionalEmbedding(16, rotary_dim=8, rotated_channels=rotated_channels)
        moved = permute_rotary_weight(w, 16, to="half_split", rotary_dim=8, rotated_channels=rotated_channels)
        heads = lambda weight: (x @ weight.T).view(5, 2, 16).transpose(0, 1)      # noqa: E731
        logits = lambda pe, t: pe(t) @ pe(t).transpose(-1, -2)                     # noqa: E731
        torch.testing.assert_close(logits(hf, heads(moved)), logits(meta, heads(w)))
        back = permute_rotary_weight(moved, 16, to="interleaved", rotary_dim=8, rotated_channels=rotated_channels)
        assert torch.equal(back, w)

    @pytest.mark.parametrize("pe, text", [
        (RotaryPositionalEmbedding(8, frequencies=[1.0, 0.5, 0.25, 0.0]),
         "dim=8, base=10000.0, interleaved=False, rotary_dim=8, frequencies=[1.0, 0.5, 0.25, 0.0]"),
        (RotaryPositionalEmbedding(16, pair_axes=[0, 1, 2, 1, 0, 2, 0, 0], rotated_channels="trailing"),
         "dim=16, base=10000.0, interleaved=False, rotary_dim=16, pair_axes=[0, 1, 2, 1, 0, 2, 0, 0], "
         "rotated_channels='trailing'"),
        (RotaryPositionalEmbedding(16, sections=[2, 3, 3], section_layout="alternating", rotate_values=True),
         "dim=16, base=10000.0, interleaved=False, rotary_dim=16, sections=[2, 3, 3], section_layout='alternating', "
         "rotate_values=True"),
        (VideoRotaryPositionalEmbedding(32, temporal_spacing=1.5),
         "dim=32, sections=[4, 6, 6], temporal_spacing=1.5, base=10000.0, interleaved=False"),
        (RotaryPositionalEmbedding(12, sections=[2, 2, 2], axis_spectrum="per_axis", chunk_size=4),
         "dim=12, base=10000.0, interleaved=False, rotary_dim=12, sections=[2, 2, 2], axis_spectrum='per_axis', "
         "chunk_size=4"),
    ], ids=["frequencies", "pair_axes_trailing", "alternating_values", "video", "chunks"])
    def test_reprs_name_every_option_and_rebuild_the_module(self, pe, text):
        """The repr names each option passed (written out here), and evaluating it builds a module that attends
        the same, bitwise."""
        assert repr(pe) == f"{type(pe).__name__}({text})"
        rebuilt = eval(repr(pe))
        axes = pe.num_axes
        positions = torch.randint(0, 9, (N,) + ((axes,) if axes > 1 else ()))
        q, k, v = qkv(dh=pe.dim)
        want = attention(q, k, v, pe, positions_q=positions, positions_k=positions)
        assert torch.equal(attention(q, k, v, rebuilt, positions_q=positions, positions_k=positions), want)

    def test_from_config_edges(self):
        llama = {"model_type": "llama", "head_dim": 16, "hidden_size": 64, "num_attention_heads": 4,
                 "max_position_embeddings": 32, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                   "alpha": 1000.0, "rope_theta": 1e4}}
        assert _rotary_kwargs_from_config(llama)["scaling"]["rope_type"] == "dynamic"   # alpha is HunYuan's only
        hunyuan = {"model_type": "hunyuan_vl", "head_dim": 16, "hidden_size": 64, "num_attention_heads": 4,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2, 2],
                                       "xdrope_section": [4, 2, 1, 1]}}
        with pytest.raises(ValueError, match=r"mrope_section=\[2, 2, 2, 2\] and xdrope_section=\[4, 2, 1, 1\] "
                                             r"disagree"):
            RotaryPositionalEmbedding.from_config(hunyuan)
        with pytest.raises(TypeError, match="frequencies must be a list or a 1-D float tensor without grad"):
            RotaryPositionalEmbedding(8, frequencies=torch.ones(4, requires_grad=True))
        with pytest.raises(ValueError, match="pair_axes must use every axis 0 .. 2 .*got no pair on axes \\[1\\]"):
            RotaryPositionalEmbedding(8, pair_axes=[0, 2, 2, 0])
        pixtral = {"model_type": "pixtral", "head_dim": 16, "hidden_size": 64, "num_attention_heads": 4,
                   "rope_parameters": {"rope_type": "axial", "rope_theta": 1e4}}
        assert _rotary_kwargs_from_config(pixtral)["axis_spectrum"] == "strided"
        with pytest.raises(ValueError, match="model_type='pixtral' has one layout.*section_layout='interleaved'"):
            RotaryPositionalEmbedding.from_config(pixtral, section_layout="interleaved")
        with pytest.raises(ValueError, match="pass sections .*or pair_axes"):
            RotaryPositionalEmbedding(8, pair_axes=[0, 1, 0, 1], scaling={"rope_type": "default", "mrope_section": [2, 2]})


class TestPairAxes:
    """Explicit pair maps (``pair_axes=``, ``frequencies=``) and the multi-axis layouts written with them:
    contiguous / Qwen3-VL interleaved / ERNIE-4.5-VL alternating sections, the strided (Pixtral) and per-axis
    (EVA-02) spectra; parity with the transformers modules of ERNIE-4.5-VL, GLM-4V, Pixtral, HunYuan-VL and
    HunYuan dense / MoE (NTK alpha), and with timm's EVA-02 RoPE."""

    # ------------------------------------------------------------------------------------------------ oracle
    @staticmethod
    def oracle(x, positions, axis_of_pair, inv_freq, *, interleaved=False, chunk=None):
        """Float64 plain-loop RoPE: pair ``f`` (channels ``(f, f + F)`` half-split, ``(2f, 2f + 1)``
        interleaved, or ``(cC + j, cC + C/2 + j)`` for ``c, j = divmod(f, C/2)`` with ``chunk=C``;
        ``F = len(axis_of_pair)``, the leading ``2F`` channels) turns by
        ``positions[..., n, axis_of_pair[f]] * inv_freq[f]``; ``(a, b) -> (a cos - b sin, b cos + a sin)``.

        x ``[..., N, Dh]``; positions ``[N, A]`` (every row of x) or ``[B, N, A]`` (B = x's first dim)."""
        src = x.detach().double()
        out = src.clone()
        pos = positions.detach().double()
        pairs = len(axis_of_pair)
        assert len(inv_freq) == pairs and 2 * pairs <= x.shape[-1]
        groups = list(range(pos.shape[0])) if pos.dim() == 3 else [None]
        for g in groups:
            p = pos if g is None else pos[g]
            xs = src if g is None else src[g]
            xo = out if g is None else out[g]              # a view: writes land in out
            for n in range(p.shape[0]):
                for f in range(pairs):
                    i, j = (2 * f, 2 * f + 1) if interleaved else (f, f + pairs)
                    if chunk is not None:
                        c, r = divmod(f, chunk // 2)
                        i, j = c * chunk + r, c * chunk + chunk // 2 + r
                    angle = float(p[n, axis_of_pair[f]]) * float(inv_freq[f])
                    c, s = math.cos(angle), math.sin(angle)
                    a, b = xs[..., n, i], xs[..., n, j]
                    xo[..., n, i] = a * c - b * s
                    xo[..., n, j] = b * c + a * s
        return out

    @staticmethod
    def plain(rotary_dim, base=10000.0):
        """The shared spectrum ``base ** (-2f / R)``, f = 0 .. R/2 - 1."""
        return [base ** (-2.0 * f / rotary_dim) for f in range(rotary_dim // 2)]

    @staticmethod
    def diff(a, b, family: Optional[str] = None):
        """max |a - b|; recorded in MAX_DIFF under ``family`` (a comparison with a model's module)."""
        value = (a.double() - b.double()).abs().max().item()
        if family is not None:
            MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), value)
        return value

    # -------------------------------------------------------------------------------- explicit pair maps
    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("batched", [False, True])
    def test_pair_axes_and_frequencies_match_oracle(self, interleaved, batched):
        torch.manual_seed(0)
        axes = [2, 0, 1, 1, 0, 2, 0, 1]                                # A = 3, any order
        freqs = [1.0, 0.5, 0.0, 0.3, 2.0, 0.01, 0.7, 0.125]           # zero is allowed: the pair stays
        rope = RotaryPositionalEmbedding(16, interleaved=interleaved, pair_axes=axes, frequencies=freqs)
        x = torch.randn(2, 3, 5, 16)
        positions = torch.randint(-20, 40, (2, 5, 3) if batched else (5, 3))
        want = self.oracle(x, positions, axes, freqs, interleaved=interleaved)
        assert self.diff(rope(x, positions), want) < 2e-6
        floats = positions.double() + torch.rand(positions.shape, dtype=torch.float64)
        assert self.diff(rope(x, floats), self.oracle(x, floats, axes, freqs, interleaved=interleaved)) < 2e-6
        # the map matters: the same frequencies with the axes in contiguous order give another rotation
        assert self.diff(rope(x, positions), self.oracle(x, positions, sorted(axes), freqs,
                                                         interleaved=interleaved)) > 0.1

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_pair_axes_partial_rotary_keeps_trailing_channels(self, interleaved):
        torch.manual_seed(1)
        axes = [1, 0, 1, 0, 0, 1]                                      # R = 12 of Dh = 16
        rope = RotaryPositionalEmbedding(16, rotary_dim=12, interleaved=interleaved, pair_axes=axes)
        x = torch.randn(1, 2, 6, 16, dtype=torch.float64)
        positions = torch.randint(0, 60, (6, 2))
        got = rope(x, positions)
        want = self.oracle(x, positions, axes, self.plain(12), interleaved=interleaved)   # default frequencies /R
        assert self.diff(got, want) < 1e-9
        assert torch.equal(got[..., 12:], x[..., 12:])

    def test_frequencies_alone_one_axis(self):
        torch.manual_seed(2)
        freqs = [3.0, 1.0, 0.25, 0.0]
        rope = RotaryPositionalEmbedding(8, frequencies=freqs)
        x = torch.randn(2, 1, 7, 8)
        positions = torch.tensor([0, 1, 2, 5, 11, 30, 63])
        want = self.oracle(x, positions[:, None], [0] * 4, freqs)
        assert self.diff(rope(x, positions), want) < 2e-6

    def test_frequencies_with_contiguous_sections(self):
        torch.manual_seed(3)
        freqs = [0.9, 0.4, 0.2, 0.05, 1.5, 0.6, 0.3, 0.001]
        rope = RotaryPositionalEmbedding(16, sections=[3, 5], frequencies=freqs)
        x = torch.randn(1, 2, 5, 16)
        positions = torch.randint(0, 50, (5, 2))
        want = self.oracle(x, positions, [0, 0, 0, 1, 1, 1, 1, 1], freqs)
        assert self.diff(rope(x, positions), want) < 2e-6

    # --------------------------------------------------------------------- half-split pairs inside chunks
    @pytest.mark.parametrize("kwargs, axes, freqs", [
        # Allegro: a chunk per axis, each its own spectrum over its chunk
        (dict(sections=[2, 2, 2], axis_spectrum="per_axis", chunk_size=4), [0, 0, 1, 1, 2, 2],
         [1.0, 0.01] * 3),
        # LTX-2's split RoPE: one chunk per head slice of any pair map (zero frequencies: its padding pairs)
        (dict(pair_axes=[0, 0, 1, 2, 0, 1], frequencies=[0.0, 0.0, 0.5, 2.0, 1.25, 0.03], chunk_size=6),
         [0, 0, 1, 2, 0, 1], [0.0, 0.0, 0.5, 2.0, 1.25, 0.03]),
    ])
    def test_chunks_match_oracle(self, kwargs, axes, freqs):
        torch.manual_seed(8)
        rope = RotaryPositionalEmbedding(12, **kwargs)
        x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
        positions = torch.rand(2, 5, 3, dtype=torch.float64) * 20 - 5
        want = self.oracle(x, positions, axes, freqs, chunk=kwargs["chunk_size"])
        assert self.diff(rope(x, positions), want) < 1e-12
        # the other paths: [B, N, H, Dh], q and k together, keys moved to new positions
        assert self.diff(rope(x.transpose(1, 2), positions, seq_dim=-3).transpose(1, 2), want) < 1e-12
        q, k = rope.encode_qk(x, x.flip(-2), positions, positions)
        assert self.diff(q, want) < 1e-12
        assert self.diff(k, self.oracle(x.flip(-2), positions, axes, freqs, chunk=kwargs["chunk_size"])) < 1e-12
        assert self.diff(rope.rerotate(rope(x, positions), positions, positions + 3), rope(x, positions + 3)) < 1e-12
        # one chunk is the plain half-split layout
        whole = RotaryPositionalEmbedding(12, **{**kwargs, "chunk_size": 12})
        assert torch.equal(whole(x, positions), RotaryPositionalEmbedding(12, **{
            key: value for key, value in kwargs.items() if key != "chunk_size"})(x, positions))

    @pytest.mark.parametrize("kwargs", [dict(chunk_size=4, interleaved=True), dict(chunk_size=5),
                                        dict(chunk_size=8), dict(chunk_size=4, rotary_dim=8)])
    def test_chunks_need_a_half_split_full_rotation(self, kwargs):
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: chunk_size \\(half-split pairs inside each "
                                             "chunk\\) needs interleaved=False, an even chunk_size dividing dim"):
            RotaryPositionalEmbedding(12, **kwargs)

    # -------------------------------------------------------------------------- presets, written out by hand
    @pytest.mark.parametrize("dim, sections, layout, interleaved, axes", [
        # contiguous: axis a takes a block of sections[a] pairs, in order
        (16, [2, 3, 3], "contiguous", False, [0, 0, 1, 1, 1, 2, 2, 2]),
        # Qwen3-VL: t h w t h w ... while an axis has pairs left, the rest t
        (16, [4, 2, 2], "interleaved", False, [0, 1, 2, 0, 1, 2, 0, 0]),
        (16, [3, 3, 2], "interleaved", True, [0, 1, 2, 0, 1, 2, 0, 1]),
        # ERNIE-4.5-VL / VideoRoPE: sections (t, h, w); h (even) and w (odd) alternate over the first s_h + s_w
        # pairs, t takes the rest
        (16, [2, 3, 3], "alternating", True, [1, 2, 1, 2, 1, 2, 0, 0]),
        (16, [4, 2, 2], "alternating", False, [1, 2, 1, 2, 0, 0, 0, 0]),
        (24, [6, 3, 3], "alternating", True, [1, 2, 1, 2, 1, 2, 0, 0, 0, 0, 0, 0]),
    ])
    def test_section_layouts_match_hand_written_pair_axes(self, dim, sections, layout, interleaved, axes):
        torch.manual_seed(4)
        rope = RotaryPositionalEmbedding(dim, sections=sections, section_layout=layout, interleaved=interleaved)
        x = torch.randn(2, 2, 6, dim)
        positions = torch.randint(0, 64, (2, 6, 3))
        want = self.oracle(x, positions, axes, self.plain(dim), interleaved=interleaved)
        assert self.diff(rope(x, positions), want) < 2e-6
        same = RotaryPositionalEmbedding(dim, pair_axes=axes, interleaved=interleaved)
        assert self.diff(same(x, positions), want) < 2e-6

    @pytest.mark.parametrize("layout", ["contiguous", "interleaved", "alternating"])
    def test_sections_are_pair_counts_per_axis(self, layout):
        # whatever the layout, axis a drives exactly sections[a] pairs: count them through the rotation (pair f
        # of a one-hot position on axis a turns iff f belongs to axis a)
        sections = {"contiguous": [2, 3, 3], "interleaved": [4, 2, 2], "alternating": [1, 4, 3]}[layout]
        rope = RotaryPositionalEmbedding(16, sections=sections, section_layout=layout)
        x = torch.zeros(1, 16, dtype=torch.float64)
        x[0, :8] = 1.0                                                    # a = 1, b = 0 in every pair
        for axis, size in enumerate(sections):
            position = torch.zeros(1, 3, dtype=torch.float64)
            position[0, axis] = 1.0
            turned = (rope(x, position)[0, 8:].abs() > 1e-12).sum().item()   # b = sin(angle) != 0
            assert turned == size, (layout, axis, turned, size)

    @pytest.mark.parametrize("sections", [[2, 5, 1], [2, 1, 5], [2, 2, 4]])
    def test_alternating_sections_it_cannot_honour_raise(self, sections):
        # h takes the even and w the odd pairs of the first s_h + s_w: ceil and floor of their sum, so only
        # s_h == s_w or s_h == s_w + 1 (VideoRoPE's odd split) are pair counts the layout can give
        with pytest.raises(ValueError, match="sections") as info:
            RotaryPositionalEmbedding(16, sections=sections, section_layout="alternating")
        assert "RotaryPositionalEmbedding" in str(info.value)

    @pytest.mark.parametrize("dim, rotary_dim, sections, index", [
        # axis a's j-th pair takes the shared frequency of index a + j * A
        (16, None, [4, 4], [0, 2, 4, 6, 1, 3, 5, 7]),                 # Pixtral, F even
        (10, None, [3, 2], [0, 2, 4, 1, 3]),                          # F odd: [ceil(F/2), floor(F/2)]
        (20, None, [4, 3, 3], [0, 3, 6, 9, 1, 4, 7, 2, 5, 8]),        # three axes
        (16, 12, [3, 3], [0, 2, 4, 1, 3, 5]),                         # partial rotary: frequencies over R
    ])
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_strided_spectrum_matches_hand_written_frequencies(self, dim, rotary_dim, sections, index, interleaved):
        torch.manual_seed(5)
        rope = RotaryPositionalEmbedding(dim, rotary_dim=rotary_dim, sections=sections, axis_spectrum="strided",
                                         interleaved=interleaved, base=100.0)
        r = rotary_dim or dim
        shared = self.plain(r, 100.0)
        freqs = [shared[i] for i in index]
        axes = [a for a, s in enumerate(sections) for _ in range(s)]
        x = torch.randn(1, 2, 5, dim)
        positions = torch.randint(0, 40, (5, len(sections)))
        want = self.oracle(x, positions, axes, freqs, interleaved=interleaved)
        assert self.diff(rope(x, positions), want) < 2e-6
        assert torch.equal(rope(x, positions)[..., r:], x[..., r:])
        explicit = RotaryPositionalEmbedding(dim, rotary_dim=rotary_dim, pair_axes=axes, frequencies=freqs,
                                             interleaved=interleaved)
        assert self.diff(explicit(x, positions), want) < 2e-6
        # the shared spectrum (each axis a slice) is another rotation
        assert self.diff(rope(x, positions), self.oracle(x, positions, axes, shared, interleaved=interleaved)) > 0.1

    def test_per_axis_spectrum_matches_hand_written_frequencies(self):
        torch.manual_seed(6)
        rope = RotaryPositionalEmbedding(16, sections=[3, 5], axis_spectrum="per_axis", interleaved=True)
        freqs = [10000.0 ** (-2.0 * i / 6) for i in range(3)] + [10000.0 ** (-2.0 * i / 10) for i in range(5)]
        x = torch.randn(2, 1, 5, 16)
        positions = torch.rand(2, 5, 2, dtype=torch.float64) * 30
        want = self.oracle(x, positions, [0, 0, 0, 1, 1, 1, 1, 1], freqs, interleaved=True)
        assert self.diff(rope(x, positions), want) < 2e-6

    # ----------------------------------------------------------------------------- attention, translation
    TRANSLATION_CASES = [   # (kwargs, pair axes, frequencies or None for base ** (-2f / 16)), all Dh = 16
        (dict(pair_axes=[2, 0, 1, 1, 0, 2, 0, 1], frequencies=[1.0, 0.5, 0.0, 0.3, 2.0, 0.01, 0.7, 0.125]),
         [2, 0, 1, 1, 0, 2, 0, 1], [1.0, 0.5, 0.0, 0.3, 2.0, 0.01, 0.7, 0.125]),
        (dict(sections=[2, 3, 3], section_layout="alternating", interleaved=True), [1, 2, 1, 2, 1, 2, 0, 0], None),
        (dict(sections=[4, 4], axis_spectrum="strided"), [0, 0, 0, 0, 1, 1, 1, 1],
         [10000.0 ** (-2.0 * i / 16) for i in (0, 2, 4, 6, 1, 3, 5, 7)]),
        (dict(sections=[4, 2, 2], section_layout="interleaved"), [0, 1, 2, 0, 1, 2, 0, 0], None),
    ]

    @pytest.mark.parametrize("kwargs, axes, freqs", TRANSLATION_CASES)
    def test_attention_translation_invariant_per_axis(self, kwargs, axes, freqs):
        torch.manual_seed(7)
        rope = RotaryPositionalEmbedding(16, **kwargs)
        freqs = self.plain(16) if freqs is None else freqs
        interleaved = kwargs.get("interleaved", False)
        count = max(axes) + 1
        q = torch.randn(2, 2, 5, 16, dtype=torch.float64)
        k = torch.randn(2, 2, 7, 16, dtype=torch.float64)
        v = torch.randn(2, 2, 7, 16, dtype=torch.float64)
        pq = torch.randint(0, 30, (2, 5, count))
        pk = torch.randint(0, 30, (2, 7, count))
        base = attention(q, k, v, rope, positions_q=pq, positions_k=pk)
        shift = torch.tensor([5.0, -3.0, 11.5][:count], dtype=torch.float64)
        shifted = attention(q, k, v, rope, positions_q=pq + shift, positions_k=pk + shift)
        assert self.diff(shifted, base) < 1e-9
        # the output is the softmax over the oracle's logits (q and k each rotated at their own positions)
        rq = self.oracle(q, pq, axes, freqs, interleaved=interleaved)
        rk = self.oracle(k, pk, axes, freqs, interleaved=interleaved)
        want = torch.softmax(rq @ rk.transpose(-1, -2) / math.sqrt(16), -1) @ v
        assert self.diff(base, want) < 1e-9
        # shifting one axis of the queries only does change it
        lone = torch.zeros(count, dtype=torch.float64)
        lone[count - 1] = 3.0
        assert self.diff(attention(q, k, v, rope, positions_q=pq + lone, positions_k=pk), base) > 1e-3

    # ----------------------------------------------------------------------------------- bad arguments
    @pytest.mark.parametrize("kwargs, error, name", [
        (dict(pair_axes=[0, 1, 0]), ValueError, "pair_axes"),                              # R/2 = 8 wanted
        (dict(pair_axes=[0, 1, 0, 1, 0, 1, 0, 1, 0]), ValueError, "pair_axes"),
        (dict(pair_axes=[0, 1, -1, 1, 0, 1, 0, 1]), ValueError, "pair_axes"),
        (dict(pair_axes=[0, 1, 1.5, 1, 0, 1, 0, 1]), TypeError, "pair_axes"),
        (dict(pair_axes=[0, 1, "1", 1, 0, 1, 0, 1]), TypeError, "pair_axes"),
        (dict(pair_axes=[0, 1, True, 1, 0, 1, 0, 1]), TypeError, "pair_axes"),
        (dict(pair_axes="01010101"), TypeError, "pair_axes"),
        (dict(frequencies=[1.0, 0.5, 0.25]), ValueError, "frequencies"),
        (dict(frequencies=[1.0] * 9), ValueError, "frequencies"),
        (dict(frequencies=[1.0, 0.5, -0.25, 0.1, 0.1, 0.1, 0.1, 0.1]), ValueError, "frequencies"),
        (dict(frequencies=[1.0, 0.5, math.nan, 0.1, 0.1, 0.1, 0.1, 0.1]), ValueError, "frequencies"),
        (dict(frequencies=[1.0, 0.5, math.inf, 0.1, 0.1, 0.1, 0.1, 0.1]), ValueError, "frequencies"),
        (dict(frequencies=[1.0, 0.5, "x", 0.1, 0.1, 0.1, 0.1, 0.1]), TypeError, "frequencies"),
        (dict(frequencies=[0.1] * 8, scaling={"rope_type": "linear", "factor": 2.0}), ValueError, "frequencies"),
        (dict(frequencies=[0.1] * 8, sections=[4, 4], axis_spectrum="per_axis"), ValueError, "frequencies"),
        (dict(frequencies=[0.1] * 8, sections=[4, 4], axis_spectrum="strided"), ValueError, "frequencies"),
        (dict(sections=[3, 5], axis_spectrum="strided"), ValueError, "sections|axis_spectrum"),
        (dict(sections=[2, 3, 3], axis_spectrum="strided"), ValueError, "sections|axis_spectrum"),
        (dict(axis_spectrum="strided"), ValueError, "sections|axis_spectrum"),
        (dict(sections=[4, 2, 2], section_layout="interleaved", axis_spectrum="strided"), ValueError,
         "section_layout|axis_spectrum"),
        (dict(sections=[4, 4], section_layout="alternating"), ValueError, "section_layout|sections"),
    ])
    def test_bad_arguments_raise(self, kwargs, error, name):
        with pytest.raises(error, match=name) as info:
            RotaryPositionalEmbedding(16, **kwargs)
        assert "RotaryPositionalEmbedding" in str(info.value)

    def test_sections_and_pair_axes_together_raise(self):
        with pytest.raises(ValueError, match="pair_axes") as info:
            RotaryPositionalEmbedding(16, sections=[4, 4], pair_axes=[0, 0, 0, 0, 1, 1, 1, 1])
        assert "sections" in str(info.value) and "RotaryPositionalEmbedding" in str(info.value)

    def test_pair_axes_positions_need_every_axis(self):
        rope = RotaryPositionalEmbedding(16, pair_axes=[0, 2, 1, 0, 2, 1, 0, 0])          # A = 3
        x = torch.randn(1, 1, 4, 16)
        with pytest.raises(ValueError, match="positions"):
            rope(x, torch.zeros(4, 2, dtype=torch.long))
        assert rope(x, torch.zeros(4, 3, dtype=torch.long)).shape == x.shape

    # --------------------------------------------------------------------------------- transformers parity
    @staticmethod
    def _transformers():
        return pytest.importorskip("transformers")

    @staticmethod
    def _tiny_vl(config_class, dim: int, rope_parameters: dict, seed: int, heads: int = 2) -> tuple:
        """A VLM config with one ``heads``-head text layer of width ``dim``, q and k ``[2, heads, 9, dim]`` and
        random ``(t, h, w)`` ids ``[3, 2, 9]`` as the model takes them."""
        torch.manual_seed(seed)
        config = config_class(text_config=dict(hidden_size=dim * heads, num_attention_heads=heads,
                                               num_key_value_heads=heads, num_hidden_layers=1,
                                               rope_parameters=rope_parameters))
        return config, torch.randn(2, heads, 9, dim), torch.randn(2, heads, 9, dim), torch.randint(0, 64, (3, 2, 9))

    @pytest.mark.parametrize("dim, mrope_section", [(32, [6, 6, 4]), (64, [11, 11, 10])])
    def test_ernie4_5_vl_matches_transformers(self, dim, mrope_section):
        self._transformers()
        from transformers import Ernie4_5_VLMoeConfig
        from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as hf
        config, q, k, ids = self._tiny_vl(Ernie4_5_VLMoeConfig, dim, {
            "rope_type": "default", "rope_theta": 500000.0, "mrope_section": mrope_section}, seed=8)
        cos, sin = hf.Ernie4_5_VLMoeTextRotaryEmbedding(config.text_config)(q, ids)
        hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        positions = ids.permute(1, 2, 0)                                        # [B, N, (t, h, w)]
        s_h, s_w, s_t = mrope_section
        kwargs = pe_lib._rotary_kwargs_from_config(config)
        assert kwargs["sections"] == [s_t, s_h, s_w] and kwargs["section_layout"] == "alternating"
        assert kwargs["interleaved"] is True
        for source in (config, config.text_config):
            rope = RotaryPositionalEmbedding.from_config(source)
            assert self.diff(rope(q, positions), hf_q, "ernie4_5_vl_moe") < 2e-5
            assert self.diff(rope(k, positions), hf_k, "ernie4_5_vl_moe") < 2e-5
        # the hand-written ERNIE map (h, w alternating, then t; interleaved pairs) is what both compute
        axes = [(1 if f % 2 == 0 else 2) if f < s_h + s_w else 0 for f in range(dim // 2)]
        assert self.diff(hf_q, self.oracle(q, positions, axes, self.plain(dim, 500000.0), interleaved=True)) < 2e-5

    @pytest.mark.parametrize("dim, mrope_section", [(32, [2, 3, 3]), (64, [4, 6, 6])])
    def test_glm4v_matches_transformers(self, dim, mrope_section):
        self._transformers()
        from transformers import Glm4vConfig
        from transformers.models.glm4v import modeling_glm4v as hf
        config, q, k, ids = self._tiny_vl(Glm4vConfig, dim, {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section,
            "partial_rotary_factor": 0.5}, seed=9)
        cos, sin = hf.Glm4vTextRotaryEmbedding(config.text_config)(q, ids)
        hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        positions = ids.permute(1, 2, 0)
        rope = RotaryPositionalEmbedding.from_config(config)
        assert self.diff(rope(q, positions), hf_q, "glm4v") < 2e-5
        assert self.diff(rope(k, positions), hf_k, "glm4v") < 2e-5
        assert torch.equal(rope(q, positions)[..., dim // 2:], q[..., dim // 2:])

    @pytest.mark.parametrize("dim, theta, grids", [(16, 10000.0, [(5, 7), (3, 4)]), (10, 100.0, [(4, 5), (2, 2)]),
                                                   (64, 10000.0, [(6, 9)])])
    def test_pixtral_matches_transformers(self, dim, theta, grids):
        self._transformers()
        from transformers import PixtralVisionConfig
        from transformers.models.pixtral import modeling_pixtral as hf
        torch.manual_seed(10)
        heads, patch = 2, 2
        config = PixtralVisionConfig(hidden_size=dim * heads, num_attention_heads=heads, intermediate_size=8,
                                     num_hidden_layers=1, patch_size=patch, image_size=16, num_channels=1,
                                     rope_parameters={"rope_type": "axial", "rope_theta": theta})
        model = hf.PixtralVisionModel(config).eval()
        captured = {}
        model.patch_positional_embedding.register_forward_hook(
            lambda module, args, out: captured.update(positions=args[1].clone(), cos=out[0], sin=out[1]))
        pixels = torch.randn(len(grids), 1, max(h for h, _ in grids) * patch, max(w for _, w in grids) * patch)
        with torch.no_grad():
            model(pixel_values=pixels, image_sizes=torch.tensor([[h * patch, w * patch] for h, w in grids]))
        positions = captured["positions"]                                       # [N, (row, col)], per image
        n = sum(h * w for h, w in grids)
        assert positions.shape == (n, 2)
        q, k = torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)
        hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, captured["cos"], captured["sin"], unsqueeze_dim=0)
        pairs = dim // 2
        kwargs = pe_lib._rotary_kwargs_from_config(config)
        assert kwargs["sections"] == [(pairs + 1) // 2, pairs // 2] and kwargs["axis_spectrum"] == "strided"
        assert not kwargs.get("interleaved", False)
        rope = RotaryPositionalEmbedding.from_config(config)
        assert self.diff(rope(q, positions), hf_q, "pixtral") < 2e-5
        assert self.diff(rope(k, positions), hf_k, "pixtral") < 2e-5

    @staticmethod
    def _hunyuan_vl_config(dim, heads, section, alpha, legacy):
        from transformers import HunYuanVLConfig
        if legacy:   # the public checkpoints' config.json form
            rope = dict(rope_theta=10000.0, rope_scaling={"type": "xdrope", "alpha": alpha, "factor": 1.0,
                                                          "xdrope_section": list(section)})
        else:
            params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)}
            if alpha is not None:
                params.update(rope_type="dynamic", alpha=alpha, factor=1.0)
            rope = dict(rope_parameters=params)
        return HunYuanVLConfig(text_config=dict(hidden_size=dim * heads, num_attention_heads=heads,
                                                num_key_value_heads=heads, head_dim=dim, num_hidden_layers=1, **rope))

    @staticmethod
    def _tencent_xdrope(x, ids, section, inv_freq):
        """Tencent's apply_rotary_pos_emb_xdrope, in float64: cos = cat(freqs, freqs) split by the LIST
        ``xdrope_section * 2``, chunk i taking axis i % A; x * cos + rotate_half(x) * sin. ids [A, B, N]."""
        axes = len(section)
        freqs = ids[..., None].double() * torch.tensor(inv_freq, dtype=torch.float64)    # [A, B, N, F]
        emb = torch.cat([freqs, freqs], -1)

        def pick(table):
            chunks = table.split(list(section) * 2, -1)
            return torch.cat([chunk[i % axes] for i, chunk in enumerate(chunks)], -1)[:, None]   # [B, 1, N, D]

        xd = x.double()
        half = xd.shape[-1] // 2
        rotated = torch.cat([-xd[..., half:], xd[..., :half]], -1)
        return xd * pick(emb.cos()) + rotated * pick(emb.sin())

    @pytest.mark.parametrize("dim, section, alpha, legacy", [
        (32, [4, 4, 4, 4], 1000.0, True),        # HunyuanOCR-like (legacy xdrope_section + alpha)
        (32, [6, 4, 3, 3], 1000.0, False),
        (64, [8, 8, 8, 8], 1000.0, False),
        (32, [6, 5, 5], None, False),            # no alpha: plain rope_theta
    ])
    def test_hunyuan_vl_matches_tencent_xdrope(self, dim, section, alpha, legacy):
        self._transformers()
        from transformers.models.hunyuan_vl import modeling_hunyuan_vl as hf
        torch.manual_seed(11)
        heads, axes = 2, len(section)
        config = self._hunyuan_vl_config(dim, heads, section, alpha, legacy)
        base = 10000.0 * (alpha ** (dim / (dim - 2)) if alpha is not None else 1.0)
        inv_freq = self.plain(dim, base)
        q, k = torch.randn(2, heads, 9, dim), torch.randn(2, heads, 9, dim)
        module = hf.HunYuanVLRotaryEmbedding(config.text_config)
        kwargs = pe_lib._rotary_kwargs_from_config(config)
        assert kwargs["sections"] == section and kwargs.get("section_layout", "contiguous") == "contiguous"
        assert not kwargs.get("interleaved", False) and kwargs["base"] == pytest.approx(base, rel=1e-12)
        for source in (config, config.text_config):
            rope = RotaryPositionalEmbedding.from_config(source)
            # text-only positions (every axis the same): transformers, Tencent and the library agree
            text = torch.randint(0, 64, (1, 2, 9)).expand(axes, 2, 9)
            hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, *module(q, text))
            ours_q, ours_k = rope(q, text.permute(1, 2, 0)), rope(k, text.permute(1, 2, 0))
            family = "hunyuan_vl (transformers, text positions)"
            assert max(self.diff(ours_q, hf_q, family), self.diff(ours_k, hf_k, family)) < 2e-5
            # multi-axis positions: the library is Tencent's XD-RoPE (each pair one axis, contiguous sections)
            ids = torch.randint(0, 64, (axes, 2, 9))
            ours_q, ours_k = rope(q, ids.permute(1, 2, 0)), rope(k, ids.permute(1, 2, 0))
            tencent_q, tencent_k = (self._tencent_xdrope(t, ids, section, inv_freq) for t in (q, k))
            family = "hunyuan_vl (Tencent's XD-RoPE, image positions)"
            assert max(self.diff(ours_q, tencent_q, family), self.diff(ours_k, tencent_k, family)) < 1e-5
            contiguous = [a for a, s in enumerate(section) for _ in range(s)]
            assert self.diff(tencent_q, self.oracle(q, ids.permute(1, 2, 0), contiguous, inv_freq)) < 1e-9
            # transformers 5.24 doubles each section in channel space (axis of channel c: the i with
            # 2 S_i <= c < 2 S_{i+1}), so the two halves of a pair take different axes: not a rotation, and far
            # from both on multi-axis positions
            hf_q, _ = hf.apply_rotary_pos_emb(q, k, *module(q, ids))
            assert self.diff(hf_q, tencent_q) > 1 and self.diff(hf_q, ours_q) > 1
            assert (hf_q.norm(dim=-1) - q.norm(dim=-1)).abs().max() > 0.1          # a rotation keeps norms
        if legacy:   # the checkpoint's raw config.json (rope_scaling type "xdrope") reads the same
            raw = {"model_type": "hunyuan_vl", "hidden_size": dim * heads, "num_attention_heads": heads,
                   "head_dim": dim, "rope_theta": 10000.0,
                   "rope_scaling": {"type": "xdrope", "alpha": alpha, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                                    "mscale": 1.0, "mscale_all_dim": 1.0, "xdrope_section": list(section)}}
            ids = torch.randint(0, 64, (axes, 2, 9))
            tencent_q = self._tencent_xdrope(q, ids, section, inv_freq)
            assert self.diff(RotaryPositionalEmbedding.from_config(raw)(q, ids.permute(1, 2, 0)), tencent_q) < 1e-5

    @pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "hunyuan_v1_moe"])
    def test_hunyuan_ntk_alpha_matches_transformers(self, model_type):
        self._transformers()
        torch.manual_seed(12)
        if model_type == "hunyuan_v1_dense":
            from transformers import HunYuanDenseV1Config as Config
            from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hf
            rotary = hf.HunYuanDenseV1RotaryEmbedding
        else:
            from transformers import HunYuanMoEV1Config as Config
            from transformers.models.hunyuan_v1_moe import modeling_hunyuan_v1_moe as hf
            rotary = hf.HunYuanMoEV1RotaryEmbedding
        dim, heads, alpha = 32, 2, 1000.0
        config = Config(hidden_size=dim * heads, num_attention_heads=heads, num_key_value_heads=heads, head_dim=dim,
                        num_hidden_layers=1, max_position_embeddings=16,
                        rope_parameters={"rope_type": "dynamic", "alpha": alpha, "factor": 1.0,
                                         "rope_theta": 10000.0})
        module = rotary(config)
        assert module.rope_type == "ntk_alpha"
        q, k = torch.randn(2, heads, 9, dim), torch.randn(2, heads, 9, dim)
        ids = torch.randint(0, 64, (2, 9))                 # past max_position_embeddings: the base stays static
        hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, *module(q, ids))
        rope = RotaryPositionalEmbedding.from_config(config)
        family = f"{model_type} (NTK alpha)"
        assert max(self.diff(rope(q, ids), hf_q, family), self.diff(rope(k, ids), hf_k, family)) < 2e-5
        # the checkpoints' raw config.json: rope_scaling {"type": "dynamic", "alpha": ...} beside rope_theta
        raw = {"model_type": model_type, "hidden_size": dim * heads, "num_attention_heads": heads, "head_dim": dim,
               "max_position_embeddings": 16, "rope_theta": 10000.0,
               "rope_scaling": {"type": "dynamic", "alpha": alpha, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0}}
        assert self.diff(RotaryPositionalEmbedding.from_config(raw)(q, ids), hf_q) < 2e-5
        base = 10000.0 * alpha ** (dim / (dim - 2))
        assert self.diff(hf_q, self.oracle(q, ids[..., None], [0] * (dim // 2), self.plain(dim, base))) < 2e-5
        # short positions too take the alpha base (dynamic NTK would keep rope_theta below max_position_embeddings)
        short = torch.arange(4)[None]
        assert self.diff(rope(q[:1, :, :4], short),
                         self.oracle(q[:1, :, :4], short[..., None], [0] * (dim // 2), self.plain(dim, base))) < 2e-6

    # ------------------------------------------------------------------------------------------ timm EVA-02
    @staticmethod
    def _eva02_reference(x, height, width, ref, temperature):
        """timm's RotaryEmbeddingCat(in_pixels=False, ref_feat_shape=ref) + apply_rot_embed_cat(half=False),
        re-enacted from its formulas in float64: bands = T ** -(arange(nb) / nb), nb = D // 4; grid
        t = arange(S) / S * R per axis ('ij'); angles [H, W, 2, nb] flattened axis-major, repeat_interleave(2);
        x * cos + rot(x) * sin with rot(x) = [-x1, x0, -x3, x2, ...]."""
        dim = x.shape[-1]
        nb = dim // 4
        bands = temperature ** -(torch.arange(nb, dtype=torch.float64) / nb)
        rows = torch.arange(height, dtype=torch.float64) / height * ref[0]
        cols = torch.arange(width, dtype=torch.float64) / width * ref[1]
        grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), -1)           # [H, W, 2]
        angles = (grid[..., None] * bands).flatten(-2).reshape(height * width, 2 * nb)
        angles = angles.repeat_interleave(2, -1)                                     # [N, D]
        xd = x.double()
        rot = torch.stack([-xd[..., 1::2], xd[..., 0::2]], -1).flatten(-2)
        return xd * angles.cos() + rot * angles.sin()

    @staticmethod
    def _eva02_positions(height, width, ref):
        rows = torch.arange(height, dtype=torch.float64) / height * ref[0]
        cols = torch.arange(width, dtype=torch.float64) / width * ref[1]
        return torch.stack(torch.meshgrid(rows, cols, indexing="ij"), -1).reshape(-1, 2)   # [N, (row, col)]

    @pytest.mark.parametrize("dim, height, width, ref, temperature", [
        (16, 6, 5, (4, 4), 10000.0), (32, 7, 9, (16, 16), 10000.0), (16, 3, 8, (3, 8), 100.0)])
    def test_eva02_formulas(self, dim, height, width, ref, temperature):
        torch.manual_seed(13)
        x = torch.randn(2, 3, height * width, dim)
        want = self._eva02_reference(x, height, width, ref, temperature)
        positions = self._eva02_positions(height, width, ref)
        rope = RotaryPositionalEmbedding(dim, sections=[dim // 4, dim // 4], axis_spectrum="per_axis",
                                         interleaved=True, base=temperature)
        assert self.diff(rope(x, positions), want) < 2e-6
        nb = dim // 4
        explicit = RotaryPositionalEmbedding(dim, pair_axes=[0] * nb + [1] * nb, interleaved=True,
                                             frequencies=[temperature ** (-i / nb) for i in range(nb)] * 2)
        assert self.diff(explicit(x, positions), want) < 2e-6

    @pytest.mark.parametrize("img_size, patch, heads, embed_dim", [((24, 20), 4, 2, 64), ((16, 28), 4, 2, 32)])
    def test_eva02_matches_timm(self, img_size, patch, heads, embed_dim):
        pytest.importorskip("timm")
        from timm.layers import pos_embed_sincos as pes
        from timm.models.eva import Eva
        torch.manual_seed(14)
        ref = (4, 4)
        model = Eva(img_size=img_size, patch_size=patch, embed_dim=embed_dim, depth=1, num_heads=heads,
                    use_rot_pos_emb=True, ref_feat_shape=ref)                    # EVA-02's rope: 'cat', lang bands
        height, width = img_size[0] // patch, img_size[1] // patch
        dim = embed_dim // heads
        emb = model.rope.get_embed()                                            # [N, 2 D]: sin | cos
        half = model.blocks[0].attn.rotate_half
        assert not half
        q = torch.randn(2, heads, height * width, dim)
        theirs = pes.apply_rot_embed_cat(q, emb, half=half)
        rope = RotaryPositionalEmbedding(dim, sections=[dim // 4, dim // 4], axis_spectrum="per_axis",
                                         interleaved=True, base=10000.0)
        assert self.diff(rope(q, self._eva02_positions(height, width, ref)), theirs) < 5e-6
        assert self.diff(theirs, self._eva02_reference(q, height, width, ref, 10000.0)) < 5e-6


class TestRerotate:
    """``RotaryPositionalEmbedding.rerotate``: cached keys moved to new positions (StreamingLLM's renumbering)."""

    LONGROPE = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
    LAYOUTS = {
        "half_split": dict(), "interleaved": dict(interleaved=True), "partial": dict(rotary_dim=8),
        "sections": dict(sections=[2, 3, 3]), "sections_interleaved": dict(sections=[4, 2, 2], section_layout="interleaved"),
        "per_axis": dict(sections=[4, 2, 2], axis_spectrum="per_axis"),
        **{name: dict(scaling={"original_max_position_embeddings": 16, **scaling})
           for name, scaling in CENSUS_SCALINGS.items() if name != "longrope"},
        "longrope": dict(scaling=LONGROPE),
    }

    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("layout", LAYOUTS, ids=str)
    def test_equals_rotating_at_the_new_positions(self, layout, dtype):
        """rerotate(rope(k, old), old, new) == rope(k, new): every layout and scaling (dynamic and longrope cross
        their switch: old positions past the original length, new ones within it), up to one rounding in dtype."""
        rope = RotaryPositionalEmbedding(16, **self.LAYOUTS[layout])
        k = torch.randn(2, 3, 12, 16).to(dtype)
        if rope.num_axes == 1:
            old, new = torch.arange(20, 32), torch.cat([torch.arange(4), torch.arange(4, 12)])   # sinks + recent
        else:
            old = torch.randint(0, 40, (12, 3), generator=torch.Generator().manual_seed(0))
            new = old - old.min(0).values
        got, want = rope.rerotate(rope(k, old), old, new), rope(k, new)
        assert got.dtype == dtype
        ulp = torch.finfo(dtype).eps * want.double().abs().amax().item()
        assert (got.double() - want.double()).abs().max().item() <= (1e-12 if dtype == torch.float64 else 2 * ulp)

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_turns_each_pair_by_the_position_difference(self, interleaved):
        """Against the float64 rotation-matrix oracle: any x turns by (new - old) * theta_i, pair by pair."""
        rope = RotaryPositionalEmbedding(8, base=100.0, interleaved=interleaved)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        old, new = torch.tensor([3, 9, 0, 7, 1000]), torch.tensor([0, 2, 5, 7, -3])
        want = rope_oracle(x, (new - old).tolist(), plain_inv_freq(8, 100.0), interleaved=interleaved)
        torch.testing.assert_close(rope.rerotate(x, old, new), want, rtol=1e-12, atol=1e-12)

    def test_streaming_cache_attends_like_a_recomputed_one(self):
        """Keep 4 sink tokens and the 6 most recent of 16 cached keys, renumber them 0..9: attention of a new
        query at position 10 equals attention over keys rotated at 0..9 from the start."""
        rope = RotaryPositionalEmbedding(DH)
        keys, values, q = torch.randn(1, H, 16, DH), torch.randn(1, H, 16, DH), torch.randn(1, H, 1, DH)
        kept = torch.cat([torch.arange(4), torch.arange(10, 16)])
        cached = rope(keys)[..., kept, :]                                              # rotated at 0..15
        moved = rope.rerotate(cached, kept, torch.arange(10))
        fresh = rope(keys[..., kept, :])                                                # rotated at 0..9
        query = rope(q, offset=10)
        torch.testing.assert_close(attention(query, moved, values[..., kept, :]),
                                   attention(query, fresh, values[..., kept, :]), rtol=1e-5, atol=1e-6)

    def test_batched_positions_and_heads_last_layout(self):
        rope = RotaryPositionalEmbedding(DH)
        k = torch.randn(2, 6, H, DH)                                                   # [B, N, H, Dh]
        old, new = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]]), torch.arange(6).expand(2, 6)
        got = rope.rerotate(rope(k, old, seq_dim=-3), old, new, seq_dim=-3)
        torch.testing.assert_close(got, rope(k, new, seq_dim=-3), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_per_head_positions_turn_each_head_by_its_own_difference(self, interleaved):
        """Per-head positions [B, H, N] (kvpress's per-head eviction): against the float64 rotation-matrix
        oracle run head by head, in both layouts (seq_dim=-3 included), old or new shared by every head."""
        rope = RotaryPositionalEmbedding(8, base=100.0, interleaved=interleaved)
        x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
        g = torch.Generator().manual_seed(0)
        old, new = torch.randint(-50, 1000, (2, 3, 5), generator=g), torch.randint(0, 40, (2, 3, 5), generator=g)
        shared = torch.tensor([4, 0, 9, 2, 7])                                          # [N]: every head
        for new_positions, diff in ((new, new - old), (shared, shared - old)):
            want = torch.stack([torch.stack([rope_oracle(x[b, h], diff[b, h].tolist(), plain_inv_freq(8, 100.0),
                                                         interleaved=interleaved) for h in range(3)]) for b in range(2)])
            torch.testing.assert_close(rope.rerotate(x, old, new_positions), want, rtol=1e-12, atol=1e-12)
            heads_last = rope.rerotate(x.transpose(1, 2), old, new_positions, seq_dim=-3)   # [B, N, H, Dh]
            torch.testing.assert_close(heads_last.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
        one_head = rope.rerotate(x, old[:, :1], new[:, :1])                             # H = 1: shared by the heads
        torch.testing.assert_close(one_head, rope.rerotate(x, old[:, :1].expand(2, 3, 5), new[:, :1].expand(2, 3, 5)))

    @pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("dynamic", "longrope")], ids=str)
    def test_per_head_eviction_equals_rotating_each_head_at_its_new_positions(self, layout):
        """kvpress-style: each key head keeps its own 6 of 16 cached keys (rotated at 0..15) and renumbers them
        0..5; the moved cache equals each head's kept raw keys rotated at 0..5 from scratch."""
        rope = RotaryPositionalEmbedding(16, **self.LAYOUTS[layout])
        keys = torch.randn(2, 3, 16, 16, dtype=torch.float64)
        g = torch.Generator().manual_seed(1)
        kept = torch.rand(2, 3, 16, generator=g).argsort(-1)[..., :6].sort(-1).values   # [B, H, 6] per head
        if rope.num_axes == 1:
            old, new = kept, torch.arange(6)
        else:   # grid positions per token: token t at (t, t // 4, t % 4)
            grid = torch.stack([torch.arange(16), torch.arange(16) // 4, torch.arange(16) % 4], -1)   # [16, 3]
            old, new = grid[kept], grid[:6]                                             # [B, H, 6, 3], [6, 3]
        cached = rope(keys, grid if rope.num_axes > 1 else None).gather(2, kept[..., None].expand(-1, -1, -1, 16))
        raw = keys.gather(2, kept[..., None].expand(-1, -1, -1, 16))                    # [B, H, 6, Dh]
        torch.testing.assert_close(rope.rerotate(cached, old, new), rope(raw, new), rtol=1e-12, atol=1e-12)

    def test_bad_input_is_named(self):
        rope = RotaryPositionalEmbedding(DH)
        k = torch.randn(1, H, 4, DH)
        with pytest.raises(TypeError, match="RotaryPositionalEmbedding: rerotate needs new_positions"):
            rope.rerotate(k, torch.arange(4), None)
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: old_positions"):
            rope.rerotate(k, torch.arange(3), torch.arange(4))
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: x"):
            rope.rerotate(torch.randn(1, H, 4, DH + 2), torch.arange(4), torch.arange(4))
        with pytest.raises(ValueError, match=re.escape(f"RotaryPositionalEmbedding: per-head old_positions must have "
                                                       f"shape [1, {H}, 4] (B or H may be 1) for x of shape (1, {H}, 4, "
                                                       f"{DH}), got (1, {H + 1}, 4)")):
            rope.rerotate(k, torch.zeros(1, H + 1, 4, dtype=torch.long), torch.arange(4))
        with pytest.raises(ValueError, match="RotaryPositionalEmbedding: per-head new_positions \\(\\[B, H, N\\]\\) "
                                             "need a 4-D x, got x of shape \\(4, 32\\)"):
            rope.rerotate(torch.randn(4, 32), torch.arange(4), torch.zeros(1, 1, 4, dtype=torch.long))


# ---------------------------------------------------------------------------
# HoPE
# ---------------------------------------------------------------------------


class TestHoPE:
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_matches_loop_oracle(self, interleaved):
        # RoPE with every frequency below 2 pi / L set to 0, rotation matrices built per position in float64
        pe = HoPEPositionalEmbedding(16, train_length=100, base=100.0, interleaved=interleaved).double()
        freqs = [w if w >= 2 * math.pi / 100 else 0.0 for w in plain_inv_freq(16, 100.0)]
        assert pe.removed_pairs == sum(w == 0.0 for w in freqs) == 3                     # 100^(-i/8) < 0.0628: i >= 5
        x = torch.randn(2, 3, 6, 16, dtype=torch.float64)
        positions = [0, 1, 7, 99, 1000, 123456]
        want = rope_oracle(x, positions, freqs, interleaved=interleaved)
        torch.testing.assert_close(pe(x, torch.tensor(positions)), want, rtol=1e-12, atol=1e-12)

    def test_p_rope_at_the_same_fraction_and_not_otherwise(self):
        x = torch.randn(2, H, 40, 64)
        hope = HoPEPositionalEmbedding(64, train_length=512)                             # removes 16 of 32 pairs
        assert hope.removed_pairs == 16
        p_rope = RotaryPositionalEmbedding(64, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5})
        torch.testing.assert_close(hope(x), p_rope(x), rtol=0, atol=0)
        longer = HoPEPositionalEmbedding(64, train_length=8192)                          # the boundary moves with L
        assert longer.removed_pairs == 7                                                 # 10^4^(-i/32) < 7.7e-4: i >= 25
        assert (longer(x) - p_rope(x)).abs().max() > 0.1

    def test_fope_without_noise_is_hope(self):
        x = torch.randn(2, H, 30, DH)
        fope = FoPEPositionalEmbedding(DH, H, train_length=64, sigma=0.0)
        torch.testing.assert_close(fope(x, torch.arange(30) * 7), HoPEPositionalEmbedding(DH, train_length=64)(
            x, torch.arange(30) * 7), rtol=1e-5, atol=1e-6)

    def test_no_long_term_decay_in_the_removed_pairs(self):
        # A q/k living only in the removed pairs has the same logit at every distance.
        pe = HoPEPositionalEmbedding(DH, train_length=64)
        q, k = torch.zeros(2, 1, 1, 1, DH).unbind(0)
        removed = [i for i in range(DH // 2) if pe.inv_freq[i] == 0]
        for i in removed:
            q[..., i], k[..., i + DH // 2] = 1.0, 1.0
            q[..., i + DH // 2], k[..., i] = 0.5, -2.0
        logits = [pe.forward_attn(q, k, torch.tensor([t]), torch.tensor([0])).item() for t in (0, 1, 100, 10**6)]
        assert max(logits) - min(logits) < 1e-6 and removed

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="HoPEPositionalEmbedding: train_length"):
            HoPEPositionalEmbedding(DH, train_length=0)
        with pytest.raises(ValueError, match="HoPEPositionalEmbedding: dim"):
            HoPEPositionalEmbedding(DH + 1, train_length=64)
        with pytest.raises(TypeError, match="HoPEPositionalEmbedding: no Hugging Face model type uses HoPE"):
            HoPEPositionalEmbedding.from_config(LLAMA3_DICT)
        with pytest.raises(TypeError, match="HoPEPositionalEmbedding: HoPE takes no scaling"):
            HoPEPositionalEmbedding(DH, train_length=64).scaling = {"rope_type": "linear", "factor": 2.0}


# ---------------------------------------------------------------------------
# VideoRoPE
# ---------------------------------------------------------------------------


def video_positions_oracle(segments, spacing):
    """The diagonal layout by plain loops: rows (t, h, w) per token."""
    rows, start = [], 0.0
    for segment in segments:
        if isinstance(segment, int):
            rows += [(start + i,) * 3 for i in range(segment)]
            start += segment
            continue
        frames, height, width = segment
        for f in range(frames):
            for y in range(height):
                for x in range(width):
                    t = start + spacing * f
                    rows.append((t, t + y - math.floor((height - 1) / 2), t + x - math.floor((width - 1) / 2)))
        start += spacing * (frames - 1) + 1
    return torch.tensor(rows, dtype=torch.float64)


class TestVideoRoPE:
    def test_time_takes_the_slowest_pairs_and_h_w_alternate(self):
        video = VideoRotaryPositionalEmbedding(128)                                          # sections [16, 24, 24]
        axes = video.axis_of_pair.tolist()
        assert video.sections == [16, 24, 24]
        assert axes == [1 if k % 2 == 0 else 2 for k in range(48)] + [0] * 16
        slowest = video.inv_freq.argsort()[:16].sort().values.tolist()                     # the 16 lowest frequencies
        assert [k for k in range(64) if axes[k] == 0] == slowest
        # M-RoPE gives time the fastest pairs, Qwen3-VL cycles t, h, w from pair 0
        mrope = RotaryPositionalEmbedding(128, sections=[16, 24, 24]).axis_of_pair.tolist()
        qwen3 = RotaryPositionalEmbedding(128, sections=[24, 20, 20], section_layout="interleaved").axis_of_pair.tolist()
        assert mrope[:16] == [0] * 16 and qwen3[:3] == [0, 1, 2]
        assert len({tuple(axes), tuple(mrope), tuple(qwen3)}) == 3

    def test_a_spatial_split_the_alternation_cannot_honour_raises(self):
        # the reference alternates h and w over sections[1] + sections[2] pairs whatever their split: h gets
        # ceil, w floor of half of them, so any other split would be silently ignored
        a = VideoRotaryPositionalEmbedding(64, sections=[8, 12, 12]).axis_of_pair
        assert a.tolist() == [1, 2] * 12 + [0] * 8
        assert VideoRotaryPositionalEmbedding(64, sections=[9, 12, 11]).axis_of_pair.tolist() == [1, 2] * 11 + [1] + [0] * 9
        with pytest.raises(ValueError, match=r"need h == w or h == w \+ 1, got sections=\[8, 20, 4\]"):
            VideoRotaryPositionalEmbedding(64, sections=[8, 20, 4])

    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
    def test_rotation_matches_loop_oracle(self, dtype):
        video = VideoRotaryPositionalEmbedding(16, sections=[2, 3, 3], base=100.0)
        positions = video.positions([2, (2, 2, 2), 1])                                      # [11, 3]
        x = torch.randn(1, 2, 11, 16, dtype=torch.float64)
        got = video(x.to(dtype), positions)
        want = torch.empty_like(x)
        for n in range(11):
            for k in range(8):                                                               # pair (k, k + 8)
                axis = 0 if k >= 6 else 1 + k % 2
                angle = float(positions[n, axis]) * 100.0 ** (-2 * k / 16)
                a, b = x[..., n, k], x[..., n, k + 8]
                want[..., n, k] = a * math.cos(angle) - b * math.sin(angle)
                want[..., n, k + 8] = b * math.cos(angle) + a * math.sin(angle)
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)

    @pytest.mark.parametrize("spacing", [2.0, 0.5, 1.0, 3.0])
    def test_positions_match_loop_oracle(self, spacing):
        segments = [3, (2, 3, 4), 1, (1, 4, 5), (3, 2, 1), 2]
        got = VideoRotaryPositionalEmbedding(DH, temporal_spacing=spacing).positions(segments, start=0)
        torch.testing.assert_close(got, video_positions_oracle(segments, spacing), rtol=0, atol=0)

    def test_positions_match_the_reference(self):
        # get_t_scale_rope_index of Wiselnn570/VideoRoPE (videorope-transformer/modeling_videorope.py,
        # HEAD 7712ca3) run on this machine for these prompts (vision start/end tokens counted as text;
        # merged grids): ids copied from its output
        video = VideoRotaryPositionalEmbedding(DH, temporal_spacing=2.0)
        got = video.positions([4, (2, 3, 4), 3])
        want = [[0, 1, 2, 3] + [4] * 12 + [6] * 12 + [7, 8, 9],
                [0, 1, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7, 7, 8, 9],
                [0, 1, 2, 3] + [3, 4, 5, 6] * 3 + [5, 6, 7, 8] * 3 + [7, 8, 9]]
        assert got.T.tolist() == want
        video = VideoRotaryPositionalEmbedding(DH, temporal_spacing=0.5)
        got = video.positions([2, (1, 2, 2), 3, (3, 2, 3), 3])
        want = [[0, 1, 2, 2, 2, 2, 3, 4, 5, 6, 6, 6, 6, 6, 6, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5, 7, 7, 7, 7, 7, 7, 8, 9, 10],
                [0, 1, 2, 2, 3, 3, 3, 4, 5, 6, 6, 6, 7, 7, 7, 6.5, 6.5, 6.5, 7.5, 7.5, 7.5, 7, 7, 7, 8, 8, 8, 8, 9, 10],
                [0, 1, 2, 3, 2, 3, 3, 4, 5, 5, 6, 7, 5, 6, 7, 5.5, 6.5, 7.5, 5.5, 6.5, 7.5, 6, 7, 8, 6, 7, 8, 8, 9, 10]]
        assert got.T.tolist() == want

    def test_text_after_a_video_resumes_from_the_time_row(self):
        positions = VideoRotaryPositionalEmbedding(DH, temporal_spacing=1.0).positions([1, (2, 5, 5), 1])
        last_frame = positions[1:-1]
        assert positions[-1, 0] == last_frame[:, 0].max() + 1 == 3
        assert last_frame[:, 1:].max() == 4                                 # M-RoPE would resume at 4 + 1 = 5

    def test_text_alone_is_plain_rope(self):
        video = VideoRotaryPositionalEmbedding(DH)
        q, k, _ = qkv()
        p = video.positions([N])
        torch.testing.assert_close(video.forward_attn(q, k, p, p), RotaryPositionalEmbedding(DH).forward_attn(q, k))

    def test_differs_from_mrope_on_video(self):
        video = VideoRotaryPositionalEmbedding(DH, sections=[4, 6, 6])
        mrope = RotaryPositionalEmbedding(DH, sections=[4, 6, 6])
        q, k, _ = qkv()
        p = video_tthw(N)
        assert (video.forward_attn(q, k, p, p) - mrope.forward_attn(q, k, p, p)).abs().max() > 0.1

    def test_bad_input(self):
        with pytest.raises(ValueError, match=r"^VideoRotaryPositionalEmbedding: section_layout=.alternating. "
                                             r"\(ERNIE-4.5-VL, VideoRoPE\) needs three sections"):
            VideoRotaryPositionalEmbedding(32, sections=[8, 8])
        with pytest.raises(ValueError, match="^VideoRotaryPositionalEmbedding: sections must be positive and sum to"):
            VideoRotaryPositionalEmbedding(32, sections=[4, 4, 4])
        with pytest.raises(ValueError, match="^VideoRotaryPositionalEmbedding: temporal_spacing must be a finite number > 0"):
            VideoRotaryPositionalEmbedding(32, temporal_spacing=0.0)
        video = VideoRotaryPositionalEmbedding(32)
        with pytest.raises(ValueError, match="^VideoRotaryPositionalEmbedding: segments must be a sequence of 3 positive ints, got segments=\\(2, 3\\)"):
            video.positions([3, (2, 3)])
        with pytest.raises(ValueError, match="^VideoRotaryPositionalEmbedding: segments must be a non-negative int, got segments=-1"):
            video.positions([-1])
        with pytest.raises(TypeError, match="^VideoRotaryPositionalEmbedding: no Hugging Face model type uses VideoRoPE"):
            VideoRotaryPositionalEmbedding.from_config({"model_type": "qwen2_vl"})
        with pytest.raises(ValueError, match="VideoRotaryPositionalEmbedding: positions"):
            video(torch.randn(1, 2, 5, 32), torch.zeros(5, 2))

    def test_a_head_dim_too_small_is_named_not_the_default_sections(self):
        """VideoRotaryPositionalEmbedding(4) blamed sections=0, a default the user never passed."""
        for args, kwargs, name in (((4,), {}, "dim"), ((), {"head_dim": 2}, "head_dim"),
                                   ((4,), {"sections": [1, 1, 0]}, "dim")):
            with pytest.raises(ValueError, match=rf"^VideoRotaryPositionalEmbedding: {name} must be at least 6 "
                                                 rf"\(a pair each for t, h and w\), got {name}="):
                VideoRotaryPositionalEmbedding(*args, **kwargs)
        assert VideoRotaryPositionalEmbedding(6).sections == [1, 1, 1]                 # the smallest


# ---------------------------------------------------------------------------
# multimodal_position_ids: the M-RoPE ids of mixed text, image and video prompts
# ---------------------------------------------------------------------------

# each model's get_rope_index in transformers 5.24: (config class, module class, its keyword for seconds)
ROPE_INDEX_MODELS = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLConfig", "Qwen2VLModel", None),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLModel", "second_per_grid_ts"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLModel", None),
    "glm4v": ("glm4v", "Glm4vConfig", "Glm4vModel", None),
    "qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniThinkerConfig", "Qwen2_5OmniThinkerForConditionalGeneration",
                     "second_per_grids"),
    "qwen3_omni": ("qwen3_omni_moe", "Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerForConditionalGeneration",
                   "second_per_grids"),
}
TEXT_ID, PAD_ID, VISION_START, VISION_END = 100, 0, 151652, 151653


def rope_index_prompt(model: str, config, segments: list) -> tuple:
    """Token ids and ``mm_token_type_ids`` of one prompt as the model's processor lays it out. ``segments``:
    ints (text runs) and ``("image" | "video", (t, h, w))``; the config's merge. Qwen3-VL and GLM-4V put a
    timestamp (text) before each video frame; GLM-4V's frames carry the image token between its video start and end."""
    ids, types = [], []
    merge = config.vision_config.spatial_merge_size

    def add(tokens, kind=0):
        ids.extend(tokens)
        types.extend([kind] * len(tokens))

    for segment in segments:
        if isinstance(segment, int):
            add([TEXT_ID] * segment)
            continue
        what, (t, h, w) = segment
        per_frame = (h // merge) * (w // merge)
        if model == "glm4v":
            frames = 1 if what == "image" else t
            if what == "video":
                add([config.video_start_token_id])
            for _ in range(frames):
                add([config.image_start_token_id])
                add([config.image_token_id] * (per_frame * (t if what == "image" else 1)), 1 if what == "image" else 2)
                add([config.image_end_token_id] + ([TEXT_ID] if what == "video" else []))
            if what == "video":
                add([config.video_end_token_id])
        elif model == "qwen3_vl" and what == "video":
            for _ in range(t):
                add([TEXT_ID] * 3 + [VISION_START])                                      # "<0.5 seconds>" + start
                add([config.video_token_id] * per_frame, 2)
                add([VISION_END])
        else:
            token = config.image_token_id if what == "image" else config.video_token_id
            add([VISION_START])
            add([token] * (t * per_frame), 1 if what == "image" else 2)
            add([VISION_END])
    return ids, types


def rope_index_batch(model: str, config, prompts: list) -> tuple:
    """Left-padded ids, types and attention mask ``[B, L]`` of several prompts."""
    rows = [rope_index_prompt(model, config, prompt) for prompt in prompts]
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), PAD_ID)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (row_ids, row_types) in enumerate(rows):
        ids[b, length - len(row_ids):] = torch.tensor(row_ids)
        types[b, length - len(row_ids):] = torch.tensor(row_types)
        mask[b, length - len(row_ids):] = 1
    return ids, types, mask


def rope_index_config(model: str, tokens_per_second=None, spatial_merge_size=None):
    """The model's transformers config: its defaults, or these video timing and merge sizes."""
    import importlib
    package, config_name, _, _ = ROPE_INDEX_MODELS[model]
    configuration = importlib.import_module(f"transformers.models.{package}.configuration_{package}")
    extra = {"vision_start_token_id": VISION_START} if "omni" in model else {}
    config = getattr(configuration, config_name)(**extra)
    if tokens_per_second is not None:
        if "omni" in model:
            config.position_id_per_seconds = tokens_per_second
        else:
            config.vision_config.tokens_per_second = tokens_per_second
    if spatial_merge_size is not None:
        config.vision_config.spatial_merge_size = spatial_merge_size
    return config


def transformers_rope_index(model: str, prompts: list, images: list, videos: list, seconds=None,
                            tokens_per_second=None, config=None) -> tuple:
    """``(ids, types, mask)`` of the prompts and what the model's own ``get_rope_index`` returns for them
    (a module built from ``config``, else from ``rope_index_config(model, tokens_per_second)``)."""
    import importlib
    package, _, module_name, seconds_keyword = ROPE_INDEX_MODELS[model]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    config = rope_index_config(model, tokens_per_second) if config is None else config
    ids, types, mask = rope_index_batch(model, config, prompts)
    with torch.device("meta"):                                                          # no weights allocated
        module = getattr(modeling, module_name)(config)
    kwargs = dict(image_grid_thw=torch.tensor(images) if images else None,
                  video_grid_thw=torch.tensor(videos) if videos else None, attention_mask=mask)
    if seconds_keyword is not None and videos:
        kwargs[seconds_keyword] = torch.tensor(seconds if seconds is not None else [1.0] * len(videos))
    if "omni" not in model:
        kwargs["mm_token_type_ids"] = types
    return ids, types, mask, module.get_rope_index(ids, **kwargs)


class TestMultimodalPositionIds:
    """Against each model's own get_rope_index (transformers 5.24, on prompts with several images and videos and
    left padding), every token and the rope_deltas; and the layout rules by hand."""

    PROMPTS = [[3, ("image", (1, 4, 6)), 2, ("image", (1, 8, 4)), 4],
               [2, ("video", (3, 4, 4)), 3, ("image", (1, 2, 2)), 1],
               [1, ("video", (2, 6, 2)), ("video", (4, 2, 4)), 5]]
    IMAGES = [(1, 4, 6), (1, 8, 4), (1, 2, 2)]
    VIDEOS = [(3, 4, 4), (2, 6, 2), (4, 2, 4)]

    @pytest.mark.parametrize("model", list(ROPE_INDEX_MODELS))
    @pytest.mark.parametrize("seconds, tokens_per_second", [(None, None), ([0.5, 1.5, 0.3], 2)],
                             ids=["defaults", "timed"])
    def test_matches_transformers_get_rope_index(self, model, seconds, tokens_per_second):
        pytest.importorskip("transformers")
        if model in ("qwen3_vl", "glm4v", "qwen2_vl") and seconds is not None:
            pytest.skip("no video timing: the time index is the frame index")
        ids, types, mask, (want, want_deltas) = transformers_rope_index(model, self.PROMPTS, self.IMAGES, self.VIDEOS,
                                                                        seconds, tokens_per_second)
        got, deltas = multimodal_position_ids(types, torch.tensor(self.IMAGES), torch.tensor(self.VIDEOS),
                                              attention_mask=mask, model=model, tokens_per_second=tokens_per_second,
                                              video_seconds=seconds)
        assert torch.equal(got.permute(2, 0, 1).to(want.dtype), want), (got.permute(2, 0, 1), want)
        if model == "qwen3_omni":  # its float32 max + 1 - n rounds once more than our float64 one
            torch.testing.assert_close(deltas.to(want_deltas.dtype), want_deltas, rtol=0, atol=1e-5)
        else:
            assert torch.equal(deltas, want_deltas)
        assert got.dtype == (torch.float64 if model == "qwen3_omni" else torch.int64)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    def test_cuda_inputs_give_the_cpu_ids_on_cuda(self):
        # the ids were built on the CPU and indexed with the inputs' mask: a CUDA mask failed
        pytest.importorskip("transformers")
        _, types, mask, _ = transformers_rope_index("qwen2_vl", self.PROMPTS, self.IMAGES, self.VIDEOS, None, None)
        args = (types, torch.tensor(self.IMAGES), torch.tensor(self.VIDEOS))
        want, want_deltas = multimodal_position_ids(*args, attention_mask=mask, model="qwen2_vl")
        got, deltas = multimodal_position_ids(*(a.cuda() for a in args), attention_mask=mask.cuda(), model="qwen2_vl")
        assert got.is_cuda and deltas.is_cuda
        assert torch.equal(got.cpu(), want) and torch.equal(deltas.cpu(), want_deltas)

    CONFIG_PROMPTS = [[2, ("image", (2, 6, 9)), 3, ("video", (3, 6, 6)), 1],
                      [1, ("video", (2, 3, 9)), 2, ("image", (1, 3, 3)), 4]]
    CONFIG_IMAGES = [(2, 6, 9), (1, 3, 3)]
    CONFIG_VIDEOS = [(3, 6, 6), (2, 3, 9)]

    @pytest.mark.parametrize("model, tokens_per_second", [("qwen2_vl", None), ("qwen2_5_vl", 3), ("qwen3_vl", None),
                                                          ("qwen2_5_omni", 10), ("qwen3_omni", 7)])
    def test_config_gives_the_models_own_ids(self, model, tokens_per_second):
        # spatial merge 3 and the video timing set in the config alone (the function's defaults are 2 and 4 / 25):
        # the ids read from the config object, its config.json dict (and an Omni's full config around the
        # thinker's) equal the model's own get_rope_index on a left-padded batch
        pytest.importorskip("transformers")
        config = rope_index_config(model, tokens_per_second, spatial_merge_size=3)
        seconds = [0.5, 1.5] if tokens_per_second else None
        ids, types, mask, (want, want_deltas) = transformers_rope_index(
            model, self.CONFIG_PROMPTS, self.CONFIG_IMAGES, self.CONFIG_VIDEOS, seconds, config=config)
        inputs = dict(image_grid_thw=torch.tensor(self.CONFIG_IMAGES), video_grid_thw=torch.tensor(self.CONFIG_VIDEOS),
                      attention_mask=mask, video_seconds=seconds)
        configs = [config, config.to_dict()]
        if "omni" in model:                                                                  # the full Omni config
            configs.append({"model_type": ROPE_INDEX_MODELS[model][0], "thinker_config": config.to_dict()})
        for given in configs:
            got, deltas = multimodal_position_ids(types, **inputs, config=given)
            assert torch.equal(got.permute(2, 0, 1).to(want.dtype), want), (got.permute(2, 0, 1), want)
            tolerance = 1e-5 if model == "qwen3_omni" else 0       # float32 max + 1 - n in the model
            torch.testing.assert_close(deltas.to(want_deltas.dtype), want_deltas, rtol=0, atol=tolerance)
        with pytest.raises(ValueError, match="divisible by spatial_merge_size=2"):          # merge 2: grids of 3s
            multimodal_position_ids(types, **inputs, model=model)
        if tokens_per_second:                                                                # the default timing
            default, _ = multimodal_position_ids(types, **inputs, model=model, spatial_merge_size=3)
            assert not torch.equal(default, got)

    def test_config_and_keywords_must_agree(self):
        pytest.importorskip("transformers")
        config = rope_index_config("qwen2_5_vl", 3, spatial_merge_size=3)
        types, grid = torch.tensor([[0] + [2] * 8]), torch.tensor([[2, 6, 6]])
        got, _ = multimodal_position_ids(types, video_grid_thw=grid, config=config)
        same, _ = multimodal_position_ids(types, video_grid_thw=grid, config=config, model="qwen2_5_vl",
                                          spatial_merge_size=3, tokens_per_second=3.0)        # agreeing: fine
        assert torch.equal(same, got) and got[0, 1:, 0].unique().tolist() == [1, 4]         # 1 + 3 tokens/s * 1 s
        owner = "^multimodal_position_ids: "
        with pytest.raises(ValueError, match=owner + r"spatial_merge_size=2 disagrees with the config's "
                                                     r"vision_config.spatial_merge_size \(3\); pass one of them"):
            multimodal_position_ids(types, video_grid_thw=grid, config=config, spatial_merge_size=2)
        with pytest.raises(ValueError, match=owner + r"tokens_per_second=2.0 disagrees with the config's "
                                                     r"vision_config.tokens_per_second \(3.0\)"):
            multimodal_position_ids(types, video_grid_thw=grid, config=config, tokens_per_second=2)
        with pytest.raises(ValueError, match=owner + "model='qwen2_vl' disagrees with the config's "
                                                     "model_type='qwen2_5_vl'"):
            multimodal_position_ids(types, video_grid_thw=grid, config=config, model="qwen2_vl")
        with pytest.raises(ValueError, match=owner + "config must be one of .*, got model_type='llama'"):
            multimodal_position_ids(types, config={"model_type": "llama"})
        with pytest.raises(ValueError, match=owner + r"config \(model_type='qwen2_vl'\) has no vision_config"):
            multimodal_position_ids(types, config={"model_type": "qwen2_vl"})
        with pytest.raises(TypeError, match=owner + "config must be a Hugging Face config object"):
            multimodal_position_ids(types, config="qwen2_vl")
        with pytest.raises(ValueError, match=owner + "config's position_id_per_seconds must be a finite number > 0"):
            multimodal_position_ids(types, config={"model_type": "qwen2_5_omni_thinker", "position_id_per_seconds": 0,
                                                   "vision_config": {"spatial_merge_size": 2}})

    @pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
    @pytest.mark.parametrize("model", ["qwen2_5_vl", "qwen2_5_omni", "qwen3_omni"])
    def test_video_seconds_must_be_finite_and_non_negative(self, model, bad):
        # -1 s gave time ids going back (-3), NaN a raw int64 overflow
        types, grids = torch.tensor([[0] + [2] * 4 + [0] + [2] * 12]), torch.tensor([[1, 4, 4], [3, 4, 4]])
        with pytest.raises(ValueError, match=r"^multimodal_position_ids: video_seconds\[1\] must be a finite number "
                                             rf">= 0.0, got video_seconds\[1\]={bad!r}$"):
            multimodal_position_ids(types, video_grid_thw=grids, model=model, video_seconds=[1.0, bad])
        still, _ = multimodal_position_ids(types, video_grid_thw=grids, model=model, video_seconds=[1.0, 0.0])
        assert still[0, 6:, 0].unique().tolist() == [still[0, 6, 0].item()]                # 0 s: one time id
        tensor, _ = multimodal_position_ids(types, video_grid_thw=grids, model=model,
                                            video_seconds=torch.tensor([1.0, 0.5]))         # second_per_grid_ts
        assert torch.equal(tensor, multimodal_position_ids(types, video_grid_thw=grids, model=model,
                                                           video_seconds=[1.0, 0.5])[0])
        with pytest.raises(TypeError, match=r"^multimodal_position_ids: video_seconds must be a list, got str"):
            multimodal_position_ids(types, video_grid_thw=grids, model=model, video_seconds="12")

    @pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
    def test_text_only_matches_transformers(self, model):
        pytest.importorskip("transformers")
        prompts = [[5], [2]]
        ids, types, mask, (want, want_deltas) = transformers_rope_index(model, prompts, [], [])
        got, deltas = multimodal_position_ids(types, attention_mask=mask, model=model)
        assert torch.equal(got.permute(2, 0, 1), want) and torch.equal(deltas, want_deltas)
        assert torch.equal(got[0, :, 0], torch.arange(5)) and (deltas == 0).all()

    def test_text_resumes_after_the_spatial_extent_not_the_last_frame(self):
        # Qwen2.5-VL, one 3 x 4 x 4 video at 2 tokens per second and 2 s per grid step: time ids 2 + 0, 4, 8;
        # the text after it starts at 2 + max(2, 2) = 4, while rope_deltas points past the largest id (10)
        types = torch.tensor([[0, 0] + [2] * 12 + [0, 0]])
        positions, deltas = multimodal_position_ids(types, video_grid_thw=torch.tensor([[3, 4, 4]]),
                                                    model="qwen2_5_vl", tokens_per_second=2, video_seconds=[2.0])
        assert positions[0, 2:14, 0].unique().tolist() == [2, 6, 10]
        assert positions[0, 14:, 0].tolist() == [4, 5]
        assert deltas.tolist() == [[10 + 1 - 16]]
        omni, omni_deltas = multimodal_position_ids(types, video_grid_thw=torch.tensor([[3, 4, 4]]),
                                                    model="qwen2_5_omni", video_seconds=[0.5])
        assert omni[0, 2:14, 0].unique().tolist() == [2, 14, 27]                      # floor(k * 0.5 * 25)
        assert omni[0, 14:, 0].tolist() == [28, 29]                                      # the block's max + 1
        fractional, _ = multimodal_position_ids(types, video_grid_thw=torch.tensor([[3, 4, 4]]), model="qwen3_omni",
                                                video_seconds=[0.5])
        assert fractional[0, 2:14, 0].unique().tolist() == [2.0, 14.5, 27.0]

    def test_bad_input(self):
        owner = "multimodal_position_ids: "
        with pytest.raises(ValueError, match=owner + "token_types must be a \\[B, N\\] integer tensor"):
            multimodal_position_ids(torch.tensor([[0, 3]]))
        with pytest.raises(ValueError, match=owner + "a run of 3 image tokens in row 0 does not match its grid"):
            multimodal_position_ids(torch.tensor([[0, 1, 1, 1]]), torch.tensor([[1, 4, 4]]))
        with pytest.raises(ValueError, match=owner + "row 0 has more runs of image tokens than there are grids"):
            multimodal_position_ids(torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1]]), torch.tensor([[1, 4, 4]]))
        with pytest.raises(ValueError, match=owner + "more video grids than runs"):
            multimodal_position_ids(torch.tensor([[0, 0]]), video_grid_thw=torch.tensor([[1, 2, 2]]))
        with pytest.raises(ValueError, match=owner + "model must be one of"):
            multimodal_position_ids(torch.tensor([[0, 0]]), model="qwen4")
        with pytest.raises(ValueError, match=owner + "model='qwen3_vl' has no video timing"):
            multimodal_position_ids(torch.tensor([[2] * 4]), video_grid_thw=torch.tensor([[1, 4, 4]]),
                                    model="qwen3_vl", tokens_per_second=2)
        with pytest.raises(ValueError, match=owner + "video_seconds must have one entry per video"):
            multimodal_position_ids(torch.tensor([[2] * 4]), video_grid_thw=torch.tensor([[1, 4, 4]]),
                                    model="qwen2_5_vl", video_seconds=[1.0, 2.0])

    def test_bad_dtypes_masks_grids_and_overflow_are_named(self):
        """Before: bool token_types / grids passed as 0 and 1, complex ones and a meta tensor raised deep in
        torch, a grid not divisible by the merge size was floored silently, an additive mask (0 real, -inf
        padded) read inverted, a list mask raised AttributeError, and huge video timing overflowed int64
        (a raw RuntimeError) or gave NaN positions (Qwen3-Omni)."""
        owner = "multimodal_position_ids: "
        types, grid = torch.tensor([[0, 0, 1, 1, 1, 1, 0]]), torch.tensor([[1, 4, 4]])
        for bad in (types.bool(), types.to(torch.complex64)):
            with pytest.raises(ValueError, match=owner + r"token_types must be a \[B, N\] integer tensor"):
                multimodal_position_ids(bad, grid)
        for bad in (grid.bool(), grid.to(torch.complex64)):
            with pytest.raises(ValueError, match=owner + r"image_grid_thw must be a \[M, 3\] integer tensor"):
                multimodal_position_ids(types, bad)
        with pytest.raises(ValueError, match=owner + "token_types must hold values .* on the meta device"):
            multimodal_position_ids(types.to("meta"), grid)
        with pytest.raises(ValueError, match=owner + r"image_grid_thw must have h and w divisible by "
                                                     r"spatial_merge_size=2, got \[\(1, 5, 4\)\]"):
            multimodal_position_ids(types, torch.tensor([[1, 5, 4]]))             # 5 // 2 = 2 gave 4 tokens
        additive = torch.tensor([[-float("inf")] + [0.0] * 6])
        with pytest.raises(ValueError, match=owner + r"attention_mask must hold 1 \(real token\) and 0 \(padding\), "
                                                     r"got the values \[-inf, 0.0\]"):
            multimodal_position_ids(types, grid, attention_mask=additive)
        with pytest.raises(ValueError, match=owner + r"attention_mask must be a tensor of token_types' shape"):
            multimodal_position_ids(types, grid, attention_mask=[[1] * 7])
        video, video_grid = torch.tensor([[0] + [2] * 8 + [0]]), torch.tensor([[2, 4, 4]])
        for model, scale in (("qwen2_5_vl", 1e30), ("qwen2_5_vl", 1e300), ("qwen3_omni", 1e300)):
            with pytest.raises(ValueError, match=owner + r"the video time ids .* must stay within 2\*\*62 - 1"):
                multimodal_position_ids(video, None, video_grid, model=model, tokens_per_second=scale)
        positions, _ = multimodal_position_ids(types, grid, attention_mask=torch.tensor([[False] + [True] * 6]))
        assert positions[0, :, 0].tolist() == [0, 0, 1, 1, 1, 1, 3]                     # a bool mask still reads


# ---------------------------------------------------------------------------
# xPos
# ---------------------------------------------------------------------------


def xpos_oracle(x, positions, sign, base, scale_base, gamma, interleaved):
    """Plain loops, float64: rotate pair i by p * theta_i and scale it by zeta_i ** (sign * p / scale_base)."""
    *lead, n, dim = x.shape
    flat = x.double().reshape(-1, n, dim).tolist()
    out = []
    for rows in flat:
        new_rows = []
        for t in range(n):
            p = positions[t]
            row = list(rows[t])
            new = list(row)
            for i in range(dim // 2):
                theta = base ** (-2 * i / dim)
                zeta = (2 * i / dim + gamma) / (1 + gamma)
                s = zeta ** (sign * p / scale_base)
                a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + dim // 2)
                a, b = row[a_idx], row[b_idx]
                new[a_idx] = s * (a * math.cos(p * theta) - b * math.sin(p * theta))
                new[b_idx] = s * (b * math.cos(p * theta) + a * math.sin(p * theta))
            new_rows.append(new)
        out.append(new_rows)
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, n, dim)


def _has_numpy():
    try:
        import numpy  # noqa: F401
        return True
    except ImportError:
        return False


class TestXPos:
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_matches_loop_oracle(self, interleaved):
        xpos = XPosPositionalEmbedding(8, scale_base=16.0, gamma=0.3, base=100.0, interleaved=interleaved)
        q, k = torch.randn(2, 1, 2, 6, 8, dtype=torch.float64).unbind(0)
        q2, k2 = xpos(q[..., -3:, :], k)                  # bottom-right: queries at 3, 4, 5
        torch.testing.assert_close(q2, xpos_oracle(q[..., -3:, :], [3, 4, 5], 1, 100.0, 16.0, 0.3, interleaved))
        torch.testing.assert_close(k2, xpos_oracle(k, list(range(6)), -1, 100.0, 16.0, 0.3, interleaved))
        pos = torch.tensor([0.5, -7.0, 30.25, 1e3, 2.0, 9.0], dtype=torch.float64)
        q2, k2 = xpos(q, k, pos, pos.flip(0))
        torch.testing.assert_close(q2, xpos_oracle(q, pos.tolist(), 1, 100.0, 16.0, 0.3, interleaved))
        torch.testing.assert_close(k2, xpos_oracle(k, pos.flip(0).tolist(), -1, 100.0, 16.0, 0.3, interleaved))

    def test_logits_depend_only_on_distance(self):
        xpos = XPosPositionalEmbedding(DH, scale_base=64.0)
        q, k, _ = qkv(dtype=torch.float64)
        pos = torch.arange(N)
        base = xpos.forward_attn(q, k, pos, pos)
        for shift in (5, 700, -300):
            torch.testing.assert_close(xpos.forward_attn(q, k, pos + shift, pos + shift), base)
        # and the decay: |logit| of the same q, k at distance d shrinks as zeta_max ** (d / scale_base) at most
        q1, k1 = q[..., :1, :], q[..., :1, :]
        near = xpos.forward_attn(q1, k1, torch.tensor([0]), torch.tensor([0]))
        far = xpos.forward_attn(q1, k1, torch.tensor([640]), torch.tensor([0]))
        assert (far.abs() < near.abs()).all()

    def test_decoding_with_offset_and_bottom_right_equals_full(self):
        xpos = XPosPositionalEmbedding(DH)
        q, k, _ = qkv()
        full_q, full_k = xpos(q, k)
        for t in (0, 7, N - 1):
            step_q, step_k = xpos(q[..., t : t + 1, :], k[..., t : t + 1, :], offset=t)
            torch.testing.assert_close(step_q, full_q[..., t : t + 1, :])
            torch.testing.assert_close(step_k, full_k[..., t : t + 1, :])
            tail_q, prefix_k = xpos(q[..., t : t + 1, :], k[..., : t + 1, :])      # bottom-right
            torch.testing.assert_close(tail_q, full_q[..., t : t + 1, :])
            torch.testing.assert_close(prefix_k, full_k[..., : t + 1, :])

    def test_far_positions_keep_precision(self):
        # position 3e4 (inside the float32 range): float32 vs float64 after dividing out each pair's
        # scale zeta ** (+-p / scale_base) (the rotated values themselves may cancel)
        xpos = XPosPositionalEmbedding(DH)
        q, k, _ = qkv(1, 1)
        pos = torch.tensor([30000])
        zeta = (torch.arange(0, DH, 2, dtype=torch.float64) / DH + 0.4) / 1.4
        for sign, x, got, want in zip((1, -1), (q, k), xpos(q, k, pos, pos), xpos(q.double(), k.double(), pos, pos)):
            scale = torch.cat([zeta, zeta]) ** (sign * 30000 / 512)
            error = ((got.double() - want) / scale).abs().max()
            assert error < 1e-5 * x.abs().max(), error
            assert ((want / scale).norm() - x.double().norm()).abs() < 1e-9     # a rotation once unscaled

    def test_range_limits_in_docstring(self):
        zeta0 = 0.4 / 1.4
        scale = lambda p, dtype: torch.tensor(zeta0, dtype=torch.float64).pow(-p / 512.0).to(dtype)
        # overflow column of the docstring table
        for dtype, first_inf in ((torch.float32, 36261), (torch.bfloat16, 36259), (torch.float16, 4533)):
            assert torch.isinf(scale(first_inf + 1, dtype)) and torch.isfinite(scale(first_inf - 2, dtype))
        # underflow-to-zero column (the q scale is the reciprocal)
        for dtype, zero in ((torch.float32, 42493), (torch.bfloat16, 37960), (torch.float16, 7082)):
            assert scale(-(zero + 1), dtype) == 0 and scale(-(zero - 2), dtype) > 0
        # the accepted range ends where the scales stop being normal numbers
        xpos = XPosPositionalEmbedding(DH)
        for dtype, first in ((torch.float32, 35694), (torch.bfloat16, 35694), (torch.float16, 3966)):
            limit = xpos.limit(dtype)
            assert first <= limit < first + 1
            assert scale(-math.floor(limit), dtype).abs() >= torch.finfo(dtype).tiny
            assert scale(-math.ceil(limit) - 1, dtype).abs() < torch.finfo(dtype).tiny

    def test_out_of_range_positions_raise(self):
        xpos = XPosPositionalEmbedding(DH)
        q, k, v = qkv(1, 1)
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: positions must satisfy \\|p\\| <= 3966 for "
                                             "torch.float16 inputs .* got \\|p\\| = 4000"):
            xpos(q.half(), k.half(), torch.tensor([4000]), torch.tensor([4000]))
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: positions must satisfy \\|p\\| <= 35694"):
            attention(q, k, v, xpos, positions_q=torch.tensor([-1e6]), positions_k=torch.tensor([0]))
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: positions"):
            xpos(q, k, offset=40000)
        out = xpos(q.half(), k.half(), torch.tensor([3900]), torch.tensor([3900]))
        assert all(torch.isfinite(t).all() for t in out)

    def test_matches_torchscale_xpos(self):
        xpos_module = pytest.importorskip("torchscale.component.xpos_relative_position")
        n, dh = 12, DH
        q, k = torch.randn(2, B * H, n, dh).unbind(0)               # torchscale: [B * H, N, Dh]
        theirs = xpos_module.XPOS(dh, scale_base=512)
        ts_q, ts_k = theirs(q), theirs(k, downscale=True)
        ours = XPosPositionalEmbedding(dh, interleaved=True)
        our_q, our_k = ours(q, k)
        # torchscale centres the exponent at c = ceil(N / 2): q' * zeta ** (-c / 512), k' * zeta ** (c / 512)
        c = -(-n // 2)
        zeta = ((torch.arange(0, dh, 2) / dh + 0.4) / 1.4).repeat_interleave(2)
        torch.testing.assert_close(our_q * zeta ** (-c / 512), ts_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(our_k * zeta ** (c / 512), ts_k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(our_q @ our_k.transpose(-1, -2), ts_q @ ts_k.transpose(-1, -2), rtol=1e-5, atol=1e-5)

    def test_matches_rotary_embedding_torch_xpos(self):
        ret = pytest.importorskip("rotary_embedding_torch")
        q, k, _ = qkv(dtype=torch.float32)
        theirs = ret.RotaryEmbedding(DH, use_xpos=True, xpos_scale_base=512)
        ret_q, ret_k = theirs.rotate_queries_and_keys(q, k)
        ours = XPosPositionalEmbedding(DH, interleaved=True)
        our_q, our_k = ours(q, k)
        c = N // 2     # rotary-embedding-torch centres at N // 2
        zeta = ((torch.arange(0, DH, 2) / DH + 0.4) / 1.4).repeat_interleave(2)
        torch.testing.assert_close(our_q * zeta ** (-c / 512), ret_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(our_k * zeta ** (c / 512), ret_k, rtol=1e-5, atol=1e-6)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: dim must be a positive even int, got dim=7"):
            XPosPositionalEmbedding(7)
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: gamma must be a finite number > 0.0, got gamma=0"):
            XPosPositionalEmbedding(8, gamma=0)
        with pytest.raises(ValueError, match="XPosPositionalEmbedding: scale_base must be .*got scale_base=-1"):
            XPosPositionalEmbedding(8, scale_base=-1)
        with pytest.raises(TypeError, match="XPosPositionalEmbedding: interleaved must be a bool, got str 'false'"):
            XPosPositionalEmbedding(8, interleaved="false")
        with pytest.raises(ValueError, match=r"XPosPositionalEmbedding: q and k must be \[\.\.\., H, N, Dh=8\], got"):
            XPosPositionalEmbedding(8)(*qkv()[:2])
        assert XPosPositionalEmbedding(__import__("numpy").int64(8)).dim == 8 if _has_numpy() else True

    def test_xpos_offset_must_be_an_int(self):
        q = k = torch.randn(1, 2, 3, 8)
        with pytest.raises(TypeError, match="XPosPositionalEmbedding: offset must be an int, got str '1'"):
            XPosPositionalEmbedding(8)(q, k, offset="1")


# ---------------------------------------------------------------------------
# Query temperature (Llama 4's NoPE layers)
# ---------------------------------------------------------------------------

LLAMA4_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                   interleave_moe_layer_step=2, no_rope_layer_interval=2, floor_scale=2, attn_scale=0.5,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8})
SMOLLM3_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    no_rope_layers=[1, 0, 1, 1, 0, 1])


def tiny_causal_lm(config_name: str, model_name: str, **fields) -> tuple:
    """A transformers causal LM with a tiny config, random weights and eager attention: ``(config, model, its
    modeling module, token ids [2, 10], the model's own logits for them)``."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    ids = torch.randint(3, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return config, model, sys.modules[type(model).__module__], ids, model(input_ids=ids).logits


def logits_with_our_rope(model, modeling, function: str, encodings: list, seq_dim: int, ids: torch.Tensor) -> tuple:
    """The model's logits with ``modeling.<function>(q, k, ...)`` replaced by ``encodings[layer]`` on q and k,
    and the layers that called it."""
    attentions = [layer.self_attn for layer in model.model.layers]
    current, called = {}, []
    hooks = [attn.register_forward_pre_hook(lambda module, args: current.__setitem__("layer", module.layer_idx))
             for attn in attentions]

    def rotate(q, k, *rest, **kwargs):
        called.append(current["layer"])
        pe = encodings[current["layer"]]
        return pe(q, seq_dim=seq_dim), pe(k, seq_dim=seq_dim)
    original = getattr(modeling, function)
    setattr(modeling, function, rotate)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits, sorted(set(called))
    finally:
        setattr(modeling, function, original)
        for hook in hooks:
            hook.remove()


class TestQueryTemperature:
    """Llama 4's query temperature: the formula at its published defaults, and inside the model."""

    def test_the_factor(self):
        temperature = QueryTemperaturePositionalEmbedding()                                # Llama 4's 8192, 0.1
        positions = torch.tensor([0, 8190, 8191, 16382, 16383, 131071])
        want = [1 + 0.1 * math.log(1 + math.floor((p + 1) / 8192)) for p in positions.tolist()]
        torch.testing.assert_close(temperature.factor(positions, torch.float64), torch.tensor(want, dtype=torch.float64))
        assert temperature.factor(positions)[:2].tolist() == [1.0, 1.0]                     # flat up to 8190
        ministral = QueryTemperaturePositionalEmbedding(length=16, scale=0.1, shift=0)
        assert ministral.factor(torch.tensor([15, 16])).tolist() == [1.0, pytest.approx(1 + 0.1 * math.log(2))]

    def test_positions_below_minus_shift_raise(self):
        temperature = QueryTemperaturePositionalEmbedding()                                # Llama 4's: shift 1
        assert temperature.factor(torch.tensor([-1, 0])).tolist() == [1.0, 1.0]           # p + shift = 0: tau = 1
        for bad in (torch.tensor([-2.0]), torch.tensor([0, -5])):                          # -inf / NaN before
            with pytest.raises(ValueError, match=r"^QueryTemperaturePositionalEmbedding: query positions must be "
                                                 r">= -shift = -1 \(below, .*\), got -"):
                temperature.factor(bad)
        with pytest.raises(ValueError, match="QueryTemperaturePositionalEmbedding: positions must be finite"):
            temperature.factor(torch.tensor([float("nan")]))
        q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        with pytest.raises(ValueError, match="query positions must be >= -shift = 0 .*, got -1"):
            QueryTemperaturePositionalEmbedding(shift=0)(q, k, positions_q=torch.tensor([-1, 0, 1]))
        shifted = QueryTemperaturePositionalEmbedding(length=2.0, scale=0.5)(q, k, positions_q=torch.tensor([-1, 0, 1]))
        torch.testing.assert_close(shifted[0], q * torch.tensor([1.0, 1.0, 1 + 0.5 * math.log(2)])[:, None])

    def test_keys_unchanged_and_queries_at_the_last_positions(self):
        temperature = QueryTemperaturePositionalEmbedding(length=4.0, scale=0.5)
        q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 10, 8)                          # decoding: 2 queries
        q2, k2 = temperature(q, k)
        assert torch.equal(k2, k)
        torch.testing.assert_close(q2, q * temperature.factor(torch.arange(8, 10))[:, None])

    def test_matches_llama4_nope_layers(self):
        # Llama 4's NoPE layers scale q inside the attention; switched off there, our encoding on the q_proj
        # output gives the same logits (positions: arange(N), as the model's without a cache)
        config, model, modeling, ids, want = tiny_causal_lm("Llama4TextConfig", "Llama4ForCausalLM", **LLAMA4_TINY)
        encodings = layer_encodings(config)
        hooks = []
        for layer, pe in zip(model.model.layers, encodings):
            if isinstance(pe, QueryTemperaturePositionalEmbedding):
                layer.self_attn.attn_temperature_tuning = False
                hooks.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, pe=pe: pe(out, out)[0]))
        got, _ = logits_with_our_rope(model, modeling, "apply_rotary_emb", encodings, -3, ids)
        for hook in hooks:
            hook.remove()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        without, _ = logits_with_our_rope(model, modeling, "apply_rotary_emb", encodings, -3, ids)
        assert (without - want).abs().max() > 1e-4                                         # the temperature matters


# ---------------------------------------------------------------------------
# PoPE (polar coordinates)
# ---------------------------------------------------------------------------


def pope_oracle(q, k, positions_q, positions_k, delta, base=10000.0):
    """The paper's logit, one (query, key, channel) at a time in float64:
    sum_c softplus(q_c) softplus(k_c) cos((s - t) theta_c + delta_c) / sqrt(Dh); q, k [H, N, Dh], delta [H, Dh]."""
    heads, dh = q.shape[0], q.shape[-1]
    mq, mk = F.softplus(q.double()), F.softplus(k.double())
    out = torch.zeros(heads, len(positions_q), len(positions_k), dtype=torch.float64)
    for h in range(heads):
        for i, t in enumerate(positions_q):
            for j, s_ in enumerate(positions_k):
                out[h, i, j] = sum(mq[h, i, c] * mk[h, j, c] * math.cos((s_ - t) * base ** (-c / dh) + float(delta[h, c]))
                                   for c in range(dh))
    return out / math.sqrt(dh)


class TestPolar:
    def test_matches_loop_oracle(self):
        pope = PolarPositionalEmbedding(6, 2, base=50.0, phase_init="uniform").double()
        q, k = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
        pos_q, pos_k = [7, 3, 100, -2], [0, 9, 4, 4, 55]
        want = pope_oracle(q, k, pos_q, pos_k, pope.delta.detach(), base=50.0)
        got = pope.forward_attn(q, k, torch.tensor(pos_q), torch.tensor(pos_k))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        default = pope.forward_attn(q, k)                                               # keys 0..4, queries 1..4
        torch.testing.assert_close(default, pope_oracle(q, k, [1, 2, 3, 4], range(5), pope.delta.detach(), 50.0),
                                   rtol=1e-12, atol=1e-12)

    def test_matches_x_transformers(self):
        xt = pytest.importorskip("x_transformers.x_transformers")
        theirs = xt.PolarEmbedding(DH, H)
        with torch.no_grad():  # bias_uniform_init=True fails in 2.31.10 (an in-place init of a leaf that requires grad)
            theirs.learned_bias.uniform_(-2 * math.pi, 0.0)
        ours = PolarPositionalEmbedding(DH, H)
        with torch.no_grad():
            ours.delta.copy_(theirs.learned_bias[:, 0])                                 # [H, 1, Dh] -> [H, Dh]
        q, k = torch.randn(B, H, 24, DH), torch.randn(B, H, 24, DH)
        freqs, bias = theirs(torch.arange(24))
        our_q, our_k = ours(q, k)
        torch.testing.assert_close(our_q, xt.apply_polar_pos_emb(q, freqs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(our_k, xt.apply_polar_pos_emb(k, freqs + bias), rtol=1e-5, atol=1e-5)

    def test_phase_bias_is_clamped_and_learned(self):
        pope = PolarPositionalEmbedding(DH, H)
        assert torch.equal(pope.delta, torch.zeros(H, DH))                              # x-transformers' init
        with torch.no_grad():
            pope.delta.fill_(-10.0)                                                     # below -2 pi: clamped
        q, k = torch.randn(1, H, 5, DH), torch.randn(1, H, 5, DH)
        clamped = PolarPositionalEmbedding(DH, H)
        with torch.no_grad():
            clamped.delta.fill_(-2 * math.pi)
        torch.testing.assert_close(pope.forward_attn(q, k), clamped.forward_attn(q, k))
        inside = PolarPositionalEmbedding(DH, H, phase_init="uniform")
        assert inside.delta.min() >= -2 * math.pi and inside.delta.max() <= 0
        inside.forward_attn(q, k).sum().backward()
        assert inside.delta.grad is not None and inside.delta.grad.abs().sum() > 0
        without = PolarPositionalEmbedding(DH, H, phase_bias=False)
        assert without.delta is None and not list(without.parameters())
        torch.testing.assert_close(without.forward_attn(q, k), PolarPositionalEmbedding(DH, H).forward_attn(q, k))

    def test_content_cannot_turn_the_phase(self):
        """Flipping the sign of q's channels changes magnitudes only: with one channel, the logit's sign
        is that of cos((s - t) theta + delta) whatever the content (RoPE's turns with the content)."""
        pope = PolarPositionalEmbedding(2, 1, base=10.0, phase_bias=False)
        q, k = torch.randn(1, 1, 9, 2), torch.randn(1, 1, 9, 2)
        q[..., 1:], k[..., 1:] = -50.0, -50.0                                           # channel 1 off (softplus ~ 0)
        signs = pope.forward_attn(q, k).sign()
        distance = torch.arange(9)[None, :] - torch.arange(9)[:, None]
        assert torch.equal(signs[0, 0], torch.cos(distance.double()).sign().float())

    def test_width_doubles_and_decoding_matches_the_full_pass(self):
        pope = PolarPositionalEmbedding(DH, H, phase_init="uniform")
        q, k = torch.randn(1, H, 10, DH), torch.randn(1, H, 10, DH)
        full_q, full_k = pope(q, k)
        assert full_q.shape == (1, H, 10, 2 * DH) and full_k.shape == (1, H, 10, 2 * DH)
        for t in (0, 4, 9):
            step_q, step_k = pope(q[..., t : t + 1, :], k[..., t : t + 1, :], offset=t)
            torch.testing.assert_close(step_q, full_q[..., t : t + 1, :])
            torch.testing.assert_close(step_k, full_k[..., t : t + 1, :])

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="PolarPositionalEmbedding: phase_init"):
            PolarPositionalEmbedding(DH, H, phase_init="normal")
        with pytest.raises(TypeError, match="PolarPositionalEmbedding: phase_bias must be a bool"):
            PolarPositionalEmbedding(DH, H, phase_bias="zeros")
        pope = PolarPositionalEmbedding(DH, H)
        with pytest.raises(ValueError, match="PolarPositionalEmbedding: q"):
            pope(torch.randn(1, H + 1, 4, DH), torch.randn(1, H + 1, 4, DH))


# ---------------------------------------------------------------------------
# FoPE
# ---------------------------------------------------------------------------


def fope_oracle(x, positions, cos_coef, sin_coef, train_length, base, padded, num_frequencies=None):
    """FoPE in float64, pair by pair: frequencies base^(-2i/Dh) at least 2 pi / train_length (or, as vLLM's
    num_inv_freq, the first num_frequencies), pair p of head h turned by C = sum_d A[h, d, p] cos(w_d m) and
    S = sum_d B[h, d, p] sin(w_d m); later pairs by C = 1 and S = 0 (or 1 when padded="ones"). x: [H, N, Dh]."""
    heads, n, dh = x.shape
    freqs = [base ** (-2 * i / dh) for i in range(dh // 2)]
    freqs = freqs[:num_frequencies] if num_frequencies is not None else \
        [w for w in freqs if w >= 2 * math.pi / train_length]
    pairs = cos_coef.shape[-1]
    out = torch.empty(heads, n, dh, dtype=torch.float64)
    for h in range(heads):
        for t, m in enumerate(positions):
            for p in range(dh // 2):
                if p < pairs:
                    c = sum(float(cos_coef[h, d, p]) * math.cos(w * m) for d, w in enumerate(freqs))
                    s = sum(float(sin_coef[h, d, p]) * math.sin(w * m) for d, w in enumerate(freqs))
                else:
                    c, s = 1.0, (1.0 if padded == "ones" else 0.0)
                a, b = float(x[h, t, p]), float(x[h, t, p + dh // 2])
                out[h, t, p], out[h, t, p + dh // 2] = a * c - b * s, b * c + a * s
    return out


class TestFoPE:
    @pytest.mark.parametrize("num_pairs, padded", [(None, "identity"), (None, "ones"), (2, "ones"), (3, "identity")])
    def test_matches_loop_oracle(self, num_pairs, padded):
        pe = FoPEPositionalEmbedding(16, 2, train_length=300, base=100.0, num_pairs=num_pairs, padded=padded).double()
        assert pe.num_frequencies == 7                                                  # 100^(-14/16) < 2 pi / 300
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        positions = [0, 3, 17, 250, 4000]
        want = fope_oracle(x, positions, pe.cos_coef, pe.sin_coef, 300, 100.0, padded)
        torch.testing.assert_close(pe(x, torch.tensor(positions)), want, rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("count", [1, 5, 8])
    def test_the_number_of_kept_frequencies_is_vllms_num_inv_freq(self, count):
        """num_frequencies=D keeps w_0 .. w_{D-1} (vLLM: inv_freq[:num_inv_freq], input and output dims D, the
        rest C = 1, S = 0), whatever their periods; the same module as the train_length that keeps D."""
        pe = FoPEPositionalEmbedding(16, 2, num_frequencies=count, base=100.0).double()
        assert pe.num_frequencies == count and pe.cos_coef.shape == (2, count, count) and pe.train_length is None
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        positions = [0, 3, 17, 250, 4000]
        want = fope_oracle(x, positions, pe.cos_coef, pe.sin_coef, None, 100.0, "identity", num_frequencies=count)
        torch.testing.assert_close(pe(x, torch.tensor(positions)), want, rtol=1e-12, atol=1e-12)
        if count == 5:   # 100^(-8/16) >= 2 pi / 100 > 100^(-10/16): train_length=100 keeps the same five
            torch.manual_seed(0)
            by_count = FoPEPositionalEmbedding(16, 2, num_frequencies=5, base=100.0)
            torch.manual_seed(0)
            by_length = FoPEPositionalEmbedding(16, 2, train_length=100, base=100.0)
            torch.testing.assert_close(by_count(x.float()), by_length(x.float()), rtol=0, atol=0)

    @pytest.mark.parametrize("learnable", [False, True])
    def test_q_and_k_take_ropes_rotation_compiled_or_not(self, monkeypatch, learnable):
        """Issue 42: FoPE turns q and k in RoPE's one call: eagerly (fixed coefficients: the allocation-free
        function, per-head angles broadcast) or through the library's compiled rotation (a counting
        AOTAutograd backend here), with the same outputs and gradients for q, k and learned coefficients."""
        from torch._dynamo.testing import CompileCounterWithBackend

        fope = FoPEPositionalEmbedding(16, 3, train_length=64, learnable=learnable)
        q, k = (torch.randn(2, 3, 10, 16, requires_grad=True) for _ in range(2))
        leaves = [q, k, fope.cos_coef, fope.sin_coef] if learnable else [q, k]

        def outputs_and_grads():
            out = fope.encode_qk(q, k)
            return [*out, *torch.autograd.grad(sum(o.square().sum() for o in out), leaves)]

        want = outputs_and_grads()
        oracle = [torch.stack([fope_oracle(row.double(), list(range(10)), fope.cos_coef, fope.sin_coef, 64, 10000.0,
                                           "identity") for row in x.detach()]) for x in (q, k)]   # per batch row
        counter = CompileCounterWithBackend("aot_eager")
        fused_rotation_on_cpu(monkeypatch, torch.compile(fresh_rotation_formula(), backend=counter))
        got = outputs_and_grads()
        assert counter.frame_count == 1
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        for g, o in zip(got, oracle):
            torch.testing.assert_close(g.double(), o, rtol=1e-5, atol=1e-5)

    def test_without_noise_or_clipping_it_is_rope(self):
        fope = FoPEPositionalEmbedding(DH, H, train_length=10**6, sigma=0.0)
        assert fope.num_frequencies == DH // 2
        q, k, v = qkv(12, 12)
        torch.testing.assert_close(attention(q, k, v, fope, causal=True),
                                   attention(q, k, v, RotaryPositionalEmbedding(DH), causal=True), rtol=1e-5, atol=1e-6)

    def test_clipped_frequencies_and_the_padded_pairs(self):
        # base 10^4, Dh = 32, L = 512: w_i = 10^(-i/4) >= 2 pi / 512 keeps i <= 7, so 8 of 16 frequencies.
        pe = FoPEPositionalEmbedding(32, 1, train_length=512, sigma=0.0)
        assert pe.num_frequencies == 8 and pe.cos_coef.shape == (1, 8, 8)
        x = torch.randn(1, 6, 32, dtype=torch.float64)
        pe = pe.double()
        out = pe(x, torch.arange(6) * 37)
        free = [*range(8, 16), *range(24, 32)]                                          # the pairs past P
        torch.testing.assert_close(out[..., free], x[..., free], rtol=0, atol=0)       # identity
        ones = FoPEPositionalEmbedding(32, 1, train_length=512, sigma=0.0, padded="ones").double()
        q, k = torch.randn(2, 1, 1, 32, dtype=torch.float64).unbind(0)
        keep = torch.zeros(32, dtype=torch.bool)
        keep[free] = True
        q, k = q * keep, k * keep
        for m in (0, 5, 300):                                                           # twice the dot product
            dot = (ones(q, torch.tensor([m])) * ones(k, torch.tensor([0]))).sum()
            torch.testing.assert_close(dot, 2 * (q * k).sum())

    def test_authors_initialisation(self):
        # eye_xavier_norm: Xavier-normal noise of gain sigma (std sigma sqrt(2 / (D P + H P))) plus 1 on
        # each pair's frequency, i * ceil(D / P); the noise is torch's xavier_normal_ draw (sin, then cos).
        torch.manual_seed(0)
        pe = FoPEPositionalEmbedding(64, 8, train_length=512, num_pairs=16)
        assert pe.num_frequencies == 16 and not pe.cos_coef.requires_grad
        eye = torch.zeros(16, 16)
        eye[torch.arange(16), torch.arange(16)] = 1.0
        noise = torch.cat([pe.cos_coef - eye, pe.sin_coef - eye]).flatten()
        expected = 0.3 * math.sqrt(2 / (16 * 16 + 8 * 16))
        assert abs(noise.std().item() / expected - 1) < 0.05
        torch.manual_seed(0)
        sin_noise = torch.nn.init.xavier_normal_(torch.empty(8, 16, 16), gain=0.3)
        torch.testing.assert_close(pe.sin_coef - eye, sin_noise, rtol=0, atol=1e-7)
        stepped = FoPEPositionalEmbedding(64, 1, train_length=1024, num_pairs=16, sigma=0.0)
        assert stepped.num_frequencies == 18                                           # ceil(18 / 16) = 2
        nonzero = stepped.cos_coef[0].nonzero().tolist()
        assert nonzero == [[2 * i, i] for i in range(9)]                               # pairs 9..15: no frequency
        assert FoPEPositionalEmbedding(DH, H, 64, learnable=True).cos_coef.requires_grad

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: train_length=6 clips every frequency"):
            FoPEPositionalEmbedding(DH, H, 6)
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: num_pairs must be at most"):
            FoPEPositionalEmbedding(DH, H, 512, num_pairs=DH)
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: padded"):
            FoPEPositionalEmbedding(DH, H, 512, padded="zeros")
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: head_dim"):
            FoPEPositionalEmbedding(DH + 1, H, 512)
        with pytest.raises(TypeError, match="FoPEPositionalEmbedding: pass exactly one of train_length .* and "
                                            "num_frequencies .*, got train_length=512 and num_frequencies=4"):
            FoPEPositionalEmbedding(DH, H, 512, num_frequencies=4)
        with pytest.raises(TypeError, match="FoPEPositionalEmbedding: pass exactly one of train_length"):
            FoPEPositionalEmbedding(DH, H)
        with pytest.raises(ValueError, match=f"FoPEPositionalEmbedding: num_frequencies must be at most head_dim // 2 "
                                             f"= {DH // 2}, got num_frequencies={DH // 2 + 1}"):
            FoPEPositionalEmbedding(DH, H, num_frequencies=DH // 2 + 1)
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: sigma"):
            FoPEPositionalEmbedding(DH, H, 512, sigma=-1.0)
        with pytest.raises(ValueError, match="FoPEPositionalEmbedding: q"):
            attention(*qkv(dh=DH + 2), FoPEPositionalEmbedding(DH, H, 512), causal=True)


# ---------------------------------------------------------------------------
# Algebraic: sequences
# ---------------------------------------------------------------------------


def random_rotations(*shape, dtype=torch.float64):
    """Special orthogonal matrices matrix_exp(P - P^T) with random P: [*shape[:-1], n, n]."""
    p = torch.randn(*shape, shape[-1], dtype=dtype)
    return torch.matrix_exp(p - p.mT)


def orthogonality_error(w):
    return (w @ w.mT - torch.eye(w.shape[-1], dtype=w.dtype)).abs().max().item()


def train_a_few_steps(pe, case_positions):
    optimiser = torch.optim.AdamW(pe.parameters(), lr=0.05)
    for _ in range(5):
        q, k = torch.randn(2, H, N, DH), torch.randn(2, H, N, DH)
        loss = pe.forward_attn(q, k, *case_positions).logsumexp(-1).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()


def sequence_oracle(w, q, k, pos_q, pos_k):
    """scores[h, i, j] = q_i^T W_h^(r_j - p_i) k_j, with explicit matrix powers in float64."""
    out = torch.zeros(w.shape[0], len(pos_q), len(pos_k), dtype=torch.float64)
    for h in range(w.shape[0]):
        for i, p in enumerate(pos_q):
            for j, r in enumerate(pos_k):
                out[h, i, j] = q[h, i] @ torch.linalg.matrix_power(w[h], r - p) @ k[h, j]
    return out


class TestAlgebraicSequence:
    def test_scores_equal_rope_at_init(self):
        ape, rope = AlgebraicSequencePositionalEmbedding(DH, H), RotaryPositionalEmbedding(DH)
        q, k, _ = qkv()
        torch.testing.assert_close(ape.forward_attn(q, k), rope.forward_attn(q, k), rtol=1e-5, atol=1e-5)
        assert (ape.basis_generator == 0).all()

    def test_primitives_orthogonal_before_and_after_training(self):
        ape = AlgebraicSequencePositionalEmbedding(DH, H)
        assert orthogonality_error(ape.primitives) < 1e-5
        before = ape.primitives.detach().clone()
        train_a_few_steps(ape, (None, None))
        assert orthogonality_error(ape.primitives) < 1e-5
        assert (ape.primitives - before).abs().max() > 1e-3        # training moved them

    def test_matches_matrix_power_oracle_after_set_primitives(self):
        ape = AlgebraicSequencePositionalEmbedding(8, 2).double()
        w = random_rotations(2, 8)
        ape.set_primitives(w)
        torch.testing.assert_close(ape.primitives, w, rtol=0, atol=1e-10)
        q, k = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
        pos_q, pos_k = [3, 0, 7, 2, 11], [0, 1, 5, 9, 4, 2]
        got = ape.forward_attn(q, k, torch.tensor(pos_q), torch.tensor(pos_k), scale=1.0)
        torch.testing.assert_close(got[0], sequence_oracle(w, q[0], k[0], pos_q, pos_k))

    def test_forward_applies_w_to_the_power_p(self):
        ape = AlgebraicSequencePositionalEmbedding(6, 1).double()
        w = random_rotations(1, 6)
        ape.set_primitives(w)
        x = torch.randn(1, 4, 6, dtype=torch.float64)
        got = ape(x, offset=3)
        for i, p in enumerate(range(3, 7)):
            torch.testing.assert_close(got[0, i], torch.linalg.matrix_power(w[0], p) @ x[0, i])

    def test_scores_depend_only_on_distance(self):
        ape = AlgebraicSequencePositionalEmbedding(8, 2).double()
        ape.set_primitives(random_rotations(2, 8))
        q, k = torch.randn(1, 2, 1, 8, dtype=torch.float64), torch.randn(1, 2, 1, 8, dtype=torch.float64)
        scores = [ape.forward_attn(q, k, torch.tensor([p]), torch.tensor([p + 4])) for p in (0, 9, 1000)]
        torch.testing.assert_close(scores[1], scores[0])
        torch.testing.assert_close(scores[2], scores[0])

    def test_set_primitives_handles_repeated_and_trivial_angles(self):
        ape = AlgebraicSequencePositionalEmbedding(6, 3).double()
        rotation_pi = torch.block_diag(-torch.eye(2), torch.eye(4)).double()            # angles pi, 0, 0
        w = torch.stack([torch.eye(6, dtype=torch.float64), rotation_pi, random_rotations(1, 6)[0]])
        ape.set_primitives(w)
        torch.testing.assert_close(ape.primitives, w, rtol=0, atol=1e-10)

    def test_rejects_non_orthogonal_and_reflections(self):
        ape = AlgebraicSequencePositionalEmbedding(4, 1)
        with pytest.raises(ValueError, match="AlgebraicSequencePositionalEmbedding: every primitive must be orthogonal"):
            ape.set_primitives(torch.randn(1, 4, 4))
        with pytest.raises(ValueError, match="determinant \\+1"):
            ape.set_primitives(torch.diag(torch.tensor([1.0, 1.0, 1.0, -1.0]))[None])
        with pytest.raises(ValueError, match="primitives must have shape \\[1, 4, 4\\], got \\[2, 4, 4\\]"):
            ape.set_primitives(random_rotations(2, 4))

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="head_dim must be divisible by 2 \\* num_axes = 2 .*got head_dim=7"):
            AlgebraicSequencePositionalEmbedding(7, 2)
        with pytest.raises(ValueError, match="x must be \\[..., H=2, N, Dh=8\\]"):
            AlgebraicSequencePositionalEmbedding(8, 2)(torch.randn(1, 3, 5, 8))

    @pytest.mark.parametrize("cls", [AlgebraicSequencePositionalEmbedding, AlgebraicTreePositionalEmbedding])
    def test_float32_checkpoint_loads_accurately_at_position_1000(self, cls):
        # RoPE-like primitives (the reference's initialisation: many angles near 0, nearly repeated
        # eigenvalues of W + W^T) in a random basis; rounding them to float32 used to cost 1.3e-4 here
        dh = 32
        theta = torch.tensor([10000.0 ** (-2 * i / dh) for i in range(dh // 2)], dtype=torch.float64)
        basis = random_rotations(2, dh)
        w = basis @ torch.block_diag(*[torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]],
                                                    dtype=torch.float64) for t in theta.tolist()]) @ basis.mT
        q, k = torch.randn(1, 2, 1, dh, dtype=torch.float64), torch.randn(1, 2, 1, dh, dtype=torch.float64)
        if cls is AlgebraicSequencePositionalEmbedding:
            pe = cls(dh, 2).double()
            pe.set_primitives(w.float())                                                # a float32 checkpoint
            got = pe.forward_attn(q, k, torch.tensor([0]), torch.tensor([1000]), scale=1.0)[0, :, 0, 0]
            want = sequence_oracle(w, q[0], k[0], [0], [1000])[:, 0, 0]
        else:  # 10 levels of branch 0 then branch 1 alternately: the node's map is a product of 10 primitives
            pe = cls(dh, 2, branching_factor=2, max_depth=10).double()
            pe.set_primitives(w.float()[None].expand(2, -1, -1, -1))
            node = pe.node_ids_from_paths([[0, 1] * 5])
            got = pe.forward_attn(q, k, torch.tensor([0]), node, scale=1.0)[0, :, 0, 0]
            want = torch.stack([q[0, h, 0] @ tree_map_oracle(w[None, h].expand(2, -1, -1), int(node), 2)
                                @ k[0, h, 0] for h in range(2)])
        scale = q.norm(dim=-1).flatten() * k.norm(dim=-1).flatten()
        assert ((got - want).abs() / scale).max() < 1e-5
        assert orthogonality_error(pe.primitives.double()) < 1e-12

    def test_set_primitives_rejects_nan_inf_and_non_orthogonal(self):
        ape = AlgebraicSequencePositionalEmbedding(4, 1)
        w = random_rotations(1, 4).float()
        for bad in (float("nan"), float("inf")):
            broken = w.clone()
            broken[0, 1, 2] = bad
            with pytest.raises(ValueError, match="AlgebraicSequencePositionalEmbedding: primitives must be finite, "
                                                 "got 1 NaN or infinite entries"):
                ape.set_primitives(broken)
        with pytest.raises(ValueError, match="every primitive must be orthogonal .*got max \\|W W\\^T - I\\| = "):
            ape.set_primitives(w * 1.001)
        tree = AlgebraicTreePositionalEmbedding(4, 1, branching_factor=2, max_depth=2)
        with pytest.raises(ValueError, match="AlgebraicTreePositionalEmbedding: primitives must be finite"):
            tree.set_primitives(torch.full((2, 1, 4, 4), float("nan")))


# ---------------------------------------------------------------------------
# Algebraic: grids
# ---------------------------------------------------------------------------


class TestAlgebraicGrid:
    def test_matches_blockwise_matrix_power_oracle(self):
        grid = AlgebraicGridPositionalEmbedding(8, 2, num_axes=2).double()
        w = random_rotations(2, 2, 4)                                                   # [A, H, 4, 4]
        grid.set_primitives(w)
        torch.testing.assert_close(grid.primitives, w, rtol=0, atol=1e-10)
        pos_q = torch.tensor([[0, 0], [2, 5], [1, 3]])
        pos_k = torch.tensor([[4, 1], [0, 0], [3, 3], [1, 7]])
        q, k = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 2, 4, 8, dtype=torch.float64)
        got = grid.forward_attn(q, k, pos_q, pos_k, scale=1.0)
        for h in range(2):
            for i in range(3):
                for j in range(4):
                    blocks = [torch.linalg.matrix_power(w[a, h], int(pos_k[j, a] - pos_q[i, a])) for a in range(2)]
                    want = q[0, h, i] @ torch.block_diag(*blocks) @ k[0, h, j]
                    assert got[0, h, i, j].item() == pytest.approx(want.item(), abs=1e-10)

    def test_queries_and_keys_use_their_own_positions(self):
        grid = AlgebraicGridPositionalEmbedding(8, 1).double()
        grid.set_primitives(random_rotations(2, 1, 4))
        q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
        at = lambda pq, pk: grid.forward_attn(q, k, torch.tensor([pq]), torch.tensor([pk]))
        torch.testing.assert_close(at([1, 2], [4, 9]), at([11, 7], [14, 14]))          # same per-axis differences
        assert not torch.allclose(at([1, 2], [4, 9]), at([1, 2], [9, 4]))

    def test_three_axes_volume(self):
        volume = AlgebraicGridPositionalEmbedding(12, 2, num_axes=3)
        assert volume.primitives.shape == (3, 2, 4, 4)
        positions = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(3), indexing="ij"), -1)
        assert volume(torch.randn(1, 2, 12, 12), positions.reshape(12, 3)).shape == (1, 2, 12, 12)

    def test_orthogonal_after_training(self):
        grid = AlgebraicGridPositionalEmbedding(DH, H)
        positions = torch.stack([torch.arange(N) // 4, torch.arange(N) % 4], -1)
        train_a_few_steps(grid, (positions, positions))
        assert orthogonality_error(grid.primitives) < 1e-5

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="head_dim must be divisible by 2 \\* num_axes = 6"):
            AlgebraicGridPositionalEmbedding(8, 2, num_axes=3)
        grid = AlgebraicGridPositionalEmbedding(8, 2)
        with pytest.raises(ValueError, match="positions must have shape \\[5, 2\\]"):
            grid(torch.randn(1, 2, 5, 8), torch.zeros(5, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="positions is required for 2 axes"):
            grid(torch.randn(1, 2, 5, 8))


# ---------------------------------------------------------------------------
# Algebraic: trees
# ---------------------------------------------------------------------------


def tree_map_oracle(w, node, b):
    """M(node) for breadth-first ids: M(root) = I, M(child c of n) = M(n) @ W_c (float64 loop)."""
    path = []
    while node > 0:
        path.append((node - 1) % b)
        node = (node - 1) // b
    m = torch.eye(w.shape[-1], dtype=torch.float64)
    for branch in reversed(path):
        m = m @ w[branch]
    return m


def ape_reference_node_map(w, path):
    """konstantinosKokos/ape ``Branching.embed_positions`` for one node, as plain loops in float64:
    ``maps = I`` then, step by step from the root, ``maps = linear(maps, W_branch) = maps @ W_branch^T``."""
    n = w.shape[-1]
    m = [[float(r == c) for c in range(n)] for r in range(n)]
    for branch in path:
        wt = w[branch].tolist()
        m = [[sum(m[r][t] * wt[c][t] for t in range(n)) for c in range(n)] for r in range(n)]
    return torch.tensor(m, dtype=torch.float64)


def ape_reference_score(w, q, k, path_q, path_k):
    """The reference's score: queries and keys mapped by ``einsum('bqBh,bqhAB->bqAh')`` (M x), then dotted."""
    mq, mk = ape_reference_node_map(w, path_q), ape_reference_node_map(w, path_k)
    q2 = [sum(mq[a, b].item() * q[b].item() for b in range(len(q))) for a in range(len(q))]
    k2 = [sum(mk[a, b].item() * k[b].item() for b in range(len(k))) for a in range(len(k))]
    return sum(x * y for x, y in zip(q2, k2))


class TestAlgebraicTree:
    def test_matches_path_product_oracle(self):
        tree = AlgebraicTreePositionalEmbedding(6, 2, branching_factor=3, max_depth=3).double()
        w = random_rotations(3, 2, 6)                                                   # [b, H, 6, 6]
        tree.set_primitives(w)
        torch.testing.assert_close(tree.primitives, w, rtol=0, atol=1e-10)
        nodes_q, nodes_k = [0, 5, 17, 39], [3, 0, 12, 17, 2]
        q, k = torch.randn(1, 2, 4, 6, dtype=torch.float64), torch.randn(1, 2, 5, 6, dtype=torch.float64)
        got = tree.forward_attn(q, k, torch.tensor(nodes_q), torch.tensor(nodes_k), scale=1.0)
        for h in range(2):
            for i, n in enumerate(nodes_q):
                for j, m in enumerate(nodes_k):
                    mq, mk = tree_map_oracle(w[:, h], n, 3), tree_map_oracle(w[:, h], m, 3)
                    want = q[0, h, i] @ mq.T @ mk @ k[0, h, j]
                    assert got[0, h, i, j].item() == pytest.approx(want.item(), abs=1e-10)

    def test_scores_depend_only_on_the_path(self):
        tree = AlgebraicTreePositionalEmbedding(8, 1, branching_factor=2, max_depth=6).double()
        q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
        at = lambda a, b: tree.forward_attn(q, k, tree.node_ids_from_paths([a]), tree.node_ids_from_paths([b]))
        # the same two steps (up one, down branch 1) from different ancestors
        torch.testing.assert_close(at([0], [1]), at([1, 1, 0], [1, 1, 1]))
        torch.testing.assert_close(at([0, 1], [0, 0, 1]), at([1, 0, 1, 1], [1, 0, 1, 0, 1]))
        assert not torch.allclose(at([0], [1]), at([1], [0]))

    def test_node_id_helpers(self):
        tree = AlgebraicTreePositionalEmbedding(4, 1, branching_factor=2, max_depth=4)
        assert tree.node_ids_from_paths([[], [0], [1], [0, 1], [1, 1, 0]]).tolist() == [0, 1, 2, 4, 13]
        #        0            parents: node 1 and 2 are children of 0, node 3 child of 2, node 4 child of 3
        #       / \
        #      1   2
        #          |
        #          3 - 4
        assert tree.node_ids_from_parents([-1, 0, 0, 2, 3]).tolist() == [0, 1, 2, 5, 11]
        with pytest.raises(ValueError, match="more than branching_factor=2 children"):
            tree.node_ids_from_parents([-1, 0, 0, 0])
        with pytest.raises(ValueError, match="exactly one root"):
            tree.node_ids_from_parents([-1, -1])

    def test_orthogonal_after_training(self):
        tree = AlgebraicTreePositionalEmbedding(DH, H, branching_factor=2, max_depth=5)
        assert orthogonality_error(tree.primitives) < 1e-5
        train_a_few_steps(tree, (None, None))
        assert orthogonality_error(tree.primitives) < 1e-5

    def test_any_number_of_leading_dims(self):
        tree = AlgebraicTreePositionalEmbedding(8, 2, branching_factor=2, max_depth=4).double()
        x = torch.randn(3, 2, 2, 6, 8, dtype=torch.float64)
        nodes = torch.tensor([0, 3, 4, 9, 2, 1])
        want = torch.stack([tree(x[i], nodes) for i in range(3)])
        torch.testing.assert_close(tree(x, nodes), want)
        torch.testing.assert_close(tree(x[0, 0], nodes), want[0, 0])

    def test_bad_nodes(self):
        tree = AlgebraicTreePositionalEmbedding(4, 1, branching_factor=2, max_depth=2)
        x = torch.randn(1, 1, 2, 4)
        with pytest.raises(ValueError, match="node ids must lie in \\[0, 6\\] \\(depth <= max_depth=2 of a 2-ary tree\\), got 7"):
            tree(x, torch.tensor([0, 7]))
        with pytest.raises(ValueError, match="got -1"):
            tree(x, torch.tensor([-1, 0]))
        with pytest.raises(TypeError, match="positions must be an integer tensor .*got dtype=torch.float32"):
            tree(x, torch.tensor([0.0, 1.0]))

    def test_tree_reference_convention_equals_reference_path_products(self):
        b, heads, dh = 2, 2, 4
        tree = AlgebraicTreePositionalEmbedding(dh, heads, branching_factor=b, max_depth=3).double()
        p = torch.randn(b, heads, dh, dh, dtype=torch.float64)
        w_ref = torch.matrix_exp(p - p.mT)                                              # the reference's primitives
        paths_q, paths_k = [[], [1], [0, 1], [1, 1, 0]], [[0], [], [1, 0, 1], [0, 0], [1]]
        q, k = torch.randn(1, heads, 4, dh, dtype=torch.float64), torch.randn(1, heads, 5, dh, dtype=torch.float64)
        nodes_q, nodes_k = tree.node_ids_from_paths(paths_q), tree.node_ids_from_paths(paths_k)
        want = torch.tensor([[[ape_reference_score(w_ref[:, h], q[0, h, i], k[0, h, j], pq, pk)
                               for j, pk in enumerate(paths_k)] for i, pq in enumerate(paths_q)]
                             for h in range(heads)], dtype=torch.float64)
        tree.set_primitives(w_ref, convention="reference")
        got = tree.forward_attn(q, k, nodes_q, nodes_k, scale=1.0)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        tree.set_primitives(w_ref)                                                      # the paper's convention
        wrong = tree.forward_attn(q, k, nodes_q, nodes_k, scale=1.0)[0]
        assert (wrong - want).abs().max() > 0.1                                         # transposed: not the reference
        with pytest.raises(ValueError, match="AlgebraicTreePositionalEmbedding: convention must be one of 'paper', "
                                             "'reference', got convention='ref'"):
            tree.set_primitives(w_ref, convention="ref")

    def test_node_ids_from_paths_rejects_non_integer_steps(self):
        tree = AlgebraicTreePositionalEmbedding(4, 1, branching_factor=2, max_depth=3)
        for bad in (1.5, 1.0, True, "1", torch.tensor(1.0)):
            with pytest.raises(TypeError, match="AlgebraicTreePositionalEmbedding: paths must hold integer branch "
                                                "indices, got .* in path"):
                tree.node_ids_from_paths([[0], [bad]])
        assert tree.node_ids_from_paths([[torch.tensor(1), 0]]).tolist() == [5]
        empty = tree.node_ids_from_paths([])
        assert empty.dtype == torch.long and empty.numel() == 0


# ---------------------------------------------------------------------------
# rope_coordinates (DINOv3)
# ---------------------------------------------------------------------------


def dinov3_coords(h, w, normalize, shift=None, jitter=None, rescale=None):
    """facebookresearch/dinov3 RopePositionEmbedding.forward's coordinates (ported, float32, training)."""
    dd = {"dtype": torch.float32}
    if normalize == "max":
        coords_h, coords_w = torch.arange(0.5, h, **dd) / max(h, w), torch.arange(0.5, w, **dd) / max(h, w)
    elif normalize == "min":
        coords_h, coords_w = torch.arange(0.5, h, **dd) / min(h, w), torch.arange(0.5, w, **dd) / min(h, w)
    else:
        coords_h, coords_w = torch.arange(0.5, h, **dd) / h, torch.arange(0.5, w, **dd) / w
    coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"), dim=-1).flatten(0, 1)
    coords = 2.0 * coords - 1.0
    if shift is not None:
        coords += torch.empty(2, **dd).uniform_(-shift, shift)[None, :]
    if jitter is not None:
        coords *= torch.empty(2, **dd).uniform_(-math.log(jitter), math.log(jitter)).exp()[None, :]
    if rescale is not None:
        coords *= torch.empty(1, **dd).uniform_(-math.log(rescale), math.log(rescale)).exp()
    return coords


def cape_oracle(positions: torch.Tensor, seed: int, shift: float, local_shift: float, scaling: float) -> torch.Tensor:
    """CAPE on one-axis positions ``[B, N]``, entry by entry in float64: ``lambda_b (p_bi + delta_b + eps_bi)``, the
    draws taken as the PyTorch port of CAPE takes them (float32, in this order: delta ``[B, 1]`` from
    ``U(-shift, shift)``, eps ``[B, N]`` from ``U(-local_shift, local_shift)``, log lambda ``[B, 1]``)."""
    g = torch.Generator().manual_seed(seed)
    rows, n = positions.shape
    delta = torch.empty(rows, 1).uniform_(-shift, shift, generator=g).tolist()
    eps = torch.empty(rows, n).uniform_(-local_shift, local_shift, generator=g).tolist()
    log_scale = torch.empty(rows, 1).uniform_(-math.log(scaling), math.log(scaling), generator=g).tolist()
    return torch.tensor([[math.exp(log_scale[b][0]) * (float(positions[b, i]) + delta[b][0] + eps[b][i])
                          for i in range(n)] for b in range(rows)], dtype=torch.float64)


DEVICE_MISTAKES = [(torch.float32, TypeError, "must be a torch.device, a device string or an index, got dtype "
                                                "torch.float32"),
                   ("gpu0", ValueError, "must name a device such as 'cpu' or 'cuda:0', got 'gpu0'"),
                   (True, TypeError, "must be a torch.device, a device string or an index, got bool True")]


class TestRopeCoordinates:
    @pytest.mark.parametrize("device, error, message", DEVICE_MISTAKES)
    def test_device_is_checked(self, device, error, message):
        # .to(torch.float32) took a dtype as the device and cast the coordinates instead
        with pytest.raises(error, match=f"^rope_coordinates: device {re.escape(message)}$"):
            rope_coordinates((2, 3), device=device)
        assert rope_coordinates((2, 3), device="cpu").dtype == torch.float64

    @pytest.mark.parametrize("normalize", ["separate", "max", "min"])
    @pytest.mark.parametrize("augment", [{}, {"shift": 0.1, "jitter": 1.5, "rescale": 2.0}, {"rescale": 1.3}])
    def test_matches_dinov3(self, normalize, augment):
        torch.manual_seed(5)
        want = dinov3_coords(3, 5, normalize, **augment)
        torch.manual_seed(5)
        got = rope_coordinates((3, 5), normalize=normalize, **augment)
        assert got.dtype == torch.float64 and got.shape == (15, 2)
        torch.testing.assert_close(got, want.double(), rtol=0, atol=1e-6)
        generator = torch.Generator().manual_seed(5)
        torch.testing.assert_close(rope_coordinates((3, 5), normalize=normalize, generator=generator, **augment), got)

    def test_video_and_plain_values(self):
        coords = rope_coordinates((2, 2, 4))
        assert coords.shape == (16, 3)
        torch.testing.assert_close(coords[1], torch.tensor([-0.5, -0.5, -0.25], dtype=torch.float64))
        torch.testing.assert_close(rope_coordinates((4,))[:, 0], torch.tensor([-0.75, -0.25, 0.25, 0.75],
                                                                               dtype=torch.float64))

    def test_feeds_every_multi_axis_rotary(self):
        q, k, v = qkv(dtype=torch.float64)
        p = rope_coordinates((4, 4), jitter=1.2)
        for pe in (RotaryPositionalEmbedding(DH, sections=[8, 8], base=100.0), MixedRotaryPositionalEmbedding(DH, H),
                   LieREPositionalEmbedding(DH, H, block_size=4)):
            out = attention(q, k, v, pe.double(), positions_q=p, positions_k=p)
            assert out.shape == v.shape and torch.isfinite(out).all()

    def test_bad_input(self):
        with pytest.raises(ValueError, match="rope_coordinates: normalize must be one of 'separate', 'max', 'min'"):
            rope_coordinates((2, 2), normalize="mean")
        with pytest.raises(ValueError, match="rope_coordinates: jitter must be a finite number >= 1.0, got jitter=0.5"):
            rope_coordinates((2, 2), jitter=0.5)
        with pytest.raises(ValueError, match="rope_coordinates: grid_shape\\[1\\] must be a positive int, got grid_shape\\[1\\]=0"):
            rope_coordinates((2, 0))
        with pytest.raises(TypeError, match="rope_coordinates: grid_shape\\[1\\] must be an int, got float 2.5"):
            rope_coordinates((2, 2.5))


class TestAugmentPositions:
    def test_cape_matches_the_entry_by_entry_oracle(self):
        positions = torch.arange(12.0).expand(3, 12)
        got = augment_positions(positions, shift=5.0, local_shift=0.5, rescale=1.03,
                                generator=torch.Generator().manual_seed(4))
        assert got.dtype == torch.float64 and got.shape == (3, 12)
        torch.testing.assert_close(got, cape_oracle(positions, 4, 5.0, 0.5, 1.03), rtol=0, atol=1e-12)
        again = augment_positions(positions, shift=5.0, local_shift=0.5, rescale=1.03,
                                  generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(again, got, rtol=0, atol=0)                          # seeded: reproducible

    def test_local_shift_is_the_ports_max_local_shift_times_the_spacing(self):
        # gcambara/cape CAPE1d.augment_positions (HEAD eed7480) on positions of spacing s (its positions_delta),
        # written out: from the global generator, in float32 and in this order, a global shift U(-G, G) [B, 1],
        # a local shift U(-m, m) [B, N] times s, a log scale U(-log L, log L) [B, 1]
        rows, n, s, m, big_g, big_l = 3, 10, 0.25, 0.5, 2.0, 1.1
        positions = torch.arange(n, dtype=torch.float32).expand(rows, n) * s
        torch.manual_seed(7)
        delta = torch.empty(rows, 1).uniform_(-big_g, big_g)
        delta_local = torch.empty(rows, n).uniform_(-m, m) * s
        log_lambdas = torch.empty(rows, 1).uniform_(-math.log(big_l), math.log(big_l))
        want = (positions + delta + delta_local) * torch.exp(log_lambdas)
        torch.manual_seed(7)
        got = augment_positions(positions, shift=big_g, local_shift=m * s, rescale=big_l)      # local_shift = m s
        torch.testing.assert_close(got, want.double(), rtol=0, atol=1e-6)                     # the port's float32

    def test_non_finite_positions_raise(self):
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(ValueError, match=r"augment_positions: positions must be finite, got \[-?(nan|inf)\]"):
                augment_positions(torch.tensor([0.0, bad, 2.0]), shift=1.0)
        with pytest.raises(ValueError, match=r"augment_positions: positions must be finite"):
            augment_positions(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), num_axes=2, jitter=1.5)

    def test_each_augmentation_keeps_what_it_should(self):
        g = torch.Generator().manual_seed(0)
        p = torch.arange(10.0).expand(4, 10)
        shifted = augment_positions(p, shift=3.0, generator=g)
        torch.testing.assert_close(shifted.diff(dim=-1), torch.ones(4, 9, dtype=torch.float64))   # distances kept
        assert len({round(row[0], 9) for row in shifted.tolist()}) == 4                            # one shift per row
        scaled = augment_positions(p + 1, rescale=2.0, generator=g)
        ratios = scaled / (p + 1)
        torch.testing.assert_close(ratios, ratios[:, :1].expand(4, 10))                             # one scale per row
        assert ((ratios >= 0.5) & (ratios <= 2.0)).all()
        jiggled = augment_positions(p, local_shift=0.4, generator=g)
        assert ((jiggled - p).abs() <= 0.4).all() and (jiggled.diff(dim=-1) > 0).all()             # order kept
        grid = rope_coordinates((4, 4))                                                 # no coordinate is 0
        per_axis = augment_positions(grid, num_axes=2, jitter=1.5, generator=g) / grid
        assert torch.allclose(per_axis, per_axis[:1]) and not torch.allclose(per_axis[0, 0], per_axis[0, 1])

    def test_feeds_absolute_and_rotary_encodings(self):
        q, k, v = qkv(dtype=torch.float64)
        p = augment_positions(torch.arange(float(N)), shift=2.0, local_shift=0.3, rescale=1.1,
                              generator=torch.Generator().manual_seed(1))
        x = torch.randn(B, N, D, dtype=torch.float64)
        assert SinusoidalPositionalEmbedding(D)(x, p).shape == x.shape
        out = attention(q, k, v, RotaryPositionalEmbedding(DH).double(), positions_q=p, positions_k=p)
        assert out.shape == v.shape and torch.isfinite(out).all()

    def test_errors_name_the_argument(self):
        with pytest.raises(ValueError, match="augment_positions: local_shift must be a finite number >= 0.0"):
            augment_positions(torch.arange(3.0), local_shift=-1.0)
        with pytest.raises(ValueError, match="augment_positions: rescale must be a finite number >= 1.0"):
            augment_positions(torch.arange(3.0), rescale=0.5)
        with pytest.raises(ValueError, match=r"augment_positions: positions must be \[\.\.\., N, A=2\], got \(4, 3\)"):
            augment_positions(torch.zeros(4, 3), num_axes=2)
        with pytest.raises(TypeError, match="augment_positions: positions must be a torch.Tensor, got list"):
            augment_positions([1.0, 2.0])

    def test_shift_bounds_past_float32_are_named(self):
        """The draws are float32: a bound past its range raised torch's "from is out of bounds for float"."""
        for name in ("shift", "local_shift"):
            with pytest.raises(ValueError, match=rf"^augment_positions: {name} must be at most float32's largest "
                                                 rf"3.402823e\+38 \(the draws are float32\), got {name}=1e\+39"):
                augment_positions(torch.arange(3.0), **{name: 1e39})
        with pytest.raises(ValueError, match=r"^rope_coordinates: shift must be at most float32's largest"):
            rope_coordinates((2, 2), shift=1e300)


# ---------------------------------------------------------------------------
# RoPE-Mixed
# ---------------------------------------------------------------------------


def rotate_pairs_oracle(x, angle):
    """Interleaved pair rotation, one entry at a time: x [Dh], angle [Dh/2] -> [Dh] (float64)."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for f in range(x.shape[0] // 2):
        c, s = math.cos(float(angle[f])), math.sin(float(angle[f]))
        a, b = float(x[2 * f]), float(x[2 * f + 1])
        out[2 * f], out[2 * f + 1] = a * c - b * s, a * s + b * c
    return out


def rope_vit_init(dim, num_heads, theta):
    """naver-ai/rope-vit `init_random_2d_freqs` (ported): [2, H, dim/2]."""
    mag = 1 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    fx, fy = [], []
    for _ in range(num_heads):
        angles = torch.rand(1) * 2 * torch.pi
        fx.append(torch.cat([mag * torch.cos(angles), mag * torch.cos(torch.pi / 2 + angles)], dim=-1))
        fy.append(torch.cat([mag * torch.sin(angles), mag * torch.sin(torch.pi / 2 + angles)], dim=-1))
    return torch.stack([torch.stack(fx), torch.stack(fy)])


def rope_vit_apply(freqs, t_x, t_y, x):
    """rope-vit `compute_mixed_cis` + `apply_rotary_emb` (ported, float64): x [B, H, N, Dh]."""
    angles = t_x[:, None, None] * freqs[0][None] + t_y[:, None, None] * freqs[1][None]     # [N, H, F]
    cis = torch.polar(torch.ones_like(angles), angles).permute(1, 0, 2)                    # [H, N, F]
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * cis).flatten(3)


class TestMixedRotary:
    def test_matches_loop_oracle(self):
        pe = MixedRotaryPositionalEmbedding(8, 2).double()
        with torch.no_grad():
            pe.freqs.normal_()
        x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        positions = torch.tensor([[0.0, 0.0], [1.0, 2.0], [-3.5, 0.25], [7.0, 1.0], [100.0, -20.0]])
        got = pe(x, positions)
        for h in range(2):
            for n in range(5):
                angle = [sum(float(positions[n, a]) * float(pe.freqs[a, h, f].detach()) for a in range(2)) for f in range(4)]
                torch.testing.assert_close(got[0, h, n], rotate_pairs_oracle(x[0, h, n], angle), rtol=0, atol=1e-12)

    def test_init_is_rope_vits(self):
        torch.manual_seed(7)
        want = rope_vit_init(DH, H, 10.0)
        torch.manual_seed(7)
        pe = MixedRotaryPositionalEmbedding(DH, H, base=10.0)
        torch.testing.assert_close(pe.freqs, want, rtol=0, atol=1e-6)

    def test_matches_rope_vit_with_same_weights(self):
        pe = MixedRotaryPositionalEmbedding(DH, H, base=10.0).double()
        end_x, end_y = 5, 3                                # rope-vit init_t_xy: x = column, y = row
        t = torch.arange(end_x * end_y, dtype=torch.float64)
        t_x, t_y = t % end_x, torch.div(t, end_x, rounding_mode="floor")
        q = torch.randn(B, H, end_x * end_y, DH, dtype=torch.float64)
        want = rope_vit_apply(pe.freqs.detach(), t_x, t_y, q)
        got = pe(q, torch.stack([t_x, t_y], -1))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # float32 module and input: float64 angles, float32 rotation
        got32 = copy.deepcopy(pe).float()(q.float(), torch.stack([t_x, t_y], -1).long())
        assert (got32.double() - want).abs().max() < 1e-5

    def test_cls_token_at_origin_is_unrotated(self):
        pe = MixedRotaryPositionalEmbedding(DH, H)
        x = torch.randn(B, H, 1, DH)
        torch.testing.assert_close(pe(x, torch.zeros(1, 2)), x)

    def test_logits_depend_on_differences_only(self):
        pe = MixedRotaryPositionalEmbedding(DH, H).double()
        q, k, _ = qkv(dtype=torch.float64)
        p = rope_coordinates((4, 4)) * 7
        shifted = p + torch.tensor([5.25, -300.0], dtype=torch.float64)
        torch.testing.assert_close(pe.forward_attn(q, k, p, p), pe.forward_attn(q, k, shifted, shifted))

    def test_three_axes_init_is_orthonormal_frames(self):
        pe = MixedRotaryPositionalEmbedding(24, 3, 3, base=10.0)
        directions = pe.freqs.detach().double().view(3, 3, 3, 4)            # [A, H, vector j, magnitude i]
        unit = directions / directions.norm(dim=0, keepdim=True)
        for h in range(3):
            frame = unit[:, h, :, 0]                                            # [A, 3]
            torch.testing.assert_close(frame.T @ frame, torch.eye(3, dtype=torch.float64), atol=1e-6, rtol=0)
            magnitude = directions[:, h, 0].norm(dim=0)                         # [4]
            torch.testing.assert_close(magnitude, 10.0 ** -(torch.arange(4.0, dtype=torch.float64) * 6 / 24))
        video = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(3), indexing="ij"), -1)
        assert pe(torch.randn(1, 3, 12, 24), video.reshape(12, 3)).shape == (1, 3, 12, 24)

    def test_axes_that_do_not_divide_the_pairs(self):
        # Mochi: 64 pairs over 3 axes; here 5 pairs over 3: each frame vector takes ceil(5 / 3) = 2, the last 1
        torch.manual_seed(0)
        pe = MixedRotaryPositionalEmbedding(10, 2, 3, base=10.0).double()
        directions = pe.freqs.detach()                                          # [A, H, F]
        for h in range(2):
            for f in range(5):   # vector f // 2 of the frame, magnitude 10 ** (-6 (f % 2) / 10)
                assert abs(directions[:, h, f].norm().item() - 10.0 ** (-6 * (f % 2) / 10)) < 1e-6   # float32
            frame = directions[:, h, ::2] / directions[:, h, ::2].norm(dim=0)  # the three unit vectors [A, 3]
            torch.testing.assert_close(frame.T @ frame, torch.eye(3, dtype=torch.float64), atol=1e-6, rtol=0)
        with torch.no_grad():
            pe.freqs.normal_()
        x = torch.randn(1, 2, 4, 10, dtype=torch.float64)
        positions = torch.tensor([[0.0, 0.5, -1.0], [1.0, 2.0, 3.0], [-3.5, 0.25, 9.0], [7.0, -1.0, 0.0]])
        got = pe(x, positions)
        for h in range(2):
            for n in range(4):
                angle = [sum(float(positions[n, a]) * float(pe.freqs[a, h, f].detach()) for a in range(3))
                         for f in range(5)]
                torch.testing.assert_close(got[0, h, n], rotate_pairs_oracle(x[0, h, n], angle), rtol=0, atol=1e-12)

    @pytest.mark.parametrize("head_dim, num_axes, counts", [(8, 3, [2, 2, 0]), (12, 4, [2, 2, 2, 0]),
                                                             (2, 2, [1, 0]), (4, 3, [1, 1, 0])])
    def test_axes_that_leave_a_frame_vector_no_pair(self, head_dim, num_axes, counts):
        # ceil(F / A) pairs per frame vector would leave the last none: the initial frequencies would span A - 1
        # directions, and positions moved along the last one would all be encoded alike
        with pytest.raises(ValueError, match=rf"MixedRotaryPositionalEmbedding: head_dim must leave each of the "
                                             rf"num_axes frame vectors a pair .*, got head_dim={head_dim} for "
                                             rf"num_axes={num_axes}: {head_dim // 2} pairs as "
                                             rf"{re.escape(str(counts))}"):
            MixedRotaryPositionalEmbedding(head_dim, 2, num_axes)
        for head_dim, num_axes in ((10, 3), (6, 2), (20, 4)):   # the last vector keeps 1, 1 and 2 pairs
            freqs = MixedRotaryPositionalEmbedding(head_dim, 2, num_axes).freqs.detach().double()   # [A, H, F]
            assert all(torch.linalg.svdvals(freqs[:, h]).min() > 1e-3 for h in range(2))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="MixedRotaryPositionalEmbedding: head_dim must be even .*, got "
                                             "head_dim=31"):
            MixedRotaryPositionalEmbedding(31, 4)
        with pytest.raises(ValueError, match="MixedRotaryPositionalEmbedding: base must be a finite number > 1.0"):
            MixedRotaryPositionalEmbedding(32, 4, base=1.0)
        with pytest.raises(TypeError, match="MixedRotaryPositionalEmbedding: num_heads must be an int, got bool True"):
            MixedRotaryPositionalEmbedding(32, True)
        pe = MixedRotaryPositionalEmbedding(DH, H)
        q, k, _ = qkv()
        with pytest.raises(ValueError, match="MixedRotaryPositionalEmbedding: positions_q and positions_k are required"):
            pe.forward_attn(q, k)
        with pytest.raises(ValueError, match="MixedRotaryPositionalEmbedding: positions must have shape \\[16, 2\\]"):
            pe(q, torch.zeros(N, 3))
        with pytest.raises(ValueError, match="MixedRotaryPositionalEmbedding: x must be \\[..., H=4, N, Dh=32\\]"):
            pe(q[:, :2], grid_rc(N))


# ---------------------------------------------------------------------------
# LieRE
# ---------------------------------------------------------------------------


def expm_oracle(g):
    """exp of a float64 matrix by scaling and squaring with a 30-term Taylor series (loops)."""
    squarings = max(0, math.ceil(math.log2(max(g.abs().sum(-1).max().item(), 1e-300) / 0.25)))
    a = g / 2 ** squarings
    term, total = torch.eye(g.shape[0], dtype=torch.float64), torch.eye(g.shape[0], dtype=torch.float64)
    for order in range(1, 30):
        term = term @ a / order
        total = total + term
    for _ in range(squarings):
        total = total @ total
    return total


class TestLieRE:
    def test_matches_loop_oracle(self):
        pe = LieREPositionalEmbedding(8, 2, block_size=4).double()
        raw = pe.generator_raw_params.detach()
        x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
        positions = torch.tensor([[0.0, 0.0], [0.5, 1.0], [-0.3, 0.9]], dtype=torch.float64)
        got = pe(x, positions)
        for h in range(2):
            for n in range(3):
                for blk in range(2):
                    g = torch.zeros(4, 4, dtype=torch.float64)
                    for a in range(2):
                        for i in range(4):
                            for j in range(i + 1, 4):
                                g[i, j] += float(positions[n, a]) * float(raw[a, h, blk, i, j])
                                g[j, i] -= float(positions[n, a]) * float(raw[a, h, blk, i, j])
                    want = expm_oracle(g) @ x[0, h, n, 4 * blk : 4 * blk + 4]
                    torch.testing.assert_close(got[0, h, n, 4 * blk : 4 * blk + 4], want, rtol=0, atol=1e-10)

    def test_matches_authors_formula_with_same_weights(self):
        # StanfordMIMI/LieRE LierePositionEncoder (phase_type "learned") + FlexibleAttention.apply_transforms,
        # ported: one layer, per-head generators, cls token at the identity.
        heads, dh, g, axes = 2, 16, 8, 2
        pe = LieREPositionalEmbedding(dh, heads, axes, block_size=g).double()
        raw = pe.generator_raw_params.detach().reshape(axes, heads * (dh // g), g, g)   # their [A, H*Dh/g, g, g]
        positions = torch.cartesian_prod(torch.linspace(0, 1, 3, dtype=torch.float64),
                                         torch.linspace(0, 1, 4, dtype=torch.float64))     # [12, 2]
        upper = torch.triu(raw, diagonal=1) - 0.5
        bases = upper - upper.transpose(-1, -2)
        generator_pos = (positions.reshape(12, axes, 1, 1, 1) * bases).sum(1)            # [12, H*Dh/g, g, g]
        generator_pos = torch.cat([torch.zeros_like(generator_pos[:1]), generator_pos])   # cls token
        transforms = torch.matrix_exp(generator_pos).view(13, heads, dh // g, g, g).transpose(0, 1)
        x = torch.randn(1, heads, 13, dh, dtype=torch.float64)
        want = (transforms @ x.reshape(1, heads, 13, dh // g, g, 1)).flatten(-3)
        got = pe(x, torch.cat([torch.zeros(1, 2, dtype=torch.float64), positions]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)

    def test_blocks_of_two_are_rope_mixed(self):
        liere = LieREPositionalEmbedding(DH, H, block_size=2).double()
        mixed = MixedRotaryPositionalEmbedding(DH, H).double()
        with torch.no_grad():
            mixed.freqs.copy_(-liere.generator_raw_params[..., 0, 1])
        q, k, _ = qkv(dtype=torch.float64)
        p = rope_coordinates((4, 4))
        torch.testing.assert_close(liere.forward_attn(q, k, p, p), mixed.forward_attn(q, k, p, p))

    def test_full_generators_are_not_translation_invariant(self):
        pe = LieREPositionalEmbedding(DH, H).double()
        q, k, _ = qkv(dtype=torch.float64)
        p = rope_coordinates((4, 4))
        gap = (pe.forward_attn(q, k, p, p) - pe.forward_attn(q, k, p + 0.5, p + 0.5)).abs().max()
        assert gap > 1e-3

    def test_distinct_positions_path_equals_per_token(self, monkeypatch):
        pe = LieREPositionalEmbedding(DH, H, block_size=8)
        q, k, _ = qkv()
        pq = torch.stack([grid_rc(N), grid_rc(N).flip(0)])                # [B, N, 2], repeated positions
        pk = torch.cat([grid_rc(N)[:8], grid_rc(N)[:8]])
        want = pe.forward_attn(q, k, pq, pk)
        monkeypatch.setattr(sys.modules[type(pe).__module__], "_is_compiling", lambda: True)
        torch.testing.assert_close(pe.forward_attn(q, k, pq, pk), want, rtol=1e-6, atol=1e-6)

    def test_bad_input(self):
        with pytest.raises(ValueError, match="LieREPositionalEmbedding: block_size must be an int in \\[2, head_dim=32\\], got block_size=64"):
            LieREPositionalEmbedding(32, 4, block_size=64)
        with pytest.raises(ValueError, match="LieREPositionalEmbedding: block_size must be a positive int, got block_size=0"):
            LieREPositionalEmbedding(32, 4, block_size=0)
        pe = LieREPositionalEmbedding(DH, H)
        with pytest.raises(TypeError, match="LieREPositionalEmbedding: positions must be an integer or float tensor"):
            pe(torch.randn(B, H, N, DH), torch.zeros(N, 2, dtype=torch.bool))


# ---------------------------------------------------------------------------
# ComRoPE
# ---------------------------------------------------------------------------


def comrope_generators_oracle(pe):
    """Full ``[A, H, Dh, Dh]`` float64 generators built entry by entry from the reference's rule:
    block j of axis a is ``w (P_j - P_j^T)``, w = multiplier[a, j] (LD) or [j mod A == a] (AP)."""
    freqs = pe.freqs.detach().double()
    axes, heads, g = pe.num_axes, pe.num_heads, pe.block_size
    out = torch.zeros(axes, heads, pe.head_dim, pe.head_dim, dtype=torch.float64)
    for a in range(axes):
        for h in range(heads):
            for j in range(pe.num_blocks):
                w = float(pe.multiplier.detach()[a, j]) if pe.variant == "ld" else float(j % axes == a)
                for r in range(g):
                    for c in range(g):
                        out[a, h, j * g + r, j * g + c] = w * (float(freqs[h, j, r, c]) - float(freqs[h, j, c, r]))
    return out


class TestComRoPE:
    @pytest.mark.parametrize("variant", ["ap", "ld"])
    def test_matches_expm_of_commuting_generators(self, variant):
        pe = ComRoPEPositionalEmbedding(8, 2, 2, variant=variant, block_size=4).double()
        generators = comrope_generators_oracle(pe)                                         # [A, H, Dh, Dh]
        for h in range(2):                                                                   # they commute
            product = generators[0, h] @ generators[1, h]
            torch.testing.assert_close(product, generators[1, h] @ generators[0, h], rtol=0, atol=1e-12)
        x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
        positions = torch.tensor([[0.0, 0.0], [0.25, 0.75], [-0.4, 1.3]], dtype=torch.float64)
        got = pe(x, positions)
        for h in range(2):
            for n in range(3):
                g = sum(float(positions[n, a]) * generators[a, h] for a in range(2))
                torch.testing.assert_close(got[0, h, n], expm_oracle(g) @ x[0, h, n], rtol=0, atol=1e-10)

    def test_axial_partition_gives_block_j_to_axis_j_mod_a(self):
        pe = ComRoPEPositionalEmbedding(24, 1, 3, block_size=4)                                # 6 blocks, 3 axes
        touched = pe.generators.abs().amax((1, 3, 4)) > 0                                   # [A, Dh/g]
        assert touched.tolist() == [[j % 3 == a for j in range(6)] for a in range(3)]

    @pytest.mark.parametrize("variant", ["ap", "ld"])
    def test_blocks_of_two_are_rope_mixed(self, variant):
        comrope = ComRoPEPositionalEmbedding(DH, H, variant=variant, block_size=2).double()
        mixed = MixedRotaryPositionalEmbedding(DH, H).double()
        with torch.no_grad():   # exp(s [[0, w], [-w, 0]]) turns by -s w
            mixed.freqs.copy_(-comrope.generators[..., 0, 1])
        q, k, _ = qkv(dtype=torch.float64)
        p = rope_coordinates((4, 4))
        torch.testing.assert_close(comrope.forward_attn(q, k, p, p), mixed.forward_attn(q, k, p, p))

    @pytest.mark.parametrize("variant", ["ap", "ld"])
    def test_translation_invariant_in_float32(self, variant):
        pe = ComRoPEPositionalEmbedding(DH, H, 3, variant=variant, block_size=8)
        q, k, _ = qkv()
        p = torch.rand(N, 3, dtype=torch.float64)
        shifted = p + torch.tensor([12.5, -3.25, 40.0], dtype=torch.float64)
        torch.testing.assert_close(pe.forward_attn(q, k, p, p), pe.forward_attn(q, k, shifted, shifted),
                                   rtol=0, atol=2e-5)

    def test_reference_parameter_layout_loads(self):
        # Longin-Yu/ComRoPE model.py keeps freqs [H, 1, Dh/g, g, g] and LD's multiplier [1, A, Dh/g, 1, 1]
        pe = ComRoPEPositionalEmbedding(64, 12, variant="ld", block_size=8)
        ref_freqs, ref_multiplier = torch.randn(12, 1, 8, 8, 8), torch.randn(1, 2, 8, 1, 1)
        with torch.no_grad():
            pe.freqs.copy_(ref_freqs[:, 0])
            pe.multiplier.copy_(ref_multiplier[0, :, :, 0, 0])
        skew = ref_freqs - ref_freqs.transpose(-1, -2)
        torch.testing.assert_close(pe.generators, (skew * ref_multiplier).transpose(0, 1).double())

    def test_bad_input(self):
        with pytest.raises(ValueError, match="^ComRoPEPositionalEmbedding: variant must be one of 'ap', 'ld', got variant='mixed'"):
            ComRoPEPositionalEmbedding(16, 2, variant="mixed")
        with pytest.raises(ValueError, match="ComRoPEPositionalEmbedding: block_size must be an int in \\[2, head_dim=6\\], got block_size=8"):
            ComRoPEPositionalEmbedding(6, 2)
        with pytest.raises(ValueError, match="^ComRoPEPositionalEmbedding: init_std must be a finite number >= 0.0"):
            ComRoPEPositionalEmbedding(16, 2, init_std=-1.0)


# ---------------------------------------------------------------------------
# STRING
# ---------------------------------------------------------------------------


def plane_generator(angles):
    """Dh x Dh float64 generator turning pair (2f, 2f + 1) at rate angles[f]: block [[0, -w], [w, 0]]."""
    out = torch.zeros(2 * len(angles), 2 * len(angles), dtype=torch.float64)
    for f, w in enumerate(angles):
        out[2 * f + 1, 2 * f], out[2 * f, 2 * f + 1] = float(w), -float(w)
    return out


class TestSTRING:
    def test_cayley_logits_are_expm_of_commuting_generators(self):
        pe = STRINGPositionalEmbedding(8, 2, 2).double()
        with torch.no_grad():
            pe.skew_params.normal_(std=0.5)
        q, k = torch.randn(2, 1, 2, 3, 8, dtype=torch.float64).unbind(0)
        positions = torch.tensor([[0.0, 0.0], [1.5, -2.0], [3.0, 0.25]], dtype=torch.float64)
        got = pe.forward_attn(q, k, positions, positions, scale=1.0)
        for h in range(2):
            upper = torch.triu(pe.skew_params[h].detach().double(), 1)
            s = upper - upper.T
            eye = torch.eye(8, dtype=torch.float64)
            basis = (eye - s) @ torch.linalg.inv(eye + s)                                   # P, orthogonal
            torch.testing.assert_close(basis.T @ basis, eye, rtol=0, atol=1e-12)
            generators = [basis.T @ plane_generator(pe.freqs[a, h].detach()) @ basis for a in range(2)]
            torch.testing.assert_close(generators[0] @ generators[1], generators[1] @ generators[0],
                                       rtol=0, atol=1e-12)
            for i in range(3):
                for j in range(3):
                    g = sum(float(positions[j, a] - positions[i, a]) * generators[a] for a in range(2))
                    want = q[0, h, i] @ expm_oracle(g) @ k[0, h, j]
                    torch.testing.assert_close(got[0, h, i, j], want, rtol=0, atol=1e-10)

    def test_circulant_is_expm_of_circulant_generators(self):
        # the class applies RoPE(p) P (P^T cancels in the logits); P^T brings back the paper's R(p) x
        pe = STRINGPositionalEmbedding(8, 2, 3, variant="circulant", init_std=0.3).double()
        x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
        positions = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [2.5, 0.75, -1.0]], dtype=torch.float64)
        got = pe.basis.T @ pe(x, positions).unsqueeze(-1)                   # P^T RoPE(p) P x = R(p) x
        got = got.squeeze(-1)
        for h in range(2):
            generators = []
            for a in range(3):
                c = pe.circulant[a, h].detach()
                circulant = torch.tensor([[float(c[(j - i) % 8]) for i in range(8)] for j in range(8)],
                                         dtype=torch.float64)                               # C[j, i] = c[(j - i) mod d]
                generators.append(circulant - circulant.T)
            for n in range(3):
                g = sum(float(positions[n, a]) * generators[a] for a in range(3))
                torch.testing.assert_close(got[0, h, n], expm_oracle(g) @ x[0, h, n], rtol=0, atol=1e-10)

    def test_new_cayley_module_is_rope_mixed(self):
        string = STRINGPositionalEmbedding(DH, H)
        mixed = MixedRotaryPositionalEmbedding(DH, H)
        with torch.no_grad():
            mixed.freqs.copy_(string.freqs)
        q, k, _ = qkv()
        p = grid_rc(N)
        assert string.skew_params.abs().max() == 0
        torch.testing.assert_close(string.forward_attn(q, k, p, p), mixed.forward_attn(q, k, p, p))

    def test_identity_basis_with_axial_frequencies_is_axial_rope(self):
        # the paper's special case: P = I and RoPE's frequencies, axis 0 on the first half of the pairs
        string = STRINGPositionalEmbedding(DH, H).double()
        rope = RotaryPositionalEmbedding(DH, interleaved=True, sections=[DH // 4, DH // 4], axis_spectrum="per_axis",
                                         base=100.0)
        spectrum = 100.0 ** -(torch.arange(0, DH // 2, 2, dtype=torch.float64) / (DH // 2))   # [Dh/4]
        with torch.no_grad():
            string.freqs.zero_()
            string.freqs[0, :, : DH // 4] = spectrum
            string.freqs[1, :, DH // 4 :] = spectrum
        q, k, _ = qkv(dtype=torch.float64)
        p = grid_rc(N)
        torch.testing.assert_close(string.forward_attn(q, k, p, p), rope.forward_attn(q, k, p, p))

    @pytest.mark.parametrize("variant", ["cayley", "circulant"])
    def test_translation_invariant_in_float32(self, variant):
        pe = STRINGPositionalEmbedding(48, H, 3, variant=variant)                          # 3 axes: Dh % 6 == 0
        with torch.no_grad():
            for p in pe.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        q, k, _ = qkv(dh=48)
        p = torch.rand(N, 3, dtype=torch.float64) * 8
        shifted = p + torch.tensor([100.5, -37.25, 1000.0], dtype=torch.float64)
        torch.testing.assert_close(pe.forward_attn(q, k, p, p), pe.forward_attn(q, k, shifted, shifted),
                                   rtol=0, atol=2e-5)

    def test_bad_input(self):
        with pytest.raises(ValueError, match="^STRINGPositionalEmbedding: variant must be one of 'cayley', 'circulant', got variant='fft'"):
            STRINGPositionalEmbedding(16, 2, variant="fft")
        with pytest.raises(ValueError, match="^STRINGPositionalEmbedding: head_dim must be divisible by 6 for variant='cayley', got head_dim=16"):
            STRINGPositionalEmbedding(16, 2, 3)
        with pytest.raises(ValueError, match="^STRINGPositionalEmbedding: head_dim must be divisible by 2 for variant='circulant', got head_dim=15"):
            STRINGPositionalEmbedding(15, 2, 3, variant="circulant")


# ===========================================================================
# Pairwise bias kind: a bias added to the logits
# ===========================================================================


# ---------------------------------------------------------------------------
# T5 (+ from_config, and the census of T5 model types)
# ---------------------------------------------------------------------------


def t5_bucket_oracle(rp, bidirectional=True, num_buckets=32, max_distance=128):
    """Mesh TensorFlow's _relative_position_bucket for one int, in plain Python."""
    bucket, n = 0, -rp
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def from_ranges(ranges):
    """{n: bucket} from (first n, last n, bucket) runs."""
    return {n: b for lo, hi, b in ranges for n in range(lo, hi + 1)}


# n = query - key. Bidirectional (16 buckets a side, 8 exact): n >= 8 -> 8 + floor(2 log2(n / 8)),
# boundaries at 8 * 2**(k/2) = 8, 11.3, 16, 22.6, 32, 45.3, 64, 90.5, 128; keys after the query add 16.
T5_BIDIRECTIONAL = from_ranges([(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 3), (4, 4, 4), (5, 5, 5), (6, 6, 6),
                                (7, 7, 7), (8, 11, 8), (12, 15, 9), (16, 22, 10), (23, 31, 11), (32, 45, 12),
                                (46, 63, 13), (64, 90, 14), (91, 400, 15)])


# Causal (32 buckets, 16 exact): n >= 16 -> 16 + floor(16/3 log2(n / 16)), boundaries at 16 * 2**(3k/16)
T5_CAUSAL = from_ranges([(n, n, n) for n in range(16)] + [
    (16, 18, 16), (19, 20, 17), (21, 23, 18), (24, 26, 19), (27, 30, 20), (31, 34, 21), (35, 39, 22), (40, 45, 23),
    (46, 51, 24), (52, 58, 25), (59, 66, 26), (67, 76, 27), (77, 86, 28), (87, 98, 29), (99, 112, 30),
    (113, 400, 31)])


def census_t5_attention(model_type: str, text):
    """The model's own attention module with a relative attention bias (the class with ``compute_bias``)."""
    module = census_modeling(model_type)
    for name, cls in vars(module).items():
        if (inspect.isclass(cls) and cls.__module__ == module.__name__ and hasattr(cls, "compute_bias")
                and "has_relative_attention_bias" in inspect.signature(cls.__init__).parameters):
            return cls(text, has_relative_attention_bias=True)
    raise AssertionError(f"{model_type}: no attention class with compute_bias")


class TestT5:
    def test_buckets_match_hand_table(self):
        n = torch.arange(0, 401)
        bidirectional = pe_lib.t5_relative_position_bucket(-n)        # keys at or before the query
        after = pe_lib.t5_relative_position_bucket(n[1:])              # keys after the query
        assert bidirectional.tolist() == [T5_BIDIRECTIONAL[int(d)] for d in n]
        assert after.tolist() == [T5_BIDIRECTIONAL[int(d)] + 16 for d in n[1:]]
        causal = pe_lib.t5_relative_position_bucket(-n, bidirectional=False)
        assert causal.tolist() == [T5_CAUSAL[int(d)] for d in n]
        assert pe_lib.t5_relative_position_bucket(n, bidirectional=False).eq(0).all()   # future keys: bucket 0

    @pytest.mark.parametrize("bidirectional", [True, False])
    @pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (64, 1000), (6, 4)])
    def test_buckets_match_mesh_tensorflow_oracle(self, bidirectional, num_buckets, max_distance):
        rp = torch.arange(-3000, 3001)
        got = pe_lib.t5_relative_position_bucket(rp, bidirectional=bidirectional, num_buckets=num_buckets,
                                                 max_distance=max_distance)
        want = [t5_bucket_oracle(int(r), bidirectional, num_buckets, max_distance) for r in rp]
        assert got.tolist() == want

    def test_integer_extremes_land_in_the_last_bucket(self):
        """-2**63 has no int64 magnitude: it got bucket -2**63 (bidirectional) and 0 (causal) before."""
        for dtype in (torch.int64, torch.int32, torch.int8):
            info = torch.iinfo(dtype)
            rp = torch.tensor([info.min, info.min + 1, info.max, -5, 5], dtype=dtype)
            for bidirectional in (True, False):
                got = pe_lib.t5_relative_position_bucket(rp, bidirectional=bidirectional)
                assert got.tolist() == [t5_bucket_oracle(r, bidirectional) for r in rp.tolist()]

    @pytest.mark.parametrize("bidirectional", [True, False])
    def test_bias_matches_loop_oracle(self, bidirectional):
        t5 = T5PositionalEmbedding(3, num_buckets=16, max_distance=20, bidirectional=bidirectional)
        table = t5.relative_attention_bias.weight
        for nq, nk in ((7, 7), (3, 40), (40, 3)):
            bias = t5(nq, nk)
            offset = max(nk - nq, 0)
            for h in range(3):
                for i in range(nq):
                    for j in range(nk):
                        bucket = t5_bucket_oracle(j - (i + offset), bidirectional, 16, 20)
                        assert bias[h, i, j] == table[bucket, h]

    def test_explicit_positions_far_beyond_max_distance(self):
        t5 = T5PositionalEmbedding(2)
        positions_q, positions_k = torch.tensor([0, 10**9, 500]), torch.tensor([10**9 + 5, 3, -7, 127, 128])
        bias = t5(3, 5, positions_q=positions_q, positions_k=positions_k)
        for i, p in enumerate(positions_q.tolist()):
            for j, r in enumerate(positions_k.tolist()):
                assert bias[1, i, j] == t5.relative_attention_bias.weight[t5_bucket_oracle(r - p), 1]

    def test_checkpoint_table_loads_unchanged(self):
        t5 = T5PositionalEmbedding(8)
        checkpoint = {"relative_attention_bias.weight": torch.randn(32, 8)}
        t5.load_state_dict(checkpoint)
        assert t5(4, 4)[5, 0, 3] == checkpoint["relative_attention_bias.weight"][t5_bucket_oracle(3), 5]

    def test_decoding_with_cache_is_bottom_right(self):
        t5 = T5PositionalEmbedding(4, bidirectional=False)
        full = t5(20, 20)
        torch.testing.assert_close(t5(1, 20), full[:, -1:])
        torch.testing.assert_close(t5(5, 20), full[:, -5:])

    def test_no_logarithm_on_the_grid(self):
        from torch.overrides import TorchFunctionMode

        sizes = []

        class RecordLog(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.log, torch.Tensor.log):
                    sizes.append(args[0].numel())
                return func(*args, **(kwargs or {}))

        t5 = T5PositionalEmbedding(4)
        with RecordLog():
            t5(300, 300)
            t5(300, 300, positions_q=torch.arange(300) * 7, positions_k=torch.arange(300) * 3)
        assert max(sizes, default=0) <= 2 * 128 + 3

    def test_translation_invariant(self):
        t5 = T5PositionalEmbedding(2)
        positions = torch.tensor([3, 9, 200, 201])
        torch.testing.assert_close(t5(4, 4, positions_q=positions, positions_k=positions),
                                   t5(4, 4, positions_q=positions + 10**6, positions_k=positions + 10**6))

    def test_float_positions_are_type_error(self):
        with pytest.raises(TypeError, match="T5PositionalEmbedding: positions_q must be an integer tensor"):
            T5PositionalEmbedding(2)(2, 2, positions_q=torch.tensor([0.0, 1.0]))

    @pytest.mark.parametrize("kwargs, message", [
        (dict(num_heads=2, num_buckets=0), "num_buckets must be a positive int, got num_buckets=0"),
        (dict(num_heads=2, num_buckets=3), "num_buckets must be >= 4 \\(bidirectional=True\\), got num_buckets=3"),
        (dict(num_heads=2, max_distance=8), "max_distance must exceed the 8 exact buckets, got max_distance=8"),
        (dict(num_heads=2, num_buckets=32, max_distance=16, bidirectional=False),
         "max_distance must exceed the 16 exact buckets, got max_distance=16"),
    ])
    def test_bad_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match="T5PositionalEmbedding: " + message):
            T5PositionalEmbedding(**kwargs)

    def test_bad_call(self):
        t5 = T5PositionalEmbedding(2)
        with pytest.raises(ValueError, match="q_len must be a positive int, got q_len=0"):
            t5(0, 4)
        with pytest.raises(ValueError, match="positions_k must have shape \\[4\\]"):
            t5(4, 4, positions_k=torch.arange(5))

    # -- from_config
    @pytest.mark.parametrize("decoder", [False, True])
    def test_bias_equals_compute_bias(self, decoder):
        config = hf_config("T5Config", d_model=32, d_kv=8, num_heads=4, num_layers=1, vocab_size=32,
                           relative_attention_num_buckets=16, relative_attention_max_distance=40, is_decoder=decoder)
        attention = hf_module("t5", "T5Attention")(config, has_relative_attention_bias=True)
        kwargs = _t5_kwargs_from_config(config)
        assert kwargs == {"num_heads": 4, "num_buckets": 16, "max_distance": 40, "bidirectional": not decoder}
        assert _t5_kwargs_from_config(config.to_dict()) == kwargs
        ours = T5PositionalEmbedding(**kwargs)
        ours.relative_attention_bias.weight.data.copy_(attention.relative_attention_bias.weight.data)
        for q_len, k_len in ((70, 70), (5, 90)):       # decoding: the last 5 queries of 90 keys
            want = attention.compute_bias(q_len, k_len, past_seen_tokens=k_len - q_len)[0]
            diff = (ours(q_len, k_len) - want).abs().max().item()
            MAX_DIFF["t5 (decoder)" if decoder else "t5 (encoder)"] = diff
            assert diff == 0.0

    def test_decoder_override_and_old_configs(self):
        encoder_config = {"model_type": "t5", "num_heads": 8, "relative_attention_num_buckets": 32}
        assert _t5_kwargs_from_config(encoder_config) == {"num_heads": 8, "num_buckets": 32, "max_distance": 128,
                                                          "bidirectional": True}
        assert _t5_kwargs_from_config(encoder_config, decoder=True)["bidirectional"] is False

    def test_bad_configs(self):
        with pytest.raises(ValueError, match="T5PositionalEmbedding.from_config: model_type='llama' \\(config field model_type\\) "
                                             "is not among the model types checked"):
            _t5_kwargs_from_config({"model_type": "llama", "num_attention_heads": 4})
        with pytest.raises(TypeError, match="T5PositionalEmbedding.from_config: decoder must be a bool or None, got "
                                            "str 'yes'"):
            _t5_kwargs_from_config(T5_DECODER_DICT, decoder="yes")

    @pytest.mark.parametrize("decoder", [False, True])
    @pytest.mark.parametrize("model_type", sorted(pe_lib._T5_MODEL_TYPES))
    def test_t5_model_type_matches_compute_bias(self, model_type, decoder):
        config = census_config(model_type)
        text = pe_lib._text_config("census", config)
        text.is_decoder = decoder
        attention = census_t5_attention(model_type, text)
        ours = T5PositionalEmbedding.from_config(config)
        assert ours.bidirectional is (not decoder and model_type not in pe_lib._T5_DECODER_ONLY)
        ours.relative_attention_bias.weight.data.copy_(attention.relative_attention_bias.weight.data)
        for q_len, k_len in ((150, 150), (5, 150)):
            want = attention.compute_bias(q_len, k_len, past_seen_tokens=k_len - q_len)[0]
            diff = (ours(q_len, k_len) - want).abs().max().item()
            MAX_DIFF[f"census t5 {model_type}"] = max(MAX_DIFF.get(f"census t5 {model_type}", 0.0), diff)
            assert diff == 0.0, f"{model_type} (decoder={decoder}): bias differs by {diff:.3g}"

    @pytest.mark.parametrize("model_type, fields, message", [
        ("dbrx", {"n_heads": 16, "attn_config": {"rope_theta": 5e5}}, "DBRX uses RoPE"),
        ("udop", {"num_heads": 8, "relative_attention_num_buckets": 32}, "bounding-box"),
        ("pix2struct_vision_model", {"num_attention_heads": 8, "relative_attention_num_buckets": 32}, "never adds"),
        ("prophetnet", {"num_attention_heads": 8, "num_buckets": 32}, "n-gram"),
        ("wavlm", {"num_attention_heads": 8, "num_buckets": 320}, "gates"),
        ("layoutlmv2", {"num_attention_heads": 8, "rel_pos_bins": 32}, "bounding-box"),
        ("layoutlmv3", {"num_attention_heads": 8, "rel_pos_bins": 32}, "bounding-box"),
        ("layoutxlm", {"num_attention_heads": 8, "rel_pos_bins": 32}, "bounding-box"),
        ("cpmant", {"num_attention_heads": 8, "position_bias_num_buckets": 512}, "segment"),
        ("longt5", {"num_heads": 8, "relative_attention_num_buckets": 32}, "per block"),
    ])
    def test_refused_bias_model_types(self, model_type, fields, message):
        for reader, cls in ((_t5_kwargs_from_config, "T5"), (_alibi_kwargs_from_config, "ALiBi")):
            with pytest.raises(ValueError, match=f"{cls}PositionalEmbedding.from_config: model_type='{model_type}'"):
                reader({"model_type": model_type, **fields})
        reader = _alibi_kwargs_from_config if model_type == "dbrx" else _t5_kwargs_from_config
        with pytest.raises(ValueError, match=message):
            reader({"model_type": model_type, **fields})


# ---------------------------------------------------------------------------
# ALiBi (+ from_config: Bloom, MPT, Falcon, and their census)
# ---------------------------------------------------------------------------


def alibi_from_kwargs(kwargs):
    """Our ALiBi with the kwargs; the current class has no slopes= yet, so set its buffer instead."""
    if lib_accepts(ALiBiPositionalEmbedding, "slopes"):
        return ALiBiPositionalEmbedding(**kwargs)
    alibi = ALiBiPositionalEmbedding(kwargs["num_heads"], bidirectional=kwargs["bidirectional"])
    alibi.slopes.copy_(torch.tensor(kwargs["slopes"]))
    return alibi


def check_ramp(family, alibi, ramp, n):
    """The model adds ramp[h, j] (+slope * j up to a constant); ours must differ from it by one constant per row
    on and below the diagonal, and mask the future."""
    bias = alibi(n, n).double()                                            # [H, N, N]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    shifted = bias - ramp[:, None, :].double()                             # [H, N, N]: constant along j
    row = shifted[:, :, :1].expand_as(shifted)
    diff = (shifted - row)[:, causal].abs().max().item()
    MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), diff)
    assert torch.isinf(bias[:, ~causal]).all()
    return diff


def census_alibi_ramp(model_type: str, config, heads: int, n: int):
    """[H, N]: what the model adds to row N - 1 of its logits, up to a constant (built by its own code)."""
    module = census_modeling(model_type)
    if model_type == "bloom":
        return module.build_alibi_tensor(torch.ones(1, n), heads, torch.float32).reshape(heads, n)
    if model_type == "mpt":
        return module.build_mpt_alibi_tensor(heads, n, config.attn_config.alibi_bias_max)[:, 0, :]
    if model_type == "falcon":   # FalconModel divides its ramp by sqrt(head_dim); its bf16 staircase: see above
        ramp = module.build_alibi_tensor(torch.ones(1, n, dtype=torch.long), heads, torch.float32).reshape(heads, n)
        return ramp / math.sqrt(config.hidden_size // heads)
    raise AssertionError(f"{model_type}: no ramp builder in the census")


CENSUS_ALIBI_CONFIGS = {   # tiny configs with ALiBi on
    "bloom": dict(n_head=6, hidden_size=48, n_layer=1, vocab_size=32),
    "mpt": dict(n_heads=6, d_model=48, n_layers=1, vocab_size=32, max_seq_len=64,
                attn_config={"alibi": True, "alibi_bias_max": 8}),
    "falcon": dict(alibi=True, num_attention_heads=4, hidden_size=16, num_hidden_layers=1, vocab_size=32,
                   new_decoder_architecture=False, multi_query=False),
}


class TestALiBi:
    def test_published_slopes_for_8_heads(self):
        assert ALiBiPositionalEmbedding(8).slopes.tolist() == [2.0 ** -k for k in range(1, 9)]

    def test_non_power_of_two_rule(self):
        # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
        assert pe_lib.alibi_slopes(12) == pytest.approx([2.0 ** -k for k in range(1, 9)]
                                                        + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5])
        # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3 from 8 heads
        assert pe_lib.alibi_slopes(6) == pytest.approx([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])

    def test_slopes_stay_float32_after_cast(self):
        alibi = ALiBiPositionalEmbedding(12).bfloat16()
        assert alibi.slopes.dtype == torch.float32
        assert alibi.slopes[8].item() == pytest.approx(2.0 ** -0.5, rel=1e-7)

    @pytest.mark.parametrize("bidirectional", [False, True])
    def test_bias_matches_loop_oracle(self, bidirectional):
        alibi = ALiBiPositionalEmbedding(4, bidirectional=bidirectional)
        slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]   # the paper's 2^(-8h/H), written out for H = 4
        for nq, nk, positions_q, positions_k in ((6, 6, None, None), (2, 9, None, None),
                                                 (3, 4, torch.tensor([0.5, 7.0, 1e6]), torch.tensor([1.0, 6.0, 1e6, -2.0]))):
            bias = alibi(nq, nk, positions_q=positions_q, positions_k=positions_k)
            pq = positions_q.tolist() if positions_q is not None else [i + max(nk - nq, 0) for i in range(nq)]
            pk = positions_k.tolist() if positions_k is not None else list(range(nk))
            for h in range(4):
                for i in range(nq):
                    for j in range(nk):
                        want = -slopes[h] * abs(pq[i] - pk[j])
                        if not bidirectional and pk[j] > pq[i]:
                            want = float("-inf")
                        assert bias[h, i, j].item() == pytest.approx(want, rel=1e-6)

    def test_softmax_equals_reference_ramp(self):
        # the reference adds +slope * j (per key) under a causal mask; same softmax
        alibi = ALiBiPositionalEmbedding(8)
        ramp = alibi.slopes[:, None, None] * torch.arange(10.0)
        ramp = ramp.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf"))
        torch.testing.assert_close(torch.softmax(alibi(10, 10), -1), torch.softmax(ramp, -1))

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="ALiBiPositionalEmbedding: num_heads must be a positive int, got num_heads=-2"):
            ALiBiPositionalEmbedding(-2)

    # -- from_config
    @pytest.mark.parametrize("heads", [4, 6, 12, 16])
    def test_bloom(self, heads):
        config = hf_config("BloomConfig", n_head=heads, hidden_size=8 * heads, n_layer=1, vocab_size=32)
        kwargs = _alibi_kwargs_from_config(config)
        assert _alibi_kwargs_from_config(config.to_dict()) == kwargs
        n = 40
        ramp = hf_module("bloom", "build_alibi_tensor")(torch.ones(1, n), heads, torch.float32).reshape(heads, n)
        slopes = ramp[:, 1].tolist()                                       # Bloom's slopes: its ramp at j = 1
        assert kwargs["slopes"] == pytest.approx(slopes, rel=1e-6)
        assert check_ramp("bloom", alibi_from_kwargs(kwargs), ramp, n) < 1e-5

    @pytest.mark.parametrize("heads, bias_max", [(4, 8), (12, 8), (16, 6), (6, 12)])
    def test_mpt_alibi_bias_max(self, heads, bias_max):
        config = hf_config("MptConfig", n_heads=heads, d_model=8 * heads, n_layers=1, vocab_size=32, max_seq_len=64,
                           attn_config={"alibi": True, "alibi_bias_max": bias_max})
        kwargs = _alibi_kwargs_from_config(config)
        assert _alibi_kwargs_from_config(config.to_dict()) == kwargs
        n = 64
        ramp = hf_module("mpt", "build_mpt_alibi_tensor")(heads, n, bias_max)[:, 0, :]   # [H, N]: slope * (j - N + 1)
        slopes = (-ramp[:, -2]).tolist()
        assert kwargs["slopes"] == pytest.approx(slopes, rel=1e-6)
        assert check_ramp("mpt (alibi_bias_max)", alibi_from_kwargs(kwargs), ramp, n) < 1e-5

    @pytest.mark.parametrize("heads", [4, 6, 71])
    def test_falcon_ramp(self, heads):
        # FalconModel adds bf16(bf16(slope) * j) / sqrt(head_dim) to q . k / sqrt(head_dim) (SDPA path)
        config = hf_config("FalconConfig", alibi=True, num_attention_heads=heads, hidden_size=4 * heads,
                           num_hidden_layers=1, vocab_size=32, new_decoder_architecture=False, multi_query=False)
        kwargs = _alibi_kwargs_from_config(config)
        assert _alibi_kwargs_from_config(config.to_dict()) == kwargs
        n = 48
        ramp = hf_module("falcon", "build_alibi_tensor")(torch.ones(1, n, dtype=torch.long), heads, torch.float32)
        ramp = ramp.reshape(heads, n).double() / math.sqrt(4)             # FalconModel divides by sqrt(head_dim)
        assert kwargs["slopes"] == pytest.approx(ramp[:, 1].tolist(), rel=1e-7)   # j = 1: the rounded slope, exact
        # Falcon rounds every product slope * j to bfloat16 as well: a staircase within 2^-8 of our line
        exact = torch.tensor(kwargs["slopes"], dtype=torch.float64)[:, None] * torch.arange(n)
        assert ((ramp - exact).abs() <= 2.0 ** -8 * exact).all()   # bf16 unit roundoff 2^-8
        diff = check_ramp("falcon (bf16 slopes / sqrt(head_dim))", alibi_from_kwargs(kwargs), ramp.float(), n)
        assert diff <= 2.0 ** -8 * exact.max().item() * 2 + 1e-6   # two rounded products per difference

    def test_falcon_attention_output(self):
        # FalconAttention's own output (SDPA path, the default) equals attention() with our ALiBi on its q, k, v
        config = hf_config("FalconConfig", alibi=True, num_attention_heads=4, hidden_size=32, num_hidden_layers=1,
                           vocab_size=32, new_decoder_architecture=False, multi_query=False, bias=False,
                           parallel_attn=False, attn_implementation="sdpa")
        from positional_embeddings import attention
        model = pytest.importorskip("transformers").FalconModel(config).eval()
        layer, seen = model.h[0].self_attention, {}
        layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0] if args else
                                                                            kwargs["hidden_states"]), with_kwargs=True)
        layer.register_forward_hook(lambda m, args, output: seen.update(out=output[0]))
        n = 20
        with torch.no_grad():
            model(torch.randint(0, 32, (1, n)))
            q, k, v = (t.transpose(1, 2) for t in layer._split_heads(layer.query_key_value(seen["x"])))  # [B, H, N, Dh]
            alibi = alibi_from_kwargs(_alibi_kwargs_from_config(config))
            ours = layer.dense(attention(q, k, v, alibi, causal=True).transpose(1, 2).reshape(1, n, 32))
        MAX_DIFF["falcon attention output"] = (ours - seen["out"]).abs().max().item()
        torch.testing.assert_close(ours, seen["out"], atol=1e-5, rtol=1e-5)

    def test_bad_configs(self):
        owner = "ALiBiPositionalEmbedding.from_config"
        with pytest.raises(ValueError, match=f"{owner}: model_type='llama' \\(config field model_type\\) is not among"):
            _alibi_kwargs_from_config(LLAMA3_DICT)
        with pytest.raises(ValueError, match=f"{owner}: Falcon config has alibi=False: it uses RoPE"):
            _alibi_kwargs_from_config({"model_type": "falcon", "alibi": False, "num_attention_heads": 4})
        with pytest.raises(ValueError, match=f"{owner}: MPT config has attn_config.alibi=False"):
            _alibi_kwargs_from_config({"model_type": "mpt", "n_heads": 4, "attn_config": {"alibi": False}})
        with pytest.raises(TypeError, match=f"{owner}: config must be a Hugging Face config object"):
            _alibi_kwargs_from_config(None)

    @pytest.mark.parametrize("model_type", sorted(pe_lib._ALIBI_MODEL_TYPES))
    def test_alibi_model_type_matches_its_ramp(self, model_type):
        pytest.importorskip("transformers")
        from transformers.models.auto import configuration_auto
        config = configuration_auto.CONFIG_MAPPING[model_type](**CENSUS_ALIBI_CONFIGS[model_type])
        kwargs = _alibi_kwargs_from_config(config)
        n = 40
        ramp = census_alibi_ramp(model_type, config, kwargs["num_heads"], n)
        diff = check_ramp(f"census alibi {model_type}", alibi_from_kwargs(kwargs), ramp, n)
        # Falcon's bf16 staircase: within 2^-8 of the line, twice (two rounded products per difference)
        assert diff <= (2.0 ** -7 * ramp.abs().max().item() + 1e-6 if model_type == "falcon" else 1e-5)


# ---------------------------------------------------------------------------
# TUPE (UnifiedPositionalEmbedding)
# ---------------------------------------------------------------------------


def layer_norm_oracle(x, weight, bias, eps=1e-5):
    mean = sum(x) / len(x)
    var = sum((v - mean) ** 2 for v in x) / len(x)
    return [(v - mean) / math.sqrt(var + eps) * w + b for v, w, b in zip(x, weight, bias)]


class TestTUPE:
    def test_matches_loop_oracle(self):
        heads, head_dim = 2, 3
        tupe = UnifiedPositionalEmbedding(10, heads, head_dim, num_buckets=8, max_distance=6, cls_token=True).double()
        for p in tupe.parameters():
            torch.nn.init.normal_(p)
        bias = tupe(4, 6)          # queries at positions 2..5 (bottom-right), keys 0..5
        param = lambda t: t.detach().tolist()
        table, ln_w, ln_b = param(tupe.position_embeddings.weight), param(tupe.pos_ln.weight), param(tupe.pos_ln.bias)
        wq, bq = param(tupe.pos_q_linear.weight), param(tupe.pos_q_linear.bias)
        wk, bk = param(tupe.pos_k_linear.weight), param(tupe.pos_k_linear.bias)
        rel = param(tupe.relative.relative_attention_bias.weight)

        def project(w, b, p):
            row = layer_norm_oracle(table[p], ln_w, ln_b)
            return [sum(w[o][c] * row[c] for c in range(len(row))) + b[o] for o in range(len(b))]

        for h in range(heads):
            for i in range(4):
                for j in range(6):
                    p, r = i + 2, j
                    pq, pk = project(wq, bq, p), project(wk, bk, r)
                    dims = range(h * head_dim, (h + 1) * head_dim)
                    want = sum(pq[c] * pk[c] for c in dims) / math.sqrt(2 * head_dim)
                    want += rel[t5_bucket_oracle(r - p, True, 8, 6)][h]
                    if r == 0:
                        want = tupe.others_to_cls[h].item()
                    assert bias[h, i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-9)
        cls_row = tupe(3, 3)[:, 0]
        torch.testing.assert_close(cls_row, tupe.cls_to_others.detach()[:, None].expand(heads, 3))

    def test_logit_scale_is_one_over_sqrt_two_d(self):
        tupe = UnifiedPositionalEmbedding(16, 2, 8, relative_bias=False)
        q, k, _ = qkv(5, 5, dh=8)
        q, k = q[:, :2], k[:, :2]
        want = q @ k.transpose(-1, -2) / 4.0 + tupe(5, 5)
        torch.testing.assert_close(tupe.forward_attn(q, k), want)

    def test_forward_attn_scale_is_checked(self):
        """forward_attn's scale (TUPE's goes through the shared base): a str was a raw torch error, a NaN
        gave NaN logits."""
        tupe = UnifiedPositionalEmbedding(16, 2, 8, relative_bias=False)
        q, k, _ = qkv(5, 5, dh=8)
        q, k = q[:, :2], k[:, :2]
        with pytest.raises(TypeError, match="^UnifiedPositionalEmbedding: scale must be a real number, got str 'a'$"):
            tupe.forward_attn(q, k, scale="a")
        with pytest.raises(ValueError, match="^UnifiedPositionalEmbedding: scale must be a finite number, got scale=nan$"):
            tupe.forward_attn(q, k, scale=float("nan"))
        assert torch.equal(tupe.forward_attn(q, k, scale=2), tupe.forward_attn(q, k, scale=2.0))

    def test_positions_past_the_table(self):
        with pytest.raises(ValueError, match="UnifiedPositionalEmbedding: positions_k must lie in \\[0, max_len=8\\), got position 8"):
            UnifiedPositionalEmbedding(8, 2, 4)(2, 9, positions_q=torch.tensor([0, 1]))

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="UnifiedPositionalEmbedding: head_dim must be a positive int, got head_dim=0"):
            UnifiedPositionalEmbedding(8, 2, 0)


# ---------------------------------------------------------------------------
# KERPLE
# ---------------------------------------------------------------------------


def kerple_oracle(kernel, r1, r2, pq, pk, bidirectional):
    out = []
    for h in range(len(r1)):
        rows = []
        for i in range(len(pq)):
            row = []
            for j in range(len(pk)):
                d = abs(pq[i] - pk[j]) if bidirectional else max(pq[i] - pk[j], 0)
                row.append(-r1[h] * math.log(1 + r2[h] * d) if kernel == "log" else -r1[h] * d ** r2[h])
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.float64)


def kerple_authors_forward(kernel, bias_p, bias_a, seq_len_q, seq_len_k, eps=1e-2):
    """The forward of github.com/chijames/KERPLE megatron/mpu/layers.py (ParallelKerpleLog /
    ParallelKerplePower with both parameters), restated on the CPU without model parallelism."""
    diff = torch.tril(torch.arange(seq_len_k).view(seq_len_k, 1).repeat(1, seq_len_k)
                      + torch.arange(0, -seq_len_k, -1)).to(torch.float64)
    if kernel == "log":
        p, a = bias_p.clamp(min=eps), bias_a.clamp(min=eps)
        bias = -p * torch.log(1 + a * diff)
    else:
        p, a = bias_p.clamp(min=eps, max=2), bias_a.clamp(min=eps)
        bias = -diff.pow(p) * a
    if seq_len_q != seq_len_k:
        assert seq_len_q == 1
        bias = bias[:, seq_len_k - 1, :].view(bias.shape[0], 1, bias.shape[2])
    return bias


class TestKerple:
    @pytest.mark.parametrize("kernel", ["log", "power"])
    @pytest.mark.parametrize("bidirectional", [False, True])
    def test_matches_loop_oracle(self, kernel, bidirectional):
        kerple = KerplePositionalEmbedding(3, kernel=kernel, bidirectional=bidirectional).double()
        r1, r2 = kerple.r1.tolist(), kerple.r2.tolist()
        p, a = kerple.bias_p.detach().view(-1).tolist(), kerple.bias_a.detach().view(-1).tolist()
        assert (r1, r2) == ((p, a) if kernel == "log" else (a, p))
        for nq, nk, pos_q, pos_k in ((6, 6, None, None), (2, 9, None, None),
                                     (3, 4, torch.tensor([0.5, 7.0, 1e6]), torch.tensor([1.0, 6.0, 1e6 - 2.5, -2.0]))):
            bias = kerple(nq, nk, positions_q=pos_q, positions_k=pos_k)
            pq, pk = paired_positions(nq, nk)
            if pos_q is not None:
                pq, pk = pos_q.tolist(), pos_k.tolist()
            torch.testing.assert_close(bias, kerple_oracle(kernel, r1, r2, pq, pk, bidirectional))

    @pytest.mark.parametrize("kernel", ["log", "power"])
    def test_matches_authors_code_with_same_weights(self, kernel):
        kerple = KerplePositionalEmbedding(4, kernel=kernel).double()
        with torch.no_grad():   # exercise the clamps: below eps, and a power exponent above 2
            kerple.bias_a[0] = -0.3
            kerple.bias_p[1] = 3.0 if kernel == "power" else 0.001
        p, a = kerple.bias_p.detach().clone(), kerple.bias_a.detach().clone()
        torch.testing.assert_close(kerple(N, N), kerple_authors_forward(kernel, p, a, N, N), rtol=1e-12, atol=1e-12)
        # their decoding step: one query, the last row
        torch.testing.assert_close(kerple(1, N), kerple_authors_forward(kernel, p, a, 1, N), rtol=1e-12, atol=1e-12)

    def test_power_kernel_with_exponent_one_is_alibi(self):
        # eps below ALiBi's smallest slopes 2^-7, 2^-8 (the authors' 0.01 would clamp them)
        kerple = KerplePositionalEmbedding(8, kernel="power", bidirectional=True, eps=1e-3)
        with torch.no_grad():
            kerple.bias_p.fill_(1.0)
            kerple.bias_a.copy_(torch.tensor([2.0 ** -k for k in range(1, 9)]).view(8, 1, 1))
        torch.testing.assert_close(kerple(N, N), ALiBiPositionalEmbedding(8, bidirectional=True)(N, N))

    def test_clamp_is_straight_through_and_storable(self):
        kerple = KerplePositionalEmbedding(2, kernel="log")
        with torch.no_grad():
            kerple.bias_a[0] = -1.0
        kerple(4, 4).sum().backward()
        # the gradient is the one at the clamped value, as after the authors' in-place clamp
        p = kerple.bias_p.detach().view(-1)[0].item()
        want = sum(-p * d / (1 + 0.01 * d) for i in range(4) for j in range(4) for d in [max(i - j, 0)])
        assert kerple.bias_a.grad.view(-1)[0].item() == pytest.approx(want, rel=1e-5)
        kerple.clamp_parameters_()
        assert kerple.bias_a.view(-1)[0].item() == pytest.approx(0.01)

    def test_causal_keys_after_query_are_zero_and_masked_by_attention(self):
        kerple = KerplePositionalEmbedding(H)
        bias = kerple(N, N)
        future = torch.ones(N, N, dtype=torch.bool).triu(1)
        assert (bias[:, future] == 0).all() and (bias[:, future.T] < 0).all()
        q, k, v = qkv(dtype=torch.float64)
        logits = kerple.double().forward_attn(q, k).masked_fill(torch.ones(N, N).triu(1).bool(), float("-inf"))
        torch.testing.assert_close(attention(q, k, v, kerple, causal=True), torch.softmax(logits, -1) @ v)

    @pytest.mark.parametrize("causal", [False, True])
    def test_score_mod_matches_dense_bias(self, causal):
        kerple = KerplePositionalEmbedding(H, kernel="power")
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, kerple, causal=causal or None, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, kerple, causal=causal or None, use_flex=True), want)
        positions = torch.stack([torch.arange(N) * 0.5, torch.arange(N) + 50.0])
        want = attention(q[..., :N, :], k, v, kerple, positions_q=positions[:, -(N - 3):], positions_k=positions,
                         use_flex=False)
        got = attention(q, k, v, kerple, positions_q=positions[:, -(N - 3):], positions_k=positions, use_flex=True)
        torch.testing.assert_close(got, want)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="KerplePositionalEmbedding: kernel must be one of 'log', 'power', got kernel='cubic'"):
            KerplePositionalEmbedding(4, kernel="cubic")
        with pytest.raises(TypeError, match="KerplePositionalEmbedding: bidirectional must be a bool, got str"):
            KerplePositionalEmbedding(4, bidirectional="false")
        with pytest.raises(ValueError, match="KerplePositionalEmbedding: eps must be a finite number > 0.0"):
            KerplePositionalEmbedding(4, eps=0.0)
        with pytest.raises(ValueError, match="KerplePositionalEmbedding: positions_q must have shape \\[3\\]"):
            KerplePositionalEmbedding(4)(3, 4, positions_q=torch.arange(4))


# ---------------------------------------------------------------------------
# Sandwich
# ---------------------------------------------------------------------------


def nemo_sandwich(num_heads, hidden_size, query_seq_length, key_seq_length, bidirectional):
    """NVIDIA NeMo's SandwichRelativePositionEmbedding.forward (nemo/collections/nlp/modules/common/
    megatron/position_embedding/sandwich_relative_position_embedding.py, with alibi's
    build_relative_position), restated on the CPU in float64: [1, H, Nq, Nk]."""
    max_seq_len = max(query_seq_length, key_seq_length)
    context = torch.arange(1 - max_seq_len, 1)[None, :].mul(-1)
    memory = torch.arange(1 - max_seq_len, 1)[:, None].mul(-1)
    relative_position = torch.abs(memory - context)[-query_seq_length:, -key_seq_length:]
    if not bidirectional:
        relative_position = torch.tril(relative_position)
    inv_freq = 1.0 / (10000 ** (2 * torch.arange(1, hidden_size / 2 + 1, dtype=torch.float64) / hidden_size))
    _bias = torch.sum((relative_position[:, :, None].repeat(1, 1, len(inv_freq)) * inv_freq).cos(), axis=2)
    bias = _bias.repeat(num_heads, 1, 1)
    bias_scales = torch.arange(1, num_heads + 1, 1)[:, None, None]
    return ((bias - hidden_size / 2) / (bias_scales * 8 / num_heads)).unsqueeze(0)


def sandwich_oracle(num_heads, dim, pq, pk, bidirectional, base=10000.0):
    out = []
    for h in range(1, num_heads + 1):
        rows = []
        for i in range(len(pq)):
            row = []
            for j in range(len(pk)):
                d = pq[i] - pk[j]
                if not bidirectional and d < 0:
                    d = 0
                inner = sum(math.cos(d / base ** (2 * f / dim)) for f in range(1, dim // 2 + 1))
                row.append((inner - dim / 2) / (8 * h / num_heads))
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.float64)


class TestSandwich:
    @pytest.mark.parametrize("bidirectional", [False, True])
    def test_matches_loop_oracle(self, bidirectional):
        sandwich = SandwichPositionalEmbedding(3, 12, bidirectional=bidirectional)
        for nq, nk, pos_q, pos_k in ((6, 6, None, None), (2, 9, None, None),
                                     (3, 4, torch.tensor([0.5, 7.0, 1e6]), torch.tensor([1.0, 6.0, 1e6 - 2.5, -2.0]))):
            bias = sandwich(nq, nk, positions_q=pos_q, positions_k=pos_k)
            pq, pk = paired_positions(nq, nk)
            if pos_q is not None:
                pq, pk = pos_q.tolist(), pos_k.tolist()
            want = sandwich_oracle(3, 12, pq, pk, bidirectional)
            assert bias.dtype == torch.float32
            torch.testing.assert_close(bias.double(), want, rtol=1e-6, atol=1e-5)

    @pytest.mark.parametrize("bidirectional", [False, True])
    @pytest.mark.parametrize("heads, dim, nq, nk", [(8, 64, 16, 16), (4, 32, 1, 16), (12, 128, 5, 40)])
    def test_matches_nemo(self, bidirectional, heads, dim, nq, nk):
        got = SandwichPositionalEmbedding(heads, dim, bidirectional=bidirectional)(nq, nk)
        # NeMo slices the last rows of the square bias, then (causal) applies tril to the slice,
        # which is top-left aligned: with nq < nk it zeroes keys that precede the query. The
        # square bias's last rows are bottom-right aligned, the rule used here.
        torch.testing.assert_close(got.double(), nemo_sandwich(heads, dim, nk, nk, bidirectional)[0, :, -nq:],
                                   rtol=1e-6, atol=1e-5)
        if bidirectional or nq == nk:
            torch.testing.assert_close(got.double(), nemo_sandwich(heads, dim, nq, nk, bidirectional)[0],
                                       rtol=1e-6, atol=1e-5)
        else:
            assert not torch.allclose(got.double(), nemo_sandwich(heads, dim, nq, nk, bidirectional)[0])

    def test_explicit_positions_take_the_sinusoid_product(self):
        # the [Nq, dim] x [dim, Nk] route for explicit positions equals the per-distance route
        sandwich = SandwichPositionalEmbedding(H, 64)
        dense = sandwich(N, N)
        shifted = sandwich(N, N, positions_q=torch.arange(N) + 10**6, positions_k=torch.arange(N) + 10**6)
        torch.testing.assert_close(shifted, dense, rtol=1e-6, atol=1e-5)
        batched = sandwich(N, N, positions_q=torch.arange(N).expand(2, -1), positions_k=torch.arange(N).expand(2, -1))
        torch.testing.assert_close(batched, dense.expand(2, -1, -1, -1), rtol=1e-6, atol=1e-5)

    @pytest.mark.parametrize("causal", [False, True])
    def test_score_mod_matches_dense_bias(self, causal):
        sandwich = SandwichPositionalEmbedding(H, DH)
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, sandwich, causal=causal or None, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, sandwich, causal=causal or None, use_flex=True), want)
        positions = torch.stack([torch.arange(N) * 0.5, torch.arange(N) + 50.0])
        want = attention(q, k, v, sandwich, positions_q=positions[:, 3:], positions_k=positions, use_flex=False)
        got = attention(q, k, v, sandwich, positions_q=positions[:, 3:], positions_k=positions, use_flex=True)
        torch.testing.assert_close(got, want)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="SandwichPositionalEmbedding: dim must be a positive even int, got dim=7"):
            SandwichPositionalEmbedding(4, 7)
        with pytest.raises(ValueError, match="SandwichPositionalEmbedding: num_heads must be a positive int, got num_heads=-1"):
            SandwichPositionalEmbedding(-1, 8)
        with pytest.raises(ValueError, match="SandwichPositionalEmbedding: base must be a finite number > 1.0, got base=1"):
            SandwichPositionalEmbedding(4, 8, base=1)
        with pytest.raises(TypeError, match="SandwichPositionalEmbedding: bidirectional must be a bool"):
            SandwichPositionalEmbedding(4, 8, bidirectional=1)


# ---------------------------------------------------------------------------
# FIRE
# ---------------------------------------------------------------------------


def fire_oracle(fire, pq, pk, bidirectional):
    c, L = abs(fire.c.item()), abs(fire.L.item())
    w1 = fire.mlp[0].weight.detach().double()[:, 0].tolist()
    b1 = fire.mlp[0].bias.detach().double().tolist()
    w2 = fire.mlp[2].weight.detach().double().tolist()
    b2 = fire.mlp[2].bias.detach().double().tolist()
    psi = lambda x: math.log(c * x + 1)
    out = [[[0.0] * len(pk) for _ in pq] for _ in range(len(b2))]
    for i in range(len(pq)):
        for j in range(len(pk)):
            if bidirectional:
                u = psi(abs(pq[i] - pk[j])) / psi(max(L, pq[i], pk[j]))
            else:
                u = psi(max(pq[i] - pk[j], 0)) / psi(max(L, pq[i]))
            hidden = [max(w * u + b, 0.0) for w, b in zip(w1, b1)]
            for h in range(len(b2)):
                out[h][i][j] = sum(w * z for w, z in zip(w2[h], hidden)) + b2[h]
    return torch.tensor(out, dtype=torch.float64)


class TestFIRE:
    @pytest.mark.parametrize("bidirectional", [False, True])
    def test_matches_loop_oracle(self, bidirectional):
        fire = FIREPositionalEmbedding(3, hidden_dim=5, init_L=3.0, init_c=0.7, bidirectional=bidirectional).double()
        for nq, nk, pos_q, pos_k in ((6, 6, None, None), (2, 9, None, None),
                                     (3, 4, torch.tensor([0.5, 7.0, 1e6]), torch.tensor([1.0, 6.0, 1e6 - 2.5, -2.0]))):
            bias = fire(nq, nk, positions_q=pos_q, positions_k=pos_k)
            pq, pk = paired_positions(nq, nk)
            if pos_q is not None:
                pq, pk = pos_q.tolist(), pos_k.tolist()
            torch.testing.assert_close(bias, fire_oracle(fire, pq, pk, bidirectional))

    def test_progressive_interpolation(self):
        # past L, the key at position 0 always maps to f(1) and the diagonal to f(0)
        fire = FIREPositionalEmbedding(H, init_L=4.0)
        bias = fire(64, 64)
        rows = torch.arange(4, 64)
        torch.testing.assert_close(bias[:, rows, 0], bias[:, 4:5, 0].expand(-1, 60))
        torch.testing.assert_close(bias[:, rows, rows], bias[:, :1, 0].expand(-1, 60))
        # below L the bias is a function of the distance alone
        torch.testing.assert_close(bias[:, 3, :4], bias[:, 4, 1:5])

    def test_batched_positions(self):
        fire = FIREPositionalEmbedding(H, hidden_dim=8, init_L=4.0)
        positions = torch.stack([torch.arange(N) * 3, torch.arange(N) + 50])
        bias = fire(N, N, positions_q=positions, positions_k=positions)
        assert bias.shape == (2, H, N, N)
        for b in range(2):
            torch.testing.assert_close(bias[b], fire(N, N, positions_q=positions[b], positions_k=positions[b]))

    @pytest.mark.parametrize("causal, bidirectional", [(True, False), (False, True)])
    def test_score_mod_matches_dense_bias(self, causal, bidirectional):
        fire = FIREPositionalEmbedding(H, hidden_dim=8, init_L=4.0, bidirectional=bidirectional)
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, fire, causal=causal or None, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, fire, causal=causal or None, use_flex=True), want)
        positions = torch.stack([torch.arange(N) * 0.5, torch.arange(N) + 50.0])
        want = attention(q, k, v, fire, positions_q=positions[:, 3:], positions_k=positions, use_flex=False)
        got = attention(q, k, v, fire, positions_q=positions[:, 3:], positions_k=positions, use_flex=True)
        torch.testing.assert_close(got, want)

    def test_appendix_checkpoint_loads(self):
        # the paper's appendix code keeps 0-d c, a frozen init_L and a learned L_multiplier (threshold
        # |L_multiplier * init_L|) and adds eps = 1e-6 to the normaliser; its state dict loads by copying
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, H))
        c, init_l, multiplier, eps = torch.tensor(0.3), torch.tensor(6.0), torch.tensor(1.5), 1e-6
        state = {"c": c, "init_L": init_l, "L_multiplier": multiplier, **{f"mlp.{k}": v for k, v in mlp.state_dict().items()}}
        fire = FIREPositionalEmbedding(H, hidden_dim=8)
        fire.load_state_dict(state)
        assert fire.c.shape == fire.L_multiplier.shape == fire.init_L.shape == (1,)
        assert fire.L.item() == 9.0
        positions = torch.arange(20.0)
        distance = (positions[:, None] - positions[None, :]).clamp_min(0)        # causal: keys after the query -> 0
        normaliser = torch.log(c * torch.maximum(positions, multiplier * init_l) + 1)[:, None]
        u = torch.log(c * distance + 1) / (normaliser + eps)
        with torch.no_grad():
            want = mlp(u.unsqueeze(-1)).permute(2, 0, 1)                            # [H, N, N]
        torch.testing.assert_close(fire(20, 20), want, atol=2e-6, rtol=1e-6)

    def test_threshold_is_learned_in_units_of_init_L(self):
        # d loss / d L_multiplier = init_L * d loss / d L, so an Adam step moves L by about lr * init_L
        fire = FIREPositionalEmbedding(H, hidden_dim=8, init_L=8.0)
        optimizer = torch.optim.Adam(fire.parameters(), lr=1e-2)
        fire(32, 32).sum().backward()
        assert fire.L_multiplier.grad.abs().item() > 0
        optimizer.step()
        assert abs(abs(fire.L.item() - 8.0) - 1e-2 * 8.0) < 1e-5

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="FIREPositionalEmbedding: num_heads must be a positive int, got num_heads=0"):
            FIREPositionalEmbedding(0)
        with pytest.raises(TypeError, match="FIREPositionalEmbedding: hidden_dim must be an int, got float 2.5"):
            FIREPositionalEmbedding(4, hidden_dim=2.5)
        with pytest.raises(ValueError, match="FIREPositionalEmbedding: init_L must be a finite number > 0.0, got init_L=-1"):
            FIREPositionalEmbedding(4, init_L=-1)
        with pytest.raises(TypeError, match="FIREPositionalEmbedding: bidirectional must be a bool"):
            FIREPositionalEmbedding(4, bidirectional="yes")
        with pytest.raises(ValueError, match="FIREPositionalEmbedding: positions_k must have shape \\[5\\]"):
            FIREPositionalEmbedding(4)(3, 5, positions_k=torch.arange(4))

    def test_fire_score_mod_is_pointwise(self):
        """Issue 22.2: inductor lowers a score_mod without reductions; FIRE's MLP used to sum over its units."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.add(str(func))
                return func(*args, **(kwargs or {}))

        fire = FIREPositionalEmbedding(H, hidden_dim=8)
        score_mod = fire.score_mod(N, N)
        args = (torch.tensor(0.5), torch.tensor(0), torch.tensor(1), torch.tensor(7), torch.tensor(3))
        ops = set()
        with torch.no_grad(), Recorder():
            score_mod(*args)
        assert ops and not any("sum" in op or "mm" in op or "mean" in op for op in ops), ops
        want = fire(N, N)[1, 7, 3] + 0.5
        torch.testing.assert_close(score_mod(*args), want)

    @slow   # inductor compiles FIRE's kernel for minutes on a CPU
    def test_fire_score_mod_compiles_with_inductor(self):
        fire = FIREPositionalEmbedding(H, hidden_dim=8, init_L=16.0)
        q, k, v = (torch.randn(1, H, 128, DH) for _ in range(3))
        mask = pe_lib._block_mask(None, True, 128, 128, q.device)
        with torch.no_grad():
            got = pe_lib._compiled_flex_attention()(q, k, v, score_mod=fire.score_mod(128, 128), block_mask=mask)
            torch.testing.assert_close(got, attention(q, k, v, fire, causal=True, use_flex=False))


# ---------------------------------------------------------------------------
# Dynamic position bias (CrossFormer / x-transformers)
# ---------------------------------------------------------------------------


def dpb_oracle(pe, offset):
    """The MLP of x-transformers' DynamicPositionBias on one query - key offset (a list), by loops."""
    rows = lambda layer: (layer.weight.detach().tolist(), layer.bias.detach().tolist())
    x = [math.copysign(math.log(1 + abs(v)), v) if pe.log_distance else float(v) for v in offset]
    for block in pe.mlp[:-1]:
        w, b = rows(block[0])
        x = [sum(w[o][c] * x[c] for c in range(len(x))) + b[o] for o in range(len(b))]
        if pe.norm:   # the first block's norm has no bias and calls its scale gamma
            norm = block[1]
            scale = (norm.gamma if hasattr(norm, "gamma") else norm.weight).tolist()
            shift = [0.0] * len(x) if hasattr(norm, "gamma") else norm.bias.tolist()
            x = layer_norm_oracle(x, scale, shift)
        x = [v / (1 + math.exp(-v)) if v >= 0 else v * math.exp(v) / (1 + math.exp(v)) for v in x]   # SiLU
    w, b = rows(pe.mlp[-1])
    return [sum(w[o][c] * x[c] for c in range(len(x))) + b[o] for o in range(len(b))]


class TestDynamicPositionBias:
    @pytest.mark.parametrize("log_distance, norm, depth", [(False, False, 1), (True, True, 2)])
    def test_matches_loop_oracle(self, log_distance, norm, depth):
        pe = randomise(DynamicPositionBias(2, hidden_dim=6, depth=depth, log_distance=log_distance, norm=norm).double())
        bias = pe(4, 7)                              # queries at 3..6 (bottom-right), keys 0..6
        for i in range(4):
            for j in range(7):
                want = dpb_oracle(pe, [(i + 3) - j])
                for h in range(2):
                    assert bias[h, i, j].item() == pytest.approx(want[h], rel=1e-12, abs=1e-12)
        pos_q, pos_k = torch.tensor([0.5, -3.25, 10.0]), torch.tensor([2.0, 0.5])
        bias = pe(3, 2, pos_q, pos_k)
        for i in range(3):
            for j in range(2):
                want = dpb_oracle(pe, [pos_q[i].item() - pos_k[j].item()])
                assert bias[:, i, j].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)

    def test_sparse_integer_positions_match_loop_oracle(self):
        # offsets far apart: distinct ones are found by sorting keys, not by enumerating their range
        pe = randomise(DynamicPositionBias(2, hidden_dim=6).double())
        pos_q, pos_k = torch.tensor([0, 1000, 5]), torch.tensor([7, 2, 999, -4000])
        bias = pe(3, 4, pos_q, pos_k)
        pe2 = randomise(DynamicPositionBias(2, num_axes=2, hidden_dim=6).double())
        grid_q, grid_k = torch.tensor([[0, 0], [100, -50], [3, 7]]), torch.tensor([[1, 1], [-20, 900]])
        bias2 = pe2(3, 2, grid_q, grid_k)
        for i in range(3):
            for j in range(4):
                assert bias[:, i, j].tolist() == pytest.approx(dpb_oracle(pe, [int(pos_q[i] - pos_k[j])]), rel=1e-12, abs=1e-12)
            for j in range(2):
                want = dpb_oracle(pe2, (grid_q[i] - grid_k[j]).tolist())
                assert bias2[:, i, j].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)

    def test_two_axes_match_loop_oracle(self):
        pe = randomise(DynamicPositionBias(2, num_axes=2, hidden_dim=6, log_distance=True).double())
        pos = grid_positions(6, width=3)
        bias = pe(6, 6, pos, pos)
        for i in range(6):
            for j in range(6):
                want = dpb_oracle(pe, (pos[i] - pos[j]).tolist())
                assert bias[:, i, j].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)

    @pytest.mark.parametrize("log_distance, norm", [(False, False), (True, True)])
    def test_matches_x_transformers(self, log_distance, norm):
        x_transformers = pytest.importorskip("x_transformers.x_transformers")
        theirs = x_transformers.DynamicPositionBias(16, heads=H, depth=3, log_distance=log_distance, norm=norm)
        randomise(theirs, 0.3)
        ours = DynamicPositionBias(H, hidden_dim=16, depth=3, log_distance=log_distance, norm=norm)
        ours.load_state_dict(theirs.state_dict())     # same names: mlp.0.0, (mlp.0.1.gamma,) ..., mlp.3
        torch.testing.assert_close(ours(N, N), theirs(N, N), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours(5, N), theirs(5, N), rtol=1e-5, atol=1e-6)

    def test_explicit_positions_equal_default_and_shift_invariance(self):
        pe = randomise(DynamicPositionBias(H, hidden_dim=8))
        torch.testing.assert_close(pe(5, 9, torch.arange(4, 9) + 100, torch.arange(9) + 100), pe(5, 9))
        pe2 = randomise(DynamicPositionBias(H, num_axes=2, hidden_dim=8))
        pos = grid_positions(N)
        torch.testing.assert_close(pe2(N, N, pos + torch.tensor([7, -3]), pos + torch.tensor([7, -3])), pe2(N, N, pos, pos))

    @pytest.mark.parametrize("num_axes", [1, 2])
    def test_score_mod_matches_dense_bias(self, num_axes):
        pe = randomise(DynamicPositionBias(H, num_axes=num_axes, hidden_dim=8), 0.3)
        q, k, v = qkv()
        positions = grid_positions(N) if num_axes == 2 else None
        kw = dict(positions_q=positions, positions_k=positions)
        torch.testing.assert_close(attention(q, k, v, pe, use_flex=True, **kw), attention(q, k, v, pe, use_flex=False, **kw))
        batched = torch.stack([grid_positions(N), grid_positions(N).flip(0)]) if num_axes == 2 else \
            torch.stack([torch.arange(N) * 2, torch.arange(N)])
        kw = dict(positions_q=batched, positions_k=batched)
        torch.testing.assert_close(attention(q, k, v, pe, use_flex=True, **kw), attention(q, k, v, pe, use_flex=False, **kw))

    def test_bad_arguments(self):
        name = "DynamicPositionBias"
        with pytest.raises(ValueError, match=f"{name}: depth must be a positive int, got depth=0"):
            DynamicPositionBias(2, depth=0)
        with pytest.raises(TypeError, match=f"{name}: log_distance must be a bool, got str 'false'"):
            DynamicPositionBias(2, log_distance="false")
        with pytest.raises(ValueError, match=f"{name}: num_axes must be a positive int, got num_axes=0"):
            DynamicPositionBias(2, num_axes=0)
        pe = DynamicPositionBias(H, num_axes=2)
        with pytest.raises(ValueError, match=f"{name}: positions_q and positions_k are required for 2 axes"):
            pe(4, 4)
        with pytest.raises(ValueError, match=f"{name}: positions_q must have shape \\[4, 2\\]"):
            pe(4, 4, torch.arange(4), grid_positions(4))
        with pytest.raises(ValueError, match=f"{name}: positions_q and positions_k are required for 2 axes"):
            pe.forward_attn(*qkv(4, 4)[:2])


# ---------------------------------------------------------------------------
# Relative position bias 2D (Swin / BEiT window table)
# ---------------------------------------------------------------------------


# vision helpers (also used by the continuous position bias)

def window_token(t, width, prefix):
    """(row, col) of window token t, or None for the prefix token."""
    return None if t < prefix else divmod(t - prefix, width)


def randomise(module, std=0.5):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module


def copy_into(dst, src):
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def beit_offsets_oracle(src, dst):
    """BEiT's geometric source offsets (unilm beit/run_class_finetuning.py; timm 1.0.31
    timm/layers/pos_embed_rel.py, resize_rel_pos_bias_table): bisection for the ratio, plain loops."""
    lo, hi = 1.01, 1.5
    while hi - lo > 1e-6:
        r = (lo + hi) / 2.0
        total = sum(r ** k for k in range(src // 2))       # 1 + r + ... + r^(n-1)
        if total > dst // 2:
            hi = r
        else:
            lo = r
    out, cur = [], 1.0
    for k in range(src // 2):
        out.append(cur)
        cur += r ** (k + 1)
    return [-v for v in reversed(out)] + [0.0] + out


def clamped_linear_oracle(points, t):
    """[(index, weight)] of piecewise-linear interpolation at t, constant beyond the ends."""
    if t <= points[0]:
        return [(0, 1.0)]
    if t >= points[-1]:
        return [(len(points) - 1, 1.0)]
    for k in range(1, len(points)):
        if points[k - 1] < t <= points[k]:
            w = (t - points[k - 1]) / (points[k] - points[k - 1])
            return [(k - 1, 1.0 - w), (k, w)]
    raise AssertionError


def resize_oracle(table, old, new, extra):
    """timm's resize_rel_pos_bias_table (the geometric / BEiT method) entry by entry, in float64."""
    src = (2 * old[0] - 1, 2 * old[1] - 1)
    dst = (2 * new[0] - 1, 2 * new[1] - 1)
    ys, xs = beit_offsets_oracle(src[0], dst[0]), beit_offsets_oracle(src[1], dst[1])
    heads = len(table[0])
    out = []
    for ty in range(-(dst[0] // 2), dst[0] // 2 + 1):
        for tx in range(-(dst[1] // 2), dst[1] // 2 + 1):
            row = []
            for h in range(heads):
                value = 0.0
                for iy, wy in clamped_linear_oracle(ys, ty):
                    for ix, wx in clamped_linear_oracle(xs, tx):
                        value += wy * wx * table[iy * src[1] + ix][h]
                row.append(value)
            out.append(row)
    return out + [list(r) for r in table[len(table) - extra:]] if extra else out


class TestRelativePositionBias2D:
    @pytest.mark.parametrize("prefix", [0, 1])
    def test_matches_loop_oracle(self, prefix):
        wh, ww, heads = 3, 4, 2
        pe = randomise(RelativePositionBias2D(heads, (wh, ww), num_prefix_tokens=prefix).double())
        table = pe.relative_position_bias_table.detach().tolist()
        assert len(table) == (2 * wh - 1) * (2 * ww - 1) + 3 * prefix
        t = wh * ww + prefix
        bias = pe(t, t)
        num_relative = (2 * wh - 1) * (2 * ww - 1)
        for i in range(t):
            for j in range(t):
                a, b = window_token(i, ww, prefix), window_token(j, ww, prefix)
                if a is None and b is None:
                    row = num_relative + 2            # cls -> cls
                elif a is None:
                    row = num_relative                # cls (query) -> token
                elif b is None:
                    row = num_relative + 1            # token -> cls (key)
                else:
                    row = (a[0] - b[0] + wh - 1) * (2 * ww - 1) + (a[1] - b[1] + ww - 1)
                for h in range(heads):
                    assert bias[h, i, j].item() == table[row][h]

    def test_shorter_calls_and_explicit_positions_select_window_tokens(self):
        pe = RelativePositionBias2D(H, (4, 5), num_prefix_tokens=1)
        full = pe(21, 21)
        torch.testing.assert_close(pe(3, 21), full[:, -3:], rtol=0, atol=0)
        torch.testing.assert_close(pe(4, 4), full[:, :4, :4], rtol=0, atol=0)
        patches = torch.arange(1, 21)                            # the patches without the [CLS]
        torch.testing.assert_close(pe(20, 20, positions_q=patches, positions_k=patches), full[:, 1:, 1:], rtol=0, atol=0)
        batched = torch.stack([patches, patches.flip(0)])
        got = pe(20, 20, positions_q=batched, positions_k=batched)
        assert got.shape == (2, H, 20, 20)
        torch.testing.assert_close(got[1], full[:, 1:, 1:].flip(-1, -2), rtol=0, atol=0)

    def test_matches_transformers_swin_attention(self):
        pytest.importorskip("transformers")
        from transformers import SwinConfig
        from transformers.models.swin.modeling_swin import SwinAttention, SwinRelativePositionBias

        heads, window, hidden = 4, 4, 32
        config = SwinConfig(embed_dim=hidden, num_heads=[heads], depths=[1], window_size=window)
        config._attn_implementation = "eager"
        theirs = randomise(SwinAttention(config, hidden, heads, window).double().eval(), 0.2)
        ours = RelativePositionBias2D(heads, window).double()
        copy_into(ours.relative_position_bias_table, theirs.relative_position_bias.relative_position_bias_table)
        torch.testing.assert_close(ours.relative_position_index.flatten(), theirs.relative_position_bias.relative_position_index)
        x = torch.randn(3, window * window, hidden, dtype=torch.float64)
        split = lambda t: t.view(3, -1, heads, hidden // heads).transpose(1, 2)       # [B, H, N, Dh]
        out = attention(split(theirs.q_proj(x)), split(theirs.k_proj(x)), split(theirs.v_proj(x)), ours)
        want = theirs(x)[0]
        got = theirs.o_proj(out.transpose(1, 2).reshape(3, -1, hidden))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)      # their eager softmax runs in float32
        torch.testing.assert_close(ours(16, 16), theirs.relative_position_bias()[0], rtol=0, atol=0)
        # a non-square window, bias against bias
        rect = randomise(SwinRelativePositionBias(heads, (3, 5)).double())
        ours = RelativePositionBias2D(heads, (3, 5)).double()
        copy_into(ours.relative_position_bias_table, rect.relative_position_bias_table)
        torch.testing.assert_close(ours(15, 15), rect()[0], rtol=0, atol=0)

    def test_matches_transformers_beit_with_cls(self):
        pytest.importorskip("transformers")
        from transformers import BeitConfig
        from transformers.models.beit.modeling_beit import BeitRelativePositionBias

        config = BeitConfig(image_size=64, patch_size=16, num_attention_heads=3)    # window 4 x 4, + [CLS]
        theirs = randomise(BeitRelativePositionBias(config).double())
        ours = RelativePositionBias2D(3, 4, num_prefix_tokens=1).double()
        copy_into(ours.relative_position_bias_table, theirs.relative_position_bias_table)
        want = theirs(window_size=(4, 4))[0]                                             # [H, 17, 17]
        torch.testing.assert_close(ours(17, 17), want, rtol=0, atol=1e-15)
        torch.testing.assert_close(ours.relative_position_index, theirs.generate_relative_position_index((4, 4)))

    def test_timm_index_and_resize_when_installed(self):
        pos_embed_rel = pytest.importorskip("timm.layers.pos_embed_rel", reason="timm (needs torchvision) not importable")
        table = torch.randn(7 * 7 + 3, 2, dtype=torch.float64)
        ours = RelativePositionBias2D(2, 4, num_prefix_tokens=1).double()
        copy_into(ours.relative_position_bias_table, table)
        torch.testing.assert_close(ours.relative_position_index,
                                   pos_embed_rel.gen_relative_position_index((4, 4), class_token=True))
        want = pos_embed_rel.resize_rel_pos_bias_table(table.float(), (6, 6), (11 * 11 + 3, 2))
        torch.testing.assert_close(ours.resize(6).relative_position_bias_table.float(), want, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("old, new, prefix", [((4, 4), (6, 6), 1), ((6, 6), (4, 4), 0), ((3, 4), (5, 7), 0),
                                                  ((4, 4), (4, 6), 1)])
    def test_resize_matches_timm_geometric_oracle(self, old, new, prefix):
        pe = randomise(RelativePositionBias2D(2, old, num_prefix_tokens=prefix).double())
        table = pe.relative_position_bias_table.detach().tolist()
        want = torch.tensor(resize_oracle(table, old, new, 3 * prefix), dtype=torch.float64)
        got = pe.resize(new).relative_position_bias_table
        assert pe.window_size == new and got.shape == want.shape
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
        t = new[0] * new[1] + prefix
        assert pe(t, t).shape == (2, t, t) and pe.relative_position_index.shape == (t, t)

    def test_resize_bicubic_is_interpolate_of_the_offset_grid(self):
        pe = randomise(RelativePositionBias2D(2, (3, 4), num_prefix_tokens=1).double())
        table = pe.relative_position_bias_table.detach().clone()
        grid = torch.zeros(1, 2, 5, 7, dtype=torch.float64)
        for dr in range(-2, 3):                 # grid[h, dr + Wh - 1, dc + Ww - 1] = table[row(dr, dc), h]
            for dc in range(-3, 4):
                grid[0, :, dr + 2, dc + 3] = table[(dr + 2) * 7 + dc + 3]
        resized = F.interpolate(grid, size=(9, 5), mode="bicubic", align_corners=False)[0]
        got = pe.resize((5, 3), interpolation="bicubic").relative_position_bias_table.detach()
        for dr in range(-4, 5):
            for dc in range(-2, 3):
                torch.testing.assert_close(got[(dr + 4) * 5 + dc + 2], resized[:, dr + 4, dc + 2])
        torch.testing.assert_close(got[-3:], table[-3:], rtol=0, atol=0)

    def test_resize_to_same_window_keeps_table(self):
        pe = RelativePositionBias2D(2, 5)
        before = pe.relative_position_bias_table.detach().clone()
        torch.testing.assert_close(pe.resize(5).relative_position_bias_table.detach(), before, rtol=0, atol=0)

    @pytest.mark.parametrize("causal", [False, True])
    def test_score_mod_matches_dense_bias(self, causal):
        pe = randomise(RelativePositionBias2D(H, (4, 5), num_prefix_tokens=1))
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, pe, causal=causal or None, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, pe, causal=causal or None, use_flex=True), want)
        positions = torch.stack([torch.arange(N) + 5, torch.randperm(21)[:N]])
        q, k, v = qkv()
        want = attention(q, k, v, pe, positions_q=positions, positions_k=positions, use_flex=False)
        got = attention(q, k, v, pe, positions_q=positions, positions_k=positions, use_flex=True)
        torch.testing.assert_close(got, want)

    def test_bad_arguments(self):
        name = "RelativePositionBias2D"
        with pytest.raises(ValueError, match=f"{name}: num_prefix_tokens must be 0 or 1 .*got num_prefix_tokens=2"):
            RelativePositionBias2D(4, 7, num_prefix_tokens=2)
        with pytest.raises(ValueError, match=f"{name}: window_size must be a sequence of 2 positive ints, got window_size=\\(7,\\)"):
            RelativePositionBias2D(4, (7,))
        with pytest.raises(ValueError, match=f"{name}: window_size\\[0\\] must be a positive int, got window_size\\[0\\]=0"):
            RelativePositionBias2D(4, (0, 3))
        with pytest.raises(TypeError, match=f"{name}: window_size must be an int, got float 7.0"):
            RelativePositionBias2D(4, 7.0)
        pe = RelativePositionBias2D(4, (4, 5))
        with pytest.raises(ValueError, match=f"{name}: q_len and k_len must be at most the window's 20 tokens \\(4x5\\), got q_len=21"):
            pe(21, 21)
        with pytest.raises(ValueError, match=f"{name}: positions_k must be token indices in \\[0, 20\\) .*got 20"):
            pe(2, 2, positions_k=torch.tensor([3, 20]))
        with pytest.raises(ValueError, match=f"{name}: positions_q must be token indices in \\[0, 20\\) .*got -1"):
            attention(*qkv(2, 2), pe, positions_q=torch.tensor([-1, 0]))
        with pytest.raises(TypeError, match=f"{name}: positions_q must be an integer tensor"):
            pe(2, 2, positions_q=torch.tensor([0.0, 1.0]))
        with pytest.raises(ValueError, match=f"{name}: interpolation must be 'geometric' or 'bicubic', got 'nearest'"):
            pe.resize(6, interpolation="nearest")
        with pytest.raises(ValueError, match=f"{name}: new_window_size\\[0\\] must be a positive int"):
            pe.resize((0, 2))

    def test_numpy_ints_accepted(self):
        np = pytest.importorskip("numpy")
        pe = RelativePositionBias2D(np.int64(2), (np.int64(3), np.int32(4)))
        assert pe.window_size == (3, 4) and pe(12, 12).shape == (2, 12, 12)


# ---------------------------------------------------------------------------
# Continuous position bias (Swin-v2)
# ---------------------------------------------------------------------------


def cpb_oracle(pe, wh, ww, pretrained=None):
    """Liu et al. (Swin-v2) eq. 4 with the official code's normalisation, every pair by loops, float64."""
    ph, pw = pretrained or (wh, ww)
    w1 = pe.cpb_mlp[0].weight.detach().tolist()
    b1 = pe.cpb_mlp[0].bias.detach().tolist()
    w2 = pe.cpb_mlp[2].weight.detach().tolist()
    log_space = lambda x: math.copysign(math.log2(1 + abs(x)) / math.log2(8), x) if x else 0.0
    t = wh * ww
    out = torch.zeros(len(w2), t, t, dtype=torch.float64)
    for i in range(t):
        for j in range(t):
            (ri, ci), (rj, cj) = divmod(i, ww), divmod(j, ww)
            x = [log_space((ri - rj) / (ph - 1) * 8), log_space((ci - cj) / (pw - 1) * 8)]
            hidden = [max(0.0, w1[u][0] * x[0] + w1[u][1] * x[1] + b1[u]) for u in range(len(b1))]
            for h in range(len(w2)):
                out[h, i, j] = 16 / (1 + math.exp(-sum(w2[h][u] * hidden[u] for u in range(len(hidden)))))
    return out


class TestContinuousPositionBias:
    @pytest.mark.parametrize("window, pretrained", [((3, 4), None), ((4, 3), (2, 5))])
    def test_matches_loop_oracle(self, window, pretrained):
        pe = randomise(ContinuousPositionBias(2, window, hidden_dim=8, pretrained_window_size=pretrained).double())
        t = window[0] * window[1]
        torch.testing.assert_close(pe(t, t), cpb_oracle(pe, *window, pretrained), rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("window, pretrained", [(4, (0, 0)), ((3, 5), (4, 6))])
    def test_matches_transformers_swinv2_attention(self, window, pretrained):
        pytest.importorskip("transformers")
        from transformers import Swinv2Config
        from transformers.models.swinv2.modeling_swinv2 import Swinv2SelfAttention

        heads, hidden = 4, 32
        config = Swinv2Config(embed_dim=hidden, num_heads=[heads], depths=[1])
        theirs = Swinv2SelfAttention(config, hidden, heads, window, pretrained_window_size=list(pretrained)).eval()
        randomise(theirs, 0.3)
        wh, ww = (window, window) if isinstance(window, int) else window
        ours = ContinuousPositionBias(heads, window, pretrained_window_size=pretrained if pretrained[0] else None)
        ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if "position_bias_mlp" in k})
        x = torch.randn(3, wh * ww, hidden)
        split = lambda t: t.view(3, -1, heads, hidden // heads).transpose(1, 2)       # [B, H, N, Dh]
        logit_scale = theirs.logit_scale.clamp(max=math.log(100.0)).exp()              # [H, 1, 1]
        q = F.normalize(split(theirs.query(x)), dim=-1) * logit_scale                   # cosine attention
        k = F.normalize(split(theirs.key(x)), dim=-1)
        out = attention(q, k, split(theirs.value(x)), ours, scale=1.0)
        want = theirs(x)[0]
        torch.testing.assert_close(out.transpose(1, 2).reshape(3, -1, hidden), want, rtol=1e-5, atol=1e-5)

    def test_state_dict_names_and_transformers_converter(self):
        pe = ContinuousPositionBias(2, 4, hidden_dim=8)
        assert set(pe.state_dict()) == {"cpb_mlp.0.weight", "cpb_mlp.0.bias", "cpb_mlp.2.weight"}
        other = randomise(ContinuousPositionBias(2, 4, hidden_dim=8))
        renamed = {k.replace("cpb_mlp", "continuous_position_bias_mlp"): v for k, v in other.state_dict().items()}
        pe.load_state_dict(renamed)
        torch.testing.assert_close(pe(16, 16), other(16, 16))
        outer = torch.nn.Sequential(pe)
        outer.load_state_dict({"0." + k: v for k, v in renamed.items()})             # nested prefix too

    def test_resize_keeps_mlp_and_uses_old_window_as_pretrained(self):
        pe = randomise(ContinuousPositionBias(2, 4, hidden_dim=8))
        fresh = ContinuousPositionBias(2, (6, 8), hidden_dim=8, pretrained_window_size=4)
        fresh.load_state_dict(pe.state_dict())
        pe.resize((6, 8))
        assert pe.pretrained_window_size == (4, 4) and pe.window_size == (6, 8)
        torch.testing.assert_close(pe(48, 48), fresh(48, 48), rtol=0, atol=0)

    def test_window_of_one_row_is_finite(self):
        pe = ContinuousPositionBias(2, (1, 4), hidden_dim=8).double()
        torch.testing.assert_close(pe(4, 4), cpb_oracle(pe, 1, 4, (2, 4)), rtol=1e-12, atol=1e-12)  # axis 0: offset 0

    def test_bfloat16_module_computes_in_float32(self):
        pe = randomise(ContinuousPositionBias(2, 4, hidden_dim=8))
        bf16 = copy.deepcopy(pe).bfloat16()
        rounded = copy.deepcopy(bf16).float()              # the same rounded weights, float32 module
        got = bf16(16, 16)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, rounded(16, 16), rtol=0, atol=0)
        assert bf16.relative_coords_table.dtype == torch.float64

    def test_bad_arguments(self):
        name = "ContinuousPositionBias"
        with pytest.raises(ValueError, match=f"{name}: hidden_dim must be a positive int, got hidden_dim=0"):
            ContinuousPositionBias(2, 4, hidden_dim=0)
        with pytest.raises(ValueError, match=f"{name}: pretrained_window_size\\[0\\] must be a positive int, got pretrained_window_size\\[0\\]=0"):
            ContinuousPositionBias(2, 4, pretrained_window_size=(0, 3))
        with pytest.raises(TypeError, match=f"{name}: window_size must be an int, got str '7'"):
            ContinuousPositionBias(2, "7")
        with pytest.raises(ValueError, match=f"{name}: q_len and k_len must be at most the window's 16 tokens"):
            ContinuousPositionBias(2, 4)(17, 17)


# ---------------------------------------------------------------------------
# Forgetting Transformer (forget gate)
# ---------------------------------------------------------------------------


def forget_bias_oracle(x, weight, bias, q_len):
    """Lin et al.'s bias one pair at a time in float64: sum_{l=j+1..i} log sigmoid(w_h . x_l + b_h)."""
    batch, n, _ = x.shape
    heads = weight.shape[0]
    offset = n - q_len
    out = torch.full((batch, heads, q_len, n), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            log_f = [-math.log1p(math.exp(-(sum(w * v for w, v in zip(weight[h].tolist(), x[b, l].tolist()))
                                            + bias[h].item()))) for l in range(n)]
            for i in range(q_len):
                for j in range(i + offset + 1):
                    out[b, h, i, j] = sum(log_f[j + 1 : i + offset + 1])
    return out


def forgetting_attention_naive(q, k, v, x, fgate_proj, scale=None):
    """The authors' O(N^2) formula (their kernel's reference): scaled logits plus the
    differences of the float32 cumulative sum of log forget gates, causal bottom-right, softmax."""
    log_fgate = F.logsigmoid(fgate_proj(x).float()).transpose(-1, -2)                   # b t h -> b h t
    log_lambda = torch.cumsum(log_fgate, dim=-1)
    q_len, k_len = q.shape[-2], k.shape[-2]
    p_seq = k_len - q_len
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores + log_lambda[..., p_seq:, None] - log_lambda[..., None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(p_seq)
    return torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1).to(v.dtype) @ v


class TestForgetting:
    @pytest.mark.parametrize("q_len", [6, 2])
    def test_matches_loop_oracle(self, q_len):
        fox = ForgettingPositionalEmbedding(8, 3).double()
        with torch.no_grad():
            fox.fgate_proj.weight.normal_()
            fox.fgate_proj.bias.normal_()
        x = torch.randn(2, 6, 8, dtype=torch.float64)
        want = forget_bias_oracle(x, fox.fgate_proj.weight.detach(), fox.fgate_proj.bias.detach(), q_len)
        torch.testing.assert_close(fox(x)(q_len, 6), want, rtol=1e-12, atol=1e-12)
        # float32 module and states: the float64-accumulated cumulative sum keeps it near float32 rounding
        got = fox.float()(x.float())(q_len, 6)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)

    @pytest.mark.parametrize("q_len", [N, N - 5, 1])
    def test_matches_authors_naive_formula(self, q_len):
        fox = ForgettingPositionalEmbedding(D, H)
        with torch.no_grad():
            fox.fgate_proj.weight.normal_(std=0.1)
            fox.fgate_proj.bias.uniform_(-2, 4)
        x = torch.randn(B, N, D)
        q, k, v = qkv(q_len, N)
        want = forgetting_attention_naive(q, k, v, x, fox.fgate_proj)
        # their float32 cumsum is itself off by ~eps * |c_i| (up to 1e-5 here): the float64 oracle is the tight check
        torch.testing.assert_close(attention(q, k, v, fox(x), causal=True), want, rtol=0, atol=1e-5)

    def test_gradients_reach_the_gate_and_the_states(self):
        fox = ForgettingPositionalEmbedding(D, H)
        with torch.no_grad():
            fox.fgate_proj.bias.uniform_(-2, 4)
        x = torch.randn(B, N, D, requires_grad=True)
        q, k, v = qkv()
        weights = torch.randn(B, H, N, DH)
        got = torch.autograd.grad((attention(q, k, v, fox(x), causal=True) * weights).sum(),
                                  (x, fox.fgate_proj.weight, fox.fgate_proj.bias))
        want = torch.autograd.grad((forgetting_attention_naive(q, k, v, x, fox.fgate_proj) * weights).sum(),
                                   (x, fox.fgate_proj.weight, fox.fgate_proj.bias))
        for g, w in zip(got, want):
            assert g.abs().sum() > 0
            torch.testing.assert_close(g, w, rtol=1e-3, atol=2e-5)

    @pytest.mark.parametrize("batch", [B, 1])
    @pytest.mark.parametrize("q_len", [N, N - 3])
    def test_flex_score_mod_matches_dense_bias(self, batch, q_len):
        fox = ForgettingPositionalEmbedding(D, H)
        with torch.no_grad():
            fox.fgate_proj.bias.uniform_(-1, 3)
        bound = fox(torch.randn(batch, N, D))
        q, k, v = qkv(q_len, N)
        want = attention(q, k, v, bound, causal=True, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, bound, causal=True, use_flex=True), want)
        torch.testing.assert_close(attention(q, k, v, bound, use_flex=True), want)

    def test_batch_one_is_shared(self):
        fox = ForgettingPositionalEmbedding(D, H)
        x = torch.randn(1, N, D)
        q, k, _ = qkv()
        torch.testing.assert_close(fox(x).forward_attn(q, k), fox(x.expand(B, -1, -1)).forward_attn(q, k))

    def test_causal_by_construction(self):
        bound = ForgettingPositionalEmbedding(D, H)(torch.randn(B, N, D))
        q, k, v = qkv(N - 2, N)
        bias = bound(N - 2, N)
        future = torch.ones(N - 2, N, dtype=torch.bool).triu(3)
        assert torch.isinf(bias[..., future]).all() and torch.isfinite(bias[..., ~future]).all()
        torch.testing.assert_close(attention(q, k, v, bound), attention(q, k, v, bound, causal=True))

    def test_decoding_with_a_cache(self):
        # the encoding bound to every token so far (cache + new) gives the full pass's rows
        fox = ForgettingPositionalEmbedding(D, H)
        with torch.no_grad():
            fox.fgate_proj.bias.uniform_(-1, 3)
        x = torch.randn(B, N, D)
        q, k, v = qkv()
        full = attention(q, k, v, fox(x), causal=True)
        cache = fox.log_forget(x[:, :5])                                                 # [B, H, 5]
        for t in (5, 9, N - 1):
            keys = (k[..., : t + 1, :], v[..., : t + 1, :])
            step = attention(q[..., t : t + 1, :], *keys, fox(x[:, : t + 1]), causal=True)
            torch.testing.assert_close(step, full[..., t : t + 1, :])
            cache = torch.cat([cache, fox.log_forget(x[:, cache.shape[-1] : t + 1])], -1)
            from_cache = attention(q[..., t : t + 1, :], *keys, fox.bind(log_forget=cache), causal=True)
            torch.testing.assert_close(from_cache, full[..., t : t + 1, :])
            # a longer bound sequence: keys are its first Nk tokens
            torch.testing.assert_close(attention(q[..., t : t + 1, :], *keys, fox(x), causal=True), step)

    def test_without_a_token_width_it_binds_log_forget_values_only(self):
        """dim=None: no fgate_proj (nothing allocated); bound to log f it is the module with a projection."""
        bare = ForgettingPositionalEmbedding(None, H)
        assert bare.fgate_proj is None and list(bare.parameters()) == []
        log_forget = F.logsigmoid(torch.randn(B, H, N) + 2)
        full = ForgettingPositionalEmbedding(D, H)
        torch.testing.assert_close(bare.bind(log_forget=log_forget)(N - 2, N),
                                   full.bind(log_forget=log_forget)(N - 2, N), rtol=0, atol=0)
        with pytest.raises(ValueError, match="ForgettingPositionalEmbedding: built with dim=None, without projections"):
            bare(torch.randn(B, N, D))

    def test_long_sequence_precision(self):
        # c_i - c_j after 2**18 tokens of log f ~ -1: a float32 cumsum loses eps * |c| ~ 0.03
        n = 2**18
        log_f = -torch.rand(1, 1, n, generator=torch.Generator().manual_seed(0)) - 0.5
        bound = ForgettingPositionalEmbedding(D, 1).bind(log_forget=log_f)
        got = bound(4, n)[0, 0].double()                                                # the last 4 queries
        c = log_f[0, 0].double().cumsum(0)
        want = (c[-4:, None] - c[None, :]).masked_fill(torch.ones(4, n, dtype=torch.bool).triu(n - 3), -math.inf)
        keep = torch.isfinite(want)
        error = ((got - want)[keep].abs() / (1 + want[keep].abs())).max().item()
        c32 = log_f[0, 0].cumsum(0)
        naive = ((c32[-4:, None] - c32[None, :]).double() - want)[keep].abs()
        assert error < 2.5e-7, error   # about two float32 roundings of D_ij itself
        assert naive.max().item() > 1e-3   # what the float64 accumulation avoids

    def test_authors_state_dict_loads(self):
        fox = ForgettingPositionalEmbedding(D, H)
        theirs = {"fgate_proj.weight": torch.randn(H, D), "fgate_proj.bias": torch.randn(H)}
        fox.load_state_dict(theirs)
        torch.testing.assert_close(fox.log_forget(FOX_STATES),
                                   F.logsigmoid(FOX_STATES @ theirs["fgate_proj.weight"].T
                                                + theirs["fgate_proj.bias"]).transpose(-1, -2))

    def test_shared_projection_is_not_reinitialised(self):
        linear = torch.nn.Linear(D, H)
        before = linear.weight.detach().clone()
        fox = ForgettingPositionalEmbedding(D, H, fgate_proj=linear)
        assert fox.fgate_proj is linear and torch.equal(linear.weight, before)
        assert fox(FOX_STATES).fgate_proj is linear

    def test_binding_compiles_inside_the_model(self):
        fox = ForgettingPositionalEmbedding(D, H)
        q, k, v = qkv()
        x = torch.randn(B, N, D)
        step = lambda q, k, v, x: attention(q, k, v, fox(x), causal=True)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v, x), step(q, k, v, x))

    def test_unbound_module_says_to_bind(self):
        fox = ForgettingPositionalEmbedding(D, H)
        q, k, v = qkv()
        message = "ForgettingPositionalEmbedding: not bound to token states.*call pe\\(x\\)"
        with pytest.raises(ValueError, match=message):
            fox.forward_attn(q, k)
        with pytest.raises(ValueError, match=message):
            attention(q, k, v, fox, causal=True)
        with pytest.raises(ValueError, match=message):
            fox.score_mod(N, N)
        with pytest.raises(ValueError, match=message):
            fox.attention_bias(N, N)

    def test_bad_inputs(self):
        fox = ForgettingPositionalEmbedding(D, H)
        bound = fox(torch.randn(B, N, D))
        q, k, v = qkv()
        owner = "ForgettingPositionalEmbedding: "
        with pytest.raises(ValueError, match=owner + "x must be \\[B, N, D=128\\], got \\(2, 16, 127\\)"):
            fox(torch.randn(B, N, D - 1))
        with pytest.raises(ValueError, match=owner + "x must be \\[B, N, D=128\\], got \\(2, 1, 16, 128\\)"):
            fox(torch.randn(B, 1, N, D))
        with pytest.raises(TypeError, match=owner + "x must be a floating tensor"):
            fox(torch.zeros(B, N, D, dtype=torch.long))
        with pytest.raises(ValueError, match=owner + "bind takes exactly one of x and log_forget"):
            fox.bind()
        with pytest.raises(ValueError, match=owner + "log_forget must be \\[B, H=4, N\\], got \\(2, 3, 16\\)"):
            fox.bind(log_forget=torch.zeros(B, 3, N))
        with pytest.raises(ValueError, match=owner + "positions_q must be None: order comes from the forget gates"):
            bound.forward_attn(q, k, torch.arange(N))
        with pytest.raises(ValueError, match=owner + "positions_k must be None"):
            attention(q, k, v, bound, positions_k=torch.arange(N))
        with pytest.raises(ValueError, match=owner + "k has more tokens than the bound encoding.*Nk=20"):
            bound.forward_attn(*qkv(20, 20)[:2])
        with pytest.raises(ValueError, match=owner + "q must not have more tokens than k.*Nq=16 and Nk=8"):
            bound.forward_attn(q, k[..., :8, :])
        with pytest.raises(ValueError, match=owner + "q and k must have the bound batch size 2.*got q \\(3,"):
            bound.forward_attn(torch.randn(3, H, N, DH), torch.randn(3, H, N, DH))
        with pytest.raises(ValueError, match=owner + "q and k must be \\[B, H, N, Dh\\]"):
            bound.forward_attn(torch.randn(B, 1, H, N, DH), torch.randn(B, 1, H, N, DH))
        with pytest.raises(ValueError, match=owner + "fgate_proj must be an nn.Linear\\(128, 4\\)"):
            ForgettingPositionalEmbedding(D, H, fgate_proj=torch.nn.Linear(D, H + 1))
        with pytest.raises(TypeError, match=owner + "num_heads must be an int, got str '4'"):
            ForgettingPositionalEmbedding(D, "4")
        with pytest.raises(ValueError, match=owner + "init_std must be a finite number >= 0.0, got init_std=nan"):
            ForgettingPositionalEmbedding(D, H, init_std=float("nan"))
        with pytest.raises(TypeError, match=owner + "q_len must be an int .*forward\\(q_len, k_len\\).*got a tensor"):
            fox(torch.randn(B, N, D), 3)   # pe(x) binds the states alone


# ---------------------------------------------------------------------------
# Inkling: relative logits from a bank of distance profiles mixed by the token states
# ---------------------------------------------------------------------------

def inkling_oracle(pe: InklingPositionalEmbedding, x: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """``b[b, h, i, j] = r_ih . P[:, i - j]`` (0 outside ``[0, E)``), from plain loops in float64: [B, H, Nq, Nk]."""
    x = x.double()
    weight = pe.r_proj.weight.detach().double()
    bias = None if pe.r_proj.bias is None else pe.r_proj.bias.detach().double()
    bank = pe.proj.detach().double()
    scale = None if pe.scale is None else pe.scale.detach().double()
    batch, heads, d_rel, extent = x.shape[0], pe.num_heads, pe.d_rel, pe.max_distance
    out = torch.zeros(batch, heads, q_len, k_len, dtype=torch.float64)
    for b in range(batch):
        for qi in range(q_len):
            i = k_len - q_len + qi                                                       # the query's token index
            for h in range(heads):
                r = [sum(weight[h * d_rel + d, c] * x[b, i, c] for c in range(x.shape[-1]))
                     + (0.0 if bias is None else bias[h * d_rel + d]) for d in range(d_rel)]
                if scale is not None:
                    r = [r[d] * scale[h, d] for d in range(d_rel)]
                    norm = math.sqrt(sum(float(v) ** 2 for v in r))
                    r = [v * min(1.0, pe.clip_threshold / (norm + 1e-6)) for v in r]
                if pe.log_scaling_n_floor is not None:
                    tau = 1 + pe.log_scaling_alpha * math.log(max(1.0, (i + 1) / pe.log_scaling_n_floor))
                    r = [v * tau for v in r]
                for j in range(k_len):
                    if 0 <= i - j < extent:
                        out[b, h, qi, j] = sum(r[d] * bank[d, i - j] for d in range(d_rel))
    return out


class TestInkling:
    """The oracle above; x-transformers' RelativeProjPositionalBias and the transformers 5.24 Inkling and
    Inkling 2 modules with the same weights; binding, decoding, GQA and FlexAttention."""

    @pytest.mark.parametrize("options", [dict(), dict(bias=True, clip_threshold=0.3, log_scaling_n_floor=3,
                                                          log_scaling_alpha=0.5)], ids=["inkling", "inkling2"])
    @pytest.mark.parametrize("q_len", [7, 3])
    def test_matches_the_loop_oracle(self, options, q_len):
        pe = InklingPositionalEmbedding(12, 2, d_rel=3, max_distance=4, init_std=0.5, **options).double()
        x = torch.randn(2, 9, 12, dtype=torch.float64)
        want = inkling_oracle(pe, x, q_len, 7)
        torch.testing.assert_close(pe(x)(q_len, 7), want, rtol=1e-12, atol=1e-12)
        pe32 = pe.float()
        torch.testing.assert_close(pe32(x.float())(q_len, 7).double(), want, rtol=1e-5, atol=1e-6)

    def test_matches_x_transformers(self):
        xt = pytest.importorskip("x_transformers.x_transformers")
        torch.manual_seed(0)
        theirs = xt.RelativeProjPositionalBias(D, H, num_distance_basis=5, max_dist=7)
        ours = InklingPositionalEmbedding(D, H, d_rel=5, max_distance=7, bias=True)
        with torch.no_grad():
            ours.r_proj.weight.copy_(theirs.to_distance_weights[0].weight)
            ours.r_proj.bias.copy_(theirs.to_distance_weights[0].bias)
            ours.proj.copy_(theirs.distance_bank * 25)
            theirs.distance_bank.mul_(25)                                                # profiles of size ~0.5
        x = torch.randn(B, N, D)
        torch.testing.assert_close(ours(x)(N, N), theirs(x), rtol=1e-5, atol=1e-6)
        # queries after a prefix: their x holds the queries' states, seq_len_k the keys
        prefix = torch.randn(B, 5, D)
        torch.testing.assert_close(ours(torch.cat([prefix, x], 1))(N, N + 5), theirs(x, seq_len_k=N + 5),
                                   rtol=1e-5, atol=1e-6)

    @staticmethod
    def _inkling_config(config_class, **extra):
        return config_class(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, head_dim=DH,
                                        swa_num_attention_heads=H, swa_num_key_value_heads=1, swa_head_dim=DH,
                                        sliding_window_size=4, d_rel=4, rel_extent=6, num_hidden_layers=2,
                                        intermediate_size=2 * D, vocab_size=64, **extra)

    @staticmethod
    def _spy_position_bias(modeling, monkeypatch) -> dict:
        """``seen["bias"]``: the position_bias the model's eager attention function receives, call by call."""
        seen, original = {}, modeling.eager_attention_forward

        def spy(module, query, key, value, attention_mask, scaling, dropout=0.0, position_bias=None, **kwargs):
            seen["bias"] = position_bias
            return original(module, query, key, value, attention_mask, scaling, dropout, position_bias, **kwargs)
        monkeypatch.setattr(modeling, "eager_attention_forward", spy)
        return seen

    def test_matches_transformers_inkling_attention(self, monkeypatch):
        # the position_bias InklingAttention hands its attention function: a full layer with the log scaling,
        # and a sliding one (extent = the window, no scaling)
        modeling = pytest.importorskip("transformers.models.inkling.modeling_inkling")
        config_module = pytest.importorskip("transformers.models.inkling.configuration_inkling")
        config = self._inkling_config(config_module.InklingTextConfig, layer_types=["hybrid", "hybrid_sliding"], log_scaling_n_floor=3,
                                      log_scaling_alpha=0.5)
        config._attn_implementation = "eager"
        seen = self._spy_position_bias(modeling, monkeypatch)
        x = torch.randn(B, N, D)
        for layer, floor in ((0, 3), (1, None)):
            torch.manual_seed(layer)
            theirs = modeling.InklingAttention(config, layer)
            for weight in theirs.parameters():
                torch.nn.init.normal_(weight, std=0.3)
            ours = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=theirs.rel_extent, log_scaling_n_floor=floor,
                                              log_scaling_alpha=0.5)
            with torch.no_grad():
                ours.r_proj.weight.copy_(theirs.r_proj.weight)
                ours.proj.copy_(theirs.rel_logits_proj.proj)
                theirs(x, attention_mask=None)
            torch.testing.assert_close(ours(x)(N, N), seen["bias"], rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("log_scaling", [False, True])
    def test_matches_transformers_inkling2_bias(self, log_scaling):
        modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
        config_module = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
        config = self._inkling_config(config_module.Inkling2TextConfig, log_scaling_n_floor=3, log_scaling_alpha=0.5,
                                      rel_l2_clip_threshold=0.4)
        theirs = modeling.Inkling2RelativePositionBias(config, H, 6, log_scaling=log_scaling)
        for weight in theirs.parameters():
            torch.nn.init.normal_(weight, std=0.3)
        ours = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6, clip_threshold=0.4,
                                          log_scaling_n_floor=3 if log_scaling else None, log_scaling_alpha=0.5)
        with torch.no_grad():
            ours.r_proj.weight.copy_(theirs.linear.weight)
            ours.scale.copy_(theirs.norm.scale)
            ours.proj.copy_(theirs.proj)
        x = torch.randn(B, N, D)
        tokens = torch.arange(N)
        want = theirs(x, tokens[:, None] - tokens[None, :], tokens.expand(B, N))
        torch.testing.assert_close(ours(x)(N, N), want, rtol=1e-5, atol=1e-6)
        # decoding: their last query (cache index N - 1) against our bound timeline
        want_last = theirs(x[:, -1:], (N - 1) - tokens[None, :], torch.full((B, 1), N - 1))
        torch.testing.assert_close(ours(x)(1, N), want_last, rtol=1e-5, atol=1e-6)

    def test_decoding_with_a_cache_equals_the_full_pass(self):
        pe = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=5, init_std=0.5, log_scaling_n_floor=2)
        x = torch.randn(B, N, D)
        q, k, v = qkv()
        full = attention(q, k, v, pe(x), causal=True)
        for t in (0, 6, N - 1):
            step = attention(q[..., t : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], pe(x[:, : t + 1]),
                             causal=True)
            torch.testing.assert_close(step, full[..., t : t + 1, :])

    @pytest.mark.parametrize("options", [dict(), dict(clip_threshold=0.3, log_scaling_n_floor=3, log_scaling_alpha=0.5)],
                             ids=["inkling", "inkling2"])
    def test_bound_at_an_offset_gives_the_full_pass_last_rows(self, options):
        """A decoding step binds only its new tokens, at their offset: the bias is the full pass's last rows
        (and the float64 loop oracle's), and attention the full pass's last outputs, dense and FlexAttention."""
        pe = InklingPositionalEmbedding(12, 2, d_rel=3, max_distance=4, init_std=0.5, **options).double()
        x = torch.randn(2, 9, 12, dtype=torch.float64)
        full = pe(x)(9, 9)
        for new in (1, 3):
            step = pe.bind(x[:, 9 - new:], offset=9 - new)                              # tokens 9 - new .. 8
            assert "from token" in repr(step)
            torch.testing.assert_close(step(new, 9), full[..., -new:, :], rtol=0, atol=0)
            torch.testing.assert_close(step(new, 9), inkling_oracle(pe, x, new, 9), rtol=1e-12, atol=1e-12)
        middle = pe.bind(x[:, 5:], offset=5)                                            # tokens 5 .. 8 bound
        torch.testing.assert_close(middle(2, 7), pe(x)(2, 7), rtol=0, atol=0)          # queries 5, 6; keys 0 .. 6
        q, k, v = torch.randn(3, 2, 2, 9, 8, dtype=torch.float64).unbind(0)
        want = attention(q, k, v, pe(x), causal=True)[..., -1:, :]
        for flex in (False, True):
            got = attention(q[..., -1:, :], k, v, pe.bind(x[:, -1:], offset=8), causal=True, use_flex=flex)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=re.escape("InklingPositionalEmbedding: the queries (tokens 4 .. 6, the "
                                                       "last Nq=3 of Nk=7) must be bound, got tokens 5 .. 8 bound")):
            middle(3, 7)
        with pytest.raises(ValueError, match=re.escape("InklingPositionalEmbedding: k has more tokens than the bound "
                                                       "encoding: keys are the bound tokens, got Nk=10 for [2, 4, 12] "
                                                       "bound from token 5")):
            middle(1, 10)
        with pytest.raises(ValueError, match="InklingPositionalEmbedding: offset must be a non-negative int, got "
                                             "offset=-1"):
            pe.bind(x, offset=-1)

    # model type -> (transformers models module, config class, full and sliding attention classes)
    INKLING_MODULES = {
        "inkling_text": ("inkling", "InklingTextConfig", "InklingAttention", "InklingAttention"),
        "inkling2_text": ("inkling2", "Inkling2TextConfig", "Inkling2FullAttention", "Inkling2SlidingAttention"),
        "inkling2_loop_text": ("inkling2_loop", "Inkling2LoopTextConfig", "Inkling2LoopFullAttention",
                               "Inkling2LoopSlidingAttention"),
    }

    @pytest.mark.parametrize("model_type", list(INKLING_MODULES))
    def test_from_config_matches_each_layer_types_module(self, model_type, monkeypatch):
        """from_config(config, layer_type=...) against the bias of that layer type's transformers attention
        (different head counts and extents per type), weights copied by transformers' names."""
        package, config_name, full_name, sliding_name = self.INKLING_MODULES[model_type]
        modeling = pytest.importorskip(f"transformers.models.{package}.modeling_{package}")
        config_class = getattr(pytest.importorskip(f"transformers.models.{package}.configuration_{package}"),
                               config_name)
        extra = {} if package == "inkling" else dict(rel_l2_clip_threshold=0.4)
        config = config_class(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, head_dim=DH,
                              swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=DH,
                              sliding_window_size=4, d_rel=4, rel_extent=6, num_hidden_layers=2, vocab_size=64,
                              layer_types=["hybrid", "hybrid_sliding"], log_scaling_n_floor=3, log_scaling_alpha=0.5,
                              **extra)
        config._attn_implementation = "eager"
        seen = self._spy_position_bias(modeling, monkeypatch)
        x, tokens = torch.randn(B, N, D), torch.arange(N)
        for layer, (layer_type, attention_class) in enumerate((("hybrid", full_name), ("hybrid_sliding", sliding_name))):
            theirs = getattr(modeling, attention_class)(config, layer)
            for weight in theirs.parameters():
                torch.nn.init.normal_(weight, std=0.3)
            ours = InklingPositionalEmbedding.from_config(config.to_dict(), layer_type=layer_type)
            assert ours.num_heads == (H if layer_type == "hybrid" else 2)
            with torch.no_grad():
                if package == "inkling":   # its bias reaches the attention function
                    ours.r_proj.weight.copy_(theirs.r_proj.weight)
                    ours.proj.copy_(theirs.rel_logits_proj.proj)
                    theirs(x, attention_mask=None)
                    want = seen["bias"]
                else:
                    module = theirs.relative_position_bias
                    ours.r_proj.weight.copy_(module.linear.weight)
                    ours.scale.copy_(module.norm.scale)
                    ours.proj.copy_(module.proj)
                    want = module(x, tokens[:, None] - tokens[None, :], tokens.expand(B, N))
            torch.testing.assert_close(ours(x)(N, N), want, rtol=1e-5, atol=1e-6)
        multimodal, extra = {"inkling_text": ("InklingConfig", {}),
                             "inkling2_text": ("Inkling2Config", dict(vision_config={"text_hidden_size": D})),
                             "inkling2_loop_text": ("Inkling2LoopConfig", dict(vision_config={"text_hidden_size": D}))
                             }[model_type]
        wrapper = getattr(importlib.import_module(f"transformers.models.{package}.configuration_{package}"),
                          multimodal)(text_config=config.to_dict(), **extra)                # its text_config is read
        for layer_type in ("hybrid", "hybrid_sliding"):
            assert pe_lib._inkling_kwargs_from_config(wrapper, layer_type=layer_type) == \
                pe_lib._inkling_kwargs_from_config(config, layer_type=layer_type)

    @pytest.mark.parametrize("model_type", list(pe_lib._INKLING_MODELS))
    def test_from_config_defaults_are_the_config_classes(self, model_type):
        """A raw config.json that omits a field reads transformers' default for it."""
        package = model_type.replace("_text", "").replace("_mm_model", "")
        config_name = {"inkling": "InklingTextConfig", "inkling2": "Inkling2TextConfig",
                       "inkling2_loop": "Inkling2LoopTextConfig"}[package]
        config = getattr(pytest.importorskip(f"transformers.models.{package}.configuration_{package}"), config_name)()
        for layer_type in ("hybrid", "hybrid_sliding"):
            assert pe_lib._inkling_kwargs_from_config({"model_type": model_type}, layer_type=layer_type) == \
                pe_lib._inkling_kwargs_from_config(config, layer_type=layer_type)

    def test_checkpoint_names_load_inkling2s_saved_checkpoint(self, tmp_path):
        """The names of checkpoint_names are those transformers writes for Inkling 2 (its save_pretrained converts
        back to the released checkpoint's names): loaded by them, each layer's bias is the model's."""
        modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
        config_module = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
        safetensors = pytest.importorskip("safetensors.torch")
        config = config_module.Inkling2TextConfig(
            hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=4,
            swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=4, d_rel=4, rel_extent=6,
            num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], log_scaling_n_floor=3,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, vocab_size=64,
            unpadded_vocab_size=60, eos_token_id=1)
        torch.manual_seed(0)
        model = modeling.Inkling2ForCausalLM(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "relative_position_bias" in name:
                    torch.nn.init.normal_(weight, std=0.3)
        model.save_pretrained(tmp_path)
        saved = safetensors.load_file(str(tmp_path / "model.safetensors"))
        x, tokens = torch.randn(B, 7, 32), torch.arange(7)
        for layer, layer_type in enumerate(config.layer_types):
            ours = InklingPositionalEmbedding.from_config(config, layer_type=layer_type)
            ours.load_state_dict({parameter: saved[f"model.llm.layers.{layer}.{name}"]
                                  for name, parameter in InklingPositionalEmbedding.checkpoint_names.items()})
            theirs = model.model.layers[layer].self_attn.relative_position_bias
            want = theirs(x, tokens[:, None] - tokens[None, :], tokens.expand(B, 7))
            torch.testing.assert_close(ours(x)(7, 7), want, rtol=1e-5, atol=1e-6)

    def test_zero_outside_the_look_back_window(self):
        pe = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=3, init_std=0.5)
        bias = pe(torch.randn(B, N, D))(N, N)
        distance = torch.arange(N)[:, None] - torch.arange(N)[None, :]
        inside = (distance >= 0) & (distance < 3)
        assert (bias[..., ~inside] == 0).all() and (bias[..., inside] != 0).all()

    @pytest.mark.parametrize("q_len", [N, N - 3])
    def test_flex_score_mod_matches_dense_bias(self, q_len):
        pe = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6, init_std=0.5, clip_threshold=1.0)
        bound = pe(torch.randn(B, N, D))
        q, k, v = qkv(q_len, N)
        want = attention(q, k, v, bound, causal=True, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, bound, causal=True, use_flex=True), want)

    def test_gradients_reach_the_states_and_weights(self):
        pe = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6, clip_threshold=0.5)
        x = torch.randn(B, N, D, requires_grad=True)
        q, k, v = qkv()
        attention(q, k, v, pe(x), causal=True).sum().backward()
        for grad in (x.grad, pe.r_proj.weight.grad, pe.proj.grad, pe.scale.grad):
            assert grad is not None and grad.abs().sum() > 0

    def test_layer_shares_the_weights(self):
        first = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6)
        second = InklingPositionalEmbedding(D, H, d_rel=4, max_distance=6, layer=first)
        assert second.proj is first.proj and second.r_proj is first.r_proj
        with pytest.raises(ValueError, match="InklingPositionalEmbedding: layer must hold r_proj.weight"):
            InklingPositionalEmbedding(D, H, d_rel=4, max_distance=7, layer=first)

    def test_bad_input(self):
        pe = InklingPositionalEmbedding(D, H)
        with pytest.raises(ValueError, match=rf"InklingPositionalEmbedding: x must be \[B, N, D={D}\]"):
            pe(torch.randn(2, N, D + 1))
        with pytest.raises(ValueError, match="InklingPositionalEmbedding: not bound to token states"):
            attention(*qkv(), pe)
        with pytest.raises(ValueError, match="InklingPositionalEmbedding: clip_threshold must be a finite number > 0"):
            InklingPositionalEmbedding(D, H, clip_threshold=0.0)
        with pytest.raises(ValueError, match="InklingPositionalEmbedding: positions_q must be None"):
            pe(torch.randn(B, N, D))(N, N, positions_q=torch.arange(N))


# ---------------------------------------------------------------------------
# Graphormer: shortest-path-distance bias and centrality
# ---------------------------------------------------------------------------


def hop_distances_oracle(adjacency: torch.Tensor) -> list:
    """Hop counts of the directed graph ``adjacency != 0`` by a breadth-first search from each node (a queue
    of plain ints): ``[N][N]``, None where no path exists."""
    n = adjacency.shape[-1]
    out = []
    for source in range(n):
        found = [None] * n
        found[source] = 0
        queue = collections.deque([source])
        while queue:
            node = queue.popleft()
            for nxt in range(n):
                if adjacency[node, nxt] != 0 and found[nxt] is None:
                    found[nxt] = found[node] + 1
                    queue.append(nxt)
        out.append(found)
    return out


def graphormer_bias_oracle(pe, adjacency: torch.Tensor) -> torch.Tensor:
    """The bias of one graph, entry by entry in float64: ``[H, T, T]``."""
    table = pe.spatial_pos_encoder.weight.detach().double()
    hops = hop_distances_oracle(adjacency)
    first = int(pe.graph_token)
    tokens = len(hops) + first
    bias = torch.empty(pe.num_heads, tokens, tokens, dtype=torch.float64)
    for h in range(pe.num_heads):
        for i in range(tokens):
            for j in range(tokens):
                if min(i, j) < first:
                    bias[h, i, j] = pe.graph_token_virtual_distance.weight[0, h].item()
                    continue
                d = hops[i - first][j - first]
                row = pe.num_spatial - 1 if d is None else min(d, pe.num_spatial - 2) + 1
                far = pe.attend_within is not None and (d is None or d >= pe.attend_within)
                bias[h, i, j] = float("-inf") if far else table[row, h].item()
    return bias


class TestGraphormer:
    def test_distances_are_breadth_first_hop_counts(self):
        split = torch.zeros(7, 7)
        split[0, 1] = split[1, 2] = split[3, 4] = split[4, 3] = split[5, 5] = 1.0       # pieces, a self-loop
        graphs = [random_graph(11, 0.2, seed, directed=True) for seed in range(3)] + [split]
        for adjacency in graphs:
            got = GraphormerPositionalEmbedding(2).bind(adjacency).distances
            want = hop_distances_oracle(adjacency)
            assert got.tolist() == [[pe_lib._UNREACHABLE if d is None else d for d in row] for row in want]
        batch = torch.stack(graphs[:3])
        got = GraphormerPositionalEmbedding(2).bind(batch).distances
        assert got.shape == (3, 11, 11)
        assert all(got[b].tolist() == GraphormerPositionalEmbedding(2).bind(graphs[b]).distances.tolist()
                   for b in range(3))
        twice = torch.tensor([[0, 0, 1, 2], [1, 1, 2, 0]])                              # 0 -> 1 twice
        dense = torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]])
        assert GraphormerPositionalEmbedding(2).bind(edge_index=twice, num_nodes=3).distances.tolist() == \
            GraphormerPositionalEmbedding(2).bind(dense).distances.tolist() == [[0, 1, 2], [2, 0, 1], [1, 2, 0]]

    @pytest.mark.parametrize("graph_token, attend_within, num_spatial", [(False, None, 512), (True, None, 4),
                                                                         (True, 2, 5), (False, 3, 3)])
    def test_bias_matches_the_loop_oracle(self, graph_token, attend_within, num_spatial):
        torch.manual_seed(0)
        pe = GraphormerPositionalEmbedding(3, num_spatial=num_spatial, graph_token=graph_token,
                                           attend_within=attend_within, init_std=1.0)
        split = random_graph(9, 0.15, 4, directed=True)
        split[:, 7:] = split[7:, :] = 0.0                                               # nodes 7, 8 unreachable
        graphs = torch.stack([random_graph(9, 0.2, 5, directed=True), split])
        bound = pe.bind(graphs)
        tokens = 9 + graph_token
        want = torch.stack([graphormer_bias_oracle(pe, g) for g in graphs])             # [2, H, T, T]
        torch.testing.assert_close(bound(tokens, tokens).double(), want, rtol=0, atol=1e-7)
        torch.testing.assert_close(bound(4, tokens).double(), want[..., -4:, :], rtol=0, atol=1e-7)
        q, k, v = (torch.randn(2, 3, tokens, 8, dtype=torch.float64) for _ in range(3))
        dense = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + want, dim=-1) @ v
        torch.testing.assert_close(attention(q, k, v, bound.double()), dense)
        torch.testing.assert_close(attention(q, k, v, bound.double(), use_flex=True), dense)

    def test_the_authors_table_rows(self):
        # their code: distance d reads row d + 1, unreachable pairs are 510 and read row 511 (num_spatial 512)
        pe = GraphormerPositionalEmbedding(1)
        with torch.no_grad():
            pe.spatial_pos_encoder.weight[:, 0] = torch.arange(512.0)                  # row r holds r
            pe.spatial_pos_encoder.weight[0, 0] = float("nan")                          # the padding row: never read
        path = torch.diag(torch.ones(11), 1)                                            # 0 -> 1 -> ... -> 11
        got = pe.bind(path)(12, 12)[0]
        assert got[0].tolist() == [float(d + 1) for d in range(12)]
        assert got[11, 0] == 511.0 and torch.isfinite(got).all()
        assert pe.spatial_pos_encoder.padding_idx == 0 and "spatial_pos_encoder.weight" in pe.state_dict()

    def test_matches_attention_gym_score_mod(self):
        gym = pytest.importorskip("attn_gym.mods.graphormer")
        from torch.nn.attention.flex_attention import flex_attention

        max_distance, heads = 3, 4
        adjacency = torch.stack([random_graph(12, 0.15, seed, directed=True) for seed in (6, 7)]).bool()
        adjacency[1, :, 10:] = adjacency[1, 10:, :] = False                             # unreachable pairs
        table = torch.randn(heads, max_distance + 2, generator=torch.Generator().manual_seed(0))
        distances = gym.shortest_path_distances(adjacency, max_distance)                # [2, 12, 12]
        pe = GraphormerPositionalEmbedding(heads, num_spatial=max_distance + 3)
        with torch.no_grad():
            pe.spatial_pos_encoder.weight[1:] = table.T                                 # their bucket d is our row d + 1
        bound = pe.bind(adjacency)
        assert bound.distances.clamp_max(max_distance + 1).tolist() == distances.tolist()
        q, k, v = (torch.randn(2, heads, 12, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
        want = flex_attention(q, k, v, score_mod=gym.generate_graphormer_spatial_bias(table, distances))
        torch.testing.assert_close(attention(q, k, v, bound), want, rtol=0, atol=1e-6)

    def test_centrality_adds_in_and_out_degree_rows(self):
        torch.manual_seed(0)
        pe = GraphormerPositionalEmbedding(2, dim=6, num_degree=4, init_std=1.0)
        graphs = torch.stack([random_graph(8, 0.3, 8, directed=True), random_graph(8, 0.2, 9)])
        graphs[0, 3, 3] = 1.0                                                           # a self-loop counts
        x = torch.randn(2, 8, 6, dtype=torch.float64)
        got = pe.bind(graphs).centrality(x)
        for b in range(2):
            for v in range(8):
                into = sum(int(graphs[b, u, v] != 0) for u in range(8))
                out = sum(int(graphs[b, v, u] != 0) for u in range(8))
                want = x[b, v] + pe.in_degree_encoder.weight[min(into, 2) + 1].double() \
                    + pe.out_degree_encoder.weight[min(out, 2) + 1].double()
                torch.testing.assert_close(got[b, v], want)
        one = pe.bind(graphs[1])                                                        # undirected: in = out
        assert one.in_degrees.tolist() == one.out_degrees.tolist()
        assert one.centrality(x[1]).shape == (8, 6)

    def test_bound_encodings_share_the_parameters(self):
        pe = GraphormerPositionalEmbedding(2, graph_token=True, dim=4)
        bound = pe.bind(ring_with_chords(5))
        assert dict(bound.named_parameters()).keys() == dict(pe.named_parameters()).keys()
        assert all(a is b for a, b in zip(bound.parameters(), pe.parameters()))
        assert pe.distances is None and bound.distances.shape == (6, 6)
        q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
        attention(q, k, v, bound).square().sum().backward()
        grad = pe.spatial_pos_encoder.weight.grad
        assert grad[0].abs().sum() == 0 and grad[1:4].abs().sum() > 0 and grad[4:].abs().sum() == 0   # rows 1..3 read
        assert pe.graph_token_virtual_distance.weight.grad.abs().sum() > 0

    def test_errors_name_the_fix(self):
        pe = GraphormerPositionalEmbedding(2)
        q = k = v = torch.randn(1, 2, 5, 4)
        with pytest.raises(ValueError, match=r"^GraphormerPositionalEmbedding: not bound to a graph: .*pe\.bind\(adjacency\)"):
            attention(q, k, v, pe)
        bound = pe.bind(ring_with_chords(4))
        with pytest.raises(ValueError, match="k must have at most the bound graph's 4 tokens"):
            attention(q, k, v, bound)
        with pytest.raises(ValueError, match=r"q must be \[B=2, H, T, Dh\] for the 2 bound graphs"):
            attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], pe.bind(torch.stack([ring_with_chords(4)] * 2)))
        with pytest.raises(ValueError, match="centrality needs the degree tables: build with dim=D"):
            bound.centrality(torch.randn(4, 3))
        with pytest.raises(ValueError, match=r"x must be \[4, 3\] \(the bound graph's nodes\), got \(5, 3\)"):
            GraphormerPositionalEmbedding(2, dim=3).bind(ring_with_chords(4)).centrality(torch.randn(5, 3))
        with pytest.raises(ValueError, match=r"adjacency must be \[N, N\] or \[B, N, N\] with at least one node, "
                                             r"got \(1, 1, 3, 3\)"):
            pe.bind(torch.zeros(1, 1, 3, 3))
        for empty in (torch.zeros(0, 0), torch.zeros(2, 0, 0)):                         # torch's reshape error before
            shape = re.escape(str(tuple(empty.shape)))
            with pytest.raises(ValueError, match=r"GraphormerPositionalEmbedding: adjacency must be \[N, N\] or "
                                                 rf"\[B, N, N\] with at least one node, got {shape}"):
                pe.bind(empty)
        with pytest.raises(ValueError, match="positions_q must be None: a node's place comes from the bound graph"):
            bound(4, 4, positions_q=torch.arange(4))


# ===========================================================================
# Logits kind: computes the logits from q and k
# ===========================================================================


# ---------------------------------------------------------------------------
# Transformer-XL
# ---------------------------------------------------------------------------


def sinusoid_concat(d, d_model, base=10000.0):
    return ([math.sin(d * base ** (-2 * k / d_model)) for k in range(d_model // 2)]
            + [math.cos(d * base ** (-2 * k / d_model)) for k in range(d_model // 2)])


def matvec(w, x):
    return [sum(wr[c] * x[c] for c in range(len(x))) for wr in w]


class TestTransformerXL:
    def xl_oracle(self, xl, q, k, pos_q, pos_k, scale):
        u, v, w_r = xl.r_w_bias.tolist(), xl.r_r_bias.tolist(), xl.r_net.weight.tolist()
        out = torch.zeros(q.shape[0], q.shape[1], len(pos_q), len(pos_k), dtype=torch.float64)
        for i, p in enumerate(pos_q):
            for j, r in enumerate(pos_k):
                distance = p - r
                if xl.clamp_len is not None:
                    distance = max(-xl.clamp_len, min(xl.clamp_len, distance))
                rel = matvec(w_r, sinusoid_concat(distance, xl.d_model))
                for b in range(q.shape[0]):
                    for h in range(q.shape[1]):
                        qi, kj = q[b, h, i].tolist(), k[b, h, j].tolist()
                        rh = rel[h * xl.head_dim : (h + 1) * xl.head_dim]
                        ac = sum((qi[c] + u[h][c]) * kj[c] for c in range(xl.head_dim))
                        bd = sum((qi[c] + v[h][c]) * rh[c] for c in range(xl.head_dim))
                        out[b, h, i, j] = scale * (ac + bd)
        return out

    @pytest.mark.parametrize("nq, nk", [(5, 5), (3, 8)])
    def test_bidirectional_and_memory_match_oracle(self, nq, nk):
        xl = TransformerXLPositionalEmbedding(2, 4, d_model=6).double()
        q, k = torch.randn(1, 2, nq, 4, dtype=torch.float64), torch.randn(1, 2, nk, 4, dtype=torch.float64)
        want = self.xl_oracle(xl, q, k, [i + nk - nq for i in range(nq)], list(range(nk)), 0.5)
        torch.testing.assert_close(xl(q, k), want)

    def test_explicit_float_positions_and_clamp_match_oracle(self):
        xl = TransformerXLPositionalEmbedding(2, 4, clamp_len=3).double()
        q, k = torch.randn(2, 2, 3, 4, dtype=torch.float64), torch.randn(2, 2, 4, 4, dtype=torch.float64)
        pos_q, pos_k = [0.5, 10.0, 4.0], [1.0, -6.5, 2.0, 4.0]
        got = xl(q, k, torch.tensor(pos_q, dtype=torch.float64), torch.tensor(pos_k, dtype=torch.float64))
        torch.testing.assert_close(got, self.xl_oracle(xl, q, k, pos_q, pos_k, 0.5))

    def test_equals_reference_rel_shift_below_the_diagonal(self):
        # the reference: BD against R(klen-1 .. 0), zero-pad, reshape, drop a row (valid where j <= i + mlen)
        xl = TransformerXLPositionalEmbedding(2, 4)
        qlen, mlen = 4, 3
        klen = qlen + mlen
        q, k = torch.randn(1, 2, qlen, 4), torch.randn(1, 2, klen, 4)
        r = xl.relative_keys(-torch.arange(klen - 1, -1, -1))                          # R(klen-1), ..., R(0)
        bd = torch.einsum("bhid,hjd->bhij", q + xl.r_r_bias[:, None], r)                # [1, 2, qlen, klen]
        padded = torch.cat([torch.zeros(1, 2, qlen, 1), bd], -1).view(1, 2, klen + 1, qlen)
        shifted = padded[:, :, 1:].reshape(1, 2, qlen, klen)
        ac = torch.einsum("bhid,bhjd->bhij", q + xl.r_w_bias[:, None], k)
        reference = (ac + shifted) * 0.5
        ours = xl(q, k)
        valid = torch.arange(klen)[None, :] <= torch.arange(qlen)[:, None] + mlen
        torch.testing.assert_close(ours[..., valid], reference[..., valid])
        assert not torch.allclose(ours[..., ~valid], reference[..., ~valid])   # the reference's garbage

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="TransformerXLPositionalEmbedding: d_model must be a positive even int, got d_model=7"):
            TransformerXLPositionalEmbedding(2, 4, d_model=7)
        xl = TransformerXLPositionalEmbedding(2, 4)
        with pytest.raises(ValueError, match="q and k must be \\[..., H=2, N, Dh=4\\]"):
            xl(torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4))

    @pytest.mark.parametrize("cls", [TransformerXLPositionalEmbedding, EnformerPositionalEmbedding])
    def test_gradcheck_float_positions(self, cls):
        pe = (cls(2, 4, d_model=6) if cls is TransformerXLPositionalEmbedding
              else cls(2, 4, num_features=12, length_scale=16)).double()
        q, k = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 4, 4, dtype=torch.float64)
        # distinct distances away from 0 and from the central masks' steps (2**k - 1)
        pos_q = torch.tensor([0.25, 4.6, 9.1], dtype=torch.float64, requires_grad=True)
        pos_k = torch.tensor([2.1, 5.45, 0.7, 12.35], dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b: pe(q, k, a, b), (pos_q, pos_k))
        batched = torch.stack([pos_q.detach(), pos_q.detach() + 0.05]).requires_grad_()
        assert torch.autograd.gradcheck(lambda a: pe(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), a, pos_k),
                                        (batched,))
        # the values equal the no-grad (distinct-distance) path
        torch.testing.assert_close(pe(q, k, pos_q, pos_k), pe(q, k, pos_q.detach(), pos_k.detach()))

    def test_transformer_xl_rejects_more_queries_than_keys_with_default_positions(self):
        xl = TransformerXLPositionalEmbedding(2, 4)
        q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)
        with pytest.raises(ValueError, match="TransformerXLPositionalEmbedding: q must not have more tokens than k "
                                             r"\(queries are the last Nq keys\), got Nq=5 and Nk=3; pass positions_q "
                                             "and positions_k explicitly"):
            xl(q, k)
        out = xl(q, k, torch.arange(5), torch.arange(3))                                # explicit: defined
        assert out.shape == (1, 2, 5, 3)
        assert xl(q[..., :3, :], k).shape == (1, 2, 3, 3)


# ---------------------------------------------------------------------------
# Enformer
# ---------------------------------------------------------------------------


def enformer_features_oracle(d, num_basis, length, min_half_life=3.0, symmetric=False):
    """Enformer's basis functions of one distance, in plain Python (DeepMind's normalisation)."""
    def gamma_raw(x):
        out = []
        stddev = length / (2 * num_basis)
        for k in range(num_basis):
            mean = length / num_basis + k * (length - length / num_basis) / (num_basis - 1)
            c, rate = (mean / stddev) ** 2, mean / stddev ** 2
            log_pdf = -math.inf if x == 0 else (c - 1) * math.log(x) - rate * x - (math.lgamma(c) - c * math.log(rate))
            out.append(math.exp(log_pdf) + 1e-8)
        return out

    x = abs(d)
    exponential = []
    for k in range(num_basis):
        half_life = 2 ** (min_half_life + k * (math.log2(length) - min_half_life) / (num_basis - 1))
        exponential.append(math.exp(-math.log(2) / half_life * x))
    central = [1.0 if 2 ** (k + 1) - 1 > x else 0.0 for k in range(num_basis)]
    peaks = [max(col) for col in zip(*[gamma_raw(y) for y in range(length)])]
    gamma = [g / p for g, p in zip(gamma_raw(x), peaks)]
    features = exponential + central + gamma
    if symmetric:
        return features
    sign = (d > 0) - (d < 0)
    return features + [sign * f for f in features]


def enformer_gamma_raw(x, num_basis, length):
    """Unnormalised gamma densities (plus 1e-8) at |x|, DeepMind's and enformer-pytorch's formula."""
    out, stddev = [], length / (2 * num_basis)
    for k in range(num_basis):
        mean = length / num_basis + k * (length - length / num_basis) / (num_basis - 1)
        c, rate = (mean / stddev) ** 2, mean / stddev ** 2
        x = abs(x)
        log_pdf = -math.inf if x == 0 else (c - 1) * math.log(x) - rate * x - (math.lgamma(c) - c * math.log(rate))
        out.append(math.exp(log_pdf) + 1e-8)
    return out


class TestEnformer:
    def test_features_match_oracle(self):
        enformer = EnformerPositionalEmbedding(2, 4, num_features=24, length_scale=50)
        distances = [-49, -7, -1, 0, 1, 3, 20, 49, 120]
        got = enformer.features(torch.tensor(distances))
        want = torch.tensor([enformer_features_oracle(d, 4, 50) for d in distances], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    def test_logits_match_oracle(self):
        enformer = EnformerPositionalEmbedding(2, 3, num_features=12, length_scale=16).double()
        q, k = torch.randn(1, 2, 3, 3, dtype=torch.float64), torch.randn(1, 2, 5, 3, dtype=torch.float64)
        u, v, w_r = enformer.r_w_bias.tolist(), enformer.r_r_bias.tolist(), enformer.r_k.weight.tolist()
        scale = 3 ** -0.5
        got = enformer(q, k)
        for i in range(3):
            for j in range(5):
                rel = matvec(w_r, enformer_features_oracle(j - (i + 2), 2, 16))
                for h in range(2):
                    qi, kj, rh = q[0, h, i].tolist(), k[0, h, j].tolist(), rel[h * 3 : h * 3 + 3]
                    want = sum((scale * qi[c] + u[h][c]) * kj[c] + (scale * qi[c] + v[h][c]) * rh[c] for c in range(3))
                    assert got[0, h, i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-12)

    def test_equals_deepmind_relative_shift(self):
        # DeepMind: distances -T+1 .. T-1, logits against them, then pad/reshape/slice
        enformer = EnformerPositionalEmbedding(2, 4, num_features=12, length_scale=64)
        t = 6
        q, k = torch.randn(1, 2, t, 4), torch.randn(1, 2, t, 4)
        keys = enformer.relative_keys(torch.arange(-t + 1, t))                          # [H, 2T-1, Dh]
        rel = torch.einsum("bhid,hjd->bhij", q * 0.5 + enformer.r_r_bias[:, None], keys)
        padded = torch.cat([torch.zeros_like(rel[..., :1]), rel], -1).reshape(1, 2, 2 * t, t)
        shifted = padded[:, :, 1:].reshape(1, 2, t, 2 * t - 1)[..., : (2 * t + 1) // 2]
        content = torch.einsum("bhid,bhjd->bhij", q * 0.5 + enformer.r_w_bias[:, None], k)
        torch.testing.assert_close(enformer(q, k), content + shifted)

    def test_pair_does_not_depend_on_sequence_length(self):
        enformer = EnformerPositionalEmbedding(2, 4, num_features=12, length_scale=64)
        q, k = torch.randn(1, 2, 40, 4), torch.randn(1, 2, 40, 4)
        torch.testing.assert_close(enformer(q[..., :10, :], k[..., :10, :]), enformer(q, k)[..., :10, :10])

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="EnformerPositionalEmbedding: num_features must be a positive multiple of 6 "
                                             "\\(symmetric=False\\), got num_features=8"):
            EnformerPositionalEmbedding(2, 4, num_features=8)

    @pytest.mark.parametrize("normalization", ["per_feature", "global", "per_distance"])
    def test_enformer_gamma_normalisations_match_their_formulas(self, normalization):
        num_basis, length = 4, 40
        enformer = EnformerPositionalEmbedding(2, 4, num_features=6 * num_basis, length_scale=length,
                                               gamma_normalization=normalization)
        # every distance of an input of `length` tokens, as both references evaluate them
        distances = list(range(-length + 1, length))
        raw = [enformer_gamma_raw(d, num_basis, length) for d in distances]
        if normalization == "global":            # DeepMind: probabilities / tf.reduce_max(probabilities)
            top = max(max(row) for row in raw)
            want = [[g / top for g in row] for row in raw]
        elif normalization == "per_distance":    # enformer-pytorch: probabilities / amax(probabilities, dim=-1)
            want = [[g / max(row) for g in row] for row in raw]
        else:                                    # each density over its own peak
            peaks = [max(row[f] for row in raw) for f in range(num_basis)]
            want = [[g / p for g, p in zip(row, peaks)] for row in raw]
        got = enformer.features(torch.tensor(distances))[:, 2 * num_basis : 3 * num_basis]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-15)
        assert normalization in repr(enformer)

    def test_enformer_gamma_normalisations_differ_and_default_is_per_feature(self):
        make = lambda **kw: EnformerPositionalEmbedding(2, 4, num_features=24, length_scale=40, **kw).features(
            torch.arange(-39, 40))
        features = {n: make(gamma_normalization=n) for n in ("per_feature", "global", "per_distance")}
        torch.testing.assert_close(make(), features["per_feature"], rtol=0, atol=0)
        assert (features["global"] - features["per_feature"]).abs().max() > 1e-2
        assert (features["per_distance"] - features["per_feature"]).abs().max() > 1e-1
        with pytest.raises(ValueError, match="EnformerPositionalEmbedding: gamma_normalization must be one of "
                                             "'per_feature', 'global', 'per_distance', got gamma_normalization='max'"):
            EnformerPositionalEmbedding(2, 4, num_features=24, gamma_normalization="max")


# ---------------------------------------------------------------------------
# Shaw
# ---------------------------------------------------------------------------


def shaw_oracle(pe, q, k, v, pos_q, pos_k, scale, allowed=None):
    """Shaw et al.'s equations pair by pair in float64: (logits [B, H, Nq, Nk], output [B, H, Nq, Dh])."""
    a_k = pe.relative_keys.weight.double().tolist()
    a_v = None if pe.relative_values is None else pe.relative_values.weight.double().tolist()
    batch, heads, nq, dh = q.shape
    nk = k.shape[-2]
    logits = torch.zeros(batch, heads, nq, nk, dtype=torch.float64)
    out = torch.zeros(batch, heads, nq, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        pq = pos_q[b] if isinstance(pos_q[0], list) else pos_q
        pk = pos_k[b] if isinstance(pos_k[0], list) else pos_k
        for h in range(heads):
            for i in range(nq):
                qi = q[b, h, i].tolist()
                row = []
                for j in range(nk):
                    kj = k[b, h, j].tolist()
                    r = pe.left + max(-pe.left, min(pe.right, pk[j] - pq[i]))
                    s = sum(qi[c] * (kj[c] + a_k[r][c]) for c in range(dh))
                    if pe.key_query:
                        s += sum(kj[c] * a_k[r][c] for c in range(dh))
                    logits[b, h, i, j] = scale * s
                    row.append((scale * s, r))
                keep = [j for j in range(nk) if allowed is None or allowed[i][j]]
                top = max(row[j][0] for j in keep)
                exps = {j: math.exp(row[j][0] - top) for j in keep}
                total = sum(exps.values())
                for j in keep:
                    w = exps[j] / total
                    for c in range(v.shape[-1]):
                        out[b, h, i, c] += w * (v[b, h, j, c].item() + (0.0 if a_v is None else a_v[row[j][1]][c]))
    return logits, out


def opennmt_attention(table, q, k, v, cache=False):
    """OpenNMT-py's MultiHeadedAttention core with ``max_relative_positions`` (onmt/modules/multi_headed_attn.py,
    ``generate_relative_positions_matrix`` and ``relative_matmul`` in onmt/utils/misc.py, v1.x/v2.x), ported:
    one table serves keys and values; ``cache=True`` is its decoding step (the last query only)."""
    max_rel = (table.shape[0] - 1) // 2
    key_len = k.shape[2]
    if cache:
        distance_mat = torch.arange(-key_len + 1, 1, 1).unsqueeze(0)
    else:
        range_vec = torch.arange(key_len)
        range_mat = range_vec.unsqueeze(-1).expand(-1, key_len).transpose(0, 1)
        distance_mat = range_mat - range_mat.transpose(0, 1)
    final_mat = torch.clamp(distance_mat, min=-max_rel, max=max_rel) + max_rel
    relations = F.embedding(final_mat, table)                                   # [1 or L, L, Dh]

    def relative_matmul(x, z, transpose):
        batch_size, heads, length = x.shape[0], x.shape[1], x.shape[2]
        x_t_r = x.permute(2, 0, 1, 3).reshape(length, heads * batch_size, -1)
        x_tz = torch.matmul(x_t_r, z.transpose(1, 2) if transpose else z)
        return x_tz.reshape(length, batch_size, heads, -1).permute(1, 2, 0, 3)

    q = q / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) + relative_matmul(q, relations, True)
    attn = torch.softmax(scores, -1)
    return torch.matmul(attn, v) + relative_matmul(attn, relations, False)


def bert_relative_attention(distance_embedding, q, k, v, key_query, mask=None):
    """transformers 4.x ``BertSelfAttention`` with ``position_embedding_type="relative_key(_query)"``, ported
    (its ``distance_embedding`` has ``2 M - 1`` rows indexed by query - key + M - 1; removed in transformers 5)."""
    max_position_embeddings = (distance_embedding.shape[0] + 1) // 2
    query_length, key_length = q.shape[2], k.shape[2]
    position_ids_l = torch.arange(query_length, dtype=torch.long).view(-1, 1)
    position_ids_r = torch.arange(key_length, dtype=torch.long).view(1, -1)
    distance = position_ids_l - position_ids_r
    positional_embedding = F.embedding(distance + max_position_embeddings - 1, distance_embedding)
    attention_scores = torch.matmul(q, k.transpose(-1, -2))
    attention_scores = attention_scores + torch.einsum("bhld,lrd->bhlr", q, positional_embedding)
    if key_query:
        attention_scores = attention_scores + torch.einsum("bhrd,lrd->bhlr", k, positional_embedding)
    attention_scores = attention_scores / math.sqrt(q.shape[-1])
    if mask is not None:
        attention_scores = attention_scores + mask
    return torch.matmul(torch.softmax(attention_scores, -1), v)


class TestShaw:
    @pytest.mark.parametrize("nq, nk, causal", [(5, 5, False), (5, 5, True), (3, 7, True), (3, 7, False)])
    @pytest.mark.parametrize("max_distance, key_query", [(2, False), ((3, 1), True), (0, False)])
    def test_matches_loop_oracle_default_positions(self, nq, nk, causal, max_distance, key_query):
        pe = ShawPositionalEmbedding(2, 4, max_distance=max_distance, key_query=key_query, init_std=1.0).double()
        q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64) for n in (nq, nk, nk))
        pos_q, pos_k = list(range(nk - nq, nk)), list(range(nk))
        allowed = [[j <= i + nk - nq or not causal for j in range(nk)] for i in range(nq)]
        want_logits, want_out = shaw_oracle(pe, q, k, v, pos_q, pos_k, 0.5, allowed)
        torch.testing.assert_close(pe(q, k), want_logits)
        torch.testing.assert_close(attention(q, k, v, pe, causal=causal), want_out)

    def test_matches_loop_oracle_batched_positions_scale_and_mask(self):
        pe = ShawPositionalEmbedding(2, 4, max_distance=(2, 3), key_query=True, init_std=1.0).double()
        q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64) for n in (3, 5, 5))
        pos_q = [[4, -7, 10], [0, 0, 100]]
        pos_k = [[0, 1, 2, 30, -3], [5, 4, 3, 2, 1]]
        keep = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 0, 1]], dtype=torch.bool)
        want_logits, want_out = shaw_oracle(pe, q, k, v, pos_q, pos_k, 0.3, keep.tolist())
        tq, tk = torch.tensor(pos_q), torch.tensor(pos_k)
        torch.testing.assert_close(pe(q, k, tq, tk, scale=0.3), want_logits)
        got = attention(q, k, v, pe, positions_q=tq, positions_k=tk, attn_mask=keep, scale=0.3)
        torch.testing.assert_close(got, want_out)

    def test_float32_value_term_error(self):
        pe = ShawPositionalEmbedding(2, 8, max_distance=3, init_std=1.0)
        q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
        want = shaw_oracle(pe, q.double(), k.double(), v.double(), list(range(9)), list(range(9)), 8 ** -0.5)[1]
        error = (attention(q, k, v, pe).double() - want).abs().max().item()
        assert error < 2e-6, error

    def test_matches_opennmt(self):
        torch.manual_seed(1)
        table = torch.randn(2 * 3 + 1, 8, dtype=torch.float64)
        pe = ShawPositionalEmbedding(2, 8, max_distance=3).double()
        with torch.no_grad():
            pe.relative_keys.weight.copy_(table)
            pe.relative_values.weight.copy_(table)              # OpenNMT-py shares one table
        q, k, v = (torch.randn(2, 2, 10, 8, dtype=torch.float64) for _ in range(3))
        torch.testing.assert_close(attention(q, k, v, pe), opennmt_attention(table, q, k, v))
        step = attention(q[:, :, -1:], k, v, pe, causal=True)      # decoding: the last query, bottom-right
        torch.testing.assert_close(step, opennmt_attention(table, q[:, :, -1:], k, v, cache=True))

    @pytest.mark.parametrize("key_query", [False, True])
    def test_matches_bert_relative_key_after_flip(self, key_query):
        distance_embedding = torch.randn(2 * 12 - 1, 8, dtype=torch.float64)   # max_position_embeddings = 12
        pe = ShawPositionalEmbedding.from_bert(nn.Embedding.from_pretrained(distance_embedding), 2,
                                               key_query=key_query)
        assert pe.max_distance == 11 and pe.relative_values is None and pe.key_query is key_query
        q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
        pad = torch.zeros(2, 1, 1, 12, dtype=torch.float64)
        pad[1, ..., 9:] = float("-inf")
        want = bert_relative_attention(distance_embedding, q, k, v, key_query, pad)
        torch.testing.assert_close(attention(q, k, v, pe, attn_mask=pad), want)
        unflipped = ShawPositionalEmbedding(2, 8, max_distance=11, key_query=key_query, values=False).double()
        with torch.no_grad():
            unflipped.relative_keys.weight.copy_(distance_embedding)
        assert not torch.allclose(attention(q, k, v, unflipped, attn_mask=pad), want)

    def test_matches_transformers_wav2vec2_bert_relative_key(self):
        transformers = pytest.importorskip("transformers")
        from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

        config = transformers.Wav2Vec2BertConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                                                 position_embeddings_type="relative_key",
                                                 left_max_position_embeddings=5, right_max_position_embeddings=2)
        config._attn_implementation = "eager"
        reference = Wav2Vec2BertSelfAttention(config).eval()
        with torch.no_grad():
            nn.init.normal_(reference.distance_embedding.weight)
        pe = ShawPositionalEmbedding(4, 8, max_distance=(5, 2), values=False)
        pe.relative_keys.weight.data.copy_(reference.distance_embedding.weight)
        x = torch.randn(2, 11, 32)
        heads = lambda t: t.unflatten(-1, (4, 8)).transpose(1, 2)                         # noqa: E731
        q, k, v = heads(reference.linear_q(x)), heads(reference.linear_k(x)), heads(reference.linear_v(x))
        ours = reference.linear_out(attention(q, k, v, pe).transpose(1, 2).flatten(-2))
        with torch.no_grad():
            want = reference(x)[0]
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)

    def test_value_term_never_builds_pair_by_dim_tensors(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class LargestOutput(TorchDispatchMode):
            largest = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        LargestOutput.largest = max(LargestOutput.largest, t.numel())
                return out

        n, dh = 40, 8
        pe = ShawPositionalEmbedding(H, dh, max_distance=3, key_query=True)
        q, k, v = (torch.randn(B, H, n, dh) for _ in range(3))
        pairs = B * H * n * n                                           # [B, H, N, N, Dh] would be 8x this
        for positions in (None, torch.arange(n).expand(B, n)):
            LargestOutput.largest = 0
            with LargestOutput():
                attention(q, k, v, pe, positions_q=positions, positions_k=positions)
            assert LargestOutput.largest == pairs, LargestOutput.largest

    def test_dropout_reaches_the_value_term(self):
        pe = ShawPositionalEmbedding(2, 4, max_distance=2, init_std=1.0).double()
        q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
        torch.manual_seed(3)
        got = attention(q, k, v, pe, dropout_p=0.5)
        torch.manual_seed(3)
        weights = F.dropout(torch.softmax(pe(q, k), -1), p=0.5)
        rows = (torch.arange(6)[None, :] - torch.arange(6)[:, None]).clamp(-2, 2) + 2
        want = weights @ v + torch.einsum("bhij,ijd->bhid", weights, pe.relative_values.weight[rows])
        torch.testing.assert_close(got, want)

    def test_bad_arguments(self):
        name = "ShawPositionalEmbedding"
        with pytest.raises(ValueError, match=f"{name}: max_distance must be a non-negative int, got max_distance=-1"):
            ShawPositionalEmbedding(2, 4, max_distance=-1)
        with pytest.raises(ValueError, match=f"{name}: max_distance must be an int or a pair"):
            ShawPositionalEmbedding(2, 4, max_distance=(1, 2, 3))
        with pytest.raises(TypeError, match=f"{name}: max_distance must be an int, got float 2.5"):
            ShawPositionalEmbedding(2, 4, max_distance=2.5)
        with pytest.raises(TypeError, match=f"{name}: key_query must be a bool, got str 'false'"):
            ShawPositionalEmbedding(2, 4, key_query="false")
        with pytest.raises(TypeError, match=f"{name}: values must be a bool"):
            ShawPositionalEmbedding(2, 4, values=1)
        with pytest.raises(ValueError, match=f"{name}: distance_embedding must be a \\[2 M - 1, Dh\\] table"):
            ShawPositionalEmbedding.from_bert(torch.zeros(4, 8), 2)

    @pytest.mark.parametrize("make", [lambda: ShawPositionalEmbedding(2, 4), lambda: TransformerXLPositionalEmbedding(2, 4),
                                      lambda: DebertaPositionalEmbedding(8, 2, position_buckets=4,
                                                                         max_relative_positions=8),
                                      lambda: CoPEPositionalEmbedding(2, 4), StickBreakingPositionalEmbedding,
                                      lambda: ReRoPEPositionalEmbedding(4, window=2)],
                             ids=["shaw", "transformer_xl", "deberta", "cope", "stick_breaking", "rerope"])
    def test_forward_attn_scale_is_checked(self, make):
        """The logits kinds' forward / forward_attn scale: a str was a raw torch error, a NaN gave NaN logits."""
        pe = make().double()
        name = type(pe).__name__
        q, k = torch.randn(2, 2, 3, 4, dtype=torch.float64), torch.randn(2, 2, 3, 4, dtype=torch.float64)
        for bad, error, message in [("a", TypeError, "must be a real number, got str 'a'"),
                                    (True, TypeError, "must be a real number, got bool True"),
                                    (float("nan"), ValueError, "must be a finite number, got scale=nan")]:
            for call in (pe.forward_attn, pe.forward, pe.full_precision_logits):
                with pytest.raises(error, match=f"^{name}: scale {message}$"):
                    call(q, k, scale=bad)
        assert torch.equal(pe.forward_attn(q, k, scale=2), pe.forward_attn(q, k, scale=2.0))

    def test_numpy_ints_are_accepted(self):
        numpy = pytest.importorskip("numpy")
        pe = ShawPositionalEmbedding(numpy.int64(2), 4, max_distance=(numpy.int32(3), 1))
        assert (pe.num_heads, pe.left, pe.right) == (2, 3, 1) and type(pe.left) is int

    def test_float_positions_in_value_term_are_type_error(self):
        pe = ShawPositionalEmbedding(H, DH)
        weights = torch.softmax(torch.randn(B, H, N, N), -1)
        with pytest.raises(TypeError, match="ShawPositionalEmbedding: positions_k must be an integer tensor"):
            pe.attention_values(weights, torch.arange(N), torch.arange(N, dtype=torch.float32))

    def test_shaw_value_term_needs_v_of_the_head_dim(self):
        q, k, v = qkv()
        wide = torch.randn(B, H, N, DH + 8)
        with pytest.raises(ValueError, match=r"ShawPositionalEmbedding: v must have the head dim Dh=32 .* "
                                             r"got v \(2, 4, 16, 40\)"):
            attention(q, k, wide, ShawPositionalEmbedding(H, DH))
        no_values = ShawPositionalEmbedding(H, DH, values=False)
        assert attention(q, k, wide, no_values).shape == (B, H, N, DH + 8)


# ---------------------------------------------------------------------------
# DeBERTa
# ---------------------------------------------------------------------------


def deberta_bucket_oracle(d, buckets, max_position):
    """DeBERTa-v2's log bucket of one query - key distance, in plain Python (float64 logs)."""
    mid = buckets // 2
    if abs(d) <= mid:
        return d
    log_pos = math.ceil(math.log(abs(d) / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return int(math.copysign(log_pos, d))


def deberta_oracle(pe, q, k, pos_q, pos_k, scale):
    """The disentangled logits pair by pair in float64, with transformers' c2p and p2c index."""
    table = pe.rel_embeddings.weight.double()
    if pe.norm is not None:
        mean = table.mean(-1, keepdim=True)
        var = ((table - mean) ** 2).mean(-1, keepdim=True)
        table = (table - mean) / torch.sqrt(var + pe.norm.eps) * pe.norm.weight.double() + pe.norm.bias.double()
    linear = lambda m: (table @ m.weight.double().T + m.bias.double()).tolist()           # noqa: E731
    query_proj, key_proj = (pe.query_proj, pe.key_proj) if pe.query_proj is not None else \
        (getattr(pe, "pos_query_proj", None), getattr(pe, "pos_key_proj", None))
    pos_query = linear(query_proj) if "p2c" in pe.pos_att_type else None
    pos_key = linear(key_proj) if "c2p" in pe.pos_att_type else None
    span, dh = pe.span, pe.head_dim
    out = torch.zeros(q.shape[0], q.shape[1], len(pos_q), len(pos_k), dtype=torch.float64)
    for i, p in enumerate(pos_q):
        for j, r in enumerate(pos_k):
            rel = p - r if pe.position_buckets is None else deberta_bucket_oracle(p - r, pe.position_buckets,
                                                                                   pe.max_relative_positions)
            idx = max(0, min(2 * span - 1, rel + span))
            for b in range(q.shape[0]):
                for h in range(q.shape[1]):
                    qi, kj = q[b, h, i].tolist(), k[b, h, j].tolist()
                    s = sum(qi[c] * kj[c] for c in range(dh))
                    if pos_key is not None:
                        s += sum(qi[c] * pos_key[idx][h * dh + c] for c in range(dh))
                    if pos_query is not None:
                        s += sum(kj[c] * pos_query[idx][h * dh + c] for c in range(dh))
                    out[b, h, i, j] = scale * s
    return out


class TestDeberta:
    def test_buckets_equal_transformers_and_oracle(self):
        distances = torch.arange(-3000, 3001)
        for buckets, max_position in ((256, 512), (8, 16), (4, 12), (32, 128)):
            got = deberta_log_bucket(distances, position_buckets=buckets, max_relative_positions=max_position)
            want = [deberta_bucket_oracle(d, buckets, max_position) for d in distances.tolist()]
            assert got.tolist() == want
        # published shape: exact within +-mid, position_buckets - 1 at max_relative_positions - 1
        got = deberta_log_bucket(torch.tensor([-128, 5, 128, 129, 511, -511]))
        assert got.tolist()[:3] == [-128, 5, 128] and got[3] == 129 and got[4] == 255 and got[5] == -255
        transformers = pytest.importorskip("transformers")
        from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position
        for buckets, max_position in ((256, 512), (8, 16)):
            want = make_log_bucket_position(distances, buckets, max_position).long()
            assert torch.equal(deberta_log_bucket(distances, position_buckets=buckets,
                                                  max_relative_positions=max_position), want)

    def test_integer_extremes_and_narrow_dtypes(self):
        """abs(-2**63) wrapped (and int8's -128): the distance came back unbucketed; a uint8 cannot hold
        mid - 1 (a raw RuntimeError); near distances past 2**24 lost their value in float32."""
        for dtype, buckets, max_position in ((torch.int64, 256, 512), (torch.int32, 256, 512), (torch.int8, 64, 128),
                                             (torch.uint8, 1024, 2048)):
            info = torch.iinfo(dtype)
            d = torch.tensor([x for x in (info.min, info.min + 1, -5, 0, 5, info.max) if x >= info.min], dtype=dtype)
            got = deberta_log_bucket(d, position_buckets=buckets, max_relative_positions=max_position)
            assert got.tolist() == [deberta_bucket_oracle(x, buckets, max_position) for x in d.tolist()], dtype
        near = torch.tensor([2**25 + 1, -(2**25 + 1)])
        assert deberta_log_bucket(near, position_buckets=2**27, max_relative_positions=2**28).tolist() == \
            near.tolist()

    @pytest.mark.parametrize("nq, nk", [(6, 6), (3, 9)])
    @pytest.mark.parametrize("options", [dict(position_buckets=4, max_relative_positions=7),
                                         dict(position_buckets=None, max_relative_positions=3,
                                              pos_att_type=("p2c",), layer_norm=False),
                                         dict(position_buckets=256, max_relative_positions=512)])
    def test_matches_loop_oracle(self, nq, nk, options):
        pe = DebertaPositionalEmbedding(8, 2, init_std=0.5, **options).double()
        with torch.no_grad():
            for p in pe.parameters():
                p.add_(torch.randn_like(p) * 0.1)   # LayerNorm and biases away from their init
        q, k = torch.randn(2, 2, nq, 4, dtype=torch.float64), torch.randn(2, 2, nk, 4, dtype=torch.float64)
        scale = (4 * (1 + len(pe.pos_att_type))) ** -0.5
        torch.testing.assert_close(pe(q, k), deberta_oracle(pe, q, k, list(range(nk - nq, nk)), list(range(nk)), scale))
        pos_q, pos_k = [3, -20, 9], [0, 40, 1, 7, 3]
        got = pe(q[..., :3, :], k[..., :5, :], torch.tensor(pos_q), torch.tensor(pos_k), scale=0.7)
        torch.testing.assert_close(got, deberta_oracle(pe, q[..., :3, :], k[..., :5, :], pos_q, pos_k, 0.7))

    def test_p2c_uses_the_query_minus_key_bucket(self):
        # the paper writes K_j . Q_r[delta(j, i)]; transformers (and this class) use delta(i, j)
        pe = DebertaPositionalEmbedding(8, 2, position_buckets=None, max_relative_positions=4,
                                        pos_att_type=("p2c",), layer_norm=False).double()
        q, k = torch.zeros(1, 2, 2, 4, dtype=torch.float64), torch.randn(1, 2, 2, 4, dtype=torch.float64)
        pos_query = pe.relative_projections(torch.float64)[0]                           # [H, 2 S, Dh]
        scale = (4 * 2) ** -0.5
        got = pe(q, k)[0, :, 1, 0]                                                      # query 1, key 0: i - j = 1
        torch.testing.assert_close(got, scale * (k[0, :, 0] * pos_query[:, 4 + 1]).sum(-1))
        assert not torch.allclose(got, scale * (k[0, :, 0] * pos_query[:, 4 - 1]).sum(-1))

    @pytest.mark.parametrize("share_att_key", [False, True])
    def test_deberta_v2_model_loads_unchanged(self, share_att_key):
        transformers = pytest.importorskip("transformers")
        config = transformers.DebertaV2Config(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=16,
            pos_att_type=["p2c", "c2p"], share_att_key=share_att_key, norm_rel_ebd="layer_norm",
            layer_norm_eps=1e-7, position_biased_input=False, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        model = transformers.DebertaV2Model(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        ids = torch.randint(0, 50, (2, 40))
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, 29:] = 0
        encoder = model.encoder
        pes = []
        for layer in encoder.layer:
            attn = layer.attention.self
            shared = dict(query_proj=attn.query_proj, key_proj=attn.key_proj) if share_att_key else {}
            pe = DebertaPositionalEmbedding(32, 4, max_relative_positions=16, position_buckets=8, **shared)
            pe.rel_embeddings.load_state_dict(encoder.rel_embeddings.state_dict())
            pe.norm.load_state_dict(encoder.LayerNorm.state_dict())
            if not share_att_key:
                pe.pos_query_proj.load_state_dict(attn.pos_query_proj.state_dict())
                pe.pos_key_proj.load_state_dict(attn.pos_key_proj.state_dict())
            assert pe.norm.eps == 1e-7
            pes.append(pe)
        heads = lambda t: t.unflatten(-1, (4, 8)).transpose(1, 2)                        # noqa: E731
        keep = (mask[:, None, :, None] * mask[:, None, None, :]).bool()                 # as DeBERTa's encoder
        with torch.no_grad():
            want = model(ids, attention_mask=mask).last_hidden_state
            x = model.embeddings(ids, mask=mask)
            for layer, pe in zip(encoder.layer, pes):
                attn = layer.attention.self
                q, k, v = heads(attn.query_proj(x)), heads(attn.key_proj(x)), heads(attn.value_proj(x))
                context = attention(q, k, v, pe, attn_mask=keep).transpose(1, 2).flatten(-2)
                hidden = layer.attention.output(context, x)
                x = layer.output(layer.intermediate(hidden), hidden)
        # every real token (padded queries differ: DeBERTa softmaxes a fully masked row, attention() gives 0)
        valid = mask.bool()
        torch.testing.assert_close(x[valid], want[valid], rtol=1e-5, atol=1e-5)

    def test_shared_projections_are_held_not_owned(self):
        query_proj, key_proj = nn.Linear(D, D), nn.Linear(D, D)
        before = [p.clone() for p in (query_proj.weight, key_proj.weight, query_proj.bias)]
        pe = DebertaPositionalEmbedding(D, H, query_proj=query_proj, key_proj=key_proj)
        pe.reset_parameters()
        for p, b in zip((query_proj.weight, key_proj.weight, query_proj.bias), before):
            assert torch.equal(p, b)
        assert pe.query_proj is query_proj and pe.key_proj is key_proj
        assert not any(name.startswith(("query_proj", "key_proj", "pos_")) for name in pe.state_dict())
        q, k, _ = qkv()
        pe(q, k).square().sum().backward()
        assert query_proj.weight.grad.abs().sum() > 0 and key_proj.weight.grad.abs().sum() > 0

    def test_meta_init_of_an_attention_with_shared_projections(self):
        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.query_proj, self.key_proj = nn.Linear(D, D), nn.Linear(D, D)
                self.pe = DebertaPositionalEmbedding(D, H, query_proj=self.query_proj, key_proj=self.key_proj)

        normal = Attention()
        with torch.device("meta"):
            meta = Attention()
        meta.to_empty(device="cpu")
        meta.load_state_dict(normal.state_dict())
        assert set(normal.state_dict()) == {"query_proj.weight", "query_proj.bias", "key_proj.weight",
                                            "key_proj.bias", "pe.rel_embeddings.weight", "pe.norm.weight",
                                            "pe.norm.bias"}
        q, k, _ = qkv()
        assert meta.pe.query_proj is meta.query_proj
        torch.testing.assert_close(meta.pe(q, k), normal.pe(q, k))

    def test_default_scale(self):
        pe = DebertaPositionalEmbedding(D, H, pos_att_type=())
        q, k, _ = qkv(dtype=torch.float64)
        torch.testing.assert_close(pe.double()(q, k), q @ k.transpose(-1, -2) / math.sqrt(DH))
        assert DebertaPositionalEmbedding(D, H).logit_scale(DH) == (3 * DH) ** -0.5
        assert DebertaPositionalEmbedding(D, H, pos_att_type="c2p").logit_scale(DH) == (2 * DH) ** -0.5

    def test_bad_arguments(self):
        name = "DebertaPositionalEmbedding"
        with pytest.raises(ValueError, match=f"{name}: pos_att_type must hold distinct 'c2p' / 'p2c', got "):
            DebertaPositionalEmbedding(D, H, pos_att_type=("c2p", "p2p"))
        with pytest.raises(ValueError, match=f"{name}: query_proj and key_proj must be given together"):
            DebertaPositionalEmbedding(D, H, query_proj=nn.Linear(D, D))
        with pytest.raises(ValueError, match=f"{name}: key_proj must map dim=128 to H \\* Dh features"):
            DebertaPositionalEmbedding(D, H, query_proj=nn.Linear(D, D), key_proj=nn.Linear(D + 1, D))
        with pytest.raises(TypeError, match=f"{name}: query_proj must be an nn.Linear, got Conv1d"):
            DebertaPositionalEmbedding(D, H, query_proj=nn.Conv1d(D, D, 1), key_proj=nn.Linear(D, D))
        with pytest.raises(ValueError, match=f"{name}: max_relative_positions must exceed position_buckets"):
            DebertaPositionalEmbedding(D, H, position_buckets=256, max_relative_positions=100)
        with pytest.raises(ValueError, match=f"{name}: dim must be divisible by num_heads"):
            DebertaPositionalEmbedding(10, 4)
        with pytest.raises(ValueError, match=f"{name}: layer_norm_eps must be a finite number > 0.0, got layer_norm_eps=0"):
            DebertaPositionalEmbedding(D, H, layer_norm_eps=0)
        with pytest.raises(TypeError, match=f"{name}: layer_norm must be a bool"):
            DebertaPositionalEmbedding(D, H, layer_norm="yes")
        with pytest.raises(TypeError, match=f"{name}: position_buckets must be an int, got float"):
            DebertaPositionalEmbedding(D, H, position_buckets=4.0)


# ---------------------------------------------------------------------------
# CoPE
# ---------------------------------------------------------------------------


def cope_oracle(q, k, table, scale, max_position):
    """Golovneva et al.'s maths one pair at a time in float64: gates, counted positions,
    clamp, interpolation of the two integer neighbours; -inf after the query."""
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[-2]
    offset = k_len - q_len
    out = torch.full((batch, heads, q_len, k_len), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            rows = table[h] if table.dim() == 3 else table
            for i in range(q_len):
                qi = q[b, h, i].tolist()
                last = i + offset
                dots = [sum(a * c for a, c in zip(qi, k[b, h, t].tolist())) for t in range(last + 1)]
                gates = [1.0 / (1.0 + math.exp(-scale * d)) for d in dots]
                for j in range(last + 1):
                    p = min(sum(gates[j:]), max_position - 1)
                    low, high = math.floor(p), math.ceil(p)
                    w = p - low
                    e = [(1 - w) * x + w * y for x, y in zip(rows[low].tolist(), rows[high].tolist())]
                    out[b, h, i, j] = scale * dots[j] + sum(a * c for a, c in zip(qi, e))
    return out


def cope_paper_appendix(query, key, pos_emb, npos_max):
    """The paper's appendix code (CoPE + SelfAttn), ported: heads folded into the batch,
    ``pos_emb`` ``[1, Dh, npos_max]``, a ``[Nq, Nk]`` 0/1 mask added as its log. Returns the
    logits before the softmax."""
    batch, heads, q_len, head_dim = query.shape
    query = query.reshape(batch * heads, q_len, head_dim)
    key = key.reshape(batch * heads, -1, head_dim)
    mask = torch.ones(q_len, key.shape[1]).tril(key.shape[1] - q_len).to(query.dtype)
    attn_logits = torch.bmm(query, key.transpose(-1, -2)) / math.sqrt(head_dim)
    attn_logits = attn_logits + mask.log()
    gates = torch.sigmoid(attn_logits)
    pos = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=npos_max - 1)
    pos_ceil, pos_floor = pos.ceil().long(), pos.floor().long()
    logits_int = torch.matmul(query, pos_emb)
    w = pos - pos_floor
    cope = logits_int.gather(-1, pos_ceil) * w + logits_int.gather(-1, pos_floor) * (1 - w)
    return (attn_logits + cope).reshape(batch, heads, q_len, -1)


class TestCoPE:
    @pytest.mark.parametrize("per_head", [False, True])
    @pytest.mark.parametrize("max_position", [3, 64])   # 3: most positions clamp
    def test_matches_loop_oracle(self, per_head, max_position):
        cope = CoPEPositionalEmbedding(2, 4, max_position=max_position, per_head=per_head, init_std=1.0).double()
        q, k = torch.randn(2, 1, 2, 7, 4, dtype=torch.float64).unbind(0)
        q = q[..., 2:, :] * 2                                                           # 5 queries: the last 5 keys
        want = cope_oracle(q, k, cope.pos_emb.detach(), 0.5, max_position)
        torch.testing.assert_close(cope(q, k), want, rtol=1e-12, atol=1e-12)

    def test_matches_paper_appendix_code(self):
        cope = CoPEPositionalEmbedding(H, DH, max_position=10, init_std=1.0)
        q, k, v = qkv(N - 4, N)
        want = cope_paper_appendix(q, k, cope.pos_emb.detach().T[None], 10)           # paper: [1, Dh, P]
        got = cope(q, k)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        out = attention(q, k, v, cope, causal=True)
        torch.testing.assert_close(out, torch.softmax(want, -1) @ v, rtol=0, atol=1e-5)

    @pytest.mark.parametrize("q_len", [N, N - 5, 1])
    def test_matches_x_transformers(self, q_len):
        x_transformers = pytest.importorskip("x_transformers.x_transformers")
        reference = x_transformers.CoPE(dim=DH, heads=H, max_pos=12)
        cope = CoPEPositionalEmbedding(H, DH, max_position=12, init_std=1.0)
        with torch.no_grad():
            reference.pos_emb.copy_(cope.pos_emb)                                        # same name and shape
        q, k, _ = qkv(q_len, N, dtype=torch.float64)
        q = q * 3                                                                       # spread the gates
        reference, cope = reference.double(), cope.double()
        # x-transformers' Attend: scaled logits, bottom-right causal mask as -max, then sim + cope(q, sim)
        sim = q @ k.transpose(-1, -2) * DH ** -0.5
        future = torch.ones(q_len, N, dtype=torch.bool).triu(N - q_len + 1)
        sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
        want = sim + reference(q, sim)
        got = cope(q, k)
        assert torch.equal(torch.isinf(got), future.expand_as(got))
        torch.testing.assert_close(got[..., ~future], want[..., ~future], rtol=0, atol=1e-12)

    def test_causal_by_construction(self):
        cope = CoPEPositionalEmbedding(H, DH, init_std=1.0)
        q, k, v = qkv(N - 3, N)
        logits = cope(q, k)
        future = torch.ones(N - 3, N, dtype=torch.bool).triu(4)
        assert torch.isinf(logits[..., future]).all() and torch.isfinite(logits[..., ~future]).all()
        torch.testing.assert_close(attention(q, k, v, cope), attention(q, k, v, cope, causal=True))

    def test_positions_count_open_gates(self):
        # every gate fully open (q = k, large): p_ij = i - j + 1, so each pair reads row i - j + 1
        cope = CoPEPositionalEmbedding(1, 2, max_position=8)
        with torch.no_grad():
            cope.pos_emb.copy_(torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.0]))   # q . e[p] = p * q_0
        q = torch.tensor([1.0, 0.0]).expand(1, 1, 5, 2) * 100
        logits = cope(q, q.clone(), scale=1.0) - 100 * 100                              # drop the content term
        i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
        want = torch.where(j <= i, 100.0 * (i - j + 1).float(), float("-inf"))
        torch.testing.assert_close(logits[0, 0], want)

    def test_decoding_token_by_token_is_exact(self):
        cope = CoPEPositionalEmbedding(H, DH, max_position=6, per_head=True, init_std=1.0)
        q, k, v = qkv()
        full = attention(q, k, v, cope, causal=True)
        for t in (0, 6, N - 1):
            step = attention(q[..., t : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], cope, causal=True)
            torch.testing.assert_close(step, full[..., t : t + 1, :])

    def test_gates_use_the_logit_scale(self):
        cope = CoPEPositionalEmbedding(1, 4, max_position=64, init_std=1.0).double()
        q, k = torch.randn(2, 1, 1, 6, 4, dtype=torch.float64).unbind(0)
        torch.testing.assert_close(cope(q, k, scale=0.3), cope_oracle(q, k, cope.pos_emb.detach(), 0.3, 64))

    def test_gradient_reaches_keys_through_the_gates(self):
        # beyond the content term, the keys move the gates, hence the positions (the paper's gradient path)
        cope = CoPEPositionalEmbedding(H, DH, init_std=1.0)
        q, k, _ = qkv(dtype=torch.float64)
        k.requires_grad_(True)
        weights = torch.randn(B, H, N, N, dtype=torch.float64).tril()
        finite = lambda t: torch.where(torch.isfinite(t), t, 0.0)
        (grad,) = torch.autograd.grad((finite(cope.double()(q, k)) * weights).sum(), k)
        content = torch.autograd.grad(((q @ k.transpose(-1, -2)) * DH ** -0.5 * weights).sum(), k)[0]
        assert (grad - content).abs().max() > 1e-3   # the position term moves the keys through the gates

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(num_heads=2, head_dim=8, max_position=1.5), TypeError, "max_position must be an int, got float 1.5"),
        (dict(num_heads=2, head_dim=8, per_head="yes"), TypeError, "per_head must be a bool, got str"),
        (dict(num_heads=2, head_dim=8, init_std=-1.0), ValueError, "init_std must be a finite number >= 0"),
    ])
    def test_bad_arguments(self, kwargs, error, message):
        with pytest.raises(error, match="CoPEPositionalEmbedding: " + message):
            CoPEPositionalEmbedding(**kwargs)

    def test_bad_inputs(self):
        cope = CoPEPositionalEmbedding(H, DH)
        q, k, v = qkv()
        with pytest.raises(ValueError, match="CoPEPositionalEmbedding: positions_q must be None: contextual .*"
                                             "got shape \\(16,\\)"):
            cope(q, k, torch.arange(N))
        with pytest.raises(ValueError, match="CoPEPositionalEmbedding: positions_k must be None"):
            attention(q, k, v, cope, positions_k=torch.arange(N))
        with pytest.raises(ValueError, match="CoPEPositionalEmbedding: q must not have more tokens than k.*Nq=16 "
                                             "and Nk=5"):
            cope(q, k[..., :5, :])
        with pytest.raises(ValueError, match="CoPEPositionalEmbedding: q and k must be \\[..., H=4, N, Dh=32\\]"):
            cope(q[..., :16], k[..., :16])


# ---------------------------------------------------------------------------
# ReRoPE
# ---------------------------------------------------------------------------


def rope_distance_oracle(q, k, positions_q, positions_k, base, distance, log_length=None):
    """RoPE logits one pair at a time in float64, each pair rotated by ``distance(t, s)`` (the encoding's rule;
    keys after the query get -inf) and the query scaled by max(1, log(t + 1) / log(log_length)) if given."""
    dh = q.shape[-1]
    inv_freq = plain_inv_freq(dh, base)
    out = torch.full((*q.shape[:-2], len(positions_q), len(positions_k)), float("-inf"), dtype=torch.float64)
    for i, t in enumerate(positions_q):
        growth = 1.0 if log_length is None or t <= 0 else max(1.0, math.log(t + 1) / math.log(log_length))
        for j, s_ in enumerate(positions_k):
            if t < s_:
                continue
            turned = rope_oracle(q[..., i : i + 1, :].double() * growth, [distance(t, s_)], inv_freq)[..., 0, :]
            out[..., i, j] = (turned * k[..., j, :].double()).sum(-1) / math.sqrt(dh)
    return out


def rerope_oracle(q, k, positions_q, positions_k, window, base, leak=None, log_length=None):
    """ReRoPE: RoPE at the rectified distance d' (d below the window, else window, or window + (d - window) /
    leak)."""
    def rectified(t, s_):
        d = t - s_
        return d if d < window else window + (d - window) / leak if leak else window
    return rope_distance_oracle(q, k, positions_q, positions_k, base, rectified, log_length)


def assert_decoding_matches_full_pass(pe, n, steps, **options):
    """Decoding with raw keys in the cache: the query at t over keys 0..t equals row t of the full pass."""
    q, k, v = qkv(n, n)
    full = attention(q, k, v, pe, **options)
    for t in steps:
        step = attention(q[..., t : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], pe, **options)
        torch.testing.assert_close(step, full[..., t : t + 1, :], rtol=1e-5, atol=1e-6)


class TestReRoPE:
    @pytest.mark.parametrize("leak, log_length", [(None, None), (4.0, None), (None, 8), (2.5, 6)])
    def test_matches_loop_oracle(self, leak, log_length):
        pe = ReRoPEPositionalEmbedding(8, window=5, base=100.0, leak=leak, log_scaling_length=log_length).double()
        q, k = torch.randn(2, 3, 7, 8, dtype=torch.float64), torch.randn(2, 3, 12, 8, dtype=torch.float64)
        want = rerope_oracle(q, k, range(5, 12), range(12), 5, 100.0, leak, log_length)   # bottom-right
        got = pe.forward_attn(q, k)
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)
        pos_q, pos_k = torch.tensor([30, 2, 17]), torch.tensor([0, 29, 3, 16, 17])
        want = rerope_oracle(q[..., :3, :], k[..., :5, :], pos_q.tolist(), pos_k.tolist(), 5, 100.0, leak, log_length)
        got = pe.forward_attn(q[..., :3, :], k[..., :5, :], pos_q, pos_k)
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)

    def test_rope_inside_the_window_and_constant_beyond_it(self):
        rope, rerope = RotaryPositionalEmbedding(DH), ReRoPEPositionalEmbedding(DH, window=6)
        q, k = torch.randn(1, H, 1, DH), torch.randn(1, H, 1, DH)
        logit = lambda pe, t: pe.forward_attn(q, k, torch.tensor([t]), torch.tensor([0]))
        for d in range(6):                                                              # exact: RoPE's logits
            torch.testing.assert_close(logit(rerope, d), logit(rope, d), rtol=1e-5, atol=1e-6)
        for d in (6, 7, 100, 10**6):                                                    # rectified: as at the window
            torch.testing.assert_close(logit(rerope, d), logit(rope, 6), rtol=1e-5, atol=1e-6)

    def test_decoding_with_raw_keys_matches_the_full_pass(self):
        assert_decoding_matches_full_pass(ReRoPEPositionalEmbedding(DH, window=4, leak=3.0), 12, (0, 5, 11),
                                          causal=True)

    def test_query_scaling_is_one_at_negative_positions(self):
        # max(1, log(t + 1) / log(L)) was log1p of t <= -1: NaN logits for queries at negative positions
        pe = ReRoPEPositionalEmbedding(8, window=3, base=100.0, leak=2.0, log_scaling_length=4).double()
        q, k = torch.randn(2, 3, 6, 8, dtype=torch.float64), torch.randn(2, 3, 6, 8, dtype=torch.float64)
        positions = torch.tensor([-9, -5, -2, -1, 3, 8])
        want = rerope_oracle(q, k, positions.tolist(), positions.tolist(), 3, 100.0, 2.0, 4)
        got = pe.forward_attn(q, k, positions, positions)
        assert torch.equal(got.isinf(), want.isinf()) and not got.isnan().any()
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)

    def test_translation_invariant_only_without_query_scaling(self):
        # the flag says what a shift of every position does to the logits, measured here both ways
        q, k = torch.randn(2, 3, 6, 8, dtype=torch.float64), torch.randn(2, 3, 6, 8, dtype=torch.float64)
        positions = torch.arange(6)
        for scaling in (None, 4):
            pe = ReRoPEPositionalEmbedding(8, window=3, log_scaling_length=scaling).double()
            moved = pe.forward_attn(q, k, positions + 50, positions + 50)
            invariant = torch.allclose(pe.forward_attn(q, k, positions, positions), moved, rtol=0, atol=1e-9)
            assert pe.translation_invariant is invariant is (scaling is None)

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="ReRoPEPositionalEmbedding: leak"):
            ReRoPEPositionalEmbedding(DH, window=4, leak=1.0)
        with pytest.raises(ValueError, match="ReRoPEPositionalEmbedding: window"):
            ReRoPEPositionalEmbedding(DH, window=0)
        with pytest.raises(ValueError, match="ReRoPEPositionalEmbedding: log_scaling_length"):
            ReRoPEPositionalEmbedding(DH, window=4, log_scaling_length=1)
        with pytest.raises(ValueError, match="ReRoPEPositionalEmbedding: dim"):
            ReRoPEPositionalEmbedding(7, window=4)
        with pytest.raises(ValueError, match="ReRoPEPositionalEmbedding: q"):
            attention(*qkv(dh=DH + 2), ReRoPEPositionalEmbedding(DH, window=4), causal=True)


# ---------------------------------------------------------------------------
# Self-Extend
# ---------------------------------------------------------------------------


def self_extend_oracle(q, k, positions_q, positions_k, group_size, window, base, shift, log_length=None):
    """Self-Extend: RoPE at distance d = t - s below the window, else at the grouped distance
    (t // G + shift) - s // G."""
    def grouped(t, s_):
        return t - s_ if t - s_ < window else (t // group_size + shift) - s_ // group_size
    return rope_distance_oracle(q, k, positions_q, positions_k, base, grouped, log_length)


def authors_neighbour_mask(length, window):
    """The LongLM patch's prefill choice, built as it builds it: a lower triangle with the triangle of pairs
    at least ``window`` apart taken out (True: neighbour attention)."""
    mask = torch.ones(length, length).tril()
    if length > window:
        mask[window:, :-window] -= torch.ones(length - window, length - window).tril()
    return mask.bool()


class TestSelfExtend:
    @pytest.mark.parametrize("group_size, window, shift, log_length", [
        (3, 5, "paper", None), (3, 5, "code", None), (4, 8, "paper", 6), (1, 3, "paper", None)])
    def test_matches_loop_oracle(self, group_size, window, shift, log_length):
        rope = RotaryPositionalEmbedding(8, base=100.0)
        pe = SelfExtendPositionalEmbedding(rope, group_size, window, shift=shift, log_scaling_length=log_length)
        pe = pe.double()
        offset = window - (window // group_size if shift == "paper" else window / group_size)
        q, k = torch.randn(2, 3, 9, 8, dtype=torch.float64), torch.randn(2, 3, 20, 8, dtype=torch.float64)
        want = self_extend_oracle(q, k, range(11, 20), range(20), group_size, window, 100.0, offset, log_length)
        got = pe.forward_attn(q, k)                                                     # bottom-right queries
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)
        pos_q, pos_k = torch.tensor([40, 2, 17]), torch.tensor([0, 39, 3, 16, 17])
        want = self_extend_oracle(q[..., :3, :], k[..., :5, :], pos_q.tolist(), pos_k.tolist(), group_size, window,
                                  100.0, offset, log_length)
        got = pe.forward_attn(q[..., :3, :], k[..., :5, :], pos_q, pos_k)
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)

    def test_neighbour_pairs_are_those_of_the_authors_mask(self):
        pe = SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH), group_size=2, window=5)
        pos = torch.arange(13)
        assert torch.equal(pe.piece_of(pos, pos) == 0, authors_neighbour_mask(13, 5) | (pos[:, None] < pos))

    def test_group_size_one_is_the_wrapped_rope(self):
        rope = RotaryPositionalEmbedding(DH, interleaved=True)
        q, k, v = qkv(10, 10)
        want = attention(q, k, v, rope, causal=True)
        got = attention(q, k, v, SelfExtendPositionalEmbedding(rope, group_size=1, window=3), causal=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    def test_grouped_distance_continues_the_window(self):
        # Past the window, the grouped distance starts at the window (to within G) and grows G times slower.
        pe = SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH), group_size=4, window=16)
        t = torch.arange(16, 4000)
        pos_q, pos_k = pe.pieces(t, torch.zeros_like(t))[1]
        grouped = pos_q - pos_k
        assert grouped.min() >= 16 - 4 + 1 and grouped.max() == 3999 // 4 + 12

    @pytest.mark.parametrize("shift", ["paper", "code"])
    def test_decoding_with_raw_keys_matches_the_full_pass(self, shift):
        pe = SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH), group_size=3, window=4, shift=shift)
        assert_decoding_matches_full_pass(pe, 14, (0, 5, 13), causal=True)

    def test_query_scaling_is_one_at_negative_positions(self):
        # max(1, log(t + 1) / log(L)) was log1p of t <= -1: NaN logits for queries at negative positions
        rope = RotaryPositionalEmbedding(8, base=100.0)
        pe = SelfExtendPositionalEmbedding(rope, 2, 3, log_scaling_length=4).double()
        q, k = torch.randn(2, 3, 7, 8, dtype=torch.float64), torch.randn(2, 3, 7, 8, dtype=torch.float64)
        positions = torch.tensor([-12, -7, -4, -2, -1, 0, 9])
        want = self_extend_oracle(q, k, positions.tolist(), positions.tolist(), 2, 3, 100.0, 2, 4)
        got = pe.forward_attn(q, k, positions, positions)
        assert torch.equal(got.isinf(), want.isinf()) and not got.isnan().any()
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)

    def test_a_dynamic_rope_fixed_at_a_length_is_wrapped(self):
        # at_length fixes dynamic / longrope frequencies: one spectrum for every rule, so it is no longer refused
        rope = RotaryPositionalEmbedding(DH, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                      "original_max_position_embeddings": 8}).at_length(40)
        q, k, v = qkv(20, 20, dtype=torch.float64)
        got = attention(q, k, v, SelfExtendPositionalEmbedding(rope, group_size=1, window=3), causal=True)
        torch.testing.assert_close(got, attention(q, k, v, rope, causal=True), rtol=1e-12, atol=1e-12)
        got = attention(q, k, v, DualChunkPositionalEmbedding(rope, chunk_size=30, local_size=2), causal=True)
        torch.testing.assert_close(got, attention(q, k, v, rope, causal=True), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"SelfExtendPositionalEmbedding: rope must have length-independent "
                                             r"frequencies, .* fix it with rope.at_length\(length\)"):
            SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH, scaling={
                "rope_type": "longrope", "short_factor": [1.0] * (DH // 2), "long_factor": [2.0] * (DH // 2),
                "original_max_position_embeddings": 8, "max_position_embeddings": 32}))

    def test_bad_input_is_named(self):
        rope = RotaryPositionalEmbedding(DH)
        with pytest.raises(TypeError, match="SelfExtendPositionalEmbedding: rope must be a RotaryPositionalEmbedding"):
            SelfExtendPositionalEmbedding(ALiBiPositionalEmbedding(H))
        with pytest.raises(ValueError, match="SelfExtendPositionalEmbedding: rope .* rope_type='dynamic'"):
            SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH, scaling={
                "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}))
        with pytest.raises(ValueError, match="SelfExtendPositionalEmbedding: rope must rotate one position axis"):
            SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(DH, sections=[4, 6, 6]))
        for name, kwargs in [("group_size", {"group_size": 0}), ("window", {"window": -1}),
                             ("shift", {"shift": "floor"}), ("log_scaling_length", {"log_scaling_length": 1})]:
            with pytest.raises(ValueError, match=f"SelfExtendPositionalEmbedding: {name}"):
                SelfExtendPositionalEmbedding(rope, **kwargs)
        with pytest.raises(ValueError, match="SelfExtendPositionalEmbedding: q"):
            attention(*qkv(dh=DH + 2), SelfExtendPositionalEmbedding(rope), causal=True)


# ---------------------------------------------------------------------------
# Dual Chunk Attention
# ---------------------------------------------------------------------------


def dual_chunk_oracle(q, k, positions_q, positions_k, chunk_size, local_size, base):
    """Dual Chunk Attention in the paper's terms (its Eqs. 2-8): chunks of s = chunk_size - local_size tokens,
    keys at j mod s; the query at i mod s (same chunk), at s + i mod s while i mod s < w = local_size + 1 and
    c - 1 = chunk_size after that (previous chunk), and at c - 1 for earlier chunks (the code's
    min(2s - 1, c - 1), which is c - 1 unless local_size >= s)."""
    s, w, c_minus_1 = chunk_size - local_size, local_size + 1, chunk_size

    def chunked(i, j):
        apart = i // s - j // s
        if apart == 0:
            query = i % s
        elif apart == 1:
            query = s + i % s if i % s < w else c_minus_1
        else:
            query = min(2 * s - 1, c_minus_1)
        return query - j % s
    return rope_distance_oracle(q, k, positions_q, positions_k, base, chunked)


class TestDualChunk:
    @pytest.mark.parametrize("chunk_size, local_size", [(9, 3), (10, 4), (5, 0), (10, 7)])
    def test_matches_loop_oracle(self, chunk_size, local_size):
        pe = DualChunkPositionalEmbedding(RotaryPositionalEmbedding(8, base=100.0), chunk_size, local_size).double()
        q, k = torch.randn(2, 3, 11, 8, dtype=torch.float64), torch.randn(2, 3, 30, 8, dtype=torch.float64)
        want = dual_chunk_oracle(q, k, range(19, 30), range(30), chunk_size, local_size, 100.0)
        got = pe.forward_attn(q, k)                                                     # bottom-right queries
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)
        pos_q, pos_k = torch.tensor([40, 2, 17]), torch.tensor([0, 39, 3, 16, 17])
        want = dual_chunk_oracle(q[..., :3, :], k[..., :5, :], pos_q.tolist(), pos_k.tolist(), chunk_size,
                                 local_size, 100.0)
        got = pe.forward_attn(q[..., :3, :], k[..., :5, :], pos_q, pos_k)
        torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), rtol=1e-12, atol=1e-12)

    def test_the_papers_figure(self):
        # The paper's Figure 2 example: chunk s = 6, pretraining length c = 10, local window w = 4; successive-chunk
        # query positions [6, 7, 8, 9, 9, 9] and inter-chunk 9 = c - 1 (chunk_size=9, local_size=3 here).
        pe = DualChunkPositionalEmbedding(RotaryPositionalEmbedding(DH), chunk_size=9, local_size=3)
        t = torch.arange(12, 18)                                                        # one chunk of queries
        (intra_q, keys), (successive_q, _), (inter_q, _) = pe.pieces(t, torch.arange(18))
        assert intra_q.tolist() == [0, 1, 2, 3, 4, 5] and successive_q.tolist() == [6, 7, 8, 9, 9, 9]
        assert inter_q.tolist() == [9] * 6 and keys.tolist() == list(range(6)) * 3

    def test_distances_stay_within_chunk_size(self):
        pe = DualChunkPositionalEmbedding(RotaryPositionalEmbedding(DH), chunk_size=10, local_size=4)
        t = torch.arange(200)
        pieces, choice = pe.pieces(t, t), pe.piece_of(t, t)
        causal = t[:, None] >= t[None, :]
        for rule, want in enumerate([range(0, 6), range(1, 11), range(5, 11)]):
            d = pieces[rule][0][:, None] - pieces[rule][1][None, :]
            assert d[(choice == rule) & causal].unique().tolist() == list(want)

    def test_within_one_chunk_it_is_the_wrapped_rope(self):
        rope = RotaryPositionalEmbedding(DH, interleaved=True, rotary_dim=DH // 2)
        q, k, v = qkv(6, 6)
        want = attention(q, k, v, rope, causal=True)
        got = attention(q, k, v, DualChunkPositionalEmbedding(rope, chunk_size=8, local_size=2), causal=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    def test_length_scaling_multiplies_the_logits_by_m_squared(self):
        rope = RotaryPositionalEmbedding(DH)
        plain = DualChunkPositionalEmbedding(rope, chunk_size=6, local_size=2)
        q, k = torch.randn(1, H, 20, DH, dtype=torch.float64), torch.randn(1, H, 20, DH, dtype=torch.float64)
        for coefficient in (0.05, 0.1):
            scaled = DualChunkPositionalEmbedding(rope, 6, 2, scaling_length=8, scaling_coefficient=coefficient)
            m = coefficient * math.log(20 / 8) + 1.0
            want = plain.forward_attn(q, k) * m * m
            torch.testing.assert_close(scaled.forward_attn(q, k), want, rtol=1e-12, atol=1e-12)
            short = scaled.forward_attn(q[..., :5, :], k[..., :5, :])                   # within L_train: m = 1
            torch.testing.assert_close(short, plain.forward_attn(q[..., :5, :], k[..., :5, :]), rtol=0, atol=0)

    def test_decoding_with_raw_keys_matches_the_full_pass(self):
        pe = DualChunkPositionalEmbedding(RotaryPositionalEmbedding(DH), chunk_size=5, local_size=2)
        assert_decoding_matches_full_pass(pe, 16, (0, 4, 9, 15), causal=True)

    def test_length_scaling_is_one_below_position_zero(self):
        # N = the largest key position + 1 <= 0 was the log of a non-positive number: NaN logits, not m = 1
        rope = RotaryPositionalEmbedding(DH)
        plain = DualChunkPositionalEmbedding(rope, chunk_size=6, local_size=2)
        scaled = DualChunkPositionalEmbedding(rope, 6, 2, scaling_length=8)
        q, k = torch.randn(1, H, 10, DH, dtype=torch.float64), torch.randn(1, H, 10, DH, dtype=torch.float64)
        for shift in (-30, -11, -10):                                                   # N = -20, -1, 0
            positions = torch.arange(10) + shift
            got = scaled.forward_attn(q, k, positions, positions)
            assert torch.equal(got, plain.forward_attn(q, k, positions, positions))

    def test_bad_input_is_named(self):
        rope = RotaryPositionalEmbedding(DH)
        with pytest.raises(TypeError, match="DualChunkPositionalEmbedding: rope must be a RotaryPositionalEmbedding"):
            DualChunkPositionalEmbedding(None, 8, 2)
        with pytest.raises(ValueError, match="DualChunkPositionalEmbedding: local_size must be below chunk_size"):
            DualChunkPositionalEmbedding(rope, 8, 8)
        for name, kwargs in [("chunk_size", {"chunk_size": 0, "local_size": 0}),
                             ("local_size", {"chunk_size": 4, "local_size": -1}),
                             ("scaling_length", {"chunk_size": 4, "local_size": 1, "scaling_length": 0}),
                             ("scaling_coefficient", {"chunk_size": 4, "local_size": 1, "scaling_coefficient": 0.0})]:
            with pytest.raises(ValueError, match=f"DualChunkPositionalEmbedding: {name}"):
                DualChunkPositionalEmbedding(rope, **kwargs)


# ---------------------------------------------------------------------------
# Stick-breaking attention
# ---------------------------------------------------------------------------


def stick_breaking_oracle(q, k, v, attend_current=False, remainder="drop"):
    """Stick-breaking attention in float64, one query and one key at a time, as products of probabilities:
    A_ij = sigmoid(z_ij) prod_{j < l < i} (1 - sigmoid(z_il)) for keys j < i (j <= i and l <= i with
    attend_current), z = q . k / sqrt(Dh); queries are the last Nq keys. Returns the output and the weights."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, k_len = q.shape[-2], k.shape[-2]
    z = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    beta = torch.sigmoid(z)
    weights = torch.zeros_like(z)
    for i in range(q_len):
        own = k_len - q_len + i
        last = own if attend_current else own - 1                                      # the nearest visible key
        for j in range(last + 1):
            w = beta[..., i, j].clone()
            for l_ in range(j + 1, last + 1):
                w = w * (1 - beta[..., i, l_])
            weights[..., i, j] = w
        if remainder == "current":
            weights[..., i, own] += 1 - weights[..., i, :].sum(-1)
    return weights @ v, weights


def fla_reference(ops_file: str, name: str):
    """A reference function of flash-linear-attention, loaded from its file under ``fla/ops`` alone (the
    package imports Triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or sys.version_info < (3, 10):
        pytest.skip("fla-core (flash-linear-attention) is not installed (Python >= 3.10)")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ops" / ops_file
    module_spec = importlib.util.spec_from_file_location("fla_" + ops_file.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def fla_stick_breaking():
    return fla_reference("stickbreaking_attn/naive.py", "naive_stickbreaking_attn")


class TestStickBreaking:
    @pytest.mark.parametrize("attend_current, remainder", [(False, "drop"), (True, "drop"), (False, "current"),
                                                           (True, "current")])
    def test_matches_loop_oracle(self, attend_current, remainder):
        pe = StickBreakingPositionalEmbedding(attend_current=attend_current, remainder=remainder)
        q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) * 2 for n in (7, 11, 11))
        want, weights = stick_breaking_oracle(q, k, v, attend_current, remainder)
        torch.testing.assert_close(attention(q, k, v, pe), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pe.attention_weights(pe.full_precision_logits(q, k)), weights,
                                   rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("attend_current", [False, True])
    def test_matches_flash_linear_attention(self, attend_current):
        reference = fla_stick_breaking()
        pe = StickBreakingPositionalEmbedding(attend_current=attend_current)
        q, k, v = (torch.randn(2, H, 13, DH, dtype=torch.float64) for _ in range(3))
        want, rem = reference(*(t.transpose(1, 2) for t in (q, k, v)), attend_current=attend_current)
        torch.testing.assert_close(attention(q, k, v, pe), want.transpose(1, 2), rtol=1e-12, atol=1e-12)
        weights = pe.attention_weights(pe.full_precision_logits(q, k))
        torch.testing.assert_close(1 - weights.sum(-1), rem.transpose(1, 2), rtol=1e-12, atol=1e-12)
        q32, k32, v32 = (t.float() for t in (q, k, v))                                  # float32 as well
        want, _ = reference(*(t.transpose(1, 2) for t in (q32, k32, v32)), attend_current=attend_current)
        torch.testing.assert_close(attention(q32, k32, v32, pe), want.transpose(1, 2), rtol=1e-5, atol=1e-6)

    def test_weights_sum_to_at_most_one_and_the_nearest_key_goes_first(self):
        pe = StickBreakingPositionalEmbedding()
        q, k = torch.zeros(1, 1, 5, DH), torch.zeros(1, 1, 5, DH)                       # every beta = 1/2
        weights = pe.attention_weights(pe.full_precision_logits(q, k))[0, 0]
        assert weights[4].tolist() == [1 / 16, 1 / 8, 1 / 4, 1 / 2, 0.0]              # halves from the nearest back
        assert weights[0].tolist() == [0.0] * 5                                          # no earlier key: nothing
        whole = StickBreakingPositionalEmbedding(remainder="current")
        weights = whole.attention_weights(whole.full_precision_logits(q, k))[0, 0]
        torch.testing.assert_close(weights.sum(-1), torch.ones(5))
        assert weights[4, 4] == 1 / 16 and weights[0, 0] == 1.0                           # the leftover, at home

    def test_decoding_and_documents(self):
        pe = StickBreakingPositionalEmbedding(attend_current=True)
        assert_decoding_matches_full_pass(pe, 12, (0, 5, 11))
        q, k, v = qkv(12, 12)
        ids = torch.tensor([0] * 5 + [1] * 7)                                           # two packed documents
        packed = attention(q, k, v, pe, document_ids=ids)
        torch.testing.assert_close(packed[..., 5:, :], attention(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :], pe),
                                   rtol=1e-5, atol=1e-6)

    def test_long_sequences_stay_finite_and_close_in_bfloat16(self):
        # 2048 keys, sharp logits: the weights are float32 in log space, so bfloat16 costs only its rounding
        # of the output (2^-8 relative) and of the weights before the product with v.
        pe = StickBreakingPositionalEmbedding()
        q, k, v = (torch.randn(1, 2, 2048, DH).bfloat16() * 3 for _ in range(3))
        want = attention(q.double(), k.double(), v.double(), pe)
        got = attention(q, k, v, pe)
        assert torch.isfinite(got).all()
        assert ((got.double() - want).abs() <= 2 ** -6 * want.abs() + 2 ** -6).all()

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="StickBreakingPositionalEmbedding: remainder"):
            StickBreakingPositionalEmbedding(remainder="keep")
        with pytest.raises(TypeError, match="StickBreakingPositionalEmbedding: attend_current"):
            StickBreakingPositionalEmbedding(attend_current=1)
        with pytest.raises(ValueError, match="StickBreakingPositionalEmbedding: positions_q must be None"):
            attention(*qkv(), StickBreakingPositionalEmbedding(), positions_q=torch.arange(N), positions_k=torch.arange(N))
        with pytest.raises(ValueError, match="causal=False with StickBreakingPositionalEmbedding"):
            attention(*qkv(), StickBreakingPositionalEmbedding(), causal=False)


# ---------------------------------------------------------------------------
# PaTH attention
# ---------------------------------------------------------------------------


def path_oracle(q, k, v, w, beta, log_forget=None, gate_scaled=True):
    """PaTH attention in float64, one query at a time, carried back key by key: u = q_i, the logit of key i is
    u . k_i, then u <- H_{j+1} u = u - beta_{j+1} (u . w_{j+1}) w_{j+1} gives key j's. q [B, H, Nq, Dh] (the last
    Nq keys), k, v [B, H, Nk, Dh], w [B, Hkv, Nk, Dh], beta [B, Hkv, Nk] (query head h reads w head
    h // (H / Hkv)); log_forget [B, H, Nk] adds scale (c_i - c_j) (c_i - c_j after the scale: gate_scaled=False).
    Returns the output and the logits (-inf after the query)."""
    q, k, v, w, beta = (t.double() for t in (q, k, v, w, beta))
    (batch, heads, q_len, dh), k_len = q.shape, k.shape[-2]
    group, scale = heads // w.shape[1], dh ** -0.5
    logits = torch.full((batch, heads, q_len, k_len), float("-inf"), dtype=torch.float64)
    for b, h, r in itertools.product(range(batch), range(heads), range(q_len)):
        i, u, g = k_len - q_len + r, q[b, h, r].clone(), h // group
        for j in range(i, -1, -1):
            if j < i:
                u = u - beta[b, g, j + 1] * (u @ w[b, g, j + 1]) * w[b, g, j + 1]
            logits[b, h, r, j] = scale * (u @ k[b, h, j])
            if log_forget is not None:
                gate = log_forget[b, h, j + 1:i + 1].double().sum()
                logits[b, h, r, j] += gate * scale if gate_scaled else gate
    return torch.softmax(logits, -1) @ v, logits


def path_layer_transitions(path, x):
    """w and beta of flash-linear-attention's PaTHAttention layer from the module's weights, in float64 with
    the short convolution as a loop over its taps: w_proj, causal depthwise conv (tap conv_size - 1 on the
    token itself), SiLU, per head w / sqrt(|w|^2 + 1e-6); beta = 2 sigmoid(bt_proj(x))."""
    x = x.double()
    w = x
    for layer in (path.w_proj if isinstance(path.w_proj, nn.Sequential) else [path.w_proj]):
        w = w @ layer.weight.double().T
    taps = path.w_conv1d.weight.double()[:, 0, :]                              # [width, K]
    conv = torch.zeros_like(w)
    for t in range(x.shape[1]):
        for tap in range(taps.shape[1]):
            source = t - (taps.shape[1] - 1 - tap)
            if source >= 0:
                conv[:, t] += taps[:, tap] * w[:, source]
    w = F.silu(conv).unflatten(-1, (path.num_kv_heads, path.head_dim)).transpose(1, 2)
    w = w / torch.sqrt((w * w).sum(-1, keepdim=True) + 1e-6)
    beta = 2 * torch.sigmoid(x @ path.bt_proj.weight.double().T + path.bt_proj.bias.double())
    return w, beta.transpose(1, 2)


def random_transitions(batch, heads, n, dh, dtype=torch.float64):
    w = F.normalize(torch.randn(batch, heads, n, dh, dtype=dtype), dim=-1)
    return w, 2 * torch.rand(batch, heads, n, dtype=dtype)


class TestPaTH:
    @pytest.mark.parametrize("q_len, k_len, block_size", [(N, N, 5), (N, N, 1), (N, N, 64), (3, N, 4), (1, N, 4),
                                                          (7, 11, 3)])
    def test_matches_loop_oracle(self, q_len, k_len, block_size):
        path = PaTHPositionalEmbedding(D, H, block_size=block_size).double()
        w, beta = random_transitions(B, H, k_len, DH)
        q, k, v = (t.double() for t in qkv(q_len, k_len))
        want_out, want_logits = path_oracle(q, k, v, w, beta)
        bound = path.bind(w=w, beta=beta)
        torch.testing.assert_close(bound(q, k), want_logits, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(attention(q, k, v, bound, causal=True), want_out, rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("gate_scaled", [True, False])
    def test_forget_gate_and_grouped_heads_match_oracle(self, gate_scaled):
        path = PaTHPositionalEmbedding(D, H, num_kv_heads=2, forget_gate=True, gate_scaled=gate_scaled,
                                       block_size=4).double()
        w, beta = random_transitions(B, 2, N, DH)
        log_forget = F.logsigmoid(torch.randn(B, H, N, dtype=torch.float64) + 2)
        q, k, v = (t.double() for t in qkv(N - 3, N))
        want, _ = path_oracle(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1), w, beta,
                              log_forget, gate_scaled)
        got = attention(q, k[:, :2], v[:, :2], path.bind(w=w, beta=beta, log_forget=log_forget), causal=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    def test_states_give_the_authors_layer_transitions(self):
        path = PaTHPositionalEmbedding(D, H, num_kv_heads=2).double()
        x = torch.randn(B, N, D, dtype=torch.float64)
        want_w, want_beta = path_layer_transitions(path, x)
        got_w, got_beta = path.transitions(x)
        torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_beta, want_beta, rtol=1e-12, atol=1e-12)
        q, k, v = (t.double() for t in qkv())
        torch.testing.assert_close(attention(q, k, v, path(x), causal=True),
                                   path_oracle(q, k, v, want_w, want_beta)[0], rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("ids", [[0] * 5 + [1] * 7 + [2] * 4, [[0] * 9 + [1] * 7, [0, 1] + [2] * 14]],
                             ids=["shared", "batched"])
    def test_packed_documents_restart_the_short_convolution(self, ids):
        """With document_ids, each document's w comes from its own tokens (the authors' layer per sequence): the
        short convolution read the previous document's last tokens into a document's first transitions."""
        path = PaTHPositionalEmbedding(D, H, num_kv_heads=2, conv_size=4).double()
        x = torch.randn(B, N, D, dtype=torch.float64)
        q, k, v = (t.double() for t in qkv())
        ids = torch.tensor(ids)
        got = attention(q, k, v, path(x), causal=True, document_ids=ids)
        for row in range(B):
            row_ids = ids[row] if ids.dim() == 2 else ids
            for doc in row_ids.unique():
                keep = row_ids == doc
                w, beta = path_layer_transitions(path, x[row:row + 1, keep])                # the document alone
                parts = (t[row:row + 1, :, keep] for t in (q, k, v))
                want = path_oracle(*parts, w.repeat_interleave(2, 1), beta.repeat_interleave(2, 1))[0]
                torch.testing.assert_close(got[row:row + 1, :, keep], want, rtol=1e-12, atol=1e-12)

    def test_state_dict_names_are_the_authors_layer(self):
        # flash-linear-attention's PaTHAttention (fla/layers/path_attn.py) names its w, beta and gate parts so
        path = PaTHPositionalEmbedding(D, H, forget_gate=True)
        assert set(path.state_dict()) == {"w_proj.0.weight", "w_proj.1.weight", "w_conv1d.weight", "bt_proj.weight",
                                          "bt_proj.bias", "forget.fgate_proj.weight", "forget.fgate_proj.bias"}
        assert path.w_conv1d.weight.shape == (D, 1, 3) and path.w_proj[0].weight.shape == (32, D)

    def test_a_layers_projections_are_used_by_reference(self):
        class LayerLike(nn.Module):   # the parts of flash-linear-attention's PaTHAttention, by their names
            def __init__(self):
                super().__init__()
                self.w_proj = nn.Sequential(nn.Linear(D, 32, bias=False), nn.Linear(32, D, bias=False))
                self.w_conv1d = nn.Conv1d(D, D, 3, groups=D, bias=False, padding=2)   # ShortConvolution's base
                self.bt_proj, self.g_proj = nn.Linear(D, H), nn.Linear(D, H)

        layer = LayerLike()
        shared = PaTHPositionalEmbedding(D, H, forget_gate=True, layer=layer)
        assert shared.w_proj is layer.w_proj and shared.forget.fgate_proj is layer.g_proj
        assert (shared.w_rank, shared.conv_size) == (32, 3)
        loaded = PaTHPositionalEmbedding(D, H, forget_gate=True)
        loaded.load_state_dict({name.replace("g_proj", "forget.fgate_proj"): t for name, t in layer.state_dict().items()})
        x, (q, k, v) = torch.randn(B, N, D), qkv()
        torch.testing.assert_close(attention(q, k, v, shared(x), causal=True), attention(q, k, v, loaded(x), causal=True))
        with pytest.raises(TypeError, match="PaTHPositionalEmbedding: layer must be an nn.Module with w_proj, w_conv1d, "
                                            "bt_proj, g_proj"):
            PaTHPositionalEmbedding(D, H, forget_gate=True, layer=nn.Linear(2, 2))

    @pytest.mark.parametrize("num_kv_heads, forget_gate", [(H, False), (2, True)])
    def test_matches_authors_naive_function(self, num_kv_heads, forget_gate):
        pytest.importorskip("einops")                                                   # the reference's import
        reference = fla_reference("path_attn/naive.py", "naive_path_attn")
        w, beta = random_transitions(B, num_kv_heads, N, DH, torch.float32)
        log_forget = F.logsigmoid(torch.randn(B, H, N) + 2) if forget_gate else torch.zeros(B, H, N)
        q, k, v = qkv()
        k, v = k[:, :num_kv_heads], v[:, :num_kv_heads]
        path = PaTHPositionalEmbedding(D, H, num_kv_heads=num_kv_heads, forget_gate=forget_gate, block_size=4)
        bound = path.bind(w=w, beta=beta, log_forget=log_forget if forget_gate else None)
        layout = lambda t: t.transpose(1, 2).contiguous()                               # [B, T, H, ...]
        want = reference(layout(q), layout(k), layout(v), layout(w), beta.transpose(1, 2), log_forget.transpose(1, 2),
                         scale=DH ** -0.5, chunk_size=8)
        # the reference computes in float32 throughout (its own rounding, about 1e-6)
        torch.testing.assert_close(attention(q, k, v, bound, causal=True), layout(want), rtol=0, atol=2e-5)

    @pytest.mark.parametrize("gate_scaled", [True, False])
    def test_without_a_token_width_it_binds_precomputed_values_and_owns_nothing(self, gate_scaled):
        """dim=None: no projections (no parameters at all, the forget gate's included); bound to precomputed
        w, beta and log f it equals the float64 oracle and the full module bound to the same values."""
        bare = PaTHPositionalEmbedding(None, H, DH, num_kv_heads=2, forget_gate=True, gate_scaled=gate_scaled,
                                       block_size=4)
        assert list(bare.parameters()) == [] and list(bare.state_dict()) == []
        assert (bare.w_proj, bare.w_conv1d, bare.bt_proj, bare.forget.fgate_proj) == (None, None, None, None)
        w, beta = random_transitions(B, 2, N, DH)
        log_forget = F.logsigmoid(torch.randn(B, H, N, dtype=torch.float64) + 2)
        q, k, v = (t.double() for t in qkv(N - 3, N))
        k, v = k[:, :2], v[:, :2]
        got = attention(q, k, v, bare.bind(w=w, beta=beta, log_forget=log_forget), causal=True)
        want, _ = path_oracle(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), w, beta, log_forget, gate_scaled)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        full = PaTHPositionalEmbedding(D, H, num_kv_heads=2, forget_gate=True, gate_scaled=gate_scaled, block_size=4)
        torch.testing.assert_close(got, attention(q, k, v, full.bind(w=w, beta=beta, log_forget=log_forget), causal=True),
                                   rtol=0, atol=0)
        plain = PaTHPositionalEmbedding(None, H, DH, block_size=4).bind(w=w.repeat_interleave(2, 1),
                                                                        beta=beta.repeat_interleave(2, 1))
        torch.testing.assert_close(plain(q, k.repeat_interleave(2, 1)),
                                   path_oracle(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                               w.repeat_interleave(2, 1), beta.repeat_interleave(2, 1))[1],
                                   rtol=1e-12, atol=1e-12)
        owner = "PaTHPositionalEmbedding: "
        with pytest.raises(ValueError, match=owner + "built with dim=None, without projections: it binds precomputed "
                                                     "inputs only \\(see bind\\), got token states x"):
            bare(torch.randn(B, N, D))
        with pytest.raises(ValueError, match=owner + "not bound: built with dim=None"):
            attention(q, k, v, bare, causal=True)
        with pytest.raises(ValueError, match=owner + "dim=None \\(no projections: bind precomputed w and beta\\) needs "
                                                     "head_dim and no layer, got head_dim=None"):
            PaTHPositionalEmbedding(None, H)

    def test_no_reflection_is_plain_causal_attention(self):
        q, k, v = qkv()
        bound = PaTHPositionalEmbedding(D, H).bind(w=torch.randn(B, H, N, DH), beta=torch.zeros(B, H, N))
        torch.testing.assert_close(attention(q, k, v, bound, causal=True), attention(q, k, v, causal=True))

    def test_decoding_equals_the_full_pass(self):
        path = PaTHPositionalEmbedding(D, H, forget_gate=True, block_size=4)
        x = torch.randn(B, N, D)
        q, k, v = qkv()
        full = attention(q, k, v, path(x), causal=True)
        for t in (1, 5, N):
            step = attention(q[..., t - 1:t, :], k[..., :t, :], v[..., :t, :], path(x[:, :t]), causal=True)
            torch.testing.assert_close(step, full[..., t - 1:t, :], rtol=1e-5, atol=1e-6)

    def test_gradients_match_the_oracle(self):
        path = PaTHPositionalEmbedding(D, H, block_size=3).double()
        x = torch.randn(1, 7, D, dtype=torch.float64, requires_grad=True)
        q, k, v = (t.double()[:1, :, :7].requires_grad_() for t in qkv())
        weights = torch.randn(1, H, 7, DH, dtype=torch.float64)
        parameters = (x, q, k, path.w_proj[0].weight, path.w_conv1d.weight, path.bt_proj.bias)
        got = torch.autograd.grad((attention(q, k, v, path(x), causal=True) * weights).sum(), parameters)
        want = torch.autograd.grad((path_oracle(q, k, v, *path_layer_transitions(path, x))[0]
                                    * weights).sum(), parameters)
        for g, w_ in zip(got, want):
            torch.testing.assert_close(g, w_, rtol=1e-9, atol=1e-11)

    def test_bfloat16_stays_near_the_float64_oracle(self):
        path = PaTHPositionalEmbedding(D, H, block_size=4)
        w, beta = random_transitions(B, H, N, DH, torch.float32)
        q, k, v = qkv()
        want, _ = path_oracle(q, k, v, w, beta)
        got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), path.bind(w=w, beta=beta), causal=True)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0.03)

    def test_bad_inputs(self):
        owner = "PaTHPositionalEmbedding: "
        path = PaTHPositionalEmbedding(D, H)
        w, beta = random_transitions(B, H, N, DH, torch.float32)
        with pytest.raises(ValueError, match=owner + "num_heads must be a multiple of num_kv_heads.*=4 and .*=3"):
            PaTHPositionalEmbedding(D, H, num_kv_heads=3)
        with pytest.raises(ValueError, match=owner + "w_rank must be a positive int, got w_rank=0"):
            PaTHPositionalEmbedding(D, H, w_rank=0)
        with pytest.raises(ValueError, match=owner + r"dim must be at least num_heads when head_dim is not given "
                                                     r"\(its default is dim // num_heads\), got dim=3 and num_heads=4"):
            PaTHPositionalEmbedding(3, 4)                                               # Conv1d's groups=0 before
        assert PaTHPositionalEmbedding(3, 4, head_dim=2).w_conv1d.groups == 8
        with pytest.raises(TypeError, match=owner + "gate_scaled must be a bool"):
            PaTHPositionalEmbedding(D, H, gate_scaled="yes")
        with pytest.raises(ValueError, match=owner + "bind takes either x or w and beta"):
            path.bind()
        with pytest.raises(ValueError, match=owner + "x must be \\[B, N, D=128\\], got \\(2, 16, 127\\)"):
            path(torch.randn(B, N, D - 1))
        with pytest.raises(ValueError, match=owner + "w and beta must be \\[B, Hkv=4, N, Dh=32\\].*got \\(2, 4, 16, 31\\)"):
            path.bind(w=w[..., :-1], beta=beta)
        with pytest.raises(ValueError, match=owner + "bind takes log_forget with w and beta exactly when forget_gate"):
            path.bind(w=w, beta=beta, log_forget=torch.zeros(B, H, N))
        with pytest.raises(ValueError, match=owner + "not bound to token states.*call pe\\(x\\)"):
            attention(*qkv(), path, causal=True)
        with pytest.raises(ValueError, match=owner + "positions_q must be None: order comes from the Householder"):
            path.bind(w=w, beta=beta).forward_attn(*qkv()[:2], torch.arange(N))
        with pytest.raises(ValueError, match=owner + "k has more tokens than the bound encoding.*Nk=20"):
            path.bind(w=w, beta=beta).forward_attn(*qkv(20, 20)[:2])
        with pytest.raises(ValueError, match="causal=False with PaTHPositionalEmbedding"):
            attention(*qkv(), path.bind(w=w, beta=beta), causal=False)


# ===========================================================================
# Cross-cutting
# ===========================================================================



# ---------------------------------------------------------------------------
# Randomized positions
# ---------------------------------------------------------------------------


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


class TestRandomized:
    def test_draws_are_sorted_distinct_and_in_range(self):
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 40, generator=seeded())
        for n in (1, 7, 40):
            p = pe.draw(n)
            assert p.dtype == torch.int64 and p.shape == (n,)
            assert bool((p[1:] > p[:-1]).all()) and 0 <= p.min() and p.max() < 40
        assert pe.draw(40).tolist() == list(range(40))                                 # n = L: every position

    def test_draw_counts_are_ints_from_0_to_max_len(self):
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 16, generator=seeded())
        assert pe.draw(0).shape == (0,) and pe.draw(torch.tensor(3)).shape == (3,)
        with pytest.raises(ValueError, match="^RandomizedPositionalEmbedding: n must be a non-negative int, got n=-1$"):
            pe.draw(-1)                                                                 # was 15 positions
        for bad, kind in ((2.5, "float 2.5"), (True, "bool True"), ("3", "str '3'")):
            with pytest.raises(TypeError, match=f"^RandomizedPositionalEmbedding: n must be an int, got {kind}"):
                pe.draw(bad)
        with pytest.raises(ValueError, match="a sequence of 17 tokens needs max_len >= 17, got max_len=16"):
            pe.draw(17)

    def test_randomized_positions_are_the_wrappers_draws(self):
        """The public sampler and the wrapper draw the same positions under one seed: in draw(), and in the
        positions attention() uses in training (the wrapped RoPE at the function's draws, to the bit)."""
        rope = RotaryPositionalEmbedding(DH)
        pe = RandomizedPositionalEmbedding(rope, 50, generator=seeded(4))
        mine = seeded(4)
        for n in (1, 12, 50, 0):
            assert torch.equal(pe.draw(n), randomized_positions(n, 50, generator=mine))
        q, k, v = qkv(5, 12)
        drawn = randomized_positions(12, 50, generator=mine)
        torch.testing.assert_close(attention(q, k, v, pe, causal=True),
                                   attention(q, k, v, rope, positions_q=drawn[7:], positions_k=drawn, causal=True),
                                   rtol=0, atol=0)
        torch.manual_seed(5)
        unseeded = randomized_positions(7, 9)                                            # torch's global generator
        torch.manual_seed(5)
        assert torch.equal(unseeded, RandomizedPositionalEmbedding(rope, 9).draw(7))
        assert randomized_positions(3, 10, device="meta").is_meta
        owner = "randomized_positions: "
        with pytest.raises(ValueError, match=owner + "n must be a non-negative int, got n=-1"):
            randomized_positions(-1, 10)
        with pytest.raises(TypeError, match=owner + "n must be an int, got float 2.5"):
            randomized_positions(2.5, 10)
        with pytest.raises(ValueError, match=owner + "a sequence of 11 tokens needs max_len >= 11, got max_len=10"):
            randomized_positions(11, 10)
        with pytest.raises(TypeError, match=owner + "generator must be a torch.Generator or None, got int"):
            randomized_positions(1, 10, generator=0)

    def test_every_subset_is_equally_likely(self):
        # L = 5, N = 2: the 10 subsets each with probability 1/10; 20000 draws, a chi-square test at 10^-4
        # (27.9 is the 0.9999 quantile of chi-square with 9 degrees of freedom).
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 5, generator=seeded(1))
        counts = collections.Counter(tuple(pe.draw(2).tolist()) for _ in range(20000))
        assert sorted(counts) == sorted(itertools.combinations(range(5), 2))
        chi2 = sum((c - 2000) ** 2 / 2000 for c in counts.values())
        assert chi2 < 27.9, chi2

    def test_inclusion_frequency_is_n_over_l(self):
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64, generator=seeded(2))
        hits = torch.zeros(64)
        for _ in range(4000):
            hits[pe.draw(16)] += 1
        # each position is drawn with probability 16/64; binomial sd sqrt(4000 * 0.25 * 0.75) = 27.4: 5 sd
        assert (hits - 1000).abs().max() < 5 * 27.4

    def test_seeded_generators_repeat_the_draws(self):
        a = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 100, generator=seeded(3))
        b = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 100, generator=seeded(3))
        q, k, v = qkv(12, 12)
        torch.testing.assert_close(attention(q, k, v, a, causal=True), attention(q, k, v, b, causal=True),
                                   rtol=0, atol=0)
        assert not torch.equal(a.draw(12), a.draw(12))                                  # and draws move on

    @pytest.mark.parametrize("make", [
        lambda: RotaryPositionalEmbedding(DH, interleaved=True),
        lambda: ALiBiPositionalEmbedding(H),
        lambda: T5PositionalEmbedding(H, bidirectional=False),
        lambda: TransformerXLPositionalEmbedding(H, DH),
        lambda: ShawPositionalEmbedding(H, DH, max_distance=50),                      # logits and a value term
        lambda: XPosPositionalEmbedding(DH),
    ], ids=["rope", "alibi", "t5", "transformer_xl", "shaw_values", "xpos"])
    def test_training_is_the_encoding_at_one_draw(self, make):
        # One draw per call, used by every hook: equal to the wrapped encoding given those positions.
        torch.manual_seed(0)
        inner = make()
        pe = RandomizedPositionalEmbedding(inner, 200, generator=seeded(4))
        positions = RandomizedPositionalEmbedding(make(), 200, generator=seeded(4)).draw(12)
        q, k, v = qkv(12, 12)
        want = attention(q, k, v, inner, positions_q=positions, positions_k=positions, causal=True)
        torch.testing.assert_close(attention(q, k, v, pe, causal=True), want, rtol=0, atol=0)
        decode = RandomizedPositionalEmbedding(inner, 200, generator=seeded(4))      # Nq < Nk: last Nq keys
        want = inner.forward_attn(q[..., -3:, :], k, positions[-3:], positions)
        torch.testing.assert_close(decode.forward_attn(q[..., -3:, :], k), want, rtol=0, atol=0)

    def test_input_kind_in_training_and_eval(self):
        inner = SinusoidalPositionalEmbedding(D)
        pe = RandomizedPositionalEmbedding(inner, 500, generator=seeded(5))
        x = torch.randn(B, 10, D)
        positions = RandomizedPositionalEmbedding(inner, 500, generator=seeded(5)).draw(10)
        torch.testing.assert_close(pe(x), inner(x, positions), rtol=0, atol=0)
        torch.testing.assert_close(pe.eval()(x), inner(x), rtol=0, atol=0)
        torch.testing.assert_close(pe(x, offset=3), inner(x, offset=3), rtol=0, atol=0)

    def test_eval_and_explicit_positions_pass_through(self):
        inner = ALiBiPositionalEmbedding(H)
        pe = RandomizedPositionalEmbedding(inner, 500)
        q, k, v = qkv(9, 9)
        positions = torch.tensor([0, 3, 4, 10, 11, 30, 31, 32, 90])
        torch.testing.assert_close(attention(q, k, v, pe, positions_q=positions, positions_k=positions),
                                   attention(q, k, v, inner, positions_q=positions, positions_k=positions))
        torch.testing.assert_close(attention(q, k, v, pe.eval()), attention(q, k, v, inner))
        assert pe.is_causal and pe.kind == "bias"

    def test_gradients_reach_the_wrapped_parameters(self):
        inner = T5PositionalEmbedding(H, num_buckets=8, max_distance=64)
        pe = RandomizedPositionalEmbedding(inner, 64, generator=seeded(6))
        q, k, v = qkv(10, 10)
        attention(q, k, v, pe).sum().backward()
        assert inner.relative_attention_bias.weight.grad.abs().sum() > 0

    def test_bad_input_is_named(self):
        with pytest.raises(TypeError, match="RandomizedPositionalEmbedding: encoding must be a PositionalEmbedding"):
            RandomizedPositionalEmbedding(torch.nn.Linear(2, 2), 10)
        with pytest.raises(ValueError, match="RandomizedPositionalEmbedding: encoding must take positions"):
            RandomizedPositionalEmbedding(HeinsenPositionalEmbedding(D, 8), 10)
        with pytest.raises(ValueError, match="RandomizedPositionalEmbedding: encoding must take one position axis"):
            RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH, sections=[4, 6, 6]), 10)
        with pytest.raises(ValueError, match="RandomizedPositionalEmbedding: max_len"):
            RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 0)
        with pytest.raises(TypeError, match="RandomizedPositionalEmbedding: generator"):
            RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 10, generator=0)
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 8)
        with pytest.raises(ValueError, match="RandomizedPositionalEmbedding: a sequence of 9 tokens needs max_len >= 9"):
            attention(*qkv(9, 9), pe)
        with pytest.raises(ValueError, match="RandomizedPositionalEmbedding: offset=2 in training mode"):
            RandomizedPositionalEmbedding(SinusoidalPositionalEmbedding(D), 64)(torch.randn(1, 4, D), offset=2)

    def test_wrapping_itself_is_refused(self):
        # a RandomizedPositionalEmbedding of one recursed without end in attention() (RecursionError)
        inner = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64)
        with pytest.raises(ValueError, match=r"^RandomizedPositionalEmbedding: encoding must not be a "
                                             r"RandomizedPositionalEmbedding itself \(one draw serves a call; wrap "
                                             r"its .encoding instead\), got RandomizedPositionalEmbedding\(max_len=64\)$"):
            RandomizedPositionalEmbedding(inner, 64)

    def test_max_len_within_the_wrapped_table(self):
        # draws past a table's rows failed at random steps of training; now at construction
        for make, name in ((lambda: LearnedPositionalEmbedding(20, D), "LearnedPositionalEmbedding"),
                           (lambda: UnifiedPositionalEmbedding(20, H, DH), "UnifiedPositionalEmbedding")):
            with pytest.raises(ValueError, match=rf"^RandomizedPositionalEmbedding: max_len must be at most the "
                                                 rf"wrapped {name}'s max_len=20 \(positions are drawn from \[0, "
                                                 rf"max_len\) and index its table\), got max_len=21$"):
                RandomizedPositionalEmbedding(make(), 21)
        for window in (RelativePositionBias2D(H, window_size=(3, 4)), ContinuousPositionBias(H, window_size=(3, 4))):
            with pytest.raises(ValueError, match=rf"^RandomizedPositionalEmbedding: max_len must be at most the "
                                                 rf"wrapped {type(window).__name__}'s num_tokens=12 \(positions are "
                                                 rf"drawn from \[0, max_len\) and index its window\), got max_len=13$"):
                RandomizedPositionalEmbedding(window, 13)
            RandomizedPositionalEmbedding(window, 12)                                   # the whole window: accepted
        inner = LearnedPositionalEmbedding(20, D)
        pe = RandomizedPositionalEmbedding(inner, 20, generator=seeded(7))             # the whole table: accepted
        x = torch.randn(B, 12, D)
        torch.testing.assert_close(pe(x), inner(x, randomized_positions(12, 20, generator=seeded(7))), rtol=0, atol=0)

    @pytest.mark.parametrize("device, error, message", DEVICE_MISTAKES)
    def test_draw_device_is_checked(self, device, error, message):
        # randomized_positions(5, 100, device=torch.float32) returned float positions
        with pytest.raises(error, match=f"^randomized_positions: device {re.escape(message)}$"):
            randomized_positions(5, 100, device=device)
        assert randomized_positions(5, 100, device="cpu").dtype == torch.long

    def test_encodings_without_positions_are_named_plainly(self):
        # the message read "its order comes from order comes from the forget gates ..."
        with pytest.raises(ValueError, match=r"^RandomizedPositionalEmbedding: encoding must take positions, got "
                                             r"ForgettingPositionalEmbedding, which takes none \(order comes from the "
                                             r"forget gates of the bound tokens\)$"):
            RandomizedPositionalEmbedding(ForgettingPositionalEmbedding(D, H), 64)
        with pytest.raises(ValueError, match=r"^RandomizedPositionalEmbedding: encoding must take positions, got "
                                             r"CoPEPositionalEmbedding, which takes none \(contextual positions are "
                                             r"counted by the gates\)$"):
            RandomizedPositionalEmbedding(CoPEPositionalEmbedding(H, DH), 64)

    def test_forward_of_a_qk_encoding_needs_q_and_k(self):
        # pe(q), as for a plain RoPE, was a bare "forward_attn() missing 1 required positional argument: 'k'"
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64)
        q, k, _ = qkv()
        with pytest.raises(TypeError, match=r"^RandomizedPositionalEmbedding: forward of a wrapped 'qk' encoding "
                                            r"takes q and k .*got 1 positional argument\(s\); to encode q alone, draw "
                                            r"once, p = pe.draw\(n\), and call pe.encoding\(q, p\)$"):
            pe(q)
        assert pe(q, k).shape == (B, H, N, N) and pe(q, k=k).shape == (B, H, N, N)

    def test_training_compiles_fullgraph_dynamic_as_documented(self):
        """torch.compile(fullgraph=True, dynamic=True) in training (the docstring's seeded generator failed to
        trace): the global generator's draw is in the graph (compiled equals eager under two seeds, at two
        lengths); a seeded generator's draw made outside, passed as positions, compiles; without fullgraph the
        seeded draw is a graph break and gives eager's values."""
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64)
        fn = lambda q, k, v: attention(q, k, v, pe, causal=True)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
        for n, seed in ((12, 3), (16, 4)):
            q, k, v = qkv(n, n)
            torch.manual_seed(seed)
            got = compiled(q, k, v)
            torch.manual_seed(seed)
            torch.testing.assert_close(got, fn(q, k, v))
        seeded_pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(DH), 64, generator=seeded())
        drawn = lambda q, k, v, p: attention(q, k, v, seeded_pe, causal=True, positions_q=p[-q.shape[-2]:],
                                             positions_k=p)
        torch._dynamo.reset()
        compiled = torch.compile(drawn, fullgraph=True, dynamic=True, backend="eager")
        q, k, v = qkv(N - 4, N)
        p = seeded_pe.draw(N)
        torch.testing.assert_close(compiled(q, k, v, p), drawn(q, k, v, p))
        inside = lambda q, k, v: attention(q, k, v, seeded_pe, causal=True)
        torch._dynamo.reset()
        compiled = torch.compile(inside, dynamic=True, backend="eager")
        seeded_pe.generator.manual_seed(5)
        got = compiled(q, k, v)
        seeded_pe.generator.manual_seed(5)
        torch.testing.assert_close(got, inside(q, k, v))

    @pytest.mark.parametrize("training", [True, False])
    def test_tensors_without_a_token_axis_are_named(self, training):
        """q, k, v or the output of one dim: an IndexError (their lengths were read before any check)."""
        pe = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(8, rotate_values=True), 64).train(training)
        flat, x = torch.randn(8), torch.randn(1, 2, 4, 8)
        for call, name in ((lambda: pe.forward_attn(flat, x), "q"), (lambda: pe(x, flat), "k"),
                           (lambda: pe.encode_v(flat, 4), "v"), (lambda: pe.decode_output(flat, 4), "out")):
            with pytest.raises(ValueError, match=rf"RandomizedPositionalEmbedding: {name} must have at least 2 dims, "
                                                 r"got shape \(8,\)"):
                call()


# ---------------------------------------------------------------------------
# layer_encodings: each layer's encoding from a config (Llama 4, SmolLM3, Gemma, DeepSeek-V4, ...)
# ---------------------------------------------------------------------------


class TestLayerEncodings:
    """layer_encodings against the models: which layers rotate, and the logits with our encodings swapped in."""

    def test_smollm3_logits(self):
        config, model, modeling, ids, want = tiny_causal_lm("SmolLM3Config", "SmolLM3ForCausalLM", **SMOLLM3_TINY)
        encodings = layer_encodings(config)
        got, called = logits_with_our_rope(model, modeling, "apply_rotary_pos_emb", encodings, -2, ids)
        assert called == [i for i, pe in enumerate(encodings) if isinstance(pe, RotaryPositionalEmbedding)] \
            == [0, 2, 3, 5]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_llama4_rope_layers_logits(self):
        config, model, modeling, ids, want = tiny_causal_lm("Llama4TextConfig", "Llama4ForCausalLM", **LLAMA4_TINY)
        # want: the model's own temperature on its NoPE layers stays on
        encodings = layer_encodings(config)
        got, called = logits_with_our_rope(model, modeling, "apply_rotary_emb", encodings, -3, ids)
        assert called == [0, 2] and [type(pe).__name__ for pe in encodings][1::2] == \
            ["QueryTemperaturePositionalEmbedding"] * 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_schedules_of_the_default_configs(self):
        transformers = pytest.importorskip("transformers")
        smol = layer_encodings(transformers.SmolLM3Config())
        assert len(smol) == 36 and [i for i, pe in enumerate(smol) if isinstance(pe, NoPositionalEmbedding)] == \
            list(range(3, 36, 4))
        llama4 = layer_encodings(transformers.Llama4Config())                          # the multimodal config
        temperatures = [pe for pe in llama4 if isinstance(pe, QueryTemperaturePositionalEmbedding)]
        assert len(llama4) == 48 and len(temperatures) == 12
        assert (temperatures[0].length, temperatures[0].scale, temperatures[0].shift) == (8192.0, 0.1, 1)
        assert llama4[0].interleaved and llama4[0].base == 500000.0
        v4 = layer_encodings(transformers.DeepseekV4Config(layer_types=["sliding_attention",
                                                                         "compressed_sparse_attention"] * 2,
                                                            num_hidden_layers=4))
        assert [pe.base for pe in v4] == [1e4, 1.6e5, 1e4, 1.6e5] and v4[0].rotary_dim == 64 and v4[0].rotate_values
        gemma = layer_encodings(transformers.Gemma3TextConfig(num_hidden_layers=6))
        assert [pe.base for pe in gemma] == [1e4] * 5 + [1e6]                          # five sliding, one full
        with pytest.raises(TypeError, match="layer_encodings: Mistral Large 4 needs rope_alpha"):
            layer_encodings(transformers.MistralLarge4TextConfig())
        large4 = layer_encodings(transformers.MistralLarge4TextConfig(), rope_alpha=torch.zeros(32))
        assert [isinstance(pe, NoPositionalEmbedding) for pe in large4[:4]] == [False, False, False, True]
        assert (large4[0].dim, large4[0].rotary_dim, large4[0].rotated_channels) == (128, 64, "trailing")
        with pytest.raises(ValueError, match="model_type='mistral_large4_text' is not supported .*rope_alpha"):
            RotaryPositionalEmbedding.from_config(transformers.MistralLarge4TextConfig())

    def test_each_layer_says_which_rope_parameters_it_got(self):
        """Per-layer-type RoPEs carry their layer type (the key of the config's rope_parameters), in the repr
        too; layers of one type share one module; a single RoPE for every layer has None."""
        transformers = pytest.importorskip("transformers")
        config = transformers.Gemma3TextConfig(num_hidden_layers=6)
        gemma = layer_encodings(config)
        assert [pe.layer_type for pe in gemma] == list(config.layer_types) == \
            ["sliding_attention"] * 5 + ["full_attention"]
        assert "layer_type='full_attention'" in repr(gemma[5]) and gemma[0] is gemma[4]
        assert gemma[5].base == config.rope_parameters["full_attention"]["rope_theta"]
        v4 = layer_encodings(transformers.DeepseekV4Config(layer_types=["sliding_attention",
                                                                         "compressed_sparse_attention"] * 2,
                                                            num_hidden_layers=4))
        assert [pe.layer_type for pe in v4] == ["main", "compress"] * 2
        smol = layer_encodings(transformers.SmolLM3Config(num_hidden_layers=4))
        assert smol[0].layer_type is None and "layer_type" not in repr(smol[0])
        assert RotaryPositionalEmbedding.from_config(config, layer_type="sliding_attention").layer_type == \
            "sliding_attention"

    SMOLLM3_DICT = {"model_type": "smollm3", "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                    "rope_theta": 2e6}
    LLAMA4_DICT = {"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                   "head_dim": 8, "rope_theta": 5e5, "no_rope_layer_interval": 2}

    def test_a_zero_no_rope_layer_interval_is_named(self):
        """A ZeroDivisionError before."""
        with pytest.raises(ValueError, match="layer_encodings: no_rope_layer_interval must be a positive int, "
                                             "got no_rope_layer_interval=0"):
            layer_encodings({**self.SMOLLM3_DICT, "no_rope_layer_interval": 0})
        assert [type(pe).__name__ for pe in layer_encodings({**self.SMOLLM3_DICT, "no_rope_layer_interval": 2})] == \
            ["RotaryPositionalEmbedding", "NoPositionalEmbedding"] * 2

    def test_llama4_temperature_fields_are_named_as_the_config_names_them(self):
        """floor_scale=0 blamed QueryTemperaturePositionalEmbedding's length, an argument the user never passed."""
        with pytest.raises(ValueError, match=r"layer_encodings: floor_scale must be a finite number > 0\.0, "
                                             r"got floor_scale=0"):
            layer_encodings({**self.LLAMA4_DICT, "floor_scale": 0})
        with pytest.raises(ValueError, match=r"layer_encodings: attn_scale must be a finite number >= 0\.0, "
                                             r"got attn_scale=-1"):
            layer_encodings({**self.LLAMA4_DICT, "attn_scale": -1})
        temperature = layer_encodings({**self.LLAMA4_DICT, "floor_scale": 16, "attn_scale": 0.25})[1]
        assert (temperature.length, temperature.scale) == (16.0, 0.25)

    def test_mistral_large4_output_with_our_rope(self):
        """A tiny Mistral Large 4 (YaRN, learned alpha, NoPE layers, its indexer): the model's output with our
        rotation swapped in for its apply_rotary_pos_emb_interleave equals its own, and our whole-head module
        on [nope | rope] equals the rope slice turned."""
        transformers = pytest.importorskip("transformers")
        modeling = importlib.import_module("transformers.models.mistral_large4.modeling_mistral_large4")
        torch.manual_seed(0)
        config = transformers.MistralLarge4TextConfig(
            vocab_size=64, hidden_size=64, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, no_rope_layers=[1, 0, 1, 0],
            max_position_embeddings=64, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0})
        model = modeling.MistralLarge4TextModel(config).eval()
        with torch.no_grad():
            model.rotary_emb.alpha.normal_(0, 0.3)           # a trained checkpoint's factors (zero at init)
            for layer in model.layers:
                layer.self_attn.softmax_scaling.scale.normal_(0, 0.1)
                layer.self_attn.softmax_scaling.bias.fill_(1.0)
        layers = layer_encodings(config, rope_alpha=model.rotary_emb.alpha)
        assert [isinstance(pe, NoPositionalEmbedding) for pe in layers] == [False, True, False, True]
        rope = layers[0]
        slice_rope = RotaryPositionalEmbedding(8, interleaved=True, frequencies=rope.frequencies)
        positions, calls = torch.arange(12), []

        def ours(q, k, cos, sin, unsqueeze_dim=1):       # [B, H, N, R] (attention) or [B, N, H, R] (indexer)
            seq_dim = -2 if unsqueeze_dim == 1 else -3
            calls.append(seq_dim)
            turn = lambda x: None if x is None else slice_rope(x, positions[-x.shape[seq_dim]:], seq_dim=seq_dim)  # noqa: E731
            return turn(q), turn(k)

        ids = torch.randint(0, 64, (1, 12))
        with torch.no_grad():
            theirs = model(input_ids=ids).last_hidden_state
            original = modeling.apply_rotary_pos_emb_interleave
            modeling.apply_rotary_pos_emb_interleave = ours
            try:
                swapped = model(input_ids=ids).last_hidden_state
            finally:
                modeling.apply_rotary_pos_emb_interleave = original
        MAX_DIFF["mistral_large4 model output"] = (swapped - theirs).abs().max().item()
        assert calls and MAX_DIFF["mistral_large4 model output"] < 2e-6
        head = torch.randn(1, 2, 12, 16)                                                  # [nope 8 | rope 8]
        torch.testing.assert_close(rope(head), torch.cat([head[..., :8], slice_rope(head[..., 8:])], -1),
                                   atol=0, rtol=0)

    def test_raw_dicts_and_bad_input(self):
        raw = {"model_type": "smollm3", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
               "rope_theta": 1e4, "no_rope_layer_interval": 3}
        assert [isinstance(pe, NoPositionalEmbedding) for pe in layer_encodings(raw)] == [False, False, True]
        with pytest.raises(ValueError, match="layer_encodings: config must set num_hidden_layers"):
            layer_encodings({"model_type": "llama", "rope_theta": 1e4})
        with pytest.raises(ValueError, match="no_rope_layers must have num_hidden_layers=3 entries, got 2"):
            layer_encodings({**raw, "no_rope_layers": [1, 0]})
        with pytest.raises(ValueError, match="layer_encodings: rope_alpha is Mistral Large 4's learned frequency "
                                             "factor; model_type='smollm3' has none"):
            layer_encodings(raw, rope_alpha=torch.zeros(8))
        large4 = {"model_type": "mistral_large4_text", "num_hidden_layers": 2, "head_dim": 16, "qk_rope_head_dim": 16,
                  "qk_nope_head_dim": 16, "rope_theta": 1e4}
        with pytest.raises(ValueError, match=r"rope_alpha must have qk_rope_head_dim / 2 = 8 entries .*got a tensor "
                                             r"of shape \[7\]"):
            layer_encodings(large4, rope_alpha=torch.zeros(7))
        with pytest.raises(TypeError, match="layer_encodings: Mistral Large 4 needs rope_alpha"):
            layer_encodings(large4, rope_alpha=[0.0] * 8)
        assert layer_encodings(large4, rope_alpha=torch.zeros(8))[1].frequencies == \
            RotaryPositionalEmbedding(16).inv_freq.tolist()                              # alpha 0: plain RoPE

    def test_per_layer_lists_of_another_length_or_kind_are_refused(self):
        """Before: layer_types of 2 for 4 layers gave 2 encodings (6 were cut to 4), Mistral Large 4's short
        no_rope_layers raised IndexError, "0" read as a RoPE layer, a non-finite rope_alpha was blamed on
        RotaryPositionalEmbedding's frequencies (never passed) and a meta one raised deep in torch."""
        owner, numpy = "layer_encodings: ", pytest.importorskip("numpy")
        gemma = {"model_type": "gemma3_text", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                 "head_dim": 16, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
        for count in (2, 6):
            with pytest.raises(ValueError, match=owner + f"layer_types must have num_hidden_layers=4 entries, "
                                                         f"got {count}"):
                layer_encodings({**gemma, "layer_types": ["sliding_attention", "full_attention"] * (count // 2)})
        built = layer_encodings({**gemma, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
        assert [pe.base for pe in built] == [1e4] * 3 + [1e6]
        large4 = {"model_type": "mistral_large4_text", "num_hidden_layers": 3, "head_dim": 16, "qk_rope_head_dim": 16,
                  "qk_nope_head_dim": 16, "rope_theta": 1e4}
        with pytest.raises(ValueError, match=owner + "no_rope_layers must have num_hidden_layers=3 entries, got 2"):
            layer_encodings({**large4, "no_rope_layers": [1, 0]}, rope_alpha=torch.zeros(8))
        smol = {"model_type": "smollm3", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                "rope_theta": 1e4}
        with pytest.raises(ValueError, match=owner + "no_rope_layers must have num_hidden_layers=3 entries, got 4"):
            layer_encodings({**smol, "no_rope_layers": [1, 0, 1, 0]})
        with pytest.raises(ValueError, match=owner + r"no_rope_layers must hold 1 \(RoPE\) and 0 \(NoPE\)"):
            layer_encodings({**smol, "no_rope_layers": ["1", "0", "0"]})
        assert [isinstance(pe, NoPositionalEmbedding) for pe in
                layer_encodings({**smol, "num_hidden_layers": numpy.int64(3), "no_rope_layers": [True, False, 1]})] \
            == [False, True, False]
        for bad in (float("nan"), 1000.0):                                   # exp(1000) overflows
            with pytest.raises(ValueError, match=owner + "rope_alpha must be finite"):
                layer_encodings(large4, rope_alpha=torch.full((8,), bad))
        with pytest.raises(ValueError, match=owner + "rope_alpha must hold the checkpoint's values.*meta device"):
            layer_encodings(large4, rope_alpha=torch.zeros(8, device="meta"))


# ---------------------------------------------------------------------------
# torch.export with a dynamic sequence length: one program, checked at two other lengths
# ---------------------------------------------------------------------------


# Every class named in issue 12 plus a few of the newer ones (each export costs ~0.2-3 s on one core).
# Not in this list, and why:
# - RelativePositionBias2D, ContinuousPositionBias: a window's table bounds the length (N <= Wh * Ww plus prefix
#   tokens); export works with Dim(max=window) and a larger max is refused by export itself (tests below).
# - ForgettingPositionalEmbedding: a bound module carries token states of one length; bind inside the exported
#   model instead, with the states as an input (test below).
# - ConvolutionalPositionalEmbedding with 2 axes: grid_shape is a Python tuple, so each grid is its own export.
# Known specialisation: attention(causal=True) on "qk" and "input" kinds takes SDPA's is_causal fast path when
# Nq == Nk, so an export with separate Nq and Nk dims holds only on the side of Nq == Nk of its example.
EXPORT_CASES = ["sinusoidal", "learned", "rotary", "rotary_yarn", "rotary_mrope", "t5", "alibi", "tupe",
                "transformer_xl", "enformer", "algebraic_sequence", "algebraic_grid", "algebraic_tree", "heinsen",
                "nope", "xpos_interleaved", "kerple_log", "sandwich", "fire_bidirectional", "cope", "shaw", "deberta",
                "dynamic_bias_2d", "mixed_rope", "liere_blocks", "conv_peg_1d", "fourier_octave"]


class _Exported(nn.Module):
    """``fn(pe, *inputs)`` as a module, so export sees the encoding's parameters and buffers."""

    def __init__(self, pe, fn):
        super().__init__()
        self.pe, self.fn = pe, fn

    def forward(self, *inputs):
        return self.fn(self.pe, *inputs)


def export_and_compare(pe, fn, make_inputs, dims, lengths=(9, 23), example=16, max_len=512):
    """Export ``fn(pe, *make_inputs(example))`` with dim ``dims[i]`` of input ``i`` dynamic (one Dim for all),
    then run the program at ``lengths`` against eager."""
    n = torch.export.Dim("n", min=2, max=max_len)
    program = torch.export.export(_Exported(pe, fn), make_inputs(example),
                                  dynamic_shapes=(tuple({dim: n} for dim in dims),))
    for length in lengths:
        inputs = make_inputs(length)
        torch.testing.assert_close(program.module()(*inputs), fn(pe, *inputs), msg=f"N={length}")


def _attend(pe, q, k, v, *positions):
    return attention(q, k, v, pe, causal=True, **dict(zip(("positions_q", "positions_k"), positions)))


# exported in the default run (one per kind); PE_SLOW=1 exports every case of EXPORT_CASES; the sample adds one
# per remaining base for the oldest and newest torch
QUICK_EXPORT_CASES = {"learned", "rotary", "alibi", "enformer"}
SAMPLE_EXPORT_CASES = {"heinsen", "algebraic_tree", "fire_bidirectional", "liere_blocks", "cope"}


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"), reason="torch.export needs torch >= 2.6 here")
class TestExport:
    @pytest.mark.parametrize("case", quick_or_slow([c for c in CASES if c.name in EXPORT_CASES], QUICK_EXPORT_CASES,
                                                   ids=[c.name for c in CASES if c.name in EXPORT_CASES],
                                                   sample=SAMPLE_EXPORT_CASES))
    def test_dynamic_length_matches_eager(self, case):
        """attention() (forward_input for the input kinds) at two lengths the program was not traced at."""
        pe = case.make().eval()
        if pe.kind == "input":
            export_and_compare(pe, lambda pe, x: pe.forward_input(x), lambda n: (tokens(case, n),), (1,))
            return
        extra = () if case.required_positions is None else (0, 0)

        def make_inputs(n):
            return (*qkv(n, n), *(p for p in case.positions(n, n) if p is not None))

        export_and_compare(pe, _attend, make_inputs, (2, 2, 2, *extra))

    @pytest.mark.parametrize("name", ["t5", "alibi", "tupe"])
    def test_bias_called_with_symbolic_lengths(self, name):
        pe = next(c for c in CASES if c.name == name).make().eval()
        export_and_compare(pe, lambda pe, q, k: pe(q.shape[-2], k.shape[-2]), lambda n: qkv(n, n)[:2], (2, 2))

    @pytest.mark.parametrize("name", ["t5", "alibi", "transformer_xl", "enformer"])
    def test_separate_query_and_key_lengths(self, name):
        """Decoding with a cache: Nq and Nk are two dims, queries bottom-right aligned (Nq == Nk included)."""
        pe = next(c for c in CASES if c.name == name).make().eval()
        nq, nk = torch.export.Dim("nq", min=1, max=512), torch.export.Dim("nk", min=1, max=512)
        program = torch.export.export(_Exported(pe, _attend), qkv(4, 16),
                                      dynamic_shapes=(({2: nq}, {2: nk}, {2: nk}),))
        for q_len, k_len in ((3, 9), (7, 7)):
            inputs = qkv(q_len, k_len)
            torch.testing.assert_close(program.module()(*inputs), _attend(pe, *inputs))

    def test_rotary_beyond_its_cache_and_symbolic_offset(self):
        """An unbounded length outgrows the cos/sin cache: the program computes the angles, never pins N."""
        pe = RotaryPositionalEmbedding(DH, cache_len=8)
        n = torch.export.Dim("n", min=2)
        program = torch.export.export(_Exported(pe, lambda pe, q, k: pe(q, offset=k.shape[-2])), qkv(4, 4)[:2],
                                      dynamic_shapes=(({2: n}, {2: n}),))
        for length in (9, 23):
            q, k, _ = qkv(length, length)
            torch.testing.assert_close(program.module()(q, k), pe(q, offset=length))

    def test_heinsen_over_several_blocks(self):
        """Lengths beyond one scan block (128 tokens) and not a multiple of it."""
        pe = HeinsenPositionalEmbedding(D, 16)
        export_and_compare(pe, lambda pe, x: pe(x), lambda n: (torch.randn(1, n, D),), (1,), lengths=(128, 300),
                           max_len=None)

    def test_forgetting_with_states_as_input(self):
        def fn(pe, q, k, v, x):
            return attention(q, k, v, pe(x), causal=True)

        export_and_compare(ForgettingPositionalEmbedding(D, H), fn, lambda n: (*qkv(n, n), torch.randn(B, n, D)),
                           (2, 2, 2, 1))

    def test_path_within_one_block(self):
        """PaTH's blocks are a Python loop (their count pinned the length even within one block): while exporting
        it takes one block, so a Dim up to block_size exports (the last length fills the block); a Dim that allows
        more says so."""
        pe = PaTHPositionalEmbedding(D, H, num_kv_heads=2, forget_gate=True, block_size=32)

        def fn(pe, q, k, v, x):
            return attention(q, k, v, pe(x), causal=True)

        export_and_compare(pe, fn, lambda n: (*qkv(n, n), torch.randn(B, n, D)), (2, 2, 2, 1), lengths=(9, 32),
                           max_len=32)
        with pytest.raises(ValueError, match=r"PaTHPositionalEmbedding: torch.export with a dynamic length needs "
                                             r"Nk <= block_size=32 .*export with a Dim of max <= 32"):
            export_and_compare(pe, fn, lambda n: (*qkv(n, n), torch.randn(B, n, D)), (2, 2, 2, 1), max_len=33)

    @pytest.mark.parametrize("make", [lambda: RelativePositionBias2D(H, (4, 5)),
                                      lambda: ContinuousPositionBias(H, (4, 5), hidden_dim=32)],
                             ids=["relpos2d", "cpb"])
    def test_window_bias_up_to_its_window(self, make):
        pe = make()
        export_and_compare(pe, _attend, lambda n: qkv(n, n), (2, 2, 2), lengths=(9, 20), max_len=20)
        with pytest.raises(torch._dynamo.exc.UserError, match="max=20"):
            export_and_compare(pe, _attend, lambda n: qkv(n, n), (2, 2, 2), max_len=64)


# ---------------------------------------------------------------------------
# torch.compile (fullgraph): every case's entry points and recompiles, the README's quick-start block
# ---------------------------------------------------------------------------


class QuickStartBlock(torch.nn.Module):
    """The README's quick-start block, with the positions a case requires and the forget gate bound to x."""

    def __init__(self, dim, heads, pe):
        super().__init__()
        self.heads, self.pe = heads, pe
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x, positions=None):
        x = self.pe.forward_input(x, positions)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)   # [B, H, N, Dh] each
        pe = self.pe(x) if isinstance(self.pe, pe_lib._BoundTokens) else self.pe
        attend_positions = None if pe.kind == "input" else positions
        y = attention(q, k, v, pe, causal=True, positions_q=attend_positions, positions_k=attend_positions)
        return self.out(y.transpose(1, 2).flatten(2))


# Every case compiles in the slow run (PE_SLOW=1, as .ci/run does; 2 to 8 s a case and test); the default run
# compiles one case per attention path.
QUICK_COMPILE_CASES = {"sinusoidal", "rotary", "t5_causal", "cope", "forgetting"}


# Cases that trace fullgraph at every length but recompile once between 16 and 40 tokens (found by the
# PE_SLOW run; the guard that fails is not identified yet: an open item, see the README limitations).
RECOMPILE_ONCE_CASES = {"heinsen", "fourier_octave"}
# PaTH's blockwise algorithm loops over its blocks in Python: a graph per number of blocks, ceil(N / block_size),
# and per whether N fills its last block (dynamo specialises the zero padding)
BLOCK_LOOP_CASES = {"path", "path_fox_gqa"}


def block_graphs(lengths, block_size: int) -> int:
    return len({(-(-n // block_size), n % block_size == 0) for n in lengths})
# dynamo before torch 2.7 recompiles Heinsen's block once more (3 graphs; measured on torch 2.6.0, outputs equal)
HEINSEN_GRAPHS = 3 if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 7) else 2
# one case per remaining base (and the version-sensitive Heinsen graphs) on the oldest and newest torch
SAMPLE_COMPILE_CASES = {"conv_peg_1d", "heinsen", "xpos_interleaved", "string_cayley", "algebraic_sequence",
                        "relpos2d", "graphormer_token", "transformer_xl", "rerope_leaky", "randomized_alibi"}
COMPILE_CASES = quick_or_slow(CASES, QUICK_COMPILE_CASES, ids=[case.name for case in CASES],
                              sample=SAMPLE_COMPILE_CASES)
# path_fox_gqa runs path's block loop: its recompiles are path's, and its dynamic graph takes dynamo about a
# minute to trace (sympy on the blocks' symbolic sizes); the quick-start block still compiles it dynamically
RECOMPILE_CASES = [param for param in COMPILE_CASES if param.id != "path_fox_gqa"]


class TestCompile:
    """torch.compile (dynamo, fullgraph) over every case: the entry points, recompiles, the quick-start block."""

    @pytest.mark.parametrize("case", COMPILE_CASES)
    def test_compile_fullgraph(self, case):
        pe = case.make()
        q, k, v = qkv()
        x = tokens(case)
        positions = dict(zip(("positions_q", "positions_k"), case.positions(N, N)))
        node_positions = () if pe.kind != "input" or case.required_positions is None else (case.required_positions(N),)
        entry_points = {
            "forward_attn": (pe.forward_attn, lambda: (q, k, *positions.values())),
            "forward_input": (pe.forward_input, lambda: (x, *node_positions)),
            "forward": (pe.forward, lambda: case.own_call_args(pe, q, k, x)),
            "attention": (lambda *a: attention(*a, pe, causal=True, **attention_positions(pe, positions.values())),
                          lambda: (q, k, v)),
        }
        for name, (fn, args) in entry_points.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(*args()), fn(*args()), msg=name)

    @pytest.mark.parametrize("case", RECOMPILE_CASES)
    def test_compile_recompiles_at_most_once_for_new_lengths(self, case):
        pe = case.make()
        graphs = []

        def counting_backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        lengths = (16, 12, 10, 14)
        if pe.kind == "input":  # its forward_attn never reads the encoding: compile what it encodes
            node_positions = lambda n: () if case.required_positions is None else (case.required_positions(n),)
            compiled = torch.compile(lambda x, *p: pe.forward_input(x, *p), backend=counting_backend, fullgraph=True)
            for n in lengths:
                x = tokens(case, n)
                torch.testing.assert_close(compiled(x, *node_positions(n)), case.forward_input(pe, x))
        else:
            compiled = torch.compile(lambda q, k, pq, pk: pe.forward_attn(q, k, pq, pk), backend=counting_backend,
                                     fullgraph=True)
            for n in lengths:
                q, k, _ = qkv(n, n)
                torch.testing.assert_close(compiled(q, k, *case.positions(n, n)), case.attn(pe, q, k))
        # the first graph is static; the dynamic ones that follow are one per number of blocks for PaTH, and
        # Heinsen's scan recompiles its dynamic graph as in the quick-start block below
        most = 1 + block_graphs(lengths, pe.block_size) if case.name in BLOCK_LOOP_CASES else 2
        most = 1 + HEINSEN_GRAPHS if case.name == "heinsen" else most
        assert len(graphs) <= most, f"{len(graphs)} graphs for 4 lengths"

    @pytest.mark.parametrize("case", COMPILE_CASES)
    def test_quick_start_block_compiles_fullgraph_dynamic(self, case):
        """Issue 22.1: torch.compile(block, dynamic=True, fullgraph=True) at 16, 24 and 40 tokens, one graph
        (windows, the bound graph and PaTH's block loop at fewer tokens)."""
        pe = case.make()
        if isinstance(case, BoundCase):
            pe = case.unbound()                                          # the block binds its own tokens
        dim = case.token_dim if pe.kind == "input" else D
        block = QuickStartBlock(dim, H, pe)
        lengths = (8, 12, 20) if isinstance(pe, pe_lib._WindowBias) else (16, 24, 40)   # windows hold 20 tokens
        if isinstance(pe, GraphormerPositionalEmbedding):
            lengths = (8, 12, 14)                                        # inside the bound graph's 16 tokens
        if case.name in BLOCK_LOOP_CASES:   # a graph per number of blocks, each unrolled: fewer blocks, less time
            lengths = (8, 12, 20)
        graphs = []

        def counting_backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(block, dynamic=True, fullgraph=True, backend=counting_backend)
        for n in lengths:
            x = torch.randn(2, n, dim)
            positions = None if case.required_positions is None else case.required_positions(n)
            torch.testing.assert_close(compiled(x, positions), block(x, positions), rtol=1e-4, atol=1e-5)
        expected = HEINSEN_GRAPHS if case.name == "heinsen" else 2 if case.name in RECOMPILE_ONCE_CASES else 1
        if case.name in BLOCK_LOOP_CASES:
            expected = block_graphs(lengths, pe.block_size)
        assert len(graphs) == expected, f"{len(graphs)} graphs for lengths {lengths}"

    def test_finite_number_check_traces_under_dynamic_shapes(self):
        """Issue 22.1: attention()'s float checks (dropout_p, scale) trace with dynamic=True, fullgraph=True."""
        q, k, v = qkv()
        fn = lambda q, k, v: attention(q, k, v, scale=0.25, dropout_p=0.0, causal=True)
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))
        with pytest.raises(ValueError, match="attention: scale must be a finite number, got scale=inf"):
            attention(q, k, v, scale=float("inf"))


# ---------------------------------------------------------------------------
# Distributed: sequence shards over 2 processes (gloo on CPU) equal the single-process run
#
# With PE_SLOW=1, one spawn of 2 ranks runs every sequence-shard check (every class of CASES on a
# sequence shard, Heinsen's sharded scan at a million tokens, PyTorch's context parallel) and each rank
# saves its measured errors; the tests below read them. A second spawn checks data parallelism: DDP and
# FSDP2 (fully_shard, deferred meta init) against one process, one case per class. The default run spawns
# once, for a representative set of both (_quick_check). The tests that read a spawn carry the marker
# ``distributed`` (-m "not distributed" leaves them out).
# ---------------------------------------------------------------------------


def _shardable(case) -> bool:
    """Classes whose shard needs only global positions (or, for Heinsen, the summary exchange).
    Left out: content-ordered ones (CoPE counts gates, the forget gate is bound to token states) and
    the convolutional encoding, whose shard would need its neighbours' tokens (a halo exchange)."""
    pe = case.make()
    return isinstance(pe, pe_lib.HeinsenPositionalEmbedding) or (pe.takes_positions and case.takes_positions)


SHARDED_CASES = [case for case in CASES if _shardable(case)]


dist = torch.distributed


WORLD = 2


SPAWN_TIMEOUT_S = 150     # the whole spawn; a hung collective fails the tests instead of hanging them


SCAN_TOKENS = 1_000_000


HAS_GLOO = dist.is_available() and dist.is_gloo_available()


needs_gloo = pytest.mark.skipif(not HAS_GLOO, reason="torch.distributed or its gloo backend is not available")


# ---------------------------------------------------------------------------
# Distributed: shard_positions (no process group needed)
# ---------------------------------------------------------------------------


class TestShardPositions:
    @pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_shards_partition_the_sequence(self, layout, world):
        n = 24
        shards = [shard_positions(n, r, world, layout=layout) for r in range(world)]
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(n))
        assert all(s.dtype == torch.long for s in shards)
        if layout == "contiguous":  # rank order is sequence order
            assert torch.equal(torch.cat(shards), torch.arange(n))

    def test_uneven_contiguous_split_is_tensor_split(self):
        for r, want in enumerate(torch.arange(10).tensor_split(4)):
            assert torch.equal(shard_positions(10, r, 4), want)

    def test_head_tail_pairs_chunk_r_with_its_mirror(self):
        # 16 tokens, 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        assert shard_positions(16, 0, 2, layout="head_tail").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert shard_positions(16, 1, 2, layout="head_tail").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]

    def test_matches_context_parallel_load_balancer(self):
        balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
        order = balancer._HeadTailLoadBalancer(24, 3, "cpu")._generate_indices()[0].long()   # [N], rank-major
        mine = torch.cat([shard_positions(24, r, 3, layout="head_tail") for r in range(3)])
        assert torch.equal(mine, order)

    def test_offset_and_numpy_like_ints(self):
        class Index:
            def __index__(self):
                return 2
        assert torch.equal(shard_positions(8, 1, Index(), offset=100), torch.arange(104, 108))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="shard_positions: rank must lie in \\[0, world_size=2\\), got rank=2"):
            shard_positions(8, 2, 2)
        with pytest.raises(ValueError, match="shard_positions: world_size must be a positive int"):
            shard_positions(8, 0, 0)
        with pytest.raises(ValueError, match="shard_positions: seq_len must be >= 0, got seq_len=-1"):
            shard_positions(-1, 0, 2)
        with pytest.raises(TypeError, match="shard_positions: seq_len must be an int, got float 8.0"):
            shard_positions(8.0, 0, 2)
        with pytest.raises(TypeError, match="shard_positions: rank must be an int, got True"):
            shard_positions(8, True, 2)
        with pytest.raises(ValueError, match="shard_positions: layout='head_tail' needs seq_len divisible by"):
            shard_positions(6, 0, 2, layout="head_tail")
        with pytest.raises(ValueError, match="shard_positions: layout must be 'contiguous' or 'head_tail'"):
            shard_positions(8, 0, 2, layout="zigzag")

    def test_scan_without_process_group_says_so(self):
        if HAS_GLOO and dist.is_initialized():
            pytest.skip("a process group is initialised in this process")
        with pytest.raises(ValueError, match="sharded_log_linear_scan: needs an initialised torch.distributed"):
            sharded_log_linear_scan(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))
        with pytest.raises(ValueError, match="sharded_log_linear_scan: log_p and h must have the same shape"):
            sharded_log_linear_scan(torch.zeros(1, 4, 2), torch.zeros(1, 5, 2))
        with pytest.raises(TypeError, match="heinsen_forward_sharded: module must be a HeinsenPositionalEmbedding"):
            heinsen_forward_sharded(RotaryPositionalEmbedding(8), torch.zeros(1, 4, 8))


# ---------------------------------------------------------------------------
# Distributed: the checks each rank runs (module level, so the spawned processes can import them)
# ---------------------------------------------------------------------------


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| over finite entries; inf unless both hold -inf/inf at the same places."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape or not torch.equal(torch.isinf(got), torch.isinf(want)) \
            or torch.isnan(got).any() or torch.isnan(want).any():
        return float("inf")
    finite = torch.isfinite(want)
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def _gather_rows(local: torch.Tensor, idx: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """The full tensor from every rank's rows ``local`` at global indices ``idx`` along ``dim`` (shards may differ in size)."""
    dim = dim % local.dim()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(WORLD)]
    dist.all_gather(sizes, torch.tensor([idx.numel()]))
    most = max(int(n) for n in sizes)
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, most - idx.numel()]
    parts = [torch.empty_like(F.pad(local.detach(), pad)) for _ in range(WORLD)]
    indices = [torch.empty(most, dtype=torch.long, device=idx.device) for _ in range(WORLD)]
    dist.all_gather(parts, F.pad(local.detach(), pad).contiguous())
    dist.all_gather(indices, F.pad(idx, (0, most - idx.numel())))
    shape = list(local.shape)
    shape[dim] = length
    full = local.new_empty(shape)
    for part, index, n in zip(parts, indices, sizes):
        full.index_copy_(dim, index[: int(n)], part.narrow(dim, 0, int(n)))
    return full


def _summed_grads(module: torch.nn.Module) -> list:
    """This rank's parameter gradients summed over ranks (what DDP's all-reduce gives)."""
    grads = []
    for p in module.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        grads.append(g)
    return grads


def _grad_error(got: list, module: torch.nn.Module) -> float:
    """Max |got - want| / max(1, max |want|) over the parameters: each parameter's gradient is a sum over
    all tokens, which the ranks add in another order (float32 sums of gradients of size ~100 differ by ~1e-4)."""
    errors = []
    for g, p in zip(got, module.parameters()):
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        errors.append(_max_error(g, want) / max(1.0, want.abs().max().item() if want.numel() else 0.0))
    return max(errors, default=0.0)


def _check_case(case, layout: str, rank: int) -> dict:
    """One class on a sequence shard against the same class on the whole sequence."""
    torch.manual_seed(0)  # the same module and data on every rank
    full_pe = case.make()
    pe = copy.deepcopy(full_pe)
    x = torch.randn(B, N, case.token_dim)
    q, k, v, weight = torch.randn(4, B, H, N, DH).unbind(0)
    weight_x = torch.randn(B, N, case.token_dim)
    idx = shard_positions(N, rank, WORLD, layout=layout)                               # [N_local] global indices
    positions = None if case.required_positions is None else case.required_positions(N)
    positions_q = idx if positions is None else positions[idx]                         # the shard's global positions
    positions_k = torch.arange(N) if positions is None else positions                  # every key's position
    errors = {}
    if full_pe.kind == "input":
        x_full = x.clone().requires_grad_(True)
        want = full_pe.forward_input(x_full, positions) if case.takes_positions else full_pe(x_full)
        (want * weight_x).sum().backward()
        x_local = x[:, idx].clone().requires_grad_(True)
        if case.takes_positions:
            got = pe.forward_input(x_local, positions_q)
        else:  # Heinsen: the order is the recurrence; the ranks exchange state summaries
            got = heinsen_forward_sharded(pe, x_local)
        (got * weight_x[:, idx]).sum().backward()
        errors["output"] = _max_error(_gather_rows(got, idx, -2, N), want)
        errors["grad_x"] = _max_error(_gather_rows(x_local.grad, idx, -2, N), x_full.grad)
    else:
        q_full = q.clone().requires_grad_(True)
        want_logits = full_pe.forward_attn(q_full, k, positions, positions)
        want = attention(q_full, k, v, full_pe, positions_q=positions, positions_k=positions, causal=True)
        (want * weight).sum().backward()
        # each rank holds its q, k, v shard; the keys and values are all-gathered (ring attention's
        # result, without the ring), the queries stay local with their global positions
        keys = _gather_rows(k[:, :, idx], idx, -2, N)
        values = _gather_rows(v[:, :, idx], idx, -2, N)
        causal = idx[:, None] >= torch.arange(N)[None, :]                               # [N_local, N] by global index
        q_local = q[:, :, idx].clone().requires_grad_(True)
        got_logits = pe.forward_attn(q_local, keys, positions_q, positions_k)
        got = attention(q_local, keys, values, pe, positions_q=positions_q, positions_k=positions_k, attn_mask=causal)
        (got * weight[:, :, idx]).sum().backward()
        errors["logits"] = _max_error(_gather_rows(got_logits, idx, -2, N), want_logits)
        errors["output"] = _max_error(_gather_rows(got, idx, -2, N), want)
        errors["grad_q"] = _max_error(_gather_rows(q_local.grad, idx, -2, N), q_full.grad)
    errors["grad_params_rel"] = _grad_error(_summed_grads(pe), full_pe)
    return errors


def _check_heinsen_scan(rank: int) -> dict:
    """sharded_log_linear_scan at a million tokens (float64) against the single-process scan."""
    n, d = SCAN_TOKENS, 4
    g = torch.Generator().manual_seed(1)
    # decays from strong (sigmoid(N(0, 1))) to very weak (sigmoid(14 + N(0, 1)), log_p ~ -1e-6):
    # rank 0's state still weighs on rank 1's last tokens
    z = torch.randn(1, n, d, generator=g, dtype=torch.float64) + torch.tensor([0.0, 4.0, 8.0, 14.0], dtype=torch.float64)
    h, weight = torch.randn(2, 1, n, d, generator=g, dtype=torch.float64).unbind(0)
    initial, weight_final = torch.randn(2, 1, 1, d, generator=g, dtype=torch.float64).unbind(0)
    idx = shard_positions(n, rank, WORLD)
    mine = [z[:, idx].clone().requires_grad_(True), h[:, idx].clone().requires_grad_(True),
            initial.clone().requires_grad_(True)]
    start = time.perf_counter()
    s_local, final = sharded_log_linear_scan(F.logsigmoid(mine[0]), mine[1], mine[2], return_state=True)
    # the final state is the same on every rank: count it once (rank 0, whose graph reaches rank 1's tokens)
    loss = (s_local * weight[:, idx]).sum() + ((final * weight_final).sum() if rank == 0 else 0.0)
    loss.backward()
    seconds = time.perf_counter() - start
    grad_initial = mine[2].grad.clone()
    dist.all_reduce(grad_initial)
    gathered = [_gather_rows(t, idx, -2, n) for t in (s_local, mine[0].grad, mine[1].grad)]
    if rank:  # the single-process run is done once, on rank 0 (the machine may have 2 cores)
        return {"seconds": seconds}
    leaves = [t.clone().requires_grad_(True) for t in (z, h, initial)]
    s = _LogLinearScanFunction.apply(F.logsigmoid(leaves[0]), leaves[1], leaves[2])    # [1, n, d]
    ((s * weight).sum() + (s[:, -1:] * weight_final).sum()).backward()
    return {
        "s": _max_error(gathered[0], s),
        "final": _max_error(final, s[:, -1:]),
        "grad_log_p": _max_error(gathered[1], leaves[0].grad),
        "grad_h": _max_error(gathered[2], leaves[1].grad),
        "grad_initial": _max_error(grad_initial, leaves[2].grad),
        "seconds": seconds,
    }


def _check_scan_oracle(rank: int) -> dict:
    """The sharded scan against a plain float64 loop of the recurrence, uneven shards (101 + 100)."""
    g = torch.Generator().manual_seed(2)
    n, d = 201, 3
    log_p = F.logsigmoid(torch.randn(2, n, d, generator=g, dtype=torch.float64) * 3 + 2)
    h = torch.randn(2, n, d, generator=g, dtype=torch.float64) * 3
    want = torch.empty_like(h)
    state = torch.zeros(2, d, dtype=torch.float64)
    for t in range(n):
        for b in range(2):
            for c in range(d):
                state[b, c] = torch.logaddexp(log_p[b, t, c] + state[b, c], h[b, t, c])
        want[:, t] = state
    idx = shard_positions(n, rank, WORLD)
    got = sharded_log_linear_scan(log_p[:, idx], h[:, idx])
    got32 = sharded_log_linear_scan(log_p[:, idx].float(), h[:, idx].float())
    return {"float64": _max_error(_gather_rows(got, idx, -2, n), want),
            "float32": _max_error(_gather_rows(got32, idx, -2, n), want)}


def _check_empty_shard(rank: int) -> dict:
    """A rank with no tokens passes the state on, forward and backward."""
    g = torch.Generator().manual_seed(3)
    log_p = F.logsigmoid(torch.randn(1, 9, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
    h = torch.randn(1, 9, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    s = _LogLinearScanFunction.apply(log_p, h, torch.zeros(1, 1, 2, dtype=torch.float64))
    s.sum().backward()
    idx = torch.arange(9) if rank == 1 else torch.arange(0)                            # rank 0 holds nothing
    mine = [log_p.detach()[:, idx].requires_grad_(True), h.detach()[:, idx].requires_grad_(True)]
    s_local = sharded_log_linear_scan(*mine)
    s_local.sum().backward()
    return {"s": _max_error(s_local, s[:, idx]), "grad_h": _max_error(mine[1].grad, h.grad[:, idx])}


def _check_heinsen_module(rank: int) -> dict:
    """heinsen_forward_sharded on 2**17 tokens, then a second sharded chunk continuing the stream."""
    torch.manual_seed(4)
    full_pe = HeinsenPositionalEmbedding(8, 4).double()
    pe = copy.deepcopy(full_pe)
    n = 2 ** 17
    x, weight = torch.randn(2, 1, n, 8, dtype=torch.float64).unbind(0)
    x2, weight2 = torch.randn(2, 1, 64, 8, dtype=torch.float64).unbind(0)
    x_full = x.clone().requires_grad_(True)
    y = full_pe(x_full)
    y2 = full_pe(x2, using_prev_context=True)   # detached context: truncated backprop, as the reference
    ((y * weight).sum() + (y2 * weight2).sum()).backward()
    idx, idx2 = shard_positions(n, rank, WORLD), shard_positions(64, rank, WORLD)
    x_local = x[:, idx].clone().requires_grad_(True)
    got = heinsen_forward_sharded(pe, x_local)
    got2 = heinsen_forward_sharded(pe, x2[:, idx2], using_prev_context=True)
    ((got * weight[:, idx]).sum() + (got2 * weight2[:, idx2]).sum()).backward()
    return {
        "output": _max_error(_gather_rows(got, idx, -2, n), y),
        "continued_chunk": _max_error(_gather_rows(got2, idx2, -2, 64), y2),
        "cached_context": _max_error(pe.prev_context, full_pe.prev_context),
        "grad_x": _max_error(_gather_rows(x_local.grad, idx, -2, n), x_full.grad),
        "grad_params_rel": _grad_error(_summed_grads(pe), full_pe),
    }


def _check_context_parallel(rank: int, device: str = "cpu") -> dict:
    """RoPE with each shard's global positions inside PyTorch's context_parallel (ring SDPA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(5)
    n = 64
    q, k, v = torch.randn(3, 1, H, n, DH, device=device).unbind(0)
    rope = RotaryPositionalEmbedding(DH).to(device)
    want = attention(q, k, v, rope, causal=True)
    mesh = init_device_mesh(device, (WORLD,))
    buffers = [q.clone(), k.clone(), v.clone()]
    idx = shard_positions(n, rank, WORLD, layout="head_tail", device=device)   # the order context_parallel uses
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            layout_ok = torch.equal(buffers[0], q[:, :, idx])
            # attention() runs F.scaled_dot_product_attention(is_causal=True), which the context patches
            out = attention(*buffers, rope, positions_q=idx, positions_k=idx, causal=True)
    except NotImplementedError as error:  # the one known finding: the CPU SDPA op has no ring (sharding) strategy
        if "does not have a sharding strategy" not in str(error):
            raise
        return {"unsupported": str(error).splitlines()[0]}
    return {"output": _max_error(_gather_rows(out, idx, -2, n), want), "layout_is_head_tail": float(layout_ok)}


def _checks() -> list:
    checks = [(f"case/{case.name}/{layout}", lambda rank, case=case, layout=layout: _check_case(case, layout, rank))
              for case in SHARDED_CASES for layout in ("contiguous", "head_tail")
              if case.takes_positions or layout == "contiguous"]
    return checks + [("heinsen_scan_1e6", _check_heinsen_scan), ("scan_oracle", _check_scan_oracle),
                     ("empty_shard", _check_empty_shard), ("heinsen_module", _check_heinsen_module),
                     ("context_parallel_cpu", _check_context_parallel)]


def _worker(rank: int, port: int, out_dir: str, backend: str, names: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    results = {}
    for name, check in _checks() + _data_parallel_checks():
        if name not in names:
            continue
        try:
            results[name] = _check_context_parallel(rank, "cuda") if "nccl" in backend else check(rank)
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            results[name] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(names: list, backend: str = "gloo") -> dict:
    """Spawn WORLD ranks running the named checks; {name: {metric: worst value over ranks}}."""
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        ranks = [context.Process(target=_worker, args=(r, port, out_dir, backend, names)) for r in range(WORLD)]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        for p in ranks:
            p.join(max(deadline - time.monotonic(), 0))
        hung = [p.pid for p in ranks if p.is_alive()]
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise RuntimeError(f"distributed checks exceeded {SPAWN_TIMEOUT_S} s (ranks {hung} killed)")
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]
    merged = {}
    for name in per_rank[0]:
        merged[name] = {}
        for result in per_rank:
            for metric, value in result[name].items():
                if isinstance(value, str):
                    merged[name][metric] = value
                elif not isinstance(merged[name].get(metric), str):
                    merged[name][metric] = max(value, merged[name].get(metric, value))
    return merged


# The default run spawns once for both fixtures, for these checks only: one case per kind in both layouts,
# Heinsen's small sharded checks and two data-parallel cases. PE_SLOW=1 spawns twice, for every check.
QUICK_SHARDED_CASES = {"sinusoidal", "rotary", "t5", "transformer_xl", "heinsen"}
QUICK_SCAN_CHECKS = {"scan_oracle", "empty_shard", "heinsen_module"}
QUICK_PARALLEL_CASES = {"learned", "t5"}


def _quick_check(name: str) -> bool:
    kind, _, rest = name.partition("/")
    if kind == "case":
        return rest.split("/")[0] in QUICK_SHARDED_CASES
    if kind == "data_parallel":
        return rest in QUICK_PARALLEL_CASES
    return name in QUICK_SCAN_CHECKS


@functools.lru_cache(maxsize=None)
def _quick_distributed_results() -> dict:
    return run_distributed([name for name, _ in _checks() + _data_parallel_checks() if _quick_check(name)])


@pytest.fixture(scope="module")
def results():
    if not HAS_GLOO:
        pytest.skip("torch.distributed or its gloo backend is not available")
    if not SLOW:
        return _quick_distributed_results()
    return run_distributed([name for name, _ in _checks()])


def _measured(results, name) -> dict:
    found = results[name]
    assert "error" not in found, found.get("error")
    return found


# float32 compute at N=16: rounding differences between one dense call and shards (outputs,
# logits, input gradients); parameter gradients are sums over every token that the ranks add
# in another order, compared relative to their size
CASE_TOL, GRAD_TOL = 2e-5, 1e-4


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("case", quick_or_slow(SHARDED_CASES, QUICK_SHARDED_CASES, ids=[c.name for c in SHARDED_CASES]))
def test_shards_equal_single_process(results, case, layout):
    if not case.takes_positions and layout != "contiguous":
        pytest.skip("a recurrence needs its shards in sequence order")
    for metric, error in _measured(results, f"case/{case.name}/{layout}").items():
        assert error <= (GRAD_TOL if metric == "grad_params_rel" else CASE_TOL), f"{case.name} ({layout}): {metric} differs by {error:.2e}"


@pytest.mark.distributed
@needs_gloo
@slow
def test_heinsen_scan_million_tokens_forward_and_backward(results):
    found = _measured(results, "heinsen_scan_1e6")
    for metric in ("s", "final", "grad_log_p", "grad_h", "grad_initial"):
        assert found[metric] <= 1e-6, f"{metric} differs by {found[metric]:.2e}"


@pytest.mark.distributed
@needs_gloo
def test_sharded_scan_matches_float64_loop_oracle(results):
    found = _measured(results, "scan_oracle")
    assert found["float64"] <= 1e-12 and found["float32"] <= 5e-6, found


@pytest.mark.distributed
@needs_gloo
def test_empty_shard_passes_the_state_on(results):
    found = _measured(results, "empty_shard")
    assert found["s"] <= 1e-12 and found["grad_h"] <= 1e-12, found


@pytest.mark.distributed
@needs_gloo
def test_heinsen_module_sharded_forward_backward_and_streaming(results):
    for metric, error in _measured(results, "heinsen_module").items():
        assert error <= 1e-9, f"{metric} differs by {error:.2e}"


@pytest.mark.distributed
@needs_gloo
@slow
def test_context_parallel_rope_cpu(results):
    found = results["context_parallel_cpu"]
    if "unsupported" in found:
        # torch 2.13: context_parallel routes SDPA to ring kernels for the flash / efficient /
        # cuDNN CUDA ops only; CPU SDPA (aten._scaled_dot_product_flash_attention_for_cpu) has no
        # DTensor sharding strategy.
        pytest.skip(f"context_parallel does not run on CPU in torch {torch.__version__}: {found['unsupported']}")
    found = _measured(results, "context_parallel_cpu")                  # any other error fails here
    assert found["layout_is_head_tail"] == 1.0
    assert found["output"] <= 1e-5, found


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= WORLD),
                    reason=f"context_parallel's ring SDPA needs CUDA: {WORLD} GPUs and NCCL")
def test_context_parallel_rope_cuda():
    found = run_distributed(["context_parallel_cpu"], backend="cpu:gloo,cuda:nccl")["context_parallel_cpu"]
    assert "error" not in found, found["error"]
    assert found["layout_is_head_tail"] == 1.0
    assert found["output"] <= 1e-3, found   # flash / efficient kernels round in their own order


# ---------------------------------------------------------------------------
# Distributed: data parallel, DDP and FSDP2 (fully_shard, deferred meta init) equal the single-process run
# ---------------------------------------------------------------------------


def _one_case_per_class() -> list:
    """The first case of every class that has parameters (the others have nothing to shard or reduce),
    and wav2vec 2.0's weight-normed convolution (its init reads one parameter into another)."""
    seen, cases = set(), []
    for case in CASES:
        pe = case.make()
        if (type(pe) not in seen or case.name == "conv_wav2vec2") and any(True for _ in pe.parameters()):
            seen.add(type(pe))
            cases.append(case)
    return cases


PARALLEL_CASES = _one_case_per_class()


# the classes whose seed-dependent parameters the library itself draws full-size (``_copy_into``), so
# a sharded deferred init keeps them bitwise; nn.init on a CPU DTensor draws each shard from the local
# generator instead (torch's DTensor RNG tracker covers CUDA-like devices only)
FULL_DRAWS = (pe_lib.AlgebraicTreePositionalEmbedding, pe_lib.MixedRotaryPositionalEmbedding)


class _Layer(torch.nn.Module):
    """A tiny attention layer around an encoding: qkv projection, the encoding, attention()."""

    def __init__(self, case) -> None:
        super().__init__()
        self.case = case
        self.qkv = torch.nn.Linear(case.token_dim, 3 * H * DH)
        self.pe = case.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = None if self.case.required_positions is None else self.case.required_positions(x.shape[-2])
        if self.pe.kind == "input":
            x = self.pe.forward_input(x, positions) if self.case.takes_positions else self.pe(x)
        q, k, v = self.qkv(x).unflatten(-1, (3, H, DH)).permute(2, 0, 3, 1, 4)          # [B, H, N, Dh] each
        return attention(q, k, v, self.pe, causal=True, **attention_positions(self.pe, (positions, positions)))


def _reference(model: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Single-process output and gradients of the loss the ranks' mean gives: sum(out * weight) / WORLD."""
    model = copy.deepcopy(model)
    out = model(x)
    ((out * weight).sum() / WORLD).backward()
    return out.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def _rank_errors(model: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, rank: int, want: tuple) -> dict:
    """This rank's half of the batch through ``model`` (DDP or FSDP2) against the reference."""
    rows = slice(rank, rank + 1)
    out = model(x[rows])
    (out * weight[rows]).sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]                       # FIRE's init_L is frozen
    grads = [pe_lib._full(p.grad) if p.grad is not None else torch.zeros(p.shape) for p in trained]
    want_out, want_grads = want
    return {"output": _max_error(out, want_out[rows]),
            "grad_params_rel": max(_max_error(g, w) / max(1.0, w.abs().max().item()) for g, w in zip(grads, want_grads))}


# FSDP2 on the CPU records events on the current CPU stream: torch.cpu.Stream.record_event (torch >= 2.7)
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")


def _check_data_parallel(case, rank: int) -> dict:
    """DDP, FSDP2 (the encoding and the layer each fully_shard-ed) and FSDP2 with deferred init."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Layer(case)
    x = torch.randn(WORLD, N, case.token_dim)                                           # the global batch
    weight = torch.randn(WORLD, H, N, DH)
    want = _reference(model, x, weight)
    errors = {}
    ddp = DistributedDataParallel(copy.deepcopy(model))
    errors.update({f"ddp_{m}": e for m, e in _rank_errors(ddp, x, weight, rank, want).items()})
    if not FSDP2_ON_CPU:
        return errors
    sharded = copy.deepcopy(model)
    fully_shard(sharded.pe)
    fully_shard(sharded)
    errors.update({f"fsdp_{m}": e for m, e in _rank_errors(sharded, x, weight, rank, want).items()})

    # deferred init: build on meta, shard, allocate, reset; against reset_parameters of a normal module
    with torch.device("meta"):
        deferred = _Layer(case)
    fully_shard(deferred.pe)
    fully_shard(deferred)
    deferred.to_empty(device="cpu")
    deferred.qkv.reset_parameters()
    torch.manual_seed(1)
    deferred.pe.reset_parameters()
    normal, other = case.make(), case.make()
    torch.manual_seed(1)
    normal.reset_parameters()
    torch.manual_seed(2)
    other.reset_parameters()                                                            # tells what depends on the seed
    fixed, drawn = [], []
    for got, same_seed, other_seed in zip(deferred.pe.parameters(), normal.parameters(), other.parameters()):
        (drawn if not torch.equal(same_seed, other_seed) else fixed).append(_max_error(pe_lib._full(got), same_seed))
    fixed += [_max_error(got, same) for got, same in zip(deferred.pe.buffers(), normal.buffers())]
    errors["deferred_init_fixed"] = max(fixed, default=0.0)
    if isinstance(normal, FULL_DRAWS):
        errors["deferred_init_drawn"] = max(drawn, default=0.0)
    # the deferred model against a single process holding its (gathered) weights
    single = _Layer(case)
    with torch.no_grad():
        for p, q in zip(single.parameters(), deferred.parameters()):
            p.copy_(pe_lib._full(q))
    errors.update({f"deferred_{m}": e for m, e in _rank_errors(deferred, x, weight, rank, _reference(single, x, weight)).items()})
    return errors


def _data_parallel_checks() -> list:
    return [(f"data_parallel/{case.name}", lambda rank, case=case: _check_data_parallel(case, rank))
            for case in PARALLEL_CASES]


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return HAS_GLOO


@pytest.fixture(scope="module")
def data_parallel_results():
    if not _has_fully_shard():
        pytest.skip("torch.distributed, gloo or FSDP2's fully_shard is not available")
    if not SLOW:
        return _quick_distributed_results()
    return run_distributed([name for name, _ in _data_parallel_checks()])


# float32 at N=16: DDP and FSDP2 average the two ranks' gradients, the reference sums the whole
# batch: the same terms added in another order
PARALLEL_TOL = 1e-5


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize("case", quick_or_slow(PARALLEL_CASES, QUICK_PARALLEL_CASES, ids=[c.name for c in PARALLEL_CASES]))
def test_ddp_and_fsdp2_equal_single_process(data_parallel_results, case):
    found = _measured(data_parallel_results, f"data_parallel/{case.name}")
    for metric, error in found.items():
        want = 0.0 if metric.startswith("deferred_init") else PARALLEL_TOL   # init: bitwise
        assert error <= want, f"{case.name}: {metric} differs by {error:.2e}"
    if not FSDP2_ON_CPU:
        pytest.skip("DDP checked; FSDP2 on the CPU needs torch.cpu.Stream.record_event (torch >= 2.7)")


# ---------------------------------------------------------------------------
# Vendoring
# ---------------------------------------------------------------------------


# Every public encoding class (and the alias EmbedPosition), each vendored alone.
VENDOR_CLASSES = [name for name in pe_lib.__all__
                  if isinstance(getattr(pe_lib, name), type) and issubclass(getattr(pe_lib, name), PositionalEmbedding)]


VENDOR_LEAN = {"config": False, "flex": False, "distributed": False}
# vendored and run in the default run (an input, a qk, a bias and a logits class); PE_SLOW=1 adds the rest
VENDOR_QUICK = ["HeinsenPositionalEmbedding", "RotaryPositionalEmbedding", "ALiBiPositionalEmbedding",
                "ShawPositionalEmbedding"]
VENDOR_SETS = quick_or_slow([VENDOR_QUICK, [name for name in VENDOR_CLASSES if name not in VENDOR_QUICK]], {"quick"},
                            ids=["quick", "rest"])


# Run in a fresh process: imports every vendored file given (as JSON: [[path, names, lean], ...]) and
# compares it with the library on the demo encodings (each entry of `_demo_modules` that names a class the
# file holds, built once from the library and once from the file with the same seed): parameters, outputs
# and every gradient, bitwise; then runs its docstring examples (an example already run in an earlier file,
# same code and same text, is not run again). Prints one JSON line per file; fails on the first difference.
_VENDOR_CHECK = r'''
import ast, doctest, importlib.util, inspect, json, py_compile, sys
import torch
import positional_embeddings as lib

torch.set_num_threads(1)   # the same kernels for library and file; less contention on a shared machine
demo = ast.parse(inspect.getsource(lib._demo_modules)).body[0]
sizes = {"num_heads": 4, "head_dim": 8, "seq_len": 16}
exec(compile(ast.Module([s for s in demo.body if isinstance(s, ast.Assign)], []), "<demo>", "exec"), {}, sizes)
entries = next(node for node in ast.walk(demo) if isinstance(node, ast.Dict))
entries = {key.value: value for key, value in zip(entries.keys, entries.values)}

def build(key, namespace):
    torch.manual_seed(0)
    return eval(compile(ast.Expression(entries[key]), "<demo>", "eval"), {**namespace, **sizes})

def run(module, pe, use_flex=None):
    torch.manual_seed(2)
    n, heads, dh = sizes["seq_len"], sizes["num_heads"], sizes["head_dim"]
    x = torch.randn(2, n, heads * dh, requires_grad=True)
    q, k, v = (torch.randn(2, heads, n, dh, requires_grad=True) for _ in range(3))
    positions = None if pe is None else lib._demo_positions(pe, n)
    tokens = pe.forward_input(x, positions) if pe is not None and pe.kind == "input" else x
    given = {} if pe is None or pe.kind == "input" else dict(positions_q=positions, positions_k=positions)
    out = module.attention(q, k, v, pe, use_flex=use_flex, causal=pe is None or pe.num_axes == 1, **given)
    params = [] if pe is None else [p for p in pe.parameters() if p.requires_grad]
    loss = (tokens * torch.randn_like(tokens)).sum() + (out * torch.randn_like(out)).sum()
    return [tokens, out, *torch.autograd.grad(loss, [x, q, k, v, *params], allow_unused=True)]

def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b))

seen, library = set(), {}   # docstrings already run; the library's state and results per demo entry
for index, (path, names, lean) in enumerate(json.loads(sys.argv[1])):
    py_compile.compile(path, doraise=True)
    spec = importlib.util.spec_from_file_location(f"vendored_{index}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.__all__ == [*names, "attention"], (path, mod.__all__)
    held = {name: getattr(mod, name) for name in lib.__all__ if hasattr(mod, name)}
    compared = [None]
    assert all(same(a, b) for a, b in zip(run(mod, None), run(lib, None))), f"{path}: attention() differs"
    for key, value in entries.items():
        head = value
        while isinstance(head, (ast.Call, ast.Attribute)):   # the class the entry builds (bound: the class it binds;
            head = head.func if isinstance(head, ast.Call) else head.value   # .eval(): the class before it)
        if head.id not in held:
            continue
        ours = build(key, {**vars(lib), **held})
        if key not in library:
            theirs = build(key, vars(lib))
            library[key] = (theirs.state_dict(), run(lib, theirs))
        state, theirs = library[key]
        assert type(ours).__module__ == spec.name, (path, key)
        assert ours.state_dict().keys() == state.keys(), (path, key)
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), state.values())), (path, key)
        flex = True if lean and ours.kind == "bias" else None   # lean files: use_flex takes the dense path
        bad = [i for i, (a, b) in enumerate(zip(run(mod, ours, flex), theirs)) if not same(a, b)]
        assert not bad, f"{path}: {key} differs from the library in outputs/gradients {bad}"
        compared.append([key, type(ours).__name__])
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(mod, spec.name, globs=vars(mod)):
        key = (test.name.split(".", 1)[-1], test.docstring)   # +SKIP marks are in the docstring
        if test.examples and key not in seen:
            seen.add(key)
            runner.run(test)
    assert runner.failures == 0, f"{path}: {runner.failures} docstring examples fail"
    print(json.dumps([path, compared, runner.tries]))
'''


def _vendor_run_check(files) -> list:
    import json
    import subprocess

    command = [sys.executable, "-c", _VENDOR_CHECK, json.dumps(files)]
    result = subprocess.run(command, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


VENDOR_WRAPPED = {"RandomizedPositionalEmbedding": "RotaryPositionalEmbedding"}   # wrapper -> its demo's encoding


def _with_wrapped(names: list) -> list:
    """``names`` and, for each wrapper among them, the class its demo entry wraps (when not there yet)."""
    wrapped = [VENDOR_WRAPPED[name] for name in names if name in VENDOR_WRAPPED]
    return names + [name for name in dict.fromkeys(wrapped) if name not in names]


class TestVendor:
    @pytest.mark.parametrize("classes", VENDOR_SETS)
    def test_vendored_classes_equal_the_library_in_a_fresh_process(self, tmp_path, classes):
        # lean: every class alone; everything kept: five classes a file (each still compared with the library).
        # A wrapper comes with the class its demo entry wraps, as a user would vendor the two.
        files = [[str(tmp_path / f"{name}_lean.py"), _with_wrapped([name]), True] for name in classes]
        files += [[str(tmp_path / f"group{i}.py"), _with_wrapped(classes[i:i + 5]), False]
                  for i in range(0, len(classes), 5)]
        for path, names, lean in files:
            pe_lib.vendor(names, path, **(VENDOR_LEAN if lean else {}))
        results = _vendor_run_check(files)
        assert [path for path, _, _ in results] == [path for path, _, _ in files]
        demo_classes = {type(pe).__name__ for pe in pe_lib._demo_modules(4, 8, 16).values()}
        for (path, compared, tries), (_, names, _) in zip(results, files):
            assert compared[0] is None, path                                   # attention(pe=None)
            wanted = {getattr(pe_lib, name).__name__ for name in names} & demo_classes   # the base has no demo entry
            assert wanted <= {cls for _, cls in compared[1:]}, (path, compared)
        assert sum(tries for _, _, tries in results) > len(files), "docstring examples ran"

    def test_vendored_file_reads_only_torch_and_the_standard_library(self):
        import ast
        import importlib.util

        for options in ({}, VENDOR_LEAN):
            tree = ast.parse(pe_lib.vendor(["RotaryPositionalEmbedding", "HeinsenPositionalEmbedding"], **options))
            imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                        for alias in node.names}
            imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            assert "torch" in imported
            for name in imported - {"torch"}:        # the standard library: not installed in site-packages
                origin = importlib.util.find_spec(name).origin or "built-in"
                assert "site-packages" not in origin and "dist-packages" not in origin, (name, origin)

    def test_only_what_is_used_comes_along(self):
        text = pe_lib.vendor(["SinusoidalPositionalEmbedding"])
        assert "class SinusoidalPositionalEmbedding(" in text and "def attention(" in text
        assert "class RotaryPositionalEmbedding(" not in text and "def _rope_yarn(" not in text
        assert "def vendor(" not in text and "_demo" not in text and '__name__ == "__main__"' not in text
        assert text.count("\nclass PositionalEmbedding(") == 1
        # the rotary docstring example of attention() needs a class left out: skipped, not failing
        assert "rope = RotaryPositionalEmbedding(64)  # doctest: +SKIP\n" in text and "marked ``+SKIP``" in text
        with_rope = pe_lib.vendor(["RotaryPositionalEmbedding"])
        assert "rope = RotaryPositionalEmbedding(64)\n" in with_rope and "def _rope_yarn(" in with_rope
        # a table's docstring comes with it; a comprehension's names bind nothing at module level
        assert '}\n"""The RoPE frequency functions by Hugging Face' in with_rope
        import ast
        statement = ast.parse("TABLE = {f'{name}_x': value for name, value in OTHER.items()}").body[0]
        assert pe_lib._vendor_bound_names(statement) == {"TABLE"}
        assert pe_lib._vendor_bound_names(ast.parse("TABLE.update({n: n for n in ITEMS})").body[0]) == set()

    def test_options_leave_their_parts_out(self):
        full = pe_lib.vendor(["RotaryPositionalEmbedding", "ALiBiPositionalEmbedding"])
        lean = pe_lib.vendor(["RotaryPositionalEmbedding", "ALiBiPositionalEmbedding"], **VENDOR_LEAN)
        for part in ("def from_config(", "def _rotary_kwargs_from_config(", "def score_mod(", "flex_attention import",
                     "def _block_mask(", "def _gathered_call(", "fsdp.register_fsdp_forward_method("):
            assert part in full and part not in lean, part
        assert "def _flex_attention(" in lean and "use_flex=False" in lean     # the stand-in, under the library's name
        assert "_vendor_" not in lean and "Left out: ``from_config``" in lean
        assert len(lean.splitlines()) < len(full.splitlines())
        assert "def _is_dtensor(" in pe_lib.vendor(["AlgebraicSequencePositionalEmbedding"])       # via _copy_into
        assert "def _is_dtensor(" not in pe_lib.vendor(["AlgebraicSequencePositionalEmbedding"], distributed=False)
        with pytest.raises(ValueError, match="vendor: shard_positions is left out with distributed=False, but you named it"):
            pe_lib.vendor(["shard_positions"], distributed=False)
        with pytest.raises(ValueError, match="vendor: diffusers_positions is left out with config=False, but you named it"):
            pe_lib.vendor(["diffusers_positions"], config=False)

    def test_private_docstrings_shrink_to_their_first_sentence(self):
        """Issue 43: a vendored file keeps every public docstring whole and cuts a private function's to its
        first sentence (a full stop outside parentheses and code)."""
        import ast
        text = pe_lib.vendor(["ALiBiPositionalEmbedding"])
        functions = {node.name: ast.get_docstring(node) for node in ast.walk(ast.parse(text))
                     if isinstance(node, ast.FunctionDef) and ast.get_docstring(node)}
        assert functions["attention"].replace("  # doctest: +SKIP", "") == inspect.getdoc(pe_lib.attention)
        assert functions["alibi_slopes"] == inspect.getdoc(pe_lib.alibi_slopes)
        assert functions["_with_parameters"] == "``fn(*args)`` with ``pe``'s parameters at hand."
        assert "\n\n" not in functions["_flex_attention"] and len(inspect.getdoc(pe_lib._flex_attention)) > \
            2 * len(functions["_flex_attention"])
        first = pe_lib._vendor_first_sentence
        assert first("Keys (``a. b``, e.g. 1. 2) end here. Not this.") == "Keys (``a. b``, e.g. 1. 2) end here."
        assert first("No full stop at all") == "No full stop at all"

    def test_header_says_license_contents_and_version(self):
        import hashlib

        text = pe_lib.vendor(["T5PositionalEmbedding"], config=False)
        source = pathlib.Path(pe_lib.__file__).read_bytes()
        assert text.startswith("# MIT License\n")
        assert "T5PositionalEmbedding and ``attention()``, vendored from positional_embeddings.py." in text
        assert f"sha256 {hashlib.sha256(source).hexdigest()[:16]}" in text
        assert "vendor T5PositionalEmbedding -o FILE --no-config" in text.replace("\n", " ")
        assert '__all__ = [\n    "T5PositionalEmbedding",\n    "attention",\n]' in text

    def test_bad_names_raise(self):
        with pytest.raises(ValueError, match="vendor: names must be public names of positional_embeddings.py, got "
                                             "'RotaryPositionalEmbeding' \\(did you mean 'RotaryPositionalEmbedding'"):
            pe_lib.vendor(["RotaryPositionalEmbeding"])
        with pytest.raises(ValueError, match="got '_rotate'"):
            pe_lib.vendor(["_rotate"])
        with pytest.raises(ValueError, match="got 'vendor'"):
            pe_lib.vendor(["vendor"])
        with pytest.raises(TypeError, match="vendor: names must be a public name or a non-empty list of them, got \\[\\]"):
            pe_lib.vendor([])
        with pytest.raises(TypeError, match="vendor: flex must be a bool, got str 'no'"):
            pe_lib.vendor(["ALiBiPositionalEmbedding"], flex="no")

    def test_stand_ins_take_the_parameters_of_what_they_replace(self, monkeypatch):
        # a stand-in whose parameters differ from the function it replaces (the library changed): refused
        flex = {**pe_lib._VENDOR_OPTIONS["flex"], "stand_ins": {"_flex_attention": pe_lib._vendor_whole}}
        monkeypatch.setattr(pe_lib, "_VENDOR_OPTIONS", {**pe_lib._VENDOR_OPTIONS, "flex": flex})
        with pytest.raises(RuntimeError, match="vendor: the stand-in _vendor_whole takes \\['t'\\] but the library's "
                                               "_flex_attention takes \\['q', 'k', 'v', 'pe'"):
            pe_lib.vendor(["ALiBiPositionalEmbedding"], flex=False)

    def test_command_line_writes_the_file_and_dry_run_counts_lines(self, tmp_path, capsys):
        path = tmp_path / "rope.py"
        assert pe_lib._vendor_main(["RotaryPositionalEmbedding", "-o", str(path), "--no-config"]) == 0
        text = path.read_text()
        assert text == pe_lib.vendor(["RotaryPositionalEmbedding"], config=False)
        assert f"wrote {path}: {len(text.splitlines())} lines" in capsys.readouterr().out
        assert pe_lib._vendor_main(["RotaryPositionalEmbedding", "--no-config", "--dry-run"]) == 0
        rows = capsys.readouterr().out.splitlines()
        counts = {row.split(None, 1)[1]: int(row.split(None, 1)[0]) for row in rows}
        assert counts["total"] == len(text.splitlines())
        assert sum(count for label, count in counts.items() if label != "total") == counts["total"]
        rotary = text.split("\nclass RotaryPositionalEmbedding(")[1].split("\n\n\n")[0]     # from its class line
        assert counts["RotaryPositionalEmbedding"] == len(rotary.splitlines())
        with pytest.raises(SystemExit):
            pe_lib._vendor_main(["NotAClass", "--dry-run"])


# ---------------------------------------------------------------------------
# The file's structure: the contract lives in the bases
# ---------------------------------------------------------------------------


def test_the_contract_lives_in_the_bases():
    """Each kind's contract is written once, in its base: the encodings write their maths hook only."""
    import ast
    tree = ast.parse(pathlib.Path(pe_lib.__file__).read_text())
    methods = [(cls.name, node.name) for cls in tree.body if isinstance(cls, ast.ClassDef)
               for node in cls.body if isinstance(node, ast.FunctionDef)]
    bases = {"PositionalEmbedding", "_AttentionEncoding", "_AddedInput", "_QKTransform", "_PairwiseBias",
             "_ExplicitLogits"}
    wrappers = {"RandomizedPositionalEmbedding"}   # an encoding of any kind inside: it forwards every hook
    own = lambda name: sorted(cls for cls, method in methods if method == name and cls not in bases | wrappers)
    assert own("score_mod") == []   # the forget gate's too: pair_bias on its bias_inputs, per batch row
    # RoPE's cos/sin cache: the fast path; the diffusers compatibility modes' averaged or unequal angles
    assert own("encode_qk") == ["DiffusersCompatRotaryEmbedding", "RotaryPositionalEmbedding"]
    assert own("attention_bias") == [] and own("full_precision_logits") == []
    # every bias's forward(q_len, k_len) is the base's
    bias_forwards = [cls for cls, method in methods if method == "forward" and cls in
                     {name for name, obj in vars(pe_lib).items() if isinstance(obj, type)
                      and issubclass(obj, pe_lib._PairwiseBias)}]
    assert bias_forwards == ["_PairwiseBias"]
    # attention()'s paths: one per base, none per class
    assert own("_attention") == []
    assert sorted(cls for cls, method in methods if method == "_attention") == sorted(
        {"PositionalEmbedding", "_AttentionEncoding", "_PairwiseBias", "_ExplicitLogits"} | wrappers)


def test_attention_reads_no_kind_string():
    """Issue 43: attention() runs each base's own path (``_attention``) instead of comparing ``pe.kind`` with a
    string, so a vendored file holds its own kind's path only: NoPE's has no bias or logits path, ALiBi's no
    logits path. The one comparison left is the demo's table."""
    import ast
    source = pathlib.Path(pe_lib.__file__).read_text()
    demo = source.index("def _demo(")
    compared = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Attribute) and node.left.attr == "kind"]
    assert len(compared) == 1 and source.count("\n", 0, demo) < compared[0]
    nope = pe_lib.vendor(["NoPositionalEmbedding"])
    assert "def _attention(" in nope and "class _AttentionEncoding" not in nope and "def _bias_path" not in nope
    alibi = pe_lib.vendor(["ALiBiPositionalEmbedding"])
    assert "class _PairwiseBias" in alibi and "class _ExplicitLogits" not in alibi


# what a per-class test class tests, where its name does not say it
TEST_CLASS_SUBJECTS = {
    "TestNoPE": "NoPositionalEmbedding", "TestFourierFeatures": "FourierFeaturePositionalEmbedding",
    "TestGraphEncodings": "LaplacianPositionalEmbedding", "TestVideoRoPE": "VideoRotaryPositionalEmbedding",
    "TestTUPE": "UnifiedPositionalEmbedding", "TestDiffusersConfig": "RotaryPositionalEmbedding",   # from_config
    "TestDiffusersCompatRotary": "RotaryPositionalEmbedding",   # a RoPE subclass that only diffusers configs need
    **dict.fromkeys(
        ("TestAtLength", "TestValueRotation", "TestRotaryOptionsTogether", "TestPairAxes", "TestRerotate"),
        "RotaryPositionalEmbedding"),
}


def test_per_class_test_classes_follow_the_library_order():
    """Issue 43: between the first kind's section and the cross-cutting tests (export, compile, sharding,
    vendoring), each test class sits where its subject is defined in the library, in the same order."""
    import ast
    library = {node.name: node.lineno for node in ast.parse(pathlib.Path(pe_lib.__file__).read_text()).body
               if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    source = pathlib.Path(__file__).read_text()
    first, last = source.index("class TestSinusoidal"), source.index("class TestExport")
    tests = [node.name for node in ast.parse(source).body if isinstance(node, ast.ClassDef)
             and node.name.startswith("Test") and first <= source.index(f"class {node.name}") < last]

    def subject(test: str) -> str:
        name = test[len("Test"):]
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
        found = [c for c in (TEST_CLASS_SUBJECTS.get(test), f"{name}PositionalEmbedding", name, snake) if c in library]
        assert found, f"{test}: no library definition named after it (add it to TEST_CLASS_SUBJECTS)"
        return found[0]

    lines = [library[subject(test)] for test in tests]
    out_of_order = [(a, b) for a, b, x, y in zip(tests, tests[1:], lines, lines[1:]) if y < x]
    assert len(tests) > 50 and out_of_order == [], out_of_order


# ---------------------------------------------------------------------------
# Docs: the demo, docstring examples, README and docs/ pages
# ---------------------------------------------------------------------------


def test_demo_runs(capsys):
    pe_lib._demo()
    out = capsys.readouterr().out
    for name in pe_lib._demo_modules(2, 8, 16):
        assert name in out


def test_demo_translation_column_is_measured_for_every_class():
    """Issue 22 item 13: the column said "n/a (absolute positions)" for FIRE and the Swin bias,
    which take relative positions. It now shifts every position and reports what it measured."""
    heads, head_dim, n = 2, 8, 16
    q, k = torch.randn(2, 1, heads, n, head_dim).unbind(0)
    # FIRE divides by the query's own position, LieRE's generators do not commute, TUPE adds absolute terms
    # Dual Chunk: chunk boundaries sit at absolute positions; FoPE: its noise mixes frequencies; the query
    # temperature grows with the query's absolute position; ERNIE-Image's angles are not a rotation
    moves = {"fire", "liere", "tupe", "dual_chunk", "fope", "query_temperature", "diffusers_compat"}
    for name, pe in pe_lib._demo_modules(heads, head_dim, n).items():
        column = pe_lib._demo_translation(pe, q, k, pe_lib._demo_positions(pe, n))
        assert "absolute positions" not in column, (name, column)
        if pe.kind == "input" or not pe.takes_positions or name == "algebraic_tree":
            assert column.startswith("n/a ("), (name, column)
            continue
        gap = float(column.rsplit("= ", 1)[1])
        if name in moves:
            assert column.startswith("not invariant") and gap > 1e-3, (name, column)
        else:
            assert column.startswith("invariant") and gap < 1e-4, (name, column)


def test_docstring_examples_run():
    """Every ``>>>`` example in the library file runs (issue 22: those of the sharded Heinsen
    functions needed a process group; those lines are marked ``# doctest: +SKIP``)."""
    tests = [t for t in doctest.DocTestFinder().find(pe_lib, globs=vars(pe_lib)) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failed = [t.name for t in tests if runner.run(copy.copy(t), out=lambda _: None).failed]
    assert not failed, failed
    # the finder reached every docstring that has an example (it also walks methods and helpers)
    found = {t.name.split(".", 1)[1] for t in tests}
    for name in pe_lib.__all__:
        obj = getattr(pe_lib, name)
        if ">>>" in (inspect.getdoc(obj) or ""):
            assert obj.__name__ in found, name   # aliases (EmbedPosition) under their class's name
    skipped = sum(e.options.get(doctest.SKIP, False) for t in tests for e in t.examples)
    assert skipped == 4, skipped   # the two sharded examples' process-group lines, nothing else


def _in_standard_library(name: str) -> bool:
    """Is ``name`` a standard-library module? ``sys.stdlib_module_names`` from Python 3.10; on 3.9 a
    built-in module, or a module file or package in the standard library's folders."""
    names = getattr(sys, "stdlib_module_names", None)
    if names is not None:
        return name in names
    import pathlib
    import sysconfig

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return (name in sys.builtin_module_names or (stdlib / f"{name}.py").exists() or (stdlib / name).is_dir()
            or any((stdlib / "lib-dynload").glob(f"{name}.*")))


def _missing_reference_libraries(block: str) -> list:
    """The top-level modules ``block`` imports that are not installed. Only reference libraries
    may be missing (transformers, ...): torch, the library and the standard library must import."""
    import re

    names = {m.split(".")[0] for m in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", block, flags=re.M)}
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    required = [n for n in missing if n in ("torch", "positional_embeddings") or _in_standard_library(n)]
    assert not required, f"an example imports {required}, which every machine must have"
    return missing


def _run_python_blocks(text: str, filename: str) -> list:
    """Run every ```python block of a Markdown page, in order, in one namespace. A block that
    imports an absent reference library is left out (like the other comparisons); the
    names of what was left out are returned."""
    import re

    namespace, left_out = {}, []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        missing = _missing_reference_libraries(block)
        if missing:
            left_out.extend(missing)
            continue
        exec(compile(block, filename, "exec"), namespace)
    return left_out


def test_readme_examples_run():
    """Every ```python block of the README runs, in order, in one namespace."""
    text = (pathlib.Path(__file__).parent / "README.md").read_text()
    assert "```python" in text
    left_out = _run_python_blocks(text, "README.md")
    if left_out:
        pytest.skip(f"the other examples ran; those that import {', '.join(left_out)} need it installed")


@pytest.mark.parametrize("page", sorted(p.name for p in (pathlib.Path(__file__).parent / "docs").glob("*.md")))
def test_docs_examples_run(page):
    """Every ```python block of each docs/ page runs, in order, in one namespace per page
    (``py`` blocks are shown, not run: they need a process group). Blocks that import an
    absent reference library are skipped; the rest of the page still runs."""
    left_out = _run_python_blocks((pathlib.Path(__file__).parent / "docs" / page).read_text(), page)
    if left_out:
        pytest.skip(f"the other examples ran; those that import {', '.join(left_out)} need it installed")


def test_docs_examples_skip_only_blocks_that_need_an_absent_reference_library(monkeypatch):
    """Issue 22 item 9: docs/model_parity.md's ``import transformers`` failed the suite where
    transformers is not installed; such a block is skipped, and every other block still runs."""
    text = ("```python\nimport torch\nx = torch.ones(2)\n```\n"
            "```python\nimport not_a_reference_library_xyz.sub\nraise AssertionError('ran')\n```\n"
            "```python\nassert x.sum() == 2\ny = 3\n```\n")
    assert _run_python_blocks(text, "page.md") == ["not_a_reference_library_xyz"]
    with pytest.raises(AssertionError, match="late"):   # the blocks after it do run
        _run_python_blocks(text + "```python\nassert y == 4, 'late'\n```\n", "page.md")
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as patch:   # a missing torch or stdlib module is a failure, not a skip
        for name in ("math", "torch"):
            patch.setattr(importlib.util, "find_spec", lambda n, name=name: None if n == name else find_spec(n))
            with pytest.raises(AssertionError, match="every machine must have"):
                _run_python_blocks(f"```python\nimport {name}\n```\n", "p.md")
    page = (pathlib.Path(__file__).parent / "docs" / "model_parity.md").read_text()
    assert "import transformers" in page   # the case that failed
    expected = [] if importlib.util.find_spec("transformers") else ["transformers"]
    assert _run_python_blocks(page, "model_parity.md") == expected


def docs_model_types(heading: str) -> set:
    """The `names` of the paragraph that follows ``heading`` in docs/model_parity.md."""
    text = (pathlib.Path(__file__).parent / "docs" / "model_parity.md").read_text()
    start = text.index(heading)
    paragraph = text[start + len(heading):].split("\n\n")[0]
    return set(re.findall(r"`([^`]+)`", paragraph))


def test_docs_list_the_from_config_model_types():
    assert docs_model_types("RoPE model types (") == set(pe_lib._ROPE_MODEL_TYPES)
    assert docs_model_types("T5 bias model types (") == set(pe_lib._T5_MODEL_TYPES)
    assert docs_model_types("ALiBi model types (") == set(pe_lib._ALIBI_MODEL_TYPES)
    assert docs_model_types("Inkling bias model types (") == set(pe_lib._INKLING_MODELS)
    text = (pathlib.Path(__file__).parent / "docs" / "model_parity.md").read_text()
    for name in [*pe_lib._ROPE_REFUSED, *pe_lib._T5_REFUSED, *pe_lib._ALIBI_REFUSED]:
        assert f"- `{name}`" in text, f"{name}: refused without a reason in the docs"


# ---------------------------------------------------------------------------
# Benchmark scripts: compare.py, the extrapolation study (quick mode), bench.py, the gallery
# ---------------------------------------------------------------------------


def test_compare_quick_runs_end_to_end():
    """benchmarks/compare.py --quick trains and evaluates every task kind (2 steps, 1 eval batch)."""
    import pathlib
    import subprocess
    import sys

    command = [sys.executable, "benchmarks/compare.py", "--quick", "--steps", "2", "--eval-batches", "1", "--markdown"]
    result = subprocess.run(command, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = [[cell.strip() for cell in line.strip().strip("|").split("|")]
             for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0][:4] == ["encoding", "task", "acc@L", "acc@2L"], result.stdout
    rows = table[1:]
    assert {row[1] for row in rows} == {"reverse", "recall", "grid", "tree"}, result.stdout
    for row in rows:
        assert 0.0 <= float(row[2]) <= 1.0 and 0.0 <= float(row[3]) <= 1.0, row


def test_abacus_addition_script_runs():
    """benchmarks/abacus_addition.py trains both models (2 steps) and prints an exact-match and a
    per-digit accuracy for every test length (the docs' under-a-minute run is the same script)."""
    import subprocess

    command = [sys.executable, "benchmarks/abacus_addition.py", "--steps", "2", "--max-k", "3"]
    result = subprocess.run(command, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"abacus", "nope"}, result.stdout
    for line in rows.values():
        values = [float(v) for v in re.findall(r"digit(?:s|s, per digit): ([0-9.]+)", line)]
        assert len(values) == 6 and all(0.0 <= v <= 1.0 for v in values), line


@slow
def test_compare_every_encoding_two_seeds(tmp_path):
    """Every (task, encoding) pair of compare.py builds, trains one step and evaluates, over two
    seeds: the table gives the mean and the range, the CSV one line per seed."""
    import csv
    import pathlib
    import subprocess
    import sys

    out = tmp_path / "compare.csv"
    command = [sys.executable, "benchmarks/compare.py", "--steps", "1", "--eval-batches", "1", "--batch-size", "8",
               "--seeds", "0,1", "--markdown", "--csv", str(out)]
    result = subprocess.run(command, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    with open(out) as handle:
        per_seed = list(csv.DictReader(handle))
    assert len(per_seed) == 2 * len(rows) and {r["seed"] for r in per_seed} == {"0", "1"}
    for row in rows:
        seeds = [r for r in per_seed if (r["task"], r["encoding"]) == (row[1], row[0])]
        mean = sum(float(r["acc_at_L"]) for r in seeds) / 2
        assert row[2].startswith(f"{mean:.3f} ("), (row, seeds)
    assert {row[0] for row in rows if row[1] == "recall"} >= {"xpos", "cope", "forgetting"}
    assert not {row[0] for row in rows if row[1] == "reverse"} & {"xpos", "cope", "forgetting"}   # causal only
    assert {row[0] for row in rows if row[1] == "grid"} >= {"swin_bias", "swinv2_cpb", "dynamic_bias_2d", "mixed_rope",
                                                           "liere", "conv_peg", "fourier_2d"}


REPO = pathlib.Path(__file__).resolve().parent


def _load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@slow   # the default run has test_extrapolation_trial_runs_leave_committed_results_alone's tiny run
def test_extrapolation_quick_runs(tmp_path):
    extrapolation = _load_benchmark("extrapolation")
    extrapolation.main(["--quick", "--out-dir", str(tmp_path)])
    with open(tmp_path / "extrapolation.csv") as handle:
        rows = list(csv.DictReader(handle))
    encodings = extrapolation.QUICK_ENCODINGS
    train_len = extrapolation.QUICK["train_len"]
    lengths = [train_len * f for f in extrapolation.LENGTH_FACTORS]
    # one row per encoding x evaluation length (one seed in quick mode), nothing else
    assert sorted((r["encoding"], int(r["eval_len"])) for r in rows) == sorted(
        (name, n) for name in encodings for n in lengths)
    for r in rows:
        bpb = float(r["bpb"])
        assert math.isfinite(bpb) and bpb > 0, r
        if int(r["eval_len"]) == train_len:
            assert math.isnan(float(r["bpb_beyond_L"])), r   # no position >= L in a window of L
            assert bpb < extrapolation.UNIFORM_BPB, f"{r['encoding']} does not beat uniform guessing at L: {bpb}"
        else:
            assert math.isfinite(float(r["bpb_beyond_L"])), r
        assert int(r["eval_bytes"]) == extrapolation.QUICK["eval_segments"] * lengths[-1]   # same bytes at every length
    with open(tmp_path / "extrapolation_positions.csv") as handle:
        positions = list(csv.DictReader(handle))
    assert {r["encoding"] for r in positions} == set(encodings)
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("extrapolation.png", "extrapolation_position.png", "extrapolation_cost.png"):
            assert (tmp_path / name).stat().st_size > 10_000, name


def test_extrapolation_registry_covers_library():
    extrapolation = _load_benchmark("extrapolation")
    assert extrapolation.uncovered_classes() == []
    corpus_files = extrapolation.corpus_files(pathlib.Path(extrapolation.sysconfig.get_paths()["stdlib"]))
    assert corpus_files == sorted(corpus_files) and corpus_files
    assert not any(part in extrapolation.EXCLUDED_DIRS for f in corpus_files for part in f.split("/")[:-1])


def test_extrapolation_trial_runs_leave_committed_results_alone(tmp_path, monkeypatch):
    """Issue 22 item 7: --quick (and any run that is not the full study) writes into SCRATCH, never
    into the committed benchmarks/results and docs/figures; --write-results asks for them."""
    extrapolation = _load_benchmark("extrapolation")
    committed = {"csv": REPO / "benchmarks" / "results" / "extrapolation.csv",
                 "positions": REPO / "benchmarks" / "results" / "extrapolation_positions.csv",
                 "figure": REPO / "docs" / "figures" / "extrapolation.png",
                 "position_figure": REPO / "docs" / "figures" / "extrapolation_position.png",
                 "cost": REPO / "docs" / "figures" / "extrapolation_cost.png"}
    paths = lambda *argv: extrapolation.output_paths(extrapolation.parse_args(list(argv)))
    assert paths() == committed                                             # the full study
    assert paths("--threads", "1", "--eval-chunk-tokens", "512") == committed   # speed only
    assert paths("--merge", "A,B") == committed
    for trial in (["--quick"], ["--seeds", "0"], ["--encodings", "rotary,alibi,nope"], ["--steps", "300"],
                  ["--train-len", "32"], ["--lr", "1e-3"], ["--corpus-root", "src"]):
        assert set(paths(*trial).values()) == {extrapolation.SCRATCH / p.name for p in committed.values()}, trial
        assert paths(*trial, "--write-results") == committed, trial
    assert set(paths("--quick", "--out-dir", "D").values()) == {pathlib.Path("D") / p.name for p in committed.values()}
    with pytest.raises(SystemExit):   # one place or the other
        extrapolation.parse_args(["--quick", "--out-dir", "D", "--write-results"])

    # a tiny --quick run, end to end, on a two-file corpus: the committed CSVs keep their bytes
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    names = [f"m{i}.py" for i in range(100)]
    valid = next(n for n in names if extrapolation.is_validation(n))
    train = next(n for n in names if not extrapolation.is_validation(n))
    for name in (valid, train):
        (corpus / name).write_text("def f(x):\n    return x + 1\n" * 200)
    before = {key: committed[key].read_bytes() for key in ("csv", "positions")}
    monkeypatch.setattr(extrapolation, "SCRATCH", tmp_path / "scratch")
    extrapolation.main(["--quick", "--encodings", "nope", "--steps", "2", "--eval-segments", "1", "--no-figures",
                        "--corpus-root", str(corpus)])
    assert {key: committed[key].read_bytes() for key in ("csv", "positions")} == before
    with open(tmp_path / "scratch" / "extrapolation.csv") as handle:
        assert {r["encoding"] for r in csv.DictReader(handle)} == {"nope"}
    assert (tmp_path / "scratch" / "extrapolation_positions.csv").is_file()


def test_bench_regime_both_passes_every_other_argument_to_each_child(monkeypatch):
    """Issue 22 item 7: ``bench.py rope --regime both`` gave the child ``both`` as a section name."""
    bench = _load_benchmark("bench")
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, env, check: calls.append((command, env)))
    for argv in (["rope", "--regime", "both"], ["rope", "--regime=both", "--reps", "3"], ["--regime", "both"], []):
        calls.clear()
        bench.main(argv)
        assert [env["MALLOC_MMAP_THRESHOLD_"] for _, env in calls] == [
            regime["MALLOC_MMAP_THRESHOLD_"] for regime in bench.REGIMES.values()], argv
        for (command, _), regime in zip(calls, bench.REGIMES):
            child = bench.parse_args(command[2:])   # [python, bench.py, *argv]
            want = bench.parse_args([a for a in argv if "regime" not in a and a != "both"])
            assert (child.sections, child.reps, child.no_compile, child.regime) == (
                want.sections, want.reps, want.no_compile, regime), (argv, command)
    with pytest.raises(SystemExit):   # an abbreviation would escape the filter
        bench.parse_args(["rope", "--reg", "both"])


def test_bench_rope_sections_run(capsys):
    """Issue 42: ``bench.py rope`` ran into a NameError (``device``) where transformers is installed, and
    ``rope_attention`` prints RoPE through attention() and the HF-style rotation as ratios to SDPA, forward and
    forward + backward, fp32 and bf16 (tiny sizes here)."""
    bench = _load_benchmark("bench")
    bench.bench_rope(1, compile=False, sizes=(1, 2, 8, 16))
    bench.bench_rope_attention(1, compile=False, sizes=(1, 2, 8, 16))
    out = capsys.readouterr().out
    assert "RoPE: rotate q and k [1, 2, 8, 16] fp32" in out
    for mode in ("forward (no grad)", "forward + backward"):
        for dtype in ("float32", "bfloat16"):
            title = f"RoPE attention, {mode}, B=1, H=2, N=8, Dh=16 {dtype}, causal (ratio to SDPA)"
            table = out.split(title)[1].split("\n\n")[0]
            assert re.search(r"SDPA causal \(floor: no positions\) +[0-9.]+ +1\.00", table), table
            assert "RoPE attention() (eager rotation: the CPU's default)" in table
            assert "HF-style rotate_half + SDPA" in table


@slow
def test_gallery_runs(tmp_path):
    pytest.importorskip("matplotlib")
    gallery = _load_benchmark("gallery")
    outcome = gallery.make_gallery(str(tmp_path))
    assert (tmp_path / "gallery.png").stat().st_size > 50_000
    failed = {name: result for name, result in outcome.items() if not result.endswith(".png")}
    assert not failed, failed
    for name in gallery.GALLERY:
        assert (tmp_path / "gallery" / f"{name}.png").is_file(), name
    assert gallery.uncovered_classes() == []


def test_gallery_draws_a_few_panels(tmp_path):
    """The default run's gallery: three panels drawn end to end (test_gallery_runs draws them all)."""
    pytest.importorskip("matplotlib")
    gallery = _load_benchmark("gallery")
    only = list(gallery.GALLERY)[:3]
    outcome = gallery.make_gallery(str(tmp_path), only=only)
    assert (tmp_path / "gallery.png").is_file()
    assert set(outcome) == {*only, "gallery"} and all(result.endswith(".png") for result in outcome.values()), outcome
    for name in only:
        assert (tmp_path / "gallery" / f"{name}.png").is_file(), name
    assert gallery.uncovered_classes() == []


if __name__ == "__main__":  # python3 test_positional_embeddings.py: the distributed figures for the README
    for name, found in run_distributed([name for name, _ in _checks()]).items():
        print(f"{name:<48}" + "  ".join(f"{m}={v:.1e}" if not isinstance(v, str) else f"{m}={v}"
                                        for m, v in found.items()))

"""Tests for positional_embeddings.py.

Layout: one shared list of factories (one per class) and the property tests that run
over all of them; then one ``TestXxx`` class per encoding, in file order, checking the
maths against slow float64 oracles written plainly here and against published constants.
"""

import copy
import math
import pickle
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import positional_embeddings as pe_lib
from positional_embeddings import (
    LearnedPositionalEmbedding,
    PositionalEmbedding,
    SinusoidalPositionalEmbedding,
    attention,
)

B, H, N, DH = 2, 4, 16, 32
D = H * DH


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------
# Factories: one per class; every property test below runs over all of them
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


CASES = [
    Case("sinusoidal", lambda: SinusoidalPositionalEmbedding(D)),
    Case("sinusoidal_concat", lambda: SinusoidalPositionalEmbedding(D, layout="concat")),
    Case("learned", lambda: LearnedPositionalEmbedding(64, D)),
]


def qkv(nq=N, nk=N, dtype=torch.float32, dh=DH):
    q = torch.randn(B, H, nq, dh, dtype=dtype)
    k = torch.randn(B, H, nk, dh, dtype=dtype)
    v = torch.randn(B, H, nk, dh, dtype=dtype)
    return q, k, v


def tokens(case, n=N, dtype=torch.float32):
    return torch.randn(B, n, case.token_dim, dtype=dtype)


# ---------------------------------------------------------------------------
# Property tests over every class
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
        y = pe.forward_input(x)
        assert y.shape == x.shape and y.dtype == dtype
        q, k, _ = qkv(N - 3, N, dtype=dtype)
        logits = case.attn(pe, q, k)
        assert logits.shape == (B, H, N - 3, N) and logits.dtype == dtype

    def test_nothing_cached_in_state_dict(self, case):
        pe = case.make()
        case.attn(pe, *qkv()[:2])
        assert set(pe.state_dict()) == {name for name, _ in pe.named_parameters()}

    def test_load_state_dict_round_trips(self, case):
        a, b = case.make(), case.make()
        for p in b.parameters():
            torch.nn.init.normal_(p)
        a.load_state_dict(b.state_dict())
        q, k, _ = qkv()
        torch.testing.assert_close(case.attn(a, q, k), case.attn(b, q, k))

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
        want = case.attn(pe, q, k)
        for clone in (copy.deepcopy(pe), pickle.loads(pickle.dumps(pe))):
            torch.testing.assert_close(case.attn(clone, q, k), want)

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
        torch.testing.assert_close(meta.forward_input(x), normal.forward_input(x))

    def test_moves_to_meta(self, case):
        pe = case.make()
        moved = copy.deepcopy(pe).to("meta")
        assert all(t.is_meta for t in list(moved.parameters()) + list(moved.buffers()))

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

    def test_token_by_token_attn_equals_full(self, case):
        pe = case.make()
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
        q, k, _ = qkv()
        q.requires_grad_(True)
        loss = case.attn(pe, q, k).square().sum() + pe.forward_input(tokens(case)).square().sum()
        loss.backward()
        assert q.grad is not None and q.grad.abs().sum() > 0
        for name, p in pe.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name

    def test_attention_matches_explicit_softmax(self, case):
        pe = case.make()
        for nq, causal in ((N, False), (N, True), (N - 6, True)):
            q, k, v = qkv(nq, N, dtype=torch.float64)
            pe64 = copy.deepcopy(pe).double()
            logits = case.attn(pe64, q, k)
            if causal:
                i = torch.arange(nq)[:, None] + (N - nq)
                logits = logits.masked_fill(torch.arange(N)[None, :] > i, float("-inf"))
            want = torch.softmax(logits, dim=-1) @ v
            got = attention(q, k, v, pe64, causal=causal, **dict(zip(("positions_q", "positions_k"),
                                                                    case.positions(nq, N))))
            torch.testing.assert_close(got, want)

    def test_compile_fullgraph(self, case):
        pe = case.make()
        q, k, _ = qkv()
        x = tokens(case)
        torch._dynamo.reset()
        attn = torch.compile(pe.forward_attn, backend="eager", fullgraph=True)
        positions = case.positions(N, N)
        torch.testing.assert_close(attn(q, k, *positions), pe.forward_attn(q, k, *positions))
        inp = torch.compile(pe.forward_input, backend="eager", fullgraph=True)
        torch.testing.assert_close(inp(x), pe.forward_input(x))

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

    def test_bad_tokens_raise(self, case):
        pe = case.make()
        if pe.kind != "input":
            pytest.skip("identity on tokens")
        with pytest.raises(ValueError, match=type(pe).__name__ + ".*x"):
            pe.forward_input(torch.randn(B, N, case.token_dim + 1))
        with pytest.raises(TypeError, match=type(pe).__name__ + ".*x"):
            pe.forward_input(torch.zeros(B, N, case.token_dim, dtype=torch.long))


# ---------------------------------------------------------------------------
# attention(): masks and alignment
# ---------------------------------------------------------------------------


class TestAttention:
    def test_no_encoding_equals_sdpa(self):
        q, k, v = qkv()
        torch.testing.assert_close(attention(q, k, v), F.scaled_dot_product_attention(q, k, v))

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


# ---------------------------------------------------------------------------
# Sinusoidal
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

    def test_float64_positions_give_float64_table(self):
        table = SinusoidalPositionalEmbedding(8).embed(torch.tensor([0.5], dtype=torch.float64))
        assert table.dtype == torch.float64

    def test_bf16_output_is_rounded_exact_value(self):
        pe = SinusoidalPositionalEmbedding(64)
        x = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
        out = pe(x, offset=999_996)
        want = sinusoid_oracle(list(range(999_996, 1_000_000)), 64).to(torch.bfloat16)
        torch.testing.assert_close(out[0], want, rtol=0, atol=0)

    @pytest.mark.parametrize("kwargs, message", [
        (dict(dim=7), "dim must be a positive multiple of 2"),
        (dict(dim=12, num_axes=4), "dim must be a positive multiple of 2 \\* num_axes = 8, got dim=12"),
        (dict(dim=8, base=-1.0), "base must be positive"),
        (dict(dim=8, layout="sin"), "layout must be"),
    ])
    def test_bad_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match="SinusoidalPositionalEmbedding: " + message):
            SinusoidalPositionalEmbedding(**kwargs)

    def test_bad_multi_axis_positions(self):
        pe = SinusoidalPositionalEmbedding(8, num_axes=2)
        with pytest.raises(ValueError, match="positions must have shape"):
            pe(torch.randn(1, 3, 8), torch.zeros(3, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="positions is required"):
            pe(torch.randn(1, 3, 8))


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

    @pytest.mark.parametrize("kwargs", [dict(max_len=0, dim=4), dict(max_len=4, dim=-1), dict(max_len=2.5, dim=4)])
    def test_bad_arguments(self, kwargs):
        with pytest.raises(ValueError, match="LearnedPositionalEmbedding: "):
            LearnedPositionalEmbedding(**kwargs)


# ---------------------------------------------------------------------------
# Demo
# ---------------------------------------------------------------------------


def test_demo_runs(capsys):
    pe_lib._demo()
    out = capsys.readouterr().out
    for name in pe_lib._demo_modules(2, 8, 16):
        assert name in out


def test_readme_examples_run():
    """Every ```python block of the README runs, in order, in one namespace."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)

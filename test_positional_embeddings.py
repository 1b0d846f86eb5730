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
    AlgebraicGridPositionalEmbedding,
    AlgebraicSequencePositionalEmbedding,
    AlgebraicTreePositionalEmbedding,
    ALiBiPositionalEmbedding,
    EnformerPositionalEmbedding,
    HeinsenPositionalEmbedding,
    LearnedPositionalEmbedding,
    PositionalEmbedding,
    RotaryPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    T5PositionalEmbedding,
    TransformerXLPositionalEmbedding,
    UnifiedPositionalEmbedding,
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

    def own_call_args(self, pe, q, k, x):
        """Arguments of the class's own forward: tokens, one of q/k, lengths, or q and k."""
        if pe.kind == "input":
            return (x,)
        if pe.kind == "bias":
            return (q.shape[-2], k.shape[-2])
        positions_q, positions_k = self.positions(q.shape[-2], k.shape[-2])
        if pe.kind == "logits":
            return (q, k, positions_q, positions_k)
        return (q,) if positions_q is None else (q, positions_q)


CASES = [
    Case("sinusoidal", lambda: SinusoidalPositionalEmbedding(D)),
    Case("sinusoidal_concat", lambda: SinusoidalPositionalEmbedding(D, layout="concat")),
    Case("learned", lambda: LearnedPositionalEmbedding(64, D)),
    Case("rotary", lambda: RotaryPositionalEmbedding(DH)),
    Case("rotary_interleaved_partial", lambda: RotaryPositionalEmbedding(DH, interleaved=True, rotary_dim=DH // 2)),
    Case("rotary_yarn", lambda: RotaryPositionalEmbedding(
        DH, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})),
    Case("rotary_mrope", lambda: RotaryPositionalEmbedding(DH, sections=[4, 6, 6]),
         required_positions=lambda n: torch.stack([torch.arange(n) // 8, torch.arange(n) % 8 // 3,
                                                   torch.arange(n) % 3], -1),
         has_offset=False),
    Case("t5", lambda: T5PositionalEmbedding(H, num_buckets=8, max_distance=12), has_offset=False),
    Case("t5_causal", lambda: T5PositionalEmbedding(H, bidirectional=False), has_offset=False),
    Case("alibi", lambda: ALiBiPositionalEmbedding(H), has_offset=False),
    Case("alibi_bidirectional", lambda: ALiBiPositionalEmbedding(H, bidirectional=True), has_offset=False),
    Case("tupe", lambda: UnifiedPositionalEmbedding(64, H, DH, cls_token=True, num_buckets=8, max_distance=12),
         has_offset=False),
    Case("transformer_xl", lambda: TransformerXLPositionalEmbedding(H, DH), has_offset=False),
    Case("enformer", lambda: EnformerPositionalEmbedding(H, DH, num_features=12, length_scale=64),
         has_offset=False),
    Case("algebraic_sequence", lambda: AlgebraicSequencePositionalEmbedding(DH, H)),
    Case("algebraic_grid", lambda: AlgebraicGridPositionalEmbedding(DH, H),
         required_positions=lambda n: torch.stack([torch.arange(n) // 4, torch.arange(n) % 4], -1), has_offset=False),
    Case("algebraic_tree", lambda: AlgebraicTreePositionalEmbedding(DH, H, branching_factor=2, max_depth=5)),
    Case("heinsen", lambda: HeinsenPositionalEmbedding(D, 16), has_offset=False, takes_positions=False),
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

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    def test_cuda_matches_cpu(self, case):
        pe = case.make()
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
        logits = case.attn(pe, q, k)
        logits = logits.masked_fill(logits == float("-inf"), 0.0)   # causal ALiBi
        loss = logits.square().sum() + pe.forward_input(tokens(case)).square().sum()
        loss.backward()
        assert q.grad is not None and q.grad.abs().sum() > 0
        for name, p in pe.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name

    def test_gradcheck_float64(self, case):
        pe = case.make().double()
        q, k, _ = qkv(4, 5, dtype=torch.float64)
        x = tokens(case, n=5, dtype=torch.float64)[:1]
        q, k = q[:1].requires_grad_(), k[:1].requires_grad_()
        positions = case.positions(4, 5)
        finite = lambda t: torch.where(torch.isfinite(t), t, 0.0)
        assert torch.autograd.gradcheck(lambda q, k: finite(pe.forward_attn(q, k, *positions)), (q, k), fast_mode=True)
        if pe.kind == "input":
            assert torch.autograd.gradcheck(pe.forward_input, (x.requires_grad_(),), fast_mode=True)
        # parameters: the derivative along a random direction against central differences
        params = [p for p in pe.parameters()]
        if not params:
            return
        weights = torch.randn_like(finite(pe.forward_attn(q, k, *positions)))

        def loss():
            total = (finite(pe.forward_attn(q, k, *positions)) * weights).sum()
            return total + (pe.forward_input(x) * x).sum() if pe.kind == "input" else total

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
        q, k, v = qkv()
        x = tokens(case)
        positions = dict(zip(("positions_q", "positions_k"), case.positions(N, N)))
        entry_points = {
            "forward_attn": (pe.forward_attn, lambda: (q, k, *positions.values())),
            "forward_input": (pe.forward_input, lambda: (x,)),
            "forward": (pe.forward, lambda: case.own_call_args(pe, q, k, x)),
            "attention": (lambda *a: attention(*a, pe, causal=True, **positions), lambda: (q, k, v)),
        }
        for name, (fn, args) in entry_points.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(*args()), fn(*args()), msg=name)

    def test_compile_recompiles_at_most_once_for_new_lengths(self, case):
        pe = case.make()
        graphs = []

        def counting_backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, pq, pk: pe.forward_attn(q, k, pq, pk), backend=counting_backend,
                                 fullgraph=True)
        for n in (16, 12, 10, 14):
            q, k, _ = qkv(n, n)
            want = case.attn(pe, q, k)
            torch.testing.assert_close(compiled(q, k, *case.positions(n, n)), want)
        assert len(graphs) <= 2, f"{len(graphs)} graphs for 4 lengths"

    def test_low_precision_module_stays_finite_and_close(self, case):
        pe = case.make()
        q, k, _ = qkv()
        want = case.attn(pe, q, k)
        for cast in ("bfloat16", "half"):
            got = case.attn(getattr(copy.deepcopy(pe), cast)(), q, k)
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), finite)
            error = (got[finite] - want[finite]).norm() / want[finite].norm()
            assert error < 0.05, f"{cast}: relative error {error:.3f}"

    def test_batched_positions_with_extra_leading_dims(self, case):
        if not case.takes_positions:
            pytest.skip("order is encoded by the recurrence")
        pe = case.make()
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
        want = pe.forward_attn(q, k, pos_q, pos_k)
        for dtype in (torch.int32, torch.int16, torch.uint8):
            torch.testing.assert_close(pe.forward_attn(q, k, pos_q.to(dtype), pos_k.to(dtype)), want)

    def test_empty_queries(self, case):
        pe = case.make()
        q, k, v = qkv(0, N)
        positions_q, positions_k = case.positions(1, N)
        if positions_q is not None:
            positions_q = positions_q[:0]
        out = attention(q, k, v, pe, positions_q=positions_q, positions_k=positions_k)
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


# ---------------------------------------------------------------------------
# Rotary
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

    # -- layouts ----------------------------------------------------------------

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

    # -- scaling --------------------------------------------------------------

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

    # -- multi-axis -------------------------------------------------------------

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

    # -- bad input --------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Relative biases: T5, ALiBi, TUPE
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
        (dict(num_heads=0), "num_heads must be a positive int, got num_heads=0"),
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
        slopes = pe_lib.alibi_slopes(4)
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

    def test_positions_past_the_table(self):
        with pytest.raises(ValueError, match="UnifiedPositionalEmbedding: positions_k must lie in \\[0, max_len=8\\), got position 8"):
            UnifiedPositionalEmbedding(8, 2, 4)(2, 9, positions_q=torch.tensor([0, 1]))

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="UnifiedPositionalEmbedding: head_dim must be a positive int, got head_dim=0"):
            UnifiedPositionalEmbedding(8, 2, 0)


class TestFlexAttention:
    @pytest.mark.parametrize("make", [lambda: T5PositionalEmbedding(H), lambda: ALiBiPositionalEmbedding(H),
                                      lambda: ALiBiPositionalEmbedding(H, bidirectional=True),
                                      lambda: UnifiedPositionalEmbedding(32, H, DH, cls_token=True)])
    @pytest.mark.parametrize("causal", [False, True])
    def test_score_mod_matches_dense_bias(self, make, causal):
        from torch.nn.attention.flex_attention import flex_attention

        pe = make()
        q, k, v = qkv(N - 3, N)
        want = attention(q, k, v, pe, causal=causal, use_flex=False)
        torch.testing.assert_close(attention(q, k, v, pe, causal=causal, use_flex=True), want)
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

    @pytest.mark.parametrize("make", BIAS_MAKERS)
    @pytest.mark.parametrize("rows", ["batched", "shared", "narrow"])
    def test_flex_equals_dense_with_positions_and_batch_unlike_heads(self, make, rows):
        """Issue 12.3: [B, N] with B != H, [1, N] with B > 1 and uint8 positions, flex vs dense."""
        pe = make()
        batch = 3                                                        # != H, so batch and head cannot be mixed up
        q, k, v = (torch.randn(batch, H, N, DH) for _ in range(3))
        base = torch.stack([torch.arange(N) * 2, torch.arange(N) + 5, torch.arange(N).flip(0)])
        positions = {"batched": base, "shared": base[:1], "narrow": base[:1].to(torch.uint8)}[rows]
        for causal in (False, True):
            want = attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=causal, use_flex=False)
            got = attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=causal, use_flex=True)
            torch.testing.assert_close(got, want)
        if rows == "narrow":  # uint8 0 - 2 must be -2, not 254: compare with the int64 positions
            wide = attention(q, k, v, pe, positions_q=base[:1], positions_k=base[:1], use_flex=False)
            torch.testing.assert_close(attention(q, k, v, pe, positions_q=positions, positions_k=positions), wide)

    @pytest.mark.parametrize("make", BIAS_MAKERS)
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


# ---------------------------------------------------------------------------
# Content-dependent relative: Transformer-XL, Enformer
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


# ---------------------------------------------------------------------------
# Algebraic: sequences, grids, trees
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


# ---------------------------------------------------------------------------
# Heinsen
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
            pe.forward_input(torch.randn(2, 5, 4), torch.arange(5))
        with pytest.raises(ValueError, match="d_hid must be a positive int, got d_hid=0"):
            HeinsenPositionalEmbedding(4, 0)


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

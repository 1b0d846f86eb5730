"""Every major positional encoding for transformers, in one PyTorch file.

Torch only: copy this file into your project (or ``pip install`` the repository)
and import the classes directly. Every class follows one interface, so you can
swap encodings without touching the model:

* ``forward_input(x, positions)``: tokens with position information added
  (the identity for encodings that act inside attention);
* ``forward_attn(q, k, positions_q, positions_k)``: pre-softmax attention logits;
* ``attention(q, k, v, pe)``: attention with the cheapest correct path per kind.

Encodings (class, paper):

* ``SinusoidalPositionalEmbedding``: Vaswani et al., "Attention Is All You Need",
  arXiv:1706.03762.
* ``LearnedPositionalEmbedding``: Devlin et al., "BERT", arXiv:1810.04805;
  Radford et al., GPT-2 (2019).
* ``RotaryPositionalEmbedding``: Su et al., "RoFormer: Enhanced Transformer with Rotary
  Position Embedding", arXiv:2104.09864; scalings: Chen et al. (position interpolation)
  arXiv:2306.15595, Peng et al. (YaRN) arXiv:2309.00071, Ding et al. (LongRoPE)
  arXiv:2402.13753, Meta's Llama 3.1; M-RoPE: Wang et al. (Qwen2-VL) arXiv:2409.12191.
* ``T5PositionalEmbedding``: Raffel et al., "Exploring the Limits of Transfer Learning
  with a Unified Text-to-Text Transformer", arXiv:1910.10683.
* ``ALiBiPositionalEmbedding``: Press, Smith and Lewis, "Train Short, Test Long",
  arXiv:2108.12409.
* ``UnifiedPositionalEmbedding`` (TUPE): Ke, He and Liu, "Rethinking Positional Encoding
  in Language Pre-training", arXiv:2006.15595.
* ``TransformerXLPositionalEmbedding``: Dai et al., "Transformer-XL", arXiv:1901.02860.
* ``EnformerPositionalEmbedding``: Avsec et al., "Effective gene expression prediction
  from sequence by integrating long-range interactions", Nature Methods 18 (2021).
* ``AlgebraicSequencePositionalEmbedding``, ``AlgebraicGridPositionalEmbedding``,
  ``AlgebraicTreePositionalEmbedding``: Kogkalidis, Bernardy and Garg, "Algebraic
  Positional Encodings", NeurIPS 2024, arXiv:2312.16045.
* ``HeinsenPositionalEmbedding`` (alias ``EmbedPosition``): Heinsen, "Encoding Position by
  Decaying and Updating Different Exponentiated States Differently" (2024).

Shape legend used in every docstring and comment: ``B`` batch, ``H`` heads,
``N`` tokens (``Nq`` queries, ``Nk`` keys), ``D`` model dim, ``Dh`` head dim,
``A`` position axes, ``F`` frequencies (``D / 2``).
"""

import math
import numbers
import operator
from typing import Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "PositionalEmbedding",
    "attention",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryPositionalEmbedding",
    "ROPE_SCALING",
    "permute_rotary_weight",
    "T5PositionalEmbedding",
    "t5_relative_position_bucket",
    "ALiBiPositionalEmbedding",
    "alibi_slopes",
    "UnifiedPositionalEmbedding",
    "TransformerXLPositionalEmbedding",
    "EnformerPositionalEmbedding",
    "AlgebraicSequencePositionalEmbedding",
    "AlgebraicGridPositionalEmbedding",
    "AlgebraicTreePositionalEmbedding",
    "HeinsenPositionalEmbedding",
    "EmbedPosition",
]

Tensor = torch.Tensor


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _is_compiling() -> bool:
    """True while ``torch.compile`` traces: value-dependent checks are skipped."""
    return torch.compiler.is_compiling()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every input dtype, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_tensor(owner: str, name: str, value, min_dim: int) -> None:
    """Raise unless ``value`` is a floating tensor with at least ``min_dim`` dims."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating tensor, got dtype={value.dtype}")
    if value.dim() < min_dim:
        raise ValueError(
            f"{owner}: {name} must have at least {min_dim} dims, got shape {tuple(value.shape)}"
        )


def _check_base(owner: str, base) -> None:
    """A frequency base: a finite real number > 1."""
    _as_float(owner, "base", base, minimum=1.0, exclusive=True)


def _describe(value) -> str:
    """A value for an error message, abbreviated: tensors by shape and dtype, long reprs cut."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_flag(owner: str, name: str, value) -> bool:
    """A boolean option: ``True``/``False`` (numpy bools too); a string such as ``"false"`` is a TypeError."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {_describe(value)}")


def _as_int(owner: str, name: str, value, minimum: Optional[int] = 1) -> int:
    """An integer size (Python, numpy or torch.SymInt) ``>= minimum``, returned as such."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{owner}: {name} must be an int, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {_describe(value)}") from None
    if minimum is not None and number < minimum:
        want = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{owner}: {name} must be {want}, got {name}={number}")
    return number


def _check_positive_int(owner: str, name: str, value) -> int:
    """A positive integer size; returns it as an int."""
    return _as_int(owner, name, value, 1)


def _as_float(owner: str, name: str, value, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
              exclusive: bool = False) -> float:
    """A finite real number in ``[minimum, maximum]`` (``(minimum, ...]`` when ``exclusive``)."""
    if isinstance(value, (bool, Tensor)) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__} {_describe(value)}")
    number = float(value)
    below = minimum is not None and (number <= minimum if exclusive else number < minimum)
    if not math.isfinite(number) or below or (maximum is not None and number > maximum):
        low = "" if minimum is None else f" {'>' if exclusive else '>='} {minimum}"
        high = "" if maximum is None else f"{' and' if low else ''} <= {maximum}"
        raise ValueError(f"{owner}: {name} must be a finite number{low}{high}, got {name}={value!r}")
    return number


def _check_choice(owner: str, name: str, value, choices: tuple):
    """One of ``choices`` (strings), else a ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {name}={_describe(value)}")
    return value


def _uninitialised(module_cls, *args, **kwargs) -> nn.Module:
    """A submodule built without its own random init (``reset_parameters`` draws it once), so a
    normal build and a meta build + ``reset_parameters()`` consume the same random numbers."""
    return nn.utils.skip_init(module_cls, *args, device=torch.get_default_device(), **kwargs)


def _check_last_dim(owner: str, name: str, value: Tensor, size: int) -> None:
    if value.shape[-1] != size:
        raise ValueError(
            f"{owner}: {name} must have last dim {size}, got shape {tuple(value.shape)}"
        )


def _default_positions(n: int, offset: int, device) -> Tensor:
    """``arange(n) + offset`` as int64."""
    return torch.arange(offset, offset + n, device=device)


def _query_offset(q_len: int, k_len: int) -> int:
    """Bottom-right alignment: fewer queries than keys are the *last* positions."""
    return max(k_len - q_len, 0)


def _check_positions(
    owner: str,
    name: str,
    positions: Optional[Tensor],
    lead: tuple,
    n: int,
    num_axes: int = 1,
    integer: bool = False,
    device=None,
) -> Optional[Tensor]:
    """Validate ``positions`` for a tensor ``[*lead, N, ...]``; return them broadcastable, or None.

    Accepted shapes are ``[N]`` and ``[B, N]`` (``B == lead[0]``, or 1 to share one row),
    with a trailing ``A`` axis when ``num_axes > 1``. ``[B, N]`` becomes
    ``[B, 1, ..., 1, N]`` so it applies to every head. Integers widen to int64 and floats
    to float64 (exact), so distances never wrap around or round; ``integer=True`` rejects
    floats first. Integers must lie in ``(-2**62, 2**62)`` so every difference fits in int64.
    With ``device`` given, positions must be on it. ``None`` stays None: the caller applies
    its default.
    """
    axes = () if num_axes == 1 else (num_axes,)
    if positions is None:
        return None
    if not isinstance(positions, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"{owner}: {name} must be an integer or float tensor, got dtype={positions.dtype}")
    if integer and positions.is_floating_point():
        raise TypeError(f"{owner}: {name} must be an integer tensor (this encoding has no float positions), "
                        f"got dtype={positions.dtype}")
    core = tuple(positions.shape[: positions.dim() - len(axes)])
    batched = len(core) == 2 and len(lead) >= 1 and core[1] == n and core[0] in (lead[0], 1)
    if tuple(positions.shape[len(core):]) != axes or not (core == (n,) or batched):
        suffix = "".join(f", {a}" for a in axes)
        want = f"[{n}{suffix}]" + (f" or [{lead[0]}, {n}{suffix}]" if lead else "")
        raise ValueError(f"{owner}: {name} must have shape {want}, got {tuple(positions.shape)}")
    if device is not None and positions.device != torch.device(device) and not positions.is_meta:
        raise ValueError(f"{owner}: {name} must be on the device of the inputs ({torch.device(device)}), "
                         f"got {name} on {positions.device}")
    positions = positions.to(torch.float64 if positions.is_floating_point() else torch.long)
    if not positions.is_floating_point() and not _skip_value_checks(positions) and positions.numel() \
            and not (-_LARGEST_POSITION <= positions.min() and positions.max() <= _LARGEST_POSITION):
        bad = positions.max() if positions.max() > _LARGEST_POSITION else positions.min()
        raise ValueError(f"{owner}: {name} must lie in [-2**62 + 1, 2**62 - 1] so that position differences fit "
                         f"in int64, got {int(bad)}")
    if positions.is_floating_point() and not _skip_value_checks(positions) and not torch.isfinite(positions).all():
        raise ValueError(f"{owner}: {name} must be finite, got {positions[~torch.isfinite(positions)][:3].tolist()}")
    if batched:  # [B, N(, A)] -> [B, 1, ..., 1, N(, A)]
        positions = positions.reshape(core[0], *([1] * (len(lead) - 1)), n, *axes)
    return positions


_LARGEST_POSITION = 2**62 - 1


def _skip_value_checks(tensor: Tensor) -> bool:
    """Value-dependent checks are skipped while tracing and on the meta device."""
    return _is_compiling() or tensor.is_meta


def _or_default(owner: str, name: str, positions: Optional[Tensor], n: int, offset: int, device,
                num_axes: int = 1) -> Tensor:
    """``positions`` on ``device``, or ``arange(n) + offset`` (an error for several axes)."""
    offset = _as_int(owner, "offset", offset, minimum=None)
    if positions is not None:
        return positions.to(device)
    if num_axes > 1:
        raise ValueError(f"{owner}: {name} is required for {num_axes} axes, shape [..., {n}, {num_axes}], got None")
    return _default_positions(n, offset, device)


def _token_positions(module: "PositionalEmbedding", positions: Optional[Tensor], x: Tensor, offset: int) -> Tensor:
    """Positions for the tokens of ``x`` ``[..., N, D]``: validated, or ``arange(N) + offset``."""
    owner, n, num_axes = type(module).__name__, x.shape[-2], module.num_axes
    checked = _check_positions(owner, "positions", positions, tuple(x.shape[:-2]), n, num_axes,
                               module.integer_positions, x.device)
    return _or_default(owner, "positions", checked, n, offset, x.device, num_axes)


def _angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Angles ``positions * inv_freq`` in float64, so 1e6 keeps full float32 accuracy.

    positions: [..., N]; inv_freq: [F] -> [..., N, F]
    """
    return positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)


def _inverse_frequencies(dim: int, base: float, device=None) -> Tensor:
    """``base ** (-2i / dim)`` for ``i < dim / 2`` in float64: the Transformer/RoPE spectrum."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim   # [F]
    return base ** -exponents


# ---------------------------------------------------------------------------
# Base class and attention()
# ---------------------------------------------------------------------------


class PositionalEmbedding(nn.Module):
    """Base of every encoding: one interface for token-side and attention-side encodings.

    ``kind`` says where the position enters:

    * ``"input"``: added to token states (``forward_input``);
    * ``"qk"``: queries and keys are transformed before the dot product;
    * ``"bias"``: an additive ``[H, Nq, Nk]`` bias on the logits;
    * ``"logits"``: the logits themselves depend on content and position jointly.

    Subclasses override the hooks ``encode_qk`` and ``attention_bias`` (or, for
    ``"logits"``, ``full_precision_logits``); ``forward_input`` and ``forward_attn`` are
    built from them, and ``attention()`` picks the efficient path from ``kind``.

    Derived tables (frequencies, slopes, caches) are non-persistent buffers built by
    ``_init_buffers``; every ``.to()`` / ``.half()`` / ``to_empty()`` rebuilds them in
    full precision on the new device, so a dtype cast never degrades them.
    """

    kind: str = "input"
    translation_invariant: bool = False  # logits depend only on position differences
    num_axes: int = 1       # position axes A: positions are [..., N] or, for A > 1, [..., N, A]
    integer_positions: bool = False  # positions index buckets, tables or tree nodes: floats are a TypeError

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Tokens with position information; identity for attention-side kinds."""
        return self(x, positions) if self.kind == "input" else x

    def encode_qk(
        self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None, positions_k: Optional[Tensor] = None
    ) -> tuple:
        """Queries and keys carrying position, ready for a dot product (identity by default)."""
        return q, k

    def attention_bias(
        self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None, positions_k: Optional[Tensor] = None,
        *, device=None,
    ) -> Optional[Tensor]:
        """Additive float32 bias ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for batched positions), or None."""
        return None

    def forward_attn(
        self,
        q: Tensor,
        k: Tensor,
        positions_q: Optional[Tensor] = None,
        positions_k: Optional[Tensor] = None,
        *,
        scale: Optional[float] = None,
    ) -> Tensor:
        """Pre-mask, pre-softmax logits ``scale * <q', k'> + bias``: [B, H, Nq, Nk]."""
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k)
        q, k = self.encode_qk(q, k, positions_q, positions_k)
        scale = self.logit_scale(q.shape[-1]) if scale is None else scale
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale                          # [B, H, Nq, Nk]
        bias = self.attention_bias(q.shape[-2], k.shape[-2], positions_q, positions_k, device=q.device)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def full_precision_logits(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                              positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """``forward_attn`` before any cast to the input dtype (``attention()`` softmaxes these)."""
        return self.forward_attn(q, k, positions_q, positions_k, scale=scale)

    def attention_values(self, weights: Tensor, positions_q: Optional[Tensor] = None,
                         positions_k: Optional[Tensor] = None) -> Optional[Tensor]:
        """A positional term added to the attention output, or None (the default).

        ``"logits"`` kinds only: ``attention()`` calls it with the masked, normalised (and
        dropped-out) float32 weights ``[B, H, Nq, Nk]`` and the positions it was given, and
        adds the result ``[B, H, Nq, Dv]`` to ``weights @ v`` (Shaw et al.'s value term).
        """
        return None

    def _check_qk(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor],
                  positions_k: Optional[Tensor], grouped: bool = False) -> tuple:
        """Validate q, k and their positions; return the positions broadcastable (or None).
        ``grouped``: k may have fewer heads than q (attention()'s grouped-query path)."""
        owner = type(self).__name__
        _check_qk(owner, q, k, grouped)
        self._check_heads(q)
        lead = tuple(q.shape[:-2])
        integer = self.integer_positions
        positions_q = _check_positions(owner, "positions_q", positions_q, lead, q.shape[-2], self.num_axes, integer,
                                       q.device)
        positions_k = _check_positions(owner, "positions_k", positions_k, lead, k.shape[-2], self.num_axes, integer,
                                       k.device)
        if self.num_axes > 1 and self.kind != "input" and (positions_q is None or positions_k is None):
            raise ValueError(f"{owner}: positions_q and positions_k are required for {self.num_axes} axes "
                             f"(shape [N, {self.num_axes}] or [B, N, {self.num_axes}]), got None")
        batched = any(p is not None and p.dim() > (1 if self.num_axes == 1 else 2) for p in (positions_q, positions_k))
        if batched and getattr(self, "num_heads", None) and q.dim() < 4:
            raise ValueError(f"{owner}: [B, N] positions need q and k of shape [B, ..., H, N, Dh], "
                             f"got q {tuple(q.shape)}")
        return positions_q, positions_k

    def _check_heads(self, x: Tensor, name: str = "q and k") -> None:
        """Per-head encodings: x must be [..., H, N, Dh] with this module's H (and Dh)."""
        heads, head_dim = getattr(self, "num_heads", None), getattr(self, "head_dim", None)
        if heads is None or self.kind == "input":
            return
        if x.dim() < 3 or x.shape[-3] != heads or (head_dim is not None and x.shape[-1] != head_dim):
            want = f"[..., H={heads}, N, Dh{'' if head_dim is None else f'={head_dim}'}]"
            raise ValueError(f"{type(self).__name__}: {name} must be {want}, got {tuple(x.shape)}")

    def logit_scale(self, head_dim: int) -> float:
        """The default logit scale: ``1 / sqrt(Dh)`` as in SDPA (TUPE overrides it)."""
        return head_dim ** -0.5

    def reset_parameters(self) -> None:
        """Re-initialise parameters and rebuild every derived buffer."""
        self._init_buffers(self._buffer_device())

    def _init_buffers(self, device) -> None:
        """Build the derived (non-persistent) buffers on ``device``; nothing by default."""

    def _buffer_device(self):
        for tensor in self.parameters(recurse=False):
            return tensor.device
        for tensor in self.buffers(recurse=False):
            return tensor.device
        return None

    def _apply(self, fn, recurse=True):
        # Moves and casts go through here; rebuild derived tables at full precision
        # afterwards (a plain Module would round them to bf16 on .bfloat16()).
        super()._apply(fn, recurse)
        if any(True for _ in self.buffers(recurse=False)):
            self._init_buffers(self._buffer_device())
        return self


def _check_qk(owner: str, q: Tensor, k: Tensor, grouped: bool = False) -> None:
    """q: [..., Nq, Dh], k: [..., Nk, Dh] with matching leading dims and Dh; with ``grouped``,
    k may have fewer heads (dim -3) than q, dividing them (grouped-query attention)."""
    _check_tensor(owner, "q", q, 2)
    _check_tensor(owner, "k", k, 2)
    heads_ok = q.shape[:-3] == k.shape[:-3] and q.dim() >= 3 and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0
    if grouped and q.dim() == k.dim() and q.shape[-3:-2] != k.shape[-3:-2] and not heads_ok:
        raise ValueError(f"{owner}: k and v must have as many heads as q or divide them (grouped-query attention), "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    same_lead = q.shape[:-2] == k.shape[:-2] or (grouped and heads_ok)
    if not same_lead or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{owner}: q and k must agree on leading dims and head dim, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    _check_same_kind(owner, "k", k, "q", q)


def _check_same_kind(owner: str, name: str, value: Tensor, reference_name: str, reference: Tensor) -> None:
    """``value`` has ``reference``'s dtype and device (no silent promotion or transfer)."""
    if value.dtype != reference.dtype or value.device != reference.device:
        raise ValueError(f"{owner}: {name} must have the dtype and device of {reference_name} "
                         f"({reference.dtype} on {reference.device}), got {value.dtype} on {value.device}")


def _causal_mask(q_len: int, k_len: int, device) -> Tensor:
    """Boolean [Nq, Nk]; True where key j may be seen by query i (bottom-right aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(_query_offset(q_len, k_len))


def _check_mask(attn_mask: Optional[Tensor], q: Tensor, k: Tensor) -> None:
    """attention(): a boolean or float mask broadcastable to [..., Nq, Nk]."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        kind = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise TypeError(f"attention: attn_mask must be a bool (True = attend) or float (additive) tensor, got {kind}")
    try:
        torch.broadcast_shapes(attn_mask.shape, (*q.shape[:-1], k.shape[-2]))
    except RuntimeError:
        raise ValueError(f"attention: attn_mask must broadcast to {[*q.shape[:-1], k.shape[-2]]}, "
                         f"got {list(attn_mask.shape)}") from None


def _merge_masks(bias: Optional[Tensor], attn_mask: Optional[Tensor], causal: bool,
                 q_len: int, k_len: int, dtype: torch.dtype, device) -> Optional[Tensor]:
    """One additive float mask (or boolean mask, or None) from a bias, a user mask and causality."""
    mask = bias
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else mask.masked_fill(~attn_mask, float("-inf"))
        else:
            mask = attn_mask if mask is None else mask + attn_mask
    if causal:
        allowed = _causal_mask(q_len, k_len, device)
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    return mask


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pe: Optional[PositionalEmbedding] = None,
    *,
    positions_q: Optional[Tensor] = None,
    positions_k: Optional[Tensor] = None,
    causal: bool = False,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    use_flex: Optional[bool] = None,
    document_ids: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention with positional encoding ``pe``, through the cheapest correct path.

    ``"input"`` encodings (already added to the tokens) and ``pe=None`` run plain
    ``scaled_dot_product_attention``; ``"qk"`` encodings transform q and k and then
    run SDPA; ``"bias"`` encodings pass their bias as a float mask to SDPA;
    ``"logits"`` encodings compute their logits explicitly and apply the softmax.

    Grouped-query and multi-query attention: k and v may have fewer heads than q
    (``Hq % Hkv == 0``; query head ``h`` reads key head ``h // (Hq / Hkv)``). Encodings that
    do not depend on the head (RoPE, input kinds, biases) run SDPA's own grouped path with
    k and v as given; per-head ``"qk"`` / ``"logits"`` encodings see k and v repeated per
    query head.

    Packed sequences: ``document_ids`` ``[N]`` or ``[B, N]`` (self-attention, ``Nq == Nk``)
    stops every token from attending across documents, and default positions restart at 0
    in every document (``document_positions``); explicit positions win.

    Args:
        q (Tensor): queries ``[B, H, Nq, Dh]``.
        k (Tensor): keys ``[B, Hkv, Nk, Dh]``.
        v (Tensor): values ``[B, Hkv, Nk, Dv]``.
        pe (PositionalEmbedding, optional): the encoding. Default: None.
        positions_q, positions_k (Tensor, optional): ``[N]`` or ``[B, N]`` positions.
            Default: keys ``arange(Nk)``, queries the last ``Nq`` of them.
        causal (bool): mask keys after each query, bottom-right aligned when
            ``Nq < Nk`` (decoding with a cache). Index based, not position based.
            Default: False.
        attn_mask (Tensor, optional): boolean (True = attend) or additive float mask
            broadcastable to ``[B, H, Nq, Nk]``. Default: None.
        scale (float, optional): logit scale. Default: ``1 / sqrt(Dh)`` (the encoding's own
            default where it has one).
        dropout_p (float): dropout on the attention weights, in ``[0, 1)``. Default: 0.0.
        use_flex (bool, optional): run ``"bias"`` encodings through FlexAttention with
            their ``score_mod`` (no dense bias). None: on CUDA when there is no
            ``attn_mask``, no dropout and no ``document_ids``; True: also on the CPU (eager
            FlexAttention, for testing). Default: None.
        document_ids (Tensor, optional): integer ``[N]`` or ``[B, N]`` ids of the packed
            documents, contiguous runs of equal ids. Default: None.

    Shape:
        - Output: ``[B, H, Nq, Dv]``.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> q, k, v = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)
        >>> attention(q, k, v, rope, causal=True).shape
        torch.Size([2, 8, 16, 64])
    """
    owner = "attention"
    group = _check_attention_inputs(q, k, v, pe)
    causal = _check_flag(owner, "causal", causal)
    dropout_p = _as_float(owner, "dropout_p", dropout_p, minimum=0.0, maximum=1.0)
    scale = None if scale is None else _as_float(owner, "scale", scale)
    if use_flex is not None:
        use_flex = _check_flag(owner, "use_flex", use_flex)
    _check_mask(attn_mask, q, k)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if document_ids is not None:
        same_document = _document_mask(q, k, document_ids)                              # [(B, 1, ..,) N, N] bool
        if attn_mask is None or attn_mask.dtype == torch.bool:
            attn_mask = same_document if attn_mask is None else attn_mask & same_document
        else:
            attn_mask = attn_mask.masked_fill(~same_document, float("-inf"))
        if pe is not None and pe.kind != "input" and positions_q is None and positions_k is None:
            positions_q = positions_k = document_positions(document_ids)
    if group > 1 and pe is not None and pe.kind in ("qk", "logits") and getattr(pe, "num_heads", None):
        k, v, group = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3), 1   # per-head maps
    if pe is not None and pe.kind == "logits":
        return _explicit_attention(q, k, v, pe, positions_q, positions_k, causal, attn_mask, scale, dropout_p)
    if pe is not None and pe.kind == "bias" and attn_mask is None and dropout_p == 0.0 \
            and (use_flex or (use_flex is None and q.is_cuda)):
        pe._check_qk(q, k, positions_q, positions_k, grouped=True)
        scale = pe.logit_scale(q.shape[-1]) if scale is None else scale
        return _flex_attention(q, k, v, pe, positions_q, positions_k, causal, scale)
    bias = None
    if pe is not None:
        scale = pe.logit_scale(q.shape[-1]) if scale is None else scale
        positions_q, positions_k = pe._check_qk(q, k, positions_q, positions_k, grouped=True)
        q, k = pe.encode_qk(q, k, positions_q, positions_k)
        bias = pe.attention_bias(q_len, k_len, positions_q, positions_k, device=q.device)
    gqa = {"enable_gqa": True} if group > 1 else {}
    if bias is None and attn_mask is None and causal and q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa)
    mask = _merge_masks(bias, attn_mask, causal, q_len, k_len, q.dtype, q.device)
    if mask is not None and mask.dim() < q.dim():  # SDPA's fused CPU kernel wants a mask with q's rank
        mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **gqa)


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, pe) -> int:
    """Validate attention()'s tensors and encoding; return the query heads per key head."""
    owner = "attention"
    _check_qk(owner, q, k, grouped=True)
    _check_tensor(owner, "v", v, 2)
    _check_same_kind(owner, "v", v, "q", q)
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{owner}: v must match k on every dim but the last, got v {tuple(v.shape)} and k {tuple(k.shape)}")
    if pe is not None and not isinstance(pe, PositionalEmbedding):
        raise TypeError(f"{owner}: pe must be a PositionalEmbedding or None, got {type(pe).__name__}")
    return q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, pe: PositionalEmbedding, positions_q, positions_k,
                        causal: bool, attn_mask: Optional[Tensor], scale: Optional[float], dropout_p: float) -> Tensor:
    """The "logits" path: the encoding's float32 logits, masks, a float32 softmax, weights @ v."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    logits = pe.full_precision_logits(q, k, positions_q, positions_k, scale=scale)      # [B, H, Nq, Nk] float32
    mask = _merge_masks(None, attn_mask, causal, q_len, k_len, logits.dtype, q.device)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    # a fully masked row gives 0 (as SDPA does), not NaN
    weights = torch.softmax(logits, dim=-1).nan_to_num(nan=0.0)                        # [B, H, Nq, Nk]
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights.to(v.dtype), v)                                          # [B, H, Nq, Dv]
    extra = pe.attention_values(weights, positions_q, positions_k)                      # [B, H, Nq, Dv] or None
    return out if extra is None else out + extra.to(out.dtype)


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, pe: PositionalEmbedding, positions_q, positions_k,
                    causal: bool, scale: float) -> Tensor:
    """FlexAttention with the encoding's ``score_mod`` (and the bottom-right causal mask).

    FlexAttention takes ``[B, H, N, Dh]``: other ranks are viewed as that (``[H, N, Dh]`` as
    one batch, ``[B, G, H, N, Dh]`` as ``B * G`` batches, ``[B, N]`` positions repeated).
    """
    from torch.nn.attention.flex_attention import flex_attention

    lead = q.shape[:-3]
    batch = math.prod(lead) if lead else 1
    if q.dim() != 4:
        q, k, v = (t.reshape(batch, *t.shape[-3:]) for t in (q, k, v))
        per_row = batch // (lead[0] if lead else 1)

        def rows(p: Optional[Tensor]) -> Optional[Tensor]:                             # [B, N] -> [B * G, N]
            return p.repeat_interleave(per_row, dim=0) if isinstance(p, Tensor) and p.dim() == 2 else p
        positions_q, positions_k = rows(positions_q), rows(positions_k)
    add_bias = pe.score_mod(q.shape[-2], k.shape[-2], positions_q, positions_k)
    offset = _query_offset(q.shape[-2], k.shape[-2])

    def score_mod(score, b, h, q_idx, kv_idx):
        score = add_bias(score, b, h, q_idx, kv_idx)
        return torch.where(kv_idx > q_idx + offset, float("-inf"), score) if causal else score

    out = flex_attention(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
    return out.reshape(*lead, *out.shape[-3:])


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions that restart at 0 in every packed document: ``[N]`` or ``[B, N]`` int64.

    Documents are contiguous runs of equal ids (``[0, 0, 0, 1, 1, 2]`` gives
    ``[0, 1, 2, 0, 1, 0]``). Pass them to ``forward_input`` of input encodings; ``attention(...,
    document_ids=...)`` uses them by default for attention-side encodings.

    Example:
        >>> document_positions(torch.tensor([7, 7, 7, 3, 3, 9]))
        tensor([0, 1, 2, 0, 1, 0])
    """
    ids = _check_document_ids("document_positions", document_ids)
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)              # [(B,) N]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    start_of_run = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_of_run


def _check_document_ids(owner: str, document_ids) -> Tensor:
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or document_ids.is_complex() \
            or document_ids.dtype == torch.bool:
        raise TypeError(f"{owner}: document_ids must be an integer tensor [N] or [B, N], got {_describe(document_ids)}")
    if document_ids.dim() not in (1, 2):
        raise ValueError(f"{owner}: document_ids must have shape [N] or [B, N], got {tuple(document_ids.shape)}")
    return document_ids.long()


def _document_mask(q: Tensor, k: Tensor, document_ids: Tensor) -> Tensor:
    """Boolean ``[N, N]`` (``[B, 1, .., N, N]`` for ``[B, N]`` ids): True within a document."""
    owner = "attention"
    ids = _check_document_ids(owner, document_ids)
    n = q.shape[-2]
    if k.shape[-2] != n or ids.shape[-1] != n or (ids.dim() == 2 and ids.shape[0] not in (1, q.shape[0])) \
            or (ids.dim() == 2 and q.dim() < 3):
        raise ValueError(f"{owner}: document_ids need self-attention (Nq == Nk) and shape [{n}] or "
                         f"[{q.shape[0]}, {n}], got ids {tuple(ids.shape)} for q {tuple(q.shape)} and k {tuple(k.shape)}")
    if ids.device != q.device:
        raise ValueError(f"{owner}: document_ids must be on {q.device}, got {ids.device}")
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)                                       # [(B,) N, N]
    if ids.dim() == 2:
        same = same.reshape(ids.shape[0], *([1] * (q.dim() - 3)), n, n)
    return same


# ---------------------------------------------------------------------------
# Absolute encodings: sinusoidal, learned
# ---------------------------------------------------------------------------


class SinusoidalPositionalEmbedding(PositionalEmbedding):
    """Fixed sinusoidal encoding added to the tokens (Vaswani et al., 2017, arXiv:1706.03762).

    ``PE[p, 2i] = sin(p / base**(2i/dim))`` and ``PE[p, 2i+1] = cos(p / base**(2i/dim))``
    (``layout="interleaved"``, the paper's formula); ``layout="concat"`` puts all sines
    first, then all cosines (Transformer-XL, tensor2tensor). Positions may be any
    integers or floats, negatives included, and there is no maximum length: angles are
    computed in float64, so position 1e6 keeps float32 accuracy.

    With ``num_axes = A > 1`` positions are ``[..., N, A]`` (images, video) and the
    channels split into ``A`` equal slices, slice ``a`` holding the 1-D encoding of
    width ``dim / A`` of axis ``a`` (MAE's 2-D sin-cos table for ``A = 2``).

    Args:
        dim (int): embedding width ``D``; a multiple of ``2 * num_axes``.
        base (float): wavelength base. Default: 10000.0.
        layout (str): ``"interleaved"`` or ``"concat"``. Default: ``"interleaved"``.
        num_axes (int): position axes ``A``. Default: 1.

    Shape:
        - x: ``[..., N, D]``; positions: ``[N]`` or ``[B, N]`` (``[N, A]`` or ``[B, N, A]``).
        - Output of ``forward`` and of ``embed``: ``[..., N, D]``.

    Example:
        >>> pe = SinusoidalPositionalEmbedding(512)
        >>> pe(torch.randn(2, 100, 512)).shape
        torch.Size([2, 100, 512])
    """

    kind = "input"

    def __init__(self, dim: int, *, base: float = 10000.0,
                 layout: Literal["interleaved", "concat"] = "interleaved", num_axes: int = 1) -> None:
        super().__init__()
        owner = type(self).__name__
        num_axes = _check_positive_int(owner, "num_axes", num_axes)
        dim = _check_positive_int(owner, "dim", dim)
        if dim % (2 * num_axes):
            raise ValueError(f"{owner}: dim must be a positive multiple of 2 * num_axes = {2 * num_axes}, "
                             f"got dim={dim!r}")
        _check_base(owner, base)
        _check_choice(owner, "layout", layout, ("interleaved", "concat"))
        self.dim, self.base, self.layout, self.num_axes = dim, float(base), layout, num_axes

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, layout={self.layout!r}, num_axes={self.num_axes}"

    def embed(self, positions: Tensor) -> Tensor:
        """The encoding of ``positions`` ``[..., N]`` (``[..., N, A]``): float32 ``[..., N, D]``.

        float64 positions give a float64 table.
        """
        owner = type(self).__name__
        if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
            raise TypeError(f"{owner}: positions must be an integer or float tensor, got "
                            f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
        axes = 1 if self.num_axes > 1 else 0
        if positions.dim() < 1 + axes or (axes and positions.shape[-1] != self.num_axes):
            raise ValueError(f"{owner}: positions must have shape [..., N]{'' if not axes else f' + [{self.num_axes}]'}"
                             f", got {tuple(positions.shape)}")
        if self.num_axes == 1:
            return self._encode_axis(positions, self.dim)
        width = self.dim // self.num_axes
        return torch.cat([self._encode_axis(positions[..., a], width) for a in range(self.num_axes)], dim=-1)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x + embed(positions)``; default positions ``arange(N) + offset``."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.dim)
        return x + self.embed(_token_positions(self, positions, x, offset)).to(x.dtype)

    def _encode_axis(self, positions: Tensor, width: int) -> Tensor:
        """One axis: positions [..., N] -> [..., N, width]."""
        angles = _angles(positions, _inverse_frequencies(width, self.base, positions.device))   # [..., N, F]
        dtype = torch.float64 if positions.dtype == torch.float64 else torch.float32
        sin, cos = angles.sin().to(dtype), angles.cos().to(dtype)
        if self.layout == "concat":
            return torch.cat([sin, cos], dim=-1)                                         # [..., N, width]
        return torch.stack([sin, cos], dim=-1).flatten(-2)                              # [..., N, width]


class LearnedPositionalEmbedding(PositionalEmbedding):
    """Learned absolute position table added to the tokens (BERT, GPT-2, ViT).

    Devlin et al., "BERT", arXiv:1810.04805. Row ``p`` of ``weight`` is the embedding
    of position ``p``; positions outside ``[0, max_len)`` raise ``ValueError`` (never an
    IndexError or a device-side assert). ``resize`` interpolates the table to a new
    length, or, for a ViT-style 2-D patch grid, to a new ``(h, w)``.

    Args:
        max_len (int): number of positions in the table.
        dim (int): embedding width ``D``.
        init_std (float): standard deviation of the normal init (BERT/GPT-2). Default: 0.02.

    Shape:
        - x: ``[..., N, D]``; positions: integer ``[N]`` or ``[B, N]``.
        - Output: ``[..., N, D]``.

    Example:
        >>> pe = LearnedPositionalEmbedding(512, 768)
        >>> pe(torch.randn(2, 100, 768)).shape
        torch.Size([2, 100, 768])
    """

    kind = "input"
    integer_positions = True

    def __init__(self, max_len: int, dim: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        owner = type(self).__name__
        max_len, dim = _check_positive_int(owner, "max_len", max_len), _check_positive_int(owner, "dim", dim)
        self.max_len, self.dim = max_len, dim
        self.init_std = _as_float(owner, "init_std", init_std, minimum=0.0)
        self.weight = nn.Parameter(torch.empty(max_len, dim))                            # [max_len, D]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def embed(self, positions: Tensor) -> Tensor:
        """Rows of the table for integer ``positions`` ``[..., N]``: ``[..., N, D]``."""
        _check_table_range(type(self).__name__, "positions", positions, self.max_len)
        return F.embedding(positions, self.weight)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x + embed(positions)``; default positions ``arange(N) + offset``."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.dim)
        return x + self.embed(_token_positions(self, positions, x, offset)).to(x.dtype)

    @torch.no_grad()
    def resize(self, new_size: Union[int, tuple], *, old_grid: Optional[tuple] = None,
               num_prefix_tokens: int = 0, mode: Optional[str] = None) -> "LearnedPositionalEmbedding":
        """Interpolate the table (in float32) to ``new_size`` positions, in place.

        ``new_size`` an int: 1-D linear interpolation along positions. ``new_size`` a
        ``(h, w)`` tuple: the table is a ViT patch grid of shape ``old_grid`` (default:
        square) and is resampled bicubically, as when fine-tuning at a new resolution.
        The first ``num_prefix_tokens`` rows (a ``[CLS]`` token) are kept as they are.

        Returns ``self``.
        """
        owner = type(self).__name__
        num_prefix_tokens = _as_int(owner, "num_prefix_tokens", num_prefix_tokens, minimum=0)
        if num_prefix_tokens >= self.max_len:
            raise ValueError(f"{owner}: num_prefix_tokens must be < max_len={self.max_len}, "
                             f"got num_prefix_tokens={num_prefix_tokens}")
        if mode is not None:
            _check_choice(owner, "mode", mode, ("nearest", "linear", "bilinear", "bicubic", "area", "nearest-exact"))
        if isinstance(new_size, (list, tuple)):
            new_size = tuple(_as_int(owner, "new_size", size) for size in new_size)
        elif not isinstance(new_size, Tensor):
            new_size = _as_int(owner, "new_size", new_size)
        prefix, table = self.weight[:num_prefix_tokens], self.weight[num_prefix_tokens:].float()  # [L, D]
        if isinstance(new_size, int) and new_size > num_prefix_tokens:
            rows = F.interpolate(table.T[None], size=new_size - num_prefix_tokens,
                                 mode=mode or "linear", align_corners=False)[0].T           # [new, D]
        elif isinstance(new_size, tuple) and len(new_size) == 2:
            old_grid = old_grid or (math.isqrt(table.shape[0]),) * 2
            if old_grid[0] * old_grid[1] != table.shape[0]:
                raise ValueError(f"{owner}: old_grid must multiply to {table.shape[0]} rows "
                                 f"(max_len - num_prefix_tokens), got old_grid={old_grid}")
            grid = table.T.reshape(1, self.dim, *old_grid)                                  # [1, D, h0, w0]
            grid = F.interpolate(grid, size=new_size, mode=mode or "bicubic", align_corners=False)
            rows = grid.reshape(self.dim, -1).T                                             # [h*w, D]
        else:
            raise ValueError(f"{owner}: new_size must be an int > num_prefix_tokens or an (h, w) tuple "
                             f"of positive ints, got new_size={new_size!r}")
        self.weight = nn.Parameter(torch.cat([prefix, rows.to(self.weight.dtype)]))
        self.max_len = self.weight.shape[0]
        return self


# ---------------------------------------------------------------------------
# Rotary position embedding and its scaling functions
# ---------------------------------------------------------------------------
#
# Every scaling function has one signature,
#     fn(dim, base, params, seq_len) -> (inv_freq [dim/2] float64, attention_factor)
# where ``params`` is a Hugging Face ``rope_parameters`` dict and ``seq_len`` is
# ``max(position) + 1`` of the current call (None at construction; an int in eager,
# a 0-d tensor under torch.compile). The formulas follow the papers and Hugging Face's
# definitions (``modeling_rope_utils.py``), computed in float64.


def _rope_default(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """Su et al.: ``theta_i = base ** (-2i / dim)``."""
    return _inverse_frequencies(dim, base), 1.0


def _rope_linear(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): positions / factor."""
    return _inverse_frequencies(dim, base) / params["factor"], 1.0


def _rope_dynamic(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """Dynamic NTK: the base grows with the current length ``L > M`` (``M`` the trained length).

    ``base' = base * (factor * L / M - (factor - 1)) ** (dim / (dim - 2))``; unchanged for ``L <= M``.
    """
    reference = params.get("original_max_position_embeddings", params.get("max_position_embeddings"))
    if seq_len is None:
        return _inverse_frequencies(dim, base), 1.0
    length = torch.clamp(torch.as_tensor(seq_len, dtype=torch.float64), min=reference)
    new_base = base * (params["factor"] * length / reference - (params["factor"] - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=new_base.device) / dim
    return new_base ** -exponents, 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_yarn(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): interpolate slow pairs, keep fast ones, ramp between.

    Pair ``i`` keeps its frequency below the correction index of ``beta_fast`` rotations over
    the original length, is divided by ``factor`` above that of ``beta_slow``, and is mixed
    linearly in between; cos and sin are scaled by the attention factor ``0.1 ln(factor) + 1``.
    """
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def correction_index(rotations: float) -> float:  # pair whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_index(params.get("beta_fast") or 32)
    high = correction_index(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)    # [F]
    inv_freq = _inverse_frequencies(dim, base)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention_factor


def _rope_longrope(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753): per-pair rescale factors, long ones past the original length."""
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        factor = params.get("factor") or params["max_position_embeddings"] / original
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(params["short_factor"], dtype=torch.float64)
    long = torch.tensor(params["long_factor"], dtype=torch.float64)
    if seq_len is None:
        rescale = short
    else:
        rescale = torch.where(torch.as_tensor(seq_len) > original, long, short)
    return _inverse_frequencies(dim, base) / rescale, attention_factor


def _rope_llama3(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """Llama 3.1: wavelengths above ``L / low_freq_factor`` are divided by ``factor``, below
    ``L / high_freq_factor`` kept, and smoothly interpolated in between (``L`` the original length)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    inv_freq = _inverse_frequencies(dim, base)
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0


def _rope_proportional(dim: int, base: float, params: dict, seq_len=None) -> tuple:
    """Gemma 4's proportional RoPE: the first ``partial_rotary_factor`` of the pairs keep the
    spectrum of the full head dim, the rest get frequency 0 (they pass unrotated); all / ``factor``."""
    rotated = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    inv_freq = _inverse_frequencies(dim, base)
    inv_freq[rotated:] = 0.0
    return inv_freq / params.get("factor", 1.0), 1.0


ROPE_SCALING = {
    "default": _rope_default,
    "linear": _rope_linear,
    "dynamic": _rope_dynamic,
    "yarn": _rope_yarn,
    "longrope": _rope_longrope,
    "llama3": _rope_llama3,
    "proportional": _rope_proportional,
}
"""The RoPE frequency functions by Hugging Face ``rope_type``: ``fn(dim, base, params, seq_len) ->
(inv_freq [dim / 2] float64, attention_factor)``. ``RotaryPositionalEmbedding(scaling=...)`` picks
one; it is public so the frequencies can be inspected or reused outside the class."""

# Keys each rope_type needs (a tuple is "one of"), and the optional ones it understands.
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", ("original_max_position_embeddings", "max_position_embeddings")),
    "yarn": ("original_max_position_embeddings", ("factor", "max_position_embeddings")),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor",
                 ("factor", "max_position_embeddings", "attention_factor")),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "proportional": (),
}
_ROPE_OPTIONAL = {
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "max_position_embeddings",
    "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "truncate", "short_factor", "long_factor", "low_freq_factor", "high_freq_factor",
    "mrope_section", "mrope_interleaved",
}
_ROPE_LENGTHS = ("original_max_position_embeddings", "max_position_embeddings")
_ROPE_POSITIVE = ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor",
                  "partial_rotary_factor")
_LENGTH_DEPENDENT = {"dynamic", "longrope"}


def _check_scaling(owner: str, scaling: Optional[dict], base: float) -> dict:
    """Validate a ``rope_parameters`` dict; return a normalised copy with ``rope_type`` set.

    ``None`` values count as absent (Hugging Face configs carry them); ``rope_type`` wins over
    the legacy ``type`` (as in transformers), and the legacy ``"mrope"`` type is default RoPE
    whose ``mrope_section`` gives the sections. Every value is type- and range-checked.
    """
    if scaling is None:
        return {"rope_type": "default"}
    if not isinstance(scaling, dict):
        raise TypeError(f"{owner}: scaling must be a dict in Hugging Face rope_parameters format or None, "
                        f"got {type(scaling).__name__}")
    params = {key: value for key, value in scaling.items() if value is not None}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params["rope_type"] = "default" if rope_type == "mrope" else rope_type
    if params["rope_type"] not in ROPE_SCALING:
        raise ValueError(f"{owner}: scaling['rope_type'] must be one of {sorted(ROPE_SCALING)} (or the legacy "
                         f"'mrope'), got {rope_type!r}")
    unknown = sorted(set(params) - _ROPE_OPTIONAL)
    if unknown:
        raise ValueError(f"{owner}: scaling has unknown keys {unknown}; allowed keys: {sorted(_ROPE_OPTIONAL)}")
    for need in _ROPE_REQUIRED[params["rope_type"]]:
        options = need if isinstance(need, tuple) else (need,)
        if all(key not in params for key in options):
            raise ValueError(f"{owner}: scaling with rope_type={rope_type!r} needs "
                             f"{' or '.join(repr(key) for key in options)}, got keys {sorted(params)}")
    for key in _ROPE_POSITIVE:
        if key in params:
            params[key] = _as_float(owner, f"scaling[{key!r}]", params[key], minimum=0.0, exclusive=True)
    for key in ("mscale", "mscale_all_dim"):
        if key in params:
            params[key] = _as_float(owner, f"scaling[{key!r}]", params[key], minimum=0.0)
    for key in _ROPE_LENGTHS:
        if key in params:
            params[key] = _check_positive_int(owner, f"scaling[{key!r}]", params[key])
    for key in ("truncate", "mrope_interleaved"):
        if key in params:
            params[key] = _check_flag(owner, f"scaling[{key!r}]", params[key])
    for key in ("short_factor", "long_factor"):
        if key in params:
            params[key] = [_as_float(owner, f"scaling[{key!r}]", value, minimum=0.0, exclusive=True)
                           for value in _as_list(owner, f"scaling[{key!r}]", params[key])]
    if "mrope_section" in params:
        params["mrope_section"] = [_check_positive_int(owner, "scaling['mrope_section']", size)
                                   for size in _as_list(owner, "scaling['mrope_section']", params["mrope_section"])]
    if "low_freq_factor" in params and "high_freq_factor" in params \
            and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(f"{owner}: scaling['high_freq_factor'] must exceed scaling['low_freq_factor'], got "
                         f"{params['high_freq_factor']} and {params['low_freq_factor']}")
    if "rope_theta" in params and _as_float(owner, "scaling['rope_theta']", params["rope_theta"]) != float(base):
        raise ValueError(f"{owner}: scaling['rope_theta']={params['rope_theta']} disagrees with base={base}")
    return params


def _as_list(owner: str, name: str, value) -> list:
    """A list or tuple (a string is not a list of numbers)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}: {name} must be a list, got {type(value).__name__} {_describe(value)}")
    return list(value)


def _rotary_layout(owner: str, dim: int, rotary_dim: Optional[int], params: dict, sections: Optional[list],
                   section_layout: str) -> tuple:
    """Reconcile ``rotary_dim``, ``sections`` and ``section_layout`` with the scaling dict.

    ``partial_rotary_factor`` in the dict (where transformers 5.x keeps it) sets
    ``rotary_dim = int(dim * factor)`` unless ``rotary_dim`` is given, which must then agree;
    ``proportional`` rotates every channel (the unrotated pairs get frequency 0) and takes its
    proportion from either; ``mrope_section`` / ``mrope_interleaved`` give the sections.
    Returns ``(rotary_dim, sections, section_layout)``.
    """
    factor = params.get("partial_rotary_factor")
    if factor is not None and rotary_dim is not None and int(dim * factor) != rotary_dim:
        raise ValueError(f"{owner}: rotary_dim={rotary_dim} disagrees with scaling['partial_rotary_factor']={factor} "
                         f"(dim * factor = {int(dim * factor)}); give one of them")
    if params["rope_type"] == "proportional":
        if factor is None and rotary_dim is not None:
            params["partial_rotary_factor"] = rotary_dim / dim
        rotary_dim = dim
    elif factor is not None:
        rotary_dim = int(dim * factor)
    rotary_dim = dim if rotary_dim is None else rotary_dim
    if "mrope_section" in params:
        if sections is not None and list(sections) != params["mrope_section"]:
            raise ValueError(f"{owner}: sections={sections} disagrees with scaling['mrope_section']="
                             f"{params['mrope_section']}")
        sections = params["mrope_section"]
    if params.get("mrope_interleaved"):
        section_layout = "interleaved"
    return rotary_dim, sections, section_layout


def _pair_views(x: Tensor, interleaved: bool) -> tuple:
    """The two members of every rotated pair: (2i, 2i+1) interleaved, (i, i + R/2) half-split."""
    return (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def _complex_viewable(t: Tensor) -> bool:
    """Whether the last dim of ``t`` can be viewed as complex pairs without a copy."""
    return (t.dtype in (torch.float32, torch.float64) and t.stride(-1) == 1 and t.storage_offset() % 2 == 0
            and all(s % 2 == 0 for s in t.stride()[:-1]))


def _rotate_pairs_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, interleaved: bool) -> None:
    """Write ``x`` with every pair rotated by its angle into ``out`` (eager fast path).

    x, out: [..., N, R]; cos, sin: [..., N, R/2] (broadcastable), float32 or float64.
    Interleaved float inputs take one complex multiply; otherwise one multiply per pair
    member and one fused multiply-add over the whole width, with no temporaries.
    """
    if interleaved and x.dtype == out.dtype and _complex_viewable(x) and _complex_viewable(out):
        as_complex = lambda t: torch.view_as_complex(t.unflatten(-1, (-1, 2)))            # [..., N, R/2]
        torch.mul(as_complex(x), torch.complex(cos, sin), out=as_complex(out))
        return
    a, b = _pair_views(x, interleaved)
    out_a, out_b = _pair_views(out, interleaved)
    torch.mul(b, -sin, out=out_a)        # -b sin
    torch.mul(a, sin, out=out_b)         #  a sin
    cos_full = cos.repeat_interleave(2, dim=-1) if interleaved else torch.cat([cos, cos], dim=-1)  # [..., N, R]
    out.addcmul_(x, cos_full)            # + (a cos, b cos): one contiguous fused multiply-add


def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """The same rotation, out of place (for torch.compile, which fuses it into one kernel)."""
    a, b = _pair_views(x, interleaved)
    a, b = a * cos - b * sin, b * cos + a * sin
    return torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)


class _RotateFunction(torch.autograd.Function):
    """Rotation of the first ``R`` channels (the rest pass through) in the compute dtype.

    Forward uses the allocation-free path; the backward of a rotation is the rotation
    by minus the angle, so it runs the same fast path with ``-sin``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.rotary_dim = interleaved, rotary_dim
        out = torch.empty(x.shape, dtype=cos.dtype, device=x.device)                   # [..., N, Dh]
        if rotary_dim < x.shape[-1]:
            out[..., rotary_dim:] = x[..., rotary_dim:]
        _rotate_pairs_into(x[..., :rotary_dim], cos, sin, out[..., :rotary_dim], interleaved)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        grad_x = _RotateFunction.apply(grad, cos, -sin, ctx.interleaved, ctx.rotary_dim)
        return grad_x, None, None, None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int) -> Tensor:
    """Rotate the pairs of the first ``rotary_dim`` channels of x [..., N, Dh] (the rest pass),
    cos/sin [..., N, R/2] in the compute dtype -> x's dtype.

    Eager uses the allocation-free function; traced code (inductor fuses it into one kernel)
    and differentiable angles (learned frequencies, float positions) use the plain formula.
    """
    if not (_is_compiling() or cos.requires_grad or sin.requires_grad):
        return _RotateFunction.apply(x, cos, sin, interleaved, rotary_dim).to(x.dtype)
    rotated = _rotate_pairs(x[..., :rotary_dim].to(cos.dtype), cos, sin, interleaved)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, x[..., rotary_dim:].to(cos.dtype)], dim=-1)
    return rotated.to(x.dtype)


def permute_rotary_weight(weight: Tensor, head_dim: int, *, to: Literal["half_split", "interleaved"],
                          rotary_dim: Optional[int] = None) -> Tensor:
    """Reorder the rows of a q or k projection between the two RoPE layouts.

    A checkpoint trained with interleaved pairs (Meta's Llama, GPT-J, RoFormer, torchtune)
    runs with ``interleaved=False`` (Hugging Face, GPT-NeoX) after
    ``permute_rotary_weight(w, head_dim, to="half_split")``, and back with ``to="interleaved"``:
    the same permutation of q and k leaves every attention logit unchanged. Works on a
    weight ``[heads * head_dim, in]`` or a bias ``[heads * head_dim]``; with partial rotary
    only the first ``rotary_dim`` rows of each head move.

    Example:
        >>> w = torch.randn(8 * 64, 512)
        >>> w_hf = permute_rotary_weight(w, 64, to="half_split")
    """
    owner = "permute_rotary_weight"
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if to not in ("half_split", "interleaved"):
        raise ValueError(f"{owner}: to must be 'half_split' or 'interleaved', got {to!r}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or weight.shape[0] % head_dim:
        raise ValueError(f"{owner}: need an even rotary_dim <= head_dim and rows divisible by head_dim, "
                         f"got rotary_dim={rotary_dim}, head_dim={head_dim}, weight {tuple(weight.shape)}")
    half = rotary_dim // 2
    rows = torch.arange(head_dim)
    if to == "half_split":  # new row c*half + j <- old row 2j + c
        rows[:rotary_dim] = 2 * (rows[:rotary_dim] % half) + rows[:rotary_dim] // half
    else:                   # new row 2j + c <- old row c*half + j
        rows[:rotary_dim] = (rows[:rotary_dim] % 2) * half + rows[:rotary_dim] // 2
    heads = weight.shape[0] // head_dim
    return weight.unflatten(0, (heads, head_dim))[:, rows.to(weight.device)].flatten(0, 1)


class RotaryPositionalEmbedding(PositionalEmbedding):
    """Rotary position embedding: rotate q and k pairwise by position-proportional angles.

    Su et al., "RoFormer", arXiv:2104.09864. Pair ``i`` of a head is rotated by
    ``p * theta_i`` with ``theta_i = base ** (-2i / rotary_dim)``, so
    ``<f(q, m), f(k, n)>`` depends on ``n - m`` only. Pairs are ``(i, i + R/2)``
    (half-split: Hugging Face, GPT-NeoX; the default) or ``(2i, 2i+1)`` (interleaved:
    RoFormer, GPT-J, Meta's Llama, torchtune); ``permute_rotary_weight`` converts
    checkpoints between the two. With ``rotary_dim < dim`` only the first ``rotary_dim``
    channels rotate (GPT-NeoX ``rotary_pct``, Phi's ``partial_rotary_factor``) and the
    frequencies use ``rotary_dim`` as denominator, as Hugging Face does.

    ``scaling`` takes a Hugging Face ``rope_parameters`` dict (``linear``, ``dynamic``,
    ``yarn``, ``longrope``, ``llama3``) and gives the same cos/sin, attention factor
    included. Where Hugging Face reads a length from the model config, the dict carries
    ``original_max_position_embeddings`` (and ``max_position_embeddings`` where needed).
    ``dynamic`` and ``longrope`` are driven by the largest position of each call.

    Multi-axis positions (Qwen2-VL's M-RoPE, axial 2-D RoPE for ViTs): ``sections`` gives
    the number of frequency pairs for each axis, in order (``[16, 24, 24]`` for ``(t, h, w)``
    with ``dim=128``); positions are then ``[..., N, A]``. With ``axis_spectrum="shared"``
    the axes take consecutive slices of one spectrum (Qwen2-VL); with ``"per_axis"`` each
    axis has its own full spectrum over ``2 * sections[a]`` channels (axial ViT RoPE).

    Angles come from float64 positions and frequencies, so position 1e6 is as accurate as
    position 1; the rotation runs in float32 (float64 for float64 inputs) and rounds once
    to the input dtype. A float32 cos/sin table serves integer positions and grows on demand.

    Args:
        dim (int): head dim ``Dh`` of the tensors to rotate.
        base (float): frequency base (``rope_theta``). Default: 10000.0.
        interleaved (bool): pair layout, see above. Default: False.
        rotary_dim (int, optional): rotated channels ``R`` (even, ``<= dim``). Default: ``dim``.
        scaling (dict, optional): Hugging Face ``rope_parameters``. Default: None.
        sections (list of int, optional): frequency pairs per position axis, summing to
            ``R / 2``. Default: None (one axis).
        axis_spectrum (str): ``"shared"`` or ``"per_axis"``. Default: ``"shared"``.
        cache_len (int): positions whose cos/sin are tabulated at construction; the table
            grows on demand in eager mode, and under ``torch.compile`` positions past it are
            computed on the fly. Default: 4096.

    Shape:
        - x: ``[..., N, Dh]`` (``[B, H, N, Dh]`` for attention); positions ``[N]``, ``[B, N]``
          (``[N, A]``, ``[B, N, A]`` with sections).
        - Output: same as x.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> q = rope(torch.randn(2, 8, 100, 64))
        >>> q_next = rope(torch.randn(2, 8, 1, 64), offset=100)
    """

    kind = "qk"
    translation_invariant = True

    def __init__(self, dim: int, *, base: float = 10000.0, interleaved: bool = False,
                 rotary_dim: Optional[int] = None, scaling: Optional[dict] = None,
                 sections: Optional[list] = None, section_layout: Literal["contiguous", "interleaved"] = "contiguous",
                 axis_spectrum: Literal["shared", "per_axis"] = "shared", cache_len: int = 4096) -> None:
        super().__init__()
        owner = type(self).__name__
        dim = _check_positive_int(owner, "dim", dim)
        if dim % 2:
            raise ValueError(f"{owner}: dim must be a positive even int, got dim={dim!r}")
        _check_base(owner, base)
        self.dim, self.base = dim, float(base)
        self.interleaved = _check_flag(owner, "interleaved", interleaved)
        params = _check_scaling(owner, scaling, self.base)
        rotary_dim = None if rotary_dim is None else _check_positive_int(owner, "rotary_dim", rotary_dim)
        _check_choice(owner, "section_layout", section_layout, ("contiguous", "interleaved"))
        if sections is not None:
            sections = [_check_positive_int(owner, "sections", size) for size in _as_list(owner, "sections", sections)]
        rotary_dim, sections, section_layout = _rotary_layout(owner, dim, rotary_dim, params, sections, section_layout)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim:
            raise ValueError(f"{owner}: rotary_dim must be a positive even int <= dim={dim}, "
                             f"got rotary_dim={rotary_dim!r}")
        if sections is not None and sum(sections) != rotary_dim // 2:
            raise ValueError(f"{owner}: sections must be positive and sum to rotary_dim / 2 = "
                             f"{rotary_dim // 2}, got sections={sections}")
        if section_layout == "interleaved" and (sections is None or len(sections) != 3):
            raise ValueError(f"{owner}: section_layout='interleaved' (Qwen3-VL) needs three sections (t, h, w), "
                             f"got sections={sections}")
        _check_choice(owner, "axis_spectrum", axis_spectrum, ("shared", "per_axis"))
        if axis_spectrum == "per_axis" and (sections is None or section_layout != "contiguous"):
            raise ValueError(f"{owner}: axis_spectrum='per_axis' needs contiguous sections, "
                             f"got sections={sections}, section_layout={section_layout!r}")
        self.rotary_dim, self.sections, self.section_layout = rotary_dim, sections, section_layout
        self.axis_spectrum = axis_spectrum
        self.cache_len = _as_int(owner, "cache_len", cache_len, minimum=0)
        self.num_axes = 1 if sections is None else len(sections)
        self._set_scaling(params)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, rotary_dim={self.rotary_dim}"
        if self._scaling["rope_type"] != "default":
            text += f", scaling={self._scaling}"
        if self.sections is not None:
            text += f", sections={self.sections}, axis_spectrum={self.axis_spectrum!r}"
        return text

    @property
    def scaling(self) -> dict:
        """The normalised ``rope_parameters`` (a copy); assign a new dict to change them."""
        return dict(self._scaling)

    @scaling.setter
    def scaling(self, value: Optional[dict]) -> None:
        owner = type(self).__name__
        params = _check_scaling(owner, value, self.base)
        layout = (self.rotary_dim, self.sections, self.section_layout)
        changed = _rotary_layout(owner, self.dim, self.rotary_dim, params, self.sections, self.section_layout)
        if changed != layout:
            raise ValueError(f"{owner}: a new scaling cannot change rotary_dim, sections or section_layout "
                             f"(got {changed}, the module has {layout}); build a new module")
        self._set_scaling(params)

    def _set_scaling(self, params: dict) -> None:
        owner = type(self).__name__
        for key in ("short_factor", "long_factor"):
            if key in params and len(params[key]) != self.rotary_dim // 2:
                raise ValueError(f"{owner}: scaling[{key!r}] must have rotary_dim / 2 = {self.rotary_dim // 2} "
                                 f"entries, got {len(params[key])}")
        self._scaling = params
        if self.axis_spectrum == "per_axis" and self._scaling["rope_type"] != "default":
            raise ValueError(f"{owner}: axis_spectrum='per_axis' takes no scaling, got "
                             f"rope_type={self._scaling['rope_type']!r}")
        self._scale_fn = ROPE_SCALING[self._scaling["rope_type"]]
        self._init_buffers(self._buffer_device())

    def _init_buffers(self, device) -> None:
        if self.axis_spectrum == "per_axis":
            inv_freq, self.attention_factor = torch.cat([_inverse_frequencies(2 * s, self.base) for s in self.sections]), 1.0
        else:
            inv_freq, self.attention_factor = self._scale_fn(self.rotary_dim, self.base, self._scaling, None)
        # construction-time frequencies [F] (float64) and their cos and sin for positions
        # 0 .. cache_len - 1, attention factor included: one [2, L, F] float32 tensor, so that
        # growing it swaps cos and sin together (a reader in another thread sees both or neither)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("cos_sin_cached", torch.empty(2, 0, self.rotary_dim // 2, device=device), persistent=False)
        if self.sections is None:
            self._grow_cache(self.cache_len)
        if self.sections is not None:  # which position axis drives each pair, [F]
            self.register_buffer("axis_of_pair", torch.tensor(self._axis_of_pair(), device=device), persistent=False)

    def _axis_of_pair(self) -> list:
        """The position axis of every frequency pair: contiguous sections (Qwen2-VL: ``t..t h..h w..w``),
        or Qwen3-VL's interleaved order (``t h w t h w ...`` while an axis has pairs left, then ``t``)."""
        if self.section_layout == "contiguous":
            return [axis for axis, size in enumerate(self.sections) for _ in range(size)]
        axes = [0] * sum(self.sections)
        for axis in (1, 2):
            for pair in range(axis, 3 * self.sections[axis], 3):
                axes[pair] = axis
        return axes

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0,
                seq_dim: Literal[-2, -3] = -2) -> Tensor:
        """Rotate ``x`` (call it for q and for k); default positions ``arange(N) + offset``.

        ``seq_dim=-2``: x is ``[..., N, Dh]`` (SDPA's ``[B, H, N, Dh]``); ``seq_dim=-3``: x is
        ``[..., N, H, Dh]`` (flash-attn, torchtune), rotated in place of its layout, no transpose.
        """
        owner = type(self).__name__
        if seq_dim not in (-2, -3) or isinstance(seq_dim, bool):
            raise ValueError(f"{owner}: seq_dim must be -2 ([..., N, Dh]) or -3 ([..., N, H, Dh]), got {seq_dim!r}")
        _check_tensor(owner, "x", x, -seq_dim)
        _check_last_dim(owner, "x", x, self.dim)
        n = x.shape[seq_dim]
        positions = _check_positions(owner, "positions", positions, tuple(x.shape[:seq_dim]), n, self.num_axes,
                                     device=x.device)
        cos, sin = self.cos_sin(positions, n, offset=offset, device=x.device, dtype=_compute_dtype(x.dtype))
        if seq_dim == -3:  # [..., N, F] -> [..., N, 1, F]: one angle for every head
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self._apply_rotation(x, cos, sin)

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        q_len, k_len = q.shape[-2], k.shape[-2]
        dtype, q_offset = _compute_dtype(q.dtype), _query_offset(q_len, k_len)
        length = None  # dynamic / longrope: q and k must share the frequencies of the longest position
        if self._scaling["rope_type"] in _LENGTH_DEPENDENT:
            tops = (self._largest(positions_q, q_len, q_offset), self._largest(positions_k, k_len, 0))
            traced = any(isinstance(top, Tensor) for top in tops)   # no data-dependent Python max while tracing
            length = (torch.maximum(*map(torch.as_tensor, tops)) if traced else max(tops)) + 1
        cos_k, sin_k = self.cos_sin(positions_k, k_len, offset=0, device=k.device, dtype=dtype, length=length)
        if positions_q is None and positions_k is None and q_len == k_len:
            cos_q, sin_q = cos_k, sin_k
        else:
            cos_q, sin_q = self.cos_sin(positions_q, q_len, offset=q_offset, device=q.device, dtype=dtype,
                                        length=length)
        return self._apply_rotation(q, cos_q, sin_q), self._apply_rotation(k, cos_k, sin_k)

    def cos_sin(self, positions: Optional[Tensor], n: int, *, offset: int = 0, device=None,
                dtype: torch.dtype = torch.float32, length=None) -> tuple:
        """cos and sin of every pair's angle, attention factor included: two ``[..., N, R/2]``.

        ``positions`` as validated by ``forward`` (or None for ``arange(n) + offset``);
        ``length`` (largest position + 1) drives ``dynamic`` / ``longrope``, from ``positions``
        when not given.
        """
        owner = type(self).__name__
        device = self.inv_freq.device if device is None else device
        default = positions is None
        inv_freq, factor = self.inv_freq, self.attention_factor
        if self._scaling["rope_type"] in _LENGTH_DEPENDENT:
            length = self._largest(positions, n, offset) + 1 if length is None else length
            inv_freq, factor = self._scale_fn(self.rotary_dim, self.base, self._scaling, length)
            inv_freq = inv_freq.to(device)
        positions = _or_default(owner, "positions", positions, n, offset, device, self.num_axes)
        cached = self._from_cache(None if default else positions, offset, n, inv_freq, factor, device, dtype)
        if cached is not None:
            return cached
        if self.sections is not None:  # pair i turns with the position on its axis
            positions = positions.gather(-1, self.axis_of_pair.expand(*positions.shape[:-1], -1))    # [..., N, F]
            angles = positions.to(torch.float64) * inv_freq.to(torch.float64)
        else:
            angles = _angles(positions, inv_freq)                                                  # [..., N, F]
        return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)

    @staticmethod
    def _largest(positions: Optional[Tensor], n: int, offset: int):
        """The largest position: ``offset + n - 1`` by default, else an int (a tensor while tracing)."""
        if positions is None:
            return offset + n - 1
        top = positions.max()
        if _skip_value_checks(top):
            return top
        return math.ceil(top.item()) if positions.is_floating_point() else int(top)

    def _from_cache(self, positions: Optional[Tensor], offset: int, n: int, inv_freq: Tensor, factor: float,
                    device, dtype) -> Optional[tuple]:
        """cos, sin looked up in the float32 cache, or None when it cannot serve this call.

        The cache holds the construction-time frequencies; it serves integer positions in
        float32 on its own device, growing (eagerly) unless the call would leave it mostly
        unused: one decoding step at position 1e6 computes its angles directly instead.
        """
        compiling = _is_compiling()
        if dtype != torch.float32 or self.sections is not None or self.cos_sin_cached.device != torch.device(device):
            return None
        if not (inv_freq is self.inv_freq or (not compiling and factor == self.attention_factor
                                              and torch.equal(inv_freq, self.inv_freq))):
            return None
        if positions is None:
            low, high, count = offset, offset + n - 1, n
        elif compiling or positions.is_floating_point() or positions.numel() == 0 or positions.is_meta:
            return None
        else:
            low, high, count = int(positions.min()), int(positions.max()), positions.shape[-1]
        cache = self.cos_sin_cached                     # read once: a concurrent grow swaps the whole tensor
        length = cache.shape[1]
        if low < 0 or (high >= length and (compiling or high + 1 > max(4 * count, length))):
            return None
        if high >= length:
            cache = self._grow_cache(max(high + 1, 2 * length))
        cos, sin = cache[0], cache[1]                                                   # [L, F] each
        if positions is None:  # views, no copy
            return cos[offset : offset + n], sin[offset : offset + n]
        return F.embedding(positions, cos), F.embedding(positions, sin)

    def _grow_cache(self, length: int) -> Tensor:
        """Tabulate cos and sin for positions ``0 .. length - 1`` and swap them in as one tensor."""
        # normal tensors even when called under inference_mode, so training can use them later
        with torch.inference_mode(False), torch.no_grad():
            angles = _angles(torch.arange(length, device=self.inv_freq.device), self.inv_freq.clone())   # [L, F]
            cache = torch.stack([angles.cos(), angles.sin()]).mul_(self.attention_factor).float()       # [2, L, F]
        self.cos_sin_cached = cache
        return cache

    def _apply_rotation(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return _rotate(x, cos, sin, self.interleaved, self.rotary_dim)


# ---------------------------------------------------------------------------
# Attention biases: T5, ALiBi, TUPE
# ---------------------------------------------------------------------------


def _toeplitz(values: Tensor, q_len: int, k_len: int) -> Tensor:
    """Expand per-distance values into the bias of default (bottom-right) positions.

    values: [..., Nq + Nk - 1], entry ``t`` for the key - query distance
    ``t - (Nq - 1) - offset`` -> [..., Nq, Nk] with ``out[i, j] = values[j - i + Nq - 1]``.
    One strided pass over the output; nothing of size N x N is computed twice.
    """
    if _is_compiling():  # unfold would specialise on the length; inductor fuses this gather instead
        queries, keys = torch.arange(q_len, device=values.device), torch.arange(k_len, device=values.device)
        return values[..., keys - queries[:, None] + q_len - 1]
    windows = values.unfold(-1, k_len, 1)          # [..., Nq, Nk]; window r starts at t = r (row Nq - 1 - r)
    return windows.flip(-2)                         # contiguous copy, rows in query order


def _default_distances(q_len: int, k_len: int, device) -> Tensor:
    """Key - query distance of every diagonal of the default-positions grid: [Nq + Nk - 1]."""
    start = -(q_len - 1) - _query_offset(q_len, k_len)
    return torch.arange(start, start + q_len + k_len - 1, device=device)


def _pair_distances(owner: str, q_len: int, k_len: int, positions_q: Optional[Tensor],
                    positions_k: Optional[Tensor], device) -> Tensor:
    """``positions_k[j] - positions_q[i]`` for explicit positions: [Nq, Nk], or [B, 1, ..., 1, Nq, Nk]
    for batched ones (their singleton dims, the head's included, stay in place)."""
    positions_q = _or_default(owner, "positions_q", positions_q, q_len, _query_offset(q_len, k_len), device)
    positions_k = _or_default(owner, "positions_k", positions_k, k_len, 0, device)
    return positions_k.unsqueeze(-2) - positions_q.unsqueeze(-1)


def _check_bias_call(module: PositionalEmbedding, q_len: int, k_len: int, positions_q: Optional[Tensor],
                     positions_k: Optional[Tensor]) -> tuple:
    """Validate ``forward(q_len, k_len, positions_q=, positions_k=)`` of a bias; return the positions
    as ``attention_bias`` takes them (``[B, N]`` becomes ``[B, 1, N]``: one row for all heads)."""
    owner = type(module).__name__
    for name, length in (("q_len", q_len), ("k_len", k_len)):
        if isinstance(length, Tensor):
            raise TypeError(f"{owner}: {name} must be an int (this bias is called with lengths, "
                            f"forward(q_len, k_len)), got {_describe(length)}")
    q_len, k_len = _check_positive_int(owner, "q_len", q_len), _check_positive_int(owner, "k_len", k_len)
    batches = {p.shape[0] for p in (positions_q, positions_k) if isinstance(p, Tensor) and p.dim() == 2}
    if len(batches - {1}) > 1:
        raise ValueError(f"{owner}: positions_q and positions_k must have the same batch size (or 1), "
                         f"got {sorted(batches)}")
    lead = (max(batches), 1) if batches else ()
    integer = module.integer_positions
    axes = module.num_axes
    if axes > 1 and (positions_q is None or positions_k is None):
        raise ValueError(f"{owner}: positions_q and positions_k are required for {axes} axes "
                         f"(shape [N, {axes}] or [B, N, {axes}]), got None")
    return (_check_positions(owner, "positions_q", positions_q, lead, q_len, axes, integer),
            _check_positions(owner, "positions_k", positions_k, lead, k_len, axes, integer))


class _RelativeBias(PositionalEmbedding):
    """An additive bias that is a function of (key - query distance, head) only.

    Subclasses define ``bias_at(distance, head)`` elementwise (broadcasting); this class
    builds the dense ``[H, Nq, Nk]`` bias from the ``Nq + Nk - 1`` distinct distances of
    default positions (an O(N) evaluation and one pass over the output), evaluates it on the
    distance grid of explicit positions, and hands it to FlexAttention as a ``score_mod``.
    """

    kind = "bias"
    translation_invariant = True
    integer_positions = True   # distances index buckets

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        """Bias for key - query ``distance`` at head index ``head`` (broadcasting tensors)."""
        raise NotImplementedError

    def forward(self, q_len: int, k_len: int, *, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None) -> Tensor:
        """The bias ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for ``[B, N]`` positions), float32."""
        return self.attention_bias(q_len, k_len, *_check_bias_call(self, q_len, k_len, positions_q, positions_k))

    def attention_bias(self, q_len, k_len, positions_q=None, positions_k=None, *, device=None):
        device = self._buffer_device() if device is None else device
        heads = torch.arange(self.num_heads, device=device)
        if q_len == 0 or k_len == 0:
            return torch.zeros(self.num_heads, q_len, k_len, device=device)
        if positions_q is None and positions_k is None:
            distances = _default_distances(q_len, k_len, device)                         # [Nq + Nk - 1]
            return _toeplitz(self.bias_at(distances, heads[:, None]), q_len, k_len)       # [H, Nq, Nk]
        distances = _pair_distances(type(self).__name__, q_len, k_len, positions_q, positions_k, device)
        return self.bias_at(distances, heads[:, None, None])                            # [(B, 1..,) H, Nq, Nk]

    def score_mod(self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None,
                  positions_k: Optional[Tensor] = None):
        """A FlexAttention ``score_mod`` adding this bias: ``flex_attention(q, k, v, score_mod=...)``.

        Default positions close over the ``Nq + Nk - 1`` per-distance values only; explicit
        ``[N]``, ``[1, N]`` or ``[B, N]`` positions (validated and widened as everywhere) are
        looked up per element.
        """
        owner = type(self).__name__
        positions_q, positions_k = _check_bias_call(self, q_len, k_len, positions_q, positions_k)
        device = self._buffer_device()
        heads = torch.arange(self.num_heads, device=device)
        if positions_q is None and positions_k is None:
            values = self.bias_at(_default_distances(q_len, k_len, device), heads[:, None])   # [H, Nq + Nk - 1]
            return lambda score, b, h, q_idx, kv_idx: score + values[h, kv_idx - q_idx + q_len - 1].to(score.dtype)
        pick_q = _row_lookup(_or_default(owner, "positions_q", positions_q, q_len, _query_offset(q_len, k_len), device))
        pick_k = _row_lookup(_or_default(owner, "positions_k", positions_k, k_len, 0, device))

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + self.bias_at(pick_k(b, kv_idx) - pick_q(b, q_idx), h).to(score.dtype)
        return add_bias


def _row_lookup(positions: Tensor):
    """``(b, index) -> position`` for FlexAttention: ``[N]``, or ``[R, 1.., N]`` rows (R = 1 shared, or B)."""
    rows = positions.reshape(-1, positions.shape[-1])                                   # [R, N]
    if rows.shape[0] == 1:
        return lambda b, index: rows[0, index]
    return lambda b, index: rows[b, index]


def _check_buckets(owner: str, num_buckets, max_distance, bidirectional) -> tuple:
    """T5 bucketing arguments: enough buckets for one exact bucket, and ``max_distance`` past them."""
    num_buckets = _check_positive_int(owner, "num_buckets", num_buckets)
    max_distance = _check_positive_int(owner, "max_distance", max_distance)
    bidirectional = _check_flag(owner, "bidirectional", bidirectional)
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if exact < 1:
        raise ValueError(f"{owner}: num_buckets must be >= {4 if bidirectional else 2} "
                         f"(bidirectional={bidirectional}), got num_buckets={num_buckets}")
    if max_distance <= exact:
        raise ValueError(f"{owner}: max_distance must exceed the {exact} exact buckets, "
                         f"got max_distance={max_distance}")
    return num_buckets, max_distance, bidirectional


def t5_relative_position_bucket(relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
                                max_distance: int = 128) -> Tensor:
    """T5's bucket of each key - query distance (Raffel et al. 2020; Mesh TensorFlow's definition).

    Bidirectional: half the buckets for keys at or before the query, half (offset by
    ``num_buckets / 2``) for keys after it. Within a half, distances below ``max_exact``
    (half of the half) get their own bucket, and larger ones share logarithmically wider
    buckets up to ``max_distance``, beyond which they all land in the last bucket.
    Causal: future keys share bucket 0. The logarithm is taken in float32, in the
    reference's order of operations, so every distance lands where T5's does.

    Args:
        relative_position (Tensor): integer ``key - query`` distances, any shape.

    Returns:
        int64 buckets in ``[0, num_buckets)``, same shape.
    """
    owner = "t5_relative_position_bucket"
    num_buckets, max_distance, bidirectional = _check_buckets(owner, num_buckets, max_distance, bidirectional)
    if not isinstance(relative_position, Tensor) or relative_position.is_floating_point() \
            or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(f"{owner}: relative_position must be an integer tensor, got {_describe(relative_position)}")
    relative_position = relative_position.long()
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    scaled = torch.log(n.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(n < max_exact, n, large)


class T5PositionalEmbedding(_RelativeBias):
    """T5's bucketed relative position bias (Raffel et al., arXiv:1910.10683).

    ``bias[h, i, j] = relative_attention_bias.weight[bucket(pos_k[j] - pos_q[i]), h]``, with
    the buckets of ``t5_relative_position_bucket``. The table is
    ``self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)``, so a T5 or
    Hugging Face checkpoint's ``...relative_attention_bias.weight`` loads unchanged. A bucket
    is computed once per distinct distance (distances past ``max_distance`` all share the
    last bucket), never on the N x N grid. T5 applies no ``1/sqrt(Dh)`` scaling: pass
    ``scale=1.0`` to ``attention()`` to reproduce it.

    Args:
        num_heads (int): heads ``H``.
        num_buckets (int): buckets. Default: 32.
        max_distance (int): distance from which all keys share the last bucket. Default: 128.
        bidirectional (bool): encoder (True) or decoder (False) bucketing. Default: True.
        init_std (float): std of the normal init of the table. Default: 0.02.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32.

    Example:
        >>> t5 = T5PositionalEmbedding(8)
        >>> t5(16, 16).shape
        torch.Size([8, 16, 16])
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, init_std: float = 0.02) -> None:
        super().__init__()
        owner = type(self).__name__
        num_heads = _check_positive_int(owner, "num_heads", num_heads)
        num_buckets, max_distance, bidirectional = _check_buckets(owner, num_buckets, max_distance, bidirectional)
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional, self.init_std = bidirectional, _as_float(owner, "init_std", init_std, minimum=0.0)
        self.relative_attention_bias = _uninitialised(nn.Embedding, num_buckets, num_heads)   # [buckets, H]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")

    def reset_parameters(self) -> None:
        nn.init.normal_(self.relative_attention_bias.weight, std=self.init_std)
        self._init_buffers(self.relative_attention_bias.weight.device)

    def _init_buffers(self, device) -> None:
        # bucket of every distance in [-(max_distance + 1), max_distance + 1]; farther ones clamp
        reach = self.max_distance + 1
        distances = torch.arange(-reach, reach + 1, device=device)
        buckets = t5_relative_position_bucket(distances, bidirectional=self.bidirectional,
                                              num_buckets=self.num_buckets, max_distance=self.max_distance)
        self.register_buffer("bucket_of_distance", buckets, persistent=False)          # [2 * reach + 1]

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        reach = self.max_distance + 1
        bucket = self.bucket_of_distance[distance.clamp(-reach, reach) + reach]
        weight = self.relative_attention_bias.weight
        return weight[bucket, head].to(_compute_dtype(weight.dtype))


_MAX_HEADS = 2**16


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> list:
    """Press et al.'s head slopes: ``2 ** (-max_bias (h + 1) / H)`` for a power-of-two ``H``.

    Otherwise the slopes of the nearest lower power of two ``P``, followed by every other
    slope of ``2P`` heads (the ones not already used), up to ``H`` in all. ``max_bias`` is 8 in
    the paper; MPT exposes it as ``alibi_bias_max``.
    """
    owner = "alibi_slopes"
    num_heads = _check_positive_int(owner, "num_heads", num_heads)
    if num_heads > _MAX_HEADS:
        raise ValueError(f"{owner}: num_heads must be at most {_MAX_HEADS}, got num_heads={num_heads}")
    max_bias = _as_float(owner, "max_bias", max_bias, minimum=0.0, exclusive=True)

    def geometric(n: int) -> list:
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return geometric(num_heads)
    lower = 2 ** int(math.log2(num_heads))
    return geometric(lower) + alibi_slopes(2 * lower, max_bias)[0::2][: num_heads - lower]


class ALiBiPositionalEmbedding(_RelativeBias):
    """Attention with Linear Biases (Press et al., arXiv:2108.12409).

    ``bias[h, i, j] = -slopes[h] * |pos_q[i] - pos_k[j]|``; in the paper's causal mode
    (``bidirectional=False``) keys after the query get ``-inf``. Positions may be any
    integers or floats. The reference adds ``+slope * j`` instead, which differs by a
    constant per row and so gives the same softmax. For a prefix LM use
    ``bidirectional=True`` (no built-in mask) with your own prefix mask.

    Variants: explicit ``slopes`` (Falcon divides Press' slopes by ``sqrt(Dh)``: use
    ``ALiBiPositionalEmbedding.from_config``), MPT's ``max_bias`` (``alibi_bias_max``), a bias on
    the first ``num_alibi_heads`` heads only (the others get slope 0, as in x-transformers), and
    ``num_axes = A > 1``: positions ``[..., N, A]`` with the Euclidean distance (2-D ALiBi for
    images and maps, as in CROMA; bidirectional only).

    Args:
        num_heads (int): heads ``H``.
        bidirectional (bool): symmetric ``|i - j|`` without the causal mask. Default: False.
        slopes (list of float, optional): one positive slope per head. Default: Press' rule.
        max_bias (float): the exponent scale of Press' rule. Default: 8.0.
        num_alibi_heads (int, optional): heads with a bias (the first ones). Default: all.
        num_axes (int): position axes ``A``. Default: 1.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32; ``self.slopes``: ``[H]``.

    Example:
        >>> alibi = ALiBiPositionalEmbedding(8)
        >>> alibi.slopes[:2]
        tensor([0.5000, 0.2500])
    """

    integer_positions = False

    def __init__(self, num_heads: int, *, bidirectional: bool = False, slopes: Optional[list] = None,
                 max_bias: float = 8.0, num_alibi_heads: Optional[int] = None, num_axes: int = 1) -> None:
        super().__init__()
        owner = type(self).__name__
        self.num_heads = _check_positive_int(owner, "num_heads", num_heads)
        if self.num_heads > _MAX_HEADS:
            raise ValueError(f"{owner}: num_heads must be at most {_MAX_HEADS}, got num_heads={num_heads}")
        self.bidirectional = _check_flag(owner, "bidirectional", bidirectional)
        self.max_bias = _as_float(owner, "max_bias", max_bias, minimum=0.0, exclusive=True)
        self.num_alibi_heads = self.num_heads if num_alibi_heads is None else \
            _check_positive_int(owner, "num_alibi_heads", num_alibi_heads)
        if self.num_alibi_heads > self.num_heads:
            raise ValueError(f"{owner}: num_alibi_heads must be <= num_heads={self.num_heads}, "
                             f"got num_alibi_heads={self.num_alibi_heads}")
        if slopes is not None:
            slopes = [_as_float(owner, "slopes", slope, minimum=0.0) for slope in _as_list(owner, "slopes", slopes)]
            if len(slopes) != self.num_alibi_heads:
                raise ValueError(f"{owner}: slopes must have num_alibi_heads={self.num_alibi_heads} entries, "
                                 f"got {len(slopes)}")
        self.explicit_slopes = slopes
        self.num_axes = _check_positive_int(owner, "num_axes", num_axes)
        if self.num_axes > 1 and not self.bidirectional:
            raise ValueError(f"{owner}: num_axes={self.num_axes} (Euclidean distance) has no causal order; "
                             f"pass bidirectional=True")
        self.translation_invariant = True
        self._init_buffers(None)

    def extra_repr(self) -> str:
        text = f"num_heads={self.num_heads}, bidirectional={self.bidirectional}"
        if self.explicit_slopes is not None:
            text += ", slopes=explicit"
        elif self.max_bias != 8.0:
            text += f", max_bias={self.max_bias}"
        if self.num_alibi_heads != self.num_heads:
            text += f", num_alibi_heads={self.num_alibi_heads}"
        return text + (f", num_axes={self.num_axes}" if self.num_axes > 1 else "")

    def _init_buffers(self, device) -> None:
        slopes = self.explicit_slopes or alibi_slopes(self.num_alibi_heads, self.max_bias)
        slopes = slopes + [0.0] * (self.num_heads - self.num_alibi_heads)
        self.register_buffer("slopes", torch.tensor(slopes, dtype=torch.float32, device=device), persistent=False)

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        slope = self.slopes[head]
        bias = -slope * distance.abs().to(slope.dtype)
        if self.bidirectional:
            return bias
        return bias.masked_fill(distance > 0, float("-inf"))

    def attention_bias(self, q_len, k_len, positions_q=None, positions_k=None, *, device=None):
        if self.num_axes == 1:
            return super().attention_bias(q_len, k_len, positions_q, positions_k, device=device)
        device = self.slopes.device if device is None else device
        offsets = positions_k.to(device).unsqueeze(-3) - positions_q.to(device).unsqueeze(-2)   # [.., Nq, Nk, A]
        distance = offsets.to(torch.float64).square().sum(-1).sqrt()                   # [(B, 1..,) Nq, Nk]
        heads = torch.arange(self.num_heads, device=device)[:, None, None]
        return self.bias_at(distance, heads)                                            # [(B, 1..,) H, Nq, Nk]

    def score_mod(self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None,
                  positions_k: Optional[Tensor] = None):
        if self.num_axes == 1:
            return super().score_mod(q_len, k_len, positions_q, positions_k)
        return _dense_score_mod(self, q_len, k_len, positions_q, positions_k)


class UnifiedPositionalEmbedding(PositionalEmbedding):
    """TUPE: untied positional attention (Ke, He and Liu, arXiv:2006.15595).

    Positions never touch the token states. Instead a learned absolute table ``p`` (shared
    by all layers) gives, per head, the positional correlation
    ``(U_q LN(p_i)) . (U_k LN(p_j)) / sqrt(2 Dh)`` with its own projections ``U_q``, ``U_k``
    (``pos_q_linear``, ``pos_k_linear``, as in the reference), plus optionally T5's bucketed
    relative bias (``self.relative``). With ``cls_token=True`` the token at position 0 is
    untied from positions: its row gets a learned ``cls_to_others[h]`` and its column a
    learned ``others_to_cls[h]`` (the paper's theta_1, theta_2). TUPE also scales the content
    logits by ``1/sqrt(2 Dh)``; ``forward_attn`` and ``attention()`` use that scale unless
    told otherwise.

    The reference's relative bias uses T5's bucket function, as here; its [CLS] values are
    realised as ``p_0 . p_0`` and ``p_1 . p_1`` plus two extra buckets, which is the same
    family of per-head constants as the learned ones here.

    Args:
        max_len (int): positions in the table.
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh`` (the table has width ``H * Dh``).
        relative_bias (bool): add T5's bucketed relative bias. Default: True.
        num_buckets, max_distance, bidirectional: of the relative bias. Defaults: 32, 128, True.
        cls_token (bool): untie position 0 as a ``[CLS]`` token. Default: False.
        init_std (float): std of the normal init (BERT's). Default: 0.02.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32.

    Example:
        >>> tupe = UnifiedPositionalEmbedding(512, 12, 64, cls_token=True)
        >>> tupe(128, 128).shape
        torch.Size([12, 128, 128])
    """

    kind = "bias"
    integer_positions = True

    def __init__(self, max_len: int, num_heads: int, head_dim: int, *, relative_bias: bool = True,
                 num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True,
                 cls_token: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        owner = type(self).__name__
        for name, value in (("max_len", max_len), ("num_heads", num_heads), ("head_dim", head_dim)):
            _check_positive_int(owner, name, value)
        self.max_len, self.num_heads, self.head_dim = max_len, num_heads, head_dim
        self.cls_token, self.init_std = cls_token, init_std
        width = num_heads * head_dim
        self.position_embeddings = _uninitialised(nn.Embedding, max_len, width)         # p: [max_len, H * Dh]
        self.pos_ln = nn.LayerNorm(width)
        self.pos_q_linear = _uninitialised(nn.Linear, width, width)                     # U_q
        self.pos_k_linear = _uninitialised(nn.Linear, width, width)                     # U_k
        self.relative = T5PositionalEmbedding(num_heads, num_buckets=num_buckets, max_distance=max_distance,
                                              bidirectional=bidirectional, init_std=init_std) if relative_bias else None
        if cls_token:
            self.cls_to_others = nn.Parameter(torch.empty(num_heads))                  # theta_1: [H]
            self.others_to_cls = nn.Parameter(torch.empty(num_heads))                  # theta_2: [H]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"max_len={self.max_len}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"cls_token={self.cls_token}")

    def reset_parameters(self) -> None:
        for linear in (self.pos_q_linear, self.pos_k_linear):
            nn.init.normal_(linear.weight, std=self.init_std)
            nn.init.zeros_(linear.bias)
        nn.init.normal_(self.position_embeddings.weight, std=self.init_std)
        self.pos_ln.reset_parameters()
        if self.relative is not None:
            self.relative.reset_parameters()
        if self.cls_token:
            nn.init.normal_(self.cls_to_others, std=self.init_std)
            nn.init.normal_(self.others_to_cls, std=self.init_std)

    def logit_scale(self, head_dim: int) -> float:
        return (2 * head_dim) ** -0.5

    def forward(self, q_len: int, k_len: int, *, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None) -> Tensor:
        """The bias ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for ``[B, N]`` positions), float32."""
        return self.attention_bias(q_len, k_len, *_check_bias_call(self, q_len, k_len, positions_q, positions_k))

    def attention_bias(self, q_len, k_len, positions_q=None, positions_k=None, *, device=None):
        owner = type(self).__name__
        device = self.position_embeddings.weight.device if device is None else device
        unhead = lambda p: p.squeeze(-2) if p.dim() > 1 else p                          # [B, 1.., 1, N] -> [B, 1.., N]
        pos_q = unhead(_or_default(owner, "positions_q", positions_q, q_len, _query_offset(q_len, k_len), device))
        pos_k = unhead(_or_default(owner, "positions_k", positions_k, k_len, 0, device))
        bias = self._correlation(pos_q, pos_k)                                          # [(B, 1..,) H, Nq, Nk]
        if self.relative is not None:
            bias = bias + self.relative.attention_bias(q_len, k_len, positions_q, positions_k, device=device)
        if self.cls_token:  # column first, then row: the [CLS] query keeps cls_to_others on itself
            heads = (-1, 1, 1)
            bias = torch.where((pos_k == 0).unsqueeze(-2).unsqueeze(-3), self.others_to_cls.view(heads).to(bias.dtype), bias)
            bias = torch.where((pos_q == 0).unsqueeze(-1).unsqueeze(-3), self.cls_to_others.view(heads).to(bias.dtype), bias)
        return bias

    def score_mod(self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None,
                  positions_k: Optional[Tensor] = None):
        """A FlexAttention ``score_mod`` adding this bias (it indexes the dense bias: the
        absolute part is a learned ``[H, Nq, Nk]`` correlation, not a function of distance)."""
        return _dense_score_mod(self, q_len, k_len, positions_q, positions_k)

    def _correlation(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """``(U_q LN(p_i)) . (U_k LN(p_j)) / sqrt(2 Dh)`` per head: [(B,) H, Nq, Nk], float32."""
        for name, positions in (("positions_q", pos_q), ("positions_k", pos_k)):
            _check_table_range(type(self).__name__, name, positions, self.max_len)

        def project(linear: nn.Linear, positions: Tensor) -> Tensor:                  # -> [(B,) H, N, Dh]
            rows = self.pos_ln(self.position_embeddings(positions))
            return linear(rows).unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3)

        pos_query = project(self.pos_q_linear, pos_q) * self.logit_scale(self.head_dim)
        correlation = torch.matmul(pos_query, project(self.pos_k_linear, pos_k).transpose(-1, -2))
        return correlation.to(_compute_dtype(correlation.dtype))


def _dense_score_mod(module: PositionalEmbedding, q_len: int, k_len: int, positions_q: Optional[Tensor],
                     positions_k: Optional[Tensor]):
    """A ``score_mod`` that indexes the module's dense bias (for biases that are not a function of one
    distance: TUPE's absolute correlation, Euclidean ALiBi)."""
    positions_q, positions_k = _check_bias_call(module, q_len, k_len, positions_q, positions_k)
    bias = module.attention_bias(q_len, k_len, positions_q, positions_k)               # [(R,) H, Nq, Nk]
    rows = bias.reshape(-1, *bias.shape[-3:])                                           # [R, H, Nq, Nk], R = 1 or B
    if rows.shape[0] == 1:
        return lambda score, b, h, q_idx, kv_idx: score + rows[0, h, q_idx, kv_idx].to(score.dtype)
    return lambda score, b, h, q_idx, kv_idx: score + rows[b, h, q_idx, kv_idx].to(score.dtype)


def _check_table_range(owner: str, name: str, positions: Tensor, size: int) -> None:
    """Integer positions inside a table of ``size`` rows (the range check is skipped while tracing)."""
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        kind = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"{owner}: {name} must be an integer tensor, got {kind}")
    if _skip_value_checks(positions) or positions.numel() == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= size:
        raise ValueError(f"{owner}: {name} must lie in [0, max_len={size}), got position {low if low < 0 else high}")


# ---------------------------------------------------------------------------
# Content-dependent relative encodings: Transformer-XL, Enformer
# ---------------------------------------------------------------------------


def _diagonals(scores: Tensor, q_len: int, k_len: int) -> Tensor:
    """Exact relative shift: ``out[..., i, j] = scores[..., i, j - i + Nq - 1]``.

    scores: [..., Nq, L] (``L = Nq + Nk - 1``) with column ``t`` for key - query distance
    ``t - (Nq - 1) - offset``. In the flattened rows that element sits at
    ``i (L - 1) + j + Nq - 1``, so skipping ``Nq - 1`` entries and re-reading rows of length
    ``L - 1`` lines every distance up: a view, with no padding and no garbage in the upper
    triangle, hence exact for bidirectional attention too.
    """
    if q_len == 1:
        return scores
    length = scores.shape[-1]
    flat = scores.contiguous().flatten(-2)[..., q_len - 1 : q_len - 1 + q_len * (length - 1)]   # [..., Nq (L - 1)]
    return flat.unflatten(-1, (q_len, length - 1))[..., :k_len]                                  # [..., Nq, Nk]


class _RelativeLogits(PositionalEmbedding):
    """Logits ``q_c . k + q_r . r(pos_k - pos_q)`` with learned per-distance keys ``r``.

    Subclasses give ``biased_queries`` (the content and position queries, with the paper's
    ``u``/``v`` biases and scale) and ``relative_keys(distance) -> [H, L, Dh]``. Default
    positions evaluate the ``Nq + Nk - 1`` distinct distances once and shift them exactly
    into place; explicit positions evaluate each distinct distance once and gather.
    """

    kind = "logits"
    translation_invariant = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        owner = type(self).__name__
        _check_positive_int(owner, "num_heads", num_heads)
        _check_positive_int(owner, "head_dim", head_dim)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.r_w_bias = nn.Parameter(torch.empty(num_heads, head_dim))                  # u: [H, Dh] (paper's name)
        self.r_r_bias = nn.Parameter(torch.empty(num_heads, head_dim))                  # v: [H, Dh]

    def biased_queries(self, q: Tensor, scale: float) -> tuple:
        raise NotImplementedError

    def relative_keys(self, distance: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """Pre-softmax logits ``[B, H, Nq, Nk]`` (same as ``forward_attn``)."""
        return self.forward_attn(q, k, positions_q, positions_k, scale=scale)

    def forward_attn(self, q, k, positions_q=None, positions_k=None, *, scale=None):
        return self.full_precision_logits(q, k, positions_q, positions_k, scale=scale).to(q.dtype)

    def full_precision_logits(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                              positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """``forward_attn`` before its final cast: float32 (float64) logits, for ``attention()``'s softmax."""
        owner = type(self).__name__
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k)
        q_len, k_len = q.shape[-2], k.shape[-2]
        scale = self.logit_scale(q.shape[-1]) if scale is None else scale
        q = q.to(_compute_dtype(q.dtype))
        q_content, q_position = self.biased_queries(q, scale)                           # [B, H, Nq, Dh] each
        logits = torch.matmul(q_content, k.to(q.dtype).transpose(-1, -2))                # [B, H, Nq, Nk]
        if q_len == 0 or k_len == 0:
            return logits
        if positions_q is None and positions_k is None:
            keys = self.relative_keys(_default_distances(q_len, k_len, q.device)).to(q.dtype)   # [H, Nq + Nk - 1, Dh]
            by_distance = torch.matmul(q_position, keys.transpose(-1, -2))             # [B, H, Nq, Nq + Nk - 1]
            return logits + _diagonals(by_distance, q_len, k_len)
        distances = _pair_distances(owner, q_len, k_len, positions_q, positions_k, q.device)   # [(B,) Nq, Nk]
        return logits + self._pair_logits(q_position, distances)

    def _pair_logits(self, q_position: Tensor, distances: Tensor) -> Tensor:
        """q_position [B, .., H, Nq, Dh], distances [Nq, Nk] or [B, 1.., 1, Nq, Nk] -> [B, .., H, Nq, Nk]."""
        if _is_compiling():  # no data-dependent shapes: relative keys for every pair
            pairs = distances.squeeze(-3) if distances.dim() > 2 else distances        # [(B, 1..,) Nq, Nk]
            keys = self.relative_keys(pairs.flatten()).to(q_position.dtype).unflatten(1, pairs.shape)
            keys = keys.movedim(0, -4)                                                  # [(B, 1..,) H, Nq, Nk, Dh]
            return torch.einsum("...hid,...hijd->...hij", q_position, keys)
        distinct, index = torch.unique(distances, return_inverse=True)                 # index: like distances
        keys = self.relative_keys(distinct).to(q_position.dtype)                        # [H, U, Dh]
        by_distance = torch.matmul(q_position, keys.transpose(-1, -2))                  # [B, .., H, Nq, U]
        return by_distance.gather(-1, index.expand(*by_distance.shape[:-1], index.shape[-1]))


class TransformerXLPositionalEmbedding(_RelativeLogits):
    """Transformer-XL's relative attention (Dai et al., arXiv:1901.02860).

    ``logits[i, j] = scale * ((q_i + u) . k_j + (q_i + v) . W_r R(pos_q[i] - pos_k[j]))``
    with ``R`` the concatenated ``[sin | cos]`` sinusoid of width ``d_model`` (Vaswani's
    frequencies), ``u = r_w_bias``, ``v = r_r_bias`` and ``W_r = r_net`` (the reference's
    names). Memory (``Nk > Nq``) puts the queries at the last positions. The classic
    pad-and-reshape shift is only right below the diagonal; here every distance is
    evaluated and shifted exactly, so bidirectional attention and explicit positions are
    exact too. ``clamp_len`` caps ``|pos_q - pos_k|`` as the reference's ``clamp_len`` does.

    Args:
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh``.
        d_model (int, optional): width of ``R`` (even). Default: ``H * Dh``.
        base (float): sinusoid base. Default: 10000.0.
        clamp_len (int, optional): largest distance encoded. Default: None (no cap).
        init_std (float): std of the normal init (the reference's). Default: 0.02.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` -> logits ``[B, H, Nq, Nk]``.

    Example:
        >>> xl = TransformerXLPositionalEmbedding(8, 64)
        >>> q, k = torch.randn(2, 8, 16, 64), torch.randn(2, 8, 48, 64)   # 32 tokens of memory
        >>> xl(q, k).shape
        torch.Size([2, 8, 16, 48])
    """

    def __init__(self, num_heads: int, head_dim: int, *, d_model: Optional[int] = None, base: float = 10000.0,
                 clamp_len: Optional[int] = None, init_std: float = 0.02) -> None:
        super().__init__(num_heads, head_dim)
        owner = type(self).__name__
        d_model = num_heads * head_dim if d_model is None else d_model
        if not isinstance(d_model, int) or d_model <= 0 or d_model % 2:
            raise ValueError(f"{owner}: d_model must be a positive even int, got d_model={d_model!r}")
        if clamp_len is not None:
            _check_positive_int(owner, "clamp_len", clamp_len)
        _check_base(owner, base)
        self.d_model, self.base, self.clamp_len, self.init_std = d_model, float(base), clamp_len, init_std
        self.r_net = _uninitialised(nn.Linear, d_model, num_heads * head_dim, bias=False)   # W_r
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, d_model={self.d_model}, "
                f"clamp_len={self.clamp_len}")

    def reset_parameters(self) -> None:
        for weight in (self.r_w_bias, self.r_r_bias, self.r_net.weight):
            nn.init.normal_(weight, std=self.init_std)
        self._init_buffers(self.r_w_bias.device)

    def _init_buffers(self, device) -> None:
        self.register_buffer("inv_freq", _inverse_frequencies(self.d_model, self.base, device), persistent=False)

    def biased_queries(self, q: Tensor, scale: float) -> tuple:
        u, v = self.r_w_bias.to(q.dtype), self.r_r_bias.to(q.dtype)
        return (q + u.unsqueeze(-2)) * scale, (q + v.unsqueeze(-2)) * scale

    def relative_keys(self, distance: Tensor) -> Tensor:
        """``W_r R(query - key)`` for key - query ``distance`` [L]: [H, L, Dh]."""
        offset = -distance                                                              # R is indexed by i - j
        if self.clamp_len is not None:
            offset = offset.clamp(-self.clamp_len, self.clamp_len)
        angles = _angles(offset, self.inv_freq)                                         # [L, d_model / 2]
        sinusoid = torch.cat([angles.sin(), angles.cos()], dim=-1).to(self.r_net.weight.dtype)   # [L, d_model]
        return self.r_net(sinusoid).unflatten(-1, (self.num_heads, self.head_dim)).transpose(0, 1)


def _enformer_basis(distance: Tensor, num_basis: int, length: int, min_half_life: float,
                    gamma_peak: Tensor) -> Tensor:
    """Enformer's exponential, central-mask and gamma basis functions of ``|distance|``, float64.

    distance: [L] -> [L, 3 * num_basis]; each gamma density (plus 1e-8) is divided by
    ``gamma_peak`` [num_basis].
    """
    d = distance.to(torch.float64).abs().unsqueeze(-1)                                  # [L, 1]
    device = d.device
    half_life = 2.0 ** torch.linspace(min_half_life, math.log2(length), num_basis, dtype=torch.float64, device=device)
    exponential = torch.exp(-math.log(2.0) / half_life * d)
    widths = 2.0 ** torch.arange(1, num_basis + 1, dtype=torch.float64, device=device) - 1
    central_mask = (widths > d).to(torch.float64)
    stddev = length / (2 * num_basis)
    mean = torch.linspace(length / num_basis, length, num_basis, dtype=torch.float64, device=device)
    concentration, rate = (mean / stddev) ** 2, mean / stddev ** 2
    log_pdf = torch.xlogy(concentration - 1, d) - rate * d - (torch.lgamma(concentration) - concentration * rate.log())
    gamma = torch.exp(log_pdf) + 1e-8
    return torch.cat([exponential, central_mask, gamma / gamma_peak.to(device)], dim=-1)


class EnformerPositionalEmbedding(_RelativeLogits):
    """Enformer's relative attention (Avsec et al. 2021, Nature Methods; bioRxiv 2021.04.07.438649).

    ``logits[i, j] = (s q_i + u) . k_j + (s q_i + v) . W_r f(pos_k[j] - pos_q[i])`` with
    ``s`` the logit scale (applied to q before the biases, as in Enformer), ``u = r_w_bias``,
    ``v = r_r_bias``, ``W_r = r_k`` and ``f`` the relative basis: exponential decays (half
    lives ``2**3 .. length_scale``), central masks (widths ``2**k - 1``) and gamma densities
    (means up to ``length_scale``), each of ``|d|``, followed by the same features times
    ``sign(d)`` (dropped with ``symmetric=True``). The gamma densities are normalised to a
    peak of 1 over ``|d| < length_scale``, as DeepMind's code does. The basis takes its
    length scale from the constructor, never from the input, so a pair's logit does not
    depend on the other tokens. Features are computed in float64.

    Args:
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh``.
        num_features (int): width of ``f``; a multiple of 6 (3 with ``symmetric``). Default: 192.
        length_scale (int): the length the basis is scaled to (Enformer's attention
            length). Default: 1536.
        min_half_life (float): log2 of the shortest exponential half life. Default: 3.0.
        symmetric (bool): drop the sign-asymmetric copies. Default: False.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` -> logits ``[B, H, Nq, Nk]``.

    Example:
        >>> enformer = EnformerPositionalEmbedding(8, 64)
        >>> q = k = torch.randn(1, 8, 100, 64)
        >>> enformer(q, k).shape
        torch.Size([1, 8, 100, 100])
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_features: int = 192, length_scale: int = 1536,
                 min_half_life: float = 3.0, symmetric: bool = False) -> None:
        super().__init__(num_heads, head_dim)
        owner = type(self).__name__
        _check_positive_int(owner, "length_scale", length_scale)
        components = 3 if symmetric else 6
        if not isinstance(num_features, int) or num_features <= 0 or num_features % components:
            raise ValueError(f"{owner}: num_features must be a positive multiple of {components} "
                             f"(symmetric={symmetric}), got num_features={num_features!r}")
        if not 0 < min_half_life < math.log2(length_scale):
            raise ValueError(f"{owner}: min_half_life must lie in (0, log2(length_scale)={math.log2(length_scale):.2f}), "
                             f"got min_half_life={min_half_life!r}")
        self.num_features, self.length_scale = num_features, length_scale
        self.min_half_life, self.symmetric = float(min_half_life), symmetric
        self.r_k = _uninitialised(nn.Linear, num_features, num_heads * head_dim, bias=False)   # W_r
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_features={self.num_features}, "
                f"length_scale={self.length_scale}, symmetric={self.symmetric}")

    def reset_parameters(self) -> None:
        # Enformer (Sonnet) draws these with variance scaling 2.0 over the fan-in
        nn.init.normal_(self.r_w_bias, std=math.sqrt(2.0 / self.num_heads))
        nn.init.normal_(self.r_r_bias, std=math.sqrt(2.0 / self.num_heads))
        nn.init.normal_(self.r_k.weight, std=math.sqrt(2.0 / self.num_features))
        self._init_buffers(self.r_w_bias.device)

    def _init_buffers(self, device) -> None:
        num_basis = self.num_features // (3 if self.symmetric else 6)
        # each gamma density's peak over |d| < length_scale (DeepMind normalises over positions)
        unscaled = _enformer_basis(torch.arange(self.length_scale, device=device), num_basis, self.length_scale,
                                   self.min_half_life, torch.ones(num_basis, dtype=torch.float64, device=device))
        self.register_buffer("gamma_peak", unscaled[:, 2 * num_basis:].amax(0), persistent=False)   # [F] float64

    def features(self, distance: Tensor) -> Tensor:
        """The relative basis ``f`` of key - query ``distance`` [L]: [L, num_features], float64."""
        num_basis = self.num_features // (3 if self.symmetric else 6)
        basis = _enformer_basis(distance, num_basis, self.length_scale, self.min_half_life, self.gamma_peak)
        if self.symmetric:
            return basis
        return torch.cat([basis, torch.sign(distance).to(basis.dtype).unsqueeze(-1) * basis], dim=-1)

    def biased_queries(self, q: Tensor, scale: float) -> tuple:
        u, v = self.r_w_bias.to(q.dtype), self.r_r_bias.to(q.dtype)
        return q * scale + u.unsqueeze(-2), q * scale + v.unsqueeze(-2)

    def relative_keys(self, distance: Tensor) -> Tensor:
        features = self.features(distance).to(self.r_k.weight.dtype)                   # [L, C]
        return self.r_k(features).unflatten(-1, (self.num_heads, self.head_dim)).transpose(0, 1)


# ---------------------------------------------------------------------------
# Algebraic (orthogonal) encodings: sequences, grids, trees
# ---------------------------------------------------------------------------


def _plane_blocks(a: Tensor, b: Tensor) -> Tensor:
    """``[[diag(a), -diag(b)], [diag(b), diag(a)]]``, acting on the pairs ``(i, i + F)``:
    a, b [..., F] -> [..., 2F, 2F]."""
    a, b = a.diag_embed(), b.diag_embed()                                               # [..., F, F]
    return torch.cat([torch.cat([a, -b], dim=-1), torch.cat([b, a], dim=-1)], dim=-2)


def _rotation_matrices(angles: Tensor) -> Tensor:
    """Block rotations of the pairs ``(i, i + F)``: angles [..., F] -> [..., 2F, 2F]."""
    return _plane_blocks(angles.cos(), angles.sin())


def _rotation_planes(w: Tensor) -> tuple:
    """Write a special orthogonal ``w`` [n, n] as ``Q R(theta) Q^T`` (float64, n even).

    ``R(theta)`` rotates the pairs ``(i, i + n/2)``; ``Q`` is special orthogonal. The
    invariant planes are read off the symmetric part ``(w + w^T)/2``, whose eigenvalues
    are ``cos(theta)``: for a unit ``u`` in such an eigenspace the skew part gives the
    plane's second axis ``v = K u / |K u|`` and ``sin(theta) = |K u|``. Eigenvalues
    +-1 (angles 0 and pi) pair the eigenspace's vectors as they come.
    """
    n = w.shape[-1]
    sym, skew = (w + w.T) / 2, (w - w.T) / 2
    cosines, vectors = torch.linalg.eigh(sym)                                          # ascending
    chosen = torch.zeros(n, 0, dtype=w.dtype, device=w.device)
    firsts, seconds, angles = [], [], []
    residual = lambda t: t - chosen @ (chosen.T @ t)
    for i in range(n):
        u = residual(vectors[:, i])
        if u.norm() < 0.5:  # already spanned by a chosen plane
            continue
        u = u / u.norm()
        v = residual(skew @ u)
        sine = v.norm()
        if sine > 1e-7:
            v, angle = v / sine, math.atan2(sine.item(), (u @ sym @ u).item())
        else:  # angle 0 or pi: any other vector of the same eigenspace completes the plane
            same = [j for j in range(i + 1, n) if abs(cosines[j] - cosines[i]) < 1e-6]
            candidates = [residual(vectors[:, j]) - u * (u @ vectors[:, j]) for j in same]
            v = max(candidates, key=lambda t: t.norm(), default=torch.zeros_like(u))
            if v.norm() < 0.5:
                raise ValueError("the primitive has an unpaired eigenvalue +-1 (it is not special orthogonal)")
            v, angle = v / v.norm(), 0.0 if cosines[i] > 0 else math.pi
        firsts.append(u), seconds.append(v), angles.append(angle)
        chosen = torch.cat([chosen, u[:, None], v[:, None]], dim=1)
    q = torch.stack(firsts + seconds, dim=1)                                            # [n, n]
    theta = torch.tensor(angles, dtype=w.dtype, device=w.device)
    if torch.linalg.det(q) < 0:  # flip one plane's second axis: same w, angle negated
        q[:, n // 2] = -q[:, n // 2]
        theta[0] = -theta[0]
    return q, theta


def _skew_log(w: Tensor) -> Tensor:
    """A real skew-symmetric ``G`` with ``matrix_exp(G) = w`` for special orthogonal ``w`` [n, n]."""
    q, theta = _rotation_planes(w)
    return q @ _plane_blocks(torch.zeros_like(theta), theta) @ q.T


def _check_special_orthogonal(owner: str, w: Tensor, shape: tuple) -> Tensor:
    """Validate primitives to load: shape, orthogonality, det +1; return them in float64."""
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise TypeError(f"{owner}: primitives must be a floating tensor, got "
                        f"{w.dtype if isinstance(w, Tensor) else type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{owner}: primitives must have shape {list(shape)}, got {list(w.shape)}")
    w = w.detach().to(torch.float64)
    error = (w @ w.mT - torch.eye(shape[-1], dtype=torch.float64, device=w.device)).abs().max().item()
    if error > 1e-4:
        raise ValueError(f"{owner}: every primitive must be orthogonal (W W^T = I), got max |W W^T - I| = {error:.2e}")
    if (torch.linalg.det(w) < 0).any():
        raise ValueError(f"{owner}: every primitive must have determinant +1 (a rotation, as matrix_exp(P - P^T) "
                         f"is), got a reflection")
    return w


class _OrthogonalRotation(PositionalEmbedding):
    """Shared machinery of the sequence and grid encodings (Kogkalidis et al.).

    Per axis ``a`` and head ``h`` the primitive is ``W = Q R(theta) Q^T``: a rotation with
    learned frequencies ``theta`` (``frequencies``) in a learned orthonormal basis
    ``Q = matrix_exp(S - S^T)`` (``basis_generator``), which keeps ``W`` exactly orthogonal
    while training and has eigendecomposition-free gradients. Then
    ``W^p = Q R(p theta) Q^T``: applying it costs a change of basis and a rotation, with
    nothing of size ``N x Dh x Dh`` ever built. At initialisation ``Q = I`` and ``theta`` are
    RoPE's frequencies, so the scores equal ``RotaryPositionalEmbedding``'s.
    """

    kind = "qk"
    translation_invariant = True

    def __init__(self, head_dim: int, num_heads: int, num_axes: int, base: float) -> None:
        super().__init__()
        owner = type(self).__name__
        for name, value in (("head_dim", head_dim), ("num_heads", num_heads), ("num_axes", num_axes)):
            _check_positive_int(owner, name, value)
        if head_dim % (2 * num_axes):
            raise ValueError(f"{owner}: head_dim must be divisible by 2 * num_axes = {2 * num_axes} (each axis "
                             f"rotates pairs), got head_dim={head_dim}")
        _check_base(owner, base)
        self.head_dim, self.num_heads, self.num_axes, self.base = head_dim, num_heads, num_axes, float(base)
        width = head_dim // num_axes
        self.basis_generator = nn.Parameter(torch.empty(num_axes, num_heads, width, width))   # S: [A, H, d, d]
        self.frequencies = nn.Parameter(torch.empty(num_axes, num_heads, width // 2))         # theta: [A, H, d/2]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, num_axes={self.num_axes}"

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.basis_generator.zero_()
            width = self.head_dim // self.num_axes
            self.frequencies.copy_(_inverse_frequencies(width, self.base).expand_as(self.frequencies))

    def _basis(self) -> Tensor:
        """Q = matrix_exp(S - S^T): [A, H, d, d], exactly orthogonal (float32 or better: CPU
        matrix_exp is unusable in fp16/bf16)."""
        generator = self.basis_generator.to(_compute_dtype(self.basis_generator.dtype))
        return torch.matrix_exp(generator - generator.mT)

    def _primitives(self) -> Tensor:
        """W = Q R(theta) Q^T: [A, H, d, d]."""
        q = self._basis()
        return q @ _rotation_matrices(self.frequencies.to(q.dtype)) @ q.mT

    @torch.no_grad()
    def _set_primitives(self, w: Tensor) -> None:
        """Load special orthogonal primitives [A, H, d, d]."""
        flat = w.reshape(-1, *w.shape[-2:])
        planes = [_rotation_planes(matrix) for matrix in flat]
        basis = torch.stack([q for q, _ in planes]).view_as(w)
        frequencies = torch.stack([theta for _, theta in planes]).view(*w.shape[:-2], -1)
        generator = torch.stack([_skew_log(q) / 2 for q in basis.reshape(-1, *w.shape[-2:])]).view_as(w)
        self.basis_generator.copy_(generator)
        self.frequencies.copy_(frequencies)

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple:
        """cos and sin of ``p_a theta_{a,h}``: positions [..., N, A] -> two [..., H, A, N, d/2]."""
        angles = positions.to(torch.float64).movedim(-1, -2).unsqueeze(-1) * \
            self.frequencies.transpose(0, 1).to(torch.float64).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _transform(self, x: Tensor, cos: Tensor, sin: Tensor, full: bool) -> Tensor:
        """``blockdiag_a(W_a^{p_a}) x`` (``full``), or ``R(p theta) Q^T x`` (enough for dot products).

        x: [..., H, N, Dh]; cos, sin: [..., H, A, N, d/2] -> [..., H, N, Dh].
        """
        basis = self._basis().to(cos.dtype).transpose(0, 1)                              # [H, A, d, d]
        slices = x.to(cos.dtype).unflatten(-1, (self.num_axes, -1)).transpose(-2, -3)  # [..., H, A, N, d]
        rotated = _rotate(torch.matmul(slices, basis), cos, sin, False, slices.shape[-1])   # R(p theta) Q^T x
        if full:
            rotated = torch.matmul(rotated, basis.mT)                                   # Q R(p theta) Q^T x
        return rotated.transpose(-2, -3).flatten(-2).to(x.dtype)                        # [..., H, N, Dh]

    def _positions_or_default(self, positions: Optional[Tensor], n: int, offset: int, device) -> Tensor:
        """[..., N, A] positions (one axis: arange(N) + offset by default)."""
        positions = _or_default(type(self).__name__, "positions", positions, n, offset, device, self.num_axes)
        return positions.unsqueeze(-1) if self.num_axes == 1 else positions

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``W^p x`` for every token (per axis on grids): x [..., H, N, Dh]."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 3)
        self._check_heads(x, "x")
        positions = _check_positions(owner, "positions", positions, tuple(x.shape[:-2]), x.shape[-2], self.num_axes)
        positions = self._positions_or_default(positions, x.shape[-2], offset, x.device)
        return self._transform(x, *self._cos_sin(positions, _compute_dtype(x.dtype)), full=True)

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        q_len, k_len, dtype = q.shape[-2], k.shape[-2], _compute_dtype(q.dtype)
        cos_k, sin_k = self._cos_sin(self._positions_or_default(positions_k, k_len, 0, k.device), dtype)
        if positions_q is None and positions_k is None and q_len == k_len:
            cos_q, sin_q = cos_k, sin_k
        else:
            positions_q = self._positions_or_default(positions_q, q_len, _query_offset(q_len, k_len), q.device)
            cos_q, sin_q = self._cos_sin(positions_q, dtype)
        return self._transform(q, cos_q, sin_q, full=False), self._transform(k, cos_k, sin_k, full=False)


class AlgebraicSequencePositionalEmbedding(_OrthogonalRotation):
    """Algebraic positional encoding of sequences (Kogkalidis, Bernardy and Garg, NeurIPS 2024).

    "Algebraic Positional Encodings", arXiv:2312.16045. Each head has a learned orthogonal
    primitive ``W`` and a token at position ``p`` is mapped to ``W^p x``, so
    ``<f(q, p), f(k, r)> = q^T W^(r - p) k``. ``W = Q R(theta) Q^T`` is parameterised by a
    basis and frequencies (every rotation has this form), so applying ``W^p`` costs
    ``O(Dh^2)`` per token (a change of basis) plus a rotation, in ``O(B H N Dh)`` memory,
    where the reference materialises ``W^p`` for every position. Initialisation is
    RoPE's, in closed form. ``set_primitives`` loads given special orthogonal matrices
    (a reference checkpoint's ``matrix_exp(P - P^T)``).

    Args:
        head_dim (int): head dim ``Dh`` (even).
        num_heads (int): heads ``H``.
        base (float): RoPE base of the initial frequencies. Default: 10000.0.

    Shape:
        - x: ``[..., H, N, Dh]``; positions: ``[N]`` or ``[B, N]``; ``primitives``: ``[H, Dh, Dh]``.

    Example:
        >>> ape = AlgebraicSequencePositionalEmbedding(64, 8)
        >>> q = k = v = torch.randn(2, 8, 100, 64)
        >>> out = attention(q, k, v, ape, causal=True)
    """

    def __init__(self, head_dim: int, num_heads: int, *, base: float = 10000.0) -> None:
        super().__init__(head_dim, num_heads, 1, base)

    @property
    def primitives(self) -> Tensor:
        """The current primitives ``W``: [H, Dh, Dh]."""
        return self._primitives()[0]

    def set_primitives(self, primitives: Tensor) -> None:
        """Load special orthogonal primitives ``[H, Dh, Dh]`` (``ValueError`` otherwise)."""
        shape = (self.num_heads, self.head_dim, self.head_dim)
        self._set_primitives(_check_special_orthogonal(type(self).__name__, primitives, shape)[None])


class AlgebraicGridPositionalEmbedding(_OrthogonalRotation):
    """Algebraic positional encoding of grids (Kogkalidis, Bernardy and Garg, NeurIPS 2024).

    Axis ``a`` (rows, columns, depth, ...) acts on slice ``a`` of the head dim with its own
    primitive ``W_a`` per head: ``f(x, P) = (W_1^{P_1} (+) W_2^{P_2} (+) ...) x``, so scores depend
    on the per-axis differences only. Queries and keys each use their own positions (the
    reference code applies the query maps to the keys). Parameterised and initialised as
    ``AlgebraicSequencePositionalEmbedding``, per axis.

    Args:
        head_dim (int): head dim ``Dh``, divisible by ``2 * num_axes``.
        num_heads (int): heads ``H``.
        num_axes (int): grid axes ``A``. Default: 2.
        base (float): RoPE base of the initial frequencies. Default: 10000.0.

    Shape:
        - x: ``[..., H, N, Dh]``; positions: ``[N, A]`` or ``[B, N, A]``;
          ``primitives``: ``[A, H, Dh/A, Dh/A]``.

    Example:
        >>> grid = AlgebraicGridPositionalEmbedding(64, 8)
        >>> rows, cols = torch.meshgrid(torch.arange(14), torch.arange(14), indexing="ij")
        >>> q = grid(torch.randn(2, 8, 196, 64), torch.stack([rows, cols], -1).reshape(196, 2))
    """

    def __init__(self, head_dim: int, num_heads: int, num_axes: int = 2, *, base: float = 10000.0) -> None:
        super().__init__(head_dim, num_heads, num_axes, base)

    @property
    def primitives(self) -> Tensor:
        """The current primitives ``W_a``: [A, H, Dh/A, Dh/A]."""
        return self._primitives()

    def set_primitives(self, primitives: Tensor) -> None:
        """Load special orthogonal primitives ``[A, H, Dh/A, Dh/A]`` (``ValueError`` otherwise)."""
        width = self.head_dim // self.num_axes
        shape = (self.num_axes, self.num_heads, width, width)
        self._set_primitives(_check_special_orthogonal(type(self).__name__, primitives, shape))


class AlgebraicTreePositionalEmbedding(PositionalEmbedding):
    """Algebraic positional encoding of trees (Kogkalidis, Bernardy and Garg, NeurIPS 2024).

    Nodes of a complete ``branching_factor``-ary tree are numbered breadth-first (root 0,
    children of ``n`` are ``b n + 1 ... b n + b``). Branch ``c`` has a learned orthogonal
    primitive ``W_c`` per head (``matrix_exp(G - G^T)`` of ``generators``, as in the
    reference), ``M(root) = I``, ``M(child c of n) = M(n) W_c`` and ``f(x, n) = M(n) x``, so
    ``<f(q, n), f(k, m)> = q^T M(n)^T M(m) k`` depends only on the path between ``n`` and
    ``m``. Each token applies its path's primitives to its own vector, one tree level per
    step (at most ``max_depth`` steps): ``O(B H N Dh)`` memory, no per-node matrices.

    Trees that are not complete or not numbered breadth-first convert with
    ``node_ids_from_paths`` (root-to-node branch indices) or ``node_ids_from_parents``
    (a parent array). Initialisation: every branch starts as RoPE's rotation plus a small
    random rotation (std ``init_std``) so siblings differ.

    Args:
        head_dim (int): head dim ``Dh`` (even).
        num_heads (int): heads ``H``.
        branching_factor (int): children per node ``b``.
        max_depth (int): deepest level (the root is level 0).
        base (float): RoPE base of the initial rotation. Default: 10000.0.
        init_std (float): std of the random part of the generators. Default: 0.02.

    Shape:
        - x: ``[..., H, N, Dh]``; positions: integer node ids ``[N]`` or ``[B, N]``;
          ``primitives``: ``[b, H, Dh, Dh]``.

    Example:
        >>> tree = AlgebraicTreePositionalEmbedding(32, 4, branching_factor=2, max_depth=3)
        >>> nodes = tree.node_ids_from_paths([[], [0], [1], [0, 1], [1, 1, 0]])   # tensor([0, 1, 2, 4, 13])
        >>> q = tree(torch.randn(1, 4, 5, 32), nodes)
    """

    kind = "qk"
    integer_positions = True

    def __init__(self, head_dim: int, num_heads: int, branching_factor: int, max_depth: int, *,
                 base: float = 10000.0, init_std: float = 0.02) -> None:
        super().__init__()
        owner = type(self).__name__
        for name, value in (("head_dim", head_dim), ("num_heads", num_heads),
                            ("branching_factor", branching_factor), ("max_depth", max_depth)):
            _check_positive_int(owner, name, value)
        if head_dim % 2:
            raise ValueError(f"{owner}: head_dim must be even, got head_dim={head_dim}")
        _check_base(owner, base)
        self.head_dim, self.num_heads, self.branching_factor, self.max_depth = head_dim, num_heads, branching_factor, max_depth
        self.base, self.init_std = float(base), init_std
        self.generators = nn.Parameter(torch.empty(branching_factor, num_heads, head_dim, head_dim))  # G: [b, H, Dh, Dh]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_heads={self.num_heads}, branching_factor={self.branching_factor}, "
                f"max_depth={self.max_depth}")

    def reset_parameters(self) -> None:
        with torch.no_grad():
            theta = _inverse_frequencies(self.head_dim, self.base, self.generators.device)   # [Dh/2]
            rope = _plane_blocks(torch.zeros_like(theta), theta / 2)                       # G - G^T = J(theta)
            self.generators.copy_(rope + self.init_std * torch.randn_like(self.generators))

    @property
    def primitives(self) -> Tensor:
        """The current primitives ``W_c``: [b, H, Dh, Dh] (float32 or better)."""
        generators = self.generators.to(_compute_dtype(self.generators.dtype))
        return torch.matrix_exp(generators - generators.mT)

    @torch.no_grad()
    def set_primitives(self, primitives: Tensor) -> None:
        """Load special orthogonal primitives ``[b, H, Dh, Dh]`` (``ValueError`` otherwise)."""
        shape = (self.branching_factor, self.num_heads, self.head_dim, self.head_dim)
        w = _check_special_orthogonal(type(self).__name__, primitives, shape)
        logs = torch.stack([_skew_log(matrix) for matrix in w.reshape(-1, *shape[-2:])]).view(shape)
        self.generators.copy_(logs / 2)

    def node_ids_from_paths(self, paths: list) -> Tensor:
        """Breadth-first ids of nodes given as root-to-node branch lists (``[]`` is the root)."""
        ids = []
        for path in paths:
            node = 0
            for branch in path:
                if not 0 <= branch < self.branching_factor:
                    raise ValueError(f"{type(self).__name__}: branch indices must lie in [0, {self.branching_factor}), "
                                     f"got {branch} in path {path}")
                node = self.branching_factor * node + 1 + branch
            ids.append(node)
        return torch.tensor(ids)

    def node_ids_from_parents(self, parents: list) -> Tensor:
        """Breadth-first ids of a tree given as a parent array (``-1`` for the root).

        A node's branch is its rank among its siblings, in the order they appear.
        """
        owner = type(self).__name__
        ids, rank = [None] * len(parents), [0] * len(parents)
        for node in self._topological(parents):
            parent = parents[node]
            if parent < 0:
                ids[node] = 0
                continue
            if rank[parent] >= self.branching_factor:
                raise ValueError(f"{owner}: node {parent} has more than branching_factor={self.branching_factor} children")
            ids[node] = self.branching_factor * ids[parent] + 1 + rank[parent]
            rank[parent] += 1
        return torch.tensor(ids)

    @staticmethod
    def _topological(parents: list) -> list:
        """Node indices, parents before children, siblings in input order."""
        children = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        if len(children.get(-1, [])) != 1:
            raise ValueError(f"AlgebraicTreePositionalEmbedding: parents must contain exactly one root (-1), got {parents}")
        order, frontier = [], children[-1]
        while frontier:
            order += frontier
            frontier = [child for node in frontier for child in children.get(node, [])]
        if len(order) != len(parents):
            raise ValueError(f"AlgebraicTreePositionalEmbedding: parents must form one tree, got {parents}")
        return order

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``M(n) x`` for every token at node ``n``: x [..., H, N, Dh]; default nodes ``arange(N) + offset``."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 3)
        self._check_heads(x, "x")
        positions = _check_positions(owner, "positions", positions, tuple(x.shape[:-2]), x.shape[-2], integer=True)
        return self._transform(x, _or_default(owner, "positions", positions, x.shape[-2], offset, x.device))

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        owner = type(self).__name__
        q_len, k_len = q.shape[-2], k.shape[-2]
        positions_q = _or_default(owner, "positions_q", positions_q, q_len, _query_offset(q_len, k_len), q.device)
        positions_k = _or_default(owner, "positions_k", positions_k, k_len, 0, k.device)
        return self._transform(q, positions_q), self._transform(k, positions_k)

    def _transform(self, x: Tensor, nodes: Tensor) -> Tensor:
        """x [..., H, N, Dh], nodes [..., N] -> M(node) x, applying the deepest branch first."""
        steps = self._check_nodes(nodes)
        dtype = _compute_dtype(x.dtype)
        b, dh = self.branching_factor, self.head_dim
        # every branch's map side by side, so one GEMM per level applies all of them: out @ [W_0^T | ... | W_b-1^T]
        maps = self.primitives.to(dtype).permute(1, 3, 0, 2).reshape(self.num_heads, dh, b * dh)   # [H, Dh, b Dh]
        out, nodes = x.to(dtype), nodes.unsqueeze(-1)                                    # nodes: [..., N, 1]
        for _ in range(steps):  # M(n) x = W_c1 (W_c2 (... W_cd x)): peel the last branch off n
            branch = torch.where(nodes > 0, (nodes - 1) % b, b)                          # b: the root stays
            candidates = torch.matmul(out, maps).unflatten(-1, (b, dh))                  # [..., H, N, b, Dh]
            for c in range(b):
                out = torch.where(branch == c, candidates[..., c, :], out)
            nodes = torch.where(nodes > 0, (nodes - 1) // b, nodes)
        return out.to(x.dtype)

    def _check_nodes(self, nodes: Tensor) -> int:
        """Validate node ids; return how many levels to peel (max_depth while tracing)."""
        owner = type(self).__name__
        if _skip_value_checks(nodes) or nodes.numel() == 0:
            return self.max_depth
        b = self.branching_factor
        last = (b ** (self.max_depth + 1) - 1) // (b - 1) - 1 if b > 1 else self.max_depth   # last node id
        low, high = int(nodes.min()), int(nodes.max())
        if low < 0 or high > last:
            bad = low if low < 0 else high
            raise ValueError(f"{owner}: node ids must lie in [0, {last}] (depth <= max_depth={self.max_depth} "
                             f"of a {b}-ary tree), got {bad}")
        depth, first = 0, 1  # first id of level depth + 1
        while high >= first:
            depth, first = depth + 1, first * b + 1
        return depth


# ---------------------------------------------------------------------------
# Recurrent: Heinsen's exponentiated-state position encoding
# ---------------------------------------------------------------------------


def _log_linear_scan(log_p: Tensor, h: Tensor, initial: Tensor) -> Tensor:
    """``s_t = log(exp(log_p_t + s_{t-1}) + exp(h_t))`` from ``s_0 = initial``, in parallel.

    log_p, h: [..., N, d]; initial: [..., 1, d] -> s: [..., N, d]. The closed form
    ``s = a + log(exp(s_0) + cumsum(exp(h - a)))`` with ``a = cumsum(log_p)`` (Heinsen;
    Martin and Cundy, arXiv:1709.04057) cancels two numbers of size ``|a|``, which grows with
    N. So the sequence is cut into blocks of ``_SCAN_BLOCK`` tokens (one block if shorter),
    each scanned from an empty state (``_scan_blocks``); the blocks are chained by the same
    recurrence over their summaries in float64, exact enough at any length for
    ``1 / _SCAN_BLOCK`` of the work, and each block then adds the state it inherits, decayed
    by ``a`` within the block.
    """
    n = log_p.shape[-2]
    size = min(n, _SCAN_BLOCK)                                                          # T
    pad = -n % size
    if pad:  # zero decay and -inf updates leave the state alone
        log_p, h = F.pad(log_p, (0, 0, 0, pad)), F.pad(h, (0, 0, 0, pad), value=float("-inf"))
    blocks = (n + pad) // size
    a, local = _scan_blocks(log_p.unflatten(-2, (blocks, size)), h.unflatten(-2, (blocks, size)))
    decay = a[..., -1, :].double()                                                      # [..., nb, d]
    after = _log_linear_scan_exact(decay, local[..., -1, :].double(), initial.double())
    entering = torch.cat([initial.double(), after[..., :-1, :]], dim=-2).to(a.dtype)   # [..., nb, d]
    s = torch.logaddexp(a.add_(entering.unsqueeze(-2)), local)                          # [..., nb, T, d]
    return s.flatten(-3, -2)[..., :n, :]


def _scan_blocks(log_p: Tensor, h: Tensor) -> tuple:
    """Every block scanned from an empty state (``s = log 0``), all blocks at once.

    log_p, h: [..., nb, T, d] -> (a, local), both [..., nb, T, d]: ``a = cumsum(log_p)`` and
    ``local_t = log(exp(log_p_t + local_{t-1}) + exp(h_t))``. Eager mode steps through the
    ``T`` tokens of every block together: one rounding per step, and ~6x faster on CPU than
    ``logcumsumexp``; traced code uses the closed form, one fused expression.
    """
    a = log_p.cumsum(dim=-2)
    if _is_compiling():
        return a, torch.logcumsumexp(h - a, dim=-2).add_(a)
    local = torch.empty_like(h)
    local[..., 0, :] = h[..., 0, :]
    for t in range(1, h.shape[-2]):
        torch.logaddexp(local[..., t - 1, :] + log_p[..., t, :], h[..., t, :], out=local[..., t, :])
    return a, local


def _log_linear_scan_exact(log_p: Tensor, h: Tensor, initial: Tensor) -> Tensor:
    """The closed form in one piece: accurate while ``|cumsum(log_p)|`` stays small for the dtype."""
    a = log_p.cumsum(dim=-2)                                                            # [..., N, d]
    return torch.logaddexp(initial, torch.logcumsumexp(h - a, dim=-2)).add_(a)


_SCAN_BLOCK = 128


class _LogLinearScanFunction(torch.autograd.Function):
    """``_log_linear_scan`` with an analytic backward that keeps only (log_p, h, s).

    With ``c_t = exp(log_p_t + s_{t-1} - s_t)`` (the share of the old state) and
    ``w_t = exp(h_t - s_t)`` (the share of the update), the gradient ``G`` reaching ``s``
    satisfies ``G_t = g_t + c_{t+1} G_{t+1}``; its positive and negative parts are two
    reversed log-space scans of the same kind. Then ``dL/dh = G w``, ``dL/dlog_p = G c``.
    Autograd through the closed form would keep three more ``[..., N, d]`` tensors.
    """

    @staticmethod
    def forward(ctx, log_p: Tensor, h: Tensor, initial: Tensor) -> Tensor:
        s = _log_linear_scan(log_p, h, initial)                                         # [..., N, d]
        ctx.save_for_backward(log_p, h, initial, s)
        return s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        log_p, h, initial, s = ctx.saved_tensors
        # The reversed scan at step tau (token t = N + 1 - tau) applies c_{t+1}: log c flipped, shifted by one.
        # Temporaries are reused in place: this runs on [..., N, d] tensors and peak memory matters.
        log_next = torch.zeros_like(s)
        log_next[..., 1:, :] = _log_keep(log_p, s, initial)[..., 1:, :].flip(-2)
        flipped = grad.flip(-2)
        positive = _log_linear_scan(log_next, flipped.clamp(min=0).log(), torch.full_like(initial, float("-inf")))
        negative = _log_linear_scan(log_next, flipped.neg_().clamp_(min=0).log_(), torch.full_like(initial, float("-inf")))
        del log_next, flipped
        total = positive.exp_().sub_(negative.exp_()).flip(-2)                           # G: [..., N, d]
        del positive, negative
        grad_h = (h - s).exp_().mul_(total)                                              # G w
        grad_log_p = total.mul_(_log_keep(log_p, s, initial).exp_())                     # G c
        return grad_log_p, grad_h, grad_log_p[..., :1, :].clone()


def _log_keep(log_p: Tensor, s: Tensor, initial: Tensor) -> Tensor:
    """``log c_t = log_p_t + s_{t-1} - s_t``: the log share of the old state in ``s_t``, [..., N, d]."""
    previous = torch.cat([initial.expand_as(s[..., :1, :]), s[..., :-1, :]], dim=-2)   # s_{t-1}
    return previous.sub_(s).add_(log_p)


class HeinsenPositionalEmbedding(PositionalEmbedding):
    """Position by decaying and updating exponentiated states (Heinsen 2024).

    Heinsen, "Encoding Position by Decaying and Updating Different Exponentiated States
    Differently". Each token gives log-decays ``log_p = logsigmoid(H(x)[..., :d_hid])`` and
    updates ``h = H(x)[..., d_hid:]``; the log-states follow
    ``s_t = log(exp(log_p_t + s_{t-1}) + exp(h_t))`` from ``s_0 = 0``, and the tokens become
    ``x + R(s)``. Order is encoded by the recurrence itself, so there are no positions and
    no maximum length. ``H`` and ``R`` are the paper's functions (``nn.Linear`` by default,
    any module with the same input and output sizes works), and a checkpoint of the
    reference ``EmbedPosition`` (``H.weight, H.bias, R.weight, R.bias``) loads unchanged.

    The scan runs in float32 (float64 for float64 inputs) whatever the input dtype, in
    blocks chained in float64, so it stays accurate at a million tokens; the reference's
    single ``cumsum`` + ``logcumsumexp`` loses accuracy linearly with length.

    Streaming: ``using_prev_context=True`` continues from the state cached by the previous
    call (detached, as the reference does: truncated backprop). For explicit control pass
    ``state=`` (the log-state before the chunk, ``[..., 1, d_hid]``) and ask for
    ``return_state=True``: the returned state is not detached, so gradients flow across
    chunks unless you detach it.

    Args:
        d_emb (int): token width ``D``.
        d_hid (int): number of exponentiated states.
        H (nn.Module, optional): ``[..., D] -> [..., 2 * d_hid]``. Default: ``nn.Linear``.
        R (nn.Module, optional): ``[..., d_hid] -> [..., D]``. Default: ``nn.Linear``.

    Shape:
        - x: ``[..., N, D]`` -> ``[..., N, D]``; state: ``[..., 1, d_hid]``.

    Example:
        >>> embed = HeinsenPositionalEmbedding(d_emb=512, d_hid=512)
        >>> y = embed(torch.randn(2, 1000, 512))
        >>> y_next = embed(torch.randn(2, 1000, 512), using_prev_context=True)
    """

    kind = "input"

    def __init__(self, d_emb: int, d_hid: int, *, H: Optional[nn.Module] = None,
                 R: Optional[nn.Module] = None) -> None:
        super().__init__()
        owner = type(self).__name__
        _check_positive_int(owner, "d_emb", d_emb)
        _check_positive_int(owner, "d_hid", d_hid)
        self.d_emb, self.d_hid = d_emb, d_hid
        self.H = nn.Linear(d_emb, 2 * d_hid) if H is None else H                        # paper's H (no sigmoid)
        self.R = nn.Linear(d_hid, d_emb) if R is None else R                            # paper's R
        self.register_buffer("prev_context", None, persistent=False)                    # [..., 1, d_hid]

    def extra_repr(self) -> str:
        return f"d_emb={self.d_emb}, d_hid={self.d_hid}"

    def reset_parameters(self) -> None:
        for module in (*self.H.modules(), *self.R.modules()):  # custom H, R: every layer inside
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self.reset_context()

    def reset_context(self) -> None:
        """Forget the cached state (the next call must not use ``using_prev_context``)."""
        self.prev_context = None

    def _apply(self, fn, recurse=True):
        # the cached state follows device moves but keeps its float32 precision under casts
        context, self.prev_context = self.prev_context, None
        super()._apply(fn, recurse)
        if context is not None:
            self.prev_context = context.to(fn(torch.empty(0, device=context.device)).device)
        return self

    def forward(self, x: Tensor, using_prev_context: bool = False, *, state: Optional[Tensor] = None,
                return_state: bool = False):
        """``x + R(s)``; with ``return_state=True`` also the final log-state ``[..., 1, d_hid]``."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.d_emb)
        if using_prev_context and state is not None:
            raise ValueError(f"{owner}: pass either using_prev_context=True or state=, not both")
        if using_prev_context:
            if self.prev_context is None:
                raise ValueError(f"{owner}: using_prev_context=True but no context is cached; "
                                 f"call once without it first (or after reset_context())")
            state = self.prev_context
        logits = self.H(x)                                                              # [..., N, 2 * d_hid]
        dtype = _compute_dtype(logits.dtype)
        log_p = F.logsigmoid(logits[..., : self.d_hid].to(dtype))                      # [..., N, d_hid]
        h = logits[..., self.d_hid :].to(dtype)                                         # [..., N, d_hid]
        initial = self._initial_state(state, x, dtype, "cached context" if using_prev_context else "state")
        if x.shape[-2] == 0:  # an empty chunk leaves the stream where it was
            self.prev_context = initial.detach()
            return (x, initial) if return_state else x
        s = _LogLinearScanFunction.apply(log_p, h, initial)                            # [..., N, d_hid]
        final = s[..., -1:, :]                                                          # [..., 1, d_hid]
        self.prev_context = final.detach()
        y = x + self.R(s.to(logits.dtype)).to(x.dtype)                                  # [..., N, D]
        return (y, final) if return_state else y

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        if positions is not None:
            raise ValueError(f"{type(self).__name__}: positions must be None: order is encoded by the "
                             f"recurrence, got a tensor of shape {tuple(positions.shape)}")
        return self(x)

    def _initial_state(self, state: Optional[Tensor], x: Tensor, dtype: torch.dtype, name: str) -> Tensor:
        """The log-state before the first token: zeros, or ``state`` checked against x: [..., 1, d_hid]."""
        want = (*x.shape[:-2], 1, self.d_hid)
        if state is None:
            return torch.zeros(want, dtype=dtype, device=x.device)
        if not isinstance(state, Tensor):
            raise TypeError(f"{type(self).__name__}: {name} must be a Tensor, got {type(state).__name__}")
        if state.is_inference() and not torch.is_inference_mode_enabled():
            state = state.clone()  # a state cached under inference_mode, continued in training
        if tuple(state.shape) != want:
            raise ValueError(f"{type(self).__name__}: {name} must have shape {list(want)} to continue a chunk "
                             f"of shape {list(x.shape)}, got {list(state.shape)}")
        return state.to(device=x.device, dtype=dtype)


EmbedPosition = HeinsenPositionalEmbedding


# ---------------------------------------------------------------------------
# Registry and demo
# ---------------------------------------------------------------------------


def _demo_modules(num_heads: int, head_dim: int, seq_len: int) -> dict:
    """One instance of every encoding at demo size, by short name."""
    dim = num_heads * head_dim
    return {
        "sinusoidal": SinusoidalPositionalEmbedding(dim),
        "learned": LearnedPositionalEmbedding(seq_len, dim),
        "rotary": RotaryPositionalEmbedding(head_dim),
        "t5": T5PositionalEmbedding(num_heads),
        "alibi": ALiBiPositionalEmbedding(num_heads),
        "tupe": UnifiedPositionalEmbedding(seq_len, num_heads, head_dim, cls_token=True),
        "transformer_xl": TransformerXLPositionalEmbedding(num_heads, head_dim),
        "enformer": EnformerPositionalEmbedding(num_heads, head_dim),
        "algebraic_seq": AlgebraicSequencePositionalEmbedding(head_dim, num_heads),
        "algebraic_grid": AlgebraicGridPositionalEmbedding(head_dim, num_heads),
        "algebraic_tree": AlgebraicTreePositionalEmbedding(head_dim, num_heads, branching_factor=2,
                                                           max_depth=seq_len.bit_length()),   # nodes 0 .. N-1
        "heinsen": HeinsenPositionalEmbedding(dim, dim),
    }


def _demo_positions(pe: PositionalEmbedding, seq_len: int) -> Optional[Tensor]:
    """Positions for encodings that need them: a square grid for multi-axis ones."""
    if pe.num_axes == 1:
        return None
    side = math.isqrt(seq_len)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(seq_len, 2)


def _demo() -> None:
    import time

    torch.manual_seed(0)
    batch, heads, head_dim, seq_len = 2, 8, 64, 256
    x = torch.randn(batch, seq_len, heads * head_dim)
    q, k, v = torch.randn(3, batch, heads, seq_len, head_dim).unbind(0)
    print(f"every encoding on B={batch}, H={heads}, N={seq_len}, Dh={head_dim} (CPU, float32)\n")
    print(f"{'encoding':<16}{'class':<40}{'kind':<8}{'params':>9}  {'output':<18}{'ms':>8}  translation")
    for name, pe in _demo_modules(heads, head_dim, seq_len).items():
        positions = _demo_positions(pe, seq_len)
        start = time.perf_counter()
        tokens = pe.forward_input(x) if pe.kind == "input" else x
        out = attention(q, k, v, pe, positions_q=positions, positions_k=positions, causal=pe.num_axes == 1)
        elapsed = (time.perf_counter() - start) * 1e3
        params = sum(p.numel() for p in pe.parameters())
        invariance = "n/a (acts on the tokens)" if pe.kind == "input" else "n/a (absolute positions)"
        if isinstance(pe, AlgebraicTreePositionalEmbedding):
            invariance = "n/a (depends on tree paths)"
        if pe.translation_invariant:
            shift = (torch.arange(seq_len) if positions is None else positions) + 1000
            base = pe.forward_attn(q, k, positions, positions)
            shifted = pe.forward_attn(q, k, shift, shift)
            gap = torch.where(base == shifted, 0.0, base - shifted).abs().max().item()   # -inf == -inf
            invariance = f"max |logits(p) - logits(p + 1000)| = {gap:.1e}"
        shape = str(tuple(out.shape if pe.kind != "input" else tokens.shape))
        print(f"{name:<16}{type(pe).__name__:<40}{pe.kind:<8}{params:>9}  {shape:<18}{elapsed:>8.2f}  {invariance}")


if __name__ == "__main__":
    _demo()

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

Shape legend used in every docstring and comment: ``B`` batch, ``H`` heads,
``N`` tokens (``Nq`` queries, ``Nk`` keys), ``D`` model dim, ``Dh`` head dim,
``A`` position axes, ``F`` frequencies (``D / 2``).
"""

import math
from typing import Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "PositionalEmbedding",
    "attention",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
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
) -> Optional[Tensor]:
    """Validate ``positions`` for a tensor ``[*lead, N, ...]``; return them broadcastable, or None.

    Accepted shapes are ``[N]`` and ``[B, N]`` (``B == lead[0]``), with a trailing
    ``A`` axis when ``num_axes > 1``. ``[B, N]`` becomes ``[B, 1, ..., 1, N]`` so it
    applies to every head. ``None`` stays None: the caller applies its default.
    """
    axes = () if num_axes == 1 else (num_axes,)
    if positions is None:
        return None
    if not isinstance(positions, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"{owner}: {name} must be an integer or float tensor, got dtype={positions.dtype}")
    core = tuple(positions.shape[: positions.dim() - len(axes)])
    batched = len(core) == 2 and len(lead) >= 1 and core == (lead[0], n)
    if tuple(positions.shape[len(core):]) != axes or not (core == (n,) or batched):
        suffix = "".join(f", {a}" for a in axes)
        want = f"[{n}{suffix}]" + (f" or [{lead[0]}, {n}{suffix}]" if lead else "")
        raise ValueError(f"{owner}: {name} must have shape {want}, got {tuple(positions.shape)}")
    if batched:  # [B, N(, A)] -> [B, 1, ..., 1, N(, A)]
        positions = positions.reshape(lead[0], *([1] * (len(lead) - 1)), n, *axes)
    return positions


def _or_default(owner: str, name: str, positions: Optional[Tensor], n: int, offset: int, device,
                num_axes: int = 1) -> Tensor:
    """``positions`` on ``device``, or ``arange(n) + offset`` (an error for several axes)."""
    if positions is not None:
        return positions.to(device)
    if num_axes > 1:
        raise ValueError(f"{owner}: {name} is required for {num_axes} axes, shape [..., {n}, {num_axes}], got None")
    return _default_positions(n, offset, device)


def _token_positions(owner: str, positions: Optional[Tensor], x: Tensor, offset: int, num_axes: int = 1) -> Tensor:
    """Positions for the tokens of ``x`` ``[..., N, D]``: validated, or ``arange(N) + offset``."""
    n = x.shape[-2]
    checked = _check_positions(owner, "positions", positions, tuple(x.shape[:-2]), n, num_axes)
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
    ``"logits"``, ``forward_attn``); ``forward_input`` and ``forward_attn`` are built
    from them, and ``attention()`` picks the efficient path from ``kind``.

    Derived tables (frequencies, slopes, caches) are non-persistent buffers built by
    ``_init_buffers``; every ``.to()`` / ``.half()`` / ``to_empty()`` rebuilds them in
    full precision on the new device, so a dtype cast never degrades them.
    """

    kind: str = "input"
    relative: bool = False  # logits depend only on position differences
    num_axes: int = 1       # position axes A: positions are [..., N] or, for A > 1, [..., N, A]

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
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale                          # [B, H, Nq, Nk]
        bias = self.attention_bias(q.shape[-2], k.shape[-2], positions_q, positions_k, device=q.device)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def _check_qk(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor],
                  positions_k: Optional[Tensor]) -> tuple:
        """Validate q, k and their positions; return the positions broadcastable (or None)."""
        owner = type(self).__name__
        _check_qk(owner, q, k)
        lead = tuple(q.shape[:-2])
        return (_check_positions(owner, "positions_q", positions_q, lead, q.shape[-2], self.num_axes),
                _check_positions(owner, "positions_k", positions_k, lead, k.shape[-2], self.num_axes))

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


def _check_qk(owner: str, q: Tensor, k: Tensor) -> None:
    """q: [..., Nq, Dh], k: [..., Nk, Dh] with matching leading dims and Dh."""
    _check_tensor(owner, "q", q, 2)
    _check_tensor(owner, "k", k, 2)
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{owner}: q and k must agree on leading dims and head dim, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )


def _causal_mask(q_len: int, k_len: int, device) -> Tensor:
    """Boolean [Nq, Nk]; True where key j may be seen by query i (bottom-right aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(_query_offset(q_len, k_len))


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
) -> Tensor:
    """Softmax attention with positional encoding ``pe``, through the cheapest correct path.

    ``"input"`` encodings (already added to the tokens) and ``pe=None`` run plain
    ``scaled_dot_product_attention``; ``"qk"`` encodings transform q and k and then
    run SDPA; ``"bias"`` encodings pass their bias as a float mask to SDPA;
    ``"logits"`` encodings compute their logits explicitly and apply the softmax.

    Args:
        q (Tensor): queries ``[B, H, Nq, Dh]``.
        k (Tensor): keys ``[B, H, Nk, Dh]``.
        v (Tensor): values ``[B, H, Nk, Dv]``.
        pe (PositionalEmbedding, optional): the encoding. Default: None.
        positions_q, positions_k (Tensor, optional): ``[N]`` or ``[B, N]`` positions.
            Default: keys ``arange(Nk)``, queries the last ``Nq`` of them.
        causal (bool): mask keys after each query, bottom-right aligned when
            ``Nq < Nk`` (decoding with a cache). Index based, not position based.
            Default: False.
        attn_mask (Tensor, optional): boolean (True = attend) or additive float mask
            broadcastable to ``[B, H, Nq, Nk]``. Default: None.
        scale (float, optional): logit scale. Default: ``1 / sqrt(Dh)``.
        dropout_p (float): dropout on the attention weights. Default: 0.0.

    Shape:
        - Output: ``[B, H, Nq, Dv]``.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> q = k = v = torch.randn(2, 4, 16, 64)
        >>> attention(q, k, v, rope, causal=True).shape
        torch.Size([2, 4, 16, 64])
    """
    owner = "attention"
    _check_qk(owner, q, k)
    _check_tensor(owner, "v", v, 2)
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{owner}: v must match k on every dim but the last, got v {tuple(v.shape)} and k {tuple(k.shape)}")
    if pe is not None and not isinstance(pe, PositionalEmbedding):
        raise TypeError(f"{owner}: pe must be a PositionalEmbedding or None, got {type(pe).__name__}")
    q_len, k_len = q.shape[-2], k.shape[-2]
    if pe is not None and pe.kind == "logits":
        logits = pe.forward_attn(q, k, positions_q, positions_k, scale=scale)              # [B, H, Nq, Nk]
        mask = _merge_masks(None, attn_mask, causal, q_len, k_len, logits.dtype, q.device)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        weights = torch.softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1).to(v.dtype)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        return torch.matmul(weights, v)                                                 # [B, H, Nq, Dv]
    bias = None
    if pe is not None:
        positions_q, positions_k = pe._check_qk(q, k, positions_q, positions_k)
        q, k = pe.encode_qk(q, k, positions_q, positions_k)
        bias = pe.attention_bias(q_len, k_len, positions_q, positions_k, device=q.device)
    if bias is None and attn_mask is None and causal and q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    mask = _merge_masks(bias, attn_mask, causal, q_len, k_len, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


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
        if not isinstance(num_axes, int) or num_axes < 1:
            raise ValueError(f"{owner}: num_axes must be a positive int, got num_axes={num_axes!r}")
        if not isinstance(dim, int) or dim <= 0 or dim % (2 * num_axes):
            raise ValueError(f"{owner}: dim must be a positive multiple of 2 * num_axes = {2 * num_axes}, "
                             f"got dim={dim!r}")
        if not base > 0:
            raise ValueError(f"{owner}: base must be positive, got base={base!r}")
        if layout not in ("interleaved", "concat"):
            raise ValueError(f"{owner}: layout must be 'interleaved' or 'concat', got layout={layout!r}")
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
        positions = _token_positions(owner, positions, x, offset, self.num_axes)
        return x + self.embed(positions).to(x.dtype)

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

    def __init__(self, max_len: int, dim: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        owner = type(self).__name__
        for name, value in (("max_len", max_len), ("dim", dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{owner}: {name} must be a positive int, got {name}={value!r}")
        self.max_len, self.dim, self.init_std = max_len, dim, init_std
        self.weight = nn.Parameter(torch.empty(max_len, dim))                            # [max_len, D]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def embed(self, positions: Tensor) -> Tensor:
        """Rows of the table for integer ``positions`` ``[..., N]``: ``[..., N, D]``."""
        self._check_range(positions)
        return F.embedding(positions, self.weight)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x + embed(positions)``; default positions ``arange(N) + offset``."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.dim)
        return x + self.embed(_token_positions(owner, positions, x, offset)).to(x.dtype)

    def _check_range(self, positions: Tensor) -> None:
        owner = type(self).__name__
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise TypeError(f"{owner}: positions must be an integer tensor, got "
                            f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
        if _is_compiling() or positions.numel() == 0:
            return
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= self.max_len:
            bad = low if low < 0 else high
            raise ValueError(
                f"{owner}: positions must lie in [0, max_len={self.max_len}), got position {bad}; "
                f"resize() the table for longer inputs"
            )

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
        prefix, table = self.weight[:num_prefix_tokens], self.weight[num_prefix_tokens:].float()  # [L, D]
        if isinstance(new_size, int) and new_size > num_prefix_tokens:
            rows = F.interpolate(table.T[None], size=new_size - num_prefix_tokens,
                                 mode=mode or "linear", align_corners=False)[0].T           # [new, D]
        elif isinstance(new_size, tuple) and len(new_size) == 2 and all(isinstance(s, int) and s > 0 for s in new_size):
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
# Registry and demo
# ---------------------------------------------------------------------------


def _demo_modules(num_heads: int, head_dim: int, seq_len: int) -> dict:
    """One instance of every encoding at demo size, by short name."""
    dim = num_heads * head_dim
    return {
        "sinusoidal": SinusoidalPositionalEmbedding(dim),
        "learned": LearnedPositionalEmbedding(seq_len, dim),
    }


def _demo() -> None:
    import time

    torch.manual_seed(0)
    batch, heads, head_dim, seq_len = 2, 8, 64, 256
    x = torch.randn(batch, seq_len, heads * head_dim)
    q, k, v = torch.randn(3, batch, heads, seq_len, head_dim).unbind(0)
    print(f"every encoding on B={batch}, H={heads}, N={seq_len}, Dh={head_dim} (CPU, float32)\n")
    print(f"{'encoding':<14}{'class':<42}{'kind':<8}{'params':>9}  {'output':<18}{'ms':>8}  translation")
    for name, pe in _demo_modules(heads, head_dim, seq_len).items():
        start = time.perf_counter()
        tokens = pe.forward_input(x) if pe.kind == "input" else x
        out = attention(q, k, v, pe, causal=True)
        elapsed = (time.perf_counter() - start) * 1e3
        params = sum(p.numel() for p in pe.parameters())
        invariance = "n/a (absolute)"
        if pe.relative:
            shift = torch.arange(seq_len) + 1000
            gap = (pe.forward_attn(q, k) - pe.forward_attn(q, k, shift, shift)).abs().max().item()
            invariance = f"max |logits(p) - logits(p + 1000)| = {gap:.1e}"
        shape = str(tuple(out.shape if pe.kind != "input" else tokens.shape))
        print(f"{name:<14}{type(pe).__name__:<42}{pe.kind:<8}{params:>9}  {shape:<18}{elapsed:>8.2f}  {invariance}")


if __name__ == "__main__":
    _demo()

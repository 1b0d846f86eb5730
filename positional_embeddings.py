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

Length generalisation:

* ``NoPositionalEmbedding``: Kazemnejad et al., "The Impact of Positional Encoding on Length
  Generalization in Transformers", arXiv:2305.19466.
* ``XPosPositionalEmbedding``: Sun et al., "A Length-Extrapolatable Transformer", arXiv:2212.10554.
* ``KerplePositionalEmbedding``: Chi et al., "KERPLE: Kernelized Relative Positional Embedding for
  Length Extrapolation", arXiv:2205.09921.
* ``SandwichPositionalEmbedding``: Chi et al., "Dissecting Transformer Length Extrapolation via
  the Lens of Receptive Field Analysis", arXiv:2212.10356.
* ``FIREPositionalEmbedding``: Li et al., "Functional Interpolation for Relative Positions
  Improves Long Context Transformers", arXiv:2310.04418.
* ``CoPEPositionalEmbedding``: Golovneva et al., "Contextual Position Encoding: Learning to Count
  What's Important", arXiv:2405.18719.
* ``ForgettingPositionalEmbedding``: Lin et al., "Forgetting Transformer: Softmax Attention with
  a Forget Gate", arXiv:2503.02130.
* ``QueryTemperaturePositionalEmbedding``: Llama 4's attention temperature tuning on its NoPE layers
  (Meta's Llama 4, 2025; transformers' ``modeling_llama4.py``).
* ``InklingPositionalEmbedding``: Thinking Machines' Inkling models (no paper; transformers 5.24's
  ``InklingRelativeLogits`` / ``Inkling2RelativePositionBias``, x-transformers'
  ``RelativeProjPositionalBias``).

Classic relative attention (content x position, with a value term):

* ``ShawPositionalEmbedding``: Shaw, Uszkoreit and Vaswani, "Self-Attention with Relative Position
  Representations", arXiv:1803.02155; ``key_query``: Huang et al., "Improve Transformer Models
  with Better Relative Position Embeddings", arXiv:2009.13658.
* ``DebertaPositionalEmbedding``: He et al., "DeBERTa: Decoding-enhanced BERT with Disentangled
  Attention", arXiv:2006.03654 (v2/v3 log buckets).

Images, video and coordinates:

* ``RelativePositionBias2D``: Liu et al., "Swin Transformer", arXiv:2103.14030; Bao et al.,
  "BEiT: BERT Pre-Training of Image Transformers", arXiv:2106.08254.
* ``ContinuousPositionBias``: Liu et al., "Swin Transformer V2: Scaling Up Capacity and
  Resolution", arXiv:2111.09883.
* ``DynamicPositionBias``: Wang et al., "CrossFormer: A Versatile Vision Transformer Hinging on
  Cross-scale Attention", arXiv:2108.00154 (x-transformers' layout).
* ``VideoRotaryPositionalEmbedding``: Wei et al., "VideoRoPE: What Makes for Good Video Rotary
  Position Embedding?", arXiv:2502.05173.
* ``MixedRotaryPositionalEmbedding``: Heo et al., "Rotary Position Embedding for Vision
  Transformer", arXiv:2403.13298 (RoPE-Mixed); ``rope_coordinates``: DINOv3's normalised
  and augmented patch coordinates (Simeoni et al., arXiv:2508.10104).
* ``LieREPositionalEmbedding``: Ostmeier et al., "LieRE: Generalizing Rotary Position Encodings",
  arXiv:2406.10322.
* ``STRINGPositionalEmbedding``: Schenck et al., "Learning the RoPE: Better 2D and 3D Position
  Encodings with STRING", arXiv:2502.02562.
* ``ComRoPEPositionalEmbedding``: Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding
  Parameterized by Trainable Commuting Angle Matrices", arXiv:2506.03737.
* ``ConvolutionalPositionalEmbedding``: Chu et al., "Conditional Positional Encodings for Vision
  Transformers" (CPVT's PEG), arXiv:2102.10882; Baevski et al., "wav2vec 2.0", arXiv:2006.11477.
* ``FourierFeaturePositionalEmbedding``: Mildenhall et al., "NeRF", arXiv:2003.08934; Tancik et al.,
  "Fourier Features Let Networks Learn High Frequency Functions in Low Dimensional Domains",
  arXiv:2006.10739.
* ``LearnableFourierPositionalEmbedding``: Li et al., "Learnable Fourier Features for
  Multi-Dimensional Spatial Positional Encoding", arXiv:2106.02795.

Time:

* ``Time2VecPositionalEmbedding``: Kazemi et al., "Time2Vec: Learning a Vector Representation of
  Time", arXiv:1907.05321.

Graphs:

* ``LaplacianPositionalEmbedding``: Dwivedi et al., "Benchmarking Graph Neural Networks",
  arXiv:2003.00982; SignNet: Lim et al., "Sign and Basis Invariant Networks for Spectral Graph
  Representation Learning", arXiv:2202.13013.
* ``RandomWalkPositionalEmbedding``: Dwivedi et al., "Graph Neural Networks with Learnable
  Structural and Positional Representations", arXiv:2110.07875.

Numbers:

* ``AbacusPositionalEmbedding``: McLeish et al., "Transformers Can Do Arithmetic with the Right
  Embeddings", arXiv:2405.17399; ``digit_positions`` also gives the positions of position
  coupling: Cho et al., "Position Coupling: Improving Length Generalization of Arithmetic
  Transformers Using Task Structure", arXiv:2405.20671.

Model parity and scale: ``document_positions`` (packed sequences), ``from_config`` on the
rotary, T5 and ALiBi classes (Hugging Face configs), ``shard_positions``,
``sharded_log_linear_scan`` and ``heinsen_forward_sharded`` (sequence shards over ranks).
``vendor`` (``python positional_embeddings.py vendor NAME ... -o FILE``) writes a standalone file
with only the encodings you name, ``attention()`` and what they use.

Shape legend used in every docstring and comment: ``B`` batch, ``H`` heads,
``N`` tokens (``Nq`` queries, ``Nk`` keys), ``D`` model dim, ``Dh`` head dim,
``A`` position axes, ``F`` frequencies (``D / 2``).
"""

import functools
import inspect
import itertools
import math
import numbers
import operator
import sys
import weakref
from typing import Literal, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "PositionalEmbedding",
    "attention",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryPositionalEmbedding",
    "HoPEPositionalEmbedding",
    "VideoRotaryPositionalEmbedding",
    "multimodal_position_ids",
    "layer_encodings",
    "diffusers_positions",
    "DiffusersCompatRotaryEmbedding",
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
    "document_positions",
    "NoPositionalEmbedding",
    "XPosPositionalEmbedding",
    "PolarPositionalEmbedding",
    "QueryTemperaturePositionalEmbedding",
    "FoPEPositionalEmbedding",
    "KerplePositionalEmbedding",
    "SandwichPositionalEmbedding",
    "FIREPositionalEmbedding",
    "CoPEPositionalEmbedding",
    "ReRoPEPositionalEmbedding",
    "SelfExtendPositionalEmbedding",
    "DualChunkPositionalEmbedding",
    "RandomizedPositionalEmbedding",
    "randomized_positions",
    "StickBreakingPositionalEmbedding",
    "PaTHPositionalEmbedding",
    "ForgettingPositionalEmbedding",
    "InklingPositionalEmbedding",
    "ShawPositionalEmbedding",
    "DebertaPositionalEmbedding",
    "deberta_log_bucket",
    "RelativePositionBias2D",
    "ContinuousPositionBias",
    "DynamicPositionBias",
    "MixedRotaryPositionalEmbedding",
    "LieREPositionalEmbedding",
    "STRINGPositionalEmbedding",
    "ComRoPEPositionalEmbedding",
    "ConvolutionalPositionalEmbedding",
    "FourierFeaturePositionalEmbedding",
    "LearnableFourierPositionalEmbedding",
    "Time2VecPositionalEmbedding",
    "LaplacianPositionalEmbedding",
    "RandomWalkPositionalEmbedding",
    "GraphormerPositionalEmbedding",
    "AbacusPositionalEmbedding",
    "digit_positions",
    "rope_coordinates",
    "augment_positions",
    "shard_positions",
    "sharded_log_linear_scan",
    "heinsen_forward_sharded",
    "vendor",
]

Tensor = torch.Tensor


# ---------------------------------------------------------------------------
# Helpers: argument checks, positions
# ---------------------------------------------------------------------------

def _is_compiling() -> bool:
    """True while ``torch.compile`` traces: value-dependent checks are skipped."""
    return torch.compiler.is_compiling()


def _is_exporting() -> bool:
    """True while ``torch.export`` traces (torch >= 2.6): one graph must then serve every length the
    export allows, so a branch on a dynamic size (which would pin it) is avoided."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return is_exporting is not None and is_exporting()


def _surely(condition) -> bool:
    """A size condition as a bool; while exporting, True only if it holds for every size the export
    allows (no guard is added, so a dynamic length stays dynamic: the caller takes its general path)."""
    if _is_exporting():
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return statically_known_true(condition)
    return True if condition else False   # an if, not bool(): dynamo before 2.7 guards the one, not the other


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


def _check_generator(owner: str, generator) -> None:
    """A ``generator=`` argument: a ``torch.Generator`` or None."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{owner}: generator must be a torch.Generator or None, got {type(generator).__name__}")


def _as_device(owner: str, name: str, value) -> Optional[torch.device]:
    """A ``device=`` argument: None, a ``torch.device``, a device string or index (``"cpu"``, ``"cuda:0"``, 0); a
    dtype or another type is a TypeError (``.to(torch.float32)`` would cast instead), an unknown string a ValueError."""
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, (str, int)) or _is_bool(value):
        raise TypeError(f"{owner}: {name} must be a torch.device, a device string or an index, got "
                        f"{type(value).__name__} {_describe(value)}")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{owner}: {name} must name a device such as 'cpu' or 'cuda:0', got {value!r}") from None


def _describe(value) -> str:
    """A value for an error message, abbreviated: tensors by shape and dtype, long reprs cut."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(value) -> bool:
    """A Python or numpy bool (numpy 1 names its type ``bool_``, numpy 2 ``bool``).

    While compiling only a Python bool counts: dynamo before torch 2.6 cannot trace the read of
    ``__module__`` (a numpy bool there is then refused by the caller, never taken for an int)."""
    if isinstance(value, bool):
        return True
    if _is_compiling():
        return False
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def _check_flag(owner: str, name: str, value) -> bool:
    """A boolean option: ``True``/``False`` (numpy bools too); a string such as ``"false"`` is a TypeError."""
    if _is_bool(value):
        return bool(value)
    raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {_describe(value)}")


def _as_int(owner: str, name: str, value, minimum: Optional[int] = 1) -> int:
    """An integer size (Python, numpy or torch.SymInt) ``>= minimum``, returned as such."""
    if isinstance(value, torch.SymInt):
        return value
    if _is_bool(value):
        raise TypeError(f"{owner}: {name} must be an int, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {_describe(value)}") from None
    if minimum is not None and number < minimum:
        want = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{owner}: {name} must be {want}, got {name}={number}")
    return number


def _check_positive_int(owner: str, name: str, value, maximum: Optional[int] = None) -> int:
    """A positive integer size (at most ``maximum``); returns it as an int."""
    number = _as_int(owner, name, value, 1)
    if maximum is not None and number > maximum:
        raise ValueError(f"{owner}: {name} must be at most {maximum}, got {name}={number}")
    return number


def _optional_size(owner: str, name: str, value) -> Optional[int]:
    """A positive int, or None (the part it sizes left out)."""
    return None if value is None else _check_positive_int(owner, name, value)


def _as_float(owner: str, name: str, value, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
              exclusive: bool = False) -> float:
    """A finite real number in ``[minimum, maximum]`` (``(minimum, ...]`` when ``exclusive``)."""
    if isinstance(value, Tensor) or _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__} {_describe(value)}")
    number = float(value)
    below = minimum is not None and (number <= minimum if exclusive else number < minimum)
    # abs(x) < inf rather than math.isfinite: dynamo cannot trace math.isfinite under dynamic=True
    if not abs(number) < math.inf or below or (maximum is not None and number > maximum):
        low = "" if minimum is None else f" {'>' if exclusive else '>='} {minimum}"
        high = "" if maximum is None else f"{' and' if low else ''} <= {maximum}"
        raise ValueError(f"{owner}: {name} must be a finite number{low}{high}, got {name}={value!r}")
    return number


def _one_of(owner: str, name: str, value, alias: str, alias_value):
    """A required argument that may also be passed as the keyword ``alias`` (``head_dim=`` for RoPE's
    ``dim``): exactly one of the two, else a TypeError (two values never silently pick one)."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{owner}: pass {name} or {alias}, not both (they are the same argument), "
                        f"got {name}={_describe(value)} and {alias}={_describe(alias_value)}")
    if value is None and alias_value is None:
        raise TypeError(f"{owner}: missing the required argument {name} (or its keyword alias {alias})")
    return alias_value if value is None else value


def _check_choice(owner: str, name: str, value, choices: tuple):
    """One of ``choices`` (strings), else a ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {name}={_describe(value)}")
    return value


def _positive_float(owner: str, name: str, value) -> float:
    return _as_float(owner, name, value, minimum=0.0, exclusive=True)


def _non_negative_float(owner: str, name: str, value) -> float:
    return _as_float(owner, name, value, minimum=0.0)


def _frequency_base(owner: str, name: str, value) -> float:
    """A frequency base: a finite real number > 1."""
    return _as_float(owner, name, value, minimum=1.0, exclusive=True)


def _even_int(owner: str, name: str, value) -> int:
    """A positive even int (a width split into pairs)."""
    if _check_positive_int(owner, name, value) % 2:
        raise ValueError(f"{owner}: {name} must be a positive even int, got {name}={value!r}")
    return operator.index(value)


def _as_list(owner: str, name: str, value) -> list:
    """A list or tuple (a string is not a list of numbers)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}: {name} must be a list, got {type(value).__name__} {_describe(value)}")
    return list(value)


def _as_sizes(owner: str, name: str, value, count: Optional[int] = None) -> tuple:
    """A tuple of positive ints (numpy ints too) from a sequence of ``count`` of them (any number
    for None), or from one int where one may stand for the sequence."""
    sequence = isinstance(value, (tuple, list, torch.Size))
    items = tuple(value) if sequence else (value,)
    if not items or (count is not None and len(items) != count):
        want = ("a positive int or a non-empty sequence of them" if count is None
                else "a positive int" if count == 1 else f"a sequence of {count} positive ints")
        raise ValueError(f"{owner}: {name} must be {want}, got {name}={_describe(value)}")
    if not sequence:
        return (_check_positive_int(owner, name, value),)
    return tuple(_check_positive_int(owner, f"{name}[{i}]", item) for i, item in enumerate(items))


def _check_window(owner: str, name: str, value) -> tuple:
    """A window size: an int ``s`` (the square ``(s, s)``) or a pair ``(Wh, Ww)`` of positive ints."""
    if isinstance(value, (tuple, list)):
        return _as_sizes(owner, name, value, 2)
    size = _check_positive_int(owner, name, value)
    return size, size


def _left_right(owner: str, name: str, value) -> Union[int, tuple]:
    """A clipping distance: a non-negative int, or a pair ``(left, right)`` of them (returned as a tuple)."""
    if not isinstance(value, (tuple, list)):
        return _as_int(owner, name, value, 0)
    if len(value) != 2:
        raise ValueError(f"{owner}: {name} must be an int or a pair (left, right), got {name}={value!r}")
    return tuple(_as_int(owner, name, m, 0) for m in value)


def _attention_terms(owner: str, name: str, value) -> tuple:
    """DeBERTa's ``pos_att_type``: distinct ``"c2p"`` / ``"p2c"``, as a sequence or a ``"p2c|c2p"`` string."""
    terms = [t.strip() for t in value.lower().split("|") if t.strip()] if isinstance(value, str) else value
    if not isinstance(terms, (tuple, list)) or any(t not in ("c2p", "p2c") for t in terms) \
            or len(set(terms)) != len(terms):
        raise ValueError(f"{owner}: {name} must hold distinct 'c2p' / 'p2c', got {name}={terms!r}")
    return tuple(terms)


# Constructor arguments checked by name before any __init__ of an encoding runs (PositionalEmbedding
# wraps every subclass's __init__); a class declares its own in ``arguments``, which take precedence.
# None passes where None is the default. Each check returns the normalised value (an int, a float).
_ARGUMENTS = {
    "num_heads": _check_positive_int, "head_dim": _check_positive_int, "dim": _check_positive_int,
    "hidden_dim": _check_positive_int, "max_len": _check_positive_int, "num_axes": _check_positive_int,
    "base": _frequency_base, "init_std": _non_negative_float,
    "bidirectional": _check_flag, "interleaved": _check_flag,
}


@functools.lru_cache(maxsize=None)
def _declared_check(cls: type, name: str):
    """The check of constructor argument ``name`` for ``cls``: its own ``arguments`` (the nearest class
    declaring it), else the shared ``_ARGUMENTS``, else None."""
    for klass in cls.__mro__:
        declared = vars(klass).get("arguments", {})
        if name in declared:
            return declared[name]
    return _ARGUMENTS.get(name)


@functools.lru_cache(maxsize=None)
def _signature(init) -> inspect.Signature:
    return inspect.signature(init)


def _checking_arguments(init, rules: tuple = ()):
    """``init`` with its declared arguments checked and normalised first (see ``_ARGUMENTS``), then the
    ``rules`` of its class run on all of them: ``rule(owner, arguments)``, ``arguments`` a dict of every
    parameter (defaults filled in), for what relates several arguments."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        if _is_compiling():  # built inside a traced function (a bound copy): the arguments come from a module
            return init(self, *args, **kwargs)
        signature = _signature(init)
        bound = signature.bind(self, *args, **kwargs)
        owner = type(self).__name__
        for name, value in list(bound.arguments.items())[1:]:
            check = _declared_check(type(self), name)
            if check is not None and not (value is None and signature.parameters[name].default is None):
                bound.arguments[name] = check(owner, name, value)
        for rule in rules:
            rule(owner, {name: bound.arguments.get(name, parameter.default)
                         for name, parameter in signature.parameters.items()})
        init(*bound.args, **bound.kwargs)
    checked._checks_arguments = True
    return checked


def _module_or_none(owner: str, name: str, value):
    """An ``nn.Module`` to use in place of a default one (None passes)."""
    if value is not None and not isinstance(value, nn.Module):
        raise TypeError(f"{owner}: {name} must be an nn.Module or None, got {type(value).__name__} {_describe(value)}")
    return value


def _current_default_device() -> torch.device:
    """The device a factory such as ``torch.empty`` uses now, including a ``with torch.device(...)``
    block (``torch.get_default_device()`` ignores such a block before torch 2.6)."""
    return torch.empty(0).device


def _uninitialised(module_cls, *args, **kwargs) -> nn.Module:
    """A submodule built without its own random init (``reset_parameters`` draws it once), so a
    normal build and a meta build + ``reset_parameters()`` consume the same random numbers.

    Built on the meta device (its init draws nothing there), then given uninitialised storage on
    the current default device, like ``nn.utils.skip_init`` but for any module (this library's
    too, which take no ``device`` argument).
    """
    device = _current_default_device()
    with torch.device("meta"):
        module = module_cls(*args, **kwargs)
    return module.to_empty(device=device)


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


def _pair_positions(q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                    offset: int, q_device, k_device) -> tuple:
    """Query and key positions, given (moved to their devices) or the defaults: keys ``arange(Nk) + offset``,
    queries the last ``Nq`` of them (one tensor for both when both default to the same)."""
    pos_k = _default_positions(k_len, offset, k_device) if positions_k is None else positions_k.to(k_device)
    if positions_q is None and positions_k is None and q_len == k_len and q_device == k_device:
        return pos_k, pos_k
    pos_q = _default_positions(q_len, offset + _query_offset(q_len, k_len), q_device) if positions_q is None \
        else positions_q.to(q_device)
    return pos_q, pos_k


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
    if device is not None and positions.device != torch.device(device):
        raise ValueError(f"{owner}: {name} must be on the device of the inputs ({torch.device(device)}), "
                         f"got {name} on {positions.device}")
    positions = positions.to(torch.float64 if positions.is_floating_point() else torch.long)
    if not positions.is_floating_point() and not _skip_value_checks(positions) and positions.numel() \
            and not (-_LARGEST_POSITION <= positions.min() and positions.max() <= _LARGEST_POSITION):
        bad = positions.max() if positions.max() > _LARGEST_POSITION else positions.min()
        raise ValueError(f"{owner}: {name} must lie in [-2**62 + 1, 2**62 - 1] so that position differences fit "
                         f"in int64, got {int(bad)}")
    _check_finite_positions(owner, name, positions)
    if batched:  # [B, N(, A)] -> [B, 1, ..., 1, N(, A)]
        positions = positions.reshape(core[0], *([1] * (len(lead) - 1)), n, *axes)
    return positions


_LARGEST_POSITION = 2**62 - 1
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _in_base_form(positions, n: int, num_axes: int, device) -> bool:
    """Positions as the base's checks return them, which attention() hands the hooks: None, or int64 /
    float64 ``[N(, A)]`` or ``[B, 1, .., 1, N(, A)]`` on ``device`` (None: any). A hook called directly
    with anything else (``[B, N]`` as ``forward`` takes them, another length) validates it."""
    axes = int(num_axes > 1)
    return positions is None or (isinstance(positions, Tensor) and positions.dtype in (torch.long, torch.float64)
                                 and positions.dim() != 2 + axes and positions.dim() >= 1 + axes
                                 and positions.shape[positions.dim() - 1 - axes] == n
                                 and (device is None or positions.device == torch.device(device)))


def _check_finite_positions(owner: str, name: str, positions: Tensor) -> None:
    """Float positions must be finite (a NaN would give NaN features silently); skipped while tracing."""
    if positions.is_floating_point() and not _skip_value_checks(positions) and not torch.isfinite(positions).all():
        raise ValueError(f"{owner}: {name} must be finite, got {positions[~torch.isfinite(positions)][:3].tolist()}")


def _check_finite_angles(owner: str, angles: Tensor) -> None:
    """Float64 angles of Fourier features must be finite (sin / cos of an overflowed angle is NaN): the positions
    times the largest frequency past float64's range. Skipped while tracing."""
    if not _skip_value_checks(angles) and not torch.isfinite(angles).all():
        raise ValueError(f"{owner}: positions times the frequencies must stay finite in float64 (cos / sin of inf is "
                         f"NaN), got a non-finite angle; use smaller positions, scale or dim")


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


def _coordinates(owner: str, positions: Tensor, num_axes: int) -> tuple:
    """Validated continuous coordinates for an ``embed``: ``(p, dtype)`` with ``p`` float64
    ``[..., N, A]`` (``[..., N]`` gets its axis when ``A = 1``) and ``dtype`` the result's
    (float64 for float64 positions, else float32)."""
    if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"{owner}: positions must be an integer or float tensor, got "
                        f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
    if num_axes == 1 and (positions.dim() == 1 or (positions.dim() and positions.shape[-1] != 1)):
        positions = positions.unsqueeze(-1)
    if positions.dim() < 2 or positions.shape[-1] != num_axes:
        raise ValueError(f"{owner}: positions must have shape [..., N, {num_axes}], got {tuple(positions.shape)}")
    _check_finite_positions(owner, "positions", positions)
    dtype = torch.float64 if positions.dtype == torch.float64 else torch.float32
    return positions.to(torch.float64), dtype


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
    if not _is_compiling() and not -_LARGEST_POSITION <= offset <= _LARGEST_POSITION - max(n - 1, 0):
        raise ValueError(f"{owner}: offset must keep the default positions offset .. offset + N - 1 in "
                         f"[-2**62 + 1, 2**62 - 1] (as given positions), got offset={offset} with N={n}")
    return _default_positions(n, offset, device)


def _reject_positions(owner: str, positions_q, positions_k, why: str) -> None:
    """Encodings whose order comes from the content: explicit positions are a ValueError."""
    for name, value in (("positions_q", positions_q), ("positions_k", positions_k)):
        if value is not None:
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{owner}: {name} must be None: {why}, got {got}")


def _token_positions(module: "PositionalEmbedding", positions: Optional[Tensor], x: Tensor, offset: int) -> Tensor:
    """Positions for the tokens of ``x`` ``[..., N, D]``: validated, or ``arange(N) + offset``."""
    owner, n, num_axes = type(module).__name__, x.shape[-2], module.num_axes
    module._check_device("x", x)
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


def _run_mlp(layers: nn.Module, x: Tensor) -> Tensor:
    """Run a stack of ``nn.Linear`` / ``nn.LayerNorm`` / elementwise activations on ``x`` in x's dtype.

    The weights are cast to x's dtype on the fly, so a ``.bfloat16()`` module still computes its
    bias in float32 (the weights themselves are what was rounded).
    """
    for layer in layers.modules():
        if isinstance(layer, nn.Linear):
            x = F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))
        elif isinstance(layer, nn.LayerNorm):
            cast = lambda t: None if t is None else t.to(x.dtype)
            x = F.layer_norm(x, layer.normalized_shape, cast(layer.weight), cast(layer.bias), layer.eps)
        elif not isinstance(layer, (nn.Sequential, nn.ModuleList)):
            x = layer(x)                                                                # elementwise activation
    return x


# ---------------------------------------------------------------------------
# The base class and attention()
# ---------------------------------------------------------------------------

def _is_dtensor(t) -> bool:
    """A DTensor (an FSDP2 or tensor-parallel parameter)? Asked without importing torch.distributed:
    no tensor is one unless that module was imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _full(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (gathered from every rank); ``t`` itself otherwise."""
    return t.full_tensor() if _is_dtensor(t) else t


@torch.no_grad()
def _copy_into(param: Tensor, value: Tensor) -> None:
    """``param.copy_(value)`` with a full-size ``value`` (broadcast to ``param``'s shape), also when
    ``param`` is a DTensor (FSDP2 shards it): each rank keeps its own slice of ``value``, with no
    communication, so a sharded module gets exactly the unsharded values."""
    value = value.to(param.dtype).expand(param.shape).contiguous()
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor
        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


class PositionalEmbedding(nn.Module):
    """Base of every encoding: one interface for token-side and attention-side encodings.

    ``kind`` says where the position enters:

    * ``"input"``: added to token states (``forward_input``);
    * ``"qk"``: queries and keys are transformed before the dot product;
    * ``"bias"``: an additive ``[H, Nq, Nk]`` bias on the logits;
    * ``"logits"``: the logits themselves depend on content and position jointly.

    Subclasses override the hooks ``encode_qk`` and ``attention_bias`` (or, for
    ``"logits"``, ``full_precision_logits``); ``forward_input`` and ``forward_attn`` are
    built from them, and ``attention()`` runs each base's own path (``_attention``): this base's is
    the ``"input"`` kind's, ``_AttentionEncoding`` (the attention-side kinds) and its subclasses
    ``_PairwiseBias`` and ``_ExplicitLogits`` have theirs.

    Derived tables (frequencies, slopes, caches) are non-persistent buffers built by
    ``_init_buffers``; every ``.to()`` / ``.half()`` / ``to_empty()`` rebuilds them in
    full precision on the new device, so a dtype cast never degrades them.
    """

    kind: str = "input"
    translation_invariant: bool = False  # logits depend only on position differences
    num_axes: int = 1       # position axes A: positions are [..., N] or, for A > 1, [..., N, A]
    integer_positions: bool = False  # positions index buckets, tables or tree nodes: floats are a TypeError
    takes_positions: bool = True     # False: order comes from the content (contextual, recurrent, gated)
    order_from: str = ""             # where the order comes from instead (the error for explicit positions)
    bound_inputs: tuple = ()         # buffers a data-dependent encoding binds token-side inputs to (pe(x))
    queries_within_keys: bool = False  # default positions need Nq <= Nk (queries are the last Nq keys)
    arguments: dict = {}             # constructor checks by argument name, beyond the shared _ARGUMENTS
    argument_rules: tuple = ()       # constructor checks relating several arguments: rule(owner, arguments)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = vars(cls).get("__init__")
        if init is not None and not getattr(init, "_checks_arguments", False):
            cls.__init__ = _checking_arguments(init, vars(cls).get("argument_rules", ()))

    @property
    def is_causal(self) -> bool:
        """True for a causal-mode encoding, defined for causal attention only (a decoder's: keys
        after the query are masked, or evaluated as if at distance 0, by the encoding itself).
        ``attention()`` then masks the future by default and rejects ``causal=False``. Classes
        with a ``bidirectional`` option are causal-mode when it is False; CoPE and the forget
        gate always are."""
        return getattr(self, "bidirectional", True) is False

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Tokens with position information (identity for the attention-side kinds, ``_AttentionEncoding``)."""
        return self(x, positions)

    def encode_qk(
        self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None, positions_k: Optional[Tensor] = None
    ) -> tuple:
        """Queries and keys carrying position, ready for a dot product (identity by default). Positions
        ``[N]``, or for a batch ``[B, N]`` as ``forward`` takes them or ``[B, 1, N]`` as ``attention()`` passes them."""
        return q, k

    def attention_bias(
        self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None, positions_k: Optional[Tensor] = None,
        *, device=None,
    ) -> Optional[Tensor]:
        """Additive float32 bias ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for batched positions), or None."""
        return None

    def encode_v(self, v: Tensor, q_len: int, positions_q: Optional[Tensor] = None,
                 positions_k: Optional[Tensor] = None) -> Tensor:
        """Values carrying position, for ``q_len`` queries (identity by default; RoPE's ``rotate_values``).
        Positions as ``encode_qk`` takes them: ``[N]``, ``[B, N]`` or ``[B, 1, N]``."""
        return v

    def decode_output(self, out: Tensor, k_len: int, positions_q: Optional[Tensor] = None,
                      positions_k: Optional[Tensor] = None) -> Tensor:
        """The attention output after ``weights @ v``, for ``k_len`` keys (identity by default; it undoes
        ``encode_v``'s query-side part). Positions as for ``encode_v``."""
        return out

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
        scale = self._given_scale(q.shape[-1], scale)                                  # of q's own width
        q, k = self.encode_qk(q, k, positions_q, positions_k)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale                          # [B, H, Nq, Nk]
        bias = self.attention_bias(q.shape[-2], k.shape[-2], positions_q, positions_k, device=q.device)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def full_precision_logits(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                              positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """``forward_attn`` before any cast to the input dtype (``attention()`` softmaxes these)."""
        return self.forward_attn(q, k, positions_q, positions_k, scale=scale)

    def attention_weights(self, logits: Tensor) -> Tensor:
        """``"logits"`` kinds only: the attention weights ``[B, H, Nq, Nk]`` from the masked float32 logits
        (masked: ``-inf``). The softmax by default, a fully masked row giving 0 (as SDPA does);
        stick-breaking attention replaces it."""
        return torch.softmax(logits, dim=-1).nan_to_num(nan=0.0)

    def attention_values(self, weights: Tensor, positions_q: Optional[Tensor] = None,
                         positions_k: Optional[Tensor] = None) -> Optional[Tensor]:
        """A positional term added to the attention output, or None (the default).

        ``"logits"`` kinds only: ``attention()`` calls it with the masked, normalised (and
        dropped-out) float32 weights ``[B, H, Nq, Nk]`` and the positions it was given, and
        adds the result ``[B, H, Nq, Dv]`` to ``weights @ v`` (Shaw et al.'s value term).
        """
        return None

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, positions_q: Optional[Tensor],
                   positions_k: Optional[Tensor], call: "_AttentionCall") -> Tensor:
        """attention()'s path for this encoding, after the checks every encoding shares; each base has its
        own (``_AttentionEncoding``, ``_PairwiseBias``, ``_ExplicitLogits``). This base's kind is added to
        the tokens: plain SDPA, and positions here are a mistake, not a no-op."""
        _reject_positions("attention", positions_q, positions_k,
                          f"{type(self).__name__} is added to the tokens; pass its positions to forward_input")
        self._check_qk(q, k, None, None, grouped=True)
        return _sdpa_attention(q, k, v, call, self.logit_scale(q.shape[-1]) if call.scale is None else call.scale)

    def _resolve_positions(self, q_len: int, k_len: int, positions_q: Optional[Tensor],
                           positions_k: Optional[Tensor], device) -> tuple:
        """The positions of one ``attention()`` call, resolved once for all its hooks: those given (None
        for the defaults). A wrapper that draws positions (``RandomizedPositionalEmbedding``) draws here."""
        return positions_q, positions_k

    def _check_qk(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor],
                  positions_k: Optional[Tensor], grouped: bool = False) -> tuple:
        """Validate q, k and their positions; return the positions broadcastable (or None).
        ``grouped``: k may have fewer heads than q (attention()'s grouped-query path)."""
        owner = type(self).__name__
        if not self.takes_positions:
            _reject_positions(owner, positions_q, positions_k, self.order_from)
        _check_qk_shapes(owner, q, k, grouped)
        self._check_device("q", q)
        self._check_heads(q)
        lead = tuple(q.shape[:-2])
        integer = self.integer_positions
        positions_q = _check_positions(owner, "positions_q", positions_q, lead, q.shape[-2], self.num_axes, integer,
                                       q.device)
        positions_k = _check_positions(owner, "positions_k", positions_k, lead, k.shape[-2], self.num_axes, integer,
                                       k.device)
        if self.queries_within_keys and positions_q is None and positions_k is None and q.shape[-2] > k.shape[-2]:
            explicit = "; pass positions_q and positions_k explicitly" if self.takes_positions else ""
            raise ValueError(f"{owner}: q must not have more tokens than k (queries are the last Nq keys), "
                             f"got Nq={q.shape[-2]} and Nk={k.shape[-2]}{explicit}")
        batched = any(p is not None and p.dim() > (1 if self.num_axes == 1 else 2) for p in (positions_q, positions_k))
        if batched and getattr(self, "num_heads", None) and q.dim() < 4:
            raise ValueError(f"{owner}: [B, N] positions need q and k of shape [B, ..., H, N, Dh], "
                             f"got q {tuple(q.shape)}")
        return positions_q, positions_k

    def _check_device(self, name: str, x: Tensor) -> None:
        """``x`` must be on this module's device (a module holding no tensors takes any): torch would fail
        deep inside, or return an uninitialised result (a batched matmul of a meta and a CPU tensor).
        Eager mode only: dynamo cannot list the tensors of a module bound inside the compiled code."""
        device = None if _is_compiling() else self._buffer_device()
        if device is not None and x.device != device:
            raise ValueError(f"{type(self).__name__}: {name} must be on the module's device ({device}), "
                             f"got {name} on {x.device}")

    def _hook_positions(self, lead: tuple, q_len: int, k_len: int, positions_q: Optional[Tensor],
                        positions_k: Optional[Tensor], device) -> tuple:
        """The positions of a hook (``encode_qk``, ``encode_v``, ``decode_output``) for inputs ``[*lead, N, ..]``:
        attention()'s, in the base's form, pass as they are; others (``[B, N(, A)]`` as ``forward`` takes
        them, a wrong length, not a tensor) are validated as ``forward`` does."""
        owner = type(self).__name__
        return tuple(p if _in_base_form(p, n, self.num_axes, device) else
                     _check_positions(owner, name, p, lead, n, self.num_axes, self.integer_positions, device)
                     for name, p, n in (("positions_q", positions_q, q_len), ("positions_k", positions_k, k_len)))

    def _check_heads(self, x: Tensor, name: str = "q and k") -> None:
        """x must be [..., H, N, Dh] with this module's H (per-head encodings) and Dh (those built for
        one head width: RoPE's ``dim`` is its head dim)."""
        heads, head_dim = getattr(self, "num_heads", None), getattr(self, "head_dim", None)
        if heads is None and head_dim is None:
            return
        if (heads is not None and (x.dim() < 3 or x.shape[-3] != heads)) or \
                (head_dim is not None and x.shape[-1] != head_dim):
            want = f"[..., {'H' if heads is None else f'H={heads}'}, N, Dh{'' if head_dim is None else f'={head_dim}'}]"
            raise ValueError(f"{type(self).__name__}: {name} must be {want}, got {tuple(x.shape)}")

    def _check_attention_shapes(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """attention()'s entry: q's head count and width against the constructor's (a wrong or swapped
        constructor argument raises here instead of running or failing deep inside)."""
        self._check_heads(q, "q")

    def extra_repr(self) -> str:
        """The constructor's arguments as this module keeps them (an attribute of the same name)."""
        names = list(inspect.signature(type(self).__init__).parameters)[1:]
        values = {name: getattr(self, name, None) for name in names}
        text = ", ".join(f"{name}={value!r}" for name, value in values.items()
                         if value is not None and not isinstance(value, (nn.Module, Tensor)))
        bound, first = self._bound_input(), getattr(self, "bound_offset", 0)
        return text + ("" if bound is None else f", bound to {bound[0]} of shape {list(bound[1].shape)}"
                       + (f" from token {first}" if first else ""))

    def _bound_input(self) -> Optional[tuple]:
        """``(name, tensor)`` of the input this encoding is bound to, or None."""
        for name in self.bound_inputs:  # a loop: dynamo before torch 2.7 cannot trace next() with a default
            if self._buffers.get(name) is not None:
                return name, self._buffers[name]
        return None

    def _bound_copy(self, **inputs: Tensor) -> "PositionalEmbedding":
        """This encoding bound to token-side ``inputs`` (what a data-dependent encoding's ``bind`` returns):
        a ``_sibling`` with its ``bound_inputs`` buffers set to ``inputs`` (the others None)."""
        bound = self._sibling()
        for name in self.bound_inputs:
            bound.register_buffer(name, inputs.get(name), persistent=False)
        return bound

    def _sibling(self) -> "PositionalEmbedding":
        """A new encoding of this class sharing this one's parameters and submodules, with buffers of its
        own. A class bound inside compiled code builds it with its constructor instead: dynamo before
        torch 2.7 cannot trace ``object.__new__`` (nor, in any version, ``copy.copy`` of a module)."""
        sibling = type(self).__new__(type(self))
        sibling.__dict__.update(self.__dict__)
        sibling._parameters, sibling._modules, sibling._buffers = \
            dict(self._parameters), dict(self._modules), dict(self._buffers)
        return sibling

    def logit_scale(self, head_dim: int) -> float:
        """The default logit scale: ``1 / sqrt(Dh)`` as in SDPA (TUPE overrides it)."""
        return head_dim ** -0.5

    def _given_scale(self, head_dim: int, scale) -> float:
        """``forward_attn``'s ``scale``: a finite real number, or None for ``logit_scale(head_dim)``."""
        return self.logit_scale(head_dim) if scale is None else _as_float(type(self).__name__, "scale", scale)

    def reset_parameters(self) -> None:
        """Re-initialise parameters and rebuild every derived buffer."""
        self._init_buffers(self._buffer_device())

    def _init_buffers(self, device) -> None:
        """Build the derived (non-persistent) buffers on ``device``; nothing by default."""

    def _buffer_device(self):
        """The device of this module's own tensors (else of its submodules' parameters, else buffers), or None."""
        # lazily (called on every call): its own dicts first, a sixth of the cost of parameters(); a loop, as
        # dynamo before 2.7 cannot trace next() with a default
        for tensor in itertools.chain(self._parameters.values(), self._buffers.values(), self.parameters(),
                                      self.buffers()):
            if tensor is not None:
                return tensor.device
        return None

    def _gathered_call(self, fn, *args):
        """``fn(*args)``: attention()'s entry into this encoding, a forward method for FSDP2 (``_with_parameters``)."""
        return fn(*args)

    def _apply(self, fn, recurse=True):
        # Moves and casts go through here; rebuild derived tables at full precision
        # afterwards (a plain Module would round them to bf16 on .bfloat16()). Bound inputs
        # follow device moves (to_empty included) but keep their values and dtype.
        bound = {name: self._buffers.pop(name) for name in self.bound_inputs if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, tensor in bound.items():
            self._buffers[name] = tensor.to(fn(torch.empty(0, device=tensor.device)).device)
        if any(True for _ in self.buffers(recurse=False)):
            self._init_buffers(self._buffer_device())
        return self


class _AttentionEncoding(PositionalEmbedding):
    """The attention-side kinds (``"qk"``, ``"bias"``, ``"logits"``): the position enters attention, not the
    tokens (``forward_input`` is the identity), and several position axes need explicit positions.
    attention() resolves the call's positions once for every hook (documents restart the defaults;
    ``_resolve_positions``); this base's path is the ``"qk"`` kind's: q and k (and v) encoded, then SDPA,
    with k and v repeated per query head for a per-head map (``num_heads``)."""

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        return x

    def _check_qk(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                  grouped: bool = False) -> tuple:
        positions_q, positions_k = super()._check_qk(q, k, positions_q, positions_k, grouped)
        if self.num_axes > 1 and (positions_q is None or positions_k is None):
            raise ValueError(f"{type(self).__name__}: positions_q and positions_k are required for {self.num_axes} "
                             f"axes (shape [N, {self.num_axes}] or [B, N, {self.num_axes}]), got None")
        return positions_q, positions_k

    def _attention(self, q, k, v, positions_q, positions_k, call):
        positions_q, positions_k = _call_positions(self, q, k, positions_q, positions_k, call)
        if getattr(self, "num_heads", None):   # per-head maps: every query head meets its own copy of k and v
            k, v = _per_query_head(q, k), _per_query_head(q, v)
        q_len, k_len = q.shape[-2], k.shape[-2]
        scale = self.logit_scale(q.shape[-1]) if call.scale is None else call.scale
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k, grouped=True)
        q, k = self.encode_qk(q, k, positions_q, positions_k)
        v = self.encode_v(v, q_len, positions_q, positions_k)
        out = _sdpa_attention(q, k, v, call, scale)
        return self.decode_output(out, k_len, positions_q, positions_k)


def _call_positions(pe: PositionalEmbedding, q: Tensor, k: Tensor, positions_q: Optional[Tensor],
                    positions_k: Optional[Tensor], call: "_AttentionCall") -> tuple:
    """The positions of an attention-side encoding's call: those given; else, with documents, each
    document's own from 0 (``document_positions``); then resolved once (``_resolve_positions``)."""
    if call.document_ids is not None and pe.takes_positions and positions_q is None and positions_k is None:
        positions_q = positions_k = document_positions(call.document_ids)
    return pe._resolve_positions(q.shape[-2], k.shape[-2], positions_q, positions_k, q.device)


def _per_query_head(q: Tensor, kv: Tensor) -> Tensor:
    """k or v ``[..., Hkv, N, D]`` repeated to q's ``Hq`` heads (grouped-query attention), or as it is."""
    group = q.shape[-3] // kv.shape[-3] if q.dim() >= 3 else 1
    return kv.repeat_interleave(group, dim=-3) if group > 1 else kv


def _check_qk_shapes(owner: str, q: Tensor, k: Tensor, grouped: bool = False) -> None:
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


def _causal_mask(q_len: int, k_len: int, device, rows: Optional[tuple] = None) -> Tensor:
    """Boolean [Nq, Nk]; True where key j may be seen by query i (bottom-right aligned). Compared
    positions, not ``tril``: ``torch.export`` 2.8 bakes tril's diagonal, a dynamic size, in as a constant.
    ``rows``: ``(start, stop)``, those rows only."""
    start, stop = (0, q_len) if rows is None else rows
    last_key = torch.arange(start, stop, device=device) + _query_offset(q_len, k_len)  # [rows]
    return torch.arange(k_len, device=device) <= last_key[:, None]


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
                 q_len: int, k_len: int, dtype: torch.dtype, device, rows: Optional[tuple] = None) -> Optional[Tensor]:
    """One additive float mask (or boolean mask, or None) from a bias, a user mask and causality
    (``rows``: ``(start, stop)``, the bias holds those query rows only)."""
    mask = bias
    if attn_mask is not None and rows is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == q_len:
        attn_mask = attn_mask[..., rows[0]:rows[1], :]                                 # its rows (else broadcast)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else mask.masked_fill(~attn_mask, float("-inf"))
        else:
            mask = attn_mask if mask is None else mask + attn_mask
    if causal:
        allowed = _causal_mask(q_len, k_len, device, rows)
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
    causal: Optional[bool] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    use_flex: Optional[bool] = None,
    document_ids: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention with positional encoding ``pe``, through the cheapest correct path.

    ``"input"`` encodings (already added to the tokens) and ``pe=None`` run plain
    ``scaled_dot_product_attention``; ``"qk"`` encodings transform q and k and then
    run SDPA; ``"bias"`` encodings run FlexAttention with their ``score_mod`` on CUDA and
    pass their bias as a float mask to SDPA elsewhere (``use_flex``);
    ``"logits"`` encodings compute their logits explicitly and apply the softmax.

    Grouped-query and multi-query attention: k and v may have fewer heads than q
    (``Hq % Hkv == 0``; query head ``h`` reads key head ``h // (Hq / Hkv)``). Encodings that
    do not depend on the head (RoPE, input kinds, biases) run SDPA's own grouped path with
    k and v as given; per-head ``"qk"`` / ``"logits"`` encodings see k and v repeated per
    query head.

    Packed sequences: ``document_ids`` ``[N]`` or ``[B, N]`` (self-attention, ``Nq == Nk``)
    stops every token from attending across documents, and default positions restart at 0
    in every document (``document_positions``); explicit positions win. The FlexAttention
    path masks documents with a ``BlockMask`` (blocks that cross documents are skipped; no
    ``[N, N]`` mask exists), the other paths with a boolean ``[N, N]`` mask. Input encodings
    take the same positions: ``pe.forward_input(x, document_positions(document_ids))``
    (Heinsen's recurrence restarts at every 0).

    FSDP2: an encoding that was ``fully_shard``-ed by itself has its parameters gathered for
    this call as for its ``forward`` (nothing to register). Its other methods called directly
    (``forward_attn``, ``encode_qk``, ...) need ``register_fsdp_forward_method(pe, name)``.

    Args:
        q (Tensor): queries ``[B, H, Nq, Dh]``.
        k (Tensor): keys ``[B, Hkv, Nk, Dh]``.
        v (Tensor): values ``[B, Hkv, Nk, Dv]``.
        pe (PositionalEmbedding, optional): the encoding. Default: None.
        positions_q, positions_k (Tensor, optional): ``[N]`` or ``[B, N]`` positions.
            Default: keys ``arange(Nk)``, queries the last ``Nq`` of them. A ValueError with
            ``pe=None`` or an ``"input"`` encoding, which read no positions here.
        causal (bool, optional): mask keys after each query, bottom-right aligned when
            ``Nq < Nk`` (decoding with a cache). Index based, not position based.
            None follows the encoding: causal for a causal-mode encoding (``pe.is_causal``:
            ALiBi, KERPLE, Sandwich, FIRE, T5 and TUPE with ``bidirectional=False``, CoPE, the
            forget gate), else not. ``causal=False`` with a causal-mode encoding is a
            ValueError. Default: None.
        attn_mask (Tensor, optional): boolean (True = attend) or additive float mask
            broadcastable to ``[B, H, Nq, Nk]``. Default: None.
        scale (float, optional): logit scale. Default: ``1 / sqrt(Dh)`` (the encoding's own
            default where it has one).
        dropout_p (float): dropout on the attention weights, in ``[0, 1)``. Default: 0.0.
        use_flex (bool, optional): how a ``"bias"`` encoding runs. FlexAttention with its
            ``score_mod`` (no dense bias: O(N) memory; causality, documents and a boolean
            ``attn_mask`` as a block mask) or its dense bias as SDPA's float mask (``[H, Nq,
            Nk]``; without gradient, built and used one block of queries at a time past 256
            MiB). None: FlexAttention on CUDA (``Dh >= 16``), fused (traced when
            ``torch.compile`` traces the call, else through a ``flex_attention`` the library
            compiles once); on the CPU the dense bias, except traced by ``torch.compile``
            without gradient, ``Nq == Nk``, default positions, no documents and no mask, for
            T5, ALiBi and KERPLE, where inductor's CPU FlexAttention kernel lowers it (other
            compile backends run it unfused). True: FlexAttention (on the CPU unfused unless
            compiled: for testing); False: the dense bias. Dropout or a float ``attn_mask``
            always take the dense bias (FlexAttention takes neither). Default: None.
        document_ids (Tensor, optional): integer ``[N]`` or ``[B, N]`` ids of the packed
            documents, contiguous runs of equal ids. Default: None.
        sinks (Tensor, optional): attention sinks, one finite logit per query head ``[H]``
            (gpt-oss's learned ``sinks``; 0 for StreamingLLM's zero sink): every query's softmax
            also covers one key of logit ``sinks[h]`` and value 0, so its weights on the real
            keys sum to less than 1 (``softmax([logits, sinks[h]])`` without the last column,
            then ``@ v``). A query with every key masked gets 0. FlexAttention rescales its
            output by ``sigmoid(lse - sinks[h])`` (no extra memory); the SDPA paths add the
            sink as a zero key and value with a float mask column (a dense ``[H, Nq, Nk + 1]``
            mask); ``"logits"`` kinds append the column to their logits (softmax-weighted
            kinds only: stick-breaking is a ValueError). Default: None.

    Shape:
        - Output: ``[B, H, Nq, Dv]``.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> q, k, v = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)
        >>> attention(q, k, v, rope, causal=True).shape
        torch.Size([2, 8, 16, 64])
    """
    owner = "attention"
    _check_attention_inputs(q, k, v, pe)
    causal = _causal_for(pe, causal)
    dropout_p = _as_float(owner, "dropout_p", dropout_p, minimum=0.0, maximum=1.0)
    scale = None if scale is None else _as_float(owner, "scale", scale)
    if use_flex is not None:
        use_flex = _check_flag(owner, "use_flex", use_flex)
    _check_mask(attn_mask, q, k)
    _check_sinks(sinks, q, pe)
    if pe is None:  # nothing here reads positions: passing them is a mistake, not a no-op
        _reject_positions(owner, positions_q, positions_k, "no encoding is given")
    if document_ids is not None:
        document_ids = _check_document_ids_for(q, k, document_ids)                     # [N] or [B, N] int64
    call = _AttentionCall(causal, attn_mask, scale, dropout_p, use_flex, document_ids, sinks)
    if pe is None:
        return _sdpa_attention(q, k, v, call, scale)
    return _with_parameters(pe, pe._attention, q, k, v, positions_q, positions_k, call)


class _AttentionCall(NamedTuple):
    """attention()'s options after its checks, handed to the encoding's path (``PositionalEmbedding._attention``)."""

    causal: bool
    attn_mask: Optional[Tensor]       # bool (True = attend) or additive float, broadcastable to [B, H, Nq, Nk]
    scale: Optional[float]            # None: the encoding's default
    dropout_p: float
    use_flex: Optional[bool]
    document_ids: Optional[Tensor]    # [N] or [B, N] int64
    sinks: Optional[Tensor]           # [H]

    def mask(self, q: Tensor) -> Optional[Tensor]:
        """``attn_mask`` with the documents' boolean mask merged in (the paths that do not mask them block-wise)."""
        if self.document_ids is None:
            return self.attn_mask
        same_document = _document_mask(q, self.document_ids)                           # [(B, 1, ..,) N, N] bool
        if self.attn_mask is None or self.attn_mask.dtype == torch.bool:
            return same_document if self.attn_mask is None else self.attn_mask & same_document
        return self.attn_mask.masked_fill(~same_document, float("-inf"))

    def sdpa_options(self, q: Tensor, k: Tensor) -> dict:
        """SDPA's grouped heads (k with fewer heads than q) and the sinks."""
        options = {"enable_gqa": True} if q.dim() >= 3 and q.shape[-3] != k.shape[-3] else {}
        if self.sinks is not None:
            options["sinks"] = self.sinks
        return options


def _check_sinks(sinks: Optional[Tensor], q: Tensor, pe: Optional[PositionalEmbedding]) -> None:
    """attention()'s ``sinks``: None, or finite floats ``[H]`` (q's heads) on q's device, for an encoding whose
    weights are a softmax (a sink is one more softmax term)."""
    owner = "attention"
    if sinks is None:
        return
    _check_tensor(owner, "sinks", sinks, 1)
    if q.dim() < 3:
        raise ValueError(f"{owner}: sinks need q with a head axis, [..., H, Nq, Dh], got q of shape {tuple(q.shape)}")
    heads = q.shape[-3]
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{owner}: sinks must have shape [H] = ({heads},), one logit per query head, "
                         f"got shape {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{owner}: sinks must be on q's device ({q.device}), got sinks on {sinks.device}")
    _check_finite_positions(owner, "sinks", sinks)
    encoding = getattr(pe, "encoding", pe)   # a wrapper's weights are its encoding's
    if pe is not None and type(encoding).attention_weights is not PositionalEmbedding.attention_weights:
        raise ValueError(f"{owner}: sinks need softmax attention weights; {type(encoding).__name__} replaces the "
                         f"softmax (attention_weights), so a sink logit has no meaning there: pass sinks=None")


def _causal_for(pe: Optional[PositionalEmbedding], causal) -> bool:
    """attention()'s one causal rule: None follows the encoding (causal for a causal-mode one);
    an explicit False with a causal-mode encoding would let a token see what the encoding
    assumes it cannot, so it is a ValueError."""
    if causal is None:
        return pe is not None and pe.is_causal
    causal = _check_flag("attention", "causal", causal)
    if not causal and pe is not None and pe.is_causal:
        name = type(pe).__name__
        fix = ("build it with bidirectional=True for bidirectional attention" if hasattr(pe, "bidirectional")
               or hasattr(pe, "relative") else "it has no bidirectional form")
        raise ValueError(f"attention: causal=False with {name}, a causal-mode encoding ({name}.is_causal=True, "
                         f"defined for causal attention only); pass causal=True or leave causal unset, or {fix}")
    return causal


def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, call: _AttentionCall, scale: Optional[float],
                    bias: Optional[Tensor] = None) -> Tensor:
    """SDPA with the call's masks, causality, grouped heads and sinks, and an additive float32 ``bias``
    ``[(B,) H, Nq, Nk]`` or None (SDPA's causal kernel where nothing else masks)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    attn_mask, options = call.mask(q), call.sdpa_options(q, k)
    if bias is None and attn_mask is None and call.causal and q_len == k_len and call.sinks is None:
        return _sdpa(q, k, v, dropout_p=call.dropout_p, is_causal=True, scale=scale, **options)
    mask = _as_sdpa_mask(q, _merge_masks(bias, attn_mask, call.causal, q_len, k_len, q.dtype, q.device))
    return _sdpa(q, k, v, attn_mask=mask, dropout_p=call.dropout_p, scale=scale, **options)


def _as_sdpa_mask(q: Tensor, mask: Optional[Tensor]) -> Optional[Tensor]:
    """``mask`` with q's rank: SDPA's fused CPU kernel takes no lower-rank mask."""
    if mask is not None and mask.dim() < q.dim():
        mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    return mask


def _sdpa(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor] = None, **options) -> Tensor:
    """``scaled_dot_product_attention``. A v narrower than q and k (PoPE's doubled q/k) is zero-padded
    to their width and the output cut back: SDPA fuses only equal widths, and its unfused path
    holds every ``[Nq, Nk]`` logit (3-4x slower at N = 1024 on the CPU). ``sinks`` ``[H]``: one
    more key per head (``_sink_key``)."""
    if sinks is not None:
        k, v, options = _sink_key(q, k, v, sinks, **options)
    width = v.shape[-1]
    if q.shape[-1] <= width:
        return F.scaled_dot_product_attention(q, k, v, **options)
    return F.scaled_dot_product_attention(q, k, F.pad(v, (0, q.shape[-1] - width)), **options)[..., :width]


def _sink_key(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, attn_mask: Optional[Tensor] = None,
              is_causal: bool = False, **options) -> tuple:
    """The sinks as a last key of SDPA: k and v gain a zero row (``q . 0 = 0``), the mask a last column of
    ``sinks[h]`` (its other columns the boolean or float mask as a float mask; ``is_causal`` as the causal
    mask). Returns k, v and SDPA's options with the float mask ``[..., H, Nq, Nk + 1]``."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    if is_causal:
        attn_mask = _causal_mask(q_len, k_len, q.device)                                 # [Nq, Nk] bool
    mask = torch.zeros(q_len, k_len, dtype=q.dtype, device=q.device) if attn_mask is None else attn_mask
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    lead = torch.broadcast_shapes(mask.shape[:-2], sinks.shape)                          # (..., H)
    column = sinks.to(q.dtype).reshape(-1, 1, 1).expand(*lead, q_len, 1)                # [..., H, Nq, 1]
    mask = torch.cat([mask.to(q.dtype).expand(*lead, q_len, k_len), column], dim=-1)     # [..., H, Nq, Nk + 1]
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))                                # [..., Nk + 1, D]
    return k, v, dict(options, attn_mask=_as_sdpa_mask(q, mask))


def _with_parameters(pe: Optional[PositionalEmbedding], fn, *args):
    """``fn(*args)`` with ``pe``'s parameters at hand.

    FSDP2 gathers a ``fully_shard``-ed module's parameters around ``forward()`` only, and
    attention() reaches an encoding through its hooks (``encode_qk``, ``attention_bias``,
    ``full_precision_logits``, ``score_mod``). An encoding sharded by itself therefore runs
    ``fn`` through ``_gathered_call``, registered on first use with FSDP2's own
    ``register_fsdp_forward_method``: parameters are gathered before, freed after, and
    gathered again for the backward, whose gradients are reduce-scattered as after ``forward``.
    An encoding inside a sharded layer needs none of this (its layer's forward gathers it).
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")                                    # None: FSDP2 never imported
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if pe is None or fsdp_module is None or not isinstance(pe, fsdp_module):
        return fn(*args)
    if "_gathered_call" not in vars(pe):
        fsdp.register_fsdp_forward_method(pe, "_gathered_call")
    return pe._gathered_call(fn, *args)


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, pe) -> None:
    """Validate attention()'s tensors and encoding."""
    owner = "attention"
    _check_qk_shapes(owner, q, k, grouped=True)
    _check_tensor(owner, "v", v, 2)
    _check_same_kind(owner, "v", v, "q", q)
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{owner}: v must match k on every dim but the last, got v {tuple(v.shape)} and k {tuple(k.shape)}")
    if pe is not None and not isinstance(pe, PositionalEmbedding):
        raise TypeError(f"{owner}: pe must be a PositionalEmbedding or None, got {type(pe).__name__}")
    if pe is not None:
        pe._check_attention_shapes(q, k, v)


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
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return _positions_since(starts)


def _positions_since(starts: Tensor) -> Tensor:
    """Tokens since the latest start (True) at or before each token, int64 ``[..., N]``."""
    index = torch.arange(starts.shape[-1], device=starts.device).expand_as(starts)     # [..., N]
    start_of_run = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_of_run


def _check_document_ids(owner: str, document_ids) -> Tensor:
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or document_ids.is_complex() \
            or document_ids.dtype == torch.bool:
        raise TypeError(f"{owner}: document_ids must be an integer tensor [N] or [B, N], got {_describe(document_ids)}")
    if document_ids.dim() not in (1, 2):
        raise ValueError(f"{owner}: document_ids must have shape [N] or [B, N], got {tuple(document_ids.shape)}")
    return document_ids.long()


def _check_document_ids_for(q: Tensor, k: Tensor, document_ids) -> Tensor:
    """attention()'s ``document_ids``: int64 ``[N]`` or ``[B, N]`` for self-attention on q, k."""
    owner = "attention"
    ids = _check_document_ids(owner, document_ids)
    n = q.shape[-2]
    if k.shape[-2] != n or ids.shape[-1] != n or (ids.dim() == 2 and ids.shape[0] not in (1, q.shape[0])) \
            or (ids.dim() == 2 and q.dim() < 3):
        raise ValueError(f"{owner}: document_ids need self-attention (Nq == Nk) and shape [{n}] or "
                         f"[{q.shape[0]}, {n}], got ids {tuple(ids.shape)} for q {tuple(q.shape)} and k {tuple(k.shape)}")
    if ids.device != q.device:
        raise ValueError(f"{owner}: document_ids must be on {q.device}, got {ids.device}")
    return ids


def _document_mask(q: Tensor, ids: Tensor) -> Tensor:
    """Boolean ``[N, N]`` (``[B, 1, .., N, N]`` for ``[B, N]`` ids): True within a document."""
    n = ids.shape[-1]
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)                                       # [(B,) N, N]
    if ids.dim() == 2:
        same = same.reshape(ids.shape[0], *([1] * (q.dim() - 3)), n, n)
    return same


# ---------------------------------------------------------------------------
# Input kind (added to the tokens): sinusoidal, learned, NoPE, convolutional, Fourier features,
# learnable Fourier features, Time2Vec
# ---------------------------------------------------------------------------

class _AddedInput(PositionalEmbedding):
    """The ``"input"`` kind: ``x + embed(positions)``. A subclass writes ``embed(positions) -> [..., N, D]``
    (float32, public: it validates what it is given); this base owns ``forward(x, positions=None, *,
    offset=0)``, its checks, the ``num_prefix_tokens`` leading tokens (``[CLS]``) it passes through
    unchanged, and the default positions ``first_position + arange(N) + offset``. A class whose
    positions are not token indices (graph nodes, digit places) names where they come from in
    ``positions_from``, and then has no default."""

    kind = "input"
    positions_from: str = ""
    num_prefix_tokens: int = 0
    first_position: int = 0   # the first default position (fairseq's padding_idx + 1)
    explicit_axis: bool = False   # embed reads [..., N, A] (_coordinates): forward gives one axis its trailing 1

    def embed(self, positions: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x + embed(positions)`` past the prefix tokens; default positions ``first_position + arange(N) +
        offset`` (required for several axes)."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.dim)
        if positions is None and self.positions_from:
            shape = f"[..., N{'' if self.num_axes == 1 else f', {self.num_axes}'}]"
            raise ValueError(f"{owner}: positions is required (no default): {self.positions_from}, shape {shape}, "
                             f"got None")
        prefix = self.num_prefix_tokens
        if x.shape[-2] < prefix:
            raise ValueError(f"{owner}: x must have at least num_prefix_tokens={prefix} tokens, got shape "
                             f"{tuple(x.shape)}")
        if positions is None and self.first_position:
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise TypeError(f"{owner}: offset must be an int, got {type(offset).__name__} {offset!r}")
            offset = offset + self.first_position
        tokens = x[..., prefix:, :]
        positions = _token_positions(self, positions, tokens, offset)                        # [..., N(, A)]
        if self.explicit_axis and self.num_axes == 1:  # [B, 1] would read as [N=B, A=1] in embed
            positions = positions.unsqueeze(-1)                                                 # [..., N, 1]
        encoded = tokens + self.embed(positions).to(x.dtype)
        return encoded if not prefix else torch.cat([x[..., :prefix, :], encoded], dim=-2)


class SinusoidalPositionalEmbedding(_AddedInput):
    """Fixed sinusoidal encoding added to the tokens (Vaswani et al., 2017, arXiv:1706.03762).

    ``PE[p, 2i] = sin(p / base**(2i/dim))`` and ``PE[p, 2i+1] = cos(p / base**(2i/dim))``
    (``layout="interleaved"``, the paper's formula); ``layout="concat"`` puts all sines
    first, then all cosines (Transformer-XL, tensor2tensor, MAE, fairseq). Positions may be
    any integers or floats, negatives included, and there is no maximum length: angles are
    computed in float64, so position 1e6 keeps float32 accuracy.

    With ``num_axes = A > 1`` positions are ``[..., N, A]`` (images, video) and the
    channels split into ``A`` equal slices, slice ``a`` holding the 1-D encoding of
    width ``dim / A`` of axis ``a``; ``sections`` makes the slices unequal: axis ``a``
    takes ``2 * sections[a]`` channels with its own spectrum ``base ** (-2i / (2 sections[a]))``
    (CogVideoX's 3-D table: ``D / 4`` for time, ``3 D / 8`` for each spatial axis).

    Conventions of other codebases, as options:

    * MAE's ``get_2d_sincos_pos_embed`` (He et al., arXiv:2111.06377): ``num_axes=2,
      layout="concat"``, with positions ``(column, row)``: MAE's ``meshgrid(grid_w, grid_h)``
      puts the column in the first half of the channels. ``num_prefix_tokens=1`` is its
      ``cls_token=True``: the first token of ``x`` gets the zero row.
    * fairseq's ``SinusoidalPositionalEmbedding``: ``spectrum="fairseq"`` uses
      ``theta_i = base ** (-i / (F - 1))`` (``F = dim // 2``, tensor2tensor's spacing, so the
      last pair has wavelength exactly ``2 pi base``) and ``layout="concat"``; an odd ``dim``
      gets a zero last column. ``padding_idx=P`` makes positions fairseq's: the default
      positions are ``P + 1 + arange(N) + offset``, and position ``P`` (a padding token, as
      ``fairseq.utils.make_positions`` marks them: ``mask.cumsum(-1) * mask + P``) embeds as
      zeros.

    Args:
        dim (int): embedding width ``D``; a multiple of ``2 * num_axes`` (odd allowed with
            ``spectrum="fairseq"`` and one axis).
        base (float): wavelength base. Default: 10000.0.
        layout (str): ``"interleaved"`` or ``"concat"``. Default: ``"interleaved"``.
        num_axes (int): position axes ``A``. Default: 1.
        sections (sequence of int, optional): sin-cos pairs per axis, ``A`` of them summing to
            ``dim / 2`` (unequal slices, above). Default: None (equal slices).
        spectrum (str): ``"vaswani"`` (``base ** (-2i / dim)``) or ``"fairseq"``
            (``base ** (-i / (F - 1))``). Default: ``"vaswani"``.
        padding_idx (int, optional): fairseq's padding index (see above; one axis only). Default: None.
        num_prefix_tokens (int): leading tokens of ``x`` (``[CLS]``) that get no encoding;
            ``positions`` then cover the other ``N - num_prefix_tokens`` tokens. Default: 0.

    Shape:
        - x: ``[..., N, D]``; positions: ``[N]`` or ``[B, N]`` (``[N, A]`` or ``[B, N, A]``),
          ``N`` counting the tokens after the prefix.
        - Output of ``forward``: ``[..., N, D]``; of ``embed``: ``[..., N, D]`` for the positions given.

    Example:
        >>> pe = SinusoidalPositionalEmbedding(512)
        >>> pe(torch.randn(2, 100, 512)).shape
        torch.Size([2, 100, 512])
        >>> mae = SinusoidalPositionalEmbedding(768, layout="concat", num_axes=2, num_prefix_tokens=1)
        >>> cols_rows = torch.stack(torch.meshgrid(torch.arange(14), torch.arange(14), indexing="xy"), -1)
        >>> mae(torch.randn(2, 197, 768), cols_rows.reshape(196, 2)).shape
        torch.Size([2, 197, 768])
    """

    arguments = {"spectrum": functools.partial(_check_choice, choices=("vaswani", "fairseq")),
                 "layout": functools.partial(_check_choice, choices=("interleaved", "concat")),
                 "padding_idx": functools.partial(_as_int, minimum=None),
                 "num_prefix_tokens": functools.partial(_as_int, minimum=0), "sections": _as_sizes}

    def __init__(self, dim: int, *, base: float = 10000.0,
                 layout: Literal["interleaved", "concat"] = "interleaved", num_axes: int = 1,
                 spectrum: Literal["vaswani", "fairseq"] = "vaswani", padding_idx: Optional[int] = None,
                 num_prefix_tokens: int = 0, sections: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        if sections is not None and (len(sections) != num_axes or 2 * sum(sections) != dim
                                     or (spectrum == "fairseq" and min(sections) < 2)):
            fairseq = ", each at least 2 with spectrum='fairseq'" if spectrum == "fairseq" else ""
            raise ValueError(f"{type(self).__name__}: sections must hold num_axes={num_axes} sizes summing to dim / 2 "
                             f"= {dim / 2:g}{fairseq}, got sections={list(sections)}")
        if padding_idx is not None and num_axes > 1:   # fairseq's padding marks a token by its one position
            raise ValueError(f"{type(self).__name__}: padding_idx (fairseq's) needs one position axis, got "
                             f"padding_idx={padding_idx} with num_axes={num_axes}")
        odd_ok = spectrum == "fairseq" and num_axes == 1
        if sections is None and dim % (2 * num_axes) and not (odd_ok and dim % 2):
            raise ValueError(f"{type(self).__name__}: dim must be a positive multiple of 2 * num_axes = {2 * num_axes}"
                             f"{' (or odd, with spectrum=fairseq and one axis)' if num_axes == 1 else ''}, got dim={dim!r}")
        if sections is None and spectrum == "fairseq" and dim // (2 * num_axes) < 2:
            raise ValueError(f"{type(self).__name__}: spectrum='fairseq' needs at least 2 frequencies per axis "
                             f"(its denominator is F - 1), got dim={dim} for {num_axes} axes")
        self.dim, self.base, self.layout, self.num_axes = dim, base, layout, num_axes
        self.spectrum, self.padding_idx, self.num_prefix_tokens = spectrum, padding_idx, num_prefix_tokens
        self.sections = None if sections is None else list(sections)

    @classmethod
    def from_config(cls, config) -> "SinusoidalPositionalEmbedding":
        """The sin-cos table a diffusers model adds to its tokens, from its config (the ``config.json`` dict or the
        loaded ``model.config``, naming the model in ``_class_name``): DiT, PixArt, SD3, Latte and CogView3-Plus's 2-D
        patch table, CogVideoX 1.0 2B's 3-D table, AnimateDiff's temporal transformer. docs/diffusers.md gives the
        positions each model feeds."""
        return cls(**_diffusers_kwargs("SinusoidalPositionalEmbedding", config, {}))

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, base={self.base}, layout={self.layout!r}, num_axes={self.num_axes}"
        if self.spectrum != "vaswani":
            text += f", spectrum={self.spectrum!r}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.num_prefix_tokens:
            text += f", num_prefix_tokens={self.num_prefix_tokens}"
        if self.sections is not None:
            text += f", sections={self.sections}"
        return text

    def embed(self, positions: Tensor) -> Tensor:
        """The encoding of ``positions`` ``[..., N]`` (``[..., N, A]``): float32 ``[..., N, D]``.

        float64 positions give a float64 table. With ``padding_idx``, rows at position
        ``padding_idx`` are zeros.
        """
        owner = type(self).__name__
        if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
            raise TypeError(f"{owner}: positions must be an integer or float tensor, got "
                            f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
        axes = 1 if self.num_axes > 1 else 0
        if positions.dim() < 1 + axes or (axes and positions.shape[-1] != self.num_axes):
            raise ValueError(f"{owner}: positions must have shape [..., N]{'' if not axes else f' + [{self.num_axes}]'}"
                             f", got {tuple(positions.shape)}")
        _check_finite_positions(owner, "positions", positions)
        if self.num_axes == 1:
            table = self._encode_axis(positions, self.dim)
        else:
            widths = [2 * size for size in self.sections or [self.dim // (2 * self.num_axes)] * self.num_axes]
            table = torch.cat([self._encode_axis(positions[..., a], width) for a, width in enumerate(widths)], dim=-1)
        if self.padding_idx is not None:
            table = table.masked_fill((positions == self.padding_idx).unsqueeze(-1), 0.0)
        return table

    @property
    def first_position(self) -> int:
        """The first default position: ``padding_idx + 1`` with ``padding_idx`` (fairseq's), else 0."""
        return 0 if self.padding_idx is None else self.padding_idx + 1

    def _encode_axis(self, positions: Tensor, width: int) -> Tensor:
        """One axis: positions [..., N] -> [..., N, width]."""
        if self.spectrum == "fairseq":   # base ** (-i / (F - 1)), i < F
            half = width // 2
            inv_freq = self.base ** -(torch.arange(half, dtype=torch.float64, device=positions.device) / (half - 1))
        else:
            inv_freq = _inverse_frequencies(width - width % 2, self.base, positions.device)
        angles = _angles(positions, inv_freq)                                            # [..., N, F]
        dtype = torch.float64 if positions.dtype == torch.float64 else torch.float32
        sin, cos = angles.sin().to(dtype), angles.cos().to(dtype)
        if self.layout == "concat":
            table = torch.cat([sin, cos], dim=-1)                                          # [..., N, 2F]
        else:
            table = torch.stack([sin, cos], dim=-1).flatten(-2)                           # [..., N, 2F]
        return F.pad(table, (0, width % 2))                                                 # [..., N, width]


def _table_lengths(owner: str, name: str, value) -> Union[int, tuple]:
    """A table length, or per-axis lengths (a sequence of them); a sequence of one is that one table's int."""
    if not isinstance(value, (tuple, list, torch.Size)):
        return _check_positive_int(owner, name, value)
    sizes = _as_sizes(owner, name, value)
    return sizes if len(sizes) > 1 else sizes[0]


class LearnedPositionalEmbedding(_AddedInput):
    """Learned absolute position table added to the tokens (BERT, GPT-2, ViT).

    Devlin et al., "BERT", arXiv:1810.04805. Row ``p`` of ``weight`` is the embedding
    of position ``p``; positions outside ``[0, max_len)`` raise ``ValueError`` (never an
    IndexError or a device-side assert). ``resize`` interpolates the table to a new
    length, or, for a ViT-style 2-D patch grid, to a new ``(h, w)``.

    Per-axis tables (DALL-E's and VQ-Diffusion's rows and columns, Cosmos 1.0's frames, rows and
    columns): ``max_len=(L_1, ..., L_A)`` holds ``A`` tables and embeds a position ``(p_1, ..., p_A)``
    as the sum of row ``p_a`` of table ``a``; ``weight`` stacks them, ``[L_1 + ... + L_A, D]``, so
    a checkpoint's tables load as ``torch.cat`` of them in axis order. ``normalize=True`` divides
    each embedding (the sum) by ``eps +`` its root mean square over ``D`` (Cosmos 1.0).

    Args:
        max_len (int or sequence of int): number of positions in the table, or per axis (a sequence of
            one length is that one table).
        dim (int): embedding width ``D``.
        init_std (float): standard deviation of the normal init (BERT/GPT-2). Default: 0.02.
        normalize (bool): divide each embedding by ``eps + sqrt(mean(e ** 2))``. Default: False.
        eps (float): the ``eps`` of ``normalize``. Default: 1e-6.

    Shape:
        - x: ``[..., N, D]``; positions: integer ``[N]`` or ``[B, N]`` (``[N, A]`` or ``[B, N, A]``,
          required, for ``A`` tables).
        - Output: ``[..., N, D]``.

    Example:
        >>> pe = LearnedPositionalEmbedding(512, 768)
        >>> pe(torch.randn(2, 100, 768)).shape
        torch.Size([2, 100, 768])
        >>> rows_cols = LearnedPositionalEmbedding((32, 32), 512)           # VQ-Diffusion's 32 x 32 latents
        >>> rows_cols(torch.randn(2, 6, 512), torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]])).shape
        torch.Size([2, 6, 512])
    """

    integer_positions = True
    arguments = {"max_len": _table_lengths, "normalize": _check_flag,
                 "eps": _positive_float}

    def __init__(self, max_len: Union[int, Sequence[int]], dim: int, *, init_std: float = 0.02,
                 normalize: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.max_len, self.dim, self.init_std = max_len, dim, init_std
        self.normalize, self.eps = normalize, eps
        self.num_axes = len(max_len) if isinstance(max_len, tuple) else 1
        rows = sum(max_len) if isinstance(max_len, tuple) else max_len
        self.weight = nn.Parameter(torch.empty(rows, dim))                               # [max_len, D]
        self.reset_parameters()

    @classmethod
    def from_config(cls, config) -> "LearnedPositionalEmbedding":
        """The learned table of a diffusers model (AuraFlow's 2-D grid of ``pos_embed_max_size`` rows, Prior's and
        MiniMax Music 3 RVQ's 1-D tables), from its config (``config.json`` dict or ``model.config``, with
        ``_class_name``); copy the checkpoint's table into ``weight``. docs/diffusers.md gives the rows each takes."""
        return cls(**_diffusers_kwargs("LearnedPositionalEmbedding", config, {}))

    def extra_repr(self) -> str:
        text = f"max_len={self.max_len}, dim={self.dim}, init_std={self.init_std}"
        return text + (f", normalize=True, eps={self.eps}" if self.normalize else "")

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def embed(self, positions: Tensor) -> Tensor:
        """Rows of the table for integer ``positions`` ``[..., N]`` (any integer dtype): ``[..., N, D]``; with
        per-axis tables, the sum of their rows for ``positions`` ``[..., N, A]``."""
        owner = type(self).__name__
        if self.num_axes == 1:
            _check_table_range(owner, "positions", positions, self.max_len)
        elif not isinstance(positions, Tensor) or positions.dim() < 2 or positions.shape[-1] != self.num_axes:
            raise ValueError(f"{owner}: positions must have shape [..., N, {self.num_axes}] (one row per table), got "
                             f"{_describe(positions)}")
        if positions.device != self.weight.device:
            raise ValueError(f"{owner}: positions must be on the device of the table "
                             f"({self.weight.device}), got positions on {positions.device}")
        if self.num_axes == 1:
            table = F.embedding(positions.long(), self.weight)                           # uint8, int16 widen
        else:   # table a holds rows first .. first + L_a - 1 of weight
            table, first = 0, 0
            for a, size in enumerate(self.max_len):
                _check_table_range(owner, f"positions[..., {a}]", positions[..., a], size)
                table = table + F.embedding(positions[..., a].long() + first, self.weight)  # [..., N, D]
                first += size
        if self.normalize:   # e / (eps + rms(e)), the norm in float32 (float64 for a float64 table)
            norm = torch.linalg.vector_norm(table, dim=-1, keepdim=True, dtype=_compute_dtype(table.dtype))
            table = (table / torch.add(self.eps, norm, alpha=math.sqrt(1.0 / self.dim))).to(table.dtype)
        return table

    @torch.no_grad()
    def resize(self, new_size: Union[int, tuple], *, old_grid: Optional[tuple] = None,
               num_prefix_tokens: int = 0, mode: Optional[str] = None,
               antialias: bool = False) -> "LearnedPositionalEmbedding":
        """Interpolate the table (in float32) to ``new_size`` positions, in place.

        ``new_size`` an int: 1-D linear interpolation along positions. ``new_size`` a
        ``(h, w)`` tuple: the table is a ViT patch grid of shape ``old_grid`` (default:
        square) and is resampled bicubically, as when fine-tuning at a new resolution.
        The first ``num_prefix_tokens`` rows (a ``[CLS]`` token) are kept as they are.

        ``antialias`` (grids, ``bilinear`` / ``bicubic`` only) picks the resampling kernel, as
        ``F.interpolate`` does: ``False`` (the default, unchanged) is the plain cubic
        convolution (``a = -0.75``) and equals timm's ``resample_abs_pos_embed(...,
        antialias=False)`` and transformers' ViT ``interpolate_pos_encoding``; ``True`` is the
        PIL-style kernel (``a = -0.5``, widened when shrinking) and equals timm's default
        ``antialias=True``, which timm uses when it loads a checkpoint at a new size. They are
        not close: on an N(0, 0.02) table they differ by up to 8e-3 growing 14 x 14 to 20 x 20
        and 4e-2 shrinking 24 x 24 to 12 x 12.

        Returns ``self``.
        """
        owner = type(self).__name__
        if self.num_axes > 1:
            raise ValueError(f"{owner}: resize interpolates one table; these are {self.num_axes} per-axis tables "
                             f"(max_len={self.max_len}): resize each slice of weight instead")
        num_prefix_tokens = _as_int(owner, "num_prefix_tokens", num_prefix_tokens, minimum=0)
        if num_prefix_tokens >= self.max_len:
            raise ValueError(f"{owner}: num_prefix_tokens must be < max_len={self.max_len}, "
                             f"got num_prefix_tokens={num_prefix_tokens}")
        if mode is not None:
            _check_choice(owner, "mode", mode, ("nearest", "linear", "bilinear", "bicubic", "area", "nearest-exact"))
        antialias = _check_flag(owner, "antialias", antialias)
        if isinstance(new_size, (list, tuple)):
            new_size = tuple(_as_int(owner, "new_size", size) for size in new_size)
        elif not isinstance(new_size, Tensor):
            new_size = _as_int(owner, "new_size", new_size)
        grid_mode = mode or "bicubic"
        if antialias and (not isinstance(new_size, tuple) or grid_mode not in ("bilinear", "bicubic")):
            raise ValueError(f"{owner}: antialias=True needs an (h, w) new_size and mode 'bilinear' or 'bicubic', "
                             f"got new_size={new_size!r}, mode={mode!r}")
        if old_grid is not None:
            if not isinstance(new_size, tuple):
                raise ValueError(f"{owner}: old_grid describes a 2-D table and needs an (h, w) new_size, "
                                 f"got new_size={new_size!r}")
            if not isinstance(old_grid, (list, tuple)) or len(old_grid) != 2:
                raise ValueError(f"{owner}: old_grid must be an (h, w) pair of positive ints, got old_grid={old_grid!r}")
            old_grid = tuple(_as_int(owner, "old_grid", size) for size in old_grid)
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
            grid = F.interpolate(grid, size=new_size, mode=grid_mode, align_corners=False, antialias=antialias)
            rows = grid.reshape(self.dim, -1).T                                             # [h*w, D]
        else:
            raise ValueError(f"{owner}: new_size must be an int > num_prefix_tokens or an (h, w) tuple "
                             f"of positive ints, got new_size={new_size!r}")
        self.weight = nn.Parameter(torch.cat([prefix, rows.to(self.weight.dtype)]))
        self.max_len = self.weight.shape[0]
        return self


class NoPositionalEmbedding(PositionalEmbedding):
    """No positional encoding: the NoPE baseline (Kazemnejad et al. 2023, arXiv:2305.19466).

    A causal decoder can infer order from the causal mask alone; this class makes "no
    positions" one more choice of the same argument, so a model switches positions off
    without code changes. ``forward`` returns ``x`` unchanged (after validating it and its
    positions), ``forward_attn`` is ``scale * q k^T`` and ``attention()`` is plain SDPA.
    NoPE needs ``causal=True`` to see order at all: bidirectional attention without
    positions is permutation-equivariant.

    Args:
        dim (int, optional): when given, the last dim of ``x`` is checked against it.
            Default: None (any width).

    Shape:
        - x: ``[..., N, D]``; positions (validated, unused): ``[N]`` or ``[B, N]``.
        - Output: ``x`` itself.

    Example:
        >>> nope = NoPositionalEmbedding()
        >>> x = torch.randn(2, 16, 64)
        >>> nope(x) is x
        True
    """

    kind = "input"
    translation_invariant = True   # the logits do not depend on positions at all

    def __init__(self, *, dim: Optional[int] = None) -> None:
        super().__init__()
        self.dim = None if dim is None else _check_positive_int(type(self).__name__, "dim", dim)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x`` unchanged; ``positions`` and ``offset`` are validated like every input class's."""
        _check_tensor(type(self).__name__, "x", x, 2)
        if self.dim is not None:
            _check_last_dim(type(self).__name__, "x", x, self.dim)
        _token_positions(self, positions, x, offset)
        return x


class ConvolutionalPositionalEmbedding(PositionalEmbedding):
    """A convolution over the token grid added to the tokens: CPVT's PEG, wav2vec 2.0's conv.

    Chu et al., "Conditional Positional Encodings for Vision Transformers", ICLR 2023,
    arXiv:2102.10882: ``y = x + DWConv(x)``, a depthwise ``kernel_size^A`` convolution
    (with bias) over the tokens laid out on their grid, zero padded so borders reveal
    absolute position. Prefix tokens (``[CLS]``) pass through unchanged.
    timm's ``PosConv`` / CPVT's ``PosCNN`` load by copying ``proj.0.weight -> weight`` and
    ``proj.0.bias -> bias``.

    Baevski et al., "wav2vec 2.0", arXiv:2006.11477, in 1-D:
    ``ConvolutionalPositionalEmbedding(768, kernel_size=128, num_axes=1, groups=16,
    weight_norm=True, activation="gelu")`` is ``y = x + GELU(conv(x))`` with a grouped,
    weight-normalised (over dim 2: one norm per kernel tap) convolution whose last output
    step is dropped for even kernels, as transformers' ``Wav2Vec2PositionalConvEmbedding``;
    its weights load by copying ``conv.parametrizations.weight.original0 -> weight_g``,
    ``...original1 -> weight_v`` (``conv.weight_g`` / ``conv.weight_v`` with the old
    ``weight_norm``) and ``conv.bias -> bias``. An even kernel in PEG mode is handled the same way.

    The grid shape reaches ``forward(x, grid_shape)`` per call; ``forward_input(x)`` uses the
    ``grid_shape`` given at construction, or the whole sequence for one axis. Positions are
    implicit in the token order (row-major), so ``forward_input`` takes none.

    Cost: ``O(B N D k^A)`` (depthwise) or ``O(B N D^2 k / groups)`` (grouped), one conv call.

    Args:
        dim (int): token width ``D``.
        kernel_size (int): kernel extent per axis. Default: 3.
        num_axes (int): grid axes ``A`` (1, 2 or 3). Default: 2.
        grid_shape (tuple of int, optional): default grid for ``forward_input``. Default: None.
        num_prefix_tokens (int): leading tokens passed through. Default: 0.
        groups (int, optional): convolution groups, dividing ``dim``. Default: ``dim`` (depthwise).
        weight_norm (bool): weight-normalise over the kernel axis (one axis only). Default: False.
        activation (str, optional): ``"gelu"`` (exact, erf) after the convolution. Default: None.

    Shape:
        - x: ``[..., P + prod(grid_shape), D]``; output: the same.
        - ``weight``: ``[D, D / groups, k, ..., k]`` (or ``weight_g`` ``[1, 1, k]`` and
          ``weight_v`` ``[D, D / groups, k]``); ``bias``: ``[D]``.

    Example:
        >>> peg = ConvolutionalPositionalEmbedding(384, num_prefix_tokens=1)
        >>> peg(torch.randn(2, 1 + 14 * 14, 384), (14, 14)).shape
        torch.Size([2, 197, 384])
    """

    kind = "input"
    takes_positions, order_from = False, "the order of the tokens (the grid for 2-D)"

    def __init__(self, dim: int, *, kernel_size: int = 3, num_axes: int = 2, grid_shape=None,
                 num_prefix_tokens: int = 0, groups: Optional[int] = None, weight_norm: bool = False,
                 activation: Optional[Literal["gelu"]] = None) -> None:
        super().__init__()
        owner = type(self).__name__
        self.dim = _check_positive_int(owner, "dim", dim)
        self.kernel_size = _check_positive_int(owner, "kernel_size", kernel_size)
        self.num_axes = _check_positive_int(owner, "num_axes", num_axes)
        if self.num_axes > 3:
            raise ValueError(f"{owner}: num_axes must be 1, 2 or 3, got num_axes={num_axes!r}")
        self.grid_shape = None if grid_shape is None else _as_sizes(owner, "grid_shape", grid_shape, self.num_axes)
        num_prefix_tokens = _as_int(owner, "num_prefix_tokens", num_prefix_tokens, 0)
        self.groups = self.dim if groups is None else _check_positive_int(owner, "groups", groups)
        if self.dim % self.groups:
            raise ValueError(f"{owner}: groups must divide dim={self.dim}, got groups={groups!r}")
        weight_norm = _check_flag(owner, "weight_norm", weight_norm)
        if weight_norm and self.num_axes != 1:
            raise ValueError(f"{owner}: weight_norm is wav2vec 2.0's 1-D option, got num_axes={self.num_axes}")
        if activation not in (None, "gelu"):
            raise ValueError(f"{owner}: activation must be None or 'gelu', got activation={activation!r}")
        self.num_prefix_tokens, self.weight_norm, self.activation = num_prefix_tokens, weight_norm, activation
        shape = (self.dim, self.dim // self.groups) + (self.kernel_size,) * self.num_axes
        if weight_norm:   # weight = g * v / |v|, the norm over every dim but the kernel axis (dim=2)
            self.weight_g = nn.Parameter(torch.empty(1, 1, self.kernel_size))                  # [1, 1, k]
            self.weight_v = nn.Parameter(torch.empty(shape))                                   # [D, D/groups, k]
        else:
            self.weight = nn.Parameter(torch.empty(shape))                                     # [D, D/groups, k...]
        self.bias = nn.Parameter(torch.empty(self.dim))                                        # [D]
        self.reset_parameters()

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, kernel_size={self.kernel_size}, num_axes={self.num_axes}"
        for name, default in (("grid_shape", None), ("num_prefix_tokens", 0), ("weight_norm", False),
                              ("activation", None)):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)!r}"
        return text + ("" if self.groups == self.dim else f", groups={self.groups}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        fan_in = (self.dim // self.groups) * self.kernel_size ** self.num_axes
        if self.weight_norm:   # wav2vec 2.0 / transformers: N(0, 2 / sqrt(k * D)), bias 0, g = |v|
            nn.init.normal_(self.weight_v, std=2 * math.sqrt(1 / (self.kernel_size * self.dim)))
            _copy_into(self.weight_g, _full(self.weight_v).norm(dim=(0, 1), keepdim=True))
            nn.init.zeros_(self.bias)
        else:                  # nn.Conv's default init (CPVT and timm keep it)
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            nn.init.uniform_(self.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def conv_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The convolution kernel in ``dtype`` (weight-normalised when asked)."""
        if not self.weight_norm:
            return self.weight.to(dtype)
        v = self.weight_v.to(dtype)
        return self.weight_g.to(dtype) * v / v.norm(dim=(0, 1), keepdim=True)

    def forward(self, x: Tensor, grid_shape=None) -> Tensor:
        """``x`` with the convolution of its grid tokens added: x [..., P + prod(grid_shape), D]."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.dim)
        self._check_device("x", x)
        prefix = self.num_prefix_tokens
        if grid_shape is None:
            grid_shape = self.grid_shape
        if grid_shape is None:
            if self.num_axes != 1:
                raise ValueError(f"{owner}: grid_shape is required for {self.num_axes} axes (or give it at "
                                 f"construction), got None")
            if not _is_compiling() and x.shape[-2] <= prefix:   # grid_shape[0] = 0 would name an argument not given
                raise ValueError(f"{owner}: x must have tokens past num_prefix_tokens={prefix} (the 1-D grid is the "
                                 f"rest of the sequence), got shape {tuple(x.shape)}")
            grid_shape = (x.shape[-2] - prefix,)
        grid = _as_sizes(owner, "grid_shape", grid_shape, self.num_axes) if not _is_compiling() else tuple(grid_shape)
        if x.shape[-2] != prefix + math.prod(grid):
            raise ValueError(f"{owner}: x must have num_prefix_tokens + prod(grid_shape) = {prefix} + "
                             f"{math.prod(grid)} tokens, got shape {tuple(x.shape)}")
        dtype = _compute_dtype(x.dtype)
        tokens = x[..., prefix:, :].to(dtype)                                                   # [..., N', D]
        lead = tokens.shape[:-2]
        maps = tokens.reshape(math.prod(lead), *grid, self.dim).movedim(-1, 1)                 # [B', D, *grid]
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.num_axes - 1]
        out = conv(maps, self.conv_weight(dtype), self.bias.to(dtype), padding=self.kernel_size // 2,
                   groups=self.groups)
        if self.kernel_size % 2 == 0:   # "same" length: drop the extra last step on every axis
            for axis in range(2, out.dim()):  # narrow, not a built slice tuple: dynamo 2.6 cannot trace that
                out = out.narrow(axis, 0, out.shape[axis] - 1)
        if self.activation == "gelu":
            out = F.gelu(out)
        out = out.movedim(1, -1).reshape(*lead, tokens.shape[-2], self.dim)                     # [..., N', D]
        encoded = (tokens + out).to(x.dtype)
        return encoded if not prefix else torch.cat([x[..., :prefix, :], encoded], dim=-2)

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``forward(x)`` on the construction-time grid (1-D: the whole sequence); no positions."""
        if positions is not None:
            raise ValueError(f"{type(self).__name__}: positions must be None (the grid order of the tokens is "
                             f"the position; pass grid_shape to forward), got a "
                             f"{type(positions).__name__}")
        return self(x)


class FourierFeaturePositionalEmbedding(_AddedInput):
    """Fourier features of continuous coordinates, added to the tokens.

    ``sampling="octave"``: NeRF's encoding (Mildenhall et al., arXiv:2003.08934),
    ``gamma(p) = (sin(2^0 pi s p), cos(2^0 pi s p), ..., sin(2^(L-1) pi s p), cos(2^(L-1) pi s p))``
    with ``L = dim / (2A)`` octaves, each block of ``A`` values holding the axes in order (the
    layout of NeRF's ``Embedder``, without its ``include_input``); ``s = scale``, and
    ``scale = 1 / pi`` gives nerf-pytorch's code, whose bands omit the ``pi``.

    ``sampling="gaussian"``: random Fourier features (Tancik et al., "Fourier Features Let
    Networks Learn High Frequency Functions in Low Dimensional Domains", arXiv:2006.10739),
    ``[cos(2 pi B p), sin(2 pi B p)]`` with ``B`` ``[dim/2, A]`` drawn ``N(0, scale^2)``.
    ``B`` is not learned and not in the ``state_dict``: it is a buffer drawn from its own
    generator seeded with ``seed`` (in float64, on the CPU), so every build with the same
    ``(num_axes, dim, scale, seed)`` has the same ``B`` on any device, meta-device
    initialisation included, and a checkpoint loads into it unchanged.

    Coordinates are usually normalised (``[0, 1]`` or ``[-1, 1]``, see ``rope_coordinates``);
    with integer positions the octave features are degenerate (``sin(2^k pi p) = 0``).
    Angles are computed in float64.

    Args:
        num_axes (int): coordinate axes ``A``.
        dim (int): feature width ``D`` (a multiple of ``2A`` for octaves, even for Gaussian).
        sampling (str): ``"octave"`` or ``"gaussian"``. Default: ``"octave"``.
        scale (float): ``s`` of the octaves, or the standard deviation of ``B``. Default: 1.0.
        seed (int): seed of ``B``. Default: 0.

    Shape:
        - positions: ``[..., N, A]`` (``[..., N]`` for one axis); ``embed`` -> ``[..., N, D]``.
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``; one axis
          defaults to ``arange(N) + offset``.

    Example:
        >>> ff = FourierFeaturePositionalEmbedding(2, 256, sampling="gaussian", scale=10.0)
        >>> uv = torch.rand(4096, 2)
        >>> ff.embed(uv).shape
        torch.Size([4096, 256])
    """

    explicit_axis = True
    arguments = {"sampling": functools.partial(_check_choice, choices=("octave", "gaussian")),
                 "scale": _positive_float, "seed": functools.partial(_as_int, minimum=None)}

    def __init__(self, num_axes: int, dim: int, *, sampling: Literal["octave", "gaussian"] = "octave",
                 scale: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        self.num_axes, self.dim = num_axes, dim
        multiple = 2 * num_axes if sampling == "octave" else 2
        if dim % multiple:
            raise ValueError(f"{type(self).__name__}: dim must be a multiple of {multiple} for sampling={sampling!r}, "
                             f"got dim={dim!r}")
        if not -2**63 <= seed < 2**64:   # torch.Generator.manual_seed's range
            raise ValueError(f"{type(self).__name__}: seed must lie in [-2**63, 2**64 - 1] (a torch.Generator seed), "
                             f"got seed={seed}")
        self.sampling, self.scale, self.seed = sampling, scale, seed
        self._init_buffers(None)

    def _init_buffers(self, device) -> None:
        if self.sampling == "gaussian":   # B [D/2, A], float64, from its own generator
            generator = torch.Generator().manual_seed(self.seed)
            B = torch.randn(self.dim // 2, self.num_axes, generator=generator, dtype=torch.float64, device="cpu")
            self.register_buffer("B", (B * self.scale).to(device), persistent=False)

    def embed(self, positions: Tensor) -> Tensor:
        """Features of ``positions`` ``[..., N, A]`` (``[..., N]`` for one axis): float32 ``[..., N, D]``
        (float64 for float64 positions)."""
        p, dtype = _coordinates(type(self).__name__, positions, self.num_axes)                  # [..., N, A]
        if self.sampling == "octave":
            octaves = self.dim // (2 * self.num_axes)
            bands = math.pi * self.scale * 2.0 ** torch.arange(octaves, dtype=torch.float64, device=p.device)   # [L]
            angles = p.unsqueeze(-2) * bands.unsqueeze(-1)                                      # [..., N, L, A]
            _check_finite_angles(type(self).__name__, angles)
            return torch.stack([angles.sin(), angles.cos()], dim=-2).flatten(-3).to(dtype)      # [..., N, D]
        angles = 2 * math.pi * torch.matmul(p, self.B.to(device=p.device, dtype=torch.float64).T)   # [..., N, D/2]
        _check_finite_angles(type(self).__name__, angles)
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)                        # [..., N, D]


class LearnableFourierPositionalEmbedding(_AddedInput):
    """Learnable Fourier features of multi-dimensional positions, then an MLP, added to the tokens
    (Li et al., "Learnable Fourier Features for Multi-Dimensional Spatial Positional Encoding",
    arXiv:2106.02795, Algorithm 1).

    The ``A`` position columns form ``G = groups`` groups of ``M = A / G`` coordinates (a pixel:
    one group of 2; a box: two corners of 2). Each group ``X_g`` ``[M]`` becomes

        F_g = [cos(X_g W_r^T), sin(X_g W_r^T)] / sqrt(F)                  [F]
        Y_g = GELU(F_g W_1 + B_1) W_2 + B_2                               [D / G]

    with ``W_r`` ``[F/2, M]`` learned and shared by the groups, and the groups' ``Y_g``
    concatenated into ``[D]``. GELU is the exact (erf) one. ``W_r`` starts normal with standard
    deviation ``1 / gamma`` (``init="paper"``: the paper's ``N(0, gamma^-2)`` is a variance);
    ``init="port"`` uses ``gamma ** -2`` as the standard deviation, as the widely copied PyTorch
    port does. Submodule names are the port's (``Wr``, ``mlp.0``, ``mlp.2``), so its state dicts
    load. Angles are computed in float64; the MLP runs in float32 (float64 for float64 positions).

    Args:
        num_axes (int): position columns ``A = G * M``.
        dim (int): output width ``D``, a multiple of ``groups``.
        fourier_dim (int): Fourier features ``F`` per group, even. Default: ``dim``.
        hidden_dim (int): MLP hidden width. Default: ``dim``.
        groups (int): position groups ``G``, dividing ``num_axes`` and ``dim``. Default: 1.
        gamma (float): scale of ``W_r``'s initialisation. Default: 1.0.
        init (str): ``"paper"`` (std ``1 / gamma``) or ``"port"`` (std ``gamma ** -2``). Default: ``"paper"``.

    Shape:
        - positions: ``[..., N, A]`` (``[..., N]`` for one axis), group ``g`` in columns
          ``g M .. (g + 1) M - 1``; ``embed`` -> ``[..., N, D]``.
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``; one axis
          defaults to ``arange(N) + offset``.

    Example:
        >>> lff = LearnableFourierPositionalEmbedding(2, 64, gamma=10.0)
        >>> rows, cols = torch.meshgrid(torch.arange(14), torch.arange(14), indexing="ij")
        >>> pixels = torch.stack([rows, cols], -1).reshape(196, 2) / 14.0
        >>> lff(torch.randn(2, 196, 64), pixels).shape
        torch.Size([2, 196, 64])
    """

    explicit_axis = True
    arguments = {"fourier_dim": _even_int, "groups": _check_positive_int, "gamma": _positive_float,
                 "init": functools.partial(_check_choice, choices=("paper", "port"))}

    def __init__(self, num_axes: int, dim: int, *, fourier_dim: Optional[int] = None, hidden_dim: Optional[int] = None,
                 groups: int = 1, gamma: float = 1.0, init: Literal["paper", "port"] = "paper") -> None:
        super().__init__()
        if num_axes % groups or dim % groups:
            raise ValueError(f"{type(self).__name__}: groups must divide num_axes and dim, got groups={groups}, "
                             f"num_axes={num_axes}, dim={dim}")
        try:
            std = 1 / gamma if init == "paper" else gamma ** -2
        except OverflowError:   # gamma ** -2 past float's range
            std = math.inf
        if not std < math.inf:
            raise ValueError(f"{type(self).__name__}: gamma must leave W_r's standard deviation "
                             f"({'1 / gamma' if init == 'paper' else 'gamma ** -2'}) finite, got gamma={gamma!r}")
        fourier_dim = dim + dim % 2 if fourier_dim is None else fourier_dim
        hidden_dim = dim if hidden_dim is None else hidden_dim
        self.num_axes, self.dim, self.groups, self.gamma, self.init = num_axes, dim, groups, gamma, init
        self.Wr = _uninitialised(nn.Linear, num_axes // groups, fourier_dim // 2, bias=False)           # [F/2, M]
        self.mlp = nn.Sequential(_uninitialised(nn.Linear, fourier_dim, hidden_dim), nn.GELU(),
                                 _uninitialised(nn.Linear, hidden_dim, dim // groups))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.Wr.weight, std=1 / self.gamma if self.init == "paper" else self.gamma ** -2)
        for layer in (self.mlp[0], self.mlp[2]):
            layer.reset_parameters()

    def embed(self, positions: Tensor) -> Tensor:
        """Features of ``positions`` ``[..., N, A]``: float32 ``[..., N, D]`` (float64 for float64 positions
        or a float64 module)."""
        p, dtype = _coordinates(type(self).__name__, positions, self.num_axes)                  # [..., N, A]
        dtype = torch.promote_types(dtype, self.Wr.weight.dtype)
        groups = p.unflatten(-1, (self.groups, -1))                                             # [..., N, G, M]
        angles = torch.matmul(groups, self.Wr.weight.to(device=p.device, dtype=torch.float64).T)   # [..., N, G, F/2]
        _check_finite_angles(type(self).__name__, angles)
        features = torch.cat([angles.cos(), angles.sin()], dim=-1) / math.sqrt(2 * angles.shape[-1])   # [..., N, G, F]
        return _run_mlp(self.mlp, features.to(dtype)).flatten(-2)                               # [..., N, D]


class Time2VecPositionalEmbedding(_AddedInput):
    """Time2Vec: one linear and ``D - 1`` periodic learned functions of a real-valued time, added
    to the tokens (Kazemi et al., "Time2Vec: Learning a Vector Representation of Time",
    arXiv:1907.05321), for irregularly sampled series whose positions are timestamps:

        t2v(tau)[0] = omega_0 . tau + phi_0
        t2v(tau)[i] = sin(omega_i . tau + phi_i)        1 <= i < D

    ``tau`` is one time (or ``A`` time features, ``num_axes``: each ``omega_i`` is then a vector);
    ``activation="cos"`` swaps the sine for a cosine (the paper's other choice). ``omega``
    ``[A, D]`` and ``phi`` ``[D]`` hold every component, the linear one in column 0 as in the
    paper; they start standard normal. To concatenate rather than add, use ``embed(times)``
    (``torch.cat([x, t2v.embed(times)], -1)``). Angles are computed in float64 from the stored
    parameters, so times of 1e6 keep float32 accuracy; scale raw timestamps (seconds since an
    epoch) to the periods you expect, since ``omega`` starts near 1 radian per unit.

    Args:
        dim (int): output width ``D = k + 1`` (at least 2).
        num_axes (int): time features ``A``. Default: 1.
        activation (str): ``"sin"`` or ``"cos"``. Default: ``"sin"``.

    Shape:
        - positions: times ``[..., N]`` (or ``[..., N, A]``), integer or float; ``embed`` -> ``[..., N, D]``.
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``; one axis
          defaults to ``arange(N) + offset``.

    Example:
        >>> t2v = Time2VecPositionalEmbedding(64)
        >>> times = torch.tensor([[0.0, 0.7, 3.2, 3.3, 9.5]])     # irregular sampling
        >>> t2v(torch.randn(1, 5, 64), times).shape
        torch.Size([1, 5, 64])
    """

    explicit_axis = True
    arguments = {"activation": functools.partial(_check_choice, choices=("sin", "cos"))}

    def __init__(self, dim: int, *, num_axes: int = 1, activation: Literal["sin", "cos"] = "sin") -> None:
        super().__init__()
        if dim < 2:
            raise ValueError(f"{type(self).__name__}: dim must be at least 2 (one linear and one periodic "
                             f"component), got dim={dim}")
        self.dim, self.num_axes, self.activation = dim, num_axes, activation
        self.omega = nn.Parameter(torch.empty(num_axes, dim))                                   # [A, D]
        self.phi = nn.Parameter(torch.empty(dim))                                               # [D]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.omega)
        nn.init.normal_(self.phi)

    def embed(self, positions: Tensor) -> Tensor:
        """``t2v`` of the times ``positions`` ``[..., N]`` (``[..., N, A]``): float32 ``[..., N, D]``
        (float64 for float64 times or a float64 module)."""
        tau, dtype = _coordinates(type(self).__name__, positions, self.num_axes)                # [..., N, A]
        dtype = torch.promote_types(dtype, self.omega.dtype)
        z = torch.matmul(tau, self.omega.to(torch.float64)) + self.phi.to(torch.float64)        # [..., N, D]
        if not _skip_value_checks(z) and not ((z[..., 0].abs() <= torch.finfo(dtype).max).all()
                                              and torch.isfinite(z[..., 1:]).all()):
            raise ValueError(f"{type(self).__name__}: positions must keep omega . tau + phi finite in {dtype} (the "
                             f"linear component), got times up to {tau.abs().max().item():.6g}")
        periodic = torch.sin(z[..., 1:]) if self.activation == "sin" else torch.cos(z[..., 1:])
        return torch.cat([z[..., :1], periodic], dim=-1).to(dtype)


# ---------------------------------------------------------------------------
# Input kind, numbers: a digit's place in its number
# ---------------------------------------------------------------------------

def _digit_ids(owner: str, name: str, value) -> tuple:
    """Token ids of the digits: a non-empty sequence of ints (numpy ints, a 1-D integer tensor), as a
    tuple of ints; floats, bools and strings (``"0123"`` is not ids) are a TypeError."""
    items = value.tolist() if isinstance(value, Tensor) and value.dim() == 1 else value
    try:
        if isinstance(items, (str, bytes, Tensor)):
            raise TypeError
        items = list(items)
        if any(_is_bool(item) for item in items):
            raise TypeError
        ids = tuple(operator.index(item) for item in items)
    except TypeError:
        ids = ()
    if not ids:
        raise TypeError(f"{owner}: {name} must be a non-empty sequence of ints, got {_describe(value)}")
    if not all(-_INT64_MAX - 1 <= i <= _INT64_MAX for i in ids):
        raise ValueError(f"{owner}: {name} must be token ids within int64, got {_describe(value)}")
    return ids


def digit_positions(token_ids: Tensor, digit_ids, *, count_from: Literal["start", "end"] = "start") -> Tensor:
    """Each digit token's place in its run of consecutive digits, counted from 1; 0 for every other token.

    The positions of Abacus embeddings (``count_from="start"``: McLeish et al. write numbers least
    significant digit first, so 1 is the ones digit of every number) and of position coupling
    (Cho et al., "Position Coupling: Improving Length Generalization of Arithmetic Transformers
    Using Task Structure", arXiv:2405.20671): with numbers written most significant digit first,
    ``count_from="end"`` gives every digit its significance (1 for the ones digit), so the digits
    of equal significance in the operands and the result share a position.

    Args:
        token_ids (Tensor): integer token ids ``[..., N]``.
        digit_ids: the ids of the digit tokens (a sequence of ints or an integer tensor).
        count_from (str): ``"start"`` or ``"end"`` of each run. Default: ``"start"``.

    Returns:
        int64 ``[..., N]``.

    Example:
        >>> digits = list(range(10))                      # token ids 0..9 are "0".."9"; 10 is "+", 11 is "="
        >>> digit_positions(torch.tensor([3, 5, 6, 10, 9, 4, 11, 2, 0, 7]), digits)
        tensor([1, 2, 3, 0, 1, 2, 0, 1, 2, 3])
        >>> digit_positions(torch.tensor([3, 5, 6, 10, 9, 4, 11]), digits, count_from="end")
        tensor([3, 2, 1, 0, 2, 1, 0])
    """
    owner = "digit_positions"
    if not isinstance(token_ids, Tensor) or token_ids.is_floating_point() or token_ids.is_complex() \
            or token_ids.dtype == torch.bool:
        raise TypeError(f"{owner}: token_ids must be an integer tensor [..., N], got "
                        f"{token_ids.dtype if isinstance(token_ids, Tensor) else type(token_ids).__name__}")
    if token_ids.dim() < 1:
        raise ValueError(f"{owner}: token_ids must have shape [..., N], got shape {tuple(token_ids.shape)}")
    _check_choice(owner, "count_from", count_from, ("start", "end"))
    digits = torch.tensor(_digit_ids(owner, "digit_ids", digit_ids), device=token_ids.device)
    is_digit = torch.isin(token_ids, digits)                                                # [..., N]
    if count_from == "end":
        is_digit = is_digit.flip(-1)
    index = torch.arange(token_ids.shape[-1], device=token_ids.device).expand(token_ids.shape)
    after_other = F.pad(~is_digit[..., :-1], (1, 0), value=True)                            # token before is no digit
    run_start = torch.where(is_digit & after_other, index, 0).cummax(-1).values             # [..., N]
    places = (index - run_start + 1) * is_digit
    return places.flip(-1) if count_from == "end" else places


class AbacusPositionalEmbedding(_AddedInput):
    """Abacus embeddings: a learned vector per digit place, added to digit tokens (McLeish et al.,
    "Transformers Can Do Arithmetic with the Right Embeddings", arXiv:2405.17399).

    A digit's position is its place in its number, counted from the number's first digit
    (``digit_positions``; the paper writes numbers least significant digit first, so place 1 is
    the ones digit); every other token has position 0. ``embed(p)`` is row ``p + k`` of a learned
    ``[max_len, D]`` table for digits and row 0 for the rest, where in training mode one offset
    ``k``, drawn uniformly from ``0 .. max_k`` per call (``generator`` seeds it), moves every digit,
    so the places seen in training cover longer numbers than the training data holds; ``k = 0``
    in eval. As in the reference code, the table starts ``N(0, 1)`` (``nn.Embedding``'s default)
    and row 0 is a learned vector added to every non-digit token. ``draw_digit_offset()`` draws
    such a ``k``, ``embed(p, digit_offset=k)`` uses a given one (in either mode), and
    ``table_rows(p, digit_offset=k)`` gives the rows the table is read at.

    Args:
        dim (int): token width ``D``.
        digit_ids: the token ids of the ten digits (for ``digit_positions``), a non-empty sequence
            of ints.
        max_len (int): rows of the table; places plus ``k`` must stay below it. Default: 1024.
        max_k (int): the largest training offset. Default: 99.
        generator (torch.Generator, optional): the source of ``k``. Default: torch's global one.

    Shape:
        - positions: integer ``[..., N]`` from ``digit_positions(token_ids)`` (required: no default).
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``.

    Example:
        >>> abacus = AbacusPositionalEmbedding(64, digit_ids=range(10), max_len=128, max_k=20)
        >>> tokens = torch.tensor([[3, 5, 6, 10, 9, 4, 11, 2, 0, 7]])   # "653+49=207": digits reversed
        >>> places = abacus.digit_positions(tokens)                     # [[1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]
        >>> abacus(torch.randn(1, 10, 64), places).shape                # training: one random k per call
        torch.Size([1, 10, 64])
    """

    integer_positions = True
    positions_from = "digit_positions(token_ids)"
    arguments = {"max_k": functools.partial(_as_int, minimum=0), "digit_ids": _digit_ids}

    def __init__(self, dim: int, digit_ids, *, max_len: int = 1024, max_k: int = 99,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        _check_generator(type(self).__name__, generator)
        if max_k >= max_len - 1:
            raise ValueError(f"{type(self).__name__}: max_k must be below max_len - 1 (room for place 1), got "
                             f"max_k={max_k}, max_len={max_len}")
        self.dim, self.max_len, self.max_k, self.generator = dim, max_len, max_k, generator
        self.digit_ids = tuple(digit_ids)
        self.embedding = _uninitialised(nn.Embedding, max_len, dim)                            # [max_len, D]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.embedding.reset_parameters()

    def digit_positions(self, token_ids: Tensor) -> Tensor:
        """``digit_positions(token_ids, digit_ids)``: the places of this module's digits, ``[..., N]``."""
        return digit_positions(token_ids, self.digit_ids)

    def draw_digit_offset(self) -> Tensor:
        """The offset ``k`` of one call: uniform in ``0 .. max_k`` from ``generator`` in training mode, 0 in
        eval (drawing nothing), as a 0-dim int64 CPU tensor."""
        k = self._drawn_offset()
        return torch.zeros((), dtype=torch.long) if k is None else k

    def _drawn_offset(self) -> Optional[Tensor]:
        """``k`` drawn in training mode (with ``max_k > 0``), else None (no offset)."""
        if self.training and self.max_k:
            return torch.randint(0, self.max_k + 1, (), generator=self.generator, device="cpu")
        return None

    def table_rows(self, positions: Tensor, *, digit_offset=None) -> Tensor:
        """The rows of the table ``embed`` reads for ``positions`` ``[..., N]``: ``p + k`` for digits (``p > 0``),
        0 for other tokens, with ``k = digit_offset`` (an int or 0-dim integer tensor), or drawn as
        ``draw_digit_offset()`` draws it when None. int64 ``[..., N]``."""
        owner = type(self).__name__
        _check_table_range(owner, "positions", positions, self.max_len)
        if digit_offset is None:
            k = self._drawn_offset()                                                            # one k per call
        else:
            k = _as_int(owner, "digit_offset", digit_offset, minimum=0)
            if k > self.max_len - 2:   # no digit (place >= 1) fits the table then; past int64 torch.tensor overflows
                raise ValueError(f"{owner}: digit_offset must be at most max_len - 2 = {self.max_len - 2} (room for "
                                 f"place 1), got digit_offset={k}")
            k = torch.tensor(k)
        if k is None:
            return positions.long()
        rows = torch.where(positions > 0, positions + k.to(positions.device), positions).long()
        _check_table_range(owner, "positions + the training offset k", rows, self.max_len)
        return rows

    def embed(self, positions: Tensor, *, digit_offset=None) -> Tensor:
        """Rows of the table for ``positions`` ``[..., N]``: ``table_rows(positions, digit_offset=...)``
        (training: digits moved by one random ``k`` unless ``digit_offset`` gives it)."""
        return F.embedding(self.table_rows(positions, digit_offset=digit_offset), self.embedding.weight)   # [..., N, D]


# ---------------------------------------------------------------------------
# Input kind, graphs: node coordinates from the graph's structure (Laplacian eigenvectors, random walks)
# ---------------------------------------------------------------------------

def _dense_adjacency(owner: str, adjacency: Optional[Tensor], edge_index: Optional[Tensor],
                     num_nodes: Optional[int], edge_weight: Optional[Tensor]) -> Tensor:
    """The graph given either way, as a float64 adjacency ``[..., N, N]`` (``A[i, j]``: the weight of
    the edge ``i -> j``; ``edge_index`` ``[2, E]`` holds PyG's (source, target) rows, repeated
    edges add their weights)."""
    if (adjacency is None) == (edge_index is None):
        raise ValueError(f"{owner}: give the graph as adjacency ([..., N, N]) or as edge_index ([2, E]) with "
                         f"num_nodes, got {'both' if adjacency is not None else 'neither'}")
    if adjacency is not None:
        if not isinstance(adjacency, Tensor) or adjacency.is_complex():
            raise TypeError(f"{owner}: adjacency must be a real or bool tensor, got "
                            f"{adjacency.dtype if isinstance(adjacency, Tensor) else type(adjacency).__name__}")
        if adjacency.dim() < 2 or adjacency.shape[-1] != adjacency.shape[-2]:
            raise ValueError(f"{owner}: adjacency must have shape [..., N, N], got {tuple(adjacency.shape)}")
        weights = adjacency.to(torch.float64)
        _check_edge_weights(owner, weights)
        return weights
    n = _check_positive_int(owner, "num_nodes", num_nodes)
    values = _edge_values(owner, edge_index, n, edge_weight)                                    # [E]
    weights = torch.zeros(n, n, dtype=torch.float64, device=edge_index.device)
    return weights.index_put((edge_index[0], edge_index[1]), values, accumulate=True)           # [N, N]


def _edge_values(owner: str, edge_index, n: int, edge_weight: Optional[Tensor]) -> Tensor:
    """The checked weights ``[E]`` (float64; 1 without ``edge_weight``) of PyG's ``edge_index`` ``[2, E]``
    on ``n`` nodes."""
    if not isinstance(edge_index, Tensor) or edge_index.is_floating_point() or edge_index.dtype == torch.bool:
        raise TypeError(f"{owner}: edge_index must be an integer tensor, got "
                        f"{edge_index.dtype if isinstance(edge_index, Tensor) else type(edge_index).__name__}")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"{owner}: edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= n):
        raise ValueError(f"{owner}: edge_index must hold node ids in [0, {n}) for num_nodes={n}, "
                         f"got ids from {edge_index.min().item()} to {edge_index.max().item()}")
    values = torch.ones(edge_index.shape[1], dtype=torch.float64, device=edge_index.device)
    if edge_weight is not None:
        _check_tensor(owner, "edge_weight", edge_weight, 1)
        if edge_weight.shape != values.shape:
            raise ValueError(f"{owner}: edge_weight must have shape [{values.shape[0]}] (one per edge), "
                             f"got {tuple(edge_weight.shape)}")
        values = edge_weight.to(torch.float64)
    _check_edge_weights(owner, values)
    return values


def _check_edge_weights(owner: str, weights: Tensor) -> None:
    if not _skip_value_checks(weights) and not (torch.isfinite(weights).all() and (weights >= 0).all()):
        raise ValueError(f"{owner}: edge weights must be finite and >= 0")


def _node_graphs(owner: str, batch, edge_index: Tensor, num_nodes: Optional[int], edge_weight) -> tuple:
    """PyG's ``batch`` (node -> graph) checked with ``edge_index``: ``(graph, local, counts, values)``, each
    node's graph and its index inside that graph (its rank among the graph's nodes), int64 ``[N]``, the
    nodes of each graph, ``[G]``, and the edges' weights ``[E]`` (``_edge_values``)."""
    if not isinstance(batch, Tensor) or batch.is_floating_point() or batch.is_complex() \
            or batch.dtype == torch.bool or batch.dim() != 1:
        raise TypeError(f"{owner}: batch must be an integer tensor [N] (the graph of each node), got "
                        f"{_describe(batch)}")
    n = batch.shape[0] if num_nodes is None else _check_positive_int(owner, "num_nodes", num_nodes)
    if batch.shape[0] != n or n == 0 or batch.min() < 0:
        raise ValueError(f"{owner}: batch must hold a graph id >= 0 for each of the num_nodes={n} nodes, got "
                         f"{_describe(batch)}" + (f" holding ids {batch.min().item()} to {batch.max().item()}"
                                                  if batch.numel() else ""))
    values = _edge_values(owner, edge_index, n, edge_weight)                                    # [E]
    graph = batch.to(edge_index.device, torch.long)
    source, target = edge_index.long()
    across = (graph[source] != graph[target]).nonzero()
    if across.numel():
        e = across[0, 0].item()
        raise ValueError(f"{owner}: edge_index must join nodes of the same graph (batch), got the edge "
                         f"{source[e].item()} -> {target[e].item()} from graph {graph[source[e]].item()} to graph "
                         f"{graph[target[e]].item()}")
    counts = torch.bincount(graph)                                                              # [G] nodes
    order = torch.argsort(graph, stable=True)                                                   # by graph, in order
    local = torch.empty_like(graph)
    local[order] = torch.arange(n, device=graph.device) - (counts.cumsum(0) - counts)[graph[order]]
    return graph, local, counts, values


class _GraphInput(_AddedInput):
    """The ``"input"`` kind on graphs. A node's position is a vector the graph's structure gives it:
    a subclass writes ``structure(adjacency) -> [..., N, A]`` (float64 in and out, the maths) and
    ``embed``; this base turns a graph given as a dense adjacency or as PyG's ``edge_index`` into
    that adjacency (``graph_positions``); ``forward`` requires the positions (there is no default graph)."""

    positions_from = "the nodes' graph_positions(adjacency) or graph_positions(edge_index=..., num_nodes=N)"
    explicit_axis = True

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """``x + embed(positions)``, positions ``[..., N, A]`` as ``graph_positions`` gives them (also for A = 1)."""
        if self.num_axes == 1 and isinstance(positions, Tensor) and positions.dim() >= 2 and positions.shape[-1] == 1:
            positions = positions.squeeze(-1)   # [..., N, 1] -> [..., N]: one axis as the base's checks take it
        return super().forward(x, positions, offset=offset)

    def structure(self, adjacency: Tensor) -> Tensor:
        raise NotImplementedError

    def graph_positions(self, adjacency: Optional[Tensor] = None, *, edge_index: Optional[Tensor] = None,
                        num_nodes: Optional[int] = None, edge_weight: Optional[Tensor] = None,
                        batch: Optional[Tensor] = None) -> Tensor:
        """The nodes' positions ``[..., N, A]`` of the graph given as ``adjacency`` ``[..., N, N]`` or as
        ``edge_index`` ``[2, E]`` with ``num_nodes``, in the module's dtype (float64 for a float64 adjacency).

        ``batch`` ``[N]`` (PyG's: node -> graph id, with ``edge_index``; ``num_nodes`` defaults to its
        length) holds several graphs in one ``edge_index``: each graph gets its own positions, as if given
        alone (in a dense batch padded to one size, the padding nodes' eigenvalue-1 eigenvectors join a
        graph's Laplacian spectrum). Graphs of one size are computed together.
        """
        owner, dtype = type(self).__name__, self._parameter_dtype()
        if adjacency is not None and adjacency.dtype == torch.float64:
            dtype = torch.float64
        if batch is None:
            return self.structure(_dense_adjacency(owner, adjacency, edge_index, num_nodes, edge_weight)).to(dtype)
        if adjacency is not None or edge_index is None:
            raise ValueError(f"{owner}: batch (PyG's node -> graph ids) goes with edge_index, got "
                             f"{'adjacency' if adjacency is not None else 'no edge_index'}")
        graph, local, counts, values = _node_graphs(owner, batch, edge_index, num_nodes, edge_weight)
        source, target = edge_index.long()
        out = torch.zeros(graph.shape[0], self.num_axes, dtype=torch.float64, device=graph.device)   # [N, A]
        for size in counts.unique().tolist():
            if size == 0:
                continue
            graphs = (counts == size).nonzero().squeeze(-1)                                     # [G_s] of this size
            slot = torch.full_like(counts, -1)
            slot[graphs] = torch.arange(graphs.shape[0], device=graph.device)                   # graph -> its slot
            edges = slot[graph[source]] >= 0                                                    # [E]: in these graphs
            weights = torch.zeros(graphs.shape[0], size, size, dtype=torch.float64, device=graph.device)
            weights.index_put_((slot[graph[source[edges]]], local[source[edges]], local[target[edges]]), values[edges],
                               accumulate=True)                                                 # [G_s, n, n]
            nodes = (slot[graph] >= 0).nonzero().squeeze(-1)                                    # their nodes
            out[nodes] = self.structure(weights)[slot[graph[nodes]], local[nodes]]              # [G_s, n, A] -> rows
        return out.to(dtype)

    def _parameter_dtype(self) -> torch.dtype:
        """The dtype of the module's floating parameters (float32 without any)."""
        for parameter in self.parameters():
            if parameter.is_floating_point():
                return parameter.dtype
        return torch.float32



class LaplacianPositionalEmbedding(_GraphInput):
    """Laplacian eigenvector positions of graph nodes, projected and added to the node states
    (Dwivedi et al., "Benchmarking Graph Neural Networks", arXiv:2003.00982).

    ``graph_positions(graph)``: the eigenvectors of the ``k`` smallest eigenvalues after the first
    of the symmetric normalised Laplacian ``L = I - D^-1/2 A D^-1/2`` (an isolated node has
    ``D^-1/2 = 0``), computed in float64 by ``torch.linalg.eigh`` (dense, ``O(N^3)``: compute them
    once per graph, in the data pipeline, as PyG's ``AddLaplacianEigenvectorPE`` does). A graph
    with fewer than ``k + 1`` nodes gets zero columns. The graph must be undirected (a symmetric
    adjacency). Eigenvectors are defined up to sign (and, for repeated eigenvalues, up to a
    rotation within their eigenspace), so:

    * ``sign_flip=True`` (the paper's): in training mode each eigenvector of each graph is
      multiplied by a random sign on every call (``generator`` seeds the draws); none in eval.
    * ``sign_invariant=True``: SignNet (Lim et al., "Sign and Basis Invariant Networks for
      Spectral Graph Representation Learning", arXiv:2202.13013) in its pointwise form,
      ``rho([phi(v_i) + phi(-v_i)]_i)`` with ``phi`` an MLP (``1 -> hidden -> hidden``, ReLU)
      applied to each node's entry of each eigenvector and ``rho`` a linear map of the ``k``
      concatenated results; no flips are needed then. The GNN form of ``phi`` is not built.

    Otherwise ``embed(v) = proj(v)``, one ``nn.Linear(k, dim)``.

    Args:
        dim (int): node state width ``D``.
        k (int): eigenvectors per node (the position axes ``A``).
        sign_flip (bool): random sign flips in training. Default: True.
        sign_invariant (bool): SignNet instead of a linear map. Default: False.
        hidden_dim (int): SignNet's ``phi`` width. Default: 16.
        generator (torch.Generator, optional): the source of the sign flips. Default: torch's global one.

    Shape:
        - positions: ``[..., N, k]`` from ``graph_positions``; ``embed`` -> ``[..., N, D]``.
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``.

    Example:
        >>> lap = LaplacianPositionalEmbedding(32, k=4).eval()
        >>> ring = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4, 5]])
        >>> nodes = lap.graph_positions(edge_index=ring, num_nodes=6)     # [6, 4], once per graph
        >>> lap(torch.randn(6, 32), nodes).shape
        torch.Size([6, 32])
    """

    arguments = {"k": _check_positive_int, "sign_flip": _check_flag, "sign_invariant": _check_flag}

    def __init__(self, dim: int, k: int, *, sign_flip: bool = True, sign_invariant: bool = False,
                 hidden_dim: int = 16, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        _check_generator(type(self).__name__, generator)
        self.dim, self.num_axes, self.k = dim, k, k
        self.sign_flip, self.sign_invariant, self.generator = sign_flip, sign_invariant, generator
        if sign_invariant:
            self.phi = nn.Sequential(_uninitialised(nn.Linear, 1, hidden_dim), nn.ReLU(),
                                     _uninitialised(nn.Linear, hidden_dim, hidden_dim))
            self.rho = _uninitialised(nn.Linear, k * hidden_dim, dim)
        else:
            self.proj = _uninitialised(nn.Linear, k, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()

    def structure(self, adjacency: Tensor) -> Tensor:
        """The ``k`` smallest non-trivial eigenvectors of the normalised Laplacian: ``[..., N, N]`` ->
        ``[..., N, k]`` (float64)."""
        if not _skip_value_checks(adjacency) and not torch.equal(adjacency, adjacency.transpose(-1, -2)):
            raise ValueError(f"{type(self).__name__}: the graph must be undirected (a symmetric adjacency, or "
                             f"edge_index holding both directions of every edge)")
        n = adjacency.shape[-1]
        degree = adjacency.sum(-1)                                                              # [..., N]
        scale = torch.where(degree > 0, degree.clamp(min=1e-300).rsqrt(), torch.zeros_like(degree))
        laplacian = torch.eye(n, dtype=adjacency.dtype, device=adjacency.device) \
            - scale.unsqueeze(-1) * adjacency * scale.unsqueeze(-2)                             # [..., N, N]
        _, vectors = torch.linalg.eigh(laplacian)                                               # ascending
        vectors = vectors[..., 1:self.k + 1]                                                    # [..., N, <= k]
        return F.pad(vectors, (0, self.k - vectors.shape[-1]))                                  # [..., N, k]

    def embed(self, positions: Tensor) -> Tensor:
        """Node codes of the eigenvectors ``positions`` ``[..., N, k]``: float32 ``[..., N, D]``
        (float64 for float64 positions or a float64 module)."""
        v, dtype = _coordinates(type(self).__name__, positions, self.num_axes)                 # [..., N, k]
        weight = (self.rho if self.sign_invariant else self.proj).weight
        v = v.to(torch.promote_types(dtype, weight.dtype))
        if self.training and self.sign_flip and not self.sign_invariant:
            flips = torch.randint(0, 2, (*v.shape[:-2], 1, self.k), generator=self.generator, device="cpu")
            v = v * (2 * flips - 1).to(device=v.device, dtype=v.dtype)                          # one sign per graph
        if not self.sign_invariant:
            return _run_mlp(self.proj, v)
        entries = v.unsqueeze(-1)                                                               # [..., N, k, 1]
        invariant = _run_mlp(self.phi, entries) + _run_mlp(self.phi, -entries)                  # [..., N, k, h]
        return _run_mlp(self.rho, invariant.flatten(-2))                                        # [..., N, D]


class RandomWalkPositionalEmbedding(_GraphInput):
    """Random-walk positions of graph nodes, projected and added to the node states (Dwivedi et al.,
    "Graph Neural Networks with Learnable Structural and Positional Representations",
    arXiv:2110.07875).

    ``graph_positions(graph)``: node ``i``'s probabilities of returning to itself after
    ``1, ..., k`` steps of the random walk ``P = D^-1 A`` (``[P_ii, (P^2)_ii, ..., (P^k)_ii]``,
    ``D`` the weighted out-degree; a node with no out-edge has a zero row), by dense matrix powers
    in float64 (``O(k N^3)``: compute them once per graph). Directed graphs walk along their
    edges; weighted edges are taken with probability ``w / D``. ``embed(p) = proj(p)``, one
    ``nn.Linear(k, dim)``. Unlike eigenvectors, these need no sign handling.

    PyG 2.8.1's ``AddRandomWalkPE`` gives the same numbers on unweighted graphs. With
    ``edge_weight`` it puts ``1 / D`` on every edge (the weight is dropped, so rows need not sum
    to 1) and clamps ``D`` at 1, and its dense path keeps one copy of a repeated edge (pyg-team
    issue #10098, pull request #10825); this class follows the paper's ``D^-1 A``.

    Args:
        dim (int): node state width ``D``.
        walk_length (int): steps ``k`` (the position axes ``A``).

    Shape:
        - positions: ``[..., N, k]`` from ``graph_positions``; ``embed`` -> ``[..., N, D]``.
        - x: ``[..., N, D]``; ``forward(x, positions)`` -> ``x + embed(positions)``.

    Example:
        >>> rw = RandomWalkPositionalEmbedding(32, walk_length=8)
        >>> triangle_and_tail = torch.tensor([[0, 1, 1, 2, 2, 0, 2, 3], [1, 0, 2, 1, 0, 2, 3, 2]])
        >>> nodes = rw.graph_positions(edge_index=triangle_and_tail, num_nodes=4)   # [4, 8]
        >>> rw(torch.randn(4, 32), nodes).shape
        torch.Size([4, 32])
    """

    arguments = {"walk_length": _check_positive_int}

    def __init__(self, dim: int, walk_length: int) -> None:
        super().__init__()
        self.dim, self.num_axes, self.walk_length = dim, walk_length, walk_length
        self.proj = _uninitialised(nn.Linear, walk_length, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()

    def structure(self, adjacency: Tensor) -> Tensor:
        """Return probabilities ``[..., N, N]`` -> ``[..., N, k]`` (float64)."""
        degree = adjacency.sum(-1, keepdim=True)                                                # [..., N, 1]
        step = adjacency / torch.where(degree > 0, degree, torch.ones_like(degree))            # P = D^-1 A
        walk, returns = step, []
        for _ in range(self.walk_length):
            returns.append(walk.diagonal(dim1=-2, dim2=-1))                                     # [..., N]
            walk = walk @ step
        return torch.stack(returns, dim=-1)                                                     # [..., N, k]

    def embed(self, positions: Tensor) -> Tensor:
        """Node codes of the return probabilities ``positions`` ``[..., N, k]``: float32 ``[..., N, D]``
        (float64 for float64 positions or a float64 module)."""
        p, dtype = _coordinates(type(self).__name__, positions, self.num_axes)                 # [..., N, k]
        return _run_mlp(self.proj, p.to(torch.promote_types(dtype, self.proj.weight.dtype)))


# ---------------------------------------------------------------------------
# Input kind, recurrent: Heinsen's exponentiated state (the plain scan beside the blocked one)
# ---------------------------------------------------------------------------

def _log_linear_scan(log_p: Tensor, h: Tensor, initial: Tensor, differentiable: bool = False,
                     segmented: bool = False) -> Tensor:
    """``s_t = log(exp(log_p_t + s_{t-1}) + exp(h_t))`` from ``s_0 = initial``, in parallel.

    log_p, h: [..., N, d]; initial: [..., 1, d] -> s: [..., N, d]. The closed form
    ``s = a + log(exp(s_0) + cumsum(exp(h - a)))`` with ``a = cumsum(log_p)`` (Heinsen;
    Martin and Cundy, arXiv:1709.04057) cancels two numbers of size ``|a|``, which grows with
    N. So the sequence is cut into blocks of ``_SCAN_BLOCK`` tokens (one block if shorter),
    each scanned from an empty state (``_scan_blocks``); the blocks are chained by the same
    recurrence over their summaries in float64, exact enough at any length for
    ``1 / _SCAN_BLOCK`` of the work, and each block then adds the state it inherits, decayed
    by ``a`` within the block. ``differentiable=True`` records a graph autograd can
    differentiate twice (the double backward's recomputation): steps without ``out=`` in the
    blocks, and the chain by this blocked scan again rather than ``logcumsumexp``, whose
    backward gives NaN second derivatives wherever the gradient reaching it is 0.

    ``segmented=True`` allows ``log_p = -inf`` (a decay of exactly 0: the state is dropped,
    packed documents): every closed form would meet ``-inf - -inf`` there, so the blocks step
    and the chain is this scan again, and every ``logaddexp`` that may see the dropped state
    goes through ``_logaddexp_dropped`` (finite derivatives of every order).
    """
    n = log_p.shape[-2]
    exporting = _is_exporting()
    if exporting:  # one graph for every N: no N % T and no size that is 1 for some N only (export cannot bound
        # them); a spare block, the padding repeating the last token
        size = _SCAN_BLOCK                                                              # T
        blocks = (n + 2 * size - 1) // size                                             # nb = ceil(N / T) + 1
        index = torch.arange(blocks * size, device=log_p.device).clamp_(max=n - 1)     # [nb T]
        log_p, h = log_p.index_select(-2, index), h.index_select(-2, index)
    else:
        size = min(n, _SCAN_BLOCK)                                                      # T
        pad = -n % size
        if pad:  # any finite values (no -inf: NaN second derivatives): cut off, and the chain skips the last block
            log_p, h = F.pad(log_p, (0, 0, 0, pad)), F.pad(h, (0, 0, 0, pad))
        blocks = (n + pad) // size
    a, local = _scan_blocks(log_p.unflatten(-2, (blocks, size)), h.unflatten(-2, (blocks, size)), differentiable,
                            segmented)
    entering = initial.double()                                                         # [..., 1, d]
    if blocks > 1:  # the states after every block but the last, by the recurrence over their summaries
        chained = blocks if exporting else blocks - 1   # C; exporting: the spare one too (nb - 1 may be 1)
        decay, last = a[..., :chained, -1, :].double(), local[..., :chained, -1, :].double()   # [..., C, d]
        after = (_log_linear_scan(decay, last, entering, differentiable, segmented) if differentiable or segmented
                 else _log_linear_scan_exact(decay, last, entering))                   # [..., C, d]
        entering = torch.cat([entering, after], dim=-2)[..., :blocks, :]                # [..., nb, d]
        del decay, last, after
    # rebinding frees the old ``a`` (peak memory as in place); not in place: vmap may batch entering alone
    a = a + entering.to(a.dtype).unsqueeze(-2)                                          # [..., nb, T, d]
    s = (_logaddexp_dropped(a, local) if segmented else torch.logaddexp(a, local)).flatten(-3, -2)   # [..., nb T, d]
    return s.index_select(-2, torch.arange(n, device=s.device)) if exporting else s[..., :n, :]


def _logaddexp_dropped(x: Tensor, y: Tensor) -> Tensor:
    """``logaddexp(x, y)`` where ``x`` is ``-inf`` at dropped states (segmented scans): ``y`` there,
    through a ``where`` whose other branch stays finite, since logaddexp's own second derivative
    is NaN at ``-inf``."""
    dropped = torch.isneginf(x)
    return torch.where(dropped, y, torch.logaddexp(x.masked_fill(dropped, 0.0), y))


def _scan_blocks(log_p: Tensor, h: Tensor, differentiable: bool = False, segmented: bool = False) -> tuple:
    """Every block scanned from an empty state (``s = log 0``), all blocks at once.

    log_p, h: [..., nb, T, d] -> (a, local), both [..., nb, T, d]: ``a = cumsum(log_p)`` and
    ``local_t = log(exp(log_p_t + local_{t-1}) + exp(h_t))``. Eager mode steps through the
    ``T`` tokens of every block together: one rounding per step, and ~6x faster on CPU than
    ``logcumsumexp``; ``differentiable=True`` takes the same steps as new tensors (autograd
    cannot record ``out=``); traced code uses the closed form, one fused expression, except
    ``segmented`` scans (``log_p = -inf`` breaks it), which step there too.
    """
    a = log_p.cumsum(dim=-2)
    if differentiable or (segmented and _is_compiling()):
        step = _logaddexp_dropped if segmented else torch.logaddexp
        local = [h[..., 0, :]]
        for t in range(1, h.shape[-2]):
            local.append(step(local[-1] + log_p[..., t, :], h[..., t, :]))
        return a, torch.stack(local, dim=-2)
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
    return torch.logaddexp(initial, torch.logcumsumexp(h - a, dim=-2)) + a


_SCAN_BLOCK = 128


def _signed_linear_scan(log_c: Tensor, u: Tensor, initial: Tensor, segmented: bool = False,
                        differentiable: bool = False) -> Tensor:
    """``T_t = c_t T_{t-1} + u_t`` from ``T_0 = initial``, for ``c = exp(log_c) > 0`` and signed u.

    log_c, u: [..., N, d]; initial: [..., 1, d] -> T: [..., N, d]. The recurrence is linear
    with positive weights, so the positive and negative parts of (u, initial) follow it
    separately: two log-space scans ``_log_linear_scan(log_c, log u+, log T_0+)``, then
    ``T = exp(positive) - exp(negative)``. ``u`` is overwritten (peak memory matters here),
    except with ``differentiable=True``: then every step is recorded out of place, for autograd
    through the result (reverse-over-forward: a gradient of a jvp). The backward (``G``,
    reversed time) and the jvp (the tangent of ``s``) both are this scan; ``segmented``:
    ``log_c`` is ``-inf`` where the state was dropped.
    """
    if differentiable:  # log 0 = -inf enters the scans: safe logs, and the logaddexps that tolerate -inf
        def log_part(t: Tensor) -> Tensor:                                              # log max(t, 0), finite derivatives
            return torch.where(t > 0, torch.where(t > 0, t, 1.0).log(), float("-inf"))

        def scan(log_u: Tensor, log_initial: Tensor) -> Tensor:
            return _log_linear_scan(log_c, log_u, log_initial, differentiable=True, segmented=True)
        return scan(log_part(u), log_part(initial)).exp() - scan(log_part(-u), log_part(-initial)).exp()
    positive = _log_linear_scan(log_c, u.clamp(min=0).log(), initial.clamp(min=0).log(), segmented=segmented)
    negative = _log_linear_scan(log_c, u.neg_().clamp_(min=0).log_(), initial.neg().clamp_(min=0).log_(),
                                segmented=segmented)
    return positive.exp_().sub_(negative.exp_())


class _LogLinearScanFunction(torch.autograd.Function):
    """``_log_linear_scan`` with an analytic backward (jvp: the subclass) from (log_p, h, initial, s).

    With ``c_t = exp(log_p_t + s_{t-1} - s_t)`` (the share of the old state) and
    ``w_t = exp(h_t - s_t)`` (the share of the update), the gradient ``G`` reaching ``s``
    satisfies ``G_t = g_t + c_{t+1} G_{t+1}``, and the tangent ``T = ds`` satisfies
    ``T_t = c_t T_{t-1} + c_t dlog_p_t + w_t dh_t`` from ``T_0 = d initial``: both are
    ``_signed_linear_scan``. Then ``dL/dh = G w``, ``dL/dlog_p = G c``, ``dL/dinitial = G_1 c_1``.
    Autograd through the closed form would keep three more ``[..., N, d]`` tensors; it is
    used only when the gradient must itself be differentiated (``create_graph=True``).
    ``vmap`` moves the batch dim to the front: the scan takes any leading dims.
    ``segmented=True``: ``log_p`` may be ``-inf`` (dropped states); then ``c = 0`` there, and
    both linear scans are segmented the same way.
    """

    @staticmethod
    def forward(log_p: Tensor, h: Tensor, initial: Tensor, segmented: bool = False) -> Tensor:
        return _log_linear_scan(log_p, h, initial, segmented=segmented)                 # [..., N, d]

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        log_p, h, initial = inputs[:3]
        ctx.segmented = len(inputs) > 3 and inputs[3]
        ctx.save_for_backward(log_p, h, initial, output)
        ctx.save_for_forward(log_p, h, initial, output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        log_p, h, initial, s = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (functorch's too): the gradient may be differentiated again
            return (*_scan_vjp_differentiable(log_p, h, initial, grad, ctx.segmented), None)
        # The reversed scan at step tau (token t = N + 1 - tau) applies c_{t+1}: log c flipped, shifted by one.
        # log c is built twice rather than kept: this runs on [..., N, d] tensors and peak memory matters.
        log_next = torch.zeros_like(s)
        log_next[..., 1:, :] = _log_keep(log_p, s, initial)[..., 1:, :].flip(-2)
        total = _signed_linear_scan(log_next, grad.flip(-2), torch.zeros_like(initial),
                                    ctx.segmented).flip(-2)                              # G: [..., N, d]
        del log_next
        grad_h = total * (h - s).exp_()                                                  # G w (vmap: G alone batched)
        grad_log_p = total.mul_(_log_keep(log_p, s, initial).exp_())                     # G c
        return grad_log_p, grad_h, grad_log_p[..., :1, :].clone(), None

    @staticmethod
    def vmap(info, in_dims: tuple, log_p: Tensor, h: Tensor, initial: Tensor, segmented: bool = False) -> tuple:
        def batch_first(tensor: Tensor, dim: Optional[int]) -> Tensor:
            return tensor.expand(info.batch_size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)

        inputs = [batch_first(t, dim) for t, dim in zip((log_p, h, initial), in_dims)]
        return _scan_apply(*inputs, segmented), 0


class _LogLinearScanWithJvp(_LogLinearScanFunction):
    """``_LogLinearScanFunction`` with its forward-mode rule (``torch.func.jvp``, ``jacfwd``, HVPs).

    A class of its own because Dynamo cannot trace an ``autograd.Function`` that defines a
    ``jvp``: traced code applies the parent, which has the same value and backward.
    """

    @staticmethod
    def jvp(ctx, d_log_p: Optional[Tensor], d_h: Optional[Tensor], d_initial: Optional[Tensor],
            *_: None) -> Tensor:
        log_p, h, initial, s = ctx.saved_tensors
        log_c = _log_keep(log_p, s, initial)                                             # [..., N, d]
        # u = c dlog_p + w dh, out of place: under vmap the tangents may be batched and the rest not
        u = torch.zeros_like(s) if d_log_p is None else log_c.exp() * d_log_p           # [..., N, d]
        if d_h is not None:
            u = u + (h - s).exp_() * d_h
        start = torch.zeros_like(initial) if d_initial is None else d_initial            # [..., 1, d]
        # a tangent autograd may go through (torch.func's transforms hide requires_grad behind their
        # wrappers: parameters that require grad, a gradient of this jvp) is recorded step by step
        recorded = torch.is_grad_enabled() and any(t.requires_grad or _functorch_wrapped(t) for t in (log_c, u, start))
        return _signed_linear_scan(log_c, u, start, ctx.segmented, recorded)            # T: [..., N, d]


def _functorch_wrapped(t: Tensor) -> bool:
    """Is ``t`` wrapped by a ``torch.func`` transform (jvp, vmap, grad)?"""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return check is not None and check(t)


def _scan_apply(log_p: Tensor, h: Tensor, initial: Tensor, segmented: bool = False) -> Tensor:
    """The scan under autograd: with its jvp in eager mode, without it while Dynamo traces."""
    function = _LogLinearScanFunction if _is_compiling() else _LogLinearScanWithJvp
    return function.apply(log_p, h, initial, segmented)                                 # [..., N, d]


def _log_keep(log_p: Tensor, s: Tensor, initial: Tensor) -> Tensor:
    """``log c_t = log_p_t + s_{t-1} - s_t``: the log share of the old state in ``s_t``, [..., N, d]."""
    previous = torch.cat([initial.expand_as(s[..., :1, :]), s[..., :-1, :]], dim=-2)   # s_{t-1}
    return previous.sub_(s).add_(log_p)


def _scan_vjp_differentiable(log_p: Tensor, h: Tensor, initial: Tensor, grad: Tensor,
                             segmented: bool = False) -> tuple:
    """The backward as a graph autograd can differentiate again (``create_graph=True``).

    The scan is recomputed from its saved inputs with ``differentiable=True`` (the same
    blocks and float64 chain, every step recorded) and differentiated by ``torch.func.vjp``,
    which composes with outer autograd and with functorch transforms alike (``jacrev``,
    nested ``grad``). Costs autograd's memory for every step.
    """
    _, vjp = torch.func.vjp(lambda *inputs: _log_linear_scan(*inputs, differentiable=True, segmented=segmented),
                            log_p, h, initial)
    return vjp(grad)                                                                     # like (log_p, h, initial)


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

    Packed sequences: ``forward_input(x, document_positions(document_ids))`` (or
    ``forward(x, positions=...)``) restarts the state at every position 0, so each document
    is encoded exactly as if it ran alone (values and gradients). Positions must be exactly
    such within-document positions (``[N]`` or ``[B, N]``, 0 first, +1 within a document):
    anything else is a ``ValueError``, since the recurrence, not the positions, sets the order.
    The restart is a decay of exactly 0 at the first token of a document (``log_p = -inf``,
    ``h = logaddexp(log_p, h)``: the state before it is ``s = 0``), inside the same scan.

    Args:
        d_emb (int): token width ``D``.
        d_hid (int): number of exponentiated states.
        H (nn.Module, optional): ``[..., D] -> [..., 2 * d_hid]``. Default: ``nn.Linear``.
        R (nn.Module, optional): ``[..., d_hid] -> [..., D]``. Default: ``nn.Linear``.

    Shape:
        - x: ``[..., N, D]`` -> ``[..., N, D]``; state: ``[..., 1, d_hid]``; positions ``[N]`` or ``[B, N]``.

    Example:
        >>> embed = HeinsenPositionalEmbedding(d_emb=512, d_hid=512)
        >>> y = embed(torch.randn(2, 1000, 512))
        >>> y_next = embed(torch.randn(2, 1000, 512), using_prev_context=True)
        >>> packed = embed.forward_input(torch.randn(1000, 512), document_positions(torch.arange(1000) // 300))
    """

    kind = "input"
    takes_positions, order_from = False, "the recurrence (positions only restart it at documents)"

    arguments = {"d_emb": _check_positive_int, "d_hid": _check_positive_int, "H": _module_or_none,
                 "R": _module_or_none}

    def __init__(self, d_emb: int, d_hid: int, *, H: Optional[nn.Module] = None,
                 R: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.d_emb, self.d_hid = d_emb, d_hid
        self.H = nn.Linear(d_emb, 2 * d_hid) if H is None else H                        # paper's H (no sigmoid)
        self.R = nn.Linear(d_hid, d_emb) if R is None else R                            # paper's R
        self.register_buffer("prev_context", None, persistent=False)                    # [..., 1, d_hid]

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

    def _check_call(self, x: Tensor, using_prev_context, state: Optional[Tensor], return_state,
                    positions: Optional[Tensor] = None) -> tuple:
        """``forward``'s (and ``heinsen_forward_sharded``'s) arguments; returns the two flags as bools."""
        owner = type(self).__name__
        _check_tensor(owner, "x", x, 2)
        _check_last_dim(owner, "x", x, self.d_emb)
        self._check_device("x", x)
        using_prev_context = _check_flag(owner, "using_prev_context", using_prev_context)
        if using_prev_context and state is not None:
            raise ValueError(f"{owner}: pass either using_prev_context=True or state=, not both")
        if positions is not None and (using_prev_context or state is not None):
            raise ValueError(f"{owner}: positions start a new document at the first token, so no state is "
                             f"continued: pass positions or using_prev_context / state, not both")
        return using_prev_context, _check_flag(owner, "return_state", return_state)

    def forward(self, x: Tensor, using_prev_context: bool = False, *, state: Optional[Tensor] = None,
                return_state: bool = False, positions: Optional[Tensor] = None):
        """``x + R(s)``; with ``return_state=True`` also the final log-state ``[..., 1, d_hid]``.
        ``positions``: within-document positions of packed sequences (the state restarts at each 0)."""
        using_prev_context, return_state = self._check_call(x, using_prev_context, state, return_state, positions)
        restart = self._restarts(positions, x)                                          # [(B, 1..,) N, 1] or None
        state = self._continued(using_prev_context, state)
        logits = self.H(x)                                                              # [..., N, 2 * d_hid]
        self._check_width("H", logits, 2 * self.d_hid, "2 * d_hid")
        dtype = _compute_dtype(logits.dtype)
        log_p = F.logsigmoid(logits[..., : self.d_hid].to(dtype))                      # [..., N, d_hid]
        h = logits[..., self.d_hid :].to(dtype)                                         # [..., N, d_hid]
        initial = self._initial_state(state, x, dtype, "cached context" if using_prev_context else "state")
        if x.shape[-2] == 0:  # an empty chunk leaves the stream where it was
            self.prev_context = initial.detach()
            return (x, initial) if return_state else x
        if restart is not None:  # a document starts from s = 0: s_t = logaddexp(log_p_t + 0, h_t), old state dropped
            h = torch.where(restart, torch.logaddexp(log_p, h), h)                      # [..., N, d_hid]
            log_p = log_p.masked_fill(restart, float("-inf"))                           # [..., N, d_hid]
        s = _scan_apply(log_p, h, initial, restart is not None)                         # [..., N, d_hid]
        final = s[..., -1:, :]                                                          # [..., 1, d_hid]
        self.prev_context = final.detach()
        r = self.R(s.to(logits.dtype))                                                  # [..., N, D]
        self._check_width("R", r, self.d_emb, "d_emb")
        y = x + r.to(x.dtype)                                                           # [..., N, D]
        return (y, final) if return_state else y

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``x + R(s)``; ``positions``: None, or within-document positions (``document_positions``)."""
        return self(x, positions=positions)

    def _continued(self, using_prev_context: bool, state: Optional[Tensor]) -> Optional[Tensor]:
        """The state a call continues from: the cached context for ``using_prev_context``, else ``state``."""
        if not using_prev_context:
            return state
        if self.prev_context is None:
            raise ValueError(f"{type(self).__name__}: using_prev_context=True but no context is cached; "
                             f"call once without it first (or after reset_context())")
        return self.prev_context

    def _restarts(self, positions: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
        """Where documents start (position 0), from exact within-document positions: bool
        ``[(B, 1, ..,) N, 1]``, or None. Other positions are a ValueError (checked unless tracing)."""
        if positions is None:
            return None
        owner, n = type(self).__name__, x.shape[-2]
        checked = _check_positions(owner, "positions", positions, tuple(x.shape[:-2]), n, device=x.device)
        starts = checked == 0                                                           # [(B, 1..,) N]
        if _skip_value_checks(checked):
            return starts.unsqueeze(-1)
        wrong = checked != _positions_since(starts).to(checked.dtype)                   # [(B, 1..,) N]
        if wrong.any():
            first = wrong.reshape(-1, n).any(dim=0).nonzero()[0, 0]
            raise ValueError(f"{owner}: positions must be None or within-document positions "
                             f"(document_positions(document_ids): 0 at the first token, +1 within a document, "
                             f"0 where the next starts), since the recurrence encodes order; got "
                             f"{checked.reshape(-1, n)[:, first].tolist()} at token {int(first)}")
        return starts.unsqueeze(-1)

    def _initial_state(self, state: Optional[Tensor], x: Tensor, dtype: torch.dtype, name: str) -> Tensor:
        """The log-state before the first token: zeros, or ``state`` checked against x: [..., 1, d_hid]."""
        want = (*x.shape[:-2], 1, self.d_hid)
        if state is None:
            return torch.zeros(want, dtype=dtype, device=x.device)
        if not isinstance(state, Tensor):
            raise TypeError(f"{type(self).__name__}: {name} must be a Tensor, got {type(state).__name__}")
        if not state.is_floating_point():  # a log-state: int, bool or complex would be cast silently
            raise TypeError(f"{type(self).__name__}: {name} must be a floating tensor, got dtype={state.dtype}")
        if state.is_inference() and not torch.is_inference_mode_enabled():
            state = state.clone()  # a state cached under inference_mode, continued in training
        if tuple(state.shape) != want:
            raise ValueError(f"{type(self).__name__}: {name} must have shape {list(want)} to continue a chunk "
                             f"of shape {list(x.shape)}, got {list(state.shape)}")
        # a log-state: -inf is an empty state, NaN and +inf have no meaning (every output would be NaN / inf)
        if not _skip_value_checks(state) and (state.isnan() | (state == math.inf)).any():
            raise ValueError(f"{type(self).__name__}: {name} must be a log-state (finite, or -inf for an empty "
                             f"state), got {state[state.isnan() | (state == math.inf)][:3].tolist()}")
        return state.to(device=x.device, dtype=dtype)

    def _check_width(self, name: str, output: Tensor, size: int, expected: str) -> None:
        """Raise unless the output of ``H`` or ``R`` has last dim ``size`` (custom modules)."""
        if output.shape[-1] != size:
            raise ValueError(f"{type(self).__name__}: {name} must output last dim {expected} = {size}, "
                             f"got shape {list(output.shape)} (last dim {output.shape[-1]})")


EmbedPosition = HeinsenPositionalEmbedding


# ---------------------------------------------------------------------------
# Q/K kind, rotary: RoPE and its scalings (the fast rotation beside the plain one), HoPE, VideoRoPE
# ---------------------------------------------------------------------------

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


def _positive_ints(owner: str, name: str, value) -> list:
    """A list of positive ints (``sections``, ``mrope_section``)."""
    return [_check_positive_int(owner, name, size) for size in _as_list(owner, name, value)]


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
        params["mrope_section"] = _positive_ints(owner, "scaling['mrope_section']", params["mrope_section"])
    if "low_freq_factor" in params and "high_freq_factor" in params \
            and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(f"{owner}: scaling['high_freq_factor'] must exceed scaling['low_freq_factor'], got "
                         f"{params['high_freq_factor']} and {params['low_freq_factor']}")
    if "rope_theta" in params and _as_float(owner, "scaling['rope_theta']", params["rope_theta"]) != float(base):
        raise ValueError(f"{owner}: scaling['rope_theta']={params['rope_theta']} disagrees with base={base}")
    return params


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


def _rotate_pairs_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, interleaved: bool,
                       inverse: bool = False) -> None:
    """Write ``x`` with every pair turned by its angle (by minus it with ``inverse``) into ``out`` (eager
    fast path).

    x, out: [..., N, R] of one dtype; cos, sin: [..., N, R/2] (broadcastable), float32 or float64.
    The arithmetic runs in cos's dtype and rounds once to out's, with no cast of x or of the result:
    interleaved pairs in cos's dtype take one complex multiply; otherwise each member of the pair
    takes one multiply and one fused multiply-add, in place in ``out`` or, when ``out`` is narrower
    (bfloat16, float16), through one float32 temporary of half the width.
    """
    if interleaved and x.dtype == cos.dtype and _complex_viewable(x) and _complex_viewable(out):
        as_complex = lambda t: torch.view_as_complex(t.unflatten(-1, (-1, 2)))            # [..., N, R/2]
        torch.mul(as_complex(x), torch.complex(cos, -sin if inverse else sin), out=as_complex(out))
        return
    a, b = _pair_views(x, interleaved)
    out_a, out_b = _pair_views(out, interleaved)
    sign = 1.0 if inverse else -1.0      # a' = a cos - b sin, b' = b cos + a sin (sin -> -sin for the inverse)
    if out.dtype == cos.dtype:
        torch.mul(a, cos, out=out_a).addcmul_(b, sin, value=sign)
        torch.mul(b, cos, out=out_b).addcmul_(a, sin, value=-sign)
        return
    scratch = a * cos                                                                   # [..., N, R/2] float32
    torch.addcmul(scratch, b, sin, value=sign, out=out_a)
    torch.mul(b, cos, out=scratch)
    torch.addcmul(scratch, a, sin, value=-sign, out=out_b)


def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """The same rotation, out of place (for torch.compile, which fuses it into one kernel)."""
    a, b = _pair_views(x, interleaved)
    a, b = a * cos - b * sin, b * cos + a * sin
    return torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)


class _RotateFunction(torch.autograd.Function):
    """Rotation of several tensors, each by its own angles: ``R`` channels of each (the first, or with
    ``trailing`` the last; the rest pass through), written in the tensor's dtype.

    Arguments: ``layout = (interleaved, rotary_dim, trailing, inverse)``, then ``x, cos, sin`` per
    tensor; one output per ``x``. Forward uses the allocation-free path; the backward of a rotation
    is the rotation by minus the angle, so it runs the same path with ``inverse`` flipped.
    """

    @staticmethod
    def forward(ctx, layout: tuple, *tensors: Tensor) -> tuple:
        interleaved, rotary_dim, trailing, inverse = layout
        ctx.layout = layout
        ctx.save_for_backward(*[t for i, t in enumerate(tensors) if i % 3])                # every cos, sin
        outs = []
        for x, cos, sin in zip(tensors[0::3], tensors[1::3], tensors[2::3]):
            rotated, passed = _rotary_slices(x.shape[-1], rotary_dim, trailing)
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)                  # [..., N, Dh]
            if rotary_dim < x.shape[-1]:
                out[..., passed] = x[..., passed]
            _rotate_pairs_into(x[..., rotated], cos, sin, out[..., rotated], interleaved, inverse)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        interleaved, rotary_dim, trailing, inverse = ctx.layout
        angles = ctx.saved_tensors
        args = [t for grad, cos, sin in zip(grads, angles[0::2], angles[1::2]) for t in (grad, cos, sin)]
        grads_x = _RotateFunction.apply((interleaved, rotary_dim, trailing, not inverse), *args)
        return (None, *[t for grad in grads_x for t in (grad, None, None)])


def _rotary_slices(width: int, rotary_dim: int, trailing: bool) -> tuple:
    """The rotated and the passing channels of a head ``width`` wide: ``(rotated, passed)`` slices."""
    split = width - rotary_dim if trailing else rotary_dim
    return (slice(split, None), slice(0, split)) if trailing else (slice(0, split), slice(split, None))


def _rotate_formula(xs: tuple, cos: tuple, sin: tuple, interleaved: bool, rotary_dim: int, trailing: bool) -> tuple:
    """The rotation as one formula, what traced code runs and what ``_compiled_rotation`` compiles: each x
    of ``xs`` turned by its cos, sin in their dtype, rounded once to x's dtype (autograd's backward)."""
    turned = []
    for x, c, s in zip(xs, cos, sin):
        rotated, passed = _rotary_slices(x.shape[-1], rotary_dim, trailing)
        out = _rotate_pairs(x[..., rotated].to(c.dtype), c, s, interleaved)              # [..., N, R]
        if rotary_dim < x.shape[-1]:
            kept = x[..., passed].to(c.dtype)
            out = torch.cat([kept, out] if trailing else [out, kept], dim=-1)              # [..., N, Dh]
        turned.append(out.to(x.dtype))
    return tuple(turned)


_FUSED_ROTATION_DEVICES = ("cuda",)   # device types whose eager rotations run the compiled formula
_FUSED_ROTATION_KINDS = 16            # kinds of call (dtype, layout, grad mode, ...) it compiles, at most
_FUSED_ROTATION = {}                  # "fn": the compiled formula (None: no torch.compile here); "kinds": those
                                      # compiled; "own_limit": it has a recompile limit of its own; "error": why it stopped


def _compiled_rotation():
    """``_rotate_formula`` compiled once and reused, as ``flex_attention`` is (``_compiled_flex_attention``):
    one kernel per rotated tensor, forward and backward, where the eager path launches four or more.

    Each kind of call is one compilation, its sizes dynamic (``_fused_rotation`` marks them), so a new
    length or batch size reuses it. Where ``torch.compile`` takes a ``recompile_limit`` (torch >= 2.12)
    the rotation gets a limit of its own; before, its compilations count against
    ``torch._dynamo.config.recompile_limit`` (8 by default), which ``_fused_rotation`` stays within."""
    if "fn" not in _FUSED_ROTATION:
        own = "recompile_limit" in inspect.signature(torch.compile).parameters
        _FUSED_ROTATION["own_limit"] = own
        _FUSED_ROTATION["fn"] = torch.compile(_rotate_formula, **({"recompile_limit": 2 * _FUSED_ROTATION_KINDS}
                                                                  if own else {})) \
            if torch._dynamo.is_dynamo_supported() else None
    return _FUSED_ROTATION["fn"]


def _recompile_limit() -> int:
    """dynamo's limit of compilations per function: ``recompile_limit`` (``cache_size_limit`` in torch 2.6)."""
    config = torch._dynamo.config
    return config.recompile_limit if hasattr(config, "recompile_limit") else config.cache_size_limit


def _fused_rotation(xs: tuple, cos: tuple, sin: tuple, interleaved: bool, rotary_dim: int,
                    trailing: bool) -> Optional[tuple]:
    """The rotation of an eager call through ``_compiled_rotation``, or None where it does not serve: a
    device not in ``_FUSED_ROTATION_DEVICES``, a tensor subclass (DTensor), no torch.compile, a compilation that failed
    (warned once), or a new kind of call once ``_FUSED_ROTATION_KINDS`` kinds (half dynamo's recompile
    limit, where the rotation has none of its own) are compiled: that kind runs eagerly instead of
    recompiling (past its limit dynamo would run the formula unfused, with a warning)."""
    if xs[0].device.type not in _FUSED_ROTATION_DEVICES or "error" in _FUSED_ROTATION \
            or any(type(x) is not Tensor for x in xs) or _compiled_rotation() is None:   # no DTensor, no subclass
        return None
    # what dynamo specialises on: dtypes, ranks, sizes of 1, layouts, equal sizes, grad mode and flags
    kind = (interleaved, rotary_dim, trailing, torch.is_grad_enabled(),
            tuple((x.dtype, x.device, x.requires_grad, x.shape[-1], x.is_contiguous(),
                   tuple(size == 1 for size in x.shape[:-1]), x.shape[-2] == xs[0].shape[-2]) for x in xs),
            tuple((c.dim(), c.shape[-2] == 1, c is cos[0], s is sin[0], c.requires_grad, s.requires_grad)
                  for c, s in zip(cos, sin)))
    kinds = _FUSED_ROTATION.setdefault("kinds", set())
    if kind not in kinds:
        limit = _FUSED_ROTATION_KINDS if _FUSED_ROTATION.get("own_limit") else \
            min(_FUSED_ROTATION_KINDS, _recompile_limit() // 2)
        if len(kinds) >= limit:
            return None
        for t in (*xs, *cos, *sin):   # every size but the channels' dynamic from the first compilation
            for dim in range(t.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        kinds.add(kind)
    try:
        return _FUSED_ROTATION["fn"](xs, cos, sin, interleaved, rotary_dim, trailing)
    except torch._dynamo.exc.TorchDynamoException as error:   # no working compiler here: the eager path
        import warnings
        _FUSED_ROTATION["error"] = error
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"positional_embeddings: the compiled rotation failed ({type(error).__name__}: {reason}); "
                      f"rotations run eagerly from now on")
        return None


def _rotate_all(xs: tuple, cos: tuple, sin: tuple, interleaved: bool, rotary_dim: int,
                trailing: bool = False) -> tuple:
    """Rotate the pairs of the first ``rotary_dim`` channels of each x [..., N, Dh] of ``xs`` (the last
    ones with ``trailing``, DeepSeek-V4's; the rest pass) by its cos, sin [..., N, R/2] in the compute
    dtype -> a tuple of tensors in the dtypes of ``xs``; q and k go in one call.

    Three routes compute the same formula: traced code (and torch.func transforms) takes it as
    written, for the user's compiler to fuse; eager calls on CUDA take it compiled once by the library
    (``_fused_rotation``); the other eager calls take the allocation-free function, or the formula
    where the angles are differentiable (learned frequencies or coefficients, float positions).
    """
    if _is_compiling() or _is_exporting() or any(_functorch_wrapped(x) for x in xs):
        return _rotate_formula(xs, cos, sin, interleaved, rotary_dim, trailing)
    fused = _fused_rotation(xs, cos, sin, interleaved, rotary_dim, trailing)
    if fused is not None:
        return fused
    if any(t.requires_grad for t in (*cos, *sin)):   # the eager function has no gradient for the angles
        return _rotate_formula(xs, cos, sin, interleaved, rotary_dim, trailing)
    return _RotateFunction.apply((interleaved, rotary_dim, trailing, False),
                                 *[t for x, c, s in zip(xs, cos, sin) for t in (x, c, s)])


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int, trailing: bool = False) -> Tensor:
    """``_rotate_all`` of one tensor: x [..., N, Dh], cos/sin [..., N, R/2] in the compute dtype -> x's dtype."""
    return _rotate_all((x,), (cos,), (sin,), interleaved, rotary_dim, trailing)[0]


def permute_rotary_weight(weight: Tensor, head_dim: int, *, to: Literal["half_split", "interleaved"],
                          rotary_dim: Optional[int] = None,
                          rotated_channels: Literal["leading", "trailing"] = "leading") -> Tensor:
    """Reorder the rows of a q or k projection between the two RoPE layouts.

    A checkpoint trained with interleaved pairs (Meta's Llama, GPT-J, RoFormer, torchtune)
    runs with ``interleaved=False`` (Hugging Face, GPT-NeoX) after
    ``permute_rotary_weight(w, head_dim, to="half_split")``, and back with ``to="interleaved"``:
    the same permutation of q and k leaves every attention logit unchanged. Works on a
    weight ``[heads * head_dim, in]`` or a bias ``[heads * head_dim]``; with partial rotary
    only the first ``rotary_dim`` rows of each head move (the last ones with
    ``rotated_channels="trailing"``, DeepSeek-V4's layout).

    Example:
        >>> w = torch.randn(8 * 64, 512)
        >>> w_hf = permute_rotary_weight(w, 64, to="half_split")
    """
    owner = "permute_rotary_weight"
    if not isinstance(weight, Tensor):
        raise TypeError(f"{owner}: weight must be a torch.Tensor (wrap a numpy array in torch.from_numpy), "
                        f"got {type(weight).__name__} {_describe(weight)}")
    if weight.dim() not in (1, 2):   # a stacked [L, ...] or [heads, head_dim, in] would move its first dim's rows
        raise ValueError(f"{owner}: weight must be a weight [heads * head_dim, in] or a bias [heads * head_dim], "
                         f"got {_describe(weight)}")
    head_dim = _check_positive_int(owner, "head_dim", head_dim)
    rotary_dim = head_dim if rotary_dim is None else _check_positive_int(owner, "rotary_dim", rotary_dim)
    _check_choice(owner, "to", to, ("half_split", "interleaved"))
    _check_choice(owner, "rotated_channels", rotated_channels, ("leading", "trailing"))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or weight.shape[0] % head_dim:
        raise ValueError(f"{owner}: need an even rotary_dim <= head_dim and rows divisible by head_dim, "
                         f"got rotary_dim={rotary_dim}, head_dim={head_dim}, weight {tuple(weight.shape)}")
    half, rows = rotary_dim // 2, torch.arange(head_dim)
    moved = torch.arange(rotary_dim)
    if to == "half_split":  # new row c*half + j <- old row 2j + c
        moved = 2 * (moved % half) + moved // half
    else:                   # new row 2j + c <- old row c*half + j
        moved = (moved % 2) * half + moved // 2
    first = head_dim - rotary_dim if rotated_channels == "trailing" else 0
    rows[first:first + rotary_dim] = first + moved
    heads = weight.shape[0] // head_dim
    return weight.unflatten(0, (heads, head_dim))[:, rows.to(weight.device)].flatten(0, 1)


def _axis_list(owner: str, name: str, value) -> list:
    """``pair_axes``: a list of position axes (ints >= 0)."""
    return [_as_int(owner, name, axis, minimum=0) for axis in _as_list(owner, name, value)]


def _frequency_list(owner: str, name: str, value) -> list:
    """``frequencies``: finite frequencies >= 0, as a list or a 1-D float tensor (fixed, so without grad)."""
    if isinstance(value, Tensor):
        if value.requires_grad or value.dim() != 1 or not value.is_floating_point():
            raise TypeError(f"{owner}: {name} must be a list or a 1-D float tensor without grad (they are "
                            f"fixed: a learned spectrum is a parameter of your model), got {_describe(value)}")
        value = value.tolist()
    return [_as_float(owner, name, number, minimum=0.0) for number in _as_list(owner, name, value)]


def _check_sections(owner: str, sections: Optional[list], section_layout: str, axis_spectrum: str,
                    pairs: int) -> None:
    """The ``sections`` preset (None: one axis, or ``pair_axes``): sizes summing to the ``pairs`` rotated,
    and the number and sizes its ``section_layout`` and ``axis_spectrum`` need."""
    if sections is not None and sum(sections) != pairs:
        raise ValueError(f"{owner}: sections must be positive and sum to rotary_dim / 2 = "
                         f"{pairs}, got sections={sections}")
    if section_layout != "contiguous" and (sections is None or len(sections) != 3):
        model = "Qwen3-VL" if section_layout == "interleaved" else "ERNIE-4.5-VL, VideoRoPE"
        raise ValueError(f"{owner}: section_layout={section_layout!r} ({model}) needs three sections (t, h, w), "
                         f"got sections={sections}")
    if section_layout == "alternating" and sections[1] - sections[2] not in (0, 1):
        # h takes the even pairs of the first sections[1] + sections[2], w the odd ones
        raise ValueError(f"{owner}: section_layout='alternating' gives h and w every other pair, so sections "
                         f"(t, h, w) need h == w or h == w + 1, got sections={sections}")
    if section_layout == "interleaved" and any(axis + 3 * (sections[axis] - 1) >= pairs for axis in (1, 2)):
        # axis a in (1, 2) takes pairs a, a + 3, ..., a + 3 (sections[a] - 1): all must exist
        raise ValueError(f"{owner}: section_layout='interleaved' gives axis a (1: h, 2: w) the pairs a, a + 3, "
                         f"..., a + 3 * (sections[a] - 1), which must be < rotary_dim / 2 = {pairs}; "
                         f"got sections={sections}")
    if axis_spectrum != "shared" and (sections is None or section_layout != "contiguous"):
        raise ValueError(f"{owner}: axis_spectrum={axis_spectrum!r} needs contiguous sections, "
                         f"got sections={sections}, section_layout={section_layout!r}")
    strides = None if sections is None else [len(range(axis, pairs, len(sections))) for axis in range(len(sections))]
    if axis_spectrum == "strided" and sections != strides:
        raise ValueError(f"{owner}: axis_spectrum='strided' gives axis a every {len(sections)}-th frequency from "
                         f"a, so sections must be {strides}, got sections={sections}")


def _check_scaling_fits(owner: str, params: dict, rotary_dim: int, axis_spectrum: str,
                        frequencies: Optional[list]) -> None:
    """A scaling (normalised ``params``) the layout takes: ``longrope``'s factors one per pair, and no
    scaling of a per-axis, strided or explicit spectrum."""
    for key in ("short_factor", "long_factor"):
        if key in params and len(params[key]) != rotary_dim // 2:
            raise ValueError(f"{owner}: scaling[{key!r}] must have rotary_dim / 2 = "
                             f"{rotary_dim // 2} entries, got {len(params[key])}")
    if (axis_spectrum != "shared" or frequencies is not None) and params["rope_type"] != "default":
        what = "frequencies" if frequencies is not None else f"axis_spectrum={axis_spectrum!r}"
        raise ValueError(f"{owner}: {what} takes no scaling, got rope_type={params['rope_type']!r}")


def _check_rotary_arguments(owner: str, arguments: dict) -> None:
    """RoPE's arguments taken together: an even ``dim`` (or ``head_dim``), then the layout as ``scaling``
    completes it (``partial_rotary_factor``, ``mrope_section``): ``rotary_dim`` within ``dim``, one of
    ``sections`` and ``pair_axes``, one frequency per pair, and a scaling that fits."""
    dim = _one_of(owner, "dim", arguments["dim"], "head_dim", arguments["head_dim"])
    if dim % 2:
        raise ValueError(f"{owner}: dim must be a positive even int, got dim={dim!r}")
    params = _check_scaling(owner, arguments["scaling"], arguments["base"])
    rotary_dim, sections, section_layout = _rotary_layout(owner, dim, arguments["rotary_dim"], params,
                                                          arguments["sections"], arguments["section_layout"])
    pair_axes, axis_spectrum, frequencies = arguments["pair_axes"], arguments["axis_spectrum"], arguments["frequencies"]
    if sections is not None and pair_axes is not None:
        raise ValueError(f"{owner}: pass sections (a preset, or scaling's mrope_section) or pair_axes (any map), "
                         f"not both, got sections={sections} and pair_axes={_describe(pair_axes)}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"{owner}: rotary_dim must be a positive even int <= dim={dim}, "
                         f"got rotary_dim={rotary_dim!r}")
    _check_sections(owner, sections, section_layout, axis_spectrum, rotary_dim // 2)
    if frequencies is not None and len(frequencies) != rotary_dim // 2:
        raise ValueError(f"{owner}: frequencies must give one frequency for each of the rotary_dim / 2 = "
                         f"{rotary_dim // 2} pairs, got {len(frequencies)}")
    if frequencies is not None and axis_spectrum != "shared":
        raise ValueError(f"{owner}: frequencies replace the spectrum, so axis_spectrum must stay 'shared', "
                         f"got axis_spectrum={axis_spectrum!r}")
    if pair_axes is not None and len(pair_axes) != rotary_dim // 2:
        raise ValueError(f"{owner}: pair_axes must give an axis for each of the rotary_dim / 2 = {rotary_dim // 2} "
                         f"pairs, got {len(pair_axes)}")
    unused = [] if pair_axes is None else sorted(set(range(max(pair_axes) + 1)) - set(pair_axes))
    if unused:   # positions would carry a column nothing reads
        raise ValueError(f"{owner}: pair_axes must use every axis 0 .. {max(pair_axes)} (positions have one column "
                         f"per axis), got no pair on axes {unused}")
    _check_scaling_fits(owner, params, rotary_dim, axis_spectrum, frequencies)
    chunk = arguments.get("chunk_size")
    if chunk is not None and (arguments["interleaved"] or chunk % 2 or rotary_dim != dim or dim % chunk):
        raise ValueError(f"{owner}: chunk_size (half-split pairs inside each chunk) needs interleaved=False, an even "
                         f"chunk_size dividing dim and rotary_dim == dim, got chunk_size={chunk}, dim={dim}, "
                         f"rotary_dim={rotary_dim}, interleaved={arguments['interleaved']}")


def _largest_position(positions: Optional[Tensor], n: int, offset: int):
    """The largest position: ``offset + n - 1`` by default, else an int (a tensor while tracing)."""
    if positions is None:
        return offset + n - 1
    top = positions.max()
    if _skip_value_checks(top):
        return top
    return math.ceil(top.item()) if positions.is_floating_point() else int(top)


class _RotaryLayout(_AttentionEncoding):
    """The layouts of ``RotaryPositionalEmbedding`` (its base): which position axis turns each frequency
    pair and which frequency it takes, and the layouts of the tensors it turns.

    One axis is plain RoPE (``pair_axes`` None). With several, pair ``i`` turns with the position on
    axis ``pair_axes[i]``, given or from the ``sections`` preset in its ``section_layout``, at a
    frequency of the scaled spectrum, of ``axis_spectrum``'s per-axis or strided one, or of the
    explicit ``frequencies``; ``_check_rotary_arguments`` checks them. x is ``[..., N, Dh]`` or, with
    ``seq_dim=-3``, ``[..., N, H, Dh]``; ``rerotate`` also takes positions per head.
    """

    chunk_size: Optional[int] = None   # half-split pairs inside chunks of this many channels (None: one chunk)

    def _set_layout(self, params: dict, rotary_dim: Optional[int], sections: Optional[list], section_layout: str,
                    axis_spectrum: str, pair_axes: Optional[list], frequencies: Optional[list],
                    chunk_size: Optional[int] = None) -> None:
        """The layout of the constructor's arguments, as the scaling dict ``params`` completes it."""
        self.rotary_dim, self.sections, self.section_layout = _rotary_layout(
            type(self).__name__, self.dim, rotary_dim, params, sections, section_layout)
        self.axis_spectrum, self.frequencies, self.chunk_size = axis_spectrum, frequencies, chunk_size
        pair_axes = self._axis_of_pair() if pair_axes is None else pair_axes
        self.pair_axes = None if pair_axes is None or max(pair_axes) == 0 else pair_axes   # one axis: plain RoPE
        self.num_axes = 1 if self.pair_axes is None else max(self.pair_axes) + 1

    def _layout_repr(self) -> str:
        """The layout's part of ``extra_repr`` (empty for plain RoPE)."""
        text = ""
        if self.sections is not None:
            text += f", sections={self.sections}"
            text += "" if self.section_layout == "contiguous" else f", section_layout={self.section_layout!r}"
            text += "" if self.axis_spectrum == "shared" else f", axis_spectrum={self.axis_spectrum!r}"
        elif self.pair_axes is not None:
            text += f", pair_axes={self.pair_axes}"
        if self.frequencies is not None:
            text += f", frequencies={self.frequencies}"
        return text if self.chunk_size is None else text + f", chunk_size={self.chunk_size}"

    def _rotate_layout(self, xs: tuple, cos: tuple, sin: tuple) -> tuple:
        """``_rotate_all`` in this layout. With ``chunk_size`` C, pair ``i = c C/2 + j`` is channels
        ``(c C + j, c C + C/2 + j)``: the chunks' first halves gathered ahead of their second halves are
        the plain half-split layout, so each x is reordered to it, turned, and put back (exact copies)."""
        trailing = self.rotated_channels == "trailing"
        if self.chunk_size is None:
            return _rotate_all(xs, cos, sin, self.interleaved, self.rotary_dim, trailing)
        chunks = (self.dim // self.chunk_size, 2, self.chunk_size // 2)
        xs = tuple(x.unflatten(-1, chunks).transpose(-3, -2).flatten(-3) for x in xs)    # [..., K, 2, C/2] -> [..., D]
        turned = _rotate_all(xs, cos, sin, False, self.rotary_dim, trailing)
        return tuple(x.unflatten(-1, chunks[1::-1] + chunks[2:]).transpose(-3, -2).flatten(-3) for x in turned)

    def _check_rotated(self, x: Tensor, seq_dim: int, per_head: bool = False, **positions: Optional[Tensor]):
        """Validate ``forward``'s x (``[..., N, Dh]`` or, with ``seq_dim=-3``, ``[..., N, H, Dh]``) and
        its positions (each as ``forward`` takes them, or with ``per_head`` also ``[B, H, N(, A)]``, returned
        in x's layout); return the positions (one, or a tuple)."""
        owner = type(self).__name__
        if seq_dim not in (-2, -3) or isinstance(seq_dim, bool):
            raise ValueError(f"{owner}: seq_dim must be -2 ([..., N, Dh]) or -3 ([..., N, H, Dh]), got {seq_dim!r}")
        _check_tensor(owner, "x", x, -seq_dim)
        _check_last_dim(owner, "x", x, self.dim)
        self._check_device("x", x)
        checked = tuple(self._head_positions(x, seq_dim, name, p) if per_head and self._per_head(p) else
                        _check_positions(owner, name, p, tuple(x.shape[:seq_dim]), x.shape[seq_dim], self.num_axes,
                                         device=x.device) for name, p in positions.items())
        return checked[0] if len(checked) == 1 else checked

    def _per_head(self, positions) -> bool:
        """Whether ``positions`` are per head: ``[B, H, N]`` (``[B, H, N, A]`` with several axes)."""
        return isinstance(positions, Tensor) and positions.dim() == 3 + (self.num_axes > 1)

    def _head_positions(self, x: Tensor, seq_dim: int, name: str, positions: Tensor) -> Tensor:
        """Per-head positions ``[B, H, N(, A)]`` of a 4-D x, checked as ``forward``'s positions are and laid
        out as x's first three dims (``[B, N, H(, A)]`` for ``seq_dim=-3``)."""
        owner, shape = type(self).__name__, tuple(positions.shape)
        axes = "" if self.num_axes == 1 else f", {self.num_axes}"
        if x.dim() != 4:
            raise ValueError(f"{owner}: per-head {name} ([B, H, N{axes}]) need a 4-D x, got x of shape "
                             f"{tuple(x.shape)}")
        batch, heads, n = x.shape[0], x.shape[seq_dim - 1 if seq_dim == -2 else -2], x.shape[seq_dim]
        if shape[0] not in (batch, 1) or shape[1] not in (heads, 1) or shape[2] != n or \
                shape[3:] != (() if self.num_axes == 1 else (self.num_axes,)):
            raise ValueError(f"{owner}: per-head {name} must have shape [{batch}, {heads}, {n}{axes}] (B or H may "
                             f"be 1) for x of shape {tuple(x.shape)}, got {shape}")
        flat = _check_positions(owner, name, positions.flatten(0, 1), (shape[0] * shape[1],), n, self.num_axes,
                                device=x.device)                                        # [B H, N(, A)]
        flat = flat.unflatten(0, shape[:2])                                             # [B, H, N(, A)]
        return flat if seq_dim == -2 else flat.transpose(1, 2)                          # [B, N, H(, A)]

    def _axis_of_pair(self) -> Optional[list]:
        """The position axis of every frequency pair from the ``sections`` preset (None for one axis):
        contiguous (Qwen2-VL: ``t..t h..h w..w``); Qwen3-VL's interleaved order (``t h w t h w ...``
        while an axis has pairs left, then ``t``); or alternating (ERNIE-4.5-VL, VideoRoPE: ``h w h w
        ...`` over the first ``sections[1] + sections[2]`` pairs, then ``t`` on the slowest)."""
        if self.sections is None:
            return None
        if self.section_layout == "contiguous":
            return [axis for axis, size in enumerate(self.sections) for _ in range(size)]
        if self.section_layout == "alternating":
            spatial = self.sections[1] + self.sections[2]
            return [1 + pair % 2 if pair < spatial else 0 for pair in range(sum(self.sections))]
        axes = [0] * sum(self.sections)
        for axis in (1, 2):
            for pair in range(axis, 3 * self.sections[axis], 3):
                axes[pair] = axis
        return axes

    def _spectrum(self) -> tuple:
        """The construction-time frequencies ``[F]`` (float64) and the attention factor."""
        if self.frequencies is not None:
            return torch.tensor(self.frequencies, dtype=torch.float64), 1.0
        if self.axis_spectrum == "per_axis":
            return torch.cat([_inverse_frequencies(2 * s, self.base) for s in self.sections]), 1.0
        inv_freq, factor = self._scale_fn(self.rotary_dim, self.base, self._scaling, None)
        if self.axis_spectrum == "strided":   # axis a: frequencies a, a + A, a + 2A, ... (Pixtral)
            axes = len(self.sections)
            inv_freq = torch.cat([inv_freq[axis::axes] for axis in range(axes)])
        return inv_freq, factor

    def _pair_angles(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """Every pair's angle at positions ``[..., N(, A)]``: ``[..., N, F]`` float64 (with sections,
        pair i turns with the position on its axis)."""
        if self.pair_axes is None:
            return _angles(positions, inv_freq)
        positions = positions.gather(-1, self.axis_of_pair.expand(*positions.shape[:-1], -1))    # [..., N, F]
        return positions.to(torch.float64) * inv_freq.to(torch.float64)


class RotaryPositionalEmbedding(_RotaryLayout):
    """Rotary position embedding: rotate q and k pairwise by position-proportional angles.

    Su et al., "RoFormer", arXiv:2104.09864. Pair ``i`` of a head is rotated by
    ``p * theta_i`` with ``theta_i = base ** (-2i / rotary_dim)``, so
    ``<f(q, m), f(k, n)>`` depends on ``n - m`` only. Pairs are ``(i, i + R/2)``
    (half-split: Hugging Face, GPT-NeoX; the default) or ``(2i, 2i+1)`` (interleaved:
    RoFormer, GPT-J, Meta's Llama, torchtune); ``permute_rotary_weight`` converts
    checkpoints between the two. With ``rotary_dim < dim`` only the first ``rotary_dim``
    channels rotate (GPT-NeoX ``rotary_pct``, Phi's ``partial_rotary_factor``) and the
    frequencies use ``rotary_dim`` as denominator, as Hugging Face does;
    ``rotated_channels="trailing"`` rotates the last ``rotary_dim`` instead (DeepSeek-V4's
    ``[nope | rope]`` heads).

    ``rotate_values=True`` (DeepSeek-V4, whose keys are its values) turns the values too:
    ``attention()`` rotates v at the key positions and the output back at the query
    positions, so query ``m`` reads ``sum_n w_mn R((n - m) theta) v_n``: a relative position
    in the values as well as in the logits (``encode_v(v, Nq)`` and ``decode_output(out, Nk)``
    are the two steps, for your own attention, positions ``[N]``, ``[B, N]`` or ``[B, 1, N]``).

    ``scaling`` takes a Hugging Face ``rope_parameters`` dict (``linear``, ``dynamic``,
    ``yarn``, ``longrope``, ``llama3``) and gives the same cos/sin, attention factor
    included. Where Hugging Face reads a length from the model config, the dict carries
    ``original_max_position_embeddings`` (and ``max_position_embeddings`` where needed).
    ``dynamic`` and ``longrope`` are driven by the largest position of each call.

    Multi-axis positions (Qwen2-VL's M-RoPE, axial 2-D RoPE for ViTs): pair ``i`` turns with
    the position on its axis, and positions are ``[..., N, A]``. ``pair_axes`` gives any map
    (the axis of each pair) and ``frequencies`` any spectrum; the presets are ``sections``, the
    pairs of each axis in order (``[16, 24, 24]`` for ``(t, h, w)`` with ``dim=128``), laid out
    by ``section_layout``: ``"contiguous"`` (Qwen2-VL, GLM-4V, HunYuan's XD-RoPE),
    ``"interleaved"`` (Qwen3-VL: ``t h w t h w ...``) or ``"alternating"`` (ERNIE-4.5-VL,
    VideoRoPE: ``h w h w ...`` then ``t`` on the slowest pairs). With contiguous sections,
    ``axis_spectrum`` says which frequencies an axis takes: ``"shared"``, consecutive slices of
    one spectrum (Qwen2-VL); ``"per_axis"``, a full spectrum over ``2 * sections[a]`` channels
    each (axial ViT RoPE, EVA-02); ``"strided"``, every ``A``-th frequency from ``a`` (Pixtral).

    Angles come from float64 positions and frequencies, so position 1e6 is as accurate as
    position 1; the rotation runs in float32 (float64 for float64 inputs) and rounds once
    to the input dtype. A float32 cos/sin table serves integer positions and grows on demand.

    Args:
        dim (int): head dim ``Dh`` of the tensors to rotate; also accepted as ``head_dim=`` (the
            keyword every per-head class uses; passing both is a TypeError).
        base (float): frequency base (``rope_theta``). Default: 10000.0.
        interleaved (bool): pair layout, see above. Default: False.
        rotary_dim (int, optional): rotated channels ``R`` (even, ``<= dim``). Default: ``dim``.
        scaling (dict, optional): Hugging Face ``rope_parameters``. Default: None.
        sections (list of int, optional): frequency pairs per position axis, summing to
            ``R / 2``. Default: None (one axis).
        section_layout (str): ``"contiguous"``, ``"interleaved"`` or ``"alternating"`` (the last
            two for three sections ``(t, h, w)``). Default: ``"contiguous"``.
        axis_spectrum (str): ``"shared"``, ``"per_axis"`` or ``"strided"``. Default: ``"shared"``.
        cache_len (int): positions whose cos/sin are tabulated at construction; the table
            grows on demand in eager mode, and under ``torch.compile`` positions past it are
            computed on the fly. Default: 4096.
        rotated_channels (str): ``"leading"`` (the first ``R`` channels) or ``"trailing"`` (the
            last ``R``). Default: ``"leading"``.
        rotate_values (bool): rotate the values in ``attention()`` and the output back (see
            above; ``Dv = Dh``). Default: False.
        pair_axes (list of int, optional): the position axis of each of the ``R / 2`` pairs, instead
            of ``sections``; ``A = max(pair_axes) + 1``. Default: None.
        frequencies (list of float or 1-D tensor, optional): the frequency of each pair, instead of
            ``base ** (-2i / R)`` (no ``scaling`` then). Default: None.
        chunk_size (int, optional): half-split pairs inside each chunk of ``C`` channels: pair ``i`` is
            channels ``(cC + j, cC + C/2 + j)``, ``c, j = divmod(i, C/2)`` (Allegro's per-axis chunks,
            LTX-2's per-head slices of one RoPE over all heads); needs ``interleaved=False`` and
            ``rotary_dim == dim``. Default: None (one chunk: the plain layouts).

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
    arguments = {"rotary_dim": _check_positive_int, "sections": _positive_ints, "pair_axes": _axis_list,
                 "frequencies": _frequency_list, "cache_len": functools.partial(_as_int, minimum=0),
                 "chunk_size": _check_positive_int,
                 "section_layout": functools.partial(_check_choice,
                                                     choices=("contiguous", "interleaved", "alternating")),
                 "axis_spectrum": functools.partial(_check_choice, choices=("shared", "per_axis", "strided")),
                 "rotated_channels": functools.partial(_check_choice, choices=("leading", "trailing")),
                 "rotate_values": _check_flag}
    argument_rules = (_check_rotary_arguments,)
    no_model_type: tuple = ()   # (method, how to build it) for a variant from_config refuses
    fixed_length: Optional[int] = None   # dynamic / longrope frequencies of this length (at_length), else per call
    layer_type: Optional[str] = None   # the config's layer type whose rope parameters it has (from_config)

    def __init__(self, dim: Optional[int] = None, *, base: float = 10000.0, interleaved: bool = False,
                 rotary_dim: Optional[int] = None, scaling: Optional[dict] = None,
                 sections: Optional[list] = None,
                 section_layout: Literal["contiguous", "interleaved", "alternating"] = "contiguous",
                 axis_spectrum: Literal["shared", "per_axis", "strided"] = "shared", cache_len: int = 4096,
                 head_dim: Optional[int] = None, rotated_channels: Literal["leading", "trailing"] = "leading",
                 rotate_values: bool = False, pair_axes: Optional[list] = None,
                 frequencies: Optional[list] = None, chunk_size: Optional[int] = None) -> None:
        super().__init__()
        self.dim, self.base, self.interleaved = dim if head_dim is None else head_dim, float(base), interleaved
        params = _check_scaling(type(self).__name__, scaling, self.base)
        self._set_layout(params, rotary_dim, sections, section_layout, axis_spectrum, pair_axes, frequencies,
                         chunk_size)
        self.rotated_channels, self.rotate_values, self.cache_len = rotated_channels, rotate_values, cache_len
        self._set_scaling(params)

    @classmethod
    def from_config(cls, config, *, layer_type: Optional[str] = None, interleaved: Optional[bool] = None,
                    rotary_dim: Optional[int] = None, sections: Optional[list] = None,
                    section_layout: Optional[Literal["contiguous", "interleaved", "alternating"]] = None
                    ) -> "RotaryPositionalEmbedding":
        """The RoPE of a Hugging Face model config (object or ``to_dict()``), as that model computes it
        (``head_dim``, ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``, partial rotary,
        interleaved layouts, M-RoPE sections); ``layer_type`` picks one of Gemma 3/4's per-layer RoPEs.

        Model types tested against their transformers module are read as they are (the list is in
        docs/model_parity.md); any other one raises a ``ValueError`` unless you state its layout with
        ``interleaved=`` (and ``section_layout=`` when the config has ``mrope_section``). The keywords
        override the config's values; with them you take responsibility for the layout.
        The result keeps ``layer_type`` as its attribute of that name (shown by its repr).
        """
        if cls.no_model_type:   # a variant no Hugging Face model uses (HoPE, VideoRoPE)
            method, build = cls.no_model_type
            raise TypeError(f"{cls.__name__}: no Hugging Face model type uses {method}; build it as "
                            f"{cls.__name__}({build})")
        rope = cls(**_rotary_kwargs_from_config(config, layer_type=layer_type, interleaved=interleaved,
                                                rotary_dim=rotary_dim, sections=sections,
                                                section_layout=section_layout))
        rope.layer_type = layer_type
        return rope

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, rotary_dim={self.rotary_dim}"
        text += "" if self._scaling["rope_type"] == "default" else f", scaling={self._scaling}"
        text += "" if self.fixed_length is None else f", fixed_length={self.fixed_length}"
        text += self._layout_repr()
        text += "" if self.rotated_channels == "leading" else f", rotated_channels={self.rotated_channels!r}"
        text += ", rotate_values=True" if self.rotate_values else ""
        text += "" if self.layer_type is None else f", layer_type={self.layer_type!r}"
        return text

    @property
    def head_dim(self) -> int:
        """The head dim ``Dh`` this rotation is built for (``dim``): q and k must have it."""
        return self.dim

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
        _check_scaling_fits(owner, params, self.rotary_dim, self.axis_spectrum, self.frequencies)
        self._set_scaling(params)

    def _set_scaling(self, params: dict) -> None:
        self._scaling = params
        self._scale_fn = ROPE_SCALING[self._scaling["rope_type"]]
        self._init_buffers(self._buffer_device())

    def _init_buffers(self, device) -> None:
        inv_freq, self.attention_factor = self._spectrum()
        # construction-time frequencies [F] (float64) and their cos and sin for positions
        # 0 .. cache_len - 1, attention factor included: one [2, L, F] float32 tensor, so that
        # growing it swaps cos and sin together (a reader in another thread sees both or neither)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("cos_sin_cached", torch.empty(2, 0, self.rotary_dim // 2, device=device), persistent=False)
        if self.pair_axes is None:
            self._grow_cache(self.cache_len)
        else:  # which position axis drives each pair, [F]
            self.register_buffer("axis_of_pair", torch.tensor(self.pair_axes, device=device), persistent=False)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0,
                seq_dim: Literal[-2, -3] = -2) -> Tensor:
        """Rotate ``x`` (call it for q and for k); default positions ``arange(N) + offset``.

        ``seq_dim=-2``: x is ``[..., N, Dh]`` (SDPA's ``[B, H, N, Dh]``); ``seq_dim=-3``: x is
        ``[..., N, H, Dh]`` (flash-attn, torchtune), rotated in place of its layout, no transpose.
        """
        positions = self._check_rotated(x, seq_dim, positions=positions)
        cos, sin = self.cos_sin(positions, x.shape[seq_dim], offset=offset, device=x.device,
                                dtype=_compute_dtype(x.dtype))
        return self._apply_rotation(x, cos, sin, seq_dim)

    def at_length(self, length: int) -> "RotaryPositionalEmbedding":
        """This RoPE with its ``dynamic`` / ``longrope`` frequencies fixed at those of ``length`` tokens.

        By default those scalings take the frequencies of each call's largest position. Keys cached
        at one decoding step and the queries of a later one then disagree once the sequence crosses
        ``original_max_position_embeddings``, as in Hugging Face (transformers PR #33129: Phi-3's
        output garbles there). Fixed at the longest length the sequence will reach (prompt plus new
        tokens), every call of the returned encoding uses one set of frequencies, so decoding token
        by token with rotated keys equals the full pass at that length. It shares this module's
        buffers. Other scalings have nothing to fix: ``self``.
        """
        length = _check_positive_int(type(self).__name__, "length", length)
        if self._scaling["rope_type"] not in _LENGTH_DEPENDENT:
            return self
        fixed = self._sibling()
        fixed.fixed_length = length
        return fixed

    def rerotate(self, x: Tensor, old_positions: Tensor, new_positions: Tensor, *,
                 seq_dim: Literal[-2, -3] = -2) -> Tensor:
        """Keys rotated at ``old_positions`` turned to ``new_positions``, with no unrotated copy.

        A KV cache that evicts tokens and renumbers the rest (StreamingLLM's attention sinks, Xiao
        et al., arXiv:2309.17453) needs its cached keys at their new positions: ``rope(k, old)``
        becomes ``rope(k, new)``. Each pair turns by ``angle(new) - angle(old)``, taken in float64 from
        the same frequencies ``forward`` uses (sections, scalings; ``dynamic`` / ``longrope`` at each
        set's own largest position, as one call of ``forward`` with those positions would), so the
        result equals ``rope(k, new)`` up to one more rounding in the input dtype; the attention
        factor is already in ``x`` and stays. Positions as ``forward`` takes them (both required),
        or per head, ``[B, H, N]`` (``[B, H, N, A]`` with sections) for a 4-D x (``[B, H, N, Dh]``, or
        ``[B, N, H, Dh]`` with ``seq_dim=-3``): a cache that evicts different tokens in each head
        (NVIDIA's kvpress) moves each head's keys by its own amounts. ``B`` or ``H`` may be 1 (shared);
        ``dynamic`` / ``longrope`` then take one spectrum from the largest position of all heads.
        """
        for name, p in (("old_positions", old_positions), ("new_positions", new_positions)):
            if p is None:
                raise TypeError(f"{type(self).__name__}: rerotate needs {name} (a tensor of positions), got None")
        old, new = self._check_rotated(x, seq_dim, per_head=True, old_positions=old_positions,
                                       new_positions=new_positions)
        n = x.shape[seq_dim]

        def angles(p: Tensor, given: Tensor) -> Tensor:
            angle = self._pair_angles(p, self._frequencies(p, n, 0, None, x.device)[0])  # [..., N(, H), F] float64
            shared = seq_dim == -3 and not self._per_head(given)
            return angle.unsqueeze(-2) if shared else angle                             # [..., N, 1, F]: every head

        turn = angles(new, new_positions) - angles(old, old_positions)                 # [..., N, (H,) F] float64
        dtype = _compute_dtype(x.dtype)
        return self._apply_rotation(x, turn.cos().to(dtype), turn.sin().to(dtype))

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        q_len, k_len, dtype = q.shape[-2], k.shape[-2], _compute_dtype(q.dtype)
        positions_q, positions_k = self._hook_positions(tuple(q.shape[:-2]), q_len, k_len, positions_q, positions_k,
                                                        q.device)
        cos_k, sin_k = self._call_cos_sin("k", q_len, k_len, positions_q, positions_k, k.device, dtype)
        if positions_q is None and positions_k is None and q_len == k_len:
            cos_q, sin_q = cos_k, sin_k
        else:
            cos_q, sin_q = self._call_cos_sin("q", q_len, k_len, positions_q, positions_k, q.device, dtype)
        return self._rotate_layout((q, k), (cos_q, cos_k), (sin_q, sin_k))

    def encode_v(self, v, q_len, positions_q=None, positions_k=None):
        """With ``rotate_values`` (DeepSeek-V4): v ``[..., Nk, Dh]`` rotated at the key positions, as k is."""
        return self._turn_values("v", v, q_len, positions_q, positions_k) if self.rotate_values else v

    def decode_output(self, out, k_len, positions_q=None, positions_k=None):
        """With ``rotate_values``: the output ``[..., Nq, Dh]`` turned back by the query positions, so
        it sums ``R(p_k - p_q) v`` over the keys (the rotated values seen from the query)."""
        return self._turn_values("out", out, k_len, positions_q, positions_k) if self.rotate_values else out

    def _turn_values(self, name: str, x: Tensor, length, positions_q: Optional[Tensor],
                     positions_k: Optional[Tensor]) -> Tensor:
        """``encode_v`` (``name="v"``: v ``[..., Nk, Dh]``, ``length`` = ``q_len``) or ``decode_output``
        (``"out"``: out ``[..., Nq, Dh]``, ``length`` = ``k_len``), checked, then turned."""
        owner, values = type(self).__name__, name == "v"
        _check_tensor(owner, name, x, 2)
        turned = "the values as the keys" if values else "the output back by the query positions"
        _check_last_dim(owner, f"{name} (rotate_values=True turns {turned})", x, self.dim)
        length = _as_int(owner, "q_len" if values else "k_len", length, minimum=0)
        q_len, k_len = (length, x.shape[-2]) if values else (x.shape[-2], length)
        positions_q, positions_k = self._hook_positions(tuple(x.shape[:-2]), q_len, k_len, positions_q, positions_k,
                                                        x.device)
        cos, sin = self._call_cos_sin("k" if values else "q", q_len, k_len, positions_q, positions_k, x.device,
                                      _compute_dtype(x.dtype))
        return self._apply_rotation(x, cos, sin if values else -sin)

    def _call_cos_sin(self, side: str, q_len: int, k_len: int, positions_q, positions_k, device, dtype) -> tuple:
        """cos, sin of one ``attention()`` call's queries (``side="q"``, the last ``Nq`` keys by default) or
        keys (``"k"``). ``dynamic`` / ``longrope``: both sides take the frequencies of the call's largest
        position, so q and k (and v) turn with one spectrum."""
        q_offset = _query_offset(q_len, k_len)
        length = None
        if self._scaling["rope_type"] in _LENGTH_DEPENDENT and self.fixed_length is None:
            tops = (_largest_position(positions_q, q_len, q_offset), _largest_position(positions_k, k_len, 0))
            traced = any(isinstance(top, Tensor) for top in tops)   # no data-dependent Python max while tracing
            length = (torch.maximum(*map(torch.as_tensor, tops)) if traced else max(tops)) + 1
        if side == "q":
            return self.cos_sin(positions_q, q_len, offset=q_offset, device=device, dtype=dtype, length=length)
        return self.cos_sin(positions_k, k_len, offset=0, device=device, dtype=dtype, length=length)

    def cos_sin(self, positions: Optional[Tensor], n: int, *, offset: int = 0, device=None,
                dtype: torch.dtype = torch.float32, length=None) -> tuple:
        """cos and sin of every pair's angle, attention factor included: two ``[..., N, R/2]``.

        ``positions`` as validated by ``forward`` (or None for ``arange(n) + offset``);
        ``length`` (largest position + 1) drives ``dynamic`` / ``longrope``, from ``positions``
        when not given.
        """
        device = self.inv_freq.device if device is None else device
        offset = _as_int(type(self).__name__, "offset", offset, minimum=None)
        inv_freq, factor = self._frequencies(positions, n, offset, length, device)
        positions = None if positions is None else positions.to(device)
        cached = self._from_cache(positions, offset, n, inv_freq, factor, device, dtype)
        if cached is not None:   # default positions: views of the table, no arange
            return cached
        positions = _or_default(type(self).__name__, "positions", positions, n, offset, device, self.num_axes)
        angles = self._pair_angles(positions, inv_freq)                                 # [..., N, F] float64
        return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)

    def _frequencies(self, positions: Optional[Tensor], n: int, offset: int, length, device) -> tuple:
        """``(inv_freq [F], attention factor)`` of a call: the construction-time ones, or for ``dynamic`` /
        ``longrope`` those of ``length`` (default: ``fixed_length``, else the call's largest position + 1)."""
        if self._scaling["rope_type"] not in _LENGTH_DEPENDENT:
            return self.inv_freq, self.attention_factor
        length = self.fixed_length if self.fixed_length is not None else length
        length = _largest_position(positions, n, offset) + 1 if length is None else length
        inv_freq, factor = self._scale_fn(self.rotary_dim, self.base, self._scaling, length)
        return inv_freq.to(device), factor

    def _from_cache(self, positions: Optional[Tensor], offset: int, n: int, inv_freq: Tensor, factor: float,
                    device, dtype) -> Optional[tuple]:
        """cos, sin looked up in the float32 cache, or None when it cannot serve this call.

        The cache holds the construction-time frequencies; it serves integer positions in
        float32 on its own device, growing (eagerly) unless the call would leave it mostly
        unused: one decoding step at position 1e6 computes its angles directly instead.
        """
        compiling = _is_compiling()
        if dtype != torch.float32 or self.pair_axes is not None or self.cos_sin_cached.device != torch.device(device):
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
        # while exporting, only a call that fits the cache at every allowed length reads it
        if not _surely(low >= 0) or (not _surely(high < length) and (compiling or high + 1 > max(4 * count, length))):
            return None
        if high >= length:
            cache = self._grow_cache(max(high + 1, 2 * length))
        if positions is None:  # views, no copy
            return cache[:, offset : offset + n].unbind(0)                              # [N, F] each
        return F.embedding(positions, cache[0]), F.embedding(positions, cache[1])

    def _grow_cache(self, length: int) -> Tensor:
        """Tabulate cos and sin for positions ``0 .. length - 1`` and swap them in as one tensor."""
        # normal tensors even when called under inference_mode, so training can use them later
        with torch.inference_mode(False), torch.no_grad():
            angles = _angles(torch.arange(length, device=self.inv_freq.device), self.inv_freq.clone())   # [L, F]
            cache = torch.stack([angles.cos(), angles.sin()]).mul_(self.attention_factor).float()       # [2, L, F]
        self.cos_sin_cached = cache
        return cache

    def _apply_rotation(self, x: Tensor, cos: Tensor, sin: Tensor, seq_dim: int = -2) -> Tensor:
        if seq_dim == -3:  # [..., N, F] -> [..., N, 1, F]: one angle for every head
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self._rotate_layout((x,), (cos,), (sin,))[0]


class HoPEPositionalEmbedding(RotaryPositionalEmbedding):
    """HoPE: RoPE with only the frequencies that turn within the training length (Chen et al. 2024).

    Chen et al., "HoPE: A Novel Positional Encoding Without Long-Term Decay for Enhanced Context
    Awareness and Extrapolation", arXiv:2410.21216 (ACL 2025; no code published). HoPE replaces
    RoPE's low-frequency components by position-independent ones and keeps the high-frequency
    rotations, so the logits have no long-term decay. The paper gives no formula for the boundary;
    this class makes a pair position-independent (frequency 0, it passes unrotated) when its
    period is longer than the training length, ``theta_i < 2 pi / train_length``: such a pair never
    completes a turn in training, which is the paper's account of why those components learn no
    position. Everything else is RoPE, with its fast path.

    p-RoPE (``RotaryPositionalEmbedding(scaling={"rope_type": "proportional", ...})``) removes a
    fixed fraction of the lowest frequencies instead; the two agree when that fraction is the one
    this rule removes (``removed_pairs / (Dh / 2)``), and differ as soon as the training length or
    the base changes.

    Args:
        dim (int): head dim ``Dh`` (even); also accepted as ``head_dim=``.
        train_length (int): the training length that sets the boundary.
        base (float): RoPE base. Default: 10000.0.
        interleaved (bool): RoPE pairs ``(2i, 2i + 1)``. Default: False (half-split).

    Shape:
        - x: ``[..., N, Dh]``; positions ``[N]`` or ``[B, N]``.

    Example:
        >>> hope = HoPEPositionalEmbedding(64, train_length=512)
        >>> hope.removed_pairs                      # pairs 16 .. 31 pass unrotated
        16
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, hope, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    arguments = {"train_length": _check_positive_int}
    no_model_type = ("HoPE", "head_dim, train_length=...")

    def __init__(self, dim: Optional[int] = None, train_length: int = 4096, *, base: float = 10000.0,
                 interleaved: bool = False, head_dim: Optional[int] = None) -> None:
        self.train_length = train_length    # read by _spectrum, which the base's constructor calls
        super().__init__(dim, base=base, interleaved=interleaved, head_dim=head_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_length={self.train_length}, removed_pairs={self.removed_pairs}"

    @RotaryPositionalEmbedding.scaling.setter
    def scaling(self, value) -> None:
        raise TypeError(f"{type(self).__name__}: HoPE takes no scaling (its spectrum is RoPE's, cut at the "
                        f"training length), got scaling={value!r}")

    def _spectrum(self) -> tuple:
        inv_freq, factor = super()._spectrum()                                           # [F] float64, decreasing
        floor = 2 * math.pi / self.train_length
        self.removed_pairs = sum(self.base ** (-i / self.dim) < floor for i in range(0, self.dim, 2))
        kept = inv_freq.shape[0] - self.removed_pairs                                    # the slowest pass unrotated
        return torch.cat([inv_freq[:kept], torch.zeros_like(inv_freq[kept:])]), factor


def _video_head_dim(owner: str, name: str, value) -> int:
    """VideoRoPE's ``dim`` (or ``head_dim``): a pair each for t, h and w at least, ``Dh >= 6`` (checked before
    the default sections are derived from it, so a small ``Dh`` is not blamed on sections the user never passed)."""
    width = _check_positive_int(owner, name, value)
    if width < 6:
        raise ValueError(f"{owner}: {name} must be at least 6 (a pair each for t, h and w), got {name}={width}")
    return width


class VideoRotaryPositionalEmbedding(RotaryPositionalEmbedding):
    """VideoRoPE: 3-D RoPE for video with the lowest frequencies on time and a diagonal spatial layout.

    Wei et al., "VideoRoPE: What Makes for Good Video Rotary Position Embedding?", ICML 2025,
    arXiv:2502.05173. Tokens carry ``(t, h, w)`` positions ``[N, 3]`` as in M-RoPE, with three changes:

    * **Low-frequency temporal allocation:** time turns the *last* (slowest) ``sections[0]`` pairs;
      the fast pairs before them alternate ``h, w, h, w, ...`` (pair 0 is h). M-RoPE
      (``RotaryPositionalEmbedding(sections=...)``) gives time the *fastest* pairs and h, w
      contiguous slices after it; Qwen3-VL's interleaved sections cycle ``t, h, w`` from pair 0.
    * **Diagonal layout** (``positions``): a visual token's h and w are its time plus its centred row
      and column, so frames lie along the diagonal of text positions.
    * **Adjustable temporal spacing** ``delta``: frame ``f`` sits at ``start + delta * f``.

    Following the reference code (Wiselnn570/VideoRoPE, ``modeling_videorope.py``:
    ``apply_m_modify_multimodal_rotary_pos_emb`` and ``get_t_scale_rope_index``), only
    ``sections[1] + sections[2]`` counts (h takes every other pair from the first, so the split must
    be ``h == w`` or ``h == w + 1``; another is a ValueError, where the reference ignores it), the centring
    offset is ``(H - 1) // 2`` (floor, so an even grid is off centre by half a row), and text after
    a visual block resumes at the temporal row's maximum + 1 (M-RoPE resumes after the maximum of
    all three rows). The reference hard-codes ``delta = 2.0`` in its transformers model; its vLLM
    port defaults to 1.0. Pairs are half-split (``rotate_half``) as in Qwen2-VL, whose base is
    ``1e6`` (this class's default base is RoPE's 10000). Positions are floats for non-integer
    ``delta``; the angles are float64 as in ``RotaryPositionalEmbedding``.

    Args:
        dim (int): head dim ``Dh`` (even); also accepted as ``head_dim=``.
        sections (list of int, optional): pairs for ``(t, h, w)``, summing to ``Dh / 2``.
            Default: ``[Dh/8, 3Dh/16, 3Dh/16]`` rounded (``[16, 24, 24]`` for ``Dh = 128``).
        temporal_spacing (float): ``delta``, used by ``positions``. Default: 2.0.
        base (float): RoPE base. Default: 10000.0.
        interleaved (bool): pairs ``(2i, 2i + 1)``. Default: False (half-split, as the reference).

    Shape:
        - x: ``[..., N, Dh]``; positions ``[N, 3]`` or ``[B, N, 3]``.

    Example:
        >>> video_rope = VideoRotaryPositionalEmbedding(64)
        >>> tthw = video_rope.positions([5, (4, 6, 6), 3])        # 5 text tokens, 4 frames of 6 x 6, 3 text
        >>> tthw.shape
        torch.Size([152, 3])
        >>> q = k = v = torch.randn(1, 8, 152, 64)
        >>> out = attention(q, k, v, video_rope, positions_q=tthw, positions_k=tthw, causal=True)
    """

    arguments = {"temporal_spacing": _positive_float, "dim": _video_head_dim, "head_dim": _video_head_dim}
    no_model_type = ("VideoRoPE", "head_dim, sections=..., temporal_spacing=...")

    def __init__(self, dim: Optional[int] = None, *, sections: Optional[list] = None, temporal_spacing: float = 2.0,
                 base: float = 10000.0, interleaved: bool = False, head_dim: Optional[int] = None) -> None:
        width = dim if dim is not None else head_dim   # checked ints (or None: the base says so)
        if sections is None and width is not None:     # [Dh/8, 3Dh/16, 3Dh/16]: [16, 24, 24] for Dh = 128
            temporal = max(1, width // 8)
            sections = [temporal, (width // 2 - temporal + 1) // 2, (width // 2 - temporal) // 2]
        self.temporal_spacing = temporal_spacing
        super().__init__(dim, base=base, interleaved=interleaved, sections=sections, section_layout="alternating",
                         head_dim=head_dim)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, sections={self.sections}, temporal_spacing={self.temporal_spacing}, "
                f"base={self.base}, interleaved={self.interleaved}")

    def positions(self, segments: Sequence, *, start: float = 0) -> Tensor:
        """The ``(t, h, w)`` positions ``[N, 3]`` (float64) of a sequence of text runs and visual grids.

        ``segments`` lists, in order, ints (a run of that many text tokens, vision start/end tokens
        included) and ``(T, H, W)`` tuples (a video of ``T`` frames, or an image with ``T = 1``, of
        ``H x W`` tokens after any patch merging, in raster order ``frame, row, column``). A text token
        at ``s`` gets ``(s, s, s)``; a visual token of frame ``f``, row ``y``, column ``x`` gets
        ``t = s + delta f``, ``h = t + y - (H - 1) // 2``, ``w = t + x - (W - 1) // 2``; the next
        segment starts at ``s + delta (T - 1) + 1``. Decoding continues as text after the last row's
        ``t``.
        """
        return _diagonal_layout(type(self).__name__, segments, self.temporal_spacing, start)


def _diagonal_layout(owner: str, segments: Sequence, spacing: float, start) -> Tensor:
    """VideoRoPE's positions ``[N, 3]`` (float64) of text runs and ``(T, H, W)`` grids from ``start``."""
    rows, start = [], _as_float(owner, "start", start)
    for segment in _as_list(owner, "segments", segments):
        if isinstance(segment, (tuple, list)):
            frames, height, width = _as_sizes(owner, "segments", segment, 3)
            f, y, x = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
            t = start + spacing * f.flatten().double()                                          # [T H W]
            rows.append(torch.stack([t, t + y.flatten() - (height - 1) // 2, t + x.flatten() - (width - 1) // 2], -1))
            start += spacing * (frames - 1) + 1
        else:
            count = _as_int(owner, "segments", segment, minimum=0)
            rows.append((start + torch.arange(count, dtype=torch.float64)).unsqueeze(-1).expand(-1, 3))
            start += count
    return torch.cat(rows) if rows else torch.empty(0, 3, dtype=torch.float64)                    # [N, 3]


class _MultimodalLayout(NamedTuple):
    """How one model family lays out images and videos in M-RoPE positions (``multimodal_position_ids``)."""

    frames: bool           # a video is T separate (1, h, w) grids, each its own run (timestamps are text)
    resume: str            # after a grid: "spatial" (its start + max(h, w)) or "max" (its largest id + 1)
    time_scale: float      # default tokens per second of video (0: the time index is the frame index)
    image_timed: bool      # an image's time step is the video's tokens per second (Omni), else 1 (its t is 1
                           # in practice)
    seconds_first: bool    # time = (arange(t) * seconds) * scale, else arange(t) * (scale * seconds)
    fractional: bool       # keep fractional time ids (float positions), else floor them
    pad: float             # the value at padded tokens


_MULTIMODAL_LAYOUTS = {
    "qwen2_vl": _MultimodalLayout(False, "spatial", 0.0, False, False, False, 0.0),
    "qwen2_5_vl": _MultimodalLayout(False, "spatial", 4.0, False, False, False, 0.0),
    "qwen3_vl": _MultimodalLayout(True, "spatial", 0.0, False, False, False, 0.0),
    "glm4v": _MultimodalLayout(True, "spatial", 0.0, False, False, False, 0.0),
    "qwen2_5_omni": _MultimodalLayout(False, "max", 25.0, True, True, False, 1.0),
    "qwen3_omni": _MultimodalLayout(False, "max", 25.0, True, True, True, 0.0),
}


# The model types whose config multimodal_position_ids reads (``config=``), by layout: each one's get_rope_index
# is the layout's in transformers 5.24 (the MoE variants' are the same code); an Omni config is read at its thinker.
_MULTIMODAL_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
    "glm4v": "glm4v", "glm4v_moe": "glm4v", "qwen2_5_omni": "qwen2_5_omni", "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni", "qwen3_omni_moe_thinker": "qwen3_omni",
}


def _multimodal_config(owner: str, config, stated: dict) -> dict:
    """``model``, ``spatial_merge_size`` and ``tokens_per_second`` as a VLM config (object or config.json dict)
    sets them for its ``get_rope_index``: the model type, ``vision_config.spatial_merge_size``, Qwen2.5-VL's
    ``vision_config.tokens_per_second`` and the Omni thinker's ``position_id_per_seconds`` (None where the
    config leaves a value out: the model's default). ``stated`` holds the checked keywords (None: not
    given); one that disagrees with the config is a ValueError."""
    _text_config(owner, config)                                       # a config object or dict, else a TypeError
    model_type = str(_config_get(config, "model_type") or "")
    if model_type not in _MULTIMODAL_MODEL_TYPES:
        raise ValueError(f"{owner}: config must be one of {', '.join(sorted(_MULTIMODAL_MODEL_TYPES))} (their "
                         f"get_rope_index is followed), got model_type={model_type!r}")
    model = _MULTIMODAL_MODEL_TYPES[model_type]
    thinker = _config_get(config, "thinker_config", config)          # Omni: the thinker holds vision and timing
    vision = _config_get(thinker, "vision_config")
    if vision is None:
        raise ValueError(f"{owner}: config (model_type={model_type!r}) has no vision_config")
    # Qwen2.5-VL times videos by its vision config's tokens_per_second, the Omni models by the thinker's
    # position_id_per_seconds; the other layouts count frames
    holder, timing = (vision, "vision_config.tokens_per_second") if model == "qwen2_5_vl" else \
        (thinker, "position_id_per_seconds")
    merge = _config_get(vision, "spatial_merge_size")
    tokens = _config_get(holder, timing.split(".")[-1]) if _MULTIMODAL_LAYOUTS[model].time_scale else None
    found = {"model": (model, f"model_type={model_type!r}"),
             "spatial_merge_size": (None if merge is None else _check_positive_int(
                 owner, "config's vision_config.spatial_merge_size", merge), "vision_config.spatial_merge_size"),
             "tokens_per_second": (None if tokens is None else _positive_float(owner, f"config's {timing}", tokens),
                                   timing)}
    merged = {}
    for name, given in stated.items():
        value, where = found[name]
        if given is not None and value is not None and given != value:
            raise ValueError(f"{owner}: {name}={given!r} disagrees with the config's {where} ({value!r}); "
                             f"pass one of them")
        merged[name] = value if given is None else given
    return merged


def _grid_rows(owner: str, name: str, grids: Optional[Tensor]) -> list:
    """``(t, h, w)`` of each row of a ``[M, 3]`` grid tensor (None: no grids)."""
    if grids is None:
        return []
    if not isinstance(grids, Tensor) or grids.dim() != 2 or grids.shape[-1] != 3 or grids.is_floating_point() \
            or grids.is_complex() or grids.dtype == torch.bool or (grids < 1).any():
        raise ValueError(f"{owner}: {name} must be a [M, 3] integer tensor of positive (t, h, w), "
                         f"got {_describe(grids)}")
    return [tuple(row) for row in grids.tolist()]


def _runs(values: Tensor) -> list:
    """``(value, length)`` of each run of equal values in a 1-D tensor."""
    if values.numel() == 0:
        return []
    kinds, lengths = torch.unique_consecutive(values, return_counts=True)
    return list(zip(kinds.tolist(), lengths.tolist()))


def multimodal_position_ids(token_types: Tensor, image_grid_thw: Optional[Tensor] = None,
                            video_grid_thw: Optional[Tensor] = None, *, attention_mask: Optional[Tensor] = None,
                            model: Optional[str] = None, spatial_merge_size: Optional[int] = None,
                            tokens_per_second: Optional[float] = None,
                            video_seconds: Optional[Sequence[float]] = None, config=None) -> tuple:
    """The ``(t, h, w)`` M-RoPE positions of a batch of mixed text, image and video tokens, and its
    ``rope_deltas``, as transformers 5.24's ``get_rope_index`` builds them for ``model``.

    ``token_types`` ``[B, N]`` marks each token: 0 text (vision start/end, timestamps and audio
    included), 1 image, 2 video. That is the processors' ``mm_token_type_ids``; GLM-4V's video
    frames carry the image token id and are 2 only between its video start and end. Each run of
    1s takes the next row of ``image_grid_thw`` and each run of 2s the next video, row-major over
    the batch, as in the models:

    - **Text** continues from the current position on all three axes.
    - **A grid** ``(t, h, w)`` merged to ``(t, h / m, w / m)`` (``m = spatial_merge_size``) gets
      ``(start + time_k, start + y, start + x)``, time-major. ``time_k = floor(k * step)``, where
      ``step`` is 1 for Qwen2-VL, ``tokens_per_second * video_seconds[i]`` for a Qwen2.5-VL video,
      and ``tokens_per_second * video_seconds[i]`` (25 by default) for an Omni video, whose images
      step by ``tokens_per_second``.
    - **Qwen3-VL and GLM-4V** lay out a video as ``t`` separate frames of ``(1, h, w)``, each its own
      run between timestamp text.
    - **After a grid**, text resumes at ``start + max(h / m, w / m)`` (Qwen2/2.5/3-VL, GLM-4V: not
      after the largest time id), or at the grid's largest id + 1 (Omni).
    - **Qwen3-Omni** keeps fractional time ids (float64 positions).

    Padded tokens (``attention_mask == 0``) get 0 (1 for Qwen2.5-Omni) and are skipped.
    ``rope_deltas[b] = max(positions of row b) + 1 - (its real tokens)``: decoding continues at
    ``arange(N, ...) + rope_deltas`` on all three axes, as the models do.

    ``config=`` reads the layout, ``m`` and the tokens per second from the model's own config, so they
    cannot drift from it; a keyword given as well must agree with it (else a ValueError).

    Not covered: the Omni models' audio-in-video interleaving (``use_audio_in_video``). Omni audio
    tokens are text here, which is what the models do without it.

    Args:
        token_types (Tensor): ``[B, N]`` integers in {0, 1, 2}.
        image_grid_thw, video_grid_thw (Tensor, optional): ``[M, 3]`` grids before merging (``h``
            and ``w`` multiples of ``m``).
        attention_mask (Tensor, optional): ``[B, N]``, 1 for real tokens and 0 for padding (left or
            right); any other value (an additive mask's ``-inf``) is a ValueError.
        model (str, optional): ``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"``, ``"glm4v"``,
            ``"qwen2_5_omni"`` or ``"qwen3_omni"``. Default: the config's, else ``"qwen2_vl"``.
        spatial_merge_size (int, optional): ``m``. Default: the config's, else 2 (every model's).
        tokens_per_second (float, optional): Qwen2.5-VL's ``vision_config.tokens_per_second``
            (default 4, its config's; released checkpoints use 2), the Omni models'
            ``position_id_per_seconds`` (default 25). Default: the config's, else those.
        video_seconds (sequence of float, optional): seconds per temporal grid step of each video
            (``second_per_grid_ts``), finite and ``>= 0``. Default: 1.0 each.
        config (optional): the model's Hugging Face config or its config.json dict: Qwen2-VL,
            Qwen2.5-VL, Qwen3-VL (MoE too), GLM-4V (MoE too), Qwen2.5-Omni or Qwen3-Omni (the full
            config or its thinker's). Default: None.

    Returns:
        ``(positions, rope_deltas)``: ``[B, N, 3]`` int64 (float64 for Qwen3-Omni) in this library's
        layout (``positions.permute(2, 0, 1)`` is transformers' ``[3, B, N]``), and ``[B, 1]``.

    Example:
        >>> types = torch.tensor([[0, 0, 1, 1, 1, 1, 0]])          # text, a 1 x 4 x 4 image (2 x 2 merged), text
        >>> positions, deltas = multimodal_position_ids(types, torch.tensor([[1, 4, 4]]))
        >>> positions[0, :, 0].tolist(), deltas.tolist()
        ([0, 1, 2, 2, 2, 2, 4], [[-2]])
    """
    owner = "multimodal_position_ids"
    stated = {"model": None if model is None else _check_choice(owner, "model", model, tuple(_MULTIMODAL_LAYOUTS)),
              "spatial_merge_size": _optional_size(owner, "spatial_merge_size", spatial_merge_size),
              "tokens_per_second": None if tokens_per_second is None else _positive_float(
                  owner, "tokens_per_second", tokens_per_second)}
    if config is not None:
        stated = _multimodal_config(owner, config, stated)
    model, merge, tokens_per_second = stated["model"] or "qwen2_vl", stated["spatial_merge_size"] or 2, \
        stated["tokens_per_second"]
    layout = _MULTIMODAL_LAYOUTS[model]
    for name, value in (("token_types", token_types), ("image_grid_thw", image_grid_thw),
                        ("video_grid_thw", video_grid_thw), ("attention_mask", attention_mask)):
        if isinstance(value, Tensor) and value.is_meta:
            raise ValueError(f"{owner}: {name} must hold values (the positions are built from them), "
                             f"got {_describe(value)} on the meta device")
    if not isinstance(token_types, Tensor) or token_types.dim() != 2 or token_types.is_floating_point() \
            or token_types.is_complex() or token_types.dtype == torch.bool \
            or not ((token_types >= 0) & (token_types <= 2)).all():
        raise ValueError(f"{owner}: token_types must be a [B, N] integer tensor of 0 (text), 1 (image) and "
                         f"2 (video), got {_describe(token_types)}")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.is_complex()
                                       or attention_mask.shape != token_types.shape):
        raise ValueError(f"{owner}: attention_mask must be a tensor of token_types' shape {tuple(token_types.shape)}, "
                         f"got {_describe(attention_mask)}")
    # 1 and 0 only: an additive mask (0 real, -inf padded) would read exactly inverted
    if attention_mask is not None and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError(f"{owner}: attention_mask must hold 1 (real token) and 0 (padding), got the values "
                         f"{attention_mask.unique()[:4].tolist()}")
    real = torch.ones_like(token_types, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    device, token_types, real = token_types.device, token_types.cpu(), real.cpu()   # a Python loop over the runs
    if not layout.time_scale and (tokens_per_second is not None or video_seconds is not None):
        raise ValueError(f"{owner}: model={model!r} has no video timing (a frame's time index is its number); "
                         f"tokens_per_second and video_seconds are for qwen2_5_vl and the Omni models, got "
                         f"tokens_per_second={tokens_per_second!r}, video_seconds={video_seconds!r}")
    images, videos = _grid_rows(owner, "image_grid_thw", image_grid_thw), _grid_rows(owner, "video_grid_thw", video_grid_thw)
    if video_seconds is None:
        seconds = [1.0] * len(videos)
    else:  # a list, or a 1-D tensor / array as the processors give second_per_grid_ts
        listed = _as_list(owner, "video_seconds", video_seconds.tolist() if hasattr(video_seconds, "tolist")
                          else video_seconds)
        seconds = [_non_negative_float(owner, f"video_seconds[{i}]", s) for i, s in enumerate(listed)]
    if len(seconds) != len(videos):
        raise ValueError(f"{owner}: video_seconds must have one entry per video ({len(videos)}), got {len(seconds)}")
    for name, rows in (("image_grid_thw", images), ("video_grid_thw", videos)):
        if any(h % merge or w % merge for _, h, w in rows):   # the vision tower merges m x m patches
            raise ValueError(f"{owner}: {name} must have h and w divisible by spatial_merge_size={merge}, got "
                             f"{[row for row in rows if row[1] % merge or row[2] % merge][:3]}")
    scale = layout.time_scale if tokens_per_second is None else tokens_per_second
    # the time step of each grid, computed in float32 in the models' order of operations
    grids = {1: [(grid, (scale if layout.image_timed else 1.0, 1.0)) for grid in images],
             2: [((1, h, w) if layout.frames else (t, h, w), (scale, s) if scale else (1.0, 1.0))
                 for (t, h, w), s in zip(videos, seconds) for _ in range(t if layout.frames else 1)]}
    queues = {kind: iter(rows) for kind, rows in grids.items()}
    positions = torch.full((*token_types.shape, 3), layout.pad, dtype=torch.float64)
    deltas = []
    for b in range(token_types.shape[0]):
        parts, start = [], 0.0
        for kind, length in _runs(token_types[b][real[b]]):
            if kind == 0:
                parts.append((start + torch.arange(length, dtype=torch.float64)).unsqueeze(-1).expand(-1, 3))
                start += length
                continue
            entry = next(queues[kind], None)
            if entry is None:
                raise ValueError(f"{owner}: row {b} has more runs of {'image' if kind == 1 else 'video'} tokens "
                                 f"than there are grids")
            (t, h, w), (step_scale, step_seconds) = entry
            h, w = h // merge, w // merge
            if t * h * w != length:
                raise ValueError(f"{owner}: a run of {length} {'image' if kind == 1 else 'video'} tokens in row {b} "
                                 f"does not match its grid ({t}, {h * merge}, {w * merge}) -> {t * h * w} tokens")
            k = torch.arange(t, dtype=torch.float32)
            scale32, seconds32 = torch.tensor(step_scale, dtype=torch.float32), torch.tensor(step_seconds)
            time = (k * seconds32 * scale32 if layout.seconds_first else k * (scale32 * seconds32)).double()
            time = time if layout.fractional else time.floor()
            f, y, x = torch.meshgrid(time, torch.arange(h, dtype=torch.float64),
                                     torch.arange(w, dtype=torch.float64), indexing="ij")
            block = torch.stack([f, y, x], -1).reshape(-1, 3) + start                   # [t h w, 3]
            parts.append(block)
            start = start + max(h, w) if layout.resume == "spatial" else block.max().item() + 1
        row = torch.cat(parts) if parts else torch.zeros(0, 3, dtype=torch.float64)
        positions[b, real[b]] = row
        deltas.append(row.max().item() + 1 - row.shape[0] if row.numel() else 0.0)
    leftover = [kind for kind, queue in queues.items() if next(queue, None) is not None]
    if leftover:
        raise ValueError(f"{owner}: more {' and '.join('image' if k == 1 else 'video' for k in leftover)} grids "
                         f"than runs of their tokens in token_types")
    if positions.numel() and not positions.abs().max() <= _LARGEST_POSITION:   # NaN fails too (inf * 0 s)
        raise ValueError(f"{owner}: the video time ids (tokens_per_second x video_seconds x frame) must stay "
                         f"within 2**62 - 1, got a position of {positions.abs().max().item()} with "
                         f"tokens_per_second={scale!r}, video_seconds={seconds[:4]}")
    dtype = torch.float64 if layout.fractional else torch.int64
    return positions.to(device, dtype), torch.tensor(deltas, dtype=dtype, device=device).unsqueeze(-1)


# ---------------------------------------------------------------------------
# Q/K kind: the base (_QKTransform) and its encodings: xPos, algebraic rotations, RoPE-Mixed, LieRE, ComRoPE, STRING
# ---------------------------------------------------------------------------

class _QKTransform(_AttentionEncoding):
    """The ``"qk"`` kind: q and k each transformed by a map of its own position (a rotation, a
    scaled rotation), so that their dot product carries the relative position.

    A subclass writes ``transform(x, positions)``: one tensor ``[..., (H,) N, Dh]`` at validated,
    defaulted positions ``[N(, A)]`` or ``[B, 1.., N(, A)]``; it may override ``transform_qk(q, k,
    pos_q, pos_k)`` where q and k take different maps, or to share work (default positions of
    equal lengths arrive as one tensor, ``pos_q is pos_k``). This base owns ``forward(x, positions,
    *, offset)``, ``encode_qk``, their validation and the default positions (keys
    ``arange(Nk) + offset``, queries the last ``Nq`` of them). RoPE, with its allocation-free
    path and length-dependent scalings, keeps an ``encode_qk`` of its own.
    """

    kind = "qk"

    def transform(self, x: Tensor, positions: Tensor) -> Tensor:
        raise NotImplementedError

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        return self.transform(q, pos_q), self.transform(k, pos_k)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """Transform ``x`` ``[..., H, N, Dh]`` at its positions (call it for q and for k)."""
        _check_tensor(type(self).__name__, "x", x, 3)
        self._check_heads(x, "x")
        positions = _token_positions(self, positions, x, offset)
        if positions.dim() > (1 if self.num_axes == 1 else 2) and x.dim() < 4:
            raise ValueError(f"{type(self).__name__}: [B, N] positions need x of shape [B, ..., H, N, Dh], "
                             f"got x {tuple(x.shape)}")
        return self.transform(x, positions)

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        return self.transform_qk(q, k, *self._qk_positions(q, k, positions_q, positions_k, 0))

    def _qk_positions(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                      offset: int) -> tuple:
        """Validated positions on q's and k's devices, or the defaults (one tensor for both when equal)."""
        positions_q, positions_k = self._hook_positions(tuple(q.shape[:-2]), q.shape[-2], k.shape[-2], positions_q,
                                                        positions_k, q.device)
        return _pair_positions(q.shape[-2], k.shape[-2], positions_q, positions_k, offset, q.device, k.device)

    def _axes(self, positions: Tensor) -> Tensor:
        """Positions with their axis last, ``[..., N, A]`` (one axis gets a trailing 1)."""
        return positions.unsqueeze(-1) if self.num_axes == 1 else positions


class _QKPairTransform(_QKTransform):
    """A ``"qk"`` encoding whose query and key maps differ (xPos's opposite scales, PoPE's key phase):
    a subclass writes ``transform_qk(q, k, pos_q, pos_k)`` alone, and its own call takes both,
    ``forward(q, k, positions_q=None, positions_k=None, *, offset=0) -> (q', k')``, with the
    positions validated and defaulted by this base (keys ``arange(Nk) + offset``, queries the last
    ``Nq`` of them)."""

    def forward(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None, *, offset: int = 0) -> tuple:
        """``(q', k')`` for ``q`` ``[..., Nq, Dh]`` and ``k`` ``[..., Nk, Dh]``."""
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k)
        offset = _as_int(type(self).__name__, "offset", offset, minimum=None)
        return self.transform_qk(q, k, *self._qk_positions(q, k, positions_q, positions_k, offset))


def _xpos_limit(scale_base: float, log_zeta_min: float, dtype: torch.dtype) -> float:
    """Largest ``|p|`` whose xPos scales ``zeta ** (+-p / scale_base)`` are normal numbers in ``dtype``."""
    return scale_base * -math.log(torch.finfo(dtype).tiny) / -log_zeta_min


class XPosPositionalEmbedding(_QKPairTransform):
    """xPos: RoPE with an exponential decay of the logits in the distance (Sun et al. 2022).

    Sun et al., "A Length-Extrapolatable Transformer", arXiv:2212.10554. Pair ``i`` of q at
    position ``p`` is rotated by ``p * theta_i`` (``theta_i = base ** (-2i / dim)``, as RoPE) and
    scaled by ``zeta_i ** (p / scale_base)``; pair ``i`` of k at position ``r`` is rotated by
    ``r * theta_i`` and scaled by ``zeta_i ** (-r / scale_base)``, with
    ``zeta_i = (2i / dim + gamma) / (1 + gamma)`` in ``(0, 1]``. So
    ``<q'_p, k'_r> = sum_i zeta_i ** ((p - r) / scale_base) * <R((r - p) theta_i) q_i, k_i>``
    depends on ``p - r`` only, and decays with it for ``p > r`` (the causal case).

    Conventions: the exponent is exactly ``p / scale_base`` (no centring, so ``q'`` and ``k'``
    are reproducible on their own); q gets the positive exponent, k the negative one;
    the scale of pair ``i`` multiplies both of its channels (``(2i, 2i+1)`` with
    ``interleaved=True``, ``(i, i + dim/2)`` otherwise). torchscale's ``XPOS`` (0.3.0) and
    rotary-embedding-torch's ``use_xpos`` use the same ``zeta``, scale base and signs with
    interleaved pairs, but centre the exponent: torchscale at ``ceil((N + offset) / 2)``,
    rotary-embedding-torch at ``N // 2``. A centring ``c`` multiplies q' by ``zeta ** (-c / scale_base)``
    and k' by ``zeta ** (c / scale_base)``, leaving every logit unchanged.

    Precision and range: angles come from float64 positions (``_angles``) and scales from
    ``exp((p / scale_base) * log(zeta))`` in float64, then both are rounded once to the
    compute dtype (float32; float64 for float64 inputs). Without centring the k scale grows
    as ``zeta_0 ** (-|p| / scale_base)`` with ``zeta_0 = gamma / (1 + gamma)`` (0.2857 for the
    defaults, ``log zeta_0 = -1.2528``), so with ``scale_base=512, gamma=0.4`` one of the two
    scales leaves the normal range of the result dtype from
    ``|p| = scale_base * -log(tiny) / -log(zeta_0)``:

    ========  ===============  ====================  ===================
    dtype     subnormal from   overflow (inf) from   underflow (0) from
    ========  ===============  ====================  ===================
    float32   35,694           36,261                42,494
    bfloat16  35,694           36,259                37,961
    float16   3,966            4,533                 7,083
    float64   289,519          290,086               304,534
    ========  ===============  ====================  ===================

    A call whose positions exceed the first column for the input dtype raises
    ``ValueError`` (eager mode; skipped while tracing) rather than return inf or 0. The
    logits only depend on ``p - r``: to go further, shift q's and k's positions by the same
    constant (as torchscale's centring does), or raise ``scale_base`` / ``gamma``.

    Args:
        dim (int): head dim ``Dh`` (even); also accepted as ``head_dim=`` (passing both is a TypeError).
        base (float): RoPE frequency base. Default: 10000.0.
        scale_base (float): length scale of the decay. Default: 512.0.
        gamma (float): ``zeta`` offset (> 0). Default: 0.4.
        interleaved (bool): pairs ``(2i, 2i+1)`` (torchscale, rotary-embedding-torch) instead
            of ``(i, i + dim/2)``. Default: False.

    Shape:
        - q: ``[..., Nq, Dh]``, k: ``[..., Nk, Dh]``; positions ``[N]`` or ``[B, N]``.
        - Output of ``forward``: ``(q', k')`` of the shapes and dtypes of ``q``, ``k``.

    Example:
        >>> xpos = XPosPositionalEmbedding(64)
        >>> q, k = torch.randn(2, 8, 100, 64), torch.randn(2, 8, 100, 64)
        >>> q2, k2 = xpos(q, k)
        >>> q_next, k_next = xpos(q[..., -1:, :], k[..., -1:, :], offset=100)
    """

    translation_invariant = True
    arguments = {"scale_base": _positive_float, "gamma": _positive_float}

    def __init__(self, dim: Optional[int] = None, *, base: float = 10000.0, scale_base: float = 512.0,
                 gamma: float = 0.4, interleaved: bool = False, head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.dim = _even_int(type(self).__name__, "dim", _one_of(type(self).__name__, "dim", dim, "head_dim", head_dim))
        self.base, self.scale_base, self.gamma, self.interleaved = base, scale_base, gamma, interleaved
        self._init_buffers(None)

    def _init_buffers(self, device) -> None:
        zeta = (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim + self.gamma) \
            / (1 + self.gamma)                                                            # [F]
        self.register_buffer("inv_freq", _inverse_frequencies(self.dim, self.base, device), persistent=False)
        self.register_buffer("log_zeta", zeta.log(), persistent=False)                   # [F] float64

    @property
    def head_dim(self) -> int:
        """The head dim ``Dh`` this encoding is built for (``dim``): q and k must have it."""
        return self.dim

    def limit(self, dtype: torch.dtype = torch.float32) -> float:
        """The largest ``|position|`` accepted for inputs of ``dtype`` (see the table above)."""
        return _xpos_limit(self.scale_base, math.log(self.gamma / (1 + self.gamma)), dtype)

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        self._check_range(q.dtype, pos_q, pos_k)
        dtype = _compute_dtype(q.dtype)
        cos_q, sin_q = self._scaled_cos_sin(pos_q, 1.0, dtype)
        cos_k, sin_k = self._scaled_cos_sin(pos_k, -1.0, dtype)
        return _rotate_all((q, k), (cos_q, cos_k), (sin_q, sin_k), self.interleaved, self.dim)   # RoPE's kernel

    def _scaled_cos_sin(self, positions: Tensor, sign: float, dtype: torch.dtype) -> tuple:
        """The rotation by ``p theta`` scaled by ``zeta ** (sign p / scale_base)``: cos, sin ``[..., N, F]``."""
        angles = _angles(positions, self.inv_freq)                                        # [..., N, F] float64
        scale = torch.exp(positions.to(torch.float64).unsqueeze(-1) * (sign / self.scale_base) * self.log_zeta)
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def _check_range(self, dtype: torch.dtype, pos_q: Tensor, pos_k: Tensor) -> None:
        """ValueError when a scale would leave the normal range of ``dtype`` (eager only)."""
        given = [p for p in (pos_q, pos_k) if p.numel() > 0]
        if any(_skip_value_checks(p) for p in given) or _is_compiling() or not given:
            return
        largest, limit = max(p.abs().max().item() for p in given), self.limit(dtype)
        if largest > limit:
            raise ValueError(
                f"{type(self).__name__}: positions must satisfy |p| <= {limit:.0f} for {dtype} inputs "
                f"(zeta ** (p / scale_base) leaves the normal range beyond), got |p| = {largest:g}; shift q's and "
                f"k's positions by the same constant (logits depend on p - r only) or raise scale_base/gamma")


class QueryTemperaturePositionalEmbedding(_QKPairTransform):
    """A query temperature that grows with the query's position: Llama 4's NoPE layers.

    Each query is multiplied by ``tau(p) = 1 + scale * log(1 + floor((p + shift) / length))`` at
    its position ``p``; keys are unchanged. There is no rotation. The factor is 1 for the first
    ``length - shift`` positions and then grows like a logarithm, which keeps attention sharp over
    long contexts. Llama 4 calls it attention temperature tuning and applies it in its NoPE layers
    (``attn_temperature_tuning``): ``length = floor_scale`` (8192), ``scale = attn_scale`` (0.1),
    ``shift = 1`` (transformers 5.24 ``modeling_llama4.py``). Ministral 3 and Mistral 4 apply the
    same factor with ``shift = 0``, ``length = original_max_position_embeddings`` and
    ``scale = llama_4_scaling_beta``, after their RoPE, which this class does not do.

    Llama 4 takes ``p`` from the cache length plus the query's index, not from ``position_ids``.
    That is this class's default: keys ``arange(Nk) + offset``, queries the last ``Nq`` of them.
    Query positions must be ``>= -shift`` (``p + shift >= 0``; Llama 4's are ``>= 0``): below, the
    floor is negative and ``log(1 + floor(...))`` is ``-inf`` or NaN, so they raise a ``ValueError``
    (checked unless tracing). The factor is computed in float32 (float64 for float64 inputs), then
    q is rounded to its dtype.

    Args:
        length (float): the floor's period (Llama 4's ``floor_scale``). Default: 8192.
        scale (float): the log's weight (Llama 4's ``attn_scale``). Default: 0.1.
        shift (int): added to the position before the floor. Default: 1 (Llama 4's).

    Example:
        >>> temperature = QueryTemperaturePositionalEmbedding(length=4, scale=0.5)
        >>> q = k = torch.ones(1, 1, 8, 2)
        >>> [round(t, 3) for t in temperature(q, k)[0][0, 0, :, 0].tolist()]   # 1 + 0.5 log(1 + floor((p + 1) / 4))
        [1.0, 1.0, 1.0, 1.347, 1.347, 1.347, 1.347, 1.549]
    """

    arguments = {"length": _positive_float, "scale": _non_negative_float,
                 "shift": functools.partial(_as_int, minimum=0)}

    def __init__(self, *, length: float = 8192.0, scale: float = 0.1, shift: int = 1) -> None:
        super().__init__()
        self.length, self.scale, self.shift = length, scale, shift

    def factor(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``tau(p)`` of ``positions`` ``[..., N]`` (finite, ``>= -shift``): ``[..., N]`` in ``dtype``."""
        owner = type(self).__name__
        _check_finite_positions(owner, "positions", positions)
        if not _skip_value_checks(positions) and positions.numel() and positions.min() < -self.shift:
            raise ValueError(f"{owner}: query positions must be >= -shift = {-self.shift} (below, "
                             f"log(1 + floor((p + shift) / length)) is -inf or NaN), got {positions.min().item()}")
        p = positions.to(dtype)
        return 1.0 + self.scale * torch.log1p(torch.floor((p + self.shift) / self.length))

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        tau = self.factor(pos_q, _compute_dtype(q.dtype)).unsqueeze(-1)                 # [..., Nq, 1]
        return (q * tau).to(q.dtype), k


class PolarPositionalEmbedding(_QKPairTransform):
    """PoPE: polar coordinates, the magnitude from content and the phase from position alone.

    Gopalakrishnan et al., "Decoupling the 'What' and 'Where' With Polar Coordinate Positional
    Embeddings", arXiv:2509.10534. Channel ``c`` of q at position ``t`` becomes the complex number
    ``softplus(q_c) e^{i t theta_c}``, channel ``c`` of k at position ``s`` becomes
    ``softplus(k_c) e^{i (s theta_c + delta_c)}``, with one frequency per channel,
    ``theta_c = base ** (-c / Dh)`` for ``c < Dh``, and a learned phase bias ``delta`` per head
    and channel, clamped to ``[-2 pi, 0]``. The logit is the real part of their inner product,

        ``a_ts = scale * sum_c softplus(q_c) softplus(k_c) cos((s - t) theta_c + delta_c)``,

    which depends on ``s - t`` only, and whose phase no content can turn (RoPE's can: the angle
    of a q/k pair adds to the positional one). As real tensors, ``q'`` and ``k'`` are the
    real parts followed by the imaginary parts, ``[..., 2 Dh]`` (x-transformers' layout; the
    paper's pseudocode interleaves them, which gives the same dot products).

    Cost: q' and k' are twice as wide as q and k, so the ``q k^T`` product and the q/k memory
    double; values keep their width. The default logit scale is ``1 / sqrt(Dh)`` of q's own
    width, not of the doubled one (as x-transformers), in ``attention()`` and ``forward_attn``.

    Precision: phases come from float64 positions times float64 frequencies, plus ``delta``;
    softplus and the products run in float32 (float64 for float64 inputs) and round once to
    the input dtype.

    Args:
        head_dim (int): head dim ``Dh`` of q and k.
        num_heads (int): heads ``H`` (one phase bias per head and channel).
        base (float): frequency base. Default: 10000.0.
        phase_bias (bool): learn ``delta``; False fixes ``delta = 0``. Default: True.
        phase_init (str): ``"zeros"`` (x-transformers' default) or ``"uniform"`` in ``[-2 pi, 0]``
            (x-transformers' ``polar_bias_uniform_init``). Default: ``"zeros"``.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]``; positions ``[N]`` or ``[B, N]``.
        - Output of ``forward``: ``(q', k')``, ``[B, H, Nq, 2 Dh]`` and ``[B, H, Nk, 2 Dh]``.

    Example:
        >>> pope = PolarPositionalEmbedding(64, 8)
        >>> q, k, v = torch.randn(2, 8, 100, 64), torch.randn(2, 8, 100, 64), torch.randn(2, 8, 100, 64)
        >>> pope(q, k)[0].shape
        torch.Size([2, 8, 100, 128])
        >>> attention(q, k, v, pope, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    translation_invariant = True
    arguments = {"phase_bias": _check_flag, "phase_init": functools.partial(_check_choice, choices=("zeros", "uniform"))}

    def __init__(self, head_dim: int, num_heads: int, *, base: float = 10000.0, phase_bias: bool = True,
                 phase_init: Literal["zeros", "uniform"] = "zeros") -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.base = head_dim, num_heads, base
        self.phase_bias, self.phase_init = phase_bias, phase_init
        self.delta = nn.Parameter(torch.empty(num_heads, head_dim)) if phase_bias else None    # [H, Dh]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.delta is not None and self.phase_init == "uniform":
            nn.init.uniform_(self.delta, -2 * math.pi, 0.0)
        elif self.delta is not None:
            nn.init.zeros_(self.delta)
        super().reset_parameters()

    def _init_buffers(self, device) -> None:
        exponents = torch.arange(self.head_dim, dtype=torch.float64, device=device) / self.head_dim
        self.register_buffer("inv_freq", self.base ** -exponents, persistent=False)       # theta: [Dh] float64

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        delta = None if self.delta is None else self.delta.clamp(-2 * math.pi, 0.0)
        return self._polar(q, pos_q, None), self._polar(k, pos_k, delta)

    def _polar(self, x: Tensor, positions: Tensor, delta: Optional[Tensor]) -> Tensor:
        """``softplus(x) e^{i phase}`` as ``[real, imaginary]``: ``[..., H, N, Dh] -> [..., H, N, 2 Dh]``."""
        phase = _angles(positions, self.inv_freq)                                       # [..., N, Dh] float64
        if delta is not None:  # positions [N] or [B, 1, N] (a slot for the heads) meet delta [H, 1, Dh]
            phase = phase + delta.to(torch.float64).unsqueeze(-2)                       # [(B,) H, N, Dh]
        dtype = _compute_dtype(x.dtype)
        magnitude = F.softplus(x.to(dtype))
        return torch.cat([magnitude * phase.cos().to(dtype), magnitude * phase.sin().to(dtype)], dim=-1).to(x.dtype)


def _step_eye(num_frequencies: int, num_pairs: int) -> Tensor:
    """FoPE's dominant terms ``[D, P]``: output pair ``i`` keeps frequency ``i * ceil(D / P)`` at weight 1
    (the identity when ``D == P``)."""
    eye = torch.zeros(num_frequencies, num_pairs, dtype=torch.float64)
    step = math.ceil(num_frequencies / num_pairs)
    for pair in range(num_pairs):
        if pair * step < num_frequencies:
            eye[pair * step, pair] = 1.0
    return eye


class FoPEPositionalEmbedding(_QKTransform):
    """FoPE: RoPE with each pair a Fourier series of frequencies, and frequencies too low to train clipped (Hua et al. 2024).

    Hua et al., "Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length
    Generalization", arXiv:2412.17739 (code: TsinghuaC3I/Fourier-Position-Embedding; vLLM's
    ``rotary_embedding/fope.py``). RoPE's frequencies ``w = base^(-2i / Dh)`` whose period exceeds
    the training length (``w < 2 pi / train_length``) are clipped; the ``D`` kept ones feed every
    output pair ``p`` of head ``h`` through two coefficient matrices ``A, B`` ``[H, D, P]``:

        ``C_p(m) = sum_d A[h, d, p] cos(w_d m)``,  ``S_p(m) = sum_d B[h, d, p] sin(w_d m)``,
        ``(x_p, x_{p + Dh/2}) -> (x_p C_p - x_{p + Dh/2} S_p, x_{p + Dh/2} C_p + x_p S_p)``

    (half-split pairs, as both references). The same map acts on q and k. The pairs past ``P``
    hold no frequency: by default they pass through unchanged (``C = 1, S = 0``, the paper's zero
    frequency and today's vLLM); ``padded="ones"`` gives them ``C = S = 1`` as the authors' code
    does, which scales those channels' dot product by 2 at every position.

    ``A`` and ``B`` start as the authors' ``eye_xavier_norm``: Xavier-normal noise of gain
    ``sigma`` plus 1 on each pair's own frequency, and stay fixed unless ``learnable`` (the
    authors' default is fixed). With ``sigma=0`` and nothing clipped FoPE is RoPE. The noise
    makes the logits depend on absolute position a little (the cross terms of different
    frequencies), as in both references.

    The kept frequencies come from ``train_length`` or, as vLLM's ``num_inv_freq`` (Intern-S1-Pro's
    ``rope_scaling``) gives them, from their number: ``num_frequencies=D`` keeps the ``D`` highest,
    ``w_0 .. w_{D-1}``, whatever their periods (pass exactly one of the two).

    Args:
        head_dim (int): ``Dh`` (even).
        num_heads (int): ``H``, one coefficient set per head (vLLM: per key/value head; repeat
            them for the query heads of a group).
        train_length (int, optional): the training length: frequencies below ``2 pi / train_length``
            are clipped. Default: None (then ``num_frequencies`` is required).
        num_frequencies (int, optional): ``D``, the number of frequencies kept (the highest), at most
            ``Dh / 2``: vLLM's ``num_inv_freq``. Default: None (from ``train_length``).
        base (float): RoPE base. Default: 10000.0.
        sigma (float): the noise gain. Default: 0.3 (the authors' 60M model; 0.4 and 0.6 larger).
        num_pairs (int, optional): ``P``, the pairs that get a series. Default: ``D``, every kept
            frequency (vLLM); the authors' code uses ``min(D, Dh // 4)``.
        padded (str): ``"identity"`` (default) or ``"ones"`` (the authors' code) for pairs past ``P``.
        learnable (bool): train ``A`` and ``B``. Default: False.

    Shape:
        - x: ``[..., H, N, Dh]``; positions ``[N]`` or ``[B, N]``.

    Example:
        >>> fope = FoPEPositionalEmbedding(64, 8, train_length=512)
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, fope, causal=True).shape
        torch.Size([2, 8, 100, 64])
        >>> FoPEPositionalEmbedding(64, 8, num_frequencies=12).cos_coef.shape   # vLLM's num_inv_freq=12
        torch.Size([8, 12, 12])
    """

    arguments = {"train_length": _check_positive_int, "sigma": _non_negative_float, "num_pairs": _check_positive_int,
                 "padded": functools.partial(_check_choice, choices=("identity", "ones")), "learnable": _check_flag,
                 "num_frequencies": _check_positive_int}

    def __init__(self, head_dim: int, num_heads: int, train_length: Optional[int] = None, *, base: float = 10000.0,
                 sigma: float = 0.3, num_pairs: Optional[int] = None, padded: Literal["identity", "ones"] = "identity",
                 learnable: bool = False, num_frequencies: Optional[int] = None) -> None:
        super().__init__()
        owner = type(self).__name__
        self.head_dim, self.num_heads = _even_int(owner, "head_dim", head_dim), num_heads
        self.train_length, self.base, self.sigma, self.padded = train_length, base, sigma, padded
        if (train_length is None) == (num_frequencies is None):
            raise TypeError(f"{owner}: pass exactly one of train_length (frequencies below 2 pi / train_length are "
                            f"clipped) and num_frequencies (the number kept, vLLM's num_inv_freq), got "
                            f"train_length={train_length!r} and num_frequencies={num_frequencies!r}")
        if num_frequencies is not None and num_frequencies > head_dim // 2:
            raise ValueError(f"{owner}: num_frequencies must be at most head_dim // 2 = {head_dim // 2}, "
                             f"got num_frequencies={num_frequencies}")
        if num_frequencies is None:
            floor = 2 * math.pi / train_length
            num_frequencies = sum(base ** (-i / head_dim) >= floor for i in range(0, head_dim, 2))   # the highest D
        if num_frequencies == 0:
            raise ValueError(f"{owner}: train_length={train_length} clips every frequency (the highest, 1, has a "
                             f"period of 2 pi); it must be at least 7")
        self.num_frequencies = kept = num_frequencies
        self.num_pairs = kept if num_pairs is None else num_pairs
        if self.num_pairs > head_dim // 2:
            raise ValueError(f"{owner}: num_pairs must be at most head_dim // 2 = {head_dim // 2}, got {num_pairs}")
        shape = (num_heads, kept, self.num_pairs)
        self.cos_coef = nn.Parameter(torch.empty(shape), requires_grad=learnable)      # A: [H, D, P]
        self.sin_coef = nn.Parameter(torch.empty(shape), requires_grad=learnable)      # B: [H, D, P]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        eye = _step_eye(self.num_frequencies, self.num_pairs)
        for coef in (self.sin_coef, self.cos_coef):   # the authors' order; full-size values (FSDP2 shards them)
            noise = nn.init.xavier_normal_(torch.empty(coef.shape, device=coef.device), gain=self.sigma)
            _copy_into(coef, noise + eye.to(noise))
        super().reset_parameters()

    def _init_buffers(self, device) -> None:
        kept = _inverse_frequencies(self.head_dim, self.base, device)[: self.num_frequencies]
        self.register_buffer("inv_freq", kept, persistent=False)                          # [D] float64

    def transform(self, x: Tensor, positions: Tensor) -> Tensor:
        return _rotate(x, *self._cos_sin(positions, _compute_dtype(x.dtype)), False, self.head_dim)

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        dtype = _compute_dtype(q.dtype)
        cos_k, sin_k = self._cos_sin(pos_k, dtype)
        cos_q, sin_q = (cos_k, sin_k) if pos_q is pos_k else self._cos_sin(pos_q, dtype)
        return _rotate_all((q, k), (cos_q, cos_k), (sin_q, sin_k), False, self.head_dim)   # RoPE's kernel

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple:
        """``C`` and ``S`` of every pair at ``positions``: two ``[.., H, N, Dh/2]`` in ``dtype``."""
        angles = _angles(positions, self.inv_freq)                                       # [..., N, D] float64
        cos = torch.matmul(angles.cos(), self.cos_coef.to(torch.float64))                  # [.., H, N, P]
        sin = torch.matmul(angles.sin(), self.sin_coef.to(torch.float64))
        free = self.head_dim // 2 - self.num_pairs
        cos = F.pad(cos, (0, free), value=1.0)                                            # [.., H, N, Dh/2]
        sin = F.pad(sin, (0, free), value=1.0 if self.padded == "ones" else 0.0)
        return cos.to(dtype), sin.to(dtype)


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
    """Validate primitives to load: shape, finite, orthogonality, det +1; return them in float64,
    projected onto the nearest orthogonal matrices.

    The projection ``U V^T`` (from the SVD ``w = U S V^T``) removes a checkpoint's rounding
    (float32: about 1e-7 from orthogonal), which the angles recovered from ``w`` would
    otherwise carry, multiplied by the position, into every score.
    """
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise TypeError(f"{owner}: primitives must be a floating tensor, got "
                        f"{w.dtype if isinstance(w, Tensor) else type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{owner}: primitives must have shape {list(shape)}, got {list(w.shape)}")
    w = w.detach().to(torch.float64)
    if not torch.isfinite(w).all():
        raise ValueError(f"{owner}: primitives must be finite, got {int((~torch.isfinite(w)).sum())} NaN or "
                         f"infinite entries")
    error = (w @ w.mT - torch.eye(shape[-1], dtype=torch.float64, device=w.device)).abs().max().item()
    if error > 1e-4:
        raise ValueError(f"{owner}: every primitive must be orthogonal (W W^T = I), got max |W W^T - I| = {error:.2e}")
    u, _, vh = torch.linalg.svd(w)
    w = u @ vh                                                                          # nearest orthogonal
    if (torch.linalg.det(w) < 0).any():
        raise ValueError(f"{owner}: every primitive must have determinant +1 (a rotation, as matrix_exp(P - P^T) "
                         f"is), got a reflection")
    return w


class _OrthogonalRotation(_QKTransform):
    """Shared machinery of the sequence and grid encodings (Kogkalidis et al.).

    Per axis ``a`` and head ``h`` the primitive is ``W = Q R(theta) Q^T``: a rotation with
    learned frequencies ``theta`` (``frequencies``) in a learned orthonormal basis
    ``Q = matrix_exp(S - S^T)`` (``basis_generator``), which keeps ``W`` exactly orthogonal
    while training and has eigendecomposition-free gradients. Then
    ``W^p = Q R(p theta) Q^T``: applying it costs a change of basis and a rotation, with
    nothing of size ``N x Dh x Dh`` ever built. At initialisation ``Q = I`` and ``theta`` are
    RoPE's frequencies, so the scores equal ``RotaryPositionalEmbedding``'s.
    """

    translation_invariant = True

    def __init__(self, head_dim: int, num_heads: int, num_axes: int, base: float) -> None:
        super().__init__()
        if head_dim % (2 * num_axes):
            raise ValueError(f"{type(self).__name__}: head_dim must be divisible by 2 * num_axes = {2 * num_axes} "
                             f"(each axis rotates pairs), got head_dim={head_dim}")
        self.head_dim, self.num_heads, self.num_axes, self.base = head_dim, num_heads, num_axes, base
        width = head_dim // num_axes
        self.basis_generator = nn.Parameter(torch.empty(num_axes, num_heads, width, width))   # S: [A, H, d, d]
        self.frequencies = nn.Parameter(torch.empty(num_axes, num_heads, width // 2))         # theta: [A, H, d/2]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.basis_generator.zero_()
            width = self.head_dim // self.num_axes
            _copy_into(self.frequencies, _inverse_frequencies(width, self.base))

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
        _copy_into(self.basis_generator, generator)
        _copy_into(self.frequencies, frequencies)

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

    def transform(self, x: Tensor, positions: Tensor) -> Tensor:
        """``W^p x`` for every token (per axis on grids): x [..., H, N, Dh]."""
        return self._transform(x, *self._cos_sin(self._axes(positions), _compute_dtype(x.dtype)), full=True)

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        """``R(p theta) Q^T`` applied to q and k: the same dot products as ``W^p``, one GEMM fewer."""
        dtype = _compute_dtype(q.dtype)
        cos_k, sin_k = self._cos_sin(self._axes(pos_k), dtype)
        cos_q, sin_q = (cos_k, sin_k) if pos_q is pos_k else self._cos_sin(self._axes(pos_q), dtype)
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


class AlgebraicTreePositionalEmbedding(_QKTransform):
    """Algebraic positional encoding of trees (Kogkalidis, Bernardy and Garg, NeurIPS 2024).

    Nodes of a complete ``branching_factor``-ary tree are numbered breadth-first (root 0,
    children of ``n`` are ``b n + 1 ... b n + b``). Branch ``c`` has a learned orthogonal
    primitive ``W_c`` per head (``matrix_exp(G - G^T)`` of ``generators``, as in the
    reference), ``M(root) = I``, ``M(child c of n) = M(n) W_c`` and ``f(x, n) = M(n) x``, so
    ``<f(q, n), f(k, m)> = q^T M(n)^T M(m) k`` depends only on the path between ``n`` and
    ``m``. Each token applies its path's primitives to its own vector, one tree level per
    step (at most ``max_depth`` steps): ``O(B H N Dh)`` memory, no per-node matrices.

    The konstantinosKokos/ape code (``Branching``) builds node maps as ``M(n) @ W_c^T``, so
    its scores are ours with every primitive transposed: load its primitives with
    ``set_primitives(W, convention="reference")``.

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

    integer_positions = True

    arguments = {"branching_factor": _check_positive_int, "max_depth": _check_positive_int}

    def __init__(self, head_dim: int, num_heads: int, branching_factor: int, max_depth: int, *,
                 base: float = 10000.0, init_std: float = 0.02) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"{type(self).__name__}: head_dim must be even, got head_dim={head_dim}")
        self.head_dim, self.num_heads, self.branching_factor, self.max_depth = head_dim, num_heads, branching_factor, max_depth
        self.base, self.init_std = base, init_std
        self.generators = nn.Parameter(torch.empty(branching_factor, num_heads, head_dim, head_dim))  # G: [b, H, Dh, Dh]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            theta = _inverse_frequencies(self.head_dim, self.base, self.generators.device)   # [Dh/2]
            rope = _plane_blocks(torch.zeros_like(theta), theta / 2)                       # G - G^T = J(theta)
            noise = torch.randn(self.generators.shape, dtype=self.generators.dtype, device=self.generators.device)
            _copy_into(self.generators, rope + self.init_std * noise)   # full-size draw: sharding keeps the values

    @property
    def primitives(self) -> Tensor:
        """The current primitives ``W_c``: [b, H, Dh, Dh] (float32 or better)."""
        generators = self.generators.to(_compute_dtype(self.generators.dtype))
        return torch.matrix_exp(generators - generators.mT)

    @torch.no_grad()
    def set_primitives(self, primitives: Tensor, *, convention: Literal["paper", "reference"] = "paper") -> None:
        """Load special orthogonal primitives ``[b, H, Dh, Dh]`` (``ValueError`` otherwise).

        ``convention="paper"``: ``primitives`` are this class's ``W_c`` (``M(child c of n) =
        M(n) W_c``, the paper's ``q (W_{|p_0|}^{sgn p_0} ...) k`` for the path ``p`` from query
        to key). ``convention="reference"``: they are the konstantinosKokos/ape ``Branching``
        primitives (``matrix_exp(P - P^T)``), which that code applies as ``M(n) @ W_c^T``
        (``torch.nn.functional.linear``); they are transposed on loading, so scores equal its
        path products.
        """
        _check_choice(type(self).__name__, "convention", convention, ("paper", "reference"))
        shape = (self.branching_factor, self.num_heads, self.head_dim, self.head_dim)
        w = _check_special_orthogonal(type(self).__name__, primitives, shape)
        if convention == "reference":
            w = w.mT
        logs = torch.stack([_skew_log(matrix) for matrix in w.reshape(-1, *shape[-2:])]).view(shape)
        _copy_into(self.generators, logs / 2)

    def node_ids_from_paths(self, paths: list) -> Tensor:
        """Breadth-first ids of nodes given as root-to-node branch lists (``[]`` is the root)."""
        ids = []
        for path in paths:
            node = 0
            for branch in path:
                try:
                    if isinstance(branch, bool):
                        raise TypeError
                    branch = operator.index(branch)                                 # ints, numpy ints
                except TypeError:
                    raise TypeError(f"{type(self).__name__}: paths must hold integer branch indices, got "
                                    f"{_describe(branch)} in path {path}") from None
                if not 0 <= branch < self.branching_factor:
                    raise ValueError(f"{type(self).__name__}: branch indices must lie in [0, {self.branching_factor}), "
                                     f"got {branch} in path {path}")
                node = self.branching_factor * node + 1 + branch
            ids.append(node)
        return torch.tensor(ids, dtype=torch.long)

    def node_ids_from_parents(self, parents: list) -> Tensor:
        """Breadth-first ids of a tree given as a parent array (``-1`` for the root).

        A node's branch is its rank among its siblings, in the order they appear.
        """
        ids, rank = [None] * len(parents), [0] * len(parents)
        for node in self._topological(parents):
            parent = parents[node]
            if parent < 0:
                ids[node] = 0
                continue
            if rank[parent] >= self.branching_factor:
                raise ValueError(f"{type(self).__name__}: node {parent} has more than "
                                 f"branching_factor={self.branching_factor} children")
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

    def transform(self, x: Tensor, nodes: Tensor) -> Tensor:
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
        if _skip_value_checks(nodes) or nodes.numel() == 0:
            return self.max_depth
        b = self.branching_factor
        last = (b ** (self.max_depth + 1) - 1) // (b - 1) - 1 if b > 1 else self.max_depth   # last node id
        low, high = int(nodes.min()), int(nodes.max())
        if low < 0 or high > last:
            bad = low if low < 0 else high
            raise ValueError(f"{type(self).__name__}: node ids must lie in [0, {last}] "
                             f"(depth <= max_depth={self.max_depth} of a {b}-ary tree), got {bad}")
        depth, first = 0, 1  # first id of level depth + 1
        while high >= first:
            depth, first = depth + 1, first * b + 1
        return depth


def rope_coordinates(grid_shape, *, normalize: Literal["separate", "max", "min"] = "separate",
                     shift: Optional[float] = None, jitter: Optional[float] = None,
                     rescale: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     device=None) -> Tensor:
    """Normalised patch-centre coordinates of a grid, with DINOv3's train-time augmentations.

    The semantics of ``RopePositionEmbedding`` in DINOv3 (Simeoni et al. 2025,
    arXiv:2508.10104), for any number of axes: patch ``i`` of an axis of ``S`` patches is
    at ``2 (i + 0.5) / S' - 1`` with ``S' = S`` (``"separate"``: every axis spans
    ``[-1, 1]``), the largest size (``"max"``: the longest axis spans ``[-1, 1]``, the others
    less) or the smallest (``"min"``: the shortest spans ``[-1, 1]``, the others more). Then,
    in this order and only when given (DINOv3 applies them while training):

    * ``shift``: add ``U(-shift, shift)``, one draw per axis;
    * ``jitter``: multiply by ``exp(U(-log jitter, log jitter))``, one draw per axis;
    * ``rescale``: multiply by ``exp(U(-log rescale, log rescale))``, one draw for all axes.

    Draws are float32 from ``generator`` (the global one by default), as DINOv3 draws them,
    so the same RNG state gives DINOv3's factors. Feed the result to any multi-axis rotary
    class (``MixedRotaryPositionalEmbedding``, ``RotaryPositionalEmbedding(sections=...)``,
    ``LieREPositionalEmbedding``): their angles are linear in these float positions. With
    DINOv3's periods ``base ** (2i / (Dh/2))`` the equivalent rotary frequencies are
    ``2 pi / period``.

    Args:
        grid_shape (tuple of int): patches per axis, e.g. ``(h, w)`` or ``(t, h, w)``.
        normalize (str): ``"separate"``, ``"max"`` or ``"min"``. Default: ``"separate"``.
        shift (float, optional): shift amplitude. Default: None.
        jitter (float, optional): per-axis scale bound (``> 1`` to do anything). Default: None.
        rescale (float, optional): global scale bound. Default: None.
        generator (torch.Generator, optional): source of the draws. Default: None.
        device: device of the result. Default: CPU.

    Returns:
        float64 ``[N, A]`` coordinates, ``N = prod(grid_shape)`` in row-major order (the last
        axis fastest), axes in ``grid_shape`` order.

    Example:
        >>> coords = rope_coordinates((14, 14), jitter=1.3)       # [196, 2]
    """
    owner = "rope_coordinates"
    sizes, device = _as_sizes(owner, "grid_shape", grid_shape), _as_device(owner, "device", device)
    _check_choice(owner, "normalize", normalize, ("separate", "max", "min"))
    count = len(sizes)
    spans = {"separate": sizes, "max": (max(sizes),) * count, "min": (min(sizes),) * count}[normalize]
    axes = [(torch.arange(size, dtype=torch.float64) + 0.5) / span for size, span in zip(sizes, spans)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, count) * 2 - 1   # [N, A]
    try:
        coords = augment_positions(coords, num_axes=count, shift=shift, jitter=jitter, rescale=rescale,
                                   generator=generator)
    except (TypeError, ValueError) as error:   # the same argument checks, named for this function
        raise type(error)(str(error).replace("augment_positions: ", owner + ": ", 1)) from None
    return coords.to(device)


def augment_positions(positions: Tensor, *, num_axes: int = 1, shift: Optional[float] = None,
                      local_shift: Optional[float] = None, jitter: Optional[float] = None,
                      rescale: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Train-time augmentations of positions: CAPE's and DINOv3's, ``lambda * j * (p + delta + eps)``.

    CAPE (Likhomanenko et al., "CAPE: Encoding Relative Positions with Continuous Augmented
    Positional Embeddings", arXiv:2106.03143) trains on positions moved at random, so that
    absolute encodings (sinusoidal, a rotary's angles) learn what stays true under the move:
    relative positions. DINOv3 (arXiv:2508.10104) does the same to RoPE's patch coordinates.
    In this order, each only when given:

    * ``shift``: add ``delta ~ U(-shift, shift)``, one draw per sequence and axis (CAPE's and
      DINOv3's global shift);
    * ``local_shift``: add ``eps ~ U(-local_shift, local_shift)``, one draw per position and axis
      (CAPE's local shift; ``local_shift < spacing / 2`` keeps the order);
    * ``jitter``: multiply by ``exp(U(-log jitter, log jitter))``, one draw per sequence and axis
      (DINOv3);
    * ``rescale``: multiply by ``lambda = exp(U(-log rescale, log rescale))``, one draw per
      sequence (CAPE's global scaling, DINOv3's rescale).

    A sequence is a row of ``positions``' leading dims: ``[B, N]`` gets ``B`` independent draws.
    Draws are float32 from ``generator`` (the global one by default) in the order above, as
    DINOv3 draws them. Augment in training only: in eval the positions are used as they are
    (CAPE's and DINOv3's rule). Positions must be finite. The PyTorch port of CAPE (gcambara/cape) draws
    its local shift from ``U(-m s, m s)`` (``m`` its ``max_local_shift``, ``s`` the spacing of the
    positions): pass ``local_shift = m s`` (its ``m = 0.5`` on integer positions is ``local_shift = 0.5``).
    The result feeds any encoding that takes float positions (sinusoidal, RoPE, RoPE-Mixed,
    LieRE, the Fourier features).

    Args:
        positions (Tensor): ``[..., N]`` (one axis) or ``[..., N, A]`` (``num_axes = A > 1``), real.
        num_axes (int): position axes ``A``. Default: 1.
        shift, local_shift (float, optional): shift bounds, ``>= 0``. Default: None.
        jitter, rescale (float, optional): scale bounds, ``>= 1``. Default: None.
        generator (torch.Generator, optional): source of the draws. Default: None.

    Returns:
        float64 positions of the same shape.

    Example:
        >>> positions = augment_positions(torch.arange(100.0).expand(8, 100), shift=5.0, local_shift=0.5,
        ...                               rescale=1.03)                  # CAPE for text: [8, 100]
    """
    owner = "augment_positions"
    num_axes = _check_positive_int(owner, "num_axes", num_axes)
    shift, local_shift, jitter, rescale = (
        None if value is None else _as_float(owner, name, value, minimum=low) for name, value, low in
        (("shift", shift, 0.0), ("local_shift", local_shift, 0.0), ("jitter", jitter, 1.0), ("rescale", rescale, 1.0)))
    for name, value in (("shift", shift), ("local_shift", local_shift)):
        if value is not None and value > _FLOAT32_MAX:   # the draws are float32
            raise ValueError(f"{owner}: {name} must be at most float32's largest {_FLOAT32_MAX:.7g} (the draws are "
                             f"float32), got {name}={value!r}")
    _check_generator(owner, generator)
    _check_tensor(owner, "positions", positions, 1 if num_axes == 1 else 2)
    if num_axes > 1 and positions.shape[-1] != num_axes:
        raise ValueError(f"{owner}: positions must be [..., N, A={num_axes}], got {tuple(positions.shape)}")
    _check_finite_positions(owner, "positions", positions)
    p = positions.to(torch.float64) if num_axes > 1 else positions.to(torch.float64).unsqueeze(-1)   # [..., N, A]
    rows, axes = p.shape[:-2], p.shape[-1]

    def draw(shape, bound):  # U(-bound, bound), float32 as DINOv3 draws, then float64
        return torch.empty(shape).uniform_(-bound, bound, generator=generator).double().to(p.device)

    if shift is not None:
        p = p + draw((*rows, 1, axes), shift)
    if local_shift is not None:
        p = p + draw(p.shape, local_shift)
    if jitter is not None:
        p = p * draw((*rows, 1, axes), math.log(jitter)).exp()
    if rescale is not None:
        p = p * draw((*rows, 1, 1), math.log(rescale)).exp()
    return p if num_axes > 1 else p.squeeze(-1)


class _TokenRotation(_QKTransform):
    """q and k each rotated by a per-head orthogonal map of their own (multi-axis) position.

    Subclasses define ``_rotate_tokens(x, positions)`` with x ``[..., H, N, Dh]`` and positions
    ``[N, A]`` or ``[B, 1, ..., 1, N, A]`` (the validated, broadcastable form); ``encode_qk``
    may be overridden to share work between q and k (``_rotate_both``).
    """

    def transform(self, x: Tensor, positions: Tensor) -> Tensor:
        return self._rotate_tokens(x, self._axes(positions))

    def transform_qk(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor) -> tuple:
        axes_k = self._axes(pos_k)
        return self._rotate_both(q, axes_k if pos_q is pos_k else self._axes(pos_q), k, axes_k)

    def _rotate_both(self, q: Tensor, positions_q: Tensor, k: Tensor, positions_k: Tensor) -> tuple:
        return self._rotate_tokens(q, positions_q), self._rotate_tokens(k, positions_k)

    @staticmethod
    def _token_axes(positions: Tensor) -> Tensor:
        """[N, A] -> [N, A]; [B, 1, ..., 1, N, A] (head slot at -3) -> [B, 1, ..., N, A] without the head slot."""
        return positions if positions.dim() == 2 else positions.squeeze(-3)


def _mixed_frequencies(head_dim: int, num_heads: int, num_axes: int, base: float) -> Tensor:
    """RoPE-Mixed's initial frequencies ``[A, H, F]`` (float64, drawn on the CPU): magnitudes
    ``base ** (-2A i / Dh)`` along a random frame per head (rope-vit's ``init_random_2d_freqs`` for
    two axes: an angle ``phi_h``, then ``phi_h + pi/2``; a QR-orthonormal frame for other counts).
    Each frame vector takes ``ceil(F / A)`` pairs; where ``A`` does not divide ``F`` (Mochi: 64 pairs,
    3 axes) the last vector takes the pairs left."""
    pairs = head_dim // 2
    per_vector = -(-pairs // num_axes)
    magnitude = base ** -(torch.arange(per_vector, dtype=torch.float64, device="cpu") * 2 * num_axes / head_dim)  # [F/A]
    if num_axes == 2:
        phi = torch.rand(num_heads, device="cpu").double() * 2 * math.pi                          # [H]
        frame = torch.stack([torch.stack([phi.cos(), (phi + math.pi / 2).cos()], -1),
                             torch.stack([phi.sin(), (phi + math.pi / 2).sin()], -1)])           # [A, H, A]
    else:
        frame = torch.linalg.qr(torch.randn(num_heads, num_axes, num_axes, dtype=torch.float64, device="cpu"))[0]
        frame = frame.permute(1, 0, 2)                                                             # [A, H, A]
    return (frame.unsqueeze(-1) * magnitude).flatten(-2)[..., :pairs]                            # [A, H, F]


def _mixed_angles(positions: Tensor, freqs: Tensor) -> Tensor:
    """``sum_a p_a freqs[a, h, f]`` in float64: positions [..., N, A], freqs [A, H, F] -> [..., H, N, F]."""
    positions = positions.to(torch.float64)
    if positions.dim() == 2:
        positions = positions.unsqueeze(0)                                                     # [1, N, A]
    return torch.matmul(positions, freqs.to(torch.float64).transpose(0, 1))                    # [..., H, N, F]


def _rotate_mixed(x: Tensor, angles: Tensor) -> Tensor:
    """x [..., H, N, Dh] with pairs (2f, 2f + 1) turned by angles [..., H, N, F] (float64)."""
    dtype = _compute_dtype(x.dtype)
    return _rotate(x, angles.cos().to(dtype), angles.sin().to(dtype), True, x.shape[-1])


class MixedRotaryPositionalEmbedding(_TokenRotation):
    """RoPE-Mixed: rotary embedding with learned frequencies that mix the position axes.

    Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024,
    arXiv:2403.13298. Pair ``f`` of head ``h`` turns by the angle
    ``sum_a p_a * freqs[a, h, f]``, so every pair rotates along its own learned direction of
    the grid (diagonals included) and ``<f(q, p), f(k, r)>`` depends on ``r - p`` only.
    Pairs are interleaved ``(2f, 2f + 1)`` as in the reference (``view_as_complex``).

    Initialisation is the reference's ``init_random_2d_freqs``: magnitudes
    ``base ** (-4i / Dh)`` for ``i < Dh/4``, the first ``Dh/4`` pairs along a random angle
    ``phi_h`` per head and the last ``Dh/4`` along ``phi_h + pi/2`` (one ``torch.rand`` per head,
    in head order, so the same seed gives the same values). For ``A != 2`` axes (video) the
    same idea: a random orthonormal frame per head (QR of a Gaussian), ``Dh / (2A)`` pairs per
    frame vector with magnitudes ``base ** (-2A i / Dh)``.

    Loading weights: naver-ai/rope-vit keeps every layer's frequencies in one parameter
    ``freqs`` of shape ``[2, depth, H * Dh/2]`` (``[2, H, Dh/2]`` per block in
    ``self-attn/rope_self_attn.py``); for layer ``l``,
    ``pe.freqs.copy_(ref.freqs[:, l].view(2, H, Dh // 2))``. timm's ``RotaryEmbeddingMixed``
    stores ``freqs`` ``[2, depth, H, Dh/2]``: ``pe.freqs.copy_(timm.freqs[:, l])``. Axis 0 is
    ``x`` (the column), axis 1 ``y`` (the row), so positions are ``(col, row)`` pairs
    (``torch.meshgrid(..., indexing="xy")``). Both references leave the ``[CLS]`` token
    unrotated: give it position ``(0, 0)`` (angle 0 is the identity). The references use
    ``base=10`` for RoPE-Mixed (100 for RoPE-Axial); this class's default is 100.

    Angles are summed in float64 from float64 positions; the rotation runs in float32
    (float64 for float64 inputs). Cost: ``O(B H N Dh)`` like RoPE, plus ``O(N H Dh A)`` angles.

    Args:
        head_dim (int): head dim ``Dh``, even (``A`` need not divide the ``Dh / 2`` pairs: Mochi's 128
            with 3 axes), with a pair left for the last frame vector (not 8 with 3 axes: 2, 2, 0 pairs).
        num_heads (int): heads ``H``.
        num_axes (int): position axes ``A``. Default: 2.
        base (float): base of the initial magnitudes. Default: 100.0.

    Shape:
        - x: ``[..., H, N, Dh]``; positions ``[N, A]`` or ``[B, N, A]``, integer or float
          (``[N]``, ``[B, N]`` for one axis, default ``arange(N) + offset``);
          ``freqs``: ``[A, H, Dh/2]``.

    Example:
        >>> rope = MixedRotaryPositionalEmbedding(64, 8, base=10.0)
        >>> xy = torch.stack(torch.meshgrid(torch.arange(14), torch.arange(14), indexing="xy"), -1).reshape(196, 2)
        >>> q = k = v = torch.randn(2, 8, 196, 64)
        >>> out = attention(q, k, v, rope, positions_q=xy, positions_k=xy)
    """

    translation_invariant = True

    def __init__(self, head_dim: int, num_heads: int, num_axes: int = 2, *, base: float = 100.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"{type(self).__name__}: head_dim must be even (pairs of channels turn), "
                             f"got head_dim={head_dim}")
        pairs, per_vector = head_dim // 2, -(-(head_dim // 2) // num_axes)
        if (num_axes - 1) * per_vector >= pairs:   # the last frame vector would get no pair: a direction unencoded
            counts = [max(0, min(per_vector, pairs - a * per_vector)) for a in range(num_axes)]
            raise ValueError(f"{type(self).__name__}: head_dim must leave each of the num_axes frame vectors a pair "
                             f"(each takes ceil(Dh/2 / num_axes) pairs, the last the rest), got head_dim={head_dim} "
                             f"for num_axes={num_axes}: {pairs} pairs as {counts}")
        self.head_dim, self.num_heads, self.num_axes, self.base = head_dim, num_heads, num_axes, base
        self.freqs = nn.Parameter(torch.empty(self.num_axes, self.num_heads, self.head_dim // 2))   # [A, H, F]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if not self.freqs.is_meta:   # no storage to fill (and no draw from the global generator)
            _copy_into(self.freqs, _mixed_frequencies(self.head_dim, self.num_heads, self.num_axes, self.base))

    @classmethod
    def from_config(cls, config) -> "MixedRotaryPositionalEmbedding":
        """Mochi's learned mixed frequencies from its diffusers config (``_class_name``
        ``MochiTransformer3DModel``): copy its ``pos_frequencies`` ``[3, H, Dh/2]`` into ``freqs``;
        ``diffusers_positions`` gives its ``(t, h, w)`` positions."""
        return cls(**_diffusers_kwargs("MixedRotaryPositionalEmbedding", config, {}))

    def angles(self, positions: Tensor) -> Tensor:
        """``sum_a p_a freqs[a, h, f]`` in float64: positions [..., N, A] -> [..., H, N, F]."""
        return _mixed_angles(positions, self.freqs)

    def _rotate_tokens(self, x: Tensor, positions: Tensor) -> Tensor:
        return _rotate_mixed(x, self.angles(positions))


class _BlockRotation(_TokenRotation):
    """q and k each turned by ``exp(sum_a p_a A_a)``, the generators ``A_a`` block diagonal with
    ``Dh // g`` skew-symmetric ``g x g`` blocks (channels past ``g * (Dh // g)`` pass unrotated).

    A subclass defines the ``generators`` property, ``[A, H, Dh/g, g, g]`` float64, and calls
    ``_set_blocks(head_dim, num_heads, num_axes, block_size)``. This base exponentiates them once per
    *distinct* position of a call (``matrix_exp`` in float64; q, k and batch pooled) and applies the
    blocks, ``O(B H N Dh g)``. Under ``torch.compile``, and for positions that require grad, every
    token is exponentiated (``torch.unique`` has a data-dependent size and no backward).
    """

    def _set_blocks(self, head_dim: int, num_heads: int, num_axes: int, block_size: Optional[int]) -> None:
        self.head_dim, self.num_heads, self.num_axes = head_dim, num_heads, num_axes
        block = head_dim if block_size is None else block_size
        if not 2 <= block <= head_dim:
            raise ValueError(f"{type(self).__name__}: block_size must be an int in [2, head_dim={self.head_dim}], "
                             f"got block_size={block_size!r}")
        self.block_size, self.num_blocks = block, self.head_dim // block

    @property
    def generators(self) -> Tensor:
        raise NotImplementedError

    def rotations(self, positions: Tensor) -> Tensor:
        """``exp(sum_a p_a A_a)`` for positions [M, A]: [M, H, Dh/g, g, g] (float64), one
        ``matrix_exp`` per distinct position (eager)."""
        positions = positions.to(torch.float64)
        inverse = None
        if not _is_compiling() and not positions.requires_grad and positions.shape[0] > 1:
            positions, inverse = torch.unique(positions, dim=0, return_inverse=True)           # [U, A]
        generator = torch.tensordot(positions, self.generators, dims=([1], [0]))               # [U, H, Dh/g, g, g]
        rotation = torch.matrix_exp(generator)
        return rotation if inverse is None else rotation[inverse]                               # [M, H, Dh/g, g, g]

    def _rotate_both(self, q, positions_q, k, positions_k):
        tokens_q, tokens_k = self._token_axes(positions_q), self._token_axes(positions_k)
        if positions_q is positions_k:
            rotation = self._token_rotations(tokens_k)
            return self._apply_rotation(q, rotation), self._apply_rotation(k, rotation)
        flat_q, flat_k = tokens_q.reshape(-1, self.num_axes), tokens_k.reshape(-1, self.num_axes)
        both = self.rotations(torch.cat([flat_q.to(torch.float64), flat_k.to(torch.float64)]))
        rotation_q = self._unflatten(both[: flat_q.shape[0]], tokens_q)
        rotation_k = self._unflatten(both[flat_q.shape[0]:], tokens_k)
        return self._apply_rotation(q, rotation_q), self._apply_rotation(k, rotation_k)

    def _rotate_tokens(self, x: Tensor, positions: Tensor) -> Tensor:
        return self._apply_rotation(x, self._token_rotations(self._token_axes(positions)))

    def _token_rotations(self, tokens: Tensor) -> Tensor:
        """tokens [..., N, A] -> rotations [..., H, N, Dh/g, g, g]."""
        return self._unflatten(self.rotations(tokens.reshape(-1, self.num_axes)), tokens)

    def _unflatten(self, rotation: Tensor, tokens: Tensor) -> Tensor:
        rotation = rotation.reshape(*tokens.shape[:-1], *rotation.shape[1:])                  # [..., N, H, Dh/g, g, g]
        return rotation.movedim(-4, -5)                                                         # [..., H, N, Dh/g, g, g]

    def _apply_rotation(self, x: Tensor, rotation: Tensor) -> Tensor:
        """``R x`` per block: x [..., H, N, Dh], rotation [..., H, N, Dh/g, g, g] -> [..., H, N, Dh]."""
        dtype = _compute_dtype(x.dtype)
        width = self.num_blocks * self.block_size
        blocks = x[..., :width].to(dtype).unflatten(-1, (self.num_blocks, self.block_size))      # [..., H, N, Dh/g, g]
        rotated = torch.matmul(rotation.to(dtype), blocks.unsqueeze(-1)).squeeze(-1).flatten(-2)   # [..., H, N, width]
        if width < x.shape[-1]:
            rotated = torch.cat([rotated, x[..., width:].to(dtype).expand(*rotated.shape[:-1], -1)], dim=-1)
        return rotated.to(x.dtype)


class LieREPositionalEmbedding(_BlockRotation):
    """LieRE: rotations ``R(p) = exp(sum_a p_a A_a)`` with learned skew-symmetric generators.

    Ostmeier et al., "LieRE: Lie Rotational Positional Encodings", arXiv:2406.10322. Each
    head has one generator per axis; a token at position ``p`` (``A`` coordinates, float
    allowed) is mapped to ``R(p) x`` and the logit is ``q^T R(p)^T R(r) k``. The generators
    do not commute, so unlike RoPE this is not a function of ``r - p`` (with
    ``block_size=2`` it is: 2 x 2 blocks commute and LieRE is RoPE-Mixed with angle
    ``-sum_a p_a A_a[0, 1]``).

    As in the authors' code (StanfordMIMI/LieRE, ``LierePositionEncoder``), the generators
    are block diagonal with ``Dh // block_size`` blocks of ``block_size x block_size``
    (``generator_dim``; ``block_size = Dh`` is the paper's full form), built from
    ``generator_raw_params`` as ``U - U^T`` with ``U`` its strict upper triangle, initialised
    ``U(0, 2 pi)``; channels past ``block_size * (Dh // block_size)`` are not rotated. Their
    parameter is ``[A, depth, H * Dh/g, g, g]``; for layer ``l``:
    ``pe.generator_raw_params.copy_(ref.generator_raw_params[:, l].view(A, H, Dh // g, g, g))``.
    Their positions are ``linspace(0, 1, steps)`` per axis (``torch.cartesian_prod``, first axis
    slowest) with the ``[CLS]`` token at the identity (give it position 0).

    Cost (the base's): one batched ``matrix_exp`` over the *distinct* positions of the call,
    ``O(U H Dh g^2)`` for ``U`` of them (``O(U H Dh^3)`` with full generators), in float64
    (float32 loses ~1e-5 relative on generators of norm ~100); applying them costs
    ``O(B H N Dh g)``.

    Args:
        head_dim (int): head dim ``Dh``.
        num_heads (int): heads ``H``.
        num_axes (int): position axes ``A``. Default: 2.
        block_size (int, optional): generator block ``g`` (2 .. Dh). Default: ``Dh``.

    Shape:
        - x: ``[..., H, N, Dh]``; positions ``[N, A]`` or ``[B, N, A]`` (``[N]``, ``[B, N]``
          for one axis, default ``arange(N) + offset``);
          ``generator_raw_params``: ``[A, H, Dh // g, g, g]``.

    Example:
        >>> liere = LieREPositionalEmbedding(64, 8, block_size=8)
        >>> rc = torch.cartesian_prod(torch.linspace(0, 1, 14), torch.linspace(0, 1, 14))     # [196, 2]
        >>> q = k = v = torch.randn(2, 8, 196, 64)
        >>> out = attention(q, k, v, liere, positions_q=rc, positions_k=rc)
    """

    arguments = {"block_size": _check_positive_int}

    def __init__(self, head_dim: int, num_heads: int, num_axes: int = 2, *, block_size: Optional[int] = None) -> None:
        super().__init__()
        self._set_blocks(head_dim, num_heads, num_axes, block_size)
        g = self.block_size
        self.generator_raw_params = nn.Parameter(
            torch.empty(self.num_axes, self.num_heads, self.num_blocks, g, g))                  # [A, H, Dh/g, g, g]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.uniform_(self.generator_raw_params, 0.0, 2 * math.pi)

    @property
    def generators(self) -> Tensor:
        """The skew-symmetric blocks ``A_a``: [A, H, Dh/g, g, g] (float64)."""
        upper = torch.triu(self.generator_raw_params.to(torch.float64), diagonal=1)
        return upper - upper.mT


class ComRoPEPositionalEmbedding(_BlockRotation):
    """ComRoPE: rotations ``exp(sum_a p_a A_a)`` whose trainable block generators commute by construction.

    Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable
    Commuting Angle Matrices", CVPR 2025, arXiv:2506.03737. The logit ``q^T R(p)^T R(r) k`` depends on
    ``r - p`` alone exactly when the generators ``A_a`` commute (the paper's Theorem 1); ComRoPE keeps
    LieRE's learned block-diagonal skew-symmetric generators (``g x g`` blocks, ``freqs - freqs^T``
    per block and head) and makes them commute in one of two ways:

    * ``variant="ap"`` (axial partition): block ``j`` turns with axis ``j mod A`` alone (the blocks of
      the other axes are 0 there), so generators of different axes touch disjoint channels.
    * ``variant="ld"`` (linearly dependent): every axis shares block ``j``'s matrix, scaled by a
      learned ``multiplier[a, j]``: ``A_a[j] = multiplier[a, j] (freqs_j - freqs_j^T)``.

    The reference (Longin-Yu/ComRoPE, ``model.py``) differs from the paper's text in two places
    that this class follows the code on: LD's ``multiplier`` is one per axis *and block* (the
    README's equation has one per axis), shared by the heads (the paper's appendix gives it a head
    axis too); and AP assigns blocks to axes interleaved, ``j mod A``. Initialisation is the
    code's: ``freqs ~ N(0, init_std^2)`` (its default ``init_std=1.0``; the paper's detection and
    CLIP runs start from 0, the identity), ``multiplier ~ N(0, 1)``. The paper uses ``g = 8``.

    Relations: LieRE is the same rotation with unconstrained generators (not translation invariant);
    STRING (``STRINGPositionalEmbedding``) is the general commuting family, RoPE-Mixed in a learned
    basis; ComRoPE-AP and -LD with ``g = 2`` are RoPE-Mixed with frequencies
    ``-multiplier[a, j] * (freqs - freqs^T)[h, j, 0, 1]`` (AP: multiplier 1 on block ``j``'s axis, 0 elsewhere).

    Loading the reference's weights (its ``freqs`` ``[H, 1, Dh/g, g, g]``, LD's ``multiplier``
    ``[1, A, Dh/g, 1, 1]``): ``pe.freqs.copy_(ref.freqs[:, 0])``,
    ``pe.multiplier.copy_(ref.multiplier[0, :, :, 0, 0])``. Its positions are patch centres scaled
    into (0, 1), ``(index + 0.5) / P`` per axis (``(row, col)``), the ``[CLS]`` token at 0.5 on every
    axis. Cost as ``LieREPositionalEmbedding``'s (one ``matrix_exp`` per distinct position).

    Args:
        head_dim (int): head dim ``Dh``.
        num_heads (int): heads ``H``.
        num_axes (int): position axes ``A``. Default: 2.
        variant (str): ``"ap"`` or ``"ld"``. Default: ``"ap"``.
        block_size (int): block ``g`` (2 .. Dh; channels past ``g * (Dh // g)`` pass unrotated). Default: 8.
        init_std (float): std of the initial ``freqs``. Default: 1.0.

    Shape:
        - x: ``[..., H, N, Dh]``; positions ``[N, A]`` or ``[B, N, A]`` (``[N]`` for one axis, default
          ``arange(N) + offset``); ``freqs`` ``[H, Dh/g, g, g]``, ``multiplier`` ``[A, Dh/g]`` (LD).

    Example:
        >>> comrope = ComRoPEPositionalEmbedding(64, 8, variant="ld")
        >>> centres = (torch.cartesian_prod(torch.arange(14), torch.arange(14)) + 0.5) / 14   # [196, 2]
        >>> q = k = v = torch.randn(2, 8, 196, 64)
        >>> out = attention(q, k, v, comrope, positions_q=centres, positions_k=centres)
    """

    translation_invariant = True
    arguments = {"variant": functools.partial(_check_choice, choices=("ap", "ld")), "block_size": _check_positive_int}

    def __init__(self, head_dim: int, num_heads: int, num_axes: int = 2, *, variant: Literal["ap", "ld"] = "ap",
                 block_size: int = 8, init_std: float = 1.0) -> None:
        super().__init__()
        self._set_blocks(head_dim, num_heads, num_axes, block_size)
        self.variant, self.init_std, g = variant, init_std, self.block_size
        self.freqs = nn.Parameter(torch.empty(self.num_heads, self.num_blocks, g, g))              # [H, Dh/g, g, g]
        if variant == "ld":
            self.multiplier = nn.Parameter(torch.empty(self.num_axes, self.num_blocks))            # [A, Dh/g]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_heads={self.num_heads}, num_axes={self.num_axes}, "
                f"variant={self.variant!r}, block_size={self.block_size}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.freqs, std=self.init_std)
        if self.variant == "ld":
            nn.init.normal_(self.multiplier)

    @property
    def generators(self) -> Tensor:
        """The commuting skew-symmetric blocks ``A_a``: [A, H, Dh/g, g, g] (float64)."""
        skew = self.freqs.to(torch.float64) - self.freqs.to(torch.float64).mT                   # [H, Dh/g, g, g]
        if self.variant == "ld":
            weight = self.multiplier.to(torch.float64)                                           # [A, Dh/g]
        else:   # block j belongs to axis j mod A
            blocks = torch.arange(self.num_blocks, device=skew.device)
            weight = (blocks % self.num_axes == torch.arange(self.num_axes, device=skew.device)[:, None])
            weight = weight.to(torch.float64)                                                    # [A, Dh/g]
        return weight[:, None, :, None, None] * skew                                            # [A, H, Dh/g, g, g]


class STRINGPositionalEmbedding(_TokenRotation):
    """STRING: rotations ``exp(sum_a p_a L_a)`` with learned commuting generators, as RoPE in a learned basis.

    Schenck et al., "Learning the RoPE: Better 2D and 3D Position Encodings with STRING", ICML 2025,
    arXiv:2502.02562. A token at coordinates ``p`` (``A`` of them: 2-D patches, 3-D points) maps to
    ``R(p) x`` with ``R(p) = exp(sum_a p_a L_a)``, the ``L_a`` skew-symmetric and commuting, so
    ``R(p)^T R(r) = R(r - p)`` and every logit depends on ``r - p`` only (exactly, not to rounding of
    an approximation). The paper shows every such ``R`` is ``P^T RoPE(p) P`` for an orthogonal ``P``
    and a RoPE-Mixed ``RoPE(p)`` (one plane per pair, turned by ``sum_a p_a theta[a, f]``); the ``P^T``
    on the left cancels between q and k, so, like the paper, this class applies ``RoPE(p) P``.
    ``variant`` picks the paper's two parametrisations:

    * ``"cayley"`` (Cayley-STRING, the default): ``P = (I - S)(I + S)^-1`` with ``S`` a learned
      skew-symmetric ``Dh x Dh`` matrix per head (``skew_params``; its strict upper triangle is
      ``S``'s), and RoPE-Mixed frequencies ``freqs`` ``[A, H, Dh/2]`` on interleaved pairs. ``S``
      starts at 0, so a new module *is* ``MixedRotaryPositionalEmbedding`` with the same frequencies
      (``P = I``); with ``freqs`` set to RoPE's axial frequencies it is axial RoPE (the paper's
      "RoPE is the special case ``P = I``"). ``P x`` is a linear solve (``O(Dh^3)`` per head per
      call, in float64, then ``O(B H N Dh^2)`` to apply).
    * ``"circulant"`` (Circulant-STRING): ``L_a = C_a - C_a^T`` with ``C_a`` circulant of first
      column ``circulant[a, h]`` (``C[j, k] = c[(j - k) mod Dh]``). The paper applies it by FFT,
      ``R(p) x = irfft(exp(i sum_a p_a w_a) * rfft(x))`` with ``w_a = 2 Im(rfft(c_a))``; the same
      map is RoPE in the fixed real Fourier basis (``P`` has rows ``cos``, ``sin`` of each mode, then
      the constant and alternating vectors, which never turn), turning mode ``m`` by
      ``-sum_a p_a w_a[m]``. This class applies it that way, a ``Dh x Dh`` matmul per token: as fast
      as the FFT at head sizes, and it compiles (``torch.compile`` of torch 2.6 has no FFT with
      dynamic shapes). The paper gives no initialisation: ``c ~ N(0, init_std^2)`` (a circulant of
      zeros would encode no position).

    The paper published no code; these follow its equations (10) and (11). Angles are float64; the
    rotation runs in float32 (float64 for float64 inputs). For 3-D coordinates (the paper's depth per
    patch) pass ``num_axes=3`` and positions ``[N, 3]``.

    Args:
        head_dim (int): head dim ``Dh`` (even; divisible by ``2 * num_axes`` for ``"cayley"``).
        num_heads (int): heads ``H``.
        num_axes (int): coordinate axes ``A``. Default: 2.
        variant (str): ``"cayley"`` or ``"circulant"``. Default: ``"cayley"``.
        base (float): base of the initial RoPE-Mixed magnitudes (``"cayley"``). Default: 100.0.
        init_std (float): std of the initial circulant columns (``"circulant"``). Default: 0.01.

    Shape:
        - x: ``[..., H, N, Dh]``; positions ``[N, A]`` or ``[B, N, A]``, integer or float (``[N]`` for
          one axis, default ``arange(N) + offset``); ``freqs`` ``[A, H, Dh/2]``, ``skew_params``
          ``[H, Dh, Dh]``; or ``circulant`` ``[A, H, Dh]``.

    Example:
        >>> string = STRINGPositionalEmbedding(64, 8)
        >>> xy = torch.cartesian_prod(torch.arange(14), torch.arange(14))                    # [196, 2]
        >>> q = k = v = torch.randn(2, 8, 196, 64)
        >>> out = attention(q, k, v, string, positions_q=xy, positions_k=xy)
        >>> depth = STRINGPositionalEmbedding(64, 8, num_axes=3, variant="circulant")
        >>> xyz = torch.rand(196, 3) * 14
        >>> out = attention(q, k, v, depth, positions_q=xyz, positions_k=xyz)
    """

    translation_invariant = True
    arguments = {"variant": functools.partial(_check_choice, choices=("cayley", "circulant"))}

    def __init__(self, head_dim: int, num_heads: int, num_axes: int = 2, *,
                 variant: Literal["cayley", "circulant"] = "cayley", base: float = 100.0,
                 init_std: float = 0.01) -> None:
        super().__init__()
        divisor = 2 * num_axes if variant == "cayley" else 2
        if head_dim % divisor:
            raise ValueError(f"{type(self).__name__}: head_dim must be divisible by {divisor} for "
                             f"variant={variant!r}, got head_dim={head_dim}")
        self.head_dim, self.num_heads, self.num_axes, self.variant = head_dim, num_heads, num_axes, variant
        self.base, self.init_std = base, init_std
        if variant == "cayley":
            self.freqs = nn.Parameter(torch.empty(num_axes, num_heads, head_dim // 2))          # [A, H, F]
            self.skew_params = nn.Parameter(torch.empty(num_heads, head_dim, head_dim))         # [H, Dh, Dh]
        else:
            self.circulant = nn.Parameter(torch.empty(num_axes, num_heads, head_dim))           # [A, H, Dh]
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, num_axes={self.num_axes}, variant={self.variant!r}"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.variant == "circulant":
            nn.init.normal_(self.circulant, std=self.init_std)
        elif not self.freqs.is_meta:
            _copy_into(self.freqs, _mixed_frequencies(self.head_dim, self.num_heads, self.num_axes, self.base))
            nn.init.zeros_(self.skew_params)

    @property
    def basis(self) -> Tensor:
        """``P``: [H, Dh, Dh] (Cayley, ``(I - S)(I + S)^-1``) or [Dh, Dh] (circulant, the real Fourier
        basis), float64 and orthogonal."""
        if self.variant == "circulant":
            return _fourier_basis(self.head_dim, self.circulant.device)
        upper = torch.triu(self.skew_params.to(torch.float64), diagonal=1)
        skew = upper - upper.mT                                                                # S, [H, Dh, Dh]
        eye = torch.eye(self.head_dim, dtype=torch.float64, device=skew.device)
        return torch.linalg.solve(eye + skew, eye - skew)          # (I + S)^-1 (I - S): the factors commute

    @property
    def frequencies(self) -> Tensor:
        """The RoPE-Mixed frequencies in ``P``'s basis: [A, H, Dh/2] (float64). Circulant: pair ``f``
        is Fourier mode ``f + 1``, turned by ``-2 Im(rfft(c))``; the last pair (modes 0 and ``Dh/2``) by 0."""
        if self.variant == "cayley":
            return self.freqs.to(torch.float64)
        speeds = 2 * torch.fft.rfft(self.circulant.to(torch.float64)).imag                     # [A, H, Dh/2 + 1]
        return torch.cat([-speeds[..., 1:-1], torch.zeros_like(speeds[..., :1])], dim=-1)       # [A, H, Dh/2]

    def _rotate_tokens(self, x: Tensor, positions: Tensor) -> Tensor:
        dtype = _compute_dtype(x.dtype)
        turned = torch.matmul(x.to(dtype), self.basis.to(dtype).mT)                             # P x, [..., H, N, Dh]
        return _rotate_mixed(turned, _mixed_angles(positions, self.frequencies)).to(x.dtype)


def _fourier_basis(dim: int, device) -> Tensor:
    """The real orthonormal Fourier basis as rows ``[Dh, Dh]`` (float64): ``cos`` and ``sin`` of modes
    ``1 .. Dh/2 - 1`` interleaved, then the constant and the alternating vectors."""
    j = torch.arange(dim, dtype=torch.float64, device=device)
    phase = 2 * math.pi * torch.arange(1, dim // 2, dtype=torch.float64, device=device)[:, None] * j / dim  # [Dh/2 - 1, Dh]
    waves = torch.stack([phase.cos(), phase.sin()], dim=1).flatten(0, 1) * math.sqrt(2 / dim)           # [Dh - 2, Dh]
    ends = torch.stack([torch.ones_like(j), torch.cos(math.pi * j)]) / math.sqrt(dim)                   # [2, Dh]
    return torch.cat([waves, ends])


# ---------------------------------------------------------------------------
# Bias kind: the base (_PairwiseBias) and its encodings
# ---------------------------------------------------------------------------

def _toeplitz(values: Tensor, q_len: int, k_len: int) -> Tensor:
    """Expand per-distance values into the bias of default (bottom-right) positions.

    values: [..., Nq + Nk - 1], entry ``t`` for the key - query distance
    ``t - (Nq - 1) - offset`` -> [..., Nq, Nk] with ``out[i, j] = values[j - i + Nq - 1]``.
    One strided pass over the output; nothing of size N x N is computed twice.
    """
    if _is_compiling():  # unfold would specialise on the length; inductor fuses this gather instead
        return values[..., _diagonal_index(q_len, k_len, values.device)]
    windows = values.unfold(-1, k_len, 1)          # [..., Nq, Nk]; window r starts at t = r (row Nq - 1 - r)
    return windows.flip(-2)                         # contiguous copy, rows in query order


def _diagonal_index(q_len: int, k_len: int, device) -> Tensor:
    """``j - i + Nq - 1`` for query ``i`` and key ``j``: the column of each pair's diagonal, [Nq, Nk]."""
    queries, keys = torch.arange(q_len, device=device), torch.arange(k_len, device=device)
    return keys - queries[:, None] + q_len - 1


def _default_distances(q_len: int, k_len: int, device) -> Tensor:
    """Key - query distance of every diagonal of the default-positions grid: [Nq + Nk - 1]."""
    start = -(q_len - 1) - _query_offset(q_len, k_len)
    return torch.arange(start, start + q_len + k_len - 1, device=device)


def _pair_distances(q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                    device) -> Tensor:
    """``positions_k[j] - positions_q[i]`` for explicit positions: [Nq, Nk], or [B, 1, ..., 1, Nq, Nk]
    for batched ones (their singleton dims, the head's included, stay in place)."""
    positions_q, positions_k = _pair_positions(q_len, k_len, positions_q, positions_k, 0, device, device)
    return positions_k.unsqueeze(-2) - positions_q.unsqueeze(-1)


class _PairwiseBias(_AttentionEncoding):
    """The ``"bias"`` kind: an additive bias as a function of (query position, key position, head).

    A subclass writes that function element-wise: ``pair_bias(pos_q, pos_k, head)`` on broadcasting
    tensors or, when it depends on the key - query distance alone (``distance_only``),
    ``bias_at(distance, head)``. This base owns the rest of the contract:

    * ``forward(q_len, k_len, *, positions_q=None, positions_k=None)`` and ``attention_bias``:
      positions validated (``[N(, A)]`` or ``[B, N(, A)]``) and defaulted (keys ``arange(Nk)``,
      queries the last ``Nq`` of them), then the dense float32 bias ``[(B,) H, Nq, Nk]``: the
      formula broadcast over the pair grid (``dense_bias``; a subclass may replace it by a faster
      evaluation of the same formula) or, for default positions of a ``distance_only`` bias, its
      ``Nq + Nk - 1`` distinct distances evaluated once and laid out Toeplitz-wise;
    * ``score_mod``: the same bias for FlexAttention, per logit from the per-distance values, from
      ``pair_bias`` itself (``pointwise``), or from the dense bias.
    """

    kind = "bias"
    distance_only = False   # pair_bias(pos_q, pos_k, h) == bias_at(pos_k - pos_q, h): Toeplitz for defaults
    pointwise = True        # pair_bias is made of pointwise ops: score_mod evaluates it per logit
    indexes_first = False   # bias_at indexes the module's own tensors before any arithmetic: see score_mod

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        """The bias at key - query ``distance`` for head ``head`` (broadcasting): ``distance_only`` biases."""
        raise NotImplementedError

    def _attention(self, q, k, v, positions_q, positions_k, call):
        """The bias path: FlexAttention with ``score_mod`` where ``_bias_path`` says so (documents masked
        block-wise there), else the dense bias as SDPA's float mask, one block of queries at a time
        without gradient past ``_DENSE_BIAS_BUDGET``."""
        q_len, k_len = q.shape[-2], k.shape[-2]
        defaults = positions_q is None and positions_k is None and call.document_ids is None
        flex = _bias_path(
            q.device, use_flex=call.use_flex, grad=_needs_grad(self, q, k, v),
            compiling=_is_compiling() and not _is_exporting(), dropout=call.dropout_p > 0.0,
            float_mask=call.attn_mask is not None and call.attn_mask.dtype != torch.bool, q_len=q_len, k_len=k_len,
            head_dim=q.shape[-1], indexes_first=self.indexes_first and defaults and call.attn_mask is None) == "flex"
        positions_q, positions_k = _call_positions(self, q, k, positions_q, positions_k, call)
        scale = self.logit_scale(q.shape[-1]) if call.scale is None else call.scale
        if flex:
            self._check_qk(q, k, positions_q, positions_k, grouped=True)
            return _flex_attention(q, k, v, self, positions_q, positions_k, call.causal, scale, call.document_ids,
                                   call.attn_mask, call.sinks)
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k, grouped=True)
        rows = _bias_chunk_rows(self, q, k, v, positions_q, positions_k)
        if rows < q_len:  # without gradient, a large bias is built and used one block of queries at a time
            return _attend_in_query_blocks(q, k, v, self, positions_q, positions_k, call, scale, rows)
        bias = self.attention_bias(q_len, k_len, positions_q, positions_k, device=q.device)
        return _sdpa_attention(q, k, v, call, scale, bias)

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor, *inputs: Tensor) -> Tensor:
        """The bias of query position ``pos_q``, key position ``pos_k`` and head ``head`` (broadcasting;
        several position axes come last, ``[..., A]``), reading the call's ``bias_inputs``."""
        return self.bias_at(pos_k - pos_q, head)

    def bias_inputs(self, q_len: int, k_len: int, device) -> tuple:
        """Tensors the bias reads beside the positions, made once per call and passed to ``pair_bias``
        after the head: none, except for a data-dependent bias (the forget gate's cumulative sums)."""
        return ()

    def dense_bias(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """``pair_bias`` over the grid of ``pos_q`` ``[(R, 1..,) Nq(, A)]`` and ``pos_k`` ``[(R, 1..,) Nk(, A)]``
        (a batch row's positions keep a slot for the heads): ``[(R, 1..,) H, Nq, Nk]``."""
        axes = int(self.num_axes > 1)
        heads = torch.arange(self.num_heads, device=pos_q.device)[:, None, None]       # [H, 1, 1]
        inputs = self.bias_inputs(pos_q.shape[-1 - axes], pos_k.shape[-1 - axes], pos_q.device)
        return self.pair_bias(pos_q.unsqueeze(-1 - axes), pos_k.unsqueeze(-2 - axes), heads, *inputs)

    def forward(self, q_len: int, k_len: Optional[int] = None, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None):
        """The bias ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for ``[B, N(, A)]`` positions), float32."""
        return self.attention_bias(q_len, k_len, *self._validated(q_len, k_len, positions_q, positions_k))

    def attention_bias(self, q_len, k_len, positions_q=None, positions_k=None, *, device=None):
        positions_q, positions_k = self._prepared(q_len, k_len, positions_q, positions_k, device)
        device = self._buffer_device() if device is None else device
        if q_len == 0 or k_len == 0:
            return torch.zeros(self.num_heads, q_len, k_len, device=device)
        if positions_q is None and positions_k is None and self.distance_only:
            return _toeplitz(self._per_distance(q_len, k_len, device), q_len, k_len)     # [H, Nq, Nk]
        return self.dense_bias(*self._positions(q_len, k_len, positions_q, positions_k, device))

    def _bias_rows(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                   device):
        """``rows(start, stop)``: rows ``start:stop`` of ``attention_bias``'s ``[(B,) H, Nq, Nk]``, each block made
        alone (attention()'s query-blocked dense path): the per-distance values of default positions once,
        then a Toeplitz window of them per block, else the pair grid of the block's query positions."""
        positions_q, positions_k = self._prepared(q_len, k_len, positions_q, positions_k, device)
        if positions_q is None and positions_k is None and self.distance_only:
            values = self._per_distance(q_len, k_len, device)                            # [H, Nq + Nk - 1]
            # rows start..stop read the values of distances t - (Nq - 1) for t in [Nq - stop, Nq - start + Nk - 1)
            return lambda start, stop: _toeplitz(values[:, q_len - stop:q_len - start + k_len - 1], stop - start, k_len)
        pos_q, pos_k = self._positions(q_len, k_len, positions_q, positions_k, device)
        axis = -2 if self.num_axes > 1 else -1
        return lambda start, stop: self.dense_bias(pos_q.narrow(axis, start, stop - start), pos_k)

    def score_mod(self, q_len: int, k_len: int, positions_q: Optional[Tensor] = None,
                  positions_k: Optional[Tensor] = None):
        """A FlexAttention ``score_mod`` adding this bias: ``flex_attention(q, k, v, score_mod=...)``.

        Default positions of a ``distance_only`` bias close over its ``Nq + Nk - 1`` per-distance
        values, read with one gather; other positions are looked up per element, and a ``pointwise``
        bias is evaluated there; any other bias is read from its dense ``[(B,) H, Nq, Nk]`` tensor.
        The ``score_mod`` holds tensors only, no Python size: a compiled kernel would specialise on an
        int, then read it as a symbol at the next length, which inductor 2.11-2.13 fails to lower
        ("'ShapeAsConstantBuffer' object has no attribute 'dtype'" on CUDA, a C++ error on the CPU).
        With ``Nq == Nk``, a bias whose ``bias_at`` indexes its own tensors first (``indexes_first``: T5,
        ALiBi, KERPLE) is evaluated per logit instead where that is cheaper or the only way: without a
        learned tensor (ALiBi: a slope times the distance costs less on the GPU than a gather from the
        per-distance table), and traced by ``torch.compile`` for the CPU.
        """
        positions_q, positions_k = self._validated(q_len, k_len, positions_q, positions_k)
        device = self._buffer_device()
        if positions_q is None and positions_k is None and self.distance_only:
            # traced for the CPU, inductor's CPU kernel reads no tensor made inside the compiled graph
            # (torch 2.13: "No choices exist"), so bias_at reads the module's own tensors, per logit
            cpu_traced = _is_compiling() and getattr(device, "type", "cpu") == "cpu"
            if self.indexes_first and q_len == k_len and (cpu_traced or not _reads_learned(self)):
                return lambda score, b, h, q_idx, kv_idx: score + self.bias_at(kv_idx - q_idx, h).to(score.dtype)
            values = self._per_distance(q_len, k_len, device)                            # [H, Nq + Nk - 1]
            shift = torch.tensor(q_len - 1, device=device)                               # column of kv_idx == q_idx
            return lambda score, b, h, q_idx, kv_idx: score + values[h, kv_idx - q_idx + shift].to(score.dtype)
        pos_q, pos_k = self._positions(q_len, k_len, positions_q, positions_k, device)
        if not (self.pointwise and self.num_axes == 1):
            return _dense_score_mod(self.dense_bias(pos_q, pos_k))
        pick_q, pick_k = _row_lookup(pos_q), _row_lookup(pos_k)
        inputs = self.bias_inputs(q_len, k_len, device)

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + self.pair_bias(pick_q(b, q_idx), pick_k(b, kv_idx), h, *inputs).to(score.dtype)
        return add_bias

    def _per_distance(self, q_len: int, k_len: int, device) -> Tensor:
        """``bias_at`` of the ``Nq + Nk - 1`` distances of default positions: [H, Nq + Nk - 1]."""
        heads = torch.arange(self.num_heads, device=device)
        return self.bias_at(_default_distances(q_len, k_len, device), heads[:, None])

    def _positions(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                   device) -> tuple:
        """Validated positions on ``device``, or the defaults: keys ``arange(Nk)``, queries the last ``Nq``."""
        return _pair_positions(q_len, k_len, positions_q, positions_k, 0, device, device)

    def _validated(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                   device=None) -> tuple:
        """Validate ``forward(q_len, k_len, positions_q=, positions_k=)``; return the positions in the base's
        form (``[B, N(, A)]`` becomes ``[B, 1, N(, A)]``: one row for every head). Positions must be on
        ``device`` (default: the module's)."""
        owner = type(self).__name__
        if not self.takes_positions:
            _reject_positions(owner, positions_q, positions_k, self.order_from)
        for name, length in (("q_len", q_len), ("k_len", k_len)):
            if isinstance(length, Tensor):
                raise TypeError(f"{owner}: {name} must be an int (this bias is called with lengths, "
                                f"forward(q_len, k_len)), got {_describe(length)}")
        q_len, k_len = _check_positive_int(owner, "q_len", q_len), _check_positive_int(owner, "k_len", k_len)
        axes = self.num_axes
        batch_dim = 2 if axes == 1 else 3
        batches = {p.shape[0] for p in (positions_q, positions_k) if isinstance(p, Tensor) and p.dim() == batch_dim}
        if len(batches - {1}) > 1:
            raise ValueError(f"{owner}: positions_q and positions_k must have the same batch size (or 1), "
                             f"got {sorted(batches)}")
        if axes > 1 and (positions_q is None or positions_k is None):
            raise ValueError(f"{owner}: positions_q and positions_k are required for {axes} axes "
                             f"(shape [N, {axes}] or [B, N, {axes}]), got None")
        lead = (max(batches), 1) if batches else ()
        device = self._buffer_device() if device is None else device
        integer = self.integer_positions
        return (_check_positions(owner, "positions_q", positions_q, lead, q_len, axes, integer, device),
                _check_positions(owner, "positions_k", positions_k, lead, k_len, axes, integer, device))

    def _prepared(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                  device=None) -> tuple:
        """``attention_bias``'s positions: those already in the base's form (int64 or float64, ``[N(, A)]``
        or ``[B, 1, .., 1, N(, A)]``, on ``device``) pass as they are; others (a direct call with
        ``[B, N]``, a narrower dtype, another device) are validated as ``forward`` does."""
        target = self._buffer_device() if device is None else torch.device(device)
        if _in_base_form(positions_q, q_len, self.num_axes, target) and \
                _in_base_form(positions_k, k_len, self.num_axes, target):
            return positions_q, positions_k
        return self._validated(q_len, k_len, positions_q, positions_k, device)


def _row_lookup(positions: Tensor):
    """``(b, index) -> position`` for FlexAttention: ``[N]``, or ``[R, 1.., N]`` rows (R = 1 shared, or B)."""
    rows = positions.reshape(-1, positions.shape[-1])                                   # [R, N]
    if rows.shape[0] == 1:  # row 0 taken here: an int beside a tensor index does not trace on torch <= 2.8
        shared = rows[0]                                                                # [N]
        return lambda b, index: shared[index]
    return lambda b, index: rows[b, index]


def _dense_score_mod(bias: Tensor):
    """A ``score_mod`` reading a dense bias ``[(R, 1..,) H, Nq, Nk]`` (R = 1 shared, or B)."""
    rows = bias.reshape(-1, *bias.shape[-3:])                                           # [R, H, Nq, Nk]
    if rows.shape[0] == 1:  # row 0 taken outside the score_mod, as in _row_lookup
        shared = rows[0]                                                                # [H, Nq, Nk]
        return lambda score, b, h, q_idx, kv_idx: score + shared[h, q_idx, kv_idx].to(score.dtype)
    return lambda score, b, h, q_idx, kv_idx: score + rows[b, h, q_idx, kv_idx].to(score.dtype)


# attention()'s bias path (_PairwiseBias._attention): FlexAttention with the score_mod and a block mask,
# or the dense bias as SDPA's float mask

def _bias_path(device: torch.device, *, use_flex: Optional[bool], grad: bool, compiling: bool, float_mask: bool,
               dropout: bool, q_len: int, k_len: int, head_dim: int, indexes_first: bool) -> str:
    """attention()'s path for a ``"bias"`` encoding: ``"flex"`` (FlexAttention with its ``score_mod``) or
    ``"dense"`` (its bias as SDPA's float mask).

    Dense where FlexAttention cannot run (dropout, a float ``attn_mask``), else as ``use_flex`` says; by
    default FlexAttention on CUDA (fused: compiled once by the library, or traced by the caller's
    ``torch.compile``; its kernel needs ``Dh >= 16``), and on the CPU where inductor's CPU kernel
    lowers it: traced by ``torch.compile``, without gradient (torch 2.13 has no CPU FlexAttention
    backward), ``Nq == Nk``, default positions and no documents or mask, for a bias read per logit
    from its own tensors (``indexes_first``). Eager on the CPU, dense: FlexAttention runs unfused there.
    Traced before torch 2.7, dense: dynamo cannot trace ``create_block_mask`` there (``_FLEX_TRACES``).
    """
    if dropout or float_mask:
        return "dense"
    if use_flex is not None:
        return "flex" if use_flex else "dense"
    if compiling and not _FLEX_TRACES:
        return "dense"
    if device.type == "cuda" and head_dim >= 16:
        return "flex"
    if device.type == "cpu" and compiling and not grad and q_len == k_len and indexes_first:
        return "flex"
    return "dense"


# torch.compile traces FlexAttention's block mask from torch 2.7 on; torch 2.6's create_block_mask calls
# inspect.signature on the mask_mod, where dynamo stops ("inspect.signature with non-constant function")
_FLEX_TRACES = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 7)


def _needs_grad(pe: PositionalEmbedding, *tensors: Tensor) -> bool:
    """Whether autograd records this call: grad mode on and a tensor, or the encoding's, needs a gradient."""
    return torch.is_grad_enabled() and (any(t.requires_grad for t in tensors) or _reads_learned(pe))


def _reads_learned(module: nn.Module) -> bool:
    """Whether ``module`` holds a tensor that needs a gradient (a learned table; bound token states). It
    walks the module's own dicts: ``torch.compile`` refuses ``.parameters()`` on a module made inside
    its graph ("getattr() on nn.Module with pending mutation": a bound encoding)."""
    own = (*module._parameters.values(), *module._buffers.values())
    return any(t is not None and t.requires_grad for t in own) or \
        any(_reads_learned(child) for child in module._modules.values() if child is not None)


def _flex_kernel_options(device: torch.device, learned: bool) -> Optional[dict]:
    """FlexAttention's ``kernel_options``: one pipeline stage (``num_stages=1``, forward and backward) on
    CUDA when the ``score_mod`` reads a tensor that needs a gradient, else torch's defaults (None).

    With the default stages, the kernels that also accumulate that tensor's gradient ask for more shared
    memory than an H100 or H200 has: "No valid triton configs ... Required: 262144 Hardware limit: 232448"
    for T5's table at Dh = 128 (H200, torch 2.11; at Dh = 64 the forward kernel too). One stage compiled
    and ran there (smaller blocks did too, slower).
    """
    return {"num_stages": 1} if device.type == "cuda" and learned else None


_COMPILED_FLEX = []   # [torch.compile(flex_attention)], built on first use


def _compiled_flex_attention():
    """``flex_attention`` compiled once and reused (torch recompiles it for new shapes, then
    dynamically): the fused kernel in eager mode.

    Every bias class's ``score_mod``, and each grad mode, is another compilation of this one
    function: past ``torch._dynamo.config.recompile_limit`` (8 by default) torch runs the unfused
    kernel instead, with a warning (``bench.py gpu``, timing 11 classes in one process, saw 13x
    plain SDPA and 3.7 GiB until it raised the limit)."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _COMPILED_FLEX.append(torch.compile(flex_attention))
    return _COMPILED_FLEX[0]


_DENSE_BIAS_BUDGET = 2**28   # bytes of dense float32 bias per query block, without gradient (256 MiB)


def _bias_chunk_rows(pe: PositionalEmbedding, q: Tensor, k: Tensor, v: Tensor, positions_q, positions_k) -> int:
    """Query rows per block of the dense bias path: all of them (``Nq``), or without gradient, where the
    ``[(B,) H, Nq, Nk]`` float32 bias would pass ``_DENSE_BIAS_BUDGET``, as many as fit in it (at least
    one), for a bias that can build its rows alone (``_PairwiseBias._bias_rows``: positions taken, not
    traced). Each block's output is SDPA's on its rows: the same as the whole bias's."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    if not hasattr(pe, "_bias_rows") or not pe.takes_positions or _is_compiling() or _needs_grad(pe, q, k, v):
        return q_len
    batch = max([p.shape[0] for p in (positions_q, positions_k) if isinstance(p, Tensor)
                 and p.dim() > (1 if pe.num_axes == 1 else 2)] + [1])
    row_bytes = batch * pe.num_heads * k_len * 4
    return q_len if row_bytes * q_len <= _DENSE_BIAS_BUDGET else max(1, _DENSE_BIAS_BUDGET // row_bytes)


def _attend_in_query_blocks(q: Tensor, k: Tensor, v: Tensor, pe: PositionalEmbedding, positions_q, positions_k,
                            call: _AttentionCall, scale: float, rows: int) -> Tensor:
    """The dense bias path ``rows`` queries at a time: each block's rows of the bias, of the call's mask
    and of the causal mask, and SDPA on its queries; ``[..., Nq, Dv]``, what the whole bias gives."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    bias_rows = pe._bias_rows(q_len, k_len, positions_q, positions_k, q.device)
    attn_mask, options = call.mask(q), call.sdpa_options(q, k)
    out = []
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        mask = _merge_masks(bias_rows(start, stop), attn_mask, call.causal, q_len, k_len, q.dtype, q.device,
                            (start, stop))
        out.append(_sdpa(q[..., start:stop, :], k, v, attn_mask=_as_sdpa_mask(q, mask), dropout_p=call.dropout_p,
                         scale=scale, **options))                                         # [..., stop - start, Dv]
    return torch.cat(out, dim=-2)


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, pe: PositionalEmbedding, positions_q, positions_k,
                    causal: bool, scale: float, document_ids: Optional[Tensor] = None,
                    attn_mask: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """FlexAttention with the encoding's ``score_mod`` (and the bottom-right causal mask); ``sinks`` ``[H]``
    rescale each query's output by ``sigmoid(lse - sinks[h])``, the share of its softmax the sink leaves.

    FlexAttention takes ``[B, H, N, Dh]``: other ranks are viewed as that (``[H, N, Dh]`` as
    one batch, ``[B, G, H, N, Dh]`` as ``B * G`` batches, ``[B, N]`` positions and document
    ids repeated). Causality, documents and a boolean ``attn_mask`` go into a ``BlockMask``
    (masked blocks are skipped; a query with no key left gets 0, where SDPA gives NaN). In
    eager mode on CUDA the call goes through ``_compiled_flex_attention``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    lead = q.shape[:-3]
    batch = math.prod(lead) if lead else 1
    per_row = batch // (lead[0] if lead else 1)

    def rows(p: Optional[Tensor], batched_dim: int) -> Optional[Tensor]:  # [1, N] -> [N]; [B, N] -> [B * G, N]
        if not isinstance(p, Tensor) or p.dim() != batched_dim:
            return p
        if p.shape[0] == 1:
            return p[0]
        return p.repeat_interleave(per_row, dim=0) if per_row > 1 else p

    batched_dim = 2 if pe.num_axes == 1 else 3
    positions_q, positions_k = rows(positions_q, batched_dim), rows(positions_k, batched_dim)
    document_ids = rows(document_ids, 2)
    allowed = None if attn_mask is None else _flex_mask(attn_mask, q.shape, k.shape[-2])     # [1 or B, 1 or H, Nq, Nk]
    if q.dim() != 4:
        q, k, v = (t.reshape(batch, *t.shape[-3:]) for t in (q, k, v))
    add_bias = pe.score_mod(q.shape[-2], k.shape[-2], positions_q, positions_k)
    block_mask = _block_mask(document_ids, causal, q.shape[-2], k.shape[-2], q.device, allowed)
    attend = _compiled_flex_attention() if q.is_cuda and not _is_compiling() else flex_attention
    options = _flex_kernel_options(q.device, torch.is_grad_enabled() and _reads_learned(pe))
    out = attend(q, k, v, score_mod=add_bias, block_mask=block_mask, scale=scale,
                 enable_gqa=q.shape[-3] != k.shape[-3], kernel_options=options,
                 **({} if sinks is None else _lse_request()))
    if sinks is not None:
        out, aux = out
        lse = getattr(aux, "lse", aux)                                                  # [B, H, Nq] (out [B, H, Nq, Dv])
        dtype = _compute_dtype(out.dtype)
        kept = torch.sigmoid(lse.to(dtype) - sinks.to(dtype).reshape(-1, 1))            # e^lse / (e^lse + e^sink)
        out = (out.to(dtype) * kept.unsqueeze(-1)).to(out.dtype)
    return out.reshape(*lead, *out.shape[-3:])


def _lse_request() -> dict:
    """flex_attention's keyword for the log-sum-exp of each query's logits: ``return_aux`` (torch >= 2.9;
    ``return_lse`` is deprecated there) or ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


_BLOCK_MASKS: dict = {}   # _block_mask's cache, oldest first: key -> (weak reference to the ids or None, version, mask)
_BLOCK_MASK_CACHE_SIZE = 8
_FLEX_BLOCK = 128         # FlexAttention's default block size (queries and keys)


def _block_mask(ids: Optional[Tensor], causal: bool, q_len: int, k_len: int, device,
                allowed: Optional[Tensor] = None):
    """FlexAttention ``BlockMask`` keeping every query to the keys of its own document (ids ``[N]``
    shared or ``[B, N]``; None: one document), with ``causal`` to keys at most ``_query_offset``
    past it, and to the keys ``allowed`` allows (bool ``[1 or B, 1 or H, Nq, Nk]``, never cached);
    None when nothing is masked.

    The kernel skips the blocks wholly masked and applies the ``mask_mod`` inside the others. The
    blocks come from block indices (``_mask_blocks``: no ``[Nq, Nk]`` tensor, memory
    ``O(N + (N / 128)^2)``), eager or traced: traced, ``create_block_mask`` would evaluate the
    ``mask_mod`` at every pair (O(N^2) work: 3% of a compiled causal ALiBi call at 4096 tokens on a 2-core CPU). In
    eager mode the mask is cached (the last ``_BLOCK_MASK_CACHE_SIZE``) per lengths, causality, device
    and ids: the same ids tensor, unchanged (its identity, held weakly, and its version counter), so
    every layer of one forward shares one mask and new ids make a new one (inference-mode ids have no
    version counter: their mask is rebuilt every call).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if ids is None and not causal and allowed is None:
        return None
    device = torch.device(device)
    cached = not _is_compiling() and allowed is None and (ids is None or not ids.is_inference())
    key = (q_len, k_len, causal, device, None if ids is None else (id(ids), tuple(ids.shape)))
    entry = _BLOCK_MASKS.pop(key, None) if cached else None
    if entry is not None and (ids is None or entry[0]() is ids and entry[1] == ids._version):
        _BLOCK_MASKS[key] = entry                                                       # now the newest
        return entry[2]

    def ordered(blocks: Tensor) -> tuple:  # [R, H, Q, K] bool -> blocks per row [R, H, Q], their indices first
        blocks = blocks.to(torch.int32)
        return blocks.sum(-1, dtype=torch.int32), blocks.argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    partial, full = _mask_blocks(ids, causal, q_len, k_len, device)                     # [R, 1, Q, K] each
    if allowed is not None:  # and its blocks: some pair kept by both is possible, all kept by both is sure
        some, every = _tensor_mask_blocks(allowed)                                      # [Bm, Hm, Q, K] each
        full, partial = full & every, (partial | full) & some
        partial = partial & ~full                                                       # [max(R, Bm), Hm, Q, K]
    mask = BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=_FLEX_BLOCK,
                                    mask_mod=_keep_mod(ids, causal, q_len, k_len, device, allowed),
                                    seq_lengths=(q_len, k_len))
    if cached:
        _BLOCK_MASKS[key] = (None if ids is None else weakref.ref(ids), None if ids is None else ids._version, mask)
        while len(_BLOCK_MASKS) > _BLOCK_MASK_CACHE_SIZE:
            del _BLOCK_MASKS[next(iter(_BLOCK_MASKS))]                                  # the oldest
    return mask


def _keep_mod(ids: Optional[Tensor], causal: bool, q_len: int, k_len: int, device, allowed: Optional[Tensor] = None):
    """``_block_mask``'s ``mask_mod``: same document, with ``causal`` ``kv_idx <= q_idx + offset``, and
    ``allowed``. A nonzero offset is a 0-d tensor: a Python int would be a size the compiled kernel
    specialises on, then reads as a symbol (which inductor 2.11-2.13 fails to lower)."""
    offset = _query_offset(q_len, k_len)
    shift = torch.tensor(offset, device=device) if offset else None
    look_up = None if allowed is None else _mask_lookup(allowed)

    def keep(b, h, q_idx, kv_idx):
        kept = kv_idx <= (q_idx if shift is None else q_idx + shift) if causal else None
        if ids is not None:
            same = ids[b, q_idx] == ids[b, kv_idx] if ids.dim() == 2 else ids[q_idx] == ids[kv_idx]
            kept = same if kept is None else kept & same
        if look_up is not None:
            kept = look_up(b, h, q_idx, kv_idx) if kept is None else kept & look_up(b, h, q_idx, kv_idx)
        return kept
    return keep


def _flex_mask(attn_mask: Tensor, q_shape: tuple, k_len: int) -> Tensor:
    """A boolean ``attn_mask`` (broadcasting to ``[..., H, Nq, Nk]``) as FlexAttention's batch of rows: ``[1 or
    B, 1 or H, Nq, Nk]`` (``B`` the flattened leading dims), views where it broadcasts."""
    shape = (*q_shape[:-1], k_len)                                                      # [..., H, Nq, Nk]
    mask = attn_mask.reshape((1,) * (len(shape) - attn_mask.dim()) + tuple(attn_mask.shape))
    lead = shape[:-3] if any(size > 1 for size in mask.shape[:-3]) else (1,) * len(shape[:-3])
    mask = mask.expand(*lead, mask.shape[-3], *shape[-2:])
    return mask.reshape(-1, *mask.shape[-3:])


def _mask_lookup(allowed: Tensor):
    """``(b, h, q_idx, kv_idx) -> allowed`` for a ``[1 or B, 1 or H, Nq, Nk]`` mask (a broadcast dim is taken
    outside the ``mask_mod``: an int beside a tensor index does not trace on torch <= 2.8)."""
    if allowed.shape[0] == 1 and allowed.shape[1] == 1:
        plane = allowed[0, 0]                                                           # [Nq, Nk]
        return lambda b, h, q_idx, kv_idx: plane[q_idx, kv_idx]
    if allowed.shape[0] == 1:
        heads = allowed[0]                                                              # [H, Nq, Nk]
        return lambda b, h, q_idx, kv_idx: heads[h, q_idx, kv_idx]
    if allowed.shape[1] == 1:
        rows = allowed[:, 0]                                                            # [B, Nq, Nk]
        return lambda b, h, q_idx, kv_idx: rows[b, q_idx, kv_idx]
    return lambda b, h, q_idx, kv_idx: allowed[b, h, q_idx, kv_idx]


def _tensor_mask_blocks(allowed: Tensor, size: int = _FLEX_BLOCK) -> tuple:
    """The blocks of a boolean mask ``[Bm, Hm, Nq, Nk]`` holding some allowed pair and those all allowed: bool
    ``[Bm, Hm, Q, K]`` each (padded with False past the lengths, as torch pads: such a block is never all)."""
    q_len, k_len = allowed.shape[-2:]
    q_blocks, k_blocks = -(-q_len // size), -(-k_len // size)
    padded = F.pad(allowed, (0, k_blocks * size - k_len, 0, q_blocks * size - q_len))   # [Bm, Hm, Q size, K size]
    tiles = padded.reshape(*padded.shape[:2], q_blocks, size, k_blocks, size)
    return tiles.any(-1).any(-2), tiles.all(-1).all(-2)


def _mask_blocks(ids: Optional[Tensor], causal: bool, q_len: int, k_len: int, device, size: int = _FLEX_BLOCK) -> tuple:
    """The ``size x size`` blocks of ``_keep_mod``'s mask that hold some kept pair (``partial``, to be masked
    inside) and those wholly kept (``full``), from block indices: bool ``[R, 1, Q, K]`` each (R rows of
    ``[R, N]`` ids, else 1), ``partial`` and ``full`` disjoint, as ``create_block_mask`` finds them.

    Causal: a block holds a kept pair iff its first key is seen by its last query, and all are kept iff
    its last key is seen by its first query. Documents: a block pair shares an id only if the id ranges
    ``[min, max]`` of its query and key blocks overlap (exact for ids that do not decrease, as packed
    documents are numbered; other ids may leave an extra block to the ``mask_mod``), and is wholly one
    document iff both blocks hold one id, the same. With both, as ids need ``Nq == Nk``, a block on the
    diagonal keeps its diagonal and one below it every causal pair, so the two tests combine exactly.
    A block past either length's end is never full (torch pads the dense mask with False).
    """
    q_blocks, k_blocks = -(-q_len // size), -(-k_len // size)
    q_first = torch.arange(q_blocks, device=device)[:, None] * size                    # [Q, 1]
    k_first = torch.arange(k_blocks, device=device) * size                              # [K]
    full = (q_first + size <= q_len) & (k_first + size <= k_len)                        # [Q, K]: inside both lengths
    partial = torch.ones_like(full)
    if causal:
        offset = _query_offset(q_len, k_len)
        q_last, k_last = (q_first + size - 1).clamp(max=q_len - 1), (k_first + size - 1).clamp(max=k_len - 1)
        partial = partial & (k_first <= q_last + offset)
        full = full & (k_last <= q_first + offset)
    if ids is not None:
        rows = ids.reshape(-1, ids.shape[-1])                                           # [R, N]
        index = torch.arange(q_blocks * size, device=device).clamp(max=rows.shape[-1] - 1)
        blocks = rows[:, index].unflatten(-1, (q_blocks, size))                         # [R, Q, size]: last id repeated
        low, high = blocks.amin(-1), blocks.amax(-1)                                    # [R, Q]
        overlap = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])   # [R, Q, K]
        one = low == high
        partial = partial & overlap
        full = full & one[:, :, None] & one[:, None, :] & (low[:, :, None] == low[:, None, :])
    return (partial & ~full).reshape(-1, 1, q_blocks, k_blocks), full.reshape(-1, 1, q_blocks, k_blocks)


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
    # -2**63 has no int64 magnitude (abs and negation wrap to itself): -(2**63 - 1) shares its bucket
    relative_position = relative_position.long().clamp(min=-_INT64_MAX)
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


class T5PositionalEmbedding(_PairwiseBias):
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

    distance_only = translation_invariant = indexes_first = True
    integer_positions = True   # distances index buckets

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, init_std: float = 0.02) -> None:
        super().__init__()
        num_buckets, max_distance, _ = _check_buckets(type(self).__name__, num_buckets, max_distance, bidirectional)
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional, self.init_std = bidirectional, init_std
        self.relative_attention_bias = _uninitialised(nn.Embedding, num_buckets, num_heads)   # [buckets, H]
        self.reset_parameters()

    @classmethod
    def from_config(cls, config, *, decoder: Optional[bool] = None) -> "T5PositionalEmbedding":
        """T5's bias of a Hugging Face config: heads, ``relative_attention_num_buckets`` /
        ``relative_attention_max_distance``, bidirectional unless ``is_decoder`` (or ``decoder=True``)."""
        return cls(**_t5_kwargs_from_config(config, decoder=decoder))

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
    num_heads = _check_positive_int(owner, "num_heads", num_heads, maximum=_MAX_HEADS)
    max_bias = _as_float(owner, "max_bias", max_bias, minimum=0.0, exclusive=True)

    def geometric(n: int) -> list:
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return geometric(num_heads)
    lower = 2 ** int(math.log2(num_heads))
    return geometric(lower) + alibi_slopes(2 * lower, max_bias)[0::2][: num_heads - lower]


def _slope_list(owner: str, name: str, value) -> list:
    """Explicit ALiBi slopes: a list of non-negative reals."""
    return [_as_float(owner, name, slope, minimum=0.0) for slope in _as_list(owner, name, value)]


def _check_alibi_heads(owner: str, arguments: dict) -> None:
    """ALiBi's heads: at most ``num_heads`` with a slope, one explicit slope for each; several axes
    (Euclidean distance) have no causal order."""
    heads, alibi, slopes = arguments["num_heads"], arguments["num_alibi_heads"], arguments["slopes"]
    alibi = heads if alibi is None else alibi
    if alibi > heads:
        raise ValueError(f"{owner}: num_alibi_heads must be <= num_heads={heads}, got num_alibi_heads={alibi}")
    if slopes is not None and len(slopes) != alibi:
        raise ValueError(f"{owner}: slopes must have num_alibi_heads={alibi} entries, got {len(slopes)}")
    if arguments["num_axes"] > 1 and not arguments["bidirectional"]:
        raise ValueError(f"{owner}: num_axes={arguments['num_axes']} (Euclidean distance) has no causal order; "
                         f"pass bidirectional=True")


class ALiBiPositionalEmbedding(_PairwiseBias):
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

    distance_only = translation_invariant = indexes_first = True
    arguments = {"num_heads": functools.partial(_check_positive_int, maximum=_MAX_HEADS),
                 "max_bias": _positive_float, "num_alibi_heads": _check_positive_int, "slopes": _slope_list}
    argument_rules = (_check_alibi_heads,)

    def __init__(self, num_heads: int, *, bidirectional: bool = False, slopes: Optional[list] = None,
                 max_bias: float = 8.0, num_alibi_heads: Optional[int] = None, num_axes: int = 1) -> None:
        super().__init__()
        self.num_heads, self.bidirectional, self.max_bias, self.num_axes = num_heads, bidirectional, max_bias, num_axes
        self.num_alibi_heads = num_heads if num_alibi_heads is None else num_alibi_heads
        self.explicit_slopes = slopes
        self._init_buffers(None)

    @classmethod
    def from_config(cls, config) -> "ALiBiPositionalEmbedding":
        """The bias a Bloom, MPT (``attn_config.alibi_bias_max``) or Falcon (``alibi=True``: slopes /
        ``sqrt(head_dim)``) model adds to its logits, from its Hugging Face config."""
        return cls(**_alibi_kwargs_from_config(config))

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

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor) -> Tensor:
        if self.num_axes == 1:
            return self.bias_at(pos_k - pos_q, head)
        squared = (pos_k - pos_q).to(torch.float64).square().sum(-1)
        # sqrt's slope is infinite at 0: a double where keeps float positions' gradient finite there
        # (0, the symmetric subgradient of the cone |offset|)
        positive = squared > 0
        return self.bias_at(torch.where(positive, torch.where(positive, squared, 1.0).sqrt(), 0.0), head)


class UnifiedPositionalEmbedding(_PairwiseBias):
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

    integer_positions = True
    pointwise = False   # a learned [H, Nq, Nk] correlation: score_mod reads the dense bias
    arguments = {"relative_bias": _check_flag, "cls_token": _check_flag}

    def __init__(self, max_len: int, num_heads: int, head_dim: int, *, relative_bias: bool = True,
                 num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True,
                 cls_token: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        num_buckets, max_distance, _ = _check_buckets(type(self).__name__, num_buckets, max_distance, bidirectional)
        self.max_len, self.num_heads, self.head_dim = max_len, num_heads, head_dim
        self.cls_token, self.init_std = cls_token, init_std
        width = num_heads * head_dim
        self.position_embeddings = _uninitialised(nn.Embedding, max_len, width)         # p: [max_len, H * Dh]
        self.pos_ln = nn.LayerNorm(width)
        self.pos_q_linear = _uninitialised(nn.Linear, width, width)                     # U_q
        self.pos_k_linear = _uninitialised(nn.Linear, width, width)                     # U_k
        self.relative = _uninitialised(T5PositionalEmbedding, num_heads, num_buckets=num_buckets,
                                       max_distance=max_distance, bidirectional=bidirectional,
                                       init_std=self.init_std) if relative_bias else None
        if self.cls_token:
            self.cls_to_others = nn.Parameter(torch.empty(num_heads))                  # theta_1: [H]
            self.others_to_cls = nn.Parameter(torch.empty(num_heads))                  # theta_2: [H]
        self.reset_parameters()

    @property
    def is_causal(self) -> bool:
        """Causal-mode when its relative bias is (``bidirectional=False``)."""
        return self.relative is not None and self.relative.is_causal

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

    def dense_bias(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        bias = self._correlation(_unhead(pos_q), _unhead(pos_k))                        # [(B, 1..,) H, Nq, Nk]
        if self.relative is not None:
            bias = bias + self.relative.dense_bias(pos_q, pos_k)
        if self.cls_token:  # column first, then row: the [CLS] query keeps cls_to_others on itself
            heads = (-1, 1, 1)
            bias = torch.where((pos_k == 0).unsqueeze(-2), self.others_to_cls.view(heads).to(bias.dtype), bias)
            bias = torch.where((pos_q == 0).unsqueeze(-1), self.cls_to_others.view(heads).to(bias.dtype), bias)
        return bias

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


def _causal_distance(distance: Tensor, bidirectional: bool) -> Tensor:
    """Non-negative distance fed to a decaying kernel.

    ``distance`` is key - query. Bidirectional: ``|i - j|``. Causal: ``max(i - j, 0)``, so a key
    after the query is evaluated at distance 0 (finite, as in the KERPLE and NeMo Sandwich
    code); ``attention(causal=True)`` masks those keys.
    """
    return distance.abs() if bidirectional else (-distance).clamp(min=0)


class _StraightThroughClamp(torch.autograd.Function):
    """``clamp(x, low, high)`` forward, identity backward: the value the KERPLE authors'
    in-place clamp gives, with the gradient they get at that value flowing to the parameter."""

    @staticmethod
    def forward(ctx, x: Tensor, low: float, high: Optional[float]) -> Tensor:
        return x.clamp(min=low, max=high)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def _clamp_straight_through(x: Tensor, low: float, high: Optional[float] = None) -> Tensor:
    if _is_compiling():  # the same function, written with detach so dynamo traces it
        return x + (x.clamp(min=low, max=high) - x).detach()
    return _StraightThroughClamp.apply(x, low, high)


class KerplePositionalEmbedding(_PairwiseBias):
    """KERPLE: a learned conditionally positive definite kernel of the distance (Chi et al. 2022).

    Chi, Fan, Ramadge and Rudnicky, "KERPLE: Kernelized Relative Positional Embedding for
    Length Extrapolation", NeurIPS 2022, arXiv:2205.09921. With ``d = max(i - j, 0)`` (causal)
    or ``d = |i - j|`` (bidirectional), per head:

    * ``kernel="log"``: ``bias = -r1 * log(1 + r2 * d)``;
    * ``kernel="power"``: ``bias = -r1 * d ** r2`` with ``r2 <= 2`` (ALiBi is ``r2 = 1``).

    Parameters follow the authors' code (github.com/chijames/KERPLE, ``megatron/mpu/layers.py``,
    ``ParallelKerpleLog`` / ``ParallelKerplePower``): ``bias_p`` and ``bias_a``, shape ``[H, 1, 1]``
    as there, so their checkpoints' ``...attention.rpe.bias_p`` / ``bias_a`` load unchanged. In
    their naming ``bias_p`` is ``r1`` of the log kernel but ``r2`` (the exponent) of the power
    kernel: log ``-bias_p * log(1 + bias_a * d)``, power ``-bias_a * d ** bias_p``; the properties
    ``r1`` and ``r2`` give the paper's names. Init as theirs: ``bias_p ~ U(0, 2)``,
    ``bias_a ~ U(0, 1)``. Positivity as theirs: every forward uses ``clamp(bias_*, min=eps)``
    (and ``max=2`` for the power exponent), ``eps = 0.01``. They also overwrite the stored
    parameters with the clamped values in forward; here forward is pure (so it compiles and
    shards) and the clamp is straight-through, which gives the same values and gradients;
    call ``clamp_parameters_()`` after ``optimizer.step()`` to store the clamped values too.

    Keys after the query (causal mode) are evaluated at ``d = 0``, bias 0, as in the authors'
    ``tril`` distance matrix: pass ``causal=True`` to ``attention()`` to mask them.
    Positions may be floats.

    Args:
        num_heads (int): heads ``H``.
        kernel (str): ``"log"`` or ``"power"``. Default: ``"log"``.
        bidirectional (bool): ``|i - j|`` for both directions. Default: False.
        eps (float): lower clamp of the parameters. Default: 0.01.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32; ``bias_p``, ``bias_a``: ``[H, 1, 1]``.

    Example:
        >>> kerple = KerplePositionalEmbedding(8)
        >>> kerple(16, 16).shape
        torch.Size([8, 16, 16])
    """

    distance_only = translation_invariant = indexes_first = True
    arguments = {"kernel": functools.partial(_check_choice, choices=("log", "power")),
                 "eps": functools.partial(_as_float, minimum=0.0, maximum=2.0, exclusive=True)}

    def __init__(self, num_heads: int, *, kernel: Literal["log", "power"] = "log", bidirectional: bool = False,
                 eps: float = 1e-2) -> None:
        super().__init__()
        self.num_heads, self.kernel, self.bidirectional, self.eps = num_heads, kernel, bidirectional, eps
        self.bias_p = nn.Parameter(torch.empty(num_heads, 1, 1))   # log: r1; power: r2 (exponent)
        self.bias_a = nn.Parameter(torch.empty(num_heads, 1, 1))   # log: r2; power: r1
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.bias_p, 0.0, 2.0)
        nn.init.uniform_(self.bias_a, 0.0, 1.0)

    @torch.no_grad()
    def clamp_parameters_(self) -> None:
        """Store the clamped parameters, as the authors' forward does in place."""
        self.bias_p.clamp_(min=self.eps, max=2.0 if self.kernel == "power" else None)
        self.bias_a.clamp_(min=self.eps)

    def _clamped(self, head: Optional[Tensor] = None) -> tuple:
        """``(bias_p, bias_a)`` clamped, flattened to ``[H]`` (or read at ``head``, broadcasting), in the compute
        dtype. The parameters are indexed before any operation, as a ``score_mod`` must read them."""
        dtype = _compute_dtype(self.bias_p.dtype)
        if head is None:
            head = torch.arange(self.num_heads, device=self.bias_p.device)
        p, a = (t[head].squeeze(-1).squeeze(-1) for t in (self.bias_p, self.bias_a))  # [H, 1, 1] -> head's shape
        p = _clamp_straight_through(p, self.eps, 2.0 if self.kernel == "power" else None)
        a = _clamp_straight_through(a, self.eps)
        return p.to(dtype), a.to(dtype)

    @property
    def r1(self) -> Tensor:
        """The paper's per-head ``r1`` (as used in forward): ``[H]``."""
        p, a = self._clamped()
        return (p if self.kernel == "log" else a).detach()

    @property
    def r2(self) -> Tensor:
        """The paper's per-head ``r2`` (as used in forward): ``[H]``."""
        p, a = self._clamped()
        return (a if self.kernel == "log" else p).detach()

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        p, a = self._clamped(head)
        d = _causal_distance(distance, self.bidirectional).to(p.dtype)
        if self.kernel == "log":
            return -p * torch.log1p(a * d)
        # d ** r2 is 0 at d = 0; its slope there (infinite for r2 < 1) is taken as 0, the symmetric
        # subgradient, through a double where: a plain pow gives inf * 0 = NaN to float positions
        positive = d > 0
        return -a * torch.where(positive, torch.where(positive, d, torch.ones_like(d)).pow(p), 0.0)


class SandwichPositionalEmbedding(_PairwiseBias):
    """Sandwich: the inner product of sinusoidal embeddings as a bias (Chi et al. 2023).

    Chi, Fan, Rudnicky and Ramadge, "Dissecting Transformer Length Extrapolation via the
    Lens of Receptive Field Analysis", ACL 2023, arXiv:2212.10356. With ``p_m`` the
    sinusoids of width ``dim``, ``p_m . p_n = sum_{i=1..dim/2} cos((m - n) / base ** (2i / dim))``
    (the paper's sum runs from ``i = 1``: frequencies ``base ** (-2/dim) ... 1/base``). Per head
    ``h = 1..H`` the bias is that inner product minus its value ``dim/2`` at distance 0, divided
    by ``8h / H``:

        ``bias[h, i, j] = (sum_i cos((i - j) w_i) - dim / 2) / (8 h / H)``.

    This is exactly NVIDIA NeMo's ``SandwichRelativePositionEmbedding``
    (``nemo/collections/nlp/modules/common/megatron/position_embedding/sandwich_relative_position_embedding.py``);
    subtracting ``dim / 2`` is a constant per head, so the softmax is the paper's. Like NeMo,
    causal mode evaluates keys after the query at distance 0 (bias 0): pass ``causal=True``
    to ``attention()`` to mask them. No parameters; positions may be floats.

    Cost: default positions take ``(Nq + Nk - 1) * dim / 2`` cosines (float64) and one pass
    over ``[H, Nq, Nk]``; explicit positions take the inner product of their sinusoids, a
    ``[Nq, dim] x [dim, Nk]`` float64 matmul.

    Args:
        num_heads (int): heads ``H``.
        dim (int): width of the sinusoids (even; the paper's ``d``, NeMo's ``hidden_size``).
        base (float): wavelength base. Default: 10000.0.
        bidirectional (bool): both directions (``cos`` is even, so ``|i - j|``). Default: False.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32.

    Example:
        >>> sandwich = SandwichPositionalEmbedding(8, 128)
        >>> sandwich(16, 16).shape
        torch.Size([8, 16, 16])
    """

    distance_only = translation_invariant = True
    arguments = {"dim": _even_int}

    def __init__(self, num_heads: int, dim: int, *, base: float = 10000.0, bidirectional: bool = False) -> None:
        super().__init__()
        self.num_heads, self.dim, self.base, self.bidirectional = num_heads, dim, base, bidirectional
        self._init_buffers(None)

    def _init_buffers(self, device) -> None:
        i = torch.arange(1, self.dim // 2 + 1, dtype=torch.float64, device=device)
        heads = torch.arange(1, self.num_heads + 1, dtype=torch.float64, device=device)
        self.register_buffer("inv_freq", self.base ** (-2 * i / self.dim), persistent=False)        # [dim/2]
        self.register_buffer("head_scales", 8 * heads / self.num_heads, persistent=False)            # [H]

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        d = _causal_distance(distance, self.bidirectional)
        inner = _angles(d, self.inv_freq).cos().sum(-1) - self.dim / 2                  # [...] float64
        return (inner / self.head_scales[head]).float()

    def dense_bias(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """``bias_at`` on the pair grid without a cosine per pair and frequency:
        ``cos(w (m - n)) = cos(w m) cos(w n) + sin(w m) sin(w n)``, the paper's ``p_m . p_n``, a matmul."""
        def sinusoids(positions: Tensor) -> Tensor:                                     # [..., N, dim]
            angles = _angles(positions, self.inv_freq)
            return torch.cat([angles.cos(), angles.sin()], dim=-1)

        inner = torch.matmul(sinusoids(pos_q), sinusoids(pos_k).transpose(-1, -2)) - self.dim / 2   # [(B, 1..,) Nq, Nk]
        if not self.bidirectional:  # keys after the query sit at distance 0
            inner = inner.masked_fill(pos_k.unsqueeze(-2) > pos_q.unsqueeze(-1), 0.0)
        return (inner / self.head_scales[:, None, None]).float()      # [Nq, Nk] -> [H, Nq, Nk]; [B, 1.., 1, ..] -> [B, 1.., H, ..]


class FIREPositionalEmbedding(_PairwiseBias):
    """FIRE: a learned function of the distance, normalised by the query position (Li et al. 2023).

    Li et al., "Functional Interpolation for Relative Positions Improves Long Context
    Transformers", ICLR 2024, arXiv:2310.04418. Per head ``h``:

        ``bias[h, i, j] = f_h(psi(d) / psi(max(L, i)))``,  ``psi(x) = log(c x + 1)``,

    with ``d = i - j >= 0`` for a causal query ``i`` and key ``j``; ``f`` is an MLP
    ``1 -> hidden_dim -> H`` with ReLU (``mlp``: ``Linear``, ``ReLU``, ``Linear``); ``c`` and ``L``
    are learned, used as ``|c|`` and ``|L|`` so they stay positive. As in the paper's appendix
    code, the threshold is learned as a multiplier of its initial value,
    ``L = |L_multiplier * init_L|`` (``L_multiplier`` starts at 1; ``init_L`` is a frozen
    parameter), so an optimiser step moves ``L`` in units of ``init_L``, and a checkpoint of that
    code (``c``, ``init_L``, ``L_multiplier``, ``mlp.*``) loads by copying; its ``eps = 1e-6``
    added to the normaliser is left out (a 2.5e-7 relative difference at the defaults). The
    scalars are ``[1]`` tensors, because FSDP2 cannot shard 0-d parameters; 0-d checkpoint
    values load as well. Dividing by
    ``psi(max(L, i))`` maps every distance a query sees into ``[0, 1]`` ("progressive
    interpolation"), so longer inputs reuse the range ``f`` was trained on.

    Definitions beyond the paper's causal formula, made explicit:

    * causal mode (default): keys after the query get ``d = 0`` (``f_h(0)``, finite);
      ``attention(causal=True)`` masks them;
    * ``bidirectional=True``: ``d = |i - j|`` and the normaliser is ``psi(max(L, i, j))``, so
      inputs stay in ``[0, 1]`` on both sides (for causal pairs ``j <= i`` this is the
      paper's ``psi(max(L, i))``; the same expression is used in both modes).

    The bias depends on (distance, query position), not on the distance alone, so there is no
    Toeplitz shortcut in general: ``forward`` evaluates ``f`` on the full ``[(B,) Nq, Nk]`` grid
    (``Nq * Nk * hidden_dim`` float32 activations, the cost of a small MLP per logit), and
    ``score_mod`` evaluates it per logit inside FlexAttention instead of materialising it.
    Positions may be floats; ``translation_invariant`` is False.

    Args:
        num_heads (int): heads ``H``.
        hidden_dim (int): hidden width of ``f``. Default: 32.
        bidirectional (bool): see above. Default: False.
        init_c (float): initial ``c``. Default: 0.1 (the paper's appendix code).
        init_L (float): initial threshold ``L``. Default: 512.0 (the paper's appendix code).

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` (``[B, H, Nq, Nk]`` for ``[B, N]``
          positions), float32.

    Example:
        >>> fire = FIREPositionalEmbedding(8)
        >>> fire(16, 16).shape
        torch.Size([8, 16, 16])
    """

    arguments = {"init_c": _positive_float, "init_L": _positive_float}

    def __init__(self, num_heads: int, *, hidden_dim: int = 32, bidirectional: bool = False,
                 init_c: float = 0.1, init_L: float = 512.0) -> None:
        super().__init__()
        self.num_heads, self.hidden_dim, self.bidirectional = num_heads, hidden_dim, bidirectional
        self.initial_c, self.initial_L = init_c, init_L
        self.mlp = nn.Sequential(_uninitialised(nn.Linear, 1, hidden_dim), nn.ReLU(),
                                 _uninitialised(nn.Linear, hidden_dim, num_heads))
        self.c = nn.Parameter(torch.empty(1))
        self.L_multiplier = nn.Parameter(torch.empty(1))
        self.init_L = nn.Parameter(torch.empty(1), requires_grad=False)   # frozen, as in the appendix code
        self.reset_parameters()

    @property
    def L(self) -> Tensor:
        """The threshold ``|L_multiplier * init_L|``: ``[1]``."""
        return (self.L_multiplier * self.init_L).abs()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("c", "L_multiplier", "init_L"):  # 0-d values (the appendix code's scalars) load into [1]
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor) and value.dim() == 0:
                state_dict[prefix + name] = value.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def reset_parameters(self) -> None:
        self.mlp[0].reset_parameters()
        self.mlp[2].reset_parameters()
        nn.init.constant_(self.c, self.initial_c)
        nn.init.ones_(self.L_multiplier)
        with torch.no_grad():
            self.init_L.fill_(self.initial_L)

    def _inputs(self, pos_q: Tensor, pos_k: Tensor, c: Optional[Tensor] = None,
                threshold: Optional[Tensor] = None) -> Tensor:
        """``psi(d) / psi(max(L, i, j))`` for broadcastable positions, in the compute dtype (``c`` and ``L``:
        ``|c|`` and ``L`` read per head by ``pair_bias``; default the parameters', 0-d)."""
        dtype = _compute_dtype(self.c.dtype)
        if c is None:
            c, threshold = self.c.abs().to(dtype).squeeze(0), self.L.to(dtype).squeeze(0)    # 0-d (L is |.|)
        distance = _causal_distance(pos_k - pos_q, self.bidirectional).to(dtype)
        top = torch.maximum(torch.maximum(pos_q, pos_k).to(dtype), threshold)
        return torch.log1p(c * distance) / torch.log1p(c * top).clamp_min(torch.finfo(dtype).tiny)

    def _first_layer(self, dtype) -> tuple:
        return self.mlp[0].weight[:, 0].to(dtype), self.mlp[0].bias.to(dtype)          # [hidden], [hidden]

    def bias_inputs(self, q_len: int, k_len: int, device) -> tuple:
        """Every number ``pair_bias`` reads, as its own ``[H]`` tensor made here, outside the ``score_mod``:
        ``|c|``, ``L``, the output bias, then per hidden unit the first layer's weight and bias and the
        output layer's weight. FlexAttention's backward gives a ``score_mod``'s tensor a gradient only
        through one index by a per-logit tensor: a view (``w[..., unit]``) or an operation on a parameter
        inside the ``score_mod`` failed to lower ("Buffers cannot be created while lowering a pointwise
        subgraph", CUDA, torch 2.11; the same on the CPU, torch 2.13)."""
        heads = self.num_heads
        w1, b1 = self.mlp[0].weight[:, 0], self.mlp[0].bias                             # [hidden] each
        w2, b2 = self.mlp[2].weight, self.mlp[2].bias                                   # [H, hidden], [H]
        units = [t for unit in range(self.hidden_dim)
                 for t in (w1[unit].expand(heads), b1[unit].expand(heads), w2[:, unit])]
        # copies, not views: torch.compile would rebuild a view of a parameter inside its graph, and
        # inductor's CPU kernel reads only tensors that come from outside it
        return tuple(t.clone() for t in (self.c.abs().expand(heads), self.L.expand(heads), b2, *units))   # [H] each

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor, c: Tensor, threshold: Tensor, b2: Tensor,
                  *units: Tensor) -> Tensor:
        """``f_h(u)``, the MLP written out over its hidden units from ``bias_inputs``: pointwise operations
        only (inductor lowers no reduction inside a FlexAttention ``score_mod``), each tensor indexed once,
        by the head, before its cast."""
        dtype = _compute_dtype(self.c.dtype)
        u = self._inputs(pos_q, pos_k, c[head].to(dtype), threshold[head].to(dtype))
        out = b2[head].to(dtype)
        for unit in range(self.hidden_dim):
            w1, b1, w2 = (t[head].to(dtype) for t in units[3 * unit: 3 * unit + 3])
            out = out + w2 * torch.relu(u * w1 + b1)
        return out

    def dense_bias(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """``pair_bias`` on the pair grid, the MLP as two matmuls: [(B, 1..,) H, Nq, Nk]."""
        u = self._inputs(pos_q.unsqueeze(-1), pos_k.unsqueeze(-2))                      # [(B, 1.., 1,) Nq, Nk]
        if u.dim() > 2:
            u = u.squeeze(-3)                                                           # drop the head slot
        w1, b1 = self._first_layer(u.dtype)
        hidden = torch.relu(u.unsqueeze(-1) * w1 + b1)                                  # [..., Nq, Nk, hidden]
        w2, b2 = self.mlp[2].weight.to(u.dtype), self.mlp[2].bias.to(u.dtype)          # [H, hidden], [H]
        return torch.movedim(torch.matmul(hidden, w2.T) + b2, -1, -3)                   # [..., H, Nq, Nk]


def _distinct_rows(rows: Tensor) -> tuple:
    """Each distinct row of ``rows`` ``[M, A]`` once, and the position of every row among them:
    ``([U, A], [M])``. Integer rows whose bounding box holds at most ``M`` points enumerate the box
    (no sort: relative offsets on a grid, or the ``Nq + Nk - 1`` distances of a sequence); other
    integer rows are sorted as one int64 key each; float rows are sorted as they are."""
    if not rows.is_floating_point():
        low = rows.amin(0)                                                               # [A]
        extent = rows.amax(0) - low + 1                                                  # [A]
        sizes = extent.tolist()
        if math.prod(sizes) < 2 ** 62:
            strides = torch.tensor([math.prod(sizes[a + 1:]) for a in range(len(sizes))], device=rows.device)
            key = ((rows - low) * strides).sum(-1)                                       # [M] mixed-radix index
            if math.prod(sizes) <= rows.shape[0]:
                keys, inverse = torch.arange(math.prod(sizes), device=rows.device), key  # the whole box
            else:
                keys, inverse = torch.unique(key, return_inverse=True)
            return keys[:, None] // strides % extent + low, inverse                      # [U, A], [M]
    if rows.shape[1] == 1:
        distinct, inverse = torch.unique(rows[:, 0], return_inverse=True)
        return distinct[:, None], inverse
    return torch.unique(rows, dim=0, return_inverse=True)


class _GammaLayerNorm(nn.Module):
    """LayerNorm without a bias whose scale is named ``gamma`` (x-transformers' ``LayerNorm``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gamma)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.gamma.shape, eps=1e-5) * self.gamma.to(x.dtype)


def _signed_log1p(x: Tensor) -> Tensor:
    """``sign(x) log(1 + |x|)`` with slope 1 at 0. Each branch reads ``x`` through a ``where``, whose
    gradient is exact on every torch (``clamp(min=0)``'s gradient at 0 is 1 before torch 2.15, 0 from it)."""
    positive = x >= 0
    return torch.where(positive, torch.log1p(torch.where(positive, x, 0.0)), -torch.log1p(torch.where(positive, 0.0, -x)))


class DynamicPositionBias(_PairwiseBias):
    """Dynamic position bias: an MLP from relative positions to per-head biases.

    Wang et al., "CrossFormer: A Versatile Vision Transformer Hinging on Cross-scale Attention",
    arXiv:2108.00154; the layout of lucidrains' x-transformers ``DynamicPositionBias``. The MLP is
    ``Linear(A, hidden_dim)``, [bias-free LayerNorm], SiLU, then ``depth - 1`` times
    ``Linear(hidden_dim, hidden_dim)``, [LayerNorm], SiLU, then ``Linear(hidden_dim, H)``, applied
    to the query minus key offset ``pos_q - pos_k`` (``sign(x) log(1 + |x|)`` of it with
    ``log_distance=True``). ``forward`` also takes the positions positionally:
    ``forward(q_len, k_len, positions_q, positions_k)``.

    Parameters are ``mlp.0.0`` (first Linear), ``mlp.0.1.gamma`` (its norm's scale, ``norm=True``),
    ``mlp.d.*`` for the hidden blocks and ``mlp.{depth}`` (output Linear): exactly
    x-transformers' names, so ``load_state_dict(x_transformers_dpb.state_dict())`` works for
    ``DynamicPositionBias(heads, hidden_dim=dim, depth=depth, log_distance=..., norm=...)``.
    (CrossFormer's own module, ReLU and a narrower first layer, is not this layout.)

    1-D (``num_axes=1``): default positions evaluate the MLP once per distinct distance
    (``Nq + Nk - 1`` rows) and expand them Toeplitz-wise; explicit positions (integer or float)
    evaluate each distinct distance once and gather. ``num_axes = A > 1`` takes positions
    ``[N, A]`` (e.g. patch ``(row, col)``; required) and evaluates each distinct offset vector once.
    Translation invariant in every axis. The MLP runs in float32 (float64 for float64 modules).

    Args:
        num_heads (int): heads ``H``.
        num_axes (int): position axes ``A``. Default: 1.
        hidden_dim (int): MLP width (x-transformers' ``dim``). Default: 64.
        depth (int): hidden blocks, >= 1. Default: 2.
        log_distance (bool): feed ``sign(x) log(1 + |x|)``. Default: False.
        norm (bool): LayerNorm after each hidden Linear (x-transformers' ``norm``). Default: False.

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32
          (``[B, H, Nq, Nk]`` for ``[B, N(, A)]`` positions).

    Example:
        >>> dpb = DynamicPositionBias(8, log_distance=True)
        >>> dpb(128, 128).shape
        torch.Size([8, 128, 128])
        >>> grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).reshape(16, 2)
        >>> DynamicPositionBias(8, num_axes=2)(16, 16, grid, grid).shape
        torch.Size([8, 16, 16])
    """

    distance_only = translation_invariant = True
    pointwise = False   # an MLP per distinct offset: score_mod reads the dense bias
    arguments = {"depth": _check_positive_int, "log_distance": _check_flag, "norm": _check_flag}

    def __init__(self, num_heads: int, *, num_axes: int = 1, hidden_dim: int = 64, depth: int = 2,
                 log_distance: bool = False, norm: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_axes, self.hidden_dim, self.depth = num_heads, num_axes, hidden_dim, depth
        self.log_distance, self.norm = log_distance, norm

        def block(width_in: int, norm_layer) -> nn.Sequential:
            norms = [norm_layer(hidden_dim)] if norm else []
            return nn.Sequential(_uninitialised(nn.Linear, width_in, hidden_dim), *norms, nn.SiLU())

        # x-transformers normalises the first block without a bias (its own LayerNorm), the others with nn.LayerNorm
        hidden = [block(hidden_dim, nn.LayerNorm) for _ in range(depth - 1)]
        self.mlp = nn.ModuleList([block(num_axes, _GammaLayerNorm), *hidden,
                                  _uninitialised(nn.Linear, hidden_dim, num_heads)])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.mlp.modules():
            if isinstance(layer, (nn.Linear, nn.LayerNorm, _GammaLayerNorm)):
                layer.reset_parameters()

    def _values(self, offsets: Tensor) -> Tensor:
        """MLP of query - key offsets ``[..., A]`` -> ``[..., H]``, once per distinct offset (eager)."""
        dtype = _compute_dtype(self.mlp[-1].weight.dtype)
        flat, inverse = offsets.reshape(-1, self.num_axes), None                        # [M, A]
        # traced code (no data-dependent shapes) and offsets that require grad (torch.unique has no
        # backward, and each pair's gradient must reach its own positions) evaluate every row
        if not _is_compiling() and not flat.requires_grad and flat.shape[0] > 1:
            flat, inverse = _distinct_rows(flat)                                         # [U, A], [M]
        x = flat.to(dtype)
        if self.log_distance:  # sign(x) log(1 + |x|), written so its slope at 0 is 1 (sign's would give 0)
            x = _signed_log1p(x)
        values = _run_mlp(self.mlp, x)                                                   # [U, H]
        if inverse is not None:
            values = values[inverse]                                                     # [M, H]
        return values.reshape(*offsets.shape[:-1], self.num_heads)

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor) -> Tensor:
        offsets = pos_q - pos_k                                                         # query - key
        return self._per_head(self._values(offsets if self.num_axes > 1 else offsets.unsqueeze(-1)), head)

    def bias_at(self, distance: Tensor, head: Tensor) -> Tensor:
        return self._per_head(self._values(-distance.unsqueeze(-1)), head)

    def _per_head(self, values: Tensor, head: Tensor) -> Tensor:
        """values ``[*S, H]``, head broadcasting with ``S`` -> the value of each element's head."""
        index = head + torch.zeros(values.shape[:-1], dtype=head.dtype, device=head.device)   # broadcast
        return values.expand(*index.shape, self.num_heads).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _window_relative_index(window_size: tuple, num_prefix_tokens: int, device=None) -> Tensor:
    """Swin's table row of every (query, key) pair of a window, BEiT's three rows for a prefix token.

    Token ``t`` of the window (row-major) sits at ``(t // Ww, t % Ww)``; the pair (query ``i``,
    key ``j``) reads row ``(r_i - r_j + Wh - 1) * (2 Ww - 1) + (c_i - c_j + Ww - 1)``. With a
    prefix token (index 0, the rest shifted by one), the query-prefix row reads ``R`` (cls to
    token), the key-prefix column ``R + 1`` (token to cls) and the corner ``R + 2`` (cls to cls),
    ``R = (2 Wh - 1)(2 Ww - 1)``, in BEiT's order. Returns int64 ``[T, T]``, ``T = Wh Ww + P``.
    """
    height, width = window_size
    tokens = torch.arange(height * width, device=device)
    rows, cols = tokens // width, tokens % width                                        # [Wh Ww] each
    index = ((rows[:, None] - rows[None, :] + height - 1) * (2 * width - 1)
             + cols[:, None] - cols[None, :] + width - 1)                                # [Wh Ww, Wh Ww]
    if num_prefix_tokens:
        num_relative = (2 * height - 1) * (2 * width - 1)
        index = F.pad(index, (1, 0, 1, 0))                                              # [T, T]
        index[0, :], index[:, 0], index[0, 0] = num_relative, num_relative + 1, num_relative + 2
    return index


def _unhead(positions: Tensor, num_axes: int = 1) -> Tensor:
    """Batched positions ``[B, 1, .., 1, N(, A)]`` lose the head's singleton: ``[B, 1.., N(, A)]``."""
    batched = positions.dim() > (1 if num_axes == 1 else 2)
    return positions.squeeze(-2 if num_axes == 1 else -3) if batched else positions


class _WindowBias(_PairwiseBias):
    """A bias over the tokens of one attention window, read from a per-head table ``[R, H]``
    through ``relative_position_index`` ``[T, T]`` (Swin's layout; BEiT's with a prefix token).

    Positions are token indices into the window, ``0 .. T - 1``: the prefix token(s) first, then
    the window's patches in row-major order (``t -> ((t - P) // Ww, (t - P) % Ww)``). Default
    positions are ``arange(Nk)`` for keys and the last ``Nq`` of them for queries, so a full
    window is ``forward(T, T)``; a shorter call is the tail of the window (a KV-cache step), and
    more than ``T`` tokens is an error. Subclasses give ``table() -> [R, H]``.
    """

    integer_positions = True   # token indices into the window

    arguments = {"window_size": _check_window,
                 "num_prefix_tokens": functools.partial(_as_int, minimum=0)}

    def _init_window(self, num_heads: int, window_size: tuple, num_prefix_tokens: int) -> None:
        self.window_size = window_size
        if num_prefix_tokens > 1:
            raise ValueError(f"{type(self).__name__}: num_prefix_tokens must be 0 or 1 (BEiT's [CLS] token), "
                             f"got num_prefix_tokens={num_prefix_tokens!r}")
        self.num_heads, self.num_prefix_tokens = num_heads, num_prefix_tokens

    @property
    def num_tokens(self) -> int:
        """``T``: the window's patches plus the prefix tokens."""
        return self.window_size[0] * self.window_size[1] + self.num_prefix_tokens

    @property
    def num_relative_positions(self) -> int:
        """``R``: table rows for the ``(2 Wh - 1)(2 Ww - 1)`` offsets, plus 3 with a prefix token."""
        return (2 * self.window_size[0] - 1) * (2 * self.window_size[1] - 1) + 3 * self.num_prefix_tokens

    def table(self) -> Tensor:
        """The per-head value of every table row ``[R, H]``, in any float dtype (``pair_bias`` casts the rows
        it reads to the compute dtype: a learned table is then indexed before its cast, which
        FlexAttention's backward needs)."""
        raise NotImplementedError

    def _init_buffers(self, device) -> None:
        index = _window_relative_index(self.window_size, self.num_prefix_tokens, device)
        self.register_buffer("relative_position_index", index, persistent=False)        # [T, T]

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor) -> Tensor:
        table = self.table()
        return table[self.relative_position_index[pos_q, pos_k], head].to(_compute_dtype(table.dtype))

    def _positions(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                   device) -> tuple:
        """Token indices of queries and keys, checked against the window."""
        owner, tokens = type(self).__name__, self.num_tokens
        window = f"the window's {tokens} tokens ({self.window_size[0]}x{self.window_size[1]}" + (
            f" + {self.num_prefix_tokens} prefix)" if self.num_prefix_tokens else ")")
        if (positions_q is None and max(q_len, k_len) > tokens) or (positions_k is None and k_len > tokens):
            raise ValueError(f"{owner}: q_len and k_len must be at most {window}, got q_len={q_len}, "
                             f"k_len={k_len} (pass positions_q/positions_k as token indices for other layouts)")
        for name, positions in (("positions_q", positions_q), ("positions_k", positions_k)):
            if positions is None or _skip_value_checks(positions) or positions.numel() == 0:
                continue
            low, high = int(positions.min()), int(positions.max())
            if low < 0 or high >= tokens:
                raise ValueError(f"{owner}: {name} must be token indices in [0, {tokens}) ({window}), "
                                 f"got {low if low < 0 else high}")
        return super()._positions(q_len, k_len, positions_q, positions_k, device)


def _beit_offsets(src: int, dst: int) -> list:
    """BEiT's source grid for resizing a table axis of ``src`` rows to ``dst`` (unilm's
    ``run_class_finetuning.py``, as timm's ``resize_rel_pos_bias_table``): offsets
    ``0, +-1, +-(1 + r), +-(1 + r + r^2), ...`` whose ratio ``r`` in (1.01, 1.5) is found by
    bisection so that the outermost lands near ``dst // 2`` (the targets sit at the integers)."""
    left, right = 1.01, 1.5
    while right - left > 1e-6:
        ratio = (left + right) / 2.0
        if (1.0 - ratio ** (src // 2)) / (1.0 - ratio) > dst // 2:
            right = ratio
        else:
            left = ratio
    offsets, current = [], 1.0
    for i in range(src // 2):
        offsets.append(current)
        current += ratio ** (i + 1)
    return [-o for o in reversed(offsets)] + [0.0] + offsets


def _linear_weights(source: Tensor, target: Tensor) -> Tensor:
    """Piecewise-linear interpolation from increasing ``source`` points to ``target`` points,
    clamped to the end values outside: the matrix ``[len(target), len(source)]``."""
    right = torch.searchsorted(source, target).clamp(max=len(source) - 1)
    left = (right - 1).clamp(min=0)
    to_left, to_right = (target - source[left]).clamp(min=0), (source[right] - target).clamp(min=0)
    span = to_left + to_right
    on_point = span == 0                       # at (or beyond) an end point: all weight on it
    weight_right = torch.where(on_point, 0.5, to_left / span.where(~on_point, 1.0))
    weights = torch.zeros(len(target), len(source), dtype=source.dtype)
    rows = torch.arange(len(target))
    weights.index_put_((rows, left), 1.0 - weight_right, accumulate=True)
    weights.index_put_((rows, right), weight_right, accumulate=True)
    return weights


class RelativePositionBias2D(_WindowBias):
    """Swin's and BEiT's learned 2-D relative position bias over an attention window.

    Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows",
    arXiv:2103.14030; Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
    arXiv:2106.08254. Every offset ``(dr, dc)`` between two of the window's ``Wh x Ww`` patches
    has a learned per-head value, row ``(dr + Wh - 1)(2 Ww - 1) + dc + Ww - 1`` of
    ``relative_position_bias_table`` (``dr = r_query - r_key``): the parameter name, shape and
    ``relative_position_index`` (a non-persistent buffer, ``[T, T]``) of the official code, timm's
    ``RelPosBias`` and transformers' ``SwinRelativePositionBias`` / ``BeitRelativePositionBias``,
    so their checkpoints load by copying the table. With ``num_prefix_tokens=1`` (BEiT's
    ``[CLS]``, token 0) three more rows hold cls->token, token->cls and cls->cls, in BEiT's order.

    Positions are token indices into the window (``0 .. T - 1``, ``T = Wh Ww + P``): prefix
    first, then the patches row-major. ``forward(T, T)`` is the whole window; fewer tokens are
    the window's last ones (bottom-right, as everywhere here) and more is a ``ValueError``. Pass
    ``positions_q`` / ``positions_k`` to select other tokens (e.g. the window's patches without
    the ``[CLS]``, or a masked subset in MAE-style training).

    ``resize(new_window_size)`` resamples the table for a new window as timm's
    ``resize_rel_pos_bias_table`` does (BEiT's geometric source grid with piecewise-linear
    interpolation), or with ``interpolation="bicubic"`` as its ``resize_rel_pos_bias_table_simple``;
    the prefix rows are kept.

    Args:
        num_heads (int): heads ``H``.
        window_size (int or (int, int)): window ``(Wh, Ww)``; an int is square.
        num_prefix_tokens (int): 0, or 1 for a ``[CLS]`` token at index 0. Default: 0.
        init_std (float): std of the truncated-normal init (Swin's). Default: 0.02.

    Shape:
        - ``relative_position_bias_table``: ``[(2 Wh - 1)(2 Ww - 1) (+ 3), H]``.
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32, ``Nq, Nk <= T``
          (``[B, H, Nq, Nk]`` for ``[B, N]`` positions).

    Example:
        >>> bias = RelativePositionBias2D(4, (7, 7))
        >>> q = k = v = torch.randn(64, 4, 49, 32)            # 64 windows of 7 x 7 patches
        >>> attention(q, k, v, bias).shape
        torch.Size([64, 4, 49, 32])
    """

    def __init__(self, num_heads: int, window_size: Union[int, tuple], *, num_prefix_tokens: int = 0,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self._init_window(num_heads, window_size, num_prefix_tokens)
        self.init_std = init_std
        table = torch.empty(self.num_relative_positions, self.num_heads)
        self.relative_position_bias_table = nn.Parameter(table)                        # [R, H]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.relative_position_bias_table, std=self.init_std)
        self._init_buffers(self.relative_position_bias_table.device)

    def table(self) -> Tensor:
        return self.relative_position_bias_table

    @torch.no_grad()
    def resize(self, new_window_size: Union[int, tuple], *,
               interpolation: Literal["geometric", "bicubic"] = "geometric") -> "RelativePositionBias2D":
        """Resample the table for a window of ``new_window_size``, in place; returns ``self``.

        ``"geometric"`` (timm's ``resize_rel_pos_bias_table``, from BEiT's fine-tuning code):
        per axis, the ``2 W - 1`` old rows are placed at geometrically spreading offsets (BEiT's
        ``_beit_offsets``) and read at the new integer offsets by piecewise-linear
        interpolation, clamped at the ends. ``"bicubic"``: ``F.interpolate(mode="bicubic",
        align_corners=False)`` of the ``[2 Wh - 1, 2 Ww - 1]`` grid (timm's
        ``resize_rel_pos_bias_table_simple``). Computed in float64; the prefix rows are kept.
        """
        new = _check_window(type(self).__name__, "new_window_size", new_window_size)
        if interpolation not in ("geometric", "bicubic"):
            raise ValueError(f"{type(self).__name__}: interpolation must be 'geometric' or 'bicubic', got "
                             f"{interpolation!r}")
        weight = self.relative_position_bias_table
        old_rows = tuple(2 * s - 1 for s in self.window_size)
        new_rows = tuple(2 * s - 1 for s in new)
        if new_rows != old_rows:
            offsets = weight[: old_rows[0] * old_rows[1]].double()                      # [(2Wh-1)(2Ww-1), H]
            table = offsets.T.reshape(self.num_heads, *old_rows)                        # [H, 2Wh-1, 2Ww-1]
            if interpolation == "bicubic":
                grid = F.interpolate(table[None], size=new_rows, mode="bicubic", align_corners=False)[0]
            else:  # separable: bilinear on a rectilinear grid is a product of 1-D linear weights
                axis = lambda src, dst: _linear_weights(
                    torch.tensor(_beit_offsets(src, dst), dtype=torch.float64),
                    torch.arange(-(dst // 2), dst // 2 + 1, dtype=torch.float64))    # [dst, src]
                rows_y, rows_x = axis(old_rows[0], new_rows[0]), axis(old_rows[1], new_rows[1])
                grid = rows_y.to(table.device) @ table @ rows_x.to(table.device).T     # [H, 2Wh'-1, 2Ww'-1]
            table = torch.cat([grid.reshape(self.num_heads, -1).T,
                               weight[old_rows[0] * old_rows[1]:].double()])           # [R', H]
            self.relative_position_bias_table = nn.Parameter(table.to(weight.dtype), requires_grad=weight.requires_grad)
        self.window_size = new
        self._init_buffers(self.relative_position_bias_table.device)
        return self


class ContinuousPositionBias(_WindowBias):
    """Swin-v2's log-spaced continuous position bias (Liu et al., "Swin Transformer V2: Scaling
    Up Capacity and Resolution", arXiv:2111.09883).

    A small MLP (``cpb_mlp``: ``Linear(2, hidden_dim)``, ReLU, ``Linear(hidden_dim, H,
    bias=False)``) maps each window offset ``(dr, dc)`` (query minus key) to a per-head value.
    Offsets are divided by ``pretrained_window_size - 1`` (default: the window's), times 8, then
    log-spaced ``sign(x) log2(1 + |x|) / log2(8)``; the bias is ``16 sigmoid(MLP(.))``. Indexing
    is Swin's (see ``RelativePositionBias2D``; positions are token indices into the window).

    Submodules follow the official code and timm (``cpb_mlp.0``, ``cpb_mlp.2``); transformers'
    Swinv2 names the same MLP ``continuous_position_bias_mlp``: such keys are renamed when a
    state dict is loaded, so a ``Swinv2SelfAttention`` state loads unchanged
    (``load_state_dict(..., strict=False)`` for its other tensors). Only the bias term: Swin-v2's
    cosine attention with the learned ``logit_scale`` belongs to the attention (normalise q and
    k, multiply q by the per-head scale, then ``attention(..., scale=1.0)``).

    The coordinates are computed in float64 and the MLP in float32 (float64 for a float64
    module), so a ``.bfloat16()`` module still gives a float32 bias of its rounded weights.
    ``resize(new_window_size)`` moves to a larger window the Swin-v2 way: the MLP is kept and,
    unless ``pretrained_window_size`` is set, the old window becomes it (so offsets keep their
    trained scale). An axis of size 1 has only offset 0 and is not divided (transformers skips
    the division for both axes when the first has size 1; the official code divides by zero).

    Args:
        num_heads (int): heads ``H``.
        window_size (int or (int, int)): window ``(Wh, Ww)``.
        hidden_dim (int): MLP width. Default: 512.
        pretrained_window_size (int or (int, int), optional): the window the offsets are
            normalised by. Default: None (the window itself).

    Shape:
        - Output of ``forward(q_len, k_len)``: ``[H, Nq, Nk]`` float32, values in ``(0, 16)``.

    Example:
        >>> cpb = ContinuousPositionBias(4, 8, pretrained_window_size=8).resize(16)
        >>> cpb(256, 256).shape
        torch.Size([4, 256, 256])
    """

    pointwise = False   # its table is an MLP's output: score_mod reads the dense bias
    arguments = {"pretrained_window_size": _check_window}

    def __init__(self, num_heads: int, window_size: Union[int, tuple], *, hidden_dim: int = 512,
                 pretrained_window_size: Optional[Union[int, tuple]] = None) -> None:
        super().__init__()
        self._init_window(num_heads, window_size, 0)
        self.pretrained_window_size, self.hidden_dim = pretrained_window_size, hidden_dim
        self.cpb_mlp = nn.Sequential(_uninitialised(nn.Linear, 2, hidden_dim), nn.ReLU(),  # official/timm name
                                     _uninitialised(nn.Linear, hidden_dim, self.num_heads, bias=False))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.cpb_mlp[0], self.cpb_mlp[2]):
            layer.reset_parameters()
        self._init_buffers(self.cpb_mlp[0].weight.device)

    def _init_buffers(self, device) -> None:
        super()._init_buffers(device)
        height, width = self.window_size
        scale = self.pretrained_window_size or self.window_size
        offsets = lambda size, norm: torch.arange(1 - size, size, dtype=torch.float64, device=device) / max(norm - 1, 1)
        grid = torch.stack(torch.meshgrid(offsets(height, scale[0]), offsets(width, scale[1]), indexing="ij"), -1)
        grid = grid.reshape(-1, 2) * 8                                                   # [R, 2], in [-8, 8]
        coords = torch.sign(grid) * torch.log2(grid.abs() + 1) / math.log2(8)
        self.register_buffer("relative_coords_table", coords, persistent=False)         # [R, 2] float64

    def table(self) -> Tensor:
        dtype = _compute_dtype(self.cpb_mlp[0].weight.dtype)
        return 16 * torch.sigmoid(_run_mlp(self.cpb_mlp, self.relative_coords_table.to(dtype)))   # [R, H]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # transformers' Swinv2 calls the MLP continuous_position_bias_mlp: same layers, same indices
        old = prefix + "continuous_position_bias_mlp."
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[prefix + "cpb_mlp." + key[len(old):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def resize(self, new_window_size: Union[int, tuple]) -> "ContinuousPositionBias":
        """Use the MLP on a new window, in place (Swin-v2's transfer); returns ``self``.

        Without an explicit ``pretrained_window_size`` the current window becomes it.
        """
        new = _check_window(type(self).__name__, "new_window_size", new_window_size)
        self.pretrained_window_size = self.pretrained_window_size or self.window_size
        self.window_size = new
        self._init_buffers(self.cpb_mlp[0].weight.device)
        return self


def _bound_rows(batch: Optional[int], stride: int, q_len: int, k_len: int, device, first: int = 0) -> tuple:
    """The positions of a bound encoding's pairs: token ``i`` of batch row ``b`` is row ``b * stride + i - first``
    of its flattened tables; keys are the first ``Nk`` tokens and queries the last ``Nq`` of those (a pair's
    difference is its distance). ``[B, 1, Nq]`` and ``[B, 1, Nk]`` (a slot for the heads), or ``[Nq]`` and
    ``[Nk]`` for ``batch=None`` (shared)."""
    keys = torch.arange(k_len, device=device) - first                                   # [Nk]
    if batch is not None:
        keys = torch.arange(batch, device=device)[:, None, None] * stride + keys       # [B, 1, Nk]
    return keys[..., k_len - q_len:], keys


class _BoundTokens(PositionalEmbedding):
    """An encoding that reads the token states: ``pe(x)`` binds them and returns the bound encoding.

    A subclass declares ``bound_inputs`` (the buffers a bound encoding holds: the token states
    first, then any precomputed alternative) and writes ``bind``. This base owns the rest:
    ``pe(x)`` is ``pe.bind(x)``, an unbound encoding says how to bind it, and every call is
    checked against the bound timeline: keys are the bound tokens (a call with ``Nk`` keys uses
    the first ``Nk``, never more than bound), the ``Nq`` queries are the last ``Nq`` keys
    (bottom-right), and q's batch is the bound batch (or the bound batch is 1, shared).
    """

    takes_positions = False
    is_causal = True    # a token's encoding reads the tokens before it: keys after the query get -inf
    token_axis: dict = {}   # bound input -> its token dim, where not -2 ([B, H, N] scalars: -1)
    bound_offset: int = 0   # the token index of the first bound token (Inkling binds new tokens at an offset)

    def forward(self, *args, **kwargs):
        """``pe(x)`` with token states ``x`` alone: ``pe.bind(x)``; every other call is the kind's own."""
        if len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            return self.bind(args[0])
        return super().forward(*args, **kwargs)

    def bind(self, x: Tensor) -> "_BoundTokens":
        raise NotImplementedError

    def _check_states(self, x: Tensor) -> Tensor:
        """Token states to bind: ``[B, N, D]``, floating."""
        if self.dim is None:
            raise ValueError(f"{type(self).__name__}: built with dim=None, without projections: it binds "
                             f"precomputed inputs only (see bind), got token states x")
        _check_tensor(type(self).__name__, "x", x, 3)
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}: x must be [B, N, D={self.dim}], got {tuple(x.shape)}")
        return x

    def _unbound(self):
        if self.dim is None:
            raise ValueError(f"{type(self).__name__}: not bound: built with dim=None, it binds precomputed "
                             f"inputs (see bind) and attends with the result")
        raise ValueError(f"{type(self).__name__}: not bound to token states: the encoding depends on them, "
                         f"so call pe(x) with the tokens x [B, N, D={self.dim}] and use the result, "
                         f"e.g. attention(q, k, v, pe(x), causal=True)")

    def _check_lengths(self, q_len: int, k_len: int, q_shape: Optional[tuple] = None) -> None:
        name, bound = self._bound_input() or self._unbound()
        first = self.bound_offset
        since = f" from token {first}" if first else ""
        if k_len > first + bound.shape[self.token_axis.get(name, -2)]:
            raise ValueError(f"{type(self).__name__}: k has more tokens than the bound encoding: keys are the "
                             f"bound tokens, got Nk={k_len} for {list(bound.shape)} bound{since}")
        if q_len > k_len:
            raise ValueError(f"{type(self).__name__}: q must not have more tokens than k (queries are the last "
                             f"Nq keys), got Nq={q_len} and Nk={k_len}")
        if k_len - q_len < first:
            raise ValueError(f"{type(self).__name__}: the queries (tokens {k_len - q_len} .. {k_len - 1}, the last "
                             f"Nq={q_len} of Nk={k_len}) must be bound, got tokens {first} .. "
                             f"{first + bound.shape[self.token_axis.get(name, -2)] - 1} bound")
        if q_shape is not None and bound.shape[0] not in (1, q_shape[0]):
            raise ValueError(f"{type(self).__name__}: q and k must have the bound batch size {bound.shape[0]} "
                             f"(or the encoding batch 1), got q {q_shape}")

    def _check_qk(self, q, k, positions_q, positions_k, grouped=False):
        super()._check_qk(q, k, positions_q, positions_k, grouped)
        if q.dim() != 4:
            raise ValueError(f"{type(self).__name__}: q and k must be [B, H, N, Dh], got q {tuple(q.shape)}")
        self._check_lengths(q.shape[-2], k.shape[-2], tuple(q.shape))
        return None, None


def _check_gate_projection(owner: str, arguments: dict) -> None:
    """A given forget-gate projection maps the ``dim`` token channels to ``num_heads`` gates."""
    dim, heads, linear = arguments["dim"], arguments["num_heads"], arguments["fgate_proj"]
    if linear is not None and (not isinstance(linear, nn.Linear) or (linear.in_features, linear.out_features)
                               != (dim, heads)):
        raise ValueError(f"{owner}: fgate_proj must be an nn.Linear({dim}, {heads}), got {linear!r}")


class ForgettingPositionalEmbedding(_BoundTokens, _PairwiseBias):
    """The Forgetting Transformer's forget gate (Lin et al., arXiv:2503.02130).

    Forgetting Attention adds a data-dependent decay to softmax attention: each token ``l``
    has a forget gate per head ``f_l = sigmoid(w_h . x_l + b_h)`` (``fgate_proj``, an
    ``nn.Linear(dim, num_heads)`` named as in the authors' code), and query ``i`` sees key
    ``j <= i`` with the bias ``D_ij = sum_{l=j+1..i} log f_l = c_i - c_j``, ``c`` the
    cumulative sum of ``log f``. It is causal (``is_causal``): the bias holds ``-inf`` after the
    query, and ``attention()`` masks causally by default and rejects ``causal=False``. No positions: order is
    what the gates accumulate (FoX uses no other positional encoding).

    The gates depend on the token states, so this module binds them first:
    ``fox(x)`` returns a bound encoding (the same class, sharing ``fgate_proj``) of kind
    ``"bias"``, and ``attention(q, k, v, fox(x), causal=True)`` is the whole use. Its
    ``attention_bias`` is the batched ``[B, H, Nq, Nk]`` bias and its ``score_mod`` works with
    FlexAttention; the gates are recomputed from ``x`` on every use, so gradients reach
    ``fgate_proj`` and ``x`` and a later ``load_state_dict`` is seen. The unbound module has no
    bias (``forward_attn`` raises). ``fox.bind(log_forget=...)`` binds precomputed log
    forget values ``[B, H, N]`` instead (a decoding cache that keeps them, as the authors'
    ``FgateDynamicCache`` does).

    Alignment: the bound tokens are the keys' timeline: key ``j`` is token ``j``, a call with
    ``Nk`` keys uses the first ``Nk`` bound tokens (never more than bound), and the ``Nq``
    queries are the last ``Nq`` of the keys (bottom-right). Decoding with a KV cache: bind the
    states (or log forget values) of every token so far, cached and new.

    Precision: ``c`` is summed in float64 and split into two float32 parts ``hi + lo``;
    ``D_ij = (hi_i - hi_j) + (lo_i - lo_j)`` is then accurate relative to ``D_ij`` itself,
    whereas a float32 ``cumsum`` loses ``eps * |c_i|`` (0.01 after a million tokens of
    ``log f ~ -1``). Gates are computed in float32 (float64 for float64 weights or states).

    Args:
        dim (int or None): token width ``D``; None: no ``fgate_proj``, for ``bind(log_forget=...)`` only.
        num_heads (int): heads ``H``.
        fgate_proj (nn.Linear, optional): an existing ``nn.Linear(dim, num_heads)`` to use,
            held by reference and never re-initialised by the constructor. Default: a new one,
            initialised as the authors' (weight ``N(0, init_std)``, bias 0).
        init_std (float): std of the weight's normal init. Default: 0.02 (the authors').

    Shape:
        - x: ``[B, N, D]``; log forget values: ``[B, H, N]`` float32; bias
          ``[B, H, Nq, Nk]`` with ``Nq <= Nk <= N``. A batch of 1 is shared by every batch row.

    Example:
        >>> fox = ForgettingPositionalEmbedding(512, 8)
        >>> x = torch.randn(2, 128, 512)
        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> attention(q, k, v, fox(x), causal=True).shape
        torch.Size([2, 8, 128, 64])
    """

    order_from = "order comes from the forget gates of the bound tokens"
    bound_inputs = ("states", "log_forget_values")   # bound x [B, N, D] or log f [B, H, N]
    token_axis = {"log_forget_values": -1}

    arguments = {"dim": _optional_size}
    argument_rules = (_check_gate_projection,)

    def __init__(self, dim: Optional[int], num_heads: int, *, fgate_proj: Optional[nn.Linear] = None,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.dim, self.num_heads, self.init_std = dim, num_heads, init_std
        owns = fgate_proj is None and dim is not None
        self.fgate_proj = _uninitialised(nn.Linear, dim, num_heads) if owns else fgate_proj   # w_h, b_h (authors' name)
        self.register_buffer("states", None, persistent=False)                          # bound x: [B, N, D]
        self.register_buffer("log_forget_values", None, persistent=False)               # bound log f: [B, H, N]
        if owns:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.fgate_proj is None:   # dim=None: binds log forget values only
            return
        nn.init.normal_(self.fgate_proj.weight, std=self.init_std)
        if self.fgate_proj.bias is not None:
            nn.init.zeros_(self.fgate_proj.bias)

    # -- binding ------------------------------------------------------------------------

    def bind(self, x: Optional[Tensor] = None, *,
             log_forget: Optional[Tensor] = None) -> "ForgettingPositionalEmbedding":
        """A bound encoding: on token states ``x`` ``[B, N, D]``, or on log forget values ``[B, H, N]``."""
        if (x is None) == (log_forget is None):
            raise ValueError(f"{type(self).__name__}: bind takes exactly one of x and log_forget")
        if x is not None:
            return self._bound_copy(states=self._check_states(x))
        _check_tensor(type(self).__name__, "log_forget", log_forget, 3)
        if log_forget.dim() != 3 or log_forget.shape[1] != self.num_heads:
            raise ValueError(f"{type(self).__name__}: log_forget must be [B, H={self.num_heads}, N], "
                             f"got {tuple(log_forget.shape)}")
        return self._bound_copy(log_forget_values=log_forget)

    def _sibling(self) -> "ForgettingPositionalEmbedding":
        return type(self)(self.dim, self.num_heads, fgate_proj=self.fgate_proj, init_std=self.init_std)

    def log_forget(self, x: Optional[Tensor] = None) -> Tensor:
        """``log f = logsigmoid(fgate_proj(x))``: ``[B, N, D] -> [B, H, N]``, float32 (float64 for
        float64 states or weights). Without ``x``: the bound tokens' values."""
        if x is None and self.log_forget_values is not None:
            return self.log_forget_values.to(_compute_dtype(self.log_forget_values.dtype))
        if x is None:
            x = self.states if self.states is not None else self._unbound()
        _check_tensor(type(self).__name__, "x", x, 2)
        if x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}: x must be [..., N, D={self.dim}], got {tuple(x.shape)}")
        weight, bias = self.fgate_proj.weight, self.fgate_proj.bias
        dtype = torch.promote_types(_compute_dtype(x.dtype), _compute_dtype(weight.dtype))
        logits = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))   # [B, N, H]
        return F.logsigmoid(logits).transpose(-1, -2)                                   # [B, H, N]

    # -- the bias -----------------------------------------------------------------------

    def _cumulative(self, k_len: int) -> tuple:
        """``c = cumsum(log f)`` over the first ``k_len`` tokens as ``(hi, lo)``: [B, H, Nk] each."""
        log_f = self.log_forget()[..., :k_len]                                          # [B, H, Nk]
        if log_f.dtype == torch.float64:
            c = log_f.cumsum(-1)
            return c, torch.zeros_like(c)
        c = log_f.double().cumsum(-1)                                                   # exact enough: float64
        hi = c.float()
        return hi, (c - hi.double()).float()                                            # c = hi + lo

    def _positions(self, q_len: int, k_len: int, positions_q, positions_k, device) -> tuple:
        """Token ``i`` of batch row ``b`` is entry ``b Nk + i`` of the cumulative sums (``bias_inputs``)."""
        self._check_lengths(q_len, k_len)
        return _bound_rows(self._bound_input()[1].shape[0], k_len, q_len, k_len, device)

    def bias_inputs(self, q_len: int, k_len: int, device) -> tuple:
        """``(hi, lo)`` of ``c`` over the first ``k_len`` tokens, ``[H, B Nk]`` each, and their copies for the
        keys: FlexAttention's backward (CUDA, torch 2.11) takes one index per tensor that needs a gradient."""
        hi, lo = (part.to(device).transpose(0, 1).flatten(1) for part in self._cumulative(k_len))
        return hi, lo, hi.clone(), lo.clone()

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor, hi: Tensor, lo: Tensor, hi_k: Tensor,
                  lo_k: Tensor) -> Tensor:
        """``D_ij = c_i - c_j = (hi_i - hi_j) + (lo_i - lo_j)``, ``-inf`` after the query."""
        bias = (hi[head, pos_q] - hi_k[head, pos_k]) + (lo[head, pos_q] - lo_k[head, pos_k])
        return torch.where(pos_k > pos_q, float("-inf"), bias)


def _shape_of(value) -> Optional[tuple]:
    """A tensor's shape as a tuple, else None."""
    return tuple(value.shape) if isinstance(value, Tensor) else None


class InklingPositionalEmbedding(_BoundTokens, _PairwiseBias):
    """Relative logits mixed from a bank of distance profiles by the token states (Thinking Machines' Inkling).

    A learned bank of ``d_rel`` bias-versus-distance profiles ``P`` (``proj``, ``[d_rel, E]``)
    is mixed, per query token ``i`` and head ``h``, by that token's relative states
    ``r_ih = r_proj(x_i)`` (``[H, d_rel]``): query ``i`` sees key ``j`` with

        ``b_hij = r_ih . P[:, i - j]``  for ``0 <= i - j < E`` (``max_distance``), else 0,

    so each token chooses how it weighs every look-back distance. There is no paper. The
    definition is the code: transformers 5.24's ``InklingRelativeLogits`` (Inkling) and
    ``Inkling2RelativePositionBias`` (Inkling 2), and x-transformers'
    ``RelativeProjPositionalBias`` (``bias=True`` there). Keys after the query get 0, not
    ``-inf``: causality is the mask's, so pass ``causal=True`` for a decoder.

    Inkling 2 conditions the states:
    - ``clip_threshold`` (its ``rel_l2_clip_threshold``) learns a per-head scale ``scale``
      ``[H, d_rel]`` (init 1) and shortens each ``r_ih`` longer than the threshold to it:
      ``r <- r min(1, t / (|r| + 1e-6))``;
    - ``log_scaling_n_floor`` multiplies query ``i``'s bias by
      ``tau_i = 1 + alpha log(max(1, (i + 1) / n_floor))`` (``log_scaling_alpha``).

    Inkling's full-attention layers apply the same ``tau_i`` to the bias. They also scale the
    query by it, a temperature that stays with the caller.

    The states are the tokens' own, so the module binds them first, as the forget gate does:
    ``pe(x)`` returns a bound encoding of kind ``"bias"``, and
    ``attention(q, k, v, pe(x), causal=True)`` is the whole use.

    Alignment: the bound tokens are the keys' timeline (key ``j`` is token ``j``), and the
    ``Nq`` queries are the last ``Nq`` of the first ``Nk`` tokens. A position (the ``i`` in the
    distance and in ``tau_i``) is a token index, as Inkling's cache indices are. The bias reads
    the queries' states only, so a decoding step with a KV cache binds just the new tokens at
    their offset, ``pe.bind(x_new, offset=n_cached)``, and gives the full pass's last rows (keys
    are tokens ``0 .. Nk - 1``, the queries must lie among the bound tokens). Computed in float32
    (float64 for float64 states or weights).

    ``from_config(config, layer_type=...)`` reads a transformers Inkling or Inkling 2 config
    (``"hybrid"``: a full-attention layer; ``"hybrid_sliding"``: a sliding one). Inkling 2's released
    checkpoint (``thinkingmachines/Inkling-2-Small-MXFP8``) names layer ``i``'s weights
    ``model.llm.layers.{i}.`` + a key of ``checkpoint_names`` (the parameter it loads into):
    ``attn.wr_du.weight`` -> ``r_proj.weight``, ``attn.rel_logits_proj.proj`` -> ``proj``,
    ``attn.rel_l2_clip.scale`` -> ``scale``; transformers loads them as
    ``model.layers.{i}.self_attn.relative_position_bias.`` ``linear.weight``, ``proj``, ``norm.scale``.

    Args:
        dim (int): token width ``D``.
        num_heads (int): heads ``H``.
        d_rel (int): profiles in the bank (x-transformers' ``num_distance_basis``). Default: 16
            (Inkling's).
        max_distance (int): ``E``, the bank's extent (Inkling's ``rel_extent``, x-transformers'
            ``max_dist``). Default: 1024.
        bias (bool): ``r_proj`` has a bias (x-transformers: True; Inkling: False). Default: False.
        clip_threshold (float, optional): Inkling 2's L2 clip, with its learned scale. Default: None.
        log_scaling_n_floor (float, optional): the ``n_floor`` of ``tau_i``. Default: None (no scaling).
        log_scaling_alpha (float): the ``alpha`` of ``tau_i``. Default: 0.1 (Inkling's).
        init_std (float): std of the bank's normal init. Default: 0.02.
        layer (nn.Module, optional): an ``InklingPositionalEmbedding`` whose ``r_proj``, ``proj`` (and
            ``scale``) to use by reference, e.g. one bank for several layers. Default: None (own weights).

    Shape:
        - x: ``[B, N, D]``; bias ``[B, H, Nq, Nk]`` with ``Nq <= Nk <= N``. A batch of 1 is shared
          by every batch row.

    Example:
        >>> inkling = InklingPositionalEmbedding(512, 8, max_distance=256)
        >>> x = torch.randn(2, 128, 512)
        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> attention(q, k, v, inkling(x), causal=True).shape
        torch.Size([2, 8, 128, 64])
        >>> step = attention(q[..., -1:, :], k, v, inkling.bind(x[:, -1:], offset=127), causal=True)
    """

    order_from = "positions are the bound tokens' indices"
    is_causal = False   # the bias reads the query's own states: defined for every pair (0 after the query)
    bound_inputs = ("states",)   # bound x [B, N, D]
    # Inkling 2's checkpoint name (under model.llm.layers.{i}.) -> the parameter it loads into
    checkpoint_names = {"attn.wr_du.weight": "r_proj.weight", "attn.rel_logits_proj.proj": "proj",
                        "attn.rel_l2_clip.scale": "scale"}
    arguments = {"d_rel": _check_positive_int, "max_distance": _check_positive_int, "bias": _check_flag,
                 "clip_threshold": _positive_float, "log_scaling_n_floor": _positive_float,
                 "log_scaling_alpha": _non_negative_float, "layer": _module_or_none}

    def __init__(self, dim: int, num_heads: int, *, d_rel: int = 16, max_distance: int = 1024, bias: bool = False,
                 clip_threshold: Optional[float] = None, log_scaling_n_floor: Optional[float] = None,
                 log_scaling_alpha: float = 0.1, init_std: float = 0.02, layer: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.dim, self.num_heads, self.d_rel, self.max_distance = dim, num_heads, d_rel, max_distance
        self.clip_threshold, self.init_std = clip_threshold, init_std
        self.log_scaling_n_floor, self.log_scaling_alpha = log_scaling_n_floor, log_scaling_alpha
        self.register_buffer("states", None, persistent=False)                          # bound x: [B, N, D]
        if layer is not None:
            self._share(layer)
            return
        self.r_proj = _uninitialised(nn.Linear, dim, num_heads * d_rel, bias=bias)    # x -> r (Inkling's name)
        self.proj = nn.Parameter(torch.empty(d_rel, max_distance))                     # P: [d_rel, E] (Inkling's)
        self.scale = nn.Parameter(torch.empty(num_heads, d_rel)) if clip_threshold is not None else None
        self.reset_parameters()

    def _share(self, layer: nn.Module) -> None:
        """Use ``layer``'s ``r_proj``, ``proj`` and ``scale`` by reference (another encoding of this class)."""
        r_proj, proj, scale = getattr(layer, "r_proj", None), getattr(layer, "proj", None), getattr(layer, "scale", None)
        want = ((self.num_heads * self.d_rel, self.dim), (self.d_rel, self.max_distance),
                None if self.clip_threshold is None else (self.num_heads, self.d_rel))
        got = (_shape_of(getattr(r_proj, "weight", None)), _shape_of(proj), _shape_of(scale))
        if got != want:
            raise ValueError(f"{type(self).__name__}: layer must hold r_proj.weight {want[0]}, proj {want[1]} and "
                             f"scale {want[2]} (an InklingPositionalEmbedding of these sizes), got {got}")
        self.r_proj, self.proj, self.scale = r_proj, proj, scale

    def _sibling(self) -> "InklingPositionalEmbedding":
        return type(self)(self.dim, self.num_heads, d_rel=self.d_rel, max_distance=self.max_distance,
                          clip_threshold=self.clip_threshold, log_scaling_n_floor=self.log_scaling_n_floor,
                          log_scaling_alpha=self.log_scaling_alpha, init_std=self.init_std, layer=self)

    def reset_parameters(self) -> None:
        self.r_proj.reset_parameters()
        nn.init.normal_(self.proj, std=self.init_std)
        if self.scale is not None:
            nn.init.ones_(self.scale)

    @classmethod
    def from_config(cls, config, *, layer_type: Optional[Literal["hybrid", "hybrid_sliding"]] = None
                    ) -> "InklingPositionalEmbedding":
        """The relative bias of one layer type of a transformers Inkling / Inkling 2 config (object or
        ``to_dict()``): ``"hybrid"`` (full attention: ``rel_extent``, the log scaling) or ``"hybrid_sliding"``
        (``swa_num_attention_heads``, extent ``sliding_window_size``, no scaling); Inkling 2 adds its clip.
        Load the weights by ``checkpoint_names`` (or transformers' names, see the class docstring)."""
        return cls(**_inkling_kwargs_from_config(config, layer_type=layer_type))

    def bind(self, x: Tensor, *, offset: int = 0) -> "InklingPositionalEmbedding":
        """A bound encoding on token states ``x`` ``[B, N, D]`` of tokens ``offset .. offset + N - 1`` (the new
        tokens of a decoding step; the keys before them need no states)."""
        bound = self._bound_copy(states=self._check_states(x))
        bound.bound_offset = _as_int(type(self).__name__, "offset", offset, minimum=0)
        return bound

    def relative_states(self, x: Tensor, first: int = 0) -> Tensor:
        """``r`` of tokens ``x`` ``[B, N, D]``, clipped and scaled as configured (``first``: the index of
        ``x``'s first token, for ``tau``): ``[B, N, H, d_rel]``, float32 (float64)."""
        weight, bias = self.r_proj.weight, self.r_proj.bias
        dtype = torch.promote_types(_compute_dtype(x.dtype), _compute_dtype(weight.dtype))
        r = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        r = r.unflatten(-1, (self.num_heads, self.d_rel))                                 # [B, N, H, d_rel]
        if self.scale is not None:
            r = r * self.scale.to(dtype)
            norm = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
            r = r * (self.clip_threshold / (norm + 1e-6)).clamp(max=1.0)
        if self.log_scaling_n_floor is not None:
            tokens = torch.arange(first, first + x.shape[-2], device=x.device, dtype=dtype)   # i
            tau = 1.0 + self.log_scaling_alpha * torch.log(((tokens + 1) / self.log_scaling_n_floor).clamp(min=1.0))
            r = r * tau[:, None, None]
        return r

    # -- the bias -----------------------------------------------------------------------

    def _positions(self, q_len: int, k_len: int, positions_q, positions_k, device) -> tuple:
        """Query ``i`` of batch row ``b`` is row ``b Nq + i - (Nk - Nq)`` of the profile mixes
        (``bias_inputs``); keys sit at the same offsets, so a pair's difference is ``i - j``."""
        self._check_lengths(q_len, k_len)
        return _bound_rows(self.states.shape[0], q_len, q_len, k_len, device, first=k_len - q_len)

    def bias_inputs(self, q_len: int, k_len: int, device) -> tuple:
        """Each query's mix of the profiles, ``r_i . P``: ``[H, B Nq, E]``."""
        first, bound = k_len - q_len, self.bound_offset                                 # token indices
        r = self.relative_states(self.states[:, first - bound:k_len - bound].to(device), first)  # [B, Nq, H, d_rel]
        curves = torch.matmul(r, self.proj.to(r.dtype))                                 # [B, Nq, H, E]
        return (curves.permute(2, 0, 1, 3).flatten(1, 2),)

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor, curves: Tensor) -> Tensor:
        """``r_i . P[:, i - j]`` for ``0 <= i - j < E``, else 0."""
        distance = pos_q - pos_k                                                        # i - j: look-back
        inside = (distance >= 0) & (distance < self.max_distance)
        return torch.where(inside, curves[head, pos_q, distance.clamp(0, self.max_distance - 1)], 0.0)


# ---------------------------------------------------------------------------
# Bias kind, graphs: shortest-path distances between nodes (Graphormer)
# ---------------------------------------------------------------------------

_UNREACHABLE = 2 ** 40   # the hop count of a pair with no path: past every table row


def _hop_distances(edges: Tensor) -> Tensor:
    """Shortest-path hop counts of the boolean graphs ``edges`` ``[B, N, N]`` (``edges[b, i, j]``: an edge
    ``i -> j``): int64 ``[B, N, N]``, 0 on the diagonal, ``_UNREACHABLE`` where no path exists.
    Breadth-first from every node at once: step ``s`` reaches the nodes one edge past step ``s - 1``'s."""
    n = edges.shape[-1]
    step_matrix = edges.to(torch.float32)                                               # counts < 2^24: exact
    seen = torch.eye(n, dtype=torch.bool, device=edges.device).expand_as(edges).clone()
    frontier, distances = seen, torch.where(seen, 0, _UNREACHABLE)
    for step in range(1, n):
        frontier = (frontier.to(torch.float32) @ step_matrix > 0) & ~seen
        if not _skip_value_checks(frontier) and not frontier.any():   # meta / compiled: every step runs
            break
        distances = distances.masked_fill(frontier, step)
        seen = seen | frontier
    return distances


class GraphormerPositionalEmbedding(_PairwiseBias):
    """Graphormer's spatial encoding: a learned bias per head and shortest-path distance between
    two nodes, with its centrality encoding as an option (Ying et al., "Do Transformers Really
    Perform Badly for Graph Representation?", arXiv:2106.05234).

    Node ``i`` attends to node ``j`` with the bias ``b_h(phi(i, j))``, ``phi`` the number of edges
    on a shortest path from ``i`` to ``j``, read from ``spatial_pos_encoder`` (the authors' name and
    layout, ``nn.Embedding(num_spatial, H)``): distance ``d`` reads row ``min(d, S - 2) + 1``, so
    row 0 is their padding row (never read), and the last row ``S - 1`` is shared by every pair
    that is ``S - 2`` or more edges apart or not connected at all (their code stores unreachable
    pairs as 510 and reads row 511 with ``S = 512``). With ``graph_token=True``, token 0 is their
    virtual [VNode] (the graph token): every pair with it reads one learned value per head,
    ``graph_token_virtual_distance``. ``attend_within=K`` masks (``-inf``) node pairs ``K`` or more
    edges apart or unconnected, as their data collator does with ``spatial_pos_max`` (20 there);
    the paper does not mention it. Their multi-hop edge encoding is not built.

    The bias depends on the graph, so the module binds one first: ``pe.bind(adjacency)`` (or
    ``pe.bind(edge_index=..., num_nodes=N)`` in PyG's form) returns a bound
    encoding sharing the parameters, whose tokens are the graph's ``N`` nodes (``N + 1`` with the
    graph token first). Distances are hop counts of the directed graph ``adjacency != 0`` (edge
    ``i -> j``; weights are ignored, as in the authors' boolean adjacency), found breadth-first
    (``O(N^3)`` per step on dense matrices: bind once per graph and reuse the bound encoding in
    every layer). A batch ``[B, N, N]`` of graphs gives a ``[B, H, T, T]`` bias (pad smaller graphs
    with isolated nodes and mask them with ``attn_mask``); ``attention()`` then needs q's batch ``B``.
    No positions: a node's place is its row of the bound graph.

    Centrality encoding (``dim=D``): ``bound.centrality(x)`` adds ``z_in[deg_in(v)] +
    z_out[deg_out(v)]`` to the node states ``x`` ``[(B,) N, D]`` (before the graph token is
    prepended), read from ``in_degree_encoder`` / ``out_degree_encoder`` at row ``min(deg, S_deg - 2)
    + 1`` like the distances. ``deg_in`` counts the edges into a node and ``deg_out`` those out of
    it, as in the paper; the authors' code uses the out-degree for both ("for undirected graph"),
    which is the same on an undirected graph. Self-loops count, as in their code.

    Args:
        num_heads (int): heads ``H``.
        num_spatial (int): rows ``S`` of the distance table (at least 3). Default: 512 (theirs).
        graph_token (bool): token 0 is the graph's virtual node. Default: False.
        attend_within (int, optional): mask node pairs this many edges apart or more. Default: None.
        dim (int, optional): node state width for the centrality encoding. Default: None (none).
        num_degree (int): rows ``S_deg`` of each degree table (at least 3). Default: 512 (theirs).
        init_std (float): std of the normal init of every table (theirs). Default: 0.02.

    Shape:
        - adjacency: ``[N, N]`` or ``[B, N, N]`` (bool or real); edge_index: ``[2, E]``.
        - Output of ``bound(T, T)``: ``[H, T, T]`` float32 (``[B, H, T, T]`` for a batch), ``T = N``
          (``N + 1`` with the graph token).

    Example:
        >>> graphormer = GraphormerPositionalEmbedding(4, dim=32)
        >>> ring = torch.eye(6).roll(1, 0) + torch.eye(6).roll(-1, 0)   # 6 nodes in a cycle
        >>> bound = graphormer.bind(ring)
        >>> x = bound.centrality(torch.randn(6, 32))
        >>> q = k = v = torch.randn(1, 4, 6, 8)
        >>> attention(q, k, v, bound).shape
        torch.Size([1, 4, 6, 8])
    """

    order_from = "a node's place comes from the bound graph (pe.bind(adjacency))"
    takes_positions = False
    bound_inputs = ("distances", "in_degrees", "out_degrees")   # [(B,) T, T] hop counts; [(B,) N] degrees

    arguments = {"num_spatial": functools.partial(_as_int, minimum=3), "num_degree": functools.partial(_as_int, minimum=3),
                 "graph_token": _check_flag, "attend_within": _check_positive_int}

    def __init__(self, num_heads: int, *, num_spatial: int = 512, graph_token: bool = False,
                 attend_within: Optional[int] = None, dim: Optional[int] = None, num_degree: int = 512,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.num_heads, self.num_spatial, self.graph_token, self.attend_within = \
            num_heads, num_spatial, graph_token, attend_within
        self.dim, self.num_degree, self.init_std = dim, num_degree, init_std
        self.spatial_pos_encoder = _uninitialised(nn.Embedding, num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = _uninitialised(nn.Embedding, 1, num_heads) if graph_token else None
        degrees = (lambda: _uninitialised(nn.Embedding, num_degree, dim, padding_idx=0)) if dim else (lambda: None)
        self.in_degree_encoder, self.out_degree_encoder = degrees(), degrees()
        for name in self.bound_inputs:
            self.register_buffer(name, None, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in (self.spatial_pos_encoder, self.graph_token_virtual_distance, self.in_degree_encoder,
                      self.out_degree_encoder):
            if table is not None:
                nn.init.normal_(table.weight, std=self.init_std)
                if table.padding_idx is not None:
                    with torch.no_grad():
                        table.weight[table.padding_idx].zero_()

    # -- binding ------------------------------------------------------------------------

    def bind(self, adjacency: Optional[Tensor] = None, *, edge_index: Optional[Tensor] = None,
             num_nodes: Optional[int] = None) -> "GraphormerPositionalEmbedding":
        """The encoding bound to the graph ``adjacency`` ``[N, N]`` / ``[B, N, N]`` (or ``edge_index``
        ``[2, E]`` with ``num_nodes``), sharing this module's parameters."""
        owner = type(self).__name__
        weights = _dense_adjacency(owner, adjacency, edge_index, num_nodes, None)      # [(B,) N, N] float64
        if weights.dim() > 3 or weights.shape[-1] == 0:
            raise ValueError(f"{owner}: adjacency must be [N, N] or [B, N, N] with at least one node, "
                             f"got {tuple(weights.shape)}")
        edges = (weights > 0).reshape(-1, *weights.shape[-2:])                         # [B, N, N] bool
        distances = _hop_distances(edges)                                               # [B, N, N]
        if self.graph_token:  # the virtual node is token 0: -1 marks its row and column
            distances = F.pad(distances, (1, 0, 1, 0), value=-1)                        # [B, T, T]
        shape = weights.shape[:-1]                                                      # [(B,) N]
        return self._bound_copy(distances=distances.reshape(*shape[:-1], *distances.shape[-2:]),   # [(B,) T, T]
                                in_degrees=edges.sum(-2).reshape(shape), out_degrees=edges.sum(-1).reshape(shape))

    def _bound_distances(self) -> Tensor:
        if self.distances is None:
            raise ValueError(f"{type(self).__name__}: not bound to a graph: the bias depends on it, so call "
                             f"pe.bind(adjacency) or pe.bind(edge_index=..., num_nodes=N) and use the result, "
                             f"e.g. attention(q, k, v, pe.bind(adjacency))")
        return self.distances

    def _check_attention_shapes(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        super()._check_attention_shapes(q, k, v)
        distances = self._bound_distances()
        if distances.dim() == 3 and (q.dim() != 4 or q.shape[0] != distances.shape[0]):
            raise ValueError(f"{type(self).__name__}: q must be [B={distances.shape[0]}, H, T, Dh] for the "
                             f"{distances.shape[0]} bound graphs, got {tuple(q.shape)}")

    # -- the bias -----------------------------------------------------------------------

    def _positions(self, q_len: int, k_len: int, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                   device) -> tuple:
        """Token ``i`` of graph ``b`` is row ``b T + i`` of the distances and key ``j`` their column ``j``: keys
        are the first ``Nk`` tokens of each graph and queries the last ``Nq`` of them (bottom-right, as
        everywhere here)."""
        distances = self._bound_distances()
        tokens = distances.shape[-1]
        if k_len > tokens or q_len > k_len:
            raise ValueError(f"{type(self).__name__}: k must have at most the bound graph's {tokens} tokens "
                             f"({'nodes + the graph token' if self.graph_token else 'nodes'}) and q at most as "
                             f"many as k, got Nq={q_len}, Nk={k_len}")
        rows, _ = _bound_rows(distances.shape[0] if distances.dim() == 3 else None, tokens, q_len, k_len, device)
        return rows, torch.arange(k_len, device=device)

    def bias_inputs(self, q_len: int, k_len: int, device) -> tuple:
        """The graph token's learned value per head, ``[H]`` (with ``graph_token``): a copy made outside the
        ``score_mod``, which indexes it once, by the head (what FlexAttention's backward takes)."""
        return (self.graph_token_virtual_distance.weight[0].clone(),) if self.graph_token else ()

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, head: Tensor, *virtual: Tensor) -> Tensor:
        distance = self.distances.flatten(0, -2)[pos_q, pos_k]                          # hops; -1: graph token
        table = self.spatial_pos_encoder.weight
        bias = table[distance.clamp(0, self.num_spatial - 2) + 1, head].to(_compute_dtype(table.dtype))
        if self.graph_token:
            bias = torch.where(distance < 0, virtual[0][head].to(bias.dtype), bias)
        if self.attend_within is not None:
            bias = torch.where(distance >= self.attend_within, float("-inf"), bias)
        return bias

    # -- centrality ---------------------------------------------------------------------

    def centrality(self, x: Tensor) -> Tensor:
        """Node states ``x`` ``[(B,) N, D]`` plus the bound graph's in- and out-degree embeddings."""
        owner = type(self).__name__
        if self.in_degree_encoder is None:
            raise ValueError(f"{owner}: centrality needs the degree tables: build with dim=D")
        self._bound_distances()
        _check_tensor(owner, "x", x, 2)
        want = (*self.in_degrees.shape, self.dim)
        if tuple(x.shape[-len(want):]) != want:
            raise ValueError(f"{owner}: x must be [{', '.join(map(str, want))}] (the bound graph's nodes), "
                             f"got {tuple(x.shape)}")
        rows = lambda degrees: degrees.clamp_max(self.num_degree - 2) + 1
        added = self.in_degree_encoder(rows(self.in_degrees)) + self.out_degree_encoder(rows(self.out_degrees))
        return x + added.to(x.dtype)


# ---------------------------------------------------------------------------
# Logits kind: the base (_ExplicitLogits) and its encodings
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
    if _is_compiling():  # the view below would specialise on Nq (its strides); a gather serves every length
        index = _diagonal_index(q_len, k_len, scores.device)                           # [Nq, Nk]
        return scores.gather(-1, index.expand(*scores.shape[:-1], k_len))
    length = scores.shape[-1]
    flat = scores.contiguous().flatten(-2)[..., q_len - 1 : q_len - 1 + q_len * (length - 1)]   # [..., Nq (L - 1)]
    return flat.unflatten(-1, (q_len, length - 1))[..., :k_len]                                  # [..., Nq, Nk]


def _gather_rows(scores: Tensor, rows: Tensor) -> Tensor:
    """Pick, per (query, key) pair, the score of its table row.

    scores: [..., N, R] (one column per table row); rows: [N, M] or [B, 1.., 1, N, M] row
    indices -> [..., N, M]. An O(N M) gather after an O(N R Dh) product: no [.., N, M, Dh].
    """
    return scores.gather(-1, rows.expand(*scores.shape[:-1], rows.shape[-1]))


def _gather_columns(scores: Tensor, rows: Tensor) -> Tensor:
    """``_gather_rows`` from the key side: scores [..., Nk, R] (one row per key), rows [.., Nq, Nk] -> [..., Nq, Nk]."""
    return _gather_rows(scores, rows.transpose(-1, -2)).transpose(-1, -2)


def _row_sums(weights: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    """The transpose of ``_gather_rows``: weights [..., N, M] summed into their rows -> [..., N, R]."""
    buckets = weights.new_zeros(*weights.shape[:-1], num_rows)
    return buckets.scatter_add(-1, rows.expand(weights.shape), weights)


class _ExplicitLogits(_AttentionEncoding):
    """The ``"logits"`` kind: the logits themselves depend on content and positions jointly.

    A subclass writes ``logits(q, k, positions_q, positions_k, scale)``: float32 (float64) logits
    ``[B, H, Nq, Nk]`` from q and k in that dtype, validated positions (None: the defaults) and
    the logit scale; and, if it has one, the value term ``attention_values``. This base owns the
    validation, the scale, the dtypes, ``forward`` / ``forward_attn`` (the logits in the input
    dtype) and the relative-table layout ``_relative_rows`` (a row per key - query distance, laid
    out Toeplitz-wise for default positions); ``attention()`` softmaxes the float32 logits itself.
    """

    kind = "logits"

    def logits(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
               scale: float) -> Tensor:
        raise NotImplementedError

    def _attention(self, q, k, v, positions_q, positions_k, call):
        """The logits path: the float32 logits, masked, a float32 softmax (over one more column, each head's
        sink logit, dropped after it; ``attention_weights``), dropout, ``weights @ v`` plus the value term.
        Every query head meets its own copy of k and v."""
        positions_q, positions_k = _call_positions(self, q, k, positions_q, positions_k, call)
        k, v = _per_query_head(q, k), _per_query_head(q, v)
        q_len, k_len = q.shape[-2], k.shape[-2]
        encoding = self._for_documents(call.document_ids, k_len)
        logits = encoding.full_precision_logits(q, k, positions_q, positions_k, scale=call.scale)  # [B, H, Nq, Nk] f32
        mask = _merge_masks(None, call.mask(q), call.causal, q_len, k_len, logits.dtype, q.device)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        if call.sinks is None:
            weights = encoding.attention_weights(logits)                                  # [B, H, Nq, Nk]
        else:
            column = call.sinks.to(logits.dtype).reshape(-1, 1, 1).expand(*logits.shape[:-1], 1)   # [B, H, Nq, 1]
            weights = encoding.attention_weights(torch.cat([logits, column], dim=-1))[..., :k_len]
        if call.dropout_p > 0.0:
            weights = F.dropout(weights, p=call.dropout_p)
        out = torch.matmul(weights.to(v.dtype), v)                                        # [B, H, Nq, Dv]
        extra = encoding.attention_values(weights, positions_q, positions_k)              # [B, H, Nq, Dv] or None
        return out if extra is None else out + extra.to(out.dtype)

    def _for_documents(self, document_ids: Optional[Tensor], k_len: int) -> "_ExplicitLogits":
        """This encoding for the packed documents ``document_ids`` of an ``attention()`` call: itself, unless what
        it binds reads across tokens (PaTH's short convolution restarts at every document)."""
        return self

    def full_precision_logits(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                              positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """``forward_attn`` before its final cast: float32 (float64) logits, for ``attention()``'s softmax."""
        positions_q, positions_k = self._check_qk(q, k, positions_q, positions_k)
        scale = self._given_scale(q.shape[-1], scale)
        dtype = _compute_dtype(q.dtype)
        return self.logits(q.to(dtype), k.to(dtype), positions_q, positions_k, scale)

    def _relative_rows(self, row_of, q_len: int, k_len: int, positions_q: Optional[Tensor],
                       positions_k: Optional[Tensor], device) -> Tensor:
        """``row_of(key - query distance)`` of every pair: [Nq, Nk], or [B, 1.., 1, Nq, Nk] for batched
        positions; default positions evaluate the ``Nq + Nk - 1`` distinct distances once."""
        if q_len == 0 or k_len == 0:
            return torch.zeros(q_len, k_len, dtype=torch.long, device=device)
        if positions_q is None and positions_k is None:
            return _toeplitz(row_of(_default_distances(q_len, k_len, device)), q_len, k_len)
        return row_of(_pair_distances(q_len, k_len, positions_q, positions_k, device))

    def forward(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor] = None,
                positions_k: Optional[Tensor] = None, *, scale: Optional[float] = None) -> Tensor:
        """Pre-softmax logits ``[B, H, Nq, Nk]`` (same as ``forward_attn``; no value term)."""
        return self.forward_attn(q, k, positions_q, positions_k, scale=scale)

    def forward_attn(self, q, k, positions_q=None, positions_k=None, *, scale=None):
        return self.full_precision_logits(q, k, positions_q, positions_k, scale=scale).to(q.dtype)


class _RelativeLogits(_ExplicitLogits):
    """Logits ``q_c . k + q_r . r(pos_k - pos_q)`` with learned per-distance keys ``r``.

    Subclasses give ``biased_queries`` (the content and position queries, with the paper's
    ``u``/``v`` biases and scale) and ``relative_keys(distance) -> [H, L, Dh]``. Default
    positions evaluate the ``Nq + Nk - 1`` distinct distances once and shift them exactly
    into place; explicit positions evaluate each distinct distance once and gather, or every
    pair when the positions require grad (so gradients reach float positions).
    """

    kind = "logits"
    translation_invariant = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.r_w_bias = nn.Parameter(torch.empty(num_heads, head_dim))                  # u: [H, Dh] (paper's name)
        self.r_r_bias = nn.Parameter(torch.empty(num_heads, head_dim))                  # v: [H, Dh]

    def biased_queries(self, q: Tensor, scale: float) -> tuple:
        raise NotImplementedError

    def relative_keys(self, distance: Tensor) -> Tensor:
        raise NotImplementedError

    def logits(self, q, k, positions_q, positions_k, scale):
        q_len, k_len = q.shape[-2], k.shape[-2]
        q_content, q_position = self.biased_queries(q, scale)                           # [B, H, Nq, Dh] each
        logits = torch.matmul(q_content, k.transpose(-1, -2))                           # [B, H, Nq, Nk]
        if q_len == 0 or k_len == 0:
            return logits
        if positions_q is None and positions_k is None:
            keys = self.relative_keys(_default_distances(q_len, k_len, q.device)).to(q.dtype)   # [H, Nq + Nk - 1, Dh]
            by_distance = torch.matmul(q_position, keys.transpose(-1, -2))             # [B, H, Nq, Nq + Nk - 1]
            return logits + _diagonals(by_distance, q_len, k_len)
        distances = _pair_distances(q_len, k_len, positions_q, positions_k, q.device)
        return logits + self._pair_logits(q_position, distances)                       # distances: [(B,) Nq, Nk]

    def _pair_logits(self, q_position: Tensor, distances: Tensor) -> Tensor:
        """q_position [B, .., H, Nq, Dh], distances [Nq, Nk] or [B, 1.., 1, Nq, Nk] -> [B, .., H, Nq, Nk].

        Relative keys for every pair while tracing (no data-dependent shapes) and when the
        distances require grad (``torch.unique`` has no backward: each pair's gradient must
        reach its own two positions); else once per distinct distance, gathered.
        """
        if _is_compiling() or distances.requires_grad:
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
    Default positions need ``Nk >= Nq`` (keys are memory plus the current segment); with
    more queries than keys pass ``positions_q`` and ``positions_k``. Float positions that
    require grad receive gradients (every pair's relative key is then evaluated).

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

    arguments = {"clamp_len": _check_positive_int}
    queries_within_keys = True   # by default, keys are the memory plus the current segment

    def __init__(self, num_heads: int, head_dim: int, *, d_model: Optional[int] = None, base: float = 10000.0,
                 clamp_len: Optional[int] = None, init_std: float = 0.02) -> None:
        super().__init__(num_heads, head_dim)
        d_model = _even_int(type(self).__name__, "d_model", num_heads * head_dim if d_model is None else d_model)
        self.d_model, self.base, self.clamp_len, self.init_std = d_model, base, clamp_len, init_std
        self.r_net = _uninitialised(nn.Linear, d_model, self.num_heads * self.head_dim, bias=False)   # W_r
        self.reset_parameters()

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
                    gamma_peak: Optional[Tensor]) -> Tensor:
    """Enformer's exponential, central-mask and gamma basis functions of ``|distance|``, float64.

    distance: [L] -> [L, 3 * num_basis]; each gamma density (plus 1e-8) is divided by
    ``gamma_peak`` [num_basis], or, for None, by the largest gamma value of its own distance.
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
    # concentration >= 4, so each density is 0 at d = 0 with zero slope; log(d) is kept away from 0
    # (the double where), else its infinite derivative times exp(-inf) = 0 gives a NaN gradient
    positive = d > 0
    safe_d = torch.where(positive, d, torch.ones_like(d))
    log_pdf = torch.xlogy(concentration - 1, safe_d) - rate * safe_d - (torch.lgamma(concentration)
                                                                       - concentration * rate.log())
    gamma = torch.where(positive, torch.exp(log_pdf), 0.0) + 1e-8                        # [L, num_basis]
    gamma = gamma / (gamma.amax(-1, keepdim=True) if gamma_peak is None else gamma_peak.to(device))
    return torch.cat([exponential, central_mask, gamma], dim=-1)


class EnformerPositionalEmbedding(_RelativeLogits):
    """Enformer's relative attention (Avsec et al. 2021, Nature Methods; bioRxiv 2021.04.07.438649).

    ``logits[i, j] = (s q_i + u) . k_j + (s q_i + v) . W_r f(pos_k[j] - pos_q[i])`` with
    ``s`` the logit scale (applied to q before the biases, as in Enformer), ``u = r_w_bias``,
    ``v = r_r_bias``, ``W_r = r_k`` and ``f`` the relative basis: exponential decays (half
    lives ``2**3 .. length_scale``), central masks (widths ``2**k - 1``) and gamma densities
    (means up to ``length_scale``), each of ``|d|``, followed by the same features times
    ``sign(d)`` (dropped with ``symmetric=True``). The basis takes its length scale from
    the constructor, never from the input, so a pair's logit does not depend on the other
    tokens. Features are computed in float64.

    The gamma densities (plus 1e-8) are divided by (``gamma_normalization``):
    ``"per_feature"``, each density's own peak over ``|d| < length_scale``: what the
    official weights need as enformer-pytorch loads them (``from_pretrained`` uses its
    precomputed TensorFlow table ``tf_gammas.pt``, which equals this to 2.2e-3, float32
    rounding, and differs from ``"global"`` by 0.11); ``"global"``, the largest value over
    every distance ``|d| < length_scale`` and every density: DeepMind's ``attention_module.py``
    (``positional_features_gamma``, ``tf.reduce_max`` over all of them, for distances of its
    input length: set ``length_scale`` to it, 1536 in Enformer); ``"per_distance"``, the
    largest density at the same distance: enformer-pytorch's own formula
    (``get_positional_features_gamma``, ``amax(dim=-1)``, used with ``use_tf_gamma=False``,
    e.g. models built with ``from_hparams``).

    Args:
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh``.
        num_features (int): width of ``f``; a multiple of 6 (3 with ``symmetric``). Default: 192.
        length_scale (int): the length the basis is scaled to (Enformer's attention
            length). Default: 1536.
        min_half_life (float): log2 of the shortest exponential half life. Default: 3.0.
        symmetric (bool): drop the sign-asymmetric copies. Default: False.
        gamma_normalization (str): ``"per_feature"``, ``"global"`` or ``"per_distance"``
            (see above). Default: ``"per_feature"``.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` -> logits ``[B, H, Nq, Nk]``.

    Example:
        >>> enformer = EnformerPositionalEmbedding(8, 64)
        >>> q = k = torch.randn(1, 8, 100, 64)
        >>> enformer(q, k).shape
        torch.Size([1, 8, 100, 100])
    """

    arguments = {"length_scale": _check_positive_int, "num_features": _check_positive_int,
                 "min_half_life": _positive_float, "symmetric": _check_flag,
                 "gamma_normalization": functools.partial(_check_choice,
                                                          choices=("per_feature", "global", "per_distance"))}

    def __init__(self, num_heads: int, head_dim: int, *, num_features: int = 192, length_scale: int = 1536,
                 min_half_life: float = 3.0, symmetric: bool = False,
                 gamma_normalization: Literal["per_feature", "global", "per_distance"] = "per_feature") -> None:
        super().__init__(num_heads, head_dim)
        owner, components = type(self).__name__, 3 if symmetric else 6
        if num_features % components:
            raise ValueError(f"{owner}: num_features must be a positive multiple of {components} "
                             f"(symmetric={symmetric}), got num_features={num_features!r}")
        if not min_half_life < math.log2(length_scale):
            raise ValueError(f"{owner}: min_half_life must lie in (0, log2(length_scale)={math.log2(length_scale):.2f}), "
                             f"got min_half_life={min_half_life!r}")
        self.num_features, self.length_scale = num_features, length_scale
        self.min_half_life, self.symmetric = min_half_life, symmetric
        self.gamma_normalization = gamma_normalization
        self.r_k = _uninitialised(nn.Linear, num_features, num_heads * head_dim, bias=False)   # W_r
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Enformer (Sonnet) draws these with variance scaling 2.0 over the fan-in
        nn.init.normal_(self.r_w_bias, std=math.sqrt(2.0 / self.num_heads))
        nn.init.normal_(self.r_r_bias, std=math.sqrt(2.0 / self.num_heads))
        nn.init.normal_(self.r_k.weight, std=math.sqrt(2.0 / self.num_features))
        self._init_buffers(self.r_w_bias.device)

    def _init_buffers(self, device) -> None:
        num_basis = self.num_features // (3 if self.symmetric else 6)
        # each gamma density's peak over |d| < length_scale ("global": the largest of them)
        unscaled = _enformer_basis(torch.arange(self.length_scale, device=device), num_basis, self.length_scale,
                                   self.min_half_life, torch.ones(num_basis, dtype=torch.float64, device=device))
        peak = unscaled[:, 2 * num_basis:].amax(0)                                      # [F] float64
        if self.gamma_normalization == "global":
            peak = peak.amax().expand(num_basis).clone()
        self.register_buffer("gamma_peak", peak, persistent=False)   # unused by "per_distance"

    def features(self, distance: Tensor) -> Tensor:
        """The relative basis ``f`` of key - query ``distance`` [L]: [L, num_features], float64."""
        num_basis = self.num_features // (3 if self.symmetric else 6)
        peak = None if self.gamma_normalization == "per_distance" else self.gamma_peak
        basis = _enformer_basis(distance, num_basis, self.length_scale, self.min_half_life, peak)
        if self.symmetric:
            return basis
        return torch.cat([basis, torch.sign(distance).to(basis.dtype).unsqueeze(-1) * basis], dim=-1)

    def biased_queries(self, q: Tensor, scale: float) -> tuple:
        u, v = self.r_w_bias.to(q.dtype), self.r_r_bias.to(q.dtype)
        return q * scale + u.unsqueeze(-2), q * scale + v.unsqueeze(-2)

    def relative_keys(self, distance: Tensor) -> Tensor:
        features = self.features(distance).to(self.r_k.weight.dtype)                   # [L, C]
        return self.r_k(features).unflatten(-1, (self.num_heads, self.head_dim)).transpose(0, 1)


class ShawPositionalEmbedding(_ExplicitLogits):
    """Shaw et al.'s relative position representations (arXiv:1803.02155).

    ``logits[i, j] = scale * q_i . (k_j + a_K[r(i, j)])`` and, inside ``attention()``,
    ``out_i = sum_j w_ij (v_j + a_V[r(i, j)])``, with learned tables ``a_K = relative_keys``
    and ``a_V = relative_values`` shared by the heads, and row
    ``r(i, j) = left + clip(pos_k[j] - pos_q[i], -left, right)`` (key minus query, the layout
    of OpenNMT-py and of transformers' Wav2Vec2-BERT ``relative_key``; ``left = right =
    max_distance`` unless a pair ``(left, right)`` is given, as Wav2Vec2-BERT's
    ``left_max_position_embeddings`` / ``right_max_position_embeddings``). ``key_query=True``
    adds ``scale * k_j . a_K[r(i, j)]`` (Huang et al. 2020, arXiv:2009.13658; BERT's
    ``relative_key_query``). An explicit ``scale`` multiplies every term of the logit.
    BERT-style ``distance_embedding`` tables index query minus key: load them with
    ``from_bert``, which flips the rows.

    The key term gathers ``q @ a_K^T`` (``[B, H, Nq, R]``, ``R`` table rows) per pair; the
    value term sums the attention weights into their ``R`` rows (``[B, H, Nq, R]``) and
    multiplies by ``a_V`` once: nothing of size ``[B, H, Nq, Nk, Dh]`` is built. The value
    term exists only in ``attention()`` (``attention_values``); ``forward_attn`` returns the
    logits.

    Args:
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh`` (and the value dim ``Dv``).
        max_distance (int or (int, int)): clipping distance ``K``, or ``(left, right)`` for
            keys before / after the query. Default: 16.
        key_query (bool): add the key-side term ``k . a_K``. Default: False.
        values (bool): learn ``relative_values`` and add the value term. Default: True.
        init_std (float): std of the normal init of the tables. Default: 0.02.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` -> logits ``[B, H, Nq, Nk]``.

    Example:
        >>> shaw = ShawPositionalEmbedding(8, 64, max_distance=16)
        >>> q = k = v = torch.randn(2, 8, 100, 64)
        >>> attention(q, k, v, shaw, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    translation_invariant = True
    integer_positions = True   # distances index a table
    arguments = {"max_distance": _left_right, "key_query": _check_flag, "values": _check_flag}

    def __init__(self, num_heads: int, head_dim: int, *, max_distance: Union[int, Sequence[int]] = 16,
                 key_query: bool = False, values: bool = True, init_std: float = 0.02) -> None:
        super().__init__()
        left, right = max_distance if isinstance(max_distance, tuple) else (max_distance, max_distance)
        self.num_heads, self.head_dim, self.left, self.right = num_heads, head_dim, left, right
        self.key_query, self.init_std = key_query, init_std
        self.relative_keys = _uninitialised(nn.Embedding, left + right + 1, head_dim)  # a_K: [R, Dh]
        self.relative_values = _uninitialised(nn.Embedding, left + right + 1, head_dim) if values else None  # a_V
        self.reset_parameters()

    @property
    def max_distance(self) -> Union[int, tuple]:
        return self.left if self.left == self.right else (self.left, self.right)

    def reset_parameters(self) -> None:
        for table in (self.relative_keys, self.relative_values):
            if table is not None:
                nn.init.normal_(table.weight, std=self.init_std)

    @classmethod
    def from_bert(cls, distance_embedding: Union[nn.Embedding, Tensor], num_heads: int, *,
                  key_query: bool = False) -> "ShawPositionalEmbedding":
        """Load a BERT-style ``relative_key`` / ``relative_key_query`` table (transformers 4.x
        ``BertSelfAttention.distance_embedding``, also RoBERTa, ELECTRA, ...).

        BERT indexes ``2 M - 1`` rows by ``query - key + M - 1`` (``M`` its
        ``max_position_embeddings``); Shaw's row is ``key - query + K``, so with ``K = M - 1``
        the rows are the same, flipped. BERT has no value term (``values=False``) and no
        clipping (it fails beyond ``M - 1``; here distances clip).
        """
        weight = distance_embedding.weight if isinstance(distance_embedding, nn.Embedding) else distance_embedding
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] % 2 == 0:
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"{cls.__name__}: distance_embedding must be a [2 M - 1, Dh] table, got {shape}")
        pe = cls(num_heads, weight.shape[1], max_distance=weight.shape[0] // 2, key_query=key_query, values=False)
        pe = pe.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            pe.relative_keys.weight.copy_(weight.flip(0))
        return pe

    def _check_attention_shapes(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        super()._check_attention_shapes(q, k, v)
        if self.relative_values is not None and v.shape[-1] != self.head_dim:
            raise ValueError(f"{type(self).__name__}: v must have the head dim Dh={self.head_dim} of relative_values "
                             f"(the value term adds a_V to every output; pass values=False for Dv != Dh), "
                             f"got v {tuple(v.shape)}")

    def _row(self, distance: Tensor) -> Tensor:
        """``r = left + clip(distance, -left, right)``: the table row of key - query ``distance``."""
        return distance.clamp(-self.left, self.right) + self.left

    def logits(self, q, k, positions_q, positions_k, scale):
        rows = self._relative_rows(self._row, q.shape[-2], k.shape[-2], positions_q, positions_k, q.device)
        table = self.relative_keys.weight.to(q.dtype)                                    # [R, Dh]
        q = q * scale
        logits = torch.matmul(q, k.transpose(-1, -2))                                   # [B, H, Nq, Nk]
        logits = logits + _gather_rows(torch.matmul(q, table.T), rows)                  # q . a_K
        if self.key_query:                                                               # k . a_K, per key
            logits = logits + _gather_columns(torch.matmul(k * scale, table.T), rows)
        return logits

    def attention_values(self, weights: Tensor, positions_q: Optional[Tensor] = None,
                         positions_k: Optional[Tensor] = None) -> Optional[Tensor]:
        """``sum_j w_ij a_V[r(i, j)]``: [B, H, Nq, Dh] (None without ``relative_values``)."""
        if self.relative_values is None:
            return None
        owner, (q_len, k_len), lead = type(self).__name__, weights.shape[-2:], tuple(weights.shape[:-2])
        positions_q, positions_k = (_check_positions(owner, name, p, lead, n, integer=True, device=weights.device)
                                    for name, p, n in (("positions_q", positions_q, q_len),
                                                       ("positions_k", positions_k, k_len)))
        rows = self._relative_rows(self._row, q_len, k_len, positions_q, positions_k, weights.device)
        table = self.relative_values.weight.to(weights.dtype)                            # [R, Dh]
        return torch.matmul(_row_sums(weights, rows, table.shape[0]), table)             # [B, H, Nq, Dh]


def _check_log_buckets(owner: str, position_buckets, max_relative_positions) -> tuple:
    """DeBERTa's log buckets: ``position_buckets >= 2`` and ``max_relative_positions`` past their
    ``position_buckets // 2`` exact ones (the log's denominator must be positive)."""
    position_buckets = _as_int(owner, "position_buckets", position_buckets, 2)
    max_relative_positions = _check_positive_int(owner, "max_relative_positions", max_relative_positions)
    if max_relative_positions - 1 <= position_buckets // 2:
        raise ValueError(f"{owner}: max_relative_positions must exceed position_buckets // 2 + 1 = "
                         f"{position_buckets // 2 + 1} (log buckets), got "
                         f"max_relative_positions={max_relative_positions}")
    return position_buckets, max_relative_positions


def deberta_log_bucket(relative_position: Tensor, *, position_buckets: int = 256,
                       max_relative_positions: int = 512) -> Tensor:
    """DeBERTa-v2's log bucket of each (query - key) distance (``make_log_bucket_position``).

    Distances with ``|d| <= position_buckets // 2`` keep their value; larger ones map to
    ``sign(d) * (mid + ceil(log(|d| / mid) / log((max_relative_positions - 1) / mid) * (mid - 1)))``
    with ``mid = position_buckets // 2``, growing past ``position_buckets - 1`` only beyond
    ``max_relative_positions`` (the caller clamps). Computed in float32 in the reference's
    order, so every distance lands where transformers puts it.

    Returns:
        int64 buckets, same shape.
    """
    owner = "deberta_log_bucket"
    position_buckets, _ = _check_log_buckets(owner, position_buckets, max_relative_positions)
    if not isinstance(relative_position, Tensor) or relative_position.is_floating_point() \
            or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(f"{owner}: relative_position must be an integer tensor, got {_describe(relative_position)}")
    mid = position_buckets // 2
    # int64 whatever the integer dtype (a uint8 cannot hold mid - 1 = 511, an int8's -128 has no magnitude);
    # -2**63 has none in int64 either: -(2**63 - 1) shares its bucket
    relative_position = relative_position.long().clamp(min=-_INT64_MAX)
    sign = torch.sign(relative_position)
    near = (relative_position < mid) & (relative_position > -mid)
    abs_pos = torch.where(near, torch.full_like(relative_position, mid - 1), relative_position.abs())
    denominator = torch.log(torch.tensor((max_relative_positions - 1) / mid, dtype=torch.float32,
                                         device=relative_position.device))
    log_pos = torch.ceil(torch.log(abs_pos.to(torch.float32) / mid) / denominator * (mid - 1)) + mid
    # near distances keep their exact value (the reference's float32 round trip is exact only below 2**24)
    return torch.where(abs_pos <= mid, relative_position, (log_pos * sign).long())


def _check_deberta_buckets(owner: str, arguments: dict) -> None:
    """DeBERTa's log buckets, where it buckets (``position_buckets`` not None): see ``_check_log_buckets``."""
    if arguments["position_buckets"] is not None:
        _check_log_buckets(owner, arguments["position_buckets"], arguments["max_relative_positions"])


def _deberta_head_dim(owner: str, dim: int, num_heads: int, head_dim: Optional[int], query_proj, key_proj) -> int:
    """DeBERTa's ``Dh``: given, or from the shared projections (both or neither, ``nn.Linear(dim, H * Dh)``),
    or ``dim // num_heads``."""
    if (query_proj is None) != (key_proj is None):
        raise ValueError(f"{owner}: query_proj and key_proj must be given together (shared projections) "
                         f"or both None, got query_proj={type(query_proj).__name__}, "
                         f"key_proj={type(key_proj).__name__}")
    shared = query_proj is not None
    for name, linear in ((("query_proj", query_proj), ("key_proj", key_proj)) if shared else ()):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{owner}: {name} must be an nn.Linear, got {type(linear).__name__}")
        if linear.in_features != dim or linear.out_features % num_heads \
                or linear.out_features != query_proj.out_features:
            raise ValueError(f"{owner}: {name} must map dim={dim} to H * Dh features (H={num_heads}), "
                             f"got {name}=Linear({linear.in_features}, {linear.out_features})")
    if head_dim is None:
        if not shared and dim % num_heads:
            raise ValueError(f"{owner}: dim must be divisible by num_heads without head_dim, "
                             f"got dim={dim}, num_heads={num_heads}")
        head_dim = query_proj.out_features // num_heads if shared else dim // num_heads
    if shared and query_proj.out_features != num_heads * head_dim:
        raise ValueError(f"{owner}: head_dim must be query_proj.out_features / num_heads = "
                         f"{query_proj.out_features // num_heads}, got head_dim={head_dim}")
    return head_dim


class DebertaPositionalEmbedding(_ExplicitLogits):
    """DeBERTa's disentangled attention (He et al., arXiv:2006.03654), as in DeBERTa-v2/v3.

    ``logits[i, j] = scale * (q_i . k_j + q_i . K_r[h, idx(i, j)] + k_j . Q_r[h, idx(i, j)])``
    (content-to-content, content-to-position ``"c2p"``, position-to-content ``"p2c"``) with
    ``P = norm(rel_embeddings)`` (``[2 S, D]``), ``K_r = key_proj(P)``, ``Q_r = query_proj(P)``
    split into heads, and ``idx(i, j) = clamp(S + bucket(pos_q[i] - pos_k[j]), 0, 2 S - 1)``
    (``bucket`` = ``deberta_log_bucket``; ``S = position_buckets``, or
    ``max_relative_positions`` with ``position_buckets=None``, no bucketing). Both indices
    follow transformers' ``modeling_deberta_v2.py``: there p2c uses ``idx(i, j)`` too, the
    query-minus-key bucket, where the paper's equation uses ``delta(j, i)``, the key-minus-query
    one (the published checkpoints were trained with the code's index). With ``scale=None``
    the logits use DeBERTa's ``1 / sqrt(Dh * (1 + len(pos_att_type)))``.

    Projections: pass the attention's own ``query_proj`` / ``key_proj`` (``share_att_key``,
    DeBERTa-v3): they are held by reference, never re-initialised, and are neither in this
    module's ``parameters()`` nor ``state_dict()`` (the attention owns, moves and saves them).
    Otherwise the class owns ``pos_query_proj`` (for p2c) and ``pos_key_proj`` (for c2p).
    A checkpoint loads by copying the encoder's ``rel_embeddings`` and ``LayerNorm`` into
    ``rel_embeddings`` and ``norm`` of each layer's encoding.

    Decoding with fewer queries than keys works (queries are the last positions, each pair's
    logit depends only on its two positions); the reference is an encoder and has no such mode.
    Positional dropout (on ``rel_embeddings`` in training) is not applied.

    Args:
        dim (int): model dim ``D`` (width of ``rel_embeddings``).
        num_heads (int): heads ``H``.
        max_relative_positions (int): the reference's ``max_relative_positions`` (the log
            buckets reach ``S - 1`` there). Default: 512.
        position_buckets (int, optional): ``S``; None for no bucketing. Default: 256.
        pos_att_type (tuple of str): any of ``"c2p"``, ``"p2c"`` (a ``"p2c|c2p"`` string as in
            the config works too). Default: ``("c2p", "p2c")``.
        query_proj, key_proj (nn.Linear, optional): shared projections ``D -> H * Dh``. Default: None.
        head_dim (int, optional): ``Dh``. Default: ``dim // num_heads``, or the shared
            projection's ``out_features // num_heads``.
        layer_norm (bool): normalise ``rel_embeddings`` (``norm_rel_ebd="layer_norm"``). Default: True.
        layer_norm_eps (float): ``norm.eps``. Default: 1e-7 (DeBERTa-v2's).
        init_std (float): std of the normal init of owned weights. Default: 0.02.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` -> logits ``[B, H, Nq, Nk]``.

    Example:
        >>> deberta = DebertaPositionalEmbedding(768, 12)
        >>> q = k = v = torch.randn(2, 12, 128, 64)
        >>> attention(q, k, v, deberta).shape
        torch.Size([2, 12, 128, 64])
    """

    translation_invariant = True
    integer_positions = True   # distances index buckets
    arguments = {"max_relative_positions": _check_positive_int, "pos_att_type": _attention_terms,
                 "position_buckets": _optional_size, "layer_norm": _check_flag, "layer_norm_eps": _positive_float}
    argument_rules = (_check_deberta_buckets,)

    def __init__(self, dim: int, num_heads: int, *, max_relative_positions: int = 512,
                 position_buckets: Optional[int] = 256,
                 pos_att_type: Union[str, Sequence[Literal["c2p", "p2c"]]] = ("c2p", "p2c"),
                 query_proj: Optional[nn.Linear] = None, key_proj: Optional[nn.Linear] = None,
                 head_dim: Optional[int] = None, layer_norm: bool = True, layer_norm_eps: float = 1e-7,
                 init_std: float = 0.02) -> None:
        super().__init__()
        head_dim = _deberta_head_dim(type(self).__name__, dim, num_heads, head_dim, query_proj, key_proj)
        shared = query_proj is not None
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.max_relative_positions, self.position_buckets = max_relative_positions, position_buckets
        self.pos_att_type, self.init_std = pos_att_type, init_std
        self.span = max_relative_positions if position_buckets is None else position_buckets   # S
        self.rel_embeddings = _uninitialised(nn.Embedding, 2 * self.span, dim)         # [2 S, D]
        self.norm = nn.LayerNorm(dim, eps=layer_norm_eps) if layer_norm else None
        # shared projections are the attention's: set past nn.Module, they stay out of this module's tree
        object.__setattr__(self, "query_proj", query_proj)
        object.__setattr__(self, "key_proj", key_proj)
        if not shared and "p2c" in self.pos_att_type:
            self.pos_query_proj = _uninitialised(nn.Linear, dim, num_heads * head_dim)
        if not shared and "c2p" in self.pos_att_type:
            self.pos_key_proj = _uninitialised(nn.Linear, dim, num_heads * head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the owned weights (never the shared ``query_proj`` / ``key_proj``)."""
        nn.init.normal_(self.rel_embeddings.weight, std=self.init_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        for name in ("pos_query_proj", "pos_key_proj"):
            linear = getattr(self, name, None)
            if isinstance(linear, nn.Linear):
                nn.init.normal_(linear.weight, std=self.init_std)
                nn.init.zeros_(linear.bias)

    def logit_scale(self, head_dim: int) -> float:
        """DeBERTa's ``1 / sqrt(Dh * (1 + len(pos_att_type)))``."""
        return (head_dim * (1 + len(self.pos_att_type))) ** -0.5

    def relative_projections(self, dtype: torch.dtype = torch.float32) -> tuple:
        """``(Q_r, K_r)``: the normalised table through the position projections, ``[H, 2 S, Dh]``
        each (None for a term not in ``pos_att_type``)."""
        table = self.rel_embeddings.weight.to(dtype)                                     # [2 S, D]
        table = table if self.norm is None else _run_mlp(self.norm, table)
        project = lambda linear: _run_mlp(linear, table).unflatten(-1, (self.num_heads, -1)).transpose(0, 1)
        queries = self.query_proj or getattr(self, "pos_query_proj", None)              # D -> H Dh
        keys = self.key_proj or getattr(self, "pos_key_proj", None)
        return (project(queries) if "p2c" in self.pos_att_type else None,
                project(keys) if "c2p" in self.pos_att_type else None)

    def _row(self, distance: Tensor) -> Tensor:
        """``idx = clamp(S + bucket(query - key), 0, 2 S - 1)`` of key - query ``distance``."""
        relative = -distance
        if self.position_buckets is not None:
            relative = deberta_log_bucket(relative, position_buckets=self.position_buckets,
                                          max_relative_positions=self.max_relative_positions)
        return (relative + self.span).clamp(0, 2 * self.span - 1)

    def logits(self, q, k, positions_q, positions_k, scale):
        q = q * scale
        logits = torch.matmul(q, k.transpose(-1, -2))                                   # [B, H, Nq, Nk]
        if not self.pos_att_type:
            return logits
        rows = self._relative_rows(self._row, q.shape[-2], k.shape[-2], positions_q, positions_k, q.device)
        pos_query, pos_key = self.relative_projections(q.dtype)                         # [H, 2 S, Dh] or None
        if pos_key is not None:                                                          # c2p: q_i . K_r[idx(i, j)]
            logits = logits + _gather_rows(torch.matmul(q, pos_key.transpose(-1, -2)), rows)
        if pos_query is not None:                                                        # p2c: k_j . Q_r[idx(i, j)]
            logits = logits + _gather_columns(torch.matmul(k * scale, pos_query.transpose(-1, -2)), rows)
        return logits


class CoPEPositionalEmbedding(_ExplicitLogits):
    """Contextual Position Encoding (Golovneva et al., arXiv:2405.18719).

    Positions are counted by the content: query ``i`` opens a gate on every key,
    ``g_it = sigmoid(scale * q_i . k_t)``, and the position of key ``j`` is the number of
    open gates between it and the query, ``p_ij = sum_{t=j..i} g_it``, clamped at
    ``max_position - 1``. A learned vector per integer position, ``e[0 .. max_position - 1]``
    (``pos_emb``), is interpolated at the fractional ``p_ij``,
    ``e(p) = (1 - w) e[floor p] + w e[ceil p]`` with ``w = p - floor p``, and the logits are
    ``scale * q_i . k_j + q_i . e(p_ij)`` (the position term is not scaled, as in the
    paper's code). As in the paper's appendix code, ``q @ e^T`` is computed once per query
    ``[B, H, Nq, max_position]`` and each pair gathers its two integer neighbours.

    The sum runs from ``j`` to ``i``, so CoPE is causal by construction: the gates of keys
    after the query are zero (the causal mask is applied to the gates, as in the paper) and
    the logits there are ``-inf``; ``is_causal`` is True, so ``attention()`` masks causally by
    default and rejects ``causal=False``. With fewer queries than keys
    the queries are the last ``Nq`` tokens (bottom-right); a query's positions use only its
    own gates, so token-by-token decoding with a cache is exact.

    ``pos_emb`` is ``[max_position, Dh]`` shared by the heads, x-transformers' ``CoPE.pos_emb``
    (copy it as is); the paper's ``pos_emb`` ``[1, Dh, max_position]`` loads as
    ``pos_emb.copy_(paper.pos_emb[0].T)``. ``per_head=True`` gives each head its own table
    ``[H, max_position, Dh]``. Both references start from zeros (``init_std=0``).

    Cost: a logits kind, O(B H Nq Nk) extra memory on top of the logits: the gates, their
    reverse cumulative sum, one int64 index and two gathered terms (about 6 float32
    ``[B, H, Nq, Nk]`` tensors), and no fused SDPA path.

    Args:
        num_heads (int): heads ``H``.
        head_dim (int): head dim ``Dh``.
        max_position (int): rows of the table; contextual positions clamp at
            ``max_position - 1``. Default: 64.
        per_head (bool): one table per head. Default: False (the references').
        init_std (float): std of the normal init of the table; 0 gives the references'
            zeros. Default: 0.0.

    Shape:
        - q: ``[B, H, Nq, Dh]``, k: ``[B, H, Nk, Dh]`` (``Nq <= Nk``) -> ``[B, H, Nq, Nk]``.

    Example:
        >>> cope = CoPEPositionalEmbedding(8, 64, max_position=64)
        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> attention(q, k, v, cope, causal=True).shape
        torch.Size([2, 8, 128, 64])
    """

    takes_positions, order_from = False, "contextual positions are counted by the gates"
    is_causal = True  # causal by construction: keys after the query get -inf
    queries_within_keys = True
    arguments = {"max_position": _check_positive_int, "per_head": _check_flag}

    def __init__(self, num_heads: int, head_dim: int, *, max_position: int = 64, per_head: bool = False,
                 init_std: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.max_position = num_heads, head_dim, max_position
        self.per_head, self.init_std = per_head, init_std
        shape = (num_heads, max_position, head_dim) if per_head else (max_position, head_dim)
        self.pos_emb = nn.Parameter(torch.empty(shape))                                # e: [(H,) P, Dh]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_std > 0:
            nn.init.normal_(self.pos_emb, std=self.init_std)
        else:
            nn.init.zeros_(self.pos_emb)

    def logits(self, q, k, positions_q, positions_k, scale):
        q_len, k_len = q.shape[-2], k.shape[-2]
        # keys in reverse order (column r is key Nk - 1 - r), so p_ij is a forward cumsum; one flip at the end
        logits = torch.matmul(q, k.flip(-2).transpose(-1, -2)) * scale                  # [B, H, Nq, Nk] reversed
        allowed = _causal_mask(q_len, k_len, q.device).flip(-1)                         # [Nq, Nk] reversed
        gates = torch.where(allowed, torch.sigmoid(logits), 0.0)                        # g_it, causal
        positions = gates.cumsum(-1).clamp(max=self.max_position - 1)                   # p_ij = sum_{t=j..i} g_it
        index = positions.long()                                                        # floor(p): p >= 0
        by_position = torch.matmul(q, self.pos_emb.to(q.dtype).transpose(-1, -2))      # q . e[p]: [B, H, Nq, P]
        step = F.pad(by_position.diff(dim=-1), (0, 1))                                 # q . (e[p + 1] - e[p])
        term = torch.addcmul(by_position.gather(-1, index), positions.frac(), step.gather(-1, index))  # [B, H, Nq, Nk]
        return torch.where(allowed, logits + term, float("-inf")).flip(-1)             # q . e(p_ij) added



class _RotaryPieces(_ExplicitLogits):
    """RoPE logits whose positions depend on the pair: each (query, key) pair is rotated by one of a few
    position rules (ReRoPE, Self-Extend, Dual Chunk Attention).

    A subclass holds ``self.rope`` (a ``RotaryPositionalEmbedding``) and gives two hooks on the
    query and key positions: ``pieces(pos_q, pos_k)``, the rules as (query positions, key positions)
    pairs, and ``piece_of(pos_q, pos_k) -> [(B, 1,) Nq, Nk]``, the rule each pair takes. The base
    rotates q and k once per rule, takes each pair's logit from its rule's product and gives keys
    after the query ``-inf`` (causal by construction). ``log_scaling_length = L`` multiplies the
    query at ``t`` by ``max(1, log(t + 1) / log(L))``, as the ReRoPE and Self-Extend patches can.

    Cost: one ``q k^T`` product and one ``[Nq, Nk]`` select per rule, with no fused SDPA path.
    Decoding keeps the raw keys in the cache: each call rotates them once per rule.
    """

    is_causal = True  # causal by construction: keys after the query get -inf
    arguments = {"log_scaling_length": functools.partial(_as_int, minimum=2)}
    log_scaling_length: Optional[int] = None

    @property
    def head_dim(self) -> int:
        """The head dim ``Dh`` of the wrapped RoPE: q and k must have it."""
        return self.rope.dim

    def pieces(self, pos_q: Tensor, pos_k: Tensor) -> tuple:
        raise NotImplementedError

    def piece_of(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        raise NotImplementedError

    def logits(self, q, k, positions_q, positions_k, scale):
        pos_q, pos_k = _pair_positions(q.shape[-2], k.shape[-2], positions_q, positions_k, 0, q.device, k.device)
        if self.log_scaling_length is not None:  # the patches' max(1, log(t + 1) / log(L_train)); 1 for t < 0
            growth = torch.log1p(pos_q.to(torch.float64).clamp(min=0)) / math.log(self.log_scaling_length)
            q = q * growth.clamp(min=1.0).to(q.dtype).unsqueeze(-1)
        choice = self.piece_of(pos_q, pos_k)                                           # [(B, 1,) Nq, Nk]
        logits = None
        for index, (piece_q, piece_k) in enumerate(self.pieces(pos_q, pos_k)):
            rotated_q, rotated_k = self.rope.encode_qk(q, k, piece_q, piece_k)
            piece = torch.matmul(rotated_q, rotated_k.transpose(-1, -2))                # [..., Nq, Nk]
            logits = piece if logits is None else torch.where(choice == index, piece, logits)
        distance = pos_q.unsqueeze(-1) - pos_k.unsqueeze(-2)
        return (logits * scale).masked_fill(distance < 0, float("-inf"))


def _check_wrapped_rope(owner: str, name: str, rope) -> "RotaryPositionalEmbedding":
    """A one-axis RoPE whose frequencies do not depend on the call's length (each rule of a
    ``_RotaryPieces`` has its own largest position, so ``dynamic`` / ``longrope`` would differ per rule;
    fixed with ``at_length`` they are one spectrum)."""
    if not isinstance(rope, RotaryPositionalEmbedding):
        raise TypeError(f"{owner}: {name} must be a RotaryPositionalEmbedding, got {type(rope).__name__}")
    if rope.num_axes != 1:
        raise ValueError(f"{owner}: {name} must rotate one position axis, got num_axes={rope.num_axes}")
    if rope.rotate_values:
        raise ValueError(f"{owner}: {name} must not rotate the values (each rule would need its own turn of "
                         f"them), got rotate_values=True")
    if rope.scaling["rope_type"] in _LENGTH_DEPENDENT and rope.fixed_length is None:
        raise ValueError(f"{owner}: {name} must have length-independent frequencies, got "
                         f"scaling rope_type={rope.scaling['rope_type']!r} (its spectrum follows each call's length; "
                         f"fix it with {name}.at_length(length))")
    return rope


class ReRoPEPositionalEmbedding(_RotaryPieces):
    """ReRoPE: RoPE whose relative position stops growing past a window (Su 2023).

    Su, "Rectified Rotary Position Embeddings" (kexue.fm/archives/9708, 2023; code in the
    bojone/rerope repository). A query at ``t`` and a key at ``s <= t`` at distance
    ``d = t - s`` meet as RoPE at the rectified distance

        ``d' = d`` for ``d < window``, else ``window`` (or, with ``leak = k``, Leaky ReRoPE's
        ``window + (d - window) / k``),

    so no logit ever sees a distance beyond what training saw, at any length, with no
    fine-tuning. Computed in two passes, as the reference does: RoPE logits at the true positions
    for the pairs inside the window, and for the others queries rotated at ``window`` against
    unrotated keys (leaky: queries at ``t / k + window (1 - 1 / k)``, keys at ``s / k``). Causal
    by construction: keys after the query get ``-inf`` (``attention()`` masks them anyway).

    The reference patch also multiplies every query at position ``t`` by
    ``max(1, log(t + 1) / log(L_train))``; pass ``log_scaling_length=L_train`` for that. The
    default leaves it out: the rectification is the method, the scaling an addition of that patch.

    Cost: two ``q k^T`` products and one ``[Nq, Nk]`` select per call, with no fused SDPA path (a
    ``"logits"`` kind). Decoding: keep the raw keys in the cache (each call rotates them, twice).

    Args:
        dim (int): head dim ``Dh`` (even); also accepted as ``head_dim=``.
        window (int): distances below it are exact (the reference's default: 512).
        base (float): RoPE frequency base. Default: 10000.0.
        interleaved (bool): RoPE pairs ``(2i, 2i + 1)`` instead of ``(i, i + Dh/2)``. Default: False.
        leak (float, optional): Leaky ReRoPE's ``k > 1``. Default: None (plain ReRoPE).
        log_scaling_length (int, optional): the reference's ``L_train`` for the query scaling
            above. Default: None (no scaling).

    Shape:
        - q: ``[..., Nq, Dh]``, k: ``[..., Nk, Dh]``; positions ``[N]`` or ``[B, N]``.
        - Output of ``forward``: logits ``[..., Nq, Nk]``.

    Example:
        >>> rerope = ReRoPEPositionalEmbedding(64, window=16)
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, rerope, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    translation_invariant = True
    arguments = {"window": _check_positive_int, "leak": functools.partial(_as_float, minimum=1.0, exclusive=True)}

    def __init__(self, dim: Optional[int] = None, window: int = 512, *, base: float = 10000.0,
                 interleaved: bool = False, leak: Optional[float] = None, log_scaling_length: Optional[int] = None,
                 head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.dim = _even_int(type(self).__name__, "dim", _one_of(type(self).__name__, "dim", dim, "head_dim", head_dim))
        self.window, self.base, self.interleaved = window, base, interleaved
        self.leak, self.log_scaling_length = leak, log_scaling_length
        self.translation_invariant = log_scaling_length is None   # the query scaling reads the query's own position
        self.rope = RotaryPositionalEmbedding(self.dim, base=base, interleaved=interleaved)

    def pieces(self, pos_q, pos_k):
        return (pos_q, pos_k), self._rectified(pos_q, pos_k)

    def piece_of(self, pos_q, pos_k):
        return (pos_q.unsqueeze(-1) - pos_k.unsqueeze(-2) >= self.window).long()      # 1: past the window

    def _rectified(self, pos_q: Tensor, pos_k: Tensor) -> tuple:
        """The second pass's positions: every query at ``window``, keys at 0 (leaky: both scaled by 1 / k
        and queries shifted by ``window (1 - 1 / k)``, so that their difference is ``window + (d - window) / k``)."""
        if self.leak is None:
            return torch.full_like(pos_q, self.window), torch.zeros_like(pos_k)
        shrink = 1.0 / self.leak
        return pos_q.to(torch.float64) * shrink + self.window * (1.0 - shrink), pos_k.to(torch.float64) * shrink


class SelfExtendPositionalEmbedding(_RotaryPieces):
    """Self-Extend: a RoPE model read past its training length through grouped positions (Jin et al. 2024).

    Jin et al., "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
    arXiv:2401.01325 (code: datamllab/LongLM). Wraps a ``RotaryPositionalEmbedding``, used at
    inference with no fine-tuning. A query at ``t`` meets a key at ``s <= t`` as that RoPE does
    while the distance ``t - s`` is below ``window`` (neighbour attention). Farther pairs use
    grouped positions: the key at ``s // G``, the query at ``t // G + shift`` with the paper's
    ``shift = window - window // G``, so grouped distances take over where the window ends and
    grow ``G`` times slower. The largest distance a logit sees at length ``L`` is about
    ``window + L / G``: pick ``G`` so that it stays within the training length.

    ``shift="code"`` uses ``window - window / G`` (a float), as the authors' prefill computes it;
    their decoding path uses the paper's integer shift, so the two disagree when ``window % G != 0``.
    The default is the paper's, which keeps prefill and decoding equal.

    Cost: two ``q k^T`` products and one ``[Nq, Nk]`` select, as ReRoPE. Decoding: keep the raw
    keys in the cache; a single query over the cached keys equals the full pass's row.

    Args:
        rope (RotaryPositionalEmbedding): the model's RoPE (any layout, ``rotary_dim``, fixed
            scaling; ``dynamic`` / ``longrope``, whose spectrum follows the call's length, only fixed
            by ``at_length``).
        group_size (int): ``G``, positions per group past the window (the reference's
            ``group_size_1``; 1 leaves RoPE unchanged).
        window (int): neighbour window ``W``, distances below it are exact (``group_size_2``).
        shift (str): ``"paper"`` (``W - W // G``, the default) or ``"code"`` (``W - W / G``).
        log_scaling_length (int, optional): the reference's ``scale_base``: queries at ``t``
            multiplied by ``max(1, log(t + 1) / log(L))``. Default: None (no scaling).

    Shape:
        - q: ``[..., Nq, Dh]``, k: ``[..., Nk, Dh]``; positions ``[N]`` or ``[B, N]``.
        - Output of ``forward``: logits ``[..., Nq, Nk]``.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> extend = SelfExtendPositionalEmbedding(rope, group_size=4, window=16)
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, extend, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    arguments = {"rope": _check_wrapped_rope, "group_size": _check_positive_int, "window": _check_positive_int,
                 "shift": functools.partial(_check_choice, choices=("paper", "code"))}

    def __init__(self, rope: RotaryPositionalEmbedding, group_size: int = 8, window: int = 1024, *,
                 shift: Literal["paper", "code"] = "paper", log_scaling_length: Optional[int] = None) -> None:
        super().__init__()
        self.rope, self.group_size, self.window, self.shift = rope, group_size, window, shift
        self.log_scaling_length = log_scaling_length
        self.group_shift = window - (window // group_size if shift == "paper" else window / group_size)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, window={self.window}, shift={self.shift!r}"

    def pieces(self, pos_q, pos_k):
        group_q = torch.div(pos_q, self.group_size, rounding_mode="floor")
        if isinstance(self.group_shift, float):                                         # "code": a float shift
            group_q = group_q.to(torch.float64)
        grouped = (group_q + self.group_shift, torch.div(pos_k, self.group_size, rounding_mode="floor"))
        return (pos_q, pos_k), grouped

    def piece_of(self, pos_q, pos_k):
        return (pos_q.unsqueeze(-1) - pos_k.unsqueeze(-2) >= self.window).long()      # 1: grouped


class DualChunkPositionalEmbedding(_RotaryPieces):
    """Dual Chunk Attention: a RoPE model read past its training length in chunks (An et al. 2024).

    An et al., "Training-Free Long-Context Scaling of Large Language Models", arXiv:2402.17463
    (code: HKUNLP/ChunkLlama; vLLM's dual-chunk backend for Qwen2.5-1M). Wraps a
    ``RotaryPositionalEmbedding``. The sequence is cut into chunks of ``L = chunk_size - local_size``
    tokens. Every key at ``s`` sits at ``s mod L``; the query at ``t`` takes one of three positions,
    by how many chunks lie between them:

    * same chunk (intra): ``t mod L``, so the distance is exactly ``t - s``;
    * the previous chunk (successive): ``min(t mod L + L, chunk_size)``, exact up to ``local_size + 1``
      tokens into the chunk, then held at ``chunk_size``;
    * earlier chunks (inter): ``min(2L - 1, chunk_size)``, one position for every query.

    No logit ever sees a distance above ``chunk_size``. This is the authors' and vLLM's code (they
    agree); the paper's ``s``, ``c - 1`` and ``w`` are ``L``, ``chunk_size`` and ``local_size + 1``
    (its figure, ``s = 6, c = 10, w = 4``, is ``chunk_size=9, local_size=3``).

    ChunkLlama also multiplies q's and k's cos/sin by ``m = 0.05 ln(N / L_train) + 1`` (vLLM:
    ``0.1``, clipped at 1) when ``N`` tokens exceed the training length, which scales every logit
    by ``m^2``; the paper has no such factor. ``scaling_length=L_train`` turns it on, with
    ``N`` the call's largest key position + 1 and ``scaling_coefficient`` 0.05 (ChunkLlama) or 0.1
    (vLLM); the default leaves it out, as the paper does. ChunkLlama keeps each cached key at the
    ``m`` of the call that rotated it; here ``m`` follows the current call.

    Cost: three ``q k^T`` products and three ``[Nq, Nk]`` selects, with no fused SDPA path (a
    ``"logits"`` kind); the reference runs three flash-attention calls per chunk instead. Decoding:
    keep the raw keys in the cache; a single query over them equals the full pass's row.

    Args:
        rope (RotaryPositionalEmbedding): the model's RoPE (any layout, ``rotary_dim``, fixed
            scaling; ``dynamic`` / ``longrope`` only fixed by ``at_length``).
        chunk_size (int): the largest query position (ChunkLlama's default: 3/4 of the training length).
        local_size (int): ``chunk_size - L``, the successive-chunk reach (ChunkLlama's
            ``local_window``, default 1/8 of the training length); below ``chunk_size``.
        scaling_length (int, optional): the training length for the ``m^2`` factor above. Default: None.
        scaling_coefficient (float): the factor's slope. Default: 0.05 (ChunkLlama).

    Shape:
        - q: ``[..., Nq, Dh]``, k: ``[..., Nk, Dh]``; positions ``[N]`` or ``[B, N]``.
        - Output of ``forward``: logits ``[..., Nq, Nk]``.

    Example:
        >>> rope = RotaryPositionalEmbedding(64)
        >>> chunked = DualChunkPositionalEmbedding(rope, chunk_size=24, local_size=4)
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, chunked, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    arguments = {"rope": _check_wrapped_rope, "chunk_size": _check_positive_int,
                 "local_size": functools.partial(_as_int, minimum=0), "scaling_length": _check_positive_int,
                 "scaling_coefficient": _positive_float}

    def __init__(self, rope: RotaryPositionalEmbedding, chunk_size: int, local_size: int, *,
                 scaling_length: Optional[int] = None, scaling_coefficient: float = 0.05) -> None:
        super().__init__()
        if local_size >= chunk_size:
            raise ValueError(f"{type(self).__name__}: local_size must be below chunk_size (chunks hold "
                             f"chunk_size - local_size tokens), got local_size={local_size}, chunk_size={chunk_size}")
        self.rope, self.chunk_size, self.local_size = rope, chunk_size, local_size
        self.scaling_length, self.scaling_coefficient = scaling_length, scaling_coefficient
        self.chunk_len = chunk_size - local_size                                        # L

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, local_size={self.local_size}, chunk_len={self.chunk_len}"

    def pieces(self, pos_q, pos_k):
        within_q, within_k = torch.remainder(pos_q, self.chunk_len), torch.remainder(pos_k, self.chunk_len)
        successive = (within_q + self.chunk_len).clamp(max=self.chunk_size)
        inter = torch.full_like(pos_q, min(2 * self.chunk_len - 1, self.chunk_size))
        return (within_q, within_k), (successive, within_k), (inter, within_k)

    def piece_of(self, pos_q, pos_k):
        chunks_apart = self._chunk(pos_q).unsqueeze(-1) - self._chunk(pos_k).unsqueeze(-2)
        return chunks_apart.clamp(0, 2)                                                 # 0 intra, 1 successive, 2 inter

    def _chunk(self, positions: Tensor) -> Tensor:
        return torch.div(positions, self.chunk_len, rounding_mode="floor")

    def logits(self, q, k, positions_q, positions_k, scale):
        logits = super().logits(q, k, positions_q, positions_k, scale)
        if self.scaling_length is None or k.shape[-2] == 0:
            return logits
        length = k.shape[-2] if positions_k is None else positions_k.max() + 1
        # N within the training length (negative positions included) gives m = 1, not the log of N <= 0
        length = torch.as_tensor(length, dtype=torch.float64).clamp(min=self.scaling_length)
        m = torch.clamp(self.scaling_coefficient * torch.log(length / self.scaling_length) + 1.0, min=1.0)
        return logits * (m * m).to(logits.dtype)


class StickBreakingPositionalEmbedding(_ExplicitLogits):
    """Stick-breaking attention: no positions; each query breaks a stick from its nearest key back (Tan et al. 2024).

    Tan et al., "Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study",
    arXiv:2410.17980 (code: shawntan/stickbreaking-attention; flash-linear-attention's
    ``stickbreaking_attn``). The weights replace the softmax. With ``z_ij = scale q_i . k_j`` and
    ``beta_ij = sigmoid(z_ij)``, query ``i`` gives key ``j < i``

        ``A_ij = beta_ij prod_{j < l < i} (1 - beta_il)``,

    so the nearest earlier key takes a fraction ``beta`` of the stick, the next one a fraction of
    what is left, and so on: order comes from the keys' order, and no position is encoded. The
    weights sum to at most 1. Computed in log space, ``log A_ij = logsigmoid(z_ij) - sum_{l > j}
    softplus(z_il)`` over the visible keys (masked keys, other documents included, neither take
    nor break the stick), in float32 (float64 for float64 inputs).

    ``attend_current=True`` lets the query's own key in (``j <= i``, the product over
    ``j < l <= i``), as the reference's option. The leftover ``1 - sum_j A_ij`` is dropped by
    default, as the reference functions return it apart; ``remainder="current"`` adds it to the
    query's own value, as the reference's tests do (the authors' model uses a learned vector per
    head instead, left to the caller).

    Cost: one ``q k^T`` product, a reverse cumulative sum and a ``[Nq, Nk]`` exp, with no fused
    path (the reference's Triton kernels are not used). Causal by construction.

    Args:
        attend_current (bool): queries see their own key. Default: False.
        remainder (str): ``"drop"`` (the default) or ``"current"``: the leftover weight goes to
            the query's own value.

    Shape:
        - q: ``[..., Nq, Dh]``, k: ``[..., Nk, Dh]`` (queries are the last ``Nq`` keys); no positions.
        - Output of ``forward``: logits ``[..., Nq, Nk]`` (``-inf`` for the keys a query cannot see).

    Example:
        >>> stick = StickBreakingPositionalEmbedding()
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, stick, causal=True).shape
        torch.Size([2, 8, 100, 64])
    """

    takes_positions = False
    order_from = "the order of the keys (the stick breaks from the nearest earlier key)"
    is_causal = True  # causal by construction: later keys (and, by default, the query's own) get -inf
    arguments = {"attend_current": _check_flag,
                 "remainder": functools.partial(_check_choice, choices=("drop", "current"))}

    def __init__(self, *, attend_current: bool = False, remainder: Literal["drop", "current"] = "drop") -> None:
        super().__init__()
        self.attend_current, self.remainder = attend_current, remainder

    def logits(self, q, k, positions_q, positions_k, scale):
        q_len, k_len = q.shape[-2], k.shape[-2]
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale                          # [..., Nq, Nk]
        own = torch.arange(q_len, device=q.device) + _query_offset(q_len, k_len)          # each query's own key
        keys = torch.arange(k_len, device=q.device)
        hidden = keys > own.unsqueeze(-1) if self.attend_current else keys >= own.unsqueeze(-1)
        return logits.masked_fill(hidden, float("-inf"))

    def attention_weights(self, logits: Tensor) -> Tensor:
        log_keep = F.logsigmoid(-logits)                                                  # log(1 - beta); 0 if masked
        broken_after = log_keep.flip(-1).cumsum(-1).flip(-1) - log_keep                   # sum over later keys l > j
        weights = torch.exp(F.logsigmoid(logits) + broken_after)                          # [..., Nq, Nk]
        if self.remainder == "drop":
            return weights
        q_len, k_len = logits.shape[-2], logits.shape[-1]
        keys = torch.arange(k_len, device=logits.device)
        own = keys == (torch.arange(q_len, device=logits.device) + _query_offset(q_len, k_len)).unsqueeze(-1)
        return weights + (1.0 - weights.sum(-1, keepdim=True)) * own.to(weights.dtype)


def _householder_blocks(w: Tensor, beta: Tensor, k: Tensor) -> tuple:
    """The UT form of each block's transformations ``H_t = I - beta_t w_t w_t^T`` (rows ``t`` of a block).

    With ``T = (I + strict_tril(diag(beta) W W^T))^-1`` the block's product is
    ``H_c ... H_1 = I - W^T T diag(beta) W``, and every partial product is a corner of it.
    Returns ``w2 = T diag(beta) W`` ``[..., c, Dh]`` and ``m = T strict_tril(diag(beta) W K^T)``
    ``[..., c, c]`` (``m[a, j]``: what key ``j`` loses along ``w_a`` on its way to the block end).
    """
    c = w.shape[-2]
    bw = beta.unsqueeze(-1) * w                                                         # diag(beta) W: [..., c, Dh]
    eye = torch.eye(c, dtype=w.dtype, device=w.device)
    unit_lower = eye + torch.tril(bw @ w.transpose(-1, -2), -1)                         # I + strict_tril: [..., c, c]
    right = torch.cat([bw, torch.tril(bw @ k.transpose(-1, -2), -1)], -1)               # [..., c, Dh + c]
    solved = torch.linalg.solve_triangular(unit_lower, right, upper=False, unitriangular=True)
    return solved[..., :w.shape[-1]], solved[..., w.shape[-1]:]


def _path_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, block_size: int) -> Tensor:
    """PaTH's logits ``s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j`` (``j <= i``, the diagonal plain ``q_i . k_i``),
    blockwise; ``-inf`` after the query. q ``[..., Nq, Dh]`` (the last ``Nq`` of the ``Nk`` tokens), k and w
    ``[..., Nk, Dh]``, beta ``[..., Nk]`` -> ``[..., Nq, Nk]``.

    Per block of ``c`` tokens (``_householder_blocks``): the logits within the block, each query carried
    back to its block's start (``u_i = q_i^T H_i ... H_start``) and each key forward to its block's end.
    Then, one block distance at a time for every query block at once, the carried queries meet the keys
    of the block before them and are carried through that block's whole product ``I - W^T w2``.
    """
    q_len, k_len, c = q.shape[-2], k.shape[-2], block_size
    # while exporting, one block: the loop over blocks below is Python, so their number would pin the length
    exporting = _is_exporting()
    if exporting and not _surely(k_len <= c):
        raise ValueError(f"PaTHPositionalEmbedding: torch.export with a dynamic length needs Nk <= block_size={c} "
                         f"(one block: the blocks are a Python loop, whose count would pin the length), got a length "
                         f"that may exceed it: export with a Dim of max <= {c}, or build with a larger block_size")
    w, beta = w.expand_as(k), beta.expand(k.shape[:-1])                                 # a shared batch of 1 too
    pad = c - k_len if exporting else -k_len % c                                        # padded tokens: w = 0, H = I
    k, w, beta = F.pad(k, (0, 0, 0, pad)), F.pad(w, (0, 0, 0, pad)), F.pad(beta, (0, pad))
    # query blocks: first .. blocks - 1 (while exporting, the one block)
    blocks, first = (1, 0) if exporting else ((k_len + pad) // c, (k_len - q_len) // c)
    rows = F.pad(q, (0, 0, k_len - q_len - first * c, pad))                             # queries on their blocks' rows
    split = lambda t: t.unflatten(-2, (-1, c))                                          # [..., n, c, Dh]
    k, w, rows = split(k), split(w), split(rows)
    w2, m = _householder_blocks(w, beta.unflatten(-1, (-1, c)), k)                      # [..., nb, c, Dh], [..., nb, c, c]
    k_end = k - m.transpose(-1, -2) @ w                                                 # H_end ... H_{j+1} k_j
    qw = torch.tril(rows @ w[..., first:, :, :].transpose(-1, -2))                      # q_i . w_a, a <= i: [..., n, c, c]
    # [..., query block, row, key block, column]; blocks after the query's stay unwritten (masked below)
    out = rows.new_empty(*rows.shape[:-3], blocks - first, c, blocks, c)
    put = lambda query_blocks, key_blocks, values: out.__setitem__(
        (..., query_blocks, slice(None), key_blocks, slice(None)), values.movedim(-3, 0))
    index = lambda start, stop: torch.arange(start, stop, device=q.device)               # block indices
    put(index(0, blocks - first), index(first, blocks),
        torch.tril(rows @ k[..., first:, :, :].transpose(-1, -2)) - qw @ m[..., first:, :, :])
    carried = rows - qw @ w2[..., first:, :, :]                                         # u_i = q_i^T H_i ... H_start
    targets = index(first, blocks)                                                      # query blocks still carried
    for distance in range(1, blocks):
        if distance - 1 >= first:  # query block `distance - 1` has met every key block before it
            carried, targets = carried[..., 1:, :, :], targets[1:]
        keys = targets - distance                                                       # the key block of each
        put(targets - first, keys, carried @ k_end[..., keys, :, :].transpose(-1, -2))
        carried = carried - (carried @ w[..., keys, :, :].transpose(-1, -2)) @ w2[..., keys, :, :]
    start = k_len - q_len - first * c
    logits = out.flatten(-4, -3).flatten(-2)                                            # [..., rows, blocks c]
    if exporting:  # gathered: a view's strides would pin Nk != c
        logits = logits.index_select(-2, torch.arange(start, start + q_len, device=q.device)).index_select(
            -1, torch.arange(k_len, device=q.device))                                   # [..., Nq, Nk]
    else:
        logits = logits[..., start:start + q_len, :k_len]                               # [..., Nq, Nk]
    own = torch.arange(q_len, device=q.device) + (k_len - q_len)
    return logits.masked_fill_(torch.arange(k_len, device=q.device) > own.unsqueeze(-1), float("-inf"))


def _check_default_head_dim(owner: str, arguments: dict) -> None:
    """``head_dim`` left to its default ``dim // num_heads`` must not be 0."""
    dim, heads = arguments["dim"], arguments["num_heads"]
    if arguments["head_dim"] is None and dim is not None and dim < heads:
        raise ValueError(f"{owner}: dim must be at least num_heads when head_dim is not given (its default is "
                         f"dim // num_heads), got dim={dim} and num_heads={heads}")


def _conv_within_documents(x: Tensor, conv: nn.Conv1d, document_ids: Tensor) -> Tensor:
    """PaTH's causal depthwise ``conv`` of ``x`` ``[B, N, C]`` with no tap crossing a document boundary
    (``document_ids`` ``[N]`` or ``[B, N]``): ``[B, N, C]``. Output ``n`` reads input ``n - s`` through
    tap ``K - 1 - s`` (``F.conv1d`` left-padded), kept where both tokens share a document."""
    taps, n = conv.weight.shape[-1], x.shape[-2]
    out = x.new_zeros(()) if conv.bias is None else conv.bias.to(x.dtype)
    for shift in range(min(taps, n)):
        same = document_ids[..., shift:] == document_ids[..., :n - shift]              # [(B,) N - shift]
        same = F.pad(same, (shift, 0)).unsqueeze(-1).to(x.dtype)                     # [(B,) N, 1]
        shifted = F.pad(x, (0, 0, shift, 0))[..., :n, :]                               # x[n - shift]: [B, N, C]
        out = out + shifted * conv.weight[:, 0, taps - 1 - shift].to(x.dtype) * same
    return out


class PaTHPositionalEmbedding(_BoundTokens, _ExplicitLogits):
    """PaTH attention: positions as accumulated data-dependent Householder transformations (Yang et al. 2025).

    Yang, Shen, Wen, Tan, Mishra, Ren, Panda and Kim, "PaTH Attention: Position Encoding via
    Accumulating Householder Transformations", arXiv:2505.16381 (code: flash-linear-attention's
    ``PaTHAttention`` layer and ``path_attn`` ops). Every token ``t`` carries a transformation
    ``H_t = I - beta_t w_t w_t^T`` made from its own state, and query ``i`` meets key ``j <= i``
    through the ones between them:

        ``s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j``      (the diagonal ``j = i``: ``q_i . k_i``),

    so what lies between two tokens decides how they see each other, where RoPE's ``R^(i-j)``
    depends on the distance alone. As in the authors' layer, ``w_t`` is ``w_proj(x_t)`` (a rank-32
    factorisation by default, ``w_rank``) through a causal depthwise convolution of ``conv_size``
    taps and a SiLU (``w_conv1d``), split into heads and normalised to unit length per head
    (``w / sqrt(|w|^2 + 1e-6)``); ``beta_t = 2 sigmoid(bt_proj(x_t))`` lies in ``(0, 2)``, so
    ``H_t``'s eigenvalue along ``w_t`` is ``1 - beta_t``, negative allowed. ``w`` and ``beta`` are
    per key head (``num_kv_heads``, shared by a group of query heads). The submodules carry the
    layer's names, so its ``state_dict`` loads (the forget gate's ``g_proj`` as ``forget.fgate_proj``).

    ``forget_gate=True`` is PaTH-FoX: a ``ForgettingPositionalEmbedding`` (``forget``) adds the
    forget gate's ``c_i - c_j`` per query head. The authors' code adds it before the softmax scale
    (``scale (s_ij + c_i - c_j)``), which is the default; ``gate_scaled=False`` adds it after, as
    the Forgetting Transformer does (``scale s_ij + c_i - c_j``).

    Computed blockwise, as the paper's algorithm: within a block of ``block_size`` tokens the
    products come from one triangular solve (the UT transform); across blocks each query is carried
    through one block's product at a time. Cost: about ``3 Nq Nk Dh / 2`` multiply-adds for the
    logits (three ``c x c x Dh`` products per pair of blocks, against one for a plain causal
    ``q k^T``), plus ``O(Nk c (Dh + c))`` per head for the blocks. ``attention()`` materialises the
    float32 ``[B, H, Nq, Nk]`` logits and weights like every ``"logits"`` kind (the authors' Triton
    kernel does not; it is not used). The result does not depend on ``block_size``.

    Binding and decoding: ``path(x)`` binds the token states ``x`` ``[B, N, D]`` (``bind(w=, beta=,
    log_forget=)`` binds precomputed ``[B, Hkv, N, Dh]``, ``[B, Hkv, N]`` and ``[B, H, N]``; built with
    ``dim=None`` and ``head_dim``, the module has no projections and binds only those); keys
    are the bound tokens and the queries the last ``Nq`` of them. To decode with a KV cache, bind
    every token so far and pass the raw cached keys: a step costs a pass over the cache (the
    authors' decoder instead keeps each cached key carried to the present, ``k <- H_t k``).
    Packed sequences: with ``document_ids``, ``attention()`` restarts the short convolution at each
    document for bound token states, as the authors' layer does per sequence (bound ``w`` and ``beta``
    are used as given: compute them per document).

    Args:
        dim (int or None): token width ``D``; None: no projections (``w_rank``, ``conv_size``, ``conv_bias``
            unused), for precomputed ``w`` and ``beta`` only; ``head_dim`` is then required.
        num_heads (int): query heads ``H``.
        head_dim (int, optional): ``Dh``. Default: ``dim // num_heads``.
        num_kv_heads (int, optional): key heads, and heads of ``w`` and ``beta``. Default: ``num_heads``.
        w_rank (int, optional): rank of ``w_proj``'s factorisation; None: one ``Linear``. Default: 32.
        conv_size (int, optional): taps of the short convolution on ``w``; None: none. Default: 3.
        conv_bias (bool): the convolution has a bias. Default: False.
        forget_gate (bool): PaTH-FoX. Default: False.
        gate_scaled (bool): the softmax scale multiplies the forget gate too. Default: True.
        block_size (int): tokens per block of the blockwise algorithm. Default: 64.
        layer (nn.Module, optional): a layer whose ``w_proj``, ``w_conv1d``, ``bt_proj`` (and
            ``g_proj``, for the forget gate) to use by reference, never re-initialised: a
            flash-linear-attention ``PaTHAttention``, for instance; ``w_rank``, ``conv_size`` and
            ``conv_bias`` are then read from it. Default: None (new projections).

    Shape:
        - x: ``[B, N, D]``; q, k: ``[B, H, Nq or Nk, Dh]`` with ``Nq <= Nk <= N``, queries the last
          ``Nq`` keys; a bound batch of 1 is shared. Output of ``forward``: logits ``[B, H, Nq, Nk]``.

    Example:
        >>> path = PaTHPositionalEmbedding(512, 8)
        >>> x = torch.randn(2, 100, 512)
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, path(x), causal=True).shape
        torch.Size([2, 8, 100, 64])
        >>> w, beta = path.transitions(x)                               # or your own layer's
        >>> bare = PaTHPositionalEmbedding(None, 8, head_dim=64)          # no parameters
        >>> out = attention(q, k, v, bare.bind(w=w, beta=beta), causal=True)
    """

    order_from = "order comes from the Householder transformations of the bound tokens"
    bound_inputs = ("states", "w", "beta", "log_forget_values")   # x [B, N, D], or w, beta (and log f [B, H, N])
    arguments = {"dim": _optional_size, "head_dim": _optional_size, "num_kv_heads": _optional_size,
                 "w_rank": _optional_size, "conv_size": _optional_size, "block_size": _check_positive_int,
                 "layer": _module_or_none, "conv_bias": _check_flag, "forget_gate": _check_flag,
                 "gate_scaled": _check_flag}
    argument_rules = (_check_default_head_dim,)

    def __init__(self, dim: Optional[int], num_heads: int, head_dim: Optional[int] = None, *,
                 num_kv_heads: Optional[int] = None, w_rank: Optional[int] = 32, conv_size: Optional[int] = 3,
                 conv_bias: bool = False, forget_gate: bool = False, gate_scaled: bool = True,
                 block_size: int = 64, layer: Optional[nn.Module] = None) -> None:
        super().__init__()
        owner = type(self).__name__
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{owner}: num_heads must be a multiple of num_kv_heads, "
                             f"got num_heads={num_heads} and num_kv_heads={num_kv_heads}")
        if dim is None and (head_dim is None or layer is not None):
            raise ValueError(f"{owner}: dim=None (no projections: bind precomputed w and beta) needs head_dim and "
                             f"no layer, got head_dim={head_dim!r}"
                             + ("" if layer is None else f" and a layer ({type(layer).__name__})"))
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads
        self.head_dim = dim // num_heads if head_dim is None else head_dim
        self.block_size, self.gate_scaled = block_size, gate_scaled
        for name in self.bound_inputs:
            self.register_buffer(name, None, persistent=False)
        if layer is not None:
            self._share(layer, forget_gate)
            return
        if dim is None:   # bound to precomputed w, beta (and log f) only: nothing to project
            self.w_rank = self.conv_size = self.w_proj = self.w_conv1d = self.bt_proj = None
            self.forget = ForgettingPositionalEmbedding(None, num_heads) if forget_gate else None
            return
        self.w_rank, self.conv_size = w_rank, conv_size
        width = num_kv_heads * self.head_dim
        self.w_proj = _uninitialised(nn.Linear, dim, width, bias=False) if w_rank is None else nn.Sequential(
            _uninitialised(nn.Linear, dim, w_rank, bias=False), _uninitialised(nn.Linear, w_rank, width, bias=False))
        self.w_conv1d = None if conv_size is None else _uninitialised(
            nn.Conv1d, width, width, conv_size, groups=width, bias=conv_bias, padding=conv_size - 1)
        self.bt_proj = _uninitialised(nn.Linear, dim, num_kv_heads)
        self.forget = _uninitialised(ForgettingPositionalEmbedding, dim, num_heads) if forget_gate else None
        self.reset_parameters()

    def _share(self, layer: nn.Module, forget_gate: bool) -> None:
        """Use ``layer``'s projections by reference (its w_rank and conv_size are read from them)."""
        owner, width = type(self).__name__, self.num_kv_heads * self.head_dim
        gate = getattr(layer, "forget", None) or getattr(layer, "g_proj", None) if forget_gate else None
        needs = ("w_proj", "w_conv1d", "bt_proj") + (("g_proj",) if forget_gate else ())
        if not isinstance(layer, nn.Module) or not all(hasattr(layer, name) for name in needs[:3]) or \
                (forget_gate and gate is None):
            raise TypeError(f"{owner}: layer must be an nn.Module with {', '.join(needs)} (flash-linear-attention's "
                            f"PaTHAttention), got {type(layer).__name__}")
        if getattr(layer.bt_proj, "out_features", None) != self.num_kv_heads or \
                (layer.w_conv1d is not None and layer.w_conv1d.weight.shape[0] != width):
            raise ValueError(f"{owner}: layer's projections must make num_kv_heads={self.num_kv_heads} heads of "
                             f"head_dim={self.head_dim}, got bt_proj {layer.bt_proj} and w_conv1d {layer.w_conv1d}")
        self.w_proj, self.w_conv1d, self.bt_proj = layer.w_proj, layer.w_conv1d, layer.bt_proj
        self.w_rank = self.w_proj[0].out_features if isinstance(self.w_proj, nn.Sequential) else None
        self.conv_size = None if self.w_conv1d is None else self.w_conv1d.weight.shape[-1]
        if gate is not None and not isinstance(gate, ForgettingPositionalEmbedding):   # the layer's g_proj
            gate = ForgettingPositionalEmbedding(self.dim, self.num_heads, fgate_proj=gate)
        self.forget = gate   # shared with this encoding's bound copies, which hand it their tokens

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, num_kv_heads={self.num_kv_heads}, "
                f"w_rank={self.w_rank}, conv_size={self.conv_size}, block_size={self.block_size}"
                + ("" if self.forget is None else f", gate_scaled={self.gate_scaled}"))

    def reset_parameters(self) -> None:
        """PyTorch's default initialisation of every projection, as the authors' layer."""
        for module in (self.w_proj, self.w_conv1d, self.bt_proj):
            for part in ([] if module is None else module.modules()):
                if isinstance(part, (nn.Linear, nn.Conv1d)):
                    part.reset_parameters()
        if self.forget is not None:
            self.forget.reset_parameters()

    # -- binding ------------------------------------------------------------------------

    def bind(self, x: Optional[Tensor] = None, *, w: Optional[Tensor] = None, beta: Optional[Tensor] = None,
             log_forget: Optional[Tensor] = None) -> "PaTHPositionalEmbedding":
        """A bound encoding sharing this one's modules: on token states ``x`` ``[B, N, D]``, or on
        precomputed ``w`` ``[B, Hkv, N, Dh]`` and ``beta`` ``[B, Hkv, N]`` (and, with the forget gate,
        ``log_forget`` ``[B, H, N]``)."""
        owner = type(self).__name__
        if (x is None) == (w is None and beta is None):
            raise ValueError(f"{owner}: bind takes either x or w and beta")
        if x is not None:
            inputs = {"states": self._check_states(x)}
        else:
            inputs = {**self._check_transitions(w, beta), **self._check_log_forget(log_forget)}
        return self._bound_copy(**inputs)

    def _sibling(self) -> "PaTHPositionalEmbedding":
        return type(self)(self.dim, self.num_heads, self.head_dim, num_kv_heads=self.num_kv_heads,
                          forget_gate=self.forget is not None, gate_scaled=self.gate_scaled,
                          block_size=self.block_size, layer=None if self.dim is None else self)

    def _check_transitions(self, w: Optional[Tensor], beta: Optional[Tensor]) -> dict:
        owner = type(self).__name__
        _check_tensor(owner, "w", w, 4)
        _check_tensor(owner, "beta", beta, 3)
        heads, width = self.num_kv_heads, self.head_dim
        if w.dim() != 4 or w.shape[1] != heads or w.shape[-1] != width or beta.shape != w.shape[:-1]:
            raise ValueError(f"{owner}: w and beta must be [B, Hkv={heads}, N, Dh={width}] and [B, Hkv={heads}, N], "
                             f"got {tuple(w.shape)} and {tuple(beta.shape)}")
        return {"w": w, "beta": beta}

    def _check_log_forget(self, log_forget: Optional[Tensor]) -> dict:
        if (log_forget is None) != (self.forget is None):
            raise ValueError(f"{type(self).__name__}: bind takes log_forget with w and beta exactly when "
                             f"forget_gate=True, got forget_gate={self.forget is not None} and "
                             f"log_forget={'None' if log_forget is None else 'a tensor'}")
        if log_forget is None:
            return {}
        self.forget.bind(log_forget=log_forget)                                         # its checks
        return {"log_forget_values": log_forget}

    def transitions(self, x: Optional[Tensor] = None) -> tuple:
        """``(w, beta)`` of the tokens ``x`` ``[B, N, D]`` (default: the bound ones): unit ``w``
        ``[B, Hkv, N, Dh]`` and ``beta`` ``[B, Hkv, N]``. The projections run in their weights' dtype
        (as the authors' layer), the normalisation and the sigmoid in float32 (float64 for float64
        weights)."""
        if x is None and self.w is not None:
            return self.w, self.beta
        if x is None:
            x = self.states if self.states is not None else self._unbound()
        return self._transitions(self._check_states(x))

    def _transitions(self, x: Tensor, document_ids: Optional[Tensor] = None) -> tuple:
        """``transitions`` of checked states ``x``; with ``document_ids`` ``[N]`` or ``[B, N]``, the short
        convolution restarts at every document (as the authors' layer does per ``cu_seqlens`` sequence)."""
        x = x.to(self.bt_proj.weight.dtype)                                             # the projections' dtype
        dtype = _compute_dtype(x.dtype)
        w = self.w_proj(x)                                                              # [B, N, Hkv Dh]
        if self.w_conv1d is not None and document_ids is not None:
            w = F.silu(_conv_within_documents(w, self.w_conv1d, document_ids))          # [B, N, Hkv Dh]
        elif self.w_conv1d is not None:  # causal depthwise: left-padded, the first N outputs
            conv = self.w_conv1d
            w = F.conv1d(w.transpose(-1, -2), conv.weight, conv.bias, padding=conv.weight.shape[-1] - 1,
                         groups=conv.weight.shape[0])[..., :x.shape[-2]]
            w = F.silu(w).transpose(-1, -2)
        w = w.unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2).to(dtype)  # [B, Hkv, N, Dh]
        w = w * torch.rsqrt(w.square().sum(-1, keepdim=True) + 1e-6)
        beta = 2 * torch.sigmoid(self.bt_proj(x).to(dtype)).transpose(-1, -2)           # [B, Hkv, N]
        return w, beta

    # -- the logits ---------------------------------------------------------------------

    def _for_documents(self, document_ids, k_len):
        if document_ids is None or self.states is None or self.w_conv1d is None:
            return self
        # packed documents: the keys' transitions with the convolution restarted per document
        w, beta = self._transitions(self.states[..., :k_len, :], document_ids)
        return self._bound_copy(states=self.states, w=w, beta=beta)

    def logits(self, q, k, positions_q, positions_k, scale):
        q_len, k_len = q.shape[-2], k.shape[-2]
        w, beta = self.transitions()
        group = q.shape[-3] // w.shape[-3]                                              # query heads per w head
        w = w[..., :k_len, :].to(q).repeat_interleave(group, -3)                        # [B, H, Nk, Dh]
        beta = beta[..., :k_len].to(q).repeat_interleave(group, -2)                     # [B, H, Nk]
        logits = _path_logits(q * scale, k, w, beta, self.block_size)                  # [B, H, Nq, Nk]
        if self.forget is None:
            return logits
        forget = self.forget.bind(self.states) if self.states is not None else \
            self.forget.bind(log_forget=self.log_forget_values)
        gate = forget.attention_bias(q_len, k_len, device=q.device).to(logits)         # c_i - c_j: [B, H, Nq, Nk]
        return logits + (gate * scale if self.gate_scaled else gate)


# ---------------------------------------------------------------------------
# Wrappers: an encoding of any kind, with the positions it sees changed
# ---------------------------------------------------------------------------

def _check_position_taking(owner: str, name: str, encoding) -> PositionalEmbedding:
    """A one-axis encoding that takes positions (the ones a wrapper can change)."""
    if not isinstance(encoding, PositionalEmbedding):
        raise TypeError(f"{owner}: {name} must be a PositionalEmbedding, got {type(encoding).__name__}")
    if not encoding.takes_positions:   # order_from reads as a clause of its own ("positions are ...", "the order ...")
        raise ValueError(f"{owner}: {name} must take positions, got {type(encoding).__name__}, which takes none "
                         f"({encoding.order_from or 'its order comes from the content'})")
    if encoding.num_axes != 1:
        raise ValueError(f"{owner}: {name} must take one position axis, got {type(encoding).__name__} "
                         f"with num_axes={encoding.num_axes}")
    return encoding


def _check_randomized_encoding(owner: str, arguments: dict) -> None:
    """The wrapped encoding of ``RandomizedPositionalEmbedding``: not another such wrapper (one draw per call),
    and, where it reads a table of ``max_len`` rows (learned, Abacus, TUPE) or the ``num_tokens`` tokens of a window
    (Swin's and the continuous window biases), every drawn position within it (a draw past it would fail at
    random steps of training)."""
    encoding, max_len = arguments["encoding"], arguments["max_len"]
    if isinstance(encoding, RandomizedPositionalEmbedding):
        raise ValueError(f"{owner}: encoding must not be a {type(encoding).__name__} itself (one draw serves a "
                         f"call; wrap its .encoding instead), got {type(encoding).__name__}(max_len={encoding.max_len})")
    for bound in ("max_len", "num_tokens"):
        rows = getattr(encoding, bound, None)
        if isinstance(rows, int) and max_len > rows:
            raise ValueError(f"{owner}: max_len must be at most the wrapped {type(encoding).__name__}'s {bound}={rows} "
                             f"(positions are drawn from [0, max_len) and index its "
                             f"{'table' if bound == 'max_len' else 'window'}), got max_len={max_len}")


def _on_drawn_positions(name: str):
    """The wrapper's hook ``name``: the call's positions resolved once (drawn in training), then the wrapped
    encoding's hook of that name. Every hook takes ``(q, k)`` tensors or ``(q_len, k_len)`` lengths first."""

    def hook(self, q, k, positions_q=None, positions_k=None, **kwargs):
        if isinstance(q, Tensor):   # read for their lengths before the wrapped encoding checks them
            _check_tensor(type(self).__name__, "q", q, 2)
            _check_tensor(type(self).__name__, "k", k, 2)
        lengths = (q.shape[-2], k.shape[-2]) if isinstance(q, Tensor) else (q, k)
        device = q.device if isinstance(q, Tensor) else kwargs.get("device")
        positions_q, positions_k = self._resolve_positions(*lengths, positions_q, positions_k, device)
        return self._named(getattr(self.encoding, name), q, k, positions_q, positions_k, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


def randomized_positions(n: int, max_len: int, *, generator: Optional[torch.Generator] = None,
                         device=None) -> Tensor:
    """``n`` distinct positions drawn uniformly from ``[0, max_len)``, sorted: the training positions of
    randomized positional encodings (Ruoss et al., "Randomized Positional Encodings Boost Length
    Generalization of Transformers", arXiv:2305.16843), which ``RandomizedPositionalEmbedding`` draws.

    The draw is ``randperm(max_len)`` on the generator's device (the CPU without one) cut to ``n`` and
    sorted, so a seeded generator gives the wrapper's positions.

    Args:
        n (int): the number of positions (tokens), at most ``max_len``.
        max_len (int): ``L``, positions are drawn from ``[0, L)``.
        generator (torch.Generator, optional): the source of the draw. Default: torch's global one.
        device (optional): the device of the result. Default: the generator's device.

    Returns:
        int64 ``[n]``.

    Example:
        >>> randomized_positions(5, 100, generator=torch.Generator().manual_seed(0)).tolist()
        [19, 44, 71, 90, 93]
    """
    return _draw_positions("randomized_positions", n, max_len, generator, device)


def _draw_positions(owner: str, n, max_len, generator, device) -> Tensor:
    """``randomized_positions``, its checks naming ``owner``."""
    n, max_len = _as_int(owner, "n", n, minimum=0), _check_positive_int(owner, "max_len", max_len)
    _check_generator(owner, generator)
    device = _as_device(owner, "device", device)
    if n > max_len:
        raise ValueError(f"{owner}: a sequence of {n} tokens needs max_len >= {n}, got max_len={max_len}")
    generator_device = generator.device if generator is not None else "cpu"
    drawn = torch.randperm(max_len, generator=generator, device=generator_device)[:n]   # distinct: [n]
    return drawn.sort().values.to(device)


class RandomizedPositionalEmbedding(PositionalEmbedding):
    """Randomized positions: train on positions drawn from a range longer than the sequence (Ruoss et al. 2023).

    Ruoss et al., "Randomized Positional Encodings Boost Length Generalization of Transformers",
    arXiv:2305.16843 (code: google-deepmind/randomized_positional_encodings). Wraps any one-axis
    encoding that takes positions, of any kind. In training mode, every call that leaves the
    positions to their defaults instead draws ``Nk`` distinct positions uniformly from
    ``[0, max_len)`` and sorts them: keys take them in order, queries the last ``Nq`` (as the
    defaults' bottom-right rule). So a model trained on short sequences has seen every position
    up to ``max_len``, and in eval mode, where the defaults ``arange`` are used, it runs at any
    length up to ``max_len`` on positions it knows. One draw serves a whole call (every sequence of
    the batch and every hook: rotation, bias, logits, value term), as in the reference.

    Explicit positions (and ``attention()``'s document positions) pass through unchanged. For
    calls that rotate q and k separately (``rope(q)``, ``rope(k)``), draw once with ``draw(n)``
    and pass the positions to both. ``generator`` seeds the draws (reproducible training).
    ``torch.compile(fullgraph=True)`` traces the training draw from torch's global generator
    (``generator=None``, seeded by ``torch.manual_seed``) but not from a seeded ``generator``, which
    dynamo cannot pass to an op: draw outside the compiled code instead, ``p = pe.draw(Nk)``, and pass
    ``positions_q=p[-Nq:], positions_k=p`` (without ``fullgraph`` the draw is a graph break).

    The reference's Transformer-XL and ALiBi variants draw relative distances instead of
    positions; they are not implemented (drawn positions give those encodings differences of
    sorted draws).

    Args:
        encoding (PositionalEmbedding): the encoding to feed (one position axis, takes positions).
        max_len (int): ``L``, positions are drawn from ``[0, L)``; at least the longest sequence.
        generator (torch.Generator, optional): the source of the draws. Default: torch's global one.

    Shape:
        - As ``encoding``'s. ``forward`` is its own call for ``"input"`` and ``"bias"`` kinds; for
          ``"qk"`` and ``"logits"`` kinds the logits ``forward_attn(q, k, positions_q, positions_k)``.

    Example:
        >>> rope = RandomizedPositionalEmbedding(RotaryPositionalEmbedding(64), max_len=1024,
        ...                                      generator=torch.Generator().manual_seed(0))
        >>> q, k, v = torch.randn(3, 2, 8, 100, 64).unbind(0)
        >>> attention(q, k, v, rope, causal=True).shape                 # training: sorted draws from [0, 1024)
        torch.Size([2, 8, 100, 64])
        >>> out = attention(q, k, v, rope.eval(), causal=True)          # eval: arange(100), plain RoPE
    """

    arguments = {"encoding": _check_position_taking, "max_len": _check_positive_int}
    argument_rules = (_check_randomized_encoding,)
    indexes_first = False   # a bias's per-logit score_mod needs default positions; this wrapper's are drawn

    def __init__(self, encoding: PositionalEmbedding, max_len: int, *,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        _check_generator(type(self).__name__, generator)
        self.encoding, self.max_len, self.generator = encoding, max_len, generator
        self.kind, self.integer_positions = encoding.kind, encoding.integer_positions
        self.translation_invariant = encoding.translation_invariant

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, seeded={self.generator is not None}"

    @property
    def num_heads(self) -> Optional[int]:
        return getattr(self.encoding, "num_heads", None)

    @property
    def head_dim(self) -> Optional[int]:
        return getattr(self.encoding, "head_dim", None)

    @property
    def is_causal(self) -> bool:
        return self.encoding.is_causal

    def draw(self, n: int, device=None) -> Tensor:
        """``n`` distinct positions drawn uniformly from ``[0, max_len)``, sorted: ``[n]`` int64
        (``randomized_positions`` with this module's ``max_len`` and ``generator``). ``n`` is an int in
        ``[0, max_len]`` (0 gives no positions; a bool, a float or a negative count is an error)."""
        return _draw_positions(type(self).__name__, n, self.max_len, self.generator, device)

    def _resolve_positions(self, q_len: int, k_len: int, positions_q: Optional[Tensor],
                           positions_k: Optional[Tensor], device) -> tuple:
        if not self.training or positions_q is not None or positions_k is not None:
            return positions_q, positions_k
        if q_len > k_len:
            raise ValueError(f"{type(self).__name__}: drawn positions need Nq <= Nk (queries are the last Nq "
                             f"keys), got Nq={q_len}, Nk={k_len}")
        positions_k = self.draw(k_len, device)
        return positions_k[k_len - q_len:], positions_k

    def forward(self, *args, **kwargs):
        """The wrapped encoding's own call, on drawn positions: ``(x, positions)`` for ``"input"`` kinds,
        ``(q_len, k_len, positions_q, positions_k)`` (the bias) for ``"bias"`` kinds, else the logits
        ``forward_attn(q, k, ...)``: a rotation of one tensor alone could not share its draw with the other."""
        if not isinstance(self.encoding, _AttentionEncoding):
            return self._forward_input(*args, **kwargs)
        if isinstance(self.encoding, _PairwiseBias):
            return self.attention_bias(*args, **kwargs)
        if len(args) < 2 and "k" not in kwargs:   # pe(q) as for a plain RoPE: q and k must share one draw
            raise TypeError(f"{type(self).__name__}: forward of a wrapped {self.kind!r} encoding takes q and k and "
                            f"returns their logits (one draw serves both), got {len(args)} positional argument(s); "
                            f"to encode q alone, draw once, p = pe.draw(n), and call pe.encoding(q, p)")
        return self.forward_attn(*args, **kwargs)

    def forward_input(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        return x if isinstance(self.encoding, _AttentionEncoding) else self(x, positions)

    def _attention(self, q, k, v, positions_q, positions_k, call):
        # the wrapped encoding's path, run by this wrapper: its hooks take the positions drawn for the call
        return type(self.encoding)._attention(self, q, k, v, positions_q, positions_k, call)

    def _forward_input(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        if self.training and positions is None:
            if offset != 0:
                raise ValueError(f"{type(self).__name__}: offset={offset} in training mode, where positions "
                                 "are drawn; pass positions, or offset in eval mode")
            positions = self.draw(x.shape[-2], x.device)
        return self._named(self.encoding, x, positions, offset=offset)

    def _check_qk(self, q, k, positions_q, positions_k, grouped=False):
        return self._named(self.encoding._check_qk, q, k, positions_q, positions_k, grouped)

    def _check_attention_shapes(self, q, k, v):
        self._named(self.encoding._check_attention_shapes, q, k, v)

    def _named(self, hook, *args, **kwargs):
        """``hook(*args, **kwargs)`` of the wrapped encoding; its errors name this wrapper, as the
        class the user called, and then the wrapped one."""
        try:
            return hook(*args, **kwargs)
        except (TypeError, ValueError) as error:
            inner, message = type(self.encoding).__name__, str(error)
            if message.startswith(inner + ": "):
                message = message[len(inner) + 2:]
            raise type(error)(f"{type(self).__name__}: {message} (in the wrapped {inner})") from None

    def reset_parameters(self) -> None:
        self.encoding.reset_parameters()

    def logit_scale(self, head_dim: int) -> float:
        return self.encoding.logit_scale(head_dim)

    # every attention hook: the positions drawn once per call, then the wrapped encoding's hook
    encode_qk = _on_drawn_positions("encode_qk")
    attention_bias = _on_drawn_positions("attention_bias")
    score_mod = _on_drawn_positions("score_mod")
    full_precision_logits = _on_drawn_positions("full_precision_logits")
    forward_attn = _on_drawn_positions("forward_attn")

    def attention_values(self, weights, positions_q=None, positions_k=None):
        return self._named(self.encoding.attention_values, weights, positions_q, positions_k)

    def encode_v(self, v, q_len, positions_q=None, positions_k=None):
        _check_tensor(type(self).__name__, "v", v, 2)
        positions_q, positions_k = self._resolve_positions(q_len, v.shape[-2], positions_q, positions_k, v.device)
        return self._named(self.encoding.encode_v, v, q_len, positions_q, positions_k)

    def decode_output(self, out, k_len, positions_q=None, positions_k=None):
        _check_tensor(type(self).__name__, "out", out, 2)
        positions_q, positions_k = self._resolve_positions(out.shape[-2], k_len, positions_q, positions_k, out.device)
        return self._named(self.encoding.decode_output, out, k_len, positions_q, positions_k)

    def attention_weights(self, logits):
        return self.encoding.attention_weights(logits)

    def _for_documents(self, document_ids, k_len):
        # itself: the encodings it wraps take positions, none binds token states read across documents (PaTH's)
        return self


# ---------------------------------------------------------------------------
# Hugging Face configs (from_config)
# ---------------------------------------------------------------------------

# Pure functions, one per class, mapping a Hugging Face model config (the config object or
# its ``to_dict()``, or a raw ``config.json`` dict) to the keyword arguments that make our
# class compute what that model computes. ``Cls.from_config(config)`` is
# ``cls(**_cls_kwargs_from_config(config))``. They read what transformers 5.x reads
# (``modeling_rope_utils.py`` and each model's rotary / bias code), including the legacy
# spellings (``rope_scaling``, ``rope_theta``, ``rotary_pct``, ``rotary_emb_base``, ``"type"``)
# that old ``config.json`` files still carry. No transformers import is needed.

# Models whose rotate_half pairs channels (2i, 2i+1) instead of (i, i + R/2) (DeepSeek's
# apply_rotary_pos_emb_interleave and the complex-number rotations included).
_INTERLEAVED_ROPE_MODELS = {
    "gptj", "codegen", "cohere", "cohere2", "cohere2_moe", "glm", "glm4", "helium", "llama4", "llama4_text",
    "ernie4_5", "ernie4_5_moe", "glm4v", "glm4v_text", "glm_ocr", "glm_ocr_text", "moonshine", "moonshine_streaming",
    "openai_privacy_filter", "pe_audio", "pe_audio_encoder", "pe_video", "pe_video_encoder", "pe_audio_video",
    "pe_audio_video_encoder", "deepseek_v2", "deepseek_v4", "hy_v4_vl", "hy_v4_vl_text", "bailing_hybrid",
    "glm_moe_dsa", "longcat_flash", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text",
}


# Models with a fixed base 10000 and ``rotary_dim`` in channels (GPT-J's sinusoid table).
_ROTARY_DIM_MODELS = {"gptj", "codegen"}


# Models whose rotated slice is int(head_dim * partial_rotary_factor) channels, which their qk_rope_head_dim
# already equals, so the factor applies once: DeepSeek-V4 rotates the trailing slice of its heads (from_config
# says so), Mistral 4 its separate rope part (from_config describes that part: dim = rotary_dim = its width).
_ROPE_SLICE_MODELS = {"deepseek_v4", "mistral4", "mistral_large4", "mistral_large4_text"}


# transformers' defaults when a raw config.json omits the field.
_PARTIAL_ROTARY_DEFAULTS = {"gpt_neox": 0.25, "phi": 0.5}


# M-RoPE models: (default mrope_section, section layout); Qwen3-VL interleaves its sections.
_MROPE_MODELS = {
    "qwen2_vl": ([16, 24, 24], "contiguous"), "qwen2_vl_text": ([16, 24, 24], "contiguous"),
    "qwen2_5_vl": ([16, 24, 24], "contiguous"), "qwen2_5_vl_text": ([16, 24, 24], "contiguous"),
    "qwen3_vl": ([24, 20, 20], "interleaved"), "qwen3_vl_text": ([24, 20, 20], "interleaved"),
    "qwen3_vl_moe": ([24, 20, 20], "interleaved"), "qwen3_vl_moe_text": ([24, 20, 20], "interleaved"),
    "qwen3_5": ([11, 11, 10], "interleaved"), "qwen3_5_text": ([11, 11, 10], "interleaved"),
    "qwen3_5_moe": ([11, 11, 10], "interleaved"), "qwen3_5_moe_text": ([11, 11, 10], "interleaved"),
    "qwen4_exp": ([11, 11, 10], "interleaved"), "qwen4_exp_text": ([11, 11, 10], "interleaved"),
    "qwen3_omni_moe_text": ([24, 20, 20], "interleaved"), "qwen3_omni_moe_thinker": ([24, 20, 20], "interleaved"),
    "qwen3_omni_moe_talker_text": ([24, 20, 20], "interleaved"),
    "cosmos3_edge": ([24, 20, 20], "interleaved"), "cosmos3_edge_text": ([24, 20, 20], "interleaved"),
    "hy_v4_vl": ([24, 20, 20], "interleaved"), "hy_v4_vl_text": ([24, 20, 20], "interleaved"),
    "glm4v": ([8, 12, 12], "contiguous"), "glm4v_text": ([8, 12, 12], "contiguous"),
    "glm_ocr": ([8, 12, 12], "contiguous"), "glm_ocr_text": ([8, 12, 12], "contiguous"),
    "paddleocr_vl": ([16, 24, 24], "contiguous"), "paddleocr_vl_text": ([16, 24, 24], "contiguous"),
    "qwen2_5_omni_text": ([16, 24, 24], "contiguous"), "qwen2_5_omni_thinker": ([16, 24, 24], "contiguous"),
    "qwen2_5_omni_talker": ([16, 24, 24], "contiguous"),
    "ernie4_5_vl_moe": ([22, 22, 20], "alternating"), "ernie4_5_vl_moe_text": ([22, 22, 20], "alternating"),
}


# Models whose mrope_section lists its axes (h, w, t) while their position ids are (t, h, w): ERNIE-4.5-VL.
_HWT_SECTION_MODELS = {"ernie4_5_vl_moe", "ernie4_5_vl_moe_text"}


# Models with an XD-RoPE (HunYuan-VL): contiguous sections from mrope_section or the legacy xdrope_section.
_XDROPE_MODELS = {"hunyuan_vl", "hunyuan_vl_text"}


# Models whose "dynamic" rope type with an ``alpha`` is a fixed NTK base (transformers' "ntk_alpha").
_NTK_ALPHA_MODELS = {"hunyuan_v1_dense", "hunyuan_v1_moe", *_XDROPE_MODELS}


# Model types that use RoPE even when a raw config.json names none of its fields.
_ROPE_DEFAULT_MODELS = _ROTARY_DIM_MODELS | set(_PARTIAL_ROTARY_DEFAULTS) | set(_MROPE_MODELS)


# rope_parameters keys that become constructor arguments (or are spelled differently) rather
# than entries of ``scaling``.
_ROPE_KEYS_NOT_SCALING = {"rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section",
                          "mrope_interleaved", "llama_4_scaling_beta", "xdrope_section", "alpha"}


# The model types whose RoPE ``from_config`` reads exactly: each one is held against the model's own
# rotary module and ``apply_rotary_pos_emb`` (same q, k and positions, every rope type its config
# accepts) by ``TestRotary.test_model_type_matches_its_module`` with the pinned transformers (5.24.0);
# docs/model_parity.md lists the same names (a test compares them). Any other model type needs the layout
# stated by the caller.
_ROPE_MODEL_TYPES = frozenset({
    "EvollaModel", "afmoe", "apertus", "apertus1p5", "apertus1p5_text", "arcee", "aria", "aria_text", "axk1",
    "axk2", "bailing_hybrid", "bamba", "beam", "bitnet", "chameleon", "codegen", "cohere", "cohere2",
    "cohere2_moe", "cosmos3_edge", "cosmos3_edge_text", "csm", "csm_depth_decoder_model", "cwm", "dbrx",
    "deepseek_ocr2", "deepseek_ocr2_encoder", "deepseek_ocr2_text", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "dia_decoder", "dia_encoder", "diffllama", "doge", "dory", "dots1",
    "dots3_note", "dots3_note_audio_encoder", "dots3_note_text", "embedding_gemma2", "embedding_gemma2_text",
    "emu3", "emu3_text_model", "ernie4_5", "ernie4_5_moe", "esmc", "eurobert", "evolla", "exaone4",
    "exaone_moe", "falcon", "falcon_h1", "flex_olmo", "flint", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma3n", "gemma3n_text", "gemma4_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_text", "glm_moe_dsa",
    "glm_ocr", "glm_ocr_text", "glmasr", "glmasr_encoder", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj",
    "gradium_phonon_tts", "granite", "granite4_vision", "granite4_vision_text", "granite_docling",
    "granite_docling_text", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "gte", "helium", "higgs_audio_v2", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "hunyuan_vl", "hunyuan_vl_text", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text", "pixtral",
    "hy_v3", "hy_v4", "hy_v4_vl", "hy_v4_vl_text", "hyperclovax", "idefics", "jais2", "jetmoe",
    "jina_embeddings_v3", "kolibri1", "kyutai_speech_to_text", "lara_mini", "lasr_encoder", "lfm2", "lfm2_moe",
    "llama", "llama4", "llama4_text", "longcat_flash", "mimi", "mimi_decoder", "mimi_encoder", "mimo_v2_flash",
    "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text", "ministral", "ministral3",
    "mistral", "mistral4", "mixtral", "mllama", "mllama_text_model", "modernbert", "modernbert-decoder",
    "molmo2", "molmo2_text", "moonshine", "moonshine_streaming", "moshi", "muse_glimmer",
    "muse_glimmer_assistant", "muse_glimmer_text", "muse_spark", "muse_spark_text", "nemotron",
    "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_word_timestamp", "nemotron3_diarization_audio",
    "neomme", "neucodec", "nomic_bert", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe",
    "openai_privacy_filter", "paddleocr_vl", "paddleocr_vl_text", "pe_audio_encoder", "pe_audio_video_encoder",
    "pe_video_encoder", "persimmon", "phi", "phi3", "phi4_multimodal", "pocket_tts", "pocket_tts_audio_tokenizer",
    "pocket_tts_audio_tokenizer_decoder", "pocket_tts_audio_tokenizer_encoder", "qwen2", "qwen2_5_omni_talker",
    "qwen2_5_omni_text", "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_moe", "qwen2_vl",
    "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
    "qwen3_next", "qwen3_omni_moe_text", "qwen3_omni_moe_thinker", "qwen3_vl", "qwen3_vl_moe",
    "qwen3_vl_moe_text", "qwen3_vl_text", "qwen4_exp", "qwen4_exp_text", "recurrent_gemma", "seed_oss",
    "smollm3", "solar_open", "stablelm", "starcoder2", "step3p5", "step3p7", "t5_gemma_module",
    "t5gemma2_decoder", "t5gemma2_encoder", "t5gemma2_text", "timesfm2_5", "ultrabert", "unlimited_ocr",
    "unlimited_ocr_text", "vaultgemma", "voxtral_realtime", "voxtral_realtime_encoder", "voxtral_realtime_text",
    "xcodec2", "youtu", "zamba2",
})


# Model types refused whatever the caller states: (config field, why no keyword expresses the model).
_MISTRAL_LARGE4_REFUSAL = ("rope_parameters", "Mistral Large 4's frequencies carry a factor exp(alpha) learned in "
                           "the checkpoint, and some layers are NoPE; use layer_encodings(config, rope_alpha=...) "
                           "with the checkpoint's model.rotary_emb.alpha")
_ROPE_REFUSED = {
    "nanochat": ("model_type", "NanoChat's rotate_half turns every pair by minus the angle, so its q . k depends "
                 "on m - n where RoPE's depends on n - m; no keyword expresses it"),
    "mistral_large4": _MISTRAL_LARGE4_REFUSAL, "mistral_large4_text": _MISTRAL_LARGE4_REFUSAL,
}


def _per_layer_type(params) -> bool:
    """Whether ``rope_parameters`` hold one dict per layer type (Gemma 3, DeepSeek-V4) rather than one RoPE."""
    return bool(params) and all(isinstance(value, dict) or value is None for value in dict(params).values())


def _config_get(config, name: str, default=None):
    """``config.name`` for a config object, ``config[name]`` for a dict; None counts as missing.

    Should move to the helpers section (shared by the three ``from_config``).
    """
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def _config_first(config, names: tuple, default=None):
    """The first of ``names`` that ``config`` sets (configs spell sizes differently: n_head, n_embd)."""
    for name in names:
        value = _config_get(config, name)
        if value is not None:
            return value
    return default


def _text_config(owner: str, config):
    """The config that describes the text decoder: ``text_config`` for VLM configs, else itself."""
    if config is None or isinstance(config, (str, bytes, int, float, bool, list, tuple)):
        raise TypeError(f"{owner}: config must be a Hugging Face config object or its to_dict(), "
                        f"got {type(config).__name__}")
    text = _config_get(config, "text_config")
    return config if text is None else text


def _model_type(config, text) -> str:
    return str(_config_get(text, "model_type") or _config_get(config, "model_type") or "")


def _head_count(owner: str, config) -> int:
    heads = _config_first(config, ("num_attention_heads", "n_head", "num_heads", "n_heads"))
    if heads is None:
        raise ValueError(f"{owner}: config sets none of num_attention_heads / n_head / num_heads / n_heads")
    return int(heads)


def _layer_override(config, layer_type: Optional[str]) -> dict:
    """Per-layer-type overrides (Gemma 4 ``per_layer_config``: full-attention layers use a larger head_dim)."""
    per_layer = _config_get(config, "per_layer_config")
    if layer_type is None or not per_layer:
        return {}
    if not isinstance(per_layer, dict):   # transformers' view: indexable by layer type
        try:
            view = per_layer[layer_type]
        except (KeyError, ValueError, TypeError, IndexError):
            return {}
        return {"head_dim": getattr(view, "head_dim", None)}
    layer_types = _config_get(config, "layer_types") or []
    for index, kind in enumerate(layer_types):
        override = per_layer.get(str(index), per_layer.get(index, per_layer.get(f"{index:02d}")))
        if kind == layer_type and override:
            return dict(override)
    return {}


def _rotary_kwargs_from_config(config, *, layer_type: Optional[str] = None, interleaved: Optional[bool] = None,
                               rotary_dim: Optional[int] = None, sections: Optional[list] = None,
                               section_layout: Optional[str] = None, spectrum_only: bool = False) -> dict:
    """Keyword arguments of ``RotaryPositionalEmbedding`` reproducing a Hugging Face model's RoPE.

    Reads, as transformers does: the head dim (``qk_rope_head_dim`` for DeepSeek's MLA, else
    ``head_dim``, else ``hidden_size / num_attention_heads``); ``rope_parameters`` (or the
    legacy ``rope_scaling`` + ``rope_theta``); the rotated fraction (``partial_rotary_factor``,
    GPT-NeoX's ``rotary_pct``, GPT-J's ``rotary_dim``); the pair layout (GPT-J, CodeGen, Cohere,
    GLM and DeepSeek's ``rope_interleave`` pair channels ``(2i, 2i+1)``); M-RoPE ``mrope_section``
    and Qwen3-VL's interleaved sections (``mrope_interleaved`` or the model type). VLM configs
    are read through their ``text_config``. Configs with one RoPE per layer type (Gemma 3/4)
    need ``layer_type`` (e.g. ``"full_attention"``).

    Only the model types of ``_ROPE_MODEL_TYPES`` (each tested against its transformers module) are
    read on trust; any other one raises a ``ValueError`` unless the caller states the pair layout
    (``interleaved=``) and, for a config with ``mrope_section``, the ``section_layout=``. Given keywords
    (``interleaved``, ``rotary_dim``, ``sections``, ``section_layout``) override what the config says.

    ``spectrum_only`` reads a refused model type's rope fields anyway (``layer_encodings`` takes
    Mistral Large 4's spectrum so, and adds the checkpoint's learned factor).

    Returns a dict with keys among ``dim, base, interleaved, rotary_dim, scaling, sections,
    section_layout, axis_spectrum, rotated_channels, rotate_values``; ``scaling`` is a
    ``rope_parameters`` dict carrying the lengths the scaling reads from the model config
    (``original_max_position_embeddings``, ``max_position_embeddings``).
    """
    owner = "RotaryPositionalEmbedding.from_config"
    if _diffusers_class_name(owner, config) is not None:
        return _diffusers_kwargs("RotaryPositionalEmbedding", config, {
            "layer_type": layer_type, "interleaved": interleaved, "rotary_dim": rotary_dim, "sections": sections,
            "section_layout": section_layout})
    text = _text_config(owner, config)
    model_type = _model_type(config, text)
    if _config_get(text, "alibi") is True:
        raise ValueError(f"{owner}: config has alibi=True ({model_type or 'Falcon'}): the model uses ALiBi, not "
                         f"RoPE; use ALiBiPositionalEmbedding.from_config")
    if interleaved is not None:
        interleaved = _check_flag(owner, "interleaved", interleaved)
    if model_type in _ROPE_REFUSED and not spectrum_only:
        field, why = _ROPE_REFUSED[model_type]
        raise ValueError(f"{owner}: model_type={model_type!r} is not supported ({field}): {why}")
    params = _config_get(text, "rope_parameters") or _config_get(text, "rope_scaling") or {}
    params = dict(params)
    per_layer_type = _per_layer_type(params)
    if model_type == "deepseek_v4" and not per_layer_type:
        raise ValueError(f"{owner}: model_type='deepseek_v4' has one RoPE per layer type ('main', 'compress'), and "
                         f"this config does not spell them out (a raw config.json, whose rope_theta, "
                         f"compress_rope_theta and rope_scaling transformers' DeepseekV4Config combines); load it "
                         f"with DeepseekV4Config(**config) or pass rope_parameters={{'main': ..., 'compress': ...}}")
    if per_layer_type:
        # one RoPE per layer type (Gemma 3: sliding / full attention with different bases)
        if layer_type is None:
            raise ValueError(f"{owner}: this config has one RoPE per layer type {sorted(params)}; pass "
                             f"layer_type=..., got layer_type=None")
        if params.get(layer_type) is None:
            raise ValueError(f"{owner}: layer_type must be one of the config's RoPE layer types "
                             f"{sorted(k for k, v in params.items() if v is not None)}, got {layer_type!r}")
        params = dict(params[layer_type])
    rotary_dim_field = _config_get(text, "rotary_dim")
    if not params and _config_get(text, "rope_theta") is None and _config_get(text, "rotary_emb_base") is None \
            and rotary_dim_field is None and model_type not in _ROPE_DEFAULT_MODELS:
        raise ValueError(f"{owner}: config (model_type={model_type!r}) has no rotary embedding: no rope_parameters, "
                         f"rope_scaling, rope_theta or rotary_dim")
    _check_model_type_known(owner, model_type, text, params, interleaved, section_layout)

    # frequency base: rope_parameters, then the legacy top-level spellings, then the model's default
    if model_type in _ROTARY_DIM_MODELS:
        base = 10000.0   # GPT-J / CodeGen hard-code it
    else:
        base = (params.get("rope_theta") or _config_get(text, "rope_theta") or _config_get(text, "rotary_emb_base")
                or getattr(text, "default_theta", None) or 10000.0)
        if isinstance(base, dict):  # per-layer-type default_theta
            base = base.get(layer_type, 10000.0)

    # head dim: DeepSeek's MLA rotates a separate qk_rope_head_dim slice
    override = _layer_override(text, layer_type)
    rope_head_dim = None if model_type in _ROPE_SLICE_MODELS else _config_get(text, "qk_rope_head_dim")
    head_dim = override.get("head_dim") or rope_head_dim or _config_get(text, "head_dim")
    if head_dim is None:
        hidden = _config_first(text, ("hidden_size", "n_embd", "d_model"))
        if hidden is None:
            raise ValueError(f"{owner}: config sets neither head_dim nor hidden_size / num_attention_heads")
        head_dim = int(hidden) // _head_count(owner, text)
    head_dim = int(head_dim)

    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "mrope" or (rope_type == "axial" and model_type == "pixtral"):
        rope_type = "default"     # legacy Qwen2-VL spelling, Pixtral's name: default RoPE with sections
    if rope_type == "xdrope":     # HunYuan-VL's legacy spelling, which transformers reads as "dynamic"
        rope_type = "dynamic"
    if rope_type == "dynamic" and params.get("alpha") and model_type in _NTK_ALPHA_MODELS:
        # HunYuan's "ntk_alpha": a fixed alpha stretches the base once, whatever the length (not dynamic NTK)
        base = float(base) * float(params["alpha"]) ** (head_dim / (head_dim - 2))
        rope_type = "default"
    if rope_type == "su" or (rope_type == "yarn" and model_type == "phi3"):
        rope_type = "longrope"    # transformers' Phi-3 backward compatibility

    kwargs = {"dim": head_dim, "base": float(base)}
    partial = (params.get("partial_rotary_factor") or _config_get(text, "partial_rotary_factor")
               or _config_get(text, "rotary_pct") or _PARTIAL_ROTARY_DEFAULTS.get(model_type, 1.0))
    stated_rotary_dim = rotary_dim
    if stated_rotary_dim is not None:
        rotary_dim = _check_positive_int(owner, "rotary_dim", stated_rotary_dim)
    elif model_type in _ROTARY_DIM_MODELS:
        rotary_dim = int(rotary_dim_field or head_dim)
    elif rope_type == "proportional":
        rotary_dim = head_dim     # every pair is returned; the unrotated ones get zero frequency
    else:
        rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{owner}: the rotated dim must be even and in (0, head_dim={head_dim}], got "
                         f"rotary_dim={rotary_dim} (partial_rotary_factor={partial})")
    if model_type == "deepseek_v4":   # [nope | rope] heads whose keys are the values: both turn, and the output
        kwargs.update(rotated_channels="trailing", rotate_values=True)
    elif model_type in _ROPE_SLICE_MODELS:
        kwargs["dim"] = head_dim = rotary_dim     # the module describes the rotated slice only
    if rotary_dim != head_dim:
        kwargs["rotary_dim"] = rotary_dim
    if interleaved is None:
        interleaved = model_type in _INTERLEAVED_ROPE_MODELS or (
            _config_get(text, "rope_interleave") is True and _config_get(text, "qk_rope_head_dim") is not None)
    if interleaved:
        kwargs["interleaved"] = True

    # multi-axis (M-RoPE) sections
    default_sections, layout = _MROPE_MODELS.get(model_type, (None, "contiguous"))
    if sections is None:
        stated = [params.get("mrope_section") or _config_get(text, "mrope_section"), params.get("xdrope_section")]
        if all(stated) and list(stated[0]) != list(stated[1]):
            raise ValueError(f"{owner}: mrope_section={stated[0]} and xdrope_section={stated[1]} disagree")
        sections = stated[0] or stated[1] or default_sections
        if sections is None and model_type in _XDROPE_MODELS:
            raise ValueError(f"{owner}: model_type={model_type!r} needs mrope_section (or xdrope_section) in "
                             f"rope_parameters, its XD-RoPE's pairs per axis; the config has none")
        if sections is not None and model_type in _HWT_SECTION_MODELS:
            h, w, t = [int(size) for size in _as_list(owner, "mrope_section", sections)]
            if h != w:   # the model stacks h and w pair by pair
                raise ValueError(f"{owner}: model_type={model_type!r} alternates h and w pairs, so mrope_section "
                                 f"(h, w, t) needs equal h and w, got {[h, w, t]}")
            sections = [t, h, w]
    if model_type == "pixtral":   # (row, column): rows take the even frequencies, columns the odd ones
        if sections is not None or section_layout is not None:
            raise ValueError(f"{owner}: model_type='pixtral' has one layout, (row, column) on alternate "
                             f"frequencies; sections= and section_layout= do not apply, got sections={sections}, "
                             f"section_layout={section_layout!r}")
        pairs = rotary_dim // 2
        kwargs.update(sections=[(pairs + 1) // 2, pairs // 2], axis_spectrum="strided")
    if sections is not None:
        kwargs["sections"] = [int(s) for s in _as_list(owner, "sections", sections)]
        if section_layout is None:
            section_layout = "interleaved" if params.get("mrope_interleaved") else layout
        if section_layout is not None and section_layout != "contiguous":
            kwargs["section_layout"] = section_layout

    if rope_type != "default":
        scaling = {key: value for key, value in params.items() if key not in _ROPE_KEYS_NOT_SCALING}
        scaling["rope_type"] = rope_type
        max_len = _config_get(text, "max_position_embeddings")
        if rope_type in ("llama3", "yarn", "longrope"):
            # transformers gives a top-level original_max_position_embeddings priority (Phi-3),
            # else the dict's, else max_position_embeddings
            original = _config_get(text, "original_max_position_embeddings") or params.get(
                "original_max_position_embeddings") or max_len
            if original is not None:
                scaling["original_max_position_embeddings"] = original
        if rope_type in ("yarn", "longrope") and max_len is not None:
            scaling["max_position_embeddings"] = max_len   # their factor when the dict has none
        if rope_type == "dynamic":
            # transformers' dynamic NTK is relative to max_position_embeddings, whatever the dict says
            scaling.pop("original_max_position_embeddings", None)
            if max_len is not None:
                scaling["max_position_embeddings"] = max_len
        if rope_type == "proportional":
            scaling["partial_rotary_factor"] = float(partial)
        kwargs["scaling"] = scaling
    return kwargs


def _check_model_type_known(owner: str, model_type: str, text, params: dict, interleaved: Optional[bool],
                            section_layout: Optional[str]) -> None:
    """A model type outside ``_ROPE_MODEL_TYPES`` is read only when the caller states its layout."""
    if model_type in _ROPE_MODEL_TYPES:
        return
    has_sections = bool(params.get("mrope_section") or _config_get(text, "mrope_section"))
    if interleaved is not None and (section_layout is not None or not has_sections):
        return
    missing = "interleaved=True or False" if interleaved is None else ""
    if has_sections and section_layout is None:
        missing += (" and " if missing else "") + "section_layout='contiguous' or 'interleaved'"
    raise ValueError(
        f"{owner}: model_type={model_type!r} (config field model_type) is not among the model types checked "
        f"against their transformers module (docs/model_parity.md lists them), and the config does not say which "
        f"channels pair up{' or how mrope_section maps pairs to axes' if has_sections else ''}. If you know the "
        f"model's layout, state it and take responsibility for it: from_config(config, {missing}); rotary_dim= "
        f"and sections= override the config's values too")


# Model types whose T5 bias from_config reads exactly (each held against the model's own ``compute_bias``
# with the same weights by ``TestT5.test_t5_model_type_matches_compute_bias``), and the ones refused with
# the reason.
_T5_MODEL_TYPES = frozenset({"t5", "mt5", "umt5", "switch_transformers", "pop2piano", "pix2struct",
                             "pix2struct_text_model"})


# T5-style models whose only biased attention is a causal decoder's (Pix2Struct's text model buckets
# unidirectionally whatever is_decoder says).
_T5_DECODER_ONLY = {"pix2struct", "pix2struct_text_model"}


_T5_REFUSED = {
    "pix2struct_vision_model": "the Pix2Struct vision encoder never adds the T5 bias its config describes",
    "udop": "UDOP adds a bounding-box (2-D) bias to the 1-D T5 bias; from_config would give the 1-D part only",
    "longt5": "LongT5's local and transient-global attention compute the bias per block of keys",
    "prophetnet": "ProphetNet's main and n-gram predicting streams bucket their distances separately "
                  "(num_buckets, relative_max_distance)",
    "wavlm": "WavLM gates its bucketed bias with weights computed from the hidden states",
    "layoutlmv2": "LayoutLMv2 adds 2-D bounding-box buckets to the 1-D ones (rel_pos_bins, max_rel_pos)",
    "layoutlmv3": "LayoutLMv3 adds 2-D bounding-box buckets to the 1-D ones (rel_pos_bins, max_rel_pos)",
    "layoutxlm": "LayoutXLM (LayoutLMv2) adds 2-D bounding-box buckets to the 1-D ones (rel_pos_bins, max_rel_pos)",
    "cpmant": "CPM-Ant buckets distances within segments and adds a segment bias (position_bias_num_buckets)",
}


# Model types whose ALiBi from_config reads exactly (TestALiBi.test_alibi_model_type_matches_its_ramp), and
# the ones refused.
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "falcon"})


_ALIBI_REFUSED = {
    "dbrx": "DBRX uses RoPE (attn_config.rope_theta), not ALiBi; use RotaryPositionalEmbedding.from_config",
}


def _check_bias_model_type(owner: str, model_type: str, accepted: frozenset, refused: dict, keywords: str) -> None:
    """A bias model type is read only when a test holds it against the model's module."""
    if model_type in refused:
        raise ValueError(f"{owner}: model_type={model_type!r} is not supported: {refused[model_type]}")
    if model_type not in accepted:
        raise ValueError(f"{owner}: model_type={model_type!r} (config field model_type) is not among the model types "
                         f"checked against their transformers module ({', '.join(sorted(accepted))}). If you know "
                         f"the model computes this bias, build it yourself and take responsibility: {keywords}")


def _t5_kwargs_from_config(config, *, decoder: Optional[bool] = None) -> dict:
    """Keyword arguments of ``T5PositionalEmbedding`` reproducing T5's ``compute_bias``.

    ``num_heads``, ``relative_attention_num_buckets`` (default 32) and
    ``relative_attention_max_distance`` (default 128, absent from old configs); buckets are
    bidirectional unless ``is_decoder``. A full T5 config describes the encoder
    (``is_decoder=False``): pass ``decoder=True`` for the decoder's self-attention bias.
    """
    owner = "T5PositionalEmbedding.from_config"
    text = _text_config(owner, config)
    if decoder is not None and not isinstance(decoder, bool):
        raise TypeError(f"{owner}: decoder must be a bool or None, got {type(decoder).__name__} {decoder!r}")
    _check_bias_model_type(owner, _model_type(config, text), _T5_MODEL_TYPES, _T5_REFUSED,
                           "T5PositionalEmbedding(num_heads, num_buckets=..., max_distance=..., bidirectional=...)")
    num_buckets = _config_get(text, "relative_attention_num_buckets")
    if num_buckets is None:
        raise ValueError(f"{owner}: config (model_type={_model_type(config, text)!r}) has no T5 relative "
                         f"attention bias: relative_attention_num_buckets is missing")
    is_decoder = bool(_config_get(text, "is_decoder", False)) if decoder is None else decoder
    if _model_type(config, text) in _T5_DECODER_ONLY:
        if decoder is False:
            raise ValueError(f"{owner}: model_type={_model_type(config, text)!r} buckets distances causally "
                             f"(its text decoder is its only T5-biased attention); got decoder=False")
        is_decoder = True
    return {"num_heads": _head_count(owner, text), "num_buckets": int(num_buckets),
            "max_distance": int(_config_get(text, "relative_attention_max_distance", 128)),
            "bidirectional": not is_decoder}


def _alibi_kwargs_from_config(config) -> dict:
    """Keyword arguments of ``ALiBiPositionalEmbedding`` reproducing what the model adds to its logits.

    Bloom: Press et al.'s slopes. MPT: slopes from ``attn_config.alibi_bias_max``. Falcon with
    ``alibi=True``: Bloom's slopes rounded to bfloat16 (as Falcon builds them) and divided by
    ``sqrt(head_dim)``, because Falcon adds ``slope * j / sqrt(head_dim)`` to logits already
    scaled by ``1 / sqrt(head_dim)``. Returns ``num_heads``, explicit ``slopes`` (a list of
    ``H`` floats) and ``bidirectional=False`` (all three are causal decoders). The models add
    ``+slope * j``; our ``-slope * |i - j|`` differs by a constant per query row, so the softmax
    is the same.
    """
    owner = "ALiBiPositionalEmbedding.from_config"
    text = _text_config(owner, config)
    model_type = _model_type(config, text)
    _check_bias_model_type(owner, model_type, _ALIBI_MODEL_TYPES, _ALIBI_REFUSED,
                           "ALiBiPositionalEmbedding(num_heads, slopes=[...]) or (num_heads, max_bias=...)")
    attn_config = _config_get(text, "attn_config")
    if model_type == "mpt":
        attn_config = {} if attn_config is None else attn_config
        if _config_get(attn_config, "alibi", True) is not True:
            raise ValueError(f"{owner}: MPT config has attn_config.alibi={_config_get(attn_config, 'alibi')!r}: "
                             f"it uses no ALiBi")
        heads = _head_count(owner, text)
        slopes = alibi_slopes(heads, float(_config_get(attn_config, "alibi_bias_max", 8)))
    elif model_type == "falcon":
        if _config_get(text, "alibi") is not True:
            raise ValueError(f"{owner}: Falcon config has alibi={_config_get(text, 'alibi', False)!r}: it uses "
                             f"RoPE; use RotaryPositionalEmbedding.from_config")
        heads = _head_count(owner, text)
        hidden = _config_first(text, ("hidden_size", "n_embd"))
        if hidden is None:
            raise ValueError(f"{owner}: Falcon config sets no hidden_size (its ALiBi is divided by sqrt(head_dim))")
        hidden = int(hidden)
        rounded = torch.tensor(alibi_slopes(heads), dtype=torch.float32).bfloat16().double().tolist()
        slopes = [s / math.sqrt(hidden // heads) for s in rounded]
    elif model_type == "bloom":
        heads = _head_count(owner, text)
        slopes = alibi_slopes(heads)
    else:
        raise ValueError(f"{owner}: config (model_type={model_type!r}) has no ALiBi: expected Bloom, MPT "
                         f"(attn_config.alibi) or Falcon with alibi=True")
    return {"num_heads": heads, "slopes": slopes, "bidirectional": False}


# Inkling's model types -> the transformers 5.24 defaults of their relative-bias fields (a config.json saved with
# only its differences from the defaults omits the rest): Inkling (no clip; log scaling where n_floor is set),
# Inkling 2 and Inkling 2 Loop (an L2 clip with a learned scale). Each is held against its module by TestInkling.
_INKLING1_DEFAULTS = {"hidden_size": 6144, "num_attention_heads": 64, "swa_num_attention_heads": 64,
                      "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024, "log_scaling_n_floor": None,
                      "log_scaling_alpha": 0.1, "rel_l2_clip_threshold": None}
_INKLING2_DEFAULTS = {"hidden_size": 4608, "num_attention_heads": 48, "swa_num_attention_heads": 48,
                      "sliding_window_size": 1024, "d_rel": 16, "rel_extent": 1024, "log_scaling_n_floor": 128000,
                      "log_scaling_alpha": 0.1, "rel_l2_clip_threshold": 8.0}
_INKLING_MODELS = {
    "inkling_text": _INKLING1_DEFAULTS, "inkling_mm_model": _INKLING1_DEFAULTS,
    "inkling2_text": _INKLING2_DEFAULTS, "inkling2": _INKLING2_DEFAULTS,
    "inkling2_loop_text": {**_INKLING2_DEFAULTS, "hidden_size": 2304, "num_attention_heads": 24,
                           "swa_num_attention_heads": 24, "log_scaling_n_floor": 8192},
}
_INKLING_MODELS["inkling2_loop"] = _INKLING_MODELS["inkling2_loop_text"]


def _inkling_kwargs_from_config(config, *, layer_type: Optional[str] = None) -> dict:
    """Keyword arguments of ``InklingPositionalEmbedding`` for the layers of type ``layer_type`` of an Inkling
    config, as transformers' attention builds them: full (``"hybrid"``) layers take ``num_attention_heads``,
    ``rel_extent`` and the log scaling; sliding ones ``swa_num_attention_heads`` and ``sliding_window_size``."""
    owner = "InklingPositionalEmbedding.from_config"
    text = _text_config(owner, config)
    model_type = _model_type(config, text)
    _check_bias_model_type(owner, model_type, frozenset(_INKLING_MODELS), {},
                           "InklingPositionalEmbedding(dim, num_heads, d_rel=..., max_distance=..., ...)")
    _check_choice(owner, "layer_type", layer_type, ("hybrid", "hybrid_sliding"))
    get = lambda name: _config_get(text, name, _INKLING_MODELS[model_type][name])             # noqa: E731
    full = layer_type == "hybrid"
    return {"dim": int(get("hidden_size")), "d_rel": int(get("d_rel")),
            "num_heads": int(get("num_attention_heads" if full else "swa_num_attention_heads")),
            "max_distance": int(get("rel_extent" if full else "sliding_window_size")),
            "clip_threshold": None if get("rel_l2_clip_threshold") is None else float(get("rel_l2_clip_threshold")),
            "log_scaling_n_floor": None if not full or get("log_scaling_n_floor") is None
            else float(get("log_scaling_n_floor")),
            "log_scaling_alpha": float(get("log_scaling_alpha"))}


_NO_ROPE_LAYER_MODELS = {"smollm3", "llama4", "llama4_text"}   # no_rope_layers[i]: 1 = RoPE, 0 = NoPE


_MISTRAL_LARGE4_MODELS = {"mistral_large4", "mistral_large4_text"}


def layer_encodings(config, *, rope_alpha: Optional[Tensor] = None) -> list:
    """The positional encoding of each layer of a Hugging Face model, by layer index.

    For models whose layers differ:

    - **SmolLM3, Llama 4.** ``no_rope_layers[i]`` is 1 for a RoPE layer and 0 for a NoPE one. When
      the list is absent, every ``no_rope_layer_interval``-th layer (default 4) is NoPE, as the
      configs build it. RoPE layers share one ``RotaryPositionalEmbedding.from_config(config)``.
      NoPE layers get ``NoPositionalEmbedding()``, or, in Llama 4 with ``attn_temperature_tuning``,
      ``QueryTemperaturePositionalEmbedding(length=floor_scale, scale=attn_scale)``.
    - **Per-layer-type RoPE** (Gemma 3 and 4, DeepSeek-V4): ``from_config(config, layer_type=...)``
      for each layer's type. DeepSeek-V4's types map to its ``"main"`` RoPE (sliding-attention layers)
      and ``"compress"`` RoPE (the others), each turning the values too in ``attention()``.
    - **Mistral Large 4** (LeRoPE): its RoPE layers (``no_rope_layers[i] = 1``) turn the trailing
      ``qk_rope_head_dim`` channels of each ``qk_nope_head_dim + qk_rope_head_dim`` head in
      interleaved pairs, at the config's frequencies times ``exp(alpha)``, a factor per pair learned
      in the checkpoint: pass it as ``rope_alpha`` (the model's ``model.rotary_emb.alpha``; required).
      Its other layers are NoPE.
    - **Every other model accepted by ``from_config``:** that one RoPE on every layer.

    Each per-layer-type RoPE carries the type whose parameters it has as ``layer_type`` (in its repr:
    Gemma's ``"sliding_attention"`` / ``"full_attention"``, DeepSeek-V4's ``"main"`` / ``"compress"``);
    a RoPE shared by every RoPE layer has ``layer_type=None``. Layers of one type share one module.

    What stays with the model: Llama 4's q/k norm and chunked attention on RoPE layers, SmolLM3's
    sliding window on NoPE layers, and Mistral Large 4's softmax scaling (q times a learned
    ``scale * log(p + 1) + bias`` per head, every layer) and sparse attention.

    Example:
        >>> smollm3 = {"model_type": "smollm3", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
        ...            "rope_theta": 2e6}                           # or transformers' SmolLM3Config(...)
        >>> [type(pe).__name__ for pe in layer_encodings(smollm3)]   # every fourth layer is NoPE
        ['RotaryPositionalEmbedding', 'RotaryPositionalEmbedding', 'RotaryPositionalEmbedding', 'NoPositionalEmbedding']
    """
    owner = "layer_encodings"
    text = _text_config(owner, config)
    model_type = _model_type(config, text)
    layers = _config_get(text, "num_hidden_layers")
    if layers is None:
        raise ValueError(f"{owner}: config must set num_hidden_layers (a positive int), got None")
    layers = _check_positive_int(owner, "num_hidden_layers", layers)
    if model_type in _MISTRAL_LARGE4_MODELS:
        rope = _mistral_large4_rope(owner, config, text, rope_alpha)
        flags = _layer_flags(owner, _config_get(text, "no_rope_layers") or [1] * layers, layers)
        return [rope if flags[i] else NoPositionalEmbedding() for i in range(layers)]
    if rope_alpha is not None:
        raise ValueError(f"{owner}: rope_alpha is Mistral Large 4's learned frequency factor; model_type="
                         f"{model_type!r} has none, got {_describe(rope_alpha)}")
    if model_type in _NO_ROPE_LAYER_MODELS:
        flags = _config_get(text, "no_rope_layers")
        if flags is None or (isinstance(flags, (list, tuple)) and not flags):
            interval = _as_int(owner, "no_rope_layer_interval", _config_get(text, "no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(layers)]
        flags = _layer_flags(owner, flags, layers)
        rope = RotaryPositionalEmbedding.from_config(config)
        nope = NoPositionalEmbedding()
        if model_type.startswith("llama4") and _config_get(text, "attn_temperature_tuning", True):
            nope = QueryTemperaturePositionalEmbedding(
                length=_positive_float(owner, "floor_scale", _config_get(text, "floor_scale", 8192)),
                scale=_non_negative_float(owner, "attn_scale", _config_get(text, "attn_scale", 0.1)))
        return [rope if flags[i] else nope for i in range(layers)]
    types = _config_get(text, "layer_types")
    params = _config_get(text, "rope_parameters") or {}
    if types and _per_layer_type(params):
        if model_type == "deepseek_v4":
            types = ["main" if kind == "sliding_attention" else "compress" for kind in types]
        types = _as_list(owner, "layer_types", types)
        if len(types) != layers:   # transformers' configs check it too
            raise ValueError(f"{owner}: layer_types must have num_hidden_layers={layers} entries, got {len(types)}")
        built = {kind: RotaryPositionalEmbedding.from_config(config, layer_type=kind) for kind in set(types)}
        return [built[kind] for kind in types]
    rope = RotaryPositionalEmbedding.from_config(config)
    return [rope] * layers


def _layer_flags(owner: str, flags, layers: int) -> list:
    """``no_rope_layers``: one 1 (RoPE) or 0 (NoPE) per layer (a string "0" is no 0, and a list of another
    length belongs to another depth)."""
    flags = _as_list(owner, "no_rope_layers", flags)
    if len(flags) != layers:
        raise ValueError(f"{owner}: no_rope_layers must have num_hidden_layers={layers} entries, got {len(flags)}")
    if not all(_is_bool(flag) or (isinstance(flag, numbers.Integral) and flag in (0, 1)) for flag in flags):
        raise ValueError(f"{owner}: no_rope_layers must hold 1 (RoPE) and 0 (NoPE), got {_describe(flags)}")
    return flags


def _mistral_large4_rope(owner: str, config, text, rope_alpha) -> "RotaryPositionalEmbedding":
    """Mistral Large 4's RoPE on its whole ``[nope | rope]`` heads: the config's spectrum (YaRN) times
    ``exp(rope_alpha)``, on the trailing ``qk_rope_head_dim`` channels, interleaved."""
    if not isinstance(rope_alpha, Tensor) or not rope_alpha.is_floating_point() or rope_alpha.dim() != 1:
        raise TypeError(f"{owner}: Mistral Large 4 needs rope_alpha, the checkpoint's learned frequency factor "
                        f"(model.rotary_emb.alpha, a float tensor [qk_rope_head_dim / 2]), got {_describe(rope_alpha)}")
    if rope_alpha.is_meta:
        raise ValueError(f"{owner}: rope_alpha must hold the checkpoint's values, got {_describe(rope_alpha)} on the "
                         f"meta device")
    spectrum = RotaryPositionalEmbedding(**_rotary_kwargs_from_config(config, interleaved=True, spectrum_only=True))
    if spectrum.attention_factor != 1.0 or rope_alpha.shape[0] != spectrum.rotary_dim // 2:
        raise ValueError(f"{owner}: rope_alpha must have qk_rope_head_dim / 2 = {spectrum.rotary_dim // 2} entries "
                         f"for an attention factor of 1 (got {spectrum.attention_factor}), got {_describe(rope_alpha)}")
    frequencies = spectrum.inv_freq.cpu() * rope_alpha.detach().cpu().double().exp()
    if not torch.isfinite(frequencies).all():   # named here, not as the frequencies the user never passed
        raise ValueError(f"{owner}: rope_alpha must be finite with exp(rope_alpha) times the config's frequencies "
                         f"finite, got rope_alpha in [{rope_alpha.min().item()}, {rope_alpha.max().item()}]")
    head_dim = int(_config_get(text, "qk_nope_head_dim")) + spectrum.rotary_dim
    return RotaryPositionalEmbedding(head_dim, rotary_dim=spectrum.rotary_dim, interleaved=True,
                                     rotated_channels="trailing", frequencies=frequencies)


# diffusers transformer configs. A diffusers ``config.json`` (or a loaded ``model.config``) names its model class
# in ``_class_name``, and part of the position code lives in the class, not the config (Flux.1's, Wan's and
# Qwen-Image's theta 10000, Wan's split of the head, Stable Audio's rotated half), so the reader is keyed by the
# class name. One entry per model class: which of our classes computes its encoding, the model's defaults of the
# config fields it reads (a config.json carries them all; a hand-written dict may not), and how the arguments
# follow from those fields. Each accepted class is held against the diffusers module by TestDiffusersConfig
# (diffusers 0.42.1); docs/diffusers.md lists them, the positions each model feeds, and why the others are refused.

class _DiffusersModel(NamedTuple):
    encoding: str       # the class whose from_config builds it
    defaults: dict      # the model's defaults of the config fields read
    read: object        # get(field) -> keyword arguments of ``encoding``
    # (a model with two encodings, OmniGen's RoPE and patch table, has a tuple of entries)
    positions: object = None   # (get, frames, height, width, text_len) -> the ids it feeds [N, A] (None: not built)


def _axial_rope(axes, *, base=10000.0, dim=None, interleaved: bool = True):
    """An axial RoPE as diffusers builds it: axis ``a`` turns its own slice of ``axes[a]`` channels with its own
    spectrum ``theta ** (-2j / axes[a])`` (Flux's ``get_1d_rotary_pos_embed`` per axis, concatenated).

    ``axes`` is the config field of the per-axis widths, or a function of ``get`` (Wan's split of the head);
    ``base`` a constant or the field of theta; ``dim`` the field of the head dim (None: the widths' sum)."""
    def read(get) -> dict:
        widths = [int(width) for width in (axes(get) if callable(axes) else get(axes))]
        head = sum(widths) if dim is None else int(dim(get) if callable(dim) else get(dim))
        if any(width <= 0 or width % 2 for width in widths) or sum(widths) != head:
            source = f"config field {axes}" if isinstance(axes, str) else "the model's split of the head"
            raise ValueError(f"the per-axis rotary widths must be positive, even and sum to the head dim {head}, got "
                             f"{widths} ({source})")
        return {"dim": head, "base": float(get(base) if isinstance(base, str) else base), "interleaved": interleaved,
                "sections": [width // 2 for width in widths], "axis_spectrum": "per_axis"}
    return read


def _wan_split(head: int) -> list:
    """Wan's split of a head of ``head`` channels among (t, h, w): h = w = 2 (D // 6) channels, t the rest."""
    spatial = 2 * (head // 6)
    return [head - 2 * spatial, spatial, spatial]


def _wan_axes(get) -> list:
    """Wan's split of ``attention_head_dim`` (and of Wan's derivatives that name it so)."""
    return _wan_split(int(get("attention_head_dim")))


def _anyflow_far_axes(get) -> list:
    """AnyFlow FAR: Wan's split. Its compressed context frames average the cos and sin of ``k`` neighbouring
    positions per axis (``k = compressed_patch_size / patch_size``) and rescale each pair to unit length. The
    average of ``exp(i w (k p + j))`` over ``j < k`` is ``exp(i w (k p + (k - 1) / 2))`` times
    ``sin(k w / 2) / (k sin(w / 2))``, so the rescaled pair is RoPE at the midpoint ``k p + (k - 1) / 2`` while that
    factor is positive for every frequency ``w <= 1``: ``k <= 6``. Past it the fastest pairs flip by pi."""
    ratios = [int(c) // int(p) for c, p in zip(get("compressed_patch_size"), get("patch_size"))]
    if max(ratios) > 6:
        raise ValueError(f"compressed_patch_size / patch_size = {ratios}: a pooling window over 6 positions flips "
                         f"the fastest pairs of the compressed frames by pi (their averaged cos/sin turn negative), "
                         f"which no position gives")
    return _wan_axes(get)


def _cosmos_rope(get) -> dict:
    """Cosmos 1.0 / 2: Wan's split of the head among (t, h, w), half-split pairs, and axis ``a`` its own spectrum
    over its ``w_a`` channels from its own NTK-scaled base ``10000 * rope_scale[a] ** (w_a / (w_a - 2))``: the
    per-axis spectra as explicit ``frequencies``."""
    widths, scales = _wan_axes(get), [float(scale) for scale in get("rope_scale")]
    frequencies = [(10000.0 * scale ** (width / (width - 2))) ** (-2 * j / width)
                   for width, scale in zip(widths, scales) for j in range(width // 2)]
    return {"dim": int(get("attention_head_dim")), "sections": [width // 2 for width in widths],
            "frequencies": frequencies}


def _allegro_rope(get) -> dict:
    """Allegro: a 1-D RoPE per third of the head (t, h, w), each half-split with its own spectrum: per-axis
    sections in chunks of ``D / 3`` channels."""
    head = int(get("attention_head_dim"))
    if head % 6:
        raise ValueError(f"attention_head_dim must be a multiple of 6 (three chunks of pairs), got {head}")
    return {"dim": head, "sections": [head // 6] * 3, "axis_spectrum": "per_axis", "chunk_size": head // 3}


def _lumina_next_rope(get) -> dict:
    """Lumina-Next: each of (row, col) its own spectrum ``10000 ** (-4k / D)`` over ``D / 2`` channels, the pairs
    alternating ``row k, col k`` (interleaved channels): an explicit map. The pipeline's time-aware scaling (a
    linear factor dividing the frequencies, or an NTK factor multiplying the base) is docs/diffusers.md's."""
    head = int(get("hidden_size")) // int(get("num_attention_heads"))
    if head % 4:
        raise ValueError(f"the head dim must be a multiple of 4 (two axes of pairs), got {head}")
    return {"dim": head, "interleaved": True, "pair_axes": [0, 1] * (head // 4),
            "frequencies": [10000.0 ** (-4 * k / head) for k in range(head // 4) for _ in range(2)]}


def _ltx_rope(ltx2: bool):
    """LTX-Video, LTX-2 and the Sana-WM refiner: one RoPE over the model width ``D = H Dh`` (q and k before the
    head split). ``F = D // 6`` frequencies rise, ``theta ** (k / (F - 1)) * pi / 2``; pair ``i`` of the ``3F``
    turns with axis ``i % 3`` (t h w t h w ...) at frequency ``i // 3``, after the ``D / 2 - 3F`` padding pairs
    (frequency 0: they pass unrotated). Pairs are interleaved, or with LTX-2's ``rope_type="split"`` half-split
    inside each head's slice (``chunk_size=Dh``). LTX-Video's theta 10000 is in its class."""
    def read(get) -> dict:
        head = int(get("attention_head_dim"))
        dim, theta = int(get("num_attention_heads")) * head, float(get("rope_theta")) if ltx2 else 10000.0
        count = dim // 6
        pad, spectrum = dim // 2 - 3 * count, [theta ** (k / max(count - 1, 1)) * math.pi / 2 for k in range(count)]
        kwargs = {"dim": dim, "pair_axes": [0] * pad + [i % 3 for i in range(3 * count)],
                  "frequencies": [0.0] * pad + [spectrum[i // 3] for i in range(3 * count)]}
        rope_type = get("rope_type") if ltx2 else "interleaved"
        if rope_type not in ("interleaved", "split"):
            raise ValueError(f"rope_type must be 'interleaved' or 'split', got rope_type={rope_type!r}")
        split = rope_type == "split"
        return {**kwargs, "chunk_size": head} if split else {**kwargs, "interleaved": True}
    return read


def _split_3d_axes(get) -> list:
    """``get_3d_rotary_pos_embed``'s split of the head among (t, h, w): D / 4, then 3 D / 8 each."""
    head = int(get("attention_head_dim"))
    return [head // 4, head // 8 * 3, head // 8 * 3]


def _cogvideox_axes(get) -> list:
    """CogVideoX's (and ConsisID's) RoPE, which its config switches on: ``get_3d_rotary_pos_embed``'s split."""
    if not get("use_rotary_positional_embeddings"):
        raise ValueError("use_rotary_positional_embeddings=False: this CogVideoX (1.0 2B) adds a 3-D sin-cos table "
                         "instead (SinusoidalPositionalEmbedding.from_config)")
    return _split_3d_axes(get)


def _cogvideox_sincos(get) -> dict:
    """CogVideoX 1.0 2B (and ConsisID) without RoPE: ``get_3d_sincos_pos_embed``'s table on the model width D,
    (t, column, row) slices of D / 4, 3 D / 8 and 3 D / 8 channels, each sines then cosines."""
    if get("use_rotary_positional_embeddings"):
        raise ValueError("use_rotary_positional_embeddings=True: the model rotates q and k instead "
                         "(RotaryPositionalEmbedding.from_config)")
    dim = int(get("num_attention_heads")) * int(get("attention_head_dim"))
    if dim % 16:
        raise ValueError(f"the model width num_attention_heads * attention_head_dim must be a multiple of 16 (slices "
                         f"of D / 4 and 3 D / 8 channels in sin-cos pairs), got {dim}")
    return {"dim": dim, "layout": "concat", "num_axes": 3, "sections": [dim // 8, 3 * dim // 16, 3 * dim // 16]}


def _cogvideox_learned(get) -> dict:
    """CogVideoX 1.0 5B I2V (``use_learned_positional_embeddings``, beside its RoPE): one learned table over the joint
    sequence, ``max_text_seq_length`` text rows then the patches of the sample size, ``T H W`` with ``T = (frames - 1)
    // temporal_compression_ratio + 1``; the checkpoint's ``patch_embed.pos_embedding[0]`` is its ``weight``."""
    if not get("use_learned_positional_embeddings"):
        raise ValueError("use_learned_positional_embeddings=False: the model has no learned table (its RoPE: "
                         "RotaryPositionalEmbedding.from_config, or a fixed sin-cos table: "
                         "SinusoidalPositionalEmbedding.from_config)")
    if get("patch_size_t") is not None:   # the module's table counts 2-D patches: it would not fit 1.5's tokens
        raise ValueError(f"a learned table with patch_size_t={get('patch_size_t')} (CogVideoX 1.5) does not fit the "
                         f"model's tokens (diffusers counts 2-D patches for it), and no checkpoint has one")
    frames = (get("sample_frames") - 1) // get("temporal_compression_ratio") + 1
    patches = frames * (get("sample_height") // get("patch_size")) * (get("sample_width") // get("patch_size"))
    return {"max_len": get("max_text_seq_length") + patches, "dim": get("num_attention_heads") * get("attention_head_dim")}


def _chronoedit_axes(get) -> list:
    """ChronoEdit's tables are Wan's, but its forward splits them at D // 3: the two agree unless D % 6 == 4."""
    if int(get("attention_head_dim")) % 6 == 4:
        raise ValueError(f"attention_head_dim={get('attention_head_dim')} (6k + 4): the model builds its tables with "
                         f"Wan's split and cuts them at D // 3, which mixes the axes' spectra")
    return _wan_axes(get)


def _halves(get) -> list:
    """Two axes (h, w), half of the head each (CogView4, GLM-Image, HunyuanDiT's ``get_2d_rotary_pos_embed``)."""
    return [int(get("attention_head_dim")) // 2] * 2


def _half_rope(head: int) -> dict:
    """Stable Audio (1 and 3): 1-D RoPE on the first half of the head, half-split (the pipeline's
    ``attention_head_dim // 2``; Stable Audio 3's module over ``dim_heads // 2``)."""
    if head % 4:
        raise ValueError(f"the head dim must be a multiple of 4 (half of it rotates, in pairs), got {head}")
    return {"dim": head, "rotary_dim": head // 2}


def _sincos_2d(get) -> dict:
    """diffusers' ``get_2d_sincos_pos_embed`` on the model width: (column, row), each a concat sin-cos half."""
    return {"dim": int(get("num_attention_heads")) * int(get("attention_head_dim")), "layout": "concat", "num_axes": 2}


def _sana_sincos(get) -> dict:
    """Sana adds its PatchEmbed's table only when ``interpolation_scale`` is set."""
    if get("interpolation_scale", 1.0) is None:
        raise ValueError("interpolation_scale=None: the model adds no position encoding (its PatchEmbed has none)")
    return _sincos_2d(get)


def _transformer_2d_sincos(get) -> dict:
    """Transformer2DModel adds the table to patch inputs (``patch_size``) only."""
    if get("num_vector_embeds", 1) is not None:
        raise ValueError("num_vector_embeds is set: VQ-Diffusion's learned (row, column) tables, summed "
                         "(LearnedPositionalEmbedding.from_config)")
    if get("patch_size", 1) is None:
        raise ValueError("patch_size=None: continuous inputs get no position encoding")
    return _sincos_2d(get)


def _vq_diffusion_tables(get) -> dict:
    """Transformer2DModel over VQ-Diffusion's discrete latents: ``ImagePositionalEmbeddings``' row and column
    tables of ``sample_size`` rows each (``nn.Embedding``'s N(0, 1) init), summed."""
    if get("num_vector_embeds", 1) is None:
        raise ValueError("num_vector_embeds=None: only discrete (VQ-Diffusion) inputs get learned tables; patch inputs "
                         "add a sin-cos table (SinusoidalPositionalEmbedding.from_config), continuous ones none")
    if get("sample_size", 1) is None:
        raise ValueError("sample_size=None: VQ-Diffusion's tables have sample_size rows each, so it must be set")
    size = int(get("sample_size"))
    return {"max_len": (size, size), "dim": int(get("num_attention_heads")) * int(get("attention_head_dim")),
            "init_std": 1.0}


def _cosmos_tables(get) -> dict:
    """Cosmos 1.0 (``extra_pos_embed_type="learnable"``): ``CosmosLearnablePositionalEmbed``'s (t, h, w) tables of
    ``max_size / patch_size`` rows (zeros until the checkpoint loads), summed, each sum divided by ``1e-6 +`` its
    RMS."""
    if get("extra_pos_embed_type") != "learnable":
        raise ValueError(f"extra_pos_embed_type={get('extra_pos_embed_type')!r}: the model adds no learned table "
                         f"(only 'learnable' adds one)")
    sizes = tuple(int(size) // int(patch) for size, patch in zip(get("max_size"), get("patch_size")))
    return {"max_len": sizes, "dim": int(get("num_attention_heads")) * int(get("attention_head_dim")),
            "init_std": 0.0, "normalize": True, "eps": 1e-6}


def _compat_rope(mode: str, axes: str, dim) -> object:
    """``DiffusersCompatRotaryEmbedding`` in ``mode`` over the per-axis spectrum ``_axial_rope`` reads (the widths
    ``axes``, base ``rope_theta``, head dim ``dim``); the pair layout is the mode's own."""
    axial = _axial_rope(axes, base="rope_theta", dim=dim)
    return lambda get: {"mode": mode, **{key: value for key, value in axial(get).items() if key != "interleaved"}}


def _omnigen_rope(get) -> dict:
    """OmniGen's Phi-3 RoPE: longrope from ``rope_scaling``'s factors, lengths and base from the config."""
    scaling = dict(get("rope_scaling", {}) or {})
    if not {"short_factor", "long_factor"} <= set(scaling):
        raise ValueError(f"rope_scaling must hold short_factor and long_factor (the model reads both), got "
                         f"rope_scaling={get('rope_scaling')!r}")
    return {"dim": int(get("hidden_size")) // int(get("num_attention_heads")), "base": float(get("rope_base")),
            "scaling": {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
                        "long_factor": list(scaling["long_factor"]),
                        "original_max_position_embeddings": int(get("original_max_position_embeddings")),
                        "max_position_embeddings": int(get("max_position_embeddings"))}}


def _temporal_sincos(get) -> dict:
    """The blocks' ``SinusoidalPositionalEmbedding`` of ``positional_embeddings="sinusoidal"`` (Vaswani's table)."""
    if get("positional_embeddings") != "sinusoidal":
        raise ValueError(f"positional_embeddings={get('positional_embeddings')!r}: the model adds no position "
                         f"encoding (only 'sinusoidal' adds one)")
    return {"dim": int(get("num_attention_heads")) * int(get("attention_head_dim"))}


def _interleaved_mrope(head: str, sections) -> object:
    """Qwen3-VL's interleaved M-RoPE over (t, h, w) (Ideogram 4, Cosmos 3): one spectrum over the head, pairs
    ``t h w t h w ...``; ``sections`` is the field of the pairs per axis, or a function of ``get``. Pair ``i`` takes
    axis ``a = i % 3`` (1: h, 2: w) while ``i < 3 * sections[a]``, else t, as the model's table starts all t and
    overwrites those slices; where that is not Qwen3-VL's preset (Ideogram 4: (24, 20, 20) of 128 pairs, the rest
    t), ``pair_axes`` states the map."""
    def read(get) -> dict:
        dim, pairs = int(get(head)), [int(p) for p in (sections(get) if callable(sections) else get(sections))]
        if len(pairs) != 3:
            raise ValueError(f"the pairs per axis must be 3 (t, h, w), got {pairs}")
        kwargs = {"dim": dim, "base": float(get("rope_theta"))}
        axes = [i % 3 if i % 3 and i < 3 * pairs[i % 3] else 0 for i in range(dim // 2)]
        if [axes.count(a) for a in range(3)] == pairs:    # exactly the preset
            return {**kwargs, "sections": pairs, "section_layout": "interleaved"}
        return {**kwargs, "pair_axes": axes}
    return read


def _cosmos3_sections(get) -> list:
    """Cosmos 3's pairs per axis: ``rope_axes_dim``, else ``rope_scaling``'s ``mrope_section``, else (24, 20, 20)."""
    section = get("rope_axes_dim", (24, 20, 20))
    if section is None:
        section = (get("rope_scaling", {}) or {}).get("mrope_section", (24, 20, 20))
        return _diffusers_value("rope_scaling", "mrope_section", section, (24, 20, 20))
    return section


def _grid_ids(*sizes: int) -> Tensor:
    """The row-major grid of ``sizes`` as float ids [prod(sizes), len(sizes)]."""
    axes = torch.meshgrid(*[torch.arange(size, dtype=torch.float32) for size in sizes], indexing="ij")
    return torch.stack(axes, -1).reshape(-1, len(sizes))                       # [N, A]


def _flux_ids(get, frames, height, width, text_len, reference=None) -> Tensor:
    """Flux.1's pipeline: the text ids at zero, then the latent patches at ``(0, row, col)``; Flux Kontext's
    reference image (``reference``, its ``(height, width)`` patch grid) after them at ``(1, row, col)``."""
    ids = [torch.zeros(text_len, 3), torch.cat([torch.zeros(height * width, 1), _grid_ids(height, width)], -1)]
    if reference is not None:
        ids.append(torch.cat([torch.ones(reference[0] * reference[1], 1), _grid_ids(*reference)], -1))   # [R, 3]
    return torch.cat(ids)                                                                # [L + H W (+ R), 3]


def _flux2_ids(get, frames, height, width, text_len) -> Tensor:
    """Flux.2's pipeline over (t, h, w, l): text ``(0, 0, 0, i)``, then the latent patches ``(0, row, col, 0)``."""
    text = torch.cat([torch.zeros(text_len, 3), torch.arange(text_len, dtype=torch.float32)[:, None]], -1)
    image = torch.cat([torch.zeros(height * width, 1), _grid_ids(height, width), torch.zeros(height * width, 1)], -1)
    return torch.cat([text, image])                                                      # [L + H W, 4]


def _video_grid(get, frames, height, width, text_len) -> Tensor:
    """The (t, h, w) grid of the latent patches the model's RoPE module walks (its text tokens get none)."""
    return _grid_ids(frames, height, width)                                              # [T H W, 3]


def _qwen_image_ids(get, frames, height, width, text_len, layers=None, reference=None) -> Tensor:
    """Qwen-Image's MSRoPE ids: the text at ``m + i`` on all three axes, ``m = max(H // 2, W // 2)``, then the
    image at ``(0, row - (H - H // 2), col - (W - W // 2))`` (rows and columns centred on zero).

    Qwen-Image-Layered (``use_layer3d_rope``, its pipeline's ``layers``): ``layers + 1`` H x W grids at frames
    ``0 .. layers``, then the condition image (``reference``, default H x W) at frame -1, each centred; the text
    starts at ``max(m, layers + 1)``, ``m`` over every grid."""
    layered = get("use_layer3d_rope")
    if layered != (layers is not None) or (reference is not None and not layered):
        name, value = ("layers", layers) if layered != (layers is not None) else ("reference", reference)
        want = "the pipeline's layers (an int >= 1)" if layered else "None (use_layer3d_rope=False)"
        raise ValueError(f"{name} must be {want}, got {name}={value!r}")
    grids = [(0, height, width)] if not layered else \
        [(layer, height, width) for layer in range(layers + 1)] + [(-1, *(reference or (height, width)))]
    start = max(max(h // 2, w // 2) for _, h, w in grids)
    start = max(start, layers + 1) if layered else start
    text = (start + torch.arange(text_len, dtype=torch.float32))[:, None].expand(text_len, 3)     # [L, 3]
    images = [_grid_ids(1, h, w) - torch.tensor([-frame, h - h // 2, w - w // 2], dtype=torch.float32)
              for frame, h, w in grids]                                                  # [H W, 3] each
    return torch.cat([text, *images])                                                    # [L + sum H W, 3]


def _mochi_ids(get, frames, height, width, text_len) -> Tensor:
    """Mochi's (t, h, w): frames ``0, 1, ...``; rows and columns the midpoints of ``n`` equal cells spanning
    ``[-n s / 2, n s / 2]``, ``s = sqrt(192^2 / (H W))`` (the model's base area 192 x 192, not in the config), so
    every grid spans the same area, centred on zero. float32 as the model computes them."""
    scale = (192 * 192 / (height * width)) ** 0.5

    def centres(n: int) -> Tensor:
        edges = torch.linspace(-n * scale / 2, n * scale / 2, n + 1)
        return (edges[:-1] + edges[1:]) / 2                                               # [n]
    axes = torch.meshgrid(torch.arange(frames, dtype=torch.float32), centres(height), centres(width), indexing="ij")
    return torch.stack(axes, -1).reshape(-1, 3)                                           # [T H W, 3]


def _cosmos_ids(get, frames, height, width, text_len, fps=None) -> Tensor:
    """Cosmos 1.0 / 2's (t, h, w) grid; a video's frames (``fps`` given) at ``frame / fps * 24`` (its base fps)."""
    grid = _grid_ids(frames, height, width)                                               # [T H W, 3]
    if fps is not None:
        grid[:, 0] = grid[:, 0] / fps * 24
    return grid


def _allegro_ids(get, frames, height, width, text_len) -> Tensor:
    """Allegro's pipeline: the (t, h, w) grid, each axis divided by the config's ``interpolation_scale_{t,h,w}``."""
    scales = [get(f"interpolation_scale_{axis}") for axis in "thw"]   # the pipeline divides by them: set, > 0
    return _grid_ids(frames, height, width) / torch.tensor([float(scale) for scale in scales])   # [T H W, 3]


def _cogvideox_ids(get, frames, height, width, text_len) -> Tensor:
    """CogVideoX's (and ConsisID's) pipeline. 1.0 (no ``patch_size_t``): the grid resized to fit the base grid
    ``(sample_height, sample_width) / patch_size`` keeping its aspect (rounded), centred in it (rounded), and each
    spatial axis ``linspace(start, stop (n - 1) / n, n)`` over that crop ``[start, stop)``: fractional unless the grid
    is the base. 1.5 (``patch_size_t``): the plain grid, which must fit in the base grid. float32 as the pipeline."""
    if not get("use_rotary_positional_embeddings"):
        raise ValueError("use_rotary_positional_embeddings=False: the positions of its 3-D sin-cos table are not built")
    patch = int(get("patch_size"))
    base_h, base_w = int(get("sample_height")) // patch, int(get("sample_width")) // patch
    if get("patch_size_t", 1) is not None:   # 1.5: rows of the base tables, which fail past them
        if height > base_h or width > base_w:
            raise ValueError(f"the latent grid {height} x {width} exceeds the base grid {base_h} x {base_w} "
                             f"(sample_height, sample_width over patch_size)")
        return _grid_ids(frames, height, width)                                           # [T H W, 3]
    if height / width > base_h / base_w:   # fits the base height; the width scales to keep the aspect
        size = (base_h, int(round(base_h / height * width)))
    else:
        size = (int(round(base_w / width * height)), base_w)
    axes = [torch.arange(frames, dtype=torch.float32)]
    for n, fit, base in zip((height, width), size, (base_h, base_w)):
        start = int(round((base - fit) / 2.0))
        axes.append(torch.linspace(start, (start + fit) * (n - 1) / n, n, dtype=torch.float32))   # [n]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)          # [T H W, 3]


def _image_grid(get, frames, height, width, text_len) -> Tensor:
    """The (row, col) grid of the image patches, which alone take positions (Lumina-Next)."""
    if text_len:
        raise ValueError(f"its text tokens take no positions; text_len must be 0, got text_len={text_len}")
    return _grid_ids(height, width)                                                       # [H W, 2]


def _ltx_ids(get, frames, height, width, text_len, fps=None) -> Tensor:
    """LTX-Video's pipeline: the latent grid times ``(8 / fps, 32, 32)`` (its VAE's compression; ``fps`` the frame
    rate, default 25) and the patch sizes, over the base ``(20, 2048, 2048)``, mapped to ``2 g - 1``. float32 in the
    model's order of operations."""
    fps = 25 if fps is None else fps
    grid = _grid_ids(frames, height, width)                                               # [T H W, 3]
    patch = [int(get("patch_size_t"))] + [int(get("patch_size"))] * 2
    for axis, (scale, base) in enumerate(zip((8 / fps, 32, 32), (20, 2048, 2048))):
        grid[:, axis] = grid[:, axis] * scale * patch[axis] / base
    return grid * 2 - 1


def _ltx2_ids(get, frames, height, width, text_len, fps=None) -> Tensor:
    """LTX-2's (and the Sana-WM refiner's) video positions: each patch's pixel span ``[start, end)`` on each axis
    (latent units times ``vae_scale_factors``; frames shifted by ``causal_offset - 8``, clamped at 0, over ``fps``,
    default 24), its midpoint over the base ``(pos_embed_max_pos, base_height, base_width)``, mapped to
    ``2 g - 1``. float32 in the model's order of operations."""
    fps = 24 if fps is None else fps
    patch = [int(get("patch_size_t"))] + [int(get("patch_size"))] * 2
    scales, offset = [int(scale) for scale in get("vae_scale_factors")], int(get("causal_offset"))
    bases = [int(get("pos_embed_max_pos")), int(get("base_height")), int(get("base_width"))]
    axes = []
    for n, size, scale, base in zip((frames, height, width), patch, scales, bases):
        start = torch.arange(n, dtype=torch.float32) * size
        span = torch.stack([start, start + size]) * scale                                # [2, n]: pixel [start, end)
        if not axes:   # the first frame is one pixel frame (causal VAE), later ones scale apart
            span = (span + offset - scale).clamp(min=0) / fps
        axes.append((span[0] + span[1]) / 2.0 / base)                                    # [n]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)           # [T H W, 3]
    return grid * 2 - 1


def _patch_table_ids(*, crop: bool):
    """PatchEmbed's sin-cos positions ``(column, row)``: each axis ``arange(n) / (n / base)``, ``base = sample_size /
    patch_size``, over the latent grid (DiT), or over the ``pos_embed_max_size`` grid centre-cropped to it (SD3)."""
    def positions(get, frames, height, width, text_len) -> Tensor:
        base = int(get("sample_size")) // int(get("patch_size"))
        size = int(get("pos_embed_max_size")) if crop else None
        if crop and (height > size or width > size):
            raise ValueError(f"the latent grid {height} x {width} exceeds pos_embed_max_size={size}")
        axes = [torch.arange(n if size is None else size, dtype=torch.float64) / ((n if size is None else size) / base)
                for n in (height, width)]
        if crop:   # the centre crop of the size x size table
            axes = [axis[(size - n) // 2:(size - n) // 2 + n] for axis, n in zip(axes, (height, width))]
        rows, cols = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([cols, rows], -1).reshape(-1, 2).float()                      # [H W, 2]: (col, row)
    return positions


_FLUX_AXES = {"attention_head_dim": 128, "axes_dims_rope": (16, 56, 56)}
_FLUX_ROPE = _axial_rope("axes_dims_rope", dim="attention_head_dim")   # theta 10000 is in the model class


def _qwen_image_rope(get) -> dict:
    """Qwen-Image's RoPE; its Layer3D variant (``use_layer3d_rope``) turns by the same angles, only its ids differ."""
    get("use_layer3d_rope")                                                              # checked: a bool
    return _FLUX_ROPE(get)


_HUNYUAN_VIDEO = _DiffusersModel("RotaryPositionalEmbedding", {
    "attention_head_dim": 128, "rope_axes_dim": (16, 56, 56), "rope_theta": 256.0},
    _axial_rope("rope_axes_dim", base="rope_theta", dim="attention_head_dim"), _video_grid)
_WAN = _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 128}, _axial_rope(_wan_axes), _video_grid)
_DIFFUSERS_MODELS = {
    # axial RoPE over explicit ids (text, h, w, ...): Flux.1 and its clones, theta 10000 in the class
    **{name: _DiffusersModel("RotaryPositionalEmbedding", _FLUX_AXES, _FLUX_ROPE, _flux_ids)
       for name in ("FluxTransformer2DModel", "ChromaTransformer2DModel")},
    **{name: _DiffusersModel("RotaryPositionalEmbedding", _FLUX_AXES, _FLUX_ROPE) for name in (
        "LongCatImageTransformer2DModel", "OvisImageTransformer2DModel")},
    "Krea2Transformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "axes_dims_rope": (32, 48, 48), "rope_theta": 1000.0},
        _axial_rope("axes_dims_rope", base="rope_theta", dim="attention_head_dim")),
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "axes_dims_rope": (32, 32, 32, 32), "rope_theta": theta},
        _axial_rope("axes_dims_rope", base="rope_theta", dim="attention_head_dim"), ids)
       for name, theta, ids in (("Flux2Transformer2DModel", 2000.0, _flux2_ids),
                                ("Flux3Transformer2DModel", 10000.0, None))},
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56), "rope_theta": 10000.0},
        _axial_rope("axes_dims_rope", base="rope_theta", dim="attention_head_dim"), _flux_ids)
       for name in ("BriaTransformer2DModel", "BriaFiboTransformer2DModel")},
    "HiDreamImageTransformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "axes_dims_rope": (32, 32)}, _FLUX_ROPE),
    # the same over integer ids into per-axis tables of axes_lens rows (Z-Image's RopeEmbedder, Lumina 2)
    "ZImageTransformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "dim": 3840, "n_heads": 30, "axes_dims": (32, 48, 48), "rope_theta": 256.0},
        _axial_rope("axes_dims", base="rope_theta", dim=lambda get: get("dim") // get("n_heads"))),
    "BriaFibo2Transformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {"axes_dims": (32, 48, 48),
                                                   "rope_theta": 256.0}, _axial_rope("axes_dims", base="rope_theta")),
    "Lumina2Transformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "hidden_size": 2304, "num_attention_heads": 24, "axes_dim_rope": (32, 32, 32)},
        _axial_rope("axes_dim_rope", dim=lambda get: get("hidden_size") // get("num_attention_heads"))),
    # (t, h, w) video grids
    **{name: _HUNYUAN_VIDEO for name in ("HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel",
                                         "MotifVideoTransformer3DModel")},
    "HunyuanImageTransformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "rope_axes_dim": (64, 64), "rope_theta": 256.0},
        _axial_rope("rope_axes_dim", base="rope_theta", dim="attention_head_dim")),
    **{name: _WAN for name in ("WanTransformer3DModel", "WanVACETransformer3DModel", "WanAnimateTransformer3DModel",
                               "SkyReelsV2Transformer3DModel", "AnyFlowTransformer3DModel")},
    "AnyFlowFARTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "patch_size": (1, 2, 2), "compressed_patch_size": (1, 4, 4)},
        _axial_rope(_anyflow_far_axes)),
    "WanAnimate2Transformer3DModel": _DiffusersModel(
        "RotaryPositionalEmbedding", {"dim": 5120, "num_heads": 40},
        _axial_rope(lambda get: _wan_split(get("dim") // get("num_heads")))),
    "SanaVideoTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 112},
                                                   _axial_rope(_wan_axes)),
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {"axes_dims": axes}, _axial_rope("axes_dims"))
       for name, axes in (("Kandinsky5Transformer3DModel", (16, 24, 24)),
                          ("Kandinsky6Transformer3DModel", (32, 48, 48)),
                          ("Kandinsky6SRTransformer3DModel", (16, 24, 24)))},
    # CogVideoX: RoPE, or (1.0 2B, use_rotary_positional_embeddings=False) a 3-D sin-cos table of unequal slices;
    # 1.0 5B I2V adds a learned table to its tokens beside the RoPE
    **{name: (_DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 64, "use_rotary_positional_embeddings": False, "patch_size": 2, "patch_size_t": None,
        "sample_height": 60, "sample_width": 90}, _axial_rope(_cogvideox_axes), _cogvideox_ids),
              _DiffusersModel("SinusoidalPositionalEmbedding", {"num_attention_heads": 30, "attention_head_dim": 64,
                                                                "use_rotary_positional_embeddings": False},
                              _cogvideox_sincos),
              _DiffusersModel("LearnedPositionalEmbedding", {
                  "num_attention_heads": 30, "attention_head_dim": 64, "use_learned_positional_embeddings": False,
                  "patch_size": 2, "patch_size_t": None, "sample_height": 60, "sample_width": 90, "sample_frames": 49,
                  "temporal_compression_ratio": 4, "max_text_seq_length": 226}, _cogvideox_learned))
       for name in ("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel")},
    "EasyAnimateTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 64},
                                                     _axial_rope(_split_3d_axes)),
    "ChronoEditTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 128},
                                                    _axial_rope(_chronoedit_axes)),
    "HunyuanDiT2DModel": _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 88},
                                         _axial_rope(_halves)),
    "PRXTransformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "hidden_size": 1792, "num_heads": 28, "axes_dim": None, "theta": 10000.0},
        _axial_rope(lambda get: get("axes_dim", (32, 32)) or (32, 32), base="theta",
                    dim=lambda get: get("hidden_size") // get("num_heads"))),
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {
        "hidden_size": 3072, "num_attention_heads": 24, "rope_dim_list": (16, 56, 56), "theta": 256.0},
        _axial_rope(lambda get: get("rope_dim_list", (16, 56, 56))
                    or [get("hidden_size") // get("num_attention_heads") // 3] * 3,
                    base="theta", dim=lambda get: get("hidden_size") // get("num_attention_heads")))
       for name in ("JoyImageEditTransformer3DModel", "JoyImageEditPlusTransformer3DModel")},
    "QwenImageTransformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56), "use_layer3d_rope": False}, _qwen_image_rope,
        _qwen_image_ids),
    **{name: _DiffusersModel("RotaryPositionalEmbedding", _FLUX_AXES, _FLUX_ROPE)
       for name in ("NucleusMoEImageTransformer2DModel", "QwenImage21Transformer2DModel")},
    # CogView4, GLM-Image: (h, w) halves of the head, half-split pairs
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 40},
                             _axial_rope(_halves, interleaved=False))
       for name in ("CogView4Transformer2DModel", "GlmImageTransformer2DModel")},
    # Qwen3-VL's interleaved M-RoPE; Cosmos 3 takes rope_axes_dim, else rope_scaling's mrope_section
    "Ideogram4Transformer2DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 256, "rope_theta": 5e6, "mrope_section": (24, 20, 20)},
        _interleaved_mrope("attention_head_dim", "mrope_section")),
    "Cosmos3OmniTransformer": _DiffusersModel("RotaryPositionalEmbedding", {
        "head_dim": 128, "rope_theta": 5e6, "rope_axes_dim": None, "rope_scaling": None},
        _interleaved_mrope("head_dim", _cosmos3_sections)),
    # MiniMax-H3: one spectrum over 2F channels per axis, (t, h, w) contiguous, on the leading 6F channels
    "MiniMaxH3Transformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 128, "rope_freq_dim": 16, "rope_theta": 10000.0},
        lambda get: {"dim": int(get("attention_head_dim")), "rotary_dim": 6 * int(get("rope_freq_dim")),
                     "base": float(get("rope_theta")), "sections": [int(get("rope_freq_dim"))] * 3,
                     "axis_spectrum": "per_axis"}),
    # OmniGen: Phi-3's longrope in its attention, and a 2-D table (pos_embed_max_size, base 64) on the patches
    "OmniGenTransformer2DModel": (
        _DiffusersModel("RotaryPositionalEmbedding", {
            "hidden_size": 3072, "num_attention_heads": 32, "rope_base": 10000.0, "rope_scaling": None,
            "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}, _omnigen_rope),
        _DiffusersModel("SinusoidalPositionalEmbedding", {"hidden_size": 3072},
                        lambda get: {"dim": int(get("hidden_size")), "layout": "concat", "num_axes": 2})),
    # Cosmos 1.0 / 2: RoPE with a base per axis, and 1.0's learned (t, h, w) tables, summed and RMS-normalised, in
    # every block
    "CosmosTransformer3DModel": (
        _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 128, "rope_scale": (2.0, 1.0, 1.0)},
                        _cosmos_rope, _cosmos_ids),
        _DiffusersModel("LearnedPositionalEmbedding", {
            "num_attention_heads": 32, "attention_head_dim": 128, "max_size": (128, 240, 240),
            "patch_size": (1, 2, 2), "extra_pos_embed_type": "learnable"}, _cosmos_tables)),
    # Allegro: a 1-D RoPE per third of the head, each half-split (chunks)
    "AllegroTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 96, "interpolation_scale_t": 2.2, "interpolation_scale_h": 2.0,
        "interpolation_scale_w": 2.0}, _allegro_rope, _allegro_ids),
    # Lumina-Next: (row, col) pairs alternating, a spectrum per axis
    "LuminaNextDiT2DModel": _DiffusersModel("RotaryPositionalEmbedding", {"hidden_size": 2304,
                                                                          "num_attention_heads": 32},
                                            _lumina_next_rope, _image_grid),
    # LTX-Video, LTX-2, the Sana-WM refiner: a rising spectrum over t h w interleaved pairs of the whole width
    "LTXVideoTransformer3DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "num_attention_heads": 32, "attention_head_dim": 64, "patch_size": 1, "patch_size_t": 1}, _ltx_rope(False),
        _ltx_ids),
    **{name: _DiffusersModel("RotaryPositionalEmbedding", {
        "num_attention_heads": 32, "attention_head_dim": 128, "rope_theta": 10000.0, "rope_type": "interleaved",
        "patch_size": 1, "patch_size_t": 1, "vae_scale_factors": (8, 32, 32), "causal_offset": 1,
        "pos_embed_max_pos": 20, "base_height": 2048, "base_width": 2048}, _ltx_rope(True), _ltx2_ids)
       for name in ("LTX2VideoTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel")},
    # Mochi: RoPE-Mixed, learned [3, H, Dh/2] frequencies (zeros until its checkpoint loads)
    "MochiTransformer3DModel": _DiffusersModel("MixedRotaryPositionalEmbedding", {
        "num_attention_heads": 24, "attention_head_dim": 128},
        lambda get: {"head_dim": int(get("attention_head_dim")), "num_heads": int(get("num_attention_heads")),
                     "num_axes": 3}, _mochi_ids),
    # ERNIE-Image: per-axis angles repeated twice and applied half-split (not a rotation: a compatibility mode)
    "ErnieImageTransformer2DModel": _DiffusersModel("DiffusersCompatRotaryEmbedding", {
        "hidden_size": 3072, "num_attention_heads": 24, "rope_theta": 256, "rope_axes_dim": (32, 48, 48)},
        _compat_rope("ernie_image", "rope_axes_dim", lambda get: get("hidden_size") // get("num_attention_heads"))),
    # FramePack, Helios: HunyuanVideo's / their own RoPE, with history tokens whose cos and sin are window averages
    "HunyuanVideoFramepackTransformer3DModel": _DiffusersModel("DiffusersCompatRotaryEmbedding", {
        "attention_head_dim": 128, "rope_axes_dim": (16, 56, 56), "rope_theta": 256.0},
        _compat_rope("pooled", "rope_axes_dim", "attention_head_dim")),
    "HeliosTransformer3DModel": _DiffusersModel("DiffusersCompatRotaryEmbedding", {
        "attention_head_dim": 128, "rope_dim": (44, 42, 42), "rope_theta": 10000.0},
        _compat_rope("pooled", "rope_dim", "attention_head_dim")),
    # 1-D RoPE of the audio models
    "StableAudioDiTModel": _DiffusersModel("RotaryPositionalEmbedding", {"attention_head_dim": 64},
                                           lambda get: _half_rope(int(get("attention_head_dim")))),
    "StableAudio3DiTModel": _DiffusersModel("RotaryPositionalEmbedding", {"embed_dim": 1536, "num_heads": 24},
                                            lambda get: _half_rope(int(get("embed_dim")) // int(get("num_heads")))),
    "AceStepTransformer1DModel": _DiffusersModel("RotaryPositionalEmbedding", {"head_dim": 128, "rope_theta": 1e6},
                                                 lambda get: {"dim": int(get("head_dim")),
                                                              "base": float(get("rope_theta"))}),
    "LongCatAudioDiTTransformer": _DiffusersModel("RotaryPositionalEmbedding", {"dit_dim": 1536, "dit_heads": 24},
                                                  lambda get: {"dim": int(get("dit_dim")) // int(get("dit_heads")),
                                                               "base": 100000.0}),
    "MiniMaxMusic3Transformer1DModel": _DiffusersModel("RotaryPositionalEmbedding", {
        "attention_head_dim": 64, "rotary_dim": 32},
        lambda get: {"dim": int(get("attention_head_dim")), "rotary_dim": int(get("rotary_dim"))}),
    # 2-D sin-cos tables added to the patch tokens (PatchEmbed): sines then cosines, the column on the first half
    **{name: _DiffusersModel("SinusoidalPositionalEmbedding",
                             {"num_attention_heads": heads, "attention_head_dim": head, **grid}, _sincos_2d, ids)
       for name, heads, head, grid, ids in (
        ("DiTTransformer2DModel", 16, 72, {"sample_size": 32, "patch_size": 2}, _patch_table_ids(crop=False)),
        ("PixArtTransformer2DModel", 16, 72, {}, None),
        ("SD3Transformer2DModel", 18, 64, {"sample_size": 128, "patch_size": 2, "pos_embed_max_size": 96},
         _patch_table_ids(crop=True)),
        ("LatteTransformer3DModel", 16, 88, {}, None), ("CogView3PlusTransformer2DModel", 64, 40, {}, None))},
    "SanaTransformer2DModel": _DiffusersModel("SinusoidalPositionalEmbedding", {
        "num_attention_heads": 70, "attention_head_dim": 32, "interpolation_scale": None}, _sana_sincos),
    "Transformer2DModel": (_DiffusersModel("SinusoidalPositionalEmbedding", {
        "num_attention_heads": 16, "attention_head_dim": 88, "patch_size": None, "num_vector_embeds": None},
        _transformer_2d_sincos),
        # VQ-Diffusion (num_vector_embeds): learned (row, column) tables, summed
        _DiffusersModel("LearnedPositionalEmbedding", {
            "num_attention_heads": 16, "attention_head_dim": 88, "num_vector_embeds": None, "sample_size": None},
            _vq_diffusion_tables)),
    # AnimateDiff-style temporal transformer: diffusers' SinusoidalPositionalEmbedding in each block (Vaswani's)
    "TransformerTemporalModel": _DiffusersModel("SinusoidalPositionalEmbedding", {
        "num_attention_heads": 16, "attention_head_dim": 88, "positional_embeddings": None}, _temporal_sincos),
    # a learned 2-D table, centre-cropped (AuraFlow)
    "AuraFlowTransformer2DModel": _DiffusersModel("LearnedPositionalEmbedding", {
        "num_attention_heads": 12, "attention_head_dim": 256, "pos_embed_max_size": 1024},
        lambda get: {"max_len": int(get("pos_embed_max_size")), "init_std": 0.1,
                     "dim": int(get("num_attention_heads")) * int(get("attention_head_dim"))}),
    # learned 1-D tables (their init: Prior's zeros, an nn.Embedding's N(0, 1))
    "PriorTransformer": _DiffusersModel("LearnedPositionalEmbedding", {
        "num_attention_heads": 32, "attention_head_dim": 64, "num_embeddings": 77, "additional_embeddings": 4},
        lambda get: {"max_len": int(get("num_embeddings")) + int(get("additional_embeddings")), "init_std": 0.0,
                     "dim": int(get("num_attention_heads")) * int(get("attention_head_dim"))}),
    "MiniMaxMusic3RVQDepthDecoder": _DiffusersModel("LearnedPositionalEmbedding", {
        "hidden_size": 4096, "max_position_embeddings": 16},
        lambda get: {"max_len": int(get("max_position_embeddings")), "dim": int(get("hidden_size")), "init_std": 1.0}),
    "T5FilmDecoder": _DiffusersModel("LearnedPositionalEmbedding", {"targets_length": 256, "d_model": 768},
                                     lambda get: {"max_len": int(get("targets_length")), "dim": int(get("d_model")),
                                                  "init_std": 1.0}),
}


# Model classes whose config from_config refuses: why (docs/diffusers.md says the same).
_DIFFUSERS_REFUSED = {
    "DreamLiteTransformer2DModel": "the model adds no position encoding (its blocks get no positional_embeddings)",
    "SanaWMTransformer3DModel": "it multiplies q and k by per-token 4x4 camera matrices",
    "RFD4ProteinaTransformer": "a protein model whose tokens carry no position index: its one position-like "
                               "signal, the bond-path length between tokens (one-hot, seq_sep_dim bins), enters "
                               "the pair representation with distances and bond features, is updated by triangle "
                               "multiplications, and biases attention only through it, so no position encoding "
                               "separates from the model",
}


def _diffusers_class_name(owner: str, config) -> Optional[str]:
    """The ``_class_name`` of a diffusers config (its ``config.json`` dict or a loaded ``model.config``), else None."""
    if not isinstance(config, dict):
        return None
    name = config.get("_class_name")
    if name is None and "_use_default_values" in config:   # a model built in code records no class name
        raise ValueError(f"{owner}: this diffusers config has no _class_name (the model was built in code, not "
                         f"loaded); pass dict(model.config, _class_name=type(model).__name__)")
    return None if name is None else str(name)


def _diffusers_kwargs(owner_class: str, config, stated: dict) -> dict:
    """Keyword arguments of ``owner_class`` reproducing the position encoding of a diffusers model config."""
    owner = f"{owner_class}.from_config"
    name = _diffusers_class_name(owner, config)
    if name is None:
        error = ValueError if isinstance(config, dict) else TypeError
        raise error(f"{owner}: config must be a diffusers model config (its config.json dict, or the loaded "
                    f"model.config, with _class_name), got {_describe(config)}")
    stated = {key: value for key, value in stated.items() if value is not None}
    if stated:
        raise ValueError(f"{owner}: a diffusers config ({name}) fixes its layout; {', '.join(sorted(stated))} do "
                         f"not apply, got {stated}")
    entries = _diffusers_entries(owner, name, config)
    entry = next((entry for entry in entries if entry.encoding == owner_class), None)
    if entry is None:
        classes = " and ".join(entry.encoding for entry in entries)
        raise ValueError(f"{owner}: {name} (diffusers config _class_name) uses {classes}; call "
                         f"{entries[0].encoding}.from_config(config)")
    return _diffusers_call(owner, name, entry.read, _diffusers_get(owner, name, config, entry))


def _diffusers_call(owner: str, name: str, function, *args, **kwargs):
    """``function(*args, **kwargs)`` with the ValueError or TypeError a reader raises prefixed by ``owner`` and the
    model class ``name`` (the errors of ``_diffusers_get`` carry them already)."""
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError) as error:
        if str(error).startswith(f"{owner}: "):
            raise
        raise (ValueError if isinstance(error, ValueError) else TypeError)(f"{owner}: {name}: {error}") from None


# Config fields of per-axis widths: one entry per axis the model has, so any length (other sequence fields have the
# length of the model's default); int fields that may be 0 (the others are sizes, counts, strides: positive).
_DIFFUSERS_PER_AXIS = frozenset({"axes_dims_rope", "rope_axes_dim", "axes_dims", "axes_dim_rope", "rope_dim",
                                 "axes_dim", "rope_dim_list"})
_DIFFUSERS_NON_NEGATIVE = frozenset({"additional_embeddings", "causal_offset"})


def _diffusers_value(owner: str, field: str, value, like):
    """A config field's ``value`` checked against ``like``, a value of its type (the model's default): a bool, a
    positive int (non-negative in ``_DIFFUSERS_NON_NEGATIVE``), a positive finite real number, a string, a dict, or a
    list or tuple of such (a string or dict field may be None); a None ``like`` checks nothing."""
    if _is_bool(like):
        return _check_flag(owner, field, value)
    if isinstance(like, int):
        return _as_int(owner, field, value, minimum=0 if field in _DIFFUSERS_NON_NEGATIVE else 1)
    if isinstance(like, float):
        return _positive_float(owner, field, value)
    if isinstance(like, (str, dict)) and not isinstance(value, (type(like), type(None))):   # None: the option off
        raise TypeError(f"{owner}: {field} must be a {type(like).__name__}, got {type(value).__name__} "
                        f"{_describe(value)}")
    if isinstance(like, (tuple, list)):
        items, free = _as_list(owner, field, value), field in _DIFFUSERS_PER_AXIS
        if not items or not (free or len(items) == len(like)):
            want = "a non-empty list (one entry per axis)" if free else f"a list of {len(like)} entries"
            raise ValueError(f"{owner}: {field} must be {want}, got {field}={_describe(value)}")
        return [_diffusers_value(owner, f"{field}[{i}]", item, like[0]) for i, item in enumerate(items)]
    return value


def _diffusers_get(owner: str, name: str, config, entry: _DiffusersModel):
    """``get(field, like=None)``: a field the config sets, else the model's default, checked against the type of the
    default (``_diffusers_value``), or of ``like``, which a reader passes for a field the model also reads as None.
    None passes only there, or where the default is None (the model reads that None too)."""
    def get(field: str, like=None):
        default = entry.defaults[field]
        value = config[field] if field in config else default
        if value is None and (default is None or like is not None):
            return None
        return _diffusers_value(f"{owner}: {name}", field, value, default if like is None else like)
    return get


def _diffusers_entries(owner: str, name: str, config) -> tuple:
    """The table's entries of the model class ``name``, or the ValueError saying why it is refused."""
    if name in _DIFFUSERS_REFUSED:
        raise ValueError(f"{owner}: {name} (diffusers config _class_name) is not supported: {_DIFFUSERS_REFUSED[name]}")
    if name not in _DIFFUSERS_MODELS:
        raise ValueError(f"{owner}: _class_name={name!r} is not a diffusers transformer model this file reads "
                         f"(docs/diffusers.md lists them)")
    entries = _DIFFUSERS_MODELS[name]
    return (entries,) if isinstance(entries, _DiffusersModel) else entries


class DiffusersCompatRotaryEmbedding(RotaryPositionalEmbedding):
    """Compatibility modes for diffusers models whose "RoPE" is not a rotation (``"ernie_image"``, ``"pooled"``).

    ERNIE-Image (``ErnieImageTransformer2DModel``) builds Flux-style per-axis angles ``f_0, f_1, ...`` (``F = Dh / 2``
    of them, axis ``a`` on ``rope_axes_dim[a] / 2`` with its own spectrum ``rope_theta ** (-2j / rope_axes_dim[a])``),
    repeats each twice (``f_0 f_0 f_1 f_1 ...``, ``Dh`` angles for ``Dh`` channels) and applies them half-split
    (``x * cos + rotate_half(x) * sin``). Channels ``c`` and ``c + Dh / 2`` form each pair, but channel ``c`` turns by
    ``f_{c // 2}`` and channel ``c + Dh / 2`` by ``f_{c // 2 + Dh / 4}``: the pair's matrix ``[[cos a, -sin a], [sin b,
    cos b]]`` has determinant ``cos(a - b)``, so it is not a rotation. What that costs: the norms of q and k change
    with position (each pair shrinks or grows by up to ``|sin(a - b)|``), and ``q . k`` depends on both positions, not
    only on their difference (RoPE's relative-position property is lost). This class reproduces it exactly, for
    loading ERNIE-Image's checkpoints; it is not a position encoding to choose for a new model.

    ``"pooled"``: FramePack's (``HunyuanVideoFramepackTransformer3DModel``) and Helios's history tokens. Each stands
    for a window of latent positions, and the model averages the cos and the sin of those positions (RoPE's interleaved
    pairs, each axis its own spectrum) instead of turning by one angle. Positions are ``[..., N, A, K]``: ``K``
    positions per axis per token, whose cos and sin are averaged (an ordinary token repeats its position ``K`` times;
    the average over a window ``W_t x W_h x W_w`` is the per-axis average, since each pair reads one axis). An average
    of unit vectors is shorter than 1, by ``|sum_j exp(i w p_j)| / K``: the fast pairs of a wide window shrink towards
    zero, so q and k lose norm and ``q . k`` no longer depends on the difference of positions alone. Exact for loading
    those checkpoints, and not a rotation.

    Built with ``from_config`` (the diffusers config) or as ``RotaryPositionalEmbedding`` is (the per-axis
    ``sections``; half-split pairs for ``"ernie_image"``, interleaved for ``"pooled"``); ``rerotate`` refuses (there is
    no rotation to compose), ``rotate_values`` is not taken.

    Args:
        mode (str): ``"ernie_image"`` or ``"pooled"``.
        dim, base, sections, axis_spectrum: as ``RotaryPositionalEmbedding``'s (the whole head turns).

    Shape:
        - x: ``[..., N, Dh]`` (or ``[..., N, H, Dh]`` with ``seq_dim=-3``); positions ``[N, A]`` or ``[B, N, A]``
          (``"pooled"``: ``[N, A, K]`` or ``[B, N, A, K]``, required).
        - Output: x's shape.

    Example:
        >>> # from_config({"_class_name": "ErnieImageTransformer2DModel", "hidden_size": 256, "num_attention_heads": 2})
        >>> ernie = DiffusersCompatRotaryEmbedding(128, mode="ernie_image", base=256, sections=[16, 24, 24],
        ...                                        axis_spectrum="per_axis")
        >>> ids = torch.tensor([[2.0, 0, 0], [2, 0, 1], [0, 0, 0], [1, 0, 0]])   # image (L, row, col), text (i, 0, 0)
        >>> ernie(torch.randn(1, 2, 4, 128), ids).shape
        torch.Size([1, 2, 4, 128])
    """

    arguments = {"mode": functools.partial(_check_choice, choices=("ernie_image", "pooled"))}

    def __init__(self, dim: int, *, mode: Literal["ernie_image", "pooled"] = "ernie_image", base: float = 10000.0,
                 sections: Optional[list] = None, axis_spectrum: Literal["shared", "per_axis", "strided"] = "shared",
                 cache_len: int = 4096) -> None:
        super().__init__(dim, base=base, sections=sections, axis_spectrum=axis_spectrum, cache_len=cache_len,
                         interleaved=mode == "pooled")
        self.mode = mode

    @classmethod
    def from_config(cls, config) -> "DiffusersCompatRotaryEmbedding":
        """The compatibility mode of a diffusers model config (``config.json`` dict or ``model.config``, with
        ``_class_name``): ERNIE-Image's. docs/diffusers.md gives the positions it feeds."""
        return cls(**_diffusers_kwargs("DiffusersCompatRotaryEmbedding", config, {}))

    def extra_repr(self) -> str:   # the constructor's own arguments, so that the repr rebuilds the module
        return f"mode={self.mode!r}, dim={self.dim}, base={self.base}" + self._layout_repr()

    def rerotate(self, x: Tensor, old_positions: Tensor, new_positions: Tensor, *, seq_dim: int = -2) -> Tensor:
        raise TypeError(f"{type(self).__name__}: mode={self.mode!r} is not a rotation, so keys cannot be turned "
                        f"from old to new positions; encode them again from the unrotated keys")

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, *, offset: int = 0,
                seq_dim: Literal[-2, -3] = -2) -> Tensor:
        if self.mode != "pooled":
            return super().forward(x, positions, offset=offset, seq_dim=seq_dim)
        self._check_rotated(x, seq_dim)
        lead, n = tuple(x.shape[:seq_dim]), x.shape[seq_dim]
        check = lambda p: _check_positions(type(self).__name__, "positions", p, lead, n, self.num_axes,  # noqa: E731
                                           device=x.device)
        return self._apply_rotation(x, *self._pooled_cos_sin("positions", positions, check, x.dtype), seq_dim)

    def _pooled_slice(self, name: str, positions, j: int) -> Tensor:
        """``"pooled"``: the ``j``-th of the ``K`` positions of each axis, ``[..., N, A]`` (``[..., N]`` for one
        axis), from ``positions`` ``[..., N, A, K]``, whose shape is checked here."""
        if not isinstance(positions, Tensor) or positions.dim() < 3 or positions.shape[-2] != self.num_axes \
                or positions.shape[-1] == 0:
            error = ValueError if isinstance(positions, Tensor) else TypeError
            raise error(f"{type(self).__name__}: mode='pooled' needs {name} [..., N, {self.num_axes}, K] (K >= 1 "
                        f"positions per axis, averaged), got {_describe(positions)}")
        return positions[..., j] if self.num_axes > 1 else positions[..., 0, j]

    def _check_qk(self, q: Tensor, k: Tensor, positions_q: Optional[Tensor], positions_k: Optional[Tensor],
                  grouped: bool = False) -> tuple:
        if self.mode != "pooled":
            return super()._check_qk(q, k, positions_q, positions_k, grouped)
        try:
            super()._check_qk(q, k, self._pooled_slice("positions_q", positions_q, 0),
                              self._pooled_slice("positions_k", positions_k, 0), grouped)
        except ValueError as error:
            raise self._pooled_error(error, f"positions_q {list(positions_q.shape)} and positions_k "
                                            f"{list(positions_k.shape)}") from None
        return positions_q, positions_k

    def _pooled_error(self, error: ValueError, given: str) -> ValueError:
        """``"pooled"``: a position check's error, which names a ``[..., N, A]`` slice, told of the ``K`` axis."""
        return ValueError(f"{error} (mode='pooled' checks each [..., N, {self.num_axes}] slice of positions "
                          f"[..., N, {self.num_axes}, K], got {given})")

    def _pooled_cos_sin(self, name: str, positions, check, dtype: torch.dtype) -> tuple:
        """``"pooled"``: cos and sin ``[..., N, F]`` averaged over the ``K`` positions of ``positions``
        ``[..., N, A, K]``, each ``K`` slice validated by ``check`` (as ``forward`` or ``encode_qk`` take them)."""
        cos = sin = 0.0
        self._pooled_slice(name, positions, 0)                                          # checks the shape
        for j in range(positions.shape[-1]):
            try:
                checked = check(self._pooled_slice(name, positions, j))
            except ValueError as error:
                raise self._pooled_error(error, f"{name} {list(positions.shape)}") from None
            angles = self._pair_angles(checked, self.inv_freq)                           # [..., N, F]
            cos, sin = cos + angles.cos(), sin + angles.sin()                           # float64
        dtype = _compute_dtype(dtype)
        return (cos / positions.shape[-1]).to(dtype), (sin / positions.shape[-1]).to(dtype)

    def encode_qk(self, q, k, positions_q=None, positions_k=None):
        if self.mode == "pooled":   # each side's slices checked as the base's hooks check positions
            lead, q_len, k_len = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
            check_q = lambda p: self._hook_positions(lead, q_len, k_len, p, None, q.device)[0]   # noqa: E731
            check_k = lambda p: self._hook_positions(lead, q_len, k_len, None, p, q.device)[1]   # noqa: E731
            return (self._apply_rotation(q, *self._pooled_cos_sin("positions_q", positions_q, check_q, q.dtype)),
                    self._apply_rotation(k, *self._pooled_cos_sin("positions_k", positions_k, check_k, k.dtype)))
        q_len, k_len, dtype = q.shape[-2], k.shape[-2], _compute_dtype(q.dtype)
        positions_q, positions_k = self._hook_positions(tuple(q.shape[:-2]), q_len, k_len, positions_q, positions_k,
                                                        q.device)
        return tuple(self._apply_rotation(x, *self._call_cos_sin(side, q_len, k_len, positions_q, positions_k,
                                                                  x.device, dtype)) for side, x in (("q", q), ("k", k)))

    def _apply_rotation(self, x: Tensor, cos: Tensor, sin: Tensor, seq_dim: int = -2) -> Tensor:
        if self.mode == "pooled":   # RoPE's formula on the shortened (cos, sin): x * cos + rotate(x) * sin
            return super()._apply_rotation(x, cos, sin, seq_dim)
        if seq_dim == -3:  # [..., N, F] -> [..., N, 1, F]: one angle for every head
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        # channel c takes angle f_{c // 2} (f_0 f_0 f_1 f_1 ...), paired half-split with channel c + Dh / 2
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)          # [..., N, Dh]
        first, second = x.to(cos.dtype).chunk(2, -1)                                   # [..., N, Dh / 2] each
        turned = torch.cat([first, second], -1) * cos + torch.cat([-second, first], -1) * sin
        return turned.to(x.dtype)


def diffusers_positions(config, *, height: int, width: int, frames: Optional[int] = None,
                        text_len: int = 0, fps: Optional[float] = None, reference: Optional[tuple] = None,
                        layers: Optional[int] = None) -> Tensor:
    """The position ids a diffusers pipeline (or model) feeds the encoding ``from_config`` builds from ``config``.

    Args:
        config: a diffusers transformer config (its ``config.json`` dict or the loaded ``model.config``), read by
            its ``_class_name`` as ``from_config`` reads it.
        height, width: the latent grid after patching (tokens per column and per row).
        frames: the latent frames after patching, for video models (None for image models).
        text_len: the text tokens that take positions, before the image (models whose text gets none take 0).
        fps: the frame rate a video pipeline passes its transformer, for the models whose positions take it
            (Cosmos: frames at ``frame / fps * 24``, None numbers them; LTX-Video, LTX-2: the frame rate, None
            their pipelines' default 25, 24); None for the others.
        reference: Flux Kontext's reference image, its ``(height, width)`` patch grid: its ids ``(1, row, col)``
            follow the image's (``FluxKontextPipeline``; ``FluxTransformer2DModel``). None: no reference. For
            Qwen-Image-Layered, the condition image's grid (None: ``height x width``).
        layers: Qwen-Image-Layered's ``layers`` (``QwenImageTransformer2DModel`` with ``use_layer3d_rope=True``,
            ``QwenImageLayeredPipeline``): ``layers + 1`` layer grids at frames ``0 .. layers``, then the condition
            image at frame -1. None for every other model.

    Shape:
        - Output: ``[N, A]`` float32, the tokens in the model's order (text, then the patches row-major); ``A``
          the encoding's axes. docs/diffusers.md lists the models covered.

    Example:
        >>> ids = diffusers_positions({"_class_name": "FluxTransformer2DModel"}, height=2, width=3, text_len=4)
        >>> ids.shape, ids[-1].tolist()
        (torch.Size([10, 3]), [0.0, 1.0, 2.0])
    """
    owner = "diffusers_positions"
    name = _diffusers_class_name(owner, config)
    if name is None:
        error = ValueError if isinstance(config, dict) else TypeError
        raise error(f"{owner}: config must be a diffusers model config with _class_name, got {_describe(config)}")
    entry = next((entry for entry in _diffusers_entries(owner, name, config) if entry.positions is not None), None)
    if entry is None:
        raise ValueError(f"{owner}: the position ids of {name} are not built yet (docs/diffusers.md gives them)")
    height, width = _as_int(owner, "height", height), _as_int(owner, "width", width)
    text_len = _as_int(owner, "text_len", text_len, minimum=0)
    timed = entry.positions in (_cosmos_ids, _ltx_ids, _ltx2_ids)
    video = entry.positions in (_video_grid, _mochi_ids, _allegro_ids, _cogvideox_ids) or timed
    if fps is not None and not timed:
        raise ValueError(f"{owner}: {name}: its positions take no frame rate; fps must be None, got fps={fps!r}")
    if video != (frames is not None):
        want = "the latent frames (an int)" if video else "None (an image model)"
        raise ValueError(f"{owner}: {name}: frames must be {want}, got frames={frames!r}")
    if (video or entry.encoding != "RotaryPositionalEmbedding") and text_len:
        raise ValueError(f"{owner}: {name}: its text tokens take no positions; text_len must be 0, got "
                         f"text_len={text_len}")
    layered = name == "QwenImageTransformer2DModel"   # its builder checks use_layer3d_rope against layers
    if reference is not None and name != "FluxTransformer2DModel" and not layered:
        raise ValueError(f"{owner}: {name}: only Flux.1 (FluxKontextPipeline) and Qwen-Image-Layered take a reference "
                         f"image; reference must be None, got reference={_describe(reference)}")
    if layers is not None and not layered:
        raise ValueError(f"{owner}: {name}: only Qwen-Image-Layered (QwenImageTransformer2DModel) takes layers; "
                         f"layers must be None, got layers={_describe(layers)}")
    frames = None if frames is None else _as_int(owner, "frames", frames)
    extra = {} if reference is None else {"reference": _as_sizes(owner, "reference", reference, 2)}
    if layers is not None:
        extra["layers"] = _as_int(owner, "layers", layers)
    fps = () if fps is None else (_positive_float(f"{owner}: {name}", "fps", fps),)
    ids = _diffusers_call(owner, name, entry.positions, _diffusers_get(owner, name, config, entry), frames, height,
                          width, text_len, *fps, **extra)
    if fps and not bool(ids.isfinite().all()):   # frames over a tiny fps overflow float32
        raise ValueError(f"{owner}: {name}: fps={fps[0]!r} puts the frames past float32's range; fps must keep the "
                         f"positions finite")
    return ids


# ---------------------------------------------------------------------------
# Distributed: sequence sharding of positions and of Heinsen's scan
# ---------------------------------------------------------------------------

# A sequence split over ranks needs, per kind:
#   * "input" / "qk": the shard's GLOBAL positions (``shard_positions``); no communication.
#   * "bias" / "logits": the shard's block of the [Nq, Nk] matrix, from explicit
#     ``positions_q`` (the shard's) and ``positions_k`` (the keys it attends to); the keys and
#     values themselves travel as in any ring / all-gather attention.
#   * Heinsen: a recurrence, so each rank needs the state left by the ranks before it: one
#     all_gather of a [..., 2, d_hid] summary per call (``sharded_log_linear_scan``).

def _check_rank_args(owner: str, seq_len, rank, world_size) -> tuple:
    """Index-like ints with ``seq_len >= 0``, ``world_size > 0``, ``0 <= rank < world_size``."""
    values = []
    for name, value in (("seq_len", seq_len), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
        try:
            values.append(operator.index(value))
        except TypeError:
            raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}") from None
    seq_len, rank, world_size = values
    if seq_len < 0:
        raise ValueError(f"{owner}: seq_len must be >= 0, got seq_len={seq_len}")
    _check_positive_int(owner, "world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"{owner}: rank must lie in [0, world_size={world_size}), got rank={rank}")
    return seq_len, rank, world_size


def shard_positions(seq_len: int, rank: int, world_size: int, *,
                    layout: Literal["contiguous", "head_tail"] = "contiguous", offset: int = 0,
                    device=None) -> Tensor:
    """The global positions of the tokens that ``rank`` holds when a sequence is split over ranks.

    The same tensor indexes the rank's tokens in the full sequence (``x[..., idx, :]``,
    ``positions[idx]`` for multi-axis positions) and is the ``positions`` /
    ``positions_q`` each encoding needs on the shard; ``positions_k`` is the positions of
    the keys the shard attends to (all of them, ``arange(seq_len) + offset``, when the keys
    are all-gathered or rotated through the ring).

    Layouts:

    * ``"contiguous"``: rank ``r`` holds one run of tokens, ranks in sequence order; when
      ``world_size`` does not divide ``seq_len`` the first ``seq_len % world_size`` ranks
      hold one more (``torch.tensor_split``). The only layout a recurrence (Heinsen) can use.
    * ``"head_tail"``: the sequence is cut into ``2 * world_size`` equal chunks and rank
      ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r``, which balances causal
      attention work. This is the order ``torch.distributed.tensor.experimental.
      context_parallel`` gives its buffers by default (``_HeadTailLoadBalancer``), so
      encodings applied inside that context must use these positions.
      ``seq_len`` must be a multiple of ``2 * world_size``.

    Args:
        seq_len (int): tokens in the full sequence.
        rank (int): this rank's index in the sequence-parallel group.
        world_size (int): ranks in the group.
        layout (str): ``"contiguous"`` or ``"head_tail"``. Default: ``"contiguous"``.
        offset (int): added to every position (a KV cache before the sequence). Default: 0.
        device (torch.device, optional): device of the result. Default: CPU.

    Returns:
        int64 ``[N_local]``, increasing within each chunk.

    Example:
        >>> idx = shard_positions(8, rank=1, world_size=2, layout="head_tail")
        >>> idx.tolist()
        [2, 3, 4, 5]
    """
    owner = "shard_positions"
    seq_len, rank, world_size = _check_rank_args(owner, seq_len, rank, world_size)
    offset = _as_int(owner, "offset", offset, minimum=None)
    if layout == "contiguous":
        size, extra = divmod(seq_len, world_size)
        start = rank * size + min(rank, extra)
        return torch.arange(start, start + size + (rank < extra), device=device) + offset
    if layout == "head_tail":
        if seq_len % (2 * world_size):
            raise ValueError(f"{owner}: layout='head_tail' needs seq_len divisible by 2 * world_size = "
                             f"{2 * world_size}, got seq_len={seq_len}")
        chunk = seq_len // (2 * world_size)
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail = torch.arange((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk, device=device)
        return torch.cat([head, tail]) + offset
    raise ValueError(f"{owner}: layout must be 'contiguous' or 'head_tail', got layout={layout!r}")


def _chain_summaries(summaries: Tensor, initial: Tensor, rank: int) -> tuple:
    """Run the recurrence over shard summaries: the state entering ``rank`` and the final state.

    summaries: [W, ..., 2, d] (total log-decay, then final state from an empty start, per
    rank); initial: [..., 1, d] -> (inherited, final), both [..., 1, d]. The same step as the
    scan, ``s = log(exp(a + s) + exp(local))``, in the dtype of its inputs (float64 here).
    """
    state, inherited = initial, initial
    for j in range(summaries.shape[0]):
        if j == rank:
            inherited = state
        state = torch.logaddexp(summaries[j, ..., :1, :] + state, summaries[j, ..., 1:, :])
    return inherited, state


class _ShardSummaryExchange(torch.autograd.Function):
    """All-gather the shard summaries; return this rank's inherited state and the global final state.

    Forward: one ``all_gather`` of ``[..., 2, d]`` float64 per rank, then the float64 chain.
    Backward: the chain's gradient with respect to EVERY rank's summary is computed locally
    and summed over ranks with one ``all_reduce``, so each rank receives what the later ranks
    owe its summary. A custom Function rather than ``torch.distributed.nn.all_gather``
    because rank 0's inherited state does not depend on the gathered tensors: autograd would
    never reach that all_gather's backward on rank 0 while the other ranks wait in theirs.
    Here the Function's own node is reached on every rank (its inputs need grad), so every
    rank enters the collective. The gradient of ``initial`` is this rank's share only (sum it
    over ranks, as for parameters, if ``initial`` is replicated).
    """

    @staticmethod
    def forward(ctx, decay: Tensor, last: Tensor, initial: Tensor, group) -> tuple:
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        summary = torch.cat([decay, last], dim=-2).double().contiguous()                # [..., 2, d]
        gathered = [torch.empty_like(summary) for _ in range(world)]
        dist.all_gather(gathered, summary, group=group)
        summaries = torch.stack(gathered)                                               # [W, ..., 2, d]
        ctx.save_for_backward(summaries, initial)
        ctx.group, ctx.rank = group, rank
        ctx.dtypes = (decay.dtype, last.dtype)
        return _chain_summaries(summaries, initial.double(), rank)                     # float64, [..., 1, d] x 2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_inherited: Tensor, grad_final: Tensor):
        import torch.distributed as dist

        summaries, initial = ctx.saved_tensors
        with torch.enable_grad():
            summaries = summaries.detach().requires_grad_(True)
            start = initial.detach().double().requires_grad_(True)
            outputs = _chain_summaries(summaries, start, ctx.rank)
            grad_summaries, grad_start = torch.autograd.grad(
                outputs, (summaries, start), (grad_inherited.double(), grad_final.double()), allow_unused=True)
        grad_summaries = torch.zeros_like(summaries) if grad_summaries is None else grad_summaries.contiguous()
        dist.all_reduce(grad_summaries, group=ctx.group)                                # [W, ..., 2, d]
        mine = grad_summaries[ctx.rank]                                                 # [..., 2, d]
        grad_start = torch.zeros_like(start) if grad_start is None else grad_start
        return (mine[..., :1, :].to(ctx.dtypes[0]), mine[..., 1:, :].to(ctx.dtypes[1]),
                grad_start.to(initial.dtype), None)


def _check_group(owner: str, group) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{owner}: needs an initialised torch.distributed process group "
                         f"(torch.distributed.init_process_group), got none")


def sharded_log_linear_scan(log_p: Tensor, h: Tensor, initial: Optional[Tensor] = None, *, group=None,
                            return_state: bool = False):
    """Heinsen's log-space scan over a sequence split in rank order: this rank's states, exactly.

    ``s_t = log(exp(log_p_t + s_{t-1}) + exp(h_t))`` over the whole sequence, when each rank
    holds one contiguous shard and ranks hold the shards in sequence order
    (``shard_positions(..., layout="contiguous")``). Each rank scans its shard from an empty
    state (``local``, the library's blocked scan), all ranks all-gather their summaries
    (total log-decay ``sum(log_p)`` and ``local``'s last state: ``[..., 2, d]`` each), each
    rank chains the summaries of the ranks before it in float64 by the same recurrence to get
    the state it inherits, and adds it: ``s = logaddexp(cumsum(log_p) + inherited, local)``,
    with the cumulative decay in float64. Forward and backward equal the single-process scan
    to rounding; the backward sends each rank's share of the gradient back to the ranks
    before it (one ``all_reduce`` of ``[W, ..., 2, d]``).

    Every rank of ``group`` must call this (and later run backward) together, with the same
    leading dims and ``d``; shard lengths may differ, and may be 0.

    Args:
        log_p (Tensor): log-decays of this rank's tokens ``[..., N_local, d]`` (``<= 0``).
        h (Tensor): log-updates ``[..., N_local, d]``.
        initial (Tensor, optional): the log-state before the first token of the WHOLE
            sequence, ``[..., 1, d]``, the same on every rank. Default: zeros (``s_0 = 0``,
            Heinsen's start).
        group (ProcessGroup, optional): the sequence-parallel group; its rank order is the
            sequence order. Default: the world.
        return_state (bool): also return the final state of the whole sequence
            ``[..., 1, d]`` (the same on every rank; it keeps its graph). Default: False.

    Returns:
        ``s`` ``[..., N_local, d]`` in float32 (float64 for float64 inputs), and the final
        state with ``return_state=True``.

    Example (on every rank of an initialised process group, so doctest skips those lines;
    the test file's distributed section runs this on two gloo processes):
        >>> import torch.distributed as dist
        >>> log_p, h = F.logsigmoid(torch.randn(2, 64, 16)), torch.randn(2, 64, 16)   # the whole sequence
        >>> idx = shard_positions(64, dist.get_rank(), dist.get_world_size())  # doctest: +SKIP
        >>> s = sharded_log_linear_scan(log_p[..., idx, :], h[..., idx, :])  # doctest: +SKIP
    """
    owner = "sharded_log_linear_scan"
    _check_tensor(owner, "log_p", log_p, 2)
    _check_tensor(owner, "h", h, 2)
    if log_p.shape != h.shape:
        raise ValueError(f"{owner}: log_p and h must have the same shape, got {tuple(log_p.shape)} and {tuple(h.shape)}")
    return_state = _check_flag(owner, "return_state", return_state)
    _check_group(owner, group)
    dtype = _compute_dtype(torch.promote_types(log_p.dtype, h.dtype))
    log_p, h = log_p.to(dtype), h.to(dtype)
    want = (*log_p.shape[:-2], 1, log_p.shape[-1])
    if initial is None:
        initial = torch.zeros(want, dtype=dtype, device=log_p.device)
    else:
        _check_tensor(owner, "initial", initial, 2)
        if tuple(initial.shape) != want:
            raise ValueError(f"{owner}: initial must have shape {list(want)} for log_p of shape "
                             f"{list(log_p.shape)}, got {list(initial.shape)}")
        initial = initial.to(device=log_p.device, dtype=dtype)
    empty = torch.full(want, float("-inf"), dtype=dtype, device=log_p.device)          # log 0: no state
    if log_p.shape[-2]:
        local = _LogLinearScanFunction.apply(log_p, h, empty)                           # [..., N_local, d]
        last = local[..., -1:, :]                                                       # [..., 1, d]
    else:  # an empty shard passes the state on unchanged (kept in the graph: every rank must reach backward)
        local, last = h, empty + h.sum(dim=-2, keepdim=True)
    decay = log_p.double().sum(dim=-2, keepdim=True)                                    # [..., 1, d] float64
    inherited, final = _ShardSummaryExchange.apply(decay, last, initial, group)         # [..., 1, d] float64
    # |cumsum(log_p)| grows with the shard: keep it in float64 until it meets the inherited state
    carried = (log_p.double().cumsum(dim=-2) + inherited).to(dtype)                    # [..., N_local, d]
    s = torch.logaddexp(carried, local)                                                 # [..., N_local, d]
    return (s, final.to(dtype)) if return_state else s


def heinsen_forward_sharded(module: HeinsenPositionalEmbedding, x: Tensor, using_prev_context: bool = False, *,
                            state: Optional[Tensor] = None, return_state: bool = False, group=None):
    """``module(x)`` for a ``HeinsenPositionalEmbedding`` when ``x`` is this rank's shard of the sequence.

    ``x`` is ``[..., N_local, D]``, the rank's contiguous run of tokens, ranks in sequence
    order (``shard_positions(..., layout="contiguous")``); the result is this rank's rows of
    ``module(x_full)``, forward and backward (``sharded_log_linear_scan``: one all_gather of
    ``[..., 2, d_hid]`` forward, one all_reduce of ``[W, ..., 2, d_hid]`` backward). Every rank
    calls it together and with the same module parameters (replicated, as under DDP/FSDP:
    parameter gradients are this rank's share, summed over ranks by the usual gradient
    all-reduce).

    ``state`` (the log-state before the whole sequence) and ``using_prev_context`` behave as
    in ``module.forward``; the state cached in ``module.prev_context`` and the one returned
    by ``return_state=True`` are the final state of the WHOLE sequence, identical on every
    rank, so the next sharded chunk continues from it.

    Example (on every rank of an initialised process group, so doctest skips those lines;
    the test file's distributed section runs this on two gloo processes):
        >>> import torch.distributed as dist
        >>> embed, x_full = HeinsenPositionalEmbedding(32, 16), torch.randn(2, 64, 32)
        >>> idx = shard_positions(x_full.shape[-2], dist.get_rank(), dist.get_world_size())  # doctest: +SKIP
        >>> y_local = heinsen_forward_sharded(embed, x_full[:, idx])  # doctest: +SKIP
    """
    if not isinstance(module, HeinsenPositionalEmbedding):
        raise TypeError(f"heinsen_forward_sharded: module must be a HeinsenPositionalEmbedding, "
                        f"got {type(module).__name__}")
    using_prev_context, return_state = module._check_call(x, using_prev_context, state, return_state)
    state = module._continued(using_prev_context, state)
    logits = module.H(x)                                                                # [..., N_local, 2 * d_hid]
    dtype = _compute_dtype(logits.dtype)
    log_p = F.logsigmoid(logits[..., : module.d_hid].to(dtype))                        # [..., N_local, d_hid]
    h = logits[..., module.d_hid :].to(dtype)                                           # [..., N_local, d_hid]
    initial = module._initial_state(state, x, dtype, "cached context" if using_prev_context else "state")
    s, final = sharded_log_linear_scan(log_p, h, initial, group=group, return_state=True)
    module.prev_context = final.detach()
    y = x + module.R(s.to(logits.dtype)).to(x.dtype)                                    # [..., N_local, D]
    return (y, final) if return_state else y


# ---------------------------------------------------------------------------
# Demo
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
        "nope": NoPositionalEmbedding(dim=dim),
        "xpos": XPosPositionalEmbedding(head_dim),
        "polar": PolarPositionalEmbedding(head_dim, num_heads, phase_init="uniform"),
        "query_temperature": QueryTemperaturePositionalEmbedding(length=max(seq_len // 4, 1), scale=0.5),
        "fope": FoPEPositionalEmbedding(head_dim, num_heads, train_length=seq_len),
        "hope": HoPEPositionalEmbedding(head_dim, train_length=seq_len),
        "kerple": KerplePositionalEmbedding(num_heads),
        "sandwich": SandwichPositionalEmbedding(num_heads, head_dim),
        "fire": FIREPositionalEmbedding(num_heads),
        "cope": CoPEPositionalEmbedding(num_heads, head_dim),
        "rerope": ReRoPEPositionalEmbedding(head_dim, window=seq_len // 4),
        "stick_breaking": StickBreakingPositionalEmbedding(),
        "self_extend": SelfExtendPositionalEmbedding(RotaryPositionalEmbedding(head_dim), group_size=4,
                                                     window=seq_len // 4),
        "randomized_rope": RandomizedPositionalEmbedding(RotaryPositionalEmbedding(head_dim), max_len=4 * seq_len,
                                                         generator=torch.Generator().manual_seed(0)),   # training mode
        "dual_chunk": DualChunkPositionalEmbedding(RotaryPositionalEmbedding(head_dim), chunk_size=seq_len // 4,
                                                   local_size=seq_len // 16),
        "forgetting": ForgettingPositionalEmbedding(dim, num_heads)(torch.randn(1, seq_len, dim)),   # bound
        "inkling": InklingPositionalEmbedding(dim, num_heads, d_rel=4, max_distance=seq_len)(torch.randn(1, seq_len, dim)),
        "path": PaTHPositionalEmbedding(dim, num_heads)(torch.randn(1, seq_len, dim)),          # bound
        "shaw": ShawPositionalEmbedding(num_heads, head_dim),
        "deberta": DebertaPositionalEmbedding(dim, num_heads),
        "swin_bias": RelativePositionBias2D(num_heads, math.isqrt(seq_len)),                 # one window of N tokens
        "swinv2_cpb": ContinuousPositionBias(num_heads, math.isqrt(seq_len)),
        "dynamic_bias": DynamicPositionBias(num_heads),
        "dynamic_bias_2d": DynamicPositionBias(num_heads, num_axes=2),
        "mixed_rope": MixedRotaryPositionalEmbedding(head_dim, num_heads, base=10.0),
        "liere": LieREPositionalEmbedding(head_dim, num_heads, block_size=8),
        "comrope": ComRoPEPositionalEmbedding(head_dim, num_heads, block_size=8),
        "string": STRINGPositionalEmbedding(head_dim, num_heads),
        "video_rope": VideoRotaryPositionalEmbedding(head_dim),
        "diffusers_compat": DiffusersCompatRotaryEmbedding(head_dim, sections=[head_dim // 4] * 2,   # ERNIE-Image's
                                                           axis_spectrum="per_axis"),                # (not a rotation)
        "conv_peg": ConvolutionalPositionalEmbedding(dim, grid_shape=(math.isqrt(seq_len),) * 2),
        "wav2vec2_conv": ConvolutionalPositionalEmbedding(dim, kernel_size=128, num_axes=1, groups=16,
                                                          weight_norm=True, activation="gelu"),
        "fourier": FourierFeaturePositionalEmbedding(1, dim, sampling="gaussian", scale=0.01),
        "learnable_fourier": LearnableFourierPositionalEmbedding(2, dim, fourier_dim=64, hidden_dim=64),
        "time2vec": Time2VecPositionalEmbedding(dim),
        "laplacian": LaplacianPositionalEmbedding(dim, 8).eval(),
        "random_walk": RandomWalkPositionalEmbedding(dim, 8),
        "graphormer": GraphormerPositionalEmbedding(num_heads, dim=dim).bind(_demo_lattice(seq_len)),
        "abacus": AbacusPositionalEmbedding(dim, range(10), max_len=seq_len + 100, max_k=99),
        "sinusoidal_fairseq": SinusoidalPositionalEmbedding(dim, spectrum="fairseq", layout="concat", padding_idx=1),
    }


def _demo_positions(pe: PositionalEmbedding, seq_len: int) -> Optional[Tensor]:
    """Positions for encodings that need them: a square grid for multi-axis ones (for graph encodings,
    the nodes of the grid's lattice graph; for video, one frame; for digit places, runs of ten digits
    between three other tokens)."""
    if hasattr(pe, "digit_positions"):
        return pe.digit_positions(torch.arange(seq_len) % 13)
    if pe.num_axes == 1 or not pe.takes_positions:   # the convolution reads its grid from the token order
        return None
    if hasattr(pe, "temporal_spacing"):   # VideoRoPE: the grid as one frame, in its diagonal layout
        return pe.positions([(1, math.isqrt(seq_len), math.isqrt(seq_len))])
    if hasattr(pe, "graph_positions"):   # a graph encoding (of this file, or of a vendored copy of it)
        return pe.graph_positions(_demo_lattice(seq_len))
    return _demo_grid(seq_len)


def _demo_grid(seq_len: int) -> Tensor:
    """The demo's square grid: ``[N, 2]`` (row, column), row-major."""
    side = math.isqrt(seq_len)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(seq_len, 2)                        # [N, 2]


def _demo_lattice(seq_len: int) -> Tensor:
    """The grid's lattice graph: ``[N, N]`` bool, neighbours one step apart."""
    grid = _demo_grid(seq_len)
    return (grid.unsqueeze(1) - grid.unsqueeze(0)).abs().sum(-1) == 1                   # [N, N]


def _demo_translation(pe: PositionalEmbedding, q: Tensor, k: Tensor, positions: Optional[Tensor]) -> str:
    """The demo's last column, measured: do the logits stay the same when every position moves?"""
    if not isinstance(getattr(pe, "encoding", pe), _AttentionEncoding):   # a wrapper's kind is its encoding's
        return "n/a (acts on the tokens)"
    if not pe.takes_positions:
        return f"n/a (takes no positions: {pe.order_from})"
    if isinstance(pe, AlgebraicTreePositionalEmbedding):
        return "n/a (node ids: depends on tree paths)"
    n = q.shape[-2]
    if isinstance(pe, (_WindowBias, UnifiedPositionalEmbedding)):   # positions index a table of n: stay inside it
        shift = n // 2   # whole rows of a square window, so 2-D offsets are kept
        positions, q, k = torch.arange(n // 2), q[..., :n // 2, :], k[..., :n // 2, :]
    else:
        shift = 1000
        positions = torch.arange(n) if positions is None else positions
    base = pe.forward_attn(q, k, positions, positions)
    shifted = pe.forward_attn(q, k, positions + shift, positions + shift)
    gap = torch.where(base == shifted, 0.0, base - shifted).abs().max().item()   # -inf == -inf
    verdict = "invariant" if gap <= 1e-4 * base.masked_fill(base.isinf(), 0).abs().max().item() else "not invariant"
    return f"{verdict}: max |logits(p) - logits(p + {shift})| = {gap:.1e}"


def _demo() -> None:
    import time

    torch.manual_seed(0)
    batch, heads, head_dim, seq_len = 2, 8, 64, 256
    x = torch.randn(batch, seq_len, heads * head_dim)
    q, k, v = torch.randn(3, batch, heads, seq_len, head_dim).unbind(0)
    print(f"every encoding on B={batch}, H={heads}, N={seq_len}, Dh={head_dim} (CPU, float32)\n")
    print(f"{'encoding':<20}{'class':<40}{'kind':<8}{'params':>9}  {'output':<18}{'ms':>8}  translation")
    for name, pe in _demo_modules(heads, head_dim, seq_len).items():
        positions = _demo_positions(pe, seq_len)
        start = time.perf_counter()
        added = pe.kind == "input"
        if added:  # its positions go to the tokens; attention() then reads none
            tokens, out = pe.forward_input(x, positions), attention(q, k, v, pe, causal=pe.num_axes == 1)
        else:
            tokens, out = x, attention(q, k, v, pe, positions_q=positions, positions_k=positions,
                                       causal=pe.num_axes == 1)
        elapsed = (time.perf_counter() - start) * 1e3
        params = sum(p.numel() for p in pe.parameters())
        shape = str(tuple(tokens.shape if added else out.shape))
        invariance = _demo_translation(pe, q, k, positions)
        print(f"{name:<20}{type(pe).__name__:<40}{pe.kind:<8}{params:>9}  {shape:<18}{elapsed:>8.2f}  {invariance}")
    _demo_today(batch, heads, head_dim, seq_len)


def _demo_today(batch: int, heads: int, head_dim: int, seq_len: int) -> None:
    """Grouped-query attention and packed documents, each against its plain equivalent."""
    q = torch.randn(batch, heads, seq_len, head_dim)
    k, v = torch.randn(2, batch, heads // 4, seq_len, head_dim).unbind(0)               # 4 query heads per kv head
    rope = RotaryPositionalEmbedding(head_dim)
    grouped = attention(q, k, v, rope, causal=True)
    repeated = attention(q, k.repeat_interleave(4, -3), v.repeat_interleave(4, -3), rope, causal=True)
    print(f"\ngrouped-query attention, {heads} query / {heads // 4} kv heads, RoPE: "
          f"max |grouped - k/v repeated| = {(grouped - repeated).abs().max().item():.1e}")
    ids = torch.arange(seq_len) * 3 // seq_len                                           # three packed documents
    first, last = int((ids == 1).nonzero()[0]), int((ids == 1).nonzero()[-1]) + 1
    alibi = ALiBiPositionalEmbedding(heads)
    packed = attention(q, k, v, alibi, causal=True, document_ids=ids)[..., first:last, :]
    alone = attention(q[..., first:last, :], k[..., first:last, :], v[..., first:last, :], alibi, causal=True)
    print(f"packed documents, ALiBi: max |document {first}..{last - 1} packed - alone| = "
          f"{(packed - alone).abs().max().item():.1e}")


# ---------------------------------------------------------------------------
# Vendoring: copy only the classes you use
# ---------------------------------------------------------------------------

# vendor() reads this file's source, cuts it into its top-level statements and follows the names
# each one uses (by walking its syntax tree) from the requested public names and attention() to
# every definition they need. An optional part is left out by name: its methods are cut from every
# class and its functions replaced by a stand-in below (same parameters, checked; their docstrings
# speak for the vendored file), so the paths that led into it take a plain route that computes the
# same thing; what then goes unused drops out.

def _vendor_dense_attention(q: Tensor, k: Tensor, v: Tensor, pe: PositionalEmbedding, positions_q, positions_k,
                            causal: bool, scale: float, document_ids: Optional[Tensor] = None,
                            attn_mask: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """This file was vendored without FlexAttention: a bias takes the dense path (``use_flex`` is ignored)."""
    return attention(q, k, v, pe, positions_q=positions_q, positions_k=positions_k, causal=causal, scale=scale,
                     use_flex=False, document_ids=document_ids, attn_mask=attn_mask, sinks=sinks)


def _vendor_dense_path(device: torch.device, *, use_flex: Optional[bool], grad: bool, compiling: bool,
                       float_mask: bool, dropout: bool, q_len: int, k_len: int, head_dim: int,
                       indexes_first: bool) -> str:
    """This file was vendored without FlexAttention: every bias takes the dense path."""
    return "dense"


def _vendor_direct_call(pe: Optional[PositionalEmbedding], fn, *args):
    """``fn(*args)``: this file was vendored without FSDP2 support (do not ``fully_shard`` an encoding by itself)."""
    return fn(*args)


def _vendor_whole(t: Tensor) -> Tensor:
    """``t``: this file was vendored without DTensor support, every tensor is whole."""
    return t


@torch.no_grad()
def _vendor_plain_copy(param: Tensor, value: Tensor) -> None:
    """``param.copy_(value)`` with ``value`` broadcast to ``param``'s shape (vendored without DTensor support)."""
    param.copy_(value.to(param.dtype).expand(param.shape))


# option -> what it leaves out: "methods" cut from every class, public "functions" refused, library
# functions replaced by "stand_ins"; "what" words it for the vendored file's docstring.
_VENDOR_OPTIONS = {
    "config": {
        "what": "``from_config`` and the Hugging Face config readers",
        "methods": ("from_config",), "functions": ("layer_encodings", "diffusers_positions"), "stand_ins": {},
    },
    "flex": {
        "what": "the FlexAttention path (``score_mod``; ``attention()`` runs every bias densely)",
        "methods": ("score_mod",), "functions": (), "stand_ins": {"_flex_attention": _vendor_dense_attention, "_bias_path": _vendor_dense_path},
    },
    "distributed": {
        "what": "FSDP2 / DTensor support and the sequence-sharding functions",
        "methods": ("_gathered_call",),
        "functions": ("shard_positions", "sharded_log_linear_scan", "heinsen_forward_sharded"),
        "stand_ins": {"_with_parameters": _vendor_direct_call, "_full": _vendor_whole, "_copy_into": _vendor_plain_copy},
    },
}


def vendor(names, path=None, *, config: bool = True, flex: bool = True, distributed: bool = True,
           dry_run: bool = False) -> str:
    """A standalone Python file holding only ``names``, ``attention()`` and every definition they use.

    The definitions come verbatim and in this file's order, found by walking the code (the names
    each definition uses, its bases, decorators, default arguments and annotations), so the file
    behaves exactly like the library for what it holds. It imports only torch and the standard
    library; its docstring gives the license, what it holds and the version of this file it came
    from, and its ``__all__`` lists ``names`` and ``attention``. A docstring example that needs a
    public name left out is marked ``+SKIP``. Command line:
    ``python positional_embeddings.py vendor NAME [NAME ...] -o FILE [--no-config] [--no-flex]
    [--no-distributed] [--dry-run]``.

    Args:
        names (str or list of str): public names (``__all__``) to keep.
        path (str, optional): file to write. Default: None (only return the text).
        config (bool): keep ``from_config`` and the Hugging Face config readers. Default: True.
        flex (bool): keep the FlexAttention path (``score_mod``); without it ``attention()`` runs
            every bias through the dense path. Default: True.
        distributed (bool): keep FSDP2 / DTensor support and the sequence-sharding functions.
            Default: True.
        dry_run (bool): return the line count of every definition and the total instead, and
            write nothing. Default: False.

    Returns:
        str: the file's text (the line counts with ``dry_run``).

    Example:
        >>> text = vendor(["ALiBiPositionalEmbedding"], flex=False)
        >>> "class ALiBiPositionalEmbedding" in text and "def from_config" in text
        True
    """
    owner = "vendor"
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{owner}: names must be a public name or a non-empty list of them, got {_describe(names)}")
    options = {key: _check_flag(owner, key, value) for key, value in
               (("config", config), ("flex", flex), ("distributed", distributed))}
    dry_run = _check_flag(owner, "dry_run", dry_run)
    public = [name for name in __all__ if name != "vendor"]
    for name in names:
        if name not in public:
            import difflib
            close = difflib.get_close_matches(name, public, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ValueError(f"{owner}: names must be public names of positional_embeddings.py, got {name!r}{hint}")
    names = list(dict.fromkeys(names))
    with open(__file__, "rb") as handle:
        source = handle.read()
    left_out = [key for key, keep in options.items() if not keep]
    units, plan = _vendor_select(source.decode("utf-8"), names, left_out)
    parts = _vendor_render(units, plan, names, left_out, _vendor_origin(source))
    if dry_run:
        return _vendor_line_counts(parts)
    text = "\n\n\n".join(text for _, text in parts) + "\n"
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return text


@functools.lru_cache(maxsize=1)
def _vendor_units(source: str) -> list:
    """This file's top-level statements, parsed once, each a dict: ``node``; the ``names`` it binds; its
    ``lines`` (``[first, last]``, 1-based, with its decorators and the comments right above it) and their
    ``text``; ``section``, the banner and comments opening its section (``""`` if it opens none);
    ``reads``, the names it reads, by method of a class (key ``""``: the rest); and ``examples``, the
    line range and read names of every docstring with examples."""
    import ast

    lines = source.splitlines()
    units, previous_end = [], 0
    for node in ast.parse(source).body:
        documents_previous = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                              and isinstance(node.value.value, str) and units and node.lineno == previous_end + 1)
        if documents_previous:  # an assignment's docstring (right below it) travels with it
            units[-1]["lines"][1] = previous_end = node.end_lineno
            units[-1]["text"] = lines[units[-1]["lines"][0] - 1:node.end_lineno]
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        lead = lines[previous_end:start - 1]                                   # blank lines and comments
        section = ""
        banner = next((i for i, line in enumerate(lead) if line.startswith("# ---")), None)
        if banner is not None:
            end = banner
            while end < len(lead) and lead[end].startswith("#"):
                end += 1
            section, lead = "\n".join(lead[banner:end]), lead[end:]
        attached = 0
        while attached < len(lead) and lead[len(lead) - 1 - attached].startswith("#"):
            attached += 1
        first = start - attached
        units.append({"node": node, "names": _vendor_bound_names(node), "lines": [first, node.end_lineno],
                      "text": lines[first - 1:node.end_lineno], "section": section,
                      "reads": _vendor_reads(node), "examples": _vendor_examples(node)})
        previous_end = node.end_lineno
    return units


def _vendor_bound_names(node) -> set:
    """The module-level names a top-level statement binds."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.If):  # the demo's `if __name__ == "__main__":` binds nothing anyone uses
        return set()
    # assignment targets only: a comprehension's or a lambda's names are its own, not the module's
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {sub.id for target in targets if target is not None for sub in ast.walk(target)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}


def _vendor_reads(node) -> dict:
    """The names a top-level statement reads (bases, decorators, defaults and annotations included), by
    method for a class (key ``""``: the rest). A local variable that shares a module-level name counts
    too: it can only add a definition, never lose one."""
    import ast

    def names(part) -> set:
        return {sub.id for sub in ast.walk(part) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}

    if not isinstance(node, ast.ClassDef):
        return {"": names(node)}
    reads = {"": set().union(*map(names, node.bases + node.keywords + node.decorator_list))}
    for statement in node.body:
        key = statement.name if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""
        reads[key] = reads.get(key, set()) | names(statement)
    return reads


def _vendor_examples(node) -> list:
    """``(first line, last line, names read)`` of every docstring in ``node`` that holds examples."""
    import ast
    import doctest

    found = []
    for sub in ast.walk(node):
        if not isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(sub):
            continue
        read = set()
        for example in doctest.DocTestParser().get_examples(ast.get_docstring(sub)):
            try:
                read |= {x.id for x in ast.walk(ast.parse(example.source)) if isinstance(x, ast.Name)}
            except SyntaxError:
                continue
        if read:
            found.append((sub.body[0].lineno, sub.body[0].end_lineno, read))
    return found


def _vendor_select(source: str, names: list, left_out: list) -> tuple:
    """The units of ``source`` and what to keep of them: a dict with ``kept`` (indices of the units
    ``names``, ``attention`` and what they use need), ``used`` (the names they read), ``methods``
    (cut from every class), ``replace`` (index of a replaced function -> index of its stand-in) and
    ``missing`` (the module-level names left out)."""
    units = _vendor_units(source)
    options = [_VENDOR_OPTIONS[key] for key in left_out]
    methods = tuple(method for option in options for method in option["methods"])
    refused = {name: key for key in left_out for name in _VENDOR_OPTIONS[key]["functions"]}
    where = {}
    for index, unit in enumerate(units):
        for name in unit["names"] - {"__all__"}:
            where.setdefault(name, index)
    replace = {}
    for option in options:
        for name, stand_in in option["stand_ins"].items():
            _vendor_check_stand_in(units, where, name, stand_in.__name__)
            replace[where[name]] = where[stand_in.__name__]
    kept, used, todo = set(), set(), [(name, None) for name in [*names, "attention"]]
    while todo:
        name, user = todo.pop()
        if name in refused:
            why = "you named it" if user is None else f"{user} uses it"
            raise ValueError(f"vendor: {name} is left out with {refused[name]}=False, but {why}; "
                             f"vendor with {refused[name]}=True")
        index = where.get(name)
        if index is None or index in kept:
            continue
        kept.add(index)
        reads = set().union(*(names for key, names in units[replace.get(index, index)]["reads"].items()
                               if key not in methods))
        used |= reads
        todo += [(read, name) for read in reads if read in where]
    missing = set(where) - {name for index in kept for name in units[index]["names"]}
    return units, {"kept": kept, "used": used, "methods": methods, "replace": replace, "missing": missing}


def _vendor_check_stand_in(units: list, where: dict, name: str, stand_in: str) -> None:
    """A stand-in must take exactly the parameters of the function it replaces (else the library changed)."""
    import ast

    def parameters(index):
        node = units[index]["node"]
        return [arg.arg for arg in ast.walk(node.args) if isinstance(arg, ast.arg)]

    if name not in where or parameters(where[name]) != parameters(where[stand_in]):
        got = parameters(where[name]) if name in where else "nothing (it is gone)"
        raise RuntimeError(f"vendor: the stand-in {stand_in} takes {parameters(where[stand_in])} but the library's "
                           f"{name} takes {got}; update {stand_in} and _VENDOR_OPTIONS")


def _vendor_unit_text(units: list, index: int, plan: dict) -> str:
    """The source of one kept unit: a replaced function's stand-in under the function's name, cut methods
    removed, private functions' docstrings cut to their first sentence, imports narrowed to the names
    used, and ``+SKIP`` on the docstring examples that need a definition left out."""
    import ast

    unit = units[plan["replace"].get(index, index)]
    node, first, lines = unit["node"], unit["lines"][0], list(unit["text"])
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        aliases = [alias for alias in node.names if (alias.asname or alias.name).split(".")[0] in plan["used"]]
        if len(aliases) == len(node.names):
            return "\n".join(lines)
        return ast.unparse(type(node)(**{**vars(node), "names": aliases}))
    dropped = set()
    for statement in node.body if isinstance(node, ast.ClassDef) else []:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name in plan["methods"]:
            start = min([statement.lineno] + [d.lineno for d in statement.decorator_list])
            while lines[start - 1 - first].strip().startswith("#"):               # its comments
                start -= 1
            if not lines[start - 1 - first].strip():                              # and the blank line above
                start -= 1
            dropped.update(range(start, statement.end_lineno + 1))
    _vendor_short_docstrings(node, lines, first, dropped)
    for start, end, read in unit["examples"]:
        if read & plan["missing"]:
            for number in range(start, end + 1):
                if lines[number - first].lstrip().startswith(">>> "):
                    lines[number - first] += "  # doctest: +SKIP"
    if index in plan["replace"]:  # the stand-in under the library's name, its signature realigned
        name = next(iter(units[index]["names"]))
        lines[node.lineno - first] = lines[node.lineno - first].replace(f"def {node.name}(", f"def {name}(", 1)
        shift = len(node.name) - len(name)
        for number in range(node.lineno + 1, node.body[0].lineno):
            line = lines[number - first]
            lines[number - first] = line[shift:] if shift >= 0 and line.startswith(" " * shift) else " " * -shift + line
    return "\n".join(line for number, line in enumerate(lines, first) if number not in dropped)


def _vendor_short_docstrings(node, lines: list, first: int, dropped: set) -> None:
    """Cut the docstring of every private function or method in ``node`` (public ones keep theirs whole) to
    its first sentence, rewrapped: ``lines`` (from line ``first``) edited, the lines it frees added to
    ``dropped``. Docstrings with examples or backslashes stay as they are."""
    import ast
    import textwrap

    for function in ast.walk(node):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.name.startswith("_") \
                or function.name.endswith("__") or ast.get_docstring(function) is None:
            continue
        doc = function.body[0]
        text = "\n".join(lines[doc.lineno - first:doc.end_lineno - first + 1])
        if doc.lineno == doc.end_lineno or ">>>" in text or "\\" in text:
            continue
        paragraph = " ".join(ast.get_docstring(function).split("\n\n")[0].split())
        sentence = _vendor_first_sentence(paragraph)
        indent = lines[doc.lineno - first][:len(lines[doc.lineno - first]) - len(lines[doc.lineno - first].lstrip())]
        wrapped = textwrap.wrap(f'"""{sentence}"""', width=116, initial_indent=indent, subsequent_indent=indent)
        lines[doc.lineno - first] = "\n".join(wrapped)
        dropped.update(range(doc.lineno + 1, doc.end_lineno + 1))


def _vendor_first_sentence(text: str) -> str:
    """``text`` up to its first full stop outside parentheses and ````code```` (all of it if none)."""
    depth, code = 0, False
    for i, char in enumerate(text):
        if text.startswith("``", i):
            code = not code
        depth += 0 if code else (char == "(") - (char == ")")
        if char == "." and not code and depth == 0 and text[i + 1:i + 2] == " ":
            return text[:i + 1]
    return text


def _vendor_origin(source: bytes) -> str:
    """Which positional_embeddings.py this is: its sha256, and the git commit it sits on when a git
    checkout holds it (with a note if it differs from that commit)."""
    import hashlib
    import os
    import subprocess

    origin = f"sha256 {hashlib.sha256(source).hexdigest()[:16]}"
    folder, name = os.path.split(os.path.abspath(__file__))
    try:
        def git(*args):
            return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--", name)
        origin += f", git commit {commit[:12]}" + (" plus uncommitted changes" if changed else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return origin


def _vendor_license() -> list:
    """The license text next to this file (LICENSE), or its name when the file travels alone."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "LICENSE")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip().splitlines()
    except OSError:
        return ["MIT License (the license of positional_embeddings.py)"]


def _vendor_header(names: list, left_out: list, origin: str, plan_skips: bool) -> str:
    """The vendored file's license comment and docstring."""
    import textwrap

    legend = next((p for p in (__doc__ or "").split("\n\n") if p.startswith("Shape legend")), "")
    flags = "".join(f" --no-{key}" for key in left_out)
    held = [name for name in names if name != "attention"]
    lines = [f"# {line}".rstrip() for line in _vendor_license()]
    title = f"{', '.join(held)} and ``attention()``" if held else "``attention()``"
    about = (f"Made by ``python positional_embeddings.py vendor {' '.join(names)} -o FILE{flags}`` from "
             f"positional_embeddings.py ({origin}). It holds these, ``attention()`` and every definition they use, "
             "unchanged and in the library's order; it imports only torch and the standard library. Regenerate it "
             "rather than editing it.")
    lines += ['"""' + f"{title}, vendored from positional_embeddings.py.", "", *textwrap.wrap(about, 100)]
    if plan_skips:
        lines += ["", *textwrap.wrap("Docstring examples marked ``+SKIP`` need a definition that is not vendored here.", 100)]
    if left_out:
        left = "Left out: " + "; ".join(_VENDOR_OPTIONS[key]["what"] for key in left_out) + "."
        lines += ["", *textwrap.wrap(left, 100)]
    if legend:
        lines += ["", *legend.splitlines()]
    return "\n".join(lines) + '\n"""'


def _vendor_render(units: list, plan: dict, names: list, left_out: list, origin: str) -> list:
    """The vendored file as a list of ``(label, text)`` parts: the header, then the kept units in the
    library's order, each section opened by its banner (a label of None: no definition)."""
    import ast

    exported = [*names, *(["attention"] if "attention" not in names else [])]
    skips = any(read & plan["missing"] for index in plan["kept"]
                for _, _, read in units[plan["replace"].get(index, index)]["examples"])
    parts, section = [(None, _vendor_header(names, left_out, origin, skips))], None
    for index, unit in enumerate(units):
        section = unit["section"] or section
        if "__all__" in unit["names"]:
            parts.append((None, "__all__ = [\n" + "".join(f'    "{name}",\n' for name in exported) + "]"))
            continue
        if index not in plan["kept"]:
            continue
        if section:
            parts.append((None, section))
            section = None
        text = _vendor_unit_text(units, index, plan)
        label = ", ".join(sorted(unit["names"])) + (" (stand-in)" if index in plan["replace"] else "")
        if isinstance(unit["node"], (ast.Import, ast.ImportFrom)):
            if parts[-1][0] == "imports":  # one block, the library's groups kept
                gap = "\n\n" if unit["lines"][0] > units[index - 1]["lines"][1] + 1 else "\n"
                parts[-1] = ("imports", parts[-1][1] + gap + text)
            else:
                parts.append(("imports", text))
        else:
            parts.append((label, text))
    return parts


def _vendor_line_counts(parts: list) -> str:
    """``--dry-run``: the lines of every definition, of the rest (header, banners, blank lines) and the total."""
    total = len(("\n\n\n".join(text for _, text in parts) + "\n").splitlines())
    rows = [f"{len(text.splitlines()):6d}  {label}" for label, text in parts if label is not None]
    rest = total - sum(len(text.splitlines()) for label, text in parts if label is not None)
    return "\n".join(rows + [f"{rest:6d}  (header, __all__, banners, blank lines)", f"{total:6d}  total"]) + "\n"


def _vendor_main(argv: list) -> int:
    """``python positional_embeddings.py vendor NAME [NAME ...] -o FILE [options]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python positional_embeddings.py vendor",
                                     description="Write a standalone file with only the named encodings, "
                                                 "attention() and what they use.")
    parser.add_argument("names", nargs="+", metavar="NAME", help="public names, e.g. RotaryPositionalEmbedding")
    parser.add_argument("-o", "--output", metavar="FILE", help="file to write (default: print it)")
    parser.add_argument("--no-config", action="store_true", help="leave out from_config and the config readers")
    parser.add_argument("--no-flex", action="store_true", help="leave out the FlexAttention path")
    parser.add_argument("--no-distributed", action="store_true", help="leave out FSDP2/DTensor and sharding")
    parser.add_argument("--dry-run", action="store_true", help="print the lines per definition, write nothing")
    args = parser.parse_args(argv)
    try:
        text = vendor(args.names, None if args.dry_run else args.output, config=not args.no_config,
                      flex=not args.no_flex, distributed=not args.no_distributed, dry_run=args.dry_run)
    except ValueError as error:
        parser.error(str(error))
    if args.dry_run or args.output is None:
        print(text, end="" if text.endswith("\n") else "\n")
    else:
        print(f"wrote {args.output}: {len(text.splitlines())} lines")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["vendor"]:
        sys.exit(_vendor_main(sys.argv[2:]))
    _demo()

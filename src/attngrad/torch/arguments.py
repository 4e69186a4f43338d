"""The public functions' options, declared once (`Options`, `AttentionOptions`: names,
types, meanings, `DEFAULTS`), and their arguments checked and folded into the op's call:
q, k, v of any rank onto (B, H, L, E) (`layout`), the masks and structured masks into
`ScoreMasks`, the dropout seed drawn; every error names the user's arguments."""

from __future__ import annotations

import difflib
import inspect
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypedDict, TypeVar

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from . import regime
from .layout import FLOATS, Layout, check_optional_tensors, check_tensors, default_scale, describe_shapes, is_number
from .masks.functions import evaluated_mask
from .masks.structured import join_bounds, structure
from .op.call import AttentionCall, ScoreMasks


class Options(TypedDict, total=False):
    """The options that `attention`, `ring_attention` and `all_to_all_attention` take after
    query, key and value, each keyword-only; `attention`'s docstring says what each does."""

    attn_mask: Optional[Tensor]  # boolean, True = take part, broadcastable to (..., H, Lq, Lk)
    attn_bias: Optional[Tensor]  # float, added to the scores; learned or not
    is_causal: bool | int | str  # False, True or "top_left", "bottom_right", or an int diagonal
    key_padding: Optional[Tensor]  # (..., Lk) boolean, True = padding, or (...,) integer lengths
    window: Optional[tuple[Optional[int], Optional[int]]]  # (left, right) keys about the diagonal; None: open
    document_ids: Optional[Tensor]  # (..., L) integers: packed documents, each contiguous
    cu_seqlens: Optional[Tensor]  # (D + 1,) cumulative document lengths, flash-attn's varlen
    softcap: Optional[float]  # c > 0: scores capped as c tanh(s / c), Gemma 2's
    sinks: Optional[Tensor]  # (H,) logits of a value-0 key every query sees, GPT-OSS's
    dropout_p: float  # the probability that a weight is dropped
    scale: Optional[float]  # of the scores; None: 1 / sqrt(E)
    enable_gqa: bool  # H a multiple of Hkv: grouped-query attention


class AttentionOptions(Options, total=False):
    """`attention`'s options: every entry point's, and masks as functions (FlexAttention's)."""

    mask_mod: Optional[Callable]  # (b, h, q_idx, kv_idx) -> True where the query sees the key
    block_mask: Any  # the same made once for many calls: attngrad's or FlexAttention's create_block_mask


DEFAULTS: Options = {"is_causal": False, "dropout_p": 0.0, "enable_gqa": False}  # every other option's is None
STRUCTURED = ("key_padding", "window", "document_ids", "cu_seqlens")  # the options that are key bounds (`structure`)

_Function = TypeVar("_Function", bound=Callable)


class Declaration:
    """A TypedDict of keyword options with their defaults (None where `defaults` has none):
    what a function taking `**options` accepts, its signature as help() and inspect show it,
    and a call's options with the defaults filled in."""

    def __init__(self, options: type, defaults: Mapping[str, Any]) -> None:
        self.types = typing.get_type_hints(options)
        self.names = frozenset(self.types)
        self.defaults = {name: defaults.get(name) for name in self.types}

    def check(self, what: str, given: Mapping[str, Any]) -> None:
        """A TypeError naming an option `what` does not take, as Python's for a keyword."""
        if self.names.issuperset(given):
            return
        unknown = next(name for name in given if name not in self.names)
        near = difflib.get_close_matches(unknown, self.types, n=1)
        raise TypeError(f"{what}() got an unexpected keyword argument {unknown!r}"
                        f"{f'. Did you mean {near[0]!r}?' if near else ''} It takes query, key, value and "
                        f"{', '.join(self.types)}")

    def with_defaults(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` with the defaults of the options it leaves out, unchecked (an option the
        caller spelled)."""
        return {**self.defaults, **given}

    def complete(self, what: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` checked (`check`), with the defaults of the options it leaves out."""
        self.check(what, given)
        return self.with_defaults(given)

    def signed(self, function: _Function) -> _Function:
        """`function(..., **options)` with a signature that lists the options (keyword-only,
        typed, with their defaults) in place of `**options`, for help() and inspect."""
        signature = inspect.signature(function, eval_str=True)  # the types, as the options show theirs
        *positional, _ = signature.parameters.values()
        options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=self.defaults[name],
                                     annotation=kind) for name, kind in self.types.items()]
        function.__signature__ = signature.replace(parameters=[*positional, *options])
        return function


ATTENTION = Declaration(AttentionOptions, DEFAULTS)


def check_sinks(sinks: Tensor, layout: Layout, query: Tensor) -> Tensor:
    """(H,) sink logits checked, as the op's (1, H)."""
    if not isinstance(sinks, Tensor) or sinks.dtype not in FLOATS:
        raise TypeError(f"sinks must be a floating tensor of shape (H,); got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.shape != (layout.heads,) or layout.flat:
        raise ValueError(f"sinks must have shape (H,) = ({layout.heads},), one logit per query head of (..., H, L, E) "
                         f"inputs; got {tuple(sinks.shape)} ({layout.shapes})")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query on {query.device}")
    readable = (type(sinks) is Tensor and sinks.device.type != "meta" and not torch.compiler.is_compiling()
                and not regime.transforms_active())
    if readable and not bool(torch.isfinite(sinks).all()):  # -inf would shift the scores by +inf: NaN
        raise ValueError(f"sinks must be finite logits; got {sinks.tolist()}")
    return sinks[None]


def _causal_offset(is_causal: bool | int | str, len_q: int, len_k: int) -> Optional[int]:
    """The causal diagonal for `is_causal`: None, 0 (top-left), Lk - Lq (bottom-right) or
    the int given (which also aligns a window: see `_op_diagonal` for the op's)."""
    if isinstance(is_causal, int) and not isinstance(is_causal, bool):
        return is_causal
    if is_causal is False:
        return None
    if is_causal is True or is_causal == "top_left":
        return 0
    if is_causal == "bottom_right":
        return len_k - len_q
    raise ValueError(f"is_causal must be True, False, 'top_left', 'bottom_right' or an int diagonal; got {is_causal!r}")


def _op_diagonal(causal: Optional[int], len_q: int, len_k: int) -> Optional[int]:
    """The causal diagonal as the op takes it: clamped to [-Lq, Lk], past which a diagonal
    sees the same keys (none, or all), so that no arithmetic on it nears int64's limits."""
    return None if causal is None else max(-len_q, min(len_k, causal))


def _check(query: Tensor, key: Tensor, value: Tensor, options: AttentionOptions, bias_name: str) -> None:
    """The checks of the tensors and options that need no layout (`build_call`'s)."""
    mask, bias, softcap = options["attn_mask"], options["attn_bias"], options["softcap"]
    check_tensors(query, key, value, options["dropout_p"])
    check_optional_tensors(attn_mask=mask, key_padding=options["key_padding"], document_ids=options["document_ids"],
                           cu_seqlens=options["cu_seqlens"])
    check_optional_tensors(**{bias_name: bias})
    if softcap is not None and not (is_number(softcap) and 0.0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number (or None); got {softcap!r}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be boolean here; pass a float mask as attn_bias (got {mask.dtype})")
    if bias is not None and bias.dtype not in FLOATS:
        raise TypeError(f"attn_bias must be floating; pass a boolean mask as attn_mask (got {bias.dtype})")
    for name, t in (("attn_mask", mask), (bias_name, bias)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query on {query.device}")


def build_call(query: Tensor, key: Tensor, value: Tensor, *, seed: Optional[Tensor] = None,
               bias_name: str = "attn_bias", **options: Unpack[AttentionOptions]) -> tuple[AttentionCall, Layout]:
    """Check the public arguments and fold them into the op's call on (B, H, L, E), with the
    layout that unfolds its output. `options` as `attention` takes them, `DEFAULTS` where
    absent. `seed` (a 0-d int64 tensor, or a `dropout.Placement`'s) fixes the dropout draw;
    by default it comes from PyTorch's generator. `bias_name` is the argument the caller's
    user passed attn_bias as, for the errors: scaled_dot_product_attention's float attn_mask."""
    options = ATTENTION.complete("build_call", options)
    _check(query, key, value, options, bias_name)
    mask, bias, dropout_p = options["attn_mask"], options["attn_bias"], options["dropout_p"]
    layout = Layout(query, key, value, options["enable_gqa"])
    sinks = None if options["sinks"] is None else check_sinks(options["sinks"], layout, query)
    mask = None if mask is None else layout.fold_mask(mask, "attn_mask")
    bias = None if bias is None else layout.fold_mask(bias, bias_name)
    causal = _causal_offset(options["is_causal"], layout.len_q, layout.len_k)
    bounds, blocks = None, None
    structured = {name: options[name] for name in STRUCTURED}
    if any(value is not None for value in structured.values()):
        batch = () if layout.flat else tuple(layout.batch)
        bounds, keep = structure(batch, layout.len_q, layout.len_k, causal, query.device, **structured)
        if keep is not None:  # padding with holes: a (B, 1, 1, Lk) mask beside any other
            mask = keep if mask is None else mask & keep
    causal = _op_diagonal(causal, layout.len_q, layout.len_k)  # the window's alignment is done with it
    if options["mask_mod"] is not None or options["block_mask"] is not None:
        if query.dim() != 4 or layout.flat:
            raise ValueError(f"mask_mod and block_mask take (B, H, L, E) inputs, as FlexAttention does; got "
                             f"{describe_shapes(query, key, value)}")
        evaluated = evaluated_mask(options["mask_mod"], options["block_mask"], layout.batch[0], layout.heads,
                                   layout.len_q, layout.len_k, query.device)
        if evaluated.causal is not None:  # two causal diagonals: the lower one holds
            causal = evaluated.causal if causal is None else min(causal, evaluated.causal)
        if evaluated.bounds is not None:
            parts = [evaluated.bounds] if bounds is None else [bounds, evaluated.bounds]
            bounds = join_bounds(parts, layout.len_q, layout.len_k, causal, query.device)
        if evaluated.mask is not None:
            mask = evaluated.mask if mask is None else mask & evaluated.mask
        blocks = evaluated.blocks
    if seed is None:
        if dropout_p > 0.0:
            seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # from PyTorch's default generator
        else:
            seed = torch.zeros((), dtype=torch.int64)
    masks = ScoreMasks(mask=mask, bias=bias, bounds=bounds, causal=causal, softcap=float(options["softcap"] or 0.0),
                       blocks=blocks, sinks=sinks)
    call = AttentionCall(layout.q, layout.k, layout.v, masks, seed, float(default_scale(query, options["scale"])),
                         float(dropout_p))
    return call, layout

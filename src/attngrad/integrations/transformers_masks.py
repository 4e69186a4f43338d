"""transformers' mask functions as attngrad's masks.

transformers describes a mask as a function of (batch, head, query, key) indices built from
the pieces of `transformers.masking_utils` (the causal mask, sliding windows, chunks,
packed sequences, image-token blocks joined by `or_masks` and `and_masks`) or by the model
itself. Its mask interface hands that function to each attention backend's mask builder,
which for SDPA or eager evaluates it into a (B, 1, Lq, Lk) tensor.

Here the common pieces are read instead (`read_mask_function`): each becomes an argument of
`attngrad.torch.attention` (a causal diagonal, a window, document ids, key padding), with
no evaluation at all. Any other function is evaluated by transformers' own SDPA mask
builder a few rows at a time and reduced to per-row key bounds where each row sees one
interval of keys, as every mask of transformers' models does (`attngrad.torch.masks.functions`);
only a mask with holes inside a row is written out whole. Either way the model runs with
its own mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypedDict

import torch
from torch import Tensor

from ..torch.masks.functions import EvaluatedMask, evaluate_rows

MASKING_MODULE = "transformers.masking_utils"


class UnsupportedMask(NotImplementedError):
    """A transformers mask (or piece of one) that `read_mask_function` does not read: it is
    evaluated instead (`evaluate_mask_function`)."""


@dataclass
class Pattern:
    """The parts of a mask function, in absolute positions (query q, key k): all must hold."""

    causal: bool = False  # k <= q
    left: Optional[int] = None  # k >= q - left (a causal sliding window of left + 1 keys)
    band: Optional[int] = None  # |q - k| <= band (a bidirectional sliding window)
    documents: Optional[Tensor] = None  # (B, L): q and k in one packed sequence

    def join(self, other: Pattern) -> Pattern:
        return Pattern(
            causal=self.causal or other.causal,
            left=_smallest(self.left, other.left),
            band=_smallest(self.band, other.band),
            documents=other.documents if self.documents is None else self.documents,
        )


def _smallest(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else min(a, b)


def _origin(fn: Callable) -> str:
    """The name of the masking_utils function that made `fn` ('and_masks' for its and_mask)."""
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return qualname.split(".<locals>")[0]


def _captured(fn: Callable) -> dict:
    return inspect.getclosurevars(fn).nonlocals


def read_mask_function(fn: Callable) -> Pattern:
    """The Pattern of a transformers mask function, or UnsupportedMask naming the piece it
    does not read."""
    module = getattr(fn, "__module__", None)
    name = _origin(fn)
    if module != MASKING_MODULE:
        raise UnsupportedMask(f"{module}.{getattr(fn, '__qualname__', fn)!s} is not a piece of {MASKING_MODULE}")
    if name == "causal_mask_function":
        return Pattern(causal=True)
    if name == "bidirectional_mask_function":
        return Pattern()
    if name == "and_masks":
        pattern = Pattern()
        for part in _captured(fn)["mask_functions"]:
            pattern = pattern.join(read_mask_function(part))
        return pattern
    if name == "sliding_window_overlay":  # k > q - w
        return Pattern(left=int(_captured(fn)["sliding_window"]) - 1)
    if name == "sliding_window_bidirectional_overlay":  # |q - k| <= w
        return Pattern(band=int(_captured(fn)["sliding_window"]))
    if name == "packed_sequence_mask_function":
        return Pattern(documents=_captured(fn)["packed_sequence_mask"])
    if name == "remap_positions_for_packed_sequence":
        # the inner pieces see positions within each document; those above depend on q - k
        # alone, which within one document equals the difference of indices
        return read_mask_function(_captured(fn)["mask_function"])
    raise UnsupportedMask(f"{MASKING_MODULE}.{name} is not read into a structured mask")


@dataclass
class CompactMask:
    """A transformers mask as attngrad's structured arguments: O(B L) memory, never Lq x Lk.
    What `mask_for_attngrad` returns and the attention function receives as attention_mask."""

    q_length: int
    kv_length: int
    is_causal: bool | int = False  # False, or the causal diagonal c: key j seen by query i when j <= i + c
    window: Optional[tuple] = None
    key_padding: Optional[Tensor] = None  # (B, Lk) boolean, True = padding
    document_ids: Optional[Tensor] = None  # (B, L)
    evaluated: Optional[EvaluatedMask] = None  # a mask function evaluated, padding included

    def arguments(self) -> dict:
        """Keywords of `attngrad.torch.attention`."""
        return dict(is_causal=self.is_causal, window=self.window, key_padding=self.key_padding,
                    document_ids=self.document_ids, block_mask=self.evaluated)

    # transformers' generate() makes the masks for a static cache before the forward and
    # calls .contiguous() on them; the forward's mask interface then returns them as they are.
    ndim = 4

    def contiguous(self) -> CompactMask:
        return self

    @property
    def shape(self) -> tuple:
        """The shape of the dense mask this stands for (B, 1, Lq, Lk), B = 1 when shared."""
        if self.evaluated is not None:
            return (self.evaluated.shape[0], 1, self.q_length, self.kv_length)
        batch = next((t.shape[0] for t in (self.key_padding, self.document_ids) if t is not None), 1)
        return (batch, 1, self.q_length, self.kv_length)


class MaskArguments(TypedDict, total=False):
    """What transformers' mask interface passes, by name, and attngrad reads (it passes more:
    allow_is_causal_skip, dtype, config, ..., which attngrad's masks do not need)."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int | Tensor  # the first query's position (a tensor with a static cache)
    kv_offset: int
    mask_function: Callable  # (b, h, q_idx, kv_idx) -> whether the key takes part
    attention_mask: Optional[Tensor]  # (B, Lk) 2-D padding, True or 1 = a real token
    use_vmap: bool
    device: torch.device | str


# transformers' own defaults for what its interface may leave out (`sdpa_mask`'s)
MASK_DEFAULTS: MaskArguments = dict(q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                                    use_vmap=False, device="cpu")


def evaluate_mask_function(arguments: MaskArguments, fixed_form: bool = False) -> CompactMask:
    """A mask function no Pattern reads, with the padding of the 2-D `attention_mask`:
    evaluated by transformers' `sdpa_mask` a few rows at a time (its semantics exactly),
    as key bounds where every row sees one interval of keys (always, with `fixed_form`:
    `masks.functions.evaluate_rows`). `arguments` holds every field of `MaskArguments`."""
    from transformers.masking_utils import sdpa_mask

    attention_mask = arguments["attention_mask"]
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.bool)  # 0/1 as transformers' own preprocessing leaves it
    batch_size, q_length, kv_length, device = (arguments[n] for n in ("batch_size", "q_length", "kv_length", "device"))

    def rows_of(start: int, stop: int) -> Tensor:
        return sdpa_mask(**{**arguments, "q_length": stop - start, "q_offset": arguments["q_offset"] + start,
                            "attention_mask": attention_mask}, allow_is_causal_skip=False,
                         allow_is_bidirectional_skip=False)

    evaluated = evaluate_rows(rows_of, batch_size, 1, q_length, kv_length, device, fixed_form)
    return CompactMask(q_length, kv_length, evaluated=evaluated)


def compact_mask(q_length: int, kv_length: int, q_offset: int, kv_offset: int, pattern: Pattern,
                 attention_mask: Optional[Tensor], batch_size: int) -> CompactMask:
    """The CompactMask of a Pattern for queries at positions q_offset.. and keys at kv_offset..,
    with transformers' 2-D `attention_mask` (True or 1 = a real token) for the padding."""
    diagonal = int(q_offset) - int(kv_offset)  # key j seen by query i when j <= i + diagonal (causal)
    window = None
    if pattern.left is not None or pattern.band is not None:
        if not pattern.causal and diagonal != 0:
            raise UnsupportedMask(f"attn_implementation='attngrad': a sliding window without the causal mask needs "
                                  f"queries and keys at the same positions; got offsets {q_offset} and {kv_offset}")
        left = _smallest(pattern.left, pattern.band)
        window = (left, pattern.band)
    documents = None
    if pattern.documents is not None:
        if q_length != kv_length or diagonal != 0:
            raise UnsupportedMask("attn_implementation='attngrad': packed sequences need as many queries as keys, "
                                  f"at the same positions; got Lq = {q_length}, Lk = {kv_length}")
        documents = pattern.documents.expand(batch_size, -1)
    key_padding = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask for attngrad must be 2-D (batch, keys); got {tuple(attention_mask.shape)}")
        kept = attention_mask.to(torch.bool)
        short = kv_offset + kv_length - kept.shape[-1]
        if short > 0:  # as transformers' prepare_padding_mask: keys past the mask are padding
            kept = torch.nn.functional.pad(kept, (0, short))
        kept = kept[:, kv_offset:kv_offset + kv_length]
        if not bool(kept.all()):
            key_padding = ~kept
    return CompactMask(q_length, kv_length, is_causal=diagonal if pattern.causal else False, window=window,
                       key_padding=key_padding, document_ids=documents)

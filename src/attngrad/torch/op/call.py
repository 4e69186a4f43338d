"""One description of an attention call, and one table of every pass's fields.

`AttentionCall` says what a call computes: q, k, v, its score masks (`ScoreMasks`), the
dropout and the scale. The public functions build it once; the ops, their fakes and checks,
the vmap rules, the autograd Functions, the backends and the ring all pass it on.

`FIELDS` names every argument any pass takes, with its schema type and the tensor whose
shape it must have; `PASSES` lists each pass's extra inputs and its outputs. The ops' schemas
(`ops`), their fake results, their shape checks (`checks.check_fields`) and their batching
rules (`vmap_rules`) are derived from these two tables, so a new option is one field here
plus its kernel code.

Shape legend: q (B, H, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), out (B, H, Lq, dv),
row statistics (B, H, Lq), a bias or mask broadcastable to (B, H, Lq, Lk), key bounds
(1 or B, Lq, 2), sink logits (1 or B, H), a mask's blocks (1 or B, 1 or H, Lq / R, Lk / K)
and tiles (T, R, K).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, TypedDict

from torch import Tensor

from ..masks.blocks import MaskBlocks
from ..precision import compute_dtype
from .dropout import Placement

REQUIRED = object()  # a field without a default


@dataclass(frozen=True)
class Field:
    """One argument of a pass: its name, its type in the op schema, what its shape must
    equal (`like`: "q", "k", "v", "out" (B, H, Lq, dv), "rows" (B, H, Lq), "bias"), if
    anything, and its default, if it has one."""

    name: str
    schema: str
    like: Optional[str] = None
    default: Any = REQUIRED

    def declaration(self) -> str:
        return f"{self.schema} {self.name}" + ("" if self.default is REQUIRED else f"={self.default!r}")


# The call's own fields: what every pass takes.
CALL_FIELDS = (
    Field("q", "Tensor"), Field("k", "Tensor"), Field("v", "Tensor"),
    Field("mask", "Tensor?"),  # boolean, True = take part
    Field("bias", "Tensor?"),  # added to the scores
    Field("bounds", "Tensor?"),  # per-row key bounds [lo, hi) of the structured masks
    Field("seed", "Tensor"),  # 0-d int64 dropout seed, or (5,): a `dropout.Placement`
    Field("causal", "int?"),  # the causal diagonal: key j visible to query i when j <= i + causal
    Field("scale", "float"), Field("softcap", "float"), Field("dropout_p", "float"),
    Field("sinks", "Tensor?", default=None),  # (1 or B, H) logits of a value-0 key every row sees (`sink_logits`)
    Field("mask_blocks", "Tensor?", default=None),  # a boolean mask kept per block (`mask_blocks`):
    Field("mask_tiles", "Tensor?", default=None),  # its (1 or B, 1 or H, blocks, blocks) index, its tiles
)

# The passes' own inputs: the forward's results, upstream gradients, tangents, cotangents.
PASS_FIELDS = (
    Field("dout", "Tensor", "out"), Field("out", "Tensor", "out"),
    Field("row_max", "Tensor", "rows"), Field("inv_sum", "Tensor", "rows"),
    Field("bias_grad", "bool"), Field("dout_grad", "bool"),
    Field("tdout", "Tensor?", "out"), Field("tq", "Tensor?", "q"), Field("tk", "Tensor?", "k"),
    Field("tv", "Tensor?", "v"), Field("tbias", "Tensor?", "bias"), Field("tsinks", "Tensor?", "sinks", default=None),
    Field("gq", "Tensor?", "q"), Field("gk", "Tensor?", "k"), Field("gv", "Tensor?", "v"), Field("gbias", "Tensor?", "bias"),
    Field("gsinks", "Tensor?", "sinks", default=None),
)

FIELDS = {field.name: field for field in CALL_FIELDS + PASS_FIELDS}


class PassInputs(TypedDict, total=False):
    """A pass's own inputs by name, as every backend takes them: `pass(call, **inputs)`, and
    as their host code passes them on whole. Each pass has those `PASSES` lists (`PASS_FIELDS`
    says their shapes), and a backend may be given two more (`dispatch`)."""

    dout: Tensor  # (B, H, Lq, dv) the output's cotangent
    out: Tensor  # (B, H, Lq, dv) the forward's output
    row_max: Tensor  # (B, H, Lq) the forward's row maxima m, compute dtype
    inv_sum: Tensor  # (B, H, Lq) the forward's 1 / l, compute dtype
    bias_grad: bool  # whether the bias's gradient (or its tangent) is asked for
    dout_grad: bool  # whether the double backward's g_dO is asked for
    tdout: Optional[Tensor]  # tangents: of dO, q, k, v, the bias and the sink logits
    tq: Optional[Tensor]
    tk: Optional[Tensor]
    tv: Optional[Tensor]
    tbias: Optional[Tensor]
    tsinks: Optional[Tensor]
    gq: Optional[Tensor]  # the double backward's cotangents of dq, dk, dv, dbias, dsinks
    gk: Optional[Tensor]
    gv: Optional[Tensor]
    gbias: Optional[Tensor]
    gsinks: Optional[Tensor]
    # a ring step's whole rows' sums (`RingSums`) or a Hessian-vector product's (`HvpSums`),
    # only to a backend with `row_sums`; each backend's `refuses` takes or refuses them by type
    row_sums: Optional[RowSums]
    sink_rows: Optional[Tensor]  # (B, H, Lq): each row's share of a sink logit's term (`sink_logits`)


class RowSums(dict):
    """Rows' sums handed to a pass beside its inputs: tensors by name, of the protocol their
    type names (a backend takes or refuses them by type: the same names mean other sums in
    each). Untyped sums are refused everywhere."""


class RingSums(RowSums):
    """A ring step's: its keys are a part of each row's, and its higher passes take the whole
    rows' sums first (`distributed.ring_passes`): "centre" (t = rowsum(P S')), with
    "centre_sums" (forward_jvp: t written there), "delta_t" (the backward's JVP: D'),
    "g_centre" (the double backward); empty for the double backward's own walk."""


class HvpSums(RowSums):
    """A Hessian-vector product's (`hvp_fusion.ForwardSums`), `HVP_SUMS` by pass, with
    "results": the tensors a fused pass writes its primal results into (the forward's out,
    row_max, inv_sum; the backward's dq, dk, dv)."""


# The rows' sums a Hessian-vector product's passes carry (`hvp_fusion.ForwardSums`), by pass,
# beside the "results" the fused passes write into: forward_jvp writes t - c, c and the peak
# key's index (-1 where the backend does not name it), and the backward's JVP along the same
# tangents reads them with O'
HVP_SUMS = {"forward_jvp": frozenset({"centre_sums", "peak_sums", "peak_index"}),
            "backward_jvp": frozenset({"centre", "peak", "peak_index", "out_t"}),
            "backward_with_jvp": frozenset({"centre", "peak", "peak_index", "out_t"})}


@dataclass(frozen=True)
class Output:
    """One result of a pass: shaped like `like` (as in `Field`, "rows" in the compute dtype),
    present only when `when` holds (an empty placeholder otherwise): a boolean input that is
    true, or a field of the call that is given ("sinks")."""

    name: str
    like: str
    when: Optional[str] = None


@dataclass(frozen=True)
class Pass:
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]


_STATS = ("out", "row_max", "inv_sum")
_TANGENTS = ("tq", "tk", "tv", "tbias", "tsinks")
_GRADS = (Output("dq", "q"), Output("dk", "k"), Output("dv", "v"), Output("dbias", "bias", "bias_grad"),
          Output("dsinks", "sinks", "sinks"))
_GRAD_TANGENTS = (Output("tdq", "q"), Output("tdk", "k"), Output("tdv", "v"), Output("tdbias", "bias", "bias_grad"),
                  Output("tdsinks", "sinks", "sinks"))

PASSES = {
    "forward": Pass((), (Output("out", "out"), Output("row_max", "rows"), Output("inv_sum", "rows"))),
    "backward": Pass(("dout", *_STATS, "bias_grad"), _GRADS),
    "jvp": Pass(("row_max", "inv_sum", *_TANGENTS), (Output("out_t", "out"),)),
    # the forward and the jvp, one pass
    "forward_jvp": Pass(_TANGENTS, (Output("out", "out"), Output("row_max", "rows"), Output("inv_sum", "rows"),
                                    Output("out_t", "out"))),
    "backward_jvp": Pass(("dout", *_STATS, "bias_grad", "tdout", *_TANGENTS), _GRAD_TANGENTS),
    # the backward and the backward_jvp, one pass
    "backward_with_jvp": Pass(("dout", *_STATS, "bias_grad", "tdout", *_TANGENTS), _GRADS + _GRAD_TANGENTS),
    "double_backward": Pass(
        ("dout", *_STATS, "bias_grad", "dout_grad", "gq", "gk", "gv", "gbias", "gsinks"),
        (Output("g_dout", "out", "dout_grad"), Output("g_q", "q"), Output("g_k", "k"), Output("g_v", "v"),
         Output("g_bias", "bias", "bias_grad"), Output("g_sinks", "sinks", "sinks")),
    ),
}


def argument_names(pass_name: str) -> tuple[str, ...]:
    """A pass's arguments in schema order: the call's fields, the pass's inputs, then those
    of either that have defaults (the schema wants them last)."""
    inputs = PASSES[pass_name].inputs
    plain = tuple(f.name for f in CALL_FIELDS if f.default is REQUIRED)
    plain_inputs = tuple(n for n in inputs if FIELDS[n].default is REQUIRED)
    defaulted = tuple(f.name for f in CALL_FIELDS if f.default is not REQUIRED)
    return plain + plain_inputs + defaulted + tuple(n for n in inputs if n not in plain_inputs)


def schema(pass_name: str) -> str:
    """The op schema of a pass, from the tables: "(Tensor q, ..., Tensor dout, ..., Tensor? sinks=None, ...) -> (...)"."""
    declared = [FIELDS[n].declaration() for n in argument_names(pass_name)]
    outputs = PASSES[pass_name].outputs
    results = "Tensor" if len(outputs) == 1 else f"({', '.join('Tensor' for _ in outputs)})"
    return f"({', '.join(declared)}) -> {results}"


@dataclass(frozen=True)
class ScoreMasks:
    """What decides each score and which scores take part: a boolean mask, a float bias,
    per-row key bounds (the structured masks), the causal diagonal, a soft cap, sink logits
    and a boolean mask kept per block (an entry takes part where every one of them lets it).

    `sinks` is the op's field; the backends see `sink` instead, a sink of logit 0 whose
    logits the bias has taken in (`sink_logits.lowered`)."""

    mask: Optional[Tensor] = None  # broadcastable to (B, H, Lq, Lk)
    bias: Optional[Tensor] = None  # broadcastable to (B, H, Lq, Lk)
    bounds: Optional[Tensor] = None  # (1 or B, Lq, 2) int64
    causal: Optional[int] = None
    softcap: float = 0.0
    sink: bool = False  # the backends': each row's softmax has one more term, exp(0)
    blocks: Optional[MaskBlocks] = None
    sinks: Optional[Tensor] = None  # (1 or B, H)


# the call's tensors, in the order a Function takes them (`AttentionCall.tensor_slots`)
TENSOR_SLOTS = ("q", "k", "v", "mask", "bias", "bounds", "seed", "sinks", "mask_blocks", "mask_tiles")


@dataclass(frozen=True)
class AttentionCall:
    """An attention call on (B, H, L, E) tensors: what every pass of it computes."""

    q: Tensor
    k: Tensor
    v: Tensor
    masks: ScoreMasks
    seed: Tensor
    scale: float
    dropout_p: float = 0.0

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> AttentionCall:
        """From the ops' arguments by name (`CALL_FIELDS`)."""
        index, tiles = fields["mask_blocks"], fields["mask_tiles"]
        if (index is None) != (tiles is None):
            raise ValueError("attngrad attention op: mask_blocks and mask_tiles come together (a `MaskBlocks`); got "
                             f"{'mask_blocks' if tiles is None else 'mask_tiles'} alone")
        blocks = None if index is None else MaskBlocks(index, tiles)
        masks = ScoreMasks(fields["mask"], fields["bias"], fields["bounds"], fields["causal"], fields["softcap"],
                           blocks=blocks, sinks=fields["sinks"])
        return cls(fields["q"], fields["k"], fields["v"], masks, fields["seed"], fields["scale"], fields["dropout_p"])

    def fields(self) -> dict[str, Any]:
        """The ops' arguments by name (`CALL_FIELDS`); a backend's call (`ScoreMasks.sink`) has
        none for its sink, which the op's never has."""
        m = self.masks
        return dict(q=self.q, k=self.k, v=self.v, mask=m.mask, bias=m.bias, bounds=m.bounds, seed=self.seed,
                    causal=m.causal, scale=self.scale, softcap=m.softcap, dropout_p=self.dropout_p, sinks=m.sinks,
                    mask_blocks=None if m.blocks is None else m.blocks.index,
                    mask_tiles=None if m.blocks is None else m.blocks.tiles)

    # Shorthands for the backends, which read the masks often.
    mask = property(lambda self: self.masks.mask)
    bias = property(lambda self: self.masks.bias)
    bounds = property(lambda self: self.masks.bounds)
    causal = property(lambda self: self.masks.causal)
    softcap = property(lambda self: self.masks.softcap)
    sink = property(lambda self: self.masks.sink)
    sinks = property(lambda self: self.masks.sinks)
    blocks = property(lambda self: self.masks.blocks)

    @property
    def placement(self) -> Placement:
        """The dropout seed and where this call sits in a larger one."""
        return Placement.of(self.seed)

    @property
    def partial_rows(self) -> bool:
        """Whether the call's keys are a part of each row's (a ring step)."""
        return self.seed.dim() > 0 and bool(self.placement.partial_rows)

    def tensor_slots(self) -> tuple[Optional[Tensor], ...]:
        """The call's tensors in `TENSOR_SLOTS` order, None where it has none: what an autograd
        Function takes positionally (autograd and torch.func track those alone), beside the
        call's `options()`."""
        blocks = self.masks.blocks
        return (self.q, self.k, self.v, self.mask, self.bias, self.bounds, self.seed, self.sinks,
                None if blocks is None else blocks.index, None if blocks is None else blocks.tiles)

    def options(self) -> AttentionCall:
        """The call without its tensors: what travels beside them through a Function (its ctx
        keeps this, and saves the tensors for autograd)."""
        return self.with_tensors((None,) * len(TENSOR_SLOTS))

    def with_tensors(self, tensors: tuple[Optional[Tensor], ...] | list) -> AttentionCall:
        """This call's options with `tensors` (`TENSOR_SLOTS` order) in its tensors' places: the
        ones autograd or a transform hands a Function."""
        q, k, v, mask, bias, bounds, seed, sinks, index, tiles = tensors
        blocks = None if index is None else MaskBlocks(index, tiles)
        masks = dataclasses.replace(self.masks, mask=mask, bias=bias, bounds=bounds, sinks=sinks, blocks=blocks)
        return dataclasses.replace(self, q=q, k=k, v=v, masks=masks, seed=seed)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the call that is not None."""
        blocks = (None, None) if self.blocks is None else (self.blocks.index, self.blocks.tiles)
        return tuple(t for t in (self.q, self.k, self.v, self.mask, self.bias, self.bounds, *blocks, self.sinks)
                     if t is not None)


def present(output: Output, call: AttentionCall, inputs: dict[str, Any]) -> bool:
    """Whether the pass makes `output` (`Output.when`) for this call and these inputs."""
    if output.when is None:
        return True
    if output.when == "sinks":
        return call.sinks is not None
    return bool(inputs[output.when])


def empty_like_field(like: str, call: AttentionCall) -> Tensor:
    """An uninitialised contiguous result shaped like `like` (see `Output`)."""
    q, v = call.q, call.v
    if like == "out":
        return q.new_empty(*q.shape[:3], v.shape[-1])
    if like == "rows":
        return q.new_empty(q.shape[:3], dtype=compute_dtype(q.dtype))
    source = {"q": q, "k": call.k, "v": v, "bias": call.bias, "sinks": call.sinks}[like]
    return source.new_empty(source.shape)  # empty_like would copy a transposed input's strides

"""The passes of ring attention, each a walk round the ring (`each_step`): at step s a rank
holds the key block of rank r - s, runs its units on it (`ring_plan`) while the next block
is on its way, and passes it on.

Every pass is exact because every unit uses the whole rows' statistics:

    forward          each unit's (O, m, 1/l) merge into the whole row's: with M = max m,
                     l = sum l_b e^(m_b - M) and O = sum O_b l_b e^(m_b - M) / l; a unit in
                     which a row sees no key has 1/l = 0 and weight 0
    backward         each unit is the op's backward given the whole O, M and 1/l: dQ adds up
                     here, dK and dV add up as they travel with their block, and come home
    JVP              a unit gives its part of (P S' Z) V~ + (P Z) V~' and of c = rowsum(P S');
                     O' = their sums less c O (`higher_order.attention_jvp`)
    backward's JVP   the JVP first (for c and D~ = rowsum(dO' O + dO O')), then units given both
    double backward  a first walk for t = rowsum(P T) and rowsum(P g_P), then units given both

Every unit is an `AttentionCall` (`RingPlan.call`) run through the backend registry: the
forward and backward's through the ops, the higher passes' through `dispatch.run` with the
whole rows' sums (`row_sums`), which only a backend with `row_sums` takes. Tangents and cotangents of K and V travel with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from ..op import dispatch
from ..op.call import PassInputs, RingSums
from ..op.key_constant_bias import sink_share
from ..op.ops import add_sink, run_op
from ..precision import compute_dtype
from .ring_plan import RingPlan, Unit, piece

Block = list[Optional[list[Tensor]]]  # per travelling field (K, V, their tangents...), its chunks or None


def each_step(plan: RingPlan, block: Block, work: Callable[[Unit, Block], Optional[list[Tensor]]],
              sums: Optional[list[list[Tensor]]] = None) -> Optional[list[list[Tensor]]]:
    """Run `work(unit, block)` on every unit of every step, `block` the fields of the key
    block held then. With `sums` (per key-side result, zero chunks shaped like the block's),
    `work` returns its key-side results, which add up as they travel with their block; the
    sums of this rank's own block are returned once they are home."""
    ring = plan.ring
    present = [i for i, field in enumerate(block) if field is not None]
    chunks = plan.chunks

    def flat(fields: list) -> list[Tensor]:
        return [t for i in present for t in fields[i]]

    def unflat(tensors: list[Tensor]) -> Block:
        fields: Block = [None] * len(block)
        for n, i in enumerate(present):
            fields[i] = tensors[n * chunks:(n + 1) * chunks]
        return fields

    sums_home = None  # the sums in flight
    partial = sums  # this step's results, into the caller's zeros first
    for step in range(ring.size):
        incoming = ring.pass_on(flat(block)) if step < ring.size - 1 else None
        for unit in plan.units[step]:
            results = work(unit, block)
            if partial is not None:
                for field, result in zip(partial, results):
                    if result is not None:
                        field[unit.j] += result
        if partial is not None:
            totals = partial
            if sums_home is not None:  # this block's sums from the ranks before, received into fresh buffers
                arrived = sums_home.wait()
                totals = [arrived[n * chunks:(n + 1) * chunks] for n in range(len(partial))]
                for total, field in zip(totals, partial):
                    for t, p in zip(total, field):
                        t.add_(p)
            if ring.size == 1:
                return totals
            sums_home = ring.pass_on([t for field in totals for t in field])
            if step < ring.size - 1:  # a partial that was sent is in flight: the next step takes new zeros
                partial = ([[t.zero_() for t in field] for field in partial] if totals is not partial
                           else [[torch.zeros_like(t) for t in field] for field in partial])
        if incoming is not None:
            block = unflat(incoming.wait())
    if sums is None:
        return None
    arrived = sums_home.wait()
    return [arrived[n * chunks:(n + 1) * chunks] for n in range(len(sums))]


def _zeros(chunks: Optional[list[Tensor]], work: torch.dtype, width: Optional[int] = None) -> list[Tensor]:
    """Zero chunks shaped like `chunks` (the last axis `width` wide, if given), dtype `work`."""
    return [torch.zeros(*t.shape[:-1], t.shape[-1] if width is None else width, dtype=work, device=t.device) for t in chunks]


class _RowMerge:
    """The whole rows' (O, M, 1/l) from units' (O_b, m_b, 1/l_b), one unit at a time."""

    def __init__(self, like: Tensor, width: int, work: torch.dtype) -> None:
        self.acc = torch.zeros(*like.shape[:-1], width, dtype=work, device=like.device)  # sum O_b l_b e^(m_b - M)
        self.max = torch.full(like.shape[:-1], -torch.inf, dtype=work, device=like.device)  # M
        self.sum = torch.zeros(like.shape[:-1], dtype=work, device=like.device)  # l relative to M

    def add(self, out: Tensor, row_max: Tensor, inv_sum: Tensor) -> None:
        # a row that saw no key has (O, m, 1/l) = (0, 0, 0): weight 0; one that a NaN or Inf
        # reached has 1/l NaN, and its NaN carries through M (torch.maximum keeps NaN), the
        # weights and the sum
        seen = inv_sum != 0
        block_max = torch.where(seen, row_max, -torch.inf)
        new_max = torch.maximum(self.max, block_max)
        shift = torch.where(new_max == -torch.inf, 0.0, new_max)  # no NaN from -inf - -inf
        old = torch.exp(self.max - shift)
        weight = torch.exp(block_max - shift) / torch.where(seen, inv_sum, 1.0)  # l_b e^(m_b - M)
        self.acc.mul_(old[..., None]).add_(out.to(self.acc.dtype) * weight[..., None])
        self.sum.mul_(old).add_(weight)
        self.max = new_max

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        seen = self.sum != 0  # 0 for a row that saw no key in any unit alone
        out = self.acc / torch.where(seen, self.sum, 1.0)[..., None]
        return out, torch.where(seen, self.max, 0.0), torch.where(seen, 1.0 / torch.where(seen, self.sum, 1.0), 0.0)


def ring_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out, row_max, inv_sum) of this rank's queries over the whole sequence's keys."""
    work = compute_dtype(q.dtype)
    qs = plan.split(q)
    merges = [_RowMerge(chunk, v.shape[-1], work) for chunk in qs]

    def unit_forward(unit: Unit, block: Block) -> None:
        k_blk, v_blk = block
        merges[unit.i].add(*run_op("forward", plan.call(unit, qs[unit.i], k_blk[unit.j], v_blk[unit.j])))

    each_step(plan, [plan.split(k), plan.split(v)], unit_forward)
    out, row_max, inv_sum = (plan.join(list(parts)) for parts in zip(*(m.result() for m in merges)))
    if plan.masks.sink:  # the whole rows' statistics take the sink in; every later pass reads it from 1/l
        out, row_max, inv_sum = add_sink(out, row_max, inv_sum)
    return out.to(q.dtype), row_max, inv_sum


ROW_INPUTS = ("dout", "out", "row_max", "inv_sum", "tdout", "tq", "gq")  # the pass inputs shaped like this rank's rows


class _Rows:
    """This rank's row-side tensors (B, H, L / P, .) as chunks: q, the pass's `ROW_INPUTS`
    (None where not given) and `more`; and query-side sums."""

    def __init__(self, plan: RingPlan, q: Tensor, inputs: PassInputs, **more: Tensor) -> None:
        self.plan = plan
        self.q = plan.split(q)
        for name in ROW_INPUTS:
            setattr(self, name, plan.split(inputs.get(name)))
        for name, t in more.items():
            setattr(self, name, plan.split(t))

    def zeros(self, like: Tensor, work: torch.dtype, width: Optional[int] = None) -> list[Tensor]:
        return _zeros(self.plan.split(like), work, width)


def _add_to(total: Optional[Tensor], unit: Unit, part: Optional[Tensor]) -> None:
    """A unit's bias-shaped result into the rank's (b, h, L / P, L) total."""
    if total is not None and part is not None and part.numel():
        piece(total, unit.rows, unit.cols).add_(part)


def _bias_total(plan: RingPlan, wanted: bool, work: torch.dtype) -> Optional[Tensor]:
    return torch.zeros(plan.masks.bias.shape, dtype=work, device=plan.masks.bias.device) if wanted else None


def _key_results(k: Tensor, v: Tensor, sums: list[list[Tensor]], plan: RingPlan) -> tuple[Tensor, Tensor]:
    return plan.join(sums[0]).to(k.dtype), plan.join(sums[1]).to(v.dtype)


def _of(chunks: Optional[list[Tensor]], i: int) -> Optional[Tensor]:
    return None if chunks is None else chunks[i]


def ring_backward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor,
                  **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(dq, dk, dv, dbias or None) of this rank's shard, given the backward's inputs (dout,
    out, row_max, inv_sum, bias_grad)."""
    work = compute_dtype(q.dtype)
    bias_grad = inputs["bias_grad"]
    r = _Rows(plan, q, inputs)
    dq, dbias = r.zeros(q, work), _bias_total(plan, bias_grad, work)

    def unit_backward(unit: Unit, block: Block) -> list[Tensor]:
        i, k_blk, v_blk = unit.i, block[0][unit.j], block[1][unit.j]
        call = plan.call(unit, r.q[i], k_blk, v_blk)
        dq_u, dk_u, dv_u, dbias_u, _ = run_op("backward", call, dout=r.dout[i], out=r.out[i], row_max=r.row_max[i],
                                              inv_sum=r.inv_sum[i], bias_grad=bias_grad)
        dq[i] += dq_u
        _add_to(dbias, unit, dbias_u)
        return [dk_u, dv_u]

    ks, vs = plan.split(k), plan.split(v)
    sums = each_step(plan, [ks, vs], unit_backward, [_zeros(ks, work), _zeros(vs, work)])
    dk, dv = _key_results(k, v, sums, plan)
    return plan.join(dq).to(q.dtype), dk, dv, None if dbias is None else dbias.to(plan.masks.bias.dtype)


def ring_jvp(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor]:
    """(O', c): the output's tangent, and c = rowsum(P S') (B, H, L / P, 1, compute dtype),
    given out, row_max, inv_sum and the tangents tq, tk, tv, tbias (each None or absent: 0)."""
    work = compute_dtype(q.dtype)
    out, tbias = inputs["out"], inputs.get("tbias")
    r = _Rows(plan, q, inputs)
    out_t, centre = r.zeros(out, work), r.zeros(out, work, 1)
    uncentred = torch.zeros_like(centre[0])

    def unit_jvp(unit: Unit, block: Block) -> None:
        i, j = unit.i, unit.j
        k_blk, v_blk, tk_blk, tv_blk = block
        out_t[i] += dispatch.run(
            "jvp", plan.call(unit, r.q[i], k_blk[j], v_blk[j]), row_max=r.row_max[i], inv_sum=r.inv_sum[i],
            tq=_of(r.tq, i), tk=_of(tk_blk, j), tv=_of(tv_blk, j), tbias=piece(tbias, unit.rows, unit.cols),
            row_sums=RingSums(centre=uncentred, centre_sums=centre[i]))

    block = [plan.split(k), plan.split(v), plan.split(inputs.get("tk")), plan.split(inputs.get("tv"))]
    each_step(plan, block, unit_jvp)
    for i in range(plan.chunks):
        out_t[i] -= centre[i] * r.out[i].to(work)  # O' = sum of parts - c O
    return plan.join(out_t).to(q.dtype), plan.join(centre)


def _sink_rows(plan: RingPlan, row_max: Tensor, inv_sum: Tensor, x: Tensor, y: Tensor, delta: Tensor) -> Optional[Tensor]:
    """Each whole row's share of the sink logits' result, P_sink (Y - X D) (B, H, L / P), from
    its sums X, Y (t and D~, or t and u) and D: the one-process passes' `sink_rows`."""
    if not plan.masks.sink:
        return None
    return sink_share(row_max, inv_sum) * (y.double() - x.double() * delta.double())[..., 0]


def ring_backward_jvp(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, **inputs: Unpack[PassInputs]
                      ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Tangents of (dq, dk, dv, dbias or None) along (dO', Q', K', V', bias'), and with a sink
    each row's P_sink (D~ - t D) (`sink_logits`), else None; given the backward's inputs and
    the tangents tdout, tq, tk, tv, tbias (each None or absent: 0)."""
    work = compute_dtype(q.dtype)
    dout, out, row_max, inv_sum = inputs["dout"], inputs["out"], inputs["row_max"], inputs["inv_sum"]
    bias_grad = inputs["bias_grad"]
    tdout, tbias = inputs.get("tdout"), inputs.get("tbias")
    out_t, centre = ring_jvp(plan, q, k, v, **inputs)
    delta_t = (dout.to(work) * out_t.to(work)).sum(dim=-1, keepdim=True)  # D~ = rowsum(dO' O + dO O')
    if tdout is not None:
        delta_t += (tdout.to(work) * out.to(work)).sum(dim=-1, keepdim=True)
    delta = (dout.to(work) * out.to(work)).sum(dim=-1, keepdim=True)
    sink_rows = _sink_rows(plan, row_max, inv_sum, centre, delta_t, delta)
    r = _Rows(plan, q, inputs, centre=centre, delta_t=delta_t)
    dq_t, dbias_t = r.zeros(q, work), _bias_total(plan, bias_grad, work)

    def unit_backward_jvp(unit: Unit, block: Block) -> list[Tensor]:
        i, j = unit.i, unit.j
        k_blk, v_blk, tk_blk, tv_blk = block
        dq_u, dk_u, dv_u, dbias_u = dispatch.run(
            "backward_jvp", plan.call(unit, r.q[i], k_blk[j], v_blk[j]), dout=r.dout[i], out=r.out[i],
            row_max=r.row_max[i], inv_sum=r.inv_sum[i], bias_grad=bias_grad, tdout=_of(r.tdout, i), tq=_of(r.tq, i),
            tk=_of(tk_blk, j), tv=_of(tv_blk, j), tbias=piece(tbias, unit.rows, unit.cols),
            row_sums=RingSums(centre=r.centre[i], delta_t=r.delta_t[i]))
        dq_t[i] += dq_u
        _add_to(dbias_t, unit, dbias_u)
        return [dk_u, dv_u]

    ks, vs = plan.split(k), plan.split(v)
    block = [ks, vs, plan.split(inputs.get("tk")), plan.split(inputs.get("tv"))]
    sums = each_step(plan, block, unit_backward_jvp, [_zeros(ks, work), _zeros(vs, work)])
    dk_t, dv_t = _key_results(k, v, sums, plan)
    return (plan.join(dq_t).to(q.dtype), dk_t, dv_t, None if dbias_t is None else dbias_t.to(plan.masks.bias.dtype),
            sink_rows)


def ring_double_backward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, **inputs: Unpack[PassInputs]
                         ) -> tuple[Optional[Tensor], Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """(g_dout or None, g_q, g_k, g_v, g_bias or None, sink rows or None): the gradients of
    <gq, dq> + <gk, dk> + <gv, dv> + <gbias, dbias>, as the double_backward op, and with a
    sink each row's P_sink (u - t D) (`sink_logits`); given the backward's inputs, dout_grad
    and the cotangents gq, gk, gv, gbias (each None or absent: 0)."""
    work = compute_dtype(q.dtype)
    dout, out, row_max, inv_sum = inputs["dout"], inputs["out"], inputs["row_max"], inputs["inv_sum"]
    bias_grad, dout_grad = inputs["bias_grad"], inputs["dout_grad"]
    gbias = inputs.get("gbias") if bias_grad else None
    r = _Rows(plan, q, inputs)
    ks, vs = plan.split(k), plan.split(v)
    block = [ks, vs, plan.split(inputs.get("gk")), plan.split(inputs.get("gv"))]
    t_sum, u_sum = r.zeros(out, work, 1), r.zeros(out, work, 1)

    def unit_row_sums(unit: Unit, block: Block) -> None:
        i, j = unit.i, unit.j
        k_blk, v_blk, gk_blk, gv_blk = block
        t_u, u_u = dispatch.run(
            "double_backward_row_sums", plan.call(unit, r.q[i], k_blk[j], v_blk[j]), dout=r.dout[i],
            row_max=r.row_max[i], inv_sum=r.inv_sum[i], bias_grad=bias_grad, gq=_of(r.gq, i), gk=_of(gk_blk, j),
            gv=_of(gv_blk, j), gbias=piece(gbias, unit.rows, unit.cols), row_sums=RingSums())
        t_sum[i] += t_u
        u_sum[i] += u_u

    each_step(plan, block, unit_row_sums)
    deltas = [(r.dout[i].to(work) * r.out[i].to(work)).sum(dim=-1, keepdim=True) for i in range(plan.chunks)]
    for i in range(plan.chunks):  # rowsum(P g_P) = rowsum(P (dP T + (dO gV~^T) Z)) - t D
        # (with a sink too: the one-process pass's t D P_sink term restores what its own
        # rowsum(P g_P) leaves out, where this sum never had it)
        u_sum[i] -= t_sum[i] * deltas[i]
    sink_rows = _sink_rows(plan, row_max, inv_sum, plan.join(t_sum), plan.join(u_sum), plan.join(deltas))
    g_dout = r.zeros(dout, work) if dout_grad else None
    g_q, g_bias = r.zeros(q, work), _bias_total(plan, bias_grad, work)

    def unit_double_backward(unit: Unit, block: Block) -> list[Tensor]:
        i, j = unit.i, unit.j
        k_blk, v_blk, gk_blk, gv_blk = block
        g_dout_u, g_q_u, g_k_u, g_v_u, g_bias_u = dispatch.run(
            "double_backward", plan.call(unit, r.q[i], k_blk[j], v_blk[j]), dout=r.dout[i], out=r.out[i],
            row_max=r.row_max[i], inv_sum=r.inv_sum[i], bias_grad=bias_grad, dout_grad=dout_grad, gq=_of(r.gq, i),
            gk=_of(gk_blk, j), gv=_of(gv_blk, j), gbias=piece(gbias, unit.rows, unit.cols),
            row_sums=RingSums(centre=t_sum[i], g_centre=u_sum[i]))
        if g_dout is not None:
            g_dout[i] += g_dout_u
        g_q[i] += g_q_u
        _add_to(g_bias, unit, g_bias_u)
        return [g_k_u, g_v_u]

    sums = each_step(plan, block, unit_double_backward, [_zeros(ks, work), _zeros(vs, work)])
    g_k, g_v = _key_results(k, v, sums, plan)
    return (None if g_dout is None else plan.join(g_dout).to(dout.dtype), plan.join(g_q).to(q.dtype), g_k, g_v,
            None if g_bias is None else g_bias.to(plan.masks.bias.dtype), sink_rows)

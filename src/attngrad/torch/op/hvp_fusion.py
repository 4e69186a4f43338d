"""The fused passes of a Hessian-vector product: what forward mode and reverse mode, both
seeing attention's Functions (torch.func.jvp of torch.func.grad, a dual level over tensors
that require grad), can share that autograd's separate forward, jvp and backward cannot ask
for.

    Deferred      a Function's forward leaves its results to its jvp, which makes them with
                  their tangents in one fused pass (forward_jvp, backward_with_jvp)
    ForwardSums   the forward's fused pass leaves each row's centre and the output's
                  tangent, so that the backward's fused pass along the same tangents runs on
                  the backward's tiles rather than on whole rows

Both hold nothing that outlives the step: `Deferred.settle` lets go of the Function's
outputs, and the sums hold the tangents and O' weakly.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from .. import regime
from ..precision import compute_dtype
from . import dispatch
from .call import AttentionCall, HvpSums
from .ops import empty_results, run_op, run_pass


class ForwardSums:
    """What the forward's fused pass (forward_jvp) leaves the backward's (backward_with_jvp)
    of the same call: each row's centre t = rowsum(P * S') ((B, H, Lq, 1), compute dtype)
    and the output's tangent O', along the tangents of q, k, v and the bias it was given.
    Along the same tangents, the backward's JVP needs no walk over whole rows: with t, O' and
    D' = rowsum(dO' * O + dO * O'), which the backend makes from them, it runs on the
    backward's tiles (the tiles backend's `native.attention_backward_jvp_given_sums`, as a
    ring step's does: 5-8% less time per matrix product than on whole rows at L=1024-4096),
    or Triton's walks skip their `row_sums` pass (`launch._given_row_sums`)."""

    def __init__(self, tangents: tuple) -> None:
        # weak: the tangents and O' are the forward-mode level's, and the sums serve only a
        # backward run inside that level (an HVP); a training step's graph must not keep them
        self._tangents = tuple(None if t is None else weakref.ref(t) for t in tangents)
        # with peak, peak_index and out_t, set once the forward's pass has made them: each row's
        # t - c and c, c = S' at its most probable key (and that key's index where the backend
        # names it, else -1), so that the backward's pass centres its rows as the forward's did
        # (higher_order._centre_on_the_peak)
        self.centre: Optional[Tensor] = None
        self.peak: Optional[Tensor] = None
        self.peak_index: Optional[Tensor] = None
        self._out_t: Optional[weakref.ref] = None

    @property
    def out_t(self) -> Optional[Tensor]:
        return None if self._out_t is None else self._out_t()

    @out_t.setter
    def out_t(self, out_t: Tensor) -> None:
        self._out_t = weakref.ref(out_t)

    def along(self, tangents: tuple) -> bool:
        """Whether the sums were made along these very tangents (torch.func hands both passes
        the same tensors), and O' is still alive."""
        if self.centre is None or self.out_t is None:
            return False
        return all((a is None and b is None) or (a is not None and a() is b) for a, b in zip(self._tangents, tangents))

    def centre_sums(self, call: AttentionCall, inputs: dict, results: tuple) -> Optional[dict]:
        """The row sums to ask of the forward's pass, where a backend makes them; else None.
        The pass writes its primal results into `results`, the forward's held ones, and the
        peak key's index into "peak_index" where it names one (-1 where it does not: the
        tiles find the peak by its value)."""
        if call.sinks is not None:
            return None  # (the sinks' closed forms take the whole-row pass's sink_rows)
        rows = (*call.q.shape[:3], 1)
        row_sums = HvpSums(centre_sums=call.q.new_empty(rows, dtype=compute_dtype(call.q.dtype)),
                           peak_sums=call.q.new_empty(rows, dtype=compute_dtype(call.q.dtype)),
                           peak_index=call.q.new_full(rows, -1, dtype=torch.int32), results=results)
        return row_sums if dispatch.offered("forward_jvp", call, {**inputs, "row_sums": row_sums}) else None

    def run(self, pass_name: str, call: AttentionCall, given: dict, held: tuple) -> Optional[tuple]:
        """The fused pass `pass_name` of `call` with the rows' sums: forward_jvp making them
        (writing its primal results into `held`, the forward's), where a backend can;
        backward_with_jvp taking them (its dq, dk, dv into `held`'s; no bias gradient). The
        pass runs as the op's own work (`ops.run_pass`), which takes rows' sums. None where
        forward_jvp cannot make them: the plain pass then runs."""
        if pass_name == "forward_jvp":
            row_sums = self.centre_sums(call, given, held)
            if row_sums is None:
                return None
            results = run_pass(pass_name, call, {**given, "row_sums": row_sums})
            self.centre, self.peak, self.peak_index = (row_sums[name] for name in
                                                       ("centre_sums", "peak_sums", "peak_index"))
            self.out_t = results[-1]
            return results
        row_sums = HvpSums(centre=self.centre, peak=self.peak, peak_index=self.peak_index, out_t=self.out_t,
                           results=held[:3])
        return run_pass(pass_name, call, {**given, "row_sums": row_sums})


def _plain(t: Any) -> Any:
    """A tensor as the bottom of torch.func's wrappers holds it, out of every graph; anything
    else as it is."""
    return regime.unwrapped(t).detach() if isinstance(t, Tensor) else t


class Deferred:
    """The results a Function's forward leaves to its jvp: where forward mode will see the
    Function, the jvp runs one fused pass for the results and their tangents, which
    autograd's separate forward and jvp cannot ask for. The forward returns uninitialised
    tensors (`hold`); the jvp's pass fills them (`fill`). Where no jvp ran after all (no input
    carried a tangent), `settle` runs the plain pass (`plain`) into them.

    The tensors are filled through `.data`, which leaves their version alone: autograd has
    saved them (the forward's statistics) and the values are the ones it was promised."""

    def __init__(self, plain: str, sums: Optional[ForwardSums] = None) -> None:
        self.plain = plain
        self.results: Optional[tuple] = None
        self.filled = False
        self.sums = sums  # the forward's: what its fused pass leaves the backward's (`ForwardSums`)

    def hold(self, call: AttentionCall, inputs: dict) -> tuple:
        self.results = empty_results(self.plain, call, inputs)
        return self.results

    def fill(self, results: tuple) -> None:
        with regime.functorch_disabled(), torch.no_grad():
            for held, result in zip(self.results, results):
                result = _plain(result)
                if result.numel() and result.data_ptr() == held.data_ptr() and result.shape == held.shape:
                    continue  # the pass wrote this one in place (`_final` with sums)
                held.data.copy_(result)
        self.filled = True

    def rest(self, results: tuple) -> tuple:
        """The fused pass's results after the primal ones: the tangents."""
        rest = results[len(self.results):]
        return rest[0] if len(rest) == 1 else rest

    def settle(self, options: AttentionCall, slots: tuple | list, **inputs: Any) -> None:
        """Fill the results if no jvp did, then let go of them: they are the Function's
        outputs, and this object stays on its ctx, whose node they point back to. A cycle
        through autograd's C++ graph, which Python's collector cannot see, would keep the
        whole step alive."""
        if not self.filled:
            with regime.functorch_disabled(), torch.no_grad():
                plain = {name: _plain(t) for name, t in inputs.items()}
                call = options.with_tensors([_plain(t) for t in slots])
                self.fill(run_op(self.plain, call, **plain))
        self.results = None

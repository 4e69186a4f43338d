"""The gradient formulas of each flavor, as text for the terminal (`attngrad formulas`).

Each step pairs a forward line with the backward lines that undo it, in the order the
backward runs (last forward line first), as in attngrad.reference. docs/derivation.md
derives every line; the symbols are those of its notation table.
"""

from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    forward: str
    backward: tuple[str, ...]


NOTATION = (
    "B batch · H heads · Hkv key/value heads · Lq query length · Lk key length",
    "E = d_model · dk, dv head widths (dk = dv = E/H in MHA) · γ = 1/√dk",
    "X (B,Lq,E) query input · M (B,Lk,E) key/value input (= X in self-attention, the encoder memory in cross-attention)",
    "W^Q, W^K, W^V, W^O (torch layout, y = x Wᵀ + b) · b^Q, b^K, b^V, b^O · Bias: additive attention bias",
    "dZ = ∂L/∂Z for a scalar loss L · ⊙ elementwise · rowsum over keys · Σ_b sum over batch (and length)",
)

SDPA = (
    Step("S = γ Q Kᵀ + Bias,  masked entries -∞", ("dQ = γ dS K", "dK = γ dSᵀ Q", "dBias = dS summed over its broadcast axes")),
    Step("P = softmax_rows(S)   (a row with no key: P = 0)", ("dS = P ⊙ (dP − rowsum(dP ⊙ P))   (masked entries: P = 0, so dS = 0)",)),
    Step("P' = P ⊙ keep / (1 − p)   (dropout)", ("dP = dP' ⊙ keep / (1 − p)",)),
    Step("O = P' V", ("dP' = dO Vᵀ", "dV = P'ᵀ dO")),
)

PROJECTIONS = (
    Step("Q = X W^Qᵀ + b^Q,  split into H heads", ("dW^Q = Σ_b dQᵀ X", "db^Q = Σ_b dQ", "dX via Q = dQ W^Q")),
    Step("K = M W^Kᵀ + b^K,  split into Hkv heads", ("dW^K = Σ_b dKᵀ M", "db^K = Σ_b dK = 0   (b^K shifts each score row by q_i·b^K: softmax ignores it)", "dM via K = dK W^K")),
    Step("V = M W^Vᵀ + b^V,  split into Hkv heads", ("dW^V = Σ_b dVᵀ M", "db^V = Σ_b dV", "dM via V = dV W^V")),
    Step("Y = concat_h(O) W^Oᵀ + b^O", ("dO = dY W^O, split into heads", "dW^O = Σ_b dYᵀ concat_h(O)", "db^O = Σ_b dY")),
)

OPTIONS = {
    "causal": "causal mask: query i sees keys j ≤ i (top-left aligned); P and dS are 0 above the diagonal",
    "padding": "key padding: padded keys get P = 0, so dS = 0 there; their rows of dK, dV get only what other rows send",
    "bias": "additive bias: dBias = dS, summed over every axis the bias was broadcast along",
    "gqa": "grouped-query heads: K, V repeated over G = H/Hkv query heads; dK, dV sum the G copies of each head",
    "dropout": "dropout: the same keep-mask in forward and backward; dP = dP' ⊙ keep / (1 − p)",
}

FLAVORS = {
    "sdpa": ("scaled dot-product attention", "Q (B,H,Lq,dk), K (B,Hkv,Lk,dk), V (B,Hkv,Lk,dv) given", ("causal", "bias", "gqa", "dropout")),
    "encoder": ("encoder self-attention", "Q, K, V all from X:  dX = dX via Q + dX via K + dX via V", ("padding", "bias", "gqa", "dropout")),
    "decoder": ("decoder masked self-attention", "Q, K, V all from X, causal mask:  dX = dX via Q + dX via K + dX via V", ("causal", "padding", "bias", "gqa", "dropout")),
    "cross": ("encoder-decoder attention", "Q from the decoder stream X, K and V from the encoder memory M:  dX = dX via Q;  dM = dM via K + dM via V", ("padding", "bias", "gqa", "dropout")),
}


def steps(flavor: str) -> tuple[Step, ...]:
    """The forward/backward steps of one flavor, forward order."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; choose from {', '.join(FLAVORS)}")
    if flavor == "sdpa":
        return SDPA
    return PROJECTIONS[:3] + SDPA + PROJECTIONS[3:]

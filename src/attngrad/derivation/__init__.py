"""attngrad.derivation: the seeds' own forms of the gradient, as code, and what the docs show.

- head_selector: the Q&A answer's per-head formulas with a head-selector matrix (seed 001)
- chain_rule: the exercise sheet's chain-rule sums and computation graph (seed 002)
- element_jacobians: the math Q&A's element Jacobians (seed 003)
- defects: the seed notebook's and the blog check's mistakes, demonstrated (needs torch)
- formulas: the formulas printed by `attngrad formulas`

docs/derivation.md derives each and runs them against attngrad.reference.
"""

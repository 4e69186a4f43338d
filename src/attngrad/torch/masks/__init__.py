"""Masks in every form the op takes, and what is made from them once: structured masks as
per-row key bounds (`structured`), masks given as functions (`functions`, FlexAttention's
`mask_mod`) and their evaluations kept between calls (`memo`), a boolean mask kept per block
(`blocks`), the map of which score tiles a call skips (`block_map`), and the cache of values
made from a tensor while its version counter stays (`version_cache`). Nothing here computes
attention or imports the op."""

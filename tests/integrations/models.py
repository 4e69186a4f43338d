"""Tiny random transformers models (no downloads), each with inputs that exercise its mask,
and an exact float64 reference attention to hold attngrad's against.

transformers' own eager attention computes its softmax in float32 for many models (and
gives NaN for left-padded rows in float64), so the reference here is the definition in
float64: transformers' dense SDPA mask, scores with T5's bias, Gemma 2's cap and GPT-OSS's
sinks, softmax, times V; a row with no key gives 0, as attngrad's do.
"""

from __future__ import annotations

import math

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngrad.integrations.transformers import register

REFERENCE = "dense_float64_reference"
VOCAB, LENGTH = 61, 11


def reference_mask(**kwargs):
    """transformers' SDPA mask, always written out: (B, 1, Lq, Lk) boolean, True = attend."""
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        softcap=None, s_aux=None, position_bias=None, **_):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        attention_mask = torch.ones(scores.shape[-2:], dtype=torch.bool)
        if causal and query.shape[-2] > 1:
            attention_mask = attention_mask.tril()
    scores = scores.masked_fill(~attention_mask, -math.inf)
    empty = ~attention_mask.any(dim=-1, keepdim=True)
    if s_aux is not None:
        sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.masked_fill(empty, 0.0), sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    probs = probs.masked_fill(empty, 0.0)
    return (probs @ value).transpose(1, 2).contiguous(), None


def register_both() -> None:
    register()
    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, reference_mask)


def _ids(batch, length, seed):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _padding(batch, length, kept, left):
    """(batch, length) 0/1: `kept[b]` real tokens, padded on the left or the right."""
    position = torch.arange(length)[None, :]
    kept = torch.tensor(kept)[:, None]
    return (position >= length - kept if left else position < kept).long()


SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0)


def llama():
    """GQA (4 query heads over 2) and left padding."""
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2)
    inputs = dict(input_ids=_ids(2, LENGTH, 1), attention_mask=_padding(2, LENGTH, [LENGTH - 4, LENGTH], left=True))
    return transformers.LlamaForCausalLM, config, inputs


def llama_packed():
    """Three packed sequences in one row, found from position ids (no attention_mask)."""
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2)
    position_ids = torch.cat([torch.arange(4), torch.arange(5), torch.arange(LENGTH - 9)])[None]
    # without a cache, as in training: transformers looks for packing only then
    return transformers.LlamaForCausalLM, config, dict(input_ids=_ids(1, LENGTH, 2), position_ids=position_ids, use_cache=False)


def bert():
    """Bidirectional, right padding."""
    config = transformers.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = dict(input_ids=_ids(2, LENGTH, 3), attention_mask=_padding(2, LENGTH, [6, LENGTH], left=False))
    return transformers.BertForMaskedLM, config, inputs


def t5():
    """Relative position bias (with its gradient), an encoder with padding, a causal decoder."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
                                   decoder_start_token_id=0)
    inputs = dict(input_ids=_ids(2, LENGTH, 4), attention_mask=_padding(2, LENGTH, [7, LENGTH], left=False),
                  decoder_input_ids=_ids(2, 6, 5))
    return transformers.T5ForConditionalGeneration, config, inputs


def bart():
    """Cross-attention over a padded encoder output (Lq != Lk)."""
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                     decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, pad_token_id=1)
    inputs = dict(input_ids=_ids(2, LENGTH, 6), attention_mask=_padding(2, LENGTH, [5, LENGTH], left=False),
                  decoder_input_ids=_ids(2, 7, 7))
    return transformers.BartForConditionalGeneration, config, inputs


def mistral():
    """A sliding window of 4 keys over 11, GQA, left padding."""
    config = transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=4)
    inputs = dict(input_ids=_ids(2, LENGTH, 8), attention_mask=_padding(2, LENGTH, [LENGTH - 2, LENGTH], left=True))
    return transformers.MistralForCausalLM, config, inputs


def qwen2():
    """Biased query, key and value projections; a sliding layer over a full one; right padding."""
    config = transformers.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1)
    inputs = dict(input_ids=_ids(2, LENGTH, 14), attention_mask=_padding(2, LENGTH, [LENGTH, LENGTH - 3], left=False))
    return transformers.Qwen2ForCausalLM, config, inputs


def gemma2():
    """Soft-capped scores (cap 2, so that it bends them), sliding and full layers."""
    config = transformers.Gemma2Config(**{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=2, head_dim=8,
                                       sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=8)
    inputs = dict(input_ids=_ids(2, LENGTH, 9), attention_mask=_padding(2, LENGTH, [LENGTH - 3, LENGTH], left=True))
    return transformers.Gemma2ForCausalLM, config, inputs


def gpt_oss():
    """Attention sinks, sliding and full layers, mixture of experts."""
    config = transformers.GptOssConfig(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                       num_local_experts=4, num_experts_per_tok=2)
    inputs = dict(input_ids=_ids(2, LENGTH, 10), attention_mask=_padding(2, LENGTH, [LENGTH - 3, LENGTH], left=True))
    return transformers.GptOssForCausalLM, config, inputs


def gemma3_images():
    """Image tokens that see each other both ways inside a causal mask (transformers joins the
    two with or_masks), sliding and full layers, a SigLIP vision tower, left padding."""
    text = transformers.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=2, head_dim=8,
                                         sliding_window=4, query_pre_attn_scalar=8)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    ids = torch.randint(3, VOCAB - 3, (2, LENGTH), generator=torch.Generator().manual_seed(11))
    ids[:, 4:8] = VOCAB - 1  # one image of 4 tokens each
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    inputs = dict(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == VOCAB - 1).long(),
                  attention_mask=_padding(2, LENGTH, [LENGTH - 2, LENGTH], left=True))
    return transformers.Gemma3ForConditionalGeneration, config, inputs


def llama4_chunked():
    """Chunked attention (chunks of 4 keys) in alternate layers, mixture of experts, left padding.
    Without the query/key L2 norm, which Llama 4 computes in float32: its rounding would
    blur the float64 comparison of second derivatives."""
    config = transformers.Llama4TextConfig(**SMALL, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=48,
                                           attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
                                           interleave_moe_layer_step=1, use_qk_norm=False)
    inputs = dict(input_ids=_ids(2, LENGTH, 13), attention_mask=_padding(2, LENGTH, [LENGTH - 3, LENGTH], left=True))
    return transformers.Llama4ForCausalLM, config, inputs


MODELS = dict(llama=llama, llama_packed=llama_packed, bert=bert, t5=t5, bart=bart, mistral=mistral, qwen2=qwen2,
              gemma2=gemma2,
              gpt_oss=gpt_oss, gemma3_images=gemma3_images, llama4_chunked=llama4_chunked)


def build(name: str, implementation: str):
    """(model in float64 with random weights of seed 0, its inputs)."""
    model_class, config, inputs = MODELS[name]()
    torch.manual_seed(0)
    # grouped_mm, the default experts kernel, takes no float64: GPT-OSS's experts run eagerly
    experts = dict(experts_implementation="eager") if name in ("gpt_oss", "llama4_chunked") else {}
    model = model_class._from_config(config, attn_implementation=implementation, dtype=torch.float64, **experts)
    with torch.no_grad():  # sinks and other parameters that a config initialises to 0 get values
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.5)
    return model.eval(), inputs

"""attn_implementation="attngrad" in tiny random transformers models, in float64: logits,
every parameter's gradient, a JVP and a gradient penalty's double backward through the
whole model equal those of the exact dense reference (`models`), generate() gives the same
tokens (under torch.inference_mode too), mask functions it does not read (or_masks for Gemma 3's image tokens, Llama 4's
chunks, a function of its own) are evaluated into the same mask as transformers' own, and
a padded Llama and a chunked Llama 4 at L = 4096 make no L x L tensor.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attngrad.integrations.transformers import CompactMask, UnsupportedMask  # noqa: E402

from ..conftest import assert_all_close  # noqa: E402
from .models import MODELS, REFERENCE, build, register_both, sdpa_mask  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_both()


def logits_of(model, inputs, params=None):
    if params is None:
        return model(**inputs).logits
    return torch.func.functional_call(model, params, args=(), kwargs=inputs).logits


def weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def first_and_second_order(model, inputs):
    """logits, every parameter's gradient of <W, logits>, the JVP of the logits along random
    parameter tangents, and the gradient of a gradient penalty sum |grad|^2."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    leaves = [params[n] for n in names]
    logits = logits_of(model, inputs)
    w = weights(logits.shape, 1)
    # allow_unused: a parameter the inputs never reach (Gemma 3's unused vision head) has none
    grads = torch.autograd.grad((logits * w).sum(), leaves, create_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]
    penalty = sum((g * g).sum() for g in grads)
    second = torch.autograd.grad(penalty, leaves, allow_unused=True)
    primals = {n: p.detach() for n, p in params.items()}
    tangents = {n: weights(p.shape, 2 + i) for i, (n, p) in enumerate(primals.items())}
    _, logits_t = torch.func.jvp(lambda ps: logits_of(model, inputs, ps), (primals,), (tangents,))
    results = dict(logits=logits, jvp=logits_t)
    results.update({f"grad {n}": g for n, g in zip(names, grads)})
    results.update({f"penalty grad {n}": g if g is not None else torch.zeros_like(p)
                    for n, g, p in zip(names, second, leaves)})
    return results


@pytest.mark.parametrize("name", list(MODELS))
def test_model_matches_the_exact_reference_to_second_order(name):
    model, inputs = build(name, "attngrad")
    ours = first_and_second_order(model, inputs)
    model.set_attn_implementation(REFERENCE)
    theirs = first_and_second_order(model, inputs)
    assert not any(t.isnan().any() for t in ours.values())
    # a key projection's bias shifts whole rows of scores, which softmax ignores: its gradient
    # is 0 in exact arithmetic and both sides hold rounding noise
    zeros = {n for n in ours if any(part in n for part in ("k_proj.bias", "key.bias", ".k.bias"))}
    assert_all_close(ours, theirs, zeros=zeros)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss", "t5"])
def test_generate_gives_the_reference_tokens(name):
    """Greedy decoding with the cache: one query over all keys so far (the causal diagonal
    moves with the cache), sliding-window caches, left padding, encoder-decoder."""
    model, inputs = build(name, "attngrad")
    inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    ours = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    model.set_attn_implementation(REFERENCE)
    theirs = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_inference_mode_generates_the_reference_tokens_and_training_follows(name):
    """Under torch.inference_mode (pipelines, serving), the masks and their bounds are
    inference tensors, which have no version counter: the tiles make their block maps anew
    each call instead of keeping them (every masked call raised before), and a training
    step after it runs and matches the reference's gradients."""
    model, inputs = build(name, "attngrad")
    with torch.inference_mode():
        ours = model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    model.set_attn_implementation(REFERENCE)
    with torch.inference_mode():
        theirs = model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(ours, theirs)
    grads = {}
    for implementation in ("attngrad", REFERENCE):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(**inputs).logits.square().sum().backward()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if "q_proj" in n}
    assert_all_close(grads["attngrad"], grads[REFERENCE])


def test_masks_reach_attention_compact():
    """The mask function's result for a padded sliding-window layer: a causal diagonal, a
    window and key padding, O(B L) memory."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    model, inputs = build("mistral", "attngrad")
    embeds = model.model.embed_tokens(inputs["input_ids"])
    mask = create_sliding_window_causal_mask(model.config, embeds, inputs["attention_mask"], None)
    assert isinstance(mask, CompactMask)
    assert (mask.is_causal, mask.window) == (0, (3, None))
    assert torch.equal(mask.key_padding, inputs["attention_mask"] == 0)


def _dense(mask: CompactMask, batch: int) -> torch.Tensor:
    """A CompactMask from evaluation written out: (B, 1, Lq, Lk) boolean."""
    return mask.evaluated.dense().expand(batch, 1, mask.q_length, mask.kv_length)


@pytest.mark.parametrize("entries", [7, 1 << 22])
def test_mask_functions_it_does_not_read_are_evaluated_exactly(entries, tuned):
    """or_masks, chunks, blockwise overlays, a function of the test's own and one with holes
    inside rows, with padding and a cache offset: equal to transformers' own SDPA mask,
    as key bounds wherever every row is one interval."""
    from transformers import masking_utils as mu

    from attngrad.integrations.transformers import mask_for_attngrad
    from attngrad.torch.masks import functions

    tuned(functions.EVALUATION, entries=entries)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10])
    blocks = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, -1, -1, -1], [2, 2, -1, 3, 3, 3, -1, -1, 4, 4]])
    cases = [
        (mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function), True),
        (mu.and_masks(mu.causal_mask_function, mu.chunked_overlay(4, torch.tensor([2, 0]))), True),
        (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks)), True),
        (lambda b, h, q, k: (k < 3) | (q >= k), True),
        (lambda b, h, q, k: (q >= k) & ((q - k) % 2 == 0), False),
    ]
    for mask_function, intervals in cases:
        arguments = dict(batch_size=2, q_length=8, kv_length=10, q_offset=2, kv_offset=0,
                         mask_function=mask_function, attention_mask=padding)
        ours = mask_for_attngrad(**arguments)
        theirs = sdpa_mask(**arguments, allow_is_causal_skip=False, use_vmap=True)
        assert ours.evaluated.mask is None and (ours.evaluated.blocks is None) == intervals
        assert torch.equal(_dense(ours, 2), theirs)


def test_models_masks_reach_attention_as_bounds(monkeypatch):
    """Gemma 3's image tokens (or_masks) and Llama 4's chunks are evaluated, into bounds
    (or the causal diagonal), not a mask."""
    from attngrad.integrations import transformers as integration

    made = []
    evaluate = integration.evaluate_mask_function
    monkeypatch.setattr(integration, "evaluate_mask_function", lambda *a, **k: made.append(evaluate(*a, **k)) or made[-1])
    for name in ("gemma3_images", "llama4_chunked"):
        model, inputs = build(name, "attngrad")
        model(**inputs)
    assert len(made) >= 2 and all(m.evaluated.mask is None and m.evaluated.blocks is None for m in made)


def test_a_mask_function_it_has_never_seen(monkeypatch):
    """A model whose mask function is its own (here transformers' causal mask swapped for a
    prefix-LM one, which both the model's mask interface and the reference then get):
    logits, gradients, a JVP and a double backward equal the exact reference."""
    from transformers import masking_utils

    def prefix_lm(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx < 3) | (kv_idx <= q_idx)

    monkeypatch.setattr(masking_utils, "causal_mask_function", prefix_lm)
    model, inputs = build("llama", "attngrad")
    ours = first_and_second_order(model, inputs)
    model.set_attn_implementation(REFERENCE)
    theirs = first_and_second_order(model, inputs)
    zeros = {n for n in ours if "k_proj.bias" in n}
    assert_all_close(ours, theirs, zeros=zeros)


def _long_model(name: str, length: int):
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=length)
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation="attngrad", dtype=torch.float32)
    config = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, attention_chunk_size=512, num_local_experts=2,
                                           num_experts_per_tok=1, max_position_embeddings=length)
    return transformers.Llama4ForCausalLM._from_config(config, attn_implementation="attngrad", dtype=torch.float32,
                                                       experts_implementation="eager")


@pytest.mark.parametrize("name", ["llama", "llama4_chunked"])
def test_a_padded_model_at_4096_makes_no_l_by_l_tensor(name):
    """Every tensor that any operator returns in a forward and backward of a padded Llama
    (its mask read) and a Llama 4 with chunked layers (its mask evaluated) at L = 4096,
    watched at PyTorch's dispatcher: none has L x L elements (a (B, 1, L, L) mask would
    have 2 L^2, SDPA's boolean one among them)."""
    from ..largest_tensor import LargestTensor

    length = 4096
    torch.manual_seed(0)
    model = _long_model(name, length)
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, length, dtype=torch.long)
    padding[0, :1000] = 0

    with LargestTensor() as seen:
        loss = model(input_ids=ids, attention_mask=padding).logits.sum()
        loss.backward()
    assert 0 < seen.numel < length * length


def test_a_window_without_a_mask_is_refused():
    """The window reaches attngrad through the mask; a call without one cannot honour it."""
    from attngrad.integrations.transformers import attention_for_transformers

    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    module = torch.nn.Module()
    with pytest.raises(UnsupportedMask, match="sliding_window"):
        attention_for_transformers(module, q, q, q, None, sliding_window=3)
    out, weights = attention_for_transformers(module, q, q, q, None)
    assert out.shape == (1, 6, 2, 4) and weights is None


def test_a_4d_mask_of_the_callers_own_is_used_as_given():
    """transformers hands a 4-D mask through untouched: boolean as attn_mask, float as a bias."""
    model, inputs = build("llama", "attngrad")
    length = inputs["input_ids"].shape[1]
    keep = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & inputs["attention_mask"].bool()[:, None, None, :]
    compact = model(**inputs).logits
    dense = model(input_ids=inputs["input_ids"], attention_mask=keep).logits
    additive = model(input_ids=inputs["input_ids"],
                     attention_mask=torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -torch.inf)).logits
    real = inputs["attention_mask"].bool()  # padded queries see no key: 0 here, as in the compact call
    assert_all_close(dict(dense=dense[real], additive=additive[real]), dict(dense=compact[real], additive=compact[real]))

"""attn_implementation="attngrad" under `torch.compile(fullgraph=True)`: a training step of
Mistral, Qwen 2, Gemma 2, GPT-OSS and Gemma 3 with image tokens traces into one graph
(Dynamo, the test's cost kept low) with the eager loss and gradients, and Inductor
compiles Llama's, backward included; generate() with a static cache under compile gives
the eager tokens from one graph for the prompt and one for every decoding step.

Float32 (GPT-OSS's default experts kernel takes no float64); compiled and eager differ by
float32 rounding only, as transformers' own eager attention does compiled (measured 1e-6).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from ..conftest import assert_all_close  # noqa: E402
from .models import MODELS, register_both  # noqa: E402

# float32 against float32: the compiled graph sums in another order (decompositions, fusion);
# the largest measured is 1.7e-6 (GPT-OSS through Inductor)
FLOAT32_ROUNDING = 5e-6


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_both()


def float32_model(name: str):
    model_class, config, inputs = MODELS[name]()
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="attngrad", dtype=torch.float32).eval(), inputs


def loss_and_gradients(model, inputs) -> dict:
    model.zero_grad()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=loss.detach(), **grads)


def compiled_matches_eager(name: str, backend: str) -> None:
    if name == "gpt_oss" and Version(transformers.__version__) < Version("5.23"):
        pytest.skip("before transformers 5.23 its grouped_mm experts compile no backward, whatever the attention")
    torch._dynamo.reset()
    model, inputs = float32_model(name)
    eager = loss_and_gradients(model, inputs)
    compiled = loss_and_gradients(torch.compile(model, fullgraph=True, backend=backend), inputs)
    assert compiled.keys() == eager.keys()
    assert_all_close(compiled, eager, zeros={n for n in eager if "k_proj.bias" in n}, bar=FLOAT32_ROUNDING)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "gpt_oss",
                                  pytest.param("gemma3_images", marks=pytest.mark.full)])  # 10 s of compiling
def test_a_training_step_traces_into_one_graph(name):
    """fullgraph: the masks (read eagerly, evaluated when compiled: Dynamo cannot read a
    closure; Gemma 3's or_masks under vmap) and attngrad's op trace without a break."""
    compiled_matches_eager(name, "eager")


def test_inductor_compiles_a_padded_llama_step():
    """Through AOTAutograd (the backward traced too) and Inductor, which fuses the mask's
    evaluation into its row reductions."""
    compiled_matches_eager("llama", "inductor")


@pytest.mark.parametrize("name", ["gemma2"])  # full and sliding layers: both caches
def test_static_cache_generate_compiled_gives_the_eager_tokens(name):
    """generate() makes a static cache's masks before each forward (q_offset a tensor): they
    take a form fixed by their shapes, so the prompt and the decoding steps compile once each."""
    torch._dynamo.reset()
    model, inputs = float32_model(name)
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static")
    eager = model.generate(**inputs, **settings)
    counter = CompileCounterWithBackend("aot_eager")
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    compiled = model.generate(**inputs, **settings)
    assert torch.equal(compiled, eager)
    assert counter.frame_count == 2  # the prompt's graph and the decoding step's

"""Bad input fails at the boundary with a ValueError/TypeError that names the argument and
the shapes; never an IndexError from inside, never NaN, never a silently wrong number."""

import re

import numpy as np
import pytest

from attngrad import reference as ref


@pytest.fixture
def qkv(rng):
    return rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 4, 6, 3)), rng.standard_normal((2, 4, 6, 2))


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (argument names, shapes)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


class TestSDPA:
    def test_wrong_rank(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "query", "(B, H, Lq, dk)", "(4, 5, 3)"):
            ref.sdpa_forward(q[0], k, v)

    def test_batch_mismatch(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "batch size", "(2, 4, 5, 3)", "(1, 4, 6, 3)"):
            ref.sdpa_forward(q, k[:1], v[:1])

    def test_key_value_mismatch(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "key and value", "Lk", "(2, 4, 5, 2)"):
            ref.sdpa_forward(q, k, v[:, :, :5])

    def test_width_mismatch(self, qkv, rng):
        q, k, v = qkv
        with raises(ValueError, "dk", "(2, 4, 6, 4)"):
            ref.sdpa_forward(q, rng.standard_normal((2, 4, 6, 4)), v)

    def test_gqa_needs_enable_gqa(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "H=4", "Hkv=2", "enable_gqa=True"):
            ref.sdpa_forward(q, k[:, :2], v[:, :2])

    def test_heads_not_a_multiple(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "multiple", "H=4", "Hkv=3"):
            ref.sdpa_forward(q, k[:, :3], v[:, :3], enable_gqa=True)

    def test_mask_does_not_broadcast(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "mask", "(5, 5)", "(2, 4, 5, 6)"):
            ref.sdpa_forward(q, k, v, mask=np.ones((5, 5), dtype=bool))

    def test_mask_must_be_boolean(self, qkv):
        q, k, v = qkv
        with raises(TypeError, "mask", "boolean", "float64"):
            ref.sdpa_forward(q, k, v, mask=np.ones((5, 6)))

    def test_bias_does_not_broadcast(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "bias", "(3, 5, 6)", "(B, H, Lq, Lk)"):
            ref.sdpa_forward(q, k, v, bias=np.zeros((3, 5, 6)))

    def test_bias_may_not_grow_the_output(self, qkv):
        q, k, v = qkv
        with raises(ValueError, "bias", "(2, 2, 4, 5, 6)"):
            ref.sdpa_forward(q, k, v, bias=np.zeros((2, 2, 4, 5, 6)))

    @pytest.mark.parametrize("dtype", [np.int64, np.int32, np.complex128, np.float16, np.bool_])
    def test_non_float_inputs(self, qkv, dtype):
        q, k, v = qkv
        with raises(TypeError, "query", str(np.dtype(dtype)), "(2, 4, 5, 3)"):
            ref.sdpa_forward(q.astype(dtype), k, v)

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
    def test_non_finite_inputs(self, qkv, bad):
        q, k, v = qkv
        k = k.copy()
        k[1, 2, 3, 0] = bad
        with raises(ValueError, "key", "(1, 2, 3, 0)"):
            ref.sdpa_forward(q, k, v)

    @pytest.mark.parametrize("bad", [np.nan, np.inf])
    def test_bias_admits_minus_inf_only(self, qkv, bad):
        q, k, v = qkv
        bias = np.zeros((5, 6))
        bias[0, 0] = bad
        with raises(ValueError, "bias", "(0, 0)"):
            ref.sdpa_forward(q, k, v, bias=bias)

    @pytest.mark.parametrize("p", [-0.1, 1.0, 2.0])
    def test_dropout_rate(self, qkv, p):
        with raises(ValueError, "dropout_p", "[0, 1)"):
            ref.sdpa_forward(*qkv, dropout_p=p)

    def test_keep_mask_without_dropout(self, qkv):
        with raises(ValueError, "keep_mask", "dropout_p"):
            ref.sdpa_forward(*qkv, keep_mask=np.ones((2, 4, 5, 6), dtype=bool))

    def test_keep_mask_shape(self, qkv):
        with raises(ValueError, "keep_mask", "(3, 3)"):
            ref.sdpa_forward(*qkv, dropout_p=0.1, keep_mask=np.ones((3, 3), dtype=bool))

    def test_scale_must_be_finite(self, qkv):
        with raises(ValueError, "scale", "nan"):
            ref.sdpa_forward(*qkv, scale=float("nan"))

    def test_dout_shape(self, qkv):
        out, cache = ref.sdpa_forward(*qkv)
        with raises(ValueError, "dout", "(2, 4, 5, 2)", "(2, 4, 5, 3)"):
            ref.sdpa_backward(np.zeros((2, 4, 5, 3)), cache)

    def test_dout_nan(self, qkv):
        out, cache = ref.sdpa_forward(*qkv)
        dout = np.zeros(out.shape)
        dout[0, 0, 0, 0] = np.nan
        with raises(ValueError, "dout", "NaN"):
            ref.sdpa_backward(dout, cache)


E, H = 8, 2


@pytest.fixture
def params(rng):
    return ref.MHAParams.random(E, H, rng=rng)


class TestMHA:
    def test_heads_must_divide_the_width(self, rng):
        with raises(ValueError, "embed_dim", "8", "num_heads=3"):
            ref.MHAParams.random(E, 3)
        params = ref.MHAParams.random(E, H, rng=rng)
        x = rng.standard_normal((2, 3, E))
        with raises(ValueError, "E=8", "num_heads=3"):
            ref.mha_forward(x, x, x, params, 3)

    def test_params_type(self, rng):
        x = rng.standard_normal((2, 3, E))
        with raises(TypeError, "params", "MHAParams", "dict"):
            ref.mha_forward(x, x, x, {"w_q": 1}, H)

    def test_query_width(self, params, rng):
        x = rng.standard_normal((2, 3, E + 1))
        with raises(ValueError, "query", "width 9", "E=8"):
            ref.mha_forward(x, x, x, params, H)

    def test_query_rank(self, params, rng):
        x = rng.standard_normal((3, E))
        with raises(ValueError, "query", "(B, Lq, E)", "(3, 8)"):
            ref.mha_forward(x, x, x, params, H)

    def test_key_value_lengths(self, params, rng):
        x = rng.standard_normal((2, 3, E))
        with raises(ValueError, "Lk", "(2, 4, 8)", "(2, 3, 8)"):
            ref.mha_forward(x, rng.standard_normal((2, 4, E)), x, params, H)

    def test_key_padding_mask_shape_and_dtype(self, params, rng):
        x = rng.standard_normal((2, 3, E))
        with raises(ValueError, "key_padding_mask", "(2, 3)", "(3, 2)"):
            ref.mha_forward(x, x, x, params, H, key_padding_mask=np.zeros((3, 2), dtype=bool))
        with raises(TypeError, "key_padding_mask", "boolean", "int64"):
            ref.mha_forward(x, x, x, params, H, key_padding_mask=np.zeros((2, 3), dtype=np.int64))

    def test_attn_mask_layouts(self, params, rng):
        x = rng.standard_normal((2, 3, E))
        with raises(ValueError, "3-D attn_mask", "(B*H, Lq, Lk)", "(4, 3, 3)", "(2, 3, 3)"):
            ref.mha_forward(x, x, x, params, H, attn_mask=np.zeros((2, 3, 3)))
        with raises(ValueError, "attn_mask", "(3, 4)", "(B, H, Lq, Lk)"):
            ref.mha_forward(x, x, x, params, H, attn_mask=np.zeros((3, 4)))
        with raises(ValueError, "attn_mask", "NaN"):
            ref.mha_forward(x, x, x, params, H, attn_mask=np.full((3, 3), np.nan))

    def test_parameter_shapes(self, params, rng):
        x = rng.standard_normal((2, 3, E))
        bad = ref.MHAParams(**{**dict(params.items()), "w_o": np.zeros((E, E + 1))})
        with raises(ValueError, "w_o", "(8, 9)"):
            ref.mha_forward(x, x, x, bad, H)
        bad = ref.MHAParams(**{**dict(params.items()), "b_v": np.zeros(E + 1)})
        with raises(ValueError, "params.b_v", "(8,)", "(9,)"):
            ref.mha_forward(x, x, x, bad, H)
        bad = ref.MHAParams(**{**dict(params.items()), "b_k": None})
        with raises(ValueError, "all four biases"):
            ref.mha_forward(x, x, x, bad, H)
        bad = ref.MHAParams(**{**dict(params.items()), "w_k": np.zeros((6, E)), "w_v": np.zeros((6, E))})
        with raises(ValueError, "w_k", "(6, 8)", "Hkv * dh"):
            ref.mha_forward(x, x, x, bad, H)
        bad = ref.MHAParams(**{**dict(params.items()), "w_q": np.zeros((E, E), dtype=np.int64)})
        with raises(TypeError, "params.w_q", "int64"):
            ref.mha_forward(x, x, x, bad, H)

    def test_self_attention_needs_kdim_equal_e(self, rng):
        params = ref.MHAParams.random(E, H, kdim=5, rng=rng)
        with raises(ValueError, "kdim = vdim = E", "kdim=5"):
            ref.encoder_self_attention_forward(rng.standard_normal((2, 3, E)), params, H)

    def test_cross_attention_needs_kdim_equal_vdim(self, rng):
        params = ref.MHAParams.random(E, H, kdim=5, vdim=6, rng=rng)
        with raises(ValueError, "kdim must equal vdim", "kdim=5", "vdim=6"):
            ref.encoder_decoder_attention_forward(rng.standard_normal((2, 3, E)), rng.standard_normal((2, 4, 5)), params, H)

    def test_dout_shape(self, params, rng):
        x = rng.standard_normal((2, 3, E))
        out, cache = ref.mha_forward(x, x, x, params, H)
        with raises(ValueError, "dout", "(2, 3, 8)", "(2, 8, 3)"):
            ref.mha_backward(np.zeros((2, 8, 3)), cache)

    def test_state_dict_problems(self, params):
        sd = params.state_dict()
        with raises(ValueError, "unexpected", "extra"):
            ref.MHAParams.from_state_dict({**sd, "extra": np.zeros(1)})
        with raises(ValueError, "out_proj.weight"):
            ref.MHAParams.from_state_dict({k: v for k, v in sd.items() if k != "out_proj.weight"})
        with raises(ValueError, "add_bias_kv"):
            ref.MHAParams.from_state_dict({**sd, "bias_k": np.zeros((1, 1, E))})

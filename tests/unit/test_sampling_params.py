"""SamplingParams validation: every out-of-range value is a ValueError naming the field."""
from __future__ import annotations

import pytest

from kvstrata.protocol import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"stream_interval": 1.5}, "stream_interval"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"the": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"logit_bias": {"٣": 1.0}}, "logit_bias"),  # a digit, but not an ASCII token id
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {2 ** 70: 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias"),
    ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
])
def test_out_of_range_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_from_dict_rejects_unknown_and_normalises_stop():
    with pytest.raises(ValueError, match="unsupported sampling parameter.*top_q"):
        SamplingParams.from_dict({"top_q": 0.5})
    p = SamplingParams.from_dict({"stop": "###", "temperature": 0, "seed": None})
    assert p.stop == ["###"] and p.is_greedy and p.seed is None


def test_logit_bias_keys_become_ints_and_values_clamp_to_100():
    """Clients send the ids as strings (JSON keys); values outside OpenAI's [-100, 100] are
    clamped as vLLM does, so SGLang's "-1e9 bans a token" still bans it."""
    p = SamplingParams.from_dict({"logit_bias": {"5": 3, 7: -1e9, "11": float("inf"),
                                                 "0": -2.5}})
    assert p.logit_bias == {5: 3.0, 7: -100.0, 11: 100.0, 0: -2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams(logit_bias=None).logit_bias == {}

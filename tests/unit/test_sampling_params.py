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
])
def test_out_of_range_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_from_dict_rejects_unknown_and_normalises_stop():
    with pytest.raises(ValueError, match="unsupported sampling parameter.*top_q"):
        SamplingParams.from_dict({"top_q": 0.5})
    p = SamplingParams.from_dict({"stop": "###", "temperature": 0, "seed": None})
    assert p.stop == ["###"] and p.is_greedy and p.seed is None

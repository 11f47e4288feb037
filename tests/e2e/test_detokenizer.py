"""Incremental detokenisation with the real SmolLM2 tokenizer: never half a character,
stop strings trimmed and never streamed early."""
from __future__ import annotations

import pytest

from kvstrata.frontend.detokenizer import Detokenizer, stop_holdback
from kvstrata.frontend.ipc import RegisterDetok
from kvstrata.protocol import FinishReason, RequestOutput


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _out(ids, finished=False, reason=None):
    return RequestOutput("r", ids, finished, reason, 3, 0, 0)


def test_multibyte_characters_never_split(tokenizer):
    text = "héllo 世界 🎉 naïve — ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.register(RegisterDetok("r", []))
    pieces = [detok.process([_out([t], i == len(ids) - 1,
                                  FinishReason("length") if i == len(ids) - 1 else None)])[0].text
              for i, t in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # the emoji is several byte-level tokens: some steps must have held text back
    assert any(p == "" for p in pieces)


def test_stop_string_held_back_and_trimmed(tokenizer):
    text = "The answer is 42. END of story"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.register(RegisterDetok("r", ["END"]))
    streamed = ""
    for i, t in enumerate(ids):
        done = tokenizer.decode(ids[:i + 1]).find("END") >= 0
        out = detok.process([_out([t], done, FinishReason("stop", matched="END") if done
                                  else None)])[0]
        streamed += out.text
        assert "E" not in streamed.split("42.")[-1].strip() or done
        if done:
            break
    assert streamed == "The answer is 42. "


def test_stop_holdback():
    assert stop_holdback("abc </", ["</s>"]) == 2
    assert stop_holdback("abc", ["xyz"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2


@pytest.mark.parametrize("skip", [True, False])
def test_matched_stop_token_is_not_text(tokenizer, skip):
    """SGLang: the stop token a request stopped at (EOS, a stop_token_id) is left out of the
    text -- with skip_special_tokens false an EOS would otherwise show as <|im_end|> -- and
    no_stop_trim (registered with trim_stop_token false) keeps it."""
    ids = tokenizer.encode("Paris.", add_special_tokens=False)
    the = tokenizer.encode(" the", add_special_tokens=False)
    for stop_id, shown in ((2, "<|im_end|>"), (the[0], " the")):
        for trim in (True, False):
            detok = Detokenizer(tokenizer)
            detok.register(RegisterDetok("r", [], skip_special_tokens=skip,
                                         trim_stop_token=trim))
            text = detok.process([_out(ids + [stop_id], True,
                                       FinishReason("stop", matched=stop_id))])[0].text
            hidden = "" if skip and stop_id == 2 else shown
            assert text == "Paris." + ("" if trim else hidden), (stop_id, trim, text)
    # an answer cut by length keeps its last token
    detok = Detokenizer(tokenizer)
    detok.register(RegisterDetok("r", [], skip_special_tokens=skip))
    assert detok.process([_out(ids, True, FinishReason("length"))])[0].text == "Paris."

"""The detokenizer's copy of the launcher's decoder (frontend/tokenizer_loader.py
decoder_spec / DecodeOnlyTokenizer) decodes exactly as transformers' tokenizer does, and is
refused where transformers' decode does more than its backend's."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvstrata.config.model_source import load_tokenizer, resolve_model_path
from kvstrata.frontend.tokenizer_loader import DecodeOnlyTokenizer, decoder_spec


def _random_ids(rng: random.Random, vocab: int, specials: list[int]) -> list[int]:
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
    for _ in range(rng.randrange(3)):  # special tokens anywhere, to test skipping them
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


def _assert_decodes_alike(tok, n: int = 300) -> None:
    spec = decoder_spec(tok)
    assert spec is not None
    ours = DecodeOnlyTokenizer(spec)
    rng = random.Random(0)
    specials = list(tok.all_special_ids) or [0]
    for _ in range(n):
        ids = _random_ids(rng, len(tok), specials)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert ours.decode(specials[0]) == tok.decode(specials[0])  # one id, as an int


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(resolve_model_path("smollm2-135m"))  # from the GGUF file


def test_smollm2_decodes_alike(smollm2_tokenizer):
    _assert_decodes_alike(smollm2_tokenizer)
    text = "Héllo, wörld! 你好 <|im_start|>"  # multi-byte characters, a special token
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert DecodeOnlyTokenizer(decoder_spec(smollm2_tokenizer)).decode(ids) == text


def test_tokens_added_after_loading_travel_with_the_copy(smollm2_tokenizer):
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_x>"]})
    tok.add_tokens(["zzqq"])  # a plain added token: kept when skipping specials
    new_ids = tok.convert_tokens_to_ids(["<tool_x>", "zzqq"])
    ours = DecodeOnlyTokenizer(decoder_spec(tok))
    for skip in (False, True):
        ids = [new_ids[0], 28, new_ids[1], 30]
        assert ours.decode(ids, skip_special_tokens=skip) == tok.decode(ids,
                                                                        skip_special_tokens=skip)
    assert "<tool_x>" not in ours.decode([new_ids[0], 28], skip_special_tokens=True)


def _wordpiece(**kwargs) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[SEP]": 1, "a": 2, "b": 3, ",": 4, "'": 5, "s": 6, "##b": 7, ".": 8}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   sep_token="[SEP]", **kwargs)


def test_space_clean_up_keeps_transformers():
    """A non-BPE tokenizer that cleans up spaces after decoding ("a , b" -> "a, b") is
    decoded by transformers itself; without the clean-up the copy decodes alike."""
    cleaning = _wordpiece(clean_up_tokenization_spaces=True)
    assert cleaning.decode([2, 4, 3, 5, 6, 8]) != Tokenizer.from_str(
        cleaning.backend_tokenizer.to_str()).decode([2, 4, 3, 5, 6, 8])  # the case is real
    assert decoder_spec(cleaning) is None
    _assert_decodes_alike(_wordpiece(clean_up_tokenization_spaces=False), n=50)


def test_a_tokenizer_class_with_its_own_decode_keeps_transformers(smollm2_tokenizer):
    class Custom(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    custom = Custom(tokenizer_object=smollm2_tokenizer.backend_tokenizer)
    assert decoder_spec(custom) is None
    assert decoder_spec(object()) is None  # not a transformers tokenizer at all

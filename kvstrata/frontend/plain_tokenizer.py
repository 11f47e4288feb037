"""A model's tokenizer loaded with the `tokenizers` library alone, for the api server: the
same token ids, text and chat prompts as transformers' tokenizer of that directory, without
importing transformers (~1.4 s of CPU of the api server's ~2.5 s start, for every server
start).

transformers' generic tokenizer class (TokenizersBackend, alias PreTrainedTokenizerFast)
builds its backend from tokenizer.json and then adjusts it from tokenizer_config.json
(special tokens it adds, a post-processor it writes, truncation, prefix spaces, the Mistral
regex fix, ...). `load_plain_tokenizer` takes only directories where none of those
adjustments changes anything -- a config whose every key is in PLAIN_CONFIG_KEYS, named
special tokens already special added tokens of tokenizer.json, no truncation or padding in
it -- and returns None for any other, which the caller then loads with transformers. The
backend it builds serializes exactly as transformers' (tests/unit/test_plain_tokenizer.py
compares them, and the ids, text and rendered chats, for SmolLM2's and the tests'
tokenizers).
"""
from __future__ import annotations

import json
import os

from kvstrata.frontend.chat_template import render_chat

# tokenizer_config.json keys that change nothing transformers' generic class does to the
# backend or to encode / decode / chat rendering (the named special tokens are checked
# against tokenizer.json's added tokens; max length and padding side act only when a caller
# asks to truncate or pad, which the server never does).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
PLAIN_CONFIG_KEYS = frozenset({
    "backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
    "padding_side", "truncation_side", "model_input_names", "chat_template",
    "clean_up_tokenization_spaces", "added_tokens_decoder", "extra_special_tokens",
    "additional_special_tokens", *SPECIAL_TOKEN_KEYS})
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
NAMED_TOKEN_FLAGS = {"single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": True}


class PlainTokenizer:
    """The api server's tokenizer calls (encode, decode, len, apply_chat_template to text)
    over a tokenizers-library Tokenizer."""

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: str | None):
        self._backend = backend
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template  # --chat-template replaces it

    @property
    def backend_tokenizer(self):
        """The tokenizers-library Tokenizer (its JSON is the detokenizer's decoder)."""
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **variables) -> str:
        """The rendered prompt text (tokenize=False, as the server asks; encode() it without
        special tokens for the ids)."""
        if tokenize:
            raise ValueError("PlainTokenizer.apply_chat_template renders text only: pass "
                             "tokenize=False and encode the text")
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template (give one with "
                             "--chat-template)")
        return render_chat(self.chat_template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens_map, **variables)


def load_plain_tokenizer(path: str) -> PlainTokenizer | None:
    """The directory's tokenizer without transformers, or None where transformers' loading
    could differ from the plain tokenizer.json (the caller falls back to transformers)."""
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if (not isinstance(config, dict) or not os.path.isfile(tokenizer_file)
            or config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES
            or config.get("backend", "tokenizers") != "tokenizers"
            or not set(config) <= PLAIN_CONFIG_KEYS
            or config.get("extra_special_tokens") or config.get("additional_special_tokens")
            or os.path.isdir(os.path.join(path, "additional_chat_templates"))):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(tokenizer_file)
    if backend.truncation is not None or backend.padding is not None:
        return None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers' decode would clean up spaces (it skips that for BPE)
    added = backend.get_added_tokens_decoder()
    special_tokens = _named_special_tokens(config, added)
    if special_tokens is None or not _same_added_tokens(config.get("added_tokens_decoder"),
                                                        added):
        return None
    template = _chat_template(path, config)
    if template is False:
        return None
    if backend.post_processor is None:
        # transformers writes this one (its update_post_processor without BOS / EOS)
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                    special_tokens=[])
    return PlainTokenizer(backend, special_tokens, template)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _named_special_tokens(config: dict, added: dict) -> dict[str, str] | None:
    """bos_token, eos_token, ... as the template sees them; None when one is not a special
    added token of tokenizer.json with the same flags (transformers would add or change it)."""
    by_content = {tok.content: tok for tok in added.values()}
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if value is None:
            continue
        content = value.get("content") if isinstance(value, dict) else value
        tok = by_content.get(content) if isinstance(content, str) else None
        # what transformers (re-)adds: a string as a special, unnormalized token
        want = {**NAMED_TOKEN_FLAGS, **(value if isinstance(value, dict) else {})}
        if tok is None or any(want[flag] != getattr(tok, flag) for flag in ADDED_TOKEN_FLAGS):
            return None
        out[key] = content
    return out


def _same_added_tokens(declared: dict | None, added: dict) -> bool:
    """tokenizer_config.json's added_tokens_decoder names only tokenizer.json's own added
    tokens, flags and all (otherwise transformers adds or alters tokens)."""
    for index, entry in (declared or {}).items():
        tok = added.get(int(index))
        if (tok is None or not isinstance(entry, dict) or entry.get("content") != tok.content
                or any(key in entry and entry[key] != getattr(tok, key)
                       for key in ADDED_TOKEN_FLAGS)):
            return False
    return True


def _chat_template(path: str, config: dict) -> str | None | bool:
    """The chat template transformers would use (chat_template.jinja before the config's
    string); False for a form this loader leaves to transformers (a list of named ones)."""
    try:
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        pass
    template = config.get("chat_template")
    return template if template is None or isinstance(template, str) else False

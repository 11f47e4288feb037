"""The api server's tokenizer without transformers (frontend/plain_tokenizer.py,
frontend/chat_template.py) against transformers' own tokenizer of the same directory: the
same backend (its JSON), vocabulary size, token ids, text, and rendered chat prompts for
SmolLM2 (its GGUF file's tokenizer) and the tests' tiny checkpoints (which save SmolLM2's),
the same template environment (filters, globals, sandbox, loop controls, the generation
marker) on templates written to use each, and a fallback to transformers wherever its
loading would change the backend. Under --skip-tokenizer-init the vocabulary size comes from
config.json, again without transformers."""
from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvstrata.config.model_source import resolve_model_path, tokenizer_dir
from kvstrata.entrypoints.api.chat_prompt import TEMPLATE_CALL_PARAMETERS
from kvstrata.frontend.plain_tokenizer import PlainTokenizer, load_plain_tokenizer
from kvstrata.frontend.tokenizer_loader import decoder_spec

TEXTS = ["", "Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
         "héllo wörld — ünïcödé 你好 🙂", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x",
         "1234567890 3.14159", "def f(x):\n    return x ** 2\n"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Café? 🙂"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "Done.", "reasoning_content": "step one"},
     {"role": "user", "content": "And now?"}],
]


@pytest.fixture(scope="module", params=["smollm2_gguf", "saved_copy"])
def tokenizer_dir_path(request, tmp_path_factory) -> str:
    """SmolLM2's tokenizer as its GGUF file gives it, and as the tests' tiny checkpoints save
    it (tests/e2e/conftest.py, kvstrata/bench/tiny_dsa.py: save_pretrained)."""
    try:
        path = tokenizer_dir(resolve_model_path("smollm2-135m"))
    except ValueError as e:
        pytest.skip(str(e))
    if request.param == "saved_copy":
        out = str(tmp_path_factory.mktemp("saved_tok"))
        PreTrainedTokenizerFast.from_pretrained(path).save_pretrained(out)
        path = out
    return path


@pytest.fixture(scope="module")
def both(tokenizer_dir_path):
    ours = load_plain_tokenizer(tokenizer_dir_path)
    assert isinstance(ours, PlainTokenizer), "the plain loader refused SmolLM2's tokenizer"
    return ours, PreTrainedTokenizerFast.from_pretrained(tokenizer_dir_path)


def test_same_backend_vocabulary_and_specials(both):
    ours, theirs = both
    assert json.loads(ours.backend_tokenizer.to_str()) == \
        json.loads(theirs.backend_tokenizer.to_str())
    assert len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    # the detokenizer's decoder copy is the one transformers' tokenizer gives
    assert decoder_spec(ours) == decoder_spec(theirs)


def test_same_ids_and_text(both):
    ours, theirs = both
    for text in TEXTS:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == \
                theirs.encode(text, add_special_tokens=special), (text, special)
    rng = random.Random(3)
    specials = list(theirs.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 20))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert ours.decode(specials[0]) == theirs.decode(specials[0])


def _outcome(call):
    """call()'s text, or its exception's type and message (a template that fails on a chat
    must fail alike)."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - compared, not handled
        return type(e), str(e)


def test_same_rendered_chats(both):
    ours, theirs = both
    for chat in CHATS:
        for kwargs in ({}, {"tools": [WEATHER]}, {"enable_thinking": False}):
            for gen in (False, True):
                want = _outcome(lambda: theirs.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=gen, **kwargs))
                got = _outcome(lambda: ours.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=gen, **kwargs))
                assert got == want, (chat, kwargs, gen)
                if isinstance(got, str):
                    assert ours.encode(got, add_special_tokens=False) == \
                        theirs.apply_chat_template(chat, add_generation_prompt=gen,
                                                   return_dict=False, **kwargs)


# Templates that use each piece of the environment transformers gives a chat template.
TEMPLATES = [
    # tojson: no HTML escaping, non-ASCII kept, indent / sort_keys; special tokens as variables
    "{{ bos_token }}{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, "
    "sort_keys=true) }}{% endfor %}{{ tools | tojson }}{{ eos_token }}",
    # namespace, dict(), loop controls, whitespace control by trim_blocks / lstrip_blocks
    "{% set ns = namespace(n=0, last='') %}\n{% for m in messages %}\n"
    "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "  {% set ns.n = ns.n + 1 %}{% set ns.last = m.content %}\n"
    "  {% if loop.index > 3 %}{% break %}{% endif %}\n"
    "  {{ dict(role=m.role, n=ns.n) | tojson }}\n{% endfor %}\n{{ ns.n }}:{{ ns.last }}"
    "{% if add_generation_prompt %}<gen>{% endif %}",
    # the generation marker, the reasoning under both names, extra variables
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.thinking }}|"
    "{{ m.reasoning_content }}]{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
    "{% endif %}{% endfor %}{{ enable_thinking }}{{ strftime_now('%Y') }}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_environment_matches_transformers(both, template):
    ours, theirs = both
    chat = [{"role": "system", "content": "<b>&'\"</b>"}, *CHATS[3],
            {"role": "assistant", "content": "ok", "thinking": "é"}]
    for gen in (False, True):
        want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen,
                                          tools=[WEATHER], chat_template=template,
                                          enable_thinking=True)
        got = PlainTokenizer(ours.backend_tokenizer, ours.special_tokens_map, template
                             ).apply_chat_template(chat, tokenize=False,
                                                   add_generation_prompt=gen, tools=[WEATHER],
                                                   enable_thinking=True)
        assert got == want


@pytest.mark.parametrize("template,error", [
    ("{{ raise_exception('no system role') }}", jinja2.TemplateError),
    ("{% set ns = namespace(_x=1) %}", jinja2.exceptions.SecurityError),
    ("{% set ns = namespace() %}{% set ns._y = 1 %}", jinja2.exceptions.SecurityError),
    ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),  # immutable inputs
    ("{{ ''.__class__ }}", jinja2.exceptions.SecurityError),
])
def test_template_errors_match_transformers(both, template, error):
    ours, theirs = both
    chat = CHATS[0]
    for tok in (theirs, PlainTokenizer(ours.backend_tokenizer, {}, template)):
        kwargs = {"chat_template": template} if tok is theirs else {}
        if template == "{{ ''.__class__ }}":  # the sandbox renders an unsafe attribute empty
            assert tok.apply_chat_template(chat, tokenize=False, **kwargs) == ""
            continue
        with pytest.raises(error):
            tok.apply_chat_template(chat, tokenize=False, **kwargs)


def test_reserved_template_variables_are_transformers_parameters():
    """chat_template_kwargs refuses apply_chat_template's parameter names whichever
    tokenizer renders (entrypoints/api/chat_prompt.py)."""
    theirs = set(inspect.signature(PreTrainedTokenizerFast.apply_chat_template).parameters)
    assert TEMPLATE_CALL_PARAMETERS == theirs - {"self"}


def _word_level_dir(path, config: dict | None = None, post_processor: bool = True,
                    added: list[dict] | None = None) -> str:
    """A small WordLevel tokenizer directory with the given tokenizer_config.json entries."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if post_processor:
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                special_tokens=[("<s>", 1)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    base = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "chat_template": "{{ messages[0].content }}"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({**base, **(config or {})}, f)
    return str(path)


@pytest.mark.parametrize("case,config,plain", [
    ("plain", {}, True),
    ("no post-processor", {"__no_post_processor": True}, True),
    ("added tokens as in tokenizer.json", {"added_tokens_decoder": {"1": {
        "content": "<s>", "lstrip": False, "rstrip": False, "single_word": False,
        "normalized": False, "special": True}}}, True),
    ("an added token tokenizer.json lacks", {"added_tokens_decoder": {"7": {
        "content": "<pad>", "special": True}}}, False),
    ("a special token tokenizer.json lacks", {"pad_token": "<pad>"}, False),
    ("a flag transformers applies", {"add_prefix_space": True}, False),
    ("extra special tokens", {"extra_special_tokens": ["<x>"]}, False),
    ("named chat templates", {"chat_template": [{"name": "default", "template": "x"}]}, False),
    ("space clean-up of a WordLevel model", {"clean_up_tokenization_spaces": True}, False),
    ("another tokenizer class", {"tokenizer_class": "LlamaTokenizer"}, False),
])
def test_loads_plain_only_where_transformers_loads_the_same(tmp_path, case, config, plain):
    no_post = config.pop("__no_post_processor", False)
    path = _word_level_dir(tmp_path, config, post_processor=not no_post)
    ours = load_plain_tokenizer(path)
    assert (ours is not None) == plain, case
    if ours is None:
        return
    theirs = PreTrainedTokenizerFast.from_pretrained(path)
    assert json.loads(ours.backend_tokenizer.to_str()) == \
        json.loads(theirs.backend_tokenizer.to_str()), case
    for text in ("hello world", "a b <s> hello", "unknown words"):
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == \
                theirs.encode(text, add_special_tokens=special), (case, text)
    assert ours.decode([1, 3, 4, 2]) == theirs.decode([1, 3, 4, 2])
    assert ours.special_tokens_map == theirs.special_tokens_map


def test_api_server_start_imports_no_transformers():
    """A fresh interpreter loads the api server's tokenizer, the detokenizer's decoder copy
    and the api app without importing transformers (the point of the plain tokenizer), once
    the GGUF file's metadata directory exists (built here if not)."""
    try:
        tokenizer_dir(resolve_model_path("smollm2-135m"))
    except ValueError as e:
        pytest.skip(str(e))
    code = ("import sys, types; from kvstrata.frontend.tokenizer_loader import "
            "load_tokenizer_for, decoder_spec; tok = load_tokenizer_for(types.SimpleNamespace("
            "model_path=sys.argv[1])); decoder_spec(tok); "
            "import kvstrata.entrypoints.api.api_server, kvstrata.entrypoints.launcher; "
            "print(type(tok).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "smollm2-135m"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["PlainTokenizer", "False"]


def test_skip_tokenizer_init_reads_the_vocabulary_size_without_transformers(
        tiny_checkpoints, tmp_path):
    """--skip-tokenizer-init: the api server and the detokenizer need only the vocabulary
    size; config.json gives transformers' config value, and a fresh interpreter reads it
    importing neither transformers nor torch (DeepSeek-V3.2's config class pulled both)."""
    from transformers import AutoConfig

    from kvstrata.config.model_source import config_vocab_size
    from tests.conftest import _tiny_dsa_config

    tiny_dsa_checkpoint = str(tmp_path / "deepseek_v32")  # its config is all that is read
    _tiny_dsa_config().save_pretrained(tiny_dsa_checkpoint)
    for path in (tiny_checkpoints["llama"], tiny_dsa_checkpoint):
        assert config_vocab_size(resolve_model_path(path)) == \
            AutoConfig.from_pretrained(path).vocab_size
    code = ("import sys, types; from kvstrata.frontend.tokenizer_loader import "
            "load_tokenizer_for; tok = load_tokenizer_for(types.SimpleNamespace("
            "model_path=sys.argv[1], skip_tokenizer_init=True)); "
            "print(len(tok), 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, tiny_dsa_checkpoint], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(AutoConfig.from_pretrained(tiny_dsa_checkpoint)
                                      .vocab_size), "False", "False"]

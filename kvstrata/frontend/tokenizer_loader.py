"""Load only the tokenizer (never the weights) for the api server and the detokenizer; the
scheduler's, deferred."""
from __future__ import annotations

import threading


def load_tokenizer_for(server_args):
    """The model's tokenizer; under --skip-tokenizer-init a NoTokenizer (nothing loaded: the
    model needs no tokenizer files). A PlainTokenizer (the `tokenizers` library alone: no
    transformers import) where its directory loads the same without transformers, else
    transformers' tokenizer."""
    from kvstrata.config.model_source import (config_vocab_size, load_tokenizer,
                                              resolve_model_path, tokenizer_dir)
    from kvstrata.frontend.plain_tokenizer import load_plain_tokenizer

    source = resolve_model_path(server_args.model_path)
    if getattr(server_args, "skip_tokenizer_init", False):
        return NoTokenizer(config_vocab_size(source))
    tokenizer_path = getattr(server_args, "tokenizer_path", None)
    tokenizer = (load_plain_tokenizer(tokenizer_dir(source, tokenizer_path))
                 or load_tokenizer(source, tokenizer_path=tokenizer_path))
    template = getattr(server_args, "chat_template", None)
    if template:
        tokenizer.chat_template = chat_template_text(template)
    return tokenizer


def chat_template_text(value: str) -> str:
    """--chat-template: a Jinja file's text, or the template itself (as vLLM takes it);
    ValueError naming the flag when it cannot be read or does not parse."""
    import jinja2

    text = value
    if "{{" not in value and "{%" not in value:
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e.strerror} (give a "
                             "Jinja file or the template text)") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a Jinja template: {e.message} "
                         f"(line {e.lineno})") from None
    return text


class TokenizerSkipped(ValueError):
    """A request needs text on a server started with --skip-tokenizer-init (a 400; `param`
    the field that needs it, where one does)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoTokenizer:
    """The api server's and detokenizer's tokenizer under --skip-tokenizer-init, as SGLang's
    token-in-token-out mode: requests send token ids (/generate input_ids, token-id prompts)
    and get token ids back (`output_ids`) with empty text. It knows the vocabulary size (the
    token id check); text prompts and chat messages raise TokenizerSkipped."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, **kwargs) -> list[int]:
        raise TokenizerSkipped(skipped_message("a text prompt"))

    def apply_chat_template(self, messages, **kwargs):
        raise TokenizerSkipped(skipped_message("chat messages (the chat template)"))

    def decode(self, ids, **kwargs) -> str:
        return ""  # no text out: the ids are the output


def skipped_message(what: str) -> str:
    """The 400's message for a request that needs text under --skip-tokenizer-init."""
    return (f"the server was started with --skip-tokenizer-init: {what} needs a tokenizer; "
            "send token ids (input_ids on /generate, or a token-id prompt on "
            "/v1/completions)")


class DeferredTokenizer:
    """A tokenizer loaded off the start-up path: the scheduler process needs one only to find
    stop strings, and loading it imports transformers (~1.5 s on 2 cores, while the model
    loads). `start_loading()` (after the process reported ready) loads it on a thread; any
    attribute access waits for it (or loads it now), so users see a plain tokenizer."""

    def __init__(self, load):
        self._load = load
        self._first: object = None  # prefer(): a cheaper source tried before `load`
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._value = None
        self._error: BaseException | None = None

    def start_loading(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tokenizer-load",
                                                daemon=True)
                self._thread.start()

    def prefer(self, source) -> None:
        """Try `source()` first (before loading starts): its tokenizer, or None to load."""
        self._first = source

    def _run(self) -> None:
        try:
            value = self._first() if self._first is not None else None
            self._value = value if value is not None else self._load()
        except BaseException as e:  # re-raised to the first user
            self._error = e

    def get(self):
        self.start_loading()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


def decoder_spec(tokenizer) -> str | None:
    """The tokenizers-library JSON of `tokenizer`'s backend when transformers' decode of it is
    exactly the backend's decode, else None.

    transformers' fast tokenizer decodes with its backend (`tokenizers.Tokenizer.decode`) and
    then, for a non-BPE model whose config asks for it, cleans up spaces. The backend is
    what transformers built from the checkpoint's files (added and special tokens, patched
    pre-tokenizers), so a copy of it decodes alike: the detokenizer gets that copy instead of
    importing transformers and building the tokenizer again (~1.2 s of CPU a start)."""
    if isinstance(tokenizer, NoTokenizer):
        return None  # --skip-tokenizer-init: nothing to copy (and no transformers to import)
    from kvstrata.frontend.plain_tokenizer import PlainTokenizer

    if isinstance(tokenizer, PlainTokenizer):  # its decode is its backend's
        return tokenizer.backend_tokenizer.to_str()
    try:
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not PreTrainedTokenizerFast._decode
            or _cleans_up_spaces(tokenizer, backend)):
        return None
    return backend.to_str()


def _cleans_up_spaces(tokenizer, backend) -> bool:
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_"
                     "corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or forced


class DecodeOnlyTokenizer:
    """A tokenizers-library Tokenizer from decoder_spec(), with transformers' decode call
    (the detokenizer's and the stop checker's only use of a tokenizer)."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(spec)

    @property
    def backend_tokenizer(self):
        """The tokenizers-library Tokenizer (grammars build their token table from it, as
        from a transformers fast tokenizer's)."""
        return self._backend

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif not isinstance(token_ids, list):  # the detokenizer's are lists: no copy per call
            token_ids = list(token_ids)
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

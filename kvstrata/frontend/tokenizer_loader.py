"""Load only the tokenizer (never the weights) for the api server and the detokenizer."""
from __future__ import annotations


def load_tokenizer_for(server_args):
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(server_args.model_path),
                          tokenizer_path=getattr(server_args, "tokenizer_path", None))

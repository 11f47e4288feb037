"""kvstrata: an LLM serving engine with a tiered KV cache."""
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.version import __version__
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from kvstrata.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)

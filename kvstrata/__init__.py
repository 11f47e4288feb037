"""kvstrata: an LLM serving engine with a tiered KV cache."""
from kvstrata.protocol.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from kvstrata.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)

"""Our model implementations and their weight loader."""
from kvstrata.runner.models.decoder import ArchSpec, DecoderForCausalLM
from kvstrata.runner.models.loader import load_model
from kvstrata.runner.models.registry import ARCHITECTURES, arch_spec

__all__ = ["ARCHITECTURES", "ArchSpec", "DecoderForCausalLM", "arch_spec", "load_model"]

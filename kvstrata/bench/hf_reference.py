"""Load a checkpoint into transformers (the reference and the benchmark baseline) without our
loader. GGUF goes through transformers' own GGUF reader (dequantise + q/k un-permute) into a
LlamaForCausalLM; from_pretrained(gguf_file=...) would need `accelerate`."""
from __future__ import annotations

import functools


def load_hf_model(model_path: str):
    import torch  # here, not at import: `kvstrata serve` builds this command's parser too
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvstrata.config.model_source import gguf_metadata_dir, resolve_model_path

    source = resolve_model_path(model_path)
    if source.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    # transformers' own config class (the reference must not depend on our reader).
    config = AutoConfig.from_pretrained(gguf_metadata_dir(source))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # transformers asks gguf for the same (arch, layers) name map once per module of the
    # model (~400 times, ~12 s of CPU for SmolLM2); the map is a pure function of its
    # arguments, so a cache changes nothing but the time.
    import gguf

    uncached, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(uncached)
    gguf.GGUFReader = _plain_array_reader()
    try:
        state = load_gguf_checkpoint(source.gguf_path, return_tensors=True,
                                     model_to_load=model)["tensors"]
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = uncached, reader
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.float().eval()


@functools.lru_cache(maxsize=1)
def _plain_array_reader() -> type:
    """gguf's GGUFReader reading its fields through a plain ndarray view of its memmap.

    The reader parses every metadata value (SmolLM2: 49k vocabulary strings, 48k merges) with
    ~250k small slices of `self.data`, an np.memmap whose Python-level __getitem__ took ~60% of
    the 4-5 s parse; a view of the same mapping as a plain ndarray gives the same bytes and
    arrays (tensor data included) in ~1.2 s."""
    import gguf
    import numpy as np

    class PlainArrayReader(gguf.GGUFReader):
        _itemsizes: dict = {}

        def _get(self, offset, dtype, count=1, override_order=None):
            data = self.__dict__.get("_plain")
            if data is None:
                data = self._plain = self.data.view(np.ndarray)
            size = self._itemsizes.get(dtype)
            if size is None:
                size = self._itemsizes[dtype] = np.dtype(dtype).itemsize
            count = int(count)
            arr = data[offset:offset + size * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainArrayReader

"""Our model implementations and their weight loader.

  registry.py       architecture name -> how to build it
  decoder.py        the llama-family decoder (llama, mistral, qwen2, qwen3, phi3, smollm3)
  sandwich.py       OLMo 2 and GLM-4: the decoder with sublayer outputs normed
  gemma.py          Gemma 3 (text) and Gemma 2: the decoder's fused weights, Gemma's layers
  moe_decoder.py    Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 (Glm4Moe): the decoder with
                    expert MLPs (moe.py); the config fields they build: moe_config.py
  gpt_oss.py        gpt-oss: windows and sinks, YaRN, top-k MoE with clamped SwiGLU (moe.py)
  decode_plan.py    a CPU decode step's layers as C calls bound once per batch size
  rope.py           rotary embeddings and their scaling types (linear, llama3, yarn,
                    dynamic, longrope), partial rotary
  deepseek.py       DeepSeek-V2 / V3 (MLA + MoE) and V3.2 (MLA + DSA indexer + MoE; moe.py,
                    the routers and expert dispatch); config and weight names:
                    deepseek_config.py, deepseek_weights.py
  deepseek_mtp.py   DeepSeek's MTP layer as a NEXTN draft head
  qwen3_next_mtp.py Qwen3-Next's and Qwen3.5's MTP layer as a NEXTN draft head
  deepseek_packed.py a DeepSeek model's linears, absorbed heads and FFNs (experts too) on
                    kvstrata's packed linears (runner/cpu/packed_linear.py)
  deepseek_fixed.py deterministic inference: the same on the fixed GEMM, and its rotary table
  deepseek_w8a8.py  --quantization w8a8_int8 on MLA: int8 projections and experts, float router
  hybrid_packed.py  the recurrent hybrids' linears (mixers, attention, MLPs, experts, head) on
                    kvstrata's packed linears (the default on a CPU)
  hybrid_fixed.py   deterministic inference for the recurrent hybrids (Qwen3.5 / Qwen3-Next,
                    Nemotron-H, Mamba2): linears on the fixed GEMM, the pinned recurrent
                    backend, position-free activations, exact rope
  eagle.py, eagle3.py  EAGLE-2 / EAGLE-3 draft heads
  hybrids.py        hybrid recurrent models by architecture, on hybrid_base.py (layer kinds,
                    KV and state components, a weight table): qwen3_next.py (Qwen3-Next,
                    Qwen3.5; gated_deltanet.py its Gated DeltaNet layer), nemotron_h.py
                    (Nemotron-H, Mamba2; nemotron_h_moe.py its MoE block),
                    granite_hybrid.py (Granite-4.0-H) and
                    falcon_h1.py (Falcon-H1: attention and Mamba2 in every layer), whose
                    Mamba2 layer is mamba2_mixer.py
  loader.py         safetensors and GGUF weights (gguf_index.py: a GGUF file's tensor table;
                    gguf_weights.py: its tensors by HF name, dequantized or kept packed;
                    gguf_hybrid_weights.py: a recurrent hybrid's, the converter's
                    transforms undone; gguf_names.py: llama.cpp's block names of the MoE /
                    Phi-3 / OLMo 2 / GLM-4 archs, expert stacks split by expert)
"""
from kvstrata.runner.models.decoder import ArchSpec, DecoderForCausalLM
from kvstrata.runner.models.loader import load_model
from kvstrata.runner.models.registry import ARCHITECTURES, arch_spec

__all__ = ["ARCHITECTURES", "ArchSpec", "DecoderForCausalLM", "arch_spec", "load_model"]

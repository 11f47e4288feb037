"""ServerArgs: every start-up option, in one frozen dataclass.

Flag names, choices and defaults follow SGLang (`--page-size`, `--hicache-mem-layout`, ...):
the CLI flag is the field name with underscores turned into dashes, and the CLI is generated
from these fields (kvstrata.config.cli_args), so each default and help text has one source.

ServerArgs holds what the user *asked for*. Values that depend on the platform or the model
(chunked prefill size, device, HiCache ratio, retraction backup, DSA gates) are filled in by
`kvstrata.config.resolve`, which returns a new frozen `ResolvedArgs` plus the list of changes,
instead of patching this object in place. The flags' choice tuples and `opt` live in
config/arg_choices.py (re-exported here), the value checks in config/arg_checks.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvstrata.config.arg_checks import flag, parse_extra_config, reject_unknown_kwargs, validate
from kvstrata.config.arg_choices import (  # noqa: F401 (re-exported)
    opt, DTYPES, DEVICES, PLATFORMS, LOG_LEVELS, SCHEDULE_POLICIES, RADIX_EVICTION_POLICIES,
    HICACHE_WRITE_POLICIES, HICACHE_IO_BACKENDS, HICACHE_MEM_LAYOUTS,
    HICACHE_HOST_MEMORY_MODES, HICACHE_STORAGE_BACKENDS, HICACHE_PREFETCH_POLICIES,
    DISAGG_MODES, DISAGG_TRANSFER_BACKENDS, RETRACTION_BACKUPS, MAMBA_SSM_DTYPES,
    MAMBA_RADIX_CACHE_STRATEGIES, SPECULATIVE_ALGORITHMS, NGRAM_MATCH_TYPES, GRAMMAR_BACKENDS,
    TOOL_CALL_PARSERS, REASONING_PARSERS, QUANTIZATION_AT_LOAD, QUANTIZATION_FROM_CHECKPOINT,
    QUANTIZATION_BUILT, QUANTIZATIONS, LOAD_FORMATS)


@dataclass(frozen=True)
class ServerArgs:
    # ---- model and engine -------------------------------------------------------------------
    model_path: str = opt("smollm2-135m", "Model name, local directory, or GGUF file.")
    tokenizer_path: str | None = opt(None, "Tokenizer path (default: the model path).")
    chat_template: str | None = opt(
        None, "A Jinja chat template (a file, or the template text) in place of the model's: "
              "e.g. one that shows `tools` to a model whose own template does not.")
    skip_tokenizer_init: bool = opt(False, "Do not load a tokenizer: requests pass token ids "
                                           "and get token ids back (no text; text prompts, "
                                           "chat messages and stop strings are refused).")
    served_model_name: str | None = opt(None, "Model name reported by the API "
                                              "(default: the model path).")
    context_length: int | None = opt(None, "Maximum context length (default: from the model "
                                           "config).")
    dtype: str = opt("auto", "Weight and activation dtype; auto = the checkpoint's half "
                             "dtype on accelerators; on CPU bfloat16 where the CPU has bf16 "
                             "instructions (avx512_bf16, amx_bf16) or AVX2 without AVX-512 "
                             "(up to 2 threads), else float32 (measured: "
                             "docs/configuration.md, rule platform.cpu_dtype).",
                     choices=DTYPES)
    quantization: str | None = opt(None, "Quantize the weights at load (default: none, the "
                                         "float path, or the checkpoint's own scheme). "
                                         "w8a8_int8: int8 per-channel weights and per-token "
                                         "int8 activations for every linear layer, each MoE "
                                         "expert its own int8 layer, routers float (CPU; a "
                                         "GGUF file is dequantized first). gguf: a GGUF "
                                         "file's quantized weights stay in their blocks (Q4_0, "
                                         "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and are multiplied "
                                         "packed (CPU). gptq, awq (and gptq_marlin, "
                                         "awq_marlin, marlin), compressed-tensors, fp8: "
                                         "detected from the checkpoint's quantization_config; "
                                         "naming another method than the checkpoint's is an "
                                         "error.", choices=QUANTIZATIONS)
    load_format: str = opt("auto", "How weights are read. auto: safetensors (or a single "
                                   "pytorch_model.bin) from a directory; a GGUF file "
                                   "dequantized to float (rule gguf_weights.*). gguf: a GGUF "
                                   "file's weights kept quantized (as --quantization gguf). "
                                   "gguf_dequantize: every GGUF weight dequantized to float "
                                   "at load.", choices=LOAD_FORMATS)
    device: str | None = opt(None, "Device to run on (default: detected from the platform).",
                             choices=DEVICES)
    platform: str | None = opt(None, "Platform to resolve for (default: detected). Only "
                                     "meaningful for `kvstrata config --explain`; `serve` "
                                     "refuses a platform other than the detected one.",
                               choices=PLATFORMS)
    random_seed: int | None = opt(None, "Random seed (default: none).")
    enable_deterministic_inference: bool = opt(
        False, "Batch-invariant kernels: a request's tokens and logprobs (greedy, or sampled "
               "with a seed) never depend on its batch, its prefill chunks or where its KV "
               "came from (prefix cache, host tier, storage, a prefill server) "
               "(docs/configuration.md, rule deterministic.*).")
    disable_deterministic_inference: bool = opt(
        False, "Keep the fastest kernel per row count where deterministic inference would "
               "otherwise be the platform's default.")

    # ---- HTTP server --------------------------------------------------------------------------
    host: str = opt("127.0.0.1", "Host the HTTP server binds to.", group="server")
    port: int = opt(30000, "Port of the HTTP server.", group="server")
    api_key: str | None = opt(None, "If set, requests must send `Authorization: Bearer <key>`.",
                              group="server")
    log_level: str = opt("info", "Logging level.", choices=LOG_LEVELS, group="server")
    stream_interval: int = opt(1, "Send a streamed chunk every N decoded tokens.",
                               group="server")
    enable_metrics: bool = opt(True, "Expose Prometheus metrics at /metrics.", group="server")
    watchdog_timeout: float = opt(300.0, "Seconds one scheduler step (one forward) may take; "
                                         "past that the scheduler logs a state dump and the "
                                         "server fails its requests and exits non-zero instead "
                                         "of hanging (kvstrata serve only).", group="server")

    # ---- memory and scheduling --------------------------------------------------------------
    page_size: int = opt(1, "Tokens per KV page.", group="memory")
    max_total_tokens: int | None = opt(None, "KV pool capacity in tokens (default: from "
                                             "memory).", group="memory")
    mem_fraction_static: float | None = opt(None, "Fraction of device memory for weights + KV "
                                                  "pool (default: platform-dependent).",
                                            group="memory")
    swa_full_tokens_ratio: float = opt(
        0.8, "Hybrid SWA memory: tokens of the sliding-window layers' pool per token of the "
             "full-attention layers' pool (SGLang's flag; ignored for an all-SWA model, whose "
             "whole budget goes to the SWA pool).", group="memory")
    disable_hybrid_swa_memory: bool = opt(
        False, "Keep every layer's K/V in one pool, the sliding-window layers' too (by default "
               "a model with windowed layers keeps theirs in a second, smaller pool that drops "
               "out-of-window K/V).", group="memory")
    # Recurrent (SSM / linear-attention) models: SGLang's flags (config/kv_sizing_state.py,
    # config/rules/recurrent.py; docs/configuration.md "Recurrent state").
    max_mamba_cache_size: int | None = opt(
        None, "State slots of a recurrent model's state pool (default: sized by "
              "--mamba-full-memory-ratio).", group="memory")
    mamba_ssm_dtype: str | None = opt(None, "dtype of the SSM state (default: the model's).",
                                      choices=MAMBA_SSM_DTYPES, group="memory")
    mamba_full_memory_ratio: float = opt(
        0.9, "State pool memory / full-attention KV memory: the states get r/(1+r) of the "
             "KV budget.", group="memory")
    mamba_radix_cache_strategy: str = opt(
        "auto", "Prefix cache with state snapshots: no_buffer (page size 1), extra_buffer "
                "(a track slot per request), auto (no_buffer at page size 1).",
        choices=MAMBA_RADIX_CACHE_STRATEGIES, group="memory")
    mamba_track_interval: int | None = opt(
        None, "extra_buffer: snapshot a decoding request's state every N tokens (default: "
              "resolved: the page size; SGLang's 256 at page size 1).", group="memory")
    max_running_requests: int | None = opt(None, "Maximum concurrently running requests.",
                                           group="scheduling")
    max_prefill_tokens: int = opt(16384, "Token budget of one prefill batch.",
                                  group="scheduling")
    chunked_prefill_size: int | None = opt(None, "Max tokens of one prefill chunk; -1 disables "
                                                 "chunking (default: 2048 on CPU, 8192 on "
                                                 "accelerators).", group="scheduling")
    schedule_policy: str = opt("fcfs", "Order of waiting requests (lpm = longest prefix match "
                                       "first, lof = longest output first).", choices=SCHEDULE_POLICIES, group="scheduling")
    schedule_conservativeness: float = opt(1.0, "Scales the reserve of decode tokens kept for "
                                                "running requests (>1 admits fewer).",
                                           group="scheduling")
    enable_priority_scheduling: bool = opt(False, "Schedule by request priority.",
                                           group="scheduling")
    disable_priority_preemption: bool = opt(False, "With priority scheduling, never preempt a "
                                                   "running request for a higher-priority one.",
                                            group="scheduling")
    default_priority_value: int | None = opt(None, "Priority of a request that gives none "
                                                   "(default: the least preferred).",
                                             group="scheduling")
    abort_on_priority_when_disabled: bool = opt(False, "Without priority scheduling, refuse "
                                                       "(503) a request that gives a priority.",
                                                group="scheduling")
    schedule_low_priority_values_first: bool = opt(False, "With priority scheduling, lower "
                                                          "values go first (default: higher).",
                                                   group="scheduling")
    priority_scheduling_preemption_threshold: int = opt(
        10, "A waiting request preempts a running one only if their priorities differ by more "
            "than this.", group="scheduling")
    max_queued_requests: int | None = opt(None, "Bound of the waiting queue: a full queue "
                                                "refuses (503) or, with priority scheduling, "
                                                "evicts its least preferred request.",
                                          group="scheduling")
    tp_size: int = opt(1, "Tensor parallel size: one process per rank, the model's heads, "
                          "MLP width (MoE: routed experts by index) and vocabulary split "
                          "across them.", group="parallelism")
    nnodes: int = opt(1, "Launchers the --tp-size ranks are spread over (one per machine); "
                         "each runs `serve` with its --node-rank.", group="parallelism")
    node_rank: int = opt(0, "This launcher's index among --nnodes (0 runs the HTTP server "
                            "and the scheduler).", group="parallelism")
    dist_init_addr: str | None = opt(None, "host:port where the ranks meet "
                                           "(torch.distributed's store, served by node 0); "
                                           "needed with --nnodes > 1 (default: a free "
                                           "127.0.0.1 port).", group="parallelism")
    # SGLang's flag (its default None: torch's own timeouts); here it bounds the join only,
    # collectives keep --watchdog-timeout.
    dist_timeout: int | None = opt(None, "Seconds start-up waits for every tensor-parallel "
                                         "rank to join the group at --dist-init-addr; a rank "
                                         "still missing then fails start-up, naming it and "
                                         "the address (a rank this launcher started that "
                                         "exits first fails it at once, with its exit code "
                                         "and last lines). Default: --watchdog-timeout.",
                                   group="parallelism")
    dcp_size: int = opt(1, "Decode context parallel size (> 1 enables DCP).",
                        group="parallelism")

    # ---- prefix cache and HiCache -------------------------------------------------------------
    disable_radix_cache: bool = opt(False, "Disable prefix (radix) caching.", group="hicache")
    radix_eviction_policy: str = opt("lru", "Eviction order of the radix cache.",
                                     choices=RADIX_EVICTION_POLICIES, group="hicache")
    enable_hierarchical_cache: bool = opt(False, "Back the device KV cache with a host pool "
                                                 "(L2) and optionally storage (L3).",
                                          group="hicache")
    hicache_ratio: float | None = opt(None, "Host pool size as a multiple of the device pool "
                                            "(default: resolved: 2.0, 1.2 in buffer_only, 0.2 "
                                            "for a decode retraction-only pool).",
                                      group="hicache")
    hicache_size: float = opt(0, "Host pool size in GB per rank; overrides --hicache-ratio "
                                 "when > 0.", group="hicache")
    hicache_write_policy: str = opt("write_through", "When device pages are copied to host.",
                                    choices=HICACHE_WRITE_POLICIES, group="hicache")
    hicache_io_backend: str = opt("kernel", "Device<->host copy mechanism.",
                                  choices=HICACHE_IO_BACKENDS, group="hicache")
    hicache_mem_layout: str = opt("page_first", "Memory layout of the host pool.",
                                  choices=HICACHE_MEM_LAYOUTS, group="hicache")
    hicache_host_memory_mode: str = opt("cache", "cache: L2 is a persistent cache; buffer_only: "
                                                 "L2 only stages transfers to storage.",
                                        choices=HICACHE_HOST_MEMORY_MODES, group="hicache")
    hicache_storage_backend: str | None = opt(None, "L3 storage backend (default: none).",
                                              choices=HICACHE_STORAGE_BACKENDS, group="hicache")
    hicache_storage_prefetch_policy: str = opt("timeout", "When a storage prefetch stops "
                                                          "waiting.",
                                               choices=HICACHE_PREFETCH_POLICIES,
                                               group="hicache")
    hicache_storage_backend_extra_config: str | None = opt(
        None, "Extra storage backend config: a JSON object, or @path to a JSON file.",
        group="hicache")
    hicache_mamba_size_gb: str | None = opt(
        None, "Host memory in GB for recurrent (SSM / linear-attention) models' state "
              "snapshots, carved out of --hicache-size when that is set (default: the host "
              "tier split in proportion to the device bytes of K/V and states; 'auto': one "
              "slot per --chunked-prefill-size tokens of the host K/V tier plus 4 per "
              "running request).", group="hicache")

    # ---- prefill/decode disaggregation ------------------------------------------------------
    disaggregation_mode: str = opt("null", "Role in prefill/decode disaggregation: null (one "
                                           "server does both), prefill (computes the prompt's "
                                           "KV and sends it), or decode (receives it and "
                                           "generates); requests then come through a PD router "
                                           "(docs/disaggregation.md).",
                                   choices=DISAGG_MODES, group="disaggregation")
    disaggregation_transfer_backend: str = opt("tcp", "KV transfer backend between prefill "
                                                      "and decode servers: tcp (built in), "
                                                      "mooncake (Mooncake transfer engine), "
                                                      "fake (moves nothing; decode-side tests "
                                                      "and warm-up only).",
                                               choices=DISAGG_TRANSFER_BACKENDS,
                                               group="disaggregation")
    disaggregation_bootstrap_port: int = opt(8998, "Port of the bootstrap server a prefill "
                                                   "server runs (decode servers reach it there; "
                                                   "give it to the router after the prefill URL).",
                                             group="disaggregation")
    disaggregation_decode_polling_interval: int = opt(
        1, "Decode server: poll the pre-allocation and transfer queues every N scheduler "
           "steps.", group="disaggregation")
    disaggregation_decode_extra_slots: int | None = opt(
        None, "Decode server: extra request slots for requests being pre-allocated or "
              "transferred (default: resolved: 2 x --max-running-requests when that is <= 32, "
              "else 0).", group="disaggregation")
    disaggregation_decode_retraction_backup: str | None = opt(
        None, "Where a retracted decode request's KV is kept (default: resolved: host_pool "
              "where supported, else cpu_tensor).", choices=RETRACTION_BACKUPS,
        group="disaggregation")
    disaggregation_decode_enable_radix_cache: bool = opt(False, "Use a radix cache on the "
                                                                "decode server.",
                                                         group="disaggregation")
    disaggregation_decode_enable_hicache: bool = opt(
        False, "SGLang's spelling of --enable-hierarchical-cache on a decode server (a host "
               "tier behind the decode radix cache).", group="disaggregation")
    disaggregation_decode_enable_offload_kvcache: bool = opt(False, "Offload decode KV to the "
                                                                    "host pool / storage.",
                                                             group="disaggregation")
    num_reserved_decode_tokens: int = opt(512, "Decode server: KV tokens reserved per request "
                                               "for its output when admitting transfers.",
                                          group="disaggregation")

    # ---- structured output (SGLang's flags; docs/api.md "Structured output") ------------------
    grammar_backend: str = opt("llguidance", "Grammar backend of structured output "
                                             "(json_schema, regex, ebnf, response_format): "
                                             "llguidance, or none to refuse them (SGLang's "
                                             "default xgrammar and outlines are not built).",
                               choices=GRAMMAR_BACKENDS)
    constrained_json_whitespace_pattern: str | None = opt(
        None, "Regular expression of the whitespace allowed between JSON tokens under a JSON "
              "schema (default: any JSON whitespace).")
    constrained_json_disable_any_whitespace: bool = opt(
        False, "Under a JSON schema allow no whitespace between JSON tokens (compact JSON).")
    grammar_timeout: float = opt(
        10.0, "Seconds a request's grammar may take to compile in the API server's check "
              "before the request is refused with a 400 naming its field (SGLang's "
              "SGLANG_GRAMMAR_TIMEOUT, 300 there; docs/api.md \"Structured output\").")
    tool_call_parser: str | None = opt(
        None, "The model's tool-call format: chat answers to requests with `tools` are read "
              "into message.tool_calls (docs/api.md \"Tool calling\"). Without it the text "
              "comes back as content (tool_choice required / named answers are read "
              "anyway).", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = opt(
        None, "The model's thinking format: a chat answer's thinking section goes to "
              "message.reasoning_content, the rest to content (docs/api.md \"Reasoning\").",
        choices=REASONING_PARSERS)

    # ---- speculative decoding (SGLang's flags; docs/speculative.md) --------------------------
    speculative_algorithm: str | None = opt(
        None, "Speculative decoding: draft several tokens per step and verify them in one "
              "forward (default: off). NGRAM drafts from an n-gram cache of prompts and "
              "outputs.", choices=SPECULATIVE_ALGORITHMS, group="speculative")
    speculative_draft_model_path: str | None = opt(None, "Draft model (STANDALONE, EAGLE).",
                                                   group="speculative")
    speculative_draft_model_quantization: str | None = opt(
        None, "Quantization of the draft model (default: none; unquant = none).",
        choices=QUANTIZATIONS + ("unquant",), group="speculative")
    speculative_num_steps: int | None = opt(None, "Draft depth: tokens drafted per step "
                                                  "(default: resolved per algorithm).",
                                            group="speculative")
    speculative_eagle_topk: int | None = opt(None, "Branching factor of the draft per step "
                                                   "(1 = a chain; default: resolved).",
                                             group="speculative")
    speculative_num_draft_tokens: int | None = opt(
        None, "Tokens verified per step, the last accepted one included (default: resolved; "
              "with topk 1 it is num_steps + 1).", group="speculative")
    speculative_accept_threshold_single: float = opt(1.0, "Acceptance threshold of one draft "
                                                          "token (1.0 = exact).",
                                                     group="speculative")
    speculative_accept_threshold_acc: float = opt(1.0, "Accumulated acceptance threshold "
                                                       "(1.0 = exact).", group="speculative")
    speculative_token_map: str | None = opt(None, "FR-Spec token map of the draft head.",
                                            group="speculative")
    speculative_disable_by_batch_size: int | None = opt(
        None, "Decode steps with more running requests than this verify no drafts (vLLM's "
              "flag). Default: measured while serving -- per batch-size range, drafts are "
              "verified only while a verified step costs less per token than a plain one.",
        group="speculative")
    speculative_ngram_min_match_window_size: int = opt(
        1, "NGRAM: shortest suffix of the sequence matched in the cache.", group="speculative")
    speculative_ngram_max_match_window_size: int = opt(
        12, "NGRAM: longest suffix of the sequence matched in the cache.", group="speculative")
    speculative_ngram_min_bfs_breadth: int = opt(1, "NGRAM: minimum breadth of the draft "
                                                    "tree.", group="speculative")
    speculative_ngram_max_bfs_breadth: int | None = opt(
        None, "NGRAM: maximum breadth of the draft tree (default: resolved; 1 = one chain).",
        group="speculative")
    speculative_ngram_match_type: str = opt("BFS", "NGRAM: how draft tokens are picked from "
                                                   "the cache.", choices=NGRAM_MATCH_TYPES,
                                            group="speculative")
    speculative_ngram_branch_length: int = opt(18, "NGRAM: how many recent tokens are "
                                                   "inserted into the cache per position.",
                                               group="speculative")
    speculative_ngram_capacity: int = opt(10_000_000, "NGRAM: cache capacity in nodes (the "
                                                      "least recently used are pruned).",
                                          group="speculative")

    # ---- sparse attention ---------------------------------------------------------------------
    enable_hisparse: bool = opt(False, "Hierarchical sparse attention (DSA with host-resident "
                                       "KV).", group="sparse")

    def __post_init__(self) -> None:
        validate(self)

    # -- helpers --------------------------------------------------------------------------------
    @property
    def priority_preemption(self) -> bool:
        # SGLang: preemption is on whenever priority scheduling is, unless explicitly disabled.
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @property
    def dcp_enabled(self) -> bool:
        return self.dcp_size > 1

    def hicache_storage_extra_config(self) -> dict:
        """The parsed --hicache-storage-backend-extra-config ({} when unset)."""
        return parse_extra_config(self.hicache_storage_backend_extra_config)

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


reject_unknown_kwargs(ServerArgs)

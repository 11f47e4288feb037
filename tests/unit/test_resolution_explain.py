"""`kvstrata config --explain`: table, JSON, exit codes; logging; ModelInfo from config."""
from __future__ import annotations

import io
import json
import logging

import pytest

from kvstrata.config import ModelInfo, ServerArgs, explain, explain_main, log_resolutions, resolve
from kvstrata.platform import simulated


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    code = explain_main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_table_lists_rules_and_resolved_values():
    # (HiCache on a decode server needs the decode radix cache: rules/disagg.py)
    code, out, err = run_main(["--platform", "hip", "--disaggregation-mode", "decode",
                               "--disaggregation-decode-enable-radix-cache",
                               "--enable-hierarchical-cache", "--hicache-io-backend", "direct"])
    assert code == 0 and err == ""
    assert "disagg.decode_radix_cache" in out
    assert out.startswith("platform: hip [simulated]\n")
    assert "hicache.layout_io.R2" in out
    assert ("WARNING: Page first layout is not supported with direct IO backend, switching to "
            "page first direct layout") in out
    assert "retraction.backup" in out and "ROCm" in out
    assert "  * hicache_mem_layout = 'page_first_direct'" in out
    assert "  * disaggregation_decode_retraction_backup = 'cpu_tensor'" in out


@pytest.mark.parametrize("platform", ["cuda", "hip", "npu", "xpu", "mps", "cpu"])
def test_json(platform):
    code, out, _ = run_main(["--json", "--platform", platform, "--disaggregation-mode",
                             "decode"])
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"resolved", "resolutions"}
    resolved = data["resolved"]
    assert resolved["dsa_remap_pd_seed_to_local_slots"] is (platform in ("cuda", "hip"))
    assert resolved["dsa_fused_topk"] is (platform in ("cuda", "hip"))
    assert resolved["disaggregation_decode_retraction_backup"] == (
        "cpu_tensor" if platform == "hip" else "host_pool")
    assert "json" not in resolved
    for r in data["resolutions"]:
        assert set(r) == {"field", "old", "new", "rule", "reason"}


def test_invalid_combination_exits_nonzero_with_error_on_stderr():
    code, out, err = run_main(["--enable-hierarchical-cache", "--hicache-mem-layout",
                               "page_head", "--hicache-io-backend", "direct"])
    assert code == 2 and out == ""
    assert "--hicache-mem-layout page_head requires --hicache-io-backend kernel" in err
    code, _, err = run_main(["--page-size", "0"])
    assert code == 2 and "--page-size must be >= 1, got 0" in err


def test_bad_flag_is_argparse_error():
    with pytest.raises(SystemExit) as info:
        run_main(["--no-such-flag"])
    assert info.value.code == 2


def test_explain_function_matches_resolve():
    args = ServerArgs(enable_hierarchical_cache=True)
    data = json.loads(explain(args, "cuda", ModelInfo(), as_json=True))
    resolved, res = resolve(args, simulated("cuda"), ModelInfo())
    assert data["resolutions"] == [r.to_json() for r in res]
    assert data["resolved"]["hicache_ratio"] == resolved.hicache_ratio == 2.0
    assert "resolutions (" in explain(args, simulated("cpu"), ModelInfo())


def test_model_info_from_local_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v32", "kv_lora_rank": 512, "index_topk": 2048}))
    info = ModelInfo.from_model_path(str(tmp_path))
    assert info == ModelInfo(kv_pool_kind="mla", uses_dsa=True)
    assert ModelInfo.from_model_path("smollm2-135m") is None
    assert ModelInfo.from_hf_config({"model_type": "llama"}) == ModelInfo()
    assert ModelInfo.from_hf_config({"model_type": "mamba2"}).has_recurrent_state
    # MLA -> auto retraction backup is cpu_tensor
    code, out, _ = run_main(["--json", "--platform", "cuda", "--model-path", str(tmp_path),
                             "--disaggregation-mode", "decode"])
    assert json.loads(out)["resolved"]["disaggregation_decode_retraction_backup"] == "cpu_tensor"


def test_log_resolutions(caplog):
    _, res = resolve(ServerArgs(enable_hierarchical_cache=True, hicache_io_backend="direct"),
                     simulated("cuda"), ModelInfo(), env={})
    with caplog.at_level(logging.INFO, logger="kvstrata.config"):
        log_resolutions(res)
    assert len(caplog.records) == len(res)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].getMessage().startswith("Page first layout is not supported with direct")


def test_cli_command_table_hooks():
    # the shape the lead's `kvstrata` command table uses: add_arguments(parser) + run(ns)
    import argparse

    from kvstrata.config import add_explain_args, run_explain
    parser = argparse.ArgumentParser()
    add_explain_args(parser)
    ns = parser.parse_args(["--explain", "--json", "--platform", "xpu"])
    ns._run = run_explain  # extra attributes are ignored
    out, err = io.StringIO(), io.StringIO()
    assert run_explain(ns, out, err) == 0
    assert json.loads(out.getvalue())["resolved"]["device"] == "xpu"


RULES = ["gguf_weights.kept", "platform.device", "platform.chunked_prefill_size", "platform.cpu_dtype",
         "hicache.layout_io.R1",
         "hicache.layout_io.R2", "hicache.storage_layout", "hicache.ratio_default",
         "retraction.backup", "retraction.ratio", "dsa.remap_pd_seed", "dsa.fused_topk",
         "disagg.decode_chunk_cache", "disagg.decode_offload", "disagg.decode_hicache", "disagg.decode_radix_cache", "disagg.decode_extra_slots",
         "spec.nextn", "spec.nextn_draft", "spec.auto_shape", "spec.ngram_breadth", "spec.ngram_tokens",
         "spec.ngram_topk", "spec.ngram_steps", "spec.chain", "deterministic.cpu_default",
         "deterministic.kernels", "swa.on", "swa.off", "state.strategy", "state.slots_per_request",
         "state.host_split",
         # sizing, after the model loads (kvstrata/config/kv_sizing.py)
         "kv_plan.whole_pages", "kv_plan.memory_budget", "kv_plan.context_length",
         "kv_plan.sliding_window", "kv_plan.rows", "kv_plan.swa_memory", "kv_plan.state_slots",
         "kv_plan.state_rows", "kv_plan.host_state_slots", "state.track_interval"]


def test_docs_list_every_flag_rule_and_env_var():
    import pathlib
    import re

    from kvstrata import envs
    from kvstrata.config import flag
    root = pathlib.Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "configuration.md").read_text()
    missing = [flag(n) for n in ServerArgs.field_names() if f"`{flag(n)}`" not in doc]
    assert missing == [], "add these flags to docs/configuration.md"
    assert [r for r in RULES if f"`{r}`" not in doc] == []
    assert [v for v in envs.REGISTRY if f"`{v}`" not in doc] == []
    # and the list above is every rule name the rules modules use
    sources = "".join(p.read_text() for p in (root / "kvstrata/config/rules").glob("*.py"))
    sources += (root / "kvstrata/config/kv_sizing.py").read_text()
    sources += (root / "kvstrata/config/kv_sizing_swa.py").read_text()
    sources += (root / "kvstrata/config/kv_sizing_state.py").read_text()
    sources += (root / "kvstrata/config/kv_sizing_host_state.py").read_text()
    used = set(re.findall(r'"((?:gguf_weights|platform|hicache|retraction|dsa|kv_plan|disagg|spec|deterministic|swa|state)\.[A-Za-z_.0-9]+)"',
                          sources))
    assert used == set(RULES)

"""--disaggregation-decode-retraction-backup from the flag to the scheduler, without torch:
resolution (explicit or auto) -> KV sizing (a retraction-only host pool of the resolved
hicache_ratio, resolved layout/IO, host_pool_use "retraction") -> SchedulerConfig, and the
host-pool options a decode server may give without --enable-hierarchical-cache."""
from __future__ import annotations

import pytest

from kvstrata.config import ServerArgs, resolve
from kvstrata.config.kv_plan import KVPlan, mha_components
from kvstrata.config.kv_sizing import ModelKVFacts, size_kv_plan
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.entrypoints.engine_factory import refuse_l2_options_without_hicache

SMOL = ModelKVFacts("mha", mha_components(30, 3, 64, "float32"), max_position_embeddings=8192)
DECODE = {"disaggregation_mode": "decode", "max_total_tokens": 400, "page_size": 4}


def sized(platform="cpu", **kw):
    args, res = resolve(ServerArgs(**kw), platform, env={})
    plan, _ = size_kv_plan(args, SMOL)
    return args, plan, {r.field: r for r in res}


def test_auto_decode_gets_a_backup_only_host_pool_of_0_2():
    args, plan, res = sized(**DECODE)
    assert args.disaggregation_decode_retraction_backup == "host_pool"
    assert args.hicache_ratio == 0.2 and res["hicache_ratio"].rule == "retraction.ratio"
    assert (plan.num_host_pages, plan.host_pool_use) == (20, "retraction")  # 400 x 0.2 / 4
    assert (plan.host_layout, plan.io_backend) == (args.hicache_mem_layout,
                                                   args.hicache_io_backend)
    assert plan.to_json()["host_pool_use"] == "retraction"  # /server_info shows it
    cfg = SchedulerConfig.from_args(args, plan)
    assert cfg.retraction_backup == "host_pool"


def test_hip_auto_is_cpu_tensor_without_a_host_pool():
    args, plan, _ = sized("hip", **DECODE)
    assert args.disaggregation_decode_retraction_backup == "cpu_tensor"
    assert not plan.has_host_pool
    assert SchedulerConfig.from_args(args, plan).retraction_backup == "cpu_tensor"


def test_explicit_host_pool_kept_on_hip_with_its_ratio_and_layout():
    args, plan, res = sized("hip", disaggregation_decode_retraction_backup="host_pool",
                            hicache_ratio=0.5, hicache_mem_layout="page_first_direct",
                            hicache_io_backend="direct", **DECODE)
    assert "disaggregation_decode_retraction_backup" not in res
    assert (plan.num_host_pages, plan.host_layout, plan.io_backend, plan.host_pool_use) == \
        (50, "page_first_direct", "direct", "retraction")
    assert SchedulerConfig.from_args(args, plan).retraction_backup == "host_pool"


@pytest.mark.parametrize("kwargs,message", [
    ({"disaggregation_mode": "prefill"}, "requires --disaggregation-mode decode"),
    ({"disaggregation_mode": "null"}, "requires --disaggregation-mode decode"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_offload_kvcache": True,
      "hicache_storage_backend": "file"}, "mutually exclusive"),
])
def test_explicit_host_pool_validations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(ServerArgs(disaggregation_decode_retraction_backup="host_pool", **kwargs),
                "cpu", env={})


def test_explicit_cpu_tensor_has_no_host_pool():
    args, plan, _ = sized(disaggregation_decode_retraction_backup="cpu_tensor", **DECODE)
    assert not plan.has_host_pool and args.hicache_ratio == 2.0


def test_scheduler_config_host_pool_rules():
    # A page-only decode config: its host pages are the retraction pool.
    cfg = SchedulerConfig(num_pages=8, num_host_pages=4, disaggregation_mode="decode")
    assert cfg.plan.host_pool_use == "retraction" and cfg.retraction_backup == "host_pool"
    assert SchedulerConfig(num_pages=8, disaggregation_mode="decode").retraction_backup == \
        "cpu_tensor"
    with pytest.raises(ValueError, match="cannot use --enable-hierarchical-cache"):
        SchedulerConfig(KVPlan.pages_only(num_pages=8, num_host_pages=8),
                        disaggregation_mode="decode")
    with pytest.raises(ValueError, match="for --disaggregation-mode decode only"):
        SchedulerConfig(KVPlan.pages_only(num_pages=8, num_host_pages=8,
                                          host_pool_use="retraction"))
    with pytest.raises(ValueError, match="host_pool needs a retraction host pool"):
        SchedulerConfig(num_pages=8, disaggregation_mode="decode",
                        disaggregation_decode_retraction_backup="host_pool")
    with pytest.raises(ValueError, match="cpu_tensor needs no retraction host pool"):
        SchedulerConfig(num_pages=8, num_host_pages=4, disaggregation_mode="decode",
                        disaggregation_decode_retraction_backup="cpu_tensor")
    shared = SchedulerConfig(num_pages=8, num_host_pages=8, host_pool_use="hicache",
                             disaggregation_mode="decode",
                             disaggregation_decode_enable_radix_cache=True,
                             disaggregation_decode_retraction_backup="host_pool")
    assert shared.backups_share_host and shared.retraction_backup == "host_pool"
    assert not SchedulerConfig(num_pages=8, num_host_pages=4,
                               disaggregation_mode="decode").backups_share_host
    with pytest.raises(ValueError, match="must be one of cpu_tensor, host_pool"):
        SchedulerConfig(num_pages=8, disaggregation_mode="decode",
                        disaggregation_decode_retraction_backup="disk")


def test_host_pool_options_without_hicache_only_for_a_retraction_pool():
    args = ServerArgs(disaggregation_mode="decode", hicache_ratio=0.5,
                      hicache_mem_layout="layer_first")
    refuse_l2_options_without_hicache(args, retraction_host_pool=True)
    with pytest.raises(ValueError, match="--hicache-ratio needs --enable-hierarchical-cache"):
        refuse_l2_options_without_hicache(args, retraction_host_pool=False)
    policy = ServerArgs(disaggregation_mode="decode", hicache_write_policy="write_back")
    with pytest.raises(ValueError, match="--hicache-write-policy needs"):
        refuse_l2_options_without_hicache(policy, retraction_host_pool=True)


def test_server_info_shows_the_resolved_backend_ratio_and_pool():
    from types import SimpleNamespace

    from kvstrata.entrypoints.engine_factory import server_info_dict, start_up_info
    args, plan, _ = sized(**DECODE)
    engine = SimpleNamespace(server_args=args, kv_plan=plan, resolutions=[])
    info = server_info_dict(args, start_up_info(engine))
    assert info["disaggregation_decode_retraction_backup"] == "host_pool"
    assert info["hicache_ratio"] == 0.2
    assert info["kv_plan"]["host_pool_use"] == "retraction"
    assert info["kv_plan"]["num_host_pages"] == 20

"""HiCache statistics from get_load reach the Prometheus exposition."""
from __future__ import annotations

from kvstrata.metrics import ServerMetrics


def test_hicache_stats_exported():
    m = ServerMetrics("tiny")
    m.set_load({"num_running_reqs": 1, "hicache_host_hit_tokens": 48,
                "hicache_load_gb_per_s": 3.5, "hicache_host_used_tokens": 96})
    text = m.render().decode()
    assert 'kvstrata:hicache{model_name="tiny",stat="host_hit_tokens"} 48.0' in text
    assert 'kvstrata:hicache{model_name="tiny",stat="load_gb_per_s"} 3.5' in text
    assert 'kvstrata:num_running_reqs{model_name="tiny"} 1.0' in text


def test_decode_retraction_counters_follow_the_load_report():
    m = ServerMetrics("tiny")
    load = {"num_decode_retracted": 2, "decode_retractions_total": 3,
            "decode_backups_cpu_tensor": 0, "decode_backups_host_pool": 3,
            "decode_restores_cpu_tensor": 0, "decode_restores_host_pool": 1,
            "decode_backup_bytes": 4096, "decode_backup_exhausted_aborts": 1}
    m.set_load(load)
    m.set_load({**load, "decode_retractions_total": 5, "decode_backups_host_pool": 5,
                "num_decode_retracted": 1})
    text = m.render().decode()
    assert 'kvstrata:num_decode_retracted_reqs{model_name="tiny"} 1.0' in text
    assert 'kvstrata:decode_retractions_total{model_name="tiny"} 5.0' in text
    assert ('kvstrata:decode_retraction_backups_total{backend="host_pool",model_name="tiny"} '
            '5.0') in text
    assert ('kvstrata:decode_retraction_restores_total{backend="host_pool",model_name="tiny"} '
            '1.0') in text
    assert 'kvstrata:decode_retraction_backup_bytes_total{model_name="tiny"} 4096.0' in text
    assert 'kvstrata:decode_retraction_exhausted_aborts_total{model_name="tiny"} 1.0' in text
    # A server without decode retraction exports none of them.
    plain = ServerMetrics("tiny")
    plain.set_load({"num_running_reqs": 1})
    assert "decode_retraction_backups_total{" not in plain.render().decode()


def test_storage_counters_follow_the_load_report():
    m = ServerMetrics("tiny")
    load = {"hicache_storage_hit_tokens": 256, "hicache_storage_miss_tokens": 16,
            "hicache_storage_bytes_read": 4096, "hicache_storage_bytes_written": 8192,
            "hicache_storage_errors": 0, "hicache_storage_prefetch_complete": 1,
            "hicache_storage_prefetch_revoked": 2}
    m.set_load(load)
    m.set_load({**load, "hicache_storage_hit_tokens": 512, "hicache_storage_errors": 1})
    text = m.render().decode()
    assert 'kvstrata:hicache_storage_hit_tokens_total{model_name="tiny"} 512.0' in text
    assert 'kvstrata:hicache_storage_bytes_written_total{model_name="tiny"} 8192.0' in text
    assert 'kvstrata:hicache_storage_errors_total{model_name="tiny"} 1.0' in text
    assert ('kvstrata:hicache_storage_prefetch_total{model_name="tiny",outcome="revoked"} 2.0'
            in text)


def test_storage_backend_misses_and_corrupt_records_reach_metrics():
    """The backend's read misses and checksum failures were in /get_load only (issue 24)."""
    m = ServerMetrics("tiny")
    m.set_load({"hicache_storage_hit_tokens": 0, "hicache_storage_read_misses": 3,
                "hicache_storage_corrupt_records": 2})
    text = m.render().decode()
    assert 'kvstrata:hicache_storage_read_misses_total{model_name="tiny"} 3.0' in text
    assert 'kvstrata:hicache_storage_corrupt_records_total{model_name="tiny"} 2.0' in text

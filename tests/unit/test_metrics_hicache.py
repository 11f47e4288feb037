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

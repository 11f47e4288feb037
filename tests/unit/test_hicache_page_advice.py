"""The start-up warning for HiCache with pages too small for fast host copies."""
from __future__ import annotations

from kvstrata.config.kv_plan import KVPlan
from kvstrata.runner.executors.hicache import page_size_advice


def KVGeometry(num_layers, num_kv_heads, head_dim, page_size, dtype):  # noqa: N802
    return KVPlan.mha(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, page_size=page_size, num_pages=1)


def test_smollm2_page_size_1_warns_and_suggests_16():
    # SmolLM2: 3 kv heads x head dim 64 x fp32 = 768 B per token of one layer.
    msg = page_size_advice(KVGeometry(30, 3, 64, 1, "float32"))
    assert msg is not None
    assert "--page-size 1:" in msg and "768 bytes" in msg and "--page-size 16 or more" in msg


def test_page_size_16_is_quiet():
    assert page_size_advice(KVGeometry(30, 3, 64, 16, "float32")) is None


def test_narrow_heads_suggest_more_than_16():
    # 1 kv head x 32 x bf16 = 64 B per token-layer: 64 tokens reach 4 KiB.
    msg = page_size_advice(KVGeometry(2, 1, 32, 16, "bfloat16"))
    assert "--page-size 64 or more" in msg

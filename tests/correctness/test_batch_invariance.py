"""Deterministic inference's kernels: a row's result is the same bits whatever else shares the
call (config/rules/deterministic.py).

- The fixed linear layers (runner/cpu/fixed_linear.py): every row of an M-row call equals the
  same row run alone, for M = 1..64 and beyond (the GEMV, oneDNN and the AMX split change their
  body with M; the fixed layers must not), bf16 and fp32, padded widths and biases too.
- The int8 layers of --quantization w8a8_int8 (runner/cpu/int8_linear.py): the same, as
  they stand (per-row activation scales, exact int32 sums).
- The paged decode kernel over ranges (paged_decode.py `ends`): a prompt's queries attend in
  one call exactly as each would alone as a decode step, whether its prefix keys were written
  by this forward or read from other pool rows (a cache hit, a transfer), whatever the other
  queries of the call.
- MLA / DSA (runner/attention/mla_fixed.py): latent queries in the same kernel over the
  pool's latent rows (a DSA pool's indexer keys beside them), each query as alone; the DSA
  indexer's scores and its stable top-k, a query's the same in a group of any width.
- The per-head q / k norm (Qwen3): over a view of the fused qkv projection, a token's heads
  normalise to the same bits alone (a contiguous view) and beside others (a strided one).
These tests also run on the emulated AVX-512 / AMX bodies (test_emulated_avx512.py)."""
from __future__ import annotations

import pytest
import torch

from kvstrata.runner.attention.paged_decode import paged_decode
from kvstrata.runner.cpu.fixed_linear import fixed_unsupported
from kvstrata.runner.cpu.packed_linear import PackedLinear
from kvstrata.runner.models.decoder import rms_norm
from kvstrata.runner.quant import w8a8

ROW_COUNTS = list(range(1, 18)) + [24, 31, 32, 33, 48, 63, 64, 65, 100, 130, 257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,bias", [(96, False), (300, True), (176, True)])
def test_fixed_linear_rows_do_not_depend_on_the_row_count(dtype, out_features, bias):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 64, generator=g).to(dtype)
    if fixed_unsupported(weight) is not None:
        pytest.skip(fixed_unsupported(weight))
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    layer = PackedLinear(weight, b, fixed=True)
    x = torch.randn(max(ROW_COUNTS), 64, generator=g).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    assert alone.shape == (x.shape[0], out_features) and alone.dtype == dtype
    for m in ROW_COUNTS:
        assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows differ from one at a time"
    # and it is the layer's product (the padding cut away, the bias added)
    ref = torch.nn.functional.linear(x.double(), weight.double(),
                                     None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 0.05 * ref.abs().max().item()
    assert (alone.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features,bias", [(96, 64, False), (304, 128, True),
                                                            (300, 64, True)])
def test_int8_linear_rows_do_not_depend_on_the_row_count(dtype, out_features, in_features, bias):
    """--quantization w8a8_int8 under deterministic inference (runner/quant/w8a8.py
    check_batch_invariant): kvstrata's int8 GEMM quantises each row alone and sums in int32,
    so a row's bits never depend on the rows beside it -- the plain layer and the fused
    silu(gate) * up alike."""
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    layer = w8a8.int8_kernel()[0](weight, b)
    model = torch.nn.Module()
    model.layer = layer
    try:
        w8a8.check_batch_invariant(model)
    except NotImplementedError as e:  # fbgemm / oneDNN here: refused, as the load does
        pytest.skip(str(e))
    x = torch.randn(max(ROW_COUNTS), in_features, generator=g).to(dtype)
    # and it is the layer's product (a padded width cut back, the bias added), to int8's error
    ref = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert (layer(x).double() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    for fn in (layer, layer.linear_silu_mul):
        if fn(x[:1]) is None:  # a padded width (300 columns) has no fused silu
            continue
        alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
        for m in ROW_COUNTS:
            assert torch.equal(fn(x[:m]), alone[:m]), f"{m} rows differ from one at a time"


def test_fixed_linear_refuses_what_it_cannot_pin():
    reason = fixed_unsupported(torch.zeros(16, 8, dtype=torch.float16))
    assert reason is not None and "float16" in reason
    with pytest.raises(ValueError, match="--enable-deterministic-inference: .*odd input width"):
        PackedLinear(torch.zeros(16, 7), fixed=True)


def _pool(g, slots: int, hkv: int, d: int, dtype):
    return (torch.randn(slots, hkv, d, generator=g).to(dtype),
            torch.randn(slots, hkv, d, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 24)])
def test_prompt_queries_over_ranges_equal_decode_steps(dtype, hq, hkv, d):
    """Three prompts (prefix + new tokens) in one ranges call, beside two decode queries, equal
    every token run alone as a one-token decode over keys 0 .. its position, with the prefix
    at other pool rows (a cache hit) -- bit for bit."""
    g = torch.Generator().manual_seed(hq + d)
    k_cache, v_cache = _pool(g, 900, hkv, d, dtype)
    scale = d ** -0.5
    prompts = [(0, 37), (23, 9), (70, 40)]  # (cached prefix, new tokens)
    decodes = [55, 120]                       # one-token requests' context lengths
    perm = torch.randperm(900, generator=g)
    tables, used = [], 0
    for prefix, new in prompts:
        tables.append(perm[used:used + prefix + new])
        used += prefix + new
    for length in decodes:
        tables.append(perm[used:used + length])
        used += length
    # one call: every prompt token over its request's slot list up to its own position
    slots, begins, ends, queries = [], [], [], 0
    off = 0
    for i, (prefix, new) in enumerate(prompts):
        slots.append(tables[i])
        begins += [off] * new
        ends += [off + prefix + j + 1 for j in range(new)]
        off += prefix + new
        queries += new
    for i, length in enumerate(decodes, start=len(prompts)):
        slots.append(tables[i])
        begins.append(off)
        ends.append(off + length)
        off += length
        queries += 1
    q = (torch.randn(queries, hq, d, generator=g) * 3).to(dtype)
    together = paged_decode(q, k_cache, v_cache, torch.cat(slots).contiguous(),
                            torch.tensor(begins), scale, num_threads=3, ends=torch.tensor(ends))
    # alone: each query a decode step of its own (contiguous starts), on 1 thread
    row = 0
    for i, (prefix, new) in enumerate(prompts):
        for j in range(new):
            keys = tables[i][:prefix + j + 1].contiguous()
            alone = paged_decode(q[row:row + 1], k_cache, v_cache, keys,
                                 torch.tensor([0, keys.numel()]), scale, num_threads=1)
            assert torch.equal(together[row], alone[0]), f"prompt {i} token {j}"
            row += 1
    for i, length in enumerate(decodes, start=len(prompts)):
        alone = paged_decode(q[row:row + 1], k_cache, v_cache, tables[i].contiguous(),
                             torch.tensor([0, length]), scale, num_threads=1)
        assert torch.equal(together[row], alone[0]), f"decode request {i}"
        row += 1


def test_ranges_are_checked():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = _pool(g, 32, 1, 32, torch.float32)
    q = torch.randn(2, 1, 32, generator=g)
    slots = torch.arange(10)
    with pytest.raises(IndexError, match="range 1"):
        paged_decode(q, k_cache, v_cache, slots, torch.tensor([0, 4]), 1.0,
                     ends=torch.tensor([3, 11]))
    with pytest.raises(ValueError, match="starts must have 2 entries"):
        paged_decode(q, k_cache, v_cache, slots, torch.tensor([0, 4, 10]), 1.0,
                     ends=torch.tensor([3, 10]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norm_of_a_token_does_not_depend_on_the_tokens_beside_it(dtype):
    """Qwen3's q_norm reads qkv[:, :q_end].view(t, heads, head_dim): contiguous for one token,
    strided for several (torch's fallback rounded the two differently before the norm copied
    the strided view; a decode step's answer then depended on its batch)."""
    g = torch.Generator().manual_seed(7)
    heads, hd, kv_heads = 4, 24, 2
    qkv = (torch.randn(9, (heads + 2 * kv_heads) * hd, generator=g) * 3).to(dtype)
    weight = torch.randn(hd, generator=g).to(dtype)
    q_end = heads * hd
    for t in (2, 5, 9):
        together = rms_norm(qkv[:t, :q_end].view(t, heads, hd), weight, 1e-6)
        for i in range(t):
            alone = rms_norm(qkv[i:i + 1, :q_end].view(1, heads, hd), weight, 1e-6)
            assert torch.equal(together[i], alone[0]), f"token {i} of {t}"


def _moe_blocks(dtype: torch.dtype) -> dict:
    """A Qwen2-MoE block (softmax router, gated shared expert) and GLM-4.5's (moe.MoE: float32
    sigmoid router with groups, shared experts), 64 experts, top-8, random weights: router
    logits of 600 tokens pass torch's thread grain (32768 elements)."""
    import transformers as tf

    from kvstrata.runner.models.moe import MoE, MoeDims
    from kvstrata.runner.models.moe_decoder import STYLES, SparseMoeBlock

    cpu = torch.device("cpu")
    qwen = tf.Qwen2MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=64,
                             shared_expert_intermediate_size=96, num_experts_per_tok=8)
    glm = MoeDims(hidden_size=128, moe_intermediate_size=64, n_routed_experts=64,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                  norm_topk_prob=True, routed_scaling_factor=2.5)
    blocks = {"qwen2_moe": SparseMoeBlock(qwen, STYLES["qwen2_moe"], 128, dtype, cpu),
              "glm4_moe": MoE(glm, dtype, cpu)}
    g = torch.Generator().manual_seed(7)
    for block in blocks.values():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_moe_block_rows_do_not_depend_on_the_batch(dtype):
    """Deterministic inference's MoE blocks (runner/cpu/fixed_experts.py): a token's output
    is the same bits alone as beside 1..599 others (the first 24 alone; every count's rows
    equal 600 tokens' rows) -- whatever the other tokens route to its
    experts (the fixed GEMM at any row count), the combine in its own top-k order, the sigmoid
    and silu per row. Unpinned (F.linear, torch's sigmoid) the float32 blocks fail this."""
    from kvstrata.runner.cpu.fixed_experts import pin_block

    if fixed_unsupported(torch.zeros(16, 16, dtype=dtype)) is not None:
        pytest.skip(fixed_unsupported(torch.zeros(16, 16, dtype=dtype)))
    x = torch.randn(600, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    for name, block in _moe_blocks(dtype).items():
        pin_block(block)
        with torch.inference_mode():
            full = block(x)
            alone = torch.cat([block(x[i:i + 1]) for i in range(24)])
            assert torch.equal(full[:24], alone), f"{name}: 600 tokens vs one at a time"
            for m in list(range(2, 18)) + [33, 64, 130, 599]:
                assert torch.equal(block(x[:m]), full[:m]), f"{name}: {m} tokens vs 600"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dim", [0, 24])
def test_mla_queries_over_latent_rows_equal_each_alone(dtype, index_dim):
    """mla_fixed.attend: prompt and decode queries [T, H, R + r] in one call over latent rows
    [N, 1, R + r (+ a DSA pool's indexer key)] equal each query alone, bit for bit, and are
    MLA's attention (softmax(q . latent * s) times the latents' first R values)."""
    from kvstrata.runner.attention import mla_fixed

    g = torch.Generator().manual_seed(index_dim + 1)
    heads, rank, rope, scale = 3, 28, 8, 0.3
    rows = torch.randn(400, 1, rank + rope + index_dim, generator=g).to(dtype)
    slots = torch.randperm(400, generator=g)[:90].contiguous()
    begins = torch.tensor([0] * 9 + [30] * 5 + [50])       # a prompt, a chunk, a decode
    ends = torch.tensor(list(range(1, 10)) + list(range(44, 49)) + [90])
    q = (torch.randn(15, heads, rank + rope, generator=g) * 2).to(dtype)
    together = mla_fixed.attend(q, rows, slots, begins, scale, rank, ends=ends)
    for t in range(15):
        keys = slots[begins[t]:ends[t]].contiguous()
        alone = mla_fixed.attend(q[t:t + 1], rows, keys, torch.tensor([0, keys.numel()]),
                                 scale, rank)
        assert torch.equal(together[t], alone[0]), f"query {t}"
        latents = rows[keys, 0, :rank + rope].double()
        probs = torch.softmax(q[t].double() @ latents.T * scale, dim=-1)
        ref = probs @ latents[:, :rank]
        tol = 1e-5 if dtype == torch.float32 else 0.02 * ref.abs().max().item()
        assert (together[t].double() - ref).abs().max().item() <= tol


def test_indexer_scores_and_top_k_do_not_depend_on_the_group():
    """A DSA query's indexer scores (mla_fixed.ordered_index_scores) and its stable top-k
    (dsa_topk `stable`) are the same bits alone, over exactly its keys, as in a decode group
    padded to a longer neighbour's width; exact ties (a score of 0: every head's relu 0) go
    to the earliest positions."""
    from kvstrata.runner.attention import mla_fixed
    from kvstrata.runner.attention.dsa_topk import fused_topk_to_slots

    g = torch.Generator().manual_seed(5)
    n, heads, dim, width, topk = 5, 16, 24, 70, 8
    q = torch.randn(n, heads, dim, generator=g)
    w = torch.randn(n, heads, generator=g)
    keys = torch.randn(1, width, dim, generator=g)
    lengths = torch.tensor([20, 70, 9, 33, 41])
    group = mla_fixed.ordered_index_scores(q, w, keys, dim ** -0.5)
    ref = (w[:, None, :] @ (q @ keys[0].T * dim ** -0.5).relu())[:, 0]
    torch.testing.assert_close(group, ref, atol=1e-4, rtol=1e-5)
    # a decode group reads each query's own key rows ([n, S, Di]): the same bits
    per_query = keys.expand(n, -1, -1).contiguous()
    assert torch.equal(mla_fixed.ordered_index_scores(q, w, per_query, dim ** -0.5), group)
    group[0, 3:17] = 0.0  # ties: 14 zeros, of which some fill the top 8
    group[0, :3] = 5.0
    group[0, 17:20] = -1.0
    table = torch.randperm(500, generator=g)[:width].expand(n, -1)
    chosen = fused_topk_to_slots(group, lengths, table, topk, stable=True)
    assert chosen[0].tolist() == table[0, :8].tolist()
    for i in range(n):
        length = int(lengths[i])
        alone = mla_fixed.ordered_index_scores(q[i:i + 1], w[i:i + 1], keys[:, :length],
                                               dim ** -0.5)
        if i == 0:
            alone = group[:1, :length].clone()
        else:
            assert torch.equal(alone[0], group[i, :length]), f"query {i}"
        picked = fused_topk_to_slots(alone, lengths[i:i + 1], table[i:i + 1, :length], topk,
                                     stable=True)
        assert torch.equal(picked[0], chosen[i]), f"query {i}'s top-k"



def test_unstable_top_k_breaks_ties_by_the_row_width():
    """The control for the stable top-k: torch.topk (the unflagged path) picks or orders
    exactly tied scores differently when the same row is padded to another width (a decode
    group's), so a query's selected slots -- and its attention's sum order -- followed its
    neighbours; the stable sort never does."""
    from kvstrata.runner.attention.dsa_topk import fused_topk_to_slots

    g = torch.Generator().manual_seed(0)
    moved = 0
    for _ in range(40):
        row = torch.randn(30, generator=g).relu()  # about half exact zeros
        row[:3] = 5.0
        for stable in (False, True):
            alone = fused_topk_to_slots(row[None], torch.tensor([30]), torch.arange(30)[None], 8,
                                        stable)
            for width in (40, 64, 300):
                padded = torch.cat([row, torch.full((width - 30,), -1.0)])[None]
                got = fused_topk_to_slots(padded, torch.tensor([30]), torch.arange(width)[None],
                                          8, stable)
                if stable:
                    assert torch.equal(got, alone), f"stable, width {width}"
                else:
                    moved += not torch.equal(got, alone)
    assert moved, "the control did not move: torch.topk kept tied slots in one order"

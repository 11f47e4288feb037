"""Fused CPU element-wise ops (runner/cpu/fused_ops.py) against the torch op sequences they replace:
HF's bf16 RMSNorm (upcast, normalise, downcast, times the weight), the residual add fused
with it, silu(gate) * up and HF's rotary embedding, on every instruction set this CPU has,
strided rows included; the decoder with them on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.cpu import fused_ops as cpu_ops
def hf_rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def bf16_ulps(a, b):
    """Distance in bf16 units in the last place (both bf16)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    return (ia - ib).abs()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("rows,h", [(1, 576), (37, 64), (300, 576), (3, 40)])
def test_rms_norm_bf16_matches_hf(monkeypatch, isa, rows, h):
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(rows + h)
    base = (torch.randn(rows, h + 8, generator=g) * 3).bfloat16()
    x = base[:, 4:4 + h]                      # strided rows (a view)
    w = (torch.randn(h, generator=g) * 0.5 + 1).bfloat16()
    got = cpu_ops.rms_norm(x, w, 1e-5)
    want = hf_rms_norm(x, w, 1e-5)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == want.shape
    # Same roundings; only the fp32 sum order differs, which may move the normalised value
    # across a bf16 rounding boundary (1 ulp), then the weight product's rounding (2): rare.
    ulps = bf16_ulps(got, want)
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 0.01


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])  # avx2: its own rows (n % 8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1536), (33, 64), (400, 1536), (5, 24), (3, 20)])
def test_silu_mul_matches_torch(monkeypatch, isa, dtype, rows, n):
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(rows * n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ops.silu_mul(gate_up)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        ulps = bf16_ulps(got, want)
        assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.01


def hf_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one of q / k: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,nq,nkv,d", [(1, 9, 3, 64), (37, 9, 3, 64), (300, 4, 2, 128),
                                        (5, 2, 1, 24), (6, 3, 1, 16)])  # 16: AVX2 width only
def test_rope_in_place_equals_hf_bit_for_bit(monkeypatch, isa, dtype, t, nq, nkv, d):
    """The q and k heads of a fused qkv row rotated in place, v untouched: the same bits as
    transformers' q * cos + rotate_half(q) * sin (each product rounded, then the sum)."""
    from kvstrata.runner.models.rope import RotaryEmbedding
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(t * d + nq)
    qkv = (torch.randn(t, (nq + 2 * nkv) * d, generator=g) * 2).to(dtype)
    rotary = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 10000.0},
                             torch.device("cpu"))
    positions = torch.randint(0, 4096, (t,), generator=g)
    cos, sin = rotary.plain_cos_sin(positions)
    want = hf_rope(qkv[:, :(nq + nkv) * d].view(t, nq + nkv, d), cos.to(dtype), sin.to(dtype))
    got = qkv.clone()
    assert cpu_ops.rope_(got, nq + nkv, *rotary.cos_sin(positions, dtype))
    assert torch.equal(got[:, :(nq + nkv) * d].view(t, nq + nkv, d), want)
    assert torch.equal(got[:, (nq + nkv) * d:], qkv[:, (nq + nkv) * d:])
    strided = torch.zeros(t, qkv.shape[1] + 8, dtype=dtype)  # rows of a wider buffer
    strided[:, 4:4 + qkv.shape[1]] = qkv
    assert cpu_ops.rope_(strided[:, 4:4 + qkv.shape[1]], nq + nkv,
                         *rotary.cos_sin(positions, dtype))
    assert torch.equal(strided[:, 4:4 + qkv.shape[1]], got)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("rows,h", [(1, 576), (37, 64), (300, 576), (3, 40)])
def test_add_rms_norm_bf16(monkeypatch, isa, rows, h):
    """The residual add (x += y, rounded to bf16 as torch's add_) and HF's RMSNorm of the
    new x, in one pass."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(rows + 7 * h)
    x = (torch.randn(rows, h, generator=g) * 3).bfloat16()
    y = (torch.randn(rows, h, generator=g) * 3).bfloat16()
    w = (torch.randn(h, generator=g) * 0.5 + 1).bfloat16()
    summed = x + y
    got = cpu_ops.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(x, summed)
    ulps = bf16_ulps(got, hf_rms_norm(summed, w, 1e-5))
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 0.01


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("rows,h", [(1, 576), (37, 64), (300, 576), (3, 40)])
def test_rms_norm_f32_matches_hf(monkeypatch, isa, rows, h):
    """fp32 RMSNorm (strided rows) and the residual add fused with it, against HF's op
    sequence and torch's rms_norm: the same products; the sum of squares in another order
    (a few fp32 ulps at most)."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(rows + 3 * h)
    x = (torch.randn(rows, h + 8, generator=g) * 3)[:, 4:4 + h]  # strided rows (a view)
    y = torch.randn(rows, h, generator=g) * 3
    w = torch.randn(h, generator=g) * 0.5 + 1
    got = cpu_ops.rms_norm(x, w, 1e-5)
    want = hf_rms_norm(x, w, 1e-5)
    assert got is not None and got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (h,), w, 1e-5), rtol=2e-6, atol=1e-6)
    x = x.contiguous()
    summed = x + y
    got = cpu_ops.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(x, summed)  # the add is torch's add_, exactly
    torch.testing.assert_close(got, hf_rms_norm(summed, w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("rows,n", [(32, 49152), (5, 17), (3, 1), (7, 100), (6, 8)])
def test_argmax_rows_equals_torch_max(monkeypatch, isa, rows, n):
    """First index of the maximum, as torch.max(dim).indices: ties (across lanes and within
    one), a row of -inf, a max in the masked last block, NaN (its first one), strided rows."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(rows * n)
    wide = torch.randint(0, 4, (rows, n + 9), generator=g).float()  # ties everywhere
    x = wide[:, 3:3 + n]  # rows n + 9 apart
    x[0] = float("-inf")
    if rows > 2:
        x[1, -1] = 7.0  # in the last (masked) block
    if rows > 4 and n > 2:
        x[2, n // 2] = float("nan")
        x[2, n - 1] = float("nan")
        x[3, 1:] = 5.0  # equal maxima in every lane: the lowest index
    if rows > 5 and n % 8:
        x[5, -1] = float("nan")  # only in the AVX2 body's scalar tail
    want = x.max(dim=-1).indices.tolist()
    assert cpu_ops.argmax_rows(x) == want
    assert cpu_ops.argmax_rows(x.contiguous()) == want


def test_unsupported_inputs_fall_back(monkeypatch):
    x = torch.randn(4, 8)
    assert cpu_ops.rms_norm(x.half(), torch.ones(8).half(), 1e-5) is None  # fp16
    assert cpu_ops.rms_norm(x, torch.ones(8).bfloat16(), 1e-5) is None     # mixed dtypes
    assert cpu_ops.rms_norm(x.t(), torch.ones(4), 1e-5) is None        # columns strided
    assert cpu_ops.silu_mul(torch.randn(4, 8).t()) is None               # columns strided
    assert cpu_ops.silu_mul(torch.randn(4, 7)) is None                   # odd width
    assert cpu_ops.silu_mul(torch.randn(4, 8).half()) is None            # fp16
    x = torch.randn(4, 8)
    before = x.clone()
    assert cpu_ops.add_rms_norm(x, torch.randn(8, 8)[::2], torch.ones(8), 1e-5) is None
    assert cpu_ops.add_rms_norm(x, torch.randn(4, 8), torch.ones(8).half(), 1e-5) is None
    assert torch.equal(x, before)                                        # nothing added
    cos = torch.ones(4, 1, 8)
    assert not cpu_ops.rope_(torch.randn(4, 16).half(), 2, cos.half(), cos.half())  # fp16
    assert not cpu_ops.rope_(torch.randn(4, 16), 2, cos.bfloat16(), cos.bfloat16())  # dtypes
    assert not cpu_ops.rope_(torch.randn(4, 8), 2, cos, cos)             # too few columns
    assert cpu_ops.argmax_rows(torch.randn(4, 8).bfloat16()) is None      # fp32 only
    assert cpu_ops.argmax_rows(torch.randn(4, 8).t()) is None            # columns strided
    assert cpu_ops.argmax_rows(torch.randn(8)) is None                   # 2-D only
    monkeypatch.setenv("KVSTRATA_CPU_FUSED_OPS", "0")
    assert cpu_ops.argmax_rows(torch.randn(4, 8)) is None
    assert cpu_ops.silu_mul(torch.randn(4, 8)) is None
    assert cpu_ops.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-5) is None
    assert not cpu_ops.rope_(torch.randn(4, 16), 2, cos, cos)


def test_decoder_with_and_without_fused_ops(tiny_checkpoints, tiny_prompts, monkeypatch):
    """bf16 decoder: fused on vs off gives logprobs within bf16 rounding; fp32 (silu_mul,
    the rotary embedding, the norms) the same greedy tokens."""
    from kvstrata import LLM
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 0.15)):
        outs = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("KVSTRATA_CPU_FUSED_OPS", flag)
            # the default kernels, which the bf16 tolerance was measured on (deterministic
            # inference, on by default at bf16 on AVX2, runs others)
            with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
                     dtype=dtype, max_total_tokens=1024,
                     disable_deterministic_inference=True) as llm:
                outs[flag] = llm.generate(input_ids=tiny_prompts, sampling_params=params)
        for on, off in zip(outs["1"], outs["0"]):
            same = next((i for i, (a, b) in enumerate(zip(on["output_ids"], off["output_ids"]))
                         if a != b), len(on["output_ids"]))
            if dtype == "float32":
                assert same == len(on["output_ids"])
            got = [lp for lp, _ in on["meta_info"]["output_token_logprobs"][:same]]
            want = [lp for lp, _ in off["meta_info"]["output_token_logprobs"][:same]]
            assert max((abs(a - b) for a, b in zip(got, want)), default=0.0) < tol


def test_a_forward_reads_the_cpu_settings_once(monkeypatch):
    """KVSTRATA_CPU_FUSED_OPS / KVSTRATA_CPU_ISA are read once per model forward (the decoder
    wraps its forward in cpu_ops.fixed_settings), not by each fused op or attention call;
    outside a forward every call reads them again."""
    from kvstrata import envs
    from kvstrata.runner.cpu import isa
    reads = []

    class Counted:
        def __init__(self, var):
            self.var = var

        def get(self, *args, **kwargs):
            reads.append(self.var.name)
            return self.var.get(*args, **kwargs)

    for name in ("KVSTRATA_CPU_FUSED_OPS", "KVSTRATA_CPU_ISA"):
        monkeypatch.setattr(envs, name, Counted(getattr(envs, name)))

    @cpu_ops.fixed_settings
    def forward():
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        for _ in range(5):
            x = cpu_ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
            cpu_ops.silu_mul(torch.randn(4, 128))
        return isa.isa_cap(), cpu_ops.enabled()

    assert forward() == (isa.ISA_CAPS["auto"], True) and len(reads) == 2
    assert isa._pinned_cap is None and cpu_ops._pinned_enabled is None
    monkeypatch.setenv("KVSTRATA_CPU_FUSED_OPS", "0")
    assert cpu_ops.silu_mul(torch.randn(4, 8)) is None and len(reads) == 3

"""Train a small EAGLE-2 draft head for a llama-family target on this CPU, so that
`kvstrata bench spec --algorithms EAGLE` has a head to measure (no trained head for
SmolLM2 is reachable offline). The result is an HF checkpoint of `LlamaForCausalLMEagle`
form, the same kind SGLang and kvstrata load with `--speculative-draft-model-path`.

    .venv/bin/python benchmarks/train_eagle_head.py --out /tmp/eagle-smollm2
    .venv/bin/kvstrata bench spec --algorithms EAGLE --eagle-head /tmp/eagle-smollm2 \
        --dtype float32 --batch-sizes 1 4 32 --workloads chat

Recipe (EAGLE's, scaled down): the data is the target's own greedy answers to templated chat
questions (none of them `kvstrata bench spec`'s questions), served by kvstrata; the features
are transformers' final-normed hidden states of prompt + answer (a reference we did not
write); the head is fc(cat(embed(x_{i+1}), h_i)) -> one decoder layer without its input norm,
trained so that its output at position i regresses h_{i+1} (smooth L1, with noise on the
input features) and, through the target's frozen output head, predicts x_{i+2}
(cross-entropy, weight 0.1). The embedding and output head are the target's and are not
saved (the head shares them, as in SGLang). Beside the head: `hot_tokens.pt`, an FR-Spec
token map (`--speculative-token-map`) of the data's most frequent tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOPICS = ["rainbows", "volcanoes", "the moon", "bread", "bicycles", "honey bees", "chess",
          "the internet", "coffee", "glaciers", "electric cars", "the Roman empire",
          "sleep", "recycling", "jazz", "origami", "tides", "batteries", "dinosaurs",
          "gardening", "the human heart", "solar panels", "penguins", "libraries",
          "earthquakes", "tea", "computers", "rivers", "friendship", "exercise",
          "the stock market", "clouds", "bridges", "music", "mountains", "airplanes",
          "forests", "snow", "the printing press", "trains", "deserts", "cheese",
          "robots", "the ocean", "maps", "kites", "mushrooms", "lightning"]
TEMPLATES = ["What is {t}?", "Explain {t} to a child.", "Give three facts about {t}.",
             "Write a short poem about {t}.", "Why do people care about {t}?",
             "Describe {t} in a few sentences.", "What are the pros and cons of {t}?",
             "Tell me a short story about {t}."]


def prompts(n: int, seed: int) -> list[str]:
    from kvstrata.bench.spec import QUESTIONS

    qs = [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]
    qs = [q for q in qs if q not in QUESTIONS]
    random.Random(seed).shuffle(qs)
    return qs[:n]


def generate(model: str, questions: list[str], output_len: int) -> list[list[int]]:
    """prompt + the target's greedy answer, token ids, through kvstrata (fp32)."""
    from kvstrata import LLM

    llm = LLM(model_path=model, dtype="float32", page_size=16, max_total_tokens=65536)
    try:
        tok = llm.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True)
               for q in questions]
        ids = [p if isinstance(p, list) else p["input_ids"] for p in ids]
        outs = llm.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                            "max_new_tokens": output_len})
        return [p + o["output_ids"] for p, o in zip(ids, outs)]
    finally:
        llm.shutdown()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Head(nn.Module):
    """The head as trained (plain torch, HF Llama names): fc + one decoder layer."""

    def __init__(self, cfg):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or hd
        self.nq, self.nkv, self.hd, self.eps = (cfg.num_attention_heads,
                                                cfg.num_key_value_heads, hd, cfg.rms_norm_eps)
        inter = cfg.intermediate_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.q_proj = nn.Linear(h, self.nq * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nq * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        with torch.no_grad():
            # Start as "the feature itself": fc passes h_i through, the layer adds nothing
            # (zero output projections), so the first predictions are the target's own
            # next-token guesses one position late, and training moves on from there.
            self.fc.weight.mul_(0.1)
            self.fc.weight[:, h:] += torch.eye(h)
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()
        theta = getattr(cfg, "rope_theta", None) or \
            (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))

    def forward(self, emb_next: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """emb_next[T, H] = embed(x_{i+1}), feats[T, H] = h_i (one sequence, positions 0..)."""
        t = feats.shape[0]
        x = self.fc(torch.cat([emb_next, feats], dim=-1))
        ang = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        q = rope(self.q_proj(x).view(t, self.nq, self.hd), cos, sin).transpose(0, 1)
        k = rope(self.k_proj(x).view(t, self.nkv, self.hd), cos, sin).transpose(0, 1)
        v = self.v_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)
        rep = self.nq // self.nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        x = x + self.o_proj(att.transpose(0, 1).reshape(t, -1))
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.post_norm
        return x + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def state_for_checkpoint(self, hidden: int) -> dict[str, torch.Tensor]:
        p = "layers.0."
        s = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias,
             p + "self_attn.q_proj.weight": self.q_proj.weight,
             p + "self_attn.k_proj.weight": self.k_proj.weight,
             p + "self_attn.v_proj.weight": self.v_proj.weight,
             p + "self_attn.o_proj.weight": self.o_proj.weight,
             p + "mlp.gate_proj.weight": self.gate_proj.weight,
             p + "mlp.up_proj.weight": self.up_proj.weight,
             p + "mlp.down_proj.weight": self.down_proj.weight,
             p + "post_attention_layernorm.weight": self.post_norm,
             # never read (EAGLE's first layer takes its input unnormalised)
             p + "input_layernorm.weight": torch.ones(hidden)}
        return {k: v.detach().float().contiguous() for k, v in s.items()}


def train(args) -> dict:
    from safetensors.torch import save_file

    from kvstrata.bench.hf_reference import load_hf_model

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    seqs = generate(args.model, prompts(args.prompts, args.seed), args.output_len)
    t_gen = time.perf_counter() - t0
    hf = load_hf_model(args.model)
    for p in hf.parameters():
        p.requires_grad_(False)
    cfg = hf.config
    with torch.no_grad():
        feats = [hf.model(torch.tensor([s])).last_hidden_state[0] for s in seqs]
    t_feat = time.perf_counter() - t0 - t_gen
    head = Head(cfg)
    scale = torch.cat(feats).std()  # the regression in units of the features' spread
    embed, lm_head = hf.model.embed_tokens, hf.lm_head
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * len(seqs)
    order = list(range(len(seqs)))
    step, log = 0, []
    for epoch in range(args.epochs):
        random.Random(args.seed + epoch).shuffle(order)
        stats = [0.0, 0.0, 0, 0]  # smooth L1, CE, top-1 hits, positions
        for j in order:
            ids, h = torch.tensor(seqs[j]), feats[j]
            lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
            for g in opt.param_groups:
                g["lr"] = lr
            x_in = h[:-1] + args.noise * scale * torch.randn_like(h[:-1])
            out = head(embed(ids[1:]), x_in)           # position i: (x_{i+1}, h_i)
            reg = F.smooth_l1_loss(out / scale, h[1:] / scale)  # -> h_{i+1}
            logits = lm_head(out[:-1])                  # -> x_{i+2}
            ce = F.cross_entropy(logits, ids[2:])
            (reg + 0.1 * ce).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stats[0] += reg.item()
            stats[1] += ce.item()
            stats[2] += int((logits.argmax(-1) == ids[2:]).sum())
            stats[3] += len(ids) - 2
            step += 1
        row = {"epoch": epoch, "smooth_l1": stats[0] / len(seqs), "ce": stats[1] / len(seqs),
               "top1": stats[2] / stats[3]}
        log.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    save_file(head.state_for_checkpoint(cfg.hidden_size),
              os.path.join(args.out, "model.safetensors"))
    conf = cfg.to_dict()
    conf.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1,
                torch_dtype="float32")
    conf.pop("dtype", None)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    # FR-Spec's token map (--speculative-token-map): the most frequent tokens of the data
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]),
                            minlength=cfg.vocab_size)
    hot = torch.argsort(counts, descending=True)[:min(args.hot_tokens, cfg.vocab_size)]
    torch.save(hot.sort().values, os.path.join(args.out, "hot_tokens.pt"))
    info = {"model": args.model, "sequences": len(seqs), "tokens": sum(map(len, seqs)),
            "generate_s": round(t_gen, 1), "features_s": round(t_feat, 1),
            "train_s": round(time.perf_counter() - t0 - t_gen - t_feat, 1),
            "epochs": log, "args": vars(args)}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.05,
                    help="gaussian noise on the input features, times their std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hot-tokens", type=int, default=4096,
                    help="size of the FR-Spec token map written beside the head")
    info = train(ap.parse_args(argv))
    print(json.dumps({k: v for k, v in info.items() if k != "epochs"}))


if __name__ == "__main__":
    main()

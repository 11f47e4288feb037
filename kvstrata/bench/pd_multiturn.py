"""`kvstrata bench pd --dataset multiturn`: chats through sglang-router in PD mode, once
without and once with the decode radix cache (--disaggregation-decode-enable-radix-cache),
same prompts, same run. Each chat runs its turns in order (one request in flight): before
and after each turn the decode server's `disagg_kv_bytes_received_total` is read, so every
turn gets the KV bytes that crossed for it, and its TTFT (streamed). Reported per turn
index: mean bytes and TTFT p50, and for turns >= 2 the radix cache's ratios (bytes moved
without / with; TTFT with / without)."""
from __future__ import annotations

import argparse
import json
import random
import time

import httpx
import numpy as np

from kvstrata.bench.serve_client import make_conversations

RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"


def received_bytes(decode_url: str) -> int:
    load = httpx.get(decode_url + "/get_load", timeout=30).json()
    load = load[0] if isinstance(load, list) else load
    return int(load.get("disagg_kv_bytes_received_total", 0))


def chat_turn(client: httpx.Client, messages: list[dict], output_len: int
              ) -> tuple[float, str]:
    """(TTFT in s, the answer) of one streamed greedy chat turn."""
    body = {"model": "bench", "messages": messages, "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    start, ttft, text = time.perf_counter(), None, []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
    if ttft is None:
        raise RuntimeError("no content received")
    return ttft, "".join(text)


def run_chats(args, router_url: str, decode_url: str) -> list[dict]:
    """Per turn of every chat: {turn, bytes, ttft_ms}."""
    ns = argparse.Namespace(dataset="multiturn", num_prompts=args.num_prompts,
                            num_turns=args.num_turns, input_len=args.input_len,
                            followup_len=getattr(args, "followup_len", None))
    rows = []
    with httpx.Client(base_url=router_url, timeout=600) as client:
        chat_turn(client, [{"role": "user", "content": "warm up"}], 2)
        for turns in make_conversations(ns, random.Random(args.seed)):
            messages: list[dict] = []
            for i, text in enumerate(turns):
                messages.append({"role": "user", "content": text})
                before = received_bytes(decode_url)
                ttft, answer = chat_turn(client, messages, args.output_len)
                rows.append({"turn": i + 1, "bytes": received_bytes(decode_url) - before,
                             "ttft_ms": ttft * 1000.0})
                messages.append({"role": "assistant", "content": answer})
    return rows


def per_turn(rows: list[dict]) -> dict[int, dict]:
    """turn -> {n, bytes_mean, ttft_p50_ms}."""
    out = {}
    for turn in sorted({r["turn"] for r in rows}):
        sel = [r for r in rows if r["turn"] == turn]
        out[turn] = {"n": len(sel), "bytes_mean": float(np.mean([r["bytes"] for r in sel])),
                     "ttft_p50_ms": float(np.percentile([r["ttft_ms"] for r in sel], 50))}
    return out


def radix_ratios(off: dict[int, dict], on: dict[int, dict]) -> dict[int, dict]:
    """For turns >= 2: bytes moved without / with the decode radix cache (higher: fewer
    bytes with it), TTFT p50 with / without (lower: faster with it)."""
    out = {}
    for turn in sorted(t for t in off if t >= 2 and t in on):
        b_on = on[turn]["bytes_mean"]
        out[turn] = {"bytes_without_over_with": (off[turn]["bytes_mean"] / b_on) if b_on
                     else float("inf"),
                     "ttft_p50_with_over_without": on[turn]["ttft_p50_ms"]
                     / max(off[turn]["ttft_p50_ms"], 1e-9)}
    return out


def run_multiturn(args, log_dir: str, disaggregated) -> dict:
    """`disaggregated`: bench/pd.py's, which starts router + prefill + decode and runs
    `work` on them (passed in: pd.py imports this module, not the other way round)."""
    result: dict = {}
    for backend in args.backends:
        setups = {}
        for name, extra in (("without", ()), ("with", (RADIX_FLAG,))):
            rows = disaggregated(args, backend, log_dir, extra, tag=f"-{name}-radix",
                                 work=lambda r, d: run_chats(args, r, d))
            setups[name] = per_turn(rows)
        result[backend] = {"without_radix": setups["without"], "with_radix": setups["with"],
                           "ratios": radix_ratios(setups["without"], setups["with"])}
        print_multiturn(backend, result[backend])
    return result


def print_multiturn(backend: str, r: dict) -> None:
    print(f"\n{backend}: {'turn':>4s} {'bytes w/o':>11s} {'bytes with':>11s} "
          f"{'TTFT w/o':>9s} {'TTFT with':>9s} {'bytes x':>8s} {'TTFT x':>7s}")
    for turn, off in r["without_radix"].items():
        on = r["with_radix"].get(turn, {})
        ratio = r["ratios"].get(turn, {})
        print(f"{'':{len(backend) + 1}s} {turn:4d} {off['bytes_mean']:11.0f} "
              f"{on.get('bytes_mean', 0):11.0f} {off['ttft_p50_ms']:9.1f} "
              f"{on.get('ttft_p50_ms', 0):9.1f} "
              f"{ratio.get('bytes_without_over_with', 0):8.1f} "
              f"{ratio.get('ttft_p50_with_over_without', 0):7.2f}")

"""`kvstrata bench serve`: load-test any OpenAI-compatible server with streaming requests.

Measures, per request: TTFT (send -> first content chunk), ITL (gaps between content chunks),
TPOT ((e2e - TTFT) / (output tokens - 1)) and end-to-end latency; overall: output tok/s and
req/s. Works unchanged against kvstrata, `transformers serve` and `llama_cpp.server`: it only
uses /v1/chat/completions or /v1/completions with standard fields, and every non-standard
field (ignore_eos, stream_options) can be switched off for peers that reject it.

The HTTP client is aiohttp, as SGLang's and vLLM's serving benchmarks use: on a 2-vCPU box
the client shares the cores with the server it measures, and httpx's per-chunk cost (anyio
cancel scopes and a timeout context around every read) made it the busiest process after
the engine (10% of one core in a served SmolLM2 run, py-spy).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from kvstrata.bench.box_load import add_quiet_arg, announce_load

# Short common words: each is about one token for BPE vocabularies, so a prompt of N words
# is about N tokens. The server's usage.prompt_tokens reports the exact figure.
_WORDS = ("the of and to in is was for on are with as at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do "
          "how their if will up other about out many then them these so some her would make "
          "like him into time has look two more write go see number no way could people my "
          "than first water been call who oil its now find long down day did get come made "
          "may part").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str = ""
    priority_class: str = ""  # --priority-mix: "high" or "low"


def random_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def make_conversations(args, rng: random.Random) -> list[list[str]]:
    """random: one single-turn conversation per prompt. multiturn: conversations of
    --num-turns user messages (the first --input-len words, the others --followup-len,
    default a quarter of it), so later turns share a growing prefix with earlier ones."""
    if args.dataset == "random":
        return [[random_prompt(rng, args.input_len)] for _ in range(args.num_prompts)]
    n_conv = max(1, args.num_prompts // args.num_turns)
    followup = getattr(args, "followup_len", None) or max(1, args.input_len // 4)
    return [[random_prompt(rng, args.input_len)]
            + [random_prompt(rng, followup) for _ in range(args.num_turns - 1)]
            for _ in range(n_conv)]


def _payload(args, messages: list[dict], priority: int | None = None) -> tuple[str, dict]:
    body: dict = {"model": args.model, "max_tokens": args.output_len, "stream": True,
                  "temperature": args.temperature}
    if priority is not None:
        body["priority"] = priority
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.usage:
        body["stream_options"] = {"include_usage": True}
    body.update(json.loads(args.extra_body) if args.extra_body else {})
    if args.endpoint == "chat":
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = "\n".join(m["content"] for m in messages)
    return "/v1/completions", body


async def send_one(client: aiohttp.ClientSession, args, messages: list[dict],
                   priority_class: str = "") -> tuple[RequestResult, str]:
    priority = {"high": getattr(args, "high_priority", None),
                "low": getattr(args, "low_priority", None)}.get(priority_class)
    path, body = _payload(args, messages, priority)
    res, text = RequestResult(ok=False, start=time.perf_counter(),
                              priority_class=priority_class), []
    last = res.start
    chunks = 0
    try:
        async with client.post(args.base_url.rstrip("/") + path, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                return res, ""
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip().decode()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:300]
                    return res, ""
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                    if piece:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        text.append(piece)
        res.e2e = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks  # no usage: one token per chunk
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no content received"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: JSON
        res.error = repr(e)
    return res, "".join(text)


async def run_benchmark(args) -> tuple[list[RequestResult], float]:
    from tqdm.asyncio import tqdm

    rng = random.Random(args.seed)
    conversations = make_conversations(args, rng)
    total = sum(len(c) for c in conversations)
    limit = asyncio.Semaphore(args.concurrency or total)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[RequestResult] = []
    bar = tqdm(total=total, desc="requests", unit="req")
    # --timeout bounds each read (as before with httpx), not the whole streamed answer.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.timeout)
    # force_close: a connection per request. llama-server closes kept-alive connections
    # between streamed answers, and a request sent on one fails ("Can not write request body":
    # 7-17 of 64 at 32 concurrent); a localhost connect costs ~0.1 ms against a TTFT's tens.
    connector = aiohttp.TCPConnector(limit=args.concurrency or 1000, force_close=True)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as client:
        mix = getattr(args, "priority_mix", None)

        async def conversation(turns: list[str], cls: str) -> None:
            messages: list[dict] = []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                async with limit:
                    res, answer = await send_one(client, args, messages, cls)
                results.append(res)
                bar.update(1)
                if not res.ok:
                    return
                messages.append({"role": "assistant", "content": answer})

        start = time.perf_counter()
        tasks = []
        for turns in conversations:
            cls = "" if mix is None else ("high" if rng.random() < mix else "low")
            tasks.append(asyncio.create_task(conversation(turns, cls)))
            if args.request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1000.0  # report milliseconds
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, args) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "base_url": args.base_url, "model": args.model, "dataset": args.dataset,
        "endpoint": args.endpoint, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "input_len": args.input_len, "output_len": args.output_len,
        "duration_s": duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_latency_ms": _stats([r.e2e for r in ok]),
        "per_class": {cls: {"completed": sum(r.priority_class == cls for r in ok),
                            "ttft_ms": _stats([r.ttft for r in ok if r.priority_class == cls]),
                            "e2e_latency_ms": _stats([r.e2e for r in ok
                                                      if r.priority_class == cls])}
                      for cls in sorted({r.priority_class for r in ok} - {""})},
        "per_request": [asdict(r) | {"itl": None} for r in results],
        "itl_all_ms": [x * 1000 for r in ok for x in r.itl],
    }


def print_summary(s: dict, baseline: dict | None = None) -> None:
    print(f"\n==== bench serve: {s['base_url']} ({s['model']}) ====")
    print(f"requests: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.2f} s")
    print(f"request throughput: {s['request_throughput']:.2f} req/s")
    print(f"output throughput:  {s['output_throughput']:.1f} tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        st = s[key]
        if st["mean"] is None:
            continue
        print(f"{key:16s} mean {st['mean']:9.2f}  p50 {st['p50']:9.2f}  "
              f"p90 {st['p90']:9.2f}  p99 {st['p99']:9.2f}")
    for cls, st in s.get("per_class", {}).items():
        t = st["ttft_ms"]
        print(f"ttft_ms {cls:>4s} ({st['completed']:3d} req)  p50 {t['p50']:9.2f}  "
              f"p99 {t['p99']:9.2f}")
    if baseline:
        ratio = s["output_throughput"] / max(baseline["output_throughput"], 1e-9)
        print(f"output tok/s vs baseline {baseline['base_url']}: {ratio:.2f}x")
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    add_quiet_arg(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--dataset", choices=("random", "multiturn"), default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-turns", type=int, default=3, help="multiturn: turns per chat")
    parser.add_argument("--followup-len", type=int, default=None,
                        help="multiturn: words of each message after the first "
                             "(default --input-len / 4)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrival rate in req/s (default: all at once)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so every answer has --output-len tokens "
                             "(turn off for servers that reject the field)")
    parser.add_argument("--usage", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for stream_options.include_usage (exact token counts)")
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request")
    parser.add_argument("--priority-mix", type=float, default=None,
                        help="send the `priority` field: this fraction of the conversations "
                             "high, the rest low; TTFT is reported per class")
    parser.add_argument("--high-priority", type=int, default=100)
    parser.add_argument("--low-priority", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--output-png", default=None, help="default: next to --output-json")
    parser.add_argument("--baseline-json", default=None, help="print ratios against this run")


def main_from_args(args: argparse.Namespace) -> int:
    load = announce_load(args.require_quiet)
    results, duration = asyncio.run(run_benchmark(args))
    summary = summarize(results, duration, args)
    summary["box_load"] = load
    baseline = None
    if args.baseline_json:
        with open(args.baseline_json) as f:
            baseline = json.load(f)
    print_summary(summary, baseline)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    png = args.output_png or (args.output_json.rsplit(".", 1)[0] + ".png"
                              if args.output_json else None)
    if png:
        from kvstrata.bench.plot import plot_serve

        plot_serve(summary, png)
        print(f"plot: {png}")
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata bench serve")
    add_args(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The bench client opens a connection per request: a server that closes a kept-alive
connection between two answers (llama-server does, between streamed answers) must not fail
the requests sent after it. The server here answers one request per connection and drops the
connection at the next one; with a pooled keep-alive client the later requests fail."""
import argparse
import asyncio
import threading

from kvstrata.bench import serve_client

ANSWER = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'


async def _one_answer_per_connection(reader, writer):
    answered = False
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        if answered:  # a reused connection: dropped unanswered
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
        await writer.drain()
        answered = True


def _serve(ready: list, stop: threading.Event):
    async def main():
        server = await asyncio.start_server(_one_answer_per_connection, "127.0.0.1", 0)
        ready.append(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.02)
        server.close()
    asyncio.run(main())


def test_every_request_completes_against_a_server_that_drops_reused_connections():
    ready, stop = [], threading.Event()
    thread = threading.Thread(target=_serve, args=(ready, stop), daemon=True)
    thread.start()
    try:
        while not ready:
            pass
        parser = argparse.ArgumentParser()
        serve_client.add_args(parser)
        args = parser.parse_args(["--base-url", f"http://127.0.0.1:{ready[0]}",
                                  "--model", "m", "--endpoint", "completions", "--num-prompts", "6",
                                  "--concurrency", "2", "--input-len", "4",
                                  "--output-len", "1", "--no-usage", "--timeout", "10"])
        results, _ = asyncio.run(serve_client.run_benchmark(args))
    finally:
        stop.set()
        thread.join(5)
    assert [r.error for r in results if not r.ok] == []
    assert len(results) == 6

"""Benchmark clients (serve: any OpenAI-compatible server)."""

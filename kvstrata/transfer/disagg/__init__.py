"""Prefill/decode disaggregation: moving a prompt's KV pages from a prefill server into the
pages a decode server reserved (backends: tcp, mooncake, fake). See base.py."""

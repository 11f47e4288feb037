"""Prefill/decode disaggregation: moving a prompt's KV pages from a prefill server into the
pages a decode server reserved (backends: tcp, mooncake, fake). See base.py.

  base.py              the interface (DisaggManager, KVSender, KVReceiver)
  registry.py          create_manager(backend, role, buffers, ...) for the flag's value
  bootstrap_server.py  the prefill's HTTP bootstrap server (SGLang's /route)
  bootstrap_client.py  its clients: a prefill rank registers, a decode rank looks a route up
  rank_map.py          which prefill rank a decode rank pulls from (tensor parallelism)
  control.py           the zmq control plane both real backends share (transfer thread)
  dispatch.py          its incoming messages to their rooms, the prefill side's shipping
  rooms.py             per-room sender/receiver state;  liveness.py  timeouts, heartbeat
  messages.py          msgspec control messages, buffer geometry
  tcp.py / mooncake.py / fake.py   how pages move (or do not)
  (bench/transfer_rate.py: GB/s of a backend vs a raw loopback socket, same run)
"""

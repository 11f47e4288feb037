"""The runner's half of the seam: one executor per family of protocol ops, each beside the
byte movers it drives (docs/architecture.md, "The seam"). Executors never import spec/.

  base.py               the OpExecutor interface (apply_ops / poll_events, op_types,
                        event_merges) and the idle wait
  registry.py           EXECUTORS: every executor, in the order a step applies their ops
                        (the runner, TP's event merger and docs read it)
  tp_merge.py           how N tensor-parallel ranks' events of one type become one
  hicache.py            HiCache L2/L3: host pool, IO backend, storage jobs (TransferOps)
  disagg.py             PD: PDOps to a DisaggManager's senders/receivers, PDEvents back
  retraction_backup.py  decode retraction's KV backups (BackupOps: cpu_tensor | host_pool)
  wiring.py             ExecutorWiring: ModelRunner's executor half (a step's ops around the
                        forward, PD and L3 set-up, shutdown in reverse registry order)
"""

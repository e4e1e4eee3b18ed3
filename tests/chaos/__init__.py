"""A seeded, bounded chaos run against a local broker: ``make chaos`` / ``python -m tests.chaos``.

Not part of ``make test``. One run:

1. starts a private local broker (1 node, or 3 with ``--nodes 3``: replication 3, min.insync 2) under
   ``/tmp/chaos-*``, creates a namespace, and runs two ``rollstream produce --generate tests.plugins:slow``
   processes (stable ``--producer-id``) and a trainer ``rollstream take -n N --steps 0 --out F``, while a
   thread loads a wave of fresh prompts every few seconds (`rollstream.producers.prompts.load_prompts`);
2. for ``--seconds`` (default 180), a nemesis driven by ``random.Random(seed)`` injects a fault every
   2-8 s and undoes it a few seconds later (`tests.chaos._nemesis`): SIGKILL / SIGSTOP of producers and
   the trainer, broker pauses (SIGSTOP of a JVM, 3-25 s), and with 3 nodes SIGKILL of a node. Each fault
   is printed with the elapsed time as it happens;
3. drains: every fault undone, producers run until idle (``--exit-when-idle``), the trainer takes until
   nothing moves, and a last ``take`` tops up the final partial step;
4. checks (`tests.chaos._check`): 0 lost (every prompt on NS.prompts has its group taken or filtered
   in a committed step), 0 duplicated to the trainer (no group id taken twice over all committed steps,
   each rebuilt with `rollstream.consumers.replay_step`), the ``--out`` file agrees with the manifests, and
   `rollstream.consumers.audit` is green.

The seed is printed first (``--seed`` repeats a run's fault sequence). The report (faults by kind,
prompts loaded, groups taken, lost, duplicated, audit) is printed and written to ``chaos-report.md``;
the exit status is 1 if anything was lost or duplicated, the audit failed, or the drain did not finish.
"""

"""A seeded, bounded chaos run against a local broker: ``make chaos`` / ``python -m tests.chaos``.

Not part of ``make test``. ``--seed S`` (repeatable; default 1 2 3) runs one seeded run per seed, one after
another, ``--seconds`` (default 120) of nemesis each: about 4 minutes per seed on a 2-core machine. One run:

1. starts a private local broker (1 node, or 3 with ``--nodes 3``: replication 3, min.insync 2) under
   ``/tmp/chaos-*``, creates a namespace, and runs two ``rollstream produce --generate tests.plugins:slow``
   processes (stable ``--producer-id``) and a trainer, while a thread loads a wave of fresh prompts every
   few seconds (`rollstream.producers.prompts.load_prompts`). The trainer is one long-lived Python process
   (`tests.chaos._trainer`) that takes N groups with ``commit=False`` and ``--trainer-timeout`` (default
   10 s: a timed-out take reads the cluster to say why, and that read under a broker fault is what aborted
   trainers in issue 36; 30, the issue's setting, hits it more rarely), appends them to ``--out F`` and
   commits each step, retrying timeouts and failed commits as a training job would (``--trainer cli``:
   ``rollstream take -n N --steps 0 --out F`` instead);
2. for ``--seconds`` (default 120), a nemesis driven by ``random.Random(seed)`` injects a fault every
   2-8 s and undoes it a few seconds later (`tests.chaos._nemesis`): SIGKILL / SIGSTOP of producers and
   the trainer, broker pauses (SIGSTOP of a JVM, 3-25 s), and SIGKILL of a broker node (the broker, with
   one node; restarted 5-20 s later). Each fault is printed with the elapsed time as it happens;
3. drains: every fault undone, producers run until idle (``--exit-when-idle``), the trainer takes until
   nothing moves, and a last ``take`` tops up the final partial step;
4. checks (`tests.chaos._check`): 0 lost (every prompt on NS.prompts has its group taken or filtered
   in a committed step), 0 duplicated to the trainer (no group id taken twice over all committed steps,
   each rebuilt with `rollstream.consumers.replay_step`), the ``--out`` file agrees with the manifests, and
   `rollstream.consumers.audit` is green;
5. every end of a trainer or producer process the nemesis did not SIGKILL is judged: killed by a signal the
   nemesis did not send (SIGABRT from an assertion inside librdkafka, SIGSEGV), or a Python traceback in
   that process life's output, fails the run, and the report names the process with its output's tail.

The seed is printed first (``--seed`` repeats a run's fault sequence). The report (faults by kind,
prompts loaded, groups taken, lost, duplicated, audit) is printed and written to ``chaos-report.md``;
the exit status is 1 if, in any run, anything was lost or duplicated, the audit failed, the drain did not
finish, or a process died of something the nemesis did not send.

``python -m tests.chaos.abandon`` drives the suspected sequences of that abort on purpose, in a loop, against
a private broker (see its docstring); ``--level status`` reproduces it in its first round.
"""

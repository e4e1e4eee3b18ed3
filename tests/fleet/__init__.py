"""A fleet of rollout producers against a 3-node cluster: ``make fleet`` / ``python -m tests.fleet``.

Not part of ``make test``. One run:

1. starts a private 3-node local KRaft cluster (`rollstream.infra.broker`, through `tests.chaos._cluster.Cluster`;
   replication 3, min.insync.replicas 2) under ``/tmp/fleet-*``;
2. for each phase (a backpressure mode at a fleet size), creates a fresh namespace (``--partitions``
   prompt and rollout partitions, RF 3), keeps NS.prompts a backlog ahead of the trainer, and runs:
   ``--producers`` `rollstream.producers.RolloutProducer`s, ``--per-process`` of them on one asyncio loop per OS
   process (`tests.fleet._worker`), each with a latency-modelled generate function (a uniform
   ``--gen-ms`` sleep, two-token completions) and a reward that differs per sample; and one trainer in
   the driver: `rollstream.consumers.RolloutConsumer.take(--take-n)`, a ``--step-ms`` sleep, then ``commit``;
3. measures, over a window of ``--seconds`` that starts once every producer runs: groups/s; the trainer
   group's committed lag (every 0.1 s) against max_lag and max_lag + in-flight; the event-loop lag of every
   producer process (a callback every 20 ms, how late it ran); and the broker requests backpressure
   causes (`tests.fleet._probes`): the gates' lag reads, counted in each producer process and turned
   into requests with a per-read figure from librdkafka's statistics, plus in ``pushed`` mode the
   trainer's position records on NS.control; the NS.control watchers' Fetch requests are reported too;
   and, with a JDK, every request the three brokers served, by API (their JMX ``RequestMetrics``, read
   by `BrokerRequests.java`), which shows what the cluster spends its time on;
4. drains (the producers commit every prompt, then stop; the trainer takes the rest) and checks that
   every loaded prompt's group was taken exactly once (by group id) and that `rollstream.consumers.audit` is green.
   A fleet that stops committing during the drain (polling gates whose every read times out keep a
   stale, high estimate and stay closed) is reported as stalled and replaced by a few fresh producers
   that finish the prompts, so the checks still run. Each phase's topics are deleted after its checks.

``--churn`` (`tests.fleet._churn`) changes the fleet while the trainer takes, in windows of ``--seconds``: a
baseline, then one producer process SIGKILLed and a new one with as many new producers started, another drained
with SIGTERM, one broker node (``--churn-node``) SIGKILLed, then restarted. It reports the lag against the bound of
each moment (docs/operations.md, "When producers come and go"), how far and how long it passed max_lag, and the
trainer's throughput recovery after each event; the checks are the same (0 lost, 0 duplicated, audit green).

``--tls`` and ``--sasl`` start the cluster as ``rollstream broker start --tls --sasl`` does (every listener TLS,
SASL/SCRAM and ACLs) and every client of the run, the producer processes' too, uses its admin client file
(``admin.properties`` in the data dir): the same run, priced with encryption and authentication.

``--backpressure both`` runs ``poll`` and ``pushed`` at ``--producers`` and at a quarter of it (``--small``),
to show which request rate follows the fleet size. The report is printed and written to ``--out``: ``fleet.json``
(every figure and series) and ``fleet.png`` (lag over time per phase; requests/s by phase). Exit status 1
if anything was lost or duplicated, the audit failed, or a phase could not run.
"""

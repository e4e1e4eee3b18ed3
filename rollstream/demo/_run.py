"""`rollstream demo`: the whole system doing its job on one machine, with a policy that really learns.

`run_demo` wires both sides together:

1. Kafka: the broker named by ``ROLLSTREAM_BOOTSTRAP_SERVERS`` (or `DemoOptions.bootstrap_servers`), else a
   local single-node broker started for the run in ``<out>/broker`` (stopped and removed at the end).
2. A fresh namespace ``demo-<timestamp>`` with all its topics; the demo model built locally into
   ``<out>/weights/v0`` (`rollstream.demo.task`); enough addition prompts for the run on NS.prompts.
3. What generates (`DemoOptions.engine`, `rollstream.demo._engines`): ``hf``, `DemoOptions.producers` producer
   processes (``rollstream produce --engine hf``, two by default), each loading every announced policy version
   itself; or ``vllm``, one vLLM server (``<out>/vllm-server.log``) and one producer (``rollstream produce
   --engine vllm --vllm-sync-weights``) that reloads each announced version into the server. Producers log to
   ``<out>/producer-<i>.log`` and stamp the version that generated each sample.
4. The trainer, in this process: per step it takes exactly `groups_per_step` groups (stale groups are
   filtered and recorded in the step manifest), takes a GRPO optimizer step, saves the weights to
   ``<out>/weights/v<k>``, announces version k on NS.control, and only then commits the step, so a crash
   anywhere before the commit gets the same groups again.
5. At the end: stop the producers, replay one step and check it is byte for byte the batch the trainer
   took, run the audit, write ``<out>/steps.jsonl``, ``<out>/demo.png``, ``<out>/report.html`` (`rollstream
   report` of every step), ``<out>/steps.parquet`` (`rollstream export` of every step) and ``<out>/summary.json``.

Everything started is stopped when `run_demo` returns or raises (Ctrl-C included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollstream.consumers import Batch, RolloutConsumer, TakeTimeout, audit, default_filters
from rollstream.consumers.filters import reason_label, staleness_of
from rollstream.consumers.forensics import export_steps, write_report
from rollstream.demo._display import ProgressDisplay, StepRow, write_plot
from rollstream.demo._engines import (
    ENGINES,
    DemoEngine,
    EnginePlan,
    check_engine_installed,
    engine_plan,
    generation_server,
    producer_engine_args,
)
from rollstream.demo._result import DemoResult, TakenStep, fingerprint, replay_matches, write_summary
from rollstream.demo._services import DemoError, LocalBroker, ProducerExit, ProducerFleet, ProducerSpec
from rollstream.demo.task import PAD_ID, build_demo_model, make_prompts, write_prompts
from rollstream.infra import BOOTSTRAP_ENV, KafkaConfig, PolicyAnnouncer, TopicNames, TopicPlan, create_topics
from rollstream.producers import load_prompts
from rollstream.schemas import PolicyVersion, RollstreamError, write_policy_version
from rollstream.vllm_server import VLLMServer

log = logging.getLogger(__name__)
TRAINER_GROUP = "demo-trainer"

__all__ = ["DemoOptions", "run_demo"]


@dataclass(frozen=True)
class DemoOptions:
    """How the demo runs. The defaults take about 3 minutes on 2 CPU cores (mean reward ~0.03 -> ~0.8).

    Attributes:
        steps: trainer steps. out: output directory (weights, logs, plot, steps, broker data).
        engine: what generates: ``hf`` (transformers in each producer) or ``vllm`` (one vLLM server of vLLM's
            CPU build whose weights one producer reloads at each version; ``make install-vllm``).
        producers: producer processes (None: 2 for ``hf``, 1 for ``vllm``, which allows only 1).
        seed: model initialisation and prompt order.
        keep_broker: leave a broker the demo started running (and its data) after the run.
        groups_per_step, samples_per_prompt: GRPO batch shape (prompts per step, samples per prompt).
        max_staleness: skip groups more than this many policy versions old (None: never).
        max_lag: producers pause while the trainer lags more records than this (default 2 x groups_per_step).
        keep_versions: weight directories kept on disk (older ones are deleted as training goes).
        stall_timeout_s: fail when no step could be taken for this long (producers stuck or dead).
        bootstrap_servers: Kafka to use (default: ``ROLLSTREAM_BOOTSTRAP_SERVERS``, else a local broker).
        kafka_config_file: librdkafka properties for every client (security settings), as ``--kafka-config``.
        tls: the local broker the demo starts encrypts every listener (``broker start --tls``); every client then
            trusts its CA through the client file it writes (unless ``kafka_config_file`` names another). Only
            without ``bootstrap_servers``.
    """

    steps: int = 400
    out: Path = Path("demo-out")
    engine: DemoEngine = "hf"
    producers: int | None = None
    seed: int = 0
    keep_broker: bool = False
    groups_per_step: int = engine_plan("hf").recipe.groups_per_step
    samples_per_prompt: int = engine_plan("hf").recipe.samples_per_prompt
    max_staleness: int | None = 4
    max_lag: int | None = None
    keep_versions: int = 8
    stall_timeout_s: float = 180.0
    bootstrap_servers: str | None = None
    kafka_config_file: Path | None = None
    tls: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise DemoError(f"engine={self.engine!r}: use {' or '.join(ENGINES)}")
        plan = engine_plan(self.engine)
        if self.producers is None:
            object.__setattr__(self, "producers", plan.default_producers)
        elif self.engine == "vllm" and self.producers != 1:
            raise DemoError(f"producers={self.producers} with the vllm engine: the demo runs one vLLM server and one "
                            "producer that reloads its weights (two would pause and reload it twice per version); "
                            "leave --producers out")
        for name in ("steps", "producers", "groups_per_step", "keep_versions"):
            if getattr(self, name) < 1:
                raise DemoError(f"{name}={getattr(self, name)} must be >= 1")
        if self.samples_per_prompt < 2:
            raise DemoError(f"samples_per_prompt={self.samples_per_prompt} must be >= 2 (GRPO compares samples)")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise DemoError(f"max_staleness={self.max_staleness} must be >= 0 (or None for no limit)")
        if self.max_lag is not None and self.max_lag < 0:
            raise DemoError(f"max_lag={self.max_lag} must be >= 0")
        if self.tls and self.bootstrap_servers:
            raise DemoError("tls=True (--tls) starts a local TLS broker; for another broker pass its "
                            "--kafka-config (security.protocol, ssl.ca.location) instead")
        if self.stall_timeout_s <= 0:
            raise DemoError(f"stall_timeout_s={self.stall_timeout_s} must be > 0")
        object.__setattr__(self, "out", Path(self.out).expanduser().resolve())

    @property
    def plan(self) -> EnginePlan:
        """How `engine` runs: model recipe, groups in flight per producer, label."""
        return engine_plan(self.engine)

    @property
    def producer_count(self) -> int:
        """`producers`, resolved (never None after construction)."""
        return int(self.producers or self.plan.default_producers)

    @property
    def effective_max_lag(self) -> int:
        return 2 * self.groups_per_step if self.max_lag is None else self.max_lag

    @property
    def window(self) -> int:
        """Steps averaged for the reward at the start and at the end."""
        return min(10, max(1, self.steps // 4))

    @property
    def replay_at(self) -> int:
        """The step replayed and compared with what the trainer took (the middle one)."""
        return self.steps // 2


@dataclass(frozen=True)
class _Setup:
    """The run's fixed context once Kafka, topics, model and prompts are ready."""

    options: DemoOptions
    config: KafkaConfig
    bootstrap: str
    names: TopicNames
    base_model: Path
    display: ProgressDisplay
    server: VLLMServer | None = None  # the vllm engine's server, once it serves


def run_demo(options: DemoOptions, *, display: ProgressDisplay | None = None) -> DemoResult:
    """Run the demo described by `options`; see the module docstring. Blocks for the whole run.

    Returns the result whether or not its checks passed (`DemoResult.ok`, `problems`).

    Raises:
        DemoError: every producer died while the trainer needed groups, or no step could be taken for
            `stall_timeout_s`. Everything started is stopped first. (One producer dying is not fatal:
            the run goes on and reports it as a problem.)
        ConfigError: the vllm engine without vLLM's environment (``make install-vllm``), before anything starts.
        VLLMServerError: the vllm engine's server did not start (the message ends with its log).
        RollstreamError: Kafka unreachable, a broker that cannot start, topics that cannot be created.
        KeyboardInterrupt: Ctrl-C; everything started is stopped first.
    """
    started = time.monotonic()
    check_engine_installed(options.engine)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    display = display or ProgressDisplay(options.steps, engine=_engine_label(options))
    with contextlib.ExitStack() as stack:
        stack.enter_context(_quiet_transformers())
        bootstrap = None if options.tls else options.bootstrap_servers or os.environ.get(BOOTSTRAP_ENV)
        if not bootstrap:
            display.note(f"starting a local Kafka broker{' (TLS)' if options.tls else ''} in {out / 'broker'} ...")
            broker = stack.enter_context(LocalBroker(out / "broker", keep=options.keep_broker, tls=options.tls))
            bootstrap = str(broker.bootstrap)
            if broker.client_config is not None and options.kafka_config_file is None:
                # Every client, the producers' included, trusts its CA.
                options = dataclasses.replace(options, kafka_config_file=broker.client_config)
        setup = _prepare(options, bootstrap, display)
        if options.engine == "vllm":
            display.note(f"starting a vLLM server (CPU build) for {setup.base_model}; log {out / 'vllm-server.log'} "
                         "(1-2 minutes) ...")
        server = stack.enter_context(generation_server(options.engine, setup.base_model, out))
        setup = dataclasses.replace(setup, server=server)
        fleet = stack.enter_context(ProducerFleet(_producer_specs(setup), bootstrap))
        display.note(f"started {options.producer_count} producer{'s' if options.producer_count > 1 else ''} "
                     f"(pids {fleet.pids}, {_engine_label(options)}); training {options.steps} steps")
        train_started = time.monotonic()
        try:
            with display:
                rows, taken = _train(setup, fleet)
        except BaseException as exc:
            # The traceback's frames hold the trainer's Kafka clients; drop them now, before the broker stops,
            # or librdkafka keeps reconnecting (and logging) until the exception is gone.
            traceback.clear_frames(exc.__traceback__)
            raise
        train_s = time.monotonic() - train_started
        exits = tuple(fleet.stop())
        if server is not None:
            server.stop()  # idempotent: the exit stack's stop finds nothing left
        display.note("training done; producers stopped. Replaying one step and auditing ...")
        result = _finish(setup, rows, taken, exits, train_s, time.monotonic() - started)
    return result


def _prepare(options: DemoOptions, bootstrap: str, display: ProgressDisplay) -> _Setup:
    """Create the namespace, build the model, load the prompts. Blocks for seconds."""
    config = KafkaConfig.load(bootstrap, options.kafka_config_file, client_id="rollstream-demo")
    names = TopicNames(f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{int(time.time() * 1000) % 1000:03d}")
    partitions = max(2, options.producer_count)
    create_topics(TopicPlan(names=names, partitions=partitions), config)
    weights = options.out / "weights"
    shutil.rmtree(weights, ignore_errors=True)
    base = build_demo_model(weights / "v0", seed=options.seed, recipe=options.plan.recipe)
    write_policy_version(base, 0)
    # Enough for every step, plus what producers run ahead (max lag) and what the stale filter may skip.
    needed = options.steps * options.groups_per_step
    count = needed + needed // 4 + options.effective_max_lag + 16 * options.producer_count + 100
    path = write_prompts(options.out / "prompts.jsonl", make_prompts(count, seed=options.seed))
    loaded = load_prompts(path, config, namespace=names.namespace)
    display.note(f"namespace {names.namespace} on {bootstrap}: {loaded} prompts, model {base}")
    return _Setup(options, config, bootstrap, names, base, display)


def _producer_specs(setup: _Setup) -> list[ProducerSpec]:
    o, r = setup.options, setup.options.plan.recipe
    specs = []
    for i in range(1, o.producer_count + 1):
        args = ["produce", *producer_engine_args(o.plan, setup.base_model, setup.server),
                "--reward", "rollstream.demo.task:reward", "--n-samples", str(o.samples_per_prompt),
                "--max-new-tokens", str(r.max_new_tokens), "--temperature", str(r.temperature),
                "--top-p", str(r.top_p), "--max-lag", str(o.effective_max_lag),
                "--trainer-group", TRAINER_GROUP, "--producer-id", f"demo-{i}", "--namespace", setup.names.namespace,
                "--drain-timeout", "10", "--startup-timeout", "60", "--summary-interval", "15"]
        if o.kafka_config_file is not None:
            args += ["--kafka-config", str(o.kafka_config_file)]
        specs.append(ProducerSpec(f"demo-{i}", tuple(args), o.out / f"producer-{i}.log"))
    return specs


def _train(setup: _Setup, fleet: ProducerFleet) -> tuple[list[StepRow], TakenStep | None]:
    """The trainer loop: take -> optimizer step -> save -> announce -> commit, `steps` times."""
    from rollstream.demo.trainer import GRPOLearner, LearnerConfig, logprob_temperatures

    o, r = setup.options, setup.options.plan.recipe
    trainer = GRPOLearner(setup.base_model, LearnerConfig(lr=r.lr, clip_eps=r.clip_eps,
                                                          max_grad_norm=r.max_grad_norm, torch_threads=1))
    rows: list[StepRow] = []
    taken: TakenStep | None = None
    announcer = PolicyAnnouncer(setup.config, setup.names)  # this trainer run: it fences any earlier one
    consumer = RolloutConsumer(config=setup.config, group_id=TRAINER_GROUP, namespace=setup.names.namespace,
                               filters=default_filters(dynamic_sampling=False), max_staleness=o.max_staleness,
                               announcer=announcer)
    with announcer, consumer, (o.out / "steps.jsonl").open("w", encoding="utf-8") as steps_file:
        consumer.connect()  # within the consumer's timeout: a take's 2 s is for waiting, not for a TLS start
        started = time.monotonic()
        for i in range(o.steps):
            t0 = time.monotonic()
            batch = _take(consumer, o.groups_per_step, trainer.version, fleet, o.stall_timeout_s)
            lag = consumer.estimated_lag()  # right after the take, as the consumer's lag gauge
            t1 = time.monotonic()
            tensors = batch.to_tensors(pad_id=PAD_ID)
            stats = trainer.step(tensors, temperature=logprob_temperatures(batch.groups))
            t2 = time.monotonic()
            saved = trainer.save(o.out / "weights" / f"v{trainer.version}")
            announcer.announce(PolicyVersion(trainer.version, str(saved), metadata={"step": str(batch.step)}))
            consumer.commit(batch)  # after the step and the announcement: a crash before this re-delivers
            _prune_versions(o.out / "weights", trainer.version, o.keep_versions)
            t3 = time.monotonic()
            row = _row(batch, stats, lag, (t1 - t0, t2 - t1, t3 - t2), t3 - started)
            rows.append(row)
            steps_file.write(row.to_json() + "\n")
            steps_file.flush()
            setup.display.update(row)
            for gone in fleet.newly_exited():
                setup.display.note(f"producer {gone.producer_id} exited with code {gone.returncode} (see "
                                   f"{gone.log_path}); the others take its prompts over")
            if i == o.replay_at:
                taken = fingerprint(batch, tensors)
    return rows, taken


def _take(consumer: RolloutConsumer, n: int, version: int, fleet: ProducerFleet, stall_timeout_s: float) -> Batch:
    """`take(n)` without committing, checking between short waits that the producers are still alive.

    Raises:
        DemoError: every producer exited, or no batch for `stall_timeout_s`.
    """
    deadline = time.monotonic() + stall_timeout_s
    while True:
        try:
            return consumer.take(n, timeout=2.0, commit=False, policy_version=version)
        except TakeTimeout as exc:
            fleet.check()
            if time.monotonic() > deadline:
                raise DemoError(f"no step for {stall_timeout_s:g} s: only {exc.gathered} of {n} groups arrived; "
                                f"see the producer logs ({', '.join(str(s.log_path) for s in fleet.specs)})") from exc


def _row(batch: Batch, stats: dict[str, float], lag: int, times: tuple[float, float, float],
         elapsed_s: float) -> StepRow:
    rewards = [s.reward for g in batch.groups for s in g.samples if s.reward is not None]
    staleness = [s for g in batch.groups if (s := staleness_of(g, batch.policy_version)) is not None]
    stale = sum(1 for d in batch.dispositions  # skipped as stale: requeued, or on its last attempt
                if d.kind in ("filtered", "requeued") and reason_label(d.reason or "") == "stale")
    return StepRow(
        step=batch.step, version=int(stats["version"]), reward=stats["reward_mean"],
        exact=sum(1 for x in rewards if x == 1.0) / max(1, len(rewards)),
        staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        staleness_max=max(staleness, default=0), stale_filtered=stale, lag=lag, groups=len(batch.groups),
        take_s=times[0], train_s=times[1], publish_s=times[2], elapsed_s=elapsed_s, loss=stats["loss"],
        entropy=stats["entropy"], clip_fraction=stats["clip_fraction"])


def _prune_versions(weights: Path, current: int, keep: int) -> None:
    """Delete version directories older than the newest `keep` (v0, the base model, stays)."""
    for path in weights.glob("v*"):
        suffix = path.name[1:]
        if suffix.isdigit() and 0 < int(suffix) <= current - keep:
            shutil.rmtree(path, ignore_errors=True)


def _finish(setup: _Setup, rows: list[StepRow], taken: TakenStep | None, exits: tuple[ProducerExit, ...],
            train_s: float, wall_s: float) -> DemoResult:
    """Replay, audit, plot and summarise; collect every failed check as a problem."""
    o, problems = setup.options, []
    replay_ok, replay_message = replay_matches(setup.config, setup.names.namespace, TRAINER_GROUP, taken,
                                               pad_id=PAD_ID)
    report = audit(setup.config, setup.names.namespace, TRAINER_GROUP)
    if not replay_ok:
        problems.append(f"replay of step {o.replay_at}: {replay_message}")
    if not report.ok:
        problems.append(f"audit: {report.summary().splitlines()[-1]}")
    problems += [f"producer {e.producer_id} exited with code {e.returncode}; see {e.log_path}"
                 for e in exits if not e.ok]
    title = (f"rollstream demo ({o.engine}): {len(rows)} steps, {o.producer_count} producer"
             f"{'s' if o.producer_count > 1 else ''}, {o.groups_per_step} groups/step")
    plot = write_plot(rows, o.out / "demo.png", title=title, max_staleness=o.max_staleness)
    page, table = _look_back(setup, problems)
    result = DemoResult(rows=tuple(rows), engine=o.engine, engine_label=_engine_label(o),
                        namespace=setup.names.namespace, group_id=TRAINER_GROUP,
                        bootstrap=setup.bootstrap, wall_s=wall_s, train_s=train_s, window=o.window,
                        replay_step=o.replay_at, replay_ok=replay_ok, replay_message=replay_message,
                        audit_ok=report.ok, audit_message=" / ".join(report.summary().splitlines()),
                        audit_counts=report.counts,
                        producers=exits, plot_path=plot, steps_path=o.out / "steps.jsonl",
                        summary_path=o.out / "summary.json", problems=tuple(problems), report_path=page,
                        export_path=table)
    write_summary(result)
    return result


def _look_back(setup: _Setup, problems: list[str]) -> tuple[Path | None, Path | None]:
    """Write ``report.html`` (every step; the first, replayed and last in full, tokens as text) and
    ``steps.parquet`` (every step, one row per sample) beside the plot, as `rollstream report` and
    `rollstream export` do. Blocks for seconds. A failure is a problem of the run, not an exception."""
    o, group, namespace = setup.options, TRAINER_GROUP, setup.names.namespace
    report = export = None
    try:
        from rollstream.producers.engines._tokenize import load_tokenizer

        tokenizer = load_tokenizer(setup.base_model)
        report = write_report(setup.config, namespace, group, None, None, o.out / "report.html",
                              detail=(0, o.replay_at, o.steps - 1),
                              token_text=lambda ids: [tokenizer.decode([i]) for i in ids]).path
        export = export_steps(setup.config, namespace, group, None, None, o.out / "steps.parquet").path
    except (RollstreamError, OSError) as exc:  # pyarrow missing, a read failed: the run itself is fine
        problems.append(f"{'export' if report else 'report'}: {exc}")
    return report, export


def _engine_label(options: DemoOptions) -> str:
    """What generated, for the panel and the summary: ``vllm (vLLM server ...)``."""
    return f"{options.engine} ({options.plan.label})"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while the demo draws its own panel (restored afterwards)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()

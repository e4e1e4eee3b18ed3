"""`rollstream produce`: run a rollout producer (thin: builds `ProducerSettings` and runs `RolloutProducer`)."""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from rollstream.cli._common import DEFAULT_NAMESPACE, BootstrapOpt, KafkaConfigOpt, NamespaceOpt, examples, kafka_config
from rollstream.cli._malloc import cap_malloc_arenas
from rollstream.producers import DEFAULT_REQUEST_TIMEOUT_S, ProducerSettings, RolloutProducer, make_engine
from rollstream.producers.engines.environment import EXAMPLE_ENVIRONMENT
from rollstream.producers.engines.options import EngineSettings
from rollstream.producers.multiturn import DEFAULT_MAX_TURNS


class EngineName(StrEnum):
    sglang = "sglang"
    hf = "hf"
    vllm = "vllm"


class VLLMLogprobsModeName(StrEnum):
    processed_logprobs = "processed_logprobs"
    raw_logprobs = "raw_logprobs"


class PartialRolloutsName(StrEnum):
    continue_ = "continue"
    restart = "restart"


class BackpressureName(StrEnum):
    pushed = "pushed"
    poll = "poll"


class GroupProtocolName(StrEnum):
    auto = "auto"
    classic = "classic"
    consumer = "consumer"


_D = ProducerSettings()  # every default below is the library's own, not a copy
_E = EngineSettings()
_PARTIAL = PartialRolloutsName(_E.http.partial_rollouts)
_BACKPRESSURE = BackpressureName(_D.backpressure)
_GROUP_PROTOCOL = GroupProtocolName(_D.group_protocol)
_ENGINE = "Engine"
_SAMPLING = "Sampling"
_FLOW = "Flow control"
_LIFE = "Lifecycle"


def produce(
    engine: Annotated[EngineName | None, typer.Option(
        help="sglang: SGLang servers over HTTP (--sglang-url), or in-process with --model; vllm: vLLM servers "
             "over HTTP (--vllm-url); hf: transformers on CPU (--model).", rich_help_panel=_ENGINE)] = None,
    sglang_url: Annotated[list[str] | None, typer.Option(
        "--sglang-url", metavar="URL", help="SGLang server or router base URL; repeat (or comma-separate) for "
                                            "round robin.",
        rich_help_panel=_ENGINE)] = None,
    vllm_url: Annotated[list[str] | None, typer.Option(
        "--vllm-url", metavar="URL", help="vLLM server base URL (`vllm serve`, e.g. http://gpu1:8000); repeat (or "
                                          "comma-separate) for round robin. With --tokenizer the prompt goes as "
                                          "token ids. Aborted samples are continued (--partial-rollouts).",
        rich_help_panel=_ENGINE)] = None,
    vllm_model: Annotated[str | None, typer.Option(
        "--vllm-model", metavar="NAME", help="vLLM: the served model name sent with each request (default: the "
                                             "server's first model from /v1/models).",
        rich_help_panel=_ENGINE)] = None,
    vllm_logprobs_mode: Annotated[VLLMLogprobsModeName, typer.Option(
        "--vllm-logprobs-mode", help="vLLM: the --logprobs-mode the servers were started with. processed_logprobs: "
                                     "right at any temperature, with top-p 1 and no top-k; raw_logprobs (vLLM's "
                                     "default): right only at temperature 1. Other combinations are refused.",
        rich_help_panel=_ENGINE)] = VLLMLogprobsModeName.processed_logprobs,
    model: Annotated[Path | None, typer.Option(
        help="Model directory (hf, in-process sglang); also the default --tokenizer.", rich_help_panel=_ENGINE)] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        help="Tokenizer directory: send token ids with its chat template (SGLang or vLLM over HTTP; --environment "
             "needs it); without it the server tokenizes the prompt text.", rich_help_panel=_ENGINE)] = None,
    request_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds one request to an SGLang or vLLM server may take (a long generation is slow, not "
                      "dead); a request that times out is retried within the group's --group-timeout. It no "
                      "longer bounds a whole group or a --generate call: --group-timeout does.",
        rich_help_panel=_ENGINE)] = DEFAULT_REQUEST_TIMEOUT_S,
    group_timeout: Annotated[float | None, typer.Option(
        min=0.1, help="Seconds a group may take, one deadline for all of it: its generation, with every request "
                      "retry, continuation of a partial rollout and backoff, and its scoring, with every engine "
                      "(--generate too). Retries spend it, never extend it. Past it the group is published as "
                      "failed (retriable: the trainer may requeue its prompt). Default: 3 x --request-timeout.",
        rich_help_panel=_ENGINE)] = None,
    generate: Annotated[str | None, typer.Option(
        help="Custom generate function MODULE:FUNC: `async def f(prompt, n, sampling_params)` returning a list "
             "of dicts (text, tokens, logprobs, finish_reason, weight_version).",
        rich_help_panel=_ENGINE)] = None,
    environment: Annotated[str | None, typer.Option(
        metavar="MODULE:CLASS",
        help="Multi-turn episodes with the engine as the policy (--engine vllm or sglang with --tokenizer, or "
             "hf): each sample is one episode, with a fresh CLASS(tokenizer) whose reply(turn, episode) returns "
             "the tool's token ids, appended with loss mask 0 and logprob 0.0, or None to end it; the next "
             "policy turn continues prompt + response as token ids. A sync reply runs in threads of its own. "
             f"E.g. {EXAMPLE_ENVIRONMENT} (docs/engines.md).", rich_help_panel=_ENGINE)] = None,
    max_turns: Annotated[int | None, typer.Option(
        min=1, help=f"With --environment: policy turns per episode at most (default {DEFAULT_MAX_TURNS}), each "
                    "of at most --max-new-tokens tokens.", rich_help_panel=_ENGINE)] = None,
    partial_rollouts: Annotated[PartialRolloutsName, typer.Option(
        help="SGLang and vLLM: a sample aborted by a weight update is continued on the new weights from prompt "
             "+ its partial output (continue: its tokens carry both policy versions, staleness counts from the "
             "oldest), or generated again from scratch (restart). SGLang continues only with token ids "
             "(--tokenizer); vLLM also continues a text prompt from the token ids it returns.",
        rich_help_panel=_ENGINE)] = _PARTIAL,
    sglang_sync_weights: Annotated[bool, typer.Option(
        "--sglang-sync-weights", help="The producer updates its SGLang servers (--sglang-url, each server, not "
                                      "a router) to every newer policy version announced on NS.control with a "
                                      "weights_path: /pause_generation, /update_weights_from_disk, "
                                      "/continue_generation. Off: the trainer updates them itself.",
        rich_help_panel=_ENGINE)] = _E.sglang.sync_weights,
    vllm_sync_weights: Annotated[bool, typer.Option(
        "--vllm-sync-weights", help="The producer updates its vLLM servers (--vllm-url, each started with "
                                    "VLLM_SERVER_DEV_MODE=1) to every newer policy version announced on "
                                    "NS.control with a weights_path: /pause?mode=abort, /collective_rpc "
                                    "reload_weights, /update_weight_version, /resume. Off: the trainer updates "
                                    "them itself.",
        rich_help_panel=_ENGINE)] = _E.vllm.sync_weights,
    reward: Annotated[str | None, typer.Option(
        help="Reward: built-in 'math' or 'exact', or MODULE:FUNC `f(prompt, completion) -> float` (sync or "
             "async). Omitted: samples carry no reward.", rich_help_panel=_ENGINE)] = None,
    n_samples: Annotated[int, typer.Option(min=1, help="Completions per prompt (group size).",
                                           rich_help_panel=_SAMPLING)] = _D.n_samples,
    max_new_tokens: Annotated[int, typer.Option(min=1, rich_help_panel=_SAMPLING)] = _D.max_new_tokens,
    temperature: Annotated[float, typer.Option(min=0.0, rich_help_panel=_SAMPLING)] = _D.temperature,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, rich_help_panel=_SAMPLING)] = _D.top_p,
    concurrency: Annotated[int, typer.Option(
        min=1, help="Groups generated at once.", rich_help_panel=_FLOW)] = _D.concurrency,
    max_attempts: Annotated[int, typer.Option(
        min=1, help="Attempts per prompt: a group the trainer finds too stale, or one that failed for a passing "
                    "reason (engine timeout, server restart), has its prompt requeued on NS.prompts (same group "
                    "id) until this many attempts were made; then its reason is final. 1: never requeue.",
        rich_help_panel=_FLOW)] = _D.max_attempts,
    max_lag: Annotated[int | None, typer.Option(
        min=0, help="The fleet's max lag, the same for every producer of the trainer group: pause taking prompts "
                    "while the trainer group's lag on NS.rollouts exceeds it, or while this producer's own "
                    "uncommitted groups exceed its share of it (default: --concurrency).",
        rich_help_panel=_FLOW)] = None,
    trainer_group: Annotated[str, typer.Option(
        envvar="ROLLSTREAM_TRAINER_GROUP", help="The trainer's consumer group, whose lag is watched.",
        rich_help_panel=_FLOW)] = _D.trainer_group,
    backpressure: Annotated[BackpressureName, typer.Option(
        help="How the lag is learnt. pushed: follow the position the trainer's consumer publishes on NS.control "
             "after every commit (milliseconds; the lag is read only every few seconds as a fallback, and every "
             "0.5 s until a first position came); poll: read the lag every 0.5 s.",
        rich_help_panel=_FLOW)] = _BACKPRESSURE,
    producer_id: Annotated[str | None, typer.Option(
        help="Stable identity (static group membership): a restarted producer gets its prompt partitions "
             "back at once.", rich_help_panel=_LIFE)] = None,
    exit_when_idle: Annotated[float | None, typer.Option(
        help="Exit once, for this many seconds (> 0; 0 is rejected), no prompt came while intake was not "
             "paused, everything taken is published and committed, and no prompt waits uncommitted on any "
             "partition of NS.prompts (a peer's unfinished prompts may still come here). Omit it to run until "
             "stopped.",
        rich_help_panel=_LIFE)] = None,
    drain_timeout: Annotated[float, typer.Option(
        min=0.0, help="On SIGTERM/SIGINT, seconds in-flight groups get to finish (a second signal skips it).",
        rich_help_panel=_LIFE)] = _D.drain_timeout_s,
    drain_on_revoke: Annotated[float, typer.Option(
        min=0.0, help="Seconds in-flight groups of prompt partitions a rebalance moves away get to finish and "
                      "commit before the partitions go (so their new owner generates nothing twice).",
        rich_help_panel=_LIFE)] = _D.drain_on_revoke_s,
    checkpoint_interval: Annotated[float, typer.Option(
        min=0.0, help="In-flight checkpoints on NS.inflight, so that the producer taking a prompt over after a "
                      "crash continues its samples rather than generating them again: --environment episodes are "
                      "checkpointed at every turn boundary and when they finish (with the environment's snapshot() "
                      "if it has one); a single generation on vLLM or SGLang streams and is checkpointed every this "
                      "many seconds and when it finishes (a sample done within the first interval: never, it costs "
                      "less to generate again). 0: no checkpoints, none resumed, nothing streamed.",
        rich_help_panel=_LIFE)] = _D.checkpoint_interval_s,
    checkpoint_max_staleness: Annotated[int | None, typer.Option(
        min=0, help="Discard a checkpoint whose oldest token is more than this many policy versions behind the "
                    "one followed, and generate its sample again (omitted: any age; one of another trainer run is "
                    "always discarded).", rich_help_panel=_LIFE)] = None,
    startup_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds to wait for the broker at startup.", rich_help_panel=_LIFE)] = _D.startup_timeout_s,
    session_timeout: Annotated[float, typer.Option(
        min=1.0, help="Seconds before a dead producer's prompt partitions move to the others.",
        rich_help_panel=_LIFE)] = _D.session_timeout_s,
    group_protocol: Annotated[GroupProtocolName, typer.Option(
        envvar="ROLLSTREAM_GROUP_PROTOCOL",
        help="The prompt group's rebalance protocol. classic: cooperative-sticky, assigned by a member; consumer: "
             "KIP-848, assigned by the broker (Kafka >= 4.0); auto: decided once at start, the consumer protocol "
             "where the broker serves it, classic otherwise and for a --producer-id (static member) "
             "(docs/operations.md#prompt-group-protocol).",
        rich_help_panel=_LIFE)] = _GROUP_PROTOCOL,
    metrics_port: Annotated[int | None, typer.Option(help="Serve Prometheus metrics on this port.")] = None,
    summary_interval: Annotated[float, typer.Option(
        min=0.0, help="Seconds between one-line progress summaries in the log (0: none).")] = _D.summary_interval_s,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    if exit_when_idle is not None and exit_when_idle <= 0:
        raise typer.BadParameter(f"--exit-when-idle {exit_when_idle:g}: must be > 0 seconds; omit it to run "
                                 "until stopped")
    cap_malloc_arenas()  # before any thread: a thread per generation slot would each grow an arena of its own
    settings = ProducerSettings(
        namespace=namespace, n_samples=n_samples, concurrency=concurrency, max_lag=max_lag,
        trainer_group=trainer_group, backpressure=backpressure.value, producer_id=producer_id,
        exit_when_idle_s=exit_when_idle,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, drain_timeout_s=drain_timeout,
        startup_timeout_s=startup_timeout, session_timeout_s=session_timeout, metrics_port=metrics_port,
        group_protocol=group_protocol.value,
        summary_interval_s=summary_interval,
        generate_timeout_s=group_timeout if group_timeout is not None else 3 * request_timeout,
        max_attempts=max_attempts, drain_on_revoke_s=drain_on_revoke, checkpoint_interval_s=checkpoint_interval,
        checkpoint_max_staleness=checkpoint_max_staleness)
    built = make_engine(engine.value if engine else None, sglang_urls=sglang_url or (), model=model,
                        tokenizer=tokenizer, generate=generate, request_timeout_s=request_timeout,
                        partial_rollouts=partial_rollouts.value, sglang_sync_weights=sglang_sync_weights,
                        vllm_urls=vllm_url or (), vllm_model=vllm_model, vllm_logprobs_mode=vllm_logprobs_mode.value,
                        sampling=settings.sampling(), environment=environment, max_turns=max_turns,
                        vllm_sync_weights=vllm_sync_weights)
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-producer")
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("rollstream.producers").setLevel(logging.INFO)  # a service: progress is worth showing
    RolloutProducer(built, settings, kafka=config, reward=reward).run_sync(handle_signals=True)


HELP = "\n\n".join([
    "Take prompts from NS.prompts, generate and score a group per prompt, publish it to NS.rollouts.",
    "A prompt is committed only once its group is acknowledged by the broker, so a killed producer loses nothing: "
    "its unfinished prompts are generated again (same group_id) by whoever takes its partitions. Failed groups "
    "(engine error after retries, reward error, too large) are published as failed records; a stale or "
    "retriably failed group's prompt is requeued by the trainer up to --max-attempts.",
    "Multi-turn: with --environment MODULE:CLASS each sample is an episode in which the engine's turns alternate "
    "with an environment's replies (tool tokens, masked out of the loss).",
    "Intake pauses while the trainer group's lag on NS.rollouts exceeds --max-lag (one number for the whole "
    "fleet: each producer also waits while its own uncommitted groups exceed its share of it). SIGTERM/SIGINT: "
    "stop taking prompts, finish in-flight groups, flush, commit, exit 0.",
])
EXAMPLES = examples(
    "rollstream produce --namespace demo --engine sglang --sglang-url http://gpu1:30000 --tokenizer ./model "
    "--reward math",
    "rollstream produce --namespace demo --engine vllm --vllm-url http://gpu1:8000 --tokenizer ./model",
    "rollstream produce --namespace demo --engine hf --model ./tiny --n-samples 4 --trainer-group my-trainer",
    "rollstream produce --namespace demo --generate mypkg.agent:generate --reward mypkg.agent:score",
    "rollstream produce --namespace demo --engine vllm --vllm-url http://gpu1:8000 --tokenizer ./model "
    f"--environment {EXAMPLE_ENVIRONMENT} --max-turns 2",
)


def register(app: typer.Typer) -> None:
    """Add `produce` to the root app."""
    app.command("produce", help=HELP, epilog=EXAMPLES)(produce)

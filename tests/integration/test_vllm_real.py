"""`rollstream produce --engine vllm` against a REAL vLLM server (vLLM's CPU build, `tests.integration._vllm`).

Pinned against the real thing, not the stand-in:

1. Groups carry the server's own token ids, the prompt as the producer's tokenizer encoded it (chat template),
   and logprobs that are what the trainer recomputes: log_softmax(logits / T) of the served weights, checked
   against a transformers forward pass over the same directory (the server runs ``--logprobs-mode
   processed_logprobs``, the engine's default contract).
2. Sampling options are mapped or refused as the real server validates them: every option rollstream maps is
   accepted by the server in rollstream's request body, and every value `SamplingParams` refuses the server
   refuses too (HTTP 400).
3. A multi-turn environment (``--environment``) runs on the real server with exactly the tool tokens masked.
4. A pause (``/pause?mode=abort``, as around a weight update) longer than the producer's intake stall rule,
   while every slot waits on the server, publishes no group twice, replaces no client, and every sample is
   finished (an in-flight one continued or issued again, a new one waited out until ``/resume``).
5. A server SIGKILLed mid-run and started again loses no prompt: every prompt ends as one ok group.
6. A producer that owns the server's weights (``--vllm-sync-weights``) reloads them when a version is announced
   with a ``weights_path`` (``/pause?mode=abort``, ``/collective_rpc`` ``reload_weights``,
   ``/update_weight_version``, ``/resume``): every group is published ok once, and a sample generated across the
   update carries two version spans, 0 then 1, its tokens the partial output and its continuation: the
   logprobs are the old weights' up to the split and the new weights' after it, as a trainer recomputes them.
   vLLM 0.32 reports no per-token versions: the spans are the ones the engine stamps.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import rollstream.producers._intake_stall as stall_module
import torch
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, PolicyAnnouncer
from rollstream.producers import RolloutProducer, make_engine
from rollstream.producers.engines._vllm_format import request_body
from rollstream.producers.engines.base import EngineError, SamplingParams
from rollstream.producers.engines.environment import EXAMPLE_ENVIRONMENT
from rollstream.schemas import PolicyVersion, Sampling
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration._kafka import committed_everything, count, read_all, run_cli, write_prompts
from tests.integration._vllm import RealVLLM, build_model
from tests.integration.test_multiturn import assert_calculator_episode
from tests.integration.test_policy_versions import running, settings, wait_for

TEMPERATURE, TOKENS = 0.8, 8
pytestmark = pytest.mark.timeout(600)  # the session's server starts within the first test (~1 min, more when busy)


@pytest.fixture
def vllm(real_vllm: RealVLLM) -> RealVLLM:
    real_vllm.ensure_running()
    return real_vllm


def _take_all(kafka_config: KafkaConfig, group_id: str, namespace: str, n: int) -> list[Any]:
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=namespace, filters=()) as trainer:
        batch = trainer.take(n, timeout=60)
        trainer.commit(batch)
    return list(batch.groups)


def _recomputed_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each response token, as a trainer recomputes it."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_groups_carry_the_servers_tokens_and_the_logprobs_a_trainer_recomputes(
        kafka_config: KafkaConfig, namespace_factory, group_id, bootstrap_servers: str, vllm: RealVLLM) -> None:
    prompts, samples = 4, 2
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"p{i}" for i in range(prompts)])
    produced = run_cli(bootstrap_servers, "produce", "--namespace", names.namespace, "--engine", "vllm",
                       "--vllm-url", vllm.url, "--tokenizer", str(vllm.model_dir), "--n-samples", str(samples),
                       "--max-new-tokens", str(TOKENS), "--temperature", str(TEMPERATURE), "--concurrency", "2",
                       "--max-lag", "100", "--trainer-group", group_id, "--exit-when-idle", "1.5",
                       "--summary-interval", "0", timeout_s=120)
    assert produced.returncode == 0, produced.stdout + produced.stderr
    groups = _take_all(kafka_config, group_id, names.namespace, prompts)

    tokenizer = AutoTokenizer.from_pretrained(str(vllm.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(vllm.model_dir), dtype=torch.float32).eval()
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(prompts)]
    for group in groups:
        assert group.status == "ok" and len(group.samples) == samples, group.error
        assert group.sampling == Sampling(temperature=TEMPERATURE, top_p=1.0, top_k=-1)
        chat = [{"role": "user", "content": f"question {group.prompt_id}"}]
        assert list(group.prompt_tokens) == list(tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                               tokenize=True, return_dict=False))
        for sample in group.samples:
            tokens = [int(t) for t in sample.tokens]
            assert 1 <= len(tokens) <= TOKENS and sample.finish_reason in ("stop", "length")
            assert sample.logprobs is not None and len(sample.logprobs) == len(tokens)
            expected = _recomputed_logprobs(model, list(group.prompt_tokens), tokens, TEMPERATURE)
            assert list(sample.logprobs) == pytest.approx(expected, abs=2e-3)
            assert sample.text == tokenizer.decode(tokens, skip_special_tokens=True)


# A valid value of each sampling option rollstream maps to vLLM (the rest of VLLM_OPTIONS needs the model's own
# strings or ids: bad_words, allowed_token_ids, logit_bias, truncate_prompt_tokens, length_penalty).
ACCEPTED = {"min_new_tokens": 1, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.5, "presence_penalty": 0.5,
            "repetition_penalty": 1.1, "seed": 7, "stop": ["\n"], "stop_token_ids": [4], "ignore_eos": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True}
# What SamplingParams refuses, sent to the server as it is: the server refuses it too.
REFUSED = {"temperature": -0.5, "top_p": 0.0, "top_k": -2, "max_new_tokens": 0}


def test_sampling_options_are_mapped_and_refused_as_the_real_server_validates_them(vllm: RealVLLM) -> None:
    ids = [5, 6, 7]
    for key, value in ACCEPTED.items():
        sampling = SamplingParams(max_new_tokens=4, temperature=1.0, extra={key: value})
        answer = vllm.post("/v1/completions", request_body("", ids, sampling.to_dict(), model=None))
        assert answer.status_code == 200, (key, value, answer.text[:300])
    for key, value in REFUSED.items():
        field = {"max_new_tokens": "max_tokens"}.get(key, key)
        with pytest.raises(EngineError):
            SamplingParams(**{key: value})
        body = {**request_body("", ids, SamplingParams(max_new_tokens=4).to_dict(), model=None), field: value}
        assert vllm.post("/v1/completions", body).status_code == 400, (key, value)


def test_a_multi_turn_environment_on_the_real_server_masks_exactly_the_tool_tokens(
        kafka_config: KafkaConfig, namespace_factory, group_id, bootstrap_servers: str, vllm: RealVLLM) -> None:
    prompts, samples, max_turns = 2, 2, 3
    names = namespace_factory(partitions=1)
    write_prompts(kafka_config, names, [f"p{i}" for i in range(prompts)])
    produced = run_cli(bootstrap_servers, "produce", "--namespace", names.namespace, "--engine", "vllm",
                       "--vllm-url", vllm.url, "--tokenizer", str(vllm.model_dir), "--environment",
                       EXAMPLE_ENVIRONMENT, "--max-turns", str(max_turns), "--reward", "tests.plugins:reward",
                       "--n-samples", str(samples), "--max-new-tokens", "4", "--temperature", "1.0",
                       "--concurrency", "2", "--max-lag", "100", "--trainer-group", group_id,
                       "--exit-when-idle", "1.5", "--summary-interval", "0", timeout_s=120)
    assert produced.returncode == 0, produced.stdout + produced.stderr
    groups = _take_all(kafka_config, group_id, names.namespace, prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(vllm.model_dir))
    for group in groups:
        assert group.status == "ok", group.error
        for sample in group.samples:
            assert_calculator_episode(sample, tokenizer, lambda t: tokenizer.decode(t, skip_special_tokens=True),
                                      max_turns)


def test_a_server_killed_and_restarted_mid_run_loses_no_prompt(kafka_config: KafkaConfig, namespace_factory,
                                                               vllm: RealVLLM) -> None:
    prompts = 12
    names = namespace_factory(partitions=1)
    engine = make_engine("vllm", vllm_urls=[vllm.url], tokenizer=str(vllm.model_dir))
    producer = RolloutProducer(engine, settings(names, n_samples=2, max_new_tokens=32, concurrency=2,
                                                max_attempts=5), kafka=kafka_config)
    with running(producer):
        write_prompts(kafka_config, names, [f"p{i}" for i in range(prompts)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 2, "the first groups")
        vllm.server.kill()  # SIGKILL: requests in flight get their connection closed
        time.sleep(2.0)  # the producer's requests find no server, and wait for one
        vllm.server.start()  # blocks until it serves again (about a minute)
        wait_for(lambda: len({g.prompt_id for g in read_all(kafka_config, names.rollouts) if g.status == "ok"})
                 == prompts, f"an ok group for each of the {prompts} prompts", timeout_s=240)
    groups = read_all(kafka_config, names.rollouts)
    ok = [g for g in groups if g.status == "ok"]
    assert sorted(g.prompt_id for g in ok) == sorted(f"p{i}" for i in range(prompts))  # each once, none lost


def test_a_pause_longer_than_the_stall_rule_publishes_no_group_twice(
        kafka_config: KafkaConfig, namespace_factory, vllm: RealVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # stall_s = max(_MIN_STALL_S, 2 x session timeout). A session of 6 s, not less: this machine stalls ordinary
    # processes for 4-5 s at times while vLLM generates, and a 2 s session expired in CI (its partition lost and
    # taken again: duplicates by design, not the stall rule's doing).
    session_s, concurrency, prompts = 6.0, 2, [f"w{i}" for i in range(6)]  # more prompts than slots and queue
    stall_s = 2 * session_s
    monkeypatch.setattr(stall_module, "_MIN_STALL_S", stall_s)
    names = namespace_factory(partitions=1)
    engine = make_engine("vllm", vllm_urls=[vllm.url], tokenizer=str(vllm.model_dir))
    # Long samples (no EOS) keep every slot on the server when the pause comes; the broker holds each intake
    # fetch 0.5 s, as a remote cluster may, so a stall probe would come before the first prompt after it.
    producer = RolloutProducer(engine, settings(names, n_samples=2, concurrency=concurrency, max_new_tokens=400,
                                                sampling_extra={"ignore_eos": True}, session_timeout_s=session_s,
                                                intake_overrides={"fetch.min.bytes": 1 << 20,
                                                                  "fetch.wait.max.ms": 500}),
                               kafka=kafka_config)
    with running(producer):
        write_prompts(kafka_config, names, prompts)
        wait_for(lambda: producer.stats().in_flight == concurrency and producer.stats().buffered == concurrency,
                 "every slot generating and the queue full", timeout_s=60)
        vllm.post("/pause?mode=abort").raise_for_status()
        time.sleep(stall_s + 4)  # longer than the stall rule
        vllm.post("/resume").raise_for_status()
        wait_for(lambda: committed_everything(kafka_config, producer.settings.effective_intake_group, names.prompts),
                 "every prompt committed", timeout_s=180)
        replaced = producer.registry.get_sample_value("rollstream_producer_client_replacements_total",
                                                      {"role": "intake"})
    groups = read_all(kafka_config, names.rollouts)
    twice = sorted({g.prompt_id for g in groups if sum(h.group_id == g.group_id for h in groups) > 1})
    assert not twice, f"groups of prompts {twice} published twice"
    assert sorted(g.prompt_id for g in groups) == sorted(prompts)
    assert all(g.status == "ok" for g in groups), [g.error for g in groups if g.status != "ok"]
    assert all(s.finish_reason == "length" and len(s.tokens) == 400 for g in groups for s in g.samples)
    assert replaced == 0, "the intake client was replaced while the producer waited on its paused server"


def test_weights_reloaded_mid_generation_continue_samples_on_the_new_weights(
        kafka_config: KafkaConfig, namespace_factory, vllm: RealVLLM, tmp_path: Any) -> None:
    # ~5 s of generation on 2 cores; the test lets it run only a few tokens before freezing it, so the update
    # lands mid-generation however busy the machine is (and tries again with new prompts if it could not)
    pair, samples, tokens = 2, 2, 1600
    new_weights = build_model(tmp_path / "v1", seed=1)  # the same shape, other weights
    names = namespace_factory(partitions=1)
    vllm.post("/update_weight_version", {"new_version": "0"}).raise_for_status()  # the trainer's first weights
    engine = make_engine("vllm", vllm_urls=[vllm.url], tokenizer=str(vllm.model_dir), vllm_sync_weights=True)
    producer = RolloutProducer(engine, settings(names, n_samples=samples, concurrency=pair,
                                                max_new_tokens=tokens, temperature=TEMPERATURE,
                                                sampling_extra={"ignore_eos": True}), kafka=kafka_config)
    prompts: list[str] = []
    try:
        # The trainer's run begins before the generation (its transactional producer takes seconds to start on
        # a fresh broker), as a trainer holds one announcer for its run: the announcement itself is then prompt.
        with running(producer), PolicyAnnouncer(kafka_config, names) as trainer:
            trainer.begin()
            for attempt in range(3):
                prompts += [f"s{attempt}-{i}" for i in range(pair)]
                if _frozen_a_few_tokens_in(vllm, kafka_config, names, producer, prompts[-pair:], pair * samples,
                                           tokens):
                    break
                vllm.post("/resume").raise_for_status()  # it ran to the end: its groups are on version 0
                _wait_for_groups(kafka_config, names.rollouts, len(prompts))
            else:
                pytest.fail("3 generations ran to their end before the server could be frozen part way")
            trainer.announce(PolicyVersion(1, weights_path=str(new_weights)))  # its update aborts the frozen ones
            _wait_for_groups(kafka_config, names.rollouts, len(prompts))
        assert vllm.get("/weight_info").json() == {"weight_version": "1"}
    finally:
        _serve_the_sessions_weights(vllm)
    groups = read_all(kafka_config, names.rollouts)
    assert sorted(g.prompt_id for g in groups) == sorted(prompts)  # each published once
    assert all(g.status == "ok" for g in groups), [g.error for g in groups]
    old, new = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                for d in (vllm.model_dir, new_weights))
    # vLLM 0.32 reloads a model with tied embeddings (as build_tiny_model's) keeping its old output layer: the
    # checkpoint has no lm_head.weight, and the in-place reload puts the old one back ("ParallelLMHead: Failed
    # to load weights", vllm/model_executor/model_loader/reload/layerwise.py). So the continuation is the new
    # weights' with the old head, or, once vLLM reloads tied heads, the new weights' own.
    reloaded = AutoModelForCausalLM.from_pretrained(str(new_weights), dtype=torch.float32).eval()
    reloaded.lm_head.weight = torch.nn.Parameter(old.lm_head.weight.detach().clone())
    across, all_spans = 0, []
    for group in groups:
        for sample in group.samples:
            response = [int(t) for t in sample.tokens]
            assert len(response) == tokens and sample.finish_reason == "length"
            spans = [(s.version, s.start, s.end) for s in sample.version_spans]
            all_spans.append(spans)
            split = spans[0][2] if spans[0][0] == 0 else 0
            assert spans in ([(0, 0, tokens)], [(1, 0, tokens)], [(0, 0, split), (1, split, tokens)]), spans
            across += len(spans) == 2
            prompt, logprobs = list(group.prompt_tokens), list(sample.logprobs if sample.logprobs is not None else [])
            before = _recomputed_logprobs(old, prompt, response, TEMPERATURE)[:split]
            assert logprobs[:split] == pytest.approx(before, abs=2e-3)  # the partial output: the old weights'
            if split < tokens:
                after = [_recomputed_logprobs(m, prompt, response, TEMPERATURE)[split:] for m in (new, reloaded)]
                assert any(logprobs[split:] == pytest.approx(a, abs=2e-3) for a in after)  # continued on the new ones
    assert across >= 1, f"no sample was generated across the update: {all_spans}"


def _wait_for_groups(kafka_config: KafkaConfig, topic: str, n: int) -> None:
    wait_for(lambda: count(kafka_config, topic) >= n, f"{n} groups", timeout_s=180)


def _frozen_a_few_tokens_in(vllm: RealVLLM, kafka_config: KafkaConfig, names: Any, producer: RolloutProducer,
                            prompts: list[str], requests: int, tokens: int) -> bool:
    """Leave the prompts' requests frozen on the server (``/pause?mode=keep``) a few tokens in; False if they ran out.

    The server is paused before the prompts go out, so their requests wait unscheduled. They then run in short
    bursts, each ended by SIGSTOP of the engine core (at once, however busy the machine: the API server, which
    answers late while it streams outputs on 2 cores, is not in the way), until they have a few tokens; the
    pause is sent while the core is stopped and acted on right after SIGCONT."""
    vllm.post("/pause?mode=keep").raise_for_status()
    generated_before = vllm.generated_tokens()
    write_prompts(kafka_config, names, prompts)
    wait_for(lambda: producer.stats().in_flight == len(prompts), "the prompts' groups generating", timeout_s=60)
    time.sleep(0.5)  # their requests reach the server, where they wait while it is paused
    vllm.post("/resume").raise_for_status()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
        vllm.signal_engine_core(signal.SIGSTOP)
        time.sleep(0.2)  # the outputs the core sent reach the API server's count
        generated = vllm.generated_tokens() - generated_before
        if generated >= 10 * requests:
            with ThreadPoolExecutor(1) as pool:
                pausing = pool.submit(vllm.post, "/pause?mode=keep")
                time.sleep(0.3)  # the pause waits in the core's input queue
                vllm.signal_engine_core(signal.SIGCONT)
                pausing.result().raise_for_status()
            return vllm.generated_tokens() - generated_before < requests * tokens
        vllm.signal_engine_core(signal.SIGCONT)
    pytest.fail(f"the server generated no {10 * requests} tokens in 60 s")


def _serve_the_sessions_weights(vllm: RealVLLM) -> None:
    """Load the session's model again, unlabelled, as the other tests expect it."""
    vllm.post("/pause?mode=abort").raise_for_status()
    try:
        vllm.post("/collective_rpc", {"method": "reload_weights",
                                      "kwargs": {"weights_path": str(vllm.model_dir)}}).raise_for_status()
        vllm.post("/update_weight_version", {"new_version": "default"}).raise_for_status()
    finally:
        vllm.post("/resume").raise_for_status()

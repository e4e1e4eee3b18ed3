"""A vLLM producer process whose samples ignore EOS, so each is exactly ``--max-new-tokens`` long (the CLI
passes no sampling extras): ``python -m tests.integration._vllm_producer NS URL TOKENIZER ID TOKENS SAMPLES
CONCURRENCY [IDLE_S]`` (TOKENIZER ``-``: none, text prompts), the broker from ``ROLLSTREAM_BOOTSTRAP_SERVERS``;
checkpoints every ``ROLLSTREAM_TEST_CHECKPOINT_S`` seconds (default 0.3; 0: off). Its session timeout (8 s) and
startup timeout (60 s) leave the broker time to answer while vLLM keeps both cores of a small machine busy."""

from __future__ import annotations

import logging
import os
import sys

from rollstream.producers import ProducerSettings, RolloutProducer, make_engine


def main(namespace: str, url: str, tokenizer: str, producer_id: str, tokens: str, samples: str, concurrency: str,
         idle_s: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # where a life begins in a log kept across restarts
    logging.getLogger("tests.vllm_producer").info("%s starting", producer_id)
    settings = ProducerSettings(namespace=namespace, producer_id=producer_id, n_samples=int(samples),
                                concurrency=int(concurrency), max_new_tokens=int(tokens), temperature=0.8,
                                sampling_extra={"ignore_eos": True}, max_lag=1000,
                                checkpoint_interval_s=float(os.environ.get("ROLLSTREAM_TEST_CHECKPOINT_S", "0.3")),
                                session_timeout_s=8.0, startup_timeout_s=60.0, summary_interval_s=0,
                                exit_when_idle_s=float(idle_s) if idle_s else None)
    engine = make_engine("vllm", vllm_urls=[url], tokenizer=None if tokenizer == "-" else tokenizer)
    RolloutProducer(engine, settings).run_sync()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Rollout producers: take prompts from NS.prompts, generate and score a group per prompt, publish it to
NS.rollouts, and commit a prompt only once its group is durably written. Lag-gated, never blocking the loop."""

from rollstream.producers.engines import (
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    Completion,
    CustomEngine,
    Deadline,
    Engine,
    EngineCapabilities,
    EngineError,
    EnvironmentEngine,
    Generation,
    HFEngine,
    RetryPolicy,
    SamplingParams,
    SGLangEngine,
    SGLangHTTPEngine,
    SGLangSyncEngine,
    build_tiny_model,
    make_engine,
)
from rollstream.producers.metrics import ProducerStats
from rollstream.producers.policy import PolicyFollower
from rollstream.producers.prompts import PromptFileError, load_prompts
from rollstream.producers.publisher import PublishError
from rollstream.producers.rewards import Reward, RewardError, load_reward
from rollstream.producers.service import RolloutProducer
from rollstream.producers.settings import ProducerSettings

__all__ = [
    "Completion", "CustomEngine", "DEFAULT_GROUP_TIMEOUT_S", "DEFAULT_REQUEST_TIMEOUT_S", "Deadline", "Engine",
    "EngineCapabilities", "EngineError", "EnvironmentEngine", "Generation", "HFEngine",
    "PolicyFollower", "ProducerSettings", "ProducerStats", "PromptFileError", "PublishError", "RetryPolicy",
    "Reward", "RewardError", "RolloutProducer", "SGLangEngine", "SGLangHTTPEngine", "SGLangSyncEngine",
    "SamplingParams",
    "build_tiny_model", "load_prompts", "load_reward", "make_engine",
]

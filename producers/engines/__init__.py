"""Generation engines behind one interface (`Engine`): SGLang over HTTP, SGLang in-process, vLLM over
HTTP, transformers on CPU, a user's generate function, and any of the first four with an environment
(multi-turn). Each declares its `EngineCapabilities`; `EngineSettings` groups each engine's own options.
Heavy libraries are imported lazily."""

from rollstream.producers.engines._retry import DEFAULT_GROUP_TIMEOUT_S, Backoff, Deadline, RetryPolicy
from rollstream.producers.engines.base import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Completion,
    Engine,
    EngineCapabilities,
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.producers.engines.custom import CustomEngine
from rollstream.producers.engines.environment import EnvironmentEngine
from rollstream.producers.engines.factory import build_engine, make_engine
from rollstream.producers.engines.hf import HFEngine
from rollstream.producers.engines.options import (
    EngineSettings,
    EnvironmentOptions,
    HTTPEngineOptions,
    SGLangOptions,
    VLLMOptions,
)
from rollstream.producers.engines.sglang_engine import SGLangEngine
from rollstream.producers.engines.sglang_http import SGLangHTTPEngine, SGLangSyncEngine, WeightSync
from rollstream.producers.engines.tiny_model import build_tiny_model
from rollstream.producers.engines.vllm_http import VLLMHTTPEngine, VLLMSyncEngine

__all__ = [
    "Backoff", "Completion", "CustomEngine", "DEFAULT_GROUP_TIMEOUT_S", "DEFAULT_REQUEST_TIMEOUT_S", "Deadline",
    "Engine", "EngineCapabilities", "EngineError", "EngineSettings", "EnvironmentEngine", "EnvironmentOptions",
    "Generation", "HFEngine", "HTTPEngineOptions", "RetryPolicy", "SGLangEngine", "SGLangHTTPEngine", "SGLangOptions",
    "SGLangSyncEngine", "SamplingParams", "VLLMHTTPEngine", "VLLMOptions", "VLLMSyncEngine", "WeightSync",
    "build_engine", "build_tiny_model", "make_engine",
]

"""A single generation across checkpoints (the HTTP engines' samples): the checkpointed output as the first
segment of a `PartialRollout`, the state saved as tokens stream in, and the resumed sample's resume points.

A restored sample continues exactly as one aborted by a weight update does: its checkpointed tokens become the
rollout's first segment and the next request continues prompt + those tokens (`PartialRollout`), so what differs
from an uninterrupted sample is only where the output was cut. While a request streams (`StreamedChoice`), the
sample's state so far is saved at most every `Progress.interval_s` seconds, and once more when it finishes.
Tokens of unknown version are stamped with `Progress.version` (the version the producer stamps the group with),
so a resumed sample's checkpointed tokens keep the version their producer gave them. Pure but for the clock.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from rollstream.producers.engines._samples import PartialRollout
from rollstream.producers.engines.base import Completion, EngineError
from rollstream.producers.engines.progress import Progress, SampleState
from rollstream.producers.multiturn import version_spans
from rollstream.schemas import VersionSpan

PromptIds = Callable[[], Sequence[int] | None]
"""The prompt's token ids a sample continues, as far as its engine knows them now (None: not known)."""


async def checkpointed(progress: Progress | None, index: int, rollout: PartialRollout, *, prompt_ids: PromptIds,
                       run: Callable[[StreamSaver | None], Awaitable[Completion]],
                       learn: Callable[[Sequence[int] | None], None] | None = None) -> Completion:
    """Sample `index` with its checkpoints: kept as `progress` restores it when it had finished, else continued
    from its checkpoint (`restore`), run (`run` gets the `StreamSaver` the request's stream reports to; None
    without `progress`), saved once finished with the prompt's token ids (`prompt_ids`), and saying where it
    resumed (`resumed`). Continuing needs those ids: `learn` is handed the restored checkpoint's (an engine that
    sends text learns the ids its server tokenized it into); still not known, the sample starts again, said
    through `Progress.restarted`. Raises what `run` raises."""
    if progress is None:
        return await run(None)
    restored = progress.restored(index)
    if restored is not None and learn is not None:
        learn(restored.prompt_ids)
    if restored is not None and prompt_ids() is None:
        progress.restarted(index, "continuing needs the prompt's token ids, which its checkpoint does not hold "
                                  "(give --tokenizer)")
        restored = None
    if restored is not None and (kept := restore(rollout, restored)) is not None:
        return kept
    saver = StreamSaver(progress, index, rollout, restored, prompt_ids)
    done = await run(saver)
    saver.finished(done)
    return done if restored is None else resumed(done, restored, progress.version)


def restore(rollout: PartialRollout, state: SampleState) -> Completion | None:
    """Seed `rollout` with the checkpointed output of `state`: the finished sample when it had finished (or its
    tokens fill the budget), else None and `rollout.payload()` continues it."""
    spans = tuple(VersionSpan(**s) for s in version_spans(state.versions))
    seed = Completion(text=state.text, tokens=list(state.tokens), logprobs=state.logprobs,
                      finish_reason=state.finish_reason or "abort", version_spans=spans,
                      policy_version=spans[-1].version if spans else None)
    if state.finish_reason is not None:
        return resumed(seed, state, None)
    done = rollout.add(seed)
    return None if done is None else resumed(done, state, None)


def state_of(completion: Completion, restored: SampleState | None, *, finished: bool,
             prompt_ids: Sequence[int] | None = None) -> SampleState:
    """What a checkpoint of the sample holds now (`completion`: its output so far, joined; `prompt_ids`: the
    prompt's token ids it continues, where known)."""
    versions: list[int | None] = [None] * len(completion.tokens)
    for span in completion.version_spans:
        versions[span.start:span.end] = [span.version] * (span.end - span.start)
    return SampleState(tokens=[int(t) for t in completion.tokens],
                       logprobs=None if completion.logprobs is None else [float(x) for x in completion.logprobs],
                       versions=versions, finish_reason=completion.finish_reason if finished else None,
                       resume_points=restored.resume_points if restored else (),
                       resumed_from=restored.resumed_from if restored else (), text=completion.text,
                       prompt_ids=None if prompt_ids is None else [int(t) for t in prompt_ids])


def resumed(completion: Completion, restored: SampleState, version: int | None) -> Completion:
    """`completion` (restored output + what followed) saying where it resumed; when the new tokens carry no
    version, the restored ones keep theirs and the new ones take `version` (None: left to the producer)."""
    out = replace(completion, resume_points=restored.resume_points, resumed_from=restored.resumed_from)
    if completion.version_spans or version is None or not version_spans(restored.versions):
        return out
    added = len(completion.tokens) - len(restored.tokens)
    spans = tuple(VersionSpan(**s) for s in version_spans([*restored.versions, *[version] * added]))
    return replace(out, version_spans=spans, policy_version=spans[-1].version)


class StreamSaver:
    """Saves a streaming sample's state at most every `Progress.interval_s` seconds (a `StreamedChoice`'s
    ``on_tokens``): the rollout's segments so far, then the output of the request streaming, and the prompt's
    token ids as `prompt_ids` knows them when it saves (None: not known). A sample that finishes within its first
    interval is not saved at all: generating it again costs less than the interval, the bound a checkpoint keeps,
    so a workload of short samples writes no checkpoint."""

    def __init__(self, progress: Progress, index: int, rollout: PartialRollout, restored: SampleState | None,
                 prompt_ids: PromptIds = lambda: None) -> None:
        self._progress, self._index, self._rollout, self._restored = progress, index, rollout, restored
        self._prompt_ids = prompt_ids
        self._last = self._started = time.monotonic()
        self._saved = False

    def __call__(self, streamed: object) -> None:
        now = time.monotonic()
        if now - self._last < self._progress.interval_s:
            return
        self._last = now
        try:
            partial = getattr(streamed, "partial")()  # noqa: B009 - any engine's streamed answer
        except EngineError:
            return  # a chunk that does not add up yet: the next one may
        self._save(self._rollout.so_far(partial), finished=False)

    def finished(self, completion: Completion) -> None:
        """Save the finished sample (kept as it is if the group is taken over before it is published), unless it
        finished within its first interval, unsaved and not restored (generated again, it costs less)."""
        short = time.monotonic() - self._started < self._progress.interval_s
        if self._saved or self._restored is not None or not short:
            self._save(completion, finished=True)

    def _save(self, completion: Completion, *, finished: bool) -> None:
        """Save `completion` with the versions its result will have: a restored sample's checkpointed tokens keep
        theirs when the new ones carry none (`resumed`)."""
        if self._restored is not None:
            completion = resumed(completion, self._restored, self._progress.version)
        self._progress.save(self._index, state_of(completion, self._restored, finished=finished,
                                                  prompt_ids=self._prompt_ids()))
        self._saved = True

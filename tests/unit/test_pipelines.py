"""The pipeline drivers. ShardedPipeline's own engine keeps the rank books only (it is fed
envelopes without records); a method that feeds an engine or asks it for verdicts, reached
by inheritance, would run those books as a full engine and find nothing, silently."""

from __future__ import annotations

import inspect
import re

from commcheck.collector.pipeline import Pipeline, PipelineBase
from commcheck.collector.shards import ShardedPipeline

# Engine methods that decide (or feed what they decide from).
DECIDING = re.compile(r"\bengine\.(ingest|ingest_many|check_hangs|finish)\(")


def _inherited(cls: type) -> dict[str, type]:
    """Methods of ``cls`` that it does not define itself, with the class they come from."""
    out = {}
    for name in dir(cls):
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if owner not in (cls, object) and inspect.isfunction(getattr(cls, name)):
            out[name] = owner
    return out


def test_the_sharded_pipeline_inherits_nothing_that_decides():
    assert not issubclass(ShardedPipeline, Pipeline)
    assert not hasattr(ShardedPipeline, "feed_batch")
    assert not ShardedPipeline.__abstractmethods__  # every abstract step is its own
    inherited = _inherited(ShardedPipeline)
    assert set(inherited.values()) == {PipelineBase}, inherited
    for name in inherited:
        source = inspect.getsource(getattr(ShardedPipeline, name))
        assert not DECIDING.search(source), f"ShardedPipeline.{name} inherits: {source}"
    # the check itself sees what the one-engine driver does
    assert DECIDING.search(inspect.getsource(Pipeline.feed_decoded))

"""Device-resident FIFO ring buffer of rollouts: pure ``init`` / ``add`` / ``sample``."""

from jaxreplay.replay.buffer import BufferState, SampleResult, add, init, sample

__all__ = ["BufferState", "SampleResult", "add", "init", "sample"]

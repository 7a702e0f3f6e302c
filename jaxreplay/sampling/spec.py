"""The ``sampler`` config section: how rollouts are decoded."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxreplay.spec import Spec, field


@dataclasses.dataclass(frozen=True)
class SamplingSpec(Spec):
  """The ``sampler`` section: the behaviour policy's decoding and the decode engine's shape.

  ``temperature``, ``top_k`` and ``top_p`` define the behaviour distribution; the learner
  recomputes log-probs under the same truncated distribution (``scoring``), so a fresh
  rollout's importance ratio is 1 at identical parameters.

  Attributes:
    max_new_tokens: >= 1, the longest completion, in tokens.
    temperature: > 0, the softmax temperature of the behaviour policy.
    top_k: >= 0, keep the k most likely tokens (0 = off).
    top_p: in (0, 1], keep the smallest set of tokens with this much mass (1 = off).
    slots: >= 0, rows the decode engine runs at once (0 = one per rollout); a finished row's
      slot takes the next request.
    chunk_steps: >= 1, decode steps between the engine's host checks (refill, batch shrink,
      attention width); a finished row idles at most this many steps.
    paged: the engine keeps its KV cache in a pool of pages (``sampling.paged``): a group's
      prompt pages are shared by its G samples and a slot holds only the pages it has
      filled; False keeps one contiguous cache of prompt width + max_new_tokens per slot.
      The held-out evaluation decodes on the same kind of cache (with its own slots,
      ``eval.batch_rows``).
    page_size: >= 1, positions per page of the paged cache.
    num_pages: >= 0, pages in the paged pool (0 = enough for every slot at full length); a
      smaller pool admits fewer requests at once (each waits until its full length fits).
      The evaluation's pool has the same size.
    attention: the paged decode attention: 'xla' (a gather of the slot's pages), 'pallas'
      (JAX's Pallas paged-attention kernel of the GPU or TPU, the xla path elsewhere or for
      shapes it cannot take) or 'auto' (the kernel on GPU/TPU, xla on CPU).
    overlap_host_check: dispatch each decode chunk before the host reads the one before it
      (contiguous cache): the device never waits for the host's refill check, but a freed
      slot is refilled one chunk later (it idles up to 2 × chunk_steps steps instead of
      chunk_steps), and the attention width covers the chunk in flight. Without an
      in-flight weight swap the tokens are the same either way (a swap lands at other steps
      of the requests); which is faster depends on the host's round trip against a chunk's
      decode time (docs/performance.md). In the actor–learner split with several
      processes, the weight source's agreement before every chunk reads a small program
      back from the generator mesh, which waits for the chunk in flight: no overlap there.
    on_weight_swap: what an in-flight weight update does to the decoding slots:
      'recompute' re-prefills their tokens so far with the new parameters (each token then
      comes from one policy version), 'keep_kv' keeps their keys and values, as PipelineRL
      does (no re-prefill; the tokens after the swap come from the new parameters over the
      old cache, and each records the log-prob it was drawn with and the version of the
      parameters that computed its logits).
  """

  SECTION: ClassVar[str] = "sampler"

  max_new_tokens: int = field(6, ge=1)
  temperature: float = field(1.0, gt=0)
  top_k: int = field(0, ge=0, allowed="(0 = off)")
  top_p: float = field(1.0, gt=0, le=1, allowed="(1 = off)")
  slots: int = field(0, ge=0, allowed="(0 = one per rollout)")
  chunk_steps: int = field(16, ge=1)
  paged: bool = field(False)
  page_size: int = field(16, ge=1)
  num_pages: int = field(0, ge=0, allowed="(0 = every slot at full length)")
  attention: str = field("auto", choices=("auto", "xla", "pallas"))
  overlap_host_check: bool = field(False)
  on_weight_swap: str = field("recompute", choices=("recompute", "keep_kv"))

  def with_overrides(self, temperature: float | None = None,
                     top_p: float | None = None) -> SamplingSpec:
    """This spec with ``temperature`` / ``top_p`` replaced where given (evaluation's)."""
    return dataclasses.replace(self, temperature=temperature or self.temperature,
                               top_p=top_p or self.top_p)

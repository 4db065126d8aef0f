"""What every decoder takes and returns: requests in, token ids and per-step traces out.

Metrics are never computed here: the harness derives them from the traces (see docs/metrics.md).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Step kinds, per request row of a step.
PREFILL = "prefill"  # a chunk of the prompt (commits the first token when it is the last chunk)
DECODE = "decode"  # AR: one token, full attention
DRAFT = "draft"  # one draft token through a sparse view (committed only once verified)
VERIFY = "verify"  # d+1 tokens with full attention; commits accepted + 1


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    # Called on the committed output ids; returns the length to keep when a stop string ended
    # the request, else None. Built by the caller (it may need the tokenizer); decoders only call it.
    stop_check: Callable[[list[int]], int | None] | None = None
    # The target's own greedy continuation, known in hindsight: only oracle schedulers read it.
    reference_ids: list[int] | None = None
    # Called with (output ids, finish reason) as soon as the request finishes: lets a caller write
    # each result out while the others still run.
    on_finish: Callable[[list[int], str], None] | None = None


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_in_range(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether these settings define a distribution: temperature >= 0, top_k >= 0 (0 = off) and
    0 < top_p <= 1 (1 = off; top_p <= 0 keeps nothing)."""
    return temperature >= 0 and top_k >= 0 and 0 < top_p <= 1


# The ASPIRE paper's sampling setting (temperature 0.7, top-k 50, top-p 0.9).
PAPER_SAMPLING = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)


@dataclass
class RowTrace:
    """One request's part in one engine step."""

    request: str
    kind: str  # PREFILL | DECODE | DRAFT | VERIFY
    n_tokens: int  # tokens this row put through the forward pass
    committed: int = 0  # output tokens committed by this row in this step
    drafted: int = 0  # VERIFY: draft tokens checked (d_i)
    accepted: int = 0  # VERIFY: draft tokens accepted (a_i); committed = accepted + 1
    kv_read: int = 0  # KV positions attended per layer (full: context length; sparse: view size)
    kv_sparse: int = 0  # the part of kv_read gathered scattered through a sparse view (ForwardOutput.kv_sparse)
    kv_captured: int = 0  # KV positions whose scores the row captured (ForwardOutput.kv_captured)
    kv_layered: int = 0  # the part of kv_sparse read through views that differ per layer (loop.shaped_reads)
    kv_topk: int = 0  # the part of kv_captured captured as per-token scores for a top-k (loop.shaped_reads)


@dataclass
class StepTrace:
    """One engine forward pass (one `engine.forward`) and what it did for each row."""

    index: int
    t_start: float  # time.perf_counter() seconds, same clock for the whole generate call
    t_end: float
    rows: list[RowTrace] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows)

    @property
    def wall(self) -> float:
        return self.t_end - self.t_start


@dataclass
class ParityMargins:
    """Greedy AR's record per output position, the teacher-forced reference of exactness parity
    (harness/parity.py): its top-1 minus top-2 logit, its top-2 token and its top-1 logit."""
    margin: list[float] = field(default_factory=list)
    runner_up: list[int] = field(default_factory=list)
    top_logit: list[float] = field(default_factory=list)  # scales the near-tie threshold


@dataclass
class RequestResult:
    id: str
    output_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    # Time (perf_counter) each output token was committed; tokens committed by one verification
    # share its time. len(token_times) == len(output_ids).
    token_times: list[float] = field(default_factory=list)
    t_arrival: float = 0.0  # when generate() started (all requests of an offline run arrive at once)
    t_prefill_start: float = 0.0  # when this request's prefill started (after queueing)
    # Per verification: (drafted, accepted). Empty for AR.
    verifications: list[tuple[int, int]] = field(default_factory=list)
    margins: ParityMargins | None = None  # greedy AR only
    # Per verification, in the order of `verifications`, what the policy decided it with (replayed by
    # the simulator): ASPIRE's {"alpha", "c", "gamma"} (adaptive) or {"gamma"}, a fixed-gamma policy's
    # {"gamma"}. None where the policy records none (AR) or the request never verified.
    schedule: list[dict] | None = None
    draft_lengths: list[int] | None = None  # ASPIRE: the draft length of each verification
    # A plug-in decoder's own per-request data, JSON-serialisable; nothing the project reads.
    extra: dict = field(default_factory=dict)


@dataclass
class GenerationOutput:
    results: list[RequestResult]  # in the order of the input requests
    steps: list[StepTrace]
    t_start: float
    t_end: float
    info: dict = field(default_factory=dict)  # decoder settings actually used, calibration source, ...


class SupportsGenerate(Protocol):
    """What the harness calls on a decoder (loop.Decoder, the class every decoder subclasses, has it)."""
    name: str

    def generate(
        self, engine, requests: Sequence[Request], params: SamplingParams, batch_size: int,
        progress: Callable[[int], None] | None = None,
    ) -> GenerationOutput:
        """Generate for every request with at most `batch_size` active at once (continuous
        batching). `progress(n)` is called with the number of tokens committed by each step (0 after each chunk of
        a prompt's prefill, so that a long prefill shows progress too)."""
        ...

"""`aspire-bench diagnose heterogeneity`: how many of D drafted tokens each request gets accepted, on
average and from one verification round to the next, with a decoder's own sparse view (the ASPIRE
paper's case for per-request scheduling). Runs the decoder through its public API with a fixed draft
length and reads each request's verification history; no decoder internals."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ..decoders import SamplingParams, get_decoder
from ..errors import ConfigError
from ..harness import records
from ..harness.runner import RunConfig, build_requests, load_engine
from ..progress import TokenProgress


@dataclass
class HeterogeneityConfig:
    model: str = "tiny"
    task: str = "code-completion"
    context_len: str | None = None
    data: str | None = None
    decoder: str = "aspire"
    decoder_args: dict = field(default_factory=dict)  # further settings; the draft length is set here
    draft_len: int = 20
    requests: int = 16
    max_new_tokens: int = 128
    batch_size: int = 8
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"


def fixed_draft_settings(decoder: str, draft_len: int) -> dict:
    """The settings that make `decoder` draft exactly draft_len tokens before every verification
    (fewer only where the request ends)."""
    if draft_len < 1:
        raise ConfigError("--draft-len must be at least 1")
    if decoder == "ar":
        raise ConfigError("ar does not draft: choose a speculative decoder (aspire, magicdec, vegas, ...)")
    if decoder.startswith("aspire"):
        # The fixed policy never reads the cost model: no calibration is measured for it.
        return {"policy": "fixed", "gamma": draft_len, "d_max": draft_len, "calibration": "none"}
    return {"gamma": draft_len}


def request_stats(verifications, draft_len: int) -> dict:
    """Accepted drafts per full round (drafted == draft_len): mean, population std, min, max."""
    acc = [a for d, a in verifications if d == draft_len]
    if not acc:
        return {"rounds": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"rounds": len(acc), "mean": statistics.fmean(acc), "std": statistics.pstdev(acc),
            "min": min(acc), "max": max(acc)}


def distribution(values: list[float]) -> dict:
    """min, quartiles (inclusive method: the quartiles of the values themselves), max, mean."""
    if not values:
        return {"n": 0, "min": None, "q1": None, "median": None, "q3": None, "max": None, "mean": None}
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"n": len(values), "min": min(values), "q1": q1, "median": med, "q3": q3, "max": max(values),
            "mean": statistics.fmean(values)}


@dataclass
class HeterogeneityResult:
    config: dict
    requests: list[dict]  # per request: id, prompt_len, rounds, mean, std, min, max, accepted (per round)
    summary: dict  # distribution of the per-request means
    record: records.RunRecord

    def to_json(self) -> dict:
        return {"decoder": self.config["decoder"], "draft_len": self.config["draft_len"],
                "settings": self.config["decoder_args"], "requests": self.requests, "summary": self.summary}


def diagnose_heterogeneity(cfg: HeterogeneityConfig, show_progress: bool = True) -> HeterogeneityResult:
    settings = {**cfg.decoder_args, **fixed_draft_settings(cfg.decoder, cfg.draft_len)}
    clash = sorted(k for k in cfg.decoder_args if k in settings and cfg.decoder_args[k] != settings[k])
    if clash:
        raise ConfigError(f"--decoder-arg {', '.join(clash)} is set by --draft-len here: drop it")
    dec = get_decoder(cfg.decoder, **settings)  # a bad name or setting fails before the model loads
    engine = load_engine(cfg.model, cfg.dtype, cfg.device, cfg.attention_backend)
    run_cfg = RunConfig(model=cfg.model, task=cfg.task, data=cfg.data, limit=cfg.requests,
                        context_len=cfg.context_len, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    _, _, reqs = build_requests(run_cfg, engine)
    # Greedy, EOS ignored: every request drafts over the same number of new tokens.
    params = SamplingParams(seed=cfg.seed)
    with TokenProgress(sum(r.max_new_tokens for r in reqs), f"{cfg.decoder} D={cfg.draft_len}",
                       disable=not show_progress) as bar:
        out = dec.generate(engine, reqs, params, cfg.batch_size, progress=bar.advance)
    prompt_lens = {r.id: len(r.prompt_ids) for r in reqs}
    per = []
    for r in out.results:
        per.append({"id": r.id, "prompt_len": prompt_lens[r.id], **request_stats(r.verifications, cfg.draft_len),
                    "accepted": [a for d, a in r.verifications if d == cfg.draft_len]})
    summary = distribution([p["mean"] for p in per if p["mean"] is not None])
    config = {"diagnostic": "heterogeneity", **asdict(cfg), "decoder_args": settings}
    record = records.from_output(config, out, prompt_lens, records.capture_environment())
    record.kind = "diagnostic"
    record.set_section("heterogeneity", {"requests": per, "summary": summary})
    record.aggregates.update({f"accepted_len_{k}": v for k, v in summary.items()})
    return HeterogeneityResult(config, per, summary, record)

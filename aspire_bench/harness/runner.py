"""Run a decoder on a task: samples in, timed generation, scores, parity, one stored record out."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from ..decoders import SamplingParams, check_for_model, get_decoder
from ..decoders.base import GenerationOutput
from ..engine import Engine
from ..errors import ConfigError
from ..tasks import get_task
from . import metrics, records
from .generation import build_requests, cached_prefix, generate
from .parity import against_ar, check_tolerance
from .schema import check_run_settings
from .store import check_store_path, save_record


@dataclass
class RunConfig:
    model: str = "tiny"
    decoder: str = "ar"
    decoder_args: dict = field(default_factory=dict)
    task: str = "code-completion"
    data: str | None = None
    limit: int | None = 8
    context_len: str | None = None
    batch_size: int = 8
    max_new_tokens: int | None = None  # None = the task's default
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repeat: int = 1
    parity: bool = False
    # Relative near-tie tolerance for parity (harness/parity.py); None = the dtype's default.
    parity_tolerance: float | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    warmup: bool = True
    # Generate exactly max_new_tokens per request (EOS and stop strings ignored), as throughput
    # benchmarks do: under sampling, decoders would otherwise stop at different points and do different work.
    ignore_eos: bool = False
    # Under sampling, ignore EOS (as ignore_eos) so every decoder of a group does the same work; task
    # scores still come from the text up to the first EOS. False marks the group "unequal work".
    equal_work: bool = True
    # Decoders with a tune_grid (e.g. a baseline's draft length): pick those settings on separate tuning requests first.
    tune: bool = False
    # Prefill each distinct prompt once per process and copy its KV in afterwards (decode figures
    # exclude prefill; TTFT then measures a copy, not a prefill). For demos and side-by-side sweeps.
    prefix_cache: bool = False
    # Rope scaling that replaces the checkpoint's (config.json's rope_scaling form), e.g. YaRN past the
    # native context; None keeps the checkpoint's own.
    rope_scaling: dict | None = None

    @property
    def eos_ignored(self) -> bool:
        return self.ignore_eos or (self.equal_work and self.temperature > 0)

    def identity(self) -> dict:
        """What makes two runs the same experiment (hashed into config_hash); an unset rope_scaling is left
        out, so runs stored before it existed keep their hash."""
        d = asdict(self)
        if d["rope_scaling"] is None:
            del d["rope_scaling"]
        return d


@dataclass(repr=False)
class RunResult:
    run_id: int | None
    record: records.RunRecord
    store: str | None = None  # where the run was stored (None: not stored)

    @property
    def aggregates(self) -> dict:
        return self.record.aggregates

    def __getitem__(self, key):
        return self.record.aggregates[key]

    def __repr__(self) -> str:
        """One line: the run's identity, its headline figures, where it is stored."""
        c, a = self.record.config, self.record.aggregates
        figures = ", ".join(f"{k}={a[k]:.4g}" for k in REPR_FIGURES if isinstance(a.get(k), (int, float)))
        return (f"RunResult(run_id={self.run_id}, store={self.store!r}, decoder={c.get('decoder')!r}, "
                f"task={c.get('task')!r}, context_len={c.get('context_len')!r}, batch_size={c.get('batch_size')}, "
                f"status={self.record.status!r}{', ' + figures if figures else ''})")


# The figures a RunResult's repr shows (all are in .aggregates).
REPR_FIGURES = ("decode_tok_s", "speedup_vs_ar", "mean_accepted_len", "draft_acceptance_rate", "tpot_median_s",
                "parity_identical_pct", "score_mean")


def load_engine(model: str, dtype: str, device: str, attention_backend: str,
                rope_scaling: dict | None = None) -> Engine:
    """One engine per (model, dtype, device, backend, rope scaling) per process: sweeps and side-by-side
    comparisons load the weights once."""
    key = None if rope_scaling is None else records.canonical_json(rope_scaling)
    return _load_engine(model, dtype, device, attention_backend, key)


@lru_cache(maxsize=2)
def _load_engine(model: str, dtype: str, device: str, attention_backend: str, rope_key: str | None) -> Engine:
    import json
    rope = None if rope_key is None else json.loads(rope_key)
    return Engine.from_pretrained(model, dtype, device, attention_backend, rope_scaling=rope)


@dataclass
class Prepared:
    """A run ready to measure: requests built, decoder settings resolved (tuned), warm-up done."""
    cfg: RunConfig
    engine: Engine
    task: object
    samples: list
    reqs: list
    params: SamplingParams
    decoder_args: dict = field(default_factory=dict)  # cfg.decoder_args plus the tuned settings
    reference: GenerationOutput | None = None  # the oracle's AR output (greedy only)
    decoder: object = None  # built once from decoder_args; warm-up and every repeat run it
    info: records.RunInfo = field(default_factory=dict)  # sections kept with the record (tuning, bench's)


def prepare(cfg: RunConfig, engine: Engine | None = None, show_progress: bool = True) -> Prepared:
    check_run_settings(cfg.identity())  # types and ranges: nothing is clamped or replaced
    if check_tolerance(cfg.parity_tolerance) is not None and not cfg.parity:
        raise ConfigError("--parity-tolerance applies to the parity comparison: add --parity")
    probe = get_decoder(cfg.decoder, **cfg.decoder_args)  # fail fast on a bad decoder or setting
    if cfg.data is not None and not get_task(cfg.task).reads_data:
        raise ConfigError(f"task {cfg.task} makes its own prompts and reads no --data: drop --data")
    if engine is None:  # a caller's own engine keeps its prefix cache as the caller set it
        engine = load_engine(cfg.model, cfg.dtype, cfg.device, cfg.attention_backend, cfg.rope_scaling)
        if not cfg.prefix_cache:
            engine.prefix_cache = None
        elif engine.prefix_cache is None:
            engine.prefix_cache = {}
    check_for_model(probe, engine.cfg.num_layers)  # e.g. a layer index: the model is known, nothing computed yet
    task, samples, reqs = build_requests(cfg, engine)
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed,
                            () if cfg.eos_ignored else engine.cfg.eos_token_ids)
    if cfg.eos_ignored:
        reqs = [replace(r, stop_check=None) for r in reqs]
    p = Prepared(cfg, engine, task, samples, reqs, params, dict(cfg.decoder_args))
    if cfg.tune:
        from .tuning import tune
        p.info["tuning"] = tune(cfg, engine, reqs, params, show_progress)
        p.decoder_args.update(p.info["tuning"]["settings"])
    if getattr(probe, "needs_reference", False):  # oracle: the target's greedy tokens, known in hindsight
        if not params.greedy:
            raise ConfigError(f"{cfg.decoder} knows the target's tokens only under greedy decoding: "
                              "use --temperature 0")
        p.reference = generate("ar", {}, engine, reqs, params, cfg.batch_size, "reference (ar)", show_progress)
        for r, a in zip(reqs, p.reference.results):
            r.reference_ids = a.output_ids
    p.decoder = probe if p.decoder_args == cfg.decoder_args else get_decoder(cfg.decoder, **p.decoder_args)
    if callable(getattr(p.decoder, "prepare", None)):  # what the run needs measured first (a calibration)
        p.decoder.prepare(engine, cfg.batch_size, reqs)
    if cfg.warmup:
        warm_up(p, show_progress)
    return p


def warm_up(p: Prepared, show_progress: bool = False) -> None:
    """A short generate (allocator, kernels, caches), excluded from every figure. With a prefix cache,
    every prompt is prefilled here too, so no measured run (the first decoder of a group) pays prefills
    that the others get from the cache. Its progress shows unless every prompt is cached already (a
    32k prefill is minutes of work)."""
    warm = [replace(r, max_new_tokens=min(4, r.max_new_tokens)) for r in p.reqs[:p.cfg.batch_size]]
    show = show_progress and not all(p.engine.has_prefix(cached_prefix(r)) for r in p.reqs)
    generate(p.decoder, {}, p.engine, warm, p.params, p.cfg.batch_size, "warm-up (prefill)", show)
    if p.engine.prefix_cache is not None:
        prime = [replace(r, max_new_tokens=1) for r in p.reqs[p.cfg.batch_size:]]
        if prime:
            generate("ar", {}, p.engine, prime, p.params, p.cfg.batch_size, "prefill", show)


def measure_repeat(p: Prepared, i: int, show_progress: bool = True) -> GenerationOutput:
    """Measured repeat i: its own sampling seed (seed + i), the same requests."""
    params = replace(p.params, seed=p.cfg.seed + i)
    return generate(p.decoder, {}, p.engine, p.reqs, params, p.cfg.batch_size,
                    f"{p.cfg.decoder} {i + 1}/{p.cfg.repeat}", show_progress)


def traced_repeat(outputs: list[GenerationOutput]) -> int:
    """The repeat whose requests and trace a run's record keeps: the median one by decode tok/s."""
    rates = [metrics.decode_tok_s(o) or 0.0 for o in outputs]
    return rates.index(statistics.median_low(rates))


def finish(p: Prepared, outputs: list[GenerationOutput], *, store: str | None = None, group: str | None = None,
           sweep: str | None = None, tag: str | None = None, show_progress: bool = True,
           percentiles=metrics.DEFAULT_PERCENTILES, ar=None, parity_tolerance: float | None = None) -> RunResult:
    """Scores, parity and the stored record of a run's measured repeats. ar: AR's results on the same
    requests (RequestResults or stored RequestRows) to compare with, e.g. the AR run of a bench cell, at
    parity_tolerance (None: cfg's); without it, --parity compares with the oracle's reference, the run
    itself (AR) or a fresh AR run."""
    cfg, engine, reqs, params = p.cfg, p.engine, p.reqs, p.params
    output = outputs[traced_repeat(outputs)]

    parity = ar_run = None
    if cfg.parity or ar is not None:
        if not params.greedy:
            raise ConfigError("--parity compares greedy outputs token for token: use --temperature 0")
        if ar is None:
            ref = p.reference
            if ref is None:
                ref = output if cfg.decoder == "ar" else generate("ar", {}, engine, reqs, params, cfg.batch_size,
                                                                   "parity (ar)", show_progress)
            ar = ref.results
            ar_run = ref if ref is not output else None
        tolerance = cfg.parity_tolerance if parity_tolerance is None else parity_tolerance
        parity = against_ar(output.results, ar, tolerance, engine.dtype)
    tok = engine.tokenizer
    eos = set(engine.cfg.eos_token_ids) if cfg.eos_ignored else set()
    texts = {r.id: tok.decode(_until_eos(r.output_ids, eos), skip_special_tokens=True) for r in output.results}
    scores = {s.id: p.task.score(s, texts[s.id]) for s in p.samples}
    # Resolved decoder settings go to record.info (may include fitted values), not to the config.
    record = records.from_output(cfg.identity(), output, {r.id: len(r.prompt_ids) for r in reqs},
                                 records.capture_environment(), texts=texts, scores=scores, parity=parity,
                                 repeats=outputs, info=p.info, backend=engine.backend.name, dtype=engine.dtype,
                                 sweep=sweep, tag=tag, group=group, percentiles=percentiles)
    if ar_run is not None:
        record.aggregates.update(speedup_over(output, ar_run))
    run_id = None
    if store is not None:
        run_id = save_record(store, record)  # a recovery JSONL beside the store if saving fails
    return RunResult(run_id, record, None if store is None else str(store))


def speedup_over(output: GenerationOutput, ar: GenerationOutput) -> dict:
    """`speedup_vs_ar` and its 95% interval (`_ci95_low`, `_ci95_high`) of a run over the AR run of the
    same requests in the same invocation (--parity's reference), as bench computes them per cell."""
    num, den = metrics.request_decode_times(output), metrics.request_decode_times(ar)
    ci = metrics.ratio_ci(num, den) or (None, None)
    return {"speedup_vs_ar": metrics.ratio(num, den), "speedup_vs_ar_ci95_low": ci[0],
            "speedup_vs_ar_ci95_high": ci[1]}


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """The tokens a task scores: up to (without) the first EOS when EOS was ignored for equal work."""
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def run(cfg: RunConfig | None = None, *, store: str | None = None, group: str | None = None,
        sweep: str | None = None, tag: str | None = None, show_progress: bool = True,
        engine: Engine | None = None, percentiles=metrics.DEFAULT_PERCENTILES, **overrides) -> RunResult:
    """Python API of `aspire-bench run`; keyword overrides apply to RunConfig fields."""
    cfg = cfg or RunConfig()
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            from ..errors import did_you_mean
            raise ConfigError(f"unknown run option {k!r}{did_you_mean(k, list(RunConfig.__dataclass_fields__))}")
        setattr(cfg, k, v)
    metrics.check_percentiles(percentiles)
    if store is not None:
        check_store_path(store)  # a bad --store fails now, not after the compute
    p = prepare(cfg, engine, show_progress)
    outputs = [measure_repeat(p, i, show_progress) for i in range(p.cfg.repeat)]
    return finish(p, outputs, store=store, group=group, sweep=sweep, tag=tag, show_progress=show_progress,
                  percentiles=percentiles)

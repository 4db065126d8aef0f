"""`aspire-bench diagnose recall`: mass recall@k of each attention predictor on a model, a task and a
context bucket, teacher-forced over reference (or greedy) continuations."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..decoders import Request, SamplingParams, get_decoder
from ..errors import ConfigError
from ..harness.runner import RunConfig, build_requests, load_engine
from ..progress import TokenProgress
from .capture import HEADS, capture_scores, token_engine
from .recall import FAMILIES, RecallAccumulator, RecallSpec
from .records import diagnostic_record

CONTINUATIONS = ("auto", "reference", "greedy")


@dataclass
class RecallConfig:
    model: str = "tiny"
    task: str = "code-completion"
    context_len: str | None = None
    data: str | None = None
    requests: int = 4
    positions: int = 32  # query positions per request (fewer when the continuation is shorter)
    continuation: str = "auto"  # auto: the task's reference text when it has one, else greedy
    heads: str = "max"
    k_tokens: tuple[int, ...] = (256, 1024)
    k_pages: tuple[int, ...] = (32, 64)
    page_size: int | None = None  # None: the engine's
    lags: tuple[int, ...] = (1, 2, 4, 8, 16)
    sinks: int = 16
    vegas_gamma: int = 6
    predictors: tuple[str, ...] = FAMILIES
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    batch_size: int = 8  # for the greedy continuations

    def check(self) -> None:
        if self.continuation not in CONTINUATIONS:
            raise ConfigError(f"unknown continuation {self.continuation!r}: choose one of {', '.join(CONTINUATIONS)}")
        if self.heads not in HEADS:
            raise ConfigError(f"unknown head reduction {self.heads!r}: choose one of {', '.join(HEADS)}")
        bad = [p for p in self.predictors if p not in FAMILIES]
        if bad or not self.predictors:
            raise ConfigError(f"unknown predictor {', '.join(bad) or '(none)'}: choose from {', '.join(FAMILIES)}")
        if not (self.k_tokens or self.k_pages):
            raise ConfigError("give at least one k (--k-tokens or --k-pages)")
        for name in ("requests", "positions", "vegas_gamma", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1")
        if self.sinks < 0 or self.page_size is not None and self.page_size < 1:
            raise ConfigError("sinks must be >= 0 and the page size >= 1")
        if any(k < 1 for k in (*self.k_tokens, *self.k_pages, *self.lags)):
            raise ConfigError("every k and lag must be at least 1")

    def spec(self, page_size: int) -> RecallSpec:
        return RecallSpec(tuple(self.k_tokens), tuple(self.k_pages), page_size, tuple(self.lags), self.sinks,
                          self.vegas_gamma, tuple(self.predictors))

    def to_config(self, page_size: int) -> dict:
        d = {"diagnostic": "recall", **asdict(self), "page_size": page_size}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclass
class RecallResult:
    rows: list[dict]
    config: dict
    requests: list[dict] = field(default_factory=list)  # per request: id, prompt length, positions, source


def _continuations(cfg: RecallConfig, engine, samples, reqs, show: bool) -> list[tuple[list[int], str]]:
    """Per request (continuation ids, "reference" | "greedy")."""
    tok = engine.tokenizer
    out: list = [None] * len(reqs)
    for i, s in enumerate(samples):
        ref = s.reference if isinstance(s.reference, str) else None
        ids = list(tok.encode(ref, add_special_tokens=False)) if ref else []
        if cfg.continuation == "reference" and not ids:
            raise ConfigError(f"task {cfg.task} has no reference text for sample {s.id}: use --continuation greedy")
        if cfg.continuation != "greedy" and ids:
            out[i] = (ids[:cfg.positions], "reference")
    todo = [i for i, o in enumerate(out) if o is None]
    if todo:
        greedy = [Request(reqs[i].id, reqs[i].prompt_ids, cfg.positions) for i in todo]
        params = SamplingParams(eos_token_ids=engine.cfg.eos_token_ids)
        with TokenProgress(len(greedy) * cfg.positions, "greedy continuations", disable=not show) as bar:
            gen = get_decoder("ar").generate(engine, greedy, params, cfg.batch_size, progress=bar.advance)
        for i, r in zip(todo, gen.results):
            out[i] = (list(r.output_ids), "greedy")
    return out


def diagnose_recall(cfg: RecallConfig, show_progress: bool = True) -> RecallResult:
    cfg.check()
    engine = load_engine(cfg.model, cfg.dtype, cfg.device, cfg.attention_backend)
    page_size = cfg.page_size or engine.page_size
    spec = cfg.spec(page_size)
    run_cfg = RunConfig(model=cfg.model, task=cfg.task, data=cfg.data, limit=cfg.requests,
                        context_len=cfg.context_len, max_new_tokens=cfg.positions, seed=cfg.seed)
    _, samples, reqs = build_requests(run_cfg, engine)
    conts = _continuations(cfg, engine, samples, reqs, show_progress)
    teng = token_engine(engine)
    acc = RecallAccumulator(engine.cfg.num_layers, spec)
    h = spec.history
    plans = []
    for r, (cont, source) in zip(reqs, conts):
        P = len(r.prompt_ids)
        if P - 1 - h < 1:
            raise ConfigError(f"request {r.id} has a {P}-token prompt; the predictors need more than {h + 1}: "
                              "use a longer --context-len or smaller --lags / --vegas-gamma")
        n_q = max(1, min(cfg.positions, len(cont)))  # queries P-1 .. P-2+n_q predict cont[0..n_q-1]
        plans.append((r, list(r.prompt_ids) + cont[:n_q - 1], P, n_q, source))
    total = sum(h + n_q for *_, n_q, _ in plans)
    infos = []
    with TokenProgress(total, "capturing attention", disable=not show_progress) as bar:
        for r, ids, P, n_q, source in plans:
            scores, means = capture_scores(teng, ids, P - 1 - h, cfg.heads, "vegas" in spec.families, bar.advance)
            for t in range(P - 1, P - 1 + n_q):
                acc.add_query(t, scores, means)
            infos.append({"id": r.id, "prompt_len": P, "positions": n_q, "continuation": source})
            del scores, means
    return RecallResult(acc.rows(), cfg.to_config(page_size), infos)


def recall_record(result: RecallResult):
    """The stored run: every row in info, the mean over layers of each (predictor, unit, k) as an
    aggregate named recall:PREDICTOR:UNIT@K."""
    aggregates = {f"recall:{r['predictor']}:{r['unit']}@{r['k']}": r["recall"]
                  for r in result.rows if r["layer"] == "mean"}
    return diagnostic_record(result.config, {"recall": {"rows": result.rows, "requests": result.requests}},
                             aggregates)

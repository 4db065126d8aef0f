"""lm-eval model `aspire`: evaluate task accuracy with any aspire-bench decoder.

    lm-eval --model aspire --model_args pretrained=tiny,decoder=aspire,decoder.policy=fixed,decoder.gamma=4 ...

`generate_until` runs through the chosen decoder (one continuous-batching `generate` call per set
of generation settings), so a task's accuracy is measured with exactly the decoding that is being
benchmarked, and its throughput/acceptance can be stored beside the regular runs (`store=PATH`).
`loglikelihood` and `loglikelihood_rolling` do not decode: they run the engine's exact full-attention
forward, so their numbers are decoder-independent (as they should be). See docs/lm-eval.md.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .decoders import Request, SamplingParams, get_decoder, parse_value
from .decoders.base import sampling_in_range
from .engine import Row
from .errors import ConfigError

log = logging.getLogger(__name__)

# lm-eval's aliases for the number of new tokens, highest priority first (as its HF model reads them).
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# gen_kwargs we honour; anything else is reported once and ignored rather than silently dropped.
KNOWN_GEN_KWARGS = frozenset({"until", "do_sample", "temperature", "top_p", "top_k", *MAX_TOKEN_KEYS})
MODEL_ARGS = ("pretrained", "decoder", "dtype", "device", "batch_size", "max_length", "max_gen_toks", "store",
              "parity", "parity_tolerance", "ar_reference", "tag", "seed", "attention_backend", "add_bos_token",
              "equal_work", "revision", "trust_remote_code")


def _as_bool(value) -> bool | None:
    return parse_value(value) if isinstance(value, str) else (None if value is None else bool(value))


def decoder_settings(settings: dict) -> dict:
    """Decoder settings from model_args: every key must carry the `decoder.` prefix, so that model and
    decoder settings never share a name (a mistyped or HF-only model option is not a decoder setting)."""
    out = {}
    for key, value in settings.items():
        if not key.startswith("decoder."):
            raise ConfigError(f"unknown model_args key {key!r} for the aspire model: model settings are "
                              f"{', '.join(MODEL_ARGS)}; decoder settings take the prefix decoder. "
                              f"(e.g. decoder.gamma=4)")
        # lm-eval has already typed "4"/"true"; plain strings still go through our own parser.
        out[key[len("decoder."):].replace("-", "_")] = parse_value(value) if isinstance(value, str) else value
    return out


def ignored_settings(dec, given: dict) -> list[str]:
    """The given settings that the decoder reports as not in effect (None in its settings()), e.g.
    aspire's gamma outside policy=fixed: accepted silently, they would also enter the run's key."""
    active = dec.settings() if hasattr(dec, "settings") else {}
    return sorted(f"{k}={v}" for k, v in given.items() if k in active and active[k] is None and v is not None)


def _brief(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if not isinstance(v, dict))


def _as_int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not an integer") from None


@register_model("aspire")
class AspireLM(TemplateLM):
    """lm-eval model over an aspire-bench Engine and decoder. model_args: pretrained, decoder, decoder
    settings with the prefix `decoder.` (decoder.gamma=4, ...; from Python also decoder_args={...}),
    dtype (auto: the checkpoint's), device, batch_size, max_length, max_gen_toks, store, parity,
    parity_tolerance, ar_reference, tag, seed, attention_backend, add_bos_token, equal_work; revision and
    trust_remote_code are accepted for lm-eval's HF conventions."""

    def __init__(self, pretrained: str = "tiny", decoder: str = "ar", dtype: str = "float32", device: str = "cpu",
                 batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 store: str | None = None, parity: bool = False, parity_tolerance: float | None = None,
                 tag: str | None = None, seed: int = 0,
                 attention_backend: str = "auto", add_bos_token: bool | None = None, max_batch_size=None,
                 revision: str | None = None, trust_remote_code=None, ar_reference: bool = False,
                 equal_work: bool = True, decoder_args: dict | None = None, **settings):
        # max_batch_size: lm-eval passes it to every model; continuous batching has no use for it.
        super().__init__()
        from .harness.parity import check_tolerance
        from .harness.records import new_group_id
        from .harness.runner import load_engine

        self.pretrained = str(pretrained)
        self.decoder_name = str(decoder)
        self.decoder_args = {**(decoder_args or {}), **decoder_settings(settings)}
        # built once (fails fast on a bad decoder or setting); decoders keep no state between runs
        self.decoder = dec = get_decoder(self.decoder_name, **self.decoder_args)
        ignored = ignored_settings(dec, self.decoder_args)
        if ignored:
            raise ConfigError(f"decoder {self.decoder_name!r} ignores {', '.join(ignored)} with these settings "
                              f"(its settings: {_brief(dec.settings())}): remove {'it' if len(ignored) == 1 else 'them'}"
                              " or set what makes it apply (e.g. decoder.policy=fixed for aspire's gamma)")
        if revision is not None:
            log.warning("revision=%s changes nothing: pretrained is a local checkpoint directory (or tiny); "
                        "check out the revision you want there", revision)
        if _as_bool(trust_remote_code):
            log.warning("trust_remote_code=true changes nothing: the aspire model runs its own implementation "
                        "of the supported architectures, never code from the checkpoint")
        self.ar_reference = bool(_as_bool(ar_reference))
        if self.ar_reference and store is None:
            raise ConfigError("ar_reference=true stores an AR run beside each decoder run: give store=PATH")
        self.dtype, self.attention_backend = str(dtype), str(attention_backend)
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            log.warning("batch_size=%s: the aspire model has no auto batch size; using 8 "
                        "(continuous batching keeps up to that many requests active)", batch_size)
            batch_size = 8
        self.batch_size = _as_int(batch_size, "batch_size")
        if self.batch_size < 1:
            raise ConfigError("batch_size must be at least 1")
        self.max_gen_toks = _as_int(max_gen_toks, "max_gen_toks")
        self.store, self.parity, self.tag, self.seed = store, bool(_as_bool(parity)), tag, _as_int(seed, "seed")
        self.parity_tolerance = check_tolerance(parity_tolerance)
        if self.parity_tolerance is not None and not self.parity:
            raise ConfigError("parity_tolerance applies to the parity comparison: add parity=true")
        self.add_bos_token = _as_bool(add_bos_token)
        self.equal_work = bool(_as_bool(equal_work))
        self.group = new_group_id()  # the runs one lm-eval invocation records share a group
        if store is not None:  # a bad store fails now, before any evaluation
            from .harness.store import check_store_path
            check_store_path(store)

        self.engine = load_engine(self.pretrained, self.dtype, str(device), self.attention_backend)
        if self.dtype == "auto":  # runs are stored with the dtype they ran in
            self.dtype = str(self.engine.dtype).removeprefix("torch.")
        self._device = self.engine.device
        self.device_name = str(device)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ConfigError(f"{self.pretrained} has no tokenizer files; lm-eval tasks are text and need one")
        self._max_length = self.engine.max_context if max_length is None else _as_int(max_length, "max_length")
        if not 1 < self._max_length <= self.engine.max_context:
            raise ConfigError(f"max_length={self._max_length} must be between 2 and the model's maximum "
                              f"context of {self.engine.max_context}")
        eos = set(self.engine.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self._warned: set[str] = set()

    # --- construction from lm-eval's CLI / simple_evaluate ------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval always passes its own batch_size (CLI default 1) and device (CLI default cuda:0)
        # next to model_args; model_args win, and a defaulted CUDA device on a CPU-only machine
        # falls back to the CPU instead of failing.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        dev = extra.get("device")
        if "device" not in arg_dict and dev and str(dev).startswith("cuda") and not torch.cuda.is_available():
            log.warning("device=%s asked for but no CUDA device is available: using cpu", dev)
            extra["device"] = "cpu"
        return cls(**{**extra, **arg_dict})

    # --- what lm-eval asks of a model --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        # Conditions the first token of an empty context or a rolling window: BOS when there is one.
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", None) or self.pretrained).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        # continue_final_message: lm-eval passes add_generation_prompt=False when it prefills the
        # assistant turn (gen_prefix), which must then stay open.
        from jinja2.exceptions import TemplateError

        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except TemplateError:  # some templates reject a system turn (--system_instruction)
            self._warn_once("the chat template rejected the conversation: retrying without system messages")
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            bos = self.tokenizer.bos_token
            if bos and string.startswith(bos):  # a chat template already wrote the BOS
                add_special_tokens = False
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = list(self.tokenizer.encode(string, **kw))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- loglikelihood ----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        results = self.score_tokens(pairs)
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # Disjoint windows of at most max_length predicted tokens, each conditioned on the tokens
        # before it inside the window (lm-eval's own windowing, so perplexities match its HF model).
        windows, owner = [], []
        for i, req in enumerate(requests):
            for w in get_rolling_token_windows(token_list=self.tok_encode(req.args[0]),
                                               prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces it) per pair,
        through the engine's exact full-attention forward. Inputs longer than max_length keep their
        last max_length tokens (lm-eval's convention); a continuation longer than that is an error
        (use loglikelihood_rolling). Each request gets a fresh KV slot and runs in pieces of at most
        `prefill_chunk` tokens; logits are only materialised for the continuation's positions."""
        eng = self.engine
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        jobs = []  # (index, input ids, target ids of the scored positions)
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                continue
            if len(cont) > self.max_length:
                raise ConfigError(f"a continuation of {len(cont)} tokens is longer than max_length "
                                  f"{self.max_length}: score it with loglikelihood_rolling")
            seq = ((list(ctx) or [self.prefix_token_id]) + list(cont))[-(self.max_length + 1):]
            jobs.append((i, seq[:-1], cont))
        jobs.sort(key=lambda j: -len(j[1]))  # similar lengths together; the longest first sizes the pool
        chunk = eng.prefill_chunk
        # Scored pieces are shorter: their logits are [tokens x vocab] floats (150k-vocab models: 0.6 MB each).
        scored_chunk = min(chunk, 256)
        for b in range(0, len(jobs), self.batch_size):
            batch = jobs[b:b + self.batch_size]
            ps = eng.page_size
            eng.reserve(sum(-(-len(inp) // ps) * ps for _, inp, _ in batch))
            slots = [eng.alloc(len(inp)) for _, inp, _ in batch]
            # Pieces per request: the context in prefill chunks without logits, then the scored
            # part with them; a short request runs as one scored piece (one forward, not two).
            plans = []
            for _, inp, cont in batch:
                n, first, s, pieces = len(inp), len(inp) - len(cont), 0, []
                while s < n:
                    if s < first and n - s <= scored_chunk:
                        e, mode = n, "all"
                    elif s < first:
                        e, mode = min(s + chunk, first), "none"
                    else:
                        e, mode = min(s + scored_chunk, n), "all"
                    pieces.append((s, e, mode))
                    s = e
                plans.append(pieces)
            logits = [[] for _ in batch]
            try:
                for step in range(max(len(p) for p in plans)):
                    live = [k for k, p in enumerate(plans) if step < len(p)]
                    rows = [Row(slots[k], batch[k][1][plans[k][step][0]:plans[k][step][1]], plans[k][step][0],
                                logits=plans[k][step][2]) for k in live]
                    res = eng.forward(rows)
                    for k, lg in zip(live, res.logits):
                        start, _, mode = plans[k][step]
                        if mode == "all":  # keep the continuation's positions only
                            logits[k].append(lg[max(0, len(batch[k][1]) - len(batch[k][2]) - start):])
            finally:
                for s in slots:
                    eng.free(s)
            for k, (i, _, cont) in enumerate(batch):
                lp = torch.log_softmax(torch.cat(logits[k]).float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                logprob = float(lp.gather(-1, target[:, None]).sum())
                out[i] = (logprob, bool((lp.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    # --- generation -------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        texts: list[str | None] = [None] * len(requests)
        for idx in groups.values():
            for i, text in zip(idx, self._generate_group([requests[i] for i in idx], disable_tqdm)):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts  # type: ignore[return-value]

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning(msg)

    def sampling_settings(self, gen_kwargs: dict) -> tuple[list[str], int, SamplingParams]:
        """lm-eval gen_kwargs -> (stop strings, max new tokens, sampling parameters)."""
        kw = dict(gen_kwargs or {})
        until = kw.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        stops = [s for s in until + [eos_text] if s]  # "" would match everywhere
        stops = list(dict.fromkeys(stops))
        max_new = next((kw[k] for k in MAX_TOKEN_KEYS if kw.get(k) is not None), self.max_gen_toks)
        max_new = _as_int(max_new, "max_gen_toks")
        if not 0 < max_new < self.max_length:
            raise ConfigError(f"max_gen_toks={max_new} must be positive and below max_length {self.max_length}")
        temperature = float(kw.get("temperature") or 0.0)
        do_sample = kw.get("do_sample")
        if do_sample is False:
            temperature = 0.0  # greedy, whatever the temperature says (lm-eval's HF convention)
        elif do_sample and temperature == 0.0:
            temperature = 1.0  # transformers' default temperature when sampling
        unknown = sorted(set(kw) - KNOWN_GEN_KWARGS)
        if unknown:
            self._warn_once(f"aspire model ignores gen_kwargs {unknown}")
        top_k = _as_int(kw.get("top_k") or 0, "top_k")
        top_p = float(kw.get("top_p") if kw.get("top_p") is not None else 1.0)
        if not sampling_in_range(temperature, top_k, top_p):  # the ranges the CLI accepts
            raise ConfigError(f"gen_kwargs temperature={temperature}, top_k={top_k}, top_p={top_p}: need "
                              "temperature >= 0, top_k >= 0 (0 = off) and 0 < top_p <= 1 (1 = off)")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=self.seed, eos_token_ids=self.eos_token_ids)
        return stops, max_new, params

    def stop_check(self, stops: list[str]):
        """Request.stop_check for these stop strings: decodes the output's tail after each commit and
        returns the length to keep (through the token that completes the first stop string)."""
        if not stops:
            return None
        tok = self.tokenizer
        # A stop string of c characters spans at most ~4c byte-level tokens; decoding only that tail
        # keeps the check O(1) per token instead of O(output length).
        tail = 4 * max(len(s) for s in stops) + 8

        def has_stop(ids) -> bool:
            text = tok.decode(ids, skip_special_tokens=False)  # special stop strings (<|im_end|>) count
            return any(s in text for s in stops)

        def check(ids: list[int]) -> int | None:
            start = max(0, len(ids) - tail)
            if not has_stop(ids[start:]):
                return None
            k = len(ids)
            while k - 1 > start and has_stop(ids[start:k - 1]):  # the shortest prefix that holds a stop
                k -= 1
            return k

        return check

    def cut_at_stops(self, text: str, stops: list[str]) -> str:
        cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=len(text))
        return text[:cut]

    def _decode(self, dec, reqs, params, quiet: bool):
        from .progress import TokenProgress
        with TokenProgress(sum(r.max_new_tokens for r in reqs), f"lm-eval {dec.name}", disable=quiet) as bar:
            return dec.generate(self.engine, reqs, params, self.batch_size, progress=bar.advance)

    def _generate_group(self, requests, disable_tqdm: bool) -> list[str]:
        stops, max_new, params = self.sampling_settings(requests[0].args[1])
        dec = self.decoder
        # Prompts keep their last tokens so that prompt + new tokens (+ the decoder's pending drafts)
        # fit both max_length and the model's context.
        budget = min(self.max_length, self.engine.max_context) - max_new
        if budget < 1:
            raise ConfigError(f"max_gen_toks={max_new} leaves no room for the prompt within {self.max_length} tokens")
        # Equal work under sampling: every request generates max_new tokens (stops and EOS ignored) so
        # the recorded throughput compares decoders on the same work; the text is cut as if it had stopped.
        full = self.equal_work and not params.greedy
        if full:
            params = replace(params, eos_token_ids=())
        reqs = []
        for n, inst in enumerate(requests):
            ids = self.tok_encode(inst.args[0], left_truncate_len=budget) or [self.prefix_token_id]
            rid = f"{getattr(inst, 'task_name', None) or 'request'}/{getattr(inst, 'doc_id', None)}#{n}"
            reqs.append(Request(rid, ids, max_new, stop_check=None if full else self.stop_check(stops)))
        output = self._decode(dec, reqs, params, disable_tqdm)
        texts = self._texts(output, stops, full)
        if self.store is not None:
            self._record(requests, reqs, output, texts, params, max_new, stops, full)
        return [texts[r.id] for r in reqs]

    def _texts(self, output, stops: list[str], full: bool) -> dict[str, str]:
        """Each request's text, cut at the first stop string (and, for equal work, the first EOS: the
        tokens past it were generated for the throughput figures only)."""
        eos = set(self.eos_token_ids)
        raw = {r.id: self.tok_decode(next((r.output_ids[:i] for i, t in enumerate(r.output_ids) if t in eos),
                                          r.output_ids) if full else r.output_ids) for r in output.results}
        return {rid: self.cut_at_stops(text, stops) for rid, text in raw.items()}

    def _record(self, instances, reqs, output, texts, params, max_new, stops, full) -> None:
        from .harness.parity import against_ar
        parity, ar = None, None
        if self.ar_reference and self.decoder_name != "ar":
            # AR on the same requests, stored in the same group: the decoder's speedup over it is then
            # shown wherever runs are compared (run summaries, leaderboard).
            ar = self._decode(get_decoder("ar"), reqs, params, True)
            self._save(instances, reqs, ar, self._texts(ar, stops, full), params, max_new, "ar", {}, None)
        if self.parity:
            if not params.greedy:
                self._warn_once("parity=true compares greedy outputs: skipped for sampled gen_kwargs")
            else:
                if self.decoder_name == "ar":
                    ar = output
                elif ar is None:
                    ar = self._decode(get_decoder("ar"), reqs, params, True)
                parity = against_ar(output.results, ar.results, self.parity_tolerance, self.engine.dtype)
        self._save(instances, reqs, output, texts, params, max_new, self.decoder_name, self.decoder_args, parity)

    def _save(self, instances, reqs, output, texts, params, max_new, decoder, decoder_args, parity) -> None:
        from .harness import records
        from .harness.store import save_record
        names = sorted({getattr(i, "task_name", None) or "?" for i in instances})
        config = {
            "model": self.pretrained, "decoder": decoder, "decoder_args": decoder_args,
            "task": "lm-eval:" + ",".join(names), "harness": "lm-eval", "context_len": None,
            "limit": len(reqs), "batch_size": self.batch_size, "max_new_tokens": max_new,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": self.seed,
            "parity": parity is not None, "parity_tolerance": self.parity_tolerance if parity is not None else None,
            "dtype": self.dtype, "device": self.device_name,
            "attention_backend": self.attention_backend, "max_length": self.max_length,
            "gen_kwargs": instances[0].args[1], "equal_work": self.equal_work,
        }
        env = records.capture_environment()
        try:
            env["lm_eval"] = version("lm_eval")
        except PackageNotFoundError:
            env["lm_eval"] = None
        record = records.from_output(config, output, {r.id: len(r.prompt_ids) for r in reqs}, env,
                                     texts=texts, parity=parity, backend=self.engine.backend.name,
                                     dtype=self.engine.dtype, tag=self.tag,
                                     group=self.group)
        save_record(self.store, record)  # a recovery JSONL beside the store if saving fails

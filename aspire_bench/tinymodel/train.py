"""Train the bundled tiny Qwen3 model on the stdlib corpus, once, on a CPU (or a GPU).

Long context matters more than low loss here: a draft that sees only a few pages looks good against
a target that ignores far context anyway. So training ends on long single-package sequences with a
copy curriculum (spans repeated from thousands of tokens back), which makes induction heads form
over long distances. Everything is step-count fixed and seeded, so a run is reproducible.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from aspire_bench import corpus
from aspire_bench.atomic import atomic_open, write_text
from aspire_bench.errors import UserError

EOS = "<|endoftext|>"
HELDOUT_EVAL_TOKENS = 16_384  # tokens of the held-out stream scored by `heldout_loss` at each context


@dataclass
class TrainSettings:
    max_steps: int = 560
    long_fraction: float = 0.2  # last part of the steps, on long single-package sequences
    short_len: int = 1024
    long_lens: tuple[int, ...] = (2048, 4096, 2048, 4096, 8192)  # cycled; 8k, the dearest step, once a cycle
    tokens_per_step: int = 2048  # batch = tokens_per_step // seq_len (at least 1)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    copy_prob: float = 0.5  # share of sequences that get copied spans
    copy_share: float = 0.1  # share of such a sequence's tokens that are copies
    vocab_size: int = 4096
    model: dict = field(default_factory=dict)  # overrides of `model_config` (tests use tiny shapes)


def model_config(vocab_size: int, eos_id: int, **overrides):
    from transformers import Qwen3Config

    shape = {
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        # A large base keeps 32k positions distinguishable although training stops at 8k.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    shape.update(overrides)
    return Qwen3Config(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=eos_id, **shape)


def shape_summary(config) -> str:
    """What a shape costs in decoding: the KV cache per token (fp32, as loaded on a CPU) and the weights."""
    from ..simulator.costs import ModelShape

    shape = ModelShape("new", config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size,
                       config.tie_word_embeddings, "float32")
    return (f"{shape.layers} layers, hidden {shape.hidden}, MLP {shape.intermediate}, "
            f"{shape.heads} query / {shape.kv_heads} KV heads of {shape.head_dim}: "
            f"KV {shape.kv_bytes_per_position / 1024:.1f} KiB per token, weights ~{2 * shape.weight_params / 1e6:.1f} MB "
            "in bf16")


def keep_only_layers(model, keep: tuple[int, ...]) -> None:
    """Drop every decoder layer of a Qwen3ForCausalLM but `keep` (in that order), in place."""
    layers = model.model.layers
    if any(not 0 <= i < len(layers) for i in keep):
        raise ValueError(f"--keep-layers {keep}: the checkpoint has layers 0..{len(layers) - 1}")
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for j, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = j
    cfg = model.config
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in keep]


# --- tokenizer -----------------------------------------------------------------------------------

def train_tokenizer(files: list[corpus.SourceFile], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=40960)
    fast.save_pretrained(out_dir)
    # transformers 5 names its own backend class here, which 4.x cannot resolve; both load this name.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def encode_files(tok, files: list[corpus.SourceFile]) -> list[np.ndarray]:
    """Token ids of each file, each followed by EOS (the document separator)."""
    eos = tok.token_to_id(EOS)
    return [np.array(e.ids + [eos], dtype=np.int32) for e in tok.encode_batch([f.text for f in files])]


def package_streams(files: list[corpus.SourceFile], ids: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
    streams: dict[str, list[np.ndarray]] = {}
    for f, x in zip(files, ids):
        streams.setdefault(f.package, []).append(x)
    return streams


# --- batches -------------------------------------------------------------------------------------

def add_copies(seq: np.ndarray, rng: np.random.Generator, share: float) -> None:
    """Overwrite spans with copies of earlier spans, far back, in place (the copy curriculum).

    Copies land in the second half and come from at least a quarter of the sequence earlier, so for
    an 8k sequence the model must look 2k-7k tokens back to predict them.
    """
    n = len(seq)
    max_span = max(8, min(256, n // 8))
    budget = int(share * n)
    while budget > 0:
        m = int(rng.integers(max(4, max_span // 8), max_span + 1))
        dst = int(rng.integers(n // 2, n - m + 1))
        src_hi = dst - m - n // 4
        if src_hi <= 0:
            return
        src = int(rng.integers(0, src_hi + 1))
        seq[dst:dst + m] = seq[src:src + m]
        budget -= m


def window(docs: list[np.ndarray], length: int, rng: np.random.Generator) -> np.ndarray:
    """A random `length`-token window of the documents concatenated in a random order."""
    order = rng.permutation(len(docs))
    stream = np.concatenate([docs[i] for i in order])
    while len(stream) < length:  # a small package: repeat it in a fresh order
        stream = np.concatenate([stream] + [docs[i] for i in rng.permutation(len(docs))])
    start = int(rng.integers(0, len(stream) - length + 1))
    return stream[start:start + length].copy()


class Batches:
    """Deterministic batches: short windows over the whole corpus, long ones within one package."""

    def __init__(self, streams: dict[str, list[np.ndarray]], s: TrainSettings, seed: int):
        self.s = s
        self.rng = np.random.default_rng(seed)
        self.packages = sorted(streams)
        self.streams = streams
        sizes = np.array([sum(len(d) for d in streams[p]) for p in self.packages], dtype=np.float64)
        self.weights = sizes / sizes.sum()
        self.all_docs = [d for p in self.packages for d in streams[p]]

    def get(self, long_step: int | None) -> torch.Tensor:
        """A short batch, or (given its index in the long phase) a long one."""
        long = long_step is not None
        length = self.s.long_lens[long_step % len(self.s.long_lens)] if long else self.s.short_len
        rows = []
        for _ in range(max(1, self.s.tokens_per_step // length)):
            if long:
                pkg = self.packages[int(self.rng.choice(len(self.packages), p=self.weights))]
                seq = window(self.streams[pkg], length, self.rng)
            else:
                seq = self._short_window(length)
            if self.rng.random() < self.s.copy_prob:
                add_copies(seq, self.rng, self.s.copy_share)
            rows.append(seq)
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def _short_window(self, length: int) -> np.ndarray:
        # A random file from a random offset, then whole random files until full (files are drawn
        # uniformly, not by size, so small files weigh more than their share of tokens).
        doc = self.all_docs[int(self.rng.integers(len(self.all_docs)))]
        parts = [doc[int(self.rng.integers(len(doc))):]]
        have = len(parts[0])
        while have < length:
            d = self.all_docs[int(self.rng.integers(len(self.all_docs)))]
            parts.append(d)
            have += len(d)
        return np.concatenate(parts)[:length].copy()


# --- evaluation (shared with scripts/tiny_model_card.py and the tests) ---------------------------

def heldout_streams(tok) -> dict[str, np.ndarray]:
    """Each held-out package's files concatenated (sorted by path, EOS-separated) into one stream."""
    files = corpus.list_files("heldout")
    return {p: np.concatenate(d) for p, d in package_streams(files, encode_files(tok, files)).items()}


def heldout_windows(tok, context: int, total: int = HELDOUT_EVAL_TOKENS) -> list[np.ndarray]:
    """Non-overlapping `context`-token windows of held-out packages, largest packages first,
    `total` tokens in all (at least one window)."""
    streams = heldout_streams(tok)
    out: list[np.ndarray] = []
    for pkg in sorted(streams, key=lambda p: -len(streams[p])):
        s = streams[pkg]
        for start in range(0, len(s) - context + 1, context):
            if out and len(out) * context >= total:
                return out
            out.append(s[start:start + context])
    return out


def heldout_prefix(tok, context: int, end: int = 20_000) -> np.ndarray:
    """The `context` tokens before position `end` of the largest held-out package's stream: the same
    continuation point at every context length, so samples at 1k and 16k context are comparable."""
    streams = heldout_streams(tok)
    s = max(streams.values(), key=len)
    if not context <= end <= len(s):
        raise ValueError(f"need context <= end <= {len(s)}, got context={context}, end={end}")
    return s[end - context:end]


@torch.no_grad()
def heldout_loss(model, tok, context: int, total: int = HELDOUT_EVAL_TOKENS) -> float:
    """Mean next-token loss (nats/token) over every position of held-out windows of `context` tokens."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for w in heldout_windows(tok, context, total):
        ids = torch.from_numpy(w.astype(np.int64))[None].to(device)
        logits = model(ids).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    model.train(was_training)
    return nll / count


# --- training ------------------------------------------------------------------------------------

def lr_at(step: int, progress: float, s: TrainSettings) -> float:
    """Linear warmup over steps, then cosine decay over progress (0..1) down to min_lr_ratio."""
    warm = min(1.0, (step + 1) / s.warmup_steps)
    return warm * s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """Training progress 0..1: by step count (reproducible), or by wall clock when a budget is given.

    The machine this runs on is shared, and its speed varies several-fold with other people's load;
    a wall-clock budget keeps a run within its time, and the record says how many steps it took.
    """

    def __init__(self, max_steps: int, budget_s: float | None):
        self.max_steps, self.budget_s, self.t0 = max_steps, budget_s, time.time()

    def __call__(self, step: int) -> float:
        if self.budget_s is None:
            return step / self.max_steps
        return min(1.0, (time.time() - self.t0) / self.budget_s)


CHECKPOINT = "checkpoint.pt"  # inside the output directory while a run is under way
CURVE = "curve.jsonl"  # one line per evaluation: tokens seen, train loss, held-out loss


def save_checkpoint(path: Path, state: dict) -> None:
    """Written to a temporary file and renamed: a run killed mid-write keeps its previous checkpoint."""
    with atomic_open(path, "wb") as f:
        torch.save(state, f)


def load_checkpoint(path: Path, settings: TrainSettings, seed: int) -> dict | None:
    """The checkpoint to resume from (None when there is none), refused before any work when it was
    written with other settings or seed."""
    if not path.exists():
        return None
    try:
        ck = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and what to do
        raise UserError(f"{path} cannot be read ({type(e).__name__}): delete it to start afresh") from None
    if not isinstance(ck, dict) or ck.get("settings") != asdict(settings) or ck.get("seed") != seed:
        raise UserError(f"{path} was written with other settings or seed: resume with the same arguments, "
                        "or delete it to start afresh")
    return ck


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_tiny(
    out_dir: str | Path,
    *,
    device: str = "cpu",
    max_steps: int = 560,
    minutes: float | None = None,
    seed: int = 0,
    threads: int = 2,
    settings: TrainSettings | None = None,
    files: list[corpus.SourceFile] | None = None,
    eval_tokens: int = HELDOUT_EVAL_TOKENS,
    log_every: int = 10,
    command: str = "",
    init_from: str | Path | None = None,
    checkpoint_every: int = 0,
    eval_every: int = 0,
    eval_contexts: tuple[int, ...] = (4096,),
    corpus_name: str = "stdlib",
    tokenizer_from: str | Path | None = None,
    keep_layers: tuple[int, ...] | None = None,
) -> dict:
    """Train tokenizer and model, save an HF checkpoint (bf16) to `out_dir`; returns training.json's dict.

    `minutes` bounds the run's wall time instead of `max_steps` (see `Progress`); `files` defaults to
    the corpus' train split; `eval_tokens=0` skips the held-out evaluation. Every `checkpoint_every`
    steps the whole training state goes to `out_dir/checkpoint.pt`, and a rerun with the same arguments
    resumes exactly; every `eval_every` steps the held-out loss at `eval_contexts` goes to
    `out_dir/curve.jsonl` and the weights to `out_dir/curve/step_N`. `corpus_name`, `tokenizer_from` (a
    shared tokenizer, so held-out losses compare across shapes) and `keep_layers` (a draft model from
    its target): docs/tiny-model.md, "Long runs: checkpoints, resume, learning curve".
    """
    s = settings or TrainSettings()
    s.max_steps = max_steps
    if max_steps < 1 or threads < 1 or (minutes is not None and not 0 < minutes < math.inf):
        raise UserError("train-tiny needs steps >= 1, threads >= 1 and minutes > 0")
    if checkpoint_every and minutes is not None:
        raise UserError("checkpoints need a step-count schedule: pass --steps, not --minutes")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file: give a directory for the checkpoint")
    if device != "cpu":
        s.tokens_per_step *= 8  # a GPU has room for a bigger batch at the same step count
    ckpt_path, curve_path = out_dir / CHECKPOINT, out_dir / CURVE
    ck = load_checkpoint(ckpt_path, s, seed) if checkpoint_every else None  # before any work
    import transformers
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    if device == "cpu":
        # Few threads: the machine is shared, and under load every extra thread waits at each op's barrier.
        torch.set_num_threads(threads)
    t0 = time.time()

    files = corpus.training_files(corpus_name) if files is None else files
    if init_from is None and tokenizer_from is None:
        tok = train_tokenizer(files, s.vocab_size)
    else:  # a checkpoint of this script's tokenizer (and, continuing it, its weights)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(init_from or tokenizer_from) / "tokenizer.json"))
    streams = package_streams(files, encode_files(tok, files))
    eos_id = tok.token_to_id(EOS)
    if init_from is None:
        config = model_config(tok.get_vocab_size(), eos_id, **s.model)
        model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    else:
        from ..models.bundled import bundled_checkpoint, bundled_name
        weights = bundled_checkpoint(name) if (name := bundled_name(init_from)) else init_from  # expanded once
        model = Qwen3ForCausalLM.from_pretrained(str(weights), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
        if keep_layers:
            keep_only_layers(model, keep_layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"shape {shape_summary(model.config)}", flush=True)
    print(f"params {n_params:,}  corpus {len(files)} files  "
          f"{sum(len(d) for v in streams.values() for d in v):,} tokens  ({time.time() - t0:.0f}s)", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    batches = Batches(streams, s, seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    model.train()
    tokens_seen, losses, t_train = 0, [], time.time()
    # Tokenizing already took its share of the budget; leave ~3 minutes for evaluation and saving.
    budget_s = None if minutes is None else minutes * 60 - (t_train - t0) - 180
    progress = Progress(s.max_steps, budget_s)
    step, long_from = 0, None
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        batches.rng.bit_generator.state = ck["data_rng"]
        torch.set_rng_state(ck["torch_rng"])
        step, long_from, tokens_seen, losses = ck["step"], ck["long_from"], ck["tokens_seen"], ck["losses"]
        t_train -= ck["train_wall_s"]
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    while (p := progress(step)) < 1:
        if long_from is None and p >= 1 - s.long_fraction:
            long_from = step
        x = batches.get(None if long_from is None else step - long_from).to(device)
        lr = lr_at(step, p, s)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += x.numel()
        losses.append(loss.item())
        if step % log_every == 0:
            el = time.time() - t_train
            print(f"step {step:5d}  len {x.shape[1]:5d}x{x.shape[0]}  loss {losses[-1]:.3f}  "
                  f"lr {lr:.2e}  {tokens_seen / el:,.0f} tok/s  {el / 60:.1f} min", flush=True)
        step += 1
        if eval_every and step % eval_every == 0:
            point = {"step": step, "tokens_seen": tokens_seen,
                     "train_loss": round(float(np.mean(losses[-eval_every:])), 4)}
            for c in eval_contexts:  # at least one whole window of each context
                point[f"heldout_loss_{c}"] = round(heldout_loss(model, tok, c, max(eval_tokens, c)), 4)
            point["train_wall_s"] = round(time.time() - t_train, 1)
            with curve_path.open("a") as f:
                f.write(json.dumps(point) + "\n")
            snapshot = out_dir / "curve" / f"step_{step}"
            copy.deepcopy(model).to(torch.bfloat16).save_pretrained(snapshot)  # training weights stay fp32
            save_tokenizer(tok, snapshot)
            print(f"eval  {point}", flush=True)
        if checkpoint_every and step % checkpoint_every == 0:
            save_checkpoint(ckpt_path, {
                "settings": asdict(s), "seed": seed, "step": step, "long_from": long_from,
                "tokens_seen": tokens_seen, "losses": losses, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "data_rng": batches.rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(), "train_wall_s": time.time() - t_train})

    # Evaluate the weights as shipped (bf16), not the fp32 ones they were rounded from.
    model.to(torch.bfloat16).float().eval()
    previous = json.loads((Path(init_from) / "training.json").read_text()) if init_from else None
    record = {
        "command": command,
        "continued_from": previous,
        "seed": seed,
        "device": device,
        "threads": threads if device == "cpu" else None,
        "steps": step,
        "long_phase_from_step": long_from,
        "budget_minutes": minutes,
        "settings": asdict(s),
        "params": n_params,
        "tokenizer_from": None if tokenizer_from is None else str(tokenizer_from),
        "kept_layers": list(keep_layers) if keep_layers else None,
        "tokens_seen": tokens_seen + (previous["tokens_seen"] if previous else 0),  # over the whole chain
        "tokens_seen_this_run": tokens_seen,
        "train_wall_s": round(time.time() - t_train, 1),
        # The mean of the last steps, not one step's: a single long batch is noisy.
        "first_train_loss": round(losses[0], 4),
        "final_train_loss": round(float(np.mean(losses[-min(20, len(losses)):])), 4),
        "corpus": {"name": corpus_name, "split": "train", "files": len(files),
                   "sha256": corpus.content_hash(files), "heldout_packages": list(corpus.HELDOUT_PACKAGES),
                   **({"site_packages": corpus.package_versions()} if corpus_name == "python" else {})},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
    }
    if eval_tokens:
        record["heldout_loss"] = {"eval_tokens": eval_tokens} | {
            str(c): round(heldout_loss(model, tok, c, eval_tokens), 4) for c in (1024, 4096)
        }
    save_tokenizer(tok, out_dir)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    record["wall_s"] = round(time.time() - t0, 1)
    if curve_path.exists():
        record["curve"] = [json.loads(line) for line in curve_path.read_text().split("\n") if line.strip()]
    write_text(out_dir / "training.json", json.dumps(record, indent=2) + "\n")
    ckpt_path.unlink(missing_ok=True)  # the run is complete: the checkpoint's job is done
    print(json.dumps(record, indent=2), flush=True)
    return record


class _Parser(argparse.ArgumentParser):
    """Errors as every aspire-bench command gives them: one line, exit status 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# What --quick sets itself: giving one of these with it is refused, not silently overridden.
QUICK_OVERRIDES = ("steps", "minutes", "lr", "warmup_steps", "long_fraction", "long_lens", "checkpoint_every",
                   "corpus", "eval_every", "eval_contexts", "hidden_size", "intermediate_size", "init_from",
                   "tokenizer_from")


def _given(ap: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options named on the command line (a default left alone is not given)."""
    saved = [(a, a.default) for a in ap._actions]
    for a, _ in saved:
        a.default = argparse.SUPPRESS
    try:
        return set(vars(ap.parse_args(argv)))
    finally:
        for a, d in saved:
            a.default = d


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="aspire-bench train-tiny", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--steps", type=int, default=TrainSettings.max_steps)
    ap.add_argument("--minutes", type=float, default=None,
                    help="bound the whole run's wall time instead of the step count (shared machines)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (1 is faster on a loaded machine)")
    ap.add_argument("--quick", action="store_true", help="a 2-layer smoke run of 30 steps on 40 files")
    ap.add_argument("--init-from", default=None, help="continue training this checkpoint (its tokenizer too)")
    ap.add_argument("--lr", type=float, default=TrainSettings.lr)
    ap.add_argument("--warmup-steps", type=int, default=TrainSettings.warmup_steps)
    ap.add_argument("--long-fraction", type=float, default=TrainSettings.long_fraction,
                    help="share of the run spent on long single-package sequences (the copy curriculum)")
    ap.add_argument("--long-lens", default=",".join(map(str, TrainSettings.long_lens)),
                    help="comma-separated sequence lengths cycled through in the long phase")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="save the whole training state every N steps; rerunning the same command resumes")
    ap.add_argument("--corpus", choices=corpus.CORPORA, default="stdlib",
                    help="stdlib: the standard library; python: stdlib + the Python source of the installed "
                         "dependencies (torch, transformers, pandas, ...), ~50x the text")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="append the held-out loss to OUT/curve.jsonl every N steps (learning curve)")
    ap.add_argument("--eval-contexts", default="4096",
                    help="comma-separated contexts at which --eval-every scores the held-out loss")
    ap.add_argument("--hidden-size", type=int, default=None,
                    help="a new model's hidden size (default 128); decoding reads it once per step")
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="a new model's MLP width (default 384); costs weights, not KV cache")
    ap.add_argument("--layers", type=int, default=None,
                    help="a new model's number of layers (default 16); a draft model for the bundled one takes 2")
    ap.add_argument("--keep-layers", default=None,
                    help="with --init-from: start from only these layers of it, comma-separated (e.g. 0,15: "
                         "a draft model made from its target)")
    ap.add_argument("--tokenizer-from", default=None,
                    help="start a new model with this checkpoint's tokenizer instead of training one "
                         "(held-out losses then compare with that checkpoint's)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        given = sorted(_given(ap, argv) & set(QUICK_OVERRIDES))
        if given:
            ap.error(f"--quick sets its own {', '.join('--' + g.replace('_', '-') for g in given)}: drop "
                     f"{'them' if len(given) > 1 else 'it'}, or drop --quick")
    for name, ok, rule in (("steps", args.steps >= 1, "an integer >= 1"), ("threads", args.threads >= 1, "an integer >= 1"),
                           ("seed", args.seed >= 0, "an integer >= 0"),
                           ("minutes", args.minutes is None or 0 < args.minutes < math.inf, "a positive number"),
                           ("lr", 0 < args.lr < math.inf, "a positive number"),
                           ("long_fraction", 0 <= args.long_fraction <= 1, "a number in 0..1"),
                           ("warmup_steps", args.warmup_steps >= 0, "an integer >= 0")):
        if not ok:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be {rule}")
    shape = {k: v for k, v in (("hidden_size", args.hidden_size), ("intermediate_size", args.intermediate_size),
                               ("num_hidden_layers", args.layers)) if v is not None}
    if any(v <= 0 for v in shape.values()):
        ap.error("--hidden-size, --intermediate-size and --layers must be positive")
    if args.init_from and (shape or args.tokenizer_from):
        ap.error("--init-from continues a checkpoint with its own shape and tokenizer: "
                 "drop --hidden-size/--intermediate-size/--layers/--tokenizer-from, or --init-from")
    keep_layers = None
    if args.keep_layers is not None:
        try:
            keep_layers = tuple(int(x) for x in args.keep_layers.split(","))
        except ValueError:
            ap.error(f"--keep-layers takes comma-separated layer indices, got {args.keep_layers!r}")
        if not args.init_from:
            ap.error("--keep-layers needs --init-from (the checkpoint whose layers it keeps)")
        n = json.loads((Path(args.init_from) / "config.json").read_text())["num_hidden_layers"]
        if not keep_layers or any(not 0 <= i < n for i in keep_layers):
            ap.error(f"--keep-layers {args.keep_layers}: {args.init_from} has layers 0..{n - 1}")
    if args.tokenizer_from and not (Path(args.tokenizer_from) / "tokenizer.json").is_file():
        ap.error(f"--tokenizer-from {args.tokenizer_from}: no tokenizer.json there (give a checkpoint directory, "
                 "e.g. aspire_bench/assets/tiny)")
    try:
        long_lens = tuple(int(x) for x in args.long_lens.split(","))
    except ValueError:
        ap.error(f"--long-lens takes comma-separated integers, got {args.long_lens!r}")
    try:
        eval_contexts = tuple(int(x) for x in args.eval_contexts.split(","))
    except ValueError:
        ap.error(f"--eval-contexts takes comma-separated integers, got {args.eval_contexts!r}")
    if any(n <= 1 for n in eval_contexts):
        ap.error("--eval-contexts entries must be at least 2 tokens")
    if any(n <= 0 for n in long_lens) or args.checkpoint_every < 0 or args.eval_every < 0:
        ap.error("--long-lens entries must be positive; --checkpoint-every and --eval-every at least 0")
    if args.checkpoint_every and args.minutes is not None:
        ap.error("--checkpoint-every needs a step-count schedule (--steps): a wall-clock budget cannot resume")
    command = "python -m aspire_bench.tinymodel.train " + shlex.join(argv)
    if args.quick:
        settings = TrainSettings(short_len=256, long_lens=(512,), tokens_per_step=2048,
                                 warmup_steps=5, model={"num_hidden_layers": 2})
        train_tiny(args.out, device=args.device, max_steps=30, seed=args.seed, threads=args.threads, settings=settings,
                   files=corpus.list_files("train")[:40], eval_tokens=2048, command=command)
    else:
        settings = TrainSettings(lr=args.lr, warmup_steps=args.warmup_steps, long_fraction=args.long_fraction,
                                 long_lens=long_lens, model=shape)
        train_tiny(args.out, device=args.device, max_steps=args.steps, minutes=args.minutes, seed=args.seed,
                   threads=args.threads, command=command, init_from=args.init_from, settings=settings,
                   checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, eval_contexts=eval_contexts,
                   corpus_name=args.corpus, tokenizer_from=args.tokenizer_from, keep_layers=keep_layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())

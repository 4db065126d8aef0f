"""The tasks layer: loaders on our fixtures, scorers, exact-length synthetic and code prompts, registry,
offline errors. A small byte-level BPE trained here stands in for the bundled tiny model's tokenizer."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aspire_bench import corpus
from aspire_bench.errors import UserError
from aspire_bench.tasks import Sample, describe_tasks, encode_prompt, get_task, list_tasks, parse_bucket
from aspire_bench.tasks.aime import score_aime
from aspire_bench.tasks.code_completion import code_similarity
from aspire_bench.tasks.longbench_v2 import TEMPLATE_0SHOT, extract_choice
from aspire_bench.tasks.scoring import (
    boxed_contents,
    code_sim_score,
    edit_similarity,
    levenshtein,
    starts_with_answer,
)

FIX = Path(__file__).parents[1] / "fixtures" / "tasks"
ROOT = Path(__file__).resolve().parents[2]


def _train_tokenizer(with_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=768, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f.text for f in corpus.list_files("train")[:40]], trainer)
    if with_bos:
        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tok():
    """Adds <s> in front like Llama tokenizers do, so exact lengths must count it."""
    return _train_tokenizer(with_bos=True)


@pytest.fixture(scope="module")
def tok_nobos():
    return _train_tokenizer(with_bos=False)


# ---------------------------------------------------------------- registry, buckets, encode_prompt

def test_registry_lists_every_task():
    names = [t.name for t in list_tasks()]
    for n in ("code-completion", "needle", "kv-retrieval", "longbench-v2", "aime24", "aime25", "aime"):
        assert n in names
        assert get_task(n).name == n
    assert get_task("LongBench_v2").name == "longbench-v2"
    assert [n for n, _ in describe_tasks()] == names
    assert all(d and isinstance(d, str) for _, d in describe_tasks())


def test_unknown_task_is_a_user_error_naming_the_known_tasks():
    with pytest.raises(UserError) as e:
        get_task("aime2099")
    assert "aime2099" in str(e.value)
    for n in ("code-completion", "needle", "longbench-v2", "aime24"):
        assert n in str(e.value)


@pytest.mark.parametrize("s, expected", [
    ("4k", (4096, 4096)), ("16k", (16384, 16384)), ("32K", (32768, 32768)), ("4096", (4096, 4096)),
    ("30-40k", (30720, 40960)), ("80-100k", (81920, 102400)), ("30k-40k", (30720, 40960)),
    ("300-900", (300, 900)), (2048, (2048, 2048)),
])
def test_parse_bucket(s, expected):
    assert parse_bucket(s) == expected


@pytest.mark.parametrize("s", ["", "big", "40-30k", "0k", "4m", "-4k"])
def test_parse_bucket_rejects_nonsense(s):
    with pytest.raises(UserError):
        parse_bucket(s)


def test_encode_prompt_precedence(tok):
    assert encode_prompt(tok, Sample(id="a", prompt="hello", prompt_ids=[5, 6, 7])) == [5, 6, 7]
    assert encode_prompt(tok, Sample(id="b", prompt="hello")) == tok.encode("hello")
    msgs = [{"role": "user", "content": "hello"}]
    # No chat template (a base model): the message text, encoded as a plain prompt.
    assert encode_prompt(tok, Sample(id="c", messages=msgs)) == tok.encode("hello")
    chat = tok
    saved = chat.chat_template
    chat.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    try:
        ids = encode_prompt(chat, Sample(id="d", messages=msgs))
        assert chat.decode(ids) == "[user]hello\n[assistant]"
    finally:
        chat.chat_template = saved
    with pytest.raises(ValueError):
        encode_prompt(tok, Sample(id="e"))


# ---------------------------------------------------------------- AIME

def test_aime_loads_problem_answer_jsonl(tok):
    samples = get_task("aime24").samples(tok, data_path=FIX / "aime_problem_answer.jsonl")
    assert [s.id for s in samples] == ["aime24/101", "aime24/102", "aime24/103"]
    assert [s.reference for s in samples] == ["066", "31", "5"]
    s = samples[1]
    assert s.prompt is None and s.prompt_ids is None and s.messages[0]["role"] == "user"
    assert s.messages[0]["content"].startswith("What is the sum of the decimal digits of $2^{20}$?")
    assert "\\boxed{}" in s.messages[0]["content"]
    assert s.metadata["n_prompt_tokens"] == len(encode_prompt(tok, s))
    assert len(get_task("aime24").samples(tok, data_path=FIX / "aime_problem_answer.jsonl", limit=2)) == 2


def test_aime_loads_Problem_Answer_json_and_parquet(tok, tmp_path):
    samples = get_task("aime25").samples(tok, data_path=FIX / "aime_Problem_Answer.json")
    assert [s.id for s in samples] == ["aime25/2025-T-1", "aime25/2025-T-2"]
    assert [s.reference for s in samples] == ["19", "1"]
    assert "Two are drawn without replacement" in samples[0].messages[0]["content"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = json.loads((FIX / "aime_Problem_Answer.json").read_text())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime.parquet")
    from_parquet = get_task("aime25").samples(tok, data_path=tmp_path / "aime.parquet")
    assert [(s.id, s.reference, s.messages) for s in from_parquet] == \
        [(s.id, s.reference, s.messages) for s in samples]
    # A directory of data files works too.
    assert len(get_task("aime").samples(tok, data_path=tmp_path)) == 2


def test_aime_bad_inputs_are_user_errors(tok, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_text": "x", "solution": "y"}\n')
    with pytest.raises(UserError, match="problem/answer"):
        get_task("aime24").samples(tok, data_path=bad)
    with pytest.raises(UserError, match="no such file"):
        get_task("aime24").samples(tok, data_path=tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="context-length"):
        get_task("aime24").samples(tok, data_path=FIX / "aime_problem_answer.jsonl", context_len="4k")


@pytest.mark.parametrize("text, ref, expected", [
    ("so the answer is \\boxed{66}.", "066", 1.0),          # leading zeros in the reference
    ("\\boxed{066}", 66, 1.0),
    ("the answer is 66", "66", 0.0),                         # no boxed answer
    ("\\boxed{12} then, correcting, \\boxed{66}", "66", 1.0),  # several: the last counts
    ("\\boxed{66} then, correcting, \\boxed{12}", "66", 0.0),
    ("\\boxed{\\text{66}}", "66", 1.0),                      # nested braces
    ("\\boxed{{66}}", "66", 1.0),
    ("\\boxed{\\frac{1}{2}}", "66", 0.0),                    # not an integer
    ("\\boxed{1000}", "1000", 0.0),                          # out of 0..999
    ("\\boxed{-5}", "-5", 0.0),
    ("\\boxed{66} and finally \\boxed{7", "66", 1.0),        # an unclosed box (cut short) is ignored
    ("\\boxed{ 66 }", "66", 1.0),
    ("$\\boxed{1,000}$", "999", 0.0),
    ("\\boxed{6 6}", "67", 0.0),
])
def test_aime_scorer(text, ref, expected):
    assert score_aime(text, ref) == expected


def test_boxed_contents_matches_nested_braces():
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\boxed{x{y{z}}}") == ["\\frac{1}{2}", "x{y{z}}"]
    assert boxed_contents("\\boxed{open") == []


# ---------------------------------------------------------------- LongBench v2

def test_longbench_v2_loads_fixture_with_the_original_prompt(tok):
    samples = get_task("longbench-v2").samples(tok, data_path=FIX / "longbench_v2.json")
    rows = json.loads((FIX / "longbench_v2.json").read_text())
    assert [s.id for s in samples] == [r["_id"] for r in rows]
    assert [s.reference for s in samples] == ["C", "B", "D"]
    content = samples[0].messages[0]["content"]
    assert content.startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert f"<text>\n{rows[0]['context'].strip()}\n</text>" in content
    assert f"What is the correct answer to this question: {rows[0]['question']}\nChoices:\n(A) Brackwater\n" \
           "(B) Elmsford\n(C) Port Hadley\n(D) Sallow Bay\n" in content
    assert content.endswith('Format your response as follows: "The correct answer is (insert answer here)".')
    assert not any(f in content for f in ("$DOC$", "$Q$", "$C_A$", "$C_D$")) and "$DOC$" in TEMPLATE_0SHOT
    assert samples[1].metadata["domain"] == "Code Repository Understanding"
    assert samples[0].metadata["n_prompt_tokens"] == len(encode_prompt(tok, samples[0]))
    assert not samples[0].metadata["truncated"]


def test_longbench_v2_middle_truncation(tok):
    full = get_task("longbench-v2").samples(tok, data_path=FIX / "longbench_v2.json", limit=1)[0]
    ids = tok.encode(full.messages[0]["content"], add_special_tokens=False)
    cut = get_task("longbench-v2").samples(tok, data_path=FIX / "longbench_v2.json", limit=1,
                                           max_length=41)[0]
    assert cut.metadata["truncated"] and cut.metadata["n_original_tokens"] == len(ids) > 41
    assert cut.messages[0]["content"] == tok.decode(ids[:20] + ids[-21:])


def _write_longbench(tmp_path, n_sentences):
    rows = []
    for k, n in enumerate(n_sentences):
        rows.append({"_id": f"len-{n}", "domain": "d", "sub_domain": "s", "difficulty": "easy",
                     "length": "short", "question": "Which lamp was lit?", "choice_A": "red",
                     "choice_B": "green", "choice_C": "blue", "choice_D": "white", "answer": "ABCD"[k % 4],
                     "context": " ".join(f"Lamp number {i} was lit at dusk." for i in range(n))})
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_longbench_v2_buckets_filter_and_truncate(tok, tmp_path):
    path = _write_longbench(tmp_path, [5, 40, 120, 400])
    task = get_task("longbench-v2")
    everything = task.samples(tok, data_path=path)
    n = {s.id: s.metadata["n_prompt_tokens"] for s in everything}
    assert n["len-5"] < n["len-40"] < n["len-120"] < n["len-400"]
    lo, hi = n["len-40"] - 1, n["len-120"] + 1
    window = task.samples(tok, data_path=path, context_len=f"{lo}-{hi}")
    assert [s.id for s in window] == ["len-40", "len-120"]
    assert all(s.metadata["bucket"] == f"{lo}-{hi}" for s in window)
    # A single size keeps the samples at least that long, truncated to it.
    size = n["len-40"] + 10
    fixed = task.samples(tok, data_path=path, context_len=str(size))
    assert [s.id for s in fixed] == ["len-120", "len-400"]
    for s in fixed:
        assert len(tok.encode(s.messages[0]["content"], add_special_tokens=False)) in (size - 1, size, size + 1)
        assert s.metadata["truncated"]


@pytest.mark.parametrize("text, pred", [
    ("The correct answer is (C)", "C"),
    ("The correct answer is C.", "C"),
    ("**The correct answer is (C)**", "C"),
    ("The correct answer is **(C)**", "C"),
    ("Hmm. The correct answer is (B). The correct answer is (C)", "B"),  # the first statement counts
    ("The correct answer is (E)", None),
    ("The correct answer is: C", None),
    ("the correct answer is (c)", None),
    ("C", None),
    ("", None),
])
def test_longbench_v2_choice_extraction(text, pred):
    assert extract_choice(text) == pred
    s = Sample(id="x", reference="C")
    assert get_task("longbench-v2").score(s, text) == float(pred == "C")


# ---------------------------------------------------------------- synthetic tasks

@pytest.mark.parametrize("name", ["needle", "kv-retrieval"])
@pytest.mark.parametrize("context_len, n_tokens", [("1k", 1024), ("4k", 4096), ("16k", 16384), ("1500", 1500)])
def test_synthetic_exact_length(tok, name, context_len, n_tokens):
    samples = get_task(name).samples(tok, limit=2, context_len=context_len, seed=3)
    assert [len(s.prompt_ids) for s in samples] == [n_tokens, n_tokens]
    assert all(s.metadata["n_prompt_tokens"] == n_tokens and s.prompt_ids[0] == tok.bos_token_id
               for s in samples)
    assert all(encode_prompt(tok, s) == s.prompt_ids for s in samples)


@pytest.mark.parametrize("name", ["needle", "kv-retrieval"])
def test_synthetic_exact_length_without_bos_and_in_windows(tok_nobos, name):
    samples = get_task(name).samples(tok_nobos, limit=4, context_len="2-3k", seed=0)
    lengths = [len(s.prompt_ids) for s in samples]
    assert lengths == [s.metadata["n_prompt_tokens"] for s in samples]
    assert all(2048 <= n <= 3072 for n in lengths) and len(set(lengths)) > 1
    assert tok_nobos.bos_token_id not in samples[0].prompt_ids


@pytest.mark.parametrize("name", ["needle", "kv-retrieval"])
def test_synthetic_deterministic_given_seed(tok, name):
    task = get_task(name)
    a = task.samples(tok, limit=3, context_len="2k", seed=7)
    b = task.samples(tok, limit=3, context_len="2k", seed=7)
    c = task.samples(tok, limit=3, context_len="2k", seed=8)
    assert [(s.id, s.prompt_ids, s.reference) for s in a] == [(s.id, s.prompt_ids, s.reference) for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    assert len({s.reference for s in a}) == 3  # samples differ from each other


def test_needle_prompt_holds_every_needle_and_asks_one(tok):
    for s in get_task("needle").samples(tok, limit=3, context_len="4k", seed=1):
        text = tok.decode(s.prompt_ids, skip_special_tokens=True)
        for key, code in s.metadata["needles"].items():
            assert text.count(f"The secret code for {key} is {code}.") == 1
        assert s.metadata["needles"][s.metadata["key"]] == s.reference
        assert text.endswith(f"Answer: The secret code for {s.metadata['key']} is")


def test_kv_retrieval_prompt_is_valid_json_holding_the_pair(tok):
    for s in get_task("kv-retrieval").samples(tok, limit=3, context_len="2k", seed=1):
        text = tok.decode(s.prompt_ids, skip_special_tokens=True)
        blob = "{" + text.split("JSON data:\n{", 1)[1].split("\n}\n", 1)[0] + "\n}"
        data = json.loads(blob)
        assert data[s.metadata["key"]] == s.reference and len(data) > 10
        assert text.endswith(f'Key: "{s.metadata["key"]}"\nThe value associated with the specified key is: "')


@pytest.mark.parametrize("text, expected", [
    ("1234567", 1.0), (" 1234567.", 1.0), ("\n 1234567 is the code", 1.0),
    ("12345678", 0.0), ("123456", 0.0), ("The code is 1234567", 0.0), ("", 0.0),
])
def test_needle_scorer_matches_at_the_start(text, expected):
    assert get_task("needle").score(Sample(id="x", reference="1234567"), text) == expected


def test_kv_scorer():
    s = Sample(id="x", reference="9fa57de8-b768-4d6b-8f5d-d1b433f2edd1")
    assert get_task("kv-retrieval").score(s, '9fa57de8-b768-4d6b-8f5d-d1b433f2edd1"') == 1.0
    assert get_task("kv-retrieval").score(s, "9fa57de8-b768-4d6b-8f5d-d1b433f2edd1-ff") == 0.0
    assert get_task("kv-retrieval").score(s, "9fa57de8-b768") == 0.0
    assert starts_with_answer("  abc   def", "abc def")


def test_synthetic_too_short_or_too_long_is_a_user_error(tok):
    with pytest.raises(UserError, match="too short"):
        get_task("needle").samples(tok, limit=1, context_len="40")
    for name in ("needle", "kv-retrieval", "code-completion"):
        with pytest.raises(UserError, match="exceeds max_length"):
            get_task(name).samples(tok, limit=1, context_len="32k", max_length=16384)


# ---------------------------------------------------------------- code completion

@functools.lru_cache(maxsize=1)
def _heldout():
    return corpus.list_files("heldout")


def _package_text(package: str) -> str:
    parts = []
    for f in _heldout():
        if f.package == package:
            parts += [f"# file: {f.relpath}\n", f.text if f.text.endswith("\n") else f.text + "\n"]
    return "".join(parts)


@pytest.fixture(scope="module")
def code4k(tok):
    return get_task("code-completion").samples(tok, limit=6, context_len="4k", seed=0)


def test_code_completion_exact_length_and_deterministic(tok, code4k):
    assert [len(s.prompt_ids) for s in code4k] == [4096] * 6
    assert all(s.prompt_ids[0] == tok.bos_token_id for s in code4k)
    again = get_task("code-completion").samples(tok, limit=6, context_len="4k", seed=0)
    assert [(s.prompt_ids, s.reference, s.metadata) for s in again] == \
        [(s.prompt_ids, s.reference, s.metadata) for s in code4k]
    other = get_task("code-completion").samples(tok, limit=2, context_len="4k", seed=1)
    assert [s.prompt_ids for s in other] != [s.prompt_ids for s in code4k[:2]]
    # Different samples: different packages and cut points.
    assert len({s.metadata["package"] for s in code4k}) >= 3
    assert len({(s.metadata["file"], s.metadata["line"]) for s in code4k}) == 6


def test_code_completion_reference_is_the_true_continuation(tok, code4k):
    for s in code4k[:3]:
        f = next(f for f in _heldout() if f.relpath == s.metadata["file"])
        lines = f.text.split("\n")
        k = s.metadata["line"]
        assert s.reference == lines[k] and s.reference.strip() and not s.reference.strip().startswith("#")
        body = tok.decode(s.prompt_ids[1:])
        assert body.endswith("\n".join(lines[k - 3:k]) + "\n")
        # Context rule: the text before the cut, starting at the latest line start that leaves >= N-1
        # tokens; only part of that first line is dropped.
        pkg = _package_text(s.metadata["package"])
        before = pkg[:pkg.index("# file: " + s.metadata["file"] + "\n")] + \
            "# file: " + s.metadata["file"] + "\n" + "".join(x + "\n" for x in lines[:k])
        assert before.endswith(body[-200:])
        start = len(before) - len(body)
        first_line_start = before.rfind("\n", 0, start + 1) + 1
        next_line_start = before.index("\n", start) + 1
        assert len(tok.encode(before[first_line_start:], add_special_tokens=False)) >= 4095
        assert len(tok.encode(before[next_line_start:], add_special_tokens=False)) < 4095


def test_code_completion_16k_and_errors(tok_nobos):
    samples = get_task("code-completion").samples(tok_nobos, limit=2, context_len="16k", seed=0)
    assert [len(s.prompt_ids) for s in samples] == [16384, 16384]
    with pytest.raises(UserError, match="longer than any held-out package"):
        get_task("code-completion").samples(tok_nobos, limit=1, context_len="4000k")


@pytest.mark.parametrize("generated, reference, expected", [
    ("    return x\n    y = 2", "    return x", 1.0),
    ("\n\nreturn x  \nmore", "    return x", 0.73),      # LongBench: 2 * 8 common / 22 characters
    ("return y", "return x", 0.88),                      # 14/16, rounded to a whole percent
    ("", "return x", 0.0),
    ("abcd", "abce", 0.75),
    ("```python\n# set it\n    x = foo(1)\n", "    x = foo(2)", 0.93),  # lines with ` # // skipped
    ("// c\nint a = 1;", "int a = 1;", 1.0),
    ("# only comments\n#", "x = 1", 0.0),               # no line qualifies: ""
    ("a\nb\nc", "a\nb", 1.0),                            # several reference lines: line-wise edit similarity
    ("  a \nb\nc", "a\nb", 1.0),
])
def test_code_similarity(generated, reference, expected):
    assert code_similarity(generated, reference) == pytest.approx(expected)


@pytest.mark.parametrize("prediction, truth", [
    ("\n\nreturn x  \nmore", "    return x"), ("return y", "return x"), ("abcd", "abce"),
    ("```python\n# set it\n    x = foo(1)\n", "    x = foo(2)"), ("", ""), ("x", ""),
    ("        self.assertEqual(result, 3)", "        self.assertEqual(res, 3)"),
])
def test_code_sim_score_is_longbenchs(prediction, truth):
    """LongBench's definition (first line without ` # //, fuzzywuzzy's ratio / 100) recomputed with the
    standard library's SequenceMatcher, fuzzywuzzy's fallback matcher, on examples where both agree."""
    import difflib
    line = next((x for x in prediction.lstrip("\n").split("\n") if not any(c in x for c in ("`", "#", "//"))), "")
    if line == truth:
        ref = 1.0
    elif not line or not truth:
        ref = 0.0
    else:
        ref = round(100 * difflib.SequenceMatcher(None, line, truth).ratio()) / 100
    assert code_sim_score(prediction, truth) == ref


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert edit_similarity("", "") == 1.0 and edit_similarity("abc", "xyz") == 0.0


# ---------------------------------------------------------------- offline datasets

_OFFLINE_PROBE = textwrap.dedent("""
    import json, sys, time
    from aspire_bench.errors import DatasetUnavailable
    from aspire_bench.tasks import get_task
    out = {}
    for name in ("aime24", "aime25", "longbench-v2"):
        t = time.time()
        try:
            get_task(name).samples(None)
            out[name] = {"raised": None}
        except DatasetUnavailable as e:
            out[name] = {"raised": "DatasetUnavailable", "msg": str(e), "cause": e.__cause__ is None,
                         "quiet": e.__suppress_context__, "s": time.time() - t}
    out["layers"] = sorted({m.split(".")[1] for m in sys.modules if m.startswith("aspire_bench.")})
    print(json.dumps(out))
""")


def _probe(tmp_path, extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT), **extra_env)
    res = subprocess.run([sys.executable, "-c", _OFFLINE_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env", [
    {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    {"HF_ENDPOINT": "http://127.0.0.1:9"},  # unreachable Hub, offline mode not set: must still fail fast
], ids=["offline-env", "hub-unreachable"])
def test_dataset_offline_raises_dataset_unavailable_with_both_remedies(tmp_path, env):
    out = _probe(tmp_path, env)
    for name, hub_id in (("aime24", "HuggingFaceH4/aime_2024"), ("aime25", "math-ai/aime25"),
                         ("longbench-v2", "THUDM/LongBench-v2")):
        r = out[name]
        assert r["raised"] == "DatasetUnavailable", r
        assert "not available offline" in r["msg"] and "--data PATH" in r["msg"]
        assert f"load_dataset('{hub_id}')" in r["msg"] and "HF_DATASETS_OFFLINE=1" in r["msg"]
        assert r["cause"] and r["quiet"]  # no chained library traceback
        assert r["s"] < 10
    # The tasks layer never pulls in engine, decoders or harness.
    assert not {"engine", "decoders", "harness", "kernels"} & set(out["layers"])

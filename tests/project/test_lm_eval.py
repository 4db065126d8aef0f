"""The lm-eval model plugin `aspire`: offline, on the random-init tiny checkpoint and the example tasks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from aspire_bench.harness.store import Store
from aspire_bench.lm_eval_plugin import AspireLM

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "lm_eval_tasks"
# The example YAMLs name their data files relative to the repository root (datasets resolves them
# against the working directory), as a user running from a checkout does.
pytestmark = pytest.mark.usefixtures("at_repo_root")


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def gen_request(context: str, gen_kwargs: dict, i: int = 0) -> Instance:
    return Instance("generate_until", {}, (context, gen_kwargs), i, ("unit", i, 1))


def test_simple_evaluate_example_tasks_records_the_run(random_tiny, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager
    db = tmp_path / "r.db"
    tm = TaskManager(include_path=str(TASKS), include_defaults=False)  # built-ins take a minute to index
    out = lm_eval.simple_evaluate(
        model="aspire", tasks=["aspire_aime_mini", "aspire_mc_mini"], task_manager=tm, limit=2,
        model_args=f"pretrained={random_tiny},decoder=aspire,decoder.min_pages=1,batch_size=2,store={db},parity=true",
        gen_kwargs="max_gen_toks=6", log_samples=True)
    res = out["results"]
    assert 0.0 <= res["aspire_aime_mini"]["exact_match,boxed"] <= 1.0
    assert 0.0 <= res["aspire_mc_mini"]["acc,none"] <= 1.0
    aime, mc = out["samples"]["aspire_aime_mini"], out["samples"]["aspire_mc_mini"]
    assert len(aime) == 2 and len(mc) == 2
    assert all(isinstance(s["resps"][0][0], str) for s in aime)
    assert aime[0]["target"] == "10" and "\\boxed{}" in str(aime[0]["arguments"])
    assert len(mc[0]["resps"]) == 4 and mc[0]["target"] == 1  # one loglikelihood per choice; answer B
    with Store(db) as st:
        runs = st.list_runs()
        assert len(runs) == 1  # the multiple-choice task decodes nothing, so only the AIME run is stored
        rec = st.get_run(runs[0]["run_id"])
    assert rec.config["task"] == "lm-eval:aspire_aime_mini" and rec.config["decoder"] == "aspire"
    assert rec.config["decoder_args"] == {"min_pages": 1} and rec.config["max_new_tokens"] == 6
    assert rec.env["lm_eval"] and rec.aggregates["n_requests"] == 2
    assert rec.aggregates["decode_tok_s"] > 0 and rec.aggregates["parity_identical_pct"] == 100.0
    assert all(r.id.startswith("aspire_aime_mini/") for r in rec.requests)
    # The stored text is what lm-eval scored.
    assert sorted(r.text for r in rec.requests) == sorted(s["resps"][0][0] for s in aime)


def test_example_aime_task_scores_the_last_boxed_integer():
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.tasks import TaskManager, get_task_dict
    tm = TaskManager(include_path=str(TASKS), include_defaults=False)
    task = get_task_dict(["aspire_aime_mini"], tm)["aspire_aime_mini"]
    docs = list(task.test_docs())
    assert len(docs) == 6 and all(d["answer"].isdigit() for d in docs)
    regex = task.config.filter_list[0]["filter"][0]
    extract = RegexFilter(regex["regex_pattern"], regex["group_select"])
    got = list(extract.apply([["first \\boxed{12}, finally \\boxed{ 10 }."], ["no box: 10"]], docs[:2]))
    assert got == [["10"], ["[invalid]"]]
    assert task.process_results(docs[0], ["10"])["exact_match"] == 1.0
    assert task.process_results(docs[0], ["12"])["exact_match"] == 0.0


def test_aspire_and_ar_generate_the_same_and_honour_stop_strings(random_tiny, tmp_path):
    long = " ".join(f"entry {i}: the keeper logged a barge." for i in range(40))  # > max_length: left-truncated
    prompts = ["Problem: find the sum of 2 and 3.\nSolution:", "def fibonacci(n):\n    ", long]
    lm = AspireLM(pretrained=str(random_tiny), decoder="ar", batch_size=2, max_length=96, store=str(tmp_path / "s.db"))
    assert len(lm.tok_encode(long)) > lm.max_length
    free = lm.generate_until([gen_request(p, {"until": [], "max_gen_toks": 10}, i) for i, p in enumerate(prompts)])
    assert all(free) and len(free) == 3
    # A stop string taken from the middle of the first free generation: the output must end just before it.
    stop = free[0][3:5] if len(free[0]) >= 5 else free[0][-1]
    kwargs = {"until": [stop], "max_gen_toks": 10, "do_sample": False}
    reqs = [gen_request(p, kwargs, i) for i, p in enumerate(prompts)]
    ar = lm.generate_until(reqs)
    assert ar[0] == free[0][:free[0].index(stop)] and stop not in ar[0]
    for a, f in zip(ar, free):
        assert f.startswith(a) and stop not in a
    # Decoding itself stopped at the token that completes the stop string (not just the text cut).
    with Store(tmp_path / "s.db") as st:
        rec = st.get_run(st.list_runs()[-1]["run_id"])
    first = rec.requests[0]
    assert first.finish_reason == "stop" and len(first.output_ids) < 10
    assert stop in lm.tok_decode(first.output_ids) and stop not in lm.tok_decode(first.output_ids[:-1])
    aspire = AspireLM(pretrained=str(random_tiny), decoder="aspire", decoder_args={"min_pages": 1, "gamma_init": 4}, batch_size=2,
                      max_length=96)
    assert aspire.generate_until(reqs) == ar
    assert aspire.generate_until([gen_request(p, {"until": [], "max_gen_toks": 10}, i)
                                  for i, p in enumerate(prompts)]) == free


def test_sampled_generation_does_equal_work_and_scores_text_up_to_the_stop(random_tiny, tmp_path):
    prompts = ["Problem: find the sum of 2 and 3.\nSolution:", "def fibonacci(n):\n    "]
    db = tmp_path / "s.db"
    kwargs = {"until": [" "], "max_gen_toks": 10, "do_sample": True}  # a stop string that comes early
    lm = AspireLM(pretrained=str(random_tiny), decoder="ar", batch_size=2, max_length=96, store=str(db))
    texts = lm.generate_until([gen_request(p, kwargs, i) for i, p in enumerate(prompts)])
    with Store(db) as st:
        rec = st.get_run(st.list_runs()[-1]["run_id"])
    assert rec.config["equal_work"] and all(len(r.output_ids) == 10 for r in rec.requests)  # stops ignored
    for text, r in zip(texts, rec.requests):  # the scored text: the generation cut at the stop string
        assert " " not in text and lm.tok_decode(r.output_ids).startswith(text)
    early = AspireLM(pretrained=str(random_tiny), decoder="ar", batch_size=2, max_length=96, store=str(db),
                     equal_work=False)
    assert early.generate_until([gen_request(p, kwargs, i) for i, p in enumerate(prompts)]) == texts
    with Store(db) as st:
        rec = st.get_run(st.list_runs()[-1]["run_id"])
    assert not rec.config["equal_work"] and any(len(r.output_ids) < 10 for r in rec.requests)


def test_loglikelihood_equals_transformers(random_tiny, monkeypatch):
    from transformers import AutoModelForCausalLM
    lm = AspireLM(pretrained=str(random_tiny), batch_size=3, max_length=96)
    monkeypatch.setattr(lm.engine, "prefill_chunk", 40)  # contexts span several prefill pieces
    tok = lm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(random_tiny), dtype=torch.float32).eval()
    text = " ".join(f"line {i}: the lighthouse keeper trims the wick." for i in range(20))
    pairs = [("The correct answer is (", "B"), ("Lantern Spring is warm", " even in winter."),
             (text, " The end of the log."),  # longer than max_length: truncated from the left
             ("def f(x):\n", "    return x * 2\n"), ("", "Velmora keeps a ledger.")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i, ("unit", i, 1)) for i, p in enumerate(pairs)])

    def reference(ctx_ids, cont_ids):
        seq = (ctx_ids + cont_ids)[-(lm.max_length + 1):]
        with torch.no_grad():
            logits = hf(torch.tensor([seq[:-1]])).logits[0, -len(cont_ids):]
        lp = torch.log_softmax(logits.float(), -1)
        target = torch.tensor(cont_ids)
        return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())

    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        if ctx:
            spaces = len(ctx) - len(ctx.rstrip())  # lm-eval moves trailing whitespace to the continuation
            if spaces:
                ctx, cont = ctx[:-spaces], ctx[-spaces:] + cont
            whole, ctx_ids = tok.encode(ctx + cont), tok.encode(ctx)
            ref = reference(ctx_ids, whole[len(ctx_ids):])
        else:
            ref = reference([lm.prefix_token_id], tok.encode(cont))
        assert logprob == pytest.approx(ref[0], abs=2e-3) and greedy == ref[1]
    assert len(tok.encode(text)) > lm.max_length

    # Rolling perplexity over several max_length windows, each scored in 256-token-capped pieces.
    doc = text
    ids = tok.encode(doc)
    assert len(ids) > 2 * lm.max_length
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, lm.prefix_token_id, lm.max_length, 1)]
    total = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0, ("unit", 0, 1))])[0]
    assert total == pytest.approx(sum(reference(c, t)[0] for c, t in windows), abs=5e-3)


def test_chat_template_and_gen_kwargs(random_tiny, monkeypatch):
    lm = AspireLM(pretrained=str(random_tiny), decoder="ar", max_gen_toks=7)
    monkeypatch.setattr(lm.tokenizer, "chat_template",
                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}", raising=False)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert lm.apply_chat_template(chat) == "<user>What is 2+2?\n<assistant>"
    assert lm.chat_template(True) == lm.tokenizer.chat_template and lm.tokenizer_name
    stops, max_new, params = lm.sampling_settings({"until": "###", "do_sample": True, "top_p": 0.9})
    assert stops[0] == "###" and max_new == 7 and params.temperature == 1.0 and params.top_p == 0.9
    _, max_new, params = lm.sampling_settings({"max_new_tokens": 3, "do_sample": False, "temperature": 0.7})
    assert max_new == 3 and params.greedy
    from aspire_bench.errors import ConfigError
    for bad in ({"top_p": 0.0}, {"top_p": -0.5}, {"top_p": 1.5}, {"top_k": -1}, {"temperature": -1.0}):
        with pytest.raises(ConfigError, match=r"need temperature >= 0, top_k >= 0 \(0 = off\) and 0 < top_p <= 1"):
            lm.sampling_settings({"do_sample": True, **bad})


def test_cli_wrapper_end_to_end(random_tiny, tmp_path):
    from click.testing import CliRunner

    from aspire_bench.lm_eval_cli import lm_eval_command
    out_dir, db = tmp_path / "out", tmp_path / "cli.db"
    args = ["--skip-builtin-tasks", "--ar-reference", "run", "--model", "aspire",
            "--model_args", f"pretrained={random_tiny},decoder=aspire,decoder.min_pages=1,store={db}",
            "--tasks", "aspire_aime_mini", "--include_path", str(TASKS), "--limit", "2",
            "--batch_size", "2", "--gen_kwargs", "max_gen_toks=4", "--device", "cpu",
            "--output_path", str(out_dir), "--log_samples"]
    result = CliRunner().invoke(lm_eval_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "aspire_aime_mini" in result.output and "exact_match" in result.output
    files = list(out_dir.rglob("results_*.json"))
    assert len(files) == 1
    results = json.loads(files[0].read_text())["results"]
    assert set(results) == {"aspire_aime_mini"}
    assert len(list(out_dir.rglob("samples_aspire_aime_mini_*.jsonl"))) == 1
    with Store(db) as st:
        ar, run = st.list_runs()  # --ar-reference: AR on the same requests, in the same group
    assert run["task"] == "lm-eval:aspire_aime_mini" and run["aggregates"]["n_requests"] == 2
    assert (ar["decoder"], run["decoder"]) == ("ar", "aspire") and ar["group"] == run["group"]


def test_with_model_arg():
    from aspire_bench.lm_eval_cli import with_model_arg
    assert with_model_arg(["--model_args", "a=1", "--x"], "b=2") == ["--model_args", "a=1,b=2", "--x"]
    assert with_model_arg(["--model_args=a=1"], "b=2") == ["--model_args=a=1,b=2"]
    assert with_model_arg(["--tasks", "t"], "b=2") == ["--tasks", "t", "--model_args", "b=2"]


def test_model_and_decoder_args_are_separate(random_tiny, caplog):
    from aspire_bench.errors import ConfigError
    with pytest.raises(ConfigError, match=r"unknown model_args key 'gamma'.*decoder\.gamma=4"):
        AspireLM(pretrained=str(random_tiny), decoder="aspire", gamma=4)
    with pytest.raises(ConfigError, match=r"ignores gamma=4.*policy=adaptive"):
        AspireLM(pretrained=str(random_tiny), decoder="aspire", **{"decoder.gamma": 4})
    fixed = AspireLM(pretrained=str(random_tiny), decoder="aspire", **{"decoder.policy": "fixed", "decoder.gamma": 4})
    assert fixed.decoder_args == {"policy": "fixed", "gamma": 4}
    with caplog.at_level("WARNING"):
        lm = AspireLM.create_from_arg_string(f"pretrained={random_tiny},revision=main,trust_remote_code=true,"
                                             "dtype=auto")
    assert "revision=main changes nothing" in caplog.text and "trust_remote_code" in caplog.text
    assert lm.engine.dtype == torch.float32  # the checkpoint's torch_dtype
    with pytest.raises(ConfigError, match="store=PATH"):
        AspireLM(pretrained=str(random_tiny), decoder="aspire", ar_reference=True)


def test_checkpoint_dtype_is_read_from_config(tmp_path):
    from aspire_bench.engine.loading import checkpoint_dtype
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) == "float32"


def test_ar_reference_stores_ar_in_the_same_group(random_tiny, tmp_path):
    from aspire_bench.harness.tables import summary_table, table_data
    db = str(tmp_path / "r.db")
    lm = AspireLM(pretrained=str(random_tiny), decoder="aspire", decoder_args={"min_pages": 1}, batch_size=2,
                  max_length=96, store=db, ar_reference=True)
    lm.generate_until([gen_request(p, {"until": [], "max_gen_toks": 6}, i)
                       for i, p in enumerate(["a b c", "the keeper"])])
    with Store(db) as st:
        recs = [st.get_run(s["run_id"]) for s in st.list_runs()]
    assert [r.config["decoder"] for r in recs] == ["ar", "aspire"] and recs[0].group == recs[1].group
    assert recs[0].config["decoder_args"] == {} and recs[0].config["task"] == recs[1].config["task"]
    assert [r.output_ids for r in recs[0].requests] == [r.output_ids for r in recs[1].requests]  # greedy
    headers, rows = table_data(summary_table(recs))
    assert rows[1][headers.index("× AR")].endswith("x")
    from aspire_bench.harness import figures  # the leaderboard's reference: this AR run
    assert [a.run_id for a in figures.ar_references(recs)[recs[1].run_id]] == [recs[0].run_id]

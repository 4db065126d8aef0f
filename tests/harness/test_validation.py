"""Validation at the edges, in process: property-based fuzzing (hypothesis) of the prompts JSONL
reader, the sweep schema and the decoder-argument parser (every input is either accepted with sane
values or refused with a UserError, never another exception), plus the recovery JSONL, cgroup memory
limits and streamed generate output."""
from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aspire_bench.cli import parse_decoder_args
from aspire_bench.decoders import get_decoder
from aspire_bench.engine.memory import cgroup_available_bytes
from aspire_bench.errors import StoreError, UserError
from aspire_bench.harness.prompts import encode_prompts, parse_line
from aspire_bench.harness.records import RunRecord, config_hash
from aspire_bench.harness.store import Store, recovery_path, save_record
from aspire_bench.harness.sweep import TOP_KEYS, expand

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 100
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)


class WordTokenizer:
    def encode(self, text):
        return [len(w) % VOCAB for w in text.split()]


# --- prompts JSONL ----------------------------------------------------------------------------------

def _check_line(line: str) -> None:
    try:
        [(rid, ids)] = encode_prompts([parse_line(line, 1)], WordTokenizer(), VOCAB)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(rid, str) and ids
    assert all(type(t) is int and 0 <= t < VOCAB for t in ids)


@FUZZ
@given(st.text(max_size=40))
def test_prompt_lines_of_any_text(line):
    _check_line(line)


@FUZZ
@given(st.dictionaries(st.sampled_from(["id", "prompt", "input_ids", "extra"]), json_values, max_size=3)
       | json_values)
def test_prompt_lines_of_any_json(obj):
    _check_line(json.dumps(obj))


@FUZZ
@given(st.lists(st.integers(-5, VOCAB + 5), max_size=6))
def test_prompt_token_ids_are_in_the_vocabulary_or_refused(ids):
    ok = bool(ids) and all(0 <= t < VOCAB for t in ids)
    try:
        row = parse_line(json.dumps({"id": "a", "input_ids": ids}), 1)
        assert encode_prompts([row], None, VOCAB) == [("a", ids)]
        assert ok
    except UserError:
        assert not ok


# --- sweep schema -----------------------------------------------------------------------------------

sweep_values = st.one_of(json_values, st.sampled_from(["tiny", "ar", "needle", "4k", 0, 1, -1, True, "false"]),
                         st.lists(st.sampled_from(["tiny", "ar", "aspire", "needle", "4k", 2, None]), max_size=3))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(TOP_KEYS | {"bogus"})), sweep_values, max_size=6))
def test_sweep_specs_are_accepted_or_refused(extra):
    spec = {"models": ["tiny"], "decoders": ["ar"], "tasks": ["needle"], **extra}
    try:
        sw = expand(spec)
    except UserError as e:
        assert "\n" not in str(e)
        return
    for cell in sw.cells:  # what was accepted is what runs: no coerced or clamped values
        c = cell.config
        assert type(c.batch_size) is int and c.batch_size >= 1 and type(c.repeat) is int and c.repeat >= 1
        assert type(c.parity) is bool and c.temperature >= 0 and 0 < c.top_p <= 1
        assert c.max_new_tokens is None or c.max_new_tokens >= 1


# --- decoder arguments ------------------------------------------------------------------------------

arg_text = st.text(st.sampled_from("abcdefgmprtu_=-.0123456789 eTFnx"), max_size=14)
names = st.sampled_from(["gamma", "ratio", "refresh", "d_max", "budget", "policy", "omega", "bogus"])


@FUZZ
@given(st.sampled_from(["ar", "magicdec", "vegas", "aspire", "aspire-fixed"]),
       st.lists(arg_text | st.builds(lambda k, v: f"{k}={v}", names, arg_text), max_size=3))
@example("aspire", ["omega=0"])  # an EMA weight of 0 was once accepted (a random seed found it)
def test_decoder_args_are_accepted_or_refused(decoder, pairs):
    try:
        dec = get_decoder(decoder, **parse_decoder_args(tuple(pairs)))
    except UserError as e:
        assert "\n" not in str(e)
        return
    for k, v in dec.settings().items():  # accepted values are in range, never silently changed
        if k in ("gamma", "budget", "d_max") and v is not None:
            assert type(v) is int and v >= 0
        if k in ("ratio", "omega"):
            assert 0 < v <= 1


@pytest.mark.parametrize("arg, fragment", [("gamma=abc", "gamma"), ("gamma=4.5", "gamma"), ("gamma=-1", "gamma"),
                                           ("refresh=yes", "refresh"), ("ratio=0", "ratio"), ("nope=1", "unknown")])
def test_decoder_arg_messages_name_the_setting(arg, fragment):
    with pytest.raises(UserError, match=fragment):
        get_decoder("aspire", **parse_decoder_args((arg,)))


# --- recovery JSONL ---------------------------------------------------------------------------------

def _record() -> RunRecord:
    config = {"decoder": "ar", "model": "tiny", "task": "needle"}
    return RunRecord(config=config, config_hash=config_hash(config), env={}, aggregates={"decode_tok_s": 1.5})


def test_a_failed_save_leaves_a_recovery_file_that_imports_back(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from aspire_bench.cli import main
    db = tmp_path / "r.db"

    def disk_full(self, record):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Store, "save_run", disk_full)
    with pytest.raises(StoreError, match="recovery.jsonl") as e:
        save_record(db, _record())
    assert str(recovery_path(db)) in str(e.value)
    monkeypatch.undo()
    res = CliRunner().invoke(main, ["import", str(recovery_path(db)), "--store", str(db)])
    assert res.exit_code == 0, res.output
    with Store(db, readonly=True) as s:
        assert s.get_run(1).aggregates == {"decode_tok_s": 1.5}


# --- cgroup memory limits ---------------------------------------------------------------------------

def _cgroup(tmp_path, version: int, limit: str, usage: int, inactive: int):
    root = tmp_path / "cg"
    d = root / "job" if version == 2 else root / "memory" / "job"
    d.mkdir(parents=True)
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    (d / names[0]).write_text(limit + "\n")
    (d / names[1]).write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"anon 5\n{names[2]} {inactive}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n" if version == 2 else "4:memory:/job\n1:cpu:/\n")
    return root, proc


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limits_bound_the_memory_check(tmp_path, version):
    root, proc = _cgroup(tmp_path, version, str(8 << 30), 6 << 30, 1 << 30)
    assert cgroup_available_bytes(root, proc) == 3 << 30  # limit - usage + reclaimable page cache


@pytest.mark.parametrize("version, limit", [(2, "max"), (1, str(9223372036854771712))])
def test_no_cgroup_limit_means_none(tmp_path, version, limit):
    root, proc = _cgroup(tmp_path, version, limit, 6 << 30, 0)
    assert cgroup_available_bytes(root, proc) is None


def test_cgroup_path_outside_the_namespace_reads_the_mount(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text(f"{4 << 30}\n")
    (root / "memory.current").write_text(f"{1 << 30}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/docker/abc\n")
    assert cgroup_available_bytes(root, proc) == 3 << 30


# --- generate streams its rows ------------------------------------------------------------------------

def test_generate_writes_rows_as_requests_finish(tmp_path):
    from click.testing import CliRunner

    from aspire_bench.cli import main
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n\n{"id": "b", "prompt": "def f(x):"}\n')
    res = CliRunner().invoke(main, ["generate", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2",
                                    "--batch-size", "1", "--attention-backend", "torch"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"] and all(1 <= len(r["output_ids"]) <= 2 for r in rows)
    assert not (tmp_path / "o.jsonl.partial").exists()


def test_request_on_finish_is_called_once_per_request():
    from aspire_bench.decoders import Request, SamplingParams
    from aspire_bench.engine import Engine
    engine = Engine.from_pretrained("tiny", attention_backend="torch")
    seen = []
    reqs = [Request(str(i), [3 + i, 4, 5], 2 + 3 * i, on_finish=lambda ids, why, i=i: seen.append((i, len(ids))))
            for i in range(3)]
    out = get_decoder("ar").generate(engine, reqs, SamplingParams(), batch_size=3)  # no EOS: full lengths
    assert sorted(seen) == [(i, len(r.output_ids)) for i, r in enumerate(out.results)]
    assert [i for i, _ in seen] == [0, 1, 2]  # in finishing order: the shortest first

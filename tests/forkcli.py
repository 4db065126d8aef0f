"""The real CLI in a fresh process per command, without paying torch's import each time.

A server process imports aspire_bench.cli (torch, pandas, click) once; each command is run in a
fork of it: its own process, working directory, environment, stdout and stderr, exit status. The
server never runs a model, so a fork starts from clean state. Tests take it as the session fixture
`cli` (tests/conftest.py): `cli(*args, cwd=...)`.
Run as a script, this file is the server (one JSON request a line on stdin, one reply a line).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _serve() -> None:
    import aspire_bench.harness.frames
    import aspire_bench.harness.runner  # noqa: F401 - torch and the engine, imported once for every fork
    from aspire_bench import cli
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(err, 2)
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the fork's own stream
                if req["close_stdout"]:
                    os.close(1)  # as `>&-`: the process starts with no stdout
                    sys.stdout = None
                else:
                    os.dup2(out, 1)
                    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the fork's own stream
                os.close(out)
                os.close(err)
                try:
                    cli.main(req["args"], prog_name="aspire-bench")
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:  # noqa: BLE001 - a traceback is the failure the tests look for
                    import traceback
                    traceback.print_exc()
                    code = 1
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream and stream.flush()
                    except Exception:  # noqa: BLE001, S110 - a stream closed by the command itself
                        pass
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkCLI:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.tmp = Path(tempfile.mkdtemp(prefix="forkcli-"))

    def __call__(self, *args, cwd: Path, env: dict | None = None, close_stdout: bool = False
                 ) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if not k.startswith("ASPIRE_BENCH_")}
        base.update(NO_COLOR="1", COLUMNS="200", OMP_NUM_THREADS="1",
                    ASPIRE_BENCH_CALIBRATION_DIR=os.environ.get("ASPIRE_BENCH_CALIBRATION_DIR", str(self.tmp)))
        out, err = self.tmp / "stdout", self.tmp / "stderr"
        req = {"args": [str(a) for a in args], "cwd": str(cwd), "env": {**base, **(env or {})},
               "stdout": str(out), "stderr": str(err), "close_stdout": close_stdout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return subprocess.CompletedProcess(req["args"], rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    _serve()

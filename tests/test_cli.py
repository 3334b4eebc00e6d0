"""The command line as a new user meets it: one-line errors with exit status 2 (the traceback with
--debug), precompile's summary for a person (--json for the record), the entry point's name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kermac_like.__main__ as cli
from kermac_like.runtime import compiler

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    """(exit status, stdout, stderr) of main(argv) in this process."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's errors and -h
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,needle", [
    (("precompile", "--preset", "nosuch"), "--preset: invalid choice: 'nosuch'"),
    (("precompile", "--all", "--arch", "sm_50"), "--arch: 'sm_50' is not a supported architecture"),
    (("precompile", "--all", "--arch", "sm_80", "--family", "nosuch"), "--family: invalid choice: 'nosuch'"),
    (("nosuch",), "invalid choice: 'nosuch'"),
    (("tune", "--preset", "nosuch"), "--preset: invalid choice"),
    (("precompile",), "give --all, --first-calls or at least one --preset"),
])
def test_unknown_names_one_line_status_2(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    assert err.startswith("python -m kermac_like"), err


def test_failures_one_line_unless_debug(capsys, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("NVRTC failed to compile 1 kernel(s) for sm_80\nNVRTC log:\n...")

    monkeypatch.setattr(compiler, "precompile_specs", fail)
    rc, out, err = _run(capsys, "precompile", "--arch", "sm_80", "--preset", "l1")
    assert rc == 1 and err.count("\n") == 1 and "NVRTC failed to compile" in err and "--debug" in err, err
    for argv in (("--debug", "precompile", "--arch", "sm_80", "--preset", "l1"),
                 ("precompile", "--arch", "sm_80", "--preset", "l1", "-d")):
        with pytest.raises(RuntimeError, match="NVRTC failed"):  # the traceback: the exception itself
            cli.main(list(argv))


SUMMARY = dict(arch="sm_80", requested=12, cached=3, compiled=9, programs=2, processes=2, seconds=4.25,
               spills={f"kermac_like::k<{i}>": (8 * i, 8 * i) for i in range(1, 8)})


def test_precompile_prints_a_summary_and_json_on_request(capsys, monkeypatch):
    monkeypatch.setattr(compiler, "precompile_specs", lambda *a, **k: dict(SUMMARY, spills=dict(SUMMARY["spills"])))
    rc, out, _ = _run(capsys, "precompile", "--arch", "sm_80", "--preset", "l1")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("sm_80: 12 kernel(s) requested, 3 already cached, 9 compiled (2 NVRTC program(s) "
                               "in 2 process(es)) in 4.2 s"), lines[0]
    assert lines[1] == "7 compiled kernel(s) spill registers (bytes stored / loaded):"
    assert lines[2] == "  8 / 8  kermac_like::k<1>" and len(lines) == 2 + cli.SPILLS_SHOWN + 1
    assert lines[-1] == "  and 2 more (--json lists them all)"
    rc, out, _ = _run(capsys, "precompile", "--arch", "sm_80", "--preset", "l1", "--json")
    record = json.loads(out)
    assert rc == 0 and record["compiled"] == 9 and len(record["spills"]) == 7 and "wall_seconds" in record
    no_spill = cli.precompile_text(dict(SUMMARY, spills={}, bundle="/tmp/b/kernels.sqlite"))
    assert no_spill.splitlines()[1:] == ["bundle: /tmp/b/kernels.sqlite"]


def test_entry_point_names_itself_and_exits_2(capsys, monkeypatch):
    """Through the console script (``kermac-like`` in pyproject.toml) the usage and errors say
    ``kermac-like``; once in a new process, so that the exit status and stderr are the real ones."""
    assert 'kermac-like = "kermac_like.__main__:main"' in (ROOT / "pyproject.toml").read_text()
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kermac-like"])
    rc, out, _ = _run(capsys, "-h")
    assert rc == 0 and out.startswith("usage: kermac-like ")
    code = ("import sys; sys.argv[0] = '/usr/local/bin/kermac-like'; from kermac_like.__main__ import main; "
            "sys.exit(main())")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code, "precompile", "--preset", "nosuch"], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("kermac-like precompile: error: argument --preset") and r.stderr.count("\n") == 1

"""The suite's fork server (tests/forkserver.py) runs a script the way a new interpreter would: the
tests that trust it to start trainer processes rely on each property checked here."""

import os
import signal
import sys

from procs import ENV, FORKS

SCRIPT = r"""
import atexit, os, random, sys, threading, time
import numpy
print("argv", sys.argv[1:], __name__, os.path.dirname(os.path.abspath(__file__)) == sys.path[0])
print("cwd", os.getcwd(), "env", os.environ.get("FRK_FORK_PROBE"), "package", "fastai_resume" in sys.modules)
print("seeds", hash("fastai-resume"), random.random(), numpy.random.random())
print("set", list({"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}))
atexit.register(lambda: print("atexit"))
threading.Thread(target=lambda: (time.sleep(0.1), print("thread joined"))).start()
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), 9)
if how == "raise":
    raise ValueError("raised in the script")
if how == "exit":
    sys.exit(3)
"""


def lines(p):
    return dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)


def test_a_forked_run_is_a_new_interpreter_for_the_script(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = dict(ENV, FRK_FORK_PROBE="yes")
    runs = [FORKS.run([sys.executable, str(script), "ok", "x y"], env, 120, tmp_path) for _ in range(4)]
    for p in runs:
        assert p.returncode == 0, p.stderr
        out = lines(p)
        assert out["argv"] == "['ok', 'x y'] __main__ True"
        assert out["cwd"] == f"{tmp_path} env yes package False"  # the package is imported by the run itself
        assert p.stdout.splitlines()[-2:] == ["thread joined", "atexit"] and p.stderr == "to stderr\n"
    seeds = [lines(p)["seeds"].split() for p in runs]
    assert len({lines(p)["set"] for p in runs}) > 1  # sets of strings iterate in more than one order
    # consecutive runs (a killed run and its rerun) come from servers with different hash seeds
    assert seeds[0][0] != seeds[1][0] and seeds[1][0] != seeds[2][0]
    assert len({s[1] for s in seeds}) == len({s[2] for s in seeds}) == 4  # random and numpy reseeded per run
    killed = FORKS.run([sys.executable, str(script), "kill"], env, 120, tmp_path)
    assert killed.returncode == -signal.SIGKILL and "atexit" not in killed.stdout
    raised = FORKS.run([sys.executable, str(script), "raise"], env, 120, tmp_path)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: raised in the script")
    assert FORKS.run([sys.executable, str(script), "exit"], env, 120, tmp_path).returncode == 3


def test_fresh_mode_runs_a_new_interpreter(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text("import os, sys; print(os.getppid(), 'torch' in sys.modules)")
    monkeypatch.setenv("FRK_TEST_FRESH", "1")
    p = FORKS.run([sys.executable, str(script)], ENV, 120, tmp_path)
    assert p.stdout.split() == [str(os.getpid()), "False"]


def test_a_runs_output_is_read_until_the_processes_it_left_close_it(tmp_path):
    "As subprocess.run: a child process the run forked and left behind still writes to its output."
    script = tmp_path / "leaves.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(0.5); print('from the process left behind', flush=True); os._exit(0)\n"
        "print('from the run', flush=True); os.kill(os.getpid(), 9)\n"
    )
    p = FORKS.run([sys.executable, str(script)], ENV, 120, tmp_path)
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.splitlines() == ["from the run", "from the process left behind"]

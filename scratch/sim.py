import os, subprocess, sys, tempfile, time

from mltuner.launch._env import free_port
def run(n, args, extra_env=None):
    port = free_port(); out = tempfile.mkdtemp(); procs = []
    for rank in range(n):
        env = dict(os.environ, MLTUNER_RANK=str(rank), MLTUNER_WORLD_SIZE=str(n), MLTUNER_LOCAL_RANK=str(rank),
                   MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port), MLTUNER_SECRET="s", PYTHONUNBUFFERED="1", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "sim_worker.py", "--out", out, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for line in outs[0].splitlines():
        if "ELAPSED" in line: return line
    return outs[0][-2000:]
base = ["--runs", "3", "--clocks", "40", "--rule", "add", "--work-s", "0.004", "--slow-rank", "1", "--slow-s", "0", "--prob", "0.1"]
for rep in range(2):
    for name, extra, env in [("slack1", ["--slack", "1"], None), ("steal shared", ["--slack", "1", "--steal"], None), ("steal rank0", ["--slack", "1", "--steal"], {"MLTUNER_SHARED_CLAIMS": "0"})]:
        print(name, run(int(sys.argv[1]), base + extra, env), flush=True)

import os, subprocess, sys, tempfile, time

from mltuner.launch._env import free_port
def run(n, args):
    port = free_port(); out = tempfile.mkdtemp(); procs = []
    for rank in range(n):
        env = dict(os.environ, MLTUNER_RANK=str(rank), MLTUNER_WORLD_SIZE=str(n), MLTUNER_LOCAL_RANK=str(rank),
                   MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port), MLTUNER_SECRET="s", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, "sim_worker.py", "--out", out, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for line in outs[0].splitlines():
        if "ELAPSED" in line: return line
    return outs[0][-2000:]
base = ["--runs", "3", "--clocks", "40", "--rule", "add", "--work-s", "0.01", "--slow-rank", "1", "--slow-s", "0.042", "--prob", "0.1"]
for name, extra in [("bsp", ["--slack", "0"]), ("slack1", ["--slack", "1"]), ("slack1 steal", ["--slack", "1", "--steal"]), ("nopause steal", ["--slack", "1", "--steal", "--slow-s", "0"]), ("nopause bsp", ["--slack", "0", "--slow-s", "0"])]:
    print(name, run(int(sys.argv[1]), base + extra), flush=True)

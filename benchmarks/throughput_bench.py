"""Training throughput of mltuner against PyTorch DistributedDataParallel
(gloo on the CPU, NCCL on GPUs) and plain single-process PyTorch, on the same
model, data, per-worker batch, update rule and number of workers.

    python benchmarks/throughput_bench.py [--device cpu|cuda] [--model cnn|resnet18|transformer|gpt] [--rule momentum|adam]
        [--workers 1,2] [--slacks 0,1] [--batch B] [--steps K] [--warmup W] [--overlap auto|step|backward] [--repeat R]
        [--quick] [--trace DIR] [--hops DIR] [--out PATH.md] [--figures PATH.json]

The runs:

1. plain PyTorch: this process, the model and a torch.optim.SGD;
2. mltuner, 1 worker, slack 0: one process under ``mltuner launch``, an
   ``mltuner.Job`` and the model wrapped with ``mltuner.torch``;
3. for each N >= 2 of ``--workers``: DDP on N processes, and mltuner on N
   processes at each slack of ``--slacks`` (0 is BSP; s lets a worker run s
   clocks ahead of the slowest).

Models: ``cnn`` is the MNIST-1D CNN on inputs of shape (B, 1, 40), the
default on the CPU; ``resnet18`` is torch_bench.py's ResNet-18 on 32x32x3
images, the default on a GPU; ``transformer`` is a BERT-base-sized text
classifier (a 30,522-token embedding, 12 ``nn.TransformerEncoderLayer`` of
width 768, 256 tokens a sample, mean-pooled into a linear head; 108.5 M
parameters, default batch 16); ``gpt`` is gpu_path_bench.py's language model of GPT-2
small's shape (its output projection tied to the token embedding, 124 M
parameters, batch 16 of 256 tokens, next-token cross-entropy on random
tokens); the others have 10 classes; synthetic data. Every run starts
from the same weights (seed 0); rank r trains on its own fixed batch, the
same in every run (plain PyTorch uses rank 0's), kept on the device, so the
figure is of the training step and its communication, not of data loading.
The update rule is the same everywhere: the servers' momentum
``h = (1-m) g + m h; w -= lr h`` on the gradient averaged over the workers,
which is torch's SGD with ``momentum=m, dampening=m`` (lr 0.05, m 0.9; torch
takes its first step with the undamped gradient, the only difference); with
``--rule adam``, torch's Adam (lr 0.001) on both sides. The
loss of rank 0's last step is in the table as a check that the runs train
alike. Batch-norm running statistics stay local to each worker (mltuner does
so; DDP is told not to broadcast them).

``--overlap`` says when mltuner's updates leave: ``auto`` (wrap()'s rule:
at step() on the CPU and within one process, from the backward pass on GPUs
across processes), ``step`` or ``backward`` (``wrap(overlap_updates=)``);
run the benchmark once with each to compare the two on a machine.

Each run takes ``--warmup`` untimed steps, then meets at a barrier so that
the ranks start together, then ``--steps`` timed steps, CUDA synchronised at
both ends. Throughput = N x batch x steps / the slowest rank's timed seconds;
mltuner's last update is still in flight at the end, as it would be in the
middle of training. On the CPU every process, plain PyTorch's too, runs one
torch thread (see ``prepare``). On GPUs rank r uses GPU r mod count;
NCCL cannot put two ranks on one GPU, so a configuration with more workers
than GPUs is skipped, for mltuner as for DDP: comparisons are on equal
hardware.

Figures (``--figures``): 1 worker vs plain PyTorch (goal 0.95 on a GPU);
N workers at slack s vs DDP (goal 1.0 on GPUs at slack >= 1); N workers at
the best slack vs 1 worker (goal 1.9 for 2 workers on 2 GPUs); DDP N vs plain
PyTorch, for reading. Every launched job is bounded by ``--timeout``; a
configuration that fails is reported as failed (its figures have no value)
and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn
from torch.profiler import record_function

import mltuner as mlt
from figures import Figure, ratio, write_figures
from local_job import run_job
from torch_bench import resnet18, synchronize  # benchmarks/ is on sys.path: these scripts live there
from machine import cpu_name

System = Literal["plain", "ddp", "mltuner"]

LR, MOMENTUM = 0.05, 0.9
ADAM_LR = 1e-3
RULES = ("momentum", "adam")
SEED = 0
CLASSES = 10
# (timed steps, warmup steps) per model, full and --quick.
STEPS = {"cnn": (300, 30), "resnet18": (50, 10), "transformer": (30, 10), "gpt": (30, 10)}
QUICK_STEPS = {"cnn": (60, 10), "resnet18": (10, 3), "transformer": (5, 2), "gpt": (5, 2)}
MODEL_NAMES = {"cnn": "MNIST-1D CNN", "resnet18": "ResNet-18", "transformer": "Transformer encoder 12 x 768",
               "gpt": "GPT-2 small, tied embedding"}
BATCH = {"cnn": 128, "resnet18": 128, "transformer": 16, "gpt": 16}  # per worker, when --batch is not given
GPT_VOCABULARY = 50304
# The transformer: BERT-base's sizes (vocabulary, layers, width, heads) at 256 tokens a sample.
VOCABULARY, LAYERS, WIDTH, HEADS, TOKENS = 30522, 12, 768, 12, 256
TRACE_STEPS = 10
# The training thread's parts of a step, as annotations in --trace's traces
# (trace_timeline.py --phases sums them a clock; nothing records them otherwise).
PHASES = ("step.forward", "step.backward", "step.update")


@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration; travels to the launched workers as JSON."""

    system: System
    workers: int
    slack: int
    model: str
    device: str
    batch: int
    steps: int
    warmup: int
    overlap: str = "auto"  # mltuner's wrap(overlap_updates=): auto (None), step (False), backward (True)
    rule: str = "momentum"  # RULES: the servers' damped momentum (= torch SGD with dampening m) or Adam
    trace: str = ""  # a folder: profile TRACE_STEPS more steps per rank with torch.profiler into it
    hops: str = ""  # a folder: mltuner's hop logs (MLTUNER_HOP_LOG), a subfolder per run
    precision: str = "fp32"  # or "bf16": every side's forward under torch.autocast(dtype=bfloat16)

    @property
    def slug(self) -> str:
        return f"{self.system}-{self.workers}w-s{self.slack}"

    @property
    def label(self) -> str:
        if self.system == "plain":
            return "plain PyTorch, 1 process"
        if self.system == "ddp":
            return f"DDP ({backend(self.device)}), {self.workers} workers"
        shipped = {"auto": "", "step": ", updates at step()", "backward": ", updates from backward"}[self.overlap]
        return f"mltuner, {self.workers} worker{'s' if self.workers > 1 else ''}, slack {self.slack}{shipped}"


@dataclasses.dataclass
class Outcome:
    """What a run gave: samples/s, or why there is none."""

    run: Run
    samples_per_s: Optional[float] = None
    loss: Optional[float] = None
    note: str = ""
    failed: str = ""  # the reason, when the run failed
    skipped: str = ""  # the reason, when it was not run


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


# -- what every process runs -------------------------------------------------------


def build_model(name: str) -> nn.Module:
    """The model with the same initial weights in every process (on the CPU)."""
    torch.manual_seed(SEED)
    if name == "cnn":
        from mltuner.apps._cnn import mnist1d_cnn

        return mnist1d_cnn(40, CLASSES)
    if name == "transformer":
        return TextClassifier()
    if name == "gpt":
        return NextTokenLogits()
    return resnet18(num_classes=CLASSES)


class NextTokenLogits(nn.Module):
    """gpu_path_bench.py's tied language model, its logits laid out (batch,
    vocabulary, tokens) for ``cross_entropy`` against the next tokens."""

    def __init__(self) -> None:
        super().__init__()
        from gpu_path_bench import TiedLM

        self.lm = TiedLM(vocab=GPT_VOCABULARY, sequence=TOKENS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens).transpose(1, 2)


class TextClassifier(nn.Module):
    """Token embedding, TransformerEncoder layers (feed-forward 4x, no
    dropout, so that every run computes the same), mean over the tokens,
    a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.encoder = nn.Sequential(*[nn.TransformerEncoderLayer(
            d_model=WIDTH, nhead=HEADS, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def make_batch(run: Run, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s fixed batch: the same in every run."""
    generator = torch.Generator().manual_seed(1000 * SEED + rank)
    if run.model == "gpt":  # the targets are the next tokens
        tokens = torch.randint(0, GPT_VOCABULARY, (run.batch, TOKENS + 1), generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    if run.model == "transformer":
        x = torch.randint(0, VOCABULARY, (run.batch, TOKENS), generator=generator)
    else:
        x = torch.randn(*((run.batch, 1, 40) if run.model == "cnn" else (run.batch, 3, 32, 32)), generator=generator)
    y = torch.randint(0, CLASSES, (run.batch,), generator=generator)
    return x.to(device), y.to(device)


def prepare(run: Run, local_rank: int) -> torch.device:
    """This process's device and thread count."""
    # One intra-op thread per process, whatever N: the models are too small to
    # gain from more, and with cores // N threads the 1-process runs on a
    # shared 2-core machine were up to 20x slower than with one.
    torch.set_num_threads(1)
    if run.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())  # the GPU the engine picks too
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    return device


def timed_steps(step: Callable[[], torch.Tensor], run: Run, device: torch.device, barrier: Callable[[], None],
                rank: int = 0, counters: Callable[[], dict[str, float]] | None = None,
                ) -> tuple[float, float, dict[str, float]]:
    """(seconds of the timed steps, loss of the last step, how much each of
    ``counters()`` grew over the timed steps alone: not over the traced ones)."""
    for _ in range(run.warmup):
        step()
    synchronize(device)
    barrier()  # the ranks start the clock together: no rank's start-up is timed
    before = counters() if counters else {}
    start = time.perf_counter()
    for _ in range(run.steps):
        loss = step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    grown = {name: value - before.get(name, 0) for name, value in counters().items()} if counters else {}
    if run.trace and run.system != "ddp":  # torch 2.13's profiler aborts a gloo job at its end
        traced_steps(step, run, device, rank)
    return elapsed, float(loss.item()), grown


def autocast(run: Run) -> contextlib.AbstractContextManager[Any]:
    """The run's precision: bfloat16 autocast (no scaler needed) or float32."""
    if run.precision == "bf16":
        return torch.autocast(run.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def phased_step(run: Run, forward: Callable[[], torch.Tensor], update: Callable[[], object]) -> torch.Tensor:
    """A training step (``forward`` returns the loss, run under the run's
    autocast), its parts annotated with PHASES for the traces."""
    with record_function(PHASES[0]), autocast(run):
        loss = forward()
    with record_function(PHASES[1]):
        loss.backward()  # type: ignore[no-untyped-call]
    with record_function(PHASES[2]):
        update()
    return loss


def traced_steps(step: Callable[[], torch.Tensor], run: Run, device: torch.device, rank: int) -> None:
    """TRACE_STEPS more steps under torch.profiler (every thread's operators
    and CUDA calls, the engine's included), after the timed ones so that the
    profiler does not slow what is timed: a gzipped Chrome trace and an operator
    table per rank in ``run.trace``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(TRACE_STEPS):
            step()
        synchronize(device)
    folder = Path(run.trace)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{run.slug}-rank{rank}"
    profiler.export_chrome_trace(str(folder / f"{name}.json.gz"))  # gzipped: a transformer's is 30 MB plain
    averages = profiler.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
    (folder / f"{name}.txt").write_text("\n\n".join(tables))


def torch_optimizer(model: nn.Module, rule: str) -> torch.optim.Optimizer:
    if rule == "adam":
        return torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    # The servers' rule h = (1-m) g + m h; w -= lr h is torch's SGD with dampening m.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, dampening=MOMENTUM)


def server_rule(rule: str) -> mlt.UpdateRule:
    """The servers' side of ``torch_optimizer``."""
    if rule == "adam":
        return mlt.UpdateRule("adam", learning_rate=ADAM_LR)
    return mlt.UpdateRule("momentum", learning_rate=LR, momentum=MOMENTUM)


def torch_step(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        return phased_step(run, lambda: nn.functional.cross_entropy(model(x), y), optimizer.step)

    return step


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def plain_run(run: Run) -> dict[str, Any]:
    """Plain PyTorch in this process."""
    device = prepare(run, 0)
    model = build_model(run.model)
    params = parameter_count(model)
    model.to(device)
    x, y = make_batch(run, 0, device)
    elapsed, loss, _ = timed_steps(torch_step(run, model, torch_optimizer(model, run.rule), x, y), run, device,
                                   lambda: None)
    if device.type == "cuda":
        del model, x, y
        torch.cuda.empty_cache()  # leave the GPU to the launched workers
    return {"elapsed_s": [elapsed], "loss": loss, "batch": run.batch, "steps": run.steps, "params": params}


def local_buffers() -> dict[str, Any]:
    """DDP's option to keep buffers (batch-norm running statistics) local to
    each rank after the start, as mltuner does: ``forward_sync_buffers``
    where this torch has it (it deprecates ``broadcast_buffers``)."""
    options = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in options else "broadcast_buffers": False}


def ddp_worker(run: Run) -> Optional[dict[str, Any]]:
    """One DDP rank under ``mltuner launch``; rank 0 returns the result."""
    import torch.distributed as dist

    rank, world = int(os.environ["MLTUNER_RANK"]), int(os.environ["MLTUNER_WORLD_SIZE"])
    device = prepare(run, int(os.environ.get("MLTUNER_LOCAL_RANK", rank)))
    address = f"tcp://{os.environ['MLTUNER_MASTER_ADDR']}:{os.environ['MLTUNER_MASTER_PORT']}"
    # device_id binds the NCCL communicator to this rank's GPU (and barrier() to it).
    dist.init_process_group(backend(run.device), init_method=address, rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    try:
        model = build_model(run.model)
        params = parameter_count(model)
        model.to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, **local_buffers())
        x, y = make_batch(run, rank, device)
        step = torch_step(run, ddp, torch_optimizer(ddp, run.rule), x, y)
        elapsed, loss, _ = timed_steps(step, run, device, dist.barrier, rank)
        times = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(times, torch.tensor([elapsed], dtype=torch.float64, device=device))
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {"elapsed_s": [float(t.item()) for t in times], "loss": loss, "batch": run.batch, "steps": run.steps,
            "params": params}


def mltuner_worker(run: Run) -> Optional[dict[str, Any]]:
    """One mltuner rank under ``mltuner launch``; rank 0 returns the result."""
    import mltuner.torch as mtorch

    if run.hops:  # read by the engine at its first message
        os.environ["MLTUNER_HOP_LOG"] = str(hop_folder(run))
    config = mlt.Config(update_rule=server_rule(run.rule), device="cuda" if run.device == "cuda" else "cpu",
                        wait_timeout_s=120)
    with mlt.Job(config) as job:
        device = prepare(run, job.local_rank)
        model = build_model(run.model)
        params = parameter_count(model)
        model.to(device)
        x, y = make_batch(run, job.rank, device)
        overlap = {"auto": None, "step": False, "backward": True}[run.overlap]
        with autocast(run):  # the recording pass sees what the clocks do
            ps = mtorch.wrap(model, job.worker, example_input=x, slack=run.slack, overlap_updates=overlap,
                             example_loss=lambda out: nn.functional.cross_entropy(out, y))

        def step() -> torch.Tensor:
            return phased_step(run, lambda: nn.functional.cross_entropy(ps(x), y), ps.step)

        def counters() -> dict[str, float]:
            return {"stall_seconds": job.worker.stats["stall_seconds"], **job.transport_stats}

        elapsed, loss, traffic = timed_steps(step, run, device, lambda: job.barrier("timed"), job.rank, counters)
        stall_s = traffic.pop("stall_seconds")
        gathered = job.allgather("elapsed", [elapsed, stall_s])
        job.worker.sync()  # every update applied before the job closes
    if job.rank != 0:
        return None
    return {"elapsed_s": [g[0] for g in gathered], "stall_s": [g[1] for g in gathered], "loss": loss,
            "batch": run.batch, "steps": run.steps, "params": params, "traffic": traffic}


def worker_main(spec: str, result: str) -> int:
    """The launched process: runs its rank of ``spec`` and, on rank 0, writes the result."""
    run = Run(**json.loads(spec))
    outcome = ddp_worker(run) if run.system == "ddp" else mltuner_worker(run)
    if outcome is not None:
        Path(result).write_text(json.dumps(outcome))
    return 0


# -- the benchmark: plan, launch, tabulate ------------------------------------------


def hop_folder(run: Run) -> Path:
    folder = Path(run.hops) / run.slug
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def hops_note(run: Run) -> str:
    """From the run's hop logs (the whole run, warm-up included): each rank's
    send-thread waits for CUDA IPC releases, and the 90th percentile of the
    way of rows and updates to another process (hop_timeline.py)."""
    import hop_timeline  # beside this script

    hops = hop_timeline.read_hops([hop_folder(run)])
    legs = hop_timeline.legs(hops)
    waits = hop_timeline.release_waits(hops)
    parts = [f"rank {rank} release waits {len(waits.get(rank, []))} ({sum(waits.get(rank, [])):.0f} ms)"
             for rank in sorted({hop.rank for hop in hops})]
    for kind in ("clock update", "rows"):
        values = legs.get((kind, "to another process", "queued -> admitted"))
        if values:
            parts.append(f"{kind} to a peer p90 {hop_timeline.percentile(values, 0.9):.2f} ms")
    return "hops: " + ", ".join(parts)


def launched_run(run: Run, timeout_s: float) -> dict[str, Any]:
    """Runs ``run`` on its workers through this script's --worker mode."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(run)),
                   "--result", str(result)]
        return run_job(command, result, run.workers, timeout_s)


def measure(run: Run, params: int, timeout_s: float) -> Outcome:
    """Runs ``run`` and checks that it did the work asked for; a failure
    becomes the outcome's reason instead of ending the benchmark."""
    started = time.perf_counter()
    try:
        result = plain_run(run) if run.system == "plain" else launched_run(run, timeout_s)
        done = (result["batch"], result["steps"], result["params"], len(result["elapsed_s"]))
        if done != (run.batch, run.steps, params, run.workers):
            raise RuntimeError(f"did other work than asked: (batch, steps, parameters, ranks) = {done}, "
                               f"expected {(run.batch, run.steps, params, run.workers)}")
    except Exception as error:  # reported in the table; the other runs go on
        print(f"{run.label}: FAILED: {error}", file=sys.stderr, flush=True)
        return Outcome(run, failed=str(error).splitlines()[0] if str(error) else type(error).__name__)
    slowest = max(result["elapsed_s"])
    outcome = Outcome(run, run.workers * run.batch * run.steps / slowest, result["loss"])
    if "stall_s" in result:
        outcome.note = f"stall {max(result['stall_s']) / run.steps * 1e3:.2f} ms/clock (slowest rank)"
    if run.workers > 1 and result.get("traffic"):
        outcome.note += "; " + traffic_note(result["traffic"], run.steps, run.device == "cuda")
    if run.hops and run.system == "mltuner" and run.workers > 1:
        outcome.note += "; " + hops_note(run)
    if run.workers > 1:
        spread = min(result["elapsed_s"]) / slowest
        outcome.note = "; ".join(filter(None, [outcome.note, f"fastest rank {spread:.2f} of slowest's time"]))
    print(f"{run.label}: {outcome.samples_per_s:.0f} samples/s, loss {outcome.loss:.3f} "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    return outcome


def traffic_note(traffic: dict[str, int], clocks: int, gpu: bool) -> str:
    """Rank 0's payload bytes a timed clock, by path: what went through the
    socket and, on GPUs, what crossed by CUDA IPC and which device payloads
    took host frames instead."""
    def mb(name: str) -> str:
        return f"{traffic.get(name, 0) / clocks / 1e6:.2f}"
    if not gpu:
        return f"rank 0 a clock: socket {mb('socket_payload_bytes')} MB out"
    return (f"rank 0 a clock: CUDA IPC {mb('cuda_ipc_sent_bytes')} MB out, socket {mb('socket_payload_bytes')} MB out "
            f"({mb('device_payload_bytes_by_host')} MB of device rows by host)")


def median_outcome(outcomes: list[Outcome]) -> Outcome:
    """One run's rounds as one outcome: the median samples/s (of an even
    count, the mean of the middle two), with the rounds' spread in its note."""
    measured = sorted((o for o in outcomes if o.samples_per_s is not None), key=lambda o: o.samples_per_s or 0.0)
    if len(outcomes) == 1 or not measured:
        return outcomes[0]
    values = [o.samples_per_s or 0.0 for o in measured]
    notes = [f"median of {len(values)} rounds: {', '.join(f'{v:.0f}' for v in values)}"]
    if len(measured) < len(outcomes):
        notes.append(f"{len(outcomes) - len(measured)} rounds failed")
    middle = measured[(len(measured) - 1) // 2]
    return dataclasses.replace(middle, samples_per_s=statistics.median(values),
                               note="; ".join(filter(None, [middle.note, *notes])))


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs, in order; 1 worker (plain PyTorch and mltuner) always, as
    the baseline of the scaling figures."""
    common = dict(model=args.model, device=args.device, batch=args.batch, steps=args.steps, warmup=args.warmup,
                  trace=str(Path(args.trace).resolve()) if args.trace else "", rule=args.rule,
                  hops=str(Path(args.hops).resolve()) if args.hops else "", precision=args.precision)
    runs = [Run("plain", 1, 0, **common), Run("mltuner", 1, 0, **common, overlap=args.overlap)]
    for n in sorted(set(args.workers) - {1}):
        runs.append(Run("ddp", n, 0, **common))
        runs += [Run("mltuner", n, s, **common, overlap=args.overlap) for s in args.slacks]
    return runs


def skip_reason(run: Run, gpus: int) -> str:
    if run.device == "cuda" and run.workers > gpus:
        return f"needs {run.workers} GPUs; this machine has {gpus}"
    return ""


Key = tuple[System, int, int]  # (system, workers, slack)


def key(run: Run) -> Key:
    return run.system, run.workers, run.slack


def baseline_key(run: Run) -> Key:
    """What a run's row is compared with: mltuner N >= 2 with DDP N, the rest with plain PyTorch."""
    return ("ddp", run.workers, 0) if run.system == "mltuner" and run.workers > 1 else ("plain", 1, 0)


def goal(run: Run) -> Optional[float]:
    """The issues' goal for a run's ratio to its baseline: on GPUs only."""
    if run.device != "cuda" or run.system != "mltuner":
        return None
    if run.workers == 1:
        return 0.95
    return 1.0 if run.slack >= 1 else None  # "at least equal to DDP at slack >= 1"


def scaling_goal(workers: int, device: str) -> Optional[float]:
    # Meaningful only with a GPU per worker; on the CPU the workers share the cores.
    return 1.9 if device == "cuda" and workers == 2 else None


@dataclasses.dataclass
class Scaling:
    """mltuner on N workers at its best slack against mltuner on 1 worker."""

    workers: int
    value: Optional[float]
    baseline_value: Optional[float]
    goal: Optional[float]
    note: str


def scalings(args: argparse.Namespace, outcomes: dict[Key, Outcome]) -> list[Scaling]:
    result = []
    for n in sorted(set(args.workers) - {1}):
        runs = [outcomes[("mltuner", n, s)] for s in args.slacks]
        measured = [(o.samples_per_s, o.run.slack) for o in runs if o.samples_per_s is not None]
        best, slack = max(measured) if measured else (None, None)
        skipped = next((o.skipped for o in runs if o.skipped), "")
        notes = [f"best slack {slack}" if slack is not None else f"skipped: {skipped}" if skipped
                 else "every mltuner run failed"]
        if args.device != "cuda" and n > (os.cpu_count() or 1):
            notes.append(f"{n} one-thread processes share {os.cpu_count()} cores")
        result.append(Scaling(n, best, outcomes[("mltuner", 1, 0)].samples_per_s, scaling_goal(n, args.device),
                              "; ".join(notes)))
    return result


def why_missing(outcome: Outcome) -> str:
    """Why ``outcome`` has no value, naming its run; empty when it has one."""
    if outcome.skipped or outcome.failed:
        return f"{outcome.run.label} {'skipped' if outcome.skipped else 'failed'}: {outcome.skipped or outcome.failed}"
    return ""


def figures(args: argparse.Namespace, outcomes: dict[Key, Outcome], scaling: list[Scaling]) -> list[Figure]:
    prefix = f"{MODEL_NAMES[args.model]}, batch {args.batch}, {args.device}"
    ddp_name = f"DDP ({backend(args.device)})"
    plain = outcomes[("plain", 1, 0)]

    def compare(name: str, outcome: Outcome, base: Outcome, baseline: str, means: str,
                goal_: Optional[float], note: str = "") -> Figure:
        note = "; ".join(filter(None, [note, why_missing(outcome), why_missing(base)]))
        return Figure("throughput", f"{prefix}: {name}", outcome.samples_per_s, "samples/s", baseline,
                      base.samples_per_s, ratio(outcome.samples_per_s, base.samples_per_s), means, goal=goal_,
                      note=note)

    single = outcomes[("mltuner", 1, 0)]
    result = [compare("1 worker vs plain PyTorch", single, plain, "plain PyTorch", "mltuner / plain samples/s",
                      goal(single.run))]
    for s in scaling:
        ddp = outcomes[("ddp", s.workers, 0)]
        for slack in args.slacks:
            mine = outcomes[("mltuner", s.workers, slack)]
            result.append(compare(f"{s.workers} workers, slack {slack} vs {ddp_name}", mine, ddp,
                                  f"{ddp_name}, {s.workers} workers", "mltuner / DDP samples/s", goal(mine.run)))
        result.append(Figure("throughput", f"{prefix}: {s.workers} workers vs 1 worker (scaling)", s.value,
                             "samples/s", "mltuner, 1 worker", s.baseline_value, ratio(s.value, s.baseline_value),
                             "best-slack mltuner N workers / mltuner 1 worker samples/s", goal=s.goal, note=s.note))
        result.append(compare(f"{ddp_name} {s.workers} vs plain", ddp, plain, "plain PyTorch",
                              "DDP / plain samples/s", None, "DDP's own scaling, for reading"))
    return result


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else cpu_name()


def table(args: argparse.Namespace, outcomes: dict[Key, Outcome], scaling: list[Scaling], params: int,
          total_s: float) -> str:
    model = MODEL_NAMES[args.model]
    lines = [
        f"# Training throughput: mltuner vs DDP ({backend(args.device)}) and plain PyTorch, {model}, {args.device}",
        "",
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}; device {device_name(args.device)}; {os.cpu_count()} cores; "
        f"torch {torch.__version__}; {model} ({params:,} parameters); rule {args.rule}; batch {args.batch} per worker; "
        f"{args.steps} timed steps after {args.warmup}; precision {args.precision}; total {total_s:.0f} s",
        "",
        "Samples/s of all workers together (higher is better); loss: rank 0's at the last step.",
        "",
        "| configuration | samples/s | ratio | goal | loss | note |",
        "|:--|--:|--:|:-:|--:|:--|",
    ]

    def goal_cell(value: Optional[float]) -> str:
        return "" if value is None else f">= {value:.2f}"

    for o in outcomes.values():
        run = o.run
        if o.samples_per_s is None or o.loss is None:
            lines.append(f"| {run.label} | {'skipped' if o.skipped else 'failed'} | | {goal_cell(goal(run))} | | "
                         f"{o.skipped or o.failed} |")
            continue
        base = outcomes[baseline_key(run)]
        share = ratio(o.samples_per_s, base.samples_per_s)
        cell = "1.00" if run.system == "plain" else "-" if share is None else f"{share:.2f} of {base.run.label}"
        lines.append(f"| {run.label} | {o.samples_per_s:.0f} | {cell} | {goal_cell(goal(run))} | {o.loss:.3f} "
                     f"| {o.note} |")
    for s in scaling:
        share = ratio(s.value, s.baseline_value)
        value = "-" if s.value is None else f"{s.value:.0f}"
        cell = "-" if share is None else f"{share:.2f} of mltuner, 1 worker"
        lines.append(f"| scaling: mltuner, {s.workers} workers | {value} | {cell} | {goal_cell(s.goal)} | | "
                     f"{s.note} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    def numbers(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when torch and the engine see a GPU, else cpu")
    parser.add_argument("--model", choices=list(MODEL_NAMES), default=None,
                        help="default: cnn on the CPU, resnet18 on a GPU")
    parser.add_argument("--rule", choices=RULES, default="momentum",
                        help="the update rule on both sides: damped momentum (SGD), or Adam")
    parser.add_argument("--workers", type=numbers, default=[1, 2],
                        help="numbers of workers, comma-separated (1 is always run: the scaling baseline)")
    parser.add_argument("--slacks", type=numbers, default=[0, 1], help="mltuner's slacks for N >= 2 workers")
    parser.add_argument("--batch", type=int, default=None, help="per worker (default by model: 128; transformer 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default by model; fewer with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--overlap", choices=["auto", "step", "backward"], default="auto",
                        help="when mltuner's updates leave: wrap()'s rule, at step(), or from the backward pass")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every run, alternated; each figure is the median (for shared, noisy hosts)")
    parser.add_argument("--quick", action="store_true", help="fewer steps: a smoke run")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per launched job (default 300; quick 120)")
    parser.add_argument("--trace", default="", metavar="DIR",
                        help=f"after the timed steps, profile {TRACE_STEPS} more per rank of plain PyTorch and mltuner "
                        "with torch.profiler into DIR")
    parser.add_argument("--hops", default="", metavar="DIR",
                        help="log every message's hops in mltuner's runs (MLTUNER_HOP_LOG) into DIR/<run>, and note "
                        "each rank's send-thread release waits and the messages' way to a peer "
                        "(benchmarks/hop_timeline.py DIR/<run> prints all of it)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: every side's forward under torch.autocast(dtype=torch.bfloat16)")
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a launched worker's run, as JSON
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where its rank 0 writes the result
    args = parser.parse_args(argv)
    if args.worker:
        return args
    usable_gpu = mlt.cuda_built() and mlt.cuda_device_count() > 0 and torch.cuda.is_available()
    args.device = args.device or ("cuda" if usable_gpu else "cpu")
    if args.device == "cuda" and not usable_gpu:
        parser.error("--device cuda: torch and the engine (built with CUDA) must both see a GPU")
    args.model = args.model or ("resnet18" if args.device == "cuda" else "cnn")
    steps, warmup = (QUICK_STEPS if args.quick else STEPS)[args.model]
    args.batch = BATCH[args.model] if args.batch is None else args.batch
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    args.timeout = args.timeout or (120.0 if args.quick else 300.0)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.repeat < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1 and --repeat >= 1")
    if not args.workers or min(args.workers) < 1 or not args.slacks or min(args.slacks) < 0:
        parser.error("need --workers >= 1 and --slacks >= 0, at least one of each")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.result)
    started = time.perf_counter()
    gpus = min(torch.cuda.device_count(), mlt.cuda_device_count()) if args.device == "cuda" else 0
    params = parameter_count(build_model(args.model))
    rounds: dict[Key, list[Outcome]] = {}
    for _ in range(args.repeat):  # whole rounds, so that drift of a shared host touches every run alike
        for run in plan(args):
            reason = skip_reason(run, gpus)
            outcome = Outcome(run, skipped=reason) if reason else measure(run, params, args.timeout)
            rounds.setdefault(key(run), []).append(outcome)
    outcomes = {k: median_outcome(v) for k, v in rounds.items()}
    scaling = scalings(args, outcomes)
    text = table(args, outcomes, scaling, params, time.perf_counter() - started)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    write_figures(args.figures, figures(args, outcomes, scaling))
    return 0 if any(o.samples_per_s is not None for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The whole training step through the GPU data path, as a ratio to plain
PyTorch on the same model, data and GPU in the same run (issue 14).

    python benchmarks/gpu_path_bench.py [--steps 50] [--warmup 15] [--only resnet|resnet50|transformer|gpt]
                                        [--precision fp32,bf16,fp16] [--channels-last] [--figures PATH]

Models, each trained by one worker (an in-process cluster, its shard on the
same GPU) and by plain PyTorch with the equivalent torch.optim optimizer:

- torchvision ``resnet18(num_classes=10)`` (or the CIFAR ResNet-18 of
  torch_bench.py where torchvision is missing) on 3x32x32 inputs, batch 128,
  256 and 512, the damped momentum rule (= ``SGD(momentum=m, dampening=m)``),
  at slack 0 and 1;
- 12 ``nn.TransformerEncoderLayer`` (width 768, 12 heads, sequence 256,
  batch 16), Adam on the servers (= ``torch.optim.Adam``), slack 0;
- a language model of GPT-2 small's shape (``--only gpt``): token and
  position embeddings, 12 causal pre-norm ``nn.TransformerEncoderLayer``
  (width 768, 12 heads, GELU), a final ``LayerNorm`` and an output
  projection tied to the token embedding (vocabulary 50,304, 124 M
  parameters), next-token cross-entropy on random tokens, sequence 256,
  batch 16, Adam, slack 0;
- torchvision ``resnet50(num_classes=1000)`` on 3x224x224 inputs, batch 64
  and 128, damped momentum, slack 0 (``--only resnet50``: an ImageNet
  step, where the GPU's compute rather than the host's launches bounds it).

``--precision`` runs each case in float32 and/or under ``torch.autocast``:
``bf16`` (no scaler) or ``fp16`` with a ``torch.amp.GradScaler`` (passed to
``wrap(grad_scaler=...)``; ``scaler.step(model.optimizer)`` ends the clock),
both sides alike; ``--channels-last`` puts the convolutional models and
their inputs in ``torch.channels_last`` before either side sees them.

Per configuration: samples/s of both, their ratio (goal >= 0.90), the GPU
stall (the training thread's time waiting for an engine buffer / the clock's
time; GeePS reports < 8%), the training thread's CPU time per clock of both
(plain PyTorch at these sizes is bound by it: kernel launches) and the engine
threads' CPU time per clock (the threads named mlt-*: allocator, reclaimer,
shard, installer; autograd's backward thread is not among them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import tempfile
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from figures import Figure, spread, write_figures


def resnet18() -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    except ImportError:
        from torch_bench import resnet18 as cifar_resnet18

        return cifar_resnet18()


def transformer(layers: int = 12, width: int = 768, heads: int = 12) -> nn.Module:
    """``layers`` nn.TransformerEncoderLayers of width ``width`` (feed-forward 4x), no dropout."""
    return nn.Sequential(*[nn.TransformerEncoderLayer(d_model=width, nhead=heads, dim_feedforward=4 * width,
                                                      dropout=0.0, batch_first=True) for _ in range(layers)])


class TiedLM(nn.Module):
    """GPT-2 small's shape from torch's own modules; the output projection
    reuses the token embedding's weight."""

    def __init__(self, vocab: int = 50304, width: int = 768, layers: int = 12, heads: int = 12,
                 sequence: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(sequence, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(sequence), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        h = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        for block in self.blocks:
            h = block(h, src_mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(h))


class Phases:
    """Host time of each part of a step (forward with the loss, backward,
    optimizer step or clock): where a launch-bound step spends its time."""

    def __init__(self) -> None:
        self.totals = [0.0, 0.0, 0.0]
        self.steps = 0

    def add(self, forward: float, backward: float, step: float) -> None:
        for i, value in enumerate((forward, backward, step)):
            self.totals[i] += value
        self.steps += 1

    def text(self) -> str:
        f, b, s = (1e3 * t / max(self.steps, 1) for t in self.totals)
        return f"forward {f:.2f} ms, backward {b:.2f} ms, step {s:.2f} ms"


PHASES = {"plain": Phases(), "mltuner": Phases()}


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Case:
    def __init__(self, name: str, make: Callable[[], nn.Module], x: torch.Tensor,
                 loss: Callable[[torch.Tensor], torch.Tensor], rule: mlt.UpdateRule,
                 optimizer: Callable[[nn.Module], torch.optim.Optimizer], slack: int,
                 precision: str = "fp32", channels_last: bool = False) -> None:
        self.name, self.make, self.x, self.loss = name, make, x, loss
        self.rule, self.optimizer, self.slack = rule, optimizer, slack
        self.precision, self.channels_last = precision, channels_last
        self.batch = x.shape[0]

    def model(self) -> nn.Module:
        model = self.make().cuda()
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = AUTOCAST[self.precision]
        return contextlib.nullcontext() if dtype is None else torch.autocast("cuda", dtype=dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler("cuda") if self.precision == "fp16" else None

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None) -> tuple[float, float, float]:
        """One training step: the forward under the case's autocast, the
        backward, the optimizer's step (through the scaler where there is
        one); the host seconds of each part."""
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.loss(model(self.x))
        t1 = time.perf_counter()
        if scaler is None:
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            t2 = time.perf_counter()
            scaler.step(optimizer)
            scaler.update()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def with_precision(self, precision: str, channels_last: bool) -> Case:
        channels_last = channels_last and self.x.dim() == 4
        x = self.x.contiguous(memory_format=torch.channels_last) if channels_last else self.x
        suffix = "" if precision == "fp32" else f" {precision}"
        suffix += " channels_last" if channels_last else ""
        return Case(self.name + suffix, self.make, x, self.loss, self.rule, self.optimizer, self.slack,
                    precision, channels_last)


def plain_run(case: Case, args: argparse.Namespace) -> tuple[float, float]:
    """(samples/s, the training thread's CPU seconds per step)."""
    torch.manual_seed(0)
    model = case.model()
    optimizer = case.optimizer(model)
    scaler = case.scaler()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start, main_start = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        phases = case.step(model, optimizer, scaler)
        if step >= args.warmup:
            PHASES["plain"].add(*phases)
    torch.cuda.synchronize()
    return case.batch * args.steps / (time.perf_counter() - start), (time.thread_time() - main_start) / args.steps


def mltuner_run(case: Case, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(samples/s, stall fraction, the training thread's and the engine
    threads' CPU seconds per clock)."""
    torch.manual_seed(0)
    model = case.model()
    scaler = case.scaler()
    config = mlt.Config(update_rule=case.rule, device="cuda", wait_timeout_s=120)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        with case.autocast():  # the recording pass saves what the clocks save
            ps = mtorch.wrap(model, worker, example_input=case.x, slack=case.slack,
                             example_loss=lambda out: case.loss(out), grad_scaler=scaler)
        profiler = cProfile.Profile() if args.profile else None
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                torch.cuda.synchronize()
                before = worker.stats
                cpu_start, main_start = engine_threads_cpu(), time.thread_time()
                start = time.perf_counter()
                if profiler:
                    profiler.enable()
            phases = case.step(ps, ps.optimizer, scaler)  # its step() ends the clock
            if step >= args.warmup:
                PHASES["mltuner"].add(*phases)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        main_cpu = time.thread_time() - main_start
        engine_cpu = engine_threads_cpu() - cpu_start
        stats = worker.stats
        worker.sync()
    stall = (stats["stall_seconds"] - before["stall_seconds"]) / elapsed
    return case.batch * args.steps / elapsed, stall, main_cpu / args.steps, engine_cpu / args.steps


def engine_threads_cpu() -> float:
    """CPU seconds so far of this process's engine threads (named mlt-*:
    allocator, reclaimer, shard, installer), from /proc; 0 elsewhere."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*"):
        try:
            if not (task / "comm").read_text().startswith("mlt-"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


@contextlib.contextmanager
def gpu_profile(enabled: bool, title: str, steps: int) -> Iterator[None]:
    """With `enabled`, prints the run's GPU kernels and copies by total time
    (warm-up included), every stream and thread of the process counted."""
    if not enabled:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        yield
    summarize_timeline(profiler, title, steps)
    events = [e for e in profiler.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"## GPU time of {title}: {total / 1e3:.1f} ms in all")
    for e in events[:18]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:90]}")


def summarize_timeline(profiler: Any, title: str, steps: int) -> None:
    """From the run's trace: each stream's GPU busy time, and the CUDA
    runtime calls' time per thread (a contended driver shows as slow calls)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    busy: dict[Any, float] = collections.defaultdict(float)
    calls: dict[tuple[Any, str], list[float]] = collections.defaultdict(list)
    start, end = float("inf"), 0.0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        category, duration = event.get("cat", ""), float(event.get("dur", 0))
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            busy[event.get("tid")] += duration
            start, end = min(start, event["ts"]), max(end, event["ts"] + duration)
        elif category == "cuda_runtime":
            calls[(event.get("tid"), event.get("name", ""))].append(duration)
    print(f"## timeline of {title}: GPU span {(end - start) / 1e3:.1f} ms")
    for stream, total in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"  stream {stream}: busy {total / 1e3:.1f} ms ({total / max(end - start, 1):.0%} of the span)")
    per_thread: dict[Any, list[float]] = collections.defaultdict(list)
    for (thread, _), durations in calls.items():
        per_thread[thread].extend(durations)
    for thread, durations in sorted(per_thread.items(), key=lambda kv: -sum(kv[1])):
        print(f"  thread {thread}: {len(durations) / steps:.0f} CUDA runtime calls per step, "
              f"{sum(durations) / 1e3 / steps:.2f} ms per step")
    for (thread, name), durations in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:24]:
        print(f"  thread {thread} {name}: {len(durations) / steps:.1f} calls/step, mean {sum(durations) / len(durations):.1f} us, "
              f"total {sum(durations) / 1e3:.1f} ms")


def cases(only: str | None) -> list[Case]:
    out: list[Case] = []
    generator = torch.Generator().manual_seed(0)
    m = 0.9
    if only in (None, "resnet"):
        for batch in (128, 256, 512):
            x = torch.randn(batch, 3, 32, 32, generator=generator).cuda()
            y = torch.randint(0, 10, (batch,), generator=generator).cuda()
            for slack in (0, 1):
                out.append(Case(
                    f"resnet18 b{batch} s{slack}", resnet18, x,
                    lambda o, y=y: nn.functional.cross_entropy(o, y),
                    mlt.UpdateRule("momentum", learning_rate=0.05, momentum=m),
                    lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=m, dampening=m),
                    slack))
    if only in (None, "transformer"):
        x = torch.randn(16, 256, 768, generator=generator).cuda()
        out.append(Case(
            "transformer12 b16", transformer, x, lambda o: o.float().pow(2).mean(),
            mlt.UpdateRule("adam", learning_rate=1e-4),
            lambda model: torch.optim.Adam(model.parameters(), lr=1e-4), 0))
    if only == "resnet50":  # not by default: its own --only run
        import torchvision

        for batch in (64, 128):
            x = torch.randn(batch, 3, 224, 224, generator=generator).cuda()
            y = torch.randint(0, 1000, (batch,), generator=generator).cuda()
            out.append(Case(
                f"resnet50 224px b{batch}", torchvision.models.resnet50, x,
                lambda o, y=y: nn.functional.cross_entropy(o, y),
                mlt.UpdateRule("momentum", learning_rate=0.05, momentum=m),
                lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=m, dampening=m), 0))
    if only == "gpt":  # not by default: its own --only run
        ids = torch.randint(0, 50304, (16, 257), generator=generator).cuda()
        out.append(Case(
            "gpt2-small tied b16", TiedLM, ids[:, :-1],
            lambda o, t=ids[:, 1:]: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()),
            mlt.UpdateRule("adam", learning_rate=1e-4),
            lambda model: torch.optim.Adam(model.parameters(), lr=1e-4), 0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--phases", action="store_true", help="print each side's host time per step part")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; medians reported")
    parser.add_argument("--only", choices=("resnet", "resnet50", "transformer", "gpt"),
                        help="one family (default: resnet and transformer; resnet50 and gpt only when named)")
    parser.add_argument("--precision", default="fp32",
                        help="comma-separated: fp32, bf16 (autocast), fp16 (autocast and a GradScaler)")
    parser.add_argument("--channels-last", action="store_true",
                        help="convolutional models and their inputs in torch.channels_last")
    parser.add_argument("--match", default="", help="only the cases whose name contains this")
    parser.add_argument("--figures", type=Path)
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--profile", action="store_true", help="cProfile the training thread's timed clocks")
    parser.add_argument("--gpu-profile", action="store_true",
                        help="torch.profiler over both runs' timed steps: GPU time per kernel, both runs")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not mlt.cuda_built():
        raise SystemExit("gpu_path_bench needs a CUDA GPU and mltuner built with CUDA")
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    emit(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} timed steps")
    emit("| case | plain samples/s | mltuner samples/s | ratio (min-max over rounds) | stall | training thread CPU ms/clock, "
         "plain / mltuner | engine threads CPU ms/clock |")
    emit("|---|---|---|---|---|---|---|")
    figures = []
    precisions = args.precision.split(",")
    unknown = set(precisions) - set(AUTOCAST)
    if unknown:
        parser.error(f"--precision: unknown {sorted(unknown)}; choose from {sorted(AUTOCAST)}")
    chosen = [c.with_precision(p, args.channels_last) for c in cases(args.only) for p in precisions]
    for case in (c for c in chosen if args.match in c.name):
        # Rounds alternate the two sides, so that a slow spell of the host
        # (other tenants, clocks) falls on both; the medians are reported.
        runs: list[tuple[float, float, float, float, float, float]] = []
        for phases in PHASES.values():
            phases.__init__()  # type: ignore[misc]
        for _ in range(args.rounds):
            with gpu_profile(args.gpu_profile, f"plain {case.name}", args.warmup + args.steps):
                plain, plain_cpu = plain_run(case, args)
            with gpu_profile(args.gpu_profile, f"mltuner {case.name}", args.warmup + args.steps):
                ours, stall, main_cpu, engine_cpu = mltuner_run(case, args)
            runs.append((plain, ours, stall, plain_cpu, main_cpu, engine_cpu))
        plain, ours, stall, plain_cpu, main_cpu, engine_cpu = (statistics.median(column) for column in zip(*runs))
        ratios = [r[1] / r[0] for r in runs]
        ratio = statistics.median(ratios)
        span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(runs) > 1 else ""
        emit(f"| {case.name} | {plain:,.0f} | {ours:,.0f} | {ratio:.2f}{span} | {stall:.1%} | "
             f"{plain_cpu * 1e3:.2f} / {main_cpu * 1e3:.2f} | {engine_cpu * 1e3:.2f} |")
        if args.phases:
            print(f"  host time per step, plain: {PHASES['plain'].text()}; mltuner: {PHASES['mltuner'].text()}")
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
        figures.append(Figure("gpu-path", f"{case.name}: 1 worker vs plain PyTorch", ours, "samples/s",
                              "plain PyTorch", plain, ratio, "mltuner / plain samples/s", goal=0.90,
                              ratio_range=spread(ratios),
                              note=f"stall {stall:.1%} of the clock, engine CPU {engine_cpu * 1e3:.2f} ms/clock"))
    write_figures(str(args.figures) if args.figures else None, figures)


if __name__ == "__main__":
    main()

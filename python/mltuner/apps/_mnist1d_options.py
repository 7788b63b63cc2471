"""The options of ``python -m mltuner.apps.mnist1d``, in one place.

The program parses them in every worker; ``mltuner tune`` and ``mltuner
demo`` add the same options to their own parsers and check them in the
launcher's process before a worker starts, so a bad value is one error line
there instead of one per worker. Only argparse is imported here: the
launcher builds these parsers for every ``mltuner`` command.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["SEARCHABLE", "MLP_HIDDEN", "DEFAULT_SEED", "DefaultsHelpFormatter", "add_program_options",
           "add_output_options", "build_parser"]

MLP_HIDDEN = {"logreg": (), "mlp": (100, 100)}  # hidden layer sizes of the numpy models
SEARCHABLE = ("lr", "momentum", "batch_size", "staleness")
# Seeds the data shuffle, the initial weights and every searcher (search i
# uses seed + i): two runs with one seed propose the same first trials.
DEFAULT_SEED = 0


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help with each option's default, except where it is None or off:
    the help says what None means there."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and "%(default)" not in text and not hidden:
            default = action.default
            shown = ",".join(map(str, default)) if isinstance(default, list) else "%(default)s"
            text += f" (default: {shown})"
        return text


def _number(kind: Callable[[str], float], test: Callable[[float], bool], wanted: str
            ) -> Callable[[str], float]:
    """An argparse type: ``kind`` of the text, refused unless ``test`` holds."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    parse.__name__ = wanted  # argparse names the type by it in some messages
    return parse


def _int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= ``minimum``."""
    wanted = f"comma-separated integers >= {minimum}"

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if any(value < minimum for value in values):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return values

    return parse


def _samples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a multiple of 10 >= 100, got {text!r}") from None
    if value < 100 or value % 10:
        # 10 classes of equal size; below 100 the validation split is a handful.
        raise argparse.ArgumentTypeError(f"expected a multiple of 10 >= 100, got {text!r}")
    return value


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_positive = _number(float, lambda v: v > 0, "a number > 0")
_non_negative = _number(float, lambda v: v >= 0, "a number >= 0")
_at_least_one = _number(float, lambda v: v >= 1, "a number >= 1")
_fraction = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_probability = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
_seed = _number(int, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")
_rank = _number(int, lambda v: v >= -1, "a rank, or -1 for none")


def add_program_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds every option of the program except its output files (each with
    its default in the help)."""
    parser.add_argument("--model", choices=[*MLP_HIDDEN, "cnn"], default="mlp",
                        help="mlp: the MNIST-1D authors' 100-100 MLP (numpy); logreg: logistic regression; "
                             "cnn: their CNN (PyTorch)")
    parser.add_argument("--mode", choices=["tune", "fixed", "optuna", "hyperband"], default="tune",
                        help="tune: MLtuner; fixed: train with --lr/--momentum/--batch-size; optuna: Optuna TPE "
                             "with a whole training run per trial; hyperband: Optuna's HyperbandPruner over epochs")
    parser.add_argument("--search", default="lr,momentum,batch_size",
                        help=f"tunables to search, comma-separated, from {','.join(SEARCHABLE)}; empty: none")
    parser.add_argument("--lr", type=_positive, default=0.01,
                        help="learning rate (fixed, or the starting default)")
    parser.add_argument("--lr-min", type=_positive, default=1e-4, help="lower end of the searched learning rates")
    parser.add_argument("--lr-max", type=_positive, default=1.0, help="upper end of the searched learning rates")
    parser.add_argument("--momentum", type=_number(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
                        default=0.9, help="momentum (fixed, or the starting default)")
    parser.add_argument("--batch-size", type=_positive_int, default=32, help="batch size per worker (fixed)")
    parser.add_argument("--batch-sizes", type=_int_list(1), default=[8, 16, 32, 64],
                        help="batch sizes per worker to search, comma-separated")
    parser.add_argument("--staleness", type=_int_list(0), default=[0, 1, 3],
                        help="staleness bounds to search, comma-separated (0 is BSP); the first is the "
                             "training staleness when staleness is not searched")
    parser.add_argument("--sampler", default="tpe", help="searcher: tpe, random, grid, gp or cmaes")
    parser.add_argument("--retune", choices=["full", "marginal", "off"], default="full",
                        help="what a plateau of the validation accuracy starts")
    parser.add_argument("--trials", type=_positive_int, default=30,
                        help="trial cap of the initial search; trials of the Optuna baselines")
    parser.add_argument("--eval-clocks", type=_positive_int, default=20,
                        help="clocks of the lr = 0 evaluation branch")
    parser.add_argument("--test-clocks", type=_positive_int, default=None,
                        help="clocks of each validation, which covers the validation set once (default: the "
                             "fewest of at most 1024 samples a worker; at least one sample a worker a clock)")
    parser.add_argument("--trial-time", type=_positive, default=None,
                        help="initial trial time in seconds (default: measured)")
    parser.add_argument("--max-epochs", type=_positive_int, default=30, help="stop after this many epochs")
    parser.add_argument("--samples", type=_samples, default=5000,
                        help="MNIST-1D samples, a multiple of 10 (80%% train, 20%% test)")
    parser.add_argument("--target-accuracy", type=_fraction, default=None,
                        help="validation accuracy whose first reach is timed; every mode stops there")
    parser.add_argument("--time-budget", type=_positive, default=None,
                        help="the job's budget in seconds of clocks: every mode stops at the first validation "
                             "past it, and the tuner's searches each get --search-share of it (default: "
                             "--max-epochs epochs)")
    parser.add_argument("--search-share", type=_non_negative, default=0.1,
                        help="share of the job's budget each search may spend; 0 leaves searches bounded only "
                             "by --trials")
    parser.add_argument("--max-search-share", type=_fraction, default=0.2,
                        help="the most the searches may spend together when the floor (finding the trial time, "
                             "then successive halving over 4 trials of it) raises one above --search-share")
    parser.add_argument("--retune-every", type=_positive_int, default=None,
                        help="also re-tune after this many epochs without a search, plateau or not; without "
                             "it, only a plateau starts a re-tune")
    parser.add_argument("--retune-search", default="lr,momentum",
                        help="tunables a re-tune searches, the others kept (comma-separated, or 'all')")
    parser.add_argument("--no-batch-check", action="store_true",
                        help="no batch check (the training setting against the next larger batch, lr scaled "
                             "per --batch-check-lr, after a stretch's first validation)")
    parser.add_argument("--batch-check-lr", choices=["sqrt", "linear", "none"], default="sqrt",
                        help="how the batch check scales the learning rate for the larger batch: by the "
                             "square root of the batch ratio (default), by the ratio, or not at all")
    parser.add_argument("--no-rollback", action="store_true",
                        help="no frozen copy of the best model and no rollback when training collapses")
    parser.add_argument("--balance-batches", action="store_true",
                        help="size each worker's part of a clock's samples by its measured speed (the "
                             "clock's samples and the summed update stay those of equal parts)")
    parser.add_argument("--steal-batches", action="store_true",
                        help="at staleness >= 1, a worker a whole clock behind the others loses its part of "
                             "the clock to them, so nobody waits for it; every sample is still computed once")
    parser.add_argument("--steal-after", type=_non_negative, default=2.0,
                        help="with --steal-batches: how long a worker a clock behind may be silent before its "
                             "parts move, in typical clocks of the run")
    parser.add_argument("--slow-rank", type=_rank, default=-1, help="the rank to slow down (benchmarks)")
    parser.add_argument("--slow-factor", type=_at_least_one, default=1.0,
                        help="that rank computes this many times as slowly: after a training clock it sleeps "
                             "(factor - 1) x its model's forward and backward time for the clock's samples")
    parser.add_argument("--slow-ms", type=_non_negative, default=0.0, help="its sleep after a clock, in ms")
    parser.add_argument("--slow-probability", type=_probability, default=1.0, help="chance of that sleep per clock")
    parser.add_argument("--seed", type=_seed, default=DEFAULT_SEED,
                        help="seeds the data shuffle, the initial weights and the searchers: the same seed "
                             "proposes the same first trials (later ones depend on measured times)")
    parser.add_argument("--storage", default=None, help="an Optuna storage URL for every trial")


def add_output_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds the program's outputs, which ``mltuner tune`` sets itself."""
    parser.add_argument("--live", action="store_true", help="show the tuner's progress live (rank 0)")
    parser.add_argument("--log", default=None, help="decision log (JSON lines), written by rank 0")
    parser.add_argument("--result", default=None, help="result JSON, written by rank 0")


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The program's parser: every option, with its default in the help."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=DefaultsHelpFormatter)
    add_program_options(parser)
    add_output_options(parser)
    return parser

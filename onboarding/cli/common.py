"""What the commands share: the error console, the MODEL and --families options, progress lines."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from rich.console import Console

from onboarding.cli.logs import verbosity_options
from onboarding.errors import InputError
from onboarding.load.examples import DEFAULT_EXAMPLE, model_forms
from onboarding.load.overrides import parse_assignments, positive_int
from onboarding.load.spec import ModelSpec

# errors print as written: no markup in messages, no :name: emoji (`hf:llama:` is text)
err = Console(stderr=True, emoji=False)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option said in one line (the full usage of a command with many
    options would bury it), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def model_argument(p: argparse.ArgumentParser, without: str | None = None) -> None:
    """The MODEL positional of every command that takes one, its help `model_forms()` (what
    `load_model` accepts), so that no command's help lists a form the resolver refuses.
    ``without``: what the command does when MODEL is left out (None: runs the default
    example)."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"{model_forms()}; {without or f'default: {DEFAULT_EXAMPLE}'}")


def model_options(p: argparse.ArgumentParser, without: str | None = None) -> None:
    """MODEL (`model_argument`) and how to build its proxy."""
    model_argument(p, without)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value); repeatable")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow running the model's own modeling_*.py (read it first)")
    p.add_argument("--impl", choices=("auto", "native", "remote"), default="auto",
                   help="remote code whose model_type the installed transformers also "
                        "implements: native uses transformers' classes (when names and shapes "
                        "agree), remote (auto) the model's own code")
    p.add_argument("--part", choices=("language", "vision"), default="language",
                   help="a multimodal model: its language model, or its vision tower alone "
                        "(synthetic pixel inputs)")
    p.add_argument("--proxy", choices=("tiny", "small"), default="tiny",
                   help="proxy size for real execution: tiny (CPU) or small (one GPU)")
    p.add_argument("--seq", type=positive_int, default=64,
                   help="proxy sequence length (default 64)")
    p.add_argument("--batch", type=positive_int, default=1, help="proxy batch size (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the proxy's weights and inputs (default 0)")


FAMILIES_HELP = ("a folder of kernel families (or one family folder) to use beside the built-in "
                 "ones; repeatable. Also: the ONBOARD_FAMILIES path list and installed packages' "
                 "onboard.families entry points")


def gpu_sharing_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """How tuning shares a GPU host (`TuneConfig.gpu_gate`, `compile_ahead`, `join_studies`,
    `timing`): the same flags for `onboard tune` and, as `--tune-...`, for `onboard run`."""
    from onboarding.tune.search import GPU_GATES, TIMINGS

    p.add_argument(f"--{prefix}gpu-gate", choices=GPU_GATES, default="strict",
                   help="how tuning's checks and timings share the GPU: strict (a timing has it "
                        "alone; checks wait) or overlap (timings alone among themselves, checks "
                        "beside them; the finalists are re-timed after every search); default "
                        "strict")
    p.add_argument(f"--{prefix}no-compile-ahead", action="store_true",
                   help="on a GPU host, let each tuning check JIT-compile its config's kernels "
                        "while it holds the GPU, instead of building them first outside it")
    p.add_argument(f"--{prefix}no-join-studies", action="store_true",
                   help="with studies at once (a GPU host), keep each study to its own worker "
                        "instead of letting a study thread with none left to start join the "
                        "searches still running")
    p.add_argument(f"--{prefix}timing", choices=TIMINGS, default="graph",
                   help="how a trial is timed on a GPU: graph (the step replayed as a CUDA graph: "
                        "its kernels only; a step that cannot be captured falls back to events; "
                        "default) or events (CUDA events around launched steps: the host's "
                        "Python and launch time included, which the other studies' builds move)")


def gpu_sharing(args: argparse.Namespace, prefix: str = "") -> dict:
    """`gpu_sharing_options`' values as TuneConfig's keyword arguments."""
    a = prefix.replace("-", "_")
    return {"gpu_gate": getattr(args, f"{a}gpu_gate"),
            "compile_ahead": False if getattr(args, f"{a}no_compile_ahead") else None,
            "join_studies": not getattr(args, f"{a}no_join_studies"),
            "timing": getattr(args, f"{a}timing")}


def command_parser(sub, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand's parser. It takes `--families`, `-v` and `-q` too (`onboard map X
    --families DIR -q`); SUPPRESS keeps a value given before the command when none comes after
    it."""
    p = sub.add_parser(name, **kw)
    p.add_argument("--families", action="append", default=argparse.SUPPRESS, metavar="DIR",
                   help=FAMILIES_HELP)
    verbosity_options(p, default=argparse.SUPPRESS)
    return p


def progress(console: Console, status) -> Callable[[str], None]:
    """Progress into a rich status line; off a terminal, timed log lines on stderr (the
    ``onboarding`` logger at INFO: ``-q`` silences them)."""
    from onboarding.cli.logs import log

    def step(text: str) -> None:
        status.update(text)
        log.log(logging.DEBUG if console.is_terminal else logging.INFO, text)
    return step


# --kernels names besides the registered families: what the generate stage serves uncovered
# blocks with (the Inductor fallback's block swaps; every LLM-written family of the run, whose
# names are not known before generate), so an explicit list can keep them
SERVED_BY = ("inductor", "generated")


def selected_kernels(args: argparse.Namespace) -> list[str] | None:
    from onboarding.families import families

    if args.kernels == "all":
        return None
    if args.kernels == "none":
        return []
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = sorted(set(names) - set(families()) - set(SERVED_BY))
    if unknown:
        raise InputError(f"--kernels: unknown families {unknown}; known: "
                         f"{sorted(families())} and {', '.join(SERVED_BY)}")
    return names


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The `ModelSpec` of a command's MODEL options (`model_options`)."""
    return ModelSpec(ref=args.model, overrides=parse_assignments(args.set),
                     trust_remote_code=args.trust_remote_code, proxy=args.proxy,
                     impl=getattr(args, "impl", "auto"), part=getattr(args, "part", "language"))

"""`ditkv` command line: generate, serve, stage, quantize, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import DitkvError

# bench name -> module under ditkv.bench exposing add_arguments(parser) and run(args)
BENCHES = {
    "scheduler": "Control-plane admission + metadata encode cost",
    "attention": "Paged attention kernel vs SDPA / FlexAttention (GPU)",
    "step": "Denoise step: prefix reuse vs recompute, paged vs dense",
    "transfer": "AR -> DiT KV transfer: legacy vs native throughput, page bandwidth",
    "handoff": "AR -> DiT handoff latency at editing prefix sizes: native vs legacy (+ GPU memory)",
    "capacity": "Requests a KV budget holds at once: paged vs dense max-shape",
    "prefix": "Prefix cache on vs off: time to the first denoise step (tiny engine) and requests held (release geometry)",
    "quality": "Tiny model held-out accuracy through the engine, paged vs dense (captions; --edit: edits)",
    "loading": "Per-rank checkpoint load: sliced vs load-all-then-shard (time, peak RSS, bytes)",
    "serve": "HTTP load test of `ditkv serve`: req/s, latency percentiles, errors",
    "ar": "The single engine's AR phase: decode ms per step and tokens/s at R concurrent requests",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the text states it already (an unset flag
    that means "the model's" or "no limit" says so in words): an empty or None default is never
    printed as such, and a required flag has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required or action.default is None or action.default == "":
            return text
        return super()._get_help_string(action)


def _format_help(parser: argparse.ArgumentParser) -> None:
    """One formatter for the whole tree, whichever module built a subcommand's parser."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _format_help(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ditkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    try:
        from . import generate
        generate.add_parser(sub)
    except ImportError as e:  # data plane not importable (e.g. torch missing)
        g = sub.add_parser("generate", help="generate an image (needs torch)")
        g.set_defaults(func=lambda a, e=e: _missing(e))
    try:
        from ..train import tiny
        tiny.add_parser(sub)
    except ImportError as e:  # torch/numpy missing
        t = sub.add_parser("train-tiny", help="train the tiny model (needs torch)")
        t.set_defaults(func=lambda a, e=e: _missing(e))
    try:
        from ..train import text_head
        text_head.add_parser(sub)
    except ImportError as e:
        t = sub.add_parser("train-text-head", help="train the text head of a checkpoint (needs torch)")
        t.set_defaults(func=lambda a, e=e: _missing(e))
    try:
        from ..train import edit
        edit.add_parser(sub)
    except ImportError as e:
        t = sub.add_parser("train-tiny-edit", help="fine-tune the tiny model to edit images (needs torch)")
        t.set_defaults(func=lambda a, e=e: _missing(e))
    from . import serve  # imports only argparse/config; FastAPI loads when the server starts
    serve.add_parser(sub)
    from . import stage  # the server's modules load when it starts
    stage.add_parser(sub)
    from . import quantize  # torch loads when the command runs
    quantize.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (tables + JSON)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, help_ in BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        try:
            mod = importlib.import_module(f"ditkv.bench.{name}")
        except ImportError as e:
            bp.set_defaults(func=lambda a, e=e: _missing(e))
            continue
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
    _format_help(p)
    return p


def _missing(e):
    raise SystemExit(f"ditkv: this command is unavailable here: {e}")


def main(argv=None) -> int:
    """Run one command. Bad input ends as one `ditkv: error: ...` line on stderr and a non-zero
    exit: argparse and the commands' own checks exit through SystemExit, the library raises
    `DitkvError` (loaders convert file and parse errors into `ConfigError` where they happen), and
    an OSError is the environment (a full disk, a closed pipe), not a bug. Anything else is a bug
    and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DitkvError as e:
        _error(e)
        return 2
    except OSError as e:
        _error(e)
        return 1
    except KeyboardInterrupt:
        print("ditkv: interrupted", file=sys.stderr)
        return 130
    return 0


def _error(e: Exception) -> None:
    # one line whatever the message holds (parsers quote the offending text with newlines)
    print("ditkv: error: " + " ".join(str(e).split()), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

"""Issue 33, QA findings on the `ditkv` command line: output paths probed before any work, every
flag's help and default, the address `ditkv serve` listens on, FP8 named in the closing and startup
lines, and stage YAML paths read from the file's folder."""

from __future__ import annotations

import argparse

import pytest

from ditkv.entrypoints.cli import build_parser, main


# ---- help texts -----------------------------------------------------------------------------------
def _subcommands(parser, path=("ditkv",)):
    """(command path, parser) of every parser in the tree, the root included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def _flags():
    for path, parser in _subcommands(build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                yield " ".join(path), parser, action


def test_every_flag_has_help_that_shows_its_default():
    missing, no_default = [], []
    for cmd, parser, action in _flags():
        name = f"{cmd} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            missing.append(name)
            continue
        text = parser._get_formatter()._expand_help(action)
        if not action.required and ("default" not in text or "default: None" in text):
            no_default.append(f"{name}: {text}")
    assert not missing, f"{len(missing)} flags without help: {missing}"
    assert not no_default, "flags whose help shows no default:\n" + "\n".join(no_default)


@pytest.mark.parametrize("cmd", [["generate"], ["serve"], ["quantize"]])
def test_model_help_names_every_bundled_model(cmd, capsys):
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "'tiny', 'tiny-edit'" in out and "checkpoint folder" in out


def test_serve_help_shows_the_port_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--port PORT" in out and "(default: 8000)" in out

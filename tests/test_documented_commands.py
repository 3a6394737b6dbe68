"""Every `fedrec run` / `fedrec config` command that README.md, BENCHMARKS.md and docs/ (docs/benchmarks/ too) give
resolves: its flags exist, its preset and dataset are in the registry, and each `--set` key is a config key that takes
the value given. Nothing runs and no data is read, so a renamed key, preset or flag fails here instead of in a user's
terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedrec_flwr.cli.commands import _parser
from fedrec_flwr.config import ConfigError, load_config, parse_overrides, to_dict
from fedrec_flwr.data.sources import get_spec
from fedrec_flwr.data.types import DataError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/benchmarks/ too
COMMAND = re.compile(r"fedrec (?:run|config)\b[^`\n;&|()]*")
PLACEHOLDER = re.compile(r"^(<[^>]*>|[A-Z][A-Z_]*|\.\.\.)$")  # <gnn>, DATA, S, KEY, ...


def documented_commands() -> list[tuple[str, str]]:
    """(file:line, command) of every fedrec run/config command in the docs: in code blocks (a block's
    backslash-continued lines joined, shell comments dropped) and in inline code spans (which prose may wrap)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        blocks = list(re.finditer(r"```[^\n]*\n(.*?)```", text, re.S))
        pieces = [(b.start(1), re.sub(r"#[^\n]*", "", b.group(1))) for b in blocks]
        prose = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)
        pieces += [(m.start(1), m.group(1)) for m in re.finditer(r"`([^`]+)`", prose)]
        for start, piece in pieces:
            piece = re.sub(r"\\\n\s*", " ", piece)
            for line in (piece.split("\n") if "\n" in piece and piece.count("fedrec ") > 1
                         else [piece.replace("\n", " ")]):
                for match in COMMAND.finditer(line):
                    number = text.count("\n", 0, start) + 1
                    found.append((f"{path.relative_to(ROOT)}:{number}", match.group(0).strip().rstrip(".,:")))
    return sorted(set(found))


def _default_of(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"unknown config key {key!r}")
        node = node[part]
    return node


def check_command(command: str) -> None:
    """Raise (ConfigError, or SystemExit from the CLI's parser) unless `command` resolves. A templated part (`<...>`,
    an upper-case placeholder such as DATA or S) is checked as far as it can be: a placeholder preset or dataset
    skips the config, a placeholder value keeps its key's check with the key's own default value."""
    tokens = [t for t in shlex.split(command) if t not in ("[", "]")]
    tokens = [t.strip("[]") for t in tokens if t.strip("[]")]
    tokens = ["0" if prev == "--seed" and PLACEHOLDER.match(t) else t for prev, t in zip(["", *tokens], tokens)]
    args = _parser().parse_args([t for t in tokens[1:] if t != "..."])
    if PLACEHOLDER.match(args.preset) or (args.dataset and PLACEHOLDER.match(args.dataset)):
        return
    dataset = args.dataset or None
    if dataset and not dataset.startswith("synthetic"):
        get_spec(dataset)  # a real dataset: in the registry (its files are not read)
    overrides = parse_overrides(" ".join(s for s in args.set if s != "..."))
    defaults = to_dict(load_config(args.preset, dataset))
    resolved = []
    for item in overrides:
        key, _, value = item.partition("=")
        if PLACEHOLDER.match(value) or "<" in value:
            default = _default_of(defaults, key)
            if "<" in value or not isinstance(default, str):  # a placeholder path (KEY, DATA) stays as it is
                value = str(default).lower() if isinstance(default, bool) else str(default)
        resolved.append(f"{key}={value}")
    load_config(args.preset, dataset, resolved)


COMMANDS = documented_commands()


def test_the_docs_give_commands_to_check():
    assert len(COMMANDS) > 40 and any("BENCHMARKS.md" in where for where, _ in COMMANDS)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_resolves(where, command):
    try:
        check_command(command)
    except (ConfigError, SystemExit, ValueError, DataError) as exc:
        pytest.fail(f"{where}: `{command}` does not resolve: {exc}")


@pytest.mark.parametrize("stale", [
    "fedrec run --preset fedgnn_tuned --dataset ml-100k --data-dir DATA --set model.gnnn=gat",  # a renamed key
    "fedrec run --preset fedgnn_private --dataset ml-100k --data-dir DATA",  # a preset that does not exist
    "fedrec run --preset fedgnn_tuned --dataset ml-101k --data-dir DATA",  # a dataset outside the registry
    "fedrec run --preset fedgnn_tuned --in-proces",  # a flag that does not exist
    "fedrec run --preset fedgnn_tuned --set federation.rounds=ten",  # a value the key cannot take
])
def test_a_planted_stale_command_fails_the_check(stale):
    with pytest.raises((ConfigError, SystemExit, ValueError, DataError)):
        check_command(stale)

"""Write docs/flags.md from the real command-line parsers, so no flag table is kept by hand.

    python tools/gen_flags.py            rewrite docs/flags.md
    python tools/gen_flags.py --check    exit 1 (and say so) when docs/flags.md is stale

The parsers are the ones `tidal` itself runs: `tidal.frontend.cli.build_parser(command)` for
`core`, `serve` and `generate`. The engine flags in them come from the config dataclasses
(`tidal.engine_core.args.FLAGS`: a flag's default and type are its field's, its help the
field's docstring), so a new field shows up here with its docstring as its meaning.
`tests/test_docs.py` fails when the file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "flags.md"
COMMAND = "python tools/gen_flags.py"

_ENV_DEFAULTS = ("TIDAL_API_KEY",)
"""Environment variables some flags take their default from: unset while the parsers are
built, so the page says the same on every machine (the help text names the variable)."""


@contextlib.contextmanager
def _without_env(names):
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser `tidal COMMAND` runs (its subparser, with only its own flags loaded)."""
    from tidal.frontend.cli import build_parser

    with _without_env(_ENV_DEFAULTS):
        parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(title, visible actions) of each argument group, in --help order; -h left out."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if actions:
            out.append((group.title, actions))
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")]
        return " / ".join(f"`{n}`" for n in names) + " / `--no-…`"
    return " / ".join(f"`{n}`" for n in names)


def _value(value) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _expanded_help(action: argparse.Action, prog: str) -> str:
    if not action.help:
        return ""
    return " ".join(argparse.HelpFormatter(prog)._expand_help(action).split())


def _default(action: argparse.Action, prog: str) -> str:
    value = action.default
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return "unset" if value is None else "on" if value else "off"
    if value is None or value == []:
        # a default decided later (an environment variable, the engine core's own) is said
        # in the help text: quote it when it is short
        said = re.search(r"\(default: ([^;)]*)", _expanded_help(action, prog))
        if said and len(said.group(1)) <= 20:
            return f"`{said.group(1)}`"
        return "see meaning" if said else "–"
    return f"`{_value(value)}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = _expanded_help(action, prog)
    # the default has its own column: drop a trailing "(default: X)" that only repeats it
    for default in (_default(action, prog).strip("`"), str(action.default)):
        if text.endswith(f" (default: {default})"):
            text = text[: -len(f" (default: {default})")]
            break
    if action.choices:
        choices = "Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        text = (text if not text or text.endswith(".") else text + ".") + " " + choices
    return _cell(text)


def _table(actions: list[argparse.Action], prog: str, python_names: bool) -> list[str]:
    if python_names:
        lines = ["| flag | Python name | default | meaning |", "| --- | --- | --- | --- |"]
    else:
        lines = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in actions:
        cells = [_flag(action)]
        if python_names:
            cells.append("`model`" if action.dest == "model_tag" else f"`{action.dest}`")
        cells += [_default(action, prog), _help(action, prog)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _signature(groups) -> list[tuple[str, list[tuple]]]:
    return [(title, [(tuple(a.option_strings), a.dest, repr(a.default), a.help)
                     for a in actions]) for title, actions in groups]


_COMMANDS = (
    ("core", "`tidal core`: the engine-core daemon",
     "tidal core [MODEL] [engine flags] [the flags below]"),
    ("serve", "`tidal serve`: the OpenAI-compatible HTTP server",
     "tidal serve [MODEL] [engine flags] [the flags below]"),
    ("generate", "`tidal generate`: one completion, printed",
     "tidal generate PROMPT [MODEL] [engine flags] [the flags below]"),
)
"""The commands documented: name, heading, usage line."""


def render() -> str:
    """The text of docs/flags.md."""
    from tidal.engine_core.args import FLAGS

    engine_titles = list(FLAGS)
    parsers = {name: command_parser(name) for name in ("core", "serve", "generate")}
    groups = {name: _groups(p) for name, p in parsers.items()}
    engine = {name: [g for g in gs if g[0] in engine_titles] for name, gs in groups.items()}
    if not (_signature(engine["core"]) == _signature(engine["serve"])
            == _signature(engine["generate"])):
        raise SystemExit("the engine flags differ between tidal core, serve and generate: "
                         "add_engine_args is no longer the one source of them")

    out = [
        "<!-- Generated by `python tools/gen_flags.py` from the parsers `tidal` runs; do not",
        "     edit by hand (tests/test_docs.py fails when this file is stale). -->",
        "",
        "# Flags",
        "",
        "Every flag of `tidal core`, `tidal serve` and `tidal generate`, as their `--help` gives",
        "them. The engine flags carry vLLM's names and defaults; they are built from the config",
        "dataclasses in `engine_core/config.py` (each flag's meaning is its field's docstring),",
        "and the same flags are taken by `LLM(model, **flags)` under their Python names.",
        "`tidal bench --help` and `tidal tune --help` list the flags of the benchmarks and the",
        "tuner.",
        "",
        "## Engine flags (`tidal core`, `tidal serve`, `tidal generate`, `LLM`)",
        "",
    ]
    for title, actions in engine["core"]:
        out += [f"### {title}", ""]
        out += _table(actions, "tidal core", python_names=True)
        out.append("")
    for name, heading, usage in _COMMANDS:
        out += [f"## {heading}", "", f"`{usage}`", ""]
        own = [a for title, actions in groups[name] if title not in engine_titles
               for a in actions]
        out += _table(own, f"tidal {name}", python_names=False)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when docs/flags.md differs from the parsers")
    ns = parser.parse_args(argv)
    text = render()
    current = OUTPUT.read_text() if OUTPUT.exists() else ""
    if ns.check:
        if current != text:
            print(f"docs/flags.md is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

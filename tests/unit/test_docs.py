"""The README and docs/ match the tree: links, commands, settings.

Every relative link in README.md, docs/*.md and deploy/README.md names a file that
exists (and a ``#section`` of the same page names one of its headings); every
``aikg`` command line in the README's console blocks names a real subcommand with
real options, every ``make`` target one the Makefile defines and every
``python -m bench.X`` a module of bench/; every Settings field is in docs/settings.md.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from services.cli import app
from services.common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A link's target: a path (a '.' or '/' in it) or a '#section'; `OPS['r'](x)` is not one.
LINK = re.compile(r"\]\((#[^)\s]+|[^)\s]*[./][^)\s]*)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def without_blocks(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def console_lines(text: str) -> list[str]:
    """Every line of the page's ```console blocks, continuation lines joined."""
    return [line for block in re.findall(r"```console\n(.*?)```", text, re.S)
            for line in block.replace("\\\n", " ").splitlines()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    text = without_blocks(page.read_text())
    headings = {slug(h.replace("`", "")) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for target in LINK.findall(re.sub(r"`[^`\n]*`", "", text)):  # not in inline code
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            assert anchor in headings, f"{page.name}: no heading for #{anchor}"
            continue
        assert (page.parent / path).exists(), f"{page.name}: {target} does not exist"


def test_readme_commands_exist() -> None:
    group = typer.main.get_command(app)
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    seen = set()
    for line in console_lines(README.read_text()):
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0].endswith("bin/aikg") or argv[0] == "aikg":
            name, *args = argv[1:]
            assert name in group.commands, f"`aikg {name}` is not a command: {line}"
            command = group.commands[name]
            options = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
            for arg in args:
                if arg.startswith("-"):
                    assert arg.split("=", 1)[0] in options, f"`aikg {name}` has no {arg}: {line}"
            seen.add(name)
        elif argv[0] == "make":
            target = argv[1] if len(argv) > 1 and "=" not in argv[1] else "all"
            assert target in targets, f"`make {target}` is not a Makefile target: {line}"
        elif "-m" in argv and argv[argv.index("-m") + 1].startswith("bench."):
            module = argv[argv.index("-m") + 1]
            assert (ROOT / "bench" / f"{module.split('.', 1)[1]}.py").exists(), line
    # The main job: a stack, a submission, a verification of one's own kernel.
    assert {"up", "submit", "verify", "run"} <= seen, seen


def test_readme_gives_the_two_commands() -> None:
    """The Makefile's header promises that the README gives `make run` and `make test`."""
    install = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    block = console_lines("## Install" + install)
    assert any(line.startswith("make run") for line in block)
    assert any(line.startswith("make test") for line in block)


def test_every_setting_is_documented() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    per_agent = re.compile(r"llm_(designer|coder|conductor)_(\w+)")
    for field in Settings.__struct_fields__:
        agent = per_agent.fullmatch(field)
        if agent:
            assert "AIKG_LLM_<AGENT>_<NAME>" in text
            assert f"`{agent.group(1).upper()}`" in text and f"`{agent.group(2).upper()}`" in text, \
                field
            continue
        assert f"AIKG_{field.upper()}" in text, f"AIKG_{field.upper()} is not in docs/settings.md"

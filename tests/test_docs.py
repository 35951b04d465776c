"""The docs' command lines against the parsers that read them.

A user copies a line from README.md or docs/ into a shell at 3 a.m.: an option
that was renamed or never existed must fail here, not there.  Each command line
is split where the docs write one (a fenced block's line, an inline code span),
and its options are checked against the program they are given to: the
launcher's before the script, the script's after it; every other ``--option``
the docs name must belong to one of our programs, to torchrun, or to the few
outside tools the docs quote.  Every link between the docs leads to a file that
exists and, where it names one, to a heading of that file: pages split and
headings renamed with the code they cite must not leave dead links.
"""
import ast
import re
import shlex
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

from torch.distributed.run import get_args_parser

from commslayer.run.launcher import parser as launcher_parser
from tracing.read.cli import parser as trace_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGES = ("commslayer", "faults", "tracing", "fsdp_overlap", "launch")
# options of outside tools the docs quote, by tool
OUTSIDE = {"--allow-incomplete-ranks": "torch's fr_trace", "--short": "git rev-parse",
           "--pid": "py-spy", "--format": "py-spy", "--threads": "py-spy", "--nonblocking": "py-spy",
           "--client-cert-auth": "etcd"}
OPTION = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")


def _added_options(path: Path) -> Set[str]:
    """The ``--options`` a source file's ``add_argument`` calls declare."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            found |= {a.value for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}
    return found


def _parser_options(p) -> Set[str]:
    """A parser's options, its subcommands' included."""
    found = {s for a in p._actions for s in a.option_strings}
    for action in p._actions:
        for sub in (getattr(action, "choices", None) or {}).values():
            if hasattr(sub, "_actions"):
                found |= _parser_options(sub)
    return found


def _command_lines() -> Iterator[Tuple[Path, str]]:
    """Every line of a fenced block and every inline code span of the docs."""
    for doc in DOCS:
        fenced = False
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced:
                yield doc, line
            else:
                yield from ((doc, span) for span in re.findall(r"`([^`]+)`", line))


def _words(text: str) -> List[str]:
    """A command line's words up to its end (a comment, a pipe, a sequence)."""
    text = re.split(r"\s#|\s\||;|&&|\)", text)[0]
    try:
        return shlex.split(text)
    except ValueError:  # an unclosed quote in prose
        return text.split()


def _script_options() -> Dict[str, Set[str]]:
    return {str(p.relative_to(ROOT)): _added_options(p) for p in (ROOT / "launch").rglob("*.py")}


def _invocations(program: str) -> Iterator[Tuple[Path, List[str]]]:
    """The words after ``program`` on each docs line that runs it."""
    for doc, line in _command_lines():
        words = _words(line)
        for i, word in enumerate(words):
            if word == program or word.endswith("/" + program):
                yield doc, words[i + 1:]


def test_the_launcher_lines_name_its_options_and_the_scripts_theirs():
    ours = _parser_options(launcher_parser())
    scripts = _script_options()
    wrong, seen = [], 0
    for doc, words in _invocations("commslayer-run"):
        cut = next((i for i, w in enumerate(words) if w.endswith(".py") or w == "..."), len(words))
        for word in words[:cut]:
            option = word.split("=", 1)[0]
            if option.startswith("--") and option not in ours:
                wrong.append((doc.name, "commslayer-run", option))
        seen += 1
        script = words[cut] if cut < len(words) else ""
        for word in words[cut + 1:]:
            option = word.split("=", 1)[0]
            if script in scripts and option.startswith("--") and option not in scripts[script]:
                wrong.append((doc.name, script, option))
    assert seen > 10, seen  # the docs' launcher lines were found
    assert not wrong, wrong


def test_the_script_lines_name_the_scripts_options():
    scripts = _script_options()
    wrong, seen = [], 0
    for doc, line in _command_lines():
        words = _words(line)
        for i, word in enumerate(words):
            if word in scripts and (i == 0 or words[i - 1] in ("python", "python3", "torchrun")
                                    or words[i - 1].startswith("-")):
                seen += 1
                for later in words[i + 1:]:
                    option = later.split("=", 1)[0]
                    if option.startswith("--") and option not in scripts[word]:
                        wrong.append((doc.name, word, option))
    assert seen > 10, seen
    assert not wrong, wrong


def test_the_trace_and_fault_tool_lines_name_their_options():
    tools = {"commslayer-trace": _parser_options(trace_parser()),
             "commslayer-faults": _added_options(ROOT / "faults" / "cli.py")}
    wrong = []
    for program, options in tools.items():
        for doc, words in _invocations(program):
            cut = words.index("--") if "--" in words else len(words)  # after --: the job's arguments
            wrong += [(doc.name, program, w) for w in words[:cut]
                      if w.startswith("--") and w.split("=", 1)[0] not in options]
    assert not wrong, wrong


def test_every_option_the_docs_name_exists():
    known = set(OUTSIDE) | {s for a in get_args_parser()._actions for s in a.option_strings}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            known |= _added_options(path)
    unknown = sorted({(doc.name, m.group(0)) for doc in DOCS for m in OPTION.finditer(doc.read_text())
                      if m.group(0) not in known})
    assert not unknown, unknown


def _heading_anchors(doc: Path) -> Set[str]:
    """The anchors a Markdown renderer gives a page's headings (GitHub's rule), fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_the_docs_leads_somewhere():
    dead = []
    for doc in DOCS:
        for m in LINK.finditer(doc.read_text()):
            path, anchor = m.group(1), m.group(2)
            if path.startswith(("http://", "https://", "mailto:")):
                continue
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                dead.append((doc.relative_to(ROOT).as_posix(), m.group(0)))
            elif anchor and target.suffix == ".md" and anchor not in _heading_anchors(target):
                dead.append((doc.relative_to(ROOT).as_posix(), m.group(0)))
    assert not dead, dead

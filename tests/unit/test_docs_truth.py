"""What the docs name exists: every repo path, file name, link, `--flag` and backticked
kvstrata class (or `Class.attribute`) that README.md and docs/*.md mention is checked against
the tree, so a rename or a removal that leaves a doc behind fails here, not in a reader's
hands. docs/history/ is not read: a history may name what no longer exists; that is its job.

- Paths: a token that starts with one of the repo's folders (kvstrata/, tests/, benchmarks/,
  docs/, or a kvstrata package written without kvstrata/: `runner/model_runner.py`) must
  exist, as must a hidden folder's (`.ci/run`), and a glob (`engine/sides/disagg_*.py`,
  `{a,b}` alternatives) must match something;
  a shorter path with a folder and a source suffix (`api/native_batch.py`, `csrc/rowcopy.c`)
  must be the tail of a real path. Paths under a gitignored folder (`benchmarks/results/`)
  are what a tool writes, not claims. A bare source file name (`quantization.py`) must be
  some file's name, unless its line names another project (OTHER_PROJECTS: SGLang's
  `deepseek_v2.py`).
- Links: a markdown link to a file must reach it, and its `#anchor` one of its headings.
- Flags: every `--flag` must be kvstrata's: a ServerArgs field (`--field-name`, and
  `--no-field-name` for a switch that defaults to on; `--prefix-*` must match one) or an
  argparse flag of kvstrata's commands (kvstrata/) or of a script in benchmarks/. A flag on
  a line that names another program (a code block's command with its `\\` continuations, or
  a prose line) is that program's: THIRD_PARTY matches those programs.
- Classes: a backticked CamelCase name must be a class or module-level alias defined in
  kvstrata/, a name kvstrata reads as a string (an HF architecture such as
  `LlamaForCausalLMEagle`), a Python builtin, or one of THIRD_PARTY_NAMES; a backticked
  `Class.attribute` must be something the class (or a kvstrata base class) defines.

Prose claims ("one C extension", "refused") cannot be checked this way; keep them few and
point at the code that decides them.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import fnmatch
import os
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "kvstrata"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

TOP = {"kvstrata", "tests", "benchmarks", "docs"}
PACKAGES = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
    "entrypoints"}
SOURCE_SUFFIXES = (".py", ".h", ".c", ".sh")

# Other programs: a line that runs or names one carries its flags (and its file names).
THIRD_PARTY = re.compile(
    r"\b(sglang[-_]router|vLLM|llama-server|llama\.cpp|transformers serve|pytest|pip"
    r"|apt-get|curl)\b", re.IGNORECASE)
# Other projects: a line that names one may name its files (SGLang's `deepseek_v2.py`).
OTHER_PROJECTS = re.compile(r"\b(SGLang|vLLM|transformers|torchao|llama\.cpp)\b")
# Backticked CamelCase names that are not kvstrata's, and why the docs name them.
THIRD_PARTY_NAMES = {
    "FastAPI",  # the HTTP framework
    "RMSNorm", "LayerNorm",  # the layers of DeepSeek's reference model (docs/dsa.md)
    "GenerateReqInput",  # SGLang's /generate schema, which kvstrata mirrors
    "Int8DynamicActivationInt8WeightConfig",  # torchao's int8 path, measured and not taken
    "Gemma3ForConditionalGeneration",  # the multimodal Gemma 3 checkpoints, refused by name
    # transformers' decoder layers that the NEXTN tests run as the MTP layer's reference
    "DeepseekV3DecoderLayer", "Qwen3NextDecoderLayer",
}


@cache
def _docs() -> dict[Path, str]:
    return {p: p.read_text() for p in DOCS}


@cache
def _repo_files() -> tuple[str, ...]:
    """Every file and folder of the repo (relative, folders with a trailing /), minus
    hidden folders (.venv, .git), caches and build output."""
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in (
            "__pycache__", "build", "dist") and not d.endswith(".egg-info")]
        rel = os.path.relpath(root, REPO)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out += [prefix + d + "/" for d in dirs] + [prefix + f for f in files]
    return tuple(out)


@cache
def _tails() -> frozenset[str]:
    """Every tail of every repo path with a folder in it (`api/native_batch.py`)."""
    out = set()
    for f in _repo_files():
        parts = f.rstrip("/").split("/")
        out |= {"/".join(parts[i:]) for i in range(len(parts) - 1)}
    return frozenset(out)


@cache
def _file_names() -> frozenset[str]:
    return frozenset(f.rstrip("/").rsplit("/", 1)[-1] for f in _repo_files())


@cache
def _ignored_folders() -> tuple[str, ...]:
    lines = (REPO / ".gitignore").read_text().splitlines()
    return tuple(ln.lstrip("/") for ln in lines if ln.endswith("/") and "*" not in ln)


def _lines_with_context(text: str):
    """(line number, line, context): in a code block the context is the logical command
    (joined over `\\` continuations); in prose, the line itself."""
    lines = text.split("\n")
    in_code = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_code = not in_code
            i += 1
            continue
        j = i
        while in_code and lines[j].rstrip().endswith("\\") and j + 1 < len(lines):
            j += 1
        logical = " ".join(lines[i:j + 1])
        for k in range(i, j + 1):
            yield k + 1, lines[k], logical
        i = j + 1


# ---- paths ----------------------------------------------------------------------------------
_PATH = re.compile(r"(?<![\w./~:=@$-])((?:[\w*{},.-]+/)+[\w*{},.-]*)")
_BARE = re.compile(r"(?<![\w./~-])([A-Za-z_][\w-]*\.(?:py|c|h|sh))\b")


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [e for alt in m.group(1).split(",")
            for e in _expand_braces(path[:m.start()] + alt + path[m.end():])]


def _path_exists(path: str) -> bool:
    files = _repo_files()
    first = path.split("/")[0]
    for candidate in _expand_braces(path):
        for base in [""] + (["kvstrata/"] if first in PACKAGES else []):
            full = base + candidate
            if any(ch in full for ch in "*?["):
                if any(fnmatch.fnmatch(f.rstrip("/"), full.rstrip("/")) for f in files):
                    break
            elif (REPO / full).exists():
                break
        else:
            if first in TOP | PACKAGES:
                return False
            tail = candidate.rstrip("/")  # a shorter path: the tail of a real one
            if any(ch in tail for ch in "*?["):
                if not fnmatch.filter(_tails(), tail):
                    return False
            elif tail not in _tails():
                return False
    return True


def _path_claims(line: str) -> list[str]:
    found = []
    for m in _PATH.finditer(line):
        token = m.group(1).rstrip(".,;:")
        first = token.split("/")[0]
        if "<" in token or first in ("", ".", "..") or token.startswith(_ignored_folders()):
            continue
        if first in TOP | PACKAGES or first.startswith(".") or token.endswith(SOURCE_SUFFIXES):
            found.append(token)
    return found


def _bare_name_claims(line: str) -> list[str]:
    if OTHER_PROJECTS.search(line):
        return []
    return [m for m in _BARE.findall(line) if m not in _file_names()]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


def _link_claims(doc: Path, line: str) -> list[str]:
    bad = []
    for target in _LINK.findall(line):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file) if file else doc
        if not path.exists() or anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(target)
    return bad


# ---- flags ----------------------------------------------------------------------------------
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*(?:-\*)?)(?![a-z0-9-]|\.\.\.)")


@cache
def _known_flags() -> frozenset[str]:
    from kvstrata.config.server_args import ServerArgs

    flags = set()
    for f in dataclasses.fields(ServerArgs):
        name = f.name.replace("_", "-")
        flags.add(name)
        if str(f.type) == "bool" and f.default:
            flags.add("no-" + name)
    for path in [*PKG.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        text = path.read_text()
        if "add_argument" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                continue
            negated = any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value)
                          for k in node.keywords)
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    flags.add(arg.value[2:])
                    if negated:
                        flags.add("no-" + arg.value[2:])
    return frozenset(flags)


def _flag_ok(name: str) -> bool:
    known = _known_flags()
    if name.endswith("-*"):
        return any(f.startswith(name[:-1]) for f in known)
    return name in known


def _flag_claims(line: str, context: str) -> list[str]:
    if THIRD_PARTY.search(context):
        return []
    return _FLAG.findall(line)


# ---- classes --------------------------------------------------------------------------------
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
# CamelCase: an upper-case letter, later a lower-case one and another upper-case one
# (`SchedulerOutput`, `HiRadixCache`) or upper-case letters then a word (`KVPlan`);
# optionally `.attribute` and a call's parentheses.
_CAMEL = re.compile(r"^([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*"
                    r"|[A-Z]+[A-Z][a-z][A-Za-z0-9]*)"
                    r"(?:\.([A-Za-z_]\w*))?(?:\(.*\))?$")


_CLASS_DEF = re.compile(r"^[ \t]*class (\w+)\b[^:\n]*:|^([A-Z]\w*)\s*(?::[^=\n]*)?=", re.MULTILINE)
_NAME_STRING = re.compile(r"""["']([A-Z]\w+)["']""")


@cache
def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in PKG.rglob("*.py")}


@cache
def _kvstrata_names() -> tuple[dict[str, list[Path]], frozenset[str]]:
    """(class -> the files defining it, CamelCase string constants) over kvstrata/, by a
    regex (parsing every module would take a second): a module-level CamelCase alias
    (`Op = BackupOp | ...`) counts as a class too."""
    classes: dict[str, list[Path]] = {}
    strings: set[str] = set()
    for path, text in _sources().items():
        for m in _CLASS_DEF.finditer(text):
            classes.setdefault(m.group(1) or m.group(2), []).append(path)
        strings |= {s for s in _NAME_STRING.findall(text) if _CAMEL.match(s)}
    return classes, frozenset(strings)


@cache
def _class_members(path: Path) -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
    """class -> (the names its body and its methods' `self.x =` define, its bases)."""
    out = {}
    for node in ast.walk(ast.parse(_sources()[path])):
        if not isinstance(node, ast.ClassDef):
            continue
        names = set()
        for item in ast.walk(node):
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(item.name)
            elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Name):
                            names.add(sub.id)
                        elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                              and sub.value.id == "self"):
                            names.add(sub.attr)
        out[node.name] = (frozenset(names), tuple(ast.unparse(b).split(".")[-1]
                                                  for b in node.bases))
    return out


def _defines(cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    if cls in seen:
        return False
    for path in _kvstrata_names()[0].get(cls, []):
        names, bases = _class_members(path).get(cls, (frozenset(), ()))
        if attr in names or any(_defines(b, attr, seen | {cls}) for b in bases):
            return True
    return False


def _class_ok(name: str, attr: str | None) -> bool:
    classes, strings = _kvstrata_names()
    if name in classes:
        return attr is None or _defines(name, attr)
    return attr is None and (name in THIRD_PARTY_NAMES or name in strings
                             or hasattr(builtins, name))


def _class_claims(text: str) -> list[tuple[int, str, str | None]]:
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
    out = []
    for m in _CODE_SPAN.finditer(prose):
        c = _CAMEL.match(m.group(1).strip())
        if c:
            out.append((prose.count("\n", 0, m.start()) + 1, c.group(1), c.group(2)))
    return out


# ---- the check ------------------------------------------------------------------------------
def false_claims(docs: dict[Path, str] | None = None) -> list[str]:
    bad = []
    for doc, text in (_docs() if docs is None else docs).items():
        rel = doc.relative_to(REPO)
        for n, line, context in _lines_with_context(text):
            bad += [f"{rel}:{n}: path {p}" for p in _path_claims(line) if not _path_exists(p)]
            bad += [f"{rel}:{n}: file {p}" for p in _bare_name_claims(line)]
            bad += [f"{rel}:{n}: link {p}" for p in _link_claims(doc, line)]
            bad += [f"{rel}:{n}: flag --{f}" for f in _flag_claims(line, context)
                    if not _flag_ok(f)]
        bad += [f"{rel}:{n}: class {name}{'.' + attr if attr else ''}"
                for n, name, attr in _class_claims(text) if not _class_ok(name, attr)]
    return bad


def test_every_path_flag_and_class_a_doc_names_exists():
    bad = false_claims()
    assert bad == [], "the docs name what does not exist:\n" + "\n".join(bad)


def test_the_check_catches_what_does_not_exist():
    """The checker itself: each line below names something that does not exist (or, the
    last ones, something that does, or another program's flag)."""
    lines = [
        "engine/scheduler.py and runner/quantization.py",  # moved / never there
        "kvstrata/engine/sides/nothing_*.py",  # a glob that matches nothing
        "`--tp-sizes 2`",  # no such flag
        "`SchedulerOutput.backups` and `NoSuchPlan`",  # no such field, no such class
        "[a link](nope.md), [an anchor](api.md#no-such-heading), quantization.py",
        "engine/sides/disagg_*.py, `--tp-size`, `--speculative-*`, `SchedulerOutput.ops`",
        "[api](api.md#errors), vLLM's `--enable-auto-tool-choice`, benchmarks/results/x.json",
    ]
    bad = false_claims({REPO / "docs" / "example.md": "\n".join(lines)})
    claims = [b.split(": ", 1)[1] for b in bad]
    assert claims == [
        "path engine/scheduler.py", "path runner/quantization.py",
        "path kvstrata/engine/sides/nothing_*.py", "flag --tp-sizes",
        "file quantization.py", "link nope.md", "link api.md#no-such-heading",
        "class SchedulerOutput.backups", "class NoSuchPlan"], bad


if __name__ == "__main__":
    print("\n".join(false_claims()))

"""An openly licensed chat corpus: the docstrings and reference topics of the running CPython.

The standard library this interpreter ships (PSF-2.0) is read as source with `ast`, never
imported, so building the corpus runs no module code. Each documented public module, class,
function and method, and each `pydoc_data` language-reference topic, becomes one
question/answer conversation whose answer is the (cleaned, capped) documentation text.
With `--sources`, each public function and method of up to MAX_ANSWER_CHARS characters also
becomes one whose answer is its source code ("How is `textwrap.dedent` implemented?"), held
out together with its docstring's conversation. With `--grounded K`, every documented function,
method and class also becomes K reading-comprehension conversations (a held-out one: one):
the prompt quotes the documentation of the object and of up to three of its siblings, and
the answer is the object's entry, copied (see `grounded_conversations`). A question about
an object the target never saw has no right answer closed-book; with its documentation in
the prompt it has one.

    python -m training.corpus --out corpus.json [--sources] [--grounded 3 [--swapped-words F]]

`--documentation-out docs.json` also writes what was read (a few MB), and `--documentation
docs.json` builds the same corpus from it on another interpreter, e.g. the GPU machine's.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import hashlib
import itertools
import json
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Collection, Iterator
from pathlib import Path

MIN_ANSWER_CHARS = 40
MAX_ANSWER_CHARS = 1200
# Fraction of items held out for evaluation, chosen by a hash of the name (stable across runs).
HELD_OUT_FRACTION = 0.03
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
TOPICS_FILE = Path("pydoc_data") / "topics.py"

OBJECT_QUESTIONS = (
    "What does `{}` do?",
    "Explain `{}`.",
    "How do I use `{}`?",
    "What is `{}` for?",
)
QUESTION_TEMPLATES = {
    "module": ("Tell me about the `{}` module.", "What is the `{}` module for?"),
    "class": OBJECT_QUESTIONS,
    "function": OBJECT_QUESTIONS,
    "method": OBJECT_QUESTIONS,
    "topic": (
        "Explain the Python topic `{}`.",
        "What does the Python language reference say about `{}`?",
    ),
    "source": (
        "How is `{}` implemented?",
        "Show me the source code of `{}`.",
    ),
}
SOURCE_PREFIX = "source:"
GROUNDED_PREFIX = "grounded:"
GROUNDED_KINDS = ("function", "method", "class")
# Each quoted entry of a grounded prompt, and so its answer, is capped at this length: four
# entries and the question stay within ~600 tokens of the embedded tokenizer.
GROUNDED_CHARS = 480
MAX_SIBLINGS = 3
# Words of a training prompt's quoted texts replaced at random (see grounded_conversations).
SWAPPED_WORDS = 0.2
WORD = re.compile(r"[A-Za-z]{3,}")
GROUNDED_QUESTIONS = (
    "According to this documentation, what does `{}` do?",
    "What does the documentation above say about `{}`?",
    "Using only the documentation above, explain `{}`.",
)


@dataclasses.dataclass(frozen=True)
class Documented:
    """One piece of documentation: `name` is unique, `kind` a key of QUESTION_TEMPLATES."""

    name: str
    kind: str
    text: str


@dataclasses.dataclass(frozen=True)
class Conversation:
    name: str
    question: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: tuple[Conversation, ...]
    held_out: tuple[Conversation, ...]
    source: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def running_python() -> str:
    return ".".join(str(part) for part in sys.version_info[:3])


def corpus_source(sources: bool = False, grounded: bool = False, version: str = "") -> str:
    """`version`: of the CPython whose library was read (default: this one)."""
    version = version or running_python()
    code = ", function and method source code" if sources else ""
    quoted = (
        "; questions answered from documentation quoted in the prompt (in training prompts, "
        "under other objects' headings)"
        if grounded
        else ""
    )
    return (
        f"CPython {version} standard library docstrings{code} and pydoc_data topics "
        f"(PSF-2.0){quoted}"
    )


def build_corpus(
    seed: int = 0,
    modules: Collection[str] | None = None,
    sources: bool = False,
    grounded: int = 0,
    swapped_words: float = SWAPPED_WORDS,
) -> Corpus:
    """The corpus of this interpreter's standard library; deterministic for a given seed.

    `modules` restricts the docstrings to those top-level modules/packages (tests use it to
    stay fast); the reference topics are always included. `sources`: also the functions'
    and methods' source code. `grounded`: grounded conversations per training object
    (`grounded_conversations`, with `swapped_words` of their training texts' words swapped).
    """
    documented = collect_documentation(stdlib_dir(), modules, sources)
    return corpus_from(documented, seed, grounded, swapped_words)


def collect_documentation(
    root: Path, modules: Collection[str] | None = None, sources: bool = False
) -> list[Documented]:
    """Docstrings (and with `sources` the source code) of the modules under `root`, sorted by
    path, then the reference topics."""
    documented = []
    for module_name, path in module_files(root):
        if modules is None or module_name.split(".")[0] in modules:
            documented.extend(module_docstrings(module_name, path))
            if sources:
                documented.extend(module_sources(module_name, path))
    documented.extend(reference_topics(root / TOPICS_FILE))
    return documented


def corpus_from(
    documented: list[Documented],
    seed: int,
    grounded: int = 0,
    swapped_words: float = SWAPPED_WORDS,
    python_version: str = "",
) -> Corpus:
    """`python_version`: of the CPython the documentation was read from (default: this one)."""
    conversations = [to_conversation(item, seed) for item in documented]
    if grounded:
        conversations += grounded_conversations(documented, seed, grounded, swapped_words)
    names = [conversation.name for conversation in conversations]
    assert len(set(names)) == len(names), "documentation names must be unique"
    return Corpus(
        train=tuple(c for c in conversations if not is_held_out(split_name(c.name))),
        held_out=tuple(c for c in conversations if is_held_out(split_name(c.name))),
        source=corpus_source(
            any(item.kind == "source" for item in documented), bool(grounded), python_version
        ),
    )


def split_name(name: str) -> str:
    """The name that decides a conversation's split: a source or grounded conversation goes
    with its object's docstring (its code, or its prompt, holds that docstring); `#k`
    numbers a grounded conversation's variants."""
    return name.removeprefix(SOURCE_PREFIX).removeprefix(GROUNDED_PREFIX).partition("#")[0]


def grounded_conversations(
    documented: list[Documented],
    seed: int,
    variants: int,
    swapped_words: float = SWAPPED_WORDS,
) -> list[Conversation]:
    """Reading comprehension over the documentation: for an object X, the prompt quotes
    X and up to MAX_SIBLINGS other members of X's module or class, in random order, each
    under a `### `name`` heading with (capped) documentation below it, then asks about X;
    the answer is the text under X's heading. Each training object gets `variants` such
    conversations (other siblings, order, texts and question; named `grounded:X`,
    `grounded:X#1`, ...), a held-out one gets one.

    A held-out prompt quotes each object's own documentation. A training prompt quotes
    texts of randomly drawn training objects under the headings instead, with a
    `swapped_words` fraction of their words replaced by random corpus words: with their own
    texts (commit 3e26e4f) the target answered every training prompt from memory (the
    closed-book conversations teach X's documentation too) and read no held-out prompt
    (0 of 48 right); with whole memorised texts it could still read only the first words
    and recite the rest. No held-out text is quoted in a training prompt."""
    candidates = [item for item in documented if item.kind in GROUNDED_KINDS]
    siblings: dict[str, list[Documented]] = collections.defaultdict(list)
    for item in candidates:
        siblings[item.name.rpartition(".")[0]].append(item)
    training_texts = [item.text for item in candidates if not is_held_out(item.name)]
    words = sorted({word for text in training_texts for word in WORD.findall(text)})
    conversations = []
    for item, variant in itertools.product(candidates, range(variants)):
        held_out = is_held_out(item.name)
        if held_out and variant:
            continue
        name = GROUNDED_PREFIX + item.name + (f"#{variant}" if variant else "")
        rng = random.Random(f"{seed}:{name}")
        others = [
            other
            for other in siblings[item.name.rpartition(".")[0]]
            if other is not item and (held_out or not is_held_out(other.name))
        ]
        quoted = [*rng.sample(others, min(len(others), rng.randint(1, MAX_SIBLINGS))), item]
        rng.shuffle(quoted)
        if held_out:
            texts = [cap_text(other.text, GROUNDED_CHARS) for other in quoted]
        else:
            texts = [
                cap_text(_swap_words(text, words, rng, swapped_words), GROUNDED_CHARS)
                for text in _distinct(training_texts, len(quoted), rng)
            ]
        entries = "\n\n".join(
            f"### `{other.name}`\n{text}" for other, text in zip(quoted, texts, strict=True)
        )
        question = rng.choice(GROUNDED_QUESTIONS).format(item.name)
        answer = texts[quoted.index(item)]
        conversations.append(Conversation(name, f"{entries}\n\n{question}", answer))
    return conversations


def is_grounded(conversation: Conversation) -> bool:
    return conversation.name.startswith(GROUNDED_PREFIX)


def _swap_words(text: str, words: list[str], rng: random.Random, fraction: float) -> str:
    """`text` with each word (WORD) replaced by a random one of `words` with probability
    `fraction`, at least one: text no model can continue from memory, only copy."""
    spans = [match.span() for match in WORD.finditer(text)]
    chosen = [span for span in spans if rng.random() < fraction]
    if not chosen and spans:
        chosen = [rng.choice(spans)]
    pieces, end = [], 0
    for start, stop in chosen:
        pieces += [text[end:start], rng.choice(words)]
        end = stop
    return "".join([*pieces, text[end:]])


def _distinct(texts: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` different texts drawn from `texts` (some docstrings are shared by several
    objects; two equal entries would make the answer ambiguous)."""
    chosen: list[str] = []
    while len(chosen) < count:
        text = rng.choice(texts)
        if text not in chosen:
            chosen.append(text)
    return chosen


def module_files(root: Path) -> list[tuple[str, Path]]:
    """(dotted module name, path) of every public, non-test module under root, sorted by path."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(part in SKIPPED_DIRS for part in parts[:-1]):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(part.isidentifier() and not part.startswith("_") for part in parts):
            found.append((".".join(parts), path))
    return found


def module_docstrings(module_name: str, path: Path) -> list[Documented]:
    """The module's docstring and those of its public classes, functions and methods."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    documented = list(_documented_in(tree, module_name, "module"))
    first_by_name = {}
    for item in documented:
        # A property's setter, or a definition repeated in both branches of an `if`: keep one.
        first_by_name.setdefault(item.name, item)
    return list(first_by_name.values())


def _documented_in(node: ast.AST, name: str, kind: str) -> Iterator[Documented]:
    text = ast.get_docstring(node, clean=True)
    if text is not None and len(text.strip()) >= MIN_ANSWER_CHARS:
        yield Documented(name, kind, cap_text(text.strip()))
    if kind not in ("module", "class"):
        return
    for child in node.body:
        if isinstance(child, ast.ClassDef):
            child_kind = "class"
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            child_kind = "method" if kind == "class" else "function"
        else:
            continue
        if not child.name.startswith("_"):
            yield from _documented_in(child, f"{name}.{child.name}", child_kind)


def module_sources(module_name: str, path: Path) -> list[Documented]:
    """The source code of the module's public functions and of its public classes' public
    methods, MIN_ANSWER_CHARS..MAX_ANSWER_CHARS characters each (decorators left out),
    dedented; named `source:<dotted name>`, the first definition of a name kept."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []
    found: dict[str, Documented] = {}
    for name, node in _public_functions(tree, module_name):
        segment = ast.get_source_segment(text, node, padded=True)
        code = textwrap.dedent(segment or "").strip()
        if MIN_ANSWER_CHARS <= len(code) <= MAX_ANSWER_CHARS:
            found.setdefault(name, Documented(SOURCE_PREFIX + name, "source", code))
    return list(found.values())


def _public_functions(tree: ast.Module, module_name: str) -> Iterator[tuple[str, ast.AST]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not node.name.startswith("_"):
                yield f"{module_name}.{node.name}", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for child in node.body:
                is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_function and not child.name.startswith("_"):
                    yield f"{module_name}.{node.name}.{child.name}", child


def reference_topics(path: Path) -> list[Documented]:
    """The `topics` dict of pydoc_data/topics.py, read as a literal (the file is not imported)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and [
            target.id for target in statement.targets if isinstance(target, ast.Name)
        ] == ["topics"]:
            topics = ast.literal_eval(statement.value)
            break
    else:
        raise ValueError(f"{path} has no `topics = {{...}}` assignment")
    return [
        Documented(f"topic:{topic}", "topic", cap_text(text.strip()))
        for topic, text in sorted(topics.items())
        if len(text.strip()) >= MIN_ANSWER_CHARS
    ]


def cap_text(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """text cut to at most max_chars, at the last paragraph break, else line break, else space.

    A boundary is only used if it keeps at least half of max_chars.
    """
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for boundary in ("\n\n", "\n", " "):
        cut = head.rfind(boundary)
        if cut >= max_chars // 2:
            return head[:cut].rstrip()
    return head


def to_conversation(item: Documented, seed: int) -> Conversation:
    # A generator per item (str seeds hash deterministically) keeps each question independent
    # of which other items are present and of their order.
    rng = random.Random(f"{seed}:{item.name}")
    template = rng.choice(QUESTION_TEMPLATES[item.kind])
    subject = item.name.removeprefix("topic:").removeprefix(SOURCE_PREFIX)
    return Conversation(name=item.name, question=template.format(subject), answer=item.text)


def is_held_out(name: str) -> bool:
    return _hashes_below(name, HELD_OUT_FRACTION)


def is_validation(name: str) -> bool:
    """Whether a training conversation is set aside to choose when the target stops
    training (`--target-eval-every`): another 3 % by another hash, so the held-out set that
    the benchmarks measure plays no part in choosing the model."""
    return _hashes_below(f"validation:{name}", HELD_OUT_FRACTION)


def _hashes_below(key: str, fraction: float) -> bool:
    """A stable pseudo-random choice of `fraction` of all keys (sha256, not Python's hash)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def rephrased_question(conversation: Conversation, rng: random.Random) -> str:
    """The conversation's subject asked with another template than its own: a prompt the
    target never saw, for drafter data that covers how the target answers new prompts."""
    subject = subject_of(conversation)
    choices = [t for t in OBJECT_QUESTIONS if t.format(subject) != conversation.question]
    return rng.choice(choices).format(subject)


def invented_question(
    conversations: tuple[Conversation, ...], rng: random.Random, known: set[str]
) -> str:
    """A question about a subject that does not exist: one training item's module path with
    another item's last name component (`json.decoder.dedent`). The target has to improvise
    its answer, as it does for any subject it never saw; drafter data from such prompts
    covers that behaviour without touching the held-out set."""
    while True:
        first, second = rng.sample(conversations, 2)
        head, tail = subject_of(first).rpartition(".")[0], subject_of(second).rpartition(".")[2]
        subject = f"{head}.{tail}" if head else tail
        if subject not in known:
            return rng.choice(OBJECT_QUESTIONS).format(subject)


def subject_of(conversation: Conversation) -> str:
    """The name a question asks about: between its last pair of backticks (a grounded
    question quotes other names before it)."""
    return conversation.question.split("`")[-2]


def prompt_text(question: str) -> str:
    """The ChatML generation prompt for one user question, thinking disabled."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def render_chat(conversation: Conversation) -> str:
    """The text a model trains on: the prompt, then the answer closed by `<|im_end|>`."""
    return f"{prompt_text(conversation.question)}{conversation.answer}<|im_end|>\n"


def save_documentation(documented: list[Documented], path: Path, version: str = "") -> None:
    """Write what `collect_documentation` read, with the version of the CPython it read
    (default: this one), so that another interpreter (the GPU machine's) builds the same
    corpus from it: a few MB where a grounded corpus is ~80 MB."""
    payload = {
        "python": version or running_python(),
        "documented": [dataclasses.asdict(d) for d in documented],
    }
    Path(path).write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")


def load_documentation(path: Path) -> tuple[list[Documented], str]:
    """(documentation, version of the CPython it was read from), from save_documentation."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    return [Documented(**d) for d in payload["documented"]], payload["python"]


def save_corpus(corpus: Corpus, path: Path) -> None:
    """Write the corpus as one UTF-8 JSON file (read back with load_corpus)."""
    payload = {
        "source": corpus.source,
        "train": [dataclasses.asdict(c) for c in corpus.train],
        "held_out": [dataclasses.asdict(c) for c in corpus.held_out],
    }
    Path(path).write_text(json.dumps(payload, ensure_ascii=False, indent=1), encoding="utf-8")


def load_corpus(path: Path) -> Corpus:
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    return Corpus(
        train=tuple(Conversation(**c) for c in payload["train"]),
        held_out=tuple(Conversation(**c) for c in payload["held_out"]),
        source=payload["source"],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the question templates")
    parser.add_argument(
        "--sources", action="store_true", help="also the functions' and methods' source code"
    )
    parser.add_argument(
        "--grounded",
        type=int,
        default=0,
        metavar="K",
        help="K questions per training function, method and class (a held-out one: one) "
        "answered from its documentation quoted in the prompt among its siblings'",
    )
    parser.add_argument(
        "--swapped-words",
        type=float,
        default=SWAPPED_WORDS,
        metavar="F",
        help=f"fraction of the words of a grounded training text swapped for random corpus "
        f"words (default {SWAPPED_WORDS})",
    )
    parser.add_argument(
        "--documentation",
        type=Path,
        help="build from documentation written by --documentation-out (on another "
        "interpreter) instead of reading this interpreter's standard library",
    )
    parser.add_argument(
        "--documentation-out",
        type=Path,
        help="also write the documentation read, for --documentation elsewhere",
    )
    args = parser.parse_args(argv)
    if args.documentation and args.sources:
        parser.error("--sources: the documentation file already holds what was read")
    if args.grounded < 0:
        parser.error(f"--grounded {args.grounded}: a count of variants, 0 or more")
    if not 0 <= args.swapped_words <= 1:
        parser.error(f"--swapped-words {args.swapped_words}: a fraction, 0 to 1")
    if args.documentation:
        documented, version = load_documentation(args.documentation)
    else:
        documented, version = collect_documentation(stdlib_dir(), sources=args.sources), ""
    if args.documentation_out:
        save_documentation(documented, args.documentation_out, version)
    corpus = corpus_from(documented, args.seed, args.grounded, args.swapped_words, version)
    save_corpus(corpus, args.out)
    print(corpus.source)
    for kind, count in sorted(collections.Counter(item.kind for item in documented).items()):
        print(f"  {kind:<8} {count:>6}")
    if args.grounded:
        num_grounded = sum(map(is_grounded, corpus.train))
        print(f"  grounded {num_grounded:>6} training conversations")
    num_chars = sum(len(render_chat(c)) for c in (*corpus.train, *corpus.held_out))
    print(f"train {len(corpus.train)}, held out {len(corpus.held_out)} conversations")
    print(f"{num_chars} characters of rendered chat written to {args.out}")


if __name__ == "__main__":
    main()

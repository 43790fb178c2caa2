#!/usr/bin/env python3
"""doc_links.py — every citation in the repository points at a file that is there.

Two checks over the tracked files (`git ls-files`; without git, every file below the root but
build folders and .scratch):

1. Every relative link of every Markdown file — inline `[text](target)`, images `![alt](target)`
   and reference definitions `[name]: target` — names a file or folder that exists (and, in a git
   checkout, is tracked, so that a fresh clone has it too). Links with a scheme (https:, mailto:)
   and in-page anchors (#...) are left alone; fenced code blocks and inline code are not links.
2. Every `bench/results/...` path written anywhere in a tracked text file (source comments,
   scripts, docs, the results index) exists; a path must not be broken
   across lines. A glob (`*`, `?`, `[67]`, `{a,b}`) must match at least one file; a placeholder
   (`<run>`, `$VAR`, `...`) is skipped. The result records themselves (bench/results/**, except
   their .md files) are data and are not read.

    python3 tests/doc_links.py [--root DIR]     # exit 1 and one line per broken citation
    python3 tests/doc_links.py --self-test      # the checker finds planted breaks

CTest runs both (label cpu, tests/CMakeLists.txt).
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from urllib.parse import unquote

EXCLUDED_DIRS = re.compile(r"^(build[^/]*|\.scratch|\.git)(/|$)")
RESULTS = "bench/results"
MAX_BYTES = 2_000_000  # larger tracked files are data, not text that cites anything

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
RESULTS_PATH = re.compile(r"(?<![\w./-])bench/results(?![\w-])(?:/(?:[\w.\-/*?\[\]]|\{[\w.,\-]*\})*)?")
PLACEHOLDER_NEXT = set("<$…")
GLOB_CHARS = set("*?[{")


def listed_files(root):
    """(files to read, tracked set or None): git's tracked files, else a walk of the tree."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True)
        files = [f for f in out.stdout.decode("utf-8", "surrogateescape").split("\0") if f]
        if files:
            files = [f for f in files if not EXCLUDED_DIRS.match(f)]
            return files, set(files)
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dirnames[:] = [d for d in dirnames if not EXCLUDED_DIRS.match(rel_dir + d)]
        files += [rel_dir + f for f in filenames]
    return files, None


def read_text(root, rel):
    path = os.path.join(root, rel)
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_BYTES:
        return None
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    return data.decode("utf-8", "replace")


class Checker:
    def __init__(self, root, tracked):
        self.root = root
        self.tracked = tracked
        self.tracked_dirs = None
        if tracked is not None:
            self.tracked_dirs = {""}
            for f in tracked:
                parts = f.split("/")
                for i in range(1, len(parts)):
                    self.tracked_dirs.add("/".join(parts[:i]))
        self.problems = []

    def missing(self, rel):
        """Why the repository-relative path `rel` is not a citable file or folder, or None."""
        if rel.startswith("../") or rel == "..":
            return "points outside the repository"
        if not os.path.exists(os.path.join(self.root, rel)):
            return "does not exist"
        if self.tracked is not None and rel not in self.tracked and rel not in self.tracked_dirs:
            return "exists but is not tracked by git (a fresh clone lacks it)"
        return None

    def report(self, where, line_no, target, why):
        self.problems.append(f"{where}:{line_no}: {target}: {why}")

    def check_markdown(self, rel, text):
        base = os.path.dirname(rel)
        fence = None
        for line_no, line in enumerate(text.splitlines(), 1):
            m = FENCE.match(line)
            if m:
                if fence is None:
                    fence = m.group(1)[0] * 3
                elif m.group(1).startswith(fence):
                    fence = None
                continue
            if fence is not None:
                continue
            stripped = INLINE_CODE.sub("", line)
            targets = [m.group(1) for m in INLINE_LINK.finditer(stripped)]
            m = REFERENCE_DEF.match(stripped)
            if m:
                targets.append(m.group(1))
            for target in targets:
                self.check_link(rel, base, line_no, target)

    def check_link(self, rel, base, line_no, target):
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        if not target or target.startswith("#") or SCHEME.match(target):
            return
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:
            return
        if path.startswith("/"):
            resolved = os.path.normpath(path.lstrip("/"))
        else:
            resolved = os.path.normpath(os.path.join(base, path))
        resolved = resolved.replace(os.sep, "/")
        why = self.missing("" if resolved == "." else resolved)
        if why:
            self.report(rel, line_no, target, why)

    def check_results_paths(self, rel, text):
        for line_no, line in enumerate(text.splitlines(), 1):
            for m in RESULTS_PATH.finditer(line):
                token = m.group(0)
                while token.endswith("]") and token.count("]") > token.count("["):
                    token = token[:-1]  # the end of a link's text, not a character class
                following = line[m.start() + len(token):m.start() + len(token) + 1]
                if following in PLACEHOLDER_NEXT or "..." in token:
                    continue  # a placeholder such as bench/results/<run>/, not a path
                path = token.rstrip(".").rstrip("/")  # a sentence's full stop, a folder's slash
                if GLOB_CHARS & set(path):
                    why = None if self.glob_matches(path) else "matches no file"
                else:
                    why = self.missing(path)
                if why:
                    self.report(rel, line_no, token, why)

    def glob_matches(self, pattern):
        """Whether the glob `pattern` (with one level of {a,b}) names a citable file or folder."""
        m = re.search(r"\{([^{}]*)\}", pattern)
        patterns = ([pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")]
                    if m else [pattern])
        for p in patterns:
            for hit in glob.glob(os.path.join(self.root, p)):
                if self.missing(os.path.relpath(hit, self.root).replace(os.sep, "/")) is None:
                    return True
        return False


def check(root):
    files, tracked = listed_files(root)
    checker = Checker(root, tracked)
    for rel in sorted(files):
        is_md = rel.endswith(".md")
        if rel.startswith(RESULTS + "/") and not is_md:
            continue  # result records: data, not citations
        text = read_text(root, rel)
        if text is None:
            continue
        if is_md:
            checker.check_markdown(rel, text)
        checker.check_results_paths(rel, text)
    return checker.problems, len(files)


def self_test():
    """Plant one good and one broken citation of each kind in a scratch tree (no git there).
    The fixtures spell bench/results as @R, so that this file does not cite what it plants."""
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            rel, text = rel.replace("@R", RESULTS), text.replace("@R", RESULTS)
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        write("@R/2026-01-01-h100-abc1234/run.json", "{}")
        write("docs/a.md", "\n".join([
            "[ok](../@R/2026-01-01-h100-abc1234/run.json) [web](https://example.com)",
            "[anchor](#x) [ok dir](../@R/) ![img](missing.png)",
            "`[code](not-a-link.md)`",
            "```", "[fenced](not-a-link-either.md)", "```",
            "[ref]: ../@R/gone.json",
            "see @R/2026-01-01-h100-abc1234/run.json and @R/*/*.json",
            "and @R/<run>/x.json, @R/compare-....json, @R/.",
            "globs: @R/2026-01-0[12]-*/run.json, @R/*/{run,old}.json",
            "[in link text: @R/2026-01-01-h100-abc1234/run.json](https://example.com)",
            "stale: @R/*.json, @R/2026-01-01-h100-abc1234/{a,b}.json",
        ]))
        write("src/x.cpp", "// measured: @R/2026-01-01-h100-abc1234/old.json\n"
                           "// wrapped: @R/2026-01-01-\n// h100-abc1234/run.json\n")
        write("build-x/ignored.md", "[broken](nowhere.md)")
        problems, _ = check(root)
        expected = [
            "docs/a.md:2: missing.png: does not exist",
            "docs/a.md:7: ../@R/gone.json: does not exist",
            "docs/a.md:12: @R/*.json: matches no file",
            "docs/a.md:12: @R/2026-01-01-h100-abc1234/{a,b}.json: matches no file",
            "src/x.cpp:1: @R/2026-01-01-h100-abc1234/old.json: does not exist",
            "src/x.cpp:2: @R/2026-01-01-: does not exist",
        ]
        expected = [e.replace("@R", RESULTS) for e in expected]
        if sorted(problems) != sorted(expected):
            print("doc_links self-test: expected\n  " + "\n  ".join(expected) +
                  "\ngot\n  " + "\n  ".join(problems))
            return 1
        print(f"doc_links self-test: the {len(expected)} planted breaks found, nothing else")
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the repository's root (default: this script's parent's parent)")
    ap.add_argument("--self-test", action="store_true", help="check the checker on planted breaks")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    problems, n = check(args.root)
    for p in problems:
        print(p)
    if problems:
        print(f"doc_links: {len(problems)} broken citation(s) in {n} files")
        return 1
    print(f"doc_links: every Markdown link and bench/results path resolves ({n} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

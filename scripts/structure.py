#!/usr/bin/env python3
"""Fails, listing them, on the structural problems clippy does not see in src/:
files over MAX_FILE lines outside their `#[cfg(test)] mod tests`, and import circles between
two top-level modules (A uses B when A's code names `crate::B`, `use crate::{B, ...}` groups
included; comments, strings and test modules do not count). Function length is clippy's
`too_many_lines`. Usage: scripts/structure.py [--max-file N]  (from anywhere)."""
import argparse
import os
import re
import sys

MAX_FILE = 600


def strip(code):
    """Blanks out comments, strings and char literals, keeping newlines."""
    out, i, n = [], 0, len(code)
    while i < n:
        if code.startswith("//", i):
            j = code.find("\n", i)
            i = n if j < 0 else j
            continue
        if code.startswith("/*", i):
            j = code.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif (m := re.match(r'b?r(#*)"', code[i:i + 40])) and not (i and (code[i - 1].isalnum() or code[i - 1] == "_")):
            end = '"' + m.group(1)
            j = code.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
        elif code[i] == '"':
            j = i + 1
            while j < n and code[j] != '"':
                j += 2 if code[j] == "\\" else 1
            j += 1
        elif m := (re.match(r"'(\\.|[^\\'])'", code[i:i + 4]) or re.match(r"'\\u\{[0-9a-fA-F]+\}'", code[i:i + 12])):
            j = i + m.end()
        else:
            out.append(code[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", code[i:j]))
        i = j
    return "".join(out)


def without_tests(text):
    """The text up to its test module."""
    cut = re.search(r"^\s*(#\[cfg\(test\)\]\s*)?mod tests\b", text, re.M)
    return text[:cut.start()] if cut else text


def used_modules(code):
    """The top-level modules `code` names through `crate::`, groups included."""
    used = set(re.findall(r"\bcrate::(\w+)", code))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", code):
        used.update(re.findall(r"(?:^|,)\s*(\w+)", group))
    return used


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-file", type=int, default=MAX_FILE)
    args = ap.parse_args()
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    big, uses = [], {}
    for root, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            text = open(path, encoding="utf-8").read()
            lines = without_tests(text).count("\n")
            if lines > args.max_file:
                big.append(f"src/{rel}: {lines} lines outside its tests (at most {args.max_file})")
            top = rel.split(os.sep)[0].removesuffix(".rs")
            code = without_tests(strip(text))
            used = used_modules(code)
            if os.sep not in rel:  # a top-level file's `super::` is the crate root
                used |= set(re.findall(r"\bsuper::(\w+)", code))
            uses.setdefault(top, set()).update(u for u in used if u != top)
    circles = sorted({tuple(sorted((a, b))) for a, bs in uses.items() for b in bs if a in uses.get(b, ())})
    problems = big + [f"import circle: {a} <-> {b}" for a, b in circles]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

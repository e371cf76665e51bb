#!/usr/bin/env python3
"""Check that avgpipe.h's implementation keeps its sections in dependency order: no function of a
section calls (or takes the address of) a function defined in a later section. The order held by
discipline; this makes it hold by construction (meson test 'section-order', run by CI).

Sections are the implementation's "/* --- N. Title ---" markers. A function definition is a line at
column 0 that names the function and opens its body ("{" before any ";"); its body ends at the brace
that closes it (comments, strings and character constants left out). Every identifier in a body that names a function defined in the implementation is
a use; a use of a function from a later section is an error, printed as FILE:LINE.

usage: scripts/check_order.py [HEADER]     (default: avgpipe.h beside this script's folder)
       scripts/check_order.py --self-test  (the checker finds a backward call in a made-up header)
Exit status: 0 in order, 1 a backward use (each printed), 2 usage or an unreadable header.
"""
import os
import re
import sys

SECTION = re.compile(r"^/\* --- (\d+)\. ")
IMPL = "#if defined(AVGPIPE_IMPLEMENTATION) && !defined(AVGPIPE_IMPLEMENTATION_INCLUDED)"
DEF_START = re.compile(r"^(?![#/ \t}{])[^;(]*?\b(avgpipe_\w+)\s*\(")
IDENT = re.compile(r"\b(avgpipe_\w+)\b")
TOKEN = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])+\'', re.S)


def clean(text):
    """The text with comments, strings and character constants blanked (in one left-to-right pass, so a
    "/*" inside a string is a string), line breaks kept."""
    def blank(m):
        t = m.group(0)
        return (t[0] if t[0] in "\"'" else " ") + "\n" * t.count("\n") + (t[0] if t[0] in "\"'" else "")
    return TOKEN.sub(blank, text)


def functions(lines, start):
    """(name, section, first line, body text) of every function defined after line `start`."""
    out, section, i = [], 0, start
    code = clean("".join(lines)).splitlines(True)
    while i < len(lines):
        line = code[i]
        m = SECTION.match(lines[i])
        if m:
            section = int(m.group(1))
            i += 1
            continue
        d = DEF_START.match(line)
        if d:
            j, head = i, line
            while ";" not in head and "{" not in head and j + 1 < len(lines):
                j += 1
                head += code[j]
            if "{" in head and head.index("{") < (head.index(";") if ";" in head else len(head)):
                k, depth, body = j, 0, ""
                while k < len(code): # to the brace that closes the body (one-line functions too)
                    text = code[k] if k > j else head
                    body += text
                    depth += text.count("{") - text.count("}")
                    if depth <= 0 and "{" in body:
                        break
                    k += 1
                out.append((d.group(1), section, i + 1, body[body.index("{"):]))
                i = k + 1
                continue
        i += 1
    return out


def check(path):
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        print(f"check_order: cannot read {path}: {e}", file=sys.stderr)
        return 2
    start = next((n for n, l in enumerate(lines) if l.startswith(IMPL)), None)
    if start is None:
        print(f"check_order: {path}: no implementation block ('{IMPL}')", file=sys.stderr)
        return 2
    fns = functions(lines, start)
    where = {}
    for name, sec, line, _ in fns:
        where.setdefault(name, (sec, line))
    nsections = len({sec for _, sec, _, _ in fns})
    bad = uses = 0
    for name, sec, line, body in fns:
        for callee in sorted(set(IDENT.findall(body))):
            if callee == name or callee not in where:
                continue
            uses += 1
            csec, cline = where[callee]
            if csec > sec:
                bad += 1
                print(f"{path}:{line}: {name} (section {sec}) uses {callee}, defined in the later section {csec} (line {cline})")
    verdict = "in order" if bad == 0 else f"{bad} backward uses"
    print(f"check_order: {len(fns)} functions in {nsections} sections, {uses} uses of another function: {verdict}")
    return 1 if bad else 0


def self_test():
    import tempfile
    text = (IMPL + "\n/* --- 1. Basics --- */\nstatic int avgpipe__a(void) {\n    return avgpipe__b();\n}\n"
            "/* --- 2. Later --- */\nstatic int avgpipe__b(void) {\n    return avgpipe__c(); /* avgpipe__d() */\n}\n"
            "static int\navgpipe__c(void) {\n    return 0;\n}\nstatic int avgpipe__d(void) { return 0; }\n#endif\n")
    with tempfile.NamedTemporaryFile("w", suffix=".h", delete=False) as f:
        f.write(text)
    try:
        rc = check(f.name)
    finally:
        os.unlink(f.name)
    if rc != 1:
        print(f"check_order --self-test: a made-up header with one backward call gave exit status {rc}, not 1")
        return 1
    print("check_order --self-test: the backward call was found")
    return 0


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    path = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "avgpipe.h")
    return check(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

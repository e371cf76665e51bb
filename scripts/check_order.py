#!/usr/bin/env python3
"""Check that avgpipe.h's implementation keeps its sections in dependency order: no function of a
section calls (or takes the address of) a function defined in a later section. The order held by
discipline; this makes it hold by construction (meson test 'section-order', run by CI).

Sections are the implementation's "/* --- N. Title ---" markers. A function definition is a line at
column 0 that names the function and opens its body ("{" before any ";"); its body ends at the brace
that closes it (comments, strings and character constants left out). Every identifier in a body that names a function defined in the implementation is
a use; a use of a function from a later section is an error, printed as FILE:LINE.

It also checks the sections' layout: the implementation's markers are numbered 1, 2, ... K without a gap,
the declarations carry the same K section headers ("/* N. Title") and the CONTENTS list at the top names
the same K numbers, and no section's implementation is longer than MAX_LINES lines (one subject a reader
can hold in mind: the issue that split the runtime and the tuner asked for about 800).

usage: scripts/check_order.py [HEADER]     (default: avgpipe.h beside this script's folder)
       scripts/check_order.py --self-test  (the checker finds a backward call in a made-up header)
Exit status: 0 in order, 1 a backward use or a layout problem (each printed), 2 usage or an unreadable header.
"""
import os
import re
import sys

SECTION = re.compile(r"^/\* --- (\d+)\. ")
PUBLIC = re.compile(r"^/\* (\d+)\. \S")
CONTENTS_ITEM = re.compile(r"^ {3,6}(\d+)\. \S")
MAX_LINES = 900
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


def layout(lines, start):
    """Problems with the sections' numbering and sizes, as strings (none: an empty list)."""
    problems, marks = [], [(int(m.group(1)), n) for n, l in enumerate(lines) if n >= start for m in [SECTION.match(l)] if m]
    numbers = [k for k, _ in marks]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"implementation sections numbered {numbers}, not 1..{len(numbers)}")
    public = [int(m.group(1)) for l in lines[:start] for m in [PUBLIC.match(l)] if m]
    if public != numbers:
        problems.append(f"declaration sections {public} differ from the implementation's {numbers}")
    top = lines[:next((n for n, l in enumerate(lines) if l.rstrip() == "*/"), 0)]
    listed = [int(m.group(1)) for l in top[next((n for n, l in enumerate(top) if l.strip() == "CONTENTS"), len(top)):]
              for m in [CONTENTS_ITEM.match(l)] if m]
    if listed != numbers:
        problems.append(f"CONTENTS lists sections {listed}, the implementation has {numbers}")
    ends = [n for _, n in marks[1:]] + [len(lines)]
    for (k, n), end in zip(marks, ends):
        if end - n > MAX_LINES:
            problems.append(f"line {n + 1}: section {k} is {end - n} lines, more than {MAX_LINES}: split it")
    return problems


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
    problems = layout(lines, start)
    for p in problems:
        print(f"{path}: {p}")
    sizes = [n for n, l in enumerate(lines) if n >= start and SECTION.match(l)] + [len(lines)]
    print(f"check_order: layout {'ok' if not problems else 'WRONG'}; the largest section is "
          f"{max(b - a for a, b in zip(sizes, sizes[1:]))} lines (limit {MAX_LINES})")
    return 1 if bad or problems else 0


def self_test():
    import tempfile
    text = ("/*\n   CONTENTS\n     1. Basics\n     2. Later\n*/\n/* 1. Basics */\n/* 2. Later */\n"
            + IMPL + "\n/* --- 1. Basics --- */\nstatic int avgpipe__a(void) {\n    return avgpipe__b();\n}\n"
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
    lines = ["/*\n", "   CONTENTS\n", "     1. A\n", "     2. B\n", "*/\n", "/* 1. A */\n", "/* 2. B */\n", IMPL + "\n",
             "/* --- 1. A --- */\n", "/* --- 2. B --- */\n"]
    if layout(lines, 7):
        print(f"check_order --self-test: a well-formed layout was refused: {layout(lines, 7)}")
        return 1
    cases = [(lines[:3] + lines[4:], "CONTENTS"), (lines[:6] + lines[7:], "declaration"),
             (lines[:9] + ["/* --- 3. B --- */\n"], "numbered"), (lines + ["x\n"] * (MAX_LINES + 1), "split it")]
    for bad, word in cases:
        found = layout(bad, bad.index(IMPL + "\n"))
        if not any(word in p for p in found):
            print(f"check_order --self-test: a layout problem ({word}) was not found: {found}")
            return 1
    print("check_order --self-test: the layout problems were found")
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

#!/usr/bin/env python3
"""Checks the flag tables of a Markdown page against the binary's --help.

A table sits between marker comments naming the command whose help it
documents:

    <!-- serve-flags:begin -->      kvserve serve --help
    | flag | default | ... |
    | `--grpc-address` | `127.0.0.1:50051` | ... |
    <!-- serve-flags:end -->

    <!-- global-flags:begin -->     kvserve --help

The first column lists an option's names in backticks (`-m`, `--model`), the
second its default. The check fails, naming every problem, when
  - a flag of the help is missing from the table, or the table has one the
    help lacks;
  - the help shows a default (NAME TYPE=DEFAULT) and the table's differs;
  - the help restricts the values (TYPE:{a,b}) or lists them at the end of
    its description ("...: a, b, c") and the table's row leaves one out.
--help itself is not documented.

Usage: check_flag_tables.py BINARY DOC.md
"""

import os
import re
import subprocess
import sys

# Marker name -> arguments that print the help the table documents.
COMMANDS = {
    "serve-flags": ["serve", "--help"],
    "global-flags": ["--help"],
}
IGNORED = {"-h", "--help"}

# An option line of CLI11's help: two spaces, names joined by commas (a
# negated flag may carry {false}), then an optional TYPE[:{choices}][=DEFAULT].
OPTION_LINE = re.compile(
    r"^  (?P<names>-[^\s]+)"
    r"(?:\s+(?P<type>[A-Z]+)(?::\{(?P<choices>[^}]*)\})?(?:=(?P<default>\S+))?(?=\s|$))?"
    r"(?P<rest>.*)$")
# A description ending in a plain list of values: "KV storage: f32, f16, bf16".
VALUE_LIST = re.compile(r":\s+([\w.-]+(?:,\s*[\w.-]+)+)\s*$")


def parse_help(text):
    """Returns [{names, default, values}] for the options of a help text."""
    options = []
    lines = text.splitlines()
    in_options = False
    for i, line in enumerate(lines):
        if line.strip() == "Options:":
            in_options = True
            continue
        if in_options and line and not line.startswith(" "):
            in_options = False  # "Subcommands:" and the like
        if not in_options:
            continue
        m = OPTION_LINE.match(line)
        if not m:
            continue
        names = [re.sub(r"\{.*\}$", "", n) for n in m.group("names").split(",") if n]
        values = []
        if m.group("choices"):
            values = [v.strip() for v in m.group("choices").split(",") if v.strip()]
        # The description is on the same line after padding, or on the next
        # line, indented further.
        description = m.group("rest").strip()
        if i + 1 < len(lines) and re.match(r"^\s{6,}\S", lines[i + 1]) and \
                not lines[i + 1].lstrip().startswith("-"):
            description = (description + " " + lines[i + 1].strip()).strip()
        description = re.sub(r"\(Env:[^)]*\)", "", description).strip()
        listed = VALUE_LIST.search(description)
        if listed and not values:
            values = [v.strip() for v in listed.group(1).split(",")]
        options.append({"names": names, "default": m.group("default"), "values": values})
    return options


def parse_table(doc, marker):
    """Returns [{names, default, row, line}] for the rows between the markers."""
    begin = f"<!-- {marker}:begin -->"
    end = f"<!-- {marker}:end -->"
    lines = doc.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == begin)
        stop = next(i for i, l in enumerate(lines) if l.strip() == end and i > start)
    except StopIteration:
        return None
    rows = []
    for n in range(start + 1, stop):
        line = lines[n].strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 2 or re.fullmatch(r"[-: ]+", cells[0]) or cells[0] == "flag":
            continue
        names = re.findall(r"`(-[^`\s]+)`", cells[0])
        default = cells[1]
        code = re.fullmatch(r"`([^`]*)`", default)
        rows.append({"names": names, "default": code.group(1) if code else default,
                     "row": line, "line": n + 1})
    return rows


def check(binary, doc_path):
    doc = open(doc_path, encoding="utf-8").read()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    problems = []
    tables = 0
    for marker, args in COMMANDS.items():
        rows = parse_table(doc, marker)
        if rows is None:
            continue
        tables += 1
        command = " ".join(["kvserve"] + args)
        result = subprocess.run([binary] + args, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            problems.append(f"{command} exited {result.returncode}: {result.stderr.strip()}")
            continue
        options = parse_help(result.stdout)
        if not options:
            problems.append(f"{command}: no options found in its help (format changed?)")
            continue
        help_by_name = {}
        for opt in options:
            for name in opt["names"]:
                help_by_name[name] = opt
        doc_by_name = {}
        for row in rows:
            if not row["names"]:
                problems.append(f"{doc_path}:{row['line']}: [{marker}] row names no flag: {row['row']}")
            for name in row["names"]:
                if name in doc_by_name:
                    problems.append(f"{doc_path}:{row['line']}: [{marker}] {name} listed twice")
                doc_by_name[name] = row
        for name in sorted(set(help_by_name) - set(doc_by_name) - IGNORED):
            problems.append(f"[{marker}] {name}: in `{command}` but missing from the table in {doc_path}")
        for name in sorted(set(doc_by_name) - set(help_by_name) - IGNORED):
            problems.append(f"[{marker}] {name}: in the table in {doc_path} "
                            f"(line {doc_by_name[name]['line']}) but not in `{command}`")
        for name in sorted(set(doc_by_name) & set(help_by_name)):
            opt, row = help_by_name[name], doc_by_name[name]
            if opt["default"] is not None and row["default"] != opt["default"]:
                problems.append(f"{doc_path}:{row['line']}: [{marker}] {name}: default "
                                f"'{row['default']}' in the table, '{opt['default']}' in `{command}`")
            missing = [v for v in opt["values"] if f"`{v}`" not in row["row"]]
            if missing:
                problems.append(f"{doc_path}:{row['line']}: [{marker}] {name}: the row does not list "
                                f"{', '.join('`' + v + '`' for v in missing)} (accepted by `{command}`)")
    if tables == 0:
        problems.append(f"{doc_path}: no flag table markers found ({', '.join(COMMANDS)})")
    return problems, tables


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    problems, tables = check(sys.argv[1], sys.argv[2])
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"{len(problems)} problem(s): update the flag tables in {sys.argv[2]} "
              f"to match the binary's --help.")
        return 1
    print(f"OK: {tables} flag table(s) in {sys.argv[2]} match the binary's --help")
    return 0


if __name__ == "__main__":
    sys.exit(main())

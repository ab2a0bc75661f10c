#!/usr/bin/env python3
"""Every citation of bench/NOTES.md names a record that exists.

Code and docs cite a decision record by its heading: `bench/NOTES.md,
"Title"` (also `NOTES.md ("Title")` and `[NOTES.md, "Title"](...)`), or link
to it by anchor (`NOTES.md#title`). This fails when a cited heading or anchor
is not a heading of bench/NOTES.md, and when anything cites a version number
("NOTES.md v7"), the form the records replaced.

  tests/notes_citations_test.py SOURCE_DIR
  tests/notes_citations_test.py SOURCE_DIR --self-test   (must find planted faults)
"""
import os
import re
import sys

EXTENSIONS = (".cc", ".h", ".cu", ".cuh", ".py", ".sh", ".md", ".txt", ".cmake", ".proto")
# The records themselves, and this check (its planted faults).
SKIP_FILES = {os.path.join("bench", "NOTES.md"), os.path.join("tests", "notes_citations_test.py")}
SKIP_DIRS = {".git", "build", "build-sanitize", "results", "node_modules", ".device"}
# A title in double quotes after NOTES.md, allowing `, ( [ ] and a line break.
TITLE = re.compile(r'NOTES\.md`?\]?,?\s*\(?\s*"([^"]{1,120})"')
ANCHOR = re.compile(r"NOTES\.md#([A-Za-z0-9_-]+)")
VERSION = re.compile(r"NOTES(?:\.md)?`?,?\s+v\d")
# Comment markers at the start of a continued line: joined away so that a
# title wrapped over two comment lines still reads as one.
CONTINUATION = re.compile(r"\s*\n\s*(?://+|#+|\*+|>)?\s*")


def slug(heading):
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(notes_path):
    titles = set()
    with open(notes_path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"#+\s+(.*\S)\s*$", line)
            if m:
                titles.add(m.group(1))
    return titles


def check_text(name, text, titles, anchors):
    faults = []
    joined = CONTINUATION.sub(" ", text)
    for m in TITLE.finditer(joined):
        if m.group(1) not in titles:
            faults.append(f'{name}: cites bench/NOTES.md, "{m.group(1)}": no such heading')
    for m in ANCHOR.finditer(text):
        if m.group(1) not in anchors:
            faults.append(f"{name}: links NOTES.md#{m.group(1)}: no such heading")
    for m in VERSION.finditer(joined):
        faults.append(f"{name}: cites a NOTES version ({m.group(0)!r}); cite a record's heading")
    return faults


def sources(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build")]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            rel = os.path.relpath(path, root)
            if rel in SKIP_FILES or not filename.endswith(EXTENSIONS):
                continue
            yield rel, path


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    root = sys.argv[1]
    notes = os.path.join(root, "bench", "NOTES.md")
    titles = headings(notes)
    if not titles:
        print(f"FAIL: no headings read from {notes}")
        return 1
    anchors = {slug(t) for t in titles}

    if "--self-test" in sys.argv[2:]:
        title = sorted(titles)[0]
        planted = {
            "a missing heading": '// bench/NOTES.md, "No such record here").',
            "a wrapped missing heading": '// (bench/NOTES.md, "No such\n// record").',
            "a missing anchor": "[x](NOTES.md#no-such-record)",
            "a version": "// bench/NOTES.md v7",
        }
        ok = check_text("good", f'// bench/NOTES.md, "{title}"', titles, anchors) == []
        ok = ok and check_text("good", f"[x](NOTES.md#{slug(title)})", titles, anchors) == []
        for what, text in planted.items():
            found = check_text("planted", text, titles, anchors)
            print(f"{'found' if found else 'MISSED'}: {what}")
            ok = ok and bool(found)
        print("planted faults found" if ok else "FAIL: the check misses planted faults")
        return 0 if ok else 1

    faults, cited = [], 0
    for rel, path in sources(root):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if "NOTES" not in text:
            continue
        cited += 1
        faults += check_text(rel, text, titles, anchors)
    for fault in faults:
        print("FAIL:", fault)
    if faults:
        return 1
    print(f"ok: {cited} files cite bench/NOTES.md; every cited heading of its {len(titles)} exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())

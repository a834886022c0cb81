#!/usr/bin/env python3
"""design_modules.py — docs/DESIGN.md's module table (§1) names exactly the project's folders.

The table is the first markdown table under the heading "## 1." whose header row starts with
"| folder |"; each row's first cell names one folder in backticks (`kernels/cpu/`). The folders
the project has, and the table must list, are:
  * every top-level folder (source or not: slurm/, scripts/, docs/ hold no C; each is a row),
  * every module folder of CMakeLists.txt's K3_MODULES (kernels/ref, kernels/cpu, ...),
  * every deeper folder that holds C, C++ or CUDA sources (.c .h .cu .cuh .cpp) itself:
    kernels/cuda, kernels/cuda/emu, comm/nccl_emu — except under tests/, which is one row.
Folders come from git (tracked + untracked, not ignored) when ROOT is a git work tree, else from a
walk that skips hidden folders and the ignored ones of .gitignore's top level (build*, ...).
A folder without sources below the top level (tiny/data/) is not a row.

Usage: design_modules.py [ROOT]              exit 0 = the table matches, 1 = a folder missing
                                             from it or listed but absent (each named), 2 = usage
       design_modules.py --self-test [ROOT]  feeds the checker tables with a folder left out and
                                             one made up, and checks that it names both and fails
                                             (the checker seen to fail, STYLE.md §18)
"""
import os
import re
import subprocess
import sys

SOURCE_EXT = (".c", ".h", ".cu", ".cuh", ".cpp")
ONE_ROW = ("tests",)  # top-level folders whose sub-folders are not rows of their own
SKIP_TOP = re.compile(r"^(build.*|tiny-model|__pycache__)$")  # ignored by .gitignore


def repo_files(root):
    """Relative paths of the project's files (git: tracked + untracked, not ignored)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True).stdout
        files = [f for f in out.decode("utf-8", "replace").split("\0") if f]
        return [f for f in files if os.path.exists(os.path.join(root, f))]
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (
            rel == "." and SKIP_TOP.match(d)) and d != "__pycache__")
        files += [os.path.normpath(os.path.join(rel, n)) for n in names]
    return files


def k3_modules(root):
    """The folders of CMakeLists.txt's set(K3_MODULES ...)."""
    with open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"set\(\s*K3_MODULES\s+([^)]*)\)", f.read())
    return m.group(1).split() if m else None


def project_folders(root):
    folders = set()
    for f in repo_files(root):
        parts = f.split("/")
        if len(parts) < 2 or parts[0].startswith("."):
            continue
        folders.add(parts[0])
        if len(parts) > 2 and parts[0] not in ONE_ROW and f.endswith(SOURCE_EXT):
            folders.add("/".join(parts[:-1]))
    return folders


def table_folders(text):
    """Folder names of the module table, or (None, why)."""
    m = re.search(r"^## 1\..*$", text, re.M)
    if not m:
        return None, "no section '## 1.'"
    rest = text[m.end():]
    end = re.search(r"^## ", rest, re.M)
    section = rest[:end.start()] if end else rest
    lines = section.split("\n")
    start = next((i for i, ln in enumerate(lines) if re.match(r"^\|\s*folder\s*\|", ln)), None)
    if start is None:
        return None, "no table with a '| folder |' header in section 1"
    names = []
    for ln in lines[start + 2:]:  # after the header and the |---| line
        if not ln.startswith("|"):
            break
        cell = ln.split("|")[1]
        b = re.fullmatch(r"\s*`([^`]+)`\s*", cell)
        if not b:
            return None, f"a row whose first cell is not one `folder/`: {cell.strip()!r}"
        names.append(b.group(1).strip().rstrip("/"))
    return names, None


def check(root, text, out=print):
    names, why = table_folders(text)
    if names is None:
        out(f"design_modules: docs/DESIGN.md: {why}")
        return 1
    mods = k3_modules(root)
    if mods is None:
        out("design_modules: CMakeLists.txt has no set(K3_MODULES ...)")
        return 1
    want = project_folders(root) | set(mods)
    have = set(names)
    bad = 0
    for n in sorted({n for n in names if names.count(n) > 1}):
        out(f"design_modules: `{n}/` is listed more than once in the module table")
        bad += 1
    for n in sorted(want - have):
        out(f"design_modules: folder {n}/ is missing from docs/DESIGN.md's module table")
        bad += 1
    for n in sorted(have - want):
        out(f"design_modules: docs/DESIGN.md's module table lists {n}/, which is not a folder "
            "of the project (no such folder, or one without sources below the top level)")
        bad += 1
    out(f"design_modules: {len(have)} folders in the table, {len(want)} in the project, "
        f"{bad} mismatch{'es' if bad != 1 else ''}")
    return 1 if bad else 0


def self_test(root, text):
    names, why = table_folders(text)
    if names is None or len(names) < 2:
        print(f"design_modules self-test: cannot read the table ({why})")
        return 1
    if check(root, text, out=lambda s: None) != 0:
        print("design_modules self-test: the real table does not match; fix that first")
        return 1
    victim = "kernels/cpu" if "kernels/cpu" in names else names[1]
    lines = text.split("\n")
    row = next(i for i, ln in enumerate(lines) if ln.startswith(f"| `{victim}/` |"))
    # one folder left out, one made up (inserted where the left-out row was)
    fake = lines[:row] + ["| `nosuch/` | a folder that does not exist | |"] + lines[row + 1:]
    report = []
    rc = check(root, "\n".join(fake), out=report.append)
    got = "\n".join(report)
    ok = True
    for want in (f"folder {victim}/ is missing", "lists nosuch/"):
        if rc == 1 and want in got:
            print(f"ok   caught: {want}")
        else:
            print(f"FAIL not caught: {want} (rc={rc}):\n{got}")
            ok = False
    # a table the checker cannot read fails too
    rc = check(root, text.replace("| folder |", "| dir |", 1), out=report.append)
    print(f"{'ok  ' if rc == 1 else 'FAIL'} a module table without its header fails (rc={rc})")
    ok &= rc == 1
    print(f"design_modules self-test: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv):
    args = argv[1:]
    test = bool(args) and args[0] == "--self-test"
    if test:
        args = args[1:]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: design_modules.py [--self-test] [ROOT]", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(args[0] if args else os.environ.get("K3_SRC",
                                                               os.path.join(here, "..", "..")))
    path = os.path.join(root, "docs", "DESIGN.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        print(f"design_modules: {path}: {e.strerror}", file=sys.stderr)
        return 2
    return self_test(root, text) if test else check(root, text)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
